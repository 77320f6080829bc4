//! The finance import's SQL: the imported files, their rows, matching a row
//! against `media.budget_writes`, and the review queue.

use chrono::{DateTime, NaiveDate, Utc};
use durastep::{Engine, Event, RunState};
use serde::{Deserialize, Serialize};
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use crate::Platform;
use crate::functions::finance::{DECISION_EVENT, Decision, IMPORT_EVENT, ImportRequest, ReviewDecision, ReviewOutcome};

/// The columns the finance sheet's CSV export must have (any order, more are ignored).
pub const SHEET_COLUMNS: [&str; 7] = ["date", "client", "platform", "account", "campaign", "daily_budget", "reference"];

/// A sheet that cannot be imported at all (nothing is stored).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SheetError {
    /// The header lacks a column.
    #[error("the finance sheet has no column {0:?} (it needs {cols})", cols = SHEET_COLUMNS.join(", "))]
    MissingColumn(String),
    /// The file is not CSV.
    #[error("the finance sheet is not readable CSV: {0}")]
    Csv(String),
}

/// A decision that cannot be taken (nothing is sent).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReviewError {
    /// No such row.
    #[error("no finance row #{0}")]
    NoSuchRow(i64),
    /// The row is not waiting for a review.
    #[error("finance row #{row_id} is {status}, not waiting for a review")]
    NotFlagged {
        /// The row.
        row_id: i64,
        /// Its status.
        status: String,
    },
    /// The row's review run has not started waiting yet.
    #[error("the review of finance row #{0} is not open yet (its run has not started); try again in a moment")]
    NotOpenYet(i64),
    /// A correction to a budget that is not positive.
    #[error("a corrected daily budget must be more than 0 cents, not {0}")]
    BadAmount(i64),
}

/// One row of the sheet, as read (every field as text: a row that does not
/// parse is flagged for review, not refused).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SheetRow {
    /// 1 for the first row under the header.
    pub row_no: u32,
    /// The day the budget applied, `YYYY-MM-DD` or `DD-MM-YYYY`.
    pub date: String,
    /// The client.
    pub client: String,
    /// `meta`, `tiktok` or `linkedin` (any case).
    pub platform: String,
    /// The ad account.
    pub account: String,
    /// The campaign.
    pub campaign: String,
    /// The daily budget in euros, `25.00` or `25,00`.
    pub daily_budget: String,
    /// The platform's reference of the write, when finance copied it.
    pub reference: String,
}

/// Reads the CSV export: a header with [`SHEET_COLUMNS`] (any order, any
/// case), then one row per budget write. Blank lines are skipped.
///
/// ```
/// let rows = media_buying::store::finance::parse_sheet(
///     "date,client,platform,account,campaign,daily_budget,reference\n2026-11-27,acme,Meta,act_1,c_1,\"25,00\",w-1\n",
/// ).unwrap();
/// assert_eq!(rows[0].daily_budget, "25,00");
/// ```
pub fn parse_sheet(csv_text: &str) -> Result<Vec<SheetRow>, SheetError> {
    let mut reader = csv::ReaderBuilder::new().flexible(true).trim(csv::Trim::All).from_reader(csv_text.as_bytes());
    let headers = reader.headers().map_err(|e| SheetError::Csv(e.to_string()))?.clone();
    let mut index = [0usize; 7];
    for (i, col) in SHEET_COLUMNS.iter().enumerate() {
        index[i] = headers
            .iter()
            .position(|h| h.trim_start_matches('\u{feff}').eq_ignore_ascii_case(col))
            .ok_or_else(|| SheetError::MissingColumn((*col).to_owned()))?;
    }
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|e| SheetError::Csv(e.to_string()))?;
        if record.iter().all(str::is_empty) {
            continue;
        }
        let field = |i: usize| record.get(index[i]).unwrap_or("").to_owned();
        rows.push(SheetRow {
            row_no: u32::try_from(rows.len() + 1).unwrap_or(u32::MAX),
            date: field(0),
            client: field(1),
            platform: field(2),
            account: field(3),
            campaign: field(4),
            daily_budget: field(5),
            reference: field(6),
        });
    }
    Ok(rows)
}

