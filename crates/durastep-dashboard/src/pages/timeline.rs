//! A run's step timeline: every step, sleep, wait and child run as a span on
//! one time axis, drawn as a waterfall (an inline SVG; no script).
//!
//! The inspection API gives a step's execution times and a sleep's wake time,
//! but a wait (`ctx.wait_for_event`) or an invoke (`ctx.invoke`) is a record
//! the database stored when it resolved: [`StepRecord`] carries no start and
//! no kind for it. Both are derived here: the kind from the stored record (a
//! child outcome names `child_run_id`; a wait result `event_id` and `data`,
//! or `timed_out`), the start from the state history (the entry where the
//! run went `waiting` for it). A wait or invoke still pending is the run's
//! [`Blocker`], drawn from that entry to now with an open end.

use chrono::{DateTime, Utc};
use durastep::RunState;
use durastep::inspect::{Blocker, BlockerKind, HistoryEntry, RunDetail, StepRecord, StepStatus};
use maud::{Markup, html};
use serde_json::Value;
use uuid::Uuid;

use crate::html as shell;

/// What a row of the timeline is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A step's body running.
    Step,
    /// A durable sleep.
    Sleep,
    /// A wait for an event.
    Wait,
    /// A child run (`ctx.invoke`).
    Invoke,
    /// A step whose last execution failed.
    Failed,
}

impl Kind {
    const ALL: [Kind; 5] = [Kind::Step, Kind::Sleep, Kind::Wait, Kind::Invoke, Kind::Failed];

    /// The SVG class of its spans.
    pub(crate) fn class(self) -> &'static str {
        match self {
            Kind::Step => "step",
            Kind::Sleep => "sleep",
            Kind::Wait => "wait",
            Kind::Invoke => "invoke",
            Kind::Failed => "failed",
        }
    }

    pub(crate) fn color(self) -> &'static str {
        match self {
            Kind::Step => "#5b8def",
            Kind::Sleep => "#b49be0",
            Kind::Wait => "#e8a33d",
            Kind::Invoke => "#2a9d8f",
            Kind::Failed => "#d64545",
        }
    }

    fn legend(self) -> &'static str {
        match self {
            Kind::Step => "step",
            Kind::Sleep => "durable sleep",
            Kind::Wait => "wait for an event",
            Kind::Invoke => "child run (invoke)",
            Kind::Failed => "failure",
        }
    }
}

/// One row: a span of time of one kind.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    /// The step key (or what stands for it).
    pub(crate) name: String,
    pub(crate) kind: Kind,
    pub(crate) start: DateTime<Utc>,
    pub(crate) end: DateTime<Utc>,
    /// Still pending: drawn to now, with an open end.
    pub(crate) open: bool,
    /// The tooltip.
    pub(crate) title: String,
    /// The text beside the span (its duration and what it is).
    pub(crate) note: String,
    /// The child run of an invoke.
    pub(crate) child: Option<Uuid>,
}

/// A wait's or invoke's stored record, read for what it says.
enum Record {
    Wait {
        event: Option<Uuid>,
        timed_out: bool,
    },
    Invoke {
        child: Uuid,
        state: Option<String>,
    },
    /// Not a wait or invoke record, or one sealed so it cannot be read.
    Other,
}

fn record(output: Option<&Value>) -> Record {
    let Some(map) = output.and_then(Value::as_object) else { return Record::Other };
    if let Some(child) = map.get("child_run_id").and_then(Value::as_str).and_then(|s| Uuid::parse_str(s).ok()) {
        let state = map.get("state").and_then(Value::as_str).map(str::to_owned);
        return Record::Invoke { child, state };
    }
    if map.contains_key("event_id") && map.contains_key("data") {
        let event = map.get("event_id").and_then(Value::as_str).and_then(|s| Uuid::parse_str(s).ok());
        return Record::Wait { event, timed_out: false };
    }
    // `{"timed_out": true}`: a wait's timeout (an invoke's timeout stores the
    // same record, so the two cannot be told apart from it).
    if map.len() == 1 && map.get("timed_out") == Some(&Value::Bool(true)) {
        return Record::Wait { event: None, timed_out: true };
    }
    Record::Other
}

