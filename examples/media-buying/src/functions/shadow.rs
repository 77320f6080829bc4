//! Shadow mode for Meta: the new function runs beside the old writer (the
//! zap that still owns the write) and records whether their results agree,
//! without writing to Meta. It waits, durably, for the old writer to have
//! written, reads the campaign's budget back from Meta, and records the
//! comparison in `media.shadow_comparisons` in the step's transaction.

use std::sync::Arc;

use durastep::{Ctx, Function, HandlerError, HandlerResult};
use serde::{Deserialize, Serialize};

use super::{BudgetRequest, Platform, Services};
use crate::store::{self, Comparison};

/// What a shadow run returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShadowOutcome {
    /// What the new function would have written.
    pub planned_cents: i64,
    /// What Meta has after the old writer.
    pub platform_cents: Option<i64>,
    /// Whether they are the same.
    pub agree: bool,
}

/// The Meta shadow function (registered instead of the Meta writer in shadow mode).
pub fn meta_budget_shadow(s: Arc<Services>) -> Function {
    Function::new("meta-budget-shadow")
        .on_event(Platform::Meta.event_name())
        .concurrency(6, Some("/account_id"))
        .retries(5)
        .handler(move |ctx: Ctx, req: BudgetRequest| shadow(ctx, s.clone(), req))
}

async fn shadow(ctx: Ctx, s: Arc<Services>, req: BudgetRequest) -> HandlerResult<ShadowOutcome> {
    ctx.sleep("let-old-writer-finish", s.settings.shadow_settle).await?;
    let platform_cents: Option<i64> = ctx
        .step("read-back", || async {
            // Read only: the stored token, never refreshed from here.
            let token = store::token(&s.pool, Platform::Meta, &req.account_id)
                .await?
                .ok_or_else(|| HandlerError::permanent(format!("no Meta token for account {}", req.account_id)))?;
            let budget = s
                .api
                .meta
                .read_budget(&token.access_token, &req.campaign_id)
                .await
                .map_err(|e| e.into_handler_error())?;
            Ok(budget.daily_budget_cents)
        })
        .await?;
    let run_id = ctx.run_id();
    let request = req.clone();
    let agree: bool = ctx
        .step_tx("compare", move |conn| {
            Box::pin(async move {
                Ok(store::record_comparison(conn, Comparison { run_id, request: &request, platform_cents }).await?)
            })
        })
        .await?;
    Ok(ShadowOutcome { planned_cents: req.amount_cents, platform_cents, agree })
}

/// Sends a request to the shadow function: no budget write row (the old
/// writer owns the write), just the event, keyed by campaign and request id so
/// that a re-sent request is one comparison.
pub async fn request_shadow(
    engine: &durastep::Engine,
    request_id: &str,
    account_id: &str,
    campaign_id: &str,
    amount_cents: i64,
    requested_by: &str,
) -> Result<uuid::Uuid, crate::Error> {
    let req = BudgetRequest {
        write_id: None,
        platform: Platform::Meta,
        account_id: account_id.to_owned(),
        campaign_id: campaign_id.to_owned(),
        amount_cents,
        requested_by: requested_by.to_owned(),
    };
    let event = durastep::Event::new(Platform::Meta.event_name(), &req).idempotency_key(format!("shadow:{request_id}"));
    let receipt = engine.send(event).await?;
    receipt.run_ids.first().copied().ok_or_else(|| crate::Error::Usage("the shadow function is not registered".into()))
}
