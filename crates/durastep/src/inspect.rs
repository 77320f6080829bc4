//! Inspection: what happened to a run, and why another one is not running.
//!
//! [`Engine::inspect`] returns an [`Inspector`], which reads (never writes) the
//! runs, their events, state history and step timelines, the counts per
//! function and state, and what holds every run that is due but not running
//! (the `durastep.run_blockers` view). The `durastep` CLI and its dashboard use
//! only this API and the engine's actions ([`Engine::replay`],
//! [`Engine::replay_many`], [`Engine::cancel`], [`Engine::prune`]).
//!
//! ```no_run
//! # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
//! use durastep::inspect::RunFilter;
//! use durastep::RunState;
//! let page = engine.inspect().runs(&RunFilter::new().function("meta-budget-update").state(RunState::Failed)).await?;
//! for run in &page.runs {
//!     let detail = engine.inspect().run(run.id).await?;
//!     for step in &detail.steps {
//!         println!("{} {:?} after {} attempt(s): {:?}", step.name, step.status, step.attempts, step.error);
//!     }
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::codec::{self, Keyring, Kind, Place};
use crate::engine::Engine;
use crate::error::{Error, from_sqlx};
use crate::run::{Run, RunState, count};
use crate::store::{self, inspect as sql};

/// The most rows one listing returns.
pub const MAX_PAGE: u32 = 1_000;

/// Below this many runs (the planner's estimate), [`Inspector::counts_estimated`]
/// counts exactly.
pub const EXACT_COUNT_BELOW: i64 = 50_000;

/// Reads runs, events and functions. Get one from [`Engine::inspect`]; cheap to clone.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for c in engine.inspect().counts().await? {
///     println!("{:<30} {:<10} {}", c.function_id, c.state.as_str(), c.count);
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Inspector {
    pool: PgPool,
    keyring: Option<Arc<Keyring>>,
}

impl fmt::Debug for Inspector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Inspector").field("encryption", &self.keyring.is_some()).finish_non_exhaustive()
    }
}

/// Where a listing goes on: pass it to [`RunFilter::after`] (or
/// [`EventFilter::after`]) for the next page. Its text form (`Display` /
/// `FromStr`) is what a URL or a CLI flag carries.
///
/// ```
/// let c: durastep::inspect::Cursor = "1764579600000000_67e55044-10b1-426f-9247-bb680e5fe0c8".parse().unwrap();
/// assert_eq!(c.to_string(), "1764579600000000_67e55044-10b1-426f-9247-bb680e5fe0c8");
/// assert!("nonsense".parse::<durastep::inspect::Cursor>().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    created_at: DateTime<Utc>,
    id: Uuid,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}_{}", self.created_at.timestamp_micros(), self.id)
    }
}

impl FromStr for Cursor {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::InvalidFilter(format!("not a page cursor: {:?}", s.chars().take(80).collect::<String>()));
        let (micros, id) = s.split_once('_').ok_or_else(bad)?;
        let micros: i64 = micros.parse().map_err(|_| bad())?;
        let created_at = DateTime::from_timestamp_micros(micros).ok_or_else(bad)?;
        let id = Uuid::parse_str(id).map_err(|_| bad())?;
        Ok(Cursor { created_at, id })
    }
}

/// Which runs to list (or replay): all conditions must hold. Newest first:
/// by id, which for every run created since migration 0021 begins with the
/// millisecond it was created (a time-ordered UUID); then the runs stored
/// before that, by `created_at` (docs/guide.md, "Inspecting a run").
///
/// ```
/// use durastep::{RunState, inspect::RunFilter};
/// let f = RunFilter::new()
///     .function("linkedin-budget-update")
///     .state(RunState::Failed)
///     .data("/ad_account_id", "act_7")
///     .limit(20);
/// # let _ = f;
/// ```
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    function: Option<String>,
    states: Vec<RunState>,
    created_after: Option<DateTime<Utc>>,
    created_before: Option<DateTime<Utc>>,
    event_name: Option<String>,
    idempotency_key: Option<String>,
    data: Option<(String, Value)>,
    limit: Option<u32>,
    after: Option<Cursor>,
}

impl RunFilter {
    /// Every run.
    ///
    /// ```
    /// let all = durastep::inspect::RunFilter::new();
    /// # let _ = all;
    /// ```
    pub fn new() -> Self {
        RunFilter::default()
    }

    /// Runs of this function.
    ///
    /// ```
    /// let f = durastep::inspect::RunFilter::new().function("send-invoice");
    /// # let _ = f;
    /// ```
    pub fn function(mut self, id: impl Into<String>) -> Self {
        self.function = Some(id.into());
        self
    }

    /// Runs in this state; call again to allow several states.
    ///
    /// ```
    /// use durastep::RunState;
    /// let f = durastep::inspect::RunFilter::new().state(RunState::Failed).state(RunState::Cancelled);
    /// # let _ = f;
    /// ```
    pub fn state(mut self, state: RunState) -> Self {
        if !self.states.contains(&state) {
            self.states.push(state);
        }
        self
    }

    /// Runs created at or after this time.
    ///
    /// ```
    /// let f = durastep::inspect::RunFilter::new().created_after(chrono::Utc::now() - chrono::Duration::hours(1));
    /// # let _ = f;
    /// ```
    pub fn created_after(mut self, t: DateTime<Utc>) -> Self {
        self.created_after = Some(t);
        self
    }

    /// Runs created before this time.
    ///
    /// ```
    /// let f = durastep::inspect::RunFilter::new().created_before(chrono::Utc::now());
    /// # let _ = f;
    /// ```
    pub fn created_before(mut self, t: DateTime<Utc>) -> Self {
        self.created_before = Some(t);
        self
    }

    /// Runs started by events of this name.
    ///
    /// ```
    /// let f = durastep::inspect::RunFilter::new().event_name("deal/stage.changed");
    /// # let _ = f;
    /// ```
    pub fn event_name(mut self, name: impl Into<String>) -> Self {
        self.event_name = Some(name.into());
        self
    }

    /// Runs started by the event sent with this idempotency key.
    ///
    /// ```
    /// let f = durastep::inspect::RunFilter::new().idempotency_key("4711:placement:2026-W48");
    /// # let _ = f;
    /// ```
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Runs whose event data holds `value` at the JSON pointer `pointer` (the
    /// key of a concurrency limit, say). A string value matches a JSON string.
    ///
    /// ```
    /// let f = durastep::inspect::RunFilter::new().data("/ad_account_id", "act_7");
    /// let g = durastep::inspect::RunFilter::new().data("/contact_id", 4711);
    /// # let _ = (f, g);
    /// ```
    pub fn data(mut self, pointer: impl Into<String>, value: impl Into<Value>) -> Self {
        self.data = Some((pointer.into(), value.into()));
        self
    }

    /// At most this many runs per page (default 50, at most [`MAX_PAGE`]).
    ///
    /// ```
    /// let f = durastep::inspect::RunFilter::new().limit(200);
    /// # let _ = f;
    /// ```
    pub fn limit(mut self, n: u32) -> Self {
        self.limit = Some(n);
        self
    }

    /// The page after the one that returned this cursor ([`RunPage::next`]).
    ///
    /// ```
    /// # fn f(page: durastep::inspect::RunPage) {
    /// if let Some(next) = page.next { let _f = durastep::inspect::RunFilter::new().after(next); }
    /// # }
    /// ```
    pub fn after(mut self, cursor: Cursor) -> Self {
        self.after = Some(cursor);
        self
    }

    fn page_size(&self) -> Result<i64, Error> {
        page_size(self.limit)
    }

    fn path(&self) -> Result<Option<Vec<String>>, Error> {
        match &self.data {
            None => Ok(None),
            Some((pointer, _)) => crate::flow::parse_pointer(pointer)
                .map(Some)
                .map_err(|reason| Error::InvalidFilter(format!("bad key path {pointer:?}: {reason}"))),
        }
    }
}

/// A listing's page size: 50 unless given, 1 to [`MAX_PAGE`].
fn page_size(limit: Option<u32>) -> Result<i64, Error> {
    match limit.unwrap_or(50) {
        0 => Err(Error::InvalidFilter("limit must be at least 1".into())),
        n if n > MAX_PAGE => Err(Error::InvalidFilter(format!("limit {n} is over the maximum of {MAX_PAGE}"))),
        n => Ok(i64::from(n)),
    }
}

/// One run in a listing.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let page = engine.inspect().runs(&durastep::inspect::RunFilter::new()).await?;
/// if let Some(r) = page.runs.first() { println!("{} {} {:?}", r.id, r.function_id, r.state); }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct RunSummary {
    /// The run.
    pub id: Uuid,
    /// Its function.
    pub function_id: String,
    /// The event that started it.
    pub event_id: Uuid,
    /// That event's name.
    pub event_name: String,
    /// That event's idempotency key.
    pub idempotency_key: Option<String>,
    /// Its state.
    pub state: RunState,
    /// The current (or last) attempt.
    pub attempt: u32,
    /// Attempts allowed in all.
    pub max_attempts: u32,
    /// When it is (or was) next due.
    pub run_at: DateTime<Utc>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it finished.
    pub finished_at: Option<DateTime<Utc>>,
    /// The last failure. A completed run keeps the error of an earlier,
    /// retried attempt: `error_standing` says so.
    pub last_error: Option<String>,
    /// What `last_error` means for this run (None when it has none): a
    /// completed run's is [`ErrorStanding::Recovered`], not a failure.
    pub error_standing: Option<ErrorStanding>,
}

