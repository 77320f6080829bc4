//! Security: loopback unless a token is set; with a token every page needs it
//! and nothing leaks outputs without it; outputs hidden in loopback mode unless
//! asked for; CSRF-less or cross-origin POSTs get 403 and change nothing.
mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use axum::http::StatusCode;
use common::*;
use durastep::RunState;
use durastep_dashboard::{DashboardConfig, DashboardError, router, serve};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "correct-horse-battery-staple-42";
/// The step output of `budget_push`'s `fetch` step, and a value of its event data.
const SECRET_OUTPUT: &str = "STEP-OUTPUT-SECRET-4711";
const SECRET_DATA: &str = "act_SECRET_DATA";

fn with_token() -> DashboardConfig {
    let mut c = DashboardConfig::default();
    c.token = Some(TOKEN.into());
    c
}

/// An engine with one completed run (its step output and event data are the
/// secrets) and one failed run.
async fn setup(opts: &PgConnectOptions) -> (durastep::Engine, uuid::Uuid, uuid::Uuid, WorkerGuard) {
    let broken = Arc::new(AtomicBool::new(true));
    let engine = engine(opts, vec![budget_push(broken.clone())]).await;
    let worker = spawn_worker(&engine);
    let failed = failed_run(&engine, json!({"ad_account_id": "act_1", "note": SECRET_DATA})).await;
    broken.store(false, std::sync::atomic::Ordering::SeqCst);
    let ok = engine
        .send(durastep::Event::new(
            "campaign/budget.requested",
            &json!({"ad_account_id": "act_1", "note": SECRET_DATA}),
        ))
        .await
        .expect("send")
        .run_ids[0];
    assert_eq!(engine.wait_for_run(ok, DEADLINE).await.expect("run").state, RunState::Completed);
    (engine, ok, failed, worker)
}

fn leaks(body: &str) -> bool {
    body.contains(SECRET_OUTPUT) || body.contains(SECRET_DATA)
}

#[sqlx::test(migrations = false)]
async fn a_non_loopback_address_needs_a_token(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, vec![]).await;
    for addr in ["0.0.0.0:7070", "192.168.1.10:7070", "[::]:7070"] {
        let config = DashboardConfig::new(addr.parse().expect("addr"));
        assert!(matches!(router(engine.clone(), &config), Err(DashboardError::TokenRequired { .. })), "{addr}");
        let served = serve(engine.clone(), config, CancellationToken::new()).await;
        assert!(matches!(served, Err(DashboardError::TokenRequired { .. })), "{addr}: {served:?}");
    }
    let mut ok = DashboardConfig::new("0.0.0.0:7070".parse().expect("addr"));
    ok.token = Some(TOKEN.into());
    assert!(router(engine.clone(), &ok).is_ok());
    ok.token = Some("short".into());
    assert!(matches!(router(engine.clone(), &ok), Err(DashboardError::WeakToken { .. })));
    assert!(router(engine.clone(), &DashboardConfig::new("[::1]:7070".parse().expect("addr"))).is_ok());

    // Loopback serves, and stops when cancelled.
    let shutdown = CancellationToken::new();
    let task = tokio::spawn(serve(
        engine.clone(),
        DashboardConfig::new("127.0.0.1:0".parse().expect("addr")),
        shutdown.clone(),
    ));
    shutdown.cancel();
    let served = tokio::time::timeout(DEADLINE, task).await.expect("serve stops when cancelled").expect("task");
    assert!(served.is_ok(), "{served:?}");
}

#[sqlx::test(migrations = false)]
async fn with_a_token_every_page_requires_it(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (engine, ok, failed, _worker) = setup(&opts).await;
    let app = router(engine.clone(), &with_token()).expect("router");
    let pages = ["/".to_owned(), "/runs".into(), format!("/runs/{ok}"), format!("/runs/{failed}"), "/functions".into()];

    for path in &pages {
        let page = get(&app, path).await;
        assert_eq!(page.status, StatusCode::SEE_OTHER, "{path}");
        assert!(page.location().is_some_and(|l| l.starts_with("/login?next=")), "{path}: {:?}", page.location());
        assert!(!leaks(&page.body), "{path}");
        let wrong = get_with(&app, path, &[("authorization", "Bearer not-the-token-at-all")]).await;
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{path}");
        assert!(!leaks(&wrong.body));
        let forged = get_with(&app, path, &[("cookie", "durastep_session=guess")]).await;
        assert_eq!(forged.status, StatusCode::SEE_OTHER, "{path}");
    }
    // POSTs without the token are refused before any CSRF check.
    let post = post_form(&app, &format!("/runs/{failed}/replay"), "csrf=x", &[]).await;
    assert_eq!(post.status, StatusCode::UNAUTHORIZED);
    assert_eq!(engine.run(failed).await.expect("run").state, RunState::Failed);

    // With the bearer token: the pages, with the outputs and data.
    let bearer = format!("Bearer {TOKEN}");
    let detail = get_with(&app, &format!("/runs/{ok}"), &[("authorization", &bearer)]).await;
    assert_eq!(detail.status, StatusCode::OK);
    assert!(detail.body.contains(SECRET_OUTPUT) && detail.body.contains(SECRET_DATA), "{}", detail.body);

    // The login form: a wrong token is refused; the right one sets the cookie.
    let login = get(&app, "/login?next=%2Fruns").await;
    assert_eq!(login.status, StatusCode::OK);
    assert!(login.body.contains("name=\"token\"") && !leaks(&login.body));
    let wrong = post_form(&app, "/login", "token=nope&next=%2Fruns", &[]).await;
    assert_eq!(wrong.status, StatusCode::UNAUTHORIZED);
    assert!(wrong.headers.get("set-cookie").is_none());
    let right = post_form(&app, "/login", &format!("token={TOKEN}&next=%2Fruns"), &[]).await;
    assert_eq!(right.status, StatusCode::SEE_OTHER);
    assert_eq!(right.location(), Some("/runs"));
    let cookie = right.headers.get("set-cookie").expect("a session cookie").to_str().expect("ascii").to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    assert!(!cookie.contains(TOKEN), "the cookie is a session id, not the token");
    let session = cookie.split(';').next().expect("name=value").to_owned();
    let page = get_with(&app, &format!("/runs/{ok}"), &[("cookie", &session)]).await;
    assert_eq!(page.status, StatusCode::OK);
    assert!(page.body.contains(SECRET_OUTPUT));
    // The login page refuses to send anyone elsewhere after logging in.
    let offsite = post_form(&app, "/login", &format!("token={TOKEN}&next=%2F%2Fevil.example"), &[]).await;
    assert_eq!(offsite.location(), Some("/"));
    // Another process's session does not open this one.
    let other = router(engine.clone(), &with_token()).expect("router");
    assert_eq!(get_with(&other, "/", &[("cookie", &session)]).await.status, StatusCode::SEE_OTHER);
}

