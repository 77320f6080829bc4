//! Claim: due runs taken under a new lease epoch, and the only place a
//! [`Fence`] is made.

use std::collections::{BTreeMap, HashMap};
use std::sync::LazyLock;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::Value;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use super::{records_of, secs};
use crate::journal::JournalEntry;

/// The right to write on behalf of one attempt: a run id and the lease epoch
/// its claim set.
///
/// Every write made for a running attempt takes a `Fence`, and its statement
/// matches the run only while `(id, lease_epoch, state = 'running')` still
/// holds (under a row lock). Only a claim makes one (the constructor is
/// private to this module), so a write that is not fenced, or one fenced with
/// an epoch read from elsewhere, does not compile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Fence {
    run_id: Uuid,
    epoch: i64,
}

impl Fence {
    /// The fenced run.
    pub(crate) fn run_id(&self) -> Uuid {
        self.run_id
    }

    /// The lease epoch of the attempt that holds it.
    pub(crate) fn epoch(&self) -> i64 {
        self.epoch
    }

    /// A fence that no claim made, for the unit tests of code that only
    /// carries fences (batching); never compiled outside them.
    #[cfg(test)]
    pub(crate) fn unclaimed_for_tests(run_id: Uuid, epoch: i64) -> Fence {
        Fence { run_id, epoch }
    }
}

/// A run a worker has claimed, with everything its attempt needs.
pub(crate) struct ClaimedRun {
    pub id: Uuid,
    pub function_id: String,
    /// The function version it started under.
    pub version: i32,
    pub event_id: Uuid,
    pub attempt: i32,
    /// The run id and the lease epoch this claim set.
    fence: Fence,
    pub payload: Value,
    pub steps: HashMap<String, Value>,
    /// The run's journal: position -> (kind, step key).
    pub journal: BTreeMap<u32, JournalEntry>,
    /// The run and step that invoked it (a child run): its output is bound to them.
    pub parent: Option<(Uuid, String)>,
    pub db_now: DateTime<Utc>,
    /// Where it stood in the due queue when claimed.
    pub place: QueuePlace,
    /// The claim record (`run_claims`) that lists this attempt, for the
    /// worker to delete once every attempt in it has ended: the claim's, or
    /// the handing send's (migration 0035). Every statement that starts
    /// attempts writes one, so a claimed run always has it.
    pub claim: i64,
}

/// Where a run stands in the due queue: claims take runs by priority (highest
/// first), then by due time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct QueuePlace {
    pub priority: i32,
    pub run_at: DateTime<Utc>,
}

impl QueuePlace {
    /// Whether a claim takes a run at this place before one at `other`.
    pub(crate) fn before(&self, other: &QueuePlace) -> bool {
        (std::cmp::Reverse(self.priority), self.run_at) < (std::cmp::Reverse(other.priority), other.run_at)
    }
}

impl ClaimedRun {
    /// The fence of this attempt: what every write made for it takes.
    pub(crate) fn fence(&self) -> Fence {
        self.fence
    }
}

/// What a worker has handlers for: its function ids, and every (function,
/// version) pair it registers (`version_ids[i]` at `versions[i]`).
#[derive(Clone)]
pub(crate) struct Handled {
    pub ids: Vec<String>,
    pub version_ids: Vec<String>,
    pub versions: Vec<i32>,
}

