//! Network faults between worker processes and Postgres, through the testkit's
//! TCP proxy: every socket reset, a black hole for 2.5 leases, 200 ms of added
//! latency, and one worker cut off while the others pass.
//!
//! Pass figures: every run completes with its oracle's output and no stored
//! step runs again (G2); no worker process exits; a cut worker stops running
//! user code within its lease by its own clock (G4: its log says "lease not
//! extended in time" for the runs it held, stamped within one lease of the
//! cut, and the ledger shows no body of its old attempts after the cut);
//! work resumes within 5 s of healing.
//!
//! Timestamps: the ledger's `worker_clock` (the worker's wall clock when a
//! body started) and the workers' log stamps are compared with the test's
//! wall clock: one machine, one clock. The database's `started_at` would not
//! do: an INSERT sent into the black hole runs when the network heals.
//! `DURASTEP_SOAK=1` makes each test run longer and with more runs.

use std::time::Duration;

use chrono::{DateTime, Utc};
use durastep_testkit::proxy::{Mode, Proxy};
use durastep_testkit::{Cluster, FiveSteps, WorkerConfig, checks, ledger, url_of, wait_for};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const LEASE: Duration = Duration::from_secs(2);
const RECOVERY: Duration = Duration::from_secs(5);
const NEEDLE: &str = "lease not extended in time";

/// One test at a time: each runs worker processes whose connections a black
/// hole keeps open, on a Postgres shared with every other test.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn soak() -> bool {
    std::env::var_os("DURASTEP_SOAK").is_some()
}

fn runs_count(ci: u64) -> u64 {
    if soak() { ci * 5 } else { ci }
}

fn config(url: String) -> WorkerConfig {
    WorkerConfig {
        lease: LEASE,
        max_in_flight: 8,
        claim_batch: 8,
        step_delay: Duration::from_millis(100),
        ..WorkerConfig::default()
    }
    .database_url(url)
}

fn chrono(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap()
}

/// Waits until the ledger has at least `n` rows.
async fn wait_rows(c: &Cluster, n: i64) {
    let pool = c.pool().clone();
    wait_for(&format!("{n} ledger rows"), Duration::from_secs(60), || {
        let pool = pool.clone();
        async move { Ok((ledger::summary(&pool).await?.executions >= n).then_some(())) }
    })
    .await
    .unwrap();
}

/// The checks every test ends with; returns a one-line summary.
async fn check_completed(c: &mut Cluster, runs: &[Uuid]) -> String {
    c.wait_finished(runs, Duration::from_secs(120)).await.unwrap();
    let pool = c.pool().clone();
    let states = checks::run_states(&pool).await.unwrap();
    assert_eq!(states.get("completed").copied(), Some(runs.len() as i64), "{states:?}");
    let problems = checks::five_steps_mismatches(&pool).await.unwrap();
    assert!(problems.is_empty(), "{} problems; first: {:?}", problems.len(), &problems[..problems.len().min(5)]);
    let totals = checks::step_result_totals(&pool).await.unwrap();
    assert_eq!(totals.distinct_steps, totals.rows, "duplicate step rows");
    let again = ledger::started_after_stored(&pool).await.unwrap();
    assert!(again.is_empty(), "{} stored steps ran again; first: {:?}", again.len(), again.first());
    for i in 0..c.workers().len() {
        assert!(c.worker(i).is_running().unwrap(), "worker {i} exited:\n{}", c.worker(i).log_tail(20));
    }
    let s = ledger::summary(&pool).await.unwrap();
    format!(
        "{} runs completed, {} step bodies for {} steps ({} run more than once)",
        runs.len(),
        s.executions,
        s.steps,
        s.repeated_steps
    )
}

/// How long after `healed_at` the first step body started (by a worker's
/// clock), among `pids` (all when empty).
async fn recovery_after(c: &Cluster, healed_at: DateTime<Utc>, pids: &[i32]) -> Duration {
    let pool = c.pool().clone();
    let first = wait_for("a step body after healing", Duration::from_secs(30), || {
        let pool = pool.clone();
        async move {
            let rows = ledger::executions(&pool).await?;
            Ok(rows
                .into_iter()
                .filter(|e| pids.is_empty() || pids.contains(&e.pid))
                .filter_map(|e| e.worker_clock)
                .filter(|&t| t > healed_at)
                .min())
        }
    })
    .await
    .unwrap();
    (first - healed_at).to_std().unwrap()
}

