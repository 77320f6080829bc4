//! The `durastep` binary against a real database per test: runs are seeded
//! by an engine and a worker in this process; the CLI, a separate process,
//! reads and acts on them through the inspection API only.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Ctx, Engine, Event, Function, HandlerError, RunState, WorkerHandle, WorkerOptions};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::watch;
use uuid::Uuid;

/// How long any wait in a test may take.
const DEADLINE: Duration = Duration::from_secs(15);

/// The permanent failure of `push-budget` until the test fixes it.
const META_ERROR: &str = "403 from Meta: ad account act_7 disabled";

/// The database URL of a test's own database.
fn url_of(opts: &PgConnectOptions) -> String {
    format!(
        "postgres://{}@{}:{}/{}",
        opts.get_username(),
        opts.get_host(),
        opts.get_port(),
        opts.get_database().unwrap_or("postgres")
    )
}

/// What one run of the binary printed.
#[derive(Debug)]
struct Output {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Output {
    /// Stdout of a run that must have succeeded.
    fn ok(&self) -> &str {
        assert_eq!(self.code, Some(0), "expected success: {self:?}");
        &self.stdout
    }

    /// Stdout of a successful `--json` run, parsed.
    fn json(&self) -> Value {
        serde_json::from_str(self.ok()).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }

