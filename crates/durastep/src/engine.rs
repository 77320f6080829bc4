//! The engine: one builder, sending events, running workers, looking at runs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::codec::{self, Keyring};
use crate::error::{Error, from_sqlx};
use crate::event::{Event, SendReceipt};
use crate::function::{Backoff, ErasedHandler, Function};
use crate::limits::{self, Limits};
use crate::schedule::{self, CatchUp, Schedule};
use crate::store;
use crate::worker::{self, WorkerOptions};

/// A registered function, as the worker executes it.
pub(crate) struct Registered {
    pub handler: ErasedHandler,
    pub backoff: Backoff,
    /// A retry-after failure pauses the run's back-pressure keys.
    pub backpressure: bool,
    /// The cron schedule and its catch-up policy, for functions with `on_cron`.
    pub schedule: Option<(Schedule, CatchUp)>,
}

pub(crate) struct EngineInner {
    pub pool: PgPool,
    /// Heartbeats, the reaper and LISTEN: never starved by user steps.
    pub control_pool: PgPool,
    pub functions: HashMap<String, Registered>,
    pub limits: Limits,
    pub worker: WorkerOptions,
    /// Seals step outputs and run outputs at rest, when set.
    pub keyring: Option<Arc<Keyring>>,
    /// Per event name, the (function, key pointer) pairs its data must carry for
    /// the flow control of functions registered here: checked before any SQL.
    pub key_checks: HashMap<String, Vec<(String, String)>>,
}

/// The handle to Durastep: sends events, runs workers, reads runs. Cheap to clone.
///
/// ```no_run
/// use durastep::{Ctx, Engine, Event, Function};
/// use tokio_util::sync::CancellationToken;
///
/// # async fn demo() -> Result<(), durastep::Error> {
/// let hello = Function::new("hello")
///     .on_event("greeting/requested")
///     .handler(|ctx: Ctx, name: String| async move {
///         ctx.step("greet", || async move { Ok(format!("hello, {name}")) }).await
///     });
/// let engine = Engine::builder()
///     .database_url("postgres://postgres@127.0.0.1/postgres")
///     .function(hello)
///     .build()
///     .await?; // connects and migrates
/// engine.send(Event::new("greeting/requested", "world")).await?;
/// engine.run_worker(CancellationToken::new()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut functions: Vec<&str> = self.inner.functions.keys().map(String::as_str).collect();
        functions.sort_unstable();
        f.debug_struct("Engine")
            .field("functions", &functions)
            .field("encryption", &self.inner.keyring.is_some())
            .finish_non_exhaustive()
    }
}

/// Builds an [`Engine`]; see [`Engine::builder`].
#[must_use]
pub struct EngineBuilder {
    url: Option<String>,
    pool: Option<PgPool>,
    functions: Vec<Function>,
    migrate: bool,
    limits: Limits,
    worker: WorkerOptions,
    max_connections: u32,
    keyring: Option<Keyring>,
}

impl Engine {
    /// Starts building an engine.
    ///
    /// ```
    /// let builder = durastep::Engine::builder().database_url("postgres://localhost/app");
    /// # let _ = builder;
    /// ```
    pub fn builder() -> EngineBuilder {
        EngineBuilder {
            url: None,
            pool: None,
            functions: Vec::new(),
            migrate: true,
            limits: Limits::default(),
            worker: WorkerOptions::default(),
            max_connections: 10,
            keyring: None,
        }
    }

    /// Sends an event: stores it and creates one run per function it triggers.
    /// With an idempotency key, a repeated send creates nothing and returns the
    /// first send's ids.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let receipt = engine
    ///     .send(durastep::Event::new("deal/stage.changed", &serde_json::json!({"contact_id": 7})).idempotency_key("7:offer:2026-W48"))
    ///     .await?;
    /// println!("event {} started {} runs", receipt.event_id, receipt.run_ids.len());
    /// # Ok(()) }
    /// ```
    pub async fn send(&self, event: Event) -> Result<SendReceipt, Error> {
        let mut receipts = self.send_batch(vec![event]).await?;
        Ok(receipts.remove(0))
    }

