//! `log.*` and `telemetry.*`: log lines and trace export.

use serde::Deserialize;

use super::{ConfigError, invalid};

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Readable text (coloured on a terminal).
    #[default]
    Human,
    /// One JSON object per line, for log collectors.
    Json,
}

/// `log.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// A `tracing` filter directive such as `info` or `ratelimitd=debug,info`.
    /// `RUST_LOG`, when set, wins.
    pub level: String,
    /// `human` or `json`.
    pub format: LogFormat,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { level: "info".to_owned(), format: LogFormat::Human }
    }
}

/// `telemetry.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP/gRPC collector, e.g. `http://otel-collector:4317`; unset = no span export.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of exported spans.
    pub service_name: String,
    /// `host:port` of a statsd server (a statsd-exporter) to send
    /// envoyproxy/ratelimit's counters to, under its names; unset = none.
    pub statsd_addr: Option<String>,
    /// How often the statsd counters are sent.
    pub statsd_flush_interval_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: "ratelimitd".to_owned(),
            statsd_addr: None,
            statsd_flush_interval_ms: 10_000,
        }
    }
}

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
        if !(100..=3_600_000).contains(&self.statsd_flush_interval_ms) {
            return Err(invalid("telemetry.statsd_flush_interval_ms", "must be between 100 and 3600000"));
        }
        Ok(())
    }
}
