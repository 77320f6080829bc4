//! Meta's Graph API, as far as budget writes and tokens go.
//!
//! - `POST /v19.0/{campaign}` `{"daily_budget": cents}` with `Authorization:
//!   Bearer` and `Idempotency-Key`: a repeated key gets the first answer back
//!   and changes nothing.
//! - `GET /v19.0/{campaign}?fields=daily_budget`.
//! - `POST /v19.0/oauth/access_token` (refresh grant, with `Idempotency-Key`)
//!   and `POST /v19.0/oauth/revoke`.
//!
//! Failures, as Meta shapes them: an expired, revoked or unknown token gets
//! HTTP 400 with an `OAuthException` of code 190 (subcode 463 when expired);
//! a burst of calls on one ad account gets HTTP 429 with code 80004.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;

use super::{InFlight, SimClock, lock};

/// A budget write Meta applied.
#[derive(Debug, Clone, PartialEq)]
pub struct MetaWriteRecord {
    /// The ad account (the token's).
    pub account_id: String,
    /// The campaign.
    pub campaign_id: String,
    /// The new daily budget.
    pub daily_budget_cents: i64,
    /// Meta's reference.
    pub write_ref: String,
    /// The idempotency key it came with.
    pub idempotency_key: Option<String>,
    /// When (simulator clock).
    pub at: DateTime<Utc>,
}

#[derive(Debug)]
struct Token {
    account_id: String,
    expires_at: DateTime<Utc>,
    revoked: bool,
}

#[derive(Debug, Default)]
struct Inner {
    tokens: HashMap<String, Token>,
    refresh: HashMap<String, String>,
    issued: HashMap<String, String>,
    issues: HashMap<String, u32>,
    failing_issue: HashSet<String>,
    writes_received: u64,
    applied: HashMap<String, MetaWriteRecord>,
    log: Vec<MetaWriteRecord>,
    duplicates: u64,
    budgets: HashMap<String, i64>,
    burst_every: u64,
    burst_len: u32,
    burst_left: HashMap<String, u32>,
    rate_limited: u64,
    auth_errors: u64,
    in_flight: InFlight,
}

/// The Meta simulator's state and switches.
#[derive(Debug)]
pub struct MetaSim {
    clock: SimClock,
    inner: Mutex<Inner>,
    latency: Mutex<Duration>,
}

impl MetaSim {
    pub(super) fn new(clock: SimClock) -> MetaSim {
        MetaSim { clock, inner: Mutex::default(), latency: Mutex::new(Duration::from_millis(30)) }
    }

    /// Issues a token for an ad account, valid until `expires_at` (simulator clock).
    pub fn add_token(&self, account_id: &str, access_token: &str, refresh_token: &str, expires_at: DateTime<Utc>) {
        let mut s = lock(&self.inner);
        s.tokens
            .insert(access_token.to_owned(), Token { account_id: account_id.to_owned(), expires_at, revoked: false });
        s.refresh.insert(refresh_token.to_owned(), account_id.to_owned());
    }

    /// The 1st, `every + 1`-th, `2 * every + 1`-th ... budget write request
    /// starts a burst: it and the next `len - 1` writes on its ad account get
    /// HTTP 429. `every = 0` turns bursts off.
    pub fn set_bursts(&self, every: u64, len: u32) {
        let mut s = lock(&self.inner);
        s.burst_every = every;
        s.burst_len = len;
    }

    /// Makes token issuing fail (HTTP 500) for this ad account, or work again.
    pub fn fail_token_issue(&self, account_id: &str, failing: bool) {
        let mut s = lock(&self.inner);
        if failing {
            s.failing_issue.insert(account_id.to_owned());
        } else {
            s.failing_issue.remove(account_id);
        }
    }

    /// How long each budget write takes.
    pub fn set_latency(&self, latency: Duration) {
        *lock(&self.latency) = latency;
    }

    /// Sets a budget directly, as another writer would (no count, no token).
    pub fn set_budget(&self, campaign_id: &str, cents: i64) {
        lock(&self.inner).budgets.insert(campaign_id.to_owned(), cents);
    }

