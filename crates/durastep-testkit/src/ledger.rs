//! The ledger: one row per execution of a step body, written by the test
//! functions on their own connection, outside the step's checkpoint.
//!
//! The ledger is the test's view of the outside world: a step body that ran
//! twice (its worker died before its checkpoint) leaves two rows, whatever
//! `durastep.step_results` says. A row is inserted when the body starts and
//! gets `ended_at` when the body finishes, so a body cut short by SIGKILL shows
//! as a row without `ended_at`.
//!
//! Architecture invariant: every SQL statement on `testkit_ledger` is in this
//! module. Caveat for fault suites: a ledger write is itself a database call, so
//! a fault that breaks the connection can fail a step body (the step is then
//! retried and leaves one more row, possibly without `ended_at`).

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

use crate::error::Result;

/// The ledger table, in the `public` schema of the test database.
pub const TABLE: &str = "testkit_ledger";

const CREATE: &str = "CREATE TABLE IF NOT EXISTS testkit_ledger (
    id          bigserial PRIMARY KEY,
    run_id      uuid NOT NULL,
    step_key    text NOT NULL,
    attempt     integer NOT NULL,
    -- The run's lease epoch as read when the body started (the attempt's own
    -- epoch unless the attempt had already lost its lease).
    lease_epoch bigint,
    pid         integer NOT NULL,
    worker      text NOT NULL,
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at    timestamptz,
    -- The worker's own wall clock when the body started (the database's
    -- started_at is when the INSERT ran, which a slow network can delay).
    worker_clock timestamptz,
    -- Durastep's database clock (durastep.now(): the test offset included)
    -- when the INSERT ran: what flow limits and due times are judged by.
    db_started  timestamptz
);
CREATE INDEX IF NOT EXISTS testkit_ledger_run_step ON testkit_ledger (run_id, step_key);
-- Rows written by the `record` step_tx of the mixed function, inside its
-- transaction: G3 says exactly one per run.
CREATE TABLE IF NOT EXISTS testkit_tx_effects (
    id         bigserial PRIMARY KEY,
    run_id     uuid NOT NULL,
    pid        integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- Rows written by the workload's step_tx steps inside their transaction, with
-- the run's lease epoch as the transaction read it: at most one per stored step.
CREATE TABLE IF NOT EXISTS testkit_wl_tx (
    id         bigserial PRIMARY KEY,
    run_id     uuid NOT NULL,
    step_key   text NOT NULL,
    lease_epoch bigint NOT NULL,
    pid        integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- A model of an external service that honours idempotency keys (a payment API):
-- one row per key, however often it is called with that key.
CREATE TABLE IF NOT EXISTS testkit_external (
    idempotency_key text PRIMARY KEY,
    run_id          uuid NOT NULL,
    step_key        text NOT NULL,
    calls           integer NOT NULL DEFAULT 1,
    first_pid       integer NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp()
)";

/// Creates the ledger table if it is missing. Safe to call from many processes
/// at once (an advisory lock serialises the `CREATE`s).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// durastep_testkit::ledger::create(&pool).await?;
/// # Ok(()) }
/// ```
pub async fn create(pool: &PgPool) -> Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(7412001)").execute(&mut *tx).await?;
    sqlx::raw_sql(CREATE).execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// How a worker's ledger connects.
///
/// ```
/// let o = durastep_testkit::LedgerOptions::default();
/// assert!(!o.synchronous_commit);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LedgerOptions {
    /// Connections of the ledger's own pool (default 2).
    pub pool_size: u32,
    /// Wait for the WAL flush at each ledger commit (default false). Without it
    /// ledger rows are visible at once but a Postgres *crash* (not a clean
    /// restart, which flushes the WAL) can lose the last fraction of a second of
    /// them. Turn it on in tests that crash Postgres itself; it costs one fsync
    /// per ledger write (two per step), which dominates a 10,000-step test.
    pub synchronous_commit: bool,
}

impl Default for LedgerOptions {
    fn default() -> Self {
        LedgerOptions { pool_size: 2, synchronous_commit: false }
    }
}

/// The writing side, used inside step bodies: records who ran which step when.
///
/// ```no_run
/// # async fn demo(url: &str, run: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let ledger = durastep_testkit::Ledger::connect(url, "w0", durastep_testkit::LedgerOptions::default()).await?;
/// let id = ledger.begin(run, "step-1", 1).await?;
/// ledger.end(id).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Ledger {
    pool: PgPool,
    worker: String,
    pid: i32,
}

