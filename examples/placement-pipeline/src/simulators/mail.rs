//! The transactional mail API: `POST /v1/messages`.
//!
//! Like most mail APIs it does not dedupe: every accepted request is a mail in
//! the candidate's inbox, so a test can count mails per idempotency token.

use std::collections::HashMap;
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

/// A mail as the API receives it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Message {
    /// The recipient.
    pub to: String,
    /// The subject line.
    pub subject: String,
    /// The body.
    pub text: String,
}

/// The mail simulator's state.
#[derive(Debug)]
pub struct Mail {
    traffic: Traffic,
    unavailable_every: Option<u64>,
    sent: Mutex<HashMap<String, Vec<Message>>>,
}

impl Mail {
    pub(super) fn new(unavailable_every: Option<u64>) -> Self {
        Mail { traffic: Traffic::default(), unavailable_every, sent: Mutex::default() }
    }

    /// What it has received.
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    /// How many mails were sent with this idempotency token.
    pub fn sent_with(&self, token: &str) -> usize {
        lock(&self.sent).get(token).map_or(0, Vec::len)
    }

    /// The mails sent with this idempotency token.
    pub fn messages(&self, token: &str) -> Vec<Message> {
        lock(&self.sent).get(token).cloned().unwrap_or_default()
    }
}

pub(super) fn router(mail: Arc<Mail>, clock: Clock) -> Router {
    Router::new().route("/v1/messages", post(send)).with_state((mail, clock))
}

async fn send(
    State((mail, clock)): State<(Arc<Mail>, Clock)>,
    headers: HeaderMap,
    Json(message): Json<Message>,
) -> Response {
    let n = mail.traffic.arrived();
    let Some(token) = token(&headers) else {
        mail.traffic.reject();
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "Idempotency-Key header required"}))).into_response();
    };
    if mail.unavailable_every.is_some_and(|every| n.is_multiple_of(every)) {
        mail.traffic.reject();
        return (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": "service temporarily unavailable"})))
            .into_response();
    }
    mail.traffic.accept(&token, clock.now().await);
    let id = format!("msg_{n}");
    lock(&mail.sent).entry(token).or_default().push(message);
    (StatusCode::OK, Json(json!({"id": id}))).into_response()
}