/// Euros as written in the sheet (`25`, `25.5`, `25.00`, `25,00`, `1.250,00`, `EUR 25`) to cents.
///
/// ```
/// use media_buying::store::finance::parse_euros;
/// assert_eq!(parse_euros("25,00"), Some(2_500));
/// assert_eq!(parse_euros("1.250,50"), Some(125_050));
/// assert_eq!(parse_euros("abc"), None);
/// ```
pub fn parse_euros(text: &str) -> Option<i64> {
    let t = text.trim().trim_start_matches("EUR").trim_start_matches('€').trim();
    // The last ',' or '.' followed by 1-2 digits is the decimal separator; the other is grouping.
    let (whole, frac) = match t.rfind([',', '.']) {
        Some(i) if t.len() - i - 1 <= 2 && t.len() - i > 1 => (&t[..i], &t[i + 1..]),
        _ => (t, ""),
    };
    let whole: String = whole.chars().filter(|c| *c != '.' && *c != ',' && *c != ' ').collect();
    if whole.is_empty() || !whole.chars().all(|c| c.is_ascii_digit()) || !frac.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let cents = match frac.len() {
        0 => 0,
        1 => frac.parse::<i64>().ok()? * 10,
        _ => frac.parse::<i64>().ok()?,
    };
    whole.parse::<i64>().ok()?.checked_mul(100)?.checked_add(cents)
}

fn parse_date(text: &str) -> Option<NaiveDate> {
    NaiveDate::parse_from_str(text.trim(), "%Y-%m-%d")
        .or_else(|_| NaiveDate::parse_from_str(text.trim(), "%d-%m-%Y"))
        .ok()
}

fn parse_platform(text: &str) -> Option<Platform> {
    Platform::ALL.into_iter().find(|p| p.as_str().eq_ignore_ascii_case(text.trim()))
}

/// What importing one row did (the `row-<n>` step's result).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum RowVerdict {
    /// The row is this budget write.
    Matched {
        /// The `media.finance_rows` row.
        row_id: i64,
        /// The budget write.
        budget_write_id: i64,
    },
    /// An earlier row (of this or an earlier import) holds the same write.
    Duplicate {
        /// The `media.finance_rows` row.
        row_id: i64,
        /// The earlier row.
        of_row: i64,
    },
    /// The row does not match; it waits for an accountant.
    Flagged {
        /// The `media.finance_rows` row.
        row_id: i64,
        /// Why.
        reason: String,
    },
}

/// A file as imported.
#[derive(Debug, Clone, PartialEq)]
pub struct Imported {
    /// The `media.finance_imports` row.
    pub import_id: i64,
    /// The run that imports it.
    pub run_id: Option<Uuid>,
    /// Its rows.
    pub rows: usize,
    /// `true` when the same file (same sha256) was imported before: nothing new was stored or started.
    pub already_imported: bool,
}

/// Stores a CSV export and sends the event that starts its import run, in
/// one transaction. A file that is not an importable sheet is refused and
/// nothing is stored; the same content imported again returns the first
/// import (`already_imported`) and starts nothing.
pub async fn import_sheet(
    engine: &Engine,
    pool: &PgPool,
    file_name: &str,
    csv_text: &str,
) -> Result<Imported, crate::Error> {
    let rows = parse_sheet(csv_text)?.len();
    let mut tx = pool.begin().await?;
    let inserted: Option<i64> = sqlx::query_scalar(
        "INSERT INTO media.finance_imports (file_name, sha256, csv, row_count)
         VALUES ($1, encode(sha256(convert_to($2, 'UTF8')), 'hex'), $2, $3)
         ON CONFLICT (sha256) DO NOTHING RETURNING id",
    )
    .bind(file_name)
    .bind(csv_text)
    .bind(i32::try_from(rows).unwrap_or(i32::MAX))
    .fetch_optional(&mut *tx)
    .await?;
    let Some(import_id) = inserted else {
        let (import_id, run_id): (i64, Option<Uuid>) = sqlx::query_as(
            "SELECT id, run_id FROM media.finance_imports WHERE sha256 = encode(sha256(convert_to($1, 'UTF8')), 'hex')",
        )
        .bind(csv_text)
        .fetch_one(&mut *tx)
        .await?;
        return Ok(Imported { import_id, run_id, rows, already_imported: true });
    };
    let event =
        Event::new(IMPORT_EVENT, &ImportRequest { import_id }).idempotency_key(format!("finance-import:{import_id}"));
    let run_id = engine.send_in(&mut tx, event).await?.run_ids.first().copied();
    sqlx::query("UPDATE media.finance_imports SET run_id = $2 WHERE id = $1")
        .bind(import_id)
        .bind(run_id)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(Imported { import_id, run_id, rows, already_imported: false })
}

