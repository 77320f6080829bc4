//! Every SQL statement Durastep runs, named for what it does.
//!
//! Architecture invariant: no other module builds or sends SQL. Every statement
//! here is a fixed string; user values travel only as bind parameters. Every write
//! made on behalf of an attempt compares `(id, lease_epoch, state = 'running')`
//! under a row lock in the same statement (fencing). Statements that lock several
//! run rows lock them in id order, and the claim and the reaper skip locked rows,
//! so the engine's own statements cannot deadlock one another.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

pub(crate) mod inspect;

/// The channel workers LISTEN on. Payloads are empty: a notification is only a hint.
pub(crate) const WAKEUP_CHANNEL: &str = "durastep_wakeup";

/// Applies the embedded migrations; tracking lives in `durastep._migrations`.
pub(crate) async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut migrator = sqlx::migrate!("../../migrations");
    migrator.create_schema("durastep");
    migrator.dangerous_set_table_name("durastep._migrations");
    migrator.run(pool).await
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// A function definition as stored in `durastep.functions`.
pub(crate) struct FunctionRow {
    pub id: String,
    pub triggers: Vec<String>,
    pub max_attempts: i32,
    pub has_on_failure: bool,
    /// `[{"event", "event_path", "run_path"}]`, as JSON text.
    pub cancel_on: String,
    pub start_timeout_secs: Option<f64>,
    pub finish_timeout_secs: Option<f64>,
}

/// Upserts function definitions (sorted by id, so concurrent starts cannot deadlock).
pub(crate) async fn register_functions(pool: &PgPool, rows: &mut [FunctionRow]) -> Result<(), sqlx::Error> {
    rows.sort_by(|a, b| a.id.cmp(&b.id));
    let ids: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    // Postgres has no array-of-arrays of different lengths: triggers travel as JSON.
    let triggers: Vec<String> =
        rows.iter().map(|r| serde_json::to_string(&r.triggers).unwrap_or_else(|_| "[]".into())).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.max_attempts).collect();
    let on_failure: Vec<bool> = rows.iter().map(|r| r.has_on_failure).collect();
    let cancel_on: Vec<&str> = rows.iter().map(|r| r.cancel_on.as_str()).collect();
    let start_timeouts: Vec<Option<f64>> = rows.iter().map(|r| r.start_timeout_secs).collect();
    let finish_timeouts: Vec<Option<f64>> = rows.iter().map(|r| r.finish_timeout_secs).collect();
    sqlx::query(
        "INSERT INTO durastep.functions (id, triggers, max_attempts, has_on_failure, cancel_on,
                                         start_timeout_secs, finish_timeout_secs, updated_at)
         SELECT t.id, ARRAY(SELECT jsonb_array_elements_text(t.triggers::jsonb)), t.attempts, t.on_failure,
                t.cancel_on::jsonb, t.start_timeout, t.finish_timeout, now()
           FROM unnest($1::text[], $2::text[], $3::int[], $4::bool[], $5::text[], $6::float8[], $7::float8[])
                AS t(id, triggers, attempts, on_failure, cancel_on, start_timeout, finish_timeout)
         ON CONFLICT (id) DO UPDATE
            SET triggers = EXCLUDED.triggers, max_attempts = EXCLUDED.max_attempts,
                has_on_failure = EXCLUDED.has_on_failure, cancel_on = EXCLUDED.cancel_on,
                start_timeout_secs = EXCLUDED.start_timeout_secs,
                finish_timeout_secs = EXCLUDED.finish_timeout_secs, updated_at = now()",
    )
    .bind(&ids)
    .bind(&triggers)
    .bind(&attempts)
    .bind(&on_failure)
    .bind(&cancel_on)
    .bind(&start_timeouts)
    .bind(&finish_timeouts)
    .execute(pool)
    .await?;
    Ok(())
}

/// The flow definitions of the functions an engine registers.
pub(crate) struct FlowRows {
    /// Every function the engine registers (their old flow rows are replaced).
    pub function_ids: Vec<String>,
    /// (function id, rule).
    pub rules: Vec<(String, crate::flow::StoredRule)>,
    /// (function id, options).
    pub options: Vec<(String, crate::flow::StoredOptions)>,
}

/// Stores the flow rules (upserted by name: last writer wins) and replaces the
/// registered functions' flow rows, in one transaction.
pub(crate) async fn register_flow(pool: &PgPool, rows: &FlowRows) -> Result<(), sqlx::Error> {
    let mut rules: Vec<&crate::flow::StoredRule> = rows.rules.iter().map(|(_, r)| r).collect();
    rules.sort_by(|a, b| a.name.cmp(&b.name));
    rules.dedup_by(|a, b| a.name == b.name);
    let names: Vec<&str> = rules.iter().map(|r| r.name.as_str()).collect();
    let kinds: Vec<&str> = rules.iter().map(|r| r.kind.as_str()).collect();
    let caps: Vec<i32> = rules.iter().map(|r| r.capacity).collect();
    let periods: Vec<f64> = rules.iter().map(|r| r.period_s).collect();
    let bursts: Vec<i32> = rules.iter().map(|r| r.burst).collect();
    let ff_fn: Vec<&str> = rows.rules.iter().map(|(f, _)| f.as_str()).collect();
    let ff_rule: Vec<&str> = rows.rules.iter().map(|(_, r)| r.name.as_str()).collect();
    let ff_ptr: Vec<Option<&str>> = rows.rules.iter().map(|(_, r)| r.pointer.as_deref()).collect();
    // Paths travel as JSON (arrays of different lengths do not fit a text[][]).
    let json_path = |p: &Option<Vec<String>>| p.as_ref().map(|p| serde_json::to_string(p).unwrap_or_default());
    let ff_path: Vec<Option<String>> = rows.rules.iter().map(|(_, r)| json_path(&r.path)).collect();
    let o = &rows.options;
    let o_fn: Vec<&str> = o.iter().map(|(f, _)| f.as_str()).collect();
    let o_ds: Vec<Option<f64>> = o.iter().map(|(_, x)| x.debounce_s).collect();
    let o_dm: Vec<Option<f64>> = o.iter().map(|(_, x)| x.debounce_max_s).collect();
    let o_dptr: Vec<Option<&str>> = o.iter().map(|(_, x)| x.debounce_pointer.as_deref()).collect();
    let o_dpath: Vec<Option<String>> = o.iter().map(|(_, x)| json_path(&x.debounce_path)).collect();
    let o_sm: Vec<Option<&str>> = o.iter().map(|(_, x)| x.singleton_mode).collect();
    let o_sptr: Vec<Option<&str>> = o.iter().map(|(_, x)| x.singleton_pointer.as_deref()).collect();
    let o_spath: Vec<Option<String>> = o.iter().map(|(_, x)| json_path(&x.singleton_path)).collect();
    let o_pptr: Vec<Option<&str>> = o.iter().map(|(_, x)| x.priority_pointer.as_deref()).collect();
    let o_ppath: Vec<Option<String>> = o.iter().map(|(_, x)| json_path(&x.priority_path)).collect();

    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO durastep.flow_rules (name, kind, capacity, period_s, burst, updated_at)
         SELECT *, now() FROM unnest($1::text[], $2::text[], $3::int[], $4::float8[], $5::int[])
         ON CONFLICT (name) DO UPDATE
            SET kind = EXCLUDED.kind, capacity = EXCLUDED.capacity, period_s = EXCLUDED.period_s,
                burst = EXCLUDED.burst, updated_at = now()",
    )
    .bind(&names)
    .bind(&kinds)
    .bind(&caps)
    .bind(&periods)
    .bind(&bursts)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM durastep.function_flow WHERE function_id = ANY ($1)")
        .bind(&rows.function_ids)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO durastep.function_flow (function_id, rule, key_pointer, key_path)
         SELECT f, r, p, CASE WHEN j IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text(j::jsonb)) END
           FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS t(f, r, p, j)",
    )
    .bind(&ff_fn)
    .bind(&ff_rule)
    .bind(&ff_ptr)
    .bind(&ff_path)
    .execute(&mut *tx)
    .await?;
    sqlx::query("DELETE FROM durastep.function_options WHERE function_id = ANY ($1)")
        .bind(&rows.function_ids)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO durastep.function_options (function_id, debounce_s, debounce_max_s, debounce_pointer,
                    debounce_path, singleton_mode, singleton_pointer, singleton_path, priority_pointer, priority_path)
         SELECT f, ds, dm, dp,
                CASE WHEN dj IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text(dj::jsonb)) END,
                sm, sp,
                CASE WHEN sj IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text(sj::jsonb)) END,
                pp,
                CASE WHEN pj IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text(pj::jsonb)) END
           FROM unnest($1::text[], $2::float8[], $3::float8[], $4::text[], $5::text[], $6::text[], $7::text[],
                       $8::text[], $9::text[], $10::text[]) AS t(f, ds, dm, dp, dj, sm, sp, sj, pp, pj)",
    )
    .bind(&o_fn)
    .bind(&o_ds)
    .bind(&o_dm)
    .bind(&o_dptr)
    .bind(&o_dpath)
    .bind(&o_sm)
    .bind(&o_sptr)
    .bind(&o_spath)
    .bind(&o_pptr)
    .bind(&o_ppath)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// A cron schedule as stored in `durastep.schedules`.
