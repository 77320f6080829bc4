//! Access: the token gate (login form, session cookie, bearer header), the
//! CSRF token of POST forms with the Origin/Referer check, and the security
//! headers of every response.
//!
//! Invariant: with a token configured, no handler runs for a request that has
//! not shown it (the login page aside); every comparison of a secret is in
//! constant time; every POST that changes a run passes [`Access::verify_post`]
//! first.

use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::{Form, extract::Query};
use serde::Deserialize;
use uuid::Uuid;

use crate::App;
use crate::html::{self, esc};

/// The session cookie's name.
pub(crate) const COOKIE: &str = "durastep_session";

/// The secrets of one dashboard process.
pub(crate) struct Access {
    /// The access token, when one is configured.
    token: Option<String>,
    /// The cookie value a browser gets after logging in: random per process, so
    /// the token itself never sits in a cookie and a restart logs everyone out.
    session: String,
    /// The CSRF token embedded in every POST form: random per process.
    csrf: String,
}

/// 244 random bits (two v4 UUIDs), as 64 hex digits.
fn random_secret() -> String {
    format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple())
}

/// Equal in constant time (for a given length of `expected`).
pub(crate) fn same_secret(expected: &str, given: &str) -> bool {
    let (a, b) = (expected.as_bytes(), given.as_bytes());
    let mut diff = u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

impl Access {
    pub(crate) fn new(token: Option<String>) -> Self {
        Access { token, session: random_secret(), csrf: random_secret() }
    }

    /// The CSRF token for forms.
    pub(crate) fn csrf(&self) -> &str {
        &self.csrf
    }

    /// Whether a token is configured (every page then requires it).
    pub(crate) fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// Whether the request shows the token (bearer header) or a session cookie.
    fn authenticated(&self, headers: &HeaderMap) -> bool {
        let Some(token) = &self.token else { return true };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| same_secret(token, given.trim()));
        bearer || cookie(headers, COOKIE).is_some_and(|given| same_secret(&self.session, given))
    }

    /// A POST that changes something: the form's CSRF token must be this
    /// process's, and the request must come from a page of this host.
    pub(crate) fn verify_post(&self, headers: &HeaderMap, csrf: Option<&str>) -> Result<(), Forbidden> {
        let token_ok = csrf.is_some_and(|c| same_secret(&self.csrf, c));
        if !token_ok || !same_origin(headers) {
            return Err(Forbidden);
        }
        Ok(())
    }
}

/// A POST refused by the CSRF or origin check: 403, nothing changed.
pub(crate) struct Forbidden;

impl IntoResponse for Forbidden {
    fn into_response(self) -> Response {
        forbidden()
    }
}

fn forbidden() -> Response {
    let body = html::page(
        "Forbidden",
        "<h1>403 Forbidden</h1><p>This form is stale or did not come from this dashboard (CSRF check \
         failed). Nothing was changed. Reload the page and try again.</p>",
        None,
    );
    (StatusCode::FORBIDDEN, Html(body)).into_response()
}

/// The value of one cookie of the request.
fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// The request's Origin (or else Referer) names the host it was sent to; a
/// request with neither (not from a browser) passes, the CSRF token still applies.
fn same_origin(headers: &HeaderMap) -> bool {
    let source = headers.get(header::ORIGIN).or_else(|| headers.get(header::REFERER));
    let Some(source) = source.and_then(|v| v.to_str().ok()) else { return source.is_none() };
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else { return false };
    let Some(rest) = source.strip_prefix("http://").or_else(|| source.strip_prefix("https://")) else {
        return false; // "null" and other schemes
    };
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    authority.eq_ignore_ascii_case(host)
}

