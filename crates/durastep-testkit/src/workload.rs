//! A randomized workload checked against a model (issue 11): random functions
//! composed of every primitive, random operator actions over time, random
//! faults, and an oracle over the database afterwards.
//!
//! Worker processes need their functions compiled in, so the functions are a
//! **data-driven interpreter**: a run's *program* (a list of [`Prim`]) travels
//! in its event payload ([`WlInput`]), and one generic handler executes it. A
//! fixed family of functions ([`Flavor`]) gives every flow rule, `cancel_on`,
//! timeouts and a cron trigger; the worker binary registers them with
//! `--workload` ([`crate::WorkerConfig::workload`]).
//!
//! - [`Workload::generate`] turns a seed and a [`WorkloadConfig`] into a plan:
//!   a timeline of sends, operator actions and faults. The same seed gives the
//!   same plan ([`Workload::fingerprint`]).
//! - [`run`] executes a plan against a [`crate::Cluster`] whose workers run with
//!   `--workload`, drains it, and returns the oracle's [`Finding`]s
//!   ([`crate::checks::workload`]).
//! - [`KnownBugs`] switches each feature combination that today's main gets
//!   wrong (issue 11, bugs 1-4, 7-9) on or off, so a fix can be confirmed by
//!   turning its combination on; all are on by default.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use durastep::{
    Backoff, Backpressure, CancelOn, ChildError, Concurrency, Ctx, Debounce, Event, EventMatch, Function, HandlerError,
    Invoke, RateLimit, Singleton, SingletonMode, Throttle, WaitFor,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::ledger::Ledger;
use crate::tier::Rng;

mod driver;

pub use driver::{Finding, Outcome, run};

/// Every workload function id starts with this.
pub const PREFIX: &str = "wl-";
/// The event a [`Prim::Wait`] waits for (matched on `/token`).
pub const SIGNAL_EVENT: &str = "wl/signal";
/// The event that cancels [`Flavor::CancelOn`] runs whose `/key` equals its `/key`.
pub const CANCEL_EVENT: &str = "wl/cancel";
/// The ledger step key of one execution of a handler body (start to return or drop).
pub const BODY_KEY: &str = "body";
/// Attempts of every workload function but [`Flavor::Fragile`].
pub const MAX_ATTEMPTS: u32 = 50;
/// Attempts of [`Flavor::Fragile`] (the default `retries(3)` plus one... kept small).
pub const FRAGILE_ATTEMPTS: u32 = 3;
/// Per-key concurrency of [`Flavor::Concurrency`].
pub const CONCURRENCY_LIMIT: u32 = 2;
/// Starts per [`RATE_PERIOD`] of [`Flavor::Rate`], per key.
pub const RATE_LIMIT: u32 = 3;
/// Period of [`Flavor::Rate`] (database clock).
pub const RATE_PERIOD: Duration = Duration::from_secs(300);
/// Starts per [`THROTTLE_PERIOD`] of [`Flavor::Throttle`], per key (plus [`THROTTLE_BURST`]).
pub const THROTTLE_LIMIT: u32 = 3;
/// Burst of [`Flavor::Throttle`].
pub const THROTTLE_BURST: u32 = 1;
/// Period of [`Flavor::Throttle`] (database clock).
pub const THROTTLE_PERIOD: Duration = Duration::from_secs(120);
/// The "no timeout" of `wait_for_event` and `invoke` when bug 8 is exercised
/// (the library treats 100 years or more as no timeout).
pub const NO_TIMEOUT: Duration = Duration::from_secs(200 * 365 * 86_400);
/// The stand-in for "no timeout" when bug 8 is not exercised.
pub const LONG_TIMEOUT: Duration = Duration::from_secs(10 * 365 * 86_400);

/// The functions of the workload: one per flow rule or trigger kind, each
/// running the interpreter over its input's program.
///
/// ```
/// use durastep_testkit::workload::Flavor;
/// assert_eq!(Flavor::Concurrency.id(), "wl-concurrency");
/// assert_eq!(Flavor::Concurrency.event(), "wl/start/wl-concurrency");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Flavor {
    /// No flow rule.
    Plain,
    /// [`FRAGILE_ATTEMPTS`] attempts: worker losses must not spend them (bug 7).
    Fragile,
    /// Concurrency [`CONCURRENCY_LIMIT`] per `/key`.
    Concurrency,
    /// Shares a concurrency limit of 1 per `/key` with [`Flavor::SharedB`].
    SharedA,
    /// Shares a concurrency limit of 1 per `/key` with [`Flavor::SharedA`].
    SharedB,
    /// Throttled per `/key`.
    Throttle,
    /// Rate-limited per `/key` (the excess is skipped).
    Rate,
    /// Back-pressure per `/key`.
    Backpressure,
    /// Debounced per `/key`.
    Debounce,
    /// Singleton per `/key`, new events skipped.
    SingletonSkip,
    /// Singleton per `/key`, the old run cancelled.
    SingletonCancel,
    /// Priority from `/prio`.
    Priority,
    /// Cancelled by [`CANCEL_EVENT`] with the same `/key`.
    CancelOn,
    /// Start and finish timeouts.
    Timeouts,
    /// Only started by `invoke` (no flow rule).
    Child,
    /// A cron trigger (every minute of the database clock); runs one step.
    Cron,
}

impl Flavor {
    /// Every flavor.
    pub const ALL: [Flavor; 16] = [
        Flavor::Plain,
        Flavor::Fragile,
        Flavor::Concurrency,
        Flavor::SharedA,
        Flavor::SharedB,
        Flavor::Throttle,
        Flavor::Rate,
        Flavor::Backpressure,
        Flavor::Debounce,
        Flavor::SingletonSkip,
        Flavor::SingletonCancel,
        Flavor::Priority,
        Flavor::CancelOn,
        Flavor::Timeouts,
        Flavor::Child,
        Flavor::Cron,
    ];

