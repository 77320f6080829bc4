//! Attempt writes: everything a running attempt stores (checkpoints and
//! completions by group commit, `step_tx` checkpoints, failure, sleep, release,
//! divergence, journal entries). Every write here takes a [`Fence`] and matches
//! nothing once the attempt has lost its run.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::{PgConnection, PgPool};
use uuid::Uuid;

use super::{Fence, load_step, secs};
use crate::RunState;
use crate::journal::EntryKind;

/// When a step ran (database clock, as the attempt knows it) and in which attempt.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepTiming {
    pub started_at: DateTime<Utc>,
    pub finished_at: DateTime<Utc>,
    pub attempt: i32,
}

/// One pending write of the group commit.
pub(crate) enum PendingWrite {
    /// Store a step result.
    Checkpoint { fence: Fence, key: String, output: String, timing: StepTiming, entry: (u32, EntryKind) },
    /// Complete the run with its output.
    Complete { fence: Fence, output: String },
}

impl PendingWrite {
    /// Bytes of the output it stores (what a flush statement carries).
    pub(crate) fn output_len(&self) -> usize {
        match self {
            PendingWrite::Checkpoint { output, key, .. } => output.len() + key.len(),
            PendingWrite::Complete { output, .. } => output.len(),
        }
    }
}

/// What happened to one pending write.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum WriteOutcome {
    /// Stored now.
    Stored,
    /// A result for this step was already stored; here it is (the stored value wins).
    Adopted(Value),
    /// The attempt no longer holds the run: nothing was written.
    Fenced,
}

/// The group-commit statement; `$lock` is how it locks the run rows, `$cps`
/// and `$dns` the checkpoints' and completions' parts (`checkpoints!` or
/// `no_checkpoints!`, `completions!` or `no_completions!`: a batch of
/// checkpoints only updates no run row and so fires none of the statement
/// triggers on `runs`; the completions' half of the answer follows the
/// checkpoints' with `UNION ALL` when there is one), `$inserts` what its
/// insert does with a step row already stored ([`Conflicts`]:
/// `plain_inserts!` or `adopting_inserts!`; `no_inserts!` without
/// checkpoints) ([`Halves`]).
///
/// The parameters are read through the CTE `p`, never directly: a custom plan
/// would see the arrays' lengths, estimate fewer rows than the generic plan and
/// so always look cheaper, and Postgres would plan every flush again (1.3 ms
/// per flush here against 0.3 ms to execute it; `benches/sql/plans.sh`,
/// docs/performance.md "Plans"). Through `p` both plans estimate alike, and
/// the generic one is kept after the first five executions.
///
/// `l` finds its run rows by id alone and reads `state = 'running'` after the
/// lock (`live`, from the row version the lock returns, as the `WHERE` would
/// have been rechecked on it): with the state in its `WHERE`, Postgres chose
/// the partial index `runs_running` and read every running run of every
/// worker, comparing each with the whole id array, on every flush, whenever
/// few of the table's runs were running (docs/performance.md "A flush that
/// read every running run"; `tests/plans.rs`; since migration 0034 that
/// index is gone, and the plan to fear is a sequential scan). For the same reason a write
/// the lock skipped looks its run up by id (a scalar subquery) to tell a
/// run locked by another transaction from a fenced one: as an `EXISTS` it
/// became a hash over every running run.
///
/// The arrays are unnested in select lists (`SELECT unnest(a), unnest(b)`,
/// which Postgres steps through together, one row per element, as a
/// `ProjectSet` node that streams its rows), never as `unnest(a, b) WITH
/// ORDINALITY` in a `FROM`: a function in a `FROM` puts all its rows in a
/// tuple store first, and the CTE that two parts of the statement read
/// stored them again. Each part now unnests what it reads itself: the
/// insert every column (`cp`, read once, so inlined), the answer only the
/// ids, epochs, keys and the position (`ord`, 1-based, as `WITH ORDINALITY`
/// gave it). Counted, a flush of 32 checkpoints costs the server 12.1% less,
/// one of 16 checkpoints and 16 completions 4.8% less (docs/performance.md
/// "The flush's arrays streamed").
macro_rules! flush_sql {
    ($lock:literal, $cps:ident, $dns:ident, $inserts:ident) => {
        concat!(
            "WITH p AS MATERIALIZED (
             SELECT $1::uuid[] AS cp_run, $2::bigint[] AS cp_epoch, $3::text[] AS cp_key, $4::text[] AS cp_output,
                    $5::uuid[] AS dn_run, $6::bigint[] AS dn_epoch, $7::text[] AS dn_output,
                    $8::timestamptz[] AS cp_started, $9::timestamptz[] AS cp_finished, $10::int[] AS cp_attempt,
                    $11::int[] AS cp_position, $12::text[] AS cp_kind)",
            $cps!(input),
            $dns!(input),
            ",
         l AS (
             SELECT r.id, r.lease_epoch, r.state = 'running' AS live FROM durastep.runs r
              WHERE r.id = ANY ((SELECT p.cp_run || p.dn_run FROM p)::uuid[])
              ORDER BY r.id ",
            $lock,
            ")",
            $cps!(insert),
            $inserts!(results),
            $cps!(inserted),
            $dns!(writes),
            "
         ",
            $cps!(answer),
            $inserts!(written),
            $cps!(answered),
            $inserts!(join),
            "
         ",
            $dns!(answer, $cps)
        )
    };
}

