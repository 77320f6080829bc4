//! Story B of the project's scenarios, as a crate: a media-buying agency's
//! budget writes to Meta, TikTok and LinkedIn as Durastep functions on one
//! typed Postgres schema, with local simulators of the three platforms and of
//! the on-call chat channel.
//!
//! Run the story end to end with `cargo run -p media-buying -- demo`; see the
//! crate's README for what maps to which line of the story.
//!
//! - [`store`]: the state store (`media` schema: accounts, tokens,
//!   budget_writes) and every SQL statement the example runs.
//! - [`platforms`]: HTTP clients for the platforms, reached through base URLs
//!   only ([`Endpoints`]), so the same code can point at the real APIs.
//! - [`functions`]: the Durastep functions (Meta, TikTok, LinkedIn, token
//!   rotation, the Saturday summary, shadow mode).
//! - [`founder`]: the founder's view of the budget writes.
//! - [`sim`]: the simulators, with the platforms' failure modes.
//! - [`database`]: pools, the demo's own database, an engine with every function.
//! - [`demo`]: the `demo` command; [`shadow_week`]: the `shadow-week` command
//!   (TikTok shadow-written for a week, and the comparison report).
//! - [`cli`]: the command line; [`units`]: durations and amounts for people.

pub mod cli;
pub mod database;
pub mod demo;
pub mod founder;
pub mod functions;
pub mod platforms;
pub mod shadow_week;
pub mod sim;
pub mod store;
pub mod units;

mod config;
mod error;

pub use config::{CrashPoint, Endpoints, Settings};
pub use error::Error;
pub use functions::{BudgetRequest, Platform};
