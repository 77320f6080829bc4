//! One `durastep-test-worker` process: spawn it, wait for "ready", signal it
//! (SIGKILL, SIGSTOP, SIGCONT, SIGTERM), wait for its exit, read its log.
//!
//! Signals other than SIGKILL are sent with the `kill` command (the workspace
//! forbids `unsafe`, and one short-lived command per signal costs nothing in a
//! test); SIGKILL uses tokio's `Child::start_kill`. A process that has been
//! reaped is never signalled again, so a recycled pid cannot be hit.

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, ChildStdin, Command};

use crate::error::{Error, Result, io};
use crate::wait::POLL;

/// How a test worker process runs: turned into its command-line flags.
///
/// The defaults are fast test timings: a 2 s lease, 50 ms polls, 200 ms reaps.
///
/// ```
/// use durastep_testkit::WorkerConfig;
/// use std::time::Duration;
/// let config = WorkerConfig { lease: Duration::from_secs(3), ..WorkerConfig::default() }
///     .failpoints("step-after-checkpoint=2*exit");
/// assert!(config.args().contains(&"--lease-ms=3000".to_string()));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// Lease of a claimed run (`--lease-ms`).
    pub lease: Duration,
    /// Heartbeat interval (`--heartbeat-ms`); the engine also caps it at lease / 3.
    pub heartbeat: Duration,
    /// Longest wait between claims (`--poll-ms`).
    pub poll: Duration,
    /// How often the worker reaps expired leases (`--reap-ms`).
    pub reap: Duration,
    /// Attempts executing at once (`--max-in-flight`).
    pub max_in_flight: usize,
    /// Runs claimed per round trip (`--claim-batch`).
    pub claim_batch: usize,
    /// Runs claimed ahead of free slots (`--claim-ahead`; the engine's default, 16).
    pub claim_ahead: usize,
    /// The engine's main pool (`--pool-size`); the engine adds 3 control connections.
    pub pool_size: u32,
    /// The ledger's own pool (`--ledger-pool-size`).
    pub ledger_pool_size: u32,
    /// Ledger commits wait for the WAL flush (`--ledger-synchronous-commit`):
    /// needed only where Postgres itself crashes; see [`crate::LedgerOptions`].
    pub ledger_synchronous_commit: bool,
    /// Grace for running attempts at SIGTERM (`--shutdown-grace-ms`).
    pub shutdown_grace: Duration,
    /// Default sleep in each five-steps body (`--step-delay-ms`).
    pub step_delay: Duration,
    /// Default sleep in the slow step (`--slow-step-ms`).
    pub slow_step: Duration,
    /// LISTEN/NOTIFY wake-ups (off: `--no-listen`).
    pub listen: bool,
    /// `DURASTEP_FAILPOINTS` for the process (see `durastep::failpoints`); `None`
    /// removes any inherited value.
    pub failpoints: Option<String>,
    /// `RUST_LOG` for the process (default: `RUST_LOG` of the test, else
    /// `warn,durastep=info`).
    pub log_filter: Option<String>,
    /// More environment variables for the process.
    pub env: Vec<(String, String)>,
    /// Also register the randomized workload's functions (`--workload`; see
    /// [`crate::workload`]). Off by default: they include a cron function.
    pub workload: bool,
    /// The database URL this worker uses instead of the cluster's (say,
    /// through a [`crate::proxy::Proxy`] listener of its own). The harness's
    /// own pool keeps the cluster's URL.
    pub database_url: Option<String>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            lease: Duration::from_secs(2),
            heartbeat: Duration::from_millis(250),
            poll: Duration::from_millis(50),
            reap: Duration::from_millis(200),
            max_in_flight: 16,
            claim_batch: 16,
            claim_ahead: 16,
            pool_size: 4,
            ledger_pool_size: 2,
            ledger_synchronous_commit: false,
            shutdown_grace: Duration::from_secs(5),
            step_delay: Duration::ZERO,
            slow_step: Duration::from_secs(5),
            listen: true,
            failpoints: None,
            log_filter: None,
            env: Vec::new(),
            workload: false,
            database_url: None,
        }
    }
}

impl WorkerConfig {
    /// The same config with `DURASTEP_FAILPOINTS` set to `spec`.
    ///
    /// ```
    /// let c = durastep_testkit::WorkerConfig::default().failpoints("heartbeat=error");
    /// assert_eq!(c.failpoints.as_deref(), Some("heartbeat=error"));
    /// ```
    #[must_use]
    pub fn failpoints(mut self, spec: impl Into<String>) -> Self {
        self.failpoints = Some(spec.into());
        self
    }

