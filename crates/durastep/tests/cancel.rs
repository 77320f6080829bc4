//! Cancellation: `Engine::cancel` for queued, sleeping and running runs (a
//! running run stops at its next step boundary and stores nothing more), typed
//! errors, and `cancel_on`, which cancels matching runs in the sending
//! statement's own transaction.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::Gate;
use durastep::{Ctx, Error, Event, Function, RunState};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

async fn state_in_db(engine: &durastep::Engine, id: uuid::Uuid) -> (String, Option<String>, bool) {
    sqlx::query_as("SELECT state, cancel_reason, finished_at IS NOT NULL FROM durastep.runs WHERE id = $1")
        .bind(id)
        .fetch_one(engine.pool())
        .await
        .unwrap()
}

/// A queued run (due in an hour) and a sleeping run are cancelled at once,
/// keep their reason, and never execute again even when they become due.
/// Catches: a cancel that leaves the run claimable, or a claim that takes
/// cancelled runs.
#[sqlx::test(migrations = false)]
async fn queued_and_sleeping_runs_are_cancelled_and_never_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let bodies = Arc::new(AtomicU32::new(0));
    let b = bodies.clone();
    let f = Function::new("f").on_event("go").handler(move |ctx: Ctx, sleep_first: bool| {
        let b = b.clone();
        async move {
            if sleep_first {
                ctx.sleep("nap", Duration::from_secs(600)).await?;
            }
            ctx.step("work", || async {
                b.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await
        }
    });
    let engine = common::engine(&opts, vec![f]).await;
    let now = durastep::testing::db_now(&engine).await.unwrap();
    let queued =
        engine.send(Event::new("go", &false).start_at(now + chrono::Duration::hours(1))).await.unwrap().run_ids[0];
    let sleeper = engine.send(Event::new("go", &true)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, sleeper, "the run to sleep", |r| r.state == RunState::Sleeping).await;

    engine.cancel(queued, "not needed any more").await.unwrap();
    engine.cancel(sleeper, "campaign ended").await.unwrap();
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 3600)).await.unwrap();
    common::stays(&engine, sleeper, Duration::from_millis(400), "cancelled", |r| r.state == RunState::Cancelled).await;
    w.stop().await;

    assert_eq!(bodies.load(Ordering::SeqCst), 0, "a cancelled run executed a step");
    assert_eq!(state_in_db(&engine, queued).await, ("cancelled".into(), Some("not needed any more".into()), true));
    assert_eq!(state_in_db(&engine, sleeper).await, ("cancelled".into(), Some("campaign ended".into()), true));
    assert_eq!(common::step_rows(&engine, queued).await.len(), 0);
    let run = engine.run(sleeper).await.unwrap();
    assert_eq!(run.cancel_reason.as_deref(), Some("campaign ended"));
    assert_eq!(run.last_error, None, "cancelling is not a failure");
}

/// A running run whose step body is in flight when it is cancelled: the body
/// runs to its end but its result is not stored, the next step never runs,
/// the handler is dropped, and the run stays cancelled (not retried, not
/// completed). Catches: cancellation that waits for the run to finish, a
/// worker that overwrites `cancelled` with `completed` or `queued`.
#[sqlx::test(migrations = false)]
async fn a_running_run_stops_at_its_next_step_boundary(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (entered, release, dropped) = (Gate::new(), Gate::new(), Gate::new());
    let after = Arc::new(AtomicU32::new(0));
    let (e, r, d, a) = (entered.clone(), release.clone(), dropped.clone(), after.clone());
    let f = Function::new("f").on_event("go").handler(move |ctx: Ctx, _: ()| {
        let (e, r, d, a) = (e.clone(), r.clone(), d.clone(), a.clone());
        async move {
            let _guard = common::OpenOnDrop(d);
            ctx.step("first", || async { Ok(1) }).await?;
            ctx.step("slow", || async move {
                e.open();
                r.wait().await;
                Ok(2)
            })
            .await?;
            ctx.step("after", || async move {
                a.fetch_add(1, Ordering::SeqCst);
                Ok(3)
            })
            .await?;
            Ok("finished")
        }
    });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered.reached("the slow step").await;
    engine.cancel(id, "operator stop").await.unwrap();
    release.open();
    dropped.reached("the handler to be dropped").await;
    common::stays(&engine, id, Duration::from_millis(300), "cancelled", |r| r.state == RunState::Cancelled).await;
    w.stop().await;

    let keys: Vec<String> = common::step_rows(&engine, id).await.into_iter().map(|s| s.key).collect();
    assert_eq!(keys, vec!["first".to_owned()], "a step result was stored after the cancel");
    assert_eq!(after.load(Ordering::SeqCst), 0, "a step after the cancel ran");
    let run = engine.run(id).await.unwrap();
    assert_eq!((run.state, run.attempt, run.output.clone()), (RunState::Cancelled, 1, None), "{run:?}");
    assert_eq!(run.cancel_reason.as_deref(), Some("operator stop"));
}

