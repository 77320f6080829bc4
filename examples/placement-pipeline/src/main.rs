//! Run with: `cargo run -p placement-pipeline` (the demo, the default), or
//! `cargo run -p placement-pipeline -- <command>`:
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
//! ```
//!
//! Every command uses the database `durastep_placement_pipeline` on the server
//! `DATABASE_URL` names (default `postgres://postgres@127.0.0.1:5432/postgres`),
//! creating it if missing; `demo` recreates it from nothing.

mod commands;
mod demo;

use std::process::ExitCode;

use placement_pipeline::SideEffect;

const USAGE: &str = "usage: placement-pipeline [demo | serve | simulators | status | dry-run on|off | switch <side-effect> on|off | channel <account> <channel> | rerun-dead [side-effect]]";

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let result = match args.as_slice() {
        [] | ["demo"] => demo::run().await,
        ["serve"] => commands::serve().await,
        ["simulators"] => commands::simulators().await,
        ["status"] => commands::status().await,
        ["dry-run", on] => match on_off(on) {
            Some(on) => commands::dry_run(on).await,
            None => Err(USAGE.into()),
        },
        ["switch", side_effect, on] => match (side_effect.parse(), on_off(on)) {
            (Ok(side_effect), Some(on)) => commands::switch(side_effect, on).await,
            (Err(e), _) => Err(Box::new(e) as Box<dyn std::error::Error>),
            (_, None) => Err(USAGE.into()),
        },
        ["channel", account, channel] => commands::channel(account, channel).await,
        ["rerun-dead"] => commands::rerun_dead(SideEffect::ChannelPost).await,
        ["rerun-dead", side_effect] => match side_effect.parse() {
            Ok(side_effect) => commands::rerun_dead(side_effect).await,
            Err(e) => Err(Box::new(e) as Box<dyn std::error::Error>),
        },
        ["-h" | "--help" | "help"] => {
            println!("{USAGE}");
            Ok(())
        }
        _ => Err(USAGE.into()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn on_off(word: &str) -> Option<bool> {
    match word {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    }
}