pub(crate) struct ScheduleRow {
    pub function_id: String,
    pub expr: String,
    pub tz: String,
    pub catch_up: i32,
}

/// Upserts the schedules of the registered functions `ids` (sorted by id) and
/// removes the schedules of those of them that no longer have one. A changed
/// expression or time zone re-arms the schedule from the next tick.
pub(crate) async fn register_schedules(
    pool: &PgPool,
    rows: &mut [ScheduleRow],
    ids: &[String],
) -> Result<(), sqlx::Error> {
    rows.sort_by(|a, b| a.function_id.cmp(&b.function_id));
    let fids: Vec<&str> = rows.iter().map(|r| r.function_id.as_str()).collect();
    let exprs: Vec<&str> = rows.iter().map(|r| r.expr.as_str()).collect();
    let tzs: Vec<&str> = rows.iter().map(|r| r.tz.as_str()).collect();
    let catch_up: Vec<i32> = rows.iter().map(|r| r.catch_up).collect();
    sqlx::query(
        "WITH gone AS (
             DELETE FROM durastep.schedules
              WHERE function_id = ANY ($5) AND NOT function_id = ANY ($1))
         INSERT INTO durastep.schedules (function_id, expr, tz, catch_up)
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int[])
         ON CONFLICT (function_id) DO UPDATE
            SET catch_up = EXCLUDED.catch_up, updated_at = now(),
                expr = EXCLUDED.expr, tz = EXCLUDED.tz,
                last_tick_at = CASE WHEN (durastep.schedules.expr, durastep.schedules.tz) = (EXCLUDED.expr, EXCLUDED.tz)
                                    THEN durastep.schedules.last_tick_at END,
                next_fire_at = CASE WHEN (durastep.schedules.expr, durastep.schedules.tz) = (EXCLUDED.expr, EXCLUDED.tz)
                                    THEN durastep.schedules.next_fire_at END",
    )
    .bind(&fids)
    .bind(&exprs)
    .bind(&tzs)
    .bind(&catch_up)
    .bind(ids)
    .execute(pool)
    .await?;
    Ok(())
}

/// A schedule whose next fire time has passed, locked for this tick.
pub(crate) struct DueSchedule {
    pub function_id: String,
    /// Fire times up to here are handled (None: never ticked; arm it now).
    pub last_tick_at: Option<DateTime<Utc>>,
    pub db_now: DateTime<Utc>,
}

/// Locks the schedules of these functions that are due (or never ticked),
/// skipping those another worker is ticking. Run in the tick's transaction.
pub(crate) async fn lock_due_schedules(
    conn: &mut PgConnection,
    function_ids: &[String],
) -> Result<Vec<DueSchedule>, sqlx::Error> {
    let rows: Vec<(String, Option<DateTime<Utc>>, DateTime<Utc>)> = sqlx::query_as(
        "SELECT function_id, last_tick_at, durastep.now() FROM durastep.schedules
          WHERE function_id = ANY ($1) AND (next_fire_at IS NULL OR next_fire_at <= durastep.now())
          ORDER BY function_id FOR UPDATE SKIP LOCKED",
    )
    .bind(function_ids)
    .fetch_all(&mut *conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(function_id, last_tick_at, db_now)| DueSchedule { function_id, last_tick_at, db_now })
        .collect())
}

/// Records a tick: fire times up to `tick_at` are handled; the next is `next`.
pub(crate) async fn advance_schedule(
    conn: &mut PgConnection,
    function_id: &str,
    tick_at: DateTime<Utc>,
    next: Option<DateTime<Utc>>,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE durastep.schedules SET last_tick_at = $2, next_fire_at = coalesce($3, 'infinity')
          WHERE function_id = $1",
    )
    .bind(function_id)
    .bind(tick_at)
    .bind(next)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// An event ready to insert: validated and serialized.
pub(crate) struct NewEvent {
    pub id: Uuid,
    pub name: String,
    pub payload: String,
    pub idempotency_key: Option<String>,
    pub start_at: Option<DateTime<Utc>>,
    pub priority: i32,
}

/// What an insert did for one event, in input order.
pub(crate) struct InsertedEvent {
    pub event_id: Uuid,
    pub run_ids: Vec<Uuid>,
    pub duplicate: bool,
}

/// Locks the rendezvous rows of these event names (`durastep.topics`) FOR
/// SHARE, creating the missing ones, so that no wait for one of them can be
/// recorded until this transaction ends. Must run in the sender's transaction,
/// as its own statement, before [`insert_events`]: that statement's snapshot is
/// then taken after the lock, so it sees every wait recorded before.
pub(crate) async fn lock_topics(conn: &mut PgConnection, names: &[&str]) -> Result<(), sqlx::Error> {
    let mut names: Vec<&str> = names.to_vec();
    names.sort_unstable();
    names.dedup();
    // Usually every name has its row already: one statement. Otherwise the
    // missing rows are created (this transaction then owns them, or waited
    // for the concurrent sender that created them) and a fresh statement,
    // whose snapshot sees them, locks them too. Three rounds always suffice.
    for round in 0..3 {
        if round > 0 {
            sqlx::query(
                "INSERT INTO durastep.topics (name) SELECT unnest($1::text[]) ORDER BY 1 ON CONFLICT DO NOTHING",
            )
            .bind(&names)
            .execute(&mut *conn)
            .await?;
        }
        let locked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT name FROM durastep.topics WHERE name = ANY ($1)
                                    ORDER BY name FOR SHARE) t",
        )
        .bind(&names)
        .fetch_one(&mut *conn)
        .await?;
        if locked as usize == names.len() {
            return Ok(());
        }
    }
    // Only if topic rows were deleted meanwhile: refuse rather than risk a lost wake-up.
    Err(sqlx::Error::Protocol("durastep.topics rows for the sent event names could not be locked".into()))
}

