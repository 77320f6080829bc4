//! Bad input gives a clear, typed error and loses nothing already stored:
//! payloads that do not deserialize, oversized, NUL-holding or too-deep
//! payloads, malformed names, invalid definitions, an unreachable database, and
//! step or run outputs over the limit.
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use durastep::{Ctx, Engine, Error, Event, Function, LimitError, Limits, RunState};
use serde_json::{Value, json};
use sqlx::ConnectOptions;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Small limits, so oversized values stay small in the tests.
const LIMITS: Limits = Limits {
    max_payload_bytes: 1024,
    max_depth: 64,
    max_key_bytes: 512,
    max_run_bytes: 64 * 1024 * 1024,
    max_steps_per_run: 10_000,
    max_batch_events: 10_000,
    max_batch_bytes: 16 * 1024 * 1024,
};

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

/// The server to point bad settings at: `DATABASE_URL`'s host, port and user.
fn server() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database that does not exist, a role that does not exist and a
/// malformed URL are configuration errors: `Error::Config`, not transient (a
/// retry loop must not retry them forever), and the message is the server's
/// without sqlx's "at line N" (the server's C source line).
/// Catches: these reported as `Unavailable` with `is_transient() == true`,
/// and "... does not exist at line 1023" noise.
#[tokio::test]
async fn wrong_settings_are_configuration_errors_not_transient() {
    let server: PgConnectOptions = server().parse().unwrap();
    let no_database = server.clone().database("durastep_no_such_database_x9");
    let no_role = server.clone().username("durastep_no_such_role_x9");
    for (what, options) in [("database", no_database), ("role", no_role)] {
        let url = options.to_url_lossy().to_string();
        let err = Engine::builder().database_url(url).build().await.expect_err(what);
        assert!(matches!(err, Error::Config(_)), "{what}: {err:?}");
        assert!(!err.is_transient(), "{what}: {err:?}");
        let message = err.to_string();
        assert!(message.contains("does not exist"), "{what}: {message}");
        assert!(!message.contains(" at line "), "{what}: {message}");
    }
    for url in ["not a url", "postgres://postgres@127.0.0.1:notaport/postgres"] {
        let err = Engine::builder().database_url(url).build().await.expect_err(url);
        assert!(matches!(err, Error::Config(_)), "{url}: {err:?}");
        assert!(!err.is_transient());
    }
}

/// A database error raised inside a step and passed on with `?` is stored as
/// the server's message with its SQLSTATE, once.
/// Catches: `HandlerError`'s `From` copying sqlx's text, which adds the
/// server's C source line ("division by zero at line 840") and repeats the
/// message through the error's source.
#[sqlx::test(migrations = false)]
async fn a_database_error_in_a_step_is_stored_without_noise(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = durastep::Function::new("divide").on_event("divide").retries(0).handler(
        |ctx: durastep::Ctx, _: ()| async move {
            ctx.step_tx("divide", async move |conn| {
                let n: i32 = sqlx::query_scalar("SELECT 1 / 0").fetch_one(&mut *conn).await?;
                Ok(n)
            })
            .await?;
            Ok(())
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let run_id = engine.send(durastep::Event::new("divide", &())).await.unwrap().run_ids[0];
    let worker = common::spawn_worker(&engine);
    let run = common::finished(&engine, run_id).await;
    worker.stop().await;
    let error = run.last_error.unwrap_or_default();
    assert!(error.contains("division by zero (SQLSTATE 22012)"), "{error}");
    assert!(!error.contains(" at line "), "{error}");
    assert_eq!(error.matches("division by zero").count(), 1, "{error}");
}

/// Every `sqlx::Error` converts through the one classifying `From`: `?` on a
/// sqlx call in code returning `durastep::Error` tells unreachability apart.
/// Catches: a derived `From` that made every sqlx error `Error::Database`.
#[test]
fn the_one_from_sqlx_error_classifies() {
    let io = sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused"));
    assert!(matches!(Error::from(io), Error::Unavailable(_)));
    assert!(matches!(Error::from(sqlx::Error::PoolTimedOut), Error::Unavailable(_)));
    assert!(matches!(Error::from(sqlx::Error::Configuration("bad".into())), Error::Config(_)));
    assert!(matches!(Error::from(sqlx::Error::RowNotFound), Error::Database(_)));
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
