//! Fencing: an attempt that lost its lease cannot store a step result, complete
//! the run, fail it, put it to sleep, wait for an event, invoke a child run,
//! send an event or release the run at shutdown; the attempt that took over wins.
//!
//! Each test runs attempt 1 in worker A, holds it at a gate, expires its lease by
//! moving the database clock, reaps it, lets worker B claim attempt 2 and hold
//! it at its own gate, then releases the stale attempt 1 while attempt 2 still
//! runs. Worker A's heartbeat does not come within the test, so A does not know
//! it lost the lease: only the database's fencing (`lease_epoch`) can stop it.
mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use durastep::{Backoff, ChildError, Ctx, Event, EventMatch, Function, HandlerError, RunState};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

use common::{Handoff, count, lease_of, release_stale, step_row, step_rows, take_over, take_over_with};

/// What the test and both attempts share.
#[derive(Default)]
struct Probe {
    h: Handoff,
    log: Mutex<Vec<String>>,
}

impl Probe {
    fn log(&self, what: &str, attempt: u32) {
        self.log.lock().unwrap().push(format!("{what}@{attempt}"));
    }

    fn logged(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

/// The stale attempt finishes a step body after losing its lease: its result
/// must not be stored and its next step body must not run. Catches: a
/// checkpoint without the epoch compare, or one that merely relies on ON
/// CONFLICT (here attempt 2 has not stored `two` yet, so nothing would conflict).
#[sqlx::test(migrations = false)]
async fn stale_attempt_cannot_store_a_step_result(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let p = Arc::new(Probe::default());
    let make = || {
        let p = p.clone();
        Function::new("fenced-step").on_event("go").retries(3).backoff(Backoff::Fixed(Duration::ZERO)).handler(
            move |ctx: Ctx, _: ()| {
                let p = p.clone();
                async move {
                    let attempt = ctx.attempt();
                    let _dropped = p.h.drop_guard(attempt);
                    ctx.step("one", || async {
                        p.log("one", attempt);
                        Ok(attempt)
                    })
                    .await?;
                    let two: String = ctx
                        .step("two", || async {
                            p.h.hold(attempt).await;
                            p.log("two", attempt);
                            Ok(format!("two by attempt {attempt}"))
                        })
                        .await?;
                    ctx.step("three", || async {
                        p.log("three", attempt);
                        Ok(())
                    })
                    .await?;
                    Ok(format!("done by attempt {attempt}; {two}"))
                }
            },
        )
    };
    let (id, _engine_a, wa, engine, wb) = take_over(&opts, make, &p.h).await;

    release_stale(&p.h, wa).await;
    assert_eq!(p.logged(), ["one@1", "two@1"], "the stale attempt's next step body ran");
    assert_eq!(step_row(&engine, id, "two").await, None, "the stale attempt stored a step result");
    let run = engine.run(id).await.unwrap();
    assert_eq!((run.state, run.attempt), (RunState::Running, 2), "{run:?}");

    p.h.b_gate.open();
    let run = common::finished(&engine, id).await;
    wb.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!("done by attempt 2; two by attempt 2")));
    assert_eq!(p.logged(), ["one@1", "two@1", "two@2", "three@2"]);
    let rows: Vec<(String, serde_json::Value, i64)> =
        step_rows(&engine, id).await.into_iter().map(|r| (r.key, r.output, r.lease_epoch)).collect();
    let claims = common::claim_epochs(&engine, id).await;
    assert_eq!(
        rows,
        [
            ("one".to_owned(), json!(1), claims[0]),
            ("three".to_owned(), json!(null), claims[1]),
            ("two".to_owned(), json!("two by attempt 2"), claims[1]),
        ]
    );
}

/// How the stale attempt 1 ends once released.
#[derive(Clone, Copy, Debug)]
enum StaleEnding {
    Return,
    Fail,
    Sleep,
    /// `ctx.wait_for_event` (it would record a wait and make the run `waiting`).
    Wait,
    /// `ctx.invoke` of a child run (it would create the child and make the run `waiting`).
    Invoke,
    /// `ctx.send_event` (it would store the event and its fan-out).
    Send,
}

