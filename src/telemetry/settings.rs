//! `log.*` and `telemetry.*`: the log lines, trace export and statsd
//! settings this part owns (validated by `config`, which composes them).

use serde::Deserialize;

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Readable text (coloured on a terminal).
    #[default]
    Human,
    /// One JSON object per line, for log collectors.
    Json,
}

/// `log.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
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
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP/gRPC collector, e.g. `http://otel-collector:4317`; unset = no span export.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of exported spans.
    pub service_name: String,
    /// Share (0 to 1) of the decisions without a caller's trace whose spans are exported; a
    /// caller's trace (`traceparent`) is followed as it says (sampled or not).
    pub sampling_ratio: f64,
    /// `host:port` of a statsd server (a statsd-exporter): envoyproxy/ratelimit's counters are sent
    /// there under its names (`ratelimit.service.rate_limit.<key>.total_hits`, …; see "Upstream
    /// metrics"); a host that does not resolve is tried again at every flush (warned once), never
    /// fatal; unset = none.
    pub statsd_addr: Option<String>,
    /// How often the statsd counters (each one's gain since the last flush) are sent.
    pub statsd_flush_interval_ms: u64,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            otlp_endpoint: None,
            service_name: "ratelimitd".to_owned(),
            sampling_ratio: 1.0,
            statsd_addr: None,
            statsd_flush_interval_ms: 10_000,
        }
    }
}
