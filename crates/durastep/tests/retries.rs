//! Retries and failure: backoff by the database clock, only the failing step
//! runs again, out of attempts or permanent means `failed` with the last error,
//! panics fail an attempt without hurting the worker, and `on_failure` runs
//! exactly once per dead run, whichever way it died.
mod common;

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durastep::{
    Backoff, Ctx, Engine, Event, FailedRun, Function, HandlerError, HandlerResult, Run, RunState, WorkerOptions,
};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

use common::{Gate, LONG_LEASE};

fn bump(n: &AtomicU32) -> u32 {
    n.fetch_add(1, Ordering::SeqCst) + 1
}

/// How far ahead of the database clock the run is due.
async fn due_in(engine: &Engine, run: &Run) -> Duration {
    let now = durastep::testing::db_now(engine).await.unwrap();
    (run.run_at - now).to_std().unwrap_or_default()
}

async fn queued_for_attempt(engine: &Engine, id: Uuid, attempt: u32) -> Run {
    common::wait_for_run_where(engine, id, &format!("attempt {attempt} to be queued"), |r| {
        r.state == RunState::Queued && r.attempt == attempt
    })
    .await
}

/// Catches: a retry that runs before its backoff by the database clock, or one
/// that re-runs the step that succeeded before the failing one.
#[sqlx::test(migrations = false)]
async fn failing_step_is_retried_alone_after_its_backoff(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (fetch, flaky) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (f1, f2) = (fetch.clone(), flaky.clone());
    let f = Function::new("retry-alone").on_event("go").backoff(Backoff::Fixed(Duration::from_secs(10))).handler(
        move |ctx: Ctx, _: ()| {
            let (f1, f2) = (f1.clone(), f2.clone());
            async move {
                let token: String = ctx
                    .step("fetch", || async {
                        bump(&f1);
                        Ok("token".to_owned())
                    })
                    .await?;
                ctx.step("flaky", || async {
                    let n = bump(&f2);
                    if n < 3 {
                        return Err(HandlerError::new(format!("429 number {n}")));
                    }
                    Ok(format!("pushed with {token}"))
                })
                .await
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    for attempt in 2..=3 {
        let run = queued_for_attempt(&engine, id, attempt).await;
        assert_eq!(run.last_error, Some(format!("step flaky: 429 number {}", attempt - 1)));
        let wait = due_in(&engine, &run).await;
        assert!(wait > Duration::from_secs(9) && wait <= Duration::from_secs(10), "due in {wait:?}");
        common::stays(&engine, id, Duration::from_millis(250), "queued until its backoff", |r| {
            r.state == RunState::Queued && r.attempt == attempt
        })
        .await;
        durastep::testing::advance_clock(&engine, Duration::from_secs(10)).await.unwrap();
    }
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!("pushed with token")));
    assert_eq!((fetch.load(Ordering::SeqCst), flaky.load(Ordering::SeqCst)), (1, 3));
}

/// Catches: a run retried past its attempts, or one that loses its last error.
#[sqlx::test(migrations = false)]
async fn out_of_attempts_the_run_fails_with_its_last_error(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let tries = Arc::new(AtomicU32::new(0));
    let t = tries.clone();
    let f = Function::new("doomed").on_event("go").retries(2).backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, _: ()| {
            let t = t.clone();
            async move {
                ctx.step("charge", || async { Err::<(), _>(HandlerError::new(format!("declined #{}", bump(&t)))) })
                    .await
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    common::stays(&engine, id, Duration::from_millis(200), "failed", |r| r.state == RunState::Failed).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    assert_eq!((run.attempt, run.max_attempts), (3, 3));
    assert_eq!(run.last_error.as_deref(), Some("step charge: declined #3"));
    assert!(run.finished_at.is_some());
    assert_eq!(tries.load(Ordering::SeqCst), 3, "no attempt after the last");
}

/// A permanent error fails the run on attempt 1, from a step or from the
/// handler itself. Catches: permanence lost on the way (a step's error is
/// re-wrapped) so the run burns all its retries.
#[sqlx::test(migrations = false)]
async fn permanent_error_fails_the_run_at_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let tries = Arc::new(AtomicU32::new(0));
    let t = tries.clone();
    let in_step =
        Function::new("permanent-step").on_event("go").retries(5).backoff(Backoff::Fixed(Duration::ZERO)).handler(
            move |ctx: Ctx, _: ()| {
                let t = t.clone();
                async move {
                    ctx.step("lookup", || async {
                        bump(&t);
                        Err::<(), _>(HandlerError::permanent("no such campaign"))
                    })
                    .await
                }
            },
        );
    let in_handler = Function::new("permanent-handler")
        .on_event("go")
        .retries(5)
        .backoff(Backoff::Fixed(Duration::ZERO))
        .handler(|_ctx: Ctx, _: ()| async move { Err::<(), _>(HandlerError::permanent("bad request")) });
    let engine = common::engine(&opts, vec![in_step, in_handler]).await;
    let ids = engine.send(Event::new("go", &())).await.unwrap().run_ids;
    let w = common::spawn_worker(&engine);
    let mut errors = HashSet::new();
    for id in ids {
        let run = common::finished(&engine, id).await;
        assert_eq!((run.state, run.attempt), (RunState::Failed, 1), "{run:?}");
        errors.insert(run.last_error.unwrap());
    }
    w.stop().await;
    assert_eq!(errors, HashSet::from(["step lookup: no such campaign".to_owned(), "bad request".to_owned()]));
    assert_eq!(tries.load(Ordering::SeqCst), 1);
}

/// A panic in a handler or in a step body fails that attempt (and is retried
/// like any failure), while the same worker, with two slots, goes on running
/// other runs. Catches: a panic that kills the worker loop or leaks its slot.
#[sqlx::test(migrations = false)]
async fn panics_fail_the_attempt_and_the_worker_keeps_working(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let step_panics = Arc::new(AtomicU32::new(0));
    let sp = step_panics.clone();
    let in_handler = Function::new("panics-in-handler").on_event("panic/handler").retries(0).handler(
        |_ctx: Ctx, explode: bool| async move {
            if explode {
                panic!("kaboom in the handler");
            }
            Ok(())
        },
    );
    let in_step = Function::new("panics-in-step")
        .on_event("panic/step")
        .retries(1)
        .backoff(Backoff::Fixed(Duration::ZERO))
        .handler(move |ctx: Ctx, _: ()| {
            let sp = sp.clone();
            async move {
                ctx.step("fragile", || async {
                    let n = bump(&sp);
                    if n == 1 {
                        panic!("kaboom in step call {n}");
                    }
                    Ok(n)
                })
                .await
            }
        });
    let steady = Function::new("steady")
        .on_event("steady")
        .handler(|ctx: Ctx, n: u32| async move { ctx.step("double", || async move { Ok(n * 2) }).await });
    let options = WorkerOptions { max_in_flight: 2, ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![in_handler, in_step, steady], options).await;
    let mut events = vec![Event::new("panic/handler", &true), Event::new("panic/step", &())];
    events.extend((0..6).map(|n| Event::new("steady", &n)));
    let ids: Vec<Uuid> = engine.send_batch(events).await.unwrap().into_iter().map(|r| r.run_ids[0]).collect();
    let w = common::spawn_worker(&engine);
    let mut runs = Vec::new();
    for id in &ids {
        runs.push(common::finished(&engine, *id).await);
    }
    assert!(!w.is_finished(), "the worker died");
    w.stop().await;

    assert_eq!((runs[0].state, runs[0].attempt), (RunState::Failed, 1), "{:?}", runs[0]);
    assert_eq!(runs[0].last_error.as_deref(), Some("handler panicked: kaboom in the handler"));
    assert_eq!((runs[1].state, runs[1].attempt), (RunState::Completed, 2), "{:?}", runs[1]);
    assert_eq!(runs[1].last_error.as_deref(), Some("handler panicked: kaboom in step call 1"));
    assert_eq!(runs[1].output, Some(json!(2)));
    for (n, run) in runs[2..].iter().enumerate() {
        assert_eq!(run.state, RunState::Completed, "{run:?}");
        assert_eq!(run.output, Some(json!(n * 2)));
    }
}

/// Story A: after a failure the run waits `30 s * attempts^2` by the database
/// clock and is not claimed before (a worker polling every 50 ms is running all
/// along). Catches: backoff measured by the worker's clock, the wrong attempt
/// number fed to the backoff, or a claim that ignores `run_at`.
#[sqlx::test(migrations = false)]
async fn story_a_backoff_waits_30s_times_attempts_squared(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let posts = Arc::new(AtomicU32::new(0));
    let p = posts.clone();
    let f = Function::new("slack-post")
        .on_event("deal/stage.changed")
        .retries(4)
        .backoff(Backoff::custom(|attempts| Duration::from_secs(30 * u64::from(attempts).pow(2))))
        .handler(move |ctx: Ctx, _: ()| {
            let p = p.clone();
            async move {
                ctx.step("post", || async {
                    let n = bump(&p);
                    if n < 3 {
                        return Err(HandlerError::new(format!("channel_not_found #{n}")));
                    }
                    Ok(())
                })
                .await
            }
        });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("deal/stage.changed", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);

    for (attempt, backoff) in [(2, 30u64), (3, 120)] {
        let run = queued_for_attempt(&engine, id, attempt).await;
        let wait = due_in(&engine, &run).await;
        assert!(
            wait > Duration::from_secs(backoff - 1) && wait <= Duration::from_secs(backoff),
            "after failed attempt {}: due in {wait:?}, expected {backoff} s",
            attempt - 1
        );
        assert_eq!(run.last_error, Some(format!("step post: channel_not_found #{}", attempt - 1)));
        let still_queued = |r: &Run| r.state == RunState::Queued && r.attempt == attempt;
        common::stays(&engine, id, Duration::from_millis(300), "queued", still_queued).await;
        durastep::testing::advance_clock(&engine, Duration::from_secs(backoff - 2)).await.unwrap();
        common::stays(&engine, id, Duration::from_millis(300), "queued 2 s before its time", still_queued).await;
        durastep::testing::advance_clock(&engine, Duration::from_secs(3)).await.unwrap();
    }
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 3), "{run:?}");
    assert_eq!(posts.load(Ordering::SeqCst), 3);
}

