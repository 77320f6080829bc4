//! The Durastep functions of Story B, and what they share.
//!
//! | function | trigger | rules |
//! |---|---|---|
//! | `meta-budget-update` | `campaign/budget.requested` | 6 at once per ad account, 5 retries |
//! | `tiktok-budget-update` | `campaign/budget.requested.tiktok` | sleeps until after TikTok's reset, 5 retries |
//! | `linkedin-budget-update` | `campaign/budget.requested.linkedin` | 2 at once and 100 starts/min per account, back-pressure on 429, 8 retries |
//! | `meta-token-rotation` | cron `0 9 * 1,4,7,10 MON#1` Europe/Amsterdam | durable, all-or-nothing switch |
//! | `saturday-summary` | cron `0 6 * * SAT` Europe/Amsterdam | one message |
//! | `meta-budget-shadow` | `campaign/budget.requested`, instead of the Meta writer in shadow mode | writes nothing to Meta |
//! | `tiktok-budget-shadow` | `campaign/budget.requested.tiktok`, instead of the TikTok writer in shadow mode | writes nothing to TikTok; compares amount and timing |
//! | `finance-import` | `finance/sheet.imported` | one `step_tx` per sheet row, 5 retries |
//! | `finance-row-review` | `finance/row.flagged` | waits for the accountant's decision, up to 30 days |
//!
//! Each platform has its own event name, so that one platform's limits (its
//! concurrency, throttle and back-pressure keys) only ever see its own
//! requests. Every budget function has the same failure handler: the write
//! becomes `failed` and one message goes to the on-call channel.

pub mod finance;
mod linkedin;
mod meta;
mod rotation;
mod shadow;
mod summary;
mod tiktok;

use std::sync::Arc;

use chrono::{DateTime, Utc};
use durastep::{Ctx, FailedRun, Function, HandlerError, HandlerResult};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;

use crate::Settings;
use crate::platforms::Platforms;
use crate::store;

pub use linkedin::linkedin_budget_update;
pub use meta::meta_budget_update;
pub use rotation::{ROTATION_CRON, RotationReport, meta_token_rotation};
pub use shadow::{ShadowOutcome, ShadowRequest, meta_budget_shadow, request_shadow, tiktok_budget_shadow};
pub use summary::{SUMMARY_CRON, saturday_summary, summary_text};
pub use tiktok::{TIKTOK_PUSH_AFTER_RESET, next_tiktok_push, tiktok_budget_update};

/// An ad platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Platform {
    /// Meta (Facebook, Instagram).
    Meta,
    /// TikTok.
    TikTok,
    /// LinkedIn.
    LinkedIn,
}

impl Platform {
    /// All three.
    pub const ALL: [Platform; 3] = [Platform::Meta, Platform::TikTok, Platform::LinkedIn];

    /// The name in the state store.
    pub fn as_str(self) -> &'static str {
        match self {
            Platform::Meta => "meta",
            Platform::TikTok => "tiktok",
            Platform::LinkedIn => "linkedin",
        }
    }

    /// The event a budget request for this platform is sent as.
    pub fn event_name(self) -> &'static str {
        match self {
            Platform::Meta => "campaign/budget.requested",
            Platform::TikTok => "campaign/budget.requested.tiktok",
            Platform::LinkedIn => "campaign/budget.requested.linkedin",
        }
    }

    /// The id of the function that pushes its budget writes.
    pub fn function_id(self) -> &'static str {
        match self {
            Platform::Meta => "meta-budget-update",
            Platform::TikTok => "tiktok-budget-update",
            Platform::LinkedIn => "linkedin-budget-update",
        }
    }

    /// How people write it.
    pub fn label(self) -> &'static str {
        match self {
            Platform::Meta => "Meta",
            Platform::TikTok => "TikTok",
            Platform::LinkedIn => "LinkedIn",
        }
    }
}

/// A budget change a client asked for: the payload of the budget events.
/// Stored in `durastep.events` (a stored format: change it with care).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BudgetRequest {
    /// The `media.budget_writes` row (absent in shadow mode: the old writer owns the write).
    pub write_id: Option<i64>,
    /// Where it goes.
    pub platform: Platform,
    /// The ad account: the key of the concurrency, throttle and back-pressure rules.
    pub account_id: String,
    /// The campaign.
    pub campaign_id: String,
    /// The new daily budget, in cents.
    pub amount_cents: i64,
    /// Who asked.
    pub requested_by: String,
}

/// What a `push` step stores: the platform's reference and when it accepted the write.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Pushed {
    /// The platform's reference of the write.
    pub external_ref: String,
    /// When the platform accepted it (database clock).
    pub pushed_at: DateTime<Utc>,
}

