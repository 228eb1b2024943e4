//! `limits.*`: bounds on `Check` request fields.

use serde::Deserialize;

use super::{ConfigError, invalid};

/// `limits.*`: bounds on request fields.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Longest `user_id` counted as it is; a longer one is counted by its SHA-256 digest (never
    /// refused).
    pub max_user_id_bytes: usize,
    /// Longest `resource_path` a dead-letter record keeps (matching sees it whole); longer is cut,
    /// marked `…[truncated]`.
    pub max_resource_path_bytes: usize,
    /// Longest accepted `client_type`, in bytes.
    pub max_client_type_bytes: usize,
    /// Most entries in the `headers` map.
    pub max_headers: usize,
    /// Longest header name plus value, in bytes.
    pub max_header_bytes: usize,
    /// How long a reservation (a `Check` with `reserve`) may be settled, in ms (1 to 86,400,000):
    /// not settled by then, it stays charged at its estimate.
    pub reservation_ttl_ms: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_user_id_bytes: 256,
            max_resource_path_bytes: 2_048,
            max_client_type_bytes: 64,
            max_headers: 64,
            max_header_bytes: 8_192,
            reservation_ttl_ms: crate::decision::reservation::DEFAULT_TTL_MS,
        }
    }
}

impl LimitsConfig {
    /// Checks `limits.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("limits.max_user_id_bytes", self.max_user_id_bytes),
            ("limits.max_resource_path_bytes", self.max_resource_path_bytes),
            ("limits.max_client_type_bytes", self.max_client_type_bytes),
            ("limits.max_header_bytes", self.max_header_bytes),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        let most = crate::decision::reservation::MAX_TTL_MS;
        if !(1..=most).contains(&self.reservation_ttl_ms) {
            return Err(invalid("limits.reservation_ttl_ms", format!("must be between 1 and {most}")));
        }
        Ok(())
    }
}
