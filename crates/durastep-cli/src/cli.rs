//! The command line: every command, its arguments and their help.
//!
//! Adding a command is one variant of [`Command`] here and one arm in
//! `commands::run`.

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use durastep::RunState;
use durastep::inspect::Cursor;
use serde_json::Value;
use uuid::Uuid;

use crate::parse;

/// Inspect and operate Durastep runs: what happened to a run, why another
/// one is not running, replay, cancel, send, prune.
#[derive(Debug, Parser)]
#[command(name = "durastep", version, about, max_term_width = 100)]
pub struct Cli {
    /// The Postgres to use (the password is never printed)
    /// [default: postgres://postgres@127.0.0.1:5432/postgres]. Prefer the
    /// DATABASE_URL variable or --database-url-file: a URL on the command line
    /// is visible to other local users in `ps`.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true, value_name = "URL")]
    pub database_url: Option<String>,
    /// Read the database URL from this file (its first line).
    #[arg(long, env = "DATABASE_URL_FILE", global = true, value_name = "PATH", conflicts_with = "database_url")]
    pub database_url_file: Option<std::path::PathBuf>,
    /// Machine-readable JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply Durastep's schema migrations (the only command that changes the schema).
    Migrate,
    /// Runs per function and state, and the last hour per minute.
    Stats,
    /// The registered functions: triggers, attempts, cron, flow-control rules.
    Functions,
    /// List, show, replay and cancel runs.
    #[command(subcommand)]
    Runs(RunsCommand),
    /// Why a run is not running (or what it is doing), in one line.
    Why {
        /// The run.
        #[arg(value_parser = parse::run_id)]
        id: Uuid,
    },
    /// Send an event; prints the receipt (event id and the runs it started).
    Send(SendArgs),
    /// Stored events.
    #[command(subcommand)]
    Events(EventsCommand),
    /// Delete finished runs (with their steps, history and events) older than a bound.
    ///
    /// Without --yes it first counts what it would delete, and refuses (deleting
    /// nothing, printing that count) when that is every finished run there is,
    /// or when --older-than is under 1h. --dry-run only counts.
    Prune(PruneArgs),
    /// Serve the web dashboard until Ctrl-C (loopback only unless a token is set).
    Serve(ServeArgs),
    /// A Postgres to develop against: the one at the URL if it answers, else a
    /// throwaway cluster from the installed server binaries (kept until Ctrl-C,
    /// then removed); migrates it and prints its DATABASE_URL.
    Dev,
}

/// `durastep serve`
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// The address to listen on (HOST:PORT; localhost:PORT works); a
    /// non-loopback address needs --token.
    #[arg(long, default_value = "127.0.0.1:7070", value_parser = parse::listen_addr)]
    pub addr: std::net::SocketAddr,
    /// Another host name browsers use for the dashboard (repeatable); requests
    /// for names not allowed get 421 (against DNS rebinding).
    #[arg(long = "allow-host", value_name = "NAME")]
    pub allow_hosts: Vec<String>,
    /// Browsers reach it over TLS (a TLS proxy in front): Secure session cookie.
    #[arg(long)]
    pub behind_tls: bool,
    /// No replay or cancel; connects read-only, so a SELECT-only role suffices.
    #[arg(long)]
    pub read_only: bool,
    /// The access token every page asks for (at least 16 characters).
    #[arg(long, env = "DURASTEP_DASHBOARD_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Without a token (loopback only): show step outputs, event data, keys and
    /// error texts anyway.
    #[arg(long)]
    pub show_data: bool,
}

/// `durastep runs ...`
#[derive(Debug, Subcommand)]
pub enum RunsCommand {
    /// List runs, newest first, one page at a time.
    Ls(LsArgs),
    /// One run: its event, executions, state history and step timeline.
    Show(ShowArgs),
    /// Re-run a failed (or cancelled) run from its failed step, or every
    /// matching one (needs --function or --state).
    Replay(ReplayArgs),
    /// Cancel a run that has not finished.
    Cancel(CancelArgs),
    /// Queue a diverged run again as it is, once code that fits its recorded
    /// steps is deployed (it is checked again; still diverging, it is parked again).
    Resume(ResumeArgs),
    /// Forget a diverged run's entries from a position on (their results,
    /// journal entries, open waits) and queue it: the deployed code executes
    /// them afresh, their step bodies included.
    Discard(DiscardArgs),
}