impl Ledger {
    /// Opens the ledger's own pool (separate from the engine's) and creates the table.
    ///
    /// ```no_run
    /// # async fn demo() -> durastep_testkit::Result<()> {
    /// let url = "postgres://postgres@127.0.0.1/test";
    /// let ledger = durastep_testkit::Ledger::connect(url, "w0", durastep_testkit::LedgerOptions::default()).await?;
    /// # let _ = ledger; Ok(()) }
    /// ```
    pub async fn connect(url: &str, worker: impl Into<String>, options: LedgerOptions) -> Result<Ledger> {
        let mut connect: PgConnectOptions = url.parse()?;
        if !options.synchronous_commit {
            connect = connect.options([("synchronous_commit", "off")]);
        }
        let pool = PgPoolOptions::new()
            .max_connections(options.pool_size.max(1))
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(connect)
            .await?;
        create(&pool).await?;
        Ok(Ledger::with_pool(pool, worker))
    }

    /// A ledger on an existing pool (the table must exist; see [`create`]).
    ///
    /// ```no_run
    /// # fn demo(pool: sqlx::PgPool) {
    /// let ledger = durastep_testkit::Ledger::with_pool(pool, "test-process");
    /// # let _ = ledger; }
    /// ```
    pub fn with_pool(pool: PgPool, worker: impl Into<String>) -> Ledger {
        let pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        Ledger { pool, worker: worker.into(), pid }
    }