/// Stores events and fans each out into one run per function it triggers, in one
/// statement. An event whose (name, idempotency key) is already stored inserts
/// nothing and reports the stored event and its runs. In the same statement,
/// each new event cancels the unfinished runs that a `cancel_on` of their
/// function matches, and resumes the waits it matches (see `lock_topics`, which
/// must precede it in the same transaction). Notifies the workers once if any
/// run is due now.
pub(crate) async fn insert_events(
    conn: &mut PgConnection,
    events: &[NewEvent],
) -> Result<Vec<InsertedEvent>, sqlx::Error> {
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    let payloads: Vec<&str> = events.iter().map(|e| e.payload.as_str()).collect();
    let keys: Vec<Option<&str>> = events.iter().map(|e| e.idempotency_key.as_deref()).collect();
    let starts: Vec<Option<DateTime<Utc>>> = events.iter().map(|e| e.start_at).collect();
    let priorities: Vec<i32> = events.iter().map(|e| e.priority).collect();
    let rows = sqlx::query(
        "WITH input AS (
             SELECT * FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::timestamptz[], $6::int[])
                 WITH ORDINALITY AS t(id, name, payload, idem, start_at, priority, ord)),
         ev AS (
             INSERT INTO durastep.events (id, name, payload, idempotency_key)
             SELECT id, name, payload::jsonb, idem FROM input ORDER BY name, idem, ord
             ON CONFLICT DO NOTHING
             RETURNING id),
         fan AS MATERIALIZED (
             SELECT i.id AS event_id, i.ord, f.id AS function_id, f.max_attempts, i.payload::jsonb AS payload,
                    coalesce(i.start_at, durastep.now()) AS start_at,
                    CASE WHEN o.priority_path IS NULL THEN i.priority
                         ELSE durastep.flow_priority(i.payload::jsonb, o.priority_path, i.priority) END AS priority,
                    o.debounce_s, o.debounce_max_s, o.singleton_mode,
                    f.start_timeout_secs, f.finish_timeout_secs,
                    CASE WHEN o.debounce_s IS NOT NULL THEN durastep.flow_key(
                        i.payload::jsonb, o.debounce_path, true, f.id, o.debounce_pointer) END AS dkey,
                    CASE WHEN o.singleton_mode IS NOT NULL THEN durastep.flow_key(
                        i.payload::jsonb, o.singleton_path, true, f.id, o.singleton_pointer) END AS skey
               FROM input i JOIN ev ON ev.id = i.id
               JOIN durastep.functions f ON f.triggers @> ARRAY[i.name]
               LEFT JOIN durastep.function_options o ON o.function_id = f.id),
         keys AS (
             INSERT INTO durastep.flow_keys (rule, key)
             SELECT DISTINCT ff.rule, durastep.flow_key(x.payload, ff.key_path, true, x.function_id, ff.key_pointer)
               FROM fan x JOIN durastep.function_flow ff ON ff.function_id = x.function_id
              ORDER BY 1, 2
             ON CONFLICT DO NOTHING),
         r AS (
             INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, priority,
                                        start_by, deadline_at)
             SELECT gen_random_uuid(), x.function_id, x.event_id, 'queued', x.start_at, x.max_attempts, x.priority,
                    x.start_at + make_interval(secs => x.start_timeout_secs),
                    x.start_at + make_interval(secs => x.finish_timeout_secs)
               FROM fan x WHERE x.debounce_s IS NULL AND x.singleton_mode IS NULL
             RETURNING id, event_id, run_at),
         dr AS (
             INSERT INTO durastep.runs AS old (id, function_id, event_id, state, run_at, max_attempts, priority,
                                               debounce_key, debounce_deadline, start_by, deadline_at)
             SELECT DISTINCT ON (x.function_id, x.dkey) gen_random_uuid(), x.function_id, x.event_id, 'queued',
                    x.start_at + make_interval(secs => x.debounce_s), x.max_attempts, x.priority, x.dkey,
                    x.start_at + make_interval(secs => x.debounce_max_s),
                    x.start_at + make_interval(secs => x.debounce_s + x.start_timeout_secs),
                    x.start_at + make_interval(secs => x.debounce_s + x.finish_timeout_secs)
               FROM fan x WHERE x.debounce_s IS NOT NULL
              ORDER BY x.function_id, x.dkey, x.ord DESC
             ON CONFLICT (function_id, debounce_key) WHERE state = 'queued' AND debounce_key IS NOT NULL
             DO UPDATE SET event_id = EXCLUDED.event_id, priority = EXCLUDED.priority,
                           run_at = least(EXCLUDED.run_at, old.debounce_deadline), park_rule = NULL, park_key = NULL
             RETURNING id, event_id, run_at, function_id, debounce_key),
         sc AS (
             UPDATE durastep.runs o
                SET state = 'cancelled', finished_at = durastep.now(), lease_expires_at = NULL, worker_id = NULL,
                    last_error = 'cancelled: a newer event arrived for singleton key ' || o.singleton_key,
                    cancel_reason = 'a newer event arrived for singleton key ' || o.singleton_key
              WHERE o.id IN (
                    SELECT a.id FROM durastep.runs a
                     WHERE a.state IN ('queued', 'running', 'sleeping', 'waiting') AND a.singleton_key IS NOT NULL
                       AND (a.function_id, a.singleton_key) IN
                           (SELECT function_id, skey FROM fan WHERE singleton_mode = 'cancel_old')
                     ORDER BY a.id FOR UPDATE)
                AND o.state IN ('queued', 'running', 'sleeping', 'waiting')
             RETURNING o.id),
         sr AS (
             INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, priority, singleton_key,
                                        start_by, deadline_at)
             SELECT DISTINCT ON (x.function_id, x.skey) gen_random_uuid(), x.function_id, x.event_id, 'queued',
                    x.start_at, x.max_attempts, x.priority, x.skey,
                    x.start_at + make_interval(secs => x.start_timeout_secs),
                    x.start_at + make_interval(secs => x.finish_timeout_secs)
               FROM fan x WHERE x.singleton_mode IS NOT NULL AND (SELECT count(*) FROM sc) >= 0
              ORDER BY x.function_id, x.skey, CASE WHEN x.singleton_mode = 'cancel_old' THEN -x.ord ELSE x.ord END
             ON CONFLICT (function_id, singleton_key)
                WHERE state IN ('queued', 'running', 'sleeping', 'waiting') AND singleton_key IS NOT NULL
             DO NOTHING
             RETURNING id, event_id, run_at, function_id),
         sk AS (
             INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, priority,
                                        singleton_key, last_error, finished_at)
             SELECT gen_random_uuid(), x.function_id, x.event_id, 'skipped', x.start_at, x.max_attempts, x.priority,
                    x.skey, 'singleton: another run is active for key ' || x.skey, durastep.now()
               FROM fan x WHERE x.singleton_mode IS NOT NULL
                AND NOT EXISTS (SELECT 1 FROM sr WHERE sr.event_id = x.event_id AND sr.function_id = x.function_id)
             RETURNING id, event_id),
         created AS (
             SELECT id, event_id, run_at FROM r
             UNION ALL SELECT id, event_id, run_at FROM dr
             UNION ALL SELECT id, event_id, run_at FROM sr),
         merged AS (
             SELECT x.event_id, d.id FROM fan x
               JOIN dr d ON d.function_id = x.function_id AND d.debounce_key = x.dkey
              WHERE x.debounce_s IS NOT NULL AND d.event_id <> x.event_id),
         fresh AS (
             SELECT i.id, i.name, i.payload::jsonb AS payload, i.ord FROM input i JOIN ev ON ev.id = i.id),
         cspec AS (
             SELECT f.id AS function_id, fr.name,
                    fr.payload #> ARRAY(SELECT jsonb_array_elements_text(c->'event_path')) AS want,
                    ARRAY(SELECT jsonb_array_elements_text(c->'run_path')) AS run_path
               FROM fresh fr, durastep.functions f, jsonb_array_elements(f.cancel_on) c
              WHERE f.cancel_on <> '[]' AND c->>'event' = fr.name),
         cx AS (
             SELECT DISTINCT ON (cr.id) cr.id, s.name
               FROM cspec s
               JOIN durastep.runs cr ON cr.function_id = s.function_id
                                    AND cr.state IN ('queued', 'running', 'sleeping', 'waiting')
               JOIN durastep.events ce ON ce.id = cr.event_id
              WHERE s.want IS NOT NULL AND (ce.payload #> s.run_path) = s.want
              ORDER BY cr.id),
         dx AS (
             SELECT DISTINCT ON (w.run_id, w.step_key) w.run_id, w.step_key, fr.id AS event_id, fr.payload
               FROM fresh fr JOIN durastep.waits w ON w.event_name = fr.name
              WHERE w.match_path IS NULL OR (fr.payload #> w.match_path) = w.match_value
              ORDER BY w.run_id, w.step_key, fr.ord),
         lk AS (
             SELECT l.id, l.state, l.lease_epoch FROM durastep.runs l
              WHERE l.id IN (SELECT id FROM cx UNION SELECT run_id FROM dx)
                AND l.state IN ('queued', 'running', 'sleeping', 'waiting')
              ORDER BY l.id FOR NO KEY UPDATE),
         upd AS (
             UPDATE durastep.runs u
                SET state = CASE WHEN cx.id IS NOT NULL THEN 'cancelled' ELSE 'queued' END,
                    run_at = CASE WHEN cx.id IS NOT NULL THEN u.run_at ELSE durastep.now() END,
                    finished_at = CASE WHEN cx.id IS NOT NULL THEN durastep.now() END,
                    cancel_reason = CASE WHEN cx.id IS NOT NULL THEN 'cancelled by event ' || cx.name
                                         ELSE u.cancel_reason END,
                    lease_expires_at = CASE WHEN cx.id IS NOT NULL THEN NULL ELSE u.lease_expires_at END,
                    worker_id = CASE WHEN cx.id IS NOT NULL THEN NULL ELSE u.worker_id END
               FROM lk LEFT JOIN cx ON cx.id = lk.id
              WHERE u.id = lk.id AND (cx.id IS NOT NULL OR lk.state = 'waiting')
             RETURNING u.id, u.state),
         res AS (
             INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
             SELECT dx.run_id, dx.step_key, jsonb_build_object('event_id', dx.event_id, 'data', dx.payload),
                    lk.lease_epoch
               FROM dx JOIN lk ON lk.id = dx.run_id
              WHERE dx.run_id NOT IN (SELECT id FROM cx)
             ON CONFLICT DO NOTHING
             RETURNING run_id),
         del AS (
             DELETE FROM durastep.waits w
              WHERE w.run_id IN (SELECT lk.id FROM lk JOIN cx ON cx.id = lk.id)
                 OR w.run_id IN (SELECT id FROM sc)
                 OR (w.run_id, w.step_key) IN (SELECT dx.run_id, dx.step_key FROM dx JOIN lk ON lk.id = dx.run_id)
             RETURNING w.run_id)
         SELECT i.ord, i.id, (ev.id IS NOT NULL) AS inserted,
                ARRAY(SELECT c.id FROM created c WHERE c.event_id = i.id
                      UNION SELECT k.id FROM sk k WHERE k.event_id = i.id
                      UNION SELECT m.id FROM merged m WHERE m.event_id = i.id ORDER BY 1) AS run_ids,
                (SELECT pg_notify('durastep_wakeup', '')
                  WHERE EXISTS (SELECT 1 FROM created c WHERE c.run_at <= durastep.now())
                     OR EXISTS (SELECT 1 FROM upd WHERE upd.state = 'queued')) IS NULL AS _n,
                (SELECT count(*) FROM res) + (SELECT count(*) FROM del) AS _touched
           FROM input i LEFT JOIN ev ON ev.id = i.id
          ORDER BY i.ord",
    )
    .bind(&ids)
    .bind(&names)
    .bind(&payloads)
    .bind(&keys)
    .bind(&starts)
    .bind(&priorities)
    .fetch_all(&mut *conn)
    .await?;

    let mut out = Vec::with_capacity(rows.len());
    let mut duplicates = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let inserted: bool = row.try_get("inserted")?;
        if !inserted {
            duplicates.push(i);
        }
        out.push(InsertedEvent {
            event_id: row.try_get("id")?,
            run_ids: row.try_get("run_ids")?,
            duplicate: !inserted,
        });
    }
    if !duplicates.is_empty() {
        let names: Vec<&str> = duplicates.iter().map(|&i| events[i].name.as_str()).collect();
        let keys: Vec<&str> = duplicates.iter().map(|&i| events[i].idempotency_key.as_deref().unwrap_or("")).collect();
        let rows = sqlx::query(
            "SELECT t.ord, e.id, ARRAY(SELECT r.id FROM durastep.runs r WHERE r.event_id = e.id ORDER BY r.id) AS run_ids
               FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(name, idem, ord)
               JOIN durastep.events e ON e.name = t.name AND e.idempotency_key = t.idem",
        )
        .bind(&names)
        .bind(&keys)
        .fetch_all(&mut *conn)
        .await?;
        for row in rows {
            let ord: i64 = row.try_get("ord")?;
            let slot = &mut out[duplicates[(ord - 1) as usize]];
            slot.event_id = row.try_get("id")?;
            slot.run_ids = row.try_get("run_ids")?;
        }
    }
    Ok(out)
}

