//! Function versions: a run keeps the version it started under, a worker
//! claims only runs of the versions it registers, new runs start under the
//! newest registered version, and an old version's handler registered beside
//! the new one drains the old runs.
mod common;

use std::time::Duration;

use durastep::{Ctx, Event, Function, RunState};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const NAP: Duration = Duration::from_secs(86_400);

/// `billing` at `version`: step `steps[0]`, a day's sleep, step `steps[1]`.
fn billing(version: u32, steps: [&'static str; 2]) -> Function {
    Function::new("billing").on_event("invoice/due").version(version).handler(move |ctx: Ctx, _: Value| async move {
        let a: String = ctx.step(steps[0], || async move { Ok(steps[0].to_owned()) }).await?;
        ctx.sleep("settle", NAP).await?;
        let b: String = ctx.step(steps[1], || async move { Ok(steps[1].to_owned()) }).await?;
        Ok(format!("v{version}:{a},{b}"))
    })
}

const V1: [&str; 2] = ["charge", "receipt"];
const V2: [&str; 2] = ["reserve", "capture"];

/// A v1 run asleep when v2 ships (v2 would diverge on it at position 0). A
/// v2-only worker runs v2's runs and never claims the v1 run, and the deploy
/// check names it as a run of a version the build has no handler for; a
/// build registering v2 and v1 side by side (v1 first: the newest wins
/// whatever the order) passes the check, drains the v1 run on v1's handler and
/// starts new runs under v2. Catches: a claim that ignores the run's version
/// (the v1 run would be claimed by the v2 worker and park `diverged`), new
/// runs started under an old version, and a check blind to unhandled versions.
#[sqlx::test(migrations = false)]
async fn old_and_new_versions_run_side_by_side(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let v1 = common::engine(&opts, vec![billing(1, V1)]).await;
    let w1 = common::spawn_worker(&v1);
    let old = v1.send(Event::new("invoice/due", &json!({"id": 1}))).await.unwrap().run_ids[0];
    let asleep = common::wait_for_run_where(&v1, old, "v1 run asleep", |r| r.state == RunState::Sleeping).await;
    assert_eq!(asleep.version, 1);
    w1.stop().await;

    // v2 alone.
    let v2 = common::engine(&opts, vec![billing(2, V2)]).await;
    let new = v2.send(Event::new("invoice/due", &json!({"id": 2}))).await.unwrap().run_ids[0];
    assert_eq!(v2.run(new).await.unwrap().version, 2, "new runs start under the newest version");
    let report = v2.check_deploy().await.unwrap();
    assert!(report.diverging.is_empty() && report.problems.is_empty(), "{report}");
    assert_eq!(report.unhandled.len(), 1, "{report}");
    let u = &report.unhandled[0];
    assert_eq!((u.function_id.as_str(), u.version, u.runs, u.example), ("billing", 1, 1, old), "{report}");
    assert!(!report.is_safe());
    assert!(report.to_string().contains("billing version 1: 1 runs"), "{report}");

    let (epoch, _) = common::lease_of(&v2, old).await;
    let w2 = common::spawn_worker(&v2);
    common::wait_for_run_where(&v2, new, "v2 run asleep", |r| r.state == RunState::Sleeping).await;
    // Both wake; the old one is due first, so a claim that took it would take it first.
    durastep::testing::advance_clock(&v2, NAP + Duration::from_secs(1)).await.unwrap();
    let done = common::finished(&v2, new).await;
    assert_eq!(done.output, Some(json!("v2:reserve,capture")), "{done:?}");
    let untouched = v2.run(old).await.unwrap();
    assert_eq!(untouched.state, RunState::Sleeping, "the v2-only worker claimed a v1 run: {untouched:?}");
    assert_eq!(common::lease_of(&v2, old).await.0, epoch, "the v1 run was claimed");
    w2.stop().await;

    // v2 with v1's handler beside it, v1 registered first.
    let both = common::engine(&opts, vec![billing(1, V1), billing(2, V2)]).await;
    let report = both.check_deploy().await.unwrap();
    assert!(report.is_safe() && report.runs_checked == 1, "{report}");
    let w = common::spawn_worker(&both);
    let drained = common::finished(&both, old).await;
    assert_eq!((drained.output, drained.version), (Some(json!("v1:charge,receipt")), 1));
    let later = both.send(Event::new("invoice/due", &json!({"id": 3}))).await.unwrap().run_ids[0];
    assert_eq!(both.run(later).await.unwrap().version, 2, "the newest registered version, not the last listed");
    common::wait_for_run_where(&both, later, "the new run asleep", |r| r.state == RunState::Sleeping).await;
    durastep::testing::advance_clock(&both, NAP + Duration::from_secs(1)).await.unwrap();
    assert_eq!(common::finished(&both, later).await.output, Some(json!("v2:reserve,capture")));
    w.stop().await;
}

/// Two definitions with the same id and version are refused at build; the
/// same id at two versions is not. An unversioned function is version 0.
#[sqlx::test(migrations = false)]
async fn same_id_and_version_twice_is_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let twice = vec![billing(2, V1), billing(2, V2)];
    let err = common::try_engine(&opts, twice, common::fast_options(), Default::default()).await.unwrap_err();
    assert!(matches!(&err, durastep::Error::InvalidFunction(m) if m.contains("version 2")), "{err}");
    let plain = Function::new("plain").on_event("p").handler(|_ctx: Ctx, _: Value| async { Ok(()) });
    assert_eq!(plain.version(), 0);
    let engine = common::engine(&opts, vec![plain, billing(1, V1), billing(3, V2)]).await;
    let id = engine.send(Event::new("p", &json!({}))).await.unwrap().run_ids[0];
    assert_eq!(engine.run(id).await.unwrap().version, 0);
}

