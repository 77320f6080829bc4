//! A run that a send handed to a worker of its own process, still in the
//! worker's channel when the worker stops, is given back at once (released,
//! keeping its place) and runs elsewhere: not left claimed until its lease
//! expires.
//!
//! The `hand-over` failpoint with `block` holds the send after its statement
//! claimed the run for the idle worker and before it puts the run in the
//! worker's channel. The test then lets the send go and stops the worker in
//! the same moment: the send puts the run in the channel, and the worker wakes
//! with both the run and its stop at hand and takes the stop first (its loop
//! checks the stop before anything else), so the run is still in the channel
//! when the worker stops. The lease is an hour and no reaper runs within the
//! test, so a run that was not given back could only finish after the test's
//! wait. Its own file: failpoints are global to the test binary.

use std::time::Duration;

use durastep::{Engine, Event, failpoints};
use durastep_testkit::wait_for;
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

mod handoff_common;

use handoff_common::{WAIT, states};

/// The output of the run, once it has finished.
async fn finished(engine: &Engine, run: Uuid) -> Value {
    handoff_common::finished(engine, run).await.output.unwrap_or(Value::Null)
}

/// Catches: a worker that stops with a handed run in its channel and drops
/// it (the run stays claimed for its hour-long lease), and a given-back run
/// that loses its input.
#[sqlx::test(migrations = false)]
async fn a_run_handed_to_a_stopping_worker_is_given_back(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = handoff_common::engine(&opts).await;
    let worker = engine.spawn_worker();
    failpoints::set("hand-over", "block");
    let mut handed = None;
    for i in 0..50u64 {
        let send = tokio::spawn({
            let engine = engine.clone();
            async move { engine.send(Event::new("ping", &json!({"i": i}))).await }
        });
        // The send either blocks at the handoff (the worker offered its
        // slots) or returns without one (the worker was not idle yet).
        let blocked = wait_for("the send to block or return", WAIT, || {
            let done = send.is_finished();
            async move { Ok((done || failpoints::blocked("hand-over") == 1).then_some(!done)) }
        })
        .await
        .unwrap();
        if blocked {
            handed = Some((i, send));
            break;
        }
        let run = send.await.unwrap().unwrap().run_ids[0];
        assert_eq!(finished(&engine, run).await, json!({"i": i}));
        // Longer each time, so that a busy machine delays the worker's offer,
        // not the verdict.
        tokio::time::sleep(Duration::from_millis(20 * (i + 1).min(50))).await;
    }
    let (i, send) = handed.expect("no send in 50 found the worker idle");
    // Both at once: the send puts its run in the channel; the worker wakes
    // to its stop.
    failpoints::release("hand-over");
    worker.request_stop();
    let receipt = send.await.unwrap().unwrap();
    worker.stop().await.unwrap();
    let run = receipt.run_ids[0];
    let snapshot = engine.run(run).await.unwrap();
    assert!(!snapshot.state.is_finished(), "the stopping worker ran the handed run: {snapshot:?}");
    assert_eq!(states(&engine, run).await, ["running", "queued"], "given back at once, as queued");

    // Another worker takes it (its lease of an hour would hold it otherwise).
    let worker = engine.spawn_worker();
    assert_eq!(finished(&engine, run).await, json!({"i": i}));
    assert_eq!(states(&engine, run).await, ["running", "queued", "running", "completed"]);
    worker.request_stop();
    worker.stop().await.unwrap();
}
