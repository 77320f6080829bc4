//! Encrypted step outputs: nothing readable at rest, bound to run and step, key rotation.

mod common;

use std::future::Future;
use std::time::Duration;

use durastep::{Ctx, Engine, Event, Function, Keyring, RunState};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn token_flow() -> Function {
    Function::new("rotate-token").on_event("token/rotate").retries(0).handler(|ctx: Ctx, account: String| async move {
        let token: String =
            ctx.step("fetch-token", || async move { Ok(format!("secret-token-for-{account}")) }).await?;
        let len: usize = ctx.step("use-token", || async move { Ok(token.len()) }).await?;
        Ok(format!("used {len} bytes of secret-token"))
    })
}

async fn engine(opts: &PgConnectOptions, keyring: Keyring) -> Engine {
    let pool = PgPoolOptions::new().max_connections(4).connect_with(opts.clone()).await.unwrap();
    Engine::builder()
        .pool(pool)
        .worker_options(common::fast_options())
        .encryption(keyring)
        .function(token_flow())
        .build()
        .await
        .unwrap()
}

async fn run_once(engine: &Engine, account: &str) -> durastep::Run {
    let receipt = engine.send(Event::new("token/rotate", account)).await.unwrap();
    let worker = common::spawn_worker(engine);
    let run = engine.wait_for_run(receipt.run_ids[0], Duration::from_secs(10)).await.unwrap();
    worker.stop().await;
    run
}

#[sqlx::test(migrations = false)]
async fn step_outputs_are_sealed_at_rest(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, Keyring::new("k1", [7; 32])).await;
    let run = run_once(&engine, "act_1").await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    // The engine that holds the key shows the output opened.
    assert_eq!(run.output, Some(serde_json::json!("used 22 bytes of secret-token")));

    // At rest: no plaintext in step_results or runs, and the key id beside the ciphertext.
    let raw: Vec<String> = sqlx::query_scalar("SELECT output::text FROM durastep.step_results WHERE run_id = $1")
        .bind(run.id)
        .fetch_all(engine.pool())
        .await
        .unwrap();
    assert_eq!(raw.len(), 2);
    for text in &raw {
        assert!(!text.contains("secret"), "plaintext at rest: {text}");
        assert!(text.contains(r#""kid": "k1""#), "{text}");
    }
    let output: String = sqlx::query_scalar("SELECT output::text FROM durastep.runs WHERE id = $1")
        .bind(run.id)
        .fetch_one(engine.pool())
        .await
        .unwrap();
    assert!(!output.contains("secret"), "plaintext run output at rest: {output}");
}

#[sqlx::test(migrations = false)]
async fn a_ciphertext_moved_to_another_run_does_not_open(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, Keyring::new("k1", [7; 32])).await;
    let first = run_once(&engine, "act_1").await;
    assert_eq!(first.state, RunState::Completed);

    // A second run whose first step result is a copy of the first run's ciphertext
    // (an attacker with write access to step_results swapping tokens between accounts).
    let receipt = engine.send(Event::new("token/rotate", "act_2")).await.unwrap();
    let second = receipt.run_ids[0];
    sqlx::query(
        "INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
         SELECT $2, step_key, output, 0 FROM durastep.step_results WHERE run_id = $1 AND step_key = 'fetch-token'",
    )
    .bind(first.id)
    .bind(second)
    .execute(engine.pool())
    .await
    .unwrap();
    let worker = common::spawn_worker(&engine);
    let run = engine.wait_for_run(second, Duration::from_secs(10)).await.unwrap();
    worker.stop().await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    let error = run.last_error.unwrap_or_default();
    assert!(error.contains("fetch-token") && error.contains("does not authenticate"), "{error}");
}

