//! The standard test functions that every test worker registers, their inputs,
//! and the oracles their outputs are checked against.
//!
//! Every step body records itself in the [`Ledger`] (start and end); the
//! `slow` step of [`SLOW_STEP`] also calls the external service
//! ([`Ledger::external_call`]) with `ctx.idempotency_key()` + `":slow"`. Each body
//! returns a deterministic function of the run's input and the previous step's
//! (stored) output, so a wrong or corrupted stored result shows in the run output.

use std::time::Duration;

use durastep::{Backoff, Ctx, Event, Function, HandlerError, HandlerResult};
use serde::{Deserialize, Serialize};

use crate::ledger::Ledger;

/// Id of the five-step function.
pub const FIVE_STEPS: &str = "five-steps";
/// The event that starts a [`FIVE_STEPS`] run (payload: [`FiveSteps`]).
pub const FIVE_STEPS_EVENT: &str = "testkit/five-steps";
/// Id of the slow-step function.
pub const SLOW_STEP: &str = "slow-step";
/// The event that starts a [`SLOW_STEP`] run (payload: [`SlowStep`]).
pub const SLOW_STEP_EVENT: &str = "testkit/slow-step";
/// Step keys of the slow-step function, in order.
pub const SLOW_STEP_KEYS: [&str; 2] = ["slow", "after"];
/// Id of the flow function with a concurrency limit of [`FLOW_PER_KEY_LIMIT`] per `/account`.
pub const FLOW_PER_KEY: &str = "flow-per-key";
/// The event that starts a [`FLOW_PER_KEY`] run (payload: [`FlowInput`]).
pub const FLOW_PER_KEY_EVENT: &str = "testkit/flow-per-key";
/// The per-account concurrency limit of [`FLOW_PER_KEY`].
pub const FLOW_PER_KEY_LIMIT: i64 = 3;
/// Ids of the two functions that share one concurrency limit of 1 ([`FLOW_SHARED_LIMIT`]).
pub const FLOW_SHARED: [&str; 2] = ["flow-shared-a", "flow-shared-b"];
/// The events that start the [`FLOW_SHARED`] functions (payload: [`FlowInput`]).
pub const FLOW_SHARED_EVENTS: [&str; 2] = ["testkit/flow-shared-a", "testkit/flow-shared-b"];
/// The name of the limit the [`FLOW_SHARED`] functions share (Story A's "exact-online").
pub const FLOW_SHARED_LIMIT: &str = "testkit-exact-online";
/// Id of the flow function throttled to [`FLOW_THROTTLE_LIMIT`] starts per
/// [`FLOW_THROTTLE_PERIOD`] with a burst of [`FLOW_THROTTLE_BURST`], per `/account`.
pub const FLOW_THROTTLE: &str = "flow-throttle";
/// The event that starts a [`FLOW_THROTTLE`] run (payload: [`FlowInput`]).
pub const FLOW_THROTTLE_EVENT: &str = "testkit/flow-throttle";
/// Starts per period of [`FLOW_THROTTLE`], per account.
pub const FLOW_THROTTLE_LIMIT: u32 = 50;
/// The burst of [`FLOW_THROTTLE`]: at most limit + burst starts in any period.
pub const FLOW_THROTTLE_BURST: u32 = 10;
/// The period of [`FLOW_THROTTLE`], by the database clock (tests move it): long,
/// so that the worker's wall time between two moves of the clock is negligible.
pub const FLOW_THROTTLE_PERIOD: Duration = Duration::from_secs(600);
/// Id of the flow function rate-limited to [`FLOW_RATE_LIMIT`] starts per
/// [`FLOW_RATE_PERIOD`] per `/account` (the excess is `skipped`).
pub const FLOW_RATE: &str = "flow-rate";
/// The event that starts a [`FLOW_RATE`] run (payload: [`FlowInput`]).
pub const FLOW_RATE_EVENT: &str = "testkit/flow-rate";
/// Starts per period of [`FLOW_RATE`], per account.
pub const FLOW_RATE_LIMIT: u32 = 5;
/// The period of [`FLOW_RATE`], by the database clock.
pub const FLOW_RATE_PERIOD: Duration = Duration::from_secs(1_000);
/// Ids of the two functions that share the back-pressure rule [`FLOW_BACKPRESSURE_RULE`]
/// keyed by `/account`. They have no retries: a back-pressure pause must not use one up.
pub const FLOW_BACKPRESSURE: [&str; 2] = ["flow-bp-a", "flow-bp-b"];
/// The events that start the [`FLOW_BACKPRESSURE`] functions (payload: [`BackpressureInput`]).
pub const FLOW_BACKPRESSURE_EVENTS: [&str; 2] = ["testkit/flow-bp-a", "testkit/flow-bp-b"];
/// The back-pressure rule the [`FLOW_BACKPRESSURE`] functions share (one LinkedIn account's writes).
pub const FLOW_BACKPRESSURE_RULE: &str = "testkit-linkedin-writes";
/// The ledger's step key for a flow function's attempt: its row spans the attempt.
pub const FLOW_ATTEMPT_KEY: &str = "attempt";
/// Id of the sleeper function: a step, a durable sleep, a step.
pub const SLEEPER: &str = "sleeper";
/// The event that starts a [`SLEEPER`] run (payload: [`Sleeper`]).
pub const SLEEPER_EVENT: &str = "testkit/sleeper";
/// Step keys of the sleeper function, in order (`nap` is the sleep's checkpoint,
/// which stores `{"wake_at": ...}`).
pub const SLEEPER_KEYS: [&str; 3] = ["before", "nap", "after"];
/// Id of the mixed function: a step, a `step_tx`, a durable sleep, a step.
pub const MIXED: &str = "mixed";
/// The event that starts a [`MIXED`] run (payload: [`Mixed`]).
pub const MIXED_EVENT: &str = "testkit/mixed";
/// Step keys of the mixed function, in order (`nap` is the durable sleep).
pub const MIXED_KEYS: [&str; 4] = ["one", "record", "nap", "two"];
/// The mixed function's sleep unless the input says otherwise.
pub const MIXED_NAP: Duration = Duration::from_millis(20);
/// Attempts each test function gets: generous, so that fault suites can kill a
/// run's worker many times without failing the run.
pub const MAX_ATTEMPTS: u32 = 50;

