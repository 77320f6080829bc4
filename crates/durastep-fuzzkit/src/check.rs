//! The properties the fuzz targets and the smoke test check: each drives the
//! library's own checks with one input, panics if the verdict is not the one
//! an independent oracle gives (or if anything panics inside), and returns the
//! library's verdict so an end-to-end test can compare it with what the
//! engine then does.

use std::sync::OnceLock;

use durastep::limits::{self, LimitError, Limits};
use durastep::{Engine, Error, Event, Function};
use serde_json::Value;

use crate::hostile::{EventCase, Payload};
use crate::{depth, has_nul, max_depth, name_ok, text_depth};

/// Asserts that a refusal echoes at most 80 characters of the refused value.
fn short_echo(err: &LimitError) {
    if let LimitError::InvalidName { value, .. } = err {
        assert!(value.chars().count() <= 80, "the error echoes {} characters", value.chars().count());
    }
}

/// JSON text as a payload (`limits::parse_payload`, `Event::from_json`): every
/// refusal is the right typed `LimitError`; every acceptance is what
/// serde_json parses, within the limits and storable in `jsonb` (no NUL).
/// Returns the parsed value when the text is accepted.
pub fn json_text(text: &str, limits: &Limits) -> Result<Value, LimitError> {
    let max_depth = max_depth(limits);
    let parsed = serde_json::from_str::<Value>(text);
    let verdict = limits::parse_payload(text, limits);
    match &verdict {
        Ok(value) => {
            assert!(text.len() <= limits.max_payload_bytes, "accepted oversized text");
            assert!(depth(value) <= max_depth, "accepted too deep a value");
            let nesting = text_depth(text).expect("serde_json parses what was accepted");
            assert!(nesting <= max_depth, "accepted text nested {nesting} deep");
            assert!(!has_nul(value), "accepted a NUL character");
            assert_eq!(parsed.as_ref().ok(), Some(value), "accepted text serde_json refuses, or parsed differently");
        }
        Err(LimitError::TooLarge { size, limit }) => {
            assert_eq!((*size, *limit), (text.len(), limits.max_payload_bytes));
            assert!(size > limit);
        }
        Err(LimitError::TooDeep { limit }) => {
            assert_eq!(*limit, max_depth);
            assert!(text.len() <= limits.max_payload_bytes);
            // The limit is on the text: a deep value that a later duplicate
            // key replaces still counts, as whitespace counts toward the size.
            if let Some(nesting) = text_depth(text) {
                assert!(nesting > max_depth, "refused as too deep: {nesting}");
            }
        }
        Err(LimitError::NulCharacter) => {
            let v = parsed.as_ref().expect("NulCharacter for text serde_json refuses");
            assert!(has_nul(v) && depth(v) <= max_depth);
            assert!(text_depth(text).is_some_and(|d| d <= max_depth));
        }
        Err(LimitError::InvalidJson(reason)) => {
            assert!(parsed.is_err(), "valid JSON refused as invalid");
            assert!(reason.len() < 200, "the reason echoes the input: {reason}");
        }
        Err(other) => panic!("unexpected refusal: {other:?}"),
    }
    // What is sent to Postgres: compact text, NUL-free, within the limit,
    // which reads back as the same value.
    let stored = verdict.clone().and_then(|v| limits::check_payload(&v, limits).map(|text| (v, text)));
    if let Ok((value, stored)) = &stored {
        assert!(!stored.contains('\0') && stored.len() <= limits.max_payload_bytes);
        assert_eq!(
            serde_json::from_str::<Value>(stored).ok().as_ref(),
            Some(value),
            "stored text reads back differently"
        );
    }
    // The same text through the public event API: the same verdict.
    let through_event = Event::from_json("e", text).validate(limits);
    if name_ok("e", limits) {
        assert_eq!(through_event, stored.map(|_| ()), "Event::from_json disagrees with parse_payload + check_payload");
    } else {
        assert!(matches!(through_event, Err(LimitError::InvalidName { what: "event name", .. })), "{through_event:?}");
    }
    if let Ok(Value::Number(_) | Value::String(_)) = &parsed {
        // Scalars parse with no nesting at all.
        assert!(!matches!(verdict, Err(LimitError::TooDeep { .. })));
    }
    if let Ok(v) = parsed {
        crate::drop_flat(v);
    }
    verdict
}

