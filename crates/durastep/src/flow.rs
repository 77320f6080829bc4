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
pub const BACKPRESSURE_FREE_RETRIES: u32 = 50;

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
/// use durastep::{Function, Singleton, SingletonMode};
/// let f = Function::new("sync-contact")
///     .on_event("contact/changed")
///     .singleton(Singleton::new(SingletonMode::SkipNew).key("/contact_id"))
///     .handler(|_ctx, _e: serde_json::Value| async { Ok(()) });
/// # let _ = f;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SingletonMode {
    /// The new event's run is recorded as `skipped` (with the active run's id in
    /// its `last_error`); the active run goes on.
    SkipNew,
    /// The active run is cancelled (a running attempt can write nothing more,
    /// and its worker, told at once, drops it) and the new run starts. A run
    /// that sends such an event itself (`Ctx::send_event`) is cancelled once
    /// that step commits.
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

/// A concurrency limit: at most `limit` attempts execute at once per key; see
/// [`crate::FunctionBuilder::concurrency`].
///
/// ```
/// use durastep::Concurrency;
/// // 6 at once per ad account:
/// let per_account = Concurrency::new(6).key("/ad_account_id");
/// // One slot shared by every function that names "exact-online":
/// let shared = Concurrency::new(1).shared("exact-online");
/// # let _ = (per_account, shared);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Concurrency {
    limit: u32,
    key: Option<String>,
    shared: Option<String>,
}

impl Concurrency {
    /// At most `limit` attempts at once, over the whole function until
    /// [`Concurrency::key`] makes it per key.
    ///
    /// ```
    /// let c = durastep::Concurrency::new(4);
    /// # let _ = c;
    /// ```
    pub fn new(limit: u32) -> Self {
        Concurrency { limit, key: None, shared: None }
    }

    /// One limit per value at this JSON pointer into the event data (`"/ad_account_id"`).
    ///
    /// ```
    /// let c = durastep::Concurrency::new(6).key("/ad_account_id");
    /// # let _ = c;
    /// ```
    pub fn key(mut self, pointer: impl Into<String>) -> Self {
        self.key = Some(pointer.into());
        self
    }

    /// Shares the limit by name with every function that declares the same
    /// name: their attempts together never exceed the limit per key. Every
    /// function sharing a name must give it the same limit (the last engine to
    /// register it decides); each gives its own key pointer.
    ///
    /// ```
    /// let c = durastep::Concurrency::new(1).shared("exact-online");
    /// # let _ = c;
    /// ```
    pub fn shared(mut self, name: impl Into<String>) -> Self {
        self.shared = Some(name.into());
        self
    }

    pub(crate) fn rule(self) -> Rule {
        Rule {
            shared: self.shared,
            kind: Kind::Concurrency,
            capacity: self.limit,
            period: Duration::ZERO,
            burst: 0,
            key: self.key,
        }
    }
}

/// A throttle: at most `limit` starts per `period` per key (GCRA); runs over it
/// **wait**. See [`crate::FunctionBuilder::throttle`].
///
/// ```
/// use durastep::Throttle;
/// use std::time::Duration;
/// let t = Throttle::per_minute(100).key("/account_id");
/// let bursty = Throttle::new(10, Duration::from_secs(1)).burst(20);
/// # let _ = (t, bursty);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Throttle {
    limit: u32,
    period: Duration,
    burst: u32,
    key: Option<String>,
}

impl Throttle {
    /// At most `limit` starts in any window of `period` (at least
    /// `period / limit` apart), over the whole function until [`Throttle::key`].
    ///
    /// ```
    /// let t = durastep::Throttle::new(5, std::time::Duration::from_secs(10));
    /// # let _ = t;
    /// ```
    pub fn new(limit: u32, period: Duration) -> Self {
        Throttle { limit, period, burst: 0, key: None }
    }

    /// `limit` starts per second.
    ///
    /// ```
    /// let t = durastep::Throttle::per_second(10);
    /// # let _ = t;
    /// ```
    pub fn per_second(limit: u32) -> Self {
        Throttle::new(limit, Duration::from_secs(1))
    }

