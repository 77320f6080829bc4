//! Divergence detection: what a run's handler asked for, in order, and the
//! comparison of a replay against it.
//!
//! Every entry a handler asks for (a step, a step_tx, a sleep, a wait, a sent
//! event, an invoke, a [`Ctx::changed`](crate::Ctx::changed) marker) gets the
//! next position of the run (0, 1, 2 ...) when the handler calls it, and is
//! recorded with its kind and step key in `durastep.step_journal` (with its
//! checkpoint, or when it is first asked for waits, invokes and markers). A
//! replay compares what the code asks at each position with what was
//! recorded there; the first difference is a [`Divergence`].

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// What kind of entry a handler asked for.
///
/// ```
/// use durastep::EntryKind;
/// assert_eq!(EntryKind::Sleep.as_str(), "sleep");
/// assert_eq!("step_tx".parse::<EntryKind>(), Ok(EntryKind::StepTx));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum EntryKind {
    /// [`Ctx::step`](crate::Ctx::step).
    Step,
    /// [`Ctx::step_tx`](crate::Ctx::step_tx).
    StepTx,
    /// [`Ctx::sleep`](crate::Ctx::sleep) or [`Ctx::sleep_until`](crate::Ctx::sleep_until).
    Sleep,
    /// [`Ctx::wait_for_event`](crate::Ctx::wait_for_event).
    Wait,
    /// [`Ctx::send_event`](crate::Ctx::send_event).
    SendEvent,
    /// [`Ctx::invoke`](crate::Ctx::invoke).
    Invoke,
    /// A [`Ctx::changed`](crate::Ctx::changed) marker that returned `true`.
    Changed,
}

impl EntryKind {
    /// The kind's name as stored (`step`, `step_tx`, `sleep`, `wait`,
    /// `send_event`, `invoke`, `changed`).
    ///
    /// ```
    /// assert_eq!(durastep::EntryKind::SendEvent.as_str(), "send_event");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            EntryKind::Step => "step",
            EntryKind::StepTx => "step_tx",
            EntryKind::Sleep => "sleep",
            EntryKind::Wait => "wait",
            EntryKind::SendEvent => "send_event",
            EntryKind::Invoke => "invoke",
            EntryKind::Changed => "changed",
        }
    }
}

impl fmt::Display for EntryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A string that names no [`EntryKind`].
///
/// ```
/// assert!("nap".parse::<durastep::EntryKind>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown entry kind {0:?}")]
pub struct UnknownEntryKind(pub String);

impl FromStr for EntryKind {
    type Err = UnknownEntryKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "step" => EntryKind::Step,
            "step_tx" => EntryKind::StepTx,
            "sleep" => EntryKind::Sleep,
            "wait" => EntryKind::Wait,
            "send_event" => EntryKind::SendEvent,
            "invoke" => EntryKind::Invoke,
            "changed" => EntryKind::Changed,
            other => return Err(UnknownEntryKind(other.to_owned())),
        })
    }
}

/// One entry of a run's journal: what the handler asked for at a position.
///
/// ```
/// use durastep::{EntryKind, JournalEntry};
/// let e = JournalEntry::new(EntryKind::Step, "push");
/// assert_eq!(e.to_string(), "step \"push\"");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct JournalEntry {
    /// What was asked for.
    pub kind: EntryKind,
    /// Its step key (the name, or `name#2` for the second call of a name; for
    /// a `changed` marker, its id).
    pub key: String,
}

impl JournalEntry {
    /// An entry of `kind` under `key`.
    ///
    /// ```
    /// let e = durastep::JournalEntry::new(durastep::EntryKind::Sleep, "settle");
    /// assert_eq!(e.key, "settle");
    /// ```
    pub fn new(kind: EntryKind, key: impl Into<String>) -> Self {
        JournalEntry { kind, key: key.into() }
    }
}

impl fmt::Display for JournalEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.kind, self.key)
    }
}

/// A replay asked for something other than what its run recorded: the code of
/// the function changed in a way that does not fit the runs in flight.
///
/// A run whose attempt finds a divergence is parked in the state
/// [`RunState::Diverged`](crate::RunState::Diverged) with this value (see
/// [`Engine::resume_diverged`](crate::Engine::resume_diverged) and
/// [`Engine::discard_from`](crate::Engine::discard_from));
/// [`Engine::check_deploy`](crate::Engine::check_deploy) finds it before a deploy.
///
/// ```
/// use durastep::{Divergence, EntryKind, JournalEntry};
/// let d = Divergence {
///     run_id: uuid::Uuid::nil(),
///     function_id: "welcome".into(),
///     position: 1,
///     recorded: Some(JournalEntry::new(EntryKind::Step, "send-email")),
///     asked: Some(JournalEntry::new(EntryKind::Step, "send-mail")),
/// };
/// assert!(d.to_string().contains("position 1"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("run {run_id} of {function_id} diverged at position {position}: recorded {}, asked {}",
        describe(.recorded.as_ref(), "nothing"), describe(.asked.as_ref(), "nothing (the handler returned)"))]
pub struct Divergence {
    /// The run.
    pub run_id: Uuid,
    /// Its function.
    pub function_id: String,
    /// The position (from 0) where the replay and the record part.
    pub position: u32,
    /// What the run recorded there (`None`: nothing; not produced today, kept
    /// for forward compatibility).
    pub recorded: Option<JournalEntry>,
    /// What the code asked for there (`None`: the handler returned while this
    /// and later recorded entries were never asked for).
    pub asked: Option<JournalEntry>,
}

fn describe(e: Option<&JournalEntry>, none: &str) -> String {
    e.map_or_else(|| none.to_owned(), JournalEntry::to_string)
}

