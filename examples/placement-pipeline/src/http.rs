//! One HTTP request to an external system, and what its answer means for the
//! run: a success, a retry (with `Retry-After` when the system gives one), or
//! a permanent failure.

use std::time::Duration;

use durastep::HandlerError;
use reqwest::StatusCode;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::simulators::IDEMPOTENCY_HEADER;

/// How long a 429 without `Retry-After` pauses the system's key.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(30);

/// A request to an external system. It is also what a dry run records as
/// "would have sent", so it is a stored format: keep its fields stable.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiRequest {
    /// `POST` or `PUT`.
    pub method: String,
    /// The full URL (base URL of the system plus the path).
    pub url: String,
    /// The `Idempotency-Key` header: the stage change's dedupe key.
    pub idempotency_key: String,
    /// The JSON body.
    pub body: Value,
}

/// Sends requests with one shared connection pool.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
}

impl Client {
    /// A client with a 10 s timeout per request.
    pub fn new() -> Result<Self, reqwest::Error> {
        Ok(Client { http: reqwest::Client::builder().timeout(Duration::from_secs(10)).build()? })
    }

    /// Sends `request`; a 2xx answer gives its JSON body (`null` if empty).
    ///
    /// A 429 is [`HandlerError::retry_after`] with the system's `Retry-After`
    /// (the function's back-pressure then pauses every call to that system);
    /// other 4xx answers are permanent (retrying the same request cannot
    /// help); 5xx answers and network errors are retried with the backoff.
    pub async fn send(&self, request: &ApiRequest) -> Result<Value, HandlerError> {
        let method = match request.method.as_str() {
            "PUT" => reqwest::Method::PUT,
            _ => reqwest::Method::POST,
        };
        let response = self
            .http
            .request(method, &request.url)
            .header(IDEMPOTENCY_HEADER, &request.idempotency_key)
            .json(&request.body)
            .send()
            .await
            .map_err(|e| HandlerError::new(format!("{} {}: {e}", request.method, request.url)))?;
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let text = response.text().await.unwrap_or_default();
        let what = format!("{} {} answered {status}: {text}", request.method, request.url);
        if status == StatusCode::TOO_MANY_REQUESTS {
            return Err(HandlerError::retry_after(what, retry_after.unwrap_or(DEFAULT_RETRY_AFTER)));
        }
        if status.is_client_error() && status != StatusCode::REQUEST_TIMEOUT {
            return Err(HandlerError::permanent(what));
        }
        if !status.is_success() {
            return Err(HandlerError::new(what));
        }
        if text.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text).map_err(|e| HandlerError::new(format!("{what} (not JSON: {e})")))
    }
}