    /// The one-line message of a run that must have failed with `code`.
    fn failed(&self, code: i32) -> &str {
        assert_eq!(self.code, Some(code), "expected exit code {code}: {self:?}");
        assert_eq!(self.stderr.lines().count(), 1, "one line on stderr: {self:?}");
        assert!(!self.stderr.contains("panicked"), "{self:?}");
        assert!(self.stdout.is_empty(), "{self:?}");
        self.stderr.trim_end()
    }
}

/// Runs `durastep ARGS` with `--database-url url` (when given) and no
/// DATABASE_URL in its environment (cargo sets one for tests).
async fn durastep(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_durastep"));
    cmd.env_remove("DATABASE_URL");
    if let Some(url) = url {
        cmd.arg("--database-url").arg(url);
    }
    let out = cmd.args(args).output().await.expect("run the durastep binary");
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The run ids of a `runs ls --json` page.
fn ids(page: &Value) -> HashSet<Uuid> {
    page["runs"].as_array().expect("runs").iter().map(|r| r["id"].as_str().unwrap().parse().unwrap()).collect()
}

fn set(ids: &[Uuid]) -> HashSet<Uuid> {
    ids.iter().copied().collect()
}

/// A worker running in the test process (stopped on drop); `stop` waits
/// for it and fails the test if the worker failed.
struct Worker(WorkerHandle);

impl Worker {
    fn start(engine: &Engine) -> Self {
        Worker(engine.spawn_worker())
    }

    async fn stop(self) {
        self.0.stop().await.expect("worker");
    }
}

fn fast_worker() -> WorkerOptions {
    WorkerOptions {
        poll_interval: Duration::from_millis(50),
        lease: Duration::from_secs(5),
        heartbeat_interval: Duration::from_millis(500),
        reap_interval: Duration::from_millis(200),
        shutdown_grace: Duration::from_secs(2),
        max_in_flight: 8,
        ..Default::default()
    }
}

async fn engine(opts: &PgConnectOptions, functions: Vec<Function>) -> Engine {
    let pool = PgPoolOptions::new().max_connections(6).connect_with(opts.clone()).await.unwrap();
    let mut b = Engine::builder().pool(pool).worker_options(fast_worker());
    for f in functions {
        b = b.function(f);
    }
    b.build().await.expect("build engine")
}

async fn wait_for(engine: &Engine, id: Uuid, what: &str, pred: impl Fn(&durastep::Run) -> bool) -> durastep::Run {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let run = engine.run(id).await.expect("load run");
        if pred(&run) {
            return run;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}: {run:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn finished(engine: &Engine, id: Uuid) -> durastep::Run {
    wait_for(engine, id, "the run to finish", |r| r.state.is_finished()).await
}

/// A greeting whose step output is long (300 characters and more).
fn greet() -> Function {
    Function::new("greet").on_event("greeting/requested").handler(|ctx: Ctx, name: Value| async move {
        ctx.step("greet", || async move { Ok(format!("hello {name} {}", "x".repeat(300))) }).await
    })
}

/// A durable sleep of an hour.
fn nap() -> Function {
    Function::new("nap").on_event("nap/start").handler(|ctx: Ctx, _: Value| async move {
        ctx.sleep("nap", Duration::from_secs(3_600)).await?;
        Ok(())
    })
}

/// A database with one run in each interesting state, and the worker that made them.
struct Seeded {
    url: String,
    engine: Engine,
    worker: Worker,
    /// While false, `push-budget`'s `push` step fails permanently.
    fixed: Arc<AtomicBool>,
    /// Executions of `push-budget`'s `fetch` step.
    fetches: Arc<AtomicU32>,
    /// Holds `exact-invoice` runs until opened.
    gate: watch::Sender<bool>,
    failed: Uuid,
    completed: Uuid,
    running: Uuid,
    held: Uuid,
    sleeping: Uuid,
}

impl Seeded {
    async fn new(opts: &PgConnectOptions) -> Seeded {
        let (fixed, fetches) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU32::new(0)));
        let (f, n) = (fixed.clone(), fetches.clone());
        let push =
            Function::new("push-budget").on_event("budget/requested").retries(0).handler(move |ctx: Ctx, _: Value| {
                let (fixed, fetches) = (f.clone(), n.clone());
                async move {
                    let token: String = ctx
                        .step("fetch", || async {
                            fetches.fetch_add(1, Ordering::SeqCst);
                            Ok("tok".to_owned())
                        })
                        .await?;
                    ctx.step("push", || async move {
                        if fixed.load(Ordering::SeqCst) {
                            Ok(format!("pushed with {token}"))
                        } else {
                            Err(HandlerError::permanent(META_ERROR))
                        }
                    })
                    .await
                }
            });
        let gate = watch::channel(false).0;
        let g = gate.clone();
        let invoice = Function::new("exact-invoice")
            .on_event("invoice/create")
            .concurrency(durastep::Concurrency::new(1).key("/account").shared("exact-online"))
            .handler(move |_: Ctx, _: Value| {
                let mut open = g.subscribe();
                async move {
                    let _ = open.wait_for(|o| *o).await;
                    Ok(())
                }
            });
        let engine = engine(opts, vec![push, greet(), invoice, nap()]).await;
        let send = |name: &'static str, data: Value, key: Option<&'static str>| {
            let engine = engine.clone();
            async move {
                let mut e = Event::new(name, &data);
                if let Some(k) = key {
                    e = e.idempotency_key(k);
                }
                engine.send(e).await.expect("send").run_ids[0]
            }
        };
        let worker = Worker::start(&engine);
        let failed = send("budget/requested", json!({"ad_account_id": "act_7"}), Some("budget-7")).await;
        let completed = send("greeting/requested", json!("ops"), None).await;
        let running = send("invoice/create", json!({"account": "acme", "n": 1}), None).await;
        wait_for(&engine, running, "the first invoice running", |r| r.state == RunState::Running).await;
        let held = send("invoice/create", json!({"account": "acme", "n": 2}), None).await;
        let sleeping = send("nap/start", json!({}), None).await;
        assert_eq!(finished(&engine, failed).await.state, RunState::Failed);
        assert_eq!(finished(&engine, completed).await.state, RunState::Completed);
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !matches!(
            engine.inspect().why(held).await.expect("why"),
            durastep::inspect::Why::Blocked(ref b) if b.kind == durastep::inspect::BlockerKind::Concurrency
        ) {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for the second invoice to be parked");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        wait_for(&engine, sleeping, "the nap sleeping", |r| r.state == RunState::Sleeping).await;
        Seeded { url: url_of(opts), engine, worker, fixed, fetches, gate, failed, completed, running, held, sleeping }
    }

    async fn cli(&self, args: &[&str]) -> Output {
        durastep(Some(&self.url), args).await
    }

    async fn stop(self) {
        self.gate.send_replace(true);
        self.worker.stop().await;
    }
}

/// The embedded migrations, as `migrate` lists them: `0002 next due index`.
fn migration_files() -> Vec<String> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../migrations");
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("the migrations folder")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter_map(|n| n.strip_suffix(".sql").map(|n| n.replace('_', " ")))
        .collect();
    names.sort();
    names
}

/// Catches: a CLI that migrates by accident (stats would then work on an
/// empty database), a migrate that is not idempotent or does not say what it
/// applied (it said "schema up to date" on an empty database), or stats that miscount.
#[sqlx::test(migrations = false)]
async fn migrate_on_an_empty_database_then_stats(_p: PgPoolOptions, opts: PgConnectOptions) {
    let url = url_of(&opts);
    let before = durastep(Some(&url), &["stats"]).await;
    assert!(before.failed(1).contains("run `durastep migrate`"), "{before:?}");
    let first = durastep(Some(&url), &["migrate"]).await;
    let mut lines = first.ok().lines();
    let files = migration_files();
    assert!(files.len() >= 10 && files[0] == "0001 core", "{files:?}");
    assert_eq!(lines.next(), Some(format!("applied {} migration(s):", files.len()).as_str()), "{first:?}");
    assert_eq!(lines.map(str::trim).collect::<Vec<_>>(), files, "{first:?}");
    assert_eq!(durastep(Some(&url), &["--json", "migrate"]).await.json(), json!({"applied": []}));
    assert_eq!(durastep(Some(&url), &["migrate"]).await.ok(), "schema up to date: no migration needed\n");
    assert_eq!(durastep(Some(&url), &["stats"]).await.ok().lines().next(), Some("no runs"));

    let s = Seeded::new(&opts).await;
    let stats = s.cli(&["--json", "stats"]).await.json();
    let count = |f: &str, state: &str| {
        stats["counts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["function_id"] == f && c["state"] == state)
            .map(|c| c["count"].clone())
    };
    assert_eq!(count("push-budget", "failed"), Some(json!(1)));
    assert_eq!(count("greet", "completed"), Some(json!(1)));
    assert_eq!(count("exact-invoice", "running"), Some(json!(1)));
    assert_eq!(count("exact-invoice", "queued"), Some(json!(1)));
    assert_eq!(count("nap", "sleeping"), Some(json!(1)));
    let created: i64 = stats["per_minute"].as_array().unwrap().iter().map(|m| m["created"].as_i64().unwrap()).sum();
    assert_eq!(created, 5);

    let text = s.cli(&["stats"]).await;
    let text = text.ok();
    let header = text.lines().next().unwrap();
    assert!(header.starts_with("FUNCTION") && header.contains("QUEUED") && header.ends_with("TOTAL"), "{text}");
    let invoice = text.lines().find(|l| l.starts_with("exact-invoice")).expect(text);
    let cells: Vec<&str> = invoice.split_whitespace().collect();
    // queued, running, sleeping, waiting, completed, failed, cancelled, skipped, diverged, total
    assert_eq!(cells[1..], ["1", "1", "0", "0", "0", "0", "0", "0", "0", "2"], "{text}");
    assert!(text.contains("last hour: 5 created, 1 completed, 1 failed"), "{text}");
    s.stop().await;
}

/// Catches: a filter flag that is ignored or mapped to the wrong field, JSON
/// that does not carry the ids, and bad filters accepted.
#[sqlx::test(migrations = false)]
async fn runs_ls_filters_and_json_round_trip(_p: PgPoolOptions, opts: PgConnectOptions) {
    let s = Seeded::new(&opts).await;
    let ls = |args: &'static [&'static str]| {
        let s = &s;
        async move {
            let mut all = vec!["--json", "runs", "ls"];
            all.extend_from_slice(args);
            ids(&s.cli(&all).await.json())
        }
    };
    assert_eq!(ls(&[]).await, set(&[s.failed, s.completed, s.running, s.held, s.sleeping]));
    assert_eq!(ls(&["--function", "push-budget"]).await, set(&[s.failed]));
    assert_eq!(ls(&["--state", "failed", "--state", "completed"]).await, set(&[s.failed, s.completed]));
    assert_eq!(ls(&["--key", "/account=acme"]).await, set(&[s.running, s.held]));
    assert_eq!(ls(&["--key", "/n=2"]).await, set(&[s.held]));
    assert_eq!(ls(&["--idempotency-key", "budget-7"]).await, set(&[s.failed]));
    assert_eq!(ls(&["--event", "nap/start"]).await, set(&[s.sleeping]));
    assert_eq!(ls(&["--since", "1h ago", "--function", "greet"]).await, set(&[s.completed]));
    assert!(ls(&["--until", "1h ago"]).await.is_empty());
    assert!(ls(&["--function", "exact-invoice", "--state", "failed"]).await.is_empty());
    // Relative times are on the database clock: two days on, the runs are two
    // days old (by the wall clock they are seconds old).
    durastep::testing::advance_clock(&s.engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    assert!(ls(&["--since", "1h ago", "--function", "greet"]).await.is_empty());
    assert_eq!(ls(&["--since", "3d ago", "--function", "greet"]).await, set(&[s.completed]));
    assert_eq!(ls(&["--until", "1d ago", "--function", "greet"]).await, set(&[s.completed]));

    let page = s.cli(&["--json", "runs", "ls", "--state", "failed"]).await.json();
    let run = &page["runs"][0];
    assert_eq!((run["function_id"].as_str(), run["state"].as_str()), (Some("push-budget"), Some("failed")));
    assert_eq!(run["last_error"].as_str(), Some(format!("step push: {META_ERROR}").as_str()));
    assert_eq!(run["error_standing"], "exhausted", "retries(0): it failed on its only attempt");
    assert_eq!(page["next"], Value::Null);

    let text = s.cli(&["runs", "ls", "--state", "failed"]).await;
    let text = text.ok();
    assert!(text.starts_with("ID "), "{text}");
    let line = text.lines().nth(1).expect(text);
    assert!(
        line.starts_with(&s.failed.to_string()) && line.contains("push-budget") && line.contains("failed"),
        "{text}"
    );
    assert_eq!(text.lines().count(), 2, "{text}");

    for (args, says) in [
        (&["runs", "ls", "--key", "account=acme"][..], "not a JSON pointer"),
        (&["runs", "ls", "--limit", "0"][..], "limit must be at least 1"),
        (&["runs", "ls", "--state", "dead"][..], "unknown run state \"dead\""),
        (&["runs", "ls", "--since", "yesterday"][..], "is not a time"),
        (&["runs", "ls", "--after", "nonsense"][..], "not a page cursor"),
    ] {
        let out = s.cli(args).await;
        assert!(out.failed(1).contains(says), "{args:?}: {out:?}");
    }
    s.stop().await;
}

/// Catches: pages that overlap or skip runs, a cursor that is not printed,
/// or a table cursor that differs from the JSON one.
#[sqlx::test(migrations = false)]
async fn pagination_with_limit_and_after_gets_every_run_once(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, vec![greet()]).await;
    let sent = engine.send_batch((0..12).map(|i| Event::new("greeting/requested", &i)).collect()).await.unwrap();
    let sent: HashSet<Uuid> = sent.iter().map(|r| r.run_ids[0]).collect();
    let url = url_of(&opts);
    let (mut seen, mut pages, mut after) = (Vec::new(), 0, None::<String>);
    loop {
        let mut args = vec!["--json", "runs", "ls", "--limit", "5"];
        if let Some(c) = &after {
            args.extend(["--after", c.as_str()]);
        }
        let page = durastep(Some(&url), &args).await.json();
        pages += 1;
        seen.extend(ids(&page));
        let next = page["next"].as_str().map(str::to_owned);
        if let Some(c) = &next {
            // People get the same cursor under the table.
            let mut text_args = vec!["runs", "ls", "--limit", "5"];
            if let Some(a) = &after {
                text_args.extend(["--after", a.as_str()]);
            }
            let text = durastep(Some(&url), &text_args).await;
            assert_eq!(text.ok().lines().last(), Some(format!("next page: --after {c}").as_str()));
        }
        match next {
            Some(c) => after = Some(c),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    assert_eq!(seen.len(), 12, "no run twice");
    assert_eq!(seen.into_iter().collect::<HashSet<_>>(), sent);
}

/// Catches: a show that hides the failed step or its error, outputs not cut
/// in table mode, or `--full` that still cuts.
#[sqlx::test(migrations = false)]
async fn runs_show_of_a_failed_run_shows_the_failed_step_and_error(_p: PgPoolOptions, opts: PgConnectOptions) {
    let s = Seeded::new(&opts).await;
    let id = s.failed.to_string();
    let out = s.cli(&["runs", "show", &id]).await;
    let text = out.ok();
    let step =
        |name: &str| text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{text}"));
    let push = step("push");
    assert!(push.contains(" failed ") && push.ends_with(&format!("step push: {META_ERROR}")), "{text}");
    let fetch = step("fetch");
    assert!(fetch.contains(" completed ") && fetch.ends_with("\"tok\""), "{text}");
    assert!(text.contains("state       failed (attempt 1 of 1)"), "{text}");
    assert!(
        text.contains(&format!("failed      on its last attempt (attempt 1 of 1): step push: {META_ERROR}")),
        "{text}"
    );
    assert!(text.contains("event data  {\"ad_account_id\":\"act_7\"}"), "{text}");

    let d = s.cli(&["--json", "runs", "show", &id]).await.json();
    assert_eq!(d["run"]["state"], "failed");
    let push = d["steps"].as_array().unwrap().iter().find(|s| s["name"] == "push").unwrap();
    assert_eq!(
        (push["status"].as_str(), push["error"].as_str()),
        (Some("failed"), Some(&*format!("step push: {META_ERROR}")))
    );
    assert_eq!(d["attempts"][0]["outcome"], "failed");

    // A 300-character output: cut in the table, whole with --full and in JSON.
    let done = s.completed.to_string();
    let cut = s.cli(&["runs", "show", &done]).await;
    let whole = "x".repeat(300);
    assert!(!cut.ok().contains(&whole) && cut.ok().contains("… (+"), "{cut:?}");
    assert!(s.cli(&["runs", "show", &done, "--full"]).await.ok().contains(&whole));
    let d = s.cli(&["--json", "runs", "show", &done]).await.json();
    assert!(d["run"]["output"].as_str().unwrap().ends_with(&whole));
    s.stop().await;
}

/// Catches: a why that is vague (no rule, key or counts), shows the wrong
/// time for a sleep, or says nothing useful for running and failed runs.
#[sqlx::test(migrations = false)]
async fn why_explains_concurrency_sleep_running_and_failure(_p: PgPoolOptions, opts: PgConnectOptions) {
    let s = Seeded::new(&opts).await;
    let why = |id: Uuid| {
        let s = &s;
        async move { s.cli(&["why", &id.to_string()]).await.ok().trim_end().to_owned() }
    };
    assert_eq!(
        why(s.held).await,
        "queued: concurrency limit exact-online key acme is full (1/1); it starts when a slot frees"
    );
    let wake = s.engine.run(s.sleeping).await.unwrap().run_at;
    assert_eq!(
        why(s.sleeping).await,
        format!("sleeping until {} (in step nap)", wake.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
    );
    let now = durastep::testing::db_now(&s.engine).await.unwrap();
    assert!(wake > now + chrono::Duration::minutes(59), "the nap wakes in an hour: {wake}");
    let running = why(s.running).await;
    let worker = running.strip_prefix("running attempt 1 on worker ").unwrap_or_else(|| panic!("{running}"));
    assert!(worker.parse::<Uuid>().is_ok(), "{running}");
    assert_eq!(why(s.failed).await, format!("failed: step push: {META_ERROR}"));
    assert_eq!(why(s.completed).await, "completed");

    let j = s.cli(&["--json", "why", &s.held.to_string()]).await.json();
    assert_eq!(
        (j["status"].as_str(), j["kind"].as_str(), j["key"].as_str()),
        (Some("blocked"), Some("concurrency"), Some("acme"))
    );
    assert_eq!((j["in_use"].as_i64(), j["limit"].as_i64()), (Some(1), Some(1)));
    assert!(j["message"].as_str().unwrap().starts_with("queued: concurrency limit exact-online"));
    s.stop().await;
}

/// A run that recovers: its `call` step fails once (retried), then it sleeps
/// an hour (`cool-off`) and completes.
fn recovers(calls: Arc<AtomicU32>) -> Function {
    Function::new("recovers")
        .on_event("recovers/start")
        .retries(2)
        .backoff(durastep::Backoff::Fixed(Duration::from_millis(10)))
        .handler(move |ctx: Ctx, _: Value| {
            let calls = calls.clone();
            async move {
                ctx.step("call", || async move {
                    if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                        Err(HandlerError::new("503 from gateway"))
                    } else {
                        Ok(1)
                    }
                })
                .await?;
                ctx.sleep("cool-off", Duration::from_secs(3_600)).await?;
                Ok(())
            }
        })
}

/// Catches (issue 15): a completed run shown with a red "error" (the error
/// of an earlier, retried attempt), a permanent failure not said to be one,
/// a sleep shown as "completed, 20µs" without its wake time, history without
/// replays or cancel reasons, `why` not naming the wait step, and JSON
/// without these facts.
#[sqlx::test(migrations = false)]
async fn show_tells_recovered_permanent_sleeps_replays_and_waits(_p: PgPoolOptions, opts: PgConnectOptions) {
    let strict = Function::new("strict").on_event("strict/start").retries(2).handler(|ctx: Ctx, _: Value| async move {
        ctx.step("validate", || async { Err::<(), _>(HandlerError::permanent("400: campaign 9 does not exist")) }).await
    });
    let approve = Function::new("approve").on_event("approval/requested").handler(|ctx: Ctx, _: Value| async move {
        let got: Option<Value> = ctx.wait_for_event("approval", durastep::WaitFor::event("approval/given")).await?;
        Ok(got)
    });
    let engine = engine(&opts, vec![recovers(Arc::new(AtomicU32::new(0))), strict, approve, nap()]).await;
    let send = |name: &'static str| {
        let engine = engine.clone();
        async move { engine.send(Event::new(name, &json!({}))).await.expect("send").run_ids[0] }
    };
    let worker = Worker::start(&engine);
    let (recovered, failed, waiting, napping) = (
        send("recovers/start").await,
        send("strict/start").await,
        send("approval/requested").await,
        send("nap/start").await,
    );
    let run = wait_for(&engine, recovered, "the recovering run asleep", |r| r.state == RunState::Sleeping).await;
    let wake = run.run_at;
    wait_for(&engine, waiting, "the approval waiting", |r| r.state == RunState::Waiting).await;
    wait_for(&engine, napping, "the nap sleeping", |r| r.state == RunState::Sleeping).await;
    assert_eq!(finished(&engine, failed).await.state, RunState::Failed);
    let url = url_of(&opts);
    let cli = |args: Vec<String>| {
        let url = url.clone();
        async move { durastep(Some(&url), &args.iter().map(String::as_str).collect::<Vec<_>>()).await }
    };
    let show = |id: Uuid| cli(vec!["runs".into(), "show".into(), id.to_string()]);
    let show_json = |id: Uuid| cli(vec!["--json".into(), "runs".into(), "show".into(), id.to_string()]);
    let time = |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);

    // Asleep: the sleep step says until when, and for how long.
    let text = show(recovered).await.ok().to_owned();
    let line = text.lines().find(|l| l.starts_with("cool-off ")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains(" sleeping ") && line.contains(" 1h00m "), "{text}");
    assert!(line.ends_with(&format!("sleeping until {} (1h00m)", time(wake))), "{text}");
    assert!(text.contains("last error  step call: 503 from gateway (attempt 1 failed; it runs again)"), "{text}");

    // History: the cancel reason.
    engine.cancel(napping, "client paused").await.unwrap();
    let text = show(napping).await.ok().to_owned();
    let cancelled = text.lines().rev().find(|l| l.contains(" cancelled ")).unwrap_or_else(|| panic!("{text}"));
    assert!(cancelled.ends_with("reason: client paused"), "{text}");
    let nap = text.lines().find(|l| l.starts_with("nap ")).unwrap_or_else(|| panic!("{text}"));
    assert!(
        nap.contains(" cut short ") && nap.contains("the run ended first"),
        "a cancelled sleep did not sleep: {text}"
    );

    // Woken by the database clock, it completes: the error is recovered from, not the run's.
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 3_600)).await.unwrap();
    assert_eq!(finished(&engine, recovered).await.state, RunState::Completed);
    let text = show(recovered).await.ok().to_owned();
    assert!(
        text.contains("recovered   step call: 503 from gateway (attempt 1 failed; a retry completed the run)"),
        "{text}"
    );
    assert!(!text.lines().any(|l| l.starts_with("error ") || l.starts_with("failed ")), "{text}");
    let line = text.lines().find(|l| l.starts_with("cool-off ")).unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains(" slept ") && line.ends_with(&format!("slept until {} (1h00m)", time(wake))), "{text}");
    let call = text.lines().find(|l| l.starts_with("call ")).unwrap_or_else(|| panic!("{text}"));
    assert!(call.contains(" completed after retry "), "{text}");
    let d = show_json(recovered).await.json();
    assert_eq!(d["error"], json!({"message": "step call: 503 from gateway", "standing": "recovered", "attempt": 1}));
    let sleep = d["steps"].as_array().unwrap().iter().find(|s| s["name"] == "cool-off").unwrap().clone();
    let wake_at: chrono::DateTime<chrono::Utc> = sleep["wake_at"].as_str().unwrap().parse().unwrap();
    assert_eq!(wake_at.timestamp_micros(), wake.timestamp_micros(), "{sleep}");
    let slept = sleep["slept"].as_f64().unwrap();
    assert!((3_599.0..=3_600.0).contains(&slept), "{sleep}");
    let ls = cli(vec!["runs".into(), "ls".into(), "--function".into(), "recovers".into()]).await;
    assert!(ls.ok().lines().nth(1).unwrap().ends_with("recovered: step call: 503 from gateway"), "{ls:?}");
    let page = cli(vec!["--json".into(), "runs".into(), "ls".into(), "--function".into(), "recovers".into()]).await;
    assert_eq!(page.json()["runs"][0]["error_standing"], "recovered");

    // A permanent error with attempts left says so.
    let text = show(failed).await.ok().to_owned();
    assert!(
        text.contains(
            "failed      permanently, at attempt 1 of 3 (a permanent error: not retried): step validate: 400: \
             campaign 9 does not exist"
        ),
        "{text}"
    );
    assert_eq!(show_json(failed).await.json()["error"]["standing"], "permanent");
    let ls = cli(vec!["runs".into(), "ls".into(), "--function".into(), "strict".into()]).await;
    assert!(ls.ok().lines().nth(1).unwrap().ends_with("permanent: step validate: 400: campaign 9 does not exist"));

    // `why` names the wait step, in text and JSON.
    let why = cli(vec!["why".into(), waiting.to_string()]).await;
    assert_eq!(why.ok(), "waiting for event approval/given, with no timeout (in step approval)\n");
    let j = cli(vec!["--json".into(), "why".into(), waiting.to_string()]).await.json();
    assert_eq!((j["kind"].as_str(), j["step"].as_str()), (Some("wait_for_event"), Some("approval")), "{j}");
    assert_eq!(show_json(waiting).await.json()["blocker"]["step"], "approval");

    // History: the cancel reason (above), then the replay.
    engine.replay(napping, durastep::ReplayFrom::FailedStep).await.unwrap();
    let text = show(napping).await.ok().to_owned();
    assert!(text.lines().any(|l| l.contains(" queued (replayed) ")), "{text}");
    let history = show_json(napping).await.json()["history"].as_array().unwrap().clone();
    let marks: Vec<(&str, bool)> =
        history.iter().map(|h| (h["state"].as_str().unwrap(), h["replayed"].as_bool().unwrap())).collect();
    let replay = marks.iter().position(|&(state, replayed)| state == "queued" && replayed).expect("a replay");
    assert_eq!(marks[replay - 1].0, "cancelled", "{marks:?}");
    assert_eq!(marks.iter().filter(|m| m.1).count(), 1, "{marks:?}");
    worker.stop().await;
}

