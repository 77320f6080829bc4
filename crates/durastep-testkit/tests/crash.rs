//! Crash durability across processes: a worker process dies in the middle of a
//! five-step run and another process finishes it.
//!
//! Invariants 1 and 2 of the design: a step whose result is stored never runs
//! again, and a step runs twice only if its worker died between running it and
//! storing its result. The ledger (written outside the checkpoints) is the
//! witness of how often each step body really ran.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use durastep_testkit::{
    Cluster, FiveSteps, WorkerConfig, checks, five_steps_key, five_steps_oracle, five_steps_step_output, ledger,
    url_of, wait_for,
};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const WAIT: Duration = Duration::from_secs(20);

/// The worker exits abruptly (the `exit` failpoint: no destructor, no shutdown,
/// code 137 as after SIGKILL) right after the checkpoint of step 2 committed.
/// A second process takes the run over once the lease expires: steps 1 and 2
/// are not run again, steps 3 to 5 run once, and the output is the oracle's.
#[sqlx::test(migrations = false)]
async fn killed_after_step_two_then_finished_by_another_process(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let run = c.send_five_steps([FiveSteps::new(5)]).await.unwrap()[0];

    let a = c.spawn(WorkerConfig::default().failpoints("step-after-checkpoint=2*exit")).await.unwrap();
    let a_pid = c.worker(a).pid() as i32;
    let status = c.worker(a).wait_exit(WAIT).await.unwrap();
    assert_eq!(status.code(), Some(137), "the failpoint should have ended worker a: {status}");
    let stored = checks::step_results(c.pool(), run).await.unwrap();
    let keys: Vec<&str> = stored.iter().map(|s| s.step_key.as_str()).collect();
    assert_eq!(keys, ["step-1", "step-2"], "a died right after storing step 2");
    assert_eq!(checks::run(c.pool(), run).await.unwrap().state, "running", "a's lease is still on the run");

    let b = c.spawn(WorkerConfig::default()).await.unwrap();
    let b_pid = c.worker(b).pid() as i32;
    let done = checks::wait_state(c.pool(), run, "completed", WAIT).await.unwrap();
    assert_eq!(done.output, Some(Value::from(five_steps_oracle(5))));
    assert_eq!(done.attempt, 2, "the lost attempt counts: {done:?}");

    let runs = ledger::executions_of_run(c.pool(), run).await.unwrap();
    let who: Vec<(String, i32)> = runs.iter().map(|e| (e.step_key.clone(), e.pid)).collect();
    let want: Vec<(String, i32)> = (1..=5).map(|i| (five_steps_key(i), if i <= 2 { a_pid } else { b_pid })).collect();
    assert_eq!(who, want, "each step body ran exactly once, steps 1-2 by a and 3-5 by b");
    assert!(runs.iter().all(|e| e.ended_at.is_some()), "{runs:?}");

    let a_epoch = runs[0].lease_epoch.unwrap();
    let b_epoch = runs[4].lease_epoch.unwrap();
    assert!(b_epoch > a_epoch, "b's claim bumped the epoch: {a_epoch} -> {b_epoch}");
    for (i, s) in checks::step_results(c.pool(), run).await.unwrap().iter().enumerate() {
        let i = i as u32 + 1;
        assert_eq!(s.step_key, five_steps_key(i));
        assert_eq!(s.output, Value::from(five_steps_step_output(5, i)));
        assert_eq!(s.lease_epoch, if i <= 2 { a_epoch } else { b_epoch }, "{s:?}");
    }
    for (i, status) in c.shutdown(WAIT).await.unwrap() {
        assert!(status.success(), "worker {i} did not shut down cleanly: {status}");
    }
}

/// The harness SIGKILLs the worker while the body of step 3 is running (each
/// body takes 400 ms). The restarted process runs step 3 again (the only step
/// allowed to run twice: its worker died before its checkpoint), then steps 4
/// and 5 once.
#[sqlx::test(migrations = false)]
async fn sigkill_mid_step_then_restart(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let run = c.send_five_steps([FiveSteps { n: 9, delay_ms: Some(400) }]).await.unwrap()[0];
    let a = c.spawn(WorkerConfig::default()).await.unwrap();
    let old_pid = c.worker(a).pid() as i32;

    let pool = c.pool().clone();
    wait_for("step 3 to start", WAIT, || {
        let pool = pool.clone();
        async move { Ok((!ledger::executions_of_step(&pool, run, "step-3").await?.is_empty()).then_some(())) }
    })
    .await
    .unwrap();
    let status = c.worker(a).kill().await.unwrap();
    assert_eq!(status.signal(), Some(9), "{status}");

    let cut = ledger::executions_of_step(c.pool(), run, "step-3").await.unwrap();
    assert!(cut.len() == 1 && cut[0].ended_at.is_none(), "the kill should land mid-body: {cut:?}");
    assert_eq!(checks::step_results(c.pool(), run).await.unwrap().len(), 2);

    let new_pid = c.restart(a).await.unwrap() as i32;
    let done = checks::wait_state(c.pool(), run, "completed", WAIT).await.unwrap();
    assert_eq!(done.output, Some(Value::from(five_steps_oracle(9))));

    let runs = ledger::executions_of_run(c.pool(), run).await.unwrap();
    let who: Vec<(&str, i32, bool)> = runs.iter().map(|e| (e.step_key.as_str(), e.pid, e.ended_at.is_some())).collect();
    assert_eq!(
        who,
        [
            ("step-1", old_pid, true),
            ("step-2", old_pid, true),
            ("step-3", old_pid, false),
            ("step-3", new_pid, true),
            ("step-4", new_pid, true),
            ("step-5", new_pid, true),
        ],
    );
    assert!(checks::five_steps_mismatches(c.pool()).await.unwrap().is_empty());
    for (i, status) in c.shutdown(WAIT).await.unwrap() {
        assert!(status.success(), "worker {i} did not shut down cleanly: {status}");
    }
}
