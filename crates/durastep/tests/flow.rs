//! Flow control in one process (two engines, two workers): concurrency per key
//! and shared by name, throttle, rate limit, back-pressure, priority, debounce,
//! singleton, visibility, and the typed errors for bad keys. Every check is SQL
//! over a side table the handlers write (`flow_ledger`: one row per attempt, with
//! its start and end), not what the engine reports. The multi-process version of
//! the concurrency test is `durastep-testkit/tests/flow_processes.rs`.

mod common;

use std::time::Duration;

use common::*;
use durastep::{Ctx, Engine, Error, Event, Function, HandlerError, RunState};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const KEYS: [&str; 3] = ["x", "y", "z"];

const LEDGER: &str = "CREATE TABLE IF NOT EXISTS flow_ledger (
    id bigserial PRIMARY KEY, run_id uuid NOT NULL, function_id text NOT NULL, key text NOT NULL,
    n bigint, attempt int NOT NULL, started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    db_started timestamptz NOT NULL DEFAULT durastep.now(), ended_at timestamptz)";

/// The attempt's start, recorded on the handler's own pool (outside any checkpoint).
async fn begin(pool: &PgPool, ctx: &Ctx, key: &str, n: i64) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO flow_ledger (run_id, function_id, key, n, attempt) VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(ctx.run_id())
    .bind(ctx.function_id())
    .bind(key)
    .bind(n)
    .bind(ctx.attempt() as i32)
    .fetch_one(pool)
    .await
    .expect("ledger begin")
}

async fn end(pool: &PgPool, id: i64) {
    sqlx::query("UPDATE flow_ledger SET ended_at = clock_timestamp() WHERE id = $1")
        .bind(id)
        .execute(pool)
        .await
        .expect("ledger end");
}

/// The most attempts that executed at once, per key, over `functions`: a sweep
/// over the recorded [start, end) intervals (an end sorts before a start at the
/// same instant).
async fn max_overlap(pool: &PgPool, functions: &[&str]) -> Vec<(String, i64)> {
    sqlx::query_as(
        "WITH ev AS (SELECT key, started_at AS t, 1 AS d FROM flow_ledger WHERE function_id = ANY ($1)
                     UNION ALL SELECT key, ended_at, -1 FROM flow_ledger WHERE function_id = ANY ($1))
         SELECT key, max(c)::bigint FROM (
             SELECT key, sum(d) OVER (PARTITION BY key ORDER BY t, d ROWS UNBOUNDED PRECEDING) AS c FROM ev) x
          GROUP BY key ORDER BY key",
    )
    .bind(functions.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    .fetch_all(pool)
    .await
    .expect("overlap sweep")
}

/// The most attempt starts of one key in any window of `period` (by the database
/// clock, which the tests move): for each start s, the starts in [s, s + period).
#[allow(dead_code)] // used by the throttle and rate-limit tests
async fn max_starts_in_window(pool: &PgPool, function: &str, period: Duration) -> Vec<(String, i64)> {
    sqlx::query_as(
        "SELECT a.key, max((SELECT count(*) FROM flow_ledger b
                             WHERE b.function_id = a.function_id AND b.key = a.key
                               AND b.db_started >= a.db_started
                               AND b.db_started < a.db_started + make_interval(secs => $2)))::bigint
           FROM flow_ledger a WHERE a.function_id = $1 GROUP BY a.key ORDER BY a.key",
    )
    .bind(function)
    .bind(period.as_secs_f64())
    .fetch_all(pool)
    .await
    .expect("window count")
}

async fn states(pool: &PgPool, function: &str) -> std::collections::HashMap<String, i64> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, count(*) FROM durastep.runs WHERE function_id = $1 GROUP BY state")
            .bind(function)
            .fetch_all(pool)
            .await
            .expect("states");
    rows.into_iter().collect()
}

async fn ledger_pool(opts: &PgConnectOptions) -> PgPool {
    let pool = PgPoolOptions::new().max_connections(8).connect_with(opts.clone()).await.expect("connect");
    durastep::migrate(&pool).await.expect("migrate");
    sqlx::query(LEDGER).execute(&pool).await.expect("ledger");
    pool
}

/// The start of a test function's definition (3 retries, 20 ms backoff).
fn builder(id: &str, event: &str) -> durastep::FunctionBuilder {
    Function::new(id).on_event(event).retries(3).backoff(durastep::Backoff::Fixed(Duration::from_millis(20)))
}

