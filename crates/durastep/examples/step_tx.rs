//! `step_tx`: database writes that commit together with the step's checkpoint,
//! so they happen exactly once even when the run is retried.
//!
//! `cargo run -p durastep --example step_tx`
//!
//! The run inserts a ledger row in a `step_tx`, then a later step fails once.
//! The retry replays the `step_tx` from its checkpoint: the ledger has one row.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::sqlx::{self, Executor};
use durastep::{Backoff, Ctx, Event, Function, HandlerError};

#[tokio::main]
async fn main() -> common::Result {
    let notify_runs = Arc::new(AtomicU32::new(0));
    let n = notify_runs.clone();

    let book = Function::new("book-payment")
        .on_event("payment/received")
        .backoff(Backoff::Fixed(Duration::from_millis(200)))
        .handler(move |ctx: Ctx, cents: i64| {
            let n = n.clone();
            async move {
                // An async closure over the step's transaction: no boxing.
                let ledger_id: i64 = ctx
                    .step_tx("book", async move |conn| {
                        let id = sqlx::query_scalar("INSERT INTO ledger (cents) VALUES ($1) RETURNING id")
                            .bind(cents)
                            .fetch_one(&mut *conn)
                            .await?;
                        Ok(id)
                    })
                    .await?;
                ctx.step("notify", || async {
                    if n.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Err(HandlerError::new("mail server timed out"));
                    }
                    Ok(())
                })
                .await?;
                Ok(ledger_id)
            }
        });

    let db = common::fresh_db("step_tx").await?;
    let engine = db.builder().function(book).build().await?;
    engine.pool().execute("CREATE TABLE ledger (id bigserial PRIMARY KEY, cents bigint NOT NULL)").await?;
    let worker = engine.spawn_worker();

    let run_id = engine.send(Event::new("payment/received", &4_200)).await?.run_ids[0];
    let run = engine.wait_for_run(run_id, Duration::from_secs(30)).await?;
    worker.stop().await?;

    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger").fetch_one(engine.pool()).await?;
    println!("run {:?} after {} attempts; ledger rows: {rows} (exactly once)", run.state, run.attempt);
    Ok(())
}
