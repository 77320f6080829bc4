//! The demo: the Monday-morning burst of 200 stage changes against the six
//! simulators, then the story's incident (a typo in a channel name: 5
//! failures, dead, fixed, re-run).

use std::error::Error;
use std::time::{Duration, Instant};

use durastep::RunState;
use placement_pipeline::burst::{self, monday_burst};
use placement_pipeline::database::{DATABASE, own_database, server_url};
use placement_pipeline::figures::{human, latencies, percentile, runs_by_function};
use placement_pipeline::simulators::Faults;
use placement_pipeline::stack::{Stack, StackConfig};
use placement_pipeline::{SideEffect, Stage, StageChange, side_effects};

type Result<T = ()> = std::result::Result<T, Box<dyn Error>>;

/// The client account onboarded on Monday with a typo in its channel name.
const NEW_ACCOUNT: &str = "initech";
const RIGHT_CHANNEL: &str = "#client-initech";
const TYPO_CHANNEL: &str = "#client-intiech";

pub async fn run() -> Result {
    let started = Instant::now();
    println!("Story A: the placement pipeline (CRM stage change -> one durable run per side effect)\n");
    // Kept to the end: a throwaway cluster is removed when it drops.
    let server = durastep_localpg::LocalDatabase::resolve(&server_url()).await?;
    if let Some(notice) = server.notice() {
        println!("{notice}");
    }
    let url = server.url().to_owned();
    let options = own_database(&url, true)
        .await
        .map_err(|e| format!("cannot reach Postgres at {url}: {e}\n(set DATABASE_URL to a Postgres you can use)"))?;
    println!("database {DATABASE} created from nothing on {}", url.rsplit_once('@').map_or(url.as_str(), |(_, h)| h));

    let mut config = StackConfig {
        // The real systems' bad days: the mail API answers 503 now and then;
        // the CRM sometimes creates the task and loses the response.
        faults: Faults { mail_unavailable_every: Some(40), crm_lost_response_every: Some(45) },
        workers: 3,
        max_connections: 12,
        progress_every: Some(Duration::from_secs(2)),
        ..StackConfig::default()
    };
    config.chat_channels.push(RIGHT_CHANNEL.to_owned());
    config.channel_config.push((NEW_ACCOUNT.to_owned(), TYPO_CHANNEL.to_owned()));
    let stack = Stack::start(options, config).await?;
    println!("started 6 simulators, the webhook receiver ({}) and 3 workers side by side\n", stack.receiver_url);

    monday(&stack).await?;
    incident(&stack).await?;

    let (moved, jumps) = stack.clock_moved();
    println!(
        "\nTime: the database clock was moved forward {} in {jumps} jumps to cross backoff delays and Retry-After\n\
         waits (durastep::testing::advance_clock; the simulators read the same clock). Real time: {}.",
        human(moved),
        human(started.elapsed())
    );
    stack.stop().await?;
    Ok(())
}

async fn monday(stack: &Stack) -> Result {
    let burst = monday_burst(200, 12);
    println!(
        "== Monday 08:00-10:00: {} stage changes ({} placements), {} webhooks re-fired by the CRM ==",
        burst.changes.len(),
        burst.placements(),
        burst.refired()
    );
    let sent = Instant::now();
    deliver(stack, &burst.deliveries.iter().map(|&i| burst.changes[i].clone()).collect::<Vec<_>>()).await?;
    println!(
        "{} webhooks delivered in {}: {} stage changes stored, {} re-fires ignored (same dedupe key)",
        stack.receiver_stats.webhooks(),
        human(sent.elapsed()),
        stack.receiver_stats.webhooks() - stack.receiver_stats.duplicates(),
        stack.receiver_stats.duplicates()
    );
    stack.settle(Duration::from_secs(40)).await?;
    println!("all runs finished after {}\n", human(sent.elapsed()));

    let runs = runs_by_function(&stack.pool).await?;
    println!("{:<24} {:>5} {:>10} {:>5} {:>8}  at the system", "side effect", "runs", "completed", "dead", "retries");
    let s = &stack.sims;
    let at_system = [
        format!("{} mails", s.mail.traffic().counts().accepted),
        format!("{} tasks", s.crm.tasks()),
        format!("{} posts", s.chat.traffic().counts().accepted),
        format!("{} rows", s.sheet.rows()),
        format!("{} status updates", s.outreach.traffic().counts().accepted),
        format!("{} draft invoices", s.invoicing.invoices()),
    ];
    for (side_effect, at) in SideEffect::ALL.into_iter().zip(at_system) {
        let r = runs.get(side_effect.function_id()).cloned().unwrap_or_default();
        println!(
            "{:<24} {:>5} {:>10} {:>5} {:>8}  {at}",
            side_effect.function_id(),
            r.runs,
            r.completed,
            r.failed,
            r.retries
        );
    }
    let total: i64 = runs.values().map(|r| r.runs).sum();
    let dead: i64 = runs.values().map(|r| r.failed).sum();
    println!("{:<24} {total:>5}{:>17}", "all", dead);

    let mail = s.mail.traffic().counts();
    let inv = s.invoicing.traffic().counts();
    println!(
        "\nretries: {} mail 503s retried after 30 s; {} CRM responses lost after the task was created, retried",
        mail.rejected,
        s.crm.duplicates()
    );
    println!(
        "429s absorbed: invoicing throttled {} of {} requests (about 20/minute sustained); each 429 paused every\n\
         invoicing run until its Retry-After without costing an attempt; {} draft invoices for {} placements, none dead",
        s.invoicing.throttled(),
        inv.requests,
        s.invoicing.invoices(),
        burst.placements()
    );
    println!(
        "max requests in flight at invoicing: {} (the shared concurrency limit of 1)",
        s.invoicing.max_in_flight()
    );
    println!(
        "duplicates prevented: {} re-fired webhooks created no runs; {} retried CRM writes landed on the task\n\
         that existed (same idempotency token), so {} tasks for {} stage changes",
        stack.receiver_stats.duplicates(),
        s.crm.duplicates(),
        s.crm.tasks(),
        burst.changes.len()
    );
    let measured = latencies(&stack.pool, &stack.sims).await?;
    let lat: Vec<Duration> = measured.iter().map(|(_, d)| *d).collect();
    println!(
        "latency webhook -> side effect ({} side effects): p50 {}, p99 {}, max {}",
        lat.len(),
        human(percentile(&lat, 50.0)),
        human(percentile(&lat, 99.0)),
        human(percentile(&lat, 100.0))
    );
    for side_effect in SideEffect::ALL {
        let one: Vec<Duration> = measured.iter().filter(|(e, _)| *e == side_effect).map(|(_, d)| *d).collect();
        println!(
            "  {:<24} p50 {:>8}  p99 {:>8}",
            side_effect.function_id(),
            human(percentile(&one, 50.0)),
            human(percentile(&one, 99.0))
        );
    }
    println!(
        "  (on the database clock: a retried side effect includes its backoff, and an invoice its wait for\n   \
         the throttle, both crossed by moving the clock)"
    );
    if dead > 0 {
        return Err(format!("{dead} runs ended dead during the Monday burst").into());
    }
    Ok(())
}

