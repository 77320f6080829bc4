//! Cron triggers: one run per fire time however many workers tick, Amsterdam's
//! daylight-saving gap and overlap, catch-up after every worker was down, and
//! Story B's TikTok wait (the next 01:30 Amsterdam is before UTC midnight in
//! summer). Time is moved on the database clock, never waited for.
mod common;

use std::time::Duration;

use chrono::{DateTime, Datelike, NaiveDate, TimeZone, Utc};
use chrono_tz::Europe::Amsterdam;
use durastep::{CatchUp, CronTick, Ctx, Engine, Function, RunState, Schedule};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

fn utc(y: i32, mo: u32, d: u32, h: u32, mi: u32, s: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(y, mo, d, h, mi, s).unwrap()
}

/// The year the tests move the clock into: the next one, so that every date
/// in it is ahead of the database clock whenever the tests run (a fixed year
/// would make them fail once it has passed). Read once per run, so that a
/// run across New Year's midnight does not mix two years in one test.
fn year() -> i32 {
    static YEAR: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *YEAR.get_or_init(|| Utc::now().year() + 1)
}

/// The day of the month of the last Sunday of `month` in `year`: when
/// Amsterdam moves its clocks (March forward, October back), at 01:00 UTC.
fn last_sunday(year: i32, month: u32) -> u32 {
    let first_of_next = NaiveDate::from_ymd_opt(year, month + 1, 1).unwrap();
    let last = first_of_next.pred_opt().unwrap();
    last.day() - last.weekday().num_days_from_sunday()
}

/// Moves the database clock forward to `at`.
async fn clock_to(engine: &Engine, at: DateTime<Utc>) {
    let now = durastep::testing::db_now(engine).await.unwrap();
    let by = (at - now).to_std().expect("the target time is ahead of the database clock");
    durastep::testing::advance_clock(engine, by).await.unwrap();
}

/// A function that records the fire time it was started for.
fn cron_fn(id: &str, expr: &str, tz: chrono_tz::Tz, catch_up: CatchUp) -> Function {
    Function::new(id)
        .on_cron(expr, tz)
        .catch_up(catch_up)
        .handler(|_ctx: Ctx, tick: CronTick| async move { Ok(tick.scheduled_at) })
}

/// The scheduled times of a function's runs, in order, straight from the tables.
async fn fired(engine: &Engine, function_id: &str) -> Vec<DateTime<Utc>> {
    let rows: Vec<String> = sqlx::query_scalar(
        "SELECT e.payload->>'scheduled_at' FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id
          WHERE r.function_id = $1 ORDER BY 1",
    )
    .bind(function_id)
    .fetch_all(engine.pool())
    .await
    .unwrap();
    rows.iter().map(|s| s.parse().unwrap()).collect()
}

/// Waits until every worker has ticked the schedule at the current database
/// time (its next fire time is in the future again).
async fn ticked(engine: &Engine, function_id: &str) {
    let (e, f) = (engine.clone(), function_id.to_owned());
    common::wait_until("the schedule to be ticked", move || {
        let (e, f) = (e.clone(), f.clone());
        async move {
            sqlx::query_scalar::<_, bool>(
                "SELECT coalesce(last_tick_at IS NOT NULL AND next_fire_at > durastep.now(), false)
                   FROM durastep.schedules WHERE function_id = $1",
            )
            .bind(&f)
            .fetch_one(e.pool())
            .await
            .unwrap()
        }
    })
    .await;
}

async fn next_fire(engine: &Engine, function_id: &str) -> DateTime<Utc> {
    sqlx::query_scalar("SELECT next_fire_at FROM durastep.schedules WHERE function_id = $1")
        .bind(function_id)
        .fetch_one(engine.pool())
        .await
        .unwrap()
}

