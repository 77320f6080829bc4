//! The Monday-morning burst: 200 stage changes between 08:00 and 10:00 UTC,
//! with the share of each stage a recruiting pipeline has (most deals are
//! early; about one in eight is a placement), and some webhooks re-fired by
//! the CRM. Deterministic, so every demo run and test sees the same burst.

use chrono::{DateTime, Duration, Utc};

use crate::stage::{Stage, StageChange};

/// The client accounts of the burst; each posts to `#client-<account>`.
pub const CLIENT_ACCOUNTS: [&str; 12] = [
    "acme",
    "globex",
    "initrode",
    "umbrella",
    "hooli",
    "vandelay",
    "soylent",
    "stark",
    "wayne",
    "wonka",
    "tyrell",
    "cyberdyne",
];

/// A client account's chat channel.
pub fn channel_of(account: &str) -> String {
    format!("#client-{account}")
}

/// A burst of webhooks.
#[derive(Debug, Clone)]
pub struct Burst {
    /// The distinct stage changes.
    pub changes: Vec<StageChange>,
    /// The webhooks in delivery order, as indexes into `changes`; a re-fired
    /// webhook repeats an earlier index.
    pub deliveries: Vec<usize>,
}

impl Burst {
    /// The stage changes to `placement`.
    pub fn placements(&self) -> usize {
        self.changes.iter().filter(|c| c.stage == Stage::Placement).count()
    }

    /// How many deliveries are re-fires.
    pub fn refired(&self) -> usize {
        self.deliveries.len() - self.changes.len()
    }
}

/// `changes` stage changes on Monday 30 November 2026 from 08:00 UTC, of
/// which `refired` are delivered twice.
pub fn monday_burst(changes: usize, refired: usize) -> Burst {
    let start: DateTime<Utc> = DateTime::from_timestamp(1_796_025_600, 0).unwrap_or_default(); // 2026-11-30 08:00 UTC
    let mut rng = Lcg(0x5eed_2026);
    // Per 100 stage changes: sourced 30, intro call 22, client interview 18,
    // offer 12, placement 12, invoice 4, renewal 2.
    let weights = [30, 22, 18, 12, 12, 4, 2];
    let all: Vec<StageChange> = (0..changes)
        .map(|i| {
            let mut pick = rng.below(100);
            let mut stage = Stage::Sourced;
            for (s, w) in Stage::ALL.into_iter().zip(weights) {
                if pick < w {
                    stage = s;
                    break;
                }
                pick -= w;
            }
            let contact_id = 10_000 + i as u64;
            let account = CLIENT_ACCOUNTS[rng.below(CLIENT_ACCOUNTS.len() as u64) as usize];
            StageChange {
                contact_id,
                stage,
                occurred_at: start + Duration::seconds((i as i64 * 7_200) / changes.max(1) as i64),
                candidate_name: format!("Candidate {contact_id}"),
                candidate_email: format!("candidate{contact_id}@example.com"),
                recruiter_id: 100 + rng.below(8),
                client_account: account.to_owned(),
                fee_cents: (stage == Stage::Placement).then(|| 900_000 + rng.below(20) * 50_000),
                received_at: None,
            }
        })
        .collect();
    let mut deliveries: Vec<usize> = (0..all.len()).collect();
    for _ in 0..refired.min(all.len()) {
        // A re-fire comes a little after the original.
        let original = rng.below(all.len() as u64) as usize;
        let at = (original + 1 + rng.below(10) as usize).min(deliveries.len());
        deliveries.insert(at, original);
    }
    Burst { changes: all, deliveries }
}

/// A small deterministic generator (no randomness needed beyond this).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % n.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_burst_has_distinct_keys_some_placements_and_the_re_fires_asked_for() {
        let burst = monday_burst(200, 12);
        assert_eq!(burst.changes.len(), 200);
        assert_eq!(burst.deliveries.len(), 212);
        let keys: std::collections::HashSet<String> = burst.changes.iter().map(StageChange::dedupe_key).collect();
        assert_eq!(keys.len(), 200);
        assert!((15..=40).contains(&burst.placements()), "{} placements", burst.placements());
        assert!(burst.changes.iter().all(|c| (c.stage == Stage::Placement) == c.fee_cents.is_some()));
    }
}
