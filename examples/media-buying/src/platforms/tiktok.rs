//! TikTok Business API: campaign daily budgets.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{ApiError, base};

const PLATFORM: &str = "TikTok";

/// A TikTok client for one base URL.
#[derive(Debug, Clone)]
pub struct TikTokClient {
    http: reqwest::Client,
    base: String,
}

/// TikTok's answer to a budget write.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TikTokWrite {
    /// TikTok's request id, the write's reference.
    pub request_id: String,
    /// When the advertiser's daily spend counter last reset (midnight UTC).
    pub counter_reset_at: DateTime<Utc>,
}

/// A campaign's budget as TikTok has it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TikTokCampaign {
    /// The daily budget, if the campaign has one.
    pub daily_budget_cents: Option<i64>,
    /// When the campaign was last changed (TikTok's `modify_time`, UTC).
    pub modified_at: Option<DateTime<Utc>>,
}

#[derive(Deserialize)]
struct Envelope {
    code: i64,
    message: String,
    request_id: String,
    #[serde(default)]
    data: Option<serde_json::Value>,
}

/// The outcome in TikTok's envelope (HTTP 200 with a `code`), as an error when it is not 0.
fn check(envelope: &Envelope, status: u16) -> Result<(), ApiError> {
    match envelope.code {
        0 => Ok(()),
        40100 => {
            Err(ApiError::RateLimited { platform: PLATFORM, retry_after: None, message: envelope.message.clone() })
        }
        40104 | 40105 => Err(ApiError::TokenRejected { platform: PLATFORM, message: envelope.message.clone() }),
        code if (50000..60000).contains(&code) => {
            Err(ApiError::Server { platform: PLATFORM, status, message: envelope.message.clone() })
        }
        _ => Err(ApiError::Refused { platform: PLATFORM, status, message: envelope.message.clone() }),
    }
}

impl TikTokClient {
    /// Reads a campaign's daily budget and when it last changed
    /// (`GET /open_api/v1.3/campaign/get/`, filtered to the campaign).
    pub async fn read_campaign(
        &self,
        access_token: &str,
        advertiser_id: &str,
        campaign_id: &str,
    ) -> Result<TikTokCampaign, ApiError> {
        let filtering = json!({ "campaign_ids": [campaign_id] }).to_string();
        let response = self
            .http
            .get(format!("{}/open_api/v1.3/campaign/get/", self.base))
            .header("Access-Token", access_token)
            .query(&[("advertiser_id", advertiser_id), ("filtering", filtering.as_str())])
            .send()
            .await
            .map_err(ApiError::transport(PLATFORM))?;
        let status = response.status().as_u16();
        let body = response.text().await.map_err(ApiError::transport(PLATFORM))?;
        let Ok(envelope) = serde_json::from_str::<Envelope>(&body) else {
            return Err(ApiError::Server { platform: PLATFORM, status, message: body });
        };
        check(&envelope, status)?;
        let first = envelope.data.as_ref().and_then(|d| d.get("list")).and_then(|l| l.get(0));
        let Some(campaign) = first else {
            return Ok(TikTokCampaign { daily_budget_cents: None, modified_at: None });
        };
        let daily_budget_cents = campaign.get("budget").and_then(|b| b.as_f64()).map(|b| (b * 100.0).round() as i64);
        let modified_at = campaign
            .get("modify_time")
            .and_then(|t| t.as_str())
            .and_then(|t| chrono::NaiveDateTime::parse_from_str(t, "%Y-%m-%d %H:%M:%S").ok())
            .map(|t| t.and_utc());
        Ok(TikTokCampaign { daily_budget_cents, modified_at })
    }

    pub(super) fn new(http: reqwest::Client, base_url: &str) -> TikTokClient {
        TikTokClient { http, base: base(base_url) }
    }

    /// Sets a campaign's daily budget (`BUDGET_MODE_DAY`).
    pub async fn update_budget(
        &self,
        access_token: &str,
        advertiser_id: &str,
        campaign_id: &str,
        daily_budget_cents: i64,
        idempotency_key: &str,
    ) -> Result<TikTokWrite, ApiError> {
        let response = self
            .http
            .post(format!("{}/open_api/v1.3/campaign/update/", self.base))
            .header("Access-Token", access_token)
            .header("X-Idempotency-Key", idempotency_key)
            .json(&json!({
                "advertiser_id": advertiser_id,
                "campaign_id": campaign_id,
                "budget_mode": "BUDGET_MODE_DAY",
                // TikTok takes the budget in currency units.
                "budget": daily_budget_cents as f64 / 100.0,
            }))
            .send()
            .await
            .map_err(ApiError::transport(PLATFORM))?;
        let status = response.status().as_u16();
        let body = response.text().await.map_err(ApiError::transport(PLATFORM))?;
        let Ok(envelope) = serde_json::from_str::<Envelope>(&body) else {
            return Err(ApiError::Server { platform: PLATFORM, status, message: body });
        };
        // TikTok answers HTTP 200 and puts the outcome in `code`.
        match envelope.code {
            0 => {
                let counter_reset_at = envelope
                    .data
                    .as_ref()
                    .and_then(|d| d.get("counter_reset_at"))
                    .and_then(|v| serde_json::from_value(v.clone()).ok())
                    .unwrap_or_default();
                Ok(TikTokWrite { request_id: envelope.request_id, counter_reset_at })
            }
            40100 => Err(ApiError::RateLimited { platform: PLATFORM, retry_after: None, message: envelope.message }),
            40104 | 40105 => Err(ApiError::TokenRejected { platform: PLATFORM, message: envelope.message }),
            code if (50000..60000).contains(&code) => {
                Err(ApiError::Server { platform: PLATFORM, status, message: envelope.message })
            }
            _ => Err(ApiError::Refused { platform: PLATFORM, status, message: envelope.message }),
        }
    }
}
