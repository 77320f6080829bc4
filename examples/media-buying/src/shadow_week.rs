//! The `shadow-week` command: the story's migration step "one channel
//! shadow-written (the new code runs beside the old writer for a week and
//! results are compared)", on TikTok, as the story ran it.
//!
//! For seven days (Monday to Sunday, Amsterdam), 30 clients ask for new
//! TikTok daily budgets, each campaign once a day, at 09:15, 14:30 or 23:55
//! Amsterdam. The old writer (the zap) still owns the writes: it pushes each
//! one to TikTok as it comes, and, as zaps did, now and then pushes a bump
//! twice after a timeout (a doubled daily budget). Beside it,
//! `tiktok-budget-shadow` plans each write as the new function would (the
//! amount, at 00:30 UTC after TikTok's midnight-UTC reset), sleeps durably
//! until then, reads the campaign back from TikTok and records amount and
//! timing. The database clock crosses the nights; nothing waits for real.
//! It ends with the comparison report (`media-buying shadow-report` prints
//! it again for any database).

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use chrono::{DateTime, Datelike, NaiveTime, Utc};
use chrono_tz::Europe::Amsterdam;
use durastep::WorkerOptions;

use crate::demo::{Clock, clock_to, local, wait_finished};
use crate::functions::{ShadowRequest, next_tiktok_push, request_shadow};
use crate::sim::{SimClock, Simulators};
use crate::store::{self, LATE_IN_DAY_HOURS, ShadowReport};
use crate::units::{euros, human};
use crate::{Error, Platform, Settings, database};

/// The command's own database.
pub const DATABASE: &str = "durastep_media_buying_shadow";

/// How many differences the report lists.
const SHOWN_DIFFERENCES: usize = 20;

/// Every how many requests the old writer pushes a bump twice (a doubled budget).
const DOUBLED_EVERY: usize = 37;

