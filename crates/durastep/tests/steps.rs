//! Steps: a stored step result never runs again, and step keys are deterministic
//! (repeated names, concurrent steps) across attempts and across a sleep.
mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durastep::{Backoff, Ctx, Event, Function, HandlerError, RunState};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::{StepRow, step_rows};

/// Counters shared between a test and its handler.
#[derive(Default)]
struct Counts {
    entries: AtomicU32,
    a: AtomicU32,
    b: AtomicU32,
    c: AtomicU32,
}

fn bump(n: &AtomicU32) -> u32 {
    n.fetch_add(1, Ordering::SeqCst) + 1
}

fn get(n: &AtomicU32) -> u32 {
    n.load(Ordering::SeqCst)
}

/// Three attempts: `b` fails on attempt 1, `c` on attempt 2. Each attempt runs
/// the handler from the top, but a step whose result is stored returns it
/// without running its body. Catches: the claim not loading stored results, a
/// lookup by the wrong key, or a retry that re-runs finished steps.
#[sqlx::test(migrations = false)]
async fn stored_steps_never_run_again_across_attempts(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let counts = Arc::new(Counts::default());
    let k = counts.clone();
    let f = Function::new("three-attempts").on_event("go").retries(5).backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, _: ()| {
            let k = k.clone();
            async move {
                bump(&k.entries);
                // A fresh random value each time the body runs: a re-run would show.
                let a: String = ctx
                    .step("a", || async {
                        bump(&k.a);
                        Ok(uuid::Uuid::new_v4().to_string())
                    })
                    .await?;
                let b: u32 = ctx
                    .step("b", || async {
                        if bump(&k.b) == 1 {
                            return Err(HandlerError::new("b fails once"));
                        }
                        Ok(7)
                    })
                    .await?;
                let c: u32 = ctx
                    .step("c", || async {
                        if bump(&k.c) == 1 {
                            return Err(HandlerError::new("c fails once"));
                        }
                        Ok(b * 6)
                    })
                    .await?;
                Ok(json!({ "a": a, "c": c, "attempt": ctx.attempt() }))
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let receipt = engine.send(Event::new("go", &())).await.unwrap();
    let id = receipt.run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;

    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 3);
    assert_eq!(get(&counts.entries), 3, "the handler runs from the top on every attempt");
    assert_eq!(get(&counts.a), 1, "a finished on attempt 1 and never ran again");
    assert_eq!(get(&counts.b), 2, "b: one failure, one success, then never again");
    assert_eq!(get(&counts.c), 2, "c: one failure, one success");
    let rows = step_rows(&engine, id).await;
    let keys: Vec<&str> = rows.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys, ["a", "b", "c"]);
    // The value later attempts saw for `a` is the stored one, not a fresh one.
    let output = run.output.unwrap();
    assert_eq!(output["a"], rows[0].output);
    assert_eq!(output["c"], json!(42));
    assert_eq!(output["attempt"], json!(3));
    // Each row was stored by the attempt that finished the step.
    let claims = common::claim_epochs(&engine, id).await;
    assert_eq!(claims.len(), 3, "three claims");
    assert_eq!(rows.iter().map(|r| r.lease_epoch).collect::<Vec<_>>(), claims);
}