    /// Records that a step body starts; returns the row's id for [`Ledger::end`].
    ///
    /// ```no_run
    /// # async fn demo(ledger: durastep_testkit::Ledger, run: uuid::Uuid) -> durastep_testkit::Result<()> {
    /// let id = ledger.begin(run, "step-1", 1).await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub async fn begin(&self, run_id: Uuid, step_key: &str, attempt: u32) -> Result<i64> {
        self.insert_begin(run_id, step_key, attempt, None).await
    }

    /// Like [`Ledger::begin`], for an execution whose attempt's lease epoch the
    /// caller knows (a handler body: `Ctx::lease_epoch`). The run's current
    /// epoch may already be a later attempt's, when this one started late.
    ///
    /// ```no_run
    /// # async fn demo(ledger: durastep_testkit::Ledger, run: uuid::Uuid) -> durastep_testkit::Result<()> {
    /// let id = ledger.begin_at_epoch(run, "body", 1, 1).await?;
    /// # let _ = id; Ok(()) }
    /// ```
    pub async fn begin_at_epoch(&self, run_id: Uuid, step_key: &str, attempt: u32, epoch: i64) -> Result<i64> {
        self.insert_begin(run_id, step_key, attempt, Some(epoch)).await
    }

    /// The ledger row of an execution that starts; without `epoch`, the run's
    /// current lease epoch.
    async fn insert_begin(&self, run_id: Uuid, step_key: &str, attempt: u32, epoch: Option<i64>) -> Result<i64> {
        let id = sqlx::query_scalar(
            "INSERT INTO testkit_ledger (run_id, step_key, attempt, lease_epoch, pid, worker, worker_clock, db_started)
             SELECT $1, $2, $3, coalesce($7::bigint, (SELECT lease_epoch FROM durastep.runs WHERE id = $1)),
                    $4, $5, $6, durastep.now()
             RETURNING id",
        )
        .bind(run_id)
        .bind(step_key)
        .bind(i32::try_from(attempt).unwrap_or(i32::MAX))
        .bind(self.pid)
        .bind(&self.worker)
        .bind(Utc::now())
        .bind(epoch)
        .fetch_one(&self.pool)
        .await?;
        Ok(id)
    }

    /// Records that the step body with this ledger row finished.
    ///
    /// ```no_run
    /// # async fn demo(ledger: durastep_testkit::Ledger, id: i64) -> durastep_testkit::Result<()> {
    /// ledger.end(id).await?;
    /// # Ok(()) }
    /// ```
    pub async fn end(&self, id: i64) -> Result<()> {
        sqlx::query("UPDATE testkit_ledger SET ended_at = clock_timestamp() WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}

impl Ledger {
    /// Records that the step body with this ledger row finished at `at` (the
    /// worker's wall clock: the moment a dropped body stopped, not when the
    /// update reached the database).
    ///
    /// ```no_run
    /// # async fn demo(ledger: durastep_testkit::Ledger, id: i64) -> durastep_testkit::Result<()> {
    /// ledger.end_at(id, chrono::Utc::now()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn end_at(&self, id: i64, at: DateTime<Utc>) -> Result<()> {
        sqlx::query("UPDATE testkit_ledger SET ended_at = $2 WHERE id = $1 AND ended_at IS NULL")
            .bind(id)
            .bind(at)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Inside a workload `step_tx` body: one `testkit_wl_tx` row on the step's
    /// own connection, with the run's lease epoch as this transaction reads
    /// it; returns that epoch.
    ///
    /// ```no_run
    /// # async fn demo(ledger: durastep_testkit::Ledger, conn: &mut sqlx::PgConnection, run: uuid::Uuid) -> durastep_testkit::Result<()> {
    /// let epoch = ledger.wl_tx_effect(conn, run, "t0").await?;
    /// # let _ = epoch; Ok(()) }
    /// ```
    pub async fn wl_tx_effect(&self, conn: &mut sqlx::PgConnection, run_id: Uuid, step_key: &str) -> Result<i64> {
        Ok(sqlx::query_scalar(
            "INSERT INTO testkit_wl_tx (run_id, step_key, lease_epoch, pid)
             SELECT $1, $2, (SELECT lease_epoch FROM durastep.runs WHERE id = $1), $3
             RETURNING lease_epoch",
        )
        .bind(run_id)
        .bind(step_key)
        .bind(self.pid)
        .fetch_one(conn)
        .await?)
    }
}

impl Ledger {
    /// How many executions of one step of one run the ledger holds so far
    /// (including one just begun): lets a body act on its first execution only,
    /// where `Ctx::attempt` does not tell (a back-pressure retry keeps the attempt).
    ///
    /// ```no_run
    /// # async fn demo(ledger: durastep_testkit::Ledger, run: uuid::Uuid) -> durastep_testkit::Result<()> {
    /// let first = ledger.executions(run, "attempt").await? == 1;
    /// # let _ = first; Ok(()) }
    /// ```
    pub async fn executions(&self, run_id: Uuid, step_key: &str) -> Result<i64> {
        Ok(sqlx::query_scalar("SELECT count(*) FROM testkit_ledger WHERE run_id = $1 AND step_key = $2")
            .bind(run_id)
            .bind(step_key)
            .fetch_one(&self.pool)
            .await?)
    }

    /// Calls the external service: a write keyed by `idempotency_key` that
    /// happens once per key (later calls with the same key only count). Returns
    /// true when this call made the write.
    ///
    /// ```no_run
    /// # async fn demo(ledger: durastep_testkit::Ledger, run: uuid::Uuid) -> durastep_testkit::Result<()> {
    /// let wrote = ledger.external_call(&format!("{run}:slow"), run, "slow").await?;
    /// # let _ = wrote; Ok(()) }
    /// ```
    pub async fn external_call(&self, idempotency_key: &str, run_id: Uuid, step_key: &str) -> Result<bool> {
        Ok(sqlx::query_scalar(
            "INSERT INTO testkit_external (idempotency_key, run_id, step_key, first_pid) VALUES ($1, $2, $3, $4)
             ON CONFLICT (idempotency_key) DO UPDATE SET calls = testkit_external.calls + 1
             RETURNING calls = 1",
        )
        .bind(idempotency_key)
        .bind(run_id)
        .bind(step_key)
        .bind(self.pid)
        .fetch_one(&self.pool)
        .await?)
    }
}

impl Ledger {
    /// Inside a `step_tx` body: writes the run's transactional effect on the
    /// step's own connection (it commits or rolls back with the checkpoint).
    ///
    /// ```no_run
    /// # async fn demo(ledger: durastep_testkit::Ledger, conn: &mut sqlx::PgConnection, run: uuid::Uuid) -> durastep_testkit::Result<()> {
    /// ledger.tx_effect(conn, run).await?;
    /// # Ok(()) }
    /// ```
    pub async fn tx_effect(&self, conn: &mut sqlx::PgConnection, run_id: Uuid) -> Result<()> {
        sqlx::query("INSERT INTO testkit_tx_effects (run_id, pid) VALUES ($1, $2)")
            .bind(run_id)
            .bind(self.pid)
            .execute(conn)
            .await?;
        Ok(())
    }
}

/// Transactional effects per run: `(run, rows)` for every run with a row.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let per_run = durastep_testkit::ledger::tx_effects_per_run(&pool).await?;
/// assert!(per_run.values().all(|&n| n == 1));
/// # Ok(()) }
/// ```
pub async fn tx_effects_per_run(pool: &PgPool) -> Result<HashMap<Uuid, i64>> {
    let rows: Vec<(Uuid, i64)> =
        sqlx::query_as("SELECT run_id, count(*) FROM testkit_tx_effects GROUP BY run_id").fetch_all(pool).await?;
    Ok(rows.into_iter().collect())
}

/// What the external service saw ([`Ledger::external_call`]).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let s = durastep_testkit::ledger::external_summary(&pool).await?;
/// assert_eq!(s.duplicates, 0, "{s:?}");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExternalSummary {
    /// Calls received, over all keys.
    pub calls: i64,
    /// Writes made (distinct keys).
    pub writes: i64,
    /// Calls absorbed by an existing key (`calls - writes`).
    pub deduplicated: i64,
    /// Writes beyond the first for one (run, step): the key was not stable
    /// across attempts, so the service wrote twice.
    pub duplicates: i64,
}

/// Computes the [`ExternalSummary`] in one query.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// println!("{:?}", durastep_testkit::ledger::external_summary(&pool).await?);
/// # Ok(()) }
/// ```
pub async fn external_summary(pool: &PgPool) -> Result<ExternalSummary> {
    let (calls, writes, duplicates): (i64, i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(calls), 0)::bigint, count(*), count(*) - count(DISTINCT (run_id, step_key))
           FROM testkit_external",
    )
    .fetch_one(pool)
    .await?;
    Ok(ExternalSummary { calls, writes, deduplicated: calls - writes, duplicates })
}

