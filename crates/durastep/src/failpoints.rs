//! Named failpoints for the fault-injection suite.
//!
//! Compiled only with the `failpoints` feature; without it `failpoint!` expands
//! to nothing. Configure with the `DURASTEP_FAILPOINTS` environment variable
//! (read once) or [`set`]: a comma-separated list of `name=action`, where action
//! is `exit`, `panic`, `error`, `pause(ms)`, `block` or `off`, optionally
//! prefixed by a hit count, `3*exit` (fire on the third hit only), or a
//! percentage, `10%exit`. `block` holds every task that reaches the point until
//! [`release`] is called: a test can then do something else (complete a run)
//! exactly between two statements of the engine, without guessing a pause.
//!
//! The failpoints, in the order a run meets them, and what `error` does at each:
//!
//! | name | where | `error` |
//! |---|---|---|
//! | `claim-before-commit` | claim loop, before the claim statement | the round fails (backoff, retry) |
//! | `claim-after-commit` | after a claim that got runs | the claimed runs are dropped, as if the answer were lost: their leases expire |
//! | `claim-answered` | after every claim (and, when it found nothing, its read of its class's next due run), before the claim loop takes the answer | the round fails (backoff, retry); runs it claimed are dropped, as if the answer were lost: their leases expire |
//! | `wake-taken` | claim loop, after a wake-up ended the holds of the classes it names (and marked a class whose claim is in flight) | none: `pause(0)` counts the wake-ups the loop took ([`hits`]) |
//! | `notice-lost` | the worker's listener, a notice of runs a send of another process handed it, before it is read | the notice is dropped with the listener's connection, as if the connection died with it unread: the listener connects again, lists the claim records marked with the worker's offer, and the worker starts the runs of those it never heard of (a marker on its channel, which the failpoint lets through, says when) |
//! | `found-before-start` | the worker, a record of runs a send handed it through its offer, listed after its listener connected again and not heard of before: after its runs were read back, before they are started | none: `block` holds it there, so that a test can end a run meanwhile |
//! | `offer-full` | claim loop, a run a send of another process handed it through its offer when it has no free slot, before the run is given back | none: `pause(0)` counts them ([`hits`]) |
//! | `hand-over` | `Engine::send`, after the send claimed a new run for an idle worker of its process, before the worker takes it | refused, as by a worker that stopped meanwhile: the run is released at once (it keeps its place) and the workers are notified |
//! | `step-before-body` | `Ctx::step`, before the body | the step, so the attempt, fails |
//! | `step-after-body` | after the body, before its checkpoint is queued (also a sleep's wake-time checkpoint) | the attempt fails; the body runs again |
//! | `checkpoint-before-commit` | checkpoint writer, before the group commit | the flush fails: its steps' attempts fail, its completions are not stored |
//! | `checkpoint-after-commit` | after the group commit | the worker sees an error although the commit landed (ambiguous commit): the flush is retried and adopts its own rows |
//! | `step-after-checkpoint` | after a step's checkpoint is stored | the attempt fails; the step replays |
//! | `step-tx-before-commit` | `Ctx::step_tx`, before the transaction commits | rolled back; the attempt fails |
//! | `step-tx-after-commit` | `Ctx::step_tx` (and `Ctx::send_event`), after the transaction committed | the acknowledgement is lost: the ambiguous-commit path finds the step's own row and adopts it |
//! | `send-event-before-insert` | `Ctx::send_event`, inside the step's transaction, before the event is inserted | rolled back; the attempt fails |
//! | `sleep-after-arming` | `Ctx::sleep`, wake time stored, before suspending | the attempt fails |
//! | `wait-before-commit` | `Ctx::wait_for_event`, before the wait is recorded | the attempt fails (retryable); nothing is recorded |
//! | `wait-after-commit` | after the wait is recorded (or resolved) | the acknowledgement is lost: the attempt fails although the wait is stored; the run must still get its event |
//! | `invoke-before-commit` | `Ctx::invoke`, before the child is started | the attempt fails (retryable); no child |
//! | `invoke-after-commit` | after the child is started (or its outcome read) | the acknowledgement is lost: the attempt fails although the child exists; the retry must find it |
//! | `complete-before-commit` | before the completion is queued | the completion is not written: the lease expires |
//! | `heartbeat` | heartbeat round, before extending the leases | the round, and its own-clock check, are skipped |
//! | `reaper-between-select-and-update` | reaper pass, between its two statements | the pass fails |
//! | `release-before-commit` | worker shutdown, before a run still running after the grace is released | not released: its lease expires and the reaper requeues it |
//! | `cancel-before-commit` | `Engine::cancel`, before the cancel statement | the call fails; nothing is cancelled |
//! | `cancel-after-commit` | `Engine::cancel`, after the cancel committed | the call fails although the run is cancelled (lost acknowledgement) |
//! | `replay-before-commit` | `Engine::replay` and `Engine::replay_many`, before the replay statement | the call fails; nothing is replayed |
//!
//! ```
//! # #[cfg(feature = "failpoints")] {
//! durastep::failpoints::set("step-after-body", "2*exit");
//! # durastep::failpoints::set("step-after-body", "off"); }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// What a failpoint does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Exit the process at once with code 137 (as if SIGKILLed): no destructors run.
    Exit,
    /// Panic in the current task.
    Panic,
    /// Return an error from the surrounding operation.
    Error,
    /// Sleep this long, then go on.
    Pause(Duration),
    /// Wait until [`release`] is called for this failpoint, then go on.
    Block,
}

