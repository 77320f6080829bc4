//! Flow control: claim throughput with each limit on versus off, in the same run.
//!
//! `cargo bench -p durastep-benches --bench flow`
//!
//! For each configuration, 3,000 runs of a no-op handler are enqueued, then one
//! in-process worker (64 in flight, claims of 32) drains them; with a no-op
//! handler the drain is bound by the claim and the completion write. Limits are
//! set so that they never bind (the cost of enforcing them, not their effect),
//! except the last row, where 4 slots per key over 16 keys do bind. Runs are
//! spread over 16 keys (the rate limit: one key per run, since GCRA without a
//! burst starts one run per key per instant). Each configuration is measured `ROUNDS` times, in
//! interleaved order; the table shows the best round, and the ratio to "off".
//! "off-without-release-trigger" is "off" with the slot-release trigger
//! disabled: what that trigger costs a function that has no flow control.
//! Env `BENCH_FLOW_RUNS` changes the number of runs.

use std::time::{Duration, Instant};

use durastep::{Engine, Event, Function, WorkerOptions};
use durastep_benches::db::BenchDb;
use durastep_benches::report::{Table, ratio, thousands};
use serde_json::{Value, json};

const ROUNDS: usize = 3;
const KEYS: usize = 16;

fn config(name: &str) -> Function {
    let id = format!("flow-{name}");
    let f = Function::new(&id).on_event(format!("bench/{id}"));
    let f = match name {
        "off" | "off-without-release-trigger" => f,
        "concurrency" => f.concurrency(durastep::Concurrency::new(100_000).key("/k")),
        "concurrency-shared" => f.concurrency(durastep::Concurrency::new(100_000).shared("bench-shared")),
        "two-concurrency" => f
            .concurrency(durastep::Concurrency::new(100_000).key("/k"))
            .concurrency(durastep::Concurrency::new(100_000)),
        "throttle" => f.throttle(durastep::Throttle::new(1_000_000, Duration::from_secs(1)).burst(1_000).key("/k")),
        // GCRA without burst starts one run per key per instant: one key per run keeps it from binding.
        "rate-limit" => f.rate_limit(durastep::RateLimit::new(1_000_000, Duration::from_secs(1)).key("/n")),
        "backpressure" => f.backpressure(durastep::Backpressure::new().key("/k")),
        "concurrency-binding" => f.concurrency(durastep::Concurrency::new(4).key("/k")),
        other => panic!("unknown config {other}"),
    };
    f.handler(|_ctx, _e: Value| async { Ok(()) })
}

const CONFIGS: [&str; 9] = [
    "off",
    "off-without-release-trigger",
    "concurrency",
    "concurrency-shared",
    "two-concurrency",
    "throttle",
    "rate-limit",
    "backpressure",
    "concurrency-binding",
];

async fn drain(db: &BenchDb, name: &str, runs: usize) -> f64 {
    let engine = Engine::builder()
        .pool(db.pool(12).await)
        .function(config(name))
        .worker_options(WorkerOptions { max_in_flight: 64, claim_batch: 32, ..WorkerOptions::default() })
        .build()
        .await
        .expect("engine");
    let id = format!("flow-{name}");
    let events: Vec<Event> = (0..runs)
        .map(|i| Event::new(format!("bench/{id}"), &json!({"k": format!("key-{}", i % KEYS), "n": i})))
        .collect();
    for chunk in events.chunks(200) {
        engine.send_batch(chunk.to_vec()).await.expect("send");
    }
    // The cost the slot-release trigger adds to a function without flow control.
    let toggle = |on: bool| {
        let pool = engine.pool().clone();
        async move {
            let sql = if on {
                "ALTER TABLE durastep.runs ENABLE TRIGGER runs_release_flow"
            } else {
                "ALTER TABLE durastep.runs DISABLE TRIGGER runs_release_flow"
            };
            sqlx::query(sql).execute(&pool).await.expect("toggle trigger");
        }
    };
    let no_trigger = name == "off-without-release-trigger";
    if no_trigger {
        toggle(false).await;
    }
    let worker = engine.spawn_worker();
    let started = Instant::now();
    loop {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM durastep.runs WHERE function_id = $1 AND state <> 'completed'")
                .bind(&id)
                .fetch_one(engine.pool())
                .await
                .expect("count");
        if left == 0 {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(300), "{name}: {left} runs left");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let took = started.elapsed();
    worker.stop().await.expect("worker");
    if no_trigger {
        toggle(true).await;
    }
    sqlx::query("DELETE FROM durastep.events WHERE name = $1")
        .bind(format!("bench/{id}"))
        .execute(engine.pool())
        .await
        .ok();
    runs as f64 / took.as_secs_f64()
}

#[tokio::main]
async fn main() {
    let runs = durastep_benches::knobs::whole_number("BENCH_FLOW_RUNS").unwrap_or(3_000);
    let db = BenchDb::create("flow").await;
    // Warm up: schema, plans, caches.
    drain(&db, "off", 500).await;
    let mut best = vec![0.0f64; CONFIGS.len()];
    for _ in 0..ROUNDS {
        for (i, name) in CONFIGS.iter().enumerate() {
            best[i] = best[i].max(drain(&db, name, runs).await);
        }
    }
    let mut t = Table::new(
        &format!(
            "Claim throughput, flow control on vs off ({runs} no-op runs over {KEYS} keys, 1 worker, best of {ROUNDS})"
        ),
        &["configuration", "runs/s", "vs off"],
    );
    for (i, name) in CONFIGS.iter().enumerate() {
        t.row(vec![(*name).to_owned(), thousands(best[i]), ratio(best[i], best[0])]);
    }
    t.print();
    db.drop_database().await;
}
