//! Every SQL statement Durastep runs, named for what it does, in one module per
//! stage of a run: `registration`, `send`, `offers` (an idle worker's offer to
//! the sends of every process), `claim`, `attempt` (what a running
//! attempt writes), `waits`, `leases`, `schedules`, `admin` (an operator's
//! writes) and `inspect` (reads). Statements longer than about 20 lines are
//! `.sql` files under `store/sql/`, with a comment per CTE.
//!
//! Architecture invariant: no other module builds or sends SQL. Every statement
//! here is a fixed string; user values travel only as bind parameters. Every write
//! made on behalf of an attempt takes a [`Fence`], which only a claim makes, and
//! compares `(id, lease_epoch, state = 'running')` under a row lock in the same
//! statement (fencing). Statements that lock several
//! run rows lock them in id order, and the claim and the reaper skip locked rows,
//! so the engine's own statements cannot deadlock one another.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use crate::journal::{EntryKind, JournalEntry};

/// The running runs, as `r` (the text after `FROM`, ending in a `WHERE`
/// its caller may extend with `AND`): the runs of the claim records
/// (`run_claims`, migration 0034) still running under the epoch their
/// claim gave them. A run is in one record per claim, and a claim sets a new
/// epoch, so each running run is here once.
macro_rules! running_runs {
    () => {
        "durastep.run_claims rc CROSS JOIN LATERAL unnest(rc.run_ids, rc.epochs) AS rcu(run_id, epoch)
                 JOIN durastep.runs r ON r.id = rcu.run_id AND r.lease_epoch = rcu.epoch
                WHERE r.state = 'running'"
    };
}

/// The runs a listing (and pruning) walks the primary key for: version-7 ids below
/// `03bb2cc3-d800-0000-0000-000000000000`, the first time-ordered id of 2100
/// (`durastep.uuid7_floor('2100-01-01 00:00:00+00')`; migration 0031 says
/// why). A macro, for the statements that splice it in with `concat!`.
macro_rules! time_ordered {
    () => {
        "(get_byte(uuid_send(r.id), 6) >> 4) = 7 AND r.id < '03bb2cc3-d800-0000-0000-000000000000'"
    };
}

/// The other runs: the predicate of `runs_created_legacy`, word for word
/// (so that the planner matches it), on `r`. Listings and pruning read them
/// by `created_at` through that index.
macro_rules! legacy {
    () => {
        "((get_byte(uuid_send(r.id), 6) >> 4) <> 7 OR r.id >= '03bb2cc3-d800-0000-0000-000000000000')"
    };
}

mod admin;
mod attempt;
mod claim;
pub(crate) mod inspect;
mod leases;
mod offers;
mod registration;
mod schedules;
mod send;
#[cfg(feature = "testing")]
mod testing;
mod waits;

pub(crate) use admin::*;
pub(crate) use attempt::*;
pub(crate) use claim::*;
pub(crate) use inspect::{ReplayRun, load_divergence, load_run, unfinished_runs};
pub(crate) use leases::*;
pub(crate) use offers::*;
pub(crate) use registration::*;
pub(crate) use schedules::*;
pub(crate) use send::*;
#[cfg(feature = "testing")]
pub(crate) use testing::*;
pub(crate) use waits::*;

/// The channel workers LISTEN on. Payloads are empty: a notification is only a hint.
pub(crate) const WAKEUP_CHANNEL: &str = "durastep_wakeup";

/// The channel on which a cancel of a running run is announced (by the
/// `release_flow` trigger, at commit), with the payload `<run id>:<lease epoch>`:
/// the worker holding that attempt drops its handler at once.
pub(crate) const CANCEL_CHANNEL: &str = "durastep_cancelled";

/// Applies the embedded migrations; tracking lives in `durastep._migrations`.
/// Returns the (version, description) of those this call applied, oldest
/// first: the embedded ones recorded as applied now and not before.
pub(crate) async fn migrate(pool: &PgPool) -> Result<Vec<(i64, String)>, sqlx::migrate::MigrateError> {
    let mut migrator = sqlx::migrate!("../../migrations");
    migrator.create_schema("durastep");
    migrator.dangerous_set_table_name("durastep._migrations");
    let before = applied_migrations(pool).await?;
    migrator.run(pool).await?;
    let after = applied_migrations(pool).await?;
    Ok(migrator
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .filter(|m| after.contains(&m.version) && !before.contains(&m.version))
        .map(|m| (m.version, m.description.to_string()))
        .collect())
}

/// The versions recorded as applied in `durastep._migrations` (none when the
/// table does not exist yet).
async fn applied_migrations(pool: &PgPool) -> Result<Vec<i64>, sqlx::Error> {
    let exists: bool =
        sqlx::query_scalar("SELECT to_regclass('durastep._migrations') IS NOT NULL").fetch_one(pool).await?;
    if !exists {
        return Ok(Vec::new());
    }
    sqlx::query_scalar("SELECT version FROM durastep._migrations WHERE success ORDER BY version").fetch_all(pool).await
}

