//! Child runs: `ctx.invoke` starts a run of another function and suspends the
//! parent (holding no worker) until the child finishes, then returns its output.
//!
//! `cargo run -p durastep --example child_runs`

mod common;

use std::time::Duration;

use durastep::{ChildError, Ctx, Event, Function, HandlerError, Invoke};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize)]
struct Resize {
    image: String,
    width: u32,
}

#[tokio::main]
async fn main() -> common::Result {
    // The child: an ordinary function, with its own steps and retries.
    let resize = Function::new("resize-image").handler(|ctx: Ctx, job: Resize| async move {
        ctx.step("resize", || async move { Ok(format!("{}@{}w.png", job.image.trim_end_matches(".png"), job.width)) })
            .await
    });
    // The parent: one child per width, one after the other.
    let publish =
        Function::new("publish-image").on_event("image/uploaded").handler(|ctx: Ctx, image: String| async move {
            let mut variants = Vec::new();
            for width in [320, 1280] {
                let child = Invoke::function("resize-image")
                    .input(&Resize { image: image.clone(), width })
                    .timeout(Duration::from_secs(60));
                let variant: Result<String, ChildError> = ctx.invoke("resize", child).await?;
                variants.push(variant.map_err(|e| HandlerError::permanent(e.to_string()))?);
            }
            Ok(variants)
        });

    let db = common::fresh_db("child_runs").await?;
    let engine = db.builder().functions([resize, publish]).build().await?;
    let worker = engine.spawn_worker();
    let parent = engine.send(Event::new("image/uploaded", &"cat.png")).await?.run_ids[0];
    let run = engine.wait_for_run(parent, Duration::from_secs(30)).await?;
    worker.stop().await?;

    println!("parent {:?}: {}", run.state, run.output.unwrap_or_default());
    for child in engine.inspect().run(parent).await?.children {
        println!("  child {} ({}) {:?}", child.id, child.function_id, child.state);
    }
    Ok(())
}