/// One suspension of the run in `waiting`: from the history entry where it
/// went waiting to the one where it left for a claim (`queued`: the event
/// came or the child finished; `running`: claimed at a timeout).
#[derive(Debug, Clone, Copy)]
struct Suspension {
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    /// By when its record was stored (a record stored later belongs to a
    /// later suspension); None: no bound yet.
    stored_by: Option<DateTime<Utc>>,
}

fn suspensions(history: &[HistoryEntry]) -> Vec<Suspension> {
    let mut out = Vec::new();
    for (i, h) in history.iter().enumerate() {
        let Some(next) = history.get(i + 1) else { continue };
        if h.state != RunState::Waiting || !matches!(next.state, RunState::Queued | RunState::Running) {
            continue;
        }
        // Its record is stored before the next claim; a claim straight from
        // waiting (a timeout) stores it in that attempt.
        let stored_by = if next.state == RunState::Running {
            history.get(i + 2).map(|c| c.at)
        } else {
            history[i + 1..].iter().find(|c| c.state == RunState::Running).map(|c| c.at)
        };
        out.push(Suspension { from: h.at, to: next.at, stored_by });
    }
    out
}

/// Pairs each wait or invoke record (indices into the steps, in the order
/// they were stored) with the suspension it ended.
///
/// The records' times are the database's wall clock (`clock_timestamp()`),
/// the history's the durastep clock (`durastep.now()`, which a test moves):
/// so when there are as many records as suspensions that ended in a claim
/// (each wait or invoke suspended the run once, the usual case) they pair in
/// order; otherwise (waits joined in one suspension, a replay from the start)
/// each record goes to the last suspension that began before it was stored
/// and was not yet followed by a claim then.
fn pair(records: &[(usize, DateTime<Utc>)], history: &[HistoryEntry]) -> Vec<(usize, Option<Suspension>)> {
    let held = suspensions(history);
    if held.len() == records.len() {
        return records.iter().zip(held).map(|(&(i, _), s)| (i, Some(s))).collect();
    }
    records
        .iter()
        .map(|&(i, stored)| {
            let s = held.iter().rev().find(|s| s.from <= stored).filter(|s| s.stored_by.is_none_or(|c| stored <= c));
            (i, s.copied())
        })
        .collect()
}

fn took(a: DateTime<Utc>, b: DateTime<Utc>) -> String {
    shell::duration((b - a).to_std().unwrap_or_default())
}

/// The span of each step record (None for one with no time at all), in the
/// order of `d.steps`.
pub(crate) fn step_spans(d: &RunDetail) -> Vec<Option<Span>> {
    let records: Vec<(usize, DateTime<Utc>)> = d
        .steps
        .iter()
        .enumerate()
        .filter(|(_, s)| stored_by_database(s))
        .filter(|(_, s)| !matches!(record(s.output.as_ref()), Record::Other))
        .filter_map(|(i, s)| Some((i, s.finished_at?)))
        .collect();
    let paired = pair(&records, &d.history);
    d.steps
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let held = paired.iter().find(|(j, _)| *j == i).and_then(|(_, h)| *h);
            step_span(s, held)
        })
        .collect()
}

/// Whether the database stored it (a wait's or a child's outcome), rather
/// than a worker running a step's body.
fn stored_by_database(s: &StepRecord) -> bool {
    s.status == StepStatus::Completed && !s.is_sleep() && s.started_at.is_none()
}

/// All the spans of a run: the steps' (see [`step_spans`]), then the pending
/// wait or invoke that holds it, if one does. `now` is the database clock's
/// (used for what is still pending).
pub(crate) fn spans(d: &RunDetail, steps: &[Option<Span>], now: DateTime<Utc>) -> Vec<Span> {
    let mut out: Vec<Span> = steps.iter().flatten().cloned().collect();
    if d.run.state == RunState::Waiting
        && let Some(b) = &d.blocker
        && let Some(span) = pending(b, &d.history, d.run.created_at, now)
    {
        out.push(span);
    }
    out
}

