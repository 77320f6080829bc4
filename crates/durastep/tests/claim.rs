//! The fast claim's guards (store/sql/claim_fast.sql, docs/architecture.md
//! "The fast claim"): a worker takes the runs of its functions without flow
//! rules or timeouts with the fast claim, and that claim must leave alone the
//! runs the full claim would have treated differently.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Ctx, Event, Function, RunState};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn counted(bodies: Arc<AtomicU32>) -> Function {
    Function::new("plain").on_event("go").handler(move |ctx: Ctx, _: ()| {
        let bodies = bodies.clone();
        async move {
            ctx.step("once", || async move {
                bodies.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await
        }
    })
}

/// Catches: a fast claim that starts the runs of a function for which another
/// build registered a flow rule (a mixed deploy): only a worker with that
/// build's rules, which uses the full claim, may take them.
#[sqlx::test(migrations = false)]
async fn fast_claim_leaves_runs_of_a_function_with_flow_rules_elsewhere(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let bodies = Arc::new(AtomicU32::new(0));
    let engine = common::engine(&opts, vec![counted(bodies.clone())]).await;
    // Another build's registration: a concurrency rule on the same function id.
    for sql in [
        "INSERT INTO durastep.flow_rules (name, kind, capacity) VALUES ('other-build', 'concurrency', 1)",
        "INSERT INTO durastep.function_flow (function_id, rule) VALUES ('plain', 'other-build')",
    ] {
        sqlx::query(sql).execute(engine.pool()).await.unwrap();
    }
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::stays(&engine, id, Duration::from_millis(1500), "queued", |r| r.state == RunState::Queued).await;
    assert_eq!(bodies.load(Ordering::SeqCst), 0, "no body ran");
    // Once no build has the rule, this worker's fast claim takes it.
    sqlx::query("DELETE FROM durastep.function_flow WHERE function_id = 'plain'").execute(engine.pool()).await.unwrap();
    let run = common::finished(&engine, id).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(bodies.load(Ordering::SeqCst), 1);
    w.stop().await;
}

/// Catches: a fast claim that starts a run past its start deadline (its
/// function had a start timeout in another build): maintenance cancels it with
/// the reason the full claim would have written, and no body runs.
#[sqlx::test(migrations = false)]
async fn fast_claim_leaves_a_run_past_its_start_deadline_to_maintenance(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let bodies = Arc::new(AtomicU32::new(0));
    let engine = common::engine(&opts, vec![counted(bodies.clone())]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    sqlx::query("UPDATE durastep.runs SET start_by = durastep.now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(engine.pool())
        .await
        .unwrap();
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Cancelled, "{run:?}");
    let reason = run.cancel_reason.unwrap_or_default();
    assert!(reason.starts_with("start timeout"), "{reason}");
    assert_eq!(bodies.load(Ordering::SeqCst), 0, "no body ran");
}