/// How [`cancel_run`] went.
pub(crate) enum CancelOutcome {
    /// No run has this id.
    Unknown,
    /// The run had already finished in this state; nothing changed.
    Finished(String),
    /// Cancelled now (from this state).
    Cancelled,
}

/// Cancels one unfinished run: its state becomes `cancelled`, so every later
/// fenced write of a running attempt matches nothing, and its waits are removed.
pub(crate) async fn cancel_run(pool: &PgPool, run_id: Uuid, reason: &str) -> Result<CancelOutcome, sqlx::Error> {
    let row: Option<(String, bool)> = sqlx::query_as(
        "WITH l AS (SELECT id, state FROM durastep.runs WHERE id = $1 FOR NO KEY UPDATE),
         u AS (
             UPDATE durastep.runs r
                SET state = 'cancelled', cancel_reason = $2, finished_at = durastep.now(),
                    lease_expires_at = NULL, worker_id = NULL
               FROM l WHERE r.id = l.id AND l.state NOT IN ('completed', 'failed', 'cancelled')
             RETURNING r.id),
         d AS (DELETE FROM durastep.waits w WHERE w.run_id IN (SELECT id FROM u) RETURNING w.run_id)
         SELECT l.state, EXISTS (SELECT 1 FROM u) AND (SELECT count(*) FROM d) >= 0 FROM l",
    )
    .bind(run_id)
    .bind(reason)
    .fetch_optional(pool)
    .await?;
    Ok(match row {
        None => CancelOutcome::Unknown,
        Some((_, true)) => CancelOutcome::Cancelled,
        Some((state, false)) => CancelOutcome::Finished(state),
    })
}

/// What a wait for an event came to, when it was not left waiting.
pub(crate) enum WaitOutcome {
    /// The run is `waiting`; the attempt ends.
    Suspended,
    /// Resolved: the stored result (an event or a timeout record).
    Resolved(Value),
    /// The attempt no longer holds the run.
    Fenced,
}

/// What a wait stores for its step when it times out.
pub(crate) const WAIT_TIMED_OUT: &str = r#"{"timed_out": true}"#;

/// Records a wait for an event of `event_name` whose value at `path` equals
/// `value` (any event of the name when `path` is None), and suspends the run
/// until it arrives or until the deadline, which is computed at the first call
/// (`timeout_secs` from then; None: no deadline) and kept by the wait's row.
/// A result already stored (an event delivered since the claim) is returned
/// instead; a deadline already passed stores the timeout record.
///
/// Lock order: the topic row first (an UPDATE, which conflicts with every
/// sender's FOR SHARE, see `lock_topics`), then the run row (fencing).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn wait_for_event(
    pool: &PgPool,
    run_id: Uuid,
    epoch: i64,
    key: &str,
    event_name: &str,
    path: Option<&[String]>,
    value: Option<&str>,
    timeout_secs: Option<f64>,
) -> Result<WaitOutcome, sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO durastep.topics (name, waits) VALUES ($1, 1)
         ON CONFLICT (name) DO UPDATE SET waits = durastep.topics.waits + 1",
    )
    .bind(event_name)
    .execute(&mut *tx)
    .await?;
    // A fresh statement: its snapshot is taken after the topic lock.
    let state: Option<(Option<Value>, DateTime<Utc>, bool)> = sqlx::query_as(
        "WITH l AS (SELECT id FROM durastep.runs WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
                     FOR NO KEY UPDATE),
         dl AS (SELECT coalesce(
                   (SELECT w.expires_at FROM durastep.waits w WHERE w.run_id = $1 AND w.step_key = $3),
                   CASE WHEN $4::float8 IS NULL THEN 'infinity'::timestamptz
                        ELSE durastep.now() + make_interval(secs => $4) END) AS at)
         SELECT (SELECT s.output FROM durastep.step_results s WHERE s.run_id = $1 AND s.step_key = $3),
                dl.at, dl.at <= durastep.now()
           FROM l, dl",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(key)
    .bind(timeout_secs)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((stored, deadline, due)) = state else {
        return Ok(WaitOutcome::Fenced);
    };
    if let Some(stored) = stored {
        sqlx::query("DELETE FROM durastep.waits WHERE run_id = $1 AND step_key = $2")
            .bind(run_id)
            .bind(key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        return Ok(WaitOutcome::Resolved(stored));
    }
    if due {
        // No sender can deliver meanwhile (we hold the topic), so the insert stores.
        let stored: Option<Value> = sqlx::query_scalar(
            "WITH d AS (DELETE FROM durastep.waits WHERE run_id = $1 AND step_key = $2),
             ins AS (INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
                     VALUES ($1, $2, $3::jsonb, $4) ON CONFLICT DO NOTHING RETURNING output)
             SELECT output FROM ins",
        )
        .bind(run_id)
        .bind(key)
        .bind(WAIT_TIMED_OUT)
        .bind(epoch)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        return match stored {
            Some(v) => Ok(WaitOutcome::Resolved(v)),
            None => Ok(load_step(&mut *pool.acquire().await?, run_id, key)
                .await?
                .map_or(WaitOutcome::Fenced, WaitOutcome::Resolved)),
        };
    }
    sqlx::query(
        "WITH w AS (
             INSERT INTO durastep.waits (run_id, step_key, event_name, match_path, match_value, expires_at)
             VALUES ($1, $2, $3, $4, $5::jsonb, $6)
             ON CONFLICT (run_id, step_key) DO NOTHING)
         UPDATE durastep.runs SET state = 'waiting', run_at = $6, lease_expires_at = NULL, worker_id = NULL
          WHERE id = $1",
    )
    .bind(run_id)
    .bind(key)
    .bind(event_name)
    .bind(path)
    .bind(value)
    .bind(deadline)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(WaitOutcome::Suspended)
}

/// A run a worker has claimed, with everything its attempt needs.
pub(crate) struct ClaimedRun {
    pub id: Uuid,
    pub function_id: String,
    pub event_id: Uuid,
    pub attempt: i32,
    pub lease_epoch: i64,
    pub payload: Value,
    pub steps: HashMap<String, Value>,
    pub db_now: DateTime<Utc>,
}

