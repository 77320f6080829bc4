//! Sending events: an idempotency key makes a repeated send create nothing
//! (sequentially, concurrently and inside one batch), and `send_in` joins the
//! caller's transaction.
mod common;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Barrier;

use durastep::{Ctx, Engine, Error, Event, Function, RunState};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// Two functions triggered by `order/placed`, so every event fans out into two runs.
fn two_functions() -> Vec<Function> {
    ["invoice", "notify"]
        .into_iter()
        .map(|id| Function::new(id).on_event("order/placed").handler(|_ctx: Ctx, v: Value| async move { Ok(v) }))
        .collect()
}

async fn stored_payload(engine: &Engine, event_id: uuid::Uuid) -> Value {
    sqlx::query_scalar("SELECT payload FROM durastep.events WHERE id = $1")
        .bind(event_id)
        .fetch_one(engine.pool())
        .await
        .unwrap()
}

/// Catches: a second send that inserts a second event or new runs, or that
/// reports ids other than the first send's, or overwrites the stored payload.
#[sqlx::test(migrations = false)]
async fn same_key_twice_creates_the_runs_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, two_functions()).await;
    let first = engine.send(Event::new("order/placed", &json!({"n": 1})).idempotency_key("order-7")).await.unwrap();
    let again = engine.send(Event::new("order/placed", &json!({"n": 2})).idempotency_key("order-7")).await.unwrap();

    assert!(!first.duplicate);
    assert!(again.duplicate);
    assert_eq!(first.run_ids.len(), 2, "one run per triggered function");
    assert_eq!(again.event_id, first.event_id);
    assert_eq!(again.run_ids, first.run_ids);
    assert_eq!(common::count(&engine, "durastep.events").await, 1);
    assert_eq!(common::count(&engine, "durastep.runs").await, 2);
    assert_eq!(stored_payload(&engine, first.event_id).await, json!({"n": 1}), "the first payload is kept");
    for id in ["invoice", "notify"] {
        assert_eq!(common::runs_of(&engine, id).await.len(), 1, "{id}");
    }
}

/// Two senders race with the same key, 25 times: each time exactly one creates
/// the event and both get the same ids. Catches: a check-then-insert race (two
/// events), or a duplicate whose lookup misses the winner's rows.
#[sqlx::test(migrations = false)]
async fn concurrent_sends_of_one_key_create_the_runs_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, two_functions()).await;
    let barrier = Arc::new(Barrier::new(2));
    let sender = |engine: Engine, barrier: Arc<Barrier>| {
        tokio::spawn(async move {
            let mut out = Vec::new();
            for k in 0..25 {
                barrier.wait().await; // both tasks send key k at the same moment
                out.push(
                    engine.send(Event::new("order/placed", &k).idempotency_key(format!("key-{k}"))).await.unwrap(),
                );
            }
            out
        })
    };
    let a = sender(engine.clone(), barrier.clone());
    let b = sender(engine.clone(), barrier);
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    for (k, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(x.event_id, y.event_id, "key-{k}");
        assert_eq!(x.run_ids, y.run_ids, "key-{k}");
        assert_eq!(x.run_ids.len(), 2, "key-{k}");
        assert!(x.duplicate != y.duplicate, "key-{k}: exactly one send creates the event: {x:?} {y:?}");
    }
    assert_eq!(common::count(&engine, "durastep.events").await, 25);
    assert_eq!(common::count(&engine, "durastep.runs").await, 50);
}

/// The key is unique per event name: the same key under another name is
/// another event. Catches: a unique index on the key alone (a silent drop).
#[sqlx::test(migrations = false)]
async fn same_key_under_another_name_is_another_event(_p: PgPoolOptions, opts: PgConnectOptions) {
    let mut functions = two_functions();
    functions
        .push(Function::new("refund").on_event("order/cancelled").handler(|_c: Ctx, v: Value| async move { Ok(v) }));
    let engine = common::engine(&opts, functions).await;
    let placed = engine.send(Event::new("order/placed", &1).idempotency_key("order-7")).await.unwrap();
    let cancelled = engine.send(Event::new("order/cancelled", &1).idempotency_key("order-7")).await.unwrap();
    assert!(!placed.duplicate && !cancelled.duplicate);
    assert_ne!(placed.event_id, cancelled.event_id);
    assert_eq!(placed.run_ids.len(), 2);
    assert_eq!(cancelled.run_ids.len(), 1);
    assert_eq!(common::count(&engine, "durastep.events").await, 2);
    assert_eq!(common::count(&engine, "durastep.runs").await, 3);
}

