//! The fast claim's guards (store/sql/claim_fast.sql, docs/architecture.md
//! "The fast claim"): a worker takes the runs of its functions without flow
//! rules or timeouts with the fast claim, and that claim must leave alone the
//! runs the full claim would have treated differently.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Ctx, Event, Function, RunState};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn counted(bodies: Arc<AtomicU32>) -> Function {
    Function::new("plain").on_event("go").handler(move |ctx: Ctx, _: ()| {
        let bodies = bodies.clone();
        async move {
            ctx.step("once", || async move {
                bodies.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await
        }
    })
}

/// Catches: a fast claim that starts the runs of a function for which another
/// build registered a flow rule (a mixed deploy): only a worker with that
/// build's rules, which uses the full claim, may take them.
#[sqlx::test(migrations = false)]
async fn fast_claim_leaves_runs_of_a_function_with_flow_rules_elsewhere(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let bodies = Arc::new(AtomicU32::new(0));
    let engine = common::engine(&opts, vec![counted(bodies.clone())]).await;
    // Another build's registration: a concurrency rule on the same function id.
    for sql in [
        "INSERT INTO durastep.flow_rules (name, kind, capacity) VALUES ('other-build', 'concurrency', 1)",
        "INSERT INTO durastep.function_flow (function_id, rule) VALUES ('plain', 'other-build')",
    ] {
        sqlx::query(sql).execute(engine.pool()).await.unwrap();
    }
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::stays(&engine, id, Duration::from_millis(1500), "queued", |r| r.state == RunState::Queued).await;
    assert_eq!(bodies.load(Ordering::SeqCst), 0, "no body ran");
    // Once no build has the rule, this worker's fast claim takes it.
    sqlx::query("DELETE FROM durastep.function_flow WHERE function_id = 'plain'").execute(engine.pool()).await.unwrap();
    let run = common::finished(&engine, id).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(bodies.load(Ordering::SeqCst), 1);
    w.stop().await;
}

/// Catches: a fast claim that starts a run past its start deadline (its
/// function had a start timeout in another build): maintenance cancels it with
/// the reason the full claim would have written, and no body runs.
#[sqlx::test(migrations = false)]
async fn fast_claim_leaves_a_run_past_its_start_deadline_to_maintenance(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let bodies = Arc::new(AtomicU32::new(0));
    let engine = common::engine(&opts, vec![counted(bodies.clone())]).await;
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    sqlx::query("UPDATE durastep.runs SET start_by = durastep.now() - interval '1 second' WHERE id = $1")
        .bind(id)
        .execute(engine.pool())
        .await
        .unwrap();
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, id).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Cancelled, "{run:?}");
    let reason = run.cancel_reason.unwrap_or_default();
    assert!(reason.starts_with("start timeout"), "{reason}");
    assert_eq!(bodies.load(Ordering::SeqCst), 0, "no body ran");
}

/// Catches: a worker that claims ahead while none of its slots frees (a
/// worker whose handlers are all stuck would hoard runs that another worker
/// could start; `claim_ahead` is bounded by the slots freed in the last 100-200 ms).
#[sqlx::test(migrations = false)]
async fn a_worker_whose_slots_are_all_stuck_claims_nothing_ahead(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (gates, reached) = (Arc::new(vec![common::Gate::new()]), Arc::new(vec![common::Gate::new()]));
    let x_starts = Arc::new(AtomicU32::new(0));
    let worker = durastep::WorkerOptions { max_in_flight: 1, claim_ahead: 4, ..common::fast_options() };
    let engine = common::engine_with(
        &opts,
        vec![common::ahead::ahead_function(gates.clone(), reached.clone(), x_starts.clone())],
        worker,
    )
    .await;
    let w = common::spawn_worker(&engine);
    let blocked = engine.send(Event::new("ahead/go", &("block", 0))).await.unwrap().run_ids[0];
    reached[0].reached("the blocking run to start").await;
    let next = engine.send(Event::new("ahead/go", &("x", 0))).await.unwrap().run_ids[0];
    common::stays(&engine, next, Duration::from_millis(1_500), "queued (not claimed ahead)", |r| {
        r.state == RunState::Queued && r.attempt == 1
    })
    .await;
    gates[0].open();
    assert_eq!(common::finished(&engine, blocked).await.state, RunState::Completed);
    assert_eq!(common::finished(&engine, next).await.state, RunState::Completed);
    w.stop().await;
    assert_eq!(x_starts.load(Ordering::SeqCst), 1);
}

