//! Events built from arbitrary `serde_json::Value`s (`Event::new`), with
//! arbitrary names, idempotency keys and limits: hostile strings (NUL bytes,
//! control characters, long runs), deep nesting, wide objects. No panic; the
//! verdict of `Event::validate` (what `Engine::send` runs before any SQL) is
//! exactly the one an independent oracle gives.
#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use durastep::limits::{LimitError, Limits, MAX_SUPPORTED_DEPTH};
use durastep::Event;
use durastep_fuzz::{depth, drop_flat, has_nul, name_ok};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};

/// Deep enough to matter (the default limit is 64), shallow enough that
/// serde_json's recursive `to_value` inside `Event::new` cannot overflow.
const MAX_BUILD_DEPTH: usize = 1_000;

/// A string biased toward what hurts: NULs, control characters, long runs.
fn hostile_string(u: &mut Unstructured<'_>) -> arbitrary::Result<String> {
    Ok(match u.int_in_range(0..=7u8)? {
        0 => "\0".into(),
        1 => format!("a\u{0}{}", <&str>::arbitrary(u)?),
        2 => "x".repeat(usize::from(u16::arbitrary(u)?) * 16),
        3 => "\u{1}\u{1f}\u{7f}\u{85}\u{2028}\u{fffe}\u{10ffff}".into(),
        4 => "\\ud800\"".into(),
        _ => <&str>::arbitrary(u)?.to_owned(),
    })
}

fn scalar(u: &mut Unstructured<'_>) -> arbitrary::Result<Value> {
    Ok(match u.int_in_range(0..=5u8)? {
        0 => Value::Null,
        1 => Value::Bool(bool::arbitrary(u)?),
        2 => Value::from(i64::arbitrary(u)?),
        3 => Value::from(u64::arbitrary(u)?),
        // Non-finite floats become null in serde_json.
        4 => serde_json::to_value(f64::arbitrary(u)?).unwrap_or(Value::Null),
        _ => Value::String(hostile_string(u)?),
    })
}

/// Builds a value from a stream of operations (open array, open object, push a
/// scalar, close), without recursion.
fn value(u: &mut Unstructured<'_>) -> arbitrary::Result<Value> {
    // Each frame: the container being filled and, for objects, the next key.
    let mut stack: Vec<(Value, Option<String>)> = Vec::new();
    let mut done: Option<Value> = None;
    while done.is_none() {
        let op = if u.is_empty() { 3 } else { u.int_in_range(0..=4u8)? };
        let finished = match op {
            0 | 1 if stack.len() < MAX_BUILD_DEPTH => {
                let key = if matches!(stack.last(), Some((Value::Object(_), _))) { Some(hostile_string(u)?) } else { None };
                if let Some(top) = stack.last_mut() {
                    top.1 = key;
                }
                stack.push((if op == 0 { Value::Array(vec![]) } else { Value::Object(Map::new()) }, None));
                None
            }
            2 => Some(scalar(u)?),
            _ => stack.pop().map(|(v, _)| v).or(Some(Value::Null)),
        };
        if let Some(v) = finished {
            match stack.last_mut() {
                None => done = Some(v),
                Some((Value::Array(items), _)) => items.push(v),
                Some((Value::Object(map), key)) => {
                    let k = match key.take() {
                        Some(k) => k,
                        None => hostile_string(u)?,
                    };
                    if let Some(old) = map.insert(k, v) {
                        drop_flat(old);
                    }
                }
                Some(_) => unreachable!("only containers are on the stack"),
            }
        }
    }
    Ok(done.unwrap_or(Value::Null))
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(limits) = (|| -> arbitrary::Result<Limits> {
        Ok(if bool::arbitrary(&mut u)? {
            Limits::default()
        } else {
            Limits {
                max_payload_bytes: usize::from(u16::arbitrary(&mut u)?) * 4,
                max_depth: usize::from(u8::arbitrary(&mut u)?),
                max_key_bytes: usize::from(u8::arbitrary(&mut u)?) * 4,
            }
        })
    })() else {
        return;
    };
    let (Ok(name), Ok(key)) = (hostile_string(&mut u), Option::<()>::arbitrary(&mut u)) else { return };
    let key = match key {
        Some(()) => hostile_string(&mut u).ok(),
        None => None,
    };
    let Ok(payload) = value(&mut u) else { return };

    let mut event = Event::new(name.clone(), &payload);
    if let Some(k) = &key {
        event = event.idempotency_key(k.clone());
    }
    let verdict = event.validate(&limits);
    drop(event);

    // The oracle, in the order Engine::send checks: name, key, payload shape, size.
    let expected_name = if !name_ok(&name, limits.max_key_bytes) {
        Some("event name")
    } else if key.as_deref().is_some_and(|k| !name_ok(k, limits.max_key_bytes)) {
        Some("idempotency key")
    } else {
        None
    };
    match (&verdict, expected_name) {
        (Err(LimitError::InvalidName { what, value, .. }), Some(expected)) => {
            assert_eq!(*what, expected);
            assert!(value.chars().count() <= 80, "the error echoes at most 80 characters");
        }
        (_, Some(expected)) => panic!("{expected} should be refused, got {verdict:?}"),
        (_, None) => {
            let max_depth = limits.max_depth.min(MAX_SUPPORTED_DEPTH);
            let too_deep = depth(&payload) > max_depth;
            let nul = has_nul(&payload);
            let text = serde_json::to_string(&payload).expect("a Value always serializes");
            match &verdict {
                Err(LimitError::TooDeep { limit }) => assert!(too_deep && *limit == max_depth),
                Err(LimitError::NulCharacter) => assert!(nul),
                Err(LimitError::TooLarge { size, limit }) => {
                    assert!(!too_deep && !nul);
                    assert_eq!((*size, *limit), (text.len(), limits.max_payload_bytes));
                    assert!(size > limit);
                }
                Ok(()) => {
                    assert!(!too_deep && !nul && text.len() <= limits.max_payload_bytes, "wrongly accepted");
                    // What is stored comes back as the same value (through JSON text).
                    let back: Value = serde_json::from_str(&text).expect("stored text parses");
                    assert_eq!(back, payload, "payload does not survive the JSON round trip");
                    drop_flat(back);
                }
                Err(other) => panic!("unexpected refusal {other:?}"),
            }
        }
    }
    drop_flat(payload);
});