/// One batch holding the same (name, key) twice stores it once; receipts come
/// back in input order and the repeat points at the first. A second batch of
/// known keys creates nothing. Catches: a batch insert that errors on its own
/// duplicates, or receipts out of order.
#[sqlx::test(migrations = false)]
async fn send_batch_with_duplicates_inside_the_batch(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, two_functions()).await;
    let batch = vec![
        Event::new("order/placed", &0).idempotency_key("k1"),
        Event::new("order/placed", &1).idempotency_key("k2"),
        Event::new("order/placed", &2).idempotency_key("k1"),
        Event::new("order/placed", &3),
        Event::new("order/placed", &4),
    ];
    let r = engine.send_batch(batch).await.unwrap();
    assert_eq!(r.iter().map(|r| r.duplicate).collect::<Vec<_>>(), [false, false, true, false, false]);
    assert_eq!(r[2].event_id, r[0].event_id);
    assert_eq!(r[2].run_ids, r[0].run_ids);
    assert!(r.iter().all(|r| r.run_ids.len() == 2));
    let distinct: std::collections::HashSet<_> = r.iter().map(|r| r.event_id).collect();
    assert_eq!(distinct.len(), 4, "events without a key are never duplicates");
    assert_eq!(stored_payload(&engine, r[0].event_id).await, json!(0), "the first of the batch is kept");
    assert_eq!(common::count(&engine, "durastep.events").await, 4);
    assert_eq!(common::count(&engine, "durastep.runs").await, 8);

    let again = engine
        .send_batch(vec![
            Event::new("order/placed", &9).idempotency_key("k2"),
            Event::new("order/placed", &9).idempotency_key("k1"),
        ])
        .await
        .unwrap();
    assert!(again.iter().all(|r| r.duplicate));
    assert_eq!((again[0].event_id, again[1].event_id), (r[1].event_id, r[0].event_id));
    assert_eq!((&again[0].run_ids, &again[1].run_ids), (&r[1].run_ids, &r[0].run_ids));
    assert_eq!(common::count(&engine, "durastep.events").await, 4);
    assert_eq!(common::count(&engine, "durastep.runs").await, 8);
}

/// `send_in` writes with the caller's transaction: a rollback leaves no event
/// and no run (and no worker ever sees one), a commit makes the run start.
/// Catches: a send_in that uses its own connection (an event for a deal that
/// was never saved).
#[sqlx::test(migrations = false)]
async fn send_in_commits_and_rolls_back_with_the_callers_transaction(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    common::exec(&opts, "CREATE TABLE deals (id int PRIMARY KEY, stage text NOT NULL)").await;
    let f = Function::new("on-stage").on_event("deal/stage.changed").handler(|ctx: Ctx, deal: i32| async move {
        ctx.step("mail", || async move { Ok(format!("mailed deal {deal}")) }).await
    });
    let engine = common::engine(&opts, vec![f]).await;
    let w = common::spawn_worker(&engine);

    let mut tx = engine.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO deals VALUES (1, 'offer')").execute(&mut *tx).await.unwrap();
    let lost = engine.send_in(&mut tx, Event::new("deal/stage.changed", &1)).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(matches!(engine.run(lost.run_ids[0]).await, Err(Error::UnknownRun(_))));
    assert_eq!(common::count(&engine, "durastep.events").await, 0);
    assert_eq!(common::count(&engine, "durastep.runs").await, 0);
    assert_eq!(common::count(&engine, "deals").await, 0);

    let mut tx = engine.pool().begin().await.unwrap();
    sqlx::query("INSERT INTO deals VALUES (2, 'offer')").execute(&mut *tx).await.unwrap();
    let kept = engine.send_in(&mut tx, Event::new("deal/stage.changed", &2)).await.unwrap();
    // Not visible to workers (or anyone) before the commit.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(matches!(engine.run(kept.run_ids[0]).await, Err(Error::UnknownRun(_))));
    tx.commit().await.unwrap();

    let run = common::finished(&engine, kept.run_ids[0]).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!("mailed deal 2")));
    assert_eq!(common::count(&engine, "durastep.events").await, 1);
    assert_eq!(common::count(&engine, "durastep.runs").await, 1);
}

/// The Unix time in milliseconds a version-7 UUID carries (its first 48 bits).
fn v7_millis(id: uuid::Uuid) -> i64 {
    (id.as_u128() >> 80) as i64
}

/// Catches: run or event ids minted at random again (version 4) instead of
/// time-ordered (version 7, migration 0021), or a time-ordered id whose time
/// is not when it was made: indexes keyed by these ids rely on runs created
/// together getting neighbouring ids.
#[sqlx::test(migrations = false)]
async fn runs_and_events_get_time_ordered_ids(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, two_functions()).await;
    let before = chrono::Utc::now().timestamp_millis();
    let first = engine.send(Event::new("order/placed", &json!({"n": 1}))).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let second = engine.send(Event::new("order/placed", &json!({"n": 2}))).await.unwrap();
    let after = chrono::Utc::now().timestamp_millis();

    let ids: Vec<uuid::Uuid> = [first.event_id, second.event_id]
        .into_iter()
        .chain(first.run_ids.iter().copied())
        .chain(second.run_ids.iter().copied())
        .collect();
    for id in &ids {
        assert_eq!(id.get_version_num(), 7, "{id}");
        let at = v7_millis(*id);
        // The server's clock and this process's are the same machine's; 1 s of slack.
        assert!(at >= before - 1_000 && at <= after + 1_000, "{id}: {at} not in [{before}, {after}]");
    }
    for (a, b) in first.run_ids.iter().zip(&second.run_ids) {
        assert!(a < b, "a later send's run sorts after an earlier one's: {a} !< {b}");
    }
    assert!(first.event_id < second.event_id);
}

