//! A test database with worker processes around it: the harness's entry point.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use durastep::{Engine, Event};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::functions::{self, FiveSteps, FunctionSettings, Mixed, Sleeper, SlowStep};
use crate::ledger::{self, Ledger};
use crate::process::{WorkerConfig, WorkerProcess};

/// How long a worker may take to print "ready" (a debug build migrating and
/// registering on a loaded 2-core machine).
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// Events per `send_batch` call of the harness.
const SEND_BATCH: usize = 200;

/// Set this environment variable to keep the workers' log files of passing tests too.
pub const KEEP_LOGS: &str = "DURASTEP_TESTKIT_KEEP_LOGS";

/// Worker processes sharing one test database, plus a pool and an engine for
/// the test itself.
///
/// Building it migrates the database, creates the ledger and registers the
/// test functions, so events can be sent before any worker runs. Workers are
/// addressed by index (the order they were spawned); [`Cluster::restart`]
/// replaces the process at an index. Dropping the cluster kills every worker;
/// if the test is panicking it first prints each worker's log tail, and it
/// keeps the log directory (else the directory is removed, unless [`KEEP_LOGS`] is set).
///
/// ```no_run
/// # async fn demo(url: String) -> durastep_testkit::Result<()> {
/// use durastep_testkit::{Cluster, FiveSteps, WorkerConfig};
/// use std::time::Duration;
/// let mut cluster = Cluster::start("target/debug/durastep-test-worker", url).await?;
/// let runs = cluster.send_five_steps((0..100).map(FiveSteps::new)).await?;
/// cluster.spawn_many(2, WorkerConfig::default()).await?;
/// cluster.wait_finished(&runs, Duration::from_secs(30)).await?;
/// cluster.shutdown(Duration::from_secs(10)).await?;
/// # Ok(()) }
/// ```
pub struct Cluster {
    bin: PathBuf,
    url: String,
    pool: PgPool,
    engine: Engine,
    log_dir: PathBuf,
    workers: Vec<WorkerProcess>,
}

