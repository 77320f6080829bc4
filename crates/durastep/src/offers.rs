//! An idle worker's offer of its free slots to the one-event sends of every
//! process ([`Offers`]), and the runs those sends hand it ([`take_handed`]).
//!
//! A send in the worker's own process hands it its runs in memory
//! (`crate::handoff`). A send in another process finds the worker through
//! its offer row (`durastep.worker_offers`, migration 0036): it inserts the
//! new runs claimed for the worker, as a send of the worker's process would,
//! and names them, with what the worker needs to start them, on the
//! worker's secret channel. The worker starts them (reading them back first
//! only when their event's payload did not fit in the notification),
//! instead of claiming them after the NOTIFY: one round trip and one commit
//! fewer between the send and the first step body (docs/architecture.md
//! "The send hands its run to an idle worker of any process").
//!
//! An offer is good while the worker's listener connection holds the
//! advisory lock the offer names; a send that finds it free deletes the
//! offer instead of handing runs nobody would hear of.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::handoff::{Handoff, Via};
use crate::store::{self, Handled};

/// How long a worker stays busy before it withdraws its offer: a worker
/// that is busy only for a moment (a run handed to it is starting) keeps it.
const WITHDRAW_AFTER: Duration = Duration::from_millis(50);

/// A worker's offer, as its claim loop and its listener see it; written to
/// the database by [`publish_loop`].
pub(crate) struct Offers {
    worker_id: Uuid,
    /// Its secret channel: a hand-over is believed because it arrives there
    /// (anyone connected may NOTIFY a channel they can name; only the roles
    /// that may read `worker_offers` learn this one, docs/security.md).
    channel: String,
    lease: Duration,
    /// The (function, version) pairs of its fast claim: only their runs are handed on.
    functions: Handled,
    /// The advisory lock its listener connection holds (0: not listening,
    /// so no offer: no send could tell it of a run).
    key: AtomicI64,
    /// The free slots its claim loop offers now (0: busy).
    want: AtomicUsize,
    /// The slots its offer row holds, as far as it knows: what it wrote,
    /// less the runs sends handed it since.
    row: AtomicUsize,
    changed: Notify,
}

impl Offers {
    pub(crate) fn new(worker_id: Uuid, lease: Duration, functions: Handled) -> Arc<Offers> {
        Arc::new(Offers {
            worker_id,
            channel: format!("durastep_hand_{}", Uuid::new_v4().simple()),
            lease,
            functions,
            key: AtomicI64::new(0),
            want: AtomicUsize::new(0),
            row: AtomicUsize::new(0),
            changed: Notify::new(),
        })
    }

    /// The channel its listener listens on for the runs handed to it.
    pub(crate) fn channel(&self) -> &str {
        &self.channel
    }

    /// The claim loop offers `slots` free slots (0: none).
    pub(crate) fn set(&self, slots: usize) {
        if self.want.swap(slots, Ordering::AcqRel) != slots {
            self.changed.notify_one();
        }
    }

    /// A new listener connection holds `key`: the offer is written afresh
    /// (a send may have deleted it while no connection held the old key).
    pub(crate) fn listening(&self, key: i64) {
        self.key.store(key, Ordering::Release);
        self.row.store(0, Ordering::Release);
        self.changed.notify_one();
    }

    /// The listener connection is gone: nothing is offered until a new one
    /// holds a key.
    pub(crate) fn not_listening(&self) {
        self.key.store(0, Ordering::Release);
        self.changed.notify_one();
    }

    /// A send took `n` of the offered slots.
    fn taken(&self, n: usize) {
        let _ = self.row.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| Some(r.saturating_sub(n)));
        self.changed.notify_one();
    }
}

/// The worker stops: no more runs are handed to it once this returns (a
/// send that took the offer just before may still; the worker gives such
/// runs back as it gives back runs claimed ahead).
pub(crate) async fn withdraw(pool: &PgPool, offers: &Offers) {
    offers.set(0);
    if let Err(e) = store::withdraw_offer(pool, offers.worker_id).await {
        tracing::debug!(error = %e, "could not withdraw the worker's offer; the first send that finds it deletes it");
    }
}

