//! Group commit of step results and run completions.
//!
//! Every attempt running in a worker hands its checkpoints to one queue; a few
//! writer tasks each take everything pending, store it in one statement (one
//! transaction, each write behind its own fencing check) and then release each
//! waiting step. A step is still durable before the next one starts; throughput
//! grows with the number of runs in flight instead of stopping at one commit per
//! step.
//!
//! Architecture invariant: a flush is idempotent, so after an ambiguous failure
//! (the connection dropped during COMMIT) it is simply sent again: a checkpoint
//! that did land is adopted, a completion that did land is recognised by its epoch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::error::is_transient_sqlx;
use crate::store::{self, PendingWrite, WriteOutcome};

type Reply = oneshot::Sender<Result<WriteOutcome, String>>;

/// The sending side, cloned into every attempt's context.
#[derive(Clone)]
pub(crate) struct Writer {
    queue: mpsc::UnboundedSender<(PendingWrite, Reply)>,
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
    /// Starts the writer tasks. They stop when every `Writer` clone is dropped,
    /// or when `stop` is cancelled, after flushing what is already queued.
    pub(crate) fn spawn(
        pool: PgPool,
        stop: CancellationToken,
        config: WriterConfig,
    ) -> (Writer, Vec<tokio::task::JoinHandle<()>>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let rx = Arc::new(Mutex::new(rx));
        // Supervised: a panicking flush fails its own batch (its steps see an
        // error and their attempts are retried), and the writer goes on.
        let handles = (0..config.tasks.max(1))
            .map(|_| {
                let (pool, rx, stop) = (pool.clone(), Arc::clone(&rx), stop.clone());
                crate::worker::spawn_supervised("checkpoint writer", move || {
                    writer_task(pool.clone(), Arc::clone(&rx), stop.clone(), config)
                })
            })
            .collect();
        (Writer { queue: tx }, handles)
    }

    /// Queues one write and waits until it is durable (or refused).
    pub(crate) async fn write(&self, write: PendingWrite) -> Result<WriteOutcome, String> {
        let (reply, answer) = oneshot::channel();
        self.queue.send((write, reply)).map_err(|_| "the worker is shutting down".to_owned())?;
        answer.await.map_err(|_| "the writer stopped".to_owned())?
    }
}

async fn writer_task(
    pool: PgPool,
    rx: Arc<Mutex<mpsc::UnboundedReceiver<(PendingWrite, Reply)>>>,
    stop: CancellationToken,
    config: WriterConfig,
) {
    let mut batch = Vec::with_capacity(config.max_batch);
    loop {
        {
            // One task collects while the others flush.
            let mut rx = rx.lock().await;
            let received = tokio::select! {
                n = rx.recv_many(&mut batch, config.max_batch) => n,
                _ = stop.cancelled() => {
                    // Flush what is already queued, then stop.
                    while batch.len() < config.max_batch {
                        match rx.try_recv() {
                            Ok(item) => batch.push(item),
                            Err(_) => break,
                        }
                    }
                    if batch.is_empty() {
                        return;
                    }
                    batch.len()
                }
            };
            if received == 0 {
                return;
            }
        }
        let (writes, replies): (Vec<PendingWrite>, Vec<Reply>) = batch.drain(..).unzip();
        let started = Instant::now();
        let result = flush_with_retry(&pool, &writes, config.retry_for).await;
        crate::metrics::checkpoint_flushed(started.elapsed(), writes.len());
        match result {
            Ok(outcomes) => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(Ok(outcome));
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
}

async fn flush_with_retry(
    pool: &PgPool,
    writes: &[PendingWrite],
    retry_for: Duration,
) -> Result<Vec<WriteOutcome>, sqlx::Error> {
    let started = Instant::now();
    let mut delay = Duration::from_millis(20);
    loop {
        #[cfg(feature = "failpoints")]
        if crate::failpoints::eval("checkpoint-before-commit").await {
            return Err(sqlx::Error::Protocol("failpoint checkpoint-before-commit".into()));
        }
        #[allow(unused_mut)]
        let mut result = store::flush_writes(pool, writes).await;
        #[cfg(feature = "failpoints")]
        if result.is_ok() && crate::failpoints::eval("checkpoint-after-commit").await {
            // The commit landed but the worker is told it failed: the ambiguous case.
            result = Err(sqlx::Error::Protocol("failpoint checkpoint-after-commit".into()));
        }
        match result {
            Err(e) if is_transient_sqlx(&e) && started.elapsed() < retry_for => {
                tracing::warn!(error = %e, "checkpoint flush failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(1));
            }
            other => return other,
        }
    }
}
