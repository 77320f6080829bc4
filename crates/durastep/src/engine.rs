//! The engine: one builder, sending events, running workers, looking at runs.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{PgConnection, PgPool};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::codec::{self, Keyring};
use crate::error::{Error, from_sqlx};
use crate::event::{Event, SendReceipt, insert, receipts_of};
use crate::function::{Backoff, Function};
use crate::handoff::LocalWorkers;
use crate::limits::{self, Limits};
use crate::run::Run;
use crate::schedule;
use crate::shared::{EngineInner, Registered, Versions};
use crate::store;
use crate::worker;
use crate::worker_handle::WorkerHandle;
use crate::worker_options::WorkerOptions;

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
    pub(crate) inner: Arc<EngineInner>,
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
        // One statement (`durastep.send_events`), its own transaction: one round trip, one commit.
        let mut conn = self.inner.pool.acquire().await.map_err(from_sqlx)?;
        // One event due now, and a worker of this process waits idle: the
        // send claims the new runs for it, and it starts them at once.
        let one_due_now = matches!(prepared.as_slice(), [event] if event.start_at.is_none());
        let offer = if one_due_now { self.inner.local_workers.take_offer() } else { None };
        // The functions the events trigger: whether a worker of this process
        // runs one, and which of its claim classes to wake after the commit.
        let names = prepared.iter().map(|e| e.name.as_str()).collect();
        let triggered = self.inner.triggered_by(&names);
        let (receipts, notified) = match offer {
            Some(offer) => {
                let sent = std::time::Instant::now();
                let (inserted, handed) =
                    store::insert_event_handing(&mut conn, &prepared[0], &offer.to()).await.map_err(from_sqlx)?;
                drop(conn);
                let queued = inserted.events.iter().map(|e| e.run_ids.len()).sum::<usize>() > handed.len();
                offer.hand_over(&self.inner.pool, handed, sent).await;
                let (receipts, notified) = receipts_of(inserted);
                // Every new run handed on: nothing for the other workers here.
                (receipts, notified && queued)
            }
            // Else, one event due now: to an idle worker of another process,
            // if one offered its slots (`store::Route::Offers`), unless a
            // worker of this process runs its functions. A batch, or an
            // event due later, is queued.
            None => {
                let route = if one_due_now && !self.inner.local_workers.run_any(&triggered) {
                    store::Route::Offers
                } else {
                    store::Route::Queue
                };
                insert(&mut conn, &prepared, route).await?
            }
        };
        if notified {
            // Committed: the workers of this process claim now, without
            // waiting for the NOTIFY to come back through their listener,
            // for the classes of the functions the events trigger (as the
            // NOTIFY names them; a wait the send resumed is left to the NOTIFY).
            self.inner.local_workers.wake(&triggered);
        }
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
        // Not committed yet: the workers learn of its runs from the NOTIFY,
        // which Postgres delivers when (and only if) the caller commits.
        let (mut receipts, _) = insert(conn, &prepared, store::Route::Queue).await?;
        Ok(receipts.remove(0))
    }

    fn prepare(&self, events: &[Event]) -> Result<Vec<store::NewEvent>, Error> {
        limits::check_batch(events.len(), 0, &self.inner.limits)?;
        let mut bytes = 0usize;
        events
            .iter()
            .map(|e| {
                let prepared = e.prepare(&self.inner.limits)?;
                bytes = bytes.saturating_add(prepared.payload.len());
                limits::check_batch(events.len(), bytes, &self.inner.limits)?;
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

    /// Runs a worker as a task of the current Tokio runtime, as
    /// [`run_worker`](Self::run_worker) does, until the returned handle's
    /// [`stop`](WorkerHandle::stop) (which waits for it) or until the handle
    /// is dropped (which does not). Panics outside a Tokio runtime.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let worker = engine.spawn_worker();
    /// tokio::signal::ctrl_c().await.ok();
    /// worker.stop().await?;
    /// # Ok(()) }
    /// ```
    pub fn spawn_worker(&self) -> WorkerHandle {
        let shutdown = CancellationToken::new();
        let (engine, stop) = (self.clone(), shutdown.clone());
        WorkerHandle::spawn(shutdown, async move { engine.run_worker(stop).await })
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
        let row = row.ok_or(Error::UnknownRun(run_id))?;
        let place = row.output_place();
        let mut run = Run::from(row);
        // Opened when this engine holds the key, and an output that does not
        // open is an error (never the envelope handed back as the output).
        // Without a key, a sealed output is shown as stored.
        if let Some(output) = run.output.take() {
            run.output = Some(match codec::open_value(self.inner.keyring.as_deref(), &place, output.clone()) {
                Ok(v) => v,
                Err(codec::CodecError::NoKeyring) => output,
                Err(e) => return Err(Error::Codec { run_id, error: e }),
            });
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
    /// as soon as it learns of the cancel: at once, by a notification sent when
    /// the cancel commits (or at that write, or its next heartbeat, if the
    /// notification is missed). No step result is stored after the cancel
    /// commits; a step body already executing runs until the handler is dropped
    /// (its next `.await`), and its result is discarded. Until then the attempt
    /// keeps its concurrency slots, so no other run of its key starts beside it.
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
        crate::failpoint!(
            "cancel-before-commit",
            Err(Error::Database(sqlx::Error::Protocol("failpoint cancel-before-commit".into())))
        );
        match store::cancel_run(&self.inner.pool, run_id, reason).await.map_err(from_sqlx)? {
            store::CancelOutcome::Unknown => Err(Error::UnknownRun(run_id)),
            store::CancelOutcome::Finished(state) => Err(Error::RunFinished { run_id, state }),
            // The cancel is stored but its acknowledgement is "lost".
            store::CancelOutcome::Cancelled if crate::failpoint_fires!("cancel-after-commit") => {
                Err(Error::Database(sqlx::Error::Protocol("failpoint cancel-after-commit".into())))
            }
            store::CancelOutcome::Cancelled => Ok(()),
        }
    }
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
    /// separate pool (3 connections, same connect options) for heartbeats,
    /// the reaper and LISTEN, so that a busy application cannot starve them.
    /// No server setting of the pool's sessions needs changing for Durastep:
    /// its statements run at full speed with the server's defaults, JIT
    /// included (docs/performance.md). Build it with [`pool_options`](crate::pool_options)
    /// to save sqlx's ping before every statement (one round trip each).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), durastep::Error> {
    /// let pool = durastep::pool_options().connect("postgres://postgres@127.0.0.1/postgres").await?;
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

    /// Registers many functions at once (a `Vec`, an array, an iterator),
    /// like calling [`EngineBuilder::function`] for each.
    ///
    /// ```
    /// use durastep::Function;
    /// let all = vec![
    ///     Function::new("a").on_event("e").handler(|_c, _x: ()| async { Ok(()) }),
    ///     Function::new("b").on_event("e").handler(|_c, _x: ()| async { Ok(()) }),
    /// ];
    /// let b = durastep::Engine::builder().functions(all);
    /// # let _ = b;
    /// ```
    pub fn functions(mut self, functions: impl IntoIterator<Item = Function>) -> Self {
        self.functions.extend(functions);
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
    pub async fn build(mut self) -> Result<Engine, Error> {
        let mut prepared = prepare(std::mem::take(&mut self.functions), &self.limits)?;
        let (pool, control_pool) =
            connect(self.pool.take(), self.url.take(), self.max_connections, Control::Own).await?;
        if self.migrate {
            store::migrate(&pool).await?;
        }
        store::register_functions(&pool, &mut prepared.rows).await.map_err(from_sqlx)?;
        store::register_flow(&pool, &prepared.flow).await.map_err(from_sqlx)?;
        let ids: Vec<String> = prepared.rows.iter().map(|r| r.id.clone()).collect();
        store::register_schedules(&pool, &mut prepared.schedules, &ids).await.map_err(from_sqlx)?;
        Ok(Engine { inner: Arc::new(self.into_inner(pool, control_pool, prepared)) })
    }

    /// The engine's state, from its pools and its prepared functions.
    fn into_inner(self, pool: PgPool, control_pool: PgPool, prepared: Prepared) -> EngineInner {
        EngineInner {
            pool,
            control_pool,
            functions: prepared.functions,
            limits: self.limits,
            worker: self.worker.clamped(),
            keyring: self.keyring.map(Arc::new),
            key_checks: prepared.key_checks,
            triggered: prepared.triggered,
            local_workers: LocalWorkers::default(),
            #[cfg(feature = "testing")]
            probe: std::sync::OnceLock::new(),
        }
    }

    /// An engine that has validated its functions and connected, but has
    /// not migrated and registered nothing: for
    /// [`EngineBuilder::check_deploy`] (`deploy.rs`), which only reads.
    pub(crate) async fn connect_unregistered(mut self) -> Result<Engine, Error> {
        let prepared = prepare(std::mem::take(&mut self.functions), &self.limits)?;
        let (pool, control_pool) =
            connect(self.pool.take(), self.url.take(), self.max_connections, Control::Shared).await?;
        Ok(Engine { inner: Arc::new(self.into_inner(pool, control_pool, prepared)) })
    }
}

/// The functions of a builder, validated, with the rows that register them.
struct Prepared {
    functions: HashMap<String, Versions>,
    rows: Vec<store::FunctionRow>,
    flow: store::FlowRows,
    key_checks: HashMap<String, Vec<(String, String)>>,
    triggered: HashMap<String, Vec<String>>,
    schedules: Vec<store::ScheduleRow>,
}

/// Validates the functions and works out what registering them writes. Of
/// the versions of one function id, the newest is registered (its row, flow
/// rules, schedule); the older ones add their handlers only.
fn prepare(mut defs: Vec<Function>, limits: &Limits) -> Result<Prepared, Error> {
    // Newest version first within each id.
    defs.sort_by(|a, b| a.id.cmp(&b.id).then(b.version.cmp(&a.version)));
    let mut functions: HashMap<String, Versions> = HashMap::new();
    let mut rows = Vec::new();
    let mut flow = store::FlowRows { function_ids: Vec::new(), rules: Vec::new(), options: Vec::new() };
    let mut key_checks: HashMap<String, Vec<(String, String)>> = HashMap::new();
    let mut triggered: HashMap<String, Vec<String>> = HashMap::new();
    let mut shared: HashMap<String, crate::flow::StoredRule> = HashMap::new();
    let mut schedules = Vec::new();
    for f in defs {
        limits::check_function_id(&f.id, limits)?;
        for t in &f.triggers {
            limits::check_event_name(t, limits)?;
        }
        if let Some(e) = f.invalid.first() {
            return Err(Error::InvalidFunction(format!("function {:?}: {e}", f.id)));
        }
        for c in &f.cancel_on {
            limits::check_event_name(&c.event, limits)?;
        }
        if i32::try_from(f.version).is_err() {
            return Err(Error::InvalidFunction(format!(
                "function {:?}: version {} is above {}",
                f.id,
                f.version,
                i32::MAX
            )));
        }
        if let Some(registered) = functions.get(&f.id) {
            // An older version beside the newest: its handler, to drain its runs.
            if registered.by_version.contains_key(&f.version) {
                return Err(Error::InvalidFunction(format!(
                    "two functions have the id {:?} and the version {}",
                    f.id, f.version
                )));
            }
            let step_timeout = f.step_timeout;
            if let Some(handler) = f.on_failure {
                let handler = Registered {
                    handler,
                    backoff: Backoff::default(),
                    backpressure: false,
                    schedule: None,
                    step_timeout,
                };
                functions
                    .entry(format!("{}/on-failure", f.id))
                    .or_insert_with(|| Versions { newest: f.version, by_version: BTreeMap::new(), fast_claim: true })
                    .by_version
                    .insert(f.version, handler);
            }
            let backpressure = f.flow.has_backpressure();
            let handler =
                Registered { handler: f.handler, backoff: f.backoff, backpressure, schedule: None, step_timeout };
            if let Some(registered) = functions.get_mut(&f.id) {
                registered.by_version.insert(f.version, handler);
            }
            continue;
        }
        let rules = crate::flow::resolve(&f.id, &f.flow, limits)?;
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
        for t in &f.triggers {
            triggered.entry(t.clone()).or_default().push(f.id.clone());
        }
        flow.function_ids.push(f.id.clone());
        // Timeouts too: the full claim cancels a run past its deadline as it meets it.
        let fast_claim = rules.is_empty() && f.start_timeout.is_none() && f.finish_timeout.is_none();
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
            start_timeout_secs: f.start_timeout.map(|d| d.min(limits::MAX_DURATION).as_secs_f64()),
            finish_timeout_secs: f.finish_timeout.map(|d| d.min(limits::MAX_DURATION).as_secs_f64()),
            max_lease_losses: i32::try_from(f.max_lease_losses).unwrap_or(i32::MAX),
            version: i32::try_from(f.version).unwrap_or(i32::MAX),
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
                max_lease_losses: i32::try_from(crate::function::DEFAULT_LEASE_LOSSES).unwrap_or(10),
                version: i32::try_from(f.version).unwrap_or(i32::MAX),
            });
            flow.function_ids.push(id.clone());
            let handler = Registered {
                handler,
                backoff: Backoff::default(),
                backpressure: false,
                schedule: None,
                step_timeout: f.step_timeout,
            };
            functions.insert(
                id,
                Versions { newest: f.version, by_version: BTreeMap::from([(f.version, handler)]), fast_claim: true },
            );
        }
        let schedule = f.schedule.map(|s| (s, f.catch_up));
        let step_timeout = f.step_timeout;
        let handler = Registered { handler: f.handler, backoff: f.backoff, backpressure, schedule, step_timeout };
        functions.insert(
            f.id,
            Versions { newest: f.version, by_version: BTreeMap::from([(f.version, handler)]), fast_claim },
        );
    }
    Ok(Prepared { functions, rows, flow, key_checks, triggered, schedules })
}

/// Whether the engine gets its own control pool (heartbeats, reaper, LISTEN)
/// or shares the main one (a deploy check, which runs no worker).
enum Control {
    Own,
    Shared,
}

/// Connects the main pool (from `pool` or `url`) and the control pool.
async fn connect(
    pool: Option<PgPool>,
    url: Option<String>,
    max_connections: u32,
    control: Control,
) -> Result<(PgPool, PgPool), Error> {
    let (pool, control_pool) = match (pool, url) {
        (Some(pool), _) => {
            let options = pool.connect_options().as_ref().clone();
            let control = match control {
                Control::Own => control_pool(options).await?,
                Control::Shared => pool.clone(),
            };
            (pool, control)
        }
        (None, Some(url)) => {
            let options: PgConnectOptions = url.parse().map_err(from_sqlx)?;
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
                .map_err(from_sqlx)?;
            let _ = probe.close().await;
            let pool = pool_options()
                .max_connections(max_connections)
                .acquire_timeout(Duration::from_secs(10))
                .connect_with(options.clone())
                .await
                .map_err(from_sqlx)?;
            let control = match control {
                Control::Own => control_pool(options).await?,
                Control::Shared => pool.clone(),
            };
            (pool, control)
        }
        (None, None) => return Err(Error::NoDatabase),
    };
    Ok((pool, control_pool))
}

async fn control_pool(options: PgConnectOptions) -> Result<PgPool, Error> {
    pool_options()
        .max_connections(3)
        .min_connections(0)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(options)
        .await
        .map_err(from_sqlx)
}

/// How long a pooled connection may have been idle before [`pool_options`]
/// checks it with a ping when it is handed out.
///
/// ```
/// assert_eq!(durastep::IDLE_PING_AFTER, std::time::Duration::from_secs(1));
/// ```
pub const IDLE_PING_AFTER: Duration = Duration::from_secs(1);

/// The pool options Durastep uses for the pools it opens itself, and
/// recommends for a pool you pass to [`EngineBuilder::pool`]: sqlx's defaults,
/// except that a connection is pinged before it is handed out only when it
/// has been idle for [`IDLE_PING_AFTER`] or longer. By default sqlx pings every
/// connection on every acquire, which adds one round trip before each
/// statement (on the development machine a run's claim took 1.4 ms with the
/// ping and 1.1 ms without, docs/performance.md "Plans kept, the ping before each
/// statement"). A connection that broke while it was busy fails its next
/// statement once and is closed, and every Durastep statement that can fail
/// so is retried or reported; a connection idle through an outage is pinged
/// and replaced before use.
///
/// ```no_run
/// # async fn demo() -> Result<(), durastep::Error> {
/// let pool = durastep::pool_options()
///     .max_connections(20)
///     .connect("postgres://postgres@127.0.0.1/postgres")
///     .await?;
/// let engine = durastep::Engine::builder().pool(pool).build().await?;
/// # let _ = engine; Ok(()) }
/// ```
pub fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new().test_before_acquire(false).before_acquire(|conn, meta| {
        Box::pin(async move {
            if meta.idle_for >= IDLE_PING_AFTER {
                use sqlx::Connection;
                conn.ping().await?;
            }
            Ok(true)
        })
    })
}

/// Applies Durastep's schema migrations (schema `durastep`, tracked in
/// `durastep._migrations`) and returns those it applied, oldest first (empty
/// when the schema was up to date). The engine builder does this unless told
/// not to.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), durastep::Error> {
/// for m in durastep::migrate(&pool).await? {
///     println!("applied {} {}", m.version, m.description);
/// }
/// # Ok(()) }
/// ```
pub async fn migrate(pool: &PgPool) -> Result<Vec<AppliedMigration>, Error> {
    let applied = store::migrate(pool).await.map_err(Error::from)?;
    Ok(applied.into_iter().map(|(version, description)| AppliedMigration { version, description }).collect())
}

/// A schema migration that [`migrate`] applied.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> Result<(), durastep::Error> {
/// let applied: Vec<durastep::AppliedMigration> = durastep::migrate(&pool).await?;
/// if applied.is_empty() { println!("schema up to date"); }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct AppliedMigration {
    /// Its version (the number its file name starts with, `5` for `0005_inspection.sql`).
    pub version: i64,
    /// Its description (the rest of the file name, `inspection`).
    pub description: String,
}
