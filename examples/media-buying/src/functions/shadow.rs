//! Shadow mode: the new function runs beside the old writer (the zap that
//! still owns the write) and records what it would have written against what
//! the old writer did write, without writing to the platform.
//!
//! - Meta (`meta-budget-shadow`): waits, durably, for the old writer to have
//!   written, reads the campaign's budget back and records the comparison.
//! - TikTok (`tiktok-budget-shadow`), the story's shadow week: plans its write
//!   as the live function would (the amount, at 00:30 UTC after TikTok's
//!   daily reset), sleeps durably until then, reads the campaign back (budget
//!   and when it last changed) and records amount *and* timing, so the
//!   comparison report (`store::shadow_report`) shows the old writer's
//!   doubled budgets and its bumps pushed late in TikTok's day.
//!
//! Comparisons land in `media.shadow_comparisons` in the step's transaction.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use durastep::{Concurrency, Ctx, Function, HandlerError, HandlerResult};
use serde::{Deserialize, Serialize};

use super::{BudgetRequest, Platform, Services, next_tiktok_push};
use crate::store::{self, Comparison};

/// What a shadow run returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowOutcome {
    /// What the new function would have written.
    pub planned_cents: i64,
    /// What the platform has after the old writer.
    pub platform_cents: Option<i64>,
    /// Whether they are the same.
    pub agree: bool,
}

/// The Meta shadow function (registered instead of the Meta writer in shadow mode).
pub fn meta_budget_shadow(s: Arc<Services>) -> Function {
    Function::new("meta-budget-shadow")
        .on_event(Platform::Meta.event_name())
        .concurrency(durastep::Concurrency::new(6).key("/account_id"))
        .retries(5)
        .handler(move |ctx: Ctx, req: BudgetRequest| shadow_meta(ctx, s.clone(), req))
}

async fn shadow_meta(ctx: Ctx, s: Arc<Services>, req: BudgetRequest) -> HandlerResult<ShadowOutcome> {
    ctx.sleep("let-old-writer-finish", s.settings.shadow_settle).await?;
    let platform_cents: Option<i64> = ctx
        .step("read-back", || async {
            // Read only: the stored token, never refreshed from here.
            let token = stored_token(&s, Platform::Meta, &req.account_id).await?;
            let budget = s.api.meta.read_budget(&token, &req.campaign_id).await.map_err(|e| e.into_handler_error())?;
            Ok(budget.daily_budget_cents)
        })
        .await?;
    let comparison = Comparison {
        run_id: ctx.run_id(),
        request: req.clone(),
        platform_cents,
        requested_at: None,
        planned_at: None,
        platform_written_at: None,
    };
    compare(&ctx, comparison).await
}

/// The TikTok shadow function (registered instead of the TikTok writer in shadow mode).
pub fn tiktok_budget_shadow(s: Arc<Services>) -> Function {
    Function::new("tiktok-budget-shadow")
        .on_event(Platform::TikTok.event_name())
        .concurrency(Concurrency::new(6).key("/account_id"))
        .retries(5)
        .handler(move |ctx: Ctx, req: BudgetRequest| shadow_tiktok(ctx, s.clone(), req))
}

/// When the shadow run was asked and when the live function would have pushed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct Plan {
    requested_at: DateTime<Utc>,
    planned_at: DateTime<Utc>,
}

/// What TikTok has, read back after the planned push time.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct ReadBack {
    cents: Option<i64>,
    written_at: Option<DateTime<Utc>>,
}

async fn shadow_tiktok(ctx: Ctx, s: Arc<Services>, req: BudgetRequest) -> HandlerResult<ShadowOutcome> {
    let now = ctx.db_time();
    // Checkpointed, so every later execution compares against the first plan.
    let plan: Plan = ctx
        .step("plan", || async move {
            let planned_at =
                next_tiktok_push(now).ok_or_else(|| HandlerError::permanent("no next TikTok push time"))?;
            Ok(Plan { requested_at: now, planned_at })
        })
        .await?;
    // Where the live function would push; no worker is held meanwhile.
    ctx.sleep_until("until-after-reset", plan.planned_at).await?;
    let read: ReadBack = ctx
        .step("read-back", || async {
            let token = stored_token(&s, Platform::TikTok, &req.account_id).await?;
            let campaign = s
                .api
                .tiktok
                .read_campaign(&token, &req.account_id, &req.campaign_id)
                .await
                .map_err(|e| e.into_handler_error())?;
            Ok(ReadBack { cents: campaign.daily_budget_cents, written_at: campaign.modified_at })
        })
        .await?;
    let comparison = Comparison {
        run_id: ctx.run_id(),
        request: req.clone(),
        platform_cents: read.cents,
        requested_at: Some(plan.requested_at),
        planned_at: Some(plan.planned_at),
        platform_written_at: read.written_at,
    };
    compare(&ctx, comparison).await
}

/// The stored access token (read only: a shadow run never refreshes it).
async fn stored_token(s: &Services, platform: Platform, account_id: &str) -> HandlerResult<String> {
    let token = store::token(&s.pool, platform, account_id)
        .await?
        .ok_or_else(|| HandlerError::permanent(format!("no {} token for account {account_id}", platform.label())))?;
    Ok(token.access_token)
}

/// The `compare` step: records the comparison in the step's transaction.
async fn compare(ctx: &Ctx, c: Comparison) -> HandlerResult<ShadowOutcome> {
    let outcome_base = (c.request.amount_cents, c.platform_cents);
    let agree: bool = ctx.step_tx("compare", async move |conn| Ok(store::record_comparison(conn, &c).await?)).await?;
    Ok(ShadowOutcome { planned_cents: outcome_base.0, platform_cents: outcome_base.1, agree })
}

/// A request for a shadow function.
#[derive(Debug, Clone, PartialEq)]
pub struct ShadowRequest<'a> {
    /// The platform in shadow mode.
    pub platform: Platform,
    /// The old system's id of the request: a re-sent request is one comparison.
    pub request_id: &'a str,
    /// The ad account.
    pub account_id: &'a str,
    /// The campaign.
    pub campaign_id: &'a str,
    /// The daily budget asked for, in cents.
    pub amount_cents: i64,
    /// Who asked.
    pub requested_by: &'a str,
}

/// Sends a request to the platform's shadow function: no budget write row
/// (the old writer owns the write), just the event, keyed by the request id.
pub async fn request_shadow(engine: &durastep::Engine, r: ShadowRequest<'_>) -> Result<uuid::Uuid, crate::Error> {
    let req = BudgetRequest {
        write_id: None,
        platform: r.platform,
        account_id: r.account_id.to_owned(),
        campaign_id: r.campaign_id.to_owned(),
        amount_cents: r.amount_cents,
        requested_by: r.requested_by.to_owned(),
    };
    let key = format!("shadow:{}:{}", r.platform.as_str(), r.request_id);
    let event = durastep::Event::new(r.platform.event_name(), &req).idempotency_key(key);
    let receipt = engine.send(event).await?;
    receipt
        .run_ids
        .first()
        .copied()
        .ok_or_else(|| crate::Error::Usage(format!("the {} shadow function is not registered", r.platform.label())))
}
