//! Cron: a function that runs on a schedule in a time zone, exactly one run
//! per fire time however many workers are up.
//!
//! `cargo run -p durastep --example cron`
//!
//! A six-field expression (seconds first) fires every 2 seconds; the example
//! stops after three runs. Real schedules look like `0 9 * 1,4,7,10 MON#1`
//! (09:00 on the first Monday of each quarter) in `Europe::Amsterdam`.

mod common;

use std::time::{Duration, Instant};

use chrono_tz::Europe::Amsterdam;
use durastep::inspect::RunFilter;
use durastep::{CronTick, Ctx, Function, RunState};

#[tokio::main]
async fn main() -> common::Result {
    let heartbeat =
        Function::new("heartbeat").on_cron("*/2 * * * * *", Amsterdam).handler(|ctx: Ctx, tick: CronTick| async move {
            // The input is the fire time this run is for (not when it ran).
            ctx.step("beat", || async move { Ok(format!("beat for {}", tick.scheduled_at.with_timezone(&Amsterdam))) })
                .await
        });

    let db = common::fresh_db("cron").await?;
    let engine = db.builder().function(heartbeat).build().await?;
    let worker = engine.spawn_worker();
    let deadline = Instant::now() + Duration::from_secs(30);
    let done = RunFilter::new().function("heartbeat").state(RunState::Completed);
    loop {
        let page = engine.inspect().runs(&done).await?;
        if page.runs.len() >= 3 {
            worker.stop().await?;
            for r in page.runs.iter().rev() {
                println!("run {} {:?}: {}", r.id, r.state, engine.run(r.id).await?.output.unwrap_or_default());
            }
            return Ok(());
        }
        assert!(Instant::now() < deadline, "fewer than 3 cron runs in 30 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
