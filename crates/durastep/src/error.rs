//! Errors of the engine's own operations (building, migrating, sending, running workers).
//!
//! Failures of user code are [`crate::HandlerError`]s and end up on the run,
//! never here.

use crate::limits::LimitError;

/// An error from an engine operation.
///
/// Every `sqlx::Error` becomes one of [`Error::Unavailable`] (worth retrying),
/// [`Error::Config`] (fix the settings: retrying cannot help) or
/// [`Error::Database`], through the one `From<sqlx::Error>`; messages carry
/// the server's text without its source-file line.
///
/// ```
/// # async fn demo() {
/// let err = durastep::Engine::builder()
///     .database_url("postgres://nobody@127.0.0.1:1/none")
///     .build()
///     .await
///     .unwrap_err();
/// assert!(matches!(err, durastep::Error::Unavailable(_)));
/// assert!(err.is_transient());
///
/// let err = durastep::Engine::builder().database_url("not a url").build().await.unwrap_err();
/// assert!(matches!(err, durastep::Error::Config(_)));
/// assert!(!err.is_transient());
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The database could not be reached (at startup, or on a call): a
    /// refused or reset connection, a timeout, a server shutting down.
    #[error("database unreachable: {}", describe(.0))]
    Unavailable(sqlx::Error),
    /// The connection settings are wrong: a malformed URL, a database or role
    /// that does not exist, a refused password. Retrying cannot help.
    #[error("database configuration: {}", describe(.0))]
    Config(sqlx::Error),
    /// A database error other than unreachability or configuration.
    #[error("database error: {}", describe(.0))]
    Database(sqlx::Error),
    /// Applying the schema migrations failed.
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A payload or name was refused before anything was written.
    #[error(transparent)]
    Limit(#[from] LimitError),
    /// A function definition is invalid (two functions with one id, no handler, ...).
    #[error("invalid function definition: {0}")]
    InvalidFunction(String),
    /// The builder was not given a database.
    #[error("no database configured: call database_url() or pool()")]
    NoDatabase,
    /// No run has this id.
    #[error("no run with id {0}")]
    UnknownRun(uuid::Uuid),
    /// An event lacks (or has null at) the key a function's flow control needs:
    /// nothing was written.
    #[error("function {function} needs the key {key} in the event data; it is missing or null (nothing was sent)")]
    MissingKey {
        /// The function whose concurrency, throttle, rate limit, back-pressure,
        /// debounce or singleton key is missing.
        function: String,
        /// The JSON pointer of the key.
        key: String,
    },
    /// The run has already finished (completed, failed or cancelled); it was left as it was.
    #[error("run {run_id} has already finished ({state:?})")]
    RunFinished {
        /// The run.
        run_id: uuid::Uuid,
        /// The state it finished in.
        state: crate::RunState,
    },
    /// A run cannot be replayed (it is not failed or cancelled, or another run
    /// holds its singleton key); it was left as it was.
    #[error("run {run_id} cannot be replayed: {reason}")]
    NotReplayable {
        /// The run.
        run_id: uuid::Uuid,
        /// Why.
        reason: String,
    },
    /// A run's stored output does not open with the engine's keyring
    /// (tampered, moved, plaintext with encryption on, or an unknown key id).
    #[error("run {run_id}: stored output cannot be opened: {error}")]
    Codec {
        /// The run.
        run_id: uuid::Uuid,
        /// Why it does not open.
        error: crate::CodecError,
    },
    /// An inspection filter is invalid (a bad key path, page size or cursor).
    #[error("invalid filter: {0}")]
    InvalidFilter(String),
    /// The run is not `diverged`, so it cannot be resumed or discarded from a
    /// position; it was left as it was.
    #[error("run {run_id} is not diverged (it is {state})")]
    NotDiverged {
        /// The run.
        run_id: uuid::Uuid,
        /// Its state.
        state: crate::RunState,
    },
}

impl Error {
    /// Whether the error is a transient database failure worth retrying.
    ///
    /// ```
    /// assert!(!durastep::Error::NoDatabase.is_transient());
    /// ```
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Unavailable(_) => true,
            Error::Database(e) => is_transient_sqlx(e),
            _ => false,
        }
    }
}

/// Connection-level failures (refused, reset, pool timed out, server shutting down).
pub(crate) fn is_transient_sqlx(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => true,
        sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            // 08* connection exceptions, 57P0x admin/crash shutdown, 40001/40P01 retryable.
            let code = db.code();
            let code = code.as_deref().unwrap_or("");
            code.starts_with("08") || code.starts_with("57P") || code == "40001" || code == "40P01"
        }
        _ => false,
    }
}

/// A sqlx error's text without the server's source-file line (`... at line 123`),
/// with the SQLSTATE for a database error.
pub(crate) fn describe(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Database(db) => match db.code() {
            Some(code) => format!("{} (SQLSTATE {code})", db.message()),
            None => db.message().to_owned(),
        },
        other => other.to_string(),
    }
}

impl From<crate::ParseRunStateError> for Error {
    /// A state name that is none: [`Error::InvalidFilter`], with the states listed.
    fn from(e: crate::ParseRunStateError) -> Self {
        Error::InvalidFilter(e.to_string())
    }
}

impl From<sqlx::Error> for Error {
    /// Classifies: unreachable, configuration, missing flow key, or other.
    fn from(e: sqlx::Error) -> Self {
        from_sqlx(e)
    }
}

/// SQLSTATEs of a connection refused for its settings: 3D000 no such
/// database, 28000 no such role (or not allowed by pg_hba), 28P01 wrong password.
fn is_config_code(code: &str) -> bool {
    matches!(code, "3D000" | "28000" | "28P01")
}

/// Maps a sqlx error to [`Error`], telling unreachability and configuration apart.
pub(crate) fn from_sqlx(e: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &e
        && db.code().as_deref() == Some("DSK01")
    {
        // Raised by durastep.flow_key at send; DETAIL is {"function": ..., "key": ...}.
        let detail = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>().and_then(|pg| pg.detail());
        let parsed: Option<serde_json::Value> = detail.and_then(|d| serde_json::from_str(d).ok());
        let field = |k: &str| parsed.as_ref().and_then(|v| v.get(k)).and_then(|v| v.as_str()).unwrap_or("?").to_owned();
        return Error::MissingKey { function: field("function"), key: field("key") };
    }
    match &e {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Tls(_) => Error::Unavailable(e),
        sqlx::Error::Configuration(_) => Error::Config(e),
        sqlx::Error::Database(db) if db.code().as_deref().is_some_and(is_config_code) => Error::Config(e),
        _ => Error::Database(e),
    }
}
