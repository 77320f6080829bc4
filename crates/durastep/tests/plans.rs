//! Plans: the claims keep one generic plan per connection instead of being
//! planned again on every execution (docs/performance.md "Plans kept, the ping before each statement").
//! Each claim statement runs on one connection, as the worker prepares it,
//! and claims runs from a backlog (in empty tables custom and generic plans
//! cost alike, which hides the fault);
//! Postgres then says how often it planned it for the values
//! (`pg_prepared_statements.custom_plans`).
mod common;

use durastep::{Ctx, Event, Function};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection};

const EXECUTIONS: i64 = 12;

/// The two claims as the worker sends them after a short claim (the due runs
/// read first; after a full one, the same text without its due read:
/// `both_ways`): name, text, and whether it is the full claim (which takes
/// one more parameter).
const CLAIMS: [(&str, &str, bool); 2] = [
    (
        "the full claim",
        concat!(include_str!("../src/store/sql/claim.sql"), include_str!("../src/store/sql/run_records.sql")),
        true,
    ),
    (
        "the fast claim",
        concat!(include_str!("../src/store/sql/claim_fast.sql"), include_str!("../src/store/sql/run_records.sql")),
        false,
    ),
];

/// Runs `sql` (a claim of 1 to 32 runs of `function`) `EXECUTIONS` times
/// on one connection and returns the number of custom and generic plans
/// Postgres made for it.
async fn plans_of(conn: &mut PgConnection, sql: &str, full: bool, function: &str) -> (i64, i64) {
    let worker = uuid::Uuid::new_v4();
    for i in 0..EXECUTIONS {
        // A worker asks for as many runs as it has room for: 1 to 32.
        let limit = 1 + (i * 7) % 32;
        let mut q = sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
            .bind(vec![function])
            .bind(limit)
            .bind(30.0f64)
            .bind(worker);
        if full {
            q = q.bind(1.0f64);
        }
        q.bind(vec![function]).bind(vec![0i32]).execute(&mut *conn).await.expect("claim");
    }
    sqlx::query_as(
        "SELECT custom_plans, generic_plans FROM pg_prepared_statements
          WHERE NOT from_sql AND statement = $1",
    )
    .bind(sql)
    .fetch_one(&mut *conn)
    .await
    .expect("the claim's prepared statement")
}

