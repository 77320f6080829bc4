//! Access: the Host allow-list (DNS rebinding), the token gate (login form,
//! per-login sessions that expire, logout, bearer header), the login rate
//! limit, the CSRF token of POST forms with the Origin/Referer check, and the
//! security headers of every response.
//!
//! Invariants: a request whose Host is not one the dashboard is served as gets
//! 421 before any other check or handler; with a token configured, no handler
//! runs for a request that has not shown it or a live session (the login page
//! aside); every comparison of a secret is in constant time (`subtle`); every
//! POST that changes something passes [`Access::verify_post`] first.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::{Form, extract::Query};
use serde::Deserialize;
use subtle::ConstantTimeEq;
use uuid::Uuid;

use crate::App;
use maud::html;

use crate::html as shell;

/// The session cookie's name over plain HTTP.
pub(crate) const COOKIE: &str = "durastep_session";
/// The session cookie's name when the dashboard is reached over TLS: the
/// `__Host-` prefix makes browsers refuse it unless it is `Secure`, has
/// `Path=/` and no `Domain`, so no sibling host can set or shadow it.
pub(crate) const SECURE_COOKIE: &str = "__Host-durastep_session";

/// Failed logins allowed per [`LOGIN_WINDOW`] (for the whole process).
pub(crate) const LOGIN_ATTEMPTS: usize = 5;
/// The window of the login rate limit.
pub(crate) const LOGIN_WINDOW: Duration = Duration::from_secs(60);
/// Live sessions kept at most; logging in past it ends the oldest.
const MAX_SESSIONS: usize = 1_000;

/// The secrets and sessions of one dashboard process.
pub(crate) struct Access {
    /// The access token, when one is configured.
    token: Option<String>,
    /// The CSRF token embedded in every POST form: random per process.
    csrf: String,
    /// Live sessions: id → when it expires. A new random id per login.
    sessions: Mutex<HashMap<String, Instant>>,
    /// How long a session lives after its login.
    session_ttl: Duration,
    /// When recent failed logins happened (oldest first).
    failures: Mutex<Vec<Instant>>,
    /// Whether browsers reach the dashboard over TLS (cookies get `Secure`
    /// and the `__Host-` prefix).
    secure: bool,
    /// Host names the dashboard answers to (lowercase, without port).
    hosts: Vec<String>,
}

