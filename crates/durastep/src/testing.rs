//! Controlling time in tests.
//!
//! Every due-ness decision (sleeps, retries, leases) is made by the database
//! clock, `durastep.now()`, which is the transaction time plus an offset that is
//! zero in production. Tests move that offset forward instead of sleeping; each
//! test database has its own clock.

use std::time::Duration;

use crate::Engine;
use crate::error::{Error, from_sqlx};
use crate::store;

/// Moves the database clock forward by `by` and wakes listening workers.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// // A run sleeping for three days becomes due now.
/// durastep::testing::advance_clock(&engine, std::time::Duration::from_secs(3 * 86_400)).await?;
/// # Ok(()) }
/// ```
pub async fn advance_clock(engine: &Engine, by: Duration) -> Result<(), Error> {
    store::advance_clock(engine.pool(), by).await.map_err(from_sqlx)?;
    store::notify_workers(engine.pool()).await.map_err(from_sqlx)
}

/// The database clock as Durastep sees it.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let now = durastep::testing::db_now(&engine).await?;
/// # let _ = now; Ok(()) }
/// ```
pub async fn db_now(engine: &Engine) -> Result<chrono::DateTime<chrono::Utc>, Error> {
    store::db_now(engine.pool()).await.map_err(from_sqlx)
}
