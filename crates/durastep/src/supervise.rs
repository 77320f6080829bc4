//! Background tasks that a panic cannot stop for good: each is run again
//! when it panics (a bug, or the `panic` failpoint action), so the
//! heartbeats, the reaper, the pruner and the checkpoint writers keep going.

/// Runs a background task of the worker, and runs it again if it panics (a
/// bug, or the `panic` failpoint action), so that a panic cannot silently stop
/// the heartbeats, the reaper or a checkpoint writer for good. Returns when the
/// task returns.
pub(crate) fn spawn_supervised<F, Fut>(name: &'static str, make: F) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            match tokio::spawn(make()).await {
                Err(e) if e.is_panic() => {
                    tracing::error!(
                        task = name,
                        "worker task panicked: {}; restarting it",
                        panic_message(e.into_panic())
                    );
                }
                _ => return,
            }
        }
    })
}

/// The text of a panic's payload, for the log and for the attempt's error.
pub(crate) fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".to_owned())
}