/// Catches: `claim_ahead: 0` not honoured (G26: it keeps strict order, since
/// a run claimed ahead could start before a higher-priority run that becomes
/// due meanwhile). The scenario in which a worker with `claim_ahead: 1`
/// claims `x` ahead (tests/common/ahead.rs: its slot turned over on 100
/// quick runs, then a run blocks it), run for every round: `x` must stay
/// queued while the slot is blocked.
#[sqlx::test(migrations = false)]
async fn a_worker_with_claim_ahead_zero_claims_nothing_ahead(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let ahead = common::ahead::Ahead::new();
    let engine = ahead.engine_claiming_ahead(&opts, 0).await;
    let w = common::spawn_worker(&engine);
    for round in 0..common::ahead::AHEAD_ROUNDS {
        let (blocked, x) = ahead.round(&engine, round).await;
        common::stays(&engine, x, Duration::from_millis(600), "queued (not claimed ahead)", |r| {
            r.state == RunState::Queued && r.attempt == 1
        })
        .await;
        ahead.gates[round].open();
        assert_eq!(common::finished(&engine, blocked).await.state, RunState::Completed);
        assert_eq!(common::finished(&engine, x).await.state, RunState::Completed);
    }
    w.stop().await;
    assert_eq!(ahead.x_starts.load(Ordering::SeqCst), common::ahead::AHEAD_ROUNDS as u32);
}

/// Catches: a run claimed ahead that is kept while no slot frees (it must be
/// given back within about a second, without counting an attempt and without
/// running user code, so that another worker starts it), one given back
/// behind the runs that became due after it (it keeps its due time), and a
/// worker that does not count a run it gave back off its claim's record (the
/// record would stay until its first lease passed: a minute here, longer
/// than the test).
#[sqlx::test(migrations = false)]
async fn a_run_claimed_ahead_is_given_back_when_no_slot_frees(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let ahead = common::ahead::Ahead::new();
    let engine = ahead.engine_with_lease(&opts, common::LONG_LEASE).await;
    let w = common::spawn_worker(&engine);
    let (round, blocked, x) = ahead.claimed_ahead(&engine).await;
    let due = engine.run(x).await.unwrap().run_at;
    // Given back: queued again, the same attempt, no user code run, and its
    // place in the queue kept (G26: its due time, not the time it was given back).
    let back = common::wait_for_run_where(&engine, x, "given back", |r| r.state == RunState::Queued).await;
    assert_eq!(back.attempt, 1, "{back:?}");
    assert_eq!(back.run_at, due, "the run given back lost its place in the queue");
    assert_eq!(ahead.x_starts.load(Ordering::SeqCst), round as u32, "the run claimed ahead ran user code");
    // Another worker starts it while A's slot is still blocked.
    let other = common::engine(&opts, vec![ahead.function()]).await;
    let wb = common::spawn_worker(&other);
    assert_eq!(common::finished(&engine, x).await.state, RunState::Completed);
    assert!(!ahead.gates[round].is_open());
    assert_eq!(engine.run(blocked).await.unwrap().state, RunState::Running);
    ahead.gates[round].open();
    assert_eq!(common::finished(&engine, blocked).await.state, RunState::Completed);
    // Every attempt ended or was given back: no claim record is left.
    common::wait_until("every claim record deleted", || async { claim_records(&engine).await == (0, 0) }).await;
    w.stop().await;
    wb.stop().await;
}

