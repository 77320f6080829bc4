//! Where features meet the edges of their input and of the machine: reserved
//! event names, extreme durations and instants, step timeouts, two waits at
//! once, lost leases and their own budget, and a run row that another
//! transaction holds (the heartbeat and the group commit of the other runs go
//! on). Issue 11, fixes 5 to 10.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::{Gate, LONG_LEASE};
use durastep::limits::{MAX_DURATION, MAX_RETRY_DELAY, max_instant};
use durastep::{
    Backoff, Ctx, Engine, Error, Event, EventMatch, FailedRun, Function, HandlerError, LimitError, RunState,
    StepOptions, WorkerOptions,
};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

fn is_reserved(e: &Error) -> bool {
    matches!(e, Error::Limit(LimitError::ReservedName { .. }))
}

async fn db_now(engine: &Engine) -> DateTime<Utc> {
    durastep::testing::db_now(engine).await.unwrap()
}

/// Seconds from the database's now to `at`.
async fn secs_from_now(engine: &Engine, at: DateTime<Utc>) -> i64 {
    (at - db_now(engine).await).num_seconds()
}

/// Event names beginning with `durastep/` are the engine's own: refused with
/// `LimitError::ReservedName` at send, send_batch (nothing stored), send_in
/// (the caller's transaction still usable), as a trigger or a cancel_on rule
/// (build), and in a handler's send_event and wait_for_event (the run fails
/// permanently, saying why). The engine's own events still work: on_failure
/// and invoke. Catches: anyone who can send events firing cron functions,
/// suppressing on_failure or failing a parent's invoke (issue 11, fix 6).
#[sqlx::test(migrations = false)]
async fn reserved_event_names_are_refused_where_users_name_events(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let failed = Arc::new(AtomicU32::new(0));
    let seen = failed.clone();
    let sender = Function::new("sender").on_event("go/send").handler(|ctx: Ctx, _: ()| async move {
        ctx.send_event("fire", Event::new("durastep/cron:report", &json!({}))).await?;
        Ok(())
    });
    let waiter = Function::new("waiter").on_event("go/wait").handler(|ctx: Ctx, _: ()| async move {
        let _: Option<Value> = ctx
            .wait_for_event(
                "w",
                durastep::WaitFor::event("durastep/run.failed")
                    .matching(EventMatch::any())
                    .timeout(Duration::from_secs(60)),
            )
            .await?;
        Ok(())
    });
    let child = Function::new("child").handler(|_ctx: Ctx, n: u32| async move { Ok(n + 1) });
    let parent = Function::new("parent")
        .on_event("go/invoke")
        .retries(0)
        .on_failure(move |_ctx: Ctx, _f: FailedRun<Value>| {
            let seen = seen.clone();
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .handler(|ctx: Ctx, _: ()| async move {
            let got: Result<u32, _> = ctx
                .invoke("c", durastep::Invoke::function("child").input(&41u32).timeout(Duration::from_secs(60)))
                .await?;
            Err::<(), _>(HandlerError::permanent(format!("child said {}", got.unwrap())))
        });
    let engine = common::engine(&opts, vec![sender, waiter, child, parent]).await;

    let err = engine.send(Event::new("durastep/cron:report", &json!({}))).await.unwrap_err();
    assert!(is_reserved(&err), "{err}");
    let batch = vec![Event::new("go/send", &()), Event::new("durastep/invoke:child", &1)];
    let err = engine.send_batch(batch).await.unwrap_err();
    assert!(is_reserved(&err), "{err}");
    assert_eq!(common::count(&engine, "durastep.events").await, 0, "a refused batch stores nothing");
    let mut tx = engine.pool().begin().await.unwrap();
    let err = engine.send_in(&mut tx, Event::new("durastep/run.failed", &json!({}))).await.unwrap_err();
    assert!(is_reserved(&err), "{err}");
    sqlx::query("SELECT 1").execute(&mut *tx).await.expect("the caller's transaction is still usable");
    tx.rollback().await.unwrap();
    assert!(Event::new("durastep/x", &()).validate(&Default::default()).is_err());

    let trigger = Function::new("t").on_event("durastep/cron:report").handler(|_c: Ctx, _: Value| async { Ok(()) });
    let err = common::try_engine(&opts, vec![trigger], common::fast_options(), Default::default()).await.unwrap_err();
    assert!(is_reserved(&err), "{err}");
    let cancel = Function::new("c")
        .on_event("x")
        .cancel_on(durastep::CancelOn::event("durastep/run.failed").event_key("/run_id").run_key("/id"))
        .handler(|_c: Ctx, _: Value| async { Ok(()) });
    let err = common::try_engine(&opts, vec![cancel], common::fast_options(), Default::default()).await.unwrap_err();
    assert!(is_reserved(&err), "{err}");

    let w = common::spawn_worker(&engine);
    for (event, function) in [("go/send", "sender"), ("go/wait", "waiter")] {
        let id = engine.send(Event::new(event, &())).await.unwrap().run_ids[0];
        let run = common::finished(&engine, id).await;
        assert_eq!((run.state, run.attempt), (RunState::Failed, 1), "{function}: {run:?}");
        assert!(run.last_error.as_deref().unwrap_or("").contains("reserved"), "{function}: {run:?}");
    }
    // The engine's own events still flow: invoke's child, and on_failure.
    let id = engine.send(Event::new("go/invoke", &())).await.unwrap().run_ids[0];
    let run = common::finished(&engine, id).await;
    assert_eq!(run.last_error.as_deref(), Some("child said 42"), "{run:?}");
    common::wait_until("on_failure to run", || async { failed.load(Ordering::SeqCst) == 1 }).await;
    w.stop().await;
}

/// A huge `retry_after` (and a huge backoff) is cut to `MAX_RETRY_DELAY`: the
/// failure is recorded (no "timestamp out of range"), the run retries in 7
/// days, and a back-pressure key pauses for 7 days, not years. Catches: the
/// failure write failing so that every attempt is lost as an expired lease,
/// and a shared key paused for years (issue 11, fix 8).
#[sqlx::test(migrations = false)]
async fn a_huge_retry_delay_is_cut_to_the_documented_maximum(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let huge = Function::new("huge")
        .on_event("go/huge")
        .backpressure(durastep::Backpressure::new().shared("api"))
        .handler(|_ctx: Ctx, _: ()| async { Err::<(), _>(HandlerError::retry_after("429", Duration::MAX)) });
    let years = Function::new("years").on_event("go/years").handler(|_ctx: Ctx, _: ()| async {
        Err::<(), _>(HandlerError::retry_after("429", Duration::from_secs(20 * 365 * 86_400)))
    });
    let custom = Function::new("custom")
        .on_event("go/custom")
        .backoff(Backoff::custom(|_| Duration::MAX))
        .handler(|_ctx: Ctx, _: ()| async { Err::<(), _>(HandlerError::new("boom")) });
    let exp = Function::new("exp")
        .on_event("go/exp")
        .backoff(Backoff::Exponential { base: Duration::MAX, max: Duration::MAX })
        .handler(|_ctx: Ctx, _: ()| async { Err::<(), _>(HandlerError::new("boom")) });
    let engine = common::engine(&opts, vec![huge, years, custom, exp]).await;
    let w = common::spawn_worker(&engine);
    let max = MAX_RETRY_DELAY.as_secs() as i64;
    for (event, message) in [("go/huge", "429"), ("go/years", "429"), ("go/custom", "boom"), ("go/exp", "boom")] {
        let id = engine.send(Event::new(event, &())).await.unwrap().run_ids[0];
        let run = common::wait_for_run_where(&engine, id, "the failure to be recorded", |r| {
            r.state == RunState::Queued && r.last_error.is_some()
        })
        .await;
        assert_eq!(run.last_error.as_deref(), Some(message), "{event}: {run:?}");
        let wait = secs_from_now(&engine, run.run_at).await;
        assert!((max - 60..=max).contains(&wait), "{event}: retry in {wait} s, want {max}");
    }
    let paused: DateTime<Utc> = sqlx::query_scalar("SELECT paused_until FROM durastep.flow_keys WHERE rule = 'api'")
        .fetch_one(engine.pool())
        .await
        .unwrap();
    let pause = secs_from_now(&engine, paused).await;
    assert!((max - 60..=max).contains(&pause), "the key pauses {pause} s, want at most {max}");
    w.stop().await;
}

/// `wait_for_event` and `invoke` with `Duration::MAX` (no timeout): the run
/// waits, reads back (its `run_at` is `max_instant()`, Postgres `infinity`
/// mapped), and resumes on its event / its child's end. Catches: every
/// attempt panicking with "NaiveDateTime + TimeDelta overflowed" while
/// decoding `infinity` (issue 11, fix 8).
#[sqlx::test(migrations = false)]
async fn waits_and_invokes_without_timeout_work(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let waiter = Function::new("waiter").on_event("go/wait").handler(|ctx: Ctx, _: ()| async move {
        let got: Option<u32> = ctx
            .wait_for_event("w", durastep::WaitFor::event("reply").matching(EventMatch::any()).timeout(Duration::MAX))
            .await?;
        let century: Option<u32> = ctx
            .wait_for_event(
                "w2",
                durastep::WaitFor::event("reply2")
                    .matching(EventMatch::any())
                    .timeout(MAX_DURATION + Duration::from_secs(1)),
            )
            .await?;
        Ok(json!([got, century]))
    });
    let child = Function::new("child").handler(|_ctx: Ctx, n: u32| async move { Ok(n * 2) });
    let parent = Function::new("parent").on_event("go/invoke").handler(|ctx: Ctx, _: ()| async move {
        let got: Result<u32, _> =
            ctx.invoke("c", durastep::Invoke::function("child").input(&21u32).timeout(Duration::MAX)).await?;
        got.map_err(|e| HandlerError::permanent(e.to_string()))
    });
    let engine = common::engine(&opts, vec![waiter, child, parent]).await;
    let w = common::spawn_worker(&engine);
    let id = engine.send(Event::new("go/wait", &())).await.unwrap().run_ids[0];
    let run = common::wait_for_run_where(&engine, id, "the run to wait", |r| r.state == RunState::Waiting).await;
    assert_eq!(run.run_at, max_instant(), "a wait without timeout reads back as max_instant()");
    engine.inspect().run(id).await.expect("the inspector reads a run waiting forever");
    engine.inspect().why(id).await.expect("why() reads a run waiting forever");
    engine.send(Event::new("reply", &7)).await.unwrap();
    common::wait_until("the second wait to be recorded", || async {
        common::count(&engine, &format!("durastep.waits WHERE run_id = '{id}' AND step_key = 'w2'")).await == 1
    })
    .await;
    engine.send(Event::new("reply2", &8)).await.unwrap();
    let run = common::finished(&engine, id).await;
    assert_eq!((run.state, run.attempt, run.output.clone()), (RunState::Completed, 1, Some(json!([7, 8]))), "{run:?}");

    let id = engine.send(Event::new("go/invoke", &())).await.unwrap().run_ids[0];
    let run = common::finished(&engine, id).await;
    assert_eq!((run.state, run.attempt, run.output.clone()), (RunState::Completed, 1, Some(json!(42))), "{run:?}");
    w.stop().await;
}

/// Every other duration and instant at its extreme: `sleep(Duration::MAX)`
/// (100 years), `sleep_until(DateTime::MAX_UTC)` and `start_at(MAX_UTC)`
/// (cut to `max_instant()`), `start_at(MIN_UTC)` (due at once), start and
/// finish timeouts, a throttle period, a debounce window and a worker lease
/// of `Duration::MAX`. Each is stored and read back; runs due now complete.
/// Catches: "interval out of range" / "timestamp out of range" at send, at
/// claim (a throttle period fails every claim of the worker) or at suspend
/// (issue 11, fix 8).
#[sqlx::test(migrations = false)]
async fn every_user_duration_and_instant_survives_its_extreme(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let sleeper = Function::new("sleeper").on_event("go/sleep").handler(|ctx: Ctx, _: ()| async move {
        ctx.sleep("long", Duration::MAX).await?;
        Ok(())
    });
    let until = Function::new("until").on_event("go/until").handler(|ctx: Ctx, _: ()| async move {
        ctx.sleep_until("end", DateTime::<Utc>::MAX_UTC).await?;
        Ok(())
    });
    let timed = Function::new("timed")
        .on_event("go/timed")
        .start_timeout(Duration::MAX)
        .finish_timeout(Duration::MAX)
        .step_timeout(Duration::MAX)
        .handler(|ctx: Ctx, _: ()| async move { ctx.step("s", || async { Ok(1) }).await });
    let throttled = Function::new("throttled")
        .on_event("go/throttled")
        .throttle(durastep::Throttle::new(1, Duration::MAX))
        .handler(|_ctx: Ctx, _: ()| async { Ok(()) });
    let debounced = Function::new("debounced")
        .on_event("go/debounced")
        .debounce(durastep::Debounce::new(Duration::MAX).max_wait(Duration::MAX))
        .handler(|_ctx: Ctx, _: ()| async { Ok(()) });
    let plain = Function::new("plain").on_event("go/plain").handler(|_ctx: Ctx, _: ()| async { Ok(()) });
    let options = WorkerOptions {
        lease: Duration::MAX,
        reap_interval: Duration::MAX,
        prune_interval: Duration::MAX,
        retention: Some(Duration::MAX),
        ..common::fast_options()
    };
    let engine = common::engine_with(&opts, vec![sleeper, until, timed, throttled, debounced, plain], options).await;
    let century = MAX_DURATION.as_secs() as i64;

    let late = engine.send(Event::new("go/plain", &()).start_at(DateTime::<Utc>::MAX_UTC)).await.unwrap().run_ids[0];
    assert_eq!(engine.run(late).await.unwrap().run_at, max_instant());
    let early = engine.send(Event::new("go/plain", &()).start_at(DateTime::<Utc>::MIN_UTC)).await.unwrap().run_ids[0];
    let debounced = engine.send(Event::new("go/debounced", &())).await.unwrap().run_ids[0];
    let wait = secs_from_now(&engine, engine.run(debounced).await.unwrap().run_at).await;
    assert!((century - 60..=century).contains(&wait), "debounced for {wait} s");
    let timed = engine.send(Event::new("go/timed", &())).await.unwrap().run_ids[0];
    let throttled: Vec<Uuid> = engine
        .send_batch(vec![Event::new("go/throttled", &()), Event::new("go/throttled", &())])
        .await
        .unwrap()
        .into_iter()
        .flat_map(|r| r.run_ids)
        .collect();
    let sleeper = engine.send(Event::new("go/sleep", &())).await.unwrap().run_ids[0];
    let until = engine.send(Event::new("go/until", &())).await.unwrap().run_ids[0];

    let w = common::spawn_worker(&engine);
    for id in [early, timed] {
        let run = common::finished(&engine, id).await;
        assert_eq!((run.state, run.attempt), (RunState::Completed, 1), "{run:?}");
    }
    let run = common::wait_for_run_where(&engine, sleeper, "the sleep", |r| r.state == RunState::Sleeping).await;
    let wait = secs_from_now(&engine, run.run_at).await;
    assert!((century - 60..=century).contains(&wait), "slept for {wait} s");
    let run = common::wait_for_run_where(&engine, until, "the sleep", |r| r.state == RunState::Sleeping).await;
    assert_eq!(run.run_at, max_instant());
    // One throttled run starts; the other waits a whole period (cut to 100 years).
    common::wait_until("a throttled run to complete", || async {
        let mut done = 0;
        for id in &throttled {
            done += i32::from(engine.run(*id).await.unwrap().state == RunState::Completed);
        }
        done == 1
    })
    .await;
    let parked = common::count(
        &engine,
        "durastep.runs WHERE function_id = 'throttled' AND state = 'queued'
            AND run_at > durastep.now() + interval '99 years'",
    )
    .await;
    assert_eq!(parked, 1);
    // The worker (lease, reaper and pruner at their extremes) still serves new runs.
    let id = engine.send(Event::new("go/plain", &())).await.unwrap().run_ids[0];
    assert_eq!(common::finished(&engine, id).await.state, RunState::Completed);
    w.stop().await;
}

/// A step body that never returns is stopped by the function's
/// `step_timeout`, and the attempt fails as retryable with a clear error; a
/// step's own `StepOptions::timeout` overrides the default (here a shorter
/// one on a `step_tx`, whose transaction is rolled back; 5 s, so that the
/// attempt that does not hang finishes within it on a loaded machine). The
/// next attempt completes. Catches: a hung body holding its run (and its flow-control
/// slots) for ever while heartbeats keep its lease alive (issue 11, fix 10).
#[sqlx::test(migrations = false)]
async fn a_hung_step_is_stopped_by_its_timeout_and_retried(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let hung = Function::new("hung")
        .on_event("go")
        .step_timeout(Duration::from_millis(500))
        .backoff(Backoff::Fixed(Duration::from_millis(10)))
        .handler(|ctx: Ctx, _: ()| async move {
            let attempt = ctx.attempt();
            let n: u32 = ctx
                .step("fetch", || async move {
                    if attempt == 1 {
                        std::future::pending::<()>().await; // hangs for ever
                    }
                    Ok(attempt)
                })
                .await?;
            let m: i64 = ctx
                .step_tx_with("write", StepOptions::new().timeout(Duration::from_secs(5)), async move |conn| {
                    sqlx::query("INSERT INTO hung_writes VALUES ($1)").bind(attempt as i32).execute(&mut *conn).await?;
                    if attempt == 2 {
                        std::future::pending::<()>().await;
                    }
                    Ok(i64::from(attempt))
                })
                .await?;
            Ok(json!([n, m]))
        });
    let overridden = Function::new("overridden").on_event("go2").step_timeout(Duration::from_millis(100)).handler(
        |ctx: Ctx, _: ()| async move {
            // Its own (longer) timeout: the 300 ms body completes despite the 100 ms default.
            ctx.step_with("slow", StepOptions::new().timeout(Duration::from_secs(3600)), || async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok(1)
            })
            .await
        },
    );
    let engine = common::engine(&opts, vec![hung, overridden]).await;
    sqlx::query("CREATE TABLE hung_writes (attempt int)").execute(engine.pool()).await.unwrap();
    let w = common::spawn_worker(&engine);
    let id = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let run = common::finished(&engine, id).await;
    assert_eq!((run.state, run.attempt, run.output.clone()), (RunState::Completed, 3, Some(json!([2, 3]))), "{run:?}");
    let detail = engine.inspect().run(id).await.unwrap();
    let errors: Vec<String> = detail.attempts.iter().filter_map(|a| a.error.clone()).collect();
    assert_eq!(
        errors,
        ["step fetch: timed out after 500ms (step timeout)", "step write: timed out after 5s (step timeout)"]
    );
    let writes: Vec<i32> =
        sqlx::query_scalar("SELECT attempt FROM hung_writes ORDER BY attempt").fetch_all(engine.pool()).await.unwrap();
    assert_eq!(writes, [3], "the timed-out step_tx was rolled back");
    let id = engine.send(Event::new("go2", &())).await.unwrap().run_ids[0];
    let run = common::finished(&engine, id).await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 1), "{run:?}");
    w.stop().await;
}

