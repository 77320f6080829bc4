//! Optional encryption at rest of step outputs and run outputs.
//!
//! With a [`Keyring`] set on the engine, every step result and run output is
//! stored as an envelope `{"$sealed": "xchacha20poly1305", "kid", "nonce", "ct"}`:
//! XChaCha20-Poly1305 with a random 192-bit nonce, the key id beside the
//! ciphertext, and the run id and step key bound as associated data, so a
//! ciphertext moved to another run or step fails to open. Rotation: add the new
//! key as current and keep old ones with [`Keyring::with_old_key`]; old results
//! still open, new ones are sealed with the new key.
//!
//! Architecture invariant: sealing happens after the input limits are checked
//! (limits apply to the plaintext) and before any SQL; opening happens before a
//! stored value is handed to user code. Values stored before encryption was
//! turned on (plain JSON) still read.

use std::collections::HashMap;
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use chacha20poly1305::aead::{Aead, AeadCore, KeyInit, OsRng, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use serde_json::{Value, json};
use uuid::Uuid;

const ALGORITHM: &str = "xchacha20poly1305";

/// Why a sealed value could not be opened.
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
    /// Authentication failed: wrong key, tampered data, or moved to another run or step.
    #[error("sealed value does not authenticate (tampered, or moved to another run or step)")]
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
}

/// Keys for sealing step outputs and run outputs; see [`crate::EngineBuilder::encryption`].
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
        Keyring { current, keys }
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

    /// The id of the key that seals new values.
    ///
    /// ```
    /// assert_eq!(durastep::Keyring::new("a", [0u8; 32]).current_key_id(), "a");
    /// ```
    pub fn current_key_id(&self) -> &str {
        &self.current
    }

    /// Seals JSON text; `aad` binds it to its place.
    pub(crate) fn seal(&self, aad: &str, plain: &str) -> Value {
        let cipher = &self.keys[&self.current];
        let nonce = XChaCha20Poly1305::generate_nonce(&mut OsRng);
        // Encryption with a valid key and nonce cannot fail for in-memory buffers.
        let ct = cipher.encrypt(&nonce, Payload { msg: plain.as_bytes(), aad: aad.as_bytes() }).unwrap_or_default();
        json!({ "$sealed": ALGORITHM, "kid": self.current, "nonce": B64.encode(nonce), "ct": B64.encode(ct) })
    }

    /// Opens a sealed value; a value that is not an envelope is returned as is.
    pub(crate) fn open(&self, aad: &str, value: Value) -> Result<Value, CodecError> {
        let Some(env) = envelope(&value) else { return Ok(value) };
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

fn envelope(value: &Value) -> Option<&serde_json::Map<String, Value>> {
    let map = value.as_object()?;
    (map.get("$sealed").and_then(Value::as_str) == Some(ALGORITHM)).then_some(map)
}

fn decode_key(key: &str) -> Result<[u8; 32], CodecError> {
    let bytes = B64.decode(key.trim()).map_err(|_| CodecError::BadKey("not base64"))?;
    bytes.try_into().map_err(|_| CodecError::BadKey("must be 32 bytes"))
}

impl fmt::Debug for Keyring {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ids: Vec<&String> = self.keys.keys().collect();
        ids.sort();
        f.debug_struct("Keyring").field("current", &self.current).field("key_ids", &ids).finish()
    }
}

/// Associated data of a step result: its run and step key.
pub(crate) fn step_aad(run_id: Uuid, key: &str) -> String {
    format!("durastep/step\0{run_id}\0{key}")
}

/// Associated data of a run output.
pub(crate) fn output_aad(run_id: Uuid) -> String {
    format!("durastep/output\0{run_id}")
}

/// Seals when a keyring is set; otherwise passes the text through.
pub(crate) fn seal_text(keyring: Option<&Keyring>, aad: &str, text: String) -> String {
    match keyring {
        Some(k) => k.seal(aad, &text).to_string(),
        None => text,
    }
}

/// Opens when a keyring is set; without one, a sealed value is an error.
pub(crate) fn open_value(keyring: Option<&Keyring>, aad: &str, value: Value) -> Result<Value, CodecError> {
    match keyring {
        Some(k) => k.open(aad, value),
        None if envelope(&value).is_some() => Err(CodecError::NoKeyring),
        None => Ok(value),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_rotation_and_binding() {
        let old = Keyring::new("k1", [1; 32]);
        let sealed = old.seal("a", r#"{"token":"secret"}"#);
        assert!(!sealed.to_string().contains("secret"));
        assert_eq!(old.open("a", sealed.clone()).unwrap(), json!({"token": "secret"}));
        // Moved to another run or step: refused.
        assert_eq!(old.open("b", sealed.clone()), Err(CodecError::Tampered));
        // Rotation: the new keyring still opens old values and seals with the new key.
        let new = Keyring::new("k2", [2; 32]).with_old_key("k1", [1; 32]);
        assert_eq!(new.open("a", sealed.clone()).unwrap(), json!({"token": "secret"}));
        assert_eq!(new.seal("a", "1")["kid"], "k2");
        // Without the old key: a typed error, not a panic.
        assert_eq!(Keyring::new("k2", [2; 32]).open("a", sealed.clone()), Err(CodecError::UnknownKey("k1".into())));
        // Tampered ciphertext.
        let mut bad = sealed;
        bad["ct"] = json!(B64.encode(b"garbage-garbage-garbage"));
        assert_eq!(old.open("a", bad), Err(CodecError::Tampered));
        // Plain values pass through.
        assert_eq!(old.open("a", json!(5)).unwrap(), json!(5));
        assert_eq!(open_value(None, "a", old.seal("a", "1")), Err(CodecError::NoKeyring));
    }
}
