//! The worker's part in keeping the claim records (`durastep.run_claims`,
//! migration 0034) small: each claim statement writes one record of the
//! attempts it started, which is how the reaper finds a lapsed lease. The
//! worker counts down, per record, the attempts whose end it has stored and
//! the runs it gave back unstarted (queued again, they are listed by their
//! next claim's record), and deletes a record once none is left, in small
//! batches off the hot path. What it misses (an end or a give-back that was
//! not stored, a worker that died) the reaper deletes when the record's
//! first lease has passed.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::store::{self, ClaimedRun};

/// The records whose attempts have all ended here, to delete; and the
/// records of runs handed through the worker's offer that it has heard of
/// and not yet ended.
#[derive(Default)]
pub(crate) struct EndedClaims {
    ids: Mutex<Vec<i64>>,
    notify: Notify,
    /// Heard of by their notice, or found after the listener connected again
    /// (`crate::offers`): a record in here is not started a second time. It
    /// leaves when its tally ends, after its runs' ends or give-backs are
    /// stored, so a record found later lists no run still running here.
    heard: Mutex<HashSet<i64>>,
}

impl EndedClaims {
    fn push(&self, id: i64) {
        self.forget(id);
        self.ids.lock().unwrap_or_else(|p| p.into_inner()).push(id);
        self.notify.notify_one();
    }

    /// Notes that the worker takes the runs of the handed record `id`:
    /// false when it already did.
    pub(crate) fn hear(&self, id: i64) -> bool {
        self.heard.lock().unwrap_or_else(|p| p.into_inner()).insert(id)
    }

    /// The handed record `id` started no run here (none was still running
    /// for this worker, or reading them failed).
    pub(crate) fn forget(&self, id: i64) {
        self.heard.lock().unwrap_or_else(|p| p.into_inner()).remove(&id);
    }

    fn take(&self) -> Vec<i64> {
        std::mem::take(&mut *self.ids.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// One claim record, shared by the attempts it started: how many of them
/// have not yet stored their end.
pub(crate) struct ClaimTally {
    id: i64,
    left: AtomicUsize,
    ended: Arc<EndedClaims>,
}

impl ClaimTally {
    /// One attempt of this claim has stored its end, or one of its runs was
    /// given back; the last one queues the record for deletion.
    pub(crate) fn end(&self) {
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.ended.push(self.id);
        }
    }
}

/// The tally of the record of `claimed`, the runs of one claim statement or
/// handing send (one record lists them all; None when it started none).
pub(crate) fn tally(claimed: &[ClaimedRun], ended: &Arc<EndedClaims>) -> Option<Arc<ClaimTally>> {
    let id = claimed.first()?.claim;
    debug_assert!(claimed.iter().all(|r| r.claim == id), "one record per claim statement");
    Some(Arc::new(ClaimTally { id, left: AtomicUsize::new(claimed.len()), ended: ended.clone() }))
}

/// How long the sweeper gathers ended records before it deletes them: one
/// statement per this interval at most, however fast claims end.
const GATHER: Duration = Duration::from_millis(20);

/// Deletes the ended records as they come, until `stop`; then once more.
pub(crate) async fn sweep_loop(pool: PgPool, ended: Arc<EndedClaims>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = ended.notify.notified() => {}
            _ = stop.cancelled() => {
                sweep(&pool, &ended).await;
                return;
            }
        }
        tokio::time::sleep(GATHER).await;
        sweep(&pool, &ended).await;
    }
}

async fn sweep(pool: &PgPool, ended: &EndedClaims) {
    let ids = ended.take();
    if ids.is_empty() {
        return;
    }
    if let Err(e) = store::drop_claims(pool, &ids).await {
        // The reaper deletes them once their first lease has passed.
        tracing::debug!(error = %e, records = ids.len(), "could not delete ended claim records");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handed_record_is_heard_once_until_its_tally_ends() {
        let ended = Arc::new(EndedClaims::default());
        assert!(ended.hear(7));
        assert!(!ended.hear(7), "a record taken twice");
        let tally = ClaimTally { id: 7, left: AtomicUsize::new(2), ended: ended.clone() };
        tally.end();
        assert!(!ended.hear(7), "forgotten while one of its runs still runs");
        tally.end();
        assert_eq!(ended.take(), [7], "queued for deletion once both ended");
        assert!(ended.hear(7), "still noted after its tally ended");
        ended.forget(7);
        assert!(ended.hear(7), "still noted after it was forgotten");
    }
}
