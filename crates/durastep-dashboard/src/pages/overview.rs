//! The overview: runs per function and state, runs per minute over the last
//! hour (an inline SVG bar chart), what holds the runs that are not running,
//! and the latest failures.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::State;
use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use durastep::RunState;
use durastep::inspect::{Blocker, MinuteCount, RunFilter, StateCount};
use maud::{Markup, html};

use super::PageResult;
use crate::App;
use crate::html::{self as shell, query};

/// Blockers looked at for the summary.
const BLOCKER_SAMPLE: u32 = 1_000;

/// GET /
pub(crate) async fn show(State(app): State<App>) -> PageResult {
    let inspector = &app.inspector;
    let failures = RunFilter::new().state(RunState::Failed).limit(10);
    let (now, counts, minutes, blockers, failed) = tokio::try_join!(
        inspector.db_now(),
        inspector.counts_estimated(),
        inspector.per_minute(Duration::from_secs(3600)),
        inspector.blockers(None, BLOCKER_SAMPLE),
        inspector.runs(&failures),
    )?;
    let unfinished: i64 = counts.iter().filter(|c| !c.state.is_finished()).map(|c| c.count).sum();
    // Diverged runs are unfinished but have no blocker row: they wait for an operator.
    let diverged: i64 = counts.iter().filter(|c| c.state == RunState::Diverged).map(|c| c.count).sum();
    let body = html! {
        h1 { "Overview" }
        (counts_table(&counts))
        (chart(&minutes, now))
        (blocker_summary(&app, &blockers, unfinished, diverged))
        h2 { "Latest failures" }
        @if failed.runs.is_empty() {
            p.muted { "No failed runs." }
        } @else {
            table {
                tr { th { "Run" } th { "Function" } th { "Finished" } th { "Error" } }
                @for r in &failed.runs {
                    tr {
                        td { a.run href={ "/runs/" (r.id) } { (r.id) } }
                        td { (r.function_id) }
                        td { (shell::opt_time(r.finished_at)) }
                        td.err { (app.data(&short(r.last_error.as_deref().unwrap_or(""), 160))) }
                    }
                }
            }
            p { a href="/runs?state=failed" { "All failed runs" } }
        }
    };
    Ok(shell::app_page(&app, "Overview", body, app.overview_refresh))
}

/// At most `max` characters of `s`, with an ellipsis when cut.
pub(crate) fn short(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

fn counts_table(counts: &[StateCount]) -> Markup {
    let mut by_function: BTreeMap<&str, [i64; RunState::ALL.len()]> = BTreeMap::new();
    let estimated = counts.iter().any(|c| c.estimated);
    for c in counts {
        let row = by_function.entry(c.function_id.as_str()).or_default();
        if let Some(i) = RunState::ALL.iter().position(|s| *s == c.state) {
            row[i] += c.count;
        }
    }
    let mut totals = [0i64; RunState::ALL.len()];
    for row in by_function.values() {
        for (i, n) in row.iter().enumerate() {
            totals[i] += n;
        }
    }
    html! {
        h2 { "Runs by function and state" }
        table {
            tr {
                th { "Function" }
                @for s in RunState::ALL { th { (s.as_str()) } }
                th { "total" }
            }
            @for (function, row) in &by_function {
                tr {
                    td { a href={ "/runs" (query(&[("function", function)])) } { (function) } }
                    @for (i, n) in row.iter().enumerate() { (count_cell(Some(function), RunState::ALL[i], *n)) }
                    td.n { (row.iter().sum::<i64>()) }
                }
            }
            tr {
                th { "all" }
                @for (i, n) in totals.iter().enumerate() { (count_cell(None, RunState::ALL[i], *n)) }
                th.n { (totals.iter().sum::<i64>()) }
            }
        }
        @if estimated {
            p.muted #estimated {
                "Finished runs are estimated from the database's statistics (refreshed by ANALYZE); unfinished \
                 ones are counted exactly."
            }
        }
    }
}

fn count_cell(function: Option<&str>, state: RunState, n: i64) -> Markup {
    if n == 0 {
        return html! { td class="n muted" { "0" } };
    }
    let link = query(&[("function", function.unwrap_or("")), ("state", state.as_str())]);
    html! { td.n { a href={ "/runs" (link) } { (n) } } }
}

