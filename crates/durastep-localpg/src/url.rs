//! The few parts of a `postgres://` URL this crate needs.

use crate::{Error, Result};

/// Host, port and database of a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Parts {
    pub host: String,
    pub port: u16,
    pub database: String,
}

impl Parts {
    /// Reads `postgres[ql]://[user[:password]@]host[:port][/database][?params]`;
    /// a missing host is a Unix socket (local), a missing port 5432, a missing database `postgres`.
    pub fn parse(url: &str) -> Result<Parts> {
        let rest = url
            .strip_prefix("postgres://")
            .or_else(|| url.strip_prefix("postgresql://"))
            .ok_or_else(|| Error::BadUrl(url.to_owned()))?;
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) => rest.split_at(i),
            None => (rest, ""),
        };
        let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
        let (host, port) = match hostport.rsplit_once(':') {
            Some((h, p)) if !p.contains(']') => {
                (h.to_owned(), p.parse::<u16>().map_err(|_| Error::BadUrl(url.to_owned()))?)
            }
            _ => (hostport.to_owned(), 5432),
        };
        let database = path.strip_prefix('/').unwrap_or("").split('?').next().unwrap_or("");
        let database = if database.is_empty() { "postgres".to_owned() } else { database.to_owned() };
        if !database.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
            return Err(Error::BadUrl(url.to_owned()));
        }
        let host = if host.is_empty() { "localhost".to_owned() } else { host };
        Ok(Parts { host, port, database })
    }

    /// Whether the host is this machine.
    pub fn is_local(&self) -> bool {
        matches!(self.host.as_str(), "localhost" | "127.0.0.1" | "[::1]" | "::1") || self.host.starts_with("127.")
    }

    /// `host:port`, for messages.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

#[cfg(test)]
mod tests {
    use super::Parts;

    #[test]
    fn reads_the_parts_that_matter() {
        let p = Parts::parse("postgres://postgres@127.0.0.1:5432/postgres").unwrap();
        assert_eq!((p.host.as_str(), p.port, p.database.as_str()), ("127.0.0.1", 5432, "postgres"));
        let p = Parts::parse("postgresql://app:s3cr3t@localhost/app_db?sslmode=disable").unwrap();
        assert_eq!((p.host.as_str(), p.port, p.database.as_str()), ("localhost", 5432, "app_db"));
        assert!(p.is_local());
        let p = Parts::parse("postgres://u@db.internal:6543").unwrap();
        assert_eq!((p.port, p.database.as_str()), (6543, "postgres"));
        assert!(!p.is_local());
        let p = Parts::parse("postgres://u@[::1]:5433/x").unwrap();
        assert_eq!((p.host.as_str(), p.port), ("[::1]", 5433));
        assert!(p.is_local());
        assert!(Parts::parse("mysql://x").is_err());
        assert!(Parts::parse("postgres://h:notaport/x").is_err());
        assert!(Parts::parse("postgres://h/x;drop").is_err());
    }
}
