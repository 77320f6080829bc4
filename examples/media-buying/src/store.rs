//! The state store: schema `media` (see `migrations/`), and every SQL
//! statement the example runs, named for what it does. Nothing here calls a
//! platform.

use chrono::{DateTime, Utc};
use durastep::{Engine, Event};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::functions::{BudgetRequest, Platform};

pub mod finance;

/// Applies the example's migrations (schema `media`, tracked in
/// `media._migrations`). Durastep's own schema must exist first: the tables'
/// timestamps default to its clock, `durastep.now()`.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.create_schema("media");
    migrator.dangerous_set_table_name("media._migrations");
    migrator.run(pool).await
}

/// Adds a client's ad account on a platform (a no-op if it exists).
pub async fn add_account(pool: &PgPool, platform: Platform, account_id: &str, client: &str) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO media.accounts (platform, account_id, client) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING")
        .bind(platform.as_str())
        .bind(account_id)
        .bind(client)
        .execute(pool)
        .await?;
    Ok(())
}

/// Stores an account's credential. Fails with a foreign-key violation when
/// the account does not exist.
pub async fn add_token(
    pool: &PgPool,
    platform: Platform,
    account_id: &str,
    access_token: &str,
    refresh_token: &str,
    expires_at: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO media.tokens (platform, account_id, access_token, refresh_token, expires_at)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(platform.as_str())
    .bind(account_id)
    .bind(access_token)
    .bind(refresh_token)
    .bind(expires_at)
    .execute(pool)
    .await?;
    Ok(())
}

/// A credential as stored.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow, serde::Serialize, serde::Deserialize)]
pub struct TokenRow {
    /// The ad account.
    pub account_id: String,
    /// The access token.
    pub access_token: String,
    /// The refresh token.
    pub refresh_token: String,
    /// When the access token expires.
    pub expires_at: DateTime<Utc>,
    /// When it was last rotated.
    pub rotated_at: Option<DateTime<Utc>>,
}

/// An account's credential.
pub async fn token(pool: &PgPool, platform: Platform, account_id: &str) -> sqlx::Result<Option<TokenRow>> {
    sqlx::query_as(
        "SELECT account_id, access_token, refresh_token, expires_at, rotated_at
           FROM media.tokens WHERE platform = $1 AND account_id = $2",
    )
    .bind(platform.as_str())
    .bind(account_id)
    .fetch_optional(pool)
    .await
}

/// Every credential of a platform, by account.
pub async fn tokens(pool: &PgPool, platform: Platform) -> sqlx::Result<Vec<TokenRow>> {
    sqlx::query_as(
        "SELECT account_id, access_token, refresh_token, expires_at, rotated_at
           FROM media.tokens WHERE platform = $1 ORDER BY account_id",
    )
    .bind(platform.as_str())
    .fetch_all(pool)
    .await
}

/// Replaces one account's access token after a refresh.
pub async fn save_token(
    pool: &PgPool,
    platform: Platform,
    account_id: &str,
    access_token: &str,
    expires_at: DateTime<Utc>,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE media.tokens SET access_token = $3, expires_at = $4, rotated_at = durastep.now()
          WHERE platform = $1 AND account_id = $2",
    )
    .bind(platform.as_str())
    .bind(account_id)
    .bind(access_token)
    .bind(expires_at)
    .execute(pool)
    .await?;
    Ok(())
}

/// Switches every staged credential in one statement (so in one
/// transaction): after it, all accounts have their new token; before it, all
/// had their old one. Returns how many rows changed.
pub async fn switch_tokens(
    conn: &mut PgConnection,
    platform: Platform,
    staged: &[(String, String, DateTime<Utc>)],
) -> sqlx::Result<u64> {
    let accounts: Vec<&str> = staged.iter().map(|s| s.0.as_str()).collect();
    let tokens: Vec<&str> = staged.iter().map(|s| s.1.as_str()).collect();
    let expiries: Vec<DateTime<Utc>> = staged.iter().map(|s| s.2).collect();
    let done = sqlx::query(
        "UPDATE media.tokens t
            SET access_token = n.access_token, expires_at = n.expires_at, rotated_at = durastep.now()
           FROM unnest($2::text[], $3::text[], $4::timestamptz[]) AS n (account_id, access_token, expires_at)
          WHERE t.platform = $1 AND t.account_id = n.account_id",
    )
    .bind(platform.as_str())
    .bind(&accounts)
    .bind(&tokens)
    .bind(&expiries)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// What [`request_budget`] created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Requested {
    /// The `media.budget_writes` row, `queued`.
    pub write_id: i64,
    /// The run that will push it.
    pub run_id: Uuid,
}

