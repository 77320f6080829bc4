//! The step context: what a handler uses to run checkpointed steps and to sleep.
//!
//! Architecture invariant: control flow never travels through user-visible
//! errors. When a step fails, a sleep suspends or the lease is lost, the context
//! tells the executor through a private signal and the call never returns; the
//! executor then drops the handler's future. User code cannot swallow a
//! suspension by catching an error.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::checkpoint::Writer;
use crate::codec::{self, Keyring};
use crate::event::{Event, SendReceipt};
use crate::failure::{HandlerError, HandlerResult};
use crate::limits::{self, Limits};
use crate::store::{self, PendingWrite, StepTiming, WriteOutcome};

/// The future a [`Ctx::step_tx`] closure returns: it borrows the step's connection.
pub type TxFuture<'c, T> = Pin<Box<dyn Future<Output = HandlerResult<T>> + Send + 'c>>;

/// Why an attempt stopped before its handler returned.
#[derive(Debug)]
pub(crate) enum Signal {
    /// A step failed; the attempt ends with this error.
    StepFailed(HandlerError),
    /// The run is sleeping; nothing more to write.
    Suspended,
    /// The attempt lost its lease: nothing more may be written.
    Fenced,
}

struct Inner {
    run_id: Uuid,
    function_id: String,
    event_id: Uuid,
    attempt: u32,
    epoch: i64,
    /// Step results stored before this attempt began, loaded with the claim.
    stored: Mutex<HashMap<String, Value>>,
    /// Occurrences of each step name so far in this attempt.
    counters: Mutex<HashMap<String, u32>>,
    signal: Mutex<Option<oneshot::Sender<Signal>>>,
    lost: CancellationToken,
    writer: Writer,
    pool: PgPool,
    limits: Limits,
    keyring: Option<Arc<Keyring>>,
    /// The database clock at the claim, and when the claim answered: the
    /// database time now is at least `db_now + claimed_at.elapsed()`.
    db_now: DateTime<Utc>,
    claimed_at: Instant,
    /// The attempt's `run` span: the parent of every step span, also of a step
    /// whose future the handler spawned.
    span: tracing::Span,
}

/// The context of one attempt of one run. Cheap to clone; hand it to closures.
///
/// ```
/// use durastep::{Ctx, Function};
/// use std::time::Duration;
///
/// let f = Function::new("remind").on_event("trial/started").handler(|ctx: Ctx, email: String| async move {
///     ctx.step("welcome", || async { Ok(format!("welcome sent to {email}")) }).await?;
///     ctx.sleep("wait-3-days", Duration::from_secs(3 * 86_400)).await?;
///     ctx.step("reminder", || async { Ok(()) }).await?;
///     Ok(())
/// });
/// # let _ = f;
/// ```
#[derive(Clone)]
pub struct Ctx {
    inner: Arc<Inner>,
}

/// Everything an attempt's context is built from.
pub(crate) struct CtxParts {
    pub run_id: Uuid,
    pub function_id: String,
    pub event_id: Uuid,
    pub attempt: u32,
    pub epoch: i64,
    pub stored: HashMap<String, Value>,
    pub signal: oneshot::Sender<Signal>,
    pub lost: CancellationToken,
    pub writer: Writer,
    pub pool: PgPool,
    pub limits: Limits,
    pub keyring: Option<Arc<Keyring>>,
    pub db_now: DateTime<Utc>,
    pub claimed_at: Instant,
    pub span: tracing::Span,
}

impl Ctx {
    pub(crate) fn new(p: CtxParts) -> Self {
        Ctx {
            inner: Arc::new(Inner {
                run_id: p.run_id,
                function_id: p.function_id,
                event_id: p.event_id,
                attempt: p.attempt,
                epoch: p.epoch,
                stored: Mutex::new(p.stored),
                counters: Mutex::new(HashMap::new()),
                signal: Mutex::new(Some(p.signal)),
                lost: p.lost,
                writer: p.writer,
                pool: p.pool,
                limits: p.limits,
                keyring: p.keyring,
                db_now: p.db_now,
                claimed_at: p.claimed_at,
                span: p.span,
            }),
        }
    }

