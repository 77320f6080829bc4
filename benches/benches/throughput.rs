//! Throughput: raw Postgres baselines, then the engine on the same server in the
//! same run, as ratios.
//!
//! `cargo bench -p durastep-benches --bench throughput`
//!
//! 1. Raw baselines with plain sqlx: single-row INSERT commits/s from 16
//!    connections; multi-row (group-commit) INSERT rows/s at 16 and 256 rows per
//!    commit; SKIP LOCKED claim rows/s at 32 per round trip and one at a time.
//! 2. 10,000 runs of 10 no-op steps with 16 and 256 runs in flight in total,
//!    in 1 and in 4 worker processes (`bench-worker`), all enqueued first.
//! 3. 20,000 no-op single-step runs enqueued, then drained by 1, 2, 4 and 8
//!    worker processes; then by 1 process again with the run history off and
//!    on, three times each, for what the history costs.
//!
//! Besides its tables it prints one `RESULT metric=... value=... ratio=...`
//! line per figure: `steps_16_inflight` and `steps_256_inflight` (1 process;
//! ratios to single-row and 256-row group commits), `drain_runs_per_s` (1
//! process; ratio to the raw claim of 32 rows per round trip), `scale_4_procs`
//! (4-process drain / 1-process drain) and `history_cost` (drain with history /
//! without).
//!
//! Knobs (environment): `BENCH_MATRIX` (the cells of section 2 as
//! `<runs in flight>x<processes>`, comma-separated, as `256x1,16x4`; default
//! all four), `BENCH_MATRIX_RUNS` (runs per cell of section 2, default
//! 10,000), `BENCH_ROUNDS` (rounds of section 2, default 1: with more, the
//! cells alternate round by round, each round after the first measures its
//! two raw bases again, and the table and `RESULT` lines give the medians of
//! the values and of each round's ratio to its own base; this machine's
//! noise between rounds reaches 20-30%), `BENCH_WRITERS` (group-commit
//! writer tasks per worker, default the engine's), `BENCH_POOL` (pool per worker process, default 10
//! up to 4 processes and 6 at 8), `BENCH_DRAIN_RUNS` (runs of each drain of
//! section 3, default 20,000), `BENCH_CLAIM_BATCH`, `BENCH_CLAIM_AHEAD`,
//! `BENCH_ONLY` (`raw`, `matrix` or `drain`; `fk` runs only the cost of the
//! step tables' foreign keys, with and without them; `indexes` that of the
//! two dashboard-only indexes of `runs`; `warm` drains of 1 and 4 processes,
//! each both cold, as in section 3, and with workers that first drained
//! `BENCH_WARM_RUNS` runs (default 10,000), three alternated rounds),
//! `BENCH_STATEMENTS=on` (after each drain, what each statement cost per
//! 1,000 runs, from `pg_stat_statements`, which the server must preload: see
//! `Statements`), `BENCH_HISTORY=off` (the whole bench with the run history
//! off: see `set_history`; never do this in production), `BENCH_MIXED=on`
//! (every worker process also registers a function with a flow rule, none of
//! whose runs is due: each claim round then sends the full claim beside the
//! fast one), `BENCH_DROP_INDEXES` (indexes of the `durastep` schema to
//! drop before anything runs, comma-separated: a probe of what an index costs
//! the write path; the engine's readers that need one then scan instead).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use durastep::{Engine, Event};
use durastep_benches::db::{BenchDb, wait_until_drained};
use durastep_benches::functions::{self, NOOP1, NOOP10};
use durastep_benches::knobs::whole_number;
use durastep_benches::process::{WorkerConfig, WorkerProcess};
use durastep_benches::raw;
use durastep_benches::report::{Table, machine_busy_cpu, median, process_cpu, ratio, result, thousands, verdict};
use sqlx::PgPool;

const WORKER: &str = env!("CARGO_BIN_EXE_bench-worker");
/// Writer connections for the raw group-commit baseline: the engine's default
/// number of group-commit writer tasks in one worker.
const GROUP_TASKS: usize = 2;

/// The whole-number knobs, checked before anything runs.
const KNOBS: [&str; 8] = [
    "BENCH_MATRIX_RUNS",
    "BENCH_ROUNDS",
    "BENCH_DRAIN_RUNS",
    "BENCH_WARM_RUNS",
    "BENCH_WRITERS",
    "BENCH_POOL",
    "BENCH_CLAIM_BATCH",
    "BENCH_CLAIM_AHEAD",
];