#[sqlx::test(migrations = false)]
async fn rotation_keeps_old_results_readable(_p: PgPoolOptions, opts: PgConnectOptions) {
    // A run sleeps under key k1; the engine is restarted with k2 as current and
    // k1 kept as old: the run resumes from its k1-sealed step and finishes.
    let sleepy = |id: &'static str| {
        Function::new(id).on_event("s").retries(0).handler(|ctx: Ctx, _: ()| async move {
            let a: String = ctx.step("before", || async { Ok("secret-a".to_owned()) }).await?;
            ctx.sleep("nap", Duration::from_secs(3600)).await?;
            let b: String = ctx.step("after", || async { Ok("secret-b".to_owned()) }).await?;
            Ok(format!("{a}+{b}"))
        })
    };
    let pool = PgPoolOptions::new().max_connections(4).connect_with(opts.clone()).await.unwrap();
    let old = Engine::builder()
        .pool(pool.clone())
        .worker_options(common::fast_options())
        .encryption(Keyring::new("k1", [1; 32]))
        .function(sleepy("sleepy"))
        .build()
        .await
        .unwrap();
    let run_id = old.send(Event::new("s", &())).await.unwrap().run_ids[0];
    let worker = common::spawn_worker(&old);
    common::wait_for_run_where(&old, run_id, "sleeping", |r| r.state == RunState::Sleeping).await;
    worker.stop().await;

    let rotated = Engine::builder()
        .pool(pool)
        .worker_options(common::fast_options())
        .encryption(Keyring::new("k2", [2; 32]).with_old_key("k1", [1; 32]))
        .function(sleepy("sleepy"))
        .build()
        .await
        .unwrap();
    durastep::testing::advance_clock(&rotated, Duration::from_secs(3601)).await.unwrap();
    let worker = common::spawn_worker(&rotated);
    let run = rotated.wait_for_run(run_id, Duration::from_secs(10)).await.unwrap();
    worker.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(serde_json::json!("secret-a+secret-b")));
    let kids: Vec<String> =
        sqlx::query_scalar("SELECT output->>'kid' FROM durastep.step_results WHERE run_id = $1 ORDER BY created_at")
            .bind(run_id)
            .fetch_all(rotated.pool())
            .await
            .unwrap();
    assert_eq!(kids, vec!["k1", "k1", "k2"], "before and nap sealed with k1, after with k2");
}

fn keyed_engine(opts: &PgConnectOptions, keyring: Keyring, functions: Vec<Function>) -> impl Future<Output = Engine> {
    let opts = opts.clone();
    async move {
        let pool = PgPoolOptions::new().max_connections(4).connect_with(opts).await.unwrap();
        let mut builder = Engine::builder().pool(pool).worker_options(common::fast_options()).encryption(keyring);
        for f in functions {
            builder = builder.function(f);
        }
        builder.build().await.unwrap()
    }
}

/// Catches: with a keyring, a plaintext value in `step_results` was passed
/// through (`Keyring::open` returned a non-envelope as is): anyone who can
/// write to the database could forge a step result and the handler used it.
#[sqlx::test(migrations = false)]
async fn a_forged_plaintext_step_result_is_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, Keyring::new("k1", [7; 32])).await;
    let run_id = engine.send(Event::new("token/rotate", "act_1")).await.unwrap().run_ids[0];
    sqlx::query(
        "INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
         VALUES ($1, 'fetch-token', '\"attacker-token\"', 0)",
    )
    .bind(run_id)
    .execute(engine.pool())
    .await
    .unwrap();
    let worker = common::spawn_worker(&engine);
    let run = common::finished(&engine, run_id).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    let error = run.last_error.unwrap_or_default();
    assert!(error.contains("fetch-token") && error.contains("plaintext"), "{error}");
    let used: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durastep.step_results WHERE run_id = $1 AND step_key = 'use-token'")
            .bind(run_id)
            .fetch_one(engine.pool())
            .await
            .unwrap();
    assert_eq!(used, 0, "the forged token reached the next step");
}

