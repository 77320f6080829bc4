//! Run with: `cargo run -p quickstart`
//!
//! A first Durastep workflow, end to end, in one process. It uses the Postgres
//! at `DATABASE_URL` if set, else `postgres://postgres@127.0.0.1:5432/postgres`;
//! when nothing answers at that (local) address, it starts a throwaway cluster
//! from the installed server binaries, says where, and removes it at exit
//! (`durastep-localpg`). It creates its own database, `durastep_quickstart`,
//! on that server (the engine migrates the schema), so it never touches
//! anyone else's tables.
//!
//! The workflow fulfils an order in four steps:
//!
//! 1. `reserve-stock`: a plain step;
//! 2. `charge-card`: calls a payment gateway that times out on its first call,
//!    so attempt 1 fails and attempt 2 replays step 1 from its checkpoint and
//!    retries only this step (with the run's idempotency key, as a real payment
//!    API wants);
//! 3. `cool-off`: a durable sleep of 2 s; the run leaves the worker while it sleeps;
//! 4. `record-shipment`: a `step_tx` whose row commits together with its checkpoint.
//!
//! Every line it prints says which step runs, which is replayed, and why.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use durastep::{Backoff, Ctx, Engine, Event, Function, HandlerError, RunState};
use serde::{Deserialize, Serialize};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection};

const DATABASE: &str = "durastep_quickstart";

/// The event payload: what the shop sends when an order is placed.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct OrderPlaced {
    order_id: String,
    customer: String,
    amount_cents: u64,
}

