//! The commands: each reads or acts through the engine's public API and
//! writes to [`Out`]. None of them runs SQL of its own.

mod events;
mod maintenance;
mod overview;
mod runs;
mod show;
mod why;

use durastep::Engine;

use crate::cli::{Command, EventsCommand, RunsCommand};
use crate::error::CliError;
use crate::output::Out;

/// Runs one command (other than `migrate`, which needs its own engine) on `engine`.
pub async fn run(command: Command, engine: &Engine, out: &mut Out) -> Result<(), CliError> {
    match command {
        Command::Migrate => maintenance::migrated(out),
        Command::Stats => overview::stats(engine, out).await,
        Command::Functions => overview::functions(engine, out).await,
        Command::Runs(RunsCommand::Ls(args)) => runs::list(engine, args, out).await,
        Command::Runs(RunsCommand::Show(args)) => show::show(engine, args, out).await,
        Command::Runs(RunsCommand::Replay(args)) => runs::replay(engine, args, out).await,
        Command::Runs(RunsCommand::Cancel(args)) => runs::cancel(engine, args, out).await,
        Command::Why { id } => why::why(engine, id, out).await,
        Command::Send(args) => events::send(engine, args, out).await,
        Command::Events(EventsCommand::Ls(args)) => events::list(engine, args, out).await,
        Command::Prune(args) => maintenance::prune(engine, args, out).await,
        Command::Serve(args) => maintenance::serve(engine, args, out).await,
    }
}
