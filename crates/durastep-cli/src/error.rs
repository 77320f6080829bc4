//! The CLI's errors and the exit code each one maps to.
//!
//! Exit codes: 0 success, 1 anything the user can fix (a bad argument, an
//! unknown run, a run that cannot be replayed, a missing schema), 2 the
//! database could not be reached. Every message is one line on stderr.

use std::process::ExitCode;

/// Something went wrong; `main` prints it as one line and exits with [`CliError::exit_code`].
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The URL does not parse.
    #[error("invalid database URL {url}: {reason}")]
    InvalidUrl {
        /// The URL, password hidden.
        url: String,
        /// What the parser said.
        reason: String,
    },
    /// The database did not answer (refused, timed out, authentication failed).
    #[error("database unreachable at {url}: {reason}")]
    Unreachable {
        /// The URL, password hidden.
        url: String,
        /// What the connection attempt said.
        reason: String,
    },
    /// The database answers but has no (or an older) `durastep` schema.
    #[error("the durastep schema in {url} is missing or older than this CLI: run `durastep migrate` ({reason})")]
    NotMigrated {
        /// The URL, password hidden.
        url: String,
        /// The database's error.
        reason: String,
    },
    /// A bad combination of arguments the parser cannot catch by itself.
    #[error("{0}")]
    Usage(String),
    /// The engine refused or failed an operation.
    #[error(transparent)]
    Engine(#[from] durastep::Error),
    /// Reading input or writing output failed.
    #[error("{0}")]
    Io(String),
    /// `durastep dev` found no Postgres to use and none to start.
    #[error(transparent)]
    LocalPg(#[from] durastep_localpg::Error),
    /// The dashboard could not start (or stopped with an error).
    #[error(transparent)]
    Dashboard(#[from] durastep_dashboard::DashboardError),
}

/// Postgres error codes that mean "the schema is not there (or is older)":
/// undefined table, undefined column, undefined function, invalid schema name.
const SCHEMA_MISSING: [&str; 4] = ["42P01", "42703", "42883", "3F000"];

impl CliError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> ExitCode {
        match self {
            CliError::Unreachable { .. } | CliError::Engine(durastep::Error::Unavailable(_)) => ExitCode::from(2),
            _ => ExitCode::from(1),
        }
    }

    /// A short name of the kind of error, for `--json` output.
    pub fn kind(&self) -> &'static str {
        match self {
            CliError::InvalidUrl { .. } => "invalid_url",
            CliError::Unreachable { .. } => "unreachable",
            CliError::NotMigrated { .. } => "not_migrated",
            CliError::Usage(_) => "usage",
            CliError::Engine(durastep::Error::UnknownRun(_)) => "unknown_run",
            CliError::Engine(durastep::Error::NotReplayable { .. }) => "not_replayable",
            CliError::Engine(durastep::Error::RunFinished { .. }) => "run_finished",
            CliError::Engine(durastep::Error::NotDiverged { .. }) => "not_diverged",
            CliError::Engine(durastep::Error::InvalidFilter(_)) => "invalid_filter",
            CliError::Engine(_) => "engine",
            CliError::Io(_) => "io",
            CliError::Dashboard(_) => "dashboard",
            CliError::LocalPg(_) => "local_postgres",
        }
    }

    /// Turns the engine's connection and schema errors into ones that name the
    /// database (password hidden).
    pub fn at(self, url: &str) -> CliError {
        match self {
            CliError::Engine(durastep::Error::Unavailable(sqlx::Error::Configuration(e))) => {
                CliError::InvalidUrl { url: url.to_owned(), reason: e.to_string() }
            }
            CliError::Engine(durastep::Error::Unavailable(e)) => {
                CliError::Unreachable { url: url.to_owned(), reason: e.to_string() }
            }
            CliError::Engine(durastep::Error::Database(e)) if schema_missing(&e) => {
                CliError::NotMigrated { url: url.to_owned(), reason: e.to_string() }
            }
            other => other,
        }
    }
}

fn schema_missing(e: &sqlx::Error) -> bool {
    e.as_database_error().and_then(|db| db.code()).is_some_and(|code| SCHEMA_MISSING.contains(&code.as_ref()))
}
