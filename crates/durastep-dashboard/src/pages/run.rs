//! One run: its state, why it is not running, the replay and cancel forms, its
//! event, step timeline, executions, state history and children.

use std::fmt::Write as _;

use axum::extract::{Path, Query, State};
use axum::response::Html;
use chrono::{DateTime, Utc};
use durastep::RunState;
use durastep::inspect::{Blocker, RunDetail, StepStatus};
use serde::Deserialize;
use uuid::Uuid;

use super::{HIDDEN, PageError, PageResult};
use crate::App;
use crate::html::{self, esc};

/// `?done=` after an action redirected here.
#[derive(Deserialize)]
pub(crate) struct Notice {
    #[serde(default)]
    done: String,
}

/// Parses a run id from the path (a 404, not a 400, when it is not one).
pub(crate) fn run_id(raw: &str) -> Result<Uuid, PageError> {
    Uuid::parse_str(raw).map_err(|_| PageError::NotFound(format!("{raw:?} is not a run id")))
}

/// GET /runs/{id}
pub(crate) async fn show(State(app): State<App>, Path(raw): Path<String>, Query(n): Query<Notice>) -> PageResult {
    let id = run_id(&raw)?;
    let d = app.engine.inspect().run(id).await?;
    let mut body = String::new();
    let r = &d.run;
    let _ = write!(body, "<h1>Run <code>{}</code></h1>", r.id);
    match n.done.as_str() {
        "replayed" => body.push_str("<p class=\"s s-queued\">Replay queued.</p>"),
        "cancelled" => body.push_str("<p class=\"s s-cancelled\">Cancelled.</p>"),
        _ => {}
    }
    let _ = write!(
        body,
        "<table><tr><th>Function</th><td><a href=\"/runs{}\">{}</a></td></tr>\
         <tr><th>State</th><td id=\"state\">{}</td></tr>\
         <tr><th>Attempt</th><td>{} of {}</td></tr>\
         <tr><th>Created</th><td>{}</td></tr><tr><th>Due</th><td>{}</td></tr><tr><th>Finished</th><td>{}</td></tr>",
        esc(&html::query(&[("function", &r.function_id)])),
        esc(&r.function_id),
        html::state_badge(r.state),
        r.attempt,
        r.max_attempts,
        html::time(r.created_at),
        html::time(r.run_at),
        html::opt_time(r.finished_at),
    );
    if let Some(e) = &r.last_error {
        let _ = write!(body, "<tr><th>Last error</th><td class=\"err\">{}</td></tr>", esc(e));
    }
    if let Some(c) = &r.cancel_reason {
        let _ = write!(body, "<tr><th>Cancel reason</th><td>{}</td></tr>", esc(c));
    }
    body.push_str("</table>");
    actions(&mut body, &app, r.id, r.state);
    why(&mut body, &d);
    if let Some(output) = &r.output {
        body.push_str("<h2>Output</h2>");
        body.push_str(&if app.show_data { html::json_block(output) } else { HIDDEN.to_owned() });
    }
    event(&mut body, &app, &d);
    steps(&mut body, &app, &d);
    executions(&mut body, &d);
    history(&mut body, &d);
    if !d.children.is_empty() {
        body.push_str("<h2>Children</h2><table><tr><th>Run</th><th>Function</th><th>State</th></tr>");
        for c in &d.children {
            let _ = write!(
                body,
                "<tr><td><a href=\"/runs/{id}\">{id}</a></td><td>{}</td><td>{}</td></tr>",
                esc(&c.function_id),
                html::state_badge(c.state),
                id = c.id
            );
        }
        body.push_str("</table>");
    }
    Ok(Html(html::page(&format!("Run {}", r.id), &body, None)))
}