    /// The function id.
    ///
    /// ```
    /// assert_eq!(durastep_testkit::workload::Flavor::Cron.id(), "wl-cron");
    /// ```
    pub fn id(self) -> &'static str {
        match self {
            Flavor::Plain => "wl-plain",
            Flavor::Fragile => "wl-fragile",
            Flavor::Concurrency => "wl-concurrency",
            Flavor::SharedA => "wl-shared-a",
            Flavor::SharedB => "wl-shared-b",
            Flavor::Throttle => "wl-throttle",
            Flavor::Rate => "wl-rate",
            Flavor::Backpressure => "wl-backpressure",
            Flavor::Debounce => "wl-debounce",
            Flavor::SingletonSkip => "wl-singleton-skip",
            Flavor::SingletonCancel => "wl-singleton-cancel",
            Flavor::Priority => "wl-priority",
            Flavor::CancelOn => "wl-cancel-on",
            Flavor::Timeouts => "wl-timeouts",
            Flavor::Child => "wl-child",
            Flavor::Cron => "wl-cron",
        }
    }

    /// The flavor of a function id.
    ///
    /// ```
    /// use durastep_testkit::workload::Flavor;
    /// assert_eq!(Flavor::from_id("wl-rate"), Some(Flavor::Rate));
    /// assert_eq!(Flavor::from_id("five-steps"), None);
    /// ```
    pub fn from_id(id: &str) -> Option<Flavor> {
        Flavor::ALL.into_iter().find(|f| f.id() == id)
    }

    /// The event that starts a run of it.
    ///
    /// ```
    /// assert_eq!(durastep_testkit::workload::Flavor::Plain.event(), "wl/start/wl-plain");
    /// ```
    pub fn event(self) -> String {
        format!("wl/start/{}", self.id())
    }

    /// Attempts a run gets.
    ///
    /// ```
    /// use durastep_testkit::workload::{Flavor, FRAGILE_ATTEMPTS};
    /// assert_eq!(Flavor::Fragile.max_attempts(), FRAGILE_ATTEMPTS);
    /// ```
    pub fn max_attempts(self) -> u32 {
        if self == Flavor::Fragile { FRAGILE_ATTEMPTS } else { MAX_ATTEMPTS }
    }

    /// The concurrency group and limit of its bodies per key, if it has one
    /// (a `SkipNew` singleton counts as a limit of 1; the `CancelOld` one has
    /// a concurrency limit of 1 besides).
    ///
    /// ```
    /// use durastep_testkit::workload::Flavor;
    /// assert_eq!(Flavor::SharedA.concurrency(), Flavor::SharedB.concurrency());
    /// assert_eq!(Flavor::Plain.concurrency(), None);
    /// ```
    pub fn concurrency(self) -> Option<(&'static str, u32)> {
        match self {
            Flavor::Concurrency => Some(("wl-concurrency", CONCURRENCY_LIMIT)),
            Flavor::SharedA | Flavor::SharedB => Some(("wl-shared", 1)),
            Flavor::SingletonSkip => Some(("wl-singleton-skip", 1)),
            Flavor::SingletonCancel => Some(("wl-singleton-cancel", 1)),
            _ => None,
        }
    }
}

/// One primitive of a program. Step names derive from the index `i` of the
/// primitive in its program, so they are deterministic.
///
/// ```
/// use durastep_testkit::workload::Prim;
/// let p = Prim::Step { delay_ms: 5 };
/// assert_eq!(serde_json::to_value(&p).unwrap(), serde_json::json!({"op": "step", "delay_ms": 5}));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Prim {
    /// `ctx.step("s<i>")`, whose body sleeps `delay_ms` (wall clock).
    Step {
        /// Body duration.
        delay_ms: u64,
    },
    /// `ctx.step_tx("t<i>")`: inserts one `testkit_wl_tx` row in the step's transaction.
    StepTx,
    /// `n` steps at once (`join_all`), `p<i>`, `p<i>#2`, ...
    Parallel {
        /// How many.
        n: u8,
        /// Body duration of each.
        delay_ms: u64,
    },
    /// `ctx.sleep("z<i>", ms)` (database clock).
    Sleep {
        /// How long.
        ms: u64,
    },
    /// A step that computes `db_time + ms`, then `ctx.sleep_until("z<i>", that)`.
    SleepUntil {
        /// How far ahead.
        ms: u64,
    },
    /// `ctx.wait_for_event("w<i>", SIGNAL_EVENT, /token = "<tag>.<i>", timeout)`.
    Wait {
        /// The timeout; `None`: the library's "no timeout" ([`NO_TIMEOUT`], or
        /// [`LONG_TIMEOUT`] with bug 8 off).
        timeout_ms: Option<u64>,
        /// Use [`NO_TIMEOUT`] (bug 8) rather than [`LONG_TIMEOUT`] when `timeout_ms` is `None`.
        unbounded: bool,
    },
    /// Two waits at once (`join!`), tokens `"<tag>.<i>a"` and `"<tag>.<i>b"` (bug 9).
    WaitPair {
        /// Timeout of both.
        timeout_ms: u64,
    },
    /// `ctx.send_event("e<i>", ...)`.
    Send {
        /// What is sent.
        what: SendWhat,
    },
    /// `ctx.invoke("c<i>", "wl-child", child, timeout)`; the child's result is ignored.
    Invoke {
        /// The timeout; `None`: "no timeout" as in [`Prim::Wait`].
        timeout_ms: Option<u64>,
        /// Use [`NO_TIMEOUT`] when `timeout_ms` is `None`.
        unbounded: bool,
        /// The child's input.
        child: Box<WlInput>,
    },
    /// Fails on attempts up to `attempts` (retryable), or on every attempt (permanent).
    Fail {
        /// Attempts that fail.
        attempts: u32,
        /// Permanent (ends the run at once).
        permanent: bool,
    },
    /// Panics on attempts up to `attempts`.
    Panic {
        /// Attempts that panic.
        attempts: u32,
    },
    /// Fails with `retry_after(ms)` on its first `attempts` executions (a
    /// back-pressure pause does not advance the attempt number).
    RetryAfter {
        /// The delay asked for.
        ms: u64,
        /// Attempts that fail.
        attempts: u32,
    },
}

/// What a [`Prim::Send`] sends.
///
/// ```
/// let s = durastep_testkit::workload::SendWhat::CancelKey { key: "k1".into() };
/// # let _ = s;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
#[non_exhaustive]
pub enum SendWhat {
    /// A [`SIGNAL_EVENT`] with this token.
    Signal {
        /// The token of some wait.
        token: String,
    },
    /// A [`CANCEL_EVENT`] for this key.
    CancelKey {
        /// The key.
        key: String,
    },
    /// Starts a run of `flavor` with `input`.
    Start {
        /// The function.
        flavor: Flavor,
        /// Its input.
        input: Box<WlInput>,
    },
}

/// The input of every workload run (its event payload).
///
/// ```
/// use durastep_testkit::workload::{Prim, WlInput};
/// let input = WlInput { tag: 7, key: "k1".into(), prio: 0, program: vec![Prim::StepTx] };
/// assert_eq!(input.expected_output(), serde_json::json!({"tag": 7, "ops": 1}));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WlInput {
    /// Unique per planned run: names its wait tokens.
    pub tag: u64,
    /// The flow key (`/key`).
    pub key: String,
    /// The priority (`/prio`, used by [`Flavor::Priority`]).
    pub prio: i32,
    /// What the handler does.
    pub program: Vec<Prim>,
}

impl WlInput {
    /// The output of a completed run: its tag and the number of primitives it executed.
    ///
    /// ```
    /// let i = durastep_testkit::workload::WlInput { tag: 1, key: "k".into(), prio: 0, program: vec![] };
    /// assert_eq!(i.expected_output()["ops"], 0);
    /// ```
    pub fn expected_output(&self) -> Value {
        json!({"tag": self.tag, "ops": self.program.len()})
    }

