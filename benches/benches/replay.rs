//! Step replay: a run with 1,000 stored steps resumes.
//!
//! `cargo bench -p durastep-benches --bench replay`
//!
//! A run executes 1,000 no-op steps for real (one run in flight: each step waits
//! for its own commit), then sleeps. Each round makes it due again (run_at = now,
//! plus a NOTIFY), and the idle worker claims it: the claim statement returns the
//! run's 1,000 stored results with it, and the handler replays 1,000 memoized
//! `ctx.step` calls before it sleeps again. The same is done for a run with no
//! stored steps; the difference of the two wake-to-handler times is the cost of
//! loading 1,000 steps in the claim. The load query is also timed alone.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use durastep::{Ctx, Engine, Event, Function};
use durastep_benches::db::BenchDb;
use durastep_benches::report::{Table, ms, percentile, result, thousands, verdict};
use serde_json::Value;
use sqlx::{PgPool, Row};
use tokio::sync::mpsc;
use uuid::Uuid;

const STEPS: usize = 1000;
const ROUNDS: usize = 40;

/// What the handler saw on one attempt.
struct Probe {
    entered: Instant,
    replayed: Instant,
}

fn replaying(id: &str, steps: usize, probes: mpsc::UnboundedSender<Probe>) -> Function {
    Function::new(id).on_event(format!("bench/{id}")).handler(move |ctx: Ctx, _: Value| {
        let probes = probes.clone();
        async move {
            let entered = Instant::now();
            for _ in 0..steps {
                ctx.step("s", || async { Ok(()) }).await?;
            }
            let _ = probes.send(Probe { entered, replayed: Instant::now() });
            ctx.sleep("nap", Duration::from_secs(3600)).await?;
            Ok(())
        }
    })
}