/// The stored CSV of an import.
pub async fn import_csv(pool: &PgPool, import_id: i64) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT csv FROM media.finance_imports WHERE id = $1").bind(import_id).fetch_optional(pool).await
}

/// The identity of a row across imports: the platform's reference when the
/// sheet has one, else the row's normalized text.
fn row_key(row: &SheetRow) -> String {
    let platform = row.platform.trim().to_lowercase();
    if row.reference.trim().is_empty() {
        format!(
            "{platform}|{}|{}|{}|{}",
            row.date.trim(),
            row.account.trim(),
            row.campaign.trim(),
            parse_euros(&row.daily_budget).map_or_else(|| row.daily_budget.trim().to_owned(), |c| c.to_string())
        )
    } else {
        format!("{platform}:{}", row.reference.trim())
    }
}

/// Imports one row inside the `row-<n>` step's transaction: matches it against
/// `media.budget_writes` and inserts it into `media.finance_rows` as matched,
/// duplicate or flagged.
pub async fn import_row(conn: &mut PgConnection, import_id: i64, row: &SheetRow) -> sqlx::Result<RowVerdict> {
    let key = row_key(row);
    let sheet = serde_json::to_value(row).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let earlier: Option<i64> = sqlx::query_scalar(
        "SELECT id FROM media.finance_rows
          WHERE row_key = $1 AND status <> 'duplicate' AND (import_id <> $2 OR row_no < $3)
          ORDER BY id LIMIT 1",
    )
    .bind(&key)
    .bind(import_id)
    .bind(row.row_no as i32)
    .fetch_optional(&mut *conn)
    .await?;
    let sheet_cents = parse_euros(&row.daily_budget);
    let (status, write, store_cents, reason) = match earlier {
        Some(_) => ("duplicate", None, None, None),
        None => match_row(conn, row, sheet_cents).await?,
    };
    let row_id: i64 = sqlx::query_scalar(
        "INSERT INTO media.finance_rows
             (import_id, row_no, row_key, sheet, sheet_cents, budget_write_id, store_cents, status, reason)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) RETURNING id",
    )
    .bind(import_id)
    .bind(row.row_no as i32)
    .bind(&key)
    .bind(sheet)
    .bind(sheet_cents)
    .bind(write)
    .bind(store_cents)
    .bind(status)
    .bind(&reason)
    .fetch_one(&mut *conn)
    .await?;
    Ok(match (earlier, write, reason) {
        (Some(of_row), _, _) => RowVerdict::Duplicate { row_id, of_row },
        (None, Some(budget_write_id), None) => RowVerdict::Matched { row_id, budget_write_id },
        (None, _, reason) => RowVerdict::Flagged { row_id, reason: reason.unwrap_or_default() },
    })
}