/// 244 random bits (two v4 UUIDs), as 64 hex digits.
fn random_secret() -> String {
    format!("{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple())
}

/// Equal, in time independent of where they differ (`subtle`); the length of
/// `expected` may show.
pub(crate) fn same_secret(expected: &str, given: &str) -> bool {
    bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
}

/// What [`Access::new`] needs.
pub(crate) struct AccessConfig {
    pub token: Option<String>,
    pub session_ttl: Duration,
    pub secure: bool,
    pub hosts: Vec<String>,
}

impl Access {
    pub(crate) fn new(c: AccessConfig) -> Self {
        Access {
            token: c.token,
            csrf: random_secret(),
            sessions: Mutex::new(HashMap::new()),
            session_ttl: c.session_ttl,
            failures: Mutex::new(Vec::new()),
            secure: c.secure,
            hosts: c.hosts.into_iter().map(|h| h.to_ascii_lowercase()).collect(),
        }
    }

    /// The CSRF token for forms.
    pub(crate) fn csrf(&self) -> &str {
        &self.csrf
    }

    /// Whether a token is configured (every page then requires it).
    pub(crate) fn has_token(&self) -> bool {
        self.token.is_some()
    }

    fn cookie_name(&self) -> &'static str {
        if self.secure { SECURE_COOKIE } else { COOKIE }
    }

    /// Whether the request's Host is one the dashboard is served as.
    fn host_allowed(&self, request: &Request) -> bool {
        if request.headers().get_all(header::HOST).iter().count() > 1 {
            return false; // ambiguous: refused, as HTTP/1.1 asks
        }
        let host = request
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .or_else(|| request.uri().authority().map(|a| a.as_str().to_owned()));
        let Some(host) = host else { return false };
        let name = host_name(&host).to_ascii_lowercase();
        self.hosts.contains(&name)
    }

    /// Whether the request shows the token (bearer header) or a live session cookie.
    fn authenticated(&self, headers: &HeaderMap) -> bool {
        let Some(token) = &self.token else { return true };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|given| same_secret(token, given.trim()));
        bearer || cookie(headers, self.cookie_name()).is_some_and(|given| self.session_live(given))
    }

    /// Whether `given` is a session that has not expired (compared with each
    /// live session in constant time; expired ones are dropped).
    fn session_live(&self, given: &str) -> bool {
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|_, expires| *expires > now);
        sessions.keys().fold(false, |found, id| found | same_secret(id, given))
    }

    /// A new session, random per login.
    fn open_session(&self) -> String {
        let id = random_secret();
        let now = Instant::now();
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|_, expires| *expires > now);
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions.iter().min_by_key(|(_, e)| **e).map(|(k, _)| k.clone())
        {
            sessions.remove(&oldest);
        }
        sessions.insert(id.clone(), now + self.session_ttl);
        id
    }

    /// Ends the session the request carries, if any.
    fn close_session(&self, headers: &HeaderMap) {
        let Some(given) = cookie(headers, self.cookie_name()) else { return };
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|id, _| !same_secret(id, given));
    }

    /// The `Set-Cookie` value for a session (or for clearing it, with `None`).
    fn session_cookie(&self, session: Option<&str>) -> String {
        let secure = if self.secure { "; Secure" } else { "" };
        match session {
            Some(id) => format!(
                "{}={id}; Path=/; HttpOnly; SameSite=Strict; Max-Age={}{secure}",
                self.cookie_name(),
                self.session_ttl.as_secs()
            ),
            None => format!("{}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0{secure}", self.cookie_name()),
        }
    }

    /// Whether another login may be tried now (fewer than [`LOGIN_ATTEMPTS`]
    /// failures in the last [`LOGIN_WINDOW`]); else how long to wait.
    fn login_allowed(&self) -> Result<(), Duration> {
        let now = Instant::now();
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        failures.retain(|t| now.duration_since(*t) < LOGIN_WINDOW);
        if failures.len() >= LOGIN_ATTEMPTS {
            let oldest = failures[0];
            return Err(LOGIN_WINDOW.saturating_sub(now.duration_since(oldest)));
        }
        Ok(())
    }

    fn login_failed(&self) {
        self.failures.lock().unwrap_or_else(|e| e.into_inner()).push(Instant::now());
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

/// The host name of a `Host` value: `[::1]:7070` → `[::1]`, `a.b:80` → `a.b`.
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if host.starts_with('[') {
        return host.split_inclusive(']').next().unwrap_or(host);
    }
    host.rsplit_once(':').map_or(host, |(name, _port)| name)
}

/// A POST refused by the CSRF or origin check: 403, nothing changed.
pub(crate) struct Forbidden;

impl IntoResponse for Forbidden {
    fn into_response(self) -> Response {
        forbidden()
    }
}

