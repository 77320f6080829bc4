//! A run a send of another process handed to a worker, whose notice the
//! worker never read (its listener's connection died with the notice in
//! it), still runs: nothing extends its lease, so it lapses, the reaper
//! takes the run back and a claim runs it. And the worker offers its slots
//! again once its listener has connected again.
//!
//! The `notice-lost` failpoint (`1*error`) drops the first notice with the
//! listener's connection. The lease is short (2 s) so that the lapse comes
//! within the test; the worker's heartbeat extends the leases of the runs
//! it holds, which this one never was.

use std::time::Duration;

use durastep::{Engine, Event, WorkerOptions, failpoints};
use durastep_testkit::wait_for;
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

mod handoff_common;

use handoff_common::WAIT;

/// A lease of 2 s, which the reaper takes back within the test.
async fn build(opts: &PgConnectOptions) -> Engine {
    let options = WorkerOptions {
        lease: Duration::from_secs(2),
        heartbeat_interval: Duration::from_millis(500),
        reap_interval: Duration::from_millis(300),
        poll_interval: Duration::from_millis(200),
        ..handoff_common::options()
    };
    handoff_common::engine_with(opts, options, vec![handoff_common::echo()]).await
}

/// The slots of the worker's offer, once it has one with free slots.
async fn offered(engine: &Engine) -> durastep_testkit::Result<Option<i32>> {
    Ok(sqlx::query_scalar("SELECT slots FROM durastep.worker_offers WHERE slots > 0")
        .fetch_optional(engine.pool())
        .await?)
}

/// Sends `ping` with `n` and waits for its run to finish; returns its
/// history and output.
async fn send_and_finish(sender: &Engine, n: i32) -> (Vec<(String, bool)>, Option<Value>) {
    let receipt = sender.send(Event::new("ping", &json!({"n": n}))).await.unwrap();
    let run = receipt.run_ids[0];
    let done = handoff_common::finished(sender, run).await;
    (handoff_common::history(sender, run, receipt.event_id).await, done.output)
}

/// Catches: a handed run whose notice is lost and that never runs (its
/// lease extended although no attempt holds it, or never reaped), one that
/// runs twice or loses its input, a worker that stops offering its slots
/// after it lost a notice, and one whose offer keeps naming the key of a
/// lost connection while it stays idle (the listener must have it written
/// afresh: the test times out without that).
#[sqlx::test(migrations = false)]
async fn a_run_whose_notice_was_lost_runs_after_its_lease_and_the_worker_offers_again(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let engine = build(&opts).await;
    let sender = build(&opts).await;
    let worker = engine.spawn_worker();
    wait_for("the idle worker's offer", WAIT, || offered(&engine)).await.unwrap();

    failpoints::set("notice-lost", "1*error");
    let (states, output) = send_and_finish(&sender, 1).await;
    assert_eq!(failpoints::hits("notice-lost"), 1, "the notice never reached the listener");
    assert_eq!(output, Some(json!({"n": 1})));
    assert!(states.first().is_some_and(|(s, by_send)| s == "running" && *by_send), "not handed on: {states:?}");
    let got: Vec<&str> = states.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(got.last(), Some(&"completed"));
    assert_eq!(got.iter().filter(|s| **s == "completed").count(), 1, "{got:?}");
    assert!(got.len() >= 4, "the run was not taken back and claimed again: {got:?}");
    failpoints::set("notice-lost", "off");

    // The listener connected again, and the worker offers its slots again:
    // a send hands its run on, and the worker starts it from the notice.
    wait_for("the worker's offer again", WAIT, || offered(&engine)).await.unwrap();
    let (states, output) = send_and_finish(&sender, 2).await;
    assert_eq!(output, Some(json!({"n": 2})));
    let got: Vec<(&str, bool)> = states.iter().map(|(s, by)| (s.as_str(), *by)).collect();
    assert_eq!(got, [("running", true), ("completed", false)], "not handed on again");

    // A connection lost while the worker is idle, with no run in its notice
    // (the test's own notice on the worker's channel): nothing makes the
    // worker busy, so only the listener's new key has its offer written
    // again. The old row names a key no connection holds; a send that met it
    // would delete it and hand nothing on.
    // The offer once the worker is idle again (busy a moment with the last
    // run, it may have withdrawn it).
    let (old_key, channel): (i64, String) = wait_for("the idle worker's offer", WAIT, || async {
        Ok(sqlx::query_as("SELECT lock_key, channel FROM durastep.worker_offers WHERE slots > 0")
            .fetch_optional(engine.pool())
            .await?)
    })
    .await
    .unwrap();
    failpoints::set("notice-lost", "1*error");
    sqlx::query("SELECT pg_notify($1, 'not a hand-over')").bind(&channel).execute(engine.pool()).await.unwrap();
    wait_for("the offer written again under the listener's new key", WAIT, || async {
        let key: Option<i64> = sqlx::query_scalar("SELECT lock_key FROM durastep.worker_offers WHERE slots > 0")
            .fetch_optional(engine.pool())
            .await?;
        Ok(key.filter(|k| *k != old_key))
    })
    .await
    .unwrap();
    assert_eq!(failpoints::hits("notice-lost"), 1, "the test's notice never reached the listener");
    failpoints::set("notice-lost", "off");
    let (states, output) = send_and_finish(&sender, 3).await;
    assert_eq!(output, Some(json!({"n": 3})));
    let got: Vec<(&str, bool)> = states.iter().map(|(s, by)| (s.as_str(), *by)).collect();
    assert_eq!(got, [("running", true), ("completed", false)], "not handed on after an idle reconnect");
    worker.request_stop();
    worker.stop().await.unwrap();
}
