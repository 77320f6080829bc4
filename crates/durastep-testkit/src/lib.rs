//! # durastep-testkit: Durastep's promises, tested across real processes
//!
//! In-process tests cannot kill a worker the way production does. This crate
//! runs real worker processes (the `durastep-test-worker` binary) against a
//! test's own Postgres database, and gives a test the controls and the
//! evidence it needs:
//!
//! - **Workers**: [`Cluster::spawn`] starts a worker process and waits for its
//!   "ready" line; [`WorkerProcess`] sends SIGKILL ([`WorkerProcess::kill`]),
//!   SIGSTOP/SIGCONT ([`WorkerProcess::pause`], [`WorkerProcess::resume`]) and
//!   SIGTERM ([`WorkerProcess::terminate`]); [`Cluster::restart`] replaces a
//!   worker by a fresh process. Failpoints go in [`WorkerConfig::failpoints`]
//!   (the `DURASTEP_FAILPOINTS` syntax of `durastep::failpoints`), or are set
//!   in a live process with [`WorkerProcess::set_failpoint`] (over its stdin);
//!   [`WorkerProcess::failpoint_fired`] counts the firings.
//! - **Test functions** ([`functions`]): `five-steps`, `slow-step`,
//!   `sleeper` (a step, a durable sleep, a step) and `mixed` (a step, a
//!   `step_tx`, a durable sleep, a step), the flow functions (concurrency,
//!   throttle, rate limit and back-pressure per account), whose
//!   outputs are deterministic functions of their input (the oracles), and
//!   whose step bodies record each execution in the **ledger**.
//! - **Ledger** ([`ledger`]): one row per execution of a step body, written on
//!   its own connection, outside the checkpoint: what the outside world saw.
//! - **Checks** ([`checks`]) over `durastep.runs` / `durastep.step_results`,
//!   and **waiting** on conditions with deadlines ([`wait_for`]).
//! - **Network faults** ([`proxy`]): a TCP proxy between workers and Postgres
//!   (pass, reset every socket, black-hole, added latency, one listener per
//!   worker to cut one alone, and a cut right after a commit's reply).
//! - **A throwaway Postgres** ([`pg::TempPostgres`]): its own cluster on a
//!   free port, for tests that restart or crash the server.
//! - **Tiers and seeds** ([`tier`]): `DURASTEP_SOAK=1` scales a suite up;
//!   randomized tests print their seed and replay `DURASTEP_SEED`.
//! - **A randomized workload against a model** ([`workload`]): seeded random
//!   programs over every primitive and flow rule (interpreted from the event
//!   payload, so the worker binary runs them with `--workload`), operator
//!   actions and faults over time, and an oracle over the database afterwards
//!   ([`checks::workload`]).
//!
//! ```no_run
//! use durastep_testkit::{Cluster, FiveSteps, WorkerConfig, checks, ledger};
//! use std::time::Duration;
//!
//! # async fn demo(url: String) -> durastep_testkit::Result<()> {
//! // In this crate's tests: env!("CARGO_BIN_EXE_durastep-test-worker").
//! let mut cluster = Cluster::start("target/debug/durastep-test-worker", url).await?;
//! let runs = cluster.send_five_steps([FiveSteps::new(5)]).await?;
//! // This worker exits (as if SIGKILLed) right after its second checkpoint.
//! let a = cluster.spawn(WorkerConfig::default().failpoints("step-after-checkpoint=2*exit")).await?;
//! cluster.worker(a).wait_exit(Duration::from_secs(20)).await?;
//! cluster.spawn(WorkerConfig::default()).await?;
//! cluster.wait_finished(&runs, Duration::from_secs(20)).await?;
//! assert!(checks::five_steps_mismatches(cluster.pool()).await?.is_empty());
//! assert_eq!(ledger::summary(cluster.pool()).await?.max_per_step, 1);
//! # Ok(()) }
//! ```
//!
//! In a test, the database comes from `#[sqlx::test(migrations = false)]`
//! and [`url_of`] turns its options into the URL the worker processes use.
//! Each worker opens at most [`WorkerConfig::connections`] connections.
//!
//! ## Notes for fault-injection suites
//!
//! - **Ordering, not sleeping.** Freeze a worker with [`WorkerProcess::pause`]
//!   and move the database clock with [`Cluster::advance_clock`] to expire its
//!   lease, then [`WorkerProcess::resume`] it once the next event you want to
//!   race with has happened (watch the ledger with [`wait_for`]). On resume, a
//!   stopped process's overdue timers (step sleeps, heartbeat ticks) fire
//!   together, in no fixed order: give the worker a long lease and heartbeat
//!   when a test needs one path deterministically.
//! - **Failpoint hit counts are per process** (`2*exit` is the second hit in
//!   that process, over all its runs). `heartbeat=error` skips the whole
//!   heartbeat round, including the worker's own-clock lease check, so it
//!   models a stuck heartbeat loop rather than a failing heartbeat statement.
//! - **The ledger commits asynchronously** by default ([`LedgerOptions`]):
//!   rows are visible at once, but a Postgres crash can lose the last ones.
//!   Set [`WorkerConfig::ledger_synchronous_commit`] when crashing Postgres.
//!   A ledger write is itself a database call: a broken connection can fail a
//!   step body, which then runs again (one more ledger row).
//! - **Logs.** Each worker's stderr (the engine's tracing, `RUST_LOG`, default
//!   `warn,durastep=info`) is a file; [`WorkerProcess::wait_for_log`] waits on
//!   it. A failing test prints every worker's log tail and keeps the files;
//!   set [`KEEP_LOGS`] to keep them for passing tests too.
//! - **No orphans.** Dropping a [`Cluster`] or [`WorkerProcess`] kills the
//!   process, and a worker exits by itself when the test process dies (its
//!   stdin, a pipe from the harness, closes).

pub mod checks;
mod cluster;
mod error;
pub mod functions;
pub mod ledger;
pub mod pg;
pub mod process;
pub mod proxy;
pub mod tier;
mod wait;
pub mod workload;

pub use cluster::{Cluster, KEEP_LOGS, READY_TIMEOUT};
pub use error::{Error, Result};
pub use functions::{
    BackpressureInput, FiveSteps, FlowInput, FunctionSettings, Mixed, Sleeper, SlowStep, five_steps_key,
    five_steps_oracle, five_steps_step_output, mixed_oracle, sleeper_oracle, slow_step_oracle,
};
pub use ledger::{Ledger, LedgerOptions};
pub use process::{Signal, WorkerConfig, WorkerProcess};
pub use wait::{POLL, wait_for};

/// The URL of a test's own database, for worker processes (user, host, port
/// and database of the options; this machine's Postgres uses trust auth, so no
/// password is carried).
///
/// ```
/// let opts: sqlx::postgres::PgConnectOptions = "postgres://postgres@127.0.0.1:5432/t1".parse().unwrap();
/// assert_eq!(durastep_testkit::url_of(&opts), "postgres://postgres@127.0.0.1:5432/t1");
/// ```
pub fn url_of(opts: &sqlx::postgres::PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("postgres")
    )
}