    /// Budget write requests received, whatever their answer.
    pub fn writes_received(&self) -> u64 {
        lock(&self.inner).writes_received
    }

    /// Budget writes applied, in order (a deduplicated repeat is not one).
    pub fn writes(&self) -> Vec<MetaWriteRecord> {
        lock(&self.inner).log.clone()
    }

    /// Requests that repeated an idempotency key already applied.
    pub fn duplicates(&self) -> u64 {
        lock(&self.inner).duplicates
    }

    /// 429s answered.
    pub fn rate_limited(&self) -> u64 {
        lock(&self.inner).rate_limited
    }

    /// Code-190 (invalid token) answers.
    pub fn auth_errors(&self) -> u64 {
        lock(&self.inner).auth_errors
    }

    /// The most budget writes in flight at once on one ad account.
    pub fn max_in_flight_per_account(&self) -> u32 {
        lock(&self.inner).in_flight.max_overall()
    }

    /// Tokens issued for this ad account (a repeated idempotency key is not a new one).
    pub fn tokens_issued(&self, account_id: &str) -> u32 {
        lock(&self.inner).issues.get(account_id).copied().unwrap_or(0)
    }

    /// Whether Meta accepts this token now.
    pub async fn accepts(&self, access_token: &str) -> bool {
        let now = self.clock.now().await;
        lock(&self.inner).tokens.get(access_token).is_some_and(|t| !t.revoked && t.expires_at > now)
    }

    /// A campaign's daily budget at Meta.
    pub fn budget(&self, campaign_id: &str) -> Option<i64> {
        lock(&self.inner).budgets.get(campaign_id).copied()
    }

    /// The account of a valid token, or the OAuthException for it.
    fn authorize(&self, s: &mut Inner, headers: &HeaderMap, now: DateTime<Utc>) -> Result<String, Box<Response>> {
        let token = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        let refusal = match s.tokens.get(token) {
            Some(t) if t.revoked => {
                (460, "Error validating access token: The session has been invalidated.".to_owned())
            }
            Some(t) if t.expires_at <= now => (
                463,
                format!(
                    "Error validating access token: Session has expired on {}. The current time is {}.",
                    t.expires_at.format("%A, %d-%b-%y %H:%M:%S UTC"),
                    now.format("%A, %d-%b-%y %H:%M:%S UTC")
                ),
            ),
            Some(t) => return Ok(t.account_id.clone()),
            None => (0, "Invalid OAuth access token - Cannot parse access token".to_owned()),
        };
        s.auth_errors += 1;
        let mut error =
            json!({ "message": refusal.1, "type": "OAuthException", "code": 190, "fbtrace_id": trace_id() });
        if refusal.0 != 0 {
            error["error_subcode"] = json!(refusal.0);
        }
        Err(Box::new((StatusCode::BAD_REQUEST, Json(json!({ "error": error }))).into_response()))
    }
}

/// Meta's routes on this simulator.
pub fn router(sim: Arc<MetaSim>) -> Router {
    Router::new()
        .route("/v19.0/oauth/access_token", post(issue_token))
        .route("/v19.0/oauth/revoke", post(revoke_token))
        .route("/v19.0/{campaign}", post(update_budget).get(read_budget))
        .with_state(sim)
}

#[derive(Deserialize)]
struct BudgetBody {
    daily_budget: i64,
}