/// The inserts of `flush_sql!` for [`Conflicts::Fail`]: plain `INSERT`s.
/// A statement that succeeds stored every write its fence let through, so
/// "written" is "live" and the step rows need no `RETURNING` to tell.
macro_rules! plain_inserts {
    (results) => {
        ""
    };
    (written) => {
        "(l.id IS NOT NULL)"
    };
    (join) => {
        ""
    };
}

/// The inserts of `flush_sql!` for [`Conflicts::Adopt`]: a stored row is
/// skipped, and "written" tells the stored (adopted) ones apart.
macro_rules! adopting_inserts {
    (results) => {
        "ON CONFLICT DO NOTHING RETURNING run_id, step_key"
    };
    (written) => {
        "(ins.run_id IS NOT NULL)"
    };
    (join) => {
        "LEFT JOIN ins ON ins.run_id = cp.run_id AND ins.step_key = cp.step_key"
    };
}

/// The inserts of `flush_sql!` for a batch without checkpoints: none.
macro_rules! no_inserts {
    (results) => {
        ""
    };
    (written) => {
        ""
    };
    (join) => {
        ""
    };
}

/// The checkpoints' parts of `flush_sql!`: their arrays unnested (`input`),
/// the step rows' insert behind the fence (`insert`, then the inserts'
/// `results`, then `inserted`), and the answer's rows for them (`answer`,
/// the inserts' `written`, `answered`, the inserts' `join`).
macro_rules! checkpoints {
    (input) => {
        ",
         cp AS (
             SELECT unnest(p.cp_run) AS run_id, unnest(p.cp_epoch) AS epoch, unnest(p.cp_key) AS step_key,
                    unnest(p.cp_output) AS output, unnest(p.cp_started) AS started_at,
                    unnest(p.cp_finished) AS finished_at, unnest(p.cp_attempt) AS attempt,
                    unnest(p.cp_position) AS position, unnest(p.cp_kind) AS kind
               FROM p)"
    };
    (insert) => {
        ",
         ins AS (
             INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                                position, kind)
             SELECT cp.run_id, cp.step_key, cp.output::jsonb, cp.epoch, cp.started_at, cp.finished_at, cp.attempt,
                    cp.position, cp.kind
               FROM cp JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch AND l.live
             "
    };
    (inserted) => {
        ")"
    };
    (answer) => {
        "SELECT 0, cp.ord, (l.id IS NOT NULL), "
    };
    (then) => {
        "UNION ALL "
    };
    (answered) => {
        ",
                (l.id IS NULL AND coalesce((SELECT b.lease_epoch = cp.epoch AND b.state = 'running'
                                              FROM durastep.runs b WHERE b.id = cp.run_id), false))
           FROM (SELECT unnest(p.cp_run) AS run_id, unnest(p.cp_epoch) AS epoch, unnest(p.cp_key) AS step_key,
                        generate_series(1::bigint, cardinality(p.cp_run)) AS ord FROM p) cp
           LEFT JOIN l ON l.id = cp.run_id AND l.lease_epoch = cp.epoch AND l.live "
    };
}