/// Catches: a stopping worker that gives back a run claimed ahead without
/// counting it off its claim's record (the record would stay until its
/// first lease passed: a minute here, longer than the test), or that starts
/// it. Stopped within a second of the claim (before the claimed-ahead run
/// would be given back for waiting too long), the worker gives the run back
/// at once and lets the running one finish within its grace; once `stop`
/// returns, no claim record is left.
#[sqlx::test(migrations = false)]
async fn a_run_claimed_ahead_and_given_back_at_shutdown_leaves_no_claim_record(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    common::init_logs();
    let ahead = common::ahead::Ahead::new();
    let engine = ahead.engine_with_lease(&opts, common::LONG_LEASE).await;
    let w = common::spawn_worker(&engine);
    let (round, blocked, x) = ahead.claimed_ahead(&engine).await;
    w.request_stop();
    let back = common::wait_for_run_where(&engine, x, "given back", |r| r.state == RunState::Queued).await;
    assert_eq!(back.attempt, 1, "{back:?}");
    ahead.gates[round].open();
    w.stop().await;
    assert_eq!(engine.run(blocked).await.unwrap().state, RunState::Completed, "the running run had its grace");
    assert_eq!(ahead.x_starts.load(Ordering::SeqCst), round as u32, "the run claimed ahead ran user code");
    assert_eq!(claim_records(&engine).await, (0, 0), "a claim record left after the worker stopped");
}

/// Catches: a worker that claims more than `claim_ahead` runs ahead of its
/// slots (G26 bounds by `claim_ahead` how many runs claimed earlier may start
/// before a higher-priority run that becomes due). Two slots, `claim_ahead:
/// 2`, claims of up to 16: after its slots turned over on quick runs, two runs
/// block both slots while 12 more are due; sampled for a second, at most 2 of
/// those 12 are claimed (`running`), and a run that becomes due later with a
/// higher priority starts after at most the 2 claimed ahead.
#[sqlx::test(migrations = false)]
async fn a_worker_claims_at_most_claim_ahead_runs_ahead(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let gates = Arc::new([common::Gate::new(), common::Gate::new()]);
    let entered = Arc::new([common::Gate::new(), common::Gate::new()]);
    // The runs that waited, in the order their handlers started (the urgent one is 99).
    let started = Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
    let f = {
        let (gates, entered, started) = (gates.clone(), entered.clone(), started.clone());
        Function::new("ahead-bound").on_event("go").handler(move |_: Ctx, (kind, n): (String, usize)| {
            let (gates, entered, started) = (gates.clone(), entered.clone(), started.clone());
            async move {
                match kind.as_str() {
                    "block" => {
                        entered[n].open();
                        gates[n].wait().await;
                    }
                    "wait" => started.lock().unwrap().push(n),
                    _ => {}
                }
                Ok(())
            }
        })
    };
    let worker =
        durastep::WorkerOptions { max_in_flight: 2, claim_ahead: 2, claim_batch: 16, ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![f], worker).await;
    let w = common::spawn_worker(&engine);
    engine.send_batch((0..100).map(|_| Event::new("go", &("quick", 0))).collect()).await.unwrap();
    for n in 0..2 {
        engine.send(Event::new("go", &("block", n))).await.unwrap();
    }
    // The runs that wait are sent once both slots are blocked: sent before,
    // some could start (and finish) between the two blocking runs, which
    // is not claiming ahead (on a busy machine they did, and were counted).
    entered[0].reached("the first blocking run to start").await;
    entered[1].reached("the second blocking run to start").await;
    let waiting: Vec<uuid::Uuid> = engine
        .send_batch((0..12).map(|n| Event::new("go", &("wait", n))).collect())
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.run_ids[0])
        .collect();
    let mut most = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    while tokio::time::Instant::now() < deadline {
        // Runs that wait behind the blocked slots and are claimed: claimed ahead.
        // (Quick runs may still read `running` while their completion is written.)
        let held: i64 =
            sqlx::query_scalar("SELECT count(*) FROM durastep.runs WHERE id = ANY ($1) AND state = 'running'")
                .bind(&waiting)
                .fetch_one(engine.pool())
                .await
                .unwrap();
        assert!(held <= 2, "{held} runs claimed ahead by a worker with claim_ahead 2");
        most = most.max(held);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    engine.send(Event::new("go", &("wait", 99)).priority(10)).await.unwrap();
    gates[0].open();
    gates[1].open();
    common::wait_until("every run that waited to start", || async { started.lock().unwrap().len() == 13 }).await;
    w.stop().await;
    let order = started.lock().unwrap().clone();
    let place = order.iter().position(|n| *n == 99).unwrap();
    tracing::info!(most, place, ?order, "claimed ahead at most, and the start order of the runs that waited");
    assert!(place <= 2, "the urgent run started after {place} runs claimed before it (claim_ahead 2): {order:?}");
}

