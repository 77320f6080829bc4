//! Inspection reads: the SQL of the inspection API (`crate::inspect`), of
//! `check_deploy`'s dry replay, and of loading one run. Nothing here writes:
//! the operator's actions live in `admin`.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgPool, Postgres, QueryBuilder, Row};
use uuid::Uuid;

use std::time::Duration;

use super::{records_of, secs};
use crate::RunState;
use crate::journal::JournalEntry;

/// The filter of a run listing, as SQL needs it.
#[derive(Default)]
pub(crate) struct RunQuery<'a> {
    pub function: Option<&'a str>,
    pub states: &'a [&'a str],
    pub created_after: Option<DateTime<Utc>>,
    pub created_before: Option<DateTime<Utc>>,
    pub event_name: Option<&'a str>,
    pub idempotency_key: Option<&'a str>,
    /// A JSON path in the event data and the value it must hold.
    pub data: Option<(&'a [String], &'a Value)>,
    /// Keyset pagination: rows strictly older than this (created_at, id).
    pub before: Option<(DateTime<Utc>, Uuid)>,
    pub limit: i64,
}

impl RunQuery<'_> {
    /// The runs and their events, as a listing's `FROM`. With a filter on the
    /// event, through the runs' keys (migration 0042), so that Postgres may
    /// find a rare event first and its runs by their keys, as it found them
    /// through `UNIQUE (event_id, function_id)` before: no index of `runs`
    /// names `event_id` any more, and without the keys a listing of one
    /// idempotency key read every run.
    fn runs_and_events(&self) -> &'static str {
        if self.event_name.is_some() || self.idempotency_key.is_some() || self.data.is_some() {
            " FROM durastep.runs r
               JOIN durastep.run_keys k ON k.event_id = r.event_id AND k.function_id = r.function_id AND k.run_id = r.id
               JOIN durastep.events e ON e.id = k.event_id"
        } else {
            " FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id"
        }
    }
}

/// One run of a listing.
#[derive(sqlx::FromRow)]
pub(crate) struct RunListRow {
    pub id: Uuid,
    pub function_id: String,
    pub event_id: Uuid,
    pub event_name: String,
    pub idempotency_key: Option<String>,
    pub state: RunState,
    pub attempt: i32,
    pub max_attempts: i32,
    pub lease_losses: i32,
    pub run_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

/// The bound of [`time_ordered`] as a value.
const FIRST_ID_OF_2100: Uuid = uuid::uuid!("03bb2cc3-d800-0000-0000-000000000000");

/// Which runs a listing reads: those with a time-ordered id (every run
/// created since migration 0021), which the primary key orders by creation,
/// or the others, which the partial index `runs_created_legacy` orders by
/// `created_at` (migration 0031). A listing reads all of the first kind
/// before any of the second, which are older.
#[derive(Clone, Copy, PartialEq)]
enum Ids {
    TimeOrdered,
    Legacy,
}

impl Ids {
    /// The kind of `id`: [`time_ordered`]'s condition, in Rust.
    fn of(id: Uuid) -> Ids {
        if id.get_version_num() == 7 && id < FIRST_ID_OF_2100 { Ids::TimeOrdered } else { Ids::Legacy }
    }

    /// The runs of this kind (a `WHERE` clause).
    fn condition(self) -> &'static str {
        match self {
            Ids::TimeOrdered => concat!(" WHERE ", time_ordered!()),
            Ids::Legacy => concat!(" WHERE ", legacy!()),
        }
    }
}

/// Which way a listing walks the runs: newest first (the pages of the
/// listings) or oldest first (bulk actions); every time-ordered id is newer
/// than the others ([`Ids`]).
#[derive(Clone, Copy)]
enum Walk {
    NewestFirst,
    OldestFirst,
}

impl Walk {
    /// The kinds of ids left to walk after `key`, the (created_at, id) of the
    /// last run of the page before: from the key's kind on, in this walk's
    /// order; both without a key.
    fn kinds_from(self, key: Option<(DateTime<Utc>, Uuid)>) -> impl Iterator<Item = Ids> {
        let kinds = match self {
            Walk::NewestFirst => [Ids::TimeOrdered, Ids::Legacy],
            Walk::OldestFirst => [Ids::Legacy, Ids::TimeOrdered],
        };
        let passed = key.map_or(0, |(_, id)| usize::from(kinds[0] != Ids::of(id)));
        kinds.into_iter().skip(passed)
    }

