//! Generators of hostile input: strings, names, numbers, JSON values, JSON
//! text and limits, biased toward what breaks parsers and databases (NUL
//! bytes, control characters, surrogate escapes, invalid UTF-8, sizes at and
//! past the limits, 10 MB strings, 10,000 levels of nesting, huge numbers,
//! duplicate keys). Nothing here recurses, so no case overflows the stack
//! while it is built.

use durastep::{Event, Limits};
use serde_json::{Map, Number, Value};

use crate::Source;

/// Ten megabytes: the size of the "huge" strings.
pub const HUGE: usize = 10 * 1024 * 1024;

/// Short pieces that strings are built from.
const PIECES: &[&str] = &[
    "a",
    "Z",
    "0",
    " ",
    "é",
    "ß",
    "\u{0}",
    "\u{1}",
    "\n",
    "\r",
    "\t",
    "\u{1b}",
    "\u{1f}",
    "\u{7f}",
    "\u{85}",
    "\u{a0}",
    "\u{200b}",
    "\u{200e}",
    "\u{2028}",
    "\u{2029}",
    "\u{feff}",
    "\u{fffd}",
    "\u{fffe}",
    "\u{ffff}",
    "\u{10ffff}",
    "\u{1F600}",
    "e\u{301}",
    "\"",
    "'",
    "\\",
    "\\ud800",
    "\\u0000",
    "\\\"",
    "/",
    "#",
    "#2",
    ":",
    "-",
    ".",
    "_",
    "[",
    "{",
    "]",
    "}",
    "~0~1",
    "%s",
    "$1",
    "?",
    "'; DROP TABLE durastep.runs; --",
    "\u{0}\u{0}",
];

/// Byte lengths at the edges of the default and supported limits.
const EDGE_LENGTHS: &[usize] = &[0, 1, 79, 80, 81, 255, 256, 511, 512, 513, 1023, 1024, 1025, 1400, 2704, 4096];

/// A hostile string. Mostly short; sometimes right at a limit's edge, long
/// (64 KiB) or lossy-decoded from invalid UTF-8 (U+FFFD where the bytes were
/// bad, which is all a `String` can hold of them); with `huge`, sometimes 10 MB.
pub fn string(src: &mut Source<'_>, huge: bool) -> String {
    match src.below(16) {
        0..=8 => (0..src.below(9)).map(|_| src.pick(PIECES)).collect(),
        9 | 10 => {
            // Right at an edge, from repeated pieces (compressible) or noise (not).
            let len = src.pick(EDGE_LENGTHS);
            if src.below(2) == 0 { repeat_to(src.pick(PIECES), len) } else { noise(src, len) }
        }
        11 => {
            let prefix: String = (0..src.below(4)).map(|_| src.pick(PIECES)).collect();
            prefix + &"x".repeat(src.range(1, 64 * 1024))
        }
        12 | 13 => {
            let mut bytes: Vec<u8> = (0..src.below(24)).map(|_| src.below(256) as u8).collect();
            bytes.extend_from_slice(src.pick(INVALID_UTF8));
            String::from_utf8_lossy(&bytes).into_owned()
        }
        14 if huge => repeat_to(src.pick(&["x", "é", "\u{1F600}", "\u{0}"]), HUGE),
        _ => src.pick(PIECES).to_owned(),
    }
}

/// Byte sequences that are not UTF-8: stray continuation bytes, overlong
/// forms, CESU-8 surrogates, truncated sequences, bytes that never occur.
const INVALID_UTF8: &[&[u8]] = &[
    b"\xff",
    b"\xc0\x80",
    b"\xed\xa0\x80",
    b"\xed\xb0\x80\xed\xa0\x80",
    b"\xe2\x82",
    b"\x80\x80",
    b"\xf4\x90\x80\x80",
    b"\xfe\xfe\xff\xff",
];

/// `piece` repeated until the string is `len` bytes (or just under, on a char boundary).
fn repeat_to(piece: &str, len: usize) -> String {
    let mut s = piece.repeat(len / piece.len().max(1) + 1);
    let mut cut = len.min(s.len());
    while !s.is_char_boundary(cut) {
        cut -= 1;
    }
    s.truncate(cut);
    s
}

/// `len` bytes of printable ASCII noise (incompressible, unlike a repeat).
fn noise(src: &mut Source<'_>, len: usize) -> String {
    let mut seeded = Source::seeded(src.u64());
    (0..len).map(|_| char::from(b'!' + seeded.below(94) as u8)).collect()
}

