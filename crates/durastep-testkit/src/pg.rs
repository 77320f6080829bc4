//! A throwaway Postgres cluster of a test's own, for tests that restart or
//! crash the server (the shared server on 5432 serves every other test).
//!
//! The cluster is `durastep-localpg`'s [`TempPostgres`], the same one the
//! quickstart, the examples and `durastep dev` fall back to: `initdb` into a
//! fresh directory under the system temp dir, `pg_ctl start` on a free port
//! (127.0.0.1 only, trust auth, user `postgres`), with the installed server
//! binaries ([`PG_BIN_ENV`], else `PATH`, `pg_config`, `/usr/lib/postgresql/*/bin`).
//! As root, every command runs as the `postgres` OS user. Dropping the
//! handle stops the server (`-m immediate`) and removes the directory.
//!
//! ```no_run
//! # async fn demo() -> durastep_localpg::Result<()> {
//! use durastep_testkit::pg::{StopMode, TempPostgres};
//! let pg = TempPostgres::start().await?;
//! println!("{}", pg.url("postgres"));
//! let took = pg.restart(StopMode::Immediate).await?;
//! println!("back after {took:?}");
//! # Ok(()) }
//! ```

pub use durastep_localpg::{PG_BIN_ENV, StartOptions, StopMode, TempPostgres};
