//! LinkedIn Marketing API: campaign daily budgets (Rest.li partial updates).

use serde::Deserialize;
use serde_json::json;

use super::{ApiError, base, retry_after};

const PLATFORM: &str = "LinkedIn";

/// A LinkedIn client for one base URL.
#[derive(Debug, Clone)]
pub struct LinkedInClient {
    http: reqwest::Client,
    base: String,
}

#[derive(Deserialize)]
struct ErrorBody {
    message: String,
}

impl LinkedInClient {
    pub(super) fn new(http: reqwest::Client, base_url: &str) -> LinkedInClient {
        LinkedInClient { http, base: base(base_url) }
    }

    /// Sets a campaign's daily budget; returns LinkedIn's `x-restli-id` or a
    /// reference of the write.
    pub async fn update_budget(
        &self,
        access_token: &str,
        account_id: &str,
        campaign_id: &str,
        daily_budget_cents: i64,
        idempotency_key: &str,
    ) -> Result<String, ApiError> {
        let amount = format!("{}.{:02}", daily_budget_cents / 100, daily_budget_cents % 100);
        let response = self
            .http
            .post(format!("{}/rest/adAccounts/{account_id}/adCampaigns/{campaign_id}", self.base))
            .bearer_auth(access_token)
            .header("X-RestLi-Method", "PARTIAL_UPDATE")
            .header("LinkedIn-Version", "202401")
            .header("X-Idempotency-Key", idempotency_key)
            .json(&json!({ "patch": { "$set": { "dailyBudget": { "amount": amount, "currencyCode": "EUR" } } } }))
            .send()
            .await
            .map_err(ApiError::transport(PLATFORM))?;
        let status = response.status().as_u16();
        let wait = retry_after(response.headers());
        let write_ref = response
            .headers()
            .get("x-restli-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
            .unwrap_or_else(|| format!("{campaign_id}:{idempotency_key}"));
        let body = response.text().await.map_err(ApiError::transport(PLATFORM))?;
        if (200..300).contains(&status) {
            return Ok(write_ref);
        }
        let message = serde_json::from_str::<ErrorBody>(&body).map(|b| b.message).unwrap_or(body);
        Err(match status {
            429 => ApiError::RateLimited { platform: PLATFORM, retry_after: wait, message },
            401 => ApiError::TokenRejected { platform: PLATFORM, message },
            500.. => ApiError::Server { platform: PLATFORM, status, message },
            _ => ApiError::Refused { platform: PLATFORM, status, message },
        })
    }
}
