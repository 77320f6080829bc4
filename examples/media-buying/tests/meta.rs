//! Story B, Meta: `get-token` rotates a token that expires within 7 days; an
//! expired token gets Meta's auth error and is refreshed once; a 429 burst is
//! retried; at most 6 writes at once per ad account.

mod common;

use std::time::Duration;

use durastep::RunState;
use media_buying::{Platform, store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn get_token_rotates_a_token_expiring_within_7_days_and_only_then(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    let now = w.now().await;
    let soon = now + chrono::Duration::days(3);
    let later = now + chrono::Duration::days(10);
    let old_soon = w.account_expiring(Platform::Meta, "act_soon", soon, soon).await;
    let old_later = w.account_expiring(Platform::Meta, "act_later", later, later).await;
    let a = w.request(Platform::Meta, "act_soon", "c1", 1_000).await.1;
    let b = w.request(Platform::Meta, "act_later", "c2", 1_000).await.1;
    let worker = common::worker(&w.engine);
    let runs = w.drive(&[a, b]).await;
    worker.stop().await;
    assert!(runs.iter().all(|r| r.state == RunState::Completed), "{runs:?}");
    let soon_row = store::token(&w.pool, Platform::Meta, "act_soon").await.unwrap().unwrap();
    assert_ne!(soon_row.access_token, old_soon, "rotated before the push");
    assert!(soon_row.expires_at > now + chrono::Duration::days(59));
    assert_eq!(w.sims.meta.tokens_issued("act_soon"), 1);
    let later_row = store::token(&w.pool, Platform::Meta, "act_later").await.unwrap().unwrap();
    assert_eq!(later_row.access_token, old_later, "10 days left: not rotated");
    assert_eq!(w.sims.meta.tokens_issued("act_later"), 0);
    assert_eq!(w.sims.meta.writes().len(), 2);
}

#[sqlx::test(migrations = false)]
async fn an_expired_token_gets_metas_auth_error_and_is_refreshed_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    let now = w.now().await;
    // The store thinks the token is good for 30 days; Meta expired it yesterday.
    w.account_expiring(Platform::Meta, "act_1", now + chrono::Duration::days(30), now - chrono::Duration::days(1))
        .await;
    let (write_id, run_id) = w.request(Platform::Meta, "act_1", "c1", 7_700).await;
    let worker = common::worker(&w.engine);
    let run = w.finished(run_id).await;
    worker.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 1, "handled within the attempt, no retry used");
    assert_eq!(w.sims.meta.auth_errors(), 1, "Meta answered code 190 once");
    assert_eq!(w.sims.meta.tokens_issued("act_1"), 1);
    assert_eq!(w.sims.meta.writes().len(), 1);
    assert_eq!(w.write_row(write_id).await.0, "pushed");
}

#[sqlx::test(migrations = false)]
async fn a_429_burst_is_retried_and_the_write_lands_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    w.account(Platform::Meta, "act_1").await;
    // The first write request starts a burst of two 429s on its account.
    w.sims.meta.set_bursts(1_000, 2);
    let (write_id, run_id) = w.request(Platform::Meta, "act_1", "c1", 2_500).await;
    let worker = common::worker(&w.engine);
    let run = w.drive(&[run_id]).await.remove(0);
    worker.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 3, "two 429s, each a retry with backoff (of 5)");
    assert!(run.last_error.as_deref().unwrap_or_default().contains("HTTP 429"), "{run:?}");
    assert_eq!(w.sims.meta.rate_limited(), 2);
    assert_eq!(w.sims.meta.writes().len(), 1);
    assert_eq!(w.write_row(write_id).await.0, "pushed");
}

#[sqlx::test(migrations = false)]
async fn at_most_6_writes_at_once_per_ad_account(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    w.account(Platform::Meta, "act_big").await;
    w.sims.meta.set_latency(Duration::from_millis(150));
    let mut ids = Vec::new();
    for i in 0..14 {
        ids.push(w.request(Platform::Meta, "act_big", &format!("c{i}"), 1_000 + i).await.1);
    }
    let worker = common::worker(&w.engine);
    let runs = w.drive(&ids).await;
    worker.stop().await;
    assert!(runs.iter().all(|r| r.state == RunState::Completed));
    assert_eq!(w.sims.meta.max_in_flight_per_account(), 6, "6 at once, never more");
    assert_eq!(w.sims.meta.writes().len(), 14);
}