/// The checkpoints' parts of `flush_sql!` for a batch of completions alone:
/// none (no insert into `step_results` to start, no half of the answer, and
/// so nothing for the completions' half to follow).
macro_rules! no_checkpoints {
    ($part:ident) => {
        ""
    };
}

/// The completions' parts of `flush_sql!`: their arrays unnested (`input`),
/// the CTEs that complete the runs and write their history rows (`writes`),
/// and the answer's rows for them (`answer`).
///
/// `fin` completes the runs (fenced by `l`). It flips `history_noted`, so
/// the `runs_changed` trigger writes no history row for them (migration
/// 0020): since migration 0045 the run carries its completion, with the
/// attempt's start the claim noted on it and the worker that ran it (which
/// `fin` no longer clears), and `durastep.run_timeline` reads both from the
/// run (docs/architecture.md "A completion kept on the run"). `fin_counted`
/// adds the completions to this connection's row of the minute in
/// `durastep.completions_per_minute`, which the per-minute counts read. The
/// clock is read once (an InitPlan): when `durastep.now()` was a PL/pgSQL
/// function (migrations 0019 to 0038) each call cost 3-4 us, once per
/// completed run; since 0039 Postgres inlines it.
macro_rules! completions {
    (input) => {
        ",
         dn AS (
             SELECT unnest(p.dn_run) AS run_id, unnest(p.dn_epoch) AS epoch, unnest(p.dn_output) AS output FROM p)"
    };
    (writes) => {
        ",
         fin AS (
             UPDATE durastep.runs r
                SET state = 'completed', output = dn.output::jsonb, finished_at = (SELECT durastep.now()),
                    lease_expires_at = NULL, history_noted = NOT r.history_noted
               FROM dn JOIN l ON l.id = dn.run_id AND l.lease_epoch = dn.epoch AND l.live
              WHERE r.id = dn.run_id
             RETURNING r.id, r.finished_at),
         fin_counted AS (
             INSERT INTO durastep.completions_per_minute AS c (minute, backend, completed)
             SELECT date_trunc('minute', min(fin.finished_at)), pg_backend_pid(), count(*) FROM fin
             HAVING count(*) > 0
             ON CONFLICT (minute, backend) DO UPDATE SET completed = c.completed + excluded.completed)"
    };
    (answer, $cps:ident) => {
        concat!(
            $cps!(then),
            "SELECT 1, dn.ord, (fin.id IS NOT NULL), (fin.id IS NOT NULL),
                (fin.id IS NULL AND coalesce((SELECT b.lease_epoch = dn.epoch AND b.state = 'running'
                                                FROM durastep.runs b WHERE b.id = dn.run_id), false))
           FROM (SELECT unnest(p.dn_run) AS run_id, unnest(p.dn_epoch) AS epoch,
                        generate_series(1::bigint, cardinality(p.dn_run)) AS ord FROM p) dn
           LEFT JOIN fin ON fin.id = dn.run_id"
        )
    };
}

/// The completions' parts of `flush_sql!` for a batch of checkpoints alone:
/// none. No statement then updates `runs` (so its statement trigger does
/// not fire), and the answer has the checkpoints' rows only.
macro_rules! no_completions {
    ($($part:ident),+) => {
        ""
    };
}

