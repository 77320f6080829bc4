//! The world of one end-to-end test: its own database (from `#[sqlx::test]`),
//! the simulators on the database clock, an engine with every function, a
//! worker, and waits with deadlines.
#![allow(dead_code)]

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use durastep::{Engine, Run, RunState, WorkerHandle, WorkerOptions};
use media_buying::functions::Services;
use media_buying::sim::{SimClock, Simulators};
use media_buying::{Platform, Settings, database, store};
use sqlx::PgPool;
use sqlx::postgres::PgConnectOptions;
use uuid::Uuid;

/// The longest any one wait in a test may take.
pub const DEADLINE: Duration = Duration::from_secs(20);

/// Short polls and leases, so that nothing in a test waits long.
pub fn fast() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(10),
        heartbeat_interval: Duration::from_secs(1),
        reap_interval: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(5),
        max_in_flight: 16,
        ..Default::default()
    }
}

pub struct World {
    pub engine: Engine,
    pub pool: PgPool,
    pub sims: Simulators,
    pub services: Arc<Services>,
    pub url: String,
}

/// A world with default settings.
pub async fn world(opts: PgConnectOptions) -> World {
    world_with(opts, |_| {}).await
}

/// A world whose settings `tweak` adjusts.
pub async fn world_with(opts: PgConnectOptions, tweak: impl FnOnce(&mut Settings)) -> World {
    let url = format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("postgres")
    );
    let pool = database::pool(opts, 8).await.expect("pool");
    let sims = Simulators::start(SimClock::Database(pool.clone())).await.expect("simulators");
    let mut settings = Settings::new(sims.endpoints.clone());
    tweak(&mut settings);
    let (engine, services) = database::engine(pool.clone(), settings, fast()).await.expect("engine");
    let world = World { engine, pool, sims, services, url };
    world.clock_to(quiet_start()).await;
    world
}

/// Where every world's clock starts: a Wednesday at 10:00 in Amsterdam, days
/// from the Saturday summary and weeks from the quarterly rotation. A test
/// that started at the wall clock's time and moved it on (a backoff, a
/// Retry-After) fired a schedule whenever it ran just before one (the
/// summary's page beside the one page a test counted, on a Saturday at 05:00
/// UTC): tests move the clock from here, never from today.
pub fn quiet_start() -> DateTime<Utc> {
    first_next_year(1, chrono::Weekday::Wed, 10, 0)
}

/// The first `weekday` of `month` next year, at `h:min` in Amsterdam.
fn first_next_year(month: u32, weekday: chrono::Weekday, h: u32, min: u32) -> DateTime<Utc> {
    use chrono::{Datelike, NaiveDate};
    let mut day = NaiveDate::from_ymd_opt(next_year(), month, 1).expect("a date");
    while day.weekday() != weekday {
        day = day.succ_opt().expect("a date");
    }
    amsterdam(day.year(), day.month(), day.day(), h, min)
}

impl World {
    /// An account with a token valid for 30 days, in the store and at its platform.
    pub async fn account(&self, platform: Platform, account_id: &str) -> String {
        let expires = self.now().await + chrono::Duration::days(30);
        self.account_expiring(platform, account_id, expires, expires).await
    }

    /// An account whose token the store thinks expires at `store_expiry` and
    /// the platform at `platform_expiry`; returns the access token.
    pub async fn account_expiring(
        &self,
        platform: Platform,
        account_id: &str,
        store_expiry: DateTime<Utc>,
        platform_expiry: DateTime<Utc>,
    ) -> String {
        let access = format!("tok-{}-{account_id}-v1", platform.as_str());
        let refresh = format!("refresh-{}-{account_id}", platform.as_str());
        store::add_account(&self.pool, platform, account_id, &format!("client of {account_id}")).await.unwrap();
        store::add_token(&self.pool, platform, account_id, &access, &refresh, store_expiry).await.unwrap();
        match platform {
            Platform::Meta => self.sims.meta.add_token(account_id, &access, &refresh, platform_expiry),
            Platform::TikTok => self.sims.tiktok.add_token(&access),
            Platform::LinkedIn => self.sims.linkedin.add_token(&access),
        }
        access
    }

    /// Requests a budget; returns the write id and the run id.
    pub async fn request(&self, platform: Platform, account_id: &str, campaign_id: &str, cents: i64) -> (i64, Uuid) {
        let r = store::request_budget(&self.engine, &self.pool, platform, account_id, campaign_id, cents, "ops@agency")
            .await
            .expect("request budget");
        (r.write_id, r.run_id)
    }

    pub async fn now(&self) -> DateTime<Utc> {
        durastep::testing::db_now(&self.engine).await.unwrap()
    }

    /// Moves the database clock forward to `at`.
    pub async fn clock_to(&self, at: DateTime<Utc>) {
        let by = (at - self.now().await).to_std().expect("the target time is ahead of the database clock");
        durastep::testing::advance_clock(&self.engine, by).await.unwrap();
    }

    pub async fn run(&self, id: Uuid) -> Run {
        self.engine.run(id).await.unwrap()
    }