    /// What the program alone lets the run end as: `(may complete, may fail)`
    /// given `max_attempts`.
    ///
    /// The failures compose: an attempt stops at the first primitive that
    /// fails it, so a [`Prim::RetryAfter`] behind a [`Prim::Fail`] is reached
    /// (and fails its first execution) only on the first attempt that gets
    /// past the `Fail`. The model replays the attempts of a run without faults
    /// and counts how many the program needs. Faults never make a run need
    /// more: a lost lease advances the attempt number that `Fail` and `Panic`
    /// compare without spending a retry, and a killed execution of a
    /// `RetryAfter` counts among its executions. So a program that needs at
    /// most `max_attempts` must complete; one that needs more may fail, and may
    /// also complete when lost leases moved its attempt number on; a permanent
    /// failure always fails. A back-pressure pause is counted as an attempt
    /// here, which only matters past `max_attempts` (never for the functions
    /// with back-pressure, which have [`MAX_ATTEMPTS`]).
    ///
    /// ```
    /// use durastep_testkit::workload::{Prim, WlInput};
    /// let i = WlInput { tag: 1, key: "k".into(), prio: 0, program: vec![Prim::Fail { attempts: 1, permanent: true }] };
    /// assert_eq!(i.program_outcome(50), (false, true));
    /// // Two failing attempts, then a retry-after on the third: four are needed.
    /// let i = WlInput { tag: 1, key: "k".into(), prio: 0, program: vec![
    ///     Prim::Fail { attempts: 2, permanent: false },
    ///     Prim::RetryAfter { ms: 100, attempts: 1 },
    /// ] };
    /// assert_eq!(i.attempts_needed(), Some(4));
    /// assert_eq!(i.program_outcome(3), (true, true));
    /// assert_eq!(i.program_outcome(4), (true, false));
    /// ```
    pub fn program_outcome(&self, max_attempts: u32) -> (bool, bool) {
        match self.attempts_needed() {
            None => (false, true),
            Some(n) if n <= max_attempts => (true, false),
            Some(_) => (true, true),
        }
    }

    /// How many attempts the program needs to complete when nothing else
    /// fails it (no lost leases); `None` when it fails permanently.
    pub fn attempts_needed(&self) -> Option<u32> {
        let mut executions = vec![0u32; self.program.len()];
        let mut attempt = 1u32;
        'attempts: loop {
            for (i, p) in self.program.iter().enumerate() {
                match p {
                    Prim::Fail { permanent: true, .. } => return None,
                    Prim::Fail { attempts, .. } | Prim::Panic { attempts } if attempt <= *attempts => {
                        attempt += 1;
                        continue 'attempts;
                    }
                    Prim::RetryAfter { attempts, .. } => {
                        executions[i] += 1;
                        if executions[i] <= *attempts {
                            attempt += 1;
                            continue 'attempts;
                        }
                    }
                    _ => {}
                }
            }
            return Some(attempt);
        }
    }
}

/// Feature combinations that today's main gets wrong (issue 11). Each is
/// switchable so a fix can be confirmed by turning its combination on; all
/// are on by default.
///
/// ```
/// use durastep_testkit::workload::KnownBugs;
/// let only_bug_4 = KnownBugs { cancel_limited_running: true, ..KnownBugs::none() };
/// assert!(!only_bug_4.self_cancel);
/// assert!(KnownBugs::default().self_cancel);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KnownBugs {
    /// Bug 1: a `cancel_on` run sends the event that cancels its own key, and
    /// a `CancelOld` singleton run starts a new run of its own key.
    pub self_cancel: bool,
    /// Bug 2: the operator cancels runs that wait on `invoke`, and replays them.
    pub replay_waiting_parent: bool,
    /// Bug 3: debounced runs fail, sleep and wait (back to `queued` after they
    /// started) while events for their key keep coming.
    pub debounce_requeue: bool,
    /// Bug 4: running runs of concurrency-limited and singleton functions are
    /// cancelled (operator, `CancelOld`).
    pub cancel_limited_running: bool,
    /// Bug 7: runs of [`Flavor::Fragile`] (few attempts) under worker kills.
    pub worker_loss_retries: bool,
    /// Bug 8: waits and invokes with the library's "no timeout" (100 years or
    /// more) and huge `retry_after` delays.
    pub unbounded_times: bool,
    /// Bug 9: two `wait_for_event` at once in one handler.
    pub concurrent_waits: bool,
}

impl Default for KnownBugs {
    fn default() -> Self {
        KnownBugs::all()
    }
}

impl KnownBugs {
    /// Every combination on (the default).
    ///
    /// ```
    /// assert!(durastep_testkit::workload::KnownBugs::all().concurrent_waits);
    /// ```
    pub fn all() -> Self {
        KnownBugs {
            self_cancel: true,
            replay_waiting_parent: true,
            debounce_requeue: true,
            cancel_limited_running: true,
            worker_loss_retries: true,
            unbounded_times: true,
            concurrent_waits: true,
        }
    }

    /// Every combination off.
    ///
    /// ```
    /// assert!(!durastep_testkit::workload::KnownBugs::none().self_cancel);
    /// ```
    pub fn none() -> Self {
        KnownBugs {
            self_cancel: false,
            replay_waiting_parent: false,
            debounce_requeue: false,
            cancel_limited_running: false,
            worker_loss_retries: false,
            unbounded_times: false,
            concurrent_waits: false,
        }
    }

    /// From `DURASTEP_WORKLOAD_BUGS`: `all` (default when unset), `none`, or a
    /// comma-separated list of `1,2,3,4,7,8,9` (the issue's bug numbers) to
    /// turn on, each optionally prefixed by `-` to turn it off from `all`.
    ///
    /// ```
    /// use durastep_testkit::workload::KnownBugs;
    /// assert_eq!(KnownBugs::parse("none"), KnownBugs::none());
    /// assert!(KnownBugs::parse("4").cancel_limited_running);
    /// assert!(!KnownBugs::parse("4").self_cancel);
    /// assert!(!KnownBugs::parse("-1").self_cancel && KnownBugs::parse("-1").concurrent_waits);
    /// ```
    pub fn parse(spec: &str) -> Self {
        let spec = spec.trim();
        if spec.is_empty() || spec == "all" {
            return KnownBugs::all();
        }
        if spec == "none" {
            return KnownBugs::none();
        }
        let negative = spec.split(',').all(|s| s.trim().starts_with('-'));
        let mut bugs = if negative { KnownBugs::all() } else { KnownBugs::none() };
        for item in spec.split(',') {
            let item = item.trim();
            let (on, n) = match item.strip_prefix('-') {
                Some(n) => (false, n),
                None => (true, item),
            };
            match n {
                "1" => bugs.self_cancel = on,
                "2" => bugs.replay_waiting_parent = on,
                "3" => bugs.debounce_requeue = on,
                "4" => bugs.cancel_limited_running = on,
                "7" => bugs.worker_loss_retries = on,
                "8" => bugs.unbounded_times = on,
                "9" => bugs.concurrent_waits = on,
                _ => {}
            }
        }
        bugs
    }

    /// [`KnownBugs::parse`] of `DURASTEP_WORKLOAD_BUGS`, or all.
    ///
    /// ```
    /// let _ = durastep_testkit::workload::KnownBugs::from_env();
    /// ```
    pub fn from_env() -> Self {
        KnownBugs::parse(&std::env::var(BUGS_ENV).unwrap_or_default())
    }
}

/// The environment variable [`KnownBugs::from_env`] reads.
pub const BUGS_ENV: &str = "DURASTEP_WORKLOAD_BUGS";

