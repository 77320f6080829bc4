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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
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
use crate::codec::{self, Keyring, Kind, Place};
use crate::event::{Event, SendReceipt};
use crate::failure::{HandlerError, HandlerResult};
use crate::journal::{self, Ask, Divergence, EntryKind, Journal, JournalEntry};
use crate::limits::{self, Limits};
use crate::store::{self, Fence, PendingWrite, StepTiming, WriteOutcome};

/// A boxed step-transaction future, from before [`Ctx::step_tx`] took async
/// closures. Not needed any more: write `async move |conn| { .. }`.
pub type TxFuture<'c, T> = Pin<Box<dyn Future<Output = HandlerResult<T>> + Send + 'c>>;

/// The body of a [`Ctx::step_tx`]: implemented for every async closure (and
/// every closure returning a future) that takes the step's connection and
/// whose future is `Send`. You never implement it yourself.
///
/// ```
/// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
/// let n: i64 = ctx.step_tx("count", async |conn| {
///     Ok(sqlx::query_scalar("SELECT 1::bigint").fetch_one(&mut *conn).await?)
/// }).await?;
/// # let _ = n; Ok(()) }
/// ```
pub trait TxBody<'c, T>: FnOnce(&'c mut PgConnection) -> <Self as TxBody<'c, T>>::Fut + Send {
    /// The future the closure returns; it may borrow the connection.
    type Fut: Future<Output = HandlerResult<T>> + Send + 'c;
}

