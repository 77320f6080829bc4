//! The POST actions: replay (from the failed step or from the start) and
//! cancel. Each checks the CSRF token and origin before touching the run, then
//! redirects back to the run's page.

use axum::Form;
use axum::extract::rejection::FormRejection;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Redirect, Response};
use durastep::ReplayFrom;
use serde::Deserialize;

use crate::App;
use crate::pages::{PageError, run::run_id};

/// The replay form.
#[derive(Deserialize)]
pub(crate) struct ReplayForm {
    csrf: Option<String>,
    /// `failed_step` (default) or `start`.
    from: Option<String>,
}

/// The cancel form.
#[derive(Deserialize)]
pub(crate) struct CancelForm {
    csrf: Option<String>,
    reason: Option<String>,
}

/// POST /runs/{id}/replay
pub(crate) async fn replay(
    State(app): State<App>,
    Path(raw): Path<String>,
    headers: HeaderMap,
    form: Result<Form<ReplayForm>, FormRejection>,
) -> Response {
    // An unreadable form has no valid CSRF token either: 403, like a missing one.
    let form = form.ok().map(|Form(f)| f);
    if let Err(denied) = app.access.verify_post(&headers, form.as_ref().and_then(|f| f.csrf.as_deref())) {
        return denied.into_response();
    }
    let from = match form.and_then(|f| f.from).as_deref() {
        Some("start") => ReplayFrom::Start,
        None | Some("failed_step") => ReplayFrom::FailedStep,
        Some(other) => return PageError::BadRequest(format!("replay from {other:?}?")).into_response(),
    };
    let result = async {
        let id = run_id(&raw)?;
        app.engine.replay(id, from).await?;
        tracing::info!(run_id = %id, ?from, "run replayed from the dashboard");
        Ok::<_, PageError>(Redirect::to(&format!("/runs/{id}?done=replayed")))
    };
    result.await.into_response()
}

/// POST /runs/{id}/cancel
pub(crate) async fn cancel(
    State(app): State<App>,
    Path(raw): Path<String>,
    headers: HeaderMap,
    form: Result<Form<CancelForm>, FormRejection>,
) -> Response {
    let form = form.ok().map(|Form(f)| f);
    if let Err(denied) = app.access.verify_post(&headers, form.as_ref().and_then(|f| f.csrf.as_deref())) {
        return denied.into_response();
    }
    let reason = form
        .and_then(|f| f.reason)
        .map(|r| r.trim().to_owned())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| "cancelled from the dashboard".into());
    let result = async {
        let id = run_id(&raw)?;
        app.engine.cancel(id, &reason).await?;
        tracing::info!(run_id = %id, "run cancelled from the dashboard");
        Ok::<_, PageError>(Redirect::to(&format!("/runs/{id}?done=cancelled")))
    };
    result.await.into_response()
}
