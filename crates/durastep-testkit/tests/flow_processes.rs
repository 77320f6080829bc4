//! Concurrency limits across worker processes: 4 processes, 2,000 runs of a
//! function limited to 3 attempts at once per account, plus 200 runs of two
//! functions that share one limit of 1 (Story A's "exact-online").
//!
//! Each attempt records its start and end in the ledger (on its own connection,
//! outside the engine); a sweep over those intervals counts the most attempts
//! that executed at once per key. The limit must hold, and be reached (a limit
//! of N > 1 that only ever let one through would pass a weaker test). Scale with
//! DURASTEP_SOAK=1 (x5).

use std::time::{Duration, Instant};

use durastep_testkit::functions::{
    FLOW_PER_KEY, FLOW_PER_KEY_EVENT, FLOW_PER_KEY_LIMIT, FLOW_SHARED, FLOW_SHARED_EVENTS,
};
use durastep_testkit::{Cluster, FlowInput, WorkerConfig, checks, ledger, url_of};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const WORKERS: usize = 4;
const ACCOUNTS: u64 = 25;

fn scale() -> u64 {
    if std::env::var_os("DURASTEP_SOAK").is_some() { 5 } else { 1 }
}

#[sqlx::test(migrations = false)]
async fn concurrency_limits_hold_across_four_processes(_p: PgPoolOptions, opts: PgConnectOptions) {
    let runs_per_key = 2_000 * scale();
    let shared_runs = 100 * scale();
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let config =
        WorkerConfig { max_in_flight: 24, claim_batch: 16, lease: Duration::from_secs(10), ..WorkerConfig::default() };

    // Interleaved, so every claim sees many keys at once; the shared functions
    // alternate so that both compete for their single slot.
    let mut events = Vec::new();
    for n in 0..runs_per_key {
        let account = format!("acct-{}", n % ACCOUNTS);
        events.push(FlowInput { account, n, hold_ms: 8 }.event(FLOW_PER_KEY_EVENT));
        if n < shared_runs * 2 {
            let input = FlowInput { account: String::new(), n, hold_ms: 2 };
            events.push(input.event(FLOW_SHARED_EVENTS[(n % 2) as usize]));
        }
    }
    let total = events.len();
    let runs = c.send_events(events).await.unwrap();
    let started = Instant::now();
    c.spawn_many(WORKERS, config).await.unwrap();
    c.wait_finished(&runs, Duration::from_secs(120)).await.unwrap();
    let drained = started.elapsed();

    let states = checks::run_states(c.pool()).await.unwrap();
    assert_eq!(states.get("completed").copied(), Some(total as i64), "{states:?}");

    let per_key = checks::max_overlap_per_key(c.pool(), &[FLOW_PER_KEY], Some("account")).await.unwrap();
    assert_eq!(per_key.len(), ACCOUNTS as usize, "{per_key:?}");
    let worst = per_key.iter().map(|(_, n)| *n).max().unwrap();
    assert!(
        worst <= FLOW_PER_KEY_LIMIT,
        "a key ran {worst} attempts at once (limit {FLOW_PER_KEY_LIMIT}): {per_key:?}"
    );
    let reached = per_key.iter().filter(|(_, n)| *n == FLOW_PER_KEY_LIMIT).count();
    assert!(reached > 0, "no key ever reached its limit of {FLOW_PER_KEY_LIMIT}: {per_key:?}");

    let shared = checks::max_overlap_per_key(c.pool(), &FLOW_SHARED, None).await.unwrap();
    assert_eq!(shared, vec![(String::new(), 1)], "the shared limit of 1 across two functions");

    // Every slot was given back, and every run took exactly one attempt.
    let in_use: i64 = sqlx::query_scalar("SELECT coalesce(sum(in_use), 0)::bigint FROM durastep.flow_keys")
        .fetch_one(c.pool())
        .await
        .unwrap();
    assert_eq!(in_use, 0);
    let summary = ledger::summary(c.pool()).await.unwrap();
    assert_eq!(summary.executions, total as i64, "{summary:?}");
    assert_eq!(summary.max_per_step, 1, "{summary:?}");
    let per_pid = ledger::executions_per_pid(c.pool()).await.unwrap();
    assert!(per_pid.len() > 1, "the work was not shared: {per_pid:?}");

    for (i, status) in c.shutdown(Duration::from_secs(20)).await.unwrap() {
        assert!(status.success(), "worker {i} did not shut down cleanly: {status}");
    }
    eprintln!(
        "flow_processes: {WORKERS} processes, {total} runs ({runs_per_key} limited to {FLOW_PER_KEY_LIMIT} per account over \
         {ACCOUNTS} accounts, {} sharing a limit of 1) drained in {drained:.2?} ({:.0} runs/s); max at once per \
         account {worst} ({reached} accounts reached it), shared {:?}; attempts per process: {per_pid:?}",
        shared_runs * 2,
        total as f64 / drained.as_secs_f64(),
        shared,
    );
}
