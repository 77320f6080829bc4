//! Event to first step: how soon an idle worker starts a run after `send`.
//!
//! `cargo bench -p durastep-benches --bench latency`
//!
//! 1. Raw baseline with plain sqlx on the same server: one connection inserts a
//!    queue row and NOTIFYs in one statement, a LISTEN connection receives it,
//!    and a third claims the row with `FOR UPDATE SKIP LOCKED`: send to claimed.
//! 2. Across processes: one `bench-worker` process (default options: LISTEN on)
//!    waits idle; this process sends one event, and the function's one step
//!    stores the wall-clock time its body started, which the bench reads back.
//!    Since migration 0036 the send claims the run for the idle worker through
//!    its offer and tells it on its channel (no claim of the worker's own).
//! 3. Across processes again, the worker also registering a function with a
//!    flow rule: each of its claim rounds sends the full claim beside the fast one.
//! 4. In the same process: the same with the worker in this process.
//! 5. The statements one `engine.send` runs (each one round trip once
//!    prepared), counted from sqlx's own statement log.
//!
//! Each sample waits until the run has finished and the worker is idle again.
//! Prints `RESULT` lines `wake_p50_ms` (across processes), `wake_p50_ms_mixed`
//! (3.), `wake_p50_ms_same_process` (each with the ratio to the raw baseline's
//! median) and `send_round_trips`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use durastep::{Engine, Event};
use durastep_benches::db::BenchDb;
use durastep_benches::functions::{self, FIRST, FIRST_STEP, unix_micros};
use durastep_benches::process::{WorkerConfig, WorkerProcess};
use durastep_benches::raw;
use durastep_benches::report::{Table, ms, percentile, result, verdict};
use sqlx::PgPool;
use sqlx::postgres::PgListener;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{Layer, filter::Targets};

const WORKER: &str = env!("CARGO_BIN_EXE_bench-worker");
const SAMPLES: usize = 300;
/// How long every sample rests before it sends, the raw baseline's too: an
/// idle worker must have finished the last run and gone back to waiting, and
/// a machine that rested this long answers its next statement more slowly
/// (the raw baseline's median here: 1.20 ms after 5 ms of rest, 1.43 ms
/// after 15 ms), so both sides rest alike.
const REST: Duration = Duration::from_millis(15);

/// Counts sqlx's statement log events while armed.
struct StatementCount {
    armed: AtomicBool,
    count: AtomicU64,
}

static STATEMENTS: StatementCount = StatementCount { armed: AtomicBool::new(false), count: AtomicU64::new(0) };

struct CountLayer;

