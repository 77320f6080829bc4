//! What a sender (or the handler code it drives) can make Durastep store or
//! do: bytes and steps per run, the size of a `send_batch`, topic rows, and
//! priorities taken from event data. Each limit is in docs/security.md with
//! its default and the test here that shows it.

mod common;

use std::time::Duration;

use durastep::{Ctx, Event, Function, LimitError, Limits, RunState};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Catches: a run could store step results without bound (each under
/// `max_payload_bytes`, but together past the 255 MiB `jsonb` value the claim
/// reads them into, after which the run could never be claimed again).
#[sqlx::test(migrations = false)]
async fn a_run_over_its_byte_limit_fails_typed_and_keeps_what_it_stored(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("hoard").on_event("h").retries(0).handler(|ctx: Ctx, _: ()| async move {
        for i in 0..10 {
            let _: String = ctx.step(&format!("s{i}"), || async { Ok("x".repeat(3_000)) }).await?;
        }
        Ok(())
    });
    let limits = Limits { max_run_bytes: 10_000, ..Limits::default() };
    let engine = common::engine_with_limits(&opts, vec![f], limits).await;
    let run_id = engine.send(Event::new("h", &())).await.unwrap().run_ids[0];
    let worker = common::spawn_worker(&engine);
    let run = common::finished(&engine, run_id).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    let error = run.last_error.unwrap_or_default();
    assert!(error.contains("s3") && error.contains("over the limit of 10000 bytes per run"), "{error}");
    assert_eq!(common::step_rows(&engine, run_id).await.len(), 3, "the first three steps stay stored");
}

/// Catches: records the database writes for a run (a child's output, a
/// wait's event) were never counted against `max_run_bytes`, so a loop of
/// invokes (or waits on sender-chosen events) could store without bound, past
/// what a claim can read.
#[sqlx::test(migrations = false)]
async fn child_outcomes_count_against_the_run_byte_limit(_p: PgPoolOptions, opts: PgConnectOptions) {
    let child = Function::new("big-child").handler(|_ctx: Ctx, _: ()| async move { Ok("y".repeat(3_000)) });
    let parent = Function::new("collector").on_event("collect").retries(0).handler(|ctx: Ctx, _: ()| async move {
        for i in 0..10 {
            let out: Result<String, durastep::ChildError> =
                ctx.invoke(&format!("c{i}"), durastep::Invoke::function("big-child")).await?;
            assert_eq!(out.map(|s| s.len()).unwrap_or(0), 3_000);
        }
        Ok(())
    });
    let limits = Limits { max_run_bytes: 10_000, ..Limits::default() };
    let engine = common::engine_with_limits(&opts, vec![child, parent], limits).await;
    let run_id = engine.send(Event::new("collect", &())).await.unwrap().run_ids[0];
    let worker = common::spawn_worker(&engine);
    let run = common::finished(&engine, run_id).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    let error = run.last_error.unwrap_or_default();
    assert!(error.contains("c4") && error.contains("over the limit of 10000 bytes per run"), "{error}");
    let bytes: i64 = sqlx::query_scalar(
        "SELECT sum(octet_length(output::text))::bigint FROM durastep.step_results WHERE run_id = $1",
    )
    .bind(run_id)
    .fetch_one(engine.pool())
    .await
    .unwrap();
    assert!(bytes < 10_000 + 4_000, "the run stored {bytes} bytes: past its limit by more than one record");
}

/// Catches: a run could record any number of steps (a loop over sender data).
#[sqlx::test(migrations = false)]
async fn a_run_over_its_step_limit_fails_typed(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("loop").on_event("l").retries(0).handler(|ctx: Ctx, n: u32| async move {
        for i in 0..n {
            let _: u32 = ctx.step("tick", || async move { Ok(i) }).await?;
        }
        Ok(())
    });
    let limits = Limits { max_steps_per_run: 5, ..Limits::default() };
    let engine = common::engine_with_limits(&opts, vec![f], limits).await;
    let ok = engine.send(Event::new("l", &5u32)).await.unwrap().run_ids[0];
    let over = engine.send(Event::new("l", &50u32)).await.unwrap().run_ids[0];
    let worker = common::spawn_worker(&engine);
    let (ok, over) = (common::finished(&engine, ok).await, common::finished(&engine, over).await);
    worker.stop().await;
    assert_eq!(ok.state, RunState::Completed, "{ok:?}");
    assert_eq!(over.state, RunState::Failed, "{over:?}");
    let error = over.last_error.unwrap_or_default();
    assert!(error.contains("tick#6") && error.contains("more than 5 steps"), "{error}");
    assert_eq!(common::step_rows(&engine, over.id).await.len(), 5);
}

/// Catches: `send_batch` took any number of events in one statement (a
/// million events of 1 MiB is far past Postgres' 1 GB message limit).
#[sqlx::test(migrations = false)]
async fn send_batch_is_bounded_in_events_and_bytes(_p: PgPoolOptions, opts: PgConnectOptions) {
    let limits = Limits { max_batch_events: 3, max_batch_bytes: 100, ..Limits::default() };
    let engine = common::engine_with_limits(&opts, vec![], limits).await;
    let small = |n: usize| (0..n).map(|i| Event::new("b", &i)).collect::<Vec<_>>();
    assert_eq!(engine.send_batch(small(3)).await.unwrap().len(), 3);
    let err = engine.send_batch(small(4)).await.unwrap_err();
    assert!(matches!(err, durastep::Error::Limit(LimitError::BatchTooLarge { events: 4, .. })), "{err}");
    let big = vec![Event::new("b", &"y".repeat(60)), Event::new("b", &"z".repeat(60))];
    let err = engine.send_batch(big).await.unwrap_err();
    assert!(matches!(err, durastep::Error::Limit(LimitError::BatchTooLarge { events: 2, .. })), "{err}");
    assert_eq!(common::count(&engine, "durastep.events").await, 3, "refused batches store nothing");
}

/// Catches: `durastep.topics` kept one row per event name ever sent or
/// awaited, forever (a sender choosing fresh names grew it without bound).
/// Prune deletes the rows no wait uses; a name in use keeps its row, and a
/// pruned name works again at once.
#[sqlx::test(migrations = false)]
async fn prune_removes_topics_no_wait_uses(_p: PgPoolOptions, opts: PgConnectOptions) {
    let waiter = Function::new("waiter").on_event("start").retries(0).handler(|ctx: Ctx, _: ()| async move {
        let got: Option<u32> = ctx
            .wait_for_event(
                "w",
                durastep::WaitFor::event("kept/name")
                    .matching(durastep::EventMatch::any())
                    .timeout(Duration::from_secs(3600)),
            )
            .await?;
        Ok(got)
    });
    let engine = common::engine(&opts, vec![waiter]).await;
    engine.send_batch((0..50).map(|i| Event::new(format!("junk/{i}"), &i)).collect()).await.unwrap();
    let run_id = engine.send(Event::new("start", &())).await.unwrap().run_ids[0];
    let worker = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, run_id, "waiting", |r| r.state == RunState::Waiting).await;
    assert!(common::count(&engine, "durastep.topics").await >= 52);

    let report = engine.prune(Duration::from_secs(86_400)).await.unwrap();
    assert!(report.topics >= 51, "{report:?}");
    let names: Vec<String> =
        sqlx::query_scalar("SELECT name FROM durastep.topics").fetch_all(engine.pool()).await.unwrap();
    assert_eq!(names, vec!["kept/name".to_owned()]);

    // The waiting run still gets its event, and pruned names are usable again.
    engine.send(Event::new("junk/1", &1)).await.unwrap();
    engine.send(Event::new("kept/name", &7u32)).await.unwrap();
    let run = common::finished(&engine, run_id).await;
    worker.stop().await;
    assert_eq!(run.output, Some(serde_json::json!(7)));
}

