//! Hostile input against a real database: oversized, NUL-bearing, deeply
//! nested or malformed payloads and bad names or idempotency keys are refused
//! by `Engine::send` with a typed [`LimitError`] before any SQL runs (no row is
//! written, and an engine whose pool is closed gives the same typed refusal, so
//! the database was never asked). Plus a seeded property test of the limits
//! (the seed is printed; `DURASTEP_FUZZ_SEED=<n>` replays it) and the
//! least-privilege role recipe of `docs/security.md`, run end to end.
//!
//! The coverage-guided fuzz targets are in `fuzz/` (see `scripts/fuzz-smoke.sh`).

use std::time::Duration;

use durastep::limits::{self, LimitError, Limits};
use durastep::{Ctx, Engine, Error, Event, Function, HandlerError, RunState, WorkerOptions};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgPool};

const DEADLINE: Duration = Duration::from_secs(15);

fn fast_options() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(500),
        reap_interval: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(5),
        max_in_flight: 8,
        ..Default::default()
    }
}

async fn engine_on(opts: &PgConnectOptions, functions: Vec<Function>, migrate: bool) -> Result<Engine, Error> {
    let pool = PgPoolOptions::new().max_connections(4).connect_with(opts.clone()).await?;
    let mut b = Engine::builder().pool(pool).migrate(migrate).worker_options(fast_options());
    for f in functions {
        b = b.function(f);
    }
    b.build().await
}

fn echo() -> Function {
    Function::new("echo").on_event("limits/go").handler(|_ctx: Ctx, v: Value| async move { Ok(v) })
}

async fn counts(pool: &PgPool) -> (i64, i64) {
    sqlx::query_as("SELECT (SELECT count(*) FROM durastep.events), (SELECT count(*) FROM durastep.runs)")
        .fetch_one(pool)
        .await
        .expect("count rows")
}

/// A value nested `depth` arrays deep, built and later dropped without recursion.
fn nested(depth: usize) -> Value {
    let mut v = json!(1);
    for _ in 0..depth {
        v = Value::Array(vec![v]);
    }
    v
}

fn drop_flat(mut v: Value) {
    while let Value::Array(mut items) = v {
        v = items.pop().unwrap_or(Value::Null);
    }
}

fn key_error(what: &'static str) -> impl Fn(&Error) -> bool {
    move |e| matches!(e, Error::Limit(LimitError::InvalidName { what: w, .. }) if *w == what)
}

/// Tells the expected refusal from any other outcome.
type Refusal = Box<dyn Fn(&Error) -> bool>;