    /// `limit` starts per minute.
    ///
    /// ```
    /// let t = durastep::Throttle::per_minute(100);
    /// # let _ = t;
    /// ```
    pub fn per_minute(limit: u32) -> Self {
        Throttle::new(limit, Duration::from_secs(60))
    }

    /// `limit` starts per hour.
    ///
    /// ```
    /// let t = durastep::Throttle::per_hour(1_000);
    /// # let _ = t;
    /// ```
    pub fn per_hour(limit: u32) -> Self {
        Throttle::new(limit, Duration::from_secs(3600))
    }

    /// Lets up to `burst` extra starts through at once (default 0): at most
    /// `limit + burst` starts in any window of the period.
    ///
    /// ```
    /// let t = durastep::Throttle::per_minute(60).burst(10);
    /// # let _ = t;
    /// ```
    pub fn burst(mut self, burst: u32) -> Self {
        self.burst = burst;
        self
    }

    /// One throttle per value at this JSON pointer into the event data.
    ///
    /// ```
    /// let t = durastep::Throttle::per_minute(100).key("/account_id");
    /// # let _ = t;
    /// ```
    pub fn key(mut self, pointer: impl Into<String>) -> Self {
        self.key = Some(pointer.into());
        self
    }

    pub(crate) fn rule(self) -> Rule {
        Rule {
            shared: None,
            kind: Kind::Throttle,
            capacity: self.limit,
            period: self.period,
            burst: self.burst,
            key: self.key,
        }
    }
}

/// A rate limit: at most `limit` starts per `period` per key; runs over it are
/// **skipped**. See [`crate::FunctionBuilder::rate_limit`].
///
/// ```
/// use durastep::RateLimit;
/// use std::time::Duration;
/// let r = RateLimit::new(1, Duration::from_secs(300)).key("/client_id");
/// # let _ = r;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct RateLimit {
    limit: u32,
    period: Duration,
    key: Option<String>,
}

impl RateLimit {
    /// At most `limit` starts in any window of `period`.
    ///
    /// ```
    /// let r = durastep::RateLimit::new(1, std::time::Duration::from_secs(60));
    /// # let _ = r;
    /// ```
    pub fn new(limit: u32, period: Duration) -> Self {
        RateLimit { limit, period, key: None }
    }

    /// `limit` starts per second.
    ///
    /// ```
    /// let r = durastep::RateLimit::per_second(2);
    /// # let _ = r;
    /// ```
    pub fn per_second(limit: u32) -> Self {
        RateLimit::new(limit, Duration::from_secs(1))
    }

    /// `limit` starts per minute.
    ///
    /// ```
    /// let r = durastep::RateLimit::per_minute(1);
    /// # let _ = r;
    /// ```
    pub fn per_minute(limit: u32) -> Self {
        RateLimit::new(limit, Duration::from_secs(60))
    }

    /// `limit` starts per hour.
    ///
    /// ```
    /// let r = durastep::RateLimit::per_hour(1);
    /// # let _ = r;
    /// ```
    pub fn per_hour(limit: u32) -> Self {
        RateLimit::new(limit, Duration::from_secs(3600))
    }

    /// One limit per value at this JSON pointer into the event data.
    ///
    /// ```
    /// let r = durastep::RateLimit::per_minute(1).key("/client_id");
    /// # let _ = r;
    /// ```
    pub fn key(mut self, pointer: impl Into<String>) -> Self {
        self.key = Some(pointer.into());
        self
    }

    pub(crate) fn rule(self) -> Rule {
        Rule { shared: None, kind: Kind::RateLimit, capacity: self.limit, period: self.period, burst: 0, key: self.key }
    }
}

/// Key back-pressure: a [`crate::HandlerError::retry_after`] pauses the whole
/// key. See [`crate::FunctionBuilder::backpressure`].
///
/// ```
/// use durastep::Backpressure;
/// let private = Backpressure::new().key("/account_id");
/// let shared = Backpressure::new().key("/account_id").shared("linkedin-writes");
/// # let _ = (private, shared);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[must_use]
pub struct Backpressure {
    key: Option<String>,
    shared: Option<String>,
}

impl Backpressure {
    /// Back-pressure over the whole function, until [`Backpressure::key`].
    ///
    /// ```
    /// let b = durastep::Backpressure::new();
    /// # let _ = b;
    /// ```
    pub fn new() -> Self {
        Backpressure::default()
    }

