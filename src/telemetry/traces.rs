//! Logs and traces: a `tracing` subscriber with human (default) or JSON
//! logs written to stderr by a dedicated thread (a worker only hands a
//! line to a bounded buffer; when the buffer is full the line is dropped
//! and counted, never waited for), and — when `telemetry.otlp_endpoint` is set — an OpenTelemetry
//! layer exporting spans over OTLP/gRPC. Incoming W3C trace context
//! (`traceparent` in gRPC metadata) becomes the parent of each decision span.
//!
//! Spans exist for the exporter alone: the log layer takes events only, so
//! without `telemetry.otlp_endpoint` no layer wants a span and every
//! request and store span is a disabled callsite (one atomic load), not a
//! registry entry with its fields formatted (about 3,000 instructions of a
//! decision at `info`, counted with callgrind).

use opentelemetry::{propagation::Extractor, trace::TracerProvider as _};
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::{Resource, propagation::TraceContextPropagator, trace::SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::{
    Layer, Registry,
    filter::{FilterExt as _, LevelFilter, filter_fn},
    layer::SubscriberExt as _,
    util::SubscriberInitExt as _,
};

use crate::config::{LogConfig, LogFormat, TelemetryConfig};

/// Log lines the writer thread may have waiting; past it lines are dropped.
const LOG_BUFFER_LINES: usize = 65_536;

/// The log writer's count of lines dropped because its buffer was full.
static LOG_LINES_DROPPED: std::sync::OnceLock<tracing_appender::non_blocking::ErrorCounter> =
    std::sync::OnceLock::new();

/// Log lines dropped because stderr could not keep up (0 before [`init`]).
pub fn log_lines_dropped() -> u64 {
    LOG_LINES_DROPPED.get().map_or(0, |c| c.dropped_lines() as u64)
}

/// Flushes and stops the span exporter, then the log writer, when dropped
/// (after the server has stopped).
#[derive(Debug)]
pub struct TracingGuard {
    provider: Option<SdkTracerProvider>,
    _log_writer: tracing_appender::non_blocking::WorkerGuard,
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(e) = provider.shutdown()
        {
            tracing::warn!(error = %e, "could not flush spans to the OTLP collector");
        }
    }
}

/// Why telemetry could not start.
#[derive(Debug, thiserror::Error)]
#[error("telemetry.otlp_endpoint: {0}")]
pub struct TelemetryError(String);

/// Installs the global subscriber. `RUST_LOG`, when set, wins over `log.level`.
/// Must run inside a tokio runtime when OTLP is configured (batch export).
pub fn init(log: &LogConfig, telemetry: &TelemetryConfig) -> Result<TracingGuard, TelemetryError> {
    // One filter per layer (a filter is stateful), from the same spec.
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&log.level))
    };
    // Colours only for a terminal: log files and collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (writer, log_writer) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_BUFFER_LINES)
        .thread_name("ratelimitd-log")
        .finish(std::io::stderr());
    let _ = LOG_LINES_DROPPED.set(writer.error_counter());
    // The log layer takes events only. Its hint keeps the log level's:
    // without one the combined hint is "any level", and every `trace!` in
    // h2 and hyper would be asked about at run time (3× the instructions of
    // a unary decision).
    let events =
        || filter().and(filter_fn(|metadata| metadata.is_event()).with_max_level_hint(LevelFilter::TRACE));
    let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = vec![match log.format {
        LogFormat::Human => {
            tracing_subscriber::fmt::layer().with_writer(writer).with_ansi(ansi).with_filter(events()).boxed()
        }
        LogFormat::Json => {
            tracing_subscriber::fmt::layer().json().with_writer(writer).with_filter(events()).boxed()
        }
    }];
    // No layer for a missing exporter: even an empty `Option` layer would
    // make every span callsite wanted.
    let provider = match &telemetry.otlp_endpoint {
        None => None,
        Some(endpoint) => {
            let exporter = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(endpoint)
                .build()
                .map_err(|e| TelemetryError(e.to_string()))?;
            let provider = SdkTracerProvider::builder()
                .with_batch_exporter(exporter)
                .with_resource(Resource::builder().with_service_name(telemetry.service_name.clone()).build())
                .build();
            let tracer = provider.tracer("ratelimitd");
            opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
            layers.push(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(filter()).boxed());
            Some(provider)
        }
    };
    tracing_subscriber::registry().with(layers).init();
    Ok(TracingGuard { provider, _log_writer: log_writer })
}

/// Reads W3C trace headers from gRPC metadata.
struct MetadataExtractor<'a>(&'a tonic::metadata::MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// Makes the caller's trace (from `traceparent` in `metadata`) the parent of `span`.
pub fn continue_trace(span: &tracing::Span, metadata: &tonic::metadata::MetadataMap) {
    if metadata.get("traceparent").is_none() {
        return;
    }
    let context = opentelemetry::global::get_text_map_propagator(|p| p.extract(&MetadataExtractor(metadata)));
    // Fails only when no OpenTelemetry layer is installed: nothing to link then.
    let _ = span.set_parent(context);
}

/// The trace id (32 hex digits) of a W3C `traceparent`
/// (`version-traceid-parentid-flags`), if well formed and not all zero.
pub fn trace_id_of(traceparent: &str) -> Option<&str> {
    let mut parts = traceparent.trim().split('-');
    let (_version, trace_id) = (parts.next()?, parts.next()?);
    let valid = trace_id.len() == 32
        && trace_id.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
        && trace_id.bytes().any(|b| b != b'0');
    valid.then_some(trace_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_id_from_traceparent() {
        assert_eq!(
            trace_id_of("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(trace_id_of("00-00000000000000000000000000000000-00f067aa0ba902b7-01"), None);
        assert_eq!(trace_id_of("garbage"), None);
        assert_eq!(trace_id_of("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"), None);
    }
}
