//! The CI tier of the fuzzing (G11): the properties the cargo-fuzz targets in
//! `fuzz/` check, driven by a seeded generator of hostile input instead of the
//! fuzzer, so it runs in plain `cargo test` on stable with no extra tools.
//!
//! - Without a database: JSON text payloads, events (value and text payloads,
//!   names, idempotency keys) and names (event names, keys, step names,
//!   function ids, triggers) get exactly the oracle's verdict, with no panic.
//! - Against real Postgres: hostile events go through `Engine::send`; each is
//!   either refused with a typed `LimitError` and writes nothing (rows counted
//!   in `durastep.events` and `durastep.runs` before and after), or stored and
//!   read back as sent: its `events` row, and the output of a run that stores
//!   it as a step output, replays it after a retry and returns it. A hostile
//!   step name is refused by the step with a permanent failure. Every run
//!   finishes: no accepted value poisons a claim.
//!
//! The seed is printed; `DURASTEP_SEED=<n>` replays it. `DURASTEP_SOAK=1` runs
//! about 50 times as many cases.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::time::{Duration, Instant};

use durastep::limits::{self, LimitError, Limits};
use durastep::{Backoff, Ctx, Engine, Error, Function, HandlerError, RunState, WorkerOptions};
use durastep_fuzzkit::hostile::{self, EventCase, Payload};
use durastep_fuzzkit::{Source, check, depth, drop_flat, has_nul, max_depth, name_ok};
use serde_json::{Value, json};
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

/// The seed of this run (printed; `DURASTEP_SEED` replays one).
fn seed(test: &str) -> u64 {
    let seed = std::env::var("DURASTEP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(7, |d| d.as_nanos() as u64)
    });
    println!("{test}: seed {seed} (replay with DURASTEP_SEED={seed})");
    seed
}

/// `n`, or 50 times `n` with DURASTEP_SOAK=1.
fn cases(n: u64) -> u64 {
    if std::env::var("DURASTEP_SOAK").is_ok_and(|v| v == "1") { n * 50 } else { n }
}

/// The source of case `i`: each case has its own, so one can be replayed alone.
fn source(seed: u64, i: u64) -> Source<'static> {
    Source::seeded(seed ^ i.wrapping_mul(0x2545_F491_4F6C_DD1D))
}

/// Runs `f` and, if it panics, says which case of which seed did.
fn case<T>(seed: u64, i: u64, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(panic) => {
            eprintln!("case {i} of seed {seed} failed (replay with DURASTEP_SEED={seed})");
            resume_unwind(panic)
        }
    }
}

