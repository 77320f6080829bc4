//! The pages: what the overview, run list and run detail show, filters and
//! cursor pagination, replay and cancel through the forms, escaping, and every
//! page rendering from 100,000 runs.
mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::http::StatusCode;
use common::*;
use durastep::{Event, RunState};
use durastep_dashboard::{DashboardConfig, router};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn loopback() -> DashboardConfig {
    // These tests read error texts and keys; hiding them is security.rs's subject.
    let mut c = DashboardConfig::default();
    c.show_data = true;
    c
}

#[sqlx::test(migrations = false)]
async fn overview_list_and_detail_show_a_failed_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    let broken = Arc::new(AtomicBool::new(true));
    let engine = engine(&opts, vec![budget_push(broken.clone())]).await;
    let worker = spawn_worker(&engine);
    let id = failed_run(&engine, json!({"ad_account_id": "act_7"})).await;
    let app = router(engine.clone(), &loopback()).expect("router");

    let overview = get(&app, "/").await;
    assert_eq!(overview.status, StatusCode::OK);
    assert!(
        overview.body.contains("<td><a href=\"/runs?function=budget-push\">budget-push</a></td>"),
        "{}",
        overview.body
    );
    assert!(
        overview.body.contains("<a href=\"/runs?function=budget-push&amp;state=failed\">1</a>"),
        "{}",
        overview.body
    );
    assert!(overview.body.contains(&format!("href=\"/runs/{id}\"")), "the latest failures link to the run");
    assert!(overview.body.contains("created 1 · completed 0 · failed 1"), "{}", overview.body);
    assert!(overview.body.contains("<meta http-equiv=\"refresh\" content=\"10\">"));

    let list = get(&app, "/runs?state=failed&function=budget-push").await;
    assert_eq!(list.status, StatusCode::OK);
    assert!(list.body.contains(&format!("href=\"/runs/{id}\"")), "{}", list.body);
    let none = get(&app, "/runs?state=completed").await;
    assert!(!none.body.contains(&format!("href=\"/runs/{id}\"")) && none.body.contains("No runs match."));

    let detail = get(&app, &format!("/runs/{id}")).await;
    assert_eq!(detail.status, StatusCode::OK);
    let b = &detail.body;
    assert!(b.contains("<td id=\"state\"><span class=\"s s-failed\">failed</span></td>"), "{b}");
    assert!(b.contains("upstream refused account &quot;act_7&quot;"), "the step error, escaped: {b}");
    assert!(b.contains("<td>fetch</td><td><span class=\"s s-completed\">completed</span>"), "{b}");
    assert!(b.contains("<td>push</td><td><span class=\"s s-failed\">failed</span>"), "{b}");
    assert!(b.contains("id=\"replay\"") && b.contains("id=\"replay-start\"") && !b.contains("id=\"cancel\""));
    assert!(b.contains("It has finished (failed)"), "{b}");
    assert!(b.contains("<td>campaign/budget.requested</td>"));

    assert_eq!(get(&app, "/runs/not-a-uuid").await.status, StatusCode::NOT_FOUND);
    assert_eq!(get(&app, &format!("/runs/{}", uuid::Uuid::new_v4())).await.status, StatusCode::NOT_FOUND);
    assert_eq!(get(&app, "/runs?state=exploded").await.status, StatusCode::BAD_REQUEST);
    assert_eq!(get(&app, "/runs?after=nonsense").await.status, StatusCode::BAD_REQUEST);
    assert_eq!(get(&app, "/nowhere").await.status, StatusCode::NOT_FOUND);
    let functions = get(&app, "/functions").await;
    assert!(functions.body.contains("campaign/budget.requested"), "{}", functions.body);

    // Issue 15: a timeline waterfall, a "since" filter (on the database
    // clock), and bulk replay behind a confirmation that says how many.
    assert!(b.contains("id=\"waterfall\""), "a step timeline waterfall: {b}");
    assert!(b.contains("id=\"failure\""), "the failure says how it failed: {b}");
    let since = get(&app, "/runs?state=failed&since=1h").await;
    assert!(since.body.contains(&format!("href=\"/runs/{id}\"")), "{}", since.body);
    let future = chrono::Utc::now() + chrono::Duration::days(1);
    let later = get(&app, &format!("/runs?since={}", future.format("%Y-%m-%dT%H:%M:%SZ"))).await;
    assert!(later.body.contains("No runs match."), "{}", later.body);
    assert_eq!(get(&app, "/runs?since=yesterday").await.status, StatusCode::BAD_REQUEST);
    let list = get(&app, "/runs?state=failed").await;
    assert!(list.body.contains("id=\"replay-all\""), "{}", list.body);
    let csrf = csrf_of(&list.body);
    let ask = post_form(&app, "/runs/replay", &format!("csrf={csrf}&state=failed"), &[]).await;
    assert_eq!(ask.status, StatusCode::OK, "{}", ask.body);
    assert!(ask.body.contains("This replays <b>1</b> run(s)"), "{}", ask.body);
    assert_eq!(engine.run(id).await.expect("run").attempt, 1, "asking replays nothing");
    let wrong = post_form(&app, "/runs/replay", &format!("csrf={csrf}&state=completed&confirm=yes"), &[]).await;
    assert_eq!(wrong.status, StatusCode::BAD_REQUEST, "completed runs cannot be replayed");
    let done = post_form(&app, "/runs/replay", &format!("csrf={csrf}&state=failed&confirm=yes"), &[]).await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    assert_eq!(done.location(), Some("/runs?state=failed&replayed=1"));
    wait_for(&engine, id, "the replay to fail again", |r| r.attempt == 2 && r.state == durastep::RunState::Failed)
        .await;
    worker.stop().await;
}

