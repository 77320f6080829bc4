//! Shared helpers for the integration tests: an engine on the test's own
//! database with fast timings, and a worker running in the background.
#![allow(dead_code)]

use std::time::Duration;

use durastep::{Engine, Function, WorkerOptions};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

/// Worker timings for tests: short polls and leases, so nothing waits long.
pub fn fast_options() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(500),
        reap_interval: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(5),
        max_in_flight: 16,
        ..Default::default()
    }
}

pub async fn engine(opts: &PgConnectOptions, functions: Vec<Function>) -> Engine {
    engine_with(opts, functions, fast_options()).await
}

pub async fn engine_with(opts: &PgConnectOptions, functions: Vec<Function>, worker: WorkerOptions) -> Engine {
    let pool = PgPoolOptions::new().max_connections(6).connect_with(opts.clone()).await.expect("connect");
    let mut b = Engine::builder().pool(pool).worker_options(worker);
    for f in functions {
        b = b.function(f);
    }
    b.build().await.expect("build engine")
}

/// A worker in the background; cancel the token (or drop the guard) to stop it.
pub struct WorkerGuard {
    pub shutdown: CancellationToken,
    pub handle: Option<tokio::task::JoinHandle<Result<(), durastep::Error>>>,
}

impl WorkerGuard {
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(h) = self.handle.take() {
            h.await.expect("worker task").expect("worker result");
        }
    }
}

impl Drop for WorkerGuard {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub fn spawn_worker(engine: &Engine) -> WorkerGuard {
    let shutdown = CancellationToken::new();
    let e = engine.clone();
    let s = shutdown.clone();
    WorkerGuard { shutdown, handle: Some(tokio::spawn(async move { e.run_worker(s).await })) }
}

/// The database URL of a test's own database (for worker processes).
pub fn url_of(opts: &PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("postgres")
    )
}

/// Logs to the test output when RUST_LOG is set (tests only; the library never installs a subscriber).
pub fn init_logs() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
    }
}
