//! A run as the API shows it ([`Run`]) and its state ([`RunState`]), a
//! type read from the database, never a string with a fallback.

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

/// The state of a run.
///
/// ```
/// assert!(durastep::RunState::Completed.is_finished());
/// assert!(!durastep::RunState::Sleeping.is_finished());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RunState {
    /// Waiting to be claimed (new, or retrying after its backoff).
    Queued,
    /// An attempt is executing.
    Running,
    /// Suspended in a durable sleep; holds no worker.
    Sleeping,
    /// Suspended in [`Ctx::wait_for_event`](crate::Ctx::wait_for_event) until an
    /// event or its timeout; holds no worker.
    Waiting,
    /// Finished with an output.
    Completed,
    /// Out of attempts, or failed permanently.
    Failed,
    /// Cancelled.
    Cancelled,
    /// Not started, on purpose: over a rate limit, or refused by a singleton
    /// key that already had an active run. `last_error` says why.
    Skipped,
    /// Parked because its replay asked for something other than what it
    /// recorded (the function's code changed under it): not claimed, not
    /// retried, not failed. `last_error` and [`crate::inspect::Why::Diverged`]
    /// say where; [`Engine::resume_diverged`](crate::Engine::resume_diverged)
    /// and [`Engine::discard_from`](crate::Engine::discard_from) end it.
    Diverged,
}

impl RunState {
    /// Whether the run will not execute again.
    ///
    /// ```
    /// assert!(durastep::RunState::Failed.is_finished());
    /// ```
    pub fn is_finished(self) -> bool {
        matches!(self, RunState::Completed | RunState::Failed | RunState::Cancelled | RunState::Skipped)
    }

    /// The state's name as stored (`queued`, `running`, ... `skipped`).
    ///
    /// ```
    /// assert_eq!(durastep::RunState::Failed.as_str(), "failed");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Queued => "queued",
            RunState::Running => "running",
            RunState::Sleeping => "sleeping",
            RunState::Waiting => "waiting",
            RunState::Completed => "completed",
            RunState::Failed => "failed",
            RunState::Cancelled => "cancelled",
            RunState::Skipped => "skipped",
            RunState::Diverged => "diverged",
        }
    }

    /// Every state, in lifecycle order.
    ///
    /// ```
    /// assert_eq!(durastep::RunState::ALL.len(), 9);
    /// ```
    pub const ALL: [RunState; 9] = [
        RunState::Queued,
        RunState::Running,
        RunState::Sleeping,
        RunState::Waiting,
        RunState::Completed,
        RunState::Failed,
        RunState::Cancelled,
        RunState::Skipped,
        RunState::Diverged,
    ];
}

impl std::fmt::Display for RunState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parses a state's stored name (`"failed"`, ...).
///
/// ```
/// let s: durastep::RunState = "failed".parse().unwrap();
/// assert_eq!(s, durastep::RunState::Failed);
/// assert!("dead".parse::<durastep::RunState>().is_err());
/// ```
impl std::str::FromStr for RunState {
    type Err = ParseRunStateError;
    fn from_str(s: &str) -> Result<RunState, ParseRunStateError> {
        RunState::ALL.into_iter().find(|st| st.as_str() == s).ok_or_else(|| ParseRunStateError(s.to_owned()))
    }
}

/// A name that is no run state (`RunState`'s `FromStr`). Its message lists
/// the states; it converts into [`Error::InvalidFilter`](crate::Error::InvalidFilter).
///
/// ```
/// let e = "dead".parse::<durastep::RunState>().unwrap_err();
/// assert!(e.to_string().starts_with("unknown run state \"dead\"; one of queued, running"));
/// assert!(matches!(durastep::Error::from(e), durastep::Error::InvalidFilter(_)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown run state {0:?}; one of {names}", names = RunState::ALL.map(RunState::as_str).join(", "))]
pub struct ParseRunStateError(String);

/// A run state in the database that this build does not know (a newer
/// migration's, or a hand edit): reading it is an error, never a guess.
#[derive(Debug, thiserror::Error)]
#[error("the database holds run state {0:?}, which this build of durastep does not know")]
pub(crate) struct UnknownRunState(String);

/// Read from `text` columns (`runs.state`, `run_history.state`): the labels
/// of the enum type `durastep.run_state` that `runs_state_check` casts to
/// (migration 0040), which a test holds equal to [`RunState::ALL`].
impl sqlx::Type<sqlx::Postgres> for RunState {
    fn type_info() -> sqlx::postgres::PgTypeInfo {
        <&str as sqlx::Type<sqlx::Postgres>>::type_info()
    }

    fn compatible(ty: &sqlx::postgres::PgTypeInfo) -> bool {
        <&str as sqlx::Type<sqlx::Postgres>>::compatible(ty)
    }
}

impl<'r> sqlx::Decode<'r, sqlx::Postgres> for RunState {
    fn decode(value: sqlx::postgres::PgValueRef<'r>) -> Result<Self, sqlx::error::BoxDynError> {
        let s = <&str as sqlx::Decode<sqlx::Postgres>>::decode(value)?;
        RunState::ALL.into_iter().find(|st| st.as_str() == s).ok_or_else(|| UnknownRunState(s.to_owned()).into())
    }
}

/// A run as stored.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// let run: durastep::Run = engine.run(id).await?;
/// if let Some(error) = &run.last_error { eprintln!("attempt {} failed: {error}", run.attempt); }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct Run {
    /// The run's id.
    pub id: Uuid,
    /// Its function.
    pub function_id: String,
    /// The event that started it.
    pub event_id: Uuid,
    /// Its state.
    pub state: RunState,
    /// The current (or last) attempt, from 1.
    pub attempt: u32,
    /// Attempts allowed in all, not counting attempts that ended with a lost
    /// lease (see [`Run::lease_losses`]).
    pub max_attempts: u32,
    /// How many of its attempts ended with a lost lease (the worker was lost);
    /// these do not spend `max_attempts`, but the function's own budget
    /// ([`crate::FunctionBuilder::lease_losses`]).
    pub lease_losses: u32,
    /// When it is (or was) next due. A run waiting without a timeout (stored
    /// as Postgres `infinity`) shows [`crate::limits::max_instant`].
    pub run_at: DateTime<Utc>,
    /// The last failure, if any.
    pub last_error: Option<String>,
    /// Why it was cancelled, when it was.
    pub cancel_reason: Option<String>,
    /// The handler's output, once completed.
    pub output: Option<Value>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it finished.
    pub finished_at: Option<DateTime<Utc>>,
    /// The version of its function it started under, for good
    /// ([`crate::FunctionBuilder::version`]; 0 for an unversioned function).
    pub version: u32,
}

/// A count stored as `integer` (never negative), as the `u32` the API uses.
pub(crate) fn count(n: i32) -> u32 {
    u32::try_from(n).unwrap_or(0)
}