async fn update_budget(
    State(sim): State<Arc<MetaSim>>,
    Path(campaign_id): Path<String>,
    headers: HeaderMap,
    Json(body): Json<BudgetBody>,
) -> Response {
    let now = sim.clock.now().await;
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let account_id = {
        let mut s = lock(&sim.inner);
        s.writes_received += 1;
        let account_id = match sim.authorize(&mut s, &headers, now) {
            Ok(a) => a,
            Err(refusal) => return *refusal,
        };
        let received = s.writes_received;
        if s.burst_every > 0 && (received - 1).is_multiple_of(s.burst_every) {
            let len = s.burst_len;
            s.burst_left.insert(account_id.clone(), len);
        }
        if let Some(left) = s.burst_left.get_mut(&account_id)
            && *left > 0
        {
            *left -= 1;
            s.rate_limited += 1;
            let error = json!({
                "message": "There have been too many calls to this ad-account. Wait a bit and try again.",
                "type": "OAuthException", "code": 80004, "error_subcode": 2446079, "fbtrace_id": trace_id(),
            });
            return (StatusCode::TOO_MANY_REQUESTS, Json(json!({ "error": error }))).into_response();
        }
        s.in_flight.enter(&account_id);
        account_id
    };
    let latency = *lock(&sim.latency);
    tokio::time::sleep(latency).await;
    let mut s = lock(&sim.inner);
    s.in_flight.leave(&account_id);
    if let Some(previous) = key.as_ref().and_then(|k| s.applied.get(k)).cloned() {
        s.duplicates += 1;
        return Json(json!({ "success": true, "write_ref": previous.write_ref })).into_response();
    }
    let record = MetaWriteRecord {
        write_ref: format!("mw_{}", s.log.len() + 1),
        account_id,
        campaign_id: campaign_id.clone(),
        daily_budget_cents: body.daily_budget,
        idempotency_key: key.clone(),
        at: now,
    };
    s.budgets.insert(campaign_id, body.daily_budget);
    if let Some(k) = key {
        s.applied.insert(k, record.clone());
    }
    s.log.push(record.clone());
    Json(json!({ "success": true, "write_ref": record.write_ref })).into_response()
}

async fn read_budget(State(sim): State<Arc<MetaSim>>, Path(campaign_id): Path<String>, headers: HeaderMap) -> Response {
    let now = sim.clock.now().await;
    let mut s = lock(&sim.inner);
    if let Err(refusal) = sim.authorize(&mut s, &headers, now) {
        return *refusal;
    }
    let budget = s.budgets.get(&campaign_id).map(|c| c.to_string());
    Json(json!({ "id": campaign_id, "daily_budget": budget })).into_response()
}

#[derive(Deserialize)]
struct Grant {
    grant_type: String,
    refresh_token: String,
}

async fn issue_token(State(sim): State<Arc<MetaSim>>, headers: HeaderMap, Json(grant): Json<Grant>) -> Response {
    let now = sim.clock.now().await;
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let mut s = lock(&sim.inner);
    let Some(account_id) = s.refresh.get(&grant.refresh_token).cloned().filter(|_| grant.grant_type == "refresh_token")
    else {
        let error = json!({ "message": "Invalid refresh token", "type": "OAuthException", "code": 190, "fbtrace_id": trace_id() });
        return (StatusCode::BAD_REQUEST, Json(json!({ "error": error }))).into_response();
    };
    if s.failing_issue.contains(&account_id) {
        let error = json!({ "message": "An unexpected error has occurred. Please retry your request later.",
                            "type": "OAuthException", "code": 2, "is_transient": true, "fbtrace_id": trace_id() });
        return (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({ "error": error }))).into_response();
    }
    const SIXTY_DAYS: i64 = 60 * 86_400;
    if let Some(token) = key.as_ref().and_then(|k| s.issued.get(k)) {
        return Json(json!({ "access_token": token, "token_type": "bearer", "expires_in": SIXTY_DAYS }))
            .into_response();
    }
    let n = s.issues.entry(account_id.clone()).or_default();
    *n += 1;
    let token = format!("EAAB{account_id}v{}{}", *n + 1, &trace_id()[..6]);
    s.tokens.insert(
        token.clone(),
        Token { account_id, expires_at: now + chrono::Duration::seconds(SIXTY_DAYS), revoked: false },
    );
    if let Some(k) = key {
        s.issued.insert(k, token.clone());
    }
    Json(json!({ "access_token": token, "token_type": "bearer", "expires_in": SIXTY_DAYS })).into_response()
}

#[derive(Deserialize)]
struct Revoke {
    access_token: String,
}

async fn revoke_token(State(sim): State<Arc<MetaSim>>, Json(body): Json<Revoke>) -> Response {
    if let Some(t) = lock(&sim.inner).tokens.get_mut(&body.access_token) {
        t.revoked = true;
    }
    Json(json!({ "success": true })).into_response()
}

fn trace_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}