/// Seconds for `make_interval`, cut to [`crate::limits::MAX_DURATION`] so no
/// user duration can overflow an interval or a timestamp.
fn secs(d: Duration) -> f64 {
    d.min(crate::limits::MAX_DURATION).as_secs_f64()
}

/// The database clock, as Durastep sees it (with the test offset).
pub(crate) async fn db_now(pool: &PgPool) -> Result<DateTime<Utc>, sqlx::Error> {
    sqlx::query_scalar("SELECT durastep.now()").fetch_one(pool).await
}

/// Wakes every class of every listening worker (after the test clock moved:
/// runs of any function may be due).
#[cfg(feature = "testing")]
pub(crate) async fn notify_workers<'e>(db: impl sqlx::PgExecutor<'e>) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT pg_notify('durastep_wakeup', '')").execute(db).await?;
    Ok(())
}

/// Wakes the workers of these functions (`durastep.wake_workers`, migration
/// 0028: the payload names them; a worker that runs none of them does not
/// claim). In a transaction, the notification goes at its commit.
pub(crate) async fn wake_workers<'e>(db: impl sqlx::PgExecutor<'e>, functions: &[&str]) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT durastep.wake_workers($1)").bind(functions).execute(db).await?;
    Ok(())
}

/// One stored step result.
pub(crate) async fn load_step(conn: &mut PgConnection, run_id: Uuid, key: &str) -> Result<Option<Value>, sqlx::Error> {
    sqlx::query_scalar("SELECT output FROM durastep.step_results WHERE run_id = $1 AND step_key = $2")
        .bind(run_id)
        .bind(key)
        .fetch_optional(conn)
        .await
}

/// A run's stored steps (key -> output) and its journal (position -> entry).
pub(crate) type RunRecords = (HashMap<String, Value>, BTreeMap<u32, JournalEntry>);

/// A run's stored steps (key -> output) and its journal (position -> entry)
/// from the arrays of `run_records.sql` in a claim or replay row: the steps'
/// `step_keys`, `step_outputs`, `step_positions` and `step_kinds` (element `i`
/// of each is step row `i`; a row with no position has its entry in
/// `step_journal`, migration 0029; a kind is NULL for a plain step), and the rest of the journal's
/// `journal_positions`, `journal_kinds` and `journal_keys`.
pub(crate) fn records_of(row: &PgRow) -> Result<RunRecords, sqlx::Error> {
    let keys: Vec<String> = row.try_get("step_keys")?;
    let outputs: Vec<Value> = row.try_get("step_outputs")?;
    let step_positions: Vec<Option<i32>> = row.try_get("step_positions")?;
    let step_kinds: Vec<Option<String>> = row.try_get("step_kinds")?;
    if [outputs.len(), step_positions.len(), step_kinds.len()].iter().any(|&n| n != keys.len()) {
        return Err(sqlx::Error::Decode(
            format!(
                "{} step keys for {} outputs, {} positions and {} kinds",
                keys.len(),
                outputs.len(),
                step_positions.len(),
                step_kinds.len()
            )
            .into(),
        ));
    }
    let positions: Vec<i32> = row.try_get("journal_positions")?;
    let kinds: Vec<String> = row.try_get("journal_kinds")?;
    let journal_keys: Vec<String> = row.try_get("journal_keys")?;
    let mut journal = BTreeMap::new();
    let kind_of = |kind: &str| kind.parse::<EntryKind>().map_err(|e| sqlx::Error::Decode(Box::new(e)));
    let mut entry = |position: i32, kind: EntryKind, key: &str| -> Result<(), sqlx::Error> {
        let position = u32::try_from(position).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
        journal.insert(position, JournalEntry::new(kind, key));
        Ok(())
    };
    for ((position, kind), key) in positions.into_iter().zip(&kinds).zip(&journal_keys) {
        entry(position, kind_of(kind)?, key)?;
    }
    for ((position, kind), key) in step_positions.into_iter().zip(&step_kinds).zip(&keys) {
        if let Some(position) = position {
            entry(position, kind.as_deref().map_or(Ok(EntryKind::Step), kind_of)?, key)?;
        }
    }
    Ok((keys.into_iter().zip(outputs).collect(), journal))
}

async fn insert_entry(
    conn: &mut PgConnection,
    run_id: Uuid,
    position: u32,
    kind: EntryKind,
    key: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO durastep.step_journal (run_id, position, kind, step_key) VALUES ($1, $2, $3, $4)
         ON CONFLICT DO NOTHING",
    )
    .bind(run_id)
    .bind(i32::try_from(position).unwrap_or(i32::MAX))
    .bind(kind.as_str())
    .bind(key)
    .execute(conn)
    .await?;
    Ok(())
}
