//! The functions some engine registered: triggers, attempts, schedule, rules.

use std::fmt::Write as _;

use axum::extract::State;
use axum::response::Html;

use super::PageResult;
use crate::App;
use crate::html::{self, esc, query};

/// GET /functions
pub(crate) async fn list(State(app): State<App>) -> PageResult {
    let functions = app.engine.inspect().functions().await?;
    let mut body = String::from("<h1>Functions</h1>");
    if functions.is_empty() {
        body.push_str("<p class=\"muted\">No function is registered.</p>");
    } else {
        body.push_str(
            "<table><tr><th>Function</th><th>Triggers</th><th>Attempts</th><th>Cron</th><th>Next fire</th>\
             <th>Flow control</th><th>Registered</th></tr>",
        );
        for f in &functions {
            let cron = f.cron.as_ref().map(|c| format!("{} ({})", c.expr, c.tz)).unwrap_or_default();
            let rules: Vec<String> = f
                .rules
                .iter()
                .map(|r| {
                    let per = if r.period_secs > 0.0 { format!(" per {} s", r.period_secs) } else { String::new() };
                    format!("{} {}{per} on {} ({})", r.kind, r.limit, r.key.as_deref().unwrap_or("all"), r.name)
                })
                .collect();
            let _ = write!(
                body,
                "<tr><td><a href=\"/runs{}\">{}</a></td><td>{}</td><td class=\"n\">{}</td><td>{}</td><td>{}</td>\
                 <td>{}</td><td>{}</td></tr>",
                esc(&query(&[("function", &f.id)])),
                esc(&f.id),
                esc(&f.triggers.join(", ")),
                f.max_attempts,
                esc(&cron),
                html::opt_time(f.cron.as_ref().and_then(|c| c.next_fire_at)),
                esc(&rules.join("; ")),
                html::time(f.updated_at),
            );
        }
        body.push_str("</table>");
    }
    Ok(Html(html::page("Functions", &body, None)))
}