/// G4 by the worker's own clock, for the worker at `i` cut off at `cut_at`
/// and healed at `healed_at`: every "lease not extended in time" line of the
/// cut is stamped within one lease of it, there is at least one, and no step
/// body of an attempt it ran before the cut started after the cut plus a lease.
/// Returns the latest drop after the cut.
async fn check_stopped_within_lease(
    c: &mut Cluster,
    i: usize,
    cut_at: DateTime<Utc>,
    healed_at: DateTime<Utc>,
) -> Duration {
    let w = c.worker(i);
    let pid = w.pid() as i32;
    let drops: Vec<DateTime<Utc>> =
        w.log_events(NEEDLE).into_iter().map(|(at, _)| at).filter(|&at| at >= cut_at && at <= healed_at).collect();
    assert!(!drops.is_empty(), "worker {i} held runs at the cut but never dropped one:\n{}", w.log_tail(30));
    let latest = drops.iter().max().copied().unwrap();
    assert!(
        latest - cut_at <= chrono(LEASE),
        "worker {i} dropped a handler {:?} after the cut (lease {LEASE:?})",
        (latest - cut_at).to_std().unwrap()
    );
    let rows = ledger::executions(c.pool()).await.unwrap();
    let mine: Vec<&ledger::Execution> = rows.iter().filter(|e| e.pid == pid).collect();
    let before: std::collections::HashSet<(Uuid, i32)> =
        mine.iter().filter(|e| e.worker_clock.is_some_and(|t| t < cut_at)).map(|e| (e.run_id, e.attempt)).collect();
    let limit = cut_at + chrono(LEASE);
    for e in &mine {
        let t = e.worker_clock.unwrap();
        assert!(!(t > limit && t < healed_at), "worker {i} started a body during the cut, after its lease: {e:?}");
        assert!(
            !(t > limit && before.contains(&(e.run_id, e.attempt))),
            "worker {i} went on with an attempt it held before the cut: {e:?}"
        );
    }
    (latest - cut_at).to_std().unwrap()
}

/// Every socket reset, new connections refused for 1 s; then one more reset
/// that accepts new connections at once.
#[sqlx::test(migrations = false)]
async fn reset_every_socket(_p: PgPoolOptions, opts: PgConnectOptions) {
    let _serial = SERIAL.lock().await;
    let url = url_of(&opts);
    let proxy = Proxy::start(&url).await.unwrap();
    let mut c = Cluster::start(BIN, &url).await.unwrap();
    let runs = c.send_five_steps((0..runs_count(200)).map(FiveSteps::new)).await.unwrap();
    c.spawn_many(2, config(proxy.url(0))).await.unwrap();
    wait_rows(&c, 100).await;

    proxy.set_mode(Mode::Reset { refuse_new: true });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let healed_at = Utc::now();
    proxy.set_mode(Mode::Pass);
    let first = recovery_after(&c, healed_at, &[]).await;

    wait_rows(&c, 400).await;
    proxy.set_mode(Mode::Reset { refuse_new: false });
    let second_at = Utc::now();
    proxy.set_mode(Mode::Pass);
    let second = recovery_after(&c, second_at, &[]).await;

    let summary = check_completed(&mut c, &runs).await;
    assert!(first <= RECOVERY && second <= RECOVERY, "recovery took {first:?} / {second:?}");
    eprintln!(
        "network_cut (reset): {summary}; first body {first:.2?} after 1 s of refused connections, \
         {second:.2?} after a reset accepting new ones; {} connections accepted",
        proxy.accepted(0)
    );
}

/// Nothing passes for 2.5 leases; every worker drops the handlers it held
/// within its lease by its own clock; work resumes within 5 s of healing.
#[sqlx::test(migrations = false)]
async fn black_hole_for_two_and_a_half_leases(_p: PgPoolOptions, opts: PgConnectOptions) {
    let _serial = SERIAL.lock().await;
    let url = url_of(&opts);
    let proxy = Proxy::start(&url).await.unwrap();
    let mut c = Cluster::start(BIN, &url).await.unwrap();
    let runs = c.send_five_steps((0..runs_count(300)).map(FiveSteps::new)).await.unwrap();
    c.spawn_many(2, config(proxy.url(0))).await.unwrap();
    wait_rows(&c, 100).await;

    let cut_at = Utc::now();
    proxy.set_mode(Mode::BlackHole);
    tokio::time::sleep(LEASE * 5 / 2).await;
    let healed_at = Utc::now();
    proxy.set_mode(Mode::Pass);
    assert!(checks::unfinished_among(c.pool(), &runs).await.unwrap() > 0, "the work ended before the heal");
    let recovery = recovery_after(&c, healed_at, &[]).await;

    let summary = check_completed(&mut c, &runs).await;
    let mut drops = Vec::new();
    for i in 0..2 {
        drops.push(check_stopped_within_lease(&mut c, i, cut_at, healed_at).await);
    }
    assert!(recovery <= RECOVERY, "first step body {recovery:?} after healing");
    eprintln!(
        "network_cut (black hole {:?}): {summary}; handlers dropped by the workers' own clocks at most \
         {drops:.2?} after the cut (lease {LEASE:?}); first body {recovery:.2?} after healing",
        LEASE * 5 / 2
    );
}

