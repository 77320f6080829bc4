//! Function definitions: an id, triggers, a retry policy and a typed handler.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use uuid::Uuid;

use crate::ctx::Ctx;
use crate::failure::{HandlerError, HandlerResult};
use crate::flow::{Backpressure, Concurrency, Debounce, FlowConfig, RateLimit, Singleton, Throttle};
use crate::schedule::{CatchUp, Schedule};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;
pub(crate) type ErasedHandler = Arc<dyn Fn(Ctx, Value) -> BoxFuture<HandlerResult<Value>> + Send + Sync>;

/// How long to wait before retrying after a failed attempt.
///
/// ```
/// use durastep::Backoff;
/// use std::time::Duration;
/// // Story A's policy: 30 s * attempts^2.
/// let b = Backoff::custom(|attempt| Duration::from_secs(30 * u64::from(attempt).pow(2)));
/// assert_eq!(b.delay(2), Duration::from_secs(120));
/// assert_eq!(Backoff::Fixed(Duration::from_secs(5)).delay(9), Duration::from_secs(5));
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub enum Backoff {
    /// `base * 2^(attempt-1)`, capped at `max`, with up to 25% random jitter (the default:
    /// 1 s base, 10 min cap).
    Exponential {
        /// Delay after the first failed attempt.
        base: Duration,
        /// Largest delay.
        max: Duration,
    },
    /// The same delay every time.
    Fixed(Duration),
    /// Any function of the failed attempt's number (1 for the first attempt).
    Custom(Arc<dyn Fn(u32) -> Duration + Send + Sync>),
}

impl Backoff {
    /// A custom backoff from a function of the attempt number.
    ///
    /// ```
    /// let b = durastep::Backoff::custom(|n| std::time::Duration::from_millis(100 * u64::from(n)));
    /// assert_eq!(b.delay(3).as_millis(), 300);
    /// ```
    pub fn custom(f: impl Fn(u32) -> Duration + Send + Sync + 'static) -> Self {
        Backoff::Custom(Arc::new(f))
    }

    /// The delay after failed attempt number `attempt` (1-based). The worker
    /// cuts it to [`crate::limits::MAX_RETRY_DELAY`].
    ///
    /// ```
    /// let d = durastep::Backoff::default().delay(1);
    /// assert!(d >= std::time::Duration::from_secs(1));
    /// ```
    pub fn delay(&self, attempt: u32) -> Duration {
        match self {
            Backoff::Exponential { base, max } => {
                let exp = attempt.saturating_sub(1).min(30);
                let raw = base.saturating_mul(1u32 << exp).min(*max);
                // Jitter from a v4 uuid's random bits: no extra dependency for a coin flip.
                let unit = (Uuid::new_v4().as_u128() % 1_000) as f64 / 1_000.0;
                raw.saturating_add(raw.mul_f64(0.25 * unit))
            }
            Backoff::Fixed(d) => *d,
            Backoff::Custom(f) => f(attempt),
        }
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::Exponential { base: Duration::from_secs(1), max: Duration::from_secs(600) }
    }
}

impl fmt::Debug for Backoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Backoff::Exponential { base, max } => {
                f.debug_struct("Exponential").field("base", base).field("max", max).finish()
            }
            Backoff::Fixed(d) => f.debug_tuple("Fixed").field(d).finish(),
            Backoff::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// A failed run, as the `on_failure` handler receives it.
///
/// ```
/// use durastep::{Function, FailedRun};
/// let f = Function::new("linkedin-budget")
///     .on_event("campaign/budget.requested")
///     .on_failure(|_ctx, failed: FailedRun<serde_json::Value>| async move {
///         println!("run {} failed after {} attempts: {}", failed.run_id, failed.attempts, failed.error);
///         Ok(())
///     })
///     .handler(|_ctx, _req: serde_json::Value| async move { Ok(()) });
/// # let _ = f;
/// ```
#[derive(Debug, Clone, serde::Deserialize, Serialize)]
#[non_exhaustive]
pub struct FailedRun<I> {
    /// The run that failed.
    pub run_id: Uuid,
    /// Its function.
    pub function_id: String,
    /// Its last error.
    pub error: String,
    /// How many attempts it had.
    pub attempts: u32,
    /// The event payload that started it.
    pub event: I,
}

