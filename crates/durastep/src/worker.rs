//! The worker: claims due runs, executes their attempts, keeps their leases,
//! reaps the leases of lost workers, and shuts down gracefully.
//!
//! Architecture invariants: the worker never holds a database transaction open
//! across user code (only `step_tx`, by the user's choice, does); heartbeats and
//! the reaper use their own small pool, so a busy main pool cannot starve them;
//! a run whose lease this worker may have lost (fenced by the database, or no
//! successful heartbeat within one lease by the worker's own clock) has its
//! handler dropped and gets no further writes.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::checkpoint::{Writer, WriterConfig};
use crate::claim_records::{self, ClaimTally, EndedClaims};
use crate::ctx::{Ctx, CtxParts, Signal};
use crate::error::{Error, from_sqlx};
use crate::failure::{HandlerError, HandlerResult};
use crate::handoff::{ClaimClasses, Handoff, Via, Wake, class};
use crate::journal::Journal;
use crate::kept::Kept;
use crate::limits;
use crate::metrics;
use crate::offers::Offers;
use crate::shared::EngineInner;
use crate::store::{self, ClaimedRun, Fence, PendingWrite, WriteOutcome};
use crate::supervise::{panic_message, spawn_supervised};

/// One attempt executing in this worker.
struct Held {
    fence: Fence,
    lost: CancellationToken,
    last_extended: Instant,
    function_id: String,
    /// Wakes the claim loop when this attempt is lost while it waits for a
    /// slot (claimed ahead), so that it ends the attempt at once.
    waiting_lost: Arc<Notify>,
    /// Set once the attempt's handler is gone and its end is being written: a
    /// heartbeat that then no longer finds the run running has most likely
    /// raced that end write (completion, retry, sleep), not lost the lease.
    ending: Arc<AtomicBool>,
}

impl Held {
    /// The attempt is lost (lease lost, run cancelled): its handler is
    /// dropped, or, if it still waits for a slot, it never starts.
    fn lose(&self) {
        self.lost.cancel();
        self.waiting_lost.notify_one();
    }
}

type HeldRuns = Arc<Mutex<HashMap<Uuid, Held>>>;

fn lock(held: &HeldRuns) -> std::sync::MutexGuard<'_, HashMap<Uuid, Held>> {
    held.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs one worker until `shutdown` is cancelled.
