//! Story A: "`UNIQUE(kind, dedupe_key)` makes a re-fired webhook a silent
//! no-op", and "the dedupe key is also sent to HubSpot as an idempotency
//! token, so every retry lands on the same write".

mod common;

use common::{SETTLE, change, count_runs, outcome, run_of, stack};
use durastep::RunState;
use placement_pipeline::simulators::Faults;
use placement_pipeline::stack::StackConfig;
use placement_pipeline::{Outcome, SideEffect, Stage};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn a_re_fired_webhook_creates_no_duplicate_side_effect(_pool: PgPoolOptions, opts: PgConnectOptions) {
    let stack = stack(opts, StackConfig::default()).await;
    let placed = change(4711, Stage::Placement, "acme");
    let key = placed.dedupe_key();

    let first = stack.webhook(&placed).await.expect("first delivery");
    let again = stack.webhook(&placed).await.expect("re-fired delivery");
    assert_eq!(first.dedupe_key, "4711:placement:2026-W49");
    assert!(!first.duplicate && again.duplicate, "{first:?} {again:?}");
    assert_eq!(again.run_ids, first.run_ids, "the re-fire names the same runs and creates none");
    assert_eq!(first.run_ids.len(), 6, "one run per side effect, the draft invoice included");
    stack.settle(SETTLE).await.expect("runs finish");

    let s = &stack.sims;
    assert_eq!(s.mail.sent_with(&key), 1, "one mail");
    assert_eq!((s.crm.tasks(), s.crm.duplicates()), (1, 0), "one task, and the CRM never saw the key twice");
    assert_eq!(s.chat.posted_with(&key), 1);
    assert_eq!(s.sheet.rows_with(&key), 1);
    assert_eq!(s.outreach.traffic().counts().requests, 1);
    assert_eq!(s.invoicing.invoices_with(&key), 1);
    for side_effect in SideEffect::ALL {
        assert_eq!(count_runs(&stack, side_effect.function_id(), "completed").await, 1, "{side_effect}");
    }
    let mail = outcome(&run_of(&stack, &first.run_ids, "send-candidate-mail").await);
    assert!(matches!(mail, Outcome::Sent { ref idempotency_key, .. } if *idempotency_key == key), "{mail:?}");
    stack.stop().await.expect("stop");
}

#[sqlx::test(migrations = false)]
async fn a_retried_task_lands_on_the_task_the_crm_already_created(_pool: PgPoolOptions, opts: PgConnectOptions) {
    // Every new task is stored and then its response is lost (504).
    let faults = Faults { crm_lost_response_every: Some(1), ..Faults::default() };
    let stack = stack(opts, StackConfig { faults, ..StackConfig::default() }).await;
    let offer = change(31, Stage::Offer, "globex");
    let receipt = stack.webhook(&offer).await.expect("delivery");
    stack.settle(SETTLE).await.expect("runs finish");

    let task = run_of(&stack, &receipt.run_ids, "create-recruiter-task").await;
    assert_eq!((task.state, task.attempt), (RunState::Completed, 2), "{task:?}");
    assert!(task.last_error.as_deref().is_some_and(|e| e.contains("504")), "{task:?}");
    let crm = &stack.sims.crm;
    assert_eq!(crm.traffic().counts().requests, 2, "the first attempt and its retry");
    assert_eq!(crm.tasks(), 1, "one recruiter task");
    assert_eq!(crm.duplicates(), 1, "the retry carried the same token and created nothing");
    // The retry waited the story's first backoff, 30 s (the clock was moved
    // by what remained of it after real time passed; the default backoff's
    // first delay is about 1 s).
    assert!(stack.clock_moved().0 >= std::time::Duration::from_secs(25), "{:?}", stack.clock_moved());
    stack.stop().await.expect("stop");
}

#[sqlx::test(migrations = false)]
async fn a_malformed_stage_change_is_refused_and_creates_nothing(_pool: PgPoolOptions, opts: PgConnectOptions) {
    let stack = stack(opts, StackConfig::default()).await;
    let mut no_fee = change(5, Stage::Placement, "acme");
    no_fee.fee_cents = None;
    let refused = stack.webhook(&no_fee).await.expect_err("a placement without a fee");
    assert!(matches!(refused, placement_pipeline::stack::StackError::Refused { status: 422, .. }), "{refused}");
    let mut unknown = serde_json::to_value(change(5, Stage::Offer, "acme")).expect("json");
    unknown["stage"] = "placed".into();
    let response = reqwest::Client::new()
        .post(format!("{}/webhooks/stage-changed", stack.receiver_url))
        .json(&unknown)
        .send()
        .await
        .expect("send");
    assert!(response.status().is_client_error(), "{}", response.status());
    let events: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durastep.events").fetch_one(&stack.pool).await.expect("count");
    assert_eq!(events, 0);
    stack.stop().await.expect("stop");
}
