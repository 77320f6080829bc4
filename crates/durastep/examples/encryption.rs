//! Encryption at rest: with a keyring, step results and run outputs are stored
//! sealed (XChaCha20-Poly1305, bound to their run and step).
//!
//! `cargo run -p durastep --example encryption`
//!
//! A step fetches an access token. The example shows the row as stored (sealed)
//! and the run's output as the engine returns it (opened). In production,
//! load the key from your secret store (`Keyring::from_base64`).

mod common;

use std::time::Duration;

use durastep::sqlx;
use durastep::{Ctx, Event, Function, Keyring};

#[tokio::main]
async fn main() -> common::Result {
    let fetch = Function::new("fetch-token").on_event("token/needed").handler(|ctx: Ctx, account: String| async move {
        let token: String = ctx.step("get-token", || async move { Ok(format!("secret-token-for-{account}")) }).await?;
        Ok(format!("{}...", &token[..12]))
    });

    // Rotation: the first key seals; older keys still open what they sealed.
    let keyring = Keyring::new("2026-q4", [7u8; 32]).with_old_key("2026-q3", [3u8; 32]);
    let db = common::fresh_db("encryption").await?;
    let engine = db.builder().encryption(keyring).function(fetch).build().await?;
    let worker = engine.spawn_worker();
    let run_id = engine.send(Event::new("token/needed", &"act_1")).await?.run_ids[0];
    let run = engine.wait_for_run(run_id, Duration::from_secs(30)).await?;
    worker.stop().await?;

    let stored: String = sqlx::query_scalar("SELECT output::text FROM durastep.step_results WHERE run_id = $1")
        .bind(run_id)
        .fetch_one(engine.pool())
        .await?;
    println!("step result as stored: {}...", &stored[..stored.len().min(72)]);
    println!("run output, opened by the engine: {}", run.output.unwrap_or_default());
    Ok(())
}