/// One execution of a step body, as the ledger saw it.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, run: uuid::Uuid) -> durastep_testkit::Result<()> {
/// for e in durastep_testkit::ledger::executions_of_run(&pool, run).await? {
///     println!("{} by pid {} (attempt {}, epoch {:?}) ended: {}", e.step_key, e.pid, e.attempt, e.lease_epoch, e.ended_at.is_some());
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Execution {
    /// Ledger row id: increases with the order in which bodies started.
    pub id: i64,
    /// The run.
    pub run_id: Uuid,
    /// The step key (`step-1`, ...).
    pub step_key: String,
    /// The attempt that ran the body (`Ctx::attempt`).
    pub attempt: i32,
    /// The run's lease epoch when the body started.
    pub lease_epoch: Option<i64>,
    /// The worker process.
    pub pid: i32,
    /// The worker's label.
    pub worker: String,
    /// When the body started (database clock, not Durastep's test clock).
    pub started_at: DateTime<Utc>,
    /// When it finished; `None` if it never did (killed, or dropped mid-body).
    pub ended_at: Option<DateTime<Utc>>,
    /// The worker's own wall clock when the body started (`started_at` is
    /// when the database ran the ledger INSERT, later if the network was slow or cut).
    pub worker_clock: Option<DateTime<Utc>>,
}

