//! Signed snapshot records: who may change the limits. `rules publish`
//! signs each record with the publisher's Ed25519 key; every instance
//! verifies it against the public keys it is configured with
//! (`rules.kafka.verify_keys`, several at once for a rotation) and refuses
//! an unsigned record, or one signed by a key it does not know, unless
//! unsigned records are allowed explicitly (`rules.kafka.allow_unsigned`).
//!
//! On the topic a signed record is an envelope (schema
//! `ratelimitd.rules.signed/1`, JSON): the signer's public key, the
//! signature, and the snapshot record's exact JSON bytes as a string, which
//! is what is signed, so no canonical form is needed. A record without an
//! envelope is unsigned.

use base64::{Engine as _, engine::general_purpose::STANDARD};
use ed25519_dalek::{Signature, Signer as _, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};

use super::encoding::{DecodeError, SnapshotRecord};

/// The schema of a signed record's envelope.
pub const SIGNED_SCHEMA: &str = "ratelimitd.rules.signed/1";

/// A signed record as it travels.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Envelope {
    schema: String,
    /// The signer's public key, base64.
    key: String,
    /// The Ed25519 signature of `record`'s bytes, base64.
    signature: String,
    /// The snapshot record's JSON.
    record: String,
}

/// Why a key could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// Not base64 of 32 bytes.
    #[error("not a base64 Ed25519 key (32 bytes)")]
    Malformed,
    /// 32 bytes that are no valid public key.
    #[error("not a valid Ed25519 public key")]
    Invalid,
}

/// A publisher's signing key.
#[derive(Clone)]
pub struct Signer(SigningKey);

impl std::fmt::Debug for Signer {
    // The private key is never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Signer").field(&self.public_key()).finish()
    }
}

impl Signer {
    /// A new key from the operating system's randomness.
    pub fn generate() -> Result<Self, getrandom::Error> {
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed)?;
        Ok(Signer(SigningKey::from_bytes(&seed)))
    }

    /// The key a file holds: its 32-byte seed in base64 (surrounding
    /// whitespace ignored), as [`Signer::to_text`] writes it.
    pub fn from_text(text: &str) -> Result<Self, KeyError> {
        let seed: [u8; 32] = decode32(text)?;
        Ok(Signer(SigningKey::from_bytes(&seed)))
    }

    /// The private key as a key file holds it.
    pub fn to_text(&self) -> String {
        STANDARD.encode(self.0.to_bytes())
    }

    /// The public key, base64: what instances list in `rules.kafka.verify_keys`.
    pub fn public_key(&self) -> String {
        STANDARD.encode(self.0.verifying_key().to_bytes())
    }

    /// `record` signed: the bytes to produce to the topic.
    pub fn sign(&self, record: &SnapshotRecord) -> Vec<u8> {
        let json = serde_json::to_string(record).expect("records serialise");
        let signature = self.0.sign(json.as_bytes());
        let envelope = Envelope {
            schema: SIGNED_SCHEMA.to_owned(),
            key: self.public_key(),
            signature: STANDARD.encode(signature.to_bytes()),
            record: json,
        };
        serde_json::to_vec(&envelope).expect("envelopes serialise")
    }
}

fn decode32(text: &str) -> Result<[u8; 32], KeyError> {
    STANDARD.decode(text.trim()).ok().and_then(|b| b.try_into().ok()).ok_or(KeyError::Malformed)
}

/// Parses one public key (base64, 32 bytes).
pub fn public_key(text: &str) -> Result<VerifyingKey, KeyError> {
    VerifyingKey::from_bytes(&decode32(text)?).map_err(|_| KeyError::Invalid)
}

/// Who an instance takes records from.
#[derive(Debug, Clone, Default)]
pub struct Trust {
    /// The publishers' public keys; a record signed by any of them is taken.
    pub keys: Vec<VerifyingKey>,
    /// Unsigned records are taken too (`rules.kafka.allow_unsigned`).
    pub allow_unsigned: bool,
    /// Only records carrying a passing gate report judged by thresholds at
    /// least this strict (`rules.kafka.require_gate`, `gate.*`).
    pub require_gate: Option<super::gate::GateThresholds>,
}