/// The matrix's cells, `(runs in flight, processes)`: `BENCH_MATRIX` as
/// `256x1,16x4`, by default all four of 16 and 256 in flight in 1 and 4
/// processes.
fn matrix_cells() -> Vec<(usize, usize)> {
    let all = vec![(16, 1), (16, 4), (256, 1), (256, 4)];
    let Ok(spec) = std::env::var("BENCH_MATRIX") else { return all };
    spec.split(',')
        .map(|cell| {
            let parsed = cell.trim().split_once('x').and_then(|(f, p)| Some((f.parse().ok()?, p.parse().ok()?)));
            parsed.unwrap_or_else(|| panic!("BENCH_MATRIX: {cell:?} is not <in flight>x<processes>, as 256x1"))
        })
        .collect()
}

fn runs_section(name: &str) -> bool {
    std::env::var("BENCH_ONLY").map_or(true, |only| only == name)
}

struct Raw {
    single16: f64,
    group16: f64,
    group256: f64,
    claim32: f64,
    claim1: f64,
}

async fn raw_baselines(pool: &PgPool) -> Raw {
    raw::setup(pool).await;
    let window = Duration::from_secs(3);
    let single16 = raw::single_row_commits(pool, 16, window).await;
    let group16 = raw::group_commit(pool, GROUP_TASKS, 16, window).await;
    let group256 = raw::group_commit(pool, GROUP_TASKS, 256, window).await;
    let claim32 = raw::claim(pool, 1, 32, 30_000).await;
    let claim1 = raw::claim(pool, 1, 1, 5_000).await;
    sqlx::query("DROP SCHEMA raw CASCADE").execute(pool).await.expect("drop raw schema");
    let mut t =
        Table::new("Raw Postgres baselines (plain sqlx, same server and connection settings)", &["what", "rows/s"]);
    t.row(vec!["single-row INSERT, one commit per row, 16 connections".into(), thousands(single16)]);
    t.row(vec![format!("group-commit INSERT, 16 rows per commit, {GROUP_TASKS} connections"), thousands(group16)]);
    t.row(vec![format!("group-commit INSERT, 256 rows per commit, {GROUP_TASKS} connections"), thousands(group256)]);
    t.row(vec!["SKIP LOCKED claim, 32 rows per round trip, 1 connection".into(), thousands(claim32)]);
    t.row(vec!["SKIP LOCKED claim, 1 row per round trip, 1 connection".into(), thousands(claim1)]);
    t.print();
    Raw { single16, group16, group256, claim32, claim1 }
}

/// The two raw rates the matrix's cells are ratios to: single-row commits
/// (16 runs in flight) and 256-row group commits (256 in flight).
struct MatrixBases {
    single16: f64,
    group256: f64,
}

impl MatrixBases {
    fn of(raw: &Raw) -> MatrixBases {
        MatrixBases { single16: raw.single16, group256: raw.group256 }
    }

    /// Both measured again, for a later round of the matrix (`BENCH_ROUNDS`).
    async fn measure(pool: &PgPool) -> MatrixBases {
        raw::setup(pool).await;
        let window = Duration::from_secs(3);
        let single16 = raw::single_row_commits(pool, 16, window).await;
        let group256 = raw::group_commit(pool, GROUP_TASKS, 256, window).await;
        sqlx::query("DROP SCHEMA raw CASCADE").execute(pool).await.expect("drop raw schema");
        eprintln!("raw again: single-row commits {single16:.0}/s, group commit (256) {group256:.0} rows/s");
        MatrixBases { single16, group256 }
    }

    /// The rate a cell with `in_flight` runs in flight is a ratio to.
    fn for_in_flight(&self, in_flight: usize) -> f64 {
        if in_flight == 16 { self.single16 } else { self.group256 }
    }
}

/// The name of the raw rate a cell with `in_flight` runs in flight is a
/// ratio to, and the ratio its target asks for.
fn matrix_target(in_flight: usize) -> (&'static str, f64) {
    if in_flight == 16 { ("single-row commits", 0.8) } else { ("group commit (256)", 0.3) }
}

/// What one configuration measured.
struct Cell {
    enqueue: Duration,
    elapsed: Duration,
    /// The machine's busy CPU time over the drain (zero where unknown).
    cpu: Duration,
    /// The CPU time of the worker processes over the drain (zero where unknown).
    worker_cpu: Duration,
}

/// The CPU time the worker processes have used so far.
fn workers_cpu(workers: &[WorkerProcess]) -> Duration {
    workers.iter().filter_map(|w| process_cpu(w.pid())).sum()
}

