//! `media-buying check-deploy [--database-url URL] [--meta-shadow] [--tiktok-shadow]`: replays
//! every unfinished run of the example's functions against this build's code,
//! writing nothing, and exits 0 when none would diverge, 1 when some would (or
//! could not be replayed), 2 on an error. Run it in CI, against the production
//! database, with the workers' settings, before a deploy. It migrates nothing
//! and registers nothing (`EngineBuilder::check_deploy`): the reader role of
//! docs/security.md, plus SELECT on `media.finance_imports` (the finance
//! import reads its file outside steps; see the README, "Checking a deploy"),
//! is enough (`--database-url` with that role).

use std::process::ExitCode;

use durastep::Engine;
use media_buying::cli::CheckDeployArgs;
use media_buying::functions::{self, Services};
use media_buying::{Endpoints, Error, Settings, database, demo};

/// Runs the check (default database: the demo's); prints the report.
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

async fn check(args: CheckDeployArgs) -> Result<durastep::DeployReport, Error> {
    let options: sqlx::postgres::PgConnectOptions = match args.database_url {
        Some(url) => url.parse()?,
        None => database::server_url().parse::<sqlx::postgres::PgConnectOptions>()?.database(demo::DATABASE),
    };
    let pool = database::pool(options, 2).await?;
    // No step body runs in a check: the platforms are never called.
    let unused = || "http://127.0.0.1:9".to_owned();
    let mut settings =
        Settings::new(Endpoints { meta: unused(), tiktok: unused(), linkedin: unused(), chat: unused() });
    settings.meta_shadow = args.meta_shadow;
    settings.tiktok_shadow = args.tiktok_shadow;
    // The handlers of this build, checked without building an engine: no
    // migration, no registration, SELECTs only.
    let services = Services::new(pool.clone(), settings);
    Ok(Engine::builder().pool(pool).functions(functions::all(&services)).check_deploy().await?)
}