/// Catches: a worker in the sender's process that learns of a new run only
/// from the NOTIFY (one hop later) or from its poll. Here it has no LISTEN at
/// all and polls every 10 minutes, so only the engine's own wake-up can start
/// the later runs: they must finish long before the poll. They are sent as a
/// batch, which a send never hands to a worker directly (that is one event's
/// path): a single send here would pass by the handoff alone.
#[sqlx::test(migrations = false)]
async fn a_send_wakes_the_worker_of_its_own_process(_p: PgPoolOptions, opts: PgConnectOptions) {
    let echo = Function::new("echo").on_event("ping").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let options =
        durastep::WorkerOptions { listen: false, poll_interval: Duration::from_secs(600), ..common::fast_options() };
    let engine = common::engine_with(&opts, vec![echo], options).await;
    let w = common::spawn_worker(&engine);
    let first = engine.send(Event::new("ping", &1)).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, first).await.state, RunState::Completed);
    // Let the worker find the queue empty and settle into its 10-minute wait
    // (were it still claiming, the run below would start anyway: the test
    // would then pass without exercising the wake-up, never fail).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = engine.send_batch(vec![Event::new("ping", &2), Event::new("ping", &3)]).await.unwrap();
    for (receipt, n) in later.iter().zip([2, 3]) {
        // Waits up to common::DEADLINE (15 s), far below the poll.
        let run = common::finished(&engine, receipt.run_ids[0]).await;
        assert_eq!(run.state, RunState::Completed, "{run:?}");
        assert_eq!(run.output, Some(json!(n)));
        assert!(
            !common::handed_by_its_send(&engine, receipt.run_ids[0], receipt.event_id).await,
            "a batch handed a run on"
        );
    }
    w.stop().await;
}

/// How many calls of `durastep.send_events_full` (the fan-out with debounce,
/// singletons, `cancel_on` and waits) the session has counted and not yet
/// reported (`pg_stat_xact_user_functions`: at least the current
/// transaction's): compare before and after a send.
async fn full_sends(conn: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_xact_user_functions
          WHERE schemaname = 'durastep' AND funcname = 'send_events_full'",
    )
    .fetch_one(&mut *conn)
    .await
    .unwrap()
}

/// Catches: a send of a plain event that pays for the full fan-out statement
/// (twice the lean one, migration 0023), and a send that needs it (a
/// debounced function, a wait for the name) taking the lean branch instead.
/// The function-call counts of the current transaction say which ran.
#[sqlx::test(migrations = false)]
async fn a_plain_send_takes_the_lean_branch_and_the_others_the_full_one(_p: PgPoolOptions, opts: PgConnectOptions) {
    let echo = |_ctx: Ctx, v: Value| async move { Ok(v) };
    let functions = vec![
        Function::new("plain").on_event("plain").handler(echo),
        Function::new("merged")
            .on_event("merged")
            .debounce(durastep::Debounce::new(Duration::from_secs(60)))
            .handler(echo),
        Function::new("waiter").on_event("start").handler(|ctx: Ctx, _: Value| async move {
            let got: Option<Value> = ctx
                .wait_for_event("reply", durastep::WaitFor::event("reply").timeout(Duration::from_secs(3600)))
                .await?;
            Ok(got)
        }),
    ];
    let engine = common::engine(&opts, functions).await;
    // Topic rows exist once a name has been sent (or waited for).
    for name in ["plain", "merged", "reply"] {
        engine.send(Event::new(name, &0)).await.unwrap();
    }
    // Whether `name`'s send in `tx` took the full fan-out.
    async fn took_full(tx: &mut sqlx::PgConnection, name: &'static str) -> (bool, usize) {
        let before = full_sends(tx).await;
        let runs: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT run_ids FROM durastep.send_events(ARRAY[gen_random_uuid()], ARRAY[$1], ARRAY['1'],
                                                       ARRAY[NULL]::text[], ARRAY[NULL]::timestamptz[], ARRAY[0])",
        )
        .bind(name)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        (full_sends(tx).await > before, runs.len())
    }
    let mut tx = engine.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL track_functions = 'pl'").execute(&mut *tx).await.unwrap();
    assert_eq!(took_full(&mut tx, "plain").await, (false, 1), "a plain send took the full fan-out");
    assert_eq!(took_full(&mut tx, "merged").await, (true, 1), "a debounced send took the lean branch");
    assert_eq!(took_full(&mut tx, "reply").await, (false, 0), "no wait for `reply` yet: the lean branch");
    tx.rollback().await.unwrap();

    // Once a run waits for `reply`, a send of it resumes the wait: the full fan-out.
    let w = common::spawn_worker(&engine);
    let waiter = engine.send(Event::new("start", &0)).await.unwrap().run_ids[0];
    common::wait_for_run_where(&engine, waiter, "the run to wait", |r| r.state == RunState::Waiting).await;
    w.stop().await;
    let mut tx = engine.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL track_functions = 'pl'").execute(&mut *tx).await.unwrap();
    assert_eq!(took_full(&mut tx, "reply").await, (true, 0), "a send with a wait for its name took the lean branch");
    tx.commit().await.unwrap();
    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, waiter).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
}

/// Catches: a send through an engine whose worker waits idle that leaves its
/// run queued for a claim (the handoff of migration 0024 not taken), and a
/// handed run that does not run, or runs twice.
#[sqlx::test(migrations = false)]
async fn a_send_hands_its_run_to_an_idle_worker_of_its_process(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(
        &opts,
        vec![Function::new("echo").on_event("ping").handler(|_ctx: Ctx, v: Value| async move { Ok(v) })],
    )
    .await;
    let w = common::spawn_worker(&engine);
    common::send_until_handed(&engine, "ping").await;
    w.stop().await;
    common::assert_claimed_once_each(&engine).await;
}