    /// Only the runs of kind `ids` past `key`, when the key is of that kind
    /// (a kind after the key's is walked whole).
    fn push_past(self, b: &mut QueryBuilder<Postgres>, key: Option<(DateTime<Utc>, Uuid)>, ids: Ids) {
        let Some((t, id)) = key.filter(|(_, id)| Ids::of(*id) == ids) else { return };
        let past = match self {
            Walk::NewestFirst => " < ",
            Walk::OldestFirst => " > ",
        };
        match ids {
            Ids::TimeOrdered => b.push(" AND r.id").push(past).push_bind(id),
            Ids::Legacy => {
                b.push(" AND (r.created_at, r.id)").push(past).push("(").push_bind(t).push(", ").push_bind(id).push(")")
            }
        };
    }

    /// The `ORDER BY` of kind `ids` in this walk.
    fn order(self, ids: Ids) -> &'static str {
        match (self, ids) {
            (Walk::NewestFirst, Ids::TimeOrdered) => " ORDER BY r.id DESC",
            (Walk::NewestFirst, Ids::Legacy) => " ORDER BY r.created_at DESC, r.id DESC",
            (Walk::OldestFirst, Ids::TimeOrdered) => " ORDER BY r.id",
            (Walk::OldestFirst, Ids::Legacy) => " ORDER BY r.created_at, r.id",
        }
    }
}

/// The states whose runs `runs_listed_by_state` holds (its predicate,
/// migration 0038): queued and running runs are few and found by the walk
/// of the primary key; completed ones are the bulk of the table, walked by
/// id.
const LISTED_STATES: [&str; 6] = ["sleeping", "waiting", "failed", "cancelled", "skipped", "diverged"];

/// The predicate of `runs_listed_by_state` on `r`, made of
/// [`LISTED_STATES`]: a listing of those states restates it, so that a
/// generic plan (whose states are a parameter) may use the index.
fn listed_states() -> String {
    let states: Vec<String> = LISTED_STATES.iter().map(|s| format!("'{s}'")).collect();
    format!(" AND r.state IN ({})", states.join(", "))
}

/// The filter, for the runs of one kind of id. On time-ordered ids a
/// `created_after` bound also bounds the walk of the primary key below
/// (`durastep.run_id_floor`), so that it stops at the first run older than
/// the bound.
fn push_run_filter(b: &mut QueryBuilder<Postgres>, q: &RunQuery<'_>, ids: Ids) {
    b.push(ids.condition());
    if let Some(f) = q.function {
        b.push(" AND r.function_id = ").push_bind(f);
    }
    if !q.states.is_empty() {
        // States listed by state are found through `runs_listed_by_state`
        // (its predicate restated); the others are filtered on the walk of
        // the primary key.
        if q.states.iter().all(|s| LISTED_STATES.contains(s)) {
            b.push(listed_states());
        }
        b.push(" AND r.state = ANY (").push_bind(q.states.to_vec()).push(")");
    }
    if let Some(t) = q.created_after {
        b.push(" AND r.created_at >= ").push_bind(t);
        if ids == Ids::TimeOrdered {
            b.push(" AND r.id >= durastep.run_id_floor(").push_bind(t).push(")");
        }
    }
    if let Some(t) = q.created_before {
        b.push(" AND r.created_at < ").push_bind(t);
    }
    if let Some(n) = q.event_name {
        b.push(" AND e.name = ").push_bind(n);
    }
    if let Some(k) = q.idempotency_key {
        b.push(" AND e.idempotency_key = ").push_bind(k);
    }
    if let Some((path, value)) = q.data {
        b.push(" AND e.payload #> ").push_bind(path.to_vec()).push(" = ").push_bind((*value).clone());
    }
}

/// Runs matching the filter, newest first, at most `limit` (keyset paginated).
/// Newest first is by id for time-ordered ids, then by `created_at` for the
/// others ([`Ids`]); the cursor's id says which kind the page goes on with.
pub(crate) async fn list_runs(pool: &PgPool, q: &RunQuery<'_>) -> Result<Vec<RunListRow>, sqlx::Error> {
    let mut rows = Vec::new();
    for ids in Walk::NewestFirst.kinds_from(q.before) {
        let left = q.limit - rows.len() as i64;
        if left <= 0 {
            break;
        }
        let mut b = QueryBuilder::new(
            "SELECT r.id, r.function_id, r.event_id, e.name AS event_name, e.idempotency_key, r.state, r.attempt,
                    r.max_attempts, r.lease_losses, least(r.run_at, '9999-12-31 23:59:59+00') AS run_at,
                    r.created_at, r.finished_at, r.last_error",
        );
        b.push(q.runs_and_events());
        push_run_filter(&mut b, q, ids);
        Walk::NewestFirst.push_past(&mut b, q.before, ids);
        b.push(Walk::NewestFirst.order(ids)).push(" LIMIT ").push_bind(left);
        rows.extend(b.build_query_as::<RunListRow>().fetch_all(pool).await?);
    }
    Ok(rows)
}