/// What a run's last error means, given how the run stands: the error of an
/// attempt that a retry recovered from, the failure that ended the run (at
/// once, or after every attempt), or the failure of an attempt that will be
/// retried. The CLI and the dashboard show errors by it, so that a completed
/// run never looks failed.
///
/// ```
/// use durastep::{RunState, inspect::ErrorStanding};
/// assert_eq!(ErrorStanding::of(RunState::Completed, 2, 3), ErrorStanding::Recovered);
/// assert_eq!(ErrorStanding::of(RunState::Failed, 1, 3), ErrorStanding::Permanent);
/// assert_eq!(ErrorStanding::of(RunState::Failed, 3, 3), ErrorStanding::Exhausted);
/// assert_eq!(ErrorStanding::of(RunState::Queued, 1, 3), ErrorStanding::Retrying);
/// assert_eq!(ErrorStanding::Permanent.as_str(), "permanent");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorStanding {
    /// The run completed: the error ended an earlier attempt, and a retry
    /// (or a replay) completed it. Not the run's error.
    Recovered,
    /// The run failed with attempts left: a permanent error
    /// ([`crate::HandlerError::permanent`]), or a limit such as the lease-loss
    /// budget, ended it without a retry.
    Permanent,
    /// The run failed on its last attempt: it is out of attempts. (A
    /// permanent error on the last attempt looks the same: either way no
    /// attempt was left.)
    Exhausted,
    /// The run has not finished: the error ended an earlier attempt, and it
    /// runs again (or is running).
    Retrying,
    /// The run was cancelled or skipped after an attempt failed with it.
    BeforeCancel,
    /// The run is parked after its replay diverged; the error says where.
    Diverged,
}

impl ErrorStanding {
    /// The standing of the last error of a run in `state` that has spent
    /// `attempt` of `max_attempts` (its attempt number less its lost leases,
    /// which do not count): a failed run with attempts left failed permanently.
    ///
    /// ```
    /// use durastep::{RunState, inspect::ErrorStanding};
    /// assert_eq!(ErrorStanding::of(RunState::Cancelled, 1, 3), ErrorStanding::BeforeCancel);
    /// ```
    pub fn of(state: RunState, attempt: u32, max_attempts: u32) -> ErrorStanding {
        match state {
            RunState::Completed => ErrorStanding::Recovered,
            RunState::Failed if attempt < max_attempts => ErrorStanding::Permanent,
            RunState::Failed => ErrorStanding::Exhausted,
            RunState::Cancelled | RunState::Skipped => ErrorStanding::BeforeCancel,
            RunState::Diverged => ErrorStanding::Diverged,
            _ => ErrorStanding::Retrying,
        }
    }

    /// Its name, as in JSON (`recovered`, `permanent`, ...).
    ///
    /// ```
    /// assert_eq!(durastep::inspect::ErrorStanding::BeforeCancel.as_str(), "before_cancel");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorStanding::Recovered => "recovered",
            ErrorStanding::Permanent => "permanent",
            ErrorStanding::Exhausted => "exhausted",
            ErrorStanding::Retrying => "retrying",
            ErrorStanding::BeforeCancel => "before_cancel",
            ErrorStanding::Diverged => "diverged",
        }
    }

    /// Whether the error is the run's own failure (it failed permanently or
    /// out of attempts), as opposed to one it got past or has not finished with.
    ///
    /// ```
    /// use durastep::inspect::ErrorStanding;
    /// assert!(ErrorStanding::Exhausted.is_failure());
    /// assert!(!ErrorStanding::Recovered.is_failure());
    /// ```
    pub fn is_failure(self) -> bool {
        matches!(self, ErrorStanding::Permanent | ErrorStanding::Exhausted)
    }
}

/// A run's last error, with what it means and the attempt it ended.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// if let Some(e) = engine.inspect().run(id).await?.error {
///     println!("{} ({}, attempt {:?})", e.message, e.standing.as_str(), e.attempt);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct RunError {
    /// The error (the run's `last_error`).
    pub message: String,
    /// What it means for the run.
    pub standing: ErrorStanding,
    /// The attempt it ended, from the state history (None when the history
    /// does not record it, as for a run pruned of it or failed before a claim).
    pub attempt: Option<u32>,
}

/// A page of runs.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// use durastep::inspect::RunFilter;
/// let mut filter = RunFilter::new().limit(100);
/// loop {
///     let page = engine.inspect().runs(&filter).await?;
///     println!("{} runs", page.runs.len());
///     match page.next { Some(c) => filter = filter.after(c), None => break }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct RunPage {
    /// The runs, newest first.
    pub runs: Vec<RunSummary>,
    /// The cursor of the next page, when there may be one.
    #[serde(serialize_with = "ser_cursor")]
    pub next: Option<Cursor>,
}

fn ser_cursor<S: serde::Serializer>(c: &Option<Cursor>, s: S) -> Result<S::Ok, S::Error> {
    match c {
        Some(c) => s.serialize_some(&c.to_string()),
        None => s.serialize_none(),
    }
}

/// A stored event.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// let detail = engine.inspect().run(id).await?;
/// println!("started by {} with {}", detail.event.name, detail.event.data);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct StoredEvent {
    /// The event's id.
    pub id: Uuid,
    /// Its name.
    pub name: String,
    /// Its data.
    pub data: Value,
    /// Its idempotency key.
    pub idempotency_key: Option<String>,
    /// When it was stored.
    pub created_at: DateTime<Utc>,
    /// How many runs it started.
    pub runs: i64,
}

/// Which events to list. Newest first.
///
/// ```
/// let f = durastep::inspect::EventFilter::new().name("campaign/budget.requested").limit(10);
/// # let _ = f;
/// ```
#[derive(Debug, Clone, Default)]
pub struct EventFilter {
    name: Option<String>,
    limit: Option<u32>,
    after: Option<Cursor>,
}

impl EventFilter {
    /// Every event.
    ///
    /// ```
    /// let f = durastep::inspect::EventFilter::new();
    /// # let _ = f;
    /// ```
    pub fn new() -> Self {
        EventFilter::default()
    }

