//! The group commit: one write the server refuses, in a batch with other
//! runs' writes, fails only its own step; the other runs' steps are stored
//! and their runs complete (`checkpoint::flush_chunk` retries a refused chunk
//! write by write).
mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use durastep::{Ctx, Event, Function, RunState, WorkerOptions};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tracing_subscriber::layer::{Context, SubscriberExt};

/// The library's warnings, as `message writes=N` lines.
#[derive(Clone, Default)]
struct Warnings(Arc<Mutex<Vec<String>>>);

#[derive(Default)]
struct Fields(String);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={value:?} ", field.name()));
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() <= tracing::Level::WARN {
            let mut fields = Fields::default();
            event.record(&mut fields);
            self.0.lock().unwrap().push(fields.0);
        }
    }
}

/// Good runs in the batch besides the one the server refuses.
const GOOD: usize = 4;

#[sqlx::test(migrations = false)]
async fn a_refused_write_in_a_batch_fails_only_its_own_step(_p: PgPoolOptions, opts: PgConnectOptions) {
    let warnings = Warnings::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(warnings.clone()))
        .expect("the only subscriber of this test binary");
    let arrived = Arc::new(AtomicUsize::new(0));
    let returned = Arc::new(AtomicUsize::new(0));
    let gate = common::Gate::new();
    let (a, r, g) = (arrived.clone(), returned.clone(), gate.clone());
    // Each run's one step waits at the gate, then returns the event's value:
    // all of them finish together and their checkpoints queue behind one another.
    let batch = Function::new("batch").on_event("batch/go").retries(0).handler(move |ctx: Ctx, data: Value| {
        let (a, r, g) = (a.clone(), r.clone(), g.clone());
        async move {
            let stored: Value = ctx
                .step("store", || async move {
                    a.fetch_add(1, Ordering::SeqCst);
                    g.wait().await;
                    r.fetch_add(1, Ordering::SeqCst);
                    Ok(data["value"].clone())
                })
                .await?;
            Ok(stored)
        }
    });
    // One run whose write the writer is busy with while the others queue.
    let first_gate = common::Gate::new();
    let fg = first_gate.clone();
    let first = Function::new("first").on_event("batch/first").retries(0).handler(move |ctx: Ctx, _: Value| {
        let fg = fg.clone();
        async move {
            ctx.step("store", || async move {
                fg.wait().await;
                Ok(0)
            })
            .await?;
            Ok(())
        }
    });
    // One writer task, so the queued writes are collected into one batch.
    let options = WorkerOptions { writers: 1, ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![batch, first], options).await;
    // What the server refuses: a step result the database's own constraint
    // rejects (a value Postgres cannot store, as a stand-in that any size fits).
    sqlx::query(
        "ALTER TABLE durastep.step_results ADD CONSTRAINT refuses_poison CHECK (output::text NOT LIKE '%poison%')",
    )
    .execute(engine.pool())
    .await
    .expect("add the constraint");

    let mut good = Vec::new();
    for i in 0..GOOD {
        let e = Event::new("batch/go", &json!({ "value": format!("fine-{i}") }));
        good.push(engine.send(e).await.expect("send").run_ids[0]);
    }
    let bad = engine.send(Event::new("batch/go", &json!({ "value": "poison" }))).await.expect("send").run_ids[0];
    let first_id = engine.send(Event::new("batch/first", &json!({}))).await.expect("send").run_ids[0];
    let worker = common::spawn_worker(&engine);
    common::wait_until("every batch run inside its step", || async { arrived.load(Ordering::SeqCst) == GOOD + 1 })
        .await;

    // Hold the writer on the first run's write: the table is locked against writes.
    let mut lock = engine.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE durastep.step_results IN SHARE MODE").execute(&mut *lock).await.expect("lock");
    first_gate.open();
    let pool = engine.pool().clone();
    common::wait_until("the writer waiting for the table lock", || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_locks WHERE relation = 'durastep.step_results'::regclass AND NOT granted",
            )
            .fetch_one(&pool)
            .await
            .expect("pg_locks")
                > 0
        }
    })
    .await;
    gate.open();
    common::wait_until("every batch step returned", || async { returned.load(Ordering::SeqCst) == GOOD + 1 }).await;
    // The writes are queued behind the held flush (a handful of microseconds
    // after the step returns, against the flush's commit round trip).
    lock.commit().await.expect("release the lock");

    for id in &good {
        let run = common::finished(&engine, *id).await;
        assert_eq!(run.state, RunState::Completed, "a good run in the refused batch: {run:?}");
        assert_eq!(run.attempt, 1, "completed on its first attempt, not by a retry: {run:?}");
        assert!(common::step_row(&engine, *id, "store").await.is_some(), "its step is stored");
    }
    let run = common::finished(&engine, bad).await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    let error = run.last_error.clone().unwrap_or_default();
    assert!(error.contains("refuses_poison"), "the step fails with the server's refusal: {error}");
    assert!(common::step_row(&engine, bad, "store").await.is_none(), "nothing stored for the refused step");
    assert_eq!(common::finished(&engine, first_id).await.state, RunState::Completed);
    worker.stop().await;

    // The refused write shared a chunk with the others' writes.
    let logged = warnings.0.lock().unwrap().clone();
    let refused: Vec<&String> = logged.iter().filter(|w| w.contains("storing its writes one by one")).collect();
    assert!(
        refused.iter().any(|w| writes_of(w) > GOOD),
        "one chunk of (at least) all {} batch writes was refused and retried write by write: {logged:?}",
        GOOD + 1
    );
}

/// The `writes=N` field of a logged warning (0 without one).
fn writes_of(warning: &str) -> usize {
    warning.split_whitespace().find_map(|f| f.strip_prefix("writes=")).and_then(|n| n.parse().ok()).unwrap_or(0)
}
