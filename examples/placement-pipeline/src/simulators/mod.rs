//! Local stand-ins for the six external systems, each an axum server on
//! `127.0.0.1:0` (a random port), reached only through its base URL, so the
//! pipeline code is the same against these and against the real APIs.
//!
//! Each reproduces the failure mode of its real counterpart that the story
//! depends on, and counts what it receives so tests can assert "exactly one":
//!
//! | System | Stands in for | Failure mode |
//! |---|---|---|
//! | [`mail`] | the transactional mail API | `503` on every Nth request ([`Faults::mail_unavailable_every`]) |
//! | [`crm`] | HubSpot tasks | dedupes by idempotency token and counts duplicates; can store a task and lose the response ([`Faults::crm_lost_response_every`]) |
//! | [`chat`] | Slack `chat.postMessage` | `{"ok": false, "error": "channel_not_found"}` for an unknown channel |
//! | [`sheet`] | the master placement sheet (Sheets append) | none: it records every row, duplicates included |
//! | [`outreach`] | the LinkedIn outreach tool | none |
//! | [`invoicing`] | Exact Online draft invoices | throttles to about 20/minute under sustained load (`429` + `Retry-After`), on a clock the caller controls; records the most requests in flight at once |

pub mod chat;
pub mod crm;
pub mod invoicing;
pub mod mail;
pub mod outreach;
pub mod sheet;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::http::HeaderMap;
use chrono::{DateTime, Utc};
use tokio_util::task::AbortOnDropHandle;

use crate::clock::Clock;
use crate::side_effects::Endpoints;

/// The header every simulator reads the idempotency token from.
pub const IDEMPOTENCY_HEADER: &str = "idempotency-key";

/// Injected failures (all off by default).
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    /// The mail API answers `503` to every Nth request.
    pub mail_unavailable_every: Option<u64>,
    /// The CRM stores every Nth task and then answers `504`, as if the
    /// response were lost on the way back: the caller retries, and only the
    /// idempotency token stops a second task.
    pub crm_lost_response_every: Option<u64>,
}

/// What one simulator has received.
#[derive(Debug, Default)]
pub struct Traffic {
    requests: AtomicU64,
    accepted: AtomicU64,
    rejected: AtomicU64,
    accepted_at: Mutex<Vec<(String, DateTime<Utc>)>>,
}

/// A copy of a simulator's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrafficCounts {
    /// Requests received, whatever the answer.
    pub requests: u64,
    /// Requests that performed the side effect.
    pub accepted: u64,
    /// Requests refused (an error status, a throttle, an unknown channel).
    pub rejected: u64,
}

impl Traffic {
    /// Counts a request as it arrives; returns its number (1-based).
    fn arrived(&self) -> u64 {
        self.requests.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn accept(&self, token: &str, at: DateTime<Utc>) {
        self.accepted.fetch_add(1, Ordering::SeqCst);
        lock(&self.accepted_at).push((token.to_owned(), at));
    }

    fn reject(&self) {
        self.rejected.fetch_add(1, Ordering::SeqCst);
    }

    /// The counters now.
    pub fn counts(&self) -> TrafficCounts {
        TrafficCounts {
            requests: self.requests.load(Ordering::SeqCst),
            accepted: self.accepted.load(Ordering::SeqCst),
            rejected: self.rejected.load(Ordering::SeqCst),
        }
    }

    /// Every accepted request's idempotency token and when it arrived (by the
    /// simulator's clock), in arrival order.
    pub fn accepted_at(&self) -> Vec<(String, DateTime<Utc>)> {
        lock(&self.accepted_at).clone()
    }
}

/// The six simulators, running until dropped.
pub struct Simulators {
    /// The mail API.
    pub mail: std::sync::Arc<mail::Mail>,
    /// The CRM's task API.
    pub crm: std::sync::Arc<crm::Crm>,
    /// The chat workspace.
    pub chat: std::sync::Arc<chat::Chat>,
    /// The placement sheet.
    pub sheet: std::sync::Arc<sheet::Sheet>,
    /// The outreach tool.
    pub outreach: std::sync::Arc<outreach::Outreach>,
    /// The invoicing system.
    pub invoicing: std::sync::Arc<invoicing::Invoicing>,
    endpoints: Endpoints,
    _servers: Vec<AbortOnDropHandle<()>>,
}

impl Simulators {
    /// Starts all six on random loopback ports. `channels` are the chat
    /// workspace's channel names; `clock` drives the invoicing throttle.
    pub async fn start(clock: Clock, faults: Faults, channels: &[&str]) -> std::io::Result<Simulators> {
        let mail = std::sync::Arc::new(mail::Mail::new(faults.mail_unavailable_every));
        let crm = std::sync::Arc::new(crm::Crm::new(faults.crm_lost_response_every));
        let chat = std::sync::Arc::new(chat::Chat::new(channels));
        let sheet = std::sync::Arc::new(sheet::Sheet::default());
        let outreach = std::sync::Arc::new(outreach::Outreach::default());
        let invoicing = std::sync::Arc::new(invoicing::Invoicing::new(invoicing::Throttle::exact_online()));
        let mut servers = Vec::new();
        let mut url = async |router: Router| -> std::io::Result<String> {
            let (url, handle) = serve(router).await?;
            servers.push(handle);
            Ok(url)
        };
        let endpoints = Endpoints {
            mail: url(mail::router(mail.clone(), clock.clone())).await?,
            crm: url(crm::router(crm.clone(), clock.clone())).await?,
            chat: url(chat::router(chat.clone(), clock.clone())).await?,
            sheet: url(sheet::router(sheet.clone(), clock.clone())).await?,
            outreach: url(outreach::router(outreach.clone(), clock.clone())).await?,
            invoicing: url(invoicing::router(invoicing.clone(), clock)).await?,
        };
        Ok(Simulators { mail, crm, chat, sheet, outreach, invoicing, endpoints, _servers: servers })
    }

    /// The base URLs to point the pipeline at.
    pub fn endpoints(&self) -> Endpoints {
        self.endpoints.clone()
    }
}

/// Serves `router` on a random loopback port; returns its base URL.
pub async fn serve(router: Router) -> std::io::Result<(String, AbortOnDropHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let handle = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "simulator stopped");
        }
    });
    Ok((format!("http://{addr}"), AbortOnDropHandle::new(handle)))
}

fn token(headers: &HeaderMap) -> Option<String> {
    headers.get(IDEMPOTENCY_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
