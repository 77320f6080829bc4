//! Story A: Exact Online "throttles one integration to about 20/minute under
//! sustained load; the dead state filled up one afternoon. Fix: a
//! per-handler concurrency cap of 1".

mod common;

use std::collections::HashSet;

use common::{SETTLE, count_runs, stack};
use placement_pipeline::burst::monday_burst;
use placement_pipeline::figures::runs_by_function;
use placement_pipeline::simulators::Faults;
use placement_pipeline::stack::StackConfig;
use placement_pipeline::{SideEffect, Stage};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn under_the_monday_burst_invoicing_sees_one_request_at_a_time_and_no_run_ends_dead(
    _pool: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let faults = Faults { mail_unavailable_every: Some(40), crm_lost_response_every: Some(45) };
    let stack = stack(opts, StackConfig { faults, workers: 3, ..StackConfig::default() }).await;
    let burst = monday_burst(200, 12);
    let deliveries: Vec<_> = burst.deliveries.iter().map(|&i| burst.changes[i].clone()).collect();
    let answers = stack.webhooks().send_all(&deliveries, 8).await.expect("deliveries");
    assert_eq!(answers.iter().filter(|a| a.duplicate).count(), 12);
    stack.settle(SETTLE).await.expect("every run finishes");

    let runs = runs_by_function(&stack.pool).await.expect("runs");
    let placements = burst.placements();
    for side_effect in SideEffect::ALL {
        let expected = if side_effect == SideEffect::DraftInvoice { placements } else { 200 };
        let r = runs.get(side_effect.function_id()).cloned().unwrap_or_default();
        assert_eq!((r.runs, r.completed, r.failed), (expected as i64, expected as i64, 0), "{side_effect}: {r:?}");
    }
    let inv = &stack.sims.invoicing;
    assert_eq!(inv.max_in_flight(), 1, "the invoicing system saw two requests at once");
    assert!(inv.throttled() > 0, "the burst never reached the throttle, so this test proves nothing about 429s");
    assert_eq!(inv.invoices(), placements);
    for placed in burst.changes.iter().filter(|c| c.stage == Stage::Placement) {
        assert_eq!(inv.invoices_with(&placed.dedupe_key()), 1, "{}", placed.dedupe_key());
    }
    // The 429s cost no attempts: every invoice run finished on its first.
    assert_eq!(runs["create-draft-invoice"].retries, 0, "{:?}", runs["create-draft-invoice"]);
    // The injected mail and CRM failures were retried and went through, once each.
    let mails: HashSet<String> = stack.sims.mail.traffic().accepted_at().into_iter().map(|(t, _)| t).collect();
    assert_eq!((mails.len(), stack.sims.mail.traffic().counts().accepted), (200, 200));
    assert!(stack.sims.crm.duplicates() > 0 && stack.sims.crm.tasks() == 200);
    assert_eq!(count_runs(&stack, "send-candidate-mail", "failed").await, 0);
    stack.stop().await.expect("stop");
}