/// Counts verdicts by kind, for the printed summary.
#[derive(Default, Debug)]
struct Tally(std::collections::BTreeMap<&'static str, u64>);

impl Tally {
    fn add<T>(&mut self, verdict: &Result<T, LimitError>) {
        let kind = match verdict {
            Ok(_) => "accepted",
            Err(LimitError::TooLarge { .. }) => "TooLarge",
            Err(LimitError::TooDeep { .. }) => "TooDeep",
            Err(LimitError::NulCharacter) => "NulCharacter",
            Err(LimitError::InvalidJson(_)) => "InvalidJson",
            Err(LimitError::InvalidName { .. }) => "InvalidName",
            Err(_) => "other",
        };
        *self.0.entry(kind).or_default() += 1;
    }
}

/// Inputs every run checks, whatever the seed: the named corner cases.
fn corner_texts() -> Vec<String> {
    let ten_mb = "x".repeat(hostile::HUGE);
    let mut texts: Vec<String> = [
        r#""\ud800""#,
        r#""\udc00""#,
        r#""\udc00\ud800""#,
        r#""\ud800\ud800""#,
        r#""\ud83d\ude00""#,
        r#""\ud800\u0041""#,
        r#"{"\ud800": 1}"#,
        r#""\u0000""#,
        r#"{"\u0000": 1}"#,
        "\"a\u{0}b\"",
        "\u{0}",
        r#"{"a": 1, "a": 2}"#,
        r#"{"a": {"x": 1}, "a": [1, 2, 3]}"#,
        "1e400",
        "-1e400",
        "1e-400",
        "18446744073709551616",
        "-9223372036854775809",
        "1.7976931348623157e308",
        "1e16",
        "[5e-324, -0.0, 1E+2]",
        "NaN",
        "\u{feff}{}",
        "",
        " ",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    texts.push(format!("\"{ten_mb}\""));
    texts.push(format!("{}1", " ".repeat(hostile::HUGE)));
    texts.push(format!("1{}", "0".repeat(100_000)));
    for depth in [64, 65, 120, 121, 127, 128, 129, 10_000, 100_000] {
        texts.push("[".repeat(depth) + &"]".repeat(depth));
        texts.push("{\"a\":".repeat(depth) + "1" + &"}".repeat(depth));
    }
    // Invalid UTF-8 cannot be in a `&str`: what arrives is what the caller's
    // decoding made of it (U+FFFD with a lossy decode).
    for bytes in [&b"\"\xff\""[..], b"\"\xed\xa0\x80\"", b"{\"\xc0\x80\": 1}", b"[\"\xe2\x82\"]"] {
        assert!(std::str::from_utf8(bytes).is_err());
        texts.push(String::from_utf8_lossy(bytes).into_owned());
    }
    texts
}

/// JSON text payloads: the corner cases under the default and wide limits,
/// then generated text under generated limits.
#[test]
fn json_text_gets_the_oracles_verdict() {
    let seed = seed("json_text");
    let started = Instant::now();
    let mut tally = Tally::default();
    let wide =
        Limits { max_payload_bytes: 16 * 1024 * 1024, max_depth: 10_000, max_key_bytes: 4096, ..Limits::default() };
    for text in corner_texts() {
        for limits in [Limits::default(), wide] {
            let verdict = check::json_text(&text, &limits);
            tally.add(&verdict);
            if let Ok(v) = verdict {
                drop_flat(v);
            }
        }
    }
    let n = cases(4_000);
    for i in 0..n {
        case(seed, i, || {
            let mut src = source(seed, i);
            let limits = hostile::limits(&mut src);
            let text = hostile::json_text(&mut src, i % 1000 == 0);
            let verdict = check::json_text(&text, &limits);
            tally.add(&verdict);
            if let Ok(v) = verdict {
                drop_flat(v);
            }
        });
    }
    println!("json_text: {n} generated cases + corners in {:?}: {:?}", started.elapsed(), tally.0);
}

/// Events with value and text payloads, hostile names and keys.
#[test]
fn events_get_the_oracles_verdict() {
    let seed = seed("events");
    let started = Instant::now();
    let mut tally = Tally::default();
    let n = cases(3_000);
    for i in 0..n {
        case(seed, i, || {
            let mut src = source(seed, i);
            let limits = hostile::limits(&mut src);
            let event = hostile::event(&mut src, i % 1000 == 0, &["fuzz/echo"], EVENT_DEPTH);
            tally.add(&check::event(&event, &limits));
            event.drop_flat();
        });
    }
    println!("events: {n} cases in {:?}: {:?}", started.elapsed(), tally.0);
}

/// Names of any content and size, as event name, key, step name, function id, trigger.
#[test]
fn names_get_the_oracles_verdict() {
    let seed = seed("names");
    let started = Instant::now();
    let n = cases(3_000);
    for i in 0..n {
        case(seed, i, || {
            let mut src = source(seed, i);
            let limits = hostile::limits(&mut src);
            let (name, trigger) = (hostile::name(&mut src, i % 300 == 0), hostile::name(&mut src, false));
            check::names(&name, &trigger, &limits);
        });
    }
    println!("names: {n} cases in {:?}", started.elapsed());
}

/// The deepest values an event is built from here. `Event::new` serializes its
/// payload through serde (`serde_json::to_value`), which recurses once per
/// level before Durastep sees the value; the library's own checks do not
/// recurse, which `deep_values_are_refused_without_recursion` shows to 10,000 levels.
const EVENT_DEPTH: usize = 1_000;

/// Values 10,000 levels deep (and at every edge below): the checks the engine
/// runs on payloads and step outputs refuse them without recursing.
#[test]
fn deep_values_are_refused_without_recursion() {
    let seed = seed("deep_values");
    let mut src = Source::seeded(seed);
    let wide =
        Limits { max_payload_bytes: 16 * 1024 * 1024, max_depth: 10_000, max_key_bytes: 4096, ..Limits::default() };
    for &d in hostile::DEPTHS {
        for limits in [Limits::default(), wide] {
            let v = hostile::spine(&mut src, false, d);
            let verdict = limits::check_payload(&v, &limits);
            let nul = has_nul(&v);
            assert_eq!(depth(&v), d);
            match verdict {
                Err(LimitError::TooDeep { limit }) => assert!(d > max_depth(&limits) && limit == max_depth(&limits)),
                // A NUL met before the too-deep level is refused as such: either refusal is right.
                Err(LimitError::NulCharacter) => assert!(nul),
                Ok(text) => {
                    assert!(d <= max_depth(&limits) && !nul);
                    let back: Value = serde_json::from_str(&text).expect("accepted text reads back");
                    assert_eq!(back, v);
                    drop_flat(back);
                }
                Err(other) => panic!("depth {d}: {other:?}"),
            }
            drop_flat(v);
        }
    }
}

// ---------------------------------------------------------------------------
// End to end, against Postgres.

fn fast_options() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(30),
        heartbeat_interval: Duration::from_secs(2),
        reap_interval: Duration::from_millis(500),
        shutdown_grace: Duration::from_secs(5),
        max_in_flight: 8,
        ..Default::default()
    }
}