/// With `BENCH_STATEMENTS=on`: what each statement cost in a drain, from
/// `pg_stat_statements` (the server must load it: `shared_preload_libraries
/// = 'pg_stat_statements'`, then a restart), per 1,000 runs. Its executor
/// time is wall time, so it grows with the backends that wait for a core;
/// buffer hits and WAL records are the work itself.
struct Statements;

impl Statements {
    /// Empties the statistics before a drain (None when not asked for, or
    /// when the server does not load the extension).
    async fn reset(pool: &PgPool) -> Option<Statements> {
        if !std::env::var("BENCH_STATEMENTS").is_ok_and(|v| v == "on") {
            return None;
        }
        // Backends report their counts to pg_stat_statements as each statement ends.
        let sql = "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset()";
        match sqlx::raw_sql(sql).execute(pool).await {
            Ok(_) => Some(Statements),
            Err(e) => {
                eprintln!("BENCH_STATEMENTS=on, but pg_stat_statements is not available: {e}");
                None
            }
        }
    }

    /// Prints the statements of this database that cost most, per 1,000 runs.
    async fn print(self, pool: &PgPool, title: &str, runs: usize) {
        let rows: Vec<(i64, i64, f64, i64, i64, i64, String)> = sqlx::query_as(
            "SELECT calls, rows, total_exec_time, shared_blks_hit, wal_records, wal_bytes::bigint,
                    regexp_replace(left(query, 90), '\\s+', ' ', 'g')
               FROM pg_stat_statements
              WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND query NOT LIKE '%pg_stat_statements%'
              ORDER BY total_exec_time DESC LIMIT 8",
        )
        .fetch_all(pool)
        .await
        .expect("read pg_stat_statements");
        let mut t = Table::new(
            &format!("Statements of {title}, per 1,000 runs"),
            &["calls", "rows", "executor ms", "buffer hits", "WAL records", "WAL bytes", "statement"],
        );
        let k = runs as f64 / 1_000.0;
        for (calls, n, ms, hits, wal, wal_bytes, query) in rows {
            t.row(vec![
                format!("{:.1}", calls as f64 / k),
                format!("{:.0}", n as f64 / k),
                format!("{:.1}", ms / k),
                format!("{:.0}", hits as f64 / k),
                format!("{:.0}", wal as f64 / k),
                format!("{:.0}", wal_bytes as f64 / k),
                format!("`{}`", query.replace('|', "/")),
            ]);
        }
        t.print();
    }
}

fn unix_now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).expect("clock after 1970").as_secs_f64()
}

/// The configuration of each of `procs` worker processes sharing `in_flight`.
fn worker_config(procs: usize, in_flight: usize) -> WorkerConfig {
    WorkerConfig {
        in_flight: in_flight / procs,
        writers: whole_number("BENCH_WRITERS").unwrap_or(WorkerConfig::default().writers),
        claim_batch: whole_number("BENCH_CLAIM_BATCH").unwrap_or(WorkerConfig::default().claim_batch),
        claim_ahead: whole_number("BENCH_CLAIM_AHEAD").unwrap_or(WorkerConfig::default().claim_ahead),
        // 8 processes of 10 + 3 control connections would pass the default max_connections of 100.
        pool: whole_number("BENCH_POOL").map_or((48 / procs).clamp(4, 10) as u32, |p| p as u32),
        listen: true,
        flow: std::env::var("BENCH_MIXED").is_ok_and(|v| v == "on"),
    }
}

/// Sends `runs` events named `event` in batches of 1,000, due at `due` (or now).
async fn enqueue(engine: &Engine, event: &str, runs: usize, due: Option<chrono::DateTime<chrono::Utc>>) {
    let mut chunk = Vec::with_capacity(1000);
    for i in 0..runs {
        let e = Event::new(event, &i);
        chunk.push(match due {
            Some(at) => e.start_at(at),
            None => e,
        });
        if chunk.len() == 1000 || i + 1 == runs {
            engine.send_batch(std::mem::take(&mut chunk)).await.expect("enqueue");
        }
    }
}

/// Empties the run tables and starts `procs` worker processes sharing
/// `in_flight`, connected but not yet told to go.
async fn fresh_workers(db: &BenchDb, engine: &Engine, procs: usize, in_flight: usize) -> Vec<WorkerProcess> {
    sqlx::query("TRUNCATE durastep.events, durastep.runs, durastep.step_results, durastep.step_journal CASCADE")
        .execute(engine.pool())
        .await
        .expect("reset");
    let config = worker_config(procs, in_flight);
    let mut workers = Vec::new();
    for _ in 0..procs {
        workers.push(WorkerProcess::spawn(WORKER, &db.url, &config).await);
    }
    workers
}