    /// Events of this name.
    ///
    /// ```
    /// let f = durastep::inspect::EventFilter::new().name("deal/stage.changed");
    /// # let _ = f;
    /// ```
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// At most this many per page (default 50, at most [`MAX_PAGE`]).
    ///
    /// ```
    /// let f = durastep::inspect::EventFilter::new().limit(5);
    /// # let _ = f;
    /// ```
    pub fn limit(mut self, n: u32) -> Self {
        self.limit = Some(n);
        self
    }

    /// The page after the one that returned this cursor.
    ///
    /// ```
    /// # fn f(page: durastep::inspect::EventPage) {
    /// if let Some(c) = page.next { let _ = durastep::inspect::EventFilter::new().after(c); }
    /// # }
    /// ```
    pub fn after(mut self, cursor: Cursor) -> Self {
        self.after = Some(cursor);
        self
    }
}

/// A page of events.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let page = engine.inspect().events(&durastep::inspect::EventFilter::new()).await?;
/// # let _ = page.events; Ok(()) }
/// ```
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct EventPage {
    /// The events, newest first.
    pub events: Vec<StoredEvent>,
    /// The cursor of the next page, when there may be one.
    #[serde(serialize_with = "ser_cursor")]
    pub next: Option<Cursor>,
}

/// One change of a run's state (or a new claim of it), oldest first.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// for h in engine.inspect().run(id).await?.history {
///     println!("{} {:?} attempt {} {}", h.at, h.state, h.attempt, h.error.as_deref().unwrap_or(""));
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct HistoryEntry {
    /// When, by the database clock.
    pub at: DateTime<Utc>,
    /// The state the run entered.
    pub state: RunState,
    /// The attempt it was then at.
    pub attempt: u32,
    /// The worker that claimed it (for `running`).
    pub worker_id: Option<Uuid>,
    /// The failure that ended an attempt here, if one did.
    pub error: Option<String>,
    /// The step that failed, when the attempt ended at a step.
    pub step: Option<String>,
    /// Whether this entry is a replay: a finished run queued again
    /// ([`Engine::replay`]).
    pub replayed: bool,
    /// For the entry that cancelled (or skipped) the run as it now stands:
    /// why. (A replay clears the reason, so earlier cancellations have none.)
    pub cancel_reason: Option<String>,
}

/// How one execution of a run (one claim) ended.
///
/// ```
/// assert_ne!(durastep::inspect::AttemptOutcome::Completed, durastep::inspect::AttemptOutcome::Running);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum AttemptOutcome {
    /// Still executing.
    Running,
    /// The handler returned: the run completed.
    Completed,
    /// It failed and the run will be retried.
    Retried,
    /// It failed and the run failed (out of attempts, or a permanent failure).
    Failed,
    /// The worker was lost (its lease expired) and the run was taken back.
    LeaseLost,
    /// Suspended in a durable sleep.
    Slept,
    /// Suspended waiting for an event or a child run.
    Waited,
    /// Cancelled (by a cancel, `cancel_on` or a timeout).
    Cancelled,
    /// Handed back by a worker shutting down; not counted as an attempt.
    Released,
}

impl AttemptOutcome {
    /// Its name, as in JSON (`completed`, `lease_lost`, ...).
    ///
    /// ```
    /// assert_eq!(durastep::inspect::AttemptOutcome::LeaseLost.as_str(), "lease_lost");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Running => "running",
            AttemptOutcome::Completed => "completed",
            AttemptOutcome::Retried => "retried",
            AttemptOutcome::Failed => "failed",
            AttemptOutcome::LeaseLost => "lease_lost",
            AttemptOutcome::Slept => "slept",
            AttemptOutcome::Waited => "waited",
            AttemptOutcome::Cancelled => "cancelled",
            AttemptOutcome::Released => "released",
        }
    }
}

/// One execution of a run: from a claim to the next state change.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// for a in engine.inspect().run(id).await?.attempts {
///     println!("attempt {} on {:?}: {:?} {}", a.attempt, a.worker_id, a.outcome, a.error.as_deref().unwrap_or(""));
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct AttemptRecord {
    /// The attempt number (a wake-up after a sleep executes the same attempt again).
    pub attempt: u32,
    /// The worker that executed it.
    pub worker_id: Option<Uuid>,
    /// When it was claimed.
    pub started_at: DateTime<Utc>,
    /// When it ended (None while running).
    pub ended_at: Option<DateTime<Utc>>,
    /// How it ended.
    pub outcome: AttemptOutcome,
    /// Its failure.
    pub error: Option<String>,
    /// The step that failed.
    pub failed_step: Option<String>,
}

/// Where a step stands.
///
/// ```
/// assert_ne!(durastep::inspect::StepStatus::Completed, durastep::inspect::StepStatus::Failed);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum StepStatus {
    /// Its result is stored.
    Completed,
    /// Its last execution failed and no result is stored.
    Failed,
}

/// One step of a run's timeline.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// for s in engine.inspect().run(id).await?.steps {
///     println!("{:<20} {:?} x{} {:?}", s.name, s.status, s.attempts, s.duration);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct StepRecord {
    /// The step key (`name`, or `name#2` for a second call of the name).
    pub name: String,
    /// Stored or failed.
    pub status: StepStatus,
    /// Executions of it: failed ones plus the one that stored it.
    pub attempts: u32,
    /// The attempt that stored it (or that last failed at it).
    pub attempt: Option<u32>,
    /// When its (last) execution began, by the database clock; None for steps
    /// stored by the database itself (waits, invokes) and for failures.
    pub started_at: Option<DateTime<Utc>>,
    /// When it ended (stored, or failed).
    pub finished_at: Option<DateTime<Utc>>,
    /// How long its body ran.
    #[serde(serialize_with = "ser_duration")]
    pub duration: Option<Duration>,
    /// Its stored output (opened when the engine holds the key; sealed otherwise).
    pub output: Option<Value>,
    /// Its last failure.
    pub error: Option<String>,
    /// For a durable sleep (`ctx.sleep`, `ctx.sleep_until`): the time it
    /// wakes (or woke) at. The sleep itself lasts from `finished_at` (when the
    /// wake time was stored) to this.
    pub wake_at: Option<DateTime<Utc>>,
    /// For a durable sleep: how long it sleeps (or slept), from when its wake
    /// time was stored to `wake_at`. (`duration` is the few microseconds it
    /// took to store that.)
    #[serde(serialize_with = "ser_duration")]
    pub slept: Option<Duration>,
}

impl StepRecord {
    /// Whether it is a durable sleep.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let sleeps = engine.inspect().run(id).await?.steps.iter().filter(|s| s.is_sleep()).count();
    /// # let _ = sleeps; Ok(()) }
    /// ```
    pub fn is_sleep(&self) -> bool {
        self.wake_at.is_some()
    }
}

/// The wake time of a sleep step's stored record (`{"wake_at": ...}` alone).
fn wake_time(output: &Value) -> Option<DateTime<Utc>> {
    let map = output.as_object().filter(|m| m.len() == 1)?;
    serde_json::from_value(map.get("wake_at")?.clone()).ok()
}

fn ser_duration<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// Everything about one run.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// let d = engine.inspect().run(id).await?;
/// println!("{} {:?}: {} steps, {} executions", d.run.function_id, d.run.state, d.steps.len(), d.attempts.len());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct RunDetail {
    /// The run (its output opened when the engine holds the key).
    pub run: Run,
    /// Its last error and what it means (a completed run's is recovered
    /// from, not its failure); None when it has none.
    pub error: Option<RunError>,
    /// The event that started it.
    pub event: StoredEvent,
    /// Every state change, oldest first.
    pub history: Vec<HistoryEntry>,
    /// Every execution, oldest first.
    pub attempts: Vec<AttemptRecord>,
    /// The step timeline, in the order steps finished.
    pub steps: Vec<StepRecord>,
    /// What holds it, when it is not running and not finished.
    pub blocker: Option<Blocker>,
    /// Its child runs (`ctx.invoke`).
    pub children: Vec<ChildRun>,
}

