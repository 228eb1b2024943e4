//! `rules.*`: where native and Envoy rules come from, and how often they
//! are checked for changes.

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, invalid};

/// `rules.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RulesConfig {
    /// A native rule YAML file, or a directory whose `*.yaml`/`*.yml` files
    /// together form the rule set. Unset: the example rules compiled into
    /// the binary (`examples/rules`), unless `envoy_path` is set, in which
    /// case there are no native rules (`Check` answers NO_RULE).
    pub path: Option<PathBuf>,
    /// How often `path` is checked for changes (metadata only; a file is read
    /// again only when its identity, size or mtime changed). 0 disables reload.
    pub reload_interval_ms: u64,
    /// envoyproxy/ratelimit-format YAML: a file, or a directory with one
    /// domain per file. Unset: `ShouldRateLimit` is not served.
    pub envoy_path: Option<PathBuf>,
}

impl Default for RulesConfig {
    fn default() -> Self {
        Self { path: None, reload_interval_ms: 1_000, envoy_path: None }
    }
}

impl RulesConfig {
    /// Checks `rules.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid("rules.path", "must not be empty; leave it unset for the embedded rules"));
        }
        if self.envoy_path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid(
                "rules.envoy_path",
                "must not be empty; leave it unset to not serve ShouldRateLimit",
            ));
        }
        Ok(())
    }
}
