//! How the codec writes a message: prost's encoding, except for the
//! answers every decision makes (`RateLimitResponse`, `CheckResult`,
//! `CheckBatchResponse`), which are written here field by field.
//!
//! prost writes each varint through a generic, out-of-line call per field
//! (about 40 instructions each, a dozen per answer) and measures a nested
//! message twice (once for the whole, once for its length prefix). Written
//! here, a varint is a few pushes into a `Vec` with room reserved, and a
//! nested message's length is filled in after it is written. The bytes are
//! exactly prost's (fields in tag order, defaults left out; the property
//! tests below compare them over arbitrary values), so any protobuf reader
//! reads them as before.

use prost::Message;

use super::{
    envoy_pb::{rlqs, rls},
    pb,
};

/// A message the codec can write into a `Vec`.
pub trait Encode: Message + Sized {
    /// Appends the message's encoding to `out` (without a length prefix).
    fn encode_to(&self, out: &mut Vec<u8>) {
        self.encode_raw(out);
    }
}

impl Encode for pb::RateLimitRequest {}
impl Encode for pb::CheckItem {}
impl Encode for pb::CheckBatchRequest {}
impl Encode for rls::RateLimitRequest {}
impl Encode for rls::RateLimitResponse {}
impl Encode for rlqs::RateLimitQuotaUsageReports {}
impl Encode for rlqs::RateLimitQuotaResponse {}

impl Encode for pb::RateLimitResponse {
    fn encode_to(&self, out: &mut Vec<u8>) {
        // The scalars take at most 11 bytes each; the strings their length
        // and a prefix.
        out.reserve(
            16 * 11
                + self.cluster_utilization_status.len()
                + self.rule_id.len()
                + self.store_error.len()
                + self.unit.len()
                + self.reservation.len()
                + self.level.len(),
        );
        boolean(out, 1, self.allowed);
        uint(out, 2, u64::from(self.remaining_tokens));
        int(out, 3, self.retry_after_ms);
        string(out, 4, &self.cluster_utilization_status);
        string(out, 5, &self.rule_id);
        uint(out, 6, self.limit);
        int(out, 7, self.reset_after_ms);
        int(out, 8, i64::from(self.reason));
        boolean(out, 9, self.shadow_denied);
        uint(out, 10, self.capacity);
        int(out, 11, self.window_ms);
        boolean(out, 12, self.shadow_shed);
        int(out, 13, i64::from(self.priority));
        string(out, 14, &self.store_error);
        string(out, 15, &self.unit);
        uint(out, 16, self.remaining);
        string(out, 17, &self.reservation);
        string(out, 18, &self.level);
    }
}

impl Encode for pb::CheckResult {
    fn encode_to(&self, out: &mut Vec<u8>) {
        uint(out, 1, self.id);
        if let Some(response) = &self.response {
            nested(out, 2, |out| response.encode_to(out));
        }
        string(out, 3, &self.invalid_argument);
    }
}

impl Encode for pb::CheckBatchResponse {
    fn encode_to(&self, out: &mut Vec<u8>) {
        for result in &self.results {
            nested(out, 1, |out| result.encode_to(out));
        }
    }
}

