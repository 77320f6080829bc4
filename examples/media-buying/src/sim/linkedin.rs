//! LinkedIn's Marketing API, as far as campaign budgets go.
//!
//! `POST /rest/adAccounts/{account}/adCampaigns/{campaign}` with
//! `X-RestLi-Method: PARTIAL_UPDATE` and a `{"patch": {"$set": {"dailyBudget":
//! {"amount", "currencyCode"}}}}` body; 204 on success. LinkedIn's limits are
//! rolling buckets, separate for reads, writes and ads: here the write bucket
//! of each ad account holds `capacity` writes per rolling `window` (Friday
//! 16:00-22:00 it drains), and a write over it gets HTTP 429 with a
//! `Retry-After` of the seconds until a slot frees. A storm (every write
//! refused until a time) and an outage (HTTP 500) can be switched on.

use std::collections::{HashMap, HashSet, VecDeque};
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

/// A budget write LinkedIn applied.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkedInWrite {
    /// The ad account.
    pub account_id: String,
    /// The campaign.
    pub campaign_id: String,
    /// The new daily budget.
    pub daily_budget_cents: i64,
    /// When (simulator clock).
    pub at: DateTime<Utc>,
}

#[derive(Debug, Default)]
struct Inner {
    tokens: HashSet<String>,
    bucket: Option<(usize, Duration)>,
    recent: HashMap<String, VecDeque<DateTime<Utc>>>,
    storm_until: Option<DateTime<Utc>>,
    outage: HashSet<String>,
    archived: HashSet<String>,
    writes_received: u64,
    rate_limited: u64,
    log: Vec<LinkedInWrite>,
    in_flight: InFlight,
}

/// The LinkedIn simulator's state and switches.
#[derive(Debug)]
pub struct LinkedInSim {
    clock: SimClock,
    inner: Mutex<Inner>,
    latency: Mutex<Duration>,
}

/// The longest `Retry-After` this simulator sends, in seconds.
const MAX_RETRY_AFTER: i64 = 60;

impl LinkedInSim {
    pub(super) fn new(clock: SimClock) -> LinkedInSim {
        LinkedInSim { clock, inner: Mutex::default(), latency: Mutex::new(Duration::from_millis(30)) }
    }

    /// How long each budget write takes.
    pub fn set_latency(&self, latency: Duration) {
        *lock(&self.latency) = latency;
    }

    /// Accepts this access token from now on.
    pub fn add_token(&self, access_token: &str) {
        lock(&self.inner).tokens.insert(access_token.to_owned());
    }

    /// Each ad account's write bucket: `capacity` writes per rolling `window`
    /// (`None`: unlimited).
    pub fn set_write_bucket(&self, bucket: Option<(usize, Duration)>) {
        lock(&self.inner).bucket = bucket;
    }

    /// Refuses every write with 429 until `until` (simulator clock); each
    /// refusal's `Retry-After` is the time left, at most 60 s.
    pub fn storm_until(&self, until: Option<DateTime<Utc>>) {
        lock(&self.inner).storm_until = until;
    }

    /// Answers every write on this ad account with HTTP 500, or not.
    pub fn set_outage(&self, account_id: &str, down: bool) {
        let mut s = lock(&self.inner);
        if down {
            s.outage.insert(account_id.to_owned());
        } else {
            s.outage.remove(account_id);
        }
    }

    /// Marks a campaign archived: writes to it get HTTP 400.
    pub fn archive(&self, campaign_id: &str) {
        lock(&self.inner).archived.insert(campaign_id.to_owned());
    }

    /// Budget write requests received, whatever their answer.
    pub fn writes_received(&self) -> u64 {
        lock(&self.inner).writes_received
    }

    /// 429s answered.
    pub fn rate_limited(&self) -> u64 {
        lock(&self.inner).rate_limited
    }

    /// Budget writes applied, in order.
    pub fn writes(&self) -> Vec<LinkedInWrite> {
        lock(&self.inner).log.clone()
    }