/// A name (event name, idempotency key, step name, function id, trigger):
/// a hostile string, or one that is nearly valid (a valid name with one bad
/// character, or at the length limits).
pub fn name(src: &mut Source<'_>, huge: bool) -> String {
    match src.below(4) {
        0 => {
            let base: String = (0..src.range(1, 12)).map(|_| src.pick(&["a", "b", "-", "_", ".", ":", "9"])).collect();
            if src.below(2) == 0 { base } else { base + src.pick(PIECES) }
        }
        _ => string(src, huge),
    }
}

/// A number at the edges of what JSON, serde_json and Postgres `numeric` hold.
pub fn number(src: &mut Source<'_>) -> Value {
    match src.below(18) {
        0 => Value::from(0),
        1 => Value::from(-1),
        2 => Value::from(i64::MIN),
        3 => Value::from(i64::MAX),
        4 => Value::from(u64::MAX),
        5 => Value::from(f64::MAX),
        6 => Value::from(f64::MIN),
        7 => Value::from(f64::MIN_POSITIVE),
        8 => Value::from(5e-324),
        9 => Value::from(-0.0),
        10 => Value::from(1e300),
        11 => Value::from(0.1),
        12 => Value::from(2.6079843774798866e-110),
        13 => Value::from(src.u64()),
        14 => Value::from(src.u64() as i64),
        // Any finite float (non-finite ones have no JSON form).
        _ => Number::from_f64(f64::from_bits(src.u64())).map_or(Value::Null, Value::Number),
    }
}

fn scalar(src: &mut Source<'_>, huge: bool) -> Value {
    match src.below(6) {
        0 => Value::Null,
        1 => Value::Bool(src.below(2) == 1),
        2 | 3 => number(src),
        _ => Value::String(string(src, huge)),
    }
}

/// Nesting depths around every edge: the default limit (64), the supported
/// ceiling (120), serde_json's own (128), and far past them.
pub const DEPTHS: &[usize] = &[1, 2, 3, 63, 64, 65, 119, 120, 121, 126, 127, 128, 129, 200, 1_000, 10_000];

/// A hostile JSON value: a random tree, a deep spine (up to `max_depth`
/// levels: see [`DEPTHS`]), a wide array or object, or a scalar. Drop deep
/// values with [`crate::drop_flat`] (serde_json's `Drop` recurses).
pub fn value(src: &mut Source<'_>, huge: bool, max_depth: usize) -> Value {
    match src.below(8) {
        0..=3 => tree(src, max_depth.min(200)),
        4 | 5 => {
            let depths: Vec<usize> = DEPTHS.iter().copied().filter(|d| *d <= max_depth).collect();
            let depth = src.pick(&depths);
            spine(src, huge, depth)
        }
        6 => wide(src),
        _ => scalar(src, huge),
    }
}

/// A random tree from a stream of operations (close, scalar, open array, open
/// object), without recursion; at most 256 nodes and `max_depth` levels, no
/// huge strings.
fn tree(src: &mut Source<'_>, max_depth: usize) -> Value {
    let mut stack: Vec<Value> = Vec::new();
    let mut budget = 256u32;
    loop {
        // Out of budget (or input), every operation is "close": the tree ends.
        budget = budget.saturating_sub(1);
        let op = if budget == 0 || src.is_exhausted() { 0 } else { src.below(4) };
        let done = match op {
            2 | 3 if stack.len() < max_depth => {
                stack.push(if op == 2 { Value::Array(Vec::new()) } else { Value::Object(Map::new()) });
                None
            }
            1 => Some(scalar(src, false)),
            _ => Some(stack.pop().unwrap_or(Value::Null)),
        };
        if let Some(v) = done {
            match stack.last_mut() {
                None => return v,
                Some(parent) => attach(src, parent, v),
            }
        }
    }
}

/// Puts `v` into a container; into an object under a hostile key, which may
/// be one it already has (the old value is replaced, as a duplicate key in JSON
/// text would be).
fn attach(src: &mut Source<'_>, parent: &mut Value, v: Value) {
    match parent {
        Value::Array(items) => items.push(v),
        Value::Object(map) => {
            let key = if src.below(4) == 0 { "k".to_owned() } else { string(src, false) };
            if let Some(old) = map.insert(key, v) {
                crate::drop_flat(old);
            }
        }
        _ => unreachable!("only containers are on the stack"),
    }
}

