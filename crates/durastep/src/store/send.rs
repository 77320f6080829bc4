//! Send: events stored and fanned out into runs (`durastep.send_events`,
//! migration 0014), from an application or from a run's step.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::claim::{Records, claimed_runs};
use super::{ClaimedRun, Handled, secs};

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
///
/// By [`Route::Offers`], a batch of one event due now goes to an idle worker
/// of any process that offered its slots, if one did
/// (`durastep.send_events_offered`, migration 0036): the new runs come back
/// claimed for it, and it is told on its secret channel.
pub(crate) async fn insert_events(
    conn: &mut PgConnection,
    events: &[NewEvent],
    route: Route,
) -> Result<Sent, sqlx::Error> {
    let ids: Vec<Uuid> = events.iter().map(|e| e.id).collect();
    let names: Vec<&str> = events.iter().map(|e| e.name.as_str()).collect();
    let payloads: Vec<&str> = events.iter().map(|e| e.payload.as_str()).collect();
    let keys: Vec<Option<&str>> = events.iter().map(|e| e.idempotency_key.as_deref()).collect();
    let starts: Vec<Option<DateTime<Utc>>> = events.iter().map(|e| e.start_at).collect();
    let priorities: Vec<i32> = events.iter().map(|e| e.priority).collect();
    let statement = match route {
        Route::Queue => "SELECT ord, id, inserted, run_ids, _n FROM durastep.send_events($1, $2, $3, $4, $5, $6)",
        Route::Offers => {
            "SELECT ord, id, inserted, run_ids, _n FROM durastep.send_events_offered($1, $2, $3, $4, $5, $6)"
        }
    };
    let rows = sqlx::query(statement)
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
    report_duplicates(conn, events, &mut out, &duplicates).await?;
    Ok(Sent { events: out, notified })
}

/// Where a send's new runs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Queued, for whichever worker claims them first: every batch, and every
    /// send inside a caller's transaction (its commit may come much later
    /// than the claim a hand-over would make).
    Queue,
    /// A one-event send due now, in its own transaction: to an idle worker
    /// of any process that offered its slots, else queued.
    Offers,
}

/// Fills in, for the events at `duplicates` (their (name, idempotency key)
/// was stored already), the stored event and its runs.
async fn report_duplicates(
    conn: &mut PgConnection,
    events: &[NewEvent],
    out: &mut [InsertedEvent],
    duplicates: &[usize],
) -> Result<(), sqlx::Error> {
    if duplicates.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = duplicates.iter().map(|&i| events[i].name.as_str()).collect();
    let keys: Vec<&str> = duplicates.iter().map(|&i| events[i].idempotency_key.as_deref().unwrap_or("")).collect();
    // The event's runs by their keys (migration 0042: no index of `runs`
    // names `event_id`).
    let rows = sqlx::query(
        "SELECT t.ord, e.id,
                    ARRAY(SELECT k.run_id FROM durastep.run_keys k WHERE k.event_id = e.id
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
    Ok(())
}

/// An idle worker of the sender's process that a send may hand its new runs
/// to: who claims them, for how long, which (function, version) pairs it runs
/// by the fast claim, and how many it would start at once.
pub(crate) struct HandTo<'a> {
    pub worker_id: Uuid,
    pub lease: Duration,
    pub functions: &'a Handled,
    pub slots: usize,
}

/// Sends one event due now, as [`insert_events`] does, and in the same
/// transaction claims for the worker `to` the runs it created that the fast
/// claim would give that worker, when no other run is due
/// (`durastep.send_event_to_worker`, migrations 0024, 0025 and 0035, which
/// also names the claim record of the runs it hands on): they come back
/// claimed (inserted `running` when the send needs none of the fan-out's
/// rarer work), and no other worker can ever see them queued. Its own
/// transaction: one round trip, one commit.
pub(crate) async fn insert_event_handing(
    conn: &mut PgConnection,
    event: &NewEvent,
    to: &HandTo<'_>,
) -> Result<(Sent, Vec<ClaimedRun>), sqlx::Error> {
    let rows = sqlx::query("SELECT * FROM durastep.send_event_to_worker($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)")
        .bind(event.id)
        .bind(&event.name)
        .bind(&event.payload)
        .bind(event.idempotency_key.as_deref())
        .bind(event.priority)
        .bind(to.worker_id)
        .bind(secs(to.lease))
        .bind(&to.functions.version_ids)
        .bind(&to.functions.versions)
        .bind(i32::try_from(to.slots).unwrap_or(i32::MAX))
        .fetch_all(&mut *conn)
        .await?;
    let Some(first) = rows.first() else {
        return Err(sqlx::Error::RowNotFound);
    };
    let inserted: bool = first.try_get("sent_inserted")?;
    // `sent_n` is the null-ness of the notify: false when it was sent.
    let notified = !first.try_get::<bool, _>("sent_n")?;
    let mut sent = Sent {
        events: vec![InsertedEvent {
            event_id: first.try_get("sent_id")?,
            run_ids: first.try_get("sent_run_ids")?,
            duplicate: !inserted,
        }],
        notified,
    };
    if !inserted {
        report_duplicates(conn, std::slice::from_ref(event), &mut sent.events, &[0]).await?;
    }
    let (handed, _) = claimed_runs(rows, Records::New)?;
    Ok((sent, handed))
}
