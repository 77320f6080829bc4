//! The chat workspace (Slack's `chat.postMessage` shape): the on-call channel.

use serde::Deserialize;
use serde_json::json;

use super::{ApiError, base};

const PLATFORM: &str = "chat";

/// A chat client for one base URL.
#[derive(Debug, Clone)]
pub struct ChatClient {
    http: reqwest::Client,
    base: String,
}

impl ChatClient {
    pub(super) fn new(http: reqwest::Client, base_url: &str) -> ChatClient {
        ChatClient { http, base: base(base_url) }
    }

    /// Posts a message to a channel; returns its timestamp id.
    pub async fn post(&self, channel: &str, text: &str) -> Result<String, ApiError> {
        #[derive(Deserialize)]
        struct Posted {
            ok: bool,
            #[serde(default)]
            ts: String,
            #[serde(default)]
            error: Option<String>,
        }
        let response = self
            .http
            .post(format!("{}/api/chat.postMessage", self.base))
            .json(&json!({ "channel": channel, "text": text }))
            .send()
            .await
            .map_err(ApiError::transport(PLATFORM))?;
        let status = response.status().as_u16();
        let posted: Posted = response.json().await.map_err(ApiError::transport(PLATFORM))?;
        if posted.ok {
            Ok(posted.ts)
        } else {
            let message = posted.error.unwrap_or_else(|| "not ok".to_owned());
            Err(if status >= 500 {
                ApiError::Server { platform: PLATFORM, status, message }
            } else {
                ApiError::Refused { platform: PLATFORM, status, message }
            })
        }
    }
}