/// What an on_failure handler saw.
#[derive(Default)]
struct FailureLog {
    entries: AtomicU32,
    pages: AtomicU32,
    acks: AtomicU32,
    seen: Mutex<Vec<FailedRun<Value>>>,
}

/// A boxed future, so `on_call` can name its handler's return type.
type BoxFuture = Pin<Box<dyn Future<Output = HandlerResult<()>> + Send>>;

/// An on_failure handler that pages once (a step) and then acknowledges (a
/// step); with `flaky_ack` the very first acknowledgement fails, so that
/// handler is retried, and its retry must not page again.
fn on_call(
    log: Arc<FailureLog>,
    flaky_ack: bool,
) -> impl Fn(Ctx, FailedRun<Value>) -> BoxFuture + Send + Sync + 'static {
    move |ctx: Ctx, failed: FailedRun<Value>| {
        let log = log.clone();
        Box::pin(async move {
            bump(&log.entries);
            ctx.step("page on-call", || async {
                bump(&log.pages);
                Ok(())
            })
            .await?;
            ctx.step("ack", || async {
                if bump(&log.acks) == 1 && flaky_ack {
                    return Err(HandlerError::new("ack failed once"));
                }
                Ok(())
            })
            .await?;
            log.seen.lock().unwrap().push(failed);
            Ok(())
        })
    }
}

