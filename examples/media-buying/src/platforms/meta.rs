//! Meta Graph API: campaign daily budgets and system-user tokens.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{ApiError, base};

const PLATFORM: &str = "Meta";
const VERSION: &str = "v19.0";

/// A Meta client for one base URL.
#[derive(Debug, Clone)]
pub struct MetaClient {
    http: reqwest::Client,
    base: String,
}

/// Meta's answer to a budget write.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MetaWrite {
    /// Meta's reference for the write (the same for a repeated idempotency key).
    pub write_ref: String,
}

/// A campaign's daily budget as Meta has it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MetaBudget {
    /// In cents; `None` when the campaign has none.
    pub daily_budget_cents: Option<i64>,
}

/// A freshly issued access token.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct NewToken {
    /// The token.
    pub access_token: String,
    /// When it expires.
    pub expires_at: DateTime<Utc>,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: GraphError,
}

#[derive(Deserialize)]
struct GraphError {
    message: String,
    code: i64,
    #[serde(default)]
    error_subcode: Option<i64>,
}

impl MetaClient {
    pub(super) fn new(http: reqwest::Client, base_url: &str) -> MetaClient {
        MetaClient { http, base: base(base_url) }
    }

    /// Sets a campaign's daily budget. `idempotency_key` makes a repeated call
    /// land on the same write.
    pub async fn update_budget(
        &self,
        access_token: &str,
        campaign_id: &str,
        daily_budget_cents: i64,
        idempotency_key: &str,
    ) -> Result<MetaWrite, ApiError> {
        let response = self
            .http
            .post(format!("{}/{VERSION}/{campaign_id}", self.base))
            .bearer_auth(access_token)
            .header("Idempotency-Key", idempotency_key)
            .json(&json!({ "daily_budget": daily_budget_cents }))
            .send()
            .await
            .map_err(ApiError::transport(PLATFORM))?;
        parse(response).await
    }

    /// Reads a campaign's daily budget back.
    pub async fn read_budget(&self, access_token: &str, campaign_id: &str) -> Result<MetaBudget, ApiError> {
        #[derive(Deserialize)]
        struct Campaign {
            daily_budget: Option<String>,
        }
        let response = self
            .http
            .get(format!("{}/{VERSION}/{campaign_id}", self.base))
            .query(&[("fields", "daily_budget")])
            .bearer_auth(access_token)
            .send()
            .await
            .map_err(ApiError::transport(PLATFORM))?;
        let campaign: Campaign = parse(response).await?;
        Ok(MetaBudget { daily_budget_cents: campaign.daily_budget.and_then(|s| s.parse().ok()) })
    }

    /// Exchanges a refresh token for a new access token. The same
    /// `idempotency_key` gets the same token back. Its expiry is reckoned from
    /// `now` (the caller's clock: the database clock in a run).
    pub async fn refresh_token(
        &self,
        refresh_token: &str,
        idempotency_key: &str,
        now: DateTime<Utc>,
    ) -> Result<NewToken, ApiError> {
        #[derive(Deserialize)]
        struct Issued {
            access_token: String,
            expires_in: i64,
        }
        let response = self
            .http
            .post(format!("{}/{VERSION}/oauth/access_token", self.base))
            .header("Idempotency-Key", idempotency_key)
            .json(&json!({ "grant_type": "refresh_token", "refresh_token": refresh_token }))
            .send()
            .await
            .map_err(ApiError::transport(PLATFORM))?;
        let issued: Issued = parse(response).await?;
        Ok(NewToken {
            access_token: issued.access_token,
            expires_at: now + chrono::Duration::seconds(issued.expires_in),
        })
    }

    /// Revokes an access token. Revoking one that is already revoked is not an error.
    pub async fn revoke_token(&self, access_token: &str) -> Result<(), ApiError> {
        let response = self
            .http
            .post(format!("{}/{VERSION}/oauth/revoke", self.base))
            .json(&json!({ "access_token": access_token }))
            .send()
            .await
            .map_err(ApiError::transport(PLATFORM))?;
        let _: serde_json::Value = parse(response).await?;
        Ok(())
    }
}

/// Meta's answers: 2xx JSON, or `{"error": {"message", "type", "code", ...}}`.
async fn parse<T: serde::de::DeserializeOwned>(response: reqwest::Response) -> Result<T, ApiError> {
    let status = response.status().as_u16();
    let body = response.text().await.map_err(ApiError::transport(PLATFORM))?;
    if (200..300).contains(&status) {
        return serde_json::from_str(&body).map_err(|e| ApiError::Server {
            platform: PLATFORM,
            status,
            message: format!("unreadable answer: {e}"),
        });
    }
    let Ok(ErrorBody { error }) = serde_json::from_str::<ErrorBody>(&body) else {
        return Err(ApiError::Server { platform: PLATFORM, status, message: body });
    };
    let message = match error.error_subcode {
        Some(sub) => format!("{} (code {}, subcode {sub})", error.message, error.code),
        None => format!("{} (code {})", error.message, error.code),
    };
    // Codes 4, 17, 32, 613 and 80004 are Meta's rate limits; 190 is an invalid token.
    Err(match (status, error.code) {
        (429, _) | (_, 4 | 17 | 32 | 613 | 80004) => {
            ApiError::RateLimited { platform: PLATFORM, retry_after: None, message }
        }
        (_, 190) => ApiError::TokenRejected { platform: PLATFORM, message },
        (500.., _) => ApiError::Server { platform: PLATFORM, status, message },
        _ => ApiError::Refused { platform: PLATFORM, status, message },
    })
}
