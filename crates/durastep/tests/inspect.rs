//! The inspection API: run detail (history, executions, step timeline),
//! listings with filters and pagination, counts, blockers ("why is it not
//! running"), replay (from the failed step, from the start, in bulk) and pruning.
mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::inspect::{AttemptOutcome, BlockerKind, EventFilter, RunFilter, StepStatus, Why};
use durastep::{Backoff, Ctx, Engine, Error, Event, Function, HandlerError, ReplayFrom, RunState, WorkerOptions};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

fn bump(n: &AtomicU32) -> u32 {
    n.fetch_add(1, Ordering::SeqCst) + 1
}

/// A function with steps `fetch` and `push`; `push` fails while `fail_push` says so.
fn two_steps(id: &str, fetches: Arc<AtomicU32>, pushes: Arc<AtomicU32>, failing: Arc<AtomicU32>) -> Function {
    Function::new(id).on_event(format!("{id}/go")).retries(2).backoff(Backoff::Fixed(Duration::from_secs(10))).handler(
        move |ctx: Ctx, _: Value| {
            let (fetches, pushes, failing) = (fetches.clone(), pushes.clone(), failing.clone());
            async move {
                let token: String = ctx
                    .step("fetch", || async {
                        bump(&fetches);
                        Ok("tok".to_owned())
                    })
                    .await?;
                ctx.step("push", || async {
                    let n = bump(&pushes);
                    if failing.load(Ordering::SeqCst) >= n {
                        return Err(HandlerError::new(format!("503 number {n}")));
                    }
                    Ok(format!("pushed with {token}"))
                })
                .await
            }
        },
    )
}

/// Catches: a history that misses a transition, executions that do not pair
/// claims with their ends, or a step timeline that loses the failed attempt.
#[sqlx::test(migrations = false)]
async fn run_detail_shows_history_executions_and_step_timeline(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (fetches, pushes, failing) = (Arc::default(), Arc::default(), Arc::new(AtomicU32::new(1)));
    let engine = common::engine(&opts, vec![two_steps("detail", fetches, pushes, failing)]).await;
    let id = engine.send(Event::new("detail/go", &json!({"account": "a1"}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, id, "attempt 2 queued", |r| r.attempt == 2 && r.state == RunState::Queued)
        .await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(11)).await.unwrap();
    let run = common::finished(&engine, id).await;
    assert_eq!(run.state, RunState::Completed);
    w.stop().await;

    let d = engine.inspect().run(id).await.unwrap();
    assert_eq!(d.event.name, "detail/go");
    assert_eq!(d.event.data, json!({"account": "a1"}));
    let states = timeline_states(&d);
    assert_eq!(states, [RunState::Running, RunState::Queued, RunState::Running, RunState::Completed]);
    assert_eq!(d.history[1].error.as_deref(), Some("step push: 503 number 1"));
    assert_eq!(d.history[1].step.as_deref(), Some("push"));
    assert!(d.history[0].worker_id.is_some());
    let outcomes: Vec<AttemptOutcome> = d.attempts.iter().map(|a| a.outcome).collect();
    assert_eq!(outcomes, [AttemptOutcome::Retried, AttemptOutcome::Completed]);
    assert_eq!((d.attempts[0].attempt, d.attempts[1].attempt), (1, 2));
    assert_eq!(d.attempts[0].failed_step.as_deref(), Some("push"));
    assert!(d.attempts[1].started_at >= d.attempts[0].ended_at.unwrap() + chrono::Duration::seconds(10));

    let names: Vec<&str> = d.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["fetch", "push"]);
    let (fetch, push) = (&d.steps[0], &d.steps[1]);
    assert_eq!((fetch.status, fetch.attempts, fetch.attempt), (StepStatus::Completed, 1, Some(1)));
    assert_eq!((push.status, push.attempts, push.attempt), (StepStatus::Completed, 2, Some(2)));
    assert_eq!(push.output, Some(json!("pushed with tok")));
    assert!(fetch.started_at.is_some() && fetch.duration.is_some());
    assert!(push.started_at.unwrap() >= fetch.finished_at.unwrap());
    assert!(d.blocker.is_none());
    assert_eq!(engine.inspect().why(id).await.unwrap(), Why::Finished { state: RunState::Completed, reason: None });
}

