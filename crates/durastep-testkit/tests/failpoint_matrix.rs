//! The failpoint matrix: every failpoint of the engine x {exit, panic, error},
//! 50 runs each (soak tier, `DURASTEP_SOAK=1`: 200), each run hit by exactly
//! one fault. The duplicate-execution count of every cell must match the model.
//!
//! One worker process per failpoint, each in a database of its own (so the
//! failpoints' cells run side by side and moving one database's clock disturbs
//! no other), executes one run at a time (`max_in_flight = 1`) of the `mixed`
//! test function: step `one`, step_tx `record`, durable sleep `nap`, step `two`,
//! completion; every failpoint lies on that path. Each trial arms the failpoint
//! in the live process over its stdin to fire once, at hit N (N drawn from the
//! seed among the hits one run makes), sends one run and waits for it to finish.
//! The run is sent with a start time (now), so that its send never hands it
//! to the idle worker through the worker's offer (migration 0036): every run
//! here is claimed, as the claim failpoints' hit counts assume. Hand-overs
//! have their own faults (`handoff.rs`, `crates/durastep/tests/offers.rs`)
//! and meet the random ones of the workload.
//! After an `exit` (code 137, like SIGKILL) the harness restarts the worker; a
//! run left `running` by a dead or departed holder is recovered by moving the
//! database clock past the lease (no waiting).
//!
//! **The model** (G1, G2, G3, G4, G8, G10): a fault never makes a stored step
//! run again (0 executions after a checkpoint, in every cell); it makes the
//! step run once more (exactly 1 extra execution) when it lands between the
//! step's body and its checkpoint's commit, and otherwise not at all (0). Per
//! failpoint, and per hit N where it matters:
//!
//! | failpoint | exit | panic | error |
//! |---|---|---|---|
//! | step-after-body (N: one, nap, two) | 1, 0, 1 | 1, 0, 1 | 1, 0, 1 |
//! | checkpoint-before-commit (N: one, nap, two, completion) | 1, 0, 1, 0 | 1, 0, 1, 0 | 1, 0, 1, 0 |
//! | step-tx-before-commit | 1 | 1 | 1 |
//! | heartbeat | at most 1 (the process dies wherever the run is) | 0 | 0 |
//! | every other failpoint | 0 | 0 | 0 |
//!
//! and the `step_tx` row is written exactly once in every run. **Panics** in
//! the worker's own machinery are contained: a panicking claim round, reaper
//! pass or heartbeat round is a failed round (the heartbeat and reaper tasks
//! and the checkpoint writers are restarted by a supervisor), a panicking
//! flush fails its batch (its steps' attempts are retried), a panicking
//! executor releases its run (its lease expires and it is retried); a panic in
//! a step or handler fails the attempt (G10). The worker process never dies of
//! a panic: after every panic trial it must still be the same live process.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use durastep_testkit::tier::{self, Rng};
use durastep_testkit::{Cluster, Mixed, WorkerConfig, checks, ledger, url_of};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const WAIT: Duration = Duration::from_secs(30);
/// Long, so that a CPU-starved heartbeat never costs a lease (which the model
/// would count as an unexplained extra execution); the runs the model strands
/// are recovered by moving the clock past it, not by waiting.
const LEASE: Duration = Duration::from_secs(10);
const REAPER: &str = "reaper-between-select-and-update";
const HEARTBEAT: &str = "heartbeat";
/// The mixed run's durable sleep: always long enough to suspend; the harness
/// wakes the sleeping run by moving the database clock.
const NAP: Duration = Duration::from_secs(3_600);

/// Every failpoint of the engine (`failpoint!` and `failpoints::eval` in
/// crates/durastep/src), with the number of times one fault-free run of the
/// mixed function reaches it (N is drawn from 1..=hits).
const POINTS: [(&str, u64); 12] = [
    ("claim-before-commit", 2),
    ("claim-after-commit", 2), // claims that got runs: the first one and the one after the nap
    ("step-before-body", 2),   // one, two
    ("step-after-body", 3),    // one, nap, two (the sleep's checkpoint goes the same way)
    ("checkpoint-before-commit", 4), // flushes: one, nap, two, completion
    ("checkpoint-after-commit", 4),
    ("step-after-checkpoint", 3),
    ("step-tx-before-commit", 1),
    ("sleep-after-arming", 1),
    ("complete-before-commit", 1),
    (HEARTBEAT, 1),
    (REAPER, 1),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Act {
    Exit,
    Panic,
    Error,
}

impl Act {
    fn name(self) -> &'static str {
        match self {
            Act::Exit => "exit",
            Act::Panic => "panic",
            Act::Error => "error",
        }
    }
}

