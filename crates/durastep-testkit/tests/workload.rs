//! The randomized workload against a model (issue 11; `durastep_testkit::workload`).
//!
//! Each test generates a plan from a seed (printed first; `DURASTEP_SEED=<n>`
//! replays it): random programs over every primitive and flow rule, operator
//! actions (sends with repeated idempotency keys, cancel, replay, replay_many,
//! prune, clock moves) and faults (SIGKILL, SIGSTOP, failpoints in every
//! write, lost commit acknowledgements through the proxy, a Postgres restart
//! on a private cluster). After the drain the oracle checks every run against
//! the model; any finding fails the test and is printed with its run.
//!
//! Tiers: by default (CI) two fixed seeds and a fixed seed with Postgres
//! restarts, each about a minute of work on 4 workers (the random-seed test
//! is ignored, so CI never fails on an unseen plan; `-- --ignored` runs it). With
//! `DURASTEP_SOAK=1`, `soak_workload` runs plans back to back for
//! `DURASTEP_SOAK_MINUTES` (default 30) minutes. `DURASTEP_WORKLOAD_BUGS`
//! (`all`, `none`, or `1,2,3,4,7,8,9`, or `-4` to leave one out) picks the
//! known-bug combinations of issue 11 that the plans exercise; default all.

use std::time::{Duration, Instant};

use durastep_testkit::pg::TempPostgres;
use durastep_testkit::proxy::Proxy;
use durastep_testkit::tier;
use durastep_testkit::workload::{self, Outcome, Workload, WorkloadConfig};
use durastep_testkit::{Cluster, WorkerConfig, url_of};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");

fn worker_config() -> WorkerConfig {
    WorkerConfig {
        lease: Duration::from_secs(3),
        heartbeat: Duration::from_millis(300),
        max_in_flight: 12,
        claim_batch: 12,
        // 6 connections per worker: two tests of 3 workers at once stay far below
        // the shared server's max_connections.
        pool_size: 2,
        ledger_pool_size: 1,
        ..WorkerConfig::default()
    }
}

fn report(name: &str, seed: u64, w: &Workload, out: &Outcome) {
    eprintln!(
        "{name}: seed {seed}: plan {:?} (fingerprint {:x}; the driver runs a worker: {})",
        w.summary(),
        w.fingerprint(),
        w.driver_worker
    );
    eprintln!("{name}: seed {seed}: bugs exercised {:?}", w.config.bugs);
    eprintln!("{name}: seed {seed}: stats {:?}", out.stats);
    eprintln!("{name}: seed {seed}: findings per check {:?}", out.per_check());
    for f in out.findings.iter().take(40) {
        eprintln!("{name}: seed {seed}: {f}");
    }
}

/// One plan on the shared server, workers behind the proxy (lost acknowledgements).
async fn one(name: &str, seed: u64, opts: PgConnectOptions) -> Outcome {
    let config = WorkloadConfig::ci();
    let w = Workload::generate(seed, &config);
    let url = url_of(&opts);
    let mut cluster = Cluster::start(BIN, url.clone()).await.unwrap();
    let proxy = Proxy::start(&url).await.unwrap();
    let started = Instant::now();
    let out =
        workload::run(&mut cluster, &w, worker_config(), Some(&proxy), None, Duration::from_secs(60)).await.unwrap();
    eprintln!("{name}: seed {seed}: {:.1} s", started.elapsed().as_secs_f64());
    report(name, seed, &w, &out);
    cluster.shutdown(Duration::from_secs(20)).await.unwrap();
    out
}

/// The plan handed some runs on in its sends: to the driver's own worker in
/// memory (odd seeds), or to idle worker processes through their offers (even
/// seeds, `Workload::driver_worker`), so the fixed seeds cover both paths.
fn assert_some_handed_on(name: &str, seed: u64, out: &Outcome) {
    let handed = out.stats.get("runs_handed_by_their_send").copied().unwrap_or(0);
    assert!(handed > 0, "{name}: seed {seed}: no run handed on by its send: {:?}", out.stats);
}

fn assert_clean(name: &str, seed: u64, out: &Outcome) {
    assert!(
        out.findings.is_empty(),
        "{name}: seed {seed} (replay with DURASTEP_SEED={seed}): {} findings {:?}; first: {}",
        out.findings.len(),
        out.per_check(),
        out.findings[0]
    );
}

/// The plan is a function of the seed.
#[test]
fn same_seed_same_workload() {
    let seed = tier::seed("workload::same_seed_same_workload");
    let config = WorkloadConfig::ci();
    let a = Workload::generate(seed, &config);
    let b = Workload::generate(seed, &config);
    assert_eq!(a.fingerprint(), b.fingerprint());
    assert_eq!(format!("{:?}", a.timeline), format!("{:?}", b.timeline));
    let kinds = a.summary();
    for k in ["send", "kill"] {
        assert!(kinds.contains_key(k), "{kinds:?}");
    }
    assert!(kinds["kill"] >= 3, "{kinds:?}");
}

