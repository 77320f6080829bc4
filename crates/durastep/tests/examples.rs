//! The one-concept examples (`crates/durastep/examples`), run as a new user
//! would, with nothing answering at `DATABASE_URL`: they fall back to a
//! throwaway cluster (durastep-localpg) instead of failing to connect.

use std::path::PathBuf;

/// An example's binary: `cargo test` builds the examples next to the tests
/// (`target/<profile>/examples/`).
fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile = exe.parent().and_then(|deps| deps.parent()).expect("target/<profile>/deps/<test>");
    let bin = profile.join("examples").join(name);
    assert!(bin.is_file(), "{} is not built: run `cargo test -p durastep` (it builds the examples)", bin.display());
    bin
}

/// Catches: an example failing with "connection refused" where the README
/// promises a throwaway cluster when no Postgres answers.
#[test]
fn an_example_runs_on_a_throwaway_cluster_when_nothing_answers() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let out = std::process::Command::new(example("steps_and_retries"))
        .env("DATABASE_URL", format!("postgres://postgres@127.0.0.1:{closed}/postgres"))
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("started a throwaway PostgreSQL cluster"), "{stderr}");
    assert!(stdout.contains("on the throwaway cluster (removed at exit)"), "{stdout}");
}