/// The ids of the runs matching the filter (up to `limit`), oldest first, for
/// bulk actions: the legacy ids first, then the time-ordered ones ([`Ids`]),
/// each with its `created_at`. Keyset paginated: only runs after `after`
/// (the last run of the previous batch); the cursor's id says which kind the
/// batch goes on with, as in [`list_runs`].
pub(crate) async fn matching_run_ids(
    pool: &PgPool,
    q: &RunQuery<'_>,
    after: Option<(DateTime<Utc>, Uuid)>,
) -> Result<Vec<(Uuid, DateTime<Utc>)>, sqlx::Error> {
    let mut out = Vec::new();
    for ids in Walk::OldestFirst.kinds_from(after) {
        let left = q.limit - out.len() as i64;
        if left <= 0 {
            break;
        }
        let mut b = QueryBuilder::new("SELECT r.id, r.created_at");
        b.push(q.runs_and_events());
        push_run_filter(&mut b, q, ids);
        Walk::OldestFirst.push_past(&mut b, after, ids);
        b.push(Walk::OldestFirst.order(ids)).push(" LIMIT ").push_bind(left);
        out.extend(b.build_query_as::<(Uuid, DateTime<Utc>)>().fetch_all(pool).await?);
    }
    Ok(out)
}

/// The stored event of a run, or any event.
#[derive(sqlx::FromRow)]
pub(crate) struct EventRow {
    pub id: Uuid,
    pub name: String,
    pub payload: Value,
    pub idempotency_key: Option<String>,
    pub created_at: DateTime<Utc>,
    pub runs: i64,
}

/// One event with the number of runs it started (counted by their keys,
/// migration 0042).
pub(crate) async fn load_event(pool: &PgPool, id: Uuid) -> Result<Option<EventRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.id, e.name, e.payload, e.idempotency_key, e.created_at,
                (SELECT count(*) FROM durastep.run_keys k WHERE k.event_id = e.id) AS runs
           FROM durastep.events e WHERE e.id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await
}

/// Events, newest first, optionally of one name, keyset paginated.
pub(crate) async fn list_events(
    pool: &PgPool,
    name: Option<&str>,
    before: Option<(DateTime<Utc>, Uuid)>,
    limit: i64,
) -> Result<Vec<EventRow>, sqlx::Error> {
    let mut b = QueryBuilder::new(
        "SELECT e.id, e.name, e.payload, e.idempotency_key, e.created_at,
                (SELECT count(*) FROM durastep.run_keys k WHERE k.event_id = e.id) AS runs
           FROM durastep.events e WHERE true",
    );
    if let Some(n) = name {
        b.push(" AND e.name = ").push_bind(n);
    }
    if let Some((t, id)) = before {
        b.push(" AND (e.created_at, e.id) < (").push_bind(t).push(", ").push_bind(id).push(")");
    }
    b.push(" ORDER BY e.created_at DESC, e.id DESC LIMIT ").push_bind(limit);
    b.build_query_as().fetch_all(pool).await
}

/// One row of a run's state history.
#[derive(sqlx::FromRow)]
pub(crate) struct HistoryRow {
    pub at: DateTime<Utc>,
    pub state: RunState,
    pub attempt: i32,
    pub worker_id: Option<Uuid>,
    pub error: Option<String>,
    pub step: Option<String>,
}

/// A run's history, oldest first: each attempt's start and every change of
/// state (`durastep.run_timeline`, migration 0044, which expands an
/// attempt's row into its start and its end).
pub(crate) async fn load_history(pool: &PgPool, run_id: Uuid) -> Result<Vec<HistoryRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT at, state, attempt, worker_id, error, step
           FROM durastep.run_timeline WHERE run_id = $1 ORDER BY seq, part",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
}

