//! The overview: runs per function and state, runs per minute over the last
//! hour (an inline SVG bar chart), what holds the runs that are not running,
//! and the latest failures.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use axum::extract::State;
use axum::response::Html;
use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use durastep::RunState;
use durastep::inspect::{Blocker, MinuteCount, RunFilter, StateCount};

use super::PageResult;
use crate::App;
use crate::html::{self, esc, query};

/// Blockers looked at for the summary.
const BLOCKER_SAMPLE: u32 = 1_000;

/// GET /
pub(crate) async fn show(State(app): State<App>) -> PageResult {
    let inspector = app.engine.inspect();
    let failures = RunFilter::new().state(RunState::Failed).limit(10);
    let (now, counts, minutes, blockers, failed) = tokio::try_join!(
        inspector.db_now(),
        inspector.counts(),
        inspector.per_minute(Duration::from_secs(3600)),
        inspector.blockers(None, BLOCKER_SAMPLE),
        inspector.runs(&failures),
    )?;
    let mut body = String::from("<h1>Overview</h1>");
    counts_table(&mut body, &counts);
    chart(&mut body, &minutes, now);
    blocker_summary(&mut body, &blockers);
    body.push_str("<h2>Latest failures</h2>");
    if failed.runs.is_empty() {
        body.push_str("<p class=\"muted\">No failed runs.</p>");
    } else {
        body.push_str("<table><tr><th>Run</th><th>Function</th><th>Finished</th><th>Error</th></tr>");
        for r in &failed.runs {
            let _ = write!(
                body,
                "<tr><td><a class=\"run\" href=\"/runs/{id}\">{id}</a></td><td>{}</td><td>{}</td><td class=\"err\">{}</td></tr>",
                esc(&r.function_id),
                html::opt_time(r.finished_at),
                esc(&short(r.last_error.as_deref().unwrap_or(""), 160)),
                id = r.id,
            );
        }
        body.push_str("</table><p><a href=\"/runs?state=failed\">All failed runs</a></p>");
    }
    Ok(Html(html::page("Overview", &body, app.overview_refresh)))
}

