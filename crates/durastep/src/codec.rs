//! Optional encryption at rest of everything the engine stores for a run.
//!
//! # Stored format (version 2)
//!
//! A stored step result or run output is one of:
//!
//! - **sealed** (a [`Keyring`] is configured):
//!   `{"$durastep": "sealed", "v": 2, "alg": "xchacha20poly1305", "kid", "nonce", "ct"}`:
//!   XChaCha20-Poly1305 with a random 192-bit nonce and the key id beside the
//!   ciphertext. The associated data binds the record's kind (step result,
//!   run output, wait result, child outcome), its run id and its step key (for a
//!   run output: the parent run and step it answers, for a child run), so a
//!   ciphertext moved to another run, step or kind fails to open.
//! - **plain** (no keyring): the user's JSON as is, except that a value that is
//!   an object with a `"$durastep"` key is stored escaped as
//!   `{"$durastep": "plain", "value": ...}`. So a stored object with that key
//!   was always written by the engine, and user data is never mistaken for an
//!   envelope, whatever it looks like.
//! - **legacy sealed** (version 1, written before this format):
//!   `{"$sealed": "xchacha20poly1305", "kid", "nonce", "ct"}`; opened only when
//!   a keyring is configured (without one it is user data like any other).
//!
//! # Integrity
//!
//! With a keyring, a value that is not sealed is refused with
//! [`CodecError::Plaintext`]: anyone who can write to the database could have
//! put it there. Values stored before encryption was turned on are read only
//! during an explicit migration window, [`Keyring::accept_plaintext_until`].
//! Wait results and child outcomes are written by SQL (the sender's or the
//! child's transaction, which holds no key) as plain records: the engine
//! authenticates them from their source the first time it reads them and
//! stores them sealed (see `Ctx::wait_for_event` and `Ctx::invoke`).
//!
//! Architecture invariant: sealing happens after the input limits are checked
//! (limits apply to the plaintext) and before any SQL; opening happens before a
//! stored value is handed to user code or shown.

use std::collections::HashMap;
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use uuid::Uuid;

const ALGORITHM: &str = "xchacha20poly1305";
/// The key that marks a record written by the engine (sealed or escaped).
pub(crate) const MARK: &str = "$durastep";
/// The stored format version of sealed records.
const FORMAT_VERSION: u64 = 2;

/// Why a stored value could not be opened.
///
/// ```
/// use durastep::{CodecError, Keyring};
/// let err = Keyring::from_base64("k1", "not base64!").unwrap_err();
/// assert!(matches!(err, CodecError::BadKey(_)));
/// ```
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CodecError {
    /// The value was sealed with a key id this keyring does not hold.
    #[error("sealed with unknown key id {0:?}")]
    UnknownKey(String),
    /// Authentication failed: wrong key, tampered data, or moved to another run, step or kind of record.
    #[error("sealed value does not authenticate (tampered, or moved to another run, step or kind of record)")]
    Tampered,
    /// The envelope is not well formed.
    #[error("malformed sealed value: {0}")]
    Malformed(&'static str),
    /// A key is not 32 bytes of base64.
    #[error("bad key: {0}")]
    BadKey(&'static str),
    /// A value is sealed but the engine has no keyring.
    #[error("value is sealed but no keyring is configured")]
    NoKeyring,
    /// A keyring is configured but the value is stored in plaintext: written by
    /// someone who holds no key (forged), or stored before encryption was turned
    /// on (read those during [`Keyring::accept_plaintext_until`]).
    #[error(
        "value is stored in plaintext but encryption is on (forged, or stored before encryption was turned on: see Keyring::accept_plaintext_until)"
    )]
    Plaintext,
    /// A wait result or child outcome written by SQL does not match its source.
    #[error("stored {0} does not match its source (forged)")]
    Unauthentic(&'static str),
}

/// What a stored record is; bound into the associated data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A step result (`ctx.step`, `step_tx`, `send_event`, a sleep record).
    Step,
    /// A run's output.
    Output,
    /// A wait result (`ctx.wait_for_event`).
    Wait,
    /// A child outcome (`ctx.invoke`).
    Child,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Step => "step",
            Kind::Output => "output",
            Kind::Wait => "wait",
            Kind::Child => "child",
        }
    }
}

/// Where a record is stored: its kind, run and step key. The associated data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Place {
    kind: Kind,
    run_id: Uuid,
    /// The step key; for a run output, the parent binding (`<parent id>\0<step key>`) or empty.
    key: String,
}

