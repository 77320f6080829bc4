//! `ctx.invoke`: a child run's typed output comes back to its parent, a
//! failing child's error comes back as a `ChildError`, a parent that executes
//! its invoke again (a crash while waiting, a retry) never starts a second
//! child, and a child that outlives the timeout is cancelled.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::Gate;
use durastep::{Backoff, ChildError, Ctx, Engine, Event, Function, HandlerError, RunState};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const MINUTE: Duration = Duration::from_secs(60);

async fn children_of(engine: &Engine, parent: Uuid) -> Vec<Uuid> {
    sqlx::query_scalar("SELECT id FROM durastep.runs WHERE parent_run_id = $1 ORDER BY id")
        .bind(parent)
        .fetch_all(engine.pool())
        .await
        .unwrap()
}

fn doubler() -> Function {
    Function::new("double").handler(|_ctx: Ctx, n: u64| async move { Ok(n * 2) })
}

/// The parent invokes `double` with 21 and gets 42 (typed), after waiting in
/// state `waiting`; the child is a run of `double` with the parent recorded.
/// A retry of the parent after the invoke replays the stored output and starts
/// no second child. Catches: an output lost on the way, a child per attempt.
#[sqlx::test(migrations = false)]
async fn child_output_is_returned_to_the_parent(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let parent = Function::new("parent").on_event("go").retries(2).backoff(Backoff::Fixed(Duration::ZERO)).handler(
        |ctx: Ctx, n: u64| async move {
            let doubled: Result<u64, ChildError> = ctx.invoke("double-it", "double", &n, MINUTE).await?;
            let doubled = doubled.map_err(|e| HandlerError::permanent(e.to_string()))?;
            let attempt = ctx.attempt();
            ctx.step("flaky", || async move { if attempt == 1 { Err(HandlerError::new("once")) } else { Ok(()) } })
                .await?;
            Ok(doubled)
        },
    );
    let engine = common::engine(&opts, vec![parent, doubler()]).await;
    let id = engine.send(Event::new("go", &21u64)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!((run.state, run.output.clone(), run.attempt), (RunState::Completed, Some(json!(42)), 2), "{run:?}");
    let children = children_of(&engine, id).await;
    assert_eq!(children.len(), 1, "a retried parent started another child");
    let child = engine.run(children[0]).await.unwrap();
    assert_eq!(
        (child.function_id.as_str(), child.state, child.output),
        ("double", RunState::Completed, Some(json!(42)))
    );
}

/// A child that fails permanently: the parent gets `ChildError::Failed` with
/// the child's error and goes on (it is not failed itself).
#[sqlx::test(migrations = false)]
async fn a_failing_childs_error_is_returned(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let child = Function::new("charge")
        .handler(|_ctx: Ctx, _: ()| async move { Err::<(), _>(HandlerError::permanent("card declined")) });
    let parent = Function::new("parent").on_event("go").handler(|ctx: Ctx, _: ()| async move {
        let r: Result<(), ChildError> = ctx.invoke("charge", "charge", &(), MINUTE).await?;
        Ok(match r {
            Ok(()) => "charged".to_owned(),
            Err(ChildError::Failed { error, .. }) => format!("failed: {error}"),
            Err(e) => format!("other: {e}"),
        })
    });
    let engine = common::engine(&opts, vec![parent, child]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!("failed: card declined")));
}

/// A parent crash while it waits: the child is held at a gate; the parent is
/// put back to `queued` as a reaped crashed attempt would be, and executes its
/// invoke again while the child is still running. It finds its child and
/// waits again; when the child finishes, the parent completes with its output.
/// Exactly one child exists. Catches: a child per execution of the invoke.
#[sqlx::test(migrations = false)]
async fn a_parent_crash_while_waiting_does_not_start_a_second_child(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (entered, release) = (Gate::new(), Gate::new());
    let executions = Arc::new(AtomicU32::new(0));
    let (e, r, x) = (entered.clone(), release.clone(), executions.clone());
    let child = Function::new("slow-child").handler(move |_ctx: Ctx, n: u32| {
        let (e, r) = (e.clone(), r.clone());
        async move {
            e.open();
            r.wait().await;
            Ok(n + 1)
        }
    });
    let parent = Function::new("parent").on_event("go").handler(move |ctx: Ctx, n: u32| {
        let x = x.clone();
        async move {
            x.fetch_add(1, Ordering::SeqCst);
            let got: Result<u32, ChildError> = ctx.invoke("child", "slow-child", &n, MINUTE * 60).await?;
            Ok(got.ok())
        }
    });
    let engine = common::engine(&opts, vec![parent, child]).await;
    let id = engine.send(Event::new("go", &1u32)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered.reached("the child to start").await;
    common::wait_for_run_where(&engine, id, "the parent to wait", |r| r.state == RunState::Waiting).await;
    // The crash: the parent is due again while its child still runs.
    sqlx::query("UPDATE durastep.runs SET state = 'queued', run_at = durastep.now() WHERE id = $1")
        .bind(id)
        .execute(engine.pool())
        .await
        .unwrap();
    common::wait_until("the parent to execute again and wait", || async {
        executions.load(Ordering::SeqCst) >= 2 && engine.run(id).await.unwrap().state == RunState::Waiting
    })
    .await;
    assert_eq!(children_of(&engine, id).await.len(), 1, "the re-executed invoke started a second child");
    release.open();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.output, Some(json!(2)), "{run:?}");
    assert_eq!(children_of(&engine, id).await.len(), 1);
}

/// A child that does not finish within the timeout (database clock): the
/// parent gets `ChildError::TimedOut` and the child is cancelled with a reason.
#[sqlx::test(migrations = false)]
async fn a_child_past_the_timeout_is_cancelled(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let child = Function::new("sleepy").handler(|ctx: Ctx, _: ()| async move {
        ctx.sleep("long", Duration::from_secs(86_400)).await?;
        Ok(())
    });
    let parent = Function::new("parent").on_event("go").handler(|ctx: Ctx, _: ()| async move {
        let r: Result<(), ChildError> = ctx.invoke("child", "sleepy", &(), MINUTE).await?;
        Ok(r == Err(ChildError::TimedOut))
    });
    let engine = common::engine(&opts, vec![parent, child]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, id, "waiting", |r| r.state == RunState::Waiting).await;
    let child = children_of(&engine, id).await[0];
    common::wait_for_run_where(&engine, child, "the child to sleep", |r| r.state == RunState::Sleeping).await;
    durastep::testing::advance_clock(&engine, MINUTE + Duration::from_secs(1)).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.output, Some(json!(true)), "{run:?}");
    let child = engine.run(child).await.unwrap();
    assert_eq!(child.state, RunState::Cancelled);
    assert_eq!(child.cancel_reason.as_deref(), Some("the parent stopped waiting (invoke timeout)"));
}
