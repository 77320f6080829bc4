//! The `durastep` binary against a real database per test: runs are seeded
//! by an engine and a worker in this process; the CLI, a separate process,
//! reads and acts on them through the inspection API only.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Ctx, Engine, Event, Function, HandlerError, RunState, WorkerOptions};
use serde_json::{Value, json};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
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

/// A worker running in the test process; stopped on drop.
struct Worker {
    shutdown: CancellationToken,
    handle: Option<tokio::task::JoinHandle<Result<(), durastep::Error>>>,
}

impl Worker {
    fn start(engine: &Engine) -> Self {
        let shutdown = CancellationToken::new();
        let (e, s) = (engine.clone(), shutdown.clone());
        Worker { shutdown, handle: Some(tokio::spawn(async move { e.run_worker(s).await })) }
    }

    async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(h) = self.handle.take() {
            h.await.expect("worker task").expect("worker");
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.shutdown.cancel();
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
    let pool =
        PgPoolOptions::new().max_connections(6).connect_with(opts.clone().options([("jit", "off")])).await.unwrap();
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
            .concurrency_shared("exact-online", 1, Some("/account"))
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
        wait_for(&engine, held, "the second invoice parked", |r| r.flow_wait.is_some()).await;
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

/// Catches: a CLI that migrates by accident (stats would then work on an
/// empty database), a migrate that is not idempotent, or stats that miscount.
#[sqlx::test(migrations = false)]
async fn migrate_on_an_empty_database_then_stats(_p: PgPoolOptions, opts: PgConnectOptions) {
    let url = url_of(&opts);
    let before = durastep(Some(&url), &["stats"]).await;
    assert!(before.failed(1).contains("run `durastep migrate`"), "{before:?}");
    assert_eq!(durastep(Some(&url), &["migrate"]).await.ok(), "schema up to date\n");
    assert_eq!(durastep(Some(&url), &["--json", "migrate"]).await.json(), json!({"migrated": true}));
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
    // queued, running, sleeping, waiting, completed, failed, cancelled, skipped, total
    assert_eq!(cells[1..], ["1", "1", "0", "0", "0", "0", "0", "0", "2"], "{text}");
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

    let page = s.cli(&["--json", "runs", "ls", "--state", "failed"]).await.json();
    let run = &page["runs"][0];
    assert_eq!((run["function_id"].as_str(), run["state"].as_str()), (Some("push-budget"), Some("failed")));
    assert_eq!(run["last_error"].as_str(), Some(format!("step push: {META_ERROR}").as_str()));
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
    assert!(text.contains(&format!("error       step push: {META_ERROR}")), "{text}");
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
        format!("sleeping until {}", wake.to_rfc3339_opts(chrono::SecondsFormat::Secs, true))
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

/// Catches: a replay that does not requeue, re-runs finished steps, accepts a
/// run that is not dead, or takes an id and filters at once.
#[sqlx::test(migrations = false)]
async fn replay_makes_a_failed_run_complete_once_the_cause_is_fixed(_p: PgPoolOptions, opts: PgConnectOptions) {
    let s = Seeded::new(&opts).await;
    let id = s.failed.to_string();
    assert_eq!(s.fetches.load(Ordering::SeqCst), 1);
    s.fixed.store(true, Ordering::SeqCst);
    let out = s.cli(&["runs", "replay", &id]).await;
    assert_eq!(
        out.ok().trim_end(),
        format!("run {id} (push-budget) is queued again, from the failed step: attempt 2 of 2")
    );
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

    let none = durastep(None, &["stats"]).await;
    assert!(none.failed(1).contains("pass --database-url") && none.stderr.contains("set DATABASE_URL"), "{none:?}");
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
        .args(["--database-url", &url, "serve", "--addr", &addr])
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