    /// The run's id.
    ///
    /// ```
    /// # fn f(ctx: durastep::Ctx) {
    /// let id: uuid::Uuid = ctx.run_id();
    /// # let _ = id; }
    /// ```
    pub fn run_id(&self) -> Uuid {
        self.inner.run_id
    }

    /// The function's id.
    ///
    /// ```
    /// # fn f(ctx: durastep::Ctx) { println!("{}", ctx.function_id()); }
    /// ```
    pub fn function_id(&self) -> &str {
        &self.inner.function_id
    }

    /// The id of the event that started the run.
    ///
    /// ```
    /// # fn f(ctx: durastep::Ctx) { let _ = ctx.event_id(); }
    /// ```
    pub fn event_id(&self) -> Uuid {
        self.inner.event_id
    }

    /// The attempt number, from 1. Waking from a sleep is not a new attempt.
    ///
    /// ```
    /// # fn f(ctx: durastep::Ctx) { assert!(ctx.attempt() >= 1); }
    /// ```
    pub fn attempt(&self) -> u32 {
        self.inner.attempt
    }

    /// A key that is the same on every attempt of this run: hand it (joined with
    /// the step's name) to an external API as its idempotency token, so a step
    /// body that runs twice (its worker died before the checkpoint) still writes
    /// once.
    ///
    /// ```
    /// # fn f(ctx: durastep::Ctx) {
    /// let token = format!("{}:push", ctx.idempotency_key());
    /// # let _ = token; }
    /// ```
    pub fn idempotency_key(&self) -> String {
        self.inner.run_id.to_string()
    }

    /// The database clock now, as well as this worker knows it: never ahead of
    /// the database (it is the claim's database time plus the time elapsed since).
    ///
    /// ```
    /// # fn f(ctx: durastep::Ctx) { let _ = ctx.db_time(); }
    /// ```
    pub fn db_time(&self) -> DateTime<Utc> {
        let elapsed = chrono::Duration::from_std(self.inner.claimed_at.elapsed()).unwrap_or_default();
        self.inner.db_now + elapsed
    }

    /// The step key of the next call of `name`: the name, then `name#2`, `name#3` ...
    fn next_key(&self, name: &str) -> Result<String, HandlerError> {
        limits::check_step_name(name, &self.inner.limits).map_err(|e| HandlerError::permanent(e.to_string()))?;
        let mut counters = self.inner.counters.lock().unwrap_or_else(|p| p.into_inner());
        let n = counters.entry(name.to_owned()).or_insert(0);
        *n += 1;
        Ok(if *n == 1 { name.to_owned() } else { format!("{name}#{n}") })
    }

    fn stored<T: DeserializeOwned>(&self, key: &str) -> Option<HandlerResult<T>> {
        let value = self.inner.stored.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()?;
        Some(self.open(key, value))
    }

    /// Opens (when sealed) and decodes a stored step result.
    fn open<T: DeserializeOwned>(&self, key: &str, value: Value) -> HandlerResult<T> {
        let aad = codec::step_aad(self.inner.run_id, key);
        let value = codec::open_value(self.inner.keyring.as_deref(), &aad, value)
            .map_err(|e| HandlerError::permanent(format!("step {key}: stored output cannot be opened: {e}")))?;
        decode(key, value)
    }

    /// Seals (when a keyring is set) a checked step output.
    fn seal(&self, key: &str, text: String) -> String {
        codec::seal_text(self.inner.keyring.as_deref(), &codec::step_aad(self.inner.run_id, key), text)
    }

