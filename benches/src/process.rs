//! Worker processes: the `bench-worker` binary, driven over stdin/stdout.
//!
//! Protocol: the worker connects and prints `ready`; the bench writes `go` and
//! the worker starts `run_worker`; the bench closes stdin and the worker shuts
//! down gracefully and exits.

use std::process::Stdio;
use std::time::Duration;

use durastep::WorkerOptions;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, Command};

/// How a bench worker process runs.
///
/// ```
/// let c = durastep_benches::process::WorkerConfig { in_flight: 64, ..Default::default() };
/// assert_eq!(c.to_args()[0], "in_flight=64");
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerConfig {
    /// `WorkerOptions::max_in_flight`.
    pub in_flight: usize,
    /// `WorkerOptions::writers` (group-commit writer tasks).
    pub writers: usize,
    /// `WorkerOptions::claim_batch`.
    pub claim_batch: usize,
    /// `WorkerOptions::claim_ahead`.
    pub claim_ahead: usize,
    /// The engine's main pool size.
    pub pool: u32,
    /// `WorkerOptions::listen`.
    pub listen: bool,
    /// Also register [`crate::functions::flowed`], a function with a flow
    /// rule (the worker then claims with the fast and the full claim).
    pub flow: bool,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        let d = WorkerOptions::default();
        WorkerConfig {
            in_flight: d.max_in_flight,
            writers: d.writers,
            claim_batch: d.claim_batch,
            claim_ahead: d.claim_ahead,
            pool: 10,
            listen: true,
            flow: false,
        }
    }
}

impl WorkerConfig {
    /// The command-line form, `key=value` words.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            format!("in_flight={}", self.in_flight),
            format!("writers={}", self.writers),
            format!("claim_batch={}", self.claim_batch),
            format!("claim_ahead={}", self.claim_ahead),
            format!("pool={}", self.pool),
            format!("listen={}", self.listen),
            format!("flow={}", self.flow),
        ]
    }

    /// Parses the command-line form; unknown or missing keys keep their defaults.
    ///
    /// ```
    /// use durastep_benches::process::WorkerConfig;
    /// let c = WorkerConfig { in_flight: 4, writers: 3, claim_batch: 8, claim_ahead: 2, pool: 5, listen: false, flow: true };
    /// assert_eq!(WorkerConfig::from_args(c.to_args()), c);
    /// ```
    pub fn from_args(args: impl IntoIterator<Item = String>) -> WorkerConfig {
        let mut c = WorkerConfig::default();
        for arg in args {
            let Some((k, v)) = arg.split_once('=') else { continue };
            match k {
                "in_flight" => c.in_flight = v.parse().unwrap_or(c.in_flight),
                "writers" => c.writers = v.parse().unwrap_or(c.writers),
                "claim_batch" => c.claim_batch = v.parse().unwrap_or(c.claim_batch),
                "claim_ahead" => c.claim_ahead = v.parse().unwrap_or(c.claim_ahead),
                "pool" => c.pool = v.parse().unwrap_or(c.pool),
                "listen" => c.listen = v.parse().unwrap_or(c.listen),
                "flow" => c.flow = v.parse().unwrap_or(c.flow),
                _ => {}
            }
        }
        c
    }

    /// The worker options this config stands for.
    pub fn options(&self) -> WorkerOptions {
        WorkerOptions {
            max_in_flight: self.in_flight,
            writers: self.writers,
            claim_batch: self.claim_batch,
            claim_ahead: self.claim_ahead,
            listen: self.listen,
            ..Default::default()
        }
    }
}

/// One running `bench-worker` process.
///
/// ```no_run
/// # async fn demo(url: &str) {
/// use durastep_benches::process::{WorkerConfig, WorkerProcess};
/// let mut w = WorkerProcess::spawn("target/release/bench-worker", url, &WorkerConfig::default()).await;
/// w.go().await;
/// w.stop().await;
/// # }
/// ```
pub struct WorkerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
}

impl WorkerProcess {
    /// Starts a worker process on `url` and waits until it is connected.
    pub async fn spawn(binary: &str, url: &str, config: &WorkerConfig) -> WorkerProcess {
        let mut child = Command::new(binary)
            .arg(url)
            .args(config.to_args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {binary}: {e}"));
        let stdin = child.stdin.take();
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let ready = tokio::time::timeout(Duration::from_secs(30), lines.next_line()).await;
        match ready {
            Ok(Ok(Some(line))) if line == "ready" => {}
            other => panic!("bench-worker did not get ready: {other:?}"),
        }
        WorkerProcess { child, stdin }
    }

    /// The process id (for its RSS in /proc).
    pub fn pid(&self) -> u32 {
        self.child.id().expect("running worker has a pid")
    }

    /// Starts claiming.
    pub async fn go(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(b"go\n").await.expect("tell worker to go");
        stdin.flush().await.expect("flush");
    }

    /// Asks for a graceful shutdown and waits for the exit (kills this child if it takes over 30 s).
    pub async fn stop(mut self) {
        drop(self.stdin.take());
        match tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await {
            Ok(Ok(status)) if status.success() => {}
            Ok(other) => eprintln!("bench-worker exited with {other:?}"),
            Err(_) => {
                eprintln!("bench-worker did not stop in 30 s; killing it");
                let _ = self.child.kill().await;
            }
        }
    }
}