async fn wait_sleeping(pool: &PgPool, run: Uuid) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state: String = sqlx::query_scalar("SELECT state FROM durastep.runs WHERE id = $1")
            .bind(run)
            .fetch_one(pool)
            .await
            .unwrap();
        if state == "sleeping" {
            return;
        }
        assert!(Instant::now() < deadline, "run {run} stuck in {state}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Wakes the run `n` times; returns (wake -> handler entry, memoized replay) per round.
async fn rounds(
    pool: &PgPool,
    run: Uuid,
    probes: &mut mpsc::UnboundedReceiver<Probe>,
    n: usize,
) -> (Vec<Duration>, Vec<Duration>) {
    let (mut resume, mut replay) = (vec![], vec![]);
    for _ in 0..n {
        wait_sleeping(pool, run).await;
        tokio::time::sleep(Duration::from_millis(20)).await; // let the worker go idle
        let woke = Instant::now();
        let n = sqlx::query(
            "WITH u AS (UPDATE durastep.runs SET run_at = durastep.now() WHERE id = $1 AND state = 'sleeping' RETURNING id)
             SELECT pg_notify('durastep_wakeup', '') FROM u",
        )
        .bind(run)
        .execute(pool)
        .await
        .expect("wake")
        .rows_affected();
        assert_eq!(n, 1, "run was not sleeping");
        let p = tokio::time::timeout(Duration::from_secs(10), probes.recv()).await.expect("resumed in time").unwrap();
        resume.push(p.entered - woke);
        replay.push(p.replayed - p.entered);
    }
    (resume, replay)
}

/// The claim's own `run_records.sql` for the run `$1`: the steps as four
/// arrays (key, output, and the journal entry each carries since migration
/// 0029), the rest of the journal as three arrays of one scan. (The encodings
/// before it, steps as one jsonb object and the journal in its own scans or
/// as one jsonb array, were timed here until 0029 moved the steps' entries:
/// docs/performance.md "Replay's load in two arrays".)
const ARRAYS_ONE_SCAN: &str = concat!(
    "SELECT st.step_keys, st.step_outputs, st.step_positions, st.step_kinds, jr.journal_positions, jr.journal_kinds, jr.journal_keys
       FROM (SELECT $1::uuid AS id) c
",
    include_str!("../../crates/durastep/src/store/sql/run_records.sql")
);

/// Times `ROUNDS` loads of one run's steps and journal with the claim's
/// expression, decoded into a map of steps and a map of journal entries.
async fn load_encoded(pool: &PgPool, run: Uuid) -> Vec<Duration> {
    let mut out = vec![];
    for _ in 0..ROUNDS {
        let t = Instant::now();
        let row = sqlx::query(ARRAYS_ONE_SCAN).bind(run).fetch_one(pool).await.expect("load");
        let (keys, outputs): (Vec<String>, Vec<Value>) = (row.get(0), row.get(1));
        let (step_positions, step_kinds): (Vec<Option<i32>>, Vec<Option<String>>) = (row.get(2), row.get(3));
        let (p, k, s): (Vec<i32>, Vec<String>, Vec<String>) = (row.get(4), row.get(5), row.get(6));
        let mut journal: BTreeMap<i32, (String, String)> = p.into_iter().zip(k.into_iter().zip(s)).collect();
        for ((position, kind), key) in step_positions.into_iter().zip(step_kinds).zip(&keys) {
            if let Some(position) = position {
                journal.insert(position, (kind.unwrap_or_else(|| "step".to_owned()), key.clone()));
            }
        }
        let steps: HashMap<String, Value> = keys.into_iter().zip(outputs).collect();
        assert_eq!((steps.len(), journal.len()), (STEPS + 1, STEPS + 1));
        out.push(t.elapsed());
    }
    out
}

#[tokio::main]
async fn main() {
    let db = BenchDb::create("replay").await;
    let pool = db.pool(10).await;
    println!("# Step replay (database {})", db.name);
    let (tx_big, mut rx_big) = mpsc::unbounded_channel();
    let (tx_empty, mut rx_empty) = mpsc::unbounded_channel();
    let engine = Engine::builder()
        .pool(pool.clone())
        .function(replaying("replay1000", STEPS, tx_big))
        .function(replaying("replay0", 0, tx_empty))
        .build()
        .await
        .expect("build engine");
    let worker = engine.spawn_worker();

    let sent = Instant::now();
    let big = engine.send(Event::new("bench/replay1000", &0)).await.expect("send").run_ids[0];
    let first = tokio::time::timeout(Duration::from_secs(120), rx_big.recv()).await.expect("first attempt").unwrap();
    let executed = first.replayed - first.entered;
    let _ = sent;
    let empty = engine.send(Event::new("bench/replay0", &0)).await.expect("send").run_ids[0];
    rx_empty.recv().await.unwrap();

    // `ROUNDS` each, in blocks of half ordered big, empty, empty, big, so that
    // a drift of the machine over the bench touches both runs alike (woken
    // alternately, every resume of the empty run followed the big run's and
    // came out slower: docs/performance.md, 2026-12-04 night).
    let half = ROUNDS / 2;
    let (mut resume_big, mut replay_big) = rounds(&pool, big, &mut rx_big, half).await;
    let (mut resume_empty, _) = rounds(&pool, empty, &mut rx_empty, half).await;
    resume_empty.extend(rounds(&pool, empty, &mut rx_empty, half).await.0);
    let (resume, replay) = rounds(&pool, big, &mut rx_big, half).await;
    resume_big.extend(resume);
    replay_big.extend(replay);

    // The raw yardstick: the same 1,000 rows read by plain sqlx, one row each, into a map.
    let mut load = vec![];
    for _ in 0..ROUNDS {
        let t = Instant::now();
        let rows: Vec<(String, Value)> =
            sqlx::query_as("SELECT s.step_key, s.output FROM durastep.step_results s WHERE s.run_id = $1")
                .bind(big)
                .fetch_all(&pool)
                .await
                .expect("load steps");
        let map: HashMap<String, Value> = rows.into_iter().collect();
        assert_eq!(map.len(), STEPS + 1);
        load.push(t.elapsed());
    }

    // The claim's load expression alone.
    let one_scan = load_encoded(&pool, big).await;

    worker.stop().await.expect("worker");

    let med = |xs: &[Duration]| percentile(xs, 50.0);
    let mut enc = Table::new("The claim's load expression alone, with decode", &["encoding", "median", "p99"]);
    enc.row(vec![
        "steps as four arrays (with their journal entries), the rest of the journal as three: the claim's".into(),
        ms(med(&one_scan)),
        ms(percentile(&one_scan, 99.0)),
    ]);
    enc.print();
    let load_delta = med(&resume_big).saturating_sub(med(&resume_empty));
    let replay_total = load_delta + med(&replay_big);
    let mut t = Table::new(
        &format!("Step replay of {STEPS} stored steps (medians of {ROUNDS} resumes, idle worker, LISTEN on)"),
        &["what", "median", "p99", "note"],
    );
    t.row(vec![
        "wake -> handler entry, run with 1,000 stored steps".into(),
        ms(med(&resume_big)),
        ms(percentile(&resume_big, 99.0)),
        "UPDATE+NOTIFY, LISTEN wake, claim with steps, spawn".into(),
    ]);
    t.row(vec![
        "wake -> handler entry, run with no stored steps".into(),
        ms(med(&resume_empty)),
        ms(percentile(&resume_empty, 99.0)),
        "same path, nothing to load".into(),
    ]);
    t.row(vec!["time to load 1,000 steps via the claim (difference)".into(), ms(load_delta), "".into(), "".into()]);
    t.row(vec![
        "raw: the rows alone + decode (plain sqlx)".into(),
        ms(med(&load)),
        ms(percentile(&load, 99.0)),
        "SELECT key, output: 1,001 rows into a HashMap".into(),
    ]);
    t.row(vec![
        "1,000 memoized ctx.step calls".into(),
        ms(med(&replay_big)),
        ms(percentile(&replay_big, 99.0)),
        format!("{} memoized steps/s", thousands(STEPS as f64 / med(&replay_big).as_secs_f64())),
    ]);
    t.row(vec![
        "replay total: load + memoized calls".into(),
        ms(replay_total),
        "".into(),
        format!("target <= 2 ms: {}", verdict(replay_total <= Duration::from_millis(2))),
    ]);
    t.row(vec![
        "first attempt: 1,000 steps executed, 1 run in flight".into(),
        ms(executed),
        "".into(),
        format!("{} per step (one commit each)", ms(executed / STEPS as u32)),
    ]);
    t.print();
    // Ratio: to the raw load of the same 1,000 rows (query and decode alone).
    let raw_load = med(&load).as_secs_f64();
    result("replay_1000_ms", replay_total.as_secs_f64() * 1e3, Some(replay_total.as_secs_f64() / raw_load));

    pool.close().await;
    db.drop_database().await;
}
