//! `runs ls`, `runs replay`, `runs cancel`, and `runs resume` and `runs discard` for diverged runs.

use durastep::inspect::{Inspector, RunFilter};
use durastep::{Engine, ReplayFrom, RunState};
use serde::Serialize;
use uuid::Uuid;

use crate::cli::{CancelArgs, DiscardArgs, FilterArgs, LsArgs, ReplayArgs, ResumeArgs};
use crate::error::CliError;
use crate::format;
use crate::output::Out;
use crate::table::Table;

/// Errors are cut shorter in a listing than in `runs show`.
const LIST_ERROR: usize = 80;

/// The filter the arguments describe: relative times are resolved on the
/// database clock, and a function no engine registered is an error (not an
/// empty list).
async fn filter_of(inspector: &Inspector, args: &FilterArgs) -> Result<RunFilter, CliError> {
    if let Some(function) = &args.function {
        let known = inspector.functions().await?;
        if !known.iter().any(|f| &f.id == function) {
            let names: Vec<&str> = known.iter().map(|f| f.id.as_str()).collect();
            return Err(CliError::Usage(format!(
                "no function is called {function:?} (registered: {})",
                if names.is_empty() { "none".to_owned() } else { names.join(", ") }
            )));
        }
    }
    let db_now = if args.since.is_some() || args.until.is_some() { Some(inspector.db_now().await?) } else { None };
    Ok(filter_at(args, db_now))
}

fn filter_at(args: &FilterArgs, db_now: Option<chrono::DateTime<chrono::Utc>>) -> RunFilter {
    let now = db_now.unwrap_or_else(chrono::Utc::now);
    let mut f = RunFilter::new();
    if let Some(function) = &args.function {
        f = f.function(function.clone());
    }
    for state in &args.states {
        f = f.state(*state);
    }
    if let Some(t) = args.since {
        f = f.created_after(t.resolve(now));
    }
    if let Some(t) = args.until {
        f = f.created_before(t.resolve(now));
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
pub async fn list(inspector: &Inspector, args: LsArgs, out: &mut Out) -> Result<(), CliError> {
    let mut filter = filter_of(inspector, &args.filter).await?;
    if let Some(n) = args.limit {
        filter = filter.limit(n);
    }
    if let Some(c) = args.after {
        filter = filter.after(c);
    }
    let page = inspector.runs(&filter).await?;
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
                r.last_error
                    .as_deref()
                    .map(|e| super::show::error_cell(r.error_standing, format::cell(e, LIST_ERROR, args.full)))
                    .unwrap_or_default(),
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
        if let Some(s) = f.states.iter().find(|s| !matches!(s, RunState::Failed | RunState::Cancelled)) {
            return Err(CliError::Usage(format!(
                "only failed or cancelled runs can be replayed, not {} ones; nothing was replayed",
                s.as_str()
            )));
        }
        let filter = filter_of(&engine.inspect(), f).await?;
        let ids = engine.replay_many(&filter, from).await?;
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
    // The replay queued it; a worker may have claimed (or finished) it before it was read back.
    let now = match run.state {
        RunState::Queued => String::new(),
        state => format!(" (already {})", state.as_str()),
    };
    out.line(format!(
        "run {} ({}) is queued again{}: attempt {} of {}{now}",
        run.id,
        run.function_id,
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

/// What `runs resume` and `runs discard` print with `--json`.
#[derive(Serialize)]
struct Requeued {
    run_id: Uuid,
    /// `resumed` or `discarded`.
    action: &'static str,
    /// The first position forgotten (discard only).
    #[serde(skip_serializing_if = "Option::is_none")]
    from: Option<u32>,
    state: RunState,
}

/// `durastep runs resume`: a diverged run queued again as it is.
pub async fn resume(engine: &Engine, args: ResumeArgs, out: &mut Out) -> Result<(), CliError> {
    engine.resume_diverged(args.id).await?;
    if out.json {
        return out.json(&Requeued { run_id: args.id, action: "resumed", from: None, state: RunState::Queued });
    }
    out.line(format!("run {} queued again as it is: it replays on the deployed code", args.id));
    Ok(())
}

/// `durastep runs discard`: a diverged run's entries from a position on
/// forgotten, and the run queued.
pub async fn discard(engine: &Engine, args: DiscardArgs, out: &mut Out) -> Result<(), CliError> {
    engine.discard_from(args.id, args.from).await?;
    if out.json {
        return out.json(&Requeued {
            run_id: args.id,
            action: "discarded",
            from: Some(args.from),
            state: RunState::Queued,
        });
    }
    out.line(format!(
        "run {} queued again without its entries from position {} on: the deployed code executes them afresh",
        args.id, args.from
    ));
    Ok(())
}