const ACTS: [Act; 3] = [Act::Exit, Act::Panic, Act::Error];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extra {
    Exactly(i64),
    AtMost(i64),
}

#[derive(Debug, Clone, Copy)]
struct Prediction {
    extra: Extra,
    /// A live worker is left without the run while the run stays `running`
    /// (the claim's or the completion's answer was lost): only the reaper,
    /// after the lease, brings it back. (After `exit` the harness sees it by SQL.)
    strands: bool,
}

/// The model: what one fault at hit `n` of `point` does to one mixed run.
fn model(point: &str, act: Act, n: u64) -> Prediction {
    let exact = |k| Prediction { extra: Extra::Exactly(k), strands: false };
    match (point, act) {
        ("step-after-body", _) => exact(if n == 2 { 0 } else { 1 }),
        // The flush fails before its commit (the failpoint's error is not
        // retried): the step's attempt fails and the body runs again; a lost
        // completion leaves the run to the reaper.
        ("checkpoint-before-commit", _) => Prediction {
            extra: Extra::Exactly(if n == 1 || n == 3 { 1 } else { 0 }),
            strands: act != Act::Exit && n == 4,
        },
        ("step-tx-before-commit", _) => exact(1),
        (HEARTBEAT, Act::Exit) => Prediction { extra: Extra::AtMost(1), strands: false },
        ("claim-after-commit" | "complete-before-commit", Act::Panic | Act::Error) => {
            Prediction { extra: Extra::Exactly(0), strands: true }
        }
        _ => exact(0),
    }
}

struct Trial {
    act: Act,
    run: Uuid,
    n: u64,
    prediction: Prediction,
    fired: bool,
}

#[derive(Debug, Default, Clone)]
struct CellResult {
    runs: usize,
    fired: usize,
    completed: usize,
    duplicates: usize,
    extra: i64,
    predicted_exact: i64,
    predicted_at_most: i64,
    tx_effect_problems: usize,
    recoveries: usize,
    millis: u128,
    problems: Vec<String>,
}

/// A database of its own for one failpoint, dropped (with FORCE) when this goes away.
struct ScratchDb {
    admin: PgConnectOptions,
    name: String,
}

impl ScratchDb {
    async fn create(admin: &PgConnectOptions, name: String) -> ScratchDb {
        let mut conn = PgConnection::connect_with(admin).await.unwrap();
        // The name is ours (a fixed prefix, hex and a digit): no injection.
        let sql = format!("CREATE DATABASE \"{name}\"");
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await.unwrap();
        conn.close().await.unwrap();
        ScratchDb { admin: admin.clone(), name }
    }

    fn options(&self) -> PgConnectOptions {
        self.admin.clone().database(&self.name)
    }
}

impl Drop for ScratchDb {
    fn drop(&mut self) {
        let (admin, name) = (self.admin.clone(), self.name.clone());
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
            rt.block_on(async {
                let mut conn = PgConnection::connect_with(&admin).await.ok()?;
                let sql = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
                let _ = sqlx::raw_sql(sqlx::AssertSqlSafe(sql)).execute(&mut conn).await;
                conn.close().await.ok()
            })
        })
        .join();
    }
}

fn worker_config(point: &str) -> WorkerConfig {
    WorkerConfig {
        lease: LEASE,
        // The heartbeat failpoint needs heartbeat rounds while a run is held.
        heartbeat: if point == HEARTBEAT { Duration::from_millis(10) } else { Duration::from_millis(250) },
        poll: Duration::from_millis(10),
        reap: Duration::from_millis(10),
        max_in_flight: 1,
        claim_batch: 1,
        // The model counts claims made for a free slot only: a claim ahead
        // would fall while a step runs (an exit there re-runs that step, as
        // any process death does, but off this table's model).
        claim_ahead: 0,
        pool_size: 2,
        ledger_pool_size: 1,
        // A panic's backtrace costs a debug build ~100 ms; the message is enough.
        env: vec![("RUST_BACKTRACE".into(), "0".into())],
        ..WorkerConfig::default()
    }
}

