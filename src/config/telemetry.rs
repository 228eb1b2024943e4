//! `log.*` and `telemetry.*` checked: the settings ([`LogConfig`],
//! [`TelemetryConfig`], owned by `telemetry::settings`) validated with
//! errors naming their key.

use super::{ConfigError, invalid};
use crate::telemetry::settings::{LogConfig, TelemetryConfig};

impl LogConfig {
    /// Checks `log.*`: the level is a valid filter directive.
    pub fn validate(&self) -> Result<(), ConfigError> {
        tracing_subscriber::EnvFilter::try_new(&self.level)
            .map_err(|e| invalid("log.level", format!("{:?}: {e}", self.level)))?;
        Ok(())
    }
}

impl TelemetryConfig {
    /// Checks `telemetry.*`: the OTLP endpoint is an http(s) URL.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(endpoint) = &self.otlp_endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return Err(invalid(
                "telemetry.otlp_endpoint",
                format!("{endpoint:?} must start with http:// or https://"),
            ));
        }
        if let Some(addr) = &self.statsd_addr
            && addr
                .rsplit_once(':')
                .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
        {
            return Err(invalid("telemetry.statsd_addr", format!("{addr:?} is not host:port")));
        }
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            return Err(invalid(
                "telemetry.sampling_ratio",
                format!("{}: must be between 0 and 1", self.sampling_ratio),
            ));
        }
        if !(100..=3_600_000).contains(&self.statsd_flush_interval_ms) {
            return Err(invalid("telemetry.statsd_flush_interval_ms", "must be between 100 and 3600000"));
        }
        Ok(())
    }
}
