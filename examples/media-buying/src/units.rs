//! Durations and amounts as people read them ("4 h 0 min", not "14398.72 s").

use std::time::Duration;

/// A duration in the two largest units that matter: `850 ms`, `2.4 s`,
/// `3 min 12 s`, `4 h 0 min`, `2 d 3 h`.
///
/// ```
/// use media_buying::units::human;
/// use std::time::Duration;
/// assert_eq!(human(Duration::from_secs_f64(14_398.72)), "4 h 0 min");
/// assert_eq!(human(Duration::from_millis(2_430)), "2.4 s");
/// ```
pub fn human(d: Duration) -> String {
    let ms = d.as_millis();
    let s = d.as_secs();
    if ms < 1_000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{:.1} s", d.as_secs_f64())
    } else if s < 3_600 {
        let s = (d.as_secs_f64()).round() as u64;
        format!("{} min {} s", s / 60, s % 60)
    } else if s < 86_400 {
        let m = (d.as_secs_f64() / 60.0).round() as u64;
        format!("{} h {} min", m / 60, m % 60)
    } else {
        let h = (d.as_secs_f64() / 3_600.0).round() as u64;
        format!("{} d {} h", h / 24, h % 24)
    }
}

/// [`human`] of a number of seconds (negative ones count as zero).
///
/// ```
/// assert_eq!(media_buying::units::human_secs(0.25), "250 ms");
/// ```
pub fn human_secs(secs: f64) -> String {
    human(Duration::from_secs_f64(secs.max(0.0)))
}

/// Cents as euros: `EUR 25.00`.
///
/// ```
/// assert_eq!(media_buying::units::euros(2_505), "EUR 25.05");
/// assert_eq!(media_buying::units::euros(-150), "EUR -1.50");
/// ```
pub fn euros(cents: i64) -> String {
    let sign = if cents < 0 { "-" } else { "" };
    format!("EUR {sign}{}.{:02}", cents.abs() / 100, cents.abs() % 100)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_range_reads_in_human_units() {
        assert_eq!(human(Duration::from_millis(0)), "0 ms");
        assert_eq!(human(Duration::from_millis(999)), "999 ms");
        assert_eq!(human(Duration::from_millis(59_940)), "59.9 s");
        assert_eq!(human(Duration::from_secs(192)), "3 min 12 s");
        assert_eq!(human(Duration::from_secs(3_599)), "59 min 59 s");
        assert_eq!(human(Duration::from_secs(3_600)), "1 h 0 min");
        assert_eq!(human(Duration::from_secs_f64(14_398.72)), "4 h 0 min");
        assert_eq!(human(Duration::from_secs(3 * 86_400 + 5 * 3_600)), "3 d 5 h");
    }
}
