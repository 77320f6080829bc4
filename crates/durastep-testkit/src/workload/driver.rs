//! Executes a [`Workload`] against a cluster, drains it, and checks the oracle.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use durastep::inspect::RunFilter;
use durastep::{Engine, Event, ReplayFrom, RunState};
use serde_json::{Value, json};
use tokio::time::Instant;
use uuid::Uuid;

use super::{Action, CANCEL_EVENT, Flavor, SIGNAL_EVENT, WlInput, Workload};
use crate::checks::workload as sql;
use crate::cluster::Cluster;
use crate::error::Result;
use crate::ledger::Ledger;
use crate::pg::{StopMode, TempPostgres};
use crate::process::WorkerConfig;
use crate::proxy::Proxy;

/// One broken promise the oracle found.
///
/// ```
/// let f = durastep_testkit::workload::Finding { check: "final-state", run_id: None, detail: "x".into() };
/// assert_eq!(f.to_string(), "[final-state] x");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// Which check: `final-state`, `output`, `unfinished`, `step-tx-once`,
    /// `lease-at-commit`, `limit-concurrency`, `limit-rate`, `limit-throttle`,
    /// `wait-event-lost`, `child-outcome`, `history`, `duplicate-receipt`,
    /// `debounce-after-start`, `operator-blocked`, `send-error`.
    pub check: &'static str,
    /// The run, when one is to blame.
    pub run_id: Option<Uuid>,
    /// What was seen.
    pub detail: String,
}

impl std::fmt::Display for Finding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.run_id {
            Some(id) => write!(f, "[{}] run {id}: {}", self.check, self.detail),
            None => write!(f, "[{}] {}", self.check, self.detail),
        }
    }
}

/// What a workload did and found.
///
/// ```
/// let o = durastep_testkit::workload::Outcome::default();
/// assert!(o.findings.is_empty());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// The oracle's findings (empty: every check held).
    pub findings: Vec<Finding>,
    /// Counters: runs per final state, actions applied, faults injected, checks made.
    pub stats: BTreeMap<String, i64>,
}

impl Outcome {
    /// Findings per check.
    ///
    /// ```
    /// assert!(durastep_testkit::workload::Outcome::default().per_check().is_empty());
    /// ```
    pub fn per_check(&self) -> BTreeMap<&'static str, usize> {
        let mut m = BTreeMap::new();
        for f in &self.findings {
            *m.entry(f.check).or_insert(0) += 1;
        }
        m
    }

    fn count(&mut self, what: impl Into<String>, n: i64) {
        *self.stats.entry(what.into()).or_insert(0) += n;
    }
}

/// How long one operator action may take before it counts as blocked.
const OPERATOR_TIMEOUT: Duration = Duration::from_secs(30);

enum FollowUp {
    Restart(usize),
    Resume(usize),
    ClearFailpoint(usize, String),
}

/// What the driver saw while it ran: the model's inputs besides the programs.
#[derive(Default)]
struct Seen {
    /// Tag → run ids of its first send.
    runs_of_tag: HashMap<u64, Vec<Uuid>>,
    /// Idempotency key → run ids of its first receipt.
    receipts: HashMap<String, Vec<Uuid>>,
    /// Runs the operator tried to cancel (an error may hide a cancel that landed).
    cancelled: HashSet<Uuid>,
    /// Runs replayed (or tried), and those replayed from the start.
    replayed: HashSet<Uuid>,
    replayed_from_start: HashMap<Uuid, i64>,
    /// (run, wait step, event) for signals sent while the wait was open.
    delivered: Vec<(Uuid, String, Uuid, String)>,
    /// Tokens signalled in the drain.
    drained: HashSet<String>,
    /// (pid, wall time): kills.
    kills: HashMap<u32, DateTime<Utc>>,
    /// (pid, wall time): pauses started (the pid's leases may lapse from then on).
    pauses: Vec<(u32, DateTime<Utc>)>,
    /// Wall times of clock moves big enough to lapse every lease.
    lapses: Vec<DateTime<Utc>>,
    /// Debounce sends whose run had started before the send.
    debounce_after_start: Vec<(Uuid, u64)>,
    /// (key, first receipt's runs, repeat's runs, the repeat was a duplicate).
    duplicate_mismatch: Vec<(String, Vec<Uuid>, Vec<Uuid>, bool)>,
    /// Operator actions that did not finish within [`OPERATOR_TIMEOUT`].
    blocked: Vec<String>,
    /// Sends of valid events that failed with a non-transient error.
    send_errors: Vec<String>,
}