/// Catches: a claim round whose fast claim waits for its full claim (until
/// 2026-12-04 one round sent them one after the other and started no run
/// before both answered, so one function with a flow rule added the full
/// claim's statement to every wake-up of every other function). Here the
/// full claim cannot run at all (a test transaction holds `flow_rules`, which
/// only it reads); runs of the function without flow rules must still start
/// and finish, one after the other.
#[sqlx::test(migrations = false)]
async fn a_run_of_the_fast_claim_does_not_wait_for_the_full_claim(_p: PgPoolOptions, opts: PgConnectOptions) {
    use sqlx::Connection;
    common::init_logs();
    let bodies = Arc::new(AtomicU32::new(0));
    let limited = Function::new("limited")
        .on_event("other")
        .concurrency(durastep::Concurrency::new(1))
        .handler(|_ctx: Ctx, _: ()| async move { Ok(()) });
    let engine = common::engine(&opts, vec![counted(bodies.clone()), limited]).await;
    let w = common::spawn_worker(&engine);
    // Both classes claimed once, so the worker is past its start.
    let first = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let other = engine.send(Event::new("other", &())).await.unwrap().run_ids[0];
    for id in [first, other] {
        assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);
    }
    // Sent from another engine, so that the run is not handed to the worker
    // of this process but claimed.
    let sender = common::engine(&opts, vec![counted(bodies.clone())]).await;
    let mut blocker = sqlx::PgConnection::connect_with(&opts).await.unwrap();
    sqlx::query("BEGIN").execute(&mut blocker).await.unwrap();
    sqlx::query("LOCK TABLE durastep.flow_rules IN ACCESS EXCLUSIVE MODE").execute(&mut blocker).await.unwrap();
    // A full claim waits for the lock (the worker claims both classes at
    // least once per poll interval, 50 ms here).
    let waiting =
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'";
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(waiting).fetch_one(&mut blocker).await.unwrap() == 0 {
        assert!(std::time::Instant::now() < deadline, "no full claim came to wait for the lock");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // One after the other: the full claim stays in flight all along, and
    // does not hold back the fast claims of later wake-ups either.
    for _ in 0..3 {
        let id = sender.send(Event::new("go", &())).await.unwrap().run_ids[0];
        let run = common::finished(&engine, id).await;
        assert_eq!(run.state, RunState::Completed, "{run:?}");
    }
    assert_eq!(bodies.load(Ordering::SeqCst), 4);
    // The full claim still waits: its class is claimed once the lock goes.
    let waited: i64 = sqlx::query_scalar(waiting).fetch_one(&mut blocker).await.unwrap();
    assert!(waited >= 1, "a full claim waits for the lock");
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    let after = engine.send(Event::new("other", &())).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, after).await.state, RunState::Completed);
    w.stop().await;
}

/// The claim records (`durastep.run_claims`, migration 0034): how many
/// (run, epoch) pairs they list whose run is running under that epoch, and
/// how many records there are.
async fn claim_records(engine: &durastep::Engine) -> (i64, i64) {
    sqlx::query_as(
        "SELECT (SELECT count(*) FROM durastep.run_claims c
                   CROSS JOIN LATERAL unnest(c.run_ids, c.epochs) AS u(run_id, epoch)
                   JOIN durastep.runs r ON r.id = u.run_id AND r.lease_epoch = u.epoch AND r.state = 'running'),
                (SELECT count(*) FROM durastep.run_claims)",
    )
    .fetch_one(engine.pool())
    .await
    .expect("claim records")
}