/// A child run started by `invoke` and a failure handler's run start under
/// their function's newest version too (they are created in SQL, not by
/// `send`). Catches: a run-creating statement that leaves the version at its
/// default 0, which a worker registering only version 5 would never claim.
#[sqlx::test(migrations = false)]
async fn invoked_and_failure_handler_runs_start_under_the_newest_version(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let child = Function::new("child")
        .version(5)
        .handler(|ctx: Ctx, n: u32| async move { ctx.step("double", || async move { Ok(n * 2) }).await });
    let parent = Function::new("parent").on_event("go").version(5).handler(|ctx: Ctx, _: Value| async move {
        let r: Result<u32, _> = ctx.invoke("child", durastep::Invoke::function("child").input(&21)).await?;
        Ok(r.map_err(|e| format!("{e:?}")).unwrap_or(0))
    });
    let failing = Function::new("failing")
        .on_event("fail")
        .version(5)
        .retries(0)
        .on_failure(|_ctx: Ctx, _f: durastep::FailedRun<Value>| async move { Ok(()) })
        .handler(|_ctx: Ctx, _: Value| async move { Err::<(), _>(durastep::HandlerError::permanent("no")) });
    let engine = common::engine(&opts, vec![child, parent, failing]).await;
    let w = common::spawn_worker(&engine);
    let p = engine.send(Event::new("go", &json!({}))).await.unwrap().run_ids[0];
    let done = common::finished(&engine, p).await;
    assert_eq!(done.state, RunState::Completed, "{done:?}");
    let child = common::runs_of(&engine, "child").await;
    assert_eq!(child.len(), 1);
    assert_eq!(engine.run(child[0]).await.unwrap().version, 5);
    let f = engine.send(Event::new("fail", &json!({}))).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, f).await.state, RunState::Failed);
    common::wait_until("the failure handler's run", || async {
        !common::runs_of(&engine, "failing/on-failure").await.is_empty()
    })
    .await;
    let handler = common::runs_of(&engine, "failing/on-failure").await[0];
    let handled = common::finished(&engine, handler).await;
    assert_eq!((handled.state, handled.version), (RunState::Completed, 5), "{handled:?}");
    w.stop().await;
}
