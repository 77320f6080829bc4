//! A worker with `claim_ahead: 0` claims only for its free slots, counting
//! the claims of both claim classes in flight.
//!
//! A worker with functions of both classes (here a plain one, claimed by the
//! fast claim, and one with a finish timeout, claimed by the full claim)
//! claims each class on its own. With runs claimed ahead allowed, a class
//! does not count the other's claims in flight (the other's statement may be
//! slow); with `claim_ahead: 0` it must, or both classes claim for the same
//! free slot and the run of the answer that comes second waits claimed
//! ahead, against the option's promise. The failpoint matrix caught it: its
//! one-slot worker (`claim_ahead: 0`) sent the second class's claim while
//! the first class's run was already in its first step, and a process exit
//! at that claim ran the step again.
//!
//! The `claim-before-commit` failpoint (`block`) holds every claim before its
//! statement, so the claims in flight can be counted: one slot, so one.

use std::time::Duration;

mod two_classes;

use durastep::{Event, RunState, WorkerOptions, failpoints};
use durastep_testkit::wait_for;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const POINT: &str = "claim-before-commit";
const WAIT: Duration = Duration::from_secs(20);

/// Catches: the two claim classes of a worker with `claim_ahead: 0` and one
/// slot both sending a claim for that slot.
#[sqlx::test(migrations = false)]
async fn with_claim_ahead_zero_the_claims_in_flight_bring_at_most_the_free_slots(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let worker = WorkerOptions {
        max_in_flight: 1,
        claim_ahead: 0,
        poll_interval: Duration::from_millis(20),
        ..Default::default()
    };
    let engine = two_classes::engine(&opts, worker).await;
    // A run of each class due, so that each class has a claim to send.
    let plain = engine.send(Event::new("go", &())).await.unwrap().run_ids[0];
    let timed = engine.send(Event::new("timed", &())).await.unwrap().run_ids[0];
    failpoints::set(POINT, "block");
    let worker = engine.spawn_worker();
    wait_for("the first claim", WAIT, || async { Ok((failpoints::blocked(POINT) >= 1).then_some(())) }).await.unwrap();
    // Both classes would send at once (the same turn of the claim loop); a
    // second claim that comes later still comes within the poll interval.
    let until = tokio::time::Instant::now() + Duration::from_millis(500);
    while tokio::time::Instant::now() < until {
        assert_eq!(failpoints::blocked(POINT), 1, "two claims in flight for one free slot");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    failpoints::release(POINT);
    for run in [plain, timed] {
        let run = wait_for("the run to complete", WAIT, || async {
            let run = engine.run(run).await?;
            Ok(run.state.is_finished().then_some(run))
        })
        .await
        .unwrap();
        assert_eq!(run.state, RunState::Completed, "{run:?}");
    }
    worker.stop().await.unwrap();
}