pub(crate) async fn run(engine: Arc<EngineInner>, shutdown: CancellationToken) -> Result<(), Error> {
    let opts = engine.worker.clone();
    let worker_id = Uuid::new_v4();
    let functions = Arc::new(engine.handled());
    let classes = Arc::new(engine.claim_classes());
    let span = tracing::info_span!("worker", %worker_id);
    async move {
        let versions: Vec<String> =
            functions.version_ids.iter().zip(&functions.versions).map(|(f, v)| format!("{f}@{v}")).collect();
        tracing::info!(functions = ?versions, "worker started");
        let held: HeldRuns = Arc::default();
        let wake = Arc::new(Wake::default());
        // Claim records whose attempts have all ended here, deleted in batches.
        let ended_claims = Arc::new(EndedClaims::default());
        let (handoff, mut handed) =
            Handoff::new(wake.clone(), worker_id, opts.lease, classes.clone(), ended_claims.clone());
        engine.local_workers.register(&handoff);
        // Its offer to the sends of other processes: only while it listens,
        // since a send tells it of the runs it hands on by a notification.
        let offers = opts.listen.then(|| Offers::new(worker_id, opts.lease, classes.fast.clone()));
        let slot_freed = Arc::new(Turnover::default());
        let waiting_lost = Arc::new(Notify::new());
        let stop_background = CancellationToken::new();
        let stop_writers = CancellationToken::new();
        let (writer, writer_tasks) = Writer::spawn(
            engine.pool.clone(),
            stop_writers.clone(),
            WriterConfig { tasks: opts.writers, max_batch: 512, retry_for: opts.lease },
        );

        let mut background = vec![
            spawn_supervised("heartbeat", {
                let (engine, held, stop) = (engine.clone(), held.clone(), stop_background.clone());
                move || heartbeat_loop(engine.clone(), held.clone(), stop.clone())
            }),
            spawn_supervised("own-clock", {
                let (engine, held, stop) = (engine.clone(), held.clone(), stop_background.clone());
                move || own_clock_loop(engine.clone(), held.clone(), stop.clone())
            }),
            spawn_supervised("reaper", {
                let (engine, stop) = (engine.clone(), stop_background.clone());
                move || reaper_loop(engine.clone(), stop.clone())
            }),
        ];
        if opts.listen {
            background.push(tokio::spawn(listen_loop(
                engine.clone(),
                Listening { wake: wake.clone(), classes: classes.clone(), held: held.clone(), handoff: handoff.clone() },
                offers.clone(),
                stop_background.clone(),
            )));
        }
        if let Some(offers) = &offers {
            background.push(tokio::spawn(crate::offers::publish_loop(
                engine.pool.clone(),
                offers.clone(),
                stop_background.clone(),
            )));
        }
        background.push(tokio::spawn(cron_loop(engine.clone(), stop_background.clone())));
        background.push(tokio::spawn(claim_records::sweep_loop(
            engine.control_pool.clone(),
            ended_claims.clone(),
            stop_background.clone(),
        )));
        if let Some(retention) = opts.retention {
            background.push(spawn_supervised("pruner", {
                let (engine, stop) = (engine.clone(), stop_background.clone());
                move || prune_loop(engine.clone(), retention, stop.clone())
            }));
        }

        let slots = Arc::new(Semaphore::new(opts.max_in_flight.max(1)));
        let ahead = opts.claim_ahead.min(opts.max_in_flight.max(1));
        // `claim_ahead: 0`: no run is claimed without a free slot for it, so
        // the two classes' claims in flight together bring at most the free
        // slots, and take turns at them (below).
        let strict = ahead == 0;
        // In strict mode, whether the fast class's claim goes first when both
        // may claim; the other class goes first after one claimed.
        let mut fast_first = true;
        let batch = opts.claim_batch.max(1);
        // Claimed runs waiting for a slot, in the order they start.
        let mut ready: VecDeque<Ready> = VecDeque::new();
        // Claim statements in flight, of each class of functions (fast and
        // full claim) at most two (a second one only while that class's
        // claims came back full).
        let mut claims: tokio::task::JoinSet<ClaimDone> = tokio::task::JoinSet::new();
        // Their connections, kept from one claim to the next.
        let claim_conns = Kept::new(engine.pool.clone());
        // What each statement in flight is: its class and the runs it may bring.
        let mut in_flight: HashMap<tokio::task::Id, Sent> = HashMap::new();
        // Answers that came while another claim of their class was in flight
        // (taken once none is).
        let mut answered: Vec<ClaimDone> = Vec::new();
        // Per class (index `class(fast)`): whether its last answer filled its
        // batch, and until when it is not claimed (its last claims found
        // nothing: until its next due run, a wake-up for it or the poll
        // interval).
        let mut last_full = [false, false];
        let mut class_held: [Option<tokio::time::Instant>; 2] = [None, None];
        // Per class: woken while a claim of it was in flight. That claim may
        // have gone out before the run the wake-up announces was visible, so
        // its answer, if empty, does not hold the class (the wake-up would be
        // lost until the poll interval).
        let mut woken_in_flight = [false, false];
        // No claim of either class before this: a claim failed (backoff), or
        // the worker has no function to claim for (the poll interval).
        let mut backoff_until: Option<tokio::time::Instant> = None;
        let mut failures = 0u32;
        let (mut window_start, mut window_frees, mut recent_frees) = (Instant::now(), 0usize, 0usize);
        let mut executors = tokio::task::JoinSet::new();
        loop {
            if shutdown.is_cancelled() {
                break;
            }
            while let Some(joined) = executors.try_join_next() {
                if let Err(e) = joined
                    && e.is_panic()
                {
                    tracing::error!(
                        "executor panicked: {}; its run's lease will expire",
                        panic_message(e.into_panic())
                    );
                }
            }
            // A run lost or cancelled while it waited (anywhere in the queue)
            // starts at once, without a slot, only to end its attempt; then
            // what waits, in order, on the free slots.
            loop {
                let (i, permit) = match ready.iter().position(|r| r.lost.is_cancelled()) {
                    Some(i) => (i, None),
                    None if ready.is_empty() => break,
                    None => match slots.clone().try_acquire_owned() {
                        Ok(p) => (0, Some(p)),
                        Err(_) => break,
                    },
                };
                let Some(next) = ready.remove(i) else { break };
                let slot = Slot { permit, turnover: slot_freed.clone() };
                let (engine, held, writer) = (engine.clone(), held.clone(), writer.clone());
                executors.spawn(async move {
                    // Dropped when the attempt ends, also if `execute` panics: the
                    // run is no longer held (its lease then expires) and the slot is free.
                    let _done = Done { held, fence: next.run.fence() };
                    execute(&engine, next, writer, slot).await;
                });
            }
            let now = tokio::time::Instant::now();
            let [fast_held, full_held] = &mut class_held;
            for h in [&mut backoff_until, fast_held, full_held] {
                if h.is_some_and(|t| t <= now) {
                    *h = None;
                }
            }
            // Claim ahead only what the slots freed lately would take (in the
            // last full window or the current one): a worker whose handlers
            // are all stuck claims nothing ahead.
            let frees = slot_freed.frees.load(Ordering::Relaxed);
            if window_start.elapsed() >= TURNOVER_WINDOW {
                recent_frees = frees - window_frees;
                (window_frees, window_start) = (frees, Instant::now());
            }
            let ahead = ahead.min(recent_frees.max(frees - window_frees));
            // Free slots, and the runs that will fill them without a slot of
            // their own: those waiting and those the claims in flight of the
            // same class may bring. A class does not count the other's claims
            // in flight: the other's statement may be slow (the full claim's,
            // or one waiting for a lock) and must not keep it from free slots.
            // If both bring runs for the same slots, the flow-limited ones
            // start first (`enqueue`) and the others wait as runs claimed ahead.
            // With `claim_ahead: 0` there are no runs claimed ahead: a class
            // counts every claim in flight and every answer not yet taken (at
            // most its cap each), and the classes take turns at the free
            // slots (neither starves the other while both have runs due).
            let idle = slots.available_permits();
            let untaken = if strict { answered.iter().map(|d| d.cap).sum::<usize>() } else { 0 };
            let mut sent = false;
            for fast in [fast_first, !fast_first] {
                let c = class(fast);
                let mine = in_flight.values().filter(|s| s.fast == fast);
                let n = mine.clone().count();
                let counted = in_flight.values().filter(|s| strict || s.fast == fast);
                let covered = ready.len() + untaken + counted.map(|s| s.cap).sum::<usize>();
                let room = (idle + ahead).saturating_sub(covered);
                let starved = idle > covered || (ahead > 0 && room >= ahead.div_ceil(2));
                // No claim of a class is sent while its answers wait, nor while
                // it waits for its next due run.
                let may_claim = backoff_until.is_none()
                    && class_held[c].is_none()
                    && room > 0
                    && starved
                    && !answered.iter().any(|d| d.fast == fast)
                    && (n == 0 || (n < 2 && last_full[c]))
                    && !classes.of_class(fast).ids.is_empty();
                if !may_claim {
                    continue;
                }
                let cap = if fast {
                    room.min(batch)
                } else {
                    idle.saturating_sub(covered).max(1).min(room.min(batch))
                };
                let (engine, classes, conns) = (engine.clone(), classes.clone(), claim_conns.clone());
                let queue = if last_full[c] { store::Queue::Backlog } else { store::Queue::Few };
                let task = claims.spawn(async move {
                    // The lease starts when the database runs the claim: count from before we send it.
                    let sent = Instant::now();
                    let claim = Claim { fast, cap, worker_id, queue };
                    let (result, next_due) = claim_class(&engine, &classes, &conns, claim).await;
                    ClaimDone { result, fast, cap, sent, received: Instant::now(), next_due }
                });
                in_flight.insert(task.id(), Sent { fast, cap });
                sent = true;
                if strict {
                    fast_first = !fast;
                }
            }
            if sent {
                continue;
            }
            if backoff_until.is_none() && classes.fast.ids.is_empty() && classes.full.ids.is_empty() {
                // No function to claim for: only the timer or a wake-up ends the wait.
                backoff_until = Some(tokio::time::Instant::now() + opts.poll_interval);
            }
            // Idle with nothing due (every class it has functions of is held):
            // offer the free slots to the sends of this process (if it has
            // functions whose runs may be handed on).
            let quiet = [true, false]
                .into_iter()
                .all(|fast| classes.of_class(fast).ids.is_empty() || class_held[class(fast)].is_some());
            let idle_waiting = quiet
                && failures == 0
                && claims.is_empty()
                && ready.is_empty()
                && !classes.fast.ids.is_empty();
            let offered = if idle_waiting { slots.available_permits() } else { 0 };
            handoff.offer(offered);
            if let Some(offers) = &offers {
                offers.set(offered);
            }
            let held_until = [backoff_until, class_held[0], class_held[1]].into_iter().flatten().min();
            let sleep_until = held_until.unwrap_or_else(|| tokio::time::Instant::now() + opts.poll_interval);
            let give_back_at =
                ready.iter().map(|r| r.received).min().map_or(sleep_until, |r| (r + AHEAD_WAIT_MAX).into());
            // The stop first: a worker woken by its stop and a handed run at
            // once stops, and gives the run back below.
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some(done) = claims.join_next_with_id(), if !claims.is_empty() => {
                    let (id, done) = match done {
                        Ok((id, done)) => (id, Some(done)),
                        // claim_class catches its own panics: a claim task cannot fail.
                        Err(e) => (e.id(), None),
                    };
                    let Some(sent) = in_flight.remove(&id) else { continue };
                    answered.extend(done);
                    // A class's answers are taken once no claim of that class
                    // is in flight, all together, in the order their claims were
                    // sent (`enqueue` then orders their runs by their place in
                    // the queue). Two claims of one class in flight skip each
                    // other's locked rows, so either may hold the runs that come
                    // first in the queue: a claim's runs started before the
                    // other's answer came could pass a run the other claimed (a
                    // flaky test caught a run taken out of order that way).
                    // Claims of the two classes take runs of different functions,
                    // so neither waits for the other. No claim is sent while
                    // answers wait.
                    if in_flight.values().any(|c| c.fast == sent.fast) {
                        continue;
                    }
                    let (mut taken, waiting): (Vec<ClaimDone>, Vec<ClaimDone>) =
                        answered.drain(..).partition(|d| d.fast == sent.fast);
                    answered = waiting;
                    taken.sort_by_key(|d| d.sent);
                    let mut class_found = 0;
                    // When the class's next run is due, as its last empty claim read it.
                    let mut next_due = None;
                    for done in taken {
                        next_due = done.next_due;
                        match done.result {
                            Ok((claimed, moved)) => {
                                failures = 0;
                                last_full[class(done.fast)] = claimed.len() >= done.cap;
                                class_found += i64::try_from(claimed.len()).unwrap_or(i64::MAX) + moved;
                                let tally = claim_records::tally(&claimed, &ended_claims);
                                for run in claimed {
                                    let r = hold(&held, &waiting_lost, run, done.sent, done.received, done.fast);
                                    enqueue(&mut ready, Ready { tally: tally.clone(), ..r });
                                }
                            }
                            Err(e) => {
                                failures += 1;
                                last_full = [false, false];
                                let backoff = Duration::from_millis(50 * 2u64.pow(failures.min(7))).min(Duration::from_secs(1));
                                tracing::warn!(error = %e, ?backoff, "claim failed; retrying");
                                backoff_until = Some(tokio::time::Instant::now() + backoff);
                            }
                        }
                    }
                    // Each class is held on its own: a class that had nothing
                    // due (its flow control moved nothing either) in what its
                    // claims since the last quiet moment found is not claimed
                    // again before its next due run (read by its claim's task),
                    // a wake-up for it or the poll interval: not for a slot.
                    // For a worker with both classes, its statement (the full
                    // claim's above all) would otherwise go with every claim of
                    // the other class, for nothing; and a hold of the whole
                    // worker would end at the other class's next due run.
                    let woken = std::mem::take(&mut woken_in_flight[class(sent.fast)]);
                    if class_found == 0 && failures == 0 && !woken {
                        let wait = next_due.map_or(opts.poll_interval, |d| d.min(opts.poll_interval));
                        // Due but claimed by someone else or not yet visible: do not spin.
                        class_held[class(sent.fast)] =
                            Some(tokio::time::Instant::now() + wait.max(Duration::from_millis(5)));
                    }
                }
                Some(h) = handed.recv() => {
                    // Claimed for this worker by a send (of its process, or of
                    // another through its offer): held from now. A run it holds
                    // already (a hand-over named twice: anyone may NOTIFY) is
                    // not started twice.
                    if lock(&held).contains_key(&h.run.id) {
                        tracing::warn!(run_id = %h.run.id, "a run handed over twice; ignored");
                        continue;
                    }
                    if h.via == Via::Offer && slots.available_permits() <= ready.len() {
                        // Taken through an offer row that still showed slots
                        // this worker has filled since: another worker may run
                        // it now (as a run claimed ahead that waited too long).
                        crate::failpoint!("offer-full");
                        spawn_give_back(&mut executors, &engine, Ready::unheld(h.run, h.received, h.tally));
                        continue;
                    }
                    let r = hold(&held, &waiting_lost, h.run, h.sent, h.received, true);
                    enqueue(&mut ready, Ready { tally: h.tally, ..r });
                }
                _ = wake.notify.notified(), if held_until.is_some() && failures == 0 => {
                    // A wake-up ends the holds of the classes it is for.
                    let woken = wake.take();
                    for fast in [true, false] {
                        let c = class(fast);
                        if woken[c] {
                            class_held[c] = None;
                            woken_in_flight[c] |= in_flight.values().any(|s| s.fast == fast);
                        }
                    }
                    crate::failpoint!("wake-taken");
                }
                _ = slot_freed.notify.notified() => {}
                _ = waiting_lost.notified() => {}
                _ = tokio::time::sleep_until(give_back_at), if !ready.is_empty() => {
                    // Claimed ahead, but no slot freed for AHEAD_WAIT_MAX:
                    // another worker may run them now.
                    let (stale, waiting): (VecDeque<Ready>, VecDeque<Ready>) =
                        ready.drain(..).partition(|r| r.received.elapsed() >= AHEAD_WAIT_MAX);
                    ready = waiting;
                    for r in stale {
                        let fence = r.run.fence();
                        lock(&held).remove(&fence.run_id());
                        spawn_give_back(&mut executors, &engine, r);
                    }
                }
                // The end of a wait (cleared at the top of the loop).
                _ = tokio::time::sleep_until(sleep_until), if held_until.is_some() => {}
            }
        }

        // Graceful shutdown: no more runs handed over (a send that still
        // tries releases its runs itself); those already handed are given
        // back with the runs claimed ahead.
        handoff.offer(0);
        if let Some(offers) = &offers {
            crate::offers::withdraw(&engine.pool, offers).await;
        }
        handed.close();
        while let Ok(h) = handed.try_recv() {
            ready.push_back(Ready::unheld(h.run, h.received, h.tally));
        }
        // No more claims; a claim in flight is awaited, so that its runs are
        // given back with those claimed ahead.
        let mut unstarted = answered;
        while let Some(done) = claims.join_next().await {
            unstarted.extend(done.ok());
        }
        for done in unstarted {
            if let ClaimDone { result: Ok((claimed, _)), received, .. } = done {
                let tally = claim_records::tally(&claimed, &ended_claims);
                for run in claimed {
                    ready.push_back(Ready::unheld(run, received, tally.clone()));
                }
            }
        }
        // Graceful shutdown: no more claims; runs claimed ahead that did not
        // start are given back at once; running attempts may finish within the grace.
        for r in ready.drain(..) {
            lock(&held).remove(&r.run.id);
            give_back(&engine, r).await;
        }
        tracing::info!(in_flight = executors.len(), "worker stopping");
        let drained =
            tokio::time::timeout(opts.shutdown_grace, async { while executors.join_next().await.is_some() {} }).await;
        if drained.is_err() {
            let still: Vec<Fence> = lock(&held).values().map(|h| h.fence).collect();
            for (id, h) in lock(&held).iter() {
                tracing::info!(run_id = %id, "releasing run at shutdown");
                h.lost.cancel();
            }
            executors.shutdown().await;
            for fence in still {
                let id = fence.run_id();
                if crate::failpoint_fires!("release-before-commit") {
                    tracing::warn!(run_id = %id, "failpoint release-before-commit: not released; its lease will expire");
                    continue;
                }
                if let Err(e) = store::release_run(&engine.pool, fence).await {
                    tracing::warn!(run_id = %id, error = %e, "could not release run; its lease will expire");
                }
            }
        }
        stop_background.cancel();
        // Not "when every Writer clone is dropped": user code may keep a Ctx alive.
        stop_writers.cancel();
        drop(writer);
        for t in writer_tasks.into_iter().chain(background) {
            let _ = t.await;
        }
        tracing::info!("worker stopped");
        Ok(())
    }
    .instrument(span)
    .await
}

