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
    /// Not ready while the counter store is unreachable and some answer
    /// would deny by policy (a rule failing closed, `ShouldRateLimit`
    /// answering UNAVAILABLE). The store is shared by every instance, so
    /// this takes the whole fleet out of its endpoints at once, and a
    /// gateway that fails open then allows everything: leave it off unless
    /// the clients have somewhere else to go. Off: an outage keeps the
    /// instance ready, its decisions follow each rule's failure policy,
    /// flagged, and the body says so.
    pub unready_without_store: bool,
    /// Most connections to the HTTP port open at once; past it a new one
    /// takes the place of the connection that received nothing for
    /// longest, which is closed (keep-alive pollers from many addresses
    /// cannot keep a probe out). Scrapers and probes need a few; the bound
    /// keeps idle connections from taking the descriptors gRPC needs.
    pub max_connections: usize,
    /// Of those, most one peer (an IPv4 address, an IPv6 /64) holds; a connection past it is
    /// closed as soon as it is accepted. A flood of unfinished request heads from one address
    /// then holds this many places, not the probes' and scrapers'.
    pub max_connections_per_peer: usize,
    /// Also serve the probes alone (`/healthz`, `/readyz`, `/healthcheck`) on this address, with
    /// places of their own (`http.max_connections`, `http.max_connections_per_peer` each): a flood
    /// of the HTTP port cannot starve them. Point the kubelet's probes here, and let a
    /// NetworkPolicy admit nothing else to it (the kubelet's probes are not subject to it). Unset:
    /// probes share the HTTP port.
    pub probe_listen: Option<String>,
    /// Also serve `/metrics` (and the probes) on this address, with places of its own as
    /// `probe_listen` has: for a scraper configured for a port of its own (envoyproxy/ratelimit's
    /// `PROMETHEUS_ADDR`, which Envoy Gateway's Deployment sets to `:19001`). Unset: `/metrics` is
    /// on the HTTP port only.
    pub metrics_listen: Option<String>,
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
            unready_without_store: false,
            max_connections: 64,
            max_connections_per_peer: 8,
            probe_listen: None,
            metrics_listen: None,
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
        if !(1..=self.max_connections).contains(&self.max_connections_per_peer) {
            return Err(invalid(
                "http.max_connections_per_peer",
                format!("must be between 1 and http.max_connections ({})", self.max_connections),
            ));
        }
        let http_port = self.listen.parse::<SocketAddr>().ok().map(|http| http.port());
        let mut ports = Vec::new();
        for (key, listen) in
            [("http.probe_listen", &self.probe_listen), ("http.metrics_listen", &self.metrics_listen)]
        {
            let Some(listen) = listen else { continue };
            let addr = listen
                .parse::<SocketAddr>()
                .map_err(|e| invalid(key, format!("{listen:?} is not an ip:port address: {e}")))?;
            if addr.port() != 0 && http_port == Some(addr.port()) {
                return Err(invalid(key, "must not be the port of http.listen"));
            }
            if addr.port() != 0 && ports.contains(&addr.port()) {
                return Err(invalid(key, "must not be the port of http.probe_listen"));
            }
            ports.push(addr.port());
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
