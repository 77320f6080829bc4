//! # Durastep: durable step functions on the Postgres you already run
//!
//! Write operations logic as plain async Rust. A function is triggered by an
//! event; each [`Ctx::step`] result is checkpointed in `durastep.step_results`,
//! so a crash or a retry resumes after the last finished step. Sleeps last
//! seconds or months without holding a worker. Any number of workers, in any
//! number of processes, share the work through Postgres alone.
//!
//! ```no_run
//! use durastep::{Ctx, Engine, Event, Function, HandlerError};
//! use serde::{Deserialize, Serialize};
//! use std::time::Duration;
//! use tokio_util::sync::CancellationToken;
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
//!             let key = format!("{}:push", ctx.idempotency_key());
//!             // Runs once per run; a retry after a crash returns the stored result.
//!             let external_ref: String = ctx.step("push", || push_budget(&key, &req)).await?;
//!             ctx.sleep("settle", Duration::from_secs(60)).await?; // no worker held
//!             // Commits together with its checkpoint: exactly once.
//!             ctx.step_tx("log", |conn| Box::pin(async move {
//!                 sqlx::query("INSERT INTO budget_log (external_ref) VALUES ($1)")
//!                     .bind(&external_ref).execute(&mut *conn).await?;
//!                 Ok(())
//!             })).await?;
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
//!   Use [`Ctx::idempotency_key`] for the external APIs a step calls.
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
//! - **Waiting and signalling.** [`Ctx::wait_for_event`] suspends until a
//!   matching event ([`EventMatch`]) or a timeout; [`Ctx::send_event`] sends
//!   from a run, once; [`Ctx::invoke`] runs another function as a child and
//!   returns its output or a [`ChildError`].
//! - **Cancellation and timeouts.** [`Engine::cancel`] and
//!   [`FunctionBuilder::cancel_on`] cancel runs (a running one at its next step
//!   boundary); [`FunctionBuilder::start_timeout`] and
//!   [`FunctionBuilder::finish_timeout`] cancel runs that start or finish too late.
//! - **Workers.** [`Engine::run_worker`] claims due runs with `FOR UPDATE SKIP
//!   LOCKED`, holds each under a lease with a fencing epoch, and group-commits
//!   checkpoints; cancelling its token shuts it down gracefully.
//! - **Flow control.** [`FunctionBuilder::concurrency`] (per key, or shared by
//!   name with [`FunctionBuilder::concurrency_shared`]), [`FunctionBuilder::throttle`]
//!   (runs wait), [`FunctionBuilder::rate_limit`] (runs are skipped),
//!   [`FunctionBuilder::backpressure`] (a [`HandlerError::retry_after`] pauses the
//!   key), [`Event::priority`] and [`FunctionBuilder::priority_from`],
//!   [`FunctionBuilder::debounce`] and [`FunctionBuilder::singleton`]. Keys are
//!   JSON pointers into the event data; limits are enforced in the claim, so they
//!   hold across every worker. A parked run says why in [`Run::flow_wait`].
//! - **Encryption.** [`EngineBuilder::encryption`] with a [`Keyring`] seals step
//!   results and run outputs at rest.
//! - **Testing.** [`testing::advance_clock`] moves the database clock, so tests
//!   of sleeps and backoff need not wait.
//!
//! The repository's `docs/guide.md` walks through all of this; `docs/guarantees.md`
//! says exactly what is promised, and `docs/architecture.md` how it works.
//!
//! ## Foreign types in the API
//!
//! [`sqlx::PgPool`] and [`sqlx::PgConnection`] appear because Durastep runs on
//! your Postgres and `send_in`/`step_tx` join your transactions;
//! [`tokio_util::sync::CancellationToken`] is how a worker is told to shut down.
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

mod checkpoint;
mod codec;
mod ctx;
mod engine;
mod error;
mod event;
#[cfg(feature = "failpoints")]
pub mod failpoints;
mod failure;
pub mod flow;
mod function;
pub mod inspect;
pub mod limits;
pub mod metrics;
mod schedule;
mod store;
pub mod testing;
mod worker;

pub use codec::{CodecError, Keyring};
pub use ctx::{ChildError, Ctx, EventMatch, TxFuture};
pub use engine::{Engine, EngineBuilder, Run, RunState, migrate};
pub use error::Error;
pub use event::{Event, SendReceipt};
pub use failure::{HandlerError, HandlerResult};
pub use flow::{BACKPRESSURE_FREE_RETRIES, FlowWait, SingletonMode};
pub use function::{Backoff, FailedRun, Function, FunctionBuilder};
pub use inspect::{ReplayFrom, RunFilter};
pub use limits::{LimitError, Limits};
pub use schedule::{CatchUp, CronTick, Schedule, ScheduleError};
pub use worker::WorkerOptions;
