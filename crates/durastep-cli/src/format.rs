//! How values look in tables: times, durations, long text.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

/// Table cells longer than this are cut (unless `--full`).
pub const CELL: usize = 200;

/// A time as RFC 3339 UTC, to the second: `2026-12-02T00:30:00Z`.
pub fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// [`time`], or `-` for none.
pub fn opt_time(t: Option<DateTime<Utc>>) -> String {
    t.map(time).unwrap_or_else(|| "-".into())
}

/// A duration, short: `340ms`, `1.2s`, `4m05s`, `3h20m`, `2d04h` (from a
/// minute up, to the nearest second: an hour's sleep whose record was stored
/// a few microseconds after its wake time was set shows as `1h00m`, not `59m59s`).
pub fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    let s = u64::try_from(ms.saturating_add(500) / 1_000).unwrap_or(u64::MAX);
    match s {
        _ if ms < 1 => format!("{}µs", d.as_micros()),
        _ if ms < 1_000 => format!("{ms}ms"),
        0..60 => format!("{:.1}s", d.as_secs_f64()),
        60..3_600 => format!("{}m{:02}s", s / 60, s % 60),
        3_600..86_400 => format!("{}h{:02}m", s / 3_600, s % 3_600 / 60),
        _ => format!("{}d{:02}h", s / 86_400, s % 86_400 / 3_600),
    }
}

/// [`duration`], or `-` for none.
pub fn opt_duration(d: Option<Duration>) -> String {
    d.map(duration).unwrap_or_else(|| "-".into())
}

/// The time between two instants, or `-` when one is missing or they are out of order.
pub fn between(a: Option<DateTime<Utc>>, b: Option<DateTime<Utc>>) -> String {
    opt_duration(a.zip(b).and_then(|(a, b)| (b - a).to_std().ok()))
}

/// Text made fit for one table cell: on one line, and cut to `max`
/// characters (with a note of how much was cut) unless `full`.
pub fn cell(text: &str, max: usize, full: bool) -> String {
    let one_line: String = text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect();
    let len = one_line.chars().count();
    if full || len <= max {
        return one_line;
    }
    let kept: String = one_line.chars().take(max).collect();
    format!("{kept}… (+{} chars)", len - max)
}

/// JSON as compact text, cut like [`cell`].
pub fn json_cell(value: &serde_json::Value, max: usize, full: bool) -> String {
    cell(&value.to_string(), max, full)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_short_and_readable() {
        let check = |d: Duration, shown: &str| assert_eq!(duration(d), shown, "{d:?}");
        check(Duration::from_micros(400), "400µs");
        check(Duration::from_millis(340), "340ms");
        check(Duration::from_millis(1_230), "1.2s");
        check(Duration::from_secs(245), "4m05s");
        check(Duration::from_secs(3 * 3_600 + 20 * 60 + 5), "3h20m");
        check(Duration::from_secs(2 * 86_400 + 4 * 3_600), "2d04h");
        check(Duration::from_secs(3_600) - Duration::from_micros(30), "1h00m");
        check(Duration::from_millis(59_400), "59.4s");
    }

    #[test]
    fn cells_are_one_line_and_cut_with_a_note() {
        assert_eq!(cell("a\nb", 10, false), "a b");
        assert_eq!(cell("abcdef", 3, false), "abc… (+3 chars)");
        assert_eq!(cell("abcdef", 3, true), "abcdef");
        assert_eq!(cell("ééé", 2, false), "éé… (+1 chars)");
    }

    #[test]
    fn times_are_rfc3339_utc() {
        let t = DateTime::parse_from_rfc3339("2026-12-02T01:30:00+01:00").unwrap().with_timezone(&Utc);
        assert_eq!(time(t), "2026-12-02T00:30:00Z");
    }
}
