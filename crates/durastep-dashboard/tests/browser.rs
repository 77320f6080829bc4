//! A real headless Chromium against the dashboard, driven through chromedriver
//! (WebDriver): load the overview, follow the link to a failed run, press
//! Replay, and reload the run's page until it shows completed.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`scripts/install-browser.sh`);
//! other paths through `DURASTEP_CHROMIUM` and `DURASTEP_CHROMEDRIVER`. Without
//! them the test fails when `CI` is set, and is skipped with a notice otherwise.
mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use durastep::RunState;
use durastep_dashboard::{DashboardConfig, router};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio_util::sync::CancellationToken;

fn tool(var: &str, default: &str) -> PathBuf {
    std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| PathBuf::from(default))
}

/// Chromium and chromedriver, or None (after failing under CI) when missing.
fn browser() -> Option<(PathBuf, PathBuf)> {
    let chromium = tool("DURASTEP_CHROMIUM", "/usr/bin/chromium");
    let driver = tool("DURASTEP_CHROMEDRIVER", "/usr/bin/chromedriver");
    if chromium.exists() && driver.exists() {
        return Some((chromium, driver));
    }
    let missing = format!(
        "headless browser missing ({} or {}): run scripts/install-browser.sh",
        chromium.display(),
        driver.display()
    );
    assert!(std::env::var_os("CI").is_none(), "{missing}");
    eprintln!("SKIPPED browser test: {missing}");
    None
}

/// A fresh profile directory, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("durastep-chromium-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("profile dir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Starts chromedriver on a free port and waits (bounded) until it accepts connections.
async fn start_driver(driver: &PathBuf) -> (tokio::process::Child, u16) {
    let port = std::net::TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
    let child = tokio::process::Command::new(driver)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start chromedriver");
    let deadline = Instant::now() + DEADLINE;
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(Instant::now() < deadline, "chromedriver did not listen on {port} within {DEADLINE:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    (child, port)
}

async fn connect(chromium: &PathBuf, port: u16, profile: &TempDir) -> Client {
    let args = [
        "--headless".to_owned(),
        "--no-sandbox".into(),
        "--disable-gpu".into(),
        "--disable-quic".into(),
        "--no-first-run".into(),
        "--disable-background-networking".into(),
        "--disable-component-update".into(),
        "--disable-sync".into(),
        "--disable-dev-shm-usage".into(),
        format!("--user-data-dir={}", profile.0.display()),
    ];
    let mut caps = serde_json::Map::new();
    caps.insert("browserName".into(), json!("chrome"));
    caps.insert("goog:chromeOptions".into(), json!({ "binary": chromium, "args": args }));
    ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a WebDriver session with headless Chromium")
}

/// Reloads the page until the run's state cell reads `want`; fails after [`DEADLINE`].
async fn reload_until_state(client: &Client, want: &str) {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let state = client.find(Locator::Id("state")).await.expect("the state cell").text().await.expect("text");
        if state.trim() == want {
            return;
        }
        assert!(Instant::now() < deadline, "the run page still says {state:?}, not {want:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        client.refresh().await.expect("reload");
    }
}

#[sqlx::test(migrations = false)]
async fn replay_a_failed_run_in_a_real_browser(_p: PgPoolOptions, opts: PgConnectOptions) {
    let Some((chromium, driver)) = browser() else { return };
    let started = Instant::now();

    let broken = Arc::new(AtomicBool::new(true));
    let engine = engine(&opts, vec![budget_push(broken.clone())]).await;
    let worker = spawn_worker(&engine);
    let id = failed_run(&engine, json!({"ad_account_id": "act_7"})).await;
    broken.store(false, Ordering::SeqCst);

    let app = router(engine.clone(), &DashboardConfig::default()).expect("router");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let stop = CancellationToken::new();
    let server =
        tokio::spawn(axum::serve(listener, app).with_graceful_shutdown(stop.clone().cancelled_owned()).into_future());

    let profile = TempDir::new();
    let (mut driver, port) = start_driver(&driver).await;
    let client = connect(&chromium, port, &profile).await;
    let c = client.clone();
    let (client_ref, base_ref) = (c, base.clone());
    let browse = tokio::spawn(async move {
        let client = client_ref;
        let base = base_ref;
        client.goto(&format!("{base}/")).await.expect("open the overview");
        let title = client.title().await.expect("title");
        assert_eq!(title, "Overview · Durastep");
        let link =
            client.find(Locator::Css(&format!("a.run[href='/runs/{id}']"))).await.expect("a link to the failed run");
        link.click().await.expect("follow it");
        let url = client.current_url().await.expect("url");
        assert_eq!(url.path(), format!("/runs/{id}"));
        reload_until_state(&client, "failed").await;
        client.find(Locator::Id("replay")).await.expect("the Replay button").click().await.expect("press Replay");
        let deadline = Instant::now() + DEADLINE;
        loop {
            let url = client.current_url().await.expect("url");
            if url.query() == Some("done=replayed") {
                assert_eq!(url.path(), format!("/runs/{id}"), "back on the run's page");
                break;
            }
            assert!(Instant::now() < deadline, "the replay did not redirect back: {url}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        reload_until_state(&client, "completed").await;
        let page = client.source().await.expect("page source");
        assert!(page.contains("<td>push</td>"), "the step timeline shows the push step");
    });
    // Whatever happened in the browser, end the session and the driver first.
    let outcome = browse.await;
    let closed = client.close().await;
    driver.kill().await.expect("stop chromedriver");
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic.into_panic());
    }
    closed.expect("end the session");
    stop.cancel();
    server.await.expect("server task").expect("server");

    let run = engine.run(id).await.expect("run");
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    eprintln!("browser test took {:.2} s", started.elapsed().as_secs_f64());
    worker.stop().await;
}
