//! HTML building: the page shell, URL encoding for links and small
//! formatters. Pages are [`maud`] templates, which escape every value they
//! interpolate (text and attribute values alike).
//!
//! Invariant: raw HTML (`PreEscaped`) appears only here, for the fixed style
//! sheet; no value from the database, the request or the engine is ever
//! written unescaped (`tests/security.rs` greps the sources for it).

use std::fmt::Write as _;
use std::time::Duration;

use axum::response::Html;
use chrono::{DateTime, Utc};
use durastep::RunState;
use maud::{DOCTYPE, Markup, PreEscaped, html};

/// Percent-encodes a query-string component (everything but unreserved characters).
pub(crate) fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A query string from non-empty pairs: `?a=1&b=2` (or "" when none).
pub(crate) fn query(pairs: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (k, v) in pairs.iter().filter(|(_, v)| !v.is_empty()) {
        out.push(if out.is_empty() { '?' } else { '&' });
        let _ = write!(out, "{}={}", url_encode(k), url_encode(v));
    }
    out
}

const STYLE: &str = "
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}
header{background:#1b1f24;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}
header a{color:#cfe3ff;text-decoration:none}header b{margin-right:16px}
main{padding:16px;max-width:1200px}
table{border-collapse:collapse;background:#fff;margin:8px 0 16px}
th,td{border:1px solid #d8dde3;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#eef1f4}td.n{text-align:right;font-variant-numeric:tabular-nums}
.s{padding:1px 6px;border-radius:8px;font-size:12px;background:#e3e7eb}
.s-completed{background:#d4f4dd}.s-failed{background:#fbd5d5}.s-running{background:#d6e6ff}
.s-queued{background:#fff1c2}.s-cancelled,.s-skipped{background:#e6e0f5}.s-sleeping{background:#ece4fb}
a.run,code{word-break:keep-all;white-space:nowrap}
pre{background:#fff;border:1px solid #d8dde3;padding:8px;max-height:320px;overflow:auto;white-space:pre-wrap}
.err{color:#a40e0e;white-space:pre-wrap}.muted{color:#68717a}
form.inline{display:inline-block;margin-right:8px}form.logout{margin-left:auto}
.bar{display:inline-block;height:10px;background:#5b8def}.bar.f{background:#d64545}
";

/// A whole page: the shell with navigation around `body`. `refresh` adds a
/// `<meta http-equiv="refresh">` of that many seconds; `logout` (the CSRF
/// token) adds a Log out button to the header.
pub(crate) fn page(title: &str, body: Markup, refresh: Option<u32>, logout: Option<&str>) -> String {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                @if let Some(secs) = refresh {
                    meta http-equiv="refresh" content=(secs);
                }
                title { (title) " · Durastep" }
                // The one raw output: a fixed style sheet, no data.
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    b { "Durastep" }
                    a href="/" { "Overview" }
                    a href="/runs" { "Runs" }
                    a href="/functions" { "Functions" }
                    @if let Some(csrf) = logout {
                        form.logout method="post" action="/logout" {
                            input type="hidden" name="csrf" value=(csrf);
                            button #logout type="submit" { "Log out" }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
    .into_string()
}

/// [`page`], with a Log out button in the header when the dashboard has a token.
pub(crate) fn app_page(app: &crate::App, title: &str, body: Markup, refresh: Option<u32>) -> Html<String> {
    let logout = app.access.has_token().then(|| app.access.csrf());
    Html(page(title, body, refresh, logout))
}

/// A run state as a coloured badge.
pub(crate) fn state_badge(state: RunState) -> Markup {
    html! { span class={ "s s-" (state.as_str()) } { (state.as_str()) } }
}

/// A time as `2026-11-29 10:04:05.123 UTC`.
pub(crate) fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3f UTC").to_string()
}

/// The first 8 hex digits of an id (the full id goes in the link's title).
pub(crate) fn short_id(id: uuid::Uuid) -> String {
    id.simple().to_string()[..8].to_owned()
}

/// An optional time, or a dash.
pub(crate) fn opt_time(t: Option<DateTime<Utc>>) -> String {
    t.map(time).unwrap_or_else(|| "–".into())
}

/// A duration as `12 ms`, `3.40 s` or `5.0 min`.
pub(crate) fn duration(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else if ms < 120_000.0 {
        format!("{:.2} s", ms / 1000.0)
    } else {
        format!("{:.1} min", ms / 60_000.0)
    }
}

/// Pretty-printed JSON in a `<pre>`.
pub(crate) fn json_block(v: &serde_json::Value) -> Markup {
    let text = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    html! { pre { (text) } }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_escape_every_special_character() {
        let check = |input: &str, expected: &str| {
            assert_eq!(
                html! { td title=(input) { (input) } }.into_string(),
                format!(r#"<td title="{expected}">{expected}</td>"#)
            );
        };
        check("plain", "plain");
        check("<script>alert(\"x\")</script>", "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;");
        check("a&b", "a&amp;b");
        check("&amp;", "&amp;amp;");
        check("", "");
        check("ünïcødé <", "ünïcødé &lt;");
    }

    #[test]
    fn encodes_query_components() {
        assert_eq!(url_encode("/ad_account_id=act 7&x"), "%2Fad_account_id%3Dact%207%26x");
        assert_eq!(query(&[("state", "failed"), ("function", ""), ("key", "a&b")]), "?state=failed&key=a%26b");
        assert_eq!(query(&[("a", "")]), "");
    }

    #[test]
    fn formats_durations() {
        assert_eq!(duration(Duration::from_millis(12)), "12 ms");
        assert_eq!(duration(Duration::from_millis(3400)), "3.40 s");
        assert_eq!(duration(Duration::from_secs(300)), "5.0 min");
    }
}