/// Which writes a flush's batch holds: each kind's parts of `flush_sql!`
/// are in its statement only when the batch has writes of that kind. An
/// empty part is not free: Postgres starts every CTE and every branch of the
/// answer on each execution, so a flush of checkpoints alone with the
/// completions' parts (empty arrays) cost the server about 60,000 more
/// instructions (a flush of 32 checkpoints 2.5% more, of 4 5.5%), and one of
/// completions alone with the checkpoints' parts about 153,000 more (4
/// completions: 9%) (docs/performance.md "Flushes without an empty half").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Halves {
    /// Checkpoints and completions.
    Both,
    /// Checkpoints alone.
    Checkpoints,
    /// Completions alone.
    Completions,
}

impl Halves {
    fn of(checkpoints: usize, completions: usize) -> Halves {
        match (checkpoints, completions) {
            (_, 0) => Halves::Checkpoints,
            (0, _) => Halves::Completions,
            _ => Halves::Both,
        }
    }
}

/// What a flush's insert does with a step row already stored. A step row
/// carries its journal entry (`position`, `kind`; migration 0029), so the
/// flush writes one row per checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conflicts {
    /// Plain inserts: one stored row fails the whole statement (a unique
    /// violation) and nothing of it is written. Every flush tries this first:
    /// an `ON CONFLICT` insert is a speculative insertion, which probes the
    /// unique index before the insert and confirms the row with one more WAL
    /// record after it (docs/performance.md "Plain inserts for checkpoints").
    Fail,
    /// `ON CONFLICT DO NOTHING`: a stored row is skipped, and the flush adopts
    /// its output. Only after [`Conflicts::Fail`] met a stored row.
    Adopt,
}

/// The group-commit statement for a batch: how it locks, which writes it
/// holds, and what its inserts do with stored rows (a batch of completions
/// alone inserts nothing, so it has one text for both).
fn flush_statement(locks: LockWait, halves: Halves, conflicts: Conflicts) -> &'static str {
    use Conflicts::{Adopt, Fail};
    macro_rules! locking {
        ($($parts:tt)*) => {
            match locks {
                LockWait::Skip => flush_sql!("FOR NO KEY UPDATE SKIP LOCKED", $($parts)*),
                LockWait::Wait => flush_sql!("FOR NO KEY UPDATE", $($parts)*),
            }
        };
    }
    match (halves, conflicts) {
        (Halves::Both, Fail) => locking!(checkpoints, completions, plain_inserts),
        (Halves::Both, Adopt) => locking!(checkpoints, completions, adopting_inserts),
        (Halves::Checkpoints, Fail) => locking!(checkpoints, no_completions, plain_inserts),
        (Halves::Checkpoints, Adopt) => locking!(checkpoints, no_completions, adopting_inserts),
        (Halves::Completions, _) => locking!(no_checkpoints, completions, no_inserts),
    }
}

/// Whether `e` is a unique violation of a stored step row.
fn is_stored_step(e: &sqlx::Error) -> bool {
    e.as_database_error().is_some_and(|d| d.is_unique_violation() && d.constraint() == Some("step_results_pkey"))
}

/// What a flush did to one pending write.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Flushed {
    /// Written, adopted or fenced.
    Done(WriteOutcome),
    /// Not attempted: its run's row is locked by another transaction (only
    /// when the flush skips locked rows). Flush it again, waiting for the lock.
    Busy,
}

/// How a flush treats run rows another transaction has locked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockWait {
    /// Skip them: their writes come back [`Flushed::Busy`], the rest commit now.
    Skip,
    /// Wait for them.
    Wait,
}

