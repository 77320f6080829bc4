//! How the sends of a process reach the workers of the same process
//! ([`LocalWorkers`]): a send wakes them itself, before its NOTIFY arrives,
//! and a one-event send hands the runs it claimed for an idle one
//! ([`Offer`]). Also the worker's functions by claim class
//! ([`ClaimClasses`]), which say which classes a wake-up is for.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::claim_records::{self, ClaimTally, EndedClaims};
use crate::store::{self, ClaimedRun};

/// The workers that run in this process, for the sends made through the
/// same engine. A send that made a run due wakes them as soon as it has
/// committed, instead of through the NOTIFY that Postgres delivers to their
/// listener connection one hop later (which still comes, and still wakes the
/// workers of other processes). And a one-event send, while one of them
/// waits idle with nothing due, claims its new runs for that worker in its
/// own statement and hands them over: the worker starts them without a claim
/// of its own (docs/architecture.md "The send hands its run to a worker of
/// its own process").
#[derive(Default)]
pub(crate) struct LocalWorkers(std::sync::Mutex<Vec<std::sync::Weak<Handoff>>>);

impl LocalWorkers {
    /// Adds a worker; it is forgotten once the worker has ended.
    pub(crate) fn register(&self, handoff: &Arc<Handoff>) {
        let mut workers = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        workers.retain(|w| w.strong_count() > 0);
        workers.push(Arc::downgrade(handoff));
    }

    /// Wakes the workers of this process that run one of `functions`, for
    /// the classes that run them (a wake-up while a worker claims is kept
    /// for its next wait, as a NOTIFY's is).
    pub(crate) fn wake(&self, functions: &[&str]) {
        let workers = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for worker in workers.iter().filter_map(std::sync::Weak::upgrade) {
            worker.wake.classes(worker.functions.woken_by_ids(functions.iter().copied()));
        }
    }

    /// Whether a worker of this process runs one of `functions`: a send of
    /// this process then leaves their runs to it (handed in memory when it
    /// waits idle, else queued, and it is woken), never to another process's
    /// worker through an offer, whose row lags behind the worker's own count.
    pub(crate) fn run_any(&self, functions: &[&str]) -> bool {
        let workers = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        workers
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .any(|w| w.functions.woken_by_ids(functions.iter().copied()) != [false, false])
    }

    /// A worker of this process that waits idle with nothing due, with the
    /// slots it offers taken (a second send finds them gone until the worker
    /// offers again): the send may claim up to that many runs for it.
    pub(crate) fn take_offer(&self) -> Option<Offer> {
        let workers = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        workers.iter().filter_map(std::sync::Weak::upgrade).find_map(|handoff| {
            let slots = handoff.open.swap(0, Ordering::AcqRel);
            (slots > 0).then_some(Offer { handoff, slots })
        })
    }
}

/// How the sends of its process reach a worker: its wake-up, and the runs
/// they claimed for it.
pub(crate) struct Handoff {
    wake: Arc<Wake>,
    worker_id: Uuid,
    lease: Duration,
    /// Its functions by claim class: a send of its process wakes the classes
    /// of the functions it triggers, and hands on runs of the fast class only.
    functions: Arc<ClaimClasses>,
    /// Free slots it offers: set while it waits with nothing due and nothing
    /// claimed, 0 otherwise.
    open: AtomicUsize,
    runs: tokio::sync::mpsc::UnboundedSender<Handed>,
    /// The worker's ended claim records: a send's record is counted down as
    /// the worker's claims' are (migration 0035).
    ended: Arc<EndedClaims>,
}

impl Handoff {
    /// A worker's hand-off, offering no slots yet, with the receiving end of
    /// the runs sends will hand it.
    pub(crate) fn new(
        wake: Arc<Wake>,
        worker_id: Uuid,
        lease: Duration,
        functions: Arc<ClaimClasses>,
        ended: Arc<EndedClaims>,
    ) -> (Arc<Handoff>, tokio::sync::mpsc::UnboundedReceiver<Handed>) {
        let (runs, handed) = tokio::sync::mpsc::unbounded_channel();
        (Arc::new(Handoff { wake, worker_id, lease, functions, open: AtomicUsize::new(0), runs, ended }), handed)
    }

