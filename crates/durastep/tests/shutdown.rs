//! Graceful shutdown: a running attempt may finish within the grace period; one
//! still running after it is released (queued, attempt not counted), its
//! handler is dropped, and another worker finishes the run.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use durastep::{Ctx, Event, Function, RunState, WorkerOptions};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::{Gate, OpenOnDrop};

fn bump(n: &AtomicU32) -> u32 {
    n.fetch_add(1, Ordering::SeqCst) + 1
}

/// The worker is told to stop while a handler is mid-step; it keeps running
/// (and heartbeating) until the handler finishes, the run completes, and only
/// then does the worker return. Catches: a shutdown that abandons in-flight work
/// at once (the run would wait for its lease to expire and be retried).
#[sqlx::test(migrations = false)]
async fn running_attempt_finishes_within_the_grace_period(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (entered, gate) = (Gate::new(), Gate::new());
    let (e2, g2) = (entered.clone(), gate.clone());
    let f = Function::new("report").on_event("go").handler(move |ctx: Ctx, _: ()| {
        let (e2, g2) = (e2.clone(), g2.clone());
        async move {
            let n: u32 = ctx
                .step("crunch", || async {
                    e2.open();
                    g2.wait().await;
                    Ok(42)
                })
                .await?;
            ctx.step("send", || async move { Ok(n + 1) }).await
        }
    });
    let options = WorkerOptions { shutdown_grace: Duration::from_secs(10), ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![f], options).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered.reached("the handler to start").await;

    w.request_stop();
    // Past several heartbeats and polls, the worker is still there, holding the run.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(!w.is_finished(), "the worker returned while an attempt was running");
    assert_eq!(engine.run(id).await.unwrap().state, RunState::Running);

    let released = Instant::now();
    gate.open();
    w.stop_within(Duration::from_secs(5)).await;
    assert!(released.elapsed() < Duration::from_secs(5));
    let run = engine.run(id).await.unwrap();
    assert_eq!((run.state, run.attempt), (RunState::Completed, 1), "{run:?}");
    assert_eq!(run.output, Some(json!(43)));
}

/// A handler still running when the grace period ends is dropped and its run
/// released without counting the attempt; the worker returns promptly; a new
/// worker finishes the run, and the step finished before the shutdown is not
/// redone. Catches: a release that counts the attempt (or marks it failed), a
/// handler left running after shutdown (the worker would hang waiting for it),
/// or a run left `running` until its lease expires.
#[sqlx::test(migrations = false)]
async fn attempt_past_the_grace_is_released_and_finished_elsewhere(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (entered, dropped) = (Gate::new(), Gate::new());
    let (before, after, entries) =
        (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (e2, d2, b2, a2, n2) = (entered.clone(), dropped.clone(), before.clone(), after.clone(), entries.clone());
    let f = Function::new("long-haul").on_event("go").retries(0).handler(move |ctx: Ctx, _: ()| {
        let (e2, d2, b2, a2, n2) = (e2.clone(), d2.clone(), b2.clone(), a2.clone(), n2.clone());
        async move {
            let first = bump(&n2) == 1;
            let _guard = first.then(|| OpenOnDrop(d2.clone()));
            ctx.step("before", || async {
                bump(&b2);
                Ok(())
            })
            .await?;
            if first {
                e2.open();
                std::future::pending::<()>().await; // outlives any grace period
            }
            ctx.step("after", || async {
                bump(&a2);
                Ok("done".to_owned())
            })
            .await
        }
    });
    let grace = Duration::from_millis(300);
    let options = WorkerOptions { shutdown_grace: grace, ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![f], options).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered.reached("the handler to start").await;

    let stopping = Instant::now();
    w.stop_within(Duration::from_secs(5)).await;
    assert!(stopping.elapsed() >= grace, "the worker did not wait for the grace period");
    dropped.reached("the worker to drop the handler past the grace").await;
    let run = engine.run(id).await.unwrap();
    assert_eq!((run.state, run.attempt), (RunState::Queued, 1), "released, attempt not counted: {run:?}");
    assert_eq!(common::lease_of(&engine, id).await.1, None);

    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 1), "{run:?}");
    assert_eq!(run.output, Some(json!("done")));
    assert_eq!(before.load(Ordering::SeqCst), 1, "the step finished before the shutdown ran again");
    assert_eq!(after.load(Ordering::SeqCst), 1);
    assert_eq!(entries.load(Ordering::SeqCst), 2);
    // G30: the release is in the history, without an error.
    let d = engine.inspect().run(id).await.unwrap();
    let outcomes: Vec<_> = d.attempts.iter().map(|a| (a.attempt, a.outcome, a.error.clone())).collect();
    use durastep::inspect::AttemptOutcome::{Completed, Released};
    assert_eq!(outcomes, [(1, Released, None), (1, Completed, None)]);
}

/// A `WorkerHandle` dropped without `stop` still tells its worker to stop:
/// the worker claims nothing more, gives its attempt the grace period and
/// then releases its run, with no one waiting for it. Catches: a handle whose
/// drop leaves the worker running (the gated attempt would hold its run, and
/// a second run would be claimed and completed).
#[sqlx::test(migrations = false)]
async fn a_dropped_worker_handle_stops_its_worker(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (entered, gate) = (Gate::new(), Gate::new());
    let (e2, g2) = (entered.clone(), gate.clone());
    let f = Function::new("held").on_event("go").handler(move |ctx: Ctx, first: bool| {
        let (e2, g2) = (e2.clone(), g2.clone());
        async move {
            ctx.step("wait", || async move {
                if first {
                    e2.open();
                    g2.wait().await;
                }
                Ok(())
            })
            .await
        }
    });
    let options = WorkerOptions { shutdown_grace: Duration::from_millis(300), ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![f], options).await;
    let held = engine.send(Event::new("go", &true)).await.unwrap().run_ids[0];
    let worker = engine.spawn_worker();
    entered.reached("the handler to start").await;

    drop(worker);
    let run =
        common::wait_for_run_where(&engine, held, "the run to be released", |r| r.state == RunState::Queued).await;
    assert_eq!(run.attempt, 1, "released, attempt not counted: {run:?}");
    let later = engine.send(Event::new("go", &false)).await.unwrap().run_ids[0];
    // Several of the stopped worker's polls (50 ms) and a NOTIFY later, the run is still queued.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(engine.run(later).await.unwrap().state, RunState::Queued);

    gate.open();
    let worker = engine.spawn_worker();
    for id in [held, later] {
        assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);
    }
    worker.stop().await.unwrap();
}
