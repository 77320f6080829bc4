//! Input limits, checked before any SQL runs.
//!
//! Every payload (event data, step output, run output) and every name (function
//! id, event name, step name, idempotency key) passes through here first, so a
//! bad value is refused with a typed error and nothing is written.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;

/// Bounds on what Durastep accepts; see [`crate::EngineBuilder::limits`].
///
/// ```
/// let limits = durastep::Limits { max_payload_bytes: 256 * 1024, ..Default::default() };
/// assert_eq!(limits.max_depth, 64);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
// Not #[non_exhaustive]: build it with `..Default::default()`, so new fields stay compatible.
pub struct Limits {
    /// Largest serialized payload or step output, in bytes (default 1 MiB).
    pub max_payload_bytes: usize,
    /// Deepest nesting of arrays and objects in a payload (default 64). Values
    /// above [`MAX_SUPPORTED_DEPTH`] act as that ceiling.
    pub max_depth: usize,
    /// Longest idempotency key, event name, function id or step name, in bytes
    /// (default 512). Values above [`MAX_SUPPORTED_KEY_BYTES`] act as that ceiling.
    pub max_key_bytes: usize,
    /// Most bytes of step results one run may store in total (default 64 MiB),
    /// as stored (sealed, when encryption is on). A worker loads all of a run's
    /// step results as one `jsonb` value at each claim, and Postgres holds at
    /// most 255 MiB in one; values above [`MAX_SUPPORTED_RUN_BYTES`] act as that
    /// ceiling. A step whose output would pass it fails the run permanently
    /// with [`LimitError::RunTooLarge`]. Records the database writes for the
    /// run later (a wait's event, a child's outcome, each at most
    /// `max_payload_bytes`) count too: a wait or invoke asked for when the run
    /// is already at the limit fails it the same way, so a run passes its limit
    /// by at most one such record.
    pub max_run_bytes: usize,
    /// Most steps (step results, sleeps, waits, child runs, sent events) one run
    /// may record (default 10,000); the next one fails the run permanently with
    /// [`LimitError::TooManySteps`].
    pub max_steps_per_run: usize,
    /// Most events in one [`crate::Engine::send_batch`] (default 10,000); more is
    /// [`LimitError::BatchTooLarge`] and nothing is sent.
    pub max_batch_events: usize,
    /// Most payload bytes in one [`crate::Engine::send_batch`], all events
    /// together (default 16 MiB; values above [`MAX_SUPPORTED_BATCH_BYTES`] act
    /// as that ceiling); more is [`LimitError::BatchTooLarge`] and nothing is sent.
    pub max_batch_bytes: usize,
}

/// The most bytes of step results a run can store, whatever
/// [`Limits::max_run_bytes`] says: well below the 255 MiB a `jsonb` value
/// holds, as the claim reads a run's step results as one value.
///
/// ```
/// assert_eq!(durastep::limits::MAX_SUPPORTED_RUN_BYTES, 128 * 1024 * 1024);
/// ```
pub const MAX_SUPPORTED_RUN_BYTES: usize = 128 * 1024 * 1024;

/// The most payload bytes one `send_batch` can carry, whatever
/// [`Limits::max_batch_bytes`] says: one statement carries the whole batch,
/// and Postgres refuses a message over 1 GB.
///
/// ```
/// assert_eq!(durastep::limits::MAX_SUPPORTED_BATCH_BYTES, 256 * 1024 * 1024);
/// ```
pub const MAX_SUPPORTED_BATCH_BYTES: usize = 256 * 1024 * 1024;

/// The deepest nesting Durastep can store and read back, whatever
/// [`Limits::max_depth`] says: serde_json reads at most 127 levels, and the
/// worker reads a run's step outputs inside one object (one level deeper).
/// Deeper values were once accepted and then made every claim that included
/// their run fail to decode.
///
/// ```
/// let limits = durastep::Limits { max_depth: 1_000, ..Default::default() };
/// let deep = "[".repeat(121) + &"]".repeat(121);
/// let err = durastep::limits::parse_payload(&deep, &limits).unwrap_err();
/// assert_eq!(err, durastep::LimitError::TooDeep { limit: durastep::limits::MAX_SUPPORTED_DEPTH });
/// ```
pub const MAX_SUPPORTED_DEPTH: usize = 120;

