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
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self { otlp_endpoint: None, service_name: "ratelimitd".to_owned() }
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
        Ok(())
    }
}
