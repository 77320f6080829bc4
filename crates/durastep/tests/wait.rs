//! `ctx.wait_for_event`: a matching event resumes the run with its data, a
//! non-matching one does not, the timeout returns None by the database clock,
//! an event that commits before the wait is recorded does not count, the
//! commit race between a sender and a waiter never loses a wake-up, and a
//! cancelled waiter is not resumed.
mod common;

use std::sync::Arc;
use std::time::Duration;

use durastep::{Ctx, Engine, Event, EventMatch, Function, RunState};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const HOUR: Duration = Duration::from_secs(3600);

/// Waits for `approval` of its campaign, an hour at most; returns what came.
fn approver() -> Function {
    Function::new("approver").on_event("campaign/created").handler(|ctx: Ctx, c: Value| async move {
        let got: Option<Value> = ctx
            .wait_for_event(
                "approval",
                durastep::WaitFor::event("campaign/approved")
                    .matching(EventMatch::field("/campaign_id", &c["campaign_id"]))
                    .timeout(HOUR),
            )
            .await?;
        // A step after the wait: replays must return the same outcome.
        let seen = ctx.step("record", || async { Ok(got.clone()) }).await?;
        Ok(json!({"got": seen}))
    })
}

async fn waiting(engine: &Engine, id: Uuid) -> durastep::Run {
    common::wait_for_run_where(engine, id, "the run to wait", |r| r.state == RunState::Waiting).await
}

async fn waits_of(engine: &Engine, id: Uuid) -> i64 {
    common::count(engine, &format!("durastep.waits WHERE run_id = '{id}'")).await
}

