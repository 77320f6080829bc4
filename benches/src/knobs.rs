//! The benches' knobs: environment variables that change what they measure.

/// A whole-number knob: `None` when `name` is unset. A value that is not a
/// whole number stops the bench with the knob's name, instead of silently
/// measuring the default.
///
/// ```
/// use durastep_benches::knobs::whole_number;
/// assert_eq!(whole_number("DURASTEP_BENCHES_DOC_UNSET_KNOB"), None);
/// ```
pub fn whole_number(name: &str) -> Option<usize> {
    let v = std::env::var(name).ok()?;
    Some(v.trim().parse().unwrap_or_else(|_| panic!("{name}: {v:?} is not a whole number")))
}
