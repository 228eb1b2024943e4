//! `http.*`: the metrics and health listener.

use std::net::SocketAddr;

use serde::Deserialize;

use super::{ConfigError, invalid};

/// `http.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of `/metrics`, `/healthz` and `/readyz` (`http.listen`).
    pub listen: String,
    /// How often the counter store is probed for readiness and gRPC health.
    pub health_interval_ms: u64,
    /// Most connections to the HTTP port open at once; past it new ones
    /// wait in the listen backlog, holding no descriptor. Scrapers and
    /// probes need a few; the bound keeps idle connections from taking the
    /// descriptors gRPC needs.
    pub max_connections: usize,
    /// A connection that sends nothing for this long is closed.
    pub idle_timeout_ms: u64,
    /// A request's head (request line and headers) must be whole this long
    /// after its first byte, or the connection is closed: a request
    /// trickled in byte by byte cannot hold a place.
    pub header_read_timeout_ms: u64,
    /// A connection is closed this long after it opened, whatever it does
    /// (a scraper reconnects: keep-alive still saves the handshakes in
    /// between).
    pub max_connection_age_ms: u64,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:8080".to_owned(),
            health_interval_ms: 1_000,
            max_connections: 64,
            idle_timeout_ms: 10_000,
            header_read_timeout_ms: 5_000,
            max_connection_age_ms: 60_000,
        }
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
        if !(1..=1 << 16).contains(&self.max_connections) {
            return Err(invalid("http.max_connections", "must be between 1 and 65536"));
        }
        for (key, ms) in [
            ("http.idle_timeout_ms", self.idle_timeout_ms),
            ("http.header_read_timeout_ms", self.header_read_timeout_ms),
            ("http.max_connection_age_ms", self.max_connection_age_ms),
        ] {
            if !(100..=3_600_000).contains(&ms) {
                return Err(invalid(key, "must be between 100 and 3600000"));
            }
        }
        Ok(())
    }
}
