//! Counting: the window arithmetic ([`window`]), the token bucket and GCRA
//! ([`bucket`]), `evaluate` which picks by a rule's [`Algorithm`], and the
//! two stores that apply it atomically — [`redis`] (a Lua script) and
//! [`memory`] (sharded maps) — behind one [`Store`].
//!
//! Architecture invariant: no gRPC here, and both stores answer through
//! `Seen::verdict` (the memory store through `evaluate`, the Lua script
//! as its twin), so the embedded default behaves exactly like Redis.

pub mod breaker;
pub mod bucket;
pub mod memory;
pub mod redis;
pub mod window;

use std::{
    fmt::{self, Write as _},
    sync::Arc,
};

pub use memory::MemoryStore;
pub use redis::RedisStore;
use window::StoredCounter;
pub use window::{Algorithm, Verdict, WindowParams};

pub use crate::clock::{Clock, ManualClock, SystemClock};

/// Where counters live. An enum rather than a trait object: static dispatch,
/// and no boxed future per decision.
#[derive(Debug, Clone)]
pub enum Store {
    /// In-process counters (the embedded default).
    Memory(Arc<MemoryStore>),
    /// Counters in Redis, updated by a Lua script.
    Redis(Arc<RedisStore>),
}

impl Store {
    /// Counts a request of `weight` for `user_id` against `counter`, if it
    /// fits. `weight` must not exceed the counter's capacity (the caller
    /// answers those without a store call).
    pub async fn decide(
        &self,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
    ) -> Result<Verdict, StoreError> {
        match self {
            Store::Memory(store) => store.decide(user_id, counter, weight),
            Store::Redis(store) => store.decide(user_id, counter, weight).await,
        }
    }

    /// Decides several counters together, all or nothing (Envoy's
    /// multi-descriptor requests): if any non-shadow item does not fit,
    /// nothing is counted. `group` scopes the keys (the Envoy domain).
    pub async fn decide_many(&self, group: &str, items: &[ManyItem]) -> Result<ManyOutcome, StoreError> {
        match self {
            Store::Memory(store) => store.decide_many(group, items),
            Store::Redis(store) => store.decide_many(group, items).await,
        }
    }

    /// `memory` or `redis`, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }
}

/// Appends `text` to a counter key with `%` and every character of
/// `reserved` (ASCII separators of the key format) percent-encoded, so
/// values can never be confused with the key's structure. Borrowed through
/// when there is nothing to encode, the usual case.
pub fn push_encoded(key: &mut String, text: &str, reserved: &[char]) {
    if !text.contains(|c| c == '%' || reserved.contains(&c)) {
        key.push_str(text);
        return;
    }
    for c in text.chars() {
        if c == '%' || reserved.contains(&c) {
            let _ = write!(key, "%{:02X}", u32::from(c));
        } else {
            key.push(c);
        }
    }
}

/// Which counter of a user a single-counter decision uses: the rule's id
/// (part of the key) and its window. Borrowed from the caller's rule, so the
/// store knows nothing of the rule model.
#[derive(Debug, Clone, Copy)]
pub struct CounterSpec<'a> {
    /// Scopes the counter (a native rule id).
    pub id: &'a Arc<str>,
    /// Window and capacity.
    pub window: WindowParams,
}

/// One counter of a multi-counter decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManyItem {
    /// The counter's key within its group.
    pub key: String,
    /// Window and capacity, in ticks of `tick_ms`.
    pub params: WindowParams,
    /// Length of one tick in ms (1 for windows up to a minute).
    pub tick_ms: u64,
    /// Weight to add.
    pub weight: u64,
    /// Over the limit does not block the other items (and is not counted).
    pub shadow: bool,
}

/// The result of [`Store::decide_many`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManyOutcome {
    /// Whether the items that fit were counted (no enforced item was over).
    pub committed: bool,
    /// Per item, durations in ms. `admitted` says whether the item fit on
    /// its own; `remaining` reflects what was actually counted.
    pub verdicts: Vec<Verdict>,
}

/// What a store saw of one counter, before the request's own weight: the
/// verdict follows from it alone (`Seen::verdict`), for both stores and
/// for the check of every Redis answer against the Rust arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Seen {
    /// A window's counts and the ticks elapsed in the current window.
    Window {
        /// Counts of the current and the previous window.
        counts: window::Counts,
        /// Ticks elapsed in the current window.
        elapsed: u64,
    },
    /// A bucket's debt in units ([`bucket`]).
    Bucket {
        /// Units missing from a full bucket.
        debt: u64,
    },
}