fn actions(out: &mut String, app: &App, id: Uuid, state: RunState) {
    let csrf = esc(app.access.csrf());
    let hidden = format!("<input type=\"hidden\" name=\"csrf\" value=\"{csrf}\">");
    if matches!(state, RunState::Failed | RunState::Cancelled) {
        let _ = write!(
            out,
            "<form class=\"inline\" method=\"post\" action=\"/runs/{id}/replay\">{hidden}\
             <input type=\"hidden\" name=\"from\" value=\"failed_step\">\
             <button id=\"replay\" type=\"submit\">Replay</button></form>\
             <form class=\"inline\" method=\"post\" action=\"/runs/{id}/replay\">{hidden}\
             <input type=\"hidden\" name=\"from\" value=\"start\">\
             <button id=\"replay-start\" type=\"submit\">Replay from start</button></form>\
             <p class=\"muted\">Replay keeps the finished steps (they return their stored results) and resumes at \
             the step that failed; from start discards them.</p>"
        );
    } else if !state.is_finished() {
        let _ = write!(
            out,
            "<form class=\"inline\" method=\"post\" action=\"/runs/{id}/cancel\">{hidden}\
             <input name=\"reason\" value=\"cancelled from the dashboard\" size=\"40\"> \
             <button id=\"cancel\" type=\"submit\">Cancel</button></form>"
        );
    }
}

fn why(out: &mut String, d: &RunDetail) {
    out.push_str("<h2>Why it is not running</h2>");
    let r = &d.run;
    match (&d.blocker, r.state) {
        (_, RunState::Running) => {
            let worker = d.attempts.last().and_then(|a| a.worker_id);
            let _ = write!(
                out,
                "<p>It is running: attempt {} on worker {}.</p>",
                r.attempt,
                worker.map_or_else(|| "?".into(), |w| w.to_string())
            );
        }
        (_, s) if s.is_finished() => {
            let _ = write!(out, "<p>It has finished ({}); it runs again only if replayed.</p>", s.as_str());
        }
        (Some(b), _) => blocker(out, b),
        (None, _) => out.push_str("<p class=\"muted\">Nothing holds it now; it is about to be claimed.</p>"),
    }
}

fn blocker(out: &mut String, b: &Blocker) {
    let _ = write!(out, "<table><tr><th>Held by</th><td id=\"blocker\">{}</td></tr>", esc(b.kind.as_str()));
    let row = |out: &mut String, k: &str, v: &str| {
        let _ = write!(out, "<tr><th>{}</th><td>{}</td></tr>", esc(k), esc(v));
    };
    if let Some(rule) = &b.rule {
        row(out, "Rule", rule);
    }
    if let Some(key) = &b.key {
        row(out, "Key", key);
    }
    match (b.in_use, b.limit) {
        (Some(u), Some(l)) => row(out, "Slots in use", &format!("{u} of {l}")),
        (None, Some(l)) => row(out, "Limit", &l.to_string()),
        _ => {}
    }
    row(
        out,
        "Next possible start",
        &b.next_possible_start.map_or_else(|| "when a slot frees, or the awaited event comes".into(), html::time),
    );
    if let Some(detail) = &b.detail {
        row(out, "Detail", detail);
    }
    out.push_str("</table>");
}

fn event(out: &mut String, app: &App, d: &RunDetail) {
    let e = &d.event;
    let _ = write!(
        out,
        "<h2>Event</h2><table><tr><th>Name</th><td>{}</td></tr><tr><th>Id</th><td>{}</td></tr>\
         <tr><th>Idempotency key</th><td>{}</td></tr><tr><th>Sent</th><td>{}</td></tr>\
         <tr><th>Runs started</th><td>{}</td></tr></table>",
        esc(&e.name),
        e.id,
        esc(e.idempotency_key.as_deref().unwrap_or("–")),
        html::time(e.created_at),
        e.runs,
    );
    out.push_str(&if app.show_data { html::json_block(&e.data) } else { HIDDEN.to_owned() });
}