/// Catches: a replay that re-runs finished steps (FailedStep), one that keeps
/// them (Start), a replay of a run that is not dead, or a bad id accepted.
#[sqlx::test(migrations = false)]
async fn replay_resumes_at_the_failed_step_or_from_the_start(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (fetches, pushes) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let failing = Arc::new(AtomicU32::new(u32::MAX));
    let f = two_steps("replayed", fetches.clone(), pushes.clone(), failing.clone());
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("replayed/go", &json!({}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    for attempt in 2..=3 {
        common::wait_for_run_where(&engine, id, "next attempt", |r| {
            r.attempt == attempt && r.state == RunState::Queued
        })
        .await;
        durastep::testing::advance_clock(&engine, Duration::from_secs(11)).await.unwrap();
    }
    let dead = common::finished(&engine, id).await;
    assert_eq!((dead.state, dead.attempt), (RunState::Failed, 3));
    let d = engine.inspect().run(id).await.unwrap();
    let push = d.steps.iter().find(|s| s.name == "push").unwrap();
    assert_eq!((push.status, push.attempts), (StepStatus::Failed, 3));
    assert_eq!(push.error.as_deref(), Some("step push: 503 number 3"));
    assert_eq!(d.attempts.last().unwrap().outcome, AttemptOutcome::Failed);

    // Fixed: replay from the failed step. `fetch` is not executed again.
    failing.store(0, Ordering::SeqCst);
    let queued = engine.replay(id, ReplayFrom::FailedStep).await.unwrap();
    assert_eq!((queued.state, queued.attempt, queued.max_attempts), (RunState::Queued, 4, 6));
    let run = common::finished(&engine, id).await;
    assert_eq!(run.state, RunState::Completed);
    assert_eq!((fetches.load(Ordering::SeqCst), pushes.load(Ordering::SeqCst)), (1, 4));

    // Not dead: refused, left as it was.
    let err = engine.replay(id, ReplayFrom::FailedStep).await.unwrap_err();
    assert!(matches!(err, Error::NotReplayable { run_id, .. } if run_id == id), "{err}");
    assert_eq!(engine.run(id).await.unwrap().state, RunState::Completed);
    let unknown = uuid::Uuid::new_v4();
    assert!(matches!(engine.replay(unknown, ReplayFrom::Start).await, Err(Error::UnknownRun(u)) if u == unknown));

    // From the start: a cancelled run re-runs every step.
    let id2 = engine.send(Event::new("replayed/go", &json!({}))).await.unwrap().run_ids[0];
    common::finished(&engine, id2).await;
    let (f0, p0) = (fetches.load(Ordering::SeqCst), pushes.load(Ordering::SeqCst));
    sqlx::query("UPDATE durastep.runs SET state = 'cancelled' WHERE id = $1")
        .bind(id2)
        .execute(engine.pool())
        .await
        .unwrap();
    engine.replay(id2, ReplayFrom::Start).await.unwrap();
    assert_eq!(common::finished(&engine, id2).await.state, RunState::Completed);
    assert_eq!((fetches.load(Ordering::SeqCst), pushes.load(Ordering::SeqCst)), (f0 + 1, p0 + 1));
    w.stop().await;
}

/// A replay from the start is new ground: it deletes the run's journal with
/// its step results, so the run runs today's code from the beginning. v1
/// invoked a child at position 0 (its entry in `step_journal`) and ran a
/// step after it; v2 only runs the step. Replayed from the start under v2,
/// the run completes on v2's path, and its journal is that path alone.
/// Catches: a replay from the start that keeps the journal (the run parks
/// `diverged` at position 0: recorded the invoke, asked step `a`), although
/// no stored result is left that a changed path could be handed.
#[sqlx::test(migrations = false)]
async fn a_replay_from_the_start_forgets_the_journal(_p: PgPoolOptions, opts: PgConnectOptions) {
    let kid = || Function::new("kid").handler(|_ctx: Ctx, _: Value| async move { Ok(1) });
    let v1 = Function::new("parent").on_event("parent/go").handler(|ctx: Ctx, _: Value| async move {
        let invoke = durastep::Invoke::function("kid").input(&()).timeout(Duration::from_secs(60));
        let _: Result<u32, durastep::ChildError> = ctx.invoke("k", invoke).await?;
        ctx.step("a", || async { Ok(1) }).await
    });
    let engine = common::engine(&opts, vec![v1, kid()]).await;
    let w = common::spawn_worker(&engine);
    let id = engine.send(Event::new("parent/go", &json!({}))).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);
    w.stop().await;
    assert_eq!(common::journal(&engine, id).await, ["0 invoke k", "1 step a"]);
    sqlx::query("UPDATE durastep.runs SET state = 'cancelled' WHERE id = $1")
        .bind(id)
        .execute(engine.pool())
        .await
        .unwrap();

    let v2 = Function::new("parent")
        .on_event("parent/go")
        .handler(|ctx: Ctx, _: Value| async move { ctx.step("a", || async { Ok(2) }).await });
    let engine = common::engine(&opts, vec![v2, kid()]).await;
    engine.replay(id, ReplayFrom::Start).await.unwrap();
    let w = common::spawn_worker(&engine);
    let run = common::wait_for_run_where(&engine, id, "the replay to end", |r| {
        r.state.is_finished() || r.state == RunState::Diverged
    })
    .await;
    assert_eq!((run.state, run.output), (RunState::Completed, Some(json!(2))), "{:?}", run.last_error);
    assert_eq!(common::journal(&engine, id).await, ["0 step a"]);
    w.stop().await;
}

/// A function `id` on `event` whose every attempt fails permanently with `error`.
fn dead_on_arrival(id: &str, event: &str, error: &'static str) -> Function {
    Function::new(id)
        .on_event(event)
        .retries(0)
        .handler(move |_: Ctx, _: Value| async move { Err::<(), _>(HandlerError::permanent(error)) })
}

/// Catches: `replay` returning the run as read after its commit, when a
/// listening worker may already have claimed it (seen in CI: `Running` where
/// the docs promise `Queued`). The run is read back in the replay's own
/// transaction. A hundred replays, each racing an idle worker woken by it.
#[sqlx::test(migrations = false)]
async fn replay_returns_the_run_as_it_queued_it_even_when_a_worker_takes_it_at_once(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let f = dead_on_arrival("refused", "refused/go", "422 refused");
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("refused/go", &json!({}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    for round in 1..=100u32 {
        let failed = common::finished(&engine, id).await;
        assert_eq!((failed.state, failed.attempt), (RunState::Failed, round));
        let queued = engine.replay(id, ReplayFrom::FailedStep).await.unwrap();
        assert_eq!((queued.state, queued.attempt), (RunState::Queued, round + 1), "round {round}");
    }
    w.stop().await;
}

/// Catches: a bulk replay whose batches lose or repeat runs where a batch
/// ends among the runs with random ids (stored before migration 0021) or
/// where the walk passes on to the time-ordered ones, and one that replays a
/// run a second time, or forever, when it fails again while the call goes
/// on. 520 failed runs with random ids and 100 with time-ordered ones: the
/// first batch of 500 ends among the first kind, the second takes the last
/// 20 of them and the 100. A worker runs the replayed runs meanwhile, and
/// each fails again at once.
#[sqlx::test(migrations = false)]
async fn replay_many_walks_both_kinds_of_ids_in_batches_once_while_runs_fail_again(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let dead = dead_on_arrival("dead", "dead/go", "mailbox full");
    let engine = common::engine(&opts, vec![dead]).await;
    let pool = engine.pool();
    engine.send_batch((0..100).map(|i| Event::new("dead/go", &json!({"i": i}))).collect()).await.unwrap();
    let w = common::spawn_worker(&engine);
    common::wait_until("the 100 runs failed", || async {
        common::count(&engine, "durastep.runs WHERE state = 'failed'").await == 100
    })
    .await;
    sqlx::query(
        "WITH ev AS (INSERT INTO durastep.events (id, name, payload)
                     SELECT gen_random_uuid(), 'dead/go', jsonb_build_object('old', i)
                       FROM generate_series(1, 520) i RETURNING id, (payload ->> 'old')::int AS i)
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, attempt, max_attempts, created_at,
                                    finished_at, last_error)
         SELECT gen_random_uuid(), 'dead', ev.id, 'failed', durastep.now(), 1, 1,
                durastep.now() - make_interval(secs => ev.i), durastep.now(), 'old' FROM ev",
    )
    .execute(pool)
    .await
    .unwrap();
    let all: HashSet<uuid::Uuid> =
        sqlx::query_scalar("SELECT id FROM durastep.runs").fetch_all(pool).await.unwrap().into_iter().collect();
    assert_eq!(all.len(), 620);

    let filter = RunFilter::new().function("dead").state(RunState::Failed);
    let replayed = tokio::time::timeout(common::DEADLINE, engine.replay_many(&filter, ReplayFrom::Start))
        .await
        .expect("replay_many never ended")
        .unwrap();
    assert_eq!(replayed.len(), 620, "a run replayed twice or left out");
    assert_eq!(replayed.iter().copied().collect::<HashSet<_>>(), all);
    common::wait_until("the 620 runs failed again", || async {
        common::count(&engine, "durastep.runs WHERE state = 'failed'").await == 620
    })
    .await;
    w.stop().await;
}

/// Catches: a bulk replay that misses runs past the first batch, touches
/// another function's or a live run, or replays a run twice.
#[sqlx::test(migrations = false)]
async fn replay_many_requeues_exactly_the_matching_dead_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let dead = |id: &str| dead_on_arrival(id, "go", "channel #plaatsingen-2026 not found");
    let engine = common::engine(&opts, vec![dead("post"), dead("other")]).await;
    let events: Vec<Event> = (0..620).map(|i| Event::new("go", &json!({"i": i}))).collect();
    engine.send_batch(events).await.unwrap();
    let w = common::spawn_worker(&engine);
    common::wait_until("all 1,240 runs failed", || async {
        common::count(&engine, "durastep.runs WHERE state = 'failed'").await == 1240
    })
    .await;
    w.stop().await;
    let filter = RunFilter::new().function("post").state(RunState::Failed);
    let ids = engine.replay_many(&filter, ReplayFrom::FailedStep).await.unwrap();
    assert_eq!(ids.len(), 620);
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 620);
    assert_eq!(common::count(&engine, "durastep.runs WHERE function_id = 'post' AND state = 'queued'").await, 620);
    assert_eq!(common::count(&engine, "durastep.runs WHERE function_id = 'other' AND state = 'failed'").await, 620);
    // Nothing left to replay: a second call queues nothing.
    assert!(engine.replay_many(&filter, ReplayFrom::FailedStep).await.unwrap().is_empty());
    // A filter naming only live states replays nothing.
    let live = RunFilter::new().state(RunState::Queued);
    assert!(engine.replay_many(&live, ReplayFrom::FailedStep).await.unwrap().is_empty());
}

