//! Hostile inputs and their oracles, shared by the cargo-fuzz targets in
//! `fuzz/` (which draw their choices from the fuzzer's bytes) and the CI smoke
//! test `tests/fuzz_smoke.rs` (which draws them from a seeded PRNG).
//!
//! - [`Source`]: where choices come from.
//! - [`hostile`]: generators of hostile strings, names, numbers, values, JSON
//!   text, limits and events.
//! - [`check`]: the properties: drive the library's checks with one input and
//!   panic unless the verdict is the one an independent oracle gives.
//!
//! ```
//! use durastep_fuzzkit::{check, hostile, Source};
//! let mut src = Source::seeded(7);
//! let limits = hostile::limits(&mut src);
//! let text = hostile::json_text(&mut src, false);
//! let _verdict = check::json_text(&text, &limits); // panics on a wrong verdict
//! ```

pub mod check;
pub mod hostile;
mod source;

use durastep::Limits;
use serde_json::Value;

pub use source::Source;

/// Deepest nesting of arrays and objects (a scalar alone is 0), without recursion.
///
/// ```
/// assert_eq!(durastep_fuzzkit::depth(&serde_json::json!([{"a": []}])), 3);
/// ```
pub fn depth(v: &Value) -> usize {
    let mut deepest = 0;
    let mut stack = vec![(v, 0usize)];
    while let Some((v, d)) = stack.pop() {
        match v {
            Value::Array(items) => {
                deepest = deepest.max(d + 1);
                stack.extend(items.iter().map(|i| (i, d + 1)));
            }
            Value::Object(map) => {
                deepest = deepest.max(d + 1);
                stack.extend(map.values().map(|i| (i, d + 1)));
            }
            _ => {}
        }
    }
    deepest
}

/// The nesting depth of JSON text as serde_json's parser sees it, counting
/// every value, also one a later duplicate key replaces (which the parsed
/// `Value` no longer holds). None if serde_json refuses the text.
///
/// ```
/// assert_eq!(durastep_fuzzkit::text_depth(r#"{"a": [[1]], "a": 2}"#), Some(3));
/// assert_eq!(durastep_fuzzkit::text_depth("[1,"), None);
/// ```
pub fn text_depth(text: &str) -> Option<usize> {
    serde_json::from_str::<TextDepth>(text).ok().map(|d| d.0)
}

/// The depth of whatever was deserialized (see [`text_depth`]).
struct TextDepth(usize);

impl<'de> serde::Deserialize<'de> for TextDepth {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DepthVisitor)
    }
}

struct DepthVisitor;

impl<'de> serde::de::Visitor<'de> for DepthVisitor {
    type Value = TextDepth;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<TextDepth, E> {
        Ok(TextDepth(0))
    }
    fn visit_i64<E>(self, _: i64) -> Result<TextDepth, E> {
        Ok(TextDepth(0))
    }
    fn visit_u64<E>(self, _: u64) -> Result<TextDepth, E> {
        Ok(TextDepth(0))
    }
    fn visit_f64<E>(self, _: f64) -> Result<TextDepth, E> {
        Ok(TextDepth(0))
    }
    fn visit_str<E>(self, _: &str) -> Result<TextDepth, E> {
        Ok(TextDepth(0))
    }
    fn visit_unit<E>(self) -> Result<TextDepth, E> {
        Ok(TextDepth(0))
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<TextDepth, A::Error> {
        let mut deepest = 0;
        while let Some(TextDepth(d)) = seq.next_element()? {
            deepest = deepest.max(d);
        }
        Ok(TextDepth(deepest + 1))
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<TextDepth, A::Error> {
        let mut deepest = 0;
        while let Some((serde::de::IgnoredAny, TextDepth(d))) = map.next_entry()? {
            deepest = deepest.max(d);
        }
        Ok(TextDepth(deepest + 1))
    }
}

/// Whether any string or object key holds a NUL character.
///
/// ```
/// assert!(durastep_fuzzkit::has_nul(&serde_json::json!({"a\u{0}": 1})));
/// ```
pub fn has_nul(v: &Value) -> bool {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) if s.contains('\0') => return true,
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                if map.keys().any(|k| k.contains('\0')) {
                    return true;
                }
                stack.extend(map.values());
            }
            _ => {}
        }
    }
    false
}

/// The nesting limit in force: [`Limits::max_depth`], at most
/// [`durastep::limits::MAX_SUPPORTED_DEPTH`].
///
/// ```
/// let l = durastep::Limits { max_depth: 10_000, ..Default::default() };
/// assert_eq!(durastep_fuzzkit::max_depth(&l), durastep::limits::MAX_SUPPORTED_DEPTH);
/// ```
pub fn max_depth(limits: &Limits) -> usize {
    limits.max_depth.min(durastep::limits::MAX_SUPPORTED_DEPTH)
}

/// Whether `name` is a valid name (event name, idempotency key, step name
/// base): not empty, within the key limit (at most
/// [`durastep::limits::MAX_SUPPORTED_KEY_BYTES`]), no control character.
///
/// ```
/// assert!(!durastep_fuzzkit::name_ok("a\u{0}", &Default::default()));
/// ```
pub fn name_ok(name: &str, limits: &Limits) -> bool {
    let max = limits.max_key_bytes.min(durastep::limits::MAX_SUPPORTED_KEY_BYTES);
    !name.is_empty() && name.len() <= max && !name.chars().any(char::is_control)
}

/// Drops a value without recursion (serde_json's own `Drop` recurses, and a
/// generated value may be 10,000 levels deep).
///
/// ```
/// let mut v = serde_json::json!(1);
/// for _ in 0..100_000 { v = serde_json::Value::Array(vec![v]); }
/// durastep_fuzzkit::drop_flat(v);
/// ```
pub fn drop_flat(v: Value) {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => stack.extend(map.into_iter().map(|(_, v)| v)),
            _ => {}
        }
    }
}
