//! The command line (clap): every command with its arguments and help.
//! Unknown commands, flags and values are errors.

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::SideEffect;

/// Story A: a CRM stage-change webhook fans out into one durable run per
/// side effect. Every command uses the database `durastep_placement_pipeline`
/// on the server DATABASE_URL names (default
/// postgres://postgres@127.0.0.1:5432/postgres), creating it if missing
/// (`check-deploy` never creates it).
#[derive(Debug, Parser)]
#[command(name = "placement-pipeline", max_term_width = 100)]
pub struct Cli {
    /// What to do (default: `demo`).
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The Monday burst and the channel-name incident, against simulators
    /// (recreates the database; with nothing answering at DATABASE_URL, runs
    /// on a throwaway cluster removed at exit).
    Demo,
    /// Receiver and worker against the real systems (PLACEMENT_*_URL).
    Serve,
    /// The six simulators on the machine's clock, printing PLACEMENT_*_URL.
    Simulators,
    /// Runs per side effect and state; the switches.
    Status,
    /// Dry run: runs are created but fire nothing (they record what they would send).
    DryRun {
        /// on or off.
        state: OnOff,
    },
    /// Turns one side effect on or off.
    Switch {
        /// The side effect (its function id, e.g. post-to-channel).
        #[arg(value_parser = parse_side_effect)]
        side_effect: SideEffect,
        /// on or off.
        state: OnOff,
    },
    /// Sets a client account's chat channel (the incident's fix).
    Channel {
        /// The client account.
        account: String,
        /// The channel, e.g. #client-initech.
        channel: String,
    },
    /// Re-runs the dead runs of a side effect, from the step that failed.
    RerunDead {
        /// The side effect (default post-to-channel).
        #[arg(value_parser = parse_side_effect, default_value = "post-to-channel")]
        side_effect: SideEffect,
    },
    /// Replays the unfinished runs against this build, writing nothing; exit
    /// 0: none diverges, 1: some do, 2: error (for CI, before a deploy).
    CheckDeploy(CheckDeployArgs),
}

/// `placement-pipeline check-deploy`
#[derive(Debug, Args)]
pub struct CheckDeployArgs {
    /// The database to check (default: `durastep_placement_pipeline` on
    /// DATABASE_URL's server; never created). The reader role of
    /// docs/security.md is enough.
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
}

/// A switch position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    /// On.
    On,
    /// Off.
    Off,
}

impl OnOff {
    /// `true` for on.
    pub fn is_on(self) -> bool {
        self == OnOff::On
    }
}

fn parse_side_effect(s: &str) -> Result<SideEffect, String> {
    s.parse::<SideEffect>().map_err(|e| {
        let known: Vec<&str> = SideEffect::ALL.iter().map(|e| e.function_id()).collect();
        format!("{e} (one of: {})", known.join(", "))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_parse_and_typos_fail() {
        assert!(Cli::try_parse_from(["placement-pipeline"]).unwrap().command.is_none());
        let Some(Command::DryRun { state }) = Cli::try_parse_from(["p", "dry-run", "on"]).unwrap().command else {
            panic!()
        };
        assert!(state.is_on());
        assert!(Cli::try_parse_from(["p", "dry-run", "yes"]).is_err());
        assert!(Cli::try_parse_from(["p", "demo", "--fast"]).is_err());
        assert!(Cli::try_parse_from(["p", "switch", "post-to-chanel", "on"]).is_err());
        let Some(Command::RerunDead { side_effect }) = Cli::try_parse_from(["p", "rerun-dead"]).unwrap().command else {
            panic!()
        };
        assert_eq!(side_effect, SideEffect::ChannelPost);
    }
}