/// One stored step result, with its timing.
#[derive(sqlx::FromRow)]
pub(crate) struct StepRow {
    pub step_key: String,
    pub output: Value,
    pub started_at: Option<DateTime<Utc>>,
    pub finished_at: Option<DateTime<Utc>>,
    pub stored_at: DateTime<Utc>,
    pub attempt: Option<i32>,
}

/// A run's stored steps, in the order they finished.
pub(crate) async fn load_steps(pool: &PgPool, run_id: Uuid) -> Result<Vec<StepRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT step_key, output, started_at, finished_at, created_at AS stored_at, attempt
           FROM durastep.step_results WHERE run_id = $1
          ORDER BY coalesce(finished_at, created_at), created_at, step_key",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
}

/// The child runs (ctx.invoke) of a run.
pub(crate) async fn load_children(pool: &PgPool, run_id: Uuid) -> Result<Vec<(Uuid, String, RunState)>, sqlx::Error> {
    sqlx::query_as("SELECT id, function_id, state FROM durastep.runs WHERE parent_run_id = $1 ORDER BY created_at, id")
        .bind(run_id)
        .fetch_all(pool)
        .await
}

/// A row of `durastep.run_blockers`.
#[derive(sqlx::FromRow)]
pub(crate) struct BlockerRow {
    pub run_id: Uuid,
    pub function_id: String,
    pub state: RunState,
    pub blocker: String,
    pub rule: Option<String>,
    pub key: Option<String>,
    pub in_use: Option<i32>,
    pub limit: Option<i32>,
    pub next_possible_start: Option<DateTime<Utc>>,
    pub detail: Option<String>,
}

/// What holds runs that are not running (one run, or the first `limit` of a function's, or of all).
pub(crate) async fn blockers(
    pool: &PgPool,
    run_id: Option<Uuid>,
    function: Option<&str>,
    limit: i64,
) -> Result<Vec<BlockerRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT run_id, function_id, state, blocker, rule, key, in_use, "limit", next_possible_start, detail
             FROM durastep.run_blockers
            WHERE ($1::uuid IS NULL OR run_id = $1) AND ($2::text IS NULL OR function_id = $2)
            ORDER BY run_at, run_id LIMIT $3"#,
    )
    .bind(run_id)
    .bind(function)
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Where a held run stands, for naming its step: one row per candidate.
#[derive(sqlx::FromRow)]
pub(crate) struct HeldStepRow {
    /// `wait` (a `durastep.waits` row), `invoke` (a child run) or `sleep` (a
    /// stored step that may be a sleep record).
    pub source: String,
    pub run_id: Uuid,
    pub step_key: String,
    /// The awaited event (waits).
    pub event_name: Option<String>,
    /// The stored record (sleeps; maybe sealed).
    pub output: Option<Value>,
}

/// The candidates for the step each held run is in: the waits of `waiting`
/// runs (oldest first, as `run_blockers` picks its event), the step keys of
/// the child runs `children` were invoked at, and the stored steps of
/// `sleeping` runs that can be a sleep record (`{"wake_at": ...}`, or a sealed
/// or escaped value). Oldest first (by when each was stored).
pub(crate) async fn held_steps(
    pool: &PgPool,
    waiting: &[Uuid],
    children: &[Uuid],
    sleeping: &[Uuid],
) -> Result<Vec<HeldStepRow>, sqlx::Error> {
    sqlx::query_as(
        r#"SELECT 'wait' AS source, w.run_id, w.step_key, w.event_name, NULL::jsonb AS output, w.created_at AS at
             FROM durastep.waits w WHERE w.run_id = ANY ($1)
           UNION ALL
           SELECT 'invoke', c.parent_run_id, c.parent_step_key, NULL, NULL, c.created_at
             FROM durastep.runs c WHERE c.id = ANY ($2) AND c.parent_step_key IS NOT NULL
           UNION ALL
           SELECT 'sleep', s.run_id, s.step_key, NULL, s.output, s.created_at
             FROM durastep.step_results s
            WHERE s.run_id = ANY ($3)
              AND (s.output ? 'wake_at' OR s.output ? '$durastep' OR s.output ? '$sealed')
            ORDER BY at, step_key"#,
    )
    .bind(waiting)
    .bind(children)
    .bind(sleeping)
    .fetch_all(pool)
    .await
}