/// One claim statement for one class of functions, in a task of its own so
/// that a panic in it (a bug, or the `panic` failpoint action) fails this
/// claim only: the claim loop logs it and retries, as after a failed claim
/// statement.
///
/// Up to `cap` runs: the fast claim for the functions without claim-time
/// flow rules (`fast`), the full claim for the others. Priority orders runs
/// within each class; the claim loop claims each class on its own, so that
/// neither starves the other and neither's answer waits for the other's
/// statement. When the claim found nothing, also returns how long until this
/// class's next due run (read here, so that the claim loop does not wait for
/// it).
async fn claim_class(
    engine: &Arc<EngineInner>,
    classes: &Arc<ClaimClasses>,
    conns: &Arc<Kept>,
    Claim { fast, cap, worker_id, queue }: Claim,
) -> (Result<(Vec<ClaimedRun>, i64), String>, Option<Duration>) {
    let claim = tokio::spawn({
        let (engine, classes, conns) = (engine.clone(), classes.clone(), conns.clone());
        async move {
            crate::failpoint!("claim-before-commit", Err("failpoint claim-before-commit".to_owned()));
            let (lease, functions) = (engine.worker.lease, classes.of_class(fast));
            let sent = Instant::now();
            let limit = i64::try_from(cap).unwrap_or(i64::MAX);
            let claimed = conns
                .run(async |conn| {
                    if fast {
                        store::claim_fast(conn, functions, limit, lease, worker_id, queue).await
                    } else {
                        store::claim_runnable(conn, functions, limit, lease, worker_id, queue).await
                    }
                })
                .await;
            let (runs, moved) = claimed.map_err(|e| e.to_string())?;
            metrics::claimed(sent.elapsed(), runs.len(), fast);
            if !runs.is_empty() {
                // The claim committed but its answer is lost: the runs stay claimed
                // until their leases expire and a reaper takes them back.
                crate::failpoint!("claim-after-commit", Err("failpoint claim-after-commit".to_owned()));
            }
            Ok((runs, moved))
        }
    });
    let result = match claim.await {
        Ok(result) => result,
        Err(e) if e.is_panic() => Err(format!("claim panicked: {}", panic_message(e.into_panic()))),
        Err(e) => Err(e.to_string()),
    };
    let nothing = matches!(&result, Ok((runs, 0)) if runs.is_empty());
    let next_due =
        if nothing { store::next_due_in(&engine.pool, classes.of_class(fast)).await.ok().flatten() } else { None };
    // The answer is ready, not yet taken by the claim loop: a test holds it
    // here to deliver a wake-up while the claim is in flight.
    crate::failpoint!("claim-answered", (Err("failpoint claim-answered".to_owned()), None));
    (result, next_due)
}

