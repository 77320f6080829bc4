//! `ctx.invoke`: a child run's typed output comes back to its parent, a
//! failing child's error comes back as a `ChildError`, a parent that executes
//! its invoke again (a crash while waiting, a retry) never starts a second
//! child, and a child that outlives the timeout is cancelled. A parent that
//! executes its invoke after its child finished (a replay, a wake-up racing the
//! child's completion) gets the child's outcome.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use common::Gate;
use durastep::{Backoff, ChildError, Ctx, Engine, Event, Function, HandlerError, ReplayFrom, RunState};
use serde_json::{Value, json};
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
            let doubled: Result<u64, ChildError> =
                ctx.invoke("double-it", durastep::Invoke::function("double").input(&n).timeout(MINUTE)).await?;
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
        let r: Result<(), ChildError> =
            ctx.invoke("charge", durastep::Invoke::function("charge").input(&()).timeout(MINUTE)).await?;
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
            let got: Result<u32, ChildError> =
                ctx.invoke("child", durastep::Invoke::function("slow-child").input(&n).timeout(MINUTE * 60)).await?;
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
        let r: Result<(), ChildError> =
            ctx.invoke("child", durastep::Invoke::function("sleepy").input(&()).timeout(MINUTE)).await?;
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

/// What a parent in these tests returns: the child's output, or why it has none.
fn outcome(got: Result<Value, ChildError>) -> Value {
    match got {
        Ok(v) => json!({"ok": v}),
        Err(e) => json!({"err": e.to_string()}),
    }
}

/// A parent waiting on its child is cancelled; the child then completes (its
/// outcome is not delivered: the parent is finished); the parent is replayed.
/// Its invoke finds the finished child and returns its output at once.
async fn replayed_parent_gets_the_finished_childs_output(opts: PgConnectOptions, from: ReplayFrom) {
    common::init_logs();
    let (entered, release) = (Gate::new(), Gate::new());
    let (e, r) = (entered.clone(), release.clone());
    let child = Function::new("slow-child").handler(move |_ctx: Ctx, n: u32| {
        let (e, r) = (e.clone(), r.clone());
        async move {
            e.open();
            r.wait().await;
            Ok(n + 1)
        }
    });
    let parent = Function::new("parent").on_event("go").handler(|ctx: Ctx, n: u32| async move {
        ctx.step("before", || async { Ok(()) }).await?;
        Ok(outcome(ctx.invoke("child", durastep::Invoke::function("slow-child").input(&n).timeout(MINUTE * 60)).await?))
    });
    let engine = common::engine(&opts, vec![parent, child]).await;
    let id = engine.send(Event::new("go", &1u32)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered.reached("the child to start").await;
    common::wait_for_run_where(&engine, id, "the parent to wait", |r| r.state == RunState::Waiting).await;
    engine.cancel(id, "operator").await.unwrap();
    release.open();
    let child = children_of(&engine, id).await[0];
    assert_eq!(common::finished(&engine, child).await.state, RunState::Completed);
    assert_eq!(engine.run(id).await.unwrap().state, RunState::Cancelled);

    engine.replay(id, from).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!((run.state, run.output.clone()), (RunState::Completed, Some(json!({"ok": 2}))), "{run:?}");
    assert_eq!(children_of(&engine, id).await, [child], "the replay started another child");
}

/// Catches: a replayed parent (from the failed step) that waited for an
/// outcome its finished child never delivers again, until the invoke's
/// timeout, and then reported "child run did not finish in time (it was
/// cancelled)" for a child that completed.
#[sqlx::test(migrations = false)]
async fn a_parent_replayed_from_the_failed_step_gets_its_finished_childs_output(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    replayed_parent_gets_the_finished_childs_output(opts, ReplayFrom::FailedStep).await;
}

/// Catches: as above, for a replay from the start (step results deleted).
#[sqlx::test(migrations = false)]
async fn a_parent_replayed_from_the_start_gets_its_finished_childs_output(_p: PgPoolOptions, opts: PgConnectOptions) {
    replayed_parent_gets_the_finished_childs_output(opts, ReplayFrom::Start).await;
}

/// Whether a statement of an invoke in this test's database waits on a lock
/// now (not a heartbeat or a claim, which may wait on the parent's row).
async fn an_invoke_waits_on_a_lock(engine: &Engine) -> bool {
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity
          WHERE datname = current_database() AND wait_event_type = 'Lock'
            AND query NOT LIKE '%lease_expires_at%'",
    )
    .fetch_one(engine.pool())
    .await
    .unwrap();
    waiting > 0
}

