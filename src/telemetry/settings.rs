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

/// The OTLP transport spans are exported over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
pub enum OtlpProtocol {
    /// OTLP/gRPC (a collector's port 4317).
    #[default]
    #[serde(rename = "grpc")]
    Grpc,
    /// OTLP/HTTP with protobuf bodies (a collector's port 4318), posted to `/v1/traces`.
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
}

/// `telemetry.*`
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The collector's URL, e.g. `http://otel-collector:4317` (gRPC) or `http://otel-collector:4318`
    /// (`http/protobuf`: spans are posted to its path with `/v1/traces` appended, unless the path
    /// already ends with it); plain `http://` only; unset = no span export.
    pub otlp_endpoint: Option<String>,
    /// `grpc` or `http/protobuf`.
    pub otlp_protocol: OtlpProtocol,
    /// `service.name` of exported spans.
    pub service_name: String,
    /// `service.namespace` of exported spans; unset = none.
    pub service_namespace: Option<String>,
    /// `service.instance.id` of exported spans; unset = a random UUID chosen at start.
    pub service_instance_id: Option<String>,
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
            otlp_protocol: OtlpProtocol::Grpc,
            service_name: "ratelimitd".to_owned(),
            service_namespace: None,
            service_instance_id: None,
            sampling_ratio: 1.0,
            statsd_addr: None,
            statsd_flush_interval_ms: 10_000,
        }
    }
}
