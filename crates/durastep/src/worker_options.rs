//! How a worker runs ([`WorkerOptions`]): its slots, claims, lease,
//! heartbeats, reaping, shutdown, group commit and retention.

use std::time::Duration;

use crate::limits;

/// How a worker runs; see [`crate::EngineBuilder::worker_options`].
///
/// ```
/// use std::time::Duration;
/// let opts = durastep::WorkerOptions { max_in_flight: 256, lease: Duration::from_secs(60), ..Default::default() };
/// assert_eq!((opts.claim_batch, opts.claim_ahead), (128, 64));
/// ```
#[derive(Debug, Clone)]
// Not #[non_exhaustive]: build it with `..Default::default()`, so new fields stay compatible.
pub struct WorkerOptions {
    /// Attempts whose handler runs at once in this worker (default 64). An
    /// attempt whose handler has returned gives its slot to the next claim
    /// while its end (completion, failure, retry) is still being written.
    pub max_in_flight: usize,
    /// Runs claimed per round trip at most (default 128). A good part of a
    /// claim's cost is per statement, not per run (docs/performance.md
    /// "Larger claims"), so a busy worker takes what its free slots and
    /// [`claim_ahead`](Self::claim_ahead) allow in one round trip.
    pub claim_batch: usize,
    /// Runs claimed ahead of free slots (default 64, at most `max_in_flight`,
    /// and at most as many as this worker's slots freed in the last 100-200
    /// ms): claimed and leased, they wait in this worker and start the moment
    /// a slot frees, without a claim round trip in between; the buffer is
    /// refilled in one claim once half of it has started, and a run that
    /// waited a second without a slot is given back. Only runs of
    /// functions without claim-time flow rules or timeouts are claimed ahead
    /// beyond one run; a run of a flow-limited function is claimed for a
    /// free slot (or one ahead) and starts ahead of the buffered runs (if
    /// the other class's claim took the same free slots at the same moment,
    /// it waits for the next ones). 0 claims only for free slots.
    pub claim_ahead: usize,
    /// Longest wait between claims when no notification arrives (default 1 s):
    /// the bound on how late a timer can fire.
    pub poll_interval: Duration,
    /// How long a claim holds a run without a heartbeat (default 30 s).
    pub lease: Duration,
    /// How often held leases are extended (default lease / 3).
    pub heartbeat_interval: Duration,
    /// How often this worker looks for expired leases to reap (default 5 s).
    pub reap_interval: Duration,
    /// On shutdown, how long running attempts may go on before they are released (default 30 s).
    pub shutdown_grace: Duration,
    /// Use LISTEN/NOTIFY for low latency (default true); polling alone still
    /// guarantees progress. A worker that listens also offers its free slots,
    /// while it waits idle, to the one-event sends of every process, which
    /// then claim their new runs for it (migration 0036).
    pub listen: bool,
    /// Group-commit writer tasks (default 2): at most this many commits of
    /// checkpoints and completions in flight at once. A second one starts
    /// only with at least 64 writes; fewer wait for the next commit.
    pub writers: usize,
    /// Automatic pruning: when set, this worker deletes finished runs (with
    /// their steps, history and events) that finished longer ago than this,
    /// every `prune_interval`, as [`crate::Engine::prune`] does (default None:
    /// keep everything). Several workers may prune at once; they split the work.
    pub retention: Option<Duration>,
    /// How often a worker with `retention` prunes (default 60 s). Each round
    /// deletes at most 20 batches of 500 runs, so a large backlog is worked
    /// off over several rounds without long transactions.
    pub prune_interval: Duration,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            max_in_flight: 64,
            claim_batch: 128,
            claim_ahead: 64,
            poll_interval: Duration::from_secs(1),
            lease: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(10),
            reap_interval: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(30),
            listen: true,
            writers: 2,
            retention: None,
            prune_interval: Duration::from_secs(60),
        }
    }
}

impl WorkerOptions {
    /// Every duration cut to [`limits::MAX_DURATION`], so none can overflow an
    /// interval, a timestamp or an `Instant`.
    pub(crate) fn clamped(mut self) -> Self {
        let max = limits::MAX_DURATION;
        for d in [
            &mut self.poll_interval,
            &mut self.lease,
            &mut self.heartbeat_interval,
            &mut self.reap_interval,
            &mut self.shutdown_grace,
            &mut self.prune_interval,
        ] {
            *d = (*d).min(max);
        }
        self.retention = self.retention.map(|r| r.min(max));
        self
    }
}