/// A claim statement to send: its class (`fast`: the fast claim's
/// functions), how many runs it may bring, for which worker, and which of
/// the class's two statements.
struct Claim {
    fast: bool,
    cap: usize,
    worker_id: Uuid,
    queue: store::Queue,
}

/// A claim statement in flight: its class (`fast`: the fast claim's
/// functions) and how many runs it may bring.
struct Sent {
    fast: bool,
    cap: usize,
}

/// A claim statement that ended: its class, what it asked for, when it was
/// sent and when its answer came.
struct ClaimDone {
    result: Result<(Vec<ClaimedRun>, i64), String>,
    fast: bool,
    cap: usize,
    sent: Instant,
    received: Instant,
    /// How long until this class's next due run, read after an empty answer
    /// (None: not read, or nothing scheduled).
    next_due: Option<Duration>,
}

/// A claimed run that has not started: held (its lease is kept), waiting for a slot.
struct Ready {
    run: ClaimedRun,
    lost: CancellationToken,
    /// Shared with the run's [`Held`] entry: set when the attempt's end is written.
    ending: Arc<AtomicBool>,
    /// When the claim's answer arrived: the run's `db_now` was read before it.
    received: Instant,
    /// Claimed by the fast claim (no claim-time flow rules).
    fast: bool,
    /// The record of the claim that started it, counted down once its end is stored.
    tally: Option<Arc<ClaimTally>>,
}

impl Ready {
    /// A run this worker never held, only to be given back (its fence, its
    /// place): nothing waits on its `lost` or `ending`; `tally` is its claim
    /// record's, counted down once it is given back.
    fn unheld(run: ClaimedRun, received: Instant, tally: Option<Arc<ClaimTally>>) -> Ready {
        Ready { run, lost: CancellationToken::new(), ending: Arc::default(), received, fast: true, tally }
    }
}

/// Gives back `r` in a task beside the attempts (awaited within the
/// shutdown grace): its round trip does not hold up the claim loop.
fn spawn_give_back(executors: &mut tokio::task::JoinSet<()>, engine: &Arc<EngineInner>, r: Ready) {
    let engine = engine.clone();
    executors.spawn(async move { give_back(&engine, r).await });
}

/// A claimed run held by this worker from now (its lease kept by the
/// heartbeat, counted from `sent`), ready to queue.
fn hold(
    held: &HeldRuns,
    waiting_lost: &Arc<Notify>,
    run: ClaimedRun,
    sent: Instant,
    received: Instant,
    fast: bool,
) -> Ready {
    let lost = CancellationToken::new();
    let ending = Arc::new(AtomicBool::new(false));
    let h = Held {
        fence: run.fence(),
        lost: lost.clone(),
        last_extended: sent,
        function_id: run.function_id.clone(),
        waiting_lost: waiting_lost.clone(),
        ending: ending.clone(),
    };
    lock(held).insert(run.id, h);
    Ready { run, lost, ending, received, fast, tally: None }
}

/// Queues a claimed run to start. A flow-limited run holds its concurrency
/// slots from the claim, so it starts before the runs claimed ahead; the
/// others take their place by priority, then due time: two claims in flight
/// may answer in either order, and their runs must still start in the order
/// the queue gave them (G26).
fn enqueue(ready: &mut VecDeque<Ready>, r: Ready) {
    if !r.fast {
        ready.push_front(r);
        return;
    }
    let at = ready.iter().position(|q| q.fast && r.run.place.before(&q.run.place)).unwrap_or(ready.len());
    ready.insert(at, r);
}

/// The end of one executor: releases its run's slot and its place in the held
/// runs, whether the attempt ended normally or its executor panicked.
struct Done {
    held: HeldRuns,
    fence: Fence,
}

impl Drop for Done {
    fn drop(&mut self) {
        let mut held = lock(&self.held);
        // A newer attempt of the same run may already be held here.
        if held.get(&self.fence.run_id()).is_some_and(|h| h.fence == self.fence) {
            held.remove(&self.fence.run_id());
        }
    }
}