/// Claims up to `limit` due runs of the given functions, in priority then due
/// order, skipping rows other workers hold; bumps each run's lease epoch and
/// returns its input and every stored step result (one round trip in all).
///
/// Flow control happens in the same statement. Each candidate's keys are read
/// from its event data (`function_flow`), and the rows of those keys in
/// `flow_keys` are locked `FOR UPDATE SKIP LOCKED`: a candidate with a key row
/// another claimer (or a releasing statement) holds is left alone, due, for the
/// next claim. On the locked rows (the latest versions) each candidate is ranked
/// per key, and is started only if every rule admits its rank (concurrency:
/// `in_use + rank <= limit`; throttle and rate limit: GCRA; back-pressure: no
/// pause); the key rows are updated in the same statement. A candidate refused
/// by a concurrency, throttle or back-pressure rule is parked (`queued`, `run_at`
/// = its next possible start, `park_rule`/`park_key` = what it waits for); one
/// refused only by a rate limit is `skipped`. Concurrency keys left with free
/// slots wake their parked runs. Returns the claimed runs and how many other runs
/// it parked, skipped or woke (the caller claims again at once when that is > 0).
pub(crate) async fn claim_runnable(
    pool: &PgPool,
    functions: &[String],
    limit: i64,
    lease: Duration,
    worker_id: Uuid,
) -> Result<(Vec<ClaimedRun>, i64), sqlx::Error> {
    let rows = sqlx::query(
        "WITH cand AS MATERIALIZED (
             SELECT id, function_id, event_id, priority, run_at,
                    (started_at IS NULL AND start_by < durastep.now()) AS late,
                    (deadline_at < durastep.now()) AS overdue
               FROM durastep.runs
              WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at <= durastep.now()
                AND function_id = ANY ($1)
              ORDER BY priority DESC, run_at
              LIMIT $2
              FOR UPDATE SKIP LOCKED),
         expired AS (
             UPDATE durastep.runs x
                SET state = 'cancelled', finished_at = durastep.now(),
                    cancel_reason = CASE WHEN cand.overdue THEN 'finish timeout: not finished by ' || x.deadline_at
                                         ELSE 'start timeout: not started by ' || x.start_by END
               FROM cand WHERE x.id = cand.id AND (cand.late OR cand.overdue)
             RETURNING x.id),
         gone AS (DELETE FROM durastep.waits w WHERE w.run_id IN (SELECT id FROM expired)),
         live AS MATERIALIZED (
             SELECT id, function_id, event_id, priority, run_at FROM cand
              WHERE NOT coalesce(cand.late, false) AND NOT coalesce(cand.overdue, false)),
         t AS (SELECT durastep.now() AS now),
         ck AS MATERIALIZED (
             SELECT c.id, c.priority, c.run_at, ff.rule, fr.kind, fr.capacity, fr.burst,
                    CASE WHEN fr.capacity > 0 THEN fr.period_s / fr.capacity ELSE 0 END AS emit_s,
                    durastep.flow_key(e.payload, ff.key_path, false, c.function_id, ff.key_pointer) AS key
               FROM live c
               JOIN durastep.function_flow ff ON ff.function_id = c.function_id
               JOIN durastep.flow_rules fr ON fr.name = ff.rule
               JOIN durastep.events e ON e.id = c.event_id),
         newkeys AS (
             INSERT INTO durastep.flow_keys (rule, key)
             SELECT DISTINCT ck.rule, ck.key FROM ck
              WHERE NOT EXISTS (SELECT 1 FROM durastep.flow_keys f WHERE f.rule = ck.rule AND f.key = ck.key)
              ORDER BY 1, 2
             ON CONFLICT DO NOTHING),
         fk AS MATERIALIZED (
             SELECT f.rule, f.key, f.in_use, f.tat, f.horizon, f.paused_until FROM durastep.flow_keys f
              WHERE (f.rule, f.key) IN (SELECT rule, key FROM ck)
              ORDER BY f.rule, f.key
              FOR UPDATE SKIP LOCKED),
         ckf AS MATERIALIZED (
             SELECT ck.*, (fk.rule IS NOT NULL) AS locked, fk.in_use, fk.tat, fk.horizon, fk.paused_until
               FROM ck LEFT JOIN fk ON fk.rule = ck.rule AND fk.key = ck.key),
         lockable AS MATERIALIZED (
             SELECT c.id FROM live c
              WHERE NOT EXISTS (SELECT 1 FROM ckf WHERE ckf.id = c.id AND NOT ckf.locked)),
         judged AS MATERIALIZED (
             SELECT x.*, greatest(coalesce(x.tat, t.now), t.now) AS base,
                    CASE x.kind
                      WHEN 'concurrency' THEN x.in_use + x.rn <= x.capacity
                      WHEN 'throttle' THEN greatest(coalesce(x.tat, t.now), t.now)
                           + make_interval(secs => (x.rn - 1 - x.burst) * x.emit_s) <= t.now
                      ELSE x.paused_until IS NULL OR x.paused_until <= t.now
                    END AS ok
               FROM (SELECT ckf.*, row_number() OVER (PARTITION BY ckf.rule, ckf.key
                                                      ORDER BY ckf.priority DESC, ckf.run_at, ckf.id) AS rn
                       FROM ckf WHERE ckf.kind <> 'rate_limit' AND ckf.id IN (SELECT id FROM lockable)) x, t),
         pre AS MATERIALIZED (
             SELECT l.id FROM lockable l
              WHERE NOT EXISTS (SELECT 1 FROM judged j WHERE j.id = l.id AND NOT j.ok)),
         rated AS MATERIALIZED (
             SELECT x.*, greatest(coalesce(x.tat, t.now), t.now)
                         + make_interval(secs => (x.rn - 1 - x.burst) * x.emit_s) <= t.now AS ok
               FROM (SELECT ckf.*, row_number() OVER (PARTITION BY ckf.rule, ckf.key
                                                      ORDER BY ckf.priority DESC, ckf.run_at, ckf.id) AS rn
                       FROM ckf WHERE ckf.kind = 'rate_limit' AND ckf.id IN (SELECT id FROM pre)) x, t),
         admit AS MATERIALIZED (
             SELECT p.id FROM pre p WHERE NOT EXISTS (SELECT 1 FROM rated r WHERE r.id = p.id AND NOT r.ok)),
         skip AS MATERIALIZED (
             SELECT r.id, min(format('rate limit %s: over %s per %s s for key %s',
                                     r.rule, r.capacity, r.emit_s * r.capacity, r.key)) AS reason
               FROM rated r WHERE NOT r.ok GROUP BY r.id),
         refused AS MATERIALIZED (
             SELECT j.id, j.rule, j.key, j.kind,
                    CASE j.kind
                      WHEN 'concurrency' THEN t.now + make_interval(secs => $5)
                      WHEN 'throttle' THEN greatest(
                           j.base + make_interval(secs => (j.rn - 1 - j.burst) * j.emit_s),
                           coalesce(j.horizon, '-infinity'::timestamptz)
                             + make_interval(secs => (row_number() OVER (PARTITION BY j.rule, j.key ORDER BY j.rn)) * j.emit_s))
                      ELSE j.paused_until
                    END AS next_at
               FROM judged j, t WHERE NOT j.ok),
         park AS MATERIALIZED (
             SELECT r.id,
                    (array_agg(r.rule ORDER BY (r.kind = 'concurrency') DESC, r.next_at DESC))[1] AS rule,
                    (array_agg(r.key ORDER BY (r.kind = 'concurrency') DESC, r.next_at DESC))[1] AS key,
                    max(r.next_at) AS run_at
               FROM refused r GROUP BY r.id),
         per_key AS (
             SELECT k.rule, k.key, k.kind, k.emit_s, k.capacity, k.in_use,
                    (SELECT count(*) FROM ckf a WHERE a.rule = k.rule AND a.key = k.key
                        AND a.id IN (SELECT id FROM admit)) AS n,
                    (SELECT max(r.next_at) FROM refused r
                      WHERE r.rule = k.rule AND r.key = k.key AND r.kind = 'throttle') AS horizon
               FROM (SELECT DISTINCT rule, key, kind, emit_s, capacity, in_use FROM ckf WHERE locked) k),
         counted AS (
             UPDATE durastep.flow_keys f
                SET in_use = f.in_use + CASE WHEN p.kind = 'concurrency' THEN p.n ELSE 0 END,
                    tat = CASE WHEN p.kind IN ('throttle', 'rate_limit') AND p.n > 0
                               THEN greatest(coalesce(f.tat, t.now), t.now) + make_interval(secs => p.n * p.emit_s)
                               ELSE f.tat END,
                    horizon = CASE WHEN p.horizon IS NULL THEN f.horizon
                                   ELSE greatest(coalesce(f.horizon, p.horizon), p.horizon) END
               FROM per_key p, t
              WHERE f.rule = p.rule AND f.key = p.key AND p.kind <> 'backpressure'
                AND (p.n > 0 OR p.horizon IS NOT NULL)),
         claimed AS (
             UPDATE durastep.runs r
                SET state = 'running', lease_epoch = r.lease_epoch + 1,
                    lease_expires_at = durastep.now() + make_interval(secs => $3),
                    worker_id = $4, started_at = coalesce(r.started_at, durastep.now()),
                    park_rule = NULL, park_key = NULL,
                    flow_held = (SELECT jsonb_agg(jsonb_build_array(j.rule, j.key)) FROM judged j
                                  WHERE j.id = r.id AND j.kind = 'concurrency')
               FROM admit, durastep.events e
              WHERE r.id = admit.id AND e.id = r.event_id
             RETURNING r.id, r.function_id, r.event_id, r.attempt, r.lease_epoch, e.payload,
                       durastep.now() AS db_now,
                       (SELECT coalesce(jsonb_object_agg(s.step_key, s.output), '{}'::jsonb)
                          FROM durastep.step_results s WHERE s.run_id = r.id) AS steps),
         parked AS (
             UPDATE durastep.runs r SET state = 'queued', run_at = p.run_at, park_rule = p.rule, park_key = p.key
               FROM park p WHERE r.id = p.id
             RETURNING r.id),
         skipped AS (
             UPDATE durastep.runs r
                SET state = 'skipped', finished_at = durastep.now(), last_error = s.reason,
                    park_rule = NULL, park_key = NULL
               FROM skip s WHERE r.id = s.id
             RETURNING r.id),
         woken AS (
             UPDATE durastep.runs r SET run_at = durastep.now(), park_rule = NULL, park_key = NULL
              WHERE r.id IN (
                    SELECT w.id FROM per_key p CROSS JOIN LATERAL (
                        SELECT w.id FROM durastep.runs w
                         WHERE w.park_rule = p.rule AND w.park_key = p.key AND w.state = 'queued'
                           AND w.id NOT IN (SELECT id FROM cand)
                         ORDER BY w.priority DESC, w.created_at
                         LIMIT greatest(p.capacity - p.in_use - p.n, 0)
                         FOR UPDATE SKIP LOCKED) w
                     WHERE p.kind = 'concurrency' AND p.capacity - p.in_use - p.n > 0)
             RETURNING r.id)
         SELECT c.id, c.function_id, c.event_id, c.attempt, c.lease_epoch, c.payload, c.db_now, c.steps,
                (SELECT count(*) FROM parked) + (SELECT count(*) FROM skipped) + (SELECT count(*) FROM woken)
                  + (SELECT count(*) FROM expired) AS moved
           FROM (SELECT 1) AS one LEFT JOIN claimed c ON true",
    )
    .bind(functions)
    .bind(limit)
    .bind(secs(lease))
    .bind(worker_id)
    .bind(secs(crate::flow::PARK_RECHECK))
    .fetch_all(pool)
    .await?;
    let mut moved = 0;
    let mut claimed = Vec::with_capacity(rows.len());
    for row in rows {
        moved = row.try_get("moved")?;
        let Some(id) = row.try_get::<Option<Uuid>, _>("id")? else {
            continue;
        };
        let steps: Value = row.try_get("steps")?;
        let steps = match steps {
            Value::Object(map) => map.into_iter().collect(),
            _ => HashMap::new(),
        };
        claimed.push(ClaimedRun {
            id,
            function_id: row.try_get("function_id")?,
            event_id: row.try_get("event_id")?,
            attempt: row.try_get("attempt")?,
            lease_epoch: row.try_get("lease_epoch")?,
            payload: row.try_get("payload")?,
            steps,
            db_now: row.try_get("db_now")?,
        });
    }
    Ok((claimed, moved))
}

