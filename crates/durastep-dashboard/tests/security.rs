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
/// The idempotency key of the failed run's event.
const SECRET_KEY: &str = "IDEM-SECRET-KEY-99";
/// Part of the failed step's error text (it quotes the event data).
const SECRET_ERROR: &str = "upstream refused account";

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
    let failed = engine
        .send(
            durastep::Event::new("campaign/budget.requested", &json!({"ad_account_id": "act_1", "note": SECRET_DATA}))
                .idempotency_key(SECRET_KEY),
        )
        .await
        .expect("send")
        .run_ids[0];
    assert_eq!(engine.wait_for_run(failed, DEADLINE).await.expect("run").state, RunState::Failed);
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
    body.contains(SECRET_OUTPUT)
        || body.contains(SECRET_DATA)
        || body.contains(SECRET_KEY)
        || body.contains(SECRET_ERROR)
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
    let (engine, ok, failed, worker) = setup(&opts).await;
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
    worker.stop().await;
}

/// Catches: `show_data` off still showing idempotency keys, flow keys and
/// error texts (which quote event data) on the run list, a run and the overview.
#[sqlx::test(migrations = false)]
async fn loopback_mode_hides_outputs_unless_asked(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (engine, ok, failed, worker) = setup(&opts).await;
    let app = router(engine.clone(), &DashboardConfig::default()).expect("router");
    for path in ["/".to_owned(), "/runs".into(), format!("/runs/{ok}"), format!("/runs/{failed}"), "/functions".into()]
    {
        let page = get(&app, &path).await;
        assert_eq!(page.status, StatusCode::OK, "{path}");
        assert!(!leaks(&page.body), "{path} leaks: {}", page.body);
    }
    assert!(get(&app, &format!("/runs/{ok}")).await.body.contains("Hidden: outputs, event data"));

    let mut config = DashboardConfig::default();
    config.show_data = true;
    let shown = router(engine.clone(), &config).expect("router");
    let page = get(&shown, &format!("/runs/{ok}")).await;
    assert!(page.body.contains(SECRET_OUTPUT) && page.body.contains(SECRET_DATA), "{}", page.body);
    let page = get(&shown, &format!("/runs/{failed}")).await;
    assert!(page.body.contains(SECRET_KEY) && page.body.contains(SECRET_ERROR), "{}", page.body);
    worker.stop().await;
}

/// Markers, each in one kind of user data only (never in event data, so a
/// page shows one only by showing that data): the error text of a run in
/// retry backoff, the concurrency key of a parked run (from its event data,
/// which is hidden anyway), an idempotency key, and a step key the new code
/// of a diverged run asked for (only its divergence error quotes it).
const BACKOFF_ERROR: &str = "BACKOFF-ERROR-SECRET-31";
const FLOW_KEY: &str = "FLOW-KEY-SECRET-58";
const IDEM_KEY: &str = "IDEM-KEY-SECRET-77";
const DIVERGED_STEP: &str = "lookup-DIVERGED-STEP-SECRET-12";