/// Every hostile event, with the refusal it must get.
fn hostile_events() -> Vec<(&'static str, Event, Refusal)> {
    let ten_mb = "x".repeat(10 * 1024 * 1024);
    let deep = nested(1_000);
    let deep_event = Event::new("limits/go", &deep);
    drop_flat(deep);
    let limit = |e: LimitError| -> Refusal { Box::new(move |got| matches!(got, Error::Limit(l) if *l == e)) };
    vec![
        (
            "10 MB string",
            Event::new("limits/go", &ten_mb),
            Box::new(|e| matches!(e, Error::Limit(LimitError::TooLarge { .. }))),
        ),
        (
            "10 MB JSON text",
            Event::from_json("limits/go", format!("\"{ten_mb}\"")),
            limit(LimitError::TooLarge { size: ten_mb.len() + 2, limit: 1024 * 1024 }),
        ),
        ("NUL in a string", Event::new("limits/go", &json!({"a": "x\u{0}y"})), limit(LimitError::NulCharacter)),
        ("NUL in a key", Event::new("limits/go", &json!({"a\u{0}": 1})), limit(LimitError::NulCharacter)),
        ("\\u0000 in JSON text", Event::from_json("limits/go", r#"{"a": "\u0000"}"#), limit(LimitError::NulCharacter)),
        ("1000-deep value", deep_event, limit(LimitError::TooDeep { limit: 64 })),
        (
            "100k-deep JSON text",
            Event::from_json("limits/go", "[".repeat(100_000) + &"]".repeat(100_000)),
            limit(LimitError::TooDeep { limit: 64 }),
        ),
        (
            "lone surrogate",
            Event::from_json("limits/go", r#"{"a": "\ud800"}"#),
            Box::new(|e| matches!(e, Error::Limit(LimitError::InvalidJson(_)))),
        ),
        (
            "raw NUL byte in JSON text",
            Event::from_json("limits/go", "\"a\u{0}b\""),
            Box::new(|e| matches!(e, Error::Limit(LimitError::InvalidJson(_)))),
        ),
        (
            "truncated JSON text",
            Event::from_json("limits/go", r#"{"a": [1, 2"#),
            Box::new(|e| matches!(e, Error::Limit(LimitError::InvalidJson(_)))),
        ),
        ("empty event name", Event::new("", &1), Box::new(key_error("event name"))),
        ("NUL in event name", Event::new("limits/\u{0}go", &1), Box::new(key_error("event name"))),
        ("10 MB event name", Event::new(ten_mb.clone(), &1), Box::new(key_error("event name"))),
        (
            "empty idempotency key",
            Event::new("limits/go", &1).idempotency_key(""),
            Box::new(key_error("idempotency key")),
        ),
        (
            "NUL in idempotency key",
            Event::new("limits/go", &1).idempotency_key("k\u{0}"),
            Box::new(key_error("idempotency key")),
        ),
        (
            "newline in idempotency key",
            Event::new("limits/go", &1).idempotency_key("a\nb"),
            Box::new(key_error("idempotency key")),
        ),
        (
            "10 MB idempotency key",
            Event::new("limits/go", &1).idempotency_key(ten_mb),
            Box::new(key_error("idempotency key")),
        ),
        (
            "513-byte idempotency key",
            Event::new("limits/go", &1).idempotency_key("k".repeat(513)),
            Box::new(key_error("idempotency key")),
        ),
    ]
}

#[sqlx::test(migrations = false)]
async fn hostile_events_are_refused_before_any_sql(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine_on(&opts, vec![echo()], true).await.expect("build engine");
    let before = counts(engine.pool()).await;

    for (what, event, expected) in hostile_events() {
        let err = engine.send(event.clone()).await.expect_err(what);
        assert!(expected(&err), "{what}: got {err:?}");
        // In a batch, one bad event refuses the whole batch.
        let err = engine.send_batch(vec![Event::new("limits/go", &1), event.clone()]).await.expect_err(what);
        assert!(expected(&err), "{what} in a batch: got {err:?}");
        let mut tx = engine.pool().begin().await.expect("begin");
        let err = engine.send_in(&mut tx, event).await.expect_err(what);
        assert!(expected(&err), "{what} via send_in: got {err:?}");
        tx.rollback().await.expect("rollback");
    }
    assert_eq!(counts(engine.pool()).await, before, "a refused event wrote rows");

    // The counts can move: a good event (the largest and deepest allowed) is stored.
    let biggest = "y".repeat(1024 * 1024 - 2);
    let receipt = engine.send(Event::new("limits/go", &biggest)).await.expect("1 MiB payload");
    assert_eq!(receipt.run_ids.len(), 1);
    let deepest = nested(63); // 63 arrays around a number: depth 63, limit 64
    engine.send(Event::new("limits/go", &deepest).idempotency_key("k".repeat(512))).await.expect("deep payload");
    drop_flat(deepest);
    engine.send(Event::from_json("limits/go", r#"{"emoji": "\ud83d\ude00"}"#)).await.expect("surrogate pair");
    assert_eq!(counts(engine.pool()).await, (before.0 + 3, before.1 + 3));

    // No SQL at all: with the pool closed, any statement would fail with
    // PoolClosed, yet every refusal is still the typed limit error.
    let closed = engine_on(&opts, vec![], false).await.expect("second engine");
    closed.pool().close().await;
    for (what, event, expected) in hostile_events() {
        let err = closed.send(event).await.expect_err(what);
        assert!(expected(&err), "{what} with the pool closed: got {err:?}");
    }
    let err = closed.send(Event::new("limits/go", &1)).await.expect_err("a good event needs the database");
    assert!(matches!(err, Error::Database(sqlx::Error::PoolClosed)), "{err:?}");
}

#[sqlx::test(migrations = false)]
async fn configured_limits_are_enforced(_p: PgPoolOptions, opts: PgConnectOptions) {
    let pool = PgPoolOptions::new().max_connections(2).connect_with(opts.clone()).await.expect("connect");
    let limits = Limits { max_payload_bytes: 100, max_depth: 2, max_key_bytes: 12, ..Limits::default() };
    let engine = Engine::builder().pool(pool).limits(limits).function(echo()).build().await.expect("engine");
    let before = counts(engine.pool()).await;
    let cases: Vec<(Event, Result<(), LimitError>)> = vec![
        (Event::new("limits/go", &"a".repeat(98)), Ok(())),
        (Event::new("limits/go", &"a".repeat(99)), Err(LimitError::TooLarge { size: 101, limit: 100 })),
        (Event::from_json("limits/go", format!("{:101}", 1)), Err(LimitError::TooLarge { size: 101, limit: 100 })),
        (Event::new("limits/go", &json!([[1]])), Ok(())),
        (Event::new("limits/go", &json!([[[1]]])), Err(LimitError::TooDeep { limit: 2 })),
        (Event::from_json("limits/go", "[[[1]]]"), Err(LimitError::TooDeep { limit: 2 })),
        (Event::new("limits/go", &1).idempotency_key("123456789012"), Ok(())),
    ];
    let mut stored = 0;
    for (event, expected) in cases {
        let got = engine.send(event).await;
        match expected {
            Ok(()) => {
                got.expect("accepted");
                stored += 1;
            }
            Err(e) => assert!(matches!(&got, Err(Error::Limit(l)) if *l == e), "expected {e:?}, got {got:?}"),
        }
    }
    let err = engine.send(Event::new("limits/go", &1).idempotency_key("1234567890123")).await.unwrap_err();
    assert!(key_error("idempotency key")(&err), "{err:?}");
    // Function ids and triggers are checked at build, before connecting.
    for (id, trigger) in [("a/on-failure", "t"), ("", "t"), ("ok", ""), ("ok", "a\u{0}")] {
        let f = Function::new(id).on_event(trigger).handler(|_c: Ctx, _x: ()| async { Ok(()) });
        let err = Engine::builder().function(f).build().await.expect_err("refused");
        assert!(matches!(err, Error::Limit(LimitError::InvalidName { .. })), "{id:?}/{trigger:?}: {err:?}");
    }
    assert_eq!(counts(engine.pool()).await, (before.0 + stored, before.1 + stored));
}

/// A tiny PRNG (splitmix64), so the property test needs no extra dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn string(&mut self) -> String {
        const PIECES: &[&str] =
            &["a", "é", "\u{0}", "\n", "\"", "\\", "[", "{", "#", "/", "\u{1F600}", "\u{7f}", "\u{fffe}", " ", ":"];
        let len = match self.below(20) {
            0 => 600 + self.below(2000) as usize,
            _ => self.below(12) as usize,
        };
        (0..len).map(|_| PIECES[self.below(PIECES.len() as u64) as usize]).collect()
    }

    /// JSON-ish text: mostly valid, sometimes broken by a hostile fragment.
    fn json_text(&mut self, depth: usize) -> String {
        match (self.below(9), depth > 80) {
            (0, false) => {
                format!("[{}]", (0..self.below(3)).map(|_| self.json_text(depth + 1)).collect::<Vec<_>>().join(","))
            }
            (1, false) => format!("{{\"k{}\":{}}}", self.below(3), self.json_text(depth + 1)),
            (2, _) => serde_json::to_string(&self.string()).expect("a string serializes"),
            (3, _) => {
                ["\"\\ud800\"", "\"\\u0000\"", "\"\\udc00\\ud800\"", "\"\\uD83D\\uDE00\"", "1e999", "-0", "[", "}"]
                    [self.below(8) as usize]
                    .to_owned()
            }
            (4, _) => "[".repeat(self.below(200) as usize),
            _ => self.below(1_000_000).to_string(),
        }
    }
}

fn depth_of(v: &Value) -> usize {
    match v {
        Value::Array(items) => 1 + items.iter().map(depth_of).max().unwrap_or(0),
        Value::Object(map) => 1 + map.values().map(depth_of).max().unwrap_or(0),
        _ => 0,
    }
}

fn has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(items) => items.iter().any(has_nul),
        Value::Object(map) => map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

/// Seeded hostile inputs against the limit checks, with an oracle for each
/// verdict. Cheap (no database); the coverage-guided version is `fuzz/`.
#[test]
fn seeded_hostile_inputs_get_the_right_verdict() {
    let seed = std::env::var("DURASTEP_FUZZ_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(7)
    });
    println!("seed {seed} (replay with DURASTEP_FUZZ_SEED={seed})");
    let mut rng = Rng(seed);
    for i in 0..3_000 {
        let limits = Limits {
            max_payload_bytes: [64, 1024, 1024 * 1024][rng.below(3) as usize],
            max_depth: rng.below(100) as usize,
            max_key_bytes: rng.below(600) as usize,
            ..Limits::default()
        };
        let text = rng.json_text(0);
        let parsed = serde_json::from_str::<Value>(&text);
        let got = limits::parse_payload(&text, &limits);
        let ctx = format!("case {i} of seed {seed}: {limits:?} {:?}", text.chars().take(200).collect::<String>());
        match &got {
            Ok(v) => {
                assert_eq!(parsed.as_ref().ok(), Some(v), "{ctx}");
                assert!(
                    text.len() <= limits.max_payload_bytes && depth_of(v) <= limits.max_depth && !has_nul(v),
                    "{ctx}"
                );
            }
            Err(LimitError::TooLarge { size, .. }) => assert!(*size > limits.max_payload_bytes, "{ctx}"),
            Err(LimitError::TooDeep { .. }) => {
                assert!(parsed.as_ref().map_or(true, |v| depth_of(v) > limits.max_depth), "{ctx}")
            }
            Err(LimitError::NulCharacter) => assert!(parsed.as_ref().is_ok_and(has_nul), "{ctx}"),
            Err(LimitError::InvalidJson(_)) => assert!(parsed.is_err(), "{ctx}"),
            Err(e) => panic!("{ctx}: unexpected {e:?}"),
        }
        let name = rng.string();
        let name_ok = !name.is_empty() && name.len() <= limits.max_key_bytes && !name.chars().any(char::is_control);
        assert_eq!(limits::check_name("event name", &name, &limits).is_ok(), name_ok, "{ctx} name {name:?}");
        assert_eq!(limits::check_step_name(&name, &limits).is_ok(), name_ok && !name.contains('#'), "{ctx} {name:?}");
        let event = Event::new("e", &Value::Null).idempotency_key(name.clone());
        assert_eq!(event.validate(&limits).is_ok(), name_ok, "{ctx} key {name:?}");
    }
}

/// The least-privilege recipe of docs/security.md, run as written: an owner
/// role with only CREATE on the database migrates and runs the grants block; a
/// role with only those grants runs the engine end to end (send, steps, a
/// step_tx, a failure handler), and cannot change the schema.
#[sqlx::test(migrations = false)]
async fn restricted_role_runs_the_engine(_p: PgPoolOptions, opts: PgConnectOptions) {
    let admin = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.expect("admin");
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (owner, app) = (format!("durastep_owner_{suffix}"), format!("durastep_app_{suffix}"));
    let db = opts.get_database().unwrap_or("postgres").to_owned();
    for sql in [
        format!("CREATE ROLE {owner} LOGIN"),
        format!("GRANT CREATE ON DATABASE \"{db}\" TO {owner}"),
        format!("CREATE ROLE {app} LOGIN"),
        "CREATE TABLE public.app_log (id bigint)".to_owned(),
        format!("GRANT SELECT, INSERT ON public.app_log TO {app}"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone())).execute(&admin).await.expect(&sql);
    }
    let result = async {
        let owner_pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(opts.clone().username(&owner))
            .await
            .map_err(|e| e.to_string())?;
        durastep::migrate(&owner_pool).await.map_err(|e| format!("migrate as owner: {e}"))?;
        let grants = runtime_grants().replace("durastep_app", &app);
        sqlx::raw_sql(sqlx::AssertSqlSafe(grants))
            .execute(&owner_pool)
            .await
            .map_err(|e| format!("grants from docs/security.md: {e}"))?;
        owner_pool.close().await;
        run_as(&opts.clone().username(&app)).await
    }
    .await;

    // Drop the cluster-wide roles before judging, so a failure leaves none behind.
    for sql in [
        "DROP SCHEMA IF EXISTS durastep CASCADE".to_owned(),
        format!("DROP OWNED BY {app}, {owner}"),
        format!("DROP ROLE {app}"),
        format!("DROP ROLE {owner}"),
    ] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone())).execute(&admin).await.expect(&sql);
    }
    result.expect("the recipe of docs/security.md");
}

