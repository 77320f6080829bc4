//! The webhook receiver: one CRM stage change in, one Durastep event out.
//!
//! `POST /webhooks/stage-changed` takes a [`StageChange`] and sends the event
//! `crm/stage.<stage>` with the idempotency key `contact_id:stage:iso_week`.
//! The engine creates one run per side effect function the event triggers. A
//! re-fired webhook carries the same key, so it creates nothing (`202` with
//! `"duplicate": true`): the story's `UNIQUE(kind, dedupe_key)`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use durastep::{Engine, Event};
use serde::{Deserialize, Serialize};
use serde_json::json;
use uuid::Uuid;

use crate::clock::Clock;
use crate::stage::{Stage, StageChange};

/// The receiver's answer to an accepted webhook.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Accepted {
    /// The dedupe key the event was sent with.
    pub dedupe_key: String,
    /// Whether the stage change had been received before (nothing was created).
    pub duplicate: bool,
    /// The runs of this stage change, one per side effect.
    pub run_ids: Vec<Uuid>,
}

/// Counts of what the receiver has handled.
#[derive(Debug, Default)]
pub struct ReceiverStats {
    webhooks: AtomicU64,
    duplicates: AtomicU64,
}

impl ReceiverStats {
    /// Webhooks accepted (duplicates included).
    pub fn webhooks(&self) -> u64 {
        self.webhooks.load(Ordering::SeqCst)
    }

    /// Webhooks that repeated a stage change already received.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::SeqCst)
    }
}

#[derive(Clone)]
struct Receiver {
    engine: Engine,
    clock: Clock,
    stats: Arc<ReceiverStats>,
}

/// The receiver's routes. `clock` stamps `received_at` on each stage change.
pub fn router(engine: Engine, clock: Clock, stats: Arc<ReceiverStats>) -> Router {
    Router::new().route("/webhooks/stage-changed", post(stage_changed)).with_state(Receiver { engine, clock, stats })
}

async fn stage_changed(State(r): State<Receiver>, Json(mut change): Json<StageChange>) -> Response {
    if change.stage == Stage::Placement && change.fee_cents.is_none() {
        return (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({"error": "a placement needs fee_cents"})))
            .into_response();
    }
    change.received_at = Some(r.clock.now().await);
    let dedupe_key = change.dedupe_key();
    let event = Event::new(change.stage.event_name(), &change).idempotency_key(&dedupe_key);
    match r.engine.send(event).await {
        Ok(receipt) => {
            r.stats.webhooks.fetch_add(1, Ordering::SeqCst);
            if receipt.duplicate {
                r.stats.duplicates.fetch_add(1, Ordering::SeqCst);
            }
            let accepted = Accepted { dedupe_key, duplicate: receipt.duplicate, run_ids: receipt.run_ids };
            (StatusCode::ACCEPTED, Json(accepted)).into_response()
        }
        Err(durastep::Error::Limit(e)) => {
            (StatusCode::UNPROCESSABLE_ENTITY, Json(json!({"error": e.to_string()}))).into_response()
        }
        Err(e) => {
            // The CRM re-fires webhooks that fail; the dedupe key makes that safe.
            tracing::warn!(error = %e, %dedupe_key, "could not store the stage change");
            (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"error": e.to_string()}))).into_response()
        }
    }
}
