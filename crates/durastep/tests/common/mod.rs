//! Shared helpers for the integration tests: an engine on the test's own
//! database with fast timings, a worker running in the background, gates that
//! hold a handler at a chosen point, and waits on conditions with deadlines.
#![allow(dead_code)]

pub mod ahead;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use durastep::{Engine, Function, Limits, Run, WorkerHandle, WorkerOptions};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::watch;
use uuid::Uuid;

/// How long any single wait in a test may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(15);

/// Worker timings for tests: short polls and leases, so nothing waits long.
pub fn fast_options() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(500),
        reap_interval: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(5),
        max_in_flight: 16,
        ..Default::default()
    }
}

/// The lease of [`stalling_options`]; advance the clock past it to expire a lease.
pub const LONG_LEASE: Duration = Duration::from_secs(60);

/// A worker that can be made to lose its lease on purpose: one attempt at a
/// time, a long lease whose heartbeat does not come within a test's lifetime,
/// and no reaper of its own. Advance the database clock past [`LONG_LEASE`] and
/// call `reap_expired_leases`: the worker still runs its attempt, unaware that
/// another worker may now take the run over.
pub fn stalling_options() -> WorkerOptions {
    WorkerOptions {
        max_in_flight: 1,
        lease: LONG_LEASE,
        heartbeat_interval: Duration::from_secs(30),
        reap_interval: Duration::from_secs(600),
        ..fast_options()
    }
}

pub async fn engine(opts: &PgConnectOptions, functions: Vec<Function>) -> Engine {
    engine_with(opts, functions, fast_options()).await
}

pub async fn engine_with(opts: &PgConnectOptions, functions: Vec<Function>, worker: WorkerOptions) -> Engine {
    try_engine(opts, functions, worker, Limits::default()).await.expect("build engine")
}

/// An engine with its own input limits.
pub async fn engine_with_limits(opts: &PgConnectOptions, functions: Vec<Function>, limits: Limits) -> Engine {
    try_engine(opts, functions, fast_options(), limits).await.expect("build engine")
}

/// Builds an engine and hands back the build's result (for tests of build errors).
pub async fn try_engine(
    opts: &PgConnectOptions,
    functions: Vec<Function>,
    worker: WorkerOptions,
    limits: Limits,
) -> Result<Engine, durastep::Error> {
    // The server's JIT settings as they are (on, by default): Durastep's
    // statements must not need it off.
    let pool = PgPoolOptions::new().max_connections(6).connect_with(opts.clone()).await.expect("connect");
    let mut b = Engine::builder().pool(pool).worker_options(worker).limits(limits);
    for f in functions {
        b = b.function(f);
    }
    b.build().await
}

/// A worker in the background (the engine's own [`WorkerHandle`]); its
/// `stop` fails the test if the worker returned an error.
pub struct WorkerGuard(WorkerHandle);

impl WorkerGuard {
    pub async fn stop(self) {
        self.0.stop().await.expect("worker result");
    }

    /// Stops the worker and fails the test if it takes longer than `limit`.
    pub async fn stop_within(self, limit: Duration) {
        tokio::time::timeout(limit, self.stop())
            .await
            .unwrap_or_else(|_| panic!("worker did not stop within {limit:?}"));
    }

    /// Tells the worker to stop without waiting for it.
    pub fn request_stop(&self) {
        self.0.request_stop();
    }

    /// Whether the worker task has returned.
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

pub fn spawn_worker(engine: &Engine) -> WorkerGuard {
    WorkerGuard(engine.spawn_worker())
}

/// The database URL of a test's own database (for worker processes).
pub fn url_of(opts: &PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("postgres")
    )
}

/// Logs to the test output when RUST_LOG is set (tests only; the library never installs a subscriber).
pub fn init_logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}

/// A one-way latch: closed until `open`, then open for good. Handlers wait on
/// gates the test opens, and open gates the test waits on ("handler reached X").
#[derive(Clone)]
pub struct Gate {
    tx: Arc<watch::Sender<bool>>,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    pub fn new() -> Self {
        Gate { tx: Arc::new(watch::channel(false).0) }
    }

