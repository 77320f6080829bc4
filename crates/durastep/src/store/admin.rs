//! Admin writes: an operator's actions on stored runs (cancel, replay, resume
//! or discard a diverged run, prune).

use std::time::Duration;

use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::{secs, wake_workers};
use crate::RunState;

/// How [`cancel_run`] went.
pub(crate) enum CancelOutcome {
    /// No run has this id.
    Unknown,
    /// The run had already finished in this state; nothing changed.
    Finished(RunState),
    /// Cancelled now (from this state).
    Cancelled,
}

/// Cancels one unfinished run: its state becomes `cancelled`, so every later
/// fenced write of a running attempt matches nothing, and its waits are removed.
/// A running attempt keeps its worker and lease (and its concurrency slots)
/// until its worker has stopped it or the lease has lapsed; the cancel is
/// announced to the workers (`durastep_cancelled`, by the `release_flow` trigger).
pub(crate) async fn cancel_run(pool: &PgPool, run_id: Uuid, reason: &str) -> Result<CancelOutcome, sqlx::Error> {
    let row: Option<(RunState, bool)> = sqlx::query_as(
        "WITH l AS (SELECT id, state FROM durastep.runs WHERE id = $1 FOR NO KEY UPDATE),
         u AS (
             UPDATE durastep.runs r
                SET state = 'cancelled', cancel_reason = $2, finished_at = durastep.now()
               FROM l WHERE r.id = l.id AND l.state NOT IN ('completed', 'failed', 'cancelled')
             RETURNING r.id),
         d AS (DELETE FROM durastep.waits w WHERE w.run_id IN (SELECT id FROM u) RETURNING w.run_id)
         SELECT l.state, EXISTS (SELECT 1 FROM u) AND (SELECT count(*) FROM d) >= 0 FROM l",
    )
    .bind(run_id)
    .bind(reason)
    .fetch_optional(pool)
    .await?;
    Ok(match row {
        None => CancelOutcome::Unknown,
        Some((_, true)) => CancelOutcome::Cancelled,
        Some((state, false)) => CancelOutcome::Finished(state),
    })
}

/// What an operator did to a diverged run.
pub(crate) enum DivergedAction {
    /// Queue it again as it is (the code was fixed).
    Resume,
    /// Forget its entries from this position on (results, journal, waits), then queue it.
    DiscardFrom(u32),
}

/// Applies an operator's action to a `diverged` run. Returns the run's state
/// when it was not `diverged` (nothing changed), None when done; Err
/// RowNotFound when there is no such run.
pub(crate) async fn act_on_diverged(
    pool: &PgPool,
    run_id: Uuid,
    action: DivergedAction,
) -> Result<Option<RunState>, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let state: Option<RunState> = sqlx::query_scalar("SELECT state FROM durastep.runs WHERE id = $1 FOR UPDATE")
        .bind(run_id)
        .fetch_optional(&mut *tx)
        .await?;
    let state = state.ok_or(sqlx::Error::RowNotFound)?;
    if state != RunState::Diverged {
        return Ok(Some(state));
    }
    if let DivergedAction::DiscardFrom(position) = action {
        let position = i32::try_from(position).unwrap_or(i32::MAX);
        sqlx::query(
            "WITH gone AS (DELETE FROM durastep.step_journal WHERE run_id = $1 AND position >= $2 RETURNING step_key),
             r AS (DELETE FROM durastep.step_results s
                    WHERE s.run_id = $1 AND (s.position >= $2 OR s.step_key IN (SELECT step_key FROM gone)))
             DELETE FROM durastep.waits w USING gone WHERE w.run_id = $1 AND w.step_key = gone.step_key",
        )
        .bind(run_id)
        .bind(position)
        .execute(&mut *tx)
        .await?;
    }
    let function: String = sqlx::query_scalar(
        "UPDATE durastep.runs SET state = 'queued', run_at = durastep.now(), divergence = NULL WHERE id = $1
         RETURNING function_id",
    )
    .bind(run_id)
    .fetch_one(&mut *tx)
    .await?;
    wake_workers(&mut *tx, &[function.as_str()]).await?;
    tx.commit().await?;
    Ok(None)
}

/// Deletes up to `limit` topic rows (`durastep.topics`, one per event name ever
/// sent or awaited) that no wait uses; returns how many. Rows that a sender or
/// a waiter holds locked are skipped (SKIP LOCKED), and a deleted row is
/// created again by the next send or wait of its name, so the rendezvous
/// stays lossless: a recorded wait is seen by every later sender's snapshot,
/// and a deletion cannot happen while a sender holds its row FOR SHARE.
pub(crate) async fn prune_topics(pool: &PgPool, limit: i64) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM durastep.topics WHERE name IN (
             SELECT t.name FROM durastep.topics t
              WHERE NOT EXISTS (SELECT 1 FROM durastep.waits w WHERE w.event_name = t.name)
              LIMIT $1 FOR UPDATE SKIP LOCKED)",
    )
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(done.rows_affected())
}

/// What a replay did to one run.
pub(crate) enum ReplayOutcome {
    /// Queued again.
    Replayed,
    /// Not failed or cancelled: left as it was (its state).
    NotReplayable(RunState),
}

