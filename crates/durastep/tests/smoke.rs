//! Smoke test: a multi-step run with a retry, end to end.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Backoff, Ctx, Event, Function, HandlerError, RunState};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn three_steps_and_a_retry(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let first = Arc::new(AtomicU32::new(0));
    let flaky = Arc::new(AtomicU32::new(0));
    let (f1, f2) = (first.clone(), flaky.clone());
    let f = Function::new("smoke").on_event("smoke/go").backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, n: u32| {
            let (f1, f2) = (f1.clone(), f2.clone());
            async move {
                let a: u32 = ctx
                    .step("one", || async {
                        f1.fetch_add(1, Ordering::SeqCst);
                        Ok(n + 1)
                    })
                    .await?;
                let b: u32 = ctx
                    .step("two", || async {
                        if f2.fetch_add(1, Ordering::SeqCst) == 0 {
                            return Err(HandlerError::new("flaky"));
                        }
                        Ok(a * 10)
                    })
                    .await?;
                Ok(b + 1)
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let receipt = engine.send(Event::new("smoke/go", &4u32)).await.unwrap();
    let w = common::spawn_worker(&engine);
    let run = engine.wait_for_run(receipt.run_ids[0], Duration::from_secs(10)).await.unwrap();
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(serde_json::json!(51)));
    assert_eq!(first.load(Ordering::SeqCst), 1);
    assert_eq!(flaky.load(Ordering::SeqCst), 2);
    assert_eq!(run.attempt, 2);
}

/// Catches: an engine that needs (or forces) a JIT setting on its sessions, or
/// a function losing its own `jit = off` (or `send_events` its own generic
/// plan, migration 0022). With JIT on, Postgres compiled every
/// execution of the two statements whose plans are costed above
/// `jit_above_cost` (a 1,000-event `send_batch`: 1.6 s; a prune batch at
/// 700,000 finished runs: 180 functions each, docs/performance.md); both are
/// functions that carry `jit = off`, and a probe of every other statement on a
/// database of a million runs with JIT on found none compiled. So the engine's
/// pools keep the server's settings.
#[sqlx::test(migrations = false)]
async fn statements_need_no_jit_setting_of_the_pool(_p: PgPoolOptions, opts: PgConnectOptions) {
    let url = format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("postgres")
    );
    let engine = durastep::Engine::builder().database_url(url).build().await.expect("build");
    // What a session of this server gets without any option.
    let plain = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.unwrap();
    let server_default: String = sqlx::query_scalar("SHOW jit").fetch_one(&plain).await.unwrap();
    let jit: String = sqlx::query_scalar("SHOW jit").fetch_one(engine.pool()).await.unwrap();
    assert_eq!(jit, server_default, "the engine changed the session's JIT setting");
    let carry: Vec<(String, Option<Vec<String>>)> = sqlx::query_as(
        "SELECT proname::text, proconfig FROM pg_proc
          WHERE pronamespace = 'durastep'::regnamespace
            AND proname IN ('send_events', 'send_events_full', 'prune_batch')
          ORDER BY proname",
    )
    .fetch_all(engine.pool())
    .await
    .unwrap();
    assert_eq!(carry.len(), 3, "{carry:?}");
    for (name, config) in carry {
        let config = config.unwrap_or_default();
        assert!(config.iter().any(|c| c == "jit=off"), "{name} lost its own jit = off");
        // A later `CREATE OR REPLACE` of a send function without it would drop
        // it: every send would plan its statement again (migrations 0022, 0023).
        if name.starts_with("send_events") {
            assert!(
                config.iter().any(|c| c == "plan_cache_mode=force_generic_plan"),
                "{name} lost its own generic plan: {config:?}"
            );
        }
    }
}