/// A claim statement as the worker sends it after a short claim (`sql`, the
/// due runs read first) and after a full one (the walk alone).
fn both_ways(sql: &str) -> [(&'static str, String); 2] {
    [("after a short claim", sql.to_owned()), ("after a full claim", common::walk_only(sql))]
}

/// Catches: a claim statement that reads its parameters directly, so that its
/// custom plans (which see the function with its backlog, the limit and the
/// lease where the generic plan assumes defaults) always look cheaper and
/// every claim is planned again: before 2026-12-03 the fast claim was
/// planned 12 times of 12 here, and so was the full claim
/// (1-1.5 ms per full claim). Postgres makes five custom plans before it
/// compares.
#[sqlx::test(migrations = false)]
async fn the_claims_keep_a_generic_plan(_p: PgPoolOptions, opts: PgConnectOptions) {
    let handler = |_ctx: Ctx, v: Value| async move { Ok(v) };
    let other = Function::new("other").on_event("seed").handler(handler);
    let claimed = Function::new("f").on_event("go").handler(handler);
    let engine = common::engine(&opts, vec![other, claimed]).await;
    // No autovacuum while the statements run: an automatic ANALYZE between
    // executions would plan them again for a reason that is not the fault.
    for table in ["runs", "events", "run_history"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE durastep.{table} SET (autovacuum_enabled = false)")))
            .execute(engine.pool())
            .await
            .expect("autovacuum off");
    }
    // A backlog: 4,000 runs of `f` (the busy case, where a custom plan of the
    // old fast claim looked cheapest) and 4,000 of another function.
    let seed: Vec<Event> =
        (0..4000).map(|i| Event::new("seed", &i)).chain((0..4000).map(|i| Event::new("go", &i))).collect();
    for chunk in seed.chunks(1000) {
        engine.send_batch(chunk.to_vec()).await.expect("seed runs");
    }
    let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
    sqlx::query("ANALYZE").execute(&mut conn).await.expect("analyze");
    for (name, sql, full) in CLAIMS {
        for (way, sql) in both_ways(sql) {
            let (custom, generic) = plans_of(&mut conn, &sql, full, "f").await;
            assert!(
                custom <= 5 && generic >= EXECUTIONS - 5,
                "{name} {way} was planned for its values {custom} times in {EXECUTIONS} executions ({generic} generic)"
            );
        }
    }
}

/// Catches: the full claim planned again on every execution when the
/// function it claims for has flow rules and a backlog over many keys (its
/// flow CTEs then read `flow_keys` and park runs, which the test above, a
/// function without rules, never does).
#[sqlx::test(migrations = false)]
async fn the_full_claim_keeps_a_generic_plan_under_flow_control(_p: PgPoolOptions, opts: PgConnectOptions) {
    let handler = |_ctx: Ctx, v: Value| async move { Ok(v) };
    let limited = Function::new("g")
        .on_event("go")
        .concurrency(durastep::Concurrency::new(2).key("/account"))
        .throttle(durastep::Throttle::new(50, std::time::Duration::from_secs(1)).key("/account"))
        .handler(handler);
    let engine = common::engine(&opts, vec![limited]).await;
    for table in ["runs", "events", "run_history", "flow_keys"] {
        sqlx::query(sqlx::AssertSqlSafe(format!("ALTER TABLE durastep.{table} SET (autovacuum_enabled = false)")))
            .execute(engine.pool())
            .await
            .expect("autovacuum off");
    }
    // 4,000 runs over 40 accounts: each claim admits two per account and
    // parks the rest of what it looked at.
    let seed: Vec<Event> = (0..4000).map(|i| Event::new("go", &serde_json::json!({"account": i % 40}))).collect();
    for chunk in seed.chunks(1000) {
        engine.send_batch(chunk.to_vec()).await.expect("seed runs");
    }
    let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
    sqlx::query("ANALYZE").execute(&mut conn).await.expect("analyze");
    let (_, sql, full) = CLAIMS[0];
    let mut plans = Vec::new();
    for (way, sql) in both_ways(sql) {
        plans.push((way, plans_of(&mut conn, &sql, full, "g").await));
    }
    // The claims went through the flow rules: some runs started, never
    // more than two per account.
    let (running, most): (i64, i64) = sqlx::query_as(
        "SELECT count(*), coalesce(max(n), 0) FROM (
             SELECT count(*) AS n FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id
              WHERE r.state = 'running' GROUP BY e.payload->'account') a",
    )
    .fetch_one(&mut conn)
    .await
    .expect("running runs");
    assert!(running > 0 && most <= 2, "{running} accounts running, at most {most} runs on one");
    for (way, (custom, generic)) in plans {
        assert!(
            custom <= 5 && generic >= EXECUTIONS - 5,
            "the full claim {way} under flow control was planned for its values {custom} times in {EXECUTIONS} executions ({generic} generic)"
        );
    }
}

/// Rows of `durastep.runs` read by sequential scans so far, as the statistics have them.
async fn runs_seq_reads(conn: &mut PgConnection) -> i64 {
    sqlx::query_scalar("SELECT seq_tup_read FROM pg_stat_user_tables WHERE relid = 'durastep.runs'::regclass")
        .fetch_one(&mut *conn)
        .await
        .expect("runs' statistics")
}

