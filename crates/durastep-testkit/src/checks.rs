//! Checks over the engine's own tables (`durastep.runs`, `durastep.step_results`)
//! and against the test functions' oracles.
//!
//! Architecture invariant: every SQL statement the harness runs on the engine's
//! tables is in this module, and none of them writes.

pub mod workload;

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::functions::{self, FiveSteps, Mixed, SlowStep};

/// A run row as stored (the columns a durability test compares).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let run = durastep_testkit::checks::run(&pool, id).await?;
/// assert_eq!(run.state, "completed");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct RunSnapshot {
    /// The run.
    pub id: Uuid,
    /// Its function.
    pub function_id: String,
    /// `queued`, `running`, `sleeping`, `waiting`, `completed`, `failed`, `cancelled` or `skipped`.
    pub state: String,
    /// Current (or last) attempt.
    pub attempt: i32,
    /// The fencing counter, bumped on every claim.
    pub lease_epoch: i64,
    /// The output, once completed.
    pub output: Option<Value>,
    /// The last failure.
    pub last_error: Option<String>,
    /// When it finished.
    pub finished_at: Option<DateTime<Utc>>,
    /// The worker holding it (while running).
    pub worker_id: Option<Uuid>,
}

/// One run, as stored now.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let before = durastep_testkit::checks::run(&pool, id).await?;
/// // ... a stale worker resumes ...
/// assert_eq!(durastep_testkit::checks::run(&pool, id).await?, before);
/// # Ok(()) }
/// ```
pub async fn run(pool: &PgPool, id: Uuid) -> Result<RunSnapshot> {
    sqlx::query_as(
        "SELECT id, function_id, state, attempt, lease_epoch, output, last_error, finished_at, worker_id
           FROM durastep.runs WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?
    .ok_or_else(|| Error::Unexpected(format!("no run {id}")))
}

/// A stored step result.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// for s in durastep_testkit::checks::step_results(&pool, id).await? {
///     println!("{} = {} (epoch {})", s.step_key, s.output, s.lease_epoch);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct StoredStep {
    /// The step key.
    pub step_key: String,
    /// Its stored output.
    pub output: Value,
    /// The lease epoch of the attempt that stored it.
    pub lease_epoch: i64,
    /// When it was stored.
    pub created_at: DateTime<Utc>,
}

/// The stored step results of a run, in the order they were stored.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let steps = durastep_testkit::checks::step_results(&pool, id).await?;
/// assert_eq!(steps.len(), 5);
/// # Ok(()) }
/// ```
pub async fn step_results(pool: &PgPool, run_id: Uuid) -> Result<Vec<StoredStep>> {
    Ok(sqlx::query_as(
        "SELECT step_key, output, lease_epoch, created_at FROM durastep.step_results
          WHERE run_id = $1 ORDER BY created_at, step_key",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await?)
}

/// Runs per state, over the whole database.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let states = durastep_testkit::checks::run_states(&pool).await?;
/// assert_eq!(states.get("completed"), Some(&2_000));
/// # Ok(()) }
/// ```
pub async fn run_states(pool: &PgPool) -> Result<BTreeMap<String, i64>> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM durastep.runs GROUP BY state").fetch_all(pool).await?;
    Ok(rows.into_iter().collect())
}

/// Runs per attempt number (1: never retried nor reaped), over the whole database.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let attempts = durastep_testkit::checks::runs_per_attempt(&pool).await?;
/// assert_eq!(attempts.keys().copied().collect::<Vec<_>>(), [1], "some run needed a second attempt");
/// # Ok(()) }
/// ```
pub async fn runs_per_attempt(pool: &PgPool) -> Result<BTreeMap<i32, i64>> {
    let rows: Vec<(i32, i64)> =
        sqlx::query_as("SELECT attempt, count(*) FROM durastep.runs GROUP BY attempt").fetch_all(pool).await?;
    Ok(rows.into_iter().collect())
}

/// Runs that needed more than one attempt, with their last error.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// for (id, attempt, error) in durastep_testkit::checks::retried_runs(&pool).await? {
///     println!("{id}: attempt {attempt}: {error:?}");
/// }
/// # Ok(()) }
/// ```
pub async fn retried_runs(pool: &PgPool) -> Result<Vec<(Uuid, i32, Option<String>)>> {
    Ok(sqlx::query_as("SELECT id, attempt, last_error FROM durastep.runs WHERE attempt > 1 ORDER BY id")
        .fetch_all(pool)
        .await?)
}

/// How many of the given runs are not yet completed, failed, cancelled or
/// skipped (a run id that does not exist counts as unfinished).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, runs: Vec<uuid::Uuid>) -> durastep_testkit::Result<()> {
/// let left = durastep_testkit::checks::unfinished_among(&pool, &runs).await?;
/// # let _ = left; Ok(()) }
/// ```
pub async fn unfinished_among(pool: &PgPool, runs: &[Uuid]) -> Result<i64> {
    let finished: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM durastep.runs
          WHERE id = ANY ($1) AND state IN ('completed', 'failed', 'cancelled', 'skipped')",
    )
    .bind(runs)
    .fetch_one(pool)
    .await?;
    Ok(i64::try_from(runs.len()).unwrap_or(i64::MAX) - finished)
}

