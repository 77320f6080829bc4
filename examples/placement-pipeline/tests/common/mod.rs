//! Shared helpers for the end-to-end tests: the whole pipeline on the test's
//! own database, stage changes to send, and what the runs ended as.
#![allow(dead_code)]

use std::time::Duration;

use durastep::RunState;
use placement_pipeline::stack::{Stack, StackConfig};
use placement_pipeline::{Outcome, Stage, StageChange};
use sqlx::postgres::PgConnectOptions;
use uuid::Uuid;

/// How long one settle may take in real time before the test fails.
pub const SETTLE: Duration = Duration::from_secs(30);

/// The stack with `config`, on the test's database.
pub async fn stack(opts: PgConnectOptions, config: StackConfig) -> Stack {
    Stack::start(opts, StackConfig { max_connections: 6, ..config }).await.expect("start the stack")
}

/// A stage change of `contact_id` for client account `account`.
pub fn change(contact_id: u64, stage: Stage, account: &str) -> StageChange {
    StageChange {
        contact_id,
        stage,
        occurred_at: "2026-11-30T08:15:00Z".parse().expect("a time"),
        candidate_name: format!("Candidate {contact_id}"),
        candidate_email: format!("candidate{contact_id}@example.com"),
        recruiter_id: 101,
        client_account: account.to_owned(),
        fee_cents: (stage == Stage::Placement).then_some(1_200_000),
        received_at: None,
    }
}

/// The run of `function` among `run_ids`, as stored now.
pub async fn run_of(stack: &Stack, run_ids: &[Uuid], function: &str) -> durastep::Run {
    for id in run_ids {
        let run = stack.engine.run(*id).await.expect("load run");
        if run.function_id == function {
            return run;
        }
    }
    panic!("no run of {function} among {run_ids:?}");
}

/// The run's output as an [`Outcome`].
pub fn outcome(run: &durastep::Run) -> Outcome {
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    serde_json::from_value(run.output.clone().expect("an output")).expect("an Outcome")
}

/// Runs in `state`, by function id.
pub async fn count_runs(stack: &Stack, function: &str, state: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM durastep.runs WHERE function_id = $1 AND state = $2")
        .bind(function)
        .bind(state)
        .fetch_one(&stack.pool)
        .await
        .expect("count runs")
}