/// The stale attempt tries to end the run (complete, fail or sleep) while
/// attempt 2 holds it: the run must stay attempt 2's, running, untouched.
async fn stale_attempt_cannot_end_the_run(opts: PgConnectOptions, ending: StaleEnding) {
    common::init_logs();
    let p = Arc::new(Probe::default());
    let make = || {
        let p = p.clone();
        Function::new("fenced-end").on_event("go").retries(3).backoff(Backoff::Fixed(Duration::ZERO)).handler(
            move |ctx: Ctx, _: ()| {
                let p = p.clone();
                async move {
                    let attempt = ctx.attempt();
                    let _dropped = p.h.drop_guard(attempt);
                    ctx.step("one", || async { Ok(attempt) }).await?;
                    p.h.hold(attempt).await;
                    p.log("released", attempt);
                    if attempt == 1 {
                        match ending {
                            StaleEnding::Return => {}
                            StaleEnding::Fail => return Err(HandlerError::new("stale failure")),
                            StaleEnding::Sleep => {
                                ctx.sleep("nap", Duration::from_secs(3600)).await?;
                                p.log("after-nap", attempt);
                            }
                            StaleEnding::Wait => {
                                let got: Option<serde_json::Value> = ctx
                                    .wait_for_event(
                                        "nap",
                                        durastep::WaitFor::event("fenced/ping")
                                            .matching(EventMatch::any())
                                            .timeout(Duration::from_secs(3600)),
                                    )
                                    .await?;
                                p.log(&format!("after-wait {got:?}"), attempt);
                            }
                            StaleEnding::Invoke => {
                                let got: Result<String, ChildError> = ctx
                                    .invoke(
                                        "nap",
                                        durastep::Invoke::function("fenced-end").timeout(Duration::from_secs(3600)),
                                    )
                                    .await?;
                                p.log(&format!("after-invoke {got:?}"), attempt);
                            }
                            StaleEnding::Send => {
                                let receipt = ctx.send_event("nap", Event::new("fenced/ping", &())).await?;
                                p.log(&format!("after-send {receipt:?}"), attempt);
                            }
                        }
                    }
                    Ok(format!("by attempt {attempt}"))
                }
            },
        )
    };
    let (id, _engine_a, wa, engine, wb) = take_over(&opts, make, &p.h).await;

    release_stale(&p.h, wa).await;
    let run = engine.run(id).await.unwrap();
    assert_eq!(run.state, RunState::Running, "the stale attempt ended the run ({ending:?}): {run:?}");
    assert_eq!(run.attempt, 2, "{run:?}");
    assert_eq!(run.output, None, "{run:?}");
    assert!(run.last_error.as_deref().unwrap_or("").contains("lease expired"), "{run:?}");
    assert_eq!(lease_of(&engine, id).await.0, common::claim_epochs(&engine, id).await[1], "attempt 2's claim");
    assert_eq!(step_row(&engine, id, "nap").await, None, "the stale attempt stored its sleep, wait, invoke or send");
    assert_eq!(count(&engine, "durastep.waits").await, 0, "the stale attempt recorded a wait");
    assert_eq!(count(&engine, "durastep.runs WHERE parent_run_id IS NOT NULL").await, 0, "the stale attempt invoked");
    assert_eq!(count(&engine, "durastep.events WHERE name = 'fenced/ping'").await, 0, "the stale attempt sent");

    p.h.b_gate.open();
    let run = common::finished(&engine, id).await;
    wb.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.attempt, 2);
    assert_eq!(run.output, Some(json!("by attempt 2")));
    assert_eq!(p.logged(), ["released@1", "released@2"]);
}

/// Catches: a completion that does not compare the epoch (the run would end
/// `completed` with attempt 1's output).
#[sqlx::test(migrations = false)]
async fn stale_attempt_cannot_complete_the_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    stale_attempt_cannot_end_the_run(opts, StaleEnding::Return).await;
}

/// Catches: a failure write without the epoch compare (the run would be
/// requeued as attempt 3 with the stale error).
#[sqlx::test(migrations = false)]
async fn stale_attempt_cannot_fail_the_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    stale_attempt_cannot_end_the_run(opts, StaleEnding::Fail).await;
}

