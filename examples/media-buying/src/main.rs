//! Run with: `cargo run -p media-buying` (the demo), or
//! `cargo run -p media-buying -- <demo | worker | founder>`.
//!
//! - `demo`: starts the simulators and a worker on its own database
//!   (`durastep_media_buying` on `DATABASE_URL`, default
//!   `postgres://postgres@127.0.0.1:5432/postgres`), sends budget requests for
//!   80 clients over Meta, TikTok and LinkedIn, and prints what happened.
//! - `worker --database-url URL --meta URL --tiktok URL --linkedin URL --chat URL [--meta-shadow]`:
//!   one worker process against the given platforms, until Ctrl-C.
//! - `founder [--database-url URL]`: prints the founder's view (default: the demo's database).

use std::process::ExitCode;

use durastep::WorkerOptions;
use media_buying::{CrashPoint, Endpoints, Error, Settings, database, demo, founder};
use tokio_util::sync::CancellationToken;

const USAGE: &str = "usage: media-buying [demo]
       media-buying worker --database-url URL --meta URL --tiktok URL --linkedin URL --chat URL [--meta-shadow]
       media-buying founder [--database-url URL]";

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        None | Some("demo") => demo::run().await,
        Some("worker") => worker(&args[1..]).await,
        Some("founder") => show_founder(&args[1..]).await,
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        Some(other) => Err(Error::Usage(format!("unknown command {other:?}\n{USAGE}"))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The value after `--name`.
fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn required(args: &[String], name: &str) -> Result<String, Error> {
    flag(args, name).ok_or_else(|| Error::Usage(format!("missing {name}\n{USAGE}")))
}

async fn worker(args: &[String]) -> Result<(), Error> {
    let url = required(args, "--database-url")?;
    let endpoints = Endpoints {
        meta: required(args, "--meta")?,
        tiktok: required(args, "--tiktok")?,
        linkedin: required(args, "--linkedin")?,
        chat: required(args, "--chat")?,
    };
    let mut settings = Settings::new(endpoints);
    settings.meta_shadow = args.iter().any(|a| a == "--meta-shadow");
    if let Ok(point) = std::env::var("MEDIA_BUYING_CRASH") {
        settings.crash_at = Some(
            CrashPoint::parse(&point).ok_or_else(|| Error::Usage(format!("unknown MEDIA_BUYING_CRASH {point:?}")))?,
        );
    }
    let pool = database::pool(url.parse()?, 8).await?;
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

async fn show_founder(args: &[String]) -> Result<(), Error> {
    let options: sqlx::postgres::PgConnectOptions = match flag(args, "--database-url") {
        Some(url) => url.parse()?,
        None => database::server_url().parse::<sqlx::postgres::PgConnectOptions>()?.database(demo::DATABASE),
    };
    let pool = database::pool(options, 2).await?;
    let view = founder::load(&pool).await?;
    print!("{}", view.render());
    Ok(())
}
