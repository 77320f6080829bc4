//! What the tests of a worker's two claim classes share: an engine with one
//! function of each class, `plain` (on `go`, claimed by the fast claim) and
//! `timed` (on `timed`, a finish timeout of an hour, so claimed by the full
//! claim), both returning at once.

use std::time::Duration;

use durastep::{Ctx, Engine, Function, WorkerOptions};
use durastep_testkit::url_of;
use serde_json::Value;
use sqlx::postgres::PgConnectOptions;

/// The engine, its worker run with `worker`.
pub async fn engine(opts: &PgConnectOptions, worker: WorkerOptions) -> Engine {
    Engine::builder()
        .database_url(url_of(opts))
        .worker_options(worker)
        .function(Function::new("plain").on_event("go").handler(|_ctx: Ctx, _: Value| async move { Ok(()) }))
        .function(
            Function::new("timed")
                .on_event("timed")
                .finish_timeout(Duration::from_secs(3_600))
                .handler(|_ctx: Ctx, _: Value| async move { Ok(()) }),
        )
        .build()
        .await
        .unwrap()
}
