//! `durastep runs show`: one run, everything about it.

use chrono::{DateTime, Utc};
use durastep::RunState;
use durastep::inspect::Inspector;
use durastep::inspect::{AttemptOutcome, ErrorStanding, RunDetail, RunError, StepRecord, StepStatus};

use crate::cli::ShowArgs;
use crate::commands::why;
use crate::error::CliError;
use crate::format::{self, CELL};
use crate::output::Out;
use crate::table::Table;

/// `durastep runs show ID [--full]`.
pub async fn show(inspector: &Inspector, args: ShowArgs, out: &mut Out) -> Result<(), CliError> {
    let detail = inspector.run(args.id).await?;
    if out.json {
        return out.json(&detail);
    }
    render(&detail, args.full, out);
    Ok(())
}

fn render(d: &RunDetail, full: bool, out: &mut Out) {
    let r = &d.run;
    let cut = |s: &str| format::cell(s, CELL, full);
    let mut facts = Table::new(&["", ""]);
    let mut fact = |name: &str, value: String| facts.row(vec![name.to_owned(), value]);
    fact("id", r.id.to_string());
    fact("function", r.function_id.clone());
    fact("state", format!("{} (attempt {} of {})", r.state.as_str(), r.attempt, r.max_attempts));
    fact("created", format::time(r.created_at));
    if let Some(t) = r.finished_at {
        fact("finished", format!("{} (after {})", format::time(t), format::between(Some(r.created_at), Some(t))));
    } else {
        fact("due", format::time(r.run_at));
    }
    if let Some(e) = &d.error {
        let (name, text) = error_fact(e, r.max_attempts, &cut);
        fact(name, text);
    }
    if let Some(reason) = &r.cancel_reason {
        fact("cancelled", cut(reason));
    }
    if let Some(output) = &r.output {
        fact("output", format::json_cell(output, CELL, full));
    }
    if let Some(b) = &d.blocker {
        fact("why", why::blocker(b));
    }
    let e = &d.event;
    fact("event", format!("{} {} at {}", e.name, e.id, format::time(e.created_at)));
    if let Some(k) = &e.idempotency_key {
        fact("event key", k.clone());
    }
    fact("event data", format::json_cell(&e.data, CELL, full));
    out.block(&facts.render_rows());

    out.line("");
    out.line("executions");
    if d.attempts.is_empty() {
        out.line("  none yet");
    } else {
        let mut t = Table::new(&["ATTEMPT", "STARTED", "DURATION", "OUTCOME", "WORKER", "ERROR"]);
        for a in &d.attempts {
            let error = match (&a.error, &a.failed_step) {
                (Some(e), _) => cut(e),
                (None, Some(step)) => format!("at step {step}"),
                (None, None) => String::new(),
            };
            t.row(vec![
                a.attempt.to_string(),
                format::time(a.started_at),
                format::between(Some(a.started_at), a.ended_at),
                outcome(a.outcome).into(),
                a.worker_id.map(|w| w.to_string()).unwrap_or_else(|| "-".into()),
                error,
            ]);
        }
        out.block(&t.render());
    }

    out.line("");
    out.line("steps");
    if d.steps.is_empty() {
        out.line("  none stored");
    } else {
        let mut t = Table::new(&["STEP", "STATUS", "ATTEMPTS", "STARTED", "FINISHED", "DURATION", "OUTPUT / ERROR"]);
        // The sleep the run is in now (the others have woken).
        let asleep_in = d.blocker.as_ref().filter(|_| r.state == RunState::Sleeping).and_then(|b| b.step.as_deref());
        for s in &d.steps {
            let result = match (&s.error, &s.output) {
                (Some(e), _) => cut(e),
                (None, Some(_)) if s.is_sleep() => sleep_text(s, sleep_state(s, asleep_in, r.finished_at)),
                (None, Some(o)) => format::json_cell(o, CELL, full),
                (None, None) => String::new(),
            };
            t.row(vec![
                s.name.clone(),
                step_status(s, sleep_state(s, asleep_in, r.finished_at)).into(),
                s.attempts.to_string(),
                format::opt_time(s.started_at),
                format::opt_time(s.finished_at),
                // A sleep's duration is how long it sleeps, not the microseconds it took to store.
                format::opt_duration(if s.is_sleep() { s.slept } else { s.duration }),
                result,
            ]);
        }
        out.block(&t.render());
    }

    if !d.children.is_empty() {
        out.line("");
        out.line("children");
        let mut t = Table::new(&["RUN", "FUNCTION", "STATE"]);
        for c in &d.children {
            t.row(vec![c.id.to_string(), c.function_id.clone(), c.state.as_str().into()]);
        }
        out.block(&t.render());
    }

    out.line("");
    out.line("history");
    let mut t = Table::new(&["AT", "STATE", "ATTEMPT", "STEP", "ERROR / REASON"]);
    for h in &d.history {
        let state = if h.replayed { format!("{} (replayed)", h.state.as_str()) } else { h.state.as_str().into() };
        let note = match (&h.error, &h.cancel_reason) {
            (Some(e), _) => cut(e),
            (None, Some(reason)) => format!("reason: {}", cut(reason)),
            (None, None) => String::new(),
        };
        t.row(vec![format::time(h.at), state, h.attempt.to_string(), h.step.clone().unwrap_or_default(), note]);
    }
    out.block(&t.render());
}