impl Place {
    /// A step-keyed record of `run_id` (step result, wait result, child outcome).
    pub(crate) fn step(kind: Kind, run_id: Uuid, key: &str) -> Self {
        Place { kind, run_id, key: key.to_owned() }
    }

    /// The output of `run_id`; `parent` is the run and step that invoked it, if any.
    pub(crate) fn output(run_id: Uuid, parent: Option<(Uuid, &str)>) -> Self {
        let key = parent.map(|(p, k)| format!("{p}\0{k}")).unwrap_or_default();
        Place { kind: Kind::Output, run_id, key }
    }

    fn aad(&self) -> String {
        format!("durastep/v{FORMAT_VERSION}\0{}\0{}\0{}", self.kind.as_str(), self.run_id, self.key)
    }

    /// The associated data of a version-1 envelope at this place, if version 1
    /// may be read here without the migration window: step results (bound to
    /// run and step) and outputs of runs without a parent (bound to the run).
    /// A version-1 child output had no parent binding (it could be
    /// transplanted into another parent), so it reads only in the window.
    fn legacy_aad(&self) -> Option<String> {
        match self.kind {
            Kind::Step => Some(format!("durastep/step\0{}\0{}", self.run_id, self.key)),
            Kind::Output if self.key.is_empty() => Some(format!("durastep/output\0{}", self.run_id)),
            _ => None,
        }
    }

    fn legacy_aad_in_window(&self) -> String {
        match self.kind {
            Kind::Output => format!("durastep/output\0{}", self.run_id),
            _ => format!("durastep/step\0{}\0{}", self.run_id, self.key),
        }
    }
}

/// Keys for sealing everything the engine stores for a run; see [`crate::EngineBuilder::encryption`].
///
/// ```
/// use durastep::Keyring;
/// let keyring = Keyring::new("2026-q4", [7u8; 32]).with_old_key("2026-q3", [3u8; 32]);
/// assert_eq!(keyring.current_key_id(), "2026-q4");
/// ```
#[derive(Clone)]
pub struct Keyring {
    current: String,
    keys: HashMap<String, XChaCha20Poly1305>,
    plaintext_until: Option<DateTime<Utc>>,
}

impl Keyring {
    /// A keyring whose current key (used to seal) is `key`.
    ///
    /// ```
    /// let k = durastep::Keyring::new("k1", [1u8; 32]);
    /// # let _ = k;
    /// ```
    pub fn new(key_id: impl Into<String>, key: [u8; 32]) -> Self {
        let current = key_id.into();
        let mut keys = HashMap::new();
        keys.insert(current.clone(), XChaCha20Poly1305::new(&key.into()));
        Keyring { current, keys, plaintext_until: None }
    }

    /// A keyring from a base64-encoded 32-byte key (as kept in a secret store).
    ///
    /// ```
    /// let k = durastep::Keyring::from_base64("k1", "AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=").unwrap();
    /// assert_eq!(k.current_key_id(), "k1");
    /// ```
    pub fn from_base64(key_id: impl Into<String>, key: &str) -> Result<Self, CodecError> {
        Ok(Keyring::new(key_id, decode_key(key)?))
    }

    /// Adds an older key that still opens values but no longer seals new ones.
    ///
    /// ```
    /// let k = durastep::Keyring::new("new", [2u8; 32]).with_old_key("old", [1u8; 32]);
    /// # let _ = k;
    /// ```
    pub fn with_old_key(mut self, key_id: impl Into<String>, key: [u8; 32]) -> Self {
        let id = key_id.into();
        if id != self.current {
            self.keys.insert(id, XChaCha20Poly1305::new(&key.into()));
        }
        self
    }

    /// The migration window for turning encryption on over existing data:
    /// until `until` (by this process's clock), values stored in plaintext
    /// (before encryption was on) are read as they are, and version-1 child
    /// outputs (no parent binding) open. After it, a plaintext value is refused
    /// with [`CodecError::Plaintext`]: anyone who can write to the database
    /// could have forged it. Without this call there is no window.
    ///
    /// Keep the window as short as the runs that were in flight when you turned
    /// encryption on need (they finish, or are replayed, within it); everything
    /// written meanwhile is sealed.
    ///
    /// ```
    /// use chrono::{Duration, Utc};
    /// let k = durastep::Keyring::new("k1", [1u8; 32]).accept_plaintext_until(Utc::now() + Duration::days(7));
    /// assert!(k.accepts_plaintext());
    /// ```
    pub fn accept_plaintext_until(mut self, until: DateTime<Utc>) -> Self {
        self.plaintext_until = Some(until);
        self
    }

