//! Run with: `cargo run -p placement-pipeline` (the demo, the default), or
//! `cargo run -p placement-pipeline -- <command>` (`-- --help` lists them; see `src/cli.rs`):
//!
//! ```text
//! demo                            the Monday burst and the channel-name incident, against simulators
//! serve                           receiver and worker against the real systems (PLACEMENT_*_URL)
//! simulators                      the six simulators on the machine's clock, printing PLACEMENT_*_URL
//! status                          runs per side effect and state; the switches
//! dry-run on|off                  runs are created but fire nothing (they record what they would send)
//! switch <side-effect> on|off     one side effect on or off
//! channel <account> <channel>     set a client account's chat channel (the incident's fix)
//! rerun-dead [side-effect]        re-run the dead runs of a side effect (default post-to-channel)
//! check-deploy [--database-url U] replay the unfinished runs against this build, writing nothing
//!                                 (the reader role is enough); exit 0: none diverges, 1: some do, 2: error
//! ```
//!
//! Every command uses the database `durastep_placement_pipeline` on the server
//! `DATABASE_URL` names (default `postgres://postgres@127.0.0.1:5432/postgres`),
//! creating it if missing (`check-deploy` never does); `demo` recreates it from nothing, and when nothing
//! answers at that (local) address it runs on a throwaway cluster from the
//! installed server binaries, removed at exit.

mod check_deploy;
mod commands;
mod demo;

use std::process::ExitCode;

use clap::Parser;
use placement_pipeline::cli::{Cli, Command};

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Demo) {
        Command::Demo => demo::run().await,
        Command::Serve => commands::serve().await,
        Command::Simulators => commands::simulators().await,
        Command::Status => commands::status().await,
        Command::DryRun { state } => commands::dry_run(state.is_on()).await,
        Command::Switch { side_effect, state } => commands::switch(side_effect, state.is_on()).await,
        Command::Channel { account, channel } => commands::channel(&account, &channel).await,
        Command::RerunDead { side_effect } => commands::rerun_dead(side_effect).await,
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
