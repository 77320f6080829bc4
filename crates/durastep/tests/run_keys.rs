//! Each run's (event, function) key lives in `durastep.run_keys` (migration
//! 0042), written once when the run is inserted, instead of in a unique index
//! of `runs` that every claim and completion wrote a new entry into. What the
//! index and the foreign key to `events` did must still hold: one run per
//! function per event, the runs of an event found without reading every run,
//! a debounced run found under its newest event, and deleted events taking
//! their runs along.
mod common;

use std::time::Duration;

use durastep::inspect::{EventFilter, RunFilter};
use durastep::{Ctx, Engine, Event, Function, RunState};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

fn plain() -> Function {
    Function::new("plain").on_event("go").handler(|ctx: Ctx, v: Value| async move {
        ctx.step("one", || async move { Ok(1) }).await?;
        Ok(v)
    })
}

/// The keys of `durastep.run_keys`: (event, function, run), in event order.
async fn keys(engine: &Engine) -> Vec<(Uuid, String, Uuid)> {
    sqlx::query_as("SELECT event_id, function_id, run_id FROM durastep.run_keys ORDER BY event_id, function_id")
        .fetch_all(engine.pool())
        .await
        .expect("run keys")
}

async fn event_of(engine: &Engine, run: Uuid) -> Uuid {
    sqlx::query_scalar("SELECT event_id FROM durastep.runs WHERE id = $1")
        .bind(run)
        .fetch_one(engine.pool())
        .await
        .expect("the run's event")
}

/// Catches: runs no longer unique per (event, function) once the unique
/// index of `runs` is gone (the trigger that keys new runs missing or not
/// firing for every insert), and a refused insert that leaves anything
/// behind. A second run for a stored event's function, and two runs of one
/// function for a new event in one statement, are both refused with a
/// unique violation on `run_keys_pkey`.
#[sqlx::test(migrations = false)]
async fn a_second_run_of_a_function_for_an_event_is_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, vec![plain()]).await;
    let sent = engine.send(Event::new("go", &json!({"n": 1}))).await.expect("send");
    assert_eq!(sent.run_ids.len(), 1);
    let insert = |n: i32, event: Uuid| {
        sqlx::query(
            "INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts)
             SELECT durastep.uuid7(), 'plain', $2, 'queued', durastep.now(), 1 FROM generate_series(1, $1)",
        )
        .bind(n)
        .bind(event)
        .execute(engine.pool())
    };
    let fresh = Uuid::now_v7();
    for (what, result) in
        [("a second run", insert(1, sent.event_id).await), ("two runs at once", insert(2, fresh).await)]
    {
        let err = result.expect_err(what);
        let db = err.as_database_error().expect("a database error");
        assert!(db.is_unique_violation(), "{what}: {err}");
        assert_eq!(db.constraint(), Some("run_keys_pkey"), "{what}: {err}");
    }
    assert_eq!(common::count(&engine, "durastep.runs").await, 1);
    assert_eq!(keys(&engine).await, vec![(sent.event_id, "plain".to_owned(), sent.run_ids[0])]);
    // One run per event is still allowed, for any event.
    insert(1, fresh).await.expect("one run for a new event");
    assert_eq!(keys(&engine).await.len(), 2);
}

