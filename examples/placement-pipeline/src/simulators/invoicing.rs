//! The invoicing system: `POST /api/v1/{division}/salesinvoice/SalesInvoices`,
//! shaped like Exact Online's draft sales invoices.
//!
//! Exact documents 60 requests per minute, but under sustained load it
//! throttles one integration to about 20 per minute: a short burst goes
//! through, then requests come back `429 Too Many Requests` with a
//! `Retry-After` in seconds. The throttle runs on a [`Clock`] the caller
//! chooses (the database clock in tests and the demo), so moving that clock
//! refills it. It also records the largest number of requests it was handling
//! at one moment: the story's fix is that this never exceeds one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{Traffic, lock, token};
use crate::clock::Clock;

/// A draft sales invoice as the API receives it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct SalesInvoice {
    /// The client account billed.
    pub ordered_by: String,
    /// The invoice line's description.
    pub description: String,
    /// The amount in cents.
    pub amount_cents: u64,
    /// The caller's reference: the idempotency token.
    pub your_ref: String,
}

/// A sustained-rate throttle (GCRA): requests are spaced `interval` apart on
/// average, and up to `burst` may arrive at once after a quiet spell.
#[derive(Debug, Clone, Copy)]
pub struct Throttle {
    /// The sustained spacing between requests (3 s is 20 per minute).
    pub interval: Duration,
    /// How many requests may arrive back to back.
    pub burst: u32,
}

impl Throttle {
    /// About 20 per minute sustained, with a burst of 10.
    pub fn exact_online() -> Self {
        Throttle { interval: Duration::from_secs(3), burst: 10 }
    }
}

/// The invoicing simulator's state.
#[derive(Debug)]
pub struct Invoicing {
    traffic: Traffic,
    throttle: Throttle,
    /// Theoretical arrival time of the next request (GCRA).
    tat: Mutex<Option<DateTime<Utc>>>,
    throttled: AtomicU64,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    invoices: Mutex<HashMap<String, Vec<SalesInvoice>>>,
}

impl Invoicing {
    /// An invoicing system with this throttle.
    pub fn new(throttle: Throttle) -> Self {
        Invoicing {
            traffic: Traffic::default(),
            throttle,
            tat: Mutex::default(),
            throttled: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            invoices: Mutex::default(),
        }
    }

    /// What it has received.
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    /// Requests answered `429`.
    pub fn throttled(&self) -> u64 {
        self.throttled.load(Ordering::SeqCst)
    }

    /// The most requests it was handling at the same moment.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    /// Draft invoices created with this reference.
    pub fn invoices_with(&self, your_ref: &str) -> usize {
        lock(&self.invoices).get(your_ref).map_or(0, Vec::len)
    }

    /// Draft invoices created in all.
    pub fn invoices(&self) -> usize {
        lock(&self.invoices).values().map(Vec::len).sum()
    }

    /// Admits a request at `now`, or says how long until one would be admitted.
    fn admit(&self, now: DateTime<Utc>) -> Result<(), Duration> {
        let interval = chrono::Duration::from_std(self.throttle.interval).unwrap_or(chrono::Duration::seconds(3));
        let tolerance = interval * i32::try_from(self.throttle.burst.saturating_sub(1)).unwrap_or(i32::MAX);
        let mut tat = lock(&self.tat);
        let current = tat.map_or(now, |t| t.max(now));
        let earliest = current - tolerance;
        if earliest > now {
            return Err((earliest - now).to_std().unwrap_or_default());
        }
        *tat = Some(current + interval);
        Ok(())
    }
}

/// Decrements the in-flight count however the handler ends.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) fn router(invoicing: Arc<Invoicing>, clock: Clock) -> Router {
    Router::new().route("/api/v1/{division}/salesinvoice/SalesInvoices", post(create)).with_state((invoicing, clock))
}

async fn create(
    State((invoicing, clock)): State<(Arc<Invoicing>, Clock)>,
    Path(_division): Path<String>,
    headers: HeaderMap,
    Json(invoice): Json<SalesInvoice>,
) -> Response {
    invoicing.traffic.arrived();
    let now_in_flight = invoicing.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    let _in_flight = InFlight(&invoicing.in_flight);
    invoicing.max_in_flight.fetch_max(now_in_flight, Ordering::SeqCst);
    // The real system takes a while per request; this is what makes two
    // requests at once visible if a caller sends them.
    tokio::time::sleep(Duration::from_millis(15)).await;

    let now = clock.now().await;
    if let Err(wait) = invoicing.admit(now) {
        invoicing.throttled.fetch_add(1, Ordering::SeqCst);
        invoicing.traffic.reject();
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        let mut response =
            (StatusCode::TOO_MANY_REQUESTS, Json(json!({"error": {"message": "Too many requests"}}))).into_response();
        response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        return response;
    }
    let Some(token) = token(&headers) else {
        invoicing.traffic.reject();
        return (StatusCode::BAD_REQUEST, Json(json!({"error": {"message": "Idempotency-Key header required"}})))
            .into_response();
    };
    invoicing.traffic.accept(&token, now);
    let mut invoices = lock(&invoicing.invoices);
    let number = invoices.values().map(Vec::len).sum::<usize>() + 1;
    invoices.entry(invoice.your_ref.clone()).or_default().push(invoice);
    (StatusCode::CREATED, Json(json!({"d": {"InvoiceID": format!("inv_{number}"), "Status": "draft"}}))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_lets_a_burst_through_then_spaces_requests_three_seconds_apart() {
        let invoicing = Invoicing::new(Throttle::exact_online());
        let t0: DateTime<Utc> = "2026-11-30T08:00:00Z".parse().expect("time");
        for i in 0..10 {
            assert!(invoicing.admit(t0).is_ok(), "request {i} of the burst");
        }
        assert_eq!(invoicing.admit(t0), Err(Duration::from_secs(3)));
        assert_eq!(invoicing.admit(t0 + chrono::Duration::seconds(1)), Err(Duration::from_secs(2)));
        assert!(invoicing.admit(t0 + chrono::Duration::seconds(3)).is_ok());
        assert!(invoicing.admit(t0 + chrono::Duration::seconds(4)).is_err());
        // Sustained: over 10 minutes after the burst, 20 per minute.
        let mut admitted = 0;
        for s in 6..606 {
            if invoicing.admit(t0 + chrono::Duration::seconds(s)).is_ok() {
                admitted += 1;
            }
        }
        assert_eq!(admitted, 200);
    }
}