/// Catches: a replay that does not requeue, re-runs finished steps, accepts a
/// run that is not dead, or takes an id and filters at once.
#[sqlx::test(migrations = false)]
async fn replay_makes_a_failed_run_complete_once_the_cause_is_fixed(_p: PgPoolOptions, opts: PgConnectOptions) {
    let s = Seeded::new(&opts).await;
    let id = s.failed.to_string();
    assert_eq!(s.fetches.load(Ordering::SeqCst), 1);
    s.fixed.store(true, Ordering::SeqCst);
    let out = s.cli(&["runs", "replay", &id]).await;
    // The worker may claim it before the CLI reads it back: "(already running)".
    let said = format!("run {id} (push-budget) is queued again, from the failed step: attempt 2 of 2");
    assert!(out.ok().starts_with(&said), "{out:?}");
    let run = finished(&s.engine, s.failed).await;
    assert_eq!((run.state, run.output), (RunState::Completed, Some(json!("pushed with tok"))));
    assert_eq!(s.fetches.load(Ordering::SeqCst), 1, "the finished step was not executed again");
    assert_eq!(s.cli(&["why", &id]).await.ok(), "completed\n");

    let again = s.cli(&["runs", "replay", &id]).await;
    assert!(again.failed(1).contains("cannot be replayed: it is completed"), "{again:?}");
    let both = s.cli(&["runs", "replay", &id, "--function", "push-budget"]).await;
    assert!(both.failed(1).contains("not both"), "{both:?}");

    // From the start: every step runs again.
    s.engine.cancel(s.held, "test").await.unwrap();
    let held = s.held.to_string();
    let j = s.cli(&["--json", "runs", "replay", &held, "--from-start"]).await.json();
    assert_eq!((j["id"].as_str(), j["state"].as_str()), (Some(held.as_str()), Some("queued")));
    s.stop().await;
}