/// Catches: an unfenced sleep (checkpoint or suspend) that would put attempt
/// 2's run to sleep under it.
#[sqlx::test(migrations = false)]
async fn stale_attempt_cannot_put_the_run_to_sleep(_p: PgPoolOptions, opts: PgConnectOptions) {
    stale_attempt_cannot_end_the_run(opts, StaleEnding::Sleep).await;
}

/// Catches: a wait recorded without the epoch compare (the run would become
/// `waiting` under attempt 2, which would then be dropped as fenced).
#[sqlx::test(migrations = false)]
async fn stale_attempt_cannot_wait_for_an_event(_p: PgPoolOptions, opts: PgConnectOptions) {
    stale_attempt_cannot_end_the_run(opts, StaleEnding::Wait).await;
}

/// Catches: an invoke without the epoch compare (a child run would be created
/// for the stale attempt and the run made `waiting` under attempt 2).
#[sqlx::test(migrations = false)]
async fn stale_attempt_cannot_invoke_a_child(_p: PgPoolOptions, opts: PgConnectOptions) {
    stale_attempt_cannot_end_the_run(opts, StaleEnding::Invoke).await;
}

/// Catches: a `send_event` whose event commits without the step's fencing
/// check (the stale attempt's event and fan-out would be stored).
#[sqlx::test(migrations = false)]
async fn stale_attempt_cannot_send_an_event(_p: PgPoolOptions, opts: PgConnectOptions) {
    stale_attempt_cannot_end_the_run(opts, StaleEnding::Send).await;
}

/// Worker A shuts down while its stale attempt 1 is still held past a short
/// grace period, so it releases the run: the release must match nothing (the
/// run stays attempt 2's, running, with B's lease), and attempt 2 completes.
/// Catches: a release without the epoch compare (the run would go back to
/// `queued` under attempt 2, and a second body would start beside it).
#[sqlx::test(migrations = false)]
async fn stale_attempt_cannot_release_the_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let p = Arc::new(Probe::default());
    let make = || {
        let p = p.clone();
        Function::new("fenced-release").on_event("go").retries(3).backoff(Backoff::Fixed(Duration::ZERO)).handler(
            move |ctx: Ctx, _: ()| {
                let p = p.clone();
                async move {
                    let attempt = ctx.attempt();
                    let _dropped = p.h.drop_guard(attempt);
                    ctx.step("one", || async { Ok(attempt) }).await?;
                    p.h.hold(attempt).await;
                    p.log("released", attempt);
                    Ok(format!("by attempt {attempt}"))
                }
            },
        )
    };
    let a_options =
        durastep::WorkerOptions { shutdown_grace: Duration::from_millis(100), ..common::stalling_options() };
    let (id, _engine_a, wa, engine, wb) = take_over_with(&opts, make, &p.h, a_options).await;
    let before = lease_of(&engine, id).await;

    // Attempt 1 stays at its gate: worker A stops, waits out its grace, drops
    // the handler and releases the run with its old epoch.
    wa.stop_within(Duration::from_secs(10)).await;
    assert!(p.h.a_dropped.is_open(), "the stale handler was not dropped at shutdown");
    let run = engine.run(id).await.unwrap();
    assert_eq!((run.state, run.attempt), (RunState::Running, 2), "the stale release changed the run: {run:?}");
    assert_eq!(lease_of(&engine, id).await, before, "the stale release changed attempt 2's lease");

    p.h.b_gate.open();
    let run = common::finished(&engine, id).await;
    wb.stop().await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 2), "{run:?}");
    assert_eq!(run.output, Some(json!("by attempt 2")));
    assert_eq!(p.logged(), ["released@2"]);
}

