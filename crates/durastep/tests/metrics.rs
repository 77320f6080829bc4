//! Metrics: what the worker records through the `metrics` facade, observed
//! with a recorder local to each test (the spans are in tests/traces.rs).
//!
//! `#[sqlx::test]` runs each test on a current-thread runtime, so every task
//! the worker spawns runs on the test's thread, where the thread-local
//! recorder (`metrics::set_default_local_recorder`) is in force; tests running
//! in parallel on other threads do not see each other's metrics.
mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durastep::{Backoff, Ctx, Event, Function, HandlerError, WorkerOptions};
use metrics::{Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, SharedString, Unit};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::Gate;

// ---- A recorder that keeps everything (cumulative, never drained) ----

#[derive(Default)]
struct Recorded {
    counters: HashMap<String, u64>,
    gauges: HashMap<String, f64>,
    histograms: HashMap<String, Vec<f64>>,
}

/// A metric's identity: its name and labels, as `name{a=1,b=2}` with the labels sorted.
fn id_of(key: &Key) -> String {
    let labels: BTreeMap<&str, &str> = key.labels().map(|l| (l.key(), l.value())).collect();
    let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{}{{{}}}", key.name(), labels.join(","))
}

#[derive(Clone, Default)]
struct TestRecorder(Arc<Mutex<Recorded>>);

struct Handle {
    id: String,
    into: Arc<Mutex<Recorded>>,
}

impl Handle {
    fn with<R>(&self, f: impl FnOnce(&mut Recorded, &str) -> R) -> R {
        f(&mut self.into.lock().unwrap(), &self.id)
    }
}

impl CounterFn for Handle {
    fn increment(&self, value: u64) {
        self.with(|r, id| *r.counters.entry(id.to_owned()).or_default() += value);
    }
    fn absolute(&self, value: u64) {
        self.with(|r, id| r.counters.insert(id.to_owned(), value));
    }
}

impl GaugeFn for Handle {
    fn increment(&self, value: f64) {
        self.with(|r, id| *r.gauges.entry(id.to_owned()).or_default() += value);
    }
    fn decrement(&self, value: f64) {
        self.with(|r, id| *r.gauges.entry(id.to_owned()).or_default() -= value);
    }
    fn set(&self, value: f64) {
        self.with(|r, id| r.gauges.insert(id.to_owned(), value));
    }
}

impl HistogramFn for Handle {
    fn record(&self, value: f64) {
        self.with(|r, id| r.histograms.entry(id.to_owned()).or_default().push(value));
    }
}

impl metrics::Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(Arc::new(self.handle(key)))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(Arc::new(self.handle(key)))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(Arc::new(self.handle(key)))
    }
}

impl TestRecorder {
    fn handle(&self, key: &Key) -> Handle {
        Handle { id: id_of(key), into: self.0.clone() }
    }
    fn counter(&self, id: &str) -> u64 {
        self.0.lock().unwrap().counters.get(id).copied().unwrap_or(0)
    }
    fn gauge(&self, id: &str) -> Option<f64> {
        self.0.lock().unwrap().gauges.get(id).copied()
    }
    fn samples(&self, id: &str) -> Vec<f64> {
        self.0.lock().unwrap().histograms.get(id).cloned().unwrap_or_default()
    }
}

// ---- Metrics ----