/// Echoes its input through a step that is replayed from the database after a retry.
fn echo() -> Function {
    Function::new("echo").on_event("fuzz/echo").backoff(Backoff::Fixed(Duration::ZERO)).handler(
        |ctx: Ctx, input: Value| async move {
            let stored: Value = ctx.step("echo", || async move { Ok(input) }).await?;
            if ctx.attempt() == 1 {
                return Err(HandlerError::new("retry, so that the step output is read back"));
            }
            Ok(stored)
        },
    )
}

/// Runs a step named by the payload (`{"step": name, "value": v}`) that returns
/// `v`, replayed after a retry, and returns what the step returned.
fn stepper() -> Function {
    Function::new("stepper").on_event("fuzz/step").backoff(Backoff::Fixed(Duration::ZERO)).handler(
        |ctx: Ctx, input: Value| async move {
            let name = input["step"].as_str().unwrap_or("not-a-string").to_owned();
            let value = input["value"].clone();
            let stored: Value = ctx.step(&name, || async move { Ok(value) }).await?;
            if ctx.attempt() == 1 {
                return Err(HandlerError::new("retry, so that the step output is read back"));
            }
            Ok(stored)
        },
    )
}

async fn counts(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT (SELECT count(*) FROM durastep.events), (SELECT count(*) FROM durastep.runs)")
        .fetch_one(pool)
        .await
        .expect("count rows")
}

