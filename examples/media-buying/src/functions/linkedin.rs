//! LinkedIn budget update: 2 at once per account, at most 100 starts per
//! minute per account (a throttle: runs over it wait, none is dropped),
//! back-pressure on 429, 8 retries; when they run out, one on-call message.

use std::sync::Arc;
use std::time::Duration;

use durastep::{Ctx, FailedRun, Function, HandlerResult};

use super::{BudgetRequest, Credential, Platform, Pushed, Services, get_token, log_pushed, page_on_call, write_id};

/// The LinkedIn budget writer.
pub fn linkedin_budget_update(s: Arc<Services>) -> Function {
    let on_failure = s.clone();
    Function::new(Platform::LinkedIn.function_id())
        .on_event(Platform::LinkedIn.event_name())
        .concurrency(durastep::Concurrency::new(2).key("/account_id"))
        .throttle(durastep::Throttle::new(100, Duration::from_secs(60)).key("/account_id"))
        // A 429's Retry-After pauses the whole account, not just the run that
        // got it; such retries do not use up the 8 (Durastep's
        // BACKPRESSURE_FREE_RETRIES), which stay for real failures.
        .backpressure(durastep::Backpressure::new().key("/account_id"))
        .retries(8)
        .on_failure(move |ctx: Ctx, failed: FailedRun<BudgetRequest>| page_on_call(ctx, on_failure.clone(), failed))
        .handler(move |ctx: Ctx, req: BudgetRequest| update(ctx, s.clone(), req))
}

async fn update(ctx: Ctx, s: Arc<Services>, req: BudgetRequest) -> HandlerResult<Pushed> {
    let write_id = write_id(&req)?;
    let run = ctx.idempotency_key();
    let now = ctx.db_time();
    let token: Credential = ctx
        .step("get-token", || {
            get_token(&s, Platform::LinkedIn, &req.account_id, false, now, format!("{run}:get-token"))
        })
        .await?;
    let key = format!("{run}:push");
    let pushed: Pushed = ctx
        .step("push", || async {
            // A 429 becomes HandlerError::retry_after(Retry-After): back-pressure.
            let external_ref = s
                .api
                .linkedin
                .update_budget(&token.access_token, &req.account_id, &req.campaign_id, req.amount_cents, &key)
                .await
                .map_err(|e| e.into_handler_error())?;
            Ok(Pushed { external_ref, pushed_at: ctx.db_time() })
        })
        .await?;
    log_pushed(&ctx, write_id, &pushed).await?;
    Ok(pushed)
}