/// Catches: a send whose fan-out inserts runs in several parts of one
/// statement (the full fan-out's plain, debounced and singleton inserts are
/// three CTEs) keying them more than once or not at all. Postgres gathers
/// the rows of every insert of a statement into one transition table and
/// fires the statement trigger once (docs/architecture.md "The run's key in
/// a table of its own"); if it fired once per insert with the shared table,
/// the second firing would insert the same keys again and fail the send.
/// One event triggers a plain, a debounced and a singleton function: three
/// runs, each with its one key. A second event of the same key then inserts
/// a plain run, a skipped singleton run (a fourth insert) and moves the
/// debounced run to itself, in one statement: five runs, five keys, the
/// debounced run's under the second event.
#[sqlx::test(migrations = false)]
async fn a_fan_out_s_runs_are_keyed_once_each(_p: PgPoolOptions, opts: PgConnectOptions) {
    let handler = |_ctx: Ctx, v: Value| async move { Ok(v) };
    let functions = vec![
        Function::new("plain").on_event("go").handler(handler),
        Function::new("debounced")
            .on_event("go")
            .debounce(durastep::Debounce::new(Duration::from_secs(10)).key("/k"))
            .handler(handler),
        Function::new("single")
            .on_event("go")
            .singleton(durastep::Singleton::new(durastep::SingletonMode::SkipNew).key("/k"))
            .handler(handler),
    ];
    let engine = common::engine(&opts, functions).await;
    let first = engine.send(Event::new("go", &json!({"k": "a"}))).await.expect("send");
    assert_eq!(first.run_ids.len(), 3, "{first:?}");
    let run = |f: &'static str, n: usize| {
        let engine = engine.clone();
        async move {
            let runs = common::runs_of(&engine, f).await;
            assert_eq!(runs.len(), n, "{f}: {runs:?}");
            runs
        }
    };
    let (d, p, s) = (run("debounced", 1).await, run("plain", 1).await, run("single", 1).await);
    let key = |e: Uuid, f: &str, r: Uuid| (e, f.to_owned(), r);
    let expected = vec![
        key(first.event_id, "debounced", d[0]),
        key(first.event_id, "plain", p[0]),
        key(first.event_id, "single", s[0]),
    ];
    assert_eq!(keys(&engine).await, expected);

    let second = engine.send(Event::new("go", &json!({"k": "a"}))).await.expect("send");
    assert_eq!(second.run_ids.len(), 3, "{second:?}");
    let (p, s) = (run("plain", 2).await, run("single", 2).await);
    assert_eq!(run("debounced", 1).await, d, "the debounced run merged the second event");
    let expected = vec![
        key(first.event_id, "plain", p[0]),
        key(first.event_id, "single", s[0]),
        key(second.event_id, "debounced", d[0]),
        key(second.event_id, "plain", p[1]),
        key(second.event_id, "single", s[1]),
    ];
    assert_eq!(keys(&engine).await, expected);
}

/// Catches: a debounced run's key left under the event it was created for
/// when a later event of its key takes it over (the upsert sets the run's
/// `event_id`): its newest event would count no run and its first event one,
/// and the first event could never be pruned. Three events of one key make
/// one run; its only key names the third event, which counts the run; the
/// first two count none, as before migration 0042.
#[sqlx::test(migrations = false)]
async fn a_debounced_run_s_key_follows_it_to_its_newest_event(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("resync")
        .on_event("changed")
        .debounce(durastep::Debounce::new(Duration::from_secs(10)).key("/k").max_wait(Duration::from_secs(60)))
        .handler(|_ctx: Ctx, e: Value| async move { Ok(e["n"].clone()) });
    let engine = common::engine(&opts, vec![f]).await;
    let mut events = Vec::new();
    for n in 1..=3 {
        let sent = engine.send(Event::new("changed", &json!({"k": "a", "n": n}))).await.expect("send");
        events.push(sent.event_id);
    }
    let run = common::runs_of(&engine, "resync").await;
    assert_eq!(run.len(), 1, "one debounced run: {run:?}");
    let run = run[0];
    assert_eq!(event_of(&engine, run).await, events[2], "the run carries the newest event");
    assert_eq!(keys(&engine).await, vec![(events[2], "resync".to_owned(), run)]);
    let page = engine.inspect().events(&EventFilter::new().name("changed")).await.expect("events");
    let counts: Vec<(Uuid, i64)> = page.events.iter().map(|e| (e.id, e.runs)).collect();
    assert_eq!(counts, vec![(events[2], 1), (events[1], 0), (events[0], 0)], "runs per event, newest first");
}

