//! What an engine's handles and its workers share: the pools, the
//! registered functions and options (`EngineInner`, behind the `Engine`
//! handle's `Arc`).
//! The worker depends on this module, never on `engine.rs`, whose public
//! handle starts workers.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use sqlx::PgPool;

use crate::codec::Keyring;
use crate::function::{Backoff, ErasedHandler};
use crate::handoff::{ClaimClasses, LocalWorkers};
use crate::limits::Limits;
use crate::schedule::{CatchUp, Schedule};
use crate::store;
use crate::worker_options::WorkerOptions;

/// The registered versions of one function id.
pub(crate) struct Versions {
    /// The newest registered version: new runs start under it.
    pub newest: u32,
    /// Each registered version's handler (the newest's included).
    pub by_version: BTreeMap<u32, Registered>,
    /// The newest registration has no claim-time flow rule (concurrency,
    /// throttle, rate limit, back-pressure) and no start or finish timeout:
    /// its runs are taken by the fast claim.
    pub fast_claim: bool,
}

impl Versions {
    /// The newest version's registration.
    pub fn newest(&self) -> Option<&Registered> {
        self.by_version.get(&self.newest)
    }
}

/// One registered version of a function, as the worker executes it.
pub(crate) struct Registered {
    pub handler: ErasedHandler,
    pub backoff: Backoff,
    /// A retry-after failure pauses the run's back-pressure keys.
    pub backpressure: bool,
    /// The cron schedule and its catch-up policy, for functions with `on_cron`.
    pub schedule: Option<(Schedule, CatchUp)>,
    /// The default timeout of each step body.
    pub step_timeout: Option<Duration>,
}

pub(crate) struct EngineInner {
    pub pool: PgPool,
    /// Heartbeats, the reaper and LISTEN: never starved by user steps.
    pub control_pool: PgPool,
    pub functions: HashMap<String, Versions>,
    pub limits: Limits,
    pub worker: WorkerOptions,
    /// Seals step outputs and run outputs at rest, when set.
    pub keyring: Option<Arc<Keyring>>,
    /// Per event name, the (function, key pointer) pairs its data must carry for
    /// the flow control of functions registered here: checked before any SQL.
    pub key_checks: HashMap<String, Vec<(String, String)>>,
    /// Per event name, the functions registered here that it triggers (their
    /// newest registrations): a send wakes the workers of its process for them.
    pub triggered: HashMap<String, Vec<String>>,
    /// The workers running in this process (`run_worker`): a send through
    /// this engine wakes them itself, before its NOTIFY reaches them.
    pub local_workers: LocalWorkers,
    /// The test kit's crash and failure injection, set by `testing::TestEngine`.
    #[cfg(feature = "testing")]
    pub probe: std::sync::OnceLock<Arc<crate::probe::Probe>>,
}

impl EngineInner {
    /// The handler of a run of `function_id` started under `version`, if this engine registers it.
    pub(crate) fn handler(&self, function_id: &str, version: i32) -> Option<&Registered> {
        let version = u32::try_from(version).ok()?;
        self.functions.get(function_id)?.by_version.get(&version)
    }

    /// The functions of this engine that events named `names` trigger (a
    /// function once per name that triggers it: a batch of 1,000 events of
    /// one name looks its name up once).
    pub(crate) fn triggered_by(&self, names: &std::collections::BTreeSet<&str>) -> Vec<&str> {
        names.iter().filter_map(|n| self.triggered.get(*n)).flatten().map(String::as_str).collect()
    }

    /// Every (function, version) this engine has a handler for, as the claim takes them.
    pub(crate) fn handled(&self) -> store::Handled {
        self.handled_where(|_| true)
    }

    /// [`EngineInner::handled`] of the functions whose runs the fast claim
    /// takes (no claim-time flow rule, no timeout), and of the others.
    pub(crate) fn claim_classes(&self) -> ClaimClasses {
        ClaimClasses { fast: self.handled_where(|v| v.fast_claim), full: self.handled_where(|v| !v.fast_claim) }
    }

    fn handled_where(&self, keep: impl Fn(&Versions) -> bool) -> store::Handled {
        let mut ids: Vec<String> = self.functions.iter().filter(|(_, v)| keep(v)).map(|(id, _)| id.clone()).collect();
        ids.sort();
        let (mut version_ids, mut versions) = (Vec::new(), Vec::new());
        for id in &ids {
            for v in self.functions[id].by_version.keys() {
                version_ids.push(id.clone());
                versions.push(i32::try_from(*v).unwrap_or(i32::MAX));
            }
        }
        store::Handled { ids, version_ids, versions }
    }
}
