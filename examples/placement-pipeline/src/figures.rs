//! What happened, in numbers: runs per side effect by state, retries, and the
//! latency from webhook to side effect. Everything is read from plain rows
//! (`durastep.runs`, `durastep.events`) and the simulators' counters.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::side_effects::SideEffect;
use crate::simulators::Simulators;

/// The runs of one function.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FunctionRuns {
    /// Runs created.
    pub runs: i64,
    /// Runs completed.
    pub completed: i64,
    /// Runs failed: out of attempts (the story's `dead`) or permanently.
    pub failed: i64,
    /// Runs not finished yet.
    pub open: i64,
    /// Attempts beyond the first, summed (retries after failures; a 429
    /// absorbed by back-pressure is not an attempt).
    pub retries: i64,
}

/// Runs per function id, the story's dashboard panel.
pub async fn runs_by_function(pool: &PgPool) -> Result<HashMap<String, FunctionRuns>, sqlx::Error> {
    let rows: Vec<(String, i64, i64, i64, i64, i64)> = sqlx::query_as(
        "SELECT function_id, count(*),
                count(*) FILTER (WHERE state = 'completed'),
                count(*) FILTER (WHERE state = 'failed'),
                count(*) FILTER (WHERE state IN ('queued', 'running', 'sleeping', 'waiting')),
                coalesce(sum(greatest(attempt - 1, 0)), 0)::bigint
           FROM durastep.runs GROUP BY function_id",
    )
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(f, runs, completed, failed, open, retries)| (f, FunctionRuns { runs, completed, failed, open, retries }))
        .collect())
}

/// Latency from the webhook's arrival to each side effect's arrival at its
/// system, one value per side effect fired (the first arrival per token),
/// both on the database clock.
pub async fn latencies(pool: &PgPool, sims: &Simulators) -> Result<Vec<(SideEffect, Duration)>, sqlx::Error> {
    let received: HashMap<String, DateTime<Utc>> = sqlx::query_as::<_, (String, DateTime<Utc>)>(
        "SELECT idempotency_key, (payload->>'received_at')::timestamptz FROM durastep.events
          WHERE idempotency_key IS NOT NULL AND payload ? 'received_at' AND payload->>'received_at' IS NOT NULL",
    )
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let arrivals = [
        (SideEffect::CandidateMail, sims.mail.traffic().accepted_at()),
        (SideEffect::RecruiterTask, sims.crm.traffic().accepted_at()),
        (SideEffect::ChannelPost, sims.chat.traffic().accepted_at()),
        (SideEffect::SheetRow, sims.sheet.traffic().accepted_at()),
        (SideEffect::OutreachStatus, sims.outreach.traffic().accepted_at()),
        (SideEffect::DraftInvoice, sims.invoicing.traffic().accepted_at()),
    ];
    let mut out = Vec::new();
    for (side_effect, accepted) in arrivals {
        let mut seen = std::collections::HashSet::new();
        for (token, at) in accepted {
            if !seen.insert(token.clone()) {
                continue;
            }
            if let Some(from) = received.get(&token) {
                out.push((side_effect, (at - *from).to_std().unwrap_or_default()));
            }
        }
    }
    Ok(out)
}

/// The `p`-th percentile (0-100, nearest rank) of `values`.
///
/// ```
/// use std::time::Duration;
/// let v: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
/// assert_eq!(placement_pipeline::figures::percentile(&v, 50.0), Duration::from_millis(50));
/// assert_eq!(placement_pipeline::figures::percentile(&v, 99.0), Duration::from_millis(99));
/// ```
pub fn percentile(values: &[Duration], p: f64) -> Duration {
    if values.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = values.to_vec();
    sorted.sort();
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A duration in the two largest units that matter: `850 ms`, `2.4 s`,
/// `3 min 12 s`, `4 h 0 min`, `2 d 3 h`.
///
/// ```
/// use placement_pipeline::figures::human;
/// assert_eq!(human(std::time::Duration::from_secs(192)), "3 min 12 s");
/// ```
pub fn human(d: Duration) -> String {
    let ms = d.as_millis();
    let s = d.as_secs();
    if ms < 1_000 {
        format!("{ms} ms")
    } else if ms < 60_000 {
        format!("{:.1} s", d.as_secs_f64())
    } else if s < 3_600 {
        let s = d.as_secs_f64().round() as u64;
        format!("{} min {} s", s / 60, s % 60)
    } else if s < 86_400 {
        let m = (d.as_secs_f64() / 60.0).round() as u64;
        format!("{} h {} min", m / 60, m % 60)
    } else {
        let h = (d.as_secs_f64() / 3_600.0).round() as u64;
        format!("{} d {} h", h / 24, h % 24)
    }
}
