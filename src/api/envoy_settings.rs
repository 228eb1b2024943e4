//! `envoy.*`: how `ShouldRateLimit` counts, fails, prioritises, bounds and
//! answers Envoy requests; the settings this API owns (validated by
//! `config`, which composes them).

use std::collections::HashMap;

use serde::Deserialize;

use crate::{
    decision::{EnvoyFailure, EnvoyPolicy},
    limiter::window::Algorithm,
    shed::Priority,
};

/// Counting algorithm of Envoy descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvoyAlgorithm {
    /// Sliding window: no client gets twice the limit across a window edge.
    #[default]
    SlidingWindow,
    /// envoyproxy/ratelimit's fixed window, for exact parity.
    FixedWindow,
}

/// What a descriptor with no hits (`hits_addend: 0`, a check that counts
/// nothing) asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvoyZeroHits {
    /// Whether one more hit would fit: OVER_LIMIT once the count reaches
    /// the limit, so a check says what the next request would get.
    #[default]
    NextHit,
    /// Whether the count is still within the limit: OVER_LIMIT only past
    /// it (envoyproxy/ratelimit's answer, on which its token-quota flow
    /// relies: check with 0 hits, debit after the response).
    WithinLimit,
}

/// Which hits a descriptor's counter takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvoyHitsCounted {
    /// The hits of an admitted request only, all or nothing: a request one
    /// enforced descriptor denies consumes nothing, from any descriptor.
    #[default]
    IfAdmitted,
    /// Every hit, each descriptor on its own, over the limit too
    /// (envoyproxy/ratelimit's INCRBY, on which its token-quota flow
    /// relies: a usage report after the response is counted even when it
    /// overdraws). A denied request still consumes.
    Always,
}

/// How the rate-limit response headers are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvoyHeaderFormat {
    /// The tightest limit's number, as envoyproxy/ratelimit writes it.
    #[default]
    Plain,
    /// draft-ietf-httpapi-ratelimit-headers-03: the tightest limit, then
    /// every descriptor's quota policy (`10, 10;w=60, 1000;w=3600`), as
    /// Envoy's own `DRAFT_VERSION_03` headers.
    Draft03,
}

/// What `ShouldRateLimit` answers when the counter store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvoyFailureMode {
    /// Decide locally at this instance's share of each limit (the local
    /// limiter), flagged with `envoy.error_header`.
    #[default]
    Local,
    /// Answer OK (and record the failure like any failed decision).
    Allow,
    /// Answer gRPC UNAVAILABLE, so Envoy's own `failure_mode_deny` decides.
    Unavailable,
}