/// Every execution of one run, in start order.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, run: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let rows = durastep_testkit::ledger::executions_of_run(&pool, run).await?;
/// assert!(rows.iter().all(|e| e.run_id == run));
/// # Ok(()) }
/// ```
pub async fn executions_of_run(pool: &PgPool, run_id: Uuid) -> Result<Vec<Execution>> {
    Ok(sqlx::query_as(
        "SELECT id, run_id, step_key, attempt, lease_epoch, pid, worker, started_at, ended_at, worker_clock
           FROM testkit_ledger WHERE run_id = $1 ORDER BY id",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?)
}

/// Executions of one step of one run, in start order.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, run: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let rows = durastep_testkit::ledger::executions_of_step(&pool, run, "step-3").await?;
/// assert!(rows.len() <= 2);
/// # Ok(()) }
/// ```
pub async fn executions_of_step(pool: &PgPool, run_id: Uuid, step_key: &str) -> Result<Vec<Execution>> {
    Ok(sqlx::query_as(
        "SELECT id, run_id, step_key, attempt, lease_epoch, pid, worker, started_at, ended_at, worker_clock
           FROM testkit_ledger WHERE run_id = $1 AND step_key = $2 ORDER BY id",
    )
    .bind(run_id)
    .bind(step_key)
    .fetch_all(pool)
    .await?)
}

/// The highest ledger id so far (0 when empty): a mark to ask later what
/// started after it ([`executions_since`]).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let mark = durastep_testkit::ledger::high_water(&pool).await?;
/// // ... resume a stopped worker ...
/// let later = durastep_testkit::ledger::executions_since(&pool, mark).await?;
/// # let _ = later; Ok(()) }
/// ```
pub async fn high_water(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT coalesce(max(id), 0) FROM testkit_ledger").fetch_one(pool).await?)
}

/// Executions whose row id is above `mark`, in start order.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let all = durastep_testkit::ledger::executions_since(&pool, 0).await?;
/// # let _ = all; Ok(()) }
/// ```
pub async fn executions_since(pool: &PgPool, mark: i64) -> Result<Vec<Execution>> {
    Ok(sqlx::query_as(
        "SELECT id, run_id, step_key, attempt, lease_epoch, pid, worker, started_at, ended_at, worker_clock
           FROM testkit_ledger WHERE id > $1 ORDER BY id",
    )
    .bind(mark)
    .fetch_all(pool)
    .await?)
}

/// How many times each (run, step) body ran.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let counts = durastep_testkit::ledger::execution_counts(&pool).await?;
/// assert!(counts.values().all(|&n| n == 1));
/// # Ok(()) }
/// ```
pub async fn execution_counts(pool: &PgPool) -> Result<HashMap<(Uuid, String), i64>> {
    let rows: Vec<(Uuid, String, i64)> =
        sqlx::query_as("SELECT run_id, step_key, count(*) FROM testkit_ledger GROUP BY run_id, step_key")
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().map(|(r, k, n)| ((r, k), n)).collect())
}

/// Totals over the whole ledger.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let s = durastep_testkit::ledger::summary(&pool).await?;
/// assert_eq!(s.max_per_step, 1, "some step body ran twice: {s:?}");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    /// Ledger rows (step body executions).
    pub executions: i64,
    /// Distinct (run, step) pairs executed.
    pub steps: i64,
    /// The most executions of any one (run, step); 0 on an empty ledger.
    pub max_per_step: i64,
    /// (run, step) pairs executed more than once.
    pub repeated_steps: i64,
    /// Executions that never recorded their end.
    pub unfinished: i64,
    /// Distinct worker processes that executed something.
    pub pids: i64,
}

/// Computes the [`Summary`] of the ledger in one query.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// println!("{:?}", durastep_testkit::ledger::summary(&pool).await?);
/// # Ok(()) }
/// ```
pub async fn summary(pool: &PgPool) -> Result<Summary> {
    let (executions, steps, max_per_step, repeated_steps, unfinished, pids): (i64, i64, i64, i64, i64, i64) =
        sqlx::query_as(
            "WITH per AS (SELECT run_id, step_key, count(*) AS n FROM testkit_ledger GROUP BY run_id, step_key)
             SELECT (SELECT count(*) FROM testkit_ledger),
                    (SELECT count(*) FROM per),
                    (SELECT coalesce(max(n), 0) FROM per),
                    (SELECT count(*) FROM per WHERE n > 1),
                    (SELECT count(*) FROM testkit_ledger WHERE ended_at IS NULL),
                    (SELECT count(DISTINCT pid) FROM testkit_ledger)",
        )
        .fetch_one(pool)
        .await?;
    Ok(Summary { executions, steps, max_per_step, repeated_steps, unfinished, pids })
}

/// (run, step, executions) for every step body that ran more than once.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let repeated = durastep_testkit::ledger::repeated_steps(&pool).await?;
/// assert!(repeated.is_empty(), "{repeated:?}");
/// # Ok(()) }
/// ```
pub async fn repeated_steps(pool: &PgPool) -> Result<Vec<(Uuid, String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, step_key, count(*) FROM testkit_ledger
          GROUP BY run_id, step_key HAVING count(*) > 1 ORDER BY run_id, step_key",
    )
    .fetch_all(pool)
    .await?)
}

