//! Flow control definitions: concurrency limits, throttles, rate limits and
//! back-pressure (enforced in the claim statement), debounce, singleton and
//! priority from the event (applied when an event is sent).
//!
//! Architecture invariant: keys are values, never SQL. A key is a JSON pointer
//! (RFC 6901) into the event data, checked here at build and sent to Postgres as
//! a `text[]` path bind parameter; the key's value is read in SQL with `#>`.
//! No advisory locks: every limit's state is a row of `durastep.flow_keys` that
//! the claim locks `FOR UPDATE SKIP LOCKED` (see `store::claim_runnable`).

use std::time::Duration;

use crate::error::Error;
use crate::limits::{self, Limits};

/// How many back-pressure retries a run gets without them counting as attempts.
/// After that many pauses, a further 429 counts like any retryable failure, so
/// a key that never recovers still ends its runs.
///
/// ```
/// assert_eq!(durastep::BACKPRESSURE_FREE_RETRIES, 50);
/// ```
pub const BACKPRESSURE_FREE_RETRIES: i32 = 50;

/// How long a run parked on a full concurrency key waits at most before it is
/// looked at again, even if no slot release wakes it (a safety net, like polling
/// is for NOTIFY; releases wake parked runs at once).
pub(crate) const PARK_RECHECK: Duration = Duration::from_secs(30);

/// The kinds of claim-time rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Concurrency,
    Throttle,
    RateLimit,
    Backpressure,
}

impl Kind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Concurrency => "concurrency",
            Kind::Throttle => "throttle",
            Kind::RateLimit => "rate_limit",
            Kind::Backpressure => "backpressure",
        }
    }
}

/// One claim-time rule of a function, as written in the builder.
#[derive(Debug, Clone)]
pub(crate) struct Rule {
    /// A shared name, or None: named after the function.
    pub shared: Option<String>,
    pub kind: Kind,
    pub capacity: u32,
    pub period: Duration,
    pub burst: u32,
    /// JSON pointer into the event data; None: one key for the whole function.
    pub key: Option<String>,
}

/// What happens when an event arrives for a singleton key that already has an
/// active (queued, running, sleeping or waiting) run.
///
/// ```
/// use durastep::{Function, SingletonMode};
/// let f = Function::new("sync-contact")
///     .on_event("contact/changed")
///     .singleton(Some("/contact_id"), SingletonMode::SkipNew)
///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
/// # let _ = f;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SingletonMode {
    /// The new event's run is recorded as `skipped` (with the active run's id in
    /// its `last_error`); the active run goes on.
    SkipNew,
    /// The active run is cancelled (a running attempt is dropped at its worker's
    /// next heartbeat and can write nothing more) and the new run starts.
    CancelOld,
}

impl SingletonMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SingletonMode::SkipNew => "skip_new",
            SingletonMode::CancelOld => "cancel_old",
        }
    }
}

/// Debounce settings of a function.
#[derive(Debug, Clone)]
pub(crate) struct Debounce {
    pub period: Duration,
    pub key: Option<String>,
    pub max_wait: Duration,
}

/// Every flow setting of one function.
#[derive(Debug, Clone, Default)]
pub(crate) struct FlowConfig {
    pub rules: Vec<Rule>,
    pub debounce: Option<Debounce>,
    pub singleton: Option<(Option<String>, SingletonMode)>,
    pub priority_from: Option<String>,
}

impl FlowConfig {
    pub(crate) fn has_backpressure(&self) -> bool {
        self.rules.iter().any(|r| r.kind == Kind::Backpressure)
    }

    /// Every key pointer an event must carry for this function: its value is
    /// required at send.
    pub(crate) fn required_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.rules.iter().filter_map(|r| r.key.clone()).collect();
        keys.extend(self.debounce.as_ref().and_then(|d| d.key.clone()));
        keys.extend(self.singleton.as_ref().and_then(|s| s.0.clone()));
        keys.sort();
        keys.dedup();
        keys
    }
}

/// A rule as stored in `durastep.flow_rules`, plus the function's key path.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StoredRule {
    pub name: String,
    pub kind: Kind,
    pub capacity: i32,
    pub period_s: f64,
    pub burst: i32,
    pub pointer: Option<String>,
    pub path: Option<Vec<String>>,
}