    /// Offers `slots` free slots to the sends of the process (0: none).
    pub(crate) fn offer(&self, slots: usize) {
        self.open.store(slots, Ordering::Release);
    }

    /// The worker's claim records, by which it tells a handed record it has
    /// taken from one it has not (`EndedClaims::hear`).
    pub(crate) fn records(&self) -> &EndedClaims {
        &self.ended
    }
}

/// A worker's wake-up: it ends the claim loop's wait, for the classes of
/// functions (index `class(fast)`) it was given. A NOTIFY whose payload names
/// functions (migrations 0027, 0028), and a send of its own process, wake only
/// the classes that run one of them; an empty payload and a reconnect of the
/// listener wake both. Every wake-up marks the classes it is for.
#[derive(Default)]
pub(crate) struct Wake {
    pub(crate) notify: Notify,
    /// The classes woken since the claim loop last took them.
    classes: [AtomicBool; 2],
}

impl Wake {
    /// Wakes the claim loop for `classes` (nothing, for no class). A wake-up
    /// while the loop claims is kept for its next wait.
    pub(crate) fn classes(&self, classes: [bool; 2]) {
        if classes == [false, false] {
            return;
        }
        for (woken, wake) in self.classes.iter().zip(classes) {
            if wake {
                woken.store(true, Ordering::Release);
            }
        }
        self.notify.notify_one();
    }

    /// The classes woken since the last call. None when the marks of this
    /// notification were taken with an earlier one's (a wake-up marks its
    /// classes before it notifies): it was served then.
    pub(crate) fn take(&self) -> [bool; 2] {
        self.classes.each_ref().map(|woken| woken.swap(false, Ordering::AcqRel))
    }
}

/// A run claimed for a worker by a send.
pub(crate) struct Handed {
    pub(crate) run: ClaimedRun,
    /// How the send found the worker.
    pub(crate) via: Via,
    /// Before the send went out: the lease counts from there.
    pub(crate) sent: Instant,
    pub(crate) received: Instant,
    /// The tally of the send's claim record, shared by the runs it handed on.
    pub(crate) tally: Option<Arc<ClaimTally>>,
}

/// How a send found the worker it handed its runs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Via {
    /// Its offer in memory, taken by a send of its process: exact, since the
    /// send takes the slots as it takes the offer.
    Process,
    /// Its offer row, taken by a send of any process (`crate::offers`): the
    /// row may still offer slots the worker has filled since, so a run it
    /// has no free slot for is given back at once.
    Offer,
}

/// Slots an idle worker offered, taken by one send.
pub(crate) struct Offer {
    handoff: Arc<Handoff>,
    slots: usize,
}

impl Offer {
    /// The claim the send makes for the worker.
    pub(crate) fn to(&self) -> store::HandTo<'_> {
        let h = &self.handoff;
        store::HandTo { worker_id: h.worker_id, lease: h.lease, functions: &h.functions.fast, slots: self.slots }
    }

    /// Hands the runs the send claimed to the worker.
    pub(crate) async fn hand_over(self, pool: &PgPool, runs: Vec<ClaimedRun>, sent: Instant) {
        self.handoff.deliver(pool, runs, sent, Via::Process).await;
    }
}

