//! Start and finish timeouts: what happens is recorded on the run (state
//! `cancelled` and a reason), by the database clock, and a timed-out run
//! executes nothing more.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::Gate;
use durastep::{Ctx, Event, Function, RunState};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// A run still queued 61 s after it was due (no worker was up) is cancelled
/// instead of started, with reason "start timeout: ..."; the handler never
/// runs. A run that started in time is not affected when it later sleeps past
/// the start timeout. Catches: a start timeout measured from the wrong time,
/// or one that also hits resumed runs.
#[sqlx::test(migrations = false)]
async fn a_run_not_started_in_time_is_cancelled(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let started = Arc::new(AtomicU32::new(0));
    let s = started.clone();
    let f = Function::new("push").on_event("go").start_timeout(Duration::from_secs(60)).handler(
        move |ctx: Ctx, sleep: bool| {
            let s = s.clone();
            async move {
                ctx.step("started", || async {
                    s.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
                .await?;
                if sleep {
                    ctx.sleep("nap", Duration::from_secs(600)).await?;
                }
                Ok("done")
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let late = engine.send(Event::new("go", &false)).await.unwrap().run_ids[0];
    durastep::testing::advance_clock(&engine, Duration::from_secs(61)).await.unwrap();
    let on_time = engine.send(Event::new("go", &true)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, late).await;
    assert_eq!(run.state, RunState::Cancelled, "{run:?}");
    assert!(run.cancel_reason.as_deref().unwrap_or("").starts_with("start timeout: not started by "), "{run:?}");
    common::wait_for_run_where(&engine, on_time, "sleeping", |r| r.state == RunState::Sleeping).await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(601)).await.unwrap();
    let run = common::finished(&engine, on_time).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "a resumed run hit the start timeout: {run:?}");
    assert_eq!(started.load(Ordering::SeqCst), 1, "the late run executed");
}

/// Finish timeout of one hour: a run sleeping for two hours is cancelled at
/// the deadline (by the reaper's sweep, while it sleeps), and a running run
/// whose step body is in flight at the deadline stores nothing more and stops.
/// Both keep the reason "finish timeout: ...".
#[sqlx::test(migrations = false)]
async fn a_run_not_finished_in_time_is_cancelled(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (entered, release, dropped) = (Gate::new(), Gate::new(), Gate::new());
    let after = Arc::new(AtomicU32::new(0));
    let (e, r, d, a) = (entered.clone(), release.clone(), dropped.clone(), after.clone());
    let f = Function::new("bounded").on_event("go").finish_timeout(Duration::from_secs(3600)).handler(
        move |ctx: Ctx, hold: bool| {
            let (e, r, d, a) = (e.clone(), r.clone(), d.clone(), a.clone());
            async move {
                if hold {
                    let _guard = common::OpenOnDrop(d);
                    ctx.step("slow", || async move {
                        e.open();
                        r.wait().await;
                        Ok(())
                    })
                    .await?;
                } else {
                    ctx.sleep("two-hours", Duration::from_secs(7200)).await?;
                }
                ctx.step("after", || async move {
                    a.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
                .await?;
                Ok(())
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let sleeper = engine.send(Event::new("go", &false)).await.unwrap().run_ids[0];
    let holder = engine.send(Event::new("go", &true)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, sleeper, "sleeping", |r| r.state == RunState::Sleeping).await;
    entered.reached("the slow step").await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(3601)).await.unwrap();
    for id in [sleeper, holder] {
        let run = common::finished(&engine, id).await;
        assert_eq!(run.state, RunState::Cancelled, "{run:?}");
        assert!(run.cancel_reason.as_deref().unwrap_or("").starts_with("finish timeout: not finished by "), "{run:?}");
    }
    release.open();
    dropped.reached("the timed-out handler to be dropped").await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(7200)).await.unwrap();
    common::stays(&engine, sleeper, Duration::from_millis(300), "cancelled", |r| r.state == RunState::Cancelled).await;
    w.stop().await;
    assert_eq!(after.load(Ordering::SeqCst), 0, "a timed-out run executed a step");
    assert_eq!(common::step_row(&engine, holder, "slow").await, None, "the in-flight step was stored");
}