/// Catches: a bulk replay that runs without a filter, miscounts, or touches
/// runs outside its filter.
#[sqlx::test(migrations = false)]
async fn bulk_replay_needs_a_filter_and_counts_what_it_queued(_p: PgPoolOptions, opts: PgConnectOptions) {
    let s = Seeded::new(&opts).await;
    let mut failed = vec![s.failed];
    for i in 0..3 {
        let r = s.engine.send(Event::new("budget/requested", &json!({"i": i}))).await.unwrap();
        failed.push(r.run_ids[0]);
    }
    for id in &failed {
        assert_eq!(finished(&s.engine, *id).await.state, RunState::Failed);
    }
    let refused = s.cli(&["runs", "replay"]).await;
    assert!(refused.failed(1).contains("needs --function or --state"), "{refused:?}");
    let refused = s.cli(&["runs", "replay", "--event", "budget/requested"]).await;
    assert!(refused.failed(1).contains("needs --function or --state"), "{refused:?}");
    assert_eq!(s.engine.run(s.failed).await.unwrap().state, RunState::Failed, "nothing was replayed");
    assert_eq!(
        s.cli(&["runs", "replay", "--function", "greet", "--state", "failed"]).await.ok(),
        "0 run(s) queued again, from the failed step\n"
    );

    s.fixed.store(true, Ordering::SeqCst);
    let out = s.cli(&["--json", "runs", "replay", "--function", "push-budget", "--state", "failed"]).await.json();
    assert_eq!(out["replayed"], 4);
    let replayed: HashSet<Uuid> =
        out["run_ids"].as_array().unwrap().iter().map(|v| v.as_str().unwrap().parse().unwrap()).collect();
    assert_eq!(replayed, set(&failed));
    for id in &failed {
        assert_eq!(finished(&s.engine, *id).await.state, RunState::Completed);
    }
    assert_eq!(s.engine.run(s.completed).await.unwrap().state, RunState::Completed);
    assert_eq!(
        s.cli(&["runs", "replay", "--state", "failed"]).await.ok(),
        "0 run(s) queued again, from the failed step\n"
    );
    s.stop().await;
}

