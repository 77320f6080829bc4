//! The founder's view: budget writes grouped by platform and status, then
//! every write not pushed on its own row, with the original request and the
//! latest error, then the finance sheet's review queue (every flagged row
//! waiting for an accountant). `cargo run -p media-buying -- founder` prints it.

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use chrono_tz::Europe::Amsterdam;
use sqlx::PgPool;

use crate::store::finance::{self as finance, ReviewItem};
use crate::store::{self, OpenWrite, StatusCount};

/// The view, as loaded.
#[derive(Debug, Clone)]
pub struct FounderView {
    /// Writes by platform and status.
    pub by_status: Vec<StatusCount>,
    /// Every write not pushed.
    pub open: Vec<OpenWrite>,
    /// Imported finance rows by status.
    pub finance_rows: Vec<(String, i64)>,
    /// Every finance row waiting for an accountant.
    pub review: Vec<ReviewItem>,
    /// How long the two queries took.
    pub load_time: Duration,
}

/// Loads the view (four queries).
pub async fn load(pool: &PgPool) -> sqlx::Result<FounderView> {
    let started = Instant::now();
    let by_status = store::writes_by_status(pool).await?;
    let open = store::open_writes(pool).await?;
    let finance_rows = finance::rows_by_status(pool).await?;
    let review = finance::review_queue(pool).await?;
    Ok(FounderView { by_status, open, finance_rows, review, load_time: started.elapsed() })
}

use crate::units::euros;

fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max { s.to_owned() } else { format!("{}...", s.chars().take(max - 3).collect::<String>()) }
}

impl FounderView {
    /// The view as plain-text tables.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "Budget writes by platform and status");
        let _ = writeln!(out, "  {:<10} {:<8} {:>7} {:>16}", "platform", "status", "writes", "daily budgets");
        for c in &self.by_status {
            let _ = writeln!(out, "  {:<10} {:<8} {:>7} {:>16}", c.platform, c.status, c.writes, euros(c.amount_cents));
        }
        let _ =
            writeln!(out, "\nWrites not pushed ({}), with the original request and the latest error", self.open.len());
        if self.open.is_empty() {
            let _ = writeln!(out, "  (none)");
        } else {
            let _ = writeln!(
                out,
                "  {:>5} {:<9} {:<12} {:<14} {:<16} {:>13} {:<14} {:<17} {:<7} {:<9} {:>3}  latest error",
                "id",
                "platform",
                "account",
                "client",
                "campaign",
                "daily budget",
                "asked by",
                "asked at (AMS)",
                "status",
                "run",
                "att"
            );
        }
        for w in &self.open {
            let _ = writeln!(
                out,
                "  {:>5} {:<9} {:<12} {:<14} {:<16} {:>13} {:<14} {:<17} {:<7} {:<9} {:>3}  {}",
                w.id,
                w.platform,
                clip(&w.account_id, 12),
                clip(&w.client, 14),
                clip(&w.campaign_id, 16),
                euros(w.amount_cents),
                clip(&w.requested_by, 14),
                w.requested_at.with_timezone(&Amsterdam).format("%a %d %b %H:%M"),
                w.status,
                w.run_state.as_deref().unwrap_or("-"),
                w.attempts.map_or_else(|| "-".to_owned(), |a| a.to_string()),
                clip(w.latest_error.as_deref().unwrap_or("-"), 140),
            );
        }
        self.render_review(&mut out);
        let _ = writeln!(out, "\n(loaded in {})", crate::units::human(self.load_time));
        out
    }
}

impl FounderView {
    fn render_review(&self, out: &mut String) {
        if self.finance_rows.is_empty() {
            return;
        }
        let counts: Vec<String> = self.finance_rows.iter().map(|(status, n)| format!("{n} {status}")).collect();
        let _ = writeln!(out, "\nFinance sheet import: {}", counts.join(", "));
        let _ = writeln!(
            out,
            "Rows waiting for an accountant ({}): `media-buying review <id> approve|correct --amount EUR --by NAME`",
            self.review.len()
        );
        if self.review.is_empty() {
            let _ = writeln!(out, "  (none)");
            return;
        }
        let _ = writeln!(
            out,
            "  {:>5} {:<22} {:<9} {:<16} {:>12} {:>13} {:<17} {:<8}  why",
            "id", "file, row", "platform", "campaign", "sheet", "store", "since (AMS)", "review"
        );
        for r in &self.review {
            let _ = writeln!(
                out,
                "  {:>5} {:<22} {:<9} {:<16} {:>12} {:>13} {:<17} {:<8}  {}",
                r.id,
                clip(&format!("{} #{}", r.file_name, r.row_no), 22),
                clip(&r.platform, 9),
                clip(&r.campaign, 16),
                clip(&r.daily_budget, 12),
                r.store_cents.map_or_else(|| "-".to_owned(), euros),
                r.imported_at.with_timezone(&Amsterdam).format("%a %d %b %H:%M"),
                r.review_state.as_deref().unwrap_or("starting"),
                clip(&r.reason, 100),
            );
        }
    }
}
