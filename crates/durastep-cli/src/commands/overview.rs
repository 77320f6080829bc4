//! `stats` and `functions`: the whole system at a glance.

use std::collections::BTreeMap;
use std::time::Duration;

use durastep::RunState;
use durastep::inspect::Inspector;
use serde::Serialize;

use crate::error::CliError;
use crate::format;
use crate::output::Out;
use crate::table::Table;

const HOUR: Duration = Duration::from_secs(3_600);

/// `durastep stats`: runs per function and state, then the last hour.
pub async fn stats(inspector: &Inspector, out: &mut Out) -> Result<(), CliError> {
    let (counts, minutes) = tokio::try_join!(inspector.counts(), inspector.per_minute(HOUR))?;
    if out.json {
        #[derive(Serialize)]
        struct Stats<'a> {
            counts: &'a [durastep::inspect::StateCount],
            per_minute: &'a [durastep::inspect::MinuteCount],
        }
        return out.json(&Stats { counts: &counts, per_minute: &minutes });
    }

    let mut by_function: BTreeMap<&str, [i64; RunState::ALL.len()]> = BTreeMap::new();
    for c in &counts {
        let i = RunState::ALL.iter().position(|s| *s == c.state).unwrap_or(0);
        by_function.entry(c.function_id.as_str()).or_default()[i] += c.count;
    }
    if by_function.is_empty() {
        out.line("no runs");
    } else {
        let mut headers = vec!["FUNCTION"];
        headers.extend(RunState::ALL.iter().map(|s| header(*s)));
        headers.push("TOTAL");
        let mut table = Table::new(&headers);
        let mut totals = [0i64; RunState::ALL.len()];
        for (function, n) in &by_function {
            let mut row = vec![(*function).to_owned()];
            row.extend(n.iter().map(|c| c.to_string()));
            row.push(n.iter().sum::<i64>().to_string());
            for (t, c) in totals.iter_mut().zip(n) {
                *t += c;
            }
            table.row(row);
        }
        if by_function.len() > 1 {
            let mut row = vec!["(all)".to_owned()];
            row.extend(totals.iter().map(|c| c.to_string()));
            row.push(totals.iter().sum::<i64>().to_string());
            table.row(row);
        }
        out.block(&table.render());
    }

    let created: i64 = minutes.iter().map(|m| m.created).sum();
    let completed: i64 = minutes.iter().map(|m| m.completed).sum();
    let failed: i64 = minutes.iter().map(|m| m.failed).sum();
    let mut summary = format!(
        "last hour: {created} created, {completed} completed, {failed} failed, in {} active minute(s)",
        minutes.len()
    );
    if let Some(peak) = minutes.iter().max_by_key(|m| (m.created + m.completed + m.failed, m.minute)) {
        summary.push_str(&format!(
            "; busiest {} ({} created, {} completed, {} failed)",
            format::time(peak.minute),
            peak.created,
            peak.completed,
            peak.failed
        ));
    }
    out.line("");
    out.line(summary);
    Ok(())
}

fn header(state: RunState) -> &'static str {
    match state {
        RunState::Queued => "QUEUED",
        RunState::Running => "RUNNING",
        RunState::Sleeping => "SLEEPING",
        RunState::Waiting => "WAITING",
        RunState::Completed => "COMPLETED",
        RunState::Failed => "FAILED",
        RunState::Cancelled => "CANCELLED",
        RunState::Skipped => "SKIPPED",
        RunState::Diverged => "DIVERGED",
        _ => "OTHER",
    }
}

/// `durastep functions`: what is registered, with schedules and rules.
pub async fn functions(inspector: &Inspector, out: &mut Out) -> Result<(), CliError> {
    let functions = inspector.functions().await?;
    if out.json {
        return out.json(&functions);
    }
    if functions.is_empty() {
        out.line("no functions registered (a worker registers its functions when it starts)");
        return Ok(());
    }
    let mut table = Table::new(&["ID", "TRIGGERS", "ATTEMPTS", "CRON", "RULES"]);
    for f in &functions {
        let cron = match &f.cron {
            Some(c) => format!("{} ({}), next {}", c.expr, c.tz, format::opt_time(c.next_fire_at)),
            None => "-".into(),
        };
        let rules: Vec<String> = f
            .rules
            .iter()
            .map(|rule| {
                let mut r = format!("{}: {} {}", rule.name, rule.kind, rule.limit);
                if let Ok(period) = Duration::try_from_secs_f64(rule.period_secs)
                    && !period.is_zero()
                {
                    r.push_str(&format!(" per {}", format::duration(period)));
                }
                if let Some(key) = &rule.key {
                    r.push_str(&format!(" by {key}"));
                }
                r
            })
            .collect();
        table.row(vec![
            f.id.clone(),
            if f.triggers.is_empty() { "-".into() } else { f.triggers.join(", ") },
            f.max_attempts.to_string(),
            cron,
            if rules.is_empty() { "-".into() } else { rules.join("; ") },
        ]);
    }
    out.block(&table.render());
    Ok(())
}