/// How long until the earliest due run of these functions (None: nothing scheduled).
pub(crate) async fn next_due_in(pool: &PgPool, functions: &[String]) -> Result<Option<Duration>, sqlx::Error> {
    let secs: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM min(run_at) - durastep.now())::float8 FROM durastep.runs
          WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at < 'infinity' AND function_id = ANY ($1)",
    )
    .bind(functions)
    .fetch_one(pool)
    .await?;
    Ok(secs.map(|s| Duration::from_secs_f64(s.max(0.0))))
}

/// How many runs of each of these functions are due now and not running (the
/// queue-depth gauge). Functions with none are absent.
pub(crate) async fn count_due_runs(pool: &PgPool, functions: &[String]) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT function_id, count(*) FROM durastep.runs
          WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at <= durastep.now() AND function_id = ANY ($1)
          GROUP BY function_id",
    )
    .bind(functions)
    .fetch_all(pool)
    .await
}

/// Extends the leases of the given (run, epoch) pairs; returns the runs still held.
pub(crate) async fn extend_leases(
    pool: &PgPool,
    held: &[(Uuid, i64)],
    lease: Duration,
) -> Result<Vec<Uuid>, sqlx::Error> {
    let ids: Vec<Uuid> = held.iter().map(|h| h.0).collect();
    let epochs: Vec<i64> = held.iter().map(|h| h.1).collect();
    sqlx::query_scalar(
        "WITH h AS (SELECT * FROM unnest($1::uuid[], $2::bigint[]) AS t(id, epoch)),
         l AS (SELECT r.id FROM durastep.runs r JOIN h ON r.id = h.id AND r.lease_epoch = h.epoch
                WHERE r.state = 'running' ORDER BY r.id FOR NO KEY UPDATE OF r)
         UPDATE durastep.runs r SET lease_expires_at = durastep.now() + make_interval(secs => $3)
           FROM l WHERE r.id = l.id
         RETURNING r.id",
    )
    .bind(&ids)
    .bind(&epochs)
    .bind(secs(lease))
    .fetch_all(pool)
    .await
}

/// Runs whose lease has expired: candidates for the reaper.
pub(crate) async fn find_expired_leases(pool: &PgPool, limit: i64) -> Result<Vec<(Uuid, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, lease_epoch FROM durastep.runs
          WHERE state = 'running' AND lease_expires_at < durastep.now()
          ORDER BY lease_expires_at LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

/// Takes expired runs back, as a compare-and-set on (id, epoch, running, expired):
/// a run that finished or was re-claimed since it was seen is left alone. The
/// lost attempt counts; a run out of attempts is failed.
pub(crate) async fn reap_expired(pool: &PgPool, seen: &[(Uuid, i64)]) -> Result<Vec<(Uuid, String)>, sqlx::Error> {
    let ids: Vec<Uuid> = seen.iter().map(|h| h.0).collect();
    let epochs: Vec<i64> = seen.iter().map(|h| h.1).collect();
    sqlx::query_as(
        "WITH c AS (SELECT * FROM unnest($1::uuid[], $2::bigint[]) AS t(id, epoch)),
         l AS (SELECT r.id FROM durastep.runs r JOIN c ON r.id = c.id AND r.lease_epoch = c.epoch
                WHERE r.state = 'running' AND r.lease_expires_at < durastep.now()
                ORDER BY r.id FOR NO KEY UPDATE OF r SKIP LOCKED)
         UPDATE durastep.runs r
            SET state = CASE WHEN r.attempt >= r.max_attempts THEN 'failed' ELSE 'queued' END,
                attempt = CASE WHEN r.attempt >= r.max_attempts THEN r.attempt ELSE r.attempt + 1 END,
                finished_at = CASE WHEN r.attempt >= r.max_attempts THEN durastep.now() END,
                run_at = durastep.now(), lease_expires_at = NULL, worker_id = NULL,
                last_error = 'lease expired: the worker was lost during attempt ' || r.attempt,
                failed_step = NULL
           FROM l WHERE r.id = l.id
         RETURNING r.id, r.state",
    )
    .bind(&ids)
    .bind(&epochs)
    .fetch_all(pool)
    .await
}

/// Cancels runs past their finish deadline (any unfinished state) or their
/// start deadline (never started), skipping rows others hold; returns how many.
/// A running run's attempt is then fenced like any cancelled run's.
pub(crate) async fn expire_timeouts(pool: &PgPool, limit: i64) -> Result<u64, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(
        "WITH c AS (
             (SELECT id FROM durastep.runs
               WHERE deadline_at < durastep.now() AND state IN ('queued', 'running', 'sleeping', 'waiting')
               LIMIT $1)
             UNION
             (SELECT id FROM durastep.runs
               WHERE start_by < durastep.now() AND started_at IS NULL AND state = 'queued' LIMIT $1)),
         l AS (SELECT r.id FROM durastep.runs r JOIN c ON c.id = r.id
                WHERE r.state IN ('queued', 'running', 'sleeping', 'waiting')
                ORDER BY r.id FOR NO KEY UPDATE OF r SKIP LOCKED),
         u AS (
             UPDATE durastep.runs r
                SET state = 'cancelled', finished_at = durastep.now(), lease_expires_at = NULL, worker_id = NULL,
                    cancel_reason = CASE WHEN r.deadline_at < durastep.now()
                                         THEN 'finish timeout: not finished by ' || r.deadline_at
                                         ELSE 'start timeout: not started by ' || r.start_by END
               FROM l WHERE r.id = l.id
             RETURNING r.id),
         d AS (DELETE FROM durastep.waits w WHERE w.run_id IN (SELECT id FROM u))
         SELECT count(*) FROM u",
    )
    .bind(limit)
    .fetch_one(pool)
    .await?;
    Ok(n as u64)
}

/// When a step ran (database clock, as the attempt knows it) and in which attempt.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepTiming {
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub attempt: i32,
}

/// One pending write of the group commit.
pub(crate) enum PendingWrite {
    /// Store a step result.
    Checkpoint { run_id: Uuid, epoch: i64, key: String, output: String, timing: StepTiming },
    /// Complete the run with its output.
    Complete { run_id: Uuid, epoch: i64, output: String },
}

/// What happened to one pending write.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WriteOutcome {
    /// Stored now.
    Stored,
    /// A result for this step was already stored; here it is (the stored value wins).
    Adopted(Value),
    /// The attempt no longer holds the run: nothing was written.
    Fenced,
}

