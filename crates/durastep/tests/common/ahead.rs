//! The claimed-ahead scenario (tests/claim.rs, tests/metrics.rs): a worker
//! with one slot and one run claimed ahead, driven until a run blocks its
//! slot while the next run waits, claimed, for a slot.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use durastep::{Ctx, Engine, Event, Function, RunState};
use sqlx::postgres::PgConnectOptions;
use uuid::Uuid;

use super::Gate;

/// A handler by input: `"quick"` returns at once, `"block"` waits for the
/// round's gate, `"x"` counts its start and returns.
pub fn ahead_function(gates: Arc<Vec<Gate>>, reached: Arc<Vec<Gate>>, x_starts: Arc<AtomicU32>) -> Function {
    Function::new("ahead").on_event("ahead/go").handler(move |_ctx: Ctx, input: (String, usize)| {
        let (gates, reached, x_starts) = (gates.clone(), reached.clone(), x_starts.clone());
        async move {
            match input.0.as_str() {
                "block" => {
                    reached[input.1].open();
                    gates[input.1].wait().await;
                }
                "x" => {
                    x_starts.fetch_add(1, Ordering::SeqCst);
                }
                _ => {}
            }
            Ok(())
        }
    })
}

/// Rounds of the claimed-ahead scenarios; each needs gates of its own.
pub const AHEAD_ROUNDS: usize = 3;

/// A worker (one slot, one run ahead, claims of two) and the gates of
/// [`ahead_function`] for [`AHEAD_ROUNDS`] rounds.
pub struct Ahead {
    pub gates: Arc<Vec<Gate>>,
    pub reached: Arc<Vec<Gate>>,
    pub x_starts: Arc<AtomicU32>,
}

impl Default for Ahead {
    fn default() -> Self {
        Self::new()
    }
}

impl Ahead {
    pub fn new() -> Self {
        let gates = || Arc::new((0..AHEAD_ROUNDS).map(|_| Gate::new()).collect::<Vec<_>>());
        Ahead { gates: gates(), reached: gates(), x_starts: Arc::new(AtomicU32::new(0)) }
    }

    pub fn function(&self) -> Function {
        ahead_function(self.gates.clone(), self.reached.clone(), self.x_starts.clone())
    }

    pub async fn engine(&self, opts: &PgConnectOptions) -> Engine {
        self.engine_claiming_ahead(opts, 1).await
    }

    /// As [`Ahead::engine`], with `claim_ahead` set to `ahead`.
    pub async fn engine_claiming_ahead(&self, opts: &PgConnectOptions, ahead: usize) -> Engine {
        self.engine_with(opts, durastep::WorkerOptions { claim_ahead: ahead, ..super::fast_options() }).await
    }

    /// As [`Ahead::engine`], with the leases of `lease`: longer than a test
    /// runs, no reaper deletes a claim record within it.
    pub async fn engine_with_lease(&self, opts: &PgConnectOptions, lease: Duration) -> Engine {
        self.engine_with(opts, durastep::WorkerOptions { claim_ahead: 1, lease, ..super::fast_options() }).await
    }

    /// `worker` with one slot and claims of two.
    async fn engine_with(&self, opts: &PgConnectOptions, worker: durastep::WorkerOptions) -> Engine {
        let worker = durastep::WorkerOptions { max_in_flight: 1, claim_batch: 2, ..worker };
        super::engine_with(opts, vec![self.function()], worker).await
    }

    /// One round of [`Ahead::claimed_ahead`]'s scenario: quick runs, then a
    /// run that blocks the only slot, then `x`; returns (blocked, x) once the
    /// blocking run has started.
    pub async fn round(&self, engine: &Engine, round: usize) -> (Uuid, Uuid) {
        engine.send_batch((0..100).map(|_| Event::new("ahead/go", &("quick", round))).collect()).await.unwrap();
        let blocked = engine.send(Event::new("ahead/go", &("block", round))).await.unwrap().run_ids[0];
        let x = engine.send(Event::new("ahead/go", &("x", round))).await.unwrap().run_ids[0];
        self.reached[round].reached("the blocking run to start").await;
        (blocked, x)
    }

    /// Drives the worker until it holds a run claimed ahead: its slots turn
    /// over on quick runs, then a run blocks its only slot and the next run
    /// `x` is claimed ahead (running, held, while the slot is blocked).
    /// Whether it claims ahead depends on the turnover it saw just before, so
    /// this tries up to [`AHEAD_ROUNDS`] rounds and fails if it never does
    /// (claiming ahead would not work at all). Returns (round, blocked, x).
    pub async fn claimed_ahead(&self, engine: &Engine) -> (usize, Uuid, Uuid) {
        for round in 0..AHEAD_ROUNDS {
            let (blocked, x) = self.round(engine, round).await;
            let deadline = tokio::time::Instant::now() + Duration::from_millis(600);
            while tokio::time::Instant::now() < deadline {
                if engine.run(x).await.unwrap().state == RunState::Running {
                    return (round, blocked, x);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            self.gates[round].open();
            super::finished(engine, x).await;
        }
        panic!("in {AHEAD_ROUNDS} rounds, the worker never claimed a run ahead");
    }
}
