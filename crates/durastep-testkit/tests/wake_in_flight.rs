//! A wake-up for a class of functions that comes while a claim of that class
//! is in flight is not lost.
//!
//! A worker with functions of both claim classes (here a plain one, claimed
//! by the fast claim, and one with a finish timeout, claimed by the full
//! claim) holds each class on its own while nothing of it is due. A wake-up
//! naming a function of one class ends that class's hold; if a claim of that
//! class is in flight, its statement (and its read of the class's next due
//! run) may have run before the announced run was visible, so its empty
//! answer must not hold the class again: the run would then wait for the
//! poll interval (here a minute, longer than the test's wait). Under load
//! this lost about 1 wake-up in 25 before the worker remembered such
//! wake-ups (`woken_in_flight`).
//!
//! The `claim-answered` failpoint (`block`) holds the full class's empty
//! answer until the run is sent and its NOTIFY has reached the worker's
//! claim loop (counted at the `wake-taken` failpoint). The sends come from a second engine without a worker, so that
//! they reach the worker only by NOTIFY.

use std::time::Duration;

mod two_classes;

use durastep::{Engine, Event, RunState, WorkerOptions, failpoints};
use durastep_testkit::wait_for;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const POINT: &str = "claim-answered";
const TAKEN: &str = "wake-taken";
const WAIT: Duration = Duration::from_secs(20);

/// The two classes' engine (`two_classes`), polling once a minute.
async fn build(opts: &PgConnectOptions) -> Engine {
    two_classes::engine(opts, WorkerOptions { poll_interval: Duration::from_secs(60), ..WorkerOptions::default() })
        .await
}

/// Catches: an empty answer of a claim that was in flight when a wake-up for
/// its class came, holding the class until the poll interval (the wake-up
/// lost).
#[sqlx::test(migrations = false)]
async fn a_wake_up_for_a_class_with_a_claim_in_flight_is_not_lost(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = build(&opts).await;
    // The same functions, for sending only: no worker runs on it.
    let sender = build(&opts).await;
    // Counts the answers: each class's first claim finds nothing, and each
    // class then holds until the poll interval.
    failpoints::set(POINT, "pause(0)");
    let worker = engine.spawn_worker();
    wait_for("both classes' first claims", WAIT, || async { Ok((failpoints::hits(POINT) >= 2).then_some(())) })
        .await
        .unwrap();
    // Time for the loop to take both answers and hold both classes.
    tokio::time::sleep(Duration::from_millis(200)).await;

    // A wake-up for the full class with nothing of it due: its claim finds
    // nothing, reads no next due run, and is held at the failpoint.
    failpoints::set(POINT, "block");
    sqlx::query("SELECT pg_notify('durastep_wakeup', 'timed')").execute(engine.pool()).await.unwrap();
    wait_for("the full class's claim to be held", WAIT, || async {
        Ok((failpoints::blocked(POINT) == 1).then_some(()))
    })
    .await
    .unwrap();
    // The run it did not see, and its wake-up, which the worker takes (the
    // fast class is held, so the claim loop waits on wake-ups) while the
    // claim is still in flight: counted at `wake-taken` before the claim's
    // answer is let go, so the test cannot pass without the race (a machine
    // too slow to deliver the NOTIFY meanwhile fails it by the deadline).
    failpoints::set(TAKEN, "pause(0)");
    let id = sender.send(Event::new("timed", &())).await.unwrap().run_ids[0];
    wait_for("the worker to take the send's wake-up", WAIT, || async {
        Ok((failpoints::hits(TAKEN) >= 1).then_some(()))
    })
    .await
    .unwrap();
    assert_eq!(failpoints::blocked(POINT), 1, "the claim was still in flight when the wake-up came");
    failpoints::release(POINT);

    let run = wait_for("the run to complete", WAIT, || async {
        let run = engine.run(id).await?;
        Ok(run.state.is_finished().then_some(run))
    })
    .await
    .expect("the run waited for the poll interval: the wake-up was lost");
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    worker.stop().await.unwrap();
}
