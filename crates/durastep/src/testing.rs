//! The test kit (feature `testing`): test your own functions on a real
//! Postgres, with a clock you move, crashes at every checkpoint and injected
//! step failures.
//!
//! Enable it for tests only:
//!
//! ```toml
//! [dev-dependencies]
//! durastep = { version = "*", features = ["testing"] }
//! ```
//!
//! Every due-ness decision (sleeps, retries, leases) is made by the database
//! clock, `durastep.now()`, which is the transaction time plus an offset that is
//! zero in production. Tests move that offset instead of sleeping; each test
//! database has its own clock. [`TestEngine`] gives each test a fresh database,
//! a worker, and the tools below.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::{Error, from_sqlx};
use crate::probe::{CrashPlan, Probe};
use crate::store;
use crate::{Engine, Function, Run, RunState, WorkerHandle, WorkerOptions};

pub use crate::probe::Point;

/// Moves the database clock forward by `by` and wakes listening workers.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// // A run sleeping for three days becomes due now.
/// durastep::testing::advance_clock(&engine, std::time::Duration::from_secs(3 * 86_400)).await?;
/// # Ok(()) }
/// ```
pub async fn advance_clock(engine: &Engine, by: Duration) -> Result<(), Error> {
    store::advance_clock(engine.pool(), by).await.map_err(from_sqlx)?;
    store::notify_workers(engine.pool()).await.map_err(from_sqlx)
}

/// Sets the database clock so that it reads `at` now (it may move back: a test
/// that does so must expect what that means for leases and due times).
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// use chrono::TimeZone;
/// durastep::testing::set_clock(&engine, chrono::Utc.with_ymd_and_hms(2026, 12, 4, 21, 30, 0).unwrap()).await?;
/// # Ok(()) }
/// ```
pub async fn set_clock(engine: &Engine, at: DateTime<Utc>) -> Result<(), Error> {
    store::set_clock(engine.pool(), at).await.map_err(from_sqlx)?;
    store::notify_workers(engine.pool()).await.map_err(from_sqlx)
}

/// The database clock as Durastep sees it.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let now = durastep::testing::db_now(&engine).await?;
/// # let _ = now; Ok(()) }
/// ```
pub async fn db_now(engine: &Engine) -> Result<DateTime<Utc>, Error> {
    store::db_now(engine.pool()).await.map_err(from_sqlx)
}

/// An engine for tests on a fresh database of its own, with a worker running,
/// a clock you move, and injection of crashes and step failures.
///
/// ```no_run
/// use durastep::testing::TestEngine;
/// use durastep::{Ctx, Function};
/// use std::time::Duration;
///
/// # async fn demo() -> Result<(), durastep::Error> {
/// let f = Function::new("remind").handler(|ctx: Ctx, who: String| async move {
///     ctx.sleep("wait", Duration::from_secs(3 * 86_400)).await?;
///     ctx.step("remind", || async move { Ok(format!("reminded {who}")) }).await
/// });
/// let t = TestEngine::builder().function(f).build().await?;
/// let run = t.start("remind", &"ada").await?;
/// let done = t.finish(run, Duration::from_secs(30)).await?; // moves the clock past the sleep
/// assert_eq!(done.output, Some(serde_json::json!("reminded ada")));
/// t.shutdown().await;
/// # Ok(()) }
/// ```
pub struct TestEngine {
    engine: Engine,
    probe: Arc<Probe>,
    worker: WorkerHandle,
    lease: Duration,
    database: String,
    admin: sqlx::postgres::PgConnectOptions,
}

/// Builds a [`TestEngine`].
///
/// ```no_run
/// # async fn demo(f: durastep::Function) -> Result<(), durastep::Error> {
/// let t = durastep::testing::TestEngine::builder()
///     .database_url("postgres://postgres@127.0.0.1:5432/postgres")
///     .function(f)
///     .build()
///     .await?;
/// # let _ = t; Ok(()) }
/// ```
#[must_use]
pub struct TestEngineBuilder {
    url: Option<String>,
    functions: Vec<Function>,
    worker: WorkerOptions,
}

