//! Flow control in one process (two engines, two workers): concurrency per key
//! and shared by name, throttle, rate limit, back-pressure, priority, debounce,
//! singleton, visibility, and the typed errors for bad keys. Every check is SQL
//! over a side table the handlers write (`flow_ledger`: one row per attempt, with
//! its start and end), not what the engine reports. The multi-process version of
//! the concurrency test is `durastep-testkit/tests/flow_processes.rs`.

mod common;

use std::time::Duration;

use common::*;
use durastep::{Ctx, Engine, Error, Event, Function, HandlerError, RunState, SingletonMode, WorkerOptions};
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

/// Every claim of a run of `function` (a start of an attempt, the thing a
/// throttle limits), with the run's key: from the run's timeline, one entry
/// per claim (state `running` under a new lease epoch), at the claim statement's
/// database time. Not when a handler got to run, which lags behind on a loaded
/// machine while the test moves the clock on, and not only a run's first claim
/// (`runs.started_at`): a run re-claimed after a lost lease is claimed again.
const CLAIMS: &str = "SELECT h.run_id, e.payload->>'k' AS key, e.payload->'n' AS n, h.at AS t
                        FROM durastep.run_timeline h
                        JOIN durastep.runs r ON r.id = h.run_id
                        JOIN durastep.events e ON e.id = r.event_id
                       WHERE r.function_id = $1 AND h.state = 'running'";