/// Catches: a checkpoint flush that finds its runs by anything but their ids.
/// Postgres once chose the partial index `runs_running` (every running run of
/// every worker, each compared with the whole id array) when the state was in
/// the same `WHERE` as the ids and few of the table's runs were running, and
/// so every flush read all 500 other running runs here (at 256 runs in flight
/// a few percent of the server's CPU; with more workers, more for every
/// flush). Since migration 0034 that index is gone, and the plan such a
/// statement falls back to is a sequential scan of the table: the statistics
/// count the rows those read, 10,000 per scan here.
#[sqlx::test(migrations = false)]
async fn a_flush_reads_only_its_own_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    const OTHERS: i64 = 500;
    let steps = Function::new("steps").on_event("go").handler(|ctx: Ctx, _v: Value| async move {
        for i in 0..20 {
            ctx.step(&format!("s{i}"), || async move { Ok(i) }).await?;
        }
        Ok(())
    });
    let other = Function::new("other").on_event("seed").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    // No reaper within the test: it reads every running run by design.
    let options =
        durastep::WorkerOptions { reap_interval: std::time::Duration::from_secs(3_600), ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![steps, other], options).await;
    // Other workers' running runs, among 10,000, as the planner sees them.
    let seed: Vec<Event> = (0..10_000).map(|i| Event::new("seed", &i)).collect();
    for chunk in seed.chunks(1000) {
        engine.send_batch(chunk.to_vec()).await.expect("seed runs");
    }
    let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
    sqlx::query(
        "UPDATE durastep.runs SET state = CASE WHEN n <= $1 THEN 'running' ELSE 'completed' END,
                worker_id = CASE WHEN n <= $1 THEN gen_random_uuid() END,
                lease_epoch = 1, lease_expires_at = CASE WHEN n <= $1 THEN durastep.now() + interval '1 hour' END,
                finished_at = CASE WHEN n > $1 THEN durastep.now() END
           FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM durastep.runs) o WHERE o.id = runs.id",
    )
    .bind(OTHERS)
    .execute(&mut conn)
    .await
    .expect("other workers' runs");
    sqlx::query("ANALYZE durastep.runs").execute(&mut conn).await.expect("analyze");
    let before = runs_seq_reads(&mut conn).await;

    let worker = common::spawn_worker(&engine);
    let run = engine.send(Event::new("go", &0)).await.expect("send").run_ids[0];
    common::wait_for_run_where(&engine, run, "the run to complete", |r| r.state.is_finished()).await;
    worker.stop().await;
    // Statistics reach the shared counters about a second after each backend
    // goes idle: wait until the 20 step rows are counted.
    common::wait_until("the flushes in the statistics", || {
        let pool = engine.pool().clone();
        async move {
            let inserted: i64 = sqlx::query_scalar(
                "SELECT n_tup_ins FROM pg_stat_user_tables WHERE schemaname = 'durastep' AND relname = 'step_results'",
            )
            .fetch_one(&pool)
            .await
            .expect("step_results' statistics");
            inserted >= 20
        }
    })
    .await;
    let read = runs_seq_reads(&mut conn).await - before;
    assert!(read < OTHERS, "sequential scans read {read} rows of durastep.runs ({OTHERS} other running runs)");
}

/// Buffers (shared hits and reads) a claim reads when nothing is due: `sql`
/// prepared on `conn` and executed under its generic plan, as a worker's
/// connection keeps it, inside a transaction that is rolled back.
async fn idle_claim_buffers(conn: &mut PgConnection, sql: &'static str, full: bool) -> i64 {
    let types = if full {
        "text[], bigint, float8, uuid, float8, text[], int[]"
    } else {
        "text[], bigint, float8, uuid, text[], int[]"
    };
    let args = if full {
        "'{f}', 64, 30, gen_random_uuid(), 1, '{f}', '{0}'"
    } else {
        "'{f}', 64, 30, gen_random_uuid(), '{f}', '{0}'"
    };
    sqlx::raw_sql("SET plan_cache_mode = force_generic_plan; BEGIN").execute(&mut *conn).await.expect("begin");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("PREPARE idle_claim ({types}) AS {sql}")))
        .execute(&mut *conn)
        .await
        .expect("prepare the claim");
    let plan: serde_json::Value = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE idle_claim ({args})"
    )))
    .fetch_one(&mut *conn)
    .await
    .expect("explain the claim");
    sqlx::raw_sql("ROLLBACK; DEALLOCATE idle_claim; RESET plan_cache_mode")
        .execute(&mut *conn)
        .await
        .expect("roll back");
    let root = &plan[0]["Plan"];
    root["Shared Hit Blocks"].as_i64().expect("hits") + root["Shared Read Blocks"].as_i64().expect("reads")
}