/// What the workflow returns; it is stored as the run's output.
#[derive(Debug, Serialize, Deserialize)]
struct Fulfilled {
    reservation: String,
    charge_id: String,
    shipment_id: i64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let log = Log::new();
    // Kept to the end of `main`: a throwaway cluster is removed when it drops.
    // On failure, one line saying what to install (or what failed), not a Debug dump.
    let server = durastep_localpg::LocalDatabase::resolve_or_exit().await;
    if let Some(notice) = server.notice() {
        log.main(&notice);
    }
    let options = own_database(server.url()).await?;
    let pool = PgPoolOptions::new().max_connections(5).connect_with(options).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS quickstart_shipments (
             id         bigserial PRIMARY KEY,
             order_id   text NOT NULL,
             charge_id  text NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await?;

    let gateway = Arc::new(PaymentGateway::default());
    let engine =
        Engine::builder().pool(pool.clone()).function(fulfil_order(gateway.clone(), log.clone())).build().await?; // migrates the `durastep` schema and registers the function
    log.main(&format!("engine ready on database {DATABASE} (schema migrated)"));

    // A worker in this process. Any number of workers, in any number of
    // processes, can share the same database.
    let worker = engine.spawn_worker();

    // Send the event. The idempotency key says "this order, once".
    let order = OrderPlaced { order_id: new_order_id(), customer: "ada@example.com".into(), amount_cents: 4_200 };
    let key = format!("order-placed:{}", order.order_id);
    let first = engine.send(Event::new("order/placed", &order).idempotency_key(&key)).await?;
    let run_id = first.run_ids[0];
    log.main(&format!("sent order/placed for order {} with key {key:?}: run {run_id} created", order.order_id));
    let again = engine.send(Event::new("order/placed", &order).idempotency_key(&key)).await?;
    log.main(&format!(
        "sent it again with the same key: duplicate = {}, same run = {}, nothing new was created",
        again.duplicate,
        again.run_ids == first.run_ids
    ));

    // While the run sleeps, no worker holds it: it is a row with a due time.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let run = engine.run(run_id).await?;
        if run.state == RunState::Sleeping {
            log.main(&format!(
                "the run is {:?} until {} (database clock); no worker holds it",
                run.state,
                run.run_at.format("%H:%M:%S%.3f")
            ));
            break;
        }
        if run.state.is_finished() || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let run = engine.wait_for_run(run_id, Duration::from_secs(15)).await?;
    log.main(&format!("the run is {:?} after {} attempt(s)", run.state, run.attempt));
    if let Some(error) = &run.last_error {
        log.main(&format!("its last_error, kept from the failed attempt: {error}"));
    }
    log.main(&format!("its output: {}", run.output.clone().unwrap_or_default()));

    // Everything is plain rows you can query: the checkpoints of this run ...
    let steps: Vec<(String, serde_json::Value)> =
        sqlx::query_as("SELECT step_key, output FROM durastep.step_results WHERE run_id = $1 ORDER BY created_at")
            .bind(run_id)
            .fetch_all(&pool)
            .await?;
    log.main("its checkpoints in durastep.step_results:");
    for (key, output) in &steps {
        println!("{:>32} {key:<16} {output}", "");
    }
    // ... and the side effects, each exactly once.
    let shipments: i64 = sqlx::query_scalar("SELECT count(*) FROM quickstart_shipments WHERE order_id = $1")
        .bind(&order.order_id)
        .fetch_one(&pool)
        .await?;
    log.main(&format!(
        "shipment rows for this order: {shipments}; charges at the gateway: {} (from {} calls)",
        gateway.charges_for(&format!("{run_id}:charge-card")),
        gateway.calls.load(Ordering::SeqCst)
    ));

    // Graceful shutdown: the worker stops claiming and lets running attempts finish.
    worker.stop().await?;
    log.main("worker stopped gracefully; bye");

    if run.state == RunState::Completed { Ok(()) } else { Err(format!("the run ended {:?}", run.state).into()) }
}

/// The workflow: a function triggered by `order/placed`.
fn fulfil_order(gateway: Arc<PaymentGateway>, log: Log) -> Function {
    Function::new("fulfil-order")
        .on_event("order/placed")
        .retries(3)
        .backoff(Backoff::Fixed(Duration::from_millis(500)))
        .handler(move |ctx: Ctx, order: OrderPlaced| {
            let (gateway, log) = (gateway.clone(), log.clone());
            async move {
                log.worker(&ctx, "", "handler starts from the top");
                let ran = Ran::default(); // which step bodies ran in this execution, for the printout

                let reservation: String = ctx
                    .step("reserve-stock", || async {
                        ran.mark("reserve-stock");
                        Ok(format!("rsv-{}", order.order_id))
                    })
                    .await?;
                log.step(&ctx, &ran, "reserve-stock", &reservation);

                // A stable key for the external call: the same on every attempt of this run.
                let payment_key = format!("{}:charge-card", ctx.idempotency_key());
                let charge_id: String = ctx
                    .step("charge-card", || async {
                        ran.mark("charge-card");
                        let charged = gateway.charge(&payment_key, order.amount_cents).await;
                        if let Err(e) = &charged {
                            log.worker(
                                &ctx,
                                "charge-card",
                                &format!("body failed: {e}; attempt ends, retry due in 500 ms"),
                            );
                        }
                        charged
                    })
                    .await?;
                log.step(&ctx, &ran, "charge-card", &charge_id);

                if log.first_time(&ctx, "cool-off") {
                    log.worker(
                        &ctx,
                        "cool-off",
                        "durable sleep of 2 s: the handler is dropped, the run leaves the worker",
                    );
                }
                ctx.sleep("cool-off", Duration::from_secs(2)).await?;
                log.worker(&ctx, "cool-off", "wake time reached (by the database clock): going on");

                let (order_id, charge) = (order.order_id.clone(), charge_id.clone());
                let shipment_id: i64 = ctx
                    .step_tx("record-shipment", async move |conn| {
                        // Commits in the same transaction as this step's checkpoint.
                        let id = sqlx::query_scalar(
                            "INSERT INTO quickstart_shipments (order_id, charge_id) VALUES ($1, $2) RETURNING id",
                        )
                        .bind(&order_id)
                        .bind(&charge)
                        .fetch_one(&mut *conn)
                        .await?;
                        Ok(id)
                    })
                    .await?;
                log.worker(
                    &ctx,
                    "record-shipment",
                    &format!("row {shipment_id} inserted and checkpointed in one transaction"),
                );

                Ok(Fulfilled { reservation, charge_id, shipment_id })
            }
        })
}

/// A stand-in for a payment API: its first call times out, and like real
/// payment APIs it charges once per idempotency key however often it is called.
#[derive(Default)]
struct PaymentGateway {
    calls: AtomicU32,
    charges: Mutex<HashMap<String, String>>,
}

impl PaymentGateway {
    async fn charge(&self, idempotency_key: &str, _amount_cents: u64) -> Result<String, HandlerError> {
        tokio::time::sleep(Duration::from_millis(50)).await; // the network
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(HandlerError::new("payment gateway timed out"));
        }
        let mut charges = self.charges.lock().unwrap_or_else(|p| p.into_inner());
        let next = format!("ch_{}", charges.len() + 1);
        Ok(charges.entry(idempotency_key.to_owned()).or_insert(next).clone())
    }