/// Starts a function definition; finish it with [`FunctionBuilder::handler`].
///
/// ```
/// use durastep::{Ctx, Function};
/// #[derive(serde::Deserialize)]
/// struct Signup { email: String }
///
/// let welcome = Function::new("send-welcome")
///     .on_event("user/signed-up")
///     .retries(3)
///     .handler(|ctx: Ctx, signup: Signup| async move {
///         let id: String = ctx.step("send-mail", || async { Ok(format!("sent to {}", signup.email)) }).await?;
///         Ok(id)
///     });
/// assert_eq!(welcome.id(), "send-welcome");
/// ```
pub struct Function {
    pub(crate) id: String,
    pub(crate) triggers: Vec<String>,
    pub(crate) max_attempts: u32,
    pub(crate) backoff: Backoff,
    pub(crate) handler: ErasedHandler,
    pub(crate) on_failure: Option<ErasedHandler>,
    pub(crate) flow: FlowConfig,
    pub(crate) cancel_on: Vec<CancelRule>,
    /// Why the definition is invalid (reported by `build`).
    pub(crate) invalid: Vec<String>,
    pub(crate) schedule: Option<Schedule>,
    pub(crate) catch_up: CatchUp,
    pub(crate) start_timeout: Option<Duration>,
    pub(crate) finish_timeout: Option<Duration>,
    pub(crate) step_timeout: Option<Duration>,
    pub(crate) max_lease_losses: u32,
    pub(crate) version: u32,
}

/// One `cancel_on` rule: an event of this name cancels the runs whose own event
/// data has, at `run_path`, the value the new event has at `event_path`.
#[derive(Debug, Clone)]
pub(crate) struct CancelRule {
    pub event: String,
    pub event_path: Vec<String>,
    pub run_path: Vec<String>,
}

/// A rule that cancels a function's runs when an event arrives; see
/// [`FunctionBuilder::cancel_on`].
///
/// ```
/// use durastep::CancelOn;
/// // The paused campaign's runs: same `campaign_id` in both events.
/// let same = CancelOn::event("campaign/paused").key("/campaign_id");
/// // Different places: the event's `/id` against the run's `/campaign/id`.
/// let mapped = CancelOn::event("campaign/deleted").event_key("/id").run_key("/campaign/id");
/// # let _ = (same, mapped);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct CancelOn {
    event: String,
    event_key: Option<String>,
    run_key: Option<String>,
}

impl CancelOn {
    /// A rule for events with this name; give it a key.
    ///
    /// ```
    /// let r = durastep::CancelOn::event("order/cancelled").key("/order_id");
    /// # let _ = r;
    /// ```
    pub fn event(name: impl Into<String>) -> Self {
        CancelOn { event: name.into(), event_key: None, run_key: None }
    }

    /// Matches the new event and the run's own event at the same JSON pointer.
    ///
    /// ```
    /// let r = durastep::CancelOn::event("campaign/paused").key("/campaign_id");
    /// # let _ = r;
    /// ```
    pub fn key(mut self, pointer: impl Into<String>) -> Self {
        let pointer = pointer.into();
        self.event_key = Some(pointer.clone());
        self.run_key = Some(pointer);
        self
    }

    /// The JSON pointer into the cancelling event's data.
    ///
    /// ```
    /// let r = durastep::CancelOn::event("campaign/deleted").event_key("/id").run_key("/campaign_id");
    /// # let _ = r;
    /// ```
    pub fn event_key(mut self, pointer: impl Into<String>) -> Self {
        self.event_key = Some(pointer.into());
        self
    }

    /// The JSON pointer into the run's own event data.
    ///
    /// ```
    /// let r = durastep::CancelOn::event("campaign/deleted").event_key("/id").run_key("/campaign_id");
    /// # let _ = r;
    /// ```
    pub fn run_key(mut self, pointer: impl Into<String>) -> Self {
        self.run_key = Some(pointer.into());
        self
    }
}

impl Function {
    /// The cancel_on rules as stored in `durastep.functions.cancel_on`.
    pub(crate) fn cancel_on_json(&self) -> String {
        let rules: Vec<Value> = self
            .cancel_on
            .iter()
            .map(|c| serde_json::json!({"event": c.event, "event_path": c.event_path, "run_path": c.run_path}))
            .collect();
        Value::Array(rules).to_string()
    }