    /// Sends many events in one statement (one round trip). Receipts come back
    /// in input order.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let events = (0..100).map(|i| durastep::Event::new("n", &i)).collect();
    /// assert_eq!(engine.send_batch(events).await?.len(), 100);
    /// # Ok(()) }
    /// ```
    pub async fn send_batch(&self, events: Vec<Event>) -> Result<Vec<SendReceipt>, Error> {
        let prepared = self.prepare(&events)?;
        let mut tx = self.inner.pool.begin().await.map_err(from_sqlx)?;
        let receipts = insert(&mut tx, &prepared).await?;
        tx.commit().await.map_err(from_sqlx)?;
        Ok(receipts)
    }

    /// Sends an event inside the caller's transaction: it is stored, and its runs
    /// start, only if that transaction commits (the outbox pattern, without an outbox).
    /// Until that transaction ends, no run can start waiting for an event of
    /// this name (see [`Ctx::wait_for_event`](crate::Ctx::wait_for_event)), so
    /// keep it short. Use READ COMMITTED (Postgres' default): under REPEATABLE
    /// READ or SERIALIZABLE a concurrently recorded wait makes this call fail
    /// with a serialization error (retry the transaction) instead of missing it.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, pool: sqlx::PgPool) -> Result<(), durastep::Error> {
    /// let mut tx = pool.begin().await?;
    /// sqlx::query("UPDATE deals SET stage = 'offer' WHERE id = 7").execute(&mut *tx).await?;
    /// engine.send_in(&mut tx, durastep::Event::new("deal/stage.changed", &7)).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn send_in(&self, conn: &mut PgConnection, event: Event) -> Result<SendReceipt, Error> {
        let prepared = self.prepare(std::slice::from_ref(&event))?;
        let mut receipts = insert(conn, &prepared).await?;
        Ok(receipts.remove(0))
    }

    fn prepare(&self, events: &[Event]) -> Result<Vec<store::NewEvent>, Error> {
        events
            .iter()
            .map(|e| {
                let prepared = e.prepare(&self.inner.limits)?;
                if let Some(checks) = self.inner.key_checks.get(e.name()) {
                    // Refused here when this engine knows the function (so `send_in`
                    // does not abort the caller's transaction); the insert checks again
                    // for functions only other processes register.
                    let payload: Value = serde_json::from_str(&prepared.payload).unwrap_or(Value::Null);
                    if let Some((function, key)) = checks.iter().find(|(_, k)| !crate::flow::has_key(&payload, k)) {
                        return Err(Error::MissingKey { function: function.clone(), key: key.clone() });
                    }
                }
                Ok(prepared)
            })
            .collect()
    }

    /// Runs a worker until `shutdown` is cancelled, then stops claiming, lets
    /// running attempts finish within the grace period and releases the rest.
    /// Run as many workers as you like, in as many processes.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let shutdown = tokio_util::sync::CancellationToken::new();
    /// let stop = shutdown.clone();
    /// tokio::spawn(async move { tokio::signal::ctrl_c().await.ok(); stop.cancel(); });
    /// engine.run_worker(shutdown).await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_worker(&self, shutdown: CancellationToken) -> Result<(), Error> {
        worker::run(self.inner.clone(), shutdown).await
    }

    /// One run, as stored now.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let run = engine.run(id).await?;
    /// println!("{} is {:?}", run.id, run.state);
    /// # Ok(()) }
    /// ```
    pub async fn run(&self, run_id: Uuid) -> Result<Run, Error> {
        let row = store::load_run(&self.inner.pool, run_id).await.map_err(from_sqlx)?;
        let mut run = row.map(Run::from).ok_or(Error::UnknownRun(run_id))?;
        // Shown opened when this engine holds the key; otherwise as stored (sealed).
        // (The keyring is checked first: `take()` must not run without one.)
        if let Some(keyring) = self.inner.keyring.as_deref()
            && let Some(output) = run.output.take()
        {
            let aad = codec::output_aad(run_id);
            run.output = Some(keyring.open(&aad, output.clone()).unwrap_or(output));
        }
        Ok(run)
    }

    /// Waits until a run is completed, failed or cancelled, checking every 20 ms,
    /// for at most `timeout`; returns the run as it is then.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let run = engine.wait_for_run(id, std::time::Duration::from_secs(10)).await?;
    /// assert!(run.state.is_finished());
    /// # Ok(()) }
    /// ```
    pub async fn wait_for_run(&self, run_id: Uuid, timeout: Duration) -> Result<Run, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let run = self.run(run_id).await?;
            if run.state.is_finished() || tokio::time::Instant::now() >= deadline {
                return Ok(run);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The pool the engine uses, for the application's own queries (and `send_in`).
    ///
    /// ```no_run
    /// # fn demo(engine: durastep::Engine) { let _pool: &sqlx::PgPool = engine.pool(); }
    /// ```
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    pub(crate) fn keyring(&self) -> Option<Arc<Keyring>> {
        self.inner.keyring.clone()
    }

    /// Takes back runs whose lease has expired, once, now (workers do this on
    /// their own every `reap_interval`). Returns how many runs were taken back.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let n = engine.reap_expired_leases().await?;
    /// # let _ = n; Ok(()) }
    /// ```
    pub async fn reap_expired_leases(&self) -> Result<usize, Error> {
        worker::reap_once(&self.inner.control_pool).await
    }

    /// Cancels a run that has not finished, keeping `reason` on it
    /// ([`Run::cancel_reason`]). A queued, sleeping or waiting run is cancelled at
    /// once and never executes again. A running run stops at its next step
    /// boundary: every later write of its attempt (checkpoint, sleep, wait,
    /// completion, failure) matches nothing, and its worker drops the handler
    /// when it notices (at that write, or its next heartbeat). No step result is
    /// stored after the cancel commits; a step body already executing runs to its
    /// end, and its result is discarded.
    ///
    /// Errors: [`Error::UnknownRun`] for an id no run has, and
    /// [`Error::RunFinished`] for a run already completed, failed or cancelled
    /// (which is left as it was).
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// match engine.cancel(id, "campaign paused by the client").await {
    ///     Ok(()) => println!("cancelled"),
    ///     Err(durastep::Error::RunFinished { state, .. }) => println!("too late: already {state:?}"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn cancel(&self, run_id: Uuid, reason: &str) -> Result<(), Error> {
        limits::check_name("cancel reason", reason, &self.inner.limits)?;
        match store::cancel_run(&self.inner.pool, run_id, reason).await.map_err(from_sqlx)? {
            store::CancelOutcome::Unknown => Err(Error::UnknownRun(run_id)),
            store::CancelOutcome::Finished(state) => Err(Error::RunFinished { run_id, state: RunState::parse(&state) }),
            store::CancelOutcome::Cancelled => Ok(()),
        }
    }
}

