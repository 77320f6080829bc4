//! One run: its state, why it is not running, the replay and cancel forms, its
//! event, step timeline, executions, state history and children.

use axum::extract::{Path, Query, State};
use chrono::{DateTime, Utc};
use durastep::RunState;
use durastep::inspect::{Blocker, BlockerKind, ErrorStanding, RunDetail, StepStatus};
use maud::{Markup, html};
use serde::Deserialize;
use uuid::Uuid;

use super::{PageError, PageResult, hidden, timeline};
use crate::App;
use crate::html::{self as shell, query};

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
    let d = app.inspector.run(id).await?;
    let r = &d.run;
    // A pending wait or invoke is drawn to now, by the database clock.
    let now = if r.state == RunState::Waiting { app.inspector.db_now().await? } else { Utc::now() };
    let step_spans = timeline::step_spans(&d);
    let spans = timeline::spans(&d, &step_spans, now);
    let axis = timeline::Axis::of(&d, &spans);
    let body = html! {
        h1 { "Run " code { (r.id) } }
        @match n.done.as_str() {
            "replayed" => p class="s s-queued" { "Replay queued." },
            "cancelled" => p class="s s-cancelled" { "Cancelled." },
            _ => {},
        }
        table {
            tr { th { "Function" } td { a href={ "/runs" (query(&[("function", &r.function_id)])) } { (r.function_id) } } }
            tr { th { "State" } td #state { (shell::state_badge(r.state)) } }
            tr { th { "Attempt" } td { (r.attempt) " of " (r.max_attempts) } }
            tr { th { "Created" } td { (shell::time(r.created_at)) } }
            tr { th { "Due" } td { (shell::time(r.run_at)) } }
            tr { th { "Finished" } td { (shell::opt_time(r.finished_at)) } }
            // What the error is to the run is the library's answer (ErrorStanding).
            @match &d.error {
                Some(e) if e.standing == ErrorStanding::Recovered => tr {
                    th { "Recovered error" }
                    td #recovered .muted {
                        (app.data(&e.message)) " " i { "(an earlier attempt failed; a retry completed the run)" }
                    }
                },
                Some(e) if e.standing.is_failure() => tr {
                    th { "Error" }
                    td {
                        b #failure {
                            @if e.standing == ErrorStanding::Permanent {
                                "Failed permanently (a permanent error: not retried)"
                            } @else {
                                "Failed on its last attempt (all " (r.max_attempts) " used)"
                            }
                        }
                        br;
                        span.err { (app.data(&e.message)) }
                    }
                },
                Some(e) => tr { th { "Last error" } td.err { (app.data(&e.message)) } },
                None => {},
            }
            @if let Some(c) = &r.cancel_reason {
                tr { th { "Cancel reason" } td { (app.data(c)) } }
            }
        }
        (actions(&app, r.id, r.state))
        (why(&app, &d))
        @if let Some(output) = &r.output {
            h2 { "Output" }
            @if app.show_data { (shell::json_block(output)) } @else { (hidden()) }
        }
        (event(&app, &d))
        (timeline::waterfall(&spans, &axis))
        (steps(&app, &d, &step_spans, &axis))
        (executions(&app, &d))
        (history(&app, &d))
        @if !d.children.is_empty() {
            h2 { "Children" }
            table {
                tr { th { "Run" } th { "Function" } th { "State" } }
                @for c in &d.children {
                    tr {
                        td { a href={ "/runs/" (c.id) } { (c.id) } }
                        td { (c.function_id) }
                        td { (shell::state_badge(c.state)) }
                    }
                }
            }
        }
    };
    Ok(shell::app_page(&app, &format!("Run {}", r.id), body, None))
}

fn actions(app: &App, id: Uuid, state: RunState) -> Markup {
    if app.engine.is_none() {
        return html! {};
    }
    let csrf = app.access.csrf();
    html! {
        @if matches!(state, RunState::Failed | RunState::Cancelled) {
            form.inline method="post" action={ "/runs/" (id) "/replay" } {
                input type="hidden" name="csrf" value=(csrf);
                input type="hidden" name="from" value="failed_step";
                button #replay type="submit" { "Replay" }
            }
            form.inline method="post" action={ "/runs/" (id) "/replay" } {
                input type="hidden" name="csrf" value=(csrf);
                input type="hidden" name="from" value="start";
                button #replay-start type="submit" { "Replay from start" }
            }
            p.muted {
                "Replay keeps the finished steps (they return their stored results) and resumes at the step that \
                 failed; from start discards them."
            }
        } @else if !state.is_finished() {
            form.inline method="post" action={ "/runs/" (id) "/cancel" } {
                input type="hidden" name="csrf" value=(csrf);
                input name="reason" value="cancelled from the dashboard" size="40";
                " "
                button #cancel type="submit" { "Cancel" }
            }
        }
    }
}

