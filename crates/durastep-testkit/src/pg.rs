//! A throwaway Postgres cluster of a test's own, for tests that restart or
//! crash the server (the shared server on 5432 serves every other test).
//!
//! [`TempPostgres::start`] runs `initdb` into a fresh directory under the
//! system temp dir and `pg_ctl start` on a free port (127.0.0.1 only, trust
//! auth, user `postgres`). The binaries come from [`PG_BIN_ENV`] or
//! [`DEFAULT_PG_BIN`]. `initdb` refuses to run as root, so when the test runs
//! as root every command runs as the `postgres` OS user (`runuser`), and the
//! directory is handed to that user. Durability settings are left at their
//! defaults (`fsync`, `synchronous_commit` on): these tests crash the server.
//! Dropping the handle stops the server (`-m immediate`) and removes the directory.
//!
//! ```no_run
//! # async fn demo() -> durastep_testkit::Result<()> {
//! use durastep_testkit::pg::{StopMode, TempPostgres};
//! let pg = TempPostgres::start().await?;
//! println!("{}", pg.url("postgres"));
//! let took = pg.restart(StopMode::Immediate).await?;
//! println!("back after {took:?}");
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::process::Command;

use crate::error::{Error, Result, io};

/// Where the Postgres 15 binaries are unless [`PG_BIN_ENV`] says otherwise.
pub const DEFAULT_PG_BIN: &str = "/usr/lib/postgresql/15/bin";
/// Environment variable naming the directory of `initdb` and `pg_ctl`.
pub const PG_BIN_ENV: &str = "DURASTEP_PG_BIN";

/// How `pg_ctl` stops the server.
///
/// ```
/// assert_eq!(durastep_testkit::pg::StopMode::Immediate.as_arg(), "immediate");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopMode {
    /// `-m immediate`: every process is killed at once; the next start runs crash recovery.
    Immediate,
    /// `-m fast`: sessions are terminated (57P01), a checkpoint is written, clean shutdown.
    Fast,
}

impl StopMode {
    /// The value of `pg_ctl -m`.
    ///
    /// ```
    /// assert_eq!(durastep_testkit::pg::StopMode::Fast.as_arg(), "fast");
    /// ```
    pub fn as_arg(self) -> &'static str {
        match self {
            StopMode::Immediate => "immediate",
            StopMode::Fast => "fast",
        }
    }
}

/// A running throwaway cluster; see the [module docs](self).
///
/// ```no_run
/// # async fn demo() -> durastep_testkit::Result<()> {
/// let pg = durastep_testkit::pg::TempPostgres::start().await?;
/// assert!(pg.port() > 0);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct TempPostgres {
    dir: PathBuf,
    bin: PathBuf,
    port: u16,
    as_postgres: bool,
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

