//! `http.*`: the metrics and health listener.

use std::net::SocketAddr;

use serde::Deserialize;

use super::{ConfigError, invalid};

/// `http.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of `/metrics`, `/healthz` and `/readyz` (`http.listen`).
    pub listen: String,
    /// How often the counter store is probed for readiness and gRPC health.
    pub health_interval_ms: u64,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self { listen: "0.0.0.0:8080".to_owned(), health_interval_ms: 1_000 }
    }
}

impl HttpConfig {
    /// Checks `http.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.listen.parse::<SocketAddr>().map_err(|e| {
            invalid("http.listen", format!("{:?} is not an ip:port address: {e}", self.listen))
        })?;
        if self.health_interval_ms < 10 {
            return Err(invalid("http.health_interval_ms", "must be at least 10"));
        }
        Ok(())
    }
}