fn why(app: &App, d: &RunDetail) -> Markup {
    let r = &d.run;
    if r.state.is_finished() {
        return html! {
            h2 { "Status" }
            p { "It has finished (" (r.state.as_str()) "); it runs again only if replayed." }
        };
    }
    html! {
        h2 { @if r.state == RunState::Running { "What it is doing" } @else { "Why it is not running" } }
        @match (&d.blocker, r.state) {
            (_, RunState::Running) => {
                @let worker = d.attempts.last().and_then(|a| a.worker_id);
                p {
                    "It is running: attempt " (r.attempt) " on worker "
                    (worker.map_or_else(|| "?".into(), |w| w.to_string())) "."
                }
            },
            (_, RunState::Diverged) => p #diverged {
                "Its replay diverged from what it recorded (the function's code changed): "
                // The run's last error, hidden like every error text (it quotes step keys).
                (r.last_error.as_deref().map_or("?", |e| app.data(e)))
                ". It stays parked until an operator resumes it once the code fits, or discards it from that \
                 position."
            },
            (Some(b), _) => {
                // The step it is in, as the library names it (Blocker::step).
                @let step = b.step.as_deref();
                @if let Some(sleep) = d.steps.iter().find(|s| Some(s.name.as_str()) == step && s.is_sleep()) {
                    p #asleep { "In the sleep step " b { (sleep.name) } ", until " (shell::opt_time(sleep.wake_at)) "." }
                } @else if let Some(step) = step {
                    p #held-step { "In the step " b { (step) } "." }
                }
                (blocker(app, b))
            },
            (None, _) => p.muted { "Nothing holds it now; it is about to be claimed." },
        }
    }
}

