//! Safe deploys: divergence detection at replay, `Ctx::changed`, the
//! `diverged` state and its operator actions, and `Engine::check_deploy`.
//!
//! The v1/v2 variant test: v1 of a function is `a, nap1, b, nap2, c`. Two
//! runs are left asleep, one at each nap (`early` at nap1, `late` at nap2).
//! Then the code is switched to a v2 variant (rename, insert, remove or
//! reorder a step; a change guarded with `changed`), the deploy check is run,
//! and the runs are resumed under v2.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::inspect::Why;
use durastep::{Ctx, Engine, EntryKind, Event, Function, HandlerResult, JournalEntry, RunState};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

const NAP: Duration = Duration::from_secs(86_400);

/// The v2 variants of the function (v1 is `V1`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    V1,
    /// `b` renamed `b2`.
    Rename,
    /// A step `x` inserted between `a` and `nap1`.
    Insert,
    /// `b` removed.
    Remove,
    /// `c` moved before `b` (`a, nap1, c, nap2, b`).
    Reorder,
    /// `x` inserted between `a` and `nap1`, guarded with `changed("add-x")`.
    Guarded,
    /// By input (deterministic): `n = 1` (the late run) takes `Rename`'s
    /// path, any other `n` `Insert`'s.
    PerInput,
}

/// The function in a variant; `bodies` counts every step body that runs.
fn flow(variant: Variant, bodies: Arc<AtomicU32>) -> Function {
    flow_named("flow", variant, bodies)
}

/// [`flow`] under another id (triggered by `<id>/go`).
fn flow_named(id: &str, variant: Variant, bodies: Arc<AtomicU32>) -> Function {
    Function::new(id).on_event(format!("{id}/go")).handler(move |ctx: Ctx, input: Value| {
        let bodies = bodies.clone();
        let variant = match variant {
            Variant::PerInput if input["n"] == 1 => Variant::Rename,
            Variant::PerInput => Variant::Insert,
            v => v,
        };
        async move {
            let step = |name: &'static str| {
                let (ctx, bodies) = (ctx.clone(), bodies.clone());
                async move {
                    ctx.step(name, || async move {
                        bodies.fetch_add(1, Ordering::SeqCst);
                        Ok(name.to_owned())
                    })
                    .await
                }
            };
            let mut path: Vec<String> = vec![step("a").await?];
            match variant {
                Variant::Insert => path.push(step("x").await?),
                Variant::Guarded if ctx.changed("add-x").await? => path.push(step("x").await?),
                _ => {}
            }
            ctx.sleep("nap1", NAP).await?;
            match variant {
                Variant::Rename => path.push(step("b2").await?),
                Variant::Remove => {}
                Variant::Reorder => path.push(step("c").await?),
                _ => path.push(step("b").await?),
            }
            ctx.sleep("nap2", NAP).await?;
            match variant {
                Variant::Reorder => path.push(step("b").await?),
                _ => path.push(step("c").await?),
            }
            HandlerResult::Ok(path.join(","))
        }
    })
}

async fn engine(opts: &PgConnectOptions, variant: Variant, bodies: &Arc<AtomicU32>) -> Engine {
    common::engine(opts, vec![flow(variant, bodies.clone())]).await
}

async fn state_is(engine: &Engine, id: Uuid, state: RunState) -> durastep::Run {
    common::wait_for_run_where(engine, id, &format!("the run to be {state}"), |r| r.state == state).await
}

/// Runs v1 until `late` sleeps at nap2 and `early` at nap1; returns (early, late).
async fn leave_runs_asleep(opts: &PgConnectOptions) -> (Uuid, Uuid) {
    leave_asleep(opts, &["flow"]).await[0]
}

/// [`leave_runs_asleep`] for v1 of each of these functions; (early, late) per function.
async fn leave_asleep(opts: &PgConnectOptions, ids: &[&str]) -> Vec<(Uuid, Uuid)> {
    let bodies = Arc::new(AtomicU32::new(0));
    let functions = ids.iter().map(|id| flow_named(id, Variant::V1, bodies.clone())).collect();
    let v1 = common::engine(opts, functions).await;
    let w = common::spawn_worker(&v1);
    let mut lates = Vec::new();
    for id in ids {
        let late = v1.send(Event::new(format!("{id}/go"), &json!({"n": 1}))).await.unwrap().run_ids[0];
        state_is(&v1, late, RunState::Sleeping).await;
        lates.push(late);
    }
    durastep::testing::advance_clock(&v1, NAP + Duration::from_secs(1)).await.unwrap();
    for &late in &lates {
        common::wait_until("late to sleep at nap2", || async {
            common::step_row(&v1, late, "nap2").await.is_some()
                && v1.run(late).await.unwrap().state == RunState::Sleeping
        })
        .await;
    }
    let mut out = Vec::new();
    for (id, late) in ids.iter().zip(lates) {
        let early = v1.send(Event::new(format!("{id}/go"), &json!({"n": 2}))).await.unwrap().run_ids[0];
        state_is(&v1, early, RunState::Sleeping).await;
        out.push((early, late));
    }
    drop(w);
    out
}