/// G13's old-values promise, now explicit: inside the migration window
/// (`Keyring::accept_plaintext_until`), a value stored before encryption was
/// turned on reads; everything written meanwhile is sealed.
#[sqlx::test(migrations = false)]
async fn plaintext_stored_before_encryption_reads_inside_the_migration_window(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let window = Keyring::new("k1", [7; 32]).accept_plaintext_until(chrono::Utc::now() + chrono::Duration::hours(1));
    let engine = engine(&opts, window).await;
    let run_id = engine.send(Event::new("token/rotate", "act_1")).await.unwrap().run_ids[0];
    sqlx::query(
        "INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
         VALUES ($1, 'fetch-token', '\"old-plain-token\"', 0)",
    )
    .bind(run_id)
    .execute(engine.pool())
    .await
    .unwrap();
    let worker = common::spawn_worker(&engine);
    let run = common::finished(&engine, run_id).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(serde_json::json!("used 15 bytes of secret-token")));
    let sealed: String = sqlx::query_scalar(
        "SELECT output::text FROM durastep.step_results WHERE run_id = $1 AND step_key = 'use-token'",
    )
    .bind(run_id)
    .fetch_one(engine.pool())
    .await
    .unwrap();
    assert!(sealed.contains(r#""$durastep": "sealed""#), "{sealed}");
}

fn waiter() -> Function {
    Function::new("waiter").on_event("w/start").retries(0).handler(|ctx: Ctx, _: ()| async move {
        let got: Option<String> = ctx
            .wait_for_event(
                "approval",
                durastep::WaitFor::event("w/approved")
                    .matching(durastep::EventMatch::any())
                    .timeout(Duration::from_secs(3600)),
            )
            .await?;
        Ok(got)
    })
}

/// Catches: wait results were stored as plain JSON written by SQL and read
/// as is, so a database writer could make a wait return data no event
/// carried; and they stayed unsealed at rest. Now a plain wait result is
/// checked against the stored event, then stored sealed (kind `wait`).
#[sqlx::test(migrations = false)]
async fn wait_results_are_authenticated_and_sealed(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = keyed_engine(&opts, Keyring::new("k1", [7; 32]), vec![waiter()]).await;
    let worker = common::spawn_worker(&engine);

    // A real event: delivered, and the record is sealed after the engine reads it.
    let real = engine.send(Event::new("w/start", &())).await.unwrap().run_ids[0];
    common::wait_for_run_where(&engine, real, "waiting", |r| r.state == RunState::Waiting).await;
    engine.send(Event::new("w/approved", &"secret-approval")).await.unwrap();
    let run = common::finished(&engine, real).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(serde_json::json!("secret-approval")));
    let stored: String = sqlx::query_scalar(
        "SELECT output::text FROM durastep.step_results WHERE run_id = $1 AND step_key = 'approval'",
    )
    .bind(real)
    .fetch_one(engine.pool())
    .await
    .unwrap();
    assert!(!stored.contains("secret-approval") && stored.contains(r#""$durastep": "sealed""#), "{stored}");

    // A forged one: a plain record naming no stored event.
    let forged = engine.send(Event::new("w/start", &())).await.unwrap().run_ids[0];
    common::wait_for_run_where(&engine, forged, "waiting", |r| r.state == RunState::Waiting).await;
    sqlx::query(
        "WITH s AS (INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
                    VALUES ($1, 'approval', jsonb_build_object('event_id', gen_random_uuid(), 'data', 'forged'), 0))
         UPDATE durastep.runs SET state = 'queued', run_at = durastep.now() WHERE id = $1",
    )
    .bind(forged)
    .execute(engine.pool())
    .await
    .unwrap();
    let run = common::finished(&engine, forged).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    assert!(run.last_error.as_deref().unwrap_or_default().contains("forged"), "{run:?}");
}

/// Catches: a child's output was opened with associated data taken from the
/// unauthenticated child record (`child_run_id`), so the sealed output of any
/// run could be transplanted into a waiting parent. Now a child's output is
/// bound to the parent run and step it answers.
#[sqlx::test(migrations = false)]
async fn a_sealed_run_output_cannot_be_transplanted_into_a_parent(_p: PgPoolOptions, opts: PgConnectOptions) {
    let gate = Function::new("gate").handler(|ctx: Ctx, _: ()| async move {
        let go: Option<String> = ctx
            .wait_for_event(
                "hold",
                durastep::WaitFor::event("never/happens")
                    .matching(durastep::EventMatch::any())
                    .timeout(Duration::from_secs(3600)),
            )
            .await?;
        Ok(go)
    });
    let parent = Function::new("parent").on_event("p/start").retries(0).handler(|ctx: Ctx, _: ()| async move {
        let out: Result<String, durastep::ChildError> =
            ctx.invoke("child", durastep::Invoke::function("gate").timeout(Duration::from_secs(7200))).await?;
        Ok(out.map_err(|e| e.to_string()))
    });
    let engine = keyed_engine(&opts, Keyring::new("k1", [7; 32]), vec![token_flow(), gate, parent]).await;
    let worker = common::spawn_worker(&engine);
    // A finished run whose sealed output the attacker copies.
    let victim = engine.send(Event::new("token/rotate", "act_1")).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, victim).await.state, RunState::Completed);
    let p = engine.send(Event::new("p/start", &())).await.unwrap().run_ids[0];
    common::wait_for_run_where(&engine, p, "waiting", |r| r.state == RunState::Waiting).await;
    sqlx::query(
        "WITH s AS (INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
                    SELECT $1, 'child', jsonb_build_object('child_run_id', v.id, 'state', 'completed',
                                                           'output', v.output, 'error', NULL), 0
                      FROM durastep.runs v WHERE v.id = $2)
         UPDATE durastep.runs SET state = 'queued', run_at = durastep.now() WHERE id = $1",
    )
    .bind(p)
    .bind(victim)
    .execute(engine.pool())
    .await
    .unwrap();
    let run = common::finished(&engine, p).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Failed, "the transplanted output was accepted: {run:?}");
    assert!(run.last_error.as_deref().unwrap_or_default().contains("does not authenticate"), "{run:?}");
}