/// The most claims of one key in any window of `period` (by the database
/// clock, which the tests move): for each claim c, the claims in [c, c + period).
async fn max_starts_in_window(pool: &PgPool, function: &str, period: Duration) -> Vec<(String, i64)> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "WITH s AS ({CLAIMS})
         SELECT a.key, max((SELECT count(*) FROM s b
                             WHERE b.key = a.key AND b.t >= a.t
                               AND b.t < a.t + make_interval(secs => $2)))::bigint
           FROM s a GROUP BY a.key ORDER BY a.key"
    )))
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
    let make = || {
        handler(
            builder("meta", "budget").concurrency(durastep::Concurrency::new(2).key("/k")),
            pool.clone(),
            Duration::from_millis(40),
        )
    };
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
                builder("exact-draft", "placement").concurrency(durastep::Concurrency::new(1).shared("exact-online")),
                pool.clone(),
                Duration::from_millis(15),
            ),
            handler(
                builder("exact-credit", "cancelled").concurrency(durastep::Concurrency::new(1).shared("exact-online")),
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
        .concurrency(durastep::Concurrency::new(1))
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
    let wait = common::parked(&e, blocked, "the run to be parked").await;
    assert_eq!(
        (wait.kind.as_str(), wait.rule.as_deref(), wait.key.as_deref()),
        ("concurrency", Some("one-at-a-time#concurrency1"), Some(""))
    );
    assert_eq!((wait.in_use, wait.limit), (Some(1), Some(1)));
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

/// A run of a concurrency limit of one holds the slot in its body; the next
/// run is parked; another transaction holds the parked run's row (as a claim
/// does that read it as due before it was parked) when the slot is given
/// back. Returns the engine, its worker, the holder, the parked run, the
/// gate that ends the holder's body and the transaction holding the row.
async fn a_parked_run_held_elsewhere(
    opts: PgConnectOptions,
) -> (Engine, WorkerGuard, Uuid, Uuid, Gate, sqlx::Transaction<'static, sqlx::Postgres>) {
    let gate = Gate::new();
    let g = gate.clone();
    let f = Function::new("one").on_event("go").concurrency(durastep::Concurrency::new(1)).handler(
        move |_ctx: Ctx, e: Value| {
            let g = g.clone();
            async move {
                if e["hold"] == true {
                    g.wait().await;
                }
                Ok(())
            }
        },
    );
    let e = engine(&opts, vec![f]).await;
    let w = spawn_worker(&e);
    let holder = e.send(Event::new("go", &json!({"hold": true}))).await.unwrap().run_ids[0];
    wait_for_run_where(&e, holder, "the holder to run", |r| r.state == RunState::Running).await;
    let blocked = e.send(Event::new("go", &json!({}))).await.unwrap().run_ids[0];
    common::parked(&e, blocked, "the next run to be parked").await;
    let mut held = e.pool().begin().await.unwrap();
    sqlx::query("SELECT 1 FROM durastep.runs WHERE id = $1 FOR UPDATE")
        .bind(blocked)
        .execute(&mut *held)
        .await
        .unwrap();
    (e, w, holder, blocked, gate, held)
}

/// Waits until a statement of the test's database waits for a lock: the
/// slot's release, waiting for the parked run's row.
async fn a_release_waits_for_a_lock(e: &Engine) {
    let waiting = "pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'";
    wait_until("the slot's release to wait for the parked run", || async { count(e, waiting).await >= 1 }).await;
}

/// Moves the clock past a parked run's 30 s recheck; the run then completes.
async fn completes_after_its_recheck(e: &Engine, parked: Uuid) {
    durastep::testing::advance_clock(e, Duration::from_secs(31)).await.unwrap();
    assert_eq!(finished(e, parked).await.state, RunState::Completed);
}

/// Catches: the slot's release skipping a parked run whose row another
/// transaction holds for a moment (a claim that found it no longer due), so
/// that it stayed parked until its 30 s recheck with the key's slot free (a
/// cancel test failed that way about once in thirty runs under load).
#[sqlx::test(migrations = false)]
async fn a_slot_given_back_wakes_a_parked_run_another_transaction_holds(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    // The release waits at most half of deadlock_timeout: far beyond this test's steps.
    let opts = opts.options([("deadlock_timeout", "40s")]);
    let (e, w, holder, blocked, gate, held) = a_parked_run_held_elsewhere(opts).await;
    gate.open();
    // The worker's write that ends the holder, waiting for the row in its release.
    a_release_waits_for_a_lock(&e).await;
    assert_eq!(e.run(holder).await.unwrap().state, RunState::Running, "its completion waits");
    held.commit().await.unwrap();
    assert_eq!(finished(&e, holder).await.state, RunState::Completed);
    // Woken by the release, not by the recheck 30 s after it was parked.
    assert_eq!(finished(&e, blocked).await.state, RunState::Completed);
    w.stop().await;
}

/// Catches: the release waiting for the held row without a bound (a user's
/// transaction holding a parked run would stall the worker's writes, and a
/// statement cancelling a parked run and a running run of one key would
/// deadlock with it). It gives up after half of deadlock_timeout, the
/// attempt still ends, and the parked run is left to its recheck.
#[sqlx::test(migrations = false)]
async fn a_slot_given_back_waits_for_a_held_parked_run_only_briefly(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let opts = opts.options([("deadlock_timeout", "200ms")]);
    let (e, w, holder, blocked, gate, held) = a_parked_run_held_elsewhere(opts).await;
    gate.open();
    // The holder ends while the parked run's row is still held.
    assert_eq!(finished(&e, holder).await.state, RunState::Completed);
    held.commit().await.unwrap();
    stays(&e, blocked, Duration::from_millis(300), "parked", |r| r.state == RunState::Queued).await;
    let in_use: i64 = sqlx::query_scalar("SELECT coalesce(sum(in_use), 0)::bigint FROM durastep.flow_keys")
        .fetch_one(e.pool())
        .await
        .unwrap();
    assert_eq!(in_use, 0, "the slot was given back");
    completes_after_its_recheck(&e, blocked).await;
    w.stop().await;
}

/// Catches: the release waiting for a held parked run without a bound while
/// the holder waits for the key row the release locked (a statement that
/// cancels a key's parked run and a running run of the same key, whose own
/// release then needs that key row): a deadlock, and one of the two
/// statements fails. Here the holder is a test transaction that holds the
/// parked run and then asks for the key row, with a `deadlock_timeout` (1.5 s)
/// longer than the release's bound (1 s: half of the worker's 2 s) and
/// shorter than the worker's: the release gives up first, so when the test's
/// deadlock check runs there is no cycle, and its statement gets the row. With
/// a wait of no bound, the test's check finds the cycle and fails it.
#[sqlx::test(migrations = false)]
async fn a_slot_given_back_gives_up_a_held_parked_run_before_a_deadlock(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let opts = opts.options([("deadlock_timeout", "2s")]);
    let (e, w, holder, blocked, gate, mut held) = a_parked_run_held_elsewhere(opts).await;
    sqlx::query("SET LOCAL deadlock_timeout = '1500ms'").execute(&mut *held).await.unwrap();
    gate.open();
    a_release_waits_for_a_lock(&e).await;
    // The other half of the cycle: the key row the release holds.
    let key_row = sqlx::query("SELECT 1 FROM durastep.flow_keys WHERE rule = 'one#concurrency1' FOR UPDATE")
        .execute(&mut *held)
        .await;
    assert!(key_row.is_ok(), "the release held on past the deadlock check: {key_row:?}");
    assert_eq!(key_row.unwrap().rows_affected(), 1, "the key row was locked");
    held.commit().await.unwrap();
    assert_eq!(finished(&e, holder).await.state, RunState::Completed);
    // Given up, so the parked run waits for its recheck.
    completes_after_its_recheck(&e, blocked).await;
    w.stop().await;
}

#[sqlx::test(migrations = false)]
async fn keys_are_checked_at_build_and_at_send(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let f = |key: &'static str| {
        Function::new("f")
            .on_event("e")
            .concurrency(durastep::Concurrency::new(2).key(key))
            .handler(|_c, _e: Value| async { Ok(()) })
    };
    for bad in ["account", "/a~2", "/a~"] {
        let err = try_engine(&opts, vec![f(bad)], fast_options(), Default::default()).await.unwrap_err();
        assert!(matches!(&err, Error::InvalidFunction(m) if m.contains("function f")), "{bad}: {err}");
    }
    let three = Function::new("g")
        .on_event("e")
        .concurrency(durastep::Concurrency::new(1))
        .concurrency(durastep::Concurrency::new(1))
        .concurrency(durastep::Concurrency::new(1))
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

/// The throttle's rule is on claims, so the test measures claims (from the
/// run history, every claim, by the claim's database time), never when a
/// handler body got to run. Catches: a check that failed on a loaded machine
/// because it measured body starts, or only first claims (issue 11).
#[sqlx::test(migrations = false)]
async fn throttle_never_exceeds_limit_plus_burst_in_any_window_and_drops_nothing(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    // 3 per 9 s with a burst of 1: at most 4 starts in any 9 s window; one every 3 s once the burst is spent.
    let period = Duration::from_secs(9);
    let f = handler(
        builder("linkedin", "budget").throttle(durastep::Throttle::new(3, period).burst(1).key("/k")),
        pool.clone(),
        Duration::ZERO,
    );
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
    let wait = common::parked(&e, parked, "a throttled run to be parked").await;
    assert_eq!((wait.kind.as_str(), wait.key.as_deref()), ("throttle", Some("acct-a")));
    assert!(wait.next_possible_start.unwrap() > durastep::testing::db_now(&e).await.unwrap());
    drive_clock(&e, &pool, "linkedin", Duration::from_secs(1), 120).await;
    w.stop().await;

    assert_eq!(states(&pool, "linkedin").await.get("completed"), Some(&16), "nothing dropped");
    let windows = max_starts_in_window(&pool, "linkedin", period).await;
    assert_eq!(windows, vec![("acct-a".into(), 4), ("acct-b".into(), 4)], "most starts in any {period:?} window");
    // Waiting runs are claimed in arrival order (the burst's two in one claim: one claim time).
    let order: Vec<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "WITH s AS ({CLAIMS}) SELECT (n)::bigint FROM s WHERE key = 'acct-a' GROUP BY run_id, n ORDER BY min(t), n"
    )))
    .bind("linkedin")
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(order, (0..12).collect::<Vec<i64>>());
    // Spacing: the claims replayed through the rule itself (GCRA, one emission
    // every 3 s, a burst of 1) are each allowed when they happened. A claim
    // that came late by the clock's 1 s steps lets the next come sooner than
    // 3 s after it (the burst credit), so plain gaps are not the rule; this
    // replay fails for any claim the rule did not allow.
    let times: Vec<f64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "WITH s AS ({CLAIMS}) SELECT extract(epoch FROM min(t))::float8 FROM s WHERE key = 'acct-a'
          GROUP BY run_id ORDER BY 1"
    )))
    .bind("linkedin")
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(times.len(), 12);
    let (emit, burst) = (3.0, 1.0);
    let mut tat = f64::NEG_INFINITY;
    for (i, t) in times.iter().enumerate() {
        assert!(
            *t >= tat - burst * emit - 1e-3,
            "claim {i} at {t} came before the rule allowed ({}): {times:?}",
            tat - burst * emit
        );
        tat = tat.max(*t) + emit;
    }
}