/// Catches: pages that overlap or skip rows, filters that are ignored, and bad
/// input accepted instead of a typed error.
#[sqlx::test(migrations = false)]
async fn listings_paginate_and_filter(_p: PgPoolOptions, opts: PgConnectOptions) {
    let noop = Function::new("listed").on_event("listed/go").handler(|_: Ctx, _: Value| async move { Ok(()) });
    let engine = common::engine(&opts, vec![noop]).await;
    let events: Vec<Event> = (0..120)
        .map(|i| Event::new("listed/go", &json!({"account": format!("a{}", i % 4)})).idempotency_key(format!("k{i}")))
        .collect();
    engine.send_batch(events).await.unwrap();

    let mut seen = Vec::new();
    let mut filter = RunFilter::new().function("listed").limit(50);
    let mut pages = 0;
    loop {
        let page = engine.inspect().runs(&filter).await.unwrap();
        pages += 1;
        seen.extend(page.runs.iter().map(|r| (r.created_at, r.id)));
        match page.next {
            Some(c) => filter = filter.after(c.to_string().parse().unwrap()),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen.len(), 120);
    assert_eq!(seen.iter().collect::<HashSet<_>>().len(), 120);
    assert!(seen.windows(2).all(|w| w[0] > w[1]), "newest first, strictly");

    let a1 = engine.inspect().runs(&RunFilter::new().data("/account", "a1").limit(100)).await.unwrap();
    assert_eq!(a1.runs.len(), 30);
    let k7 = engine.inspect().runs(&RunFilter::new().idempotency_key("k7")).await.unwrap();
    assert_eq!(k7.runs.len(), 1);
    assert_eq!(k7.runs[0].idempotency_key.as_deref(), Some("k7"));
    let none = engine.inspect().runs(&RunFilter::new().state(RunState::Failed)).await.unwrap();
    assert!(none.runs.is_empty() && none.next.is_none());
    let future = chrono::Utc::now() + chrono::Duration::days(1);
    assert!(engine.inspect().runs(&RunFilter::new().created_after(future)).await.unwrap().runs.is_empty());
    assert_eq!(
        engine.inspect().runs(&RunFilter::new().created_before(future).limit(1000)).await.unwrap().runs.len(),
        120
    );

    for bad in [RunFilter::new().data("account", "a1"), RunFilter::new().limit(0), RunFilter::new().limit(5000)] {
        assert!(matches!(engine.inspect().runs(&bad).await, Err(Error::InvalidFilter(_))));
    }
    assert!(matches!("12_nope".parse::<durastep::inspect::Cursor>(), Err(Error::InvalidFilter(_))));

    let counts = engine.inspect().counts().await.unwrap();
    assert_eq!(counts.len(), 1);
    assert_eq!((counts[0].function_id.as_str(), counts[0].state, counts[0].count), ("listed", RunState::Queued, 120));
    let minutes = engine.inspect().per_minute(Duration::from_secs(3600)).await.unwrap();
    assert_eq!(minutes.iter().map(|m| m.created).sum::<i64>(), 120);
    let events = engine.inspect().events(&EventFilter::new().name("listed/go").limit(1000)).await.unwrap();
    assert_eq!(events.events.len(), 120);
    assert!(events.events.iter().all(|e| e.runs == 1));
    let functions = engine.inspect().functions().await.unwrap();
    assert_eq!(functions.iter().map(|f| f.id.as_str()).collect::<Vec<_>>(), ["listed"]);
    assert_eq!(functions[0].triggers, ["listed/go"]);
}

/// Catches: a listing that orders runs by anything but their id (the
/// creation order of time-ordered ids), that loses or repeats runs with a
/// random id (stored before migration 0031's listing by id) or mixes them
/// into the others, a bulk action that misses them, and a `created_after`
/// bound on ids that leaves out a run created while the test clock was
/// ahead of where it is now.
#[sqlx::test(migrations = false)]
async fn listings_walk_time_ordered_ids_then_the_runs_with_random_ids(_p: PgPoolOptions, opts: PgConnectOptions) {
    let noop = Function::new("listed").on_event("listed/go").handler(|_: Ctx, _: Value| async move { Ok(()) });
    let engine = common::engine(&opts, vec![noop]).await;
    let pool = engine.pool();
    for batch in 0..3 {
        let events: Vec<Event> = (0..10).map(|i| Event::new("listed/go", &json!({"i": batch * 10 + i}))).collect();
        engine.send_batch(events).await.unwrap();
    }
    // Runs as an engine before migration 0021 stored them: random ids, the
    // newest of them created a minute ago, failed. One has a version-7 id
    // that is not a time of this century; it ends the fifth page below.
    sqlx::query(
        "WITH ev AS (INSERT INTO durastep.events (id, name, payload)
                     SELECT gen_random_uuid(), 'listed/go', jsonb_build_object('old', i)
                       FROM generate_series(1, 25) i RETURNING id, (payload ->> 'old')::int AS i)
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, attempt, max_attempts, created_at,
                                    finished_at, last_error)
         SELECT CASE WHEN ev.i = 5 THEN 'f0000000-0000-7000-8000-000000000005'::uuid ELSE gen_random_uuid() END,
                'listed', ev.id, 'failed', durastep.now(), 1, 1,
                durastep.now() - make_interval(mins => ev.i), durastep.now(), 'old' FROM ev",
    )
    .execute(pool)
    .await
    .unwrap();
    let expected: Vec<uuid::Uuid> = sqlx::query_scalar(
        "(SELECT r.id FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id
           WHERE NOT e.payload ? 'old' ORDER BY r.id DESC)
         UNION ALL
         (SELECT r.id FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id
           WHERE e.payload ? 'old' ORDER BY r.created_at DESC, r.id DESC)",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(expected.len(), 55);

    let listed = |filter: RunFilter| {
        let engine = engine.clone();
        async move {
            let (mut filter, mut seen) = (filter, Vec::new());
            for _ in 0..100 {
                let page = engine.inspect().runs(&filter).await.unwrap();
                seen.extend(page.runs.iter().map(|r| r.id));
                match page.next {
                    Some(c) => filter = filter.after(c.to_string().parse().unwrap()),
                    None => return seen,
                }
            }
            panic!("a listing goes on past 100 pages: {} runs seen", seen.len())
        }
    };
    // Pages of 7: one of them holds the last time-ordered runs and the first
    // random ones.
    assert_eq!(listed(RunFilter::new().limit(7)).await, expected);
    assert_eq!(listed(RunFilter::new().function("listed").limit(30)).await, expected);
    assert_eq!(listed(RunFilter::new().state(RunState::Failed).limit(4)).await, expected[30..]);
    assert_eq!(listed(RunFilter::new().state(RunState::Queued).limit(4)).await, expected[..30]);

    // A bulk action takes the matching runs of both kinds.
    let replayed = engine.replay_many(&RunFilter::new().state(RunState::Failed), ReplayFrom::Start).await.unwrap();
    assert_eq!(replayed.iter().collect::<HashSet<_>>(), expected[30..].iter().collect::<HashSet<_>>());

    // Runs created while the test clock is two days ahead, found by
    // `created_after` from their own time, also once the clock is set back.
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    let sent = engine.send_batch((0..5).map(|i| Event::new("listed/go", &json!({"ahead": i}))).collect()).await;
    // Newest first: by id (ids minted in one millisecond are in no particular order).
    let mut ahead: Vec<uuid::Uuid> = sent.unwrap().iter().flat_map(|s| s.run_ids.iter().copied()).collect();
    ahead.sort_by(|a, b| b.cmp(a));
    assert_eq!(ahead.len(), 5);
    let since: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT durastep.now() - interval '1 hour'").fetch_one(pool).await.unwrap();
    assert_eq!(listed(RunFilter::new().created_after(since).limit(2)).await, ahead);
    durastep::testing::set_clock(&engine, chrono::Utc::now()).await.unwrap();
    assert_eq!(listed(RunFilter::new().created_after(since).limit(2)).await, ahead);
    assert_eq!(listed(RunFilter::new().created_before(since).limit(9)).await.len(), 55);
    let minutes = engine.inspect().per_minute(Duration::from_secs(3600)).await.unwrap();
    assert_eq!(minutes.iter().map(|m| m.created).sum::<i64>(), 30 + 5 + 25, "the last hour, and the five ahead");
}

