//! Shared helpers for the dashboard tests: an engine on the test's own
//! database, a worker in the background, requests to the router in process,
//! a function that fails while a flag says so, a run made to diverge by a
//! second build of its function, and 100,000 seeded runs.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode, header};
use durastep::{Ctx, Engine, Event, Function, HandlerError, Run, WorkerHandle, WorkerOptions};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tower::ServiceExt;
use uuid::Uuid;

/// How long any single wait in a test may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(20);

pub fn fast_options() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(500),
        reap_interval: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(5),
        ..Default::default()
    }
}

/// An engine on the test's database.
pub async fn engine(opts: &PgConnectOptions, functions: Vec<Function>) -> Engine {
    let pool = PgPoolOptions::new().max_connections(8).connect_with(opts.clone()).await.expect("connect");
    let mut b = Engine::builder().pool(pool).worker_options(fast_options());
    for f in functions {
        b = b.function(f);
    }
    b.build().await.expect("build engine")
}

/// A worker in the background until [`WorkerGuard::stop`] (or, without
/// waiting for it, until the guard is dropped).
pub struct WorkerGuard(WorkerHandle);

impl WorkerGuard {
    /// Stops the worker and waits until it has. A test that runs a worker
    /// ends with it: sqlx drops a passed test's database only once no
    /// connection to it is open, and a worker that was only told to stop
    /// (the guard dropped as the test returned) went on using its
    /// connections, so the database was left behind.
    pub async fn stop(self) {
        tokio::time::timeout(DEADLINE, self.0.stop()).await.expect("the worker stops").expect("worker");
    }
}

pub fn spawn_worker(engine: &Engine) -> WorkerGuard {
    WorkerGuard(engine.spawn_worker())
}

/// `budget-push`: step `fetch` returns a secret-looking output, step `push`
/// fails permanently while `broken` is true, then returns `{"pushed": true}`.
pub fn budget_push(broken: Arc<AtomicBool>) -> Function {
    Function::new("budget-push").on_event("campaign/budget.requested").retries(0).handler(
        move |ctx: Ctx, req: Value| {
            let broken = broken.clone();
            async move {
                let token: String = ctx.step("fetch", || async { Ok("STEP-OUTPUT-SECRET-4711".to_owned()) }).await?;
                let pushed: Value = ctx
                    .step("push", || async move {
                        if broken.load(Ordering::SeqCst) {
                            Err(HandlerError::permanent(format!("upstream refused account {}", req["ad_account_id"])))
                        } else {
                            Ok(json!({ "pushed": true, "with": token }))
                        }
                    })
                    .await?;
                Ok(pushed)
            }
        },
    )
}

/// Sends one budget request and waits until its run has failed.
pub async fn failed_run(engine: &Engine, data: Value) -> Uuid {
    let id = engine.send(Event::new("campaign/budget.requested", &data)).await.expect("send").run_ids[0];
    let run = engine.wait_for_run(id, DEADLINE).await.expect("load run");
    assert_eq!(run.state, durastep::RunState::Failed, "{run:?}");
    id
}