/// Puts failed or cancelled runs back in the queue, due now, with a fresh set of
/// attempts (their function's `max_attempts` from the current attempt on). With
/// `from_start`, their stored step results are deleted first, in the same
/// statement; otherwise finished steps are kept and replay. Runs in other
/// states are left alone. Returns, per id, what happened (None: no such run).
/// Workers are woken when the statement's transaction commits (in `conn`'s
/// transaction if it has one, at once otherwise).
pub(crate) async fn replay(
    conn: &mut PgConnection,
    ids: &[Uuid],
    from_start: bool,
) -> Result<Vec<(Uuid, Option<ReplayOutcome>)>, sqlx::Error> {
    let rows: Vec<(Uuid, Option<RunState>, Option<String>)> =
        sqlx::query_as(include_str!("sql/replay.sql")).bind(ids).bind(from_start).fetch_all(&mut *conn).await?;
    let functions: Vec<&str> = rows.iter().filter_map(|r| r.2.as_deref()).collect();
    if !functions.is_empty() {
        wake_workers(&mut *conn, &functions).await?;
    }
    Ok(rows
        .into_iter()
        .map(|(id, state, function)| {
            let outcome = match (state, function) {
                (None, _) => None,
                (Some(_), Some(_)) => Some(ReplayOutcome::Replayed),
                (Some(s), None) => Some(ReplayOutcome::NotReplayable(s)),
            };
            (id, outcome)
        })
        .collect())
}

/// What one pruning batch removed.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Pruned {
    pub runs: u64,
    pub events: u64,
    pub flow_keys: u64,
    /// Where the pass's next batch goes on: the largest time-ordered id this
    /// batch deleted (or the batch's `after`).
    pub last_run: Option<Uuid>,
}

/// How many runs [`prune_batch`] would delete now (the same condition, no lock).
pub(crate) async fn prunable(pool: &PgPool, older_than: Duration) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        // The runs `prune_batch` walks (migration 0033): by id up to the
        // bound's ceiling, and those with other ids created before it.
        concat!(
            "WITH t AS MATERIALIZED (SELECT durastep.now() - make_interval(secs => $1) AS bound)
             SELECT count(*) FROM durastep.runs r
              WHERE (r.id < (SELECT durastep.run_id_ceiling(t.bound) FROM t)
                     OR (",
            legacy!(),
            " AND r.created_at < (SELECT t.bound FROM t)))
                AND r.finished_at < (SELECT t.bound FROM t)
                AND r.state IN ('completed', 'failed', 'cancelled', 'skipped')
                AND (r.worker_id IS NULL OR r.state = 'completed')
                AND NOT EXISTS (SELECT 1 FROM durastep.runs p WHERE p.id = r.parent_run_id
                                 AND p.state IN ('queued', 'running', 'sleeping', 'waiting', 'diverged'))"
        ),
    )
    .bind(secs(older_than))
    .fetch_one(pool)
    .await
}

/// Deletes up to `batch` finished runs (completed, failed, cancelled, skipped)
/// that finished before `older_than` ago, with their steps and history, and the
/// events older than that bound that no run references any more (neither as
/// its event nor as an earlier event merged into a debounced run); also idle
/// flow-control key rows. Rows other transactions hold are skipped (SKIP
/// LOCKED), so a batch never waits on a worker; each batch is one short
/// transaction. A run whose parent has not finished is kept (the parent's
/// invoke may still look for it), and so is a cancelled run whose attempt is
/// still stopping (`worker_id` set: it holds its slots until then). Runs
/// with time-ordered ids are looked for after `after`, the `last_run` of the
/// pass's batch before (migration 0033). The statements are the function
/// `durastep.prune_batch` (migrations 0017, 0033).
pub(crate) async fn prune_batch(
    pool: &PgPool,
    older_than: Duration,
    batch: i64,
    after: Option<Uuid>,
) -> Result<Pruned, sqlx::Error> {
    let (runs, events, flow_keys, last_run): (i64, i64, i64, Option<Uuid>) = sqlx::query_as(
        "SELECT pruned_runs, pruned_events, pruned_flow_keys, last_run FROM durastep.prune_batch($1, $2, $3)",
    )
    .bind(secs(older_than))
    .bind(i32::try_from(batch).unwrap_or(i32::MAX))
    .bind(after)
    .fetch_one(pool)
    .await?;
    Ok(Pruned { runs: runs as u64, events: events as u64, flow_keys: flow_keys as u64, last_run })
}

/// Rows per pruning transaction: small, so no lock is held for long.
pub(crate) const PRUNE_BATCH: i64 = 500;

/// What [`prune_all`] removed, in all.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PruneTotals {
    pub runs: u64,
    pub events: u64,
    pub flow_keys: u64,
    pub topics: u64,
    pub batches: u64,
}

/// Prunes in batches of [`PRUNE_BATCH`] until one finds nothing or
/// `max_batches` ran (the engine's `prune` and the worker's retention loop).
pub(crate) async fn prune_all(
    pool: &PgPool,
    older_than: Duration,
    max_batches: u64,
) -> Result<PruneTotals, sqlx::Error> {
    let mut report = PruneTotals::default();
    let mut after = None;
    while report.batches < max_batches {
        let p = prune_batch(pool, older_than, PRUNE_BATCH, after).await?;
        after = p.last_run;
        report.batches += 1;
        report.runs += p.runs;
        report.events += p.events;
        report.flow_keys += p.flow_keys;
        if p.runs == 0 && p.events == 0 && p.flow_keys < PRUNE_BATCH as u64 {
            break;
        }
    }
    // Topic rows are independent of runs: pruned in their own small batches.
    for _ in 0..max_batches {
        let n = prune_topics(pool, PRUNE_BATCH).await?;
        report.topics += n;
        report.batches += 1;
        if n < PRUNE_BATCH as u64 {
            break;
        }
    }
    Ok(report)
}
