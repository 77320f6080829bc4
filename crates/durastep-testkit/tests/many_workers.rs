//! Many worker processes draining one queue: 4 processes, 2,000 five-step runs.
//!
//! With nobody killed or stalled, every step body must run exactly once (the
//! ledger), every step result must be stored once (`step_results`), and every
//! run must complete with the oracle's output. Prints the wall time (run with
//! `--nocapture` to see it).

use std::time::{Duration, Instant};

use durastep_testkit::{Cluster, FiveSteps, WorkerConfig, checks, ledger, url_of};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const WORKERS: usize = 4;
const RUNS: u64 = 2_000;

#[sqlx::test(migrations = false)]
async fn four_processes_drain_two_thousand_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    // Nobody dies here: a long lease keeps a CPU-starved heartbeat from costing an attempt.
    let config =
        WorkerConfig { max_in_flight: 32, claim_batch: 32, lease: Duration::from_secs(10), ..WorkerConfig::default() };

    // The whole queue is in place before the first worker starts: the time measured is the drain.
    let sending = Instant::now();
    let runs = c.send_five_steps((0..RUNS).map(FiveSteps::new)).await.unwrap();
    let sent = sending.elapsed();
    let started = Instant::now();
    c.spawn_many(WORKERS, config).await.unwrap();
    let ready = started.elapsed();
    c.wait_finished(&runs, Duration::from_secs(75)).await.unwrap();
    let drained = started.elapsed();

    let states = checks::run_states(c.pool()).await.unwrap();
    assert_eq!(states.get("completed").copied(), Some(RUNS as i64), "{states:?}");
    let retried = checks::retried_runs(c.pool()).await.unwrap();
    assert!(retried.is_empty(), "{} runs needed another attempt; first: {:?}", retried.len(), retried.first());
    let problems = checks::five_steps_mismatches(c.pool()).await.unwrap();
    assert!(problems.is_empty(), "{} problems; first: {:?}", problems.len(), &problems[..problems.len().min(5)]);

    let totals = checks::step_result_totals(c.pool()).await.unwrap();
    assert_eq!(totals.rows, RUNS as i64 * 5);
    assert_eq!(totals.distinct_steps, totals.rows, "a step result was stored twice");

    let summary = ledger::summary(c.pool()).await.unwrap();
    assert_eq!(summary.executions, RUNS as i64 * 5, "{summary:?}");
    assert_eq!(summary.steps, RUNS as i64 * 5, "{summary:?}");
    assert_eq!(summary.max_per_step, 1, "a step body ran twice: {:?}", ledger::repeated_steps(c.pool()).await);
    assert_eq!(summary.unfinished, 0, "{summary:?}");
    let per_pid = ledger::executions_per_pid(c.pool()).await.unwrap();
    assert!(per_pid.len() > 1, "the work was not shared: {per_pid:?}");

    for (i, status) in c.shutdown(Duration::from_secs(20)).await.unwrap() {
        assert!(status.success(), "worker {i} did not shut down cleanly: {status}");
    }
    eprintln!(
        "many_workers: {WORKERS} processes, {RUNS} runs x 5 steps: sent in {sent:.2?}; from spawning the workers \
         (all ready after {ready:.2?}) to all runs completed: {drained:.2?} ({:.0} runs/s, {:.0} steps/s); \
         step bodies per process: {per_pid:?}",
        RUNS as f64 / drained.as_secs_f64(),
        (RUNS * 5) as f64 / drained.as_secs_f64(),
    );
}
