//! Connecting: the read-only connection of the read commands, the engine of
//! the others, and the URL as it may be shown.
//!
//! The read commands connect with [`Inspector::connect`]: no migration, no
//! registration, so a role with SELECT only (the reader role of
//! docs/security.md) runs them. The CLI's engine registers no functions and
//! never migrates (only the `migrate` command does), so running it cannot
//! change the schema or the function registry by accident.
//!
//! Passwords: [`redact`] hides them in URLs (even with an unencoded `/`, `?`,
//! `#` or `@` in them) and in libpq `key=value` strings; [`Secrets`] scrubs
//! every message the CLI prints of the password itself, whatever produced it.

use durastep::Engine;
use durastep::inspect::Inspector;

use crate::error::CliError;

/// Connections the CLI needs: one command at a time, a few parallel reads.
const MAX_CONNECTIONS: u32 = 4;

/// What stands for a hidden password.
const MASK: &str = "***";

/// Builds an engine with no functions; migrates only when `migrate` is true.
pub async fn engine(url: &str, migrate: bool) -> Result<Engine, CliError> {
    // The builder opens one plain connection first, so a refused or unknown
    // host fails at once with its own cause (mapped to exit code 2 by `at`).
    Engine::builder()
        .database_url(url)
        .max_connections(MAX_CONNECTIONS)
        .migrate(migrate)
        .build()
        .await
        .map_err(|e| CliError::from(e).at(&redact(url)))
}

/// Applies the schema migrations over one connection; returns those applied.
pub async fn migrate(url: &str) -> Result<Vec<durastep::AppliedMigration>, CliError> {
    use durastep::sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    let run = async {
        let options: PgConnectOptions = url.parse().map_err(durastep::Error::from)?;
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(std::time::Duration::from_secs(10))
            .connect_with(options)
            .await
            .map_err(durastep::Error::from)?;
        let applied = durastep::migrate(&pool).await;
        pool.close().await;
        applied
    };
    run.await.map_err(|e| CliError::from(e).at(&redact(url)))
}

/// A read-only connection (no migration, no registration).
pub async fn reader(url: &str) -> Result<Inspector, CliError> {
    Inspector::connect(url).await.map_err(|e| CliError::from(e).at(&redact(url)))
}

/// The URL (or libpq `key=value` string) with its password replaced by `***`.
pub fn redact(url: &str) -> String {
    let t = url.trim();
    if t.contains("://") {
        redact_url(t)
    } else if t.contains('=') {
        redact_key_values(t)
    } else {
        t.to_owned()
    }
}

fn is_password_key(k: &str) -> bool {
    let k = k.trim();
    k.eq_ignore_ascii_case("password") || k.eq_ignore_ascii_case("sslpassword")
}

/// `scheme://user:password@host/db?password=...`. The password may hold an
/// unencoded `/`, `?`, `#` or `@`, so the userinfo ends at the *last* `@` of
/// the URL (a host never holds one); a query with an `@` is then hidden too,
/// which errs on the safe side.
fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else { return url.to_owned() };
    let (shown_rest, tail) = match rest.rfind('@') {
        Some(at) => {
            let (userinfo, after) = (&rest[..at], &rest[at + 1..]);
            let user = match userinfo.split_once(':') {
                Some((user, _password)) => format!("{user}:{MASK}"),
                None => userinfo.to_owned(),
            };
            (format!("{user}@"), after)
        }
        None => (String::new(), rest),
    };
    let tail = match tail.split_once('?') {
        Some((base, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if is_password_key(k) => format!("{k}={MASK}"),
                    _ => p.to_owned(),
                })
                .collect();
            format!("{base}?{}", params.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{shown_rest}{tail}")
}

/// One `key = value` pair of a libpq connection string, with the byte range of
/// its value (quotes included).
fn key_values(s: &str) -> Vec<(String, std::ops::Range<usize>, String)> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key_start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = s[key_start..i].to_owned();
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= b.len() || b[i] != b'=' {
            break; // not key=value any more: stop (the rest is hidden by the caller)
        }
        i += 1;
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        let value_start = i;
        let mut value = String::new();
        if i < b.len() && b[i] == b'\'' {
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                let c = s[i..].chars().next().unwrap_or(' ');
                value.push(c);
                i += c.len_utf8();
            }
            i = (i + 1).min(b.len());
        } else {
            while i < b.len() && !b[i].is_ascii_whitespace() {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                let c = s[i..].chars().next().unwrap_or(' ');
                value.push(c);
                i += c.len_utf8();
            }
        }
        out.push((key, value_start..i, value));
    }
    out
}