/// Catches: a refused database that is reported only after the pool's acquire
/// timeout, as "pool timed out", instead of at once with the real cause.
#[tokio::test]
async fn an_unreachable_database_fails_the_build_at_once_with_its_cause() {
    let started = std::time::Instant::now();
    let err =
        durastep::Engine::builder().database_url("postgres://postgres@127.0.0.1:1/none").build().await.unwrap_err();
    assert!(matches!(err, durastep::Error::Unavailable(_)), "{err:?}");
    assert!(started.elapsed() < std::time::Duration::from_secs(3), "took {:?}", started.elapsed());
    assert!(err.to_string().to_lowercase().contains("refused"), "{err}");
}

/// Catches: engines that start at once on a fresh database racing each other's
/// migrations (docs/operations.md promises concurrent starts are safe).
#[sqlx::test(migrations = false)]
async fn engines_starting_at_once_migrate_once(
    _p: sqlx::postgres::PgPoolOptions,
    opts: sqlx::postgres::PgConnectOptions,
) {
    let url = common::url_of(&opts);
    let builds = (0..6).map(|_| {
        let url = url.clone();
        tokio::spawn(async move { durastep::Engine::builder().database_url(url).max_connections(2).build().await })
    });
    for b in builds {
        b.await.unwrap().expect("every concurrent build succeeds");
    }
    let engine = common::engine(&opts, vec![]).await;
    let applied: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durastep._migrations").fetch_one(engine.pool()).await.unwrap();
    let shipped = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../../migrations")).unwrap().count() as i64;
    assert_eq!(applied, shipped);
}

/// Catches: pool options that hand out a connection the server has closed
/// while it sat idle (the ping before each statement is gone: a connection
/// idle for `IDLE_PING_AFTER` is still pinged and replaced when dead).
#[sqlx::test(migrations = false)]
async fn a_connection_closed_while_idle_is_replaced_before_use(_p: PgPoolOptions, opts: PgConnectOptions) {
    let pool = durastep::pool_options().max_connections(1).connect_with(opts.clone()).await.unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&pool).await.unwrap();
    let plain = PgPoolOptions::new().max_connections(1).connect_with(opts).await.unwrap();
    let ended: bool =
        sqlx::query_scalar("SELECT pg_terminate_backend($1, 5000)").bind(pid).fetch_one(&plain).await.unwrap();
    assert!(ended, "the pool's connection was not terminated");
    tokio::time::sleep(durastep::IDLE_PING_AFTER + std::time::Duration::from_millis(100)).await;
    let now: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&pool).await.expect("a fresh connection");
    assert_ne!(now, pid, "the statement ran on the closed connection");
}

/// Catches: connections that send with Nagle's algorithm on. sqlx 0.9.0
/// stopped setting `TCP_NODELAY` (0.9.1 sets it again): then the tail of
/// every statement longer than a TCP segment (a group commit of a few
/// hundred checkpoints, a batch send) waited for the server's delayed ACK,
/// 40 ms or more on Linux, and the 256-in-flight matrix ran at half speed
/// (docs/performance.md "Nagle's algorithm"). With Nagle on, every one of
/// these round trips stalls, so the fastest of ten tells, however busy the
/// machine is.
#[sqlx::test(migrations = false)]
async fn a_statement_longer_than_a_tcp_segment_does_not_wait_for_a_delayed_ack(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let pool = durastep::pool_options().max_connections(1).connect_with(opts).await.unwrap();
    let port: Option<i32> = sqlx::query_scalar("SELECT inet_client_port()").fetch_one(&pool).await.unwrap();
    assert!(port.is_some(), "this test needs the database over TCP, not a Unix socket");
    for bytes in [100_000, 200_000, 400_000] {
        let value = "x".repeat(bytes);
        let mut fastest = Duration::MAX;
        for _ in 0..10 {
            let started = std::time::Instant::now();
            let n: i32 = sqlx::query_scalar("SELECT length($1)").bind(&value).fetch_one(&pool).await.unwrap();
            fastest = fastest.min(started.elapsed());
            assert_eq!(n as usize, bytes);
        }
        assert!(
            fastest < Duration::from_millis(30),
            "a {bytes}-byte statement took at least {fastest:?} in ten tries: its tail waited for a delayed ACK"
        );
    }
}