/// Catches: a blocker view that names the wrong reason (or none) for a run
/// that is held by concurrency, a sleep, a wait, a backoff, a delayed start,
/// or that is simply waiting for a worker.
#[sqlx::test(migrations = false)]
async fn blockers_name_what_holds_each_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    let gate = common::Gate::new();
    let g = gate.clone();
    let capped = Function::new("capped")
        .on_event("capped/go")
        .concurrency(durastep::Concurrency::new(1).key("/account"))
        .handler(move |_: Ctx, _: Value| {
            let g = g.clone();
            async move {
                g.wait().await;
                Ok(())
            }
        });
    let sleeper = Function::new("sleeper").on_event("sleeper/go").handler(|ctx: Ctx, _: Value| async move {
        ctx.sleep("nap", Duration::from_secs(3600)).await?;
        Ok(())
    });
    let waiter = Function::new("waiter").on_event("waiter/go").handler(|ctx: Ctx, _: Value| async move {
        let _: Option<Value> = ctx
            .wait_for_event("approval", durastep::WaitFor::event("approval/given").timeout(Duration::from_secs(60)))
            .await?;
        Ok(())
    });
    let flaky = Function::new("flaky")
        .on_event("flaky/go")
        .backoff(Backoff::Fixed(Duration::from_secs(300)))
        .handler(|_: Ctx, _: Value| async move { Err::<(), _>(HandlerError::new("429 from LinkedIn")) });
    let engine = common::engine(&opts, vec![capped, sleeper, waiter, flaky]).await;
    let first = engine.send(Event::new("capped/go", &json!({"account": "acme"}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, first, "first running", |r| r.state == RunState::Running).await;
    let second = engine.send(Event::new("capped/go", &json!({"account": "acme"}))).await.unwrap().run_ids[0];
    let sleeping = engine.send(Event::new("sleeper/go", &json!({}))).await.unwrap().run_ids[0];
    let waiting = engine.send(Event::new("waiter/go", &json!({}))).await.unwrap().run_ids[0];
    let backing = engine.send(Event::new("flaky/go", &json!({}))).await.unwrap().run_ids[0];
    let later = engine
        .send(Event::new("sleeper/go", &json!({})).start_at(chrono::Utc::now() + chrono::Duration::hours(2)))
        .await
        .unwrap()
        .run_ids[0];
    common::parked(&engine, second, "second parked").await;
    common::wait_for_run_where(&engine, sleeping, "sleeping", |r| r.state == RunState::Sleeping).await;
    common::wait_for_run_where(&engine, waiting, "waiting", |r| r.state == RunState::Waiting).await;
    common::wait_for_run_where(&engine, backing, "backing off", |r| r.attempt == 2).await;

    let why = |id| {
        let engine = engine.clone();
        async move {
            match engine.inspect().why(id).await.unwrap() {
                Why::Blocked(b) => b,
                other => panic!("{id} not blocked: {other:?}"),
            }
        }
    };
    let b = why(second).await;
    assert_eq!(b.kind, BlockerKind::Concurrency);
    assert_eq!((b.key.as_deref(), b.in_use, b.limit), (Some("acme"), Some(1), Some(1)));
    assert!(b.next_possible_start.is_none());
    let b = why(sleeping).await;
    assert_eq!(b.kind, BlockerKind::Sleep);
    assert!(b.next_possible_start.unwrap() > chrono::Utc::now() + chrono::Duration::minutes(59));
    let b = why(waiting).await;
    assert_eq!((b.kind, b.detail.as_deref()), (BlockerKind::WaitForEvent, Some("approval/given")));
    let b = why(backing).await;
    assert_eq!((b.kind, b.detail.as_deref()), (BlockerKind::RetryBackoff, Some("429 from LinkedIn")));
    assert_eq!(why(later).await.kind, BlockerKind::Scheduled);
    assert!(matches!(engine.inspect().why(first).await.unwrap(), Why::Running { attempt: 1, worker_id: Some(_) }));
    let all = engine.inspect().blockers(None, 100).await.unwrap();
    assert_eq!(all.len(), 5);
    assert_eq!(engine.inspect().blockers(Some("capped"), 100).await.unwrap().len(), 1);
    let functions = engine.inspect().functions().await.unwrap();
    let capped = functions.iter().find(|f| f.id == "capped").unwrap();
    assert_eq!(capped.rules.len(), 1);
    let rule = &capped.rules[0];
    assert_eq!((rule.kind.as_str(), rule.limit, rule.key.as_deref()), ("concurrency", 1, Some("/account")));

    // No worker for it: ready, and says so.
    w.stop().await;
    let idle = engine.send(Event::new("sleeper/go", &json!({}))).await.unwrap().run_ids[0];
    assert_eq!(why(idle).await.kind, BlockerKind::Ready);
    gate.open();
}

/// Catches: pruning that deletes unfinished or recent runs, leaves steps,
/// history or events behind (those of its runs, or old events that started no
/// run), or stops after one batch.
#[sqlx::test(migrations = false)]
async fn prune_deletes_old_finished_runs_with_everything_they_own(_p: PgPoolOptions, opts: PgConnectOptions) {
    let done = Function::new("done").on_event("done/go").handler(|ctx: Ctx, _: Value| async move {
        ctx.step("one", || async { Ok(1) }).await?;
        Ok(())
    });
    let sleeper = Function::new("napper").on_event("napper/go").handler(|ctx: Ctx, _: Value| async move {
        ctx.sleep("long", Duration::from_secs(30 * 86_400)).await?;
        Ok(())
    });
    let engine = common::engine(&opts, vec![done, sleeper]).await;
    engine.send_batch((0..1200).map(|i| Event::new("done/go", &json!({"i": i}))).collect()).await.unwrap();
    let napping = engine.send(Event::new("napper/go", &json!({}))).await.unwrap().run_ids[0];
    // Events no function listens to: they start no run, and go once old
    // (more than one batch of them, found in the batches that delete no run).
    engine.send_batch((0..600).map(|i| Event::new("nobody/go", &json!({"i": i}))).collect()).await.unwrap();
    let w = common::spawn_worker(&engine);
    common::wait_until("1,200 completed", || async {
        common::count(&engine, "durastep.runs WHERE state = 'completed'").await == 1200
    })
    .await;
    common::wait_for_run_where(&engine, napping, "sleeping", |r| r.state == RunState::Sleeping).await;
    w.stop().await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    let fresh = engine.send(Event::new("done/go", &json!({"fresh": true}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::finished(&engine, fresh).await;
    w.stop().await;

    let report = engine.prune(Duration::from_secs(86_400)).await.unwrap();
    assert_eq!((report.runs, report.events), (1200, 1800));
    assert!(report.batches >= 3, "1,200 runs in batches of 500: {report:?}");
    assert_eq!(common::count(&engine, "durastep.runs").await, 2);
    assert_eq!(common::count(&engine, "durastep.events").await, 2);
    assert_eq!(
        common::count(&engine, "durastep.step_results WHERE run_id NOT IN (SELECT id FROM durastep.runs)").await,
        0
    );
    assert_eq!(
        common::count(&engine, "durastep.step_journal WHERE run_id NOT IN (SELECT id FROM durastep.runs)").await,
        0
    );
    assert_eq!(
        common::count(&engine, "durastep.run_history WHERE run_id NOT IN (SELECT id FROM durastep.runs)").await,
        0
    );
    assert!(common::count(&engine, "durastep.run_history").await > 0);
    assert!(common::count(&engine, "durastep.run_journal").await > 0);
    assert_eq!(engine.run(napping).await.unwrap().state, RunState::Sleeping);
    assert_eq!(engine.inspect().run(fresh).await.unwrap().steps.len(), 1);
    assert_eq!(engine.prune(Duration::from_secs(86_400)).await.unwrap().runs, 0);
}

/// Catches: pruning whose walk of the primary key misses old runs (migration
/// 0033 finds finished runs by id instead of by `finished_at`): runs created
/// while the test clock was set back ten days, whose ids are then far newer
/// than their `created_at`, and runs with random ids, which the walk of
/// time-ordered ids cannot bound. Also: the runs of that time that have not
/// finished, and recent ones, are kept.
#[sqlx::test(migrations = false)]
async fn prune_finds_old_runs_under_any_clock_and_with_random_ids(_p: PgPoolOptions, opts: PgConnectOptions) {
    let done = Function::new("done").on_event("done/go").handler(|_: Ctx, _: Value| async move { Ok(()) });
    let sleeper = Function::new("napper").on_event("napper/go").handler(|ctx: Ctx, _: Value| async move {
        ctx.sleep("long", Duration::from_secs(30 * 86_400)).await?;
        Ok(())
    });
    let engine = common::engine(&opts, vec![done, sleeper]).await;
    let now = chrono::Utc::now();
    durastep::testing::set_clock(&engine, now - chrono::Duration::days(10)).await.unwrap();
    let old: Vec<Uuid> = engine
        .send_batch((0..30).map(|i| Event::new("done/go", &json!({"i": i}))).collect())
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.run_ids[0])
        .collect();
    let napping = engine.send(Event::new("napper/go", &json!({}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    for id in &old {
        common::finished(&engine, *id).await;
    }
    common::wait_for_run_where(&engine, napping, "sleeping", |r| r.state == RunState::Sleeping).await;
    w.stop().await;
    // Runs with random ids, finished five days ago, as runs stored before
    // migration 0021 are.
    sqlx::query(
        "WITH e AS (INSERT INTO durastep.events (id, name, payload) VALUES (gen_random_uuid(), 'done/go', '{}')
                    RETURNING id)
         INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, created_at, finished_at)
         SELECT gen_random_uuid(), 'done-' || i, e.id, 'completed', durastep.now(), 3,
                durastep.now() + interval '5 days', durastep.now() + interval '5 days'
           FROM e, generate_series(1, 20) i",
    )
    .execute(engine.pool())
    .await
    .unwrap();
    durastep::testing::set_clock(&engine, now).await.unwrap();
    let fresh = engine.send(Event::new("done/go", &json!({"fresh": true}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::finished(&engine, fresh).await;
    w.stop().await;

    assert_eq!(engine.inspect().prunable(Duration::from_secs(86_400)).await.unwrap(), 50);
    // A batch goes on after its pass's cursor (`after`): the time-ordered
    // runs up to it are left for the next pass, and it says where it stopped.
    let mut ordered = old.clone();
    ordered.sort();
    let (pruned, last_run): (i64, Uuid) =
        sqlx::query_as("SELECT pruned_runs, last_run FROM durastep.prune_batch(86400, 5, $1)")
            .bind(ordered[9])
            .fetch_one(engine.pool())
            .await
            .unwrap();
    assert_eq!(last_run, ordered[14], "five after the cursor");
    assert_eq!(pruned, 5 + 5, "five time-ordered runs and a batch of the random-id ones");
    for id in &ordered[..10] {
        assert!(engine.run(*id).await.is_ok(), "a run before the cursor was pruned");
    }
    let report = engine.prune(Duration::from_secs(86_400)).await.unwrap();
    assert_eq!(report.runs, 40, "{report:?}");
    let mut left: Vec<Uuid> =
        sqlx::query_scalar("SELECT id FROM durastep.runs").fetch_all(engine.pool()).await.unwrap();
    left.sort();
    let mut kept = vec![napping, fresh];
    kept.sort();
    assert_eq!(left, kept);
    assert_eq!(engine.inspect().prunable(Duration::from_secs(86_400)).await.unwrap(), 0);
}

/// Catches: per-minute counts of finished runs that miss completions or
/// failures, or count only a run's last finish (since migration 0033 they
/// are read from the run history, where a run replayed and finished again
/// has both finishes).
#[sqlx::test(migrations = false)]
async fn per_minute_counts_every_finish(_p: PgPoolOptions, opts: PgConnectOptions) {
    let tries = Arc::new(AtomicU32::new(0));
    let t = tries.clone();
    let done = Function::new("done").on_event("done/go").handler(|_: Ctx, _: Value| async move { Ok(()) });
    let flaky = Function::new("flaky").on_event("flaky/go").handler(move |_: Ctx, _: Value| {
        let t = t.clone();
        async move {
            if bump(&t) == 1 {
                return Err(HandlerError::permanent("first try refused"));
            }
            Ok(())
        }
    });
    let engine = common::engine(&opts, vec![done, flaky]).await;
    let done_ids = engine.send_batch((0..4).map(|i| Event::new("done/go", &json!({"i": i}))).collect()).await.unwrap();
    let flaky_id = engine.send(Event::new("flaky/go", &json!({}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    for r in &done_ids {
        common::finished(&engine, r.run_ids[0]).await;
    }
    assert_eq!(common::finished(&engine, flaky_id).await.state, RunState::Failed);
    engine.replay(flaky_id, ReplayFrom::Start).await.unwrap();
    common::wait_for_run_where(&engine, flaky_id, "completed", |r| r.state == RunState::Completed).await;
    w.stop().await;
    let minutes = engine.inspect().per_minute(Duration::from_secs(3600)).await.unwrap();
    let sum = |f: fn(&durastep::inspect::MinuteCount) -> i64| minutes.iter().map(f).sum::<i64>();
    assert_eq!((sum(|m| m.created), sum(|m| m.completed), sum(|m| m.failed)), (5, 5, 1), "{minutes:?}");
    // Finishes older than the window are not counted.
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 3600)).await.unwrap();
    assert_eq!(engine.inspect().per_minute(Duration::from_secs(3600)).await.unwrap(), vec![]);
}

/// Catches: per-minute counts that drop the completions a run carries
/// (migration 0045) in the window's first minute, which begins before the
/// window does, or that count the minute before it. The counts are kept per
/// minute, not per completion: a minute counts whole once it overlaps the
/// window (docs/guide.md).
#[sqlx::test(migrations = false)]
async fn a_minute_of_carried_completions_counts_whole_once_it_overlaps_the_window(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let engine = common::engine(&opts, vec![]).await;
    let window = Duration::from_secs(600);
    // The minute the window starts in, by the database clock (it begins
    // before the window unless the window starts on the minute), read before
    // and after the counts: a window that moved into the next minute
    // meanwhile is read again.
    let first_minute = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
            "SELECT date_trunc('minute', durastep.now() - make_interval(secs => $1))",
        )
        .bind(window.as_secs_f64())
        .fetch_one(engine.pool())
        .await
        .unwrap()
    };
    let (minutes, first) = loop {
        let first = first_minute().await;
        sqlx::query("DELETE FROM durastep.completions_per_minute").execute(engine.pool()).await.unwrap();
        sqlx::query(
            "INSERT INTO durastep.completions_per_minute (minute, backend, completed)
             VALUES ($1, 1, 3), ($1, 2, 4), ($1 - interval '1 minute', 1, 5)",
        )
        .bind(first)
        .execute(engine.pool())
        .await
        .unwrap();
        let minutes = engine.inspect().per_minute(window).await.unwrap();
        if first_minute().await == first {
            break (minutes, first);
        }
    };
    let counted: Vec<(chrono::DateTime<chrono::Utc>, i64)> = minutes.iter().map(|m| (m.minute, m.completed)).collect();
    assert_eq!(counted, [(first, 7)], "{minutes:?}");
}

/// Catches: a worker with `retention` that never prunes (or prunes recent runs).
#[sqlx::test(migrations = false)]
async fn workers_prune_on_their_own_with_retention(_p: PgPoolOptions, opts: PgConnectOptions) {
    let done = Function::new("kept").on_event("kept/go").handler(|_: Ctx, _: Value| async move { Ok(()) });
    let worker = WorkerOptions {
        retention: Some(Duration::from_secs(3600)),
        prune_interval: Duration::from_millis(100),
        ..common::fast_options()
    };
    let engine: Engine = common::engine_with(&opts, vec![done], worker).await;
    let old = engine.send(Event::new("kept/go", &json!({}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::finished(&engine, old).await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(7200)).await.unwrap();
    let recent = engine.send(Event::new("kept/go", &json!({}))).await.unwrap().run_ids[0];
    common::finished(&engine, recent).await;
    common::wait_until("the old run pruned", || async { matches!(engine.run(old).await, Err(Error::UnknownRun(_))) })
        .await;
    assert_eq!(engine.run(recent).await.unwrap().state, RunState::Completed);
    w.stop().await;
}

/// Catches: a history that records only the worker's own transitions. The
/// reaper (lease lost), a cancel and a replay each leave their entry, with the
/// lease-lost execution told apart from a retry.
#[sqlx::test(migrations = false)]
async fn history_records_reaper_cancel_and_replay_paths(_p: PgPoolOptions, opts: PgConnectOptions) {
    let h = Arc::new(common::Handoff::default());
    let hh = h.clone();
    let make = move || {
        let hh = hh.clone();
        Function::new("handed").on_event("go").handler(move |ctx: Ctx, _: ()| {
            let hh = hh.clone();
            async move {
                let _guard = hh.drop_guard(ctx.attempt());
                hh.hold(ctx.attempt()).await;
                Ok(())
            }
        })
    };
    let (id, _ea, wa, engine, wb) = common::take_over(&opts, make, &h).await;
    h.b_gate.open();
    assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);
    common::release_stale(&h, wa).await;
    wb.stop().await;
    let d = engine.inspect().run(id).await.unwrap();
    let outcomes: Vec<AttemptOutcome> = d.attempts.iter().map(|a| a.outcome).collect();
    assert_eq!(outcomes, [AttemptOutcome::LeaseLost, AttemptOutcome::Completed]);
    assert_ne!(d.attempts[0].worker_id, d.attempts[1].worker_id);
    assert!(d.attempts[0].error.as_deref().unwrap().starts_with("lease expired"));

    // A cancel of a queued run (no worker), then a replay of it.
    let other = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    engine.cancel(other, "not needed").await.unwrap();
    engine.replay(other, ReplayFrom::Start).await.unwrap();
    let states: Vec<RunState> = engine.inspect().run(other).await.unwrap().history.iter().map(|h| h.state).collect();
    assert_eq!(states, [RunState::Cancelled, RunState::Queued]);
}

/// Catches: pruning a finished child run while its parent has not finished
/// (G32), or keeping it once the parent is gone too.
#[sqlx::test(migrations = false)]
async fn prune_keeps_the_children_of_unfinished_parents(_p: PgPoolOptions, opts: PgConnectOptions) {
    let child = Function::new("child").on_event("child/go").handler(|_: Ctx, _: Value| async move { Ok(7) });
    let parent = Function::new("parent").on_event("parent/go").handler(|ctx: Ctx, _: Value| async move {
        let got: Result<i32, durastep::ChildError> = ctx
            .invoke("call", durastep::Invoke::function("child").input(&json!({})).timeout(Duration::from_secs(600)))
            .await?;
        let _ = got;
        ctx.sleep("after", Duration::from_secs(10 * 86_400)).await?;
        Ok(())
    });
    let engine = common::engine(&opts, vec![child, parent]).await;
    let id = engine.send(Event::new("parent/go", &json!({}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, id, "parent sleeping", |r| r.state == RunState::Sleeping).await;
    w.stop().await;
    let kid = engine.inspect().run(id).await.unwrap().children[0].clone();
    assert_eq!(kid.state, RunState::Completed);
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    assert_eq!(engine.prune(Duration::from_secs(86_400)).await.unwrap().runs, 0);
    assert_eq!(engine.run(kid.id).await.unwrap().state, RunState::Completed);
    // The parent finishes (cancelled here) and ages: then both go.
    engine.cancel(id, "done with it").await.unwrap();
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    assert_eq!(engine.prune(Duration::from_secs(86_400)).await.unwrap().runs, 2);
}

/// Events merged into a debounced run that has not finished are kept by
/// pruning (their duplicates still name the run); once the run has finished
/// and aged, the run and all its events go. Catches: pruning an event merged
/// away (no run names it in `runs.event_id`) while its run lives, which would
/// forget its idempotency key (G6, G27).
#[sqlx::test(migrations = false)]
async fn prune_keeps_events_merged_into_a_debounced_run_while_the_run_is_kept(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let f = Function::new("resync")
        .on_event("changed")
        .debounce(
            durastep::Debounce::new(Duration::from_secs(3 * 86_400))
                .key("/k")
                .max_wait(Duration::from_secs(5 * 86_400)),
        )
        .handler(|_: Ctx, e: Value| async move { Ok(e["n"].clone()) });
    let engine = common::engine(&opts, vec![f]).await;
    let send = |n: i64| {
        let engine = engine.clone();
        async move { engine.send(Event::new("changed", &json!({"k": "a", "n": n})).idempotency_key(format!("e{n}"))).await }
    };
    let first = send(1).await.unwrap();
    let run = first.run_ids[0];
    assert_eq!(send(2).await.unwrap().run_ids, [run]);
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    let pruned = engine.prune(Duration::from_secs(86_400)).await.unwrap();
    assert_eq!((pruned.runs, pruned.events), (0, 0), "pruned the events of a debounced run that is kept");
    let again = send(1).await.unwrap();
    assert!(again.duplicate);
    assert_eq!((again.event_id, again.run_ids), (first.event_id, vec![run]));

    // The run starts (3 days after the last event), completes and ages: everything goes.
    durastep::testing::advance_clock(&engine, Duration::from_secs(86_400)).await.unwrap();
    let w = common::spawn_worker(&engine);
    assert_eq!(common::finished(&engine, run).await.output, Some(json!(2)));
    w.stop().await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    let pruned = engine.prune(Duration::from_secs(86_400)).await.unwrap();
    assert_eq!((pruned.runs, pruned.events), (1, 2), "{pruned:?}");
    assert_eq!(common::count(&engine, "durastep.debounced_events").await, 0);
}

/// A run cancelled while running on a worker that cannot learn of it (no
/// LISTEN, no heartbeat within the test) still holds its concurrency slot:
/// pruning keeps it (even past the bound), and once a reaper pass has given
/// the slot back (its lease lapsed), pruning deletes it and the slot count is
/// 0. Catches: pruning a cancelled run whose attempt still holds a slot (G22,
/// G32).
#[sqlx::test(migrations = false)]
async fn prune_keeps_a_cancelled_run_until_its_attempt_has_stopped(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (entered, gate) = (common::Gate::new(), common::Gate::new());
    let (e, g) = (entered.clone(), gate.clone());
    let f = Function::new("limited").on_event("limited").concurrency(durastep::Concurrency::new(1).key("/k")).handler(
        move |ctx: Ctx, _: Value| {
            let (e, g) = (e.clone(), g.clone());
            async move {
                ctx.step("held", || async {
                    e.open();
                    g.wait().await;
                    Ok(())
                })
                .await
            }
        },
    );
    let stalled = WorkerOptions { listen: false, ..common::stalling_options() };
    let engine = common::engine_with(&opts, vec![f], stalled).await;
    let id = engine.send(Event::new("limited", &json!({"k": "a"}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered.reached("the body").await;
    engine.cancel(id, "operator").await.unwrap();
    let in_use = || async {
        sqlx::query_scalar::<_, i64>("SELECT coalesce(sum(in_use), 0)::bigint FROM durastep.flow_keys")
            .fetch_one(engine.pool())
            .await
            .unwrap()
    };
    assert_eq!(in_use().await, 1, "the cancel gave the slot back while the body runs");
    // Past the bound (a day) but not yet reaped: kept.
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    assert_eq!(engine.prune(Duration::from_secs(86_400)).await.unwrap().runs, 0);
    assert_eq!(in_use().await, 1);
    // The lease lapsed: a reaper pass gives the slot back; then pruning deletes the run.
    engine.reap_expired_leases().await.unwrap();
    assert_eq!(in_use().await, 0);
    assert_eq!(engine.prune(Duration::from_secs(86_400)).await.unwrap().runs, 1);
    gate.open();
    w.stop().await;
    assert_eq!(in_use().await, 0);
}

/// The reader role of docs/security.md, run as written: connected with
/// `Inspector::connect` it reads runs, details, counts (exact and estimated),
/// blockers, events and functions; it cannot build an engine (registration
/// writes), replay, cancel or update a run.
///
/// Catches: a read-only entry that still migrates or registers (so needs the
/// runtime role), and a reader grant block that misses what reads need.
#[sqlx::test(migrations = false)]
async fn reader_role_reads_everything_and_writes_nothing(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(
        &opts,
        vec![
            Function::new("r")
                .on_event("r/go")
                .handler(|ctx: Ctx, _: Value| async move { ctx.step("one", || async { Ok(1) }).await }),
        ],
    )
    .await;
    let w = common::spawn_worker(&engine);
    let id = engine.send(Event::new("r/go", &json!({"k": 1}))).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);

    let reader = format!("durastep_reader_{}", uuid::Uuid::new_v4().simple());
    let admin = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.expect("admin");
    let grants = reader_grants().replace("durastep_reader", &reader);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE ROLE {reader} LOGIN; {grants}")))
        .execute(&admin)
        .await
        .expect("the reader grants of docs/security.md");
    let url = common::url_of(&opts.clone().username(&reader));
    let result = async {
        let inspector = durastep::inspect::Inspector::connect(&url).await.map_err(|e| format!("connect: {e}"))?;
        let page = inspector.runs(&RunFilter::new()).await.map_err(|e| format!("runs: {e}"))?;
        if page.runs.len() != 1 {
            return Err(format!("runs: {page:?}"));
        }
        let d = inspector.run(id).await.map_err(|e| format!("run: {e}"))?;
        if d.steps.len() != 1 {
            return Err(format!("steps: {:?}", d.steps));
        }
        inspector.why(id).await.map_err(|e| format!("why: {e}"))?;
        let counts = inspector.counts().await.map_err(|e| format!("counts: {e}"))?;
        let estimated = inspector.counts_estimated().await.map_err(|e| format!("counts_estimated: {e}"))?;
        if counts != estimated {
            return Err(format!("small tables are counted exactly: {counts:?} vs {estimated:?}"));
        }
        inspector.blockers(None, 10).await.map_err(|e| format!("blockers: {e}"))?;
        inspector.per_minute(Duration::from_secs(3600)).await.map_err(|e| format!("per_minute: {e}"))?;
        inspector.events(&EventFilter::new()).await.map_err(|e| format!("events: {e}"))?;
        inspector.functions().await.map_err(|e| format!("functions: {e}"))?;
        inspector.db_now().await.map_err(|e| format!("db_now: {e}"))?;
        // ... and writes nothing.
        if Engine::builder().database_url(&url).migrate(false).build().await.is_ok() {
            return Err("the reader role could build an engine (register functions)".into());
        }
        let pool = PgPoolOptions::new().max_connections(1).connect(&url).await.map_err(|e| e.to_string())?;
        if sqlx::query("UPDATE durastep.runs SET state = 'queued'").execute(&pool).await.is_ok() {
            return Err("the reader role could update runs".into());
        }
        if sqlx::query("DELETE FROM durastep.step_results").execute(&pool).await.is_ok() {
            return Err("the reader role could delete step results".into());
        }
        // Nor learns the idle workers' secret channels (docs/security.md).
        if sqlx::query("SELECT channel FROM durastep.worker_offers").execute(&pool).await.is_ok() {
            return Err("the reader role could read the workers' channels".into());
        }
        pool.close().await;
        Ok::<_, String>(())
    }
    .await;
    for sql in [format!("DROP OWNED BY {reader}"), format!("DROP ROLE {reader}")] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone())).execute(&admin).await.expect(&sql);
    }
    result.expect("the reader role of docs/security.md");
    w.stop().await;
}

/// The reader role's grants: the ```sql block after the marker in docs/security.md.
fn reader_grants() -> String {
    let doc = include_str!("../../../docs/security.md");
    let (_, after) = doc.split_once("<!-- reader-grants -->").expect("marker in docs/security.md");
    let block = after.split_once("```sql\n").expect("sql block").1;
    block.split_once("```").expect("end of sql block").0.to_owned()
}

/// Catches: an overview that counts every run on each reload. Past
/// `EXACT_COUNT_BELOW` runs, finished states come from the statistics (marked
/// estimated, close to the truth) and unfinished ones are still exact, in
/// every unfinished state (each read through its own partial index).
#[sqlx::test(migrations = false)]
async fn counts_are_estimated_from_statistics_on_large_tables(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, vec![]).await;
    let n = durastep::inspect::EXACT_COUNT_BELOW * 2;
    for sql in [
        "INSERT INTO durastep.events (id, name, payload, created_at)
         SELECT md5('e' || i)::uuid, 'x', '{}', durastep.now() FROM generate_series(1, $1::bigint) i",
        "INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, attempt, max_attempts, created_at,
                                    finished_at)
         SELECT md5('r' || i)::uuid, 'f' || (i % 3), md5('e' || i)::uuid,
                (ARRAY['completed', 'completed', 'failed', 'queued', 'sleeping', 'waiting', 'running',
                       'diverged'])[1 + i % 8], durastep.now(), 1, 3,
                durastep.now(), CASE WHEN i % 8 < 3 THEN durastep.now() END
           FROM generate_series(1, $1::bigint) i",
        // The running ones in a claim record, as a claim lists the runs it starts.
        "INSERT INTO durastep.run_claims (recheck_at, run_ids, epochs)
         SELECT durastep.now() + interval '1 hour', array_agg(id), array_agg(lease_epoch)
           FROM durastep.runs WHERE state = 'running' AND $1::bigint > 0",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql)).bind(n).execute(engine.pool()).await.expect(sql);
    }
    sqlx::query("ANALYZE durastep.runs").execute(engine.pool()).await.expect("analyze");
    let exact = engine.inspect().counts().await.unwrap();
    let estimated = engine.inspect().counts_estimated().await.unwrap();
    assert_eq!(exact.len(), estimated.len(), "{exact:?}\n{estimated:?}");
    for (e, s) in exact.iter().zip(&estimated) {
        assert_eq!((&e.function_id, e.state), (&s.function_id, s.state));
        if e.state.is_finished() {
            assert!(s.estimated, "{s:?}");
            let off = (s.count - e.count).abs() as f64 / e.count as f64;
            assert!(off < 0.1, "estimate {s:?} against {e:?}");
        } else {
            assert_eq!((s.count, s.estimated), (e.count, false), "{s:?}");
        }
    }
}

/// Step results and journal entries have no foreign key on their run (the
/// fenced writes make it redundant, migration 0016): a DELETE of runs, by any
/// path, and a TRUNCATE of runs still take them along.
/// Catches: a statement on runs that would leave orphaned step rows behind.
#[sqlx::test(migrations = false)]
async fn deleting_or_truncating_runs_takes_their_steps_along(_p: PgPoolOptions, opts: PgConnectOptions) {
    // Two steps (their journal entries on their step rows) and a `changed`
    // marker (its entry in `step_journal`).
    let f = Function::new("two").on_event("two/go").handler(|ctx: Ctx, _: Value| async move {
        ctx.step("a", || async { Ok(1) }).await?;
        ctx.step("b", || async { Ok(2) }).await?;
        assert!(ctx.changed("two-steps").await?);
        Ok(())
    });
    let engine = common::engine(&opts, vec![f]).await;
    let ids: Vec<_> = engine
        .send_batch((0..4).map(|i| Event::new("two/go", &json!({"i": i}))).collect())
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.run_ids[0])
        .collect();
    let w = common::spawn_worker(&engine);
    for id in &ids {
        common::finished(&engine, *id).await;
    }
    w.stop().await;
    assert_eq!(common::count(&engine, "durastep.step_results").await, 8);
    assert_eq!(common::count(&engine, "durastep.step_journal").await, 4);
    assert_eq!(common::count(&engine, "durastep.run_journal").await, 12);
    sqlx::query("DELETE FROM durastep.runs WHERE id = $1").bind(ids[0]).execute(engine.pool()).await.unwrap();
    assert_eq!(common::count(&engine, "durastep.step_results").await, 6);
    assert_eq!(common::count(&engine, "durastep.step_journal").await, 3);
    sqlx::query("TRUNCATE durastep.runs CASCADE").execute(engine.pool()).await.unwrap();
    assert_eq!(common::count(&engine, "durastep.step_results").await, 0);
    assert_eq!(common::count(&engine, "durastep.step_journal").await, 0);
    // Listing the step tables in the same TRUNCATE works too.
    sqlx::query("TRUNCATE durastep.events, durastep.runs, durastep.step_results, durastep.step_journal CASCADE")
        .execute(engine.pool())
        .await
        .unwrap();
}

/// Since migration 0020 the claims and the completion write their history rows
/// themselves and a row trigger writes the rest. Catches: a transition
/// recorded twice (by the statement and by the trigger) or not at all, on
/// either claim: the fast claim (a function without flow rules) and the full
/// claim (a concurrency-limited function), each through a retry (the failure
/// is recorded by the trigger) and a completion.
#[sqlx::test(migrations = false)]
async fn each_transition_is_recorded_once_on_the_fast_and_the_full_claim(_p: PgPoolOptions, opts: PgConnectOptions) {
    let failing = |id: &str, limited: bool| {
        let tries = Arc::new(AtomicU32::new(0));
        let f = Function::new(id).on_event("once/go").retries(2).backoff(Backoff::Fixed(Duration::ZERO));
        let f = if limited { f.concurrency(durastep::Concurrency::new(1).key("/k")) } else { f };
        f.handler(move |_ctx: Ctx, _: Value| {
            let tries = tries.clone();
            async move {
                if tries.fetch_add(1, Ordering::SeqCst) == 0 {
                    return Err(HandlerError::new("first attempt fails"));
                }
                Ok(json!("done"))
            }
        })
    };
    let (fast, full) = (failing("once-fast", false), failing("once-full", true));
    let engine = common::engine(&opts, vec![fast, full]).await;
    let sent = engine.send(Event::new("once/go", &json!({"k": "a"}))).await.unwrap();
    let w = common::spawn_worker(&engine);
    for id in &sent.run_ids {
        assert_eq!(common::finished(&engine, *id).await.state, RunState::Completed);
    }
    w.stop().await;
    for id in &sent.run_ids {
        let d = engine.inspect().run(*id).await.unwrap();
        let states = timeline_states(&d);
        assert_eq!(
            states,
            [RunState::Running, RunState::Queued, RunState::Running, RunState::Completed],
            "{}",
            d.run.function_id
        );
        let attempts: Vec<u32> = d.history.iter().map(|h| h.attempt).collect();
        assert_eq!(attempts, [1, 2, 2, 2], "{}", d.run.function_id);
        assert!(d.history[0].worker_id.is_some() && d.history[2].worker_id.is_some());
        assert_eq!(d.history[1].error.as_deref(), Some("first attempt fails"));
    }
}

/// The states of a run's timeline entries, in order.
fn timeline_states(d: &durastep::inspect::RunDetail) -> Vec<RunState> {
    d.history.iter().map(|h| h.state).collect()
}

/// A run's history rows as stored: (state, whether the row carries an
/// attempt's start, the started attempt's number), oldest first.
async fn history_rows(engine: &Engine, id: Uuid) -> Vec<(String, bool, Option<i32>)> {
    sqlx::query_as(
        "SELECT state, started_at IS NOT NULL, started_attempt FROM durastep.run_history
          WHERE run_id = $1 ORDER BY seq",
    )
    .bind(id)
    .fetch_all(engine.pool())
    .await
    .expect("the history rows")
}

/// Catches (migration 0044): a claim that writes a history row of its own
/// again (two rows per attempt: the first assertion on the rows), an end
/// that does not carry its attempt's start (no `running` entry in the
/// timeline), and a start noted on the run by an earlier attempt read as the
/// start of a later attempt that a claim of an earlier version made (which
/// sets a new `claim_id`, notes no start and writes its own `running` row):
/// the timeline would then show that attempt started twice, once at the
/// earlier attempt's time. Checked: with the view's comparison of
/// `attempt_claim_id` with `claim_id` taken out (and the trigger's), the
/// timeline holds a stale fourth `running` entry while the older claim
/// runs; with the trigger's alone taken out, a stale `running` entry
/// before the reaping's `queued`.
#[sqlx::test(migrations = false)]
async fn each_attempt_is_one_history_row_and_an_older_claim_keeps_its_own_start(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let tries = Arc::new(AtomicU32::new(0));
    let counted = tries.clone();
    let f = Function::new("rows").on_event("rows/go").retries(2).backoff(Backoff::Fixed(Duration::from_secs(3600)));
    let f = f.handler(move |_ctx: Ctx, _: Value| {
        let tries = counted.clone();
        async move {
            if tries.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(HandlerError::new("first attempt fails"));
            }
            Ok(json!("done"))
        }
    });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("rows/go", &json!({}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_for_run_where(&engine, id, "the first attempt to fail", |r| r.attempt == 2).await;
    w.stop().await;
    // The claim wrote no row; the failure's row carries the attempt's start.
    assert_eq!(history_rows(&engine, id).await, [("queued".to_owned(), true, Some(1))]);

    // A claim as processes of 0034-0043 make it: a new claim record (listed
    // for the reaper), its own `running` row, the mark flipped, no start
    // noted; its lease already lapsed.
    common::claim_as_earlier_version(&engine, id, common::EarlierClaim::Listed).await;
    let d = engine.inspect().run(id).await.unwrap();
    assert_eq!(
        timeline_states(&d),
        [RunState::Running, RunState::Queued, RunState::Running],
        "while the older claim runs"
    );

    assert_eq!(engine.reap_expired_leases().await.unwrap(), 1);
    let d = engine.inspect().run(id).await.unwrap();
    assert_eq!(
        timeline_states(&d),
        [RunState::Running, RunState::Queued, RunState::Running, RunState::Queued],
        "after the older claim's lease was reaped"
    );

    // Claimed again by this version, and completed.
    let w = common::spawn_worker(&engine);
    durastep::testing::advance_clock(&engine, Duration::from_secs(3601)).await.unwrap();
    assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);
    w.stop().await;
    let d = engine.inspect().run(id).await.unwrap();
    assert_eq!(
        timeline_states(&d),
        [
            RunState::Running,
            RunState::Queued,
            RunState::Running,
            RunState::Queued,
            RunState::Running,
            RunState::Completed
        ]
    );
    assert!(
        d.history.windows(2).all(|p| p[0].at <= p[1].at),
        "{:?}",
        d.history.iter().map(|h| h.at).collect::<Vec<_>>()
    );
    // The completion is the run's own (migration 0045): no row of its own.
    assert_eq!(
        history_rows(&engine, id).await,
        [("queued".to_owned(), true, Some(1)), ("running".to_owned(), false, None), ("queued".to_owned(), false, None),]
    );
}

/// Catches (migration 0044): a run taken over by hand while it runs (a new
/// lease, the claim record unchanged, so no claim noted a start) whose
/// timeline keeps the start the worker's claim noted on the run as the new
/// attempt's too: a stale third `running` entry while the taken-over
/// attempt runs, and its end's row carrying that start again after the
/// reaping. The trigger writes both starts as rows and forgets the noted
/// one. Checked: without the trigger's forgetting, the timeline holds the
/// stale third entry while the taken-over attempt runs.
#[sqlx::test(migrations = false)]
async fn a_run_taken_over_by_hand_keeps_each_start_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    let calls = Arc::new(AtomicU32::new(0));
    let gate = Arc::new(tokio::sync::Notify::new());
    let (counted, held) = (calls.clone(), gate.clone());
    let f = Function::new("hand").on_event("hand/go").handler(move |_ctx: Ctx, _: Value| {
        let (calls, gate) = (counted.clone(), held.clone());
        async move {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                gate.notified().await;
            }
            Ok(json!("done"))
        }
    });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("hand/go", &json!({}))).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    common::wait_until("the first attempt to start", || async { calls.load(Ordering::SeqCst) == 1 }).await;

    // Taken over by hand: a new lease whose time has passed, no mark
    // flipped, the claim record unchanged (the trigger lists it).
    sqlx::query(
        "UPDATE durastep.runs SET lease_epoch = lease_epoch + 1, worker_id = gen_random_uuid(),
                lease_expires_at = durastep.now() - interval '1 second'
          WHERE id = $1 AND state = 'running'",
    )
    .bind(id)
    .execute(engine.pool())
    .await
    .unwrap();
    let d = engine.inspect().run(id).await.unwrap();
    assert_eq!(timeline_states(&d), [RunState::Running, RunState::Running], "while the taken-over attempt runs");
    assert_eq!(
        history_rows(&engine, id).await,
        [("running".to_owned(), false, None), ("running".to_owned(), false, None)]
    );

    engine.reap_expired_leases().await.unwrap();
    common::wait_for_run_where(&engine, id, "the taken-over attempt to be reaped", |r| {
        r.state != RunState::Running || r.attempt > 1
    })
    .await;
    gate.notify_one();
    assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);
    w.stop().await;
    let d = engine.inspect().run(id).await.unwrap();
    assert_eq!(
        timeline_states(&d),
        [RunState::Running, RunState::Running, RunState::Queued, RunState::Running, RunState::Completed]
    );
    let rows = history_rows(&engine, id).await;
    assert_eq!(rows[2], ("queued".to_owned(), false, None), "{rows:?}");
    // The last attempt's start and its completion are the run's (0045).
    assert_eq!(rows.len(), 3, "{rows:?}");
}

/// Catches (migration 0045): a completion that writes a history row again
/// (the first assertion on the rows), a completed run's timeline without its
/// last attempt's start or its completion (which the run carries), or with
/// the completion twice when a history row has it too (an earlier version's
/// completion: the view must take the row and not the run), a completion the
/// trigger does not write as a row before plain SQL changes the run (the
/// timeline would lose it), and per-minute counts that miss either kind.
/// Checked: without the view's test for a `completed` row, the earlier
/// version's completion is in the timeline twice; without the trigger's
/// branch for a completed run, the requeued run's timeline has no
/// `completed` entry.
#[sqlx::test(migrations = false)]
async fn a_completion_is_carried_by_its_run_and_written_as_a_row_when_the_run_moves_on(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let f = Function::new("kept").on_event("kept/go").handler(|_: Ctx, _: Value| async move { Ok(json!("done")) });
    let engine = common::engine(&opts, vec![f]).await;
    let ids: Vec<Uuid> = engine
        .send_batch((0..2).map(|i| Event::new("kept/go", &json!({"i": i}))).collect())
        .await
        .unwrap()
        .iter()
        .map(|s| s.run_ids[0])
        .collect();
    let w = common::spawn_worker(&engine);
    for id in &ids {
        assert_eq!(common::finished(&engine, *id).await.state, RunState::Completed);
    }
    w.stop().await;
    let (carried, moved) = (ids[0], ids[1]);

    // No row: the start and the completion are read from the run, the
    // start with the worker that ran it, the completion at its finish.
    assert_eq!(history_rows(&engine, carried).await, []);
    let d = engine.inspect().run(carried).await.unwrap();
    assert_eq!(timeline_states(&d), [RunState::Running, RunState::Completed]);
    assert!(d.history[0].worker_id.is_some() && d.history[1].worker_id.is_none(), "{:?}", d.history);
    assert_eq!(Some(d.history[1].at), d.run.finished_at);
    assert!(d.history[0].at <= d.history[1].at);
    assert_eq!(d.attempts.len(), 1, "{:?}", d.attempts);
    assert_eq!(d.attempts[0].worker_id, d.history[0].worker_id);

    // Plain SQL puts the other completed run back in the queue: the trigger
    // writes its completion as a row first, with its start.
    sqlx::query("UPDATE durastep.runs SET state = 'queued', worker_id = NULL WHERE id = $1")
        .bind(moved)
        .execute(engine.pool())
        .await
        .unwrap();
    assert_eq!(
        history_rows(&engine, moved).await,
        [("completed".to_owned(), true, Some(1)), ("queued".to_owned(), false, None)]
    );
    let d = engine.inspect().run(moved).await.unwrap();
    assert_eq!(timeline_states(&d), [RunState::Running, RunState::Completed, RunState::Queued]);
    assert!(d.history[0].worker_id.is_some(), "{:?}", d.history);

    // A completion as processes of 0044 write it: the worker cleared, the
    // mark flipped, a `completed` row with its start. The timeline shows
    // the row, once; the minute counts it once.
    let old = engine.send(Event::new("kept/go", &json!({"old": true}))).await.unwrap().run_ids[0];
    common::claim_as_earlier_version(&engine, old, common::EarlierClaim::Listed).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "WITH fin AS (
             UPDATE durastep.runs r SET state = 'completed', output = 'null', finished_at = durastep.now(),
                    lease_expires_at = NULL, worker_id = NULL, history_noted = NOT r.history_noted
              WHERE r.id = '{old}' RETURNING r.id, r.attempt, r.lease_epoch, r.finished_at)
         INSERT INTO durastep.run_history (run_id, at, state, attempt, lease_epoch)
         SELECT fin.id, fin.finished_at, 'completed', fin.attempt, fin.lease_epoch FROM fin"
    )))
    .execute(engine.pool())
    .await
    .unwrap();
    let d = engine.inspect().run(old).await.unwrap();
    assert_eq!(timeline_states(&d), [RunState::Running, RunState::Completed]);
    let minutes = engine.inspect().per_minute(Duration::from_secs(3600)).await.unwrap();
    let completed: i64 = minutes.iter().map(|m| m.completed).sum();
    assert_eq!(completed, 3, "two completions counted by the minute, one by its row: {minutes:?}");

    // Pruned like every finished run, though its worker is still named.
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    assert_eq!(engine.inspect().prunable(Duration::from_secs(86_400)).await.unwrap(), 2);
    engine.prune(Duration::from_secs(86_400)).await.unwrap();
    assert_eq!(common::count(&engine, &format!("durastep.runs WHERE id = '{carried}'")).await, 0);
    assert_eq!(common::count(&engine, "durastep.completions_per_minute").await, 0);
}

