//! Local simulators of Meta, TikTok, LinkedIn and the chat channel.
//!
//! Each is an axum server on `127.0.0.1:0` (a random port) that answers in
//! the real platform's request and error shapes, with its failure modes
//! switchable from the test or the demo: Meta's expired tokens and 429 bursts,
//! TikTok's daily spend counter that resets at midnight UTC, LinkedIn's rolling
//! write bucket with `Retry-After`. Every write a simulator receives is counted,
//! so a test can assert "exactly one". The example's code reaches them only
//! through [`crate::Endpoints`]. The simulators never touch the state store;
//! their only use of the database is its clock ([`SimClock`]).

pub mod chat;
pub mod linkedin;
pub mod meta;
pub mod tiktok;

use std::sync::Arc;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio_util::task::AbortOnDropHandle;

use crate::Endpoints;

/// Where a simulator reads "now": the database clock (`durastep.now()`, which
/// tests and the demo move forward), or the system clock.
#[derive(Debug, Clone)]
pub enum SimClock {
    /// `durastep.now()` of this database.
    Database(PgPool),
    /// The machine's clock.
    System,
}

impl SimClock {
    /// The simulator's "now".
    pub async fn now(&self) -> DateTime<Utc> {
        match self {
            SimClock::Database(pool) => {
                match sqlx::query_scalar::<_, DateTime<Utc>>("SELECT durastep.now()").fetch_one(pool).await {
                    Ok(now) => now,
                    Err(e) => {
                        tracing::warn!(error = %e, "simulator clock: database unreachable, using the system clock");
                        Utc::now()
                    }
                }
            }
            SimClock::System => Utc::now(),
        }
    }
}

/// The four simulators, running; dropped, they stop.
pub struct Simulators {
    /// Meta.
    pub meta: Arc<meta::MetaSim>,
    /// TikTok.
    pub tiktok: Arc<tiktok::TikTokSim>,
    /// LinkedIn.
    pub linkedin: Arc<linkedin::LinkedInSim>,
    /// The chat workspace.
    pub chat: Arc<chat::ChatSim>,
    /// Their base URLs.
    pub endpoints: Endpoints,
    _servers: Vec<AbortOnDropHandle<()>>,
}

impl Simulators {
    /// Starts the four servers, each on its own random port.
    pub async fn start(clock: SimClock) -> std::io::Result<Simulators> {
        let meta = Arc::new(meta::MetaSim::new(clock.clone()));
        let tiktok = Arc::new(tiktok::TikTokSim::new(clock.clone()));
        let linkedin = Arc::new(linkedin::LinkedInSim::new(clock));
        let chat = Arc::new(chat::ChatSim::default());
        let (meta_url, s1) = serve(meta::router(meta.clone())).await?;
        let (tiktok_url, s2) = serve(tiktok::router(tiktok.clone())).await?;
        let (linkedin_url, s3) = serve(linkedin::router(linkedin.clone())).await?;
        let (chat_url, s4) = serve(chat::router(chat.clone())).await?;
        Ok(Simulators {
            meta,
            tiktok,
            linkedin,
            chat,
            endpoints: Endpoints { meta: meta_url, tiktok: tiktok_url, linkedin: linkedin_url, chat: chat_url },
            _servers: vec![s1, s2, s3, s4],
        })
    }
}

async fn serve(router: axum::Router) -> std::io::Result<(String, AbortOnDropHandle<()>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "simulator stopped");
        }
    });
    Ok((url, AbortOnDropHandle::new(task)))
}

/// Locks a simulator's state, whatever a panicking handler left behind.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts requests in flight per key and remembers the most at once.
#[derive(Debug, Default)]
struct InFlight {
    now: std::collections::HashMap<String, u32>,
    max: std::collections::HashMap<String, u32>,
}

impl InFlight {
    fn enter(&mut self, key: &str) {
        let n = self.now.entry(key.to_owned()).or_default();
        *n += 1;
        let max = self.max.entry(key.to_owned()).or_default();
        *max = (*max).max(*n);
    }

    fn leave(&mut self, key: &str) {
        if let Some(n) = self.now.get_mut(key) {
            *n = n.saturating_sub(1);
        }
    }

    fn max_overall(&self) -> u32 {
        self.max.values().copied().max().unwrap_or(0)
    }
}
