//! Connecting: the engine the CLI works through, and the URL as it may be shown.
//!
//! The CLI's engine registers no functions and never migrates (only the
//! `migrate` command does), so running it cannot change the schema or the
//! function registry by accident.

use durastep::Engine;

use crate::error::CliError;

/// Connections the CLI needs: one command at a time, a few parallel reads.
const MAX_CONNECTIONS: u32 = 4;

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

/// The URL with its password (in the userinfo or a `password=` parameter)
/// replaced by `***`, for messages.
pub fn redact(url: &str) -> String {
    let url = redact_userinfo(url);
    match url.split_once('?') {
        Some((base, query)) => {
            let params: Vec<String> = query
                .split('&')
                .map(|p| match p.split_once('=') {
                    Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                    _ => p.to_owned(),
                })
                .collect();
            format!("{base}?{}", params.join("&"))
        }
        None => url,
    }
}

fn redact_userinfo(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The authority ends at the first '/', '?' or '#'; its userinfo at its last '@'.
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{scheme}://{user}:***@{host}{tail}"),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

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
}
