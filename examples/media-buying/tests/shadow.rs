//! Story B's migration order: "one channel shadow-written (the new code runs
//! beside the old writer for a week and results are compared)". Shadow mode
//! writes nothing to the platform and records whether the results agree.

mod common;

use chrono::{TimeZone, Utc};
use durastep::RunState;
use media_buying::Platform;
use media_buying::functions::{ShadowOutcome, ShadowRequest, request_shadow};
use media_buying::store;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn shadow_mode_writes_nothing_and_records_agreement(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world_with(opts, |s| s.meta_shadow = true).await;
    let token = w.account(Platform::Meta, "act_1").await;
    let worker = common::worker(&w.engine);

    let meta = |request_id, campaign_id| ShadowRequest {
        platform: Platform::Meta,
        request_id,
        account_id: "act_1",
        campaign_id,
        amount_cents: 5_000,
        requested_by: "ops",
    };
    let ok = request_shadow(&w.engine, meta("req-1", "c_ok")).await.unwrap();
    let doubled = request_shadow(&w.engine, meta("req-2", "c_doubled")).await.unwrap();
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

/// The story's shadow week, on TikTok: the shadow function plans each write
/// at 00:30 UTC after TikTok's reset, sleeps until then, reads the campaign
/// back and records amount and timing; TikTok receives only the old writer's
/// writes, and the comparison report shows the doubled budget and the bump
/// the old writer pushed late in TikTok's day.
#[sqlx::test(migrations = false)]
async fn tiktok_shadow_week_compares_amount_and_timing_and_writes_nothing(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world_with(opts, |s| s.tiktok_shadow = true).await;
    let token = w.account(Platform::TikTok, "adv_1").await;
    let worker = common::worker(&w.engine);
    let year = common::next_year();
    let tiktok = |request_id, campaign_id, amount_cents| ShadowRequest {
        platform: Platform::TikTok,
        request_id,
        account_id: "adv_1",
        campaign_id,
        amount_cents,
        requested_by: "ops",
    };
    let old = &w.services.api.tiktok;

    // Tuesday 10:00 Amsterdam (winter): the old writer pushes the asked amount at once.
    w.clock_to(common::amsterdam(year, 1, 12, 10, 0)).await;
    let morning = request_shadow(&w.engine, tiktok("r-1", "c_morning", 4_000)).await.unwrap();
    old.update_budget(&token, "adv_1", "c_morning", 4_000, "zap-1").await.unwrap();
    // Its plan (checkpointed) is made at the request's time, before the clock moves on.
    w.reaches(morning, RunState::Sleeping).await;
    // 23:55 Amsterdam = 22:55 UTC: the old writer pushes twice after a timeout (doubled),
    // with 65 minutes of TikTok's day left.
    w.clock_to(common::amsterdam(year, 1, 12, 23, 55)).await;
    let late = request_shadow(&w.engine, tiktok("r-2", "c_late", 3_000)).await.unwrap();
    old.update_budget(&token, "adv_1", "c_late", 6_000, "zap-2").await.unwrap();
    // A re-sent request is the same comparison.
    assert_eq!(request_shadow(&w.engine, tiktok("r-2", "c_late", 3_000)).await.unwrap(), late);

    let runs = w.drive(&[morning, late]).await;
    worker.stop().await;
    let outcomes: Vec<ShadowOutcome> = runs
        .iter()
        .map(|r| {
            assert_eq!(r.state, RunState::Completed, "{r:?}");
            serde_json::from_value(r.output.clone().unwrap()).unwrap()
        })
        .collect();
    assert_eq!(outcomes[0], ShadowOutcome { planned_cents: 4_000, platform_cents: Some(4_000), agree: true });
    assert_eq!(outcomes[1], ShadowOutcome { planned_cents: 3_000, platform_cents: Some(6_000), agree: false });
    assert_eq!(w.sims.tiktok.writes_received(), 2, "only the old writer wrote to TikTok");
    assert_eq!(w.budget_write_rows().await, 0, "the old writer owns the writes in shadow mode");

    let planned: Vec<chrono::DateTime<Utc>> =
        sqlx::query_scalar("SELECT planned_at FROM media.shadow_comparisons ORDER BY requested_at")
            .fetch_all(&w.pool)
            .await
            .unwrap();
    let after_reset = Utc.with_ymd_and_hms(year, 1, 13, 0, 30, 0).unwrap();
    assert_eq!(planned, [after_reset, after_reset], "both would have been pushed 30 min after the next reset");

    let report = store::shadow_report(&w.pool, Platform::TikTok).await.unwrap();
    assert_eq!(report.days.len(), 1);
    let day = &report.days[0];
    assert_eq!((day.requests, day.same_amount, day.other_amount, day.never_written), (2, 1, 1, 0));
    assert_eq!(day.late_in_day, 1, "the 23:55 bump landed with 65 min of TikTok's day left");
    assert_eq!(day.extra_cents, 3_000);
    assert_eq!(report.differences.len(), 1);
    assert_eq!(report.differences[0].campaign_id, "c_late");
    assert!(report.differences[0].late_in_day);
    let text = report.render();
    assert!(text.contains("agreed with the old writer on 1 of 2 amounts"), "{text}");
    assert!(text.contains("EUR 60.00 instead of EUR 30.00"), "{text}");
}
