//! Bad input gives a clear, typed error and loses nothing already stored:
//! payloads that do not deserialize, oversized, NUL-holding or too-deep
//! payloads, malformed names, invalid definitions, an unreachable database, and
//! step or run outputs over the limit.
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use durastep::{Ctx, Engine, Error, Event, Function, LimitError, Limits, RunState};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Small limits, so oversized values stay small in the tests.
const LIMITS: Limits = Limits { max_payload_bytes: 1024, max_depth: 64, max_key_bytes: 512 };

#[derive(Debug, serde::Deserialize, serde::Serialize)]
struct Order {
    id: u64,
    cents: u64,
}

/// Rows in the tables a send writes to, to show a refused send wrote nothing.
async fn stored(engine: &Engine) -> (i64, i64) {
    (common::count(engine, "durastep.events").await, common::count(engine, "durastep.runs").await)
}

/// The run of a function that cannot read the payload fails permanently on
/// attempt 1 with a message naming the function and serde's reason; the event
/// and the other function's run are untouched. Catches: a deserialization
/// failure retried to exhaustion, or an error that does not say which function.
#[sqlx::test(migrations = false)]
async fn payload_that_does_not_deserialize_fails_the_run_permanently(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let typed = Function::new("typed-order")
        .on_event("order/placed")
        .retries(5)
        .handler(|ctx: Ctx, order: Order| async move { ctx.step("charge", || async move { Ok(order.cents) }).await });
    let raw = Function::new("raw-order").on_event("order/placed").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let engine = common::engine(&opts, vec![typed, raw]).await;
    let receipt = engine.send(Event::new("order/placed", "hello")).await.unwrap();
    let w = common::spawn_worker(&engine);
    let mut runs = Vec::new();
    for id in &receipt.run_ids {
        runs.push(common::finished(&engine, *id).await);
    }
    w.stop().await;
    let typed = runs.iter().find(|r| r.function_id == "typed-order").unwrap();
    let raw = runs.iter().find(|r| r.function_id == "raw-order").unwrap();

    assert_eq!((typed.state, typed.attempt), (RunState::Failed, 1), "{typed:?}");
    let error = typed.last_error.as_deref().unwrap();
    assert!(error.contains("function typed-order"), "{error}");
    assert!(error.contains("Order"), "{error}");
    assert!(error.contains(r#"invalid type: string "hello", expected struct Order"#), "{error}");
    assert!(common::step_rows(&engine, typed.id).await.is_empty());
    assert_eq!((raw.state, raw.output.clone()), (RunState::Completed, Some(json!("hello"))));
    let payload: Value = sqlx::query_scalar("SELECT payload FROM durastep.events WHERE id = $1")
        .bind(receipt.event_id)
        .fetch_one(engine.pool())
        .await
        .unwrap();
    assert_eq!(payload, json!("hello"), "the event is kept as sent");
}

/// What a refused event's error must look like.
type Expect = fn(&LimitError) -> bool;

fn nested(depth: usize) -> Value {
    (0..depth).fold(json!(1), |v, _| Value::Array(vec![v]))
}

/// Every kind of refused event, through `send`, `send_batch` (one bad event
/// refuses the batch) and `send_in` (the caller's transaction stays usable):
/// the typed error comes back and no row is written. Catches: a check done
/// after the INSERT, or a batch that stores its good half.
#[sqlx::test(migrations = false)]
async fn refused_events_write_nothing(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let f = Function::new("keep").on_event("order/placed").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let engine = common::engine_with_limits(&opts, vec![f], LIMITS).await;
    let kept = engine.send(Event::new("order/placed", &json!({"id": 1}))).await.unwrap();
    let before = stored(&engine).await;
    assert_eq!(before, (1, 1));

    let tuple_keys: BTreeMap<(u8, u8), u8> = BTreeMap::from([((1, 2), 3)]);
    let cases: Vec<(Event, Expect)> = vec![
        (Event::new("order/placed", &"x".repeat(2000)), |e| *e == LimitError::TooLarge { size: 2002, limit: 1024 }),
        (Event::new("order/placed", &json!({"note": "a\u{0}b"})), |e| *e == LimitError::NulCharacter),
        (Event::new("order/placed", &json!({"a\u{0}": 1})), |e| *e == LimitError::NulCharacter),
        (Event::new("order/placed", &nested(65)), |e| *e == LimitError::TooDeep { limit: 64 }),
        (Event::new("order/placed", &tuple_keys), |e| matches!(e, LimitError::Serialize(_))),
        (Event::new("", &1), |e| matches!(e, LimitError::InvalidName { what: "event name", .. })),
        (Event::new("order/\nplaced", &1), |e| matches!(e, LimitError::InvalidName { what: "event name", .. })),
        (Event::new("order/placed", &1).idempotency_key(""), |e| {
            matches!(e, LimitError::InvalidName { what: "idempotency key", .. })
        }),
        (Event::new("order/placed", &1).idempotency_key("k".repeat(513)), |e| {
            matches!(e, LimitError::InvalidName { what: "idempotency key", .. })
        }),
    ];
    for (event, is_expected) in cases {
        let name = format!("{event:?}").chars().take(120).collect::<String>();
        match engine.send(event.clone()).await {
            Err(Error::Limit(e)) => assert!(is_expected(&e), "{name}: unexpected error {e}"),
            other => panic!("{name}: expected a limit error, got {other:?}"),
        }
        let batch = vec![Event::new("order/placed", &json!({"id": 2})), event.clone()];
        match engine.send_batch(batch).await {
            Err(Error::Limit(e)) => assert!(is_expected(&e), "{name} in a batch: unexpected error {e}"),
            other => panic!("{name} in a batch: expected a limit error, got {other:?}"),
        }
        let mut tx = engine.pool().begin().await.unwrap();
        match engine.send_in(&mut tx, event).await {
            Err(Error::Limit(e)) => assert!(is_expected(&e), "{name} in send_in: unexpected error {e}"),
            other => panic!("{name} in send_in: expected a limit error, got {other:?}"),
        }
        // The caller's transaction is still usable: nothing ran in it.
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        assert_eq!(stored(&engine).await, before, "{name}: a refused send wrote rows");
    }

    // What was stored before is intact and still runs.
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, kept.run_ids[0]).await;
    w.stop().await;
    assert_eq!(run.output, Some(json!({"id": 1})));
}

/// Invalid definitions are refused by `build` with a typed error, and do not
/// disturb what an earlier engine registered. Catches: a bad function id that
/// is registered anyway, or a duplicate id where one silently wins.
#[sqlx::test(migrations = false)]
async fn invalid_definitions_are_refused_at_build(_p: PgPoolOptions, opts: PgConnectOptions) {
    let ok = || Function::new("ok").on_event("a").handler(|_c: Ctx, _: ()| async { Ok(()) });
    let _first = common::engine(&opts, vec![ok()]).await;
    let build =
        |functions: Vec<Function>| common::try_engine(&opts, functions, common::fast_options(), Limits::default());

    let bad_id = Function::new("bad id").on_event("a").handler(|_c: Ctx, _: ()| async { Ok(()) });
    match build(vec![bad_id]).await {
        Err(Error::Limit(LimitError::InvalidName { what: "function id", value, .. })) => assert_eq!(value, "bad id"),
        other => panic!("expected an invalid function id, got {:?}", other.err()),
    }
    let reserved = Function::new("x/on-failure").on_event("a").handler(|_c: Ctx, _: ()| async { Ok(()) });
    assert!(matches!(
        build(vec![reserved]).await.err(),
        Some(Error::Limit(LimitError::InvalidName { what: "function id", .. }))
    ));
    let empty = Function::new("").on_event("a").handler(|_c: Ctx, _: ()| async { Ok(()) });
    assert!(matches!(
        build(vec![empty]).await.err(),
        Some(Error::Limit(LimitError::InvalidName { what: "function id", .. }))
    ));
    let bad_trigger = Function::new("f").on_event("").handler(|_c: Ctx, _: ()| async { Ok(()) });
    assert!(matches!(
        build(vec![bad_trigger]).await.err(),
        Some(Error::Limit(LimitError::InvalidName { what: "event name", .. }))
    ));
    match build(vec![ok(), ok()]).await {
        Err(Error::InvalidFunction(message)) => assert!(message.contains("\"ok\""), "{message}"),
        other => panic!("expected a duplicate function id error, got {:?}", other.err()),
    }

    let registered: Vec<String> =
        sqlx::query_scalar("SELECT id FROM durastep.functions ORDER BY id").fetch_all(_first.pool()).await.unwrap();
    assert_eq!(registered, ["ok"]);
}

/// An unreachable database is `Error::Unavailable` (transient) at build.
/// sqlx retries a refused connection until the pool's acquire timeout (10 s).
#[tokio::test]
async fn unreachable_database_is_unavailable_at_build() {
    let started = std::time::Instant::now();
    let err = Engine::builder()
        .database_url("postgres://postgres@127.0.0.1:1/postgres")
        .build()
        .await
        .expect_err("port 1 has no database");
    assert!(matches!(err, Error::Unavailable(_)), "{err:?}");
    assert!(err.is_transient());
    assert!(started.elapsed() < Duration::from_secs(30), "took {:?}", started.elapsed());
}

/// A step output or a run output over the limit fails the run at once with a
/// message naming the step and the sizes; the results stored before it stay.
/// Catches: an oversized output written anyway, or an error that does not say
/// what was too large.
#[sqlx::test(migrations = false)]
async fn outputs_over_the_limit_fail_the_run_clearly(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let big_step = Function::new("big-step").on_event("go").retries(5).handler(|ctx: Ctx, _: ()| async move {
        ctx.step("small", || async { Ok("fits".to_owned()) }).await?;
        let page: String = ctx.step("render", || async { Ok("x".repeat(2000)) }).await?;
        Ok(page.len())
    });
    let big_output = Function::new("big-output").on_event("go").retries(5).handler(|ctx: Ctx, _: ()| async move {
        ctx.step("small", || async { Ok("fits".to_owned()) }).await?;
        Ok("y".repeat(2000))
    });
    let bad_name = Function::new("bad-step-name")
        .on_event("go")
        .retries(5)
        .handler(|ctx: Ctx, _: ()| async move { ctx.step("push#2", || async { Ok(()) }).await });
    let engine = common::engine_with_limits(&opts, vec![big_step, big_output, bad_name], LIMITS).await;
    let ids = engine.send(Event::new("go", &())).await.unwrap().run_ids;
    let w = common::spawn_worker(&engine);
    let mut runs = Vec::new();
    for id in ids {
        runs.push(common::finished(&engine, id).await);
    }
    w.stop().await;
    let run = |f: &str| runs.iter().find(|r| r.function_id == f).unwrap().clone();

    let r = run("big-step");
    assert_eq!((r.state, r.attempt), (RunState::Failed, 1), "{r:?}");
    assert_eq!(
        r.last_error.as_deref(),
        Some("step render: output refused: payload is 2002 bytes, over the limit of 1024 bytes")
    );
    let keys: Vec<String> = common::step_rows(&engine, r.id).await.into_iter().map(|s| s.key).collect();
    assert_eq!(keys, ["small"], "the earlier result is kept and the oversized one is not stored");

    let r = run("big-output");
    assert_eq!((r.state, r.attempt, r.output.clone()), (RunState::Failed, 1, None), "{r:?}");
    assert_eq!(
        r.last_error.as_deref(),
        Some("run output refused: payload is 2002 bytes, over the limit of 1024 bytes")
    );
    assert_eq!(common::step_rows(&engine, r.id).await.len(), 1);

    let r = run("bad-step-name");
    assert_eq!((r.state, r.attempt), (RunState::Failed, 1), "{r:?}");
    let error = r.last_error.unwrap();
    assert!(error.contains("step name") && error.contains("push#2") && error.contains('#'), "{error}");
}