/// Issue 15: a completed run whose earlier attempt failed shows that error as
/// recovered (not in red as the run's error); a sleep step shows its wake time
/// and how long it slept, not its few microseconds of bookkeeping.
#[sqlx::test(migrations = false)]
async fn recovered_errors_and_sleeps_are_shown_as_such(_p: PgPoolOptions, opts: PgConnectOptions) {
    let tries = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let t = tries.clone();
    let flaky = durastep::Function::new("flaky")
        .on_event("flaky/go")
        .retries(2)
        .backoff(durastep::Backoff::Fixed(std::time::Duration::from_millis(10)))
        .handler(move |ctx: durastep::Ctx, _: serde_json::Value| {
            let t = t.clone();
            async move {
                ctx.sleep("nap", std::time::Duration::from_millis(1)).await?;
                ctx.step("call", || async move {
                    if t.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                        Err(durastep::HandlerError::new("HTTP 503 once"))
                    } else {
                        Ok(1)
                    }
                })
                .await
            }
        });
    let engine = engine(&opts, vec![flaky]).await;
    let worker = spawn_worker(&engine);
    let id = engine.send(durastep::Event::new("flaky/go", &json!({}))).await.expect("send").run_ids[0];
    let run = wait_for(&engine, id, "completion", |r| r.state.is_finished()).await;
    assert_eq!(run.state, durastep::RunState::Completed, "{run:?}");
    let app = router(engine.clone(), &loopback()).expect("router");
    let b = get(&app, &format!("/runs/{id}")).await.body;
    if run.last_error.is_some() {
        assert!(b.contains("id=\"recovered\"") && !b.contains("<th>Last error</th>"), "{b}");
    }
    assert!(b.contains("(recovered)"), "the step that failed once then completed: {b}");
    assert!(b.contains("<span class=\"s s-sleeping\">sleep</span>"), "{b}");
    assert!(b.contains("sleep until "), "{b}");
    assert!(b.contains("<h2>Status</h2>") && !b.contains("Why it is not running"), "{b}");
    worker.stop().await;
}

