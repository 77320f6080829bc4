//! What the hand-over tests share: the engine (by default one function,
//! `echo`, on `ping`, returning its input; a lease of an hour with no
//! heartbeat or reaper within a test; and a poll every 10 minutes, so that a
//! run comes back in time only through what the test checks: a release, a
//! give-back, a NOTIFY), and a run's history.

// Each test binary uses its own part of this module.
#![allow(dead_code)]

use std::time::Duration;

use durastep::{Ctx, Engine, Function, Run, WorkerOptions};
use durastep_testkit::{url_of, wait_for};
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;
use uuid::Uuid;

/// How long a test waits for what it expects.
pub const WAIT: Duration = Duration::from_secs(20);

/// The lease, the heartbeat interval and the reaper's interval.
pub const LEASE: Duration = Duration::from_secs(3_600);

/// The worker options of [`engine`].
pub fn options() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_secs(600),
        lease: LEASE,
        heartbeat_interval: LEASE,
        reap_interval: LEASE,
        shutdown_grace: Duration::from_millis(100),
        ..WorkerOptions::default()
    }
}

/// `echo`: on `ping`, returns its input.
pub fn echo() -> Function {
    Function::new("echo").on_event("ping").handler(|_ctx: Ctx, v: Value| async move { Ok(v) })
}

/// The engine on the test's database, with [`options`] and [`echo`].
pub async fn engine(opts: &PgConnectOptions) -> Engine {
    engine_with(opts, options(), vec![echo()]).await
}

/// The engine on the test's database with these worker options and functions.
pub async fn engine_with(opts: &PgConnectOptions, options: WorkerOptions, functions: Vec<Function>) -> Engine {
    let mut builder = Engine::builder().database_url(url_of(opts)).worker_options(options);
    for f in functions {
        builder = builder.function(f);
    }
    builder.build().await.unwrap()
}

/// The run's timeline, oldest first: (state, an attempt started by the
/// transaction of the send of `event`, that is, handed on by that send: its
/// start's time is the run's creation time, the send's transaction's, where
/// a claim's transaction starts after the send's has committed).
pub async fn history(engine: &Engine, run: Uuid, event: Uuid) -> Vec<(String, bool)> {
    sqlx::query_as(
        "SELECT h.state, h.part = 0 AND h.at = r.created_at AND r.event_id = $2
           FROM durastep.run_timeline h JOIN durastep.runs r ON r.id = h.run_id
          WHERE h.run_id = $1 ORDER BY h.seq, h.part",
    )
    .bind(run)
    .bind(event)
    .fetch_all(engine.pool())
    .await
    .unwrap()
}

/// The run's states, oldest first.
pub async fn states(engine: &Engine, run: Uuid) -> Vec<String> {
    sqlx::query_scalar("SELECT state FROM durastep.run_timeline WHERE run_id = $1 ORDER BY seq, part")
        .bind(run)
        .fetch_all(engine.pool())
        .await
        .unwrap()
}

/// The run, once it has finished (within [`WAIT`]).
pub async fn finished(engine: &Engine, run: Uuid) -> Run {
    wait_for("the run to finish", WAIT, || async move {
        let r = engine.run(run).await?;
        Ok(r.state.is_finished().then_some(r))
    })
    .await
    .unwrap()
}
