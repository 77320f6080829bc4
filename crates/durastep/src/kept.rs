//! Connections a worker keeps from one of its statements to the next.
//!
//! sqlx tests a pooled connection each time it goes back to the pool: it
//! sends a `Sync` and waits for the server's answer. That is one more
//! message each way per statement, and a wake-up of the server's backend and
//! of the worker, for nothing the statement needed. A worker's checkpoint
//! writers and its claims send one statement after another, so they keep
//! their connections here between statements instead (docs/performance.md
//! "A worker keeps its connections").
//!
//! A connection is kept only after a statement that succeeded
//! ([`Kept::run`]). It goes back to the pool (and through its test there)
//! after a failed statement (the test then tells a broken connection from a
//! good one), when it has not been used again for [`UNUSED_FOR`], and at
//! once whenever a statement ends while the pool has no other connection
//! idle: the application (`step_tx`), a worker's other statements and
//! other workers' never wait long behind a connection kept here.
//! (Heartbeats and the reaper use the control pool.)

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};
use tokio::time::Instant;

/// How long a connection is kept without being used again.
pub(crate) const UNUSED_FOR: Duration = Duration::from_millis(100);

/// Connections taken from `pool` and kept between statements.
pub(crate) struct Kept {
    pool: PgPool,
    unused_for: Duration,
    /// Each with when it was kept.
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
}

impl Kept {
    pub(crate) fn new(pool: PgPool) -> Arc<Kept> {
        Kept::keeping_for(pool, UNUSED_FOR)
    }

    fn keeping_for(pool: PgPool, unused_for: Duration) -> Arc<Kept> {
        Arc::new(Kept { pool, unused_for, idle: Mutex::new(Vec::new()) })
    }

    /// Runs `statement` on the connection kept last (or one from the pool)
    /// and keeps that connection if the statement succeeded. After an error
    /// it goes back to the pool, whose test closes it if it broke.
    pub(crate) async fn run<T>(
        self: &Arc<Self>,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let mut conn = self.take().await?;
        let result = statement(&mut conn).await;
        if result.is_ok() {
            self.keep(conn);
        }
        result
    }

    /// The connection kept last, or one from the pool.
    async fn take(&self) -> Result<PoolConnection<Postgres>, sqlx::Error> {
        let kept = self.idle.lock().unwrap_or_else(PoisonError::into_inner).pop();
        match kept {
            Some((conn, _)) => Ok(conn),
            None => self.pool.acquire().await,
        }
    }

    /// Keeps `conn` for the next statement, unless the pool has no other
    /// connection idle: then it goes back to the pool, for whoever needs one.
    fn keep(self: &Arc<Self>, conn: PoolConnection<Postgres>) {
        if self.pool.num_idle() == 0 {
            return;
        }
        self.idle.lock().unwrap_or_else(PoisonError::into_inner).push((conn, Instant::now()));
        let kept = Arc::downgrade(self);
        let unused_for = self.unused_for;
        tokio::spawn(async move {
            tokio::time::sleep(unused_for).await;
            if let Some(kept) = kept.upgrade() {
                kept.release_unused();
            }
        });
    }

    /// Gives back to the pool every connection kept for [`UNUSED_FOR`] or
    /// longer without being used again.
    fn release_unused(&self) {
        let unused: Vec<_> = {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            let (old, fresh) =
                std::mem::take(&mut *idle).into_iter().partition(|(_, at)| at.elapsed() >= self.unused_for);
            *idle = fresh;
            old
        };
        drop(unused);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits until `n` connections are idle in the pool (a dropped one comes
    /// back after the pool's test of it); fails after 30 s.
    async fn idle_in_pool(pool: &PgPool, n: usize) {
        let wait = async {
            while pool.num_idle() < n {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), wait).await.expect("connections back in the pool");
    }

    fn kept_count(kept: &Kept) -> usize {
        kept.idle.lock().unwrap().len()
    }

    async fn backend_pid(conn: &mut PoolConnection<Postgres>) -> i32 {
        sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut **conn).await.unwrap()
    }

    /// Takes two connections, gives one back to the pool and keeps the
    /// other (another is then idle in the pool); returns its backend's pid.
    async fn keep_one(kept: &Arc<Kept>, pool: &PgPool) -> i32 {
        let (mut a, b) = (kept.take().await.unwrap(), kept.take().await.unwrap());
        let a_pid = backend_pid(&mut a).await;
        drop(b);
        idle_in_pool(pool, 1).await;
        kept.keep(a);
        a_pid
    }

    #[sqlx::test(migrations = false)]
    async fn a_connection_is_kept_while_the_pool_has_another_idle(pool: PgPool) {
        let kept = Kept::keeping_for(pool.clone(), Duration::from_secs(3600));
        let a_pid = keep_one(&kept, &pool).await;
        assert_eq!(kept_count(&kept), 1, "not kept although another connection was idle");
        assert_eq!(pool.num_idle(), 1, "the kept connection went back to the pool");
        let mut again = kept.take().await.unwrap();
        assert_eq!(backend_pid(&mut again).await, a_pid, "the kept connection is the one taken next");
    }

    #[sqlx::test(migrations = false)]
    async fn a_connection_is_kept_after_a_statement_that_succeeded_only(pool: PgPool) {
        let kept = Kept::keeping_for(pool.clone(), Duration::from_secs(3600));
        // Two connections idle in the pool, so that another is idle while
        // one runs and the rule on scarce connections does not decide.
        let (a, b) = (kept.take().await.unwrap(), kept.take().await.unwrap());
        drop((a, b));
        idle_in_pool(&pool, 2).await;
        let failed = kept.run(async |c| sqlx::query("SELECT 1 / 0").execute(c).await).await;
        assert!(failed.is_err());
        assert_eq!(kept_count(&kept), 0, "kept after a failed statement");
        idle_in_pool(&pool, 2).await;
        let one: i32 = kept.run(async |c| sqlx::query_scalar("SELECT 1").fetch_one(c).await).await.unwrap();
        assert_eq!(one, 1);
        assert_eq!(kept_count(&kept), 1, "not kept after a statement that succeeded");
    }

    #[sqlx::test(migrations = false)]
    async fn a_connection_goes_back_when_no_other_is_idle(pool: PgPool) {
        let kept = Kept::keeping_for(pool.clone(), Duration::from_secs(3600));
        let a = kept.take().await.unwrap();
        assert_eq!(pool.num_idle(), 0);
        kept.keep(a);
        assert_eq!(kept_count(&kept), 0, "kept although no other connection was idle");
        idle_in_pool(&pool, 1).await;
    }

    #[sqlx::test(migrations = false)]
    async fn a_connection_unused_for_a_while_goes_back(pool: PgPool) {
        let kept = Kept::keeping_for(pool.clone(), Duration::from_millis(1));
        keep_one(&kept, &pool).await;
        idle_in_pool(&pool, 2).await;
        assert_eq!(kept_count(&kept), 0);
    }

    #[sqlx::test(migrations = false)]
    async fn a_connection_kept_for_less_than_its_time_stays(pool: PgPool) {
        let kept = Kept::keeping_for(pool.clone(), Duration::from_secs(3600));
        keep_one(&kept, &pool).await;
        kept.release_unused();
        assert_eq!(kept_count(&kept), 1, "released although kept within its time");
    }
}