type Match = (&'static str, Option<i64>, Option<i64>, Option<String>);

fn flagged(write: Option<i64>, store_cents: Option<i64>, reason: String) -> Match {
    ("flagged", write, store_cents, Some(reason))
}

async fn match_row(conn: &mut PgConnection, row: &SheetRow, sheet_cents: Option<i64>) -> sqlx::Result<Match> {
    let Some(platform) = parse_platform(&row.platform) else {
        return Ok(flagged(None, None, format!("unknown platform {:?}", row.platform)));
    };
    let Some(cents) = sheet_cents.filter(|c| *c > 0) else {
        return Ok(flagged(None, None, format!("unreadable daily budget {:?}", row.daily_budget)));
    };
    let euros = crate::units::euros;
    if !row.reference.trim().is_empty() {
        let found: Option<(i64, String, i64)> = sqlx::query_as(
            "SELECT id, campaign_id, amount_cents FROM media.budget_writes WHERE platform = $1 AND external_ref = $2",
        )
        .bind(platform.as_str())
        .bind(row.reference.trim())
        .fetch_optional(&mut *conn)
        .await?;
        return Ok(match found {
            None => flagged(None, None, format!("no pushed budget write has reference {:?}", row.reference.trim())),
            Some((id, campaign, store)) if campaign != row.campaign.trim() => flagged(
                Some(id),
                Some(store),
                format!(
                    "reference {} is campaign {campaign} in the store, {} in the sheet",
                    row.reference.trim(),
                    row.campaign
                ),
            ),
            Some((id, _, store)) if store != cents => {
                flagged(Some(id), Some(store), format!("the sheet says {}, the store {}", euros(cents), euros(store)))
            }
            Some((id, _, store)) => match claimed_by(conn, id).await? {
                Some(row) => {
                    flagged(Some(id), Some(store), format!("budget write #{id} is already finance row #{row}"))
                }
                None => ("matched", Some(id), Some(store), None),
            },
        });
    }
    let Some(date) = parse_date(&row.date) else {
        return Ok(flagged(None, None, format!("no reference and an unreadable date {:?}", row.date)));
    };
    // No reference: a pushed write of the campaign on that day (Amsterdam),
    // not yet claimed by another row, preferring one of the same amount.
    let found: Option<(i64, i64)> = sqlx::query_as(
        "SELECT w.id, w.amount_cents FROM media.budget_writes w
          WHERE w.platform = $1 AND w.campaign_id = $2 AND w.status = 'pushed'
            AND (w.pushed_at AT TIME ZONE 'Europe/Amsterdam')::date = $3
            AND NOT EXISTS (SELECT 1 FROM media.finance_rows f WHERE f.budget_write_id = w.id)
          ORDER BY (w.amount_cents = $4) DESC, w.id LIMIT 1",
    )
    .bind(platform.as_str())
    .bind(row.campaign.trim())
    .bind(date)
    .bind(cents)
    .fetch_optional(&mut *conn)
    .await?;
    Ok(match found {
        None => flagged(None, None, format!("no pushed budget write for campaign {} on {date}", row.campaign.trim())),
        Some((id, store)) if store != cents => {
            flagged(Some(id), Some(store), format!("the sheet says {}, the store {}", euros(cents), euros(store)))
        }
        Some((id, store)) => ("matched", Some(id), Some(store), None),
    })
}

/// The finance row already matched to a budget write, if any.
async fn claimed_by(conn: &mut PgConnection, budget_write_id: i64) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar("SELECT id FROM media.finance_rows WHERE budget_write_id = $1 AND status = 'matched'")
        .bind(budget_write_id)
        .fetch_optional(conn)
        .await
}

/// The review run's `open` step: records the run on its row.
pub async fn open_review(conn: &mut PgConnection, row_id: i64, run_id: Uuid) -> sqlx::Result<u64> {
    let done = sqlx::query("UPDATE media.finance_rows SET review_run_id = $2 WHERE id = $1")
        .bind(row_id)
        .bind(run_id)
        .execute(conn)
        .await?;
    Ok(done.rows_affected())
}

