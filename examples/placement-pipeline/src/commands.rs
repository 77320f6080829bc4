//! The operator's commands: status, the switches, the channel fix, re-running
//! dead runs, and serving against the real systems.

use std::error::Error;
use std::sync::Arc;

use durastep::Engine;
use placement_pipeline::clock::Clock;
use placement_pipeline::database::{own_database, server_url};
use placement_pipeline::figures::runs_by_function;
use placement_pipeline::http::Client;
use placement_pipeline::receiver::{self, ReceiverStats};
use placement_pipeline::settings::{self, Settings};
use placement_pipeline::side_effects::{self, Pipeline};
use placement_pipeline::simulators::{Faults, Simulators};
use placement_pipeline::{Endpoints, SideEffect};
use sqlx::PgPool;
use sqlx::postgres::PgPoolOptions;
use tokio_util::sync::CancellationToken;

type Result<T = ()> = std::result::Result<T, Box<dyn Error>>;

async fn connect() -> Result<PgPool> {
    let url = server_url();
    let options = own_database(&url, false)
        .await
        .map_err(|e| format!("cannot reach Postgres at {url}: {e} (set DATABASE_URL to a Postgres you can use)"))?;
    let pool = PgPoolOptions::new().max_connections(8).connect_with(options).await?;
    durastep::migrate(&pool).await?;
    settings::migrate(&pool).await?;
    Ok(pool)
}

/// Runs per side effect and state (the story's one dashboard panel), and the switches.
pub async fn status() -> Result {
    let pool = connect().await?;
    let settings = Settings::new(pool.clone());
    let runs = runs_by_function(&pool).await?;
    println!("{:<26} {:>6} {:>10} {:>7} {:>6} {:>8}", "function", "runs", "completed", "failed", "open", "retries");
    for side_effect in SideEffect::ALL {
        let r = runs.get(side_effect.function_id()).cloned().unwrap_or_default();
        println!(
            "{:<26} {:>6} {:>10} {:>7} {:>6} {:>8}",
            side_effect.function_id(),
            r.runs,
            r.completed,
            r.failed,
            r.open,
            r.retries
        );
    }
    println!("\ndry run: {}", if settings.dry_run().await? { "on" } else { "off" });
    for (side_effect, on) in settings.switches().await? {
        println!("switch {:<26} {}", side_effect.function_id(), if on { "on" } else { "off" });
    }
    Ok(())
}

/// Turns dry run on or off.
pub async fn dry_run(on: bool) -> Result {
    Settings::new(connect().await?).set_dry_run(on).await?;
    println!("dry run is {}; runs that execute from now on read it", if on { "on" } else { "off" });
    Ok(())
}

/// Turns one side effect on or off.
pub async fn switch(side_effect: SideEffect, on: bool) -> Result {
    Settings::new(connect().await?).set_switch(side_effect, on).await?;
    println!("{side_effect} is {}; runs that execute from now on read it", if on { "on" } else { "off" });
    Ok(())
}

/// Sets a client account's chat channel.
pub async fn channel(account: &str, channel: &str) -> Result {
    Settings::new(connect().await?).set_channel(account, channel).await?;
    println!("client account {account} now posts to {channel}");
    Ok(())
}

/// Re-runs the dead runs of one side effect, from the step that failed. A
/// worker (`serve`) picks them up at once.
pub async fn rerun_dead(side_effect: SideEffect) -> Result {
    let engine = Engine::builder().pool(connect().await?).build().await?;
    let ids = side_effects::rerun_dead(&engine, side_effect).await?;
    println!("{} dead runs of {side_effect} queued again, resuming at the step that failed", ids.len());
    for id in ids {
        println!("  {id}");
    }
    Ok(())
}

/// Runs the six simulators on the machine's clock until Ctrl-C, printing the
/// variables that point `serve` at them.
pub async fn simulators() -> Result {
    let config = placement_pipeline::stack::StackConfig::default();
    let channels: Vec<&str> = config.chat_channels.iter().map(String::as_str).collect();
    let sims = Simulators::start(Clock::System, Faults::default(), &channels).await?;
    let e = sims.endpoints();
    println!("export PLACEMENT_MAIL_URL={}", e.mail);
    println!("export PLACEMENT_CRM_URL={}", e.crm);
    println!("export PLACEMENT_CHAT_URL={}", e.chat);
    println!("export PLACEMENT_SHEET_URL={}", e.sheet);
    println!("export PLACEMENT_OUTREACH_URL={}", e.outreach);
    println!("export PLACEMENT_INVOICING_URL={}", e.invoicing);
    println!("# chat channels: {}; Ctrl-C stops", channels.join(" "));
    tokio::signal::ctrl_c().await?;
    Ok(())
}

/// The receiver and a worker against the real systems, until Ctrl-C. The base
/// URLs come from `PLACEMENT_MAIL_URL`, `PLACEMENT_CRM_URL`, `PLACEMENT_CHAT_URL`,
/// `PLACEMENT_SHEET_URL`, `PLACEMENT_OUTREACH_URL` and `PLACEMENT_INVOICING_URL`;
/// the receiver listens on `PLACEMENT_LISTEN` (default `127.0.0.1:8080`).
pub async fn serve() -> Result {
    let var = |name: &str| std::env::var(name).map_err(|_| format!("set {name} to the system's base URL"));
    let endpoints = Endpoints {
        mail: var("PLACEMENT_MAIL_URL")?,
        crm: var("PLACEMENT_CRM_URL")?,
        chat: var("PLACEMENT_CHAT_URL")?,
        sheet: var("PLACEMENT_SHEET_URL")?,
        outreach: var("PLACEMENT_OUTREACH_URL")?,
        invoicing: var("PLACEMENT_INVOICING_URL")?,
    };
    let listen = std::env::var("PLACEMENT_LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".to_owned());
    let pool = connect().await?;
    let pipeline = Pipeline { endpoints, client: Client::new()?, settings: Settings::new(pool.clone()) };
    let mut builder = Engine::builder().pool(pool);
    for f in side_effects::functions(&pipeline) {
        builder = builder.function(f);
    }
    let engine = builder.build().await?;
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("receiving webhooks on http://{listen}/webhooks/stage-changed; Ctrl-C stops");
    let router = receiver::router(engine.clone(), Clock::System, Arc::new(ReceiverStats::default()));
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        tokio::signal::ctrl_c().await.ok();
        stop.cancel();
    });
    let server = {
        let shutdown = shutdown.clone();
        tokio::spawn(
            async move { axum::serve(listener, router).with_graceful_shutdown(shutdown.cancelled_owned()).await },
        )
    };
    engine.run_worker(shutdown).await?;
    server.await??;
    Ok(())
}
