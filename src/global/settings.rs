//! `global.*`: the settings of the global limits (validated in `config/`).

use serde::{Deserialize, Serialize};

use crate::limiter::settings::Connection;

/// `global.*`: the regions sharing the global limits and the coordination
/// store that leases each its grants. Off while `regions` is empty.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct GlobalConfig {
    /// Every region sharing the global limits, with its floor; this
    /// deployment's is named by the top-level `region`.
    pub regions: Vec<RegionConfig>,
    /// The coordination store every region reaches (Redis, Sentinel or
    /// Cluster), its keys those of `redis`: `global.redis.url`, …
    pub redis: Connection,
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
            redis: Connection::default(),
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
