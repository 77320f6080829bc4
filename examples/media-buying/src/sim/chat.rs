//! The chat workspace: `POST /api/chat.postMessage` `{"channel", "text"}`,
//! Slack's shape. It records every message.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};

use super::lock;

/// A message as posted.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// The channel.
    pub channel: String,
    /// The text.
    pub text: String,
}

/// The chat simulator's state.
#[derive(Debug, Default)]
pub struct ChatSim {
    messages: Mutex<Vec<Message>>,
}

impl ChatSim {
    /// Every message posted, in order.
    pub fn messages(&self) -> Vec<Message> {
        lock(&self.messages).clone()
    }

    /// The messages posted to one channel.
    pub fn messages_in(&self, channel: &str) -> Vec<Message> {
        lock(&self.messages).iter().filter(|m| m.channel == channel).cloned().collect()
    }
}

/// The chat routes on this simulator.
pub fn router(sim: Arc<ChatSim>) -> Router {
    Router::new().route("/api/chat.postMessage", post(post_message)).with_state(sim)
}

#[derive(Deserialize)]
struct Post {
    channel: String,
    text: String,
}

async fn post_message(State(sim): State<Arc<ChatSim>>, Json(post): Json<Post>) -> Json<Value> {
    let mut messages = lock(&sim.messages);
    messages.push(Message { channel: post.channel, text: post.text });
    Json(json!({ "ok": true, "ts": format!("{}.000100", messages.len()) }))
}
