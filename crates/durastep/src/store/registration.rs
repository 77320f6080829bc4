//! Registration: what an engine declares at start (functions, flow rules,
//! cron schedules), upserted so that concurrent starts cannot deadlock.

use sqlx::PgPool;

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
    /// Lost leases a run survives before it fails.
    pub max_lease_losses: i32,
    /// The version new runs start under (the newest the engine registers).
    pub version: i32,
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
    let lease_losses: Vec<i32> = rows.iter().map(|r| r.max_lease_losses).collect();
    let versions: Vec<i32> = rows.iter().map(|r| r.version).collect();
    sqlx::query(
        "INSERT INTO durastep.functions (id, triggers, max_attempts, has_on_failure, cancel_on,
                                         start_timeout_secs, finish_timeout_secs, max_lease_losses, version,
                                         updated_at)
         SELECT t.id, ARRAY(SELECT jsonb_array_elements_text(t.triggers::jsonb)), t.attempts, t.on_failure,
                t.cancel_on::jsonb, t.start_timeout, t.finish_timeout, t.lease_losses, t.version, now()
           FROM unnest($1::text[], $2::text[], $3::int[], $4::bool[], $5::text[], $6::float8[], $7::float8[],
                       $8::int[], $9::int[])
                AS t(id, triggers, attempts, on_failure, cancel_on, start_timeout, finish_timeout, lease_losses,
                     version)
         ON CONFLICT (id) DO UPDATE
            SET triggers = EXCLUDED.triggers, max_attempts = EXCLUDED.max_attempts,
                has_on_failure = EXCLUDED.has_on_failure, cancel_on = EXCLUDED.cancel_on,
                start_timeout_secs = EXCLUDED.start_timeout_secs,
                finish_timeout_secs = EXCLUDED.finish_timeout_secs,
                max_lease_losses = EXCLUDED.max_lease_losses, version = EXCLUDED.version, updated_at = now()",
    )
    .bind(&ids)
    .bind(&triggers)
    .bind(&attempts)
    .bind(&on_failure)
    .bind(&cancel_on)
    .bind(&start_timeouts)
    .bind(&finish_timeouts)
    .bind(&lease_losses)
    .bind(&versions)
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
    let o_pmin: Vec<i32> = o.iter().map(|(_, x)| *x.priority_range.start()).collect();
    let o_pmax: Vec<i32> = o.iter().map(|(_, x)| *x.priority_range.end()).collect();

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
                    debounce_path, singleton_mode, singleton_pointer, singleton_path, priority_pointer, priority_path,
                    priority_min, priority_max)
         SELECT f, ds, dm, dp,
                CASE WHEN dj IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text(dj::jsonb)) END,
                sm, sp,
                CASE WHEN sj IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text(sj::jsonb)) END,
                pp,
                CASE WHEN pj IS NULL THEN NULL ELSE ARRAY(SELECT jsonb_array_elements_text(pj::jsonb)) END,
                plo, phi
           FROM unnest($1::text[], $2::float8[], $3::float8[], $4::text[], $5::text[], $6::text[], $7::text[],
                       $8::text[], $9::text[], $10::text[], $11::int[], $12::int[])
                AS t(f, ds, dm, dp, dj, sm, sp, sj, pp, pj, plo, phi)",
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
    .bind(&o_pmin)
    .bind(&o_pmax)
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