    pub fn open(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_open(&self) -> bool {
        *self.tx.borrow()
    }

    /// Waits until the gate is open (forever, if nobody opens it).
    pub async fn wait(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|open| *open).await;
    }

    /// Waits until the gate is open; fails the test after [`DEADLINE`].
    pub async fn reached(&self, what: &str) {
        tokio::time::timeout(DEADLINE, self.wait()).await.unwrap_or_else(|_| panic!("timed out waiting for {what}"));
    }
}

/// Opens its gate when dropped: put one in a handler to learn when the worker
/// dropped (or finished) that handler's future.
pub struct OpenOnDrop(pub Gate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Polls `check` every 20 ms until it holds; fails the test after [`DEADLINE`].
pub async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the run satisfies `pred` and returns it; fails the test after [`DEADLINE`].
pub async fn wait_for_run_where(engine: &Engine, run_id: Uuid, what: &str, pred: impl Fn(&Run) -> bool) -> Run {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let run = engine.run(run_id).await.expect("load run");
        if pred(&run) {
            return run;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}; run is {run:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until flow control parks the run (a concurrency, throttle or
/// back-pressure rule holds it) and returns what holds it, as
/// `engine.inspect().why(id)` says.
pub async fn parked(engine: &Engine, run_id: Uuid, what: &str) -> durastep::inspect::Blocker {
    use durastep::inspect::{BlockerKind, Why};
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let why = engine.inspect().why(run_id).await.expect("why");
        if let Why::Blocked(b) = &why
            && matches!(b.kind, BlockerKind::Concurrency | BlockerKind::Throttle | BlockerKind::Backpressure)
        {
            return b.clone();
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}; why: {why:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the run is finished; fails the test if it is not within [`DEADLINE`].
pub async fn finished(engine: &Engine, run_id: Uuid) -> Run {
    wait_for_run_where(engine, run_id, "the run to finish", |r| r.state.is_finished()).await
}

/// Checks, for `window`, that the run keeps satisfying `pred` (used to show that
/// something does NOT happen: a timer that must not fire, a run that must not be claimed).
pub async fn stays(engine: &Engine, run_id: Uuid, window: Duration, what: &str, pred: impl Fn(&Run) -> bool) {
    let until = tokio::time::Instant::now() + window;
    loop {
        let run = engine.run(run_id).await.expect("load run");
        assert!(pred(&run), "expected the run to stay {what}; it is {run:?}");
        if tokio::time::Instant::now() >= until {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// One row of `durastep.step_results`.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRow {
    pub key: String,
    pub output: Value,
    pub lease_epoch: i64,
}

/// The stored step results of a run, by key.
pub async fn step_rows(engine: &Engine, run_id: Uuid) -> Vec<StepRow> {
    let rows: Vec<(String, Value, i64)> = sqlx::query_as(
        "SELECT step_key, output, lease_epoch FROM durastep.step_results WHERE run_id = $1 ORDER BY step_key",
    )
    .bind(run_id)
    .fetch_all(engine.pool())
    .await
    .expect("load step results");
    rows.into_iter().map(|(key, output, lease_epoch)| StepRow { key, output, lease_epoch }).collect()
}

/// The lease epoch each claim of a run set, in claim order (the `running`
/// entries of `durastep.run_timeline`: each attempt's start). Claims move the epoch forward by a random amount, so
/// tests compare a row's epoch with these instead of with a count.
pub async fn claim_epochs(engine: &Engine, run_id: Uuid) -> Vec<i64> {
    sqlx::query_scalar(
        "SELECT lease_epoch FROM durastep.run_timeline WHERE run_id = $1 AND state = 'running' ORDER BY seq, part",
    )
    .bind(run_id)
    .fetch_all(engine.pool())
    .await
    .expect("load claim epochs")
}

/// The stored result of one step, if any.
pub async fn step_row(engine: &Engine, run_id: Uuid, key: &str) -> Option<StepRow> {
    step_rows(engine, run_id).await.into_iter().find(|r| r.key == key)
}

/// The run's current lease epoch and worker, straight from the table.
pub async fn lease_of(engine: &Engine, run_id: Uuid) -> (i64, Option<Uuid>) {
    sqlx::query_as("SELECT lease_epoch, worker_id FROM durastep.runs WHERE id = $1")
        .bind(run_id)
        .fetch_one(engine.pool())
        .await
        .expect("load lease")
}

/// `SELECT count(*)` of any query (a table name with an optional WHERE).
/// A claim's text as the worker sends it after a claim that came back full:
/// without the lines that end with `-- few` (its due read; `store::claim`
/// makes it the same way). Panics if no line has the mark, so that a mark
/// renamed in the claims cannot make a test compare a claim with itself.
pub fn walk_only(sql: &str) -> String {
    let walk: String = sql.lines().filter(|l| !l.trim_end().ends_with("-- few")).flat_map(|l| [l, "\n"]).collect();
    assert!(walk.len() < sql.len() && !walk.contains("FROM due"), "no due read marked `-- few` in the claim");
    walk
}

/// Rows of `durastep.runs` read by sequential scans so far, as the
/// statistics have them after this connection's own are flushed (the pool
/// has one connection; `pg_stat_force_next_flush` makes it flush when it
/// next goes idle, before the statistics are read in a new transaction).
pub async fn runs_seq_reads(pool: &sqlx::PgPool) -> i64 {
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(pool).await.expect("flush statistics");
    sqlx::query_scalar("SELECT seq_tup_read FROM pg_stat_user_tables WHERE relid = 'durastep.runs'::regclass")
        .fetch_one(pool)
        .await
        .expect("runs' statistics")
}

pub async fn count(engine: &Engine, from: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {from}")))
        .fetch_one(engine.pool())
        .await
        .expect("count")
}

/// A run's journal, wherever its entries are stored (`durastep.run_journal`),
/// in position order, each as "position kind key".
pub async fn journal(engine: &Engine, run_id: Uuid) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT position || ' ' || kind || ' ' || step_key FROM durastep.run_journal
          WHERE run_id = $1 ORDER BY position",
    )
    .bind(run_id)
    .fetch_all(engine.pool())
    .await
    .expect("load the journal")
}

/// The ids of a function's runs, oldest first.
pub async fn runs_of(engine: &Engine, function_id: &str) -> Vec<Uuid> {
    sqlx::query_scalar("SELECT id FROM durastep.runs WHERE function_id = $1 ORDER BY created_at, id")
        .bind(function_id)
        .fetch_all(engine.pool())
        .await
        .expect("load runs")
}

/// Gates for a lease takeover: attempt 1 (the stale one, in worker A) and
/// attempt 2 (in worker B) each wait at their own gate; `a_dropped` opens when
/// the worker drops attempt 1's handler (put an [`OpenOnDrop`] in the handler).
#[derive(Default)]
pub struct Handoff {
    pub a_entered: Gate,
    pub a_gate: Gate,
    pub a_dropped: Gate,
    pub b_entered: Gate,
    pub b_gate: Gate,
}

impl Handoff {
    /// Attempt 1 waits at gate A, later attempts at gate B.
    pub async fn hold(&self, attempt: u32) {
        if attempt == 1 {
            self.a_entered.open();
            self.a_gate.wait().await;
        } else {
            self.b_entered.open();
            self.b_gate.wait().await;
        }
    }

    /// A guard for attempt 1's handler that opens `a_dropped` when the handler is dropped.
    pub fn drop_guard(&self, attempt: u32) -> Option<OpenOnDrop> {
        (attempt == 1).then(|| OpenOnDrop(self.a_dropped.clone()))
    }
}

/// Makes worker A lose a run to worker B while A's attempt still runs.
///
/// Sends `go`, lets worker A (with [`stalling_options`]) claim it and reach gate
/// A, expires A's lease by moving the database clock past [`LONG_LEASE`], reaps
/// it, and starts worker B (fast options), whose attempt 2 reaches gate B. A's
/// heartbeat does not come within a test, so A does not know it lost the lease:
/// from here only the database's fencing can stop its writes. `make` builds the
/// function for each engine. Returns the run and both engines and workers.
pub async fn take_over(
    opts: &PgConnectOptions,
    make: impl Fn() -> Function,
    h: &Handoff,
) -> (Uuid, Engine, WorkerGuard, Engine, WorkerGuard) {
    take_over_with(opts, make, h, stalling_options()).await
}

/// [`take_over`] with worker A's options (built on [`stalling_options`]).
pub async fn take_over_with(
    opts: &PgConnectOptions,
    make: impl Fn() -> Function,
    h: &Handoff,
    worker_a: WorkerOptions,
) -> (Uuid, Engine, WorkerGuard, Engine, WorkerGuard) {
    let engine_a = engine_with(opts, vec![make()], worker_a).await;
    let id = engine_a.send(durastep::Event::new("go", &())).await.expect("send").run_ids[0];
    let wa = spawn_worker(&engine_a);
    h.a_entered.reached("attempt 1 to reach its gate").await;
    assert_eq!(vec![lease_of(&engine_a, id).await.0], claim_epochs(&engine_a, id).await, "one claim");

    durastep::testing::advance_clock(&engine_a, LONG_LEASE + Duration::from_secs(1)).await.expect("advance clock");
    assert_eq!(engine_a.reap_expired_leases().await.expect("reap"), 1);
    let run = engine_a.run(id).await.expect("load run");
    assert_eq!((run.state, run.attempt), (durastep::RunState::Queued, 2), "{run:?}");

    let engine_b = engine(opts, vec![make()]).await;
    let wb = spawn_worker(&engine_b);
    h.b_entered.reached("attempt 2 to reach its gate").await;
    assert_eq!(claim_epochs(&engine_b, id).await.get(1), Some(&lease_of(&engine_b, id).await.0), "attempt 2's claim");
    assert!(!h.a_dropped.is_open(), "worker A noticed the lost lease itself; the test would not test fencing");
    (id, engine_a, wa, engine_b, wb)
}

/// Releases the stale attempt 1 and stops worker A, which waits for that
/// attempt to end, so every write it tried has been answered.
pub async fn release_stale(h: &Handoff, wa: WorkerGuard) {
    h.a_gate.open();
    wa.stop_within(Duration::from_secs(10)).await;
    assert!(h.a_dropped.is_open(), "the stale handler was not dropped");
}

/// Runs one statement on a connection of its own (setup before any engine exists).
pub async fn exec(opts: &PgConnectOptions, sql: &'static str) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect_with(opts).await.expect("connect");
    sqlx::query(sql).execute(&mut conn).await.expect("setup statement");
    conn.close().await.expect("close");
}

/// A login role with the reader grants of docs/security.md (the ```sql block
/// after `<!-- reader-grants -->`), on the test's database.
pub struct ReaderRole {
    /// The reader's URL.
    pub url: String,
    name: String,
    admin: sqlx::PgPool,
}

impl ReaderRole {
    /// Creates the role (after the migrations: the grants cover the tables that exist).
    pub async fn create(opts: &PgConnectOptions) -> ReaderRole {
        let doc = include_str!("../../../../docs/security.md");
        let (_, after) = doc.split_once("<!-- reader-grants -->").expect("marker in docs/security.md");
        let block = after.split_once("```sql\n").expect("sql block").1;
        let grants = block.split_once("```").expect("end of sql block").0;
        let name = format!("durastep_reader_{}", Uuid::new_v4().simple());
        let admin = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.expect("admin");
        let sql = format!("CREATE ROLE {name} LOGIN; {}", grants.replace("durastep_reader", &name));
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&admin).await.expect("the reader grants of docs/security.md");
        ReaderRole { url: url_of(&opts.clone().username(&name)), name, admin }
    }

    /// Drops the role (call it at the end of the test, before its asserts fail).
    pub async fn drop(self) {
        for sql in [format!("DROP OWNED BY {}", self.name), format!("DROP ROLE {}", self.name)] {
            sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone())).execute(&self.admin).await.expect(&sql);
        }
    }
}

/// The claims of earlier versions that [`claim_as_earlier_version`] makes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum EarlierClaim {
    /// Migrations 0020 to 0033: no claim record (the trigger lists the run).
    Unlisted,
    /// Migrations 0034 to 0043: a claim record of its own, named in `claim_id`.
    Listed,
}

/// Makes `run_id` running as a claim of an earlier version did, its lease
/// already lapsed: a new epoch and worker, its own `running` history row,
/// the history mark flipped, and no attempt start noted on the run (0044).
pub async fn claim_as_earlier_version(engine: &Engine, run_id: Uuid, claim: EarlierClaim) {
    sqlx::query(
        "WITH k AS (SELECT CASE WHEN $2 THEN nextval('durastep.run_claims_id_seq') END AS id),
         c AS (
            UPDATE durastep.runs SET state = 'running', lease_epoch = lease_epoch + 1,
                   worker_id = gen_random_uuid(), started_at = coalesce(started_at, durastep.now()),
                   claim_id = CASE WHEN $2 THEN (SELECT k.id FROM k) ELSE claim_id END,
                   lease_expires_at = durastep.now() - interval '1 second', history_noted = NOT history_noted
             WHERE id = $1
            RETURNING id, attempt, lease_epoch, worker_id, lease_expires_at),
         l AS (
            INSERT INTO durastep.run_claims (id, recheck_at, run_ids, epochs)
            SELECT (SELECT k.id FROM k), c.lease_expires_at, ARRAY[c.id], ARRAY[c.lease_epoch] FROM c WHERE $2)
         INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, worker_id)
         SELECT id, durastep.now(), 'running', attempt, lease_epoch, worker_id FROM c",
    )
    .bind(run_id)
    .bind(claim == EarlierClaim::Listed)
    .execute(engine.pool())
    .await
    .expect("a claim of an earlier version");
}

/// Whether the send of `event_id` claimed the run itself (handed it to an
/// idle worker): the run's first attempt started in the send's own
/// transaction (the start's time is the transaction's, the run's creation
/// time; a claim's transaction starts after the send's has committed), and
/// the run is the event's.
pub async fn handed_by_its_send(engine: &Engine, run_id: Uuid, event_id: Uuid) -> bool {
    sqlx::query_scalar(
        "SELECT (SELECT h.at FROM durastep.run_timeline h WHERE h.run_id = $1 AND h.state = 'running'
                  ORDER BY h.seq, h.part LIMIT 1)
              = (SELECT r.created_at FROM durastep.runs r WHERE r.id = $1 AND r.event_id = $2)",
    )
    .bind(run_id)
    .bind(event_id)
    .fetch_one(engine.pool())
    .await
    .unwrap()
}