#[sqlx::test(migrations = false)]
async fn replay_and_cancel_through_the_forms(_p: PgPoolOptions, opts: PgConnectOptions) {
    let broken = Arc::new(AtomicBool::new(true));
    let engine = engine(&opts, vec![budget_push(broken.clone())]).await;
    let worker = spawn_worker(&engine);
    let id = failed_run(&engine, json!({"ad_account_id": "act_1"})).await;
    let app = router(engine.clone(), &loopback()).expect("router");
    broken.store(false, Ordering::SeqCst);

    let csrf = csrf_of(&get(&app, &format!("/runs/{id}")).await.body);
    let origin = ("origin", "http://127.0.0.1:7070");
    let r = post_form(&app, &format!("/runs/{id}/replay"), &format!("csrf={csrf}&from=failed_step"), &[origin]).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(r.location(), Some(format!("/runs/{id}?done=replayed").as_str()));
    let run = wait_for(&engine, id, "the replay to complete", |r| r.state == RunState::Completed).await;
    assert_eq!(run.output, Some(json!({"pushed": true, "with": "STEP-OUTPUT-SECRET-4711"})));
    // Replaying a completed run is refused, and says why.
    let again = post_form(&app, &format!("/runs/{id}/replay"), &format!("csrf={csrf}"), &[origin]).await;
    assert_eq!(again.status, StatusCode::CONFLICT);
    assert!(again.body.contains("only failed or cancelled runs can be replayed"), "{}", again.body);

    // Cancel a run that is waiting for its delayed start.
    worker.stop().await;
    let later = engine
        .send(
            Event::new("campaign/budget.requested", &json!({"ad_account_id": "act_2"}))
                .start_at(chrono::Utc::now() + chrono::Duration::hours(1)),
        )
        .await
        .expect("send")
        .run_ids[0];
    let page = get(&app, &format!("/runs/{later}")).await;
    assert!(page.body.contains("<td id=\"blocker\">scheduled</td>"), "{}", page.body);
    assert!(page.body.contains("id=\"cancel\""));
    let overview = get(&app, "/").await;
    assert!(
        overview.body.contains("(a delayed start)</span></td><td>budget-push</td><td>–</td><td class=\"n\">1</td>"),
        "the blockers summary: {}",
        overview.body
    );
    assert!(
        overview.body.contains(&format!("href=\"/runs/{later}\" title=\"{later}\"")),
        "it links the longest-due run"
    );
    let r = post_form(&app, &format!("/runs/{later}/cancel"), &format!("csrf={csrf}&reason=client+paused"), &[origin])
        .await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    let run = engine.run(later).await.expect("run");
    assert_eq!((run.state, run.cancel_reason.as_deref()), (RunState::Cancelled, Some("client paused")));

    // Replay from the start reruns every step.
    let r = post_form(&app, &format!("/runs/{later}/replay"), &format!("csrf={csrf}&from=start"), &[origin]).await;
    assert_eq!(r.status, StatusCode::SEE_OTHER, "{}", r.body);
    assert_eq!(engine.run(later).await.expect("run").state, RunState::Queued);
}