/// Group commit: stores every pending step result and completion in ONE
/// statement (one transaction), each behind its own fencing check. Safe to
/// repeat after an ambiguous commit: a repeated checkpoint adopts the stored
/// row and a repeated completion is recognised by its epoch. With
/// [`LockWait::Skip`], a run row that another transaction holds (an
/// application's `send_in` that cancels the run, left open) does not hold up
/// the other runs' writes: its writes come back [`Flushed::Busy`].
pub(crate) async fn flush_writes(
    conn: &mut PgConnection,
    writes: &[PendingWrite],
    locks: LockWait,
) -> Result<Vec<Flushed>, sqlx::Error> {
    let (mut cp_run, mut cp_epoch, mut cp_key, mut cp_out) = (vec![], vec![], vec![], vec![]);
    let (mut cp_start, mut cp_end, mut cp_attempt) = (vec![], vec![], vec![]);
    let (mut cp_pos, mut cp_kind) = (vec![], vec![]);
    let (mut dn_run, mut dn_epoch, mut dn_out) = (vec![], vec![], vec![]);
    for w in writes {
        match w {
            PendingWrite::Checkpoint { fence, key, output, timing, entry } => {
                let (run_id, epoch) = (fence.run_id(), fence.epoch());
                cp_pos.push(i32::try_from(entry.0).unwrap_or(i32::MAX));
                cp_kind.push(entry.1.as_str());
                cp_run.push(run_id);
                cp_epoch.push(epoch);
                cp_key.push(key.as_str());
                cp_out.push(output.as_str());
                cp_start.push(timing.started_at);
                cp_end.push(timing.finished_at);
                cp_attempt.push(timing.attempt);
            }
            PendingWrite::Complete { fence, output } => {
                let (run_id, epoch) = (fence.run_id(), fence.epoch());
                dn_run.push(run_id);
                dn_epoch.push(epoch);
                dn_out.push(output.as_str());
            }
        }
    }
    let flush = |conflicts: Conflicts| {
        sqlx::query_as::<_, (i32, i64, bool, bool, bool)>(flush_statement(
            locks,
            Halves::of(cp_run.len(), dn_run.len()),
            conflicts,
        ))
        .bind(&cp_run)
        .bind(&cp_epoch)
        .bind(&cp_key)
        .bind(&cp_out)
        .bind(&dn_run)
        .bind(&dn_epoch)
        .bind(&dn_out)
        .bind(&cp_start)
        .bind(&cp_end)
        .bind(&cp_attempt)
        .bind(&cp_pos)
        .bind(&cp_kind)
    };
    // Plain inserts first; a step row already stored (a
    // flush repeated after an ambiguous commit) fails that statement whole,
    // and the same writes go again adopting what is stored.
    let rows = match flush(Conflicts::Fail).fetch_all(&mut *conn).await {
        Err(e) if is_stored_step(&e) => {
            tracing::debug!(writes = writes.len(), "a step of the flush is stored already; flushing again to adopt it");
            flush(Conflicts::Adopt).fetch_all(&mut *conn).await?
        }
        rows => rows?,
    };

    let mut cp_result = vec![WriteOutcome::Fenced; cp_run.len()];
    let mut dn_result = vec![WriteOutcome::Fenced; dn_run.len()];
    let mut conflicts = Vec::new();
    let mut unfinished = Vec::new();
    let (mut cp_busy, mut dn_busy) = (vec![false; cp_run.len()], vec![false; dn_run.len()]);
    for (kind, ord, live, written, busy) in rows {
        let i = (ord - 1) as usize;
        // Busy means "skipped, still ours by the snapshot"; when waiting for
        // locks, a row that changed meanwhile is simply fenced.
        if busy && locks == LockWait::Skip {
            if kind == 0 {
                cp_busy[i] = true;
            } else {
                dn_busy[i] = true;
            }
            continue;
        }
        match (kind, live, written) {
            (0, true, true) => cp_result[i] = WriteOutcome::Stored,
            (0, true, false) => conflicts.push(i),
            (1, _, true) => dn_result[i] = WriteOutcome::Stored,
            (1, _, false) => unfinished.push(i),
            _ => {}
        }
    }
    if !conflicts.is_empty() {
        let runs: Vec<Uuid> = conflicts.iter().map(|&i| cp_run[i]).collect();
        let keys: Vec<&str> = conflicts.iter().map(|&i| cp_key[i]).collect();
        let stored: Vec<(i64, Value)> = sqlx::query_as(
            "SELECT t.ord, s.output
               FROM unnest($1::uuid[], $2::text[]) WITH ORDINALITY AS t(run_id, step_key, ord)
               JOIN durastep.step_results s ON s.run_id = t.run_id AND s.step_key = t.step_key",
        )
        .bind(&runs)
        .bind(&keys)
        .fetch_all(&mut *conn)
        .await?;
        for (ord, output) in stored {
            cp_result[conflicts[(ord - 1) as usize]] = WriteOutcome::Adopted(output);
        }
    }
    if !unfinished.is_empty() {
        // A completion that matched nothing: either fenced, or our own earlier
        // commit whose acknowledgement was lost.
        let runs: Vec<Uuid> = unfinished.iter().map(|&i| dn_run[i]).collect();
        let epochs: Vec<i64> = unfinished.iter().map(|&i| dn_epoch[i]).collect();
        let done: Vec<i64> = sqlx::query_scalar(
            "SELECT t.ord FROM unnest($1::uuid[], $2::bigint[]) WITH ORDINALITY AS t(run_id, epoch, ord)
               JOIN durastep.runs r ON r.id = t.run_id AND r.lease_epoch = t.epoch AND r.state = 'completed'",
        )
        .bind(&runs)
        .bind(&epochs)
        .fetch_all(&mut *conn)
        .await?;
        for ord in done {
            dn_result[unfinished[(ord - 1) as usize]] = WriteOutcome::Stored;
        }
    }
    let flushed = |o: WriteOutcome, busy: bool| if busy { Flushed::Busy } else { Flushed::Done(o) };
    let mut cp_iter = cp_result.into_iter().zip(cp_busy).map(|(o, b)| flushed(o, b));
    let mut dn_iter = dn_result.into_iter().zip(dn_busy).map(|(o, b)| flushed(o, b));
    Ok(writes
        .iter()
        .map(|w| match w {
            PendingWrite::Checkpoint { .. } => cp_iter.next(),
            PendingWrite::Complete { .. } => dn_iter.next(),
        })
        .map(|o| o.unwrap_or(Flushed::Done(WriteOutcome::Fenced)))
        .collect())
}