impl<'c, T, F, Fut> TxBody<'c, T> for F
where
    F: FnOnce(&'c mut PgConnection) -> Fut + Send,
    Fut: Future<Output = HandlerResult<T>> + Send + 'c,
{
    type Fut = Fut;
}

/// Why an attempt stopped before its handler returned.
#[derive(Debug)]
pub(crate) enum Signal {
    /// A step failed; the attempt ends with this error.
    StepFailed(HandlerError),
    /// The run is sleeping; nothing more to write.
    Suspended,
    /// The attempt lost its lease: nothing more may be written.
    Fenced,
    /// A step of the attempt cancelled its own run (an event it sent matched
    /// the run's `cancel_on`, or its singleton key with `CancelOld`); the step
    /// committed, the run is `cancelled`, nothing more may be written.
    Cancelled,
    /// The replay asked for something other than what the run recorded.
    Diverged(Divergence),
    /// A dry replay ([`crate::Engine::check_deploy`]) reached work that was not recorded.
    Reached,
    /// The test kit crashed the attempt: drop the handler, write nothing.
    #[cfg(feature = "testing")]
    Crashed,
}

/// A step key handed out to a call, with its place in the run's journal.
pub(crate) struct Asked {
    key: String,
    kind: EntryKind,
    ask: Ask,
}

/// Why a call got no key.
enum KeyError {
    Refused(HandlerError),
    Diverged(Divergence),
}

struct Inner {
    run_id: Uuid,
    function_id: String,
    event_id: Uuid,
    attempt: u32,
    /// What every write of this attempt takes (None: a dry replay, which writes nothing).
    fence: Option<Fence>,
    /// Step results stored before this attempt began, loaded with the claim.
    stored: Mutex<HashMap<String, Value>>,
    /// Occurrences of each step name so far in this attempt.
    counters: Mutex<HashMap<String, u32>>,
    /// What the run recorded, and where this attempt's replay stands in it.
    journal: Arc<Mutex<Journal>>,
    /// A dry replay: stop at the first unrecorded entry, write nothing.
    dry: bool,
    /// The test kit's crash and failure injection.
    #[cfg(feature = "testing")]
    probe: Option<Arc<crate::probe::Probe>>,
    /// Bytes of the step results stored before this attempt (computed at its
    /// first checkpoint), and bytes this attempt stored since: `max_run_bytes`.
    stored_bytes: OnceLock<usize>,
    added_bytes: AtomicUsize,
    /// Step keys this attempt made that were not stored before: `max_steps_per_run`.
    new_keys: AtomicUsize,
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
    /// The function's default step timeout ([`crate::FunctionBuilder::step_timeout`]).
    step_timeout: Option<Duration>,
    /// Waits of this attempt in flight at once; see [`Ctx::wait_for_event`].
    waits: Mutex<WaitGate>,
}

/// The waits of one attempt that are recording themselves at once (a handler
/// that joins two `wait_for_event`s): the attempt suspends only when the last
/// of them has recorded its wait, so no wait is left unrecorded.
#[derive(Default)]
struct WaitGate {
    in_flight: usize,
    suspended: bool,
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
    /// The claim's fence (None: a dry replay).
    pub fence: Option<Fence>,
    pub stored: HashMap<String, Value>,
    pub journal: Arc<Mutex<Journal>>,
    pub dry: bool,
    #[cfg(feature = "testing")]
    pub probe: Option<Arc<crate::probe::Probe>>,
    pub signal: oneshot::Sender<Signal>,
    pub lost: CancellationToken,
    pub writer: Writer,
    pub pool: PgPool,
    pub limits: Limits,
    pub keyring: Option<Arc<Keyring>>,
    pub db_now: DateTime<Utc>,
    pub claimed_at: Instant,
    pub span: tracing::Span,
    pub step_timeout: Option<Duration>,
}

impl Ctx {
    pub(crate) fn new(p: CtxParts) -> Self {
        Ctx {
            inner: Arc::new(Inner {
                run_id: p.run_id,
                function_id: p.function_id,
                event_id: p.event_id,
                attempt: p.attempt,
                fence: p.fence,
                stored: Mutex::new(p.stored),
                counters: Mutex::new(HashMap::new()),
                journal: p.journal,
                dry: p.dry,
                #[cfg(feature = "testing")]
                probe: p.probe,
                stored_bytes: OnceLock::new(),
                added_bytes: AtomicUsize::new(0),
                new_keys: AtomicUsize::new(0),
                signal: Mutex::new(Some(p.signal)),
                lost: p.lost,
                writer: p.writer,
                pool: p.pool,
                limits: p.limits,
                keyring: p.keyring,
                db_now: p.db_now,
                claimed_at: p.claimed_at,
                span: p.span,
                step_timeout: p.step_timeout,
                waits: Mutex::new(WaitGate::default()),
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

    /// The lease epoch of this attempt: what every fenced write of it compares
    /// (with the `testing` feature, for fault-injection oracles that must tell
    /// an attempt that started late from the one that took the run over).
    /// Each claim moves it forward by a random amount (1 to 2^31): compare
    /// epochs by order, never count claims with them.
    ///
    /// ```
    /// # fn f(ctx: durastep::Ctx) { assert!(ctx.lease_epoch() >= 0); }
    /// ```
    #[cfg(feature = "testing")]
    pub fn lease_epoch(&self) -> i64 {
        // A dry replay (the deploy check) has no lease: 0.
        self.inner.fence.as_ref().map_or(0, |f| f.epoch())
    }

    /// A key that is the same on every attempt of this run (the run id). For
    /// the idempotency token of one step's external call, prefer
    /// [`Ctx::step_with_key`], which hands each step its own key.
    ///
    /// ```
    /// # fn f(ctx: durastep::Ctx) {
    /// let run_key = ctx.idempotency_key();
    /// # let _ = run_key; }
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

    /// The step key of the next call of `name` (the name, then `name#2`,
    /// `name#3` ...), checked against what the run recorded at its position.
    fn next_key(&self, kind: EntryKind, name: &str) -> Result<Asked, KeyError> {
        limits::check_step_name(name, &self.inner.limits)
            .map_err(|e| KeyError::Refused(HandlerError::permanent(e.to_string())))?;
        let key = {
            let mut counters = self.inner.counters.lock().unwrap_or_else(|p| p.into_inner());
            // Looked up before inserting: a replay calls the same names
            // thousands of times, and `entry` would copy the name each time.
            match counters.get_mut(name) {
                Some(n) => {
                    *n += 1;
                    format!("{name}#{n}")
                }
                None => {
                    counters.insert(name.to_owned(), 1);
                    name.to_owned()
                }
            }
        };
        {
            let stored = self.inner.stored.lock().unwrap_or_else(|p| p.into_inner());
            if !stored.contains_key(&key) {
                let steps = stored.len() + self.inner.new_keys.fetch_add(1, Ordering::Relaxed) + 1;
                let limit = self.inner.limits.max_steps_per_run;
                if steps > limit {
                    let e = limits::LimitError::TooManySteps { limit };
                    return Err(KeyError::Refused(HandlerError::permanent(format!("step {key}: {e}"))));
                }
            }
        }
        let ask = self.inner.journal.lock().unwrap_or_else(|p| p.into_inner()).ask(kind, &key);
        match ask {
            Ok(ask) => Ok(Asked { key, kind, ask }),
            Err((position, recorded)) => Err(KeyError::Diverged(Divergence {
                run_id: self.inner.run_id,
                function_id: self.inner.function_id.clone(),
                position,
                recorded: Some(recorded),
                asked: Some(JournalEntry::new(kind, key)),
            })),
        }
    }

    /// A key, or the end of the attempt on a divergence (which user code never sees).
    async fn asked(&self, key: Result<Asked, KeyError>) -> HandlerResult<Asked> {
        match key {
            Ok(asked) => Ok(asked),
            Err(KeyError::Refused(e)) => Err(e),
            Err(KeyError::Diverged(d)) => {
                tracing::warn!(error = %d, "replay diverged from the recorded run");
                self.stop(Signal::Diverged(d)).await
            }
        }
    }

    /// The attempt's fence. A dry replay has none: it stops here, as at any
    /// new work, before it could write.
    async fn fence(&self) -> Fence {
        match self.inner.fence {
            Some(fence) => fence,
            None => self.stop(Signal::Reached).await,
        }
    }

    /// Before new (unrecorded) work: a dry replay stops here.
    async fn fresh_work(&self) {
        if self.inner.dry {
            self.stop::<()>(Signal::Reached).await;
        }
    }

    /// Records a waited-for or marker entry when it is first asked (steps and
    /// sleeps are recorded with their checkpoint). `Ok(false)`: fenced.
    async fn record(&self, asked: &Asked) -> Result<bool, sqlx::Error> {
        let Ask::Fresh(position) = asked.ask else { return Ok(true) };
        store::record_entry(&self.inner.pool, self.fence().await, position, asked.kind, &asked.key).await
    }

    /// Whether this run took the path of a change named `id`: `true` for runs
    /// that reach this call on code that has it, `false` for runs that had
    /// already gone past this point on code without it (they recorded the old
    /// path here). Like Temporal's patch markers: branch old and new code on it,
    /// so a deploy does not break the runs in flight.
    ///
    /// The first `true` records a marker in the run's journal (one write); a
    /// replay then finds it and answers `true` again. Once no run that took the
    /// old path is left (see [`crate::Engine::check_deploy`]), drop the old
    /// branch and, later, the call: a recorded marker whose call was removed is
    /// skipped.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// if ctx.changed("send-sms-too").await? {
    ///     ctx.step("sms", || async { Ok(()) }).await?;
    /// }
    /// ctx.step("email", || async { Ok(()) }).await?;
    /// # Ok(()) }
    /// ```
    pub async fn changed(&self, id: &str) -> HandlerResult<bool> {
        limits::check_step_name(id, &self.inner.limits).map_err(|e| HandlerError::permanent(e.to_string()))?;
        let answer = self.inner.journal.lock().unwrap_or_else(|p| p.into_inner()).changed(id);
        match answer {
            journal::Changed::Recorded => Ok(true),
            journal::Changed::OldPath => Ok(false),
            journal::Changed::Fresh(position) => {
                self.fresh_work().await;
                if self.inner.lost.is_cancelled() {
                    return self.stop(Signal::Fenced).await;
                }
                let asked = Asked { key: id.to_owned(), kind: EntryKind::Changed, ask: Ask::Fresh(position) };
                match self.record(&asked).await {
                    Ok(true) => Ok(true),
                    Ok(false) => self.stop(Signal::Fenced).await,
                    Err(e) => {
                        let e = HandlerError::new(format!("change marker {id}: not recorded: {e}"));
                        self.stop(Signal::StepFailed(e)).await
                    }
                }
            }
        }
    }

    /// Bytes of the records the claim loaded (counted once, when first needed).
    fn loaded_bytes(&self) -> usize {
        *self.inner.stored_bytes.get_or_init(|| {
            let stored = self.inner.stored.lock().unwrap_or_else(|p| p.into_inner());
            stored.values().map(|v| serde_json::to_string(v).map_or(0, |t| t.len())).sum()
        })
    }

    /// Counts `bytes` more stored step output against `max_run_bytes`.
    fn charge(&self, key: &str, bytes: usize) -> HandlerResult<()> {
        let size = self.loaded_bytes() + self.inner.added_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let limit = self.inner.limits.run_bytes();
        if size > limit {
            let e = limits::LimitError::RunTooLarge { size, limit };
            return Err(HandlerError::permanent(format!("step {key}: output refused: {e}")));
        }
        Ok(())
    }

    /// Before a wait or an invoke, whose record the database writes later (an
    /// event's data, a child's output) with no charge at that time: refuses it
    /// when the run's stored output is already at `max_run_bytes`, so a run can
    /// pass its limit by at most one such record.
    fn room_for_record(&self, key: &str, what: &str) -> HandlerResult<()> {
        let size = self.loaded_bytes() + self.inner.added_bytes.load(Ordering::Relaxed);
        let limit = self.inner.limits.run_bytes();
        if size >= limit {
            let e = limits::LimitError::RunTooLarge { size, limit };
            return Err(HandlerError::permanent(format!("step {key}: {what} refused: {e}")));
        }
        Ok(())
    }

    /// Counts a record the database stored for this attempt (a wait's event, a
    /// child's outcome) against `max_run_bytes`; the next write is refused if
    /// it took the run past its limit.
    fn count_record(&self, stored: &Value) {
        let bytes = serde_json::to_string(stored).map_or(0, |t| t.len());
        self.inner.added_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn stored<T: DeserializeOwned>(&self, key: &str) -> Option<HandlerResult<T>> {
        let value = self.inner.stored.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()?;
        Some(self.open(key, value))
    }

    /// A stored record as it was loaded with the claim, not yet opened.
    fn stored_raw(&self, key: &str) -> Option<Value> {
        self.inner.stored.lock().unwrap_or_else(|p| p.into_inner()).get(key).cloned()
    }

    /// Opens (when sealed) and decodes a stored step result.
    fn open<T: DeserializeOwned>(&self, key: &str, value: Value) -> HandlerResult<T> {
        let place = Place::step(Kind::Step, self.inner.run_id, key);
        let value = codec::open_value(self.inner.keyring.as_deref(), &place, value)
            .map_err(|e| HandlerError::permanent(format!("step {key}: stored output cannot be opened: {e}")))?;
        decode(key, value)
    }

    /// Seals (when a keyring is set; escapes otherwise) a checked step output.
    fn seal(&self, key: &str, value: &Value, text: String) -> String {
        let place = Place::step(Kind::Step, self.inner.run_id, key);
        codec::seal_text(self.inner.keyring.as_deref(), &place, value, text)
    }

    /// Opens a wait result or child outcome. These are written by SQL (the
    /// sender's or the child's transaction, which holds no key): with a
    /// keyring, a plain one is authenticated from its source by `verify`,
    /// then stored sealed in its place; a sealed one must open as `kind`.
    async fn open_record<V, Fut>(&self, key: &str, kind: Kind, stored: Value, verify: V) -> HandlerResult<Value>
    where
        V: FnOnce(Value) -> Fut,
        Fut: Future<Output = Result<Value, HandlerError>>,
    {
        let place = Place::step(kind, self.inner.run_id, key);
        let Some(keyring) = self.inner.keyring.as_deref() else {
            return codec::open_value(None, &place, stored)
                .map_err(|e| HandlerError::permanent(format!("step {key}: stored record cannot be opened: {e}")));
        };
        if !codec::is_unsealed(&stored) {
            return codec::open_value(Some(keyring), &place, stored)
                .map_err(|e| HandlerError::permanent(format!("step {key}: stored record cannot be opened: {e}")));
        }
        let record = verify(stored.clone()).await?;
        if self.inner.dry {
            // A dry replay writes nothing: the record stays plain until a real attempt reads it.
            return Ok(record);
        }
        let sealed = codec::seal_record(keyring, &place, &record);
        // Best effort: if it fails, the next read authenticates it again.
        if let Err(e) = store::reseal_step(&self.inner.pool, self.inner.run_id, key, &stored, &sealed).await {
            tracing::warn!(step = key, error = %e, "could not store an authenticated record sealed");
        }
        Ok(record)
    }

    /// Authenticates a plain wait result: a timeout carries no data; an event
    /// must be a stored event of the awaited name with exactly this data.
    async fn verify_wait(&self, key: &str, event_name: &str, stored: Value) -> HandlerResult<Value> {
        let record: WaitRecord = decode(key, stored.clone())?;
        let forged =
            || HandlerError::permanent(format!("step {key}: {}", codec::CodecError::Unauthentic("wait result")));
        match record.event_id {
            None if record.timed_out && record.data.is_null() => Ok(stored),
            None => Err(forged()),
            Some(id) => match store::event_is(&self.inner.pool, id, event_name, &record.data).await {
                Ok(true) => Ok(stored),
                Ok(false) => Err(forged()),
                Err(e) => Err(HandlerError::new(format!("step {key}: could not check the wait result: {e}"))),
            },
        }
    }

    /// Ends the attempt: tells the executor why, then never returns.
    async fn stop<T>(&self, signal: Signal) -> T {
        self.signal(signal);
        std::future::pending().await
    }

    /// Tells the executor why the attempt ends (the first signal wins).
    fn signal(&self, signal: Signal) {
        if let Some(tx) = self.inner.signal.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(signal);
        }
    }

    /// Records a fresh wait or invoke in the journal before it is registered;
    /// the attempt ends if it lost its lease or the write failed.
    async fn record_or_stop(&self, asked: &Asked) -> HandlerResult<()> {
        match self.record(asked).await {
            Ok(true) => Ok(()),
            Ok(false) => self.stop(Signal::Fenced).await,
            Err(e) => {
                let e = HandlerError::new(format!("step {}: not recorded: {e}", asked.key));
                self.stop(Signal::StepFailed(e.at_step(&asked.key))).await
            }
        }
    }

    /// The test kit: counts a step body about to run, or fails it (injected failure).
    #[cfg(feature = "testing")]
    fn probe_body(&self, name: &str, key: &str) -> Option<HandlerError> {
        self.inner.probe.as_ref().and_then(|p| p.body(self.inner.run_id, name, key))
    }

    /// The test kit: a crash planned at this point ends the attempt as a dead
    /// process would (nothing more is written; the lease is left to expire).
    #[cfg(feature = "testing")]
    async fn probe_crash(&self, point: crate::probe::Point, key: &str) {
        if self.inner.probe.as_ref().is_some_and(|p| p.crash_here(self.inner.run_id, point, key)) {
            self.stop::<()>(Signal::Crashed).await;
        }
    }

    /// When a step began and ended, by the database clock as this attempt knows it.
    fn timing(&self, started_at: DateTime<Utc>) -> StepTiming {
        StepTiming {
            started_at,
            finished_at: self.db_time(),
            attempt: i32::try_from(self.inner.attempt).unwrap_or(i32::MAX),
        }
    }

    async fn checkpoint(&self, asked: &Asked, value: Value, started_at: DateTime<Utc>) -> HandlerResult<Option<Value>> {
        let key = asked.key.as_str();
        let output = match limits::check_payload(&value, &self.inner.limits) {
            Ok(text) => self.seal(key, &value, text),
            Err(e) => return Err(HandlerError::permanent(format!("step {key}: output refused: {e}"))),
        };
        self.charge(key, output.len())?;
        crate::failpoint!("step-after-body", Err(HandlerError::new("failpoint step-after-body")));
        #[cfg(feature = "testing")]
        self.probe_crash(crate::probe::Point::AfterBody, key).await;
        let write = PendingWrite::Checkpoint {
            fence: self.fence().await,
            key: key.to_owned(),
            output,
            timing: self.timing(started_at),
            entry: (asked.ask.position(), asked.kind),
        };
        match self.inner.writer.write(write).await {
            Ok(WriteOutcome::Stored) => {
                crate::failpoint!("step-after-checkpoint", Err(HandlerError::new("failpoint step-after-checkpoint")));
                #[cfg(feature = "testing")]
                self.probe_crash(crate::probe::Point::AfterCheckpoint, key).await;
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
        self.step_with(name, StepOptions::default(), f)
    }

    /// [`Ctx::step`] with options for this step, such as its own timeout.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// use durastep::StepOptions;
    /// use std::time::Duration;
    /// // The body is stopped after 30 s; the attempt then fails and is retried.
    /// let rows: u64 = ctx
    ///     .step_with("export", StepOptions::new().timeout(Duration::from_secs(30)), || async { Ok(7) })
    ///     .await?;
    /// # let _ = rows; Ok(()) }
    /// ```
    pub fn step_with<T, F, Fut>(
        &self,
        name: &str,
        options: StepOptions,
        f: F,
    ) -> impl Future<Output = HandlerResult<T>> + Send + use<T, F, Fut>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = HandlerResult<T>> + Send,
    {
        let key = self.next_key(EntryKind::Step, name);
        let memoized = self.memoized::<T>(&key);
        let ctx = self.clone();
        let name = if memoized.is_some() { String::new() } else { name.to_owned() };
        let timeout = options.timeout.or(self.inner.step_timeout);
        async move {
            if let Some(stored) = memoized {
                return stored;
            }
            let asked = ctx.asked(key).await?;
            ctx.step_keyed(asked, &name, f, timeout).await
        }
    }

    /// The stored value of a step asked for by key (a replay), read when the
    /// step is called: a memoized step then needs none of the rest of the
    /// step's machinery (a replay of 1,000 steps makes 1,000 calls).
    fn memoized<T: DeserializeOwned>(&self, key: &Result<Asked, KeyError>) -> Option<HandlerResult<T>> {
        key.as_ref().ok().and_then(|asked| self.stored(&asked.key))
    }

    /// Runs a step that has no stored value: see [`Ctx::memoized`], which
    /// every caller asks first.
    async fn step_keyed<T, F, Fut>(&self, asked: Asked, name: &str, f: F, timeout: Option<Duration>) -> HandlerResult<T>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce() -> Fut + Send,
        Fut: Future<Output = HandlerResult<T>> + Send,
    {
        let ctx = self;
        let key = asked.key.clone();
        {
            ctx.fresh_work().await;
            let span = tracing::info_span!(parent: &ctx.inner.span, "step", step = %key, attempt = ctx.inner.attempt);
            async {
                if ctx.inner.lost.is_cancelled() {
                    return ctx.stop(Signal::Fenced).await;
                }
                crate::failpoint!("step-before-body", Err(HandlerError::new("failpoint step-before-body")));
                #[cfg(feature = "testing")]
                {
                    if let Some(e) = ctx.probe_body(name, &key) {
                        return ctx.stop(Signal::StepFailed(annotate(&key, e).at_step(&key))).await;
                    }
                }
                let started_at = ctx.db_time();
                let timer = crate::metrics::StepTimer::start(&ctx.inner.function_id, name);
                let value = match with_timeout(timeout, f()).await {
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
                let stored = ctx.checkpoint(&asked, json, started_at).await;
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

    /// [`Ctx::step`], handing the body an idempotency key for the external
    /// call it makes: `"<run id>:<step key>"`, the same on every attempt of
    /// this step and different for every step (a second call of the same name
    /// gets `name#2` in its key). Give it to the API's idempotency header, so a
    /// body that runs twice (its worker died before the checkpoint) still
    /// writes once, without formatting a key by hand.
    ///
    /// ```
    /// # async fn charge(_key: &str, _cents: u64) -> durastep::HandlerResult<String> { Ok("ch_1".into()) }
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// let charge_id: String = ctx
    ///     .step_with_key("charge", |key| async move { charge(&key, 50_00).await })
    ///     .await?;
    /// # let _ = charge_id; Ok(()) }
    /// ```
    pub fn step_with_key<T, F, Fut>(
        &self,
        name: &str,
        f: F,
    ) -> impl Future<Output = HandlerResult<T>> + Send + use<T, F, Fut>
    where
        T: Serialize + DeserializeOwned + Send,
        F: FnOnce(String) -> Fut + Send,
        Fut: Future<Output = HandlerResult<T>> + Send,
    {
        let key = self.next_key(EntryKind::Step, name);
        let memoized = self.memoized::<T>(&key);
        let ctx = self.clone();
        let name = if memoized.is_some() { String::new() } else { name.to_owned() };
        async move {
            if let Some(stored) = memoized {
                return stored;
            }
            let asked = ctx.asked(key).await?;
            let token = format!("{}:{}", ctx.inner.run_id, asked.key);
            ctx.step_keyed(asked, &name, move || f(token), ctx.inner.step_timeout).await
        }
    }

    /// A step whose database writes commit together with its checkpoint.
    ///
    /// `f` gets the connection of a transaction; the step result is stored in
    /// that same transaction, behind the fencing check. Either both commit or
    /// neither does, so the writes happen exactly once. The transaction is open
    /// while `f` runs: keep `f` to database work.
    ///
    /// `f` is an async closure (`async move |conn| { .. }`); no boxing.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// let campaign = String::from("c_9");
    /// let id: i64 = ctx
    ///     .step_tx("log", async move |conn| {
    ///         let id: i64 = sqlx::query_scalar("SELECT length($1)::bigint").bind(&campaign).fetch_one(&mut *conn).await?;
    ///         Ok(id)
    ///     })
    ///     .await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub fn step_tx<T, F>(&self, name: &str, f: F) -> impl Future<Output = HandlerResult<T>> + Send + use<T, F>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> TxBody<'c, T> + AsyncFnOnce(&mut PgConnection) -> HandlerResult<T>,
    {
        self.step_tx_with(name, StepOptions::default(), f)
    }

    /// [`Ctx::step_tx`] with options for this step, such as its own timeout
    /// (on timeout the transaction is rolled back and the attempt fails).
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// use durastep::StepOptions;
    /// use std::time::Duration;
    /// let n: i64 = ctx
    ///     .step_tx_with("count", StepOptions::new().timeout(Duration::from_secs(5)), async move |conn| {
    ///         Ok(sqlx::query_scalar("SELECT 1::bigint").fetch_one(&mut *conn).await?)
    ///     })
    ///     .await?;
    /// # let _ = n; Ok(()) }
    /// ```
    pub fn step_tx_with<T, F>(
        &self,
        name: &str,
        options: StepOptions,
        f: F,
    ) -> impl Future<Output = HandlerResult<T>> + Send + use<T, F>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> TxBody<'c, T> + AsyncFnOnce(&mut PgConnection) -> HandlerResult<T>,
    {
        let key = self.next_key(EntryKind::StepTx, name);
        let ctx = self.clone();
        let name = name.to_owned();
        let timeout = options.timeout.or(self.inner.step_timeout);
        async move {
            let asked = ctx.asked(key).await?;
            ctx.step_tx_key(asked, f, &name, timeout).await
        }
    }

    async fn step_tx_key<T, F>(&self, asked: Asked, f: F, name: &str, timeout: Option<Duration>) -> HandlerResult<T>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> TxBody<'c, T>,
    {
        let ctx = self;
        let key = asked.key.clone();
        let span = tracing::info_span!(parent: &ctx.inner.span, "step_tx", step = %key, attempt = ctx.inner.attempt);
        async move {
            if let Some(stored) = ctx.stored(&key) {
                return stored;
            }
            ctx.fresh_work().await;
            if ctx.inner.lost.is_cancelled() {
                return ctx.stop(Signal::Fenced).await;
            }
            #[cfg(feature = "testing")]
            {
                if let Some(e) = ctx.probe_body(name, &key) {
                    return ctx.stop(Signal::StepFailed(annotate(&key, e).at_step(&key))).await;
                }
            }
            let timer = crate::metrics::StepTimer::start(&ctx.inner.function_id, name);
            let outcome = ctx.run_step_tx(&asked, f, timeout).await;
            if matches!(outcome, Ok(TxOutcome::Committed(_) | TxOutcome::CommittedAndCancelled | TxOutcome::Adopted(_)))
            {
                timer.finish();
            }
            match outcome {
                Ok(TxOutcome::Committed(v)) => {
                    #[cfg(feature = "testing")]
                    ctx.probe_crash(crate::probe::Point::AfterCheckpoint, &key).await;
                    Ok(v)
                }
                Ok(TxOutcome::CommittedAndCancelled) => ctx.stop(Signal::Cancelled).await,
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
    /// An event that cancels the sending run itself (it matches the run's own
    /// `cancel_on` rule, or starts a new run of the run's singleton key with
    /// `SingletonMode::CancelOld`) is stored with this step all the same; the
    /// run is then `cancelled` and its attempt ends here (this call does not
    /// return). The same holds for an event sent with `Engine::send_in` on a
    /// [`Ctx::step_tx`] connection.
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
        let asked = self.asked(self.next_key(EntryKind::SendEvent, name)).await?;
        let key = asked.key.clone();
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
            asked,
            async move |conn: &mut PgConnection| {
                crate::failpoint!(
                    "send-event-before-insert",
                    Err(HandlerError::new("failpoint send-event-before-insert"))
                );
                let (mut receipts, _) =
                    crate::event::insert(conn, std::slice::from_ref(&prepared), crate::store::Route::Queue)
                        .await
                        .map_err(|e| HandlerError::new(format!("send failed: {e}")))?;
                Ok(receipts.remove(0))
            },
            name,
            self.inner.step_timeout,
        )
        .await
    }

    async fn run_step_tx<T, F>(&self, asked: &Asked, f: F, timeout: Option<Duration>) -> HandlerResult<TxOutcome<T>>
    where
        T: Serialize + DeserializeOwned + Send,
        F: for<'c> TxBody<'c, T>,
    {
        let key = asked.key.as_str();
        let db = |e: sqlx::Error| HandlerError::new(format!("step {key}: {e}"));
        let started_at = self.db_time();
        let mut tx = self.inner.pool.begin().await.map_err(db)?;
        let value = with_timeout(timeout, f(&mut tx)).await.map_err(|e| annotate(key, e))?;
        let json = serde_json::to_value(&value)
            .map_err(|e| HandlerError::permanent(format!("step {key}: output does not serialize: {e}")))?;
        let text = limits::check_payload(&json, &self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: output refused: {e}")))?;
        let text = self.seal(key, &json, text);
        self.charge(key, text.len())?;
        let cancelled = match store::checkpoint_in_tx(
            &mut tx,
            self.fence().await,
            key,
            &text,
            self.timing(started_at),
            (asked.ask.position(), asked.kind),
        )
        .await
        .map_err(db)?
        {
            store::TxCheckpoint::Fenced => return Ok(TxOutcome::Fenced),
            store::TxCheckpoint::Adopted(stored) => return Ok(TxOutcome::Adopted(stored)),
            store::TxCheckpoint::Stored => false,
            store::TxCheckpoint::StoredAndCancelled => true,
        };
        crate::failpoint!("step-tx-before-commit", Err(HandlerError::new("failpoint step-tx-before-commit")));
        let committed = match tx.commit().await {
            // The commit landed but its acknowledgement is "lost": take the ambiguous path.
            Ok(()) if crate::failpoint_fires!("step-tx-after-commit") => {
                Err(sqlx::Error::Protocol("failpoint step-tx-after-commit".into()))
            }
            other => other,
        };
        match committed {
            Ok(()) if cancelled => Ok(TxOutcome::CommittedAndCancelled),
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
    /// A zero (or already passed) duration does not suspend: the step is
    /// recorded and the call returns at once, on the same worker. So
    /// `sleep(name, Duration::ZERO)` is a cheap no-op checkpoint, not a yield
    /// to other runs. The same holds for [`Ctx::sleep_until`] with a time in
    /// the past.
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// ctx.sleep("cool-down", std::time::Duration::from_secs(60)).await?;
    /// ctx.sleep("no-wait", std::time::Duration::ZERO).await?; // returns at once
    /// # Ok(()) }
    /// ```
    pub async fn sleep(&self, name: &str, duration: Duration) -> HandlerResult<()> {
        let asked = self.asked(self.next_key(EntryKind::Sleep, name)).await?;
        let wake_at = limits::instant_after(self.db_time(), duration);
        self.sleep_key(&asked, wake_at).await
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
        let asked = self.asked(self.next_key(EntryKind::Sleep, name)).await?;
        self.sleep_key(&asked, limits::clamp_instant(at.with_timezone(&Utc))).await
    }

    #[tracing::instrument(name = "sleep", parent = &self.inner.span, skip_all, fields(step = %asked.key, attempt = self.inner.attempt))]
    async fn sleep_key(&self, asked: &Asked, wake_at: DateTime<Utc>) -> HandlerResult<()> {
        let key = asked.key.as_str();
        let wake_at = match self.stored::<SleepRecord>(key) {
            Some(record) => record?.wake_at,
            None => {
                self.fresh_work().await;
                if self.inner.lost.is_cancelled() {
                    return self.stop(Signal::Fenced).await;
                }
                let record = serde_json::to_value(SleepRecord { wake_at }).map_err(HandlerError::from)?;
                match self.checkpoint(asked, record, self.db_time()).await {
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
        self.fresh_work().await;
        crate::failpoint!("sleep-after-arming", Err(HandlerError::new("failpoint sleep-after-arming")));
        match store::suspend_until(&self.inner.pool, self.fence().await, wake_at).await {
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

/// What a [`Ctx::wait_for_event`] waits for: an event name, which of its
/// events count ([`EventMatch`], default any) and how long at most (default:
/// no timeout).
///
/// ```
/// use durastep::{EventMatch, WaitFor};
/// use std::time::Duration;
/// let w = WaitFor::event("campaign/approved")
///     .matching(EventMatch::field("/campaign_id", &"c_9"))
///     .timeout(Duration::from_secs(2 * 86_400));
/// # let _ = w;
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct WaitFor {
    event: String,
    matching: EventMatch,
    timeout: Option<Duration>,
}

impl WaitFor {
    /// Waits for an event with this name (any of them, with no timeout, until
    /// [`WaitFor::matching`] and [`WaitFor::timeout`]).
    ///
    /// ```
    /// let w = durastep::WaitFor::event("invoice/paid");
    /// # let _ = w;
    /// ```
    pub fn event(name: impl Into<String>) -> Self {
        WaitFor { event: name.into(), matching: EventMatch::any(), timeout: None }
    }

    /// Only events that this matches resume the wait.
    ///
    /// ```
    /// let w = durastep::WaitFor::event("invoice/paid").matching(durastep::EventMatch::field("/invoice_id", &42));
    /// # let _ = w;
    /// ```
    pub fn matching(mut self, matching: EventMatch) -> Self {
        self.matching = matching;
        self
    }

    /// Gives up after this long (by the database clock, from when the wait is
    /// first recorded): the wait then returns `None`.
    ///
    /// ```
    /// let w = durastep::WaitFor::event("invoice/paid").timeout(std::time::Duration::from_secs(3600));
    /// # let _ = w;
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
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
    /// Suspends the run until an event that `wait` describes arrives (its
    /// name, and its [`EventMatch`]), or until its timeout has passed; returns
    /// the event's data (deserialized into `T`), or `None` on timeout.
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
    /// Several waits may be in flight at once (`tokio::join!` of two waits):
    /// each is recorded, the run waits until one of them resolves, and the
    /// others stay recorded (with their own deadlines) and catch their events
    /// meanwhile, so the next execution finds them resolved or waits again.
    ///
    /// An event name beginning with `durastep/` (the engine's own) fails the
    /// run permanently ([`crate::LimitError::ReservedName`] in the message).
    ///
    /// ```
    /// # async fn f(ctx: durastep::Ctx) -> durastep::HandlerResult<()> {
    /// use durastep::{EventMatch, WaitFor};
    /// use std::time::Duration;
    /// #[derive(serde::Deserialize)]
    /// struct Approved { campaign_id: String, by: String }
    ///
    /// let wait = WaitFor::event("campaign/approved")
    ///     .matching(EventMatch::field("/campaign_id", &"c_9"))
    ///     .timeout(Duration::from_secs(2 * 86_400));
    /// let approval: Option<Approved> = ctx.wait_for_event("approval", wait).await?;
    /// match approval {
    ///     Some(a) => println!("approved by {} ({})", a.by, a.campaign_id),
    ///     None => println!("no approval within two days"),
    /// }
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "wait", parent = &self.inner.span, skip_all, fields(step, attempt = self.inner.attempt))]
    pub async fn wait_for_event<T: DeserializeOwned>(&self, name: &str, wait: WaitFor) -> HandlerResult<Option<T>> {
        let WaitFor { event: event_name, matching, timeout } = wait;
        let event_name = event_name.as_str();
        let asked = self.asked(self.next_key(EntryKind::Wait, name)).await?;
        let key = asked.key.clone();
        tracing::Span::current().record("step", key.as_str());
        if let Some(stored) = self.stored_raw(&key) {
            let record = self.open_record(&key, Kind::Wait, stored, |v| self.verify_wait(&key, event_name, v)).await?;
            return wait_result(&key, record);
        }
        self.fresh_work().await;
        if self.inner.lost.is_cancelled() {
            return self.stop(Signal::Fenced).await;
        }
        limits::check_event_name(event_name, &self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: {e}")))?;
        self.room_for_record(&key, "wait")?;
        let (path, value) = match matching.kind {
            MatchKind::Any => (None, None),
            MatchKind::Field { pointer, value } => {
                let path = crate::flow::pointer_path(&pointer)
                    .map_err(|e| HandlerError::permanent(format!("step {key}: {e}")))?;
                let value = value
                    .map_err(|e| HandlerError::permanent(format!("step {key}: match value does not serialize: {e}")))?;
                let text = limits::check_payload(&value, &self.inner.limits)
                    .map_err(|e| HandlerError::permanent(format!("step {key}: match value refused: {e}")))?;
                (Some(path), Some(text))
            }
        };
        // limits::MAX_DURATION or more is "no timeout" (the deadline is then 'infinity').
        let timeout_secs = timeout_secs(timeout);
        if crate::failpoint_fires!("wait-before-commit") {
            let e = HandlerError::new(format!("step {key}: could not wait: failpoint wait-before-commit"));
            return self.stop(Signal::StepFailed(e.at_step(&key))).await;
        }
        // Several waits of this attempt may record themselves at once (a
        // handler that joins them): each is recorded, and the attempt ends
        // only when the last of them is, so none is lost.
        let (ticket, mut sibling) = self.wait_enter();
        let outcome = loop {
            let outcome = store::wait_for_event(
                &self.inner.pool,
                self.fence().await,
                &key,
                event_name,
                path.as_deref(),
                value.as_deref(),
                timeout_secs,
                sibling,
                (asked.ask.position(), asked.kind),
            )
            .await;
            let outcome = match outcome {
                // The wait is stored but its acknowledgement is "lost".
                Ok(_) if crate::failpoint_fires!("wait-after-commit") => {
                    Err(sqlx::Error::Protocol("failpoint wait-after-commit".into()))
                }
                other => other,
            };
            // Fenced only because a sibling wait suspended the run meanwhile: record it too.
            if matches!(outcome, Ok(store::WaitOutcome::Fenced)) && !sibling && self.wait_has_sibling() {
                sibling = true;
                continue;
            }
            break outcome;
        };
        let (suspended, last) = ticket.leave(matches!(outcome, Ok(store::WaitOutcome::Suspended)));
        match outcome {
            Ok(store::WaitOutcome::Fenced) => self.stop(Signal::Fenced).await,
            // The run is waiting (for this wait or a sibling): the attempt ends
            // when the last wait in flight has been recorded.
            _ if suspended && last => self.stop(Signal::Suspended).await,
            _ if suspended => std::future::pending().await,
            Ok(store::WaitOutcome::Suspended) => self.stop(Signal::Suspended).await,
            Ok(store::WaitOutcome::Resolved(stored)) => {
                self.count_record(&stored);
                let record =
                    self.open_record(&key, Kind::Wait, stored, |v| self.verify_wait(&key, event_name, v)).await?;
                wait_result(&key, record)
            }
            Err(e) => {
                let e = HandlerError::new(format!("step {key}: could not wait: {e}"));
                self.stop(Signal::StepFailed(e.at_step(&key))).await
            }
        }
    }

    fn wait_gate(&self) -> std::sync::MutexGuard<'_, WaitGate> {
        self.inner.waits.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A wait starts recording itself; also says whether a sibling is in
    /// flight or has suspended the run.
    fn wait_enter(&self) -> (WaitTicket<'_>, bool) {
        let mut g = self.wait_gate();
        g.in_flight += 1;
        (WaitTicket { ctx: self, left: false }, g.in_flight > 1 || g.suspended)
    }

    fn wait_has_sibling(&self) -> bool {
        let g = self.wait_gate();
        g.in_flight > 1 || g.suspended
    }
}

/// One wait in flight; leaves the gate when done, or when its future is dropped.
struct WaitTicket<'a> {
    ctx: &'a Ctx,
    left: bool,
}

impl WaitTicket<'_> {
    /// Done recording; returns (the run is suspended by this attempt's waits,
    /// no other wait is still in flight).
    fn leave(mut self, suspended: bool) -> (bool, bool) {
        self.left = true;
        let mut g = self.ctx.wait_gate();
        g.in_flight = g.in_flight.saturating_sub(1);
        g.suspended |= suspended;
        (g.suspended, g.in_flight == 0)
    }
}

impl Drop for WaitTicket<'_> {
    fn drop(&mut self) {
        if !self.left {
            let mut g = self.ctx.wait_gate();
            g.in_flight = g.in_flight.saturating_sub(1);
            let end = g.suspended && g.in_flight == 0;
            drop(g);
            // The last wait in flight was dropped after a sibling suspended the run.
            if end {
                self.ctx.signal(Signal::Suspended);
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

/// What a [`Ctx::invoke`] starts: a function, its input (default JSON
/// `null`) and how long the parent waits at most (default: no timeout).
///
/// ```
/// use durastep::Invoke;
/// use std::time::Duration;
/// let i = Invoke::function("meta-token-rotation")
///     .input(&serde_json::json!({"account": "act_1"}))
///     .timeout(Duration::from_secs(600));
/// # let _ = i;
/// ```
#[derive(Debug, Clone)]
#[must_use]
pub struct Invoke {
    function_id: String,
    input: Result<Value, String>,
    timeout: Option<Duration>,
}

impl Invoke {
    /// A child run of the function with this id.
    ///
    /// ```
    /// let i = durastep::Invoke::function("resize-image");
    /// # let _ = i;
    /// ```
    pub fn function(function_id: impl Into<String>) -> Self {
        Invoke { function_id: function_id.into(), input: Ok(Value::Null), timeout: None }
    }

    /// The child's input (its handler's event payload). A value that does not
    /// serialize fails the parent permanently at the invoke.
    ///
    /// ```
    /// let i = durastep::Invoke::function("resize-image").input(&("a.png", 640));
    /// # let _ = i;
    /// ```
    pub fn input<I: Serialize + ?Sized>(mut self, input: &I) -> Self {
        self.input = serde_json::to_value(input).map_err(|e| e.to_string());
        self
    }

    /// Cancels the child and returns [`ChildError::TimedOut`] if it has not
    /// finished this long (by the database clock) after it was created.
    ///
    /// ```
    /// let i = durastep::Invoke::function("resize-image").timeout(std::time::Duration::from_secs(60));
    /// # let _ = i;
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
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
    /// Starts a run of the function that `invoke` names, with its input, and
    /// suspends this run until that child run finishes; returns its output
    /// (deserialized into `O`), or why it has none ([`ChildError`]: it failed,
    /// was cancelled, or did not finish within the invoke's timeout, in which
    /// case it is cancelled).
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
    /// use durastep::Invoke;
    /// use std::time::Duration;
    /// let child = Invoke::function("meta-token-rotation")
    ///     .input(&serde_json::json!({"account": "act_1"}))
    ///     .timeout(Duration::from_secs(600));
    /// let token: Result<String, durastep::ChildError> = ctx.invoke("rotate", child).await?;
    /// match token {
    ///     Ok(t) => println!("new token {t}"),
    ///     Err(e) => println!("rotation did not happen: {e}"),
    /// }
    /// # Ok(()) }
    /// ```
    #[tracing::instrument(name = "invoke", parent = &self.inner.span, skip_all, fields(step, attempt = self.inner.attempt))]
    pub async fn invoke<O: DeserializeOwned>(
        &self,
        name: &str,
        invoke: Invoke,
    ) -> HandlerResult<Result<O, ChildError>> {
        let Invoke { function_id, input, timeout } = invoke;
        let function_id = function_id.as_str();
        let asked = self.asked(self.next_key(EntryKind::Invoke, name)).await?;
        let key = asked.key.clone();
        tracing::Span::current().record("step", key.as_str());
        if let Some(stored) = self.stored_raw(&key) {
            let record = self.open_record(&key, Kind::Child, stored, |v| self.verify_child(&key, v)).await?;
            return self.child_result(&key, record);
        }
        self.fresh_work().await;
        if self.inner.lost.is_cancelled() {
            return self.stop(Signal::Fenced).await;
        }
        limits::check_function_id(function_id, &self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: {e}")))?;
        self.room_for_record(&key, "invoke")?;
        let input =
            input.map_err(|e| HandlerError::permanent(format!("step {key}: child input does not serialize: {e}")))?;
        let input = limits::check_payload(&input, &self.inner.limits)
            .map_err(|e| HandlerError::permanent(format!("step {key}: child input refused: {e}")))?;
        let timeout_secs = timeout_secs(timeout);
        if crate::failpoint_fires!("invoke-before-commit") {
            let e = HandlerError::new(format!("step {key}: could not invoke: failpoint invoke-before-commit"));
            return self.stop(Signal::StepFailed(e.at_step(&key))).await;
        }
        self.record_or_stop(&asked).await?;
        let outcome =
            store::invoke(&self.inner.pool, self.fence().await, &key, function_id, &input, timeout_secs).await;
        let outcome = match outcome {
            // The child is started but the acknowledgement is "lost".
            Ok(_) if crate::failpoint_fires!("invoke-after-commit") => {
                Err(sqlx::Error::Protocol("failpoint invoke-after-commit".into()))
            }
            other => other,
        };
        match outcome {
            Ok(store::InvokeOutcome::Suspended) => self.stop(Signal::Suspended).await,
            Ok(store::InvokeOutcome::Fenced) => self.stop(Signal::Fenced).await,
            Ok(store::InvokeOutcome::UnknownFunction) => {
                Err(HandlerError::permanent(format!("step {key}: no function has the id {function_id:?}")))
            }
            Ok(store::InvokeOutcome::Resolved(stored)) => {
                self.count_record(&stored);
                let record = self.open_record(&key, Kind::Child, stored, |v| self.verify_child(&key, v)).await?;
                self.child_result(&key, record)
            }
            Err(e) => {
                let e = HandlerError::new(format!("step {key}: could not invoke: {e}"));
                self.stop(Signal::StepFailed(e.at_step(&key))).await
            }
        }
    }

    /// Authenticates a plain child outcome: a completed child's output must
    /// open as the output of that child bound to this run and step (so the
    /// sealed output of another run cannot be transplanted here); a failed,
    /// cancelled or timed-out outcome carries no user data.
    async fn verify_child(&self, key: &str, stored: Value) -> HandlerResult<Value> {
        let record: ChildRecord = decode(key, stored.clone())?;
        if record.state.as_deref() == Some("completed") {
            let output = record.output.unwrap_or(Value::Null);
            self.open_child_output(key, record.child_run_id.unwrap_or_default(), output)?;
        }
        Ok(stored)
    }

    /// Opens a completed child's output: bound to the child run and to this
    /// run and step (its parent), as its worker sealed it.
    fn open_child_output(&self, key: &str, child: Uuid, output: Value) -> HandlerResult<Value> {
        let place = Place::output(child, Some((self.inner.run_id, key)));
        codec::open_value(self.inner.keyring.as_deref(), &place, output)
            .map_err(|e| HandlerError::permanent(format!("step {key}: child output cannot be opened: {e}")))
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
                let output = self.open_child_output(key, run_id, record.output.unwrap_or(Value::Null))?;
                decode(key, output).map(Ok)
            }
            Some("failed") => Ok(Err(ChildError::Failed { run_id, error })),
            _ => Ok(Err(ChildError::Cancelled { run_id, reason: error })),
        }
    }
}

/// A timeout in seconds for the store; none, or beyond a century, is "no
/// timeout" (the deadline is then 'infinity').
/// Seconds of a wait or invoke timeout; none, or [`limits::MAX_DURATION`] or
/// more, is "no timeout" (the deadline is then 'infinity').
fn timeout_secs(timeout: Option<Duration>) -> Option<f64> {
    timeout.filter(|t| *t < limits::MAX_DURATION).map(|t| t.as_secs_f64())
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

/// Options of one step; see [`Ctx::step_with`] and [`Ctx::step_tx_with`].
///
/// ```
/// let opts = durastep::StepOptions::new().timeout(std::time::Duration::from_secs(10));
/// # let _ = opts;
/// ```
#[derive(Debug, Clone, Default)]
pub struct StepOptions {
    timeout: Option<Duration>,
}

impl StepOptions {
    /// No options: the function's defaults apply.
    ///
    /// ```
    /// let opts = durastep::StepOptions::new();
    /// # let _ = opts;
    /// ```
    pub fn new() -> Self {
        StepOptions::default()
    }

    /// The longest this step's body may run: when `timeout` passes, the body
    /// is stopped (its future is dropped at its next `.await`; a `step_tx`
    /// transaction is rolled back) and the attempt fails as retryable with
    /// `"step <name>: timed out after <timeout> (step timeout)"`. Overrides
    /// [`crate::FunctionBuilder::step_timeout`] for this step. Longer than
    /// [`crate::limits::MAX_DURATION`] is cut to it.
    ///
    /// ```
    /// let opts = durastep::StepOptions::new().timeout(std::time::Duration::from_secs(90));
    /// # let _ = opts;
    /// ```
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
}

/// Runs a step body, stopping it when `timeout` passes (a retryable failure).
async fn with_timeout<T>(timeout: Option<Duration>, body: impl Future<Output = HandlerResult<T>>) -> HandlerResult<T> {
    match timeout {
        None => body.await,
        Some(d) => {
            let d = d.min(limits::MAX_DURATION);
            tokio::time::timeout(d, body)
                .await
                .unwrap_or_else(|_| Err(HandlerError::new(format!("timed out after {d:?} (step timeout)"))))
        }
    }
}

enum TxOutcome<T> {
    Committed(T),
    /// Committed, and the step's own event cancelled the run in the same
    /// transaction: the attempt ends, the run is `cancelled`.
    CommittedAndCancelled,
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