    /// Ends the attempt: tells the executor why, then never returns.
    async fn stop<T>(&self, signal: Signal) -> T {
        if let Some(tx) = self.inner.signal.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(signal);
        }
        std::future::pending().await
    }

    /// When a step began and ended, by the database clock as this attempt knows it.
    fn timing(&self, started_at: DateTime<Utc>) -> StepTiming {
        StepTiming {
            started_at,
            finished_at: self.db_time(),
            attempt: i32::try_from(self.inner.attempt).unwrap_or(i32::MAX),
        }
    }

    async fn checkpoint(&self, key: &str, value: Value, started_at: DateTime<Utc>) -> HandlerResult<Option<Value>> {
        let output = match limits::check_payload(&value, &self.inner.limits) {
            Ok(text) => self.seal(key, text),
            Err(e) => return Err(HandlerError::permanent(format!("step {key}: output refused: {e}"))),
        };
        crate::failpoint!("step-after-body", Err(HandlerError::new("failpoint step-after-body")));
        let write = PendingWrite::Checkpoint {
            run_id: self.inner.run_id,
            epoch: self.inner.epoch,
            key: key.to_owned(),
            output,
            timing: self.timing(started_at),
        };
        match self.inner.writer.write(write).await {
            Ok(WriteOutcome::Stored) => {
                crate::failpoint!("step-after-checkpoint", Err(HandlerError::new("failpoint step-after-checkpoint")));
                Ok(None)
            }
            Ok(WriteOutcome::Adopted(stored)) => Ok(Some(stored)),
            Ok(WriteOutcome::Fenced) => self.stop(Signal::Fenced).await,
            Err(e) => Err(HandlerError::new(format!("step {key}: checkpoint not stored: {e}"))),
        }
    }

    /// Runs `f` once for this run and checkpoints its output.
    ///
    /// If this step's result is already stored (an earlier attempt finished it),
    /// the stored value is returned and `f` does not run. Otherwise `f` runs and
    /// its output is stored before this call returns. If `f` fails, the attempt
    /// ends and the run is retried with backoff: finished steps are not redone.
    /// Calling the same name again in one run makes a new step (`name#2`, ...).
    /// Steps may run concurrently (`tokio::join!`); their keys are assigned when
    /// `step` is called, so they are deterministic.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// let total: u64 = ctx.step("sum", || async { Ok(40 + 2) }).await?;
    /// let (a, b) = tokio::join!(
    ///     ctx.step("fetch-a", || async { Ok(1u8) }),
    ///     ctx.step("fetch-b", || async { Ok(2u8) }),
    /// );
    /// assert_eq!(total + u64::from(a? + b?), 45);
    /// # Ok(()) }
    /// ```
    pub fn step<T, F, Fut>(&self, name: &str, f: F) -> impl Future<Output = HandlerResult<T>> + Send + use<T, F, Fut>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = HandlerResult<T>> + Send,
    {
        let key = self.next_key(name);
        let ctx = self.clone();
        let name = name.to_owned();
        async move {
            let key = key?;
            if let Some(stored) = ctx.stored(&key) {
                return stored;
            }
            let span = tracing::info_span!(parent: &ctx.inner.span, "step", step = %key, attempt = ctx.inner.attempt);
            async {
                if ctx.inner.lost.is_cancelled() {
                    return ctx.stop(Signal::Fenced).await;
                }
                crate::failpoint!("step-before-body", Err(HandlerError::new("failpoint step-before-body")));
                let started_at = ctx.db_time();
                let timer = crate::metrics::StepTimer::start(&ctx.inner.function_id, &name);
                let value = match f().await {
                    Ok(v) => v,
                    Err(e) => return ctx.stop(Signal::StepFailed(annotate(&key, e).at_step(&key))).await,
                };
                let json = match serde_json::to_value(&value) {
                    Ok(j) => j,
                    Err(e) => {
                        let e = HandlerError::permanent(format!("step {key}: output does not serialize: {e}"));
                        return ctx.stop(Signal::StepFailed(e.at_step(&key))).await;
                    }
                };
                let stored = ctx.checkpoint(&key, json, started_at).await;
                if stored.is_ok() {
                    timer.finish();
                }
                match stored {
                    Ok(None) => Ok(value),
                    Ok(Some(stored)) => ctx.open(&key, stored),
                    Err(e) => ctx.stop(Signal::StepFailed(e.at_step(&key))).await,
                }
            }
            .instrument(span)
            .await
        }
    }

    /// A step whose database writes commit together with its checkpoint.
    ///
    /// `f` gets the connection of a transaction; the step result is stored in
    /// that same transaction, behind the fencing check. Either both commit or
    /// neither does, so the writes happen exactly once. The transaction is open
    /// while `f` runs: keep `f` to database work.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// let id: i64 = ctx
    ///     .step_tx("log", |conn| Box::pin(async move {
    ///         let id: i64 = sqlx::query_scalar("SELECT 42").fetch_one(&mut *conn).await?;
    ///         Ok(id)
    ///     }))
    ///     .await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub fn step_tx<T, F>(&self, name: &str, f: F) -> impl Future<Output = HandlerResult<T>> + Send + use<T, F>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, T> + Send,
    {
        let key = self.next_key(name);
        let ctx = self.clone();
        let name = name.to_owned();
        async move { ctx.step_tx_key(key?, f, &name).await }
    }

    async fn step_tx_key<T, F>(&self, key: String, f: F, name: &str) -> HandlerResult<T>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, T> + Send,
    {
        let ctx = self;
        let span = tracing::info_span!(parent: &ctx.inner.span, "step_tx", step = %key, attempt = ctx.inner.attempt);
        async move {
            if let Some(stored) = ctx.stored(&key) {
                return stored;
            }
            if ctx.inner.lost.is_cancelled() {
                return ctx.stop(Signal::Fenced).await;
            }
            let timer = crate::metrics::StepTimer::start(&ctx.inner.function_id, name);
            let outcome = ctx.run_step_tx(&key, f).await;
            if matches!(outcome, Ok(TxOutcome::Committed(_) | TxOutcome::Adopted(_))) {
                timer.finish();
            }
            match outcome {
                Ok(TxOutcome::Committed(v)) => Ok(v),
                Ok(TxOutcome::Adopted(stored)) => ctx.open(&key, stored),
                Ok(TxOutcome::Fenced) => ctx.stop(Signal::Fenced).await,
                Err(e) => ctx.stop(Signal::StepFailed(e.at_step(&key))).await,
            }
        }
        .instrument(span)
        .await
    }

    /// Sends an event from the run, as a step: its fan-out (the runs it starts,
    /// the waits it resumes, the runs it cancels) happens once for this run,
    /// however often the attempt is retried or the handler replayed. The event
    /// is stored in the same transaction as the step's checkpoint, behind the
    /// fencing check, and carries a deterministic idempotency key (the run id
    /// and the step key, `"<run id>:<step key>"`) unless you gave it one; so a
    /// lost commit acknowledgement or a stale attempt never sends it twice.
    /// Returns the receipt of the send (the stored one on replays).
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// use durastep::Event;
    /// let receipt = ctx
    ///     .send_event("notify-finance", Event::new("budget/pushed", &serde_json::json!({"campaign_id": "c_9"})))
    ///     .await?;
    /// println!("started {} runs", receipt.run_ids.len());
    /// # Ok(()) }
    /// ```
    pub async fn send_event(&self, name: &str, event: Event) -> HandlerResult<SendReceipt> {
        let key = self.next_key(name)?;
        let event = if event.has_idempotency_key() {
            event
        } else {
            let k = format!("{}:{key}", self.inner.run_id);
            event.idempotency_key(k)
        };
        let prepared = event
            .prepare(&self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: event refused: {e}")))?;
        self.step_tx_key(
            key,
            move |conn| {
                Box::pin(async move {
                    let mut receipts = crate::engine::insert(conn, std::slice::from_ref(&prepared))
                        .await
                        .map_err(|e| HandlerError::new(format!("send failed: {e}")))?;
                    Ok(receipts.remove(0))
                })
            },
            name,
        )
        .await
    }

    async fn run_step_tx<T, F>(&self, key: &str, f: F) -> HandlerResult<TxOutcome<T>>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> FnOnce(&'c mut PgConnection) -> TxFuture<'c, T> + Send,
    {
        let db = |e: sqlx::Error| HandlerError::new(format!("step {key}: {e}"));
        let started_at = self.db_time();
        let mut tx = self.inner.pool.begin().await.map_err(db)?;
        let value = f(&mut tx).await.map_err(|e| annotate(key, e))?;
        let json = serde_json::to_value(&value)
            .map_err(|e| HandlerError::permanent(format!("step {key}: output does not serialize: {e}")))?;
        let text = limits::check_payload(&json, &self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: output refused: {e}")))?;
        let text = self.seal(key, text);
        match store::checkpoint_in_tx(&mut tx, self.inner.run_id, self.inner.epoch, key, &text, self.timing(started_at))
            .await
            .map_err(db)?
        {
            None => return Ok(TxOutcome::Fenced),
            Some(Some(stored)) => return Ok(TxOutcome::Adopted(stored)),
            Some(None) => {}
        }
        crate::failpoint!("step-tx-before-commit", Err(HandlerError::new("failpoint step-tx-before-commit")));
        match tx.commit().await {
            Ok(()) => Ok(TxOutcome::Committed(value)),
            Err(e) => {
                // Ambiguous: the commit may have landed. Our row is the proof.
                let mut conn = self.inner.pool.acquire().await.map_err(db)?;
                match store::load_step(&mut conn, self.inner.run_id, key).await.map_err(db)? {
                    Some(stored) => Ok(TxOutcome::Adopted(stored)),
                    None => Err(db(e)),
                }
            }
        }
    }

    /// Sleeps durably for `duration`, measured from the first time this step ran.
    ///
    /// The wake time is computed once (by the database clock) and checkpointed;
    /// the run leaves the worker and no worker is held while it sleeps, whether
    /// for a second or for months. It never wakes early, and wakes within the
    /// workers' poll interval after its time.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// ctx.sleep("cool-down", std::time::Duration::from_secs(60)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn sleep(&self, name: &str, duration: Duration) -> HandlerResult<()> {
        let key = self.next_key(name)?;
        let wake = chrono::Duration::from_std(duration).unwrap_or(chrono::Duration::MAX);
        let wake_at = self.db_time().checked_add_signed(wake).unwrap_or(DateTime::<Utc>::MAX_UTC);
        self.sleep_key(&key, wake_at).await
    }

    /// Sleeps durably until a point in time, in any time zone (for example the
    /// next 01:30 in `chrono_tz::Europe::Amsterdam`).
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// use chrono::TimeZone;
    /// let at = chrono_tz::Europe::Amsterdam.with_ymd_and_hms(2026, 12, 1, 1, 30, 0).unwrap();
    /// ctx.sleep_until("until-tiktok-reset", at).await?;
    /// # Ok(()) }
    /// ```
    pub async fn sleep_until<Tz: TimeZone>(&self, name: &str, at: DateTime<Tz>) -> HandlerResult<()> {
        let key = self.next_key(name)?;
        self.sleep_key(&key, at.with_timezone(&Utc)).await
    }

    #[tracing::instrument(name = "sleep", parent = &self.inner.span, skip_all, fields(step = %key, attempt = self.inner.attempt))]
    async fn sleep_key(&self, key: &str, wake_at: DateTime<Utc>) -> HandlerResult<()> {
        let wake_at = match self.stored::<SleepRecord>(key) {
            Some(record) => record?.wake_at,
            None => {
                if self.inner.lost.is_cancelled() {
                    return self.stop(Signal::Fenced).await;
                }
                let record = serde_json::to_value(SleepRecord { wake_at }).map_err(HandlerError::from)?;
                match self.checkpoint(key, record, self.db_time()).await {
                    Ok(None) => wake_at,
                    Ok(Some(stored)) => self.open::<SleepRecord>(key, stored)?.wake_at,
                    // Like a failed step: the attempt ends; user code never sees it.
                    Err(e) => return self.stop(Signal::StepFailed(e.at_step(key))).await,
                }
            }
        };
        if self.db_time() >= wake_at {
            return Ok(());
        }
        crate::failpoint!("sleep-after-arming", Err(HandlerError::new("failpoint sleep-after-arming")));
        match store::suspend_until(&self.inner.pool, self.inner.run_id, self.inner.epoch, wake_at).await {
            Ok(Some(false)) => Ok(()),
            Ok(Some(true)) => self.stop(Signal::Suspended).await,
            Ok(None) => self.stop(Signal::Fenced).await,
            Err(e) => {
                let e = HandlerError::new(format!("step {key}: could not suspend: {e}"));
                self.stop(Signal::StepFailed(e.at_step(key))).await
            }
        }
    }
}

/// Which events of a name resume a [`Ctx::wait_for_event`].
///
/// ```
/// use durastep::EventMatch;
/// // The approval of this campaign (its data has `"campaign_id": "c_9"`):
/// let m = EventMatch::field("/campaign_id", &"c_9");
/// // Any event of the name:
/// let any = EventMatch::any();
/// # let _ = (m, any);
/// ```
#[derive(Debug, Clone)]
pub struct EventMatch {
    kind: MatchKind,
}

#[derive(Debug, Clone)]
enum MatchKind {
    Any,
    Field { pointer: String, value: Result<Value, String> },
}

impl EventMatch {
    /// Every event of the awaited name matches.
    ///
    /// ```
    /// let m = durastep::EventMatch::any();
    /// # let _ = m;
    /// ```
    pub fn any() -> Self {
        EventMatch { kind: MatchKind::Any }
    }

    /// Events whose data has `value` at the JSON pointer `pointer` (RFC 6901:
    /// `"/campaign_id"`, `"/order/lines/0/sku"`; `""` is the whole data). The
    /// comparison is JSON equality (`1` and `1.0` are equal, `1` and `"1"` are not).
    ///
    /// ```
    /// let m = durastep::EventMatch::field("/invoice/id", &42);
    /// # let _ = m;
    /// ```
    pub fn field<T: Serialize + ?Sized>(pointer: impl Into<String>, value: &T) -> Self {
        EventMatch {
            kind: MatchKind::Field {
                pointer: pointer.into(),
                value: serde_json::to_value(value).map_err(|e| e.to_string()),
            },
        }
    }
}

/// What a wait stores for its step: the event that resumed it, or a timeout.
#[derive(serde::Deserialize)]
struct WaitRecord {
    /// Present when an event resumed the wait (its data may be JSON `null`).
    #[serde(default)]
    event_id: Option<Uuid>,
    #[serde(default)]
    data: Value,
    #[serde(default)]
    timed_out: bool,
}

impl Ctx {
    /// Suspends the run until an event named `event_name` that `matching`
    /// accepts arrives, or until `timeout` has passed; returns the event's data
    /// (deserialized into `T`), or `None` on timeout.
    ///
    /// While it waits the run is `waiting`: no worker, task, connection or
    /// lease is held. The outcome is checkpointed under the step name `name`, so
    /// later executions of the handler return the same event (or the same
    /// `None`) at once. The timeout is measured by the database clock from the
    /// first time this wait is recorded, and is kept across executions.
    ///
    /// Which events count: exactly those that commit **after** the wait is
    /// recorded. An event that committed before, even a moment before, does not
    /// resume it (it started no wait); if a reply may come before you wait,
    /// look for it in a step first. There is no window in between: a sender
    /// and a waiter of one event name are ordered by a row lock, so an event
    /// that commits after the wait is recorded always resumes it, however the
    /// two transactions interleave. The first event that resumes a wait wins;
    /// later ones are not delivered to it. Data that does not deserialize into
    /// `T` fails the run permanently.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// use durastep::EventMatch;
    /// use std::time::Duration;
    /// #[derive(serde::Deserialize)]
    /// struct Approved { campaign_id: String, by: String }
    ///
    /// let approval: Option<Approved> = ctx
    ///     .wait_for_event("approval", "campaign/approved", EventMatch::field("/campaign_id", &"c_9"), Duration::from_secs(2 * 86_400))
    ///     .await?;
    /// match approval {
    ///     Some(a) => println!("approved by {} ({})", a.by, a.campaign_id),
    ///     None => println!("no approval within two days"),
    /// }
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "wait", parent = &self.inner.span, skip_all, fields(step, attempt = self.inner.attempt))]
    pub async fn wait_for_event<T: DeserializeOwned>(
        &self,
        name: &str,
        event_name: &str,
        matching: EventMatch,
        timeout: Duration,
    ) -> HandlerResult<Option<T>> {
        let key = self.next_key(name)?;
        tracing::Span::current().record("step", key.as_str());
        if let Some(stored) = self.stored::<Value>(&key) {
            return wait_result(&key, stored?);
        }
        if self.inner.lost.is_cancelled() {
            return self.stop(Signal::Fenced).await;
        }
        limits::check_name("event name", event_name, &self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: {e}")))?;
        let (path, value) = match matching.kind {
            MatchKind::Any => (None, None),
            MatchKind::Field { pointer, value } => {
                let path = crate::function::pointer_path(&pointer)
                    .map_err(|e| HandlerError::permanent(format!("step {key}: {e}")))?;
                let value = value
                    .map_err(|e| HandlerError::permanent(format!("step {key}: match value does not serialize: {e}")))?;
                let text = limits::check_payload(&value, &self.inner.limits)
                    .map_err(|e| HandlerError::permanent(format!("step {key}: match value refused: {e}")))?;
                (Some(path), Some(text))
            }
        };
        // Beyond a century is "no timeout" (the deadline is then 'infinity').
        let timeout_secs = (timeout < Duration::from_secs(100 * 365 * 86_400)).then_some(timeout.as_secs_f64());
        let outcome = store::wait_for_event(
            &self.inner.pool,
            self.inner.run_id,
            self.inner.epoch,
            &key,
            event_name,
            path.as_deref(),
            value.as_deref(),
            timeout_secs,
        )
        .await;
        match outcome {
            Ok(store::WaitOutcome::Suspended) => self.stop(Signal::Suspended).await,
            Ok(store::WaitOutcome::Fenced) => self.stop(Signal::Fenced).await,
            Ok(store::WaitOutcome::Resolved(stored)) => {
                let stored = self.open::<Value>(&key, stored)?;
                wait_result(&key, stored)
            }
            Err(e) => {
                let e = HandlerError::new(format!("step {key}: could not wait: {e}"));
                self.stop(Signal::StepFailed(e.at_step(&key))).await
            }
        }
    }
}

