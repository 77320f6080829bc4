//! Waiting on conditions with a deadline, never on a guessed sleep.

use std::future::Future;
use std::time::Duration;

use crate::error::{Error, Result};

/// How often [`wait_for`] probes.
pub const POLL: Duration = Duration::from_millis(20);

/// Probes `probe` every [`POLL`] until it returns `Some(value)`, for at most
/// `timeout`; a probe error ends the wait at once.
///
/// ```no_run
/// # async fn demo(pool: sqlx::PgPool) -> durastep_testkit::Result<()> {
/// use std::time::Duration;
/// let n: i64 = durastep_testkit::wait_for("ten ledger rows", Duration::from_secs(5), || {
///     let pool = pool.clone();
///     async move {
///         let n: i64 = sqlx::query_scalar("SELECT count(*) FROM testkit_ledger").fetch_one(&pool).await?;
///         Ok((n >= 10).then_some(n))
///     }
/// })
/// .await?;
/// # let _ = n; Ok(()) }
/// ```
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await? {
            return Ok(value);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(Error::Timeout { what: what.to_owned(), after: timeout });
        }
        tokio::time::sleep(POLL).await;
    }
}
