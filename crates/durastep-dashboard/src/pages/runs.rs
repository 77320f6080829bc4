//! The run list: filters (function, state, key pointer=value, idempotency
//! key, event name, created since) and next-page links carrying the listing's
//! cursor; bulk replay of the failed runs a filter matches, after a
//! confirmation page that says how many.

use axum::extract::{Query, State};
use axum::response::Html;
use chrono::{DateTime, TimeDelta, Utc};
use durastep::RunState;
use durastep::inspect::{Cursor, RunFilter};
use maud::{Markup, html};
use serde::Deserialize;
use serde_json::Value;

use super::overview::short;
use super::{PageError, PageResult};
use crate::App;
use crate::html::{self as shell, query};

/// Runs per page.
const PAGE: u32 = 50;

/// The filter form's fields, as they come in the query string.
#[derive(Debug, Default, Clone, Deserialize)]
pub(crate) struct ListQuery {
    #[serde(default)]
    function: String,
    #[serde(default)]
    state: String,
    /// `pointer=value`, e.g. `/ad_account_id=act_7`.
    #[serde(default)]
    key: String,
    #[serde(default)]
    idempotency_key: String,
    #[serde(default)]
    event: String,
    /// Created within this long before now by the database clock (`2h`,
    /// `30m`, `7d`), or at or after an RFC 3339 time.
    #[serde(default)]
    since: String,
    #[serde(default)]
    after: String,
    /// Set after a bulk replay: how many runs it queued.
    #[serde(default)]
    replayed: Option<String>,
}

/// Runs counted at most for the bulk replay's confirmation.
const COUNT_CAP: usize = 10_000;

impl ListQuery {
    pub(crate) fn pairs<'a>(&'a self, after: &'a str) -> [(&'a str, &'a str); 7] {
        [
            ("function", self.function.as_str()),
            ("since", self.since.as_str()),
            ("state", self.state.as_str()),
            ("key", self.key.as_str()),
            ("idempotency_key", self.idempotency_key.as_str()),
            ("event", self.event.as_str()),
            ("after", after),
        ]
    }

    /// The filter of a bulk replay: these fields without the page cursor; the
    /// state must be failed or cancelled (or none: failed).
    pub(crate) fn replay_filter(&self) -> Result<RunFilter, PageError> {
        let state = self.state.trim();
        if !matches!(state, "" | "failed" | "cancelled") {
            return Err(PageError::BadRequest(format!(
                "only failed or cancelled runs can be replayed, not {state} ones"
            )));
        }
        let mut q = ListQuery { after: String::new(), ..self.clone() };
        if q.state.trim().is_empty() {
            q.state = "failed".into();
        }
        q.filter()
    }

    /// The inspection filter these fields describe.
    pub(crate) fn filter(&self) -> Result<RunFilter, PageError> {
        let mut f = RunFilter::new().limit(PAGE);
        let text = |s: &str| Some(s.trim()).filter(|s| !s.is_empty()).map(str::to_owned);
        if let Some(function) = text(&self.function) {
            f = f.function(function);
        }
        if let Some(state) = text(&self.state) {
            let s: RunState =
                state.parse().map_err(|_| PageError::BadRequest(format!("no run state is called {state:?}")))?;
            f = f.state(s);
        }
        if let Some(key) = text(&self.key) {
            let (pointer, value) = parse_key(&key)?;
            f = f.data(pointer, value);
        }
        if let Some(k) = text(&self.idempotency_key) {
            f = f.idempotency_key(k);
        }
        if let Some(e) = text(&self.event) {
            f = f.event_name(e);
        }
        if let Some(after) = text(&self.after) {
            f = f.after(after.parse::<Cursor>()?);
        }
        Ok(f)
    }

    /// The `since` field as a time: relative ones are resolved on the
    /// database clock (`now`), the clock the runs' times are written by.
    fn since(&self, now: DateTime<Utc>) -> Result<Option<DateTime<Utc>>, PageError> {
        let s = self.since.trim();
        if s.is_empty() {
            return Ok(None);
        }
        if let Ok(t) = DateTime::parse_from_rfc3339(s) {
            return Ok(Some(t.with_timezone(&Utc)));
        }
        let bad = || {
            PageError::BadRequest(format!(
                "since {s:?}? write a time ago (90s, 30m, 2h, 7d) or an RFC 3339 time (2026-12-01T09:00:00Z)"
            ))
        };
        let t = s.strip_suffix("ago").unwrap_or(s).trim();
        let split = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let (n, unit) = t.split_at(split);
        let n: i64 = n.parse().map_err(|_| bad())?;
        let unit: i64 = match unit.trim() {
            "s" => 1,
            "m" | "min" => 60,
            "h" => 3_600,
            "d" => 86_400,
            "w" => 7 * 86_400,
            _ => return Err(bad()),
        };
        let back = n.checked_mul(unit).and_then(TimeDelta::try_seconds).ok_or_else(bad)?;
        now.checked_sub_signed(back).map(Some).ok_or_else(bad)
    }

    /// [`ListQuery::filter`] with `since` resolved on the database clock.
    async fn resolve(&self, app: &App, mut f: RunFilter) -> Result<RunFilter, PageError> {
        if !self.since.trim().is_empty() {
            let now = app.inspector.db_now().await?;
            if let Some(t) = self.since(now)? {
                f = f.created_after(t);
            }
        }
        Ok(f)
    }
}