/// Totals over `durastep.step_results`.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let t = durastep_testkit::checks::step_result_totals(&pool).await?;
/// assert_eq!(t.rows, t.distinct_steps, "a step result was stored twice");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepResultTotals {
    /// Rows in `step_results`.
    pub rows: i64,
    /// Distinct (run, step key) pairs among them.
    pub distinct_steps: i64,
}

/// Counts `step_results` rows and distinct (run, step) pairs (equal unless a
/// result was stored twice; the primary key should make that impossible).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// println!("{:?}", durastep_testkit::checks::step_result_totals(&pool).await?);
/// # Ok(()) }
/// ```
pub async fn step_result_totals(pool: &PgPool) -> Result<StepResultTotals> {
    let (rows, distinct_steps): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT (run_id, step_key)) FROM durastep.step_results")
            .fetch_one(pool)
            .await?;
    Ok(StepResultTotals { rows, distinct_steps })
}

/// Every run of a function with its input, state, output and stored steps.
async fn runs_with_steps(pool: &PgPool, function_id: &str) -> Result<Vec<(Uuid, String, Option<Value>, Value, Value)>> {
    Ok(sqlx::query_as(
        "SELECT r.id, r.state, r.output, e.payload,
                coalesce(jsonb_object_agg(s.step_key, s.output) FILTER (WHERE s.step_key IS NOT NULL), '{}'::jsonb)
           FROM durastep.runs r
           JOIN durastep.events e ON e.id = r.event_id
           LEFT JOIN durastep.step_results s ON s.run_id = r.id
          WHERE r.function_id = $1
          GROUP BY r.id, e.payload
          ORDER BY r.id",
    )
    .bind(function_id)
    .fetch_all(pool)
    .await?)
}

/// Checks every five-steps run against the oracle: completed, output equal to
/// [`functions::five_steps_oracle`], and exactly the five step results, each
/// equal to [`functions::five_steps_step_output`]. Returns one line per problem
/// (empty: all good).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let problems = durastep_testkit::checks::five_steps_mismatches(&pool).await?;
/// assert!(problems.is_empty(), "{} problems, first: {:?}", problems.len(), problems.first());
/// # Ok(()) }
/// ```
pub async fn five_steps_mismatches(pool: &PgPool) -> Result<Vec<String>> {
    oracle_mismatches(
        pool,
        functions::FIVE_STEPS,
        |i: &FiveSteps| functions::five_steps_oracle(i.n),
        |id, input, steps, problems| {
            if steps.len() != 5 {
                problems.push(format!(
                    "run {id}: {} stored steps: {:?}",
                    steps.len(),
                    steps.keys().collect::<Vec<_>>()
                ));
            }
            for i in 1..=5 {
                let key = functions::five_steps_key(i);
                let want = Value::from(functions::five_steps_step_output(input.n, i));
                if steps.get(&key) != Some(&want) {
                    problems.push(format!("run {id}: step {key} stored {:?}, oracle {want}", steps.get(&key)));
                }
            }
        },
    )
    .await
}

/// Like [`five_steps_mismatches`], for the slow-step runs.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// assert!(durastep_testkit::checks::slow_step_mismatches(&pool).await?.is_empty());
/// # Ok(()) }
/// ```
pub async fn slow_step_mismatches(pool: &PgPool) -> Result<Vec<String>> {
    oracle_mismatches(
        pool,
        functions::SLOW_STEP,
        |i: &SlowStep| functions::slow_step_oracle(i.n),
        |id, _, steps, problems| {
            if steps.len() != functions::SLOW_STEP_KEYS.len() {
                problems.push(format!("run {id}: stored steps {:?}", steps.keys().collect::<Vec<_>>()));
            }
        },
    )
    .await
}