/// A child's outcome reaches its parent with encryption on, and the parent's
/// record of it is stored sealed (kind `child`) once the parent has read it.
#[sqlx::test(migrations = false)]
async fn child_outcomes_are_delivered_and_sealed(_p: PgPoolOptions, opts: PgConnectOptions) {
    let child = Function::new("child-secret").handler(|_ctx: Ctx, n: u32| async move { Ok(format!("secret-{n}")) });
    let parent = Function::new("parent").on_event("p/start").retries(0).handler(|ctx: Ctx, _: ()| async move {
        let out: Result<String, durastep::ChildError> = ctx
            .invoke("child", durastep::Invoke::function("child-secret").input(&7u32).timeout(Duration::from_secs(600)))
            .await?;
        Ok(out.map_err(|e| e.to_string()))
    });
    let engine = keyed_engine(&opts, Keyring::new("k1", [7; 32]), vec![child, parent]).await;
    let worker = common::spawn_worker(&engine);
    let p = engine.send(Event::new("p/start", &())).await.unwrap().run_ids[0];
    let run = common::finished(&engine, p).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(serde_json::json!({"Ok": "secret-7"})));
    let stored: String =
        sqlx::query_scalar("SELECT output::text FROM durastep.step_results WHERE run_id = $1 AND step_key = 'child'")
            .bind(p)
            .fetch_one(engine.pool())
            .await
            .unwrap();
    assert!(!stored.contains("secret-7") && stored.contains(r#""$durastep": "sealed""#), "{stored}");
}

/// Catches: `Engine::run` returned the stored envelope as the run's output
/// when it did not open (tampered, moved), as if it were the output.
#[sqlx::test(migrations = false)]
async fn engine_run_fails_loudly_when_the_output_does_not_open(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, Keyring::new("k1", [7; 32])).await;
    let a = run_once(&engine, "act_1").await;
    let b = run_once(&engine, "act_2").await;
    assert_eq!((a.state, b.state), (RunState::Completed, RunState::Completed));
    sqlx::query("UPDATE durastep.runs SET output = (SELECT output FROM durastep.runs WHERE id = $1) WHERE id = $2")
        .bind(a.id)
        .bind(b.id)
        .execute(engine.pool())
        .await
        .unwrap();
    match engine.run(b.id).await {
        Err(durastep::Error::Codec { run_id, error }) => {
            assert_eq!(run_id, b.id);
            assert_eq!(error, durastep::CodecError::Tampered);
        }
        other => panic!("expected a codec error, got {other:?}"),
    }
}

/// Catches: without a keyring, a step output that happened to look like an
/// envelope (`{"$sealed": "xchacha20poly1305", ...}`) was taken for one on
/// replay, and the run failed with "no keyring is configured".
#[sqlx::test(migrations = false)]
async fn without_a_keyring_envelope_lookalikes_are_user_data(_p: PgPoolOptions, opts: PgConnectOptions) {
    let lookalike = serde_json::json!({"$sealed": "xchacha20poly1305", "kid": "k1", "nonce": "AA==", "ct": "AA=="});
    let engine_like = serde_json::json!({"$durastep": "sealed", "v": 2, "kid": "k1", "nonce": "", "ct": ""});
    let f = {
        let (a, b) = (lookalike.clone(), engine_like.clone());
        Function::new("echo").on_event("e").retries(1).backoff(durastep::Backoff::Fixed(Duration::ZERO)).handler(
            move |ctx: Ctx, _: ()| {
                let (a, b) = (a.clone(), b.clone());
                async move {
                    let x: serde_json::Value = ctx.step("a", || async move { Ok(a) }).await?;
                    let y: serde_json::Value = ctx.step("b", || async move { Ok(b) }).await?;
                    if ctx.attempt() == 1 {
                        // Fail once so the second attempt replays both stored outputs.
                        return Err(durastep::HandlerError::new("once"));
                    }
                    Ok(serde_json::json!([x, y]))
                }
            },
        )
    };
    let engine = common::engine(&opts, vec![f]).await;
    let run_id = engine.send(Event::new("e", &())).await.unwrap().run_ids[0];
    let worker = common::spawn_worker(&engine);
    let run = common::finished(&engine, run_id).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 2);
    assert_eq!(run.output, Some(serde_json::json!([lookalike, engine_like])));
}