/// The runtime role's grants: the ```sql block after the marker in docs/security.md.
fn runtime_grants() -> String {
    let doc = include_str!("../../../docs/security.md");
    let (_, after) = doc.split_once("<!-- runtime-grants -->").expect("marker in docs/security.md");
    let block = after.split_once("```sql\n").expect("sql block").1;
    block.split_once("```").expect("end of sql block").0.to_owned()
}

async fn run_as(app: &PgConnectOptions) -> Result<(), String> {
    let fail = |e: &dyn std::fmt::Display| e.to_string();
    // It cannot migrate or change the schema...
    let pool = PgPoolOptions::new().max_connections(1).connect_with(app.clone()).await.map_err(|e| fail(&e))?;
    if durastep::migrate(&pool).await.is_ok() {
        return Err("the runtime role could run migrations".into());
    }
    if pool.execute("CREATE TABLE durastep.x (id int)").await.is_ok() {
        return Err("the runtime role could create a table".into());
    }
    if pool.execute("UPDATE durastep.clock SET offset_by = '1 day'").await.is_ok() {
        return Err("the runtime role could move the clock".into());
    }
    pool.close().await;

    // ... but runs everything else.
    let steps = Function::new("steps").on_event("role/go").handler(|ctx: Ctx, n: i64| async move {
        let a: i64 = ctx.step("one", || async move { Ok(n + 1) }).await?;
        ctx.step_tx("log", async move |conn| {
            sqlx::query("INSERT INTO public.app_log (id) VALUES ($1)").bind(a).execute(&mut *conn).await?;
            Ok(())
        })
        .await?;
        Ok(a * 10)
    });
    let failing = Function::new("failing")
        .on_event("role/fail")
        .retries(0)
        .on_failure(|_ctx: Ctx, failed: durastep::FailedRun<()>| async move {
            assert_eq!(failed.error, "no");
            Ok(())
        })
        .handler(|_ctx: Ctx, _x: ()| async { Err::<(), _>(HandlerError::permanent("no")) });
    // One at a time: the second run starts only once the first gives its slot back.
    let limited = Function::new("limited")
        .on_event("role/limited")
        .concurrency(durastep::Concurrency::new(1))
        .handler(|ctx: Ctx, n: i64| async move { ctx.step("one", || async move { Ok(n) }).await });
    let engine = engine_on(app, vec![steps, failing, limited], false).await.map_err(|e| fail(&e))?;
    let worker = engine.spawn_worker();
    let ok = engine.send(Event::new("role/go", &4).idempotency_key("k1")).await.map_err(|e| fail(&e))?;
    let again = engine.send(Event::new("role/go", &4).idempotency_key("k1")).await.map_err(|e| fail(&e))?;
    let bad = engine.send(Event::new("role/fail", &())).await.map_err(|e| fail(&e))?;
    let one_at_a_time = engine
        .send_batch(vec![Event::new("role/limited", &1), Event::new("role/limited", &2)])
        .await
        .map_err(|e| fail(&e))?;
    let run = engine.wait_for_run(ok.run_ids[0], DEADLINE).await.map_err(|e| fail(&e))?;
    let failed = engine.wait_for_run(bad.run_ids[0], DEADLINE).await.map_err(|e| fail(&e))?;
    let handler_ran = wait_for_failure_handler(engine.pool(), DEADLINE).await;
    for sent in &one_at_a_time {
        let limited = engine.wait_for_run(sent.run_ids[0], DEADLINE).await.map_err(|e| fail(&e))?;
        if limited.state != RunState::Completed {
            return Err(format!("a run with a concurrency limit as the role: {limited:?}"));
        }
    }
    // The handing send too: the sends above take it only when they find the
    // worker idle, so call it directly: for an event no function takes and
    // no topic row exists (it calls send_event_to_worker_by_claim), and for one
    // whose topic row the sends above created (it inserts the run itself).
    for name in ["role/nobody", "role/go"] {
        sqlx::query(
            "SELECT * FROM durastep.send_event_to_worker(gen_random_uuid(), $1, '1', NULL, 0,
                                                       gen_random_uuid(), 30, ARRAY['steps'], ARRAY[0], 1)",
        )
        .bind(name)
        .fetch_all(engine.pool())
        .await
        .map_err(|e| format!("the handing send of {name}: {e}"))?;
    }
    worker.stop().await.map_err(|e| fail(&e))?;

    if !again.duplicate || run.state != RunState::Completed || run.output != Some(json!(50)) {
        return Err(format!("run as the role: {run:?}, duplicate {}", again.duplicate));
    }
    if failed.state != RunState::Failed || !handler_ran {
        return Err(format!("failure path as the role: {failed:?}, handler completed: {handler_ran}"));
    }
    Ok(())
}

