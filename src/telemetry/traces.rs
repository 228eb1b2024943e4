//! Logs and traces: a `tracing` subscriber with human (default) or JSON
//! logs written to stderr by a dedicated thread (a worker only hands a
//! line to a bounded buffer; when the buffer is full the line is dropped
//! and counted, never waited for), and — when `telemetry.otlp_endpoint` is set — an OpenTelemetry
//! layer exporting spans over OTLP (gRPC, or HTTP with protobuf bodies). Incoming W3C trace context
//! (`traceparent` in gRPC metadata) becomes the parent of each decision span.
//!
//! Spans exist for the exporter alone: the log layer takes events only, so
//! without `telemetry.otlp_endpoint` no layer wants a span and every
//! request and store span is a disabled callsite (one atomic load), not a
//! registry entry with its fields formatted (about 3,000 instructions of a
//! decision at `info`, counted with callgrind).

use opentelemetry::{KeyValue, propagation::Extractor, trace::TracerProvider as _};
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::{
    Resource,
    propagation::TraceContextPropagator,
    trace::{Sampler, SdkTracerProvider},
};
use tracing::Level;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::{
    Layer, Registry,
    filter::{FilterExt as _, LevelFilter, filter_fn},
    fmt::MakeWriter,
    layer::SubscriberExt as _,
    util::SubscriberInitExt as _,
};

use super::settings::{LogConfig, LogFormat, OtlpProtocol, TelemetryConfig};

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
    // Colours only for a terminal: log files and collectors get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let (writer, log_writer) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(LOG_BUFFER_LINES)
        .thread_name("ratelimitd-log")
        .finish(std::io::stderr());
    let _ = LOG_LINES_DROPPED.set(writer.error_counter());
    let (layers, provider) = layers(log, telemetry, writer, ansi)?;
    tracing_subscriber::registry().with(layers).init();
    Ok(TracingGuard { provider, _log_writer: log_writer })
}

/// One layer of the subscriber.
type BoxedLayer = Box<dyn Layer<Registry> + Send + Sync>;

/// A subscriber's layers: the log layer writing to `writer`, and the span
/// exporter when `telemetry.otlp_endpoint` is set (with its provider).
fn layers<W>(
    log: &LogConfig,
    telemetry: &TelemetryConfig,
    writer: W,
    ansi: bool,
) -> Result<(Vec<BoxedLayer>, Option<SdkTracerProvider>), TelemetryError>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    // One filter per layer (a filter is stateful), from the same spec.
    let filter = || {
        tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&log.level))
    };
    // The log layer takes events only. Its hint keeps the log level's:
    // without one the combined hint is "any level", and every `trace!` in
    // h2 and hyper would be asked about at run time (3× the instructions of
    // a unary decision).
    let events =
        || filter().and(filter_fn(|metadata| metadata.is_event()).with_max_level_hint(LevelFilter::TRACE));
    let mut layers: Vec<BoxedLayer> = vec![match log.format {
        LogFormat::Human => {
            tracing_subscriber::fmt::layer().with_writer(writer).with_ansi(ansi).with_filter(events()).boxed()
        }
        LogFormat::Json => {
            tracing_subscriber::fmt::layer().json().with_writer(writer).with_filter(events()).boxed()
        }
    }];
    // No layer for a missing exporter: even an empty `Option` layer would
    // make every span callsite wanted.
    let Some(endpoint) = &telemetry.otlp_endpoint else {
        return Ok((layers, None));
    };
    let exporter = exporter(endpoint, telemetry.otlp_protocol)?;
    // A caller's decision is followed; a root is sampled at the ratio.
    let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(telemetry.sampling_ratio)));
    let provider = SdkTracerProvider::builder()
        .with_sampler(sampler)
        .with_batch_exporter(exporter)
        .with_resource(resource(telemetry))
        .build();
    let tracer = provider.tracer("ratelimitd");
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    // The exporter takes this service's spans whatever the log level: a
    // `warn` log (envoyproxy/ratelimit's default `LOG_LEVEL`) must not
    // leave a sampled caller's trace without its decision.
    let spans = filter_fn(|metadata| {
        metadata.is_span() && metadata.target().starts_with("ratelimitd") && *metadata.level() <= Level::INFO
    })
    .with_max_level_hint(LevelFilter::INFO);
    layers.push(tracing_opentelemetry::layer().with_tracer(tracer).with_filter(spans).boxed());
    Ok((layers, Some(provider)))
}

/// The span exporter to `endpoint` over `protocol`.
fn exporter(
    endpoint: &str,
    protocol: OtlpProtocol,
) -> Result<opentelemetry_otlp::SpanExporter, TelemetryError> {
    match protocol {
        OtlpProtocol::Grpc => {
            opentelemetry_otlp::SpanExporter::builder().with_tonic().with_endpoint(endpoint).build()
        }
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(OnRuntime::current())
            .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
            .with_endpoint(traces_url(endpoint))
            .build(),
    }
    .map_err(|e| TelemetryError(e.to_string()))
}