#[sqlx::test(migrations = false)]
async fn user_values_are_escaped_everywhere(_p: PgPoolOptions, opts: PgConnectOptions) {
    let broken = Arc::new(AtomicBool::new(true));
    let engine = engine(&opts, vec![budget_push(broken)]).await;
    let worker = spawn_worker(&engine);
    let evil = "<script>alert(1)</script>";
    let id = engine
        .send(Event::new("campaign/budget.requested", &json!({"ad_account_id": evil})).idempotency_key(evil))
        .await
        .expect("send")
        .run_ids[0];
    engine.wait_for_run(id, DEADLINE).await.expect("run");
    let mut config = loopback();
    config.show_data = true; // event data on the page too
    let app = router(engine.clone(), &config).expect("router");
    let pages = [
        get(&app, &format!("/runs/{id}")).await,
        get(&app, "/runs").await,
        get(&app, "/").await,
        get(&app, &format!("/runs?idempotency_key={}", "%3Cscript%3Ealert(1)%3C%2Fscript%3E")).await,
        get(&app, "/runs?function=%3Cscript%3E").await,
    ];
    for (i, page) in pages.iter().enumerate() {
        assert_eq!(page.status, StatusCode::OK, "page {i}");
        assert!(!page.body.contains("<script"), "page {i} carries a raw script tag: {}", page.body);
    }
    assert!(pages[0].body.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{}", pages[0].body);
    assert!(pages[1].body.contains("<td>&lt;script&gt;alert(1)&lt;/script&gt;</td>"), "the idempotency key column");
    assert!(pages[3].body.contains(&format!("href=\"/runs/{id}\"")), "the idempotency key filter finds the run");
    assert!(pages[4].body.contains("value=\"&lt;script&gt;\""), "the filter form echoes the value escaped");
    worker.stop().await;
}

#[sqlx::test(migrations = false)]
async fn every_page_renders_from_100k_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, vec![]).await;
    seed_runs(&engine, 100_000).await;
    let app = router(engine.clone(), &loopback()).expect("router");

    let overview = get(&app, "/").await;
    assert_eq!(overview.status, StatusCode::OK);
    assert!(
        overview.body.contains("<th class=\"n\">100000</th>"),
        "the total: {}",
        &overview.body[..2000.min(overview.body.len())]
    );

    // Follow the cursor five pages deep: no run shown twice, newest first.
    let mut seen = std::collections::HashSet::new();
    let mut path = "/runs?state=failed".to_owned();
    for _ in 0..5 {
        let page = get(&app, &path).await;
        assert_eq!(page.status, StatusCode::OK);
        let ids: Vec<&str> = page.body.split("class=\"run\" href=\"/runs/").skip(1).map(|s| &s[..36]).collect();
        assert_eq!(ids.len(), 50, "{path}");
        for id in ids {
            assert!(seen.insert(id.to_owned()), "{id} twice");
        }
        let next =
            page.body.split("rel=\"next\" href=\"").nth(1).expect("a next link").split('"').next().expect("href");
        path = next.replace("&amp;", "&");
    }
    assert_eq!(seen.len(), 250);

    let keyed = get(&app, "/runs?key=%2Fad_account_id%3Dact_7").await;
    assert_eq!(keyed.status, StatusCode::OK);
    assert_eq!(keyed.body.matches("class=\"run\"").count(), 50);
    let by_key = get(&app, "/runs?idempotency_key=seed-42").await;
    assert_eq!(by_key.body.matches("class=\"run\"").count(), 1);

    let failed = seeded_run(&engine, 85).await; // i % 100 == 85: failed
    let detail = get(&app, &format!("/runs/{failed}")).await;
    assert_eq!(detail.status, StatusCode::OK);
    assert!(detail.body.contains("HTTP 502 from upstream"));
}

/// Markup-breaking data in every field a page shows: a function id, an event
/// name, a step key, an error text and an idempotency key (data shown), on
/// every page, including the error page and the bulk replay's confirmation.
#[sqlx::test(migrations = false)]
async fn markup_in_every_displayed_field_is_escaped_on_every_page(_p: PgPoolOptions, opts: PgConnectOptions) {
    const EVENT: &str = "evil/<script>alert(\"event\")</script>";
    const STEP: &str = "<script>alert(\"step\")</script>";
    const ERROR: &str = "<script>alert(\"error\")</script>";
    const KEY: &str = "<script>alert(\"key\")</script>";
    // A function id may hold only ASCII letters, digits and `-_.:`; one
    // written into the database by hand (a database user) may hold anything.
    const FUNCTION: &str = "<script>alert(\"function\")</script>";
    let f = durastep::Function::new("xss-probe").on_event(EVENT).retries(0).handler(
        |ctx: durastep::Ctx, _: serde_json::Value| async move {
            ctx.step(STEP, || async { Ok(1) }).await?;
            ctx.step("fails", || async { Err::<(), _>(durastep::HandlerError::permanent(ERROR)) }).await?;
            Ok(())
        },
    );
    let engine = engine(&opts, vec![f]).await;
    let worker = spawn_worker(&engine);
    let id = engine.send(Event::new(EVENT, &json!({})).idempotency_key(KEY)).await.expect("send").run_ids[0];
    assert_eq!(engine.wait_for_run(id, DEADLINE).await.expect("run").state, RunState::Failed);
    worker.stop().await;
    for sql in [
        "UPDATE durastep.runs SET function_id = $1 WHERE function_id = 'xss-probe'",
        "UPDATE durastep.functions SET id = $1 WHERE id = 'xss-probe'",
    ] {
        sqlx::query(sql).bind(FUNCTION).execute(engine.pool()).await.expect("rename the function");
    }
    let app = router(engine.clone(), &loopback()).expect("router");
    let escaped = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
    let list = get(&app, "/runs").await;
    let csrf = csrf_of(&get(&app, &format!("/runs/{id}")).await.body);
    let confirm = post_form(
        &app,
        "/runs/replay",
        &format!("csrf={csrf}&state=failed&event={}", enc(EVENT)),
        &[("origin", "http://127.0.0.1:7070")],
    )
    .await;
    let pages = [
        ("detail", get(&app, &format!("/runs/{id}")).await, vec![FUNCTION, EVENT, STEP, ERROR, KEY]),
        ("list", list, vec![FUNCTION, EVENT, KEY]),
        ("overview", get(&app, "/").await, vec![FUNCTION]),
        ("functions", get(&app, "/functions").await, vec![FUNCTION]),
        (
            "filtered list",
            get(&app, &format!("/runs?event={}&idempotency_key={}", enc(EVENT), enc(KEY))).await,
            vec![FUNCTION, EVENT, KEY],
        ),
        ("confirmation", confirm, vec![EVENT]),
        ("error page", get(&app, &format!("/runs/{}", enc(STEP))).await, vec![]),
    ];
    for (name, page, fields) in &pages {
        assert!(!page.body.contains("<script"), "{name} carries a raw script tag: {}", page.body);
        assert!(!page.body.contains("alert(\""), "{name} carries a raw quote from data: {}", page.body);
        for field in fields {
            assert!(page.body.contains(&escaped(field)), "{name} does not show {field:?} escaped: {}", page.body);
        }
    }
    assert!(pages[6].1.body.contains("&lt;script&gt;alert("), "the 404 quotes the path escaped: {}", pages[6].1.body);
    // The error text: in full on the detail page, shortened in the lists.
    let short_error = escaped(&ERROR[..20]);
    for (name, page, _) in &pages[..3] {
        assert!(page.body.contains(&short_error), "{name} does not show the error text escaped: {}", page.body);
    }
}