/// Headers on every response: no framing, no scripts, no caching, no referrer leaks.
fn secure(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// The gate in front of every route.
pub(crate) async fn gate(State(app): State<App>, request: Request, next: Next) -> Response {
    let open = request.uri().path() == "/login";
    if open || app.access.authenticated(request.headers()) {
        return secure(next.run(request).await);
    }
    let tried_bearer = request.headers().contains_key(header::AUTHORIZATION);
    let response = if request.method() == Method::GET && !tried_bearer {
        let target = request.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/");
        Redirect::to(&format!("/login{}", html::query(&[("next", target)]))).into_response()
    } else {
        (StatusCode::UNAUTHORIZED, [(header::WWW_AUTHENTICATE, "Bearer")], "401 Unauthorized: access token required\n")
            .into_response()
    };
    secure(response)
}

/// Query of the login page.
#[derive(Deserialize)]
pub(crate) struct LoginQuery {
    #[serde(default)]
    next: String,
}

/// The login form.
#[derive(Deserialize)]
pub(crate) struct LoginForm {
    #[serde(default)]
    token: String,
    #[serde(default)]
    next: String,
}

/// Where to go after logging in: a local path only (no open redirect).
fn local_path(next: &str) -> &str {
    if next.starts_with('/') && !next.starts_with("//") && !next.contains('\\') { next } else { "/" }
}

fn login_page(next: &str, message: Option<&str>) -> String {
    let note = message.map(|m| format!("<p class=\"err\">{}</p>", esc(m))).unwrap_or_default();
    html::page(
        "Log in",
        &format!(
            "<h1>Log in</h1>{note}<form method=\"post\" action=\"/login\">\
             <input type=\"hidden\" name=\"next\" value=\"{}\">\
             <label>Access token <input type=\"password\" name=\"token\" autocomplete=\"current-password\" autofocus></label> \
             <button type=\"submit\">Log in</button></form>",
            esc(local_path(next))
        ),
        None,
    )
}

/// GET /login
pub(crate) async fn login_form(State(app): State<App>, Query(q): Query<LoginQuery>) -> Response {
    if !app.access.has_token() {
        return Redirect::to("/").into_response();
    }
    Html(login_page(&q.next, None)).into_response()
}

/// POST /login: checks the token, sets the session cookie.
pub(crate) async fn login(State(app): State<App>, headers: HeaderMap, Form(form): Form<LoginForm>) -> Response {
    let Some(token) = &app.access.token else { return Redirect::to("/").into_response() };
    if !same_origin(&headers) {
        return forbidden();
    }
    if !same_secret(token, &form.token) {
        tracing::warn!("dashboard login with a wrong token");
        return (StatusCode::UNAUTHORIZED, Html(login_page(&form.next, Some("Wrong access token.")))).into_response();
    }
    let cookie = format!("{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict", app.access.session);
    let mut response = Redirect::to(local_path(&form.next)).into_response();
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, v);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_secrets() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "ab"));
        assert!(!same_secret("abc", "abcd"));
        assert!(!same_secret("abc", ""));
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn checks_origin_against_host() {
        assert!(same_origin(&headers(&[("host", "127.0.0.1:8080"), ("origin", "http://127.0.0.1:8080")])));
        assert!(!same_origin(&headers(&[("host", "127.0.0.1:8080"), ("origin", "http://evil.example")])));
        assert!(!same_origin(&headers(&[("host", "127.0.0.1:8080"), ("origin", "null")])));
        assert!(same_origin(&headers(&[("host", "h:1"), ("referer", "http://h:1/runs/x?y")])));
        assert!(!same_origin(&headers(&[("host", "h:1"), ("referer", "http://h:1.evil/runs")])));
        assert!(same_origin(&headers(&[("host", "h:1")])));
        assert!(!same_origin(&headers(&[("origin", "http://h:1")])));
    }

    #[test]
    fn reads_cookies_and_keeps_redirects_local() {
        let h = headers(&[("cookie", "a=1; durastep_session=xyz; b=2")]);
        assert_eq!(cookie(&h, COOKIE), Some("xyz"));
        assert_eq!(cookie(&h, "c"), None);
        assert_eq!(local_path("/runs?state=failed"), "/runs?state=failed");
        assert_eq!(local_path("//evil.example"), "/");
        assert_eq!(local_path("https://evil.example"), "/");
    }
}