const MODULUS: u64 = 1_000_000_007;

/// Input of a [`FIVE_STEPS`] run.
///
/// ```
/// let input = durastep_testkit::FiveSteps { n: 7, delay_ms: Some(100) };
/// assert_eq!(serde_json::to_value(input).unwrap(), serde_json::json!({"n": 7, "delay_ms": 100}));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FiveSteps {
    /// Seed of the run's outputs.
    pub n: u64,
    /// Each step body sleeps this long (default: the worker's `--step-delay-ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
}

impl FiveSteps {
    /// An input with seed `n` and the worker's default step delay.
    ///
    /// ```
    /// assert_eq!(durastep_testkit::FiveSteps::new(3).n, 3);
    /// ```
    pub fn new(n: u64) -> Self {
        FiveSteps { n, delay_ms: None }
    }

    /// The event that starts a run with this input.
    ///
    /// ```
    /// let e = durastep_testkit::FiveSteps::new(3).event();
    /// # let _ = e;
    /// ```
    pub fn event(&self) -> Event {
        Event::new(FIVE_STEPS_EVENT, self)
    }
}

/// Input of a [`SLOW_STEP`] run.
///
/// ```
/// let input = durastep_testkit::SlowStep { n: 1, sleep_ms: Some(2_500) };
/// # let _ = input;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlowStep {
    /// Seed of the run's outputs.
    pub n: u64,
    /// How long the `slow` step body sleeps (default: the worker's `--slow-step-ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep_ms: Option<u64>,
}

impl SlowStep {
    /// The event that starts a run with this input.
    ///
    /// ```
    /// let e = durastep_testkit::SlowStep { n: 1, sleep_ms: None }.event();
    /// # let _ = e;
    /// ```
    pub fn event(&self) -> Event {
        Event::new(SLOW_STEP_EVENT, self)
    }
}