async fn failure_runs(engine: &Engine, function: &str) -> Vec<Uuid> {
    common::runs_of(engine, &format!("{function}/on-failure")).await
}

/// Three runs die out of retries, one recovers: on_failure runs once for each
/// dead run (and not for the one that recovered), with that run's id, error,
/// attempts and event; its own retry does not page twice. Catches: a failure
/// handler started per failed attempt, twice for one run, or for a recovered run.
#[sqlx::test(migrations = false)]
async fn on_failure_runs_once_per_run_out_of_retries(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let log = Arc::new(FailureLog::default());
    let f = Function::new("linkedin-budget")
        .on_event("campaign/budget.requested")
        .retries(1)
        .backoff(Backoff::Fixed(Duration::ZERO))
        .on_failure(on_call(log.clone(), true))
        .handler(|ctx: Ctx, req: Value| async move {
            let ok_on = req["ok_on_attempt"].as_i64().unwrap_or(i64::MAX);
            ctx.step("push", || async {
                if i64::from(ctx.attempt()) < ok_on {
                    return Err(HandlerError::new(format!("429 on attempt {}", ctx.attempt())));
                }
                Ok(())
            })
            .await
        });
    let engine = common::engine(&opts, vec![f]).await;
    let events = vec![
        Event::new("campaign/budget.requested", &json!({"account": 1})),
        Event::new("campaign/budget.requested", &json!({"account": 2})),
        Event::new("campaign/budget.requested", &json!({"account": 3, "ok_on_attempt": 2})),
        Event::new("campaign/budget.requested", &json!({"account": 4})),
    ];
    let ids: Vec<Uuid> = engine.send_batch(events).await.unwrap().into_iter().map(|r| r.run_ids[0]).collect();
    let w = common::spawn_worker(&engine);
    for id in &ids {
        common::finished(&engine, *id).await;
    }
    let handlers = failure_runs(&engine, "linkedin-budget").await;
    assert_eq!(handlers.len(), 3, "one failure handler per dead run");
    // The first acknowledgement fails; that handler's retry uses the default
    // backoff (about 1 s): move the clock instead of waiting.
    let retrying =
        "durastep.runs WHERE function_id = 'linkedin-budget/on-failure' AND state = 'queued' AND attempt = 2";
    common::wait_until("a failure handler to wait for its retry", || async {
        common::count(&engine, retrying).await == 1
    })
    .await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(2)).await.unwrap();
    for h in &handlers {
        let run = common::finished(&engine, *h).await;
        assert_eq!(run.state, RunState::Completed, "{run:?}");
    }
    w.stop().await;

    assert_eq!(failure_runs(&engine, "linkedin-budget").await.len(), 3, "no second failure handler appeared");
    assert_eq!(log.pages.load(Ordering::SeqCst), 3, "on-call paged once per dead run");
    assert_eq!(log.acks.load(Ordering::SeqCst), 4, "three acknowledgements, one of them retried");
    assert_eq!(log.entries.load(Ordering::SeqCst), 4, "three handlers, one of them retried once");
    let seen = log.seen.lock().unwrap();
    let mut dead: Vec<Uuid> = seen.iter().map(|f| f.run_id).collect();
    dead.sort();
    let mut expected = vec![ids[0], ids[1], ids[3]];
    expected.sort();
    assert_eq!(dead, expected, "each dead run's handler saw its own run id");
    for failed in seen.iter() {
        assert_eq!(failed.function_id, "linkedin-budget");
        assert_eq!(failed.attempts, 2);
        assert_eq!(failed.error, "step push: 429 on attempt 2");
        let i = ids.iter().position(|id| *id == failed.run_id).unwrap();
        assert_eq!(failed.event["account"], json!(i + 1));
    }
}

