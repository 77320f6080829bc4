//! Story B's last line: "a one-off import of the finance sheet row by row,
//! flagging rows that do not match the API record into a review queue". The
//! import is a durable run (one `step_tx` per row); each flagged row gets a
//! review run that waits for the accountant's decision; the same file twice,
//! or a row already imported, is never imported again.

mod common;

use common::World;
use durastep::RunState;
use media_buying::Platform;
use media_buying::functions::finance::{Decision, ImportReport, ReviewDecision, ReviewOutcome};
use media_buying::store::finance::{self, ReviewError};
use media_buying::{Error, founder};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const HEADER: &str = "date,client,platform,account,campaign,daily_budget,reference\n";

/// Three Meta writes pushed; returns their (campaign, amount, external ref, Amsterdam date).
async fn pushed_writes(w: &World) -> Vec<(String, i64, String, String)> {
    w.account(Platform::Meta, "act_1").await;
    let worker = common::worker(&w.engine);
    let mut runs = Vec::new();
    for (campaign, cents) in [("c_1", 2_500), ("c_2", 4_000), ("c_3", 1_250)] {
        runs.push(w.request(Platform::Meta, "act_1", campaign, cents).await.1);
    }
    w.drive(&runs).await;
    worker.stop().await;
    sqlx::query_as(
        "SELECT campaign_id, amount_cents, external_ref, to_char(pushed_at AT TIME ZONE 'Europe/Amsterdam', 'YYYY-MM-DD')
           FROM media.budget_writes ORDER BY campaign_id",
    )
    .fetch_all(&w.pool)
    .await
    .unwrap()
}

async fn statuses(w: &World) -> Vec<(i32, String)> {
    sqlx::query_as("SELECT row_no, status FROM media.finance_rows ORDER BY import_id, row_no")
        .fetch_all(&w.pool)
        .await
        .unwrap()
}

async fn row_id(w: &World, row_no: i32) -> i64 {
    sqlx::query_scalar("SELECT id FROM media.finance_rows WHERE row_no = $1 ORDER BY import_id LIMIT 1")
        .bind(row_no)
        .fetch_one(&w.pool)
        .await
        .unwrap()
}

#[sqlx::test(migrations = false)]
async fn rows_are_matched_or_flagged_and_an_accountant_decides_each_flagged_one(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let w = common::world(opts).await;
    let writes = pushed_writes(&w).await;
    let (c1, c2, c3) = (&writes[0], &writes[1], &writes[2]);
    let csv = format!(
        "{HEADER}\
         {d},client of act_1,Meta,act_1,c_1,\"25,00\",{r1}\n\
         {d},client of act_1,meta,act_1,c_2,45.00,{r2}\n\
         {d},client of act_1,Meta,act_1,c_9,10.00,nosuchref\n\
         {d3},client of act_1,Meta,act_1,c_3,12.50,\n\
         {d},client of act_1,Meta,act_1,c_1,twenty,\n\
         {d},client of act_1,Meta,act_1,c_1,25.00,{r1}\n",
        d = c1.3,
        d3 = c3.3,
        r1 = c1.2,
        r2 = c2.2,
    );
    let imported = finance::import_sheet(&w.engine, &w.pool, "finance-nov.csv", &csv).await.unwrap();
    assert!(!imported.already_imported);
    assert_eq!(imported.rows, 6);
    let worker = common::worker(&w.engine);
    let run = w.finished(imported.run_id.unwrap()).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    let report: ImportReport = serde_json::from_value(run.output.unwrap()).unwrap();
    assert_eq!(report, ImportReport { rows: 6, matched: 2, duplicates: 1, flagged: 3 });
    assert_eq!(
        statuses(&w).await,
        [
            (1, "matched".to_owned()),
            (2, "flagged".to_owned()),
            (3, "flagged".to_owned()),
            (4, "matched".to_owned()),
            (5, "flagged".to_owned()),
            (6, "duplicate".to_owned()),
        ]
    );

    // One review run per flagged row, each waiting; the founder sees the queue.
    let reviews = w.runs_of("finance-row-review").await;
    assert_eq!(reviews.len(), 3);
    for r in &reviews {
        w.reaches(*r, RunState::Waiting).await;
    }
    let view = founder::load(&w.pool).await.unwrap();
    assert_eq!(view.review.len(), 3);
    assert!(view.review.iter().all(|r| r.review_state.as_deref() == Some("waiting")), "{:?}", view.review);
    let text = view.render();
    assert!(text.contains("Rows waiting for an accountant (3)"), "{text}");
    assert!(text.contains("the sheet says EUR 45.00, the store EUR 40.00"), "{text}");
    assert!(text.contains("no pushed budget write has reference \"nosuchref\""), "{text}");
    assert!(text.contains("unreadable daily budget \"twenty\""), "{text}");

    // The accountant: row 2 approved, row 3 corrected; row 5 left alone.
    let decide = |row_id, decision| ReviewDecision { row_id, decision, by: "anna@finance".into(), note: None };
    let (r2, r3, r5) = (row_id(&w, 2).await, row_id(&w, 3).await, row_id(&w, 5).await);
    finance::decide(&w.engine, &w.pool, decide(r2, Decision::Approve)).await.unwrap();
    finance::decide(&w.engine, &w.pool, decide(r3, Decision::Correct { amount_cents: 1_000 })).await.unwrap();
    let bad = finance::decide(&w.engine, &w.pool, decide(r5, Decision::Correct { amount_cents: 0 })).await;
    assert!(matches!(bad, Err(Error::Review(ReviewError::BadAmount(0)))), "{bad:?}");
    let matched = row_id(&w, 1).await;
    let not_flagged = finance::decide(&w.engine, &w.pool, decide(matched, Decision::Approve)).await;
    assert!(matches!(not_flagged, Err(Error::Review(ReviewError::NotFlagged { .. }))), "{not_flagged:?}");

    let outcome = |id| {
        let w = &w;
        async move {
            let run = w.finished(id).await;
            serde_json::from_value::<ReviewOutcome>(run.output.unwrap()).unwrap()
        }
    };
    let by_row: Vec<(i64, uuid::Uuid)> =
        sqlx::query_as("SELECT id, review_run_id FROM media.finance_rows WHERE review_run_id IS NOT NULL ORDER BY id")
            .fetch_all(&w.pool)
            .await
            .unwrap();
    assert_eq!(outcome(by_row[0].1).await, ReviewOutcome::Approved { by: "anna@finance".into() });
    assert_eq!(outcome(by_row[1].1).await, ReviewOutcome::Corrected { by: "anna@finance".into(), amount_cents: 1_000 });
    // Row 5: nobody decides within the review period (the clock moves 31 days).
    durastep::testing::advance_clock(&w.engine, std::time::Duration::from_secs(31 * 86_400)).await.unwrap();
    assert_eq!(outcome(by_row[2].1).await, ReviewOutcome::Expired);
    worker.stop().await;

    let after: Vec<(i32, String, Option<i64>)> = sqlx::query_as(
        "SELECT row_no, status, corrected_cents FROM media.finance_rows WHERE row_no IN (2, 3, 5) ORDER BY row_no",
    )
    .fetch_all(&w.pool)
    .await
    .unwrap();
    assert_eq!(
        after,
        [(2, "approved".to_owned(), None), (3, "corrected".to_owned(), Some(1_000)), (5, "expired".to_owned(), None)]
    );
    assert!(founder::load(&w.pool).await.unwrap().review.is_empty());
}