/// `envoy.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvoySettings {
    /// `sliding_window` or `fixed_window`: how limits without a `rate_limit.algorithm` of their own
    /// count.
    ///
    /// Default: `sliding_window` (`fixed_window` with `RATELIMITD_COMPAT=envoyproxy`)
    pub algorithm: EnvoyAlgorithm,
    /// What a descriptor with no hits (`hits_addend: 0`) asks: `next_hit`, whether one more hit
    /// fits (OVER_LIMIT once the count reaches the limit), or `within_limit`, whether the count is
    /// within the limit (OVER_LIMIT only past it: envoyproxy/ratelimit's answer, on which its
    /// token-quota flow relies).
    ///
    /// Default: `next_hit` (`within_limit` with `RATELIMITD_COMPAT=envoyproxy`)
    pub zero_hits: EnvoyZeroHits,
    /// Which hits a descriptor's counter takes: `if_admitted`, those of admitted requests only, all
    /// or nothing (a request one enforced descriptor denies consumes nothing from any), or
    /// `always`, every hit, each descriptor on its own, over the limit too (envoyproxy/ratelimit's
    /// INCRBY, on which its token-quota flow relies: a usage report after the response counts even
    /// when it overdraws).
    ///
    /// Default: `if_admitted` (`always` with `RATELIMITD_COMPAT=envoyproxy`)
    pub hits_counted: EnvoyHitsCounted,
    /// When the store cannot decide: `local` (this instance's share, flagged), `allow` (OK,
    /// recorded) or `unavailable` (gRPC UNAVAILABLE).
    pub failure_mode: EnvoyFailureMode,
    /// The failure mode of a domain (`domain: MODE`), over `failure_mode`.
    pub domain_failure_mode: HashMap<String, EnvoyFailureMode>,
    /// Header naming the failure kind of a decision the shared store did
    /// not make (`timeout`, `circuit_open`, ...): Envoy adds it to the
    /// response (the 200 and the 429) and to the request it forwards
    /// upstream. Empty: no header.
    pub error_header: String,
    /// Add rate-limit headers (of the descriptor closest to its limit) to responses.
    pub response_headers: bool,
    /// `plain` (the tightest limit's number, as envoyproxy/ratelimit) or `draft03` (followed by
    /// every descriptor's quota policy, `10, 10;w=60, 1000;w=3600;name="daily"`).
    pub response_headers_format: EnvoyHeaderFormat,
    /// Add the standard `RateLimit-Policy` and `RateLimit` headers (draft-ietf-httpapi-ratelimit-headers-11:
    /// every quota policy the request met, `"name";q=100;w=60`, and the binding one's remaining and
    /// reset in seconds, `"name";r=50;t=30`) to every domain's responses, beside the `X-RateLimit-*`
    /// ones of `response_headers`.
    pub ratelimit_headers: bool,
    /// Whether a domain's responses carry the standard headers (`domain: true|false`), over
    /// `ratelimit_headers`.
    pub domain_ratelimit_headers: HashMap<String, bool>,
    /// Name of the limit header.
    pub limit_header: String,
    /// Name of the remaining header.
    pub remaining_header: String,
    /// Name of the reset header (seconds).
    pub reset_header: String,
    /// Most descriptors in one `ShouldRateLimit` request (INVALID_ARGUMENT beyond).
    pub max_descriptors: usize,
    /// Most entries in one descriptor (INVALID_ARGUMENT beyond).
    pub max_entries: usize,
    /// Longest domain, in bytes (a longer one is refused: domains come
    /// from Envoy's configuration, not from clients); and the longest entry
    /// key or value counted as it is: a longer one is counted by its SHA-256
    /// digest, exactly, never refused.
    pub max_entry_bytes: usize,
    /// A descriptor entry with this key and a priority name as its value
    /// (`CRITICAL`, `DEGRADED`, `BEST_EFFORT`, `BULK`, any case) sets the
    /// request's priority for load shedding; the entry still takes part in
    /// matching like any other. Empty: requests never state a priority.
    pub priority_key: String,
    /// Priority of requests to a domain (`domain: PRIORITY`) whose
    /// descriptors state none; other domains get `shed.default_priority`.
    ///
    /// Default: none (`shed.default_priority` applies)
    pub domain_priority: HashMap<String, Priority>,
    /// Response header naming why a request was refused when it was shed
    /// (value `SHED`); Envoy adds it to its 429. Empty: no header.
    pub reason_header: String,
    /// Honour a request's own limit (`RateLimitDescriptor.limit`), for the
    /// domains in `request_limit_domains` only. Off: the configured limit
    /// applies as if the request had sent none.
    pub allow_request_limits: bool,
    /// Those domains (comma-separated in the environment); required when allowed.
    pub request_limit_domains: Vec<String>,
    /// Every limit in quota mode (upstream's `QUOTA_MODE`): the overall
    /// code is OVER_LIMIT only when every descriptor with a limit is over.
    pub quota_mode: bool,
    /// Every limit in shadow mode (upstream's `SHADOW_MODE`): over-limit hits are counted and
    /// reported (`ratelimit_service_rate_limit_shadow_mode`), never refused.
    pub shadow_mode: bool,
    /// A domain may be spread over several files (or xDS resources, or snapshot files), whose
    /// top-level descriptors are merged (upstream's `MERGE_DOMAIN_CONFIG`); the same descriptor
    /// twice is still an error. Off: a domain in two files is an error.
    pub merge_domains: bool,
    /// Answer with dynamic metadata (upstream's `RESPONSE_DYNAMIC_METADATA`):
    /// the domain, the request's descriptors, and the `metadata` of the
    /// limits that passed, merged, under `metadata`, which Envoy stores in
    /// the filter's namespace (`envoy.filters.http.ratelimit`) to route on.
    pub response_dynamic_metadata: bool,
    /// Also count every descriptor under envoyproxy/ratelimit's metric
    /// names and labels (`ratelimit_service_rate_limit_*`), and with
    /// limitador's limits every call under limitador's (`authorized_calls`,
    /// `authorized_hits`, `limited_calls`), so their dashboards and alerts
    /// carry over.
    pub upstream_metrics: bool,
    /// Admitted hits past this share of their limit count as `near_limit`
    /// (upstream's `NEAR_LIMIT_RATIO`).
    pub near_limit_ratio: f32,
    /// Most distinct stat keys the upstream families count (keys from `detailed_metric`,
    /// `value_to_metric` and request limits come from requests); hits past it count in
    /// `ratelimitd_upstream_metric_keys_refused_total`. A key over 512 bytes (long request values)
    /// is counted as its first bytes and the digest of the whole, so the series hold at most this
    /// many × 512 bytes of keys. With limitador's limits, also the most label sets (namespace, and
    /// limit name) limitador's families count; calls past it count in
    /// `ratelimitd_limitador_metric_series_refused_total`.
    pub upstream_metrics_max_keys: usize,
    /// With limitador's limits, label `limited_calls` by the refusing limit's `name` too
    /// (limitador's `--limit-name-in-labels`, `LIMIT_NAME_IN_PROMETHEUS_LABELS`).
    pub upstream_metrics_limit_name: bool,
}

