//! Throttle, rate limit and key back-pressure across worker processes: 4
//! processes and 2,000 runs each (the concurrency limits have
//! `flow_processes.rs`).
//!
//! Every attempt records its start in the ledger with Durastep's database clock
//! (`db_started`, `durastep.now()`: the test offset included), on its own
//! connection, outside the engine; every check is SQL over those rows and the
//! run rows. Time is moved, not waited for: the periods are minutes of database
//! clock, and the test moves the clock in steps only once everything due has
//! run and nothing becomes due for a margin (`checks::busy_runs`), so no claim
//! races a move. A step is much shorter than a period and the workers' wall time
//! between two moves is much shorter than a step, so a window of the period over
//! the ledger's start times sees what the claims saw. Scale with DURASTEP_SOAK=1 (x5).

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use durastep_testkit::functions::{
    FLOW_BACKPRESSURE, FLOW_BACKPRESSURE_EVENTS, FLOW_BACKPRESSURE_RULE, FLOW_RATE, FLOW_RATE_EVENT, FLOW_RATE_LIMIT,
    FLOW_RATE_PERIOD, FLOW_THROTTLE, FLOW_THROTTLE_BURST, FLOW_THROTTLE_EVENT, FLOW_THROTTLE_LIMIT,
    FLOW_THROTTLE_PERIOD,
};
use durastep_testkit::{BackpressureInput, Cluster, FlowInput, WorkerConfig, checks, ledger, url_of, wait_for};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const WORKERS: usize = 4;
/// How long nothing may become due before the test moves the clock.
const MARGIN: Duration = Duration::from_millis(200);
/// The throttle test's clock step: a tenth of the period, 5 emission intervals.
const THROTTLE_STEP: Duration = Duration::from_secs(60);
/// The rate-limit test's clock step: half the emission interval (200 s).
const RATE_STEP: Duration = Duration::from_secs(100);
const DEADLINE: Duration = Duration::from_secs(60);

fn scale() -> u64 {
    if std::env::var_os("DURASTEP_SOAK").is_some() { 5 } else { 1 }
}

/// Leases far longer than any clock step: a move of the clock never expires
/// the lease of an attempt that is running (and there should be none).
fn config() -> WorkerConfig {
    WorkerConfig { lease: Duration::from_secs(1_200), max_in_flight: 16, claim_batch: 16, ..WorkerConfig::default() }
}

/// Waits until no run of `functions` is running or due within [`MARGIN`].
async fn settle(c: &Cluster, functions: &[&str]) {
    let pool = c.pool();
    wait_for("the runs to settle", DEADLINE, || async move {
        Ok((checks::busy_runs(pool, functions, MARGIN).await? == 0).then_some(()))
    })
    .await
    .unwrap();
}

/// Moves the database clock in `step`s, each once the runs have settled, until
/// every run is finished; returns the number of moves.
async fn drive_clock(c: &Cluster, functions: &[&str], runs: &[Uuid], step: Duration, max_steps: usize) -> usize {
    for moves in 0..=max_steps {
        settle(c, functions).await;
        if checks::unfinished_among(c.pool(), runs).await.unwrap() == 0 {
            return moves;
        }
        c.advance_clock(step).await.unwrap();
    }
    panic!("the runs did not finish within {max_steps} moves of the clock");
}

async fn db_now(c: &Cluster) -> DateTime<Utc> {
    durastep::testing::db_now(c.engine()).await.unwrap()
}

async fn shutdown(c: &mut Cluster) {
    for (i, status) in c.shutdown(Duration::from_secs(20)).await.unwrap() {
        assert!(status.success(), "worker {i} did not shut down cleanly: {status}");
    }
}