/// Where a measured drain started: its instant (Unix seconds, the clock the
/// bench and Postgres share), the machine's busy CPU and the workers' CPU then.
struct Start {
    t0: f64,
    cpu: Option<Duration>,
    worker_cpu: Duration,
}

impl Start {
    fn now(t0: f64, workers: &[WorkerProcess]) -> Start {
        Start { t0, cpu: machine_busy_cpu(), worker_cpu: workers_cpu(workers) }
    }
}

/// Waits until no run is left to do, then checks that `completed` runs
/// completed and stops the workers: the drain measured from `start` to the
/// last completion (by its `finished_at`), after an enqueue that took
/// `enqueue`.
async fn finish_drain(
    engine: &Engine,
    workers: Vec<WorkerProcess>,
    completed: usize,
    start: Start,
    enqueue: Duration,
) -> Cell {
    let pool = engine.pool();
    let done = wait_until_drained(pool, Duration::from_millis(100), Duration::from_secs(180)).await;
    assert!(done, "runs did not complete in time");
    let cpu = machine_busy_cpu().zip(start.cpu).map_or(Duration::ZERO, |(b, a)| b.saturating_sub(a));
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM durastep.runs WHERE state = 'completed'")
        .fetch_one(pool)
        .await
        .expect("count the completed runs");
    assert_eq!(n, completed as i64, "runs drained, but not all of them completed");
    let last: f64 = sqlx::query_scalar("SELECT extract(epoch FROM max(finished_at))::float8 FROM durastep.runs")
        .fetch_one(pool)
        .await
        .expect("last finish");
    let worker_cpu = workers_cpu(&workers).saturating_sub(start.worker_cpu);
    let stops = workers.into_iter().map(|w| tokio::spawn(w.stop()));
    for s in stops {
        s.await.expect("stop worker");
    }
    Cell { enqueue, elapsed: Duration::from_secs_f64((last - start.t0).max(1e-6)), cpu, worker_cpu }
}

/// Enqueues `runs` events (workers connected but idle), then starts the workers
/// and measures until the last run completes.
async fn run_cell(db: &BenchDb, engine: &Engine, event: &str, runs: usize, procs: usize, in_flight: usize) -> Cell {
    let pool = engine.pool();
    let mut workers = fresh_workers(db, engine, procs, in_flight).await;
    let started = Instant::now();
    enqueue(engine, event, runs, None).await;
    let enqueue = started.elapsed();
    sqlx::query("ANALYZE durastep.runs, durastep.events").execute(pool).await.expect("analyze");

    let statements = Statements::reset(pool).await;
    let start = Start::now(unix_now(), &workers);
    for w in &mut workers {
        w.go().await;
    }
    let cell = finish_drain(engine, workers, runs, start, enqueue).await;
    if let Some(st) = statements {
        st.print(pool, &format!("{runs} runs of {event}, {procs} process(es), {in_flight} in flight"), runs).await;
    }
    cell
}

/// As [`run_cell`], with workers that have worked before: they start (`go`)
/// with nothing due, drain `warm` runs first (so that every connection they
/// use has run the hot statements and loaded what it reads), then `runs`
/// runs are enqueued due at one instant a few seconds ahead, and the drain
/// is measured from that instant to the last completion. What a long-lived
/// worker process pays per run, without what a new process and new
/// connections pay once.
async fn run_cell_warm(
    db: &BenchDb,
    engine: &Engine,
    event: &str,
    runs: usize,
    procs: usize,
    in_flight: usize,
    warm: usize,
) -> Cell {
    let pool = engine.pool();
    let mut workers = fresh_workers(db, engine, procs, in_flight).await;
    for w in &mut workers {
        w.go().await;
    }
    enqueue(engine, event, warm, None).await;
    let warmed = wait_until_drained(pool, Duration::from_millis(100), Duration::from_secs(180)).await;
    assert!(warmed, "the warm-up runs did not complete in time");

    // Due at one instant, far enough ahead for the whole enqueue.
    let lead = Duration::from_secs_f64(2.0 + runs as f64 / 8_000.0);
    let due: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT durastep.now() + make_interval(secs => $1)")
        .bind(lead.as_secs_f64())
        .fetch_one(pool)
        .await
        .expect("due time");
    let started = Instant::now();
    enqueue(engine, event, runs, Some(due)).await;
    let enqueue = started.elapsed();
    assert!(enqueue < lead, "the enqueue ({enqueue:?}) took longer than its lead ({lead:?})");
    sqlx::query("ANALYZE durastep.runs, durastep.events").execute(pool).await.expect("analyze");
    let t0 = due.timestamp_micros() as f64 / 1e6;
    tokio::time::sleep(Duration::from_secs_f64((t0 - unix_now()).max(0.0))).await;
    let start = Start::now(t0, &workers);
    finish_drain(engine, workers, warm + runs, start, enqueue).await
}

