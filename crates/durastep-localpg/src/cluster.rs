//! A throwaway Postgres cluster of its own.
//!
//! [`TempPostgres::start`] runs `initdb` into a fresh directory under the
//! system temp dir and `pg_ctl start` on a free port (127.0.0.1 only, trust
//! auth, user `postgres`). `initdb` refuses to run as root, so when the
//! process runs as root every command runs as the `postgres` OS user
//! (`runuser`), and the directory is handed to that user. Durability
//! settings are left at their defaults (`fsync`, `synchronous_commit` on):
//! tests crash this server. Dropping the handle stops the server
//! (`-m immediate`) and removes the directory. A process killed before it
//! could drop its handle leaves its cluster behind; the next
//! [`TempPostgres::start`] on the machine stops and removes it (the
//! directory records its owner's pid).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tokio::process::Command;

use crate::error::{Error, Result, io};

/// Prefix of the clusters' directories under the system temp dir.
const DIR_PREFIX: &str = "durastep-pg-";
/// The file in a cluster's directory holding the pid of the process that owns it.
const OWNER_FILE: &str = "owner.pid";

/// How `pg_ctl` stops the server.
///
/// ```
/// assert_eq!(durastep_localpg::StopMode::Immediate.as_arg(), "immediate");
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
    /// assert_eq!(durastep_localpg::StopMode::Fast.as_arg(), "fast");
    /// ```
    pub fn as_arg(self) -> &'static str {
        match self {
            StopMode::Immediate => "immediate",
            StopMode::Fast => "fast",
        }
    }
}

/// A running throwaway cluster: `initdb` into a fresh directory under the
/// system temp dir, `pg_ctl start` on a free port (127.0.0.1 only, trust auth,
/// user `postgres`; as root, every command runs as the `postgres` OS user).
/// Dropping it stops the server (`-m immediate`) and removes the directory; a
/// cluster left by a killed process is removed by the next
/// [`TempPostgres::start`] on the machine.
///
/// ```no_run
/// # async fn demo() -> durastep_localpg::Result<()> {
/// let pg = durastep_localpg::TempPostgres::start().await?;
/// println!("{}", pg.url("postgres"));
/// let took = pg.restart(durastep_localpg::StopMode::Immediate).await?;
/// println!("back after {took:?}");
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

fn fresh_dir_name() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("{DIR_PREFIX}{}-{nanos:09}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Extra settings for [`TempPostgres::start_with`]: lines appended to
/// `postgresql.conf`, and files written into the data directory before the
/// server starts (owned by the server's user, mode 0600: a TLS key, say).
///
/// ```
/// let options = durastep_localpg::StartOptions::default()
///     .conf("ssl = on")
///     .file("server.key", b"...".to_vec());
/// # let _ = options;
/// ```
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    conf: Vec<String>,
    files: Vec<(String, Vec<u8>)>,
}

impl StartOptions {
    /// Appends a line to `postgresql.conf`.
    ///
    /// ```
    /// let o = durastep_localpg::StartOptions::default().conf("ssl = on");
    /// # let _ = o;
    /// ```
    pub fn conf(mut self, line: impl Into<String>) -> Self {
        self.conf.push(line.into());
        self
    }

    /// Writes a file (a plain name) into the data directory.
    ///
    /// ```
    /// let o = durastep_localpg::StartOptions::default().file("root.crt", b"...".to_vec());
    /// # let _ = o;
    /// ```
    pub fn file(mut self, name: impl Into<String>, contents: Vec<u8>) -> Self {
        self.files.push((name.into(), contents));
        self
    }
}

impl TempPostgres {
    /// Creates and starts a cluster (`shared_buffers` 16MB, `max_connections`
    /// 100) with the binaries [`crate::find_bin_dir`] finds.
    ///
    /// ```no_run
    /// # async fn demo() -> durastep_localpg::Result<()> {
    /// let pg = durastep_localpg::TempPostgres::start().await?;
    /// # let _ = pg; Ok(()) }
    /// ```
    pub async fn start() -> Result<TempPostgres> {
        let bin = crate::find_bin_dir()?.ok_or(Error::NoServer { address: "(a throwaway cluster)".into() })?;
        TempPostgres::start_in(bin).await
    }