/// Runs the shadow week.
pub async fn run() -> Result<(), Error> {
    let clock = Clock(Instant::now());
    let server = database::server().await?;
    let options = database::fresh_database(server.url(), DATABASE).await?;
    let pool = database::pool(options, 10).await?;
    let sims = Simulators::start(SimClock::Database(pool.clone())).await?;
    let mut settings = Settings::new(sims.endpoints.clone());
    settings.tiktok_shadow = true;
    let worker_options = WorkerOptions { poll_interval: Duration::from_millis(100), ..Default::default() };
    let (engine, services) = database::engine(pool.clone(), settings, worker_options).await?;
    clock.say(&format!(
        "fresh database {DATABASE}; TikTok in shadow mode: tiktok-budget-shadow replaces the TikTok writer"
    ));

    let monday = next_monday_0800(durastep::testing::db_now(&engine).await?);
    clock_to(&engine, monday).await?;
    let accounts: Vec<(String, String)> =
        (1..=30).map(|i| (format!("client-{i:02}"), format!("adv_{}", 70_000 + i))).collect();
    let expires = monday + chrono::Duration::days(60);
    for (client, account) in &accounts {
        let access = format!("tok-tiktok-{account}-v1");
        store::add_account(&pool, Platform::TikTok, account, client).await?;
        store::add_token(&pool, Platform::TikTok, account, &access, &format!("refresh-{account}"), expires).await?;
        sims.tiktok.add_token(&access);
    }
    clock.say(&format!(
        "database clock at {}; 30 TikTok advertisers with 2 campaigns each; each campaign gets one budget request \
         a day, at 09:15, 14:30 or 23:55 Amsterdam",
        local(monday)
    ));

    let worker = engine.spawn_worker();
    let slots = [(9, 15), (14, 30), (23, 55)];
    let mut n = 0usize;
    for day in 0..7 {
        let date = monday.with_timezone(&Amsterdam).date_naive() + chrono::Duration::days(day);
        for (slot, (h, m)) in slots.iter().enumerate() {
            let Some(at) = date
                .and_time(NaiveTime::from_hms_opt(*h, *m, 0).unwrap_or_default())
                .and_local_timezone(Amsterdam)
                .single()
            else {
                continue;
            };
            clock_to(&engine, at.with_timezone(&Utc)).await?;
            for (i, (client, account)) in accounts.iter().enumerate() {
                for c in 1..=2usize {
                    if (i + c + day as usize) % slots.len() != slot {
                        continue;
                    }
                    n += 1;
                    let campaign = format!("{account}_c{c}");
                    let cents = 2_000 + 500 * ((i + c + day as usize) as i64 % 9);
                    // The old writer pushes now, with its own token; now and then twice.
                    let token = format!("tok-tiktok-{account}-v1");
                    let doubled = n.is_multiple_of(DOUBLED_EVERY);
                    let written = if doubled { cents * 2 } else { cents };
                    let zap_key = format!("zap-{n}");
                    services.api.tiktok.update_budget(&token, account, &campaign, written, &zap_key).await?;
                    let request_id = format!("{}-{n}", date.format("%Y%m%d"));
                    let by = format!("{client}@agency");
                    let request = ShadowRequest {
                        platform: Platform::TikTok,
                        request_id: &request_id,
                        account_id: account,
                        campaign_id: &campaign,
                        amount_cents: cents,
                        requested_by: &by,
                    };
                    request_shadow(&engine, request).await?;
                }
            }
            // Each run plans (a checkpointed step) at its request's time, before the clock moves on.
            wait_asleep(&pool).await?;
        }
        // Every shadow run of the day sleeps until 00:30 UTC; cross the night.
        let now = durastep::testing::db_now(&engine).await?;
        let Some(wake) = next_tiktok_push(now) else { break };
        clock_to(&engine, wake + chrono::Duration::seconds(1)).await?;
        wait_finished(&clock, &pool, &["tiktok-budget-shadow"]).await?;
        clock.say(&format!(
            "{}: {n} requests so far; the shadow runs of the day woke at {} and compared",
            date.format("%a %d %b"),
            local(wake)
        ));
    }
    worker.stop().await?;
    clock.say(&format!(
        "TikTok received {} writes, all from the old writer: shadow mode wrote nothing",
        sims.tiktok.writes_received()
    ));
    println!();
    print!("{}", store::shadow_report(&pool, Platform::TikTok).await?.render());
    println!("\nThe same report, any time: cargo run -p media-buying -- shadow-report");
    clock.say("done");
    Ok(())
}

/// Waits until no shadow run is queued or running (each has made its plan and sleeps).
async fn wait_asleep(pool: &sqlx::PgPool) -> Result<(), Error> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let busy: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM durastep.runs
              WHERE function_id = 'tiktok-budget-shadow' AND state IN ('queued', 'running')",
        )
        .fetch_one(pool)
        .await?;
        if busy == 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(Error::Usage(format!("{busy} shadow runs still not asleep after a minute")));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The next Monday 08:00 in Amsterdam after `now`.
fn next_monday_0800(now: DateTime<Utc>) -> DateTime<Utc> {
    let mut day = now.with_timezone(&Amsterdam).date_naive();
    loop {
        if day.weekday() == chrono::Weekday::Mon
            && let Some(t) = day.and_hms_opt(8, 0, 0).and_then(|t| t.and_local_timezone(Amsterdam).single())
            && t.with_timezone(&Utc) > now
        {
            return t.with_timezone(&Utc);
        }
        day = day.succ_opt().unwrap_or(day);
    }
}

fn ams(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".to_owned(), |t| t.with_timezone(&Amsterdam).format("%a %H:%M").to_string())
}