/// A run that sleeps leaves the worker and is resumed later by running the
/// handler from the top: the steps before the sleep return their stored
/// results. Catches: a resume that re-runs pre-sleep steps (a doubled budget).
#[sqlx::test(migrations = false)]
async fn steps_before_a_sleep_do_not_run_again_after_it(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let counts = Arc::new(Counts::default());
    let k = counts.clone();
    let f = Function::new("nap").on_event("go").handler(move |ctx: Ctx, _: ()| {
        let k = k.clone();
        async move {
            bump(&k.entries);
            let token: String = ctx
                .step("get-token", || async {
                    bump(&k.a);
                    Ok(uuid::Uuid::new_v4().to_string())
                })
                .await?;
            ctx.step("push", || async {
                bump(&k.b);
                Ok(())
            })
            .await?;
            ctx.sleep("settle", Duration::from_secs(3600)).await?;
            let logged: String = ctx
                .step("log", || async {
                    bump(&k.c);
                    Ok(format!("logged with {token}"))
                })
                .await?;
            Ok(logged)
        }
    });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, id, "the run to sleep", |r| r.state == RunState::Sleeping).await;
    assert_eq!((get(&counts.a), get(&counts.b), get(&counts.c)), (1, 1, 0));

    durastep::testing::advance_clock(&engine, Duration::from_secs(3601)).await.unwrap();
    let run = common::finished(&engine, id).await;
    w.stop().await;

    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 1, "waking from a sleep is not a new attempt");
    assert_eq!(get(&counts.entries), 2, "the handler ran again from the top after the sleep");
    assert_eq!((get(&counts.a), get(&counts.b), get(&counts.c)), (1, 1, 1), "no step ran twice");
    let token = step_rows(&engine, id).await.into_iter().find(|r| r.key == "get-token").unwrap().output;
    assert_eq!(run.output, Some(json!(format!("logged with {}", token.as_str().unwrap()))));
}

/// Repeated names get keys `name`, `name#2`, `name#3`, the same on every
/// attempt, so attempt 2 finds each occurrence's own result. Catches: keys that
/// depend on anything but call order (time, attempt), or a counter that is not
/// reset per attempt (attempt 2 would ask for `item#4`.. and re-run the bodies).
#[sqlx::test(migrations = false)]
async fn repeated_step_names_get_numbered_deterministic_keys(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let items = Arc::new(AtomicU32::new(0));
    let fails = Arc::new(AtomicU32::new(0));
    let (i2, f2) = (items.clone(), fails.clone());
    let f = Function::new("repeat").on_event("go").backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, names: Vec<String>| {
            let (i2, f2) = (i2.clone(), f2.clone());
            async move {
                let mut out = Vec::new();
                for name in names {
                    let i2 = i2.clone();
                    let v: String = ctx
                        .step("item", || async move {
                            i2.fetch_add(1, Ordering::SeqCst);
                            Ok(format!("processed {name}"))
                        })
                        .await?;
                    out.push(v);
                }
                ctx.step("after", || async {
                    if f2.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Err(HandlerError::new("fail once after the loop"));
                    }
                    Ok(())
                })
                .await?;
                Ok(out)
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go", &["x", "y", "z"])).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;

    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 2);
    assert_eq!(items.load(Ordering::SeqCst), 3, "each occurrence ran once, not again on attempt 2");
    assert_eq!(run.output, Some(json!(["processed x", "processed y", "processed z"])));
    let rows = step_rows(&engine, id).await;
    let claims = common::claim_epochs(&engine, id).await;
    assert_eq!(claims.len(), 2, "two claims");
    let expect = |key: &str, output: serde_json::Value| StepRow { key: key.into(), output, lease_epoch: claims[0] };
    assert_eq!(
        rows,
        [
            StepRow { key: "after".into(), output: json!(null), lease_epoch: claims[1] },
            expect("item", json!("processed x")),
            expect("item#2", json!("processed y")),
            expect("item#3", json!("processed z")),
        ]
    );
}

