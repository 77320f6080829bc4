//! TikTok's Business API, as far as campaign budgets go.
//!
//! `POST /open_api/v1.3/campaign/update/` with an `Access-Token` header and
//! `{"advertiser_id", "campaign_id", "budget_mode", "budget"}`. TikTok answers
//! HTTP 200 and puts the outcome in `code` (0 is success, 40105 an invalid
//! token). Each advertiser has a daily spend counter that resets at midnight
//! UTC, on the simulator's clock ([`SimClock`]), so a test that moves the
//! database clock moves TikTok's day with it.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::json;

use super::{SimClock, lock};

/// A budget write TikTok applied.
#[derive(Debug, Clone, PartialEq)]
pub struct TikTokPush {
    /// The advertiser.
    pub advertiser_id: String,
    /// The campaign.
    pub campaign_id: String,
    /// The new daily budget.
    pub daily_budget_cents: i64,
    /// When it arrived (simulator clock).
    pub at: DateTime<Utc>,
    /// When the advertiser's daily counter last reset: midnight UTC of `at`.
    pub counter_reset_at: DateTime<Utc>,
    /// What the campaign had spent of the day when the budget changed, at its
    /// old budget (spend runs evenly through the UTC day).
    pub spent_today_cents: i64,
}

#[derive(Debug, Default)]
struct Inner {
    tokens: HashSet<String>,
    writes_received: u64,
    log: Vec<TikTokPush>,
    /// Campaign -> (daily budget, when it was last changed).
    budgets: HashMap<String, (i64, DateTime<Utc>)>,
}

/// The TikTok simulator's state.
#[derive(Debug)]
pub struct TikTokSim {
    clock: SimClock,
    inner: Mutex<Inner>,
}

impl TikTokSim {
    pub(super) fn new(clock: SimClock) -> TikTokSim {
        TikTokSim { clock, inner: Mutex::default() }
    }

    /// Accepts this access token from now on.
    pub fn add_token(&self, access_token: &str) {
        lock(&self.inner).tokens.insert(access_token.to_owned());
    }

    /// Budget write requests received, whatever their answer.
    pub fn writes_received(&self) -> u64 {
        lock(&self.inner).writes_received
    }

    /// Budget writes applied, in order.
    pub fn writes(&self) -> Vec<TikTokPush> {
        lock(&self.inner).log.clone()
    }

    /// A campaign's daily budget now, if it has one.
    pub fn budget(&self, campaign_id: &str) -> Option<i64> {
        lock(&self.inner).budgets.get(campaign_id).map(|(cents, _)| *cents)
    }
}

/// TikTok's routes on this simulator.
pub fn router(sim: Arc<TikTokSim>) -> Router {
    Router::new()
        .route("/open_api/v1.3/campaign/update/", post(update_campaign))
        .route("/open_api/v1.3/campaign/get/", get(get_campaigns))
        .with_state(sim)
}

#[derive(Deserialize)]
struct Update {
    advertiser_id: String,
    campaign_id: String,
    budget: f64,
}

async fn update_campaign(State(sim): State<Arc<TikTokSim>>, headers: HeaderMap, Json(body): Json<Update>) -> Response {
    let now = sim.clock.now().await;
    let request_id = uuid::Uuid::new_v4().simple().to_string();
    let mut s = lock(&sim.inner);
    s.writes_received += 1;
    let token = headers.get("access-token").and_then(|v| v.to_str().ok()).unwrap_or_default();
    if !s.tokens.contains(token) {
        return Json(json!({ "code": 40105, "message": "The access token is invalid or has been revoked.",
                            "request_id": request_id, "data": {} }))
        .into_response();
    }
    let counter_reset_at = now.date_naive().and_hms_opt(0, 0, 0).map(|d| d.and_utc()).unwrap_or(now);
    let day_fraction = (now - counter_reset_at).num_seconds() as f64 / 86_400.0;
    let old = s.budgets.get(&body.campaign_id).map_or(0, |(cents, _)| *cents);
    let cents = (body.budget * 100.0).round() as i64;
    let push = TikTokPush {
        advertiser_id: body.advertiser_id,
        campaign_id: body.campaign_id.clone(),
        daily_budget_cents: cents,
        at: now,
        counter_reset_at,
        spent_today_cents: (old as f64 * day_fraction).round() as i64,
    };
    s.budgets.insert(body.campaign_id.clone(), (cents, now));
    s.log.push(push.clone());
    Json(json!({ "code": 0, "message": "OK", "request_id": request_id,
                 "data": { "campaign_id": body.campaign_id, "counter_reset_at": counter_reset_at,
                           "spent_today": push.spent_today_cents as f64 / 100.0 } }))
    .into_response()
}

#[derive(Deserialize)]
struct GetCampaigns {
    advertiser_id: String,
    /// `{"campaign_ids": ["..."]}`, as TikTok takes it.
    filtering: Option<String>,
}

#[derive(Deserialize, Default)]
struct Filtering {
    #[serde(default)]
    campaign_ids: Vec<String>,
}

/// `GET /open_api/v1.3/campaign/get/`: the campaigns' budgets and when they
/// last changed (`modify_time`, `YYYY-MM-DD HH:MM:SS` UTC, as TikTok writes it).
async fn get_campaigns(
    State(sim): State<Arc<TikTokSim>>,
    headers: HeaderMap,
    Query(q): Query<GetCampaigns>,
) -> Response {
    let request_id = uuid::Uuid::new_v4().simple().to_string();
    let s = lock(&sim.inner);
    let token = headers.get("access-token").and_then(|v| v.to_str().ok()).unwrap_or_default();
    if !s.tokens.contains(token) {
        return Json(json!({ "code": 40105, "message": "The access token is invalid or has been revoked.",
                            "request_id": request_id, "data": {} }))
        .into_response();
    }
    let filtering: Filtering = q.filtering.as_deref().and_then(|f| serde_json::from_str(f).ok()).unwrap_or_default();
    let list: Vec<serde_json::Value> = filtering
        .campaign_ids
        .iter()
        .filter_map(|id| {
            s.budgets.get(id).map(|(cents, at)| {
                json!({ "advertiser_id": q.advertiser_id, "campaign_id": id, "budget_mode": "BUDGET_MODE_DAY",
                        "budget": *cents as f64 / 100.0, "modify_time": at.format("%Y-%m-%d %H:%M:%S").to_string() })
            })
        })
        .collect();
    Json(json!({ "code": 0, "message": "OK", "request_id": request_id, "data": { "list": list } })).into_response()
}