#[derive(Debug)]
struct Point {
    action: Action,
    /// Fire on this hit only (1-based); 0 means every hit (subject to percent).
    nth: u64,
    percent: u32,
    hits: AtomicU64,
    /// Cancelled by [`release`]: lets blocked tasks go.
    gate: CancellationToken,
    /// Tasks blocked here now.
    blocked: Arc<AtomicUsize>,
}

fn registry() -> &'static Mutex<HashMap<String, Point>> {
    static REG: OnceLock<Mutex<HashMap<String, Point>>> = OnceLock::new();
    REG.get_or_init(|| {
        let mut map = HashMap::new();
        if let Ok(spec) = std::env::var("DURASTEP_FAILPOINTS") {
            for item in spec.split(',').filter(|s| !s.trim().is_empty()) {
                if let Some((name, action)) = item.split_once('=')
                    && let Some(point) = parse(action.trim())
                {
                    map.insert(name.trim().to_owned(), point);
                }
            }
        }
        Mutex::new(map)
    })
}

fn parse(spec: &str) -> Option<Point> {
    let (nth, rest) = match spec.split_once('*') {
        Some((n, rest)) => (n.parse().ok()?, rest),
        None => (0, spec),
    };
    let (percent, rest) = match rest.split_once('%') {
        Some((p, rest)) => (p.parse().ok()?, rest),
        None => (100, rest),
    };
    let action = match rest {
        "exit" => Action::Exit,
        "panic" => Action::Panic,
        "error" => Action::Error,
        "block" => Action::Block,
        "off" => return None,
        other => {
            let ms = other.strip_prefix("pause(")?.strip_suffix(')')?.parse().ok()?;
            Action::Pause(Duration::from_millis(ms))
        }
    };
    Some(Point {
        action,
        nth,
        percent,
        hits: AtomicU64::new(0),
        gate: CancellationToken::new(),
        blocked: Arc::new(AtomicUsize::new(0)),
    })
}

/// Sets (or with `off`, clears) a failpoint at run time.
///
/// ```
/// durastep::failpoints::set("claim-after-commit", "off");
/// ```
pub fn set(name: &str, action: &str) {
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    let old = match parse(action) {
        Some(point) => reg.insert(name.to_owned(), point),
        None => reg.remove(name),
    };
    // Tasks blocked under the old setting go on.
    if let Some(old) = old {
        old.gate.cancel();
    }
}

/// Clears a failpoint and lets every task blocked at it (`block`) go on.
///
/// ```
/// durastep::failpoints::set("reaper-between-select-and-update", "block");
/// assert_eq!(durastep::failpoints::blocked("reaper-between-select-and-update"), 0);
/// durastep::failpoints::release("reaper-between-select-and-update");
/// ```
pub fn release(name: &str) {
    set(name, "off");
}

/// How many tasks are blocked at this failpoint now (`block`).
///
/// ```
/// assert_eq!(durastep::failpoints::blocked("no-such-point"), 0);
/// ```
pub fn blocked(name: &str) -> usize {
    let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    reg.get(name).map_or(0, |p| p.blocked.load(Ordering::SeqCst))
}

/// How many times this failpoint was reached since it was last set (0 when not set).
///
/// ```
/// durastep::failpoints::set("claim-before-commit", "pause(0)");
/// assert_eq!(durastep::failpoints::hits("claim-before-commit"), 0);
/// durastep::failpoints::set("claim-before-commit", "off");
/// ```
pub fn hits(name: &str) -> u64 {
    let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    reg.get(name).map_or(0, |p| p.hits.load(Ordering::SeqCst))
}

/// Whether a failpoint is set (to any action).
pub(crate) fn armed(name: &str) -> bool {
    registry().lock().unwrap_or_else(|p| p.into_inner()).contains_key(name)
}

/// Evaluates a failpoint: exits, panics, pauses or blocks as configured;
/// returns true when the caller must fail with an error.
pub async fn eval(name: &str) -> bool {
    let (action, gate, blocked) = {
        let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        let Some(point) = reg.get(name) else { return false };
        let hit = point.hits.fetch_add(1, Ordering::SeqCst) + 1;
        if point.nth != 0 && hit != point.nth {
            return false;
        }
        if point.percent < 100 && (uuid::Uuid::new_v4().as_u128() % 100) as u32 >= point.percent {
            return false;
        }
        if point.action == Action::Block {
            // Counted under the lock, so `blocked` is never behind a task that passed it.
            point.blocked.fetch_add(1, Ordering::SeqCst);
        }
        (point.action, point.gate.clone(), point.blocked.clone())
    };
    tracing::warn!(failpoint = name, ?action, "failpoint fired");
    match action {
        Action::Exit => std::process::exit(137),
        Action::Panic => panic!("failpoint {name}"),
        Action::Error => true,
        Action::Pause(d) => {
            tokio::time::sleep(d).await;
            false
        }
        Action::Block => {
            gate.cancelled().await;
            blocked.fetch_sub(1, Ordering::SeqCst);
            false
        }
    }
}