/// Input of the flow functions ([`FLOW_PER_KEY`], [`FLOW_SHARED`]).
///
/// ```
/// let input = durastep_testkit::FlowInput { account: "acct-1".into(), n: 4, hold_ms: 5 };
/// assert_eq!(input.event(durastep_testkit::functions::FLOW_PER_KEY_EVENT).name(), "testkit/flow-per-key");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowInput {
    /// The concurrency key of [`FLOW_PER_KEY`].
    pub account: String,
    /// The run's output.
    pub n: u64,
    /// How long the attempt holds its slot.
    pub hold_ms: u64,
}

impl FlowInput {
    /// The event with this input under `name`.
    ///
    /// ```
    /// let e = durastep_testkit::FlowInput { account: "a".into(), n: 1, hold_ms: 0 }.event("testkit/flow-shared-a");
    /// # let _ = e;
    /// ```
    pub fn event(&self, name: &str) -> Event {
        Event::new(name, self)
    }
}

/// Input of the [`FLOW_BACKPRESSURE`] functions: the attempt records itself and,
/// on the run's first execution only, fails like an HTTP 429 with a Retry-After
/// of `retry_after_ms` when that is set.
///
/// ```
/// let input = durastep_testkit::BackpressureInput { account: "K".into(), n: 1, retry_after_ms: Some(30_000) };
/// assert_eq!(input.event(durastep_testkit::functions::FLOW_BACKPRESSURE_EVENTS[0]).name(), "testkit/flow-bp-a");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackpressureInput {
    /// The back-pressure key.
    pub account: String,
    /// The run's output.
    pub n: u64,
    /// The Retry-After of the 429 the first execution returns (none: no 429).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

impl BackpressureInput {
    /// The event with this input under `name`.
    ///
    /// ```
    /// let e = durastep_testkit::BackpressureInput { account: "a".into(), n: 1, retry_after_ms: None }.event("testkit/flow-bp-b");
    /// # let _ = e;
    /// ```
    pub fn event(&self, name: &str) -> Event {
        Event::new(name, self)
    }
}

/// Input of a [`SLEEPER`] run: step `before`, `ctx.sleep("nap", sleep_ms)`, step `after`.
///
/// ```
/// let input = durastep_testkit::Sleeper { n: 1, sleep_ms: 1_500 };
/// assert_eq!(durastep_testkit::sleeper_oracle(input.n), 3);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sleeper {
    /// Seed of the run's output.
    pub n: u64,
    /// How long the durable sleep lasts (by the database clock).
    pub sleep_ms: u64,
}

impl Sleeper {
    /// The event that starts a run with this input.
    ///
    /// ```
    /// let e = durastep_testkit::Sleeper { n: 1, sleep_ms: 10 }.event();
    /// # let _ = e;
    /// ```
    pub fn event(&self) -> Event {
        Event::new(SLEEPER_EVENT, self)
    }
}

/// The output of a sleeper run with seed `n`.
///
/// ```
/// assert_eq!(durastep_testkit::sleeper_oracle(10), 12);
/// ```
pub fn sleeper_oracle(n: u64) -> u64 {
    n % MODULUS + 2
}

/// Input of a [`MIXED`] run: step `one` (sleeps `delay_ms`), step_tx `record`
/// (writes one row of `testkit_tx_effects` in its transaction), sleep `nap`
/// (`nap_ms`, default [`MIXED_NAP`]), step `two`. Every failpoint of the engine
/// is on its path.
///
/// ```
/// let m = durastep_testkit::Mixed { n: 4, delay_ms: None, nap_ms: None };
/// assert_eq!(durastep_testkit::mixed_oracle(m.n), 42);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mixed {
    /// Seed of the run's outputs.
    pub n: u64,
    /// Sleep in the body of step `one`, in ms (default none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    /// The durable sleep, in ms (default [`MIXED_NAP`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nap_ms: Option<u64>,
}

impl Mixed {
    /// The event that starts a run with this input.
    ///
    /// ```
    /// let e = durastep_testkit::Mixed { n: 1, delay_ms: None, nap_ms: None }.event();
    /// # let _ = e;
    /// ```
    pub fn event(&self) -> Event {
        Event::new(MIXED_EVENT, self)
    }
}