/// Which runs: every condition given must hold.
#[derive(Debug, Clone, Default, Args)]
pub struct FilterArgs {
    /// Runs of this function.
    #[arg(long, value_name = "ID")]
    pub function: Option<String>,
    /// Runs in this state (repeat for several): queued, running, sleeping,
    /// waiting, completed, failed, cancelled, skipped.
    #[arg(long = "state", value_name = "STATE", value_parser = parse::state)]
    pub states: Vec<RunState>,
    /// Created at or after: RFC 3339, or a time ago (2h, 30m ago, 7d ago) on
    /// the database's clock.
    #[arg(long, value_name = "TIME", value_parser = parse::time)]
    pub since: Option<parse::TimeArg>,
    /// Created before: RFC 3339, or a time ago.
    #[arg(long, value_name = "TIME", value_parser = parse::time)]
    pub until: Option<parse::TimeArg>,
    /// Event data holds VALUE at POINTER (VALUE is JSON if it parses, else a string).
    #[arg(long, value_name = "POINTER=VALUE", value_parser = parse::key)]
    pub key: Option<(String, Value)>,
    /// Started by the event sent with this idempotency key.
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
    /// Started by events of this name.
    #[arg(long, value_name = "NAME")]
    pub event: Option<String>,
}

/// `durastep runs ls`
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Filters.
    #[command(flatten)]
    pub filter: FilterArgs,
    /// Runs per page (default 50, at most 1000).
    #[arg(long, value_name = "N")]
    pub limit: Option<u32>,
    /// The page after this cursor (printed under the previous page).
    #[arg(long, value_name = "CURSOR")]
    pub after: Option<Cursor>,
    /// Do not cut long errors.
    #[arg(long)]
    pub full: bool,
}

/// `durastep runs show`
#[derive(Debug, Args)]
pub struct ShowArgs {
    /// The run.
    #[arg(value_parser = parse::run_id)]
    pub id: Uuid,
    /// Show outputs, data and errors in full instead of cut to about 200 characters.
    #[arg(long)]
    pub full: bool,
}

/// `durastep runs replay`
#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The run to replay; without it, every failed (or cancelled, with
    /// --state cancelled) run matching the filters.
    #[arg(value_parser = parse::run_id)]
    pub id: Option<Uuid>,
    /// Discard the stored step results: every step runs again.
    #[arg(long)]
    pub from_start: bool,
    /// Filters for a bulk replay.
    #[command(flatten)]
    pub filter: FilterArgs,
}

/// `durastep runs cancel`
#[derive(Debug, Args)]
pub struct CancelArgs {
    /// The run.
    #[arg(value_parser = parse::run_id)]
    pub id: Uuid,
    /// Kept on the run as its cancel reason.
    #[arg(long, default_value = "cancelled with the durastep CLI")]
    pub reason: String,
}

/// `durastep runs resume`
#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// The diverged run.
    #[arg(value_parser = parse::run_id)]
    pub id: Uuid,
}

/// `durastep runs discard`
#[derive(Debug, Args)]
pub struct DiscardArgs {
    /// The diverged run.
    #[arg(value_parser = parse::run_id)]
    pub id: Uuid,
    /// The first position to forget (from 0); `durastep why ID` shows where
    /// the run diverged, which keeps everything before it.
    #[arg(long, value_name = "POSITION")]
    pub from: u32,
}

/// `durastep send`
#[derive(Debug, Args)]
pub struct SendArgs {
    /// The event name.
    pub name: String,
    /// The event data as JSON text (`-` reads it from stdin).
    #[arg(value_name = "JSON")]
    pub data: String,
    /// Makes the send idempotent: a second send with this key creates nothing.
    #[arg(long, value_name = "KEY")]
    pub idempotency_key: Option<String>,
}

/// `durastep events ...`
#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// List stored events, newest first.
    Ls(EventsLsArgs),
}

/// `durastep events ls`
#[derive(Debug, Args)]
pub struct EventsLsArgs {
    /// Events of this name.
    #[arg(long)]
    pub name: Option<String>,
    /// Events per page (default 50, at most 1000).
    #[arg(long, value_name = "N")]
    pub limit: Option<u32>,
    /// The page after this cursor.
    #[arg(long, value_name = "CURSOR")]
    pub after: Option<Cursor>,
    /// Do not cut long data.
    #[arg(long)]
    pub full: bool,
}

/// `durastep prune`
#[derive(Debug, Args)]
pub struct PruneArgs {
    /// Delete runs that finished longer ago than this (30d, 12h, 2w).
    #[arg(long, value_name = "AGE", value_parser = parse::duration)]
    pub older_than: Duration,
    /// Delete even when that is every finished run, or --older-than is under
    /// 1h (without it, prune refuses then and says how many runs it would delete).
    #[arg(long)]
    pub yes: bool,
    /// Say how many runs would be deleted, and delete nothing (read-only).
    #[arg(long)]
    pub dry_run: bool,
}
