//! Names and keys: event names, idempotency keys, step names, function ids and
//! triggers of any content and length, through the checks, `Event::validate`
//! and `EngineBuilder::build` (which must refuse a bad id or trigger before it
//! connects; the builder here has no database at all). The first bytes choose
//! the limits; the rest, split at the first 0xFF byte, is the name and the
//! trigger (decoded lossily). The property is `durastep_fuzzkit::check::names`.
#![no_main]

use durastep_fuzzkit::{Source, check, hostile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut src = Source::from_bytes(data);
    let limits = hostile::limits(&mut src);
    let rest = src.rest();
    let (name, trigger) = match rest.iter().position(|b| *b == 0xff) {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (rest, &b"t"[..]),
    };
    check::names(&String::from_utf8_lossy(name), &String::from_utf8_lossy(trigger), &limits);
});
