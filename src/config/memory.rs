//! `memory.*`: the in-memory counter store (when `redis.url` is unset).

use serde::Deserialize;

use super::{ConfigError, invalid};

/// `memory.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// How often idle (expired) counters are removed, so memory stays bounded.
    pub sweep_interval_ms: u64,
    /// Number of independently locked shards of the counter map.
    pub shards: usize,
    /// The most counters the in-memory store holds (rounded up to a multiple of `memory.shards`);
    /// see **Memory** in [operations](operations.md) for the policy when full.
    pub max_counters: usize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self { sweep_interval_ms: 10_000, shards: 64, max_counters: 1_000_000 }
    }
}

impl MemoryConfig {
    /// Checks `memory.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.sweep_interval_ms == 0 {
            return Err(invalid("memory.sweep_interval_ms", "must be at least 1"));
        }
        if !(1..=4096).contains(&self.shards) {
            return Err(invalid("memory.shards", "must be between 1 and 4096"));
        }
        if !(1..=1 << 32).contains(&self.max_counters) {
            return Err(invalid("memory.max_counters", "must be between 1 and 4294967296"));
        }
        Ok(())
    }
}
