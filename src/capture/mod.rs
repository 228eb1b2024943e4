//! Capture: a sample of decided `Check` and `ShouldRateLimit` requests
//! mirrored to a JSON-lines file or a Kafka topic, for `ratelimitd replay`
//! and the publish gate.
//!
//! Users, not requests, are sampled: [`sampled`] hashes the user id keyed by
//! `capture.salt` (SHA-256 of the salt and the id), the same on every
//! instance that shares the salt, and captures the user when the hash
//! falls below `capture.sample_ratio` × 2^64. A captured user's every
//! request is captured, so replay counts that user's counters exactly. An
//! Envoy request is sampled the same way by its domain and its first
//! descriptor's entries, so the counter of a first descriptor is replayed
//! exactly (those of later descriptors, shared with unsampled requests,
//! approximately). The salt is a secret: without it a client cannot tell
//! which ids are sampled, so it cannot choose to be (to pass or poison the
//! publish gate).
//!
//! The hot path builds the record and `try_send`s it into a bounded queue;
//! a full queue drops the record and counts it. One writer task appends
//! batches to the file (never past `capture.file_max_bytes`) or produces
//! them to the topic. Counters: `enqueued = written + dropped + in flight`.
//! Losing capture records costs replay accuracy, never a decision, so there
//! is no spool.

#[cfg(feature = "kafka")]
mod kafka;
mod record;
mod writer;

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::sync::mpsc;

#[cfg(feature = "kafka")]
pub use kafka::{producer, run_kafka};
pub use record::{CAPTURE_SCHEMA, CaptureRecord, CountKind, MAX_CAPTURED_UNITS};
pub use writer::run_file;

use sha2::{Digest as _, Sha256};

use crate::{
    clock::{Clock, SystemClock},
    decision::{CaptureSink, CheckRequest, Decision, EnvoyCall, RlsDecision, keys},
    dlq::record::truncated,
    limiter::Count,
};

/// Whether `user_id` is sampled at `threshold` (`ratio × 2^64`) under
/// `salt`: the first 8 bytes of SHA-256(salt length, salt, id), below the
/// threshold.
pub fn sampled(salt: &[u8], user_id: &str, threshold: u64) -> bool {
    below(salted(salt).chain_update(user_id.as_bytes()), threshold)
}

/// Whether Envoy requests of `domain` whose first descriptor has `entries`
/// are sampled: as [`sampled`], over a tag, the domain and each entry's
/// key and value, each prefixed by its length.
pub fn envoy_sampled(
    salt: &[u8],
    domain: &str,
    entries: &mut dyn Iterator<Item = (&str, &str)>,
    threshold: u64,
) -> bool {
    let field = |hash: Sha256, bytes: &[u8]| {
        hash.chain_update((bytes.len() as u64).to_le_bytes()).chain_update(bytes)
    };
    let mut hash = field(salted(salt).chain_update(b"envoy\0"), domain.as_bytes());
    for (key, value) in entries {
        hash = field(field(hash, key.as_bytes()), value.as_bytes());
    }
    below(hash, threshold)
}

fn salted(salt: &[u8]) -> Sha256 {
    Sha256::new().chain_update((salt.len() as u64).to_le_bytes()).chain_update(salt)
}

fn below(hash: Sha256, threshold: u64) -> bool {
    let digest = hash.finalize();
    u64::from_le_bytes(digest[..8].try_into().expect("a SHA-256 digest has 32 bytes")) < threshold
}

/// `ratio × 2^64`, saturating (1.0 captures everyone).
pub fn threshold(ratio: f64) -> u64 {
    if ratio >= 1.0 {
        u64::MAX
    } else {
        // Within 0..1: the product fits.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let t = (ratio * 18_446_744_073_709_551_616.0) as u64;
        t
    }
}

/// What the capture pipeline did, for `/metrics`.
#[derive(Debug, Default)]
pub struct CaptureCounters {
    /// Records queued by the hot path.
    pub enqueued: AtomicU64,
    /// Records written to the file or acknowledged by Kafka.
    pub written: AtomicU64,
    /// Dropped: the queue was full.
    pub dropped_queue_full: AtomicU64,
    /// Dropped: the file reached `capture.file_max_bytes`.
    pub dropped_disk_cap: AtomicU64,
    /// Dropped: the file could not be written or Kafka refused them.
    pub dropped_error: AtomicU64,
}

