//! An idle worker's offer of its free slots to the one-event sends of every
//! process (`durastep.worker_offers`, migration 0036): the send claims its
//! new runs for the worker and names them on the worker's secret channel;
//! the worker starts them without a claim of its own.

use std::time::Duration;

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use uuid::Uuid;

use super::claim::{HandedRecord, Handled};
use super::secs;

/// Takes the advisory lock `key` on the listener's connection, for as long as
/// that connection lives: while it is held, the offers that name `key` are
/// good (a send that could take it would find a worker that no longer hears).
pub(crate) async fn hold_listener_key(listener: &mut PgListener, key: i64) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_advisory_lock($1)").bind(key).execute(listener).await?;
    Ok(())
}

/// What an idle worker offers.
pub(crate) struct OfferRow<'a> {
    pub worker_id: Uuid,
    pub functions: &'a Handled,
    pub slots: usize,
    pub lease: Duration,
    /// The key its listener connection holds now.
    pub lock_key: i64,
    /// Its secret channel, on which a send names the runs it handed on (a
    /// [`HandNotice`](super::HandNotice)).
    pub channel: &'a str,
}

/// Writes (or replaces) the worker's offer.
pub(crate) async fn publish_offer(pool: &PgPool, offer: &OfferRow<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO durastep.worker_offers (worker_id, version_ids, versions, slots, lease_s, lock_key, channel)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (worker_id) DO UPDATE
            SET version_ids = EXCLUDED.version_ids, versions = EXCLUDED.versions, slots = EXCLUDED.slots,
                lease_s = EXCLUDED.lease_s, lock_key = EXCLUDED.lock_key, channel = EXCLUDED.channel,
                offered_at = now()",
    )
    .bind(offer.worker_id)
    .bind(&offer.functions.version_ids)
    .bind(&offer.functions.versions)
    .bind(i32::try_from(offer.slots).unwrap_or(i32::MAX))
    .bind(secs(offer.lease))
    .bind(offer.lock_key)
    .bind(offer.channel)
    .execute(pool)
    .await?;
    Ok(())
}

/// Withdraws the worker's offer (it is busy, or stopping).
pub(crate) async fn withdraw_offer(pool: &PgPool, worker_id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query("DELETE FROM durastep.worker_offers WHERE worker_id = $1").bind(worker_id).execute(pool).await?;
    Ok(())
}

/// The claim records of the runs sends handed to `worker_id` through its
/// offer (migration 0037), listed on the listener's own connection after it
/// connected again (no wait for the pool); in the same statement, if it found
/// any, `marker` on the worker's channel. Postgres delivers notifications in
/// the order their transactions commit, so once the listener reads the
/// marker it has read every notice of these records that reached it: a
/// record it has not heard of by then lost its notice.
pub(crate) async fn offered_records(
    listener: &mut PgListener,
    worker_id: Uuid,
    channel: &str,
    marker: &str,
) -> Result<Vec<HandedRecord>, sqlx::Error> {
    let records = sqlx::query_as::<_, (i64, Vec<Uuid>, Vec<i64>)>(
        "WITH listed AS MATERIALIZED (
              SELECT id, run_ids, epochs FROM durastep.run_claims WHERE offered_to = $1),
              marked AS MATERIALIZED (SELECT pg_notify($2, $3) FROM listed LIMIT 1)
         SELECT l.id, l.run_ids, l.epochs FROM listed l, (SELECT count(*) FROM marked) m",
    )
    .bind(worker_id)
    .bind(channel)
    .bind(marker)
    .fetch_all(listener)
    .await?;
    Ok(records.into_iter().map(|(claim, ids, epochs)| HandedRecord { claim, ids, epochs }).collect())
}