impl Cluster {
    /// Connects to `url` (a test's own database: see [`crate::url_of`]),
    /// migrates it, creates the ledger and registers the test functions.
    /// `bin` is the worker binary: `env!("CARGO_BIN_EXE_durastep-test-worker")`
    /// in this crate's integration tests.
    ///
    /// ```no_run
    /// # async fn demo(url: String) -> durastep_testkit::Result<()> {
    /// let cluster = durastep_testkit::Cluster::start("target/debug/durastep-test-worker", url).await?;
    /// # let _ = cluster; Ok(()) }
    /// ```
    pub async fn start(bin: impl AsRef<Path>, url: impl Into<String>) -> Result<Cluster> {
        let url = url.into();
        let options: sqlx::postgres::PgConnectOptions = url.parse()?;
        let pool = PgPoolOptions::new()
            .max_connections(3)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options)
            .await?;
        let mut builder = Engine::builder().pool(pool.clone());
        // The engine migrates on build; the ledger needs nothing from it.
        ledger::create(&pool).await?;
        let ledger = Ledger::with_pool(pool.clone(), "test");
        for f in functions::all(FunctionSettings::default(), &ledger) {
            builder = builder.function(f);
        }
        let engine = builder.build().await?;
        let database = url.rsplit('/').next().unwrap_or("db").split('?').next().unwrap_or("db").to_owned();
        let log_dir = std::env::temp_dir()
            .join("durastep-testkit")
            .join(format!("{database}-{}", &Uuid::new_v4().simple().to_string()[..8]));
        Ok(Cluster { bin: bin.as_ref().to_owned(), url, pool, engine, log_dir, workers: Vec::new() })
    }

    /// The test database's URL.
    ///
    /// ```no_run
    /// # fn demo(c: &durastep_testkit::Cluster) { println!("{}", c.url()); }
    /// ```
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A small pool on the test database, for checks.
    ///
    /// ```no_run
    /// # async fn demo(c: &durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let s = durastep_testkit::ledger::summary(c.pool()).await?;
    /// # let _ = s; Ok(()) }
    /// ```
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// An engine on the test database with the test functions registered (it
    /// never runs a worker): for sending events and reading runs.
    ///
    /// ```no_run
    /// # async fn demo(c: &durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// c.engine().send(durastep_testkit::FiveSteps::new(1).event()).await?;
    /// # Ok(()) }
    /// ```
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Where the workers' stdout and stderr files are.
    ///
    /// ```no_run
    /// # fn demo(c: &durastep_testkit::Cluster) { println!("{}", c.log_dir().display()); }
    /// ```
    pub fn log_dir(&self) -> &Path {
        &self.log_dir
    }

    /// Starts one worker process and waits for its "ready"; returns its index.
    /// Its label is `w<index>`.
    ///
    /// ```no_run
    /// # async fn demo(c: &mut durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let a = c.spawn(durastep_testkit::WorkerConfig::default()).await?;
    /// println!("pid {}", c.worker(a).pid());
    /// # Ok(()) }
    /// ```
    pub async fn spawn(&mut self, config: WorkerConfig) -> Result<usize> {
        let i = self.spawn_no_wait(config)?;
        self.workers[i].wait_ready(READY_TIMEOUT).await?;
        Ok(i)
    }

    /// Starts `n` worker processes at once, then waits for all of them to be ready.
    ///
    /// ```no_run
    /// # async fn demo(c: &mut durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let ids = c.spawn_many(4, durastep_testkit::WorkerConfig::default()).await?;
    /// assert_eq!(ids.len(), 4);
    /// # Ok(()) }
    /// ```
    pub async fn spawn_many(&mut self, n: usize, config: WorkerConfig) -> Result<Vec<usize>> {
        let ids = (0..n).map(|_| self.spawn_no_wait(config.clone())).collect::<Result<Vec<_>>>()?;
        for &i in &ids {
            self.workers[i].wait_ready(READY_TIMEOUT).await?;
        }
        Ok(ids)
    }

    /// Starts a worker process without waiting for "ready"; returns its index.
    ///
    /// ```no_run
    /// # fn demo(c: &mut durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let i = c.spawn_no_wait(durastep_testkit::WorkerConfig::default())?;
    /// # let _ = i; Ok(()) }
    /// ```
    pub fn spawn_no_wait(&mut self, config: WorkerConfig) -> Result<usize> {
        let i = self.workers.len();
        let w = WorkerProcess::spawn(&self.bin, &self.url, &format!("w{i}"), config, &self.log_dir)?;
        self.workers.push(w);
        Ok(i)
    }

    /// The worker at index `i`. Panics if there is none.
    ///
    /// ```no_run
    /// # async fn demo(c: &mut durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// c.worker(0).pause().await?;
    /// # Ok(()) }
    /// ```
    pub fn worker(&mut self, i: usize) -> &mut WorkerProcess {
        &mut self.workers[i]
    }

    /// Every worker, by index.
    ///
    /// ```no_run
    /// # fn demo(c: &durastep_testkit::Cluster) { for w in c.workers() { println!("{} {}", w.label(), w.pid()); } }
    /// ```
    pub fn workers(&self) -> &[WorkerProcess] {
        &self.workers
    }

    /// Kills the worker at `i` if it is alive (SIGKILL) and starts a new process
    /// with the same label and config in its place; waits for "ready". Returns the new pid.
    ///
    /// ```no_run
    /// # async fn demo(c: &mut durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let old = c.worker(0).pid();
    /// let new = c.restart(0).await?;
    /// assert_ne!(old, new);
    /// # Ok(()) }
    /// ```
    pub async fn restart(&mut self, i: usize) -> Result<u32> {
        self.restart_with(i, self.workers[i].config().clone()).await
    }

    /// Like [`Cluster::restart`], with a new config (say, without failpoints).
    ///
    /// ```no_run
    /// # async fn demo(c: &mut durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// c.restart_with(0, durastep_testkit::WorkerConfig::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn restart_with(&mut self, i: usize, config: WorkerConfig) -> Result<u32> {
        self.workers[i].kill().await?;
        let label = self.workers[i].label().to_owned();
        let fresh = WorkerProcess::spawn(&self.bin, &self.url, &label, config, &self.log_dir)?;
        // The old process's log file stays in the log directory.
        self.workers[i] = fresh;
        self.workers[i].wait_ready(READY_TIMEOUT).await?;
        Ok(self.workers[i].pid())
    }

    /// SIGTERM to every live worker, then waits for each to exit; returns the
    /// statuses of those that were alive, by index. Fails if one does not exit in time.
    ///
    /// ```no_run
    /// # async fn demo(c: &mut durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// for (i, status) in c.shutdown(std::time::Duration::from_secs(10)).await? {
    ///     assert!(status.success(), "worker {i}: {status}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn shutdown(&mut self, timeout: Duration) -> Result<Vec<(usize, ExitStatus)>> {
        let mut live = Vec::new();
        for (i, w) in self.workers.iter_mut().enumerate() {
            if w.is_running()? {
                w.signal(crate::Signal::Term).await?;
                let _ = w.signal(crate::Signal::Cont).await;
                live.push(i);
            }
        }
        let mut statuses = Vec::new();
        for i in live {
            statuses.push((i, self.workers[i].wait_exit(timeout).await?));
        }
        Ok(statuses)
    }

    /// Sends one five-steps event per input, in batches; returns the run ids in input order.
    ///
    /// ```no_run
    /// # async fn demo(c: &durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let runs = c.send_five_steps((0..2_000).map(durastep_testkit::FiveSteps::new)).await?;
    /// assert_eq!(runs.len(), 2_000);
    /// # Ok(()) }
    /// ```
    pub async fn send_five_steps(&self, inputs: impl IntoIterator<Item = FiveSteps>) -> Result<Vec<Uuid>> {
        self.send_all(inputs.into_iter().map(|i| i.event()).collect()).await
    }

    /// Sends one slow-step event; returns its run id.
    ///
    /// ```no_run
    /// # async fn demo(c: &durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let run = c.send_slow_step(durastep_testkit::SlowStep { n: 1, sleep_ms: Some(2_500) }).await?;
    /// # let _ = run; Ok(()) }
    /// ```
    pub async fn send_slow_step(&self, input: SlowStep) -> Result<Uuid> {
        Ok(self.send_all(vec![input.event()]).await?.remove(0))
    }

    /// Sends events that start one run each, in batches; returns the run ids in input order.
    ///
    /// ```no_run
    /// # async fn demo(c: &durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let input = durastep_testkit::FlowInput { account: "a".into(), n: 1, hold_ms: 5 };
    /// let runs = c.send_events(vec![input.event(durastep_testkit::functions::FLOW_PER_KEY_EVENT)]).await?;
    /// # let _ = runs; Ok(()) }
    /// ```
    pub async fn send_events(&self, events: Vec<Event>) -> Result<Vec<Uuid>> {
        self.send_all(events).await
    }

    /// Sends one sleeper event per input; returns the run ids in input order.
    ///
    /// ```no_run
    /// # async fn demo(c: &durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let runs = c.send_sleepers([durastep_testkit::Sleeper { n: 1, sleep_ms: 1_000 }]).await?;
    /// # let _ = runs; Ok(()) }
    /// ```
    pub async fn send_sleepers(&self, inputs: impl IntoIterator<Item = Sleeper>) -> Result<Vec<Uuid>> {
        self.send_all(inputs.into_iter().map(|i| i.event()).collect()).await
    }

    /// Sends one mixed event per input; returns their run ids, in order.
    ///
    /// ```no_run
    /// # async fn demo(c: &durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// let runs = c.send_mixed([durastep_testkit::Mixed { n: 1, delay_ms: None, nap_ms: None }]).await?;
    /// # let _ = runs; Ok(()) }
    /// ```
    pub async fn send_mixed(&self, inputs: impl IntoIterator<Item = Mixed>) -> Result<Vec<Uuid>> {
        self.send_all(inputs.into_iter().map(|i| i.event()).collect()).await
    }

    async fn send_all(&self, events: Vec<Event>) -> Result<Vec<Uuid>> {
        let mut runs = Vec::with_capacity(events.len());
        let mut events = events.into_iter().peekable();
        while events.peek().is_some() {
            let batch: Vec<Event> = events.by_ref().take(SEND_BATCH).collect();
            for receipt in self.engine.send_batch(batch).await? {
                match receipt.run_ids.as_slice() {
                    [run] => runs.push(*run),
                    other => {
                        let n = other.len();
                        return Err(Error::Unexpected(format!("an event started {n} runs instead of 1")));
                    }
                }
            }
        }
        Ok(runs)
    }

    /// Moves the test database's clock (`durastep.now()`) forward and wakes the
    /// workers: leases expire, sleeps and backoffs become due, without waiting.
    ///
    /// ```no_run
    /// # async fn demo(c: &mut durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
    /// // Every lease taken so far is now expired in the database's eyes.
    /// c.advance_clock(std::time::Duration::from_secs(3_600)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn advance_clock(&self, by: Duration) -> Result<()> {
        Ok(durastep::testing::advance_clock(&self.engine, by).await?)
    }

    /// Waits until every given run is completed, failed, cancelled or skipped.
    ///
    /// ```no_run
    /// # async fn demo(c: &durastep_testkit::Cluster, runs: Vec<uuid::Uuid>) -> durastep_testkit::Result<()> {
    /// c.wait_finished(&runs, std::time::Duration::from_secs(30)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn wait_finished(&self, runs: &[Uuid], timeout: Duration) -> Result<()> {
        let what = format!("{} runs to finish", runs.len());
        let pool = &self.pool;
        crate::wait_for(&what, timeout, || async move {
            let left = crate::checks::unfinished_among(pool, runs).await?;
            Ok((left == 0).then_some(()))
        })
        .await
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("durastep-testkit: worker logs are kept in {}", self.log_dir.display());
            for w in &self.workers {
                eprintln!("----- {} (pid {}) stderr, last lines -----\n{}", w.label(), w.pid(), w.log_tail(40));
            }
        } else if std::env::var_os(KEEP_LOGS).is_some() {
            eprintln!("durastep-testkit: worker logs are kept in {}", self.log_dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.log_dir);
        }
        // Dropping the workers kills them (kill_on_drop).
    }
}