/// Runs per function and state.
pub(crate) async fn counts(pool: &PgPool) -> Result<Vec<(String, RunState, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT function_id, state, count(*) FROM durastep.runs GROUP BY 1, 2 ORDER BY 1, 2")
        .fetch_all(pool)
        .await
}

/// The planner's row estimate of `durastep.runs` (-1 before its first ANALYZE).
pub(crate) async fn runs_row_estimate(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT reltuples::bigint FROM pg_catalog.pg_class WHERE oid = 'durastep.runs'::regclass")
        .fetch_one(pool)
        .await
}

/// Exact counts of the unfinished states only (through the partial indexes
/// `runs_due` and, for the diverged runs, `runs_listed_by_state` (since
/// migration 0043; `runs_diverged` before), and the claim records for the
/// running runs: bounded by the work in flight, however many finished runs
/// the table keeps).
pub(crate) async fn unfinished_counts(pool: &PgPool) -> Result<Vec<(String, RunState, i64)>, sqlx::Error> {
    sqlx::query_as(
        // One branch per partial index, whose predicate each branch repeats
        // (a single `state IN (...)` over all five is a seq scan of the
        // table), and the running runs through their claims' records.
        concat!(
            "SELECT function_id, state, count(*) FROM (
             SELECT function_id, state FROM durastep.runs WHERE state IN ('queued', 'sleeping', 'waiting')
             UNION ALL SELECT r.function_id, r.state FROM ",
            running_runs!(),
            "
             UNION ALL SELECT function_id, state FROM durastep.runs WHERE state = 'diverged') u
          GROUP BY 1, 2 ORDER BY 1, 2"
        ),
    )
    .fetch_all(pool)
    .await
}

/// Estimated counts per function and state from the `runs_function_state`
/// statistic (migration 0012): no row of `runs` is read.
pub(crate) async fn count_estimates(pool: &PgPool) -> Result<Vec<(String, RunState, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT function_id, state, estimate FROM durastep.run_count_estimates() ORDER BY 1, 2")
        .fetch_all(pool)
        .await
}

/// Per minute over the last `window`: runs created, completed, failed (by the
/// database clock; the finishes from the run history, and the completions
/// runs carry from their minutes' counts, migration 0045).
pub(crate) async fn per_minute(
    pool: &PgPool,
    window: Duration,
) -> Result<Vec<(DateTime<Utc>, i64, i64, i64)>, sqlx::Error> {
    sqlx::query_as(concat!(
        "WITH t AS (SELECT durastep.now() - make_interval(secs => $1) AS since),
         -- Runs created: time-ordered ids from the primary key, bounded below
         -- (durastep.run_id_floor), and the others (migration 0031).
         x AS (
             SELECT date_trunc('minute', r.created_at) AS m, 1 AS c, 0 AS d, 0 AS f
               FROM durastep.runs r
              WHERE ",
        time_ordered!(),
        "
                AND r.id >= (SELECT durastep.run_id_floor(t.since) FROM t) AND r.created_at >= (SELECT t.since FROM t)
             UNION ALL
             SELECT date_trunc('minute', r.created_at), 1, 0, 0
               FROM durastep.runs r
              WHERE ",
        legacy!(),
        "
                AND r.created_at >= (SELECT t.since FROM t)
             UNION ALL
             -- Runs finished: their completions and failures as the run
             -- history records them, through its BRIN index on `at` (0033),
             SELECT date_trunc('minute', h.at), 0, (h.state = 'completed')::int, (h.state = 'failed')::int
               FROM durastep.run_history h, t WHERE h.at >= t.since AND h.state IN ('completed', 'failed')
             UNION ALL
             -- and the completions that runs carry (0045), counted per
             -- minute and connection; a minute counts whole once it
             -- overlaps the window.
             SELECT c.minute, 0, c.completed, 0
               FROM durastep.completions_per_minute c, t WHERE c.minute > t.since - interval '1 minute')
         SELECT m, sum(c)::bigint, sum(d)::bigint, sum(f)::bigint FROM x GROUP BY m ORDER BY m",
    ))
    .bind(secs(window))
    .fetch_all(pool)
    .await
}

/// A registered function with its trigger, schedule and flow rules.
#[derive(sqlx::FromRow)]
pub(crate) struct FunctionInfoRow {
    pub id: String,
    pub triggers: Vec<String>,
    pub max_attempts: i32,
    pub updated_at: DateTime<Utc>,
    pub cron: Option<String>,
    pub tz: Option<String>,
    pub next_fire_at: Option<DateTime<Utc>>,
    /// `[{name, kind, limit, period_secs, key}, ...]`
    pub rules: Value,
}