#[sqlx::test(migrations = false)]
async fn throttle_holds_across_four_processes_and_drops_nothing(_p: PgPoolOptions, opts: PgConnectOptions) {
    let accounts = 20u64;
    let total = 2_000 * scale();
    let (limit, burst) = (i64::from(FLOW_THROTTLE_LIMIT), i64::from(FLOW_THROTTLE_BURST));
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    // Interleaved, so every claim sees many keys at once.
    let events = (0..total)
        .map(|n| FlowInput { account: format!("acct-{}", n % accounts), n, hold_ms: 0 }.event(FLOW_THROTTLE_EVENT))
        .collect();
    let runs = c.send_events(events).await.unwrap();
    c.spawn_many(WORKERS, config()).await.unwrap();
    let started = Instant::now();
    let moves = drive_clock(&c, &[FLOW_THROTTLE], &runs, THROTTLE_STEP, 400).await;
    let drained = started.elapsed();

    // Nothing dropped: every run completed, each on one attempt, one ledger row each.
    let states = checks::run_states_of(c.pool(), &[FLOW_THROTTLE]).await.unwrap();
    assert_eq!(states.get("completed").copied(), Some(total as i64), "{states:?}");
    assert_eq!(states.len(), 1, "{states:?}");
    let summary = ledger::summary(c.pool()).await.unwrap();
    assert_eq!((summary.executions, summary.max_per_step), (total as i64, 1), "{summary:?}");
    assert_eq!(checks::runs_per_attempt(c.pool()).await.unwrap().keys().copied().collect::<Vec<_>>(), vec![1]);

    // The bound, by the database clock, per account; and it was approached (the
    // throttle let its rate through, it did not just trickle).
    let windows =
        checks::max_starts_in_window(c.pool(), &[FLOW_THROTTLE], "account", FLOW_THROTTLE_PERIOD).await.unwrap();
    assert_eq!(windows.len(), accounts as usize, "{windows:?}");
    let worst = windows.iter().map(|(_, n)| *n).max().unwrap();
    let least = windows.iter().map(|(_, n)| *n).min().unwrap();
    assert!(
        worst <= limit + burst,
        "a key started {worst} attempts in a {FLOW_THROTTLE_PERIOD:?} window (limit {limit} + burst {burst}): {windows:?}"
    );
    assert!(least >= limit, "a key never had a full window ({least} < {limit}): {windows:?}");
    let per_pid = ledger::executions_per_pid(c.pool()).await.unwrap();
    assert!(per_pid.len() > 1, "the work was not shared: {per_pid:?}");
    shutdown(&mut c).await;
    eprintln!(
        "flow_limits_processes throttle: {WORKERS} processes, {total} runs over {accounts} accounts, throttle \
         {limit} per {FLOW_THROTTLE_PERIOD:?} + burst {burst}: {moves} clock moves of {THROTTLE_STEP:?}, drained in \
         {drained:.2?}; most starts in any window per account {least}..={worst} (bound {}); all completed on attempt 1; \
         attempts per process: {per_pid:?}",
        limit + burst
    );
}

#[sqlx::test(migrations = false)]
async fn rate_limit_skips_the_excess_across_four_processes(_p: PgPoolOptions, opts: PgConnectOptions) {
    let accounts = 100u64;
    let waves = 20 * scale();
    let limit = i64::from(FLOW_RATE_LIMIT);
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    c.spawn_many(WORKERS, config()).await.unwrap();
    let started = Instant::now();
    // One event per account per wave, 100 s of database clock apart. The
    // emission interval is 1000 s / 5 = 200 s: a run of an account starts in
    // every other wave (0, 2, 4, ...) and the one between is skipped.
    let mut by_wave = Vec::new();
    let mut runs = Vec::new();
    for w in 0..waves {
        let events = (0..accounts)
            .map(|a| FlowInput { account: format!("acct-{a}"), n: w * accounts + a, hold_ms: 0 }.event(FLOW_RATE_EVENT))
            .collect();
        let ids = c.send_events(events).await.unwrap();
        runs.extend(ids.iter().copied());
        by_wave.push(ids);
        c.wait_finished(&runs, DEADLINE).await.unwrap();
        c.advance_clock(RATE_STEP).await.unwrap();
    }
    let drained = started.elapsed();

    // Exactly the runs the GCRA allows started, the rest were skipped with the reason.
    let mut wrong = Vec::new();
    for (w, ids) in by_wave.iter().enumerate() {
        let expect = if w % 2 == 0 { "completed" } else { "skipped" };
        for run in checks::runs(c.pool(), ids).await.unwrap() {
            if run.state != expect {
                wrong.push(format!("wave {w}: run {} is {} ({:?})", run.id, run.state, run.last_error));
            }
        }
    }
    assert!(wrong.is_empty(), "{} runs not as the rate limit allows: {:?}", wrong.len(), &wrong[..wrong.len().min(10)]);
    let reasons: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT e.payload ->> 'account', r.last_error FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id
          WHERE r.function_id = $1 AND r.state = 'skipped'",
    )
    .bind(FLOW_RATE)
    .fetch_all(c.pool())
    .await
    .unwrap();
    let prefix = format!("rate limit {FLOW_RATE}#rate_limit1: over {limit} per ");
    let bad: Vec<_> = reasons
        .iter()
        .filter(|(account, e)| {
            !e.as_deref().is_some_and(|e| e.starts_with(&prefix) && e.ends_with(&format!(" for key {account}")))
        })
        .collect();
    assert!(bad.is_empty(), "skipped without the reason: {:?}", &bad[..bad.len().min(5)]);
    let skipped = reasons.len() as i64;
    let completed = (runs.len() as i64) - skipped;

    // No skipped run ever started; every other run started once.
    let ran_skipped: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM testkit_ledger l JOIN durastep.runs r ON r.id = l.run_id WHERE r.state = 'skipped'",
    )
    .fetch_one(c.pool())
    .await
    .unwrap();
    assert_eq!(ran_skipped, 0, "a skipped run started");
    let summary = ledger::summary(c.pool()).await.unwrap();
    assert_eq!((summary.executions, summary.max_per_step), (completed, 1), "{summary:?}");

    // The bound by the database clock, and it was reached by every account.
    let windows = checks::max_starts_in_window(c.pool(), &[FLOW_RATE], "account", FLOW_RATE_PERIOD).await.unwrap();
    assert_eq!(windows.len(), accounts as usize, "{windows:?}");
    assert!(windows.iter().all(|(_, n)| *n == limit), "most starts in a {FLOW_RATE_PERIOD:?} window: {windows:?}");
    let per_pid = ledger::executions_per_pid(c.pool()).await.unwrap();
    assert!(per_pid.len() > 1, "the work was not shared: {per_pid:?}");
    shutdown(&mut c).await;
    eprintln!(
        "flow_limits_processes rate limit: {WORKERS} processes, {} runs ({accounts} accounts x {waves} waves {RATE_STEP:?} \
         apart), rate limit {limit} per {FLOW_RATE_PERIOD:?}: {completed} completed, {skipped} skipped with the \
         reason, 0 skipped runs started; most starts in any window {limit} for all {accounts} accounts; {drained:.2?}; \
         attempts per process: {per_pid:?}",
        runs.len()
    );
}