async fn wait_for_failure_handler(pool: &PgPool, timeout: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        let done: Option<bool> = sqlx::query_scalar(
            "SELECT state = 'completed' FROM durastep.runs WHERE function_id = 'failing/on-failure'",
        )
        .fetch_optional(pool)
        .await
        .ok()
        .flatten();
        if done == Some(true) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// A step output is returned as is on its first run and read back from `jsonb`
/// on every replay: the two must be the same value, floats included (serde_json
/// parses floats exactly only with its `float_roundtrip` feature).
#[sqlx::test(migrations = false)]
async fn floats_survive_the_jsonb_round_trip(_p: PgPoolOptions, opts: PgConnectOptions) {
    let pool = PgPoolOptions::new().max_connections(1).connect_with(opts).await.expect("connect");
    let mut rng = Rng(0x5eed);
    let mut floats = vec![2.6079843774798866e-110, 4.4444444444444436e+38, 0.1, 1e300, 5e-324, f64::MAX, -0.0];
    floats.extend((0..2_000).map(|_| f64::from_bits(rng.next())).filter(|f| f.is_finite()));
    let texts: Vec<String> = floats.iter().map(|f| serde_json::to_string(&json!([f])).expect("serialize")).collect();
    let back: Vec<Value> =
        sqlx::query_scalar("SELECT t::jsonb FROM unnest($1::text[]) WITH ORDINALITY AS u(t, o) ORDER BY o")
            .bind(&texts)
            .fetch_all(&pool)
            .await
            .expect("round trip");
    let wrong: Vec<String> = floats
        .iter()
        .zip(&back)
        .filter(|(f, v)| v[0].as_f64().map(f64::to_bits) != Some(f.to_bits()) && **f != 0.0)
        .map(|(f, v)| format!("{f:e} came back as {}", v[0]))
        .collect();
    assert!(wrong.is_empty(), "{} of {} floats changed: {:?}", wrong.len(), floats.len(), &wrong[..wrong.len().min(5)]);
}

/// End to end: a payload holding f64::MAX is claimed and run (without exact
/// float parsing the claim could not decode it, failed for every run claimed
/// with it, and left them to the reaper), and a float step output replayed after
/// a retry is the float the first attempt returned.
#[sqlx::test(migrations = false)]
async fn extreme_floats_run_and_replay_exactly(_p: PgPoolOptions, opts: PgConnectOptions) {
    let tricky = 2.6079843774798866e-110_f64;
    let f = Function::new("floats").on_event("floats/go").backoff(durastep::Backoff::Fixed(Duration::ZERO)).handler(
        move |ctx: Ctx, input: Value| async move {
            let x: f64 = ctx.step("x", || async move { Ok(tricky) }).await?;
            if ctx.attempt() == 1 {
                return Err(HandlerError::new("retry, so that x is replayed from the database"));
            }
            Ok(json!({"replayed_exactly": x.to_bits() == tricky.to_bits(), "input": input}))
        },
    );
    let engine = engine_on(&opts, vec![f], true).await.expect("engine");
    let worker = engine.spawn_worker();
    let receipt = engine.send(Event::new("floats/go", &json!({"max": f64::MAX}))).await.expect("send");
    let run = engine.wait_for_run(receipt.run_ids[0], DEADLINE).await.expect("run");
    worker.stop().await.expect("worker");
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(json!({"replayed_exactly": true, "input": {"max": f64::MAX}})));
}