/// Finishes a definition: each attempt records itself, sleeps `hold`, and returns the event's `n`.
fn handler(b: durastep::FunctionBuilder, pool: PgPool, hold: Duration) -> Function {
    b.handler(move |ctx: Ctx, e: Value| {
        let pool = pool.clone();
        async move {
            let key =
                e.get("k").map(|k| k.as_str().map(str::to_owned).unwrap_or_else(|| k.to_string())).unwrap_or_default();
            let n = e.get("n").and_then(Value::as_i64).unwrap_or(0);
            let row = begin(&pool, &ctx, &key, n).await;
            tokio::time::sleep(hold).await;
            end(&pool, row).await;
            Ok(n)
        }
    })
}

async fn wait_all_finished(engine: &Engine, runs: &[Uuid], within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let left: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM durastep.runs WHERE id = ANY ($1) AND state NOT IN ('completed', 'failed', 'cancelled', 'skipped')",
        )
        .bind(runs)
        .fetch_one(engine.pool())
        .await
        .expect("count unfinished");
        if left == 0 {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{left} runs still unfinished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn send_all(engine: &Engine, events: Vec<Event>) -> Vec<Uuid> {
    engine.send_batch(events).await.expect("send").into_iter().flat_map(|r| r.run_ids).collect()
}

#[sqlx::test(migrations = false)]
async fn concurrency_per_key_holds_with_two_workers_and_a_limit_of_two(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    let make =
        || handler(builder("meta", "budget").concurrency(2, Some("/k")), pool.clone(), Duration::from_millis(40));
    let a = engine(&opts, vec![make()]).await;
    let b = engine(&opts, vec![make()]).await;
    // Three busy keys and one key sent as a number (keys are values of any JSON type).
    let mut events: Vec<Event> = (0..60).map(|i| Event::new("budget", &json!({"k": KEYS[i % 3], "n": i}))).collect();
    events.extend((0..6).map(|i| Event::new("budget", &json!({"k": 7, "n": 100 + i}))));
    let runs = send_all(&a, events).await;
    let (wa, wb) = (spawn_worker(&a), spawn_worker(&b));
    wait_all_finished(&a, &runs, Duration::from_secs(40)).await;
    wa.stop().await;
    wb.stop().await;

    let overlap = max_overlap(&pool, &["meta"]).await;
    assert_eq!(
        overlap,
        vec![("7".into(), 2), ("x".into(), 2), ("y".into(), 2), ("z".into(), 2)],
        "max attempts at once per key"
    );
    assert_eq!(states(&pool, "meta").await.get("completed"), Some(&66));
    let in_use: i64 = sqlx::query_scalar("SELECT coalesce(sum(in_use), 0)::bigint FROM durastep.flow_keys")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(in_use, 0, "every slot was given back");
}

#[sqlx::test(migrations = false)]
async fn a_shared_limit_of_one_holds_across_two_functions(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    // Story A: every function that calls Exact Online shares one slot.
    let make = || {
        vec![
            handler(
                builder("exact-draft", "placement").concurrency_shared("exact-online", 1, None),
                pool.clone(),
                Duration::from_millis(15),
            ),
            handler(
                builder("exact-credit", "cancelled").concurrency_shared("exact-online", 1, None),
                pool.clone(),
                Duration::from_millis(15),
            ),
        ]
    };
    let a = engine(&opts, make()).await;
    let b = engine(&opts, make()).await;
    let mut events = Vec::new();
    for i in 0..25 {
        events.push(Event::new("placement", &json!({"n": i})));
        events.push(Event::new("cancelled", &json!({"n": i})));
    }
    let runs = send_all(&a, events).await;
    let (wa, wb) = (spawn_worker(&a), spawn_worker(&b));
    wait_all_finished(&a, &runs, Duration::from_secs(40)).await;
    wa.stop().await;
    wb.stop().await;
    // The key is "" for both (no key pointer): one interval set over both functions.
    assert_eq!(max_overlap(&pool, &["exact-draft", "exact-credit"]).await, vec![(String::new(), 1)]);
    assert_eq!(states(&pool, "exact-draft").await.get("completed"), Some(&25));
    assert_eq!(states(&pool, "exact-credit").await.get("completed"), Some(&25));
}

#[sqlx::test(migrations = false)]
async fn a_sleeping_run_holds_no_slot_and_retries_give_theirs_back(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    let gate = Gate::new();
    let g = gate.clone();
    let sleeper = Function::new("one-at-a-time")
        .on_event("go")
        .concurrency(1, None)
        .retries(2)
        .backoff(durastep::Backoff::Fixed(Duration::from_millis(10)))
        .handler(move |ctx: Ctx, e: Value| {
            let g = g.clone();
            async move {
                if e["kind"] == "sleep" {
                    ctx.sleep("nap", Duration::from_secs(3600)).await?;
                } else if e["kind"] == "fail-once" && ctx.attempt() == 1 {
                    return Err(HandlerError::new("boom"));
                } else if e["kind"] == "hold" {
                    g.wait().await;
                }
                Ok(())
            }
        });
    let e = engine(&opts, vec![sleeper]).await;
    let sleeping = e.send(Event::new("go", &json!({"kind": "sleep"}))).await.unwrap().run_ids[0];
    let w = spawn_worker(&e);
    wait_for_run_where(&e, sleeping, "the run to sleep", |r| r.state == RunState::Sleeping).await;
    // The only slot is free while it sleeps: a failing run retries and completes; then another runs.
    let failing = e.send(Event::new("go", &json!({"kind": "fail-once"}))).await.unwrap().run_ids[0];
    assert_eq!(finished(&e, failing).await.state, RunState::Completed);
    let held = e.send(Event::new("go", &json!({"kind": "hold"}))).await.unwrap().run_ids[0];
    wait_for_run_where(&e, held, "the holder to run", |r| r.state == RunState::Running).await;
    let blocked = e.send(Event::new("go", &json!({"kind": "plain"}))).await.unwrap().run_ids[0];
    // Visible: parked on the function-wide key, waiting for a slot.
    let run = wait_for_run_where(&e, blocked, "the run to be parked", |r| r.flow_wait.is_some()).await;
    let wait = run.flow_wait.unwrap();
    assert_eq!(
        (wait.kind.as_str(), wait.rule.as_str(), wait.key.as_str()),
        ("concurrency", "one-at-a-time#concurrency1", "")
    );
    assert_eq!(wait.next_possible_start, None);
    let view: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM durastep.run_flow_waits WHERE run_id = $1 AND \"limit\" = 1 AND in_use = 1",
    )
    .bind(blocked)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(view, 1, "the view explains the wait");
    stays(&e, blocked, Duration::from_millis(300), "queued", |r| r.state == RunState::Queued).await;
    gate.open();
    // The release wakes it at once (not after the 30 s safety net).
    assert_eq!(finished(&e, blocked).await.state, RunState::Completed);
    w.stop().await;
}

