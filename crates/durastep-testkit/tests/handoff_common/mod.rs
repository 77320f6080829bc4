//! The engine both handoff tests use: one function, `echo` (on `ping`, returns
//! its input), a lease of an hour with no heartbeat or reaper within a test,
//! and a poll every 10 minutes, so that a run comes back in time only
//! through what the test checks (a release, a give-back, a NOTIFY).

use std::time::Duration;

use durastep::{Ctx, Engine, Function, WorkerOptions};
use durastep_testkit::url_of;
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;

/// The lease, the heartbeat interval and the reaper's interval.
pub const LEASE: Duration = Duration::from_secs(3_600);

/// The engine on the test's database.
pub async fn engine(opts: &PgConnectOptions) -> Engine {
    let options = WorkerOptions {
        poll_interval: Duration::from_secs(600),
        lease: LEASE,
        heartbeat_interval: LEASE,
        reap_interval: LEASE,
        shutdown_grace: Duration::from_millis(100),
        ..WorkerOptions::default()
    };
    Engine::builder()
        .database_url(url_of(opts))
        .worker_options(options)
        .function(Function::new("echo").on_event("ping").handler(|_ctx: Ctx, v: Value| async move { Ok(v) }))
        .build()
        .await
        .unwrap()
}
