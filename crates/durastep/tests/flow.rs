//! Flow control in one process (two engines, two workers): concurrency per key
//! and shared by name, throttle, rate limit, back-pressure, priority, debounce,
//! singleton, visibility, and the typed errors for bad keys. Every check is SQL
//! over a side table the handlers write (`flow_ledger`: one row per attempt, with
//! its start and end), not what the engine reports. The multi-process version of
//! the concurrency test is `durastep-testkit/tests/flow_processes.rs`.

mod common;

use std::time::Duration;

use common::*;
use durastep::{Ctx, Engine, Error, Event, Function, HandlerError, RunState, SingletonMode};
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

/// The most starts of one key in any window of `period` (by the database clock,
/// which the tests move): for each start s, the starts in [s, s + period). A
/// start is the claim that started the run (`runs.started_at`, the claim
/// statement's `durastep.now()`), not the moment its handler got to run, which
/// lags behind on a loaded machine while the test moves the clock on.
async fn max_starts_in_window(pool: &PgPool, function: &str, period: Duration) -> Vec<(String, i64)> {
    sqlx::query_as(
        "WITH s AS (SELECT DISTINCT l.run_id, l.key, r.started_at AS t FROM flow_ledger l
                      JOIN durastep.runs r ON r.id = l.run_id WHERE l.function_id = $1)
         SELECT a.key, max((SELECT count(*) FROM s b
                             WHERE b.key = a.key AND b.t >= a.t
                               AND b.t < a.t + make_interval(secs => $2)))::bigint
           FROM s a GROUP BY a.key ORDER BY a.key",
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

/// Waits until no run of `function` is running or due: everything the clock
/// allows has started (and the handlers here finish at once).
async fn quiescent(pool: &PgPool, function: &str) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let busy: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM durastep.runs WHERE function_id = $1
                AND (state = 'running' OR (state IN ('queued', 'sleeping') AND run_at <= durastep.now()))",
        )
        .bind(function)
        .fetch_one(pool)
        .await
        .expect("busy runs");
        if busy == 0 {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{busy} runs of {function} still busy");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Moves the database clock in `step`s until every run of `function` is finished.
async fn drive_clock(engine: &Engine, pool: &PgPool, function: &str, step: Duration, max_steps: usize) {
    for _ in 0..max_steps {
        quiescent(pool, function).await;
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM durastep.runs WHERE function_id = $1 AND state IN ('queued', 'running', 'sleeping')",
        )
        .bind(function)
        .fetch_one(pool)
        .await
        .unwrap();
        if open == 0 {
            return;
        }
        durastep::testing::advance_clock(engine, step).await.unwrap();
    }
    panic!("runs of {function} did not finish within {max_steps} clock steps");
}

#[sqlx::test(migrations = false)]
async fn throttle_never_exceeds_limit_plus_burst_in_any_window_and_drops_nothing(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    // 3 per 9 s with a burst of 1: at most 4 starts in any 9 s window; one every 3 s once the burst is spent.
    let period = Duration::from_secs(9);
    let f = handler(builder("linkedin", "budget").throttle(3, period, 1, Some("/k")), pool.clone(), Duration::ZERO);
    let e = engine(&opts, vec![f]).await;
    // One at a time, so that arrival order is defined (distinct due times).
    let mut runs = Vec::new();
    for n in 0..12 {
        runs.extend(send_all(&e, vec![Event::new("budget", &json!({"k": "acct-a", "n": n}))]).await);
    }
    runs.extend(
        send_all(&e, (0..4).map(|n| Event::new("budget", &json!({"k": "acct-b", "n": 100 + n}))).collect()).await,
    );
    let w = spawn_worker(&e);
    quiescent(&pool, "linkedin").await;
    // Visible: a throttled run says what it waits for and when it can start.
    let parked = runs[5];
    let wait = e.run(parked).await.unwrap().flow_wait.expect("a throttled run is parked");
    assert_eq!((wait.kind.as_str(), wait.key.as_str()), ("throttle", "acct-a"));
    assert!(wait.next_possible_start.unwrap() > durastep::testing::db_now(&e).await.unwrap());
    drive_clock(&e, &pool, "linkedin", Duration::from_secs(1), 120).await;
    w.stop().await;

    assert_eq!(states(&pool, "linkedin").await.get("completed"), Some(&16), "nothing dropped");
    let windows = max_starts_in_window(&pool, "linkedin", period).await;
    assert_eq!(windows, vec![("acct-a".into(), 4), ("acct-b".into(), 4)], "most starts in any {period:?} window");
    // Waiting runs are claimed in arrival order (the burst's two in one claim: one claim time).
    let order: Vec<i64> = sqlx::query_scalar(
        "SELECT l.n FROM flow_ledger l JOIN durastep.runs r ON r.id = l.run_id
          WHERE l.key = 'acct-a' ORDER BY r.started_at, l.n",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(order, (0..12).collect::<Vec<i64>>());
    // Spacing after the burst: claims 3 s apart by the database clock (the clock moves in 1 s steps).
    let gaps: Vec<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM r.started_at - lag(r.started_at) OVER (ORDER BY r.started_at, r.id))::float8
           FROM flow_ledger l JOIN durastep.runs r ON r.id = l.run_id
          WHERE l.key = 'acct-a' ORDER BY r.started_at, r.id OFFSET 2",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(gaps.iter().all(|g| *g >= 2.99), "starts closer than 3 s: {gaps:?}");
}