/// Catches: `priority_from` took any integer from the event data, so a sender
/// could put its runs ahead of every other run (2147483647).
#[sqlx::test(migrations = false)]
async fn priority_from_is_clamped_to_the_functions_range(_p: PgPoolOptions, opts: PgConnectOptions) {
    let noop = |_ctx: Ctx, _e: serde_json::Value| async { Ok(()) };
    let default_range = Function::new("a").on_event("p").priority_from("/urgency").handler(noop);
    let narrow = Function::new("b").on_event("p").priority_from("/urgency").priority_range(0..=10).handler(noop);
    let engine = common::engine(&opts, vec![default_range, narrow]).await;
    let send = |u: serde_json::Value| {
        let engine = engine.clone();
        async move { engine.send(Event::new("p", &serde_json::json!({"urgency": u})).priority(3)).await.unwrap() }
    };
    let priorities = |r: durastep::SendReceipt| {
        let engine = engine.clone();
        async move {
            let mut v: Vec<(String, i32)> = sqlx::query_as(
                "SELECT function_id, priority FROM durastep.runs WHERE id = ANY ($1) ORDER BY function_id",
            )
            .bind(&r.run_ids)
            .fetch_all(engine.pool())
            .await
            .unwrap();
            v.sort();
            v.into_iter().map(|(_, p)| p).collect::<Vec<i32>>()
        }
    };
    assert_eq!(priorities(send(serde_json::json!(1e12)).await).await, vec![100, 10]);
    assert_eq!(priorities(send(serde_json::json!(-5000)).await).await, vec![-100, 0]);
    assert_eq!(priorities(send(serde_json::json!(7)).await).await, vec![7, 7]);
    // No number there: the priority it was sent with, as set by code.
    assert_eq!(priorities(send(serde_json::json!("high")).await).await, vec![3, 3]);

    // An empty range (a bound computed from configuration, say) is refused at build.
    let (lo, hi) = (5, 1);
    let empty = Function::new("c").on_event("p").priority_from("/u").priority_range(lo..=hi).handler(noop);
    let err = common::try_engine(&opts, vec![empty], common::fast_options(), Limits::default()).await.unwrap_err();
    assert!(err.to_string().contains("priority_range"), "{err}");
}
