//! Run with: `cargo run -p media-buying` (the demo), or
//! `cargo run -p media-buying -- <command>`; `-- --help` lists the commands
//! and their flags (see `src/cli.rs`).
//!
//! - `demo`: starts the simulators and a worker on its own database
//!   (`durastep_media_buying` on `DATABASE_URL`, default
//!   `postgres://postgres@127.0.0.1:5432/postgres`; when nothing answers
//!   there, on a throwaway cluster removed at exit), sends budget requests for
//!   80 clients over Meta, TikTok and LinkedIn, and prints what happened.
//! - `worker --database-url URL --meta URL --tiktok URL --linkedin URL --chat URL [--meta-shadow] [--tiktok-shadow]`:
//!   one worker process against the given platforms, until Ctrl-C.
//! - `founder [--database-url URL]`: prints the founder's view (default: the demo's database).
//! - `check-deploy [--database-url URL] [--meta-shadow] [--tiktok-shadow]`: replays the unfinished runs against
//!   this build, writing nothing; exit 0: none diverges, 1: some do, 2: error (for CI).

use std::process::ExitCode;

use clap::Parser;
use durastep::WorkerOptions;
use media_buying::cli::{
    Cli, Command, DatabaseArg, FounderArgs, ImportFinanceArgs, ReviewAction, ReviewArgs, ShadowReportArgs, WorkerArgs,
};
use media_buying::functions::finance::{Decision, ReviewDecision};
use media_buying::store::{self, finance};
use media_buying::{CrashPoint, Endpoints, Error, Settings, database, demo, founder, shadow_week};
use tokio_util::sync::CancellationToken;

mod check_deploy;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Demo) {
        Command::Demo => demo::run().await,
        Command::Worker(args) => worker(args).await,
        Command::Founder(args) => show_founder(args).await,
        Command::ShadowWeek => shadow_week::run().await,
        Command::ShadowReport(args) => shadow_report(args).await,
        Command::ImportFinance(args) => import_finance(args).await,
        Command::Review(args) => review(args).await,
        Command::CheckDeploy(args) => return check_deploy::main(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn worker(args: WorkerArgs) -> Result<(), Error> {
    let endpoints = Endpoints { meta: args.meta, tiktok: args.tiktok, linkedin: args.linkedin, chat: args.chat };
    let mut settings = Settings::new(endpoints);
    settings.meta_shadow = args.meta_shadow;
    settings.tiktok_shadow = args.tiktok_shadow;
    if let Ok(point) = std::env::var("MEDIA_BUYING_CRASH") {
        settings.crash_at = Some(
            CrashPoint::parse(&point).ok_or_else(|| Error::Usage(format!("unknown MEDIA_BUYING_CRASH {point:?}")))?,
        );
    }
    let pool = database::pool(args.database_url.parse()?, 8).await?;
    let (engine, _services) = database::engine(pool, settings, WorkerOptions::default()).await?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    eprintln!("worker running; Ctrl-C stops it");
    engine.run_worker(shutdown).await?;
    Ok(())
}

/// A pool on `--database-url`, else on database `default` of DATABASE_URL's server.
async fn connect(url: Option<String>, default: &str) -> Result<sqlx::PgPool, Error> {
    let options: sqlx::postgres::PgConnectOptions = match url {
        Some(url) => url.parse()?,
        None => database::server_url().parse::<sqlx::postgres::PgConnectOptions>()?.database(default),
    };
    database::pool(options, 2).await
}

async fn show_founder(args: FounderArgs) -> Result<(), Error> {
    let pool = connect(args.database.database_url, demo::DATABASE).await?;
    let view = founder::load(&pool).await?;
    print!("{}", view.render());
    Ok(())
}

async fn shadow_report(args: ShadowReportArgs) -> Result<(), Error> {
    let pool = connect(args.database_url, shadow_week::DATABASE).await?;
    print!("{}", store::shadow_report(&pool, args.platform.into()).await?.render());
    Ok(())
}

/// An engine that registers nothing and never runs a worker: for sending.
async fn sender(pool: sqlx::PgPool) -> Result<durastep::Engine, Error> {
    Ok(durastep::Engine::builder().pool(pool).build().await?)
}

async fn import_finance(args: ImportFinanceArgs) -> Result<(), Error> {
    let text = std::fs::read_to_string(&args.file)
        .map_err(|e| Error::Usage(format!("cannot read {}: {e}", args.file.display())))?;
    let name = args.file.file_name().map_or_else(|| "sheet.csv".to_owned(), |n| n.to_string_lossy().into_owned());
    let DatabaseArg { database_url } = args.database;
    let pool = connect(database_url, demo::DATABASE).await?;
    let engine = sender(pool.clone()).await?;
    let imported = finance::import_sheet(&engine, &pool, &name, &text).await?;
    if imported.already_imported {
        println!("{name} was imported before (import #{}); nothing new stored or started", imported.import_id);
    } else {
        println!(
            "{name}: {} rows stored as import #{}; run {} imports them row by row when a worker runs              (media-buying worker ...); flagged rows appear in the founder's view",
            imported.rows,
            imported.import_id,
            imported.run_id.map_or_else(|| "-".to_owned(), |r| r.to_string())
        );
    }
    Ok(())
}

async fn review(args: ReviewArgs) -> Result<(), Error> {
    let decision = match args.action {
        ReviewAction::Approve => Decision::Approve,
        ReviewAction::Correct => {
            let text = args.amount.unwrap_or_default();
            let amount_cents = finance::parse_euros(&text)
                .ok_or_else(|| Error::Usage(format!("--amount {text:?} is not an amount in euros (e.g. 25.00)")))?;
            Decision::Correct { amount_cents }
        }
    };
    let pool = connect(args.database.database_url, demo::DATABASE).await?;
    let engine = sender(pool.clone()).await?;
    let run =
        finance::decide(&engine, &pool, ReviewDecision { row_id: args.row, decision, by: args.by, note: args.note })
            .await?;
    println!("decision sent to review run {run}; the row leaves the queue when a worker applies it");
    Ok(())
}
