//! With nothing answering at `DATABASE_URL`, the example runs on a throwaway
//! cluster (durastep-localpg) instead of failing to connect.

use std::time::Duration;

/// A local port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Catches: the example failing with "cannot reach Postgres" where the
/// README promises a throwaway cluster.
#[tokio::test]
async fn runs_on_a_throwaway_cluster_when_nothing_answers() {
    let out = tokio::time::timeout(
        Duration::from_secs(180),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_prometheus-example"))
            .env("DATABASE_URL", format!("postgres://postgres@127.0.0.1:{}/postgres", closed_port()))
            .env("METRICS_ADDR", format!("127.0.0.1:{}", closed_port()))
            .output(),
    )
    .await
    .expect("the example finishes in time")
    .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("started a throwaway PostgreSQL cluster"), "{stderr}");
    assert!(stdout.contains("--- durastep lines of the scrape"), "{stdout}");
}
