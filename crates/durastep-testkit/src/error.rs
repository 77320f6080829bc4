//! The harness's one error type.

use std::time::Duration;

/// What can go wrong while driving worker processes and checking the database.
///
/// ```
/// let e = durastep_testkit::Error::Timeout { what: "run completed".into(), after: std::time::Duration::from_secs(1) };
/// assert!(e.to_string().contains("run completed"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A query of the harness failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A throwaway Postgres cluster could not be started, restarted or stopped.
    #[error("throwaway postgres: {0}")]
    Postgres(#[from] durastep_localpg::Error),
    /// The engine refused something (building it, sending an event).
    #[error("durastep: {0}")]
    Durastep(#[from] durastep::Error),
    /// Spawning, signalling or reading the logs of a process failed.
    #[error("{context}: {source}")]
    Io {
        /// What the harness was doing.
        context: String,
        /// The cause.
        source: std::io::Error,
    },
    /// A condition did not hold before its deadline.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// The condition, in words.
        what: String,
        /// How long the harness waited.
        after: Duration,
    },
    /// A worker process ended while the harness expected it to run.
    #[error("worker {label} (pid {pid}) exited with {status} while {doing}; its log ends with:\n{log_tail}")]
    WorkerExited {
        /// The worker's label.
        label: String,
        /// Its process id.
        pid: u32,
        /// How it ended.
        status: String,
        /// What the harness was waiting for.
        doing: String,
        /// The last lines of its stderr.
        log_tail: String,
    },
    /// Something the harness relies on did not hold (an event that started no run, ...).
    #[error("{0}")]
    Unexpected(String),
    /// The worker has already been reaped: signalling its old pid could hit another process.
    #[error("worker {label} (pid {pid}) is not running")]
    NotRunning {
        /// The worker's label.
        label: String,
        /// Its (former) process id.
        pid: u32,
    },
}

/// The harness's result type.
///
/// ```
/// fn f() -> durastep_testkit::Result<u8> { Ok(1) }
/// assert_eq!(f().unwrap(), 1);
/// ```
pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}
