//! The whole pipeline in one process against the simulators: what the demo
//! runs and what the end-to-end tests drive. It builds the engine on a
//! database, applies both schemas, starts the six simulators, the webhook
//! receiver and the workers, and can wait for every run to finish while
//! moving the database clock over backoff delays instead of waiting them out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use durastep::{Engine, Function, WorkerHandle, WorkerOptions};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::task::AbortOnDropHandle;

use crate::clock::Clock;
use crate::http::Client;
use crate::receiver::{self, Accepted, ReceiverStats};
use crate::settings::{self, Settings};
use crate::side_effects::{self, Pipeline};
use crate::simulators::{Faults, Simulators};
use crate::stage::StageChange;

/// What can go wrong while running the stack.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    /// A database call failed.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// The example's migrations failed.
    #[error("migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// Durastep refused or failed.
    #[error("durastep: {0}")]
    Durastep(#[from] durastep::Error),
    /// A server could not start.
    #[error("network: {0}")]
    Io(#[from] std::io::Error),
    /// An HTTP call failed.
    #[error("http: {0}")]
    Http(#[from] reqwest::Error),
    /// The receiver refused a webhook.
    #[error("the receiver answered {status}: {body}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The answer's body.
        body: String,
    },
    /// Runs did not finish in time.
    #[error("{unfinished} runs still unfinished after {waited:?}")]
    Timeout {
        /// Runs not finished.
        unfinished: i64,
        /// How long it waited.
        waited: Duration,
    },
}

/// How to set the stack up.
#[derive(Debug, Clone)]
pub struct StackConfig {
    /// Failures the simulators inject.
    pub faults: Faults,
    /// The channels that exist in the chat workspace.
    pub chat_channels: Vec<String>,
    /// The channel configuration: (client account, channel), as stored in
    /// `placement.channels` (it may hold a typo that the workspace lacks).
    pub channel_config: Vec<(String, String)>,
    /// How many workers to run side by side.
    pub workers: usize,
    /// Connections in the main pool.
    pub max_connections: u32,
    /// While [`Stack::settle`] waits, print a progress line this often (the
    /// demo: a long wait is never silent); `None` prints nothing (the tests).
    pub progress_every: Option<Duration>,
}

impl Default for StackConfig {
    fn default() -> Self {
        let accounts = crate::burst::CLIENT_ACCOUNTS;
        StackConfig {
            faults: Faults::default(),
            chat_channels: accounts.iter().map(|a| crate::burst::channel_of(a)).collect(),
            channel_config: accounts.iter().map(|a| ((*a).to_owned(), crate::burst::channel_of(a))).collect(),
            workers: 1,
            max_connections: 8,
            progress_every: None,
        }
    }
}

/// Worker timings for the demo and tests: short polls so a moved clock is
/// noticed at once; the rest as in production.
pub fn worker_options() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_millis(50),
        reap_interval: Duration::from_millis(500),
        ..Default::default()
    }
}

/// The running pipeline.
pub struct Stack {
    /// The engine (with the six functions registered).
    pub engine: Engine,
    /// The database pool.
    pub pool: PgPool,
    /// The switches and channel configuration.
    pub settings: Settings,
    /// The six simulators.
    pub sims: Simulators,
    /// What the receiver has handled.
    pub receiver_stats: Arc<ReceiverStats>,
    /// The receiver's base URL.
    pub receiver_url: String,
    /// How far the database clock has been moved in all, and in how many jumps.
    pub clock_moved: Arc<std::sync::Mutex<(Duration, u32)>>,
    progress_every: Option<Duration>,
    http: reqwest::Client,
    workers: Vec<WorkerHandle>,
    _receiver: AbortOnDropHandle<()>,
}

impl Stack {
    /// Builds and starts everything on the database `options` points at.
    pub async fn start(options: PgConnectOptions, config: StackConfig) -> Result<Stack, StackError> {
        let pool = PgPoolOptions::new().max_connections(config.max_connections).connect_with(options).await?;
        durastep::migrate(&pool).await?;
        settings::migrate(&pool).await?;
        let settings = Settings::new(pool.clone());
        for (account, channel) in &config.channel_config {
            settings.set_channel(account, channel).await?;
        }
        let clock = Clock::Database(pool.clone());
        let channels: Vec<&str> = config.chat_channels.iter().map(String::as_str).collect();
        let sims = Simulators::start(clock.clone(), config.faults, &channels).await?;
        let pipeline = Pipeline { endpoints: sims.endpoints(), client: Client::new()?, settings: settings.clone() };
        let engine = build_engine(pool.clone(), side_effects::functions(&pipeline)).await?;

        let receiver_stats = Arc::new(ReceiverStats::default());
        let (receiver_url, receiver) =
            crate::simulators::serve(receiver::router(engine.clone(), clock, receiver_stats.clone())).await?;
        let workers = (0..config.workers.max(1)).map(|_| engine.spawn_worker()).collect();
        Ok(Stack {
            engine,
            pool,
            settings,
            sims,
            receiver_stats,
            receiver_url,
            clock_moved: Arc::default(),
            progress_every: config.progress_every,
            http: reqwest::Client::new(),
            workers,
            _receiver: receiver,
        })
    }

