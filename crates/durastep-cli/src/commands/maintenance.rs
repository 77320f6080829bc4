//! `migrate` and `prune`: the schema and retention.

use std::time::Duration;

use durastep::Engine;
use serde::Serialize;

use crate::cli::PruneArgs;
use crate::error::CliError;
use crate::format;
use crate::output::Out;

/// `durastep migrate`: the migrations it applied (version and description),
/// or that none were needed.
pub fn migrated(applied: &[durastep::AppliedMigration], out: &mut Out) -> Result<(), CliError> {
    if out.json {
        #[derive(Serialize)]
        struct Migrated<'a> {
            applied: &'a [durastep::AppliedMigration],
        }
        return out.json(&Migrated { applied });
    }
    if applied.is_empty() {
        out.line("schema up to date: no migration needed");
        return Ok(());
    }
    out.line(format!("applied {} migration(s):", applied.len()));
    for m in applied {
        out.line(format!("  {:04} {}", m.version, m.description));
    }
    Ok(())
}

/// Under this `--older-than`, `prune` needs `--yes`: a bound that short is
/// more often a slip (`30m` for `30d`) than a retention policy.
pub const PRUNE_CONFIRM_UNDER: Duration = Duration::from_secs(3_600);

/// Without `--yes`, counts what the prune would delete and refuses (deleting
/// nothing, saying how many runs it would have deleted) when that is every
/// finished run there is (and at least one), or when `--older-than` is under
/// [`PRUNE_CONFIRM_UNDER`] (whatever the count). With `--yes`, asks nothing.
pub async fn check_prune(engine: &Engine, args: &PruneArgs) -> Result<(), CliError> {
    if args.yes {
        return Ok(());
    }
    let inspector = engine.inspect();
    let would = inspector.prunable(args.older_than).await?;
    // Every finished run that a prune could delete at all (`--older-than 0s`).
    let finished = inspector.prunable(Duration::ZERO).await?;
    let mut reasons = Vec::new();
    if would > 0 && would >= finished {
        reasons.push("that is every finished run".to_owned());
    }
    if args.older_than < PRUNE_CONFIRM_UNDER {
        reasons.push("--older-than is under 1h".to_owned());
    }
    if reasons.is_empty() {
        return Ok(());
    }
    Err(CliError::Usage(format!(
        "prune --older-than {} would delete {would} of {finished} finished run(s) ({}); add --yes if that is what \
         you want (nothing was deleted)",
        if args.older_than.is_zero() { "0s".to_owned() } else { format::duration(args.older_than) },
        reasons.join(", and ")
    )))
}

/// `durastep prune --older-than AGE --dry-run`: how many runs it would delete.
pub async fn dry_run(inspector: &durastep::inspect::Inspector, args: PruneArgs, out: &mut Out) -> Result<(), CliError> {
    let n = inspector.prunable(args.older_than).await?;
    if out.json {
        #[derive(Serialize)]
        struct DryRun {
            would_prune: u64,
        }
        return out.json(&DryRun { would_prune: n });
    }
    out.line(format!(
        "would prune {n} run(s) finished over {} ago (dry run: nothing deleted)",
        format::duration(args.older_than)
    ));
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
pub async fn serve(
    source: durastep_dashboard::Source,
    args: crate::cli::ServeArgs,
    _out: &mut Out,
) -> Result<(), CliError> {
    let mut config = durastep_dashboard::DashboardConfig::new(args.addr);
    config.token = args.token;
    config.show_data = args.show_data;
    config.allowed_hosts = args.allow_hosts;
    config.behind_tls = args.behind_tls;
    config.read_only = args.read_only;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        let _ = tokio::signal::ctrl_c().await;
        stop.cancel();
    });
    // Refused settings (a non-loopback address without a token) fail before anything is printed.
    let _validated = durastep_dashboard::router(source.clone(), &config)?;
    // Printed at once (not buffered like other output): the server runs until Ctrl-C.
    println!("starting the dashboard on http://{}/ (Ctrl-C stops it)", args.addr);
    durastep_dashboard::serve(source, config, shutdown).await?;
    Ok(())
}