/// Catches: a claim that starts runs without listing them in a claim record
/// (the reaper would never find their leases once their worker died), and a
/// worker that leaves the records of finished claims behind (each would stay
/// until its first lease passed, and every read of the running runs would
/// walk it). The handlers wait on a gate, so all 40 runs are running at once;
/// then they finish, and the worker deletes the records itself: its lease
/// (60 s) and reaper (10 min) are too long for the reaper to have done it.
#[sqlx::test(migrations = false)]
async fn claims_list_their_runs_and_the_worker_deletes_their_records(_p: PgPoolOptions, opts: PgConnectOptions) {
    const RUNS: i64 = 40;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    let f = Function::new("gated").on_event("gated/go").handler(move |_ctx: Ctx, _: u32| {
        let g = g.clone();
        async move {
            let _pass = g.acquire().await.expect("gate");
            Ok(())
        }
    });
    let options = durastep::WorkerOptions {
        max_in_flight: RUNS as usize,
        claim_batch: 16,
        lease: common::LONG_LEASE,
        reap_interval: Duration::from_secs(600),
        ..common::fast_options()
    };
    let engine = common::engine_with(&opts, vec![f], options).await;
    let events = (0..RUNS as u32).map(|n| Event::new("gated/go", &n)).collect();
    let receipts = engine.send_batch(events).await.expect("send");
    let w = common::spawn_worker(&engine);
    common::wait_until("every run running", || {
        let engine = engine.clone();
        async move { common::count(&engine, "durastep.runs WHERE state = 'running'").await == RUNS }
    })
    .await;
    let (listed, records) = claim_records(&engine).await;
    assert_eq!(listed, RUNS, "running runs listed in claim records");
    assert!(records >= 3, "{records} records for claims of at most 16 runs");
    gate.add_permits(RUNS as usize);
    for r in &receipts {
        assert_eq!(common::finished(&engine, r.run_ids[0]).await.state, RunState::Completed);
    }
    common::wait_until("the worker to delete the claim records", || {
        let engine = engine.clone();
        async move { claim_records(&engine).await == (0, 0) }
    })
    .await;
    w.stop().await;
}