#[sqlx::test(migrations = false)]
async fn loopback_mode_hides_outputs_unless_asked(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (engine, ok, failed, _worker) = setup(&opts).await;
    let app = router(engine.clone(), &DashboardConfig::default()).expect("router");
    for path in ["/".to_owned(), "/runs".into(), format!("/runs/{ok}"), format!("/runs/{failed}"), "/functions".into()]
    {
        let page = get(&app, &path).await;
        assert_eq!(page.status, StatusCode::OK, "{path}");
        assert!(!leaks(&page.body), "{path} leaks: {}", page.body);
    }
    assert!(get(&app, &format!("/runs/{ok}")).await.body.contains("Hidden: outputs and event data"));

    let mut config = DashboardConfig::default();
    config.show_data = true;
    let shown = router(engine.clone(), &config).expect("router");
    let page = get(&shown, &format!("/runs/{ok}")).await;
    assert!(page.body.contains(SECRET_OUTPUT) && page.body.contains(SECRET_DATA), "{}", page.body);
}

#[sqlx::test(migrations = false)]
async fn posts_without_a_valid_csrf_token_are_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (engine, _ok, failed, _worker) = setup(&opts).await;
    let app = router(engine.clone(), &DashboardConfig::default()).expect("router");
    let csrf = csrf_of(&get(&app, &format!("/runs/{failed}")).await.body);
    let replay = format!("/runs/{failed}/replay");
    let same = ("origin", "http://127.0.0.1:7070");

    let refused = [
        post_form(&app, &replay, "from=failed_step", &[same]).await,
        post_form(&app, &replay, "csrf=&from=failed_step", &[same]).await,
        post_form(&app, &replay, &format!("csrf={}x&from=failed_step", csrf), &[same]).await,
        post_form(&app, &replay, &format!("csrf={}", &csrf[..csrf.len() - 1]), &[same]).await,
        // The right token, from another site's page.
        post_form(&app, &replay, &format!("csrf={csrf}"), &[("origin", "http://evil.example")]).await,
        post_form(&app, &replay, &format!("csrf={csrf}"), &[("referer", "http://127.0.0.1:7070.evil.example/x")]).await,
        // A body that is not a form.
        send(
            &app,
            axum::http::Request::post(&replay)
                .header("host", "127.0.0.1:7070")
                .header("content-type", "text/plain")
                .body(axum::body::Body::from(format!("csrf={csrf}")))
                .expect("request"),
        )
        .await,
        // Another process's token.
        post_form(
            &app,
            &replay,
            &format!(
                "csrf={}",
                csrf_of(
                    &get(
                        &router(engine.clone(), &DashboardConfig::default()).expect("router"),
                        &format!("/runs/{failed}")
                    )
                    .await
                    .body
                )
            ),
            &[same],
        )
        .await,
        post_form(&app, &format!("/runs/{failed}/cancel"), "reason=x", &[same]).await,
    ];
    for (i, r) in refused.iter().enumerate() {
        assert_eq!(r.status, StatusCode::FORBIDDEN, "request {i}: {}", r.body);
    }
    let run = engine.run(failed).await.expect("run");
    assert_eq!((run.state, run.attempt), (RunState::Failed, 1), "nothing changed: {run:?}");

    // The same request with the token is accepted (so the refusals above are the check's).
    let accepted = post_form(&app, &replay, &format!("csrf={csrf}"), &[same]).await;
    assert_eq!(accepted.status, StatusCode::SEE_OTHER, "{}", accepted.body);
    wait_for(&engine, failed, "the replay to complete", |r| r.state == RunState::Completed).await;
}