/// Sixty one-minute bars ending at the current minute of the database clock
/// (the clock the counts are bucketed by).
fn chart(minutes: &[MinuteCount], db_now: DateTime<Utc>) -> Markup {
    let end = db_now.duration_trunc(TimeDelta::minutes(1)).unwrap_or(db_now);
    let (created, completed, failed) =
        minutes.iter().fold((0, 0, 0), |(a, b, c), m| (a + m.created, b + m.completed, c + m.failed));
    let peak = minutes.iter().map(|m| m.created.max(m.completed + m.failed)).max().unwrap_or(0).max(1);
    const W: i64 = 10;
    const H: i64 = 100;
    let bars = minutes.iter().filter_map(|m| {
        let age = (end - m.minute).num_minutes();
        (0..60).contains(&age).then_some((m, (59 - age) * W))
    });
    html! {
        h2 { "Runs per minute, last hour" }
        p { "created " (created) " · completed " (completed) " · failed " (failed) }
        svg width=(60 * W) height=(H + 14) role="img" aria-label="runs per minute"
            style="background:#fff;border:1px solid #d8dde3" {
            @for (m, x) in bars {
                @let hc = m.created * H / peak;
                @let hf = m.failed * H / peak;
                @let hd = m.completed * H / peak;
                g {
                    title {
                        (m.minute.format("%H:%M")) ": created " (m.created) ", completed " (m.completed)
                        ", failed " (m.failed)
                    }
                    rect x=(x) y=(H - hc) width="4" height=(hc) fill="#5b8def" {}
                    rect x=(x + 4) y=(H - hd - hf) width="4" height=(hd) fill="#3aa55d" {}
                    rect x=(x + 4) y=(H - hf) width="4" height=(hf) fill="#d64545" {}
                }
            }
            text x="0" y=(H + 12) font-size="10" { ((end - TimeDelta::minutes(59)).format("%H:%M")) }
            text x=(60 * W) y=(H + 12) font-size="10" text-anchor="end" { (end.format("%H:%M UTC")) }
        }
        p.muted { "blue: created; green: completed; red: failed (peak " (peak) " per minute)" }
    }
}

fn blocker_summary(app: &App, blockers: &[Blocker], unfinished: i64, diverged: i64) -> Markup {
    let mut groups: BTreeMap<(&str, &str, Option<&str>), (usize, &Blocker)> = BTreeMap::new();
    for b in blockers {
        let g = groups.entry((b.kind.as_str(), b.function_id.as_str(), b.key.as_deref())).or_insert((0, b));
        g.0 += 1;
    }
    html! {
        h2 { "Why runs are not running" }
        @if diverged > 0 {
            p #diverged-runs {
                a href="/runs?state=diverged" { (diverged) " diverged run(s)" }
                " wait for an operator: the function's code changed under them (resume once the code fits, or \
                 discard from the divergence; "
                code { "durastep runs resume" } ", " code { "durastep runs discard" } ")."
            }
        }
        @if blockers.is_empty() {
            p.muted #no-blockers {
                @if unfinished == 0 {
                    "No run is unfinished."
                } @else if unfinished <= diverged {
                    "No other run is unfinished."
                } @else if diverged > 0 {
                    "Every other unfinished run is running."
                } @else {
                    "Every unfinished run is running."
                }
            }
        } @else {
            @if blockers.len() as u32 >= BLOCKER_SAMPLE {
                p.muted { "Of the " (BLOCKER_SAMPLE) " longest-due runs." }
            }
            table {
                tr {
                    th { "Held by" } th { "Function" } th { "Key" } th { "Runs" } th { "In use / limit" }
                    th { "Next possible start" } th { "Due the longest" }
                }
                @for ((kind, function, key), (n, first)) in &groups {
                    @let usage = match (first.in_use, first.limit) {
                        (Some(u), Some(l)) => format!("{u} / {l}"),
                        (None, Some(l)) => format!("limit {l}"),
                        _ => "–".into(),
                    };
                    tr {
                        td { (held_by(kind)) }
                        td { (function) }
                        td { (key.map_or("–", |k| app.data(k))) }
                        td.n { (n) }
                        td { (usage) }
                        td { (shell::opt_time(first.next_possible_start)) }
                        td {
                            a.run href={ "/runs/" (first.run_id) } title=(first.run_id) {
                                (shell::short_id(first.run_id))
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A blocker kind with what it means where its name alone does not say.
fn held_by(kind: &str) -> Markup {
    let note = match kind {
        "ready" => Some("(due now, not yet claimed: is a worker running that registers this function?)"),
        "retry_backoff" => Some("(waiting out the backoff after a failed attempt)"),
        "scheduled" => Some("(a delayed start)"),
        _ => None,
    };
    html! {
        (kind)
        @if let Some(note) = note { " " span.muted { (note) } }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn shortens_on_char_boundaries() {
        assert_eq!(super::short("héllo", 3), "hél…");
        assert_eq!(super::short("abc", 3), "abc");
    }
}