/// Percent-encodes a query value.
fn enc(s: &str) -> String {
    s.bytes().map(|b| if b.is_ascii_alphanumeric() { (b as char).to_string() } else { format!("%{b:02X}") }).collect()
}

/// The run of `gate`: one step that waits until the test notifies it.
fn gate(open: Arc<tokio::sync::Notify>) -> durastep::Function {
    durastep::Function::new("gate").on_event("gate/go").retries(0).handler(
        move |ctx: durastep::Ctx, _: serde_json::Value| {
            let open = open.clone();
            async move {
                ctx.step("wait", || async move {
                    open.notified().await;
                    Ok(1)
                })
                .await
            }
        },
    )
}

/// The overview's words when no run is held: none unfinished (an empty
/// database, then one whose only run completed), and every unfinished run
/// running. Catches: the empty state saying something else, or nothing.
#[sqlx::test(migrations = false)]
async fn the_overview_says_when_no_run_is_unfinished(_p: PgPoolOptions, opts: PgConnectOptions) {
    let open = Arc::new(tokio::sync::Notify::new());
    let engine = engine(&opts, vec![gate(open.clone())]).await;
    let app = router(engine.clone(), &loopback()).expect("router");
    let empty = "id=\"no-blockers\">No run is unfinished.</p>";
    let overview = get(&app, "/").await;
    assert!(overview.body.contains(empty), "an empty database: {}", overview.body);

    let worker = spawn_worker(&engine);
    let id = engine.send(Event::new("gate/go", &json!({}))).await.expect("send").run_ids[0];
    wait_for(&engine, id, "the run to start", |r| r.state == RunState::Running).await;
    let overview = get(&app, "/").await;
    assert!(
        overview.body.contains("id=\"no-blockers\">Every unfinished run is running.</p>"),
        "one run running: {}",
        overview.body
    );
    open.notify_one();
    wait_for(&engine, id, "the run to complete", |r| r.state == RunState::Completed).await;
    let overview = get(&app, "/").await;
    assert!(overview.body.contains(empty), "only a completed run: {}", overview.body);
    assert!(!overview.body.contains("<th>Held by</th>"), "no blocker table: {}", overview.body);
    worker.stop().await;
}

