//! The codec of both gRPC services: prost's, except that a request whose
//! strings are not UTF-8 is not refused. prost refuses such a `string`
//! field, and the refusal is an error a proxy answers with "allow"
//! (Envoy's `failure_mode_deny: false`), so a client could switch limiting
//! off by sending one invalid byte in a header the proxy forwards. Instead
//! the request is decoded again from a mirror of the message with `bytes`
//! fields, and every value that is not UTF-8 is read lossily (invalid
//! sequences become U+FFFD, so prefixes and wildcards still match) with the
//! digest of its bytes appended (so distinct values keep distinct
//! counters): counted exactly, never an error.

use std::marker::PhantomData;

use prost::{
    Message,
    bytes::{Buf, BufMut as _},
};
use tonic::{
    Status,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
};

use super::{
    envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{
            RateLimitDescriptor,
            rate_limit_descriptor::{Entry, RateLimitOverride},
        },
        rls::{RateLimitRequest, RateLimitResponse},
    },
    pb,
    wire::Encode,
};
use crate::decision::keys::digest_bytes;

/// A message that can be decoded lossily when prost refuses it.
pub trait Lenient: Message + Default + Sized {
    /// The message from `bytes` that prost refused, with every non-UTF-8
    /// string replaced by its digest; `None` when there is no such decoding.
    fn decode_lenient(_bytes: &[u8]) -> Option<Self> {
        None
    }
}

impl Lenient for RateLimitResponse {}
// A usage report whose bucket ids are not UTF-8 is refused: it ends its
// stream, and Envoy applies the bucket's configured fallback
// (`no_assignment_behavior`, `expired_assignment_behavior`).
impl Lenient for super::envoy_pb::rlqs::RateLimitQuotaUsageReports {}
impl Lenient for super::envoy_pb::rlqs::RateLimitQuotaResponse {}

impl Lenient for pb::RateLimitResponse {}

impl Lenient for pb::RateLimitRequest {
    fn decode_lenient(bytes: &[u8]) -> Option<Self> {
        RawCheck::decode(bytes).ok().map(RawCheck::into_request)
    }
}

impl RawCheck {
    fn into_request(self) -> pb::RateLimitRequest {
        pb::RateLimitRequest {
            user_id: text(self.user_id),
            resource_path: text(self.resource_path),
            headers: self.headers.into_iter().map(|e| (text(e.key), text(e.value))).collect(),
            weight: self.weight,
            priority: self.priority,
            client_type: text(self.client_type),
            peek: self.peek,
            outcome: self.outcome,
            latency_ms: self.latency_ms,
            usage: self.usage.into_iter().map(|e| (text(e.key), e.value)).collect(),
            reserve: self.reserve,
            reservation: text(self.reservation),
        }
    }
}

impl RawItem {
    fn into_item(self) -> pb::CheckItem {
        pb::CheckItem { id: self.id, request: self.request.map(RawCheck::into_request) }
    }
}

impl Lenient for pb::CheckResult {}

impl Lenient for pb::CheckBatchResponse {}

impl Lenient for pb::CheckItem {
    fn decode_lenient(bytes: &[u8]) -> Option<Self> {
        RawItem::decode(bytes).ok().map(RawItem::into_item)
    }
}

impl Lenient for pb::CheckBatchRequest {
    fn decode_lenient(bytes: &[u8]) -> Option<Self> {
        let raw = RawBatch::decode(bytes).ok()?;
        Some(pb::CheckBatchRequest { items: raw.items.into_iter().map(RawItem::into_item).collect() })
    }
}

impl Lenient for RateLimitRequest {
    fn decode_lenient(bytes: &[u8]) -> Option<Self> {
        let raw = RawRequest::decode(bytes).ok()?;
        Some(RateLimitRequest {
            domain: text(raw.domain),
            descriptors: raw
                .descriptors
                .into_iter()
                .map(|d| RateLimitDescriptor {
                    entries: d
                        .entries
                        .into_iter()
                        .map(|e| Entry { key: text(e.key), value: text(e.value) })
                        .collect(),
                    limit: d.limit,
                    hits_addend: d.hits_addend,
                    is_negative_hits: d.is_negative_hits,
                })
                .collect(),
            hits_addend: raw.hits_addend,
        })
    }
}

