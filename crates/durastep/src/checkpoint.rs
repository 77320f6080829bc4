//! Group commit of step results and run completions.
//!
//! Every attempt running in a worker hands its checkpoints to one queue; a few
//! writer tasks each take everything pending, store it in one statement (one
//! transaction, each write behind its own fencing check) and then release each
//! waiting step. A step is still durable before the next one starts; throughput
//! grows with the number of runs in flight instead of stopping at one commit per
//! step.
//!
//! A run row locked by another transaction (an application's `send_in` that
//! cancels the run, left open) does not hold up the batch: the flush skips it
//! and that run's writes are flushed apart, waiting for the lock.
//!
//! Architecture invariant: a flush is idempotent, so after an ambiguous failure
//! (the connection dropped during COMMIT) it is simply sent again: a checkpoint
//! that did land is adopted, a completion that did land is recognised by its epoch.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::{Mutex, Notify, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::error::is_transient_sqlx;
use crate::kept::Kept;
use crate::store::{self, Flushed, LockWait, PendingWrite, WriteOutcome};

type Reply = oneshot::Sender<Result<WriteOutcome, String>>;

/// Most bytes of outputs in one flush statement. Postgres refuses a message
/// over 1 GB, and each output may be as large as `Limits::max_payload_bytes`
/// (up to 255 MiB): a batch is cut into statements of at most this many bytes
/// (a single larger write goes alone), so many large steps at once never make
/// one statement approach the limit.
pub(crate) const MAX_FLUSH_BYTES: usize = 32 * 1024 * 1024;

/// Most writes waiting for a writer task; a step that finds the queue full
/// waits for room (back-pressure) instead of growing memory without bound.
pub(crate) const QUEUE_CAPACITY: usize = 4096;

/// Writes a writer task collects before it flushes while another task's
/// flush is still in flight. A smaller batch waits (collecting more) until
/// that flush ends or the batch reaches this size: a second commit in flight
/// pays off only when it carries enough writes; a few writes are cheaper
/// added to the next flush than committed on their own (docs/performance.md
/// "One commit in flight unless the batch is worth a second").
pub(crate) const OVERLAP_MIN_BATCH: usize = 64;

/// How many times a writer task with nothing in flight lets the steps its
/// last flush released run before it takes a smaller batch: each yield lets
/// every task queued on its thread run once, so steps that come back at once
/// (no work between two checkpoints) join this flush; a step that does real
/// work is not waited for.
const GATHER_YIELDS: usize = 4;

/// The sending side, cloned into every attempt's context.
#[derive(Clone)]
pub(crate) struct Writer {
    queue: mpsc::Sender<(PendingWrite, Reply)>,
}

/// How the writer tasks behave.
#[derive(Clone, Copy)]
pub(crate) struct WriterConfig {
    pub tasks: usize,
    pub max_batch: usize,
    /// How long a flush keeps retrying a transient database failure before the
    /// writes fail (the attempt then fails and is retried later).
    pub retry_for: Duration,
}

impl Writer {
    /// A writer that writes nothing (every write fails): for dry replays,
    /// which stop before their first write.
    pub(crate) fn closed() -> Writer {
        let (queue, _) = mpsc::channel(1);
        Writer { queue }
    }

    /// Starts the writer tasks. They stop when every `Writer` clone is dropped,
    /// or when `stop` is cancelled, after flushing what is already queued.
    pub(crate) fn spawn(
        pool: PgPool,
        stop: CancellationToken,
        config: WriterConfig,
    ) -> (Writer, Vec<tokio::task::JoinHandle<()>>) {
        let (shared, tx) = Shared::queue(pool.clone());
        // Supervised: a panicking flush fails its own batch (its steps see an
        // error and their attempts are retried), and the writer goes on.
        let handles = (0..config.tasks.max(1))
            .map(|_| {
                let (shared, stop) = (Arc::clone(&shared), stop.clone());
                crate::supervise::spawn_supervised("checkpoint writer", move || {
                    writer_task(Arc::clone(&shared), stop.clone(), config)
                })
            })
            .collect();
        (Writer { queue: tx }, handles)
    }

    /// Queues one write and waits until it is durable (or refused).
    pub(crate) async fn write(&self, write: PendingWrite) -> Result<WriteOutcome, String> {
        let (reply, answer) = oneshot::channel();
        self.queue.send((write, reply)).await.map_err(|_| "the worker is shutting down".to_owned())?;
        answer.await.map_err(|_| "the writer stopped".to_owned())?
    }
}