async fn incident(stack: &Stack) -> Result {
    println!("\n== The incident: client account {NEW_ACCOUNT} was onboarded with channel {TYPO_CHANNEL:?} (a typo) ==");
    let changes: Vec<StageChange> = [Stage::Sourced, Stage::IntroCall, Stage::Offer]
        .into_iter()
        .enumerate()
        .map(|(i, stage)| StageChange {
            contact_id: 20_000 + i as u64,
            stage,
            occurred_at: burst::monday_burst(1, 0).changes[0].occurred_at + chrono::Duration::hours(3),
            candidate_name: format!("Candidate {}", 20_000 + i),
            candidate_email: format!("candidate{}@example.com", 20_000 + i),
            recruiter_id: 101,
            client_account: NEW_ACCOUNT.to_owned(),
            fee_cents: None,
            received_at: None,
        })
        .collect();
    deliver(stack, &changes).await?;
    stack.settle(Duration::from_secs(20)).await?;
    let dead: Vec<_> = sqlx::query_as::<_, (uuid::Uuid, i32, Option<String>)>(
        "SELECT id, attempt, last_error FROM durastep.runs WHERE function_id = 'post-to-channel' AND state = 'failed'",
    )
    .fetch_all(&stack.pool)
    .await?;
    let refused = stack.sims.chat.traffic().counts().rejected;
    println!(
        "{} post-to-channel runs dead after {} attempts each ({} posts refused by chat); last_error: {}",
        dead.len(),
        dead.first().map_or(0, |d| d.1),
        refused,
        dead.first().and_then(|d| d.2.clone()).unwrap_or_default()
    );
    println!("the other side effects of these stage changes went out: each run is independent");
    stack.settings.set_channel(NEW_ACCOUNT, RIGHT_CHANNEL).await?;
    println!("fix: `placement-pipeline channel {NEW_ACCOUNT} {RIGHT_CHANNEL}` (one row in placement.channels)");
    let rerun = Instant::now();
    let queued = side_effects::rerun_dead(&stack.engine, SideEffect::ChannelPost).await?;
    println!("re-run: `placement-pipeline rerun-dead` queued {} dead runs again, from the failed step", queued.len());
    stack.settle(Duration::from_secs(20)).await?;
    let mut completed = 0;
    for id in &queued {
        if stack.engine.run(*id).await?.state == RunState::Completed {
            completed += 1;
        }
    }
    let posts = stack.sims.chat.posts_in(RIGHT_CHANNEL).len();
    let once = changes.iter().all(|c| stack.sims.chat.posted_with(&c.dedupe_key()) == 1);
    println!(
        "{completed} of {} re-run runs completed in {}; {posts} posts in {RIGHT_CHANNEL}, {} each stage change",
        queued.len(),
        human(rerun.elapsed()),
        if once { "exactly one for" } else { "NOT exactly one for" }
    );
    if completed != dead.len() || posts != changes.len() || !once {
        return Err("the re-run did not post exactly once per stage change".into());
    }
    Ok(())
}

/// Delivers webhooks eight at a time, as a CRM's webhook sender would,
/// printing a progress line every 2 s.
async fn deliver(stack: &Stack, changes: &[StageChange]) -> Result {
    let started = Instant::now();
    let mut next_progress = Duration::from_secs(2);
    let mut sent = 0;
    for chunk in changes.chunks(24) {
        stack.webhooks().send_all(chunk, 8).await?;
        sent += chunk.len();
        if started.elapsed() >= next_progress && sent < changes.len() {
            next_progress += Duration::from_secs(2);
            println!("  ... {sent} of {} webhooks delivered ({})", changes.len(), human(started.elapsed()));
        }
    }
    Ok(())
}
