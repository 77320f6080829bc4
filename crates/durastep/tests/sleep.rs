//! Durable sleep: never wakes early by the database clock, wakes within the
//! poll interval without any notification, honours time zones, holds no worker,
//! and computes its wake time once.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use chrono::{DateTime, NaiveDateTime, SubsecRound, TimeZone, Utc};
use chrono_tz::Europe::Amsterdam;
use durastep::{Backoff, Ctx, Engine, Event, Function, HandlerError, RunState, WorkerOptions};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

fn bump(n: &AtomicU32) -> u32 {
    n.fetch_add(1, Ordering::SeqCst) + 1
}

async fn sleeping(engine: &Engine, id: Uuid) -> durastep::Run {
    common::wait_for_run_where(engine, id, "the run to sleep", |r| r.state == RunState::Sleeping).await
}

/// Moves the database clock to `offset` from `at` (negative: before it).
async fn move_clock_to(engine: &Engine, at: DateTime<Utc>, offset: chrono::Duration) {
    let now = durastep::testing::db_now(engine).await.unwrap();
    let by = (at + offset - now).to_std().expect("the target time is ahead of the database clock");
    durastep::testing::advance_clock(engine, by).await.unwrap();
}

/// With LISTEN off, only polling can wake the run. One second before its wake
/// time (by the database clock) it still sleeps; just after, it wakes within
/// the poll interval plus slack. Catches: due-ness by the worker's clock, an
/// off-by-one in the claim's `run_at <= now`, or a worker that waits for a
/// notification that never comes.
#[sqlx::test(migrations = false)]
async fn sleep_never_wakes_early_and_wakes_by_polling_alone(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let after = Arc::new(AtomicU32::new(0));
    let a = after.clone();
    let f = Function::new("cool-down").on_event("go").handler(move |ctx: Ctx, _: ()| {
        let a = a.clone();
        async move {
            ctx.sleep("cool-down", Duration::from_secs(3600)).await?;
            let woke_at = ctx.db_time();
            ctx.step("after", || async {
                bump(&a);
                Ok(woke_at)
            })
            .await
        }
    });
    let poll = Duration::from_millis(200);
    let options = WorkerOptions { listen: false, poll_interval: poll, ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![f], options).await;
    let sent_at = durastep::testing::db_now(&engine).await.unwrap();
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let wake_at = sleeping(&engine, id).await.run_at;
    let planned = (wake_at - sent_at).num_milliseconds();
    assert!((3_600_000..3_602_000).contains(&planned), "wake time {planned} ms after sending");

    move_clock_to(&engine, wake_at, chrono::Duration::seconds(-1)).await;
    common::stays(&engine, id, poll * 3, "asleep one second before its time", |r| r.state == RunState::Sleeping).await;
    assert_eq!(after.load(Ordering::SeqCst), 0);

    move_clock_to(&engine, wake_at, chrono::Duration::milliseconds(100)).await;
    let moved = Instant::now();
    let run = common::finished(&engine, id).await;
    let took = moved.elapsed();
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert!(took < poll + Duration::from_secs(2), "woke {took:?} after its time; poll interval is {poll:?}");
    let woke_at: DateTime<Utc> = serde_json::from_value(run.output.unwrap()).unwrap();
    assert!(woke_at >= wake_at, "woke at {woke_at} before its wake time {wake_at}");
    assert_eq!(after.load(Ordering::SeqCst), 1);
}