/// Parses a JSON pointer (RFC 6901: `""` is refused here, since the whole event
/// as a key is almost always a mistake) into the path `jsonb #>` takes.
///
/// ```
/// assert_eq!(durastep::flow::parse_pointer("/ad_account_id").unwrap(), vec!["ad_account_id"]);
/// assert_eq!(durastep::flow::parse_pointer("/a~1b/~0c/0").unwrap(), vec!["a/b", "~c", "0"]);
/// assert!(durastep::flow::parse_pointer("ad_account_id").is_err());
/// assert!(durastep::flow::parse_pointer("/a~2").is_err());
/// ```
pub fn parse_pointer(pointer: &str) -> Result<Vec<String>, String> {
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(format!("key {pointer:?} is not a JSON pointer: it must start with '/' (e.g. \"/account_id\")"));
    };
    rest.split('/')
        .map(|token| {
            let mut out = String::with_capacity(token.len());
            let mut chars = token.chars();
            while let Some(c) = chars.next() {
                match c {
                    '~' => match chars.next() {
                        Some('0') => out.push('~'),
                        Some('1') => out.push('/'),
                        _ => return Err(format!("key {pointer:?}: '~' must be followed by 0 or 1 (RFC 6901)")),
                    },
                    '\0' => return Err(format!("key {pointer:?} holds a NUL character")),
                    c => out.push(c),
                }
            }
            Ok(out)
        })
        .collect()
}

/// Whether the event data has a non-null value at the pointer (which is valid).
pub(crate) fn has_key(payload: &serde_json::Value, pointer: &str) -> bool {
    payload.pointer(pointer).is_some_and(|v| !v.is_null())
}

fn check_pointer(function: &str, pointer: &Option<String>) -> Result<Option<Vec<String>>, Error> {
    match pointer {
        None => Ok(None),
        Some(p) => parse_pointer(p).map(Some).map_err(|e| Error::InvalidFunction(format!("function {function}: {e}"))),
    }
}

/// Validates a function's flow settings and names its rules. Errors name the function.
pub(crate) fn resolve(function: &str, flow: &FlowConfig, limits: &Limits) -> Result<Vec<StoredRule>, Error> {
    let invalid = |m: String| Error::InvalidFunction(format!("function {function}: {m}"));
    let count = |k: Kind| flow.rules.iter().filter(|r| r.kind == k).count();
    if count(Kind::Concurrency) > 2 {
        return Err(invalid("at most two concurrency limits per function".into()));
    }
    for k in [Kind::Throttle, Kind::RateLimit, Kind::Backpressure] {
        if count(k) > 1 {
            return Err(invalid(format!("at most one {} rule per function", k.as_str())));
        }
    }
    let mut out = Vec::new();
    let mut seen = std::collections::HashMap::new();
    for r in &flow.rules {
        let n = seen.entry(r.kind.as_str()).or_insert(0);
        *n += 1;
        let name = match &r.shared {
            Some(name) => {
                limits::check_function_id(name, limits).map_err(|e| invalid(format!("shared limit name: {e}")))?;
                name.clone()
            }
            None => format!("{function}#{}{}", r.kind.as_str(), n),
        };
        if r.kind != Kind::Backpressure {
            if r.capacity == 0 {
                return Err(invalid(format!("{} limit must be at least 1", r.kind.as_str())));
            }
            if r.kind != Kind::Concurrency && r.period.is_zero() {
                return Err(invalid(format!("{} period must be more than zero", r.kind.as_str())));
            }
        }
        if out.iter().any(|o: &StoredRule| o.name == name) {
            return Err(invalid(format!("uses the limit {name:?} twice")));
        }
        out.push(StoredRule {
            name,
            kind: r.kind,
            capacity: i32::try_from(r.capacity).unwrap_or(i32::MAX),
            period_s: r.period.as_secs_f64(),
            burst: i32::try_from(r.burst).unwrap_or(i32::MAX),
            pointer: r.key.clone(),
            path: check_pointer(function, &r.key)?,
        });
    }
    if flow.debounce.is_some() && flow.singleton.is_some() {
        return Err(invalid("debounce and singleton cannot be combined".into()));
    }
    if let Some(d) = &flow.debounce {
        check_pointer(function, &d.key)?;
        if d.period.is_zero() || d.max_wait < d.period {
            return Err(invalid("debounce needs a period above zero and max_wait >= period".into()));
        }
    }
    if let Some((key, _)) = &flow.singleton {
        check_pointer(function, key)?;
    }
    if let Some(p) = &flow.priority_from {
        check_pointer(function, &Some(p.clone()))?;
    }
    Ok(out)
}