/// Locks the topics of the events' names, then inserts them (fan-out, cancel_on, waits).
pub(crate) async fn insert(conn: &mut PgConnection, events: &[store::NewEvent]) -> Result<Vec<SendReceipt>, Error> {
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    store::lock_topics(conn, &names).await.map_err(from_sqlx)?;
    let inserted = store::insert_events(conn, events).await.map_err(from_sqlx)?;
    Ok(inserted
        .into_iter()
        .map(|i| SendReceipt { event_id: i.event_id, run_ids: i.run_ids, duplicate: i.duplicate })
        .collect())
}

impl EngineBuilder {
    /// The Postgres to use, as a URL.
    ///
    /// ```
    /// let b = durastep::Engine::builder().database_url("postgres://postgres@127.0.0.1/postgres");
    /// # let _ = b;
    /// ```
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// An existing pool to use instead of a URL. Durastep still opens a small
    /// separate pool (3 connections, same options) for heartbeats, the reaper
    /// and LISTEN, so that a busy application cannot starve them.
    ///
    /// Turn Postgres' JIT off on this pool (`options([("jit", "off")])` on its
    /// `PgConnectOptions`, or `jit = off` for the role or database): Durastep's
    /// large single statements otherwise cross the default JIT cost thresholds
    /// and each execution pays about 1.5 s of compilation. Pools Durastep builds
    /// from a URL do this themselves.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), durastep::Error> {
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/postgres").await?;
    /// let engine = durastep::Engine::builder().pool(pool).build().await?;
    /// # let _ = engine; Ok(()) }
    /// ```
    pub fn pool(mut self, pool: PgPool) -> Self {
        self.pool = Some(pool);
        self
    }

