//! The embedded default: with nothing answering at a local address,
//! `LocalDatabase::resolve` starts a throwaway cluster from the installed
//! binaries, and dropping the handle removes it.

use std::time::Duration;

use durastep_localpg::LocalDatabase;
use sqlx::Connection;

/// A local port nothing listens on (bound, then released).
fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// A URL to a closed local port falls back to a throwaway cluster holding the
/// URL's database; dropping the handle stops the server and removes its directory.
#[tokio::test]
async fn a_closed_local_port_falls_back_to_a_throwaway_cluster_removed_at_drop() {
    let asked = format!("postgres://postgres@127.0.0.1:{}/shop_dev", closed_port());
    let db = LocalDatabase::resolve(&asked).await.unwrap();
    let cluster = db.cluster().expect("a throwaway cluster");
    assert_ne!(db.url(), asked);
    assert!(db.url().ends_with("/shop_dev"), "{}", db.url());
    let notice = db.notice().unwrap();
    assert!(notice.contains(db.url()) && notice.contains("removed at exit"), "{notice}");
    let dir = cluster.dir().to_owned();
    let port = cluster.port();
    assert!(dir.join("data").is_dir());

    let mut conn = sqlx::PgConnection::connect(db.url()).await.unwrap();
    let name: String = sqlx::query_scalar("SELECT current_database()").fetch_one(&mut conn).await.unwrap();
    assert_eq!(name, "shop_dev");
    conn.close().await.unwrap();

    drop(db);
    assert!(!dir.exists(), "{} is still there", dir.display());
    let refused =
        tokio::time::timeout(Duration::from_secs(5), tokio::net::TcpStream::connect(("127.0.0.1", port))).await;
    assert!(matches!(refused, Ok(Err(_))), "the throwaway server still answers on {port}");
}

/// A URL where a server answers is used as given: no cluster is started.
#[tokio::test]
async fn an_answering_server_is_used_as_given() {
    let url = durastep_localpg::database_url();
    let db = LocalDatabase::resolve(&url).await.unwrap();
    assert!(db.cluster().is_none(), "the test server at {url} should answer");
    assert_eq!(db.url(), url);
    assert!(db.notice().is_none());
}

/// A remote host that does not answer is not replaced by a local cluster.
#[tokio::test]
async fn a_remote_host_is_never_replaced() {
    let db = LocalDatabase::resolve("postgres://app@192.0.2.1:5432/app").await.unwrap();
    assert!(db.cluster().is_none());
}
