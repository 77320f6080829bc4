//! The pages, one module each; every one reads through the inspection API only.

use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};

use maud::{Markup, html};

use crate::html as shell;

pub(crate) mod functions;
pub(crate) mod overview;
pub(crate) mod run;
pub(crate) mod runs;
pub(crate) mod timeline;

/// A page that could not be rendered, as an HTML error page.
#[derive(Debug)]
pub(crate) enum PageError {
    /// 404 with what was not found.
    NotFound(String),
    /// 400: the request asks for something malformed.
    BadRequest(String),
    /// 409: the action does not apply to the run as it is now.
    Conflict(String),
    /// 403: the action is not available here (a read-only dashboard).
    Forbidden(String),
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
            PageError::Forbidden(m) => (StatusCode::FORBIDDEN, m),
            PageError::Internal => {
                (StatusCode::INTERNAL_SERVER_ERROR, "the database query failed; see the dashboard's log".to_owned())
            }
        };
        let title = status.canonical_reason().unwrap_or("Error");
        let body = html! {
            h1 { (status.as_u16()) " " (title) }
            p.err { (message) }
        };
        (status, Html(shell::page(title, body, None, None))).into_response()
    }
}

/// The result of a page handler.
pub(crate) type PageResult = Result<Html<String>, PageError>;

/// Any path no route matches.
pub(crate) async fn not_found() -> PageError {
    PageError::NotFound("no such page".into())
}

/// What a hidden key or error text says instead of itself.
pub(crate) const HIDDEN_VALUE: &str = "(hidden)";

/// What a hidden value says instead of itself.
pub(crate) fn hidden() -> Markup {
    html! {
        p.muted {
            "Hidden: outputs, event data, keys and error texts are shown only with an access token configured, \
             or when the dashboard is started with "
            code { "--show-data" } " (" code { "DashboardConfig::show_data" } ") in loopback mode."
        }
    }
}
