//! `durastep runs show`: one run, everything about it.

use durastep::Engine;
use durastep::inspect::{AttemptOutcome, RunDetail, StepStatus};

use crate::cli::ShowArgs;
use crate::commands::why;
use crate::error::CliError;
use crate::format::{self, CELL};
use crate::output::Out;
use crate::table::Table;

/// `durastep runs show ID [--full]`.
pub async fn show(engine: &Engine, args: ShowArgs, out: &mut Out) -> Result<(), CliError> {
    let detail = engine.inspect().run(args.id).await?;
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
    if let Some(e) = &r.last_error {
        fact("error", cut(e));
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
        for s in &d.steps {
            let status = match s.status {
                StepStatus::Completed => "completed",
                StepStatus::Failed => "failed",
                _ => "other",
            };
            let result = match (&s.error, &s.output) {
                (Some(e), _) => cut(e),
                (None, Some(o)) => format::json_cell(o, CELL, full),
                (None, None) => String::new(),
            };
            t.row(vec![
                s.name.clone(),
                status.into(),
                s.attempts.to_string(),
                format::opt_time(s.started_at),
                format::opt_time(s.finished_at),
                format::opt_duration(s.duration),
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
    let mut t = Table::new(&["AT", "STATE", "ATTEMPT", "STEP", "ERROR"]);
    for h in &d.history {
        t.row(vec![
            format::time(h.at),
            h.state.as_str().into(),
            h.attempt.to_string(),
            h.step.clone().unwrap_or_default(),
            h.error.as_deref().map(cut).unwrap_or_default(),
        ]);
    }
    out.block(&t.render());
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