/// The output of a mixed run with seed `n`.
///
/// ```
/// assert_eq!(durastep_testkit::mixed_oracle(0), 2);
/// ```
pub fn mixed_oracle(n: u64) -> u64 {
    (mixed_one(n) + 1) * 2
}

fn mixed_one(n: u64) -> u64 {
    n % MODULUS * 5
}

/// Worker-wide defaults of the test functions.
///
/// ```
/// let s = durastep_testkit::FunctionSettings::default();
/// assert_eq!(s.step_delay, std::time::Duration::ZERO);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FunctionSettings {
    /// Sleep in each five-steps body unless the input says otherwise.
    pub step_delay: Duration,
    /// Sleep in the slow step unless the input says otherwise.
    pub slow_step: Duration,
}

impl Default for FunctionSettings {
    fn default() -> Self {
        FunctionSettings { step_delay: Duration::ZERO, slow_step: Duration::from_secs(5) }
    }
}

/// The key of step `i` (1-based) of the five-step function: `step-1` ... `step-5`.
///
/// ```
/// assert_eq!(durastep_testkit::five_steps_key(3), "step-3");
/// ```
pub fn five_steps_key(i: u32) -> String {
    format!("step-{i}")
}

/// What step `i` (1-based) of a five-steps run with seed `n` returns.
///
/// ```
/// use durastep_testkit::{five_steps_oracle, five_steps_step_output};
/// assert_eq!(five_steps_step_output(9, 5), five_steps_oracle(9));
/// ```
pub fn five_steps_step_output(n: u64, i: u32) -> u64 {
    (1..=i).fold(n % MODULUS, |acc, k| next(acc, n, k))
}

/// The output of a five-steps run with seed `n`.
///
/// ```
/// assert_ne!(durastep_testkit::five_steps_oracle(1), durastep_testkit::five_steps_oracle(2));
/// ```
pub fn five_steps_oracle(n: u64) -> u64 {
    five_steps_step_output(n, 5)
}

/// The output of a slow-step run with seed `n`.
///
/// ```
/// assert_eq!(durastep_testkit::slow_step_oracle(1), 5);
/// ```
pub fn slow_step_oracle(n: u64) -> u64 {
    slow_output(n) + 1
}

fn next(acc: u64, n: u64, k: u32) -> u64 {
    (acc * 31 + u64::from(k) * 7 + n % MODULUS) % MODULUS
}

fn slow_output(n: u64) -> u64 {
    (n % MODULUS * 3 + 1) % MODULUS
}

/// Every test function, as a worker registers it.
///
/// ```no_run
/// # async fn demo(url: &str) -> durastep_testkit::Result<()> {
/// let ledger = durastep_testkit::Ledger::connect(url, "w0", Default::default()).await?;
/// let mut builder = durastep::Engine::builder().database_url(url);
/// for f in durastep_testkit::functions::all(durastep_testkit::FunctionSettings::default(), &ledger) {
///     builder = builder.function(f);
/// }
/// let engine = builder.build().await?;
/// # let _ = engine; Ok(()) }
/// ```
pub fn all(settings: FunctionSettings, ledger: &Ledger) -> Vec<Function> {
    vec![
        five_steps(settings, ledger.clone()),
        slow_step(settings, ledger.clone()),
        flow(FLOW_PER_KEY, FLOW_PER_KEY_EVENT, ledger.clone())
            .concurrency(durastep::Concurrency::new(FLOW_PER_KEY_LIMIT as u32).key("/account"))
            .handler(flow_handler(ledger.clone())),
        flow(FLOW_SHARED[0], FLOW_SHARED_EVENTS[0], ledger.clone())
            .concurrency(durastep::Concurrency::new(1).shared(FLOW_SHARED_LIMIT))
            .handler(flow_handler(ledger.clone())),
        flow(FLOW_SHARED[1], FLOW_SHARED_EVENTS[1], ledger.clone())
            .concurrency(durastep::Concurrency::new(1).shared(FLOW_SHARED_LIMIT))
            .handler(flow_handler(ledger.clone())),
        flow(FLOW_THROTTLE, FLOW_THROTTLE_EVENT, ledger.clone())
            .throttle(
                durastep::Throttle::new(FLOW_THROTTLE_LIMIT, FLOW_THROTTLE_PERIOD)
                    .burst(FLOW_THROTTLE_BURST)
                    .key("/account"),
            )
            .handler(flow_handler(ledger.clone())),
        flow(FLOW_RATE, FLOW_RATE_EVENT, ledger.clone())
            .rate_limit(durastep::RateLimit::new(FLOW_RATE_LIMIT, FLOW_RATE_PERIOD).key("/account"))
            .handler(flow_handler(ledger.clone())),
        backpressure(FLOW_BACKPRESSURE[0], FLOW_BACKPRESSURE_EVENTS[0], ledger.clone()),
        backpressure(FLOW_BACKPRESSURE[1], FLOW_BACKPRESSURE_EVENTS[1], ledger.clone()),
        sleeper(ledger.clone()),
        mixed(ledger.clone()),
    ]
}