/// Claims up to `limit` due runs of the given functions, in priority then due
/// order, skipping rows other workers hold; bumps each run's lease epoch and
/// returns its input and every stored step result (one round trip in all).
/// Only runs of a (function, version) pair in `functions` are candidates: a
/// run started under a version this worker has no handler for is left to a
/// worker that has one.
///
/// Flow control happens in the same statement. Each candidate's keys are read
/// from its event data (`function_flow`), and the rows of those keys in
/// `flow_keys` are locked `FOR UPDATE SKIP LOCKED`: a candidate with a key row
/// another claimer (or a releasing statement) holds is left alone, due, for the
/// next claim. On the locked rows (the latest versions) each candidate is ranked
/// per key, and is started only if every rule admits its rank (concurrency:
/// `in_use + rank <= limit`; throttle and rate limit: GCRA; back-pressure: no
/// pause); the key rows are updated in the same statement. A candidate refused
/// by a concurrency, throttle or back-pressure rule is parked (`queued`, `run_at`
/// = its next possible start, `park_rule`/`park_key` = what it waits for); one
/// refused only by a rate limit is `skipped`. Concurrency keys left with free
/// slots wake their parked runs. Returns the claimed runs and how many other runs
/// it parked, skipped or woke (the caller claims again at once when that is > 0).
pub(crate) async fn claim_runnable(
    conn: &mut PgConnection,
    functions: &Handled,
    limit: i64,
    lease: Duration,
    worker_id: Uuid,
    queue: Queue,
) -> Result<(Vec<ClaimedRun>, i64), sqlx::Error> {
    let rows = sqlx::query(queue.statement(FULL, &FULL_WALK))
        .bind(&functions.ids)
        .bind(limit)
        .bind(secs(lease))
        .bind(worker_id)
        .bind(secs(crate::flow::PARK_RECHECK))
        .bind(&functions.version_ids)
        .bind(&functions.versions)
        .fetch_all(conn)
        .await?;
    claimed_runs(rows, Records::Stored)
}

/// The fast claim ([`claim_runnable`] without flow control), for functions
/// with no claim-time flow rule: one small statement with a generic plan
/// (`store/sql/claim_fast.sql`). Runs of a function that has flow rows in the
/// database, and runs past a start or finish deadline, are left alone (for
/// the full claim and for maintenance). Returns the claimed runs; it never
/// parks, skips or wakes runs, so the count of those is always 0.
pub(crate) async fn claim_fast(
    conn: &mut PgConnection,
    functions: &Handled,
    limit: i64,
    lease: Duration,
    worker_id: Uuid,
    queue: Queue,
) -> Result<(Vec<ClaimedRun>, i64), sqlx::Error> {
    let rows = sqlx::query(queue.statement(FAST, &FAST_WALK))
        .bind(&functions.ids)
        .bind(limit)
        .bind(secs(lease))
        .bind(worker_id)
        .bind(&functions.version_ids)
        .bind(&functions.versions)
        .fetch_all(conn)
        .await?;
    claimed_runs(rows, Records::Stored)
}

/// What a worker expects to find when it claims: which statement it sends.
/// Either claims the same runs; only the reads differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Queue {
    /// The last claim of this class came back full: more runs are likely due
    /// than this one takes, so it walks `runs_due` in priority order at once
    /// (the walk stops once it has its runs): the claim's text without its
    /// due read ([`walk_only`]).
    Backlog,
    /// Fewer runs were due than the last claim asked for (or this is the
    /// first): it reads the due runs in due order first and takes the best of
    /// them when they all fit, instead of a walk that would read the entry of
    /// every sleeping and waiting run; it walks only when more are due. The
    /// claim's whole text.
    Few,
}

impl Queue {
    /// The claim to send: `whole` after a short claim, `walk` after a full one.
    fn statement(self, whole: &'static str, walk: &'static LazyLock<String>) -> &'static str {
        match self {
            Queue::Few => whole,
            Queue::Backlog => walk.as_str(),
        }
    }
}

/// The full claim, whole.
const FULL: &str = concat!(include_str!("sql/claim.sql"), include_str!("sql/run_records.sql"));
/// The fast claim, whole.
const FAST: &str = concat!(include_str!("sql/claim_fast.sql"), include_str!("sql/run_records.sql"));
/// The full claim sent when a backlog is expected.
static FULL_WALK: LazyLock<String> = LazyLock::new(|| walk_only(FULL));
/// The fast claim sent when a backlog is expected.
static FAST_WALK: LazyLock<String> = LazyLock::new(|| walk_only(FAST));

/// What marks a line of a claim's text that only the claim after a short one
/// has (its due read, and what chooses between it and the walk).
const FEW_ONLY: &str = "-- few";

