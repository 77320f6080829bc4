//! Saturday 06:00 Europe/Amsterdam: one summary message to the on-call channel.

use std::sync::Arc;

use chrono::{DateTime, Utc};
use chrono_tz::Europe::Amsterdam;
use durastep::{CatchUp, CronTick, Ctx, Function, HandlerResult};

use super::Services;
use crate::store::{self, WeekSummary};

/// Saturday 06:00 (in Europe/Amsterdam).
pub const SUMMARY_CRON: &str = "0 6 * * SAT";

/// The summary function. After an outage of every worker, only the latest
/// missed Saturday is summarised.
pub fn saturday_summary(s: Arc<Services>) -> Function {
    Function::new("saturday-summary")
        .on_cron(SUMMARY_CRON, Amsterdam)
        .catch_up(CatchUp::Latest)
        .handler(move |ctx: Ctx, tick: CronTick| summarise(ctx, s.clone(), tick))
}

async fn summarise(ctx: Ctx, s: Arc<Services>, tick: CronTick) -> HandlerResult<WeekSummary> {
    let to = tick.scheduled_at;
    let from = to - chrono::Duration::days(7);
    let summary: WeekSummary =
        ctx.step("count", || async { Ok(store::week_summary(&s.pool, from, to).await?) }).await?;
    let text = summary_text(&summary, to);
    let channel = s.settings.on_call_channel.clone();
    ctx.step("post", || async move { s.api.chat.post(&channel, &text).await.map_err(|e| e.into_handler_error()) })
        .await?;
    Ok(summary)
}

/// The message: writes queued, pushed, retried, still open.
pub fn summary_text(s: &WeekSummary, week_to: DateTime<Utc>) -> String {
    format!(
        "Budget writes, week to {}: {} queued, {} pushed, {} retried, {} still open ({} failed, needing a person).",
        week_to.with_timezone(&Amsterdam).format("%a %d %b %H:%M %Z"),
        s.queued,
        s.pushed,
        s.retried,
        s.still_open,
        s.failed
    )
}