/// JSON equality with numbers compared by value: `jsonb` keeps numbers as
/// `numeric`, so a float written `1e16` reads back as the integer
/// `10000000000000000` (the same number, another serde_json representation).
fn same_json(a: &Value, b: &Value) -> bool {
    let mut stack = vec![(a, b)];
    while let Some((a, b)) = stack.pop() {
        match (a, b) {
            (Value::Number(x), Value::Number(y)) => {
                let same = match (x.as_i128(), y.as_i128()) {
                    (Some(x), Some(y)) => x == y,
                    _ => x.as_f64() == y.as_f64(),
                };
                if !same {
                    return false;
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => stack.extend(x.iter().zip(y)),
            (Value::Object(x), Value::Object(y)) if x.len() == y.len() => {
                for (k, v) in x {
                    match y.get(k) {
                        Some(w) => stack.push((v, w)),
                        None => return false,
                    }
                }
            }
            (Value::Array(_) | Value::Object(_) | Value::Number(_), _) => return false,
            _ if a == b => {}
            _ => return false,
        }
    }
    true
}

/// The named corner cases as echo events (no key), and oversized names.
fn corner_events() -> Vec<EventCase> {
    let echo = |payload| EventCase { name: "fuzz/echo".into(), key: None, payload };
    let mut src = Source::seeded(11);
    let mut cases: Vec<EventCase> = corner_texts().into_iter().map(|t| echo(Payload::Text(t))).collect();
    cases.push(echo(Payload::Value(Value::String("x".repeat(hostile::HUGE)))));
    for d in [64, 65, 120, 121, EVENT_DEPTH] {
        cases.push(echo(Payload::Value(hostile::spine(&mut src, false, d))));
    }
    let numbers = json!([u64::MAX, i64::MIN, f64::MAX, f64::MIN, f64::MIN_POSITIVE, 5e-324, -0.0, 1e16, 1e300, 0.1]);
    cases.push(echo(Payload::Value(numbers)));
    let all: String = ["a", "\u{1}", "\n", "\u{7f}", "\u{2028}", "\u{feff}", "\u{fffd}", "\u{10ffff}", "\"\\"].concat();
    cases.push(echo(Payload::Value(json!({ all.clone(): all.clone(), "\\ud800": "\\u0000" }))));
    for bad in ["x".repeat(hostile::HUGE), "\u{0}".into(), String::new(), "a\nb".into()] {
        let ok = Payload::Value(json!(1));
        cases.push(EventCase { name: bad.clone(), key: None, payload: ok.clone() });
        cases.push(EventCase { name: "fuzz/echo".into(), key: Some(bad), payload: ok });
    }
    cases
}

/// A hostile event for the end-to-end test: about half echo events, a quarter
/// step events (a hostile step name and value), the rest as generated; half
/// of them with a plain key (or none), some with a key used before.
fn e2e_event(src: &mut Source<'_>, huge: bool) -> EventCase {
    let mut case = hostile::event(src, huge, &["fuzz/echo", "fuzz/echo", "fuzz/step"], EVENT_DEPTH);
    match src.below(8) {
        0 => case.key = Some("dup".into()),
        1..=3 => case.key = None,
        _ => {}
    }
    if case.name == "fuzz/step" {
        let wrapper = json!({"step": hostile::name(src, false), "value": hostile::value(src, false, 130)});
        case.payload = if src.below(2) == 0 {
            Payload::Value(wrapper)
        } else {
            Payload::Text(serde_json::to_string(&wrapper).expect("serialize"))
        };
    }
    case
}

/// What an accepted event should have stored, by the oracle.
fn expected_payload(case: &EventCase, limits: &Limits) -> Value {
    match &case.payload {
        Payload::Value(v) => v.clone(),
        Payload::Text(t) => limits::parse_payload(t, limits).expect("accepted text parses"),
    }
}

async fn send_hostile_events(opts: PgConnectOptions, limits: Limits, n: u64, test: &str) {
    let seed = seed(test);
    let started = Instant::now();
    let pool = PgPoolOptions::new().max_connections(6).connect_with(opts.clone()).await.expect("connect");
    let engine = Engine::builder()
        .pool(pool)
        .limits(limits)
        .worker_options(fast_options())
        .function(echo())
        .function(stepper())
        .build()
        .await
        .expect("engine");
    let pool = engine.pool().clone();
    // A second engine whose pool is closed: any statement it ran would fail
    // with PoolClosed, so a typed refusal from it shows no SQL was needed.
    let closed_pool = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.expect("connect");
    let closed = Engine::builder().pool(closed_pool).migrate(false).limits(limits).build().await.expect("engine");
    closed.pool().close().await;

    let mut tally = Tally::default();
    // Accepted payloads that read back with a number in another representation.
    let mut renumbered = 0u64;
    let mut keys: HashMap<(String, String), durastep::SendReceipt> = HashMap::new();
    // (run id, function, expected run outcome)
    let mut runs = Vec::new();
    let corners = corner_events();
    let n_corners = corners.len() as u64;
    let mut corners = corners.into_iter();
    for i in 0..n + n_corners {
        let case = match corners.next() {
            Some(case) => case,
            // Ten-megabyte cases: one in 25, at most 20 (also in the soak tier).
            None => e2e_event(&mut source(seed, i), i % 25 == 0 && i < 500),
        };
        let ctx = format!("case {i} of seed {seed} (DURASTEP_SEED={seed}), event {:?}", short(&case.name));
        let verdict = check::event(&case, &limits);
        tally.add(&verdict);
        let before = counts(&pool).await;
        let sent = engine.send(case.to_event()).await;
        let after = counts(&pool).await;
        match (sent, &verdict) {
            (Err(Error::Limit(e)), Err(expected)) => {
                assert_eq!(&e, expected, "{ctx}");
                assert_eq!(after, before, "{ctx}: a refused event wrote rows");
                let without_sql = closed.send(case.to_event()).await;
                assert!(matches!(&without_sql, Err(Error::Limit(l)) if l == expected), "{ctx}: {without_sql:?}");
            }
            (Ok(receipt), Ok(())) => {
                let dup_of = case.key.clone().and_then(|k| keys.get(&(case.name.clone(), k)));
                if let Some(first) = dup_of {
                    assert!(receipt.duplicate, "{ctx}: same name and key, yet a new event");
                    assert_eq!((receipt.event_id, &receipt.run_ids), (first.event_id, &first.run_ids), "{ctx}");
                    assert_eq!(after, before, "{ctx}: a duplicate wrote rows");
                    case.drop_flat();
                    continue;
                }
                assert!(!receipt.duplicate, "{ctx}: a first send reported as a duplicate");
                let triggered = matches!(case.name.as_str(), "fuzz/echo" | "fuzz/step") as i64;
                assert_eq!(receipt.run_ids.len() as i64, triggered, "{ctx}");
                assert_eq!(after, (before.0 + 1, before.1 + triggered), "{ctx}");
                let expected = expected_payload(&case, &limits);
                let stored: Value = sqlx::query_scalar("SELECT payload FROM durastep.events WHERE id = $1")
                    .bind(receipt.event_id)
                    .fetch_one(&pool)
                    .await
                    .expect("read the stored payload");
                assert!(same_json(&stored, &expected), "{ctx}: the stored payload differs from the one sent");
                renumbered += u64::from(stored != expected);
                drop_flat(stored);
                let outcome = match case.name.as_str() {
                    "fuzz/echo" => Some(Ok(expected)),
                    "fuzz/step" => {
                        let name = expected["step"].as_str().unwrap_or("not-a-string").to_owned();
                        let ok = limits::check_step_name(&name, &limits).is_ok();
                        assert_eq!(ok, name_ok(&name, &limits) && !name.contains('#'), "{ctx}: step name verdict");
                        Some(if ok { Ok(expected["value"].clone()) } else { Err(name) })
                    }
                    _ => None,
                };
                if let (Some(outcome), Some(id)) = (outcome, receipt.run_ids.first()) {
                    runs.push((*id, ctx, outcome));
                }
                if let Some(k) = case.key.clone() {
                    keys.insert((case.name.clone(), k), receipt);
                }
            }
            (sent, _) => panic!("{ctx}: oracle says {verdict:?}, engine.send gave {sent:?}"),
        }
        case.drop_flat();
    }
    let sent_in = started.elapsed();

    // Every accepted run finishes: completed with its input (or, for a bad step
    // name, failed at that step). A value that could not be read back would
    // fail the claim of every run claimed with it, and they would stay running.
    let worker = engine.spawn_worker();
    let deadline = Instant::now() + Duration::from_secs(60);
    for (id, ctx, outcome) in &runs {
        let left = deadline.saturating_duration_since(Instant::now());
        let run = engine.wait_for_run(*id, left).await.unwrap_or_else(|e| panic!("{ctx}: run did not finish: {e}"));
        match outcome {
            Ok(expected) => {
                assert_eq!(run.state, RunState::Completed, "{ctx}: {:?}", run.last_error);
                assert!(same_json(run.output.as_ref().expect("output"), expected), "{ctx}: output differs from input");
            }
            Err(step_name) => {
                assert_eq!(run.state, RunState::Failed, "{ctx}: bad step name {:?}", short(step_name));
                let error = run.last_error.unwrap_or_default();
                assert!(error.contains("step name"), "{ctx}: {error}");
                assert_eq!(run.attempt, 1, "{ctx}: a bad step name is a permanent failure");
            }
        }
    }
    worker.stop().await.expect("worker");
    let stuck: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durastep.runs WHERE state NOT IN ('completed', 'failed')")
            .fetch_one(&pool)
            .await
            .expect("count stuck runs");
    assert_eq!(stuck, 0, "runs left unfinished");
    println!(
        "{test}: {n_corners} corner and {n} generated events ({:?}, {renumbered} read back with a float as an integer); {} runs finished; sent in {sent_in:?}, total {:?}",
        tally.0,
        runs.len(),
        started.elapsed()
    );
}

fn short(s: &str) -> String {
    let cut: String = s.chars().take(40).collect();
    if cut.len() < s.len() { format!("{cut}... ({} bytes)", s.len()) } else { cut }
}

/// Default limits: 1 MiB, 64 levels, 512-byte names.
#[sqlx::test(migrations = false)]
async fn hostile_events_end_to_end_default_limits(_p: PgPoolOptions, opts: PgConnectOptions) {
    send_hostile_events(opts, Limits::default(), cases(250), "e2e_default_limits").await;
}

/// Wide limits: 16 MiB (10 MB strings get in), depth 10,000 (the supported
/// ceiling applies), 4,096-byte names.
#[sqlx::test(migrations = false)]
async fn hostile_events_end_to_end_wide_limits(_p: PgPoolOptions, opts: PgConnectOptions) {
    let wide =
        Limits { max_payload_bytes: 16 * 1024 * 1024, max_depth: 10_000, max_key_bytes: 4096, ..Limits::default() };
    send_hostile_events(opts, wide, cases(150), "e2e_wide_limits").await;
}
