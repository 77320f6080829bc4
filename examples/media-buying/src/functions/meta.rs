//! Meta budget update, on `campaign/budget.requested`: 6 at once per ad
//! account, 5 retries; steps `get-token`, `push`, `log`.

use std::sync::Arc;

use durastep::{Ctx, FailedRun, Function, HandlerError, HandlerResult};
use serde::{Deserialize, Serialize};

use super::{BudgetRequest, Credential, Platform, Pushed, Services, get_token, log_pushed, page_on_call, write_id};
use crate::CrashPoint;
use crate::platforms::ApiError;

/// What Meta's `push` step stores. A rejected token is a value, not an
/// error, so that the handler can refresh the token once and push again in
/// the same attempt, and every replay takes the same path.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum MetaPush {
    Pushed(Pushed),
    TokenRejected { message: String },
}

/// The Meta budget writer.
pub fn meta_budget_update(s: Arc<Services>) -> Function {
    let on_failure = s.clone();
    Function::new(Platform::Meta.function_id())
        .on_event(Platform::Meta.event_name())
        .concurrency(durastep::Concurrency::new(6).key("/account_id"))
        .retries(5)
        .on_failure(move |ctx: Ctx, failed: FailedRun<BudgetRequest>| page_on_call(ctx, on_failure.clone(), failed))
        .handler(move |ctx: Ctx, req: BudgetRequest| update(ctx, s.clone(), req))
}

async fn update(ctx: Ctx, s: Arc<Services>, req: BudgetRequest) -> HandlerResult<Pushed> {
    let write_id = write_id(&req)?;
    let run = ctx.idempotency_key();
    let now = ctx.db_time();
    // Rotates the token first when it expires within 7 days.
    let token: Credential = ctx
        .step("get-token", || get_token(&s, Platform::Meta, &req.account_id, false, now, format!("{run}:get-token")))
        .await?;
    // The same key on every attempt of this run: Meta applies the write once.
    let key = format!("{run}:push");
    let mut outcome: MetaPush = ctx.step("push", || push(&ctx, &s, &token, &req, &key)).await?;
    if let MetaPush::TokenRejected { message } = &outcome {
        // The store thought the token valid, Meta does not (expired early, or
        // rotated away under this run): refresh it once and push again.
        tracing::warn!(account_id = %req.account_id, %message, "Meta rejected the token; refreshing it");
        let now = ctx.db_time();
        let token: Credential = ctx
            .step("get-token", || {
                get_token(&s, Platform::Meta, &req.account_id, true, now, format!("{run}:get-token#2"))
            })
            .await?;
        outcome = ctx.step("push", || push(&ctx, &s, &token, &req, &key)).await?;
    }
    let pushed = match outcome {
        MetaPush::Pushed(p) => p,
        MetaPush::TokenRejected { message } => {
            return Err(HandlerError::permanent(format!("Meta rejected a freshly refreshed token: {message}")));
        }
    };
    if s.settings.crash_at == Some(CrashPoint::MetaBeforeLog) {
        eprintln!("MEDIA_BUYING_CRASH=meta-before-log: exiting after the push checkpoint, before the log");
        std::process::exit(137);
    }
    log_pushed(&ctx, write_id, &pushed).await?;
    Ok(pushed)
}

/// The body of a `push` step: one HTTP POST of the daily budget.
async fn push(ctx: &Ctx, s: &Services, token: &Credential, req: &BudgetRequest, key: &str) -> HandlerResult<MetaPush> {
    match s.api.meta.update_budget(&token.access_token, &req.campaign_id, req.amount_cents, key).await {
        Ok(write) => {
            if s.settings.crash_at == Some(CrashPoint::MetaPushSent) {
                eprintln!(
                    "MEDIA_BUYING_CRASH=meta-push-sent: exiting after Meta accepted the write, before its checkpoint"
                );
                std::process::exit(137);
            }
            Ok(MetaPush::Pushed(Pushed { external_ref: write.write_ref, pushed_at: ctx.db_time() }))
        }
        Err(ApiError::TokenRejected { message, .. }) => Ok(MetaPush::TokenRejected { message }),
        Err(e) => Err(e.into_handler_error()),
    }
}
