//! The webhook's payload: one CRM stage change, and its dedupe key.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Datelike, Utc};
use serde::{Deserialize, Serialize};

/// The pipeline stages of a deal, as the CRM names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// A candidate was sourced for a vacancy.
    Sourced,
    /// The recruiter had an intro call with the candidate.
    IntroCall,
    /// The client interviews the candidate.
    ClientInterview,
    /// The client made an offer.
    Offer,
    /// The candidate was placed: the only stage that also drafts an invoice.
    Placement,
    /// The placement was invoiced.
    Invoice,
    /// The placement was renewed.
    Renewal,
}

impl Stage {
    /// Every stage, in pipeline order.
    pub const ALL: [Stage; 7] = [
        Stage::Sourced,
        Stage::IntroCall,
        Stage::ClientInterview,
        Stage::Offer,
        Stage::Placement,
        Stage::Invoice,
        Stage::Renewal,
    ];

    /// The CRM's name for the stage (`intro_call`).
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Sourced => "sourced",
            Stage::IntroCall => "intro_call",
            Stage::ClientInterview => "client_interview",
            Stage::Offer => "offer",
            Stage::Placement => "placement",
            Stage::Invoice => "invoice",
            Stage::Renewal => "renewal",
        }
    }

    /// The Durastep event a change to this stage sends (`crm/stage.placement`).
    ///
    /// One event name per stage lets a side effect subscribe to the stages it
    /// serves: the draft invoice listens to `crm/stage.placement` only, so the
    /// other stages create no invoice run at all.
    pub fn event_name(self) -> String {
        format!("crm/stage.{}", self.as_str())
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A stage name the pipeline does not know.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown stage {0:?} (expected one of sourced, intro_call, client_interview, offer, placement, invoice, renewal)"
)]
pub struct UnknownStage(pub String);

impl FromStr for Stage {
    type Err = UnknownStage;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Stage::ALL.into_iter().find(|stage| stage.as_str() == s).ok_or_else(|| UnknownStage(s.to_owned()))
    }
}

/// One stage change, as the CRM's webhook delivers it (and as it is stored as
/// the event payload, plus the time the receiver got it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageChange {
    /// The candidate's contact id in the CRM.
    pub contact_id: u64,
    /// The stage the deal moved to.
    pub stage: Stage,
    /// When the stage changed in the CRM (a re-fired webhook carries the same time).
    pub occurred_at: DateTime<Utc>,
    /// The candidate's name.
    pub candidate_name: String,
    /// Where the candidate mail goes.
    pub candidate_email: String,
    /// The CRM owner id of the candidate's recruiter (the task's assignee).
    pub recruiter_id: u64,
    /// The client account the deal belongs to (selects the chat channel).
    pub client_account: String,
    /// The placement fee in cents, invoiced on stage `placement`.
    #[serde(default)]
    pub fee_cents: Option<u64>,
    /// When the receiver accepted the webhook; set by the receiver, used for
    /// the latency from webhook to side effect.
    #[serde(default)]
    pub received_at: Option<DateTime<Utc>>,
}

impl StageChange {
    /// The dedupe key `contact_id:stage:iso_week`, e.g. `4711:placement:2026-W49`.
    ///
    /// It is the event's idempotency key (a re-fired webhook is a no-op) and
    /// the idempotency token sent to every downstream system (a retried step
    /// lands on the same write).
    ///
    /// ```
    /// use placement_pipeline::{Stage, StageChange};
    /// let change = StageChange {
    ///     contact_id: 4711,
    ///     stage: Stage::Placement,
    ///     occurred_at: "2026-11-30T08:05:00Z".parse().unwrap(),
    ///     candidate_name: "Ada".into(),
    ///     candidate_email: "ada@example.com".into(),
    ///     recruiter_id: 7,
    ///     client_account: "acme".into(),
    ///     fee_cents: Some(1_200_000),
    ///     received_at: None,
    /// };
    /// assert_eq!(change.dedupe_key(), "4711:placement:2026-W49");
    /// ```
    pub fn dedupe_key(&self) -> String {
        let week = self.occurred_at.iso_week();
        format!("{}:{}:{}-W{:02}", self.contact_id, self.stage, week.year(), week.week())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(stage: Stage, occurred_at: &str) -> StageChange {
        StageChange {
            contact_id: 42,
            stage,
            occurred_at: occurred_at.parse().expect("a time"),
            candidate_name: "Ada".into(),
            candidate_email: "ada@example.com".into(),
            recruiter_id: 1,
            client_account: "acme".into(),
            fee_cents: None,
            received_at: None,
        }
    }

    #[test]
    fn dedupe_key_uses_the_iso_week_and_its_year() {
        let check = |stage, time: &str, expected: &str| assert_eq!(at(stage, time).dedupe_key(), expected, "{time}");
        check(Stage::Offer, "2026-11-30T00:00:00Z", "42:offer:2026-W49"); // a Monday
        check(Stage::Offer, "2026-12-06T23:59:59Z", "42:offer:2026-W49"); // the Sunday after
        check(Stage::Offer, "2026-12-07T00:00:00Z", "42:offer:2026-W50");
        // 1 January 2027 is a Friday: it belongs to ISO week 53 of 2026.
        check(Stage::IntroCall, "2027-01-01T09:00:00Z", "42:intro_call:2026-W53");
        check(Stage::Placement, "2027-01-04T09:00:00Z", "42:placement:2027-W01");
    }

    #[test]
    fn stages_round_trip_through_their_names() {
        for stage in Stage::ALL {
            assert_eq!(stage.as_str().parse::<Stage>().expect("known"), stage);
            assert_eq!(serde_json::to_value(stage).expect("json"), serde_json::json!(stage.as_str()));
        }
        assert!("placed".parse::<Stage>().is_err());
    }
}