/// Catches: a run cancelled while it waits, claimed ahead, for a slot that
/// starts its handler anyway (it must end its attempt at once without user
/// code and without a slot: its worker's only slot stays blocked). On this
/// current-thread runtime a handler spawned for a cancelled run is dropped
/// before its first poll, so what the missing check shows is the attempt
/// counted as started: every run of this scenario that started is counted,
/// the cancelled one is not.
#[sqlx::test(migrations = false)]
async fn a_run_cancelled_while_it_waits_for_a_slot_never_starts(_p: PgPoolOptions, opts: PgConnectOptions) {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let ahead = common::ahead::Ahead::new();
    let engine = ahead.engine(&opts).await;
    let w = common::spawn_worker(&engine);
    let (round, blocked, x) = ahead.claimed_ahead(&engine).await;
    engine.cancel(x, "not needed").await.unwrap();
    // The attempt ends (the worker lets go of it) while the slot is still blocked.
    common::wait_until("the cancelled attempt to end", || async { common::lease_of(&engine, x).await.1.is_none() })
        .await;
    assert!(!ahead.gates[round].is_open());
    assert_eq!(engine.run(blocked).await.unwrap().state, durastep::RunState::Running);
    let cancelled = engine.run(x).await.unwrap();
    assert_eq!((cancelled.state, cancelled.attempt), (durastep::RunState::Cancelled, 1), "{cancelled:?}");
    ahead.gates[round].open();
    assert_eq!(common::finished(&engine, blocked).await.state, durastep::RunState::Completed);
    w.stop().await;
    assert_eq!(ahead.x_starts.load(Ordering::SeqCst), round as u32, "the cancelled run ran user code");
    // Earlier rounds: 100 quick runs, the blocking run and x each; this round
    // the same but x.
    let started = recorder.counter("durastep_runs_started_total{function=ahead,kind=first}");
    assert_eq!(started, round as u64 * 102 + 101, "runs counted as started");
}

/// Catches: a retry not counted as a started attempt (or counted as a first
/// one), a failed attempt counted as a failed run or not at all, a completion
/// counted twice; a replayed step timed again (step "fetch" runs once but is
/// replayed on attempt 2), an executed step not timed; claims and group
/// commits not measured.
#[sqlx::test(migrations = false)]
async fn a_run_that_fails_once_then_completes(_p: PgPoolOptions, opts: PgConnectOptions) {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let tries = Arc::new(AtomicU32::new(0));
    let t = tries.clone();
    let f = Function::new("m-flaky").on_event("go").retries(3).backoff(Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, _: ()| {
            let t = t.clone();
            async move {
                ctx.step("fetch", || async { Ok(1) }).await?;
                ctx.step("push", || async {
                    if t.fetch_add(1, Ordering::SeqCst) == 0 {
                        return Err(HandlerError::new("503 from the ads API"));
                    }
                    Ok(2)
                })
                .await?;
                Ok(())
            }
        },
    );
    let engine = common::engine(&opts, vec![f]).await;
    let receipt = engine.send(Event::new("go", &())).await.unwrap();
    let worker = common::spawn_worker(&engine);
    let run = common::finished(&engine, receipt.run_ids[0]).await;
    assert_eq!(run.attempt, 2, "{run:?}");
    worker.stop().await;

    let function = "function=m-flaky";
    assert_eq!(recorder.counter(&format!("durastep_runs_started_total{{{function},kind=first}}")), 1);
    assert_eq!(recorder.counter(&format!("durastep_runs_started_total{{{function},kind=retry}}")), 1);
    assert_eq!(recorder.counter(&format!("durastep_attempts_failed_total{{{function}}}")), 1);
    assert_eq!(recorder.counter(&format!("durastep_runs_completed_total{{{function}}}")), 1);
    assert_eq!(recorder.counter(&format!("durastep_runs_failed_total{{{function}}}")), 0);
    assert_eq!(recorder.counter(&format!("durastep_runs_suspended_total{{{function}}}")), 0);

    let step = |name: &str, outcome: &str| {
        recorder.samples(&format!("durastep_step_duration_seconds{{{function},outcome={outcome},step={name}}}"))
    };
    assert_eq!(step("fetch", "ok").len(), 1, "fetch ran once, then was replayed");
    assert_eq!(step("fetch", "error").len(), 0);
    assert_eq!(step("push", "error").len(), 1, "push failed on attempt 1");
    assert_eq!(step("push", "ok").len(), 1, "push succeeded on attempt 2");
    assert!(step("push", "ok").iter().all(|s| *s >= 0.0 && *s < 15.0));

    // Claims: at least the two that started the attempts, each taking some time.
    let sizes = recorder.samples("durastep_claim_batch_size{claim=fast}");
    assert_eq!(sizes.iter().sum::<f64>(), 2.0, "two claims returned a run: {sizes:?}");
    assert_eq!(recorder.samples("durastep_claim_duration_seconds{claim=fast}").len(), sizes.len());
    assert!(recorder.samples("durastep_claim_batch_size{claim=full}").is_empty(), "no function needs the full claim");
    // Group commits: checkpoints fetch and push, and the completion.
    let flushed = recorder.samples("durastep_checkpoint_flush_batch_size{}");
    assert_eq!(flushed.iter().sum::<f64>(), 3.0, "{flushed:?}");
    assert_eq!(recorder.samples("durastep_checkpoint_flush_duration_seconds{}").len(), flushed.len());
}

