//! The reaper racing a completion, 1,000 times (soak tier: 10,000).
//!
//! The reaper works in two statements: it selects the runs whose lease has
//! expired, then takes them back. Between the two, the worker that still holds
//! such a run (its lease expired, but nobody took it over, so it has not lost
//! it) may complete it. The update must then leave the completed run alone:
//! it is a compare-and-set on `(id, lease_epoch, state = 'running', lease
//! expired)` (G4; design lesson "the reaper is itself a compare-and-set").
//!
//! Each iteration, in process, with real Postgres and no sleeping:
//! 1. 50 runs (plus one *sentinel*) are claimed by a worker whose handlers wait
//!    on a gate; the database clock moves past their lease (1 h).
//! 2. The reaper selects them and is held exactly between its select and its
//!    update (the `reaper-between-select-and-update` failpoint with `block`).
//! 3. The gate opens: the 50 runs complete; their rows are snapshotted.
//! 4. The reaper is released and its update runs with its stale list.
//! 5. Every completed run must be unchanged (0 reverted), and the sentinel,
//!    whose handler is still waiting, must have been taken back: proof that the
//!    update did run, with the very list that named the completed runs.
//!
//! The same race is then run against a deliberately id-only reaper (the
//! classic bug, a test-only SQL statement below): the test must catch it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use durastep::{Backoff, Ctx, Engine, Event, Function, WorkerHandle, WorkerOptions, failpoints};
use durastep_testkit::{checks, tier, url_of, wait_for};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::watch;
use uuid::Uuid;

const FAILPOINT: &str = "reaper-between-select-and-update";
const EVENT: &str = "test/gated";
const LEASE: Duration = Duration::from_secs(3_600);
/// Runs completed during each held reaper pass (the engine's reaper takes up to 100 per pass).
const PER_ITERATION: u64 = 50;
const WAIT: Duration = Duration::from_secs(20);

/// The classic bug: the update names the runs by id only, so a run that
/// completed after the select is put back in the queue.
const ID_ONLY_UPDATE: &str = "UPDATE durastep.runs
    SET state = 'queued', attempt = attempt + 1, run_at = durastep.now(),
        lease_expires_at = NULL, worker_id = NULL, last_error = 'lease expired (id-only reaper)'
  WHERE id = ANY ($1)";
/// The select of the reaper, for the test-driven id-only variant (the same as the engine's).
const SELECT_EXPIRED: &str = "SELECT id FROM durastep.runs
  WHERE state = 'running' AND lease_expires_at < durastep.now() ORDER BY lease_expires_at LIMIT 100";

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Gated {
    iteration: u64,
    n: u64,
    sentinel: bool,
}

/// Gates the first attempt of each run: normal runs of iteration `i` wait
/// until `normal >= i`, sentinels until `sentinel >= i`. Later attempts go straight on.
struct Gates {
    normal: watch::Sender<u64>,
    sentinel: watch::Sender<u64>,
}

fn oracle(n: u64) -> u64 {
    n * 3 + 1
}