/// Catches: a worker with functions of both claim classes (here one with a
/// concurrency limit, claimed by the full claim) that never offers its slots
/// to the sends of its process. It holds each class on its own and never as a
/// whole; until 40d4017 only a hold of the whole worker counted as idle, so
/// no run was ever handed to such a worker.
#[sqlx::test(migrations = false)]
async fn a_send_hands_its_run_to_an_idle_worker_with_both_claim_classes(_p: PgPoolOptions, opts: PgConnectOptions) {
    let echo = Function::new("echo").on_event("ping").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let limited = Function::new("limited")
        .on_event("limited")
        .concurrency(durastep::Concurrency::new(1))
        .handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let engine = common::engine(&opts, vec![echo, limited]).await;
    let w = common::spawn_worker(&engine);
    common::send_until_handed(&engine, "ping").await;
    w.stop().await;
}

/// Catches: a send that hands its new run to a worker while another run is
/// due (the new run would start before one that a claim takes first, G26).
/// Here the due run belongs to a function no worker runs, so it stays due.
#[sqlx::test(migrations = false)]
async fn a_send_does_not_hand_on_its_run_while_another_is_due(_p: PgPoolOptions, opts: PgConnectOptions) {
    let echo = |_ctx: Ctx, v: Value| async move { Ok(v) };
    let engine = common::engine(&opts, vec![Function::new("echo").on_event("ping").handler(echo)]).await;
    let elsewhere = common::engine(&opts, vec![Function::new("elsewhere").on_event("other").handler(echo)]).await;
    let w = common::spawn_worker(&engine);
    // The setup can hand runs on ...
    common::send_until_handed(&engine, "ping").await;
    // ... until a run is due that this worker does not take.
    let due = elsewhere.send(Event::new("other", &0)).await.unwrap().run_ids[0];
    for i in 0..10 {
        let receipt = engine.send(Event::new("ping", &json!({"i": i}))).await.unwrap();
        let run = common::finished(&engine, receipt.run_ids[0]).await;
        assert_eq!(run.output, Some(json!({"i": i})), "{run:?}");
        assert!(
            !common::handed_by_its_send(&engine, receipt.run_ids[0], receipt.event_id).await,
            "send {i} handed its run on while run {due} was due"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    w.stop().await;
    assert_eq!(engine.run(due).await.unwrap().state, RunState::Queued);
}

/// Catches: a handing send that inserts its event and runs in its lean
/// statement although a run waits for the event's name (since migration
/// 0046 that check sits in the inserting statement, whose snapshot is taken
/// after the topic row's lock): the wait would not be resumed, or the full
/// path that resumes it would then find the event stored already and report
/// it as a duplicate.
#[sqlx::test(migrations = false)]
async fn a_handing_send_leaves_a_name_with_a_wait_to_the_full_path(_p: PgPoolOptions, opts: PgConnectOptions) {
    let echo = |_ctx: Ctx, v: Value| async move { Ok(v) };
    let functions = vec![
        Function::new("echo").on_event("ping").handler(echo),
        Function::new("waiter").on_event("start").handler(|ctx: Ctx, _: Value| async move {
            let got: Option<Value> =
                ctx.wait_for_event("ping", durastep::WaitFor::event("ping").timeout(Duration::from_secs(3600))).await?;
            Ok(got)
        }),
    ];
    let engine = common::engine(&opts, functions).await;
    let w = common::spawn_worker(&engine);
    let waiter = engine.send(Event::new("start", &0)).await.unwrap().run_ids[0];
    common::wait_for_run_where(&engine, waiter, "the run to wait", |r| r.state == RunState::Waiting).await;
    w.stop().await;
    let (ids, versions) = handled_versions(&engine).await;
    let event = uuid::Uuid::new_v4();
    let rows: Vec<HandingAnswer> = sqlx::query_as(
        "SELECT sent_inserted, sent_n, sent_run_ids, id, lease_epoch
           FROM durastep.send_event_to_worker($1, 'ping', '{\"n\": 1}', NULL, 0, gen_random_uuid(), 30, $2, $3, 1)",
    )
    .bind(event)
    .bind(&ids)
    .bind(&versions)
    .fetch_all(engine.pool())
    .await
    .unwrap();
    assert!(rows[0].0, "the new event was reported as a duplicate: {rows:?}");
    assert_eq!(rows[0].2.len(), 1, "one run of `echo`: {rows:?}");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM durastep.events WHERE id = $1")
        .bind(event)
        .fetch_one(engine.pool())
        .await
        .unwrap();
    assert_eq!(stored, 1);
    let resumed = engine.run(waiter).await.unwrap();
    assert_eq!(resumed.state, RunState::Queued, "the wait for `ping` was not resumed: {resumed:?}");
}

/// Catches: a handing send whose "is anything else due" check scans the
/// runs table. It must read the first entries of `runs_next_due` whatever
/// the number of runs waiting for a later time (the generic plan of a
/// `NOT EXISTS (... run_at <= now)` expected a third of the table to match
/// and scanned all of it: 6 ms per send with 50,000 sleeping runs).
#[sqlx::test(migrations = false)]
async fn a_handing_send_probes_the_due_index_not_the_table(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(
        &opts,
        vec![Function::new("echo").on_event("ping").handler(|_ctx: Ctx, v: Value| async move { Ok(v) })],
    )
    .await;
    // 5,000 runs due in a month, and nothing due now.
    let later = engine.inspect().db_now().await.unwrap() + chrono::Duration::days(30);
    let events: Vec<Event> = (0..5000).map(|i| Event::new("ping", &i).start_at(later)).collect();
    for chunk in events.chunks(1000) {
        engine.send_batch(chunk.to_vec()).await.unwrap();
    }
    let mut tx = engine.pool().begin().await.unwrap();
    sqlx::query("ANALYZE durastep.runs").execute(&mut *tx).await.unwrap();
    let version: i32 = sqlx::query_scalar("SELECT version FROM durastep.functions WHERE id = 'echo'")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    let before = runs_seq_scans(&mut tx).await;
    let handed: Option<uuid::Uuid> = sqlx::query_scalar(
        "SELECT id FROM durastep.send_event_to_worker(gen_random_uuid(), 'ping', '1', NULL, 0, gen_random_uuid(), 30,
                                                    ARRAY['echo'], ARRAY[$1], 1)",
    )
    .bind(version)
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    let after = runs_seq_scans(&mut tx).await;
    tx.rollback().await.unwrap();
    assert!(handed.is_some(), "nothing else was due: the run should have been handed on");
    assert_eq!(after - before, 0, "the handing send scanned durastep.runs");
}

/// One row of `send_event_to_worker`'s answer: whether the event was new,
/// whether the workers were not notified, the new runs, and a run handed on
/// with its epoch (none in a row without one).
type HandingAnswer = (bool, bool, Vec<uuid::Uuid>, Option<uuid::Uuid>, Option<i64>);

/// Catches: a handing send that inserts its run `queued` and then claims it
/// by an UPDATE (0024: a second row version with an entry in every index of
/// `runs`), instead of inserting it claimed (0025); and one that hands on
/// more runs than the worker has free slots, skips the claim's writes
/// (lease, worker, start time, history row) or notifies the workers when it
/// handed on every new run.
#[sqlx::test(migrations = false)]
async fn a_handing_send_inserts_its_run_claimed(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, two_functions()).await;
    // The first send of a name creates its topic row (the full fan-out);
    // this one is due in a day, so nothing is due now.
    let later = engine.inspect().db_now().await.unwrap() + chrono::Duration::days(1);
    engine.send(Event::new("order/placed", &0).start_at(later)).await.unwrap();
    let worker = uuid::Uuid::new_v4();
    let (ids, versions) = handled_versions(&engine).await;
    // One slot (rolled back: its queued run would be due for the next send),
    // two slots (kept), and the same idempotency key again.
    for (slots, idem) in [(1, "one-slot"), (2, "two-slots"), (2, "two-slots")] {
        let mut tx = engine.pool().begin().await.unwrap();
        // Read before and after: on a reused connection the counters may still
        // hold an earlier transaction's rows until they are flushed.
        let before = runs_writes(&mut tx).await;
        let rows: Vec<HandingAnswer> = sqlx::query_as(
            "SELECT sent_inserted, sent_n, sent_run_ids, id, lease_epoch
               FROM durastep.send_event_to_worker(gen_random_uuid(), 'order/placed', '{}', $1, 0, $2, 30, $3, $4, $5)",
        )
        .bind(idem)
        .bind(worker)
        .bind(&ids)
        .bind(&versions)
        .bind(slots)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        let after = runs_writes(&mut tx).await;
        let (ins, upd) = (after.0 - before.0, after.1 - before.1);
        let (inserted, not_notified, run_ids) = (rows[0].0, rows[0].1, rows[0].2.clone());
        let handed: Vec<(uuid::Uuid, i64)> = rows.iter().filter_map(|r| Some((r.3?, r.4?))).collect();
        if !inserted {
            // The same idempotency key again: no run, none handed on.
            assert_eq!((run_ids.len(), handed.len(), ins), (0, 0, 0), "{rows:?}");
            tx.rollback().await.unwrap();
            continue;
        }
        assert_eq!((ins, upd), (2, 0), "{slots} slots: the runs must be inserted claimed, not updated");
        assert_eq!(handed.len(), slots as usize, "{rows:?}");
        assert_eq!(not_notified, slots == 2, "notified although every run was handed on, or not at all: {rows:?}");
        let states: Vec<(uuid::Uuid, String, Option<uuid::Uuid>, i64, bool, bool)> = sqlx::query_as(
            "SELECT id, state, worker_id, lease_epoch,
                    lease_expires_at IS NOT DISTINCT FROM started_at + interval '30 seconds',
                    (SELECT count(*) FROM durastep.run_timeline h
                      WHERE h.run_id = r.id AND h.state = 'running' AND h.worker_id IS NOT DISTINCT FROM r.worker_id
                        AND h.lease_epoch = r.lease_epoch) = 1
               FROM durastep.runs r WHERE r.id = ANY ($1) ORDER BY id",
        )
        .bind(&run_ids)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
        for (id, state, by, epoch, leased, noted) in states {
            match handed.iter().find(|(h, _)| *h == id) {
                Some((_, e)) => assert!(
                    state == "running" && by == Some(worker) && epoch == *e && epoch > 0 && leased && noted,
                    "handed run {id}: {state} {by:?} {epoch} {leased} {noted}"
                ),
                None => assert!(state == "queued" && by.is_none() && epoch == 0, "queued run {id}: {state} {by:?}"),
            }
        }
        if slots == 1 {
            tx.rollback().await.unwrap();
        } else {
            tx.commit().await.unwrap();
        }
    }
}

