//! Ambiguous commits: the group-commit statement (step checkpoints and run
//! completions) commits, but the worker is told it failed, at least 200 times.
//!
//! Two ways: (i) the `checkpoint-after-commit` failpoint turns a flush that
//! committed into an error; (ii) the proxy forwards the statement, swallows the
//! server's whole reply (its ReadyForQuery comes after the implicit commit)
//! and closes the connection. The writer sends the flush again; the promise
//! (G2, G4) is that the retry adopts what landed: 0 duplicate rows, 0 spurious
//! conflicts (every stored result is the one attempt's own, nothing fenced, no
//! attempt failed), 0 re-executions (each step body ran once, by the ledger).
//!
//! `DURASTEP_SOAK=1` raises the count from 200 to 2,000.

use std::time::{Duration, Instant};

use durastep_testkit::proxy::Proxy;
use durastep_testkit::{Cluster, FiveSteps, WorkerConfig, checks, ledger, url_of};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
/// Unique to the group-commit statement (`store::flush_writes`).
const FLUSH_SQL: &str = "FROM cp JOIN l";

fn target() -> u64 {
    if std::env::var_os("DURASTEP_SOAK").is_some() { 2_000 } else { 200 }
}

/// Lease long enough that the writer's retry window (one lease) is never the limit here.
fn config() -> WorkerConfig {
    WorkerConfig {
        lease: Duration::from_secs(10),
        heartbeat: Duration::from_millis(500),
        max_in_flight: 4,
        claim_batch: 4,
        step_delay: Duration::from_millis(2),
        ..WorkerConfig::default()
    }
}

/// Every check of the promise, over what really happened.
async fn check_no_duplicates_no_conflicts(c: &mut Cluster, runs: &[Uuid]) -> String {
    let pool = c.pool().clone();
    let n = runs.len() as i64;
    let states = checks::run_states(&pool).await.unwrap();
    assert_eq!(states.get("completed").copied(), Some(n), "{states:?}");
    let problems = checks::five_steps_mismatches(&pool).await.unwrap();
    assert!(problems.is_empty(), "{} problems; first: {:?}", problems.len(), &problems[..problems.len().min(5)]);
    let attempts = checks::runs_per_attempt(&pool).await.unwrap();
    assert_eq!(
        attempts.keys().copied().collect::<Vec<_>>(),
        [1],
        "an attempt failed (a spurious error or conflict): {:?}",
        checks::retried_runs(&pool).await.unwrap().first()
    );
    let totals = checks::step_result_totals(&pool).await.unwrap();
    assert_eq!(totals.rows, n * 5, "{totals:?}");
    assert_eq!(totals.distinct_steps, totals.rows, "duplicate step rows");
    let summary = ledger::summary(&pool).await.unwrap();
    assert_eq!(summary.executions, n * 5, "re-executions: {:?}", ledger::repeated_steps(&pool).await.unwrap());
    assert_eq!(summary.max_per_step, 1, "{summary:?}");
    // Each stored result was stored by the one attempt (epoch) that ran its body.
    for &run in runs {
        let done = checks::run(&pool, run).await.unwrap();
        for s in checks::step_results(&pool, run).await.unwrap() {
            assert_eq!(s.lease_epoch, done.lease_epoch, "run {run}: {s:?} not from its only attempt");
        }
        for e in ledger::executions_of_run(&pool, run).await.unwrap() {
            assert_eq!(e.lease_epoch, Some(done.lease_epoch), "{e:?}");
        }
    }
    let mut logs = String::new();
    for i in 0..c.workers().len() {
        let w = c.worker(i);
        assert!(w.is_running().unwrap(), "worker {i} exited");
        logs.push_str(&w.log());
    }
    // Not "lease lost (fenced)" of the heartbeat: it also shows when a completion
    // committed and the worker has not been told yet (the run is no longer
    // running, correctly); nothing is dropped then. A real loss would fence a
    // checkpoint or a completion, or fail an attempt, all checked here.
    for bad in [
        "attempt fenced",
        "completion fenced",
        "checkpoint not stored",
        "completion not stored",
        "attempt failed",
        "lease not extended",
        "failure not recorded",
    ] {
        let hit = logs.lines().find(|l| l.contains(bad));
        assert!(hit.is_none(), "a worker logged {bad:?}: {hit:?}");
    }
    format!(
        "{n} runs completed on attempt 1, {} step rows, {} executions (max 1 per step)",
        totals.rows, summary.executions
    )
}

/// (i) The failpoint: 30% of flushes that committed are reported failed.
#[sqlx::test(migrations = false)]
async fn failpoint_after_commit_is_adopted_not_repeated(_p: PgPoolOptions, opts: PgConnectOptions) {
    let started = Instant::now();
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    c.spawn_many(2, config().failpoints("checkpoint-after-commit=30%error")).await.unwrap();
    let fired = |c: &Cluster| -> u64 {
        c.workers()
            .iter()
            .map(|w| {
                w.log()
                    .lines()
                    .filter(|l| l.contains("failpoint fired") && l.contains("checkpoint-after-commit"))
                    .count() as u64
            })
            .sum()
    };
    let mut runs = Vec::new();
    let mut n = 0;
    while fired(&c) < target() {
        assert!(runs.len() < 20 * target() as usize, "the failpoint fired only {} times", fired(&c));
        let wave = c.send_five_steps((n..n + 50).map(FiveSteps::new)).await.unwrap();
        n += 50;
        c.wait_finished(&wave, Duration::from_secs(60)).await.unwrap();
        runs.extend(wave);
    }
    let fires = fired(&c);
    let summary = check_no_duplicates_no_conflicts(&mut c, &runs).await;
    eprintln!(
        "ambiguous_commit (failpoint): {fires} flushes committed and reported failed; {summary}; {:.1?}",
        started.elapsed()
    );
}

/// (ii) The proxy: the reply to the group-commit statement is swallowed and
/// the connection closed, one flush at a time, until `target()` cuts landed
/// after a successful commit.
#[sqlx::test(migrations = false)]
async fn connection_dropped_after_commit_is_adopted_not_repeated(_p: PgPoolOptions, opts: PgConnectOptions) {
    let started = Instant::now();
    let url = url_of(&opts);
    let proxy = Proxy::start(&url).await.unwrap();
    let mut c = Cluster::start(BIN, &url).await.unwrap();
    c.spawn_many(2, config().database_url(proxy.url(0))).await.unwrap();

    let mut runs = c.send_five_steps((0..50).map(FiveSteps::new)).await.unwrap();
    let mut next = 50;
    let deadline = Instant::now() + Duration::from_secs(120);
    // After each cut, three group commits pass (the retry is usually one of them).
    proxy.cut_after_reply(FLUSH_SQL, u64::MAX, 3);
    while proxy.cuts().1 < target() {
        assert!(Instant::now() < deadline, "only {:?} cuts (all, committed) in time", proxy.cuts());
        // Keep flushes coming.
        if checks::unfinished_among(c.pool(), &runs).await.unwrap() < 8 {
            runs.extend(c.send_five_steps((next..next + 25).map(FiveSteps::new)).await.unwrap());
            next += 25;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.cut_after_reply(FLUSH_SQL, 0, 0);
    c.wait_finished(&runs, Duration::from_secs(60)).await.unwrap();
    let (cuts, committed) = proxy.cuts();
    let summary = check_no_duplicates_no_conflicts(&mut c, &runs).await;
    eprintln!(
        "ambiguous_commit (proxy): {cuts} connections cut after the reply to the group commit \
         ({committed} of them after a successful commit); {summary}; {:.1?}",
        started.elapsed()
    );
}