/// Which faults the plan injects.
///
/// ```
/// let f = durastep_testkit::workload::Faults::default();
/// assert!(f.kills && f.pauses && f.failpoints && f.lost_acks);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Faults {
    /// SIGKILL a worker (restarted a moment later).
    pub kills: bool,
    /// SIGSTOP a worker for a while, then SIGCONT.
    pub pauses: bool,
    /// Failpoints (`error`, `exit`, `pause`) at random writes of a worker, for a while.
    pub failpoints: bool,
    /// Lost commit acknowledgements through the TCP proxy.
    pub lost_acks: bool,
    /// Restart Postgres (only when the workload runs on its own cluster).
    pub pg_restarts: bool,
}

impl Default for Faults {
    fn default() -> Self {
        Faults { kills: true, pauses: true, failpoints: true, lost_acks: true, pg_restarts: false }
    }
}

/// The size and mix of a workload.
///
/// ```
/// let c = durastep_testkit::workload::WorkloadConfig::ci();
/// assert!(c.workers >= 3);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadConfig {
    /// Runs sent by the operator (children and runs sent by runs come on top).
    pub runs: usize,
    /// How long the plan's timeline lasts (wall clock).
    pub duration: Duration,
    /// Worker processes.
    pub workers: usize,
    /// Operator actions (besides sends) on the timeline.
    pub actions: usize,
    /// Faults on the timeline.
    pub fault_events: usize,
    /// Which faults.
    pub faults: Faults,
    /// Which known-bug combinations.
    pub bugs: KnownBugs,
    /// Keys per flow rule (fewer keys: more contention).
    pub keys: usize,
}

impl WorkloadConfig {
    /// The CI tier: 25 s of load on 3 workers.
    ///
    /// ```
    /// assert_eq!(durastep_testkit::workload::WorkloadConfig::ci().workers, 3);
    /// ```
    pub fn ci() -> Self {
        WorkloadConfig {
            runs: 120,
            duration: Duration::from_secs(25),
            workers: 3,
            actions: 40,
            fault_events: 10,
            faults: Faults::default(),
            bugs: KnownBugs::from_env(),
            keys: 3,
        }
    }

    /// The soak tier: one plan of `minutes` minutes.
    ///
    /// ```
    /// assert!(durastep_testkit::workload::WorkloadConfig::soak(5).runs > 1_000);
    /// ```
    pub fn soak(minutes: u64) -> Self {
        let m = usize::try_from(minutes.max(1)).unwrap_or(1);
        WorkloadConfig {
            runs: 300 * m,
            duration: Duration::from_secs(60 * minutes.max(1)),
            workers: 4,
            actions: 100 * m,
            fault_events: 24 * m,
            faults: Faults::default(),
            bugs: KnownBugs::from_env(),
            keys: 4,
        }
    }
}

/// One thing the plan does at `at` (wall time from the start).
///
/// ```
/// let p = durastep_testkit::workload::Planned {
///     at: std::time::Duration::ZERO,
///     action: durastep_testkit::workload::Action::AdvanceClock { ms: 1_000 },
/// };
/// # let _ = p;
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    /// When, from the start of the plan.
    pub at: Duration,
    /// What.
    pub action: Action,
}

/// An operator action or a fault.
///
/// ```
/// let a = durastep_testkit::workload::Action::Cancel { tag: 3 };
/// # let _ = a;
/// ```
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Action {
    /// `Engine::send` of a run of `flavor` (`idempotency_key` repeats an earlier send's key and payload).
    Send {
        /// The function.
        flavor: Flavor,
        /// Its input.
        input: WlInput,
        /// The idempotency key.
        idempotency_key: Option<String>,
    },
    /// A [`SIGNAL_EVENT`] for a token (possibly before its wait exists).
    Signal {
        /// The token.
        token: String,
    },
    /// A [`CANCEL_EVENT`] for a key.
    CancelKey {
        /// The key.
        key: String,
    },
    /// `Engine::cancel` of the run sent with this tag.
    Cancel {
        /// The tag.
        tag: u64,
    },
    /// `Engine::replay` of the run sent with this tag.
    Replay {
        /// The tag.
        tag: u64,
        /// `ReplayFrom::Start` (else `FailedStep`).
        from_start: bool,
    },
    /// `Engine::replay_many` of the failed and cancelled runs of a flavor.
    ReplayMany {
        /// The function.
        flavor: Flavor,
        /// `ReplayFrom::Start`.
        from_start: bool,
    },
    /// `Engine::prune` of runs finished more than this long ago (database clock).
    Prune {
        /// The age.
        older_than_secs: u64,
    },
    /// `durastep::testing::advance_clock`.
    AdvanceClock {
        /// By how much.
        ms: u64,
    },
    /// SIGKILL of a worker, restarted `restart_after_ms` later.
    Kill {
        /// Worker index.
        worker: usize,
        /// Downtime.
        restart_after_ms: u64,
    },
    /// SIGSTOP of a worker for `ms`.
    Pause {
        /// Worker index.
        worker: usize,
        /// How long.
        ms: u64,
    },
    /// A failpoint set in a live worker for `ms`, then cleared.
    Failpoint {
        /// Worker index.
        worker: usize,
        /// Failpoint name.
        name: String,
        /// Its action (`durastep::failpoints` syntax).
        action: String,
        /// How long it stays set.
        ms: u64,
    },
    /// Cut connections right after `times` replies to statements containing `pattern`.
    LostAcks {
        /// SQL text to match.
        pattern: String,
        /// How many cuts.
        times: u64,
    },
    /// Restart Postgres (`-m fast`), when it is the workload's own cluster.
    RestartPostgres,
}

/// The failpoints a plan sets, with the actions it may give them.
pub const FAILPOINTS: [(&str, &[&str]); 20] = [
    ("claim-after-commit", &["20%error"]),
    ("step-before-body", &["10%error", "3*exit"]),
    ("step-after-body", &["10%error", "2*exit"]),
    ("checkpoint-before-commit", &["10%error"]),
    ("checkpoint-after-commit", &["20%error", "2*exit"]),
    ("step-after-checkpoint", &["10%error", "2*exit"]),
    ("step-tx-before-commit", &["20%error"]),
    ("step-tx-after-commit", &["30%error", "1*exit"]),
    ("send-event-before-insert", &["30%error"]),
    ("sleep-after-arming", &["20%error", "1*exit"]),
    ("wait-before-commit", &["30%error"]),
    ("wait-after-commit", &["30%error", "1*exit"]),
    ("invoke-before-commit", &["30%error"]),
    ("invoke-after-commit", &["30%error", "1*exit"]),
    ("complete-before-commit", &["10%error", "2*exit"]),
    ("heartbeat", &["pause(300)"]),
    ("reaper-between-select-and-update", &["pause(200)", "50%error"]),
    ("claim-before-commit", &["pause(100)"]),
    ("release-before-commit", &["error"]),
    // A notice of runs a send handed the worker through its offer, lost with
    // the listener's connection: the worker finds them after the reconnect.
    ("notice-lost", &["30%error"]),
];

/// The SQL the lost-acknowledgement faults cut after.
const ACK_PATTERNS: [&str; 4] = ["durastep.step_results", "COMMIT", "durastep.waits", "UPDATE durastep.runs"];

