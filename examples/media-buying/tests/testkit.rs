//! The Meta budget function under Durastep's test kit (`durastep::testing`):
//! injected failures of its `push` step, driven to the end on the kit's clock,
//! and a crash at every checkpoint.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use durastep::RunState;
use durastep::testing::{Point, TestEngine};
use media_buying::functions::{self, Pushed, Services};
use media_buying::sim::{SimClock, Simulators};
use media_buying::{BudgetRequest, Platform, Settings, store};

/// A test engine with every function of the example, against simulators on
/// its clock, and a Meta account `act_1` with a token valid for 30 days.
async fn kit() -> (TestEngine, Simulators) {
    let slot = Arc::new(Mutex::new(None));
    let s = slot.clone();
    let t = TestEngine::builder()
        .build_with(|pool| async move {
            store::migrate(&pool).await.expect("migrate the example's schema");
            let sims = Simulators::start(SimClock::Database(pool.clone())).await.expect("simulators");
            let services = Services::new(pool, Settings::new(sims.endpoints.clone()));
            *s.lock().unwrap() = Some(sims);
            functions::all(&services)
        })
        .await
        .expect("test engine");
    let sims = slot.lock().unwrap().take().expect("simulators started");
    let pool = t.engine().pool().clone();
    let expires = t.now().await.unwrap() + chrono::Duration::days(30);
    store::add_account(&pool, Platform::Meta, "act_1", "client of act_1").await.unwrap();
    store::add_token(&pool, Platform::Meta, "act_1", "tok-meta-act_1-v1", "refresh-meta-act_1", expires).await.unwrap();
    sims.meta.add_token("act_1", "tok-meta-act_1-v1", "refresh-meta-act_1", expires);
    (t, sims)
}

/// Two injected failures of `push`: the run retries with its backoff (the kit
/// moves the clock), Meta applies the write once, the store logs it once, and
/// `get-token`, finished in the first attempt, does not run again.
#[tokio::test]
async fn meta_push_retries_injected_failures_and_writes_once() {
    let (t, sims) = kit().await;
    let pool = t.engine().pool().clone();
    t.fail_step("push", 2);
    let requested = store::request_budget(t.engine(), &pool, Platform::Meta, "act_1", "camp_9", 12_500, "ops@agency")
        .await
        .unwrap();
    let run = t.finish(requested.run_id, Duration::from_secs(60)).await.unwrap();
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 3, "{run:?}");
    let bodies = t.body_runs(requested.run_id);
    assert_eq!(bodies.get("push"), Some(&3), "{bodies:?}");
    assert_eq!(bodies.get("get-token"), Some(&1), "{bodies:?}");
    assert_eq!(sims.meta.writes().len(), 1, "Meta applied one write");
    let status: String = sqlx::query_scalar("SELECT status FROM media.budget_writes WHERE id = $1")
        .bind(requested.write_id)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(status, "pushed");
    t.shutdown().await;
}

/// Crashed after each body and each checkpoint of `meta-budget-update`
/// (`get-token`, `push`, and `log`, a `step_tx` whose body commits with its
/// checkpoint), every resumed run completes as the crash-free one did, and
/// no external effect happens twice: the bodies of `get-token` and `push`
/// run again after a crash between their end and their checkpoint, but
/// `get-token` only reads the store (the token is valid for 30 days: no
/// refresh), and the repeated `push` carries the run's idempotency key, so
/// Meta applies one write per run; the store's row is marked pushed once.
///
/// The output (`Pushed`) holds Meta's reference and the push time, which
/// differ per run (each run is its own write): the outputs are compared
/// without them, and each run's reference must be the one write Meta applied
/// under that run's key.
#[tokio::test]
async fn meta_budget_update_survives_a_crash_at_every_checkpoint() {
    let (t, sims) = kit().await;
    let pool = t.engine().pool().clone();
    // The request the function gets: a `queued` row of its own (the kit
    // starts every case with this input, without the event).
    let write_id: i64 = sqlx::query_scalar(
        "INSERT INTO media.budget_writes (campaign_id, platform, account_id, amount_cents, requested_by)
         VALUES ('camp_9', 'meta', 'act_1', 12500, 'ops@agency') RETURNING id",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    let request = BudgetRequest {
        write_id: Some(write_id),
        platform: Platform::Meta,
        account_id: "act_1".into(),
        campaign_id: "camp_9".into(),
        amount_cents: 12_500,
        requested_by: "ops@agency".into(),
    };
    let report = t.crash_at_every_checkpoint("meta-budget-update", &request, Duration::from_secs(60)).await.unwrap();
    assert_eq!(report.baseline_state, RunState::Completed, "{report}");
    let points: Vec<(Point, &str)> = report.cases.iter().map(|c| (c.point, c.step.as_str())).collect();
    assert_eq!(
        points,
        [
            (Point::AfterBody, "get-token"),
            (Point::AfterCheckpoint, "get-token"),
            (Point::AfterBody, "push"),
            (Point::AfterCheckpoint, "push"),
            (Point::AfterCheckpoint, "log"),
        ],
        "{report}"
    );

    // Every run's output, without what differs per run; and its reference is
    // the one write Meta applied under that run's idempotency key.
    let writes = sims.meta.writes();
    let pushed = |output: &Option<serde_json::Value>| -> Pushed {
        serde_json::from_value(output.clone().expect("an output")).expect("a Pushed")
    };
    let base = pushed(&report.baseline_output);
    let mut runs = vec![(None, base.clone())];
    for c in &report.cases {
        assert!(c.crashed, "{report}");
        assert_eq!(c.state, RunState::Completed, "{report}");
        runs.push((Some(c.run_id), pushed(&c.output)));
    }
    for (case, p) in &runs {
        let applied: Vec<_> = writes.iter().filter(|w| w.write_ref == p.external_ref).collect();
        assert_eq!(applied.len(), 1, "{p:?} is one write at Meta: {writes:?}");
        let (key, w) = (applied[0].idempotency_key.as_deref().unwrap_or_default(), applied[0]);
        assert!(key.ends_with(":push"), "{key}");
        if let Some(run_id) = case {
            assert_eq!(key, format!("{run_id}:push"), "the resumed run's own write");
        }
        assert_eq!((w.campaign_id.as_str(), w.daily_budget_cents), ("camp_9", 12_500));
    }

    // The simulator's counts: one write applied per run (the crash-free one
    // and each case); the one repeat (a crash after push's body) was
    // deduplicated by its key; no token was refreshed.
    let runs_total = 1 + report.cases.len();
    assert_eq!(writes.len(), runs_total, "{writes:?}");
    assert_eq!(sims.meta.writes_received(), runs_total as u64 + 1);
    assert_eq!(sims.meta.duplicates(), 1);
    assert_eq!(sims.meta.tokens_issued("act_1"), 0, "get-token ran again but refreshed nothing");
    let twice: Vec<(Point, &str)> =
        report.steps_run_more_than_once().into_iter().map(|(c, s, _)| (c.point, s)).collect();
    assert_eq!(twice, [(Point::AfterBody, "get-token"), (Point::AfterBody, "push")], "{report}");

    // The store: one row, marked pushed once, by the crash-free run (every
    // case carries the same write id; `log` updates a `queued` row only).
    let row: (String, Option<String>) =
        sqlx::query_as("SELECT status, external_ref FROM media.budget_writes WHERE id = $1")
            .bind(write_id)
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(row, ("pushed".to_owned(), Some(base.external_ref.clone())));
    t.shutdown().await;
}
