//! `durastep why`: what a run is doing, or what holds it, in one sentence.

use durastep::RunState;
use durastep::inspect::Inspector;
use durastep::inspect::{Blocker, BlockerKind, Why};
use uuid::Uuid;

use crate::error::CliError;
use crate::format;
use crate::output::Out;

/// `durastep why ID`.
pub async fn why(inspector: &Inspector, id: Uuid, out: &mut Out) -> Result<(), CliError> {
    let why = inspector.why(id).await?;
    let text = sentence(&why);
    if out.json {
        // The API's answer, plus the sentence a person would read.
        let mut value = serde_json::to_value(&why).map_err(|e| CliError::Io(format!("cannot write JSON: {e}")))?;
        if let Some(map) = value.as_object_mut() {
            map.insert("message".into(), text.into());
        }
        return out.json(&value);
    }
    out.line(text);
    Ok(())
}

/// The answer as a person reads it.
pub fn sentence(why: &Why) -> String {
    match why {
        Why::Running { attempt, worker_id } => match worker_id {
            Some(w) => format!("running attempt {attempt} on worker {w}"),
            None => format!("running attempt {attempt}"),
        },
        Why::Finished { state, reason } => match (state, reason) {
            (RunState::Completed, _) => "completed".into(),
            (state, Some(reason)) => format!("{}: {reason}", state.as_str()),
            (state, None) => state.as_str().to_owned(),
        },
        Why::Blocked(b) => blocker(b),
        Why::Diverged { divergence, reason } => match (divergence, reason) {
            (Some(d), _) => format!(
                "diverged: {d}; resume it once the code fits (durastep runs resume {id}), or discard it from \
                 position {p} (durastep runs discard {id} --from {p})",
                id = d.run_id,
                p = d.position
            ),
            (None, Some(reason)) => format!("diverged: {reason}"),
            (None, None) => "diverged".into(),
        },
        _ => "in a state this CLI does not know; try a newer durastep".into(),
    }
}

/// What holds a run, as a person reads it, with the sleep, wait or invoke
/// step it is in when the library knows it.
pub fn blocker(b: &Blocker) -> String {
    match &b.step {
        Some(step) => format!("{} (in step {step})", held_by(b)),
        None => held_by(b),
    }
}

fn held_by(b: &Blocker) -> String {
    let state = b.state.as_str();
    let rule = b.rule.as_deref().unwrap_or("?");
    let key = match b.key.as_deref() {
        Some(k) => format!(" key {k}"),
        None => String::new(),
    };
    let at = |what: &str| match b.next_possible_start {
        Some(t) => format!("{what} {}", format::time(t)),
        None => "no set time".into(),
    };
    let n = |v: Option<u32>| v.map(|v| v.to_string()).unwrap_or_else(|| "?".into());
    let detail = b.detail.as_deref().unwrap_or("?");
    match b.kind {
        BlockerKind::Concurrency => format!(
            "{state}: concurrency limit {rule}{key} is full ({}/{}); it starts when a slot frees",
            n(b.in_use),
            n(b.limit)
        ),
        BlockerKind::Throttle => format!(
            "{state}: throttle {rule}{key} has no start left this period (limit {}); next start {}",
            n(b.limit),
            at("at")
        ),
        BlockerKind::RateLimit => format!(
            "{state}: rate limit {rule}{key} is over its limit of {}; at its turn ({}) it is skipped if still over",
            n(b.limit),
            at("at")
        ),
        BlockerKind::Backpressure => {
            format!("{state}: {rule}{key} is paused after a Retry-After; it resumes {}", at("at"))
        }
        BlockerKind::Debounce => format!("{state}: debouncing{key}; it starts when the window closes {}", at("at")),
        BlockerKind::Sleep => match b.next_possible_start {
            Some(t) => format!("sleeping until {}", format::time(t)),
            None => "sleeping with no wake-up time".into(),
        },
        BlockerKind::WaitForEvent => match b.next_possible_start {
            Some(t) => format!("waiting for event {detail} until {} (then it times out)", format::time(t)),
            None => format!("waiting for event {detail}, with no timeout"),
        },
        BlockerKind::Invoke => format!("waiting for child run {detail}"),
        BlockerKind::RetryBackoff => {
            format!("{state}: backing off after a failure ({detail}); next attempt {}", at("at"))
        }
        BlockerKind::Scheduled => format!("{state}: scheduled to start {}", at("at")),
        BlockerKind::Ready => format!(
            "{state}: due now and not yet claimed; is a worker running that registers function {}?",
            b.function_id
        ),
        other => format!("{state}: held by {}", other.as_str()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use durastep::{Divergence, EntryKind, JournalEntry};

    /// Catches: a diverged run shown as "a state this CLI does not know".
    #[test]
    fn diverged_says_where_and_what_to_do() {
        let d = Divergence {
            run_id: Uuid::nil(),
            function_id: "flow".into(),
            position: 2,
            recorded: Some(JournalEntry::new(EntryKind::Step, "b")),
            asked: Some(JournalEntry::new(EntryKind::Step, "b2")),
        };
        let text = sentence(&Why::Diverged { divergence: Some(d), reason: None });
        assert!(text.starts_with("diverged: run"), "{text}");
        assert!(text.contains("position 2: recorded step \"b\", asked step \"b2\""), "{text}");
        let id = Uuid::nil();
        assert!(text.contains(&format!("durastep runs resume {id}")), "{text}");
        assert!(text.contains(&format!("durastep runs discard {id} --from 2")), "{text}");
    }
}
