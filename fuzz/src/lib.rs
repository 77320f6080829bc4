//! Oracles shared by the fuzz targets: independent, simple restatements of
//! the rules in `durastep::limits`, so a target can tell a correct refusal
//! from a wrong one (and a wrong acceptance from a right one).

use serde_json::Value;

/// Deepest nesting of arrays and objects (a scalar alone is 0), without recursion.
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

/// Whether any string or object key holds a NUL character.
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

/// Whether `name` is a valid name (event name, idempotency key, step name base).
pub fn name_ok(name: &str, max_key_bytes: usize) -> bool {
    !name.is_empty() && name.len() <= max_key_bytes && !name.chars().any(char::is_control)
}

/// Whether text of this shape can be stored in Postgres `text`/`jsonb`.
pub fn storable(s: &str) -> bool {
    !s.contains('\0')
}

/// Drops a value without recursion (serde_json's own drop recurses, and a
/// fuzzer-built value may be deep).
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