    /// One pause per value at this JSON pointer into the event data.
    ///
    /// ```
    /// let b = durastep::Backpressure::new().key("/account_id");
    /// # let _ = b;
    /// ```
    pub fn key(mut self, pointer: impl Into<String>) -> Self {
        self.key = Some(pointer.into());
        self
    }

    /// Shares the pause by name: a 429 in any function that declares `name`
    /// pauses the key for all of them (one API account's write bucket,
    /// whichever function drained it).
    ///
    /// ```
    /// let b = durastep::Backpressure::new().shared("linkedin-writes");
    /// # let _ = b;
    /// ```
    pub fn shared(mut self, name: impl Into<String>) -> Self {
        self.shared = Some(name.into());
        self
    }

    pub(crate) fn rule(self) -> Rule {
        Rule {
            shared: self.shared,
            kind: Kind::Backpressure,
            capacity: 0,
            period: Duration::ZERO,
            burst: 0,
            key: self.key,
        }
    }
}

/// Debounce settings: a burst of events per key makes one run, with the latest
/// event's data, that starts `period` after the burst's last event and never
/// later than `max_wait` after its first. See [`crate::FunctionBuilder::debounce`].
///
/// ```
/// use durastep::Debounce;
/// use std::time::Duration;
/// let d = Debounce::new(Duration::from_secs(30)).key("/contact_id").max_wait(Duration::from_secs(300));
/// # let _ = d;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Debounce {
    pub(crate) period: Duration,
    pub(crate) key: Option<String>,
    max_wait: Option<Duration>,
}

impl Debounce {
    /// Debounce with this quiet period, over the whole function until
    /// [`Debounce::key`]; `max_wait` is ten periods until [`Debounce::max_wait`].
    ///
    /// ```
    /// let d = durastep::Debounce::new(std::time::Duration::from_secs(5));
    /// # let _ = d;
    /// ```
    pub fn new(period: Duration) -> Self {
        Debounce { period, key: None, max_wait: None }
    }

    /// One debounce per value at this JSON pointer into the event data.
    ///
    /// ```
    /// let d = durastep::Debounce::new(std::time::Duration::from_secs(5)).key("/contact_id");
    /// # let _ = d;
    /// ```
    pub fn key(mut self, pointer: impl Into<String>) -> Self {
        self.key = Some(pointer.into());
        self
    }

    /// The longest a burst can delay its run, from its first event (at least
    /// the period; default ten periods), so a steady stream still runs.
    ///
    /// ```
    /// use std::time::Duration;
    /// let d = durastep::Debounce::new(Duration::from_secs(5)).max_wait(Duration::from_secs(60));
    /// # let _ = d;
    /// ```
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = Some(max_wait);
        self
    }

    pub(crate) fn max_wait_or_default(&self) -> Duration {
        self.max_wait.unwrap_or_else(|| self.period.saturating_mul(10))
    }
}

/// At most one active run per key; see [`crate::FunctionBuilder::singleton`].
///
/// ```
/// use durastep::{Singleton, SingletonMode};
/// let s = Singleton::new(SingletonMode::SkipNew).key("/account_id");
/// # let _ = s;
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub struct Singleton {
    pub(crate) mode: SingletonMode,
    pub(crate) key: Option<String>,
}

impl Singleton {
    /// One active run over the whole function (until [`Singleton::key`]);
    /// `mode` says what a new event for a busy key does.
    ///
    /// ```
    /// let s = durastep::Singleton::new(durastep::SingletonMode::CancelOld);
    /// # let _ = s;
    /// ```
    pub fn new(mode: SingletonMode) -> Self {
        Singleton { mode, key: None }
    }

    /// One active run per value at this JSON pointer into the event data.
    ///
    /// ```
    /// let s = durastep::Singleton::new(durastep::SingletonMode::SkipNew).key("/account_id");
    /// # let _ = s;
    /// ```
    pub fn key(mut self, pointer: impl Into<String>) -> Self {
        self.key = Some(pointer.into());
        self
    }
}