fn steps(out: &mut String, app: &App, d: &RunDetail) {
    out.push_str("<h2>Steps</h2>");
    if d.steps.is_empty() {
        out.push_str("<p class=\"muted\">No step has finished or failed yet.</p>");
        return;
    }
    // Bars: each step's time span on the run's time line (created to last step end).
    let start = d.run.created_at;
    let end = d.steps.iter().filter_map(|s| s.finished_at).max().unwrap_or(start);
    let span = (end - start).num_microseconds().unwrap_or(1).max(1) as f64;
    let offset =
        |t: DateTime<Utc>| ((t - start).num_microseconds().unwrap_or(0) as f64 / span * 300.0).clamp(0.0, 300.0);
    out.push_str(
        "<table><tr><th>Step</th><th>Status</th><th>Executions</th><th>Attempt</th><th>Started</th><th>Finished</th>\
         <th>Duration</th><th>Timeline</th><th>Error / output</th></tr>",
    );
    for s in &d.steps {
        let status = match s.status {
            StepStatus::Completed => "<span class=\"s s-completed\">completed</span>",
            _ => "<span class=\"s s-failed\">failed</span>",
        };
        let bar = match (s.started_at, s.finished_at) {
            (Some(a), Some(b)) => {
                let (x, y) = (offset(a), offset(b));
                let class = if s.status == StepStatus::Completed { "bar" } else { "bar f" };
                format!(
                    "<span style=\"margin-left:{x:.0}px;width:{:.0}px\" class=\"{class}\"></span>",
                    (y - x).max(2.0)
                )
            }
            (None, Some(b)) => {
                format!("<span style=\"margin-left:{:.0}px;width:2px\" class=\"bar f\"></span>", offset(b))
            }
            _ => String::new(),
        };
        let detail = match (&s.error, &s.output) {
            (Some(e), _) => format!("<span class=\"err\">{}</span>", esc(e)),
            (None, Some(o)) if app.show_data => {
                format!("<details><summary>output</summary>{}</details>", html::json_block(o))
            }
            (None, Some(_)) => "<span class=\"muted\">output hidden</span>".into(),
            (None, None) => String::new(),
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{status}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td>\
             <td class=\"n\">{}</td><td style=\"width:300px\">{bar}</td><td>{detail}</td></tr>",
            esc(&s.name),
            s.attempts,
            s.attempt.map_or_else(|| "–".into(), |a| a.to_string()),
            html::opt_time(s.started_at),
            html::opt_time(s.finished_at),
            s.duration.map_or_else(|| "–".into(), html::duration),
        );
    }
    out.push_str("</table>");
}

fn executions(out: &mut String, d: &RunDetail) {
    out.push_str("<h2>Executions</h2>");
    if d.attempts.is_empty() {
        out.push_str("<p class=\"muted\">Not claimed yet.</p>");
        return;
    }
    out.push_str(
        "<table><tr><th>Attempt</th><th>Worker</th><th>Started</th><th>Ended</th><th>Took</th><th>Outcome</th>\
         <th>Failed step</th><th>Error</th></tr>",
    );
    for a in &d.attempts {
        let took = a.ended_at.and_then(|e| (e - a.started_at).to_std().ok()).map_or_else(|| "–".into(), html::duration);
        let outcome = a.outcome.as_str();
        let _ = write!(
            out,
            "<tr><td class=\"n\">{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{took}</td><td>{}</td>\
             <td>{}</td><td class=\"err\">{}</td></tr>",
            a.attempt,
            a.worker_id.map_or_else(|| "–".into(), |w| w.to_string()),
            html::time(a.started_at),
            html::opt_time(a.ended_at),
            esc(outcome),
            esc(a.failed_step.as_deref().unwrap_or("")),
            esc(a.error.as_deref().unwrap_or("")),
        );
    }
    out.push_str("</table>");
}

fn history(out: &mut String, d: &RunDetail) {
    if d.history.is_empty() {
        return;
    }
    out.push_str(
        "<h2>State history</h2><table><tr><th>At</th><th>State</th><th>Attempt</th><th>Step</th><th>Error</th></tr>",
    );
    for h in &d.history {
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}</td><td class=\"err\">{}</td></tr>",
            html::time(h.at),
            html::state_badge(h.state),
            h.attempt,
            esc(h.step.as_deref().unwrap_or("")),
            esc(h.error.as_deref().unwrap_or("")),
        );
    }
    out.push_str("</table>");
}
