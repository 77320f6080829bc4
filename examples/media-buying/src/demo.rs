//! The `demo` command: Story B end to end on a fresh database, in well under a minute.
//!
//! It starts the four simulators and one worker, moves the database clock to
//! a Friday 21:30 in Amsterdam (LinkedIn's write bucket drains on Friday
//! evenings), sends budget requests for 80 clients over Meta, TikTok and
//! LinkedIn, with the story's failures switched on, then crosses the night
//! (TikTok's runs sleep until after its midnight-UTC reset) and the Saturday
//! 06:00 summary by moving the database clock forward, not by waiting. It
//! prints what happened, with figures, and the founder's view.

use std::time::{Duration, Instant};

use chrono::{DateTime, Datelike, Utc};
use chrono_tz::Europe::Amsterdam;
use durastep::{Engine, Schedule, WorkerOptions};
use sqlx::PgPool;

use crate::functions::SUMMARY_CRON;
use crate::sim::{SimClock, Simulators};
use crate::units::{human, human_secs};
use crate::{Error, Platform, Settings, database, founder, store};

/// The demo's own database.
pub const DATABASE: &str = "durastep_media_buying";

/// How long the demo may wait for any one phase.
const PHASE_LIMIT: Duration = Duration::from_secs(40);

pub(crate) struct Clock(pub(crate) Instant);

impl Clock {
    pub(crate) fn say(&self, text: &str) {
        println!("[{:>5.1} s] {text}", self.0.elapsed().as_secs_f64());
    }
}

/// A client's ad accounts and campaigns.
#[derive(Clone)]
struct Client {
    name: String,
    accounts: Vec<(Platform, String, usize)>,
}

/// 80 clients: all on Meta (3 campaigns; every 13th a big one with 14), the
/// first 30 also on TikTok (2 campaigns), clients 51-70 also on LinkedIn (5).
fn clients() -> Vec<Client> {
    (1..=80)
        .map(|i| {
            let mut accounts = vec![(Platform::Meta, format!("act_{}", 10_000 + i), if i % 13 == 0 { 14 } else { 3 })];
            if i <= 30 {
                accounts.push((Platform::TikTok, format!("adv_{}", 70_000 + i), 2));
            }
            if (51..=70).contains(&i) {
                accounts.push((Platform::LinkedIn, format!("li_{}", 500 + i), 5));
            }
            Client { name: format!("client-{i:02}"), accounts }
        })
        .collect()
}

