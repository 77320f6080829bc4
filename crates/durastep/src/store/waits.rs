//! Waits: a run suspended on an event (`wait_for_event`) or on a child run
//! (`invoke`), and the authentication of what was delivered to it.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::PgPool;
use uuid::Uuid;

use super::{Fence, insert_entry, load_step, wake_workers};
use crate::journal::EntryKind;

/// What a wait for an event came to, when it was not left waiting.
pub(crate) enum WaitOutcome {
    /// The run is `waiting`; the attempt ends.
    Suspended,
    /// Resolved: the stored result (an event or a timeout record).
    Resolved(Value),
    /// The attempt no longer holds the run.
    Fenced,
}

/// What a wait stores for its step when it times out.
pub(crate) const WAIT_TIMED_OUT: &str = r#"{"timed_out": true}"#;

/// Records a wait for an event of `event_name` whose value at `path` equals
/// `value` (any event of the name when `path` is None), and suspends the run
/// until it arrives or until the deadline, which is computed at the first call
/// (`timeout_secs` from then; None: no deadline) and kept by the wait's row.
/// A result already stored (an event delivered since the claim) is returned
/// instead; a deadline already passed stores the timeout record.
///
/// Lock order: the topic row first (an UPDATE, which conflicts with every
/// sender's FOR SHARE, taken in `durastep.send_events`), then the run row (fencing).
///
/// With `sibling` (another wait of the same attempt is recording itself at
/// the same moment, or has already suspended the run: a handler that joins
/// two waits), the run may also be `waiting` or `queued` under the same lease
/// epoch (no other attempt has claimed it since): the wait is recorded all
/// the same, and the run's wake-up time becomes the earlier of the deadlines.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn wait_for_event(
    pool: &PgPool,
    fence: Fence,
    key: &str,
    event_name: &str,
    path: Option<&[String]>,
    value: Option<&str>,
    timeout_secs: Option<f64>,
    sibling: bool,
    entry: (u32, EntryKind),
) -> Result<WaitOutcome, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO durastep.topics (name, waits) VALUES ($1, 1)
         ON CONFLICT (name) DO UPDATE SET waits = durastep.topics.waits + 1",
    )
    .bind(event_name)
    .execute(&mut *tx)
    .await?;
    // A fresh statement: its snapshot is taken after the topic lock.
    // The deadline comes back as NULL for 'infinity' (no timeout), which
    // chrono cannot hold; it is written back as 'infinity' below.
    let state: Option<(Option<Value>, Option<DateTime<Utc>>, bool)> = sqlx::query_as(
        "WITH l AS (SELECT id FROM durastep.runs
                      WHERE id = $1 AND lease_epoch = $2
                        AND (state = 'running' OR ($5 AND state IN ('waiting', 'queued')))
                     FOR NO KEY UPDATE),
         dl AS (SELECT coalesce(
                   (SELECT w.expires_at FROM durastep.waits w WHERE w.run_id = $1 AND w.step_key = $3),
                   CASE WHEN $4::float8 IS NULL THEN 'infinity'::timestamptz
                        ELSE durastep.now() + make_interval(secs => $4) END) AS at)
         SELECT (SELECT s.output FROM durastep.step_results s WHERE s.run_id = $1 AND s.step_key = $3),
                nullif(dl.at, 'infinity'), dl.at <= durastep.now()
           FROM l, dl",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(key)
    .bind(timeout_secs)
    .bind(sibling)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((stored, deadline, due)) = state else {
        return Ok(WaitOutcome::Fenced);
    };
    // The wait's journal entry, with the wait itself (and behind the same
    // fencing, which lets a sibling wait of a joined set record too).
    insert_entry(&mut tx, run_id, entry.0, entry.1, key).await?;
    if let Some(stored) = stored {
        sqlx::query("DELETE FROM durastep.waits WHERE run_id = $1 AND step_key = $2")
            .bind(run_id)
            .bind(key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        return Ok(WaitOutcome::Resolved(stored));
    }
    if due {
        // No sender can deliver meanwhile (we hold the topic), so the insert stores.
        let stored: Option<Value> = sqlx::query_scalar(
            "WITH d AS (DELETE FROM durastep.waits WHERE run_id = $1 AND step_key = $2),
             ins AS (INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
                     VALUES ($1, $2, $3::jsonb, $4) ON CONFLICT DO NOTHING RETURNING output)
             SELECT output FROM ins",
        )
        .bind(run_id)
        .bind(key)
        .bind(WAIT_TIMED_OUT)
        .bind(epoch)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        return match stored {
            Some(v) => Ok(WaitOutcome::Resolved(v)),
            None => Ok(load_step(&mut *pool.acquire().await?, run_id, key)
                .await?
                .map_or(WaitOutcome::Fenced, WaitOutcome::Resolved)),
        };
    }
    sqlx::query(
        "WITH w AS (
             INSERT INTO durastep.waits (run_id, step_key, event_name, match_path, match_value, expires_at)
             VALUES ($1, $2, $3, $4, $5::jsonb, coalesce($6::timestamptz, 'infinity'))
             ON CONFLICT (run_id, step_key) DO NOTHING)
         UPDATE durastep.runs
            SET state = CASE WHEN state = 'queued' THEN 'queued' ELSE 'waiting' END,
                run_at = CASE WHEN state = 'running' THEN coalesce($6::timestamptz, 'infinity')
                              WHEN state = 'waiting' THEN least(run_at, coalesce($6::timestamptz, 'infinity'))
                              ELSE run_at END,
                lease_expires_at = NULL, worker_id = NULL
          WHERE id = $1",
    )
    .bind(run_id)
    .bind(key)
    .bind(event_name)
    .bind(path)
    .bind(value)
    .bind(deadline)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(WaitOutcome::Suspended)
}

