//! The statements of the test kit (`crate::testing`) only.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::{notify_workers, secs};

/// Moves the database clock forward (tests only; see `testing`).
#[cfg(feature = "testing")]
pub(crate) async fn advance_clock(pool: &PgPool, by: Duration) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE durastep.clock SET offset_by = offset_by + make_interval(secs => $1)")
        .bind(secs(by))
        .execute(pool)
        .await?;
    Ok(())
}

/// Sets the test clock's offset so that `durastep.now()` reads `at` now.
#[cfg(feature = "testing")]
pub(crate) async fn set_clock(pool: &PgPool, at: DateTime<Utc>) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE durastep.clock SET offset_by = $1::timestamptz - now()").bind(at).execute(pool).await?;
    Ok(())
}

/// Creates a database (the test kit's fresh one). `name` is generated, never user input.
#[cfg(feature = "testing")]
pub(crate) async fn create_database(pool: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    let sql = format!("CREATE DATABASE \"{name}\"");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await?;
    Ok(())
}

/// Drops a database created by [`create_database`].
#[cfg(feature = "testing")]
pub(crate) async fn drop_database(pool: &PgPool, name: &str) -> Result<(), sqlx::Error> {
    let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(pool).await?;
    Ok(())
}

/// Starts a run of a function with an input, under a given id, whatever
/// triggers the function (the test kit's `start`). False: no such function.
#[cfg(feature = "testing")]
pub(crate) async fn start_run(pool: &PgPool, id: Uuid, function_id: &str, input: &Value) -> Result<bool, sqlx::Error> {
    let r = sqlx::query(
        "WITH f AS (SELECT id, max_attempts, start_timeout_secs, finish_timeout_secs, version
                      FROM durastep.functions WHERE id = $2),
         ev AS (INSERT INTO durastep.events (id, name, payload)
                SELECT durastep.uuid7(), 'durastep/test:' || f.id, $3 FROM f RETURNING id)
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, start_by, deadline_at,
                                    version)
         SELECT $1, f.id, ev.id, 'queued', durastep.now(), f.max_attempts,
                durastep.now() + make_interval(secs => f.start_timeout_secs),
                durastep.now() + make_interval(secs => f.finish_timeout_secs), f.version
           FROM f, ev",
    )
    .bind(id)
    .bind(function_id)
    .bind(input)
    .execute(pool)
    .await?;
    notify_workers(pool).await?;
    Ok(r.rows_affected() == 1)
}

/// Runs that are running or due now (the test kit's idleness check).
#[cfg(feature = "testing")]
pub(crate) async fn busy_runs(pool: &PgPool) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(concat!(
        "SELECT (SELECT count(*) FROM ",
        running_runs!(),
        ") + (SELECT count(*) FROM durastep.run_queue
                  WHERE state IN ('queued', 'sleeping') AND run_at <= durastep.now())"
    ))
    .fetch_one(pool)
    .await
}

/// When a run is next due (its run_at, or a wait's deadline), if it is not finished.
#[cfg(feature = "testing")]
pub(crate) async fn run_due_at(pool: &PgPool, run_id: Uuid) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    let at: Option<Option<DateTime<Utc>>> = sqlx::query_scalar(
        "SELECT CASE WHEN r.state = 'waiting'
                     THEN (SELECT min(w.expires_at) FROM durastep.waits w WHERE w.run_id = r.id)
                     WHEN r.state IN ('queued', 'sleeping') THEN r.run_at END
           FROM durastep.runs r WHERE r.id = $1",
    )
    .bind(run_id)
    .fetch_optional(pool)
    .await?;
    Ok(at.flatten())
}

/// The events a run sent with send_event: (step key, name, data), in journal order.
#[cfg(feature = "testing")]
pub(crate) async fn sent_events(pool: &PgPool, run_id: Uuid) -> Result<Vec<(String, String, Value)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT j.step_key, e.name, e.payload
           FROM durastep.run_journal j
           JOIN durastep.step_results s ON s.run_id = j.run_id AND s.step_key = j.step_key
           JOIN durastep.events e ON e.id::text = s.output->>'event_id'
          WHERE j.run_id = $1 AND j.kind = 'send_event'
          ORDER BY j.position",
    )
    .bind(run_id)
    .fetch_all(pool)
    .await
}

/// The child runs of a run, by creation.
#[cfg(feature = "testing")]
pub(crate) async fn child_run_ids(pool: &PgPool, run_id: Uuid) -> Result<Vec<Uuid>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM durastep.runs WHERE parent_run_id = $1 ORDER BY created_at, id")
        .bind(run_id)
        .fetch_all(pool)
        .await
}
