//! Encrypted step outputs: nothing readable at rest, bound to run and step, key rotation.

mod common;

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
