//! Metrics: their names, and the helpers the worker calls to record them
//! through the [`metrics`](https://docs.rs/metrics) facade.
//!
//! Durastep never installs a recorder. Without one (the default) every call
//! here is a no-op; install one in your application (for example
//! `metrics-exporter-prometheus`, as in `examples/prometheus`) and the worker's
//! metrics appear in it. Call [`describe`] after installing it to give each
//! metric its help text and unit.
//!
//! Labels are bounded: `function` is a function id, `step` a step name (the
//! name passed to [`Ctx::step`](crate::Ctx::step), not its numbered key
//! `name#2`), never a run id, an event key or anything from event data. Step
//! names are constants in your code, so their number is yours to keep small.
//!
//! Architecture invariant: this module only records; it reads nothing back and
//! holds no state, so the worker behaves the same with or without a recorder.
//!
//! ```
//! // The names are public, to refer to them in a recorder's configuration:
//! assert_eq!(durastep::metrics::RUNS_COMPLETED, "durastep_runs_completed_total");
//! ```

use std::time::{Duration, Instant};

use ::metrics::{Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

/// Counter: claims that started executing an attempt, by `function` and `kind`
/// (`first` for attempt 1, `retry` after a failed attempt). A run resumed after
/// a sleep or a wait goes on with the same attempt and counts again, with that
/// attempt's kind.
pub const RUNS_STARTED: &str = "durastep_runs_started_total";
/// Counter: runs whose handler returned and whose output was stored, by `function`.
pub const RUNS_COMPLETED: &str = "durastep_runs_completed_total";
/// Counter: runs that ended `failed` (out of attempts, or a permanent error), by `function`.
pub const RUNS_FAILED: &str = "durastep_runs_failed_total";
/// Counter: runs parked `diverged` (their replay parted from what they recorded), by `function`.
pub const RUNS_DIVERGED: &str = "durastep_runs_diverged_total";
/// Counter: attempts that failed and will be retried, by `function`.
pub const ATTEMPTS_FAILED: &str = "durastep_attempts_failed_total";
/// Counter: attempts that suspended their run (a sleep, a wait for an event, an invoke), by `function`.
pub const RUNS_SUSPENDED: &str = "durastep_runs_suspended_total";
/// Histogram (seconds): executed steps (`step` and `step_tx`, body and
/// checkpoint), by `function`, `step` (the step name) and `outcome` (`ok`, or
/// `error` when the step failed or its attempt ended during it). Replayed steps
/// are not timed.
pub const STEP_DURATION: &str = "durastep_step_duration_seconds";
/// Histogram (seconds): latency of the claim statement, by `claim` (`fast`:
/// the fast claim, `full`: the full claim with flow control).
pub const CLAIM_DURATION: &str = "durastep_claim_duration_seconds";
/// Histogram: runs claimed per claim statement (0 when nothing was due), by `claim`.
pub const CLAIM_BATCH_SIZE: &str = "durastep_claim_batch_size";
/// Histogram (seconds): one group commit of checkpoints and completions, retries included.
pub const CHECKPOINT_FLUSH_DURATION: &str = "durastep_checkpoint_flush_duration_seconds";
/// Histogram: writes (checkpoints and completions) per group commit.
pub const CHECKPOINT_FLUSH_BATCH_SIZE: &str = "durastep_checkpoint_flush_batch_size";
/// Gauge: runs due now and not running, by `function`; sampled by each worker
/// every reap interval.
pub const QUEUE_DEPTH: &str = "durastep_queue_depth";
/// Counter: attempts whose handler this worker dropped because it lost the
/// run's lease (fenced, or no heartbeat in time), by `function`.
pub const LEASES_LOST: &str = "durastep_leases_lost_total";
/// Counter: runs with an expired lease that the reaper took back, by `outcome`
/// (`queued` for a retry, `failed` when out of attempts). No `function` label:
/// the reaper's statement does not read it.
pub const RUNS_REAPED: &str = "durastep_runs_reaped_total";

/// Describes every Durastep metric (help text and unit) to the installed
/// recorder. Call it once, after installing the recorder; without one it does nothing.
///
/// ```
/// durastep::metrics::describe();
/// ```
pub fn describe() {
    describe_counter!(RUNS_STARTED, "Claims that started executing an attempt (kind: first or retry).");
    describe_counter!(RUNS_COMPLETED, "Runs completed.");
    describe_counter!(RUNS_FAILED, "Runs failed: out of attempts, or a permanent error.");
    describe_counter!(RUNS_DIVERGED, "Runs parked diverged: their replay parted from what they recorded.");
    describe_counter!(ATTEMPTS_FAILED, "Attempts failed that will be retried.");
    describe_counter!(RUNS_SUSPENDED, "Attempts that suspended their run (sleep, wait, invoke).");
    describe_histogram!(STEP_DURATION, Unit::Seconds, "Executed steps, body and checkpoint (not replays).");
    describe_histogram!(CLAIM_DURATION, Unit::Seconds, "Latency of the claim statement.");
    describe_histogram!(CLAIM_BATCH_SIZE, Unit::Count, "Runs claimed per claim statement.");
    describe_histogram!(CHECKPOINT_FLUSH_DURATION, Unit::Seconds, "One group commit of checkpoints.");
    describe_histogram!(CHECKPOINT_FLUSH_BATCH_SIZE, Unit::Count, "Writes per group commit.");
    describe_gauge!(QUEUE_DEPTH, Unit::Count, "Runs due now and not running.");
    describe_counter!(LEASES_LOST, "Attempts dropped because their lease was lost.");
    describe_counter!(RUNS_REAPED, "Runs with an expired lease taken back by the reaper.");
}

pub(crate) fn run_started(function: &str, attempt: u32) {
    let kind = if attempt <= 1 { "first" } else { "retry" };
    counter!(RUNS_STARTED, "function" => function.to_owned(), "kind" => kind).increment(1);
}

/// Adds one to a counter labelled only by `function` ([`RUNS_COMPLETED`],
/// [`RUNS_FAILED`], [`ATTEMPTS_FAILED`], [`RUNS_SUSPENDED`], [`LEASES_LOST`]).
pub(crate) fn count(name: &'static str, function: &str) {
    counter!(name, "function" => function.to_owned()).increment(1);
}

pub(crate) fn runs_reaped(outcome: &str) {
    counter!(RUNS_REAPED, "outcome" => outcome.to_owned()).increment(1);
}

/// One claim statement: `fast` for the fast claim (label `claim="fast"`),
/// else the full claim (`claim="full"`).
pub(crate) fn claimed(elapsed: Duration, runs: usize, fast: bool) {
    let claim = if fast { "fast" } else { "full" };
    histogram!(CLAIM_DURATION, "claim" => claim).record(elapsed);
    histogram!(CLAIM_BATCH_SIZE, "claim" => claim).record(runs as f64);
}

pub(crate) fn checkpoint_flushed(elapsed: Duration, writes: usize) {
    histogram!(CHECKPOINT_FLUSH_DURATION).record(elapsed);
    histogram!(CHECKPOINT_FLUSH_BATCH_SIZE).record(writes as f64);
}

pub(crate) fn queue_depth(function: &str, due: i64) {
    gauge!(QUEUE_DEPTH, "function" => function.to_owned()).set(due as f64);
}

/// Times one executed step. Recorded when dropped: `ok` if [`StepTimer::finish`]
/// was called, `error` otherwise (the step failed, or its future was dropped
/// because its attempt ended).
pub(crate) struct StepTimer {
    function: String,
    step: String,
    started: Instant,
    ok: bool,
}

impl StepTimer {
    pub(crate) fn start(function: &str, step: &str) -> Self {
        StepTimer { function: function.to_owned(), step: step.to_owned(), started: Instant::now(), ok: false }
    }

    /// The step finished: its output is stored.
    pub(crate) fn finish(mut self) {
        self.ok = true;
    }
}

impl Drop for StepTimer {
    fn drop(&mut self) {
        let outcome = if self.ok { "ok" } else { "error" };
        let (function, step) = (std::mem::take(&mut self.function), std::mem::take(&mut self.step));
        histogram!(STEP_DURATION, "function" => function, "step" => step, "outcome" => outcome)
            .record(self.started.elapsed());
    }
}