/// Two `wait_for_event`s joined in one handler are both recorded: the run
/// waits, the first event resumes it, the second event, sent while the run
/// waits again, is delivered to its wait, and the run completes with both,
/// in one attempt per resumption and with no lost lease. Catches: the second
/// wait reporting a spurious lease loss and its event being dropped (issue
/// 11, fix 9).
#[sqlx::test(migrations = false)]
async fn two_joined_waits_both_get_their_events(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let f = Function::new("both").on_event("go").handler(|ctx: Ctx, _: ()| async move {
        let hour = Duration::from_secs(3600);
        let (a, b) = tokio::join!(
            ctx.wait_for_event::<u32>("a", durastep::WaitFor::event("ev/a").matching(EventMatch::any()).timeout(hour)),
            ctx.wait_for_event::<u32>("b", durastep::WaitFor::event("ev/b").matching(EventMatch::any()).timeout(hour)),
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
    common::wait_for_run_where(&engine, id, "the run to wait", |r| r.state == RunState::Waiting).await;
    engine.send(Event::new("ev/a", &1)).await.unwrap();
    common::wait_until("the first wait to resolve", || async {
        common::count(&engine, &format!("durastep.waits WHERE run_id = '{id}'")).await == 1
    })
    .await;
    // Sent at once: whether the run is still queued, running or waiting again, the wait catches it.
    engine.send(Event::new("ev/b", &2)).await.unwrap();
    let run = common::finished(&engine, id).await;
    assert_eq!((run.state, run.output.clone()), (RunState::Completed, Some(json!([1, 2]))), "{run:?}");
    assert_eq!(run.lease_losses, 0);
    let lost =
        common::count(&engine, &format!("durastep.run_history WHERE run_id = '{id}' AND error IS NOT NULL")).await;
    assert_eq!(lost, 0, "no attempt failed or lost its lease");
    w.stop().await;
}

/// Simulates a worker lost after its claim committed: the run is `running`
/// under a new epoch with a lease already expired; then the reaper runs. The
/// UPDATE lists the run in no claim record, as a claim by a process older
/// than migration 0034 would not: the trigger `runs_unlisted_attempt` lists
/// it, or the reaper would never find it.
async fn lose_lease(engine: &Engine, id: Uuid) {
    sqlx::query(
        "UPDATE durastep.runs SET state = 'running', lease_epoch = lease_epoch + 1, worker_id = gen_random_uuid(),
                started_at = coalesce(started_at, durastep.now()),
                lease_expires_at = durastep.now() - interval '1 second'
          WHERE id = $1",
    )
    .bind(id)
    .execute(engine.pool())
    .await
    .unwrap();
    assert_eq!(engine.reap_expired_leases().await.unwrap(), 1);
}

/// Catches: a run made running by a claim of a process older than 0034
/// (which writes its own history row, so flips `history_noted`, and lists
/// no claim record) that no trigger lists, so that the reaper never finds
/// it once its lease lapses. Since 0041 the one row trigger of `runs`
/// (`runs_changed`) lists it only through its condition's last clause
/// (running, the same `claim_id`): the history mark flipped, no slots, no
/// parent, so every other clause is false. Checked: with that clause taken
/// out of the trigger's condition, the reaper finds nothing (0).
#[sqlx::test(migrations = false)]
async fn an_older_process_s_claim_is_listed_for_the_reaper(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let f = Function::new("old").on_event("go/old").handler(|_ctx: Ctx, _: ()| async { Ok(1) });
    let engine = common::engine(&opts, vec![f]).await;
    let id = engine.send(Event::new("go/old", &())).await.unwrap().run_ids[0];
    common::claim_as_earlier_version(&engine, id, common::EarlierClaim::Unlisted).await;
    assert_eq!(engine.reap_expired_leases().await.unwrap(), 1, "the older claim's run was not listed");
    assert_eq!(engine.run(id).await.unwrap().state, RunState::Queued);
}

/// Lost leases do not spend the function's retries: a run with `retries(0)`
/// survives three lost workers and completes; with `retries(1)`, after two
/// lost leases its own two failures still get their two attempts. Past the
/// function's `lease_losses` budget the run fails, saying so. Catches: a
/// crash-looping deployment failing healthy runs whose code never failed
/// (issue 11, fix 7).
#[sqlx::test(migrations = false)]
async fn lost_leases_spend_their_own_budget_not_the_retries(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let executions = Arc::new(AtomicU32::new(0));
    let ex = executions.clone();
    let once = Function::new("once").on_event("go/once").retries(0).handler(|_ctx: Ctx, _: ()| async { Ok(1) });
    let flaky = Function::new("flaky")
        .on_event("go/flaky")
        .retries(1)
        .backoff(Backoff::Fixed(Duration::from_millis(10)))
        .handler(move |_ctx: Ctx, _: ()| {
            let ex = ex.clone();
            async move {
                ex.fetch_add(1, Ordering::SeqCst);
                Err::<(), _>(HandlerError::new("own failure"))
            }
        });
    let fragile =
        Function::new("fragile").on_event("go/fragile").lease_losses(2).handler(|_ctx: Ctx, _: ()| async { Ok(1) });
    let engine = common::engine(&opts, vec![once, flaky, fragile]).await;

    let once = engine.send(Event::new("go/once", &())).await.unwrap().run_ids[0];
    for _ in 0..3 {
        lose_lease(&engine, once).await;
    }
    let run = engine.run(once).await.unwrap();
    assert_eq!((run.state, run.attempt, run.lease_losses), (RunState::Queued, 4, 3), "{run:?}");
    assert!(run.last_error.as_deref().unwrap().starts_with("lease expired"), "{run:?}");

    let flaky = engine.send(Event::new("go/flaky", &())).await.unwrap().run_ids[0];
    lose_lease(&engine, flaky).await;
    lose_lease(&engine, flaky).await;

    let fragile = engine.send(Event::new("go/fragile", &())).await.unwrap().run_ids[0];
    lose_lease(&engine, fragile).await;
    lose_lease(&engine, fragile).await;
    assert_eq!(engine.run(fragile).await.unwrap().state, RunState::Queued);
    lose_lease(&engine, fragile).await;
    let run = engine.run(fragile).await.unwrap();
    assert_eq!((run.state, run.lease_losses), (RunState::Failed, 3), "{run:?}");
    assert!(run.last_error.as_deref().unwrap().contains("(lost leases: 3, over the budget of 2)"), "{run:?}");

    let w = common::spawn_worker(&engine);
    let run = common::finished(&engine, once).await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 4), "{run:?}");
    let run = common::finished(&engine, flaky).await;
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    assert_eq!(run.last_error.as_deref(), Some("own failure"));
    assert_eq!(executions.load(Ordering::SeqCst), 2, "retries(1): two executions of the user's code");
    w.stop().await;
}

/// Holds a run's row locked, as an application transaction does (a `send_in`
/// that would cancel the run, left open).
async fn lock_row(opts: &PgConnectOptions, id: Uuid) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let pool = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM durastep.runs WHERE id = $1 FOR NO KEY UPDATE")
        .bind(id)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

async fn lease_expiry(engine: &Engine, id: Uuid) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT lease_expires_at FROM durastep.runs WHERE id = $1")
        .bind(id)
        .fetch_one(engine.pool())
        .await
        .unwrap()
}