/// A field's key: its number and wire type (0 varint, 2 length-delimited):
/// one byte below field 16, two from there on.
fn key(out: &mut Vec<u8>, field: u8, wire_type: u8) {
    if field < 16 {
        out.push(field << 3 | wire_type);
    } else {
        varint(out, u64::from(field) << 3 | u64::from(wire_type));
    }
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        // The low seven bits, with the continuation bit.
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn uint(out: &mut Vec<u8>, field: u8, value: u64) {
    if value != 0 {
        key(out, field, 0);
        varint(out, value);
    }
}

/// `int64` and enums: a negative value is its two's complement, ten bytes.
fn int(out: &mut Vec<u8>, field: u8, value: i64) {
    uint(out, field, value as u64);
}

fn boolean(out: &mut Vec<u8>, field: u8, value: bool) {
    uint(out, field, u64::from(value));
}

fn string(out: &mut Vec<u8>, field: u8, value: &str) {
    if !value.is_empty() {
        key(out, field, 2);
        varint(out, value.len() as u64);
        out.extend_from_slice(value.as_bytes());
    }
}

/// A message field: `body` writes the message, whose length is then put in
/// front of it (one byte reserved for it, moved aside when it needs more).
fn nested(out: &mut Vec<u8>, field: u8, body: impl FnOnce(&mut Vec<u8>)) {
    key(out, field, 2);
    let at = out.len();
    out.push(0);
    body(out);
    let length = out.len() - at - 1;
    if let Ok(short @ 0..0x80) = u8::try_from(length) {
        out[at] = short;
    } else {
        let mut prefix = Vec::with_capacity(10);
        varint(&mut prefix, length as u64);
        out.splice(at..=at, prefix);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn ours<T: Encode>(message: &T) -> Vec<u8> {
        let mut out = Vec::new();
        message.encode_to(&mut out);
        out
    }

    fn text() -> impl Strategy<Value = String> {
        // Empty (left out), short, and long enough for a two-byte prefix.
        prop_oneof!["", "[a-z]{1,20}", "[a-zé]{100,300}"]
    }

    fn response() -> impl Strategy<Value = pb::RateLimitResponse> {
        let scalars = (any::<bool>(), any::<u32>(), any::<i64>(), any::<u64>(), any::<i64>(), -3..16i32);
        let more =
            (any::<bool>(), any::<u64>(), any::<i64>(), any::<bool>(), prop_oneof![-2..8i32, any::<i32>()]);
        (scalars, more, (text(), text(), text()), (text(), any::<u64>(), text(), text())).prop_map(
            |(
                (allowed, remaining, retry, limit, reset, reason),
                (denied, capacity, window, shed, priority),
                (status, rule, store_error),
                (unit, remaining_units, reservation, level),
            )| {
                pb::RateLimitResponse {
                    allowed,
                    remaining_tokens: remaining,
                    retry_after_ms: retry,
                    cluster_utilization_status: status,
                    rule_id: rule,
                    limit,
                    reset_after_ms: reset,
                    reason,
                    shadow_denied: denied,
                    capacity,
                    window_ms: window,
                    shadow_shed: shed,
                    priority,
                    store_error,
                    unit,
                    remaining: remaining_units,
                    reservation,
                    level,
                }
            },
        )
    }

    fn result() -> impl Strategy<Value = pb::CheckResult> {
        (any::<u64>(), proptest::option::of(response()), text())
            .prop_map(|(id, response, invalid_argument)| pb::CheckResult { id, response, invalid_argument })
    }

    /// Small values (one-byte varints, defaults left out) as often as big ones.
    fn small_response() -> impl Strategy<Value = pb::RateLimitResponse> {
        (any::<bool>(), 0..3u32, -1..2i64, 0..3u64, 0..4i32, "[A-Z_]{0,3}").prop_map(
            |(allowed, remaining, retry, limit, reason, status)| pb::RateLimitResponse {
                allowed,
                remaining_tokens: remaining,
                retry_after_ms: retry,
                cluster_utilization_status: status,
                limit,
                reason,
                ..Default::default()
            },
        )
    }

    proptest! {
        #[test]
        fn a_response_is_written_as_prost_writes_it(response in prop_oneof![response(), small_response()]) {
            prop_assert_eq!(ours(&response), response.encode_to_vec());
        }

        #[test]
        fn a_result_is_written_as_prost_writes_it(result in result()) {
            prop_assert_eq!(ours(&result), result.encode_to_vec());
        }

        #[test]
        fn a_batch_is_written_as_prost_writes_it(results in proptest::collection::vec(result(), 0..6)) {
            let batch = pb::CheckBatchResponse { results };
            prop_assert_eq!(ours(&batch), batch.encode_to_vec());
        }
    }

    #[test]
    fn an_empty_response_in_a_result_is_still_present() {
        let result =
            pb::CheckResult { id: 0, response: Some(pb::RateLimitResponse::default()), ..Default::default() };
        assert_eq!(ours(&result), [0x12, 0x00]);
        assert_eq!(ours(&result), result.encode_to_vec());
    }
}