/// A claim's text without its due read: every line that ends with
/// [`FEW_ONLY`] left out (the walk of `runs_due` alone, as every claim was
/// before 2026-12-04).
fn walk_only(whole: &str) -> String {
    whole.lines().filter(|l| !l.trim_end().ends_with(FEW_ONLY)).flat_map(|l| [l, "\n"]).collect()
}

/// What the rows of a claim carry of their runs' steps and journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Records {
    /// The arrays of `run_records.sql` (the claims).
    Stored,
    /// Runs the statement itself created (the send that hands its runs to a
    /// worker, `durastep.send_event_to_worker`): nothing is stored for them
    /// yet, and the function returns constant empty arrays in the columns
    /// before migration 0029's, which are not read.
    New,
}

/// The rows of a claim statement as claimed runs, and its count of moved runs
/// (a row with a null `id` carries only that count).
pub(super) fn claimed_runs(
    rows: Vec<sqlx::postgres::PgRow>,
    records: Records,
) -> Result<(Vec<ClaimedRun>, i64), sqlx::Error> {
    let mut moved = 0;
    let mut claimed = Vec::with_capacity(rows.len());
    for row in rows {
        moved = row.try_get("moved")?;
        let Some(id) = row.try_get::<Option<Uuid>, _>("id")? else {
            continue;
        };
        let (steps, journal) = match records {
            Records::Stored => records_of(&row)?,
            Records::New => Default::default(),
        };
        // The statement's claim record (NULL only in the row of a statement
        // that started nothing, which has no run).
        let claim = row.try_get("claim")?;
        claimed.push(ClaimedRun {
            id,
            function_id: row.try_get("function_id")?,
            version: row.try_get("version")?,
            event_id: row.try_get("event_id")?,
            attempt: row.try_get("attempt")?,
            fence: Fence { run_id: id, epoch: row.try_get("lease_epoch")? },
            payload: row.try_get("payload")?,
            steps,
            journal,
            parent: row
                .try_get::<Option<Uuid>, _>("parent_run_id")?
                .zip(row.try_get::<Option<String>, _>("parent_step_key")?),
            db_now: row.try_get("db_now")?,
            place: QueuePlace { priority: row.try_get("priority")?, run_at: row.try_get("run_at")? },
            claim,
        });
    }
    Ok((claimed, moved))
}

/// How long until the earliest due run of these functions' handled versions
/// (None: nothing scheduled).
pub(crate) async fn next_due_in(pool: &PgPool, functions: &Handled) -> Result<Option<Duration>, sqlx::Error> {
    let secs: Option<f64> = sqlx::query_scalar(
        "SELECT extract(epoch FROM min(run_at) - durastep.now())::float8 FROM durastep.runs
          WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at < 'infinity' AND function_id = ANY ($1)
            AND (function_id, version) IN (SELECT * FROM unnest($2::text[], $3::int[]))",
    )
    .bind(&functions.ids)
    .bind(&functions.version_ids)
    .bind(&functions.versions)
    .fetch_one(pool)
    .await?;
    Ok(secs.map(|s| Duration::from_secs_f64(s.max(0.0))))
}

