//! SIGKILL at random: 4 worker processes drain 1,000 five-step runs (soak tier,
//! `DURASTEP_SOAK=1`: 10,000) while the harness SIGKILLs a random worker every
//! 0.5-3 s and restarts it at once. The schedule comes from a seed that the
//! test prints; `DURASTEP_SEED=<n>` replays it.
//!
//! Checked by SQL over the ledger (what the step bodies really did) and the
//! engine's tables, never over what the workers report:
//! - every run completed, none failed, each output and each stored step equal
//!   to the oracle (G1, G8: a lost attempt is retried);
//! - 0 stored steps executed again: no step body started after its step's
//!   checkpoint was written (G2; see `checks::executions_after_checkpoint`);
//! - extra executions are bounded by the steps in flight at the kills: every
//!   execution whose own attempt did not store its result was either cut short
//!   by its process's kill (its attempt lost the run after the kill, by the
//!   run's history) or lost with a lease reaped from a live process (a starved
//!   heartbeat; G1 allows it, the test reports it and allows few); each kill
//!   accounts for at most `max_in_flight` of them, and the repeats (executions
//!   beyond the first of each step) are at most their sum (G1). A failure
//!   prints the lost executions with their runs' history.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

use durastep_testkit::tier::{self, Rng};
use durastep_testkit::{Cluster, FiveSteps, WorkerConfig, checks, ledger, url_of};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const WORKERS: usize = 4;
/// Attempts in flight per worker: the most steps one kill can cut short.
const IN_FLIGHT: usize = 8;

struct Kill {
    at: Duration,
    /// The database's clock just after the process was gone.
    at_db: DateTime<Utc>,
    worker: usize,
    pid: u32,
}