    /// Whether plaintext values are read now (inside the migration window of
    /// [`Keyring::accept_plaintext_until`]).
    ///
    /// ```
    /// assert!(!durastep::Keyring::new("k1", [1u8; 32]).accepts_plaintext());
    /// ```
    pub fn accepts_plaintext(&self) -> bool {
        self.plaintext_until.is_some_and(|until| Utc::now() < until)
    }

    /// The id of the key that seals new values.
    ///
    /// ```
    /// assert_eq!(durastep::Keyring::new("a", [0u8; 32]).current_key_id(), "a");
    /// ```
    pub fn current_key_id(&self) -> &str {
        &self.current
    }

    /// Seals JSON text at `place`.
    fn seal(&self, place: &Place, plain: &str) -> Value {
        let cipher = &self.keys[&self.current];
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        let aad = place.aad();
        // Encryption with a valid key and nonce cannot fail for in-memory buffers.
        let ct = cipher.encrypt(&nonce, Payload { msg: plain.as_bytes(), aad: aad.as_bytes() }).unwrap_or_default();
        json!({
            MARK: "sealed", "v": FORMAT_VERSION, "alg": ALGORITHM,
            "kid": self.current, "nonce": B64.encode(nonce), "ct": B64.encode(ct),
        })
    }

    fn decrypt(&self, env: &serde_json::Map<String, Value>, aad: &str) -> Result<Value, CodecError> {
        let kid = env.get("kid").and_then(Value::as_str).ok_or(CodecError::Malformed("kid"))?;
        let cipher = self.keys.get(kid).ok_or_else(|| CodecError::UnknownKey(kid.to_owned()))?;
        let field = |name: &'static str| -> Result<Vec<u8>, CodecError> {
            let text = env.get(name).and_then(Value::as_str).ok_or(CodecError::Malformed(name))?;
            B64.decode(text).map_err(|_| CodecError::Malformed(name))
        };
        let nonce: [u8; 24] = field("nonce")?.try_into().map_err(|_| CodecError::Malformed("nonce"))?;
        let ct = field("ct")?;
        let plain = cipher
            .decrypt(&XNonce::from(nonce), Payload { msg: &ct, aad: aad.as_bytes() })
            .map_err(|_| CodecError::Tampered)?;
        serde_json::from_slice(&plain).map_err(|_| CodecError::Malformed("plaintext"))
    }
}

/// What a stored value is, by its format.
pub(crate) enum Stored<'v> {
    /// Sealed, format version 2.
    Sealed(&'v serde_json::Map<String, Value>),
    /// Escaped plain user data (written without a keyring).
    Escaped(&'v Value),
    /// Sealed, format version 1 (only meaningful with a keyring).
    Legacy(&'v serde_json::Map<String, Value>),
    /// Anything else: plain JSON.
    Plain,
}

/// Classifies a stored value. An object with a `"$durastep"` key that is
/// neither form is malformed (user data with that key is always escaped).
pub(crate) fn classify(value: &Value) -> Result<Stored<'_>, CodecError> {
    let Some(map) = value.as_object() else { return Ok(Stored::Plain) };
    match map.get(MARK) {
        Some(Value::String(s)) if s == "sealed" => {
            if map.get("v").and_then(Value::as_u64) != Some(FORMAT_VERSION) {
                return Err(CodecError::Malformed("unknown format version"));
            }
            if map.get("alg").and_then(Value::as_str) != Some(ALGORITHM) {
                return Err(CodecError::Malformed("unknown algorithm"));
            }
            Ok(Stored::Sealed(map))
        }
        Some(Value::String(s)) if s == "plain" => {
            map.get("value").map(Stored::Escaped).ok_or(CodecError::Malformed("value"))
        }
        Some(_) => Err(CodecError::Malformed("record format")),
        None if map.get("$sealed").and_then(Value::as_str) == Some(ALGORITHM) => Ok(Stored::Legacy(map)),
        None => Ok(Stored::Plain),
    }
}

/// Whether a stored value is plaintext that a keyring would have to refuse
/// (neither sealed form): a record written by SQL, or forged.
pub(crate) fn is_unsealed(value: &Value) -> bool {
    matches!(classify(value), Ok(Stored::Plain | Stored::Escaped(_)))
}

fn decode_key(key: &str) -> Result<[u8; 32], CodecError> {
    let bytes = B64.decode(key.trim()).map_err(|_| CodecError::BadKey("not base64"))?;
    bytes.try_into().map_err(|_| CodecError::BadKey("must be 32 bytes"))
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ids: Vec<&String> = self.keys.keys().collect();
        ids.sort();
        f.debug_struct("Keyring")
            .field("current", &self.current)
            .field("key_ids", &ids)
            .field("plaintext_until", &self.plaintext_until)
            .finish()
    }
}