#[sqlx::test(migrations = false)]
async fn rate_limit_skips_the_excess_and_runs_everything_else(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    // 2 per 10 s: starts at least 5 s apart; a run over the limit is skipped, not delayed.
    let period = Duration::from_secs(10);
    let f = handler(builder("refresh", "stale").rate_limit(2, period, Some("/k")), pool.clone(), Duration::ZERO);
    let e = engine(&opts, vec![f]).await;
    let w = spawn_worker(&e);
    let burst =
        |n: usize, key: &str| (0..n).map(|i| Event::new("stale", &json!({"k": key, "n": i}))).collect::<Vec<_>>();
    let mut expect_skipped = 0;
    // t = 0: six for a (one runs, five skipped), one for b (runs).
    let mut runs = send_all(&e, burst(6, "a")).await;
    runs.extend(send_all(&e, burst(1, "b")).await);
    expect_skipped += 5;
    wait_all_finished(&e, &runs, DEADLINE).await;
    // t = 5 s: three for a (one runs); t = 7 s: one (skipped, the next start is at 10 s); t = 10 s: one (runs).
    durastep::testing::advance_clock(&e, Duration::from_secs(5)).await.unwrap();
    runs.extend(send_all(&e, burst(3, "a")).await);
    expect_skipped += 2;
    wait_all_finished(&e, &runs, DEADLINE).await;
    durastep::testing::advance_clock(&e, Duration::from_secs(2)).await.unwrap();
    runs.extend(send_all(&e, burst(1, "a")).await);
    expect_skipped += 1;
    wait_all_finished(&e, &runs, DEADLINE).await;
    durastep::testing::advance_clock(&e, Duration::from_secs(3)).await.unwrap();
    runs.extend(send_all(&e, burst(1, "a")).await);
    wait_all_finished(&e, &runs, DEADLINE).await;
    w.stop().await;

    let st = states(&pool, "refresh").await;
    assert_eq!(st.get("skipped"), Some(&expect_skipped), "{st:?}");
    assert_eq!(st.get("completed"), Some(&(runs.len() as i64 - expect_skipped)), "everything else ran: {st:?}");
    let windows = max_starts_in_window(&pool, "refresh", period).await;
    assert_eq!(windows, vec![("a".into(), 2), ("b".into(), 1)]);
    let skipped =
        sqlx::query_scalar::<_, String>("SELECT last_error FROM durastep.runs WHERE state = 'skipped' LIMIT 1")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(skipped.starts_with("rate limit refresh#rate_limit1: over 2 per 10 s for key a"), "{skipped}");
    let ran_skipped: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM flow_ledger l JOIN durastep.runs r ON r.id = l.run_id WHERE r.state = 'skipped'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(ran_skipped, 0, "a skipped run never started");
}

