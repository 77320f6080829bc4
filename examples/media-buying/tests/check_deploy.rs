//! `media-buying check-deploy` (the binary) against a database with runs in
//! flight, as a SELECT-only reader role: exit 0 when none diverges, 1 when
//! one would (or could not be replayed), and it writes nothing.

mod common;

use std::time::Duration;

use durastep::{Ctx, Engine, Function, HandlerResult, RunState};
use media_buying::store::{self, finance};
use media_buying::{BudgetRequest, Platform, database};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

/// What one run of `media-buying check-deploy` printed.
#[derive(Debug)]
struct Checked {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `media-buying check-deploy --database-url URL`.
async fn check_deploy(url: &str) -> Checked {
    let out = tokio::time::timeout(
        common::DEADLINE,
        tokio::process::Command::new(env!("CARGO_BIN_EXE_media-buying"))
            .args(["check-deploy", "--database-url", url])
            .output(),
    )
    .await
    .expect("the check finished in time")
    .expect("run media-buying check-deploy");
    Checked {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The SQL block after `marker` in a document.
fn sql_after(doc: &str, marker: &str) -> String {
    let (_, after) = doc.split_once(marker).unwrap_or_else(|| panic!("{marker} in the document"));
    let block = after.split_once("```sql\n").expect("an sql block").1;
    block.split_once("```").expect("the end of the sql block").0.to_owned()
}

/// The reader role's grants, as docs/security.md gives them.
fn reader_grants() -> String {
    sql_after(include_str!("../../../docs/security.md"), "<!-- reader-grants -->")
}

/// The grants this crate's README adds for `check-deploy` (the finance import reads its file outside steps).
fn check_deploy_grants() -> String {
    sql_after(include_str!("../README.md"), "<!-- check-deploy-grants -->")
}

/// A login role, unique to the test, with the reader grants of docs/security.md.
struct Reader {
    name: String,
    url: String,
    admin: PgPool,
}

impl Reader {
    async fn create(opts: &PgConnectOptions) -> Reader {
        let name = format!("durastep_reader_{}", Uuid::new_v4().simple());
        let admin = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.unwrap();
        let url = format!(
            "postgres://{name}@{}:{}/{}",
            opts.get_host(),
            opts.get_port(),
            opts.get_database().unwrap_or("postgres")
        );
        let reader = Reader { name, url, admin };
        reader.run(&format!("CREATE ROLE {} LOGIN", reader.name)).await;
        reader.grant(&reader_grants()).await;
        reader
    }

    /// Runs `sql` (grants written for `durastep_reader`) for this role.
    async fn grant(&self, sql: &str) {
        self.run(&sql.replace("durastep_reader", &self.name)).await;
    }

    async fn run(&self, sql: &str) {
        sqlx::raw_sql(AssertSqlSafe(sql.to_owned()))
            .execute(&self.admin)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    async fn drop(self) {
        self.run(&format!("DROP OWNED BY {0}; DROP ROLE {0}", self.name)).await;
        self.admin.close().await;
    }
}

/// Every run, step result and journal entry, as text: what a check must leave as it is.
async fn snapshot(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT x FROM (SELECT row_to_json(r)::text AS x FROM durastep.runs r
                        UNION ALL SELECT row_to_json(s)::text FROM durastep.step_results s
                        UNION ALL SELECT row_to_json(j)::text FROM durastep.step_journal j) t ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

async fn unfinished_runs(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM durastep.runs WHERE state IN ('queued', 'running', 'sleeping', 'waiting', 'diverged')",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// A TikTok write asleep until after the reset, a flagged finance row's
/// review waiting for the accountant, and, never run, a Meta write and a
/// second finance import: the check replays them all, as the reader role
/// of docs/security.md plus this crate's README's grants, and exits 0.
/// Without the README's grants, the queued import (whose handler reads its
/// file outside steps) cannot be replayed: exit 1, naming the run and the
/// missing permission. Catches: a check that needs more than SELECT, that
/// writes, or whose exit code does not say what it found; and a README
/// whose grants are not enough.
#[sqlx::test(migrations = false)]
async fn check_deploy_passes_for_runs_in_flight_as_a_reader_role(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts.clone()).await;
    w.account(Platform::TikTok, "adv_1").await;
    w.account(Platform::Meta, "act_1").await;
    let worker = common::worker(&w.engine);
    let (_, tiktok) = w.request(Platform::TikTok, "adv_1", "tt_camp_1", 40_000).await;
    w.reaches(tiktok, RunState::Sleeping).await;
    let header = "date,client,platform,account,campaign,daily_budget,reference\n";
    let sheet = format!("{header}2026-11-21,acme,Meta,act_1,c_1,10.00,ref-nowhere-1\n");
    let first = finance::import_sheet(&w.engine, &w.pool, "sheet-1.csv", &sheet).await.unwrap();
    w.finished(first.run_id.unwrap()).await;
    common::wait_until("the flagged row's review to wait", || async {
        let reviews = w.runs_of("finance-row-review").await;
        reviews.len() == 1 && w.run(reviews[0]).await.state == RunState::Waiting
    })
    .await;
    worker.stop().await;
    // With no worker: queued, never executed.
    w.request(Platform::Meta, "act_1", "camp_9", 12_500).await;
    let sheet = format!("{header}2026-11-22,acme,Meta,act_1,c_2,20.00,ref-nowhere-2\n");
    let second = finance::import_sheet(&w.engine, &w.pool, "sheet-2.csv", &sheet).await.unwrap();
    let in_flight = unfinished_runs(&w.pool).await;
    assert!(in_flight >= 4, "{in_flight}");

    let before = snapshot(&w.pool).await;
    let reader = Reader::create(&opts).await;
    let without = check_deploy(&reader.url).await;
    reader.grant(&check_deploy_grants()).await;
    let with = check_deploy(&reader.url).await;
    reader.drop().await;
    let after = snapshot(&w.pool).await;

    assert_eq!(without.code, Some(1), "{without:?}");
    let problem = format!("finance-import run {}: the handler failed on replay", second.run_id.unwrap());
    assert!(without.stdout.contains(&problem), "{without:?}");
    assert!(without.stdout.contains("permission denied for schema media"), "{without:?}");
    assert_eq!(with.code, Some(0), "{with:?}");
    assert!(!with.stderr.contains("error"), "{with:?}");
    assert_eq!(
        with.stdout,
        format!("checked {in_flight} unfinished runs: 0 diverge, 0 could not be replayed\n"),
        "{with:?}"
    );
    assert!(before == after, "the check wrote something");
    assert_eq!(w.run(tiktok).await.state, RunState::Sleeping);
}

/// The TikTok writer of an older build, which took the token before its
/// sleep (`get-token`, then `until-after-reset`); this build sleeps first.
fn tiktok_of_an_older_build() -> Function {
    Function::new(Platform::TikTok.function_id()).on_event(Platform::TikTok.event_name()).handler(
        |ctx: Ctx, req: BudgetRequest| async move {
            let token: String =
                ctx.step("get-token", || async move { Ok(format!("token of {}", req.account_id)) }).await?;
            ctx.sleep("until-after-reset", Duration::from_secs(86_400)).await?;
            HandlerResult::Ok(token)
        },
    )
}

/// A run in flight recorded by an older build that this build's code does
/// not replay (it asks for the sleep where the run recorded `get-token`): the
/// check, as the reader role of docs/security.md, exits 1 and names the
/// function and the position. Catches: a check that passes a diverging run,
/// or exits 0 whatever it found.
#[sqlx::test(migrations = false)]
async fn check_deploy_exits_1_when_a_run_in_flight_diverges(_p: PgPoolOptions, opts: PgConnectOptions) {
    let pool = database::pool(opts.clone(), 4).await.unwrap();
    let old = Engine::builder()
        .pool(pool.clone())
        .worker_options(common::fast())
        .function(tiktok_of_an_older_build())
        .build()
        .await
        .unwrap();
    store::migrate(&pool).await.unwrap();
    store::add_account(&pool, Platform::TikTok, "adv_1", "client of adv_1").await.unwrap();
    let expires = chrono::Utc::now() + chrono::Duration::days(30);
    store::add_token(&pool, Platform::TikTok, "adv_1", "tok", "refresh", expires).await.unwrap();
    let worker = common::worker(&old);
    let requested =
        store::request_budget(&old, &pool, Platform::TikTok, "adv_1", "tt_camp_1", 40_000, "ops@agency").await.unwrap();
    common::wait_until("the old build's run to sleep", || async {
        old.run(requested.run_id).await.unwrap().state == RunState::Sleeping
    })
    .await;
    worker.stop().await;

    let before = snapshot(&pool).await;
    let reader = Reader::create(&opts).await;
    let checked = check_deploy(&reader.url).await;
    reader.drop().await;
    assert_eq!(checked.code, Some(1), "{checked:?}");
    assert!(
        checked.stdout.starts_with("checked 1 unfinished runs: 1 diverge, 0 could not be replayed\n"),
        "{checked:?}"
    );
    assert!(checked.stdout.contains("tiktok-budget-update at position 0: 1 runs"), "{checked:?}");
    assert!(before == snapshot(&pool).await, "the check wrote something");
    assert_eq!(old.run(requested.run_id).await.unwrap().state, RunState::Sleeping);
}