#[sqlx::test(migrations = false)]
async fn random_sigkills_lose_nothing_and_repeat_only_steps_in_flight(_p: PgPoolOptions, opts: PgConnectOptions) {
    let seed = tier::seed("kill_random");
    let mut rng = Rng::new(seed);
    let runs_n: u64 = tier::scaled(1_000, 10_000);
    let deadline = Duration::from_secs(tier::scaled(240, 3_600));

    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    // Step bodies sleep a little so that kills land mid-body as well as between
    // steps, and so the CPU is not saturated: a starved heartbeat would lose a
    // lease without a kill, which this test counts as unexplained.
    let config = WorkerConfig {
        lease: Duration::from_secs(3),
        max_in_flight: IN_FLIGHT,
        claim_batch: IN_FLIGHT,
        step_delay: Duration::from_millis(150),
        pool_size: 3,
        ..WorkerConfig::default()
    };
    let runs = c.send_five_steps((0..runs_n).map(FiveSteps::new)).await.unwrap();
    c.spawn_many(WORKERS, config).await.unwrap();
    let started = Instant::now();

    let mut kills: Vec<Kill> = Vec::new();
    'outer: loop {
        // The next kill comes 0.5-3 s after the previous one (or when all runs are done).
        let until = Instant::now() + Duration::from_millis(rng.range(500, 3_001));
        loop {
            if checks::unfinished_among(c.pool(), &runs).await.unwrap() == 0 {
                break 'outer;
            }
            let now = Instant::now();
            if now >= until {
                break;
            }
            tokio::time::sleep((until - now).min(Duration::from_millis(100))).await;
        }
        assert!(started.elapsed() < deadline, "runs still unfinished after {deadline:?}; seed {seed}");
        let worker = rng.range(0, WORKERS as u64) as usize;
        let pid = c.worker(worker).pid();
        let status = c.worker(worker).kill().await.unwrap();
        assert_eq!(status.signal(), Some(9), "worker {worker} had died on its own before the kill: {status}");
        let at_db: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()").fetch_one(c.pool()).await.unwrap();
        kills.push(Kill { at: started.elapsed(), at_db, worker, pid });
        c.restart(worker).await.unwrap();
    }
    let drained = started.elapsed();
    for (i, status) in c.shutdown(Duration::from_secs(30)).await.unwrap() {
        assert!(status.success(), "worker {i} did not shut down cleanly: {status}");
    }
    let pool = c.pool();

    // All runs completed, none failed, outputs equal their oracle.
    let states = checks::run_states(pool).await.unwrap();
    assert_eq!(states.get("completed").copied(), Some(runs_n as i64), "{states:?}; seed {seed}");
    assert_eq!(states.len(), 1, "runs in other states: {states:?}; seed {seed}");
    let problems = checks::five_steps_mismatches(pool).await.unwrap();
    assert!(problems.is_empty(), "{} oracle mismatches, first: {:?}; seed {seed}", problems.len(), problems.first());
    let totals = checks::step_result_totals(pool).await.unwrap();
    assert_eq!((totals.rows, totals.distinct_steps), (runs_n as i64 * 5, runs_n as i64 * 5));

    // 0 stored steps executed again.
    let late = checks::executions_after_checkpoint(pool).await.unwrap();
    assert!(
        late.is_empty(),
        "{} step bodies started after their checkpoint was stored: {late:?}; seed {seed}",
        late.len()
    );

    // Extra executions bounded by the steps in flight at each kill. Each
    // execution whose own attempt did not store its result is told apart by
    // when that attempt lost the run (the run's history): at or after its
    // process's kill, the kill cut it short; before, the process lost the
    // lease while it lived (reaped: its heartbeat was late, as on a starved
    // machine), which G1 also allows, and which the test reports apart.
    let summary = ledger::summary(pool).await.unwrap();
    assert_eq!(summary.steps, runs_n as i64 * 5, "{summary:?}");
    let extra = summary.executions - summary.steps;
    let killed_at: BTreeMap<i32, DateTime<Utc>> = kills.iter().map(|k| (k.pid as i32, k.at_db)).collect();
    let mut cut: BTreeMap<i32, Vec<checks::UnstoredExecution>> = BTreeMap::new();
    let mut lost_alive: Vec<checks::UnstoredExecution> = Vec::new();
    let mut unexplained: Vec<checks::UnstoredExecution> = Vec::new();
    for x in checks::unstored_executions(pool).await.unwrap() {
        let Some(ended) = x.attempt_ended_at else {
            unexplained.push(x);
            continue;
        };
        match killed_at.get(&x.pid) {
            Some(k) if ended >= *k => cut.entry(x.pid).or_default().push(x),
            _ if x.attempt_ended_as.as_deref() == Some("queued") => lost_alive.push(x),
            _ => unexplained.push(x),
        }
    }
    if let Some(x) = unexplained.first() {
        panic!(
            "{} executions lost before their checkpoint, neither cut short by a kill nor by a reaped lease; first: \
             {x:?}, its run's history:\n{}\nseed {seed}",
            unexplained.len(),
            checks::history_text(pool, x.run_id).await.unwrap()
        );
    }
    let in_flight: Vec<i64> = kills.iter().map(|k| cut.get(&(k.pid as i32)).map_or(0, |v| v.len() as i64)).collect();
    for (k, n) in kills.iter().zip(&in_flight) {
        if *n > IN_FLIGHT as i64 {
            let xs = &cut[&(k.pid as i32)];
            let mut detail = String::new();
            for x in xs {
                detail += &format!("\n{x:?}\n{}", checks::history_text(pool, x.run_id).await.unwrap());
            }
            panic!(
                "kill of pid {} at {} cut {n} steps short, more than {IN_FLIGHT} in flight; seed {seed}{detail}",
                k.pid, k.at_db
            );
        }
    }
    // A few leases lost by live processes are allowed (G1); many would mean
    // this test no longer measures kills (the lease tests cover heartbeats).
    let lost_attempts: BTreeSet<(uuid::Uuid, Option<i64>)> =
        lost_alive.iter().map(|x| (x.run_id, x.lease_epoch)).collect();
    assert!(
        lost_attempts.len() as u64 <= runs_n / 20,
        "{} attempts lost their lease in processes that were alive: {:?}; seed {seed}",
        lost_attempts.len(),
        lost_alive.first()
    );
    let bound: i64 = in_flight.iter().sum::<i64>() + lost_alive.len() as i64;
    assert!(
        extra <= bound,
        "{extra} extra executions, but only {bound} steps were in flight at the kills or in reaped attempts; seed {seed}"
    );
    assert!(!kills.is_empty(), "no kill happened: the test proved nothing");

    let schedule: Vec<String> =
        kills.iter().zip(&in_flight).map(|(k, n)| format!("{:.1}s:w{}:{n}", k.at.as_secs_f64(), k.worker)).collect();
    eprintln!(
        "kill_random: seed {seed}: {runs_n} runs x 5 steps, {WORKERS} processes, {} SIGKILLs in {drained:.1?} \
         ({:.0} runs/s); all completed, 0 failed, 0 oracle mismatches; 0 stored steps executed again; \
         {extra} extra executions <= {bound} steps in flight at the kills (max {} per kill, limit {IN_FLIGHT}) \
         or in {} attempts reaped from live processes ({} steps); unfinished bodies {}; kills (time:worker:steps in flight): {}",
        kills.len(),
        runs_n as f64 / drained.as_secs_f64(),
        in_flight.iter().max().copied().unwrap_or(0),
        lost_attempts.len(),
        lost_alive.len(),
        summary.unfinished,
        schedule.join(" "),
    );
}