/// Runs `workload` on `cluster`: spawns `workload.config.workers` workers with
/// `config` (forced to [`WorkerConfig::workload`], through `proxy` when given),
/// plays the timeline, drains (clears faults, signals every open wait, moves
/// the clock until nothing is left or `drain` has passed), and checks the
/// oracle. `pg` is the workload's own Postgres, for
/// [`Action::RestartPostgres`] (skipped without it).
///
/// ```no_run
/// # async fn demo(mut cluster: durastep_testkit::Cluster) -> durastep_testkit::Result<()> {
/// use durastep_testkit::workload::{self, Workload, WorkloadConfig};
/// let w = Workload::generate(durastep_testkit::tier::seed("demo"), &WorkloadConfig::ci());
/// let out = workload::run(&mut cluster, &w, durastep_testkit::WorkerConfig::default(), None, None,
///     std::time::Duration::from_secs(60)).await?;
/// for f in &out.findings { eprintln!("{f}"); }
/// # Ok(()) }
/// ```
pub async fn run(
    cluster: &mut Cluster,
    workload: &Workload,
    config: WorkerConfig,
    proxy: Option<&Proxy>,
    pg: Option<&TempPostgres>,
    drain: Duration,
) -> Result<Outcome> {
    let mut out = Outcome::default();
    let pool = cluster.pool().clone();
    sql::install_observer(&pool).await?;
    // The driver's own engine registers the workload functions (sends fan out to them).
    let ledger = Ledger::with_pool(pool.clone(), "driver");
    // For odd seeds it also runs a worker of its own, as an application that
    // sends from the process its worker runs in: a one-event send then hands
    // its run straight to that worker when it waits idle and nothing else is
    // due. Without one, such a send hands its run to an idle worker process
    // through its offer (`Workload::driver_worker`).
    let options = durastep::WorkerOptions {
        max_in_flight: config.max_in_flight,
        claim_batch: config.claim_batch,
        claim_ahead: config.claim_ahead,
        poll_interval: config.poll,
        lease: config.lease,
        heartbeat_interval: config.heartbeat,
        reap_interval: config.reap,
        shutdown_grace: config.shutdown_grace,
        listen: config.listen,
        ..durastep::WorkerOptions::default()
    };
    let mut builder = Engine::builder().pool(pool.clone()).migrate(false).worker_options(options);
    for f in super::functions(&ledger) {
        builder = builder.function(f);
    }
    let engine = builder.build().await?;
    let local_worker = workload.driver_worker.then(|| engine.spawn_worker());
    let mut config = config;
    config.workload = true;
    if let Some(p) = proxy {
        config.database_url = Some(p.url(0));
    }
    let workers = cluster.spawn_many(workload.config.workers, config.clone()).await?;
    let faults = workload.config.faults;
    let driver_failpoints = faults.failpoints;
    if driver_failpoints {
        // The operator's own writes lose acknowledgements too (this process's failpoints).
        durastep::failpoints::set("cancel-after-commit", "30%error");
        durastep::failpoints::set("replay-before-commit", "10%error");
    }

    let mut seen = Seen::default();
    let start = Instant::now();
    let mut pending: Vec<(Instant, FollowUp)> = Vec::new();
    let mut alive = vec![true; workers.len()];
    let mut paused = vec![false; workers.len()];
    for planned in &workload.timeline {
        let due = start + planned.at;
        loop {
            pending.sort_by_key(|(t, _)| *t);
            match pending.first() {
                Some((t, _)) if *t <= due => {
                    let (t, f) = pending.remove(0);
                    tokio::time::sleep_until(t).await;
                    follow_up(cluster, f, &mut alive, &mut paused).await?;
                }
                _ => break,
            }
        }
        tokio::time::sleep_until(due).await;
        // An operator call blocked behind a lock that a frozen or cut worker holds
        // must not stall the plan (nor the follow-ups that would free it).
        let applied = tokio::time::timeout(
            OPERATOR_TIMEOUT,
            apply(cluster, &engine, &pool, planned, &mut seen, &mut pending, &mut alive, &mut paused, proxy, pg),
        )
        .await;
        match applied {
            Ok(label) => out.count(format!("action:{}", label?), 1),
            Err(_) => seen.blocked.push(format!("{:?}", planned.action)),
        }
    }
    // Drain: faults off, every worker back, then signal waits and move the clock.
    if driver_failpoints {
        durastep::failpoints::set("cancel-after-commit", "off");
        durastep::failpoints::set("replay-before-commit", "off");
    }
    pending.sort_by_key(|(t, _)| *t);
    for (_, f) in pending.drain(..) {
        follow_up(cluster, f, &mut alive, &mut paused).await?;
    }
    if let Some(p) = proxy {
        p.cut_after_reply("", 0, 0);
    }
    for (i, &w) in workers.iter().enumerate() {
        if !cluster.worker(w).is_running()? {
            cluster.restart(w).await?;
            alive[i] = true;
        }
    }
    let drained_at = Instant::now();
    let mut rounds = 0;
    while drained_at.elapsed() < drain {
        rounds += 1;
        for (run_id, step, token, valid) in sql::open_waits(&pool, None).await? {
            if valid && seen.drained.insert(token.clone()) {
                signal(&engine, &pool, &token, &mut seen).await?;
                let _ = (run_id, step);
            }
        }
        cluster.advance_clock(Duration::from_secs(600)).await?;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let unfinished = sql::runs(&pool)
            .await?
            .iter()
            .filter(|r| !matches!(r.state.as_str(), "completed" | "failed" | "cancelled" | "skipped"))
            .count();
        if unfinished == 0 && rounds >= 3 {
            break;
        }
    }
    if let Some(w) = local_worker {
        w.stop().await?;
    }
    out.count("runs_handed_by_their_send", sql::runs_handed_by_their_send(&pool).await?);
    out.count("drain_rounds", rounds);
    out.count("drain_ms", i64::try_from(drained_at.elapsed().as_millis()).unwrap_or(i64::MAX));
    let lease = config.lease;
    oracle(&pool, &seen, lease, &mut out).await?;
    Ok(out)
}