#[sqlx::test(migrations = false)]
async fn a_429_pauses_the_whole_key_for_every_function_that_shares_it(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    let tripped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Two functions share the back-pressure key of one LinkedIn account. No retries
    // at all: a back-pressure delay must not use one up.
    let make = |id: &'static str, event: &'static str| {
        let (pool, tripped) = (pool.clone(), tripped.clone());
        Function::new(id).on_event(event).retries(0).backpressure_shared("linkedin-writes", Some("/account")).handler(
            move |ctx: Ctx, e: Value| {
                let (pool, tripped) = (pool.clone(), tripped.clone());
                async move {
                    let key = e["account"].as_str().unwrap_or_default().to_owned();
                    let row = begin(&pool, &ctx, &key, e["n"].as_i64().unwrap_or(0)).await;
                    end(&pool, row).await;
                    if key == "K" && !tripped.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        return Err(HandlerError::retry_after("429 Too Many Requests", Duration::from_secs(30)));
                    }
                    Ok(())
                }
            },
        )
    };
    let e = engine(&opts, vec![make("budget", "budget"), make("bid", "bid")]).await;
    let w = spawn_worker(&e);
    let first = e.send(Event::new("budget", &json!({"account": "K", "n": 0}))).await.unwrap().run_ids[0];
    let run = wait_for_run_where(&e, first, "the 429", |r| r.last_error.is_some()).await;
    assert_eq!((run.state, run.attempt), (RunState::Queued, 1), "the 429 did not use up an attempt: {run:?}");
    let paused_until: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT paused_until FROM durastep.flow_keys WHERE rule = 'linkedin-writes' AND key = 'K'")
            .fetch_one(&pool)
            .await
            .unwrap();

    let mut later = Vec::new();
    for (i, (event, account)) in
        [("budget", "K"), ("bid", "K"), ("budget", "J"), ("bid", "J"), ("bid", "K")].iter().enumerate()
    {
        later.extend(send_all(&e, vec![Event::new(*event, &json!({"account": account, "n": i + 1}))]).await);
    }
    // Other keys keep running; K's runs, of both functions, wait.
    for id in &later[2..4] {
        assert_eq!(finished(&e, *id).await.state, RunState::Completed);
    }
    for id in [later[0], later[1], later[4]] {
        let run = wait_for_run_where(&e, id, "a K run to be parked", |r| r.flow_wait.is_some()).await;
        let wait = run.flow_wait.unwrap();
        assert_eq!((wait.kind.as_str(), wait.key.as_str()), ("backpressure", "K"));
        assert_eq!(wait.next_possible_start, Some(paused_until));
    }
    stays(&e, later[0], Duration::from_millis(300), "queued", |r| r.state == RunState::Queued).await;
    // The database clock moves past the pause (nobody waits 30 s): everything finishes.
    durastep::testing::advance_clock(&e, Duration::from_secs(31)).await.unwrap();
    for id in std::iter::once(first).chain(later.iter().copied()) {
        assert_eq!(finished(&e, id).await.state, RunState::Completed, "{id}");
    }
    w.stop().await;
    // No attempt on K started before the pause ended, except the one that got the 429.
    let early: i64 = sqlx::query_scalar("SELECT count(*) FROM flow_ledger WHERE key = 'K' AND db_started < $1")
        .bind(paused_until)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(early, 1, "only the attempt that got the 429 started before {paused_until}");
    assert_eq!(e.run(first).await.unwrap().attempt, 1);
}

#[sqlx::test(migrations = false)]
async fn higher_priority_runs_start_first_including_priority_from_the_event(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    let one_at_a_time = durastep::WorkerOptions { max_in_flight: 1, claim_batch: 1, ..fast_options() };
    let sent = handler(builder("sent-priority", "p"), pool.clone(), Duration::ZERO);
    let from_event = handler(builder("event-priority", "q").priority_from("/urgency"), pool.clone(), Duration::ZERO);
    let e = engine_with(&opts, vec![sent, from_event], one_at_a_time).await;
    // Low priority first (earlier due times), then high: high must still start first.
    for n in 0..4 {
        e.send(Event::new("p", &json!({"n": n}))).await.unwrap();
    }
    for n in 10..14 {
        e.send(Event::new("p", &json!({"n": n})).priority(5)).await.unwrap();
    }
    // Priority from the data: urgency 3, 1, 2 (and one without: the sent priority, 0).
    for (n, urgency) in [(20, json!(3)), (21, json!(1)), (22, json!(2)), (23, json!("high"))] {
        e.send(Event::new("q", &json!({"n": n, "urgency": urgency}))).await.unwrap();
    }
    let w = spawn_worker(&e);
    wait_until("all ran", || async { count(&e, "flow_ledger").await == 12 }).await;
    w.stop().await;
    let order: Vec<i64> = sqlx::query_scalar("SELECT n FROM flow_ledger ORDER BY id").fetch_all(&pool).await.unwrap();
    let rank = |n: i64| order.iter().position(|&x| x == n).unwrap();
    assert!(order[..4].iter().all(|n| (10..14).contains(n)), "priority 5 first: {order:?}");
    assert!(rank(20) < rank(22) && rank(22) < rank(21), "urgency 3, 2, 1: {order:?}");
    assert!(order[4..].iter().take_while(|n| [20, 21, 22].contains(n)).count() == 3, "{order:?}");
}