/// Catches: a reaper that misses a lapsed lease listed in a claim record,
/// deletes a record that still lists a running run, or keeps records of
/// finished runs. Three records, all due for a look: A lists a completed run
/// and a running run with an hour of lease left; B a running run whose lease
/// has lapsed; C only the completed run. One pass takes B's run back, deletes
/// C, and cuts A down to its running run, to be looked at when that lease can
/// lapse; the next pass deletes B, whose run is no longer running under the
/// epoch it lists.
#[sqlx::test(migrations = false)]
async fn the_reaper_reads_and_tidies_the_claim_records(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("idle").on_event("idle/go").handler(|_ctx: Ctx, _: u32| async move { Ok(()) });
    let engine = common::engine(&opts, vec![f]).await;
    let ids: Vec<uuid::Uuid> = engine
        .send_batch((0..3u32).map(|n| Event::new("idle/go", &n)).collect())
        .await
        .expect("send")
        .into_iter()
        .map(|r| r.run_ids[0])
        .collect();
    let (done, live, lapsed) = (ids[0], ids[1], ids[2]);
    sqlx::query(
        "UPDATE durastep.runs
            SET state = CASE WHEN id = $1 THEN 'completed' ELSE 'running' END,
                finished_at = CASE WHEN id = $1 THEN durastep.now() END,
                lease_epoch = 7, worker_id = CASE WHEN id <> $1 THEN gen_random_uuid() END,
                -- As a claim sets it: the records below list the runs, not the trigger.
                claim_id = 1,
                started_at = durastep.now(),
                lease_expires_at = CASE WHEN id = $2 THEN durastep.now() + interval '1 hour'
                                        WHEN id = $3 THEN durastep.now() - interval '1 second' END
          WHERE id = ANY (ARRAY[$1, $2, $3])",
    )
    .bind(done)
    .bind(live)
    .bind(lapsed)
    .execute(engine.pool())
    .await
    .expect("run states");
    sqlx::query(
        "INSERT INTO durastep.run_claims (recheck_at, run_ids, epochs) VALUES
             (durastep.now() - interval '1 minute', ARRAY[$1, $2]::uuid[], ARRAY[7, 7]),
             (durastep.now() - interval '1 minute', ARRAY[$3]::uuid[], ARRAY[7]),
             (durastep.now() - interval '1 minute', ARRAY[$1]::uuid[], ARRAY[7])",
    )
    .bind(done)
    .bind(live)
    .bind(lapsed)
    .execute(engine.pool())
    .await
    .expect("claim records");
    assert_eq!(engine.reap_expired_leases().await.unwrap(), 1, "the lapsed lease taken back");
    assert_eq!(engine.run(lapsed).await.unwrap().state, RunState::Queued);
    assert_eq!(engine.run(live).await.unwrap().state, RunState::Running);
    let records = |pool: sqlx::PgPool| async move {
        sqlx::query_as::<_, (Vec<uuid::Uuid>, bool)>(
            "SELECT c.run_ids, coalesce(c.recheck_at = r.lease_expires_at, false)
               FROM durastep.run_claims c LEFT JOIN durastep.runs r ON r.id = c.run_ids[1]
              ORDER BY c.id",
        )
        .fetch_all(&pool)
        .await
        .expect("records")
    };
    assert_eq!(
        records(engine.pool().clone()).await,
        vec![(vec![live], true), (vec![lapsed], false)],
        "A cut down to its running run, looked at when its lease can lapse; B kept; C deleted"
    );
    assert_eq!(engine.reap_expired_leases().await.unwrap(), 0);
    assert_eq!(records(engine.pool().clone()).await, vec![(vec![live], true)], "B deleted");
}

/// Catches: a worker with `claim_ahead: 0` whose two claim classes do not
/// take turns at its free slots. With `claim_ahead: 0` the classes' claims
/// in flight together bring at most the free slots (else one class's runs
/// would wait claimed ahead); if the fast claim then always went first, a
/// due run of a function with a flow rule or a timeout (the full claim's)
/// would wait behind every fast run due, 30 here. It must start second (the
/// fast class claims first, then the full class has its turn); it starts
/// last without the turns.
#[sqlx::test(migrations = false)]
async fn with_claim_ahead_zero_the_two_claim_classes_take_turns(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let starts = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let started = |name: &'static str| {
        let starts = starts.clone();
        move |_ctx: Ctx, _: ()| {
            let starts = starts.clone();
            async move {
                starts.lock().unwrap().push(name.to_owned());
                Ok(())
            }
        }
    };
    let functions = vec![
        Function::new("plain").on_event("go").handler(started("plain")),
        // A finish timeout: claimed by the full claim.
        Function::new("timed").on_event("timed").finish_timeout(Duration::from_secs(3_600)).handler(started("timed")),
    ];
    let worker = durastep::WorkerOptions { max_in_flight: 1, claim_ahead: 0, ..common::fast_options() };
    let engine = common::engine_with(&opts, functions, worker).await;
    // Due before the worker starts: no send hands its run over.
    engine.send_batch((0..30).map(|_| Event::new("go", &())).collect()).await.unwrap();
    let timed = engine.send(Event::new("timed", &())).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    assert_eq!(common::finished(&engine, timed).await.state, RunState::Completed);
    common::wait_until("every run started", || async { starts.lock().unwrap().len() == 31 }).await;
    w.stop().await;
    let starts = starts.lock().unwrap().clone();
    let at = starts.iter().position(|s| s == "timed").unwrap();
    assert!(at <= 1, "the full claim's run started {} of 31: {starts:?}", at + 1);
}
