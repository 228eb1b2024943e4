//! `global.*`: the settings of the global limits (validated in `config/`).

use std::{fmt, path::PathBuf};

use serde::{Deserialize, Serialize};

use crate::limiter::settings::{RedisConfig, redact_url};

/// `global.*`: the regions sharing the global limits and the coordination
/// store that leases each its grants. Off while `regions` is empty.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlobalConfig {
    /// Every region sharing the global limits, with its floor; this
    /// deployment's is named by the top-level `region`.
    pub regions: Vec<RegionConfig>,
    /// The coordination store every region reaches (Redis, Sentinel or
    /// Cluster; TLS and auth as for `redis`).
    pub redis: CoordinationConfig,
    /// How often a region reports and receives its grants (ms).
    pub interval_ms: u64,
    /// How long a grant holds without a new report (ms): more than two
    /// intervals, a report's timeout and the skew margin.
    pub lease_ms: u64,
    /// How long past its end the coordination store still counts a
    /// region's lease as held (ms): the clocks' drift over a lease.
    pub skew_ms: u64,
    /// How long one report to the coordination store may take (ms).
    pub timeout_ms: u64,
    /// Keys per global limit a region tracks and reports at most; the rest
    /// are enforced at the region's floor.
    pub max_keys: usize,
}

impl Default for GlobalConfig {
    fn default() -> Self {
        GlobalConfig {
            regions: Vec::new(),
            redis: CoordinationConfig::default(),
            interval_ms: 1_000,
            lease_ms: 5_000,
            skew_ms: 500,
            timeout_ms: 1_000,
            max_keys: 10_000,
        }
    }
}

/// One region of `global.regions`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RegionConfig {
    /// The region's name, as its deployments' `region` names it.
    pub name: String,
    /// Its floor: the share of each global limit it enforces with no grant
    /// (between 0 and 1; the floors of all regions sum to at most 1).
    pub floor: f64,
}

impl GlobalConfig {
    /// Whether global limits are shared with other regions.
    pub fn enabled(&self) -> bool {
        !self.regions.is_empty()
    }

    /// Each region's floor in parts per million, rounded down.
    pub fn floors_ppm(&self) -> Vec<u64> {
        self.regions.iter().map(|r| (r.floor * crate::limiter::grants::PPM as f64).floor() as u64).collect()
    }

    /// The index of region `name`.
    pub fn index(&self, name: &str) -> Option<usize> {
        self.regions.iter().position(|r| r.name == name)
    }
}

/// `global.redis.*`: the coordination store, reached as `redis` is.
#[derive(Clone, Default, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinationConfig {
    /// The coordination store's URL (`redis://`, `rediss://`); with
    /// `global.redis.cluster` its seed nodes, with
    /// `global.redis.sentinel_master` its sentinels, comma-separated.
    pub url: Option<String>,
    /// `global.redis.url` names Redis Cluster seed nodes: each global
    /// limit's state is kept in one hash slot.
    pub cluster: bool,
    /// The coordination store's master name in Redis Sentinel.
    pub sentinel_master: Option<String>,
    /// AUTH password of the coordination store's sentinels. Never logged.
    // Secrets are never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub sentinel_password: Option<String>,
    /// The coordination store's AUTH password (best set through
    /// `RATELIMITD__GLOBAL__REDIS__PASSWORD`). Never logged.
    // Secrets are never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub password: Option<String>,
    /// The ACL user of the coordination store's password.
    pub username: Option<String>,
    /// A file holding the coordination store's AUTH password.
    pub password_file: Option<PathBuf>,
    /// With `rediss://`: the PEM CA certificate(s) the coordination
    /// store's certificate is checked against.
    pub tls_ca_file: Option<PathBuf>,
    /// With `rediss://`: the PEM client certificate this region presents
    /// to the coordination store (with `global.redis.tls_key_file`).
    pub tls_cert_file: Option<PathBuf>,
    /// With `rediss://`: the key of that client certificate.
    pub tls_key_file: Option<PathBuf>,
    /// Put before every key of the coordination store: the same in every
    /// region (they share its keys).
    pub key_prefix: String,
}

impl CoordinationConfig {
    /// The store's settings as the Redis store takes them: reports are off
    /// the request path, so one connection and a report's own deadline
    /// (`timeout_ms`, also for connecting); no breaker.
    pub fn store(&self, timeout_ms: u64) -> RedisConfig {
        RedisConfig {
            url: self.url.clone(),
            cluster: self.cluster,
            sentinel_master: self.sentinel_master.clone(),
            sentinel_password: self.sentinel_password.clone(),
            password: self.password.clone(),
            username: self.username.clone(),
            password_file: self.password_file.clone(),
            tls_ca_file: self.tls_ca_file.clone(),
            tls_cert_file: self.tls_cert_file.clone(),
            tls_key_file: self.tls_key_file.clone(),
            timeout_ms,
            connect_timeout_ms: timeout_ms,
            connections: 1,
            breaker_failures: 0,
            key_prefix: self.key_prefix.clone(),
            ..RedisConfig::default()
        }
    }
}

impl fmt::Debug for CoordinationConfig {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CoordinationConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("cluster", &self.cluster)
            .field("sentinel_master", &self.sentinel_master)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("password_file", &self.password_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}