/// The parent executes its invoke again (at its timeout, or after a wake-up
/// before it) while the child's completion is being committed by another
/// transaction: that transaction already stored the parent's result but has
/// not committed when the parent's invoke looks. The parent must end up with
/// the child's output, in its first attempt, and at once.
async fn invoke_racing_the_childs_completion(opts: PgConnectOptions, at_timeout: bool) {
    common::init_logs();
    let executions = Arc::new(AtomicU32::new(0));
    let (entered, gate) = (Gate::new(), Gate::new());
    let (x, e, g) = (executions.clone(), entered.clone(), gate.clone());
    let parent = Function::new("parent").on_event("go").retries(2).backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, _: ()| {
            let (x, e, g) = (x.clone(), e.clone(), g.clone());
            async move {
                if x.fetch_add(1, Ordering::SeqCst) == 1 {
                    e.open();
                    g.wait().await;
                }
                Ok(outcome(ctx.invoke("child", durastep::Invoke::function("unclaimed-child").timeout(MINUTE)).await?))
            }
        },
    );
    // The child's function is registered by an engine that runs no worker:
    // the test finishes the child itself, as its worker's completion would.
    let child = Function::new("unclaimed-child").handler(|_ctx: Ctx, _: ()| async move { Ok(()) });
    let _registers_child = common::engine(&opts, vec![child]).await;
    let engine = common::engine(&opts, vec![parent]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, id, "the parent to wait", |r| r.state == RunState::Waiting).await;
    let child = children_of(&engine, id).await[0];

    // The parent is due again: by its timeout, or woken early.
    if at_timeout {
        durastep::testing::advance_clock(&engine, MINUTE + Duration::from_secs(1)).await.unwrap();
    } else {
        sqlx::query("UPDATE durastep.runs SET state = 'queued', run_at = durastep.now() WHERE id = $1")
            .bind(id)
            .execute(engine.pool())
            .await
            .unwrap();
    }
    entered.reached("the parent to execute again").await;

    // The child completes in a transaction that stays open for now.
    let mut completion = engine.pool().begin().await.unwrap();
    sqlx::query(
        "UPDATE durastep.runs SET state = 'completed', output = '\"done\"', finished_at = durastep.now()
          WHERE id = $1",
    )
    .bind(child)
    .execute(&mut *completion)
    .await
    .unwrap();
    gate.open();
    // The parent's invoke either waits for the completion's locks, or (without
    // that) goes on without it; either way, commit the completion then.
    common::wait_until("the parent's invoke to wait for the completion or to suspend", || async {
        an_invoke_waits_on_a_lock(&engine).await || engine.run(id).await.unwrap().state == RunState::Waiting
    })
    .await;
    completion.commit().await.unwrap();

    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!((run.state, run.output.clone()), (RunState::Completed, Some(json!({"ok": "done"}))), "{run:?}");
    assert_eq!((run.attempt, run.last_error.as_deref()), (1, None), "{run:?}");
    assert_eq!(executions.load(Ordering::SeqCst), 2, "{run:?}");
}

/// Catches: the timeout path reading the stored result with the snapshot of
/// the statement that just waited for the child's completion (it saw neither
/// its own timeout record nor the child's outcome, and the attempt failed with
/// "could not invoke").
#[sqlx::test(migrations = false)]
async fn an_invoke_timeout_racing_the_childs_completion_returns_the_childs_output(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    invoke_racing_the_childs_completion(opts, true).await;
}

/// Catches: a lost wake-up: the child's completion stored the outcome while
/// the parent was running (so it woke nobody), and the parent's invoke, which
/// had not seen it, suspended the parent until the invoke's timeout.
#[sqlx::test(migrations = false)]
async fn a_child_completing_while_its_parent_re_executes_the_invoke_wakes_the_parent(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    invoke_racing_the_childs_completion(opts, false).await;
}