/// How many runs of each of these functions are due now and not running (the
/// queue-depth gauge). Functions with none are absent.
pub(crate) async fn count_due_runs(pool: &PgPool, functions: &[String]) -> Result<Vec<(String, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT function_id, count(*) FROM durastep.runs
          WHERE state IN ('queued', 'sleeping', 'waiting') AND run_at <= durastep.now() AND function_id = ANY ($1)
          GROUP BY function_id",
    )
    .bind(functions)
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::{FAST, FEW_ONLY, FULL, QueuePlace, walk_only};
    use chrono::{TimeZone, Utc};

    /// The conditions of the scan whose `WHERE` is the first after the line
    /// that holds `from`, up to its `ORDER BY` (trimmed, comments and the
    /// `-- few` marks left out).
    fn conditions(sql: &str, from: &str) -> Vec<String> {
        sql.lines()
            .skip_while(|l| !l.contains(from))
            .map(|l| l.trim_end().trim_end_matches(FEW_ONLY).trim())
            .skip_while(|l| !l.starts_with("WHERE "))
            .take_while(|l| !l.starts_with("ORDER BY"))
            .filter(|l| !l.starts_with("--"))
            .map(|l| l.trim_start_matches("WHERE ").trim_start_matches("AND ").to_owned())
            .collect()
    }

    /// Catches: the due read of a claim admitting runs its walk does not, or
    /// the other way round (a run would be claimed or left depending on which
    /// way the claim took): the two lists of conditions are written twice in
    /// each claim, and must stay the same.
    #[test]
    fn a_claims_due_read_and_walk_have_the_same_conditions() {
        for (whole, walk_from) in [(FAST, "SELECT c.id FROM durastep.runs c"), (FULL, "cand AS MATERIALIZED")] {
            let due = conditions(whole, "due AS MATERIALIZED");
            let walk = conditions(&walk_only(whole), walk_from);
            assert!(due.len() >= 3, "the due read's conditions were not found: {due:?}");
            assert_eq!(due, walk, "the due read's and the walk's conditions differ");
        }
    }

    /// Catches: a claim sent when a backlog is expected that still reads the
    /// due runs (or keeps a part of the choice between the two ways, which
    /// would not parse), and a mark that left out a line the walk needs.
    #[test]
    fn the_claim_after_a_full_one_is_the_walk_alone() {
        for whole in [FAST, FULL] {
            let walk = walk_only(whole);
            assert!(whole.contains("FROM due"), "the whole claim reads the due runs");
            for gone in ["FROM due", "due AS", "UNION ALL"] {
                assert!(!walk.contains(gone), "{gone:?} is in the walk alone");
            }
            assert_eq!(walk.matches('(').count(), walk.matches(')').count(), "parentheses");
            assert!(walk.contains("ORDER BY") && walk.contains("SKIP LOCKED"));
        }
    }

    #[test]
    fn queue_places_go_by_priority_then_due_time() {
        let at = |s| Utc.timestamp_opt(s, 0).unwrap();
        let urgent_late = QueuePlace { priority: 5, run_at: at(20) };
        let early = QueuePlace { priority: 0, run_at: at(10) };
        let late = QueuePlace { priority: 0, run_at: at(20) };
        assert!(urgent_late.before(&early));
        assert!(early.before(&late));
        assert!(!late.before(&early));
        assert!(!early.before(&early), "a place is not before itself");
        assert!(!early.before(&urgent_late));
    }
}

/// What a send tells the worker it handed runs to, on the worker's channel
/// (`durastep.send_events_offered`): the claim record, the database's clock
/// at the send, the event, its payload (left out, `cut`, when the
/// notification would pass Postgres' limit), and each run.
#[derive(Debug, Deserialize)]
pub(crate) struct HandNotice {
    claim: i64,
    now: DateTime<Utc>,
    event: Uuid,
    #[serde(default)]
    payload: Value,
    #[serde(default)]
    cut: bool,
    runs: Vec<NoticeRun>,
}

#[derive(Debug, Deserialize)]
struct NoticeRun {
    id: Uuid,
    epoch: i64,
    function: String,
    version: i32,
    attempt: i32,
    priority: i32,
    run_at: DateTime<Utc>,
}

impl HandNotice {
    /// A notice as the send wrote it; None for anything else (anyone may NOTIFY).
    pub(crate) fn parse(text: &str) -> Option<HandNotice> {
        serde_json::from_str::<HandNotice>(text).ok().filter(|n| !n.runs.is_empty())
    }

    /// How many runs it names.
    pub(crate) fn len(&self) -> usize {
        self.runs.len()
    }

    /// The claim record that lists its runs.
    pub(crate) fn claim(&self) -> i64 {
        self.claim
    }
}

