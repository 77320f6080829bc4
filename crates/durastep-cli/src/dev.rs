//! `durastep dev`: a Postgres to develop against, with nothing to set up.
//!
//! When something answers at the URL (default
//! `postgres://postgres@127.0.0.1:5432/postgres`, the README's), it migrates
//! that database and says so. Otherwise it starts a throwaway cluster from
//! the installed server binaries (`durastep-localpg`), migrates it, prints
//! where it is and the `DATABASE_URL` to use, and keeps it until Ctrl-C (or
//! SIGTERM), then stops and removes it. With no binaries either, the error is
//! one line saying what to install.

use std::io::Write;

use durastep_localpg::LocalDatabase;

use crate::connect;
use crate::error::CliError;

/// Runs `durastep dev`; everything it says is printed at once (it may run
/// until Ctrl-C), so the returned text is empty.
pub async fn dev(url: &str) -> Result<String, CliError> {
    let db = LocalDatabase::resolve(url).await?;
    let engine = connect::engine(db.url(), true).await?;
    drop(engine);
    let mut stdout = std::io::stdout().lock();
    let Some(cluster) = db.cluster() else {
        let _ = writeln!(stdout, "Postgres answers at {}; the durastep schema is up to date", connect::redact(url));
        return Ok(String::new());
    };
    let _ = writeln!(
        stdout,
        "nothing answers at {}: started a throwaway PostgreSQL cluster from {} in {} (migrated; removed when this stops)",
        connect::redact(url),
        cluster.bin_dir().display(),
        cluster.dir().display()
    );
    let _ = writeln!(stdout, "export DATABASE_URL={}", db.url());
    let _ = writeln!(stdout, "Ctrl-C stops it");
    let _ = stdout.flush();
    drop(stdout);
    stop_signal().await;
    drop(db);
    Ok("throwaway cluster stopped and removed\n".to_owned())
}

/// Ctrl-C, or SIGTERM on Unix.
async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
