//! A heartbeat racing the end of attempts, held exactly in the race window.
//!
//! The heartbeat reads the runs its worker holds, then extends their leases in
//! one statement. An attempt whose completion commits in between is no longer
//! `running` when that statement runs: the heartbeat must not take it for a
//! lost lease (until 2026-12-02 it did: it counted `durastep_leases_lost_total`,
//! warned "lease lost (fenced)" and cancelled the attempt, a few times per
//! thousand runs under load).
//!
//! In process, with real Postgres and no sleeping for the race:
//! 1. Ten runs are claimed; their handlers wait on a gate.
//! 2. The heartbeat is held between its read of the held runs and its
//!    statement (the `heartbeat` failpoint with `block`).
//! 3. The gate opens; the completions are written, and the writer is held just
//!    after its commit (`checkpoint-after-commit` with `block`), so the
//!    executors still wait for it and the runs are still held.
//! 4. The heartbeat is let go: its statement no longer finds the completed
//!    runs running. No lost lease may be counted.
//!
//! The test was checked to fail (one lost lease per completed run) with the
//! worker's check of an attempt's end write removed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use durastep::{Ctx, Engine, Event, Function, WorkerOptions, failpoints};
use durastep_testkit::{checks, url_of, wait_for};
use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::watch;
use uuid::Uuid;

const EVENT: &str = "test/heartbeat-race";
const RUNS: usize = 10;
const WAIT: Duration = Duration::from_secs(20);

/// Counts `durastep_leases_lost_total` (any labels); every other metric is dropped.
struct LostLeases(Arc<AtomicU64>);

impl Recorder for LostLeases {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        if key.name() == durastep::metrics::LEASES_LOST { Counter::from_arc(self.0.clone()) } else { Counter::noop() }
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::noop()
    }
}

#[sqlx::test(migrations = false)]
async fn a_heartbeat_that_races_completions_counts_no_lost_lease(_p: PgPoolOptions, opts: PgConnectOptions) {
    // `#[sqlx::test]` runs on a current-thread runtime: every task of the
    // worker runs on this thread, where the local recorder is in force.
    let lost = Arc::new(AtomicU64::new(0));
    let recorder = LostLeases(lost.clone());
    let _local = metrics::set_default_local_recorder(&recorder);

    let (gate, _) = watch::channel(false);
    let waiting = Arc::new(AtomicU64::new(0));
    let f = {
        let (gate, waiting) = (gate.clone(), waiting.clone());
        Function::new("heartbeat-race").on_event(EVENT).handler(move |_ctx: Ctx, n: u64| {
            let (mut open, waiting) = (gate.subscribe(), waiting.clone());
            async move {
                waiting.fetch_add(1, Ordering::SeqCst);
                let _ = open.wait_for(|o| *o).await;
                Ok(n)
            }
        })
    };
    // A lease far longer than the test: no lease can really be lost. One
    // writer task, so that the first flush held after its commit holds the rest.
    let options = WorkerOptions {
        max_in_flight: RUNS,
        poll_interval: Duration::from_millis(20),
        lease: Duration::from_secs(3_600),
        heartbeat_interval: Duration::from_millis(20),
        reap_interval: Duration::from_secs(3_600),
        writers: 1,
        shutdown_grace: Duration::from_secs(5),
        ..WorkerOptions::default()
    };
    let engine =
        Engine::builder().database_url(url_of(&opts)).worker_options(options).function(f).build().await.unwrap();
    let pool = engine.pool().clone();
    let events: Vec<Event> = (0..RUNS as u64).map(|n| Event::new(EVENT, &n)).collect();
    let ids: Vec<Uuid> = engine.send_batch(events).await.unwrap().into_iter().map(|r| r.run_ids[0]).collect();
    let worker = engine.spawn_worker();

    // 1. Every handler waits at the gate (so every run is held by the worker).
    wait_for("every handler at the gate", WAIT, || async {
        Ok((waiting.load(Ordering::SeqCst) == RUNS as u64).then_some(()))
    })
    .await
    .unwrap();
    // 2. A heartbeat round has read the held runs and waits before its statement.
    failpoints::set("heartbeat", "block");
    wait_for("the heartbeat to hold before its statement", WAIT, || async {
        Ok((failpoints::blocked("heartbeat") == 1).then_some(()))
    })
    .await
    .unwrap();
    // 3. Completions commit; the writer holds right after its commit.
    failpoints::set("checkpoint-after-commit", "block");
    gate.send_replace(true);
    wait_for("a completion flush to commit and hold", WAIT, || async {
        let completed = checks::count_in_state(&pool, &ids, "completed").await?;
        Ok((completed > 0 && failpoints::blocked("checkpoint-after-commit") == 1).then_some(completed))
    })
    .await
    .unwrap();
    let completed = checks::count_in_state(&pool, &ids, "completed").await.unwrap();
    // 4. The heartbeat's statement runs and its answer is read; the next
    //    round reaching the failpoint proves this one is over (a round that
    //    took every run for lost has nothing left to extend, and skips it).
    failpoints::set("heartbeat", "pause(0)");
    wait_for("the heartbeat's next round", WAIT, || async {
        Ok((failpoints::hits("heartbeat") > 0 || lost.load(Ordering::SeqCst) > 0).then_some(()))
    })
    .await
    .unwrap();
    let lost_leases = lost.load(Ordering::SeqCst);

    failpoints::release("checkpoint-after-commit");
    failpoints::release("heartbeat");
    wait_for("every run to complete", WAIT, || async {
        Ok((checks::count_in_state(&pool, &ids, "completed").await? == RUNS as i64).then_some(()))
    })
    .await
    .unwrap();
    worker.stop().await.unwrap();
    assert!(completed > 0, "no completion committed while the heartbeat was held: the race was not run");
    assert_eq!(lost_leases, 0, "{completed} runs completed under a held heartbeat; lost leases counted: {lost_leases}");
    assert_eq!(lost.load(Ordering::SeqCst), 0, "lost leases counted after the race");
}