/// Catches: a handing send whose answer does not name the claim record of
/// the runs it handed on (migration 0035), on either of its paths: the run
/// inserted running (the name's topic row exists) and the run inserted
/// queued, then claimed (no topic row yet: `send_event_to_worker_by_claim`).
/// Without the id, the worker cannot delete the record when the runs end,
/// and it stays until its lease has passed.
#[sqlx::test(migrations = false)]
async fn a_handing_send_names_its_claim_record(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, two_functions()).await;
    let worker = uuid::Uuid::new_v4();
    let (ids, versions) = handled_versions(&engine).await;
    for path in ["by claim (no topic row yet)", "inserted running"] {
        let rows: Vec<(Option<uuid::Uuid>, Option<i64>, Option<i64>)> = sqlx::query_as(
            "SELECT id, lease_epoch, claim
               FROM durastep.send_event_to_worker(gen_random_uuid(), 'order/placed', '{}', NULL, 0, $1, 30, $2, $3, 2)",
        )
        .bind(worker)
        .bind(&ids)
        .bind(&versions)
        .fetch_all(engine.pool())
        .await
        .unwrap();
        let handed: Vec<(uuid::Uuid, i64)> = rows.iter().filter_map(|r| Some((r.0?, r.1?))).collect();
        assert_eq!(handed.len(), 2, "{path}: {rows:?}");
        let claim = rows[0].2.unwrap_or_else(|| panic!("{path}: no claim record named: {rows:?}"));
        assert!(rows.iter().all(|r| r.2 == Some(claim)), "{path}: {rows:?}");
        let (mut listed, epochs): (Vec<uuid::Uuid>, Vec<i64>) =
            sqlx::query_as("SELECT run_ids, epochs FROM durastep.run_claims WHERE id = $1")
                .bind(claim)
                .fetch_one(engine.pool())
                .await
                .unwrap();
        let mut pairs: Vec<(uuid::Uuid, i64)> = listed.drain(..).zip(epochs).collect();
        pairs.sort();
        let mut expected = handed.clone();
        expected.sort();
        assert_eq!(pairs, expected, "{path}: the record named must list the runs handed on");
        // Finished, so that nothing is due for the next send.
        sqlx::query("UPDATE durastep.runs SET state = 'completed', finished_at = durastep.now() WHERE id = ANY ($1)")
            .bind(handed.iter().map(|h| h.0).collect::<Vec<_>>())
            .execute(engine.pool())
            .await
            .unwrap();
    }
}

