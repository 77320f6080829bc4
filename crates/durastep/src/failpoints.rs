//! Named failpoints for the fault-injection suite.
//!
//! Compiled only with the `failpoints` feature; without it `failpoint!` expands
//! to nothing. Configure with the `DURASTEP_FAILPOINTS` environment variable
//! (read once) or [`set`]: a comma-separated list of `name=action`, where action
//! is `exit`, `panic`, `error`, `pause(ms)` or `off`, optionally prefixed by a
//! hit count, `3*exit` (fire on the third hit only), or a percentage, `10%exit`.
//!
//! ```
//! # #[cfg(feature = "failpoints")] {
//! durastep::failpoints::set("step-after-body", "2*exit");
//! # durastep::failpoints::set("step-after-body", "off"); }
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

/// What a failpoint does when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Exit the process at once with code 137 (as if SIGKILLed): no destructors run.
    Exit,
    /// Panic in the current task.
    Panic,
    /// Return an error from the surrounding operation.
    Error,
    /// Sleep this long, then go on.
    Pause(Duration),
}

#[derive(Debug)]
struct Point {
    action: Action,
    /// Fire on this hit only (1-based); 0 means every hit (subject to percent).
    nth: u64,
    percent: u32,
    hits: AtomicU64,
}

fn registry() -> &'static Mutex<HashMap<String, Point>> {
    static REG: OnceLock<Mutex<HashMap<String, Point>>> = OnceLock::new();
    REG.get_or_init(|| {
        let mut map = HashMap::new();
        if let Ok(spec) = std::env::var("DURASTEP_FAILPOINTS") {
            for item in spec.split(',').filter(|s| !s.trim().is_empty()) {
                if let Some((name, action)) = item.split_once('=')
                    && let Some(point) = parse(action.trim())
                {
                    map.insert(name.trim().to_owned(), point);
                }
            }
        }
        Mutex::new(map)
    })
}

fn parse(spec: &str) -> Option<Point> {
    let (nth, rest) = match spec.split_once('*') {
        Some((n, rest)) => (n.parse().ok()?, rest),
        None => (0, spec),
    };
    let (percent, rest) = match rest.split_once('%') {
        Some((p, rest)) => (p.parse().ok()?, rest),
        None => (100, rest),
    };
    let action = match rest {
        "exit" => Action::Exit,
        "panic" => Action::Panic,
        "error" => Action::Error,
        "off" => return None,
        other => {
            let ms = other.strip_prefix("pause(")?.strip_suffix(')')?.parse().ok()?;
            Action::Pause(Duration::from_millis(ms))
        }
    };
    Some(Point { action, nth, percent, hits: AtomicU64::new(0) })
}

/// Sets (or with `off`, clears) a failpoint at run time.
///
/// ```
/// durastep::failpoints::set("claim-after-commit", "off");
/// ```
pub fn set(name: &str, action: &str) {
    let mut reg = registry().lock().unwrap_or_else(|p| p.into_inner());
    match parse(action) {
        Some(point) => {
            reg.insert(name.to_owned(), point);
        }
        None => {
            reg.remove(name);
        }
    }
}

/// Evaluates a failpoint: exits, panics or pauses as configured; returns true
/// when the caller must fail with an error.
pub async fn eval(name: &str) -> bool {
    let action = {
        let reg = registry().lock().unwrap_or_else(|p| p.into_inner());
        let Some(point) = reg.get(name) else { return false };
        let hit = point.hits.fetch_add(1, Ordering::SeqCst) + 1;
        if point.nth != 0 && hit != point.nth {
            return false;
        }
        if point.percent < 100 && (uuid::Uuid::new_v4().as_u128() % 100) as u32 >= point.percent {
            return false;
        }
        point.action
    };
    tracing::warn!(failpoint = name, ?action, "failpoint fired");
    match action {
        Action::Exit => std::process::exit(137),
        Action::Panic => panic!("failpoint {name}"),
        Action::Error => true,
        Action::Pause(d) => {
            tokio::time::sleep(d).await;
            false
        }
    }
}