    /// Like [`TempPostgres::start`], with the binaries in `bin`.
    ///
    /// ```no_run
    /// # async fn demo() -> durastep_localpg::Result<()> {
    /// let pg = durastep_localpg::TempPostgres::start_in("/usr/lib/postgresql/15/bin".into()).await?;
    /// # let _ = pg; Ok(()) }
    /// ```
    pub async fn start_in(bin: PathBuf) -> Result<TempPostgres> {
        TempPostgres::start_in_with(bin, &StartOptions::default()).await
    }

    /// Like [`TempPostgres::start`], with extra settings and files (a TLS
    /// certificate and key, say).
    ///
    /// ```no_run
    /// # async fn demo() -> durastep_localpg::Result<()> {
    /// use durastep_localpg::{StartOptions, TempPostgres};
    /// let pg = TempPostgres::start_with(&StartOptions::default().conf("log_connections = on")).await?;
    /// # let _ = pg; Ok(()) }
    /// ```
    pub async fn start_with(options: &StartOptions) -> Result<TempPostgres> {
        let bin = crate::find_bin_dir()?.ok_or(Error::NoServer { address: "(a throwaway cluster)".into() })?;
        TempPostgres::start_in_with(bin, options).await
    }

    async fn start_in_with(bin: PathBuf, options: &StartOptions) -> Result<TempPostgres> {
        remove_abandoned(&bin);
        let dir = std::env::temp_dir().join(fresh_dir_name());
        std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        std::fs::write(dir.join(OWNER_FILE), std::process::id().to_string())
            .map_err(io(format!("writing {}", dir.join(OWNER_FILE).display())))?;
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(io("finding a free port"))?;
            l.local_addr().map_err(io("finding a free port"))?.port()
        };
        let pg = TempPostgres { dir, bin, port, as_postgres: is_root() };
        if pg.as_postgres {
            let status = Command::new(if Path::new("/bin/chown").exists() { "/bin/chown" } else { "chown" })
                .args(["postgres:postgres", &pg.dir.display().to_string()])
                .status()
                .await
                .map_err(io("running chown"))?;
            if !status.success() {
                return Err(Error::Tool { tool: "chown".into(), status: status.to_string(), output: String::new() });
            }
        }
        let data = pg.data().display().to_string();
        // --no-sync: initdb's own final fsync only; the server keeps fsync on. A
        // crash of Postgres (not of the OS) keeps the page cache, so nothing is lost by it.
        pg.run("initdb", &["-D", &data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"]).await?;
        let conf = format!(
            "\n# durastep-localpg\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
             shared_buffers = 16MB\nmax_connections = 100\n",
            pg.dir.display()
        );
        let conf_path = pg.data().join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path).map_err(io(format!("reading {}", conf_path.display())))?;
        text.push_str(&conf);
        for line in &options.conf {
            text.push_str(line);
            text.push('\n');
        }
        std::fs::write(&conf_path, text).map_err(io(format!("writing {}", conf_path.display())))?;
        for (name, contents) in &options.files {
            let path = pg.data().join(name);
            std::fs::write(&path, contents).map_err(io(format!("writing {}", path.display())))?;
            set_private(&path, pg.as_postgres)?;
        }
        let log = pg.dir.join("server.log").display().to_string();
        pg.run("pg_ctl", &["-D", &data, "-l", &log, "-w", "-t", "60", "start"]).await?;
        tracing::debug!(dir = %pg.dir.display(), port, "throwaway Postgres started");
        Ok(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The port it listens on (127.0.0.1).
    ///
    /// ```no_run
    /// # fn demo(pg: &durastep_localpg::TempPostgres) { println!("{}", pg.port()); }
    /// ```
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its directory (data directory, socket, `server.log`).
    ///
    /// ```no_run
    /// # fn demo(pg: &durastep_localpg::TempPostgres) { println!("{}", pg.dir().display()); }
    /// ```
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The directory of the binaries it runs.
    ///
    /// ```no_run
    /// # fn demo(pg: &durastep_localpg::TempPostgres) { println!("{}", pg.bin_dir().display()); }
    /// ```
    pub fn bin_dir(&self) -> &Path {
        &self.bin
    }

    /// The URL of `database` on it, as user `postgres`.
    ///
    /// ```no_run
    /// # fn demo(pg: &durastep_localpg::TempPostgres) { assert!(pg.url("postgres").starts_with("postgres://")); }
    /// ```
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    /// `createdb name` on it.
    ///
    /// ```no_run
    /// # async fn demo(pg: &durastep_localpg::TempPostgres) -> durastep_localpg::Result<()> {
    /// pg.create_database("app").await?;
    /// # Ok(()) }
    /// ```
    pub async fn create_database(&self, name: &str) -> Result<()> {
        let port = self.port.to_string();
        self.run("createdb", &["-h", "127.0.0.1", "-p", &port, "-U", "postgres", name]).await
    }

    /// `pg_ctl restart -m <mode> -w`: returns once the server accepts
    /// connections again, with how long that took.
    ///
    /// ```no_run
    /// # async fn demo(pg: &durastep_localpg::TempPostgres) -> durastep_localpg::Result<()> {
    /// pg.restart(durastep_localpg::StopMode::Fast).await?;
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
    /// # fn demo(pg: &durastep_localpg::TempPostgres) { eprintln!("{}", pg.log_tail(20)); }
    /// ```
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    async fn run(&self, tool: &str, args: &[&str]) -> Result<()> {
        let mut cmd = Command::from(tool_command(&self.bin, tool, self.as_postgres));
        cmd.current_dir(&self.dir);
        let out = cmd.args(args).output().await.map_err(io(format!("running {}", self.bin.join(tool).display())))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(Error::Tool {
                tool: tool.to_owned(),
                status: out.status.to_string(),
                output: format!(
                    "{}{}\nserver log:\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr),
                    self.log_tail(20)
                ),
            })
        }
    }
}

/// `bin/tool`, as the `postgres` OS user when running as root; no stdin.
fn tool_command(bin: &Path, tool: &str, as_postgres: bool) -> std::process::Command {
    let path = bin.join(tool);
    let mut cmd = if as_postgres {
        // runuser lives in /usr/sbin or /sbin, which a user's PATH may lack.
        let runuser = ["/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .unwrap_or("runuser");
        let mut c = std::process::Command::new(runuser);
        c.args(["-u", "postgres", "--"]).arg(path);
        c
    } else {
        std::process::Command::new(path)
    };
    cmd.stdin(std::process::Stdio::null());
    cmd
}

/// Stops the server in `dir` (if it runs) and removes the directory.
fn stop_and_remove(bin: &Path, dir: &Path, as_postgres: bool) {
    let data = dir.join("data");
    if data.join("postmaster.pid").exists() {
        let _ = tool_command(bin, "pg_ctl", as_postgres)
            .args(["-D", &data.display().to_string(), "-m", "immediate", "-w", "stop"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Removes the clusters left by processes that died without dropping their handle.
fn remove_abandoned(bin: &Path) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else { return };
    for entry in entries.filter_map(|e| e.ok()) {
        if !entry.file_name().to_string_lossy().starts_with(DIR_PREFIX) {
            continue;
        }
        let dir = entry.path();
        let Some(owner) = std::fs::read_to_string(dir.join(OWNER_FILE)).ok().and_then(|s| s.trim().parse::<u32>().ok())
        else {
            continue; // being created, or not ours
        };
        // Linux: a live process has /proc/<pid>; elsewhere, leave it.
        if Path::new("/proc/self").exists() && !Path::new(&format!("/proc/{owner}")).exists() {
            tracing::info!(dir = %dir.display(), owner, "removing a throwaway Postgres abandoned by a dead process");
            stop_and_remove(bin, &dir, is_root());
        }
    }
}

impl Drop for TempPostgres {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("durastep-localpg: server log of the throwaway Postgres:\n{}", self.log_tail(40));
        }
        stop_and_remove(&self.bin, &self.dir, self.as_postgres);
    }
}

/// Mode 0600 and, when the server runs as `postgres`, owned by it (Postgres
/// refuses a key file others can read).
fn set_private(path: &Path, as_postgres: bool) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(io(format!("chmod {}", path.display())))?;
    if as_postgres {
        let path = path.display().to_string();
        let status = std::process::Command::new(if Path::new("/bin/chown").exists() { "/bin/chown" } else { "chown" })
            .args(["postgres:postgres", &path])
            .status()
            .map_err(io("running chown"))?;
        if !status.success() {
            return Err(Error::Tool { tool: "chown".into(), status: status.to_string(), output: String::new() });
        }
    }
    Ok(())
}