impl Default for EnvoySettings {
    fn default() -> Self {
        Self {
            algorithm: EnvoyAlgorithm::SlidingWindow,
            zero_hits: EnvoyZeroHits::NextHit,
            hits_counted: EnvoyHitsCounted::IfAdmitted,
            failure_mode: EnvoyFailureMode::Local,
            domain_failure_mode: HashMap::new(),
            error_header: "x-ratelimit-error".to_owned(),
            response_headers: false,
            response_headers_format: EnvoyHeaderFormat::Plain,
            ratelimit_headers: false,
            domain_ratelimit_headers: HashMap::new(),
            limit_header: "x-ratelimit-limit".to_owned(),
            remaining_header: "x-ratelimit-remaining".to_owned(),
            reset_header: "x-ratelimit-reset".to_owned(),
            max_descriptors: 64,
            max_entries: 32,
            max_entry_bytes: 1_024,
            priority_key: "priority".to_owned(),
            domain_priority: HashMap::new(),
            reason_header: "x-ratelimit-reason".to_owned(),
            allow_request_limits: false,
            request_limit_domains: Vec::new(),
            quota_mode: false,
            shadow_mode: false,
            merge_domains: false,
            response_dynamic_metadata: false,
            upstream_metrics: true,
            near_limit_ratio: 0.8,
            upstream_metrics_max_keys: 10_000,
            upstream_metrics_limit_name: false,
        }
    }
}

impl EnvoySettings {
    /// Whether `domain`'s responses carry the standard `RateLimit-Policy`
    /// and `RateLimit` headers.
    pub fn ratelimit_headers_for(&self, domain: &str) -> bool {
        self.domain_ratelimit_headers.get(domain).copied().unwrap_or(self.ratelimit_headers)
    }

    /// How the engine treats Envoy requests under these settings.
    pub fn policy(&self) -> EnvoyPolicy {
        let settings = self;
        EnvoyPolicy {
            algorithm: match settings.algorithm {
                EnvoyAlgorithm::SlidingWindow => Algorithm::SlidingWindow,
                EnvoyAlgorithm::FixedWindow => Algorithm::FixedWindow,
            },
            failure: envoy_failure(settings.failure_mode),
            domain_failure: settings
                .domain_failure_mode
                .iter()
                .map(|(domain, mode)| (domain.clone(), envoy_failure(*mode)))
                .collect(),
            priority_key: settings.priority_key.clone(),
            domain_priority: settings.domain_priority.clone(),
            max_value_bytes: settings.max_entry_bytes,
            request_limit_domains: if settings.allow_request_limits {
                settings.request_limit_domains.iter().cloned().collect()
            } else {
                Default::default()
            },
            quota_mode: settings.quota_mode,
            shadow_mode: settings.shadow_mode,
            upstream_metrics: settings.upstream_metrics,
            near_limit_ratio: settings.near_limit_ratio,
            zero_hits_within_limit: settings.zero_hits == EnvoyZeroHits::WithinLimit,
            count_every_hit: settings.hits_counted == EnvoyHitsCounted::Always,
        }
    }
}

fn envoy_failure(mode: EnvoyFailureMode) -> EnvoyFailure {
    match mode {
        EnvoyFailureMode::Local => EnvoyFailure::Local,
        EnvoyFailureMode::Allow => EnvoyFailure::Open,
        EnvoyFailureMode::Unavailable => EnvoyFailure::Unavailable,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn envoy_policy_follows_the_settings() {
        let settings = EnvoySettings {
            algorithm: EnvoyAlgorithm::FixedWindow,
            failure_mode: EnvoyFailureMode::Unavailable,
            ..EnvoySettings::default()
        };
        let policy = settings.policy();
        assert!(policy.algorithm == Algorithm::FixedWindow && policy.failure == EnvoyFailure::Unavailable);
        assert_eq!(policy.priority_key, "priority");
        assert_eq!(EnvoySettings::default().policy(), EnvoyPolicy::default());
    }
}