/// One of the worker's `max_in_flight` slots, held by an attempt while its
/// handler may run. Freed as soon as the handler has returned (while the
/// attempt's end is still being written, so the next claim overlaps that
/// commit), or else when the attempt ends, also if it panics.
struct Slot {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    turnover: Arc<Turnover>,
}

impl Slot {
    fn free(&mut self) {
        // Free the slot before telling the claim loop, which then counts free slots.
        if self.permit.take().is_some() {
            self.turnover.frees.fetch_add(1, Ordering::Relaxed);
            self.turnover.notify.notify_one();
        }
    }
}

/// How the claim loop learns that slots free: woken, and a count of them
/// (the rate at which this worker's slots turn over bounds what it claims ahead).
#[derive(Default)]
struct Turnover {
    notify: Notify,
    frees: AtomicUsize,
}

/// The window over which slot turnover is counted.
const TURNOVER_WINDOW: Duration = Duration::from_millis(100);

/// How long a run claimed ahead may wait for a slot before it is given back.
const AHEAD_WAIT_MAX: Duration = Duration::from_secs(1);

/// Gives back a run claimed ahead that did not start (not an attempt: the
/// run is due again at once), or ends the attempt of one cancelled meanwhile.
async fn give_back(engine: &EngineInner, r: Ready) {
    let fence = r.run.fence();
    match store::release_run(&engine.pool, fence).await {
        // Queued again: its claim record no longer needs to list it (the
        // run's next claim lists it in a record of its own).
        Ok(true) => {
            if let Some(t) = &r.tally {
                t.end();
            }
        }
        // Cancelled while it waited: it holds its slots until its attempt ends.
        Ok(false) => end_cancelled(engine, &RunRef::of(&r.run)).await,
        Err(e) => {
            tracing::warn!(run_id = %fence.run_id(), error = %e, "could not give back a run claimed ahead; its lease will expire")
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.free();
    }
}

/// How an attempt ended, before its end is written.
enum Ending {
    Returned(serde_json::Value),
    Failed(HandlerError),
    /// The replay parted from the run's journal: park the run.
    Diverged(crate::journal::Divergence),
    /// The run is sleeping or waiting: its suspension is stored.
    Suspended,
    /// Nothing more may be written (fenced, lease lost, cancelled).
    Stopped,
}

/// Whether a failure came from a step (its signal), not from the handler's own return.
fn returned_by_step(ending: &Ending) -> bool {
    matches!(ending, Ending::Failed(e) if e.step().is_some())
}

/// Parks the run `diverged`, with what was found, until an operator acts;
/// returns whether it was stored.
async fn diverged(engine: &EngineInner, run: &RunRef, d: crate::journal::Divergence) -> bool {
    let json = serde_json::to_value(&d).unwrap_or_default();
    match store::park_diverged(&engine.pool, run.fence, &json, &d.to_string()).await {
        Ok(true) => {
            metrics::count(metrics::RUNS_DIVERGED, &run.function_id);
            tracing::error!(error = %d, "run diverged from its recorded steps; parked until an operator resumes or discards it");
            true
        }
        Ok(false) => {
            tracing::warn!("divergence not recorded: lease lost or run cancelled");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "divergence not recorded; the lease will expire and the run be retried");
            false
        }
    }
}

/// Executes one attempt of a claimed run and writes how it ended.
async fn execute(engine: &EngineInner, ready: Ready, writer: Writer, mut slot: Slot) {
    let Ready { run, lost, ending: end_written, received, tally, .. } = ready;
    if lost.is_cancelled() {
        // Lost or cancelled before it started (it waited for a slot): no user
        // code runs; a cancelled run's slots are given back now.
        slot.free();
        end_cancelled(engine, &RunRef::of(&run)).await;
        return;
    }
    let Some(function) = engine.handler(&run.function_id, run.version) else {
        // Claimed only for registered versions; unreachable, but fail loudly rather than loop.
        let _ = store::fail_attempt(
            &engine.pool,
            run.fence(),
            "function not registered in this worker",
            true,
            Duration::ZERO,
            false,
            0,
            None,
        )
        .await;
        return;
    };
    let attempt = u32::try_from(run.attempt).unwrap_or(1);
    let span = tracing::info_span!("run", run_id = %run.id, function = %run.function_id, attempt);
    metrics::run_started(&run.function_id, attempt);
    let this = RunRef::of(&run);
    let (signal_tx, signal_rx) = oneshot::channel();
    let journal = Arc::new(Mutex::new(Journal::new(run.journal)));
    let ctx = Ctx::new(CtxParts {
        run_id: run.id,
        function_id: run.function_id.clone(),
        event_id: run.event_id,
        attempt,
        fence: Some(this.fence),
        stored: run.steps,
        journal: journal.clone(),
        dry: false,
        #[cfg(feature = "testing")]
        probe: engine.probe.get().cloned(),
        signal: signal_tx,
        lost: lost.clone(),
        writer: writer.clone(),
        pool: engine.pool.clone(),
        limits: engine.limits,
        keyring: engine.keyring.clone(),
        db_now: run.db_now,
        claimed_at: received,
        span: span.clone(),
        step_timeout: function.step_timeout,
    });
    async move {
        // Aborted when dropped: if this executor is cancelled (shutdown), user code stops too.
        let mut handle = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
            (function.handler)(ctx, run.payload).in_current_span(),
        ));
        // Set when the handler is aborted: the attempt's end is written (or,
        // without an end write, its slots given back) only once the handler,
        // and every step body in it, has actually been dropped.
        let mut aborted = false;
        let ending = tokio::select! {
            biased;
            joined = &mut handle => ending_of(joined),
            signal = signal_rx => match signal {
                Ok(Signal::StepFailed(e)) => {
                    handle.abort();
                    aborted = true;
                    Ending::Failed(e)
                }
                Ok(Signal::Suspended) => {
                    handle.abort();
                    aborted = true;
                    metrics::count(metrics::RUNS_SUSPENDED, &this.function_id);
                    tracing::debug!("run suspended");
                    Ending::Suspended
                }
                Ok(Signal::Diverged(d)) => {
                    handle.abort();
                    aborted = true;
                    Ending::Diverged(d)
                }
                // The test kit crashed the attempt: as a dead process, write
                // nothing and leave the lease to expire.
                #[cfg(feature = "testing")]
                Ok(Signal::Crashed) => {
                    handle.abort();
                    aborted = true;
                    tracing::info!("attempt crashed by the test kit");
                    Ending::Stopped
                }
                // Only dry replays stop so; this is not one.
                Ok(Signal::Reached) => {
                    handle.abort();
                    aborted = true;
                    Ending::Stopped
                }
                Ok(Signal::Fenced) => {
                    handle.abort();
                    aborted = true;
                    if !lost.is_cancelled() {
                        // Cancelled here, so the heartbeat does not count this loss again.
                        lost.cancel();
                        metrics::count(metrics::LEASES_LOST, &this.function_id);
                    }
                    tracing::warn!("attempt fenced: lease lost");
                    Ending::Stopped
                }
                Ok(Signal::Cancelled) => {
                    handle.abort();
                    aborted = true;
                    tracing::info!("run cancelled by an event of its own step; attempt ended");
                    Ending::Stopped
                }
                // Every Ctx is gone: the handler has returned (or panicked), or
                // it dropped its Ctx and goes on without one: keep watching the lease.
                Err(_) => tokio::select! {
                    biased;
                    joined = &mut handle => ending_of(joined),
                    _ = lost.cancelled() => {
                        handle.abort();
                        aborted = true;
                        tracing::warn!("lease lost or run cancelled; handler dropped");
                        Ending::Stopped
                    }
                },
            },
            _ = lost.cancelled() => {
                handle.abort();
                aborted = true;
                tracing::warn!("lease lost or run cancelled; handler dropped");
                Ending::Stopped
            }
        };
        // The handler returned (or failed by itself) without asking for entries
        // the run recorded: the code no longer does what the run did.
        let ending = match ending {
            Ending::Returned(_) | Ending::Failed(_) if !returned_by_step(&ending) => {
                match journal.lock().unwrap_or_else(|p| p.into_inner()).unasked() {
                    Some((position, recorded)) => Ending::Diverged(crate::journal::Divergence {
                        run_id: this.fence.run_id(),
                        function_id: this.function_id.clone(),
                        position,
                        recorded: Some(recorded),
                        asked: None,
                    }),
                    None => ending,
                }
            }
            other => other,
        };
        // An aborted handler may still be running a step body of a branch
        // that did not fail (a `join!`), until its task is dropped: wait for
        // that before writing the attempt's end, which gives back its slots
        // (G22: a slot is held until the attempt's body has stopped).
        if aborted {
            let _ = (&mut handle).await;
        }
        // No user code of this attempt runs any more: this worker's slot is
        // free while the attempt's end is written.
        end_written.store(true, Ordering::Relaxed);
        slot.free();
        // Whether the attempt's own end write (completion, failure, retry,
        // suspension, divergence) was stored; it gives back the attempt's slots itself.
        let ended = !lost.is_cancelled()
            && match ending {
                Ending::Diverged(d) => diverged(engine, &this, d).await,
                Ending::Returned(output) => complete(engine, &this, &writer, output).await,
                Ending::Failed(e) => fail(engine, &this, attempt, &function.backoff, function.backpressure, e).await,
                Ending::Suspended => true,
                Ending::Stopped => false,
            };
        if !ended {
            // A run cancelled under this attempt holds its slots until now.
            end_cancelled(engine, &this).await;
        } else if let Some(t) = &tally {
            // Stored: this attempt no longer needs its claim's record.
            t.end();
        }
    }
    .instrument(span)
    .await
}