/// Puts back (`on`) or drops the foreign keys of `step_results` and
/// `step_journal` on `runs` that migration 0016 removed: what they cost per
/// checkpoint, measured in the same run.
async fn set_step_fks(pool: &PgPool, on: bool) {
    let sql = if on {
        "ALTER TABLE durastep.step_results ADD CONSTRAINT bench_step_results_run_fk
             FOREIGN KEY (run_id) REFERENCES durastep.runs (id) ON DELETE CASCADE;
         ALTER TABLE durastep.step_journal ADD CONSTRAINT bench_step_journal_run_fk
             FOREIGN KEY (run_id) REFERENCES durastep.runs (id) ON DELETE CASCADE"
    } else {
        "ALTER TABLE durastep.step_results DROP CONSTRAINT IF EXISTS bench_step_results_run_fk;
         ALTER TABLE durastep.step_journal DROP CONSTRAINT IF EXISTS bench_step_journal_run_fk"
    };
    sqlx::raw_sql(sql).execute(pool).await.expect("switch the step foreign keys");
}

/// Puts back (`on`) or drops the two full indexes of `runs` with `state` in
/// their keys that migration 0018 removed (they served only the dashboard).
async fn set_dashboard_indexes(pool: &PgPool, on: bool) {
    let sql = if on {
        "CREATE INDEX IF NOT EXISTS runs_function_state ON durastep.runs (function_id, state, created_at);
         CREATE INDEX IF NOT EXISTS runs_state_created ON durastep.runs (state, created_at DESC, id DESC)"
    } else {
        "DROP INDEX IF EXISTS durastep.runs_function_state;
         DROP INDEX IF EXISTS durastep.runs_state_created"
    };
    sqlx::raw_sql(sql).execute(pool).await.expect("switch the dashboard indexes");
}

/// A piece of schema a migration removed, put back for a measurement.
#[derive(Clone, Copy)]
enum Removed {
    /// The foreign keys of `step_results` and `step_journal` (0016).
    StepFks,
    /// `runs_function_state` and `runs_state_created` (0018).
    DashboardIndexes,
}

impl Removed {
    async fn set(self, pool: &PgPool, on: bool) {
        match self {
            Removed::StepFks => set_step_fks(pool, on).await,
            Removed::DashboardIndexes => set_dashboard_indexes(pool, on).await,
        }
    }

    /// Its name in the table and the metric (`<metric>_cost_<n>_inflight`).
    fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Removed::StepFks => ("the step tables' foreign keys", "fk", "on (before 0016)"),
            Removed::DashboardIndexes => ("the dashboard-only indexes", "indexes", "on (before 0018)"),
        }
    }
}

/// The runs a [`removed_cost`] measurement drains: `runs` runs of `function`
/// (`steps` steps each), in one process, at each of `in_flights`.
struct Drain {
    function: &'static str,
    steps: usize,
    in_flights: &'static [usize],
    runs: usize,
}

/// Steps/s of `drain` with `removed` put back and without it, interleaved
/// twice per in-flight count; prints a table and
/// `RESULT metric=<name>_cost_<n>_inflight` (without / with).
async fn removed_cost(db: &BenchDb, engine: &Engine, pool: &PgPool, removed: Removed, drain: Drain) {
    let Drain { function, steps, in_flights, runs } = drain;
    let (what, metric, on_label) = removed.names();
    let mut t = Table::new(
        &format!("What {what} cost ({runs} runs of {steps} no-op step(s), 1 process)"),
        &["runs in flight", what, "steps/s (two passes)", "without / with"],
    );
    for &in_flight in in_flights {
        let mut with = Vec::new();
        let mut without = Vec::new();
        for _ in 0..2 {
            for on in [true, false] {
                removed.set(pool, on).await;
                let cell = run_cell(db, engine, function, runs, 1, in_flight).await;
                let steps_s = (runs * steps) as f64 / cell.elapsed.as_secs_f64();
                if on { with.push(steps_s) } else { without.push(steps_s) }
            }
        }
        removed.set(pool, false).await;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (w, wo) = (mean(&with), mean(&without));
        result(&format!("{metric}_cost_{in_flight}_inflight"), wo / w, Some(wo / w));
        for (label, v) in [(on_label, &with), ("off", &without)] {
            t.row(vec![
                in_flight.to_string(),
                label.into(),
                v.iter().map(|x| thousands(*x)).collect::<Vec<_>>().join(", "),
                ratio(wo, w),
            ]);
        }
    }
    t.print();
}

