//! Meta system-user token rotation, on the first Monday of each quarter.
//!
//! Durable and all or nothing: one step per account issues its new token
//! (checkpointed, with an idempotency key, so a retry or a crash re-issues
//! nothing already issued); then one `step_tx` switches every account to its
//! new token in a single statement; only then are the old tokens revoked. A
//! rotation that fails or crashes half-way leaves every account on its old
//! token (still valid), and the retry finishes it.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use chrono_tz::Europe::Amsterdam;
use durastep::{CronTick, Ctx, Function, HandlerResult};
use serde::{Deserialize, Serialize};

use super::{Platform, Services};
use crate::platforms::NewToken;
use crate::store::{self, TokenRow};

/// 09:00 Europe/Amsterdam on the first Monday (`MON#1`, croner's "first
/// Monday of the month") of January, April, July and October.
pub const ROTATION_CRON: &str = "0 9 * 1,4,7,10 MON#1";

/// What a rotation run returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RotationReport {
    /// The fire time it ran for.
    pub scheduled_at: DateTime<Utc>,
    /// Accounts rotated.
    pub accounts: usize,
    /// Rows the switch changed.
    pub switched: u64,
}

/// The rotation function.
pub fn meta_token_rotation(s: Arc<Services>) -> Function {
    Function::new("meta-token-rotation")
        .on_cron(ROTATION_CRON, Amsterdam)
        .retries(5)
        .handler(move |ctx: Ctx, tick: CronTick| rotate(ctx, s.clone(), tick))
}

async fn rotate(ctx: Ctx, s: Arc<Services>, tick: CronTick) -> HandlerResult<RotationReport> {
    let old: Vec<TokenRow> =
        ctx.step("list-accounts", || async { Ok(store::tokens(&s.pool, Platform::Meta).await?) }).await?;
    let run = ctx.idempotency_key();
    // Stage: new tokens are issued and checkpointed, the store still has the old ones.
    let mut staged = Vec::with_capacity(old.len());
    for t in &old {
        let now = ctx.db_time();
        let key = format!("{run}:issue:{}", t.account_id);
        let new: NewToken = ctx
            .step(&format!("issue:{}", t.account_id), || async {
                s.api.meta.refresh_token(&t.refresh_token, &key, now).await.map_err(|e| e.into_handler_error())
            })
            .await?;
        staged.push((t.account_id.clone(), new.access_token, new.expires_at));
    }
    // Switch: every account at once, with the checkpoint.
    let accounts = staged.len();
    let switched: u64 =
        ctx.step_tx("switch", async move |conn| Ok(store::switch_tokens(conn, Platform::Meta, &staged).await?)).await?;
    // Only now may the old tokens stop working.
    ctx.step("revoke-old", || async {
        for t in &old {
            s.api.meta.revoke_token(&t.access_token).await.map_err(|e| e.into_handler_error())?;
        }
        Ok(old.len())
    })
    .await?;
    tracing::info!(accounts, switched, "Meta tokens rotated");
    Ok(RotationReport { scheduled_at: tick.scheduled_at, accounts, switched })
}
