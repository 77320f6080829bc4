//! Delayed start: `Event::start_at` makes the event's runs due at that time by
//! the database clock, never earlier; a start timeout counts from then.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Ctx, Event, Function, RunState};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// An event sent to start in one hour: its run is queued with run_at = that
/// time, does not start one second before it (a worker polling every 50 ms is
/// up the whole time), and starts just after. With a 60 s start timeout, the
/// hour spent waiting for its start time does not count. Catches: start_at
/// ignored, due-ness by the worker's clock, a start timeout measured from
/// the send.
#[sqlx::test(migrations = false)]
async fn a_delayed_event_starts_at_its_time_and_not_before(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let ran = Arc::new(AtomicU32::new(0));
    let r = ran.clone();
    let f = Function::new("report").on_event("report/due").start_timeout(Duration::from_secs(60)).handler(
        move |ctx: Ctx, _: ()| {
            let r = r.clone();
            async move {
                r.fetch_add(1, Ordering::SeqCst);
                Ok(ctx.db_time())
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let now = durastep::testing::db_now(&engine).await.unwrap();
    let at = now + chrono::Duration::hours(1);
    let id = engine.send(Event::new("report/due", &()).start_at(at)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = engine.run(id).await.unwrap();
    assert_eq!((run.state, run.run_at), (RunState::Queued, at));
    durastep::testing::advance_clock(&engine, Duration::from_secs(3599)).await.unwrap();
    common::stays(&engine, id, Duration::from_millis(300), "queued before its start time", |r| {
        r.state == RunState::Queued
    })
    .await;
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    durastep::testing::advance_clock(&engine, Duration::from_secs(2)).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    let started: chrono::DateTime<chrono::Utc> = serde_json::from_value(run.output.unwrap()).unwrap();
    assert!(started >= at, "started at {started}, before its start time {at}");
}
