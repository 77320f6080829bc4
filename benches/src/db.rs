//! A fresh database per bench, on the server `DATABASE_URL` points at.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;
use sqlx::{AssertSqlSafe, Connection, PgConnection, PgPool};

/// The server to benchmark: `DATABASE_URL`, or the local default.
///
/// ```
/// assert!(durastep_benches::db::server_url().starts_with("postgres"));
/// ```
pub fn server_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned())
}

/// `url` with its database name replaced by `name` (query parameters kept).
///
/// ```
/// use durastep_benches::db::with_database;
/// assert_eq!(with_database("postgres://u@h:5432/postgres", "b"), "postgres://u@h:5432/b");
/// assert_eq!(with_database("postgres://u@h/app?sslmode=disable", "b"), "postgres://u@h/b?sslmode=disable");
/// assert_eq!(with_database("postgres://u@h", "b"), "postgres://u@h/b");
/// ```
pub fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority_start = base.find("://").map_or(0, |i| i + 3);
    let path_start = base[authority_start..].find('/').map_or(base.len(), |i| authority_start + i);
    let mut out = format!("{}/{name}", &base[..path_start]);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

/// A database created for one bench; call [`BenchDb::drop_database`] at the end.
///
/// ```no_run
/// # async fn demo() {
/// let db = durastep_benches::db::BenchDb::create("demo").await;
/// let pool = db.pool(4).await;
/// sqlx::query("SELECT 1").execute(&pool).await.unwrap();
/// pool.close().await;
/// db.drop_database().await;
/// # }
/// ```
pub struct BenchDb {
    /// The database's name (`bench_<label>_<random>`).
    pub name: String,
    /// Its URL, for worker processes.
    pub url: String,
    /// Its connect options, the same for the raw baselines and the engine.
    pub options: PgConnectOptions,
    server: String,
}

impl BenchDb {
    /// Creates `bench_<label>_<random>` on the server.
    pub async fn create(label: &str) -> BenchDb {
        let server = server_url();
        let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let name = format!("bench_{label}_{suffix}");
        let mut admin = PgConnection::connect(&server).await.expect("connect to DATABASE_URL");
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .expect("create database");
        admin.close().await.ok();
        let url = with_database(&server, &name);
        let options = PgConnectOptions::from_str(&url).expect("parse database url");
        BenchDb { name, url, options, server }
    }

    /// A pool of `n` connections on this database.
    pub async fn pool(&self, n: u32) -> PgPool {
        // As the engine's own pools: no ping before every statement.
        durastep::pool_options()
            .max_connections(n)
            .min_connections(n)
            .acquire_timeout(Duration::from_secs(30))
            .connect_with(self.options.clone())
            .await
            .expect("connect to bench database")
    }

    /// Drops the database, disconnecting whoever is still on it.
    pub async fn drop_database(self) {
        let mut admin = PgConnection::connect(&self.server).await.expect("connect to DATABASE_URL");
        if let Err(e) = sqlx::query(AssertSqlSafe(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name)))
            .execute(&mut admin)
            .await
        {
            eprintln!("could not drop {}: {e}", self.name);
        }
        admin.close().await.ok();
    }
}

/// The drain's progress check: whether no run is queued, sleeping, waiting
/// or running. An index scan of the due queue (`run_queue_next_due`) that
/// stops at its first entry, and the runs of the claim records (`run_claims`, which the workers
/// delete once their attempts have ended), where a `count(*)` of the
/// completed runs reads the whole table: polled every 100 ms during a drain
/// of 40,000 runs, that count took about a tenth of the executor time the
/// engine's statements took (docs/performance.md "The bench's own poll").
const DRAINED: &str =
    "SELECT NOT EXISTS (SELECT FROM (SELECT run_at FROM durastep.run_queue ORDER BY run_at LIMIT 1) due)
                   AND NOT EXISTS (SELECT FROM durastep.run_claims c
                                    CROSS JOIN LATERAL unnest(c.run_ids, c.epochs) AS u(run_id, epoch)
                                    JOIN durastep.runs r ON r.id = u.run_id AND r.lease_epoch = u.epoch
                                   WHERE r.state = 'running')";

/// Polls every `every` until no run is left to do (none queued, sleeping,
/// waiting or running); returns false if `timeout` passed first. Cheap enough
/// to poll during a measured drain, unlike a count of the finished runs.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) {
/// use std::time::Duration;
/// let drained = durastep_benches::db::wait_until_drained(&pool, Duration::from_millis(100), Duration::from_secs(60)).await;
/// assert!(drained);
/// # }
/// ```
pub async fn wait_until_drained(pool: &PgPool, every: Duration, timeout: Duration) -> bool {
    let drained = poll(every, timeout, || async {
        sqlx::query_scalar::<_, bool>(DRAINED).fetch_one(pool).await.expect("drain check")
    })
    .await;
    if !drained {
        eprintln!("timed out with runs left to do");
    }
    drained
}

/// Polls `sql` (a query returning one bigint) every `every` until it reaches
/// `target`; returns false if `timeout` passed first.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) {
/// use std::time::Duration;
/// let sql = "SELECT count(*) FROM durastep.runs WHERE state = 'completed'";
/// let done = durastep_benches::db::wait_for_count(&pool, sql, 100, Duration::from_millis(10), Duration::from_secs(60)).await;
/// assert!(done);
/// # }
/// ```
pub async fn wait_for_count(pool: &PgPool, sql: &'static str, target: i64, every: Duration, timeout: Duration) -> bool {
    let count = || async { sqlx::query_scalar::<_, i64>(sql).fetch_one(pool).await.expect("count query") };
    let reached = poll(every, timeout, || async { count().await >= target }).await;
    if !reached {
        eprintln!("timed out at {} of {target}: {sql}", count().await);
    }
    reached
}

/// Runs `done` every `every` until it returns true (then true) or `timeout`
/// has passed (then false).
async fn poll<F, Fut>(every: Duration, timeout: Duration, mut done: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if done().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(every).await;
    }
}