    /// Size of the main pool when built from a URL (default 10).
    ///
    /// ```
    /// let b = durastep::Engine::builder().max_connections(20);
    /// # let _ = b;
    /// ```
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Registers a function. Its definition is upserted into `durastep.functions`
    /// at build, so events sent from any process fan out to it.
    ///
    /// ```
    /// let f = durastep::Function::new("f").on_event("e").handler(|_c, _x: ()| async { Ok(()) });
    /// let b = durastep::Engine::builder().function(f);
    /// # let _ = b;
    /// ```
    pub fn function(mut self, function: Function) -> Self {
        self.functions.push(function);
        self
    }

    /// Whether `build` applies the schema migrations (default true). Turn it off
    /// where migrations run separately, with [`crate::migrate`].
    ///
    /// ```
    /// let b = durastep::Engine::builder().migrate(false);
    /// # let _ = b;
    /// ```
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Input limits (payload size, nesting depth, key length).
    ///
    /// ```
    /// let b = durastep::Engine::builder().limits(durastep::Limits { max_payload_bytes: 64 * 1024, ..Default::default() });
    /// # let _ = b;
    /// ```
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Worker settings (in-flight attempts, lease, poll interval, ...).
    ///
    /// ```
    /// let b = durastep::Engine::builder().worker_options(durastep::WorkerOptions { max_in_flight: 16, ..Default::default() });
    /// # let _ = b;
    /// ```
    pub fn worker_options(mut self, options: WorkerOptions) -> Self {
        self.worker = options;
        self
    }

    /// Encrypts step outputs and run outputs at rest with this keyring
    /// (XChaCha20-Poly1305, bound to their run and step). Every engine that runs
    /// or inspects these functions needs the keyring; see [`Keyring`] for rotation.
    ///
    /// ```
    /// let b = durastep::Engine::builder().encryption(durastep::Keyring::new("k1", [9u8; 32]));
    /// # let _ = b;
    /// ```
    pub fn encryption(mut self, keyring: Keyring) -> Self {
        self.keyring = Some(keyring);
        self
    }