/// Catches: a claim that walks the entry of every sleeping and waiting run
/// when fewer runs are due than it asks for. `runs_due` is ordered by
/// priority, then due time, and Postgres 15 cannot skip to the next
/// priority, so before 2026-12-04 each such claim (an idle worker's, or any
/// claim in a trickle of sends) read the whole index: with 400,000 runs
/// asleep, 4.6-6.8 ms per claim against 0.11-0.12 ms since (pgbench,
/// docs/performance.md "Claims that skip the sleeping runs"). Here each
/// claim, with nothing due, reads about as many buffers with 30,000 runs
/// asleep as with none (0-5 against 0-4): the old fast claim read 151, the
/// old full claim 165 (the index's leaf pages).
#[sqlx::test(migrations = false)]
async fn an_idle_claim_does_not_read_the_sleeping_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    const ASLEEP: i64 = 30_000;
    let handler = |_ctx: Ctx, v: Value| async move { Ok(v) };
    let engine = common::engine(&opts, vec![Function::new("f").on_event("go").handler(handler)]).await;
    let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
    // Each claim once before it is measured (the first execution in a session
    // reads the catalog), then with nothing stored.
    let mut empty = Vec::new();
    for (_, sql, full) in CLAIMS {
        idle_claim_buffers(&mut conn, sql, full).await;
        empty.push(idle_claim_buffers(&mut conn, sql, full).await);
    }
    // A backlog, as the statistics see it (a generic plan made then walks
    // `runs_due`; one made while nothing is due may scan `runs_next_due` and
    // sort, which hid the walk of the old full claim), then every run asleep,
    // each until its own time in the next month (one shared due time would
    // be deduplicated into a few index entries), with no new statistics.
    sqlx::query("ALTER TABLE durastep.runs SET (autovacuum_enabled = false)")
        .execute(&mut conn)
        .await
        .expect("autovacuum off");
    let seed: Vec<Event> = (0..ASLEEP).map(|i| Event::new("go", &i)).collect();
    for chunk in seed.chunks(1000) {
        engine.send_batch(chunk.to_vec()).await.expect("seed runs");
    }
    sqlx::query("ANALYZE durastep.runs").execute(&mut conn).await.expect("analyze");
    sqlx::query(
        "UPDATE durastep.runs SET state = 'sleeping',
                run_at = durastep.now() + interval '1 hour' + random() * interval '30 days'",
    )
    .execute(&mut conn)
    .await
    .expect("put the runs to sleep");
    sqlx::query("VACUUM durastep.runs").execute(&mut conn).await.expect("vacuum");
    for ((name, sql, full), before) in CLAIMS.into_iter().zip(empty) {
        let asleep = idle_claim_buffers(&mut conn, sql, full).await;
        assert!(
            asleep - before < 30,
            "{name} with nothing due read {asleep} buffers with {ASLEEP} runs asleep, {before} with none"
        );
    }
}

