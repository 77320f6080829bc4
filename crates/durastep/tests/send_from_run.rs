//! `ctx.send_event`: a step whose fan-out happens once per run, however often
//! the attempt is retried, and whose events resume waits and start runs like
//! any other send.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Backoff, Ctx, Event, EventMatch, Function, HandlerError, RunState, SendReceipt};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The sender sends `budget/pushed`, then a step that fails on attempts 1 to 3
/// (three retries); attempt 4 completes. The event is stored once, with the
/// deterministic key `<run id>:notify`, and the listener runs once; every
/// attempt got the same receipt. Catches: a send outside the step (it would
/// fan out four times), a random idempotency key.
#[sqlx::test(migrations = false)]
async fn a_run_retried_three_times_fans_out_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let receipts = Arc::new(std::sync::Mutex::new(Vec::<SendReceipt>::new()));
    let listened = Arc::new(AtomicU32::new(0));
    let (r, l) = (receipts.clone(), listened.clone());
    let sender = Function::new("sender").on_event("go").retries(3).backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, campaign: String| {
            let r = r.clone();
            async move {
                let receipt =
                    ctx.send_event("notify", Event::new("budget/pushed", &json!({"campaign_id": campaign}))).await?;
                r.lock().unwrap().push(receipt);
                let attempt = ctx.attempt();
                ctx.step("flaky", || async move {
                    if attempt <= 3 { Err(HandlerError::new(format!("flaky on attempt {attempt}"))) } else { Ok(()) }
                })
                .await?;
                Ok(attempt)
            }
        },
    );
    let listener = Function::new("listener").on_event("budget/pushed").handler(move |_ctx: Ctx, data: Value| {
        let l = l.clone();
        async move {
            l.fetch_add(1, Ordering::SeqCst);
            Ok(data)
        }
    });
    let engine = common::engine(&opts, vec![sender, listener]).await;
    let id = engine.send(Event::new("go", &"c_9")).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    assert_eq!((run.state, run.output.clone()), (RunState::Completed, Some(json!(4))), "{run:?}");
    let listener_runs = common::runs_of(&engine, "listener").await;
    assert_eq!(listener_runs.len(), 1, "the event fanned out more than once");
    assert_eq!(common::finished(&engine, listener_runs[0]).await.state, RunState::Completed);
    w.stop().await;

    assert_eq!(common::count(&engine, "durastep.events WHERE name = 'budget/pushed'").await, 1);
    let key: String = sqlx::query_scalar("SELECT idempotency_key FROM durastep.events WHERE name = 'budget/pushed'")
        .fetch_one(engine.pool())
        .await
        .unwrap();
    assert_eq!(key, format!("{id}:notify"));
    assert_eq!(listened.load(Ordering::SeqCst), 1);
    let receipts = receipts.lock().unwrap();
    assert_eq!(receipts.len(), 4, "one receipt per attempt");
    assert!(receipts.iter().all(|r| *r == receipts[0]), "replays returned another receipt: {receipts:?}");
    assert_eq!(receipts[0].run_ids, listener_runs);
}

/// A run's event resumes another run's wait (run-to-run signalling).
#[sqlx::test(migrations = false)]
async fn an_event_sent_from_a_run_resumes_a_wait(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let waiter = Function::new("waiter").on_event("wait").handler(|ctx: Ctx, _: ()| async move {
        let got: Option<Value> =
            ctx.wait_for_event("ping", "ping", EventMatch::field("/n", &7), Duration::from_secs(3600)).await?;
        Ok(got)
    });
    let pinger = Function::new("pinger").on_event("ping/now").handler(|ctx: Ctx, _: ()| async move {
        ctx.send_event("ping", Event::new("ping", &json!({"n": 7}))).await?;
        Ok(())
    });
    let engine = common::engine(&opts, vec![waiter, pinger]).await;
    let id = engine.send(Event::new("wait", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, id, "waiting", |r| r.state == RunState::Waiting).await;
    engine.send(Event::new("ping/now", &())).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.output, Some(json!({"n": 7})), "{run:?}");
}
