//! Steps and retries: finished steps are checkpointed, so a retry runs only
//! the step that failed.
//!
//! `cargo run -p durastep --example steps_and_retries`
//!
//! The `charge` step fails on its first two executions (a flaky API); the run
//! is retried after a short fixed backoff, `reserve` is not run again, and the
//! third attempt completes.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Backoff, Ctx, Event, Function, HandlerError};

#[tokio::main]
async fn main() -> common::Result {
    let reserve_runs = Arc::new(AtomicU32::new(0));
    let charge_runs = Arc::new(AtomicU32::new(0));
    let (r, c) = (reserve_runs.clone(), charge_runs.clone());

    let order = Function::new("order")
        .on_event("order/placed")
        .retries(3) // 4 attempts in all
        .backoff(Backoff::Fixed(Duration::from_millis(200)))
        .handler(move |ctx: Ctx, order_id: String| {
            let (r, c) = (r.clone(), c.clone());
            async move {
                let reservation: String = ctx
                    .step("reserve", || async {
                        r.fetch_add(1, Ordering::SeqCst);
                        Ok(format!("rsv-{order_id}"))
                    })
                    .await?;
                // `step_with_key` hands the body an idempotency key for the API call.
                let charge: String = ctx
                    .step_with_key("charge", |key| async move {
                        if c.fetch_add(1, Ordering::SeqCst) < 2 {
                            return Err(HandlerError::new("payment API: 503 Service Unavailable"));
                        }
                        Ok(format!("charged with idempotency key {key}"))
                    })
                    .await?;
                Ok(format!("{reservation}, {charge}"))
            }
        });

    let db = common::fresh_db("steps_and_retries").await?;
    let engine = db.builder().function(order).build().await?;
    let worker = engine.spawn_worker();

    let run_id = engine.send(Event::new("order/placed", &"A-1001")).await?.run_ids[0];
    let run = engine.wait_for_run(run_id, Duration::from_secs(30)).await?;
    worker.stop().await?;

    println!("run {run_id}: {:?} after {} attempts, output {}", run.state, run.attempt, run.output.unwrap_or_default());
    println!(
        "reserve ran {} time(s), charge ran {} time(s)",
        reserve_runs.load(Ordering::SeqCst),
        charge_runs.load(Ordering::SeqCst)
    );
    for a in engine.inspect().run(run_id).await?.attempts {
        println!("  attempt {}: {:?} {}", a.attempt, a.outcome, a.error.unwrap_or_default());
    }
    Ok(())
}