/// How many runs `filter` matches (at most [`COUNT_CAP`]), paging through them.
pub(crate) async fn count_matching(app: &App, filter: &RunFilter) -> Result<usize, PageError> {
    let mut f = filter.clone().limit(durastep::inspect::MAX_PAGE);
    let mut n = 0;
    loop {
        let page = app.inspector.runs(&f).await?;
        n += page.runs.len();
        match page.next {
            Some(next) if n < COUNT_CAP => f = f.after(next),
            _ => return Ok(n),
        }
    }
}

/// The page that asks before a bulk replay.
pub(crate) fn confirm_replay(app: &App, q: &ListQuery, count: usize) -> Html<String> {
    let many = if count >= COUNT_CAP { format!("at least {COUNT_CAP}") } else { count.to_string() };
    let body = html! {
        h1 { "Replay runs?" }
        p #confirm-count {
            "This replays " b { (many) } " run(s) matching the filter, each from its failed step (finished steps \
             return their stored results)."
        }
        form method="post" action="/runs/replay" {
            input type="hidden" name="csrf" value=(app.access.csrf());
            input type="hidden" name="confirm" value="yes";
            (filter_fields(q))
            button #confirm-replay type="submit" { "Replay " (many) " run(s)" }
            " "
            a href={ "/runs" (query(&q.pairs(""))) } { "Back" }
        }
    };
    shell::app_page(app, "Replay runs?", body, None)
}

/// The filter as hidden form fields (the non-empty ones, without the cursor).
fn filter_fields(q: &ListQuery) -> Markup {
    html! {
        @for (k, v) in q.pairs("") {
            @if !v.is_empty() { input type="hidden" name=(k) value=(v); }
        }
    }
}

/// `pointer=value`: the value is JSON when it parses as JSON (`7`, `true`,
/// `"7"`), a string otherwise (`act_7`).
fn parse_key(s: &str) -> Result<(String, Value), PageError> {
    let (pointer, value) = s.split_once('=').ok_or_else(|| {
        PageError::BadRequest(format!("a key filter is pointer=value, like /ad_account_id=act_7; got {s:?}"))
    })?;
    let value = serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_owned()));
    Ok((pointer.trim().to_owned(), value))
}

