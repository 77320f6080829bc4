//! The SQL of the inspection API (`crate::inspect`) and of the operator's
//! actions on stored runs: replay and pruning.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgPool, Postgres, QueryBuilder};
use uuid::Uuid;

use super::secs;
use std::time::Duration;

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

/// One run of a listing.
#[derive(sqlx::FromRow)]
pub(crate) struct RunListRow {
    pub id: Uuid,
    pub function_id: String,
    pub event_id: Uuid,
    pub event_name: String,
    pub idempotency_key: Option<String>,
    pub state: String,
    pub attempt: i32,
    pub max_attempts: i32,
    pub run_at: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
}

fn push_run_filter(b: &mut QueryBuilder<Postgres>, q: &RunQuery<'_>) {
    b.push(" WHERE true");
    if let Some(f) = q.function {
        b.push(" AND r.function_id = ").push_bind(f);
    }
    if !q.states.is_empty() {
        b.push(" AND r.state = ANY (").push_bind(q.states.to_vec()).push(")");
    }
    if let Some(t) = q.created_after {
        b.push(" AND r.created_at >= ").push_bind(t);
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
pub(crate) async fn list_runs(pool: &PgPool, q: &RunQuery<'_>) -> Result<Vec<RunListRow>, sqlx::Error> {
    let mut b = QueryBuilder::new(
        "SELECT r.id, r.function_id, r.event_id, e.name AS event_name, e.idempotency_key, r.state, r.attempt,
                r.max_attempts, r.run_at, r.created_at, r.finished_at, r.last_error
           FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id",
    );
    push_run_filter(&mut b, q);
    if let Some((t, id)) = q.before {
        b.push(" AND (r.created_at, r.id) < (").push_bind(t).push(", ").push_bind(id).push(")");
    }
    b.push(" ORDER BY r.created_at DESC, r.id DESC LIMIT ").push_bind(q.limit);
    b.build_query_as().fetch_all(pool).await
}

/// The ids of the runs matching the filter (up to `limit`), oldest first, for bulk actions.
pub(crate) async fn matching_run_ids(pool: &PgPool, q: &RunQuery<'_>) -> Result<Vec<Uuid>, sqlx::Error> {
    let mut b = QueryBuilder::new("SELECT r.id FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id");
    push_run_filter(&mut b, q);
    b.push(" ORDER BY r.created_at, r.id LIMIT ").push_bind(q.limit);
    b.build_query_scalar().fetch_all(pool).await
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

/// One event with the number of runs it started.
pub(crate) async fn load_event(pool: &PgPool, id: Uuid) -> Result<Option<EventRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT e.id, e.name, e.payload, e.idempotency_key, e.created_at,
                (SELECT count(*) FROM durastep.runs r WHERE r.event_id = e.id) AS runs
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
                (SELECT count(*) FROM durastep.runs r WHERE r.event_id = e.id) AS runs
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
    pub state: String,
    pub attempt: i32,
    pub worker_id: Option<Uuid>,
    pub error: Option<String>,
    pub step: Option<String>,
}

/// A run's history, oldest first.
pub(crate) async fn load_history(pool: &PgPool, run_id: Uuid) -> Result<Vec<HistoryRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT at, state, attempt, worker_id, error, step
           FROM durastep.run_history WHERE run_id = $1 ORDER BY seq",
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
pub(crate) async fn load_children(pool: &PgPool, run_id: Uuid) -> Result<Vec<(Uuid, String, String)>, sqlx::Error> {
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
    pub state: String,
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

/// Runs per function and state.
pub(crate) async fn counts(pool: &PgPool) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT function_id, state, count(*) FROM durastep.runs GROUP BY 1, 2 ORDER BY 1, 2")
        .fetch_all(pool)
        .await
}

/// Per minute over the last `window`: runs created, completed, failed (by the database clock).
pub(crate) async fn per_minute(
    pool: &PgPool,
    window: Duration,
) -> Result<Vec<(DateTime<Utc>, i64, i64, i64)>, sqlx::Error> {
    sqlx::query_as(
        "WITH t AS (SELECT durastep.now() - make_interval(secs => $1) AS since),
         x AS (
             SELECT date_trunc('minute', r.created_at) AS m, 1 AS c, 0 AS d, 0 AS f
               FROM durastep.runs r, t WHERE r.created_at >= t.since
             UNION ALL
             SELECT date_trunc('minute', r.finished_at), 0, (r.state = 'completed')::int, (r.state = 'failed')::int
               FROM durastep.runs r, t WHERE r.finished_at >= t.since)
         SELECT m, sum(c)::bigint, sum(d)::bigint, sum(f)::bigint FROM x GROUP BY m ORDER BY m",
    )
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
        "SELECT f.id, f.triggers, f.max_attempts, f.updated_at, s.expr AS cron, s.tz, s.next_fire_at,
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

/// What a replay did to one run.
pub(crate) enum ReplayOutcome {
    /// Queued again.
    Replayed,
    /// Not failed or cancelled: left as it was (its state).
    NotReplayable(String),
}

/// Puts failed or cancelled runs back in the queue, due now, with a fresh set of
/// attempts (their function's `max_attempts` from the current attempt on). With
/// `from_start`, their stored step results are deleted first, in the same
/// transaction; otherwise finished steps are kept and replay. Runs in other
/// states are left alone. Returns, per id, what happened (None: no such run).
pub(crate) async fn replay(
    pool: &PgPool,
    ids: &[Uuid],
    from_start: bool,
) -> Result<Vec<(Uuid, Option<ReplayOutcome>)>, sqlx::Error> {
    let rows: Vec<(Uuid, Option<String>, bool)> = sqlx::query_as(
        "WITH l AS (
             SELECT r.id, r.state, coalesce(f.max_attempts, r.max_attempts) AS fmax, f.finish_timeout_secs
               FROM durastep.runs r
               LEFT JOIN durastep.functions f ON f.id = r.function_id
              WHERE r.id = ANY ($1) ORDER BY r.id FOR NO KEY UPDATE OF r),
         ok AS (SELECT * FROM l WHERE l.state IN ('failed', 'cancelled')),
         wiped AS (DELETE FROM durastep.step_results s USING ok WHERE $2 AND s.run_id = ok.id),
         u AS (
             UPDATE durastep.runs r
                SET state = 'queued', run_at = durastep.now(), attempt = r.attempt + 1,
                    max_attempts = r.attempt + ok.fmax, finished_at = NULL, output = NULL,
                    cancel_reason = NULL, pauses = 0, park_rule = NULL, park_key = NULL,
                    debounce_key = NULL, debounce_deadline = NULL, start_by = NULL,
                    deadline_at = CASE WHEN ok.finish_timeout_secs IS NULL THEN NULL
                                       ELSE durastep.now() + make_interval(secs => ok.finish_timeout_secs) END
               FROM ok WHERE r.id = ok.id
             RETURNING r.id)
         SELECT i.id, l.state, (u.id IS NOT NULL) AS replayed
           FROM unnest($1::uuid[]) AS i(id)
           LEFT JOIN l ON l.id = i.id LEFT JOIN u ON u.id = i.id",
    )
    .bind(ids)
    .bind(from_start)
    .fetch_all(pool)
    .await?;
    if rows.iter().any(|r| r.2) {
        super::notify_workers(pool).await?;
    }
    Ok(rows
        .into_iter()
        .map(|(id, state, replayed)| {
            let outcome = match (state, replayed) {
                (None, _) => None,
                (Some(_), true) => Some(ReplayOutcome::Replayed),
                (Some(s), false) => Some(ReplayOutcome::NotReplayable(s)),
            };
            (id, outcome)
        })
        .collect())
}

/// What one pruning batch removed.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Pruned {
    pub runs: u64,
    pub events: u64,
    pub flow_keys: u64,
}

/// Deletes up to `batch` finished runs (completed, failed, cancelled, skipped)
/// that finished before `older_than` ago, with their steps and history, and the
/// events older than that bound that no run references any more; also idle
/// flow-control key rows. Rows other transactions hold are skipped (SKIP
/// LOCKED), so a batch never waits on a worker; each batch is one short
/// transaction. A run whose parent has not finished is kept (the parent's
/// invoke may still look for it).
pub(crate) async fn prune_batch(pool: &PgPool, older_than: Duration, batch: i64) -> Result<Pruned, sqlx::Error> {
    let (runs, events, flow_keys): (i64, i64, i64) = sqlx::query_as(
        "WITH t AS (SELECT durastep.now() - make_interval(secs => $1) AS bound),
         doomed AS MATERIALIZED (
             SELECT r.id, r.event_id FROM durastep.runs r, t
              WHERE r.finished_at < t.bound AND r.state IN ('completed', 'failed', 'cancelled', 'skipped')
                AND NOT EXISTS (SELECT 1 FROM durastep.runs p WHERE p.id = r.parent_run_id
                                 AND p.state IN ('queued', 'running', 'sleeping', 'waiting'))
              ORDER BY r.finished_at LIMIT $2
              FOR UPDATE OF r SKIP LOCKED),
         hist AS (DELETE FROM durastep.run_history h USING doomed d WHERE h.run_id = d.id),
         gone AS (DELETE FROM durastep.runs r USING doomed d WHERE r.id = d.id RETURNING r.id, r.event_id),
         ev AS MATERIALIZED (
             SELECT e.id FROM durastep.events e, t
              WHERE e.created_at < t.bound
                AND (e.id IN (SELECT event_id FROM gone)
                     OR e.id IN (SELECT x.id FROM durastep.events x
                                  WHERE x.created_at < t.bound
                                    AND NOT EXISTS (SELECT 1 FROM durastep.runs r WHERE r.event_id = x.id)
                                  ORDER BY x.created_at LIMIT $2))
                AND NOT EXISTS (SELECT 1 FROM durastep.runs r
                                 WHERE r.event_id = e.id AND r.id NOT IN (SELECT id FROM gone))
              FOR UPDATE OF e SKIP LOCKED),
         evd AS (DELETE FROM durastep.events e USING ev WHERE e.id = ev.id RETURNING e.id),
         fk AS MATERIALIZED (
             SELECT f.rule, f.key FROM durastep.flow_keys f, t
              WHERE f.in_use = 0
                AND coalesce(f.tat, '-infinity') < durastep.now()
                AND coalesce(f.horizon, '-infinity') < durastep.now()
                AND coalesce(f.paused_until, '-infinity') < durastep.now()
                AND NOT EXISTS (SELECT 1 FROM durastep.runs r WHERE r.park_rule = f.rule AND r.park_key = f.key
                                 AND r.state = 'queued')
              LIMIT $2
              FOR UPDATE OF f SKIP LOCKED),
         fkd AS (DELETE FROM durastep.flow_keys f USING fk WHERE f.rule = fk.rule AND f.key = fk.key RETURNING 1)
         SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM evd), (SELECT count(*) FROM fkd)",
    )
    .bind(secs(older_than))
    .bind(batch)
    .fetch_one(pool)
    .await?;
    Ok(Pruned { runs: runs as u64, events: events as u64, flow_keys: flow_keys as u64 })
}