async fn follow_up(cluster: &mut Cluster, f: FollowUp, alive: &mut [bool], paused: &mut [bool]) -> Result<()> {
    match f {
        FollowUp::Restart(i) => {
            cluster.restart(i).await?;
            alive[i] = true;
            paused[i] = false;
        }
        FollowUp::Resume(i) => {
            if paused[i] && cluster.worker(i).is_running()? {
                cluster.worker(i).resume().await?;
            }
            paused[i] = false;
        }
        FollowUp::ClearFailpoint(i, name) => {
            if alive[i] && !paused[i] && cluster.worker(i).is_running()? {
                cluster.worker(i).set_failpoint(&name, "off").await?;
            }
        }
    }
    Ok(())
}

async fn signal(engine: &Engine, pool: &sqlx::PgPool, token: &str, seen: &mut Seen) -> Result<()> {
    let open = sql::open_waits(pool, Some(token)).await?;
    let receipt = engine
        .send(Event::new(SIGNAL_EVENT, &json!({"token": token})).idempotency_key(Uuid::new_v4().to_string()))
        .await?;
    for (run_id, step, _, valid) in open {
        if valid {
            seen.delivered.push((run_id, step, receipt.event_id, token.to_owned()));
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn apply(
    cluster: &mut Cluster,
    engine: &Engine,
    pool: &sqlx::PgPool,
    planned: &super::Planned,
    seen: &mut Seen,
    pending: &mut Vec<(Instant, FollowUp)>,
    alive: &mut [bool],
    paused: &mut [bool],
    proxy: Option<&Proxy>,
    pg: Option<&TempPostgres>,
) -> Result<&'static str> {
    let now = Instant::now();
    let first = |seen: &Seen, tag: u64| seen.runs_of_tag.get(&tag).and_then(|r| r.first().copied());
    Ok(match &planned.action {
        Action::Send { flavor, input, idempotency_key } => {
            let before =
                if *flavor == Flavor::Debounce { Some(durastep::testing::db_now(engine).await?) } else { None };
            let mut event = Event::new(flavor.event(), input);
            if let Some(k) = idempotency_key {
                event = event.idempotency_key(k.clone());
            }
            let receipt = match engine.send(event).await {
                Ok(r) => r,
                // A restart of Postgres (or a cut) may fail a send: the model just does not have it.
                Err(e) if e.is_transient() => return Ok("send-failed"),
                // A valid event must be stored (or refused with a typed error, which
                // the generator never provokes): any other error is a finding.
                Err(e) => {
                    seen.send_errors.push(format!("{} (tag {}): {e}", flavor.id(), input.tag));
                    return Ok("send-error");
                }
            };
            if let Some(k) = idempotency_key {
                match seen.receipts.get(k) {
                    Some(first) if *first != receipt.run_ids => {
                        seen.duplicate_mismatch.push((
                            k.clone(),
                            first.clone(),
                            receipt.run_ids.clone(),
                            receipt.duplicate,
                        ));
                        // A new event (the first was pruned): later repeats answer with this one.
                        if !receipt.duplicate {
                            seen.receipts.insert(k.clone(), receipt.run_ids.clone());
                        }
                    }
                    Some(_) => {}
                    None => {
                        seen.receipts.insert(k.clone(), receipt.run_ids.clone());
                    }
                }
            }
            if let (Some(t0), false) = (before, receipt.duplicate) {
                for r in &receipt.run_ids {
                    // A margin for the claim that began before t0 but committed after the send.
                    if sql::started_before(pool, *r, t0 - chrono::Duration::milliseconds(300)).await? {
                        seen.debounce_after_start.push((*r, input.tag));
                    }
                }
            }
            seen.runs_of_tag.entry(input.tag).or_insert(receipt.run_ids);
            "send"
        }
        Action::Signal { token } => {
            signal(engine, pool, token, seen).await?;
            "signal"
        }
        Action::CancelKey { key } => {
            let _ = engine
                .send(Event::new(CANCEL_EVENT, &json!({"key": key})).idempotency_key(Uuid::new_v4().to_string()))
                .await;
            "cancel_key"
        }
        Action::Cancel { tag } => {
            let Some(id) = first(seen, *tag) else { return Ok("cancel-unknown") };
            seen.cancelled.insert(id);
            let _ = engine.cancel(id, "workload operator").await;
            "cancel"
        }
        Action::Replay { tag, from_start } => {
            let Some(id) = first(seen, *tag) else { return Ok("replay-unknown") };
            let from = if *from_start { ReplayFrom::Start } else { ReplayFrom::FailedStep };
            if engine.replay(id, from).await.is_ok() {
                seen.replayed.insert(id);
                if *from_start {
                    *seen.replayed_from_start.entry(id).or_insert(0) += 1;
                }
            }
            "replay"
        }
        Action::ReplayMany { flavor, from_start } => {
            let from = if *from_start { ReplayFrom::Start } else { ReplayFrom::FailedStep };
            let filter = RunFilter::new().function(flavor.id()).state(RunState::Failed).state(RunState::Cancelled);
            if let Ok(ids) = engine.replay_many(&filter, from).await {
                for id in ids {
                    seen.replayed.insert(id);
                    if *from_start {
                        *seen.replayed_from_start.entry(id).or_insert(0) += 1;
                    }
                }
            }
            "replay_many"
        }
        Action::Prune { older_than_secs } => {
            let _ = engine.prune(Duration::from_secs(*older_than_secs)).await;
            "prune"
        }
        Action::AdvanceClock { ms } => {
            // Before the move: a lease may lapse as soon as it commits.
            if *ms >= 500 {
                seen.lapses.push(Utc::now());
            }
            cluster.advance_clock(Duration::from_millis(*ms)).await?;
            "advance_clock"
        }
        Action::Kill { worker, restart_after_ms } => {
            let i = *worker % alive.len();
            if !alive[i] {
                return Ok("kill-skipped");
            }
            let pid = cluster.worker(i).pid();
            seen.kills.insert(pid, Utc::now());
            cluster.worker(i).kill().await?;
            alive[i] = false;
            pending.push((now + Duration::from_millis(*restart_after_ms), FollowUp::Restart(i)));
            "kill"
        }
        Action::Pause { worker, ms } => {
            let i = *worker % alive.len();
            if !alive[i] || paused[i] {
                return Ok("pause-skipped");
            }
            let pid = cluster.worker(i).pid();
            seen.pauses.push((pid, Utc::now()));
            cluster.worker(i).pause().await?;
            paused[i] = true;
            // The resume must not wait for the driver: the driver's next call may
            // block on a lock the frozen worker holds.
            let ms = *ms;
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let _ = tokio::process::Command::new("kill").args(["-s", "CONT", &pid.to_string()]).status().await;
            });
            pending.push((now + Duration::from_millis(ms), FollowUp::Resume(i)));
            "pause"
        }
        Action::Failpoint { worker, name, action, ms } => {
            let i = *worker % alive.len();
            if !alive[i] || paused[i] {
                return Ok("failpoint-skipped");
            }
            cluster.worker(i).set_failpoint(name, action).await?;
            if action.contains("exit") {
                // The worker may exit at the failpoint: restart it once it has.
                pending.push((now + Duration::from_millis(*ms), FollowUp::Restart(i)));
                alive[i] = false;
            } else {
                pending.push((now + Duration::from_millis(*ms), FollowUp::ClearFailpoint(i, name.clone())));
            }
            "failpoint"
        }
        Action::LostAcks { pattern, times } => {
            let Some(p) = proxy else { return Ok("lost_acks-skipped") };
            p.cut_after_reply(pattern, *times, 2);
            "lost_acks"
        }
        Action::RestartPostgres => {
            let Some(pg) = pg else { return Ok("restart_postgres-skipped") };
            // Leases may lapse while the server is down.
            seen.lapses.push(Utc::now());
            pg.restart(StopMode::Fast).await?;
            "restart_postgres"
        }
    })
}