/// A child run started by `ctx.invoke`.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// for c in engine.inspect().run(id).await?.children { println!("{} {} {:?}", c.id, c.function_id, c.state); }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct ChildRun {
    /// The child run.
    pub id: Uuid,
    /// Its function.
    pub function_id: String,
    /// Its state.
    pub state: RunState,
}

/// What holds a run that is not running (a row of `durastep.run_blockers`).
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for b in engine.inspect().blockers(None, 20).await? {
///     println!("{} waits on {:?} {:?} ({:?}/{:?})", b.run_id, b.kind, b.key, b.in_use, b.limit);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Blocker {
    /// The run.
    pub run_id: Uuid,
    /// Its function.
    pub function_id: String,
    /// Its state (queued, sleeping, waiting).
    pub state: RunState,
    /// What holds it.
    pub kind: BlockerKind,
    /// The flow-control rule (or `debounce`), when one holds it.
    pub rule: Option<String>,
    /// The key of that rule.
    pub key: Option<String>,
    /// Concurrency: the slots of the key in use.
    pub in_use: Option<u32>,
    /// The rule's limit (slots, or starts per period).
    pub limit: Option<u32>,
    /// The earliest it can start (None: when a slot frees, or never by itself).
    pub next_possible_start: Option<DateTime<Utc>>,
    /// The event waited for, the child run, or the error behind a backoff.
    pub detail: Option<String>,
    /// The step key of the wait ([`BlockerKind::WaitForEvent`]), invoke
    /// ([`BlockerKind::Invoke`]) or sleep ([`BlockerKind::Sleep`]) it is in,
    /// when known.
    pub step: Option<String>,
}

/// The reasons a run is not running; see `durastep.run_blockers`.
///
/// ```
/// assert_eq!(durastep::inspect::BlockerKind::Concurrency.as_str(), "concurrency");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum BlockerKind {
    /// Every slot of its concurrency key is taken.
    Concurrency,
    /// Its throttle key has no start left this period.
    Throttle,
    /// Its rate limit key (it will be skipped at its turn if still over).
    RateLimit,
    /// Its key is paused after a Retry-After.
    Backpressure,
    /// Its debounce window has not closed.
    Debounce,
    /// A durable sleep.
    Sleep,
    /// Waiting for an event.
    WaitForEvent,
    /// Waiting for a child run.
    Invoke,
    /// A failed attempt's backoff.
    RetryBackoff,
    /// A delayed start.
    Scheduled,
    /// Due now, not yet claimed: are workers running that register its function?
    Ready,
}

impl BlockerKind {
    /// The name used by the view and the CLI.
    ///
    /// ```
    /// assert_eq!(durastep::inspect::BlockerKind::WaitForEvent.as_str(), "wait_for_event");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            BlockerKind::Concurrency => "concurrency",
            BlockerKind::Throttle => "throttle",
            BlockerKind::RateLimit => "rate_limit",
            BlockerKind::Backpressure => "backpressure",
            BlockerKind::Debounce => "debounce",
            BlockerKind::Sleep => "sleep",
            BlockerKind::WaitForEvent => "wait_for_event",
            BlockerKind::Invoke => "invoke",
            BlockerKind::RetryBackoff => "retry_backoff",
            BlockerKind::Scheduled => "scheduled",
            BlockerKind::Ready => "ready",
        }
    }

    fn parse(s: &str) -> BlockerKind {
        match s {
            "concurrency" => BlockerKind::Concurrency,
            "throttle" => BlockerKind::Throttle,
            "rate_limit" => BlockerKind::RateLimit,
            "backpressure" => BlockerKind::Backpressure,
            "debounce" => BlockerKind::Debounce,
            "sleep" => BlockerKind::Sleep,
            "wait_for_event" => BlockerKind::WaitForEvent,
            "invoke" => BlockerKind::Invoke,
            "retry_backoff" => BlockerKind::RetryBackoff,
            "scheduled" => BlockerKind::Scheduled,
            _ => BlockerKind::Ready,
        }
    }
}

/// The answer to "why is this run not running?".
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// match engine.inspect().why(id).await? {
///     durastep::inspect::Why::Blocked(b) => println!("held by {}", b.kind.as_str()),
///     other => println!("{other:?}"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "status")]
#[non_exhaustive]
pub enum Why {
    /// It is running now.
    Running {
        /// Its attempt.
        attempt: u32,
        /// The worker holding it.
        worker_id: Option<Uuid>,
    },
    /// It has finished and will not run again (unless replayed).
    Finished {
        /// How it finished.
        state: RunState,
        /// Its last error or cancel reason.
        reason: Option<String>,
    },
    /// Something holds it.
    Blocked(Blocker),
    /// Its replay asked for something other than what it recorded: it is parked
    /// until an operator resumes it ([`crate::Engine::resume_diverged`], once the
    /// code is fixed) or discards its entries from a position
    /// ([`crate::Engine::discard_from`]).
    Diverged {
        /// Where and how it diverged (`None` if the record was unreadable).
        divergence: Option<crate::Divergence>,
        /// The message stored as its last error.
        reason: Option<String>,
    },
}

/// Runs of one function in one state.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let failed: i64 = engine.inspect().counts().await?.iter()
///     .filter(|c| c.state == durastep::RunState::Failed).map(|c| c.count).sum();
/// # let _ = failed; Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct StateCount {
    /// The function.
    pub function_id: String,
    /// The state.
    pub state: RunState,
    /// How many runs.
    pub count: i64,
    /// Whether `count` is the planner's estimate (see
    /// [`Inspector::counts_estimated`]) rather than an exact count.
    pub estimated: bool,
}

/// Runs created and finished in one minute.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for m in engine.inspect().per_minute(std::time::Duration::from_secs(3600)).await? {
///     println!("{} +{} ok {} failed {}", m.minute, m.created, m.completed, m.failed);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct MinuteCount {
    /// The start of the minute (database clock).
    pub minute: DateTime<Utc>,
    /// Runs created in it.
    pub created: i64,
    /// Runs completed in it. A run replayed and completed again counts in
    /// the minute of each completion (the run history records each).
    pub completed: i64,
    /// Runs failed in it (each failure of a run replayed since, too).
    pub failed: i64,
}

/// A function as registered by some engine, with its schedule and rules.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for f in engine.inspect().functions().await? {
///     println!("{} on {:?} cron {:?} rules {:?}", f.id, f.triggers, f.cron, f.rules);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct FunctionInfo {
    /// The function id.
    pub id: String,
    /// The event names that trigger it.
    pub triggers: Vec<String>,
    /// Attempts per run.
    pub max_attempts: u32,
    /// Its cron schedule, when it has one.
    pub cron: Option<CronInfo>,
    /// Its flow-control rules.
    pub rules: Vec<RuleInfo>,
    /// When an engine last registered it.
    pub updated_at: DateTime<Utc>,
}

/// A function's cron schedule.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for f in engine.inspect().functions().await? {
///     if let Some(c) = f.cron { println!("{}: {} in {}, next {:?}", f.id, c.expr, c.tz, c.next_fire_at); }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CronInfo {
    /// The cron expression.
    pub expr: String,
    /// Its time zone (IANA name).
    pub tz: String,
    /// The next fire time, once a worker has ticked it.
    pub next_fire_at: Option<DateTime<Utc>>,
}

