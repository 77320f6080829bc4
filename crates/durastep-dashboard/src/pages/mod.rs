//! The pages, one module each; every one reads through the inspection API only.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use crate::html::{self, esc};

pub(crate) mod functions;
pub(crate) mod overview;
pub(crate) mod run;
pub(crate) mod runs;

/// A page that could not be rendered, as an HTML error page.
#[derive(Debug)]
pub(crate) enum PageError {
    /// 404 with what was not found.
    NotFound(String),
    /// 400: the request asks for something malformed.
    BadRequest(String),
    /// 409: the action does not apply to the run as it is now.
    Conflict(String),
    /// 500: the database failed; the detail goes to the log, not the page.
    Internal,
}

impl From<durastep::Error> for PageError {
    fn from(e: durastep::Error) -> Self {
        match e {
            durastep::Error::UnknownRun(id) => PageError::NotFound(format!("no run with id {id}")),
            durastep::Error::InvalidFilter(m) => PageError::BadRequest(m),
            durastep::Error::Limit(l) => PageError::BadRequest(l.to_string()),
            e @ (durastep::Error::NotReplayable { .. } | durastep::Error::RunFinished { .. }) => {
                PageError::Conflict(e.to_string())
            }
            e => {
                tracing::error!(error = %e, "dashboard page failed");
                PageError::Internal
            }
        }
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let (status, message) = match self {
            PageError::NotFound(m) => (StatusCode::NOT_FOUND, m),
            PageError::BadRequest(m) => (StatusCode::BAD_REQUEST, m),
            PageError::Conflict(m) => (StatusCode::CONFLICT, m),
            PageError::Internal => {
                (StatusCode::INTERNAL_SERVER_ERROR, "the database query failed; see the dashboard's log".to_owned())
            }
        };
        let title = status.canonical_reason().unwrap_or("Error");
        let body = format!("<h1>{} {}</h1><p class=\"err\">{}</p>", status.as_u16(), esc(title), esc(&message));
        (status, Html(html::page(title, &body, None))).into_response()
    }
}

/// The result of a page handler.
pub(crate) type PageResult = Result<Html<String>, PageError>;

/// Any path no route matches.
pub(crate) async fn not_found() -> PageError {
    PageError::NotFound("no such page".into())
}

/// What a hidden value says instead of itself.
pub(crate) const HIDDEN: &str = "<p class=\"muted\">Hidden: outputs and event data are shown only with an \
    access token configured, or with <code>show_data</code> in loopback mode.</p>";
