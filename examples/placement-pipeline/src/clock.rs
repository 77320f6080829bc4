//! Where the simulators and the receiver read the time.
//!
//! Durastep decides when a retry is due by the database clock, and tests move
//! that clock instead of sleeping. A simulator whose behaviour depends on time
//! (invoicing's throttle) must see the same time, or a moved clock would make a
//! retry due while the simulated system still refuses it. [`Clock::Database`]
//! reads `durastep.now()`, so moving it with `durastep::testing::advance_clock`
//! moves every simulator with it.

use chrono::{DateTime, Utc};
use sqlx::PgPool;

/// A source of the current time.
#[derive(Clone, Debug)]
pub enum Clock {
    /// The machine's clock (for pointing the pipeline at real systems).
    System,
    /// Durastep's database clock, `durastep.now()` (what tests and the demo move).
    Database(PgPool),
}

impl Clock {
    /// The current time; falls back to the machine's clock if the database is
    /// unreachable (a simulator must still answer).
    pub async fn now(&self) -> DateTime<Utc> {
        match self {
            Clock::System => Utc::now(),
            Clock::Database(pool) => {
                match sqlx::query_scalar::<_, DateTime<Utc>>("SELECT durastep.now()").fetch_one(pool).await {
                    Ok(now) => now,
                    Err(e) => {
                        tracing::warn!(error = %e, "database clock unreachable, using the system clock");
                        Utc::now()
                    }
                }
            }
        }
    }
}