    /// Starts the definition of a function with this id (ASCII letters, digits, `-_.:`).
    ///
    /// ```
    /// let b = durastep::Function::new("meta-budget-update");
    /// # let _ = b;
    /// ```
    #[allow(clippy::new_ret_no_self)]
    pub fn new(id: impl Into<String>) -> FunctionBuilder {
        FunctionBuilder {
            id: id.into(),
            triggers: Vec::new(),
            max_attempts: 4,
            backoff: Backoff::default(),
            on_failure: None,
            flow: FlowConfig::default(),
            cancel_on: Vec::new(),
            invalid: Vec::new(),
            schedule: None,
            catch_up: CatchUp::default(),
            start_timeout: None,
            finish_timeout: None,
            step_timeout: None,
            max_lease_losses: DEFAULT_LEASE_LOSSES,
            version: 0,
        }
    }

    /// The function's id.
    ///
    /// ```
    /// let f = durastep::Function::new("f").handler(|_ctx, _x: ()| async { Ok(()) });
    /// assert_eq!(f.id(), "f");
    /// ```
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The function's version ([`FunctionBuilder::version`]; 0 unless set).
    ///
    /// ```
    /// let f = durastep::Function::new("f").version(3).handler(|_ctx, _x: ()| async { Ok(()) });
    /// assert_eq!(f.version(), 3);
    /// ```
    pub fn version(&self) -> u32 {
        self.version
    }
}

impl fmt::Debug for Function {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Function")
            .field("id", &self.id)
            .field("triggers", &self.triggers)
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("on_failure", &self.on_failure.is_some())
            .field("flow", &self.flow)
            .field("cancel_on", &self.cancel_on)
            .field("version", &self.version)
            .finish()
    }
}

/// A function definition under construction; see [`Function::new`].
#[must_use = "a function needs a handler"]
pub struct FunctionBuilder {
    id: String,
    triggers: Vec<String>,
    max_attempts: u32,
    backoff: Backoff,
    on_failure: Option<ErasedHandler>,
    flow: FlowConfig,
    cancel_on: Vec<CancelRule>,
    invalid: Vec<String>,
    schedule: Option<Schedule>,
    catch_up: CatchUp,
    start_timeout: Option<Duration>,
    finish_timeout: Option<Duration>,
    step_timeout: Option<Duration>,
    max_lease_losses: u32,
    version: u32,
}

/// How many lost leases a run survives by default before it fails; see
/// [`FunctionBuilder::lease_losses`].
///
/// ```
/// assert_eq!(durastep::DEFAULT_LEASE_LOSSES, 10);
/// ```
pub const DEFAULT_LEASE_LOSSES: u32 = 10;

impl FunctionBuilder {
    /// Runs this function on a cron schedule in a time zone (see [`Schedule`]
    /// for the syntax and for what happens on daylight-saving changes). Each
    /// fire time starts exactly one run, however many workers are up: every
    /// worker that has the function registered ticks the schedule (no leader),
    /// and the run for a fire time is created by an event whose idempotency key
    /// is that fire time. The run's input is a [`CronTick`](crate::CronTick) carrying its
    /// scheduled time. Fire times missed while no worker was running follow
    /// [`FunctionBuilder::catch_up`]. A schedule is first armed when a worker
    /// ticks it: fire times before that are not run. An expression that does
    /// not parse is refused at build ([`crate::Error::InvalidFunction`]).
    ///
    /// ```
    /// use durastep::{CronTick, Ctx, Function};
    /// // Story B: the Meta token rotation, first Monday of each quarter, 09:00 Amsterdam.
    /// let rotation = Function::new("meta-token-rotation")
    ///     .on_cron("0 9 * 1,4,7,10 MON#1", chrono_tz::Europe::Amsterdam)
    ///     .handler(|ctx: Ctx, tick: CronTick| async move {
    ///         ctx.step("rotate", || async move { Ok(tick.scheduled_at.to_rfc3339()) }).await
    ///     });
    /// # let _ = rotation;
    /// ```
    pub fn on_cron(mut self, expr: &str, tz: chrono_tz::Tz) -> Self {
        match Schedule::new(expr, tz) {
            Ok(s) => self.schedule = Some(s),
            Err(e) => self.invalid.push(e.to_string()),
        }
        self
    }

