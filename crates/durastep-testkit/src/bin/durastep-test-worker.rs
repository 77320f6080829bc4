//! `durastep-test-worker`: one Durastep worker process running the standard
//! test functions (`five-steps`, `slow-step`), for the multi-process tests.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1/test durastep-test-worker --lease-ms 2000 --label w0
//! DURASTEP_FAILPOINTS="step-after-checkpoint=2*exit" durastep-test-worker --database-url ...
//! ```
//!
//! Prints one line, `ready`, on stdout once the engine is built (migrated,
//! functions registered) and the signal handlers are installed; logs go to
//! stderr (`RUST_LOG`). SIGTERM or SIGINT shuts the worker down gracefully,
//! and it exits 0. Failpoints come from `DURASTEP_FAILPOINTS`, and with
//! `--exit-on-stdin-eof` also from stdin at run time: a line
//! `failpoint <seq> <name>=<action>` sets one and is answered on stdout by
//! `failpoint-set <seq>`.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use durastep::{Engine, WorkerOptions};
use durastep_testkit::{FunctionSettings, Ledger, LedgerOptions, functions};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// One Durastep test worker (see the crate docs of durastep-testkit).
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The Postgres to work on.
    #[arg(long, env = "DATABASE_URL")]
    database_url: String,
    /// Name recorded in the ledger's `worker` column.
    #[arg(long, env = "DURASTEP_TEST_LABEL", default_value = "worker")]
    label: String,
    /// Lease of a claimed run, in ms.
    #[arg(long, env = "DURASTEP_TEST_LEASE_MS", default_value_t = 2_000)]
    lease_ms: u64,
    /// Heartbeat interval in ms (the engine caps it at lease / 3).
    #[arg(long, env = "DURASTEP_TEST_HEARTBEAT_MS", default_value_t = 250)]
    heartbeat_ms: u64,
    /// Longest wait between claims, in ms.
    #[arg(long, env = "DURASTEP_TEST_POLL_MS", default_value_t = 50)]
    poll_ms: u64,
    /// How often to reap expired leases, in ms.
    #[arg(long, env = "DURASTEP_TEST_REAP_MS", default_value_t = 200)]
    reap_ms: u64,
    /// Attempts executing at once.
    #[arg(long, env = "DURASTEP_TEST_MAX_IN_FLIGHT", default_value_t = 16)]
    max_in_flight: usize,
    /// Runs claimed per round trip.
    #[arg(long, env = "DURASTEP_TEST_CLAIM_BATCH", default_value_t = 16)]
    claim_batch: usize,
    /// Runs claimed ahead of free slots.
    #[arg(long, env = "DURASTEP_TEST_CLAIM_AHEAD", default_value_t = 16)]
    claim_ahead: usize,
    /// Connections of the engine's main pool (it adds 3 control connections).
    #[arg(long, env = "DURASTEP_TEST_POOL_SIZE", default_value_t = 4)]
    pool_size: u32,
    /// Connections of the ledger's own pool.
    #[arg(long, env = "DURASTEP_TEST_LEDGER_POOL_SIZE", default_value_t = 2)]
    ledger_pool_size: u32,
    /// Ledger commits wait for the WAL flush (for tests that crash Postgres).
    #[arg(long, env = "DURASTEP_TEST_LEDGER_SYNCHRONOUS_COMMIT")]
    ledger_synchronous_commit: bool,
    /// Grace for running attempts at shutdown, in ms.
    #[arg(long, env = "DURASTEP_TEST_SHUTDOWN_GRACE_MS", default_value_t = 5_000)]
    shutdown_grace_ms: u64,
    /// Default sleep in each five-steps body, in ms.
    #[arg(long, env = "DURASTEP_TEST_STEP_DELAY_MS", default_value_t = 0)]
    step_delay_ms: u64,
    /// Default sleep in the slow step, in ms.
    #[arg(long, env = "DURASTEP_TEST_SLOW_STEP_MS", default_value_t = 5_000)]
    slow_step_ms: u64,
    /// Exit at once when stdin reaches end of file (the harness that spawned
    /// this process holds the pipe: if it dies, the worker goes too).
    #[arg(long)]
    exit_on_stdin_eof: bool,
    /// Also register the randomized workload's functions (durastep_testkit::workload).
    #[arg(long, env = "DURASTEP_TEST_WORKLOAD")]
    workload: bool,
    /// Poll only: no LISTEN/NOTIFY wake-ups.
    #[arg(long, env = "DURASTEP_TEST_NO_LISTEN")]
    no_listen: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let args = Args::parse();
    if args.exit_on_stdin_eof {
        // A plain thread: a blocking read must not hold up the runtime's shutdown.
        std::thread::spawn(|| {
            use std::io::BufRead;
            for line in std::io::stdin().lock().lines() {
                let Ok(line) = line else { break };
                command(&line);
            }
            tracing::warn!("stdin closed: the harness is gone; exiting");
            std::process::exit(0);
        });
    }
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("durastep-test-worker: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A command from the harness on stdin. `failpoint <seq> <name>=<action>` sets
/// a failpoint (see `durastep::failpoints`) and answers `failpoint-set <seq>`
/// on stdout once it is in force.
fn command(line: &str) {
    let Some(rest) = line.trim().strip_prefix("failpoint ") else {
        return tracing::warn!(line, "unknown harness command");
    };
    let Some((seq, point)) = rest.split_once(' ') else { return };
    let Some((name, action)) = point.split_once('=') else { return };
    durastep::failpoints::set(name.trim(), action.trim());
    tracing::info!(failpoint = name.trim(), action = action.trim(), "failpoint set by the harness");
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "failpoint-set {seq}");
    let _ = out.flush();
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let ms = Duration::from_millis;
    let ledger_options =
        LedgerOptions { pool_size: args.ledger_pool_size, synchronous_commit: args.ledger_synchronous_commit };
    let ledger = Ledger::connect(&args.database_url, &args.label, ledger_options).await?;
    let settings = FunctionSettings { step_delay: ms(args.step_delay_ms), slow_step: ms(args.slow_step_ms) };
    let options = WorkerOptions {
        max_in_flight: args.max_in_flight,
        claim_batch: args.claim_batch,
        claim_ahead: args.claim_ahead,
        poll_interval: ms(args.poll_ms),
        lease: ms(args.lease_ms),
        heartbeat_interval: ms(args.heartbeat_ms),
        reap_interval: ms(args.reap_ms),
        shutdown_grace: ms(args.shutdown_grace_ms),
        listen: !args.no_listen,
        ..WorkerOptions::default()
    };
    let mut builder =
        Engine::builder().database_url(&args.database_url).max_connections(args.pool_size).worker_options(options);
    for f in functions::all(settings, &ledger) {
        builder = builder.function(f);
    }
    if args.workload {
        for f in durastep_testkit::workload::functions(&ledger) {
            builder = builder.function(f);
        }
    }
    let engine = builder.build().await?;

    // Install the handlers before saying "ready": a SIGTERM right after must be graceful.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("signal received; shutting down");
        stop.cancel();
    });

    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    drop(out);
    tracing::info!(label = %args.label, pid = std::process::id(), "test worker ready");

    engine.run_worker(shutdown).await?;
    tracing::info!("test worker stopped");
    Ok(())
}