/// Scans of `durastep.runs_listed_by_state` so far, as the statistics have them.
async fn listed_by_state_scans(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT idx_scan FROM pg_stat_user_indexes WHERE indexrelid = 'durastep.runs_listed_by_state'::regclass",
    )
    .fetch_one(pool)
    .await
    .expect("the index's statistics")
}

/// Catches: a listing by state that a generic plan cannot serve from
/// `runs_listed_by_state`. The states are a parameter, so the planner
/// cannot prove the index's predicate from `state = ANY ($n)` alone; the
/// listing restates the predicate (`listed_states` in the store), and
/// without it a generic plan walks the primary key past every completed
/// run (docs/performance.md "Counted instructions": 3.8 ms against 0.38 ms
/// among 100,000 runs). The inspector's connections here make only generic
/// plans, as a connection's kept plan becomes after five executions.
#[sqlx::test(migrations = false)]
async fn a_listing_by_state_reads_its_index_under_a_generic_plan(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, vec![]).await;
    // 20,000 completed runs and 20 failed ones, with time-ordered ids.
    for sql in [
        "INSERT INTO durastep.events (id, name, payload)
         SELECT durastep.uuid7(), 'x', '{}' FROM generate_series(1, 20020)",
        "INSERT INTO durastep.runs (id, function_id, event_id, state, run_at, max_attempts, finished_at)
         SELECT durastep.uuid7(), 'f', e.id, CASE WHEN e.n <= 20 THEN 'failed' ELSE 'completed' END,
                durastep.now(), 3, durastep.now()
           FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM durastep.events) e",
        "ANALYZE durastep.runs",
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql)).execute(engine.pool()).await.expect(sql);
    }
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts.clone().options([("plan_cache_mode", "force_generic_plan")]))
        .await
        .expect("the inspector's pool");
    let inspector = durastep::inspect::Inspector::from_pool(pool.clone());
    let before = listed_by_state_scans(engine.pool()).await;
    let page = inspector.runs(&RunFilter::new().state(RunState::Failed).limit(10)).await.expect("list failed runs");
    assert_eq!(page.runs.len(), 10);
    assert!(page.runs.iter().all(|r| r.state == RunState::Failed), "{:?}", page.runs);
    // The listing's backend reports its statistics when it next goes idle.
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(&pool).await.expect("flush the statistics");
    let scans = listed_by_state_scans(engine.pool()).await - before;
    assert!(scans > 0, "the listing of failed runs did not read runs_listed_by_state under a generic plan");
}