/// Runs the demo.
pub async fn run() -> Result<(), Error> {
    let clock = Clock(Instant::now());
    // Kept to the end: a throwaway cluster is removed when it drops.
    let server = database::server().await?;
    let options = database::fresh_database(server.url(), DATABASE).await?;
    let pool = database::pool(options, 12).await?;
    let sims = Simulators::start(SimClock::Database(pool.clone())).await?;
    let settings = Settings::new(sims.endpoints.clone());
    let worker_options = WorkerOptions { poll_interval: Duration::from_millis(100), ..Default::default() };
    let (engine, services) = database::engine(pool.clone(), settings, worker_options).await?;
    clock.say(&format!(
        "fresh database {DATABASE} (schemas durastep and media migrated); simulators at {} (Meta), {} (TikTok), {} (LinkedIn), {} (chat)",
        sims.endpoints.meta, sims.endpoints.tiktok, sims.endpoints.linkedin, sims.endpoints.chat
    ));

    let friday = next_friday_2130(durastep::testing::db_now(&engine).await?);
    clock_to(&engine, friday).await?;
    clock.say(&format!(
        "database clock moved to {} (the simulators read the same clock): LinkedIn's write bucket drains on Friday evenings",
        local(friday)
    ));

    let clients = clients();
    seed(&pool, &sims, &clients, friday).await?;
    // The story's failures.
    sims.meta.set_bursts(40, 3);
    sims.meta.set_latency(Duration::from_millis(150));
    sims.linkedin.set_latency(Duration::from_millis(700));
    sims.linkedin.set_write_bucket(Some((3, Duration::from_secs(4))));
    let archived = "li_551_c5";
    sims.linkedin.archive(archived);
    clock.say(
        "failures on: Meta 429 bursts (every 40th write starts 3 on its account), one Meta token expiring in 3 days \
         (client-17), one Meta expired although the store thinks it valid (client-42); LinkedIn write bucket of 3 writes \
         per 4 s per account (429 + Retry-After), one archived LinkedIn campaign",
    );

    let worker = engine.spawn_worker();

    // The clients send at once, as on a Friday evening: one task per client.
    let mut senders = tokio::task::JoinSet::new();
    for client in &clients {
        let (engine, pool) = (engine.clone(), pool.clone());
        let by = format!("{}@agency", client.name);
        let accounts = client.accounts.clone();
        senders.spawn(async move {
            let mut counts = [0usize; 3];
            for (platform, account, campaigns) in accounts {
                for c in 1..=campaigns {
                    let cents = 2_500 + 500 * (c as i64 % 7) + 100 * (account.len() as i64);
                    let campaign = format!("{account}_c{c}");
                    store::request_budget(&engine, &pool, platform, &account, &campaign, cents, &by).await?;
                    counts[Platform::ALL.iter().position(|p| *p == platform).unwrap_or(0)] += 1;
                }
            }
            Ok::<_, Error>(counts)
        });
    }
    let mut counts = [0usize; 3];
    while let Some(sent) = senders.join_next().await {
        let sent = sent.map_err(|e| Error::Usage(format!("sender task: {e}")))??;
        for (total, n) in counts.iter_mut().zip(sent) {
            *total += n;
        }
    }
    clock.say(&format!(
        "sent {} budget requests for {} clients: {} Meta, {} TikTok, {} LinkedIn (each a queued budget write and the \
         event that starts its run, in one transaction)",
        counts.iter().sum::<usize>(),
        clients.len(),
        counts[0],
        counts[1],
        counts[2]
    ));

    let live = [
        "meta-budget-update",
        "linkedin-budget-update",
        "meta-budget-update/on-failure",
        "linkedin-budget-update/on-failure",
    ];
    wait_finished(&clock, &pool, &live).await?;
    clock.say("every Meta and LinkedIn run finished");

    let (sleeping, wake): (i64, Option<DateTime<Utc>>) = sqlx::query_as(
        "SELECT count(*), min(run_at) FROM durastep.runs WHERE function_id = 'tiktok-budget-update' AND state = 'sleeping'",
    )
    .fetch_one(&pool)
    .await?;
    if let Some(wake) = wake {
        clock.say(&format!(
            "TikTok: {sleeping} runs sleeping until {} UTC = {} (30 min after TikTok's midnight-UTC reset; the literal \
             \"01:30 Amsterdam\" would be 23:30 UTC in summer, before the reset); no worker holds them",
            wake.format("%H:%M"),
            local(wake)
        ));
        clock_to(&engine, wake + chrono::Duration::seconds(1)).await?;
        clock.say("moved the database clock across the night instead of waiting for it");
        wait_finished(&clock, &pool, &["tiktok-budget-update", "tiktok-budget-update/on-failure"]).await?;
        clock.say("every TikTok run finished");
    }

    let now = durastep::testing::db_now(&engine).await?;
    if let Some(saturday) = Schedule::new(SUMMARY_CRON, Amsterdam).ok().and_then(|s| s.next_after(now)) {
        clock_to(&engine, saturday + chrono::Duration::seconds(1)).await?;
        clock.say(&format!("moved the database clock to {}: the summary's cron fires", local(saturday)));
        let deadline = Instant::now() + PHASE_LIMIT;
        while !sims.chat.messages().iter().any(|m| m.text.starts_with("Budget writes, week to")) {
            if Instant::now() > deadline {
                return Err(Error::Usage("the Saturday summary did not arrive".into()));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    finance_import(&clock, &engine, &pool).await?;
    worker.stop().await?;
    clock.say("worker stopped gracefully");

    report(&pool, &sims, &services.settings.on_call_channel).await?;
    println!();
    print!("{}", founder::load(&pool).await?.render());
    println!("\nThe same view, any time: cargo run -p media-buying -- founder");
    clock.say("done");
    Ok(())
}

/// The one-off import of the finance sheet: an export of the week's Meta
/// writes as finance keeps them, with the usual slips (a typed-over amount,
/// a reference that exists nowhere, a row pasted twice), imported row by
/// row; the accountant approves one flagged row and corrects another, and
/// the third stays in the founder's review queue.
async fn finance_import(clock: &Clock, engine: &Engine, pool: &PgPool) -> Result<(), Error> {
    use crate::functions::finance::{Decision, ReviewDecision};
    use crate::store::finance;
    let writes: Vec<(String, String, String, i64, String, String)> = sqlx::query_as(
        "SELECT to_char(w.pushed_at AT TIME ZONE 'Europe/Amsterdam', 'DD-MM-YYYY'), a.client, w.account_id,
                w.amount_cents, w.campaign_id, w.external_ref
           FROM media.budget_writes w JOIN media.accounts a USING (platform, account_id)
          WHERE w.platform = 'meta' AND w.status = 'pushed' ORDER BY w.id LIMIT 40",
    )
    .fetch_all(pool)
    .await?;
    let mut csv = String::from("date,client,platform,account,campaign,daily_budget,reference\n");
    for (i, (date, client, account, cents, campaign, reference)) in writes.iter().enumerate() {
        // Finance writes euros with a decimal comma; row 7 was typed over, row 32 lost its amount.
        let cents = if i == 6 { cents + 1_000 } else { *cents };
        let amount = if i == 30 { "n/a".to_owned() } else { format!("\"{},{:02}\"", cents / 100, cents % 100) };
        csv.push_str(&format!("{date},{client},Meta,{account},{campaign},{amount},{reference}\n"));
        if i == 11 {
            csv.push_str(&format!(
                "{date},{client},Meta,{account},{campaign}-x,\"{},{:02}\",120202999999\n",
                cents / 100,
                cents % 100
            ));
        }
        if i == 20 {
            csv.push_str(&format!(
                "{date},{client},Meta,{account},{campaign},\"{},{:02}\",{reference}\n",
                cents / 100,
                cents % 100
            ));
        }
    }
    let imported = finance::import_sheet(engine, pool, "finance-week.csv", &csv).await?;
    clock.say(&format!(
        "finance sheet finance-week.csv ({} rows) stored as import #{}; its run imports it row by row (one step_tx per row)",
        imported.rows, imported.import_id
    ));
    let Some(run) = imported.run_id else { return Ok(()) };
    engine.wait_for_run(run, PHASE_LIMIT).await?;
    let deadline = Instant::now() + PHASE_LIMIT;
    let queue = loop {
        let queue = finance::review_queue(pool).await?;
        if queue.iter().all(|r| r.review_state.as_deref() == Some("waiting")) || Instant::now() > deadline {
            break queue;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let counts: Vec<String> =
        finance::rows_by_status(pool).await?.iter().map(|(status, n)| format!("{n} {status}")).collect();
    clock.say(&format!(
        "imported: {}; {} flagged rows each wait (a durable wait, no worker held) for an accountant",
        counts.join(", "),
        queue.len()
    ));
    let by = "anna@finance".to_owned();
    if let Some(first) = queue.first() {
        let decision = match first.store_cents {
            Some(store) => Decision::Correct { amount_cents: store },
            None => Decision::Approve,
        };
        finance::decide(engine, pool, ReviewDecision { row_id: first.id, decision, by: by.clone(), note: None })
            .await?;
    }
    if let Some(second) = queue.get(1) {
        let decision =
            ReviewDecision { row_id: second.id, decision: Decision::Approve, by, note: Some("new campaign".into()) };
        finance::decide(engine, pool, decision).await?;
    }
    let decided = queue.len().min(2);
    let deadline = Instant::now() + PHASE_LIMIT;
    while finance::review_queue(pool).await?.len() > queue.len() - decided && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    clock.say(&format!(
        "the accountant decided {decided} row(s) (`media-buying review <id> approve|correct ...`); the rest stays in the \
         founder's review queue below"
    ));
    Ok(())
}

/// Seeds the accounts and their tokens, in the store and at the platforms.
async fn seed(pool: &PgPool, sims: &Simulators, clients: &[Client], now: DateTime<Utc>) -> Result<(), Error> {
    for (i, client) in clients.iter().enumerate() {
        for (platform, account, _) in &client.accounts {
            let access = format!("tok-{}-{account}-v1", platform.as_str());
            let refresh = format!("refresh-{}-{account}", platform.as_str());
            let (stored, real) = match (platform, i + 1) {
                (Platform::Meta, 17) => (now + chrono::Duration::days(3), now + chrono::Duration::days(3)),
                (Platform::Meta, 42) => (now + chrono::Duration::days(30), now - chrono::Duration::days(1)),
                _ => (now + chrono::Duration::days(40), now + chrono::Duration::days(40)),
            };
            store::add_account(pool, *platform, account, &client.name).await?;
            store::add_token(pool, *platform, account, &access, &refresh, stored).await?;
            match platform {
                Platform::Meta => sims.meta.add_token(account, &access, &refresh, real),
                Platform::TikTok => sims.tiktok.add_token(&access),
                Platform::LinkedIn => sims.linkedin.add_token(&access),
            }
        }
    }
    Ok(())
}

/// How often a wait prints a progress line when nothing else is said.
const PROGRESS_EVERY: Duration = Duration::from_secs(2);

/// Waits until no run of these functions is unfinished, printing a progress
/// line every [`PROGRESS_EVERY`] (runs open by state) so a long wait is never silent.
pub(crate) async fn wait_finished(clock: &Clock, pool: &PgPool, functions: &[&str]) -> Result<(), Error> {
    let started = Instant::now();
    let deadline = started + PHASE_LIMIT;
    let mut next_progress = started + PROGRESS_EVERY;
    loop {
        let (open, running, waiting, finished): (i64, i64, i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state NOT IN ('completed', 'failed', 'cancelled', 'skipped')),
                    count(*) FILTER (WHERE state = 'running'),
                    count(*) FILTER (WHERE state IN ('queued', 'sleeping', 'waiting')),
                    count(*) FILTER (WHERE state IN ('completed', 'failed', 'cancelled', 'skipped'))
               FROM durastep.runs WHERE function_id = ANY($1)",
        )
        .bind(functions)
        .fetch_one(pool)
        .await?;
        if open == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Usage(format!("{open} runs still open after {}", human(PHASE_LIMIT))));
        }
        if Instant::now() >= next_progress {
            next_progress += PROGRESS_EVERY;
            clock.say(&format!(
                "  ... {finished} runs finished, {open} open ({running} running, {waiting} queued behind a limit or a \
                 backoff); waiting {} so far",
                human(started.elapsed())
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn report(pool: &PgPool, sims: &Simulators, channel: &str) -> Result<(), Error> {
    println!("\nRuns");
    println!("  {:<36} {:<10} {:>5} {:>8} {:>8}", "function", "state", "runs", "attempts", "retries");
    let rows: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT function_id, state, count(*), sum(attempt)::bigint FROM durastep.runs GROUP BY 1, 2 ORDER BY 1, 2",
    )
    .fetch_all(pool)
    .await?;
    for (function, state, runs, attempts) in &rows {
        println!("  {function:<36} {state:<10} {runs:>5} {attempts:>8} {:>8}", attempts - runs);
    }

    let pushed = |p: Platform| async move {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM media.budget_writes WHERE platform = $1 AND status = 'pushed'",
        )
        .bind(p.as_str())
        .fetch_one(pool)
        .await
    };
    println!("\nAt the platforms (the simulators count every write they receive)");
    println!(
        "  Meta:     {} writes received, {} applied, {} repeats deduplicated by idempotency key, {} 429s, {} auth \
         errors (code 190); most at once per ad account: {} (limit 6); store: {} pushed",
        sims.meta.writes_received(),
        sims.meta.writes().len(),
        sims.meta.duplicates(),
        sims.meta.rate_limited(),
        sims.meta.auth_errors(),
        sims.meta.max_in_flight_per_account(),
        pushed(Platform::Meta).await?
    );
    println!(
        "  LinkedIn: {} writes received, {} applied, {} 429s with Retry-After; most at once per account: {} (limit 2); \
         store: {} pushed",
        sims.linkedin.writes_received(),
        sims.linkedin.writes().len(),
        sims.linkedin.rate_limited(),
        sims.linkedin.max_in_flight_per_account(),
        pushed(Platform::LinkedIn).await?
    );
    let tiktok = sims.tiktok.writes();
    let after_reset = tiktok.iter().filter(|w| w.at > w.counter_reset_at).count();
    let first = tiktok.iter().map(|w| w.at).min();
    println!(
        "  TikTok:   {} writes received, {} applied, {} of them after the day's midnight-UTC reset (first at {}); store: {} pushed",
        sims.tiktok.writes_received(),
        tiktok.len(),
        after_reset,
        first.map_or_else(|| "-".to_owned(), |t| format!("{} UTC", t.format("%a %H:%M:%S"))),
        pushed(Platform::TikTok).await?
    );
    let refreshed: i64 =
        sqlx::query_scalar("SELECT count(*) FROM media.tokens WHERE rotated_at IS NOT NULL").fetch_one(pool).await?;
    println!(
        "  Meta tokens refreshed by get-token: {refreshed} account(s) (client-17's expired within 7 days; \
         client-42's was rejected by Meta and refreshed in the same attempt), {} token(s) issued",
        sims.meta.tokens_issued("act_10017") + sims.meta.tokens_issued("act_10042")
    );
    println!(
        "  429s absorbed: {} (Meta retried with backoff, LinkedIn paused the account until Retry-After)",
        sims.meta.rate_limited() + sims.linkedin.rate_limited()
    );

    println!("\nLatency, budget request -> write accepted by the platform (database clock)");
    let latency: Vec<(String, i64, f64, f64, f64)> = sqlx::query_as(
        "SELECT platform, count(*),
                percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM pushed_at - requested_at)),
                percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM pushed_at - requested_at)),
                max(extract(epoch FROM pushed_at - requested_at))::float8
           FROM media.budget_writes WHERE status = 'pushed' GROUP BY platform ORDER BY platform",
    )
    .fetch_all(pool)
    .await?;
    for (platform, n, p50, p95, max) in latency {
        let note = if platform == "tiktok" { "  (held on purpose until after TikTok's reset)" } else { "" };
        println!(
            "  {platform:<9} {n:>4} writes: p50 {:>10}, p95 {:>10}, max {:>10}{note}",
            human_secs(p50),
            human_secs(p95),
            human_secs(max)
        );
    }

    let messages = sims.chat.messages_in(channel);
    println!("\nOn-call channel {channel}: {} message(s)", messages.len());
    for m in messages {
        println!("  - {}", m.text);
    }
    Ok(())
}

pub(crate) fn local(t: DateTime<Utc>) -> String {
    t.with_timezone(&Amsterdam).format("%a %d %b %Y %H:%M %Z (Amsterdam)").to_string()
}

/// The next Friday 21:30 in Amsterdam after `now`.
fn next_friday_2130(now: DateTime<Utc>) -> DateTime<Utc> {
    let mut day = now.with_timezone(&Amsterdam).date_naive();
    loop {
        if day.weekday() == chrono::Weekday::Fri
            && let Some(t) = day.and_hms_opt(21, 30, 0).and_then(|t| t.and_local_timezone(Amsterdam).single())
            && t.with_timezone(&Utc) > now
        {
            return t.with_timezone(&Utc);
        }
        day = day.succ_opt().unwrap_or(day);
    }
}

pub(crate) async fn clock_to(engine: &Engine, at: DateTime<Utc>) -> Result<(), Error> {
    let now = durastep::testing::db_now(engine).await?;
    if let Ok(by) = (at - now).to_std() {
        durastep::testing::advance_clock(engine, by).await?;
    }
    Ok(())
}
