//! Events: what starts runs.
//!
//! An event has a name, a JSON payload and optionally an idempotency key; sending
//! it stores it and creates one run per function that it triggers. `insert`
//! (crate-internal) is the one way events are stored: by the engine's sends,
//! by a run's `ctx.send_event` and by the cron tick.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use sqlx::PgConnection;

use crate::error::{Error, from_sqlx};
use crate::limits::{self, LimitError, Limits};
use crate::store;

/// An event to send.
///
/// ```
/// use durastep::Event;
/// let event = Event::new("campaign/budget.requested", &serde_json::json!({"ad_account_id": "act_1"}))
///     .idempotency_key("contact-7:placement:2026-W48")
///     .priority(10);
/// assert_eq!(event.name(), "campaign/budget.requested");
/// ```
#[derive(Debug, Clone)]
pub struct Event {
    name: String,
    payload: Payload,
    idempotency_key: Option<String>,
    start_at: Option<DateTime<Utc>>,
    priority: i32,
}

/// The payload as given; checked against the engine's limits in `prepare`.
#[derive(Debug, Clone)]
enum Payload {
    Value(Value),
    /// Untrusted JSON text from [`Event::from_json`], parsed only after the size check.
    Text(String),
    /// The value did not serialize; the reason is reported on send.
    Unserializable(String),
}

impl Event {
    /// An event with a payload serialized from any `Serialize` value.
    /// A value that fails to serialize is reported when the event is sent.
    ///
    /// ```
    /// let e = durastep::Event::new("user/signed-up", &42);
    /// assert_eq!(e.name(), "user/signed-up");
    /// ```
    pub fn new<T: Serialize + ?Sized>(name: impl Into<String>, payload: &T) -> Self {
        Event {
            name: name.into(),
            payload: match serde_json::to_value(payload) {
                Ok(v) => Payload::Value(v),
                Err(e) => Payload::Unserializable(e.to_string()),
            },
            idempotency_key: None,
            start_at: None,
            priority: 0,
        }
    }

    /// An event whose payload is JSON text, for payloads that arrive as text
    /// (an HTTP body, a queue message). Nothing is parsed here: on send, the
    /// text's byte length is checked against [`Limits::max_payload_bytes`] and its
    /// nesting against [`Limits::max_depth`] before it is parsed, so oversized or
    /// hostile text is refused cheaply with a [`LimitError`], before any SQL runs.
    ///
    /// ```
    /// use durastep::{Event, LimitError, Limits};
    /// let ok = Event::from_json("order/placed", r#"{"order_id": 7}"#);
    /// assert!(ok.validate(&Limits::default()).is_ok());
    /// let bad = Event::from_json("order/placed", r#"{"note": "\u0000"}"#);
    /// assert_eq!(bad.validate(&Limits::default()), Err(LimitError::NulCharacter));
    /// ```
    pub fn from_json(name: impl Into<String>, json: impl Into<String>) -> Self {
        Event {
            name: name.into(),
            payload: Payload::Text(json.into()),
            idempotency_key: None,
            start_at: None,
            priority: 0,
        }
    }

    /// Makes sending idempotent: a second event with the same name and key creates
    /// nothing and returns the first one's ids. The key holds for as long as the
    /// event is stored (until it is pruned with its finished runs).
    ///
    /// ```
    /// let e = durastep::Event::new("deal/stage.changed", &()).idempotency_key("c1:offer:2026-W48");
    /// # let _ = e;
    /// ```
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Starts the event's runs no earlier than this time (by the database clock).
    /// A time after [`limits::max_instant`] (9999-12-31) is cut to it.
    ///
    /// ```
    /// let at = chrono::Utc::now() + chrono::Duration::hours(1);
    /// let e = durastep::Event::new("report/due", &()).start_at(at);
    /// # let _ = e;
    /// ```
    pub fn start_at(mut self, at: DateTime<Utc>) -> Self {
        self.start_at = Some(at);
        self
    }

