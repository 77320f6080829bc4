//! `step_tx`: the user's writes and the step's checkpoint commit together or not
//! at all (exactly-once database writes), including when the attempt is fenced.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Backoff, Ctx, Engine, Event, Function, HandlerError, RunState};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::{Handoff, release_stale, step_row, take_over};

async fn create_ledger(opts: &PgConnectOptions) {
    common::exec(opts, "CREATE TABLE ledger (id bigserial PRIMARY KEY, note text NOT NULL)").await;
}

async fn ledger(engine: &Engine) -> Vec<String> {
    sqlx::query_scalar("SELECT note FROM ledger ORDER BY id").fetch_all(engine.pool()).await.unwrap()
}

/// The step_tx commits once; a later step fails twice, and the retries return
/// the stored result without running the closure again. Catches: a step_tx
/// whose checkpoint is not found on retry (a doubled ledger row).
#[sqlx::test(migrations = false)]
async fn step_tx_writes_once_when_a_later_step_is_retried(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (tx_runs, flaky) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (t2, f2) = (tx_runs.clone(), flaky.clone());
    let f = Function::new("log-then-flaky").on_event("go").backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, amount: i64| {
            let (t2, f2) = (t2.clone(), f2.clone());
            async move {
                let id: i64 = ctx
                    .step_tx("log", async move |conn| {
                        t2.fetch_add(1, Ordering::SeqCst);
                        let id = sqlx::query_scalar("INSERT INTO ledger (note) VALUES ($1) RETURNING id")
                            .bind(format!("pushed {amount}"))
                            .fetch_one(&mut *conn)
                            .await?;
                        Ok(id)
                    })
                    .await?;
                ctx.step("notify", || async {
                    if f2.fetch_add(1, Ordering::SeqCst) < 2 {
                        return Err(HandlerError::new("notify is down"));
                    }
                    Ok(())
                })
                .await?;
                Ok(id)
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    create_ledger(&opts).await;
    let id = engine.send(Event::new("go", &500)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;

    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 3);
    assert_eq!(tx_runs.load(Ordering::SeqCst), 1);
    assert_eq!(ledger(&engine).await, ["pushed 500"]);
    let row_id: i64 = sqlx::query_scalar("SELECT id FROM ledger").fetch_one(engine.pool()).await.unwrap();
    assert_eq!(run.output, Some(json!(row_id)));
    assert_eq!(step_row(&engine, id, "log").await.unwrap().output, json!(row_id));
}

/// The closure writes, then fails: its writes roll back with it. A retryable
/// failure retries the closure (one row in the end, from attempt 2); a permanent
/// one fails the run with no row at all. Catches: user writes committed outside
/// the step's transaction, or a transaction committed despite the error.
#[sqlx::test(migrations = false)]
async fn step_tx_error_rolls_back_its_writes(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let make = |id: &str, permanent: bool| {
        Function::new(id).on_event(format!("{id}/go")).backoff(Backoff::Fixed(Duration::ZERO)).handler(
            move |ctx: Ctx, _: ()| async move {
                let attempt = ctx.attempt();
                let function = ctx.function_id().to_owned();
                ctx.step_tx("log", async move |conn| {
                    sqlx::query("INSERT INTO ledger (note) VALUES ($1)")
                        .bind(format!("{function} attempt {attempt}"))
                        .execute(&mut *conn)
                        .await?;
                    match (permanent, attempt) {
                        (true, _) => Err(HandlerError::permanent("refused after writing")),
                        (false, 1) => Err(HandlerError::new("failed after writing")),
                        _ => Ok(()),
                    }
                })
                .await
            },
        )
    };
    let engine = common::engine(&opts, vec![make("retryable", false), make("permanent", true)]).await;
    create_ledger(&opts).await;
    let retryable = engine.send(Event::new("retryable/go", &())).await.unwrap().run_ids[0];
    let permanent = engine.send(Event::new("permanent/go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let (r, p) = (common::finished(&engine, retryable).await, common::finished(&engine, permanent).await);
    w.stop().await;

    assert_eq!((r.state, r.attempt), (RunState::Completed, 2), "{r:?}");
    assert_eq!((p.state, p.attempt), (RunState::Failed, 1), "{p:?}");
    assert_eq!(p.last_error.as_deref(), Some("step log: refused after writing"));
    assert_eq!(ledger(&engine).await, ["retryable attempt 2"]);
    assert_eq!(step_row(&engine, permanent, "log").await, None);
}

/// A step_tx whose attempt lost its lease while the closure ran: the checkpoint
/// is refused inside the transaction and the user's writes roll back with it;
/// the new attempt writes once. Catches: a step_tx fencing check outside the
/// transaction, or one that commits the user's writes before checking.
#[sqlx::test(migrations = false)]
async fn fenced_step_tx_rolls_back_its_writes(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let h = Arc::new(Handoff::default());
    let make = || {
        let h = h.clone();
        Function::new("fenced-tx").on_event("go").retries(3).handler(move |ctx: Ctx, _: ()| {
            let h = h.clone();
            async move {
                let attempt = ctx.attempt();
                let _dropped = h.drop_guard(attempt);
                if attempt > 1 {
                    // Attempt 2 waits before its step_tx, so nothing is stored for `log` yet
                    // when the stale attempt tries to commit.
                    h.hold(attempt).await;
                }
                let h2 = h.clone();
                ctx.step_tx("log", async move |conn| {
                    sqlx::query("INSERT INTO ledger (note) VALUES ($1)")
                        .bind(format!("attempt {attempt}"))
                        .execute(&mut *conn)
                        .await?;
                    if attempt == 1 {
                        h2.hold(attempt).await; // the lease is lost while the transaction is open
                    }
                    Ok(attempt)
                })
                .await
            }
        })
    };
    create_ledger(&opts).await;
    let (id, _engine_a, wa, engine, wb) = take_over(&opts, make, &h).await;

    release_stale(&h, wa).await;
    assert_eq!(ledger(&engine).await, Vec::<String>::new(), "the fenced step_tx committed the user's writes");
    assert_eq!(step_row(&engine, id, "log").await, None, "the fenced step_tx stored its checkpoint");

    h.b_gate.open();
    let run = common::finished(&engine, id).await;
    wb.stop().await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 2), "{run:?}");
    assert_eq!(run.output, Some(json!(2)));
    assert_eq!(ledger(&engine).await, ["attempt 2"]);
    let row = step_row(&engine, id, "log").await.unwrap();
    let claims = common::claim_epochs(&engine, id).await;
    assert_eq!(claims.len(), 2, "two claims");
    assert_eq!((row.output, row.lease_epoch), (json!(2), claims[1]), "stored by the second claim's attempt");
}