/// The end of an attempt whose run may have been cancelled under it, once its
/// handler has been dropped: gives back the slots a cancelled run keeps until
/// then. Nothing happens for a run that was not cancelled (a lost lease).
async fn end_cancelled(engine: &EngineInner, run: &RunRef) {
    match store::end_cancelled_attempt(&engine.pool, run.fence).await {
        Ok(true) => tracing::info!("cancelled attempt ended; its concurrency slots are free"),
        Ok(false) => {}
        Err(e) => {
            tracing::warn!(error = %e, "could not end the cancelled attempt; the reaper frees its slots when its lease lapses")
        }
    }
}

/// Stores the run's completion; returns whether it was stored.
async fn complete(engine: &EngineInner, run: &RunRef, writer: &Writer, output: serde_json::Value) -> bool {
    let text = match limits::check_payload(&output, &engine.limits) {
        Ok(t) => {
            // A child's output is bound to the parent run and step it answers,
            // so it cannot be transplanted into another parent.
            let place =
                crate::codec::Place::output(run.fence.run_id(), run.parent.as_ref().map(|(p, k)| (*p, k.as_str())));
            crate::codec::seal_text(engine.keyring.as_deref(), &place, &output, t)
        }
        Err(e) => {
            let e = HandlerError::permanent(format!("run output refused: {e}"));
            return fail(engine, run, 1, &crate::Backoff::default(), false, e).await;
        }
    };
    crate::failpoint!("complete-before-commit", {
        tracing::warn!("failpoint complete-before-commit: completion not stored; the lease will expire");
        false
    });
    match writer.write(PendingWrite::Complete { fence: run.fence, output: text }).await {
        Ok(WriteOutcome::Stored) => {
            metrics::count(metrics::RUNS_COMPLETED, &run.function_id);
            tracing::debug!("run completed");
            true
        }
        Ok(_) => {
            tracing::warn!("completion fenced: lease lost or run cancelled");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "completion not stored; the lease will expire and the run be retried");
            false
        }
    }
}

/// The identity of an attempt: what every write after the claim compares.
struct RunRef {
    fence: Fence,
    function_id: String,
    /// The run and step that invoked it (from the claim): a child's output is bound to them.
    parent: Option<(Uuid, String)>,
}

impl RunRef {
    fn of(run: &ClaimedRun) -> RunRef {
        RunRef { fence: run.fence(), function_id: run.function_id.clone(), parent: run.parent.clone() }
    }
}

/// Stores the end of a failed attempt (a retry or the run's failure); returns
/// whether it was stored.
async fn fail(
    engine: &EngineInner,
    run: &RunRef,
    attempt: u32,
    backoff: &crate::Backoff,
    backpressure: bool,
    e: HandlerError,
) -> bool {
    // Cut to the documented maximum: a huge delay once failed the write
    // ("timestamp out of range") and a large one paused a shared key for years.
    let delay = e.retry_after_delay().unwrap_or_else(|| backoff.delay(attempt)).min(limits::MAX_RETRY_DELAY);
    let pause = backpressure && e.retry_after_delay().is_some() && !e.is_permanent();
    let mut tries = 0;
    loop {
        let failed = store::fail_attempt(
            &engine.pool,
            run.fence,
            e.message(),
            e.is_permanent(),
            delay,
            pause,
            i32::try_from(crate::flow::BACKPRESSURE_FREE_RETRIES).unwrap_or(i32::MAX),
            e.step(),
        );
        match failed.await {
            Ok(Some(state)) => {
                if state == crate::RunState::Failed {
                    metrics::count(metrics::RUNS_FAILED, &run.function_id);
                    tracing::warn!(error = %e, "run failed");
                } else {
                    metrics::count(metrics::ATTEMPTS_FAILED, &run.function_id);
                    tracing::info!(error = %e, retry_in = ?delay, "attempt failed; will retry");
                }
                return true;
            }
            Ok(None) => {
                tracing::warn!("failure not recorded: lease lost or run cancelled");
                return false;
            }
            Err(err) if tries < 5 && crate::error::is_transient_sqlx(&err) => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100 * tries)).await;
            }
            Err(err) => {
                tracing::warn!(error = %err, "failure not recorded; the lease will expire");
                return false;
            }
        }
    }
}