/// Bounds on what a record copies from a request.
#[derive(Debug, Clone)]
pub struct Bounds {
    /// A longer user id is recorded as the digest the engine counts it by.
    pub user_id_bytes: usize,
    /// Longer paths and client types are truncated (with a marker).
    pub resource_path_bytes: usize,
    /// As above.
    pub client_type_bytes: usize,
    /// Each allow-listed header's value is truncated to this.
    pub header_bytes: usize,
}

/// The sampling secret.
struct Salt(Box<[u8]>);

impl std::fmt::Debug for Salt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// The engine's [`CaptureSink`]: samples, builds, enqueues.
#[derive(Debug)]
pub struct Capture {
    threshold: u64,
    /// `capture.salt`: never printed.
    salt: Salt,
    queue: mpsc::Sender<CaptureRecord>,
    counters: Arc<CaptureCounters>,
    /// Lower-case header names copied into records.
    allowlist: Vec<String>,
    bounds: Bounds,
    instance: Arc<str>,
}

impl Capture {
    /// A sink sampling `ratio` of users into a queue of `capacity` records;
    /// returns the sink, the queue's receiving end (for a writer) and the counters.
    pub fn new(
        ratio: f64,
        salt: &str,
        capacity: usize,
        allowlist: &[String],
        bounds: Bounds,
        instance: String,
    ) -> (Self, mpsc::Receiver<CaptureRecord>, Arc<CaptureCounters>) {
        let (tx, rx) = mpsc::channel(capacity);
        let counters = Arc::new(CaptureCounters::default());
        let capture = Capture {
            threshold: threshold(ratio),
            salt: Salt(salt.as_bytes().into()),
            queue: tx,
            counters: Arc::clone(&counters),
            allowlist: allowlist.iter().map(|h| h.to_ascii_lowercase()).collect(),
            bounds,
            instance: Arc::from(instance),
        };
        (capture, rx, counters)
    }
}

impl CaptureSink for Capture {
    fn wants(&self, user_id: &str) -> bool {
        sampled(&self.salt.0, user_id, self.threshold)
    }

    fn record(&self, request: &CheckRequest<'_>, decision: &Decision, rules_version: &str) {
        let b = &self.bounds;
        let mut headers = BTreeMap::new();
        for (name, value) in request.headers {
            if headers.len() < self.allowlist.len()
                && self.allowlist.iter().any(|allowed| allowed.eq_ignore_ascii_case(name))
            {
                headers.insert(name.to_ascii_lowercase(), truncated(value, b.header_bytes));
            }
        }
        let record = CaptureRecord {
            schema: CAPTURE_SCHEMA.to_owned(),
            time_ms: SystemClock.now_ms(),
            instance: self.instance.to_string(),
            user_id: keys::bounded(request.user_id, b.user_id_bytes).into_owned(),
            resource_path: truncated(request.resource_path, b.resource_path_bytes),
            client_type: request.client_type.map(|c| truncated(c, b.client_type_bytes)),
            priority: request.priority,
            weight: request.weight,
            usage: captured_usage(request.usage),
            count: CountKind::of(request.count),
            headers,
            rules_version: rules_version.to_owned(),
            rule_id: decision.rule.as_ref().map(|r| r.id.to_string()),
            effective_priority: decision.priority,
            allowed: decision.allowed,
            reason: decision.reason.as_str().to_owned(),
            envoy: None,
        };
        self.enqueue(record);
    }

    fn wants_envoy(&self, domain: &str, first_entries: &mut dyn Iterator<Item = (&str, &str)>) -> bool {
        envoy_sampled(&self.salt.0, domain, first_entries, self.threshold)
    }

    fn record_envoy(&self, call: EnvoyCall, count: Count, decision: &RlsDecision, envoy_version: &str) {
        let bound = decision.bound_limit();
        let record = CaptureRecord {
            schema: CAPTURE_SCHEMA.to_owned(),
            time_ms: SystemClock.now_ms(),
            instance: self.instance.to_string(),
            user_id: String::new(),
            resource_path: String::new(),
            client_type: None,
            priority: None,
            weight: call.hits_addend.max(1),
            usage: BTreeMap::new(),
            count: CountKind::of(count),
            headers: BTreeMap::new(),
            rules_version: envoy_version.to_owned(),
            rule_id: bound.map(|limit| limit.full_key.to_string()),
            effective_priority: decision.priority,
            allowed: !decision.over_limit,
            reason: decision.reason.as_str().to_owned(),
            envoy: Some(call),
        };
        self.enqueue(record);
    }
}