    /// Priority of the event's runs: higher runs first among due runs (default 0).
    ///
    /// ```
    /// let e = durastep::Event::new("invoice/create", &()).priority(5);
    /// # let _ = e;
    /// ```
    pub fn priority(mut self, priority: i32) -> Self {
        self.priority = priority;
        self
    }

    pub(crate) fn has_idempotency_key(&self) -> bool {
        self.idempotency_key.is_some()
    }

    /// The event's name.
    ///
    /// ```
    /// assert_eq!(durastep::Event::new("a", &()).name(), "a");
    /// ```
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Checks the event against `limits` exactly as [`crate::Engine::send`] does
    /// before it writes anything: the name (a reserved `durastep/` name is
    /// [`LimitError::ReservedName`]), the idempotency key and the payload.
    /// Use it to refuse a bad event early (say, with an HTTP 400).
    ///
    /// ```
    /// use durastep::{Event, Limits};
    /// let e = Event::new("user/signed-up", &serde_json::json!({"id": 1})).idempotency_key("");
    /// assert!(e.validate(&Limits::default()).is_err()); // an empty key is refused
    /// ```
    pub fn validate(&self, limits: &Limits) -> Result<(), LimitError> {
        self.prepare(limits).map(|_| ())
    }

    /// Validates and serializes, before any SQL runs. A user's event may not
    /// carry a reserved name (`durastep/...`).
    pub(crate) fn prepare(&self, limits: &Limits) -> Result<store::NewEvent, LimitError> {
        limits::check_event_name(&self.name, limits)?;
        self.prepare_internal(limits)
    }

    /// Validates and serializes one of the engine's own events (a cron fire
    /// time), whose name is reserved.
    pub(crate) fn prepare_internal(&self, limits: &Limits) -> Result<store::NewEvent, LimitError> {
        limits::check_name("event name", &self.name, limits)?;
        if let Some(key) = &self.idempotency_key {
            limits::check_name("idempotency key", key, limits)?;
        }
        let payload = match &self.payload {
            Payload::Value(value) => limits::check_payload(value, limits)?,
            Payload::Text(text) => limits::check_payload(&limits::parse_payload(text, limits)?, limits)?,
            Payload::Unserializable(e) => return Err(LimitError::Serialize(e.clone())),
        };
        Ok(store::NewEvent {
            // Time-ordered (version 7): the events index takes neighbouring entries (migration 0021).
            id: Uuid::now_v7(),
            name: self.name.clone(),
            payload,
            idempotency_key: self.idempotency_key.clone(),
            start_at: self.start_at.map(limits::clamp_instant),
            priority: self.priority,
        })
    }
}

/// What sending an event did.
///
/// ```
/// # async fn demo(engine: durastep::Engine) -> Result<(), durastep::Error> {
/// let receipt = engine.send(durastep::Event::new("a", &()).idempotency_key("k")).await?;
/// let again = engine.send(durastep::Event::new("a", &()).idempotency_key("k")).await?;
/// assert!(again.duplicate);
/// assert_eq!(receipt.run_ids, again.run_ids);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct SendReceipt {
    /// The stored event (the first one, for a duplicate).
    pub event_id: Uuid,
    /// One run per function the event triggers.
    pub run_ids: Vec<Uuid>,
    /// True when an event with this name and idempotency key was already stored.
    pub duplicate: bool,
}

/// Inserts events (topic locks, fan-out, cancel_on, waits: one statement);
/// with whether the statement notified the workers.
pub(crate) async fn insert(
    conn: &mut PgConnection,
    events: &[store::NewEvent],
    route: store::Route,
) -> Result<(Vec<SendReceipt>, bool), Error> {
    let sent = store::insert_events(conn, events, route).await.map_err(from_sqlx)?;
    Ok(receipts_of(sent))
}

/// The receipts of a send, in input order, with whether it notified the workers.
pub(crate) fn receipts_of(sent: store::Sent) -> (Vec<SendReceipt>, bool) {
    let receipts = sent
        .events
        .into_iter()
        .map(|i| SendReceipt { event_id: i.event_id, run_ids: i.run_ids, duplicate: i.duplicate })
        .collect();
    (receipts, sent.notified)
}