/// Catches: issue 11's composition bugs (1-4, 7-9) and any regression of the
/// guarantees the oracle checks, for a fixed seed.
#[sqlx::test(migrations = false)]
async fn workload_fixed_seed_1(_p: PgPoolOptions, opts: PgConnectOptions) {
    let seed = 1_101;
    eprintln!("workload_fixed_seed_1: seed {seed}");
    let out = one("workload_fixed_seed_1", seed, opts).await;
    assert_clean("workload_fixed_seed_1", seed, &out);
    assert_some_handed_on("workload_fixed_seed_1", seed, &out);
}

/// Like `workload_fixed_seed_1`, another seed, even: the driver runs no
/// worker, so its one-event sends hand runs to the worker processes through
/// their offers.
#[sqlx::test(migrations = false)]
async fn workload_fixed_seed_2(_p: PgPoolOptions, opts: PgConnectOptions) {
    let seed = 2_202;
    eprintln!("workload_fixed_seed_2: seed {seed}");
    let out = one("workload_fixed_seed_2", seed, opts).await;
    assert_clean("workload_fixed_seed_2", seed, &out);
    assert_some_handed_on("workload_fixed_seed_2", seed, &out);
}

/// A new seed each run (printed first; `DURASTEP_SEED` replays it).
///
/// Ignored in the CI tier, on purpose: a new seed each run would let CI fail
/// on a plan nobody has looked at. The fixed seeds above run in CI; new seeds
/// run here with `-- --ignored` and in the soak tier, whose runs and findings
/// (all diagnosed so far) are in docs/reliability.md.
#[sqlx::test(migrations = false)]
#[ignore = "a new seed each run: run it with --ignored, or the soak tier (docs/reliability.md)"]
async fn workload_random_seed(_p: PgPoolOptions, opts: PgConnectOptions) {
    let seed = tier::seed("workload_random_seed");
    let out = one("workload_random_seed", seed, opts).await;
    assert_clean("workload_random_seed", seed, &out);
}

/// A fixed seed on a private Postgres that the plan restarts (`-m fast`) at random points.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_with_postgres_restarts() {
    let seed = std::env::var(tier::SEED_ENV).ok().and_then(|s| s.parse().ok()).unwrap_or(3_303);
    eprintln!("workload_with_postgres_restarts: seed {seed}");
    let mut config = WorkloadConfig::ci();
    config.runs = 80;
    config.faults.pg_restarts = true;
    config.faults.lost_acks = false;
    let w = Workload::generate(seed, &config);
    let pg = TempPostgres::start().await.unwrap();
    let mut cluster = Cluster::start(BIN, pg.url("postgres")).await.unwrap();
    let worker = WorkerConfig { ledger_synchronous_commit: true, ..worker_config() };
    let out = workload::run(&mut cluster, &w, worker, None, Some(&pg), Duration::from_secs(60)).await.unwrap();
    report("workload_with_postgres_restarts", seed, &w, &out);
    cluster.shutdown(Duration::from_secs(20)).await.unwrap();
    assert_clean("workload_with_postgres_restarts", seed, &out);
}

/// The soak tier: plans of 5 minutes back to back for `DURASTEP_SOAK_MINUTES`
/// (default 30), each on a fresh database, a new seed each (printed).
#[sqlx::test(migrations = false)]
async fn soak_workload(_p: PgPoolOptions, opts: PgConnectOptions) {
    if !tier::soak() {
        eprintln!("soak_workload: set DURASTEP_SOAK=1 to run it");
        return;
    }
    let minutes: u64 = std::env::var("DURASTEP_SOAK_MINUTES").ok().and_then(|s| s.parse().ok()).unwrap_or(30);
    let started = Instant::now();
    let mut all = Vec::new();
    let mut n = 0u64;
    let base = tier::seed("soak_workload");
    let admin = sqlx::PgPool::connect_with(opts.clone()).await.unwrap();
    while started.elapsed() < Duration::from_secs(minutes * 60) {
        let seed = base.wrapping_add(n);
        n += 1;
        // Short: a suffix on the test database's 63-character name would be
        // cut back to that very name by Postgres.
        let db = format!("durastep_soak_{}_{n}", std::process::id());
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{db}\""))).execute(&admin).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{db}\""))).execute(&admin).await.unwrap();
        let url = format!("postgres://{}@{}:{}/{db}", opts.get_username(), opts.get_host(), opts.get_port());
        let config = WorkloadConfig::soak(5);
        let w = Workload::generate(seed, &config);
        let mut cluster = Cluster::start(BIN, url.clone()).await.unwrap();
        let proxy = Proxy::start(&url).await.unwrap();
        let out = workload::run(&mut cluster, &w, worker_config(), Some(&proxy), None, Duration::from_secs(180))
            .await
            .unwrap();
        report("soak_workload", seed, &w, &out);
        cluster.shutdown(Duration::from_secs(30)).await.unwrap();
        drop(cluster);
        drop(proxy);
        all.push((seed, out.findings.len(), out.per_check()));
        if out.findings.is_empty() {
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS \"{db}\" WITH (FORCE)")))
                .execute(&admin)
                .await
                .unwrap();
        } else {
            // Kept for diagnosis: the ledger, the run history and the runs as they ended.
            eprintln!("soak_workload: seed {seed}: findings; database {db} kept for diagnosis");
        }
    }
    for (seed, n, per) in &all {
        eprintln!("soak_workload: seed {seed}: {n} findings {per:?}");
    }
    assert!(all.iter().all(|(_, n, _)| *n == 0), "soak findings: {all:?}");
}
