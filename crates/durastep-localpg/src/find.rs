//! Finding the installed server binaries (`initdb`, `pg_ctl`).

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// Environment variable naming the directory of `initdb` and `pg_ctl`; it
/// wins over every other place.
///
/// ```
/// assert_eq!(durastep_localpg::PG_BIN_ENV, "DURASTEP_PG_BIN");
/// ```
pub const PG_BIN_ENV: &str = "DURASTEP_PG_BIN";

fn has_tools(dir: &Path) -> bool {
    dir.join("initdb").is_file() && dir.join("pg_ctl").is_file()
}

/// The directory of the installed `initdb` and `pg_ctl`, looked for in this
/// order: [`PG_BIN_ENV`]; `PATH`; `pg_config --bindir`; the newest
/// `/usr/lib/postgresql/*/bin` (Debian, Ubuntu); `/usr/pgsql-*/bin` (RHEL);
/// `/usr/local/pgsql/bin` (built from source); Homebrew's
/// `/opt/homebrew/opt/postgresql*/bin` and `/usr/local/opt/postgresql*/bin`.
/// `Ok(None)` when there are none; an error when [`PG_BIN_ENV`] names a
/// directory without them.
///
/// ```
/// // Some(dir) on a machine with Postgres installed, None elsewhere.
/// let found = durastep_localpg::find_bin_dir().unwrap_or(None);
/// # let _ = found;
/// ```
pub fn find_bin_dir() -> Result<Option<PathBuf>> {
    if let Some(dir) = std::env::var_os(PG_BIN_ENV).filter(|d| !d.is_empty()) {
        let dir = PathBuf::from(dir);
        return if has_tools(&dir) { Ok(Some(dir)) } else { Err(Error::BadBinDir { dir: dir.display().to_string() }) };
    }
    if let Some(path) = std::env::var_os("PATH")
        && let Some(dir) = std::env::split_paths(&path).find(|d| has_tools(d))
    {
        return Ok(Some(real_dir(dir)));
    }
    if let Ok(out) = std::process::Command::new("pg_config").arg("--bindir").output()
        && out.status.success()
    {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if has_tools(&dir) {
            return Ok(Some(dir));
        }
    }
    for pattern in ["/usr/lib/postgresql", "/usr", "/opt/homebrew/opt", "/usr/local/opt"] {
        if let Some(dir) = newest_versioned(Path::new(pattern)) {
            return Ok(Some(dir));
        }
    }
    let source_build = Path::new("/usr/local/pgsql/bin");
    Ok(has_tools(source_build).then(|| source_build.to_owned()))
}

/// The directory `initdb` really lives in, when `dir` holds a symlink to it
/// (`/usr/local/bin/initdb -> /usr/lib/postgresql/15/bin/initdb`): the other
/// tools (`createdb`) are there.
fn real_dir(dir: PathBuf) -> PathBuf {
    match std::fs::canonicalize(dir.join("initdb")) {
        Ok(real) => match real.parent() {
            Some(parent) if has_tools(parent) => parent.to_owned(),
            _ => dir,
        },
        Err(_) => dir,
    }
}

/// In `/usr/lib/postgresql`, the `<version>/bin` with the highest version; in
/// the other folders, `pgsql-<version>/bin` or `postgresql[@<version>]/bin`.
fn newest_versioned(parent: &Path) -> Option<PathBuf> {
    let entries = std::fs::read_dir(parent).ok()?;
    let mut found: Vec<(u32, PathBuf)> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let version = if parent.ends_with("postgresql") {
                name.split('.').next()?.parse::<u32>().ok()?
            } else if let Some(v) = name.strip_prefix("pgsql-") {
                v.split('.').next()?.parse::<u32>().ok()?
            } else if let Some(v) = name.strip_prefix("postgresql") {
                v.trim_start_matches('@')
                    .split('.')
                    .next()
                    .filter(|v| !v.is_empty())
                    .map_or(Some(0), |v| v.parse().ok())?
            } else {
                return None;
            };
            let bin = e.path().join("bin");
            has_tools(&bin).then_some((version, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, dir)| dir)
}