/// Catches: a worker that leaves the claim record of the runs a send of its
/// process handed it to the reaper (before migration 0035 it was not told
/// which record that was): every reader of the running runs walks such a
/// record until its lease has passed. The lease (60 s) and the reaper (10
/// minutes) are too long here for the reaper to have deleted it.
#[sqlx::test(migrations = false)]
async fn the_worker_deletes_the_claim_record_of_runs_handed_to_it(_p: PgPoolOptions, opts: PgConnectOptions) {
    let options = durastep::WorkerOptions {
        lease: common::LONG_LEASE,
        reap_interval: Duration::from_secs(600),
        ..common::fast_options()
    };
    let echo = Function::new("echo").on_event("ping").handler(|_ctx: Ctx, v: Value| async move { Ok(v) });
    let engine = common::engine_with(&opts, vec![echo], options).await;
    let w = common::spawn_worker(&engine);
    common::send_until_handed(&engine, "ping").await;
    common::wait_until("the worker to delete every claim record", || {
        let engine = engine.clone();
        async move { common::count(&engine, "durastep.run_claims").await == 0 }
    })
    .await;
    w.stop().await;
}

/// The registered (function, version) pairs, as a worker that runs them all
/// passes them to the handing send.
async fn handled_versions(engine: &Engine) -> (Vec<String>, Vec<i32>) {
    sqlx::query_as::<_, (String, i32)>("SELECT id, version FROM durastep.functions ORDER BY id")
        .fetch_all(engine.pool())
        .await
        .unwrap()
        .into_iter()
        .unzip()
}

/// Rows of `durastep.runs` inserted and updated so far in this transaction.
async fn runs_writes(tx: &mut sqlx::PgConnection) -> (i64, i64) {
    sqlx::query_as(
        "SELECT n_tup_ins, n_tup_upd FROM pg_stat_xact_user_tables WHERE schemaname = 'durastep' AND relname = 'runs'",
    )
    .fetch_one(tx)
    .await
    .unwrap()
}

/// Sequential scans of `durastep.runs` so far in this transaction.
async fn runs_seq_scans(tx: &mut sqlx::PgConnection) -> i64 {
    sqlx::query_scalar(
        "SELECT seq_scan FROM pg_stat_xact_user_tables WHERE schemaname = 'durastep' AND relname = 'runs'",
    )
    .fetch_one(tx)
    .await
    .unwrap()
}

/// Every notification on `durastep_wakeup` that `listener` has received so
/// far: the callers' statements have committed, so each is on its way; a
/// second without one more ends the list (generous, so that a busy machine
/// does not cut it short).
async fn payloads(listener: &mut sqlx::postgres::PgListener) -> Vec<String> {
    let mut out = vec![];
    while let Ok(n) = tokio::time::timeout(Duration::from_secs(1), listener.recv()).await {
        out.push(n.expect("a notification").payload().to_owned());
    }
    out
}

