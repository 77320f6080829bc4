//! Run with: `cargo run -p prometheus-example` (add `-- --serve` to keep it
//! running; `-- --help` lists the flags, and an unknown flag is an error)
//!
//! Durastep's metrics in a Prometheus scrape. The program installs
//! `metrics-exporter-prometheus` as the process's metrics recorder, with its
//! HTTP listener on `--metrics-addr` or `METRICS_ADDR` (default `127.0.0.1:9000`), and runs a
//! worker with one small function, `build-report`, whose `fetch` step fails
//! on the first attempt of every third run (so the retry metrics move). It
//! sends 12 events, waits until their runs have finished, then scrapes its own
//! `/metrics` over HTTP, prints the Durastep lines and exits. With `--serve` it
//! goes on sending an event a second and serving `/metrics` until Ctrl-C.
//!
//! It uses the Postgres at `DATABASE_URL` if set, else
//! `postgres://postgres@127.0.0.1:5432/postgres`; when nothing answers at that
//! (local) address, it starts a throwaway cluster from the installed server
//! binaries, says where, and removes it at exit (`durastep-localpg`). There it
//! creates (once) and uses its own database, `durastep_prometheus_example`.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use durastep::{Backoff, Ctx, Engine, Event, Function, HandlerError, WorkerOptions};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const DEFAULT_ADDR: &str = "127.0.0.1:9000";
const RUNS: u32 = 12;

/// Durastep's metrics in a Prometheus scrape: a worker runs a small function
/// (12 runs, some retried), then the program scrapes its own /metrics and
/// prints the Durastep lines. Postgres: DATABASE_URL, else a local default
/// (a throwaway cluster when nothing answers there).
#[derive(Debug, Parser)]
#[command(name = "prometheus-example", max_term_width = 100)]
struct Args {
    /// Keep running after the 12 runs: send an event a second and serve
    /// /metrics until Ctrl-C (instead of scraping once and exiting).
    #[arg(long)]
    serve: bool,
    /// Where the exporter serves /metrics.
    #[arg(long, env = "METRICS_ADDR", default_value = DEFAULT_ADDR, value_name = "HOST:PORT")]
    metrics_addr: SocketAddr,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // First: a mistyped flag fails here, before anything starts.
    let Args { serve, metrics_addr: addr } = Args::parse();

    // The application chooses the recorder; Durastep only records into it.
    // Buckets make the histograms real Prometheus histograms (without them
    // the exporter renders summaries).
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".to_owned()),
            &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0],
        )?
        .set_buckets_for_metric(
            Matcher::Suffix("_batch_size".to_owned()),
            &[0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0],
        )?
        .install()
        .map_err(|e| {
            format!("cannot serve metrics on {addr}: {e} (set --metrics-addr or METRICS_ADDR to a free address)")
        })?;
    durastep::metrics::describe();
    println!("metrics at http://{addr}/metrics");

    // Kept to the end of `main`: a throwaway cluster is removed when it drops.
    let server = durastep_localpg::LocalDatabase::resolve_or_exit().await;
    if let Some(notice) = server.notice() {
        eprintln!("{notice}");
    }
    let options = example_database(server.url()).await?;
    let pool = PgPoolOptions::new().max_connections(5).connect_with(options).await?;
    let engine = Engine::builder()
        .pool(pool)
        .function(build_report())
        // The queue-depth gauge is sampled every reap interval.
        .worker_options(WorkerOptions { reap_interval: Duration::from_millis(500), ..Default::default() })
        .build()
        .await?;

    let worker = engine.spawn_worker();

    let mut runs = Vec::new();
    for n in 0..RUNS {
        runs.extend(engine.send(Event::new("report/requested", &n)).await?.run_ids);
    }
    for id in runs {
        let run = engine.wait_for_run(id, Duration::from_secs(30)).await?;
        println!("run {id}: {:?} after {} attempt(s)", run.state, run.attempt);
    }
    // One more sample of the gauge, now that the queue is empty.
    tokio::time::sleep(Duration::from_millis(600)).await;

    if serve {
        println!("serving; one event a second; Ctrl-C to stop");
        let mut n = RUNS;
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {
                    engine.send(Event::new("report/requested", &n)).await?;
                    n += 1;
                }
            }
        }
    } else {
        let scrape = scrape(addr).await?;
        println!("--- durastep lines of the scrape (buckets left out) ---");
        for line in scrape.lines().filter(|l| l.starts_with("durastep_") && !l.contains("_bucket{")) {
            println!("{line}");
        }
    }
    worker.stop().await?;
    Ok(())
}

/// Two steps; `fetch` fails on the first attempt of every third run.
fn build_report() -> Function {
    Function::new("build-report")
        .on_event("report/requested")
        .backoff(Backoff::Fixed(Duration::from_millis(200)))
        .handler(|ctx: Ctx, n: u32| async move {
            let attempt = ctx.attempt();
            let rows: u32 = ctx
                .step("fetch", || async move {
                    tokio::time::sleep(Duration::from_millis(5 + u64::from(n % 4) * 5)).await;
                    if n.is_multiple_of(3) && attempt == 1 {
                        return Err(HandlerError::new("503 from the warehouse API"));
                    }
                    Ok(n * 10)
                })
                .await?;
            ctx.step("render", || async move { Ok(format!("report of {rows} rows")) }).await
        })
}

/// GET /metrics from the exporter's listener, over plain HTTP/1.0 (so the body
/// is not chunked and ends when the server closes the connection).
async fn scrape(addr: SocketAddr) -> Result<String, Box<dyn std::error::Error>> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response.split_once("\r\n\r\n").ok_or("malformed HTTP response")?;
    let status = head.lines().next().unwrap_or_default();
    if status.split(' ').nth(1) != Some("200") {
        return Err(format!("scrape failed: {status}").into());
    }
    Ok(body.to_owned())
}

/// The example's own database on the server at `url`, created on first use.
async fn example_database(url: &str) -> Result<PgConnectOptions, Box<dyn std::error::Error>> {
    let server: PgConnectOptions = url.parse()?;
    let mut conn = sqlx::PgConnection::connect_with(&server)
        .await
        .map_err(|e| format!("cannot reach Postgres at {url}: {e} (set DATABASE_URL)"))?;
    let created = sqlx::query("CREATE DATABASE durastep_prometheus_example").execute(&mut conn).await;
    match created {
        // 42P04: it exists already (an earlier run).
        Err(sqlx::Error::Database(e)) if e.code().as_deref() != Some("42P04") => return Err(e.into()),
        Err(e) if !matches!(e, sqlx::Error::Database(_)) => return Err(e.into()),
        _ => {}
    }
    conn.close().await?;
    Ok(server.database("durastep_prometheus_example"))
}