/// A generated plan: the seed, the runs it sends and its timeline.
///
/// ```
/// use durastep_testkit::workload::{Workload, WorkloadConfig};
/// let a = Workload::generate(42, &WorkloadConfig::ci());
/// let b = Workload::generate(42, &WorkloadConfig::ci());
/// assert_eq!(a.fingerprint(), b.fingerprint());
/// assert!(!a.timeline.is_empty());
/// ```
#[derive(Debug, Clone)]
pub struct Workload {
    /// The seed it was generated from.
    pub seed: u64,
    /// The config.
    pub config: WorkloadConfig,
    /// Everything the plan does, in time order.
    pub timeline: Vec<Planned>,
    /// Whether the driver runs a worker of its own (odd seeds). Its one-event
    /// sends then hand their runs to that worker in memory; without one (even
    /// seeds) they hand them to idle worker processes through their offers,
    /// whose notices the `notice-lost` failpoint loses.
    pub driver_worker: bool,
}

struct Gen<'a> {
    rng: Rng,
    config: &'a WorkloadConfig,
    next_tag: u64,
    /// Tokens of every planned wait, for signals.
    tokens: Vec<String>,
}

impl Gen<'_> {
    fn chance(&mut self, percent: u64) -> bool {
        self.rng.range(0, 100) < percent
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[usize::try_from(self.rng.range(0, items.len() as u64)).unwrap_or(0)]
    }

    fn key(&mut self) -> String {
        format!("k{}", self.rng.range(0, self.config.keys.max(1) as u64))
    }

    fn tag(&mut self) -> u64 {
        self.next_tag += 1;
        self.next_tag
    }

    fn input(&mut self, flavor: Flavor, depth: u32) -> WlInput {
        let tag = self.tag();
        let key = self.key();
        let prio = i32::try_from(self.rng.range(0, 5)).unwrap_or(0);
        let program = self.program(flavor, tag, &key, depth);
        WlInput { tag, key, prio, program }
    }

    fn program(&mut self, flavor: Flavor, tag: u64, key: &str, depth: u32) -> Vec<Prim> {
        let bugs = self.config.bugs;
        let len = self.rng.range(1, 6);
        let mut program = Vec::new();
        // Debounced runs stay simple unless bug 3 is on: nothing sends them back to queued.
        let simple = flavor == Flavor::Debounce && !bugs.debounce_requeue;
        let max_fail = flavor.max_attempts().saturating_sub(1).min(2);
        for i in 0..len {
            let roll = self.rng.range(0, 100);
            let p = if simple || roll < 25 {
                Prim::Step { delay_ms: self.rng.range(0, 120) }
            } else if roll < 35 {
                Prim::StepTx
            } else if roll < 40 {
                Prim::Parallel { n: u8::try_from(self.rng.range(2, 4)).unwrap_or(2), delay_ms: self.rng.range(0, 60) }
            } else if roll < 47 {
                Prim::Sleep { ms: self.rng.range(50, 3_000) }
            } else if roll < 51 {
                Prim::SleepUntil { ms: self.rng.range(50, 3_000) }
            } else if roll < 62 {
                let timeout_ms = if self.chance(60) { Some(self.rng.range(500, 20_000)) } else { None };
                self.tokens.push(format!("{tag}.{i}"));
                Prim::Wait { timeout_ms, unbounded: bugs.unbounded_times && self.chance(50) }
            } else if roll < 64 && bugs.concurrent_waits {
                self.tokens.push(format!("{tag}.{i}a"));
                self.tokens.push(format!("{tag}.{i}b"));
                Prim::WaitPair { timeout_ms: self.rng.range(1_000, 20_000) }
            } else if roll < 72 {
                Prim::Send { what: self.send_what(flavor, key, depth) }
            } else if roll < 79 && depth == 0 {
                let timeout_ms = if self.chance(60) { Some(self.rng.range(1_000, 30_000)) } else { None };
                let child = self.input(Flavor::Child, depth + 1);
                Prim::Invoke { timeout_ms, unbounded: bugs.unbounded_times && self.chance(50), child: Box::new(child) }
            } else if roll < 86 {
                Prim::Fail { attempts: self.rng.range(1, u64::from(max_fail) + 1) as u32, permanent: false }
            } else if roll < 88 {
                Prim::Fail { attempts: 1, permanent: true }
            } else if roll < 92 {
                Prim::Panic { attempts: self.rng.range(1, u64::from(max_fail) + 1) as u32 }
            } else if roll < 96 {
                let ms = if bugs.unbounded_times && self.chance(15) {
                    // Bug 8: far beyond what a timestamp holds.
                    u64::MAX / 4
                } else {
                    self.rng.range(100, 5_000)
                };
                Prim::RetryAfter { ms, attempts: 1 }
            } else {
                Prim::Step { delay_ms: self.rng.range(200, 900) }
            };
            program.push(p);
        }
        // Bug 3: a debounced run that goes back to queued (a back-pressure-style delay) after it started.
        if flavor == Flavor::Debounce && bugs.debounce_requeue && depth == 0 && self.chance(50) {
            program.insert(0, Prim::RetryAfter { ms: self.rng.range(1_000, 4_000), attempts: 1 });
        }
        // Bug 1: a run that cancels itself.
        if bugs.self_cancel && depth == 0 && self.chance(30) {
            match flavor {
                Flavor::CancelOn => {
                    let i = self.rng.range(0, program.len() as u64 + 1) as usize;
                    program.insert(i, Prim::Send { what: SendWhat::CancelKey { key: key.to_owned() } });
                }
                Flavor::SingletonCancel => {
                    let mut next = self.input(Flavor::SingletonCancel, depth + 1);
                    next.key = key.to_owned();
                    next.program.retain(|p| matches!(p, Prim::Step { .. }));
                    let i = self.rng.range(0, program.len() as u64 + 1) as usize;
                    program.insert(
                        i,
                        Prim::Send { what: SendWhat::Start { flavor: Flavor::SingletonCancel, input: Box::new(next) } },
                    );
                }
                _ => {}
            }
        }
        program
    }

    fn send_what(&mut self, flavor: Flavor, own_key: &str, depth: u32) -> SendWhat {
        let roll = self.rng.range(0, 100);
        if roll < 50 && !self.tokens.is_empty() {
            let i = self.rng.range(0, self.tokens.len() as u64) as usize;
            return SendWhat::Signal { token: self.tokens[i].clone() };
        }
        if roll < 75 {
            let mut key = self.key();
            if flavor == Flavor::CancelOn && key == own_key && !self.config.bugs.self_cancel {
                key = format!("{key}-other");
            }
            return SendWhat::CancelKey { key };
        }
        let target = self.pick(&[Flavor::Plain, Flavor::Concurrency, Flavor::Priority]);
        let mut input = self.input(target, depth + 1);
        input.program.retain(|p| matches!(p, Prim::Step { .. } | Prim::StepTx | Prim::Sleep { .. }));
        SendWhat::Start { flavor: target, input: Box::new(input) }
    }
}

fn contains_invoke(program: &[Prim]) -> bool {
    program.iter().any(|p| matches!(p, Prim::Invoke { .. }))
}