/// Catches: `show_data` off still showing a retry backoff's error text (the
/// run page's blocker `Detail` row is the run's `last_error`) and a diverged
/// run's divergence error (which quotes step keys), and any page showing a
/// flow key or an idempotency key. Every page, over a run in retry backoff, a
/// run parked on its concurrency key, the run holding that key, and a
/// diverged run: no marker with `show_data` off, each marker with it on.
#[sqlx::test(migrations = false)]
async fn show_data_off_hides_error_texts_and_keys_of_unfinished_runs(_p: PgPoolOptions, opts: PgConnectOptions) {
    let backoff = durastep::Function::new("backoff-probe")
        .on_event("backoff/go")
        .retries(3)
        .backoff(durastep::Backoff::Fixed(std::time::Duration::from_secs(3600)))
        .handler(|ctx: durastep::Ctx, _: serde_json::Value| async move {
            ctx.step("call", || async {
                Err::<(), _>(durastep::HandlerError::new(format!("HTTP 429: {BACKOFF_ERROR}")))
            })
            .await
        });
    let held = durastep::Function::new("held")
        .on_event("held/go")
        .concurrency(durastep::Concurrency::new(1).key("/account"))
        .handler(|ctx: durastep::Ctx, _: serde_json::Value| async move {
            // Holds the key's one slot until the test ends.
            ctx.step("hold", || async {
                std::future::pending::<()>().await;
                Ok(())
            })
            .await
        });
    let (engine, diverged, worker) = diverged_run(&opts, DIVERGED_STEP, vec![backoff, held]).await;

    let send = |name: &str, data: serde_json::Value, key: Option<&str>| {
        let mut event = durastep::Event::new(name, &data);
        if let Some(key) = key {
            event = event.idempotency_key(key);
        }
        let engine = engine.clone();
        async move { engine.send(event).await.expect("send").run_ids[0] }
    };
    let retrying = send("backoff/go", json!({}), Some(IDEM_KEY)).await;
    wait_for(&engine, retrying, "the first attempt to fail into its backoff", |r| {
        r.last_error.is_some() && r.state == RunState::Queued
    })
    .await;
    let holder = send("held/go", json!({"account": FLOW_KEY}), None).await;
    wait_for(&engine, holder, "the holder to run", |r| r.state == RunState::Running).await;
    let parked = send("held/go", json!({"account": FLOW_KEY}), None).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let blocker = engine.inspect().run(parked).await.expect("inspect").blocker;
        if blocker.as_ref().is_some_and(|b| b.kind == durastep::inspect::BlockerKind::Concurrency) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the second run is not parked on its key: {blocker:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let blocker = engine.inspect().run(retrying).await.expect("inspect").blocker.expect("a blocker");
    assert_eq!(blocker.kind, durastep::inspect::BlockerKind::RetryBackoff, "{blocker:?}");

    let markers = [BACKOFF_ERROR, FLOW_KEY, IDEM_KEY, DIVERGED_STEP];
    let paths = [
        "/".to_owned(),
        "/runs".into(),
        "/runs?state=queued".into(),
        "/functions".into(),
        format!("/runs/{retrying}"),
        format!("/runs/{holder}"),
        format!("/runs/{parked}"),
        format!("/runs/{diverged}"),
    ];
    let hidden = router(engine.clone(), &DashboardConfig::default()).expect("router");
    let mut leaked = Vec::new();
    for path in &paths {
        let page = get(&hidden, path).await;
        assert_eq!(page.status, StatusCode::OK, "{path}: {}", page.body);
        for marker in markers.iter().filter(|m| page.body.contains(**m)) {
            let at = page.body.find(marker).expect("found");
            let context = &page.body[at.saturating_sub(120)..(at + marker.len() + 40).min(page.body.len())];
            leaked.push(format!("{path} shows {marker}: …{context}…"));
        }
    }
    assert!(leaked.is_empty(), "show_data off, yet:\n{}", leaked.join("\n"));
    let page = get(&hidden, &format!("/runs/{diverged}")).await;
    assert!(page.body.contains("id=\"diverged\""), "the diverged state is still said: {}", page.body);

    // With show_data, each is shown where it belongs.
    let mut config = DashboardConfig::default();
    config.show_data = true;
    let shown = router(engine.clone(), &config).expect("router");
    let expected = [
        (format!("/runs/{retrying}"), BACKOFF_ERROR),
        (format!("/runs/{retrying}"), IDEM_KEY),
        ("/runs".to_owned(), IDEM_KEY),
        (format!("/runs/{parked}"), FLOW_KEY),
        ("/".to_owned(), FLOW_KEY),
        (format!("/runs/{diverged}"), DIVERGED_STEP),
    ];
    for (path, marker) in expected {
        let page = get(&shown, &path).await;
        assert!(page.body.contains(marker), "{path} does not show {marker} with show_data: {}", page.body);
    }
    worker.stop().await;
}

#[sqlx::test(migrations = false)]
async fn posts_without_a_valid_csrf_token_are_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (engine, _ok, failed, worker) = setup(&opts).await;
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
    worker.stop().await;
}