/// Nesting at the supported ceiling runs end to end (payload, a step output
/// replayed after a retry, the run output); deeper is refused at send, whatever
/// `max_depth` says, because serde_json cannot read back more than 127 levels
/// (and the claim reads step outputs one level deeper, inside one object).
#[sqlx::test(migrations = false)]
async fn deepest_supported_nesting_runs_and_deeper_is_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = Function::new("deep").on_event("deep/go").backoff(durastep::Backoff::Fixed(Duration::ZERO)).handler(
        |ctx: Ctx, input: Value| async move {
            let again = input.clone();
            let stored: Value = ctx.step("echo", || async move { Ok(again) }).await?;
            if ctx.attempt() == 1 {
                return Err(HandlerError::new("retry, so that the step output is read back"));
            }
            Ok(json!(stored == input))
        },
    );
    let pool = PgPoolOptions::new().max_connections(4).connect_with(opts.clone()).await.expect("connect");
    let limits = Limits { max_depth: 10_000, ..Limits::default() };
    let engine = Engine::builder()
        .pool(pool)
        .limits(limits)
        .worker_options(fast_options())
        .function(f)
        .build()
        .await
        .expect("engine");
    let deepest = nested(durastep::limits::MAX_SUPPORTED_DEPTH);
    let receipt = engine.send(Event::new("deep/go", &deepest)).await.expect("send at the ceiling");
    drop_flat(deepest);
    let worker = engine.spawn_worker();
    let run = engine.wait_for_run(receipt.run_ids[0], DEADLINE).await.expect("run");
    worker.stop().await.expect("worker");
    assert_eq!((run.state, run.output.clone()), (RunState::Completed, Some(json!(true))), "{run:?}");

    let too_deep = nested(121);
    let err = engine.send(Event::new("deep/go", &too_deep)).await.expect_err("over the ceiling");
    drop_flat(too_deep);
    assert!(matches!(err, Error::Limit(LimitError::TooDeep { limit: 120 })), "{err:?}");
    let text = "[".repeat(121) + &"]".repeat(121);
    let err = engine.send(Event::from_json("deep/go", text)).await.expect_err("text over the ceiling");
    assert!(matches!(err, Error::Limit(LimitError::TooDeep { limit: 120 })), "{err:?}");
}

