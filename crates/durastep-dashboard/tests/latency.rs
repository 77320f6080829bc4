//! Page latency with 100,000 runs (and their events) in the tables. Ignored by
//! default; prints a Markdown table:
//!
//! ```text
//! cargo test --release -p durastep-dashboard --test latency -- --ignored --nocapture
//! ```
//!
//! Each page is requested through the router in process (no network), once to
//! warm up and then 20 times; the figures are the median and the slowest.
mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use common::*;
use durastep_dashboard::{DashboardConfig, router};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const ROUNDS: usize = 20;

#[sqlx::test(migrations = false)]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn page_latency_with_100k_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let broken = Arc::new(AtomicBool::new(true));
    let engine = engine(&opts, vec![budget_push(broken)]).await;
    let seeding = Instant::now();
    seed_runs(&engine, 100_000).await;
    let seeded_in = seeding.elapsed();
    let worker = spawn_worker(&engine);
    let real = failed_run(&engine, json!({"ad_account_id": "act_7"})).await;
    worker.stop().await;

    // Test-side SQL only to find a cursor 90,000 runs deep (the dashboard has none).
    let deep: String = sqlx::query_scalar(
        "SELECT (extract(epoch FROM created_at) * 1000000)::bigint || '_' || id FROM durastep.runs
          ORDER BY created_at DESC, id DESC OFFSET 90000 LIMIT 1",
    )
    .fetch_one(engine.pool())
    .await
    .expect("deep cursor");
    let seeded = seeded_run(&engine, 85).await;
    let app = router(engine.clone(), &DashboardConfig::default()).expect("router");

    let pages = [
        ("overview", "/".to_owned()),
        ("run list, first page", "/runs".to_owned()),
        ("run list, state=failed", "/runs?state=failed".to_owned()),
        ("run list, 90,000 runs deep (cursor)", format!("/runs?after={deep}")),
        ("run list, state=failed, function", "/runs?state=failed&function=exact-invoice".to_owned()),
        ("run list, key /ad_account_id=act_7", "/runs?key=%2Fad_account_id%3Dact_7".to_owned()),
        ("run list, idempotency key", "/runs?idempotency_key=seed-4242".to_owned()),
        ("run detail (seeded failed run)", format!("/runs/{seeded}")),
        ("run detail (run with steps and history)", format!("/runs/{real}")),
        ("functions", "/functions".to_owned()),
    ];
    println!("\n100,000 runs seeded in {:.1} s\n", seeded_in.as_secs_f64());
    println!("| page | median ms | max ms | bytes |\n|---|---:|---:|---:|");
    for (name, path) in &pages {
        let first = get(&app, path).await;
        assert_eq!(first.status, StatusCode::OK, "{path}: {}", first.body);
        let mut times: Vec<Duration> = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            let t = Instant::now();
            let page = get(&app, path).await;
            times.push(t.elapsed());
            assert_eq!(page.status, StatusCode::OK);
        }
        times.sort();
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!("| {name} | {:.1} | {:.1} | {} |", ms(times[ROUNDS / 2]), ms(times[ROUNDS - 1]), first.body.len());
        assert!(times[ROUNDS - 1] < Duration::from_secs(1), "{name} took {:?}", times[ROUNDS - 1]);
    }
}