/// Steps run concurrently with `tokio::join!` get their keys when they are
/// called, not when they finish: the slow first `fetch` is `fetch` even though
/// the second finishes first. After a retry each is found by its key and none
/// runs again. Catches: keys assigned in completion order (results swapped on
/// retry) or concurrent checkpoints lost in the group commit.
#[sqlx::test(migrations = false)]
async fn concurrent_steps_keep_deterministic_keys_across_a_retry(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let fails = Arc::new(AtomicU32::new(0));
    let (l2, f2) = (log.clone(), fails.clone());
    let f = Function::new("fan-out").on_event("go").backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, _: ()| {
            let (l2, f2) = (l2.clone(), f2.clone());
            async move {
                let body = |label: &'static str, delay_ms: u64| {
                    let l2 = l2.clone();
                    move || async move {
                        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                        l2.lock().unwrap().push(label.to_owned());
                        Ok(label.to_owned())
                    }
                };
                let (slow, fast, other) = tokio::join!(
                    ctx.step("fetch", body("slow", 60)),
                    ctx.step("fetch", body("fast", 0)),
                    ctx.step("other", body("other", 30)),
                );
                let (slow, fast, other): (String, String, String) = (slow?, fast?, other?);
                ctx.step("flaky", || async {
                    if f2.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Err(HandlerError::new("fail once after the join"));
                    }
                    Ok(())
                })
                .await?;
                Ok(vec![slow, fast, other])
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;

    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 2);
    let ran = log.lock().unwrap().clone();
    assert_eq!(ran, ["fast", "other", "slow"], "bodies finished in this order, once each");
    assert_eq!(run.output, Some(json!(["slow", "fast", "other"])));
    let rows: Vec<(String, serde_json::Value)> =
        step_rows(&engine, id).await.into_iter().map(|r| (r.key, r.output)).collect();
    assert_eq!(
        rows,
        [
            ("fetch".to_owned(), json!("slow")),
            ("fetch#2".to_owned(), json!("fast")),
            ("flaky".to_owned(), json!(null)),
            ("other".to_owned(), json!("other")),
        ]
    );
}

/// `step_with_key` hands each step its own idempotency key, `<run id>:<step
/// key>`: the same on every execution of that step (a retry after its body
/// failed gets the same key), different for a second step of the same name.
/// Catches: one key for every step of a name (the hand-formatted
/// `format!("{}:charge", ctx.idempotency_key())` that made two charges one),
/// or a key that changes between attempts.
#[sqlx::test(migrations = false)]
async fn step_with_key_hands_each_step_its_own_stable_key(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let keys = Arc::new(Mutex::new(Vec::<String>::new()));
    let k = keys.clone();
    let f = Function::new("charge-twice").on_event("go").backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, _: ()| {
            let k = k.clone();
            async move {
                let k2 = k.clone();
                ctx.step_with_key("charge", |key| async move {
                    let mut seen = k2.lock().unwrap();
                    seen.push(key);
                    if seen.len() == 1 {
                        return Err(HandlerError::new("payment API timed out"));
                    }
                    Ok(())
                })
                .await?;
                ctx.step_with_key("charge", |key| async move {
                    k.lock().unwrap().push(key);
                    Ok(())
                })
                .await
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;

    assert_eq!(run.state, RunState::Completed, "{run:?}");
    let keys = keys.lock().unwrap().clone();
    assert_eq!(keys, [format!("{id}:charge"), format!("{id}:charge"), format!("{id}:charge#2")]);
}

/// A flush that meets a step row already stored (an earlier commit whose
/// acknowledgement was lost, here written by the test while the step's body
/// runs) adopts it: the flush's plain insert fails on the stored row, and the
/// same writes go again with `ON CONFLICT DO NOTHING`, returning the stored
/// value. Catches a flush that fails the step (or the run) on the conflict.
#[sqlx::test(migrations = false)]
async fn a_checkpoint_that_meets_a_stored_row_adopts_it(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (arrived, go) = (common::Gate::new(), common::Gate::new());
    let (a, g) = (arrived.clone(), go.clone());
    let f = Function::new("adopts").on_event("adopt/go").retries(0).handler(move |ctx: Ctx, _: ()| {
        let (a, g) = (a.clone(), g.clone());
        async move {
            let fetched: String = ctx
                .step("fetch", || async move {
                    a.open();
                    g.wait().await;
                    Ok("computed".to_owned())
                })
                .await?;
            let after: u32 = ctx.step("after", || async { Ok(1) }).await?;
            Ok(json!({ "fetched": fetched, "after": after }))
        }
    });
    let engine = common::engine(&opts, vec![f]).await;
    let worker = common::spawn_worker(&engine);
    let id = engine.send(Event::new("adopt/go", &())).await.unwrap().run_ids[0];
    arrived.reached("the step body").await;
    let (epoch, _) = common::lease_of(&engine, id).await;
    sqlx::query(
        "INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch) VALUES ($1, 'fetch', '\"stored\"', $2)",
    )
    .bind(id)
    .bind(epoch)
    .execute(engine.pool())
    .await
    .unwrap();
    go.open();
    let run = common::finished(&engine, id).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!({ "fetched": "stored", "after": 1 })), "the stored value wins");
    let keys: Vec<String> = step_rows(&engine, id).await.into_iter().map(|r| r.key).collect();
    assert_eq!(keys, ["after", "fetch"]);
    worker.stop().await;
}