/// Everything the check could write: every table's rows, as text.
async fn snapshot(engine: &Engine) -> Vec<String> {
    snapshot_pool(engine.pool()).await
}

fn entry(kind: EntryKind, key: &str) -> Option<JournalEntry> {
    Some(JournalEntry::new(kind, key))
}

/// Checks the report against the expected divergences (function "flow"):
/// (position, recorded, asked, runs).
fn expect_report(report: &durastep::DeployReport, expected: &[(u32, Option<JournalEntry>, Option<JournalEntry>, u64)]) {
    assert!(report.problems.is_empty(), "{report}");
    assert_eq!(report.runs_checked, 2, "{report}");
    let got: Vec<(u32, Option<JournalEntry>, Option<JournalEntry>, u64)> = report
        .diverging
        .iter()
        .map(|g| (g.position, g.example.recorded.clone(), g.example.asked.clone(), g.runs))
        .collect();
    assert_eq!(got, expected, "{report}");
    assert_eq!(report.is_safe(), expected.is_empty());
}

/// Switches to `variant`: checks the deploy (no body runs, nothing written),
/// then runs a worker and returns the engine.
async fn switch_and_check(
    opts: &PgConnectOptions,
    variant: Variant,
    expected: &[(u32, Option<JournalEntry>, Option<JournalEntry>, u64)],
) -> (Engine, Arc<AtomicU32>) {
    let bodies = Arc::new(AtomicU32::new(0));
    let v2 = engine(opts, variant, &bodies).await;
    let before = snapshot(&v2).await;
    let report = v2.check_deploy().await.unwrap();
    expect_report(&report, expected);
    assert_eq!(bodies.load(Ordering::SeqCst), 0, "the check ran a step body");
    assert_eq!(snapshot(&v2).await, before, "the check wrote something");
    (v2, bodies)
}