/// Send-time options of one function, as stored in `durastep.function_options`.
#[derive(Debug, Clone, Default)]
pub(crate) struct StoredOptions {
    pub debounce_s: Option<f64>,
    pub debounce_max_s: Option<f64>,
    pub debounce_pointer: Option<String>,
    pub debounce_path: Option<Vec<String>>,
    pub singleton_mode: Option<&'static str>,
    pub singleton_pointer: Option<String>,
    pub singleton_path: Option<Vec<String>>,
    pub priority_pointer: Option<String>,
    pub priority_path: Option<Vec<String>>,
}

impl StoredOptions {
    /// The options of a (validated) config; None when it has none.
    pub(crate) fn of(flow: &FlowConfig) -> Option<StoredOptions> {
        if flow.debounce.is_none() && flow.singleton.is_none() && flow.priority_from.is_none() {
            return None;
        }
        let path = |p: &Option<String>| p.as_deref().and_then(|p| parse_pointer(p).ok());
        let mut o = StoredOptions::default();
        if let Some(d) = &flow.debounce {
            o.debounce_s = Some(d.period.as_secs_f64());
            o.debounce_max_s = Some(d.max_wait.as_secs_f64());
            o.debounce_pointer = d.key.clone();
            o.debounce_path = path(&d.key);
        }
        if let Some((key, mode)) = &flow.singleton {
            o.singleton_mode = Some(mode.as_str());
            o.singleton_pointer = key.clone();
            o.singleton_path = path(key);
        }
        if let Some(p) = &flow.priority_from {
            o.priority_pointer = Some(p.clone());
            o.priority_path = path(&Some(p.clone()));
        }
        Some(o)
    }
}

/// Why a queued run is not running yet: the flow rule it waits for.
///
/// ```no_run
/// # async fn demo(engine: durastep::Engine, id: uuid::Uuid) -> Result<(), durastep::Error> {
/// if let Some(w) = engine.run(id).await?.flow_wait {
///     println!("waits for {} {} on key {:?}; next possible start {:?}", w.kind, w.rule, w.key, w.next_possible_start);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct FlowWait {
    /// The rule's name (a shared name, or `<function>#concurrency1`, ...).
    pub rule: String,
    /// `concurrency`, `throttle` or `backpressure`.
    pub kind: String,
    /// The key's value (`""` for a function-wide limit).
    pub key: String,
    /// When the run can start at the earliest (None for a full concurrency key:
    /// when a slot frees).
    pub next_possible_start: Option<chrono::DateTime<chrono::Utc>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers() {
        assert_eq!(parse_pointer("/a/b").unwrap(), vec!["a", "b"]);
        assert_eq!(parse_pointer("/").unwrap(), vec![""]);
        assert!(parse_pointer("").is_err());
        assert!(parse_pointer("/a~").is_err());
        assert!(parse_pointer("/a\0").is_err());
    }

    #[test]
    fn resolve_names_and_refuses_bad_definitions() {
        let limits = Limits::default();
        let rule = |kind, key: Option<&str>| Rule {
            shared: None,
            kind,
            capacity: 2,
            period: Duration::from_secs(1),
            burst: 0,
            key: key.map(str::to_owned),
        };
        let ok = FlowConfig {
            rules: vec![rule(Kind::Concurrency, Some("/k")), rule(Kind::Concurrency, None)],
            ..Default::default()
        };
        let names: Vec<String> = resolve("f", &ok, &limits).unwrap().into_iter().map(|r| r.name).collect();
        assert_eq!(names, vec!["f#concurrency1", "f#concurrency2"]);
        let three = FlowConfig { rules: vec![rule(Kind::Concurrency, None); 3], ..Default::default() };
        assert!(resolve("f", &three, &limits).is_err());
        let bad = FlowConfig { rules: vec![rule(Kind::Throttle, Some("k"))], ..Default::default() };
        assert!(matches!(resolve("f", &bad, &limits), Err(Error::InvalidFunction(m)) if m.contains("JSON pointer")));
    }
}