/// `host=db user=app password='se cr\'et' dbname=app`.
fn redact_key_values(s: &str) -> String {
    let pairs = key_values(s);
    let end = pairs.last().map_or(0, |(_, r, _)| r.end);
    let mut out = String::new();
    let mut at = 0;
    for (key, range, _) in &pairs {
        out.push_str(&s[at..range.start]);
        out.push_str(if is_password_key(key) { MASK } else { &s[range.clone()] });
        at = range.end;
    }
    // Anything that did not parse as key=value is not shown at all.
    if end < s.trim_end().len() {
        out.push_str(" ...");
    }
    out
}

/// The passwords a database URL or connection string holds (as written and
/// percent-decoded), to scrub from every message the CLI prints.
#[derive(Debug, Default, Clone)]
pub struct Secrets(Vec<String>);

impl Secrets {
    /// The passwords in `url`.
    pub fn of(url: &str) -> Secrets {
        let t = url.trim();
        let mut found = Vec::new();
        if let Some((_, rest)) = t.split_once("://") {
            if let Some(at) = rest.rfind('@')
                && let Some((_, password)) = rest[..at].split_once(':')
            {
                found.push(password.to_owned());
            }
            if let Some((_, query)) = rest.split_once('?') {
                for p in query.split('&') {
                    if let Some((k, v)) = p.split_once('=')
                        && is_password_key(k)
                    {
                        found.push(v.to_owned());
                    }
                }
            }
        } else {
            for (k, _, v) in key_values(t) {
                if is_password_key(&k) {
                    found.push(v);
                }
            }
        }
        let decoded: Vec<String> = found.iter().map(|p| percent_decode(p)).collect();
        found.extend(decoded);
        found.retain(|p| !p.is_empty());
        // Longest first, so a password that contains another is replaced whole.
        found.sort_by_key(|p| std::cmp::Reverse(p.len()));
        found.dedup();
        Secrets(found)
    }

    /// `text` with every password replaced by `***`.
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for p in &self.0 {
            out = out.replace(p.as_str(), MASK);
        }
        out
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::{Secrets, redact};

    #[test]
    fn passwords_are_hidden_and_nothing_else_changes() {
        let check = |url: &str, shown: &str| assert_eq!(redact(url), shown, "{url}");
        check("postgres://app:s3cr3t@db.internal:5432/app", "postgres://app:***@db.internal:5432/app");
        check("postgres://app:p@ss@db/app?sslmode=require", "postgres://app:***@db/app?sslmode=require");
        check("postgres://postgres@127.0.0.1:1/x", "postgres://postgres@127.0.0.1:1/x");
        check("postgres://localhost/app", "postgres://localhost/app");
        check("not a url", "not a url");
        check("postgres://db/app?user=a&password=x&sslmode=off", "postgres://db/app?user=a&password=***&sslmode=off");
    }

    /// Catches: passwords with an unencoded `/`, `?` or `#` left in the
    /// redacted URL, and libpq key=value strings printed as they are.
    #[test]
    fn passwords_with_delimiters_and_key_value_strings_are_hidden() {
        for (url, secret) in [
            ("postgres://app:pa/ss@db:5432/app", "pa/ss"),
            ("postgres://app:pa?ss@db/app", "pa?ss"),
            ("postgres://app:pa#ss@db/app", "pa#ss"),
            ("postgres://app:a/b?c#d@e@db/app?sslmode=require", "a/b?c#d@e"),
            ("postgresql://app:%2Fsecret%3F@db/app", "%2Fsecret%3F"),
        ] {
            let shown = redact(url);
            assert!(!shown.contains(secret), "{url} -> {shown}");
            assert!(shown.contains("app:***@db"), "{url} -> {shown}");
        }
        let kv = "host=db port=5432 user=app password=s3cr3t dbname=app";
        assert_eq!(redact(kv), "host=db port=5432 user=app password=*** dbname=app");
        let quoted = "host=db password = 'se cr\\'et' dbname=app";
        let shown = redact(quoted);
        assert!(!shown.contains("se cr") && !shown.contains("et'"), "{shown}");
        assert!(shown.contains("dbname=app"), "{shown}");
        assert!(!redact("host=db sslpassword=xyz").contains("xyz"));
    }

    #[test]
    fn secrets_are_scrubbed_from_any_text() {
        let s = Secrets::of("postgres://app:pa/ss%21@db/app");
        assert_eq!(s.scrub("failed: pa/ss! and pa/ss%21"), "failed: *** and ***");
        let s = Secrets::of("host=db password='a b'");
        assert_eq!(s.scrub("x a b y"), "x *** y");
        assert_eq!(Secrets::of("postgres://db/app").scrub("nothing"), "nothing");
    }
}
