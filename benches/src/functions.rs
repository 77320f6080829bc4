//! The functions the benches run. Every process (the bench itself, which only
//! sends, and each `bench-worker`) registers the same set, so any of them can
//! claim any run.

use std::time::Duration;

use durastep::{Ctx, Function};

/// Event that starts one run of 10 no-op steps.
pub const NOOP10: &str = "bench/noop10";
/// Event that starts one run of a single no-op step.
pub const NOOP1: &str = "bench/noop1";
/// Event that starts one run that sleeps for an hour after one step.
pub const SLEEP: &str = "bench/sleep";
/// Event that starts one run of [`first_step`].
pub const FIRST: &str = "bench/first";
/// The step key of [`first_step`]'s one step.
pub const FIRST_STEP: &str = "first";

/// The wall clock in microseconds since 1970 (the bench and its worker
/// processes share this machine's clock).
///
/// ```
/// assert!(durastep_benches::functions::unix_micros() > 1_700_000_000_000_000);
/// ```
pub fn unix_micros() -> i64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock after 1970");
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

/// A function of one step that returns when its body started
/// ([`unix_micros`]): the wake-up latency bench reads it from the step's
/// stored result, also when the run ran in another process.
///
/// ```
/// assert_eq!(durastep_benches::functions::first_step().id(), "first-step");
/// ```
pub fn first_step() -> Function {
    Function::new("first-step").on_event(FIRST).handler(|ctx: Ctx, _: serde_json::Value| async move {
        ctx.step(FIRST_STEP, || async { Ok(unix_micros()) }).await?;
        Ok(())
    })
}

/// A function of `steps` no-op steps (each one checkpointed), triggered by `event`.
///
/// ```
/// let f = durastep_benches::functions::noop("noop10", durastep_benches::functions::NOOP10, 10);
/// assert_eq!(f.id(), "noop10");
/// ```
pub fn noop(id: &str, event: &str, steps: usize) -> Function {
    Function::new(id).on_event(event).handler(move |ctx: Ctx, _: serde_json::Value| async move {
        for _ in 0..steps {
            ctx.step("s", || async { Ok(()) }).await?;
        }
        Ok(())
    })
}

/// A function that sleeps an hour: its runs end up `sleeping`, holding no worker.
///
/// ```
/// assert_eq!(durastep_benches::functions::sleeper().id(), "sleeper");
/// ```
pub fn sleeper() -> Function {
    Function::new("sleeper").on_event(SLEEP).handler(|ctx: Ctx, _: serde_json::Value| async move {
        ctx.sleep("nap", Duration::from_secs(3600)).await?;
        Ok(())
    })
}

/// Event that starts one run of [`flowed`].
pub const FLOWED: &str = "bench/flowed";

/// A no-op function with a concurrency rule (100 per key `/k`): a worker that
/// registers it claims with the full claim (flow control) besides the fast one.
///
/// ```
/// assert_eq!(durastep_benches::functions::flowed().id(), "flowed");
/// ```
pub fn flowed() -> Function {
    Function::new("flowed")
        .on_event(FLOWED)
        .concurrency(durastep::Concurrency::new(100).key("/k"))
        .handler(|_ctx: Ctx, _: serde_json::Value| async move { Ok(()) })
}

/// Every function a bench worker process registers.
///
/// ```
/// assert_eq!(durastep_benches::functions::all().len(), 4);
/// ```
pub fn all() -> Vec<Function> {
    vec![noop("noop10", NOOP10, 10), noop("noop1", NOOP1, 1), sleeper(), first_step()]
}