    /// Waits until the run is finished.
    pub async fn finished(&self, id: Uuid) -> Run {
        let run = self.engine.wait_for_run(id, DEADLINE).await.expect("the run finished in time");
        assert!(run.state.is_finished(), "{run:?}");
        run
    }

    /// Waits until the run is in `state`.
    pub async fn reaches(&self, id: Uuid, state: RunState) -> Run {
        wait_until(&format!("run {id} {state:?}"), || async { self.run(id).await.state == state }).await;
        self.run(id).await
    }

    /// Waits until all `ids` finished, moving the database clock forward to
    /// the next due time whenever nothing is running and nothing is due: so a
    /// backoff or a Retry-After costs no real time. The clock only moves
    /// while no attempt is running, so no lease is taken back.
    pub async fn drive(&self, ids: &[Uuid]) -> Vec<Run> {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let (open, running, next): (i64, i64, Option<DateTime<Utc>>) = sqlx::query_as(
                "SELECT count(*) FILTER (WHERE state NOT IN ('completed', 'failed', 'cancelled', 'skipped')),
                        (SELECT count(*) FROM durastep.runs WHERE state = 'running'),
                        (SELECT min(run_at) FROM durastep.runs WHERE state IN ('queued', 'sleeping'))
                   FROM durastep.runs WHERE id = ANY($1)",
            )
            .bind(ids)
            .fetch_one(&self.pool)
            .await
            .unwrap();
            if open == 0 {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "runs still open: {open}");
            let now = self.now().await;
            if running == 0
                && let Some(next) = next.filter(|n| *n > now)
            {
                self.clock_to(next + chrono::Duration::milliseconds(5)).await;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let mut runs = Vec::new();
        for id in ids {
            runs.push(self.run(*id).await);
        }
        runs
    }

    /// The status, external ref and count of a budget write row.
    pub async fn write_row(&self, write_id: i64) -> (String, Option<String>) {
        sqlx::query_as("SELECT status, external_ref FROM media.budget_writes WHERE id = $1")
            .bind(write_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn budget_write_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM media.budget_writes").fetch_one(&self.pool).await.unwrap()
    }

    pub async fn on_call(&self) -> Vec<String> {
        self.sims.chat.messages_in(&self.services.settings.on_call_channel).into_iter().map(|m| m.text).collect()
    }
}

/// A worker in this process; stopped when dropped (or by `stop`, which
/// waits for it and fails the test if the worker failed).
pub struct Worker(WorkerHandle);

impl Worker {
    pub async fn stop(self) {
        self.0.stop().await.expect("worker");
    }
}

pub fn worker(engine: &Engine) -> Worker {
    Worker(engine.spawn_worker())
}

/// Polls `check` every 20 ms until it holds; fails the test after [`DEADLINE`].
pub async fn wait_until<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `y-m-d h:m` in Europe/Amsterdam, as UTC.
pub fn amsterdam(y: i32, m: u32, d: u32, h: u32, min: u32) -> DateTime<Utc> {
    use chrono::TimeZone;
    chrono_tz::Europe::Amsterdam
        .with_ymd_and_hms(y, m, d, h, min, 0)
        .single()
        .expect("a valid local time")
        .with_timezone(&Utc)
}

/// The next year, so that a date in it is ahead of the database clock. Read
/// once per run, so that a run across New Year's midnight does not mix two
/// years in one test.
pub fn next_year() -> i32 {
    use chrono::Datelike;
    static YEAR: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *YEAR.get_or_init(|| Utc::now().year() + 1)
}

impl World {
    /// Waits until a worker has ticked (armed) the cron schedule of `function_id`.
    pub async fn armed(&self, function_id: &str) {
        wait_until(&format!("schedule {function_id} armed"), || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT coalesce(bool_or(last_tick_at IS NOT NULL), false) FROM durastep.schedules WHERE function_id = $1",
            )
            .bind(function_id)
            .fetch_one(&self.pool)
            .await
            .unwrap()
        })
        .await;
    }

    /// The runs of a function, oldest first.
    pub async fn runs_of(&self, function_id: &str) -> Vec<Uuid> {
        sqlx::query_scalar("SELECT id FROM durastep.runs WHERE function_id = $1 ORDER BY created_at, id")
            .bind(function_id)
            .fetch_all(&self.pool)
            .await
            .unwrap()
    }
}

/// The first Friday of June next year, at 21:30 in Amsterdam (the story's 429).
pub fn friday_2130() -> DateTime<Utc> {
    first_next_year(6, chrono::Weekday::Fri, 21, 30)
}

/// Waits until the failure handler runs of `function_id` finished, and a
/// little longer to see that no second one appears; returns them.
pub async fn wait_for_failure_handler(w: &World, function_id: &str) -> Vec<Uuid> {
    wait_until("the failure handler", || async {
        let ids = w.runs_of(function_id).await;
        let mut all_done = !ids.is_empty();
        for id in &ids {
            all_done &= w.run(*id).await.state == RunState::Completed;
        }
        all_done
    })
    .await;
    // A second handler run would be created by the same statement that
    // failed the run; a few poll intervals more are enough to see it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.runs_of(function_id).await
}