/// Catches: a failed run counted as a retry, or not counted; a suspension
/// (a durable sleep) not counted.
#[sqlx::test(migrations = false)]
async fn failed_and_suspended_runs_are_counted(_p: PgPoolOptions, opts: PgConnectOptions) {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let doomed = Function::new("m-doomed").on_event("go").retries(0).handler(|ctx: Ctx, _: ()| async move {
        ctx.step("call", || async { Err::<(), _>(HandlerError::permanent("400 bad request")) }).await?;
        Ok(())
    });
    let sleeper = Function::new("m-sleeper").on_event("go").handler(|ctx: Ctx, _: ()| async move {
        ctx.sleep("nap", Duration::from_secs(3600)).await?;
        Ok(())
    });
    let engine = common::engine(&opts, vec![doomed, sleeper]).await;
    let receipt = engine.send(Event::new("go", &())).await.unwrap();
    let worker = common::spawn_worker(&engine);
    for id in &receipt.run_ids {
        common::wait_for_run_where(&engine, *id, "failed or sleeping", |r| {
            r.state == durastep::RunState::Failed || r.state == durastep::RunState::Sleeping
        })
        .await;
    }
    worker.stop().await;
    assert_eq!(recorder.counter("durastep_runs_failed_total{function=m-doomed}"), 1);
    assert_eq!(recorder.counter("durastep_attempts_failed_total{function=m-doomed}"), 0);
    assert_eq!(recorder.counter("durastep_runs_suspended_total{function=m-sleeper}"), 1);
    assert_eq!(recorder.counter("durastep_runs_completed_total{function=m-sleeper}"), 0);
}

/// Catches: a queue depth that counts running runs, is not sampled, or is not
/// brought back to 0 once the queue drains.
#[sqlx::test(migrations = false)]
async fn queue_depth_reflects_queued_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let (entered, release) = (Gate::new(), Gate::new());
    let (e, r) = (entered.clone(), release.clone());
    let f = Function::new("m-depth").on_event("go").handler(move |_ctx: Ctx, _: i32| {
        let (e, r) = (e.clone(), r.clone());
        async move {
            e.open();
            r.wait().await;
            Ok(())
        }
    });
    // One attempt at a time, the gauge sampled every 20 ms.
    let worker_opts =
        WorkerOptions { max_in_flight: 1, reap_interval: Duration::from_millis(20), ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![f], worker_opts).await;
    for i in 0..3 {
        engine.send(Event::new("go", &i)).await.unwrap();
    }
    let worker = common::spawn_worker(&engine);
    entered.reached("the first run").await;
    let depth = "durastep_queue_depth{function=m-depth}";
    common::wait_until("queue depth 2 (one of three running)", || async { recorder.gauge(depth) == Some(2.0) }).await;
    release.open();
    common::wait_until("every run done", || async {
        common::count(&engine, "durastep.runs WHERE state = 'completed'").await == 3
    })
    .await;
    common::wait_until("queue depth 0", || async { recorder.gauge(depth) == Some(0.0) }).await;
    worker.stop().await;
}