/// The review run's `apply` step: the decision (or its absence) on the row.
pub async fn apply_review(
    conn: &mut PgConnection,
    row_id: i64,
    decision: Option<&ReviewDecision>,
) -> sqlx::Result<u64> {
    let (status, corrected, by, note) = match decision {
        None => ("expired", None, None, None),
        Some(d) => match d.decision {
            Decision::Approve => ("approved", None, Some(d.by.as_str()), d.note.as_deref()),
            Decision::Correct { amount_cents } => {
                ("corrected", Some(amount_cents), Some(d.by.as_str()), d.note.as_deref())
            }
        },
    };
    let done = sqlx::query(
        "UPDATE media.finance_rows
            SET status = $2, corrected_cents = $3, decided_by = $4, note = $5, decided_at = durastep.now()
          WHERE id = $1 AND status = 'flagged'",
    )
    .bind(row_id)
    .bind(status)
    .bind(corrected)
    .bind(by)
    .bind(note)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// An accountant's decision on a flagged row: sent only while the row's
/// review run is waiting for it (so it always commits after the wait and is
/// never lost), and keyed by the row, so a second click is one decision.
pub async fn decide(engine: &Engine, pool: &PgPool, decision: ReviewDecision) -> Result<Uuid, crate::Error> {
    if let Decision::Correct { amount_cents } = decision.decision
        && amount_cents <= 0
    {
        return Err(ReviewError::BadAmount(amount_cents).into());
    }
    let row: Option<(String, Option<Uuid>)> =
        sqlx::query_as("SELECT status, review_run_id FROM media.finance_rows WHERE id = $1")
            .bind(decision.row_id)
            .fetch_optional(pool)
            .await?;
    let row_id = decision.row_id;
    let (status, run) = row.ok_or(ReviewError::NoSuchRow(row_id))?;
    if status != "flagged" {
        return Err(ReviewError::NotFlagged { row_id, status }.into());
    }
    let run = run.ok_or(ReviewError::NotOpenYet(row_id))?;
    if engine.run(run).await?.state != RunState::Waiting {
        return Err(ReviewError::NotOpenYet(row_id).into());
    }
    engine.send(Event::new(DECISION_EVENT, &decision).idempotency_key(format!("finance-decision:{row_id}"))).await?;
    Ok(run)
}

/// A row in the review queue, for the founder's view.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct ReviewItem {
    /// The row (the id an accountant decides on).
    pub id: i64,
    /// The file it came from.
    pub file_name: String,
    /// Its row number in the sheet.
    pub row_no: i32,
    /// The sheet's platform, campaign and daily budget, as written.
    pub platform: String,
    /// The sheet's campaign.
    pub campaign: String,
    /// The sheet's daily budget, as written.
    pub daily_budget: String,
    /// The store's amount, when a write was found.
    pub store_cents: Option<i64>,
    /// Why it was flagged.
    pub reason: String,
    /// When it was imported.
    pub imported_at: DateTime<Utc>,
    /// Its review run's state (`waiting` while it waits for the accountant).
    pub review_state: Option<String>,
}

/// Every flagged row, oldest first.
pub async fn review_queue(pool: &PgPool) -> sqlx::Result<Vec<ReviewItem>> {
    sqlx::query_as(
        "SELECT f.id, i.file_name, f.row_no, f.sheet->>'platform' AS platform, f.sheet->>'campaign' AS campaign,
                f.sheet->>'daily_budget' AS daily_budget, f.store_cents, coalesce(f.reason, '') AS reason,
                f.imported_at, r.state AS review_state
           FROM media.finance_rows f
           JOIN media.finance_imports i ON i.id = f.import_id
           LEFT JOIN durastep.runs r ON r.id = f.review_run_id
          WHERE f.status = 'flagged'
          ORDER BY f.imported_at, f.id",
    )
    .fetch_all(pool)
    .await
}

/// Imported rows by status (`matched`, `duplicate`, `flagged`, `approved`, `corrected`, `expired`).
pub async fn rows_by_status(pool: &PgPool) -> sqlx::Result<Vec<(String, i64)>> {
    sqlx::query_as("SELECT status, count(*) FROM media.finance_rows GROUP BY status ORDER BY status")
        .fetch_all(pool)
        .await
}

/// The outcome an accountant's decision leads to (for messages).
pub fn describe(outcome: &ReviewOutcome) -> String {
    match outcome {
        ReviewOutcome::Approved { by } => format!("approved by {by}"),
        ReviewOutcome::Corrected { by, amount_cents } => {
            format!("corrected to {} by {by}", crate::units::euros(*amount_cents))
        }
        ReviewOutcome::Expired => "expired without a decision".to_owned(),
    }
}
