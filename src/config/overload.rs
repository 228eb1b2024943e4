//! `overload.*`: the probabilistic drop layer in front of exact counting
//! (rules that declare an `overload` directive), the tenant table it
//! weighs tenants by, and `denial_cache.*`, the local cache of exact
//! denials.

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::{
    decision::{TenantPolicy, TenantSource},
    rules::OverloadMode,
};

/// `overload.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct OverloadConfig {
    /// The overload layer: `enforce`, `shadow` (count and flip, refuse nothing) or `off`; the
    /// tenant table's `mode` and the cluster-wide switch (`ratelimitd overload`) override it.
    pub mode: OverloadMode,
    /// How often each instance exchanges its counts with the global view and recomputes its drop
    /// ratios (50–60000).
    pub report_interval_ms: u64,
    /// How old the last directive may get (the global view unreachable)
    /// before it decays; it reaches zero after as long again.
    pub max_staleness_ms: u64,
    /// The hot-reloaded tenant table (weights, floors, and an optional
    /// `mode`); unset: every tenant weighs 1.0 with no floor. Its tenants
    /// also get their shares of the store (`grpc.max_store_calls_per_tenant`).
    pub tenants_path: Option<PathBuf>,
    /// How often the tenant table's files are checked for changes.
    pub reload_interval_ms: u64,
    /// `user_id_prefix` or `header`: where a `Check` request's tenant is read.
    pub tenant_from: TenantSource,
    /// With `tenant_from: user_id_prefix`, what ends the tenant in a
    /// `user_id` (`acme:alice` is tenant `acme`); a `user_id` without it
    /// has no tenant.
    pub tenant_separator: String,
    /// With `tenant_from: header`, the request header (gRPC metadata key,
    /// lower case) whose value is the tenant.
    pub tenant_header: String,
    /// The Envoy descriptor entry whose value names a `ShouldRateLimit`
    /// request's tenant (the first such entry of its descriptors).
    pub tenant_descriptor_key: String,
}

impl Default for OverloadConfig {
    fn default() -> Self {
        let tenant = TenantPolicy::default();
        Self {
            mode: OverloadMode::Enforce,
            report_interval_ms: 500,
            max_staleness_ms: 30_000,
            tenants_path: None,
            reload_interval_ms: 1_000,
            tenant_from: tenant.source,
            tenant_separator: tenant.separator,
            tenant_header: tenant.header,
            tenant_descriptor_key: tenant.descriptor_key,
        }
    }
}

impl OverloadConfig {
    /// Where the engine reads a request's tenant from.
    pub fn tenant_policy(&self) -> crate::decision::TenantPolicy {
        crate::decision::TenantPolicy {
            source: self.tenant_from,
            separator: self.tenant_separator.clone(),
            header: self.tenant_header.clone(),
            descriptor_key: self.tenant_descriptor_key.clone(),
        }
    }

    /// Checks `overload.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(50..=60_000).contains(&self.report_interval_ms) {
            return Err(invalid("overload.report_interval_ms", "must be between 50 and 60000"));
        }
        if self.max_staleness_ms < self.report_interval_ms {
            return Err(invalid("overload.max_staleness_ms", "must be at least overload.report_interval_ms"));
        }
        if self.reload_interval_ms == 0 {
            return Err(invalid("overload.reload_interval_ms", "must be at least 1"));
        }
        if self.tenant_from == TenantSource::UserIdPrefix && self.tenant_separator.is_empty() {
            return Err(invalid("overload.tenant_separator", "must not be empty"));
        }
        if self.tenant_from == TenantSource::Header && self.tenant_header.is_empty() {
            return Err(invalid("overload.tenant_header", "must not be empty"));
        }
        if self.tenant_header.chars().any(|c| c.is_ascii_uppercase()) {
            return Err(invalid("overload.tenant_header", "must be lower case (gRPC metadata keys are)"));
        }
        Ok(())
    }
}

/// `denial_cache.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DenialCacheConfig {
    /// Answer repeats of an exact denial locally until its `retry_after`
    /// (Redis store only: the memory store is local already).
    pub enabled: bool,
    /// The most denials held at once; past it new denials are not cached.
    pub max_entries: usize,
}

impl Default for DenialCacheConfig {
    fn default() -> Self {
        Self { enabled: true, max_entries: 100_000 }
    }
}

impl DenialCacheConfig {
    /// Checks `denial_cache.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=10_000_000).contains(&self.max_entries) {
            return Err(invalid("denial_cache.max_entries", "must be between 1 and 10000000"));
        }
        Ok(())
    }
}
