//! Traces: the spans a worker opens, and their fields, seen by a subscriber
//! local to the test.
//!
//! One test in this binary, on purpose: tracing caches whether a callsite is
//! enabled across threads, so a test running in parallel without a subscriber
//! could disable the `run` span for this test's thread-local subscriber.
//! `#[sqlx::test]` runs the test on a current-thread runtime, so every task
//! the worker spawns runs where `tracing::subscriber::set_default` is in force.
mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use durastep::{Ctx, Event, Function, HandlerError};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tracing::span;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// What a test subscriber saw of one span.
#[derive(Debug, Clone)]
struct SeenSpan {
    name: &'static str,
    fields: BTreeMap<String, String>,
    parent: Option<span::Id>,
}

#[derive(Clone, Default)]
struct SpanLog(Arc<Mutex<HashMap<span::Id, SeenSpan>>>);

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl tracing::field::Visit for Fields<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> tracing_subscriber::Layer<S> for SpanLog {
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        let mut fields = BTreeMap::new();
        attrs.record(&mut Fields(&mut fields));
        let parent = ctx.span(id).and_then(|s| s.parent()).map(|p| p.id());
        self.0.lock().unwrap().insert(id.clone(), SeenSpan { name: attrs.metadata().name(), fields, parent });
    }
    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, _ctx: Context<'_, S>) {
        if let Some(seen) = self.0.lock().unwrap().get_mut(id) {
            values.record(&mut Fields(&mut seen.fields));
        }
    }
}

/// Catches: a step span (also one whose future the handler spawned, and a
/// `step_tx`, sleep or wait span) that is not a child of its run's span, or lacks
/// the step key or the attempt; a run span without run id or function.
#[sqlx::test(migrations = false)]
async fn step_spans_carry_run_function_attempt_and_step(_p: PgPoolOptions, opts: PgConnectOptions) {
    let log = SpanLog::default();
    let _subscriber = tracing::subscriber::set_default(tracing_subscriber::registry().with(log.clone()));
    let f = Function::new("t-spans").on_event("go").handler(|ctx: Ctx, _: ()| async move {
        // Suspends the first execution; the second replays it (a second `wait` span).
        let _: Option<bool> = ctx
            .wait_for_event("approval", durastep::WaitFor::event("t/approved").timeout(Duration::from_secs(60)))
            .await?;
        ctx.step("fetch", || async { Ok(1) }).await?;
        ctx.step("fetch", || async { Ok(2) }).await?;
        let spawned = tokio::spawn(ctx.step("spawned", || async { Ok(3) }));
        spawned.await.map_err(|e| HandlerError::new(e.to_string()))??;
        ctx.step_tx("log", async |_conn| Ok(4)).await?;
        ctx.sleep("nap", Duration::ZERO).await?;
        Ok(())
    });
    let engine = common::engine(&opts, vec![f]).await;
    let receipt = engine.send(Event::new("go", &())).await.unwrap();
    let run_id = receipt.run_ids[0];
    let worker = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, run_id, "waiting", |r| r.state == durastep::RunState::Waiting).await;
    engine.send(Event::new("t/approved", &true)).await.unwrap();
    let run = common::finished(&engine, run_id).await;
    assert_eq!(run.state, durastep::RunState::Completed, "{run:?}");
    worker.stop().await;

    let spans = log.0.lock().unwrap().clone();
    let steps: Vec<&SeenSpan> =
        spans.values().filter(|s| matches!(s.name, "step" | "step_tx" | "sleep" | "wait" | "invoke")).collect();
    let mut keys: Vec<(&str, &str)> =
        steps.iter().map(|s| (s.name, s.fields.get("step").map_or("(no step field)", String::as_str))).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            ("sleep", "nap"),
            ("step", "fetch"),
            ("step", "fetch#2"),
            ("step", "spawned"),
            ("step_tx", "log"),
            ("wait", "approval"),
            ("wait", "approval")
        ]
    );
    for s in steps {
        // The span itself, then its parent: together run_id, function, attempt and step.
        assert_eq!(s.fields.get("attempt").map(String::as_str), Some("1"), "{s:?}");
        let parent = s.parent.as_ref().and_then(|p| spans.get(p));
        let parent = parent.unwrap_or_else(|| panic!("step span without a parent: {s:?}"));
        assert_eq!(parent.name, "run", "{s:?} under {parent:?}");
        assert_eq!(parent.fields.get("run_id"), Some(&run_id.to_string()), "{parent:?}");
        assert_eq!(parent.fields.get("function").map(String::as_str), Some("t-spans"), "{parent:?}");
        assert_eq!(parent.fields.get("attempt").map(String::as_str), Some("1"), "{parent:?}");
    }
}