/// Catches: events deleted (or truncated) without their runs once the
/// foreign key's `ON DELETE CASCADE` is gone: the runs would stay, claimable,
/// with no input, and their step rows and keys with them. Deleting one event
/// takes its run, the run's step rows and its key, and leaves the other
/// event's; a TRUNCATE of events takes the rest.
#[sqlx::test(migrations = false)]
async fn deleted_events_take_their_runs_along(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, vec![plain()]).await;
    let worker = common::spawn_worker(&engine);
    let first = engine.send(Event::new("go", &json!({"n": 1}))).await.expect("send");
    let second = engine.send(Event::new("go", &json!({"n": 2}))).await.expect("send");
    for sent in [&first, &second] {
        assert_eq!(common::finished(&engine, sent.run_ids[0]).await.state, RunState::Completed);
    }
    worker.stop().await;
    assert_eq!(common::count(&engine, "durastep.step_results").await, 2);

    sqlx::query("DELETE FROM durastep.events WHERE id = $1")
        .bind(first.event_id)
        .execute(engine.pool())
        .await
        .expect("delete an event");
    let runs: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM durastep.runs").fetch_all(engine.pool()).await.expect("runs");
    assert_eq!(runs, vec![second.run_ids[0]], "the deleted event's run is gone, the other kept");
    let steps: Vec<Uuid> = sqlx::query_scalar("SELECT run_id FROM durastep.step_results")
        .fetch_all(engine.pool())
        .await
        .expect("step rows");
    assert_eq!(steps, vec![second.run_ids[0]], "the deleted run's step rows are gone");
    assert_eq!(keys(&engine).await, vec![(second.event_id, "plain".to_owned(), second.run_ids[0])]);

    sqlx::query("TRUNCATE durastep.events CASCADE").execute(engine.pool()).await.expect("truncate events");
    for table in ["durastep.runs", "durastep.run_keys", "durastep.step_results"] {
        assert_eq!(common::count(&engine, table).await, 0, "{table} after a TRUNCATE of events");
    }
}

/// Catches: a read of an event's runs that scans `runs` now that no index of
/// it names `event_id` (the statement not going through `run_keys`): the
/// duplicate answer of an idempotent send, an event's run count, and a
/// listing of the runs of one idempotency key among 5,000. Each of them
/// would read all 5,000 rows by a sequential scan; the statistics count the
/// rows such scans read. The reads go through an engine with one
/// connection, whose statistics the test flushes before it reads them.
#[sqlx::test(migrations = false)]
async fn an_event_s_runs_are_found_by_their_keys(_p: PgPoolOptions, opts: PgConnectOptions) {
    const RUNS: usize = 5_000;
    let engine = common::engine(&opts, vec![plain()]).await;
    let seed: Vec<Event> =
        (0..RUNS).map(|i| Event::new("go", &json!({"n": i})).idempotency_key(format!("seed-{i}"))).collect();
    let mut sent = Vec::new();
    for chunk in seed.chunks(1000) {
        sent.extend(engine.send_batch(chunk.to_vec()).await.expect("seed runs"));
    }
    sqlx::query("ANALYZE durastep.runs, durastep.run_keys, durastep.events")
        .execute(engine.pool())
        .await
        .expect("analyze");
    let one = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.expect("connect");
    let reader = Engine::builder().pool(one.clone()).function(plain()).build().await.expect("reader engine");
    let before = common::runs_seq_reads(&one).await;

    let again = reader.send(Event::new("go", &json!({"n": 42})).idempotency_key("seed-42")).await.expect("send");
    assert!(again.duplicate);
    assert_eq!(again.run_ids, sent[42].run_ids, "the duplicate names the first send's run");
    let listed = reader.inspect().runs(&RunFilter::new().idempotency_key("seed-4242")).await.expect("runs");
    let ids: Vec<Uuid> = listed.runs.iter().map(|r| r.id).collect();
    assert_eq!(ids, sent[4242].run_ids, "the runs of one idempotency key");
    let events = reader.inspect().events(&EventFilter::new().name("go").limit(10)).await.expect("events");
    assert!(events.events.iter().all(|e| e.runs == 1), "one run per event");

    let read = common::runs_seq_reads(&one).await - before;
    assert!(read < RUNS as i64, "sequential scans read {read} rows of durastep.runs ({RUNS} runs)");
}