/// Group commit: stores every pending step result and completion in ONE
/// statement (one transaction), each behind its own fencing check. Safe to
/// repeat after an ambiguous commit: a repeated checkpoint adopts the stored
/// row and a repeated completion is recognised by its epoch.
pub(crate) async fn flush_writes(pool: &PgPool, writes: &[PendingWrite]) -> Result<Vec<WriteOutcome>, sqlx::Error> {
    let (mut cp_run, mut cp_epoch, mut cp_key, mut cp_out) = (vec![], vec![], vec![], vec![]);
    let (mut cp_start, mut cp_end, mut cp_attempt) = (vec![], vec![], vec![]);
    let (mut dn_run, mut dn_epoch, mut dn_out) = (vec![], vec![], vec![]);
    for w in writes {
        match w {
            PendingWrite::Checkpoint { run_id, epoch, key, output, timing } => {
                cp_run.push(*run_id);
                cp_epoch.push(*epoch);
                cp_key.push(key.as_str());
                cp_out.push(output.as_str());
                cp_start.push(timing.started_at);
                cp_end.push(timing.finished_at);
                cp_attempt.push(timing.attempt);
            }
            PendingWrite::Complete { run_id, epoch, output } => {
                dn_run.push(*run_id);
                dn_epoch.push(*epoch);
                dn_out.push(output.as_str());
            }
        }
    }
    let rows: Vec<(i32, i64, bool, bool)> = sqlx::query_as(
        "WITH cp AS (
             SELECT * FROM unnest($1::uuid[], $2::bigint[], $3::text[], $4::text[],
                                  $8::timestamptz[], $9::timestamptz[], $10::int[])
                 WITH ORDINALITY AS t(run_id, epoch, step_key, output, started_at, finished_at, attempt, ord)),
         dn AS (
             SELECT * FROM unnest($5::uuid[], $6::bigint[], $7::text[])
                 WITH ORDINALITY AS t(run_id, epoch, output, ord)),
         l AS (
             SELECT r.id, r.lease_epoch FROM durastep.runs r
              WHERE r.id = ANY ($1::uuid[] || $5::uuid[]) AND r.state = 'running'
              ORDER BY r.id FOR NO KEY UPDATE),
         ins AS (
             INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt)
             SELECT cp.run_id, cp.step_key, cp.output::jsonb, cp.epoch, cp.started_at, cp.finished_at, cp.attempt
               FROM cp JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch
             ON CONFLICT (run_id, step_key) DO NOTHING
             RETURNING run_id, step_key),
         fin AS (
             UPDATE durastep.runs r
                SET state = 'completed', output = dn.output::jsonb, finished_at = durastep.now(),
                    lease_expires_at = NULL, worker_id = NULL
               FROM dn JOIN l ON l.id = dn.run_id AND l.lease_epoch = dn.epoch
              WHERE r.id = dn.run_id
             RETURNING r.id)
         SELECT 0, cp.ord, (l.id IS NOT NULL), (ins.run_id IS NOT NULL)
           FROM cp LEFT JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch
           LEFT JOIN ins ON ins.run_id = cp.run_id AND ins.step_key = cp.step_key
         UNION ALL
         SELECT 1, dn.ord, (fin.id IS NOT NULL), (fin.id IS NOT NULL)
           FROM dn LEFT JOIN fin ON fin.id = dn.run_id",
    )
    .bind(&cp_run)
    .bind(&cp_epoch)
    .bind(&cp_key)
    .bind(&cp_out)
    .bind(&dn_run)
    .bind(&dn_epoch)
    .bind(&dn_out)
    .bind(&cp_start)
    .bind(&cp_end)
    .bind(&cp_attempt)
    .fetch_all(pool)
    .await?;

    let mut cp_result = vec![WriteOutcome::Fenced; cp_run.len()];
    let mut dn_result = vec![WriteOutcome::Fenced; dn_run.len()];
    let mut conflicts = Vec::new();
    let mut unfinished = Vec::new();
    for (kind, ord, live, written) in rows {
        let i = (ord - 1) as usize;
        match (kind, live, written) {
            (0, true, true) => cp_result[i] = WriteOutcome::Stored,
            (0, true, false) => conflicts.push(i),
            (1, _, true) => dn_result[i] = WriteOutcome::Stored,
            (1, _, false) => unfinished.push(i),
            _ => {}
        }
    }
    if !conflicts.is_empty() {
        let runs: Vec<Uuid> = conflicts.iter().map(|&i| cp_run[i]).collect();
        let keys: Vec<&str> = conflicts.iter().map(|&i| cp_key[i]).collect();
        let stored: Vec<(i64, Value)> = sqlx::query_as(
            "SELECT t.ord, s.output
               FROM unnest($1::uuid[], $2::text[]) WITH ORDINALITY AS t(run_id, step_key, ord)
               JOIN durastep.step_results s ON s.run_id = t.run_id AND s.step_key = t.step_key",
        )
        .bind(&runs)
        .bind(&keys)
        .fetch_all(pool)
        .await?;
        for (ord, output) in stored {
            cp_result[conflicts[(ord - 1) as usize]] = WriteOutcome::Adopted(output);
        }
    }
    if !unfinished.is_empty() {
        // A completion that matched nothing: either fenced, or our own earlier
        // commit whose acknowledgement was lost.
        let runs: Vec<Uuid> = unfinished.iter().map(|&i| dn_run[i]).collect();
        let epochs: Vec<i64> = unfinished.iter().map(|&i| dn_epoch[i]).collect();
        let done: Vec<i64> = sqlx::query_scalar(
            "SELECT t.ord FROM unnest($1::uuid[], $2::bigint[]) WITH ORDINALITY AS t(run_id, epoch, ord)
               JOIN durastep.runs r ON r.id = t.run_id AND r.lease_epoch = t.epoch AND r.state = 'completed'",
        )
        .bind(&runs)
        .bind(&epochs)
        .fetch_all(pool)
        .await?;
        for ord in done {
            dn_result[unfinished[(ord - 1) as usize]] = WriteOutcome::Stored;
        }
    }
    let (mut cp_iter, mut dn_iter) = (cp_result.into_iter(), dn_result.into_iter());
    Ok(writes
        .iter()
        .map(|w| match w {
            PendingWrite::Checkpoint { .. } => cp_iter.next(),
            PendingWrite::Complete { .. } => dn_iter.next(),
        })
        .map(|o| o.unwrap_or(WriteOutcome::Fenced))
        .collect())
}

/// The end of a failed attempt: retry after `delay`, or fail the run when it is
/// out of attempts or the failure is permanent. Returns the new state, or None
/// when the attempt no longer holds the run.
///
/// With `pause` (the error named a retry-after delay and the function has a
/// back-pressure rule), the run's back-pressure keys pause until now + `delay`
/// in the same statement, and the retry does not count as an attempt while the
/// run has had fewer than `free_pauses` such retries.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn fail_attempt(
    pool: &PgPool,
    run_id: Uuid,
    epoch: i64,
    error: &str,
    permanent: bool,
    delay: Duration,
    pause: bool,
    free_pauses: i32,
    failed_step: Option<&str>,
) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH u AS (
             UPDATE durastep.runs
                SET state = CASE WHEN $4 OR (attempt >= max_attempts AND NOT ($6 AND pauses < $7))
                                 THEN 'failed' ELSE 'queued' END,
                    finished_at = CASE WHEN $4 OR (attempt >= max_attempts AND NOT ($6 AND pauses < $7))
                                       THEN durastep.now() END,
                    run_at = CASE WHEN $4 OR (attempt >= max_attempts AND NOT ($6 AND pauses < $7)) THEN run_at
                                  ELSE durastep.now() + make_interval(secs => $5) END,
                    attempt = CASE WHEN $4 OR attempt >= max_attempts OR ($6 AND pauses < $7) THEN attempt
                                   ELSE attempt + 1 END,
                    pauses = CASE WHEN NOT $4 AND $6 AND pauses < $7 THEN pauses + 1 ELSE pauses END,
                    last_error = $3, failed_step = $8, lease_expires_at = NULL, worker_id = NULL
              WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
             RETURNING state, function_id, event_id),
         bp AS (
             INSERT INTO durastep.flow_keys AS f (rule, key, paused_until)
             SELECT ff.rule, durastep.flow_key(e.payload, ff.key_path, false, u.function_id, ff.key_pointer),
                    durastep.now() + make_interval(secs => $5)
               FROM u
               JOIN durastep.function_flow ff ON ff.function_id = u.function_id
               JOIN durastep.flow_rules fr ON fr.name = ff.rule AND fr.kind = 'backpressure'
               JOIN durastep.events e ON e.id = u.event_id
              WHERE $6
              ORDER BY 1, 2
             ON CONFLICT (rule, key) DO UPDATE
                SET paused_until = greatest(coalesce(f.paused_until, EXCLUDED.paused_until), EXCLUDED.paused_until))
         SELECT state FROM u",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(error)
    .bind(permanent)
    .bind(secs(delay))
    .bind(pause)
    .bind(free_pauses)
    .bind(failed_step)
    .fetch_optional(pool)
    .await
}

/// Suspends a run until `wake_at` if that is still in the future by the database
/// clock. Returns Some(true) if suspended, Some(false) if already due (the
/// attempt goes on), None if fenced.
pub(crate) async fn suspend_until(
    pool: &PgPool,
    run_id: Uuid,
    epoch: i64,
    wake_at: DateTime<Utc>,
) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar(
        "UPDATE durastep.runs
            SET state = CASE WHEN $3 > durastep.now() THEN 'sleeping' ELSE 'running' END,
                run_at = CASE WHEN $3 > durastep.now() THEN $3 ELSE run_at END,
                lease_expires_at = CASE WHEN $3 > durastep.now() THEN NULL ELSE lease_expires_at END,
                worker_id = CASE WHEN $3 > durastep.now() THEN NULL ELSE worker_id END
          WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
         RETURNING state = 'sleeping'",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(wake_at)
    .fetch_optional(pool)
    .await
}

