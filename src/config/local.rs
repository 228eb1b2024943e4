//! `local.*`: the local limiter that decides when the shared store cannot
//! (failure policy `local`).

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, invalid};

/// `local.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalConfig {
    /// The most counters the local limiter holds, and the most counters
    /// whose locally admitted hits wait to be written back. Past it, a
    /// decision needing a new one is denied (FAIL_CLOSED), never allowed.
    pub max_counters: usize,
    /// Independently locked shards of the local counters.
    pub shards: usize,
    /// How many instances share each limit when none report themselves
    /// (with Redis, every instance reports itself alive each
    /// `reconcile_interval_ms`, and the reported number wins): each
    /// instance admits `ceil(limit x burst / instances)` locally.
    pub instances: u64,
    /// How often locally admitted hits are written back to the shared
    /// store (and the instance reports itself alive).
    pub reconcile_interval_ms: u64,
    /// Where each process keeps, with Redis, the instance count it last read and the hits it
    /// owes the store (`{id}.json`, at most every 5 s and at shutdown), locked by `{id}.lock`
    /// while it lives. A process starting takes over what dead processes of the same store left:
    /// it enforces their count's share from its start, and writes their owed hits back. Several
    /// processes may share it. One set here that cannot be written stops the start; the default
    /// one that cannot be written (a read-only root filesystem, no volume) is done without, with a
    /// warning at start naming this key: a process then starts from `local.instances` and what it
    /// owes the store is not handed on past a crash. Default: `local/` in the state directory.
    pub state_dir: PathBuf,
    /// Whether `state_dir` is the state directory's default (not set): set
    /// by [`Config::load`](super::Config::load).
    #[serde(skip)]
    pub state_dir_is_default: bool,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            max_counters: 100_000,
            shards: 16,
            instances: 1,
            reconcile_interval_ms: 1_000,
            state_dir: PathBuf::from(super::dlq::SYSTEM_STATE_DIR).join("local"),
            state_dir_is_default: false,
        }
    }
}

impl LocalConfig {
    /// The local limiter's settings.
    pub fn settings(&self) -> crate::limiter::local::Settings {
        crate::limiter::local::Settings {
            max_counters: self.max_counters,
            shards: self.shards,
            instances: self.instances,
            reconcile_interval: std::time::Duration::from_millis(self.reconcile_interval_ms),
        }
    }

    /// Checks `local.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=1 << 32).contains(&self.max_counters) {
            return Err(invalid("local.max_counters", "must be between 1 and 4294967296"));
        }
        if !(1..=4096).contains(&self.shards) {
            return Err(invalid("local.shards", "must be between 1 and 4096"));
        }
        if !(1..=100_000).contains(&self.instances) {
            return Err(invalid("local.instances", "must be between 1 and 100000"));
        }
        if !(10..=60_000).contains(&self.reconcile_interval_ms) {
            return Err(invalid("local.reconcile_interval_ms", "must be between 10 and 60000"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_limiters_own() {
        assert_eq!(LocalConfig::default().settings(), crate::limiter::local::Settings::default());
    }
}