/// Why a child run started with [`Ctx::invoke`] gave no output.
///
/// ```
/// # fn f(e: durastep::ChildError) {
/// match e {
///     durastep::ChildError::Failed { error, .. } => eprintln!("child failed: {error}"),
///     other => eprintln!("{other}"),
/// }
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChildError {
    /// The child ended `failed` (out of attempts, or a permanent error).
    #[error("child run {run_id} failed: {error}")]
    Failed {
        /// The child run.
        run_id: Uuid,
        /// Its last error.
        error: String,
    },
    /// The child was cancelled.
    #[error("child run {run_id} was cancelled: {reason}")]
    Cancelled {
        /// The child run.
        run_id: Uuid,
        /// Its cancel reason.
        reason: String,
    },
    /// The child did not finish within the invoke's timeout; it was cancelled.
    #[error("child run did not finish in time (it was cancelled)")]
    TimedOut,
}

/// What an invoke stores for its step: the child's outcome, or a timeout.
#[derive(serde::Deserialize)]
struct ChildRecord {
    #[serde(default)]
    child_run_id: Option<Uuid>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    output: Option<Value>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    timed_out: bool,
}

impl Ctx {
    /// Starts a run of the function `function_id` with `input` and suspends
    /// this run until that child run finishes; returns its output (deserialized
    /// into `O`), or why it has none ([`ChildError`]: it failed, was cancelled,
    /// or did not finish within `timeout`, in which case it is cancelled).
    ///
    /// The child is started once per run and step name: a parent that executes
    /// this call again (after a crash, a retry, a wake-up) finds its child (the
    /// database allows one child per parent step) and its stored outcome. While
    /// the parent waits it is `waiting` and holds no worker. The child's
    /// outcome is delivered in the transaction that finishes it, whatever
    /// finished it (its worker, the reaper, a cancel). The timeout is measured
    /// by the database clock from the child's creation. An unknown function id
    /// fails the parent permanently. The child is an ordinary run: its own
    /// retries, steps and `on_failure` apply; cancelling the parent does not
    /// cancel it.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// use std::time::Duration;
    /// let token: Result<String, durastep::ChildError> = ctx
    ///     .invoke("rotate", "meta-token-rotation", &serde_json::json!({"account": "act_1"}), Duration::from_secs(600))
    ///     .await?;
    /// match token {
    ///     Ok(t) => println!("new token {t}"),
    ///     Err(e) => println!("rotation did not happen: {e}"),
    /// }
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "invoke", parent = &self.inner.span, skip_all, fields(step, attempt = self.inner.attempt))]
    pub async fn invoke<I: Serialize + ?Sized, O: DeserializeOwned>(
        &self,
        name: &str,
        function_id: &str,
        input: &I,
        timeout: Duration,
    ) -> HandlerResult<Result<O, ChildError>> {
        let key = self.next_key(name)?;
        tracing::Span::current().record("step", key.as_str());
        if let Some(stored) = self.stored::<Value>(&key) {
            return self.child_result(&key, stored?);
        }
        if self.inner.lost.is_cancelled() {
            return self.stop(Signal::Fenced).await;
        }
        limits::check_function_id(function_id, &self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: {e}")))?;
        let input = serde_json::to_value(input)
            .map_err(|e| HandlerError::permanent(format!("step {key}: child input does not serialize: {e}")))?;
        let input = limits::check_payload(&input, &self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: child input refused: {e}")))?;
        let timeout_secs = (timeout < Duration::from_secs(100 * 365 * 86_400)).then_some(timeout.as_secs_f64());
        let outcome = store::invoke(
            &self.inner.pool,
            self.inner.run_id,
            self.inner.epoch,
            &key,
            function_id,
            &input,
            timeout_secs,
        )
        .await;
        match outcome {
            Ok(store::InvokeOutcome::Suspended) => self.stop(Signal::Suspended).await,
            Ok(store::InvokeOutcome::Fenced) => self.stop(Signal::Fenced).await,
            Ok(store::InvokeOutcome::UnknownFunction) => {
                Err(HandlerError::permanent(format!("step {key}: no function has the id {function_id:?}")))
            }
            Ok(store::InvokeOutcome::Resolved(stored)) => {
                let stored = self.open::<Value>(&key, stored)?;
                self.child_result(&key, stored)
            }
            Err(e) => {
                let e = HandlerError::new(format!("step {key}: could not invoke: {e}"));
                self.stop(Signal::StepFailed(e.at_step(&key))).await
            }
        }
    }

    fn child_result<O: DeserializeOwned>(&self, key: &str, stored: Value) -> HandlerResult<Result<O, ChildError>> {
        let record: ChildRecord = decode(key, stored)?;
        if record.timed_out {
            return Ok(Err(ChildError::TimedOut));
        }
        let run_id = record.child_run_id.unwrap_or_default();
        let error = record.error.unwrap_or_default();
        match record.state.as_deref() {
            Some("completed") => {
                let output = record.output.unwrap_or(Value::Null);
                let output = codec::open_value(self.inner.keyring.as_deref(), &codec::output_aad(run_id), output)
                    .map_err(|e| HandlerError::permanent(format!("step {key}: child output cannot be opened: {e}")))?;
                decode(key, output).map(Ok)
            }
            Some("failed") => Ok(Err(ChildError::Failed { run_id, error })),
            _ => Ok(Err(ChildError::Cancelled { run_id, reason: error })),
        }
    }
}

fn wait_result<T: DeserializeOwned>(key: &str, stored: Value) -> HandlerResult<Option<T>> {
    let record: WaitRecord = decode(key, stored)?;
    match (record.event_id, record.timed_out) {
        (Some(_), _) => decode(key, record.data).map(Some),
        (None, true) => Ok(None),
        (None, false) => {
            Err(HandlerError::permanent(format!("step {key}: stored wait result is neither an event nor a timeout")))
        }
    }
}

enum TxOutcome<T> {
    Committed(T),
    Adopted(Value),
    Fenced,
}

/// What a sleep step stores: its wake time, computed once.
#[derive(Serialize, serde::Deserialize)]
struct SleepRecord {
    wake_at: DateTime<Utc>,
}

fn decode<T: DeserializeOwned>(key: &str, value: Value) -> HandlerResult<T> {
    serde_json::from_value(value).map_err(|e| {
        HandlerError::permanent(format!(
            "step {key}: stored output does not deserialize into {}: {e}",
            std::any::type_name::<T>()
        ))
    })
}

fn annotate(key: &str, e: HandlerError) -> HandlerError {
    let message = format!("step {key}: {}", e.message());
    match (e.is_permanent(), e.retry_after_delay()) {
        (true, _) => HandlerError::permanent(message),
        (false, Some(d)) => HandlerError::retry_after(message, d),
        (false, None) => HandlerError::new(message),
    }
}

impl std::fmt::Debug for Ctx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("run_id", &self.inner.run_id)
            .field("function_id", &self.inner.function_id)
            .field("attempt", &self.inner.attempt)
            .finish_non_exhaustive()
    }
}