/// How an invoke went, when it did not leave the parent waiting.
pub(crate) enum InvokeOutcome {
    /// The parent is `waiting` for its child; the attempt ends.
    Suspended,
    /// Resolved: the stored result (the child's outcome, or a timeout record).
    Resolved(Value),
    /// The attempt no longer holds the parent.
    Fenced,
    /// No function has this id.
    UnknownFunction,
}

/// A parent's child as `invoke` finds it: id, deadline (none: no timeout),
/// whether the deadline has passed, and the outcome record of a finished child.
type ChildProbe = (Uuid, Option<DateTime<Utc>>, bool, Option<Value>);

/// Starts (once) the child run of `function_id` for the parent's step `key`,
/// with `input`, and suspends the parent until the child finishes (the
/// `runs_child_finished` trigger stores the outcome and wakes the parent) or
/// until `timeout_secs` after the child was created (None: no deadline). A
/// child that already exists for this step is reused, never started twice (the
/// unique index `runs_parent`); one that has already finished (its outcome was
/// not delivered because the parent had finished: a replayed parent) has its
/// outcome stored and returned here. On timeout the timeout record is stored
/// and the child is cancelled. All in one transaction, fenced on the parent.
///
/// The child's row is locked `FOR SHARE` before its state is read, so a
/// completion of the child that is being committed meanwhile is ordered with
/// this transaction: either it commits first (and is seen finished here), or it
/// waits until this one has committed (and then finds the parent `waiting`, or
/// the timeout record stored and itself cancelled).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn invoke(
    pool: &PgPool,
    fence: Fence,
    key: &str,
    function_id: &str,
    input: &str,
    timeout_secs: Option<f64>,
) -> Result<InvokeOutcome, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    let mut tx = pool.begin().await?;
    let live: Option<Option<Value>> = sqlx::query_scalar(
        "WITH l AS (SELECT id FROM durastep.runs WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
                     FOR NO KEY UPDATE)
         SELECT (SELECT s.output FROM durastep.step_results s WHERE s.run_id = $1 AND s.step_key = $3) FROM l",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(key)
    .fetch_optional(&mut *tx)
    .await?;
    match live {
        None => return Ok(InvokeOutcome::Fenced),
        Some(Some(stored)) => {
            tx.commit().await?;
            return Ok(InvokeOutcome::Resolved(stored));
        }
        Some(None) => {}
    }
    sqlx::query(
        "WITH f AS (SELECT id, max_attempts, start_timeout_secs, finish_timeout_secs, version
                      FROM durastep.functions WHERE id = $3),
         ev AS (
             INSERT INTO durastep.events (id, name, payload, idempotency_key)
             SELECT durastep.uuid7(), 'durastep/invoke:' || f.id, $4::jsonb, $1::text || ':' || $2 FROM f
              WHERE NOT EXISTS (SELECT 1 FROM durastep.runs c WHERE c.parent_run_id = $1 AND c.parent_step_key = $2)
             ON CONFLICT DO NOTHING
             RETURNING id)
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, parent_run_id, parent_step_key,
                                    start_by, deadline_at, version)
         SELECT durastep.uuid7(), f.id, ev.id, 'queued', durastep.now(), f.max_attempts, $1, $2,
                durastep.now() + make_interval(secs => f.start_timeout_secs),
                durastep.now() + make_interval(secs => f.finish_timeout_secs), f.version
           FROM f, ev",
    )
    .bind(run_id)
    .bind(key)
    .bind(function_id)
    .bind(input)
    .execute(&mut *tx)
    .await?;
    // The outcome record is the one `durastep.resume_parent` (0003) stores.
    // NULL deadline: no timeout ('infinity', which chrono cannot hold).
    let child: Option<ChildProbe> = sqlx::query_as(
        "SELECT c.id, nullif(d.at, 'infinity'), d.at <= durastep.now(),
                CASE WHEN c.state IN ('completed', 'failed', 'cancelled') THEN
                     jsonb_build_object('child_run_id', c.id, 'state', c.state, 'output', c.output,
                                        'error', coalesce(c.cancel_reason, c.last_error)) END
           FROM durastep.runs c,
                LATERAL (SELECT CASE WHEN $3::float8 IS NULL THEN 'infinity'::timestamptz
                                     ELSE c.created_at + make_interval(secs => $3) END AS at) d
          WHERE c.parent_run_id = $1 AND c.parent_step_key = $2
            FOR SHARE OF c",
    )
    .bind(run_id)
    .bind(key)
    .bind(timeout_secs)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((child_id, deadline, due, finished)) = child else {
        return Ok(InvokeOutcome::UnknownFunction);
    };
    if finished.is_some() || due {
        let timed_out = finished.is_none();
        let record = finished.unwrap_or_else(|| serde_json::json!({"timed_out": true}));
        let stored: Option<Value> = sqlx::query_scalar(
            "INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch)
             VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING RETURNING output",
        )
        .bind(run_id)
        .bind(key)
        .bind(&record)
        .bind(epoch)
        .fetch_optional(&mut *tx)
        .await?;
        if timed_out && stored.is_some() {
            sqlx::query(
                "UPDATE durastep.runs SET state = 'cancelled', cancel_reason = 'the parent stopped waiting (invoke timeout)',
                        finished_at = durastep.now()
                  WHERE id = $1 AND state NOT IN ('completed', 'failed', 'cancelled')",
            )
            .bind(child_id)
            .execute(&mut *tx)
            .await?;
        }
        // A result stored meanwhile by a committed transaction: a new statement
        // (a new snapshot) reads it.
        let stored = match stored {
            Some(v) => v,
            None => load_step(&mut tx, run_id, key).await?.ok_or_else(|| {
                sqlx::Error::Protocol(format!("invoke {key}: the stored result of the step disappeared"))
            })?,
        };
        tx.commit().await?;
        return Ok(InvokeOutcome::Resolved(stored));
    }
    // The parent's row is locked by this transaction (the fencing read above).
    sqlx::query(
        "UPDATE durastep.runs SET state = 'waiting', run_at = coalesce($2::timestamptz, 'infinity'),
                lease_expires_at = NULL, worker_id = NULL
          WHERE id = $1",
    )
    .bind(run_id)
    .bind(deadline)
    .execute(&mut *tx)
    .await?;
    // The child may be new and due now: wake the workers of its function.
    wake_workers(&mut *tx, &[function_id]).await?;
    tx.commit().await?;
    Ok(InvokeOutcome::Suspended)
}

/// Replaces a plain record written by SQL (a wait result, a child outcome)
/// with its sealed form, once the engine has authenticated it. Only while the
/// stored value is still the one authenticated.
pub(crate) async fn reseal_step(
    pool: &PgPool,
    run_id: Uuid,
    key: &str,
    plain: &Value,
    sealed: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "UPDATE durastep.step_results SET output = $4::jsonb
          WHERE run_id = $1 AND step_key = $2 AND output = $3",
    )
    .bind(run_id)
    .bind(key)
    .bind(plain)
    .bind(sealed)
    .execute(pool)
    .await?;
    Ok(())
}

/// Whether a stored event has this id, name and data (authenticates a wait result).
pub(crate) async fn event_is(pool: &PgPool, id: Uuid, name: &str, data: &Value) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM durastep.events WHERE id = $1 AND name = $2 AND payload = $3)")
        .bind(id)
        .bind(name)
        .bind(data)
        .fetch_one(pool)
        .await
}
