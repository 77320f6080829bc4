//! # Story A: the placement pipeline
//!
//! Run with: `cargo run -p placement-pipeline` (the demo; see the README).
//!
//! A recruiting agency replaced 14 CRM workflows with one webhook receiver
//! and one job per side effect. Here the jobs are Durastep functions:
//!
//! - [`receiver`]: `POST /webhooks/stage-changed` turns one CRM stage change
//!   into one Durastep event with the idempotency key
//!   `contact_id:stage:iso_week` ([`StageChange::dedupe_key`]); the engine
//!   creates one run per side effect. A re-fired webhook creates nothing.
//! - [`side_effects`]: the six functions (candidate mail, recruiter task,
//!   channel post, sheet row, outreach status, and on `placement` a draft
//!   invoice), each sending the dedupe key as its idempotency token, with the
//!   story's retry policy; the invoicing ones share a concurrency limit of 1.
//! - [`settings`]: the cutover switches (dry run, one on/off switch per side
//!   effect) and the chat channel of each client account, in the example's
//!   own tables.
//! - [`simulators`]: the six external systems, with their failure modes.
//! - [`stack`]: all of it in one process, for the demo and the tests;
//!   [`burst`]: the Monday-morning burst; [`cli`]: the command line.

pub mod burst;
pub mod cli;
pub mod clock;
pub mod database;
pub mod figures;
pub mod http;
pub mod receiver;
pub mod settings;
pub mod side_effects;
pub mod simulators;
pub mod stack;
pub mod stage;

pub use side_effects::{Endpoints, Outcome, SideEffect};
pub use stage::{Stage, StageChange};