/// A new advisory lock key for a listener connection (never 0).
pub(crate) fn new_key() -> i64 {
    let (high, _) = Uuid::new_v4().as_u64_pair();
    match i64::from_ne_bytes(high.to_ne_bytes()) {
        0 => 1,
        key => key,
    }
}

/// Keeps the worker's offer row in step with its claim loop until `stop`:
/// written when the worker waits idle and its row holds no slot (sends took
/// them all, or it had none), deleted once it has been busy for
/// [`WITHDRAW_AFTER`], and at the end. A slot count that is only a little
/// off is left alone: a run handed to a worker with no free slot waits for
/// one as a run claimed ahead does, and a send that finds no slot queues
/// its run for the claims.
pub(crate) async fn publish_loop(pool: PgPool, offers: Arc<Offers>, stop: CancellationToken) {
    if offers.functions.ids.is_empty() {
        return;
    }
    let mut failures = 0u32;
    loop {
        let (key, want, row) = (
            offers.key.load(Ordering::Acquire),
            offers.want.load(Ordering::Acquire),
            offers.row.load(Ordering::Acquire),
        );
        let write = if key != 0 && want > 0 && row == 0 {
            Some(want)
        } else if want == 0 && row > 0 {
            // Busy: withdraw unless it is idle again within WITHDRAW_AFTER.
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = offers.changed.notified() => continue,
                _ = tokio::time::sleep(WITHDRAW_AFTER) => Some(0),
            }
        } else {
            None
        };
        let result = match write {
            None => {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = offers.changed.notified() => continue,
                }
            }
            Some(0) => {
                offers.row.store(0, Ordering::Release);
                store::withdraw_offer(&pool, offers.worker_id).await
            }
            Some(slots) => {
                // Counted before the write: a send may take slots as soon as it commits.
                offers.row.store(slots, Ordering::Release);
                let row = store::OfferRow {
                    worker_id: offers.worker_id,
                    functions: &offers.functions,
                    slots,
                    lease: offers.lease,
                    lock_key: key,
                    channel: &offers.channel,
                };
                let written = store::publish_offer(&pool, &row).await;
                if offers.key.load(Ordering::Acquire) != key {
                    // A new listener connection took a new key meanwhile:
                    // this row names the old one, so write it again.
                    offers.row.store(0, Ordering::Release);
                }
                written
            }
        };
        if let Err(e) = result {
            // Tried again: a write that failed leaves the row as if
            // nothing was offered, a delete that failed as if something was.
            offers.row.store(usize::from(write == Some(0)), Ordering::Release);
            failures += 1;
            let backoff = Duration::from_millis(50 * 2u64.pow(failures.min(5))).min(Duration::from_secs(1));
            tracing::warn!(error = %e, ?backoff, "could not write the worker's offer; retrying");
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(backoff) => {}
            }
        } else {
            failures = 0;
        }
    }
    withdraw(&pool, &offers).await;
}

/// How a marker of [`Offers::list_handed`] starts, on the worker's channel
/// (a send's notice is a JSON object).
const MARKER: &str = "listed ";

/// The records of runs handed through the worker's offer, listed by its
/// listener after it connected again, to take once its marker comes back.
pub(crate) struct Listed {
    marker: String,
    records: Vec<store::HandedRecord>,
}

impl Offers {
    /// Lists the records of runs handed through this worker's offer that
    /// are still in the database (`store::offered_records`), after its
    /// listener connected again: a notice it was sent meanwhile or before may
    /// have died with the old connection. None when there is none, or the
    /// list failed (their runs then wait for their leases, as before).
    pub(crate) async fn list_handed(&self, listener: &mut PgListener) -> Option<Listed> {
        let marker = format!("{MARKER}{}", Uuid::new_v4().simple());
        match store::offered_records(listener, self.worker_id, &self.channel, &marker).await {
            Ok(records) if records.is_empty() => None,
            Ok(records) => Some(Listed { marker, records }),
            Err(e) => {
                tracing::warn!(error = %e, "could not list the runs handed to this worker; a lost notice's runs wait for their leases");
                None
            }
        }
    }
}