/// Typed errors: an unknown id is `UnknownRun`; a completed run is
/// `RunFinished` and stays completed with its output; a second cancel of a
/// cancelled run is `RunFinished` and keeps the first reason.
#[sqlx::test(migrations = false)]
async fn cancel_errors_are_typed_and_change_nothing(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let f = Function::new("f").on_event("go").handler(|_ctx: Ctx, n: u32| async move { Ok(n) });
    let engine = common::engine(&opts, vec![f]).await;
    let unknown = uuid::Uuid::new_v4();
    assert!(matches!(engine.cancel(unknown, "x").await, Err(Error::UnknownRun(id)) if id == unknown));

    let done = engine.send(Event::new("go", &7)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    assert_eq!(common::finished(&engine, done).await.state, RunState::Completed);
    w.stop().await;
    let err = engine.cancel(done, "too late").await.unwrap_err();
    assert!(matches!(err, Error::RunFinished { state: RunState::Completed, .. }), "{err:?}");
    let run = engine.run(done).await.unwrap();
    assert_eq!((run.state, run.output, run.cancel_reason), (RunState::Completed, Some(json!(7)), None));

    let now = durastep::testing::db_now(&engine).await.unwrap();
    let later = engine.send(Event::new("go", &1).start_at(now + chrono::Duration::hours(1))).await.unwrap().run_ids[0];
    engine.cancel(later, "first reason").await.unwrap();
    let err = engine.cancel(later, "second reason").await.unwrap_err();
    assert!(matches!(err, Error::RunFinished { state: RunState::Cancelled, .. }), "{err:?}");
    assert_eq!(engine.run(later).await.unwrap().cancel_reason.as_deref(), Some("first reason"));
}

/// `cancel_on("campaign/paused", ("/campaign_id", "/campaign_id"))`: pausing
/// campaign 1 cancels the sleeping and the queued runs of campaign 1 and only
/// those (campaign 2's run and a run without the field go on); the cancel
/// commits with the sender's transaction (a rolled-back `send_in` cancels
/// nothing). Catches: matching on the wrong side, cancelling every run of the
/// function, a cancel outside the send's transaction.
#[sqlx::test(migrations = false)]
async fn cancel_on_cancels_matching_runs_in_the_senders_transaction(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let pushes = Arc::new(AtomicU32::new(0));
    let p = pushes.clone();
    let f = Function::new("budget")
        .on_event("campaign/budget.requested")
        .cancel_on(durastep::CancelOn::event("campaign/paused").key("/campaign_id"))
        .handler(move |ctx: Ctx, req: Value| {
            let p = p.clone();
            async move {
                ctx.sleep("settle", Duration::from_secs(600)).await?;
                ctx.step("push", || async {
                    p.fetch_add(1, Ordering::SeqCst);
                    Ok(())
                })
                .await?;
                Ok(req)
            }
        });
    let engine = common::engine(&opts, vec![f]).await;
    let send = |data: Value| engine.send(Event::new("campaign/budget.requested", &data));
    let c1_sleeping = send(json!({"campaign_id": 1})).await.unwrap().run_ids[0];
    let c2_sleeping = send(json!({"campaign_id": 2})).await.unwrap().run_ids[0];
    let no_field = send(json!({"other": 1})).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    for id in [c1_sleeping, c2_sleeping, no_field] {
        common::wait_for_run_where(&engine, id, "sleeping", |r| r.state == RunState::Sleeping).await;
    }
    w.stop().await;
    let c1_queued = send(json!({"campaign_id": 1})).await.unwrap().run_ids[0];

    // Rolled back: nothing is cancelled.
    let mut tx = engine.pool().begin().await.unwrap();
    engine.send_in(&mut tx, Event::new("campaign/paused", &json!({"campaign_id": 1}))).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(engine.run(c1_queued).await.unwrap().state, RunState::Queued);

    // Committed: campaign 1's runs are cancelled in that transaction.
    let mut tx = engine.pool().begin().await.unwrap();
    engine.send_in(&mut tx, Event::new("campaign/paused", &json!({"campaign_id": 1}))).await.unwrap();
    assert_eq!(state_in_db(&engine, c1_queued).await.0, "queued", "visible before the sender committed");
    tx.commit().await.unwrap();
    for id in [c1_sleeping, c1_queued] {
        let (state, reason, finished) = state_in_db(&engine, id).await;
        assert_eq!((state.as_str(), finished), ("cancelled", true));
        assert_eq!(reason.as_deref(), Some("cancelled by event campaign/paused"));
    }

    let w = common::spawn_worker(&engine);
    durastep::testing::advance_clock(&engine, Duration::from_secs(601)).await.unwrap();
    assert_eq!(common::finished(&engine, c2_sleeping).await.state, RunState::Completed);
    assert_eq!(common::finished(&engine, no_field).await.state, RunState::Completed);
    w.stop().await;
    assert_eq!(pushes.load(Ordering::SeqCst), 2, "only campaign 2 and the run without the field pushed");
    for id in [c1_sleeping, c1_queued] {
        assert_eq!(engine.run(id).await.unwrap().state, RunState::Cancelled);
    }
}

/// A cancel_on pointer that is not a JSON pointer is refused at build.
#[sqlx::test(migrations = false)]
async fn invalid_cancel_on_pointer_is_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("f")
        .cancel_on(durastep::CancelOn::event("x").event_key("campaign_id").run_key("/campaign_id"))
        .handler(|_c, _x: ()| async { Ok(()) });
    let err = common::try_engine(&opts, vec![f], common::fast_options(), Default::default()).await.unwrap_err();
    assert!(matches!(err, Error::InvalidFunction(ref m) if m.contains("JSON pointer")), "{err:?}");
}

/// A cancel_on rule without a key is refused at build, naming what to add.
/// Catches: a keyless rule silently comparing whole event payloads.
#[sqlx::test(migrations = false)]
async fn cancel_on_without_a_key_is_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("f").cancel_on(durastep::CancelOn::event("x")).handler(|_c, _x: ()| async { Ok(()) });
    let err = common::try_engine(&opts, vec![f], common::fast_options(), Default::default()).await.unwrap_err();
    assert!(matches!(err, Error::InvalidFunction(ref m) if m.contains("needs a key")), "{err:?}");
}