impl TestEngine {
    /// Starts building a test engine.
    ///
    /// ```
    /// let b = durastep::testing::TestEngine::builder();
    /// # let _ = b;
    /// ```
    pub fn builder() -> TestEngineBuilder {
        TestEngineBuilder {
            url: None,
            functions: Vec::new(),
            worker: WorkerOptions {
                poll_interval: Duration::from_millis(50),
                lease: Duration::from_secs(30),
                heartbeat_interval: Duration::from_secs(5),
                reap_interval: Duration::from_millis(200),
                shutdown_grace: Duration::from_secs(5),
                ..Default::default()
            },
        }
    }

    /// The engine (send events, read runs, inspect).
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) -> Result<(), durastep::Error> {
    /// let counts = t.engine().inspect().counts().await?;
    /// # let _ = counts; Ok(()) }
    /// ```
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Moves the test database's clock forward.
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) -> Result<(), durastep::Error> {
    /// t.advance_clock(std::time::Duration::from_secs(3_600)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn advance_clock(&self, by: Duration) -> Result<(), Error> {
        advance_clock(&self.engine, by).await
    }

    /// Sets the test database's clock (see [`set_clock`]).
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) -> Result<(), durastep::Error> {
    /// let now = t.now().await?;
    /// t.set_clock(now + chrono::Duration::days(1)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn set_clock(&self, at: DateTime<Utc>) -> Result<(), Error> {
        set_clock(&self.engine, at).await
    }

    /// The test database's clock.
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) -> Result<(), durastep::Error> {
    /// let now = t.now().await?;
    /// # let _ = now; Ok(()) }
    /// ```
    pub async fn now(&self) -> Result<DateTime<Utc>, Error> {
        db_now(&self.engine).await
    }

    /// Starts a run of `function_id` with `input`, whatever triggers the
    /// function (no event of its trigger is sent, so no other function starts).
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) -> Result<(), durastep::Error> {
    /// let run = t.start("remind", &"ada").await?;
    /// # let _ = run; Ok(()) }
    /// ```
    pub async fn start<I: Serialize + ?Sized>(&self, function_id: &str, input: &I) -> Result<Uuid, Error> {
        let input = serde_json::to_value(input).map_err(|e| Error::InvalidFunction(format!("input: {e}")))?;
        let id = Uuid::now_v7();
        let created = store::start_run(self.engine.pool(), id, function_id, &input).await.map_err(from_sqlx)?;
        if !created {
            return Err(Error::InvalidFunction(format!("no function has the id {function_id:?}")));
        }
        Ok(id)
    }

    /// Waits until no run is due or running (the worker has done all it can
    /// without the clock moving or an event arriving), for at most `timeout`.
    /// Returns whether it became idle.
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) -> Result<(), durastep::Error> {
    /// assert!(t.run_until_idle(std::time::Duration::from_secs(30)).await?);
    /// # Ok(()) }
    /// ```
    pub async fn run_until_idle(&self, timeout: Duration) -> Result<bool, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut quiet = 0;
        loop {
            let busy = store::busy_runs(self.engine.pool()).await.map_err(from_sqlx)?;
            quiet = if busy == 0 { quiet + 1 } else { 0 };
            // Twice in a row: a run made due by the last one's end is seen.
            if quiet >= 2 {
                return Ok(true);
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Drives one run to its end: lets the worker run it, and whenever nothing
    /// is due moves the clock to the run's next due time (past a sleep, a
    /// backoff, a timeout). Returns the run as it is when it finished, or at
    /// `timeout` (a run waiting for an event you have not sent stays `waiting`).
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let run = t.finish(id, std::time::Duration::from_secs(30)).await?;
    /// assert_eq!(run.state, durastep::RunState::Completed);
    /// # Ok(()) }
    /// ```
    pub async fn finish(&self, run_id: Uuid, timeout: Duration) -> Result<Run, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            self.run_until_idle(left).await?;
            let run = self.engine.run(run_id).await?;
            if run.state.is_finished() || run.state == RunState::Diverged || tokio::time::Instant::now() >= deadline {
                return Ok(run);
            }
            let now = self.now().await?;
            match store::run_due_at(self.engine.pool(), run_id).await.map_err(from_sqlx)? {
                Some(at) if at > now && at < DateTime::<Utc>::MAX_UTC => {
                    let by = (at - now).to_std().unwrap_or_default() + Duration::from_millis(1);
                    self.advance_clock(by).await?;
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// Waits until every run in `ids` has finished, for at most `timeout`;
    /// returns them as they are then (check their states).
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine, a: uuid::Uuid, b: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let runs = t.wait_for_runs(&[a, b], std::time::Duration::from_secs(30)).await?;
    /// assert!(runs.iter().all(|r| r.state.is_finished()));
    /// # Ok(()) }
    /// ```
    pub async fn wait_for_runs(&self, ids: &[Uuid], timeout: Duration) -> Result<Vec<Run>, Error> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            out.push(self.engine.wait_for_run(*id, left).await?);
        }
        Ok(out)
    }

    /// Makes the next `times` bodies of steps named `step` (in any run) fail
    /// with a retryable error instead of running: test your retries and
    /// `on_failure` handlers.
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) {
    /// t.fail_step("push", 2); // the first two tries of "push" fail
    /// # }
    /// ```
    pub fn fail_step(&self, step: &str, times: u32) {
        self.probe.lock().failures.insert(step.to_owned(), times);
    }

    /// How many times each step body of a run started, by step key.
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine, id: uuid::Uuid) {
    /// assert_eq!(t.body_runs(id).get("push"), Some(&1));
    /// # }
    /// ```
    pub fn body_runs(&self, run_id: Uuid) -> BTreeMap<String, u32> {
        self.probe.lock().bodies.get(&run_id).cloned().unwrap_or_default()
    }

    /// The events a run sent with [`Ctx::send_event`](crate::Ctx::send_event), in order.
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let sent = t.sent_events(id).await?;
    /// assert!(sent.iter().any(|e| e.name == "budget/pushed"));
    /// # Ok(()) }
    /// ```
    pub async fn sent_events(&self, run_id: Uuid) -> Result<Vec<SentEvent>, Error> {
        let rows = store::sent_events(self.engine.pool(), run_id).await.map_err(from_sqlx)?;
        Ok(rows.into_iter().map(|(step, name, data)| SentEvent { step, name, data }).collect())
    }

    /// The child runs a run started with [`Ctx::invoke`](crate::Ctx::invoke).
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine, id: uuid::Uuid) -> Result<(), durastep::Error> {
    /// let children = t.child_runs(id).await?;
    /// assert_eq!(children.len(), 1);
    /// # Ok(()) }
    /// ```
    pub async fn child_runs(&self, run_id: Uuid) -> Result<Vec<Run>, Error> {
        let ids = store::child_run_ids(self.engine.pool(), run_id).await.map_err(from_sqlx)?;
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            out.push(self.engine.run(id).await?);
        }
        Ok(out)
    }

    /// Crash-tests a function: runs it once with `input` without crashes,
    /// then once more per crash point that run met (after each step body's
    /// end, before its checkpoint; and after each checkpoint), crashing the
    /// attempt there as a dead process would, expiring its lease and resuming
    /// it. Reports per case how many times each step body ran and whether the
    /// output equals the crash-free one. Each case is driven with
    /// [`TestEngine::finish`] for at most `timeout`.
    ///
    /// A step whose body ran twice is where an external effect happens twice
    /// unless it carries an idempotency key ([`Ctx::idempotency_key`](crate::Ctx::idempotency_key));
    /// [`CrashReport`]'s display says so for each such step.
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) -> Result<(), durastep::Error> {
    /// let report = t.crash_at_every_checkpoint("remind", &"ada", std::time::Duration::from_secs(30)).await?;
    /// assert!(report.outputs_match(), "{report}");
    /// println!("{report}");
    /// # Ok(()) }
    /// ```
    pub async fn crash_at_every_checkpoint<I: Serialize + ?Sized>(
        &self,
        function_id: &str,
        input: &I,
        timeout: Duration,
    ) -> Result<CrashReport, Error> {
        let baseline = self.start(function_id, input).await?;
        let base = self.finish(baseline, timeout).await?;
        let points = self.probe.lock().points.get(&baseline).cloned().unwrap_or_default();
        let mut report = CrashReport {
            function_id: function_id.to_owned(),
            baseline_state: base.state,
            baseline_output: base.output.clone(),
            baseline_body_runs: self.body_runs(baseline),
            cases: Vec::with_capacity(points.len()),
        };
        for (at, (point, step)) in points.into_iter().enumerate() {
            let id = Uuid::now_v7();
            self.probe.lock().crash = Some(CrashPlan { run_id: id, at, fired: false });
            let input = serde_json::to_value(input).map_err(|e| Error::InvalidFunction(format!("input: {e}")))?;
            if !store::start_run(self.engine.pool(), id, function_id, &input).await.map_err(from_sqlx)? {
                return Err(Error::InvalidFunction(format!("no function has the id {function_id:?}")));
            }
            // Wait for the crash, then play the dead worker's part: its lease expires.
            let deadline = tokio::time::Instant::now() + timeout;
            loop {
                let fired = self.probe.lock().crash.is_some_and(|p| p.fired);
                let run = self.engine.run(id).await?;
                if fired && run.state == RunState::Running {
                    self.advance_clock(self.lease * 2).await?;
                    self.engine.reap_expired_leases().await?;
                    break;
                }
                if run.state.is_finished() || tokio::time::Instant::now() >= deadline {
                    break;
                }
                if !fired {
                    // The run may be sleeping before it reaches the point.
                    self.run_until_idle(Duration::from_millis(200)).await?;
                    let now = self.now().await?;
                    let due = store::run_due_at(self.engine.pool(), id).await.map_err(from_sqlx)?;
                    let running = run.state == RunState::Running;
                    if let Some(due) = due.filter(|d| !running && *d > now && *d < DateTime::<Utc>::MAX_UTC) {
                        let by = (due - now).to_std().unwrap_or_default() + Duration::from_millis(1);
                        self.advance_clock(by).await?;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let run = self.finish(id, left).await?;
            let crashed = self.probe.lock().crash.take().is_some_and(|p| p.fired);
            report.cases.push(CrashCase {
                point,
                step,
                crashed,
                run_id: id,
                state: run.state,
                same_output: run.state == report.baseline_state && run.output == report.baseline_output,
                output: run.output,
                body_runs: self.body_runs(id),
            });
        }
        Ok(report)
    }

    /// Stops the worker and drops the test database. A panic of the
    /// worker's task (an engine bug) is resumed here, failing the test.
    ///
    /// ```no_run
    /// # async fn demo(t: durastep::testing::TestEngine) { t.shutdown().await; }
    /// ```
    pub async fn shutdown(self) {
        // Its error, if any, was logged as it returned.
        let _ = self.worker.stop().await;
        self.engine.pool().close().await;
        if let Ok(pool) = sqlx::PgPool::connect_with(self.admin.clone()).await {
            if let Err(e) = store::drop_database(&pool, &self.database).await {
                tracing::warn!(error = %e, "test database not dropped");
            }
            pool.close().await;
        }
    }
}

impl TestEngineBuilder {
    /// The Postgres server to create the test database on, as a URL to any of
    /// its databases (default: `DATABASE_URL`, else
    /// `postgres://postgres@127.0.0.1:5432/postgres`).
    ///
    /// ```
    /// let b = durastep::testing::TestEngine::builder().database_url("postgres://postgres@127.0.0.1/postgres");
    /// # let _ = b;
    /// ```
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// Registers a function.
    ///
    /// ```
    /// let f = durastep::Function::new("noop").handler(|_ctx: durastep::Ctx, _: ()| async { Ok(()) });
    /// let b = durastep::testing::TestEngine::builder().function(f);
    /// # let _ = b;
    /// ```
    pub fn function(mut self, f: Function) -> Self {
        self.functions.push(f);
        self
    }

    /// The worker's options (default: short polls, a 30 s lease).
    ///
    /// ```
    /// let b = durastep::testing::TestEngine::builder()
    ///     .worker_options(durastep::WorkerOptions { max_in_flight: 4, ..Default::default() });
    /// # let _ = b;
    /// ```
    pub fn worker_options(mut self, worker: WorkerOptions) -> Self {
        self.worker = worker;
        self
    }

    /// Creates a fresh database, builds the engine on it (migrating it) and
    /// starts a worker.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), durastep::Error> {
    /// let t = durastep::testing::TestEngine::builder().build().await?;
    /// # let _ = t; Ok(()) }
    /// ```
    pub async fn build(self) -> Result<TestEngine, Error> {
        self.build_with(|_| async { Vec::new() }).await
    }

    /// Like [`TestEngineBuilder::build`], for functions that need the test
    /// database: `make` gets a pool on it, with Durastep's schema already
    /// migrated (to set up your own schema, your services, simulators ...),
    /// and returns more functions to register.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), durastep::Error> {
    /// use durastep::{Ctx, Function};
    /// let t = durastep::testing::TestEngine::builder()
    ///     .build_with(|pool| async move {
    ///         sqlx::query("CREATE TABLE notes (body text)").execute(&pool).await.unwrap();
    ///         vec![Function::new("note").handler(|ctx: Ctx, body: String| async move {
    ///             ctx.step_tx("insert", async move |conn| {
    ///                 sqlx::query("INSERT INTO notes VALUES ($1)").bind(&body).execute(&mut *conn).await?;
    ///                 Ok(())
    ///             }).await
    ///         })]
    ///     })
    ///     .await?;
    /// # let _ = t; Ok(()) }
    /// ```
    pub async fn build_with<F, Fut>(self, make: F) -> Result<TestEngine, Error>
    where
        F: FnOnce(sqlx::PgPool) -> Fut,
        Fut: std::future::Future<Output = Vec<Function>>,
    {
        let url = self
            .url
            .or_else(|| std::env::var("DATABASE_URL").ok())
            .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
        let admin: sqlx::postgres::PgConnectOptions = url.parse().map_err(Error::Unavailable)?;
        let database = format!("durastep_test_{}", Uuid::new_v4().simple());
        {
            let pool = sqlx::PgPool::connect_with(admin.clone()).await.map_err(Error::Unavailable)?;
            store::create_database(&pool, &database).await.map_err(from_sqlx)?;
            pool.close().await;
        }
        let options = admin.clone().database(&database);
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .map_err(Error::Unavailable)?;
        let lease = self.worker.lease;
        // Durastep's schema first: `make` may create objects that refer to it.
        crate::migrate(&pool).await?;
        let more = make(pool.clone()).await;
        let mut b = Engine::builder().pool(pool).worker_options(self.worker);
        for f in self.functions.into_iter().chain(more) {
            b = b.function(f);
        }
        let engine = b.build().await?;
        let probe = Arc::new(Probe::default());
        let _ = engine.inner.probe.set(probe.clone());
        let stop = CancellationToken::new();
        let worker = WorkerHandle::spawn(stop.clone(), {
            let engine = engine.clone();
            async move {
                let result = engine.run_worker(stop).await;
                if let Err(e) = &result {
                    tracing::warn!(error = %e, "test worker stopped");
                }
                result
            }
        });
        Ok(TestEngine { engine, probe, worker, lease, database, admin })
    }
}

/// An event a run sent.
///
/// ```no_run
/// # async fn demo(t: durastep::testing::TestEngine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// for e in t.sent_events(id).await? { println!("{} {} {}", e.step, e.name, e.data); }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct SentEvent {
    /// The step key of the `send_event` call.
    pub step: String,
    /// The event's name.
    pub name: String,
    /// Its data.
    pub data: Value,
}

/// What [`TestEngine::crash_at_every_checkpoint`] found.
///
/// ```no_run
/// # async fn demo(t: durastep::testing::TestEngine) -> Result<(), durastep::Error> {
/// let report = t.crash_at_every_checkpoint("remind", &"ada", std::time::Duration::from_secs(30)).await?;
/// for (case, step, times) in report.steps_run_more_than_once() {
///     eprintln!("after a crash {:?} at {}, step {step} ran {times} times", case.point, case.step);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CrashReport {
    /// The function.
    pub function_id: String,
    /// How the crash-free run ended.
    pub baseline_state: RunState,
    /// Its output.
    pub baseline_output: Option<Value>,
    /// How many times each step body ran in it (more than once only with retries).
    pub baseline_body_runs: BTreeMap<String, u32>,
    /// One case per crash point.
    pub cases: Vec<CrashCase>,
}

/// One crash and its resumed run.
///
/// ```no_run
/// # fn f(c: durastep::testing::CrashCase) { assert!(c.same_output, "{:?}", c.body_runs); }
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct CrashCase {
    /// Where it crashed.
    pub point: Point,
    /// At which step (key).
    pub step: String,
    /// Whether the crash happened (a run that took another path may not reach it).
    pub crashed: bool,
    /// The run.
    pub run_id: Uuid,
    /// How it ended.
    pub state: RunState,
    /// Its output.
    pub output: Option<Value>,
    /// Whether state and output equal the crash-free run's.
    pub same_output: bool,
    /// How many times each step body ran, by step key.
    pub body_runs: BTreeMap<String, u32>,
}

impl CrashReport {
    /// Whether every resumed run ended as the crash-free one did.
    ///
    /// ```no_run
    /// # fn f(r: durastep::testing::CrashReport) { assert!(r.outputs_match(), "{r}"); }
    /// ```
    pub fn outputs_match(&self) -> bool {
        self.cases.iter().all(|c| c.same_output)
    }

    /// Every (case, step, times) where a step body ran more often than in the
    /// crash-free run: each is an external effect that happens twice unless
    /// it is idempotent.
    ///
    /// ```no_run
    /// # fn f(r: durastep::testing::CrashReport) { assert!(r.steps_run_more_than_once().len() <= r.cases.len()); }
    /// ```
    pub fn steps_run_more_than_once(&self) -> Vec<(&CrashCase, &str, u32)> {
        let mut out = Vec::new();
        for c in &self.cases {
            for (step, &n) in &c.body_runs {
                let base = self.baseline_body_runs.get(step).copied().unwrap_or(0);
                if n > base.max(1) {
                    out.push((c, step.as_str(), n));
                }
            }
        }
        out
    }
}

impl std::fmt::Display for CrashReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "crash test of {}: {} crash points; crash-free run {}",
            self.function_id,
            self.cases.len(),
            self.baseline_state
        )?;
        for c in &self.cases {
            let when = match c.point {
                Point::AfterBody => "after the body of",
                Point::AfterCheckpoint => "after the checkpoint of",
            };
            let runs: Vec<String> = c.body_runs.iter().map(|(k, n)| format!("{k}×{n}")).collect();
            writeln!(
                f,
                "  crash {when} {:<24} -> {} {} [{}]",
                c.step,
                c.state,
                if c.same_output { "same output" } else { "DIFFERENT OUTPUT" },
                runs.join(" ")
            )?;
        }
        for (c, step, n) in self.steps_run_more_than_once() {
            writeln!(
                f,
                "  step {step} ran {n} times (crash {:?} at {}): if it has an external effect, that effect \
                 happened {n} times unless it passes an idempotency key (ctx.idempotency_key()) to the API: \
                 a bug in the function, not in Durastep",
                c.point, c.step
            )?;
        }
        Ok(())
    }
}
