//! Support for Durastep's benchmarks (`cargo bench -p durastep-benches`).
//!
//! Every bench is a plain `main` (no harness) that creates its own database on
//! `DATABASE_URL`, measures, prints Markdown tables and drops the database. The
//! figures and what they mean are in `docs/performance.md`.
//!
//! - [`db`]: a fresh database per bench, dropped at the end.
//! - [`raw`]: raw Postgres baselines with plain sqlx on the same connection
//!   settings (single-row commits, group-commit inserts, SKIP LOCKED claims).
//! - [`functions`]: the no-op functions every bench process registers.
//! - [`knobs`]: the environment variables that change what a bench measures.
//! - [`process`]: worker processes of the `bench-worker` binary.
//! - [`report`]: Markdown tables, rates, medians, RSS.

pub mod db;
pub mod functions;
pub mod knobs;
pub mod process;
pub mod raw;
pub mod report;
