//! The dead-letter record: one JSON object per failed decision, the same
//! schema in the Kafka topic and in the file sink (see
//! docs/dead-letters.md). Bump [`SCHEMA_VERSION`] on any incompatible change.

use std::{
    collections::BTreeMap,
    hash::{BuildHasher, RandomState},
    sync::Mutex,
};

use serde::{Deserialize, Serialize};

use crate::{
    decision::{FailedDecision, Reason},
    limiter::Count,
};

/// Version of the record schema written in every record.
pub const SCHEMA_VERSION: u32 = 1;

/// One decision the store could not make, as written to the dead-letter sink.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailureRecord {
    /// [`SCHEMA_VERSION`] at the time of writing.
    pub schema_version: u32,
    /// Unique, time-sortable id (ULID: 26 Crockford base32 characters).
    pub event_id: String,
    /// When the decision was made, RFC 3339 UTC with milliseconds.
    pub time: String,
    /// The instance that decided (`dlq.instance_id`).
    pub instance: String,
    /// The request as decided.
    pub request: RecordRequest,
    /// The rule that matched.
    pub rule_id: String,
    /// What went wrong.
    pub failure: RecordFailure,
    /// The answer the failure policy gave.
    pub answer: RecordAnswer,
    /// W3C trace id of the request, when it carried a `traceparent`.
    pub trace_id: Option<String>,
    /// How many failed decisions the record stands for: 1, or for an
    /// aggregate of a flood (`dlq.aggregate_after`) the number folded into
    /// it, the record's request being the first of them. Records written
    /// before the field read as 1.
    #[serde(default = "one")]
    pub count: u64,
    /// An aggregate's last folded failure, RFC 3339 UTC; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_time: Option<String>,
}

fn one() -> u64 {
    1
}

/// The request part of a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordRequest {
    /// The counting dimension; also the Kafka message key.
    pub user_id: String,
    /// The path that was matched.
    pub resource_path: String,
    /// The client type, when given.
    pub client_type: Option<String>,
    /// The effective priority (CRITICAL, DEGRADED, BEST_EFFORT, BULK).
    pub priority: String,
    /// The request's weight.
    pub weight: u32,
    /// How it was to be counted: `admission` (Check, ShouldRateLimit),
    /// `peek` (counts nothing) or `report` (usage counted after the fact,
    /// whatever was left). Records written before the field read as
    /// `admission`.
    #[serde(default = "admission")]
    pub counting: String,
    /// Headers named in `dlq.header_allowlist` (names lower-cased).
    pub headers: BTreeMap<String, String>,
}

fn admission() -> String {
    counting_name(Count::IfFits).to_owned()
}

/// The record's name for how a request was to be counted.
pub fn counting_name(count: Count) -> &'static str {
    match count {
        Count::IfFits => "admission",
        Count::Never => "peek",
        Count::Always => "report",
        Count::Anyway => "admission_anyway",
    }
}

/// The failure part of a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordFailure {
    /// timeout, connection_refused, connection_lost, pool_exhausted, circuit_open,
    /// script_error, cluster_error, store_full or other.
    pub kind: String,
    /// The store's error message.
    pub message: String,
}

/// The answer part of a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecordAnswer {
    /// Whether the request was let through.
    pub allowed: bool,
    /// FAIL_OPEN, FAIL_CLOSED, LOCAL_OK or LOCAL_OVER_LIMIT.
    pub reason: String,
}

/// How much of a request a record keeps (`limits.*`): request values are
/// never refused for their size, so the record bounds them instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordBounds {
    /// `resource_path` beyond this many bytes is truncated.
    pub resource_path_bytes: usize,
    /// `client_type` beyond this many bytes is truncated.
    pub client_type_bytes: usize,
    /// At most this many allow-listed headers are kept.
    pub headers: usize,
    /// A kept header's value beyond this many bytes is truncated.
    pub header_bytes: usize,
}

impl Default for RecordBounds {
    fn default() -> Self {
        RecordBounds { resource_path_bytes: 2_048, client_type_bytes: 64, headers: 64, header_bytes: 8_192 }
    }
}

/// Appended to a truncated field, so a reader sees it was cut.
pub const TRUNCATED: &str = "…[truncated]";

/// `text` cut to at most `max` bytes (at a character boundary) plus
/// [`TRUNCATED`], or whole when it fits.
pub fn truncated(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{TRUNCATED}", &text[..end])
}

impl FailureRecord {
    /// Builds the record of `failure`, decided at `now_ms` by `instance`,
    /// keeping only the headers in `allowlist` (lower-case names), every
    /// request field within `bounds`.
    pub fn new(
        failure: &FailedDecision<'_>,
        event_id: String,
        now_ms: u64,
        instance: &str,
        allowlist: &[String],
        bounds: &RecordBounds,
    ) -> Self {
        let headers = failure
            .headers
            .iter()
            .filter(|(name, _)| allowlist.iter().any(|allowed| allowed.eq_ignore_ascii_case(name)))
            .take(bounds.headers)
            .map(|(name, value)| (name.to_ascii_lowercase(), truncated(value, bounds.header_bytes)))
            .collect();
        FailureRecord {
            schema_version: SCHEMA_VERSION,
            event_id,
            time: format_time(now_ms),
            instance: instance.to_owned(),
            request: RecordRequest {
                user_id: failure.user_id.to_owned(),
                resource_path: truncated(failure.resource_path, bounds.resource_path_bytes),
                client_type: failure.client_type.map(|c| truncated(c, bounds.client_type_bytes)),
                priority: failure.priority.as_str().to_owned(),
                weight: failure.weight,
                counting: counting_name(failure.count).to_owned(),
                headers,
            },
            rule_id: failure.rule_id.to_owned(),
            failure: RecordFailure {
                kind: failure.error.kind.as_str().to_owned(),
                message: failure.error.message.clone(),
            },
            answer: RecordAnswer {
                allowed: matches!(failure.answer, Reason::FailOpen | Reason::LocalOk),
                reason: failure.answer.as_str().to_owned(),
            },
            trace_id: failure.trace_id.map(str::to_owned),
            count: 1,
            last_time: None,
        }
    }