/// A back-pressure function: no retries, so a pause that used one up would fail the run.
fn backpressure(id: &str, event: &str, ledger: Ledger) -> Function {
    Function::new(id)
        .on_event(event)
        .retries(0)
        .backpressure(durastep::Backpressure::new().key("/account").shared(FLOW_BACKPRESSURE_RULE))
        .handler(move |ctx: Ctx, input: BackpressureInput| {
            let ledger = ledger.clone();
            async move {
                let row = ledger.begin(ctx.run_id(), FLOW_ATTEMPT_KEY, ctx.attempt()).await?;
                let first = ledger.executions(ctx.run_id(), FLOW_ATTEMPT_KEY).await? == 1;
                ledger.end(row).await?;
                match input.retry_after_ms {
                    Some(ms) if first => {
                        Err(HandlerError::retry_after("429 Too Many Requests", Duration::from_millis(ms)))
                    }
                    _ => Ok(input.n),
                }
            }
        })
}

fn flow(id: &str, event: &str, _ledger: Ledger) -> durastep::FunctionBuilder {
    Function::new(id).on_event(event).retries(MAX_ATTEMPTS - 1).backoff(Backoff::Fixed(Duration::from_millis(50)))
}

/// A flow function's attempt: one ledger row from its start to its end, holding its slot `hold_ms`.
fn flow_handler(
    ledger: Ledger,
) -> impl Fn(Ctx, FlowInput) -> std::pin::Pin<Box<dyn std::future::Future<Output = HandlerResult<u64>> + Send>>
+ Send
+ Sync
+ 'static {
    move |ctx: Ctx, input: FlowInput| {
        let ledger = ledger.clone();
        Box::pin(async move {
            let row = ledger.begin(ctx.run_id(), FLOW_ATTEMPT_KEY, ctx.attempt()).await?;
            tokio::time::sleep(Duration::from_millis(input.hold_ms)).await;
            ledger.end(row).await?;
            Ok(input.n)
        })
    }
}

/// Runs one recorded step body: ledger start, `delay`, ledger end.
async fn recorded(ctx: &Ctx, ledger: &Ledger, key: &str, delay: Duration, output: u64) -> HandlerResult<u64> {
    let row = ledger.begin(ctx.run_id(), key, ctx.attempt()).await?;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    ledger.end(row).await?;
    Ok(output)
}

fn five_steps(settings: FunctionSettings, ledger: Ledger) -> Function {
    Function::new(FIVE_STEPS)
        .on_event(FIVE_STEPS_EVENT)
        .retries(MAX_ATTEMPTS - 1)
        .backoff(Backoff::Fixed(Duration::from_millis(50)))
        .handler(move |ctx: Ctx, input: FiveSteps| {
            let ledger = ledger.clone();
            async move {
                let delay = input.delay_ms.map_or(settings.step_delay, Duration::from_millis);
                let mut acc = input.n % MODULUS;
                for k in 1..=5u32 {
                    let key = five_steps_key(k);
                    let output = next(acc, input.n, k);
                    let (ctx2, ledger) = (ctx.clone(), ledger.clone());
                    acc = ctx
                        .step(&key, || async move { recorded(&ctx2, &ledger, &five_steps_key(k), delay, output).await })
                        .await?;
                }
                Ok(acc)
            }
        })
}

