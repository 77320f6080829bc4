//! The outreach tool: `PUT /v1/prospects/{email}/status`.
//!
//! Setting a status is idempotent by nature; it still counts every update.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::put;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Traffic, lock, token};
use crate::clock::Clock;

/// A status update.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatusUpdate {
    /// The new outreach status.
    pub status: String,
}

/// The outreach simulator's state.
#[derive(Debug, Default)]
pub struct Outreach {
    traffic: Traffic,
    statuses: Mutex<HashMap<String, String>>,
}

impl Outreach {
    /// What it has received.
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    /// A prospect's current status.
    pub fn status_of(&self, email: &str) -> Option<String> {
        lock(&self.statuses).get(email).cloned()
    }
}

pub(super) fn router(outreach: Arc<Outreach>, clock: Clock) -> Router {
    Router::new().route("/v1/prospects/{email}/status", put(set_status)).with_state((outreach, clock))
}

async fn set_status(
    State((outreach, clock)): State<(Arc<Outreach>, Clock)>,
    Path(email): Path<String>,
    headers: HeaderMap,
    Json(update): Json<StatusUpdate>,
) -> Response {
    outreach.traffic.arrived();
    if !email.contains('@') {
        outreach.traffic.reject();
        return (StatusCode::NOT_FOUND, Json(json!({"error": "no such prospect"}))).into_response();
    }
    outreach.traffic.accept(token(&headers).as_deref().unwrap_or_default(), clock.now().await);
    lock(&outreach.statuses).insert(email, update.status);
    (StatusCode::NO_CONTENT, ()).into_response()
}