/// `depth` levels of arrays and objects around a scalar (huge only if
/// `huge`), with the odd sibling.
pub fn spine(src: &mut Source<'_>, huge: bool, depth: usize) -> Value {
    let mut v = scalar(src, huge);
    for _ in 0..depth {
        let mut parent = if src.below(2) == 0 { Value::Array(Vec::new()) } else { Value::Object(Map::new()) };
        if src.one_in(16) {
            let sibling = scalar(src, false);
            attach(src, &mut parent, sibling);
        }
        attach(src, &mut parent, v);
        v = parent;
    }
    v
}

/// A wide container: up to 10,000 elements or keys.
fn wide(src: &mut Source<'_>) -> Value {
    let n = src.pick(&[0, 1, 100, 1_000, 10_000]);
    if src.below(2) == 0 {
        Value::Array((0..n).map(|_| number(src)).collect())
    } else {
        Value::Object((0..n).map(|i| (format!("k{i}"), Value::from(i))).collect())
    }
}

/// Fragments that break (or nearly break) JSON text.
const FRAGMENTS: &[&str] = &[
    "\"\\ud800\"",
    "\"\\udc00\"",
    "\"\\udc00\\ud800\"",
    "\"\\ud800\\u0041\"",
    "\"\\udbff\\udfff\"",
    "\"\\uD83D\\uDE00\"",
    "\"\\u0000\"",
    "\"a\\u0000b\"",
    "\"\\u12\"",
    "\"\\x41\"",
    "\"\\/\\b\\f\\n\\r\\t\"",
    "\"\u{0}\"",
    "\"\u{1}\"",
    "\"\n\"",
    "1e400",
    "-1e400",
    "1e-400",
    "123456789012345678901234567890",
    "-0",
    "NaN",
    "Infinity",
    "01",
    "+1",
    ".5",
    "1.",
    "0x10",
    "[",
    "]",
    "{",
    "}",
    ",",
    ":",
    "\"",
    "\\",
    "\u{feff}",
    "\u{fffd}",
    "// c",
    "/* c */",
    "true",
    "nul",
];

/// Numbers as JSON text at the edges of f64, i64/u64 and Postgres `numeric`.
const NUMBER_TEXTS: &[&str] = &[
    "1e400",
    "-1e400",
    "1e-400",
    "0e99999",
    "123456789012345678901234567890",
    "-9223372036854775809",
    "18446744073709551615",
    "18446744073709551616",
    "1.7976931348623157e308",
    "1.7976931348623159e308",
    "2.4703282292062328e-324",
    "5e-324",
    "-0",
    "-0.0",
    "1E+2",
    "0.1e1",
];

/// Hostile JSON text: valid text of a hostile value, a valid text with a
/// hostile fragment spliced in, duplicate keys, deep brackets (to 100,000
/// levels), truncated text, edge numbers (up to 100,000 digits), padding and
/// trailing garbage, invalid UTF-8 lossy-decoded, and with `huge` 10 MB texts.
pub fn json_text(src: &mut Source<'_>, huge: bool) -> String {
    match src.below(12) {
        0 | 1 => valid_text(src),
        2 | 3 => {
            let mut text = valid_text(src);
            let at = boundary(&text, src.below(text.len() as u64 + 1) as usize);
            text.insert_str(at, src.pick(FRAGMENTS));
            text
        }
        4 => {
            let (a, b) = (valid_text(src), valid_text(src));
            let k = serde_json::to_string(&string(src, false)).expect("a string serializes");
            format!("{{{k}:{a},\"x\":1,{k}:{b}}}")
        }
        5 => {
            let depth = src.pick(&[64, 65, 120, 121, 127, 128, 129, 1_000, 10_000, 100_000]);
            let (open, close) = src.pick(&[("[", "]"), ("{\"a\":", "}"), ("[{\"\":", "}]")]);
            let mut text = open.repeat(depth);
            text.push_str(&serde_json::to_string(&scalar(src, false)).expect("a scalar serializes"));
            if src.below(4) != 0 {
                text.push_str(&close.repeat(depth));
            }
            text
        }
        6 => {
            let text = valid_text(src);
            let at = boundary(&text, src.below(text.len() as u64 + 1) as usize);
            text[..at].to_owned()
        }
        7 => match src.below(3) {
            0 => src.pick(NUMBER_TEXTS).to_owned(),
            1 => format!("1{}", "0".repeat(src.pick(&[19, 20, 308, 309, 400, 100_000]))),
            _ => format!("[0.{}1]", "0".repeat(src.pick(&[300, 330, 400, 100_000]))),
        },
        8 => {
            let text = valid_text(src);
            let pad = src.pick(&["", " ", "\n\t\r ", "\u{feff}", "\u{a0}", "\u{0}"]);
            let tail = src.pick(&["", " ", " {}", ",", "]", "\u{0}", " // c"]);
            format!("{pad}{text}{pad}{tail}")
        }
        9 => {
            let mut bytes = valid_text(src).into_bytes();
            let at = src.below(bytes.len() as u64 + 1) as usize;
            bytes.splice(at..at, src.pick(INVALID_UTF8).iter().copied());
            String::from_utf8_lossy(&bytes).into_owned()
        }
        10 if huge => match src.below(3) {
            0 => format!("\"{}\"", "x".repeat(HUGE)),
            1 => format!("[{}1]", "1,".repeat(HUGE / 2)),
            _ => format!("{}1", " ".repeat(HUGE)),
        },
        _ => {
            let fragment = src.pick(FRAGMENTS);
            if src.below(2) == 0 { format!("[{fragment}]") } else { format!("{{\"k\":{fragment}}}") }
        }
    }
}

