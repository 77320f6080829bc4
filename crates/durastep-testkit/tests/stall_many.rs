//! Stalls past the lease, 200 times (soak tier: 2,000): 20 rounds in which
//! worker A is frozen (SIGSTOP) in the middle of the `slow` step of 10 runs.
//!
//! Each round: A claims 10 slow-step runs and starts their slow bodies; the
//! harness freezes A and moves the database clock past A's lease (no real
//! waiting); a fresh worker B reaps the runs, executes them and completes them;
//! then A is resumed. A's bodies end and A tries to store their results with
//! its old lease epoch. A's lease and heartbeat are long (10 min), so nothing
//! but the checkpoint's fencing check stands between its late results and the
//! database.
//!
//! The slow body calls an external service (a table with a UNIQUE idempotency
//! key, `testkit_external`) with `ctx.idempotency_key()` + ":slow", as G1
//! advises; A's late call comes after B's.
//!
//! Checked by SQL: 200 stale checkpoints rejected (A's 200 bodies all reached
//! their checkpoint, none of their results is stored), 0 accepted; A writes
//! nothing more for those runs (their rows are unchanged after A resumes, and A
//! starts no other step body); the external service saw 400 calls, made 200
//! writes, 0 duplicates; every run completed with its oracle's output (G4, G1).

use std::time::{Duration, Instant};

use durastep_testkit::{Cluster, SlowStep, WorkerConfig, checks, ledger, tier, url_of, wait_for};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const WAIT: Duration = Duration::from_secs(30);
/// Runs frozen per stall.
const PER_STALL: usize = 10;