/// A run due now that no worker claims: the overview explains the `ready`
/// blocker (is a worker running that registers the function?) and the run's
/// page says it is held by `ready`. Catches: the explanation lost or attached
/// to another kind.
#[sqlx::test(migrations = false)]
async fn the_ready_blocker_is_explained(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, vec![gate(Arc::new(tokio::sync::Notify::new()))]).await;
    // No worker: the run stays due and unclaimed.
    let id = engine.send(Event::new("gate/go", &json!({}))).await.expect("send").run_ids[0];
    let app = router(engine.clone(), &loopback()).expect("router");
    let overview = get(&app, "/").await;
    assert!(
        overview.body.contains(
            "<td>ready <span class=\"muted\">(due now, not yet claimed: is a worker running that registers this \
             function?)</span></td><td>gate</td><td>–</td><td class=\"n\">1</td>"
        ),
        "{}",
        overview.body
    );
    assert!(overview.body.contains(&format!("href=\"/runs/{id}\"")), "it links the run: {}", overview.body);
    let page = get(&app, &format!("/runs/{id}")).await;
    assert!(page.body.contains("<h2>Why it is not running</h2>"), "{}", page.body);
    assert!(page.body.contains("<td id=\"blocker\">ready</td>"), "{}", page.body);
}

/// Every time on the overview, the run list and a run's page carries its
/// zone, and is the stored UTC time (not the server's local time under a UTC
/// label). Catches: a time shown without its zone, or converted.
#[sqlx::test(migrations = false)]
async fn times_are_shown_in_utc_with_their_zone(_p: PgPoolOptions, opts: PgConnectOptions) {
    let broken = Arc::new(AtomicBool::new(true));
    let engine = engine(&opts, vec![budget_push(broken)]).await;
    let worker = spawn_worker(&engine);
    let id = failed_run(&engine, json!({"ad_account_id": "act_7"})).await;
    let run = engine.run(id).await.expect("run");
    let utc = |t: chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string();
    let app = router(engine.clone(), &loopback()).expect("router");

    let detail = get(&app, &format!("/runs/{id}")).await.body;
    assert!(detail.contains(&format!("<tr><th>Created</th><td>{}</td></tr>", utc(run.created_at))), "{detail}");
    let finished = run.finished_at.expect("finished");
    assert!(detail.contains(&format!("<tr><th>Finished</th><td>{}</td></tr>", utc(finished))), "{detail}");
    let list = get(&app, "/runs").await.body;
    assert!(list.contains(&format!("<td>{}</td>", utc(run.created_at))), "{list}");
    let overview = get(&app, "/").await.body;
    assert!(overview.contains(&format!("<td>{}</td>", utc(finished))), "the latest failures: {overview}");
    assert!(overview.contains(" UTC</text>"), "the chart's time axis: {overview}");

    for (name, body, at_least) in [("detail", &detail, 8), ("list", &list, 2), ("overview", &overview, 1)] {
        let times = timestamps(body);
        assert!(times.len() >= at_least, "{name}: {times:?}");
        let bare: Vec<&String> = times.iter().filter(|t| !t.ends_with(" UTC")).collect();
        assert!(bare.is_empty(), "{name} shows times without their zone: {bare:?}");
    }
    worker.stop().await;
}

/// Every `YYYY-MM-DD HH:MM:SS.mmm` in `body`, with the four characters after it.
fn timestamps(body: &str) -> Vec<String> {
    const SHAPE: &[u8] = b"dddd-dd-dd dd:dd:dd.ddd";
    let b = body.as_bytes();
    (0..b.len().saturating_sub(SHAPE.len()))
        .filter(|&i| {
            SHAPE.iter().zip(&b[i..]).all(|(s, c)| if *s == b'd' { c.is_ascii_digit() } else { s == c })
                && (i == 0 || !b[i - 1].is_ascii_digit())
        })
        .map(|i| String::from_utf8_lossy(&b[i..(i + SHAPE.len() + 4).min(b.len())]).into_owned())
        .collect()
}

