//! Plans: the claims keep one generic plan per connection instead of being
//! planned again on every execution (docs/performance.md "The send's plan").
//! Each claim statement runs on one connection, as the worker prepares it,
//! in a database where another function has thousands of runs queued (in
//! empty tables custom and generic plans cost alike, which hides the fault);
//! Postgres then says how often it planned it for the values
//! (`pg_prepared_statements.custom_plans`).
mod common;

use durastep::{Ctx, Event, Function};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection};

const EXECUTIONS: i64 = 12;

/// Runs `sql` (a claim of function `f`, which has no runs, so it claims
/// nothing) `EXECUTIONS` times on one connection and returns the number of
/// custom and generic plans Postgres made for it.
async fn plans_of(conn: &mut PgConnection, sql: &'static str, full: bool) -> (i64, i64) {
    let worker = uuid::Uuid::new_v4();
    for _ in 0..EXECUTIONS {
        let mut q = sqlx::query(sql).bind(vec!["f"]).bind(32i64).bind(30.0f64).bind(worker);
        if full {
            q = q.bind(1.0f64);
        }
        q.bind(vec!["f"]).bind(vec![0i32]).execute(&mut *conn).await.expect("claim");
    }
    sqlx::query_as(
        "SELECT custom_plans, generic_plans FROM pg_prepared_statements
          WHERE NOT from_sql AND statement = $1",
    )
    .bind(sql)
    .fetch_one(&mut *conn)
    .await
    .expect("the claim's prepared statement")
}

/// Catches: a claim statement that reads its array parameters directly, so
/// that its custom plans (which see one function where the generic plan
/// assumes ten) always look cheaper and every claim is planned again (1-1.5 ms
/// per full claim here). Postgres makes five custom plans before it compares.
#[sqlx::test(migrations = false)]
async fn the_claims_keep_a_generic_plan(_p: PgPoolOptions, opts: PgConnectOptions) {
    let other = Function::new("other").on_event("seed").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let engine = common::engine(&opts, vec![other]).await;
    let seed: Vec<Event> = (0..4000).map(|i| Event::new("seed", &i)).collect();
    for chunk in seed.chunks(1000) {
        engine.send_batch(chunk.to_vec()).await.expect("seed runs");
    }
    let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
    sqlx::query("ANALYZE").execute(&mut conn).await.expect("analyze");
    for (name, sql, full) in [
        ("the full claim", include_str!("../src/store/sql/claim.sql"), true),
        ("the fast claim", include_str!("../src/store/sql/claim_fast.sql"), false),
    ] {
        let (custom, generic) = plans_of(&mut conn, sql, full).await;
        assert!(
            custom <= 5 && generic >= EXECUTIONS - 5,
            "{name} was planned for its values {custom} times in {EXECUTIONS} executions ({generic} generic)"
        );
    }
}