/// The stored text of `text` (the checked JSON of `value`) at `place`:
/// sealed with a keyring; otherwise the text, escaped when `value` is an
/// object with the engine's mark.
pub(crate) fn seal_text(keyring: Option<&Keyring>, place: &Place, value: &Value, text: String) -> String {
    match keyring {
        Some(k) => k.seal(place, &text).to_string(),
        None if value.as_object().is_some_and(|m| m.contains_key(MARK)) => {
            format!(r#"{{"{MARK}":"plain","value":{text}}}"#)
        }
        None => text,
    }
}

/// Seals a record the engine has authenticated (a wait result or child
/// outcome written by SQL), to store it in place of the plain one.
pub(crate) fn seal_record(keyring: &Keyring, place: &Place, record: &Value) -> String {
    keyring.seal(place, &record.to_string()).to_string()
}

/// Opens a stored value at `place`.
///
/// With a keyring: a sealed value opens (or fails typed); plaintext is refused
/// with [`CodecError::Plaintext`] outside the migration window. Without one:
/// a sealed value is [`CodecError::NoKeyring`]; anything else is user data
/// (escaped data unescaped; a legacy-looking envelope is data too).
pub(crate) fn open_value(keyring: Option<&Keyring>, place: &Place, value: Value) -> Result<Value, CodecError> {
    let window = keyring.is_some_and(Keyring::accepts_plaintext);
    match (classify(&value)?, keyring) {
        (Stored::Sealed(env), Some(k)) => k.decrypt(env, &place.aad()),
        (Stored::Sealed(_), None) => Err(CodecError::NoKeyring),
        (Stored::Legacy(env), Some(k)) => match place.legacy_aad() {
            Some(aad) => k.decrypt(env, &aad),
            None if window => k.decrypt(env, &place.legacy_aad_in_window()),
            None => Err(CodecError::Tampered),
        },
        (Stored::Escaped(inner), None) => Ok(inner.clone()),
        (Stored::Escaped(inner), Some(_)) if window => Ok(inner.clone()),
        (Stored::Plain, Some(_)) if !window => Err(CodecError::Plaintext),
        (Stored::Escaped(_), Some(_)) => Err(CodecError::Plaintext),
        (Stored::Legacy(_) | Stored::Plain, _) => Ok(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(k: &Keyring, place: &Place, text: &str) -> Value {
        serde_json::from_str(&seal_text(Some(k), place, &Value::Null, text.to_owned())).unwrap()
    }

    #[test]
    fn round_trip_rotation_and_binding() {
        let run = Uuid::new_v4();
        let a = Place::step(Kind::Step, run, "a");
        let old = Keyring::new("k1", [1; 32]);
        let value = sealed(&old, &a, r#"{"token":"secret"}"#);
        assert!(!value.to_string().contains("secret"));
        assert_eq!(value["v"], 2);
        assert_eq!(open_value(Some(&old), &a, value.clone()).unwrap(), json!({"token": "secret"}));
        // Moved to another step, run or kind of record: refused.
        for other in [
            Place::step(Kind::Step, run, "b"),
            Place::step(Kind::Step, Uuid::new_v4(), "a"),
            Place::step(Kind::Wait, run, "a"),
            Place::step(Kind::Child, run, "a"),
        ] {
            assert_eq!(open_value(Some(&old), &other, value.clone()), Err(CodecError::Tampered), "{other:?}");
        }
        // Rotation: the new keyring still opens old values and seals with the new key.
        let new = Keyring::new("k2", [2; 32]).with_old_key("k1", [1; 32]);
        assert_eq!(open_value(Some(&new), &a, value.clone()).unwrap(), json!({"token": "secret"}));
        assert_eq!(sealed(&new, &a, "1")["kid"], "k2");
        // Without the old key: a typed error, not a panic.
        let only_new = Keyring::new("k2", [2; 32]);
        assert_eq!(open_value(Some(&only_new), &a, value.clone()), Err(CodecError::UnknownKey("k1".into())));
        // Tampered ciphertext.
        let mut bad = value.clone();
        bad["ct"] = json!(B64.encode(b"garbage-garbage-garbage"));
        assert_eq!(open_value(Some(&old), &a, bad), Err(CodecError::Tampered));
        // A sealed value without a keyring: typed error.
        assert_eq!(open_value(None, &a, value), Err(CodecError::NoKeyring));
    }

    /// Catches: with a keyring, plaintext in a sealed column was passed through
    /// (`Keyring::open` returned a non-envelope as is), so a database writer
    /// could forge a step result.
    #[test]
    fn plaintext_is_refused_with_a_keyring_outside_the_migration_window() {
        let a = Place::step(Kind::Step, Uuid::new_v4(), "a");
        let k = Keyring::new("k1", [1; 32]);
        assert_eq!(open_value(Some(&k), &a, json!({"token": "forged"})), Err(CodecError::Plaintext));
        assert_eq!(open_value(Some(&k), &a, json!(5)), Err(CodecError::Plaintext));
        let escaped = json!({"$durastep": "plain", "value": 1});
        assert_eq!(open_value(Some(&k), &a, escaped.clone()), Err(CodecError::Plaintext));
        // Inside the window: read as stored.
        let open = k.clone().accept_plaintext_until(Utc::now() + chrono::Duration::hours(1));
        assert_eq!(open_value(Some(&open), &a, json!(5)).unwrap(), json!(5));
        assert_eq!(open_value(Some(&open), &a, escaped).unwrap(), json!(1));
        // A window that has passed is no window.
        let closed = k.accept_plaintext_until(Utc::now() - chrono::Duration::seconds(1));
        assert!(!closed.accepts_plaintext());
        assert_eq!(open_value(Some(&closed), &a, json!(5)), Err(CodecError::Plaintext));
    }

    /// Catches: without a keyring, a step output that looked like an envelope
    /// (`{"$sealed": "xchacha20poly1305", ...}`) was taken for one, and the
    /// run failed on replay with `NoKeyring`.
    #[test]
    fn user_data_is_never_mistaken_for_an_envelope() {
        let a = Place::step(Kind::Step, Uuid::new_v4(), "a");
        let lookalikes = [
            json!({"$sealed": "xchacha20poly1305", "kid": "k1", "nonce": "AA==", "ct": "AA=="}),
            json!({"$durastep": "sealed", "v": 2, "alg": "xchacha20poly1305", "kid": "k", "nonce": "", "ct": ""}),
            json!({"$durastep": "plain", "value": 1}),
            json!({"$durastep": 7}),
        ];
        for user in lookalikes {
            let text = seal_text(None, &a, &user, user.to_string());
            let stored: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(open_value(None, &a, stored).unwrap(), user);
        }
        // Ordinary values are stored as they are.
        assert_eq!(seal_text(None, &a, &json!({"x": 1}), r#"{"x":1}"#.into()), r#"{"x":1}"#);
    }

    #[test]
    fn legacy_envelopes_open_where_they_were_bound() {
        let run = Uuid::new_v4();
        let k = Keyring::new("k1", [1; 32]);
        let v1 = |aad: &str| {
            let cipher = &k.keys["k1"];
            let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
            let ct = cipher.encrypt(&nonce, Payload { msg: b"42", aad: aad.as_bytes() }).unwrap();
            json!({"$sealed": ALGORITHM, "kid": "k1", "nonce": B64.encode(nonce), "ct": B64.encode(ct)})
        };
        let step = v1(&format!("durastep/step\0{run}\0s"));
        assert_eq!(open_value(Some(&k), &Place::step(Kind::Step, run, "s"), step.clone()).unwrap(), json!(42));
        assert_eq!(open_value(Some(&k), &Place::step(Kind::Step, run, "t"), step), Err(CodecError::Tampered));
        let out = v1(&format!("durastep/output\0{run}"));
        assert_eq!(open_value(Some(&k), &Place::output(run, None), out.clone()).unwrap(), json!(42));
        // A version-1 child output has no parent binding: only in the window.
        let as_child = Place::output(run, Some((Uuid::new_v4(), "c")));
        assert_eq!(open_value(Some(&k), &as_child, out.clone()), Err(CodecError::Tampered));
        let window = k.clone().accept_plaintext_until(Utc::now() + chrono::Duration::hours(1));
        assert_eq!(open_value(Some(&window), &as_child, out).unwrap(), json!(42));
    }
}