/// Drives a run to its end: whenever it sleeps, moves the clock past its wake time.
async fn driven(engine: &Engine, id: Uuid) -> durastep::Run {
    let deadline = tokio::time::Instant::now() + common::DEADLINE;
    loop {
        let run = engine.run(id).await.unwrap();
        if run.state.is_finished() || run.state == RunState::Diverged {
            return run;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out driving the run; it is {run:?}");
        if run.state == RunState::Sleeping {
            let now = durastep::testing::db_now(engine).await.unwrap();
            if run.run_at > now {
                let by = (run.run_at - now).to_std().unwrap() + Duration::from_secs(1);
                durastep::testing::advance_clock(engine, by).await.unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wakes every sleeper: moves the clock past both naps.
async fn wake_all(engine: &Engine) {
    durastep::testing::advance_clock(engine, 2 * NAP + Duration::from_secs(2)).await.unwrap();
}

/// The diverged run: parked, `why` says where, and the divergence is typed.
async fn parked(engine: &Engine, id: Uuid, position: u32, recorded: Option<JournalEntry>, asked: Option<JournalEntry>) {
    let run = state_is(engine, id, RunState::Diverged).await;
    assert!(run.last_error.as_deref().unwrap_or("").contains(&format!("position {position}")), "{run:?}");
    match engine.inspect().why(id).await.unwrap() {
        Why::Diverged { divergence: Some(d), .. } => {
            assert_eq!((d.run_id, d.function_id.as_str(), d.position), (id, "flow", position));
            assert_eq!((d.recorded, d.asked), (recorded, asked));
        }
        other => panic!("why: {other:?}"),
    }
    // Parked: not retried, not failed.
    common::stays(engine, id, Duration::from_millis(300), "diverged", |r| r.state == RunState::Diverged).await;
}

/// Rename: the run that recorded `b` diverges at position 2 (recorded step b,
/// asked step b2); the run that had not reached it runs v2's path. Catches: a
/// renamed step silently running again under its new name.
#[sqlx::test(migrations = false)]
async fn renamed_step_diverges_where_it_was_recorded(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (early, late) = leave_runs_asleep(&opts).await;
    let expected = [(2, entry(EntryKind::Step, "b"), entry(EntryKind::Step, "b2"), 1)];
    let (v2, _) = switch_and_check(&opts, Variant::Rename, &expected).await;
    let w = common::spawn_worker(&v2);
    wake_all(&v2).await;
    parked(&v2, late, 2, entry(EntryKind::Step, "b"), entry(EntryKind::Step, "b2")).await;
    let done = driven(&v2, early).await;
    assert_eq!(done.output, Some(json!("a,b2,c")));
    w.stop().await;
}

/// Insert: both runs recorded `nap1` at position 1 where v2 asks for `x`.
#[sqlx::test(migrations = false)]
async fn inserted_step_diverges_every_run_past_it(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (early, late) = leave_runs_asleep(&opts).await;
    let expected = [(1, entry(EntryKind::Sleep, "nap1"), entry(EntryKind::Step, "x"), 2)];
    let (v2, _) = switch_and_check(&opts, Variant::Insert, &expected).await;
    let w = common::spawn_worker(&v2);
    wake_all(&v2).await;
    for id in [early, late] {
        parked(&v2, id, 1, entry(EntryKind::Sleep, "nap1"), entry(EntryKind::Step, "x")).await;
    }
    w.stop().await;
}

/// Remove: the run that recorded `b` diverges (recorded step b, asked sleep nap2).
#[sqlx::test(migrations = false)]
async fn removed_step_diverges(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (early, late) = leave_runs_asleep(&opts).await;
    let expected = [(2, entry(EntryKind::Step, "b"), entry(EntryKind::Sleep, "nap2"), 1)];
    let (v2, _) = switch_and_check(&opts, Variant::Remove, &expected).await;
    let w = common::spawn_worker(&v2);
    wake_all(&v2).await;
    parked(&v2, late, 2, entry(EntryKind::Step, "b"), entry(EntryKind::Sleep, "nap2")).await;
    assert_eq!(driven(&v2, early).await.output, Some(json!("a,c")));
    w.stop().await;
}

/// Reorder: the run that recorded `b` at position 2 is asked for `c` there.
/// Catches: a reordered step handed the stored result of another.
#[sqlx::test(migrations = false)]
async fn reordered_steps_diverge(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (early, late) = leave_runs_asleep(&opts).await;
    let expected = [(2, entry(EntryKind::Step, "b"), entry(EntryKind::Step, "c"), 1)];
    let (v2, _) = switch_and_check(&opts, Variant::Reorder, &expected).await;
    let w = common::spawn_worker(&v2);
    wake_all(&v2).await;
    parked(&v2, late, 2, entry(EntryKind::Step, "b"), entry(EntryKind::Step, "c")).await;
    assert_eq!(driven(&v2, early).await.output, Some(json!("a,c,b")));
    w.stop().await;
}

/// Guarded with `changed`: no run diverges; the runs in flight keep the old
/// path (no `x`), a new run takes the new one and replays it after its sleeps.
#[sqlx::test(migrations = false)]
async fn guarded_change_keeps_old_runs_on_the_old_path(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (early, late) = leave_runs_asleep(&opts).await;
    let (v2, _) = switch_and_check(&opts, Variant::Guarded, &[]).await;
    let w = common::spawn_worker(&v2);
    let fresh = v2.send(Event::new("flow/go", &json!({"n": 3}))).await.unwrap().run_ids[0];
    state_is(&v2, fresh, RunState::Sleeping).await;
    // The new run's marker is recorded; the deploy check still passes with it.
    let report = v2.check_deploy().await.unwrap();
    assert!(report.is_safe() && report.runs_checked == 3, "{report}");
    wake_all(&v2).await;
    assert_eq!(driven(&v2, early).await.output, Some(json!("a,b,c")));
    assert_eq!(driven(&v2, late).await.output, Some(json!("a,b,c")));
    common::wait_until("the new run to wake", || async {
        common::step_row(&v2, fresh, "b").await.is_some() || v2.run(fresh).await.unwrap().state.is_finished()
    })
    .await;
    wake_all(&v2).await;
    assert_eq!(driven(&v2, fresh).await.output, Some(json!("a,x,b,c")));
    w.stop().await;
}

/// The handler returns while recorded entries were never asked for (the last
/// steps removed): the run diverges (asked: nothing) instead of completing.
#[sqlx::test(migrations = false)]
async fn handler_that_skips_recorded_entries_diverges(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (_early, late) = leave_runs_asleep(&opts).await;
    let short = Function::new("flow")
        .on_event("flow/go")
        .handler(|ctx: Ctx, _: Value| async move { ctx.step("a", || async { Ok("a".to_owned()) }).await });
    let v2 = common::engine(&opts, vec![short]).await;
    let report = v2.check_deploy().await.unwrap();
    assert_eq!(report.diverging_runs(), 2, "{report}");
    assert!(report.diverging.iter().all(|g| g.position == 1 && g.example.asked.is_none()), "{report}");
    let w = common::spawn_worker(&v2);
    wake_all(&v2).await;
    parked(&v2, late, 1, entry(EntryKind::Sleep, "nap1"), None).await;
    w.stop().await;
}

/// Operator actions: a diverged run resumes once the code is fixed (back to
/// v1 here), and one discarded from its divergence position runs v2's path
/// from there, keeping what came before (its `a` body does not run again).
#[sqlx::test(migrations = false)]
async fn diverged_runs_resume_or_discard(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (early, late) = leave_runs_asleep(&opts).await;
    {
        let (v2, _) = switch_and_check(
            &opts,
            Variant::Insert,
            &[(1, entry(EntryKind::Sleep, "nap1"), entry(EntryKind::Step, "x"), 2)],
        )
        .await;
        let w = common::spawn_worker(&v2);
        wake_all(&v2).await;
        state_is(&v2, early, RunState::Diverged).await;
        state_is(&v2, late, RunState::Diverged).await;
        // Discard `early` from position 1: under v2 it runs x, nap1, b, nap2, c.
        v2.discard_from(early, 1).await.unwrap();
        common::wait_until("early to sleep again", || async { common::step_row(&v2, early, "x").await.is_some() })
            .await;
        wake_all(&v2).await;
        common::wait_until("early to pass nap1", || async { common::step_row(&v2, early, "b").await.is_some() }).await;
        wake_all(&v2).await;
        assert_eq!(driven(&v2, early).await.output, Some(json!("a,x,b,c")));
        // Not diverged any more: a second action is refused, nothing changes.
        let err = v2.resume_diverged(early).await.unwrap_err();
        assert!(matches!(err, durastep::Error::NotDiverged { state: RunState::Completed, .. }), "{err}");
        drop(w);
    }
    // The code is fixed (v1 again): `late` resumes where it was.
    let bodies = Arc::new(AtomicU32::new(0));
    let fixed = engine(&opts, Variant::V1, &bodies).await;
    assert!(fixed.check_deploy().await.unwrap().is_safe());
    let w = common::spawn_worker(&fixed);
    fixed.resume_diverged(late).await.unwrap();
    assert_eq!(driven(&fixed, late).await.output, Some(json!("a,b,c")));
    // Only `c` ran: a and b were replayed.
    assert_eq!(bodies.load(Ordering::SeqCst), 1);
    assert!(matches!(fixed.resume_diverged(Uuid::nil()).await, Err(durastep::Error::UnknownRun(_))));
    w.stop().await;
}

/// Moves every entry stored on a step row to `step_journal`, as an engine
/// before migration 0029 stored them (the step rows keep no position).
async fn store_entries_as_before_0029(engine: &Engine) -> u64 {
    let mut tx = engine.pool().begin().await.unwrap();
    let moved = sqlx::query(
        "INSERT INTO durastep.step_journal (run_id, position, kind, step_key)
         SELECT run_id, position, kind, step_key FROM durastep.step_results WHERE position IS NOT NULL",
    )
    .execute(&mut *tx)
    .await
    .unwrap()
    .rows_affected();
    sqlx::query("UPDATE durastep.step_results SET position = NULL, kind = NULL WHERE position IS NOT NULL")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    moved
}

/// A checkpoint's journal entry is its step row's `position` and `kind`
/// (migration 0029): the v1 runs left asleep wrote no `step_journal` row for
/// their steps and sleeps. Runs whose entries were stored before 0029 (in
/// `step_journal`, step rows without a position) replay and diverge as
/// before: the check and the replay find the renamed step at position 2, the
/// early run replays `a` and `nap1` from the old entries and completes v2's
/// path, and discarding the late run from position 2 deletes its old-format
/// entries and their step rows (`b`, `nap2`), so it runs `b2, nap2, c`.
/// Catches: a claim that reads the journal from one of the two places only
/// (the old runs would replay as new ground and run `a` again, or the new
/// ones diverge at every position), and a discard that leaves one of them.
#[sqlx::test(migrations = false)]
async fn entries_stored_before_0029_replay_and_diverge(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (early, late) = leave_runs_asleep(&opts).await;
    let bodies = Arc::new(AtomicU32::new(0));
    let v1 = engine(&opts, Variant::V1, &bodies).await;
    assert_eq!(common::count(&v1, "durastep.step_journal").await, 0, "steps and sleeps are on their step rows");
    // early: a, nap1; late: a, nap1, b, nap2.
    assert_eq!(common::count(&v1, "durastep.run_journal").await, 6);
    assert_eq!(store_entries_as_before_0029(&v1).await, 6);
    let expected = [(2, entry(EntryKind::Step, "b"), entry(EntryKind::Step, "b2"), 1)];
    let (v2, bodies) = switch_and_check(&opts, Variant::Rename, &expected).await;
    let w = common::spawn_worker(&v2);
    wake_all(&v2).await;
    parked(&v2, late, 2, entry(EntryKind::Step, "b"), entry(EntryKind::Step, "b2")).await;
    assert_eq!(driven(&v2, early).await.output, Some(json!("a,b2,c")));
    assert_eq!(bodies.load(Ordering::SeqCst), 2, "only b2 and c ran; a was replayed");
    assert_eq!(
        common::journal(&v2, early).await,
        ["0 step a", "1 sleep nap1", "2 step b2", "3 sleep nap2", "4 step c"]
    );
    v2.discard_from(late, 2).await.unwrap();
    common::wait_until("late to sleep at nap2 again", || async { common::step_row(&v2, late, "b2").await.is_some() })
        .await;
    assert!(common::step_row(&v2, late, "b").await.is_none(), "the discarded step row is gone");
    assert_eq!(driven(&v2, late).await.output, Some(json!("a,b2,c")));
    w.stop().await;
}

/// Two joined `wait_for_event`s each record their journal entry (positions 0
/// and 1, kind `wait`), even when one of them suspends the run before the
/// other is registered; the run completes with both events and never parks
/// `diverged`. Catches: a joined wait's entry written by a separate statement
/// that requires a `running` run, which a sibling wait had already suspended
/// (the attempt then ended fenced and the entry was missing at replay).
#[sqlx::test(migrations = false)]
async fn joined_waits_are_both_journaled(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let f = Function::new("both").on_event("go").handler(|ctx: Ctx, _: ()| async move {
        let hour = Duration::from_secs(3600);
        let any = durastep::EventMatch::any;
        let (a, b) = tokio::join!(
            ctx.wait_for_event::<u32>("a", durastep::WaitFor::event("ev/a").matching(any()).timeout(hour)),
            ctx.wait_for_event::<u32>("b", durastep::WaitFor::event("ev/b").matching(any()).timeout(hour)),
        );
        Ok(json!([a?, b?]))
    });
    let engine = common::engine(&opts, vec![f]).await;
    let w = common::spawn_worker(&engine);
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    common::wait_until("both waits to be recorded", || async {
        common::count(&engine, &format!("durastep.waits WHERE run_id = '{id}'")).await == 2
    })
    .await;
    let entries = common::count(
        &engine,
        &format!("durastep.step_journal WHERE run_id = '{id}' AND kind = 'wait' AND position IN (0, 1)"),
    )
    .await;
    assert_eq!(entries, 2, "both joined waits are in the journal");
    engine.send(Event::new("ev/a", &1)).await.unwrap();
    engine.send(Event::new("ev/b", &2)).await.unwrap();
    let run = common::finished(&engine, id).await;
    assert_eq!((run.state, run.output.clone()), (RunState::Completed, Some(json!([1, 2]))), "{run:?}");
    w.stop().await;
}

/// What registering functions writes: function rows (with `updated_at`),
/// flow rules and options, schedules.
async fn registration(pool: &sqlx::PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT x FROM (
             SELECT row_to_json(f)::text AS x FROM durastep.functions f
             UNION ALL SELECT row_to_json(ff)::text FROM durastep.function_flow ff
             UNION ALL SELECT row_to_json(fr)::text FROM durastep.flow_rules fr
             UNION ALL SELECT row_to_json(o)::text FROM durastep.function_options o
             UNION ALL SELECT row_to_json(s)::text FROM durastep.schedules s) t ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// `EngineBuilder::check_deploy` as the reader role of docs/security.md: a
/// v2 build with other triggers, retries, a concurrency limit, a cron
/// schedule and a renamed step is checked against the v1 runs in flight; the
/// report finds the divergence, and nothing in the database changed (not the
/// function rows nor their `updated_at`, not the flow rules, not the runs).
/// Catches: a check that builds an engine (migrates and registers the new
/// build's definitions over the live ones before the deploy, and needs the
/// runtime role).
#[sqlx::test(migrations = false)]
async fn check_deploy_as_the_reader_role_changes_nothing(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (_early, _late) = leave_runs_asleep(&opts).await;
    let admin = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.unwrap();
    let before = (registration(&admin).await, snapshot_pool(&admin).await);
    let reader = common::ReaderRole::create(&opts).await;
    let bodies = Arc::new(AtomicU32::new(0));
    let counted = bodies.clone();
    let v2 = Function::new("flow")
        .on_event("flow/started")
        .on_cron("0 9 * * MON", chrono_tz::UTC)
        .retries(9)
        .concurrency(durastep::Concurrency::new(3).key("/n"))
        .handler(move |ctx: Ctx, _: Value| {
            let counted = counted.clone();
            async move {
                ctx.step("a2", || async move {
                    counted.fetch_add(1, Ordering::SeqCst);
                    Ok(1)
                })
                .await
            }
        });
    let report = Engine::builder().database_url(&reader.url).function(v2).check_deploy().await;
    let after = (registration(&admin).await, snapshot_pool(&admin).await);
    reader.drop().await;
    let report = report.expect("the reader role runs the check");
    expect_report(&report, &[(0, entry(EntryKind::Step, "a"), entry(EntryKind::Step, "a2"), 2)]);
    assert_eq!(bodies.load(Ordering::SeqCst), 0, "the check ran a step body");
    assert_eq!(after.0, before.0, "the check registered something");
    assert_eq!(after.1, before.1, "the check wrote something");
}

/// Everything a check could write, on a pool: every run table's rows, as text.
async fn snapshot_pool(pool: &sqlx::PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT x::text FROM (
             SELECT row_to_json(r)::text AS x FROM durastep.runs r
             UNION ALL SELECT row_to_json(s)::text FROM durastep.step_results s
             UNION ALL SELECT row_to_json(j)::text FROM durastep.step_journal j
             UNION ALL SELECT row_to_json(w)::text FROM durastep.waits w
             UNION ALL SELECT row_to_json(e)::text FROM durastep.events e) t ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

/// One divergence group: function, position, runs, recorded, asked.
type Group<'a> = (&'a str, u32, u64, Option<JournalEntry>, Option<JournalEntry>);

/// The report groups by function, then position, across functions: `alpha`
/// branches on its input (the late run renamed `b` at 2, the early run
/// inserted `x` at 1: two positions in one function), `beta` inserts `x`
/// (both runs at 1), `gamma` is unchanged. Expected, in this order: alpha@1
/// (1 run), alpha@2 (1 run), beta@1 (2 runs), each with an example of its
/// own function and position; the text lists them in that order. Then the
/// replay parks each run where the check said. Catches: groups keyed by
/// position only (alpha@1 and beta@1 merged), by function only (alpha's two
/// positions merged), an example from another group, or an unstable order.
#[sqlx::test(migrations = false)]
async fn report_groups_by_function_and_position(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let runs = leave_asleep(&opts, &["alpha", "beta", "gamma"]).await;
    let bodies = Arc::new(AtomicU32::new(0));
    let v2 = common::engine(
        &opts,
        vec![
            flow_named("gamma", Variant::V1, bodies.clone()),
            flow_named("beta", Variant::Insert, bodies.clone()),
            flow_named("alpha", Variant::PerInput, bodies.clone()),
        ],
    )
    .await;
    let before = snapshot(&v2).await;
    let report = v2.check_deploy().await.unwrap();
    assert_eq!(snapshot(&v2).await, before);
    assert_eq!(bodies.load(Ordering::SeqCst), 0);
    assert_eq!((report.runs_checked, report.problems.len()), (6, 0), "{report}");
    let got: Vec<Group> = report
        .diverging
        .iter()
        .map(|g| (g.function_id.as_str(), g.position, g.runs, g.example.recorded.clone(), g.example.asked.clone()))
        .collect();
    let sleep1 = entry(EntryKind::Sleep, "nap1");
    let x = entry(EntryKind::Step, "x");
    assert_eq!(
        got,
        vec![
            ("alpha", 1, 1, sleep1.clone(), x.clone()),
            ("alpha", 2, 1, entry(EntryKind::Step, "b"), entry(EntryKind::Step, "b2")),
            ("beta", 1, 2, sleep1.clone(), x.clone()),
        ],
        "{report}"
    );
    let (alpha, beta) = (runs[0], runs[1]);
    for g in &report.diverging {
        assert_eq!((g.example.function_id.as_str(), g.example.position), (g.function_id.as_str(), g.position));
    }
    assert_eq!(report.diverging[0].example.run_id, alpha.0, "alpha@1 is the early run");
    assert_eq!(report.diverging[1].example.run_id, alpha.1, "alpha@2 is the late run");
    assert!([beta.0, beta.1].contains(&report.diverging[2].example.run_id));
    assert_eq!(report.diverging_runs(), 4);
    let text = report.to_string();
    let at = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("{needle:?} in {text}"));
    assert!(at("alpha at position 1: 1 runs") < at("alpha at position 2: 1 runs"), "{text}");
    assert!(at("alpha at position 2: 1 runs") < at("beta at position 1: 2 runs"), "{text}");
    assert!(!text.contains("gamma"), "{text}");

    let w = common::spawn_worker(&v2);
    wake_all(&v2).await;
    let divergence = |id: Uuid| {
        let v2 = v2.clone();
        async move {
            state_is(&v2, id, RunState::Diverged).await;
            match v2.inspect().why(id).await.unwrap() {
                Why::Diverged { divergence: Some(d), .. } => (d.function_id, d.position),
                other => panic!("why: {other:?}"),
            }
        }
    };
    assert_eq!(divergence(alpha.0).await, ("alpha".to_owned(), 1));
    assert_eq!(divergence(alpha.1).await, ("alpha".to_owned(), 2));
    assert_eq!(divergence(beta.0).await, ("beta".to_owned(), 1));
    assert_eq!(divergence(beta.1).await, ("beta".to_owned(), 1));
    w.stop().await;
}

/// v1 of `ops`: a `step_tx` `tx`, a `send_event` `notify`, an `invoke`
/// `child`, a sleep `nap`. A change of `changed` replaces one of them.
#[derive(Clone, Copy, Debug, PartialEq)]
enum OpsChange {
    None,
    /// `tx` renamed `tx2`.
    StepTxRenamed,
    /// `tx` made a plain `step` of the same name.
    StepTxToStep,
    /// `notify` renamed `notify2`.
    SendRenamed,
    /// `child` renamed `child2`.
    InvokeRenamed,
    /// The invoke made a `send_event` of the same name.
    InvokeToSend,
}

/// Side effects of `ops`, counted: step_tx bodies, and what `ops` did.
#[derive(Default)]
struct OpsCounts {
    tx_bodies: AtomicU32,
}

fn ops(change: OpsChange, counts: Arc<OpsCounts>) -> Vec<Function> {
    let child = Function::new("double")
        .handler(|ctx: Ctx, n: u32| async move { ctx.step("double", || async move { Ok(n * 2) }).await });
    let f = Function::new("ops").on_event("ops/go").handler(move |ctx: Ctx, _: Value| {
        let counts = counts.clone();
        async move {
            let tx_name = if change == OpsChange::StepTxRenamed { "tx2" } else { "tx" };
            if change == OpsChange::StepTxToStep {
                ctx.step("tx", || async { Ok(1) }).await?;
            } else {
                ctx.step_tx(tx_name, async move |conn| {
                    counts.tx_bodies.fetch_add(1, Ordering::SeqCst);
                    let one: i32 = sqlx::query_scalar("SELECT 1").fetch_one(&mut *conn).await?;
                    Ok(one)
                })
                .await?;
            }
            let send_name = if change == OpsChange::SendRenamed { "notify2" } else { "notify" };
            ctx.send_event(send_name, Event::new("ops/notified", &json!({"n": 1}))).await?;
            match change {
                OpsChange::InvokeToSend => {
                    ctx.send_event("child", Event::new("ops/notified", &json!({"n": 2}))).await?;
                }
                _ => {
                    let name = if change == OpsChange::InvokeRenamed { "child2" } else { "child" };
                    let r: Result<u32, _> = ctx.invoke(name, durastep::Invoke::function("double").input(&21)).await?;
                    assert_eq!(r.ok(), Some(42));
                }
            }
            ctx.sleep("nap", NAP).await?;
            Ok("done")
        }
    });
    vec![f, child]
}

/// What `ops` has done so far: events it sent, child runs it started.
async fn ops_effects(engine: &Engine) -> (i64, i64) {
    (
        common::count(engine, "durastep.events WHERE name = 'ops/notified'").await,
        common::count(engine, "durastep.runs WHERE function_id = 'double'").await,
    )
}

/// A changed `step_tx` (renamed, or made a plain step), `send_event`
/// (renamed) or `invoke` (renamed, or made a `send_event`) diverges at its
/// position with the recorded and asked entry, in the check and at replay,
/// and nothing is done again: no step_tx body runs, no event is sent and no
/// child run started. Catches: these kinds journaled under a wrong kind or
/// key, or not at all (a renamed step_tx would commit its transaction again,
/// a renamed send_event send a second event, a renamed invoke start a
/// second child).
#[sqlx::test(migrations = false)]
async fn changed_step_tx_send_event_and_invoke_diverge(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let cases = [
        (OpsChange::StepTxRenamed, 0, entry(EntryKind::StepTx, "tx"), entry(EntryKind::StepTx, "tx2")),
        (OpsChange::StepTxToStep, 0, entry(EntryKind::StepTx, "tx"), entry(EntryKind::Step, "tx")),
        (OpsChange::SendRenamed, 1, entry(EntryKind::SendEvent, "notify"), entry(EntryKind::SendEvent, "notify2")),
        (OpsChange::InvokeRenamed, 2, entry(EntryKind::Invoke, "child"), entry(EntryKind::Invoke, "child2")),
        (OpsChange::InvokeToSend, 2, entry(EntryKind::Invoke, "child"), entry(EntryKind::SendEvent, "child")),
    ];
    for (i, (change, position, recorded, asked)) in cases.into_iter().enumerate() {
        // A v1 run asleep at `nap`, past the three.
        let counts = Arc::new(OpsCounts::default());
        let v1 = common::engine(&opts, ops(OpsChange::None, counts.clone())).await;
        let w = common::spawn_worker(&v1);
        let id = v1.send(Event::new("ops/go", &json!({}))).await.unwrap().run_ids[0];
        state_is(&v1, id, RunState::Sleeping).await;
        w.stop().await;
        assert_eq!(counts.tx_bodies.load(Ordering::SeqCst), 1);
        let effects = ops_effects(&v1).await;
        let n = i64::try_from(i).unwrap() + 1;
        assert_eq!(effects, (n, n), "one event and one child per v1 run");

        let counts = Arc::new(OpsCounts::default());
        let v2 = common::engine(&opts, ops(change, counts.clone())).await;
        let before = snapshot(&v2).await;
        let report = v2.check_deploy().await.unwrap();
        assert_eq!(snapshot(&v2).await, before, "{change:?}: the check wrote something");
        assert!(report.problems.is_empty(), "{change:?}: {report}");
        let got: Vec<_> = report
            .diverging
            .iter()
            .map(|g| (g.function_id.as_str(), g.position, g.runs, g.example.recorded.clone(), g.example.asked.clone()))
            .collect();
        assert_eq!(got, vec![("ops", position, 1, recorded.clone(), asked.clone())], "{change:?}: {report}");

        let w = common::spawn_worker(&v2);
        wake_all(&v2).await;
        let run = state_is(&v2, id, RunState::Diverged).await;
        match v2.inspect().why(id).await.unwrap() {
            Why::Diverged { divergence: Some(d), .. } => {
                assert_eq!((d.position, d.recorded, d.asked), (position, recorded, asked), "{change:?}");
            }
            other => panic!("{change:?}: why {other:?} of {run:?}"),
        }
        w.stop().await;
        assert_eq!(counts.tx_bodies.load(Ordering::SeqCst), 0, "{change:?}: a step_tx body ran again");
        assert_eq!(ops_effects(&v2).await, effects, "{change:?}: an event was sent or a child started again");
        // Out of the next case's check.
        v2.cancel(id, "next case").await.unwrap();
    }
}

/// How v2 of `approve` asks for what v1 recorded as the wait `approval`.
#[derive(Clone, Copy, Debug)]
enum WaitChange {
    None,
    Renamed,
    ToStep,
}

/// v1: wait for `approve/ok`, then sleep `nap`, then a step.
fn approve(change: WaitChange, bodies: Arc<AtomicU32>) -> Function {
    Function::new("approve").on_event("approve/go").handler(move |ctx: Ctx, _: Value| {
        let bodies = bodies.clone();
        async move {
            let what = durastep::WaitFor::event("approve/ok").timeout(NAP);
            match change {
                WaitChange::None => {
                    let _: Option<Value> = ctx.wait_for_event("approval", what).await?;
                }
                WaitChange::Renamed => {
                    let _: Option<Value> = ctx.wait_for_event("approval2", what).await?;
                }
                WaitChange::ToStep => {
                    let b = bodies.clone();
                    ctx.step("approval", || async move {
                        b.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    })
                    .await?;
                }
            }
            ctx.sleep("nap", NAP).await?;
            ctx.step("after", || async move {
                bodies.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await?;
            HandlerResult::Ok(())
        }
    })
}

/// A changed `wait_for_event` (renamed, or made a step) diverges at its
/// position with the recorded and asked entry, in the check and at replay:
/// the run is parked instead of waiting again for an event it already got, and
/// no step body runs. Catches: a wait journaled under a wrong kind or key, or
/// not at all (a renamed wait would wait again, forever, for an event that was
/// already delivered).
#[sqlx::test(migrations = false)]
async fn a_changed_wait_diverges(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let wait = |key| entry(EntryKind::Wait, key);
    let cases = [
        (WaitChange::Renamed, wait("approval"), wait("approval2")),
        (WaitChange::ToStep, wait("approval"), entry(EntryKind::Step, "approval")),
    ];
    for (change, recorded, asked) in cases {
        let bodies = Arc::new(AtomicU32::new(0));
        let v1 = common::engine(&opts, vec![approve(WaitChange::None, bodies.clone())]).await;
        let w = common::spawn_worker(&v1);
        let id = v1.send(Event::new("approve/go", &json!({}))).await.unwrap().run_ids[0];
        state_is(&v1, id, RunState::Waiting).await;
        v1.send(Event::new("approve/ok", &json!({"by": "finance"}))).await.unwrap();
        common::wait_until("the run to sleep at nap", || async {
            common::step_row(&v1, id, "nap").await.is_some() && v1.run(id).await.unwrap().state == RunState::Sleeping
        })
        .await;
        w.stop().await;

        let bodies = Arc::new(AtomicU32::new(0));
        let v2 = common::engine(&opts, vec![approve(change, bodies.clone())]).await;
        let before = snapshot(&v2).await;
        let report = v2.check_deploy().await.unwrap();
        assert_eq!(snapshot(&v2).await, before, "{change:?}: the check wrote something");
        let got: Vec<_> = report
            .diverging
            .iter()
            .map(|g| (g.function_id.as_str(), g.position, g.runs, g.example.recorded.clone(), g.example.asked.clone()))
            .collect();
        assert_eq!(got, vec![("approve", 0, 1, recorded.clone(), asked.clone())], "{change:?}: {report}");

        let w = common::spawn_worker(&v2);
        wake_all(&v2).await;
        state_is(&v2, id, RunState::Diverged).await;
        match v2.inspect().why(id).await.unwrap() {
            Why::Diverged { divergence: Some(d), .. } => {
                assert_eq!((d.position, d.recorded, d.asked), (0, recorded, asked), "{change:?}");
            }
            other => panic!("{change:?}: why {other:?}"),
        }
        w.stop().await;
        assert_eq!(bodies.load(Ordering::SeqCst), 0, "{change:?}: a step body ran");
        v2.cancel(id, "next case").await.unwrap();
    }
}

/// Catches: a `check_deploy` that misses runs past its first page (200), or
/// in a state it reads through another partial index than the page before,
/// or counts finished runs. 260 asleep, 250 queued, 10 completed: 510 checked
/// over three pages whose ids interleave both states.
#[sqlx::test(migrations = false)]
async fn check_deploy_pages_through_every_unfinished_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    let nap = || {
        Function::new("nap").on_event("nap/go").handler(|ctx: Ctx, e: Value| async move {
            if e["sleep"] == true {
                ctx.sleep("long", Duration::from_secs(3600)).await?;
            }
            Ok(())
        })
    };
    let engine = common::engine(&opts, vec![nap()]).await;
    let sleepers: Vec<Event> = (0..260).map(|i| Event::new("nap/go", &json!({"sleep": true, "i": i}))).collect();
    let done: Vec<Event> = (0..10).map(|i| Event::new("nap/go", &json!({"sleep": false, "i": i}))).collect();
    engine.send_batch(sleepers).await.unwrap();
    engine.send_batch(done).await.unwrap();
    let w = common::spawn_worker(&engine);
    common::wait_until("260 asleep and 10 completed", || async {
        common::count(&engine, "durastep.runs WHERE state = 'sleeping'").await == 260
            && common::count(&engine, "durastep.runs WHERE state = 'completed'").await == 10
    })
    .await;
    w.stop().await;
    let queued: Vec<Event> = (0..250).map(|i| Event::new("nap/go", &json!({"sleep": true, "q": i}))).collect();
    engine.send_batch(queued).await.unwrap();

    let report = common::engine(&opts, vec![nap()]).await.check_deploy().await.unwrap();
    assert!(report.is_safe(), "{report}");
    assert_eq!(report.runs_checked, 510, "{report}");
}
