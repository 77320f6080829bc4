//! `placement-pipeline check-deploy`: replays every unfinished run of the
//! pipeline's functions against this build's code, writing nothing, and exits
//! 0 when none would diverge, 1 when some would (or could not be replayed),
//! 2 on an error. Run it in CI, against the production database, before a deploy.
//! It creates, migrates and registers nothing (`EngineBuilder::check_deploy`):
//! the reader role of docs/security.md is enough (`--database-url` with that role).

use std::process::ExitCode;

use durastep::Engine;
use placement_pipeline::Endpoints;
use placement_pipeline::cli::CheckDeployArgs;
use placement_pipeline::database::{DATABASE, server_url};
use placement_pipeline::http::Client;
use placement_pipeline::settings::Settings;
use placement_pipeline::side_effects::{self, Pipeline};
use sqlx::postgres::PgPoolOptions;

/// Runs the check; prints the report.
pub async fn main(args: CheckDeployArgs) -> ExitCode {
    match check(args).await {
        Ok(report) => {
            print!("{report}");
            if report.is_safe() { ExitCode::SUCCESS } else { ExitCode::from(1) }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

async fn check(args: CheckDeployArgs) -> Result<durastep::DeployReport, Box<dyn std::error::Error>> {
    let options: sqlx::postgres::PgConnectOptions = match args.database_url {
        Some(url) => url.parse()?,
        None => server_url().parse::<sqlx::postgres::PgConnectOptions>()?.database(DATABASE),
    };
    let pool = PgPoolOptions::new().max_connections(2).connect_with(options).await?;
    // No step body runs in a check: the endpoints are never called.
    let unused = || "http://127.0.0.1:9".to_owned();
    let endpoints = Endpoints {
        mail: unused(),
        crm: unused(),
        chat: unused(),
        sheet: unused(),
        outreach: unused(),
        invoicing: unused(),
    };
    let pipeline = Pipeline { endpoints, client: Client::new()?, settings: Settings::new(pool.clone()) };
    // No migration, no registration, SELECTs only.
    Ok(Engine::builder().pool(pool).functions(side_effects::functions(&pipeline)).check_deploy().await?)
}