/// A claim record of runs a send handed to this worker through its offer
/// (`run_claims.offered_to`, migration 0037), found after the listener
/// connected again: its runs are read back, as those of a cut notice are.
#[derive(Debug)]
pub(crate) struct HandedRecord {
    pub claim: i64,
    pub(super) ids: Vec<Uuid>,
    pub(super) epochs: Vec<i64>,
}

/// A run a send of any process claimed for this worker, with how much of its
/// lease was left when the worker read it (None: not read; it was claimed
/// when its notice was sent).
pub(crate) struct HandedRun {
    pub run: ClaimedRun,
    pub lease_left: Option<Duration>,
}

/// The runs a send handed to `worker_id`: from its notice when that is
/// whole; else read, those still running under that epoch for this worker,
/// with their input as a claim returns it (a new run has no stored steps;
/// the arrays are read all the same).
pub(crate) async fn handed_runs(
    pool: &PgPool,
    worker_id: Uuid,
    notice: HandNotice,
) -> Result<Vec<HandedRun>, sqlx::Error> {
    if !notice.cut {
        let HandNotice { claim, now, event, payload, runs, .. } = notice;
        return Ok(runs
            .into_iter()
            .map(|r| HandedRun {
                run: ClaimedRun {
                    id: r.id,
                    function_id: r.function,
                    version: r.version,
                    event_id: event,
                    attempt: r.attempt,
                    fence: Fence { run_id: r.id, epoch: r.epoch },
                    payload: payload.clone(),
                    steps: HashMap::new(),
                    journal: BTreeMap::new(),
                    parent: None,
                    db_now: now,
                    place: QueuePlace { priority: r.priority, run_at: r.run_at },
                    claim,
                },
                lease_left: None,
            })
            .collect());
    }
    let (ids, epochs) = notice.runs.iter().map(|r| (r.id, r.epoch)).unzip();
    read_handed(pool, worker_id, &HandedRecord { claim: notice.claim, ids, epochs }).await
}

/// The runs of `record` still running under their epochs for `worker_id`,
/// read back with their input as a claim returns it.
pub(crate) async fn read_handed(
    pool: &PgPool,
    worker_id: Uuid,
    record: &HandedRecord,
) -> Result<Vec<HandedRun>, sqlx::Error> {
    let rows = sqlx::query(HANDED)
        .bind(&record.ids)
        .bind(&record.epochs)
        .bind(worker_id)
        .bind(record.claim)
        .fetch_all(pool)
        .await?;
    let lease_left: Vec<f64> = rows.iter().map(|r| r.try_get("lease_left")).collect::<Result<_, _>>()?;
    let (runs, _) = claimed_runs(rows, Records::Stored)?;
    Ok(runs
        .into_iter()
        .zip(lease_left)
        .map(|(run, left)| HandedRun { run, lease_left: Some(Duration::from_secs_f64(left.clamp(0.0, 1e9))) })
        .collect())
}

/// The handed runs read back: the columns of a claim's answer, and the
/// lease left (`run_records.sql` appends the stored steps and journal).
const HANDED: &str = concat!(
    "SELECT c.id, c.function_id, c.version, c.event_id, c.attempt, c.lease_epoch,
            (SELECT e.payload FROM durastep.events e WHERE e.id = c.event_id) AS payload,
            c.parent_run_id, c.parent_step_key, durastep.now() AS db_now, c.priority, c.run_at,
            st.step_keys, st.step_outputs, st.step_positions, st.step_kinds,
            jr.journal_positions, jr.journal_kinds, jr.journal_keys,
            $4::bigint AS claim, 0::bigint AS moved,
            extract(epoch FROM c.lease_expires_at - durastep.now())::float8 AS lease_left
       FROM (SELECT r.* FROM durastep.runs r
               JOIN unnest($1::uuid[], $2::bigint[]) AS h(id, epoch) ON h.id = r.id AND h.epoch = r.lease_epoch
              WHERE r.state = 'running' AND r.worker_id = $3) c
",
    include_str!("sql/run_records.sql")
);