/// What the writer tasks share: the queue (one task collects at a time) and
/// how many flushes are in flight, with a signal when one ends.
struct Shared {
    rx: Mutex<mpsc::Receiver<(PendingWrite, Reply)>>,
    flushing: AtomicUsize,
    flushed: Notify,
    /// Writes of the flush that ended last: the steps it released are
    /// about to queue their next writes.
    released: AtomicUsize,
    /// The writer tasks' connections, kept between flushes.
    kept: Arc<Kept>,
}

impl Shared {
    /// The queue the steps write to, and what its writer tasks share.
    fn queue(pool: PgPool) -> (Arc<Shared>, mpsc::Sender<(PendingWrite, Reply)>) {
        let (tx, rx) = mpsc::channel(QUEUE_CAPACITY);
        let shared = Shared {
            rx: Mutex::new(rx),
            flushing: AtomicUsize::new(0),
            flushed: Notify::new(),
            released: AtomicUsize::new(0),
            kept: Kept::new(pool),
        };
        (Arc::new(shared), tx)
    }
}

/// Counts a flush of `writes` writes in flight until dropped (a panicking
/// flush included).
struct Flushing<'a> {
    shared: &'a Shared,
    writes: usize,
}

impl<'a> Flushing<'a> {
    fn start(shared: &'a Shared, writes: usize) -> Self {
        shared.flushing.fetch_add(1, Ordering::AcqRel);
        Flushing { shared, writes }
    }
}

impl Drop for Flushing<'_> {
    fn drop(&mut self) {
        self.shared.released.store(self.writes, Ordering::Release);
        self.shared.flushing.fetch_sub(1, Ordering::AcqRel);
        self.shared.flushed.notify_waiters();
    }
}

/// Collects the next batch into `batch`: everything queued, at least one
/// write; while another task's flush is in flight, goes on collecting until
/// that flush ends or the batch reaches [`OVERLAP_MIN_BATCH`]. `false` when
/// the task should stop (the queue closed, or `stop` with nothing left).
async fn collect(
    shared: &Shared,
    batch: &mut Vec<(PendingWrite, Reply)>,
    stop: &CancellationToken,
    max_batch: usize,
) -> bool {
    // One task collects while the others flush.
    let mut rx = shared.rx.lock().await;
    loop {
        let flushed = shared.flushed.notified();
        tokio::pin!(flushed);
        // Registered before the count is read, so an end between the two is not missed.
        flushed.as_mut().enable();
        let full = max_batch.min(OVERLAP_MIN_BATCH);
        if !batch.is_empty() && (batch.len() >= full || shared.flushing.load(Ordering::Acquire) == 0) {
            // With whatever else is queued by now; and, if the last flush
            // released more steps than this batch holds, with the next writes
            // of those that come back at once (without it, the first step
            // back went alone and the others waited a whole commit for it).
            take_queued(&mut rx, batch, max_batch);
            let expected = shared.released.load(Ordering::Acquire).min(full);
            for _ in 0..GATHER_YIELDS {
                if batch.len() >= expected {
                    break;
                }
                tokio::task::yield_now().await;
                take_queued(&mut rx, batch, max_batch);
            }
            return true;
        }
        let room = max_batch - batch.len();
        tokio::select! {
            n = rx.recv_many(batch, room) => {
                if n == 0 {
                    // Closed: flush what was collected, then stop.
                    return !batch.is_empty();
                }
            }
            _ = &mut flushed, if !batch.is_empty() => {}
            _ = stop.cancelled() => {
                // Flush what is already queued, then stop.
                take_queued(&mut rx, batch, max_batch);
                return !batch.is_empty();
            }
        }
    }
}

