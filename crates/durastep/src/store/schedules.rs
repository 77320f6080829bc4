//! Cron ticks: the due schedules of this worker's functions, locked for a
//! tick, and the record of a tick.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

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