impl<S: tracing::Subscriber> Layer<S> for CountLayer {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if STATEMENTS.armed.load(Ordering::Relaxed) && event.metadata().target() == "sqlx::query" {
            STATEMENTS.count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Send to claimed with plain sqlx: INSERT + NOTIFY, LISTEN, SKIP LOCKED claim.
async fn raw_wake(pool: &PgPool) -> Vec<Duration> {
    raw::setup(pool).await;
    let mut listener = PgListener::connect_with(pool).await.expect("listen");
    listener.listen("raw_wake").await.expect("listen");
    let mut sender = pool.acquire().await.expect("sender");
    let mut claimer = pool.acquire().await.expect("claimer");
    let mut out = Vec::with_capacity(SAMPLES);
    for _ in 0..SAMPLES + 20 {
        let t = Instant::now();
        sqlx::query(
            "WITH i AS (INSERT INTO raw.queue (state) VALUES ('queued') RETURNING id)
             SELECT pg_notify('raw_wake', '') FROM i",
        )
        .execute(&mut *sender)
        .await
        .expect("insert and notify");
        listener.recv().await.expect("notification");
        let claimed: Option<i64> = sqlx::query_scalar(
            "UPDATE raw.queue SET state = 'running'
              WHERE id = (SELECT id FROM raw.queue WHERE state = 'queued'
                           ORDER BY priority DESC, run_at LIMIT 1 FOR UPDATE SKIP LOCKED)
             RETURNING id",
        )
        .fetch_optional(&mut *claimer)
        .await
        .expect("claim");
        assert!(claimed.is_some(), "raw claim found the row");
        out.push(t.elapsed());
        tokio::time::sleep(REST).await;
    }
    drop(listener);
    sqlx::query("DROP SCHEMA raw CASCADE").execute(pool).await.expect("drop raw schema");
    out.split_off(20)
}

/// When the first step of `run` started (unix micros), once it is stored.
async fn first_step_started(pool: &PgPool, run: uuid::Uuid) -> i64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let done: Option<serde_json::Value> = sqlx::query_scalar(
            "SELECT s.output FROM durastep.step_results s JOIN durastep.runs r ON r.id = s.run_id
              WHERE s.run_id = $1 AND s.step_key = $2 AND r.state = 'completed'",
        )
        .bind(run)
        .bind(FIRST_STEP)
        .fetch_optional(pool)
        .await
        .expect("read the first step");
        if let Some(v) = done {
            return v.as_i64().expect("the first step stores its start time");
        }
        assert!(Instant::now() < deadline, "run {run} did not finish in 10 s");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Send to first step body, `SAMPLES` times, each after the worker went idle.
async fn wake(engine: &Engine) -> Vec<Duration> {
    let mut out = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES + 20 {
        // Let the worker finish the last run and go idle (empty claim, then waiting).
        tokio::time::sleep(REST).await;
        let sent = unix_micros();
        let run = engine.send(Event::new(FIRST, &i)).await.expect("send").run_ids[0];
        let started = first_step_started(engine.pool(), run).await;
        out.push(Duration::from_micros(u64::try_from(started - sent).unwrap_or(0)));
    }
    out.split_off(20)
}

#[tokio::main]
async fn main() {
    tracing::subscriber::set_global_default(
        tracing_subscriber::registry()
            .with(CountLayer.with_filter(Targets::new().with_target("sqlx::query", tracing::Level::TRACE))),
    )
    .expect("the bench's statement counter");
    let db = BenchDb::create("latency").await;
    let pool = db.pool(10).await;
    println!("# Event to first step (database {})", db.name);

    let raw_rtt = raw_wake(&pool).await;
    let raw_p50 = percentile(&raw_rtt, 50.0);

    let mut builder = Engine::builder().pool(pool.clone());
    for f in functions::all() {
        builder = builder.function(f);
    }
    let engine = builder.build().await.expect("build engine");

    // Across processes: the only worker is a bench-worker process.
    let mut worker = WorkerProcess::spawn(WORKER, &db.url, &WorkerConfig::default()).await;
    worker.go().await;
    tokio::time::sleep(Duration::from_millis(300)).await; // LISTEN connected, first empty claim done
    let across = wake(&engine).await;
    worker.stop().await;

    // Across processes, the worker also running a function with a flow rule
    // (so every claim round has a full claim beside the fast one).
    let mixed_config = WorkerConfig { flow: true, ..WorkerConfig::default() };
    let mut worker = WorkerProcess::spawn(WORKER, &db.url, &mixed_config).await;
    worker.go().await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mixed = wake(&engine).await;
    worker.stop().await;

    // The statements of one send, warm (every statement prepared on its connection).
    let before = STATEMENTS.count.load(Ordering::Relaxed);
    STATEMENTS.armed.store(true, Ordering::Relaxed);
    let counted_sends = 50u64;
    let mut send_rtt = Vec::new();
    for i in 0..counted_sends {
        let t = Instant::now();
        engine.send(Event::new(functions::SLEEP, &i)).await.expect("send");
        send_rtt.push(t.elapsed());
    }
    STATEMENTS.armed.store(false, Ordering::Relaxed);
    let statements = (STATEMENTS.count.load(Ordering::Relaxed) - before) as f64 / counted_sends as f64;

    // In the same process.
    let local = engine.spawn_worker();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let same = wake(&engine).await;
    local.stop().await.expect("worker");

    let (p50_across, p50_mixed, p50_same) =
        (percentile(&across, 50.0), percentile(&mixed, 50.0), percentile(&same, 50.0));
    let mut t = Table::new(
        &format!("Event to first step ({SAMPLES} sends each, idle worker, LISTEN/NOTIFY on)"),
        &["what", "median", "p99", "vs raw", "target", "verdict"],
    );
    for (what, samples, target) in [
        ("send -> first step body, worker in another process", &across, Duration::from_millis(2)),
        ("the same, the worker also running a function with a flow rule", &mixed, Duration::from_millis(2)),
        ("send -> first step body, worker in this process", &same, Duration::from_micros(1500)),
    ] {
        let p50 = percentile(samples, 50.0);
        t.row(vec![
            what.into(),
            ms(p50),
            ms(percentile(samples, 99.0)),
            format!("{:.2}x", p50.as_secs_f64() / raw_p50.as_secs_f64()),
            format!("<= {}", ms(target)),
            verdict(p50 <= target),
        ]);
    }
    t.row(vec![
        "raw INSERT+NOTIFY -> LISTEN -> SKIP LOCKED claim (plain sqlx)".into(),
        ms(raw_p50),
        ms(percentile(&raw_rtt, 99.0)),
        "baseline".into(),
        "".into(),
        "".into(),
    ]);
    t.row(vec![
        format!("engine.send alone: {statements:.1} statements (round trips once prepared)"),
        ms(percentile(&send_rtt, 50.0)),
        ms(percentile(&send_rtt, 99.0)),
        "".into(),
        "1 round trip".into(),
        verdict(statements <= 1.0),
    ]);
    t.print();
    let raw_ms = raw_p50.as_secs_f64() * 1e3;
    result("wake_p50_ms", p50_across.as_secs_f64() * 1e3, Some(p50_across.as_secs_f64() * 1e3 / raw_ms));
    result("wake_p50_ms_mixed", p50_mixed.as_secs_f64() * 1e3, Some(p50_mixed.as_secs_f64() * 1e3 / raw_ms));
    result("wake_p50_ms_same_process", p50_same.as_secs_f64() * 1e3, Some(p50_same.as_secs_f64() * 1e3 / raw_ms));
    result("send_round_trips", statements, None);

    pool.close().await;
    db.drop_database().await;
}