/// Moves what is queued now into `batch`, up to `max_batch` writes.
fn take_queued(
    rx: &mut mpsc::Receiver<(PendingWrite, Reply)>,
    batch: &mut Vec<(PendingWrite, Reply)>,
    max_batch: usize,
) {
    while batch.len() < max_batch {
        match rx.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
}

async fn writer_task(shared: Arc<Shared>, stop: CancellationToken, config: WriterConfig) {
    let mut batch = Vec::with_capacity(config.max_batch);
    loop {
        if !collect(&shared, &mut batch, &stop, config.max_batch).await {
            return;
        }
        let _flushing = Flushing::start(&shared, batch.len());
        let (writes, replies): (Vec<PendingWrite>, Vec<Reply>) = batch.drain(..).unzip();
        let ranges = chunks_by_bytes(&writes, MAX_FLUSH_BYTES);
        // Moved, not copied: a batch carries every pending output.
        let (mut writes, mut replies) = (writes.into_iter(), replies.into_iter());
        for range in ranges {
            let chunk: Vec<PendingWrite> = writes.by_ref().take(range.len()).collect();
            let chunk_replies: Vec<Reply> = replies.by_ref().take(range.len()).collect();
            flush_chunk(&shared.kept, chunk, chunk_replies, config.retry_for).await;
        }
    }
}

/// Flushes one chunk and answers its writes, skipping run rows that another
/// transaction holds locked (those are flushed apart, waiting for their locks,
/// so the next batches go on). If the server refuses a chunk of several writes,
/// each is flushed alone: one write the database refuses (an oversized value,
/// say) fails only its own step, not the others.
async fn flush_chunk(kept: &Arc<Kept>, writes: Vec<PendingWrite>, replies: Vec<Reply>, retry_for: Duration) {
    let started = Instant::now();
    let result = flush_with_retry(kept, &writes, retry_for, LockWait::Skip).await;
    crate::metrics::checkpoint_flushed(started.elapsed(), writes.len());
    match result {
        Ok(outcomes) => {
            let (mut done, mut busy) = (Vec::new(), Vec::new());
            for ((write, reply), outcome) in writes.into_iter().zip(replies).zip(outcomes) {
                match outcome {
                    Flushed::Done(o) => done.push((write, reply, o)),
                    Flushed::Busy => busy.push((write, reply)),
                }
            }
            if !busy.is_empty() {
                tracing::debug!(writes = busy.len(), "run rows locked by another transaction; flushing them apart");
                let apart = flush_apart(Arc::clone(kept), busy, retry_for);
                // With the after-commit failpoint armed, the writes skipped as
                // locked are stored before it is evaluated, so that "after the
                // commit" holds for every write of the chunk: an exit there then
                // leaves none of them unstored (the fault suite's model).
                #[cfg(feature = "failpoints")]
                if crate::failpoints::armed("checkpoint-after-commit") {
                    apart.await;
                } else {
                    tokio::spawn(apart);
                }
                #[cfg(not(feature = "failpoints"))]
                tokio::spawn(apart);
            }
            // The commit landed but the worker is told it failed (the ambiguous
            // case), for the writes this flush stored; those it skipped as
            // locked are stored or on their way apart, so a panic here cannot
            // drop them unstored. The error is retried as a failed commit is:
            // the writes are flushed again and adopt what landed.
            #[cfg(feature = "failpoints")]
            if crate::failpoints::eval("checkpoint-after-commit").await {
                tracing::warn!("failpoint checkpoint-after-commit: flushing the chunk's stored writes again");
                let again = done.into_iter().map(|(write, reply, _)| (write, reply)).collect();
                flush_apart(Arc::clone(kept), again, retry_for).await;
                return;
            }
            for (_, reply, outcome) in done {
                let _ = reply.send(Ok(outcome));
            }
        }
        // Only a refusal by the server (an oversized value, say) is worth
        // retrying write by write; any other error fails the whole chunk.
        Err(e) if writes.len() > 1 && matches!(e, sqlx::Error::Database(_)) && !is_transient_sqlx(&e) => {
            tracing::warn!(error = %e, writes = writes.len(), "checkpoint flush refused; storing its writes one by one");
            for (write, reply) in writes.into_iter().zip(replies) {
                flush_apart(Arc::clone(kept), vec![(write, reply)], retry_for).await;
            }
        }
        Err(e) => {
            let message = e.to_string();
            for reply in replies {
                let _ = reply.send(Err(message.clone()));
            }
        }
    }
}

/// Flushes writes apart from the batch, waiting for their run rows' locks.
async fn flush_apart(kept: Arc<Kept>, busy: Vec<(PendingWrite, Reply)>, retry_for: Duration) {
    let (writes, replies): (Vec<PendingWrite>, Vec<Reply>) = busy.into_iter().unzip();
    match flush_with_retry(&kept, &writes, retry_for, LockWait::Wait).await {
        Ok(outcomes) => {
            for (reply, outcome) in replies.into_iter().zip(outcomes) {
                let outcome = match outcome {
                    Flushed::Done(o) => Ok(o),
                    Flushed::Busy => Err("run row locked".to_owned()),
                };
                let _ = reply.send(outcome);
            }
        }
        Err(e) => {
            let message = e.to_string();
            for reply in replies {
                let _ = reply.send(Err(message.clone()));
            }
        }
    }
}

/// Cuts a batch into consecutive ranges whose outputs total at most `cap`
/// bytes each; a single write over `cap` makes a range of its own.
fn chunks_by_bytes(writes: &[PendingWrite], cap: usize) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0usize);
    for (i, w) in writes.iter().enumerate() {
        let size = w.output_len();
        if i > start && bytes + size > cap {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += size;
    }
    if start < writes.len() {
        out.push(start..writes.len());
    }
    out
}

