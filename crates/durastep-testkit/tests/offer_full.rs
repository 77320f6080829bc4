//! A run that a send of another process hands to a worker through its
//! offer, when the worker's slots filled after the offer was written, is
//! given back at once: another worker may run it now, instead of it waiting
//! in the full worker for a slot (as a run claimed ahead waits, up to a
//! second).
//!
//! The worker has one slot and claims nothing ahead. A run that holds its
//! slot keeps it busy; once the worker has withdrawn its offer, the test
//! writes the offer again as the worker wrote it while idle (its listener
//! still holds the offer's lock), and an engine with no worker sends. The
//! `offer-full` failpoint (`pause(0)`) counts the runs the claim loop gave
//! back by this rule; only it tells the rule apart from the wait of a run
//! claimed ahead, which would end in the same state a second later.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use durastep::{Ctx, Engine, Event, Function, WorkerOptions, failpoints};
use durastep_testkit::wait_for;
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use uuid::Uuid;

mod handoff_common;

use handoff_common::{WAIT, states};

/// Set once the test lets the `hold` run end.
static RELEASED: AtomicBool = AtomicBool::new(false);

/// One slot, nothing claimed ahead, a lease of an hour with no heartbeat or
/// reaper within the test (`handoff_common::options`).
async fn build(opts: &PgConnectOptions) -> Engine {
    let options = WorkerOptions {
        max_in_flight: 1,
        claim_ahead: 0,
        poll_interval: Duration::from_millis(200),
        ..handoff_common::options()
    };
    let hold = Function::new("hold").on_event("hold").handler(|_ctx: Ctx, _v: Value| async move {
        while !RELEASED.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(json!("held"))
    });
    handoff_common::engine_with(opts, options, vec![hold, handoff_common::echo()]).await
}

/// The worker's offer row, as it wrote it.
type OfferRow = (Uuid, Vec<String>, Vec<i32>, f64, i64, String);

async fn offer_row(engine: &Engine) -> Result<Option<OfferRow>, sqlx::Error> {
    sqlx::query_as("SELECT worker_id, version_ids, versions, lease_s, lock_key, channel FROM durastep.worker_offers")
        .fetch_optional(engine.pool())
        .await
}

/// Catches: a full worker that keeps a run handed to it through an offer
/// (the failpoint never counts it), a given-back run that is lost, runs
/// twice or loses its input, and one left listed in the send's claim record
/// (which would stay until the hour's lease passed).
#[sqlx::test(migrations = false)]
async fn a_run_handed_to_a_full_worker_through_its_offer_is_given_back_at_once(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let engine = build(&opts).await;
    let sender = build(&opts).await;
    let worker = engine.spawn_worker();
    let (id, version_ids, versions, lease_s, key, channel) =
        wait_for("the idle worker's offer", WAIT, || async { Ok(offer_row(&engine).await?) }).await.unwrap();

    // Its one slot taken: the worker withdraws its offer.
    let held = engine.send(Event::new("hold", &0)).await.unwrap().run_ids[0];
    wait_for("the worker to withdraw its offer", WAIT, || async {
        let running: bool = sqlx::query_scalar("SELECT state = 'running' FROM durastep.runs WHERE id = $1")
            .bind(held)
            .fetch_one(engine.pool())
            .await?;
        Ok((running && offer_row(&engine).await?.is_none()).then_some(()))
    })
    .await
    .unwrap();

    // The offer as the worker wrote it while idle; its listener holds the lock.
    sqlx::query(
        "INSERT INTO durastep.worker_offers (worker_id, version_ids, versions, slots, lease_s, lock_key, channel)
         VALUES ($1, $2, $3, 1, $4, $5, $6)",
    )
    .bind(id)
    .bind(&version_ids)
    .bind(&versions)
    .bind(lease_s)
    .bind(key)
    .bind(&channel)
    .execute(engine.pool())
    .await
    .unwrap();
    failpoints::set("offer-full", "pause(0)");
    let run = sender.send(Event::new("ping", &json!({"n": 7}))).await.unwrap().run_ids[0];
    let worker_of: Option<Uuid> = sqlx::query_scalar("SELECT worker_id FROM durastep.runs WHERE id = $1")
        .bind(run)
        .fetch_one(engine.pool())
        .await
        .unwrap();
    assert_eq!(worker_of, Some(id), "the send did not hand its run to the full worker through the offer");

    wait_for("the full worker to give the run back", WAIT, || async {
        Ok((failpoints::hits("offer-full") >= 1).then_some(()))
    })
    .await
    .unwrap();
    wait_for("the given-back run to be queued", WAIT, || async {
        Ok((states(&engine, run).await == ["running", "queued"]).then_some(()))
    })
    .await
    .unwrap();
    failpoints::set("offer-full", "off");
    // Queued again, it no longer needs the send's claim record: the worker
    // deletes it (with an hour's lease, no reaper would within the test).
    wait_for("the send's claim record to be deleted", WAIT, || async {
        let listed: i64 = sqlx::query_scalar("SELECT count(*) FROM durastep.run_claims WHERE $1 = ANY (run_ids)")
            .bind(run)
            .fetch_one(engine.pool())
            .await?;
        Ok((listed == 0).then_some(()))
    })
    .await
    .unwrap();

    // The slot frees: the run runs, once, with its input.
    RELEASED.store(true, Ordering::Release);
    let done = handoff_common::finished(&engine, run).await;
    assert_eq!(done.output, Some(json!({"n": 7})), "{done:?}");
    assert_eq!(states(&engine, run).await, ["running", "queued", "running", "completed"]);
    worker.request_stop();
    worker.stop().await.unwrap();
}
