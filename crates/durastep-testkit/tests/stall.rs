//! Stalls across processes: a worker is frozen (SIGSTOP) past its lease while
//! it holds a run, another process takes the run over, and the stale worker
//! is resumed (SIGCONT).
//!
//! Invariant 3 of the design: a worker that lost its lease cannot store a
//! result or finish the run (fencing), and it stops running that handler. The
//! ledger shows what the stale process did after it was resumed.

use std::time::Duration;

use durastep_testkit::{
    Cluster, FiveSteps, SlowStep, WorkerConfig, checks, five_steps_key, five_steps_oracle, ledger, slow_step_oracle,
    url_of, wait_for,
};
use serde_json::Value;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const WAIT: Duration = Duration::from_secs(20);
/// Long enough that the stale worker's body is still running when it is
/// stopped, and short enough that it is over by the time it is resumed (the
/// takeover alone needs a 2 s lease to expire).
const SLOW_MS: u64 = 2_000;

/// Waits until `pid` has started the body of `step` of `run`; returns its ledger row.
async fn started(pool: &PgPool, run: Uuid, step: &str, pid: u32) -> ledger::Execution {
    let what = format!("pid {pid} to start {step}");
    wait_for(&what, WAIT, || async move {
        let rows = ledger::executions_of_step(pool, run, step).await?;
        Ok(rows.into_iter().find(|e| e.pid == pid as i32))
    })
    .await
    .unwrap()
}

/// Worker a is frozen mid-step past its lease; b reaps the run and executes it.
/// a is resumed while b is still in the same step: whatever a does then (its
/// body ends and its checkpoint is refused, or its own heartbeat notices the
/// lost lease first and drops the handler), it stores nothing, starts no
/// further step body for the run, and shuts down cleanly.
#[sqlx::test(migrations = false)]
async fn stopped_past_lease_then_resumed(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let run = c.send_slow_step(SlowStep { n: 7, sleep_ms: Some(SLOW_MS) }).await.unwrap();
    let a = c.spawn(WorkerConfig::default()).await.unwrap();
    let a_pid = c.worker(a).pid();
    let a_row = started(c.pool(), run, "slow", a_pid).await;
    c.worker(a).pause().await.unwrap();
    let a_row = ledger::executions_of_step(c.pool(), run, "slow").await.unwrap().into_iter().find(|e| e.id == a_row.id);
    assert!(a_row.as_ref().is_some_and(|e| e.ended_at.is_none()), "a must be stopped mid-body: {a_row:?}");
    let a_epoch = a_row.unwrap().lease_epoch.unwrap();

    let b = c.spawn(WorkerConfig::default()).await.unwrap();
    let b_pid = c.worker(b).pid();
    let b_row = started(c.pool(), run, "slow", b_pid).await;
    let b_epoch = b_row.lease_epoch.unwrap();
    assert!(b_epoch > a_epoch, "b's claim bumped the epoch: {a_epoch} -> {b_epoch}");

    let mark = ledger::high_water(c.pool()).await.unwrap();
    c.worker(a).resume().await.unwrap();
    let done = checks::wait_state(c.pool(), run, "completed", WAIT).await.unwrap();
    // a has had b's whole slow step to act; a graceful exit waits for any handler it still runs.
    let status = c.worker(a).terminate(WAIT).await.unwrap();
    assert!(status.success(), "a: {status}\n{}", c.worker(a).log_tail(20));

    assert_eq!(done.output, Some(Value::from(slow_step_oracle(7))));
    assert_eq!(done.lease_epoch, b_epoch);
    for s in checks::step_results(c.pool(), run).await.unwrap() {
        assert_eq!(s.lease_epoch, b_epoch, "only b's attempt may store results: {s:?}");
    }
    let after_resume: Vec<_> =
        ledger::executions_since(c.pool(), mark).await.unwrap().into_iter().filter(|e| e.pid == a_pid as i32).collect();
    assert!(after_resume.is_empty(), "a started step bodies after it lost its lease: {after_resume:?}");
    let a_rows: Vec<_> =
        ledger::executions_of_run(c.pool(), run).await.unwrap().into_iter().filter(|e| e.pid == a_pid as i32).collect();
    assert_eq!(a_rows.len(), 1, "a ran only the step it was frozen in: {a_rows:?}");
    let b_steps: Vec<String> = ledger::executions_of_run(c.pool(), run)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.pid == b_pid as i32)
        .map(|e| e.step_key)
        .collect();
    assert_eq!(b_steps, ["slow", "after"]);
    assert!(checks::slow_step_mismatches(c.pool()).await.unwrap().is_empty());
}

