//! `send` and `events ls`: events in and out.

use std::io::Read;

use durastep::inspect::EventFilter;
use durastep::inspect::Inspector;
use durastep::{Engine, Event};

use crate::cli::{EventsLsArgs, SendArgs};
use crate::error::CliError;
use crate::format;
use crate::output::Out;
use crate::table::Table;

/// Event data is cut shorter in a listing.
const LIST_DATA: usize = 80;

/// `durastep send NAME JSON [--idempotency-key K]`.
pub async fn send(engine: &Engine, args: SendArgs, out: &mut Out) -> Result<(), CliError> {
    let json = if args.data == "-" {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).map_err(|e| CliError::Io(format!("cannot read stdin: {e}")))?;
        text
    } else {
        args.data
    };
    // The engine checks size and nesting before it parses, and refuses bad JSON.
    let mut event = Event::from_json(args.name.clone(), json);
    if let Some(k) = &args.idempotency_key {
        event = event.idempotency_key(k.clone());
    }
    let receipt = engine.send(event).await?;
    if out.json {
        return out.json(&receipt);
    }
    let runs = receipt.run_ids.len();
    if receipt.duplicate {
        out.line(format!(
            "duplicate: event {} with this name and idempotency key was already stored; nothing was sent",
            receipt.event_id
        ));
    } else {
        out.line(format!("event {} stored, {runs} run(s) started", receipt.event_id));
    }
    for id in &receipt.run_ids {
        out.line(format!("  run {id}"));
    }
    if runs == 0 {
        out.line(format!("no registered function is triggered by {:?}", args.name));
    }
    Ok(())
}

/// `durastep events ls [--name N]`.
pub async fn list(inspector: &Inspector, args: EventsLsArgs, out: &mut Out) -> Result<(), CliError> {
    let mut filter = EventFilter::new();
    if let Some(name) = args.name {
        filter = filter.name(name);
    }
    if let Some(n) = args.limit {
        filter = filter.limit(n);
    }
    if let Some(c) = args.after {
        filter = filter.after(c);
    }
    let page = inspector.events(&filter).await?;
    if out.json {
        return out.json(&page);
    }
    if page.events.is_empty() {
        out.line("no events match");
    } else {
        let mut table = Table::new(&["ID", "NAME", "CREATED", "RUNS", "IDEMPOTENCY KEY", "DATA"]);
        for e in &page.events {
            table.row(vec![
                e.id.to_string(),
                e.name.clone(),
                format::time(e.created_at),
                e.runs.to_string(),
                e.idempotency_key.clone().unwrap_or_else(|| "-".into()),
                format::json_cell(&e.data, LIST_DATA, args.full),
            ]);
        }
        out.block(&table.render());
    }
    if let Some(next) = page.next {
        out.line(format!("next page: --after {next}"));
    }
    Ok(())
}
