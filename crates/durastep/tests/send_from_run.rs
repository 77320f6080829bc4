//! `ctx.send_event`: a step whose fan-out happens once per run, however often
//! the attempt is retried, and whose events resume waits and start runs like
//! any other send; a run whose own event cancels it (its `cancel_on`, or a new
//! run of its own singleton key) ends `cancelled` once the sending step commits.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Backoff, Ctx, Event, EventMatch, Function, HandlerError, RunState, SendReceipt, SingletonMode};
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
        let got: Option<Value> = ctx
            .wait_for_event(
                "ping",
                durastep::WaitFor::event("ping")
                    .matching(EventMatch::field("/n", &7))
                    .timeout(Duration::from_secs(3600)),
            )
            .await?;
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

/// What a self-cancelling run left behind, straight from the tables.
async fn after_self_cancel(engine: &durastep::Engine, id: uuid::Uuid) -> (Vec<String>, Option<String>) {
    let steps: Vec<String> =
        sqlx::query_scalar("SELECT step_key FROM durastep.step_results WHERE run_id = $1 ORDER BY step_key")
            .bind(id)
            .fetch_all(engine.pool())
            .await
            .unwrap();
    // The attempt ended: its worker no longer holds the run.
    common::wait_until("the cancelled attempt to end", || async {
        common::count(engine, &format!("durastep.runs WHERE id = '{id}' AND worker_id IS NULL")).await == 1
    })
    .await;
    let history: Vec<String> =
        sqlx::query_scalar("SELECT state FROM durastep.run_timeline WHERE run_id = $1 ORDER BY seq, part")
            .bind(id)
            .fetch_all(engine.pool())
            .await
            .unwrap();
    (steps, Some(history.join(",")))
}

/// A run whose `send_event` sends an event that its own `cancel_on` rule
/// matches: the sending step commits (the event is stored once, with its
/// receipt as the step result), then the run ends `cancelled` by that event,
/// in attempt 1, without an error; the step after the send never runs.
/// Catches: the sender's own cancel fencing the sending step's checkpoint in
/// its own transaction, so the step rolled back, the attempt was reported
/// fenced and the reaper retried the run until it failed with "lease expired".
#[sqlx::test(migrations = false)]
async fn a_run_cancelled_by_its_own_event_ends_cancelled_once_the_step_commits(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    common::init_logs();
    let after = Arc::new(AtomicU32::new(0));
    let a = after.clone();
    let f = Function::new("campaign-push")
        .on_event("campaign/push")
        .cancel_on(durastep::CancelOn::event("campaign/paused").key("/campaign_id"))
        .handler(move |ctx: Ctx, e: Value| {
            let a = a.clone();
            async move {
                ctx.step("before", || async { Ok(1) }).await?;
                let pause = Event::new("campaign/paused", &json!({"campaign_id": e["campaign_id"]}));
                ctx.send_event("pause", pause).await?;
                ctx.step("after", || async {
                    a.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
                .await?;
                Ok(())
            }
        });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("campaign/push", &json!({"campaign_id": "c_1"}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    let (steps, history) = after_self_cancel(&engine, id).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Cancelled, "{run:?}");
    assert_eq!(run.cancel_reason.as_deref(), Some("cancelled by event campaign/paused"), "{run:?}");
    assert_eq!((run.attempt, run.last_error.as_deref()), (1, None), "{run:?}");
    assert_eq!(steps, ["before", "pause"], "the sending step's result was not stored");
    assert_eq!(common::count(&engine, "durastep.events WHERE name = 'campaign/paused'").await, 1);
    assert_eq!(after.load(Ordering::SeqCst), 0, "a step ran after the run was cancelled");
    assert_eq!(history.as_deref(), Some("running,cancelled"));
}

/// A run of a `CancelOld` singleton that sends an event for its own key: the
/// send creates the new run and cancels the sender, whose step commits; the
/// sender ends `cancelled` (attempt 1, no lost lease), the new run completes.
/// Catches: the singleton's cancel of the sender fencing the sending step in
/// its own transaction (the new run was never created; the sender was
/// retried until "lease expired").
#[sqlx::test(migrations = false)]
async fn a_singleton_run_replaced_by_its_own_event_ends_cancelled(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let after = Arc::new(std::sync::Mutex::new(Vec::<i64>::new()));
    let a = after.clone();
    let f = Function::new("account-sync")
        .on_event("account/sync")
        .singleton(durastep::Singleton::new(SingletonMode::CancelOld).key("/account"))
        .handler(move |ctx: Ctx, e: Value| {
            let a = a.clone();
            async move {
                let n = e["n"].as_i64().unwrap_or(0);
                let mut successor = None;
                if n == 1 {
                    let next = Event::new("account/sync", &json!({"account": e["account"], "n": 2}));
                    successor = Some(ctx.send_event("hand-over", next).await?.run_ids);
                }
                ctx.step("after", || async {
                    a.lock().unwrap().push(n);
                    Ok(())
                })
                .await?;
                Ok(json!({"n": n, "successor": successor}))
            }
        });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("account/sync", &json!({"account": "a", "n": 1}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    let (steps, _) = after_self_cancel(&engine, id).await;
    let runs = common::runs_of(&engine, "account-sync").await;
    assert_eq!(runs.len(), 2, "the successor was not created: {runs:?}");
    let successor = common::finished(&engine, runs[1]).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Cancelled, "{run:?}");
    assert_eq!(run.cancel_reason.as_deref(), Some("a newer event arrived for singleton key a"), "{run:?}");
    // A singleton's cancel also names itself in last_error (G28); no lease was lost.
    assert_eq!(run.attempt, 1, "{run:?}");
    assert!(!run.last_error.as_deref().unwrap_or("").contains("lease"), "{run:?}");
    assert_eq!(steps, ["hand-over"]);
    assert_eq!(successor.state, RunState::Completed, "{successor:?}");
    assert_eq!(successor.output, Some(json!({"n": 2, "successor": null})));
    assert_eq!(*after.lock().unwrap(), [2], "only the successor ran its step");
}
