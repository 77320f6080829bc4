//! `runs ls`, `runs replay` and `runs cancel`.

use durastep::inspect::RunFilter;
use durastep::{Engine, ReplayFrom, RunState};
use serde::Serialize;
use uuid::Uuid;

use crate::cli::{CancelArgs, FilterArgs, LsArgs, ReplayArgs};
use crate::error::CliError;
use crate::format;
use crate::output::Out;
use crate::table::Table;

/// Errors are cut shorter in a listing than in `runs show`.
const LIST_ERROR: usize = 80;

fn filter_of(args: &FilterArgs) -> RunFilter {
    let mut f = RunFilter::new();
    if let Some(function) = &args.function {
        f = f.function(function.clone());
    }
    for state in &args.states {
        f = f.state(*state);
    }
    if let Some(t) = args.since {
        f = f.created_after(t);
    }
    if let Some(t) = args.until {
        f = f.created_before(t);
    }
    if let Some((pointer, value)) = &args.key {
        f = f.data(pointer.clone(), value.clone());
    }
    if let Some(key) = &args.idempotency_key {
        f = f.idempotency_key(key.clone());
    }
    if let Some(name) = &args.event {
        f = f.event_name(name.clone());
    }
    f
}

/// `durastep runs ls`: one page of runs, and the cursor of the next.
pub async fn list(engine: &Engine, args: LsArgs, out: &mut Out) -> Result<(), CliError> {
    let mut filter = filter_of(&args.filter);
    if let Some(n) = args.limit {
        filter = filter.limit(n);
    }
    if let Some(c) = args.after {
        filter = filter.after(c);
    }
    let page = engine.inspect().runs(&filter).await?;
    if out.json {
        return out.json(&page);
    }
    if page.runs.is_empty() {
        out.line("no runs match");
    } else {
        let mut table = Table::new(&["ID", "FUNCTION", "STATE", "ATTEMPT", "CREATED", "FINISHED", "EVENT", "ERROR"]);
        for r in &page.runs {
            table.row(vec![
                r.id.to_string(),
                r.function_id.clone(),
                r.state.as_str().to_owned(),
                format!("{}/{}", r.attempt, r.max_attempts),
                format::time(r.created_at),
                format::opt_time(r.finished_at),
                r.event_name.clone(),
                r.last_error.as_deref().map(|e| format::cell(e, LIST_ERROR, args.full)).unwrap_or_default(),
            ]);
        }
        out.block(&table.render());
    }
    if let Some(next) = page.next {
        out.line(format!("next page: --after {next}"));
    }
    Ok(())
}

/// `durastep runs replay`: one run by id, or every matching dead run.
pub async fn replay(engine: &Engine, args: ReplayArgs, out: &mut Out) -> Result<(), CliError> {
    let from = if args.from_start { ReplayFrom::Start } else { ReplayFrom::FailedStep };
    let f = &args.filter;
    let filtered = f.function.is_some()
        || !f.states.is_empty()
        || f.since.is_some()
        || f.until.is_some()
        || f.key.is_some()
        || f.idempotency_key.is_some()
        || f.event.is_some();
    let Some(id) = args.id else {
        if f.function.is_none() && f.states.is_empty() {
            return Err(CliError::Usage(
                "a bulk replay needs --function or --state (or give one run id); nothing was replayed".into(),
            ));
        }
        let ids = engine.replay_many(&filter_of(f), from).await?;
        if out.json {
            #[derive(Serialize)]
            struct Bulk {
                replayed: usize,
                run_ids: Vec<Uuid>,
            }
            return out.json(&Bulk { replayed: ids.len(), run_ids: ids });
        }
        out.line(format!("{} run(s) queued again{}", ids.len(), from_note(from)));
        return Ok(());
    };
    if filtered {
        return Err(CliError::Usage("give a run id or filters, not both; nothing was replayed".into()));
    }
    let run = engine.replay(id, from).await?;
    if out.json {
        return out.json(&run);
    }
    out.line(format!(
        "run {} ({}) is {} again{}: attempt {} of {}",
        run.id,
        run.function_id,
        run.state.as_str(),
        from_note(from),
        run.attempt,
        run.max_attempts
    ));
    Ok(())
}

fn from_note(from: ReplayFrom) -> &'static str {
    match from {
        ReplayFrom::Start => ", from the start",
        _ => ", from the failed step",
    }
}

/// `durastep runs cancel`.
pub async fn cancel(engine: &Engine, args: CancelArgs, out: &mut Out) -> Result<(), CliError> {
    engine.cancel(args.id, &args.reason).await?;
    if out.json {
        #[derive(Serialize)]
        struct Cancelled<'a> {
            run_id: Uuid,
            state: RunState,
            reason: &'a str,
        }
        return out.json(&Cancelled { run_id: args.id, state: RunState::Cancelled, reason: &args.reason });
    }
    out.line(format!("run {} cancelled: {}", args.id, args.reason));
    Ok(())
}
