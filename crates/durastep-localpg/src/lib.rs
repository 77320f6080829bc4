//! # durastep-localpg: a Postgres to develop against, with nothing to set up
//!
//! Durastep's quickstart, its examples and `durastep dev` need a Postgres.
//! [`LocalDatabase::resolve`] decides which: the one at the URL when
//! something answers there (or when the URL names another machine), else a
//! private throwaway cluster ([`TempPostgres`]) started from the server
//! binaries already installed on this machine ([`find_bin_dir`]: `PATH`,
//! `pg_config --bindir`, `/usr/lib/postgresql/*/bin`, ...), on a free port,
//! removed when the handle is dropped. Nothing is downloaded. With no
//! binaries either, the error ([`Error::NoServer`]) is one line saying what
//! to install.
//!
//! ```no_run
//! # async fn demo() -> durastep_localpg::Result<()> {
//! let db = durastep_localpg::LocalDatabase::resolve(&durastep_localpg::database_url()).await?;
//! if let Some(notice) = db.notice() {
//!     eprintln!("{notice}"); // where the throwaway cluster is, and that it goes at exit
//! }
//! println!("connect to {}", db.url());
//! // ... use it; dropping `db` stops and removes a throwaway cluster.
//! # Ok(()) }
//! ```
//!
//! The same [`TempPostgres`] serves the tests that restart or crash the
//! server (`durastep-testkit` re-exports it).

mod cluster;
mod error;
mod find;
mod url;

pub use cluster::{StartOptions, StopMode, TempPostgres};
pub use error::{Error, Result};
pub use find::{PG_BIN_ENV, find_bin_dir};

use std::time::Duration;

/// The Postgres every Durastep tool uses when `DATABASE_URL` is not set
/// (the README's, the CLI's, the examples').
///
/// ```
/// assert_eq!(durastep_localpg::DEFAULT_URL, "postgres://postgres@127.0.0.1:5432/postgres");
/// ```
pub const DEFAULT_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// `DATABASE_URL` if set and not empty, else [`DEFAULT_URL`].
///
/// ```
/// let url = durastep_localpg::database_url();
/// assert!(url.starts_with("postgres"));
/// ```
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").ok().filter(|u| !u.trim().is_empty()).unwrap_or_else(|| DEFAULT_URL.to_owned())
}

/// How long [`LocalDatabase::resolve`] waits for a TCP answer at the URL's address.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The Postgres to use: the one at the URL, or a throwaway cluster standing
/// in for it. See the [crate docs](crate).
///
/// ```no_run
/// # async fn demo() -> durastep_localpg::Result<()> {
/// let db = durastep_localpg::LocalDatabase::resolve("postgres://postgres@127.0.0.1:5432/app").await?;
/// assert!(db.url().ends_with("/app"));
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct LocalDatabase {
    url: String,
    asked: String,
    cluster: Option<TempPostgres>,
}

impl LocalDatabase {
    /// Uses `url` when something answers at its address, or when its host is
    /// not this machine (a remote server that is down is the caller's error to
    /// report, not a reason to start one here). Otherwise starts a throwaway
    /// cluster from the installed binaries, creates the URL's database in it,
    /// and points [`LocalDatabase::url`] at it (user `postgres`, trust auth,
    /// 127.0.0.1 only).
    ///
    /// ```no_run
    /// # async fn demo() -> durastep_localpg::Result<()> {
    /// let db = durastep_localpg::LocalDatabase::resolve("postgres://postgres@127.0.0.1:1/app").await?;
    /// assert!(db.cluster().is_some()); // nothing listens on port 1
    /// # Ok(()) }
    /// ```
    pub async fn resolve(url: &str) -> Result<LocalDatabase> {
        let parts = url::Parts::parse(url)?;
        let address = parts.address();
        if !parts.is_local() || answers(&parts.host, parts.port).await {
            return Ok(LocalDatabase { url: url.to_owned(), asked: address, cluster: None });
        }
        let bin = find_bin_dir()?.ok_or(Error::NoServer { address: address.clone() })?;
        let cluster = TempPostgres::start_in(bin).await?;
        if parts.database != "postgres" {
            cluster.create_database(&parts.database).await?;
        }
        let url = cluster.url(&parts.database);
        Ok(LocalDatabase { url, asked: address, cluster: Some(cluster) })
    }

    /// For a program's `main` (the quickstart, the examples): resolves
    /// [`database_url`] as [`LocalDatabase::resolve`] does; when that fails
    /// (no server answers and no server binaries are installed, say), prints
    /// the one-line reason on stderr and exits with status 1, rather than
    /// returning an error that `main` would print as a debug dump. Print
    /// [`LocalDatabase::notice`] yourself, where your program prints.
    ///
    /// ```no_run
    /// # async fn demo() {
    /// let db = durastep_localpg::LocalDatabase::resolve_or_exit().await;
    /// if let Some(notice) = db.notice() { eprintln!("{notice}"); }
    /// println!("connect to {}", db.url()); // keep `db` until the end of main
    /// # }
    /// ```
    pub async fn resolve_or_exit() -> LocalDatabase {
        match LocalDatabase::resolve(&database_url()).await {
            Ok(db) => db,
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        }
    }

    /// The URL to connect to.
    ///
    /// ```no_run
    /// # fn demo(db: &durastep_localpg::LocalDatabase) { println!("{}", db.url()); }
    /// ```
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The throwaway cluster, if one was started.
    ///
    /// ```no_run
    /// # fn demo(db: &durastep_localpg::LocalDatabase) {
    /// if let Some(c) = db.cluster() { println!("data in {}", c.dir().display()); }
    /// # }
    /// ```
    pub fn cluster(&self) -> Option<&TempPostgres> {
        self.cluster.as_ref()
    }

    /// One line for the user when a throwaway cluster was started (where it
    /// is, and that it is removed at exit); `None` when the URL was used as given.
    ///
    /// ```no_run
    /// # fn demo(db: &durastep_localpg::LocalDatabase) {
    /// if let Some(line) = db.notice() { eprintln!("{line}"); }
    /// # }
    /// ```
    pub fn notice(&self) -> Option<String> {
        let c = self.cluster.as_ref()?;
        Some(format!(
            "nothing answers at {}: started a throwaway PostgreSQL cluster from {} at {} (data in {}; stopped and \
             removed at exit; set DATABASE_URL to use another server)",
            self.asked,
            c.bin_dir().display(),
            self.url,
            c.dir().display()
        ))
    }
}

/// Whether something accepts a TCP connection at `host:port` within [`PROBE_TIMEOUT`].
async fn answers(host: &str, port: u16) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    matches!(tokio::time::timeout(PROBE_TIMEOUT, tokio::net::TcpStream::connect((host, port))).await, Ok(Ok(_)))
}