/// The value as a string: itself when it is UTF-8, else read lossily with
/// the digest of its bytes appended.
fn text(bytes: Vec<u8>) -> String {
    String::from_utf8(bytes).unwrap_or_else(|e| {
        let bytes = e.into_bytes();
        let mut text = String::from_utf8_lossy(&bytes).into_owned();
        text.push_str(&digest_bytes(&bytes));
        text
    })
}

/// `ratelimit.v1.RateLimitRequest` with `bytes` where it has `string` (a map
/// is a repeated key/value entry on the wire).
#[derive(Clone, PartialEq, Message)]
struct RawCheck {
    #[prost(bytes = "vec", tag = "1")]
    user_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    resource_path: Vec<u8>,
    #[prost(message, repeated, tag = "3")]
    headers: Vec<RawEntry>,
    #[prost(uint32, tag = "4")]
    weight: u32,
    #[prost(int32, tag = "5")]
    priority: i32,
    #[prost(bytes = "vec", tag = "6")]
    client_type: Vec<u8>,
    #[prost(bool, tag = "7")]
    peek: bool,
    #[prost(int32, tag = "8")]
    outcome: i32,
    #[prost(uint32, tag = "9")]
    latency_ms: u32,
    #[prost(message, repeated, tag = "10")]
    usage: Vec<RawAmount>,
    #[prost(bool, tag = "11")]
    reserve: bool,
    #[prost(bytes = "vec", tag = "12")]
    reservation: Vec<u8>,
}

/// A `usage` entry: a unit's name (bytes) and its amount.
#[derive(Clone, PartialEq, Message)]
struct RawAmount {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(uint64, tag = "2")]
    value: u64,
}

/// `ratelimit.v1.CheckItem` over [`RawCheck`].
#[derive(Clone, PartialEq, Message)]
struct RawItem {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(message, optional, tag = "2")]
    request: Option<RawCheck>,
}

/// `ratelimit.v1.CheckBatchRequest` over [`RawItem`].
#[derive(Clone, PartialEq, Message)]
struct RawBatch {
    #[prost(message, repeated, tag = "1")]
    items: Vec<RawItem>,
}

/// `RateLimitRequest` with `bytes` where it has `string`: the same wire format.
#[derive(Clone, PartialEq, Message)]
struct RawRequest {
    #[prost(bytes = "vec", tag = "1")]
    domain: Vec<u8>,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RawDescriptor>,
    #[prost(uint32, tag = "3")]
    hits_addend: u32,
}

#[derive(Clone, PartialEq, Message)]
struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<RawEntry>,
    #[prost(message, optional, tag = "2")]
    limit: Option<RateLimitOverride>,
    #[prost(message, optional, tag = "3")]
    hits_addend: Option<u64>,
    #[prost(bool, tag = "4")]
    is_negative_hits: bool,
}

#[derive(Clone, PartialEq, Message)]
struct RawEntry {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// prost's codec with the lenient fallback on decoding.
#[derive(Debug, Clone)]
pub struct LenientCodec<T, U> {
    _types: PhantomData<(T, U)>,
}

impl<T, U> Default for LenientCodec<T, U> {
    fn default() -> Self {
        LenientCodec { _types: PhantomData }
    }
}

impl<T, U> Codec for LenientCodec<T, U>
where
    T: Encode + Send + 'static,
    U: Lenient + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = LenientEncoder<T>;
    type Decoder = LenientDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        LenientEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        LenientDecoder(PhantomData)
    }
}

/// The message's [`Encode`] encoding.
#[derive(Debug, Clone)]
pub struct LenientEncoder<T>(PhantomData<T>);

impl<T: Encode> Encoder for LenientEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // Written into a `Vec`, then copied once: `EncodeBuf` has no
        // `put_u8` of its own, so through it every byte of a varint would
        // cost a generic `put_slice`. The scratch is the thread's, reused.
        SCRATCH.with_borrow_mut(|scratch| {
            scratch.clear();
            item.encode_to(scratch);
            buf.put_slice(scratch);
            if scratch.capacity() > SCRATCH_KEPT {
                *scratch = Vec::new();
            }
        });
        Ok(())
    }
}

/// The most scratch a thread keeps between messages: a bigger message
/// (a large `CheckBatch` answer) is encoded in a buffer of its own.
const SCRATCH_KEPT: usize = 64 * 1024;