/// The part of a request's `usage` a capture keeps: at most
/// [`MAX_CAPTURED_UNITS`] entries whose names a rule's unit could have
/// (any other names no limit counts).
fn captured_usage(usage: &HashMap<String, u64>) -> BTreeMap<String, u64> {
    usage
        .iter()
        .filter(|(name, _)| name.len() <= crate::rules::MAX_UNIT_BYTES)
        .take(MAX_CAPTURED_UNITS)
        .map(|(name, &amount)| (name.clone(), amount))
        .collect()
}

impl Capture {
    fn enqueue(&self, record: CaptureRecord) {
        self.counters.enqueued.fetch_add(1, Ordering::Relaxed);
        if self.queue.try_send(record).is_err() {
            self.counters.dropped_queue_full.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The capture pipeline: `enqueued = written + dropped (by reason) + in flight`.
impl crate::telemetry::Figures for CaptureCounters {
    fn render(&self, out: &mut String) {
        use std::fmt::Write as _;

        use crate::telemetry::exposition::header;

        use std::sync::atomic::Ordering::Relaxed;
        header(
            out,
            "ratelimitd_capture_records_total",
            "counter",
            "Captured requests by what became of them.",
        );
        for (result, value) in [
            ("enqueued", self.enqueued.load(Relaxed)),
            ("written", self.written.load(Relaxed)),
            ("dropped_queue_full", self.dropped_queue_full.load(Relaxed)),
            ("dropped_disk_cap", self.dropped_disk_cap.load(Relaxed)),
            ("dropped_error", self.dropped_error.load(Relaxed)),
        ] {
            let _ = writeln!(out, "ratelimitd_capture_records_total{{result=\"{result}\"}} {value}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_are_sampled_in_proportion_and_alike_where_the_salt_is_shared() {
        let salt = b"a secret every instance shares";
        let t = threshold(0.1);
        let hits = (0..100_000).filter(|i| sampled(salt, &format!("user-{i}"), t)).count();
        assert!((9_000..11_000).contains(&hits), "{hits}");
        assert!((0..1_000).all(|i| sampled(salt, &format!("u{i}"), threshold(1.0))));
        assert!((0..1_000).all(|i| !sampled(salt, &format!("u{i}"), threshold(0.0))));
        // Another salt samples other users: which ids are in is the salt's
        // secret, not a property of the id a client picks.
        let half = threshold(0.5);
        let agree = (0..10_000)
            .filter(|i| {
                let id = format!("u{i}");
                sampled(salt, &id, half) == sampled(b"another secret", &id, half)
            })
            .count();
        assert!((4_500..5_500).contains(&agree), "{agree} of 10000 agree: independent");
        let again = (0..10_000).all(|i| {
            let id = format!("u{i}");
            sampled(salt, &id, half) == sampled(&salt[..], &id, half)
        });
        assert!(again, "the same salt gives the same answer on every instance");
    }

    #[test]
    fn envoy_requests_are_sampled_by_domain_and_first_descriptor() {
        let salt = b"a secret every instance shares";
        let t = threshold(0.1);
        let sample = |domain: &str, entries: &[(&str, &str)]| {
            envoy_sampled(salt, domain, &mut entries.iter().copied(), t)
        };
        let hits = (0..100_000).filter(|i| sample("edge", &[("user", &format!("u{i}"))])).count();
        assert!((9_000..11_000).contains(&hits), "{hits}");
        // Length prefixes: moving a byte between key and value, or between
        // the domain and an entry, is another request.
        let moved = (0..10_000)
            .filter(|i| {
                let v = format!("{i}");
                sample("edge", &[("user", &v)]) != sample("edge", &[("use", &format!("r{v}"))])
            })
            .count();
        assert!((1_000..2_000).contains(&moved), "independent: {moved}");
        assert!((0..1_000).all(|i| !envoy_sampled(salt, "d", &mut [("k", &*format!("{i}"))].into_iter(), 0)));
    }
}