/// One flow-control rule of a function.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// for f in engine.inspect().functions().await? {
///     for r in &f.rules { println!("{}: {} {} per {} s by {:?}", f.id, r.kind, r.limit, r.period_secs, r.key); }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct RuleInfo {
    /// The rule's name (shared, or `<function>#<kind><n>`).
    pub name: String,
    /// `concurrency`, `throttle`, `rate_limit` or `backpressure`.
    pub kind: String,
    /// Slots (concurrency) or starts per period.
    pub limit: i64,
    /// The period of a throttle or rate limit, in seconds (0 otherwise).
    pub period_secs: f64,
    /// The key's JSON pointer (None: one key for the whole function).
    pub key: Option<String>,
}

impl Inspector {
    /// The database clock now (the time every due-ness decision uses).
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let now = engine.inspect().db_now().await?;
    /// # let _ = now; Ok(()) }
    /// ```
    pub async fn db_now(&self) -> Result<DateTime<Utc>, Error> {
        store::db_now(&self.pool).await.map_err(from_sqlx)
    }

    pub(crate) fn new(pool: PgPool, keyring: Option<Arc<Keyring>>) -> Self {
        Inspector { pool, keyring }
    }

    /// A read-only connection: connects to `url` and nothing else. It does not
    /// migrate and registers nothing, so a role with `SELECT` only (the reader
    /// role of docs/security.md) can use it. For the CLI's read commands and a
    /// dashboard without actions.
    ///
    /// Errors: [`Error::Unavailable`] when the URL does not parse or the
    /// database does not answer. A missing schema shows at the first read.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), durastep::Error> {
    /// let reader = durastep::inspect::Inspector::connect("postgres://durastep_reader@127.0.0.1/app").await?;
    /// let counts = reader.counts().await?;
    /// # let _ = counts; Ok(()) }
    /// ```
    pub async fn connect(url: &str) -> Result<Inspector, Error> {
        use sqlx::Connection;
        let options: sqlx::postgres::PgConnectOptions = url.parse().map_err(Error::Unavailable)?;
        // One plain connection first, so a refused host fails at once with its own error.
        let probe = tokio::time::timeout(Duration::from_secs(10), sqlx::PgConnection::connect_with(&options))
            .await
            .map_err(|_| {
                let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within 10 s");
                Error::Unavailable(sqlx::Error::Io(e))
            })?
            .map_err(Error::Unavailable)?;
        let _ = probe.close().await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await
            .map_err(Error::Unavailable)?;
        Ok(Inspector { pool, keyring: None })
    }

    /// A read-only inspector over an existing pool.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let reader = durastep::inspect::Inspector::from_pool(pool);
    /// # let _ = reader; }
    /// ```
    pub fn from_pool(pool: PgPool) -> Inspector {
        Inspector { pool, keyring: None }
    }

