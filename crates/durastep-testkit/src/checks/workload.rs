//! The SQL of the workload's oracle ([`crate::workload`]): reads of the
//! engine's tables, plus one observer trigger that records, for every stored
//! step result, the run's lease epoch and state as the storing transaction saw
//! them (into `testkit_wl_commits`, a table of the test kit; the trigger never
//! changes an engine row).

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::error::Result;

const OBSERVER: &str = "
CREATE TABLE IF NOT EXISTS testkit_wl_commits (
    run_id       uuid NOT NULL,
    step_key     text NOT NULL,
    stored_epoch bigint NOT NULL,
    run_epoch    bigint,
    run_state    text,
    at           timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION public.testkit_wl_observe() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Read committed: the run row as last committed, or as this transaction changed it.
    -- A step whose own event cancelled its run (G14: the step commits, then the
    -- run ends cancelled) stores its result in the very transaction that cancelled it.
    INSERT INTO public.testkit_wl_commits (run_id, step_key, stored_epoch, run_epoch, run_state)
    SELECT NEW.run_id, NEW.step_key, NEW.lease_epoch, r.lease_epoch,
           CASE WHEN r.state = 'cancelled' AND r.cancelled_by_xact = pg_current_xact_id()
                THEN 'cancelled by this step' ELSE r.state END
      FROM (SELECT 1) one LEFT JOIN durastep.runs r ON r.id = NEW.run_id;
    RETURN NULL;
END $$;
-- When (wall clock) the reaper took a run back from a lost worker: the
-- lease had lapsed, so by G22 its slot was free from then on.
CREATE TABLE IF NOT EXISTS testkit_wl_reaps (
    run_id      uuid NOT NULL,
    lease_epoch bigint NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- When (wall clock) an attempt ended by a write that gives back its slots: the
-- run left 'running' for any state but 'cancelled' (a cancelled attempt keeps
-- its slots until its worker clears worker_id, which is no state change).
CREATE TABLE IF NOT EXISTS testkit_wl_ends (
    run_id      uuid NOT NULL,
    lease_epoch bigint NOT NULL,
    state       text NOT NULL,
    at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE OR REPLACE FUNCTION public.testkit_wl_observe_reap() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.error LIKE 'lease expired%' THEN
        INSERT INTO public.testkit_wl_reaps (run_id, lease_epoch) VALUES (NEW.run_id, NEW.lease_epoch);
    END IF;
    IF NEW.state NOT IN ('running', 'cancelled') THEN
        INSERT INTO public.testkit_wl_ends (run_id, lease_epoch, state) VALUES (NEW.run_id, NEW.lease_epoch, NEW.state);
    END IF;
    RETURN NULL;
END $$;
-- The end of a cancelled attempt: its worker clears worker_id only once the
-- handler has been dropped (G22), or the reaper does once its lease lapsed.
-- Either way the body held no slot after this write.
CREATE OR REPLACE FUNCTION public.testkit_wl_observe_stopped() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.testkit_wl_ends (run_id, lease_epoch, state) VALUES (OLD.id, OLD.lease_epoch, 'stopped');
    RETURN NULL;
END $$;
DROP TRIGGER IF EXISTS testkit_wl_observe_stopped ON durastep.runs;
CREATE TRIGGER testkit_wl_observe_stopped AFTER UPDATE OF worker_id ON durastep.runs
    FOR EACH ROW WHEN (OLD.worker_id IS NOT NULL AND NEW.worker_id IS NULL
                       AND OLD.state IN ('cancelled', 'queued') AND NEW.lease_epoch = OLD.lease_epoch)
    EXECUTE FUNCTION public.testkit_wl_observe_stopped();
DROP TRIGGER IF EXISTS testkit_wl_observe_reap ON durastep.run_history;
CREATE TRIGGER testkit_wl_observe_reap AFTER INSERT ON durastep.run_history
    FOR EACH ROW EXECUTE FUNCTION public.testkit_wl_observe_reap();
DROP TRIGGER IF EXISTS testkit_wl_observe ON durastep.step_results;
CREATE TRIGGER testkit_wl_observe AFTER INSERT ON durastep.step_results
    FOR EACH ROW EXECUTE FUNCTION public.testkit_wl_observe();
";

/// Installs the commit observer on `durastep.step_results` (after the engine migrated).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// durastep_testkit::checks::workload::install_observer(&pool).await?;
/// # Ok(()) }
/// ```
pub async fn install_observer(pool: &PgPool) -> Result<()> {
    sqlx::raw_sql(OBSERVER).execute(pool).await?;
    Ok(())
}

/// A workload run as stored, with its input.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct WlRun {
    /// The run.
    pub id: Uuid,
    /// Its function.
    pub function_id: String,
    /// Its state.
    pub state: String,
    /// Its output.
    pub output: Option<Value>,
    /// Its last error.
    pub last_error: Option<String>,
    /// Its attempt.
    pub attempt: i32,
    /// Its lease epoch.
    pub lease_epoch: i64,
    /// Its event's payload (the input).
    pub payload: Value,
    /// The parent, for a child run.
    pub parent_run_id: Option<Uuid>,
    /// The parent's step, for a child run.
    pub parent_step_key: Option<String>,
}

/// Every run of a workload function (`wl-` ids).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let runs = durastep_testkit::checks::workload::runs(&pool).await?;
/// # let _ = runs; Ok(()) }
/// ```
pub async fn runs(pool: &PgPool) -> Result<Vec<WlRun>> {
    Ok(sqlx::query_as(
        "SELECT r.id, r.function_id, r.state, r.output, r.last_error, r.attempt, r.lease_epoch, e.payload,
                r.parent_run_id, r.parent_step_key
           FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id
          WHERE r.function_id LIKE 'wl-%' ORDER BY r.created_at, r.id",
    )
    .fetch_all(pool)
    .await?)
}

/// Runs without their key in `durastep.run_keys` and keys without their run
/// (migration 0042), of every function: (run id, what is wrong). Every run
/// has exactly one key, and it names the run's event and function; a
/// debounced run's key follows it to its newest event.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let wrong = durastep_testkit::checks::workload::key_mismatches(&pool).await?;
/// # let _ = wrong; Ok(()) }
/// ```
pub async fn key_mismatches(pool: &PgPool) -> Result<Vec<(Uuid, String)>> {
    Ok(sqlx::query_as(
        "SELECT r.id, 'run without its key (event ' || r.event_id || ', function ' || r.function_id || ')'
           FROM durastep.runs r
          WHERE NOT EXISTS (SELECT 1 FROM durastep.run_keys k
                             WHERE k.event_id = r.event_id AND k.function_id = r.function_id AND k.run_id = r.id)
         UNION ALL
         SELECT k.run_id, 'key without its run (event ' || k.event_id || ', function ' || k.function_id || ')'
           FROM durastep.run_keys k
          WHERE NOT EXISTS (SELECT 1 FROM durastep.runs r
                             WHERE r.id = k.run_id AND r.event_id = k.event_id AND r.function_id = k.function_id)",
    )
    .fetch_all(pool)
    .await?)
}

/// Stored step results of workload runs: (run, step key, output, lease epoch).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let steps = durastep_testkit::checks::workload::step_results(&pool).await?;
/// # let _ = steps; Ok(()) }
/// ```
pub async fn step_results(pool: &PgPool) -> Result<Vec<(Uuid, String, Value, i64)>> {
    Ok(sqlx::query_as(
        "SELECT s.run_id, s.step_key, s.output, s.lease_epoch FROM durastep.step_results s
           JOIN durastep.runs r ON r.id = s.run_id WHERE r.function_id LIKE 'wl-%'",
    )
    .fetch_all(pool)
    .await?)
}

/// Rows of `testkit_wl_tx`: (run, step key, lease epoch read in the transaction).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let rows = durastep_testkit::checks::workload::tx_rows(&pool).await?;
/// # let _ = rows; Ok(()) }
/// ```
pub async fn tx_rows(pool: &PgPool) -> Result<Vec<(Uuid, String, i64)>> {
    Ok(sqlx::query_as("SELECT run_id, step_key, lease_epoch FROM testkit_wl_tx").fetch_all(pool).await?)
}

/// Observed commits whose stored epoch was not the run's epoch, or whose run
/// was not running, when the step result was inserted: (run, step, stored
/// epoch, run epoch, run state).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let bad = durastep_testkit::checks::workload::commits_without_lease(&pool).await?;
/// assert!(bad.is_empty(), "{bad:?}");
/// # Ok(()) }
/// ```
pub async fn commits_without_lease(pool: &PgPool) -> Result<Vec<(Uuid, String, i64, Option<i64>, Option<String>)>> {
    Ok(sqlx::query_as(
        "SELECT c.run_id, c.step_key, c.stored_epoch, c.run_epoch, c.run_state FROM testkit_wl_commits c
           JOIN durastep.runs r ON r.id = c.run_id
          WHERE r.function_id LIKE 'wl-%'
            -- Written by the attempt itself (not a wait or child outcome written by another transaction).
            AND c.step_key !~ '^(w|c)[0-9]'
            AND (c.run_epoch IS DISTINCT FROM c.stored_epoch
                 OR c.run_state NOT IN ('running', 'cancelled by this step'))",
    )
    .fetch_all(pool)
    .await?)
}

/// Rows observed by the commit observer in all.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let n = durastep_testkit::checks::workload::observed_commits(&pool).await?;
/// # let _ = n; Ok(()) }
/// ```
pub async fn observed_commits(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM testkit_wl_commits").fetch_one(pool).await?)
}

/// One handler-body execution of a workload run, as the ledger has it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub struct Body {
    /// The run.
    pub run_id: Uuid,
    /// Its function.
    pub function_id: String,
    /// Its event's `/key`.
    pub key: Option<String>,
    /// The worker process that ran it.
    pub pid: i32,
    /// The run's lease epoch when the body started.
    pub lease_epoch: Option<i64>,
    /// When it started (server clock).
    pub started_at: DateTime<Utc>,
    /// When it ended (the worker's clock), if that was recorded.
    pub ended_at: Option<DateTime<Utc>>,
}

/// Handler-body executions of workload runs (ledger rows with step key
/// [`crate::workload::BODY_KEY`]).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let bodies = durastep_testkit::checks::workload::bodies(&pool).await?;
/// # let _ = bodies; Ok(()) }
/// ```
pub async fn bodies(pool: &PgPool) -> Result<Vec<Body>> {
    Ok(sqlx::query_as(
        "SELECT l.run_id, r.function_id, e.payload ->> 'key' AS key, l.pid, l.lease_epoch, l.started_at, l.ended_at
           FROM testkit_ledger l JOIN durastep.runs r ON r.id = l.run_id JOIN durastep.events e ON e.id = r.event_id
          WHERE l.step_key = $1 AND r.function_id LIKE 'wl-%' ORDER BY l.started_at",
    )
    .bind(crate::workload::BODY_KEY)
    .fetch_all(pool)
    .await?)
}

/// First claim of every workload run, by the database clock (from
/// `durastep.run_timeline`): (run, function, `/key`, claimed at).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let claims = durastep_testkit::checks::workload::first_claims(&pool).await?;
/// # let _ = claims; Ok(()) }
/// ```
pub async fn first_claims(pool: &PgPool) -> Result<Vec<(Uuid, String, Option<String>, DateTime<Utc>)>> {
    Ok(sqlx::query_as(
        "SELECT r.id, r.function_id, e.payload ->> 'key', min(h.at)
           FROM durastep.run_timeline h JOIN durastep.runs r ON r.id = h.run_id
           JOIN durastep.events e ON e.id = r.event_id
          WHERE h.state = 'running' AND r.function_id LIKE 'wl-%'
          GROUP BY r.id, r.function_id, e.payload ->> 'key' ORDER BY 4",
    )
    .fetch_all(pool)
    .await?)
}

/// The last entry of every workload run's timeline that has one, with the
/// most recent lease epoch in it: (run, last state, max epoch).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let last = durastep_testkit::checks::workload::last_history(&pool).await?;
/// # let _ = last; Ok(()) }
/// ```
pub async fn last_history(pool: &PgPool) -> Result<Vec<(Uuid, String, i64)>> {
    Ok(sqlx::query_as(
        "SELECT DISTINCT ON (h.run_id) h.run_id, h.state,
                (SELECT max(x.lease_epoch) FROM durastep.run_timeline x WHERE x.run_id = h.run_id)
           FROM durastep.run_timeline h JOIN durastep.runs r ON r.id = h.run_id
          WHERE r.function_id LIKE 'wl-%'
          ORDER BY h.run_id, h.seq DESC, h.part DESC",
    )
    .fetch_all(pool)
    .await?)
}

/// Whether a run had an attempt started before `t` (database clock).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let started = durastep_testkit::checks::workload::started_before(&pool, id, chrono::Utc::now()).await?;
/// # let _ = started; Ok(()) }
/// ```
pub async fn started_before(pool: &PgPool, run_id: Uuid, t: DateTime<Utc>) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM durastep.run_timeline WHERE run_id = $1 AND state = 'running' AND at < $2)",
    )
    .bind(run_id)
    .bind(t)
    .fetch_one(pool)
    .await?)
}

