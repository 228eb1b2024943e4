//! How the engine treats Envoy requests (`envoy.*`, `shed.*`), and what the
//! settings say of one limit or one domain.

use std::collections::{HashMap, HashSet};

use crate::{limiter::window::Algorithm, rules::envoy::EnvoyLimit, shed::Priority};

/// How the engine treats Envoy requests (from `envoy.*` and `shed.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct EnvoyPolicy {
    /// How limits without an `algorithm` of their own count, request
    /// overrides included (`envoy.algorithm`: a sliding or a fixed window).
    pub algorithm: Algorithm,
    /// What answers when the store cannot decide (`envoy.failure_mode`).
    pub failure: EnvoyFailure,
    /// The same, per domain (`envoy.domain_failure_mode`), over `failure`.
    pub domain_failure: HashMap<String, EnvoyFailure>,
    /// A descriptor entry with this key and a priority name as its value
    /// sets the request's priority (`envoy.priority_key`; empty: none).
    pub priority_key: String,
    /// Priority of requests to a domain whose descriptors name none
    /// (`envoy.domain_priority`).
    pub domain_priority: HashMap<String, Priority>,
    /// A longer entry key or value is counted by its digest
    /// (`envoy.max_entry_bytes`).
    pub max_value_bytes: usize,
    /// Domains whose requests may supply their own limit
    /// (`envoy.allow_request_limits` with `envoy.request_limit_domains`);
    /// empty: no request limit is honoured.
    pub request_limit_domains: HashSet<String>,
    /// Every limit is in quota mode (`envoy.quota_mode`, upstream's
    /// `QUOTA_MODE`), as if each descriptor said `quota_mode: true`.
    pub quota_mode: bool,
    /// Every limit is in shadow mode (`envoy.shadow_mode`, upstream's
    /// `SHADOW_MODE`): over-limit is counted and reported, never enforced.
    pub shadow_mode: bool,
    /// Count every descriptor in envoyproxy/ratelimit's terms
    /// ([`crate::decision::Stats::limit_hits`]; `envoy.upstream_metrics`).
    pub upstream_metrics: bool,
    /// Hits past this share of a limit are `near_limit`
    /// (`envoy.near_limit_ratio`, upstream's `NEAR_LIMIT_RATIO`).
    pub near_limit_ratio: f32,
    /// A 0-hit check passes while the count is within the limit (weight 0)
    /// rather than while one more hit fits (weight 1)
    /// (`envoy.zero_hits: within_limit`).
    pub zero_hits_within_limit: bool,
    /// Every hit is counted, each descriptor on its own, over the limit
    /// too (`envoy.hits_counted: always`).
    pub count_every_hit: bool,
}

impl Default for EnvoyPolicy {
    fn default() -> Self {
        EnvoyPolicy {
            algorithm: Algorithm::SlidingWindow,
            failure: EnvoyFailure::Local,
            domain_failure: HashMap::new(),
            priority_key: "priority".to_owned(),
            domain_priority: HashMap::new(),
            max_value_bytes: 1_024,
            request_limit_domains: HashSet::new(),
            quota_mode: false,
            shadow_mode: false,
            upstream_metrics: true,
            near_limit_ratio: 0.8,
            zero_hits_within_limit: false,
            count_every_hit: false,
        }
    }
}

/// What answers a `ShouldRateLimit` the store could not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyFailure {
    /// The local limiter, at this instance's share of each limit (reasons
    /// LOCAL_OK and LOCAL_OVER_LIMIT); every descriptor OVER_LIMIT when it
    /// is at its bound.
    Local,
    /// OK, nothing counted (FAIL_OPEN).
    Open,
    /// The API answers UNAVAILABLE (FAIL_CLOSED), so Envoy's own
    /// `failure_mode_deny` decides.
    Unavailable,
}

impl EnvoyPolicy {
    /// Whether `limit` is in shadow mode: its own `shadow_mode`, or
    /// `envoy.shadow_mode` for all.
    pub(super) fn shadow(&self, limit: &EnvoyLimit) -> bool {
        limit.shadow_mode || self.shadow_mode
    }

    /// Whether `limit` is in quota mode: its own `quota_mode`, or
    /// `envoy.quota_mode` for all.
    pub(super) fn quota(&self, limit: &EnvoyLimit) -> bool {
        limit.quota_mode || self.quota_mode
    }

    /// The answer `envoy.failure_mode` (or the domain's own) gives for
    /// `domain`.
    pub(super) fn failure_for(&self, domain: &str) -> EnvoyFailure {
        self.domain_failure.get(domain).copied().unwrap_or(self.failure)
    }
}
