//! Story B, LinkedIn: "a 429 at 21:30 resolves itself before 22:00; if retries
//! run out, one message goes to the on-call channel and the run stops (not
//! nine emails)"; 2 at once and at most 100 starts per minute per account.

mod common;

use durastep::RunState;
use media_buying::Platform;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn a_429_storm_at_2130_resolves_before_2200_without_paging(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    w.clock_to(common::friday_2130()).await;
    w.account(Platform::LinkedIn, "li_1").await;
    // Every write is refused for five minutes, with Retry-After up to 60 s.
    let storm_end = w.now().await + chrono::Duration::minutes(5);
    w.sims.linkedin.storm_until(Some(storm_end));
    let mut ids = Vec::new();
    for i in 0..6 {
        ids.push(w.request(Platform::LinkedIn, "li_1", &format!("li_camp_{i}"), 20_000 + i).await.1);
    }
    let worker = common::worker(&w.engine);
    let runs = w.drive(&ids).await;
    worker.stop().await;

    for run in &runs {
        assert_eq!(run.state, RunState::Completed, "{run:?}");
        // Back-pressure retries do not use up the 8 retries.
        assert_eq!(run.attempt, 1, "a 429 counted as an attempt: {run:?}");
        assert!(run.finished_at.unwrap() < common::friday_2130() + chrono::Duration::minutes(30), "{run:?}");
    }
    assert!(runs.iter().any(|r| r.last_error.as_deref().unwrap_or_default().contains("429")), "{runs:?}");
    let storm_429s = w.sims.linkedin.rate_limited();
    assert!(storm_429s >= 5, "the storm answered 429 for five minutes, {storm_429s} times");
    // Back-pressure pauses the account: not every run hammers LinkedIn in the storm.
    assert!(storm_429s < 6 * 5, "{storm_429s} 429s: the account was not paused");
    assert_eq!(w.sims.linkedin.writes().len(), 6, "every write landed once");
    assert!(w.sims.linkedin.writes().iter().all(|x| x.at >= storm_end));
    assert!(w.sims.linkedin.max_in_flight_per_account() <= 2);
    assert_eq!(w.on_call().await, Vec::<String>::new(), "nobody was paged");
}

#[sqlx::test(migrations = false)]
async fn retries_exhausted_send_exactly_one_on_call_message(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    w.account(Platform::LinkedIn, "li_2").await;
    w.sims.linkedin.set_outage("li_2", true);
    let (write_id, run_id) = w.request(Platform::LinkedIn, "li_2", "li_camp_x", 30_000).await;
    let worker = common::worker(&w.engine);
    let run = w.drive(&[run_id]).await.remove(0);
    assert_eq!(run.state, RunState::Failed, "{run:?}");
    assert_eq!(run.attempt, 9, "1 attempt and 8 retries");
    assert_eq!(w.sims.linkedin.writes_received(), 9);

    let handler = common::wait_for_failure_handler(&w, "linkedin-budget-update/on-failure").await;
    worker.stop().await;
    assert_eq!(handler.len(), 1, "one failure handler run for one failed run");
    let pages = w.on_call().await;
    assert_eq!(pages.len(), 1, "exactly one message, not one per attempt: {pages:?}");
    assert!(
        pages[0].contains("LinkedIn") && pages[0].contains("li_camp_x") && pages[0].contains("9 attempt"),
        "{}",
        pages[0]
    );
    let (status, _) = w.write_row(write_id).await;
    assert_eq!(status, "failed");
}

#[sqlx::test(migrations = false)]
async fn at_most_100_starts_per_minute_per_account_and_none_dropped(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    w.account(Platform::LinkedIn, "li_3").await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(w.request(Platform::LinkedIn, "li_3", &format!("li_camp_{i}"), 10_000).await.1);
    }
    let worker = common::worker(&w.engine);
    let runs = w.drive(&ids).await;
    worker.stop().await;
    assert!(runs.iter().all(|r| r.state == RunState::Completed), "a throttle waits, it never drops: {runs:?}");
    assert_eq!(w.sims.linkedin.writes().len(), 5);
    let starts: Vec<chrono::DateTime<chrono::Utc>> =
        sqlx::query_scalar("SELECT started_at FROM durastep.runs WHERE id = ANY($1) ORDER BY started_at")
            .bind(&ids)
            .fetch_all(&w.pool)
            .await
            .unwrap();
    for pair in starts.windows(2) {
        // 100 per minute: starts at least 600 ms apart (by the database clock).
        assert!(pair[1] - pair[0] >= chrono::Duration::milliseconds(599), "{:?}", pair[1] - pair[0]);
    }
}