/// Checkpoints are plain inserts, not `ON CONFLICT` ones: a speculative
/// insertion writes one more WAL record per row (`HEAP_CONFIRM`) after
/// probing the unique index. And a checkpoint writes one row: its journal
/// entry is its step row's `position` and `kind` (migration 0029), not a
/// `step_journal` row. Counts the WAL records of this database's
/// `step_results` and `step_journal` while a run stores 20 steps (other
/// tests' databases write WAL meanwhile; their files are other relations).
/// Fails with the `ON CONFLICT` flush (20 confirmations) and with the entries
/// in `step_journal` (20 inserts there). The window ends at the flushed WAL
/// position: `pg_walinspect` refuses an end past it, and the insert position
/// can be ahead of it (claims commit asynchronously); the checkpoints commit
/// synchronously, so their records are flushed.
#[sqlx::test(migrations = false)]
async fn checkpoints_are_plain_inserts(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let f = Function::new("twenty").on_event("twenty/go").handler(|ctx: Ctx, _: ()| async move {
        for i in 0..20u32 {
            ctx.step(&format!("s{i}"), || async move { Ok(i) }).await?;
        }
        Ok(())
    });
    let engine = common::engine(&opts, vec![f]).await;
    let pool = engine.pool().clone();
    sqlx::query("CREATE EXTENSION IF NOT EXISTS pg_walinspect").execute(&pool).await.unwrap();
    let start: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text").fetch_one(&pool).await.unwrap();
    let worker = common::spawn_worker(&engine);
    let id = engine.send(Event::new("twenty/go", &())).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);
    worker.stop().await;
    let (inserts, journal_inserts, confirms): (i64, i64, i64) = sqlx::query_as(
        "WITH rels AS (
             SELECT c, '/' || (SELECT oid FROM pg_database WHERE datname = current_database()) || '/'
                    || pg_relation_filenode(c) || ' fork' AS tag
               FROM unnest(ARRAY['durastep.step_results'::regclass, 'durastep.step_journal'::regclass]) c),
         w AS (
             SELECT w.record_type, r.c FROM pg_get_wal_records_info($1::pg_lsn, pg_current_wal_flush_lsn()) w
               JOIN rels r ON strpos(w.block_ref, r.tag) > 0
              WHERE w.resource_manager = 'Heap')
         SELECT count(*) FILTER (WHERE w.record_type LIKE 'INSERT%' AND w.c = 'durastep.step_results'::regclass),
                count(*) FILTER (WHERE w.record_type LIKE 'INSERT%' AND w.c = 'durastep.step_journal'::regclass),
                count(*) FILTER (WHERE w.record_type = 'HEAP_CONFIRM')
           FROM w",
    )
    .bind(&start)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert!(inserts >= 20, "the window holds the 20 steps' rows: {inserts} inserts");
    assert_eq!(journal_inserts, 0, "a checkpoint's journal entry is on its step row");
    assert_eq!(confirms, 0, "no speculative insertion");
    let entries: Vec<(String, Option<i32>, Option<String>)> = sqlx::query_as(
        "SELECT step_key, position, kind FROM durastep.step_results WHERE run_id = $1 ORDER BY position",
    )
    .bind(id)
    .fetch_all(&pool)
    .await
    .unwrap();
    let expected: Vec<_> = (0..20).map(|i| (format!("s{i}"), Some(i), Some("step".to_owned()))).collect();
    assert_eq!(entries, expected);
}