    /// Opens sealed outputs with this keyring (as an engine built with
    /// [`crate::EngineBuilder::encryption`] does).
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) {
    /// let reader = durastep::inspect::Inspector::from_pool(pool).encryption(durastep::Keyring::new("k1", [9u8; 32]));
    /// # let _ = reader; }
    /// ```
    pub fn encryption(mut self, keyring: Keyring) -> Inspector {
        self.keyring = Some(Arc::new(keyring));
        self
    }

    /// Lists runs matching `filter`, newest first, one page at a time.
    ///
    /// Errors: [`Error::InvalidFilter`] for a bad key path or page size.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let page = engine.inspect().runs(&durastep::inspect::RunFilter::new().limit(10)).await?;
    /// # let _ = page; Ok(()) }
    /// ```
    pub async fn runs(&self, filter: &RunFilter) -> Result<RunPage, Error> {
        let limit = filter.page_size()?;
        let path = filter.path()?;
        let states: Vec<&str> = filter.states.iter().map(|s| s.as_str()).collect();
        let q = sql::RunQuery {
            function: filter.function.as_deref(),
            states: &states,
            created_after: filter.created_after,
            created_before: filter.created_before,
            event_name: filter.event_name.as_deref(),
            idempotency_key: filter.idempotency_key.as_deref(),
            data: path.as_deref().zip(filter.data.as_ref().map(|d| &d.1)),
            before: filter.after.map(|c| (c.created_at, c.id)),
            limit: limit + 1,
        };
        let mut rows = sql::list_runs(&self.pool, &q).await.map_err(from_sqlx)?;
        let more = rows.len() as i64 > limit;
        rows.truncate(limit as usize);
        let runs: Vec<RunSummary> = rows
            .into_iter()
            .map(|r| RunSummary {
                id: r.id,
                function_id: r.function_id,
                event_id: r.event_id,
                event_name: r.event_name,
                idempotency_key: r.idempotency_key,
                state: r.state,
                attempt: count(r.attempt),
                max_attempts: count(r.max_attempts),
                run_at: r.run_at,
                created_at: r.created_at,
                finished_at: r.finished_at,
                error_standing: r.last_error.as_ref().map(|_| {
                    let counted = count(r.attempt).saturating_sub(count(r.lease_losses));
                    ErrorStanding::of(r.state, counted, count(r.max_attempts))
                }),
                last_error: r.last_error,
            })
            .collect();
        let next = if more { runs.last().map(|r| Cursor { created_at: r.created_at, id: r.id }) } else { None };
        Ok(RunPage { runs, next })
    }

    /// One run with its event, history, executions, step timeline, blocker and children.
    ///
    /// Errors: [`Error::UnknownRun`] when no run has the id.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let d = engine.inspect().run(id).await?;
    /// # let _ = d; Ok(()) }
    /// ```
    pub async fn run(&self, id: Uuid) -> Result<RunDetail, Error> {
        let row = store::load_run(&self.pool, id).await.map_err(from_sqlx)?.ok_or(Error::UnknownRun(id))?;
        let place = row.output_place();
        let mut run = Run::from(row);
        if let Some(output) = run.output.take() {
            run.output = Some(self.open(&[place], output));
        }
        let (event, history, steps, children, blocker) = tokio::try_join!(
            sql::load_event(&self.pool, run.event_id),
            sql::load_history(&self.pool, id),
            sql::load_steps(&self.pool, id),
            sql::load_children(&self.pool, id),
            sql::blockers(&self.pool, Some(id), None, 1),
        )
        .map_err(from_sqlx)?;
        let event = event.map(event_of).ok_or(Error::UnknownRun(id))?;
        let history = history_of(&run, history);
        let attempts = attempts_of(&history);
        let steps = self.timeline(id, steps, &history);
        let error = run.last_error.as_ref().map(|message| RunError {
            message: message.clone(),
            standing: ErrorStanding::of(run.state, run.attempt.saturating_sub(run.lease_losses), run.max_attempts),
            // The execution it ended (a retried failure's history row carries the next attempt).
            attempt: attempts.iter().rev().find(|a| a.error.as_ref() == Some(message)).map(|a| a.attempt),
        });
        let blocker = self.with_steps(blocker.into_iter().map(blocker_of).collect()).await?;
        Ok(RunDetail {
            run,
            error,
            event,
            history,
            attempts,
            steps,
            blocker: blocker.into_iter().next(),
            children: children.into_iter().map(|(id, function_id, s)| ChildRun { id, function_id, state: s }).collect(),
        })
    }

    /// Why a run is not running: it is running, it has finished, or what holds it.
    ///
    /// Errors: [`Error::UnknownRun`].
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// println!("{:?}", engine.inspect().why(id).await?);
    /// # Ok(()) }
    /// ```
    pub async fn why(&self, id: Uuid) -> Result<Why, Error> {
        // The run and its blocker are two reads; a run that changed state in
        // between is read again (a few times at most, then shown as it is).
        for _ in 0..3 {
            if let Some(why) = self.why_once(id).await? {
                return Ok(why);
            }
        }
        let run = store::load_run(&self.pool, id).await.map_err(from_sqlx)?.ok_or(Error::UnknownRun(id))?;
        Ok(Why::Running { attempt: count(run.attempt), worker_id: None })
    }

    async fn why_once(&self, id: Uuid) -> Result<Option<Why>, Error> {
        let run = store::load_run(&self.pool, id).await.map_err(from_sqlx)?.ok_or(Error::UnknownRun(id))?;
        let state = run.state;
        if state.is_finished() {
            let reason = match state {
                RunState::Completed => None,
                RunState::Cancelled => run.cancel_reason,
                _ => run.last_error,
            };
            return Ok(Some(Why::Finished { state, reason }));
        }
        if state == RunState::Diverged {
            let divergence = store::load_divergence(&self.pool, id).await.map_err(from_sqlx)?;
            let divergence = divergence.and_then(|v| serde_json::from_value(v).ok());
            return Ok(Some(Why::Diverged { divergence, reason: run.last_error }));
        }
        if state == RunState::Running {
            let history = sql::load_history(&self.pool, id).await.map_err(from_sqlx)?;
            let worker_id = history.iter().rev().find(|h| h.state == RunState::Running).and_then(|h| h.worker_id);
            return Ok(Some(Why::Running { attempt: count(run.attempt), worker_id }));
        }
        let rows = sql::blockers(&self.pool, Some(id), None, 1).await.map_err(from_sqlx)?;
        let held = self.with_steps(rows.into_iter().map(blocker_of).collect()).await?;
        Ok(held.into_iter().next().map(Why::Blocked))
    }

    /// What holds the runs that are not running (of one function, or all), the
    /// longest-due first, at most `limit`.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let held = engine.inspect().blockers(Some("exact-invoice"), 50).await?;
    /// # let _ = held; Ok(()) }
    /// ```
    pub async fn blockers(&self, function: Option<&str>, limit: u32) -> Result<Vec<Blocker>, Error> {
        let limit = i64::from(limit.clamp(1, MAX_PAGE));
        let rows = sql::blockers(&self.pool, None, function, limit).await.map_err(from_sqlx)?;
        self.with_steps(rows.into_iter().map(blocker_of).collect()).await
    }

    /// Runs per function and state.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let counts = engine.inspect().counts().await?;
    /// # let _ = counts; Ok(()) }
    /// ```
    pub async fn counts(&self) -> Result<Vec<StateCount>, Error> {
        let rows = sql::counts(&self.pool).await.map_err(from_sqlx)?;
        Ok(rows
            .into_iter()
            .map(|(function_id, state, count)| StateCount { function_id, state, count, estimated: false })
            .collect())
    }

    /// Runs per function and state, cheaply: exact for the unfinished states
    /// (queued, running, sleeping, waiting; found through an index), estimated
    /// for the finished ones from the statistics ANALYZE keeps (a
    /// multivariate MCV list on function and state, times the table's row
    /// estimate; [`StateCount::estimated`] is true). Below
    /// [`EXACT_COUNT_BELOW`] rows everything is counted exactly. Its cost does
    /// not grow with the number of finished runs (EXPLAIN figures in
    /// docs/performance.md), so a page that reloads every few seconds can call it.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// for c in engine.inspect().counts_estimated().await? {
    ///     println!("{} {} {}{}", c.function_id, c.state.as_str(), if c.estimated { "≈" } else { "" }, c.count);
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn counts_estimated(&self) -> Result<Vec<StateCount>, Error> {
        let rows = sql::runs_row_estimate(&self.pool).await.map_err(from_sqlx)?;
        if rows < EXACT_COUNT_BELOW {
            return self.counts().await;
        }
        let (exact, estimates) = tokio::try_join!(sql::unfinished_counts(&self.pool), sql::count_estimates(&self.pool))
            .map_err(from_sqlx)?;
        if estimates.is_empty() {
            // Statistics not gathered yet (no ANALYZE since the migration).
            return self.counts().await;
        }
        let mut out: Vec<StateCount> = exact
            .into_iter()
            .map(|(function_id, state, count)| StateCount { function_id, state, count, estimated: false })
            .collect();
        out.extend(
            estimates.into_iter().filter(|(_, s, _)| s.is_finished()).map(|(function_id, state, count)| StateCount {
                function_id,
                state,
                count,
                estimated: true,
            }),
        );
        out.sort_by(|a, b| (a.function_id.as_str(), a.state.as_str()).cmp(&(b.function_id.as_str(), b.state.as_str())));
        Ok(out)
    }

    /// How many finished runs [`Engine::prune`] with `older_than` would delete
    /// now (a dry run: nothing is deleted).
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let n = engine.inspect().prunable(std::time::Duration::from_secs(30 * 86_400)).await?;
    /// # let _ = n; Ok(()) }
    /// ```
    pub async fn prunable(&self, older_than: Duration) -> Result<u64, Error> {
        let n = store::prunable(&self.pool, older_than).await.map_err(from_sqlx)?;
        Ok(u64::try_from(n).unwrap_or(0))
    }

    /// Runs created, completed and failed per minute over the last `window`
    /// (minutes with none are left out).
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let last_hour = engine.inspect().per_minute(std::time::Duration::from_secs(3600)).await?;
    /// # let _ = last_hour; Ok(()) }
    /// ```
    pub async fn per_minute(&self, window: Duration) -> Result<Vec<MinuteCount>, Error> {
        let rows = sql::per_minute(&self.pool, window).await.map_err(from_sqlx)?;
        Ok(rows
            .into_iter()
            .map(|(minute, created, completed, failed)| MinuteCount { minute, created, completed, failed })
            .collect())
    }

    /// Lists stored events, newest first.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let page = engine.inspect().events(&durastep::inspect::EventFilter::new().name("order/placed")).await?;
    /// # let _ = page; Ok(()) }
    /// ```
    pub async fn events(&self, filter: &EventFilter) -> Result<EventPage, Error> {
        let limit = page_size(filter.limit)?;
        let before = filter.after.map(|c| (c.created_at, c.id));
        let mut rows =
            sql::list_events(&self.pool, filter.name.as_deref(), before, limit + 1).await.map_err(from_sqlx)?;
        let more = rows.len() as i64 > limit;
        rows.truncate(limit as usize);
        let events: Vec<StoredEvent> = rows.into_iter().map(event_of).collect();
        let next = if more { events.last().map(|e| Cursor { created_at: e.created_at, id: e.id }) } else { None };
        Ok(EventPage { events, next })
    }

    /// Every function that some engine registered.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let functions = engine.inspect().functions().await?;
    /// # let _ = functions; Ok(()) }
    /// ```
    pub async fn functions(&self) -> Result<Vec<FunctionInfo>, Error> {
        let rows = sql::functions(&self.pool).await.map_err(from_sqlx)?;
        Ok(rows
            .into_iter()
            .map(|f| FunctionInfo {
                rules: serde_json::from_value(f.rules).unwrap_or_default(),
                id: f.id,
                triggers: f.triggers,
                max_attempts: count(f.max_attempts),
                cron: f.cron.zip(f.tz).map(|(expr, tz)| CronInfo { expr, tz, next_fire_at: f.next_fire_at }),
                updated_at: f.updated_at,
            })
            .collect())
    }

    /// Names the step each held run is in: the wait's or the invoke's step
    /// key, or the sleep whose wake time is the run's (else its latest sleep).
    async fn with_steps(&self, mut held: Vec<Blocker>) -> Result<Vec<Blocker>, Error> {
        let of =
            |kind: BlockerKind| -> Vec<Uuid> { held.iter().filter(|b| b.kind == kind).map(|b| b.run_id).collect() };
        let (waiting, sleeping) = (of(BlockerKind::WaitForEvent), of(BlockerKind::Sleep));
        let children: Vec<Uuid> = held
            .iter()
            .filter(|b| b.kind == BlockerKind::Invoke)
            .filter_map(|b| b.detail.as_deref().and_then(|d| Uuid::parse_str(d).ok()))
            .collect();
        if waiting.is_empty() && sleeping.is_empty() && children.is_empty() {
            return Ok(held);
        }
        let rows = sql::held_steps(&self.pool, &waiting, &children, &sleeping).await.map_err(from_sqlx)?;
        for b in &mut held {
            let mine = rows.iter().filter(|r| r.run_id == b.run_id);
            b.step = match b.kind {
                BlockerKind::WaitForEvent => mine
                    .filter(|r| r.source == "wait")
                    .find(|r| r.event_name.is_some() && r.event_name == b.detail)
                    .map(|r| r.step_key.clone()),
                BlockerKind::Invoke => mine.filter(|r| r.source == "invoke").map(|r| r.step_key.clone()).next(),
                BlockerKind::Sleep => {
                    let sleeps: Vec<(DateTime<Utc>, &str)> = mine
                        .filter(|r| r.source == "sleep")
                        .filter_map(|r| {
                            let places =
                                [Kind::Step, Kind::Wait, Kind::Child].map(|k| Place::step(k, b.run_id, &r.step_key));
                            let opened = self.open(&places, r.output.clone()?);
                            Some((wake_time(&opened)?, r.step_key.as_str()))
                        })
                        .collect();
                    let exact = sleeps.iter().find(|(w, _)| Some(*w) == b.next_possible_start);
                    exact.or_else(|| sleeps.iter().max_by_key(|(w, _)| *w)).map(|(_, k)| (*k).to_owned())
                }
                _ => None,
            };
        }
        Ok(held)
    }

    /// Opens a stored value for display at the first of `places` where it
    /// opens; a value that opens nowhere is shown as stored.
    fn open(&self, places: &[Place], value: Value) -> Value {
        let keyring = self.keyring.as_deref();
        places.iter().find_map(|p| codec::open_value(keyring, p, value.clone()).ok()).unwrap_or(value)
    }

    /// The step timeline: stored steps, then steps that failed and never stored.
    fn timeline(&self, run_id: Uuid, steps: Vec<sql::StepRow>, history: &[HistoryEntry]) -> Vec<StepRecord> {
        fn failures<'h>(history: &'h [HistoryEntry], name: &'h str) -> impl Iterator<Item = &'h HistoryEntry> {
            history.iter().filter(move |h| h.step.as_deref() == Some(name))
        }
        let mut out: Vec<StepRecord> = steps
            .into_iter()
            .map(|s| {
                let failed = u32::try_from(failures(history, &s.step_key).count()).unwrap_or(u32::MAX);
                let finished_at = s.finished_at.or(Some(s.stored_at));
                let duration = s.started_at.zip(s.finished_at).and_then(|(a, b)| (b - a).to_std().ok());
                // A step key holds a step result, a wait result or a child outcome.
                let output = self.open(
                    &[Kind::Step, Kind::Wait, Kind::Child].map(|k| Place::step(k, run_id, &s.step_key)),
                    s.output,
                );
                let wake_at = wake_time(&output);
                StepRecord {
                    slept: wake_at.zip(finished_at).map(|(w, f)| (w - f).to_std().unwrap_or_default()),
                    wake_at,
                    attempts: failed.saturating_add(1),
                    attempt: s.attempt.map(count),
                    status: StepStatus::Completed,
                    started_at: s.started_at,
                    finished_at,
                    duration,
                    output: Some(output),
                    error: None,
                    name: s.step_key,
                }
            })
            .collect();
        for h in history {
            let Some(step) = &h.step else { continue };
            if out.iter().any(|s| &s.name == step) {
                continue;
            }
            let all: Vec<&HistoryEntry> = failures(history, step).collect();
            let last = all.last().copied().unwrap_or(h);
            out.push(StepRecord {
                name: step.clone(),
                status: StepStatus::Failed,
                attempts: u32::try_from(all.len()).unwrap_or(u32::MAX),
                attempt: Some(last.attempt),
                started_at: None,
                finished_at: Some(last.at),
                duration: None,
                output: None,
                error: last.error.clone(),
                wake_at: None,
                slept: None,
            });
        }
        out
    }
}

