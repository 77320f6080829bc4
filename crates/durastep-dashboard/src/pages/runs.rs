//! The run list: filters (function, state, key pointer=value, idempotency
//! key, event name) and next-page links carrying the listing's cursor.

use std::fmt::Write as _;

use axum::extract::{Query, State};
use axum::response::Html;
use durastep::RunState;
use durastep::inspect::{Cursor, RunFilter};
use serde::Deserialize;
use serde_json::Value;

use super::overview::short;
use super::{PageError, PageResult};
use crate::App;
use crate::html::{self, esc, query};

/// Runs per page.
const PAGE: u32 = 50;

/// The filter form's fields, as they come in the query string.
#[derive(Debug, Default, Deserialize)]
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
    #[serde(default)]
    after: String,
}

impl ListQuery {
    fn pairs<'a>(&'a self, after: &'a str) -> [(&'a str, &'a str); 6] {
        [
            ("function", self.function.as_str()),
            ("state", self.state.as_str()),
            ("key", self.key.as_str()),
            ("idempotency_key", self.idempotency_key.as_str()),
            ("event", self.event.as_str()),
            ("after", after),
        ]
    }

    /// The inspection filter these fields describe.
    fn filter(&self) -> Result<RunFilter, PageError> {
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
    let filter = q.filter()?;
    let page = app.engine.inspect().runs(&filter).await?;
    let mut body = String::from("<h1>Runs</h1>");
    form(&mut body, &q);
    if page.runs.is_empty() {
        body.push_str("<p class=\"muted\">No runs match.</p>");
    } else {
        body.push_str(
            "<table><tr><th>Run</th><th>Function</th><th>Event</th><th>Idempotency key</th><th>State</th>\
             <th>Attempt</th><th>Created</th><th>Finished</th><th>Last error</th></tr>",
        );
        for r in &page.runs {
            let _ = write!(
                body,
                "<tr><td><a class=\"run\" href=\"/runs/{id}\">{id}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
                 <td class=\"n\">{}/{}</td><td>{}</td><td>{}</td><td class=\"err\">{}</td></tr>",
                esc(&r.function_id),
                esc(&r.event_name),
                esc(r.idempotency_key.as_deref().unwrap_or("")),
                html::state_badge(r.state),
                r.attempt,
                r.max_attempts,
                html::time(r.created_at),
                html::opt_time(r.finished_at),
                esc(&short(r.last_error.as_deref().unwrap_or(""), 120)),
                id = r.id,
            );
        }
        body.push_str("</table>");
    }
    body.push_str("<p>");
    if !q.after.is_empty() {
        let _ = write!(body, "<a href=\"/runs{}\">First page</a> ", esc(&query(&q.pairs(""))));
    }
    if let Some(next) = page.next {
        let next = next.to_string();
        let _ = write!(body, "<a rel=\"next\" href=\"/runs{}\">Next page →</a>", esc(&query(&q.pairs(&next))));
    }
    body.push_str("</p>");
    Ok(Html(html::page("Runs", &body, None)))
}

fn form(out: &mut String, q: &ListQuery) {
    let _ = write!(
        out,
        "<form method=\"get\" action=\"/runs\">\
         <label>Function <input name=\"function\" value=\"{}\"></label> \
         <label>State <select name=\"state\"><option value=\"\">any</option>",
        esc(&q.function)
    );
    for s in RunState::ALL {
        let selected = if q.state == s.as_str() { " selected" } else { "" };
        let _ = write!(out, "<option{selected}>{}</option>", s.as_str());
    }
    let _ = write!(
        out,
        "</select></label> \
         <label>Key <input name=\"key\" placeholder=\"/ad_account_id=act_7\" value=\"{}\"></label> \
         <label>Idempotency key <input name=\"idempotency_key\" value=\"{}\"></label> \
         <label>Event <input name=\"event\" value=\"{}\"></label> \
         <button type=\"submit\">Filter</button> <a href=\"/runs\">clear</a></form>",
        esc(&q.key),
        esc(&q.idempotency_key),
        esc(&q.event)
    );
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