/// The span of one step record (`held`: the suspension a wait or invoke
/// ended); None for one with no time at all.
fn step_span(s: &StepRecord, held: Option<Suspension>) -> Option<Span> {
    let name = s.name.clone();
    let span = |kind, start, end, title, note| Span {
        name: name.clone(),
        kind,
        start,
        end,
        open: false,
        title,
        note,
        child: None,
    };
    if let (Some(f), Some(w)) = (s.finished_at, s.wake_at) {
        let slept = s.slept.map(shell::duration).unwrap_or_else(|| took(f, w));
        let title = format!("sleep {} until {} ({slept})", s.name, shell::time(w));
        return Some(span(Kind::Sleep, f, w, title, format!("sleep {slept}")));
    }
    if s.status != StepStatus::Completed {
        let f = s.finished_at?;
        let title = format!("{} failed at {} ({} execution(s))", s.name, shell::time(f), s.attempts);
        return Some(span(Kind::Failed, f, f, title, "failed".into()));
    }
    match (s.started_at, s.finished_at) {
        (Some(a), Some(b)) => {
            let d = s.duration.map(shell::duration).unwrap_or_else(|| took(a, b));
            let title = format!("{}: {} to {} ({d})", s.name, shell::time(a), shell::time(b));
            Some(span(Kind::Step, a, b, title, d))
        }
        // Stored by the database itself: a wait's or a child's outcome.
        (None, Some(stored)) => {
            // From when it suspended the run to when the run left `waiting`.
            let (start, f) = held.map_or((stored, stored), |h| (h.from, h.to));
            let how_long = match held {
                Some(h) => took(h.from, h.to),
                None => "did not hold the run".into(),
            };
            let (kind, title, note, child) = match record(s.output.as_ref()) {
                Record::Wait { event, timed_out } => {
                    let outcome = match (event, timed_out) {
                        (Some(e), _) => format!("resumed by event {e}"),
                        (None, true) => "timed out".into(),
                        (None, false) => "resumed".into(),
                    };
                    let short = match (event, timed_out) {
                        (Some(e), _) => format!("event {}", shell::short_id(e)),
                        (None, true) => "timed out".into(),
                        (None, false) => "resumed".into(),
                    };
                    let title = format!(
                        "wait {}: from {} to {} ({how_long}); {outcome}",
                        s.name,
                        shell::time(start),
                        shell::time(f)
                    );
                    (Kind::Wait, title, format!("waited {how_long} · {short}"), None)
                }
                Record::Invoke { child, state } => {
                    let state = state.unwrap_or_else(|| "finished".into());
                    let title = format!(
                        "invoke {}: child run {child} {state}; from {} to {} ({how_long})",
                        s.name,
                        shell::time(start),
                        shell::time(f)
                    );
                    (
                        Kind::Invoke,
                        title,
                        format!("child run {} {state} · {how_long}", shell::short_id(child)),
                        Some(child),
                    )
                }
                Record::Other => {
                    let title = format!("{} stored at {}", s.name, shell::time(f));
                    return Some(span(Kind::Step, f, f, title, String::new()));
                }
            };
            Some(Span { name, kind, start, end: f, open: false, title, note, child })
        }
        _ => None,
    }
}

/// The wait or invoke that holds a waiting run, from when it went waiting to now.
fn pending(b: &Blocker, history: &[HistoryEntry], created: DateTime<Utc>, now: DateTime<Utc>) -> Option<Span> {
    let start = history.iter().rev().find(|h| h.state == RunState::Waiting).map_or(created, |h| h.at);
    let end = now.max(start);
    let so_far = took(start, end);
    let detail = b.detail.as_deref().unwrap_or("?");
    let (kind, what, child) = match b.kind {
        BlockerKind::WaitForEvent => (Kind::Wait, format!("waiting for {detail}"), None),
        BlockerKind::Invoke => {
            let child = Uuid::parse_str(detail).ok();
            (Kind::Invoke, format!("child run {detail}"), child)
        }
        _ => return None,
    };
    let name = b.step.clone().unwrap_or_else(|| if kind == Kind::Wait { "(wait)" } else { "(invoke)" }.into());
    let title = format!("{name}: {what}, since {} ({so_far} so far)", shell::time(start));
    let note = match child {
        Some(c) => format!("child run {} · {so_far} so far", shell::short_id(c)),
        None => format!("{what} · {so_far} so far"),
    };
    Some(Span { name, kind, start, end, open: true, title, note, child })
}