/// The end of a failed attempt: retry after `delay`, or fail the run when it is
/// out of attempts (attempts lost with a lease do not count: `attempt -
/// lease_losses`) or the failure is permanent. Returns the new state, or None
/// when the attempt no longer holds the run.
///
/// With `pause` (the error named a retry-after delay and the function has a
/// back-pressure rule), the run's back-pressure keys pause until now + `delay`
/// in the same statement, and the retry does not count as an attempt while the
/// run has had fewer than `free_pauses` such retries.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn fail_attempt(
    pool: &PgPool,
    fence: Fence,
    error: &str,
    permanent: bool,
    delay: Duration,
    pause: bool,
    free_pauses: i32,
    failed_step: Option<&str>,
) -> Result<Option<RunState>, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    sqlx::query_scalar(include_str!("sql/fail_attempt.sql"))
        .bind(run_id)
        .bind(epoch)
        .bind(error)
        .bind(permanent)
        .bind(secs(delay))
        .bind(pause)
        .bind(free_pauses)
        .bind(failed_step)
        .fetch_optional(pool)
        .await
}

/// Suspends a run until `wake_at` if that is still in the future by the database
/// clock. Returns Some(true) if suspended, Some(false) if already due (the
/// attempt goes on), None if fenced.
pub(crate) async fn suspend_until(
    pool: &PgPool,
    fence: Fence,
    wake_at: DateTime<Utc>,
) -> Result<Option<bool>, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    sqlx::query_scalar(
        "UPDATE durastep.runs
            SET state = CASE WHEN $3 > durastep.now() THEN 'sleeping' ELSE 'running' END,
                run_at = CASE WHEN $3 > durastep.now() THEN $3 ELSE run_at END,
                lease_expires_at = CASE WHEN $3 > durastep.now() THEN NULL ELSE lease_expires_at END,
                worker_id = CASE WHEN $3 > durastep.now() THEN NULL ELSE worker_id END
          WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
         RETURNING state = 'sleeping'",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(wake_at)
    .fetch_optional(pool)
    .await
}