/// Every function some engine registered.
pub(crate) async fn functions(pool: &PgPool) -> Result<Vec<FunctionInfoRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT f.id, f.triggers, f.max_attempts, f.updated_at, s.expr AS cron, s.tz,
                nullif(s.next_fire_at, 'infinity') AS next_fire_at,
                coalesce((SELECT jsonb_agg(jsonb_build_object('name', ff.rule, 'kind', fr.kind, 'limit', fr.capacity,
                                                              'period_secs', fr.period_s, 'key', ff.key_pointer)
                                           ORDER BY ff.rule)
                            FROM durastep.function_flow ff JOIN durastep.flow_rules fr ON fr.name = ff.rule
                           WHERE ff.function_id = f.id), '[]'::jsonb) AS rules
           FROM durastep.functions f LEFT JOIN durastep.schedules s ON s.function_id = f.id
          ORDER BY f.id",
    )
    .fetch_all(pool)
    .await
}

/// A run as the inspection API shows it.
#[derive(sqlx::FromRow)]
pub(crate) struct RunRow {
    pub id: Uuid,
    pub function_id: String,
    pub event_id: Uuid,
    pub state: RunState,
    pub attempt: i32,
    pub max_attempts: i32,
    pub lease_losses: i32,
    pub run_at: DateTime<Utc>,
    pub last_error: Option<String>,
    pub cancel_reason: Option<String>,
    pub output: Option<Value>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// The run and step that invoked it (a child run): its output is bound to them.
    pub parent_run_id: Option<Uuid>,
    pub parent_step_key: Option<String>,
    /// The function version it started under.
    pub version: i32,
}

/// A run as the API shows it.
impl From<RunRow> for crate::Run {
    fn from(r: RunRow) -> Self {
        crate::Run {
            id: r.id,
            function_id: r.function_id,
            event_id: r.event_id,
            state: r.state,
            attempt: crate::run::count(r.attempt),
            max_attempts: crate::run::count(r.max_attempts),
            lease_losses: crate::run::count(r.lease_losses),
            run_at: r.run_at,
            last_error: r.last_error,
            cancel_reason: r.cancel_reason,
            output: r.output,
            created_at: r.created_at,
            finished_at: r.finished_at,
            version: crate::run::count(r.version),
        }
    }
}

impl RunRow {
    /// Where its output is stored (the associated data of a sealed output).
    pub(crate) fn output_place(&self) -> crate::codec::Place {
        let parent = self.parent_run_id.zip(self.parent_step_key.as_deref());
        crate::codec::Place::output(self.id, parent)
    }
}

/// Loads one run.
pub(crate) async fn load_run<'e>(db: impl sqlx::PgExecutor<'e>, run_id: Uuid) -> Result<Option<RunRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id, r.function_id, r.event_id, r.state, r.attempt, r.max_attempts,
                least(r.run_at, '9999-12-31 23:59:59+00') AS run_at, r.last_error, r.lease_losses,
                r.cancel_reason, r.output, r.created_at, r.finished_at,
                r.parent_run_id, r.parent_step_key, r.version
           FROM durastep.runs r
          WHERE r.id = $1",
    )
    .bind(run_id)
    .fetch_optional(db)
    .await
}

/// An unfinished run as a dry replay needs it.
pub(crate) struct ReplayRun {
    pub id: Uuid,
    pub function_id: String,
    pub version: i32,
    pub event_id: Uuid,
    pub attempt: i32,
    pub payload: Value,
    pub steps: HashMap<String, Value>,
    pub journal: BTreeMap<u32, JournalEntry>,
}