/// Catches: DNS rebinding. A page on evil.example whose name resolves to
/// 127.0.0.1 sends `Host: evil.example:7070`; its Origin equals that Host, so
/// the Origin check alone let it read pages and press Replay.
#[sqlx::test(migrations = false)]
async fn unknown_host_names_are_refused_before_any_handler(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (engine, _ok, failed, worker) = setup(&opts).await;
    let app = router(engine.clone(), &DashboardConfig::default()).expect("router");
    let csrf = csrf_of(&get(&app, &format!("/runs/{failed}")).await.body);
    let rebound = |path: &str| {
        axum::http::Request::get(path).header("host", "evil.example:7070").body(axum::body::Body::empty()).unwrap()
    };
    for path in ["/".to_owned(), "/runs".into(), format!("/runs/{failed}"), "/functions".into(), "/nope".into()] {
        let page = send(&app, rebound(&path)).await;
        assert_eq!(page.status, StatusCode::MISDIRECTED_REQUEST, "{path}");
        assert!(!page.body.contains("<html") && !leaks(&page.body), "{path}: {}", page.body);
    }
    let post = send(
        &app,
        axum::http::Request::post(format!("/runs/{failed}/replay"))
            .header("host", "evil.example:7070")
            .header("origin", "http://evil.example:7070")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(axum::body::Body::from(format!("csrf={csrf}")))
            .unwrap(),
    )
    .await;
    assert_eq!(post.status, StatusCode::MISDIRECTED_REQUEST);
    assert_eq!(engine.run(failed).await.expect("run").state, RunState::Failed, "nothing changed");
    // No Host at all is refused too.
    let bare = send(&app, axum::http::Request::get("/").body(axum::body::Body::empty()).unwrap()).await;
    assert_eq!(bare.status, StatusCode::MISDIRECTED_REQUEST);

    // The loopback names are served; another name only when allowed.
    for host in ["127.0.0.1:7070", "localhost:7070", "LOCALHOST", "[::1]:7070"] {
        let page = get_host(&app, "/", host, None).await;
        assert_eq!(page.status, StatusCode::OK, "{host}");
    }
    let mut config = with_token();
    config.allowed_hosts = vec!["dash.example.com".into()];
    let allowed = router(engine.clone(), &config).expect("router");
    let bearer = format!("Bearer {TOKEN}");
    let page = get_host(&allowed, "/", "dash.example.com", Some(&bearer)).await;
    assert_eq!(page.status, StatusCode::OK);
    let page = get_host(&allowed, "/", "evil.example", Some(&bearer)).await;
    assert_eq!(page.status, StatusCode::MISDIRECTED_REQUEST);
    // Two Host headers are ambiguous: refused.
    let two = get_with(&app, "/", &[("host", "evil.example")]).await;
    assert_eq!(two.status, StatusCode::MISDIRECTED_REQUEST);
    worker.stop().await;
}

/// GET with exactly this Host (and a bearer token when given).
async fn get_host(app: &axum::Router, path: &str, host: &str, bearer: Option<&str>) -> Page {
    let mut b = axum::http::Request::get(path).header("host", host);
    if let Some(bearer) = bearer {
        b = b.header("authorization", bearer);
    }
    send(app, b.body(axum::body::Body::empty()).unwrap()).await
}

/// The session cookie of a successful login, as `name=value`.
async fn log_in(app: &axum::Router, headers: &[(&str, &str)]) -> (String, String) {
    let right = post_form(app, "/login", &format!("token={TOKEN}&next=%2Fruns"), headers).await;
    assert_eq!(right.status, StatusCode::SEE_OTHER, "{}", right.body);
    let cookie = right.headers.get("set-cookie").expect("a session cookie").to_str().expect("ascii").to_owned();
    (cookie.split(';').next().expect("name=value").to_owned(), cookie)
}