/// The run's last error as one fact: its name says what the error is to the
/// run (recovered from, the run's failure, or an earlier attempt's).
fn error_fact(e: &RunError, max_attempts: u32, cut: &dyn Fn(&str) -> String) -> (&'static str, String) {
    let msg = cut(&e.message);
    let attempt = e.attempt.map(|a| format!("attempt {a}")).unwrap_or_else(|| "an earlier attempt".into());
    match e.standing {
        ErrorStanding::Recovered => ("recovered", format!("{msg} ({attempt} failed; a retry completed the run)")),
        ErrorStanding::Permanent => {
            ("failed", format!("permanently, at {attempt} of {max_attempts} (a permanent error: not retried): {msg}"))
        }
        ErrorStanding::Exhausted => ("failed", format!("on its last attempt ({attempt} of {max_attempts}): {msg}")),
        ErrorStanding::Retrying => ("last error", format!("{msg} ({attempt} failed; it runs again)")),
        ErrorStanding::BeforeCancel => ("last error", format!("{msg} ({attempt} failed before it was cancelled)")),
        _ => ("error", msg),
    }
}

/// A listing's error cell: the error, marked with what it is to the run.
pub fn error_cell(standing: Option<ErrorStanding>, cell: String) -> String {
    match standing {
        Some(ErrorStanding::Recovered) => format!("recovered: {cell}"),
        Some(ErrorStanding::Permanent) => format!("permanent: {cell}"),
        Some(ErrorStanding::Retrying) => format!("retrying: {cell}"),
        Some(ErrorStanding::BeforeCancel) => format!("before cancel: {cell}"),
        _ => cell,
    }
}

/// Where a sleep step stands.
#[derive(Clone, Copy, PartialEq)]
enum Sleep {
    /// The run is in it now.
    Asleep,
    /// It slept until its wake time.
    Slept,
    /// The run ended (cancelled, say) before its wake time.
    CutShort,
}

fn sleep_state(s: &StepRecord, asleep_in: Option<&str>, run_finished: Option<DateTime<Utc>>) -> Sleep {
    if asleep_in == Some(s.name.as_str()) {
        Sleep::Asleep
    } else if run_finished.zip(s.wake_at).is_some_and(|(f, w)| f < w) {
        Sleep::CutShort
    } else {
        Sleep::Slept
    }
}

fn step_status(s: &StepRecord, sleep: Sleep) -> &'static str {
    match s.status {
        StepStatus::Completed if s.is_sleep() => match sleep {
            Sleep::Asleep => "sleeping",
            Sleep::Slept => "slept",
            Sleep::CutShort => "cut short",
        },
        StepStatus::Completed if s.attempts > 1 => "completed after retry",
        StepStatus::Completed => "completed",
        StepStatus::Failed => "failed",
        _ => "other",
    }
}

/// A sleep step's wake time and how long it sleeps.
fn sleep_text(s: &StepRecord, sleep: Sleep) -> String {
    let how_long = s.slept.map(|d| format!(" ({})", format::duration(d))).unwrap_or_default();
    let until = format::opt_time(s.wake_at);
    match sleep {
        Sleep::Asleep => format!("sleeping until {until}{how_long}"),
        Sleep::Slept => format!("slept until {until}{how_long}"),
        Sleep::CutShort => format!("was to sleep until {until}{how_long}; the run ended first"),
    }
}

fn outcome(o: AttemptOutcome) -> &'static str {
    match o {
        AttemptOutcome::Running => "running",
        AttemptOutcome::Completed => "completed",
        AttemptOutcome::Retried => "failed, retried",
        AttemptOutcome::Failed => "failed",
        AttemptOutcome::LeaseLost => "lease lost",
        AttemptOutcome::Slept => "slept",
        AttemptOutcome::Waited => "waited",
        AttemptOutcome::Cancelled => "cancelled",
        AttemptOutcome::Released => "released",
        _ => "other",
    }
}