/// Every flow setting of one function.
#[derive(Debug, Clone, Default)]
pub(crate) struct FlowConfig {
    pub rules: Vec<Rule>,
    pub debounce: Option<Debounce>,
    pub singleton: Option<Singleton>,
    pub priority_from: Option<String>,
    /// The range a priority taken from event data is clamped to.
    pub priority_range: Option<std::ops::RangeInclusive<i32>>,
}

/// The range a priority taken from event data is clamped to when the function
/// sets none ([`crate::FunctionBuilder::priority_range`]).
///
/// ```
/// assert_eq!(durastep::DEFAULT_PRIORITY_RANGE, -100..=100);
/// ```
pub const DEFAULT_PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -100..=100;

impl FlowConfig {
    pub(crate) fn has_backpressure(&self) -> bool {
        self.rules.iter().any(|r| r.kind == Kind::Backpressure)
    }

    /// Every key pointer an event must carry for this function: its value is
    /// required at send.
    pub(crate) fn required_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = self.rules.iter().filter_map(|r| r.key.clone()).collect();
        keys.extend(self.debounce.as_ref().and_then(|d| d.key.clone()));
        keys.extend(self.singleton.as_ref().and_then(|s| s.key.clone()));
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

/// Splits a JSON pointer (RFC 6901: `""` is the whole document, `"/a/b"` is
/// key `b` inside key `a`, `~1` is `/` and `~0` is `~`) into the path Postgres'
/// `#>` operator takes. Array elements are addressed by their index, as in `/items/0`.
///
/// ```
/// # // private; exercised through cancel_on and EventMatch
/// ```
pub(crate) fn pointer_path(pointer: &str) -> Result<Vec<String>, String> {
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    // One RFC 6901 parser for every key path (flow-control keys refuse "").
    parse_pointer(pointer)
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
            period_s: r.period.min(crate::limits::MAX_DURATION).as_secs_f64(),
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
        if d.period.is_zero() || d.max_wait_or_default() < d.period {
            return Err(invalid("debounce needs a period above zero and max_wait >= period".into()));
        }
    }
    if let Some(s) = &flow.singleton {
        check_pointer(function, &s.key)?;
    }
    if let Some(p) = &flow.priority_from {
        check_pointer(function, &Some(p.clone()))?;
    }
    if let Some(r) = &flow.priority_range
        && r.is_empty()
    {
        return Err(invalid(format!("priority_range {r:?} is empty")));
    }
    Ok(out)
}

/// Send-time options of one function, as stored in `durastep.function_options`.
#[derive(Debug, Clone)]
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
    pub priority_range: std::ops::RangeInclusive<i32>,
}

impl Default for StoredOptions {
    fn default() -> Self {
        StoredOptions {
            debounce_s: None,
            debounce_max_s: None,
            debounce_pointer: None,
            debounce_path: None,
            singleton_mode: None,
            singleton_pointer: None,
            singleton_path: None,
            priority_pointer: None,
            priority_path: None,
            priority_range: DEFAULT_PRIORITY_RANGE,
        }
    }
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
            o.debounce_s = Some(d.period.min(crate::limits::MAX_DURATION).as_secs_f64());
            o.debounce_max_s = Some(d.max_wait_or_default().min(crate::limits::MAX_DURATION).as_secs_f64());
            o.debounce_pointer = d.key.clone();
            o.debounce_path = path(&d.key);
        }
        if let Some(s) = &flow.singleton {
            o.singleton_mode = Some(s.mode.as_str());
            o.singleton_pointer = s.key.clone();
            o.singleton_path = path(&s.key);
        }
        if let Some(p) = &flow.priority_from {
            o.priority_pointer = Some(p.clone());
            o.priority_path = path(&Some(p.clone()));
        }
        o.priority_range = flow.priority_range.clone().unwrap_or(DEFAULT_PRIORITY_RANGE);
        Some(o)
    }
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

    /// Catches: a debounce without `max_wait` that never fires under a steady
    /// stream of events (no cap), or a cap below the period (refused at build).
    #[test]
    fn debounce_max_wait_defaults_to_ten_periods() {
        let d = Debounce::new(Duration::from_secs(3));
        assert_eq!(d.max_wait_or_default(), Duration::from_secs(30));
        let d = d.max_wait(Duration::from_secs(5));
        assert_eq!(d.max_wait_or_default(), Duration::from_secs(5));
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
