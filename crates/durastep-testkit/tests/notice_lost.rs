//! A run a send of another process handed to a worker, whose notice the
//! worker never read (its listener's connection died with the notice in
//! it), still runs, once, without waiting for its lease: the listener,
//! connected again, lists the claim records marked with the worker's offer
//! and the worker starts the runs of those it never heard of. And the worker
//! offers its slots again once its listener has connected again.
//!
//! The `notice-lost` failpoint drops a notice with the listener's connection.
//! The lease is an hour (`handoff_common`), so a run that waited for it would
//! not finish within a test. The failpoint is process-wide: the two tests
//! take turns.

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use durastep::{Ctx, Engine, Event, Function, RunState, failpoints};
use durastep_testkit::wait_for;
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tracing_subscriber::layer::SubscriberExt;

mod handoff_common;

use handoff_common::WAIT;

/// The failpoint is the process's: one test at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The `info` events of runs found after a lost notice (docs/operations.md
/// promises the event, its claim record and its number of runs): their
/// `claim` and `runs` fields, as the test's own subscriber sees them.
#[derive(Clone, Default)]
struct FoundLog(Arc<Mutex<Vec<(String, String)>>>);

/// The fields of one event, by name.
struct Fields(HashMap<&'static str, String>);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name(), format!("{value:?}"));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for FoundLog {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut fields = Fields(HashMap::new());
        event.record(&mut fields);
        let found = "found runs handed on through a notice this worker never read";
        if *event.metadata().level() == tracing::Level::INFO
            && fields.0.get("message").map(String::as_str) == Some(found)
        {
            let field = |name| fields.0.get(name).cloned().unwrap_or_default();
            self.0.lock().unwrap().push((field("claim"), field("runs")));
        }
    }
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

