//! Story B: "Saturday 06:00: one summary message: writes queued, pushed,
//! retried, still open", and the founder's view: "budget writes grouped by
//! platform and status, every write not pushed on its own row with the
//! original request and the latest retry error".

mod common;

use chrono::{Datelike, Duration, Timelike, Weekday};
use chrono_tz::Europe::Amsterdam;
use durastep::{RunState, Schedule};
use media_buying::functions::SUMMARY_CRON;
use media_buying::{Platform, founder};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn saturday_summary_and_the_founders_view(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    w.account(Platform::Meta, "act_1").await;
    w.account(Platform::LinkedIn, "li_1").await;
    w.sims.meta.set_bursts(1_000, 1); // the first Meta write is retried once
    w.sims.linkedin.archive("li_archived");
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(w.request(Platform::Meta, "act_1", &format!("c{i}"), 1_000).await.1);
    }
    let (failed_write, failed_run) = w.request(Platform::LinkedIn, "li_1", "li_archived", 4_200).await;
    ids.push(failed_run);
    let worker = common::worker(&w.engine);
    w.armed("saturday-summary").await;
    let runs = w.drive(&ids).await;
    assert_eq!(runs.iter().filter(|r| r.state == RunState::Completed).count(), 3);
    assert_eq!(w.run(failed_run).await.state, RunState::Failed);

    // The founder's view, while the failed write is open.
    let view = founder::load(&w.pool).await.unwrap();
    let cells: Vec<_> = view.by_status.iter().map(|c| (c.platform.as_str(), c.status.as_str(), c.writes)).collect();
    assert_eq!(cells, [("linkedin", "failed", 1), ("meta", "pushed", 3)]);
    assert_eq!(view.open.len(), 1);
    let open = &view.open[0];
    assert_eq!((open.id, open.campaign_id.as_str(), open.amount_cents), (failed_write, "li_archived", 4_200));
    assert!(open.latest_error.as_deref().unwrap_or_default().contains("ARCHIVED"), "{open:?}");
    let table = view.render();
    assert!(table.contains("li_archived") && table.contains("ARCHIVED") && table.contains("EUR 42.00"), "{table}");
    assert!(view.load_time < std::time::Duration::from_secs(1));

    // Saturday 06:00 Amsterdam, by the database clock.
    let saturday = Schedule::new(SUMMARY_CRON, Amsterdam).unwrap().next_after(w.now().await).unwrap();
    let local = saturday.with_timezone(&Amsterdam);
    assert_eq!((local.weekday(), local.hour()), (Weekday::Sat, 6));
    w.clock_to(saturday + Duration::seconds(1)).await;
    common::wait_until("the summary", || async {
        w.on_call().await.iter().any(|m| m.starts_with("Budget writes, week to"))
    })
    .await;
    let summary = w.runs_of("saturday-summary").await;
    w.drive(&summary).await;
    worker.stop().await;
    let messages: Vec<String> = w.on_call().await.into_iter().filter(|m| m.starts_with("Budget writes")).collect();
    assert_eq!(messages.len(), 1, "{messages:?}");
    assert!(messages[0].contains("4 queued, 3 pushed, 1 retried, 1 still open (1 failed"), "{}", messages[0]);
}