    /// Validates the functions, connects, migrates (unless told not to) and
    /// registers the functions.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), durastep::Error> {
    /// let engine = durastep::Engine::builder().database_url("postgres://postgres@127.0.0.1/postgres").build().await?;
    /// # let _ = engine; Ok(()) }
    /// ```
    pub async fn build(self) -> Result<Engine, Error> {
        let mut functions = HashMap::new();
        let mut rows = Vec::new();
        let mut flow = store::FlowRows { function_ids: Vec::new(), rules: Vec::new(), options: Vec::new() };
        let mut key_checks: HashMap<String, Vec<(String, String)>> = HashMap::new();
        let mut shared: HashMap<String, crate::flow::StoredRule> = HashMap::new();
        let mut schedules = Vec::new();
        for f in self.functions {
            limits::check_function_id(&f.id, &self.limits)?;
            for t in &f.triggers {
                limits::check_name("event name", t, &self.limits)?;
            }
            if let Some(e) = f.invalid.first() {
                return Err(Error::InvalidFunction(format!("function {:?}: {e}", f.id)));
            }
            for c in &f.cancel_on {
                limits::check_name("event name", &c.event, &self.limits)?;
            }
            if functions.contains_key(&f.id) {
                return Err(Error::InvalidFunction(format!("two functions have the id {:?}", f.id)));
            }
            let rules = crate::flow::resolve(&f.id, &f.flow, &self.limits)?;
            for r in &rules {
                let params = (r.kind, r.capacity, r.period_s, r.burst);
                if let Some(other) = shared.get(&r.name)
                    && (other.kind, other.capacity, other.period_s, other.burst) != params
                {
                    return Err(Error::InvalidFunction(format!(
                        "the shared limit {:?} is declared with different settings by two functions",
                        r.name
                    )));
                }
                shared.insert(r.name.clone(), r.clone());
            }
            for key in f.flow.required_keys() {
                for t in &f.triggers {
                    key_checks.entry(t.clone()).or_default().push((f.id.clone(), key.clone()));
                }
            }
            flow.function_ids.push(f.id.clone());
            flow.rules.extend(rules.into_iter().map(|r| (f.id.clone(), r)));
            if let Some(o) = crate::flow::StoredOptions::of(&f.flow) {
                flow.options.push((f.id.clone(), o));
            }
            let backpressure = f.flow.has_backpressure();
            let max_attempts = i32::try_from(f.max_attempts).unwrap_or(i32::MAX);
            let mut triggers = f.triggers.clone();
            if let Some(s) = &f.schedule {
                triggers.push(schedule::cron_event_name(&f.id));
                schedules.push(store::ScheduleRow {
                    function_id: f.id.clone(),
                    expr: s.expr().to_owned(),
                    tz: s.tz().name().to_owned(),
                    catch_up: i32::try_from(f.catch_up.bound()).unwrap_or(i32::MAX),
                });
            }
            rows.push(store::FunctionRow {
                id: f.id.clone(),
                triggers,
                max_attempts,
                has_on_failure: f.on_failure.is_some(),
                cancel_on: f.cancel_on_json(),
                start_timeout_secs: f.start_timeout.map(|d| d.as_secs_f64()),
                finish_timeout_secs: f.finish_timeout.map(|d| d.as_secs_f64()),
            });
            if let Some(handler) = f.on_failure {
                let id = format!("{}/on-failure", f.id);
                rows.push(store::FunctionRow {
                    id: id.clone(),
                    triggers: vec![],
                    max_attempts: 4,
                    has_on_failure: false,
                    cancel_on: "[]".into(),
                    start_timeout_secs: None,
                    finish_timeout_secs: None,
                });
                flow.function_ids.push(id.clone());
                functions.insert(
                    id,
                    Registered { handler, backoff: Backoff::default(), backpressure: false, schedule: None },
                );
            }
            let schedule = f.schedule.map(|s| (s, f.catch_up));
            functions.insert(f.id, Registered { handler: f.handler, backoff: f.backoff, backpressure, schedule });
        }

        let (pool, control_pool) = match (self.pool, self.url) {
            (Some(pool), _) => {
                let options = without_jit(pool.connect_options().as_ref().clone());
                let control = control_pool(options).await?;
                (pool, control)
            }
            (None, Some(url)) => {
                let options = without_jit(url.parse().map_err(Error::Unavailable)?);
                // One plain connection first: a refused or unknown host fails here
                // at once with its own error, not after the pool's acquire timeout
                // as "pool timed out".
                use sqlx::Connection;
                let probe = tokio::time::timeout(Duration::from_secs(10), PgConnection::connect_with(&options))
                    .await
                    .map_err(|_| {
                        let e = std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer within 10 s");
                        Error::Unavailable(sqlx::Error::Io(e))
                    })?
                    .map_err(Error::Unavailable)?;
                let _ = probe.close().await;
                let pool = PgPoolOptions::new()
                    .max_connections(self.max_connections)
                    .acquire_timeout(Duration::from_secs(10))
                    .connect_with(options.clone())
                    .await
                    .map_err(Error::Unavailable)?;
                (pool, control_pool(options).await?)
            }
            (None, None) => return Err(Error::NoDatabase),
        };
        if self.migrate {
            store::migrate(&pool).await?;
        }
        store::register_functions(&pool, &mut rows).await.map_err(from_sqlx)?;
        store::register_flow(&pool, &flow).await.map_err(from_sqlx)?;
        let ids: Vec<String> = rows.iter().map(|r| r.id.clone()).collect();
        store::register_schedules(&pool, &mut schedules, &ids).await.map_err(from_sqlx)?;
        Ok(Engine {
            inner: Arc::new(EngineInner {
                pool,
                control_pool,
                functions,
                limits: self.limits,
                worker: self.worker,
                keyring: self.keyring.map(Arc::new),
                key_checks,
            }),
        })
    }
}