/// Catches: a worker draining a backlog that sends the claim which reads the
/// due runs first instead of the walk alone after a claim that came back
/// full (the hint passed the wrong way, or not at all). Under a backlog the
/// whole text scans an index of `runs` twice per claim (its due read, then
/// the walk: which index each uses depends on the statistics), the walk
/// alone once. 2,000 queued runs, claims of at most 16; each claim is
/// counted by its time in the run history (one transaction, one clock
/// reading) (docs/performance.md "Two claim statements"). The statistics
/// are made before the drain and autovacuum is off, so that every claim's
/// generic plan reads one of the two indexes (in a table never analyzed the
/// walk scanned `runs_next_due` and sorted; a sequential scan would count
/// nothing, and the test says so instead of passing).
#[sqlx::test(migrations = false)]
async fn a_draining_worker_sends_the_walk_alone(_p: PgPoolOptions, opts: PgConnectOptions) {
    const RUNS: usize = 2000;
    let handler = |_ctx: Ctx, v: Value| async move { Ok(v) };
    // No reaper within the test: its queue-depth sample reads the due runs too.
    let options = durastep::WorkerOptions {
        claim_batch: 16,
        claim_ahead: 0,
        max_in_flight: 16,
        reap_interval: std::time::Duration::from_secs(3_600),
        ..common::fast_options()
    };
    let engine = common::engine_with(&opts, vec![Function::new("f").on_event("go").handler(handler)], options).await;
    let seed: Vec<Event> = (0..RUNS).map(|i| Event::new("go", &i)).collect();
    for chunk in seed.chunks(1000) {
        engine.send_batch(chunk.to_vec()).await.expect("seed runs");
    }
    let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
    sqlx::raw_sql("ALTER TABLE durastep.runs SET (autovacuum_enabled = false); ANALYZE durastep.runs")
        .execute(&mut conn)
        .await
        .expect("statistics, then autovacuum off");
    sqlx::query("SELECT pg_stat_reset()").execute(&mut conn).await.expect("reset the statistics");
    let worker = common::spawn_worker(&engine);
    let left = "durastep.runs WHERE state <> 'completed'";
    common::wait_until("the runs to complete", || async { common::count(&engine, left).await == 0 }).await;
    worker.stop().await;
    let claims =
        common::count(&engine, "(SELECT DISTINCT at FROM durastep.run_timeline WHERE state = 'running') c").await;
    // A backend's statistics reach the shared counters when it exits.
    engine.pool().close().await;
    // Every run claimed and completed: two updates each, whatever the plans.
    let updated = "SELECT n_tup_upd FROM pg_stat_user_tables WHERE schemaname = 'durastep' AND relname = 'runs'";
    common::wait_until("the drain in the statistics", || {
        let opts = opts.clone();
        async move {
            let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
            let n: i64 = sqlx::query_scalar(updated).fetch_one(&mut conn).await.expect("updates");
            n >= 2 * RUNS as i64
        }
    })
    .await;
    let seen: i64 = sqlx::query_scalar(
        "SELECT coalesce(sum(idx_scan), 0)::bigint FROM pg_stat_user_indexes
          WHERE indexrelname IN ('runs_due', 'runs_next_due')",
    )
    .fetch_one(&mut conn)
    .await
    .expect("index scans");
    assert!(seen >= claims, "{seen} scans of runs_due and runs_next_due for {claims} claims: a claim read neither");
    assert!(claims >= 100, "{claims} claims for {RUNS} runs of at most 16");
    assert!(
        seen < claims + claims / 2,
        "{seen} scans of runs_due and runs_next_due for {claims} claims: the claims after full ones read the due runs first"
    );
}

/// The plan `conn` makes for `sql` (one parameter of type `param`) executed
/// with `arg`, as text: under `plan_cache_mode = force_generic_plan`, the
/// generic plan a pool keeps after five executions.
async fn plan_of(conn: &mut PgConnection, sql: &str, param: &str, arg: &str) -> String {
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("PREPARE planned ({param}) AS {sql}")))
        .execute(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("prepare {sql}: {e}"));
    let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!("EXPLAIN EXECUTE planned ({arg})")))
        .fetch_all(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("explain {sql}: {e}"));
    sqlx::query("DEALLOCATE planned").execute(&mut *conn).await.expect("deallocate");
    plan.join("\n")
}

/// The reaper's sweeps for what they name, and the partial indexes they are
/// written for: a sweep whose conditions no longer imply its index's
/// predicate reads every run instead (the index holds the few runs it is
/// after, the table every run ever kept).
const SWEEPS: [(&str, &str, &[&str]); 2] = [
    ("the timeout sweep", include_str!("../src/store/sql/expire_timeouts.sql"), &["runs_deadline", "runs_start_by"]),
    (
        "the lapsed-cancel release",
        include_str!("../src/store/sql/release_lapsed_cancels.sql"),
        &["runs_attempt_stopping"],
    ),
];

