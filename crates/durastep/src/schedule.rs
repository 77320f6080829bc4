//! Cron schedules: parsing (with `croner`), fire times in a time zone, and the
//! catch-up policy. Pure logic: the ticking and its SQL live in `worker.rs` and
//! `store/schedules.rs`.
//!
//! Daylight saving time follows croner's rules, which this module does not
//! change: a fixed-time expression (fixed second, minute and hour, such as
//! `30 2 * * *`) whose local time falls in a spring-forward gap fires once, at
//! the first instant after the gap (02:30 on the day Amsterdam skips 02:00-03:00
//! fires at 03:00 CEST); one whose local time occurs twice in a fall-back
//! overlap fires once, at the earlier instant (02:30 CEST, not 02:30 CET).
//! Interval and wildcard expressions (`*/15 * * * *`) skip the local times a
//! gap removes and fire on both passes of an overlap, since each is a real
//! instant a quarter of an hour after the previous one.

use std::fmt;

use chrono::{DateTime, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds};
use serde::{Deserialize, Serialize};

/// A cron expression in a time zone: 5 fields (minute, hour, day of month,
/// month, day of week) or 6 (with seconds first), with croner's extensions:
/// `L` (last day of the month, or `5L`: last Friday), `#` (`1#1`: first
/// Monday), `W` (nearest weekday), names (`MON`, `JAN`). When both the day of
/// month and the day of week are restricted, a day matching either fires
/// (POSIX cron).
///
/// ```
/// use chrono::TimeZone;
/// use chrono_tz::Europe::Amsterdam;
/// use durastep::Schedule;
///
/// // Story B: the Meta token rotation, on the first Monday of each quarter at 09:00.
/// let rotation = Schedule::new("0 9 * 1,4,7,10 MON#1", Amsterdam).unwrap();
/// let after = Amsterdam.with_ymd_and_hms(2027, 1, 1, 0, 0, 0).unwrap();
/// assert_eq!(rotation.next_after(after).unwrap(), Amsterdam.with_ymd_and_hms(2027, 1, 4, 9, 0, 0).unwrap());
///
/// // The Saturday 06:00 summary.
/// let summary = Schedule::new("0 6 * * SAT", Amsterdam).unwrap();
/// assert!(summary.next_after(after).is_some());
/// assert!(Schedule::new("61 * * * *", Amsterdam).is_err());
/// ```
#[derive(Clone)]
pub struct Schedule {
    expr: String,
    tz: Tz,
    cron: Cron,
}

/// A cron expression that does not parse.
///
/// ```
/// let err = durastep::Schedule::new("every day", chrono_tz::UTC).unwrap_err();
/// assert!(err.to_string().contains("every day"));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[error("invalid cron expression {expr:?}: {reason}")]
#[non_exhaustive]
pub struct ScheduleError {
    /// The expression.
    pub expr: String,
    /// croner's reason.
    pub reason: String,
}

impl Schedule {
    /// Parses `expr` for the time zone `tz` (any IANA zone of `chrono_tz`).
    ///
    /// ```
    /// let every_quarter_hour = durastep::Schedule::new("*/15 * * * *", chrono_tz::UTC).unwrap();
    /// # let _ = every_quarter_hour;
    /// ```
    pub fn new(expr: impl Into<String>, tz: Tz) -> Result<Self, ScheduleError> {
        let expr = expr.into();
        let cron = CronParser::builder()
            .seconds(Seconds::Optional)
            .build()
            .parse(&expr)
            .map_err(|e| ScheduleError { expr: expr.clone(), reason: e.to_string() })?;
        Ok(Schedule { expr, tz, cron })
    }

    /// The expression as given.
    ///
    /// ```
    /// assert_eq!(durastep::Schedule::new("0 6 * * SAT", chrono_tz::UTC).unwrap().expr(), "0 6 * * SAT");
    /// ```
    pub fn expr(&self) -> &str {
        &self.expr
    }

    /// The time zone.
    ///
    /// ```
    /// assert_eq!(durastep::Schedule::new("0 6 * * *", chrono_tz::Europe::Amsterdam).unwrap().tz(), chrono_tz::Europe::Amsterdam);
    /// ```
    pub fn tz(&self) -> Tz {
        self.tz
    }