impl Trust {
    /// The trust `verify_keys` and `allow_unsigned` describe; the error
    /// names the key that does not parse.
    pub fn of(verify_keys: &[String], allow_unsigned: bool) -> Result<Self, (String, KeyError)> {
        let keys = verify_keys
            .iter()
            .map(|k| public_key(k).map_err(|e| (k.clone(), e)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Trust { keys, allow_unsigned, require_gate: None })
    }

    /// This trust, taking only gated records when `required` is set.
    #[must_use]
    pub fn requiring_gate(self, required: Option<super::gate::GateThresholds>) -> Self {
        Trust { require_gate: required, ..self }
    }

    /// The snapshot record `payload` carries, if this trust takes it: signed
    /// by a known key with a valid signature (or unsigned where allowed),
    /// with a passing gate report where one is required. Nothing else about
    /// the record is checked here ([`SnapshotRecord::compile`]).
    pub fn open(&self, payload: &[u8]) -> Result<SnapshotRecord, DecodeError> {
        let record = self.open_signed(payload)?;
        if let Some(required) = &self.require_gate
            && let Some(why) = super::gate::refusal(record.gate.as_ref(), &record.version, required)
        {
            return Err(DecodeError::Ungated { version: record.version, why });
        }
        Ok(record)
    }

    fn open_signed(&self, payload: &[u8]) -> Result<SnapshotRecord, DecodeError> {
        let Ok(envelope) = serde_json::from_slice::<Envelope>(payload) else {
            // Not signed: a record that does not even decode says so first.
            let record = SnapshotRecord::parse(payload)?;
            return if self.allow_unsigned { Ok(record) } else { Err(DecodeError::Unsigned) };
        };
        if envelope.schema != SIGNED_SCHEMA {
            return Err(DecodeError::Schema(envelope.schema));
        }
        let key = public_key(&envelope.key).map_err(|_| DecodeError::UnknownKey(envelope.key.clone()))?;
        if !self.keys.contains(&key) {
            return Err(DecodeError::UnknownKey(envelope.key));
        }
        let signature = STANDARD
            .decode(&envelope.signature)
            .ok()
            .and_then(|b| <[u8; 64]>::try_from(b).ok())
            .map(|b| Signature::from_bytes(&b))
            .ok_or_else(|| DecodeError::BadSignature(envelope.key.clone()))?;
        key.verify_strict(envelope.record.as_bytes(), &signature)
            .map_err(|_| DecodeError::BadSignature(envelope.key.clone()))?;
        SnapshotRecord::parse(envelope.record.as_bytes())
    }
}

/// The signer's public key of a signed payload, unverified (for display).
pub fn signer_of(payload: &[u8]) -> Option<String> {
    serde_json::from_slice::<Envelope>(payload).ok().map(|e| e.key)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::encoding::{Provenance, SCHEMA};

    fn record() -> SnapshotRecord {
        SnapshotRecord {
            schema: SCHEMA.to_owned(),
            version: "v1".to_owned(),
            previous: None,
            published_at: "2026-11-25T00:00:00Z".to_owned(),
            provenance: Provenance::default(),
            native: None,
            envoy: None,
            limitador: None,
            gate: None,
        }
    }

    fn trust(signers: &[&Signer], allow_unsigned: bool) -> Trust {
        let keys: Vec<String> = signers.iter().map(|s| s.public_key()).collect();
        Trust::of(&keys, allow_unsigned).unwrap()
    }

    #[test]
    fn a_record_signed_by_a_known_key_opens() {
        let (old, new) = (Signer::generate().unwrap(), Signer::generate().unwrap());
        let both = trust(&[&old, &new], false);
        assert_eq!(both.open(&old.sign(&record())).unwrap(), record(), "rotation: the old key still opens");
        assert_eq!(both.open(&new.sign(&record())).unwrap(), record());
        let copy = Signer::from_text(&new.to_text()).unwrap();
        assert_eq!(copy.public_key(), new.public_key(), "a key file round-trips");
    }

    #[test]
    fn unsigned_unknown_and_tampered_records_are_refused() {
        let (publisher, stranger) = (Signer::generate().unwrap(), Signer::generate().unwrap());
        let strict = trust(&[&publisher], false);
        let unsigned = serde_json::to_vec(&record()).unwrap();
        assert!(matches!(strict.open(&unsigned), Err(DecodeError::Unsigned)));
        assert!(matches!(strict.open(&stranger.sign(&record())), Err(DecodeError::UnknownKey(_))));
        // The record changed after signing (a limit raised in transit); the
        // key and the signature as they were (a blind replace over the whole
        // envelope could hit them too: base64 holds "v1" about once in 90).
        let mut tampered: serde_json::Value = serde_json::from_slice(&publisher.sign(&record())).unwrap();
        let inner = tampered["record"].as_str().unwrap().replace("\"v1\"", "\"v2\"");
        assert_ne!(tampered["record"].as_str(), Some(inner.as_str()), "the record names its version");
        tampered["record"] = inner.into();
        let tampered = serde_json::to_vec(&tampered).unwrap();
        let refused = strict.open(&tampered);
        assert!(matches!(refused, Err(DecodeError::BadSignature(_))), "{refused:?}");
        // A stranger's envelope claiming the publisher's key.
        let mut forged: serde_json::Value = serde_json::from_slice(&stranger.sign(&record())).unwrap();
        forged["key"] = publisher.public_key().into();
        let forged = serde_json::to_vec(&forged).unwrap();
        assert!(matches!(strict.open(&forged), Err(DecodeError::BadSignature(_))));
        // Unsigned records only where allowed explicitly.
        assert_eq!(trust(&[], true).open(&unsigned).unwrap(), record());
    }

    #[test]
    fn a_trust_requiring_the_gate_opens_only_gated_records() {
        use crate::rules::gate::{Gate, GateReport, GateThresholds};
        let signer = Signer::generate().unwrap();
        let t = GateThresholds::default();
        let gated = trust(&[&signer], false).requiring_gate(Some(t));
        let ungated = gated.open(&signer.sign(&record())).unwrap_err();
        assert!(
            matches!(&ungated, DecodeError::Ungated { why, .. } if why.contains("no gate report")),
            "{ungated}"
        );
        let report = GateReport {
            capture_digest: String::new(),
            capture_requests: 1_000,
            baseline_version: "v0".to_owned(),
            candidate_version: "v1".to_owned(),
            priorities: Default::default(),
            gate: Gate::judge(t, 1_000, (10, 0), &Default::default(), &Default::default()),
            gated_at: String::new(),
        };
        let with_report = SnapshotRecord { gate: Some(report), ..record() };
        assert_eq!(gated.open(&signer.sign(&with_report)).unwrap(), with_report);
        // The report is signed with the record: editing it breaks the signature.
        let envelope: serde_json::Value = serde_json::from_slice(&signer.sign(&with_report)).unwrap();
        let edited = envelope["record"]
            .as_str()
            .unwrap()
            .replace("\"capture_requests\":1000", "\"capture_requests\":1001");
        let mut tampered = envelope.clone();
        tampered["record"] = serde_json::Value::String(edited);
        let tampered = serde_json::to_vec(&tampered).unwrap();
        assert!(matches!(gated.open(&tampered), Err(DecodeError::BadSignature(_))));
    }

    #[test]
    fn keys_that_do_not_parse_are_named() {
        assert_eq!(Trust::of(&["abc".to_owned()], false).unwrap_err().1, KeyError::Malformed);
        assert!(Signer::from_text("not base64!").is_err());
    }
}