/// The longest name Durastep can store, whatever [`Limits::max_key_bytes`]
/// says: names are keys of btree indexes (an event's name and idempotency key
/// together, a step key with its run id, a function id), and Postgres refuses
/// an index entry over 2,704 bytes that it cannot compress. Longer names were
/// once let through by a larger `max_key_bytes` and then failed the `INSERT`
/// with a database error instead of a typed refusal (a send), or failed every
/// checkpoint of the step (a step name).
///
/// ```
/// let limits = durastep::Limits { max_key_bytes: 4096, ..Default::default() };
/// let name = "k".repeat(durastep::limits::MAX_SUPPORTED_KEY_BYTES + 1);
/// assert!(durastep::limits::check_name("idempotency key", &name, &limits).is_err());
/// ```
pub const MAX_SUPPORTED_KEY_BYTES: usize = 1024;

/// The longest duration Durastep stores: 100 years (of 365.25 days). Every
/// duration a user passes (a sleep, a start or finish timeout, a throttle,
/// rate-limit or debounce period, a lease, a retention) is cut to it; a
/// [`crate::Ctx::wait_for_event`] or [`crate::Ctx::invoke`] timeout of this
/// length or more means "no timeout" (stored as Postgres `infinity`).
/// Longer values once overflowed Postgres' `interval` and `timestamptz`.
///
/// ```
/// assert_eq!(durastep::limits::MAX_DURATION.as_secs(), 3_155_760_000);
/// ```
pub const MAX_DURATION: Duration = Duration::from_secs(3_155_760_000);

/// The longest delay before a retry, whether asked for with
/// [`crate::HandlerError::retry_after`] (and so also the longest back-pressure
/// pause of a key) or given by a [`crate::Backoff`]: 7 days. A longer delay is
/// cut to it. A huge `retry_after` once made the failure's write fail
/// ("timestamp out of range"), and a merely large one paused a shared key for years.
///
/// ```
/// assert_eq!(durastep::limits::MAX_RETRY_DELAY.as_secs(), 7 * 86_400);
/// ```
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(7 * 86_400);

/// The latest instant Durastep stores: 9999-12-31T23:59:59Z. A later
/// [`crate::Ctx::sleep_until`] or [`crate::Event::start_at`] (or a sleep that
/// would end later) is cut to it; a Postgres `infinity` (a wait without
/// timeout) reads back as it, e.g. in [`crate::Run::run_at`].
///
/// ```
/// assert_eq!(durastep::limits::max_instant().to_rfc3339(), "9999-12-31T23:59:59+00:00");
/// ```
pub fn max_instant() -> DateTime<Utc> {
    DateTime::from_timestamp(253_402_300_799, 0).unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// The earliest instant Durastep stores: 0001-01-01T00:00:00Z; an earlier
/// [`crate::Event::start_at`] or [`crate::Ctx::sleep_until`] is moved up to it
/// (it is due at once either way).
///
/// ```
/// assert_eq!(durastep::limits::min_instant().to_rfc3339(), "0001-01-01T00:00:00+00:00");
/// ```
pub fn min_instant() -> DateTime<Utc> {
    DateTime::from_timestamp(-62_135_596_800, 0).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

/// An instant cut to [`min_instant`] ..= [`max_instant`].
///
/// ```
/// let far = chrono::DateTime::<chrono::Utc>::MAX_UTC;
/// assert_eq!(durastep::limits::clamp_instant(far), durastep::limits::max_instant());
/// ```
pub fn clamp_instant(at: DateTime<Utc>) -> DateTime<Utc> {
    at.clamp(min_instant(), max_instant())
}

/// `at + d`, cut to [`max_instant`] (never overflows).
pub(crate) fn instant_after(at: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    let d = chrono::Duration::from_std(d.min(MAX_DURATION)).unwrap_or(chrono::Duration::MAX);
    clamp_instant(at.checked_add_signed(d).unwrap_or(DateTime::<Utc>::MAX_UTC))
}

impl Limits {
    fn depth(&self) -> usize {
        self.max_depth.min(MAX_SUPPORTED_DEPTH)
    }

    fn key_bytes(&self) -> usize {
        self.max_key_bytes.min(MAX_SUPPORTED_KEY_BYTES)
    }

    /// The per-run byte limit in force.
    pub(crate) fn run_bytes(&self) -> usize {
        self.max_run_bytes.min(MAX_SUPPORTED_RUN_BYTES)
    }

    /// The per-batch byte limit in force.
    fn batch_bytes(&self) -> usize {
        self.max_batch_bytes.min(MAX_SUPPORTED_BATCH_BYTES)
    }
}

/// Checks the size of a `send_batch`: the number of events and the bytes of
/// their (checked) payloads together.
///
/// ```
/// use durastep::{LimitError, Limits};
/// let limits = Limits { max_batch_events: 2, ..Limits::default() };
/// assert!(durastep::limits::check_batch(2, 10, &limits).is_ok());
/// assert_eq!(durastep::limits::check_batch(3, 10, &limits), Err(LimitError::BatchTooLarge { events: 3, bytes: 10 }));
/// ```
pub fn check_batch(events: usize, bytes: usize, limits: &Limits) -> Result<(), LimitError> {
    if events > limits.max_batch_events || bytes > limits.batch_bytes() {
        return Err(LimitError::BatchTooLarge { events, bytes });
    }
    Ok(())
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_payload_bytes: 1024 * 1024,
            max_depth: 64,
            max_key_bytes: 512,
            max_run_bytes: 64 * 1024 * 1024,
            max_steps_per_run: 10_000,
            max_batch_events: 10_000,
            max_batch_bytes: 16 * 1024 * 1024,
        }
    }
}