    /// Sets [`WorkerConfig::database_url`].
    ///
    /// ```
    /// let c = durastep_testkit::WorkerConfig::default().database_url("postgres://postgres@127.0.0.1:40001/t1");
    /// assert!(c.database_url.is_some());
    /// ```
    #[must_use]
    pub fn database_url(mut self, url: impl Into<String>) -> Self {
        self.database_url = Some(url.into());
        self
    }

    /// Connections one worker process may open at most: engine pool, 3 control
    /// connections, ledger pool.
    ///
    /// ```
    /// assert_eq!(durastep_testkit::WorkerConfig::default().connections(), 9);
    /// ```
    pub fn connections(&self) -> u32 {
        self.pool_size + 3 + self.ledger_pool_size
    }

    /// The command-line flags of the worker binary for this config.
    ///
    /// ```
    /// let args = durastep_testkit::WorkerConfig::default().args();
    /// assert!(args.contains(&"--poll-ms=50".to_string()));
    /// ```
    pub fn args(&self) -> Vec<String> {
        let ms = |d: Duration| d.as_millis().to_string();
        let mut args = vec![
            format!("--lease-ms={}", ms(self.lease)),
            format!("--heartbeat-ms={}", ms(self.heartbeat)),
            format!("--poll-ms={}", ms(self.poll)),
            format!("--reap-ms={}", ms(self.reap)),
            format!("--max-in-flight={}", self.max_in_flight),
            format!("--claim-batch={}", self.claim_batch),
            format!("--claim-ahead={}", self.claim_ahead),
            format!("--pool-size={}", self.pool_size),
            format!("--ledger-pool-size={}", self.ledger_pool_size),
            format!("--shutdown-grace-ms={}", ms(self.shutdown_grace)),
            format!("--step-delay-ms={}", ms(self.step_delay)),
            format!("--slow-step-ms={}", ms(self.slow_step)),
        ];
        if !self.listen {
            args.push("--no-listen".into());
        }
        if self.ledger_synchronous_commit {
            args.push("--ledger-synchronous-commit".into());
        }
        if self.workload {
            args.push("--workload".into());
        }
        args
    }
}

/// A signal the harness sends to a worker.
///
/// ```
/// assert_eq!(durastep_testkit::Signal::Stop.name(), "STOP");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Signal {
    /// SIGKILL: dies at once, no cleanup.
    Kill,
    /// SIGSTOP: frozen (a stall: GC pause, VM migration, swapped out).
    Stop,
    /// SIGCONT: resumes a stopped process.
    Cont,
    /// SIGTERM: the worker shuts down gracefully and exits 0.
    Term,
}

impl Signal {
    /// The signal's name as `kill -s` takes it.
    ///
    /// ```
    /// assert_eq!(durastep_testkit::Signal::Term.name(), "TERM");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Signal::Kill => "KILL",
            Signal::Stop => "STOP",
            Signal::Cont => "CONT",
            Signal::Term => "TERM",
        }
    }
}

/// A running (or ended) `durastep-test-worker` process. Dropping it kills the process.
///
/// ```no_run
/// # async fn demo(url: &str) -> durastep_testkit::Result<()> {
/// use durastep_testkit::{WorkerConfig, WorkerProcess};
/// use std::time::Duration;
/// let bin = std::path::Path::new("target/debug/durastep-test-worker");
/// let mut w = WorkerProcess::spawn(bin, url, "w0", WorkerConfig::default(), std::path::Path::new("/tmp"))?;
/// w.wait_ready(Duration::from_secs(30)).await?;
/// w.pause().await?;   // SIGSTOP
/// w.resume().await?;  // SIGCONT
/// assert!(w.terminate(Duration::from_secs(10)).await?.success());
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct WorkerProcess {
    label: String,
    config: WorkerConfig,
    pid: u32,
    child: Child,
    /// Held open for the process's life: the worker exits when it closes, so a
    /// test binary that dies (or times out) leaves no worker behind.
    stdin: Option<ChildStdin>,
    /// Sequence number of the last stdin command.
    commands: u64,
    exit: Option<ExitStatus>,
    stdout_path: PathBuf,
    stderr_path: PathBuf,
}