/// The checks every `*_mismatches` shares: each run of `function` has an input
/// that parses, is completed, and has output `oracle(input)`; then
/// `check_steps` looks at its stored step results. One line per problem.
async fn oracle_mismatches<I: serde::de::DeserializeOwned>(
    pool: &PgPool,
    function: &str,
    oracle: impl Fn(&I) -> u64,
    check_steps: impl Fn(Uuid, &I, &serde_json::Map<String, Value>, &mut Vec<String>),
) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    for (id, state, output, payload, steps) in runs_with_steps(pool, function).await? {
        let input: I = match serde_json::from_value(payload) {
            Ok(i) => i,
            Err(e) => {
                problems.push(format!("run {id}: input does not parse: {e}"));
                continue;
            }
        };
        if state != "completed" {
            problems.push(format!("run {id}: state {state}"));
        }
        let want = Value::from(oracle(&input));
        if output.as_ref() != Some(&want) {
            problems.push(format!("run {id}: output {output:?}, oracle {want}"));
        }
        check_steps(id, &input, &steps.as_object().cloned().unwrap_or_default(), &mut problems);
    }
    Ok(problems)
}

/// Waits until a run is in `state`; fails at once if it finishes in another state.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let run = durastep_testkit::checks::wait_state(&pool, id, "completed", std::time::Duration::from_secs(20)).await?;
/// # let _ = run; Ok(()) }
/// ```
pub async fn wait_state(pool: &PgPool, id: Uuid, state: &str, timeout: Duration) -> Result<RunSnapshot> {
    let what = format!("run {id} to be {state}");
    crate::wait_for(&what, timeout, || async move {
        let run = run(pool, id).await?;
        if run.state == state {
            return Ok(Some(run));
        }
        if ["completed", "failed", "cancelled"].contains(&run.state.as_str()) {
            return Err(Error::Unexpected(format!("run {id} ended {} while waiting for {state}: {run:?}", run.state)));
        }
        Ok(None)
    })
    .await
}

/// The most attempts of `functions` that executed at once, per key (the event
/// data's `key_field`, or `""` when it is `None`): a sweep over the ledger rows
/// with step key [`crate::functions::FLOW_ATTEMPT_KEY`], each an attempt's
/// [start, end); an end sorts before a start at the same instant. An attempt
/// without an end (its worker died) counts as running to the end of time.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let per_key = durastep_testkit::checks::max_overlap_per_key(&pool, &["flow-per-key"], Some("account")).await?;
/// assert!(per_key.iter().all(|(_, n)| *n <= 3), "{per_key:?}");
/// # Ok(()) }
/// ```
pub async fn max_overlap_per_key(
    pool: &PgPool,
    functions: &[&str],
    key_field: Option<&str>,
) -> Result<Vec<(String, i64)>> {
    let functions: Vec<String> = functions.iter().map(|f| (*f).to_owned()).collect();
    Ok(sqlx::query_as(
        "WITH a AS (
             SELECT CASE WHEN $2::text IS NULL THEN '' ELSE e.payload ->> $2 END AS key, l.started_at,
                    coalesce(l.ended_at, 'infinity') AS ended_at
               FROM testkit_ledger l JOIN durastep.runs r ON r.id = l.run_id JOIN durastep.events e ON e.id = r.event_id
              WHERE l.step_key = $3 AND r.function_id = ANY ($1)),
         ev AS (SELECT key, started_at AS t, 1 AS d FROM a UNION ALL SELECT key, ended_at, -1 FROM a)
         SELECT key, max(c)::bigint FROM (
             SELECT key, sum(d) OVER (PARTITION BY key ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS c FROM ev) x
          GROUP BY key ORDER BY key",
    )
    .bind(&functions)
    .bind(key_field)
    .bind(crate::functions::FLOW_ATTEMPT_KEY)
    .fetch_all(pool)
    .await?)
}