/// Waits until the run satisfies `pred`; fails the test after [`DEADLINE`].
pub async fn wait_for(engine: &Engine, id: Uuid, what: &str, pred: impl Fn(&Run) -> bool) -> Run {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let run = engine.run(id).await.expect("load run");
        if pred(&run) {
            return run;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}: {run:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A response, read whole.
pub struct Page {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Page {
    pub fn location(&self) -> Option<&str> {
        self.headers.get(header::LOCATION).and_then(|v| v.to_str().ok())
    }
}

/// Sends a request through the router in process.
pub async fn send(app: &Router, request: Request<Body>) -> Page {
    let response = app.clone().oneshot(request).await.expect("infallible router");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), 16 << 20).await.expect("read body");
    Page { status, headers, body: String::from_utf8(bytes.to_vec()).expect("utf-8 page") }
}

/// GET `path` with extra headers.
pub async fn get_with(app: &Router, path: &str, headers: &[(&str, &str)]) -> Page {
    let mut b = Request::get(path).header(header::HOST, "127.0.0.1:7070");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    send(app, b.body(Body::empty()).expect("request")).await
}

/// GET `path`.
pub async fn get(app: &Router, path: &str) -> Page {
    get_with(app, path, &[]).await
}

/// POST a form body (`a=1&b=2`) with extra headers.
pub async fn post_form(app: &Router, path: &str, form: &str, headers: &[(&str, &str)]) -> Page {
    let mut b = Request::post(path)
        .header(header::HOST, "127.0.0.1:7070")
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    send(app, b.body(Body::from(form.to_owned())).expect("request")).await
}

/// The value of the hidden `csrf` input of a page.
pub fn csrf_of(body: &str) -> String {
    let at = body.find("name=\"csrf\" value=\"").expect("a csrf field on the page") + "name=\"csrf\" value=\"".len();
    body[at..].split('"').next().expect("csrf value").to_owned()
}

/// Functions of the seeded runs.
pub const SEED_FUNCTIONS: [&str; 4] = ["meta-budget-update", "exact-invoice", "hubspot-sync", "post-to-channel"];

/// Inserts `n` events and one run each, in two statements, with realistic
/// states (85% completed, 7% failed, 3% queued, 2% sleeping, 2% cancelled, 1%
/// skipped), one run created per second going back from now, then ANALYZEs.
pub async fn seed_runs(engine: &Engine, n: i64) {
    sqlx::query(
        "INSERT INTO durastep.events (id, name, payload, idempotency_key, created_at)
         SELECT md5('seed-event-' || i)::uuid,
                (ARRAY['campaign/budget.requested', 'invoice/due', 'contact/changed', 'post/scheduled'])[1 + i % 4],
                jsonb_build_object('ad_account_id', 'act_' || (i % 500), 'n', i),
                'seed-' || i,
                durastep.now() - make_interval(secs => i)
           FROM generate_series(1, $1::bigint) AS i",
    )
    .bind(n)
    .execute(engine.pool())
    .await
    .expect("seed events");
    sqlx::query(
        "INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, attempt, max_attempts, last_error,
                                    output, created_at, started_at, finished_at, failed_step)
         SELECT md5('seed-run-' || i)::uuid,
                (ARRAY['meta-budget-update', 'exact-invoice', 'hubspot-sync', 'post-to-channel'])[1 + i % 4],
                md5('seed-event-' || i)::uuid,
                s.state,
                CASE WHEN s.state = 'sleeping' THEN durastep.now() + interval '1 hour' ELSE t.created END,
                CASE WHEN s.state = 'failed' THEN 3 ELSE 1 END,
                3,
                CASE WHEN s.state = 'failed' THEN 'HTTP 502 from upstream'
                     WHEN s.state = 'skipped' THEN 'over the rate limit' END,
                CASE WHEN s.state = 'completed' THEN jsonb_build_object('ref', 'r-' || i) END,
                t.created,
                CASE WHEN s.state NOT IN ('queued', 'skipped') THEN t.created END,
                CASE WHEN s.state IN ('completed', 'failed', 'cancelled', 'skipped')
                     THEN t.created + make_interval(secs => i % 30) END,
                CASE WHEN s.state = 'failed' THEN 'push' END
           FROM generate_series(1, $1::bigint) AS i,
                LATERAL (SELECT durastep.now() - make_interval(secs => i) AS created) t,
                LATERAL (SELECT CASE WHEN i % 100 < 85 THEN 'completed' WHEN i % 100 < 92 THEN 'failed'
                                     WHEN i % 100 < 95 THEN 'queued' WHEN i % 100 < 97 THEN 'sleeping'
                                     WHEN i % 100 < 99 THEN 'cancelled' ELSE 'skipped' END AS state) s",
    )
    .bind(n)
    .execute(engine.pool())
    .await
    .expect("seed runs");
    sqlx::query("ANALYZE durastep.events, durastep.runs").execute(engine.pool()).await.expect("analyze");
}

/// The id of seeded run number `i`.
pub async fn seeded_run(engine: &Engine, i: i64) -> Uuid {
    sqlx::query_scalar("SELECT md5('seed-run-' || $1::bigint)::uuid")
        .bind(i)
        .fetch_one(engine.pool())
        .await
        .expect("seeded id")
}

/// `probe`: a step named `first_step`, then a one-hour durable sleep. Two
/// builds with different first step names are the code change of a deploy: a
/// run the first build left asleep diverges at position 0 under the second.
pub fn probe(first_step: &'static str) -> Function {
    Function::new("probe").on_event("probe/go").handler(move |ctx: Ctx, _: Value| async move {
        ctx.step(first_step, || async { Ok(1) }).await?;
        ctx.sleep("nap", Duration::from_secs(3600)).await?;
        Ok(())
    })
}

/// A diverged run: the first build of [`probe`] (step `lookup`) runs it into
/// its sleep and its worker stops; then an engine with `probe(asked_step)` and
/// `others` moves the database clock past the sleep, and its worker parks the
/// run as diverged (recorded step `lookup`, asked `asked_step`). Returns that
/// engine, the run and the engine's worker.
pub async fn diverged_run(
    opts: &PgConnectOptions,
    asked_step: &'static str,
    others: Vec<Function>,
) -> (Engine, Uuid, WorkerGuard) {
    let v1 = engine(opts, vec![probe("lookup")]).await;
    let worker = spawn_worker(&v1);
    let id = v1.send(Event::new("probe/go", &json!({}))).await.expect("send").run_ids[0];
    wait_for(&v1, id, "the first build's run to sleep", |r| r.state == durastep::RunState::Sleeping).await;
    // Stopped for good before the clock moves: the first build must not wake it.
    worker.stop().await;
    v1.pool().close().await;

    let mut functions = vec![probe(asked_step)];
    functions.extend(others);
    let v2 = engine(opts, functions).await;
    let guard = spawn_worker(&v2);
    for sql in [
        "UPDATE durastep.clock SET offset_by = offset_by + interval '2 hours'",
        "SELECT pg_notify('durastep_wakeup', '')",
    ] {
        sqlx::query(sql).execute(v2.pool()).await.expect("move the clock past the sleep");
    }
    wait_for(&v2, id, "the run to diverge under the second build", |r| r.state == durastep::RunState::Diverged).await;
    (v2, id, guard)
}