fn event_of(e: sql::EventRow) -> StoredEvent {
    StoredEvent {
        id: e.id,
        name: e.name,
        data: e.payload,
        idempotency_key: e.idempotency_key,
        created_at: e.created_at,
        runs: e.runs,
    }
}

fn blocker_of(b: sql::BlockerRow) -> Blocker {
    Blocker {
        run_id: b.run_id,
        function_id: b.function_id,
        state: b.state,
        kind: BlockerKind::parse(&b.blocker),
        rule: b.rule,
        key: b.key,
        in_use: b.in_use.map(count),
        limit: b.limit.map(count),
        next_possible_start: b.next_possible_start,
        detail: b.detail,
        step: None,
    }
}

/// The history rows as entries: replays marked, and the cancel reason on the
/// entry that cancelled the run as it now stands.
fn history_of(run: &Run, rows: Vec<sql::HistoryRow>) -> Vec<HistoryEntry> {
    let mut out: Vec<HistoryEntry> = Vec::with_capacity(rows.len());
    for h in rows {
        let state = h.state;
        let replayed = state == RunState::Queued && out.last().is_some_and(|p| p.state.is_finished());
        out.push(HistoryEntry {
            at: h.at,
            state,
            attempt: count(h.attempt),
            worker_id: h.worker_id,
            error: h.error,
            step: h.step,
            replayed,
            cancel_reason: None,
        });
    }
    if matches!(run.state, RunState::Cancelled | RunState::Skipped)
        && let Some(last) = out.iter_mut().rev().find(|h| h.state == run.state)
    {
        last.cancel_reason = run.cancel_reason.clone();
    }
    out
}

/// Executions from the history: each claim (`running`) to the next entry.
fn attempts_of(history: &[HistoryEntry]) -> Vec<AttemptRecord> {
    let mut out = Vec::new();
    for (i, h) in history.iter().enumerate() {
        if h.state != RunState::Running {
            continue;
        }
        let end = history.get(i + 1);
        let outcome = match end {
            None => AttemptOutcome::Running,
            Some(e) => match e.state {
                RunState::Completed => AttemptOutcome::Completed,
                RunState::Failed => AttemptOutcome::Failed,
                RunState::Sleeping => AttemptOutcome::Slept,
                RunState::Waiting => AttemptOutcome::Waited,
                RunState::Cancelled | RunState::Skipped => AttemptOutcome::Cancelled,
                RunState::Queued if e.error.as_deref().is_some_and(|m| m.starts_with("lease expired")) => {
                    AttemptOutcome::LeaseLost
                }
                RunState::Queued if e.error.is_some() => AttemptOutcome::Retried,
                RunState::Queued => AttemptOutcome::Released,
                // A new claim straight after (the lease was taken over).
                _ => AttemptOutcome::LeaseLost,
            },
        };
        out.push(AttemptRecord {
            attempt: h.attempt,
            worker_id: h.worker_id,
            started_at: h.at,
            ended_at: end.map(|e| e.at),
            outcome,
            error: end.and_then(|e| e.error.clone()),
            failed_step: end.and_then(|e| e.step.clone()),
        });
    }
    out
}

/// Where a replay starts.
///
/// ```
/// assert_ne!(durastep::ReplayFrom::FailedStep, durastep::ReplayFrom::Start);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReplayFrom {
    /// Keep the finished steps: they replay their stored results, and execution
    /// resumes at the step that failed.
    FailedStep,
    /// Discard the stored step results: every step runs again.
    Start,
}

/// What [`Engine::prune`] removed.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let r = engine.prune(std::time::Duration::from_secs(30 * 86_400)).await?;
/// println!("pruned {} runs and {} events in {} batches", r.runs, r.events, r.batches);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct PruneReport {
    /// Finished runs deleted (with their steps and history).
    pub runs: u64,
    /// Events deleted (no run referenced them any more).
    pub events: u64,
    /// Idle flow-control key rows deleted.
    pub flow_keys: u64,
    /// Topic rows deleted (`durastep.topics`: one per event name sent or
    /// awaited; deleted when no wait uses it, made again on the next use).
    pub topics: u64,
    /// Transactions it took.
    pub batches: u64,
}