/// The most attempts of `functions` that started in any window of `period`,
/// per key (the event data's `key_field`): for each ledger row with step key
/// [`crate::functions::FLOW_ATTEMPT_KEY`], the rows of its key whose start is in
/// `[start, start + period)`, by Durastep's database clock (the ledger's
/// `db_started`, `durastep.now()` when the body began, test offset included).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let period = std::time::Duration::from_secs(600);
/// let per_key = durastep_testkit::checks::max_starts_in_window(&pool, &["flow-throttle"], "account", period).await?;
/// assert!(per_key.iter().all(|(_, n)| *n <= 60), "{per_key:?}");
/// # Ok(()) }
/// ```
pub async fn max_starts_in_window(
    pool: &PgPool,
    functions: &[&str],
    key_field: &str,
    period: Duration,
) -> Result<Vec<(String, i64)>> {
    let functions: Vec<String> = functions.iter().map(|f| (*f).to_owned()).collect();
    // RANGE from the current row (and its peers) to period - 1 us after it: the
    // half-open window [t, t + period) at timestamptz's microsecond resolution.
    Ok(sqlx::query_as(
        "SELECT key, max(n)::bigint FROM (
             SELECT e.payload ->> $2 AS key,
                    count(*) OVER (PARTITION BY e.payload ->> $2 ORDER BY l.db_started
                                   RANGE BETWEEN CURRENT ROW
                                         AND make_interval(secs => $4) - interval '1 microsecond' FOLLOWING) AS n
               FROM testkit_ledger l JOIN durastep.runs r ON r.id = l.run_id JOIN durastep.events e ON e.id = r.event_id
              WHERE l.step_key = $3 AND r.function_id = ANY ($1)) x
          GROUP BY key ORDER BY key",
    )
    .bind(&functions)
    .bind(key_field)
    .bind(crate::functions::FLOW_ATTEMPT_KEY)
    .bind(period.as_secs_f64())
    .fetch_all(pool)
    .await?)
}

/// How many runs of `functions` are running, or queued, sleeping or waiting and
/// due within `margin` of the database clock: 0 means everything the clock
/// allows has been started and finished, and nothing becomes due for `margin`
/// (a test may then move the clock without racing a claim).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let margin = std::time::Duration::from_millis(200);
/// let busy = durastep_testkit::checks::busy_runs(&pool, &["flow-throttle"], margin).await?;
/// # let _ = busy; Ok(()) }
/// ```
pub async fn busy_runs(pool: &PgPool, functions: &[&str], margin: Duration) -> Result<i64> {
    let functions: Vec<String> = functions.iter().map(|f| (*f).to_owned()).collect();
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM durastep.runs
          WHERE function_id = ANY ($1)
            AND (state = 'running'
                 OR (state IN ('queued', 'sleeping', 'waiting') AND run_at <= durastep.now() + make_interval(secs => $2)))",
    )
    .bind(&functions)
    .bind(margin.as_secs_f64())
    .fetch_one(pool)
    .await?)
}

/// Run states of `functions`, with their counts.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let states = durastep_testkit::checks::run_states_of(&pool, &["flow-rate"]).await?;
/// println!("{states:?}");
/// # Ok(()) }
/// ```
pub async fn run_states_of(pool: &PgPool, functions: &[&str]) -> Result<BTreeMap<String, i64>> {
    let functions: Vec<String> = functions.iter().map(|f| (*f).to_owned()).collect();
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM durastep.runs WHERE function_id = ANY ($1) GROUP BY state")
            .bind(&functions)
            .fetch_all(pool)
            .await?;
    Ok(rows.into_iter().collect())
}

/// A step body execution (ledger row) that started after its step's checkpoint
/// was stored: what G2 forbids.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let late = durastep_testkit::checks::executions_after_checkpoint(&pool).await?;
/// assert!(late.is_empty(), "stored steps ran again: {late:?}");
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct LateExecution {
    /// The run.
    pub run_id: Uuid,
    /// The step.
    pub step_key: String,
    /// The ledger row of the late execution.
    pub ledger_id: i64,
    /// The process that ran it.
    pub pid: i32,
    /// The run's lease epoch when the body started.
    pub lease_epoch: Option<i64>,
    /// When the body started.
    pub started_at: DateTime<Utc>,
    /// When the checkpoint row was written (its `created_at`).
    pub stored_at: DateTime<Utc>,
    /// The epoch that stored the checkpoint.
    pub stored_epoch: i64,
}