/// Catches: one session value shared by every user for the process's life,
/// no logout, no expiry, no `Secure`/`__Host-` behind TLS, no login rate
/// limit, and `next=/%09/evil.example` redirecting off the dashboard.
#[sqlx::test(migrations = false)]
async fn sessions_are_per_login_expire_end_and_logins_are_limited(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, vec![]).await;
    let app = router(engine.clone(), &with_token()).expect("router");
    let (first, cookie) = log_in(&app, &[]).await;
    let (second, _) = log_in(&app, &[]).await;
    assert_ne!(first, second, "a new session per login");
    assert!(cookie.contains("Max-Age=43200") && cookie.contains("HttpOnly"), "{cookie}");
    assert!(!cookie.contains("Secure"), "plain HTTP: {cookie}");
    for session in [&first, &second] {
        assert_eq!(get_with(&app, "/runs", &[("cookie", session)]).await.status, StatusCode::OK);
    }

    // Log out ends that session only.
    let page = get_with(&app, "/runs", &[("cookie", &first)]).await;
    let csrf = csrf_of(&page.body);
    assert!(page.body.contains("id=\"logout\""), "a Log out button");
    let out = post_form(&app, "/logout", &format!("csrf={csrf}"), &[("cookie", &first)]).await;
    assert_eq!(out.status, StatusCode::SEE_OTHER);
    assert!(out.headers.get("set-cookie").unwrap().to_str().unwrap().contains("Max-Age=0"));
    assert_eq!(get_with(&app, "/runs", &[("cookie", &first)]).await.status, StatusCode::SEE_OTHER);
    assert_eq!(get_with(&app, "/runs", &[("cookie", &second)]).await.status, StatusCode::OK);
    let forged = post_form(&app, "/logout", "csrf=nope", &[("cookie", &second)]).await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN, "logout is CSRF-checked");

    // Sessions expire (a zero lifetime: expired as soon as made).
    let mut short = with_token();
    short.session_ttl = std::time::Duration::ZERO;
    let expiring = router(engine.clone(), &short).expect("router");
    let (session, _) = log_in(&expiring, &[]).await;
    assert_eq!(get_with(&expiring, "/runs", &[("cookie", &session)]).await.status, StatusCode::SEE_OTHER);

    // Behind TLS: Secure, and the __Host- prefix.
    let mut tls = with_token();
    tls.behind_tls = true;
    let secure = router(engine.clone(), &tls).expect("router");
    let (session, cookie) = log_in(&secure, &[]).await;
    assert!(session.starts_with("__Host-durastep_session="), "{cookie}");
    assert!(cookie.contains("; Secure") && cookie.contains("Path=/") && !cookie.contains("Domain"), "{cookie}");
    assert_eq!(get_with(&secure, "/runs", &[("cookie", &session)]).await.status, StatusCode::OK);

    // No redirect off the dashboard after logging in, however the path is dressed.
    for next in ["%2F%09%2Fevil.example", "%2F%0A%2Fevil.example", "%2F%5Cevil.example", "%2F%2Fevil.example"] {
        let r = post_form(&app, "/login", &format!("token={TOKEN}&next={next}"), &[]).await;
        assert_eq!(r.location(), Some("/"), "{next}");
    }

    // Five wrong tokens a minute, then even the right one waits.
    let limited = router(engine.clone(), &with_token()).expect("router");
    for _ in 0..5 {
        assert_eq!(post_form(&limited, "/login", "token=wrong", &[]).await.status, StatusCode::UNAUTHORIZED);
    }
    let blocked = post_form(&limited, "/login", &format!("token={TOKEN}"), &[]).await;
    assert_eq!(blocked.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(blocked.headers.get("set-cookie").is_none() && blocked.headers.get("retry-after").is_some());
}

