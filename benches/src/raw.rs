//! Raw Postgres baselines: what plain sqlx gets from the same server with the same
//! connection settings, so every engine figure can be given as a ratio measured
//! in the same run. The tables have the shape of the engine's own
//! (`raw.steps` is `durastep.step_results` without the foreign key; `raw.queue`
//! is the claimable part of `durastep.runs`, with the same partial index).

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::PgPool;

/// Creates (or empties) the `raw` schema's tables.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) { durastep_benches::raw::setup(&pool).await; }
/// ```
pub async fn setup(pool: &PgPool) {
    for sql in [
        "CREATE SCHEMA IF NOT EXISTS raw",
        "CREATE TABLE IF NOT EXISTS raw.steps (
             run_id uuid NOT NULL, step_key text NOT NULL, output jsonb NOT NULL, lease_epoch bigint NOT NULL,
             created_at timestamptz NOT NULL DEFAULT clock_timestamp(), PRIMARY KEY (run_id, step_key))",
        "CREATE TABLE IF NOT EXISTS raw.queue (
             id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, state text NOT NULL,
             priority integer NOT NULL DEFAULT 0, run_at timestamptz NOT NULL DEFAULT now())",
        "CREATE INDEX IF NOT EXISTS queue_due ON raw.queue (priority DESC, run_at) WHERE state = 'queued'",
        "TRUNCATE raw.steps, raw.queue",
    ] {
        sqlx::query(sql).execute(pool).await.expect("raw setup");
    }
}

/// Runs `tasks` loops, each on its own connection, for `warmup + measure`; each
/// loop iteration returns how many rows it did. Returns rows per second over the
/// measured window.
async fn measure<F, Fut>(pool: &PgPool, tasks: usize, warmup: Duration, measure: Duration, op: F) -> f64
where
    F: Fn(usize, u64, sqlx::pool::PoolConnection<sqlx::Postgres>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = (u64, sqlx::pool::PoolConnection<sqlx::Postgres>)> + Send,
{
    let op = Arc::new(op);
    let from = Instant::now() + warmup;
    let until = from + measure;
    let mut set = tokio::task::JoinSet::new();
    for t in 0..tasks {
        let mut conn = pool.acquire().await.expect("acquire");
        let op = op.clone();
        set.spawn(async move {
            let (mut counted, mut i) = (0u64, 0u64);
            loop {
                let (n, c) = op(t, i, conn).await;
                conn = c;
                i += 1;
                let now = Instant::now();
                if now >= until {
                    return counted;
                }
                if now >= from {
                    counted += n;
                }
            }
        });
    }
    let mut total = 0;
    while let Some(n) = set.join_next().await {
        total += n.expect("baseline task");
    }
    total as f64 / measure.as_secs_f64()
}

/// Single-row INSERT commits per second, one autocommit statement per row, from
/// `tasks` connections at once.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) {
/// use std::time::Duration;
/// let rows_per_s = durastep_benches::raw::single_row_commits(&pool, 16, Duration::from_secs(3)).await;
/// # let _ = rows_per_s; }
/// ```
pub async fn single_row_commits(pool: &PgPool, tasks: usize, duration: Duration) -> f64 {
    sqlx::query("TRUNCATE raw.steps").execute(pool).await.expect("truncate");
    measure(pool, tasks, Duration::from_millis(500), duration, |t, i, mut conn| async move {
        sqlx::query(
            "INSERT INTO raw.steps (run_id, step_key, output, lease_epoch) VALUES ($1, $2, $3::text::jsonb, $4)",
        )
        .bind(uuid::Uuid::from_u64_pair(t as u64, 0))
        .bind(format!("s#{i}"))
        .bind("null")
        .bind(1i64)
        .execute(&mut *conn)
        .await
        .expect("single-row insert");
        (1, conn)
    })
    .await
}

/// Rows per second inserted `rows` at a time (one multi-row INSERT, one commit,
/// as the engine's group commit does), from `tasks` connections at once.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) {
/// use std::time::Duration;
/// let rows_per_s = durastep_benches::raw::group_commit(&pool, 2, 256, Duration::from_secs(3)).await;
/// # let _ = rows_per_s; }
/// ```
pub async fn group_commit(pool: &PgPool, tasks: usize, rows: usize, duration: Duration) -> f64 {
    sqlx::query("TRUNCATE raw.steps").execute(pool).await.expect("truncate");
    measure(pool, tasks, Duration::from_millis(500), duration, move |t, i, mut conn| async move {
        let run_ids: Vec<uuid::Uuid> = (0..rows).map(|r| uuid::Uuid::from_u64_pair(t as u64, r as u64)).collect();
        let keys: Vec<String> = (0..rows).map(|_| format!("s#{i}")).collect();
        let outputs: Vec<&str> = vec!["null"; rows];
        let epochs: Vec<i64> = vec![1; rows];
        sqlx::query(
            "INSERT INTO raw.steps (run_id, step_key, output, lease_epoch)
             SELECT r, k, o::jsonb, e FROM unnest($1::uuid[], $2::text[], $3::text[], $4::bigint[]) AS t(r, k, o, e)",
        )
        .bind(&run_ids)
        .bind(&keys)
        .bind(&outputs)
        .bind(&epochs)
        .execute(&mut *conn)
        .await
        .expect("group insert");
        (rows as u64, conn)
    })
    .await
}

/// Rows per second claimed from a queue of `rows` due rows with
/// `FOR UPDATE SKIP LOCKED`, `batch` rows per round trip (LIMIT in a CTE, as the
/// engine does), by `tasks` claimers at once, until the queue is empty.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) {
/// let rows_per_s = durastep_benches::raw::claim(&pool, 1, 32, 20_000).await;
/// # let _ = rows_per_s; }
/// ```
pub async fn claim(pool: &PgPool, tasks: usize, batch: i64, rows: i64) -> f64 {
    sqlx::query("TRUNCATE raw.queue").execute(pool).await.expect("truncate");
    sqlx::query(
        "INSERT INTO raw.queue (state, run_at) SELECT 'queued', now() - interval '1 s' FROM generate_series(1, $1)",
    )
    .bind(rows)
    .execute(pool)
    .await
    .expect("fill queue");
    sqlx::query("VACUUM ANALYZE raw.queue").execute(pool).await.expect("analyze");
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let pool = pool.clone();
        set.spawn(async move {
            let mut conn = pool.acquire().await.expect("acquire");
            let mut claimed = 0u64;
            loop {
                let ids: Vec<i64> = sqlx::query_scalar(
                    "WITH due AS (
                         SELECT id FROM raw.queue WHERE state = 'queued' AND run_at <= now()
                          ORDER BY priority DESC, run_at LIMIT $1 FOR UPDATE SKIP LOCKED)
                     UPDATE raw.queue q SET state = 'running' FROM due WHERE q.id = due.id RETURNING q.id",
                )
                .bind(batch)
                .fetch_all(&mut *conn)
                .await
                .expect("claim");
                if ids.is_empty() {
                    return claimed;
                }
                claimed += ids.len() as u64;
            }
        });
    }
    let mut total = 0;
    while let Some(n) = set.join_next().await {
        total += n.expect("claim task");
    }
    total as f64 / started.elapsed().as_secs_f64()
}