/// The machine's busy CPU per 1,000 runs of a drain, in ms.
fn cpu_ms_per_1k(cell: &Cell, runs: usize) -> f64 {
    cell.cpu.as_secs_f64() * 1e3 * 1_000.0 / runs as f64
}

/// The worker processes' CPU per 1,000 runs of a drain, in ms.
fn worker_ms_per_1k(cell: &Cell, runs: usize) -> f64 {
    cell.worker_cpu.as_secs_f64() * 1e3 * 1_000.0 / runs as f64
}

/// Turns the run history on or off (benches only: never in production).
/// "Off" sets the history table aside for an unlogged one without indexes,
/// so its rows cost only an unlogged heap append. Since migration 0045 a
/// drain's runs write no history row at all (the claims note the attempt's
/// start on the run, 0044; a completion is carried by its run and counted
/// in its minute's row of `completions_per_minute`, 0045), so "off" and "on"
/// differ only in the rows of runs that fail, sleep or wait; what the
/// history still costs a drain (the start's two columns on `runs`, the
/// minute's count in each completion statement) cannot be switched off, and
/// is counted instead (docs/performance.md "A completion kept on the run").
/// The trigger that records the other changes (`runs_changed`, migration
/// 0041, which also gives flow slots back and wakes parents) stays on: a
/// drain's claims and completions do not call it, and its condition is read
/// by every update either way.
async fn set_history(pool: &PgPool, on: bool) {
    let sql = if on {
        "DROP TABLE durastep.run_history;
         ALTER TABLE durastep.run_history_kept RENAME TO run_history;"
    } else {
        "ALTER TABLE durastep.run_history RENAME TO run_history_kept;
         CREATE UNLOGGED TABLE durastep.run_history (
             run_id uuid, at timestamptz, state text, attempt integer, lease_epoch bigint,
             worker_id uuid, error text, step text, started_at timestamptz,
             started_attempt integer, started_by uuid)"
    };
    sqlx::raw_sql(sql).execute(pool).await.expect("switch the run history");
}

