//! A run that a send claimed for a worker of its own process, which the
//! worker can no longer take (it stopped between the send's offer and its
//! answer), is released at once and runs elsewhere: not left claimed until
//! its lease expires.
//!
//! The `hand-over` failpoint with `error` makes every handoff refused, as by
//! a stopped worker. The lease is an hour and no reaper runs within the test,
//! so a run that was not released could only finish after the test's wait.
//! The worker polls every 10 minutes and the refusing send wakes nobody in
//! its process (its only run was handed on), so the released run is taken
//! within the wait only through the NOTIFY its release sends.

use std::time::Duration;

use durastep::{Event, failpoints};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

mod handoff_common;

/// Catches: a refused handoff that leaves its run claimed (it would wait for
/// its lease, an hour), a release that notifies no worker (the run would wait
/// for the 10-minute poll), and a released run that loses its input or runs
/// twice.
#[sqlx::test(migrations = false)]
async fn a_run_handed_to_a_worker_that_is_gone_is_released_and_runs_elsewhere(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let engine = handoff_common::engine(&opts).await;
    let worker = engine.spawn_worker();
    failpoints::set("hand-over", "error");
    let mut refused = 0;
    for i in 0..50 {
        let receipt = engine.send(Event::new("ping", &json!({"i": i}))).await.unwrap();
        let (run, event) = (receipt.run_ids[0], receipt.event_id);
        let done = handoff_common::finished(&engine, run).await;
        assert_eq!(done.output, Some(json!({"i": i})), "{done:?}");
        let states = handoff_common::history(&engine, run, event).await;
        if states.first().is_some_and(|(_, by_send)| *by_send) {
            // Claimed by the send, refused, released, claimed again, completed.
            let expected = ["running", "queued", "running", "completed"];
            let got: Vec<&str> = states.iter().map(|(s, _)| s.as_str()).collect();
            assert_eq!(got, expected, "run {run}: {states:?}");
            refused += 1;
            if refused == 3 {
                break;
            }
        }
        // Longer each time, so that a busy machine delays the worker's offer,
        // not the verdict.
        tokio::time::sleep(Duration::from_millis(20 * (i + 1).min(50))).await;
    }
    failpoints::set("hand-over", "off");
    worker.request_stop();
    worker.stop().await.unwrap();
    assert_eq!(refused, 3, "the sends handed on fewer than 3 runs in 50");
}