async fn flush_with_retry(
    kept: &Arc<Kept>,
    writes: &[PendingWrite],
    retry_for: Duration,
    locks: LockWait,
) -> Result<Vec<Flushed>, sqlx::Error> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(20);
    // The checkpoint failpoints fire on a batch's own flush only, once per
    // try, as the fault suite's model counts them; not again when a write
    // whose row was locked (or that the server refused) is stored apart.
    // (`checkpoint-after-commit` fires in `flush_chunk`, after the flush.)
    #[cfg(feature = "failpoints")]
    let faults = matches!(locks, LockWait::Skip);
    loop {
        #[cfg(feature = "failpoints")]
        if faults && crate::failpoints::eval("checkpoint-before-commit").await {
            return Err(sqlx::Error::Protocol("failpoint checkpoint-before-commit".into()));
        }
        match kept.run(async |conn| store::flush_writes(conn, writes, locks).await).await {
            Err(e) if is_transient_sqlx(&e) && started.elapsed() < retry_for => {
                tracing::warn!(error = %e, "checkpoint flush failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StepTiming;

    fn cp(bytes: usize) -> PendingWrite {
        let timing = StepTiming { started_at: chrono::Utc::now(), finished_at: chrono::Utc::now(), attempt: 1 };
        PendingWrite::Checkpoint {
            fence: crate::store::Fence::unclaimed_for_tests(uuid::Uuid::nil(), 1),
            key: "k".into(),
            output: "x".repeat(bytes),
            timing,
            entry: (1, crate::journal::EntryKind::Step),
        }
    }

    /// Catches: a group-commit batch had no byte cap (512 writes of up to
    /// 255 MiB each in one statement, far past Postgres' 1 GB message limit).
    #[test]
    fn batches_are_cut_by_bytes_and_an_oversized_write_goes_alone() {
        let writes: Vec<PendingWrite> = [4, 4, 4, 20, 1, 1].into_iter().map(cp).collect();
        assert_eq!(chunks_by_bytes(&writes, 10), vec![0..2, 2..3, 3..4, 4..6]);
        assert_eq!(chunks_by_bytes(&writes, 100), vec![0..6]);
        assert!(chunks_by_bytes(&[], 10).is_empty());
        // 512 writes of 1 MiB (the default payload limit; 512 MiB in all) make
        // 17 statements of at most 32 MiB each.
        let big: Vec<PendingWrite> = (0..512).map(|_| cp(1024 * 1024)).collect();
        let chunks = chunks_by_bytes(&big, MAX_FLUSH_BYTES);
        assert_eq!(chunks.len(), 17);
        assert_eq!(chunks.iter().map(|r| r.len()).sum::<usize>(), 512);
        for r in chunks {
            assert!(big[r].iter().map(PendingWrite::output_len).sum::<usize>() <= MAX_FLUSH_BYTES);
        }
    }

    /// A pool that never connects: these tests flush nothing.
    fn nowhere() -> PgPool {
        sqlx::postgres::PgPoolOptions::new().connect_lazy("postgres://nobody@127.0.0.1:1/none").unwrap()
    }

    async fn queue(tx: &mpsc::Sender<(PendingWrite, Reply)>, n: usize) {
        for _ in 0..n {
            tx.send((cp(1), oneshot::channel().0)).await.unwrap();
        }
    }

    /// Catches: a second writer task committed a few writes on their own while
    /// the first task's flush was in flight (more commits, each paying its
    /// fixed cost: at 16 runs in flight and across processes the engine was
    /// 20-40% slower), instead of adding them to the next flush.
    #[tokio::test]
    async fn a_small_batch_waits_for_the_flush_in_flight() {
        let (shared, tx) = Shared::queue(nowhere());
        let in_flight = Flushing::start(&shared, 1);
        queue(&tx, 3).await;
        let collector = {
            let shared = Arc::clone(&shared);
            tokio::spawn(async move {
                let mut batch = Vec::new();
                let go = collect(&shared, &mut batch, &CancellationToken::new(), 512).await;
                (go, batch.len())
            })
        };
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(!collector.is_finished(), "3 writes were flushed beside a flush in flight");
        // More writes arrive meanwhile: they join the waiting batch.
        queue(&tx, 2).await;
        drop(in_flight);
        assert_eq!(collector.await.unwrap(), (true, 5));
    }

    /// Catches: a batch worth a commit of its own waited for the flush in
    /// flight (256 runs in flight in one process were 10% slower with one
    /// commit at a time).
    #[tokio::test]
    async fn a_batch_worth_a_commit_goes_beside_the_flush_in_flight() {
        let (shared, tx) = Shared::queue(nowhere());
        let _in_flight = Flushing::start(&shared, 1);
        queue(&tx, OVERLAP_MIN_BATCH).await;
        let mut batch = Vec::new();
        let waited = Duration::from_secs(10);
        let go = tokio::time::timeout(waited, collect(&shared, &mut batch, &CancellationToken::new(), 512)).await;
        assert_eq!(go, Ok(true), "a full batch waited for the flush in flight");
        assert_eq!(batch.len(), OVERLAP_MIN_BATCH);
        // With nothing in flight, one write goes at once.
        let (shared, tx) = Shared::queue(nowhere());
        queue(&tx, 1).await;
        let mut batch = Vec::new();
        assert!(collect(&shared, &mut batch, &CancellationToken::new(), 512).await);
        assert_eq!(batch.len(), 1);
    }

    /// Catches: with nothing in flight, the first step back from a flush was
    /// flushed alone and the others waited a whole commit for it (at 16 runs
    /// in flight, flushes of 1 and of 15 writes alternated).
    #[tokio::test]
    async fn the_steps_a_flush_released_join_the_next_flush() {
        let (shared, tx) = Shared::queue(nowhere());
        drop(Flushing::start(&shared, 3));
        queue(&tx, 1).await;
        for _ in 0..2 {
            let tx = tx.clone();
            tokio::spawn(async move { queue(&tx, 1).await });
        }
        let mut batch = Vec::new();
        assert!(collect(&shared, &mut batch, &CancellationToken::new(), 512).await);
        assert_eq!(batch.len(), 3);
        // Steps still at work are not waited for.
        drop(Flushing::start(&shared, 3));
        queue(&tx, 1).await;
        let mut batch = Vec::new();
        let stop = CancellationToken::new();
        let go = tokio::time::timeout(Duration::from_secs(10), collect(&shared, &mut batch, &stop, 512)).await;
        assert_eq!(go, Ok(true));
        assert_eq!(batch.len(), 1);
    }

    /// Catches: a stopping writer that waited for the flush in flight forever
    /// or dropped the writes it had collected.
    #[tokio::test]
    async fn a_stopping_writer_flushes_what_it_collected() {
        let (shared, tx) = Shared::queue(nowhere());
        let _in_flight = Flushing::start(&shared, 1);
        queue(&tx, 2).await;
        let stop = CancellationToken::new();
        stop.cancel();
        let mut batch = Vec::new();
        assert!(collect(&shared, &mut batch, &stop, 512).await);
        assert_eq!(batch.len(), 2);
        let mut empty = Vec::new();
        assert!(!collect(&shared, &mut empty, &stop, 512).await, "a stopped writer with nothing queued goes on");
    }

    /// Catches: the writer queue was an unbounded channel, so steps that
    /// produce faster than the database commits grew memory without bound.
    #[tokio::test]
    async fn the_writer_queue_is_bounded() {
        let pool = nowhere();
        let stop = CancellationToken::new();
        let config = WriterConfig { tasks: 1, max_batch: 1, retry_for: Duration::ZERO };
        let (writer, handles) = Writer::spawn(pool, stop.clone(), config);
        assert_eq!(writer.queue.max_capacity(), QUEUE_CAPACITY);
        stop.cancel();
        drop(writer);
        for h in handles {
            let _ = h.await;
        }
    }
}
