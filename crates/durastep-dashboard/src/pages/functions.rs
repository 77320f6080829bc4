//! The functions some engine registered: triggers, attempts, schedule, rules.

use axum::extract::State;
use maud::html;

use super::PageResult;
use crate::App;
use crate::html::{self as shell, query};

/// GET /functions
pub(crate) async fn list(State(app): State<App>) -> PageResult {
    let functions = app.inspector.functions().await?;
    let body = html! {
        h1 { "Functions" }
        @if functions.is_empty() {
            p.muted { "No function is registered." }
        } @else {
            table {
                tr {
                    th { "Function" } th { "Triggers" } th { "Attempts" } th { "Cron" } th { "Next fire" }
                    th { "Flow control" } th { "Registered" }
                }
                @for f in &functions {
                    @let cron = f.cron.as_ref().map(|c| format!("{} ({})", c.expr, c.tz)).unwrap_or_default();
                    @let rules: Vec<String> = f
                        .rules
                        .iter()
                        .map(|r| {
                            let per = if r.period_secs > 0.0 { format!(" per {} s", r.period_secs) } else { String::new() };
                            format!("{} {}{per} on {} ({})", r.kind, r.limit, r.key.as_deref().unwrap_or("all"), r.name)
                        })
                        .collect();
                    tr {
                        td { a href={ "/runs" (query(&[("function", &f.id)])) } { (f.id) } }
                        td { (f.triggers.join(", ")) }
                        td.n { (f.max_attempts) }
                        td { (cron) }
                        td { (shell::opt_time(f.cron.as_ref().and_then(|c| c.next_fire_at))) }
                        td { (rules.join("; ")) }
                        td { (shell::time(f.updated_at)) }
                    }
                }
            }
        }
    };
    Ok(shell::app_page(&app, "Functions", body, None))
}