const FINISHED: [&str; 4] = ["completed", "failed", "cancelled", "skipped"];

#[allow(clippy::too_many_lines)]
async fn oracle(pool: &sqlx::PgPool, seen: &Seen, lease: Duration, out: &mut Outcome) -> Result<()> {
    let mut findings = Vec::new();
    let mut find = |check: &'static str, run_id: Option<Uuid>, detail: String| {
        findings.push(super::Finding { check, run_id, detail });
    };
    let runs = sql::runs(pool).await?;
    let by_id: HashMap<Uuid, &sql::WlRun> = runs.iter().map(|r| (r.id, r)).collect();
    let steps = sql::step_results(pool).await?;
    let mut steps_of: HashMap<Uuid, HashMap<String, (Value, i64)>> = HashMap::new();
    for (run, key, output, epoch) in &steps {
        steps_of.entry(*run).or_default().insert(key.clone(), (output.clone(), *epoch));
    }
    out.count("runs", i64::try_from(runs.len()).unwrap_or(i64::MAX));

    // run-key: every run has its key, every key its run (migration 0042).
    for (run, detail) in sql::key_mismatches(pool).await? {
        find("run-key", Some(run), detail);
    }

    // final-state, output.
    for r in &runs {
        out.count(format!("state:{}", r.state), 1);
        let Some(flavor) = Flavor::from_id(&r.function_id) else { continue };
        if !FINISHED.contains(&r.state.as_str()) {
            continue;
        }
        if flavor == Flavor::Cron {
            if r.state != "completed" {
                find("final-state", Some(r.id), format!("cron run ended {} ({:?})", r.state, r.last_error));
            }
            continue;
        }
        let input: WlInput = match serde_json::from_value(r.payload.clone()) {
            Ok(i) => i,
            Err(e) => {
                find("final-state", Some(r.id), format!("input does not parse: {e}"));
                continue;
            }
        };
        let (mut may_complete, mut may_fail) = input.program_outcome(flavor.max_attempts());
        if seen.replayed.contains(&r.id) {
            (may_complete, may_fail) = (true, true);
        }
        let may_cancel = seen.cancelled.contains(&r.id)
            || matches!(flavor, Flavor::CancelOn | Flavor::SingletonCancel | Flavor::Timeouts | Flavor::Child);
        let may_skip = matches!(flavor, Flavor::Rate | Flavor::SingletonSkip);
        let ok = match r.state.as_str() {
            "completed" => may_complete,
            "failed" => may_fail,
            "cancelled" => may_cancel,
            "skipped" => may_skip,
            _ => true,
        };
        if !ok {
            find(
                "final-state",
                Some(r.id),
                format!(
                    "{} ended {} on attempt {} (model allows: complete {may_complete}, fail {may_fail}, cancel {may_cancel}, skip {may_skip}); last error: {:?}",
                    r.function_id, r.state, r.attempt, r.last_error
                ),
            );
        }
        if r.state == "completed" && r.output.as_ref() != Some(&input.expected_output()) {
            find("output", Some(r.id), format!("output {:?}, model {}", r.output, input.expected_output()));
        }
    }

    // unfinished: every unfinished run has a blocker naming a real cause.
    let blockers = sql::blockers(pool).await?;
    let blocked: HashMap<Uuid, _> = blockers.iter().map(|b| (b.0, b)).collect();
    let running = sql::running_per_key(pool).await?;
    for r in &runs {
        if FINISHED.contains(&r.state.as_str()) {
            continue;
        }
        out.count("unfinished", 1);
        match blocked.get(&r.id) {
            None => find(
                "unfinished",
                Some(r.id),
                format!(
                    "{} is {} after the drain with no blocker (last error {:?})",
                    r.function_id, r.state, r.last_error
                ),
            ),
            Some((_, state, blocker, rule, key, in_use, detail)) => {
                let real = match blocker.as_str() {
                    "ready" => false,
                    "wait_for_event" => true,
                    "invoke" => match detail.as_deref().and_then(|d| d.parse::<Uuid>().ok()) {
                        Some(child) => by_id.get(&child).is_none_or(|c| !FINISHED.contains(&c.state.as_str())),
                        None => false,
                    },
                    "concurrency" => {
                        // A real holder: a run of the key is running or holds the slot.
                        let holders: i64 =
                            running.iter().filter(|(_, k, _)| k.as_deref() == key.as_deref()).map(|(_, _, n)| *n).sum();
                        holders > 0
                    }
                    // Future due times: clamped delays and long timeouts are real causes.
                    _ => true,
                };
                if !real {
                    find(
                        "unfinished",
                        Some(r.id),
                        format!(
                            "{} is {state} after the drain, blocker {blocker} (rule {rule:?}, key {key:?}, in use {in_use:?}, detail {detail:?}) names no real cause",
                            r.function_id
                        ),
                    );
                }
            }
        }
    }

    // step-tx-once.
    let mut tx: HashMap<(Uuid, String), Vec<i64>> = HashMap::new();
    for (run, key, epoch) in sql::tx_rows(pool).await? {
        tx.entry((run, key)).or_default().push(epoch);
    }
    for ((run, key), epochs) in &tx {
        if !by_id.contains_key(run) {
            continue;
        }
        let bound = 1 + seen.replayed_from_start.get(run).copied().unwrap_or(0);
        if epochs.len() as i64 > bound {
            find("step-tx-once", Some(*run), format!("step_tx {key} committed {} rows (bound {bound})", epochs.len()));
        }
        if let Some((_, stored_epoch)) = steps_of.get(run).and_then(|s| s.get(key)) {
            let n = epochs.iter().filter(|e| *e == stored_epoch).count();
            if n != 1 {
                find(
                    "step-tx-once",
                    Some(*run),
                    format!("step_tx {key} stored by epoch {stored_epoch}: {n} rows of that epoch"),
                );
            }
        }
    }
    out.count("tx_rows", tx.values().map(|v| v.len() as i64).sum());

    // lease-at-commit.
    for (run, key, stored, run_epoch, state) in sql::commits_without_lease(pool).await? {
        find(
            "lease-at-commit",
            Some(run),
            format!("step {key} stored with epoch {stored} while the run had epoch {run_epoch:?}, state {state:?}"),
        );
    }
    out.count("observed_commits", sql::observed_commits(pool).await?);

    // limit-concurrency: interval sweep over body start and stop, cancelled bodies included.
    let lease = chrono::Duration::from_std(lease).unwrap_or_default();
    let mut reaped: HashMap<Uuid, Vec<(i64, DateTime<Utc>)>> = HashMap::new();
    for (run, epoch, at) in sql::reaps(pool).await? {
        reaped.entry(run).or_default().push((epoch, at));
    }
    // (start, end as judged, run, what the ledger says of it)
    type Span = (DateTime<Utc>, DateTime<Utc>, Uuid, String);
    let mut intervals: HashMap<(String, String), Vec<Span>> = HashMap::new();
    // The first write that ended each attempt and gave back its slots.
    let mut attempt_end: HashMap<(Uuid, i64), DateTime<Utc>> = HashMap::new();
    for (run, epoch, at) in sql::attempt_ends(pool).await? {
        attempt_end.entry((run, epoch)).or_insert(at);
    }
    for body in sql::bodies(pool).await? {
        let sql::Body {
            run_id: run,
            function_id: function,
            key,
            pid,
            lease_epoch,
            started_at: started,
            ended_at: ended,
        } = body;
        let Some((group, _)) = Flavor::from_id(&function).and_then(Flavor::concurrency) else { continue };
        let pid = u32::try_from(pid).unwrap_or(0);
        // A body whose end was never recorded (its process was killed before
        // the ledger's update): its attempt's own end write came after the
        // handler had stopped running user code, so it stopped by then.
        let written_end = lease_epoch.and_then(|e| attempt_end.get(&(run, e)).copied());
        let mut end = ended
            .or_else(|| written_end.into_iter().chain(seen.kills.get(&pid).copied()).min())
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        // A lease may lapse (the slot is then free by G22): the body's pause, a big clock move.
        for (p, at) in &seen.pauses {
            if *p == pid && *at >= started {
                end = end.min(*at + lease);
            }
        }
        for at in &seen.lapses {
            if *at >= started {
                end = end.min(*at);
            }
        }
        // Reaped: its lease had lapsed (a worker too starved to drop it in
        // time). The reap of this body's own attempt frees its slot even when
        // it came before the body started (a clock move lapsed the lease
        // between the claim and a late start): the body then held no slot.
        for (epoch, at) in reaped.get(&run).into_iter().flatten() {
            if *at >= started {
                end = end.min(*at);
            } else if lease_epoch == Some(*epoch) {
                end = end.min(started);
            }
        }
        if end <= started {
            // Held no slot while it ran.
            continue;
        }
        let seen_as = format!("{run} pid {pid} from {started} to {end} (recorded end {ended:?})");
        intervals.entry((group.to_owned(), key.unwrap_or_default())).or_default().push((started, end, run, seen_as));
    }
    let mut sweeps = 0;
    for ((group, key), list) in &intervals {
        let limit =
            Flavor::ALL.into_iter().find_map(|f| f.concurrency().filter(|(g, _)| g == group)).map_or(1, |c| c.1);
        let mut ev: Vec<(DateTime<Utc>, i32, Uuid)> = Vec::new();
        for (s, e, run, _) in list {
            ev.push((*s, 1, *run));
            ev.push((*e, -1, *run));
        }
        // An end sorts before a start at the same instant.
        ev.sort_by_key(|(t, d, _)| (*t, *d));
        let (mut n, mut max, mut at) = (0, 0, None);
        let mut open: Vec<Uuid> = Vec::new();
        let mut at_max: Vec<Uuid> = Vec::new();
        for (t, d, run) in &ev {
            n += d;
            if *d > 0 {
                open.push(*run);
            } else if let Some(i) = open.iter().position(|r| r == run) {
                open.swap_remove(i);
            }
            if n > max {
                max = n;
                at = Some(*t);
                at_max = open.clone();
            }
        }
        let who: Vec<String> = at_max
            .iter()
            .map(|r| {
                let state = by_id.get(r).map_or("pruned", |x| x.state.as_str());
                let op = if seen.cancelled.contains(r) { ", operator cancel" } else { "" };
                // The bodies of this run open at that moment, as the ledger has them.
                let spans: Vec<&str> = list
                    .iter()
                    .filter(|(s, e, run, _)| run == r && at.is_some_and(|t| *s <= t && t < *e))
                    .map(|x| x.3.as_str())
                    .collect();
                format!("{r} ({state}{op}; {})", spans.join("; "))
            })
            .collect();
        sweeps += 1;
        if max > i32::try_from(limit).unwrap_or(i32::MAX) {
            find(
                "limit-concurrency",
                None,
                format!("{group} key {key}: {max} bodies at once at {at:?} (limit {limit}): {}", who.join(", ")),
            );
        }
    }
    out.count("concurrency_keys_swept", sweeps);

    // limit-rate, limit-throttle: first claims in any window of the period (G23: claim times).
    let claims = sql::first_claims(pool).await?;
    for (flavor, check, limit, period) in [
        (Flavor::Rate, "limit-rate", super::RATE_LIMIT, super::RATE_PERIOD),
        (Flavor::Throttle, "limit-throttle", super::THROTTLE_LIMIT + super::THROTTLE_BURST, super::THROTTLE_PERIOD),
    ] {
        let period = chrono::Duration::from_std(period).unwrap_or_default();
        let mut per_key: HashMap<String, Vec<DateTime<Utc>>> = HashMap::new();
        for (_, function, key, at) in &claims {
            if function == flavor.id() {
                per_key.entry(key.clone().unwrap_or_default()).or_default().push(*at);
            }
        }
        for (key, mut times) in per_key {
            times.sort();
            let mut j = 0;
            for i in 0..times.len() {
                while times[i] - times[j] >= period {
                    j += 1;
                }
                let n = i - j + 1;
                if n > limit as usize {
                    find(
                        check,
                        None,
                        format!("{} key {key}: {n} first claims within {period} ending {}", flavor.id(), times[i]),
                    );
                    break;
                }
            }
        }
    }

    // wait-event-lost.
    for (run, step, event, token) in &seen.delivered {
        let Some(r) = by_id.get(run) else { continue };
        if seen.replayed_from_start.contains_key(run) || seen.cancelled.contains(run) || r.state == "cancelled" {
            continue;
        }
        match steps_of.get(run).and_then(|s| s.get(step)) {
            Some((v, _)) if v.get("event_id").and_then(Value::as_str).is_some() => {}
            Some((v, _)) => find(
                "wait-event-lost",
                Some(*run),
                format!("wait {step} (token {token}) stored {v} although event {event} committed while it was open"),
            ),
            None if !FINISHED.contains(&r.state.as_str()) => find(
                "wait-event-lost",
                Some(*run),
                format!(
                    "wait {step} (token {token}): event {event} committed while it was open; the run is still {}",
                    r.state
                ),
            ),
            // Finished without the wait's result: a failure or a replay discarded it.
            None => {}
        }
    }
    out.count("signals_checked", seen.delivered.len() as i64);

    // child-outcome.
    for (run, key, output, _) in &steps {
        if !key.starts_with('c') || !key[1..].chars().next().is_some_and(|c| c.is_ascii_digit()) {
            continue;
        }
        if let Some(child) = output.get("child_run_id").and_then(Value::as_str).and_then(|s| s.parse::<Uuid>().ok()) {
            let Some(c) = by_id.get(&child) else { continue };
            let timed_out = output.get("timed_out").and_then(Value::as_bool).unwrap_or(false);
            let state = output.get("state").and_then(Value::as_str);
            if timed_out && c.state != "cancelled" {
                find("child-outcome", Some(*run), format!("invoke {key} timed out but child {child} is {}", c.state));
            } else if !timed_out && state != Some(c.state.as_str()) {
                find(
                    "child-outcome",
                    Some(*run),
                    format!("invoke {key} recorded {state:?}, child {child} is {}", c.state),
                );
            }
        } else if output.get("timed_out").and_then(Value::as_bool) == Some(true) {
            // A timeout record without the child's id: the child of this step must be cancelled.
            if let Some(c) =
                runs.iter().find(|c| c.parent_run_id == Some(*run) && c.parent_step_key.as_deref() == Some(key))
                && c.state != "cancelled"
            {
                find("child-outcome", Some(*run), format!("invoke {key} timed out but child {} is {}", c.id, c.state));
            }
        }
    }
    for c in &runs {
        let (Some(parent), Some(key)) = (c.parent_run_id, c.parent_step_key.as_ref()) else { continue };
        let Some(p) = by_id.get(&parent) else { continue };
        if FINISHED.contains(&c.state.as_str())
            && p.state == "completed"
            && steps_of.get(&parent).and_then(|s| s.get(key)).is_none()
        {
            find("child-outcome", Some(parent), format!("completed without the outcome of child {} ({key})", c.id));
        }
    }

    // history agrees with state.
    for (run, state, epoch) in sql::last_history(pool).await? {
        let Some(r) = by_id.get(&run) else { continue };
        if state != r.state || epoch != r.lease_epoch {
            find(
                "history",
                Some(run),
                format!("history ends {state} (epoch {epoch}); the run is {} (epoch {})", r.state, r.lease_epoch),
            );
        }
    }

    // G6 holds while the first event is stored: a repeat that stored a new
    // event is right only if the first one's runs were pruned meanwhile.
    for (key, a, b, duplicate) in &seen.duplicate_mismatch {
        let first_kept = a.iter().any(|id| by_id.contains_key(id));
        if *duplicate || first_kept {
            find(
                "duplicate-receipt",
                None,
                format!(
                    "idempotency key {key}: first receipt {a:?}, repeat {b:?} (duplicate {duplicate}, first runs kept {first_kept})"
                ),
            );
        }
    }
    for e in &seen.send_errors {
        find("send-error", None, e.clone());
    }
    for action in &seen.blocked {
        find("operator-blocked", None, format!("{action} did not finish within {OPERATOR_TIMEOUT:?}"));
    }
    for (run, tag) in &seen.debounce_after_start {
        find(
            "debounce-after-start",
            Some(*run),
            format!("debounce event tag {tag} merged into a run that had started"),
        );
    }
    out.findings.append(&mut findings);
    Ok(())
}