    /// The most writes in flight at once on one ad account.
    pub fn max_in_flight_per_account(&self) -> u32 {
        lock(&self.inner).in_flight.max_overall()
    }
}

/// LinkedIn's routes on this simulator.
pub fn router(sim: Arc<LinkedInSim>) -> Router {
    Router::new().route("/rest/adAccounts/{account}/adCampaigns/{campaign}", post(update_campaign)).with_state(sim)
}

#[derive(Deserialize)]
struct Patch {
    patch: Set,
}

#[derive(Deserialize)]
struct Set {
    #[serde(rename = "$set")]
    set: Budget,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Budget {
    daily_budget: Money,
}

#[derive(Deserialize)]
struct Money {
    amount: String,
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (status, Json(json!({ "status": status.as_u16(), "code": code, "message": message }))).into_response()
}

fn too_many(retry_after_secs: i64) -> Response {
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        "TOO_MANY_REQUESTS",
        "Resource level throttle APPLICATION WRITE limit for adAccounts reached",
    );
    if let Ok(v) = retry_after_secs.clamp(1, MAX_RETRY_AFTER).to_string().parse() {
        response.headers_mut().insert("retry-after", v);
    }
    response
}

async fn update_campaign(
    State(sim): State<Arc<LinkedInSim>>,
    Path((account_id, campaign_id)): Path<(String, String)>,
    headers: HeaderMap,
    Json(body): Json<Patch>,
) -> Response {
    let now = sim.clock.now().await;
    {
        let mut s = lock(&sim.inner);
        s.writes_received += 1;
        let token = headers
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or_default();
        if !s.tokens.contains(token) {
            return error(
                StatusCode::UNAUTHORIZED,
                "EXPIRED_ACCESS_TOKEN",
                "The token used in the request has expired",
            );
        }
        if s.outage.contains(&account_id) {
            return error(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL_SERVER_ERROR", "Internal Server Error");
        }
        if s.archived.contains(&campaign_id) {
            return error(
                StatusCode::BAD_REQUEST,
                "ILLEGAL_ARGUMENT",
                &format!("Campaign {campaign_id} is ARCHIVED and cannot be updated"),
            );
        }
        if let Some(until) = s.storm_until.filter(|u| *u > now) {
            s.rate_limited += 1;
            let left = (until - now).num_milliseconds();
            return too_many((left + 999) / 1000);
        }
        if let Some((capacity, window)) = s.bucket {
            let window = chrono::Duration::from_std(window).unwrap_or_default();
            let recent = s.recent.entry(account_id.clone()).or_default();
            while recent.front().is_some_and(|t| *t + window <= now) {
                recent.pop_front();
            }
            if recent.len() >= capacity {
                let frees_at = recent.front().map_or(now, |t| *t + window);
                s.rate_limited += 1;
                return too_many(((frees_at - now).num_milliseconds() + 999) / 1000);
            }
            recent.push_back(now);
        }
        s.in_flight.enter(&account_id);
    }
    let latency = *lock(&sim.latency);
    tokio::time::sleep(latency).await;
    let cents = parse_amount(&body.patch.set.daily_budget.amount);
    let mut s = lock(&sim.inner);
    s.in_flight.leave(&account_id);
    s.log.push(LinkedInWrite { account_id, campaign_id: campaign_id.clone(), daily_budget_cents: cents, at: now });
    let mut response = StatusCode::NO_CONTENT.into_response();
    if let Ok(v) = format!("urn:li:sponsoredCampaign:{campaign_id}:w{}", s.log.len()).parse() {
        response.headers_mut().insert("x-restli-id", v);
    }
    response
}

fn parse_amount(amount: &str) -> i64 {
    let (units, cents) = amount.split_once('.').unwrap_or((amount, "0"));
    units.parse::<i64>().unwrap_or(0) * 100 + format!("{cents:0<2}")[..2].parse::<i64>().unwrap_or(0)
}
