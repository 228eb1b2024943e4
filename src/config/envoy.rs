//! `envoy.*` checked and translated: the Envoy API's settings
//! ([`EnvoySettings`], owned by `api::envoy_settings`) validated with
//! errors naming their key, and how they say Envoy rules compile.

use super::{ConfigError, invalid};
use crate::{
    api::envoy_settings::{EnvoyAlgorithm, EnvoySettings},
    rules::envoy::Compile,
};

impl EnvoySettings {
    /// How Envoy rules compile under these settings.
    pub fn compile(&self) -> Compile {
        Compile {
            sliding: self.algorithm == EnvoyAlgorithm::SlidingWindow,
            merge_domains: self.merge_domains,
        }
    }
}

impl EnvoySettings {
    /// Checks `envoy.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, name, may_be_empty) in [
            ("envoy.limit_header", &self.limit_header, false),
            ("envoy.remaining_header", &self.remaining_header, false),
            ("envoy.reset_header", &self.reset_header, false),
            ("envoy.reason_header", &self.reason_header, true),
            ("envoy.error_header", &self.error_header, true),
        ] {
            let valid = name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !valid || (name.is_empty() && !may_be_empty) {
                return Err(invalid(key, format!("{name:?} is not a valid header name")));
            }
        }
        if self.max_descriptors == 0 {
            return Err(invalid("envoy.max_descriptors", "must be at least 1"));
        }
        if self.max_entries == 0 {
            return Err(invalid("envoy.max_entries", "must be at least 1"));
        }
        if self.max_entry_bytes == 0 {
            return Err(invalid("envoy.max_entry_bytes", "must be at least 1"));
        }
        if self.allow_request_limits && self.request_limit_domains.is_empty() {
            return Err(invalid(
                "envoy.request_limit_domains",
                "must name the domains whose requests may supply a limit (envoy.allow_request_limits is on)",
            ));
        }
        if !self.allow_request_limits && !self.request_limit_domains.is_empty() {
            return Err(invalid(
                "envoy.allow_request_limits",
                "must be true for envoy.request_limit_domains to take effect",
            ));
        }
        if !(self.near_limit_ratio > 0.0 && self.near_limit_ratio <= 1.0) {
            return Err(invalid(
                "envoy.near_limit_ratio",
                format!("{} is not in (0, 1]", self.near_limit_ratio),
            ));
        }
        if !(1..=1_000_000).contains(&self.upstream_metrics_max_keys) {
            return Err(invalid("envoy.upstream_metrics_max_keys", "must be between 1 and 1000000"));
        }
        if let Some(domain) = self.domain_failure_mode.keys().find(|d| d.is_empty()) {
            return Err(invalid(
                "envoy.domain_failure_mode",
                format!("{domain:?}: a domain must not be empty"),
            ));
        }
        if let Some(domain) = self.domain_ratelimit_headers.keys().find(|d| d.is_empty()) {
            return Err(invalid(
                "envoy.domain_ratelimit_headers",
                format!("{domain:?}: a domain must not be empty"),
            ));
        }
        if let Some(domain) = self.domain_priority.keys().find(|d| d.is_empty()) {
            return Err(invalid("envoy.domain_priority", format!("{domain:?}: a domain must not be empty")));
        }
        Ok(())
    }
}
