//! Events built by `durastep_fuzzkit::hostile::event` from the fuzzer's bytes:
//! value payloads (`Event::new`: hostile strings, edge numbers, deep and wide
//! nesting, duplicate keys) and JSON text payloads (`Event::from_json`), with
//! hostile names and idempotency keys, under hostile limits. No panic; the
//! verdict of `Event::validate` (what `Engine::send` runs before any SQL) is
//! exactly the oracle's (`durastep_fuzzkit::check::event`, which the CI smoke
//! test drives too).
#![no_main]

use durastep_fuzzkit::{Source, check, hostile};
use libfuzzer_sys::fuzz_target;

/// Deep enough to matter (the ceiling is 120), shallow enough that serde's
/// recursive `to_value` inside `Event::new` cannot overflow the stack.
const MAX_BUILD_DEPTH: usize = 1_000;

fuzz_target!(|data: &[u8]| {
    let mut src = Source::from_bytes(data);
    let limits = hostile::limits(&mut src);
    // No 10 MB strings here (they would slow every run); the limits go down to 0 bytes instead.
    let case = hostile::event(&mut src, false, &["e"], MAX_BUILD_DEPTH);
    let _ = check::event(&case, &limits);
    case.drop_flat();
});
