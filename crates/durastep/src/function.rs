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
use crate::flow::{Debounce, FlowConfig, Kind, Rule, SingletonMode};
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

    /// The delay after failed attempt number `attempt` (1-based).
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
                raw + raw.mul_f64(0.25 * unit)
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
    pub attempts: i32,
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
    pub(crate) cancel_on: Vec<CancelOn>,
    /// Why the definition is invalid (reported by `build`).
    pub(crate) invalid: Vec<String>,
    pub(crate) schedule: Option<Schedule>,
    pub(crate) catch_up: CatchUp,
    pub(crate) start_timeout: Option<Duration>,
    pub(crate) finish_timeout: Option<Duration>,
}

/// One `cancel_on` rule: an event of this name cancels the runs whose own event
/// data has, at `run_path`, the value the new event has at `event_path`.
#[derive(Debug, Clone)]
pub(crate) struct CancelOn {
    pub event: String,
    pub event_path: Vec<String>,
    pub run_path: Vec<String>,
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
    cancel_on: Vec<CancelOn>,
    invalid: Vec<String>,
    schedule: Option<Schedule>,
    catch_up: CatchUp,
    start_timeout: Option<Duration>,
    finish_timeout: Option<Duration>,
}

/// Splits a JSON pointer (RFC 6901: `""` is the whole document, `"/a/b"` is
/// key `b` inside key `a`, `~1` is `/` and `~0` is `~`) into the path Postgres'
/// `#>` operator takes. Array elements are addressed by their index, as in `/items/0`.
///
/// ```
/// # // private; exercised through cancel_on and EventMatch
/// ```
pub(crate) fn pointer_path(pointer: &str) -> Result<Vec<String>, String> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    // One RFC 6901 parser for every key path (flow-control keys refuse "").
    crate::flow::parse_pointer(pointer)
}

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

    /// Cancels this function's unfinished runs when an event named `event`
    /// arrives whose data, at the JSON pointer `matching.0`, equals the value the
    /// run's own event data has at the JSON pointer `matching.1`. The cancel
    /// happens in the statement (and transaction) that stores the event: queued,
    /// sleeping and waiting runs never execute again; a running run stops at its
    /// next step boundary, as with [`crate::Engine::cancel`]. Runs whose data has
    /// no value at the pointer are never cancelled by it. Call it more than once
    /// for several rules. An invalid pointer (not empty, not starting with `/`)
    /// is refused at build.
    ///
    /// ```
    /// // A budget push is cancelled when its campaign is paused.
    /// let f = durastep::Function::new("meta-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .cancel_on("campaign/paused", ("/campaign_id", "/campaign_id"))
    ///     .handler(|_ctx, _req: serde_json::Value| async move { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn cancel_on(mut self, event: impl Into<String>, matching: (&str, &str)) -> Self {
        match (pointer_path(matching.0), pointer_path(matching.1)) {
            (Ok(event_path), Ok(run_path)) => {
                self.cancel_on.push(CancelOn { event: event.into(), event_path, run_path });
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

    fn rule(
        mut self,
        shared: Option<&str>,
        kind: Kind,
        capacity: u32,
        period: Duration,
        burst: u32,
        key: Option<&str>,
    ) -> Self {
        self.flow.rules.push(Rule {
            shared: shared.map(str::to_owned),
            kind,
            capacity,
            period,
            burst,
            key: key.map(str::to_owned),
        });
        self
    }

    /// At most `limit` attempts of this function execute at once per key, across
    /// every worker and process. `key` is a JSON pointer into the event data
    /// (`Some("/ad_account_id")`), or `None` for one limit over the whole
    /// function. A slot is held only while an attempt executes (state
    /// `running`); sleeping, waiting and queued runs hold none. Up to two
    /// concurrency limits per function; a run starts when it has a slot of both.
    /// A malformed pointer fails [`crate::EngineBuilder::build`]; an event that
    /// lacks the key is refused at send with [`crate::Error::MissingKey`].
    ///
    /// ```
    /// // Story B: Meta allows 6 concurrent writes per ad account.
    /// let f = durastep::Function::new("meta-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .concurrency(6, Some("/ad_account_id"))
    ///     .handler(|_ctx, _req: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn concurrency(self, limit: u32, key: Option<&str>) -> Self {
        self.rule(None, Kind::Concurrency, limit, Duration::ZERO, 0, key)
    }

    /// A concurrency limit shared by name with every function that declares the
    /// same name: their attempts together never exceed `limit` per key. Every
    /// function sharing a name must give it the same limit (the last engine to
    /// register it decides). Each function gives its own key pointer.
    ///
    /// ```
    /// // Story A: every function that calls Exact Online shares one slot.
    /// let draft = durastep::Function::new("exact-draft-invoice")
    ///     .on_event("deal/placement")
    ///     .concurrency_shared("exact-online", 1, None)
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// let credit = durastep::Function::new("exact-credit-note")
    ///     .on_event("deal/cancelled")
    ///     .concurrency_shared("exact-online", 1, None)
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = (draft, credit);
    /// ```
    pub fn concurrency_shared(self, name: &str, limit: u32, key: Option<&str>) -> Self {
        self.rule(Some(name), Kind::Concurrency, limit, Duration::ZERO, 0, key)
    }

    /// Throttles starts per key with GCRA: at most `limit + burst` attempts start
    /// in any window of `period` (with `burst` 0, starts are at least
    /// `period / limit` apart). Runs over the limit **wait** and start as capacity
    /// frees, in priority then arrival order; none is dropped. Use this when
    /// every event matters (a budget change).
    ///
    /// ```
    /// use std::time::Duration;
    /// // Story B: at most 100 starts per minute per LinkedIn account.
    /// let f = durastep::Function::new("linkedin-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .throttle(100, Duration::from_secs(60), 0, Some("/account_id"))
    ///     .handler(|_ctx, _req: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn throttle(self, limit: u32, period: Duration, burst: u32, key: Option<&str>) -> Self {
        self.rule(None, Kind::Throttle, limit, period, burst, key)
    }

    /// Rate-limits starts per key with GCRA: at most `limit` attempts start in
    /// any window of `period` (at least `period / limit` apart). A run over the
    /// limit is **not started**: it ends in state `skipped`, with the reason in
    /// `last_error`. Use this when only the latest or a sample matters (a
    /// "refresh the dashboard" event); use [`FunctionBuilder::throttle`] when
    /// every event must be processed.
    ///
    /// ```
    /// use std::time::Duration;
    /// let f = durastep::Function::new("refresh-report")
    ///     .on_event("report/stale")
    ///     .rate_limit(1, Duration::from_secs(300), Some("/client_id"))
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn rate_limit(self, limit: u32, period: Duration, key: Option<&str>) -> Self {
        self.rule(None, Kind::RateLimit, limit, period, 0, key)
    }

    /// Key back-pressure: when an attempt fails with
    /// [`HandlerError::retry_after`] (an HTTP 429 with Retry-After), the whole
    /// key pauses until then: no attempt of this function with that key starts
    /// before it. Such a retry does not count as an attempt, up to
    /// [`crate::BACKPRESSURE_FREE_RETRIES`] times per run. The key is private to
    /// this function; see [`FunctionBuilder::backpressure_shared`].
    ///
    /// ```
    /// let f = durastep::Function::new("linkedin-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .backpressure(Some("/account_id"))
    ///     .handler(|_ctx, _req: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn backpressure(self, key: Option<&str>) -> Self {
        self.rule(None, Kind::Backpressure, 0, Duration::ZERO, 0, key)
    }

    /// Key back-pressure shared by name: a 429 in any function that declares
    /// `name` pauses the key for all of them (one LinkedIn account's write
    /// bucket, whichever function drained it).
    ///
    /// ```
    /// let f = durastep::Function::new("linkedin-budget-update")
    ///     .on_event("campaign/budget.requested")
    ///     .backpressure_shared("linkedin-writes", Some("/account_id"))
    ///     .handler(|_ctx, _req: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn backpressure_shared(self, name: &str, key: Option<&str>) -> Self {
        self.rule(Some(name), Kind::Backpressure, 0, Duration::ZERO, 0, key)
    }

    /// Debounces events per key: a burst of events produces one run, with the
    /// latest event's data, that starts `period` after the last event of the
    /// burst, and never later than `max_wait` after the first. An event that
    /// arrives once the run has started begins a new burst.
    ///
    /// ```
    /// use std::time::Duration;
    /// let f = durastep::Function::new("resync-contact")
    ///     .on_event("contact/changed")
    ///     .debounce(Duration::from_secs(30), Some("/contact_id"), Duration::from_secs(300))
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn debounce(mut self, period: Duration, key: Option<&str>, max_wait: Duration) -> Self {
        self.flow.debounce = Some(Debounce { period, key: key.map(str::to_owned), max_wait });
        self
    }

    /// At most one active (queued, running, sleeping or waiting) run per key;
    /// `mode` says what a new event for a busy key does.
    ///
    /// ```
    /// let f = durastep::Function::new("rotate-token")
    ///     .on_event("token/expiring")
    ///     .singleton(Some("/account_id"), durastep::SingletonMode::SkipNew)
    ///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
    /// # let _ = f;
    /// ```
    pub fn singleton(mut self, key: Option<&str>, mode: SingletonMode) -> Self {
        self.flow.singleton = Some((key.map(str::to_owned), mode));
        self
    }

    /// Takes each run's priority from the event data (an integer at this JSON
    /// pointer; higher runs first among due runs). An event without a number
    /// there keeps the priority it was sent with ([`crate::Event::priority`]).
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