impl Seen {
    /// The verdict for a request of `weight` (durations in ticks).
    pub(crate) fn verdict(self, weight: u64, params: WindowParams) -> Verdict {
        match self {
            Seen::Window { counts, elapsed } => window::decide(counts, elapsed, weight, params),
            Seen::Bucket { debt } => bucket::decide(debt, weight, params.bucket()).0,
        }
    }
}

/// One counter decided at `now` (in ticks): what was seen, the verdict, and
/// the state to store if it is admitted, with how long (in ticks) that
/// state still matters.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Evaluated {
    pub(crate) seen: Seen,
    pub(crate) verdict: Verdict,
    pub(crate) next: StoredCounter,
    pub(crate) ttl: u64,
}

/// Decides a request of `weight` on the counter `stored` (none: never
/// counted, or expired) at `now` ticks, by the rule's algorithm. Pure: the
/// memory store applies `next` on admit; the Lua script is its twin.
/// A bucket keeps its stamp (last refill, or TAT in whole ticks) in
/// `StoredCounter::window` and its level (or TAT remainder) in `current`.
pub(crate) fn evaluate(
    stored: Option<StoredCounter>,
    now: u64,
    weight: u64,
    params: WindowParams,
) -> Evaluated {
    match params.algorithm {
        Algorithm::SlidingWindow | Algorithm::FixedWindow => {
            let (index, elapsed) = window::position(now, params.window_ms);
            let counts = window::roll(stored.unwrap_or_default(), index);
            let verdict = window::decide(counts, elapsed, weight, params);
            Evaluated {
                seen: Seen::Window { counts, elapsed },
                verdict,
                next: StoredCounter {
                    window: index,
                    current: counts.current + weight,
                    previous: counts.previous,
                },
                ttl: 2 * params.window_ms,
            }
        }
        Algorithm::TokenBucket | Algorithm::Gcra => {
            let b = params.bucket();
            let debt = stored.map_or(0, |s| bucket::debt_of(params.algorithm, s.window, s.current, now, b));
            let (verdict, after) = bucket::decide(debt, weight, b);
            let (stamp, value) = bucket::state_of(params.algorithm, after, now, b);
            Evaluated {
                seen: Seen::Bucket { debt },
                verdict,
                next: StoredCounter { window: stamp, current: value, previous: 0 },
                // Until it is full again, at least a tick.
                ttl: after.div_ceil(b.rate.max(1)).max(1),
            }
        }
    }
}

/// Per item: fits, then what the store saw before its own weight.
pub(crate) type RawItem = (bool, Seen);

/// Turns the raw per-item results of either store into verdicts in ms.
pub(crate) fn many_verdicts(items: &[ManyItem], raw: &[RawItem], committed: bool) -> Vec<Verdict> {
    items
        .iter()
        .zip(raw)
        .map(|(item, &(fits, seen))| {
            // Nothing was counted: report the item as if it had no weight.
            let weight = if fits && !committed { 0 } else { item.weight };
            let mut verdict = seen.verdict(weight, item.params);
            verdict.admitted = fits;
            verdict.retry_after_ms = verdict.retry_after_ms.map(|t| t.saturating_mul(item.tick_ms));
            verdict.reset_after_ms = verdict.reset_after_ms.saturating_mul(item.tick_ms);
            verdict
        })
        .collect()
}

/// Why the store could not decide. Cheap to build on the hot path's error
/// branch; the kind is what dashboards and dead-letter records group by.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}: {message}")]
pub struct StoreError {
    /// Classification.
    pub kind: FailureKind,
    /// Detail from the client library (never contains credentials).
    pub message: String,
}

/// Classification of a store failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// The call missed `redis.timeout_ms`.
    Timeout,
    /// Redis refused the connection.
    ConnectionRefused,
    /// The connection broke mid-call.
    ConnectionLost,
    /// No connection could be had from the pool in time, or too many
    /// decisions already wait for one.
    PoolExhausted,
    /// Not tried: the circuit breaker is open after consecutive failures.
    CircuitOpen,
    /// The script failed or answered something unexpected.
    ScriptError,
    /// A Redis Cluster error (slot moved, cluster down).
    ClusterError,
    /// The in-memory store is at `memory.max_counters` and none of the
    /// counters it sampled has expired.
    StoreFull,
    /// Anything else.
    Other,
}

impl FailureKind {
    /// Stable snake_case name used in logs, metrics and records.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureKind::Timeout => "timeout",
            FailureKind::ConnectionRefused => "connection_refused",
            FailureKind::ConnectionLost => "connection_lost",
            FailureKind::PoolExhausted => "pool_exhausted",
            FailureKind::CircuitOpen => "circuit_open",
            FailureKind::ScriptError => "script_error",
            FailureKind::ClusterError => "cluster_error",
            FailureKind::StoreFull => "store_full",
            FailureKind::Other => "other",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