fn ending_of(joined: Result<HandlerResult<serde_json::Value>, tokio::task::JoinError>) -> Ending {
    match joined {
        Ok(Ok(output)) => Ending::Returned(output),
        Ok(Err(e)) => Ending::Failed(e),
        Err(e) if e.is_panic() => {
            Ending::Failed(HandlerError::new(format!("handler panicked: {}", panic_message(e.into_panic()))))
        }
        Err(_) => Ending::Stopped,
    }
}

/// Extends every held lease in one statement per interval. A run the database
/// no longer gives this worker has its handler dropped. A statement that gets
/// no answer within one lease is abandoned (its connection is dropped), so a
/// connection lost in a network partition cannot stall the heartbeats for
/// good; [`own_clock_loop`] drops the handlers meanwhile.
async fn heartbeat_loop(engine: Arc<EngineInner>, held: HeldRuns, stop: CancellationToken) {
    let opts = &engine.worker;
    let tick = opts.heartbeat_interval.min(opts.lease / 3).max(Duration::from_millis(10));
    loop {
        tokio::select! {
            _ = tokio::time::sleep(tick) => {}
            _ = stop.cancelled() => return,
        }
        // Not the attempts whose handler is being dropped: their leases must lapse.
        let pairs: Vec<Fence> = lock(&held).values().filter(|h| !h.lost.is_cancelled()).map(|h| h.fence).collect();
        if pairs.is_empty() {
            continue;
        }
        let sent_at = Instant::now();
        #[cfg(feature = "failpoints")]
        if crate::failpoints::eval("heartbeat").await {
            continue;
        }
        let extended = tokio::time::timeout(opts.lease, store::extend_leases(&engine.control_pool, &pairs, opts.lease));
        let extended = tokio::select! {
            r = extended => r,
            _ = stop.cancelled() => return,
        };
        match extended {
            Err(_) => tracing::warn!(after = ?opts.lease, "heartbeat got no answer; abandoned"),
            Ok(Err(e)) => tracing::warn!(error = %e, "heartbeat failed"),
            Ok(Ok(still)) => {
                // Extended, or busy: still ours, but its row was locked by another
                // transaction, so it was skipped. A busy run keeps its old lease
                // and is tried again next round; only the own-clock check drops
                // it, if its lease really lapses.
                let still: HashMap<Uuid, bool> = still.into_iter().collect();
                let mut held = lock(&held);
                for fence in &pairs {
                    let id = &fence.run_id();
                    if let Some(h) = held.get_mut(id).filter(|h| h.fence == *fence) {
                        match still.get(id) {
                            Some(true) => h.last_extended = sent_at,
                            Some(false) => {
                                tracing::debug!(run_id = %id, "run row locked by another transaction; lease extension retried next round")
                            }
                            // The end write committed between the heartbeat's read of
                            // the held runs and its statement: not a lost lease (a
                            // fenced end write is found by the end write itself).
                            None if h.ending.load(Ordering::Relaxed) => {
                                tracing::debug!(run_id = %id, "attempt ended while its lease was being extended")
                            }
                            None if !h.lost.is_cancelled() => {
                                metrics::count(metrics::LEASES_LOST, &h.function_id);
                                tracing::warn!(run_id = %id, "lease lost (fenced); dropping handler");
                                h.lose();
                            }
                            None => {}
                        }
                    }
                }
            }
        }
    }
}

/// The own-clock lease check: a held run whose lease was not extended within
/// 90% of the lease by this worker's monotonic clock has its handler dropped,
/// a little before the lease can expire in the database. It runs on its own
/// timer, waking at the earliest such deadline (and at least every 100 ms),
/// so neither the heartbeat tick nor a heartbeat statement stuck on a dead
/// connection can delay it.
async fn own_clock_loop(engine: Arc<EngineInner>, held: HeldRuns, stop: CancellationToken) {
    let limit = engine.worker.lease.mul_f64(0.9);
    loop {
        let now = Instant::now();
        let mut earliest = now + limit;
        for (id, h) in lock(&held).iter() {
            if h.lost.is_cancelled() {
                continue;
            }
            let deadline = h.last_extended + limit;
            if deadline <= now {
                metrics::count(metrics::LEASES_LOST, &h.function_id);
                tracing::warn!(run_id = %id, "lease not extended in time by this worker's clock; dropping handler");
                h.lose();
            } else {
                earliest = earliest.min(deadline);
            }
        }
        // A run claimed meanwhile counts from when its claim was sent, which a
        // slow claim puts in the past: look again at least every 100 ms.
        let wake = earliest.min(now + Duration::from_millis(100));
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// Takes back runs whose lease expired (their worker died or stalled).
async fn reaper_loop(engine: Arc<EngineInner>, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(engine.worker.reap_interval) => {}
            _ = stop.cancelled() => return,
        }
        if let Err(e) = reap_once(&engine.control_pool).await {
            tracing::warn!(error = %e, "reaper failed");
        }
        // On the reaper's timer: one cheap statement per interval, not one per claim.
        sample_queue_depth(&engine).await;
    }
}

/// Prunes finished runs older than `retention` every `prune_interval`.
async fn prune_loop(engine: Arc<EngineInner>, retention: Duration, stop: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(engine.worker.prune_interval) => {}
            _ = stop.cancelled() => return,
        }
        // On the main pool: a long prune must never hold a connection the
        // heartbeats, the reaper or the listener need (the control pool is small).
        match store::prune_all(&engine.pool, retention, 20).await {
            Ok(r) if r.runs + r.events > 0 => tracing::info!(runs = r.runs, events = r.events, "pruned finished runs"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "pruning failed"),
        }
    }
}

/// One reaper pass; returns how many runs were taken back.
pub(crate) async fn reap_once(pool: &sqlx::PgPool) -> Result<usize, Error> {
    let timed_out = store::expire_timeouts(pool, 100).await.map_err(from_sqlx)?;
    if timed_out > 0 {
        tracing::info!(timed_out, "cancelled runs past their start or finish timeout");
    }
    let lapsed = store::release_lapsed_cancels(pool, 100).await.map_err(from_sqlx)?;
    if lapsed > 0 {
        tracing::warn!(lapsed, "cancelled attempts whose lease lapsed gave back their slots");
    }
    let seen = store::find_expired_leases(pool, 100).await.map_err(from_sqlx)?;
    if seen.is_empty() {
        return Ok(0);
    }
    crate::failpoint!(
        "reaper-between-select-and-update",
        Err(from_sqlx(sqlx::Error::Protocol("failpoint reaper-between-select-and-update".into())))
    );
    let reaped = store::reap_expired(pool, &seen).await.map_err(from_sqlx)?;
    for (id, state) in &reaped {
        metrics::runs_reaped(state.as_str());
        tracing::warn!(run_id = %id, new_state = %state, "reaped run with expired lease");
    }
    Ok(reaped.len())
}

/// Sets the queue-depth gauge of each of this worker's functions (0 for a
/// function with nothing due).
async fn sample_queue_depth(engine: &EngineInner) {
    let functions: Vec<String> = engine.functions.keys().cloned().collect();
    match store::count_due_runs(&engine.control_pool, &functions).await {
        Ok(due) => {
            let due: HashMap<String, i64> = due.into_iter().collect();
            for f in &functions {
                metrics::queue_depth(f, due.get(f).copied().unwrap_or(0));
            }
        }
        Err(e) => tracing::debug!(error = %e, "queue depth not sampled"),
    }
}

