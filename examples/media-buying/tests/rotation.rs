//! Story B: "Meta system-user token rotation: a scheduled function on the
//! first Monday of each quarter; the rotation is itself durable, so a
//! half-done rotation never leaves a mix of old and new credentials."

mod common;

use chrono::{Datelike, Duration, TimeZone, Timelike, Utc, Weekday};
use chrono_tz::Europe::Amsterdam;
use durastep::{RunState, Schedule};
use media_buying::functions::ROTATION_CRON;
use media_buying::{Platform, store};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[test]
fn the_rotation_fires_on_the_first_monday_of_each_quarter_at_0900_amsterdam() {
    let schedule = Schedule::new(ROTATION_CRON, Amsterdam).unwrap();
    let mut at = Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap();
    let mut fires = Vec::new();
    for _ in 0..4 {
        at = schedule.next_after(at).unwrap();
        let local = at.with_timezone(&Amsterdam);
        assert_eq!((local.weekday(), local.hour(), local.minute()), (Weekday::Mon, 9, 0));
        assert!(local.day() <= 7, "the first Monday: {local}");
        fires.push(local.date_naive().to_string());
    }
    assert_eq!(fires, ["2027-01-04", "2027-04-05", "2027-07-05", "2027-10-04"]);
}

#[sqlx::test(migrations = false)]
async fn a_half_done_rotation_never_mixes_old_and_new_tokens(_p: PgPoolOptions, opts: PgConnectOptions) {
    let w = common::world(opts).await;
    let far = w.now().await + Duration::days(365);
    let accounts = ["act_1", "act_2", "act_3", "act_4"];
    let mut old = Vec::new();
    for a in accounts {
        old.push(w.account_expiring(Platform::Meta, a, far, far).await);
    }
    // Meta fails to issue act_3's new token: the rotation stops half-way.
    w.sims.meta.fail_token_issue("act_3", true);
    let worker = common::worker(&w.engine);
    w.armed("meta-token-rotation").await;
    let fire = Schedule::new(ROTATION_CRON, Amsterdam).unwrap().next_after(w.now().await).unwrap();
    w.clock_to(fire + Duration::seconds(1)).await;

    common::wait_until("the rotation's first attempt failed", || async {
        !w.runs_of("meta-token-rotation").await.is_empty()
            && w.run(w.runs_of("meta-token-rotation").await[0]).await.last_error.is_some()
    })
    .await;
    let run_id = w.runs_of("meta-token-rotation").await[0];
    assert_eq!(w.sims.meta.tokens_issued("act_1"), 1, "act_1's new token was issued (staged)");
    assert_eq!(w.sims.meta.tokens_issued("act_2"), 1);
    let now: Vec<String> =
        store::tokens(&w.pool, Platform::Meta).await.unwrap().into_iter().map(|t| t.access_token).collect();
    assert_eq!(now, old, "half-way, every account still has its old token: none is switched alone");
    for t in &old {
        assert!(w.sims.meta.accepts(t).await, "the old tokens still work");
    }

    // Meta recovers; the retry finishes the rotation.
    w.sims.meta.fail_token_issue("act_3", false);
    let run = w.drive(&[run_id]).await.remove(0);
    worker.stop().await;
    assert_eq!(run.state, RunState::Completed, "{run:?}");
    assert!(run.attempt >= 2);
    let rows = store::tokens(&w.pool, Platform::Meta).await.unwrap();
    for (row, old) in rows.iter().zip(&old) {
        assert_ne!(&row.access_token, old, "{} rotated", row.account_id);
        assert!(w.sims.meta.accepts(&row.access_token).await);
        assert!(!w.sims.meta.accepts(old).await, "{old} revoked after the switch");
        assert!(row.rotated_at.is_some());
        // Issued once: the staged tokens of act_1 and act_2 were replayed, not re-issued.
        assert_eq!(w.sims.meta.tokens_issued(&row.account_id), 1, "{}", row.account_id);
    }
    let rotated: Vec<_> = rows.iter().map(|r| r.rotated_at).collect();
    assert!(rotated.windows(2).all(|p| p[0] == p[1]), "switched in one transaction: {rotated:?}");
}