/// Like the test above, but a's lease and heartbeat are long (60 s; its first
/// heartbeat would come after 20 s) and it is the database clock that moves
/// past the lease. So after the resume nothing but the fencing check of the
/// checkpoint stands between a's late step result and the database: a's body
/// must finish, its result must be refused, and its handler must not go on to
/// the next step.
#[sqlx::test(migrations = false)]
async fn late_step_result_is_fenced(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let run = c.send_slow_step(SlowStep { n: 8, sleep_ms: Some(SLOW_MS) }).await.unwrap();
    let long = Duration::from_secs(60);
    let a = c.spawn(WorkerConfig { lease: long, heartbeat: long, ..WorkerConfig::default() }).await.unwrap();
    let a_pid = c.worker(a).pid();
    let a_row = started(c.pool(), run, "slow", a_pid).await;
    c.worker(a).pause().await.unwrap();
    c.advance_clock(2 * long).await.unwrap();

    let b = c.spawn(WorkerConfig::default()).await.unwrap();
    let b_pid = c.worker(b).pid();
    let b_row = started(c.pool(), run, "slow", b_pid).await;
    c.worker(a).resume().await.unwrap();

    // a's body ends (its sleep is over, or nearly), then its checkpoint is refused.
    let pool = c.pool().clone();
    wait_for("a's slow body to end", WAIT, || {
        let pool = pool.clone();
        async move {
            let rows = ledger::executions_of_step(&pool, run, "slow").await?;
            Ok(rows.into_iter().find(|e| e.id == a_row.id && e.ended_at.is_some()))
        }
    })
    .await
    .unwrap();
    c.worker(a).wait_for_log("attempt fenced", WAIT).await.unwrap();

    let done = checks::wait_state(c.pool(), run, "completed", WAIT).await.unwrap();
    let status = c.worker(a).terminate(WAIT).await.unwrap();
    assert!(status.success(), "a: {status}");
    assert_eq!(done.output, Some(Value::from(slow_step_oracle(8))));
    let b_epoch = b_row.lease_epoch.unwrap();
    assert!(b_epoch > a_row.lease_epoch.unwrap());
    for s in checks::step_results(c.pool(), run).await.unwrap() {
        assert_eq!(s.lease_epoch, b_epoch, "a's late result must be refused: {s:?}");
    }
    let a_steps: Vec<String> = ledger::executions_of_run(c.pool(), run)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.pid == a_pid as i32)
        .map(|e| e.step_key)
        .collect();
    assert_eq!(a_steps, ["slow"], "a's handler must stop at the refused checkpoint");
}

/// a has stored all five steps and is about to write the completion (a
/// failpoint holds it there) when it is frozen. b takes over, replays the five
/// stored steps without running them, and completes the run. a, resumed, tries
/// to complete with its old epoch: refused, and the run row is unchanged.
#[sqlx::test(migrations = false)]
async fn late_completion_is_fenced(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let run = c.send_five_steps([FiveSteps::new(11)]).await.unwrap()[0];
    let a = c.spawn(WorkerConfig::default().failpoints("complete-before-commit=pause(3000)")).await.unwrap();
    let a_pid = c.worker(a).pid() as i32;

    let pool = c.pool().clone();
    wait_for("a to store five steps", WAIT, || {
        let pool = pool.clone();
        async move { Ok((checks::step_results(&pool, run).await?.len() == 5).then_some(())) }
    })
    .await
    .unwrap();
    c.worker(a).pause().await.unwrap();
    let held = checks::run(c.pool(), run).await.unwrap();
    assert_eq!(held.state, "running", "a must be frozen before its completion: {held:?}");

    c.spawn(WorkerConfig::default()).await.unwrap();
    let done = checks::wait_state(c.pool(), run, "completed", WAIT).await.unwrap();
    assert!(done.lease_epoch > held.lease_epoch);
    c.worker(a).resume().await.unwrap();
    c.worker(a).wait_for_log("completion fenced", WAIT).await.unwrap();
    let status = c.worker(a).terminate(WAIT).await.unwrap();
    assert!(status.success(), "a: {status}");

    assert_eq!(checks::run(c.pool(), run).await.unwrap(), done, "a's late completion changed the run");
    assert_eq!(done.output, Some(Value::from(five_steps_oracle(11))));
    let who: Vec<(String, i32)> =
        ledger::executions_of_run(c.pool(), run).await.unwrap().into_iter().map(|e| (e.step_key, e.pid)).collect();
    let want: Vec<(String, i32)> = (1..=5).map(|i| (five_steps_key(i), a_pid)).collect();
    assert_eq!(who, want, "every step ran once, by a; b only replayed them");
    for s in checks::step_results(c.pool(), run).await.unwrap() {
        assert_eq!(s.lease_epoch, held.lease_epoch, "{s:?}");
    }
}
