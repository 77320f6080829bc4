//! Story B's state store: "no budget write without a token row, no token row
//! without an account; orphans are rejected at insert".

mod common;

use media_buying::{Platform, store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn is_foreign_key_violation(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("23503"))
}

#[sqlx::test(migrations = false)]
async fn orphans_are_rejected_by_the_database(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    let expires = w.now().await + chrono::Duration::days(30);

    // A token without an account.
    let e = store::add_token(&w.pool, Platform::Meta, "act_ghost", "t", "r", expires).await.unwrap_err();
    assert!(is_foreign_key_violation(&e), "{e}");

    // A budget write without a token row (the account exists, its token does not).
    store::add_account(&w.pool, Platform::Meta, "act_new", "New client").await.unwrap();
    let e = sqlx::query(
        "INSERT INTO media.budget_writes (campaign_id, platform, account_id, amount_cents, requested_by)
         VALUES ('c1', 'meta', 'act_new', 1000, 'ops')",
    )
    .execute(&w.pool)
    .await
    .unwrap_err();
    assert!(is_foreign_key_violation(&e), "{e}");

    // Through the example's own path: refused, and no event, no run was sent.
    let e = store::request_budget(&w.engine, &w.pool, Platform::Meta, "act_new", "c1", 1000, "ops").await.unwrap_err();
    assert!(matches!(&e, media_buying::Error::Database(d) if is_foreign_key_violation(d)), "{e}");
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM durastep.events").fetch_one(&w.pool).await.unwrap();
    assert_eq!(events, 0);

    // With the token in place the same write is accepted.
    store::add_token(&w.pool, Platform::Meta, "act_new", "t", "r", expires).await.unwrap();
    store::request_budget(&w.engine, &w.pool, Platform::Meta, "act_new", "c1", 1000, "ops").await.unwrap();
    assert_eq!(w.budget_write_rows().await, 1);

    // A token row's account cannot be deleted from under it.
    let e = sqlx::query("DELETE FROM media.accounts WHERE account_id = 'act_new'").execute(&w.pool).await.unwrap_err();
    assert!(is_foreign_key_violation(&e), "{e}");
}
