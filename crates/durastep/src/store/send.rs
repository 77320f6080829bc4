//! Send: events stored and fanned out into runs (`durastep.send_events`,
//! migration 0014), from an application or from a run's step.

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

/// An event ready to insert: validated and serialized.
pub(crate) struct NewEvent {
    pub id: Uuid,
    pub name: String,
    pub payload: String,
    pub idempotency_key: Option<String>,
    pub start_at: Option<DateTime<Utc>>,
    pub priority: i32,
}

/// What one call of [`insert_events`] stored.
pub(crate) struct Sent {
    /// Per event, in input order.
    pub events: Vec<InsertedEvent>,
    /// The statement notified the workers (`durastep_wakeup`): a run it
    /// created is due now, or a waiting run it matched is queued again.
    pub notified: bool,
}

/// What an insert did for one event, in input order.
pub(crate) struct InsertedEvent {
    pub event_id: Uuid,
    pub run_ids: Vec<Uuid>,
    pub duplicate: bool,
}

/// Stores events and fans each out into one run per function it triggers, in one
/// statement: `durastep.send_events` (migration 0014, where the statement's
/// text lives), which first locks the rendezvous rows of the event names
/// (`durastep.topics`) FOR SHARE, creating the missing ones, so that no wait
/// for one of them can be recorded until this transaction ends, and then, in a
/// statement with a fresh snapshot that sees every wait recorded before, does
/// the rest. An event whose (name, idempotency key) is already stored inserts
/// nothing and reports the stored event and its runs. Each new event cancels
/// the unfinished runs that a `cancel_on` of their function matches, and
/// resumes the waits it matches. Notifies the workers once if any run is due
/// now, and says so ([`Sent::notified`]). Outside a transaction it is one
/// round trip and one commit.
///
/// A run cancelled here (by `cancel_on` or a singleton's `CancelOld`) records
/// this transaction in `cancelled_by_xact`: when that is the run's own
/// `step_tx`, the step still commits (see [`checkpoint_in_tx`]). A cancelled
/// running attempt keeps its `worker_id` and lease, and so its concurrency
/// slots, until its worker has stopped it ([`end_cancelled_attempt`]) or its
/// lease has lapsed ([`release_lapsed_cancels`]). Every event sent to a
/// debounced function is recorded with its run (`debounced_events`), so that a
/// duplicate of an event that was merged away still reports its run.
pub(crate) async fn insert_events(conn: &mut PgConnection, events: &[NewEvent]) -> Result<Sent, sqlx::Error> {
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    let payloads: Vec<&str> = events.iter().map(|e| e.payload.as_str()).collect();
    let keys: Vec<Option<&str>> = events.iter().map(|e| e.idempotency_key.as_deref()).collect();
    let starts: Vec<Option<DateTime<Utc>>> = events.iter().map(|e| e.start_at).collect();
    let priorities: Vec<i32> = events.iter().map(|e| e.priority).collect();
    let rows = sqlx::query("SELECT ord, id, inserted, run_ids, _n FROM durastep.send_events($1, $2, $3, $4, $5, $6)")
        .bind(&ids)
        .bind(&names)
        .bind(&payloads)
        .bind(&keys)
        .bind(&starts)
        .bind(&priorities)
        .fetch_all(&mut *conn)
        .await?;

    // `_n` is null-ness of the notify: false on every row when it was sent.
    let notified = match rows.first() {
        Some(row) => !row.try_get::<bool, _>("_n")?,
        None => false,
    };
    let mut out = Vec::with_capacity(rows.len());
    let mut duplicates = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let inserted: bool = row.try_get("inserted")?;
        if !inserted {
            duplicates.push(i);
        }
        out.push(InsertedEvent {
            event_id: row.try_get("id")?,
            run_ids: row.try_get("run_ids")?,
            duplicate: !inserted,
        });
    }
    if !duplicates.is_empty() {
        let names: Vec<&str> = duplicates.iter().map(|&i| events[i].name.as_str()).collect();
        let keys: Vec<&str> = duplicates.iter().map(|&i| events[i].idempotency_key.as_deref().unwrap_or("")).collect();
        let rows = sqlx::query(
            "SELECT t.ord, e.id,
                    ARRAY(SELECT r.id FROM durastep.runs r WHERE r.event_id = e.id
                          UNION SELECT m.run_id FROM durastep.debounced_events m WHERE m.event_id = e.id
                          ORDER BY 1) AS run_ids
               FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS t(name, idem, ord)
               JOIN durastep.events e ON e.name = t.name AND e.idempotency_key = t.idem",
        )
        .bind(&names)
        .bind(&keys)
        .fetch_all(&mut *conn)
        .await?;
        for row in rows {
            let ord: i64 = row.try_get("ord")?;
            let slot = &mut out[duplicates[(ord - 1) as usize]];
            slot.event_id = row.try_get("id")?;
            slot.run_ids = row.try_get("run_ids")?;
        }
    }
    Ok(Sent { events: out, notified })
}
