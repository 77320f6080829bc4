//! Flow control: limits per key, enforced by Postgres in the claim, so they
//! hold across every worker and process.
//!
//! `cargo run -p durastep --example flow_control`
//!
//! Twelve budget pushes over two ad accounts, with at most 2 at once per
//! account and at most 10 starts per second per account. The handler records
//! how many ran at once per account; it never exceeds 2.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use durastep::{Concurrency, Ctx, Event, Function, Throttle};
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize)]
struct Push {
    account: String,
    n: u32,
}

/// Per account: attempts running now, and the most seen at once.
type Gauge = Arc<Mutex<HashMap<String, (u32, u32)>>>;

#[tokio::main]
async fn main() -> common::Result {
    let gauge: Gauge = Arc::default();
    let g = gauge.clone();
    let push = Function::new("push-budget")
        .on_event("budget/requested")
        .concurrency(Concurrency::new(2).key("/account"))
        .throttle(Throttle::per_second(10).key("/account"))
        .handler(move |ctx: Ctx, p: Push| {
            let g = g.clone();
            async move {
                ctx.step("push", || async {
                    {
                        let mut m = g.lock().unwrap();
                        let e = m.entry(p.account.clone()).or_default();
                        e.0 += 1;
                        e.1 = e.1.max(e.0);
                    }
                    tokio::time::sleep(Duration::from_millis(150)).await; // the API call
                    g.lock().unwrap().get_mut(&p.account).unwrap().0 -= 1;
                    Ok(p.n)
                })
                .await
            }
        });

    let db = common::fresh_db("flow_control").await?;
    let engine = db.builder().function(push).build().await?;
    let started = Instant::now();
    let accounts = ["act_1", "act_2"];
    let events =
        (0..12).map(|n| Event::new("budget/requested", &json!({"account": accounts[n % 2], "n": n}))).collect();
    let runs: Vec<_> = engine.send_batch(events).await?.into_iter().flat_map(|r| r.run_ids).collect();
    let worker = engine.spawn_worker();
    for id in runs {
        engine.wait_for_run(id, Duration::from_secs(60)).await?;
    }
    worker.stop().await?;

    println!("12 runs done in {:.1} s", started.elapsed().as_secs_f64());
    let mut seen: Vec<_> = gauge.lock().unwrap().iter().map(|(k, v)| (k.clone(), v.1)).collect();
    seen.sort();
    for (account, max) in seen {
        println!("  {account}: at most {max} at once (limit 2)");
    }
    Ok(())
}