impl ShadowReport {
    /// The report as plain text: per day, the verdict, and the differences.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let p = self.platform.label();
        let _ = writeln!(
            out,
            "Shadow comparison on {p}: what the new function would have written, against what the old writer wrote"
        );
        let _ = writeln!(
            out,
            "  {:<12} {:>8} {:>11} {:>12} {:>13} {:>12} {:>16}",
            "day (AMS)", "requests", "same amount", "other amount", "never written", "late in day", "written too much"
        );
        let mut total = (0, 0, 0, 0, 0, 0);
        for d in &self.days {
            let _ = writeln!(
                out,
                "  {:<12} {:>8} {:>11} {:>12} {:>13} {:>12} {:>16}",
                d.day.format("%a %d %b").to_string(),
                d.requests,
                d.same_amount,
                d.other_amount,
                d.never_written,
                d.late_in_day,
                euros(d.extra_cents)
            );
            total.0 += d.requests;
            total.1 += d.same_amount;
            total.2 += d.other_amount;
            total.3 += d.never_written;
            total.4 += d.late_in_day;
            total.5 += d.extra_cents;
        }
        let _ = writeln!(
            out,
            "  {:<12} {:>8} {:>11} {:>12} {:>13} {:>12} {:>16}",
            "all",
            total.0,
            total.1,
            total.2,
            total.3,
            total.4,
            euros(total.5)
        );
        let _ = writeln!(
            out,
            "\nVerdict: the shadow agreed with the old writer on {} of {} amounts. The old writer wrote another amount \
             {} time(s) ({} a day more than asked, in all) and left {} request(s) unwritten; {} of its writes landed \
             with under {LATE_IN_DAY_HOURS} h of {p}'s day left, where a bump burns out in minutes. The new function \
             would have written every asked amount once{}.",
            total.1,
            total.0,
            total.2,
            euros(total.5),
            total.3,
            total.4,
            if self.platform == Platform::TikTok { ", at 00:30 UTC, 30 min after TikTok's daily reset" } else { "" }
        );
        if !self.differences.is_empty() {
            // Amount differences first (they cost money), then writes that were only late; oldest first in each.
            let mut shown: Vec<&crate::store::ShadowDifference> =
                self.differences.iter().filter(|d| d.platform_cents != Some(d.planned_cents)).collect();
            shown.extend(self.differences.iter().filter(|d| d.platform_cents == Some(d.planned_cents)));
            let more = shown.len().saturating_sub(SHOWN_DIFFERENCES);
            shown.truncate(SHOWN_DIFFERENCES);
            let _ = writeln!(
                out,
                "\nDifferences ({}): amounts first, then late writes; oldest first in each",
                self.differences.len()
            );
            let _ = writeln!(
                out,
                "  {:<16} {:<10} {:>12} {:<10} {:>12} {:<10} {:>11}  why",
                "campaign", "asked", "shadow", "at", "old writer", "at", "day left"
            );
            for d in shown {
                let left = d.platform_written_at.map(|t| {
                    let next_midnight = (t.date_naive() + chrono::Duration::days(1)).and_time(NaiveTime::MIN).and_utc();
                    human((next_midnight - t).to_std().unwrap_or_default())
                });
                let mut why = Vec::new();
                match d.platform_cents {
                    None => why.push("never written".to_owned()),
                    Some(c) if c != d.planned_cents => {
                        why.push(format!("{} instead of {}", euros(c), euros(d.planned_cents)))
                    }
                    Some(_) => {}
                }
                if d.late_in_day {
                    why.push("late in the platform's day".to_owned());
                }
                let _ = writeln!(
                    out,
                    "  {:<16} {:<10} {:>12} {:<10} {:>12} {:<10} {:>11}  {}",
                    d.campaign_id,
                    ams(d.requested_at),
                    euros(d.planned_cents),
                    ams(d.planned_at),
                    d.platform_cents.map_or_else(|| "-".to_owned(), euros),
                    ams(d.platform_written_at),
                    left.unwrap_or_else(|| "-".to_owned()),
                    why.join("; ")
                );
            }
            if more > 0 {
                let _ = writeln!(out, "  ... and {more} more (every comparison is a row of media.shadow_comparisons)");
            }
        }
        out
    }
}