#[sqlx::test(migrations = false)]
async fn two_hundred_stale_checkpoints_are_all_rejected(_p: PgPoolOptions, opts: PgConnectOptions) {
    let stalls = tier::scaled(20, 200);
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let long = Duration::from_secs(600);
    // A's slow body (1 s) outlasts the harness's reaction (it is frozen a few
    // tens of ms in) and is over soon after A is resumed. A is paused while a
    // stall's runs are sent, so that one claim takes all of them and their
    // bodies start together: sent one by one to a running A on a busy
    // machine, the first body could end before the last one started.
    let a_config = WorkerConfig {
        lease: long,
        heartbeat: long,
        slow_step: Duration::from_millis(1000),
        max_in_flight: 16,
        claim_batch: 16,
        ..WorkerConfig::default()
    };
    let b_config = WorkerConfig {
        slow_step: Duration::ZERO,
        reap: Duration::from_millis(20),
        poll: Duration::from_millis(20),
        pool_size: 2,
        ..WorkerConfig::default()
    };
    let a = c.spawn(a_config).await.unwrap();
    let a_pid = c.worker(a).pid() as i32;
    let mut b: Option<usize> = None;
    let started = Instant::now();
    let mut all_runs: Vec<Uuid> = Vec::new();

    for stall in 0..stalls {
        let mut runs = Vec::with_capacity(PER_STALL);
        c.worker(a).pause().await.unwrap();
        for i in 0..PER_STALL {
            let n = (stall * PER_STALL + i) as u64;
            runs.push(c.send_slow_step(SlowStep { n, sleep_ms: None }).await.unwrap());
        }
        c.worker(a).resume().await.unwrap();
        let pool = c.pool().clone();
        let mine = runs.clone();
        wait_for("A to start the slow bodies of this stall's runs", WAIT, || {
            let (pool, mine) = (pool.clone(), mine.clone());
            async move {
                let rows = ledger::executions_since(&pool, 0).await?;
                let started = rows.iter().filter(|e| e.pid == a_pid && mine.contains(&e.run_id)).count();
                Ok((started == PER_STALL).then_some(()))
            }
        })
        .await
        .unwrap();
        c.worker(a).pause().await.unwrap();
        let frozen: Vec<ledger::Execution> = ledger::executions_since(c.pool(), 0)
            .await
            .unwrap()
            .into_iter()
            .filter(|e| e.pid == a_pid && runs.contains(&e.run_id))
            .collect();
        assert!(frozen.iter().all(|e| e.ended_at.is_none()), "A must be frozen mid-body: {frozen:?}");
        c.advance_clock(2 * long).await.unwrap();

        // B takes the runs over and completes them.
        match b {
            None => b = Some(c.spawn(b_config.clone()).await.unwrap()),
            Some(i) => {
                c.restart(i).await.unwrap();
            }
        }
        c.wait_finished(&runs, WAIT).await.unwrap();
        let done = checks::runs(c.pool(), &runs).await.unwrap();
        assert!(done.iter().all(|r| r.state == "completed"), "{done:?}");
        let mark = ledger::high_water(c.pool()).await.unwrap();

        // A resumes: its bodies end, its checkpoints are refused.
        let fenced_before = c.worker(a).log().matches("attempt fenced").count();
        c.worker(a).resume().await.unwrap();
        let pool = c.pool().clone();
        let mine = runs.clone();
        wait_for("A's frozen bodies to end", WAIT, || {
            let (pool, mine) = (pool.clone(), mine.clone());
            async move {
                let rows = ledger::executions_since(&pool, 0).await?;
                let ended =
                    rows.iter().filter(|e| e.pid == a_pid && mine.contains(&e.run_id) && e.ended_at.is_some()).count();
                Ok((ended == PER_STALL).then_some(()))
            }
        })
        .await
        .unwrap();
        let want = fenced_before + PER_STALL;
        let what = format!("{want} 'attempt fenced' lines in A's log");
        let log_path = c.worker(a).log_path().to_owned();
        wait_for(&what, WAIT, || {
            let log_path = log_path.clone();
            async move {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                Ok((log.matches("attempt fenced").count() >= want).then_some(()))
            }
        })
        .await
        .unwrap();
        let status = c.worker(b.unwrap()).terminate(WAIT).await.unwrap();
        assert!(status.success(), "B: {status}");

        // A wrote nothing more for these runs and started nothing else.
        assert_eq!(checks::runs(c.pool(), &runs).await.unwrap(), done, "stall {stall}: A's late writes changed a run");
        let late: Vec<_> =
            ledger::executions_since(c.pool(), mark).await.unwrap().into_iter().filter(|e| e.pid == a_pid).collect();
        assert!(late.is_empty(), "stall {stall}: A started step bodies after it lost its leases: {late:?}");
        all_runs.extend(runs);
    }
    let took = started.elapsed();
    let status = c.worker(a).terminate(WAIT).await.unwrap();
    assert!(status.success(), "A: {status}");
    let a_log = c.worker(a).log();
    let pool = c.pool();

    // 200 stale checkpoints rejected, 0 accepted.
    let a_rows: Vec<ledger::Execution> =
        ledger::executions_since(pool, 0).await.unwrap().into_iter().filter(|e| e.pid == a_pid).collect();
    let total = stalls * PER_STALL;
    assert_eq!(a_rows.len(), total, "A ran exactly the bodies it was frozen in");
    assert!(
        a_rows.iter().all(|e| e.step_key == "slow" && e.ended_at.is_some()),
        "every frozen body reached its checkpoint"
    );
    let unstored: i64 = checks::unstored_executions_per_pid(pool)
        .await
        .unwrap()
        .into_iter()
        .find(|(pid, _)| *pid == a_pid)
        .map_or(0, |(_, n)| n);
    let accepted = a_rows.len() as i64 - unstored;
    assert_eq!((unstored, accepted), (total as i64, 0), "stale checkpoints rejected / accepted");
    let fences = a_log.matches("attempt fenced").count();
    assert_eq!(fences, total, "A's log reports one refused checkpoint per frozen body");

    // No stored step ran again; outputs are the oracle's; the external service wrote once per run.
    assert!(checks::executions_after_checkpoint(pool).await.unwrap().is_empty());
    let problems = checks::slow_step_mismatches(pool).await.unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(checks::count_in_state(pool, &all_runs, "completed").await.unwrap(), total as i64);
    let ext = ledger::external_summary(pool).await.unwrap();
    assert_eq!(ext.duplicates, 0, "{ext:?}");
    assert_eq!((ext.calls, ext.writes, ext.deduplicated), (2 * total as i64, total as i64, total as i64), "{ext:?}");

    eprintln!(
        "stall_many: {stalls} SIGSTOPs past the lease x {PER_STALL} runs in {took:.1?}: {unstored} stale checkpoints \
         rejected, {accepted} accepted; 0 writes by the stale worker after resuming; external service: {} calls, \
         {} writes, {} deduplicated by the idempotency key, {} duplicates",
        ext.calls, ext.writes, ext.deduplicated, ext.duplicates
    );
}
