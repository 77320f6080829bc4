//! Event to first step: how soon an idle worker starts a run after `send`.
//!
//! `cargo bench -p durastep-benches --bench latency`
//!
//! One worker (in this process, default options: LISTEN on, 1 s poll) waits
//! idle; the bench sends one event, and the function's first step records when
//! its body starts. Repeated with a pause, so the worker is idle each time. The
//! raw baseline is a NOTIFY -> LISTEN round trip with plain sqlx on the same
//! server.

use std::time::{Duration, Instant};

use durastep::{Ctx, Engine, Event, Function};
use durastep_benches::db::BenchDb;
use durastep_benches::report::{Table, ms, percentile, verdict};
use sqlx::postgres::PgListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

const SAMPLES: usize = 300;

#[tokio::main]
async fn main() {
    let db = BenchDb::create("latency").await;
    let pool = db.pool(10).await;
    println!("# Event to first step (database {})", db.name);

    // Raw: NOTIFY from one connection, received by a LISTEN connection.
    let mut listener = PgListener::connect_with(&pool).await.expect("listen");
    listener.listen("bench_ping").await.expect("listen");
    let mut notify_rtt = vec![];
    for _ in 0..SAMPLES {
        let t = Instant::now();
        sqlx::query("SELECT pg_notify('bench_ping', '')").execute(&pool).await.expect("notify");
        listener.recv().await.expect("notification");
        notify_rtt.push(t.elapsed());
    }
    drop(listener);

    let (tx, mut rx) = mpsc::unbounded_channel::<Instant>();
    let f = Function::new("first-step").on_event("bench/first").handler(move |ctx: Ctx, _: u32| {
        let tx = tx.clone();
        async move {
            ctx.step("first", || async move {
                let _ = tx.send(Instant::now());
                Ok(())
            })
            .await
        }
    });
    let engine = Engine::builder().pool(pool.clone()).function(f).build().await.expect("build engine");
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn({
        let (engine, shutdown) = (engine.clone(), shutdown.clone());
        async move { engine.run_worker(shutdown).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await; // LISTEN connected, first empty claim done

    let (mut first_step, mut send_rtt) = (vec![], vec![]);
    for i in 0..SAMPLES {
        let t = Instant::now();
        engine.send(Event::new("bench/first", &(i as u32))).await.expect("send");
        send_rtt.push(t.elapsed());
        let started =
            tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("first step in time").unwrap();
        first_step.push(started - t);
        // Let the run finish and the worker go idle again (empty claim, then waiting).
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    shutdown.cancel();
    worker.await.expect("worker task").expect("worker");

    let median = percentile(&first_step, 50.0);
    let mut t = Table::new(
        &format!("Event to first step ({SAMPLES} sends, idle worker, LISTEN/NOTIFY on)"),
        &["what", "median", "p99", "note"],
    );
    t.row(vec![
        "send -> first step body starts".into(),
        ms(median),
        ms(percentile(&first_step, 99.0)),
        format!("target median < 2 ms: {}", verdict(median < Duration::from_millis(2))),
    ]);
    t.row(vec![
        "engine.send round trip alone".into(),
        ms(percentile(&send_rtt, 50.0)),
        ms(percentile(&send_rtt, 99.0)),
        "BEGIN, topic-row lock, insert event + run + NOTIFY, COMMIT".into(),
    ]);
    t.row(vec![
        "raw NOTIFY -> LISTEN round trip (plain sqlx)".into(),
        ms(percentile(&notify_rtt, 50.0)),
        ms(percentile(&notify_rtt, 99.0)),
        "baseline".into(),
    ]);
    t.print();

    pool.close().await;
    db.drop_database().await;
}
