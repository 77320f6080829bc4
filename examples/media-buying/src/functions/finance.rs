//! The one-off import of the finance sheet (Story B's last line): a durable
//! import of a CSV export, row by row, against `media.budget_writes`; rows
//! that do not match go to a review queue where an accountant approves or
//! corrects each one.
//!
//! - `finance-import`, on `finance/sheet.imported`: one `step_tx` per row
//!   (`row-<n>`), which matches the row and inserts it into
//!   `media.finance_rows` in the checkpoint's own transaction: a crash between
//!   rows resumes after the last imported row, and no row is ever imported
//!   twice. A flagged row sends `finance/row.flagged` (a step, keyed by the
//!   row), which starts one review run for it.
//! - `finance-row-review`, on `finance/row.flagged`: records its run on the
//!   row, then waits durably (no worker held) for the accountant's
//!   `finance/review.decided` for that row, up to the review period, and
//!   applies the decision in a `step_tx`.
//!
//! The same file imported twice is one import (`store::finance::import_sheet`
//! keys it by its sha256); a row already imported by an earlier file (same
//! platform and reference) is recorded as a duplicate and matched to nothing.

use std::sync::Arc;
use std::time::Duration;

use durastep::{Concurrency, Ctx, Event, EventMatch, Function, HandlerError, HandlerResult, WaitFor};
use serde::{Deserialize, Serialize};

use super::Services;
use crate::CrashPoint;
use crate::store::finance::{self as store, RowVerdict};

/// The event that starts an import (sent by `store::finance::import_sheet`).
pub const IMPORT_EVENT: &str = "finance/sheet.imported";
/// The event a flagged row sends: it starts that row's review run.
pub const FLAGGED_EVENT: &str = "finance/row.flagged";
/// The accountant's decision on a flagged row (sent by `store::finance::decide`).
pub const DECISION_EVENT: &str = "finance/review.decided";
/// How long a flagged row waits for an accountant before it is `expired`.
pub const REVIEW_PERIOD: Duration = Duration::from_secs(30 * 86_400);

/// The payload of [`IMPORT_EVENT`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImportRequest {
    /// The `media.finance_imports` row.
    pub import_id: i64,
}

/// The payload of [`FLAGGED_EVENT`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FlaggedRow {
    /// The `media.finance_rows` row.
    pub row_id: i64,
    /// Its import.
    pub import_id: i64,
    /// Its row number in the sheet (1 is the first row under the header).
    pub row_no: u32,
}

/// What an accountant decides about a flagged row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum Decision {
    /// The row is right as it is.
    Approve,
    /// The row's daily budget should have been this.
    Correct {
        /// The corrected daily budget, in cents.
        amount_cents: i64,
    },
}

/// The payload of [`DECISION_EVENT`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReviewDecision {
    /// The flagged row.
    pub row_id: i64,
    /// What to do with it.
    pub decision: Decision,
    /// Who decided.
    pub by: String,
    /// Why, in the accountant's words.
    pub note: Option<String>,
}

/// What an import run returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ImportReport {
    /// Rows read.
    pub rows: u32,
    /// Rows that are a budget write.
    pub matched: u32,
    /// Rows an earlier import already holds.
    pub duplicates: u32,
    /// Rows sent to the review queue.
    pub flagged: u32,
}

/// What a review run returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum ReviewOutcome {
    /// Approved as it is.
    Approved {
        /// By whom.
        by: String,
    },
    /// Corrected.
    Corrected {
        /// By whom.
        by: String,
        /// The corrected daily budget.
        amount_cents: i64,
    },
    /// Nobody decided within [`REVIEW_PERIOD`].
    Expired,
}

/// The import function.
pub fn finance_import(s: Arc<Services>) -> Function {
    Function::new("finance-import")
        .on_event(IMPORT_EVENT)
        // One import at a time: a row is matched against the rows of earlier
        // imports, so two imports must not match the same row at once.
        .concurrency(Concurrency::new(1))
        .retries(5)
        .handler(move |ctx: Ctx, req: ImportRequest| import(ctx, s.clone(), req))
}

async fn import(ctx: Ctx, s: Arc<Services>, req: ImportRequest) -> HandlerResult<ImportReport> {
    // The stored file never changes: every attempt reads the same rows.
    let csv = store::import_csv(&s.pool, req.import_id)
        .await?
        .ok_or_else(|| HandlerError::permanent(format!("no finance import #{}", req.import_id)))?;
    let rows = store::parse_sheet(&csv).map_err(|e| HandlerError::permanent(e.to_string()))?;
    let mut report = ImportReport::default();
    for row in rows {
        report.rows += 1;
        let row_no = row.row_no;
        let import_id = req.import_id;
        let verdict: RowVerdict = ctx
            .step_tx(&format!("row-{row_no}"), async move |conn| Ok(store::import_row(conn, import_id, &row).await?))
            .await?;
        match verdict {
            RowVerdict::Matched { .. } => report.matched += 1,
            RowVerdict::Duplicate { .. } => report.duplicates += 1,
            RowVerdict::Flagged { row_id, .. } => {
                report.flagged += 1;
                let flagged = FlaggedRow { row_id, import_id, row_no };
                let event = Event::new(FLAGGED_EVENT, &flagged).idempotency_key(format!("finance-row:{row_id}"));
                ctx.send_event(&format!("review-{row_no}"), event).await?;
            }
        }
        if s.settings.crash_at == Some(CrashPoint::FinanceAfterRow(row_no)) {
            eprintln!("MEDIA_BUYING_CRASH=finance-after-row-{row_no}: exiting after the row's checkpoint");
            std::process::exit(137);
        }
    }
    Ok(report)
}

/// The review function: one run per flagged row.
pub fn finance_row_review(s: Arc<Services>) -> Function {
    Function::new("finance-row-review")
        .on_event(FLAGGED_EVENT)
        .retries(5)
        .handler(move |ctx: Ctx, row: FlaggedRow| review(ctx, s.clone(), row))
}

async fn review(ctx: Ctx, s: Arc<Services>, row: FlaggedRow) -> HandlerResult<ReviewOutcome> {
    let run_id = ctx.run_id();
    let row_id = row.row_id;
    ctx.step_tx("open", async move |conn| Ok(store::open_review(conn, row_id, run_id).await?)).await?;
    // `store::finance::decide` sends the decision only while this run is
    // `waiting`, so the decision always commits after the wait is recorded.
    let decision: Option<ReviewDecision> = ctx
        .wait_for_event(
            "decision",
            WaitFor::event(DECISION_EVENT)
                .matching(EventMatch::field("/row_id", &row_id))
                .timeout(s.settings.review_period),
        )
        .await?;
    let outcome = match decision.clone() {
        Some(d) => ReviewOutcome::from(d),
        None => ReviewOutcome::Expired,
    };
    ctx.step_tx("apply", async move |conn| Ok(store::apply_review(conn, row_id, decision.as_ref()).await?)).await?;
    Ok(outcome)
}

impl From<ReviewDecision> for ReviewOutcome {
    fn from(d: ReviewDecision) -> ReviewOutcome {
        match d.decision {
            Decision::Approve => ReviewOutcome::Approved { by: d.by },
            Decision::Correct { amount_cents } => ReviewOutcome::Corrected { by: d.by, amount_cents },
        }
    }
}