/// Every step body execution that started after the checkpoint of its
/// (run, step) was stored.
///
/// The definition, precisely: a ledger row `l` and the `step_results` row `s`
/// of the same (run, step) with `l.started_at > s.created_at`. Both times are
/// `clock_timestamp()` of the same server (the ledger insert is the body's
/// first action; `created_at` is taken inside the checkpoint's statement, just
/// before its commit), so no clock skew enters. An execution that started
/// before the checkpoint was written, and was cut short or had its result
/// refused, is not counted: that is the body-to-checkpoint window G1 allows.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// assert_eq!(durastep_testkit::checks::executions_after_checkpoint(&pool).await?.len(), 0);
/// # Ok(()) }
/// ```
pub async fn executions_after_checkpoint(pool: &PgPool) -> Result<Vec<LateExecution>> {
    Ok(sqlx::query_as(
        "SELECT l.run_id, l.step_key, l.id AS ledger_id, l.pid, l.lease_epoch, l.started_at,
                s.created_at AS stored_at, s.lease_epoch AS stored_epoch
           FROM testkit_ledger l
           JOIN durastep.step_results s ON s.run_id = l.run_id AND s.step_key = l.step_key
          WHERE l.started_at > s.created_at
          ORDER BY l.id",
    )
    .fetch_all(pool)
    .await?)
}

/// Step body executions whose result was never stored by their own attempt,
/// per process: `(pid, executions)`.
///
/// An execution is "unstored" when no `step_results` row of its (run, step)
/// carries the lease epoch the ledger recorded when the body started (the
/// attempt's epoch, for a worker that still held the run). These are the steps
/// that were in flight when their process died or lost the run: the only
/// executions G1 allows to be repeated.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// for (pid, n) in durastep_testkit::checks::unstored_executions_per_pid(&pool).await? {
///     println!("pid {pid}: {n} executions lost before their checkpoint");
/// }
/// # Ok(()) }
/// ```
pub async fn unstored_executions_per_pid(pool: &PgPool) -> Result<Vec<(i32, i64)>> {
    Ok(sqlx::query_as(
        "SELECT l.pid, count(*) FROM testkit_ledger l
          WHERE NOT EXISTS (SELECT 1 FROM durastep.step_results s
                             WHERE s.run_id = l.run_id AND s.step_key = l.step_key
                               AND s.lease_epoch IS NOT DISTINCT FROM l.lease_epoch)
          GROUP BY l.pid ORDER BY l.pid",
    )
    .fetch_all(pool)
    .await?)
}

/// A step body execution whose result its own attempt never stored, with
/// when and how that attempt lost the run: see [`unstored_executions`].
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// for x in durastep_testkit::checks::unstored_executions(&pool).await? {
///     println!("pid {} lost {}/{} at {:?} ({:?})", x.pid, x.run_id, x.step_key, x.attempt_ended_at, x.attempt_ended_as);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct UnstoredExecution {
    /// The process that ran the body.
    pub pid: i32,
    /// The run.
    pub run_id: Uuid,
    /// The step.
    pub step_key: String,
    /// The run's lease epoch when the body started (the attempt's epoch).
    pub lease_epoch: Option<i64>,
    /// When the body started.
    pub started_at: DateTime<Utc>,
    /// When the body returned (`None`: it never did, its process died first).
    pub ended_at: Option<DateTime<Utc>>,
    /// When the attempt lost the run: the first history row of the run that
    /// leaves `running` at this epoch, or that carries a later epoch (`None`:
    /// the run's history shows no such row).
    pub attempt_ended_at: Option<DateTime<Utc>>,
    /// The state that history row records (`queued` for a reaped lease).
    pub attempt_ended_as: Option<String>,
}

/// Every step body execution whose result was never stored by its own
/// attempt (as [`unstored_executions_per_pid`] counts them), each with the
/// moment its attempt lost the run, from the run's history.
///
/// A test that kills processes tells by that moment why a body's result was
/// lost: the attempt ended after its process was killed (the kill cut it
/// short), or before (the process lost the lease while it lived).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// let lost = durastep_testkit::checks::unstored_executions(&pool).await?;
/// assert!(lost.iter().all(|x| x.attempt_ended_at.is_some()));
/// # Ok(()) }
/// ```
pub async fn unstored_executions(pool: &PgPool) -> Result<Vec<UnstoredExecution>> {
    Ok(sqlx::query_as(
        "SELECT l.pid, l.run_id, l.step_key, l.lease_epoch, l.started_at, l.ended_at,
                e.at AS attempt_ended_at, e.state AS attempt_ended_as
           FROM testkit_ledger l
           LEFT JOIN LATERAL (
                SELECT h.at, h.state FROM durastep.run_timeline h
                 WHERE h.run_id = l.run_id
                   AND (h.lease_epoch > l.lease_epoch
                        OR (h.lease_epoch = l.lease_epoch AND h.state <> 'running'))
                 ORDER BY h.seq, h.part LIMIT 1) e ON true
          WHERE NOT EXISTS (SELECT 1 FROM durastep.step_results s
                             WHERE s.run_id = l.run_id AND s.step_key = l.step_key
                               AND s.lease_epoch IS NOT DISTINCT FROM l.lease_epoch)
          ORDER BY l.pid, l.id",
    )
    .fetch_all(pool)
    .await?)
}