#[sqlx::test(migrations = false)]
async fn keys_are_checked_at_build_and_at_send(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let f = |key: &'static str| {
        Function::new("f").on_event("e").concurrency(2, Some(key)).handler(|_c, _e: Value| async { Ok(()) })
    };
    for bad in ["account", "/a~2", "/a~"] {
        let err = try_engine(&opts, vec![f(bad)], fast_options(), Default::default()).await.unwrap_err();
        assert!(matches!(&err, Error::InvalidFunction(m) if m.contains("function f")), "{bad}: {err}");
    }
    let three = Function::new("g")
        .on_event("e")
        .concurrency(1, None)
        .concurrency(1, None)
        .concurrency(1, None)
        .handler(|_c, _e: Value| async { Ok(()) });
    assert!(matches!(
        try_engine(&opts, vec![three], fast_options(), Default::default()).await,
        Err(Error::InvalidFunction(_))
    ));

    let e = engine(&opts, vec![f("/account/id")]).await;
    // Refused before any SQL by the engine that registers the function...
    let err = e.send(Event::new("e", &json!({"account": {}}))).await.unwrap_err();
    assert!(matches!(&err, Error::MissingKey { function, key } if function == "f" && key == "/account/id"), "{err}");
    let err = e.send(Event::new("e", &json!({"account": {"id": null}}))).await.unwrap_err();
    assert!(matches!(err, Error::MissingKey { .. }));
    // ...and by the database for an engine that does not (a process that only sends).
    let sender = engine(&opts, vec![]).await;
    let batch = vec![Event::new("e", &json!({"account": {"id": "a1"}})), Event::new("e", &json!({"nothing": 1}))];
    let err = sender.send_batch(batch).await.unwrap_err();
    assert!(matches!(&err, Error::MissingKey { function, key } if function == "f" && key == "/account/id"), "{err}");
    assert_eq!(count(&e, "durastep.events").await, 0, "a refused send writes nothing");
    let ok = sender.send(Event::new("e", &json!({"account": {"id": "a1"}}))).await.unwrap();
    assert_eq!(ok.run_ids.len(), 1);
}