/// Why a payload or a name was refused.
///
/// ```
/// use durastep::{Limits, LimitError};
/// let err = durastep::limits::check_name("event name", "", &Limits::default()).unwrap_err();
/// assert!(matches!(err, LimitError::InvalidName { .. }));
/// ```
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LimitError {
    /// The serialized payload is larger than [`Limits::max_payload_bytes`].
    #[error("payload is {size} bytes, over the limit of {limit} bytes")]
    TooLarge {
        /// Serialized size.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// Arrays or objects are nested deeper than [`Limits::max_depth`] (or
    /// [`MAX_SUPPORTED_DEPTH`], if lower).
    #[error("payload is nested deeper than the limit of {limit} levels")]
    TooDeep {
        /// The limit in force.
        limit: usize,
    },
    /// A string or key holds a NUL character, which Postgres `jsonb` cannot store.
    #[error("payload holds a NUL character (\\u0000), which Postgres jsonb cannot store")]
    NulCharacter,
    /// The value could not be serialized to JSON.
    #[error("payload does not serialize to JSON: {0}")]
    Serialize(String),
    /// JSON text given to [`parse_payload`] or [`crate::Event::from_json`] is not
    /// valid JSON (a syntax error, a lone UTF-16 surrogate escape such as
    /// `"\ud800"`, a number out of range, ...). The text holds serde_json's
    /// reason with its line and column, never the input itself.
    #[error("payload is not valid JSON: {0}")]
    InvalidJson(String),
    /// An event name a user gave begins with [`RESERVED_EVENT_PREFIX`]
    /// (`durastep/`), which names the engine's own events (cron fire times,
    /// `on_failure`, child runs): a user may not send, trigger on, cancel on or
    /// wait for them.
    #[error("event name {value:?} is reserved: names beginning with \"durastep/\" are the engine's own")]
    ReservedName {
        /// The offending name, cut to 80 characters.
        value: String,
    },
    /// A run's stored step results would pass [`Limits::max_run_bytes`].
    #[error("the run's step results would take {size} bytes, over the limit of {limit} bytes per run")]
    RunTooLarge {
        /// Bytes the run would store with this step.
        size: usize,
        /// The limit in force.
        limit: usize,
    },
    /// A run would record more steps than [`Limits::max_steps_per_run`].
    #[error("the run would record more than {limit} steps")]
    TooManySteps {
        /// The configured limit.
        limit: usize,
    },
    /// A `send_batch` has more events than [`Limits::max_batch_events`] or more
    /// payload bytes than [`Limits::max_batch_bytes`].
    #[error("batch of {events} events with {bytes} payload bytes is over the batch limits")]
    BatchTooLarge {
        /// Events in the batch.
        events: usize,
        /// Payload bytes, all events together (counted up to the first refusal).
        bytes: usize,
    },
    /// A name or key is empty, too long, or holds a character that is not allowed.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        /// What kind of name ("function id", "event name", ...).
        what: &'static str,
        /// The offending value, cut to 80 characters.
        value: String,
        /// Why it was refused.
        reason: &'static str,
    },
}