/// GET /runs
pub(crate) async fn list(State(app): State<App>, Query(q): Query<ListQuery>) -> PageResult {
    let filter = q.resolve(&app, q.filter()?).await?;
    let page = app.inspector.runs(&filter).await?;
    let bulk = app.engine.is_some() && matches!(q.state.as_str(), "failed" | "cancelled") && !page.runs.is_empty();
    let next = page.next.map(|c| c.to_string());
    let body = html! {
        h1 { "Runs" }
        @if let Some(n) = &q.replayed {
            p class="s s-queued" { (n) " run(s) queued for replay." }
        }
        (form(&q))
        @if bulk { (bulk_replay(&app, &q)) }
        @if page.runs.is_empty() {
            p.muted { "No runs match." }
        } @else {
            table {
                tr {
                    th { "Run" } th { "Function" } th { "Event" } th { "Idempotency key" } th { "State" }
                    th { "Attempt" } th { "Created" } th { "Finished" } th { "Last error" }
                }
                @for r in &page.runs {
                    tr {
                        td { a.run href={ "/runs/" (r.id) } { (r.id) } }
                        td { (r.function_id) }
                        td { (r.event_name) }
                        td { (r.idempotency_key.as_deref().map_or("", |k| app.data(k))) }
                        td { (shell::state_badge(r.state)) }
                        td.n { (r.attempt) "/" (r.max_attempts) }
                        td { (shell::time(r.created_at)) }
                        td { (shell::opt_time(r.finished_at)) }
                        td.err { (app.data(&short(r.last_error.as_deref().unwrap_or(""), 120))) }
                    }
                }
            }
        }
        p {
            @if !q.after.is_empty() {
                a href={ "/runs" (query(&q.pairs(""))) } { "First page" } " "
            }
            @if let Some(next) = &next {
                a rel="next" href={ "/runs" (query(&q.pairs(next))) } { "Next page →" }
            }
        }
    };
    Ok(shell::app_page(&app, "Runs", body, None))
}

fn form(q: &ListQuery) -> Markup {
    html! {
        form method="get" action="/runs" {
            label { "Function " input name="function" value=(q.function); } " "
            label {
                "State "
                select name="state" {
                    option value="" { "any" }
                    @for s in RunState::ALL {
                        option selected[q.state == s.as_str()] { (s.as_str()) }
                    }
                }
            } " "
            label { "Key " input name="key" placeholder="/ad_account_id=act_7" value=(q.key); } " "
            label { "Idempotency key " input name="idempotency_key" value=(q.idempotency_key); } " "
            label { "Event " input name="event" value=(q.event); } " "
            label { "Since " input name="since" placeholder="2h" size="8" value=(q.since); } " "
            button type="submit" { "Filter" } " "
            a href="/runs" { "clear" }
        }
    }
}

/// The bulk replay button: posts the filter, which first shows a confirmation.
fn bulk_replay(app: &App, q: &ListQuery) -> Markup {
    html! {
        form.inline method="post" action="/runs/replay" {
            input type="hidden" name="csrf" value=(app.access.csrf());
            (filter_fields(q))
            button #replay-all type="submit" { "Replay all matching runs…" }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_key_filters() {
        let (p, v) = parse_key("/ad_account_id=act_7").unwrap();
        assert_eq!((p.as_str(), v), ("/ad_account_id", Value::from("act_7")));
        assert_eq!(parse_key("/contact_id=4711").unwrap().1, Value::from(4711));
        assert_eq!(parse_key("/contact_id=\"4711\"").unwrap().1, Value::from("4711"));
        assert_eq!(parse_key("/a=b=c").unwrap().1, Value::from("b=c"));
        assert!(parse_key("/no-value").is_err());
    }

    #[test]
    fn refuses_unknown_states_and_cursors() {
        let q = ListQuery { state: "exploded".into(), ..Default::default() };
        assert!(matches!(q.filter(), Err(PageError::BadRequest(_))));
        let q = ListQuery { after: "nonsense".into(), ..Default::default() };
        assert!(matches!(q.filter(), Err(PageError::BadRequest(_))));
    }
}