/// What a `get-token` step stores. It holds a secret: in production, give the
/// engine a `Keyring` so that step results are sealed at rest (guide, chapter 13).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Credential {
    /// The access token to use.
    pub access_token: String,
    /// When it expires.
    pub expires_at: DateTime<Utc>,
    /// Whether this step refreshed it.
    pub refreshed: bool,
}

/// What the functions share: the state store, the platform clients, the settings.
#[derive(Debug, Clone)]
pub struct Services {
    /// The database of the state store (and of Durastep).
    pub pool: PgPool,
    /// The platform clients.
    pub api: Platforms,
    /// The settings.
    pub settings: Settings,
}

impl Services {
    /// Clients for the settings' endpoints on this pool.
    pub fn new(pool: PgPool, settings: Settings) -> Arc<Services> {
        Arc::new(Services { api: Platforms::new(&settings.endpoints), pool, settings })
    }
}

/// Every function of the example, as a worker registers them. In a
/// platform's shadow mode, its shadow function replaces its writer.
pub fn all(services: &Arc<Services>) -> Vec<Function> {
    let meta = if services.settings.meta_shadow {
        meta_budget_shadow(services.clone())
    } else {
        meta_budget_update(services.clone())
    };
    let tiktok = if services.settings.tiktok_shadow {
        tiktok_budget_shadow(services.clone())
    } else {
        tiktok_budget_update(services.clone())
    };
    vec![
        meta,
        tiktok,
        linkedin_budget_update(services.clone()),
        meta_token_rotation(services.clone()),
        saturday_summary(services.clone()),
        finance::finance_import(services.clone()),
        finance::finance_row_review(services.clone()),
    ]
}

/// The body of a `get-token` step: the stored credential, refreshed first
/// (Meta only) when `force` is set or it expires within 7 days of `now`.
async fn get_token(
    s: &Services,
    platform: Platform,
    account_id: &str,
    force: bool,
    now: DateTime<Utc>,
    idempotency_key: String,
) -> HandlerResult<Credential> {
    let row = store::token(&s.pool, platform, account_id)
        .await?
        .ok_or_else(|| HandlerError::permanent(format!("no {} token for account {account_id}", platform.label())))?;
    let expiring = row.expires_at < now + chrono::Duration::days(7);
    if platform == Platform::Meta && (force || expiring) {
        let new = s
            .api
            .meta
            .refresh_token(&row.refresh_token, &idempotency_key, now)
            .await
            .map_err(|e| e.into_handler_error())?;
        store::save_token(&s.pool, platform, account_id, &new.access_token, new.expires_at).await?;
        tracing::info!(account_id, force, "Meta token refreshed");
        return Ok(Credential { access_token: new.access_token, expires_at: new.expires_at, refreshed: true });
    }
    Ok(Credential { access_token: row.access_token, expires_at: row.expires_at, refreshed: false })
}

/// The `log` step: marks the write pushed in the step's own transaction, so
/// the row and the checkpoint commit together.
async fn log_pushed(ctx: &Ctx, write_id: i64, pushed: &Pushed) -> HandlerResult<u64> {
    let external_ref = pushed.external_ref.clone();
    let pushed_at = pushed.pushed_at;
    ctx.step_tx("log", async move |conn| Ok(store::mark_pushed(conn, write_id, &external_ref, pushed_at).await?)).await
}

/// The write id of a live request (shadow requests have none).
fn write_id(req: &BudgetRequest) -> HandlerResult<i64> {
    req.write_id.ok_or_else(|| HandlerError::permanent("a live budget request must name its budget write"))
}

/// The failure handler of every budget function: the write is `failed` (one
/// `step_tx`), then one message to the on-call channel (one step). It runs
/// once per failed run, so a run that used up its 9 attempts pages once.
async fn page_on_call(ctx: Ctx, s: Arc<Services>, failed: FailedRun<BudgetRequest>) -> HandlerResult<()> {
    let req = failed.event;
    if let Some(write_id) = req.write_id {
        let error = failed.error.clone();
        ctx.step_tx("mark-failed", async move |conn| Ok(store::mark_failed(conn, write_id, &error).await?)).await?;
    }
    let text = format!(
        ":rotating_light: {} budget write {} failed after {} attempt(s) and stopped: campaign {} (account {}), \
         daily budget EUR {}.{:02}, asked by {}. Last error: {}",
        req.platform.label(),
        req.write_id.map_or_else(|| "(shadow)".to_owned(), |id| format!("#{id}")),
        failed.attempts,
        req.campaign_id,
        req.account_id,
        req.amount_cents / 100,
        req.amount_cents % 100,
        req.requested_by,
        failed.error,
    );
    let channel = s.settings.on_call_channel.clone();
    ctx.step(
        "page-on-call",
        || async move { s.api.chat.post(&channel, &text).await.map_err(|e| e.into_handler_error()) },
    )
    .await?;
    Ok(())
}
