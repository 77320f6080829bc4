//! Durable sleep until a wall-clock time in a time zone.
//!
//! `cargo run -p durastep --example sleep_until_zone`
//!
//! The run sleeps until the next 09:00 in Amsterdam (a `Schedule` computes
//! it, daylight saving included). A sleeping run holds no worker. So that the
//! example does not wait hours, it then moves this database's clock forward
//! (`durastep::testing::advance_clock`, as tests do); in production the
//! worker simply picks the run up when 09:00 comes.

mod common;

use std::time::Duration;

use chrono::Utc;
use chrono_tz::Europe::Amsterdam;
use durastep::{Ctx, Event, Function, HandlerError, RunState, Schedule};

#[tokio::main]
async fn main() -> common::Result {
    let morning_report =
        Function::new("morning-report").on_event("report/requested").handler(|ctx: Ctx, _: ()| async move {
            let nine = Schedule::new("0 9 * * *", Amsterdam).map_err(|e| HandlerError::permanent(e.to_string()))?;
            // The database clock decides when a run is due: compute from it.
            let wake = nine.next_after(ctx.db_time()).expect("09:00 comes every day");
            ctx.sleep_until("until-9-amsterdam", wake.with_timezone(&Amsterdam)).await?;
            ctx.step("send", || async { Ok(format!("sent at {}", ctx.db_time().with_timezone(&Amsterdam))) }).await
        });

    let db = common::fresh_db("sleep_until_zone").await?;
    let engine = db.builder().function(morning_report).build().await?;
    let worker = engine.spawn_worker();
    let run_id = engine.send(Event::new("report/requested", &())).await?.run_ids[0];

    // Wait until it sleeps, then show when it will wake.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while engine.run(run_id).await?.state != RunState::Sleeping {
        assert!(std::time::Instant::now() < deadline, "the run never went to sleep");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let wake = engine.run(run_id).await?.run_at;
    println!("sleeping until {} = {} (no worker held)", wake.with_timezone(&Amsterdam), wake.with_timezone(&Utc));

    let now = durastep::testing::db_now(&engine).await?;
    let until_wake = (wake - now).to_std()? + Duration::from_secs(1);
    println!("moving this database's clock {} min forward instead of waiting", until_wake.as_secs() / 60);
    durastep::testing::advance_clock(&engine, until_wake).await?;

    let run = engine.wait_for_run(run_id, Duration::from_secs(30)).await?;
    worker.stop().await?;
    println!("run {:?}: {}", run.state, run.output.unwrap_or_default());
    Ok(())
}