/// Checks a JSON value against the limits and returns its serialized text.
///
/// ```
/// let text = durastep::limits::check_payload(&serde_json::json!({"a": 1}), &Default::default()).unwrap();
/// assert_eq!(text, r#"{"a":1}"#);
/// ```
pub fn check_payload(value: &Value, limits: &Limits) -> Result<String, LimitError> {
    check_shape(value, limits.depth())?;
    let text = serde_json::to_string(value).map_err(|e| LimitError::Serialize(e.to_string()))?;
    if text.len() > limits.max_payload_bytes {
        return Err(LimitError::TooLarge { size: text.len(), limit: limits.max_payload_bytes });
    }
    Ok(text)
}

/// Parses untrusted JSON text into a payload, enforcing the limits before and
/// while parsing: the byte length of the text is checked first (the limit
/// applies to the text as given, whitespace included), then the nesting depth
/// by a scan that does not recurse, and only then does serde_json parse it.
/// Invalid JSON (lone UTF-16 surrogates such as `"\ud800"` included) is
/// [`LimitError::InvalidJson`]; a `\u0000` escape is [`LimitError::NulCharacter`],
/// because Postgres `jsonb` cannot store it.
///
/// ```
/// use durastep::limits::{parse_payload, LimitError};
/// let limits = durastep::Limits::default();
/// assert_eq!(parse_payload(r#"{"a": [1, 2]}"#, &limits).unwrap(), serde_json::json!({"a": [1, 2]}));
/// assert_eq!(parse_payload(r#""\u0000""#, &limits), Err(LimitError::NulCharacter));
/// assert!(matches!(parse_payload(r#""\ud800""#, &limits), Err(LimitError::InvalidJson(_))));
/// assert_eq!(parse_payload(&"[".repeat(100_000), &limits), Err(LimitError::TooDeep { limit: 64 }));
/// ```
pub fn parse_payload(text: &str, limits: &Limits) -> Result<Value, LimitError> {
    if text.len() > limits.max_payload_bytes {
        return Err(LimitError::TooLarge { size: text.len(), limit: limits.max_payload_bytes });
    }
    check_text_depth(text, limits.depth())?;
    let value: Value = serde_json::from_str(text).map_err(|e| LimitError::InvalidJson(e.to_string()))?;
    check_shape(&value, limits.depth())?;
    Ok(value)
}