/// Catches: a reaped run not counted (or counted under the wrong outcome); a
/// stale attempt whose checkpoint is fenced not counted as a lost lease, or a
/// lost lease counted for the attempt that took the run over.
#[sqlx::test(migrations = false)]
async fn reaped_runs_and_lost_leases_are_counted(_p: PgPoolOptions, opts: PgConnectOptions) {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let h = Arc::new(common::Handoff::default());
    let make = || {
        let h = h.clone();
        Function::new("m-fenced").on_event("go").retries(3).backoff(Backoff::Fixed(Duration::ZERO)).handler(
            move |ctx: Ctx, _: ()| {
                let h = h.clone();
                async move {
                    let attempt = ctx.attempt();
                    let _dropped = h.drop_guard(attempt);
                    ctx.step("hold", || async move {
                        h.hold(attempt).await;
                        Ok(attempt)
                    })
                    .await?;
                    Ok(())
                }
            },
        )
    };
    // Worker A's lease expires and is reaped; worker B runs attempt 2.
    let (id, _engine_a, wa, engine, wb) = common::take_over(&opts, make, &h).await;
    assert_eq!(recorder.counter("durastep_runs_reaped_total{outcome=queued}"), 1);
    assert_eq!(recorder.counter("durastep_leases_lost_total{function=m-fenced}"), 0);
    // A's step finishes; its checkpoint is fenced and A drops the handler.
    common::release_stale(&h, wa).await;
    assert_eq!(recorder.counter("durastep_leases_lost_total{function=m-fenced}"), 1);
    h.b_gate.open();
    let run = common::finished(&engine, id).await;
    wb.stop().await;
    assert_eq!(run.state, durastep::RunState::Completed, "{run:?}");
    assert_eq!(recorder.counter("durastep_leases_lost_total{function=m-fenced}"), 1);
    assert_eq!(recorder.counter("durastep_runs_started_total{function=m-fenced,kind=retry}"), 1);
    assert_eq!(recorder.counter("durastep_runs_completed_total{function=m-fenced}"), 1);
    assert_eq!(recorder.counter("durastep_runs_reaped_total{outcome=queued}"), 1);
}

/// Catches: a worker that sends the full claim (flow control, the larger
/// statement) beside every fast claim while none of its flow-limited runs is
/// due. Until 2026-12-04 every claim round had both (the full one in about
/// every second round of a backlog); now a class whose claim found nothing
/// while the other class had runs is not claimed again before its next due
/// run, a wake-up or the poll interval (1 s here, so a busy machine's slower
/// drain can add only about one full claim per second of it).
#[sqlx::test(migrations = false)]
async fn a_backlog_of_one_class_does_not_send_the_other_class_claim_each_time(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let plain = Function::new("plain").on_event("go").handler(|ctx: Ctx, _: ()| async move {
        ctx.step("one", || async { Ok(()) }).await?;
        Ok(())
    });
    let limited = Function::new("limited")
        .on_event("other")
        .concurrency(durastep::Concurrency::new(1))
        .handler(|_ctx: Ctx, _: ()| async move { Ok(()) });
    let worker_options = WorkerOptions {
        max_in_flight: 4,
        claim_batch: 4,
        claim_ahead: 0,
        poll_interval: Duration::from_secs(1),
        ..common::fast_options()
    };
    let engine = common::engine_with(&opts, vec![plain, limited], worker_options).await;
    let mut ids = Vec::new();
    for i in 0..200 {
        ids.push(engine.send(Event::new("go", &i)).await.unwrap().run_ids[0]);
    }
    let worker = common::spawn_worker(&engine);
    for id in ids {
        common::finished(&engine, id).await;
    }
    worker.stop().await;
    let fast = recorder.samples("durastep_claim_batch_size{claim=fast}");
    let full = recorder.samples("durastep_claim_batch_size{claim=full}");
    assert_eq!(fast.iter().sum::<f64>(), 200.0, "every run claimed by the fast claim");
    assert!(fast.len() >= 50, "batches of at most 4: {}", fast.len());
    assert!(full.iter().all(|n| *n == 0.0), "nothing of the full claim's class was due");
    assert!(
        full.len() * 4 < fast.len(),
        "{} full claims beside {} fast claims: the idle class was claimed along",
        full.len(),
        fast.len()
    );
}