/// Catches: a send that does not create a run, ignores the idempotency key
/// or accepts bad JSON; a cancel that does not cancel or keep its reason.
#[sqlx::test(migrations = false)]
async fn send_creates_a_run_and_cancel_cancels_one(_p: PgPoolOptions, opts: PgConnectOptions) {
    let s = Seeded::new(&opts).await;
    let receipt =
        s.cli(&["--json", "send", "nap/start", r#"{"who": "cli"}"#, "--idempotency-key", "nap-1"]).await.json();
    assert_eq!(receipt["duplicate"], false);
    let run_id: Uuid = receipt["run_ids"][0].as_str().unwrap().parse().unwrap();
    let run = s.engine.run(run_id).await.unwrap();
    assert_eq!(run.function_id, "nap");
    let again = s.cli(&["--json", "send", "nap/start", r#"{"who": "cli"}"#, "--idempotency-key", "nap-1"]).await.json();
    assert_eq!((again["duplicate"].as_bool(), &again["run_ids"]), (Some(true), &receipt["run_ids"]));
    let text = s.cli(&["send", "greeting/requested", "\"cli\""]).await;
    assert!(text.ok().contains("stored, 1 run(s) started"), "{text:?}");
    let bad = s.cli(&["send", "nap/start", "{\"who\":"]).await;
    assert!(bad.failed(1).contains("not valid JSON"), "{bad:?}");

    let sleeping = s.sleeping.to_string();
    assert_eq!(
        s.cli(&["runs", "cancel", &sleeping, "--reason", "client paused"]).await.ok(),
        format!("run {sleeping} cancelled: client paused\n")
    );
    let run = s.engine.run(s.sleeping).await.unwrap();
    assert_eq!((run.state, run.cancel_reason.as_deref()), (RunState::Cancelled, Some("client paused")));
    assert_eq!(s.cli(&["why", &sleeping]).await.ok(), "cancelled: client paused\n");
    let twice = s.cli(&["runs", "cancel", &sleeping]).await;
    assert!(twice.failed(1).contains("has already finished"), "{twice:?}");
    s.stop().await;
}

/// v1 of `flow`: step `a`, a wait for `flow/go`, step `b`; v2: step `a2` only.
/// `a_runs` counts the executions of `a`'s body.
fn flow(v2: bool, a_runs: &Arc<AtomicU32>) -> Function {
    let a_runs = a_runs.clone();
    Function::new("flow").on_event("flow/start").handler(move |ctx: Ctx, _: Value| {
        let a_runs = a_runs.clone();
        async move {
            if v2 {
                return ctx.step("a2", || async { Ok("v2".to_owned()) }).await;
            }
            ctx.step("a", || async move {
                a_runs.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
            .await?;
            let wait = durastep::WaitFor::event("flow/go").matching(durastep::EventMatch::any());
            ctx.wait_for_event::<Value>("go", wait.timeout(Duration::from_secs(3_600))).await?;
            ctx.step("b", || async { Ok("v1".to_owned()) }).await
        }
    })
}

/// Two v1 runs parked `diverged` under v2 (recorded step "a", asked step
/// "a2" at position 0). `runs discard ID --from 0` runs one afresh on v2;
/// `runs resume ID`, after going back to v1, replays the other where it was;
/// both refuse a run that is not diverged, and an unknown run.
/// Catches: no CLI way out of `diverged`, a discard that keeps the entries
/// (it would diverge again), a resume that loses them (v1 would run `a` twice).
#[sqlx::test(migrations = false)]
async fn resume_and_discard_end_diverged_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let url = url_of(&opts);
    let a_runs = Arc::new(AtomicU32::new(0));
    let v1 = engine(&opts, vec![flow(false, &a_runs)]).await;
    let w1 = Worker::start(&v1);
    let mut ids = Vec::new();
    for _ in 0..2 {
        let id = v1.send(Event::new("flow/start", &json!({}))).await.unwrap().run_ids[0];
        wait_for(&v1, id, "the v1 run waiting", |r| r.state == RunState::Waiting).await;
        ids.push(id);
    }
    w1.stop().await;
    let v2 = engine(&opts, vec![flow(true, &a_runs)]).await;
    let w2 = Worker::start(&v2);
    v2.send(Event::new("flow/go", &json!({}))).await.unwrap();
    for id in &ids {
        wait_for(&v2, *id, "the run diverged", |r| r.state == RunState::Diverged).await;
    }
    let (discarded, resumed) = (ids[0].to_string(), ids[1].to_string());
    let why = durastep(Some(&url), &["why", &discarded]).await;
    assert!(why.ok().contains(&format!("durastep runs discard {discarded} --from 0")), "{why:?}");

    let out = durastep(Some(&url), &["runs", "discard", &discarded, "--from", "0"]).await;
    assert_eq!(
        out.ok(),
        format!(
            "run {discarded} queued again without its entries from position 0 on: the deployed code executes them \
             afresh\n"
        )
    );
    let run = finished(&v2, ids[0]).await;
    assert_eq!((run.state, run.output), (RunState::Completed, Some(json!("v2"))));
    let again = durastep(Some(&url), &["runs", "resume", &discarded]).await;
    assert!(again.failed(1).contains("is not diverged (it is completed)"), "{again:?}");
    let j = durastep(Some(&url), &["--json", "runs", "discard", &discarded, "--from", "1"]).await;
    assert_eq!(j.code, Some(1), "{j:?}");
    assert!(j.stderr.contains("not_diverged"), "{j:?}");
    w2.stop().await;

    // The code fixed (v1 again): the other run resumes where it was.
    let fixed = engine(&opts, vec![flow(false, &a_runs)]).await;
    let w = Worker::start(&fixed);
    let j = durastep(Some(&url), &["--json", "runs", "resume", &resumed]).await.json();
    assert_eq!(j, json!({"run_id": resumed, "action": "resumed", "state": "queued"}));
    let run = finished(&fixed, ids[1]).await;
    assert_eq!((run.state, run.output), (RunState::Completed, Some(json!("v1"))));
    assert_eq!(a_runs.load(Ordering::SeqCst), 2, "step a ran once per run: the resumed run replayed it");
    let unknown = durastep(Some(&url), &["runs", "resume", &Uuid::nil().to_string()]).await;
    assert!(unknown.failed(1).contains("no run with id"), "{unknown:?}");
    let missing = durastep(Some(&url), &["runs", "discard", &resumed]).await;
    assert_ne!(missing.code, Some(0), "--from is required: {missing:?}");
    w.stop().await;
}

/// Catches: a prune that deletes recent or unfinished runs, or reports
/// numbers that are not what it deleted.
#[sqlx::test(migrations = false)]
async fn prune_removes_old_finished_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, vec![greet(), nap()]).await;
    let old: Vec<Uuid> = engine
        .send_batch((0..3).map(|i| Event::new("greeting/requested", &i)).collect())
        .await
        .unwrap()
        .iter()
        .map(|r| r.run_ids[0])
        .collect();
    let napping = engine.send(Event::new("nap/start", &json!({}))).await.unwrap().run_ids[0];
    let worker = Worker::start(&engine);
    for id in &old {
        finished(&engine, *id).await;
    }
    wait_for(&engine, napping, "sleeping", |r| r.state == RunState::Sleeping).await;
    worker.stop().await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(31 * 86_400)).await.unwrap();
    let recent = engine.send(Event::new("greeting/requested", &"new")).await.unwrap().run_ids[0];
    let worker = Worker::start(&engine);
    finished(&engine, recent).await;
    worker.stop().await;

    let url = url_of(&opts);
    let dry = durastep(Some(&url), &["--json", "prune", "--older-than", "30d", "--dry-run"]).await.json();
    assert_eq!(dry["would_prune"].as_u64(), Some(3), "{dry}");
    assert!(engine.run(old[0]).await.is_ok(), "a dry run deletes nothing");
    let report = durastep(Some(&url), &["--json", "prune", "--older-than", "30d"]).await.json();
    assert_eq!((report["runs"].as_u64(), report["events"].as_u64()), (Some(3), Some(3)));
    for id in &old {
        let gone = durastep(Some(&url), &["runs", "show", &id.to_string()]).await;
        assert_eq!(gone.failed(1), format!("error: no run with id {id}"));
    }
    assert_eq!(engine.run(recent).await.unwrap().state, RunState::Completed);
    assert!(engine.run(napping).await.is_ok(), "an unfinished run is kept");
    let again = durastep(Some(&url), &["prune", "--older-than", "30d"]).await;
    assert!(again.ok().starts_with("pruned 0 run(s), 0 event(s)"), "{again:?}");
}

/// Catches (issue 15): a prune that deletes every finished run, or uses a
/// bound under an hour (`30m` typed for `30d`), without `--yes`; a refusal
/// that does not say how many runs it would have deleted or that deletes
/// anything; and `--yes` asked for where a prune keeps runs.
#[sqlx::test(migrations = false)]
async fn prune_asks_for_yes_before_deleting_every_finished_run_or_under_an_hour(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let engine = engine(&opts, vec![greet()]).await;
    let greetings = |names: &[&str]| {
        let events = names.iter().map(|n| Event::new("greeting/requested", n)).collect();
        let engine = engine.clone();
        async move {
            let ids: Vec<Uuid> = engine.send_batch(events).await.unwrap().iter().map(|r| r.run_ids[0]).collect();
            let worker = Worker::start(&engine);
            for id in &ids {
                finished(&engine, *id).await;
            }
            worker.stop().await;
            ids
        }
    };
    let old = greetings(&["a", "b", "c"]).await;
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 86_400)).await.unwrap();
    let recent = greetings(&["d"]).await[0];
    let url = url_of(&opts);
    let kept = |ids: Vec<Uuid>| {
        let engine = engine.clone();
        async move {
            for id in ids {
                assert!(engine.run(id).await.is_ok(), "run {id} was deleted");
            }
        }
    };

    // Every finished run (and a bound under an hour): refused, with the count.
    let all = durastep(Some(&url), &["prune", "--older-than", "0s"]).await;
    assert_eq!(
        all.failed(1),
        "error: prune --older-than 0s would delete 4 of 4 finished run(s) (that is every finished run, and \
         --older-than is under 1h); add --yes if that is what you want (nothing was deleted)"
    );
    // Under an hour, though it keeps the run that finished just now.
    let short = durastep(Some(&url), &["prune", "--older-than", "30m"]).await;
    let message = short.failed(1);
    assert!(message.contains("would delete 3 of 4 finished run(s) (--older-than is under 1h)"), "{message}");
    let json = durastep(Some(&url), &["--json", "prune", "--older-than", "30m"]).await;
    assert_eq!(json.code, Some(1), "{json:?}");
    let v: Value = serde_json::from_str(json.stderr.trim()).expect("a JSON error");
    assert_eq!(v["error"]["kind"], "usage", "{v}");
    kept([old.clone(), vec![recent]].concat()).await;
    // Counting needs no --yes.
    let dry = durastep(Some(&url), &["--json", "prune", "--older-than", "0s", "--dry-run"]).await.json();
    assert_eq!(dry["would_prune"].as_u64(), Some(4), "{dry}");

    // A bound of a day keeps the recent run: no --yes needed.
    let report = durastep(Some(&url), &["--json", "prune", "--older-than", "1d"]).await.json();
    assert_eq!(report["runs"].as_u64(), Some(3), "{report}");
    kept(vec![recent]).await;

    // Two hours on, the recent run is every finished run left.
    durastep::testing::advance_clock(&engine, Duration::from_secs(2 * 3_600)).await.unwrap();
    let every = durastep(Some(&url), &["prune", "--older-than", "1h"]).await;
    let message = every.failed(1);
    assert!(message.contains("would delete 1 of 1 finished run(s) (that is every finished run)"), "{message}");
    kept(vec![recent]).await;
    let report = durastep(Some(&url), &["--json", "prune", "--older-than", "1h", "--yes"]).await.json();
    assert_eq!(report["runs"].as_u64(), Some(1), "{report}");
    assert!(engine.run(recent).await.is_err(), "--yes deleted it");
    // Nothing to delete is not "every finished run".
    let nothing = durastep(Some(&url), &["prune", "--older-than", "1h"]).await;
    assert!(nothing.ok().starts_with("pruned 0 run(s)"), "{nothing:?}");
}