/// Spring forward (the last Sunday of March, Amsterdam skips 02:00-03:00
/// CET): `30 2 * * *` fires once, at the first instant after the gap, 03:00
/// CEST = 01:00 UTC, not a second before; it does not fire again that day.
#[sqlx::test(migrations = false)]
async fn cron_0230_amsterdam_on_the_spring_forward_day(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let y = year();
    let d = last_sunday(y, 3);
    let engine = common::engine(&opts, vec![cron_fn("daily", "30 2 * * *", Amsterdam, CatchUp::Latest)]).await;
    clock_to(&engine, utc(y, 3, d - 1, 22, 0, 0)).await;
    let w = common::spawn_worker(&engine);
    ticked(&engine, "daily").await;
    assert_eq!(next_fire(&engine, "daily").await, utc(y, 3, d, 1, 0, 0));
    clock_to(&engine, utc(y, 3, d, 0, 59, 59)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(fired(&engine, "daily").await.is_empty(), "fired before the gap's end");
    clock_to(&engine, utc(y, 3, d, 1, 0, 1)).await;
    ticked(&engine, "daily").await;
    assert_eq!(fired(&engine, "daily").await, vec![utc(y, 3, d, 1, 0, 0)]);
    clock_to(&engine, utc(y, 3, d, 12, 0, 0)).await;
    ticked(&engine, "daily").await;
    let runs = common::runs_of(&engine, "daily").await;
    assert_eq!(runs.len(), 1);
    let run = common::finished(&engine, runs[0]).await;
    w.stop().await;
    assert_eq!(run.state, RunState::Completed);
    assert_eq!(run.output, Some(serde_json::json!(utc(y, 3, d, 1, 0, 0))), "the input carries the fire time");
    assert_eq!(
        next_fire(&engine, "daily").await,
        utc(y, 3, d, 0, 30, 0) + chrono::Duration::days(1),
        "back to 02:30 CEST"
    );
}

/// Fall back (the last Sunday of October, 02:00-03:00 happens twice): `30 2 *
/// * *` fires once, at the earlier 02:30 (CEST, 00:30 UTC), and not again at
/// 02:30 CET (01:30 UTC).
#[sqlx::test(migrations = false)]
async fn cron_0230_amsterdam_on_the_fall_back_day(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let y = year();
    let d = last_sunday(y, 10);
    // The day after may be in November.
    let after = utc(y, 10, d, 1, 30, 0) + chrono::Duration::days(1);
    let engine = common::engine(&opts, vec![cron_fn("daily", "30 2 * * *", Amsterdam, CatchUp::Latest)]).await;
    clock_to(&engine, utc(y, 10, d - 1, 21, 0, 0)).await;
    let w = common::spawn_worker(&engine);
    ticked(&engine, "daily").await;
    assert_eq!(next_fire(&engine, "daily").await, utc(y, 10, d, 0, 30, 0));
    clock_to(&engine, utc(y, 10, d, 0, 30, 1)).await;
    ticked(&engine, "daily").await;
    assert_eq!(fired(&engine, "daily").await, vec![utc(y, 10, d, 0, 30, 0)]);
    clock_to(&engine, utc(y, 10, d, 1, 30, 1)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    ticked(&engine, "daily").await;
    w.stop().await;
    assert_eq!(fired(&engine, "daily").await, vec![utc(y, 10, d, 0, 30, 0)], "fired on both passes of 02:30");
    assert_eq!(next_fire(&engine, "daily").await, after, "02:30 CET from now on");
}

/// Six engines, each with its own worker, tick one every-minute schedule at
/// once (poll interval 50 ms). Over 5 single-minute steps and one 3-minute
/// jump (catch-up: each, up to 10), every fire time has exactly one run and
/// none is missed. Catches: a check-then-insert race between workers, a
/// fire time lost between two ticks.
#[sqlx::test(migrations = false)]
async fn six_workers_create_one_run_per_fire_time(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let make = || cron_fn("every-minute", "* * * * *", chrono_tz::UTC, CatchUp::Each { max: 10 });
    let mut engines = Vec::new();
    for _ in 0..6 {
        let pool = PgPoolOptions::new().max_connections(3).connect_with(opts.clone()).await.unwrap();
        let e =
            Engine::builder().pool(pool).worker_options(common::fast_options()).function(make()).build().await.unwrap();
        engines.push(e);
    }
    let engine = engines[0].clone();
    let start = durastep::testing::db_now(&engine).await.unwrap();
    // Start on a minute boundary plus 10 s, so each step crosses exactly one fire time.
    let base = Utc.timestamp_opt(start.timestamp() - start.timestamp() % 60 + 70, 0).unwrap();
    clock_to(&engine, base).await;
    let workers: Vec<_> = engines.iter().map(common::spawn_worker).collect();
    ticked(&engine, "every-minute").await;
    let mut expected = Vec::new();
    for minute in 1..=5 {
        clock_to(&engine, base + chrono::Duration::minutes(minute)).await;
        expected.push(base - chrono::Duration::seconds(10) + chrono::Duration::minutes(minute));
        ticked(&engine, "every-minute").await;
    }
    clock_to(&engine, base + chrono::Duration::minutes(8)).await;
    for minute in 6..=8 {
        expected.push(base - chrono::Duration::seconds(10) + chrono::Duration::minutes(minute));
    }
    ticked(&engine, "every-minute").await;
    for w in workers {
        w.stop().await;
    }
    assert_eq!(fired(&engine, "every-minute").await, expected, "one run per fire time");
    let per_time: i64 = sqlx::query_scalar(
        "SELECT max(n) FROM (SELECT count(*) AS n FROM durastep.runs r JOIN durastep.events e ON e.id = r.event_id
          WHERE r.function_id = 'every-minute' GROUP BY e.payload->>'scheduled_at') t",
    )
    .fetch_one(engine.pool())
    .await
    .unwrap();
    assert_eq!(per_time, 1);
}

/// Every worker down for 5 hours and 10 minutes: on restart, `CatchUp::Latest`
/// runs only the latest missed hour, `CatchUp::Each { max: 3 }` the latest
/// three; nothing fires for the hours before the schedule was armed.
#[sqlx::test(migrations = false)]
async fn missed_fire_times_follow_the_catch_up_policy(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let y = year();
    let engine = common::engine(
        &opts,
        vec![
            cron_fn("latest", "0 * * * *", chrono_tz::UTC, CatchUp::Latest),
            cron_fn("each", "0 * * * *", chrono_tz::UTC, CatchUp::Each { max: 3 }),
        ],
    )
    .await;
    clock_to(&engine, utc(y, 6, 1, 9, 30, 0)).await;
    let w = common::spawn_worker(&engine);
    ticked(&engine, "latest").await;
    ticked(&engine, "each").await;
    w.stop().await;
    clock_to(&engine, utc(y, 6, 1, 14, 40, 0)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(fired(&engine, "latest").await.is_empty(), "fired with no worker up");
    let w = common::spawn_worker(&engine);
    ticked(&engine, "latest").await;
    ticked(&engine, "each").await;
    w.stop().await;
    assert_eq!(fired(&engine, "latest").await, vec![utc(y, 6, 1, 14, 0, 0)]);
    assert_eq!(
        fired(&engine, "each").await,
        vec![utc(y, 6, 1, 12, 0, 0), utc(y, 6, 1, 13, 0, 0), utc(y, 6, 1, 14, 0, 0)]
    );
}

/// An expression that does not parse is refused at build, naming it.
#[sqlx::test(migrations = false)]
async fn invalid_cron_expression_is_refused(_p: PgPoolOptions, opts: PgConnectOptions) {
    let f = cron_fn("bad", "0 25 * * *", chrono_tz::UTC, CatchUp::Latest);
    let err = common::try_engine(&opts, vec![f], common::fast_options(), Default::default()).await.unwrap_err();
    assert!(matches!(err, durastep::Error::InvalidFunction(ref m) if m.contains("0 25 * * *")), "{err:?}");
}

/// Story B: a bump pushed at 23:55 Amsterdam waits for TikTok's reset at
/// midnight UTC. The next 01:30 Amsterdam after 23:55 local is 00:30 UTC on a
/// winter day (after the reset) but 23:30 UTC on a summer day: half an hour
/// BEFORE the reset, so the story's literal rule would burn the budget again
/// in summer. Sleeping until the next `30 0 * * *` UTC (30 minutes after the
/// reset, all year) wakes after UTC midnight on both days. The runs sleep (no
/// worker held) and wake at exactly those instants.
#[sqlx::test(migrations = false)]
async fn story_b_tiktok_push_wakes_after_utc_midnight(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let literal = Schedule::new("30 1 * * *", Amsterdam).unwrap();
    let y = year();
    let winter = Amsterdam.with_ymd_and_hms(y, 1, 14, 23, 55, 0).unwrap();
    let summer = Amsterdam.with_ymd_and_hms(y, 7, 14, 23, 55, 0).unwrap();
    assert_eq!(literal.next_after(winter), Some(utc(y, 1, 15, 0, 30, 0)), "winter: after the reset");
    assert_eq!(literal.next_after(summer), Some(utc(y, 7, 14, 23, 30, 0)), "summer: 30 min BEFORE the reset");

    let f = Function::new("tiktok-bump").on_event("bump").handler(|ctx: Ctx, _: ()| async move {
        let after_reset = Schedule::new("30 0 * * *", chrono_tz::UTC)
            .map_err(|e| durastep::HandlerError::permanent(e.to_string()))?;
        let wake = after_reset.next_after(ctx.db_time()).expect("a next fire time");
        ctx.sleep_until("until-after-reset", wake).await?;
        let pushed_at = ctx.db_time();
        ctx.step("push", || async move { Ok(pushed_at) }).await
    });
    let engine = common::engine(&opts, vec![f]).await;
    let w = common::spawn_worker(&engine);
    for (day, reset) in [(winter, utc(y, 1, 15, 0, 0, 0)), (summer, utc(y, 7, 15, 0, 0, 0))] {
        clock_to(&engine, day.with_timezone(&Utc)).await;
        let id = engine.send(durastep::Event::new("bump", &())).await.unwrap().run_ids[0];
        let run = common::wait_for_run_where(&engine, id, "sleeping", |r| r.state == RunState::Sleeping).await;
        assert_eq!(run.run_at, reset + chrono::Duration::minutes(30), "{day}");
        clock_to(&engine, reset + chrono::Duration::minutes(30) + chrono::Duration::seconds(1)).await;
        let run = common::finished(&engine, id).await;
        let pushed: DateTime<Utc> = serde_json::from_value(run.output.unwrap()).unwrap();
        assert!(pushed > reset, "{day}: pushed at {pushed}, before TikTok's reset at {reset}");
    }
    w.stop().await;
}

/// Uniqueness does not rest on the tick's row lock alone: a tick that covers
/// fire times already fired (the schedule's bookkeeping rewound by two hours,
/// as if two ticks had computed the same window) sends them again, and they
/// are duplicates (the idempotency key is the fire time): no second run.
#[sqlx::test(migrations = false)]
async fn a_repeated_tick_creates_no_second_run(_p: PgPoolOptions, opts: PgConnectOptions) {
    common::init_logs();
    let y = year();
    let engine =
        common::engine(&opts, vec![cron_fn("hourly", "0 * * * *", chrono_tz::UTC, CatchUp::Each { max: 5 })]).await;
    clock_to(&engine, utc(y, 6, 1, 9, 30, 0)).await;
    let w = common::spawn_worker(&engine);
    ticked(&engine, "hourly").await;
    clock_to(&engine, utc(y, 6, 1, 11, 30, 0)).await;
    ticked(&engine, "hourly").await;
    assert_eq!(fired(&engine, "hourly").await, vec![utc(y, 6, 1, 10, 0, 0), utc(y, 6, 1, 11, 0, 0)]);
    sqlx::query(
        "UPDATE durastep.schedules SET last_tick_at = last_tick_at - interval '2 hours', next_fire_at = NULL
          WHERE function_id = 'hourly'",
    )
    .execute(engine.pool())
    .await
    .unwrap();
    ticked(&engine, "hourly").await;
    w.stop().await;
    assert_eq!(fired(&engine, "hourly").await, vec![utc(y, 6, 1, 10, 0, 0), utc(y, 6, 1, 11, 0, 0)]);
    assert_eq!(common::count(&engine, "durastep.events WHERE name = 'durastep/cron:hourly'").await, 2);
}