/// Catches: a wake-up that ends the hold of both claim classes when it
/// announces runs of one. Until migration 0027 a send's NOTIFY had an empty
/// payload, so a worker that also ran a function of the full claim (here one
/// with a finish timeout) sent the full claim's statement beside the fast one
/// at every send of a plain function; and a worker woke for sends of
/// functions it does not run at all. The poll interval (60 s) is longer than
/// the test: every claim after the first comes from a wake-up. The sends come
/// from another engine, so that they reach the worker by NOTIFY (not by the
/// in-process wake-up), and then from the worker's own engine: its
/// in-process wake-up wakes the classes of the functions the events trigger
/// (until 2026-12-04 afternoon it woke both). Since migration 0028 also: a
/// send to a flow-limited function (the full fan-out, which until then
/// notified with an empty payload) wakes only the full class.
#[sqlx::test(migrations = false)]
async fn a_wake_up_wakes_only_the_class_of_the_functions_it_names(_p: PgPoolOptions, opts: PgConnectOptions) {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let plain =
        || Function::new("plain").on_event("go").handler(|_ctx: Ctx, _: serde_json::Value| async move { Ok(()) });
    let timed = || {
        Function::new("timed")
            .on_event("timed")
            .finish_timeout(Duration::from_secs(3600))
            .handler(|_ctx: Ctx, _: serde_json::Value| async move { Ok(()) })
    };
    let limited = || {
        Function::new("limited")
            .on_event("limited")
            .concurrency(durastep::Concurrency::new(4))
            .handler(|_ctx: Ctx, _: serde_json::Value| async move { Ok(()) })
    };
    let elsewhere =
        Function::new("elsewhere").on_event("far").handler(|_ctx: Ctx, _: serde_json::Value| async move { Ok(()) });
    let worker_options = WorkerOptions { poll_interval: Duration::from_secs(60), ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![plain(), timed(), limited()], worker_options).await;
    let sender = common::engine(&opts, vec![plain(), timed(), limited(), elsewhere]).await;
    let worker = common::spawn_worker(&engine);
    let claims = |class: &str| recorder.samples(&format!("durastep_claim_batch_size{{claim={class}}}")).len();

    // One send of each name first (the first send of a name takes the full
    // fan-out, which creates its topic row).
    sender.send(Event::new("far", &0)).await.unwrap();
    for name in ["timed", "go", "limited"] {
        let id = sender.send(Event::new(name, &())).await.unwrap().run_ids[0];
        assert_eq!(common::finished(&engine, id).await.state, durastep::RunState::Completed);
    }
    // A wake-up naming the function of the full claim reaches that class
    // while the worker holds (nothing is due).
    let id = sender.send(Event::new("timed", &())).await.unwrap().run_ids[0];
    let run = common::finished(&engine, id).await;
    assert_eq!(run.state, durastep::RunState::Completed, "{run:?}");

    // Ten sends of `name`, each run awaited: each is claimed by the claim of
    // its function's class, and the other class claims (almost) never.
    let ten_sends = async |name: &str, class: &str, other: &str| {
        let (mine, others) = (claims(class), claims(other));
        for i in 0..10 {
            let id = sender.send(Event::new(name, &i)).await.unwrap().run_ids[0];
            assert_eq!(common::finished(&engine, id).await.state, durastep::RunState::Completed);
        }
        assert!(claims(class) >= mine + 10, "each run claimed: {mine} -> {} {class} claims", claims(class));
        let extra = claims(other) - others;
        assert!(extra <= 2, "{extra} {other} claims for 10 wake-ups of the {class} class");
    };
    // The plain function (the lean send's wake-up).
    ten_sends("go", "fast", "full").await;
    // The flow-limited function (always the full fan-out's wake-up).
    ten_sends("limited", "full", "fast").await;

    // Sends of the worker's own engine (batches of two, never handed on to
    // the worker): its in-process wake-up too wakes only the fast class.
    let full = claims("full");
    for i in 0..10 {
        let batch = vec![Event::new("go", &i), Event::new("go", &(i + 100))];
        for receipt in engine.send_batch(batch).await.unwrap() {
            let run = common::finished(&engine, receipt.run_ids[0]).await;
            assert_eq!(run.state, durastep::RunState::Completed, "{run:?}");
        }
    }
    let extra = claims("full") - full;
    assert!(extra <= 2, "{extra} full claims for 10 in-process wake-ups of the fast class");

    // Sends of a function the worker does not run do not wake it.
    let quiet = (claims("fast"), claims("full"));
    for i in 0..5 {
        sender.send(Event::new("far", &i)).await.unwrap();
    }
    // A wake-up of the fast class after them, so the worker has had every
    // NOTIFY of those sends before this one's (Postgres delivers them in
    // commit order on one connection).
    let id = sender.send(Event::new("go", &())).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, id).await.state, durastep::RunState::Completed);
    let (fast, full) = (claims("fast") - quiet.0, claims("full") - quiet.1);
    assert!(fast <= 4 && full == 0, "{fast} fast and {full} full claims for 5 foreign wake-ups and 1 of its own");
    worker.stop().await;
}