/// A run the second build of its function diverges from: its page says so
/// (`#diverged`, with the divergence: where, what was recorded, what was
/// asked), the overview counts it as waiting for an operator instead of
/// claiming every unfinished run is running, and the run list finds it.
/// Catches: the diverged state not shown, or the overview's "every unfinished
/// run is running" while a diverged run waits (it has no blocker row).
#[sqlx::test(migrations = false)]
async fn a_diverged_run_says_so_on_its_page_and_the_overview(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (engine, id, worker) = diverged_run(&opts, "lookup-v2", vec![]).await;
    let app = router(engine.clone(), &loopback()).expect("router");
    let page = get(&app, &format!("/runs/{id}")).await.body;
    assert!(page.contains("<td id=\"state\"><span class=\"s s-diverged\">diverged</span></td>"), "{page}");
    assert!(page.contains("<h2>Why it is not running</h2>"), "{page}");
    let said = page.split("<p id=\"diverged\">").nth(1).and_then(|s| s.split("</p>").next()).expect("#diverged");
    assert!(
        said.contains("diverged at position 0: recorded step &quot;lookup&quot;, asked step &quot;lookup-v2&quot;"),
        "{said}"
    );
    assert!(said.contains("It stays parked until an operator resumes it"), "{said}");
    assert!(!page.contains("id=\"replay\"") && page.contains("id=\"cancel\""), "{page}");

    let overview = get(&app, "/").await.body;
    assert!(
        overview.contains("<a href=\"/runs?state=diverged\">1 diverged run(s)</a> wait for an operator"),
        "{overview}"
    );
    assert!(overview.contains("id=\"no-blockers\">No other run is unfinished.</p>"), "{overview}");
    assert!(!overview.contains("Every unfinished run is running."), "{overview}");
    let list = get(&app, "/runs?state=diverged").await.body;
    assert!(list.contains(&format!("href=\"/runs/{id}\"")), "{list}");
    worker.stop().await;
}

/// The width attribute of the first timeline `<rect>` of `class` in `body`.
fn rect_width(body: &str, class: &str) -> f64 {
    let at = body.find(&format!("<rect class=\"{class}\"")).unwrap_or_else(|| panic!("a {class} rect: {body}"));
    let rest = &body[at..];
    let w = rest.find(" width=\"").expect("a width") + " width=\"".len();
    rest[w..].split('"').next().expect("width value").parse().expect("a number")
}

/// The timeline's SVG, alone.
fn svg(body: &str) -> &str {
    let at = body.find("<svg id=\"waterfall\"").unwrap_or_else(|| panic!("a waterfall: {body}"));
    let end = body[at..].find("</svg>").expect("the svg ends") + at;
    &body[at..end]
}

/// Issue 15: a wait for an event is a span on the timeline from when the run
/// began waiting to when the event came (two hours by the database clock
/// here, so far wider than a step), in its own colour with a legend; while it
/// waits it is drawn to now with an open end and names the awaited event.
#[sqlx::test(migrations = false)]
async fn a_wait_is_a_span_from_waiting_to_the_event(_p: PgPoolOptions, opts: PgConnectOptions) {
    let approver = durastep::Function::new("approver").on_event("doc/created").handler(
        |ctx: durastep::Ctx, _: serde_json::Value| async move {
            ctx.step("prepare", || async { Ok(1) }).await?;
            let got: Option<serde_json::Value> =
                ctx.wait_for_event("approval", durastep::WaitFor::event("doc/approved<b>")).await?;
            ctx.step("finish", || async { Ok(2) }).await?;
            Ok(got)
        },
    );
    let engine = engine(&opts, vec![approver]).await;
    let worker = spawn_worker(&engine);
    let id = engine.send(Event::new("doc/created", &json!({}))).await.expect("send").run_ids[0];
    wait_for(&engine, id, "the run to wait", |r| r.state == RunState::Waiting).await;
    let hour = std::time::Duration::from_secs(3600);
    durastep::testing::advance_clock(&engine, hour).await.expect("move the clock");
    let app = router(engine.clone(), &loopback()).expect("router");

    let b = get(&app, &format!("/runs/{id}")).await.body;
    let s = svg(&b);
    assert!(s.contains("<rect class=\"wait\""), "a pending wait is drawn: {s}");
    assert!(s.contains("<polygon class=\"open\""), "with an open end: {s}");
    assert!(s.contains("waiting for doc/approved&lt;b&gt; · 60.0 min so far"), "its label, escaped: {s}");
    assert!(s.contains("approval: waiting for doc/approved&lt;b&gt;, since "), "its tooltip: {s}");
    assert!(!s.contains("doc/approved<b>"), "escaped: {s}");
    assert!(rect_width(s, "wait") > 400.0, "an hour of a run's hour and some ms: {s}");
    for legend in ["step", "durable sleep", "wait for an event", "child run (invoke)", "failure"] {
        assert!(s.contains(&format!(">{legend}</text>")), "legend {legend}: {s}");
    }

    durastep::testing::advance_clock(&engine, hour).await.expect("move the clock");
    engine.send(Event::new("doc/approved<b>", &json!({"ok": true}))).await.expect("send");
    let run = wait_for(&engine, id, "completion", |r| r.state.is_finished()).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    let b = get(&app, &format!("/runs/{id}")).await.body;
    let s = svg(&b);
    assert!(!s.contains("class=\"open\""), "resolved: no open end: {s}");
    let (wait, step) = (rect_width(s, "wait"), rect_width(s, "step"));
    assert!(wait > 500.0 && wait > 50.0 * step, "two hours against milliseconds: wait {wait}, step {step}: {s}");
    assert!(s.contains("waited 120.0 min · event "), "the waited time beside it: {s}");
    assert!(b.contains("<td>approval</td><td><span class=\"s s-waiting\">wait</span>"), "{b}");
    worker.stop().await;
}

