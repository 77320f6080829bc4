//! Story B, TikTok: the daily counter resets at midnight UTC; a bump is
//! pushed only after that reset (30 minutes after, see the decision in
//! `src/functions/tiktok.rs`), in winter and in summer, with time moved, not waited.

mod common;

use chrono::{Duration, TimeZone, Timelike, Utc};
use chrono_tz::Europe::Amsterdam;
use durastep::RunState;
use media_buying::Platform;
use media_buying::functions::next_tiktok_push;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[test]
fn the_push_time_is_after_the_utc_reset_in_both_seasons() {
    // Winter: 23:55 CET is 22:55 UTC; the push is 00:30 UTC = 01:30 CET (the story's time).
    let winter = Amsterdam.with_ymd_and_hms(2027, 1, 14, 23, 55, 0).unwrap();
    let push = next_tiktok_push(winter.with_timezone(&Utc)).unwrap();
    assert_eq!(push, Utc.with_ymd_and_hms(2027, 1, 15, 0, 30, 0).unwrap());
    assert_eq!(push.with_timezone(&Amsterdam).hour(), 1);
    // Summer: the literal "01:30 Amsterdam" would be 23:30 UTC, before the
    // reset; the push is 00:30 UTC = 02:30 CEST.
    let summer = Amsterdam.with_ymd_and_hms(2027, 7, 14, 23, 55, 0).unwrap();
    let push = next_tiktok_push(summer.with_timezone(&Utc)).unwrap();
    assert_eq!(push, Utc.with_ymd_and_hms(2027, 7, 15, 0, 30, 0).unwrap());
    assert_eq!(push.with_timezone(&Amsterdam).hour(), 2);
    // 00:10 UTC (just after a reset): the same day's 00:30.
    let after = Utc.with_ymd_and_hms(2027, 7, 15, 0, 10, 0).unwrap();
    assert_eq!(next_tiktok_push(after).unwrap(), Utc.with_ymd_and_hms(2027, 7, 15, 0, 30, 0).unwrap());
}

#[sqlx::test(migrations = false)]
async fn a_bump_at_2355_amsterdam_lands_after_midnight_utc_winter_and_summer(
    _p: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let w = common::world(opts).await;
    w.account(Platform::TikTok, "adv_1").await;
    let worker = common::worker(&w.engine);
    let year = common::next_year();
    for (month, local_push_hour) in [(1, 1), (7, 2)] {
        let asked = common::amsterdam(year, month, 14, 23, 55);
        let reset = Utc.with_ymd_and_hms(year, month, 15, 0, 0, 0).unwrap();
        w.clock_to(asked).await;
        let before = w.sims.tiktok.writes().len();
        let (write_id, run_id) = w.request(Platform::TikTok, "adv_1", &format!("tt_camp_{month}"), 40_000).await;

        let sleeping = w.reaches(run_id, RunState::Sleeping).await;
        assert_eq!(sleeping.run_at, reset + Duration::minutes(30), "month {month}");
        assert_eq!(sleeping.run_at.with_timezone(&Amsterdam).hour(), local_push_hour);
        assert_eq!(w.sims.tiktok.writes().len(), before, "nothing pushed before the reset");

        // Cross the night by moving the database clock (TikTok's clock with it).
        w.clock_to(sleeping.run_at + Duration::seconds(1)).await;
        let run = w.finished(run_id).await;
        assert_eq!(run.state, RunState::Completed, "{run:?}");
        let writes = w.sims.tiktok.writes();
        assert_eq!(writes.len(), before + 1);
        let push = writes.last().unwrap();
        assert!(push.at > reset, "month {month}: pushed at {}, before TikTok's reset at {reset}", push.at);
        assert_eq!(push.counter_reset_at, reset, "the push counts against the new day");
        assert_eq!(w.write_row(write_id).await.0, "pushed");
    }
    worker.stop().await;
}