/// A run failed by a permanent error gets its on_failure run once too.
#[sqlx::test(migrations = false)]
async fn on_failure_runs_once_for_a_permanent_failure(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let log = Arc::new(FailureLog::default());
    let f = Function::new("exact-invoice")
        .on_event("deal/placed")
        .retries(4)
        .on_failure(on_call(log.clone(), false))
        .handler(|_ctx: Ctx, _: ()| async move { Err::<(), _>(HandlerError::permanent("no such debtor")) });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("deal/placed", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    assert_eq!((run.state, run.attempt), (RunState::Failed, 1), "{run:?}");
    common::wait_until("the failure handler to finish", || async { !log.seen.lock().unwrap().is_empty() }).await;
    let handlers = failure_runs(&engine, "exact-invoice").await;
    assert_eq!(handlers.len(), 1);
    common::finished(&engine, handlers[0]).await;
    w.stop().await;
    assert_eq!(failure_runs(&engine, "exact-invoice").await.len(), 1);
    assert_eq!((log.entries.load(Ordering::SeqCst), log.pages.load(Ordering::SeqCst)), (1, 1));
    let seen = log.seen.lock().unwrap();
    assert_eq!((seen[0].run_id, seen[0].attempts, seen[0].error.as_str()), (id, 1, "no such debtor"));
}

/// A run whose worker is lost once more than its lease-loss budget allows (0
/// here) is failed by the reaper, and
/// its on_failure runs once; the lost attempt, when it comes back, cannot
/// complete the dead run. Catches: an on_failure that only the worker's failure
/// path starts (the trigger must fire whichever path fails the run).
#[sqlx::test(migrations = false)]
async fn on_failure_runs_once_when_the_reaper_fails_the_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let log = Arc::new(FailureLog::default());
    let (entered, gate) = (Gate::new(), Gate::new());
    let (e2, g2) = (entered.clone(), gate.clone());
    let f = Function::new("exact-sync")
        .on_event("go")
        .retries(0)
        .lease_losses(0)
        .on_failure(on_call(log.clone(), false))
        .handler(move |_ctx: Ctx, _: ()| {
            let (e2, g2) = (e2.clone(), g2.clone());
            async move {
                e2.open();
                g2.wait().await; // the worker "hangs" here
                Ok("finished too late")
            }
        });
    let options = WorkerOptions { max_in_flight: 2, ..common::stalling_options() };
    let engine = common::engine_with(&opts, vec![f], options).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered.reached("the handler to start").await;

    durastep::testing::advance_clock(&engine, LONG_LEASE + Duration::from_secs(1)).await.unwrap();
    assert_eq!(engine.reap_expired_leases().await.unwrap(), 1);
    let run = engine.run(id).await.unwrap();
    assert_eq!((run.state, run.attempt), (RunState::Failed, 1), "{run:?}");
    assert_eq!(
        run.last_error.as_deref(),
        Some("lease expired: the worker was lost during attempt 1 (lost leases: 1, over the budget of 0)")
    );

    common::wait_until("the failure handler to finish", || async { !log.seen.lock().unwrap().is_empty() }).await;
    gate.open(); // the lost attempt comes back and tries to complete
    let handlers = failure_runs(&engine, "exact-sync").await;
    assert_eq!(handlers.len(), 1);
    common::finished(&engine, handlers[0]).await;
    w.stop().await;

    let run = engine.run(id).await.unwrap();
    assert_eq!((run.state, run.output), (RunState::Failed, None), "the lost attempt completed a dead run");
    assert_eq!(failure_runs(&engine, "exact-sync").await.len(), 1);
    assert_eq!((log.entries.load(Ordering::SeqCst), log.pages.load(Ordering::SeqCst)), (1, 1));
    let seen = log.seen.lock().unwrap();
    assert_eq!((seen[0].run_id, seen[0].attempts), (id, 1));
    assert!(seen[0].error.contains("lease expired"), "{:?}", seen[0].error);
}
