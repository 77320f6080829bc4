//! The commands: each reads through an [`durastep::inspect::Inspector`] (a read-only
//! connection, enough for a role with SELECT only) or acts through the
//! engine's public API, and writes to [`Out`]. None of them runs SQL of its own.

mod events;
mod maintenance;
mod overview;
mod runs;
mod show;
mod why;

use crate::cli::{Command, EventsCommand, RunsCommand};
use crate::error::CliError;
use crate::output::Out;

/// Whether the command only reads (it then connects read-only).
pub fn reads_only(command: &Command) -> bool {
    match command {
        Command::Stats
        | Command::Functions
        | Command::Why { .. }
        | Command::Events(EventsCommand::Ls(_))
        | Command::Runs(RunsCommand::Ls(_) | RunsCommand::Show(_)) => true,
        Command::Serve(args) => args.read_only,
        Command::Prune(args) => args.dry_run,
        _ => false,
    }
}

/// Runs one command, connecting to `url` read-only for the read commands and
/// with an engine (no functions, never migrating) for the others; `migrate`
/// applies the migrations over a connection of its own.
pub async fn run(command: Command, url: &str, out: &mut Out) -> Result<(), CliError> {
    if reads_only(&command) {
        let inspector = crate::connect::reader(url).await?;
        return match command {
            Command::Stats => overview::stats(&inspector, out).await,
            Command::Functions => overview::functions(&inspector, out).await,
            Command::Runs(RunsCommand::Ls(args)) => runs::list(&inspector, args, out).await,
            Command::Runs(RunsCommand::Show(args)) => show::show(&inspector, args, out).await,
            Command::Why { id } => why::why(&inspector, id, out).await,
            Command::Events(EventsCommand::Ls(args)) => events::list(&inspector, args, out).await,
            Command::Serve(args) => maintenance::serve(inspector.into(), args, out).await,
            Command::Prune(args) => maintenance::dry_run(&inspector, args, out).await,
            _ => unreachable!("reads_only lists only these"),
        };
    }
    if let Command::Migrate = command {
        let applied = crate::connect::migrate(url).await?;
        return maintenance::migrated(&applied, out);
    }
    let engine = crate::connect::engine(url, false).await?;
    if let Command::Prune(args) = &command {
        maintenance::check_prune(&engine, args).await?;
    }
    match command {
        Command::Migrate => unreachable!("migrated above"),
        Command::Runs(RunsCommand::Replay(args)) => runs::replay(&engine, args, out).await,
        Command::Runs(RunsCommand::Cancel(args)) => runs::cancel(&engine, args, out).await,
        Command::Runs(RunsCommand::Resume(args)) => runs::resume(&engine, args, out).await,
        Command::Runs(RunsCommand::Discard(args)) => runs::discard(&engine, args, out).await,
        Command::Send(args) => events::send(&engine, args, out).await,
        Command::Prune(args) => maintenance::prune(&engine, args, out).await,
        Command::Serve(args) => maintenance::serve(engine.into(), args, out).await,
        Command::Dev => Err(CliError::Usage("`dev` is run before connecting".into())),
        _ => unreachable!("read commands returned above"),
    }
}