/// Catches: a path that makes runs due and wakes every worker (an empty
/// payload: every class of every worker claims) instead of naming the
/// functions of those runs (migration 0028), and a payload that names a
/// function none of whose runs it made due. Runs every such path but the
/// test clock: the lean send, the full fan-out (a flow-limited function, a
/// name with two functions), runs released by flow control, a failure
/// handler's run, a child that makes its parent due, a child started by
/// invoke, a run given back at shutdown, a replay and a diverged run
/// resumed. Also: the payload's rule
/// in `durastep.wake_workers` (sorted, each once, NULLs dropped, nothing sent
/// for none, empty over 7,000 bytes).
#[sqlx::test(migrations = false)]
async fn every_wake_up_names_the_functions_of_the_runs_it_made_due(_p: PgPoolOptions, opts: PgConnectOptions) {
    let limited = Function::new("limited").on_event("limited").concurrency(durastep::Concurrency::new(1)).handler(
        |ctx: Ctx, _: Value| async move {
            ctx.step("a", || async { Ok(()) }).await?;
            Ok(())
        },
    );
    let pair = ["pair-a", "pair-b"]
        .map(|id| Function::new(id).on_event("pair").handler(|_ctx: Ctx, _: Value| async move { Ok(()) }));
    let failing = Function::new("failing")
        .on_event("fail")
        .on_failure(|_ctx: Ctx, _failed: durastep::FailedRun<Value>| async { Ok(()) })
        .handler(|_ctx: Ctx, _: Value| async move { Err::<(), _>(durastep::HandlerError::permanent("no")) });
    let parent = Function::new("parent").on_event("parent").handler(|ctx: Ctx, _: Value| async move {
        let out: Result<u64, durastep::ChildError> = ctx
            .invoke("child", durastep::Invoke::function("child").input(&1u64).timeout(Duration::from_secs(60)))
            .await?;
        Ok(out.is_ok())
    });
    let child = Function::new("child").handler(|_ctx: Ctx, n: u64| async move { Ok(n) });
    let plain = Function::new("plain").on_event("plain").handler(|_ctx: Ctx, _: Value| async move { Ok(()) });
    let stuck = Function::new("stuck").on_event("stuck").handler(|_ctx: Ctx, _: Value| async move {
        std::future::pending::<()>().await;
        Ok(())
    });
    let [a, b] = pair;
    let functions = vec![limited, a, b, failing, parent, child, plain, stuck];
    let worker = durastep::WorkerOptions { shutdown_grace: Duration::from_millis(200), ..common::fast_options() };
    let engine = common::engine_with(&opts, functions, worker).await;
    let mut listener = sqlx::postgres::PgListener::connect_with(engine.pool()).await.unwrap();
    listener.listen("durastep_wakeup").await.unwrap();

    // Sends with no worker: the full fan-out (flow keys; two functions of one
    // name) and the lean send, each naming its functions.
    engine.send(Event::new("limited", &1)).await.unwrap();
    engine.send(Event::new("pair", &1)).await.unwrap();
    engine.send(Event::new("plain", &1)).await.unwrap();
    let sent = payloads(&mut listener).await;
    assert_eq!(sent, ["limited", "pair-a pair-b", "plain"]);
    // A batch through the full fan-out wakes once per statement, not once
    // per event (rolled back: nothing is sent).
    let mut tx = engine.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL track_functions = 'pl'").execute(&mut *tx).await.unwrap();
    sqlx::query(
        "SELECT * FROM durastep.send_events(
             ARRAY(SELECT gen_random_uuid() FROM generate_series(1, 5)), array_fill('limited'::text, ARRAY[5]),
             array_fill('1'::text, ARRAY[5]), array_fill(NULL::text, ARRAY[5]),
             array_fill(NULL::timestamptz, ARRAY[5]), array_fill(0, ARRAY[5]))",
    )
    .execute(&mut *tx)
    .await
    .unwrap();
    let calls: i64 = sqlx::query_scalar(
        "SELECT calls FROM pg_stat_xact_user_functions WHERE schemaname = 'durastep' AND funcname = 'wake_workers'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    assert_eq!(calls, 1, "durastep.wake_workers called per event of the batch");
    tx.rollback().await.unwrap();

    // The rest through a worker: a second run of the limited function parks
    // until the first ends (flow control makes it due again), a failure
    // starts a handler, a parent invokes its child and is made due by it.
    let ids = [
        engine.send(Event::new("limited", &2)).await.unwrap().run_ids[0],
        engine.send(Event::new("fail", &1)).await.unwrap().run_ids[0],
        engine.send(Event::new("parent", &1)).await.unwrap().run_ids[0],
    ];
    let w = common::spawn_worker(&engine);
    for id in ids {
        common::finished(&engine, id).await;
    }
    common::wait_until("the failure handler ran", || async {
        sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM durastep.runs WHERE function_id = 'failing/on-failure' AND state = 'completed')",
        )
        .fetch_one(engine.pool())
        .await
        .unwrap()
    })
    .await;
    w.stop().await;
    let seen = payloads(&mut listener).await;
    let known = ["limited", "pair-a", "pair-b", "plain", "failing", "failing/on-failure", "parent", "child"];
    for p in &seen {
        assert!(!p.is_empty(), "a wake-up naming no function: {seen:?}");
        assert!(
            p.split(' ').all(|f| known.contains(&f)),
            "a wake-up naming a function of no run it made due: {seen:?}"
        );
    }
    // The sends (the worker's own process also notifies), then each trigger's and invoke's.
    for f in ["limited", "failing", "parent", "failing/on-failure", "child"] {
        assert!(seen.iter().any(|p| p.split(' ').any(|n| n == f)), "no wake-up named {f}: {seen:?}");
    }

    // A run given back (here at the end of a graceful shutdown's grace; also
    // a run claimed ahead that found no slot) wakes the workers of its function.
    let id = engine.send(Event::new("stuck", &1)).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, id, "running", |r| r.state == RunState::Running).await;
    assert_eq!(payloads(&mut listener).await, ["stuck"]);
    w.stop().await;
    assert_eq!(engine.run(id).await.unwrap().state, RunState::Queued);

    // The admin actions: a replay names the functions of the runs it queued
    // again (the run not replayable is not named), and so does resuming a
    // diverged run (made so here by hand: no code change is needed for the
    // wake-up).
    let failed = ids[1];
    engine.replay(failed, durastep::ReplayFrom::Start).await.unwrap();
    assert!(engine.replay(id, durastep::ReplayFrom::Start).await.is_err(), "a queued run is not replayable");
    // (First the give-back of the stopped worker above.)
    assert_eq!(payloads(&mut listener).await, ["stuck", "failing"]);
    let parent_run = ids[2];
    sqlx::query("UPDATE durastep.runs SET state = 'diverged' WHERE id = $1")
        .bind(parent_run)
        .execute(engine.pool())
        .await
        .unwrap();
    engine.resume_diverged(parent_run).await.unwrap();
    assert_eq!(payloads(&mut listener).await, ["parent"]);

    // The payload's rule.
    let long = |i: usize| format!("{i:0>100}");
    for names in [
        vec![Some("b".to_owned()), None, Some("a".to_owned()), Some("b".to_owned())],
        vec![],
        vec![None],
        (0..70).map(|i| Some(long(i))).collect(),
        (0..69).map(|i| Some(long(i))).collect(),
    ] {
        sqlx::query("SELECT durastep.wake_workers($1)").bind(names).execute(engine.pool()).await.unwrap();
    }
    let rule = payloads(&mut listener).await;
    let sixty_nine = (0..69).map(long).collect::<Vec<_>>().join(" ");
    assert_eq!(sixty_nine.len(), 6968);
    assert_eq!(rule, ["a b".to_owned(), String::new(), sixty_nine]);
}