    /// What the record holds in memory, about: its strings plus a fixed
    /// overhead. The queue's byte bound counts this.
    pub fn size_bytes(&self) -> u64 {
        let strings = self.event_id.len()
            + self.time.len()
            + self.instance.len()
            + self.request.user_id.len()
            + self.request.resource_path.len()
            + self.request.client_type.as_ref().map_or(0, String::len)
            + self.request.priority.len()
            + self.request.counting.len()
            + self.request.headers.iter().map(|(k, v)| k.len() + v.len() + 64).sum::<usize>()
            + self.rule_id.len()
            + self.failure.kind.len()
            + self.failure.message.len()
            + self.answer.reason.len()
            + self.trace_id.as_ref().map_or(0, String::len)
            + self.last_time.as_ref().map_or(0, String::len);
        (std::mem::size_of::<Self>() + strings) as u64
    }

    /// The record's time in ms since the epoch, if it parses.
    pub fn time_ms(&self) -> Option<u64> {
        parse_time(&self.time)
    }
}

/// RFC 3339 UTC with milliseconds, e.g. `2026-11-21T06:40:00.123Z`.
pub fn format_time(ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms)).to_string()
}

/// Parses an RFC 3339 time into ms since the epoch.
pub fn parse_time(text: &str) -> Option<u64> {
    let time = humantime::parse_rfc3339_weak(text).ok()?;
    u64::try_from(time.duration_since(std::time::UNIX_EPOCH).ok()?.as_millis()).ok()
}

/// ULIDs: 48 bits of ms timestamp then 80 random bits, incremented within
/// one ms so ids from one generator are strictly increasing.
#[derive(Debug)]
pub struct EventIds {
    state: Mutex<(u64, u128)>,
    seed: RandomState,
}

impl Default for EventIds {
    fn default() -> Self {
        EventIds { state: Mutex::new((0, 0)), seed: RandomState::new() }
    }
}

impl EventIds {
    /// The next id at `now_ms`.
    pub fn next(&self, now_ms: u64) -> String {
        const RANDOM_BITS: u32 = 80;
        const RANDOM_MASK: u128 = (1 << RANDOM_BITS) - 1;
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (last_ms, last_random) = *state;
        let (ms, random) = if now_ms > last_ms {
            let high = u128::from(self.seed.hash_one((now_ms, 0_u8)));
            let low = u128::from(self.seed.hash_one((now_ms, 1_u8)));
            // Leave headroom below the top so increments within the ms never overflow.
            (now_ms, ((high << 64) | low) & (RANDOM_MASK >> 1))
        } else {
            (last_ms, (last_random + 1) & RANDOM_MASK)
        };
        *state = (ms, random);
        drop(state);
        encode_ulid((u128::from(ms & 0xFFFF_FFFF_FFFF) << RANDOM_BITS) | random)
    }
}

fn encode_ulid(value: u128) -> String {
    const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
    (0..26).rev().map(|i| ALPHABET[((value >> (i * 5)) & 0x1F) as usize] as char).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_a_char_boundary_and_says_so() {
        assert_eq!(truncated("short", 8), "short");
        assert_eq!(truncated("abcdefghij", 4), format!("abcd{TRUNCATED}"));
        // 'é' is two bytes: a cut inside it backs off to the boundary.
        assert_eq!(truncated("aé", 2), format!("a{TRUNCATED}"));
    }

    #[test]
    fn event_ids_are_unique_and_sortable() {
        let ids = EventIds::default();
        let mut previous = String::new();
        for ms in [1_000, 1_000, 1_000, 1_001, 5_000, 5_000] {
            let id = ids.next(ms);
            assert_eq!(id.len(), 26);
            assert!(id > previous, "{id} <= {previous}");
            previous = id;
        }
        // A clock that steps back does not break monotonicity.
        assert!(ids.next(10) > previous);
    }

    #[test]
    fn a_failed_report_says_so_and_older_records_read_as_admissions() {
        let headers = std::collections::HashMap::new();
        let error = crate::limiter::StoreError {
            kind: crate::limiter::FailureKind::Timeout,
            message: "slow".to_owned(),
        };
        let failure = FailedDecision {
            user_id: "ann",
            resource_path: "/llm",
            client_type: None,
            weight: 1_500,
            count: Count::Always,
            headers: &headers,
            trace_id: None,
            rule_id: "tokens",
            priority: crate::shed::Priority::Critical,
            error: &error,
            answer: Reason::FailOpen,
        };
        let record = FailureRecord::new(&failure, "01J".to_owned(), 0, "i", &[], &RecordBounds::default());
        let json = serde_json::to_value(&record).unwrap();
        assert_eq!(
            (json["request"]["counting"].as_str(), json["request"]["weight"].as_u64()),
            (Some("report"), Some(1_500))
        );
        let mut old = json;
        old["request"].as_object_mut().unwrap().remove("counting");
        let read: FailureRecord = serde_json::from_value(old).unwrap();
        assert_eq!(read.request.counting, "admission");
    }

    #[test]
    fn time_round_trips() {
        let ms = 1_795_242_205_123;
        let text = format_time(ms);
        assert_eq!(text, "2026-11-21T06:23:25.123Z");
        assert_eq!(parse_time(&text), Some(ms));
    }
}
