//! Counting identities from request values: a value within its byte bound is
//! counted as it is; a longer one (or one that looks like a digest) is
//! counted by its SHA-256 digest, so an over-long user id or descriptor value
//! is limited exactly like a short one instead of being refused (a refusal
//! is an error a proxy with `failure_mode_deny: false` turns into "allow").

use std::{borrow::Cow, fmt::Write as _};

use sha2::{Digest, Sha256};

/// Prefix of a digest-counted value. A value that starts with it is
/// digested too, so no literal value can pose as another value's digest:
/// two values share a counter only if SHA-256 collides.
pub const DIGEST_PREFIX: &str = "#sha256:";

/// The longest counter key stored as it is. A longer one (an Envoy
/// descriptor of several long entries) is stored by its digest, so one
/// counter costs a bounded number of bytes in either store.
pub const MAX_COUNTER_KEY_BYTES: usize = 512;

/// `value` itself when it is at most `max_bytes` long and does not start
/// with [`DIGEST_PREFIX`]; otherwise `#sha256:` and the 64 hex digits of its
/// SHA-256 (72 bytes, whatever the value's length).
pub fn bounded(value: &str, max_bytes: usize) -> Cow<'_, str> {
    if value.len() <= max_bytes && !value.starts_with(DIGEST_PREFIX) {
        return Cow::Borrowed(value);
    }
    Cow::Owned(digest_bytes(value.as_bytes()))
}

/// `#sha256:` and the 64 hex digits of the SHA-256 of `bytes`: how a value
/// that is not UTF-8 is counted (the API cannot carry it as a string).
pub fn digest_bytes(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut key = String::with_capacity(DIGEST_PREFIX.len() + 64);
    key.push_str(DIGEST_PREFIX);
    for byte in digest {
        let _ = write!(key, "{byte:02x}");
    }
    key
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_values_are_themselves_and_long_ones_a_fixed_size_digest() {
        assert!(matches!(bounded("alice", 8), Cow::Borrowed("alice")));
        let long = "b".repeat(2_000);
        let key = bounded(&long, 256);
        assert_eq!(key.len(), 72);
        assert!(key.starts_with(DIGEST_PREFIX));
        assert_eq!(key, bounded(&long, 256), "the same value, the same counter");
        let mut other = long.clone();
        other.push('c');
        assert_ne!(key, bounded(&other, 256), "values sharing a prefix stay apart");
        // SHA-256 of "abc", a published test vector.
        assert_eq!(
            bounded("abc", 2),
            "#sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn no_literal_value_can_pose_as_a_digest() {
        let long = "x".repeat(300);
        let digest = bounded(&long, 256).into_owned();
        // Sent literally (it is short enough), the digest text is digested again.
        assert_ne!(bounded(&digest, 256), digest);
    }
}