    /// What happens to the fire times of [`FunctionBuilder::on_cron`] missed
    /// while no worker was running (default [`CatchUp::Latest`]).
    ///
    /// ```
    /// let b = durastep::Function::new("hourly").on_cron("0 * * * *", chrono_tz::UTC).catch_up(durastep::CatchUp::Each { max: 24 });
    /// # let _ = b;
    /// ```
    pub fn catch_up(mut self, policy: CatchUp) -> Self {
        self.catch_up = policy;
        self
    }

    /// A run not started within `timeout` of its due time (its event's
    /// `start_at`, or when it was sent) is cancelled instead of started, with
    /// `cancel_reason` `"start timeout: not started by <time>"`. It is checked by
    /// the claim (such a run is never started) and by every worker's reaper pass
    /// (`WorkerOptions::reap_interval`), by the database clock. Retries of a
    /// run that did start are not affected.
    ///
    /// ```
    /// // A budget push that could not start within 10 minutes is stale: drop it.
    /// let b = durastep::Function::new("push").start_timeout(std::time::Duration::from_secs(600));
    /// # let _ = b;
    /// ```
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = Some(timeout);
        self
    }

    /// A run not finished within `timeout` of its due time is cancelled, in
    /// whatever state it is (queued, sleeping, waiting, or running: then it
    /// stops at its next step boundary, as with [`crate::Engine::cancel`]), with
    /// `cancel_reason` `"finish timeout: not finished by <time>"`. Checked by
    /// every worker's reaper pass and by the claim, by the database clock.
    ///
    /// ```
    /// let b = durastep::Function::new("nightly-import").finish_timeout(std::time::Duration::from_secs(4 * 3600));
    /// # let _ = b;
    /// ```
    pub fn finish_timeout(mut self, timeout: Duration) -> Self {
        self.finish_timeout = Some(timeout);
        self
    }

    /// The longest any step body of this function may run (default: no
    /// limit). When it passes, the body is stopped (its future is dropped at
    /// its next `.await`; a `step_tx` transaction is rolled back) and the
    /// attempt fails as retryable with `"step <name>: timed out after
    /// <timeout> (step timeout)"`, so the run is retried with the backoff. A
    /// step can set its own with [`crate::StepOptions::timeout`]. Heartbeats
    /// keep the lease of a hung body alive, so without a timeout a body that
    /// never returns holds its run (and its flow-control slots) until a
    /// [`FunctionBuilder::finish_timeout`] or a cancel. Sleeps, waits and
    /// invokes are not step bodies: they have their own timeouts.
    ///
    /// ```
    /// let b = durastep::Function::new("push").step_timeout(std::time::Duration::from_secs(120));
    /// # let _ = b;
    /// ```
    pub fn step_timeout(mut self, timeout: Duration) -> Self {
        self.step_timeout = Some(timeout);
        self
    }

    /// How many times a run may lose its lease (its worker was killed, crashed,
    /// was redeployed or stalled past its lease, or a claim's answer was lost)
    /// before it fails (default [`DEFAULT_LEASE_LOSSES`], 10). A lost lease is
    /// not the handler's failure, so it does not spend [`FunctionBuilder::retries`]:
    /// the reaper counts it here (`lease_losses` on the run), and the run is
    /// retried at once with the same attempt number. A run whose lease is lost
    /// more often than this fails with `"lease expired: ..."` (`on_failure`
    /// runs). 0 fails a run at its first lost lease.
    ///
    /// ```
    /// let b = durastep::Function::new("import").lease_losses(25);
    /// # let _ = b;
    /// ```
    pub fn lease_losses(mut self, losses: u32) -> Self {
        self.max_lease_losses = losses;
        self
    }

    /// Cancels this function's unfinished runs when the [`CancelOn`] rule's
    /// event arrives whose data, at the rule's event key, equals the value the
    /// run's own event data has at its run key. The cancel happens in the
    /// statement (and transaction) that stores the event: queued, sleeping and
    /// waiting runs never execute again; a running run stops at its next step
    /// boundary, as with [`crate::Engine::cancel`]. Runs whose data has no
    /// value at the key are never cancelled by it. Call it more than once for
    /// several rules. A rule without a key, or with an invalid pointer, is
    /// refused at build.
    ///
    /// ```
    /// use durastep::{CancelOn, Function};
    /// // A budget push is cancelled when its campaign is paused.
    /// let f = Function::new("meta-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .cancel_on(CancelOn::event("campaign/paused").key("/campaign_id"))
    ///     .handler(|_ctx, _req: serde_json::Value| async move { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn cancel_on(mut self, rule: CancelOn) -> Self {
        let (Some(event_key), Some(run_key)) = (&rule.event_key, &rule.run_key) else {
            self.invalid.push(format!(
                "cancel_on({:?}) needs a key: CancelOn::event(..).key(\"/field\") (or .event_key() and .run_key())",
                rule.event
            ));
            return self;
        };
        match (crate::flow::pointer_path(event_key), crate::flow::pointer_path(run_key)) {
            (Ok(event_path), Ok(run_path)) => {
                self.cancel_on.push(CancelRule { event: rule.event, event_path, run_path });
            }
            // build() refuses the definition with the reason.
            (Err(e), _) | (_, Err(e)) => self.invalid.push(format!("cancel_on: {e}")),
        }
        self
    }

    /// Triggers a run of this function for every event with this name. Call it more
    /// than once for several triggers.
    ///
    /// ```
    /// let b = durastep::Function::new("f").on_event("a/b").on_event("a/c");
    /// # let _ = b;
    /// ```
    pub fn on_event(mut self, name: impl Into<String>) -> Self {
        self.triggers.push(name.into());
        self
    }

    /// How many times a failed attempt is retried (default 3, so 4 attempts in all).
    ///
    /// ```
    /// let b = durastep::Function::new("f").retries(5);
    /// # let _ = b;
    /// ```
    pub fn retries(mut self, retries: u32) -> Self {
        self.max_attempts = retries.saturating_add(1);
        self
    }

    /// The delay before each retry (default exponential with jitter).
    ///
    /// ```
    /// let b = durastep::Function::new("f").backoff(durastep::Backoff::Fixed(std::time::Duration::from_secs(1)));
    /// # let _ = b;
    /// ```
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Runs once for every run of this function that ends `failed` (out of
    /// retries, permanent error, or reaped on its last attempt). It is itself a
    /// durable run with steps, so "one message to on-call" is sent once.
    ///
    /// ```
    /// # use durastep::FailedRun;
    /// let b = durastep::Function::new("f").on_failure(|_ctx, _f: FailedRun<serde_json::Value>| async { Ok(()) });
    /// # let _ = b;
    /// ```
    pub fn on_failure<I, F, Fut>(mut self, handler: F) -> Self
    where
        I: DeserializeOwned + Send + 'static,
        F: Fn(Ctx, FailedRun<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult<()>> + Send + 'static,
    {
        self.on_failure = Some(erase(format!("{}/on-failure", self.id), handler));
        self
    }

    fn rule(mut self, rule: crate::flow::Rule) -> Self {
        self.flow.rules.push(rule);
        self
    }

    /// At most `limit` attempts of this function execute at once per key, across
    /// every worker and process ([`Concurrency::key`] is a JSON pointer into
    /// the event data; without it, one limit over the whole function;
    /// [`Concurrency::shared`] shares it by name with other functions). A slot
    /// is held only while an attempt executes (state `running`); sleeping,
    /// waiting and queued runs hold none. Up to two concurrency limits per
    /// function; a run starts when it has a slot of both. A malformed pointer
    /// fails [`crate::EngineBuilder::build`]; an event that lacks the key is
    /// refused at send with [`crate::Error::MissingKey`].
    ///
    /// ```
    /// use durastep::{Concurrency, Function};
    /// // Story B: Meta allows 6 concurrent writes per ad account.
    /// let f = Function::new("meta-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .concurrency(Concurrency::new(6).key("/ad_account_id"))
    ///     .handler(|_ctx, _req: serde_json::Value| async { Ok(()) });
    /// // Story A: every function that calls Exact Online shares one slot.
    /// let draft = Function::new("exact-draft-invoice")
    ///     .on_event("deal/placement")
    ///     .concurrency(Concurrency::new(1).shared("exact-online"))
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = (f, draft);
    /// ```
    pub fn concurrency(self, limit: Concurrency) -> Self {
        self.rule(limit.rule())
    }

    /// Throttles starts per key with GCRA: at most `limit + burst` attempts start
    /// in any window of the period (with burst 0, starts are at least
    /// `period / limit` apart). Runs over the limit **wait** and start as capacity
    /// frees, in priority then arrival order; none is dropped. Use this when
    /// every event matters (a budget change).
    ///
    /// ```
    /// use durastep::{Function, Throttle};
    /// // Story B: at most 100 starts per minute per LinkedIn account.
    /// let f = Function::new("linkedin-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .throttle(Throttle::per_minute(100).key("/account_id"))
    ///     .handler(|_ctx, _req: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn throttle(self, throttle: Throttle) -> Self {
        self.rule(throttle.rule())
    }

    /// Rate-limits starts per key with GCRA: at most `limit` attempts start in
    /// any window of the period (at least `period / limit` apart). A run over the
    /// limit is **not started**: it ends in state `skipped`, with the reason in
    /// `last_error`. Use this when only the latest or a sample matters (a
    /// "refresh the dashboard" event); use [`FunctionBuilder::throttle`] when
    /// every event must be processed.
    ///
    /// ```
    /// use durastep::{Function, RateLimit};
    /// use std::time::Duration;
    /// let f = Function::new("refresh-report")
    ///     .on_event("report/stale")
    ///     .rate_limit(RateLimit::new(1, Duration::from_secs(300)).key("/client_id"))
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn rate_limit(self, limit: RateLimit) -> Self {
        self.rule(limit.rule())
    }

    /// Key back-pressure: when an attempt fails with
    /// [`HandlerError::retry_after`] (an HTTP 429 with Retry-After), the whole
    /// key pauses until then: no attempt of this function with that key starts
    /// before it. Such a retry does not count as an attempt, up to
    /// [`crate::BACKPRESSURE_FREE_RETRIES`] times per run. The key is private to
    /// this function unless [`Backpressure::shared`] names it.
    ///
    /// ```
    /// use durastep::{Backpressure, Function};
    /// let f = Function::new("linkedin-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .backpressure(Backpressure::new().key("/account_id").shared("linkedin-writes"))
    ///     .handler(|_ctx, _req: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn backpressure(self, backpressure: Backpressure) -> Self {
        self.rule(backpressure.rule())
    }

    /// Debounces events per key: a burst of events produces one run, with the
    /// latest event's data, that starts the debounce period after the last
    /// event of the burst, and never later than its `max_wait` after the first.
    /// An event that arrives once the run has started begins a new burst, also
    /// while the started run is queued again (a retry's backoff, a release, a
    /// reaped lease), whose event and due time are left alone. Every send of a
    /// burst, and a repeated send of any of its events, names the burst's run.
    ///
    /// ```
    /// use durastep::{Debounce, Function};
    /// use std::time::Duration;
    /// let f = Function::new("resync-contact")
    ///     .on_event("contact/changed")
    ///     .debounce(Debounce::new(Duration::from_secs(30)).key("/contact_id").max_wait(Duration::from_secs(300)))
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn debounce(mut self, debounce: Debounce) -> Self {
        self.flow.debounce = Some(debounce);
        self
    }

    /// At most one active (queued, running, sleeping or waiting) run per key;
    /// the [`crate::SingletonMode`] says what a new event for a busy key does.
    ///
    /// ```
    /// use durastep::{Function, Singleton, SingletonMode};
    /// let f = Function::new("rotate-token")
    ///     .on_event("token/expiring")
    ///     .singleton(Singleton::new(SingletonMode::SkipNew).key("/account_id"))
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn singleton(mut self, singleton: Singleton) -> Self {
        self.flow.singleton = Some(singleton);
        self
    }

    /// Takes each run's priority from the event data (an integer at this JSON
    /// pointer; higher runs first among due runs), clamped to the function's
    /// [`FunctionBuilder::priority_range`] (default
    /// [`crate::DEFAULT_PRIORITY_RANGE`], -100 to 100), so a sender cannot put
    /// its runs ahead of everything by writing a huge number. An event without
    /// a number there keeps the priority it was sent with
    /// ([`crate::Event::priority`], set by your code, not clamped).
    ///
    /// ```
    /// let f = durastep::Function::new("notify")
    ///     .on_event("deal/stage.changed")
    ///     .priority_from("/urgency")
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn priority_from(mut self, pointer: &str) -> Self {
        self.flow.priority_from = Some(pointer.to_owned());
        self
    }

    /// The range a priority taken from event data ([`FunctionBuilder::priority_from`])
    /// is clamped to (default [`crate::DEFAULT_PRIORITY_RANGE`]). An empty range
    /// is refused at build.
    ///
    /// ```
    /// let f = durastep::Function::new("notify")
    ///     .on_event("deal/stage.changed")
    ///     .priority_from("/urgency")
    ///     .priority_range(0..=10)
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn priority_range(mut self, range: std::ops::RangeInclusive<i32>) -> Self {
        self.flow.priority_range = Some(range);
        self
    }

    /// The function's version (default 0): each run starts under the newest
    /// version the registering engine has and keeps it for good, and a worker
    /// claims only runs of the versions it registers. To change a handler in
    /// a way its runs in flight would not replay, give the new code a new
    /// version and keep registering the old version's handler beside it (the
    /// same id, its old version) until no run of the old version is
    /// unfinished; then delete it.
    ///
    /// Of the versions of one id registered together, the newest defines the
    /// function (its triggers, retries, flow control, schedule, cancel rules,
    /// timeouts and `on_failure` are what is registered); an older version
    /// contributes its handler, with its own backoff, step timeout and
    /// `on_failure` handler, for its own runs only. Versions are numbers so
    /// that "newest" is never ambiguous. Two definitions with the same id and
    /// version are refused at build.
    ///
    /// ```
    /// use durastep::{Ctx, Engine, Function};
    /// // v1 charged in one step; v2 reserves, then captures.
    /// let v1 = Function::new("billing").on_event("invoice/due").version(1)
    ///     .handler(|ctx: Ctx, id: u64| async move { ctx.step("charge", || async move { Ok(id) }).await });
    /// let v2 = Function::new("billing").on_event("invoice/due").version(2)
    ///     .handler(|ctx: Ctx, id: u64| async move {
    ///         ctx.step("reserve", || async move { Ok(id) }).await?;
    ///         ctx.step("capture", || async move { Ok(id) }).await
    ///     });
    /// // New runs start under 2; the runs of 1 drain on v1's handler.
    /// let b = Engine::builder().function(v2).function(v1);
    /// # let _ = b;
    /// ```
    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Finishes the definition with its handler. The handler gets a [`Ctx`] and
    /// the event payload deserialized into `I`; its output is stored on the run.
    ///
    /// ```
    /// let f = durastep::Function::new("double").on_event("n").handler(|_ctx, n: u64| async move { Ok(n * 2) });
    /// # let _ = f;
    /// ```
    pub fn handler<I, O, F, Fut>(self, handler: F) -> Function
    where
        I: DeserializeOwned + Send + 'static,
        O: Serialize + Send + 'static,
        F: Fn(Ctx, I) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult<O>> + Send + 'static,
    {
        Function {
            handler: erase(self.id.clone(), handler),
            id: self.id,
            triggers: self.triggers,
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            on_failure: self.on_failure,
            flow: self.flow,
            cancel_on: self.cancel_on,
            invalid: self.invalid,
            schedule: self.schedule,
            catch_up: self.catch_up,
            start_timeout: self.start_timeout,
            finish_timeout: self.finish_timeout,
            step_timeout: self.step_timeout,
            max_lease_losses: self.max_lease_losses,
            version: self.version,
        }
    }
}

/// Wraps a typed handler: input that does not deserialize fails the run
/// permanently with a message naming the function and serde's reason.
fn erase<I, O, F, Fut>(function_id: String, handler: F) -> ErasedHandler
where
    I: DeserializeOwned + Send + 'static,
    O: Serialize + Send + 'static,
    F: Fn(Ctx, I) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = HandlerResult<O>> + Send + 'static,
{
    let handler = Arc::new(handler);
    Arc::new(move |ctx: Ctx, payload: Value| {
        let handler = Arc::clone(&handler);
        let function_id = function_id.clone();
        Box::pin(async move {
            let input: I = serde_json::from_value(payload).map_err(|e| {
                HandlerError::permanent(format!(
                    "function {function_id}: event payload does not deserialize into {}: {e}",
                    std::any::type_name::<I>()
                ))
            })?;
            let output = handler(ctx, input).await?;
            serde_json::to_value(output)
                .map_err(|e| HandlerError::permanent(format!("function {function_id}: output does not serialize: {e}")))
        })
    })
}