/// 200 ms more each way for a while: slow, but nothing is lost.
#[sqlx::test(migrations = false)]
async fn two_hundred_ms_latency(_p: PgPoolOptions, opts: PgConnectOptions) {
    let _serial = SERIAL.lock().await;
    let url = url_of(&opts);
    let proxy = Proxy::start(&url).await.unwrap();
    let mut c = Cluster::start(BIN, &url).await.unwrap();
    let runs = c.send_five_steps((0..runs_count(200)).map(FiveSteps::new)).await.unwrap();
    // A round trip now costs 400 ms, and a heartbeat takes two or three (the
    // pool's liveness ping, then the statement): with a 2 s lease the own-clock
    // check (90%) would rightly give leases up. 5 s leaves a 3x margin, so
    // here no lease may be lost at all.
    let slow_lease = Duration::from_secs(5);
    c.spawn_many(2, WorkerConfig { lease: slow_lease, ..config(proxy.url(0)) }).await.unwrap();
    wait_rows(&c, 100).await;

    let slow_at = Utc::now();
    proxy.set_mode(Mode::Latency(Duration::from_millis(200)));
    let slow_for = if soak() { Duration::from_secs(60) } else { Duration::from_secs(8) };
    tokio::time::sleep(slow_for).await;
    let healed_at = Utc::now();
    proxy.set_mode(Mode::Pass);
    let during = ledger::executions(c.pool())
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.worker_clock.is_some_and(|t| t > slow_at && t < healed_at))
        .count();
    assert!(during > 0, "no step body started while the network was slow");

    let summary = check_completed(&mut c, &runs).await;
    let lost: usize = c.workers().iter().map(|w| w.log_events(NEEDLE).len()).sum();
    assert_eq!(lost, 0, "leases given up under latency (lease {slow_lease:?})");
    let retried = checks::retried_runs(c.pool()).await.unwrap();
    assert!(retried.is_empty(), "{} runs needed another attempt; first: {:?}", retried.len(), retried.first());
    eprintln!(
        "network_cut (latency 200 ms each way for {slow_for:?}, lease {slow_lease:?}): {summary}; {during} bodies \
         started while slow; 0 leases given up, 0 runs retried"
    );
}

/// Three workers, each through its own listener; the first is black-holed
/// for 2.5 leases while the other two go on and take its runs over.
#[sqlx::test(migrations = false)]
async fn one_worker_cut_while_others_pass(_p: PgPoolOptions, opts: PgConnectOptions) {
    let _serial = SERIAL.lock().await;
    let url = url_of(&opts);
    let proxy = Proxy::start(&url).await.unwrap();
    let mut c = Cluster::start(BIN, &url).await.unwrap();
    let runs = c.send_five_steps((0..runs_count(500)).map(FiveSteps::new)).await.unwrap();
    for _ in 0..3 {
        let l = if c.workers().is_empty() { 0 } else { proxy.add_listener().await.unwrap() };
        c.spawn(config(proxy.url(l))).await.unwrap();
    }
    wait_rows(&c, 100).await;
    let cut_pid = c.worker(0).pid() as i32;

    let cut_at = Utc::now();
    proxy.set_listener_mode(0, Mode::BlackHole);
    tokio::time::sleep(LEASE * 5 / 2).await;
    let healed_at = Utc::now();
    proxy.set_listener_mode(0, Mode::Pass);
    assert!(checks::unfinished_among(c.pool(), &runs).await.unwrap() > 0, "the work ended before the heal");

    let others_during = ledger::executions(c.pool())
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.pid != cut_pid && e.worker_clock.is_some_and(|t| t > cut_at + chrono(LEASE) && t < healed_at))
        .count();
    assert!(others_during > 0, "the other workers did nothing during the cut");
    let recovery = recovery_after(&c, healed_at, &[cut_pid]).await;
    let summary = check_completed(&mut c, &runs).await;
    let dropped = check_stopped_within_lease(&mut c, 0, cut_at, healed_at).await;
    assert!(recovery <= RECOVERY, "the cut worker's first body {recovery:?} after healing");
    eprintln!(
        "network_cut (one of 3 workers black-holed {:?}): {summary}; the cut worker dropped its handlers at most \
         {dropped:.2?} after the cut (lease {LEASE:?}) and started its first body {recovery:.2?} after healing; \
         the others started {others_during} bodies during the cut",
        LEASE * 5 / 2
    );
}