/// Open waits for the workload's signal event: (run, step key, token, expires
/// at, still valid for at least a second by the database clock).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let waits = durastep_testkit::checks::workload::open_waits(&pool, None).await?;
/// # let _ = waits; Ok(()) }
/// ```
pub async fn open_waits(pool: &PgPool, token: Option<&str>) -> Result<Vec<(Uuid, String, String, bool)>> {
    Ok(sqlx::query_as(
        "SELECT w.run_id, w.step_key, w.match_value #>> '{}', w.expires_at > durastep.now() + interval '1 second'
           FROM durastep.waits w JOIN durastep.runs r ON r.id = w.run_id
          WHERE w.event_name = $1 AND r.state = 'waiting' AND ($2::text IS NULL OR w.match_value #>> '{}' = $2)",
    )
    .bind(crate::workload::SIGNAL_EVENT)
    .bind(token)
    .fetch_all(pool)
    .await?)
}

/// `durastep.run_blockers` rows of workload runs: (run, state, blocker, rule, key, in use, detail).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let b = durastep_testkit::checks::workload::blockers(&pool).await?;
/// # let _ = b; Ok(()) }
/// ```
#[allow(clippy::type_complexity)]
pub async fn blockers(
    pool: &PgPool,
) -> Result<Vec<(Uuid, String, String, Option<String>, Option<String>, Option<i64>, Option<String>)>> {
    Ok(sqlx::query_as(
        "SELECT run_id, state, blocker, rule, key, in_use::bigint, detail FROM durastep.run_blockers
          WHERE function_id LIKE 'wl-%'",
    )
    .fetch_all(pool)
    .await?)
}

/// Runs of a concurrency-limited workload function that are running now, per `/key`.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let n = durastep_testkit::checks::workload::running_per_key(&pool).await?;
/// # let _ = n; Ok(()) }
/// ```
pub async fn running_per_key(pool: &PgPool) -> Result<Vec<(String, Option<String>, i64)>> {
    Ok(sqlx::query_as(
        "SELECT r.function_id, e.payload ->> 'key', count(*) FROM durastep.runs r
           JOIN durastep.events e ON e.id = r.event_id
          WHERE r.function_id LIKE 'wl-%' AND r.state = 'running' GROUP BY 1, 2",
    )
    .fetch_all(pool)
    .await?)
}

/// When (wall clock) each attempt ended by a write that gave back its slots
/// (the run left `running` for any state but `cancelled`, or a cancelled
/// attempt's worker or the reaper cleared its `worker_id`): (run, epoch, at).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let ends = durastep_testkit::checks::workload::attempt_ends(&pool).await?;
/// # let _ = ends; Ok(()) }
/// ```
pub async fn attempt_ends(pool: &PgPool) -> Result<Vec<(Uuid, i64, DateTime<Utc>)>> {
    Ok(sqlx::query_as("SELECT run_id, lease_epoch, at FROM testkit_wl_ends ORDER BY at").fetch_all(pool).await?)
}

/// When (wall clock) each run was reaped after its lease lapsed, and the
/// lease epoch it was reaped at: (run, epoch, at).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let reaps = durastep_testkit::checks::workload::reaps(&pool).await?;
/// # let _ = reaps; Ok(()) }
/// ```
pub async fn reaps(pool: &PgPool) -> Result<Vec<(Uuid, i64, DateTime<Utc>)>> {
    Ok(sqlx::query_as("SELECT run_id, lease_epoch, at FROM testkit_wl_reaps ORDER BY at").fetch_all(pool).await?)
}

/// How many runs their own send claimed and handed to a worker of the
/// sender's process (the run's first attempt started in the transaction
/// that stored its event: the start's time is the run's creation time, where
/// a claim's transaction starts after the send's has committed).
pub async fn runs_handed_by_their_send(pool: &PgPool) -> Result<i64> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM durastep.runs r
          WHERE (SELECT h.at FROM durastep.run_timeline h
                  WHERE h.run_id = r.id AND h.state = 'running' ORDER BY h.seq, h.part LIMIT 1) = r.created_at",
    )
    .fetch_one(pool)
    .await?)
}
