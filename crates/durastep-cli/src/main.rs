//! `durastep`: inspect and operate Durastep runs from a terminal or a script.
//!
//! Parses the command line, connects (the engine registers no functions and
//! never migrates, except for `durastep migrate`), runs one command and prints
//! its output. Errors are one line on stderr; exit code 1 for anything the user
//! can fix, 2 when the database is unreachable. See this crate's README.md.

mod cli;
mod commands;
mod connect;
mod dev;
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
use crate::connect::Secrets;
use crate::error::CliError;
use crate::output::Out;

fn main() -> ExitCode {
    // Known before parsing, so a bad command line is reported as JSON too.
    let json = std::env::args().skip(1).take_while(|a| a != "--").any(|a| a == "--json");
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_error(e, json),
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            return fail(&CliError::Io(format!("cannot start the async runtime: {e}")), json, &Secrets::default());
        }
    };
    let url = match database_url(&cli) {
        Ok(url) => url,
        Err(e) => return fail(&e, json, &Secrets::default()),
    };
    let secrets = Secrets::of(&url);
    match runtime.block_on(execute(cli, &url)) {
        Ok(text) => {
            let mut stdout = std::io::stdout().lock();
            // A closed pipe (`durastep runs ls | head`) is not an error.
            match stdout.write_all(secrets.scrub(&text).as_bytes()).and_then(|()| stdout.flush()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                Err(e) => fail(&CliError::Io(format!("cannot write the output: {e}")), json, &secrets),
            }
        }
        Err(e) => fail(&e, json, &secrets),
    }
}

/// The database URL: `--database-url` / `DATABASE_URL`, or the first line of
/// `--database-url-file` / `DATABASE_URL_FILE` (which keeps it out of `ps`);
/// without either, the local default (the README's).
fn database_url(cli: &Cli) -> Result<String, CliError> {
    let url = match (&cli.database_url, &cli.database_url_file) {
        (_, Some(path)) => std::fs::read_to_string(path)
            .map_err(|e| CliError::Io(format!("cannot read the database URL from {}: {e}", path.display())))?
            .lines()
            .next()
            .unwrap_or("")
            .to_owned(),
        (Some(url), None) => url.clone(),
        (None, None) => String::new(),
    };
    let url = url.trim();
    Ok(if url.is_empty() { durastep_localpg::DEFAULT_URL.to_owned() } else { url.to_owned() })
}

async fn execute(cli: Cli, url: &str) -> Result<String, CliError> {
    if matches!(cli.command, Command::Dev) {
        return dev::dev(url).await;
    }
    let mut out = Out::new(cli.json);
    commands::run(cli.command, url, &mut out).await.map_err(|e| e.at(&connect::redact(url)))?;
    Ok(out.into_text())
}

/// Prints the error (one line, or one JSON object with `--json`) on stderr,
/// with every password of the URL replaced by `***`.
fn fail(e: &CliError, json: bool, secrets: &Secrets) -> ExitCode {
    let message: String = secrets.scrub(&e.to_string()).chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let code = e.exit_code();
    print_error(e.kind(), &message, json);
    code
}

fn print_error(kind: &str, message: &str, json: bool) {
    if json {
        let value = serde_json::json!({ "error": { "kind": kind, "message": message } });
        eprintln!("{value}");
    } else {
        eprintln!("error: {message}");
    }
}

/// Help and version go to stdout with success; a bad command line is one
/// line on stderr (naming what is missing or wrong) and exit code 1 (2 is
/// kept for an unreachable database).
fn usage_error(e: clap::Error, json: bool) -> ExitCode {
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            ExitCode::SUCCESS
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand if !json => {
            let _ = e.print();
            ExitCode::from(1)
        }
        _ => {
            let rendered = e.render().to_string();
            // The first line, plus the names clap lists under it (the missing
            // arguments), without the usage block and the help hint.
            let mut lines = rendered
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .take_while(|l| !l.starts_with("Usage:") && !l.starts_with("For more information"));
            let first = lines.next().unwrap_or("invalid command line");
            let first = first.strip_prefix("error: ").unwrap_or(first);
            let rest: Vec<&str> = lines.collect();
            let message = if rest.is_empty() { first.to_owned() } else { format!("{first} {}", rest.join(", ")) };
            print_error("usage", &format!("{message} (see --help)"), json);
            ExitCode::from(1)
        }
    }
}