#[sqlx::test(migrations = false)]
async fn debounce_runs_once_with_the_latest_event_within_max_wait(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    let f = handler(
        builder("resync", "changed").debounce(Duration::from_secs(10), Some("/k"), Duration::from_secs(25)),
        pool.clone(),
        Duration::ZERO,
    );
    let e = engine(&opts, vec![f]).await;
    let w = spawn_worker(&e);
    let tick = |s: u64| durastep::testing::advance_clock(&e, Duration::from_secs(s));
    // A burst of three events 4 s apart: one run, with the third event, 10 s after it.
    let mut ids = Vec::new();
    for n in 1..=3 {
        ids.extend(e.send(Event::new("changed", &json!({"k": "a", "n": n}))).await.unwrap().run_ids);
        if n < 3 {
            tick(4).await.unwrap();
        }
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one run for the burst: {ids:?}");
    let run = ids[0];
    tick(9).await.unwrap();
    stays(&e, run, Duration::from_millis(300), "queued 9 s after the last event", |r| r.state == RunState::Queued)
        .await;
    tick(1).await.unwrap();
    let done = finished(&e, run).await;
    assert_eq!(done.output, Some(json!(3)), "the latest event's data");

    // Events every 4 s without pause: max_wait (25 s after the first) still starts it.
    let first_at = durastep::testing::db_now(&e).await.unwrap();
    let mut b = Vec::new();
    for n in 0..7 {
        b.extend(e.send(Event::new("changed", &json!({"k": "b", "n": n}))).await.unwrap().run_ids);
        if n < 6 {
            tick(4).await.unwrap();
        }
    }
    b.dedup();
    assert_eq!(b.len(), 1, "{b:?}");
    let queued = e.run(b[0]).await.unwrap();
    assert_eq!(queued.state, RunState::Queued);
    let due_after = (queued.run_at - first_at).num_milliseconds();
    assert!((24_900..=25_100).contains(&due_after), "due {due_after} ms after the first event, not 25 s");
    tick(1).await.unwrap();
    assert_eq!(finished(&e, b[0]).await.output, Some(json!(6)));
    w.stop().await;
    assert_eq!(count(&e, "flow_ledger").await, 2, "two bursts, two attempts");
    assert_eq!(count(&e, "durastep.runs").await, 2);
}

#[sqlx::test(migrations = false)]
async fn singleton_skips_the_new_run_or_cancels_the_old_one(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    // A run whose event says "hold" waits at its gate; `dropped` opens when its handler is dropped.
    let make = |id: &'static str, mode: SingletonMode, gate: Gate, dropped: Gate| {
        Function::new(id).on_event(id).singleton(Some("/k"), mode).handler(move |_ctx: Ctx, e: Value| {
            let (gate, dropped) = (gate.clone(), dropped.clone());
            async move {
                if e["hold"] == true {
                    let _guard = OpenOnDrop(dropped);
                    gate.wait().await;
                }
                Ok(e["n"].clone())
            }
        })
    };
    let (skip_gate, cancel_gate, cancel_dropped) = (Gate::new(), Gate::new(), Gate::new());
    let e = engine(
        &opts,
        vec![
            make("skip", SingletonMode::SkipNew, skip_gate.clone(), Gate::new()),
            make("cancel", SingletonMode::CancelOld, cancel_gate.clone(), cancel_dropped.clone()),
        ],
    )
    .await;
    let w = spawn_worker(&e);
    let send = |name: &'static str, v: Value| {
        let e = e.clone();
        async move { e.send(Event::new(name, &v)).await.unwrap().run_ids[0] }
    };

    // Skip the new one: the active run of key a goes on; a second event for a is skipped.
    let old = send("skip", json!({"k": "a", "n": 1, "hold": true})).await;
    wait_for_run_where(&e, old, "the first run to start", |r| r.state == RunState::Running).await;
    let new = send("skip", json!({"k": "a", "n": 2})).await;
    let skipped = e.run(new).await.unwrap();
    assert_eq!(skipped.state, RunState::Skipped, "{skipped:?}");
    assert!(skipped.last_error.as_deref().unwrap_or_default().contains("singleton"), "{skipped:?}");
    let other = send("skip", json!({"k": "b", "n": 3})).await;
    assert_eq!(finished(&e, other).await.state, RunState::Completed, "another key is not affected");
    skip_gate.open();
    assert_eq!(finished(&e, old).await.output, Some(json!(1)));
    let again = send("skip", json!({"k": "a", "n": 4})).await;
    assert_eq!(finished(&e, again).await.output, Some(json!(4)), "no active run: a new one starts");

    // Cancel the old one: a new event for a cancels the running run (its worker
    // drops the handler at its next heartbeat) and the new run starts.
    let old = send("cancel", json!({"k": "a", "n": 5, "hold": true})).await;
    wait_for_run_where(&e, old, "the old run to start", |r| r.state == RunState::Running).await;
    let new = send("cancel", json!({"k": "a", "n": 6})).await;
    let cancelled = e.run(old).await.unwrap();
    assert_eq!(cancelled.state, RunState::Cancelled, "cancelled by the send itself: {cancelled:?}");
    assert_eq!(finished(&e, new).await.output, Some(json!(6)));
    cancel_dropped.reached("the cancelled run's handler to be dropped").await;
    cancel_gate.open();
    w.stop().await;
    let cancelled = e.run(old).await.unwrap();
    assert_eq!((cancelled.state, cancelled.output), (RunState::Cancelled, None), "the old run wrote nothing more");
    let active: i64 = count(&e, "durastep.runs WHERE function_id = 'cancel' AND state = 'completed'").await;
    assert_eq!(active, 1);
}
