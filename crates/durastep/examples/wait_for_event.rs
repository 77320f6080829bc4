//! Waiting for an event: a run suspends (holding no worker) until a matching
//! event arrives, or a timeout passes.
//!
//! `cargo run -p durastep --example wait_for_event`
//!
//! Two orders wait for their payment. Order 1 is paid; order 2 is not, and its
//! wait times out after two seconds.

mod common;

use std::time::Duration;

use durastep::{Ctx, Event, EventMatch, Function, RunState, WaitFor};
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize)]
struct Paid {
    order_id: u64,
    amount_cents: u64,
}

#[tokio::main]
async fn main() -> common::Result {
    let fulfil = Function::new("fulfil-order").on_event("order/placed").handler(|ctx: Ctx, order_id: u64| async move {
        let payment = WaitFor::event("order/paid")
            .matching(EventMatch::field("/order_id", &order_id))
            .timeout(Duration::from_secs(2));
        let paid: Option<Paid> = ctx.wait_for_event("payment", payment).await?;
        Ok(match paid {
            Some(p) => format!("order {} paid {} cents: shipping", p.order_id, p.amount_cents),
            None => format!("order {order_id}: no payment in time, released the stock"),
        })
    });

    let db = common::fresh_db("wait_for_event").await?;
    let engine = db.builder().function(fulfil).build().await?;
    let worker = engine.spawn_worker();
    let one = engine.send(Event::new("order/placed", &1)).await?.run_ids[0];
    let two = engine.send(Event::new("order/placed", &2)).await?.run_ids[0];

    // Only events that arrive after the wait is recorded count: wait for it first.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while engine.run(one).await?.state != RunState::Waiting {
        assert!(std::time::Instant::now() < deadline, "order 1 never started waiting");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!("order 1 is waiting; paying it");
    engine.send(Event::new("order/paid", &json!({"order_id": 1, "amount_cents": 2_500}))).await?;

    for id in [one, two] {
        let run = engine.wait_for_run(id, Duration::from_secs(30)).await?;
        println!("{:?}: {}", run.state, run.output.unwrap_or_default());
    }
    worker.stop().await?;
    Ok(())
}