/// Executions per worker process: (pid, worker label, executions), by pid.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// for (pid, label, n) in durastep_testkit::ledger::executions_per_pid(&pool).await? {
///     println!("{label} ({pid}): {n}");
/// }
/// # Ok(()) }
/// ```
pub async fn executions_per_pid(pool: &PgPool) -> Result<Vec<(i32, String, i64)>> {
    Ok(sqlx::query_as("SELECT pid, min(worker), count(*) FROM testkit_ledger GROUP BY pid ORDER BY pid")
        .fetch_all(pool)
        .await?)
}

/// Executions that started (by their worker's clock, else the database's)
/// after their step's result was stored: a stored step run again, which G2
/// forbids. Reads `durastep.step_results` (never writes it).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let again = durastep_testkit::ledger::started_after_stored(&pool).await?;
/// assert!(again.is_empty(), "{again:?}");
/// # Ok(()) }
/// ```
pub async fn started_after_stored(pool: &PgPool) -> Result<Vec<Execution>> {
    Ok(sqlx::query_as(
        "SELECT l.id, l.run_id, l.step_key, l.attempt, l.lease_epoch, l.pid, l.worker, l.started_at, l.ended_at,
                l.worker_clock
           FROM testkit_ledger l
           JOIN durastep.step_results s ON s.run_id = l.run_id AND s.step_key = l.step_key
          WHERE coalesce(l.worker_clock, l.started_at) > s.created_at
          ORDER BY l.id",
    )
    .fetch_all(pool)
    .await?)
}

/// Every execution, in start order.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let all = durastep_testkit::ledger::executions(&pool).await?;
/// # let _ = all; Ok(()) }
/// ```
pub async fn executions(pool: &PgPool) -> Result<Vec<Execution>> {
    executions_since(pool, 0).await
}

/// A sleeper run's wake-up, as the database saw it: the wake time its `nap`
/// checkpoint stores, and when (database clock: the ledger's `started_at`
/// plus the test clock offset) the body of its `after` step started.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// for w in durastep_testkit::ledger::wake_ups(&pool).await? {
///     assert!(w.resumed_at >= w.wake_at, "{w:?}");
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct WakeUp {
    /// The run.
    pub run_id: Uuid,
    /// The stored wake time.
    pub wake_at: DateTime<Utc>,
    /// When the `after` step's body started, by the database clock.
    pub resumed_at: DateTime<Utc>,
    /// The worker that ran it.
    pub worker: String,
    /// Its wall clock then (skewed, in a clock-skew test).
    pub worker_clock: Option<DateTime<Utc>>,
    /// The sleep asked for (`Sleeper::sleep_ms`).
    pub sleep_ms: i64,
    /// The earliest end of a `before` body (database clock): the sleep was
    /// called after it.
    pub before_ended_at: Option<DateTime<Utc>>,
    /// When the `nap` checkpoint was stored (database clock): the sleep was
    /// called before it.
    pub armed_at: DateTime<Utc>,
}

/// Every execution of a sleeper run's `after` step with its run's stored wake
/// time. Reads `durastep.step_results`, `runs`, `events` and `clock` (never writes them).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let early = durastep_testkit::ledger::wake_ups(&pool).await?.into_iter().filter(|w| w.resumed_at < w.wake_at).count();
/// assert_eq!(early, 0);
/// # Ok(()) }
/// ```
pub async fn wake_ups(pool: &PgPool) -> Result<Vec<WakeUp>> {
    Ok(sqlx::query_as(
        "SELECT l.run_id, (s.output->>'wake_at')::timestamptz AS wake_at,
                l.started_at + c.offset_by AS resumed_at, l.worker, l.worker_clock,
                (e.payload->>'sleep_ms')::bigint AS sleep_ms,
                (SELECT min(b.ended_at) + c.offset_by FROM testkit_ledger b
                  WHERE b.run_id = l.run_id AND b.step_key = 'before') AS before_ended_at,
                s.created_at + c.offset_by AS armed_at
           FROM testkit_ledger l
           JOIN durastep.step_results s ON s.run_id = l.run_id AND s.step_key = 'nap'
           JOIN durastep.runs r ON r.id = l.run_id
           JOIN durastep.events e ON e.id = r.event_id
          CROSS JOIN durastep.clock c
          WHERE l.step_key = 'after'
          ORDER BY l.id",
    )
    .fetch_all(pool)
    .await?)
}
