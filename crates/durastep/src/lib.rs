//! # Durastep: durable step functions on the Postgres you already run
//!
//! Write operations logic as plain async Rust. A function is triggered by an
//! event; each [`Ctx::step`] result is checkpointed in `durastep.step_results`,
//! so a crash or a retry resumes after the last finished step. Sleeps last
//! seconds or months without holding a worker. Any number of workers, in any
//! number of processes, share the work through Postgres alone.
//!
//! ```no_run
//! use durastep::{sqlx, CancellationToken, Ctx, Engine, Event, Function, HandlerError};
//! use serde::{Deserialize, Serialize};
//! use std::time::Duration;
//!
//! #[derive(Serialize, Deserialize)]
//! struct BudgetRequested { ad_account_id: String, campaign_id: String, daily_cents: u64 }
//!
//! # async fn push_budget(_key: &str, _r: &BudgetRequested) -> Result<String, HandlerError> { Ok("ref".into()) }
//! #[tokio::main]
//! async fn main() -> Result<(), durastep::Error> {
//!     let meta = Function::new("meta-budget-update")
//!         .on_event("campaign/budget.requested")
//!         .retries(5)
//!         .handler(|ctx: Ctx, req: BudgetRequested| async move {
//!             // Runs once per run; a retry after a crash returns the stored result.
//!             // `key` is this step's idempotency key for the external API.
//!             let external_ref: String = ctx.step_with_key("push", |key| async move { push_budget(&key, &req).await }).await?;
//!             ctx.sleep("settle", Duration::from_secs(60)).await?; // no worker held
//!             // Commits together with its checkpoint: exactly once.
//!             ctx.step_tx("log", async move |conn| {
//!                 sqlx::query("INSERT INTO budget_log (external_ref) VALUES ($1)")
//!                     .bind(&external_ref).execute(&mut *conn).await?;
//!                 Ok(())
//!             }).await?;
//!             Ok(())
//!         });
//!
//!     let engine = Engine::builder()
//!         .database_url("postgres://postgres@127.0.0.1/postgres")
//!         .function(meta)
//!         .build()
//!         .await?; // connects, migrates, registers functions
//!
//!     let request = BudgetRequested { ad_account_id: "act_1".into(), campaign_id: "c_9".into(), daily_cents: 50_00 };
//!     engine.send(Event::new("campaign/budget.requested", &request).idempotency_key("c_9:2026-11-29")).await?;
//!     engine.run_worker(CancellationToken::new()).await
//! }
//! ```
//!
//! ## Concepts
//!
//! - **Events and runs.** [`Engine::send`] stores an [`Event`] and creates one
//!   run per [`Function`] that it triggers. An idempotency key makes a repeated
//!   send a no-op; [`Engine::send_in`] sends inside your own transaction.
//! - **Steps.** [`Ctx::step`] runs a closure once per run and stores its
//!   output; [`Ctx::step_tx`] commits its database writes with its checkpoint.
//!   [`Ctx::step_with_key`] hands a step its own idempotency key for the
//!   external API it calls.
//!   A step that fails ends the attempt; its error is not returned to the handler.
//! - **Failures.** A step or handler returns [`HandlerError`] (or panics); the
//!   attempt ends and the run is retried with the function's [`Backoff`] (or
//!   after [`HandlerError::retry_after`]'s delay), and finished steps replay.
//!   After the last attempt, or at once for [`HandlerError::permanent`], the run
//!   is `failed` and its [`FunctionBuilder::on_failure`] handler runs once.
//! - **Sleep.** [`Ctx::sleep`] and [`Ctx::sleep_until`] suspend the run: no
//!   worker is held, and the database clock decides when it is due.
//! - **Schedules.** [`FunctionBuilder::on_cron`] runs a function on a cron
//!   [`Schedule`] in a time zone, one run per fire time (input [`CronTick`]),
//!   with a [`CatchUp`] policy; [`Event::start_at`] delays an event's runs.
//! - **Waiting and signalling.** [`Ctx::wait_for_event`] suspends until the
//!   event a [`WaitFor`] describes ([`EventMatch`]) or its timeout;
//!   [`Ctx::send_event`] sends from a run, once; [`Ctx::invoke`] runs another
//!   function as a child ([`Invoke`]) and returns its output or a [`ChildError`].
//! - **Cancellation and timeouts.** [`Engine::cancel`] and
//!   [`FunctionBuilder::cancel_on`] ([`CancelOn`]) cancel runs (a running one at its next step
//!   boundary); [`FunctionBuilder::start_timeout`] and
//!   [`FunctionBuilder::finish_timeout`] cancel runs that start or finish too late.
//! - **Workers.** [`Engine::run_worker`] claims due runs with `FOR UPDATE SKIP
//!   LOCKED`, holds each under a lease with a fencing epoch, and group-commits
//!   checkpoints; cancelling its token shuts it down gracefully.
//! - **Flow control.** Rules are named values: [`Concurrency`] (per key, or
//!   shared by name), [`Throttle`] (runs wait), [`RateLimit`] (runs are
//!   skipped), [`Backpressure`] (a [`HandlerError::retry_after`] pauses the
//!   key), [`Debounce`] and [`Singleton`], given to the [`FunctionBuilder`]
//!   methods of the same names; also [`Event::priority`] and
//!   [`FunctionBuilder::priority_from`]. Keys (`.key("/account_id")`) are
//!   JSON pointers into the event data; limits are enforced in the claim, so they
//!   hold across every worker. What holds a run (a flow rule, a sleep, a
//!   wait, a backoff) has one answer: [`inspect::Inspector::why`].
//! - **Encryption.** [`EngineBuilder::encryption`] with a [`Keyring`] seals step
//!   results and run outputs at rest.
//! - **Safe deploys.** Each run records what its handler asked for, in order;
//!   a replay that asks for something else stops with a [`Divergence`] and the
//!   run is parked [`RunState::Diverged`]. [`Ctx::changed`] branches new code
//!   from old runs; [`Engine::check_deploy`] replays every run in flight
//!   against a new build, writing nothing, before you deploy it.
//! - **Testing.** With the `testing` feature, `testing::advance_clock` moves
//!   the database clock (tests of sleeps and backoff need not wait), and
//!   `testing::TestEngine` runs functions on a fresh database, crashes them at
//!   every checkpoint and injects step failures.
//!
//! The repository's `docs/guide.md` walks through all of this; `docs/guarantees.md`
//! says exactly what is promised, and `docs/architecture.md` how it works.
//!
//! ## Foreign types in the API
//!
//! [`sqlx::PgPool`] and [`sqlx::PgConnection`] appear because Durastep runs on
//! your Postgres and `send_in`/`step_tx` join your transactions (the crate
//! re-exports [`sqlx`], so your queries use the same version);
//! [`CancellationToken`] (re-exported from `tokio-util`) is how a worker is
//! told to shut down.
//! The crate installs no tracing subscriber: its spans carry the run id,
//! function, attempt and step, and your application decides where they go.
//! Nor does it install a metrics recorder: the worker records through the
//! `metrics` facade (names in [`metrics`]), a no-op until your application
//! installs one.