/// What the listener read on the worker's channel: a send's notice of runs
/// it handed on, or the marker of its own list (`listed`), which says that
/// every notice of a listed record that reached the listener has been read.
/// A record is taken once: by its notice, or, if that never came, from the
/// list. Anything else is ignored.
pub(crate) fn heard(
    pool: &PgPool,
    offers: &Arc<Offers>,
    handoff: &Arc<Handoff>,
    listed: &mut Option<Listed>,
    payload: &str,
) {
    if is_marker(payload) {
        let Some(found) = listed.take_if(|l| l.marker == payload) else {
            // An earlier connection's list: a new one was made since.
            return;
        };
        for record in found.records {
            if handoff.records().hear(record.claim) {
                tokio::spawn(take_found(pool.clone(), offers.clone(), handoff.clone(), record));
            }
        }
        return;
    }
    let Some(notice) = store::HandNotice::parse(payload) else {
        tracing::warn!(payload, "a hand-over this worker cannot read; ignored");
        return;
    };
    if handoff.records().hear(notice.claim()) {
        tokio::spawn(take_handed(pool.clone(), offers.clone(), handoff.clone(), notice));
    } else {
        tracing::debug!(claim = notice.claim(), "a hand-over already taken from the list of a reconnect");
    }
}

/// Whether `payload` on the worker's channel is a marker of its own list.
pub(crate) fn is_marker(payload: &str) -> bool {
    payload.starts_with(MARKER)
}

/// The runs a send handed to this worker, named in its notice on the
/// worker's channel, handed to its claim loop. Their leases run from the
/// send's commit: a run read back counts from what was left of its lease
/// then; a run taken from the notice from its arrival, less a tenth of the
/// lease for the notice's way (the heartbeat extends a lease long before
/// that matters, and a lapsed lease is fenced in the database, not here). A
/// run no longer running for this worker under that epoch starts nothing
/// (its lease then lapses, and a reaper takes it back). The listener has
/// noted the notice's record as heard (`EndedClaims::hear`).
pub(crate) async fn take_handed(pool: PgPool, offers: Arc<Offers>, handoff: Arc<Handoff>, notice: store::HandNotice) {
    offers.taken(notice.len());
    let claim = notice.claim();
    let received = Instant::now();
    let handed = store::handed_runs(&pool, offers.worker_id, notice).await;
    deliver(&pool, &offers, &handoff, claim, handed, received).await;
}

/// The runs of a record handed to this worker through its offer whose notice
/// its listener never read (the connection died with it, or before it came),
/// found after the listener connected again (`store::offered_records`): those
/// still running for this worker are read back and started as a notice's are.
/// The listener has noted the record as heard.
pub(crate) async fn take_found(pool: PgPool, offers: Arc<Offers>, handoff: Arc<Handoff>, record: store::HandedRecord) {
    let received = Instant::now();
    let handed = store::read_handed(&pool, offers.worker_id, &record).await;
    crate::failpoint!("found-before-start");
    if let Ok(runs) = &handed
        && !runs.is_empty()
    {
        // Handed to the claim loop, which starts them, or gives back those
        // it has no free slot for (as any run taken through an offer).
        tracing::info!(
            claim = record.claim,
            runs = runs.len(),
            "found runs handed on through a notice this worker never read"
        );
    }
    deliver(&pool, &offers, &handoff, record.claim, handed, received).await;
}

async fn deliver(
    pool: &PgPool,
    offers: &Offers,
    handoff: &Handoff,
    claim: i64,
    handed: Result<Vec<store::HandedRun>, sqlx::Error>,
    received: Instant,
) {
    match handed {
        Ok(handed) if !handed.is_empty() => {
            let used = handed
                .iter()
                .map(|h| h.lease_left.map_or(offers.lease / 10, |left| offers.lease.saturating_sub(left)))
                .max()
                .unwrap_or_default();
            let sent = received.checked_sub(used).unwrap_or(received);
            handoff.deliver(pool, handed.into_iter().map(|h| h.run).collect(), sent, Via::Offer).await;
        }
        // Nothing of it runs here: a later reconnect may look at it again.
        Ok(_) => handoff.records().forget(claim),
        Err(e) => {
            handoff.records().forget(claim);
            tracing::warn!(error = %e, "could not read the runs handed to this worker; their leases will lapse");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_never_zero() {
        assert!((0..100).all(|_| new_key() != 0));
    }
}
