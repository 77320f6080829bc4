//! The command line: a typo in a flag is an error, never silently ignored.

/// Catches: `--serv` (a typo of `--serve`) accepted and ignored, so the
/// program scraped once and exited instead of serving; and an unknown flag
/// noticed only after the exporter and the database were set up.
#[test]
fn an_unknown_flag_fails_and_names_the_flag() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_prometheus-example"))
        .arg("--serv")
        // Nothing may be reached: the command line is refused first.
        .env("DATABASE_URL", "postgres://postgres@127.0.0.1:1/postgres")
        .output()
        .expect("run prometheus-example");
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("unexpected argument '--serv'"), "{stderr}");
    assert!(stderr.contains("--serve"), "clap suggests the flag that exists: {stderr}");
    assert!(out.stdout.is_empty(), "nothing started: {}", String::from_utf8_lossy(&out.stdout));
}

/// `--help` names both flags and exits 0 without starting anything.
#[test]
fn help_lists_the_flags() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_prometheus-example"))
        .arg("--help")
        .output()
        .expect("run prometheus-example");
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("--serve") && stdout.contains("--metrics-addr"), "{stdout}");
}
