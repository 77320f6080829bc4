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
    DashboardConfig::default()
}

#[sqlx::test(migrations = false)]
async fn overview_list_and_detail_show_a_failed_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    let broken = Arc::new(AtomicBool::new(true));
    let engine = engine(&opts, vec![budget_push(broken.clone())]).await;
    let _worker = spawn_worker(&engine);
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
    drop(worker);
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
        overview.body.contains("<td>scheduled</td><td>budget-push</td><td>–</td><td class=\"n\">1</td>"),
        "the blockers summary: {}",
        overview.body
    );
    assert!(overview.body.contains(&format!("<a href=\"/runs/{later}\">")), "it links the longest-due run");
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
    let _worker = spawn_worker(&engine);
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