fn gated(gates: Arc<Gates>) -> Function {
    Function::new("gated").on_event(EVENT).retries(9).backoff(Backoff::Fixed(Duration::from_millis(10))).handler(
        move |ctx: Ctx, g: Gated| {
            let gates = gates.clone();
            async move {
                if ctx.attempt() == 1 {
                    let mut rx = if g.sentinel { gates.sentinel.subscribe() } else { gates.normal.subscribe() };
                    let _ = rx.wait_for(|v| *v >= g.iteration).await;
                }
                let out: u64 = ctx.step("work", || async move { Ok(oracle(g.n)) }).await?;
                Ok(out)
            }
        },
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reaper {
    /// The engine's own reaper pass (`Engine::reap_expired_leases`), held at its failpoint.
    Engine,
    /// Select as the engine does, then [`ID_ONLY_UPDATE`].
    IdOnly,
}

#[derive(Debug, Default)]
struct Totals {
    races: u64,
    reverted: u64,
    sentinels_reaped: u64,
}

struct Harness {
    engine: Engine,
    pool: PgPool,
    gates: Arc<Gates>,
    worker: WorkerHandle,
}

async fn start(opts: &PgConnectOptions) -> Harness {
    let (normal, _) = watch::channel(0);
    let (sentinel, _) = watch::channel(0);
    let gates = Arc::new(Gates { normal, sentinel });
    // Long lease, heartbeat and reap interval: only the test moves leases past
    // their end (the clock) and only the test reaps.
    let options = WorkerOptions {
        max_in_flight: 256,
        claim_batch: 64,
        poll_interval: Duration::from_millis(20),
        lease: LEASE,
        heartbeat_interval: LEASE,
        reap_interval: LEASE,
        shutdown_grace: Duration::from_millis(100),
        ..WorkerOptions::default()
    };
    let engine = Engine::builder()
        .database_url(url_of(opts))
        .max_connections(4)
        .worker_options(options)
        .function(gated(gates.clone()))
        .build()
        .await
        .unwrap();
    let pool = engine.pool().clone();
    let worker = engine.spawn_worker();
    Harness { engine, pool, gates, worker }
}

impl Harness {
    async fn wait_count(&self, ids: &[Uuid], state: &str, want: i64) {
        let what = format!("{want} runs {state}");
        wait_for(&what, WAIT, || async move {
            Ok((checks::count_in_state(&self.pool, ids, state).await? == want).then_some(()))
        })
        .await
        .unwrap();
    }

    /// One race of `PER_ITERATION` completions against one reaper pass.
    async fn race(&self, reaper: Reaper, iteration: u64, totals: &mut Totals) {
        let base = iteration * 1_000;
        let events: Vec<Event> = (0..=PER_ITERATION)
            .map(|i| {
                let g = Gated { iteration, n: base + i, sentinel: i == PER_ITERATION };
                Event::new(EVENT, &g)
            })
            .collect();
        let ids: Vec<Uuid> = self.engine.send_batch(events).await.unwrap().into_iter().map(|r| r.run_ids[0]).collect();
        let (normal, sentinel) = (&ids[..PER_ITERATION as usize], ids[PER_ITERATION as usize]);
        self.wait_count(&ids, "running", ids.len() as i64).await;
        durastep::testing::advance_clock(&self.engine, 2 * LEASE).await.unwrap();

        // The reaper selects every run of this iteration, and holds.
        let (held, seen) = match reaper {
            Reaper::Engine => {
                failpoints::set(FAILPOINT, "block");
                let engine = self.engine.clone();
                let pass = tokio::spawn(async move { engine.reap_expired_leases().await });
                wait_for("the reaper to hold between its select and its update", WAIT, || async {
                    Ok((failpoints::blocked(FAILPOINT) == 1).then_some(()))
                })
                .await
                .unwrap();
                (Some(pass), Vec::new())
            }
            Reaper::IdOnly => {
                let seen: Vec<Uuid> = sqlx::query_scalar(SELECT_EXPIRED).fetch_all(&self.pool).await.unwrap();
                assert_eq!(seen.len(), ids.len(), "the select must see every expired run");
                (None, seen)
            }
        };

        // Meanwhile the runs complete (their holder never lost them: nobody took them over).
        self.gates.normal.send_replace(iteration);
        self.wait_count(normal, "completed", PER_ITERATION as i64).await;
        let before = checks::runs(&self.pool, normal).await.unwrap();

        // The reaper's update runs with its stale list.
        let reaped = match held {
            Some(pass) => {
                failpoints::release(FAILPOINT);
                pass.await.unwrap().unwrap() as u64
            }
            None => sqlx::query(ID_ONLY_UPDATE).bind(&seen).execute(&self.pool).await.unwrap().rows_affected(),
        };
        let after = checks::runs(&self.pool, normal).await.unwrap();
        let reverted = before.iter().zip(&after).filter(|(b, a)| b != a).count() as u64;
        let s = checks::run(&self.pool, sentinel).await.unwrap();
        assert!(s.attempt >= 2, "the sentinel must have been taken back by the same update: {s:?}");
        totals.races += PER_ITERATION;
        totals.reverted += reverted;
        totals.sentinels_reaped += 1;
        if reaper == Reaper::Engine {
            assert_eq!(reaped, 1, "iteration {iteration}: the pass must take back the sentinel and nothing else");
        }

        // Let the sentinel's stale first attempt go (its writes are fenced); everything ends completed.
        self.gates.sentinel.send_replace(iteration);
        self.wait_count(&ids, "completed", ids.len() as i64).await;
        for r in checks::runs(&self.pool, &ids).await.unwrap() {
            assert!(r.output.is_some(), "{r:?}");
        }
    }

    async fn stop(self) {
        self.worker.stop().await.unwrap();
    }
}

/// The engine's reaper, held between its select and its update while 50 runs
/// complete, 20 times (soak: 200): 0 completed runs reverted.
#[sqlx::test(migrations = false)]
async fn reaper_never_reverts_a_run_completed_after_its_select(_p: PgPoolOptions, opts: PgConnectOptions) {
    let iterations = tier::scaled(20, 200);
    let h = start(&opts).await;
    let started = Instant::now();
    let mut totals = Totals::default();
    for i in 1..=iterations {
        h.race(Reaper::Engine, i, &mut totals).await;
    }
    let took = started.elapsed();
    assert_eq!(totals.reverted, 0, "completed runs reverted by the reaper: {totals:?}");
    assert_eq!(totals.sentinels_reaped, iterations);
    let problems: Vec<String> = sqlx::query_as::<_, (Uuid, String, Option<serde_json::Value>, serde_json::Value)>(
        "SELECT r.id, r.state, r.output, e.payload FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id",
    )
    .fetch_all(&h.pool)
    .await
    .unwrap()
    .into_iter()
    .filter_map(|(id, state, output, payload)| {
        let g: Gated = serde_json::from_value(payload).ok()?;
        let want = serde_json::Value::from(oracle(g.n));
        (state != "completed" || output.as_ref() != Some(&want)).then(|| format!("{id}: {state} {output:?}"))
    })
    .collect();
    assert!(problems.is_empty(), "{problems:?}");
    h.stop().await;
    eprintln!(
        "reaper_race: {} completions raced against a held reaper pass ({iterations} passes) in {took:.1?}: \
         0 completed runs reverted; every pass took back its sentinel ({} of {iterations})",
        totals.races, totals.sentinels_reaped
    );
}

/// The same race against an id-only reaper update: the test catches the bug
/// (every completed run is reverted), so the test above can fail.
#[sqlx::test(migrations = false)]
async fn an_id_only_reaper_is_caught_reverting_completed_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let iterations = 4;
    let h = start(&opts).await;
    let mut totals = Totals::default();
    for i in 1..=iterations {
        h.race(Reaper::IdOnly, i, &mut totals).await;
    }
    assert!(totals.reverted > 0, "the race failed to catch the id-only reaper: {totals:?}");
    assert_eq!(totals.reverted, totals.races, "every completed run in the list is reverted by the bug: {totals:?}");
    h.stop().await;
    eprintln!(
        "reaper_race (id-only reaper, the classic bug): {} of {} completed runs reverted: detected",
        totals.reverted, totals.races
    );
}