/// Catches: a reaper sweep that reads `runs` whole. Both sweeps run on every
/// reaper tick of every worker, whether or not anything is overdue, and
/// restate the predicates of the partial indexes built for them (migration
/// 0038): `runs_deadline` and `runs_start_by` for the timeout sweep,
/// `runs_attempt_stopping` for the release of cancelled attempts whose lease
/// lapsed. With a condition dropped or changed so that it no longer implies
/// the predicate (checked: the `started_at IS NULL` of a start deadline, the
/// `worker_id IS NOT NULL` of the release; or the runs locked through a join
/// with those found, as the timeout sweep did until 2026-12-07), Postgres
/// cannot use the index and scans the table (here
/// 20,000 finished runs, every one with both deadlines) or the due queue
/// (a backlog of 2,000 queued runs). Checked under the generic plan, which
/// a pool keeps after five executions.
#[sqlx::test(migrations = false)]
async fn the_reaper_sweeps_read_their_partial_indexes(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("f").on_event("go").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let engine = common::engine(&opts, vec![f]).await;
    let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
    // 20,000 finished runs with both deadlines past and a backlog of 2,000
    // queued runs without deadlines (none of them in the three indexes), and
    // one run of each kind the sweeps are for: queued past its start
    // deadline, running past its finish deadline, cancelled with its worker.
    sqlx::raw_sql(
        "CREATE TEMP TABLE seed AS SELECT durastep.uuid7() AS ev, n FROM generate_series(1, 22003) AS n;
         INSERT INTO durastep.events (id, name, payload) SELECT ev, 'go', '{}' FROM seed;
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, started_at,
                                    finished_at, start_by, deadline_at, worker_id, lease_epoch)
         SELECT durastep.uuid7(), 'f', ev,
                CASE WHEN n <= 20000 THEN 'completed' WHEN n <= 22001 THEN 'queued'
                     WHEN n = 22002 THEN 'running' ELSE 'cancelled' END,
                now(), 3, CASE WHEN n <= 20000 OR n > 22001 THEN now() END, CASE WHEN n <= 20000 THEN now() END,
                CASE WHEN n <= 20000 OR n = 22001 THEN now() - interval '1 hour' END,
                CASE WHEN n <= 20000 OR n = 22002 THEN now() - interval '1 hour' END,
                CASE WHEN n > 22001 THEN gen_random_uuid() END, 1
           FROM seed;
         ANALYZE durastep.runs;",
    )
    .execute(&mut conn)
    .await
    .expect("seed runs");
    sqlx::query("SET plan_cache_mode = force_generic_plan").execute(&mut conn).await.expect("generic plans");
    for (name, sql, indexes) in SWEEPS {
        let plan = plan_of(&mut conn, sql, "bigint", "100").await;
        for index in indexes {
            assert!(plan.contains(index), "{name} does not read {index}:\n{plan}");
        }
        assert!(!plan.contains("Seq Scan on runs"), "{name} scans durastep.runs:\n{plan}");
    }
    drop(engine);
}

/// Catches: a read of the diverged runs that scans `runs`. Since migration
/// 0043 they have no index of their own: the overview's exact counts of the
/// unfinished states (`counts_estimated` over `EXACT_COUNT_BELOW` runs) and
/// the deploy check's pages find them through `runs_listed_by_state`, whose
/// predicate names `diverged`. Checked: with that index dropped as well,
/// both read the 60,000 finished runs here by sequential scans. The reads go
/// through an engine with one connection, whose statistics the test flushes
/// before it reads them.
#[sqlx::test(migrations = false)]
async fn the_diverged_runs_are_read_through_the_listing_index(_p: PgPoolOptions, opts: PgConnectOptions) {
    const FINISHED: i64 = 60_000;
    let f = || Function::new("f").on_event("go").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let engine = common::engine(&opts, vec![f()]).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE TEMP TABLE seed AS SELECT durastep.uuid7() AS ev, n FROM generate_series(1, {FINISHED} + 3) AS n;
         INSERT INTO durastep.events (id, name, payload) SELECT ev, 'go', '{{}}' FROM seed;
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, started_at, finished_at)
         SELECT durastep.uuid7(), 'f', ev, CASE WHEN n <= {FINISHED} THEN 'completed' ELSE 'diverged' END,
                now(), 3, now(), CASE WHEN n <= {FINISHED} THEN now() END
           FROM seed;
         ANALYZE durastep.runs;"
    )))
    .execute(engine.pool())
    .await
    .expect("seed runs");
    let one = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.expect("connect");
    let reader = durastep::Engine::builder().pool(one.clone()).function(f()).build().await.expect("reader engine");
    let before = common::runs_seq_reads(&one).await;

    let counts = reader.inspect().counts_estimated().await.expect("counts");
    let diverged: Vec<_> = counts.iter().filter(|c| c.state == durastep::RunState::Diverged).collect();
    assert_eq!(diverged.len(), 1, "{counts:?}");
    assert_eq!((diverged[0].count, diverged[0].estimated), (3, false), "the diverged runs counted exactly");
    let report = reader.check_deploy().await.expect("deploy check");
    assert_eq!(report.runs_checked, 3, "the deploy check's pages hold the three diverged runs");

    let read = common::runs_seq_reads(&one).await - before;
    assert!(read < FINISHED, "sequential scans read {read} rows of durastep.runs ({FINISHED} finished runs)");
    drop(engine);
}