#[sqlx::test(migrations = false)]
async fn backpressure_pauses_one_key_across_four_processes(_p: PgPoolOptions, opts: PgConnectOptions) {
    const K: &str = "acct-0";
    const RETRY_AFTER: Duration = Duration::from_secs(30);
    let accounts = 20u64;
    let total = 2_000 * scale();
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    c.spawn_many(WORKERS, config()).await.unwrap();
    let pool = c.pool().clone();

    // A run of function a on K gets a 429 with Retry-After 30 s.
    let input = BackpressureInput { account: K.into(), n: 0, retry_after_ms: Some(RETRY_AFTER.as_millis() as u64) };
    let trigger = c.send_events(vec![input.event(FLOW_BACKPRESSURE_EVENTS[0])]).await.unwrap()[0];
    let paused_until: DateTime<Utc> = wait_for("the 429 to pause the key", DEADLINE, || {
        let pool = pool.clone();
        async move {
            Ok(sqlx::query_scalar(
                "SELECT paused_until FROM durastep.flow_keys WHERE rule = $1 AND key = $2 AND paused_until IS NOT NULL",
            )
            .bind(FLOW_BACKPRESSURE_RULE)
            .bind(K)
            .fetch_optional(&pool)
            .await?)
        }
    })
    .await
    .unwrap();
    let paused_at = paused_until - chrono::Duration::from_std(RETRY_AFTER).unwrap();
    let run = checks::run(&pool, trigger).await.unwrap();
    assert_eq!((run.state.as_str(), run.attempt), ("queued", 1), "the 429 used up no attempt: {run:?}");

    // Then 2,000 runs of both functions over 20 accounts, K among them.
    let events = (0..total)
        .map(|n| {
            let input = BackpressureInput { account: format!("acct-{}", n % accounts), n, retry_after_ms: None };
            input.event(FLOW_BACKPRESSURE_EVENTS[(n / accounts % 2) as usize])
        })
        .collect();
    let started = Instant::now();
    let runs = c.send_events(events).await.unwrap();
    let (k_runs, others): (Vec<_>, Vec<_>) =
        runs.iter().enumerate().partition(|(n, _)| (*n as u64).is_multiple_of(accounts));
    let k_runs: Vec<Uuid> = k_runs.into_iter().map(|(_, id)| *id).collect();
    let others: Vec<Uuid> = others.into_iter().map(|(_, id)| *id).collect();
    // Other keys keep running: all their runs finish; K's runs, of both functions, are parked.
    c.wait_finished(&others, DEADLINE).await.unwrap();
    let others_drained = started.elapsed();
    settle(&c, &FLOW_BACKPRESSURE).await;
    let parked: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM durastep.run_flow_waits
          WHERE run_id = ANY ($1) AND kind = 'backpressure' AND key = $2 AND next_possible_start = $3",
    )
    .bind(&k_runs)
    .bind(K)
    .bind(paused_until)
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(parked, k_runs.len() as i64, "K's runs wait for the pause, visibly");

    // The database clock moves to 1 s before the pause ends: K stays paused.
    let left = (paused_until - db_now(&c).await).to_std().unwrap_or_default();
    assert!(left > Duration::from_secs(2), "the other keys took the whole pause ({others_drained:.2?})");
    c.advance_clock(left - Duration::from_secs(1)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    settle(&c, &FLOW_BACKPRESSURE).await;
    assert_eq!(checks::count_in_state(&pool, &k_runs, "queued").await.unwrap(), k_runs.len() as i64);
    // Past it: everything finishes.
    c.advance_clock(Duration::from_secs(2)).await.unwrap();
    let mut all = runs.clone();
    all.push(trigger);
    c.wait_finished(&all, DEADLINE).await.unwrap();
    let states = checks::run_states_of(&pool, &FLOW_BACKPRESSURE).await.unwrap();
    assert_eq!(states.get("completed").copied(), Some(all.len() as i64), "{states:?}");

    // No attempt on K, of either function in any process, started before the
    // pause ended, except the one that got the 429.
    let k_starts: Vec<(Uuid, String, DateTime<Utc>)> = sqlx::query_as(
        "SELECT l.run_id, r.function_id, l.db_started FROM testkit_ledger l
           JOIN durastep.runs r ON r.id = l.run_id JOIN durastep.events e ON e.id = r.event_id
          WHERE r.function_id = ANY ($1) AND e.payload ->> 'account' = $2 ORDER BY l.db_started",
    )
    .bind(FLOW_BACKPRESSURE.map(str::to_owned).to_vec())
    .bind(K)
    .fetch_all(&pool)
    .await
    .unwrap();
    let early: Vec<_> = k_starts.iter().filter(|(_, _, t)| *t < paused_until).collect();
    assert_eq!(early.len(), 1, "attempts on {K} started before {paused_until}: {early:?}");
    assert_eq!(early[0].0, trigger, "only the attempt that got the 429 started before the pause ended");
    assert_eq!(k_starts.len(), k_runs.len() + 2, "each K run once, the paused one twice");
    for f in FLOW_BACKPRESSURE {
        assert!(k_starts.iter().any(|(_, g, t)| g == f && *t >= paused_until), "{f} ran on {K} after the pause");
    }
    // The pause used up no retry (the functions have none) and was counted as a pause.
    let (attempt, pauses, state): (i32, i32, String) =
        sqlx::query_as("SELECT attempt, pauses, state FROM durastep.runs WHERE id = $1")
            .bind(trigger)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((attempt, pauses, state.as_str()), (1, 1, "completed"));

    // Every other key ran during the pause (by the database clock), once per run.
    let during: Vec<(String, i64)> = sqlx::query_as(
        "SELECT e.payload ->> 'account', count(*) FROM testkit_ledger l
           JOIN durastep.runs r ON r.id = l.run_id JOIN durastep.events e ON e.id = r.event_id
          WHERE r.function_id = ANY ($1) AND e.payload ->> 'account' <> $2
            AND l.db_started >= $3 AND l.db_started < $4
          GROUP BY 1 ORDER BY 1",
    )
    .bind(FLOW_BACKPRESSURE.map(str::to_owned).to_vec())
    .bind(K)
    .bind(paused_at)
    .bind(paused_until)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(during.len(), accounts as usize - 1, "every other account ran during the pause: {during:?}");
    let ran_during: i64 = during.iter().map(|(_, n)| n).sum();
    let summary = ledger::summary(&pool).await.unwrap();
    assert_eq!((summary.executions, summary.max_per_step), (all.len() as i64 + 1, 2), "{summary:?}");
    let per_pid = ledger::executions_per_pid(&pool).await.unwrap();
    assert!(per_pid.len() > 1, "the work was not shared: {per_pid:?}");
    shutdown(&mut c).await;
    eprintln!(
        "flow_limits_processes back-pressure: {WORKERS} processes, a 429 with Retry-After {RETRY_AFTER:?} on {K}, then \
         {total} runs of 2 functions over {accounts} accounts: {} of {} other-key runs started during the pause \
         (drained in {others_drained:.2?}), {K}'s {} runs parked until the pause ended and 0 started before it; the \
         paused run completed on attempt 1 with 1 pause; attempts per process: {per_pid:?}",
        ran_during,
        others.len(),
        k_runs.len(),
    );
}
