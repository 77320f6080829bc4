//! Input limits, checked before any SQL runs.
//!
//! Every payload (event data, step output, run output) and every name (function
//! id, event name, step name, idempotency key) passes through here first, so a
//! bad value is refused with a typed error and nothing is written.

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
    /// Deepest nesting of arrays and objects in a payload (default 64).
    pub max_depth: usize,
    /// Longest idempotency key, event name, function id or step name, in bytes (default 512).
    pub max_key_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_payload_bytes: 1024 * 1024, max_depth: 64, max_key_bytes: 512 }
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
    /// Arrays or objects are nested deeper than [`Limits::max_depth`].
    #[error("payload is nested deeper than the limit of {limit} levels")]
    TooDeep {
        /// The configured limit.
        limit: usize,
    },
    /// A string or key holds a NUL character, which Postgres `jsonb` cannot store.
    #[error("payload holds a NUL character (\\u0000), which Postgres jsonb cannot store")]
    NulCharacter,
    /// The value could not be serialized to JSON.
    #[error("payload does not serialize to JSON: {0}")]
    Serialize(String),
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
    check_shape(value, limits.max_depth)?;
    let text = serde_json::to_string(value).map_err(|e| LimitError::Serialize(e.to_string()))?;
    if text.len() > limits.max_payload_bytes {
        return Err(LimitError::TooLarge { size: text.len(), limit: limits.max_payload_bytes });
    }
    Ok(text)
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

/// Checks a name: not empty, within [`Limits::max_key_bytes`], no control characters.
///
/// ```
/// assert!(durastep::limits::check_name("step name", "push", &Default::default()).is_ok());
/// ```
pub fn check_name(what: &'static str, value: &str, limits: &Limits) -> Result<(), LimitError> {
    let invalid = |reason| LimitError::InvalidName { what, value: value.chars().take(80).collect(), reason };
    if value.is_empty() {
        return Err(invalid("must not be empty"));
    }
    if value.len() > limits.max_key_bytes {
        return Err(invalid("is longer than the key limit"));
    }
    if value.chars().any(char::is_control) {
        return Err(invalid("must not hold control characters"));
    }
    Ok(())
}

/// Function ids: letters, digits and `-_.:`; `/` is reserved for derived ids
/// such as `<id>/on-failure`.
pub(crate) fn check_function_id(value: &str, limits: &Limits) -> Result<(), LimitError> {
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
        let limits = Limits { max_payload_bytes: 64, max_depth: 3, max_key_bytes: 8 };
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
        let mut v = v;
        while let Value::Array(mut items) = v {
            v = items.pop().unwrap_or(Value::Null);
        }
    }

    #[test]
    fn names() {
        let l = Limits::default();
        assert!(check_name("event name", "campaign/budget.requested", &l).is_ok());
        assert!(check_name("event name", "a\nb", &l).is_err());
        assert!(check_name("event name", &"x".repeat(600), &l).is_err());
        assert!(check_function_id("meta-budget-update", &l).is_ok());
        assert!(check_function_id("a/on-failure", &l).is_err());
    }
}
