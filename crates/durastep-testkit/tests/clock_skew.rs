//! Clock skew: worker processes whose wall clock is 300 s ahead and 300 s
//! behind the database's (libfaketime, Debian package `faketime`), running
//! runs that sleep durably (`sleeper`: a step, `ctx.sleep`, a step).
//!
//! Pass figure: 0 timers fire early. For every run, the `after` step's body
//! (ledger, database clock) started no earlier than the wake time stored in
//! its `nap` checkpoint, whichever worker armed the sleep and whichever resumed
//! it; and that stored wake time is the sleep's length after the call by the
//! database clock (between the end of the `before` body and the storing of
//! the checkpoint, plus the length). The test also checks that the skew was real: the ledger's
//! `worker_clock` (each worker's own wall clock) is 300 s off the database's.
//! A worker that computed its wake time or due-ness from its wall clock would
//! fail here: 300 s behind, its sleeps would end at once.
//!
//! Needs libfaketime: the test fails at once, saying so, if it is missing
//! (`apt-get install faketime`; `.ci/run` installs it). Sleep lengths come
//! from a printed seed; `DURASTEP_SEED=<n>` replays it. `DURASTEP_SOAK=1`
//! runs 1,000 sleepers instead of 100.

use std::path::Path;
use std::time::Duration;

use durastep_testkit::{Cluster, Sleeper, WorkerConfig, checks, ledger, sleeper_oracle, url_of};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

const BIN: &str = env!("CARGO_BIN_EXE_durastep-test-worker");
const LIBFAKETIME: [&str; 2] =
    ["/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1", "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1"];
const SKEW_S: i64 = 300;

fn libfaketime() -> &'static str {
    LIBFAKETIME.iter().copied().find(|p| Path::new(p).exists()).unwrap_or_else(|| {
        panic!(
            "clock_skew needs libfaketime (none of {LIBFAKETIME:?} exists): install it with \
             `apt-get install -y faketime` (.ci/run does)"
        )
    })
}

/// A worker whose wall clock is `offset_s` seconds off (the monotonic clock is
/// left alone: leases and timeouts are measured on it, and skew is about wall clocks).
fn skewed(offset_s: i64) -> WorkerConfig {
    let mut config = WorkerConfig { max_in_flight: 32, claim_batch: 32, ..WorkerConfig::default() };
    config.env = vec![
        ("LD_PRELOAD".into(), libfaketime().into()),
        ("FAKETIME".into(), format!("{offset_s:+}s")),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        ("FAKETIME_NO_CACHE".into(), "1".into()),
    ];
    config
}

fn seed() -> u64 {
    std::env::var("DURASTEP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64 | 1
    })
}

#[sqlx::test(migrations = false)]
async fn skewed_workers_never_fire_timers_early(_p: PgPoolOptions, opts: PgConnectOptions) {
    let lib = libfaketime();
    let seed = seed();
    let n: u64 = if std::env::var_os("DURASTEP_SOAK").is_some() { 1_000 } else { 100 };
    eprintln!("clock_skew: seed {seed} (DURASTEP_SEED replays it), {n} sleepers, {lib}");
    let mut x = seed;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };

    let mut c = Cluster::start(BIN, url_of(&opts)).await.unwrap();
    let ahead = c.spawn(skewed(SKEW_S)).await.unwrap();
    let behind = c.spawn(skewed(-SKEW_S)).await.unwrap();
    // Sleeps of 0.5-3 s by the database clock.
    let inputs: Vec<Sleeper> = (0..n).map(|i| Sleeper { n: i, sleep_ms: 500 + next() % 2_500 }).collect();
    let runs = c.send_sleepers(inputs).await.unwrap();
    let finished = c.wait_finished(&runs, Duration::from_secs(90)).await;

    let pool = c.pool().clone();
    // Early wake-ups first: they are the failure this test is for (a worker
    // trusting its own clock also makes the runs of the other one sleep 300 s too long).
    let wake_ups = ledger::wake_ups(&pool).await.unwrap();
    let early: Vec<_> = wake_ups.iter().filter(|w| w.resumed_at < w.wake_at).collect();
    assert!(early.is_empty(), "{} timers fired early; first: {:?}", early.len(), early.first());
    // And the stored wake time is the one asked for, by the database clock:
    // the sleep was called after `before` ended and before `nap` was stored,
    // and the worker's idea of the database time is never ahead of it (G5),
    // at most a claim round trip behind (1 s allowed). A wake time taken from
    // a skewed wall clock would be 300 s off.
    for w in &wake_ups {
        let d = chrono::Duration::milliseconds(w.sleep_ms);
        assert!(w.wake_at <= w.armed_at + d, "wake time later than asked (by the database clock): {w:?}");
        let lower = w.before_ended_at.unwrap() + d - chrono::Duration::seconds(1);
        assert!(w.wake_at >= lower, "wake time earlier than asked (by the database clock): {w:?}");
    }
    finished.unwrap();
    let offset: f64 = sqlx::query_scalar("SELECT extract(epoch FROM offset_by)::float8 FROM durastep.clock")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(offset, 0.0, "the database clock must be the real one here");
    for &run in &runs {
        let r = checks::run(&pool, run).await.unwrap();
        assert_eq!(r.state, "completed", "{r:?}");
        let input: u64 = sqlx::query_scalar("SELECT (e.payload->>'n')::bigint FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id WHERE r.id = $1")
            .bind(run)
            .fetch_one(&pool)
            .await
            .map(|v: i64| v as u64)
            .unwrap();
        assert_eq!(r.output, Some(Value::from(sleeper_oracle(input))), "{r:?}");
    }

    assert!(wake_ups.len() as u64 >= n, "{} wake-ups for {n} runs", wake_ups.len());
    let late: Vec<f64> = wake_ups.iter().map(|w| (w.resumed_at - w.wake_at).num_milliseconds() as f64 / 1e3).collect();
    let max_late = late.iter().copied().fold(0.0, f64::max);

    // The skew was real: each worker's wall clock vs the database's, per ledger row.
    let mut skews = Vec::new();
    for (i, want) in [(ahead, SKEW_S), (behind, -SKEW_S)] {
        let pid = c.worker(i).pid() as i32;
        let rows: Vec<_> = ledger::executions(&pool).await.unwrap().into_iter().filter(|e| e.pid == pid).collect();
        assert!(!rows.is_empty(), "worker {i} ran nothing");
        for e in &rows {
            let skew = (e.worker_clock.unwrap() - e.started_at).num_milliseconds() as f64 / 1e3;
            assert!((skew - want as f64).abs() < 5.0, "worker {i} should be {want} s off, is {skew} s: {e:?}");
        }
        let resumed = wake_ups.iter().filter(|w| w.worker == c.worker(i).label()).count();
        skews.push((c.worker(i).label().to_owned(), want, rows.len(), resumed));
    }
    for (i, status) in c.shutdown(Duration::from_secs(20)).await.unwrap() {
        assert!(status.success(), "worker {i}: {status}");
    }
    eprintln!(
        "clock_skew: seed {seed}: {n} sleepers (0.5-3 s) on workers {skews:?} (label, skew s, step bodies, \
         resumptions): 0 of {} timers fired early by the database clock; latest resumption {max_late:.2} s \
         after its wake time",
        wake_ups.len()
    );
}
