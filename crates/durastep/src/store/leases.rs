//! Leases: the heartbeat's extension, the reaper's takeover of expired
//! leases, start and finish timeouts, and the end of a cancelled attempt.

use std::time::Duration;

use sqlx::PgPool;
use uuid::Uuid;

use super::{Fence, secs};
use crate::RunState;

/// Extends the leases of the attempts `held` (fenced: a run claimed again
/// since, or no longer running, is not extended). Returns the runs still
/// held, each with whether its lease was extended (`false`: its row is locked
/// by another transaction, so it was skipped, not waited for: one contended
/// row cannot hold up the heartbeat of every other run).
pub(crate) async fn extend_leases(
    pool: &PgPool,
    held: &[Fence],
    lease: Duration,
) -> Result<Vec<(Uuid, bool)>, sqlx::Error> {
    let ids: Vec<Uuid> = held.iter().map(Fence::run_id).collect();
    let epochs: Vec<i64> = held.iter().map(Fence::epoch).collect();
    sqlx::query_as(
        "WITH h AS (SELECT * FROM unnest($1::uuid[], $2::bigint[]) AS t(id, epoch)),
         l AS (SELECT r.id FROM durastep.runs r JOIN h ON r.id = h.id AND r.lease_epoch = h.epoch
                WHERE r.state = 'running' ORDER BY r.id FOR NO KEY UPDATE OF r SKIP LOCKED),
         u AS (UPDATE durastep.runs r SET lease_expires_at = durastep.now() + make_interval(secs => $3)
                 FROM l WHERE r.id = l.id
               RETURNING r.id)
         SELECT r.id, EXISTS (SELECT 1 FROM u WHERE u.id = r.id)
           FROM durastep.runs r JOIN h ON r.id = h.id AND r.lease_epoch = h.epoch
          WHERE r.state = 'running'",
    )
    .bind(&ids)
    .bind(&epochs)
    .bind(secs(lease))
    .fetch_all(pool)
    .await
}

/// Runs whose lease has expired: candidates for the reaper, found through
/// the claim records whose leases could have lapsed (`run_claims`, migration
/// 0034; `sql/find_expired_leases.sql`). Tidies each record it reads: a
/// record with no run still running under its epoch is deleted, the others
/// keep only those runs and are looked at again when their first lease can
/// lapse.
pub(crate) async fn find_expired_leases(pool: &PgPool, limit: i64) -> Result<Vec<(Uuid, i64)>, sqlx::Error> {
    sqlx::query_as(include_str!("sql/find_expired_leases.sql")).bind(limit).bind(CLAIMS_PER_PASS).fetch_all(pool).await
}

/// How many claim records one reaper pass reads at most.
const CLAIMS_PER_PASS: i64 = 1000;

/// Deletes the claim records `claims` of which no run is still running under
/// the epoch the claim gave it: the worker calls it once it has stored the
/// end of every attempt a claim started. A record with a run still running
/// (an end that was not stored) is kept
/// for the reaper. Returns how many were deleted.
pub(crate) async fn drop_claims(pool: &PgPool, claims: &[i64]) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(concat!(
        "DELETE FROM durastep.run_claims c
          WHERE c.id = ANY ($1) AND NOT EXISTS (SELECT 1 FROM ",
        running_runs!(),
        " AND rc.id = c.id)"
    ))
    .bind(claims)
    .execute(pool)
    .await?;
    Ok(r.rows_affected())
}

/// Takes expired runs back, as a compare-and-set on (id, epoch, running, expired):
/// a run that finished or was re-claimed since it was seen is left alone. A
/// lost lease is not the handler's failure: it does not spend the function's
/// retries but its own budget (`lease_losses` against the function's
/// `max_lease_losses`); a run over that budget is failed. The next execution
/// gets the next attempt number.
pub(crate) async fn reap_expired(pool: &PgPool, seen: &[(Uuid, i64)]) -> Result<Vec<(Uuid, RunState)>, sqlx::Error> {
    let ids: Vec<Uuid> = seen.iter().map(|h| h.0).collect();
    let epochs: Vec<i64> = seen.iter().map(|h| h.1).collect();
    sqlx::query_as(include_str!("sql/reap_expired.sql")).bind(&ids).bind(&epochs).fetch_all(pool).await
}

/// Cancels runs past their finish deadline (any unfinished state) or their
/// start deadline (never started), skipping rows others hold; returns how many.
/// A running run's attempt is then fenced like any cancelled run's, and keeps
/// its slots until it has stopped (see [`cancel_run`]).
pub(crate) async fn expire_timeouts(pool: &PgPool, limit: i64) -> Result<u64, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(include_str!("sql/expire_timeouts.sql")).bind(limit).fetch_one(pool).await?;
    Ok(n as u64)
}

/// Ends a cancelled attempt once its worker has stopped its handler: clears
/// the run's `worker_id` and lease, which gives back its concurrency slots (the
/// `release_flow` trigger). Matches only the cancelled run of this attempt
/// whose slots are still held; returns whether it did.
pub(crate) async fn end_cancelled_attempt(pool: &PgPool, fence: Fence) -> Result<bool, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    let r = sqlx::query(
        "UPDATE durastep.runs
            SET worker_id = NULL, lease_expires_at = NULL,
                run_at = CASE WHEN state = 'queued' THEN durastep.now() ELSE run_at END
          WHERE id = $1 AND lease_epoch = $2 AND state IN ('cancelled', 'queued') AND worker_id IS NOT NULL",
    )
    .bind(run_id)
    .bind(epoch)
    .execute(pool)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// The reaper's part of [`end_cancelled_attempt`]: cancelled attempts whose
/// lease has lapsed (their worker is gone or stalled, and so is their body, as
/// far as any lease can tell) give back their slots. Skips rows others hold;
/// returns how many.
pub(crate) async fn release_lapsed_cancels(pool: &PgPool, limit: i64) -> Result<u64, sqlx::Error> {
    let r = sqlx::query(include_str!("sql/release_lapsed_cancels.sql")).bind(limit).execute(pool).await?;
    Ok(r.rows_affected())
}