async fn wait_fired(c: &mut Cluster, w: usize, point: &str, more_than: usize) -> bool {
    let deadline = Instant::now() + WAIT;
    loop {
        if c.worker(w).failpoint_fired(point) > more_than {
            return true;
        }
        if Instant::now() >= deadline || !c.worker(w).is_running().unwrap() {
            return c.worker(w).failpoint_fired(point) > more_than;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One trial: arm, send one run, let the fault happen, recover, wait for the run.
async fn trial(c: &mut Cluster, w: usize, point: &'static str, act: Act, n: u64, seq: u64) -> Trial {
    let prediction = model(point, act, n);
    let config = worker_config(point);
    let pid = c.worker(w).pid();
    let claims_before = c.worker(w).failpoint_fired("claim-after-commit");
    if point == REAPER {
        // Setup: the claim's answer is lost, so the run is left running with a lease to expire.
        c.worker(w).set_failpoint("claim-after-commit", "1*error").await.unwrap();
    }
    let before = c.worker(w).failpoint_fired(point);
    c.worker(w).set_failpoint(point, &format!("{n}*{}", act.name())).await.unwrap();
    let input = Mixed { n: seq, delay_ms: (point == HEARTBEAT).then_some(60), nap_ms: Some(NAP.as_millis() as u64) };
    let run = c.engine().send(input.event().start_at(chrono::Utc::now())).await.unwrap().run_ids[0];
    if point == REAPER {
        assert!(wait_fired(c, w, "claim-after-commit", claims_before).await, "the setup claim failpoint did not fire");
        c.advance_clock(2 * LEASE).await.unwrap();
    }
    // Until the run is finished: react to the fault once it fired, and wake the
    // run whenever it sleeps (the nap is 1 h; nobody holds a sleeping run).
    let (mut fired, mut handled) = (false, false);
    let deadline = Instant::now() + WAIT;
    loop {
        let (state, asleep) = checks::state_and_asleep(c.pool(), run).await.unwrap();
        let done = state == "completed" || state == "failed";
        if !fired {
            // Every fault of the model fires by the run's completion commit at the
            // latest (checkpoint-after-commit on the completion fires just after it).
            fired =
                if done { wait_fired(c, w, point, before).await } else { c.worker(w).failpoint_fired(point) > before };
        }
        if fired && !handled {
            handled = true;
            if act == Act::Exit {
                let status = c.worker(w).wait_exit(WAIT).await.unwrap();
                assert_eq!(status.code(), Some(137), "{point}: the exit action ends the process with 137: {status}");
                // Looked at before the restart, when no live process exists: a run
                // still `running` is held by the dead one. (After the restart the new
                // process may have claimed it, and moving the clock would take it away.)
                let stranded = checks::run(c.pool(), run).await.unwrap().state == "running";
                c.restart_with(w, config.clone()).await.unwrap();
                if stranded {
                    // Expire the dead holder's lease now instead of waiting for it.
                    c.advance_clock(2 * LEASE).await.unwrap();
                }
            } else if prediction.strands {
                c.advance_clock(2 * LEASE).await.unwrap();
            }
        }
        if done {
            break;
        }
        // Only while it is not yet due: once woken it may be claimed at once,
        // and a second move of the clock would expire its new lease.
        if asleep {
            c.advance_clock(NAP + Duration::from_secs(1)).await.unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "{point}={n}*{}: run {run} did not finish ({state}; fault fired: {fired})\n{}",
            act.name(),
            c.worker(w).log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    if act != Act::Exit {
        assert!(c.worker(w).is_running().unwrap(), "{point}={n}*{}: the worker died", act.name());
        assert_eq!(c.worker(w).pid(), pid, "{point}: a {} must not end the worker process", act.name());
    }
    Trial { act, run, n, prediction, fired }
}

/// A run's step executions, for a failure message: `step(pid, attempt, epoch, ended)`.
async fn history(pool: &sqlx::PgPool, run: Uuid) -> String {
    let rows = ledger::executions_of_run(pool, run).await.unwrap_or_default();
    let rows: Vec<String> = rows
        .iter()
        .map(|e| {
            format!(
                "{}(pid {}, attempt {}, epoch {:?}, ended {})",
                e.step_key,
                e.pid,
                e.attempt,
                e.lease_epoch,
                e.ended_at.is_some()
            )
        })
        .collect();
    let state =
        checks::run(pool, run).await.map(|r| format!("{} attempt {} epoch {}", r.state, r.attempt, r.lease_epoch));
    format!("[{}] {state:?}", rows.join(", "))
}

/// Runs the three cells of one failpoint in a database of its own.
async fn failpoint_cells(
    admin: PgConnectOptions,
    db_name: String,
    point: &'static str,
    hits: u64,
    runs_per_cell: usize,
    seed: u64,
) -> Vec<((&'static str, Act), CellResult)> {
    let db = ScratchDb::create(&admin, db_name).await;
    let mut c = Cluster::start(BIN, url_of(&db.options())).await.unwrap();
    let w = c.spawn(worker_config(point)).await.unwrap();
    let mut rng = Rng::new(seed);
    let mut trials = Vec::new();
    let mut seq = 0;
    let mut millis = HashMap::new();
    for act in ACTS {
        let t0 = Instant::now();
        for _ in 0..runs_per_cell {
            seq += 1;
            let n = rng.range(1, hits + 1);
            trials.push(trial(&mut c, w, point, act, n, seq).await);
        }
        millis.insert(act, t0.elapsed().as_millis());
    }
    let status = c.worker(w).terminate(WAIT).await.unwrap();
    assert!(status.success(), "{point}: the worker did not shut down cleanly: {status}");

    // What really happened, by SQL.
    let pool = c.pool();
    let counts = ledger::execution_counts(pool).await.unwrap();
    let mut extra_per_run: HashMap<Uuid, i64> = HashMap::new();
    let mut over_one: Vec<String> = Vec::new();
    for ((run, step), k) in &counts {
        *extra_per_run.entry(*run).or_default() += k - 1;
        if *k > 2 {
            over_one.push(format!("run {run} step {step} ran {k} times"));
        }
    }
    let mut late_per_run: HashMap<Uuid, usize> = HashMap::new();
    for l in checks::executions_after_checkpoint(pool).await.unwrap() {
        *late_per_run.entry(l.run_id).or_default() += 1;
    }
    let effects = ledger::tx_effects_per_run(pool).await.unwrap();
    let mismatches = checks::mixed_mismatches(pool).await.unwrap();
    let recovered = checks::retried_runs(pool).await.unwrap();

    let mut cells: Vec<((&'static str, Act), CellResult)> = Vec::new();
    for act in ACTS {
        let mut r = CellResult { millis: millis.get(&act).copied().unwrap_or(0), ..CellResult::default() };
        for t in trials.iter().filter(|t| t.act == act) {
            r.runs += 1;
            r.fired += usize::from(t.fired);
            if !t.fired {
                r.problems.push(format!("hit {}: the failpoint did not fire", t.n));
            }
            let extra = extra_per_run.get(&t.run).copied().unwrap_or(0);
            r.extra += extra;
            match t.prediction.extra {
                Extra::Exactly(k) => {
                    r.predicted_exact += k;
                    if extra != k {
                        let rows = history(pool, t.run).await;
                        r.problems.push(format!(
                            "hit {}: run {} had {extra} extra executions, model {k}: {rows}",
                            t.n, t.run
                        ));
                    }
                }
                Extra::AtMost(k) => {
                    r.predicted_at_most += k;
                    if extra > k {
                        r.problems
                            .push(format!("hit {}: run {} had {extra} extra executions, model <= {k}", t.n, t.run));
                    }
                }
            }
            let late = late_per_run.get(&t.run).copied().unwrap_or(0);
            r.duplicates += late;
            if late > 0 {
                r.problems.push(format!("run {}: {late} executions after the checkpoint", t.run));
            }
            if effects.get(&t.run).copied() != Some(1) {
                r.tx_effect_problems += 1;
                r.problems.push(format!("run {}: {:?} step_tx rows", t.run, effects.get(&t.run)));
            }
            r.recoveries += usize::from(recovered.iter().any(|(id, _, _)| *id == t.run));
        }
        let ids: Vec<Uuid> = trials.iter().filter(|t| t.act == act).map(|t| t.run).collect();
        r.completed = checks::count_in_state(pool, &ids, "completed").await.unwrap() as usize;
        cells.push(((point, act), r));
    }
    if let Some(cell) = cells.first_mut() {
        cell.1.problems.extend(over_one);
        cell.1.problems.extend(mismatches);
    }
    drop(c);
    drop(db);
    cells
}

#[sqlx::test(migrations = false)]
async fn every_failpoint_times_exit_panic_error_matches_the_model(_p: PgPoolOptions, opts: PgConnectOptions) {
    let seed = tier::seed("failpoint_matrix");
    let runs_per_cell: usize = std::env::var("DURASTEP_MATRIX_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| tier::scaled(50, 200));
    // Failpoints run side by side, each with one worker (6 connections) and a
    // harness pool (3): keep well under the server's connection limit.
    let parallel: usize = std::env::var("DURASTEP_MATRIX_PARALLEL").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let started = Instant::now();
    let stamp = Uuid::new_v4().simple().to_string();
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(parallel.max(1)));
    let mut groups = tokio::task::JoinSet::new();
    let mut rng = Rng::new(seed);
    // DURASTEP_MATRIX_ONLY=<failpoint>: one row of the matrix (to investigate a cell).
    let only = std::env::var("DURASTEP_MATRIX_ONLY").ok();
    for (i, (point, hits)) in POINTS.iter().copied().enumerate() {
        if only.as_deref().is_some_and(|o| o != point) {
            let _ = rng.next_u64();
            continue;
        }
        let (admin, slots) = (opts.clone(), slots.clone());
        let name = format!("durastep_fpm_{}_{i}", &stamp[..8]);
        let group_seed = rng.next_u64();
        groups.spawn(async move {
            let _slot = slots.acquire_owned().await.unwrap();
            failpoint_cells(admin, name, point, hits, runs_per_cell, group_seed).await
        });
    }
    let mut cells = Vec::new();
    while let Some(joined) = groups.join_next().await {
        cells.extend(joined.unwrap());
    }
    let took = started.elapsed();
    let order = |p: &str| POINTS.iter().position(|(q, _)| *q == p).unwrap_or(0);
    cells.sort_by_key(|((p, a), _)| (order(p), ACTS.iter().position(|x| x == a)));

    let mut table = String::from(
        "| failpoint | action | runs | faults fired | completed | executions after checkpoint | extra executions | model | step_tx rows != 1 | runs recovered by a retry | ms per run |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut failures = Vec::new();
    for ((point, act), r) in &cells {
        let model = match (r.predicted_exact, r.predicted_at_most) {
            (e, 0) => format!("= {e}"),
            (e, m) => format!("{e} + <= {m}"),
        };
        table.push_str(&format!(
            "| {point} | {} | {} | {} | {} | {} | {} | {model} | {} | {} | {} |\n",
            act.name(),
            r.runs,
            r.fired,
            r.completed,
            r.duplicates,
            r.extra,
            r.tx_effect_problems,
            r.recoveries,
            r.millis / r.runs.max(1) as u128
        ));
        if r.completed != r.runs {
            failures.push(format!("{point} x {}: {} of {} runs completed", act.name(), r.completed, r.runs));
        }
        for p in &r.problems {
            failures.push(format!("{point} x {}: {p}", act.name()));
        }
    }
    eprintln!(
        "failpoint_matrix: seed {seed}: {} failpoints x 3 actions x {runs_per_cell} runs in {took:.1?} \
         ({parallel} failpoints at a time)\n{table}",
        POINTS.len()
    );
    assert!(failures.is_empty(), "{} cells off the model (seed {seed}):\n{}", failures.len(), failures.join("\n"));
}

/// The supervisor restarts a heartbeat loop that panicked: a run whose step
/// lasts three leases still completes on its first attempt, its step body run
/// once, after the heartbeat panicked at its first round.
#[sqlx::test(migrations = false)]
async fn heartbeats_go_on_after_a_panic(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let lease = Duration::from_secs(1);
    let config = WorkerConfig {
        lease,
        heartbeat: Duration::from_millis(100),
        env: vec![("RUST_BACKTRACE".into(), "0".into())],
        ..WorkerConfig::default()
    }
    .failpoints("heartbeat=1*panic");
    let w = c.spawn(config).await.unwrap();
    let run = c
        .send_slow_step(durastep_testkit::SlowStep { n: 3, sleep_ms: Some(3 * lease.as_millis() as u64) })
        .await
        .unwrap();
    let done = checks::wait_state(c.pool(), run, "completed", WAIT).await.unwrap();
    assert_eq!(c.worker(w).failpoint_fired(HEARTBEAT), 1, "the heartbeat panicked once");
    assert!(c.worker(w).log().contains("worker task panicked"), "{}", c.worker(w).log_tail(20));
    assert_eq!(done.attempt, 1, "no lease was lost: {done:?}");
    let slow = ledger::executions_of_step(c.pool(), run, "slow").await.unwrap();
    assert_eq!(slow.len(), 1, "{slow:?}");
    assert!(checks::slow_step_mismatches(c.pool()).await.unwrap().is_empty());
    let status = c.worker(w).terminate(WAIT).await.unwrap();
    assert!(status.success(), "{status}");
}
