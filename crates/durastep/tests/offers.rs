//! An idle worker takes the one-event sends of other processes (migration
//! 0036, `durastep.worker_offers`): the send claims the new run for it and
//! tells it on its secret channel, and the worker starts the run without a
//! claim of its own. Here "another process" is an engine of its own with no
//! worker: its sends can reach the worker only through the worker's offer.

mod common;

use durastep::{Ctx, Engine, Function};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use uuid::Uuid;

fn echo() -> Function {
    Function::new("echo").on_event("ping").handler(|_ctx: Ctx, v: Value| async move { Ok(v) })
}

/// An engine with no worker, like the process of a service that only sends.
async fn sender(opts: &PgConnectOptions) -> Engine {
    common::engine(opts, vec![]).await
}

/// Catches: a send of another process that leaves its run queued for a
/// claim although a worker waits idle (no offer written, or not taken), and a
/// handed run that does not run, or runs twice.
#[sqlx::test(migrations = false)]
async fn a_send_hands_its_run_to_an_idle_worker_of_another_process(_p: PgPoolOptions, opts: PgConnectOptions) {
    let worker = common::engine(&opts, vec![echo()]).await;
    let w = common::spawn_worker(&worker);
    let sender = sender(&opts).await;
    common::send_until_handed(&sender, "ping").await;
    w.stop().await;
    common::assert_claimed_once_each(&sender).await;
}

/// Catches: a hand-over whose event's payload does not fit in the
/// notification (Postgres takes under 8,000 bytes) and is lost: the worker
/// must read the run back. Were it lost, the run would start only after its
/// lease had lapsed and a reaper had taken it back, claimed a second time.
#[sqlx::test(migrations = false)]
async fn a_payload_too_large_for_the_notice_is_read_back(_p: PgPoolOptions, opts: PgConnectOptions) {
    let worker = common::engine(&opts, vec![echo()]).await;
    let w = common::spawn_worker(&worker);
    let sender = sender(&opts).await;
    common::send_until_handed_with(&sender, "ping", |i| json!({"i": i, "text": "x".repeat(9_000)})).await;
    w.stop().await;
    common::assert_claimed_once_each(&sender).await;
}

/// Writes an offer of 4 slots for `echo` by a worker that is not there,
/// naming the lock `key` and the channel `channel`; returns its worker id.
async fn offer(engine: &Engine, key: i64, channel: &str) -> Uuid {
    let worker = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO durastep.worker_offers (worker_id, version_ids, versions, slots, lease_s, lock_key, channel)
         SELECT $1, array_agg(f.id), array_agg(f.version), 4, 30, $2, $3 FROM durastep.functions f WHERE f.id = 'echo'",
    )
    .bind(worker)
    .bind(key)
    .bind(channel)
    .execute(engine.pool())
    .await
    .unwrap();
    worker
}

async fn run_state(engine: &Engine, run: Uuid) -> (String, Option<Uuid>) {
    sqlx::query_as("SELECT state, worker_id FROM durastep.runs WHERE id = $1")
        .bind(run)
        .fetch_one(engine.pool())
        .await
        .unwrap()
}

/// Catches: a send that hands its run to a worker that no longer listens
/// (it stopped, or lost its connection), which would never hear of it: the
/// run would wait for its lease to lapse. With the lock of the offer free,
/// the send must queue the run and delete the offer.
#[sqlx::test(migrations = false)]
async fn a_send_passes_by_and_deletes_the_offer_of_a_worker_that_no_longer_listens(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let engine = common::engine(&opts, vec![echo()]).await;
    offer(&engine, 424_242, "durastep_hand_nobody").await;
    let receipt = engine.send(durastep::Event::new("ping", &1)).await.unwrap();
    assert_eq!(run_state(&engine, receipt.run_ids[0]).await, ("queued".to_owned(), None));
    assert_eq!(common::count(&engine, "durastep.worker_offers").await, 0, "the dead offer is left");
}

/// Catches: a send that takes a live worker's offer but does not claim the
/// run for it, does not take the slot it used, or tells the worker less
/// than it needs to start the run (the notice is checked field by field).
/// The "worker" is this test's connection: it holds the offer's lock and
/// listens on its channel.
#[sqlx::test(migrations = false)]
async fn a_send_claims_its_run_for_a_live_offer_and_tells_its_worker(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = common::engine(&opts, vec![echo()]).await;
    let channel = format!("durastep_hand_{}", Uuid::new_v4().simple());
    let mut listener = PgListener::connect_with(engine.pool()).await.unwrap();
    listener.listen(&channel).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock(777)").execute(&mut listener).await.unwrap();
    let worker = offer(&engine, 777, &channel).await;

    let receipt = engine.send(durastep::Event::new("ping", &json!({"n": 5}))).await.unwrap();
    let run = receipt.run_ids[0];
    assert_eq!(run_state(&engine, run).await, ("running".to_owned(), Some(worker)));
    assert!(common::handed_by_its_send(&engine, run, receipt.event_id).await);
    let slots: i32 =
        sqlx::query_scalar("SELECT slots FROM durastep.worker_offers").fetch_one(engine.pool()).await.unwrap();
    assert_eq!(slots, 3);

    let notice: Value = serde_json::from_str(listener.recv().await.unwrap().payload()).unwrap();
    let (epoch, claim_runs): (i64, Vec<Uuid>) = sqlx::query_as(
        "SELECT r.lease_epoch, c.run_ids FROM durastep.runs r, durastep.run_claims c
          WHERE r.id = $1 AND c.id = $2",
    )
    .bind(run)
    .bind(notice["claim"].as_i64().expect("the claim record"))
    .fetch_one(engine.pool())
    .await
    .unwrap();
    assert_eq!(claim_runs, vec![run]);
    assert_eq!(notice["event"], json!(receipt.event_id));
    assert_eq!(notice["payload"], json!({"n": 5}));
    assert!(notice.get("cut").is_none());
    let runs = notice["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0]["id"], json!(run));
    assert_eq!(runs[0]["epoch"], json!(epoch));
    assert_eq!(runs[0]["function"], json!("echo"));
    assert_eq!(runs[0]["attempt"], json!(1));
}

/// Catches: a worker that leaves its offer behind when it stops (the first
/// send after would pay for finding it dead), and one that never writes it.
#[sqlx::test(migrations = false)]
async fn a_worker_offers_its_slots_while_idle_and_withdraws_them_when_it_stops(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let engine = common::engine(&opts, vec![echo()]).await;
    let w = common::spawn_worker(&engine);
    common::wait_until("the idle worker's offer", async || {
        common::count(&engine, "durastep.worker_offers WHERE slots = 16").await == 1
    })
    .await;
    w.stop().await;
    assert_eq!(common::count(&engine, "durastep.worker_offers").await, 0);
}