/// Story B: sleep until the next 01:30 in Amsterdam (TikTok resets at midnight
/// UTC, 01:00 or 02:00 local). The stored wake time is that instant, not 01:30
/// UTC, and the run wakes then and not a second before. Catches: a time zone
/// dropped on the way to the database.
#[sqlx::test(migrations = false)]
async fn sleep_until_honours_the_time_zone(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let f = Function::new("tiktok-bump").on_event("go").handler(|ctx: Ctx, local: NaiveDateTime| async move {
        let at = Amsterdam
            .from_local_datetime(&local)
            .single()
            .ok_or_else(|| HandlerError::permanent("01:30 is never ambiguous in Amsterdam"))?;
        ctx.sleep_until("until-reset", at).await?;
        ctx.step("push", || async { Ok("pushed".to_owned()) }).await
    });
    let engine = common::engine(&opts, vec![f]).await;
    // The next 01:30 Amsterdam time after the database's now.
    let now = durastep::testing::db_now(&engine).await.unwrap().with_timezone(&Amsterdam);
    let mut local = now.date_naive().and_hms_opt(1, 30, 0).unwrap();
    if Amsterdam.from_local_datetime(&local).unwrap() <= now {
        local += chrono::Duration::days(1);
    }
    let expected = Amsterdam.from_local_datetime(&local).unwrap().with_timezone(&Utc);
    let offset = (local.and_utc() - expected).num_hours();
    assert!(offset == 1 || offset == 2, "Amsterdam is UTC+1 or UTC+2, got {offset}");

    let id = engine.send(Event::new("go", &local)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = sleeping(&engine, id).await;
    assert_eq!(run.run_at, expected, "wake time {} is not 01:30 Amsterdam ({local})", run.run_at);

    move_clock_to(&engine, expected, chrono::Duration::seconds(-1)).await;
    common::stays(&engine, id, Duration::from_millis(250), "asleep", |r| r.state == RunState::Sleeping).await;
    move_clock_to(&engine, expected, chrono::Duration::seconds(1)).await;
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!("pushed")));
}

/// A sleeping run is `sleeping` with no worker and no lease, and a worker with
/// one slot runs other runs meanwhile. Catches: a sleep that parks the handler
/// in the worker (the other runs would wait an hour).
#[sqlx::test(migrations = false)]
async fn a_sleeping_run_holds_no_worker(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let sleeper = Function::new("sleeper").on_event("sleep").handler(|ctx: Ctx, _: ()| async move {
        ctx.sleep("nap", Duration::from_secs(3600)).await?;
        Ok("rested")
    });
    let quick = Function::new("quick").on_event("quick").handler(|_ctx: Ctx, n: u32| async move { Ok(n + 1) });
    let options = WorkerOptions { max_in_flight: 1, ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![sleeper, quick], options).await;
    let id = engine.send(Event::new("sleep", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    sleeping(&engine, id).await;
    let (_, worker) = common::lease_of(&engine, id).await;
    assert_eq!(worker, None, "a sleeping run names no worker");
    let leased = common::count(&engine, "durastep.runs WHERE lease_expires_at IS NOT NULL").await;
    assert_eq!(leased, 0, "a sleeping run holds no lease");

    let quick_runs: Vec<Uuid> = engine
        .send_batch((0..3).map(|n| Event::new("quick", &n)).collect())
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.run_ids[0])
        .collect();
    for (n, q) in quick_runs.iter().enumerate() {
        let run = common::finished(&engine, *q).await;
        assert_eq!(run.output, Some(json!(n + 1)), "{run:?}");
    }
    assert_eq!(engine.run(id).await.unwrap().state, RunState::Sleeping);

    durastep::testing::advance_clock(&engine, Duration::from_secs(3601)).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.output, Some(json!("rested")));
}

/// The wake time is checkpointed: a retry after the sleep (a step after it
/// fails once) does not sleep again. Catches: a wake time recomputed from "now"
/// on every attempt (the retry would go back to sleep for an hour).
#[sqlx::test(migrations = false)]
async fn wake_time_is_computed_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let tries = Arc::new(AtomicU32::new(0));
    let t = tries.clone();
    let f = Function::new("nap-then-flaky").on_event("go").backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, _: ()| {
            let t = t.clone();
            async move {
                ctx.sleep("nap", Duration::from_secs(3600)).await?;
                ctx.step("after", || async {
                    if bump(&t) == 1 {
                        return Err(HandlerError::new("fails once after the nap"));
                    }
                    Ok(())
                })
                .await
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let wake_at = sleeping(&engine, id).await.run_at;

    durastep::testing::advance_clock(&engine, Duration::from_secs(3601)).await.unwrap();
    let run = common::wait_for_run_where(&engine, id, "the run to finish without sleeping again", |r| {
        assert!(r.state != RunState::Sleeping || r.run_at == wake_at, "the retry went back to sleep: {r:?}");
        r.state.is_finished()
    })
    .await;
    w.stop().await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 2), "{run:?}");
    assert_eq!(tries.load(Ordering::SeqCst), 2);
    let nap = common::step_row(&engine, id, "nap").await.unwrap();
    let stored: DateTime<Utc> = serde_json::from_value(nap.output["wake_at"].clone()).unwrap();
    // The checkpoint keeps nanoseconds, `run_at` (timestamptz) microseconds.
    assert_eq!(stored.trunc_subsecs(6), wake_at, "the stored wake time is the one the run slept until");
}
