//! A worker running in the background of the calling process
//! ([`Engine::spawn_worker`](crate::Engine::spawn_worker)), and how to stop it
//! and wait until it has.

use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::error::Error;

/// A worker running as a task of the current Tokio runtime, from
/// [`Engine::spawn_worker`](crate::Engine::spawn_worker).
///
/// [`stop`](Self::stop) tells it to stop and waits until it has: it claims
/// nothing more, lets running attempts finish within the grace period
/// ([`WorkerOptions::shutdown_grace`](crate::WorkerOptions::shutdown_grace)),
/// and gives the rest back. Dropping the handle only tells it to stop; the
/// task goes on, using its connections, for as long as that takes.
/// So end with `stop` wherever something comes after the worker: a test
/// whose database is dropped once no connection to it is open, a process
/// that exits after its last line, a pool you close.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let worker = engine.spawn_worker();
/// engine.send(durastep::Event::new("user/signed-up", &7)).await?;
/// // ... serve requests ...
/// worker.stop().await?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
#[must_use = "dropping the handle tells the worker to stop at once"]
pub struct WorkerHandle {
    shutdown: CancellationToken,
    /// Cancels `shutdown` when the handle is dropped.
    _stop_on_drop: DropGuard,
    task: JoinHandle<Result<(), Error>>,
}

impl WorkerHandle {
    pub(crate) fn spawn<F>(shutdown: CancellationToken, worker: F) -> Self
    where
        F: Future<Output = Result<(), Error>> + Send + 'static,
    {
        let task = tokio::spawn(worker);
        WorkerHandle { _stop_on_drop: shutdown.clone().drop_guard(), shutdown, task }
    }

    /// Tells the worker to stop without waiting for it (as dropping the
    /// handle does); [`stop`](Self::stop) then waits.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let worker = engine.spawn_worker();
    /// worker.request_stop();
    /// // The attempts it runs have the grace period to finish.
    /// worker.stop().await?;
    /// # Ok(()) }
    /// ```
    pub fn request_stop(&self) {
        self.shutdown.cancel();
    }

    /// Whether the worker has returned (it was stopped, or it failed: `stop`
    /// then gives its error).
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) {
    /// let worker = engine.spawn_worker();
    /// assert!(!worker.is_finished());
    /// # }
    /// ```
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Tells the worker to stop and waits until it has; returns what the
    /// worker returned ([`Engine::run_worker`](crate::Engine::run_worker)).
    /// A panic of the worker's task is resumed here.
    ///
    /// ```no_run
    /// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
    /// let worker = engine.spawn_worker();
    /// worker.stop().await?;
    /// # Ok(()) }
    /// ```
    pub async fn stop(self) -> Result<(), Error> {
        self.shutdown.cancel();
        match self.task.await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // Nothing aborts the task but the runtime shutting down.
            Err(_) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A worker that returns once told to stop, with `result`.
    fn until_stopped(result: fn() -> Result<(), Error>) -> WorkerHandle {
        let shutdown = CancellationToken::new();
        let stopped = shutdown.clone();
        WorkerHandle::spawn(shutdown, async move {
            stopped.cancelled().await;
            result()
        })
    }

    /// Catches: a `stop` that returns before the worker has, or that drops
    /// what the worker returned.
    #[tokio::test]
    async fn stop_waits_for_the_worker_and_returns_what_it_returned() {
        let worker = until_stopped(|| Ok(()));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!worker.is_finished(), "the worker runs until it is told to stop");
        worker.stop().await.expect("the worker returned Ok");

        let failing = until_stopped(|| Err(Error::InvalidFunction("broken".into())));
        let err = failing.stop().await.expect_err("the worker's error comes back");
        assert!(matches!(err, Error::InvalidFunction(ref m) if m == "broken"), "{err:?}");
    }

    /// Catches: a panic of the worker's task swallowed by `stop` (a test
    /// would pass with a dead worker).
    #[tokio::test]
    #[should_panic(expected = "the worker broke")]
    async fn stop_resumes_a_panic_of_the_worker() {
        let worker = until_stopped(|| panic!("the worker broke"));
        worker.stop().await.ok();
    }
}
