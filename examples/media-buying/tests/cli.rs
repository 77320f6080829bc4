//! The binary's command line: a typo in a flag is an error, never silently ignored.

/// Catches: `--meta-shadw` (a typo of `--meta-shadow`) accepted and ignored,
/// which left shadow mode off without a word.
#[test]
fn an_unknown_flag_fails_and_names_the_flag() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_media-buying"))
        .args(["worker", "--database-url", "postgres://127.0.0.1:1/x", "--meta", "http://127.0.0.1:1"])
        .args(["--tiktok", "http://127.0.0.1:1", "--linkedin", "http://127.0.0.1:1", "--chat", "http://127.0.0.1:1"])
        .arg("--meta-shadw")
        .output()
        .expect("run media-buying");
    assert!(!out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--meta-shadw"), "{stderr}");
    assert!(stderr.contains("--meta-shadow"), "clap suggests the flag that exists: {stderr}");
}