/// Catches: a panic or a debug dump instead of a message, the wrong exit
/// code, a password in a message, or a missing database URL not explained.
#[sqlx::test(migrations = false)]
async fn errors_are_one_line_with_the_right_exit_code(_p: PgPoolOptions, opts: PgConnectOptions) {
    let url = url_of(&opts);
    durastep(Some(&url), &["migrate"]).await.ok();
    let unknown = Uuid::new_v4().to_string();
    for cmd in [&["runs", "show"][..], &["why"], &["runs", "replay"], &["runs", "cancel"]] {
        let mut args = cmd.to_vec();
        args.push(&unknown);
        let out = durastep(Some(&url), &args).await;
        assert_eq!(out.failed(1), format!("error: no run with id {unknown}"), "{cmd:?}");
    }
    let bad_id = durastep(Some(&url), &["why", "42"]).await;
    assert!(bad_id.failed(1).contains("\"42\" is not a run id"), "{bad_id:?}");

    let started = std::time::Instant::now();
    let down = durastep(Some("postgres://ops:s3cret@127.0.0.1:1/app"), &["stats"]).await;
    let message = down.failed(2);
    assert!(message.contains("database unreachable at postgres://ops:***@127.0.0.1:1/app"), "{message}");
    assert!(!message.contains("s3cret"), "{message}");
    assert!(started.elapsed() < Duration::from_secs(5), "a refused connection fails at once");

    // No URL at all: the README's default, postgres://postgres@127.0.0.1:5432/postgres.
    let none = durastep(None, &["stats"]).await;
    assert!(
        none.code == Some(0) || none.stderr.contains("postgres://postgres@127.0.0.1:5432/postgres"),
        "the default URL is used: {none:?}"
    );
    let mut from_env = tokio::process::Command::new(env!("CARGO_BIN_EXE_durastep"));
    let out = from_env.env("DATABASE_URL", &url).args(["--json", "stats"]).output().await.unwrap();
    assert!(out.status.success(), "DATABASE_URL is read: {out:?}");
    let bad_url = durastep(Some("not a url"), &["stats"]).await;
    assert!(bad_url.failed(1).contains("invalid database URL"), "{bad_url:?}");
    let bad_flag = durastep(Some(&url), &["runs", "ls", "--bogus"]).await;
    assert!(bad_flag.failed(1).contains("--bogus"), "{bad_flag:?}");
    let open = durastep(Some(&url), &["serve", "--addr", "0.0.0.0:0"]).await;
    assert!(open.failed(1).contains("token"), "a non-loopback dashboard without a token: {open:?}");
}