impl Handoff {
    /// Gives the worker runs a send claimed for it (of this process, or of
    /// another one through its offer, `crate::offers`), all listed in one
    /// claim record; their leases count from `sent`. A run it can no longer
    /// take (it stopped meanwhile) is released at once, keeping its place.
    pub(crate) async fn deliver(&self, pool: &PgPool, runs: Vec<ClaimedRun>, sent: Instant, via: Via) {
        let received = Instant::now();
        let tally = claim_records::tally(&runs, &self.ended);
        for run in runs {
            // `error`: refused, as by a worker that stopped.
            let run = if crate::failpoint_fires!("hand-over") {
                run
            } else {
                match self.runs.send(Handed { run, via, sent, received, tally: tally.clone() }) {
                    Ok(()) => continue,
                    Err(refused) => refused.0.run,
                }
            };
            let fence = run.fence();
            match store::release_run(pool, fence).await {
                Ok(released) => {
                    if let (true, Some(t)) = (released, &tally) {
                        t.end();
                    }
                    tracing::debug!(run_id = %fence.run_id(), "worker gone; handed run released");
                }
                Err(e) => tracing::warn!(
                    run_id = %fence.run_id(), error = %e,
                    "could not release a run handed to a stopped worker; its lease will expire"
                ),
            }
        }
    }
}

/// The worker's functions by how their runs are claimed: by the fast claim
/// (no claim-time flow rule, no timeout) or by the full claim.
pub(crate) struct ClaimClasses {
    pub(crate) fast: store::Handled,
    pub(crate) full: store::Handled,
}

impl ClaimClasses {
    /// The functions of the fast claim (`fast`) or of the full claim.
    pub(crate) fn of_class(&self, fast: bool) -> &store::Handled {
        if fast { &self.fast } else { &self.full }
    }

    /// The classes (index `class(fast)`) a wake-up on `durastep_wakeup` is
    /// for: those that run a function its payload names (function ids
    /// separated by a space), both for an empty payload (it does not say),
    /// none when it names none of this worker's functions.
    pub(crate) fn woken_by(&self, payload: &str) -> [bool; 2] {
        if payload.is_empty() {
            return [true, true];
        }
        self.woken_by_ids(payload.split(' '))
    }

    /// The classes that run one of `ids`.
    pub(crate) fn woken_by_ids<'a>(&self, ids: impl Iterator<Item = &'a str>) -> [bool; 2] {
        let mut woken = [false, false];
        for id in ids {
            for fast in [true, false] {
                if self.of_class(fast).ids.binary_search_by(|f| f.as_str().cmp(id)).is_ok() {
                    woken[class(fast)] = true;
                }
            }
        }
        woken
    }
}

/// The index of a class in the claim loop's per-class arrays: 0 for the fast
/// claim's functions, 1 for the full claim's.
pub(crate) fn class(fast: bool) -> usize {
    usize::from(!fast)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handled(ids: &[&str]) -> store::Handled {
        let ids: Vec<String> = ids.iter().map(|s| (*s).to_owned()).collect();
        store::Handled { version_ids: ids.clone(), versions: vec![1; ids.len()], ids }
    }

    #[test]
    fn a_wake_up_wakes_the_classes_of_the_functions_it_names() {
        let classes = ClaimClasses { fast: handled(&["a", "b/on-failure", "c"]), full: handled(&["limited"]) };
        assert_eq!(classes.woken_by(""), [true, true], "an empty payload does not say: both");
        assert_eq!(classes.woken_by("c"), [true, false]);
        assert_eq!(classes.woken_by("b/on-failure"), [true, false]);
        assert_eq!(classes.woken_by("limited"), [false, true]);
        assert_eq!(classes.woken_by("a limited other"), [true, true]);
        assert_eq!(classes.woken_by("other another"), [false, false], "none of its functions: no class");
        assert_eq!(classes.woken_by("lim"), [false, false], "ids are matched whole");
    }

    #[test]
    fn wake_ups_add_up_until_taken() {
        let wake = Wake::default();
        wake.classes([false, false]);
        assert_eq!(wake.take(), [false, false], "a wake-up for no class wakes none");
        wake.classes([false, true]);
        assert_eq!(wake.take(), [false, true]);
        wake.classes([true, false]);
        wake.classes([false, true]);
        assert_eq!(wake.take(), [true, true]);
        assert_eq!(wake.classes.each_ref().map(|c| c.load(Ordering::Acquire)), [false, false]);
    }
}