/// A claim lost in a database crash (the fast claim commits asynchronously)
/// and made again must set another lease epoch, or the first attempt, still
/// running in its worker, would write under the second claim's fence. The
/// loss is reproduced by putting the run row back as it was before the claim
/// (a crash that lost the claim's commit leaves exactly that: the first
/// attempt had not made anything durable, since any synchronous commit after
/// the claim flushes the claim too). Catches: claims that bump the epoch by
/// a fixed step (the second claim would set the same epoch as the lost one).
#[sqlx::test(migrations = false)]
async fn a_claim_lost_and_made_again_fences_out_the_first_attempt(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let entries = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let h = Arc::new(Handoff::default());
    let make = || {
        let (entries, h) = (entries.clone(), h.clone());
        Function::new("lost-claim").on_event("go").handler(move |ctx: Ctx, _: ()| {
            let (entries, h) = (entries.clone(), h.clone());
            async move {
                // Entry 1 is the lost claim's attempt, entry 2 the new claim's (both attempt 1).
                let entry = entries.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                let _dropped = h.drop_guard(entry);
                h.hold(entry).await;
                ctx.step("one", || async move { Ok(format!("by entry {entry}")) }).await
            }
        })
    };
    let engine_a = common::engine_with(&opts, vec![make()], common::stalling_options()).await;
    let id = engine_a.send(Event::new("go", &())).await.expect("send").run_ids[0];
    let wa = common::spawn_worker(&engine_a);
    h.a_entered.reached("the first attempt to reach its gate").await;
    let (lost_epoch, _) = lease_of(&engine_a, id).await;

    // The crash loses the claim: the row as it was before it (the claim wrote
    // no history row: its start is noted on the run, 0044).
    sqlx::query(
        "UPDATE durastep.runs SET state = 'queued', lease_epoch = 0, worker_id = NULL, lease_expires_at = NULL,
                started_at = NULL, history_noted = NOT history_noted, run_at = durastep.now()
          WHERE id = $1 AND lease_epoch = $2",
    )
    .bind(id)
    .bind(lost_epoch)
    .execute(engine_a.pool())
    .await
    .expect("undo the claim");

    let engine_b = common::engine(&opts, vec![make()]).await;
    let wb = common::spawn_worker(&engine_b);
    h.b_entered.reached("the second attempt to reach its gate").await;
    let (epoch, _) = lease_of(&engine_b, id).await;
    assert_ne!(epoch, lost_epoch, "the new claim set the lost claim's epoch again");

    release_stale(&h, wa).await;
    assert_eq!(step_row(&engine_b, id, "one").await, None, "the lost claim's attempt stored a step result");
    h.b_gate.open();
    let run = common::finished(&engine_b, id).await;
    wb.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!("by entry 2")));
    let row = step_row(&engine_b, id, "one").await.expect("stored");
    assert_eq!((row.output, row.lease_epoch), (json!("by entry 2"), epoch));
}

/// The fast claim commits without waiting for its WAL flush, and only that
/// transaction: the setting is local to it. Catches: the claim losing its
/// `set_config`, or setting it for the whole session (every later statement
/// on the pooled connection would then commit asynchronously).
#[sqlx::test(migrations = false)]
async fn the_fast_claim_alone_commits_asynchronously(_p: PgPoolOptions, opts: PgConnectOptions) {
    use sqlx::Connection;
    let engine =
        common::engine(&opts, vec![Function::new("f").on_event("go").handler(|_: Ctx, _: ()| async { Ok(()) })]).await;
    engine.send(Event::new("go", &())).await.expect("send");
    let mut conn = sqlx::PgConnection::connect_with(&opts).await.expect("connect");
    // Whatever the server's default, the session commits synchronously.
    sqlx::query("SET synchronous_commit = on").execute(&mut conn).await.unwrap();
    let mut tx = conn.begin().await.expect("begin");
    // The engine's own statement, as the worker binds it.
    let claimed = sqlx::query(concat!(
        include_str!("../src/store/sql/claim_fast.sql"),
        include_str!("../src/store/sql/run_records.sql")
    ))
    .bind(vec!["f"])
    .bind(1_i64)
    .bind(60.0_f64)
    .bind(uuid::Uuid::new_v4())
    .bind(vec!["f"])
    .bind(vec![0_i32])
    .fetch_all(&mut *tx)
    .await
    .expect("claim");
    assert_eq!(claimed.len(), 1, "the claim took the run");
    let inside: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut *tx).await.unwrap();
    tx.commit().await.expect("commit");
    let after: String = sqlx::query_scalar("SHOW synchronous_commit").fetch_one(&mut conn).await.unwrap();
    assert_eq!((inside.as_str(), after.as_str()), ("off", "on"));
}