impl WorkerProcess {
    /// Starts the worker binary `bin` against `url`, labelled `label`, with its
    /// stdout and stderr in files under `log_dir` (named after the label).
    /// Its stdin is a pipe this handle holds: the worker exits when the test
    /// process goes away, even if it is killed. Does not wait for "ready":
    /// see [`WorkerProcess::wait_ready`].
    ///
    /// ```no_run
    /// # fn demo(url: &str) -> durastep_testkit::Result<()> {
    /// let w = durastep_testkit::WorkerProcess::spawn(
    ///     std::path::Path::new("target/debug/durastep-test-worker"), url, "w0",
    ///     durastep_testkit::WorkerConfig::default(), std::path::Path::new("/tmp"))?;
    /// println!("pid {}", w.pid());
    /// # Ok(()) }
    /// ```
    pub fn spawn(bin: &Path, url: &str, label: &str, config: WorkerConfig, log_dir: &Path) -> Result<WorkerProcess> {
        std::fs::create_dir_all(log_dir).map_err(io(format!("creating {}", log_dir.display())))?;
        // Unique per spawn even before the pid is known.
        let stamp = uuid::Uuid::new_v4().simple().to_string();
        let stdout_path = log_dir.join(format!("{label}-{}.stdout", &stamp[..8]));
        let stderr_path = log_dir.join(format!("{label}-{}.stderr", &stamp[..8]));
        let stdout = std::fs::File::create(&stdout_path).map_err(io(format!("creating {}", stdout_path.display())))?;
        let stderr = std::fs::File::create(&stderr_path).map_err(io(format!("creating {}", stderr_path.display())))?;

        let mut cmd = Command::new(bin);
        cmd.args(config.args())
            .arg(format!("--label={label}"))
            .arg(format!("--database-url={}", config.database_url.as_deref().unwrap_or(url)))
            .arg("--exit-on-stdin-eof")
            .env_remove("DATABASE_URL")
            .stdin(Stdio::piped())
            .stdout(Stdio::from(stdout))
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true);
        match &config.failpoints {
            Some(spec) => cmd.env("DURASTEP_FAILPOINTS", spec),
            None => cmd.env_remove("DURASTEP_FAILPOINTS"),
        };
        let filter = config
            .log_filter
            .clone()
            .or_else(|| std::env::var("RUST_LOG").ok())
            .unwrap_or_else(|| "warn,durastep=info".to_owned());
        cmd.env("RUST_LOG", filter);
        for (k, v) in &config.env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().map_err(io(format!("spawning {}", bin.display())))?;
        let pid = child.id().unwrap_or(0);
        let stdin = child.stdin.take();
        Ok(WorkerProcess {
            label: label.to_owned(),
            config,
            pid,
            child,
            stdin,
            commands: 0,
            exit: None,
            stdout_path,
            stderr_path,
        })
    }

    /// The label given at spawn (also stored in the ledger's `worker` column).
    ///
    /// ```no_run
    /// # fn demo(w: &durastep_testkit::WorkerProcess) { println!("{}", w.label()); }
    /// ```
    pub fn label(&self) -> &str {
        &self.label
    }

    /// The process id (the ledger's `pid` column).
    ///
    /// ```no_run
    /// # fn demo(w: &durastep_testkit::WorkerProcess) { let _pid: i32 = w.pid() as i32; }
    /// ```
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The config it was started with.
    ///
    /// ```no_run
    /// # fn demo(w: &durastep_testkit::WorkerProcess) { let _ = w.config().lease; }
    /// ```
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Where its stderr (the engine's tracing output) goes.
    ///
    /// ```no_run
    /// # fn demo(w: &durastep_testkit::WorkerProcess) { println!("{}", w.log_path().display()); }
    /// ```
    pub fn log_path(&self) -> &Path {
        &self.stderr_path
    }

    /// Its stderr so far.
    ///
    /// ```no_run
    /// # fn demo(w: &durastep_testkit::WorkerProcess) { assert!(!w.log().contains("panicked")); }
    /// ```
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The last `lines` lines of its stderr.
    ///
    /// ```no_run
    /// # fn demo(w: &durastep_testkit::WorkerProcess) { eprintln!("{}", w.log_tail(20)); }
    /// ```
    pub fn log_tail(&self, lines: usize) -> String {
        let log = self.log();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// The lines of its log that contain `needle`, with the timestamp each
    /// line starts with (the worker's wall clock, as `tracing` prints it);
    /// lines without a readable timestamp are left out.
    ///
    /// ```no_run
    /// # fn demo(w: &durastep_testkit::WorkerProcess) {
    /// for (at, line) in w.log_events("lease not extended in time") {
    ///     println!("{at}: {line}");
    /// }
    /// # }
    /// ```
    pub fn log_events(&self, needle: &str) -> Vec<(chrono::DateTime<chrono::Utc>, String)> {
        self.log()
            .lines()
            .filter(|l| l.contains(needle))
            .filter_map(|l| {
                let stamp = l.split_whitespace().next()?;
                let at = chrono::DateTime::parse_from_rfc3339(stamp).ok()?.with_timezone(&chrono::Utc);
                Some((at, l.to_owned()))
            })
            .collect()
    }

    /// Waits until the worker printed "ready" (engine built, functions
    /// registered, signal handlers installed); fails early if it exits.
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// w.wait_ready(std::time::Duration::from_secs(30)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let out = std::fs::read_to_string(&self.stdout_path).unwrap_or_default();
            if out.lines().any(|l| l.trim() == "ready") {
                return Ok(());
            }
            if let Some(status) = self.try_exit()? {
                return Err(self.exited(status, "waiting for \"ready\""));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!(
                        "worker {} (pid {}) to print \"ready\"; log:\n{}",
                        self.label,
                        self.pid,
                        self.log_tail(20)
                    ),
                    after: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until the log contains `needle`; fails early if the process exits
    /// without having written it.
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// w.wait_for_log("completion fenced", std::time::Duration::from_secs(5)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if self.log().contains(needle) {
                return Ok(());
            }
            if let Some(status) = self.try_exit()? {
                if self.log().contains(needle) {
                    return Ok(());
                }
                return Err(self.exited(status, &format!("waiting for {needle:?} in its log")));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("{needle:?} in the log of {} (pid {}):\n{}", self.label, self.pid, self.log_tail(20)),
                    after: timeout,
                });
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Sets a failpoint in the running process (`name`, and an action in the
    /// `DURASTEP_FAILPOINTS` syntax: `exit`, `2*panic`, `error`, `block`, `off`
    /// ...), and waits until the process confirms it is in force. Hit counts
    /// start again from zero.
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// w.set_failpoint("step-after-body", "1*exit").await?;
    /// # Ok(()) }
    /// ```
    pub async fn set_failpoint(&mut self, name: &str, action: &str) -> Result<()> {
        use tokio::io::AsyncWriteExt;
        self.commands += 1;
        let seq = self.commands;
        let line = format!("failpoint {seq} {name}={action}\n");
        let context = format!("writing to the stdin of {}", self.label);
        let stdin =
            self.stdin.as_mut().ok_or_else(|| Error::NotRunning { label: self.label.clone(), pid: self.pid })?;
        stdin.write_all(line.as_bytes()).await.map_err(io(context.clone()))?;
        stdin.flush().await.map_err(io(context))?;
        let answer = format!("failpoint-set {seq}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let out = std::fs::read_to_string(&self.stdout_path).unwrap_or_default();
            if out.lines().any(|l| l.trim() == answer) {
                return Ok(());
            }
            if let Some(status) = self.try_exit()? {
                // An `exit` failpoint on a hot path (the claim loop of an idle
                // worker, say) can fire between being set and being confirmed:
                // it was in force, and did what it was set to do.
                let fired = format!("failpoint fired failpoint=\"{name}\" action=Exit");
                if action.contains("exit") && status.code() == Some(137) && self.log().contains(&fired) {
                    return Ok(());
                }
                return Err(self.exited(status, &format!("setting failpoint {name}={action}")));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("{} to confirm failpoint {name}={action}", self.label),
                    after: Duration::from_secs(10),
                });
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// How many times failpoint `name` fired in this process so far (the
    /// "failpoint fired" lines of its log; the line is written before an
    /// `exit` action ends the process).
    ///
    /// ```no_run
    /// # fn demo(w: &durastep_testkit::WorkerProcess) { assert_eq!(w.failpoint_fired("heartbeat"), 0); }
    /// ```
    pub fn failpoint_fired(&self, name: &str) -> usize {
        let needle = format!("failpoint fired failpoint=\"{name}\"");
        self.log().lines().filter(|l| l.contains(&needle)).count()
    }

    /// Its exit status, if it has exited (reaps it).
    ///
    /// ```no_run
    /// # fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// if let Some(status) = w.try_exit()? { println!("exited: {status}"); }
    /// # Ok(()) }
    /// ```
    pub fn try_exit(&mut self) -> Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().map_err(io(format!("waiting for {}", self.label)))?;
        }
        Ok(self.exit)
    }

    /// Whether the process is still alive (running or stopped).
    ///
    /// ```no_run
    /// # fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// assert!(w.is_running()?);
    /// # Ok(()) }
    /// ```
    pub fn is_running(&mut self) -> Result<bool> {
        Ok(self.try_exit()?.is_none())
    }

    /// Waits for the process to exit on its own, for at most `timeout`.
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// // A worker with DURASTEP_FAILPOINTS="step-after-checkpoint=2*exit" exits with 137.
    /// let status = w.wait_exit(std::time::Duration::from_secs(20)).await?;
    /// assert_eq!(status.code(), Some(137));
    /// # Ok(()) }
    /// ```
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.exit {
            return Ok(status);
        }
        match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(status) => {
                let status = status.map_err(io(format!("waiting for {}", self.label)))?;
                self.exit = Some(status);
                Ok(status)
            }
            Err(_) => Err(Error::Timeout {
                what: format!("worker {} (pid {}) to exit; log:\n{}", self.label, self.pid, self.log_tail(20)),
                after: timeout,
            }),
        }
    }

    /// Sends a signal. Fails with [`Error::NotRunning`] if the process has already been reaped.
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// w.signal(durastep_testkit::Signal::Stop).await?;
    /// # Ok(()) }
    /// ```
    pub async fn signal(&mut self, signal: Signal) -> Result<()> {
        if self.try_exit()?.is_some() {
            return Err(Error::NotRunning { label: self.label.clone(), pid: self.pid });
        }
        if signal == Signal::Kill {
            return self.child.start_kill().map_err(io(format!("SIGKILL to {}", self.label)));
        }
        let context = format!("kill -s {} {} ({})", signal.name(), self.pid, self.label);
        let status = Command::new("kill")
            .args(["-s", signal.name(), &self.pid.to_string()])
            .stdin(Stdio::null())
            .status()
            .await
            .map_err(io(context.clone()))?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Io { context, source: std::io::Error::other(format!("kill exited with {status}")) })
        }
    }

    /// SIGKILL, then waits until the process is gone (reaped). Returns its status.
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// let status = w.kill().await?;
    /// use std::os::unix::process::ExitStatusExt;
    /// assert_eq!(status.signal(), Some(9));
    /// # Ok(()) }
    /// ```
    pub async fn kill(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.try_exit()? {
            return Ok(status);
        }
        self.signal(Signal::Kill).await?;
        self.wait_exit(Duration::from_secs(10)).await
    }

    /// SIGSTOP: the process freezes (its connections stay open, its timers do not fire).
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// w.pause().await?;
    /// # Ok(()) }
    /// ```
    pub async fn pause(&mut self) -> Result<()> {
        self.signal(Signal::Stop).await
    }

    /// SIGCONT: a stopped process runs again.
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// w.resume().await?;
    /// # Ok(()) }
    /// ```
    pub async fn resume(&mut self) -> Result<()> {
        self.signal(Signal::Cont).await
    }

    /// SIGTERM (after a SIGCONT, in case it is stopped), then waits for the
    /// graceful shutdown to end. Returns the exit status (0 when all went well).
    ///
    /// ```no_run
    /// # async fn demo(mut w: durastep_testkit::WorkerProcess) -> durastep_testkit::Result<()> {
    /// assert!(w.terminate(std::time::Duration::from_secs(10)).await?.success());
    /// # Ok(()) }
    /// ```
    pub async fn terminate(&mut self, timeout: Duration) -> Result<ExitStatus> {
        if let Some(status) = self.try_exit()? {
            return Ok(status);
        }
        self.signal(Signal::Term).await?;
        // A stopped process would only act on SIGTERM once continued.
        let _ = self.signal(Signal::Cont).await;
        self.wait_exit(timeout).await
    }

    fn exited(&self, status: ExitStatus, doing: &str) -> Error {
        Error::WorkerExited {
            label: self.label.clone(),
            pid: self.pid,
            status: describe(status),
            doing: doing.to_owned(),
            log_tail: self.log_tail(30),
        }
    }
}

/// An exit status in words: "exit code 137" or "signal 9".
///
/// ```
/// use std::os::unix::process::ExitStatusExt;
/// let s = std::process::ExitStatus::from_raw(9);
/// assert_eq!(durastep_testkit::process::describe(s), "signal 9");
/// ```
pub fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("signal {sig}"),
        _ => status.to_string(),
    }
}