impl Workload {
    /// Generates the plan of `seed` (same seed and config: same plan).
    ///
    /// ```
    /// let w = durastep_testkit::workload::Workload::generate(1, &durastep_testkit::workload::WorkloadConfig::ci());
    /// assert_eq!(w.seed, 1);
    /// ```
    pub fn generate(seed: u64, config: &WorkloadConfig) -> Workload {
        let mut g = Gen { rng: Rng::new(seed), config, next_tag: 0, tokens: Vec::new() };
        let span = u64::try_from(config.duration.as_millis()).unwrap_or(u64::MAX).max(1);
        let bugs = config.bugs;
        let mut flavors: Vec<Flavor> = Flavor::ALL
            .into_iter()
            .filter(|f| !matches!(f, Flavor::Child | Flavor::Cron))
            .filter(|f| bugs.worker_loss_retries || *f != Flavor::Fragile)
            .filter(|f| bugs.cancel_limited_running || *f != Flavor::SingletonCancel)
            .collect();
        flavors.sort();
        let mut timeline = Vec::new();
        // Sends: the first 40 % of them in the first tenth (a backlog), the rest spread out.
        let mut sent: Vec<(u64, Flavor, WlInput, Option<String>, u64)> = Vec::new();
        for n in 0..config.runs {
            let at = if n * 10 < config.runs * 4 { g.rng.range(0, span / 10 + 1) } else { g.rng.range(0, span) };
            let repeat = !sent.is_empty() && g.chance(8);
            let i = g.rng.range(0, sent.len().max(1) as u64) as usize;
            // A repeated key of a debounced event whose run took a later event
            // returns no run ids (bug 3): only with that combination on.
            let repeat = repeat && (bugs.debounce_requeue || sent[i].1 != Flavor::Debounce);
            let (flavor, input, key) = if repeat {
                let (_, f, input, key, _) = sent[i].clone();
                let key = key.unwrap_or_else(|| format!("idem-{}", input.tag));
                sent[i].3 = Some(key.clone());
                (f, input, Some(key))
            } else {
                let flavor = g.pick(&flavors);
                let input = g.input(flavor, 0);
                let key = g.chance(30).then(|| format!("idem-{}", input.tag));
                (flavor, input, key)
            };
            // Without bug 3, debounced runs are all sent before any fault or clock move.
            let at = if flavor == Flavor::Debounce && !bugs.debounce_requeue { at % (span / 20 + 1) } else { at };
            sent.push((at, flavor, input, key, 0));
        }
        // A repeated key repeats the first send with that key, later.
        let mut first_at: HashMap<String, u64> = HashMap::new();
        for (at, flavor, input, key, _) in &sent {
            let at = match key {
                Some(k) => (*first_at.entry(k.clone()).or_insert(*at)).max(*at),
                None => *at,
            };
            timeline.push((at, Action::Send { flavor: *flavor, input: input.clone(), idempotency_key: key.clone() }));
        }
        let tags: Vec<(u64, Flavor, bool)> =
            sent.iter().map(|(_, f, i, _, _)| (i.tag, *f, contains_invoke(&i.program))).collect();
        let quiet_start = span / 20;
        for _ in 0..config.actions {
            let at = g.rng.range(quiet_start, span);
            let roll = g.rng.range(0, 100);
            let action = if roll < 20 && !g.tokens.is_empty() {
                let i = g.rng.range(0, g.tokens.len() as u64) as usize;
                Action::Signal { token: g.tokens[i].clone() }
            } else if roll < 28 {
                Action::CancelKey { key: g.key() }
            } else if roll < 50 {
                let (tag, flavor, invokes) = g.pick(&tags);
                let limited = flavor.concurrency().is_some();
                if (limited && !bugs.cancel_limited_running) || (invokes && !bugs.replay_waiting_parent) {
                    Action::AdvanceClock { ms: g.rng.range(200, 2_000) }
                } else {
                    Action::Cancel { tag }
                }
            } else if roll < 65 {
                let (tag, _, invokes) = g.pick(&tags);
                if invokes && !bugs.replay_waiting_parent {
                    Action::AdvanceClock { ms: g.rng.range(200, 2_000) }
                } else {
                    Action::Replay { tag, from_start: g.chance(40) }
                }
            } else if roll < 70 {
                let flavor = g.pick(&flavors);
                Action::ReplayMany { flavor, from_start: g.chance(40) }
            } else if roll < 73 {
                Action::Prune { older_than_secs: g.rng.range(600, 7_200) }
            } else {
                Action::AdvanceClock {
                    ms: if g.chance(80) { g.rng.range(200, 5_000) } else { g.rng.range(30_000, 120_000) },
                }
            };
            timeline.push((at, action));
        }
        // Bug 2: a parent cancelled while it waits on its child, replayed once the child may have finished.
        if bugs.replay_waiting_parent {
            let parents: Vec<u64> = tags.iter().filter(|t| t.2).map(|t| t.0).collect();
            for tag in parents {
                if g.chance(60) {
                    let at = g.rng.range(quiet_start, span * 2 / 3);
                    timeline.push((at, Action::Cancel { tag }));
                    timeline.push((at + g.rng.range(3_000, 12_000), Action::Replay { tag, from_start: g.chance(50) }));
                }
            }
        }
        // Bug 3: bursts of events for a debounced key, while its run may be back in queued.
        if bugs.debounce_requeue {
            let debounced: Vec<(u64, String)> =
                sent.iter().filter(|x| x.1 == Flavor::Debounce).map(|x| (x.0, x.2.key.clone())).collect();
            for (mut at, key) in debounced {
                for _ in 0..g.rng.range(1, 4) {
                    at += g.rng.range(300, 3_000);
                    let mut next = g.input(Flavor::Debounce, 0);
                    next.key = key.clone();
                    timeline.push((at, Action::Send { flavor: Flavor::Debounce, input: next, idempotency_key: None }));
                }
            }
        }
        let faults = config.faults;
        let mut kinds = Vec::new();
        if faults.kills {
            kinds.push(0);
        }
        if faults.pauses {
            kinds.push(1);
        }
        if faults.failpoints {
            kinds.push(2);
        }
        if faults.lost_acks {
            kinds.push(3);
        }
        if faults.pg_restarts {
            kinds.push(4);
        }
        if !kinds.is_empty() {
            for n in 0..config.fault_events {
                let at = g.rng.range(quiet_start, span);
                let worker = g.rng.range(0, config.workers.max(1) as u64) as usize;
                // At least three kills when kills are on (the issue asks for 3 or more).
                let kind = if faults.kills && n < 3 { 0 } else { g.pick(&kinds) };
                let action = match kind {
                    0 => Action::Kill { worker, restart_after_ms: g.rng.range(100, 2_500) },
                    1 => Action::Pause { worker, ms: g.rng.range(200, 4_000) },
                    2 => {
                        let (name, actions) = g.pick(&FAILPOINTS);
                        let action = g.pick(actions);
                        Action::Failpoint {
                            worker,
                            name: name.to_owned(),
                            action: action.to_owned(),
                            ms: g.rng.range(500, 4_000),
                        }
                    }
                    3 => Action::LostAcks { pattern: g.pick(&ACK_PATTERNS).to_owned(), times: g.rng.range(1, 6) },
                    _ => Action::RestartPostgres,
                };
                timeline.push((at, action));
            }
        }
        timeline.sort_by_key(|(at, _)| *at);
        let timeline =
            timeline.into_iter().map(|(at, action)| Planned { at: Duration::from_millis(at), action }).collect();
        Workload { seed, config: config.clone(), timeline, driver_worker: seed % 2 == 1 }
    }

