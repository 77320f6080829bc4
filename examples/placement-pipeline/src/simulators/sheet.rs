//! The master placement sheet: `POST /v4/spreadsheets/{sheet}/values/append`.
//!
//! Appending is not idempotent: it records every row it is sent, so a
//! duplicate row would show (the token is the row's first cell).

use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Traffic, lock, token};
use crate::clock::Clock;

/// An append request: rows of cells.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Append {
    /// The rows to append.
    pub values: Vec<Vec<Value>>,
}

/// The sheet simulator's state.
#[derive(Debug, Default)]
pub struct Sheet {
    traffic: Traffic,
    rows: Mutex<Vec<(String, Vec<Value>)>>,
}

impl Sheet {
    /// What it has received.
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    /// Rows in the sheet.
    pub fn rows(&self) -> usize {
        lock(&self.rows).len()
    }

    /// Rows whose first cell is this token.
    pub fn rows_with(&self, token: &str) -> usize {
        lock(&self.rows).iter().filter(|(_, r)| r.first().and_then(Value::as_str) == Some(token)).count()
    }
}

pub(super) fn router(sheet: Arc<Sheet>, clock: Clock) -> Router {
    Router::new().route("/v4/spreadsheets/{sheet}/values/append", post(append)).with_state((sheet, clock))
}

async fn append(
    State((sheet, clock)): State<(Arc<Sheet>, Clock)>,
    Path(name): Path<String>,
    headers: HeaderMap,
    Json(append): Json<Append>,
) -> Response {
    sheet.traffic.arrived();
    if append.values.is_empty() {
        sheet.traffic.reject();
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "no rows"}))).into_response();
    }
    sheet.traffic.accept(token(&headers).as_deref().unwrap_or_default(), clock.now().await);
    let rows = append.values.len();
    lock(&sheet.rows).extend(append.values.into_iter().map(|row| (name.clone(), row)));
    (StatusCode::OK, Json(json!({"updates": {"updatedRows": rows}}))).into_response()
}
