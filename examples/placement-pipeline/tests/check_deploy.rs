//! `placement-pipeline check-deploy` (the binary) against a database with
//! runs in flight, as the SELECT-only reader role of docs/security.md: exit 0
//! when none diverges, 1 when one would, and it writes nothing.

mod common;

use std::time::Duration;

use common::{change, stack};
use durastep::{Ctx, Event, Function, HandlerResult, RunState};
use placement_pipeline::settings::{self, Mode};
use placement_pipeline::stack::{self as pipeline_stack, StackConfig};
use placement_pipeline::{SideEffect, Stage, StageChange};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use uuid::Uuid;

/// How long a wait in these tests may take.
const DEADLINE: Duration = Duration::from_secs(30);

/// What one run of `placement-pipeline check-deploy` printed.
#[derive(Debug)]
struct Checked {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `placement-pipeline check-deploy --database-url URL`.
async fn check_deploy(url: &str) -> Checked {
    let out = tokio::time::timeout(
        DEADLINE,
        tokio::process::Command::new(env!("CARGO_BIN_EXE_placement-pipeline"))
            .args(["check-deploy", "--database-url", url])
            .output(),
    )
    .await
    .expect("the check finished in time")
    .expect("run placement-pipeline check-deploy");
    Checked {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The reader role's grants, as docs/security.md gives them.
fn reader_grants() -> String {
    let doc = include_str!("../../../docs/security.md");
    let (_, after) = doc.split_once("<!-- reader-grants -->").expect("the marker in docs/security.md");
    let block = after.split_once("```sql\n").expect("an sql block").1;
    block.split_once("```").expect("the end of the sql block").0.to_owned()
}

/// A login role, unique to the test, with the reader grants of docs/security.md
/// and nothing else (no grant on the `placement` schema).
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
        let grants = reader_grants().replace("durastep_reader", &name);
        let reader = Reader { name, url, admin };
        reader.run(&format!("CREATE ROLE {} LOGIN; {grants}", reader.name)).await;
        reader
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

/// Polls `check` until it holds; fails the test after [`DEADLINE`].
async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A channel post in its backoff after a refused first attempt (its `mode`
/// step recorded, its `send` not), and one stage change's five runs never
/// executed: the check replays them all as the reader role and exits 0.
/// Catches: a check that needs more than SELECT, that writes, or whose exit
/// code does not say what it found.
#[sqlx::test(migrations = false)]
async fn check_deploy_passes_for_runs_in_flight_as_a_reader_role(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut config = StackConfig::default();
    config.chat_channels.push("#client-initech".into());
    config.channel_config.push(("initech".into(), "#client-intiech".into()));
    let stack = stack(opts.clone(), config).await;
    let receipt = stack.webhook(&change(77, Stage::IntroCall, "initech")).await.expect("delivery");
    let (engine, pool) = (stack.engine.clone(), stack.pool.clone());
    wait_until("the channel post to fail once and the others to complete", || async {
        let mut waiting = true;
        for id in &receipt.run_ids {
            let run = engine.run(*id).await.unwrap();
            waiting &= if run.function_id == SideEffect::ChannelPost.function_id() {
                run.state == RunState::Queued && run.last_error.is_some()
            } else {
                run.state == RunState::Completed
            };
        }
        waiting
    })
    .await;
    stack.stop().await.expect("stop");
    // With no worker: queued, never executed.
    let offer = change(78, Stage::Offer, "acme");
    let sent = engine.send(Event::new(Stage::Offer.event_name(), &offer)).await.unwrap();
    assert_eq!(sent.run_ids.len(), 5);
    let in_flight = unfinished_runs(&pool).await;
    assert_eq!(in_flight, 6);

    let before = snapshot(&pool).await;
    let reader = Reader::create(&opts).await;
    let checked = check_deploy(&reader.url).await;
    reader.drop().await;
    assert_eq!(checked.code, Some(0), "{checked:?}");
    assert!(!checked.stderr.contains("error"), "{checked:?}");
    assert_eq!(checked.stdout, "checked 6 unfinished runs: 0 diverge, 0 could not be replayed\n", "{checked:?}");
    assert!(before == snapshot(&pool).await, "the check wrote something");
}

/// The channel post of an older build, which looked the channel up in a step
/// of its own (`lookup-channel`) and then paused a day before sending; this
/// build sends right after `mode`.
fn channel_post_of_an_older_build() -> Function {
    let mut f = Function::new(SideEffect::ChannelPost.function_id());
    for stage in Stage::ALL {
        f = f.on_event(stage.event_name());
    }
    f.handler(|ctx: Ctx, change: StageChange| async move {
        let _mode: Mode = ctx.step("mode", || async { Ok(Mode::Live) }).await?;
        let channel: String =
            ctx.step("lookup-channel", || async move { Ok(format!("#client-{}", change.client_account)) }).await?;
        ctx.sleep("pause", Duration::from_secs(86_400)).await?;
        HandlerResult::Ok(channel)
    })
}

/// A run in flight recorded by an older build that this build does not
/// replay: `mode` matches, then it recorded `lookup-channel` where this build
/// asks for `send`. The check, as the reader role, exits 1 and names the
/// function and the position. Catches: a check that passes a diverging run,
/// that compares only the first entry, or exits 0 whatever it found.
#[sqlx::test(migrations = false)]
async fn check_deploy_exits_1_when_a_run_in_flight_diverges(_p: PgPoolOptions, opts: PgConnectOptions) {
    let pool = PgPoolOptions::new().max_connections(4).connect_with(opts.clone()).await.unwrap();
    let old = pipeline_stack::build_engine(pool.clone(), vec![channel_post_of_an_older_build()]).await.unwrap();
    settings::migrate(&pool).await.unwrap();
    let worker = old.spawn_worker();
    let change = change(79, Stage::Placement, "acme");
    let run_id = old.send(Event::new(Stage::Placement.event_name(), &change)).await.unwrap().run_ids[0];
    wait_until("the old build's run to sleep", || async { old.run(run_id).await.unwrap().state == RunState::Sleeping })
        .await;
    worker.stop().await.unwrap();

    let before = snapshot(&pool).await;
    let reader = Reader::create(&opts).await;
    let checked = check_deploy(&reader.url).await;
    reader.drop().await;
    assert_eq!(checked.code, Some(1), "{checked:?}");
    assert!(
        checked.stdout.starts_with("checked 1 unfinished runs: 1 diverge, 0 could not be replayed\n"),
        "{checked:?}"
    );
    assert!(checked.stdout.contains("post-to-channel at position 1: 1 runs"), "{checked:?}");
    assert!(before == snapshot(&pool).await, "the check wrote something");
    assert_eq!(old.run(run_id).await.unwrap().state, RunState::Sleeping);
}