    /// The first fire time strictly after `after` (None if there is none
    /// before the year 5000).
    ///
    /// ```
    /// use chrono::TimeZone;
    /// use chrono_tz::Europe::Amsterdam;
    /// // Story B: 23:55 in winter; the next 01:30 Amsterdam is 00:30 UTC.
    /// let s = durastep::Schedule::new("30 1 * * *", Amsterdam).unwrap();
    /// let at = Amsterdam.with_ymd_and_hms(2027, 1, 14, 23, 55, 0).unwrap();
    /// assert_eq!(s.next_after(at).unwrap(), chrono::Utc.with_ymd_and_hms(2027, 1, 15, 0, 30, 0).unwrap());
    /// ```
    pub fn next_after<T: chrono::TimeZone>(&self, after: DateTime<T>) -> Option<DateTime<Utc>> {
        let local = after.with_timezone(&self.tz);
        self.cron.find_next_occurrence(&local, false).ok().map(|t| t.with_timezone(&Utc))
    }

    /// The fire times in `(after, until]`, latest first, at most `max` of them.
    pub(crate) fn latest_in(&self, after: DateTime<Utc>, until: DateTime<Utc>, max: usize) -> Vec<DateTime<Utc>> {
        let mut out = Vec::new();
        let mut cursor = until.with_timezone(&self.tz);
        let mut inclusive = true;
        while out.len() < max {
            let Ok(t) = self.cron.find_previous_occurrence(&cursor, inclusive) else { break };
            let utc = t.with_timezone(&Utc);
            if utc <= after {
                break;
            }
            out.push(utc);
            cursor = t;
            inclusive = false;
        }
        out
    }
}

impl fmt::Debug for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Schedule").field("expr", &self.expr).field("tz", &self.tz).finish()
    }
}

/// What happens to the fire times missed while no worker was running.
///
/// ```
/// use durastep::CatchUp;
/// // Run the summary once for the latest missed Saturday, not once per missed week.
/// let policy = CatchUp::Latest;
/// // Or: every missed fire time, the most recent 24 at most.
/// let hourly = CatchUp::Each { max: 24 };
/// # let _ = (policy, hourly);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CatchUp {
    /// Only the latest missed fire time runs (the default).
    #[default]
    Latest,
    /// Every missed fire time runs, but only the most recent `max` of them.
    Each {
        /// The bound (at least 1).
        max: u32,
    },
}

impl CatchUp {
    pub(crate) fn bound(self) -> u32 {
        match self {
            CatchUp::Latest => 1,
            CatchUp::Each { max } => max.max(1),
        }
    }
}

/// The input of a run started by a cron schedule ([`crate::FunctionBuilder::on_cron`]).
///
/// ```
/// use durastep::{CronTick, Ctx, Function};
/// let summary = Function::new("saturday-summary")
///     .on_cron("0 6 * * SAT", chrono_tz::Europe::Amsterdam)
///     .handler(|_ctx: Ctx, tick: CronTick| async move {
///         Ok(format!("summary for the week before {}", tick.scheduled_at))
///     });
/// # let _ = summary;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CronTick {
    /// The fire time this run is for (not when it was started).
    pub scheduled_at: DateTime<Utc>,
}

/// The event name a function's cron ticks are sent under.
pub(crate) fn cron_event_name(function_id: &str) -> String {
    format!("durastep/cron:{function_id}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;
    use chrono_tz::Europe::Amsterdam;

    fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(y, mo, d, h, mi, 0).unwrap()
    }

    #[test]
    fn latest_in_is_bounded_and_latest_first() {
        let s = Schedule::new("* * * * *", chrono_tz::UTC).unwrap();
        let got = s.latest_in(utc(2027, 1, 1, 0, 0), utc(2027, 1, 1, 0, 10), 3);
        assert_eq!(got, vec![utc(2027, 1, 1, 0, 10), utc(2027, 1, 1, 0, 9), utc(2027, 1, 1, 0, 8)]);
        let all = s.latest_in(utc(2027, 1, 1, 0, 0), utc(2027, 1, 1, 0, 10), 100);
        assert_eq!(all.len(), 10, "the start of the window is excluded, its end included");
    }

    #[test]
    fn dst_gap_and_overlap_in_amsterdam() {
        let s = Schedule::new("30 2 * * *", Amsterdam).unwrap();
        // 2027-03-28: 02:00 CET jumps to 03:00 CEST; 02:30 fires at 03:00 CEST = 01:00 UTC.
        assert_eq!(s.next_after(utc(2027, 3, 27, 23, 0)), Some(utc(2027, 3, 28, 1, 0)));
        // 2027-10-31: 03:00 CEST falls back to 02:00 CET; 02:30 fires once, at 02:30 CEST = 00:30 UTC.
        assert_eq!(s.next_after(utc(2027, 10, 30, 22, 0)), Some(utc(2027, 10, 31, 0, 30)));
        assert_eq!(s.next_after(utc(2027, 10, 31, 0, 30)), Some(utc(2027, 11, 1, 1, 30)));
    }
}