/// How long one OTLP/HTTP export may take (the OpenTelemetry default).
const HTTP_EXPORT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The OTLP/HTTP exporter's client: hyper's, each request run on the
/// service's runtime. The batch exporter sends from a thread of its own,
/// outside any runtime, where hyper's connector cannot run.
#[derive(Debug)]
struct OnRuntime {
    client: std::sync::Arc<
        opentelemetry_http::hyper::HyperClient<hyper_util::client::legacy::connect::HttpConnector>,
    >,
    runtime: tokio::runtime::Handle,
}

impl OnRuntime {
    /// A client on the runtime this is called in (`init` runs inside it).
    fn current() -> Self {
        Self {
            client: std::sync::Arc::new(opentelemetry_http::hyper::HyperClient::with_default_connector(
                HTTP_EXPORT_TIMEOUT,
                None,
            )),
            runtime: tokio::runtime::Handle::current(),
        }
    }
}

#[tonic::async_trait]
impl opentelemetry_http::HttpClient for OnRuntime {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<opentelemetry_http::Bytes>,
    ) -> Result<opentelemetry_http::Response<opentelemetry_http::Bytes>, opentelemetry_http::HttpError> {
        let client = std::sync::Arc::clone(&self.client);
        self.runtime.spawn(async move { client.send_bytes(request).await }).await?
    }
}

/// The URL an OTLP/HTTP exporter posts spans to: `endpoint` with
/// `/v1/traces` appended to its path, unless the path already ends with it
/// (a per-signal URL such as `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`'s).
fn traces_url(endpoint: &str) -> String {
    let (base, query) = endpoint.split_once('?').map_or((endpoint, None), |(b, q)| (b, Some(q)));
    let base = base.trim_end_matches('/');
    let url = if base.ends_with("/v1/traces") { base.to_owned() } else { format!("{base}/v1/traces") };
    match query {
        Some(query) => format!("{url}?{query}"),
        None => url,
    }
}

/// The exported spans' resource: `service.name`, `service.namespace` when
/// set, and `service.instance.id` (a random UUID when not set, as the
/// OpenTelemetry conventions recommend, so two instances' spans differ).
fn resource(telemetry: &TelemetryConfig) -> Resource {
    let instance = telemetry.service_instance_id.clone().unwrap_or_else(random_uuid);
    let mut attributes = vec![KeyValue::new("service.instance.id", instance)];
    if let Some(namespace) = &telemetry.service_namespace {
        attributes.push(KeyValue::new("service.namespace", namespace.clone()));
    }
    Resource::builder().with_service_name(telemetry.service_name.clone()).with_attributes(attributes).build()
}

/// A version 4 UUID from the operating system's random source (all zero
/// when it cannot answer: the attribute names an instance, nothing more).
fn random_uuid() -> String {
    let mut b = [0u8; 16];
    let _ = getrandom::fill(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..])
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
    use std::sync::{Arc, Mutex};

    /// A log writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Lines(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'w> MakeWriter<'w> for Lines {
        type Writer = Lines;
        fn make_writer(&'w self) -> Lines {
            self.clone()
        }
    }

    /// Without an exporter a request makes no span at all (the log layer
    /// wants events only), while events at the level are still written.
    #[test]
    fn otlp_http_posts_to_v1_traces_under_the_endpoint() {
        assert_eq!(traces_url("http://collector:4318"), "http://collector:4318/v1/traces");
        assert_eq!(traces_url("http://collector:4318/"), "http://collector:4318/v1/traces");
        assert_eq!(traces_url("http://gw/otlp"), "http://gw/otlp/v1/traces");
        assert_eq!(traces_url("http://collector:4318/v1/traces"), "http://collector:4318/v1/traces");
        assert_eq!(traces_url("http://gw/otlp?tenant=a"), "http://gw/otlp/v1/traces?tenant=a");
        let id = random_uuid();
        assert!(id.len() == 36 && id.as_bytes()[14] == b'4' && id != random_uuid(), "{id}");
    }

    #[test]
    fn without_an_exporter_no_span_is_made_and_events_are_logged() {
        let lines = Lines::default();
        let log = LogConfig { level: "info".to_owned(), format: LogFormat::Human };
        let (layers, provider) = layers(&log, &TelemetryConfig::default(), lines.clone(), false).unwrap();
        assert!(provider.is_none());
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layers), || {
            let span = tracing::info_span!("ratelimit.check", otel.kind = "server");
            assert!(span.is_disabled(), "a span was made");
            let _in = span.enter();
            tracing::info!(rule = "r", "an event at the level");
            tracing::debug!("an event under it");
        });
        let written = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        assert!(written.contains("an event at the level rule=\"r\""), "{written}");
        assert!(!written.contains("under it"), "{written}");
        assert!(!written.contains("ratelimit.check"), "{written}");
    }

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
