//! Parsing the values of arguments: run ids, states, times, durations, keys.
//!
//! Each parser returns a one-line message a person can act on.

use std::time::Duration;

use chrono::{DateTime, Utc};
use durastep::RunState;
use serde_json::Value;
use uuid::Uuid;

/// A run id (a UUID).
pub fn run_id(s: &str) -> Result<Uuid, String> {
    Uuid::parse_str(s.trim())
        .map_err(|_| format!("{s:?} is not a run id (a UUID like 67e55044-10b1-426f-9247-bb680e5fe0c8)"))
}

/// A state name: `queued`, `running`, ... `skipped`.
pub fn state(s: &str) -> Result<RunState, String> {
    s.trim().to_ascii_lowercase().parse().map_err(|e: durastep::ParseRunStateError| e.to_string())
}

/// A length of time: a number and a unit, `90s`, `30m`, `2h`, `7d`, `2w`.
pub fn duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration; write a number and a unit: 90s, 30m, 2h, 7d, 2w");
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (n, unit) = t.split_at(split);
    let n: u64 = n.parse().map_err(|_| bad())?;
    let unit_secs: u64 = match unit.trim() {
        "s" | "sec" | "secs" => 1,
        "m" | "min" | "mins" => 60,
        "h" | "hour" | "hours" => 3_600,
        "d" | "day" | "days" => 86_400,
        "w" | "week" | "weeks" => 7 * 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(unit_secs).map(Duration::from_secs).ok_or_else(bad)
}

/// A point in time as given: RFC 3339, or a time ago to be resolved on the
/// database clock (the clock the runs' times are written by).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeArg {
    /// An absolute time.
    At(DateTime<Utc>),
    /// This long before the database's now.
    Ago(Duration),
}

impl TimeArg {
    /// The time, with `db_now` the database clock's now.
    pub fn resolve(self, db_now: DateTime<Utc>) -> DateTime<Utc> {
        match self {
            TimeArg::At(t) => t,
            TimeArg::Ago(d) => chrono::Duration::from_std(d)
                .ok()
                .and_then(|d| db_now.checked_sub_signed(d))
                .unwrap_or(DateTime::<Utc>::MIN_UTC),
        }
    }
}

/// A point in time: RFC 3339 (`2026-12-01T09:00:00Z`), or relative to the
/// database's now (`2h`, `30m ago`, `7d ago`).
pub fn time(s: &str) -> Result<TimeArg, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s.trim()) {
        return Ok(TimeArg::At(t.with_timezone(&Utc)));
    }
    let relative = s.trim().strip_suffix("ago").unwrap_or(s).trim();
    duration(relative).map(TimeArg::Ago).map_err(|_| {
        format!("{s:?} is not a time; write RFC 3339 (2026-12-01T09:00:00Z) or a time ago (2h, 30m ago, 7d ago)")
    })
}

/// A listen address: `HOST:PORT`, where HOST may be `localhost` (127.0.0.1).
pub fn listen_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    let t = s.trim();
    let t = match t.strip_prefix("localhost:") {
        Some(port) => format!("127.0.0.1:{port}"),
        None => t.to_owned(),
    };
    t.parse().map_err(|_| {
        format!("{s:?} is not an address to listen on; write HOST:PORT, like 127.0.0.1:7070 or localhost:7070")
    })
}

#[cfg(test)]
fn time_at(s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    time(s).map(|t| t.resolve(now))
}

/// `POINTER=VALUE` for event data: VALUE is JSON when it parses as JSON
/// (`4711`, `true`, `"4711"`), a string otherwise (`acme`).
pub fn key(s: &str) -> Result<(String, Value), String> {
    let (pointer, value) =
        s.split_once('=').ok_or_else(|| format!("{s:?} is not POINTER=VALUE (for example /account=acme)"))?;
    if !pointer.starts_with('/') {
        return Err(format!("{pointer:?} is not a JSON pointer; it starts with / (for example /account)"));
    }
    let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()));
    Ok((pointer.to_owned(), value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn durations_and_relative_times() {
        assert_eq!(duration("90s"), Ok(Duration::from_secs(90)));
        assert_eq!(duration("30d"), Ok(Duration::from_secs(30 * 86_400)));
        assert_eq!(duration("2 h"), Ok(Duration::from_secs(7_200)));
        for bad in ["", "h", "2", "2y", "-3d", "99999999999999999999w"] {
            assert!(duration(bad).is_err(), "{bad:?}");
        }
        let now = DateTime::parse_from_rfc3339("2026-12-02T12:00:00Z").unwrap().with_timezone(&Utc);
        let at = |s| time_at(s, now).map(crate::format::time);
        assert_eq!(at("2h ago").as_deref(), Ok("2026-12-02T10:00:00Z"));
        assert_eq!(at("30m").as_deref(), Ok("2026-12-02T11:30:00Z"));
        assert_eq!(at("2026-12-01T09:00:00+01:00").as_deref(), Ok("2026-12-01T08:00:00Z"));
        assert!(at("yesterday").is_err());
    }

    #[test]
    fn states_keys_and_ids() {
        assert_eq!(state("Failed"), Ok(RunState::Failed));
        assert!(state("dead").unwrap_err().contains("queued, running"));
        assert_eq!(key("/account=acme"), Ok(("/account".into(), json!("acme"))));
        assert_eq!(key("/contact_id=4711"), Ok(("/contact_id".into(), json!(4711))));
        assert_eq!(key("/contact_id=\"4711\""), Ok(("/contact_id".into(), json!("4711"))));
        assert_eq!(key("/a=b=c"), Ok(("/a".into(), json!("b=c"))));
        assert!(key("account=acme").is_err());
        assert!(key("/account").is_err());
        assert!(run_id("nope").is_err());
    }

    #[test]
    fn listen_addresses() {
        assert_eq!(listen_addr("localhost:8080"), Ok("127.0.0.1:8080".parse().unwrap()));
        assert_eq!(listen_addr("[::1]:80"), Ok("[::1]:80".parse().unwrap()));
        assert!(listen_addr("localhost").is_err());
        assert!(listen_addr("example.com:80").is_err());
    }
}