/// A run's timeline (`durastep.run_timeline`) as text, one entry per line (`at state attempt epoch
/// worker`): for a failing test's message.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// eprintln!("{}", durastep_testkit::checks::history_text(&pool, id).await?);
/// # Ok(()) }
/// ```
pub async fn history_text(pool: &PgPool, run_id: Uuid) -> Result<String> {
    let text: Option<String> = sqlx::query_scalar(
        "SELECT string_agg(format('  %s %s attempt=%s epoch=%s %s', to_char(at, 'HH24:MI:SS.MS'), state,
                                  attempt, lease_epoch, coalesce(worker_id::text, '')), E'\\n' ORDER BY seq, part)
           FROM durastep.run_timeline WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(pool)
    .await?;
    Ok(text.unwrap_or_default())
}

/// The given runs as stored now, by id (runs that do not exist are left out).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, ids: Vec<uuid::Uuid>) -> durastep_testkit::Result<()> {
/// let before = durastep_testkit::checks::runs(&pool, &ids).await?;
/// // ... a racing reaper ...
/// assert_eq!(durastep_testkit::checks::runs(&pool, &ids).await?, before);
/// # Ok(()) }
/// ```
pub async fn runs(pool: &PgPool, ids: &[Uuid]) -> Result<Vec<RunSnapshot>> {
    Ok(sqlx::query_as(
        "SELECT id, function_id, state, attempt, lease_epoch, output, last_error, finished_at, worker_id
           FROM durastep.runs WHERE id = ANY ($1) ORDER BY id",
    )
    .bind(ids)
    .fetch_all(pool)
    .await?)
}

/// How many of the given runs are in `state` now.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, ids: Vec<uuid::Uuid>) -> durastep_testkit::Result<()> {
/// let running = durastep_testkit::checks::count_in_state(&pool, &ids, "running").await?;
/// # let _ = running; Ok(()) }
/// ```
pub async fn count_in_state(pool: &PgPool, ids: &[Uuid], state: &str) -> Result<i64> {
    Ok(sqlx::query_scalar("SELECT count(*) FROM durastep.runs WHERE id = ANY ($1) AND state = $2")
        .bind(ids)
        .bind(state)
        .fetch_one(pool)
        .await?)
}

/// Like [`five_steps_mismatches`], for the mixed runs: completed, output equal
/// to [`functions::mixed_oracle`], the four step keys stored.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// assert!(durastep_testkit::checks::mixed_mismatches(&pool).await?.is_empty());
/// # Ok(()) }
/// ```
pub async fn mixed_mismatches(pool: &PgPool) -> Result<Vec<String>> {
    oracle_mismatches(
        pool,
        functions::MIXED,
        |i: &Mixed| functions::mixed_oracle(i.n),
        |id, _, steps, problems| {
            let mut keys: Vec<&String> = steps.keys().collect();
            keys.sort();
            let mut want_keys: Vec<&str> = functions::MIXED_KEYS.to_vec();
            want_keys.sort_unstable();
            if keys != want_keys {
                problems.push(format!("run {id}: stored steps {keys:?}"));
            }
        },
    )
    .await
}

/// Whether the run is sleeping and not yet due by the database clock (a test
/// may then move the clock to wake it; once due, it is not asleep any more).
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// if durastep_testkit::checks::asleep(&pool, id).await? {
///     // durastep_testkit::Cluster::advance_clock ...
/// }
/// # Ok(()) }
/// ```
pub async fn asleep(pool: &PgPool, id: Uuid) -> Result<bool> {
    Ok(state_and_asleep(pool, id).await?.1)
}

/// The run's state, and whether it is [`asleep`], in one query.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool, id: uuid::Uuid) -> durastep_testkit::Result<()> {
/// let (state, asleep) = durastep_testkit::checks::state_and_asleep(&pool, id).await?;
/// # let _ = (state, asleep); Ok(()) }
/// ```
pub async fn state_and_asleep(pool: &PgPool, id: Uuid) -> Result<(String, bool)> {
    sqlx::query_as("SELECT state, state = 'sleeping' AND run_at > durastep.now() FROM durastep.runs WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await?
        .ok_or_else(|| Error::Unexpected(format!("no run {id}")))
}
