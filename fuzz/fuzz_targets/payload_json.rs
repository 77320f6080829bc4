//! JSON text payloads (`limits::parse_payload`, `Event::from_json`): any bytes,
//! any limits. No panic; every refusal is the right typed `LimitError`; every
//! acceptance is what serde_json parses, within the limits and storable in jsonb.
#![no_main]

use arbitrary::Arbitrary;
use durastep::limits::{self, LimitError, Limits};
use durastep::Event;
use durastep_fuzz::{depth, has_nul};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    max_depth: u8,
    max_payload_bytes: u16,
    default_limits: bool,
    text: &'a str,
}

fuzz_target!(|input: Input<'_>| {
    let limits = if input.default_limits {
        Limits::default()
    } else {
        Limits {
            max_payload_bytes: usize::from(input.max_payload_bytes),
            max_depth: usize::from(input.max_depth),
            ..Limits::default()
        }
    };
    let max_depth = limits.max_depth.min(limits::MAX_SUPPORTED_DEPTH);
    let text = input.text;
    let parsed = serde_json::from_str::<serde_json::Value>(text);
    match limits::parse_payload(text, &limits) {
        Ok(value) => {
            assert!(text.len() <= limits.max_payload_bytes, "accepted oversized text");
            assert!(depth(&value) <= max_depth, "accepted too deep a value");
            assert!(!has_nul(&value), "accepted a NUL character");
            assert_eq!(parsed.as_ref().ok(), Some(&value), "accepted text serde_json refuses, or parsed differently");
            // The text sent to Postgres: compact, NUL-free, re-checked.
            if let Ok(stored) = limits::check_payload(&value, &limits) {
                assert!(!stored.contains('\0') && stored.len() <= limits.max_payload_bytes);
                assert_eq!(serde_json::from_str::<serde_json::Value>(&stored).ok(), Some(value));
            }
        }
        Err(LimitError::TooLarge { size, limit }) => {
            assert_eq!((size, limit), (text.len(), limits.max_payload_bytes));
            assert!(size > limit);
        }
        Err(LimitError::TooDeep { limit }) => {
            assert_eq!(limit, max_depth);
            assert!(text.len() <= limits.max_payload_bytes);
            if let Ok(v) = &parsed {
                assert!(depth(v) > max_depth, "refused as too deep: {}", depth(v));
            }
        }
        Err(LimitError::NulCharacter) => {
            let v = parsed.as_ref().expect("NulCharacter for text serde_json refuses");
            assert!(has_nul(v) && depth(v) <= max_depth);
        }
        Err(LimitError::InvalidJson(_)) => {
            assert!(parsed.is_err(), "valid JSON refused as invalid");
        }
        Err(other) => panic!("unexpected refusal: {other:?}"),
    }
    // The same text through the public event API: same verdict on the payload.
    let verdict = Event::from_json("fuzz/event", text).validate(&limits);
    if let Err(e) = &verdict {
        assert!(!matches!(e, LimitError::InvalidName { .. } | LimitError::Serialize(_)), "{e:?}");
    }
});