/// Gives a run back without counting the attempt (graceful shutdown, a run
/// claimed ahead that found no slot). It keeps its place in the due queue:
/// its due time stays (it was due when claimed), so it is claimed again
/// before runs that became due after it (until 2026-12-03 it was made due
/// "now", behind them). The workers of its function are notified: another
/// one may take it at once (also in another process), instead of at its next
/// poll.
pub(crate) async fn release_run(pool: &PgPool, fence: Fence) -> Result<bool, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    let (released, _): (i64, bool) = sqlx::query_as(
        "WITH u AS (
             UPDATE durastep.runs SET state = 'queued', run_at = least(run_at, durastep.now()),
                    lease_expires_at = NULL, worker_id = NULL
              WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
             RETURNING id, function_id)
         SELECT (SELECT count(*) FROM u), durastep.wake_workers(ARRAY(SELECT function_id FROM u)) IS NULL",
    )
    .bind(run_id)
    .bind(epoch)
    .fetch_one(pool)
    .await?;
    Ok(released == 1)
}

/// How [`checkpoint_in_tx`] went.
pub(crate) enum TxCheckpoint {
    /// Stored; commit the transaction.
    Stored,
    /// Stored, and this very transaction cancelled the run (the step sent an
    /// event that its own `cancel_on` rule, or its singleton key with
    /// `CancelOld`, matches): commit it, then end the attempt; the run is
    /// `cancelled` once it commits.
    StoredAndCancelled,
    /// A result was already stored: roll back and adopt it.
    Adopted(Value),
    /// The attempt lost the run: roll back.
    Fenced,
}

/// Inside a `step_tx` transaction: locks the run if this attempt still holds it
/// and stores the step result. A run that this same transaction cancelled (an
/// event the step sent matched its own run: `cancelled_by_xact` is this
/// transaction) still counts as held: the step's result and its event commit
/// together, and the attempt ends cancelled.
pub(crate) async fn checkpoint_in_tx(
    conn: &mut PgConnection,
    fence: Fence,
    key: &str,
    output: &str,
    timing: StepTiming,
    entry: (u32, EntryKind),
) -> Result<TxCheckpoint, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    let live: Option<bool> = sqlx::query_scalar(
        "SELECT state = 'cancelled' FROM durastep.runs
          WHERE id = $1 AND lease_epoch = $2
            AND (state = 'running' OR (state = 'cancelled' AND cancelled_by_xact = pg_current_xact_id()))
            FOR NO KEY UPDATE",
    )
    .bind(run_id)
    .bind(epoch)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(cancelled_here) = live else {
        return Ok(TxCheckpoint::Fenced);
    };
    let inserted = sqlx::query(
        "INSERT INTO durastep.step_results (run_id, step_key, output, lease_epoch, started_at, finished_at, attempt,
                                            position, kind)
         VALUES ($1, $2, $3::jsonb, $4, $5, $6, $7, $8, $9) ON CONFLICT (run_id, step_key) DO NOTHING",
    )
    .bind(run_id)
    .bind(key)
    .bind(output)
    .bind(epoch)
    .bind(timing.started_at)
    .bind(timing.finished_at)
    .bind(timing.attempt)
    .bind(i32::try_from(entry.0).unwrap_or(i32::MAX))
    .bind(entry.1.as_str())
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if inserted == 1 {
        return Ok(if cancelled_here { TxCheckpoint::StoredAndCancelled } else { TxCheckpoint::Stored });
    }
    Ok(match load_step(&mut *conn, run_id, key).await? {
        Some(stored) => TxCheckpoint::Adopted(stored),
        None => TxCheckpoint::Fenced,
    })
}

