//! The CRM's task API: `POST /crm/v3/objects/tasks`.
//!
//! It dedupes by idempotency token: a request whose token it has seen creates
//! no task, returns the existing one, and is counted as a duplicate (what the
//! story's duplicate recruiter tasks would have been). With
//! [`super::Faults::crm_lost_response_every`] it stores a task and then answers
//! `504`, as if the response were lost: the caller cannot know the task exists.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Traffic, lock, token};
use crate::clock::Clock;

/// A task as the API receives it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TaskRequest {
    /// The recruiter the task is assigned to.
    pub owner_id: u64,
    /// The candidate's contact.
    pub contact_id: u64,
    /// What to do.
    pub subject: String,
}

/// The CRM simulator's state.
#[derive(Debug)]
pub struct Crm {
    traffic: Traffic,
    lost_response_every: Option<u64>,
    duplicates: AtomicU64,
    tasks: Mutex<HashMap<String, (String, TaskRequest)>>,
}

impl Crm {
    pub(super) fn new(lost_response_every: Option<u64>) -> Self {
        Crm { traffic: Traffic::default(), lost_response_every, duplicates: AtomicU64::new(0), tasks: Mutex::default() }
    }

    /// What it has received.
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    /// Requests that carried a token it had already seen (no task created).
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::SeqCst)
    }

    /// Tasks created (one per distinct token).
    pub fn tasks(&self) -> usize {
        lock(&self.tasks).len()
    }
}

pub(super) fn router(crm: Arc<Crm>, clock: Clock) -> Router {
    Router::new().route("/crm/v3/objects/tasks", post(create)).with_state((crm, clock))
}

async fn create(
    State((crm, clock)): State<(Arc<Crm>, Clock)>,
    headers: HeaderMap,
    Json(task): Json<TaskRequest>,
) -> Response {
    let n = crm.traffic.arrived();
    let Some(token) = token(&headers) else {
        crm.traffic.reject();
        return (StatusCode::BAD_REQUEST, Json(json!({"message": "Idempotency-Key header required"}))).into_response();
    };
    let existing = {
        let mut tasks = lock(&crm.tasks);
        match tasks.get(&token) {
            Some((id, _)) => Some(id.clone()),
            None => {
                tasks.insert(token.clone(), (format!("task_{n}"), task));
                None
            }
        }
    };
    if let Some(id) = existing {
        // The same write again: answer with the task that exists.
        crm.duplicates.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::OK, Json(json!({"id": id, "duplicate": true}))).into_response();
    }
    if crm.lost_response_every.is_some_and(|every| n.is_multiple_of(every)) {
        // Stored, but the caller never hears so.
        crm.traffic.accept(&token, clock.now().await);
        return (StatusCode::GATEWAY_TIMEOUT, Json(json!({"message": "upstream timed out"}))).into_response();
    }
    crm.traffic.accept(&token, clock.now().await);
    (StatusCode::CREATED, Json(json!({"id": format!("task_{n}")}))).into_response()
}