/// Catches: a dashboard that needs the runtime role (it registered and
/// migrated at build) and offers actions it cannot perform. Served from an
/// inspector connected as the documented reader role (SELECT only), every
/// page renders, and there is no replay or cancel.
#[sqlx::test(migrations = false)]
async fn a_reader_role_serves_every_page_without_actions(_p: PgPoolOptions, opts: PgConnectOptions) {
    let (engine, ok, failed, worker) = setup(&opts).await;
    let reader = format!("durastep_reader_{}", uuid::Uuid::new_v4().simple());
    let admin = PgPoolOptions::new().max_connections(1).connect_with(opts.clone()).await.expect("admin");
    let grants = reader_grants().replace("durastep_reader", &reader);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE ROLE {reader} LOGIN; {grants}")))
        .execute(&admin)
        .await
        .expect("the reader grants of docs/security.md");
    let result = async {
        let url = format!(
            "postgres://{reader}@{}:{}/{}",
            opts.get_host(),
            opts.get_port(),
            opts.get_database().unwrap_or("postgres")
        );
        let inspector = durastep::inspect::Inspector::connect(&url).await.map_err(|e| e.to_string())?;
        let app = router(inspector, &DashboardConfig::default()).map_err(|e| e.to_string())?;
        for path in [
            "/".to_owned(),
            "/runs".into(),
            format!("/runs/{ok}"),
            format!("/runs/{failed}"),
            "/functions".into(),
            "/runs?state=failed&since=1h".into(),
        ] {
            let page = get(&app, &path).await;
            if page.status != StatusCode::OK {
                return Err(format!("{path}: {} {}", page.status, page.body));
            }
            if page.body.contains("id=\"replay\"") || page.body.contains("id=\"replay-all\"") {
                return Err(format!("{path} offers replay"));
            }
        }
        let post = post_form(&app, &format!("/runs/{failed}/replay"), "csrf=x", &[]).await;
        if post.status != StatusCode::FORBIDDEN {
            return Err(format!("replay on a read-only dashboard: {}", post.status));
        }
        Ok::<_, String>(())
    }
    .await;
    for sql in [format!("DROP OWNED BY {reader}"), format!("DROP ROLE {reader}")] {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.clone())).execute(&admin).await.expect(&sql);
    }
    result.expect("the dashboard as the reader role");
    assert_eq!(engine.run(failed).await.expect("run").state, RunState::Failed);
    worker.stop().await;
}

/// The reader role's grants: the ```sql block after the marker in docs/security.md.
fn reader_grants() -> String {
    let doc = include_str!("../../../docs/security.md");
    let (_, after) = doc.split_once("<!-- reader-grants -->").expect("marker in docs/security.md");
    let block = after.split_once("```sql\n").expect("sql block").1;
    block.split_once("```").expect("end of sql block").0.to_owned()
}

/// Every page is a maud template, which escapes what it interpolates: no page
/// builds HTML from strings, and raw output (`PreEscaped`) is the one fixed
/// style sheet in html.rs.
#[test]
fn html_is_built_by_templates_that_escape_by_default() {
    let sources = [
        ("html.rs", include_str!("../src/html.rs")),
        ("auth.rs", include_str!("../src/auth.rs")),
        ("actions.rs", include_str!("../src/actions.rs")),
        ("lib.rs", include_str!("../src/lib.rs")),
        ("pages/mod.rs", include_str!("../src/pages/mod.rs")),
        ("pages/functions.rs", include_str!("../src/pages/functions.rs")),
        ("pages/overview.rs", include_str!("../src/pages/overview.rs")),
        ("pages/run.rs", include_str!("../src/pages/run.rs")),
        ("pages/runs.rs", include_str!("../src/pages/runs.rs")),
    ];
    for (file, src) in sources {
        let raw = src.matches("PreEscaped(").count();
        let allowed = if file == "html.rs" { 1 } else { 0 };
        assert_eq!(raw, allowed, "{file}: raw HTML output outside the style sheet");
        if file == "html.rs" {
            assert!(src.contains("(PreEscaped(STYLE))"), "the one raw output is the fixed style sheet");
        }
        for handmade in ["format!(\"<", "push_str(\"<", "write!(out, \"<", "write!(body, \"<", "fn esc("] {
            assert!(!src.contains(handmade), "{file}: HTML built by hand ({handmade})");
        }
        assert!(!src.contains("esc("), "{file}: the opt-in escape helper is gone");
    }
}

/// Every response, pages and refusals alike, forbids framing and scripts.
#[sqlx::test(migrations = false)]
async fn every_response_forbids_framing_and_scripts(_p: PgPoolOptions, opts: PgConnectOptions) {
    let engine = engine(&opts, vec![]).await;
    let app = router(engine.clone(), &DashboardConfig::default()).expect("router");
    for path in ["/", "/runs", "/functions", "/no-such-page"] {
        let page = get(&app, path).await;
        let header = |name: &str| page.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        let csp = header("content-security-policy");
        assert!(csp.contains("frame-ancestors 'none'") && csp.contains("default-src 'none'"), "{path}: {csp}");
        assert!(!csp.contains("script-src"), "{path}: no script source is allowed: {csp}");
        assert_eq!(header("x-frame-options"), "DENY", "{path}");
        assert_eq!(header("x-content-type-options"), "nosniff", "{path}");
    }
}
