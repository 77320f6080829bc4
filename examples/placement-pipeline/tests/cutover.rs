//! Story A's cutover: "week 1 the queue fills but no handler fires (dry
//! run); then one handler live; then one more per day".

mod common;

use common::{SETTLE, change, outcome, run_of, stack};
use placement_pipeline::simulators::TrafficCounts;
use placement_pipeline::stack::StackConfig;
use placement_pipeline::{Outcome, SideEffect, Stage};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn dry_run_creates_the_runs_and_sends_nothing(_pool: PgPoolOptions, opts: PgConnectOptions) {
    let stack = stack(opts, StackConfig::default()).await;
    stack.settings.set_dry_run(true).await.expect("dry run on");
    let placed = change(8, Stage::Placement, "hooli");
    let receipt = stack.webhook(&placed).await.expect("delivery");
    assert_eq!(receipt.run_ids.len(), 6, "the queue fills as in live mode");
    stack.settle(SETTLE).await.expect("runs finish");

    let s = &stack.sims;
    let nothing = TrafficCounts { requests: 0, accepted: 0, rejected: 0 };
    for (system, counts) in [
        ("mail", s.mail.traffic().counts()),
        ("crm", s.crm.traffic().counts()),
        ("chat", s.chat.traffic().counts()),
        ("sheet", s.sheet.traffic().counts()),
        ("outreach", s.outreach.traffic().counts()),
        ("invoicing", s.invoicing.traffic().counts()),
    ] {
        assert_eq!(counts, nothing, "{system} received something in dry run");
    }
    // Each run records what it would have sent, with the token and the URL.
    let endpoints = s.endpoints();
    for side_effect in SideEffect::ALL {
        let run = run_of(&stack, &receipt.run_ids, side_effect.function_id()).await;
        let Outcome::DryRun { would_send } = outcome(&run) else { panic!("{side_effect}: {run:?}") };
        assert_eq!(would_send.idempotency_key, placed.dedupe_key(), "{side_effect}");
        let base = match side_effect {
            SideEffect::CandidateMail => &endpoints.mail,
            SideEffect::RecruiterTask => &endpoints.crm,
            SideEffect::ChannelPost => &endpoints.chat,
            SideEffect::SheetRow => &endpoints.sheet,
            SideEffect::OutreachStatus => &endpoints.outreach,
            SideEffect::DraftInvoice => &endpoints.invoicing,
        };
        assert!(would_send.url.starts_with(base.as_str()), "{side_effect}: {would_send:?}");
    }
    let post = outcome(&run_of(&stack, &receipt.run_ids, "post-to-channel").await);
    let Outcome::DryRun { would_send } = post else { panic!("{post:?}") };
    assert_eq!(would_send.body["channel"], "#client-hooli");

    // Going live is one flag, no deploy: the next stage change is sent.
    stack.settings.set_dry_run(false).await.expect("dry run off");
    let next = change(8, Stage::Renewal, "hooli");
    stack.webhook(&next).await.expect("delivery");
    stack.settle(SETTLE).await.expect("runs finish");
    assert_eq!((s.mail.sent_with(&next.dedupe_key()), s.mail.sent_with(&placed.dedupe_key())), (1, 0));
    stack.stop().await.expect("stop");
}

#[sqlx::test(migrations = false)]
async fn a_switched_off_side_effect_sends_nothing_while_the_others_do(_pool: PgPoolOptions, opts: PgConnectOptions) {
    let stack = stack(opts, StackConfig::default()).await;
    stack.settings.set_switch(SideEffect::ChannelPost, false).await.expect("switch off");
    let offer = change(9, Stage::Offer, "stark");
    let key = offer.dedupe_key();
    let receipt = stack.webhook(&offer).await.expect("delivery");
    assert_eq!(receipt.run_ids.len(), 5, "the run exists even while its switch is off");
    stack.settle(SETTLE).await.expect("runs finish");

    let s = &stack.sims;
    assert_eq!(s.chat.traffic().counts().requests, 0, "the switched-off side effect sent something");
    assert_eq!(
        (s.mail.sent_with(&key), s.crm.tasks(), s.sheet.rows_with(&key), s.outreach.traffic().counts().accepted),
        (1, 1, 1, 1),
        "the others went out"
    );
    let post = run_of(&stack, &receipt.run_ids, "post-to-channel").await;
    assert_eq!(outcome(&post), Outcome::SwitchedOff);

    // Switching it back on affects the runs that execute from then on; the
    // completed run stays as it was (documented in `settings`).
    stack.settings.set_switch(SideEffect::ChannelPost, true).await.expect("switch on");
    let next = change(9, Stage::Placement, "stark");
    stack.webhook(&next).await.expect("delivery");
    stack.settle(SETTLE).await.expect("runs finish");
    assert_eq!((s.chat.posted_with(&next.dedupe_key()), s.chat.posted_with(&key)), (1, 0));
    stack.stop().await.expect("stop");
}

#[sqlx::test(migrations = false)]
async fn a_switch_that_is_off_wins_over_dry_run_and_a_side_effect_without_a_row_is_on(
    _pool: PgPoolOptions,
    opts: PgConnectOptions,
) {
    use placement_pipeline::settings::{self, Mode, Settings};
    let pool = PgPoolOptions::new().max_connections(2).connect_with(opts).await.expect("pool");
    settings::migrate(&pool).await.expect("migrate");
    let s = Settings::new(pool);
    let check = async |expected: [Mode; 2]| {
        let got = [
            s.mode(SideEffect::ChannelPost).await.expect("mode"),
            s.mode(SideEffect::CandidateMail).await.expect("mode"),
        ];
        assert_eq!(got, expected);
    };
    check([Mode::Live, Mode::Live]).await;
    s.set_switch(SideEffect::ChannelPost, false).await.expect("switch");
    check([Mode::Off, Mode::Live]).await;
    s.set_dry_run(true).await.expect("dry run");
    check([Mode::Off, Mode::DryRun]).await;
    s.set_switch(SideEffect::ChannelPost, true).await.expect("switch");
    check([Mode::DryRun, Mode::DryRun]).await;
    assert!(s.switches().await.expect("switches").iter().all(|(_, on)| *on));
}
