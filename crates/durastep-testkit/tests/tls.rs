//! TLS to Postgres: a throwaway cluster of the test's own with `ssl = on` and
//! a certificate the test makes (the `openssl` command line tool), reached
//! with `sslmode` require, verify-ca and verify-full through the library.
//!
//! Catches: sqlx was built without TLS, so `sslmode=require` failed ("TLS
//! upgrade required by connect options but SQLx was built without TLS
//! support") and managed Postgres services were out of reach for the library,
//! the CLI and the dashboard (which take the same URLs).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use durastep::{Ctx, Engine, Event, Function, RunState};
use durastep_testkit::pg::{StartOptions, TempPostgres};
use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").args(args).current_dir(dir).output().expect("the openssl command line tool");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA, and a server certificate it signs for `localhost` only (no IP
/// address), so verify-full to 127.0.0.1 must fail while verify-ca passes.
fn make_certs(dir: &Path) {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    for ca in ["ca", "other-ca"] {
        let (key, crt, subj) = (format!("{ca}.key"), format!("{ca}.crt"), format!("/CN=durastep test {ca}"));
        let mut args = vec!["req", "-x509"];
        args.extend(ec);
        args.extend(["-keyout", &key, "-out", &crt, "-days", "2", "-subj", &subj]);
        args.extend([
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        openssl(dir, &args);
    }
    let mut args = vec!["req"];
    args.extend(ec);
    args.extend(["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]);
    openssl(dir, &args);
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
}

async fn connect(url: &str) -> Result<PgConnection, sqlx::Error> {
    let options: PgConnectOptions = url.parse()?;
    tokio::time::timeout(Duration::from_secs(30), PgConnection::connect_with(&options))
        .await
        .unwrap_or_else(|_| Err(sqlx::Error::PoolTimedOut))
}

async fn uses_tls(url: &str) -> bool {
    let mut conn = connect(url).await.unwrap_or_else(|e| panic!("{url}: {e}"));
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetch_one(&mut conn).await.unwrap()
}

#[tokio::test]
async fn sslmode_require_verify_ca_and_verify_full_against_a_tls_cluster() {
    let certs = std::env::temp_dir().join(format!("durastep-tls-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&certs).unwrap();
    make_certs(&certs);
    let read = |name: &str| std::fs::read(certs.join(name)).unwrap();
    let options = StartOptions::default()
        .conf("ssl = on")
        .conf("ssl_cert_file = 'server.crt'")
        .conf("ssl_key_file = 'server.key'")
        .file("server.crt", read("server.crt"))
        .file("server.key", read("server.key"));
    let pg = TempPostgres::start_with(&options).await.unwrap();
    let port = pg.port();
    let ca = certs.join("ca.crt").display().to_string();
    let other_ca = certs.join("other-ca.crt").display().to_string();
    let url = |host: &str, query: &str| format!("postgres://postgres@{host}:{port}/postgres?{query}");

    // require: encrypted, no certificate check.
    assert!(uses_tls(&url("127.0.0.1", "sslmode=require")).await);
    // verify-ca: the chain must lead to the given root; the host name is not checked.
    assert!(uses_tls(&url("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={ca}"))).await);
    let wrong_root = connect(&url("127.0.0.1", &format!("sslmode=verify-ca&sslrootcert={other_ca}"))).await;
    assert!(wrong_root.is_err(), "a server certificate from another CA was accepted");
    // verify-full: the root and the host name.
    let full = url("localhost", &format!("sslmode=verify-full&sslrootcert={ca}"));
    assert!(uses_tls(&full).await);
    let wrong_name = connect(&url("127.0.0.1", &format!("sslmode=verify-full&sslrootcert={ca}"))).await;
    assert!(wrong_name.is_err(), "verify-full accepted a certificate for another host name");
    // Without a root certificate, verify-full checks against the public roots: refused.
    let no_root = connect(&url("localhost", "sslmode=verify-full")).await;
    assert!(no_root.is_err(), "a private CA was trusted without sslrootcert");

    // The library over verify-full: migrate, register, send, run a step.
    let engine = Engine::builder()
        .database_url(full.as_str())
        .function(Function::new("tls-echo").on_event("tls/ping").retries(0).handler(|ctx: Ctx, n: u32| async move {
            let doubled: u32 = ctx.step("double", || async move { Ok(n * 2) }).await?;
            Ok(doubled)
        }))
        .build()
        .await
        .unwrap();
    let receipt = engine.send(Event::new("tls/ping", &21u32)).await.unwrap();
    let worker = engine.spawn_worker();
    let run = engine.wait_for_run(receipt.run_ids[0], Duration::from_secs(60)).await.unwrap();
    worker.stop().await.unwrap();
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert_eq!(run.output, Some(serde_json::json!(42)));
    let _ = std::fs::remove_dir_all(&certs);
}