    fn charges_for(&self, idempotency_key: &str) -> usize {
        usize::from(self.charges.lock().unwrap_or_else(|p| p.into_inner()).contains_key(idempotency_key))
    }
}

/// Creates the demo's own database if it is missing; returns its connect options.
async fn own_database(url: &str) -> Result<PgConnectOptions, Box<dyn std::error::Error>> {
    let server: PgConnectOptions = url.parse()?;
    let mut conn = PgConnection::connect_with(&server)
        .await
        .map_err(|e| format!("cannot reach Postgres at {url}: {e}\n(set DATABASE_URL to a Postgres you can use)"))?;
    let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(DATABASE)
        .fetch_one(&mut conn)
        .await?;
    if !exists {
        match sqlx::query("CREATE DATABASE durastep_quickstart").execute(&mut conn).await {
            Ok(_) => {}
            // Another quickstart created it in the meantime.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P04") => {}
            Err(e) => return Err(e.into()),
        }
    }
    conn.close().await?;
    Ok(server.database(DATABASE))
}

/// A fresh order id per demo run, so that re-running the demo is not a duplicate send.
fn new_order_id() -> String {
    let millis = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or_default();
    format!("{:06}", millis % 1_000_000)
}

/// The step bodies that ran in one execution of the handler.
#[derive(Default)]
struct Ran(Mutex<HashSet<&'static str>>);

impl Ran {
    fn mark(&self, step: &'static str) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(step);
    }

    fn contains(&self, step: &str) -> bool {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).contains(step)
    }
}

/// Prints what happens, with the time since the start.
#[derive(Clone)]
struct Log {
    start: Instant,
    seen: Arc<Mutex<HashSet<String>>>,
}

impl Log {
    fn new() -> Self {
        println!("Durastep quickstart: an order workflow with a retry, a durable sleep and a step_tx\n");
        Log { start: Instant::now(), seen: Arc::default() }
    }

    fn line(&self, who: &str, what: &str) {
        println!("[{:>6.2}s] {who:<24} {what}", self.start.elapsed().as_secs_f64());
    }

    fn main(&self, what: &str) {
        self.line("main", what);
    }

    fn worker(&self, ctx: &Ctx, step: &str, what: &str) {
        self.line(&format!("attempt {} {step}", ctx.attempt()), what);
    }

    fn step<T: std::fmt::Debug>(&self, ctx: &Ctx, ran: &Ran, step: &str, value: &T) {
        if ran.contains(step) {
            self.worker(ctx, step, &format!("body ran, result checkpointed: {value:?}"));
        } else {
            self.worker(ctx, step, &format!("replayed from its checkpoint, body not run: {value:?}"));
        }
    }

    /// Whether this run reaches `what` for the first time in this process.
    fn first_time(&self, ctx: &Ctx, what: &str) -> bool {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).insert(format!("{}/{what}", ctx.run_id()))
    }
}