/// The time axis: from the run's creation to its last recorded moment (now,
/// while something is pending).
pub(crate) struct Axis {
    pub(crate) start: DateTime<Utc>,
    pub(crate) end: DateTime<Utc>,
}

impl Axis {
    pub(crate) fn of(d: &RunDetail, spans: &[Span]) -> Axis {
        let start = d.run.created_at;
        let mut end = d.run.finished_at.unwrap_or(start);
        for s in spans {
            end = end.max(s.end).max(s.start);
        }
        Axis { start, end }
    }

    /// Where `t` falls on a line `width` long (0 to width).
    pub(crate) fn at(&self, t: DateTime<Utc>, width: f64) -> f64 {
        let span = (self.end - self.start).num_microseconds().unwrap_or(1).max(1) as f64;
        ((t - self.start).num_microseconds().unwrap_or(0) as f64 / span * width).clamp(0.0, width)
    }
}

/// The waterfall: one row per span, a legend of the kinds below.
pub(crate) fn waterfall(spans: &[Span], axis: &Axis) -> Markup {
    if spans.is_empty() {
        return html! {};
    }
    const W: f64 = 560.0;
    const ROW: usize = 18;
    const LABEL: f64 = 160.0;
    const NOTE: f64 = 300.0;
    let x = |t: DateTime<Utc>| LABEL + axis.at(t, W);
    let rows = spans.len() * ROW + 4;
    let height = rows + 40;
    let width = LABEL + W + 14.0 + NOTE;
    html! {
        h2 { "Timeline" }
        svg #waterfall width=(width) height=(height) viewBox=(format!("0 0 {width} {height}")) role="img"
            aria-label="step timeline" style="background:#fff;border:1px solid #d8dde3;max-width:100%;height:auto" {
            @for (i, s) in spans.iter().enumerate() {
                @let y = i * ROW + 4;
                @let (a, b) = (x(s.start), x(s.end));
                text x="4" y=(y + 11) font-size="11" { (super::overview::short(&s.name, 24)) }
                rect class=(s.kind.class()) x=(format!("{a:.1}")) y=(y) width=(format!("{:.1}", (b - a).max(2.0)))
                    height="12" fill=(s.kind.color()) fill-opacity=(if s.open { "0.7" } else { "1" }) {
                    title { (s.title) }
                }
                @if s.open {
                    // The open end: still pending at now.
                    polygon class="open" points=(format!("{b:.1},{} {:.1},{} {b:.1},{}", y - 1, b + 7.0, y + 6, y + 13))
                        fill=(s.kind.color()) { title { (s.title) } }
                }
                @let note_x = LABEL + W + 14.0;
                @match s.child {
                    Some(c) => a href={ "/runs/" (c) } {
                        text.note x=(note_x) y=(y + 11) font-size="11" fill="#1b1f24" { (s.note) title { (s.title) } }
                    },
                    _ => text.note x=(note_x) y=(y + 11) font-size="11" fill="#444" { (s.note) title { (s.title) } },
                }
            }
            text x=(LABEL) y=(rows + 12) font-size="10" { (shell::time(axis.start)) }
            text x=(LABEL + W) y=(rows + 12) font-size="10" text-anchor="end" { (shell::time(axis.end)) }
            @for (i, k) in Kind::ALL.iter().enumerate() {
                @let lx = 4.0 + i as f64 * 150.0;
                rect.legend x=(lx) y=(rows + 24) width="10" height="10" fill=(k.color()) {}
                text x=(lx + 14.0) y=(rows + 33) font-size="11" { (k.legend()) }
            }
            text x=(4.0 + 5.0 * 150.0) y=(rows + 33) font-size="11" { "▸ still pending (drawn to now)" }
        }
    }
}