/// Issue 15: a child run (`ctx.invoke`) is a span from when the parent began
/// waiting for it, labelled with the child's id (linked), drawn to now while
/// the child runs, and to the child's end once it has finished.
#[sqlx::test(migrations = false)]
async fn an_invoke_is_a_span_labelled_with_its_child(_p: PgPoolOptions, opts: PgConnectOptions) {
    let parent = durastep::Function::new("parent").on_event("parent/go").handler(
        |ctx: durastep::Ctx, _: serde_json::Value| async move {
            ctx.step("prepare", || async { Ok(1) }).await?;
            let r: Result<serde_json::Value, _> =
                ctx.invoke("fan", durastep::Invoke::function("child").input(&json!({}))).await?;
            Ok(r.is_ok())
        },
    );
    let child = durastep::Function::new("child").handler(|ctx: durastep::Ctx, _: serde_json::Value| async move {
        let got: Option<serde_json::Value> =
            ctx.wait_for_event("release", durastep::WaitFor::event("child/release")).await?;
        Ok(got)
    });
    let engine = engine(&opts, vec![parent, child]).await;
    let worker = spawn_worker(&engine);
    let id = engine.send(Event::new("parent/go", &json!({}))).await.expect("send").run_ids[0];
    wait_for(&engine, id, "the parent to wait", |r| r.state == RunState::Waiting).await;
    let kid = engine.inspect().run(id).await.expect("detail").children[0].id;
    wait_for(&engine, kid, "the child to wait", |r| r.state == RunState::Waiting).await;
    durastep::testing::advance_clock(&engine, std::time::Duration::from_secs(600)).await.expect("move the clock");
    let app = router(engine.clone(), &loopback()).expect("router");

    let b = get(&app, &format!("/runs/{id}")).await.body;
    let s = svg(&b);
    assert!(s.contains("<rect class=\"invoke\""), "a pending invoke is drawn: {s}");
    assert!(s.contains("<polygon class=\"open\""), "with an open end: {s}");
    assert!(s.contains(&format!("fan: child run {kid}, since ")), "its tooltip names the child: {s}");
    assert!(s.contains(&format!("<a href=\"/runs/{kid}\">")), "linked to the child: {s}");
    assert!(s.contains("10.0 min so far"), "{s}");
    assert!(rect_width(s, "invoke") > 400.0, "{s}");
    // The child's own page: its pending wait.
    let c = get(&app, &format!("/runs/{kid}")).await.body;
    assert!(svg(&c).contains("waiting for child/release"), "{c}");

    engine.send(Event::new("child/release", &json!({}))).await.expect("send");
    let run = wait_for(&engine, id, "the parent to complete", |r| r.state.is_finished()).await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    let b = get(&app, &format!("/runs/{id}")).await.body;
    let s = svg(&b);
    assert!(!s.contains("class=\"open\""), "{s}");
    assert!(s.contains(&format!("invoke fan: child run {kid} completed; from ")), "{s}");
    assert!(rect_width(s, "invoke") > 50.0 * rect_width(s, "step"), "{s}");
    assert!(b.contains("<td>fan</td><td><span class=\"s s-waiting\">child run</span>"), "{b}");
    worker.stop().await;
}