fn slow_step(settings: FunctionSettings, ledger: Ledger) -> Function {
    Function::new(SLOW_STEP)
        .on_event(SLOW_STEP_EVENT)
        .retries(MAX_ATTEMPTS - 1)
        .backoff(Backoff::Fixed(Duration::from_millis(50)))
        .handler(move |ctx: Ctx, input: SlowStep| {
            let ledger = ledger.clone();
            async move {
                let sleep = input.sleep_ms.map_or(settings.slow_step, Duration::from_millis);
                let (c, l) = (ctx.clone(), ledger.clone());
                // The slow step calls an external service with the run's idempotency key.
                let slow: u64 = ctx
                    .step("slow", || async move {
                        let row = l.begin(c.run_id(), "slow", c.attempt()).await?;
                        if !sleep.is_zero() {
                            tokio::time::sleep(sleep).await;
                        }
                        l.external_call(&format!("{}:slow", c.idempotency_key()), c.run_id(), "slow").await?;
                        l.end(row).await?;
                        Ok(slow_output(input.n))
                    })
                    .await?;
                let (c, l) = (ctx.clone(), ledger.clone());
                let after: u64 = ctx
                    .step("after", || async move { recorded(&c, &l, "after", Duration::ZERO, slow + 1).await })
                    .await?;
                Ok(after)
            }
        })
}

fn sleeper(ledger: Ledger) -> Function {
    Function::new(SLEEPER)
        .on_event(SLEEPER_EVENT)
        .retries(MAX_ATTEMPTS - 1)
        .backoff(Backoff::Fixed(Duration::from_millis(50)))
        .handler(move |ctx: Ctx, input: Sleeper| {
            let ledger = ledger.clone();
            async move {
                let (c, l) = (ctx.clone(), ledger.clone());
                let before: u64 = ctx
                    .step("before", || async move {
                        recorded(&c, &l, "before", Duration::ZERO, input.n % MODULUS + 1).await
                    })
                    .await?;
                ctx.sleep("nap", Duration::from_millis(input.sleep_ms)).await?;
                let (c, l) = (ctx.clone(), ledger.clone());
                let after: u64 = ctx
                    .step("after", || async move { recorded(&c, &l, "after", Duration::ZERO, before + 1).await })
                    .await?;
                Ok(after)
            }
        })
}

fn mixed(ledger: Ledger) -> Function {
    Function::new(MIXED)
        .on_event(MIXED_EVENT)
        .retries(MAX_ATTEMPTS - 1)
        .backoff(Backoff::Fixed(Duration::from_millis(10)))
        .handler(move |ctx: Ctx, input: Mixed| {
            let ledger = ledger.clone();
            async move {
                let delay = Duration::from_millis(input.delay_ms.unwrap_or(0));
                let (c, l) = (ctx.clone(), ledger.clone());
                let one: u64 =
                    ctx.step("one", || async move { recorded(&c, &l, "one", delay, mixed_one(input.n)).await }).await?;
                let (c, l) = (ctx.clone(), ledger.clone());
                let record: u64 = ctx
                    .step_tx("record", async move |conn| {
                        let row = l.begin(c.run_id(), "record", c.attempt()).await?;
                        l.tx_effect(conn, c.run_id()).await?;
                        l.end(row).await?;
                        Ok(one + 1)
                    })
                    .await?;
                let nap = input.nap_ms.map_or(MIXED_NAP, Duration::from_millis);
                ctx.sleep("nap", nap).await?;
                let (c, l) = (ctx.clone(), ledger.clone());
                let two: u64 = ctx
                    .step("two", || async move { recorded(&c, &l, "two", Duration::ZERO, record * 2).await })
                    .await?;
                Ok(two)
            }
        })
}