/// One run row held by another transaction delays only that run: the
/// heartbeat goes on extending the other runs' leases (it skips the locked
/// row and tries it again next round), and with a single checkpoint writer
/// another run's checkpoints and completion commit while the locked run's
/// checkpoint waits apart. When the lock goes, the locked run completes too.
/// Catches: the heartbeat and the group commit waiting on the one locked row,
/// so that the own-clock check drops every run of the worker (issue 11, fix 5).
#[sqlx::test(migrations = false)]
async fn one_locked_run_row_delays_only_its_own_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let (entered_x, entered_y, gate_x, gate_y) = (Gate::new(), Gate::new(), Gate::new(), Gate::new());
    let gates = Arc::new((entered_x.clone(), entered_y.clone(), gate_x.clone(), gate_y.clone()));
    let f = Function::new("held").on_event("go").handler(move |ctx: Ctx, who: String| {
        let g = gates.clone();
        async move {
            let (entered, gate) = if who == "x" { (&g.0, &g.2) } else { (&g.1, &g.3) };
            entered.open();
            let gate = gate.clone();
            ctx.step("work", || async move {
                gate.wait().await;
                Ok(())
            })
            .await?;
            ctx.step("more", || async { Ok(()) }).await?;
            Ok(who)
        }
    });
    let options = WorkerOptions {
        writers: 1,
        lease: LONG_LEASE,
        heartbeat_interval: Duration::from_millis(100),
        ..common::fast_options()
    };
    let engine = common::engine_with(&opts, vec![f], options).await;
    let x = engine.send(Event::new("go", &"x")).await.unwrap().run_ids[0];
    let y = engine.send(Event::new("go", &"y")).await.unwrap().run_ids[0];
    let w = common::spawn_worker(&engine);
    entered_x.reached("x to start").await;
    entered_y.reached("y to start").await;

    let tx = lock_row(&opts, x).await;
    // The heartbeat still extends y's lease.
    let before = lease_expiry(&engine, y).await;
    common::wait_until("y's lease to be extended while x's row is locked", || async {
        lease_expiry(&engine, y).await > before
    })
    .await;
    // x's checkpoint waits for the lock; y's checkpoints and completion do not.
    gate_x.open();
    common::wait_until("x's checkpoint to wait for the lock", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
        )
        .fetch_one(engine.pool())
        .await
        .unwrap();
        waiting > 0
    })
    .await;
    gate_y.open();
    let run = common::finished(&engine, y).await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 1), "{run:?}");
    assert_eq!(engine.run(x).await.unwrap().state, RunState::Running);
    tx.rollback().await.unwrap();
    let run = common::finished(&engine, x).await;
    assert_eq!((run.state, run.attempt), (RunState::Completed, 1), "{run:?}");
    w.stop().await;
}