/// A matching event resumes the run with its data; a non-matching one (other
/// campaign) and one of another name do not. The waiting run holds no worker
/// or lease, its wait row goes when it is resumed, and the result is stored
/// once (the run completes with it). Catches: matching on the wrong field,
/// any event resuming every waiter, a wake-up that is never claimed.
#[sqlx::test(migrations = false)]
async fn matching_event_resumes_and_others_do_not(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let engine = common::engine(&opts, vec![approver()]).await;
    let id = engine.send(Event::new("campaign/created", &json!({"campaign_id": "c1"}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = waiting(&engine, id).await;
    let now = durastep::testing::db_now(&engine).await.unwrap();
    let deadline = (run.run_at - now).num_seconds();
    assert!((3590..=3600).contains(&deadline), "deadline {deadline} s from now, want one hour");
    assert_eq!(common::lease_of(&engine, id).await.1, None, "a waiting run names no worker");
    assert_eq!(waits_of(&engine, id).await, 1);

    engine.send(Event::new("campaign/approved", &json!({"campaign_id": "c2", "by": "x"}))).await.unwrap();
    engine.send(Event::new("campaign/rejected", &json!({"campaign_id": "c1"}))).await.unwrap();
    common::stays(&engine, id, Duration::from_millis(300), "waiting", |r| r.state == RunState::Waiting).await;

    engine.send(Event::new("campaign/approved", &json!({"campaign_id": "c1", "by": "ann"}))).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!({"got": {"campaign_id": "c1", "by": "ann"}})));
    assert_eq!(waits_of(&engine, id).await, 0, "the wait row outlived its wait");
    let stored = common::step_row(&engine, id, "approval").await.expect("wait result stored");
    assert_eq!(stored.output["data"], json!({"campaign_id": "c1", "by": "ann"}));
}

/// No matching event: the run still waits one second before its deadline (by
/// the database clock) and resumes with None just after it. A matching event
/// sent after the timeout changes nothing. Catches: a deadline recomputed on
/// each execution (it would never time out), a timeout by the worker's clock.
#[sqlx::test(migrations = false)]
async fn timeout_returns_none_at_the_deadline(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let engine = common::engine(&opts, vec![approver()]).await;
    let id = engine.send(Event::new("campaign/created", &json!({"campaign_id": "c1"}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let deadline = waiting(&engine, id).await.run_at;
    let now = durastep::testing::db_now(&engine).await.unwrap();
    durastep::testing::advance_clock(&engine, (deadline - now - chrono::Duration::seconds(1)).to_std().unwrap())
        .await
        .unwrap();
    common::stays(&engine, id, Duration::from_millis(300), "waiting before its deadline", |r| {
        r.state == RunState::Waiting
    })
    .await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(2)).await.unwrap();
    let run = common::finished(&engine, id).await;
    assert_eq!(run.output, Some(json!({"got": null})), "{run:?}");
    engine.send(Event::new("campaign/approved", &json!({"campaign_id": "c1"}))).await.unwrap();
    w.stop().await;
    assert_eq!(common::step_row(&engine, id, "approval").await.unwrap().output, json!({"timed_out": true}));
    assert_eq!(waits_of(&engine, id).await, 0);
}

/// The decision documented on `wait_for_event`: an event that commits before
/// the wait is recorded does not count, even one sent while the run is on its
/// way to the wait. The run then times out. Catches: an implementation that
/// sometimes picks up earlier events (the behaviour would depend on timing).
#[sqlx::test(migrations = false)]
async fn an_event_just_before_the_wait_does_not_count(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (entered, go) = (common::Gate::new(), common::Gate::new());
    let (e, g) = (entered.clone(), go.clone());
    let f = Function::new("late").on_event("start").handler(move |ctx: Ctx, _: ()| {
        let (e, g) = (e.clone(), g.clone());
        async move {
            ctx.step("before", || async move {
                e.open();
                g.wait().await;
                Ok(())
            })
            .await?;
            let got: Option<Value> =
                ctx.wait_for_event("reply", durastep::WaitFor::event("reply").timeout(HOUR)).await?;
            Ok(got)
        }
    });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("start", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered.reached("the step before the wait").await;
    engine.send(Event::new("reply", &json!({"ok": true}))).await.unwrap();
    go.open();
    waiting(&engine, id).await;
    durastep::testing::advance_clock(&engine, HOUR + Duration::from_secs(1)).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.output, Some(Value::Null), "the earlier event resumed the wait: {run:?}");
}

/// A waiting run that is cancelled is not resumed by a matching event: it
/// stays cancelled, stores no result, and its wait row is gone.
#[sqlx::test(migrations = false)]
async fn a_cancelled_waiter_is_not_resumed(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let engine = common::engine(&opts, vec![approver()]).await;
    let id = engine.send(Event::new("campaign/created", &json!({"campaign_id": "c1"}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    waiting(&engine, id).await;
    engine.cancel(id, "campaign deleted").await.unwrap();
    assert_eq!(waits_of(&engine, id).await, 0, "cancel left the wait row");
    engine.send(Event::new("campaign/approved", &json!({"campaign_id": "c1"}))).await.unwrap();
    common::stays(&engine, id, Duration::from_millis(300), "cancelled", |r| r.state == RunState::Cancelled).await;
    w.stop().await;
    assert_eq!(common::step_row(&engine, id, "approval").await, None);
    let run = engine.run(id).await.unwrap();
    assert_eq!(run.cancel_reason.as_deref(), Some("campaign deleted"));
}

/// The commit race. Each iteration: a run reaches its wait at the same moment
/// as the test sends the matching event, each in its own transaction, with a
/// random delay of 0-1.5 ms on each side, so both orders happen and the two
/// transactions often overlap. Ground truth for which
/// committed first comes from the database: inside the sender's transaction,
/// after `send_in` (which holds the name's topic row FOR SHARE), the topic's
/// `waits` counter shows whether the wait was recorded before. Then:
/// recorded before the event -> the run must resume with the event; event
/// first -> it must not count (the run times out with None). Any lost
/// wake-up, and any early event picked up, fails. 200 iterations
/// (DURASTEP_SOAK=1: 2000); the seed is printed (DURASTEP_SEED replays it).
#[sqlx::test(migrations = false)]
async fn event_and_wait_racing_never_lose_a_wake_up(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let iterations: u32 = if std::env::var_os("DURASTEP_SOAK").is_some() { 2000 } else { 200 };
    let seed: u64 = std::env::var("DURASTEP_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| Uuid::new_v4().as_u128() as u64);
    println!("event_and_wait_racing_never_lose_a_wake_up: DURASTEP_SEED={seed}");
    let mut rng = seed;
    let mut next = move || {
        // xorshift64*: enough for jitter.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };

    let barrier = Arc::new(tokio::sync::Barrier::new(2));
    let met = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    let (b, m) = (barrier.clone(), met.clone());
    let f = Function::new("racer").on_event("race/start").handler(move |ctx: Ctx, (i, delay_us): (u32, u64)| {
        let (b, m) = (b.clone(), m.clone());
        async move {
            // Only the first execution of each run meets the test at the barrier.
            let first = m.lock().unwrap().insert(i);
            if first {
                b.wait().await;
                spin(Duration::from_micros(delay_us)).await;
            }
            #[derive(serde::Deserialize)]
            struct Reply {
                i: u32,
            }
            let got: Option<Reply> = ctx
                .wait_for_event(
                    "reply",
                    durastep::WaitFor::event(format!("race/reply-{i}"))
                        .matching(EventMatch::field("/i", &i))
                        .timeout(HOUR),
                )
                .await?;
            Ok(got.map(|r| r.i))
        }
    });
    let engine = common::engine(&opts, vec![f]).await;
    let w = common::spawn_worker(&engine);
    let (mut wait_first, mut event_first) = (Vec::new(), Vec::new());
    for i in 0..iterations {
        let (waiter_delay, sender_delay) = (next() % 1500, next() % 1500);
        let id = engine.send(Event::new("race/start", &(i, waiter_delay))).await.unwrap().run_ids[0];
        tokio::time::timeout(common::DEADLINE, barrier.wait()).await.expect("the run reached the barrier");
        spin(Duration::from_micros(sender_delay)).await;
        let name = format!("race/reply-{i}");
        let mut tx = engine.pool().begin().await.unwrap();
        engine.send_in(&mut tx, Event::new(name.clone(), &json!({"i": i}))).await.unwrap();
        let recorded: Option<i64> = sqlx::query_scalar("SELECT (SELECT waits FROM durastep.topics WHERE name = $1)")
            .bind(&name)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        if recorded.unwrap_or(0) > 0 {
            wait_first.push((i, id));
            let run = common::finished(&engine, id).await;
            assert_eq!(run.output, Some(json!(i)), "iteration {i}: wake-up lost (seed {seed}): {run:?}");
        } else {
            event_first.push((i, id));
            let run = waiting(&engine, id).await;
            assert_eq!(run.state, RunState::Waiting, "iteration {i}: event committed first must not count");
        }
    }
    // Time out the runs whose event came first: each must end with None.
    durastep::testing::advance_clock(&engine, HOUR + Duration::from_secs(1)).await.unwrap();
    for (i, id) in &event_first {
        let run = common::finished(&engine, *id).await;
        assert_eq!(run.output, Some(Value::Null), "iteration {i}: an earlier event was delivered (seed {seed})");
    }
    w.stop().await;
    println!(
        "{iterations} iterations: wait recorded first {} (all resumed), event first {} (all timed out)",
        wait_first.len(),
        event_first.len()
    );
    assert!(!wait_first.is_empty(), "the race never had the wait first; the test tested one order only");
}

/// Waits `d` precisely (tokio timers have millisecond granularity).
async fn spin(d: Duration) {
    let until = std::time::Instant::now() + d;
    while std::time::Instant::now() < until {
        tokio::task::yield_now().await;
    }
}

/// Catches: an event whose data is JSON `null` (`Event::new(name, &())`)
/// mistaken for a stored wait with no event, which failed the run permanently.
#[sqlx::test(migrations = false)]
async fn an_event_with_null_data_resumes_the_wait(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = durastep::Function::new("pinged").on_event("start").handler(|ctx: durastep::Ctx, _: ()| async move {
        let got: Option<()> =
            ctx.wait_for_event("ping", durastep::WaitFor::event("ping").timeout(Duration::from_secs(600))).await?;
        Ok(got.is_some())
    });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("start", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    waiting(&engine, id).await;
    engine.send(Event::new("ping", &())).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!((run.state, run.output), (RunState::Completed, Some(json!(true))), "{:?}", run.last_error);
}