/// A run's timeline as the inspection API reads it (`load_history` in the
/// store), with the generic plan a pool keeps after five executions.
const TIMELINE: &str = "SELECT at, state, attempt, worker_id, error, step
                          FROM durastep.run_timeline WHERE run_id = $1 ORDER BY seq, part";

/// Catches: a run's timeline (migration 0044's view `durastep.run_timeline`:
/// each attempt's start from the row of its end, every row, the start of
/// the attempt running now from the run, and since 0045 the start and the
/// completion a completed run carries) that reads `run_history` or `runs`
/// whole instead of the run's rows through their primary keys, as a branch
/// of the view would that the run's id cannot reach (one whose rows are
/// computed over the whole table first). Here 10,000 completed runs with a
/// row each, 10,000 that carry their completion and 2,000 running ones. The
/// test shows it can fail: the same view with a fence against pushing the
/// id into its last branch (`OFFSET 0`) scans `runs`.
#[sqlx::test(migrations = false)]
async fn a_run_s_timeline_is_read_through_the_primary_keys(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, vec![]).await;
    let mut conn = PgConnection::connect_with(&opts).await.expect("connect");
    sqlx::raw_sql(
        "INSERT INTO durastep.functions (id, triggers, max_attempts) VALUES ('f', ARRAY['go'], 3);
         CREATE TEMP TABLE seed AS SELECT durastep.uuid7() AS ev, durastep.uuid7() AS id, n
           FROM generate_series(1, 22000) AS n;
         INSERT INTO durastep.events (id, name, payload) SELECT ev, 'go', '{}' FROM seed;
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, started_at,
                                    finished_at, worker_id, lease_epoch, claim_id, attempt_claimed_at,
                                    attempt_claim_id)
         SELECT id, 'f', ev, CASE WHEN n <= 20000 THEN 'completed' ELSE 'running' END, now(), 3, now(),
                CASE WHEN n <= 20000 THEN now() END, CASE WHEN n > 10000 THEN gen_random_uuid() END, 1,
                n, now(), n
           FROM seed;
         INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch, started_at, started_attempt,
                                           started_by)
         SELECT id, now(), 'completed', 1, 1, now(), 1, gen_random_uuid() FROM seed WHERE n <= 10000;
         ANALYZE durastep.runs;
         ANALYZE durastep.run_history;",
    )
    .execute(&mut conn)
    .await
    .expect("seed runs and history");
    sqlx::query("SET plan_cache_mode = force_generic_plan").execute(&mut conn).await.expect("generic plans");
    let plan = plan_of(&mut conn, TIMELINE, "uuid", "durastep.uuid7()").await;
    for index in ["run_history_pkey", "runs_pkey"] {
        assert!(plan.contains(index), "the timeline does not read {index}:\n{plan}");
    }
    assert!(!plan.contains("Seq Scan"), "the timeline scans a table:\n{plan}");

    // The same view with its last branch fenced off from the run's id.
    let view: String = sqlx::query_scalar("SELECT pg_get_viewdef('durastep.run_timeline'::regclass)")
        .fetch_one(&mut conn)
        .await
        .expect("the view's text");
    let fenced = view.trim_end().trim_end_matches(';').to_owned() + " OFFSET 0";
    let (head, last) = fenced.rsplit_once("UNION ALL").expect("the view's last branch");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "BEGIN; CREATE OR REPLACE VIEW durastep.run_timeline AS {head} UNION ALL (SELECT * FROM ({last}) x)"
    )))
    .execute(&mut conn)
    .await
    .expect("fence the view's last branch");
    let fenced_plan = plan_of(&mut conn, TIMELINE, "uuid", "durastep.uuid7()").await;
    sqlx::query("ROLLBACK").execute(&mut conn).await.expect("roll back");
    assert!(fenced_plan.contains("Seq Scan on runs"), "the check cannot fail:\n{fenced_plan}");
    drop(engine);
}
