//! The pipeline's functions under Durastep's test kit (`durastep::testing`):
//! crashed at every checkpoint, and with injected step failures.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use durastep::RunState;
use durastep::testing::{Point, TestEngine};
use placement_pipeline::clock::Clock;
use placement_pipeline::http::Client;
use placement_pipeline::settings::{self, Settings};
use placement_pipeline::side_effects::{self, Pipeline};
use placement_pipeline::simulators::{Faults, Simulators};
use placement_pipeline::{Stage, StageChange};

const T: Duration = Duration::from_secs(60);

/// A test engine with the six functions, against simulators on its clock.
async fn kit() -> (TestEngine, Simulators) {
    let slot = Arc::new(Mutex::new(None));
    let s = slot.clone();
    let t = TestEngine::builder()
        .build_with(|pool| async move {
            settings::migrate(&pool).await.expect("migrate the example's schema");
            let sims = Simulators::start(Clock::Database(pool.clone()), Faults::default(), &["#acme-placements"])
                .await
                .expect("simulators");
            let pipeline = Pipeline {
                endpoints: sims.endpoints(),
                client: Client::new().expect("client"),
                settings: Settings::new(pool),
            };
            *s.lock().unwrap() = Some(sims);
            side_effects::functions(&pipeline)
        })
        .await
        .expect("test engine");
    let sims = slot.lock().unwrap().take().expect("simulators started");
    (t, sims)
}

fn change() -> StageChange {
    StageChange {
        contact_id: 7,
        stage: Stage::Offer,
        occurred_at: "2026-11-30T08:15:00Z".parse().expect("a time"),
        candidate_name: "Candidate 7".into(),
        candidate_email: "candidate7@example.com".into(),
        recruiter_id: 101,
        client_account: "acme".into(),
        fee_cents: None,
        received_at: None,
    }
}

/// The output without the mail API's answer (its message id differs per request).
fn without_answer(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            m.iter().filter(|(k, _)| k.as_str() != "answer").map(|(k, v)| (k.clone(), without_answer(v))).collect()
        }
        other => other.clone(),
    }
}

/// Crashed after each body and each checkpoint, the candidate mail ends as a
/// crash-free run does (up to the mail API's message id, which differs per
/// request); its `send` body runs twice only after a crash between its end and
/// its checkpoint, and both requests carry the same idempotency token, so an
/// API that honours it (as the real one does) keeps one mail.
#[tokio::test]
async fn candidate_mail_survives_a_crash_at_every_checkpoint() {
    let (t, sims) = kit().await;
    let report = t.crash_at_every_checkpoint("send-candidate-mail", &change(), T).await.unwrap();
    assert_eq!(report.baseline_state, RunState::Completed, "{report}");
    // mode and send, each after its body and after its checkpoint.
    assert_eq!(report.cases.len(), 4, "{report}");
    let base = report.baseline_output.as_ref().map(without_answer);
    for c in &report.cases {
        assert!(c.crashed, "{report}");
        assert_eq!(c.state, RunState::Completed, "{report}");
        assert_eq!(c.output.as_ref().map(without_answer), base, "{report}");
    }
    let twice: Vec<(Point, &str)> =
        report.steps_run_more_than_once().into_iter().map(|(c, s, _)| (c.point, s)).collect();
    assert_eq!(twice, [(Point::AfterBody, "mode"), (Point::AfterBody, "send")], "{report}");
    // The simulator records every request: 1 crash-free + 4 cases + the repeat,
    // all under the one token of this stage change.
    assert_eq!(sims.mail.sent_with(&change().dedupe_key()), 6);
    t.shutdown().await;
}

/// Two injected failures of the recruiter task's `send`: the run retries with
/// the story's backoff (the kit moves the clock) and creates one task.
#[tokio::test]
async fn recruiter_task_retries_injected_failures() {
    let (t, _sims) = kit().await;
    t.fail_step("send", 2);
    let id = t.start("create-recruiter-task", &change()).await.unwrap();
    let run = t.finish(id, T).await.unwrap();
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 3, "{run:?}");
    assert_eq!(t.body_runs(id).get("send"), Some(&3));
    assert_eq!(t.body_runs(id).get("mode"), Some(&1), "a finished step does not run again");
    t.shutdown().await;
}