impl Engine {
    /// The inspection API: reads runs, events, functions and blockers.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let inspector = engine.inspect();
    /// let counts = inspector.counts().await?;
    /// # let _ = counts; Ok(()) }
    /// ```
    pub fn inspect(&self) -> Inspector {
        Inspector::new(self.pool().clone(), self.keyring())
    }

    /// Re-runs a failed or cancelled run: it is queued again, due now, with a
    /// fresh set of attempts (its function's retries, counted from its current
    /// attempt). With [`ReplayFrom::FailedStep`] its finished steps are kept and
    /// return their stored results, so execution resumes at the step that
    /// failed; with [`ReplayFrom::Start`] its stored step results are deleted
    /// (in the same transaction) and every step runs again. Its on-failure
    /// handler, if it had one, is not run a second time should it fail again.
    ///
    /// Errors: [`Error::UnknownRun`]; [`Error::NotReplayable`] for a run that is
    /// not failed or cancelled (left as it was), or whose singleton key has
    /// another active run.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let run = engine.replay(id, durastep::ReplayFrom::FailedStep).await?;
    /// assert_eq!(run.state, durastep::RunState::Queued);
    /// # Ok(()) }
    /// ```
    pub async fn replay(&self, run_id: Uuid, from: ReplayFrom) -> Result<Run, Error> {
        crate::failpoint!(
            "replay-before-commit",
            Err(Error::Database(sqlx::Error::Protocol("failpoint replay-before-commit".into())))
        );
        // The run is read back in the replay's transaction: read after the
        // commit, a worker may already have claimed it.
        let mut tx = self.pool().begin().await.map_err(from_sqlx)?;
        let outcome =
            store::replay(&mut tx, &[run_id], from == ReplayFrom::Start).await.map_err(|e| replay_error(e, run_id))?;
        match outcome.into_iter().next().and_then(|(_, o)| o) {
            None => Err(Error::UnknownRun(run_id)),
            Some(store::ReplayOutcome::NotReplayable(state)) => Err(Error::NotReplayable {
                run_id,
                reason: format!("it is {state}; only failed or cancelled runs can be replayed"),
            }),
            Some(store::ReplayOutcome::Replayed) => {
                let row = store::load_run(&mut *tx, run_id).await.map_err(from_sqlx)?;
                tx.commit().await.map_err(from_sqlx)?;
                // A replayed run has no output, so nothing is left to open.
                Ok(Run::from(row.ok_or(Error::UnknownRun(run_id))?))
            }
        }
    }

    /// Replays every run matching `filter` (all pages; the filter's limit and
    /// cursor are ignored) that is failed or cancelled; with no state in the
    /// filter, every failed one. Returns the ids of the runs queued again, in
    /// the order they were created. Runs are replayed in transactions of up to
    /// 500, each run at most once per call (one that fails again while the
    /// call goes on is left failed).
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// use durastep::{RunState, ReplayFrom, inspect::RunFilter};
    /// let filter = RunFilter::new().function("post-to-channel").state(RunState::Failed);
    /// let ids = engine.replay_many(&filter, ReplayFrom::FailedStep).await?;
    /// println!("{} runs queued again", ids.len());
    /// # Ok(()) }
    /// ```
    pub async fn replay_many(&self, filter: &RunFilter, from: ReplayFrom) -> Result<Vec<Uuid>, Error> {
        crate::failpoint!(
            "replay-before-commit",
            Err(Error::Database(sqlx::Error::Protocol("failpoint replay-before-commit".into())))
        );
        let path = filter.path()?;
        let mut states: Vec<&str> = filter
            .states
            .iter()
            .filter(|s| matches!(s, RunState::Failed | RunState::Cancelled))
            .map(|s| s.as_str())
            .collect();
        if filter.states.is_empty() {
            states.push(RunState::Failed.as_str());
        } else if states.is_empty() {
            return Ok(Vec::new());
        }
        let q = sql::RunQuery {
            function: filter.function.as_deref(),
            states: &states,
            created_after: filter.created_after,
            created_before: filter.created_before,
            event_name: filter.event_name.as_deref(),
            idempotency_key: filter.idempotency_key.as_deref(),
            data: path.as_deref().zip(filter.data.as_ref().map(|d| &d.1)),
            before: None,
            limit: store::PRUNE_BATCH,
        };
        let mut replayed = Vec::new();
        // Every run tried once: each batch lists the matching runs after the
        // last one of the batch before (in the order they were created), so a
        // run replayed here that a worker ran and failed again before the next
        // batch was listed is not replayed a second time (nor, failing at once
        // each time, forever).
        let mut after = None;
        loop {
            let batch = sql::matching_run_ids(self.pool(), &q, after).await.map_err(from_sqlx)?;
            let Some(&(last, created)) = batch.last() else {
                return Ok(replayed);
            };
            after = Some((created, last));
            let ids: Vec<Uuid> = batch.into_iter().map(|(id, _)| id).collect();
            let first = ids[0];
            let mut conn = self.pool().acquire().await.map_err(from_sqlx)?;
            let outcome =
                store::replay(&mut conn, &ids, from == ReplayFrom::Start).await.map_err(|e| replay_error(e, first))?;
            // A run that changed state since it was listed no longer matches
            // and is left as it is.
            replayed.extend(
                outcome
                    .into_iter()
                    .filter(|(_, o)| matches!(o, Some(store::ReplayOutcome::Replayed)))
                    .map(|(id, _)| id),
            );
        }
    }

    /// Deletes finished runs (completed, failed, cancelled, skipped) that
    /// finished more than `older_than` ago, with their step results, history
    /// and events (an event goes when no run references it any more), plus
    /// events older than that which started no run, and idle flow-control key
    /// rows. Works in transactions of 500 rows that skip rows others hold, so
    /// it never waits on a worker and holds no lock for long; repeats until a
    /// batch finds nothing. An idempotency key is forgotten when its event is
    /// pruned. Workers can do this on their own: [`crate::WorkerOptions::retention`].
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let report = engine.prune(std::time::Duration::from_secs(14 * 86_400)).await?;
    /// # let _ = report; Ok(()) }
    /// ```
    pub async fn prune(&self, older_than: Duration) -> Result<PruneReport, Error> {
        let t = store::prune_all(self.pool(), older_than, u64::MAX).await.map_err(from_sqlx)?;
        Ok(PruneReport { runs: t.runs, events: t.events, flow_keys: t.flow_keys, topics: t.topics, batches: t.batches })
    }
}

fn replay_error(e: sqlx::Error, run_id: Uuid) -> Error {
    if let sqlx::Error::Database(db) = &e
        && db.constraint() == Some("runs_singleton")
    {
        return Error::NotReplayable {
            run_id,
            reason: "another run with its singleton key is active; cancel or finish it first".into(),
        };
    }
    from_sqlx(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names people and scripts see agree: `as_str` is the JSON name.
    #[test]
    fn names_match_their_json() {
        use AttemptOutcome as A;
        for o in [
            A::Running,
            A::Completed,
            A::Retried,
            A::Failed,
            A::LeaseLost,
            A::Slept,
            A::Waited,
            A::Cancelled,
            A::Released,
        ] {
            assert_eq!(serde_json::to_value(o).unwrap(), o.as_str());
        }
        for k in
            [BlockerKind::Concurrency, BlockerKind::WaitForEvent, BlockerKind::RetryBackoff, BlockerKind::RateLimit]
        {
            assert_eq!(serde_json::to_value(k).unwrap(), k.as_str());
            assert_eq!(BlockerKind::parse(k.as_str()), k);
        }
        for s in RunState::ALL {
            assert_eq!(serde_json::to_value(s).unwrap(), s.as_str());
        }
    }
}
