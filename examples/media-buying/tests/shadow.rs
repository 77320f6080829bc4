//! Story B's migration order: "one channel shadow-written (the new code runs
//! beside the old writer for a week and results are compared)". Shadow mode
//! writes nothing to the platform and records whether the results agree.

mod common;

use durastep::RunState;
use media_buying::Platform;
use media_buying::functions::{ShadowOutcome, request_shadow};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn shadow_mode_writes_nothing_and_records_agreement(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world_with(opts, |s| s.meta_shadow = true).await;
    let token = w.account(Platform::Meta, "act_1").await;
    let worker = common::worker(&w.engine);

    let ok = request_shadow(&w.engine, "req-1", "act_1", "c_ok", 5_000, "ops").await.unwrap();
    let doubled = request_shadow(&w.engine, "req-2", "act_1", "c_doubled", 5_000, "ops").await.unwrap();
    // The old writer (the zap) writes beside it; once it doubled a budget.
    let old = &w.services.api.meta;
    old.update_budget(&token, "c_ok", 5_000, "zap-1").await.unwrap();
    old.update_budget(&token, "c_doubled", 10_000, "zap-2").await.unwrap();

    let runs = w.drive(&[ok, doubled]).await;
    worker.stop().await;
    let outcomes: Vec<ShadowOutcome> = runs
        .iter()
        .map(|r| {
            assert_eq!(r.state, RunState::Completed, "{r:?}");
            serde_json::from_value(r.output.clone().unwrap()).unwrap()
        })
        .collect();
    assert_eq!(outcomes[0], ShadowOutcome { planned_cents: 5_000, platform_cents: Some(5_000), agree: true });
    assert_eq!(outcomes[1], ShadowOutcome { planned_cents: 5_000, platform_cents: Some(10_000), agree: false });

    let recorded: Vec<(String, bool)> =
        sqlx::query_as("SELECT campaign_id, agree FROM media.shadow_comparisons ORDER BY campaign_id")
            .fetch_all(&w.pool)
            .await
            .unwrap();
    assert_eq!(recorded, [("c_doubled".to_owned(), false), ("c_ok".to_owned(), true)]);
    // Meta received the old writer's two writes and nothing from the shadow.
    assert_eq!(w.sims.meta.writes_received(), 2);
    let keys: Vec<_> = w.sims.meta.writes().into_iter().filter_map(|x| x.idempotency_key).collect();
    assert_eq!(keys, ["zap-1", "zap-2"]);
    assert_eq!(w.budget_write_rows().await, 0, "the old writer owns the writes in shadow mode");
    assert_eq!(w.sims.meta.tokens_issued("act_1"), 0);
}
