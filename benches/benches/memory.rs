//! A worker's memory does not grow with the number of sleeping runs.
//!
//! `cargo bench -p durastep-benches --bench memory`
//!
//! One `bench-worker` process (default options) runs `sleeper` runs: one
//! checkpointed sleep step each, then the run is `sleeping` for an hour and holds
//! nothing in the worker. Its RSS (`VmRSS` in `/proc/<pid>/status`) is read idle,
//! then with 1,000, 10,000 and 20,000 runs asleep. The first 1,000 warm the
//! allocator and the pools; what matters is that 10,000 and 20,000 cost the same.

use std::time::{Duration, Instant};

use durastep::{Engine, Event};
use durastep_benches::db::{BenchDb, wait_for_count};
use durastep_benches::functions::{self, SLEEP};
use durastep_benches::process::{WorkerConfig, WorkerProcess};
use durastep_benches::report::{Table, rss_kib, thousands, verdict};

const WORKER: &str = env!("CARGO_BIN_EXE_bench-worker");

#[tokio::main]
async fn main() {
    let db = BenchDb::create("memory").await;
    let pool = db.pool(4).await;
    println!("# Worker memory with sleeping runs (database {})", db.name);
    let mut builder = Engine::builder().pool(pool.clone());
    for f in functions::all() {
        builder = builder.function(f);
    }
    let engine = builder.build().await.expect("build engine");

    let mut worker = WorkerProcess::spawn(WORKER, &db.url, &WorkerConfig::default()).await;
    let pid = worker.pid();
    worker.go().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut samples = vec![(0usize, rss_kib(pid).expect("rss"), Duration::ZERO)];

    let mut sent = 0usize;
    for target in [1_000usize, 10_000, 20_000] {
        let started = Instant::now();
        while sent < target {
            let n = (target - sent).min(1000);
            let events = (0..n).map(|i| Event::new(SLEEP, &(sent + i))).collect();
            engine.send_batch(events).await.expect("enqueue");
            sent += n;
        }
        let sql = "SELECT count(*) FROM durastep.runs WHERE state = 'sleeping'";
        let ok = wait_for_count(&pool, sql, target as i64, Duration::from_millis(100), Duration::from_secs(120)).await;
        assert!(ok, "runs did not all go to sleep");
        let took = started.elapsed();
        tokio::time::sleep(Duration::from_millis(500)).await; // settle: executors gone
        samples.push((target, rss_kib(pid).expect("rss"), took));
    }
    worker.stop().await;

    let (_, warm, _) = samples[1];
    let (_, at10k, _) = samples[2];
    let (_, at20k, _) = samples[3];
    let per_run_bytes = (at20k as f64 - at10k as f64) * 1024.0 / 10_000.0;
    let mut t = Table::new(
        "Worker RSS with N runs sleeping (one bench-worker process, default options)",
        &["runs sleeping", "worker RSS", "time to put them to sleep"],
    );
    for (n, kib, took) in &samples {
        t.row(vec![
            thousands(*n as f64),
            format!("{} KiB", thousands(*kib as f64)),
            format!("{:.2} s", took.as_secs_f64()),
        ]);
    }
    t.print();
    let mut v = Table::new("Growth", &["what", "value", "verdict"]);
    v.row(vec![
        "RSS(10,000 asleep) - RSS(1,000 asleep)".into(),
        format!("{} KiB", thousands(at10k as f64 - warm as f64)),
        "".into(),
    ]);
    v.row(vec![
        "bytes per extra sleeping run, 10,000 -> 20,000".into(),
        format!("{per_run_bytes:.1}"),
        // Anything per-run would cost at least a map entry (~100 bytes).
        verdict(per_run_bytes < 50.0),
    ]);
    v.print();

    pool.close().await;
    db.drop_database().await;
}
