//! The chat workspace: `POST /api/chat.postMessage`, shaped like Slack's.
//!
//! Like Slack, an unknown channel is not an HTTP error: the answer is `200`
//! with `{"ok": false, "error": "channel_not_found"}`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{Traffic, lock, token};
use crate::clock::Clock;

/// A post as the API receives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Post {
    /// The channel name, e.g. `#client-acme`.
    pub channel: String,
    /// The message.
    pub text: String,
}

/// The chat simulator's state.
#[derive(Debug)]
pub struct Chat {
    traffic: Traffic,
    channels: HashSet<String>,
    posts: Mutex<Vec<(Option<String>, Post)>>,
}

impl Chat {
    pub(super) fn new(channels: &[&str]) -> Self {
        Chat {
            traffic: Traffic::default(),
            channels: channels.iter().map(|c| (*c).to_owned()).collect(),
            posts: Mutex::default(),
        }
    }

    /// What it has received.
    pub fn traffic(&self) -> &Traffic {
        &self.traffic
    }

    /// The posts that landed in `channel`.
    pub fn posts_in(&self, channel: &str) -> Vec<Post> {
        lock(&self.posts).iter().filter(|(_, p)| p.channel == channel).map(|(_, p)| p.clone()).collect()
    }

    /// How many posts carried this idempotency token.
    pub fn posted_with(&self, token: &str) -> usize {
        lock(&self.posts).iter().filter(|(t, _)| t.as_deref() == Some(token)).count()
    }
}

pub(super) fn router(chat: Arc<Chat>, clock: Clock) -> Router {
    Router::new().route("/api/chat.postMessage", post(post_message)).with_state((chat, clock))
}

async fn post_message(
    State((chat, clock)): State<(Arc<Chat>, Clock)>,
    headers: HeaderMap,
    Json(post): Json<Post>,
) -> Json<Value> {
    let n = chat.traffic.arrived();
    if !chat.channels.contains(&post.channel) {
        chat.traffic.reject();
        return Json(json!({"ok": false, "error": "channel_not_found"}));
    }
    let token = token(&headers);
    chat.traffic.accept(token.as_deref().unwrap_or_default(), clock.now().await);
    lock(&chat.posts).push((token, post));
    Json(json!({"ok": true, "ts": format!("1764489600.{n:06}")}))
}
