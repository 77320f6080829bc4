//! The engine's hook for the test kit ([`crate::testing`]): it counts step
//! bodies, and fails and crashes them where a test asks. The context and
//! the worker call it; the test kit sets it up. Built with the `testing`
//! feature only.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use serde::Serialize;
use uuid::Uuid;

use crate::failure::HandlerError;

/// Where in a step the test kit can crash an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Point {
    /// The step body (or a sleep's wake-time computation) ended, its
    /// checkpoint was not written yet: on resume the body runs again.
    AfterBody,
    /// The checkpoint was stored (for `step_tx`: committed): on resume the
    /// stored result is returned.
    AfterCheckpoint,
}

/// A crash planned for one run: at its `at`-th crash point (from 0), once.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CrashPlan {
    pub(crate) run_id: Uuid,
    pub(crate) at: usize,
    pub(crate) fired: bool,
}

#[derive(Debug, Default)]
pub(crate) struct ProbeState {
    /// Per run and step key, how many times its body started.
    pub(crate) bodies: HashMap<Uuid, BTreeMap<String, u32>>,
    /// Per run, the crash points met so far, in order.
    pub(crate) points: HashMap<Uuid, Vec<(Point, String)>>,
    /// Per step name, how many more bodies to fail.
    pub(crate) failures: HashMap<String, u32>,
    pub(crate) crash: Option<CrashPlan>,
}

/// The engine's hook for the test kit: counts step bodies, fails and crashes them.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    state: Mutex<ProbeState>,
}

impl Probe {
    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, ProbeState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A step body is about to run: counted; an injected failure is returned.
    pub(crate) fn body(&self, run_id: Uuid, name: &str, key: &str) -> Option<HandlerError> {
        let mut s = self.lock();
        *s.bodies.entry(run_id).or_default().entry(key.to_owned()).or_insert(0) += 1;
        match s.failures.get_mut(name) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Some(HandlerError::new(format!("injected failure of step {name} (test kit)")))
            }
            _ => None,
        }
    }

    /// A crash point is reached: whether to crash here.
    pub(crate) fn crash_here(&self, run_id: Uuid, point: Point, key: &str) -> bool {
        let mut s = self.lock();
        let seen = s.points.entry(run_id).or_default();
        seen.push((point, key.to_owned()));
        let index = seen.len() - 1;
        match &mut s.crash {
            Some(plan) if plan.run_id == run_id && !plan.fired && plan.at == index => {
                plan.fired = true;
                true
            }
            _ => false,
        }
    }
}
