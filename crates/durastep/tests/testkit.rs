//! The user-facing test kit (`durastep::testing`, feature `testing`):
//! `TestEngine` on a fresh database, clock driving, crash at every
//! checkpoint, step failure injection, sent events and child runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::testing::{Point, TestEngine};
use durastep::{Ctx, Event, Function, RunState};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

/// `charge` calls an "external API" (a counter) without an idempotency key;
/// `log` is transactional; a sleep sits between them.
fn payment(charges: Arc<AtomicU32>) -> Function {
    Function::new("payment").handler(move |ctx: Ctx, amount: u32| {
        let charges = charges.clone();
        async move {
            let id: u32 = ctx
                .step("charge", || async move {
                    charges.fetch_add(1, Ordering::SeqCst);
                    Ok(amount * 10)
                })
                .await?;
            ctx.sleep("settle", Duration::from_secs(3_600)).await?;
            let logged: i32 = ctx
                .step_tx("log", async move |conn| Ok(sqlx::query_scalar("SELECT 7").fetch_one(&mut *conn).await?))
                .await?;
            Ok(json!({"id": id, "logged": logged}))
        }
    })
}

/// Every crash point is reached and resumed, every case ends with the
/// crash-free output, and the one case where `charge`'s body ran twice (a
/// crash after its body, before its checkpoint) is reported as such.
/// Catches: a crash that is not resumed, a resumed run that redoes a
/// checkpointed step, or a report that hides a double execution.
#[tokio::test]
async fn crash_at_every_checkpoint_reports_double_bodies() {
    let charges = Arc::new(AtomicU32::new(0));
    let t = TestEngine::builder().function(payment(charges.clone())).build().await.unwrap();
    let report = t.crash_at_every_checkpoint("payment", &5u32, T).await.unwrap();
    assert_eq!(report.baseline_state, RunState::Completed, "{report}");
    assert_eq!(report.baseline_output, Some(json!({"id": 50, "logged": 7})));
    // charge (body, checkpoint), settle (body, checkpoint), log (checkpoint).
    let points: Vec<(Point, &str)> = report.cases.iter().map(|c| (c.point, c.step.as_str())).collect();
    assert_eq!(
        points,
        [
            (Point::AfterBody, "charge"),
            (Point::AfterCheckpoint, "charge"),
            (Point::AfterBody, "settle"),
            (Point::AfterCheckpoint, "settle"),
            (Point::AfterCheckpoint, "log"),
        ],
        "{report}"
    );
    assert!(report.cases.iter().all(|c| c.crashed), "{report}");
    assert!(report.outputs_match(), "{report}");
    let twice: Vec<(Point, &str, &str, u32)> =
        report.steps_run_more_than_once().into_iter().map(|(c, s, n)| (c.point, c.step.as_str(), s, n)).collect();
    assert_eq!(twice, [(Point::AfterBody, "charge", "charge", 2)], "{report}");
    assert!(report.to_string().contains("idempotency key"), "{report}");
    // 1 baseline + 5 cases + 1 repeat.
    assert_eq!(charges.load(Ordering::SeqCst), 7);
    t.shutdown().await;
}

/// Injected failures fail the named step's bodies the given number of times;
/// the run retries (the kit drives the backoff clock) and completes.
#[tokio::test]
async fn fail_step_injects_retryable_failures() {
    let charges = Arc::new(AtomicU32::new(0));
    let t = TestEngine::builder().function(payment(charges.clone())).build().await.unwrap();
    t.fail_step("charge", 2);
    let id = t.start("payment", &1u32).await.unwrap();
    let run = t.finish(id, T).await.unwrap();
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 3, "{run:?}");
    assert_eq!(t.body_runs(id).get("charge"), Some(&3));
    assert_eq!(charges.load(Ordering::SeqCst), 1, "the injected failures did not run the body");
    t.shutdown().await;
}

/// Sent events and child runs are listed for assertions; the clock can be set.
#[tokio::test]
async fn sent_events_and_child_runs() {
    let parent = Function::new("parent").handler(|ctx: Ctx, _: Value| async move {
        ctx.send_event("notify", Event::new("thing/done", &json!({"n": 1}))).await?;
        let child: Result<u32, durastep::ChildError> = ctx
            .invoke("child", durastep::Invoke::function("child").input(&json!(20)).timeout(Duration::from_secs(600)))
            .await?;
        child.map_err(|e| durastep::HandlerError::permanent(e.to_string()))
    });
    let child = Function::new("child")
        .handler(|ctx: Ctx, n: u32| async move { ctx.step("double", || async move { Ok(n * 2) }).await });
    let t = TestEngine::builder().function(parent).function(child).build().await.unwrap();
    let at = chrono::DateTime::parse_from_rfc3339("2030-01-01T00:00:00Z").unwrap().to_utc();
    t.set_clock(at).await.unwrap();
    assert!((t.now().await.unwrap() - at).num_seconds().abs() < 60);
    let id = t.start("parent", &json!({})).await.unwrap();
    let run = t.finish(id, T).await.unwrap();
    assert_eq!(run.output, Some(json!(40)), "{run:?}");
    let sent = t.sent_events(id).await.unwrap();
    assert_eq!(sent.len(), 1);
    assert_eq!(
        (sent[0].step.as_str(), sent[0].name.as_str(), &sent[0].data),
        ("notify", "thing/done", &json!({"n": 1}))
    );
    let children = t.child_runs(id).await.unwrap();
    assert_eq!(children.len(), 1);
    assert_eq!((children[0].function_id.as_str(), children[0].state), ("child", RunState::Completed));
    assert!(t.run_until_idle(T).await.unwrap());
    t.shutdown().await;
}

/// `wait_for_runs` returns every run as it is when all have finished, or at
/// the timeout: runs asleep stay unfinished until the clock moves past their
/// sleep, then all complete. Catches: a wait that returns before every run has
/// finished, or that hides an unfinished run at its timeout.
#[tokio::test]
async fn wait_for_runs_waits_for_every_run() {
    let charges = Arc::new(AtomicU32::new(0));
    let t = TestEngine::builder().function(payment(charges.clone())).build().await.unwrap();
    let ids = [t.start("payment", &1u32).await.unwrap(), t.start("payment", &2u32).await.unwrap()];
    // Both sleep an hour at `settle`: at the timeout they are returned unfinished.
    let runs = t.wait_for_runs(&ids, Duration::from_millis(500)).await.unwrap();
    assert_eq!(runs.iter().map(|r| r.id).collect::<Vec<_>>(), ids);
    assert!(runs.iter().all(|r| !r.state.is_finished()), "{runs:?}");
    t.advance_clock(Duration::from_secs(3_601)).await.unwrap();
    let runs = t.wait_for_runs(&ids, T).await.unwrap();
    let outputs: Vec<_> = runs.iter().map(|r| (r.state, r.output.clone())).collect();
    assert_eq!(
        outputs,
        [
            (RunState::Completed, Some(json!({"id": 10, "logged": 7}))),
            (RunState::Completed, Some(json!({"id": 20, "logged": 7}))),
        ]
    );
    t.shutdown().await;
}