#[sqlx::test(migrations = false)]
async fn rate_limit_skips_the_excess_and_runs_everything_else(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let pool = ledger_pool(&opts).await;
    // 2 per 10 s: starts at least 5 s apart; a run over the limit is skipped, not delayed.
    let period = Duration::from_secs(10);
    let f = handler(
        builder("refresh", "stale").rate_limit(durastep::RateLimit::new(2, period).key("/k")),
        pool.clone(),
        Duration::ZERO,
    );
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
        Function::new(id)
            .on_event(event)
            .retries(0)
            .backpressure(durastep::Backpressure::new().key("/account").shared("linkedin-writes"))
            .handler(move |ctx: Ctx, e: Value| {
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
            })
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
        let wait = common::parked(&e, id, "a K run to be parked").await;
        assert_eq!((wait.kind.as_str(), wait.key.as_deref()), ("backpressure", Some("K")));
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
        builder("resync", "changed")
            .debounce(durastep::Debounce::new(Duration::from_secs(10)).key("/k").max_wait(Duration::from_secs(25))),
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
        Function::new(id).on_event(id).singleton(durastep::Singleton::new(mode).key("/k")).handler(
            move |_ctx: Ctx, e: Value| {
                let (gate, dropped) = (gate.clone(), dropped.clone());
                async move {
                    if e["hold"] == true {
                        let _guard = OpenOnDrop(dropped);
                        gate.wait().await;
                    }
                    Ok(e["n"].clone())
                }
            },
        )
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
    // drops the handler when told: by the notification, or at its next
    // heartbeat) and the new run starts.
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

/// Debounce merges only into a run that has never started. The first run of
/// key a starts and fails (backoff 1 h): it is `queued` again, but started. A
/// new event of key a then makes a new run; the old one keeps its event and
/// its backoff, and the first event's duplicate still names the old run. Both
/// runs complete, each with its own event's data. Catches: a debounce index
/// that matched any `queued` run, so the new event swapped the started run's
/// input (attempt 2 would run the new data over the old step results), cut
/// its backoff, and left the first event's duplicate receipt without run ids.
#[sqlx::test(migrations = false)]
async fn debounce_never_merges_into_a_run_that_started(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let f = Function::new("resync")
        .on_event("changed")
        .retries(1)
        .backoff(durastep::Backoff::Fixed(Duration::from_secs(3600)))
        .debounce(durastep::Debounce::new(Duration::from_secs(10)).key("/k").max_wait(Duration::from_secs(60)))
        .handler(|ctx: Ctx, e: Value| async move {
            let n = e["n"].as_i64().unwrap_or(0);
            let attempt = ctx.attempt();
            ctx.step("work", || async move {
                if n == 1 && attempt == 1 { Err(HandlerError::new("first attempt fails")) } else { Ok(n) }
            })
            .await
        });
    let e = engine(&opts, vec![f]).await;
    let w = spawn_worker(&e);
    let tick = |s: u64| durastep::testing::advance_clock(&e, Duration::from_secs(s));
    let first = Event::new("changed", &json!({"k": "a", "n": 1})).idempotency_key("first");
    let sent = e.send(first).await.unwrap();
    let old = sent.run_ids[0];
    tick(10).await.unwrap();
    let retrying =
        wait_for_run_where(&e, old, "the first attempt to fail", |r| r.state == RunState::Queued && r.attempt == 2)
            .await;

    let second = e.send(Event::new("changed", &json!({"k": "a", "n": 2}))).await.unwrap();
    assert_eq!(second.run_ids.len(), 1, "{second:?}");
    let new = second.run_ids[0];
    assert_ne!(new, old, "the event merged into a run that had started");
    let after = e.run(old).await.unwrap();
    assert_eq!(after.event_id, sent.event_id, "the started run's input was swapped");
    assert_eq!(after.run_at, retrying.run_at, "the started run's backoff was changed");
    let again = e.send(Event::new("changed", &json!({"k": "a", "n": 1})).idempotency_key("first")).await.unwrap();
    assert!(again.duplicate);
    assert_eq!((again.event_id, again.run_ids), (sent.event_id, vec![old]));

    tick(10).await.unwrap();
    assert_eq!(finished(&e, new).await.output, Some(json!(2)));
    tick(3600).await.unwrap();
    let done = finished(&e, old).await;
    w.stop().await;
    assert_eq!((done.output, done.attempt), (Some(json!(1)), 2), "the retried run ran its own event");
}

/// Three events of one key before the debounced run starts make one run,
/// carrying the latest; a repeated send of each earlier event (same
/// idempotency key) still returns that run. Catches: the duplicate receipt of
/// an event merged away (its run now points at a later event) naming no run.
#[sqlx::test(migrations = false)]
async fn a_debounced_events_duplicate_names_the_run_it_merged_into(_p: PgPoolOptions, opts: PgConnectOptions) {
    init_logs();
    let f = Function::new("resync")
        .on_event("changed")
        .debounce(durastep::Debounce::new(Duration::from_secs(10)).key("/k").max_wait(Duration::from_secs(60)))
        .handler(|_ctx: Ctx, e: Value| async move { Ok(e["n"].clone()) });
    let e = engine(&opts, vec![f]).await;
    let send = |n: i64| {
        let e = e.clone();
        async move { e.send(Event::new("changed", &json!({"k": "b", "n": n})).idempotency_key(format!("e{n}"))).await }
    };
    let mut receipts = Vec::new();
    for n in 1..=3 {
        receipts.push(send(n).await.unwrap());
    }
    let run = receipts[0].run_ids.clone();
    assert_eq!(run.len(), 1);
    assert!(receipts.iter().all(|r| r.run_ids == run && !r.duplicate), "{receipts:?}");
    for (n, first) in (1..=3).zip(&receipts) {
        let again = send(n).await.unwrap();
        assert!(again.duplicate, "{again:?}");
        assert_eq!((again.event_id, &again.run_ids), (first.event_id, &run), "event {n}'s duplicate");
    }
}

/// How the running attempt of a limited run is cancelled.
#[derive(Clone, Copy, Debug)]
enum CancelBy {
    Engine,
    CancelOn,
    FinishTimeout,
    SingletonCancelOld,
}

/// A run of key a holds the only slot of its concurrency key and waits inside a
/// step body in worker A, whose heartbeat does not come within the test; it is
/// cancelled (`how`), and a new run of key a is sent (for the singleton: the
/// new event itself cancels the old run). The new run must not start while the
/// cancelled body still runs: it starts once worker A has dropped the
/// cancelled handler, which it learns of at once (not at its next heartbeat).
async fn a_cancelled_body_keeps_its_slot_until_it_stops(opts: PgConnectOptions, how: CancelBy) {
    init_logs();
    let (entered, gate, dropped) = (Gate::new(), Gate::new(), Gate::new());
    let overlapped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let make = || {
        let (entered, gate, dropped, overlapped) = (entered.clone(), gate.clone(), dropped.clone(), overlapped.clone());
        let b = Function::new("limited").on_event("limited").concurrency(durastep::Concurrency::new(1).key("/k"));
        let b = match how {
            CancelBy::SingletonCancelOld => b.singleton(durastep::Singleton::new(SingletonMode::CancelOld).key("/k")),
            _ => {
                b.cancel_on(durastep::CancelOn::event("limited/stop").key("/k")).finish_timeout(Duration::from_secs(30))
            }
        };
        b.handler(move |ctx: Ctx, e: Value| {
            let (entered, gate, dropped, overlapped) =
                (entered.clone(), gate.clone(), dropped.clone(), overlapped.clone());
            async move {
                if e["hold"] == true {
                    ctx.step("held", || async {
                        let _guard = OpenOnDrop(dropped);
                        entered.open();
                        gate.wait().await;
                        Ok(())
                    })
                    .await?;
                } else if !dropped.is_open() {
                    overlapped.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                Ok(e["n"].clone())
            }
        })
    };
    let engine_a = engine_with(&opts, vec![make()], stalling_options()).await;
    let wa = spawn_worker(&engine_a);
    // Worker A listens before anything is cancelled (a notification sent
    // before would be missed, and its 30 s heartbeat is out of the test's reach).
    wait_until("worker A to listen for cancels", || async {
        let listening = "pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() \
                         AND query LIKE '%LISTEN%durastep_cancelled%'";
        count(&engine_a, listening).await >= 1
    })
    .await;
    let old = engine_a.send(Event::new("limited", &json!({"k": "a", "n": 1, "hold": true}))).await.unwrap().run_ids[0];
    entered.reached("the first run's body").await;
    let engine_b = engine(&opts, vec![make()]).await;
    let wb = spawn_worker(&engine_b);

    let new_event = Event::new("limited", &json!({"k": "a", "n": 2}));
    let new = match how {
        CancelBy::Engine => {
            engine_b.cancel(old, "operator").await.unwrap();
            engine_b.send(new_event).await.unwrap().run_ids[0]
        }
        CancelBy::CancelOn => {
            engine_b.send(Event::new("limited/stop", &json!({"k": "a"}))).await.unwrap();
            engine_b.send(new_event).await.unwrap().run_ids[0]
        }
        CancelBy::FinishTimeout => {
            // Past the 30 s finish timeout, well within the stalled worker's 60 s lease.
            durastep::testing::advance_clock(&engine_b, Duration::from_secs(31)).await.unwrap();
            engine_b.reap_expired_leases().await.unwrap();
            engine_b.send(new_event).await.unwrap().run_ids[0]
        }
        CancelBy::SingletonCancelOld => engine_b.send(new_event).await.unwrap().run_ids[0],
    };
    let cancelled = engine_b.run(old).await.unwrap();
    assert_eq!(cancelled.state, RunState::Cancelled, "{how:?}: {cancelled:?}");
    let done = finished(&engine_b, new).await;
    assert_eq!((done.state, done.output), (RunState::Completed, Some(json!(2))), "{how:?}");
    assert!(
        !overlapped.load(std::sync::atomic::Ordering::SeqCst),
        "{how:?}: the new run started while the cancelled body still ran"
    );
    assert!(dropped.is_open());
    wa.stop().await;
    wb.stop().await;
    let in_use: i64 = sqlx::query_scalar("SELECT coalesce(sum(in_use), 0)::bigint FROM durastep.flow_keys")
        .fetch_one(engine_b.pool())
        .await
        .unwrap();
    assert_eq!(in_use, 0, "{how:?}: slots not given back");
    assert_eq!(step_row(&engine_b, old, "held").await, None, "{how:?}: the cancelled body's result was stored");
}

/// Catches: `Engine::cancel` giving the slot back while the cancelled body ran
/// on (a new run of the key started at once: two bodies on a limit of one).
#[sqlx::test(migrations = false)]
async fn a_body_cancelled_by_the_engine_keeps_its_slot_until_it_stops(_p: PgPoolOptions, opts: PgConnectOptions) {
    a_cancelled_body_keeps_its_slot_until_it_stops(opts, CancelBy::Engine).await;
}

/// Catches: as above, for a `cancel_on` event.
#[sqlx::test(migrations = false)]
async fn a_body_cancelled_by_cancel_on_keeps_its_slot_until_it_stops(_p: PgPoolOptions, opts: PgConnectOptions) {
    a_cancelled_body_keeps_its_slot_until_it_stops(opts, CancelBy::CancelOn).await;
}

/// Catches: as above, for a finish timeout.
#[sqlx::test(migrations = false)]
async fn a_body_cancelled_by_its_finish_timeout_keeps_its_slot_until_it_stops(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    a_cancelled_body_keeps_its_slot_until_it_stops(opts, CancelBy::FinishTimeout).await;
}

/// Catches: as above, for a singleton `CancelOld` replacing the running run.
#[sqlx::test(migrations = false)]
async fn a_body_cancelled_by_a_singleton_keeps_its_slot_until_it_stops(_p: PgPoolOptions, opts: PgConnectOptions) {
    a_cancelled_body_keeps_its_slot_until_it_stops(opts, CancelBy::SingletonCancelOld).await;
}

/// A cancelled run whose worker cannot learn of the cancel (no LISTEN, no
/// heartbeat within the test: a stalled worker) keeps its slot until its lease
/// lapses; then the reaper gives the slot back and the next run starts.
/// Catches: the cancel giving the slot back at once, and a slot that a
/// cancelled attempt of a lost worker would keep for good.
#[sqlx::test(migrations = false)]
async fn a_cancelled_attempt_of_a_stalled_worker_keeps_its_slot_until_its_lease_lapses(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    init_logs();
    let (entered, gate) = (Gate::new(), Gate::new());
    let make = || {
        let (entered, gate) = (entered.clone(), gate.clone());
        Function::new("limited").on_event("limited").concurrency(durastep::Concurrency::new(1).key("/k")).handler(
            move |ctx: Ctx, e: Value| {
                let (entered, gate) = (entered.clone(), gate.clone());
                async move {
                    if e["hold"] == true {
                        ctx.step("held", || async {
                            entered.open();
                            gate.wait().await;
                            Ok(())
                        })
                        .await?;
                    }
                    Ok(e["n"].clone())
                }
            },
        )
    };
    let stalled = WorkerOptions { listen: false, ..stalling_options() };
    let engine_a = engine_with(&opts, vec![make()], stalled).await;
    let wa = spawn_worker(&engine_a);
    let old = engine_a.send(Event::new("limited", &json!({"k": "a", "n": 1, "hold": true}))).await.unwrap().run_ids[0];
    entered.reached("the first run's body").await;
    let engine_b = engine(&opts, vec![make()]).await;
    let wb = spawn_worker(&engine_b);
    engine_b.cancel(old, "operator").await.unwrap();
    let new = engine_b.send(Event::new("limited", &json!({"k": "a", "n": 2}))).await.unwrap().run_ids[0];
    stays(&engine_b, new, Duration::from_millis(500), "queued while the cancelled body may run", |r| {
        r.state == RunState::Queued
    })
    .await;
    durastep::testing::advance_clock(&engine_b, LONG_LEASE + Duration::from_secs(1)).await.unwrap();
    engine_b.reap_expired_leases().await.unwrap();
    let done = finished(&engine_b, new).await;
    assert_eq!((done.state, done.output), (RunState::Completed, Some(json!(2))));
    gate.open();
    wa.stop().await;
    wb.stop().await;
    let in_use: i64 = sqlx::query_scalar("SELECT coalesce(sum(in_use), 0)::bigint FROM durastep.flow_keys")
        .fetch_one(engine_b.pool())
        .await
        .unwrap();
    assert_eq!(in_use, 0, "slots not given back");
    let old = engine_b.run(old).await.unwrap();
    assert_eq!((old.state, old.output.clone()), (RunState::Cancelled, None), "{old:?}");
}

/// A cancelled run whose body still runs (its worker is stalled: it learns of
/// the cancel only when the body's next write is fenced) is replayed at once.
/// The replayed run must not start beside that body: it stays queued, not due,
/// holding its slot, until the old body stops; then it starts and completes,
/// and only one body of the key (and of the run) ever ran at a time.
/// Catches: a replay that cleared the cancelled attempt's worker and lease, so
/// the run was claimed again while its cancelled body ran on (found by the
/// randomized workload's soak tier as two bodies of one run at once).
#[sqlx::test(migrations = false)]
async fn a_run_replayed_while_its_cancelled_body_runs_waits_for_it_to_stop(_p: PgPoolOptions, opts: PgConnectOptions) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    init_logs();
    let (entered, gate) = (Gate::new(), Gate::new());
    let inside = std::sync::Arc::new(AtomicUsize::new(0));
    let most = std::sync::Arc::new(AtomicUsize::new(0));
    struct Leave(std::sync::Arc<AtomicUsize>);
    impl Drop for Leave {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let make = || {
        let (entered, gate, inside, most) = (entered.clone(), gate.clone(), inside.clone(), most.clone());
        Function::new("limited").on_event("limited").concurrency(durastep::Concurrency::new(1).key("/k")).handler(
            move |ctx: Ctx, _e: Value| {
                let (entered, gate, inside, most) = (entered.clone(), gate.clone(), inside.clone(), most.clone());
                async move {
                    let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    let _leave = Leave(inside.clone());
                    most.fetch_max(n, Ordering::SeqCst);
                    ctx.step("held", || async {
                        entered.open();
                        gate.wait().await;
                        Ok(())
                    })
                    .await?;
                    Ok(json!("done"))
                }
            },
        )
    };
    let stalled = WorkerOptions { listen: false, ..stalling_options() };
    let engine_a = engine_with(&opts, vec![make()], stalled).await;
    let wa = spawn_worker(&engine_a);
    let old = engine_a.send(Event::new("limited", &json!({"k": "a"}))).await.unwrap().run_ids[0];
    entered.reached("the first attempt's body").await;
    let engine_b = engine(&opts, vec![make()]).await;
    let wb = spawn_worker(&engine_b);
    engine_b.cancel(old, "operator").await.unwrap();
    let replayed = engine_b.replay(old, durastep::ReplayFrom::Start).await.unwrap();
    assert_eq!(replayed.state, RunState::Queued, "{replayed:?}");
    let (due, in_use): (bool, i64) = sqlx::query_as(
        "SELECT r.run_at <= durastep.now(), (SELECT coalesce(sum(in_use), 0)::bigint FROM durastep.flow_keys)
           FROM durastep.runs r WHERE r.id = $1",
    )
    .bind(old)
    .fetch_one(engine_b.pool())
    .await
    .unwrap();
    assert!(!due, "the replayed run is due while its cancelled body runs");
    assert_eq!(in_use, 1, "the cancelled body's slot was given back while it runs");
    stays(&engine_b, old, Duration::from_millis(500), "queued while the cancelled body runs", |r| {
        r.state == RunState::Queued
    })
    .await;
    // The old body ends; its checkpoint is fenced, its worker ends the attempt
    // and the replayed run starts at once.
    gate.open();
    let done = finished(&engine_b, old).await;
    assert_eq!((done.state, done.output.clone()), (RunState::Completed, Some(json!("done"))), "{done:?}");
    assert_eq!(most.load(Ordering::SeqCst), 1, "two bodies of the run at once");
    wa.stop().await;
    wb.stop().await;
    let in_use: i64 = sqlx::query_scalar("SELECT coalesce(sum(in_use), 0)::bigint FROM durastep.flow_keys")
        .fetch_one(engine_b.pool())
        .await
        .unwrap();
    assert_eq!(in_use, 0, "slots not given back");
}

/// Clears its flag when dropped, 300 ms late.
struct StopsSlowly(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopsSlowly {
    fn drop(&mut self) {
        std::thread::sleep(Duration::from_millis(300));
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A handler runs two steps at once (`join!`): `fails` fails while the body of
/// `slow` runs, and that body takes 300 ms to stop once it is dropped. The attempt's failure, which gives
/// back the key's slot, is written only once the handler (with `slow`'s body)
/// has been dropped, so the next run of the key never starts beside it.
/// Catches: the failure written right after the handler was aborted, while a
/// body of another branch still ran (two bodies on a limit of one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_attempt_gives_back_its_slot_only_when_every_branch_has_stopped() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let inside = std::sync::Arc::new(AtomicBool::new(false));
    let overlapped = std::sync::Arc::new(AtomicBool::new(false));
    let (i2, o2) = (inside.clone(), overlapped.clone());
    let f =
        Function::new("pair").on_event("pair").retries(0).concurrency(durastep::Concurrency::new(1).key("/k")).handler(
            move |ctx: Ctx, e: Value| {
                let (inside, overlapped) = (i2.clone(), o2.clone());
                async move {
                    if e["first"] != true {
                        if inside.load(Ordering::SeqCst) {
                            overlapped.store(true, Ordering::SeqCst);
                        }
                        return Ok(json!("second"));
                    }
                    let entered = Gate::new();
                    let in_slow = entered.clone();
                    // Fails once `slow`'s body is running.
                    let fails = ctx.step("fails", || async move {
                        entered.wait().await;
                        Err::<(), _>(durastep::HandlerError::new("fails"))
                    });
                    let inside = inside.clone();
                    let slow = ctx.step("slow", move || async move {
                        inside.store(true, Ordering::SeqCst);
                        // A body that takes a while to stop once dropped (its
                        // clean-up blocks), as a body busy on its thread would.
                        let _stopping = StopsSlowly(inside);
                        in_slow.open();
                        // Runs until the attempt drops it.
                        std::future::pending::<()>().await;
                        Ok(())
                    });
                    let (a, b) = tokio::join!(fails, slow);
                    a?;
                    b?;
                    Ok(json!("first"))
                }
            },
        );
    let t = durastep::testing::TestEngine::builder().function(f).build().await.unwrap();
    let first = t.engine().send(Event::new("pair", &json!({"k": "a", "first": true}))).await.unwrap().run_ids[0];
    let second = t.engine().send(Event::new("pair", &json!({"k": "a"}))).await.unwrap().run_ids[0];
    let runs = t.wait_for_runs(&[first, second], Duration::from_secs(60)).await.unwrap();
    assert_eq!(runs[0].state, RunState::Failed, "{:?}", runs[0]);
    assert_eq!(runs[1].state, RunState::Completed, "{:?}", runs[1]);
    assert!(!overlapped.load(Ordering::SeqCst), "the second run started while the first run's `slow` body ran");
    t.shutdown().await;
}
