//! JSON text payloads (`limits::parse_payload`, `Event::from_json`): the first
//! bytes choose the limits, the rest is the text (invalid UTF-8 decoded lossily,
//! as a caller's decoding would). No panic; every refusal is the right typed
//! `LimitError`; every acceptance is what serde_json parses, within the limits
//! and storable in jsonb. The property is `durastep_fuzzkit::check::json_text`,
//! which the CI smoke test (crates/durastep-fuzzkit/tests/fuzz_smoke.rs) drives too.
#![no_main]

use durastep_fuzzkit::{Source, check, drop_flat, hostile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut src = Source::from_bytes(data);
    let limits = hostile::limits(&mut src);
    let text = String::from_utf8_lossy(src.rest());
    if let Ok(value) = check::json_text(&text, &limits) {
        drop_flat(value);
    }
});