/// Printable ASCII noise (no `#`, which step names refuse), which Postgres
/// cannot compress into an index entry.
fn noise(rng: &mut Rng, len: usize) -> String {
    (0..len).map(|_| char::from(b'!' + rng.below(94) as u8)).map(|c| if c == '#' { '~' } else { c }).collect()
}

/// Regression (found by the fuzz smoke test): a `max_key_bytes` above what a
/// btree index entry holds let a 2,704-byte idempotency key through, and the
/// send failed with a database error ("index row size exceeds maximum") instead
/// of a typed refusal; a step name that long failed every checkpoint. Names are
/// now capped at `MAX_SUPPORTED_KEY_BYTES` whatever the limit says, and names
/// at the cap are stored and run.
#[sqlx::test(migrations = false)]
async fn names_over_the_supported_ceiling_are_refused_before_sql(_p: PgPoolOptions, opts: PgConnectOptions) {
    let cap = limits::MAX_SUPPORTED_KEY_BYTES;
    let mut rng = Rng(0x6b65_7973);
    let (long_step, capped_step) = (noise(&mut rng, 2_800), noise(&mut rng, cap));
    let steps =
        Function::new("named-steps").on_event("keys/go").retries(2).handler(|ctx: Ctx, name: String| async move {
            let n: i64 = ctx.step(&name, || async { Ok(7) }).await?;
            Ok(n)
        });
    let pool = PgPoolOptions::new().max_connections(4).connect_with(opts).await.expect("connect");
    let limits = Limits { max_key_bytes: 4096, ..Limits::default() };
    let engine = Engine::builder()
        .pool(pool)
        .limits(limits)
        .worker_options(fast_options())
        .function(steps)
        .build()
        .await
        .expect("engine");
    let before = counts(engine.pool()).await;
    for (what, event) in [
        ("idempotency key", Event::new("keys/go", &"x").idempotency_key(noise(&mut rng, 2_800))),
        ("idempotency key", Event::new("keys/go", &"x").idempotency_key(noise(&mut rng, cap + 1))),
        ("event name", Event::new(noise(&mut rng, 2_800), &"x").idempotency_key("k")),
    ] {
        let err = engine.send(event).await.expect_err(what);
        assert!(key_error(what)(&err), "{what}: {err:?}");
    }
    assert_eq!(counts(engine.pool()).await, before, "a refused event wrote rows");

    // At the cap, a name and a key (together near the index's limit) are stored.
    let name = noise(&mut rng, cap);
    engine.send(Event::new(name, &"x").idempotency_key(noise(&mut rng, cap))).await.expect("names at the cap");
    let long = engine.send(Event::new("keys/go", &long_step)).await.expect("send").run_ids[0];
    let capped = engine.send(Event::new("keys/go", &capped_step)).await.expect("send").run_ids[0];
    let worker = engine.spawn_worker();
    let long = engine.wait_for_run(long, DEADLINE).await.expect("run");
    let capped = engine.wait_for_run(capped, DEADLINE).await.expect("run");
    worker.stop().await.expect("worker");
    assert_eq!((long.state, long.attempt), (RunState::Failed, 1), "{long:?}");
    assert!(long.last_error.as_deref().unwrap_or("").contains("invalid step name"), "{long:?}");
    assert_eq!((capped.state, capped.output), (RunState::Completed, Some(json!(7))), "{:?}", capped.last_error);

    // A function id and a trigger at the cap are stored at build (the id also
    // as `<id>/on-failure`); one byte more is refused before connecting.
    let alnum = |rng: &mut Rng, len: usize| -> String {
        const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        (0..len).map(|_| char::from(CHARS[rng.below(CHARS.len() as u64) as usize])).collect()
    };
    let function = |id: String, trigger: String| {
        Function::new(id)
            .on_event(trigger)
            .on_failure(|_ctx: Ctx, _failed: durastep::FailedRun<()>| async { Ok(()) })
            .handler(|_ctx: Ctx, _x: ()| async { Ok(()) })
    };
    let (id, trigger) = (alnum(&mut rng, cap), noise(&mut rng, cap));
    let built = Engine::builder()
        .pool(engine.pool().clone())
        .limits(limits)
        .function(function(id.clone(), trigger))
        .build()
        .await;
    built.expect("a function id and trigger at the cap");
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM durastep.functions WHERE id IN ($1, $1 || '/on-failure')")
            .bind(&id)
            .fetch_one(engine.pool())
            .await
            .expect("count functions");
    assert_eq!(stored, 2);
    for (id, trigger) in [(alnum(&mut rng, cap + 1), "t".to_owned()), ("f".to_owned(), noise(&mut rng, cap + 1))] {
        let err =
            Engine::builder().limits(limits).function(function(id, trigger)).build().await.expect_err("over the cap");
        assert!(matches!(err, Error::Limit(LimitError::InvalidName { .. })), "{err:?}");
    }
}