    /// Delivers one webhook to the receiver, as the CRM would.
    pub async fn webhook(&self, change: &StageChange) -> Result<Accepted, StackError> {
        self.webhooks().send(change).await
    }

    /// A handle that delivers webhooks (cheap to clone into tasks).
    pub fn webhooks(&self) -> WebhookSender {
        WebhookSender { http: self.http.clone(), url: format!("{}/webhooks/stage-changed", self.receiver_url) }
    }

    /// Waits until no run is unfinished. Whenever nothing is running and the
    /// next run is due only later (a backoff, a `Retry-After`), it moves the
    /// database clock to that time instead of waiting, so an 8-minute backoff
    /// takes milliseconds. The simulators' clock is the database clock, so
    /// they see the same time pass. Fails after `limit` of real time.
    pub async fn settle(&self, limit: Duration) -> Result<(), StackError> {
        let started = Instant::now();
        let mut progress_lines = 0u32;
        loop {
            let (unfinished, running, due_in): (i64, i64, Option<f64>) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE state IN ('queued', 'running', 'sleeping', 'waiting')),
                        count(*) FILTER (WHERE state = 'running'),
                        extract(epoch FROM min(run_at) FILTER (WHERE state IN ('queued', 'sleeping', 'waiting')
                                                                 AND run_at < 'infinity') - durastep.now())::float8
                   FROM durastep.runs",
            )
            .fetch_one(&self.pool)
            .await?;
            if unfinished == 0 {
                return Ok(());
            }
            if let Some(every) = self.progress_every
                && started.elapsed() >= every * progress_lines
            {
                if progress_lines > 0 {
                    let (moved, _) = self.clock_moved();
                    println!(
                        "  ... {unfinished} runs unfinished ({running} running); waited {}; database clock moved {} \
                         so far to cross backoffs",
                        crate::figures::human(started.elapsed()),
                        crate::figures::human(moved)
                    );
                }
                progress_lines += 1;
            }
            if started.elapsed() > limit {
                return Err(StackError::Timeout { unfinished, waited: started.elapsed() });
            }
            if let Some(due_in) = due_in.filter(|d| running == 0 && *d > 0.0) {
                let by = Duration::from_secs_f64(due_in) + Duration::from_millis(1);
                durastep::testing::advance_clock(&self.engine, by).await?;
                let mut moved = self.clock_moved.lock().unwrap_or_else(|p| p.into_inner());
                moved.0 += by;
                moved.1 += 1;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// How far [`Stack::settle`] has moved the database clock, and in how many jumps.
    pub fn clock_moved(&self) -> (Duration, u32) {
        *self.clock_moved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stops the workers (gracefully) and the servers.
    pub async fn stop(self) -> Result<(), StackError> {
        // All told at once, so that their grace periods run together.
        for worker in &self.workers {
            worker.request_stop();
        }
        for worker in self.workers {
            worker.stop().await?;
        }
        Ok(())
    }
}

/// Delivers webhooks to the receiver, as the CRM does.
#[derive(Clone, Debug)]
pub struct WebhookSender {
    http: reqwest::Client,
    url: String,
}

impl WebhookSender {
    /// Delivers one webhook; the receiver's answer.
    pub async fn send(&self, change: &StageChange) -> Result<Accepted, StackError> {
        let response = self.http.post(&self.url).json(change).send().await?;
        let status = response.status();
        if status != reqwest::StatusCode::ACCEPTED {
            let body = response.text().await.unwrap_or_default();
            return Err(StackError::Refused { status: status.as_u16(), body });
        }
        Ok(response.json().await?)
    }

    /// Delivers `changes` in order, `parallel` at a time; the answers in order.
    pub async fn send_all(&self, changes: &[StageChange], parallel: usize) -> Result<Vec<Accepted>, StackError> {
        let mut out = Vec::with_capacity(changes.len());
        for chunk in changes.chunks(parallel.max(1)) {
            let mut tasks = tokio::task::JoinSet::new();
            for (i, change) in chunk.iter().enumerate() {
                let (sender, change) = (self.clone(), change.clone());
                tasks.spawn(async move { (i, sender.send(&change).await) });
            }
            let mut answers: Vec<(usize, Result<Accepted, StackError>)> = tasks.join_all().await;
            answers.sort_by_key(|(i, _)| *i);
            for (_, answer) in answers {
                out.push(answer?);
            }
        }
        Ok(out)
    }
}

/// An engine on `pool` with the side effect functions.
pub async fn build_engine(pool: PgPool, functions: Vec<Function>) -> Result<Engine, durastep::Error> {
    let mut builder = Engine::builder().pool(pool).worker_options(worker_options());
    for f in functions {
        builder = builder.function(f);
    }
    builder.build().await
}