/// Counts bracket nesting outside strings; malformed text is left to the parser.
fn check_text_depth(text: &str, max_depth: usize) -> Result<(), LimitError> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for b in text.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max_depth {
                    return Err(LimitError::TooDeep { limit: max_depth });
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

/// Depth and NUL checks without recursion, so a hostile value cannot overflow the stack.
fn check_shape(value: &Value, max_depth: usize) -> Result<(), LimitError> {
    let mut stack: Vec<(&Value, usize)> = vec![(value, 1)];
    while let Some((v, depth)) = stack.pop() {
        match v {
            Value::String(s) if s.contains('\0') => return Err(LimitError::NulCharacter),
            Value::Array(items) => {
                if depth > max_depth {
                    return Err(LimitError::TooDeep { limit: max_depth });
                }
                stack.extend(items.iter().map(|i| (i, depth + 1)));
            }
            Value::Object(map) => {
                if depth > max_depth {
                    return Err(LimitError::TooDeep { limit: max_depth });
                }
                for (k, item) in map {
                    if k.contains('\0') {
                        return Err(LimitError::NulCharacter);
                    }
                    stack.push((item, depth + 1));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Checks a name: not empty, within [`Limits::max_key_bytes`] (and
/// [`MAX_SUPPORTED_KEY_BYTES`]), no control characters.
///
/// ```
/// assert!(durastep::limits::check_name("step name", "push", &Default::default()).is_ok());
/// ```
pub fn check_name(what: &'static str, value: &str, limits: &Limits) -> Result<(), LimitError> {
    let invalid = |reason| LimitError::InvalidName { what, value: value.chars().take(80).collect(), reason };
    if value.is_empty() {
        return Err(invalid("must not be empty"));
    }
    if value.len() > limits.key_bytes() {
        return Err(invalid("is longer than the key limit"));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid("must not hold control characters"));
    }
    Ok(())
}

/// The prefix of the engine's own event names (`durastep/cron:<id>`,
/// `durastep/run.failed`, `durastep/invoke:<id>`); see [`check_event_name`].
///
/// ```
/// assert_eq!(durastep::limits::RESERVED_EVENT_PREFIX, "durastep/");
/// ```
pub const RESERVED_EVENT_PREFIX: &str = "durastep/";

/// Checks an event name a user gives (to send, trigger on, cancel on or wait
/// for): a valid name (see [`check_name`]) that does not begin with
/// [`RESERVED_EVENT_PREFIX`], which is [`LimitError::ReservedName`].
///
/// ```
/// use durastep::{LimitError, limits::check_event_name};
/// assert!(check_event_name("campaign/paused", &Default::default()).is_ok());
/// let err = check_event_name("durastep/cron:report", &Default::default()).unwrap_err();
/// assert!(matches!(err, LimitError::ReservedName { .. }));
/// ```
pub fn check_event_name(value: &str, limits: &Limits) -> Result<(), LimitError> {
    check_name("event name", value, limits)?;
    if value.starts_with(RESERVED_EVENT_PREFIX) {
        return Err(LimitError::ReservedName { value: value.chars().take(80).collect() });
    }
    Ok(())
}

/// Checks a step name: a valid name (see [`check_name`]) without `#`, which
/// numbers repeated calls of one name (`name#2`, `name#3`, ...).
///
/// ```
/// use durastep::limits::check_step_name;
/// assert!(check_step_name("push", &Default::default()).is_ok());
/// assert!(check_step_name("push#2", &Default::default()).is_err());
/// ```
pub fn check_step_name(value: &str, limits: &Limits) -> Result<(), LimitError> {
    check_name("step name", value, limits)?;
    if value.contains('#') {
        return Err(LimitError::InvalidName {
            what: "step name",
            value: value.chars().take(80).collect(),
            reason: "must not contain '#'",
        });
    }
    Ok(())
}

/// Checks a function id: a valid name (see [`check_name`]) of ASCII letters,
/// digits and `-_.:` only; `/` is reserved for derived ids such as `<id>/on-failure`.
///
/// ```
/// use durastep::limits::check_function_id;
/// assert!(check_function_id("meta-budget-update", &Default::default()).is_ok());
/// assert!(check_function_id("a/on-failure", &Default::default()).is_err());
/// ```
pub fn check_function_id(value: &str, limits: &Limits) -> Result<(), LimitError> {
    check_name("function id", value, limits)?;
    if !value.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c)) {
        return Err(LimitError::InvalidName {
            what: "function id",
            value: value.chars().take(80).collect(),
            reason: "may hold only ASCII letters, digits and - _ . :",
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(value: Value, expected: Result<(), LimitError>) {
        let limits = Limits { max_payload_bytes: 64, max_depth: 3, max_key_bytes: 8, ..Limits::default() };
        assert_eq!(check_payload(&value, &limits).map(|_| ()), expected, "{value}");
    }

    #[test]
    fn payload_limits() {
        check(json!({"a": [1, 2]}), Ok(()));
        check(json!({"a": {"b": {"c": 1}}}), Ok(()));
        check(json!({"a": {"b": {"c": []}}}), Err(LimitError::TooDeep { limit: 3 }));
        check(json!({"a": "x\u{0}y"}), Err(LimitError::NulCharacter));
        check(json!({"a\u{0}": 1}), Err(LimitError::NulCharacter));
        check(json!("x".repeat(100)), Err(LimitError::TooLarge { size: 102, limit: 64 }));
    }

    #[test]
    fn deep_value_does_not_overflow() {
        let mut v = json!(1);
        for _ in 0..100_000 {
            v = Value::Array(vec![v]);
        }
        assert_eq!(check_shape(&v, 64), Err(LimitError::TooDeep { limit: 64 }));
        // Drop iteratively too: serde_json's Drop is recursive.
        while let Value::Array(mut items) = v {
            v = items.pop().unwrap_or(Value::Null);
        }
    }

    fn parse(text: &str, expected: Result<Value, LimitError>) {
        let limits = Limits { max_payload_bytes: 64, max_depth: 3, max_key_bytes: 8, ..Limits::default() };
        assert_eq!(parse_payload(text, &limits), expected, "{text:?}");
    }

    fn invalid_json(text: &str) {
        let limits = Limits::default();
        let got = parse_payload(text, &limits);
        assert!(matches!(got, Err(LimitError::InvalidJson(_))), "{text:?}: {got:?}");
    }

    #[test]
    fn json_text_limits() {
        parse(r#" {"a": [1, 2]} "#, Ok(json!({"a": [1, 2]})));
        parse(r#"[[["]]]]]]"]]]"#, Ok(json!([[["]]]]]]"]]])));
        parse(r#"[[[[1]]]]"#, Err(LimitError::TooDeep { limit: 3 }));
        parse(r#"{"a":{"b":{"c":{}}}}"#, Err(LimitError::TooDeep { limit: 3 }));
        // Brackets inside strings, and escaped quotes, do not count.
        parse(r#"["[[[[\"[[[[", "{{{{"]"#, Ok(json!(["[[[[\"[[[[", "{{{{"])));
        parse(r#""\u0000""#, Err(LimitError::NulCharacter));
        parse(r#"{"\u0000": 1}"#, Err(LimitError::NulCharacter));
        // The size check comes first, on the text as given.
        parse(&format!("{:70}", 1), Err(LimitError::TooLarge { size: 70, limit: 64 }));
        parse(&"[".repeat(1_000_000), Err(LimitError::TooLarge { size: 1_000_000, limit: 64 }));
    }

    #[test]
    fn malformed_json_text_is_a_typed_error() {
        invalid_json("");
        invalid_json("{");
        invalid_json("\"\u{0}\""); // a raw NUL byte inside a string
        invalid_json(r#""\ud800""#); // lone leading surrogate
        invalid_json(r#""\udc00""#); // lone trailing surrogate
        invalid_json(r#""\ud800\u0041""#);
        invalid_json(r#""\uZZZZ""#);
        invalid_json("1e400");
        invalid_json("[1,]");
        invalid_json("{} {}");
        invalid_json("\u{feff}{}"); // a byte order mark is not JSON
        // A valid surrogate pair is fine.
        assert_eq!(parse_payload(r#""\ud83d\ude00""#, &Limits::default()), Ok(json!("\u{1F600}")));
    }

    #[test]
    fn hostile_json_text_is_refused_without_overflow() {
        let limits = Limits { max_payload_bytes: 20 * 1024 * 1024, ..Limits::default() };
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert_eq!(parse_payload(&deep, &limits), Err(LimitError::TooDeep { limit: 64 }));
        let big = format!("\"{}\"", "x".repeat(10 * 1024 * 1024));
        assert!(parse_payload(&big, &limits).is_ok());
        assert!(matches!(parse_payload(&big, &Limits::default()), Err(LimitError::TooLarge { .. })));
    }

    #[test]
    fn names() {
        let l = Limits::default();
        assert!(check_name("event name", "campaign/budget.requested", &l).is_ok());
        assert!(check_name("event name", "a\nb", &l).is_err());
        assert!(check_name("event name", &"x".repeat(600), &l).is_err());
        assert!(check_function_id("meta-budget-update", &l).is_ok());
        assert!(check_function_id("a/on-failure", &l).is_err());
        assert!(check_step_name("fetch-a", &l).is_ok());
        assert!(check_step_name("fetch#2", &l).is_err());
        assert!(check_step_name("a\u{0}b", &l).is_err());
    }

    #[test]
    fn key_limit_has_a_ceiling() {
        let wide = Limits { max_key_bytes: usize::MAX, ..Limits::default() };
        let at = "k".repeat(MAX_SUPPORTED_KEY_BYTES);
        let over = "k".repeat(MAX_SUPPORTED_KEY_BYTES + 1);
        assert!(check_name("idempotency key", &at, &wide).is_ok());
        assert!(check_step_name(&at, &wide).is_ok());
        assert!(check_function_id(&at, &wide).is_ok());
        assert!(check_name("idempotency key", &over, &wide).is_err());
        assert!(check_step_name(&over, &wide).is_err());
        assert!(check_function_id(&over, &wide).is_err());
        // Below the ceiling, the configured limit still rules.
        let narrow = Limits { max_key_bytes: 8, ..Limits::default() };
        assert!(check_name("event name", "123456789", &narrow).is_err());
    }
}