/// Catches: a handed run whose notice is lost and that waits for its lease
/// (the test times out without the listener's list), one that runs twice or
/// loses its input, a claim record the worker leaves behind, a worker that
/// stops offering its slots after it lost a notice, and one whose offer keeps
/// naming the key of a lost connection while it stays idle (the listener
/// must have it written afresh: the test times out without that).
#[sqlx::test(migrations = false)]
async fn a_run_whose_notice_was_lost_is_found_by_the_worker_which_offers_again(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let _serial = SERIAL.lock().await;
    // `#[sqlx::test]` runs the test on a current-thread runtime: the
    // worker's tasks log where this subscriber is in force.
    let found = FoundLog::default();
    let _log = tracing::subscriber::set_default(tracing_subscriber::registry().with(found.clone()));
    let engine = handoff_common::engine(&opts).await;
    let sender = handoff_common::engine(&opts).await;
    let worker = engine.spawn_worker();
    wait_for("the idle worker's offer", WAIT, || offered(&engine)).await.unwrap();

    failpoints::set("notice-lost", "1*error");
    let (states, output) = send_and_finish(&sender, 1).await;
    assert_eq!(failpoints::hits("notice-lost"), 1, "the notice never reached the listener");
    let logged = found.0.lock().unwrap().clone();
    assert!(
        matches!(logged.as_slice(), [(claim, runs)] if claim.parse::<i64>().is_ok() && runs == "1"),
        "one `info` event for the run found, with its claim record: {logged:?}"
    );
    assert_eq!(output, Some(json!({"n": 1})));
    let got: Vec<(&str, bool)> = states.iter().map(|(s, by)| (s.as_str(), *by)).collect();
    assert_eq!(got, [("running", true), ("completed", false)], "not the handed attempt that ran, once");
    failpoints::set("notice-lost", "off");
    wait_for("the worker to delete the found record", WAIT, || async {
        let left: i64 = sqlx::query_scalar("SELECT count(*) FROM durastep.run_claims WHERE offered_to IS NOT NULL")
            .fetch_one(engine.pool())
            .await?;
        Ok((left == 0).then_some(()))
    })
    .await
    .unwrap();

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

/// How often each run of [`noting`] started, by its input's `n`.
static STARTS: LazyLock<Mutex<HashMap<i64, u32>>> = LazyLock::new(Mutex::default);

/// Opens the gate a run of [`noting`] waits for.
static GATE: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// `noting`: on `note`, notes that its attempt started, waits for [`GATE`]
/// when its input says `gate`, else `hold_ms`, and returns its input.
fn noting() -> Function {
    Function::new("noting").on_event("note").handler(|_ctx: Ctx, v: Value| async move {
        let n = v["n"].as_i64().unwrap_or(-1);
        *STARTS.lock().unwrap().entry(n).or_default() += 1;
        if v["gate"] == json!(true) {
            GATE.notified().await;
        } else {
            tokio::time::sleep(Duration::from_millis(v["hold_ms"].as_u64().unwrap_or(0))).await;
        }
        Ok(v)
    })
}

/// How often the run of [`noting`] with `n` started.
fn starts(n: i64) -> u32 {
    STARTS.lock().unwrap().get(&n).copied().unwrap_or(0)
}

/// Catches, with sends from four tasks at once and notices lost again and
/// again: a run found both by its notice and by the listener's list that
/// starts twice (a notice that reached the new connection before the list's
/// marker, or the old one before it died), and a run whose notice was lost
/// that waits for its lease (an hour) instead.
#[sqlx::test(migrations = false)]
async fn runs_are_started_once_when_notices_are_lost_again_and_again(_p: PgPoolOptions, opts: PgConnectOptions) {
    const TASKS: i64 = 4;
    const EACH: i64 = 40;
    let _serial = SERIAL.lock().await;
    let engine = handoff_common::engine_with(&opts, handoff_common::options(), vec![noting()]).await;
    let sender = handoff_common::engine_with(&opts, handoff_common::options(), vec![noting()]).await;
    let worker = engine.spawn_worker();
    wait_for("the idle worker's offer", WAIT, || offered(&engine)).await.unwrap();

    // Loses the first notice the listener reads, again 30 ms after each loss,
    // and counts the losses (a count, not a chance: on a busy machine the
    // worker reads fewer notices, as few as 19 of 160 in one run).
    let arming = tokio_util::sync::CancellationToken::new();
    let losses = tokio::spawn({
        let arming = arming.clone();
        async move {
            let mut lost = 0u32;
            while !arming.is_cancelled() {
                failpoints::set("notice-lost", "1*error");
                while failpoints::hits("notice-lost") == 0 && !arming.is_cancelled() {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                if failpoints::hits("notice-lost") > 0 {
                    lost += 1;
                }
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
            failpoints::set("notice-lost", "off");
            lost
        }
    });
    let sends = (0..TASKS).map(|t| {
        let sender = sender.clone();
        tokio::spawn(async move {
            let mut runs = Vec::new();
            for i in 0..EACH {
                let n = t * EACH + i;
                // Each run still runs a while when a list after a reconnect
                // names it: a second start could meet it.
                let input = json!({"n": n, "hold_ms": 200});
                runs.push(sender.send(Event::new("note", &input)).await.unwrap().run_ids[0]);
                // Let the worker go idle and offer again now and then.
                if i % 3 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            runs
        })
    });
    let mut runs = Vec::new();
    for task in sends.collect::<Vec<_>>() {
        runs.extend(task.await.unwrap());
    }
    arming.cancel();
    let lost = losses.await.unwrap();
    for run in &runs {
        assert_eq!(handoff_common::finished(&sender, *run).await.output.map(|v| v["n"].is_i64()), Some(true));
    }
    let twice: Vec<(i64, u32)> = (0..TASKS * EACH).map(|n| (n, starts(n))).filter(|(_, c)| *c != 1).collect();
    assert!(twice.is_empty(), "runs started other than once: {twice:?}");
    eprintln!("{} runs, {lost} notices lost", runs.len());
    assert!(lost > 0, "no notice was lost");
    worker.request_stop();
    worker.stop().await.unwrap();
}

/// Catches: a record the worker took by its notice that a later reconnect
/// lists again while its run still runs, read back then as running, and
/// started again once the run has ended and left the worker's held runs (the
/// claim loop's own check no longer sees it). Run 1 is handed on by its
/// notice and held running; run 2's notice is lost, so the listener's list,
/// after the reconnect, names both records. The `found-before-start`
/// failpoint holds every found record between its read and its start: the
/// worker must find run 2's alone, and after run 1 has ended and run 2 has
/// started, run 1 must still have started once.
#[sqlx::test(migrations = false)]
async fn a_record_taken_by_its_notice_is_not_taken_again_from_a_later_list(_p: PgPoolOptions, opts: PgConnectOptions) {
    let _serial = SERIAL.lock().await;
    let engine = handoff_common::engine_with(&opts, handoff_common::options(), vec![noting()]).await;
    let sender = handoff_common::engine_with(&opts, handoff_common::options(), vec![noting()]).await;
    let worker = engine.spawn_worker();
    wait_for("the idle worker's offer", WAIT, || offered(&engine)).await.unwrap();
    failpoints::set("found-before-start", "block");

    let (n1, n2) = (1_001, 1_002);
    let first = sender.send(Event::new("note", &json!({"n": n1, "gate": true}))).await.unwrap();
    wait_for("run 1 to start", WAIT, || async { Ok((starts(n1) == 1).then_some(())) }).await.unwrap();
    let got: Vec<(String, bool)> = handoff_common::history(&sender, first.run_ids[0], first.event_id).await;
    assert_eq!(got.first().map(|(s, by)| (s.as_str(), *by)), Some(("running", true)), "run 1 not handed on");

    // Run 2's notice is lost; the worker, with 63 slots free, still offers.
    wait_for("the worker's offer beside run 1", WAIT, || offered(&engine)).await.unwrap();
    failpoints::set("notice-lost", "1*error");
    let second = sender.send(Event::new("note", &json!({"n": n2}))).await.unwrap();
    wait_for("run 2's record found and held", WAIT, || async {
        Ok((failpoints::blocked("found-before-start") >= 1).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(failpoints::hits("notice-lost"), 1, "run 2's notice never reached the listener");
    failpoints::set("notice-lost", "off");

    // Run 1 ends and leaves the worker; then the found records go on.
    GATE.notify_one();
    assert_eq!(handoff_common::finished(&sender, first.run_ids[0]).await.state, RunState::Completed);
    failpoints::release("found-before-start");
    assert_eq!(handoff_common::finished(&sender, second.run_ids[0]).await.output, Some(json!({"n": n2})));
    let got: Vec<(String, bool)> = handoff_common::history(&sender, second.run_ids[0], second.event_id).await;
    let got: Vec<(&str, bool)> = got.iter().map(|(s, by)| (s.as_str(), *by)).collect();
    assert_eq!(got, [("running", true), ("completed", false)], "run 2 not the handed attempt, found");
    // A second start of run 1 would have come with run 2's.
    worker.request_stop();
    worker.stop().await.unwrap();
    assert_eq!((starts(n1), starts(n2)), (1, 1), "a run started other than once");
}
