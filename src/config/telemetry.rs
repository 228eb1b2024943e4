//! `log.*` and `telemetry.*` checked: the settings ([`LogConfig`],
//! [`TelemetryConfig`], owned by `telemetry::settings`) validated with
//! errors naming their key.

use super::{ConfigError, invalid};
use crate::telemetry::settings::{LogConfig, OtlpProtocol, TelemetryConfig};

impl LogConfig {
    /// Checks `log.*`: the level is a valid filter directive.
    pub fn validate(&self) -> Result<(), ConfigError> {
        tracing_subscriber::EnvFilter::try_new(&self.level)
            .map_err(|e| invalid("log.level", format!("{:?}: {e}", self.level)))?;
        Ok(())
    }
}

impl TelemetryConfig {
    /// Checks `telemetry.*`: the OTLP endpoint is an http(s) URL (plain
    /// http for `http/protobuf`, whose client has no TLS).
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(endpoint) = &self.otlp_endpoint {
            let http = endpoint.starts_with("http://");
            if self.otlp_protocol == OtlpProtocol::HttpProtobuf && !http {
                return Err(invalid(
                    "telemetry.otlp_endpoint",
                    format!("{endpoint:?} must start with http:// (OTLP/HTTP is exported without TLS)"),
                ));
            }
            if !(http || endpoint.starts_with("https://")) {
                return Err(invalid(
                    "telemetry.otlp_endpoint",
                    format!("{endpoint:?} must start with http:// or https://"),
                ));
            }
            endpoint
                .parse::<axum::http::Uri>()
                .map_err(|e| invalid("telemetry.otlp_endpoint", format!("{endpoint:?}: {e}")))?;
        }
        for (key, value) in [
            ("telemetry.service_name", Some(&self.service_name)),
            ("telemetry.service_namespace", self.service_namespace.as_ref()),
            ("telemetry.service_instance_id", self.service_instance_id.as_ref()),
        ] {
            if value.is_some_and(|v| v.trim().is_empty() || v.len() > 255) {
                return Err(invalid(key, "must be 1 to 255 characters"));
            }
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