/// Catches: a `serve` command that is not wired to the dashboard, or that
/// does not answer on the address it was given.
#[sqlx::test(migrations = false)]
async fn serve_answers_on_its_address(_p: PgPoolOptions, opts: PgConnectOptions) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let url = url_of(&opts);
    durastep(Some(&url), &["migrate"]).await.ok();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_durastep"))
        .args(["--database-url", &url, "serve", "--addr", &format!("localhost:{port}")])
        .stdout(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let page = loop {
        if let Ok(mut conn) = tokio::net::TcpStream::connect(&addr).await {
            conn.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").await.unwrap();
            let mut page = String::new();
            conn.read_to_string(&mut page).await.unwrap();
            break page;
        }
        assert!(tokio::time::Instant::now() < deadline, "the dashboard never answered on {addr}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(page.starts_with("HTTP/1.1 200"), "{page}");
    assert!(page.contains("<html"), "{page}");
    child.kill().await.unwrap();
}

/// The reader role's grants: the ```sql block after the marker in docs/security.md.
fn reader_grants() -> String {
    let doc = include_str!("../../../docs/security.md");
    let (_, after) = doc.split_once("<!-- reader-grants -->").expect("marker in docs/security.md");
    let block = after.split_once("```sql\n").expect("sql block").1;
    block.split_once("```").expect("end of sql block").0.to_owned()
}

/// Catches: read commands that build a full engine (registering, so needing
/// the runtime role): as the documented reader role (SELECT only) every read
/// command works, and the acting ones are refused by the database.
#[sqlx::test(migrations = false)]
async fn read_commands_run_as_the_reader_role(_p: PgPoolOptions, opts: PgConnectOptions) {
    let seeded = Seeded::new(&opts).await;
    let reader = format!("durastep_reader_{}", Uuid::new_v4().simple());
    let admin = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.unwrap();
    let grants = reader_grants().replace("durastep_reader", &reader);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE ROLE {reader} LOGIN; {grants}"))).execute(&admin).await.unwrap();
    let url = url_of(&opts.clone().username(&reader));
    let (failed, sleeping) = (seeded.failed.to_string(), seeded.sleeping.to_string());
    let mut problems = Vec::new();
    for args in [
        &["stats"][..],
        &["functions"],
        &["runs", "ls"],
        &["runs", "ls", "--function", "push-budget", "--since", "1h"],
        &["runs", "show", &failed],
        &["why", &sleeping],
        &["events", "ls"],
        &["--json", "stats"],
    ] {
        let out = durastep(Some(&url), args).await;
        if out.code != Some(0) {
            problems.push(format!("{args:?}: {out:?}"));
        }
    }
    let replay = durastep(Some(&url), &["runs", "replay", &failed]).await;
    if replay.code == Some(0) {
        problems.push(format!("the reader replayed a run: {replay:?}"));
    }
    for sql in [format!("DROP OWNED BY {reader}"), format!("DROP ROLE {reader}")] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone())).execute(&admin).await.expect(&sql);
    }
    assert!(problems.is_empty(), "{problems:#?}");
    assert_eq!(seeded.engine.run(seeded.failed).await.unwrap().state, RunState::Failed);
    seeded.stop().await;
}