/// At most `max` characters of `s`, with an ellipsis when cut.
pub(crate) fn short(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

fn counts_table(out: &mut String, counts: &[StateCount]) {
    let mut by_function: BTreeMap<&str, [i64; RunState::ALL.len()]> = BTreeMap::new();
    for c in counts {
        let row = by_function.entry(c.function_id.as_str()).or_default();
        if let Some(i) = RunState::ALL.iter().position(|s| *s == c.state) {
            row[i] += c.count;
        }
    }
    out.push_str("<h2>Runs by function and state</h2><table><tr><th>Function</th>");
    for s in RunState::ALL {
        let _ = write!(out, "<th>{}</th>", s.as_str());
    }
    out.push_str("<th>total</th></tr>");
    let mut totals = [0i64; RunState::ALL.len()];
    for (function, row) in &by_function {
        let _ = write!(
            out,
            "<tr><td><a href=\"/runs{}\">{}</a></td>",
            esc(&query(&[("function", function)])),
            esc(function)
        );
        for (i, n) in row.iter().enumerate() {
            totals[i] += n;
            count_cell(out, Some(function), RunState::ALL[i], *n);
        }
        let _ = write!(out, "<td class=\"n\">{}</td></tr>", row.iter().sum::<i64>());
    }
    out.push_str("<tr><th>all</th>");
    for (i, n) in totals.iter().enumerate() {
        count_cell(out, None, RunState::ALL[i], *n);
    }
    let _ = write!(out, "<th class=\"n\">{}</th></tr></table>", totals.iter().sum::<i64>());
}

fn count_cell(out: &mut String, function: Option<&str>, state: RunState, n: i64) {
    if n == 0 {
        out.push_str("<td class=\"n muted\">0</td>");
        return;
    }
    let link = query(&[("function", function.unwrap_or("")), ("state", state.as_str())]);
    let _ = write!(out, "<td class=\"n\"><a href=\"/runs{}\">{n}</a></td>", esc(&link));
}

/// Sixty one-minute bars ending at the current minute of the database clock
/// (the clock the counts are bucketed by).
fn chart(out: &mut String, minutes: &[MinuteCount], db_now: DateTime<Utc>) {
    let end = db_now.duration_trunc(TimeDelta::minutes(1)).unwrap_or(db_now);
    let (created, completed, failed) =
        minutes.iter().fold((0, 0, 0), |(a, b, c), m| (a + m.created, b + m.completed, c + m.failed));
    let _ = write!(
        out,
        "<h2>Runs per minute, last hour</h2><p>created {created} · completed {completed} · failed {failed}</p>"
    );
    let peak = minutes.iter().map(|m| m.created.max(m.completed + m.failed)).max().unwrap_or(0).max(1);
    const W: i64 = 10;
    const H: i64 = 100;
    let _ = write!(
        out,
        "<svg width=\"{}\" height=\"{}\" role=\"img\" aria-label=\"runs per minute\" \
         style=\"background:#fff;border:1px solid #d8dde3\">",
        60 * W,
        H + 14
    );
    for m in minutes {
        let age = (end - m.minute).num_minutes();
        if !(0..60).contains(&age) {
            continue;
        }
        let x = (59 - age) * W;
        let hc = m.created * H / peak;
        let hf = m.failed * H / peak;
        let hd = m.completed * H / peak;
        let _ = write!(
            out,
            "<g><title>{}: created {}, completed {}, failed {}</title>\
             <rect x=\"{x}\" y=\"{}\" width=\"4\" height=\"{hc}\" fill=\"#5b8def\"/>\
             <rect x=\"{}\" y=\"{}\" width=\"4\" height=\"{hd}\" fill=\"#3aa55d\"/>\
             <rect x=\"{}\" y=\"{}\" width=\"4\" height=\"{hf}\" fill=\"#d64545\"/></g>",
            m.minute.format("%H:%M"),
            m.created,
            m.completed,
            m.failed,
            H - hc,
            x + 4,
            H - hd - hf,
            x + 4,
            H - hf,
        );
    }
    let _ = write!(
        out,
        "<text x=\"0\" y=\"{y}\" font-size=\"10\">{}</text><text x=\"{}\" y=\"{y}\" font-size=\"10\" \
         text-anchor=\"end\">{}</text></svg><p class=\"muted\">blue: created; green: completed; red: failed \
         (peak {peak} per minute)</p>",
        (end - TimeDelta::minutes(59)).format("%H:%M"),
        60 * W,
        end.format("%H:%M UTC"),
        y = H + 12,
    );
}

fn blocker_summary(out: &mut String, blockers: &[Blocker]) {
    out.push_str("<h2>Why runs are not running</h2>");
    if blockers.is_empty() {
        out.push_str("<p class=\"muted\">Every unfinished run is running.</p>");
        return;
    }
    let mut groups: BTreeMap<(&str, &str, Option<&str>), (usize, &Blocker)> = BTreeMap::new();
    for b in blockers {
        let g = groups.entry((b.kind.as_str(), b.function_id.as_str(), b.key.as_deref())).or_insert((0, b));
        g.0 += 1;
    }
    if blockers.len() as u32 >= BLOCKER_SAMPLE {
        let _ = write!(out, "<p class=\"muted\">Of the {BLOCKER_SAMPLE} longest-due runs.</p>");
    }
    out.push_str(
        "<table><tr><th>Held by</th><th>Function</th><th>Key</th><th>Runs</th><th>In use / limit</th>\
         <th>Next possible start</th><th>Longest due</th></tr>",
    );
    for ((kind, function, key), (n, first)) in &groups {
        let usage = match (first.in_use, first.limit) {
            (Some(u), Some(l)) => format!("{u} / {l}"),
            (None, Some(l)) => format!("limit {l}"),
            _ => "–".into(),
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{n}</td><td>{}</td><td>{}</td>\
             <td><a href=\"/runs/{id}\">{id}</a></td></tr>",
            esc(kind),
            esc(function),
            esc(key.unwrap_or("–")),
            esc(&usage),
            html::opt_time(first.next_possible_start),
            id = first.run_id,
        );
    }
    out.push_str("</table>");
}

#[cfg(test)]
mod tests {
    #[test]
    fn shortens_on_char_boundaries() {
        assert_eq!(super::short("héllo", 3), "hél…");
        assert_eq!(super::short("abc", 3), "abc");
    }
}