#[tokio::main]
async fn main() {
    // A knob that does not parse stops the bench before it creates its database.
    for knob in KNOBS {
        whole_number(knob);
    }
    matrix_cells();
    let db = BenchDb::create("throughput").await;
    let pool = db.pool(20).await;
    println!("# Throughput (database {})", db.name);

    // Always measured: every engine figure is a ratio to these, from this run.
    let raw = raw_baselines(&pool).await;

    let mut builder = Engine::builder().pool(pool.clone());
    for f in functions::all() {
        builder = builder.function(f);
    }
    let engine = builder.build().await.expect("build engine");
    if let Ok(names) = std::env::var("BENCH_DROP_INDEXES") {
        for name in names.split(',').filter(|n| !n.is_empty()) {
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP INDEX durastep.{}", name.trim())))
                .execute(&pool)
                .await
                .expect("drop an index named by BENCH_DROP_INDEXES");
            println!("(index durastep.{name} dropped: BENCH_DROP_INDEXES)");
        }
    }
    let history_off = std::env::var("BENCH_HISTORY").is_ok_and(|v| v == "off");
    if history_off {
        set_history(&pool, false).await;
        println!("(run history off: BENCH_HISTORY=off)");
    }

    if runs_section("matrix") {
        let runs = whole_number("BENCH_MATRIX_RUNS").unwrap_or(10_000);
        let rounds = whole_number("BENCH_ROUNDS").unwrap_or(1).max(1);
        let cells = matrix_cells();
        // Per cell, each round's steps/s and the raw base it is a ratio to,
        // and its machine's and workers' CPU per step (us).
        let mut measured: Vec<Vec<(f64, f64)>> = vec![Vec::new(); cells.len()];
        let mut cpu: Vec<Vec<(f64, f64)>> = vec![Vec::new(); cells.len()];
        for round in 0..rounds {
            let bases = if round == 0 { MatrixBases::of(&raw) } else { MatrixBases::measure(&pool).await };
            for (i, &(in_flight, procs)) in cells.iter().enumerate() {
                let cell = run_cell(&db, &engine, NOOP10, runs, procs, in_flight).await;
                let steps_s = runs as f64 * 10.0 / cell.elapsed.as_secs_f64();
                measured[i].push((steps_s, bases.for_in_flight(in_flight)));
                let per_step = |d: Duration| d.as_secs_f64() * 1e6 / (runs as f64 * 10.0);
                cpu[i].push((per_step(cell.cpu), per_step(cell.worker_cpu)));
                eprintln!(
                    "matrix round {} in_flight={in_flight} procs={procs}: {:.2} s (enqueue {:.2} s)",
                    round + 1,
                    cell.elapsed.as_secs_f64(),
                    cell.enqueue.as_secs_f64()
                );
            }
        }
        let title = if rounds == 1 {
            format!("{} runs of 10 no-op steps (all enqueued first)", thousands(runs as f64))
        } else {
            format!(
                "{} runs of 10 no-op steps (all enqueued first), medians of {rounds} alternated rounds \
                 (each round's ratio to its own raw base)",
                thousands(runs as f64)
            )
        };
        let mut t = Table::new(
            &title,
            &[
                "runs in flight (total)",
                "processes",
                "runs/s",
                "steps/s",
                "vs raw",
                "target",
                "verdict",
                "CPU us per step (workers)",
            ],
        );
        for ((&(in_flight, procs), rounds_of_cell), cpu_of_cell) in cells.iter().zip(&measured).zip(&cpu) {
            let steps_s = median(rounds_of_cell.iter().map(|(v, _)| *v));
            let steps_ratio = median(rounds_of_cell.iter().map(|(v, base)| v / base));
            let base = median(rounds_of_cell.iter().map(|(_, base)| *base));
            let (base_name, factor) = matrix_target(in_flight);
            if procs == 1 {
                result(&format!("steps_{in_flight}_inflight"), steps_s, Some(steps_ratio));
            }
            let mut steps = thousands(steps_s);
            if rounds > 1 {
                let each: Vec<String> = rounds_of_cell.iter().map(|(v, _)| thousands(*v)).collect();
                steps = format!("{steps} ({})", each.join(" / "));
            }
            t.row(vec![
                in_flight.to_string(),
                procs.to_string(),
                thousands(steps_s / 10.0),
                steps,
                format!("{steps_ratio:.2}x of {base_name} {}", thousands(base)),
                format!(">= {factor}x ({})", thousands(base * factor)),
                verdict(steps_ratio >= factor),
                format!(
                    "{:.1} ({:.1})",
                    median(cpu_of_cell.iter().map(|(m, _)| *m)),
                    median(cpu_of_cell.iter().map(|(_, w)| *w))
                ),
            ]);
        }
        t.print();
    }

    // What a schema piece that a migration removed cost, measured in this run
    // with it put back and without it, interleaved twice (1 process).
    if std::env::var("BENCH_ONLY").is_ok_and(|o| o == "fk") {
        // The step tables' foreign keys (dropped by 0016): 10-step runs.
        let drain = Drain { function: NOOP10, steps: 10, in_flights: &[16, 256], runs: 5_000 };
        removed_cost(&db, &engine, &pool, Removed::StepFks, drain).await;
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|o| o == "indexes") {
        // The dashboard-only indexes (dropped by 0018): single-step runs,
        // where a claim and a completion are most of the work.
        let drain = Drain { function: NOOP1, steps: 1, in_flights: &[256], runs: 20_000 };
        removed_cost(&db, &engine, &pool, Removed::DashboardIndexes, drain).await;
    }

    if std::env::var("BENCH_ONLY").is_ok_and(|o| o == "warm") {
        let runs = whole_number("BENCH_DRAIN_RUNS").unwrap_or(20_000);
        let warm = whole_number("BENCH_WARM_RUNS").unwrap_or(10_000);
        let mut t = Table::new(
            &format!("{} no-op single-step runs, cold and warm workers", thousands(runs as f64)),
            &[
                "round",
                "processes",
                "cold runs/s",
                "cold CPU ms per 1,000 (workers)",
                "warm runs/s",
                "warm CPU ms per 1,000 (workers)",
            ],
        );
        for round in 1..=3 {
            for procs in [1, 4] {
                let cold = run_cell(&db, &engine, NOOP1, runs, procs, 256).await;
                let hot = run_cell_warm(&db, &engine, NOOP1, runs, procs, 256, warm).await;
                t.row(vec![
                    round.to_string(),
                    procs.to_string(),
                    thousands(runs as f64 / cold.elapsed.as_secs_f64()),
                    format!("{:.0} ({:.0})", cpu_ms_per_1k(&cold, runs), worker_ms_per_1k(&cold, runs)),
                    thousands(runs as f64 / hot.elapsed.as_secs_f64()),
                    format!("{:.0} ({:.0})", cpu_ms_per_1k(&hot, runs), worker_ms_per_1k(&hot, runs)),
                ]);
            }
        }
        t.print();
    }

    if runs_section("drain") {
        let runs = whole_number("BENCH_DRAIN_RUNS").unwrap_or(20_000);
        let mut t = Table::new(
            &format!("{} no-op single-step runs, enqueued then drained", thousands(runs as f64)),
            &[
                "runs in flight (total)",
                "processes",
                "enqueue events/s",
                "runs/s",
                "CPU ms per 1,000 runs (of it, worker processes)",
                "vs raw claim (32/trip)",
                "target",
                "verdict",
            ],
        );
        let mut by_procs = Vec::new();
        let mut cpu_one = 0.0;
        for procs in [1, 2, 4, 8] {
            let in_flight = 256;
            let cell = run_cell(&db, &engine, NOOP1, runs, procs, in_flight).await;
            let runs_s = runs as f64 / cell.elapsed.as_secs_f64();
            by_procs.push((procs, runs_s));
            let cpu_per_1k = cpu_ms_per_1k(&cell, runs);
            if procs == 1 {
                cpu_one = cpu_per_1k;
            }
            t.row(vec![
                in_flight.to_string(),
                procs.to_string(),
                thousands(runs as f64 / cell.enqueue.as_secs_f64()),
                thousands(runs_s),
                format!("{cpu_per_1k:.0} ({:.0})", worker_ms_per_1k(&cell, runs)),
                ratio(runs_s, raw.claim32),
                ">= 20,000 and >= 0.3x".into(),
                verdict(runs_s >= 20_000.0 && runs_s >= 0.3 * raw.claim32),
            ]);
        }
        t.print();
        let one = by_procs[0].1;
        result("drain_runs_per_s", one, Some(one / raw.claim32));
        result("drain_cpu_ms_per_1k_runs", cpu_one, None);
        let four = by_procs.iter().find(|(p, _)| *p == 4).map_or(0.0, |(_, r)| *r);
        result("scale_4_procs", four / one, Some(four / one));
        for (procs, runs_s) in &by_procs {
            eprintln!("drain procs={procs}: {runs_s:.0} runs/s ({:.2}x of 1 process)", runs_s / one);
        }

        // What the run history costs: the same 1-process drain with the history
        // off, alternating off and on (the first "on" is the drain above) so
        // that drift touches both alike; medians of three each.
        if !history_off {
            let (mut with, mut with_cpu) = (vec![one], vec![cpu_one]);
            let (mut without, mut without_cpu) = (vec![], vec![]);
            for round in 0..3 {
                set_history(&pool, false).await;
                let cell = run_cell(&db, &engine, NOOP1, runs, 1, 256).await;
                without.push(runs as f64 / cell.elapsed.as_secs_f64());
                without_cpu.push(cpu_ms_per_1k(&cell, runs));
                set_history(&pool, true).await;
                if round < 2 {
                    let cell = run_cell(&db, &engine, NOOP1, runs, 1, 256).await;
                    with.push(runs as f64 / cell.elapsed.as_secs_f64());
                    with_cpu.push(cpu_ms_per_1k(&cell, runs));
                }
            }
            eprintln!("history on: {with:.0?} runs/s, {with_cpu:.0?} CPU ms per 1,000 runs");
            eprintln!("history off: {without:.0?} runs/s, {without_cpu:.0?} CPU ms per 1,000 runs");
            let one = median(with);
            let without = median(without);
            let (cpu_with, cpu_without) = (median(with_cpu), median(without_cpu));
            let mut h = Table::new(
                "What the run history costs (1 process, 256 in flight, single-step runs; medians of 3)",
                &["history", "runs/s", "CPU ms per 1,000 runs", "with / without", "target", "verdict"],
            );
            h.row(vec![
                "on".into(),
                thousands(one),
                format!("{cpu_with:.0}"),
                ratio(one, without),
                ">= 0.97x".into(),
                verdict(one >= 0.97 * without),
            ]);
            h.row(vec!["off".into(), thousands(without), format!("{cpu_without:.0}"), "".into(), "".into(), "".into()]);
            h.print();
            result("history_cost", one / without, Some(one / without));
            // The same in CPU per run (without / with): steadier than runs/s on a shared host.
            result("history_cost_cpu", cpu_without / cpu_with, Some(cpu_without / cpu_with));
        }
    }
    let _ = (raw.group16, raw.claim1);

    pool.close().await;
    db.drop_database().await;
}