fn blocker(app: &App, b: &Blocker) -> Markup {
    let mut rows: Vec<(&str, String)> = Vec::new();
    if let Some(rule) = &b.rule {
        rows.push(("Rule", rule.clone()));
    }
    if let Some(key) = &b.key {
        rows.push(("Key", app.data(key).to_owned()));
    }
    match (b.in_use, b.limit) {
        (Some(u), Some(l)) => rows.push(("Slots in use", format!("{u} of {l}"))),
        (None, Some(l)) => rows.push(("Limit", l.to_string())),
        _ => {}
    }
    rows.push((
        "Next possible start",
        b.next_possible_start.map_or_else(|| "when a slot frees, or the awaited event comes".into(), shell::time),
    ));
    if let Some(detail) = &b.detail {
        // The awaited event's name and the child run's id are shown as they
        // are; any other detail (a backoff's is the run's last error) is data.
        let detail = match b.kind {
            BlockerKind::WaitForEvent | BlockerKind::Invoke => detail,
            _ => app.data(detail),
        };
        rows.push(("Detail", detail.to_owned()));
    }
    html! {
        table {
            tr { th { "Held by" } td #blocker { (b.kind.as_str()) } }
            @for (k, v) in &rows { tr { th { (k) } td { (v) } } }
        }
    }
}

fn event(app: &App, d: &RunDetail) -> Markup {
    let e = &d.event;
    html! {
        h2 { "Event" }
        table {
            tr { th { "Name" } td { (e.name) } }
            tr { th { "Id" } td { (e.id) } }
            tr { th { "Idempotency key" } td { (e.idempotency_key.as_deref().map_or("–", |k| app.data(k))) } }
            tr { th { "Sent" } td { (shell::time(e.created_at)) } }
            tr { th { "Runs started" } td { (e.runs) } }
        }
        @if app.show_data { (shell::json_block(&e.data)) } @else { (hidden()) }
    }
}

fn steps(app: &App, d: &RunDetail, spans: &[Option<timeline::Span>], axis: &timeline::Axis) -> Markup {
    if d.steps.is_empty() {
        return html! { h2 { "Steps" } p.muted { "No step has finished or failed yet." } };
    }
    // Bars: each step's span on the timeline's axis (a wait or invoke from
    // when it held the run to when it resolved).
    let offset = |t: DateTime<Utc>| axis.at(t, 300.0);
    html! {
        h2 { "Steps" }
        table {
            tr {
                th { "Step" } th { "Status" } th { "Executions" } th { "Attempt" } th { "Started" } th { "Finished" }
                th { "Duration" } th { "Timeline" } th { "Error / output" }
            }
            @for (s, t) in d.steps.iter().zip(spans) {
                @let kind = t.as_ref().map(|t| t.kind);
                tr {
                    td { (s.name) }
                    td {
                        @match s.status {
                            StepStatus::Completed if s.is_sleep() => span class="s s-sleeping" { "sleep" },
                            StepStatus::Completed if kind == Some(timeline::Kind::Wait) => {
                                span class="s s-waiting" { "wait" }
                            },
                            StepStatus::Completed if kind == Some(timeline::Kind::Invoke) => {
                                span class="s s-waiting" { "child run" }
                            },
                            StepStatus::Completed if s.attempts > 1 => {
                                span class="s s-completed" { "completed" } " " span.muted { "(recovered)" }
                            },
                            StepStatus::Completed => span class="s s-completed" { "completed" },
                            _ => span class="s s-failed" { "failed" },
                        }
                    }
                    td.n { (s.attempts) }
                    td.n { (s.attempt.map_or_else(|| "–".into(), |a| a.to_string())) }
                    td { (shell::opt_time(s.started_at)) }
                    td { (shell::opt_time(s.finished_at)) }
                    td.n {
                        @if s.is_sleep() { "–" } @else { (s.duration.map_or_else(|| "–".into(), shell::duration)) }
                    }
                    td style="width:300px" {
                        @if let Some(t) = &t {
                            @let (x, y) = (offset(t.start), offset(t.end));
                            span.bar title=(t.title) style=(format!(
                                "margin-left:{x:.0}px;width:{:.0}px;background:{}", (y - x).max(2.0), t.kind.color()
                            )) {}
                        }
                    }
                    td {
                        @match (&s.error, &s.output) {
                            (None, Some(_)) if s.is_sleep() => span.sleep {
                                "sleep until " (shell::opt_time(s.wake_at))
                                @if let Some(slept) = s.slept { ", " (shell::duration(slept)) }
                            },
                            (Some(e), _) => span.err { (app.data(e)) },
                            (None, Some(o)) if app.show_data => details { summary { "output" } (shell::json_block(o)) },
                            (None, Some(_)) => span.muted { "output hidden" },
                            (None, None) => {},
                        }
                    }
                }
            }
        }
    }
}

fn executions(app: &App, d: &RunDetail) -> Markup {
    if d.attempts.is_empty() {
        return html! { h2 { "Executions" } p.muted { "Not claimed yet." } };
    }
    html! {
        h2 { "Executions" }
        table {
            tr {
                th { "Attempt" } th { "Worker" } th { "Started" } th { "Ended" } th { "Took" } th { "Outcome" }
                th { "Failed step" } th { "Error" }
            }
            @for a in &d.attempts {
                @let took =
                    a.ended_at.and_then(|e| (e - a.started_at).to_std().ok()).map_or_else(|| "–".into(), shell::duration);
                tr {
                    td.n { (a.attempt) }
                    td { (a.worker_id.map_or_else(|| "–".into(), |w| w.to_string())) }
                    td { (shell::time(a.started_at)) }
                    td { (shell::opt_time(a.ended_at)) }
                    td.n { (took) }
                    td { (a.outcome.as_str()) }
                    td { (a.failed_step.as_deref().unwrap_or("")) }
                    td.err { (a.error.as_deref().map_or("", |e| app.data(e))) }
                }
            }
        }
    }
}

fn history(app: &App, d: &RunDetail) -> Markup {
    if d.history.is_empty() {
        return html! {};
    }
    html! {
        h2 { "State history" }
        table {
            tr { th { "At" } th { "State" } th { "Attempt" } th { "Step" } th { "Error" } }
            @for h in &d.history {
                tr {
                    td { (shell::time(h.at)) }
                    td {
                        (shell::state_badge(h.state))
                        @match (h.replayed, &h.cancel_reason) {
                            (true, _) => { " " b.mark { "replayed" } },
                            (false, Some(reason)) => { " " span.mark { "reason: " (app.data(reason)) } },
                            (false, None) => {},
                        }
                    }
                    td.n { (h.attempt) }
                    td { (h.step.as_deref().unwrap_or("")) }
                    td.err { (h.error.as_deref().map_or("", |e| app.data(e))) }
                }
            }
        }
    }
}