impl TempPostgres {
    /// Creates and starts the cluster (`shared_buffers` 16MB, `max_connections` 100).
    ///
    /// ```no_run
    /// # async fn demo() -> durastep_testkit::Result<()> {
    /// let pg = durastep_testkit::pg::TempPostgres::start().await?;
    /// # let _ = pg; Ok(()) }
    /// ```
    pub async fn start() -> Result<TempPostgres> {
        let bin = PathBuf::from(std::env::var(PG_BIN_ENV).unwrap_or_else(|_| DEFAULT_PG_BIN.to_owned()));
        if !bin.join("initdb").exists() {
            return Err(Error::Unexpected(format!(
                "no initdb in {} (install Postgres 15 or set {PG_BIN_ENV})",
                bin.display()
            )));
        }
        let stamp = uuid::Uuid::new_v4().simple().to_string();
        let dir = std::env::temp_dir().join(format!("durastep-pg-{}", &stamp[..12]));
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io("finding a free port"))?;
            l.local_addr().map_err(io("finding a free port"))?.port()
        };
        let pg = TempPostgres { dir, bin, port, as_postgres: is_root() };
        if pg.as_postgres {
            pg.run_plain("chown", &["postgres:postgres", &pg.dir.display().to_string()]).await?;
        }
        let data = pg.data().display().to_string();
        // --no-sync: initdb's own final fsync only; the server keeps fsync on. A
        // crash of Postgres (not of the OS) keeps the page cache, so nothing is lost by it.
        pg.run("initdb", &["-D", &data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"]).await?;
        let conf = format!(
            "\n# durastep-testkit\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             shared_buffers = 16MB\nmax_connections = 100\n",
            pg.dir.display()
        );
        let conf_path = pg.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path).map_err(io(format!("reading {}", conf_path.display())))?;
        text.push_str(&conf);
        std::fs::write(&conf_path, text).map_err(io(format!("writing {}", conf_path.display())))?;
        let log = pg.dir.join("server.log").display().to_string();
        pg.run("pg_ctl", &["-D", &data, "-l", &log, "-w", "-t", "60", "start"]).await?;
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The port it listens on (127.0.0.1).
    ///
    /// ```no_run
    /// # fn demo(pg: &durastep_testkit::pg::TempPostgres) { println!("{}", pg.port()); }
    /// ```
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its directory (data directory, socket, `server.log`).
    ///
    /// ```no_run
    /// # fn demo(pg: &durastep_testkit::pg::TempPostgres) { println!("{}", pg.dir().display()); }
    /// ```
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The URL of `database` on it, as user `postgres`.
    ///
    /// ```no_run
    /// # fn demo(pg: &durastep_testkit::pg::TempPostgres) { assert!(pg.url("postgres").starts_with("postgres://")); }
    /// ```
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// `pg_ctl restart -m <mode> -w`: returns once the server accepts
    /// connections again, with how long that took.
    ///
    /// ```no_run
    /// # async fn demo(pg: &durastep_testkit::pg::TempPostgres) -> durastep_testkit::Result<()> {
    /// pg.restart(durastep_testkit::pg::StopMode::Fast).await?;
    /// # Ok(()) }
    /// ```
    pub async fn restart(&self, mode: StopMode) -> Result<Duration> {
        let started = Instant::now();
        let data = self.data().display().to_string();
        let log = self.dir.join("server.log").display().to_string();
        self.run("pg_ctl", &["-D", &data, "-l", &log, "-m", mode.as_arg(), "-w", "-t", "60", "restart"]).await?;
        Ok(started.elapsed())
    }

    /// The last `lines` lines of the server log.
    ///
    /// ```no_run
    /// # fn demo(pg: &durastep_testkit::pg::TempPostgres) { eprintln!("{}", pg.log_tail(20)); }
    /// ```
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn command(&self, tool: &str) -> Command {
        let path = self.bin.join(tool);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        };
        cmd.stdin(std::process::Stdio::null()).current_dir(&self.dir);
        cmd
    }

    async fn run(&self, tool: &str, args: &[&str]) -> Result<()> {
        let out = self.command(tool).args(args).output().await.map_err(io(format!("running {tool}")))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(Error::Unexpected(format!(
                "{tool} {args:?} failed ({}):\n{}{}\nserver log:\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                self.log_tail(20)
            )))
        }
    }

    async fn run_plain(&self, cmd: &str, args: &[&str]) -> Result<()> {
        let status = Command::new(cmd).args(args).status().await.map_err(io(format!("running {cmd}")))?;
        if status.success() { Ok(()) } else { Err(Error::Unexpected(format!("{cmd} {args:?} failed: {status}"))) }
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        let data = self.data().display().to_string();
        let path = self.bin.join("pg_ctl");
        let mut cmd = if self.as_postgres {
            let mut c = std::process::Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            std::process::Command::new(path)
        };
        let _ = cmd
            .args(["-D", &data, "-m", "immediate", "-w", "stop"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        if std::thread::panicking() {
            eprintln!("durastep-testkit: server log of the throwaway Postgres:\n{}", self.log_tail(40));
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