/// Sends events named `name` through `engine` until a send hands its run to
/// an idle worker (the worker offers its slots once its last claim found
/// nothing due); the payload of send `i` is `payload(i)`, and each run must
/// complete with it as its output (an echo). Returns how many sends it took.
/// Between sends it waits longer each time (20 ms, 40 ms, ... up to 1 s), so
/// that a busy machine's slow empty claim delays the offer, not the test's
/// verdict.
pub async fn send_until_handed_with(
    engine: &Engine,
    name: &str,
    payload: impl Fn(usize) -> serde_json::Value,
) -> usize {
    for i in 1..=50 {
        let receipt = engine.send(durastep::Event::new(name, &payload(i))).await.unwrap();
        let run = finished(engine, receipt.run_ids[0]).await;
        assert_eq!(run.output, Some(payload(i)), "{run:?}");
        if handed_by_its_send(engine, receipt.run_ids[0], receipt.event_id).await {
            return i;
        }
        tokio::time::sleep(Duration::from_millis(20 * i.min(50) as u64)).await;
    }
    panic!("no send handed its run to an idle worker in 50 sends");
}

/// [`send_until_handed_with`] the payload `{"i": i}`.
pub async fn send_until_handed(engine: &Engine, name: &str) -> usize {
    send_until_handed_with(engine, name, |i| serde_json::json!({"i": i})).await
}

/// Fails unless each run was claimed once (one attempt's start): by
/// its send, which handed it to a worker, or by a worker, never both.
pub async fn assert_claimed_once_each(engine: &Engine) {
    let claims: Vec<i64> = sqlx::query_scalar(
        "SELECT count(*) FILTER (WHERE h.state = 'running') FROM durastep.runs r
           JOIN durastep.run_timeline h ON h.run_id = r.id GROUP BY r.id",
    )
    .fetch_all(engine.pool())
    .await
    .unwrap();
    assert!(claims.iter().all(|&n| n == 1), "a run claimed more than once: {claims:?}");
}