/// Durastep's statements are single statements with many CTEs over array
/// parameters; under a generic plan their cost estimates cross Postgres'
/// default JIT thresholds, and JIT then spends about 1.5 s compiling each
/// execution (measured: a 1,000-event `send_batch` took 1.6 s with JIT and
/// 55 ms without). Our pools turn it off for their own sessions.
fn without_jit(options: PgConnectOptions) -> PgConnectOptions {
    options.options([("jit", "off")])
}

async fn control_pool(options: PgConnectOptions) -> Result<PgPool, Error> {
    PgPoolOptions::new()
        .max_connections(3)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(Error::Unavailable)
}

/// Applies Durastep's schema migrations (schema `durastep`, tracked in
/// `durastep._migrations`). The engine builder does this unless told not to.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), durastep::Error> {
/// durastep::migrate(&pool).await?;
/// # Ok(()) }
/// ```
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    store::migrate(pool).await.map_err(Error::from)
}

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
        }
    }

    /// Every state, in lifecycle order.
    ///
    /// ```
    /// assert_eq!(durastep::RunState::ALL.len(), 8);
    /// ```
    pub const ALL: [RunState; 8] = [
        RunState::Queued,
        RunState::Running,
        RunState::Sleeping,
        RunState::Waiting,
        RunState::Completed,
        RunState::Failed,
        RunState::Cancelled,
        RunState::Skipped,
    ];

    pub(crate) fn parse(s: &str) -> RunState {
        s.parse().unwrap_or(RunState::Cancelled)
    }
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
    type Err = Error;
    fn from_str(s: &str) -> Result<RunState, Error> {
        RunState::ALL.into_iter().find(|st| st.as_str() == s).ok_or_else(|| {
            let names: Vec<&str> = RunState::ALL.iter().map(|st| st.as_str()).collect();
            Error::InvalidFilter(format!("unknown run state {s:?}; one of {}", names.join(", ")))
        })
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
    pub attempt: i32,
    /// Attempts allowed in all.
    pub max_attempts: i32,
    /// When it is (or was) next due.
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
    /// What a queued run waits for, when flow control parked it (`None` otherwise).
    pub flow_wait: Option<crate::flow::FlowWait>,
}

impl From<store::RunRow> for Run {
    fn from(r: store::RunRow) -> Self {
        Run {
            id: r.id,
            function_id: r.function_id,
            event_id: r.event_id,
            state: RunState::parse(&r.state),
            attempt: r.attempt,
            max_attempts: r.max_attempts,
            run_at: r.run_at,
            last_error: r.last_error,
            cancel_reason: r.cancel_reason,
            output: r.output,
            created_at: r.created_at,
            finished_at: r.finished_at,
            flow_wait: match (r.park_rule, r.park_key, r.park_kind) {
                (Some(rule), Some(key), Some(kind)) => Some(crate::flow::FlowWait {
                    next_possible_start: (kind != "concurrency").then_some(r.run_at),
                    rule,
                    kind,
                    key,
                }),
                _ => None,
            },
        }
    }
}
