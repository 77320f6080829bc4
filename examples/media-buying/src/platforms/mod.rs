//! HTTP clients for the platforms and the chat channel.
//!
//! Each client knows its platform's request and error shapes and nothing
//! else: it never touches the database and never decides about retries. It
//! turns every answer into a value or an [`ApiError`], and
//! [`ApiError::into_handler_error`] says what a run should do with it.

mod chat;
mod linkedin;
mod meta;
mod tiktok;

use std::time::Duration;

use durastep::HandlerError;

use crate::Endpoints;

pub use chat::ChatClient;
pub use linkedin::LinkedInClient;
pub use meta::{MetaBudget, MetaClient, MetaWrite, NewToken};
pub use tiktok::{TikTokCampaign, TikTokClient, TikTokWrite};

/// A failed platform call.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// HTTP 429 (or the platform's equivalent): try again later.
    #[error("{platform} rate limited the write (HTTP 429){}: {message}", retry_after.map(|d| format!(", Retry-After {} s", d.as_secs())).unwrap_or_default())]
    RateLimited {
        /// Which platform.
        platform: &'static str,
        /// The platform's `Retry-After`, when it sent one.
        retry_after: Option<Duration>,
        /// The platform's message.
        message: String,
    },
    /// The access token is expired, revoked or unknown.
    #[error("{platform} rejected the access token: {message}")]
    TokenRejected {
        /// Which platform.
        platform: &'static str,
        /// The platform's message.
        message: String,
    },
    /// A 4xx other than 401/429: the request itself is wrong; retrying cannot help.
    #[error("{platform} refused the request (HTTP {status}): {message}")]
    Refused {
        /// Which platform.
        platform: &'static str,
        /// The HTTP status.
        status: u16,
        /// The platform's message.
        message: String,
    },
    /// A 5xx, or an answer that does not parse: may work next time.
    #[error("{platform} failed (HTTP {status}): {message}")]
    Server {
        /// Which platform.
        platform: &'static str,
        /// The HTTP status.
        status: u16,
        /// The platform's message or body.
        message: String,
    },
    /// No answer at all.
    #[error("{platform} unreachable: {source}")]
    Transport {
        /// Which platform.
        platform: &'static str,
        /// The client's error.
        source: reqwest::Error,
    },
}

impl ApiError {
    /// What a run does with this failure: a 429 with `Retry-After` waits that
    /// long (and, with back-pressure, pauses the account); a refused request
    /// fails the run at once; anything else is retried with the backoff.
    pub fn into_handler_error(self) -> HandlerError {
        match &self {
            ApiError::RateLimited { retry_after: Some(d), .. } => HandlerError::retry_after(self.to_string(), *d),
            ApiError::Refused { .. } => HandlerError::permanent(self.to_string()),
            _ => HandlerError::new(self.to_string()),
        }
    }

    fn transport(platform: &'static str) -> impl FnOnce(reqwest::Error) -> ApiError {
        move |source| ApiError::Transport { platform, source }
    }
}

/// One client per external system, sharing one connection pool.
#[derive(Debug, Clone)]
pub struct Platforms {
    /// Meta Graph API.
    pub meta: MetaClient,
    /// TikTok Business API.
    pub tiktok: TikTokClient,
    /// LinkedIn Marketing API.
    pub linkedin: LinkedInClient,
    /// The chat workspace.
    pub chat: ChatClient,
}

impl Platforms {
    /// Clients for these endpoints.
    pub fn new(endpoints: &Endpoints) -> Platforms {
        // Timeouts so that a platform that hangs fails the attempt instead of holding it.
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .connect_timeout(Duration::from_secs(5))
            .build()
            .unwrap_or_default();
        Platforms {
            meta: MetaClient::new(http.clone(), &endpoints.meta),
            tiktok: TikTokClient::new(http.clone(), &endpoints.tiktok),
            linkedin: LinkedInClient::new(http.clone(), &endpoints.linkedin),
            chat: ChatClient::new(http, &endpoints.chat),
        }
    }
}

/// The `Retry-After` header in seconds, when present.
fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let secs: u64 = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?.trim().parse().ok()?;
    Some(Duration::from_secs(secs))
}

fn base(url: &str) -> String {
    url.trim_end_matches('/').to_owned()
}
