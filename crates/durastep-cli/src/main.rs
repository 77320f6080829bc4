//! `durastep`: inspect and operate Durastep runs from a terminal or a script.
//!
//! Parses the command line, connects (the engine registers no functions and
//! never migrates, except for `durastep migrate`), runs one command and prints
//! its output. Errors are one line on stderr; exit code 1 for anything the user
//! can fix, 2 when the database is unreachable. See this crate's README.md.

mod cli;
mod commands;
mod connect;
mod error;
mod format;
mod output;
mod parse;
mod table;

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use clap::error::ErrorKind;

use crate::cli::{Cli, Command};
use crate::error::CliError;
use crate::output::Out;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => return fail(&CliError::Io(format!("cannot start the async runtime: {e}"))),
    };
    match runtime.block_on(execute(cli)) {
        Ok(text) => {
            let mut stdout = std::io::stdout().lock();
            // A closed pipe (`durastep runs ls | head`) is not an error.
            match stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                Err(e) => fail(&CliError::Io(format!("cannot write the output: {e}"))),
            }
        }
        Err(e) => fail(&e),
    }
}

async fn execute(cli: Cli) -> Result<String, CliError> {
    let url = cli.database_url.as_deref().map(str::trim).filter(|u| !u.is_empty()).ok_or(CliError::NoDatabaseUrl)?;
    let migrate = matches!(cli.command, Command::Migrate);
    let engine = connect::engine(url, migrate).await?;
    let mut out = Out::new(cli.json);
    commands::run(cli.command, &engine, &mut out).await.map_err(|e| e.at(&connect::redact(url)))?;
    Ok(out.into_text())
}

fn fail(e: &CliError) -> ExitCode {
    let message: String = e.to_string().chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    eprintln!("error: {message}");
    e.exit_code()
}

/// Help and version go to stdout with success; a bad command line is one
/// line on stderr and exit code 1 (2 is kept for an unreachable database).
fn usage_error(e: clap::Error) -> ExitCode {
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            let _ = e.print();
            ExitCode::from(1)
        }
        _ => {
            let rendered = e.render().to_string();
            let first = rendered.lines().find(|l| !l.trim().is_empty()).unwrap_or("invalid command line");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            eprintln!("error: {first} (see --help)");
            ExitCode::from(1)
        }
    }
}