#[sqlx::test(migrations = false)]
async fn the_same_file_twice_is_one_import_and_a_row_seen_before_is_a_duplicate(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let w = common::world(opts).await;
    let writes = pushed_writes(&w).await;
    let first = format!("{HEADER}{d},x,Meta,act_1,c_1,25.00,{r}\n", d = writes[0].3, r = writes[0].2);
    let a = finance::import_sheet(&w.engine, &w.pool, "nov.csv", &first).await.unwrap();
    let again = finance::import_sheet(&w.engine, &w.pool, "nov-copy.csv", &first).await.unwrap();
    assert!(again.already_imported);
    assert_eq!((again.import_id, again.run_id), (a.import_id, a.run_id));

    // A later export holding the same row (same reference) and a new one.
    let second = format!("{first}{d},x,Meta,act_1,c_2,40.00,{r}\n", d = writes[1].3, r = writes[1].2);
    let b = finance::import_sheet(&w.engine, &w.pool, "nov-v2.csv", &second).await.unwrap();
    assert!(!b.already_imported);
    let worker = common::worker(&w.engine);
    w.finished(a.run_id.unwrap()).await;
    w.finished(b.run_id.unwrap()).await;
    worker.stop().await;
    assert_eq!(w.runs_of("finance-import").await.len(), 2);
    let rows: Vec<(i64, i32, String)> =
        sqlx::query_as("SELECT import_id, row_no, status FROM media.finance_rows ORDER BY import_id, row_no")
            .fetch_all(&w.pool)
            .await
            .unwrap();
    assert_eq!(
        rows,
        [
            (a.import_id, 1, "matched".to_owned()),
            (b.import_id, 1, "duplicate".to_owned()),
            (b.import_id, 2, "matched".to_owned()),
        ]
    );
    let matched: i64 =
        sqlx::query_scalar("SELECT count(DISTINCT budget_write_id) FROM media.finance_rows WHERE status = 'matched'")
            .fetch_one(&w.pool)
            .await
            .unwrap();
    assert_eq!(matched, 2, "each budget write is matched once");
}

/// Bad input is refused whole, with a typed error, and nothing is stored.
#[sqlx::test(migrations = false)]
async fn a_sheet_without_the_columns_is_refused_and_nothing_is_stored(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    let e = finance::import_sheet(&w.engine, &w.pool, "x.csv", "date,client,amount\n2026-11-27,acme,25\n").await;
    assert!(matches!(e, Err(Error::Sheet(finance::SheetError::MissingColumn(ref c))) if c == "platform"), "{e:?}");
    let imports: i64 =
        sqlx::query_scalar("SELECT count(*) FROM media.finance_imports").fetch_one(&w.pool).await.unwrap();
    assert_eq!(imports, 0);
    assert!(w.runs_of("finance-import").await.is_empty());
}