/// JSON text of a hostile value (at most 200 levels, so serde_json's
/// recursive writer stays shallow), compact or pretty.
fn valid_text(src: &mut Source<'_>) -> String {
    let v = value(src, false, 200);
    let text = if src.below(2) == 0 { serde_json::to_string(&v) } else { serde_json::to_string_pretty(&v) };
    crate::drop_flat(v);
    text.expect("a Value serializes")
}

/// The char boundary at or before `at`.
fn boundary(text: &str, mut at: usize) -> usize {
    at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// Limits: the defaults, or values at and past every edge (0, 1, the
/// defaults, the supported ceilings, `usize::MAX`).
pub fn limits(src: &mut Source<'_>) -> Limits {
    if src.below(2) == 0 {
        return Limits::default();
    }
    Limits {
        max_payload_bytes: match src.below(3) {
            0 => src.pick(&[0, 1, 2, 64, 1024, 1024 * 1024, 16 * 1024 * 1024, usize::MAX]),
            _ => src.below(1 << 16) as usize,
        },
        max_depth: src.pick(&[0, 1, 2, 3, 63, 64, 65, 119, 120, 121, 127, 128, 10_000, usize::MAX]),
        max_key_bytes: match src.below(3) {
            0 => src.pick(&[0, 1, 8, 511, 512, 513, 1023, 1024, 1025, 4096, usize::MAX]),
            _ => src.below(2048) as usize,
        },
        ..Limits::default()
    }
}

/// An event's payload as the caller hands it over.
#[derive(Debug, Clone)]
pub enum Payload {
    /// A value, sent with [`Event::new`].
    Value(Value),
    /// JSON text, sent with [`Event::from_json`].
    Text(String),
}

/// A hostile event: its name, idempotency key and payload.
#[derive(Debug, Clone)]
pub struct EventCase {
    /// The event name.
    pub name: String,
    /// The idempotency key, if any.
    pub key: Option<String>,
    /// The payload.
    pub payload: Payload,
}

impl EventCase {
    /// The event as the library gets it.
    pub fn to_event(&self) -> Event {
        let event = match &self.payload {
            Payload::Value(v) => Event::new(self.name.clone(), v),
            Payload::Text(t) => Event::from_json(self.name.clone(), t.clone()),
        };
        match &self.key {
            Some(k) => event.idempotency_key(k.clone()),
            None => event,
        }
    }

    /// Drops the case without recursion.
    pub fn drop_flat(self) {
        if let Payload::Value(v) = self.payload {
            crate::drop_flat(v);
        }
    }
}

/// A hostile event. Its name is one of `names` half of the time (so that
/// it triggers a function), else hostile; values are at most `max_depth` deep
/// (building an [`Event`] from a value goes through serde, which recurses).
pub fn event(src: &mut Source<'_>, huge: bool, names: &[&str], max_depth: usize) -> EventCase {
    let name = if !names.is_empty() && src.below(2) == 0 { src.pick(names).to_owned() } else { name(src, huge) };
    let key = match src.below(3) {
        0 => None,
        1 => Some(format!("k-{}", src.u64())),
        _ => Some(self::name(src, huge)),
    };
    let payload = if src.below(2) == 0 {
        Payload::Value(value(src, huge, max_depth))
    } else {
        Payload::Text(json_text(src, huge))
    };
    EventCase { name, key, payload }
}