fn forbidden() -> Response {
    let body = shell::page(
        "Forbidden",
        html! {
            h1 { "403 Forbidden" }
            p {
                "This form is stale or did not come from this dashboard (CSRF check failed). Nothing was changed. \
                 Reload the page and try again."
            }
        },
        None,
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
/// request with neither (not from a browser) passes, the CSRF token still
/// applies. The Host itself is on the allow-list (checked first), so a page
/// served under another name (DNS rebinding) never gets this far.
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

/// The outermost check: a Host the dashboard is not served as gets 421
/// Misdirected Request, before authentication and before any handler. This
/// is what stops DNS rebinding (a web page whose own name resolves to
/// 127.0.0.1 sends its name as Host).
pub(crate) async fn hosts(State(app): State<App>, request: Request, next: Next) -> Response {
    if app.access.host_allowed(&request) {
        return next.run(request).await;
    }
    tracing::warn!(host = ?request.headers().get(header::HOST), "dashboard request for an unknown host refused");
    secure(
        (
            StatusCode::MISDIRECTED_REQUEST,
            "421 Misdirected Request: this dashboard is not served under that host name (see --allow-host)\n",
        )
            .into_response(),
    )
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
        Redirect::to(&format!("/login{}", shell::query(&[("next", target)]))).into_response()
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

/// The logout form.
#[derive(Deserialize)]
pub(crate) struct LogoutForm {
    csrf: Option<String>,
}

/// Where to go after logging in: a path on this dashboard only (no open
/// redirect). Browsers drop tabs and newlines from URLs and read `\` as `/`,
/// so `/%09/evil.example` would become `//evil.example`: anything but visible
/// ASCII, a backslash, or a second leading slash sends the user to `/`.
pub(crate) fn local_path(next: &str) -> &str {
    let safe =
        next.starts_with('/') && !next.starts_with("//") && next.chars().all(|c| c.is_ascii_graphic() && c != '\\');
    if safe { next } else { "/" }
}

fn login_page(next: &str, message: Option<&str>) -> String {
    shell::page(
        "Log in",
        html! {
            h1 { "Log in" }
            @if let Some(m) = message { p.err { (m) } }
            form method="post" action="/login" {
                input type="hidden" name="next" value=(local_path(next));
                label {
                    "Access token "
                    input type="password" name="token" autocomplete="current-password" autofocus;
                }
                " "
                button type="submit" { "Log in" }
            }
        },
        None,
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

/// POST /login: checks the token (at most [`LOGIN_ATTEMPTS`] failures a
/// minute), opens a new session and sets its cookie.
pub(crate) async fn login(State(app): State<App>, headers: HeaderMap, Form(form): Form<LoginForm>) -> Response {
    let Some(token) = &app.access.token else { return Redirect::to("/").into_response() };
    if !same_origin(&headers) {
        return forbidden();
    }
    if let Err(wait) = app.access.login_allowed() {
        tracing::warn!("dashboard login refused: too many failed attempts");
        let secs = wait.as_secs().max(1);
        let page = login_page(&form.next, Some(&format!("Too many failed logins; try again in {secs} s.")));
        return (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, secs.to_string())], Html(page)).into_response();
    }
    if !same_secret(token, &form.token) {
        app.access.login_failed();
        tracing::warn!("dashboard login with a wrong token");
        return (StatusCode::UNAUTHORIZED, Html(login_page(&form.next, Some("Wrong access token.")))).into_response();
    }
    let session = app.access.open_session();
    let mut response = Redirect::to(local_path(&form.next)).into_response();
    if let Ok(v) = HeaderValue::from_str(&app.access.session_cookie(Some(&session))) {
        response.headers_mut().insert(header::SET_COOKIE, v);
    }
    response
}

/// POST /logout: ends this browser's session (CSRF-checked) and clears its cookie.
pub(crate) async fn logout(
    State(app): State<App>,
    headers: HeaderMap,
    form: Result<Form<LogoutForm>, axum::extract::rejection::FormRejection>,
) -> Response {
    let csrf = form.as_ref().ok().and_then(|Form(f)| f.csrf.as_deref());
    if let Err(denied) = app.access.verify_post(&headers, csrf) {
        return denied.into_response();
    }
    app.access.close_session(&headers);
    let target = if app.access.has_token() { "/login" } else { "/" };
    let mut response = Redirect::to(target).into_response();
    if let Ok(v) = HeaderValue::from_str(&app.access.session_cookie(None)) {
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

    /// Catches: `next=/%09/evil.example` (and `\`-tricks) passing the local-path
    /// check, which browsers turn into `//evil.example` (an open redirect).
    #[test]
    fn reads_cookies_and_keeps_redirects_local() {
        let h = headers(&[("cookie", "a=1; durastep_session=xyz; b=2")]);
        assert_eq!(cookie(&h, COOKIE), Some("xyz"));
        assert_eq!(cookie(&h, "c"), None);
        assert_eq!(local_path("/runs?state=failed"), "/runs?state=failed");
        for evil in [
            "//evil.example",
            "https://evil.example",
            "/\t/evil.example",
            "/\n/evil.example",
            "/\r/evil.example",
            "/ /evil.example",
            "/\\evil.example",
            "\\/evil.example",
            "/\u{a0}/evil.example",
            "evil.example",
            "",
        ] {
            assert_eq!(local_path(evil), "/", "{evil:?}");
        }
    }

    #[test]
    fn host_names_without_ports() {
        assert_eq!(host_name("127.0.0.1:7070"), "127.0.0.1");
        assert_eq!(host_name("[::1]:7070"), "[::1]");
        assert_eq!(host_name("[::1]"), "[::1]");
        assert_eq!(host_name("localhost"), "localhost");
        assert_eq!(host_name("Dash.Example.com:443"), "Dash.Example.com");
    }
}