/// A client asks for a budget: the `queued` budget write and the event that
/// starts its run commit together (Durastep's `send_in`), so there is never a
/// write without a run or a run without its write. An account without a
/// token row is refused by the database (foreign key), and nothing is sent.
pub async fn request_budget(
    engine: &Engine,
    pool: &PgPool,
    platform: Platform,
    account_id: &str,
    campaign_id: &str,
    amount_cents: i64,
    requested_by: &str,
) -> Result<Requested, crate::Error> {
    let mut tx = pool.begin().await?;
    let write_id: i64 = sqlx::query_scalar(
        "INSERT INTO media.budget_writes (campaign_id, platform, account_id, amount_cents, requested_by)
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(campaign_id)
    .bind(platform.as_str())
    .bind(account_id)
    .bind(amount_cents)
    .bind(requested_by)
    .fetch_one(&mut *tx)
    .await?;
    let request = BudgetRequest {
        write_id: Some(write_id),
        platform,
        account_id: account_id.to_owned(),
        campaign_id: campaign_id.to_owned(),
        amount_cents,
        requested_by: requested_by.to_owned(),
    };
    let event = Event::new(platform.event_name(), &request).idempotency_key(format!("budget-write:{write_id}"));
    let receipt = engine.send_in(&mut tx, event).await?;
    let run_id = receipt.run_ids.first().copied().ok_or_else(|| {
        crate::Error::Usage(format!(
            "no function is registered for {}: start the worker's engine first",
            platform.event_name()
        ))
    })?;
    sqlx::query("UPDATE media.budget_writes SET run_id = $2 WHERE id = $1")
        .bind(write_id)
        .bind(run_id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Requested { write_id, run_id })
}

/// The `log` step: the write is `pushed`, with the platform's reference.
/// Runs inside the step's transaction, so it commits with the checkpoint.
pub async fn mark_pushed(
    conn: &mut PgConnection,
    write_id: i64,
    external_ref: &str,
    pushed_at: DateTime<Utc>,
) -> sqlx::Result<u64> {
    let done = sqlx::query(
        "UPDATE media.budget_writes SET status = 'pushed', external_ref = $2, pushed_at = $3
          WHERE id = $1 AND status = 'queued'",
    )
    .bind(write_id)
    .bind(external_ref)
    .bind(pushed_at)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// The failure handler's step: the write is `failed`, with the run's last error.
pub async fn mark_failed(conn: &mut PgConnection, write_id: i64, error: &str) -> sqlx::Result<u64> {
    let done = sqlx::query(
        "UPDATE media.budget_writes SET status = 'failed', last_error = $2 WHERE id = $1 AND status = 'queued'",
    )
    .bind(write_id)
    .bind(error)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Shadow mode: what the new function would have written next to what the platform has.
#[derive(Debug, Clone)]
pub struct Comparison {
    /// The shadow run.
    pub run_id: Uuid,
    /// The request it shadowed.
    pub request: BudgetRequest,
    /// The budget the platform has, after the old writer.
    pub platform_cents: Option<i64>,
    /// When the request came (TikTok's shadow records timing).
    pub requested_at: Option<DateTime<Utc>>,
    /// When the new function would have written.
    pub planned_at: Option<DateTime<Utc>>,
    /// When the old writer's write landed at the platform.
    pub platform_written_at: Option<DateTime<Utc>>,
}

/// Records a shadow comparison (once per run); returns whether the amounts agree.
pub async fn record_comparison(conn: &mut PgConnection, c: &Comparison) -> sqlx::Result<bool> {
    let agree = c.platform_cents == Some(c.request.amount_cents);
    sqlx::query(
        "INSERT INTO media.shadow_comparisons
             (run_id, platform, account_id, campaign_id, planned_cents, platform_cents, agree,
              requested_at, planned_at, platform_written_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
    )
    .bind(c.run_id)
    .bind(c.request.platform.as_str())
    .bind(&c.request.account_id)
    .bind(&c.request.campaign_id)
    .bind(c.request.amount_cents)
    .bind(c.platform_cents)
    .bind(agree)
    .bind(c.requested_at)
    .bind(c.planned_at)
    .bind(c.platform_written_at)
    .execute(conn)
    .await?;
    Ok(agree)
}

/// Hours of TikTok's (UTC) day under which a pushed bump counts as "late": it
/// lands on a day that is nearly over (the story's 23:55 bump burned out in
/// five minutes).
pub const LATE_IN_DAY_HOURS: i32 = 2;

/// One day of a shadow comparison report.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ShadowDay {
    /// The day the requests came, in Amsterdam.
    pub day: chrono::NaiveDate,
    /// Requests shadowed.
    pub requests: i64,
    /// The old writer wrote the same amount.
    pub same_amount: i64,
    /// The old writer wrote another amount.
    pub other_amount: i64,
    /// The platform has no budget for the campaign (the old writer never wrote).
    pub never_written: i64,
    /// The old writer's write landed with less than [`LATE_IN_DAY_HOURS`] of the platform's day left.
    pub late_in_day: i64,
    /// What the old writer wrote beyond what was asked, summed, in cents.
    pub extra_cents: i64,
}

/// One comparison where the old writer did something the new function would not have.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ShadowDifference {
    /// The campaign.
    pub campaign_id: String,
    /// When the request came.
    pub requested_at: Option<DateTime<Utc>>,
    /// What the new function would have written.
    pub planned_cents: i64,
    /// When.
    pub planned_at: Option<DateTime<Utc>>,
    /// What the old writer wrote.
    pub platform_cents: Option<i64>,
    /// When.
    pub platform_written_at: Option<DateTime<Utc>>,
    /// Whether the write landed late in the platform's day.
    pub late_in_day: bool,
}

/// The comparison report of a platform's shadow run: per day, and the differences.
#[derive(Debug, Clone, PartialEq)]
pub struct ShadowReport {
    /// The platform.
    pub platform: Platform,
    /// Per day (Amsterdam) of the requests.
    pub days: Vec<ShadowDay>,
    /// Every comparison that differs in amount or landed late in the day, oldest first.
    pub differences: Vec<ShadowDifference>,
}

/// Whether the old writer's write landed with less than `$2` hours of the
/// platform's (UTC) day left.
macro_rules! late_in_day {
    () => {
        "(platform_written_at IS NOT NULL AND platform_written_at >= \
          date_trunc('day', platform_written_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + make_interval(hours => 24 - $2))"
    };
}

/// Loads the comparison report of `platform`'s shadow mode.
pub async fn shadow_report(pool: &PgPool, platform: Platform) -> sqlx::Result<ShadowReport> {
    let days = sqlx::query_as(concat!(
        "SELECT (coalesce(requested_at, compared_at) AT TIME ZONE 'Europe/Amsterdam')::date AS day,
                count(*) AS requests,
                count(*) FILTER (WHERE agree) AS same_amount,
                count(*) FILTER (WHERE NOT agree AND platform_cents IS NOT NULL) AS other_amount,
                count(*) FILTER (WHERE platform_cents IS NULL) AS never_written,
                count(*) FILTER (WHERE ",
        late_in_day!(),
        ") AS late_in_day,
                coalesce(sum(greatest(platform_cents - planned_cents, 0)), 0)::bigint AS extra_cents
           FROM media.shadow_comparisons WHERE platform = $1
          GROUP BY 1 ORDER BY 1"
    ))
    .bind(platform.as_str())
    .bind(LATE_IN_DAY_HOURS)
    .fetch_all(pool)
    .await?;
    let differences = sqlx::query_as(concat!(
        "SELECT campaign_id, requested_at, planned_cents, planned_at, platform_cents, platform_written_at, ",
        late_in_day!(),
        " AS late_in_day
           FROM media.shadow_comparisons
          WHERE platform = $1 AND (NOT agree OR ",
        late_in_day!(),
        ")
          ORDER BY coalesce(requested_at, compared_at), id"
    ))
    .bind(platform.as_str())
    .bind(LATE_IN_DAY_HOURS)
    .fetch_all(pool)
    .await?;
    Ok(ShadowReport { platform, days, differences })
}

/// The figures of the Saturday summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize, sqlx::FromRow)]
pub struct WeekSummary {
    /// Budget writes requested in the week.
    pub queued: i64,
    /// Budget writes pushed in the week.
    pub pushed: i64,
    /// Writes of the week that took more than one try: pushed after a
    /// failure (a 429 absorbed counts), or not pushed after several attempts.
    pub retried: i64,
    /// Writes not pushed now, whenever requested (`queued` or `failed`).
    pub still_open: i64,
    /// Of those, `failed` (they need a person).
    pub failed: i64,
}

/// Counts the week `(from, to]`.
pub async fn week_summary(pool: &PgPool, from: DateTime<Utc>, to: DateTime<Utc>) -> sqlx::Result<WeekSummary> {
    sqlx::query_as(
        "SELECT count(*) FILTER (WHERE w.requested_at > $1 AND w.requested_at <= $2)            AS queued,
                count(*) FILTER (WHERE w.pushed_at > $1 AND w.pushed_at <= $2)                  AS pushed,
                count(*) FILTER (WHERE w.requested_at > $1 AND w.requested_at <= $2
                                   AND r.last_error IS NOT NULL
                                   AND (w.status = 'pushed' OR r.attempt > 1))                  AS retried,
                count(*) FILTER (WHERE w.status <> 'pushed')                                    AS still_open,
                count(*) FILTER (WHERE w.status = 'failed')                                     AS failed
           FROM media.budget_writes w
           LEFT JOIN durastep.runs r ON r.id = w.run_id",
    )
    .bind(from)
    .bind(to)
    .fetch_one(pool)
    .await
}

/// One cell of the founder's grouping.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct StatusCount {
    /// The platform.
    pub platform: String,
    /// `queued`, `pushed` or `failed`.
    pub status: String,
    /// How many writes.
    pub writes: i64,
    /// Their budgets, summed, in cents.
    pub amount_cents: i64,
}

/// A budget write that is not pushed, with its original request and latest error.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct OpenWrite {
    /// The write.
    pub id: i64,
    /// The platform.
    pub platform: String,
    /// The ad account.
    pub account_id: String,
    /// The client.
    pub client: String,
    /// The campaign.
    pub campaign_id: String,
    /// The requested daily budget.
    pub amount_cents: i64,
    /// Who asked.
    pub requested_by: String,
    /// When.
    pub requested_at: DateTime<Utc>,
    /// `queued` or `failed`.
    pub status: String,
    /// The run's state (`queued`, `running`, `sleeping`, `failed`, ...).
    pub run_state: Option<String>,
    /// Attempts so far.
    pub attempts: Option<i32>,
    /// The latest error of the run (or the one it failed with).
    pub latest_error: Option<String>,
}

/// Budget writes by platform and status.
pub async fn writes_by_status(pool: &PgPool) -> sqlx::Result<Vec<StatusCount>> {
    sqlx::query_as(
        "SELECT platform, status, count(*) AS writes, coalesce(sum(amount_cents), 0)::bigint AS amount_cents
           FROM media.budget_writes GROUP BY platform, status ORDER BY platform, status",
    )
    .fetch_all(pool)
    .await
}

/// Every write not pushed, oldest first.
pub async fn open_writes(pool: &PgPool) -> sqlx::Result<Vec<OpenWrite>> {
    sqlx::query_as(
        "SELECT w.id, w.platform, w.account_id, a.client, w.campaign_id, w.amount_cents, w.requested_by,
                w.requested_at, w.status, r.state AS run_state, r.attempt AS attempts,
                coalesce(w.last_error, r.last_error) AS latest_error
           FROM media.budget_writes w
           JOIN media.accounts a ON a.platform = w.platform AND a.account_id = w.account_id
           LEFT JOIN durastep.runs r ON r.id = w.run_id
          WHERE w.status <> 'pushed'
          ORDER BY w.requested_at, w.id",
    )
    .fetch_all(pool)
    .await
}