/// LISTEN for wake-up hints, and for cancels of running runs (a held run
/// that is cancelled has its handler dropped at once, not at the next
/// heartbeat); reconnects with backoff. Polling and heartbeats cover any gap.
async fn listen_loop(
    engine: Arc<EngineInner>,
    Listening { wake, classes, held, handoff }: Listening,
    offers: Option<Arc<Offers>>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(100);
    let hand_channel = offers.as_ref().map(|o| o.channel().to_owned());
    // The first connection has no notice to have lost.
    let mut connected_before = false;
    loop {
        let listener = async {
            let mut l = sqlx::postgres::PgListener::connect_with(&engine.control_pool).await?;
            l.listen_all([store::WAKEUP_CHANNEL, store::CANCEL_CHANNEL].into_iter().chain(hand_channel.as_deref()))
                .await?;
            hold_key(&mut l, offers.as_deref()).await?;
            Ok::<_, sqlx::Error>(l)
        };
        let mut listener = tokio::select! {
            l = listener => match l {
                Ok(l) => l,
                Err(e) => {
                    tracing::debug!(error = %e, "listen failed; polling only until it reconnects");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = stop.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        backoff = Duration::from_millis(100);
        // A reconnect may have missed notifications: wake once, and look for
        // runs handed on whose notices died with the old connection.
        wake.classes([true, true]);
        let mut listed = match &offers {
            Some(offers) if connected_before => offers.list_handed(&mut listener).await,
            _ => None,
        };
        connected_before = true;
        loop {
            tokio::select! {
                n = listener.try_recv() => match n {
                    Ok(Some(n)) if n.channel() == store::CANCEL_CHANNEL => drop_cancelled(&held, n.payload()),
                    Ok(Some(n)) if Some(n.channel()) == hand_channel.as_deref() => {
                        if !crate::offers::is_marker(n.payload()) && crate::failpoint_fires!("notice-lost") {
                            // As if the connection died with the notice unread.
                            break;
                        }
                        if let Some(offers) = &offers {
                            crate::offers::heard(&engine.pool, offers, &handoff, &mut listed, n.payload());
                        }
                    }
                    Ok(Some(n)) => wake.classes(classes.woken_by(n.payload())),
                    Ok(None) => {
                        // Connection lost and re-established by sqlx: the old
                        // connection's lock went with it, and maybe notices.
                        wake.classes([true, true]);
                        if hold_key(&mut listener, offers.as_deref()).await.is_err() {
                            break;
                        }
                        if let Some(offers) = &offers {
                            listed = offers.list_handed(&mut listener).await;
                        }
                    }
                    Err(_) => break,
                },
                _ = stop.cancelled() => return,
            }
        }
        if let Some(offers) = &offers {
            offers.not_listening();
        }
    }
}

/// What the listener serves: the claim loop's wake-up, for the classes of
/// the functions a notification names; the held runs, which a cancel drops;
/// and the worker's hand-off, for the runs a send of another process hands it.
struct Listening {
    wake: Arc<Wake>,
    classes: Arc<ClaimClasses>,
    held: HeldRuns,
    handoff: Arc<Handoff>,
}

/// Makes the listener's connection hold a new key of the worker's offer
/// (`crate::offers`): its offer is good while this connection lives.
async fn hold_key(listener: &mut sqlx::postgres::PgListener, offers: Option<&Offers>) -> Result<(), sqlx::Error> {
    let Some(offers) = offers else { return Ok(()) };
    offers.not_listening();
    let key = crate::offers::new_key();
    store::hold_listener_key(listener, key).await?;
    offers.listening(key);
    Ok(())
}

/// A cancel announced on [`store::CANCEL_CHANNEL`] (`<run id>:<lease epoch>`):
/// if this worker holds that attempt, its handler is dropped now; the
/// executor then ends the attempt, which frees its slots.
fn drop_cancelled(held: &HeldRuns, payload: &str) {
    let Some((id, epoch)) = payload.split_once(':') else {
        return;
    };
    let (Ok(id), Ok(epoch)) = (id.parse::<Uuid>(), epoch.parse::<i64>()) else {
        return;
    };
    if let Some(h) = lock(held).get(&id).filter(|h| h.fence.epoch() == epoch && !h.lost.is_cancelled()) {
        tracing::info!(run_id = %id, "run cancelled; dropping its handler");
        h.lose();
    }
}

/// Ticks the cron schedules of this worker's functions every poll interval.
/// Every worker does this; the schedule row's lock and the fire-time
/// idempotency keys make each fire time one run.
async fn cron_loop(engine: Arc<EngineInner>, stop: CancellationToken) {
    let mut ids: Vec<String> = engine
        .functions
        .iter()
        .filter(|(_, r)| r.newest().is_some_and(|r| r.schedule.is_some()))
        .map(|(id, _)| id.clone())
        .collect();
    if ids.is_empty() {
        return;
    }
    ids.sort_unstable();
    loop {
        if let Err(e) = cron_tick(&engine, &ids).await {
            tracing::warn!(error = %e, "cron tick failed; retrying at the next tick");
        }
        tokio::select! {
            _ = tokio::time::sleep(engine.worker.poll_interval) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// One tick: for each due schedule (locked, skipping those another worker
/// holds), sends one event per fire time since the last tick (the latest ones,
/// up to the catch-up bound), keyed by the fire time, and records the tick.
/// A never-ticked schedule is armed from now.
async fn cron_tick(engine: &EngineInner, ids: &[String]) -> Result<usize, Error> {
    let mut tx = engine.pool.begin().await.map_err(from_sqlx)?;
    let due = store::lock_due_schedules(&mut tx, ids).await.map_err(from_sqlx)?;
    if due.is_empty() {
        return Ok(0);
    }
    let mut events = Vec::new();
    for d in &due {
        let Some((schedule, catch_up)) =
            engine.functions.get(&d.function_id).and_then(|r| r.newest()).and_then(|r| r.schedule.as_ref())
        else {
            continue;
        };
        if let Some(last) = d.last_tick_at {
            let mut fires = schedule.latest_in(last, d.db_now, catch_up.bound() as usize);
            fires.reverse();
            for at in fires {
                let key = at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
                let event = crate::Event::new(
                    crate::schedule::cron_event_name(&d.function_id),
                    &crate::CronTick { scheduled_at: at },
                )
                .idempotency_key(key);
                events.push(event.prepare_internal(&engine.limits)?);
            }
        }
        let next = schedule.next_after(d.db_now);
        store::advance_schedule(&mut tx, &d.function_id, d.db_now, next).await.map_err(from_sqlx)?;
    }
    let fired = events.len();
    if fired > 0 {
        crate::event::insert(&mut tx, &events, store::Route::Queue).await?;
    }
    tx.commit().await.map_err(from_sqlx)?;
    if fired > 0 {
        tracing::info!(fired, "cron fire times sent");
    }
    Ok(fired)
}