    /// A digest of the plan, to compare two generations.
    ///
    /// ```
    /// use durastep_testkit::workload::{Workload, WorkloadConfig};
    /// assert_ne!(Workload::generate(1, &WorkloadConfig::ci()).fingerprint(),
    ///            Workload::generate(2, &WorkloadConfig::ci()).fingerprint());
    /// ```
    pub fn fingerprint(&self) -> u64 {
        // FNV-1a over the Debug text: stable within one build.
        let text = format!("{:?}", self.timeline);
        text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
    }

    /// How many actions of each kind the plan has (for the test's log).
    ///
    /// ```
    /// let w = durastep_testkit::workload::Workload::generate(3, &durastep_testkit::workload::WorkloadConfig::ci());
    /// assert!(w.summary().contains_key("send"));
    /// ```
    pub fn summary(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for p in &self.timeline {
            let k = match &p.action {
                Action::Send { .. } => "send",
                Action::Signal { .. } => "signal",
                Action::CancelKey { .. } => "cancel_key",
                Action::Cancel { .. } => "cancel",
                Action::Replay { .. } => "replay",
                Action::ReplayMany { .. } => "replay_many",
                Action::Prune { .. } => "prune",
                Action::AdvanceClock { .. } => "advance_clock",
                Action::Kill { .. } => "kill",
                Action::Pause { .. } => "pause",
                Action::Failpoint { .. } => "failpoint",
                Action::LostAcks { .. } => "lost_acks",
                Action::RestartPostgres => "restart_postgres",
            };
            *m.entry(k).or_insert(0) += 1;
        }
        m
    }
}

/// The workload's functions, for a worker (and for the driver's engine, which
/// registers them so that sends fan out before any worker has started).
///
/// ```no_run
/// # fn demo(ledger: durastep_testkit::Ledger) {
/// let functions = durastep_testkit::workload::functions(&ledger);
/// assert_eq!(functions.len(), durastep_testkit::workload::Flavor::ALL.len());
/// # }
/// ```
pub fn functions(ledger: &Ledger) -> Vec<Function> {
    Flavor::ALL.into_iter().map(|f| function(f, ledger.clone())).collect()
}

fn function(flavor: Flavor, ledger: Ledger) -> Function {
    let ms = Duration::from_millis;
    let mut b = Function::new(flavor.id()).retries(flavor.max_attempts() - 1).backoff(Backoff::Fixed(ms(30)));
    b = match flavor {
        Flavor::Cron => b.on_cron("* * * * *", chrono_tz::UTC),
        Flavor::Child => b,
        _ => b.on_event(flavor.event()),
    };
    b = match flavor {
        Flavor::Concurrency => b.concurrency(Concurrency::new(CONCURRENCY_LIMIT).key("/key")),
        Flavor::SharedA | Flavor::SharedB => b.concurrency(Concurrency::new(1).key("/key").shared("wl-shared")),
        Flavor::Throttle => {
            b.throttle(Throttle::new(THROTTLE_LIMIT, THROTTLE_PERIOD).burst(THROTTLE_BURST).key("/key"))
        }
        Flavor::Rate => b.rate_limit(RateLimit::new(RATE_LIMIT, RATE_PERIOD).key("/key")),
        Flavor::Backpressure => b.backpressure(Backpressure::new().key("/key")),
        Flavor::Debounce => b.debounce(Debounce::new(ms(500)).key("/key").max_wait(ms(5_000))),
        Flavor::SingletonSkip => b.singleton(Singleton::new(SingletonMode::SkipNew).key("/key")),
        // A `CancelOld` singleton alone keeps one run per key active, not one
        // body: the new run may start while the cancelled body is being
        // dropped (G28). With a concurrency limit of 1 on the key, as G28
        // advises, the cancelled body keeps its slot until it stops (G22),
        // which the oracle's limit of 1 checks.
        Flavor::SingletonCancel => b
            .singleton(Singleton::new(SingletonMode::CancelOld).key("/key"))
            .concurrency(Concurrency::new(1).key("/key")),
        Flavor::Priority => b.priority_from("/prio"),
        Flavor::CancelOn => b.cancel_on(CancelOn::event(CANCEL_EVENT).key("/key")),
        Flavor::Timeouts => b.start_timeout(Duration::from_secs(60)).finish_timeout(Duration::from_secs(120)),
        _ => b,
    };
    if flavor == Flavor::Cron {
        return b.handler(move |ctx: Ctx, tick: durastep::CronTick| {
            let ledger = ledger.clone();
            async move {
                let body = BodyGuard::begin(&ledger, &ctx).await?;
                let (c, l) = (ctx.clone(), ledger.clone());
                let at = tick.scheduled_at.to_rfc3339();
                let out: String = ctx
                    .step("tick", || async move {
                        let row = l.begin(c.run_id(), "tick", c.attempt()).await?;
                        l.end(row).await?;
                        Ok(at)
                    })
                    .await?;
                body.finish().await;
                Ok(out)
            }
        });
    }
    b.handler(move |ctx: Ctx, input: WlInput| {
        let ledger = ledger.clone();
        async move {
            let body = BodyGuard::begin(&ledger, &ctx).await?;
            let out = interpret(&ctx, &ledger, &input, &body).await;
            body.finish().await;
            out
        }
    })
}

/// The ledger row of one execution of a handler body: ended when the handler
/// returns, or (worker's wall clock) when its future is dropped.
struct BodyGuard {
    ledger: Ledger,
    row: Option<i64>,
    /// Set while the body is in a call that may suspend the run (sleep, wait,
    /// invoke): if the future is dropped there, the body stopped running user
    /// code when the call began (the engine parks a suspended handler until it
    /// drops it, after the suspension has committed and freed any slot).
    parked: Parked,
}

/// When the body stopped running user code, while it waits on the engine.
type Parked = std::sync::Arc<std::sync::Mutex<Option<chrono::DateTime<chrono::Utc>>>>;

fn park(parked: &Parked, on: bool) {
    *parked.lock().unwrap_or_else(|p| p.into_inner()) = on.then(chrono::Utc::now);
}

impl BodyGuard {
    async fn begin(ledger: &Ledger, ctx: &Ctx) -> crate::Result<BodyGuard> {
        let row = ledger.begin_at_epoch(ctx.run_id(), BODY_KEY, ctx.attempt(), ctx.lease_epoch()).await?;
        Ok(BodyGuard { ledger: ledger.clone(), row: Some(row), parked: Parked::default() })
    }

    /// The body enters (`true`) or leaves (`false`) a call that may suspend the run.
    fn park(&self, parked: bool) {
        park(&self.parked, parked);
    }

    async fn finish(mut self) {
        if let Some(row) = self.row.take() {
            end_body(&self.ledger, row, chrono::Utc::now()).await;
        }
    }
}