/// How an invoke went, when it did not leave the parent waiting.
pub(crate) enum InvokeOutcome {
    /// The parent is `waiting` for its child; the attempt ends.
    Suspended,
    /// Resolved: the stored result (the child's outcome, or a timeout record).
    Resolved(Value),
    /// The attempt no longer holds the parent.
    Fenced,
    /// No function has this id.
    UnknownFunction,
}

/// Starts (once) the child run of `function_id` for the parent's step `key`,
/// with `input`, and suspends the parent until the child finishes (the
/// `runs_child_finished` trigger stores the outcome and wakes the parent) or
/// until `timeout_secs` after the child was created (None: no deadline). A
/// child that already exists for this step is reused, never started twice (the
/// unique index `runs_parent`). On timeout the timeout record is stored and
/// the child is cancelled. All in one transaction, fenced on the parent.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn invoke(
    pool: &PgPool,
    run_id: Uuid,
    epoch: i64,
    key: &str,
    function_id: &str,
    input: &str,
    timeout_secs: Option<f64>,
) -> Result<InvokeOutcome, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let live: Option<Option<Value>> = sqlx::query_scalar(
        "WITH l AS (SELECT id FROM durastep.runs WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
                     FOR NO KEY UPDATE)
         SELECT (SELECT s.output FROM durastep.step_results s WHERE s.run_id = $1 AND s.step_key = $3) FROM l",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    match live {
        None => return Ok(InvokeOutcome::Fenced),
        Some(Some(stored)) => {
            tx.commit().await?;
            return Ok(InvokeOutcome::Resolved(stored));
        }
        Some(None) => {}
    }
    sqlx::query(
        "WITH f AS (SELECT id, max_attempts, start_timeout_secs, finish_timeout_secs
                      FROM durastep.functions WHERE id = $3),
         ev AS (
             INSERT INTO durastep.events (id, name, payload, idempotency_key)
             SELECT gen_random_uuid(), 'durastep/invoke:' || f.id, $4::jsonb, $1::text || ':' || $2 FROM f
              WHERE NOT EXISTS (SELECT 1 FROM durastep.runs c WHERE c.parent_run_id = $1 AND c.parent_step_key = $2)
             ON CONFLICT DO NOTHING
             RETURNING id)
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, parent_run_id, parent_step_key,
                                    start_by, deadline_at)
         SELECT gen_random_uuid(), f.id, ev.id, 'queued', durastep.now(), f.max_attempts, $1, $2,
                durastep.now() + make_interval(secs => f.start_timeout_secs),
                durastep.now() + make_interval(secs => f.finish_timeout_secs)
           FROM f, ev",
    )
    .bind(run_id)
    .bind(key)
    .bind(function_id)
    .bind(input)
    .execute(&mut *tx)
    .await?;
    let child: Option<(Uuid, DateTime<Utc>, bool)> = sqlx::query_as(
        "SELECT c.id, d.at, d.at <= durastep.now()
           FROM durastep.runs c,
                LATERAL (SELECT CASE WHEN $3::float8 IS NULL THEN 'infinity'::timestamptz
                                     ELSE c.created_at + make_interval(secs => $3) END AS at) d
          WHERE c.parent_run_id = $1 AND c.parent_step_key = $2",
    )
    .bind(run_id)
    .bind(key)
    .bind(timeout_secs)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((child_id, deadline, due)) = child else {
        return Ok(InvokeOutcome::UnknownFunction);
    };
    if due {
        let stored: Value = sqlx::query_scalar(
            "WITH ins AS (INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
                          VALUES ($1, $2, $3::jsonb, $4) ON CONFLICT DO NOTHING RETURNING output)
             SELECT coalesce((SELECT output FROM ins),
                             (SELECT output FROM durastep.step_results WHERE run_id = $1 AND step_key = $2))",
        )
        .bind(run_id)
        .bind(key)
        .bind(WAIT_TIMED_OUT)
        .bind(epoch)
        .fetch_one(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE durastep.runs SET state = 'cancelled', cancel_reason = 'the parent stopped waiting (invoke timeout)',
                    finished_at = durastep.now(), lease_expires_at = NULL, worker_id = NULL
              WHERE id = $1 AND state NOT IN ('completed', 'failed', 'cancelled')",
        )
        .bind(child_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        return Ok(InvokeOutcome::Resolved(stored));
    }
    // The parent's row is locked by this transaction (the fencing read above).
    sqlx::query(
        "UPDATE durastep.runs SET state = 'waiting', run_at = $2, lease_expires_at = NULL, worker_id = NULL
          WHERE id = $1",
    )
    .bind(run_id)
    .bind(deadline)
    .execute(&mut *tx)
    .await?;
    // The child may be new and due now.
    sqlx::query("SELECT pg_notify('durastep_wakeup', '')").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(InvokeOutcome::Suspended)
}

/// Gives a run back without counting the attempt (graceful shutdown).
pub(crate) async fn release_run(pool: &PgPool, run_id: Uuid, epoch: i64) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "UPDATE durastep.runs SET state = 'queued', run_at = durastep.now(), lease_expires_at = NULL, worker_id = NULL
          WHERE id = $1 AND lease_epoch = $2 AND state = 'running'",
    )
    .bind(run_id)
    .bind(epoch)
    .execute(pool)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// Inside a `step_tx` transaction: locks the run if this attempt still holds it
/// and stores the step result. Returns Ok(None) when stored, Ok(Some(v)) when a
/// result was already stored (the caller rolls back and adopts it), and
/// Err(Fenced) via `None` in the outer option when the attempt lost the run.
pub(crate) async fn checkpoint_in_tx(
    conn: &mut PgConnection,
    run_id: Uuid,
    epoch: i64,
    key: &str,
    output: &str,
    timing: StepTiming,
) -> Result<Option<Option<Value>>, sqlx::Error> {
    let live: Option<i64> = sqlx::query_scalar(
        "SELECT lease_epoch FROM durastep.runs WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
            FOR NO KEY UPDATE",
    )
    .bind(run_id)
    .bind(epoch)
    .fetch_optional(&mut *conn)
    .await?;
    if live.is_none() {
        return Ok(None);
    }
    let inserted = sqlx::query(
        "INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt)
         VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7) ON CONFLICT (run_id, step_key) DO NOTHING",
    )
    .bind(run_id)
    .bind(key)
    .bind(output)
    .bind(epoch)
    .bind(timing.started_at)
    .bind(timing.finished_at)
    .bind(timing.attempt)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(Some(None));
    }
    let stored = load_step(&mut *conn, run_id, key).await?;
    Ok(Some(stored))
}

/// One stored step result.
pub(crate) async fn load_step(conn: &mut PgConnection, run_id: Uuid, key: &str) -> Result<Option<Value>, sqlx::Error> {
    sqlx::query_scalar("SELECT output FROM durastep.step_results WHERE run_id = $1 AND step_key = $2")
        .bind(run_id)
        .bind(key)
        .fetch_optional(conn)
        .await
}

/// A run as the inspection API shows it.
#[derive(sqlx::FromRow)]
pub(crate) struct RunRow {
    pub id: Uuid,
    pub function_id: String,
    pub event_id: Uuid,
    pub state: String,
    pub attempt: i32,
    pub max_attempts: i32,
    pub run_at: DateTime<Utc>,
    pub last_error: Option<String>,
    pub cancel_reason: Option<String>,
    pub output: Option<Value>,
    pub created_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub park_rule: Option<String>,
    pub park_key: Option<String>,
    pub park_kind: Option<String>,
}

/// Loads one run.
pub(crate) async fn load_run(pool: &PgPool, run_id: Uuid) -> Result<Option<RunRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT r.id, r.function_id, r.event_id, r.state, r.attempt, r.max_attempts, r.run_at, r.last_error,
                r.cancel_reason, r.output, r.created_at, r.finished_at,
                CASE WHEN r.state = 'queued' THEN r.park_rule END AS park_rule,
                CASE WHEN r.state = 'queued' THEN r.park_key END AS park_key,
                CASE WHEN r.state = 'queued' THEN fr.kind END AS park_kind
           FROM durastep.runs r LEFT JOIN durastep.flow_rules fr ON fr.name = r.park_rule
          WHERE r.id = $1",
    )
    .bind(run_id)
    .fetch_optional(pool)
    .await
}

/// The database clock, as Durastep sees it (with the test offset).
pub(crate) async fn db_now(pool: &PgPool) -> Result<DateTime<Utc>, sqlx::Error> {
    sqlx::query_scalar("SELECT durastep.now()").fetch_one(pool).await
}

/// Moves the database clock forward (tests only; see `testing`).
pub(crate) async fn advance_clock(pool: &PgPool, by: Duration) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE durastep.clock SET offset_by = offset_by + make_interval(secs => $1)")
        .bind(secs(by))
        .execute(pool)
        .await?;
    Ok(())
}

/// Wakes listening workers (after the test clock moved, say).
pub(crate) async fn notify_workers(pool: &PgPool) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify('durastep_wakeup', '')").execute(pool).await?;
    Ok(())
}
