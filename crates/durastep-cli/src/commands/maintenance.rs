//! `migrate` and `prune`: the schema and retention.

use durastep::Engine;
use serde::Serialize;

use crate::cli::PruneArgs;
use crate::error::CliError;
use crate::format;
use crate::output::Out;

/// `durastep migrate`: the engine was built with migrations on, so they are applied.
pub fn migrated(out: &mut Out) -> Result<(), CliError> {
    if out.json {
        #[derive(Serialize)]
        struct Migrated {
            migrated: bool,
        }
        return out.json(&Migrated { migrated: true });
    }
    out.line("schema up to date");
    Ok(())
}

/// `durastep prune --older-than AGE`.
pub async fn prune(engine: &Engine, args: PruneArgs, out: &mut Out) -> Result<(), CliError> {
    let report = engine.prune(args.older_than).await?;
    if out.json {
        return out.json(&report);
    }
    out.line(format!(
        "pruned {} run(s), {} event(s) and {} idle flow key(s) finished over {} ago, in {} batch(es)",
        report.runs,
        report.events,
        report.flow_keys,
        format::duration(args.older_than),
        report.batches
    ));
    Ok(())
}

/// `durastep serve`: the dashboard, until Ctrl-C.
pub async fn serve(engine: &Engine, args: crate::cli::ServeArgs, _out: &mut Out) -> Result<(), CliError> {
    let mut config = durastep_dashboard::DashboardConfig::new(args.addr);
    config.token = args.token;
    config.show_data = args.show_data;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    // Refused settings (a non-loopback address without a token) fail before anything is printed.
    let _validated = durastep_dashboard::router(engine.clone(), &config)?;
    // Printed at once (not buffered like other output): the server runs until Ctrl-C.
    println!("starting the dashboard on http://{}/ (Ctrl-C stops it)", args.addr);
    durastep_dashboard::serve(engine.clone(), config, shutdown).await?;
    Ok(())
}