/// Catches: a lean send (migration 0027, the common path, which writes its
/// NOTIFY inline rather than through `durastep.wake_workers`) whose payload
/// breaks Postgres's limit of 8,000 bytes (the send would fail) or is cut
/// (a cut id names another function, or none). A list of up to 7,000 bytes
/// goes whole and sorted; a longer one goes empty (every class wakes).
#[sqlx::test(migrations = false)]
async fn a_lean_send_names_its_functions_up_to_7000_bytes(_p: PgPoolOptions, opts: PgConnectOptions) {
    // Ids of 100 bytes: 69 of them with their spaces are 6,968 bytes, 70 are 7,069.
    let id = |name: &str, i: usize| format!("{name}-{i:0>95}");
    let mut functions = vec![];
    for (name, n) in [("wide", 70), ("near", 69)] {
        for i in 0..n {
            let f = Function::new(id(name, i)).on_event(name);
            functions.push(f.handler(|_ctx: Ctx, _: Value| async move { Ok(()) }));
        }
    }
    let engine = common::engine(&opts, functions).await;
    // The first send of a name takes the full fan-out (it creates the topic row).
    for name in ["wide", "near"] {
        engine.send(Event::new(name, &0)).await.unwrap();
    }
    let mut listener = sqlx::postgres::PgListener::connect_with(engine.pool()).await.unwrap();
    listener.listen("durastep_wakeup").await.unwrap();
    // Both sends in one transaction that counts its function calls: neither
    // calls the full fan-out. Their NOTIFYs arrive at the commit, in order.
    let mut tx = engine.pool().begin().await.unwrap();
    sqlx::query("SET LOCAL track_functions = 'pl'").execute(&mut *tx).await.unwrap();
    for (name, n) in [("wide", 70), ("near", 69)] {
        let runs: Vec<uuid::Uuid> = sqlx::query_scalar(
            "SELECT run_ids FROM durastep.send_events(ARRAY[gen_random_uuid()], ARRAY[$1], ARRAY['1'],
                                                       ARRAY[NULL]::text[], ARRAY[NULL]::timestamptz[], ARRAY[0])",
        )
        .bind(name)
        .fetch_one(&mut *tx)
        .await
        .unwrap();
        assert_eq!(runs.len(), n);
    }
    assert_eq!(full_sends(&mut tx).await, 0, "a send took the full fan-out, not the lean one");
    tx.commit().await.unwrap();
    let near = (0..69).map(|i| id("near", i)).collect::<Vec<_>>().join(" ");
    assert_eq!(near.len(), 6_968);
    assert_eq!(payloads(&mut listener).await, [String::new(), near]);
}