/// A page of the unfinished runs of these functions, by id after `after`.
pub(crate) async fn unfinished_runs(
    pool: &PgPool,
    functions: &[String],
    after: Uuid,
    limit: i64,
) -> Result<Vec<ReplayRun>, sqlx::Error> {
    let rows = sqlx::query(concat!(
        "SELECT c.id, c.function_id, c.version, c.event_id, c.attempt, e.payload,
                    st.step_keys, st.step_outputs, st.step_positions, st.step_kinds, jr.journal_positions, jr.journal_kinds, jr.journal_keys
               FROM (
                   -- The page's ids first, one branch per partial index (a single
                   -- `state IN (...)` over all five is a seq scan of the table):
                   -- `runs_due`, the claim records, `runs_listed_by_state`.
                   SELECT u.id FROM (
                       SELECT id FROM durastep.runs
                        WHERE state IN ('queued', 'sleeping', 'waiting') AND function_id = ANY ($1) AND id > $2
                       UNION ALL SELECT r.id FROM ",
        running_runs!(),
        "
                          AND r.function_id = ANY ($1) AND r.id > $2
                       UNION ALL SELECT id FROM durastep.runs
                        WHERE state = 'diverged' AND function_id = ANY ($1) AND id > $2) u
                    ORDER BY u.id LIMIT $3) page
               JOIN durastep.runs c ON c.id = page.id
               JOIN durastep.events e ON e.id = c.event_id
",
        // Steps and journal as the claims load them; the page is put in id order below.
        include_str!("sql/run_records.sql")
    ))
    .bind(functions)
    .bind(after)
    .bind(limit)
    .fetch_all(pool)
    .await?;
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let (steps, journal) = records_of(&row)?;
        out.push(ReplayRun {
            id: row.try_get("id")?,
            function_id: row.try_get("function_id")?,
            version: row.try_get("version")?,
            event_id: row.try_get("event_id")?,
            attempt: row.try_get("attempt")?,
            payload: row.try_get("payload")?,
            steps,
            journal,
        });
    }
    // Postgres orders uuids by their bytes, as `Uuid` does: the caller's next
    // page starts after the last id here.
    out.sort_by_key(|r| r.id);
    Ok(out)
}

/// What a `diverged` run's replay found (NULL for other runs).
pub(crate) async fn load_divergence(pool: &PgPool, run_id: Uuid) -> Result<Option<Value>, sqlx::Error> {
    let v: Option<Option<Value>> = sqlx::query_scalar("SELECT divergence FROM durastep.runs WHERE id = $1")
        .bind(run_id)
        .fetch_optional(pool)
        .await?;
    Ok(v.flatten())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The legacy listing's condition is `runs_created_legacy`'s predicate as
    /// migration 0031 writes it, and pruning's (0033) the same: the planner
    /// uses the index only for the same text.
    #[test]
    fn the_legacy_condition_is_the_index_predicate() {
        let migration = include_str!("../../../../migrations/0031_runs_listed_by_id.sql");
        let condition = legacy!().replace("r.id", "id");
        let bare = condition.strip_prefix('(').and_then(|c| c.strip_suffix(')')).expect("parenthesized");
        assert!(migration.contains(&format!("WHERE {bare};")), "{bare}");
        // Pruning's walk of the same runs (migration 0033) repeats it too.
        let pruning = include_str!("../../../../migrations/0033_completions_write_no_pruning_entry.sql");
        assert!(pruning.contains(concat!("WHERE ", legacy!())), "prune_batch's legacy branch");
        // And the time-ordered one is its complement, on the same constant.
        assert!(time_ordered!().contains("= 7 AND r.id < '03bb2cc3-d800-0000-0000-000000000000'"));
        assert_eq!(FIRST_ID_OF_2100.to_string(), "03bb2cc3-d800-0000-0000-000000000000");
    }

    /// `LISTED_STATES` and `listed_states` are the predicate of
    /// `runs_listed_by_state` (migration 0038): a state missing would be
    /// listed by a walk of every run instead of through the index, and a
    /// predicate restated otherwise would keep a generic plan off it.
    #[test]
    fn the_listed_states_are_the_index_s() {
        let migration = include_str!("../../../../migrations/0038_generated_columns_undone.sql");
        let states = LISTED_STATES.map(|s| format!("'{s}'")).join(", ");
        let predicate = format!("WHERE state IN ({states});");
        assert!(
            migration.contains(&format!("runs_listed_by_state ON durastep.runs (state, id DESC)\n    {predicate}"))
        );
        assert_eq!(listed_states(), format!(" AND r.state IN ({states})"));
    }

    #[test]
    fn ids_are_told_apart_as_the_conditions_do() {
        assert!(Ids::of(Uuid::now_v7()) == Ids::TimeOrdered);
        assert!(Ids::of(Uuid::new_v4()) == Ids::Legacy);
        let v7_after_2100 = uuid::uuid!("f0000000-0000-7000-8000-000000000005");
        assert!(Ids::of(v7_after_2100) == Ids::Legacy, "a version-7 id past the bound goes with the others");
    }
}