/// `failpoint!("name")`, or `failpoint!("name", expr)` to `return expr` on the
/// `error` action. Expands to nothing without the `failpoints` feature.
macro_rules! failpoint {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        {
            let _ = $crate::failpoints::eval($name).await;
        }
    };
    ($name:literal, $on_error:expr) => {
        #[cfg(feature = "failpoints")]
        {
            if $crate::failpoints::eval($name).await {
                return $on_error;
            }
        }
    };
}

pub(crate) use failpoint;

/// `failpoint_fires!("name")`: evaluates the failpoint (exit, panic, pause and
/// block act at once) and is `true` when its action is `error`; always
/// `false` without the `failpoints` feature. For call sites that must do more
/// than `return` on the error action (an acknowledgement lost after a commit).
macro_rules! failpoint_fires {
    ($name:literal) => {{
        #[cfg(feature = "failpoints")]
        let fires = $crate::failpoints::eval($name).await;
        #[cfg(not(feature = "failpoints"))]
        let fires = false;
        fires
    }};
}

pub(crate) use failpoint_fires;

mod checkpoint;
mod claim_records;
mod codec;
mod ctx;
mod deploy;
mod engine;
mod error;
mod event;
#[cfg(feature = "failpoints")]
pub mod failpoints;
mod failure;
pub mod flow;
mod function;
mod handoff;
pub mod inspect;
mod journal;
mod kept;
pub mod limits;
pub mod metrics;
mod offers;
#[cfg(feature = "testing")]
mod probe;
mod run;
mod schedule;
mod shared;
mod store;
mod supervise;
#[cfg(feature = "testing")]
pub mod testing;
mod worker;
mod worker_handle;
mod worker_options;

pub use codec::{CodecError, Keyring};
pub use ctx::{ChildError, Ctx, EventMatch, Invoke, StepOptions, TxBody, TxFuture, WaitFor};
pub use deploy::{DeployReport, DivergenceGroup, ReplayProblem, UnhandledVersion};
pub use engine::{AppliedMigration, Engine, EngineBuilder, IDLE_PING_AFTER, migrate, pool_options};
pub use error::Error;
pub use event::{Event, SendReceipt};
pub use failure::{HandlerError, HandlerResult};
pub use flow::{
    BACKPRESSURE_FREE_RETRIES, Backpressure, Concurrency, DEFAULT_PRIORITY_RANGE, Debounce, RateLimit, Singleton,
    SingletonMode, Throttle,
};
pub use function::{Backoff, CancelOn, DEFAULT_LEASE_LOSSES, FailedRun, Function, FunctionBuilder};
pub use inspect::{ReplayFrom, RunFilter};
pub use journal::{Divergence, EntryKind, JournalEntry, UnknownEntryKind};
pub use limits::{LimitError, Limits};
pub use run::{ParseRunStateError, Run, RunState};
pub use schedule::{CatchUp, CronTick, Schedule, ScheduleError};
pub use worker_handle::WorkerHandle;
pub use worker_options::WorkerOptions;

/// The sqlx version Durastep is built on: use it for [`Engine::send_in`],
/// [`Ctx::step_tx`] and your own queries, so the types match.
pub use sqlx;
/// How a worker is told to shut down ([`Engine::run_worker`]).
pub use tokio_util::sync::CancellationToken;