/// Catches: a password printed by a URL that does not parse (an unencoded
/// `/`, `?` or `#` in it), by a libpq key=value string, in `--json` errors;
/// and the URL only accepted on the command line (visible in `ps`).
#[sqlx::test(migrations = false)]
async fn passwords_never_appear_in_errors_or_json(_p: PgPoolOptions, opts: PgConnectOptions) {
    let url = url_of(&opts);
    durastep(Some(&url), &["migrate"]).await.ok();
    for bad in [
        "postgres://ops:se/cr?et#1@127.0.0.1:1/app",
        "postgres://ops:se/cret@127.0.0.1:1/app",
        "postgres://ops:sec#ret@127.0.0.1:1/app",
        "postgres://ops@127.0.0.1:1/app?password=secret-in-query",
        "host=127.0.0.1 port=1 user=ops password=secret-kv dbname=app",
        "host=127.0.0.1 port=1 password='secret quoted' dbname=app",
    ] {
        for json in [false, true] {
            let args: &[&str] = if json { &["--json", "stats"] } else { &["stats"] };
            let out = durastep(Some(bad), args).await;
            assert_ne!(out.code, Some(0), "{bad}: {out:?}");
            for secret in ["se/cr?et#1", "se/cret", "sec#ret", "secret-in-query", "secret-kv", "secret quoted"] {
                assert!(!out.stderr.contains(secret) && !out.stdout.contains(secret), "{bad} leaks: {out:?}");
            }
            if json {
                let v: Value = serde_json::from_str(out.stderr.trim()).unwrap_or_else(|e| panic!("{e}: {out:?}"));
                assert!(v["error"]["message"].is_string() && v["error"]["kind"].is_string(), "{v}");
            }
        }
    }
    // The URL from a file, so it is not on the command line.
    let dir = std::env::temp_dir().join(format!("durastep-cli-{}", Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("url");
    std::fs::write(&file, format!("{url}\n")).unwrap();
    let out = durastep(None, &["--database-url-file", file.to_str().unwrap(), "--json", "stats"]).await;
    assert_eq!(out.code, Some(0), "{out:?}");
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_durastep"))
        .env_remove("DATABASE_URL")
        .env("DATABASE_URL_FILE", &file)
        .args(["functions"])
        .output()
        .await
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Catches (issue 15): a missing argument not named, unknown function names
/// and impossible replays answered with "0 runs", errors that are not JSON
/// with --json, `prune --older-than 0s` deleting everything without asking,
/// and `--addr localhost:PORT` refused.
#[sqlx::test(migrations = false)]
async fn mistakes_are_named_errors(_p: PgPoolOptions, opts: PgConnectOptions) {
    let seeded = Seeded::new(&opts).await;
    let missing = seeded.cli(&["why"]).await;
    assert!(missing.failed(1).contains("<ID>"), "{missing:?}");
    let unknown = seeded.cli(&["runs", "ls", "--function", "push-budgte"]).await;
    let message = unknown.failed(1);
    assert!(message.contains("push-budgte") && message.contains("push-budget"), "{message}");
    let replay = seeded.cli(&["runs", "replay", "--state", "completed"]).await;
    assert!(replay.failed(1).contains("only failed or cancelled runs"), "{replay:?}");
    let json = seeded.cli(&["--json", "runs", "show", &Uuid::nil().to_string()]).await;
    assert_eq!(json.code, Some(1));
    let v: Value = serde_json::from_str(json.stderr.trim()).expect("a JSON error");
    assert_eq!(v["error"]["kind"], "unknown_run", "{v}");
    let usage = seeded.cli(&["--json", "why"]).await;
    let v: Value = serde_json::from_str(usage.stderr.trim()).expect("a JSON usage error");
    assert_eq!(v["error"]["kind"], "usage", "{v}");
    let prune = seeded.cli(&["prune", "--older-than", "0s"]).await;
    assert!(prune.failed(1).contains("--yes"), "{prune:?}");
    assert_eq!(seeded.engine.run(seeded.completed).await.unwrap().state, RunState::Completed, "nothing pruned");
    let bad_addr = seeded.cli(&["serve", "--addr", "localhost"]).await;
    assert!(bad_addr.failed(1).contains("HOST:PORT"), "{bad_addr:?}");
    seeded.stop().await;
}

/// `durastep dev` with nothing answering at the URL: starts a throwaway
/// cluster, migrates it, prints its URL, and removes it on SIGTERM.
#[tokio::test]
async fn dev_starts_a_throwaway_cluster_and_removes_it_when_stopped() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_durastep"))
        .env("DATABASE_URL", format!("postgres://postgres@127.0.0.1:{closed}/postgres"))
        .arg("dev")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut said = Vec::new();
    let url = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            said.push(line.clone());
            if let Some(url) = line.strip_prefix("export DATABASE_URL=") {
                return url.to_owned();
            }
        }
        panic!("durastep dev ended without a URL: {said:?}");
    })
    .await
    .expect("durastep dev printed its URL in time");
    let dir =
        said[0].split(" in ").nth(1).and_then(|r| r.split(" (").next()).expect("the directory is named").to_owned();
    assert!(std::path::Path::new(&dir).is_dir(), "{said:?}");
    assert!(!url.contains(&format!(":{closed}/")), "{url}");

    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.unwrap();
    let migrated: bool =
        sqlx::query_scalar("SELECT to_regclass('durastep.runs') IS NOT NULL").fetch_one(&mut conn).await.unwrap();
    assert!(migrated, "the throwaway database is migrated");
    drop(conn);

    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await.expect("dev stops").unwrap();
    assert!(status.success(), "{status}");
    assert!(!std::path::Path::new(&dir).exists(), "{dir} was removed");
}