/// Records a body's end, retrying through a database restart (an end left
/// unrecorded would count as a body running forever).
async fn end_body(ledger: &Ledger, row: i64, at: chrono::DateTime<chrono::Utc>) {
    for _ in 0..60 {
        if ledger.end_at(row, at).await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

impl Drop for BodyGuard {
    fn drop(&mut self) {
        if let Some(row) = self.row.take() {
            let parked = *self.parked.lock().unwrap_or_else(|p| p.into_inner());
            let at = parked.unwrap_or_else(chrono::Utc::now);
            let ledger = self.ledger.clone();
            if let Ok(handle) = tokio::runtime::Handle::try_current() {
                handle.spawn(async move { end_body(&ledger, row, at).await });
            }
        }
    }
}

fn no_timeout(unbounded: bool) -> Duration {
    if unbounded { NO_TIMEOUT } else { LONG_TIMEOUT }
}

async fn recorded_step(
    ctx: &Ctx,
    ledger: &Ledger,
    key: String,
    delay_ms: u64,
    i: usize,
    parked: Parked,
) -> durastep::HandlerResult<Value> {
    let row = ledger.begin(ctx.run_id(), &key, ctx.attempt()).await?;
    if delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    }
    ledger.end(row).await?;
    // User code done: a failed or fenced checkpoint parks the handler until the engine drops it.
    park(&parked, true);
    Ok(json!({"i": i}))
}

/// Executes a program: the generic handler of every workload function.
async fn interpret(ctx: &Ctx, ledger: &Ledger, input: &WlInput, body: &BodyGuard) -> durastep::HandlerResult<Value> {
    let attempt = ctx.attempt();
    for (i, p) in input.program.iter().enumerate() {
        let suspends = matches!(
            p,
            Prim::Sleep { .. }
                | Prim::SleepUntil { .. }
                | Prim::Wait { .. }
                | Prim::WaitPair { .. }
                | Prim::Invoke { .. }
        );
        body.park(suspends);
        match p {
            Prim::Step { delay_ms } => {
                let (c, l, d, pk) = (ctx.clone(), ledger.clone(), *delay_ms, body.parked.clone());
                let key = format!("s{i}");
                let k2 = key.clone();
                let _: Value = ctx.step(&key, || async move { recorded_step(&c, &l, k2, d, i, pk).await }).await?;
            }
            Prim::StepTx => {
                let (run, l, pk) = (ctx.run_id(), ledger.clone(), body.parked.clone());
                let key = format!("t{i}");
                let k2 = key.clone();
                let _: i64 = ctx
                    .step_tx(&key, async move |conn| {
                        let epoch = l.wl_tx_effect(conn, run, &k2).await?;
                        park(&pk, true);
                        Ok(epoch)
                    })
                    .await?;
            }
            Prim::Parallel { n, delay_ms } => {
                let name = format!("p{i}");
                let futs: Vec<_> = (0..*n)
                    .map(|j| {
                        // Parallel bodies do not park the handler: the others may still run.
                        let (c, l, d, pk) = (ctx.clone(), ledger.clone(), *delay_ms, Parked::default());
                        let key = if j == 0 { name.clone() } else { format!("{name}#{}", j + 1) };
                        ctx.step(&name, move || async move { recorded_step(&c, &l, key, d, i, pk).await })
                    })
                    .collect();
                for r in join_all(futs).await {
                    let _: Value = r?;
                }
            }
            Prim::Sleep { ms } => ctx.sleep(&format!("z{i}"), Duration::from_millis(*ms)).await?,
            Prim::SleepUntil { ms } => {
                let (c, ms) = (ctx.clone(), *ms);
                let at: chrono::DateTime<chrono::Utc> = ctx
                    .step(&format!("u{i}"), || async move {
                        Ok(c.db_time() + chrono::Duration::milliseconds(i64::try_from(ms).unwrap_or(0)))
                    })
                    .await?;
                ctx.sleep_until(&format!("z{i}"), at).await?;
            }
            Prim::Wait { timeout_ms, unbounded } => {
                let timeout = timeout_ms.map_or(no_timeout(*unbounded), Duration::from_millis);
                let token = format!("{}.{i}", input.tag);
                let _: Option<Value> = ctx
                    .wait_for_event(
                        &format!("w{i}"),
                        WaitFor::event(SIGNAL_EVENT).matching(EventMatch::field("/token", &token)).timeout(timeout),
                    )
                    .await?;
            }
            Prim::WaitPair { timeout_ms } => {
                let timeout = Duration::from_millis(*timeout_ms);
                let (ta, tb) = (format!("{}.{i}a", input.tag), format!("{}.{i}b", input.tag));
                let (na, nb) = (format!("w{i}a"), format!("w{i}b"));
                let (a, b) = tokio::join!(
                    ctx.wait_for_event::<Value>(
                        &na,
                        WaitFor::event(SIGNAL_EVENT).matching(EventMatch::field("/token", &ta)).timeout(timeout)
                    ),
                    ctx.wait_for_event::<Value>(
                        &nb,
                        WaitFor::event(SIGNAL_EVENT).matching(EventMatch::field("/token", &tb)).timeout(timeout)
                    ),
                );
                a?;
                b?;
            }
            Prim::Send { what } => {
                let event = match what {
                    SendWhat::Signal { token } => Event::new(SIGNAL_EVENT, &json!({"token": token})),
                    SendWhat::CancelKey { key } => Event::new(CANCEL_EVENT, &json!({"key": key})),
                    SendWhat::Start { flavor, input } => Event::new(flavor.event(), input.as_ref()),
                };
                ctx.send_event(&format!("e{i}"), event).await?;
            }
            Prim::Invoke { timeout_ms, unbounded, child } => {
                let timeout = timeout_ms.map_or(no_timeout(*unbounded), Duration::from_millis);
                let _: Result<Value, ChildError> = ctx
                    .invoke(
                        &format!("c{i}"),
                        Invoke::function(Flavor::Child.id()).input(child.as_ref()).timeout(timeout),
                    )
                    .await?;
            }
            // A permanent failure fails every attempt: the model must not depend on
            // how many attempts worker losses used up.
            Prim::Fail { attempts, permanent } => {
                if *permanent || attempt <= *attempts {
                    let msg = format!("wl: planned failure at op {i} (attempt {attempt})");
                    return Err(if *permanent { HandlerError::permanent(msg) } else { HandlerError::new(msg) });
                }
            }
            Prim::Panic { attempts } => {
                if attempt <= *attempts {
                    panic!("wl: planned panic at op {i} (attempt {attempt})");
                }
            }
            // Back-pressure pauses do not advance the attempt: count executions instead.
            Prim::RetryAfter { ms, attempts } => {
                let key = format!("r{i}");
                let row = ledger.begin(ctx.run_id(), &key, attempt).await?;
                let executions = ledger.executions(ctx.run_id(), &key).await?;
                ledger.end(row).await?;
                if executions <= i64::from(*attempts) {
                    return Err(HandlerError::retry_after(
                        format!("wl: planned retry_after at op {i}"),
                        Duration::from_millis(*ms),
                    ));
                }
            }
        }
        body.park(false);
    }
    Ok(input.expected_output())
}

/// Awaits futures concurrently, in order (a small `join_all`: the crate does
/// not depend on `futures`).
async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    let mut set = Vec::with_capacity(futs.len());
    let mut futs: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut done: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, d) in futs.iter_mut().zip(done.iter_mut()) {
            if d.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *d = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    set.extend(done.into_iter().flatten());
    set
}