thread_local! {
    /// Where a message is encoded before it is copied into the call's buffer.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// prost's decoding, then the lenient one if prost refuses.
#[derive(Debug, Clone)]
pub struct LenientDecoder<U>(PhantomData<U>);

impl<U: Lenient> Decoder for LenientDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // A whole message is usually one contiguous chunk: decode it in
        // place, keeping it for the fallback; otherwise gather it first.
        let gathered;
        let bytes: &[u8] = if buf.chunk().len() == buf.remaining() {
            buf.chunk()
        } else {
            gathered = buf.copy_to_bytes(buf.remaining());
            &gathered
        };
        let length = bytes.len();
        let decoded = match U::decode(bytes) {
            Ok(message) => Ok(Some(message)),
            Err(error) => {
                // Not the message at all: the caller's bug, never a server fault.
                U::decode_lenient(bytes)
                    .map(Some)
                    .ok_or_else(|| Status::invalid_argument(format!("malformed request: {error}")))
            }
        };
        if buf.remaining() >= length {
            buf.advance(length);
        }
        decoded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request as Envoy would send it, with raw bytes as values.
    fn wire(value: &[u8]) -> Vec<u8> {
        RawRequest {
            domain: b"edge".to_vec(),
            descriptors: vec![RawDescriptor {
                entries: vec![RawEntry { key: b"user".to_vec(), value: value.to_vec() }],
                ..Default::default()
            }],
            hits_addend: 1,
        }
        .encode_to_vec()
    }

    #[test]
    fn utf8_requests_decode_as_they_are_and_others_by_digest() {
        let plain = RateLimitRequest::decode(wire(b"alice").as_slice()).unwrap();
        assert_eq!(plain.descriptors[0].entries[0].value, "alice");
        let invalid = wire(b"bob\xff");
        assert!(RateLimitRequest::decode(invalid.as_slice()).is_err(), "prost refuses it");
        let lenient = RateLimitRequest::decode_lenient(&invalid).unwrap();
        let value = &lenient.descriptors[0].entries[0].value;
        assert_eq!(value, &format!("bob\u{fffd}{}", digest_bytes(b"bob\xff")), "a prefix still matches");
        assert_eq!((lenient.domain.as_str(), lenient.hits_addend), ("edge", 1));
        let other = RateLimitRequest::decode_lenient(&wire(b"bob\xfe")).unwrap();
        assert_ne!(&other.descriptors[0].entries[0].value, value, "distinct bytes, distinct counters");
        assert!(RateLimitResponse::decode_lenient(&invalid).is_none());
    }

    #[test]
    fn check_requests_that_are_not_utf8_decode_too() {
        let raw = RawCheck {
            user_id: b"eve\xff".to_vec(),
            resource_path: b"/api/v1/search\xfe".to_vec(),
            headers: vec![RawEntry { key: b"x-request-id".to_vec(), value: b"r\xff".to_vec() }],
            weight: 2,
            priority: 4,
            client_type: Vec::new(),
            peek: true,
            outcome: 2,
            latency_ms: 7,
            usage: vec![
                RawAmount { key: b"input_tokens".to_vec(), value: 900 },
                RawAmount { key: b"cost\xff".to_vec(), value: 3 },
            ],
            reserve: true,
            reservation: Vec::new(),
        }
        .encode_to_vec();
        assert!(pb::RateLimitRequest::decode(raw.as_slice()).is_err(), "prost refuses it");
        let request = pb::RateLimitRequest::decode_lenient(&raw).unwrap();
        assert!(request.user_id.starts_with("eve\u{fffd}#sha256:"), "{}", request.user_id);
        assert_eq!((request.outcome, request.latency_ms), (2, 7), "every field carried over");
        assert!(request.resource_path.starts_with("/api/v1/search\u{fffd}"));
        assert_eq!((request.weight, request.priority, request.client_type.as_str()), (2, 4, ""));
        assert!(request.peek, "the peek flag survives the lenient decoding");
        assert!(request.headers["x-request-id"].starts_with("r\u{fffd}"));
        assert_eq!(request.usage["input_tokens"], 900, "usage carried over");
        assert_eq!(request.usage.len(), 2, "a unit name that is not UTF-8 is kept apart");
    }
}