/// The answer of the journal to one ask.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    /// The entry was recorded at this position: replay it.
    Replayed(u32),
    /// Nothing was recorded at this position: new work, to be recorded here.
    Fresh(u32),
}

impl Ask {
    pub(crate) fn position(self) -> u32 {
        match self {
            Ask::Replayed(p) | Ask::Fresh(p) => p,
        }
    }
}

/// What `changed(id)` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Changed {
    /// The marker was recorded: the run took the new path.
    Recorded,
    /// The run recorded the old path here: `false`, no position used.
    OldPath,
    /// New ground: `true`, and the marker is to be recorded at this position.
    Fresh(u32),
}

/// The journal of one attempt: the recorded entries, and the position of the next ask.
#[derive(Debug, Default)]
pub(crate) struct Journal {
    recorded: BTreeMap<u32, JournalEntry>,
    next: u32,
}

impl Journal {
    pub(crate) fn new(recorded: BTreeMap<u32, JournalEntry>) -> Self {
        Journal { recorded, next: 0 }
    }

    /// The handler asks for `kind` under `key`: where it stands, or how it diverged
    /// (position, recorded there).
    pub(crate) fn ask(&mut self, kind: EntryKind, key: &str) -> Result<Ask, (u32, JournalEntry)> {
        loop {
            let p = self.next;
            match self.recorded.get(&p) {
                None => {
                    self.next += 1;
                    return Ok(Ask::Fresh(p));
                }
                Some(r) if r.kind == kind && r.key == key => {
                    self.next += 1;
                    return Ok(Ask::Replayed(p));
                }
                // A marker whose `changed` call has since been removed: skipped.
                Some(r) if r.kind == EntryKind::Changed => self.next += 1,
                Some(r) => return Err((p, r.clone())),
            }
        }
    }

    /// The handler calls `changed(id)`.
    pub(crate) fn changed(&mut self, id: &str) -> Changed {
        let p = self.next;
        match self.recorded.get(&p) {
            Some(r) if r.kind == EntryKind::Changed && r.key == id => {
                self.next += 1;
                Changed::Recorded
            }
            Some(_) => Changed::OldPath,
            // A later entry was recorded (the run's old code asked for something
            // here that never finished): the run predates the change.
            None if self.recorded.range(p..).next().is_some() => Changed::OldPath,
            None => {
                self.next += 1;
                Changed::Fresh(p)
            }
        }
    }

    /// The first recorded entry that was never asked for, once the handler has returned.
    pub(crate) fn unasked(&self) -> Option<(u32, JournalEntry)> {
        self.recorded.range(self.next..).find(|(_, e)| e.kind != EntryKind::Changed).map(|(p, e)| (*p, e.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(entries: &[(EntryKind, &str)]) -> Journal {
        Journal::new(entries.iter().enumerate().map(|(i, (k, key))| (i as u32, JournalEntry::new(*k, *key))).collect())
    }

    #[test]
    fn replay_matches_then_goes_fresh() {
        let mut j = rec(&[(EntryKind::Step, "a"), (EntryKind::Sleep, "nap")]);
        assert_eq!(j.ask(EntryKind::Step, "a"), Ok(Ask::Replayed(0)));
        assert_eq!(j.ask(EntryKind::Sleep, "nap"), Ok(Ask::Replayed(1)));
        assert_eq!(j.ask(EntryKind::Step, "b"), Ok(Ask::Fresh(2)));
        assert_eq!(j.unasked(), None);
    }

    #[test]
    fn renamed_step_diverges() {
        let mut j = rec(&[(EntryKind::Step, "a"), (EntryKind::Sleep, "nap")]);
        assert_eq!(j.ask(EntryKind::Step, "a2"), Err((0, JournalEntry::new(EntryKind::Step, "a"))));
    }

    #[test]
    fn kind_change_diverges() {
        let mut j = rec(&[(EntryKind::Step, "a")]);
        assert!(j.ask(EntryKind::StepTx, "a").is_err());
    }

    #[test]
    fn removed_last_entry_is_unasked() {
        let j = rec(&[(EntryKind::Step, "a")]);
        assert_eq!(j.unasked(), Some((0, JournalEntry::new(EntryKind::Step, "a"))));
    }

    #[test]
    fn changed_markers() {
        // Old run: recorded the old path at position 1.
        let mut old = rec(&[(EntryKind::Step, "a"), (EntryKind::Step, "old")]);
        assert_eq!(old.ask(EntryKind::Step, "a"), Ok(Ask::Replayed(0)));
        assert_eq!(old.changed("v2"), Changed::OldPath);
        assert_eq!(old.ask(EntryKind::Step, "old"), Ok(Ask::Replayed(1)));
        // New run: records the marker, and finds it on replay.
        let mut new = rec(&[(EntryKind::Step, "a")]);
        new.ask(EntryKind::Step, "a").unwrap();
        assert_eq!(new.changed("v2"), Changed::Fresh(1));
        let mut again = rec(&[(EntryKind::Step, "a"), (EntryKind::Changed, "v2"), (EntryKind::Step, "new")]);
        again.ask(EntryKind::Step, "a").unwrap();
        assert_eq!(again.changed("v2"), Changed::Recorded);
        assert_eq!(again.ask(EntryKind::Step, "new"), Ok(Ask::Replayed(2)));
        // The marker's call removed later: the marker is skipped.
        let mut removed = rec(&[(EntryKind::Step, "a"), (EntryKind::Changed, "v2"), (EntryKind::Step, "new")]);
        removed.ask(EntryKind::Step, "a").unwrap();
        assert_eq!(removed.ask(EntryKind::Step, "new"), Ok(Ask::Replayed(2)));
        assert_eq!(removed.unasked(), None);
    }
}
