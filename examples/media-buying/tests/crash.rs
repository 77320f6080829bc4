//! Story B: "a crash after `push` and before `log` resumes at `log` with the
//! same token: Meta sees one write, the store records one write". The crash
//! is a real one: a worker process (this crate's `worker` command) exits on
//! purpose (`MEDIA_BUYING_CRASH`), then a second worker finishes the run.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::World;
use durastep::RunState;
use media_buying::Platform;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Runs one worker process with `MEDIA_BUYING_CRASH=point` until it exits; returns its exit code.
async fn crashing_worker(w: &World, point: &str) -> Option<i32> {
    let e = &w.sims.endpoints;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_media-buying"))
        .args(["worker", "--database-url", &w.url, "--meta", &e.meta, "--tiktok", &e.tiktok])
        .args(["--linkedin", &e.linkedin, "--chat", &e.chat])
        .env("MEDIA_BUYING_CRASH", point)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the worker");
    let status = tokio::time::timeout(common::DEADLINE, child.wait())
        .await
        .expect("the worker crashed in time")
        .expect("wait for the worker");
    status.code()
}

/// The second worker: the lease of the dead one expires (by the database
/// clock, moved past the worker's 30 s lease) and the run resumes.
async fn finish_with_second_worker(w: &World, run_id: uuid::Uuid) -> durastep::Run {
    assert_eq!(w.run(run_id).await.state, RunState::Running, "the dead worker still holds the run");
    durastep::testing::advance_clock(&w.engine, Duration::from_secs(31)).await.unwrap();
    let worker = common::worker(&w.engine);
    let run = w.finished(run_id).await;
    worker.stop().await;
    run
}

#[sqlx::test(migrations = false)]
async fn crash_after_meta_accepted_the_push_gives_one_write_at_meta_and_one_row(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let w = common::world(opts).await;
    let token = w.account(Platform::Meta, "act_1").await;
    let (write_id, run_id) = w.request(Platform::Meta, "act_1", "camp_9", 12_500).await;

    // The process dies inside `push`, after Meta applied the write and before
    // the step's checkpoint: the resumed run must push again.
    assert_eq!(crashing_worker(&w, "meta-push-sent").await, Some(137));
    assert_eq!(w.sims.meta.writes().len(), 1, "Meta applied the write before the crash");
    assert_eq!(w.write_row(write_id).await.0, "queued", "the log step never ran");

    let run = finish_with_second_worker(&w, run_id).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(w.sims.meta.writes_received(), 2, "the second worker pushed again (the body ran twice)");
    let writes = w.sims.meta.writes();
    assert_eq!(writes.len(), 1, "Meta deduplicated the repeat by its idempotency key: {writes:?}");
    assert_eq!(w.sims.meta.duplicates(), 1);
    assert_eq!(writes[0].idempotency_key.as_deref(), Some(format!("{run_id}:push").as_str()));
    assert_eq!(w.budget_write_rows().await, 1);
    assert_eq!(w.write_row(write_id).await, ("pushed".to_owned(), Some(writes[0].write_ref.clone())));
    // The same token: get-token was checkpointed before the crash and replayed.
    assert!(w.sims.meta.accepts(&token).await);
    assert_eq!(w.sims.meta.tokens_issued("act_1"), 0, "no token was rotated");
}

#[sqlx::test(migrations = false)]
async fn crash_between_push_and_log_resumes_at_log(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    w.account(Platform::Meta, "act_1").await;
    let (write_id, run_id) = w.request(Platform::Meta, "act_1", "camp_9", 12_500).await;

    // `push` is checkpointed; the process dies before `log`.
    assert_eq!(crashing_worker(&w, "meta-before-log").await, Some(137));
    assert_eq!(w.write_row(write_id).await.0, "queued");

    let run = finish_with_second_worker(&w, run_id).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(w.sims.meta.writes_received(), 1, "push replayed from its checkpoint: Meta was not called again");
    let writes = w.sims.meta.writes();
    assert_eq!(writes.len(), 1);
    assert_eq!(w.budget_write_rows().await, 1);
    assert_eq!(w.write_row(write_id).await, ("pushed".to_owned(), Some(writes[0].write_ref.clone())));
}

/// The finance import crashes (a real process exit) right after row 3's
/// checkpoint; a second worker resumes at row 4. Every row is imported once
/// and every flagged row has one review run: no double import.
#[sqlx::test(migrations = false)]
async fn a_crash_in_the_finance_import_resumes_after_the_last_row_without_double_import(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use media_buying::store::finance;
    let w = common::world(opts).await;
    w.account(Platform::Meta, "act_1").await;
    let mut csv = String::from("date,client,platform,account,campaign,daily_budget,reference\n");
    for i in 1..=6 {
        // Rows with references no write has: each is flagged and gets a review run.
        csv.push_str(&format!("2026-11-2{i},acme,Meta,act_1,c_{i},{i}0.00,ref-{i}\n"));
    }
    let imported = finance::import_sheet(&w.engine, &w.pool, "sheet.csv", &csv).await.unwrap();
    let run_id = imported.run_id.unwrap();

    assert_eq!(crashing_worker(&w, "finance-after-row-3").await, Some(137));
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM media.finance_rows").fetch_one(&w.pool).await.unwrap();
    assert_eq!(rows, 3, "rows 1-3 were imported before the crash");

    let run = finish_with_second_worker(&w, run_id).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    let per_row: Vec<(i32, i64)> =
        sqlx::query_as("SELECT row_no, count(*) FROM media.finance_rows GROUP BY row_no ORDER BY row_no")
            .fetch_all(&w.pool)
            .await
            .unwrap();
    assert_eq!(per_row, (1..=6).map(|n| (n, 1)).collect::<Vec<_>>(), "each row imported exactly once");
    assert_eq!(w.runs_of("finance-row-review").await.len(), 6, "one review run per flagged row");
    // A re-run of the same file imports nothing.
    assert!(finance::import_sheet(&w.engine, &w.pool, "sheet.csv", &csv).await.unwrap().already_imported);
    assert_eq!(w.runs_of("finance-import").await.len(), 1);
}
