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
use crate::pages::runs::ListQuery;
use crate::pages::{PageError, run::run_id};

/// The engine behind the actions; a read-only dashboard has none.
fn engine(app: &App) -> Result<&durastep::Engine, PageError> {
    app.engine.as_ref().ok_or_else(|| PageError::Forbidden("this dashboard is read-only".into()))
}

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
        engine(&app)?.replay(id, from).await?;
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
        engine(&app)?.cancel(id, &reason).await?;
        tracing::info!(run_id = %id, "run cancelled from the dashboard");
        Ok::<_, PageError>(Redirect::to(&format!("/runs/{id}?done=cancelled")))
    };
    result.await.into_response()
}

/// The bulk replay form: the run list's filter, the CSRF token, and
/// `confirm=yes` once the user has seen how many runs it replays.
#[derive(Deserialize)]
pub(crate) struct ReplayManyForm {
    csrf: Option<String>,
    #[serde(default)]
    confirm: String,
    #[serde(flatten)]
    filter: ListQuery,
}

/// POST /runs/replay: replays every failed (or cancelled) run matching the
/// run list's filter. Without `confirm=yes` it changes nothing and shows how
/// many runs would be replayed, with a button that confirms.
pub(crate) async fn replay_many(
    State(app): State<App>,
    headers: HeaderMap,
    form: Result<Form<ReplayManyForm>, FormRejection>,
) -> Response {
    let form = form.ok().map(|Form(f)| f);
    if let Err(denied) = app.access.verify_post(&headers, form.as_ref().and_then(|f| f.csrf.as_deref())) {
        return denied.into_response();
    }
    let Some(form) = form else { return PageError::BadRequest("unreadable form".into()).into_response() };
    let result = async {
        let engine = engine(&app)?;
        let filter = form.filter.replay_filter()?;
        if form.confirm != "yes" {
            let count = crate::pages::runs::count_matching(&app, &filter).await?;
            return Ok(crate::pages::runs::confirm_replay(&app, &form.filter, count).into_response());
        }
        let ids = engine.replay_many(&filter, ReplayFrom::FailedStep).await?;
        tracing::info!(runs = ids.len(), "runs replayed from the dashboard");
        let back = crate::html::query(&form.filter.pairs(""));
        let sep = if back.is_empty() { '?' } else { '&' };
        Ok::<_, PageError>(Redirect::to(&format!("/runs{back}{sep}replayed={}", ids.len())).into_response())
    };
    result.await.unwrap_or_else(IntoResponse::into_response)
}