/// An event (`Event::new` or `Event::from_json`, with a name and maybe an
/// idempotency key): `Event::validate`, which `Engine::send` runs before any
/// SQL, gives exactly the oracle's verdict, checked in the engine's order
/// (name, key, payload). Returns that verdict.
pub fn event(case: &EventCase, limits: &Limits) -> Result<(), LimitError> {
    let verdict = case.to_event().validate(limits);
    if let Err(e) = &verdict {
        short_echo(e);
    }
    let bad_name = !name_ok(&case.name, limits);
    let bad_key = case.key.as_deref().is_some_and(|k| !name_ok(k, limits));
    if bad_name || bad_key {
        let expected = if bad_name { "event name" } else { "idempotency key" };
        match &verdict {
            Err(LimitError::InvalidName { what, .. }) => assert_eq!(*what, expected),
            other => panic!("{expected} should be refused, got {other:?}"),
        }
        return verdict;
    }
    if case.name.starts_with(limits::RESERVED_EVENT_PREFIX) {
        assert!(matches!(verdict, Err(LimitError::ReservedName { .. })), "{verdict:?}");
        return verdict;
    }
    match &case.payload {
        Payload::Text(text) => {
            let expected = json_text(text, limits).and_then(|v| {
                let checked = limits::check_payload(&v, limits).map(|_| ());
                crate::drop_flat(v);
                checked
            });
            assert_eq!(verdict, expected, "Event::from_json verdict");
        }
        Payload::Value(payload) => {
            let max_depth = max_depth(limits);
            let too_deep = depth(payload) > max_depth;
            let nul = has_nul(payload);
            match &verdict {
                Err(LimitError::TooDeep { limit }) => assert!(too_deep && *limit == max_depth),
                Err(LimitError::NulCharacter) => assert!(nul),
                Err(LimitError::TooLarge { size, limit }) => {
                    assert!(!too_deep && !nul);
                    let text = serde_json::to_string(payload).expect("a Value serializes");
                    assert_eq!((*size, *limit), (text.len(), limits.max_payload_bytes));
                    assert!(size > limit);
                }
                Ok(()) => {
                    assert!(!too_deep && !nul, "wrongly accepted");
                    let text = serde_json::to_string(payload).expect("a Value serializes");
                    assert!(text.len() <= limits.max_payload_bytes, "wrongly accepted");
                    // What is stored comes back as the same value (through JSON text).
                    let back: Value = serde_json::from_str(&text).expect("stored text parses");
                    assert_eq!(&back, payload, "payload does not survive the JSON round trip");
                }
                Err(other) => panic!("unexpected refusal {other:?}"),
            }
        }
    }
    verdict
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("runtime"))
}

fn check_refusal(result: Result<(), LimitError>, what: &str, should_pass: bool) {
    match result {
        Ok(()) => assert!(should_pass, "{what} wrongly accepted"),
        Err(LimitError::InvalidName { what: w, value, .. }) => {
            assert!(!should_pass, "{what} wrongly refused");
            assert_eq!(w, what);
            assert!(value.chars().count() <= 80);
        }
        Err(other) => panic!("{what}: unexpected refusal {other:?}"),
    }
}

/// A string as event name, idempotency key, step name and function id, and a
/// second one as a trigger: each check gives the oracle's verdict, and
/// `EngineBuilder::build` (with no database configured) refuses a bad id or
/// trigger before it would connect, and otherwise gets as far as
/// `Error::NoDatabase`.
pub fn names(name: &str, trigger: &str, limits: &Limits) {
    // Only the key limit applies to names (the payload of the events built
    // here, `null`, must fit).
    let limits = &Limits { max_key_bytes: limits.max_key_bytes, ..Limits::default() };
    let base = name_ok(name, limits);
    check_refusal(limits::check_name("event name", name, limits), "event name", base);
    check_refusal(limits::check_step_name(name, limits), "step name", base && !name.contains('#'));
    let id_ok = base && name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.:".contains(c));
    check_refusal(limits::check_function_id(name, limits), "function id", id_ok);
    if base {
        assert!(!name.contains('\0'), "an accepted name holds NUL");
    }

    check_refusal(Event::new(name, &()).validate(limits), "event name", base);
    let as_key = Event::new("e", &()).idempotency_key(name).validate(limits);
    if name_ok("e", limits) {
        check_refusal(as_key, "idempotency key", base);
    } else {
        check_refusal(as_key, "event name", false);
    }

    let trigger_ok = name_ok(trigger, limits);
    let f = Function::new(name).on_event(trigger).handler(|_ctx, _x: ()| async { Ok(()) });
    let built = runtime().block_on(Engine::builder().limits(*limits).function(f).build());
    match built {
        Err(Error::NoDatabase) => assert!(id_ok && trigger_ok, "bad function definition got past validation"),
        Err(Error::Limit(LimitError::InvalidName { what, .. })) => {
            assert!(!(id_ok && trigger_ok), "good function definition refused");
            assert_eq!(what, if id_ok { "event name" } else { "function id" });
        }
        Err(other) => panic!("unexpected build error {other}"),
        Ok(_) => panic!("built an engine without a database"),
    }
}
