//! Counting: the sliding-window arithmetic ([`window`]) and the two stores
//! that apply it atomically — [`redis`] (a Lua script) and [`memory`]
//! (sharded maps) — behind one [`Store`].
//!
//! Architecture invariant: no gRPC here, and both stores answer through
//! [`window::decide`], so the embedded default behaves exactly like Redis.

pub mod memory;
pub mod redis;
pub mod window;

use std::{fmt, sync::Arc};

pub use memory::MemoryStore;
pub use redis::RedisStore;
pub use window::Verdict;

pub use crate::clock::{Clock, ManualClock, SystemClock};

use crate::rules::Rule;

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
    /// Counts a request of `weight` for `user_id` against `rule`, if it fits.
    /// `weight` must not exceed the rule's capacity (the caller answers those
    /// without a store call).
    pub async fn decide(&self, user_id: &str, rule: &Rule, weight: u64) -> Result<Verdict, StoreError> {
        match self {
            Store::Memory(store) => Ok(store.decide(user_id, rule, weight)),
            Store::Redis(store) => store.decide(user_id, rule, weight).await,
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
    /// No connection could be had from the pool in time.
    PoolExhausted,
    /// The script failed or answered something unexpected.
    ScriptError,
    /// A Redis Cluster error (slot moved, cluster down).
    ClusterError,
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
            FailureKind::ScriptError => "script_error",
            FailureKind::ClusterError => "cluster_error",
            FailureKind::Other => "other",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
