//! Story A's one incident: "a typo in a Slack channel name: 5 failures,
//! dead, fixed and re-run in 3 minutes".

mod common;

use std::time::Duration;

use common::{SETTLE, change, run_of, stack};
use durastep::RunState;
use placement_pipeline::side_effects::rerun_dead;
use placement_pipeline::stack::StackConfig;
use placement_pipeline::{SideEffect, Stage};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};

#[sqlx::test(migrations = false)]
async fn a_channel_typo_fails_five_times_lands_dead_and_after_the_fix_one_rerun_posts_once(
    _pool: PgPoolOptions,
    opts: PgConnectOptions,
) {
    let mut config = StackConfig::default();
    config.chat_channels.push("#client-initech".into());
    config.channel_config.push(("initech".into(), "#client-intiech".into()));
    let stack = stack(opts, config).await;
    let intro = change(77, Stage::IntroCall, "initech");
    let key = intro.dedupe_key();
    let receipt = stack.webhook(&intro).await.expect("delivery");
    stack.settle(SETTLE).await.expect("runs finish");

    let post = run_of(&stack, &receipt.run_ids, "post-to-channel").await;
    assert_eq!((post.state, post.attempt), (RunState::Failed, 5), "{post:?}");
    assert!(post.last_error.as_deref().is_some_and(|e| e.contains("channel_not_found")), "{post:?}");
    let chat = &stack.sims.chat;
    assert_eq!(chat.traffic().counts().rejected, 5, "5 failed attempts");
    assert_eq!(chat.traffic().counts().accepted, 0);
    // The story's backoff between them: 30 s + 2 min + 4.5 min + 8 min = 900 s
    // (the clock was moved by what real time had not covered).
    assert!(stack.clock_moved().0 >= Duration::from_secs(880), "{:?}", stack.clock_moved());
    // The other side effects of the same stage change are independent runs.
    for side_effect in
        SideEffect::ALL.into_iter().filter(|e| !matches!(e, SideEffect::ChannelPost | SideEffect::DraftInvoice))
    {
        assert_eq!(run_of(&stack, &receipt.run_ids, side_effect.function_id()).await.state, RunState::Completed);
    }
    assert_eq!(stack.sims.mail.sent_with(&key), 1);

    // The fix: the channel configuration, not the code; then one command.
    stack.settings.set_channel("initech", "#client-initech").await.expect("fix the channel");
    let queued = rerun_dead(&stack.engine, SideEffect::ChannelPost).await.expect("rerun");
    assert_eq!(queued, vec![post.id], "exactly the dead run is queued again");
    stack.settle(SETTLE).await.expect("the re-run finishes");

    let post = run_of(&stack, &receipt.run_ids, "post-to-channel").await;
    assert_eq!(post.state, RunState::Completed, "{post:?}");
    assert_eq!(chat.posts_in("#client-initech").len(), 1, "exactly one post, in the right channel");
    assert_eq!(chat.posted_with(&key), 1);
    assert_eq!(chat.traffic().counts().rejected, 5, "no further failure");
    // Nothing else ran again: the other side effects still went out once.
    assert_eq!(stack.sims.mail.sent_with(&key), 1);
    assert_eq!(stack.sims.crm.duplicates(), 0);
    // A second rerun finds nothing dead.
    assert!(rerun_dead(&stack.engine, SideEffect::ChannelPost).await.expect("rerun").is_empty());
    stack.stop().await.expect("stop");
}