/// Records a journal entry when it is first asked (waits, invokes, `changed`
/// markers), if the attempt still holds the run. `Ok(false)`: fenced.
pub(crate) async fn record_entry(
    pool: &PgPool,
    fence: Fence,
    position: u32,
    kind: EntryKind,
    key: &str,
) -> Result<bool, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    let live: Option<bool> = sqlx::query_scalar(
        "WITH l AS (SELECT id FROM durastep.runs WHERE id = $1 AND lease_epoch = $2 AND state = 'running'
                     FOR NO KEY UPDATE),
         ins AS (INSERT INTO durastep.step_journal (run_id, position, kind, step_key)
                 SELECT l.id, $3, $4, $5 FROM l ON CONFLICT DO NOTHING)
         SELECT true FROM l",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(i32::try_from(position).unwrap_or(i32::MAX))
    .bind(kind.as_str())
    .bind(key)
    .fetch_optional(pool)
    .await?;
    Ok(live.is_some())
}

/// Parks a running attempt's run as `diverged` (fenced: `Ok(false)` when the
/// attempt no longer holds it). Its concurrency slots are given back by the
/// flow trigger, as for any run that leaves `running`.
pub(crate) async fn park_diverged(
    pool: &PgPool,
    fence: Fence,
    divergence: &Value,
    message: &str,
) -> Result<bool, sqlx::Error> {
    let (run_id, epoch) = (fence.run_id(), fence.epoch());
    let r = sqlx::query(
        "UPDATE durastep.runs
            SET state = 'diverged', divergence = $3, last_error = $4, lease_expires_at = NULL, worker_id = NULL
          WHERE id = $1 AND lease_epoch = $2 AND state = 'running'",
    )
    .bind(run_id)
    .bind(epoch)
    .bind(divergence)
    .bind(message)
    .execute(pool)
    .await?;
    Ok(r.rows_affected() == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Catches: a flush whose text carries the parts of a kind of write its
    /// batch does not hold (what each such empty part costs the server:
    /// [`Halves`]), or lacks those of one it holds.
    #[test]
    fn a_flush_holds_the_parts_of_the_writes_in_its_batch() {
        assert_eq!(Halves::of(3, 0), Halves::Checkpoints);
        assert_eq!(Halves::of(0, 2), Halves::Completions);
        assert_eq!(Halves::of(3, 2), Halves::Both);
        let inserts = "INSERT INTO durastep.step_results";
        let completes = "UPDATE durastep.runs";
        for locks in [LockWait::Skip, LockWait::Wait] {
            for conflicts in [Conflicts::Fail, Conflicts::Adopt] {
                let both = flush_statement(locks, Halves::Both, conflicts);
                assert!(both.contains(inserts) && both.contains(completes) && both.contains("UNION ALL"));
                let checkpoints = flush_statement(locks, Halves::Checkpoints, conflicts);
                assert!(checkpoints.contains(inserts) && !checkpoints.contains(completes));
                assert!(!checkpoints.contains("dn AS (") && !checkpoints.contains("UNION"));
                let completions = flush_statement(locks, Halves::Completions, conflicts);
                assert!(completions.contains(completes) && !completions.contains(inserts));
                assert!(!completions.contains("cp AS (") && !completions.contains("UNION"));
                assert_eq!(conflicts == Conflicts::Adopt, checkpoints.contains("ON CONFLICT DO NOTHING"));
            }
        }
    }
}
