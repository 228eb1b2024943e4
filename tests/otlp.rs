//! With `telemetry.otlp_endpoint` pointed at a test OTLP/gRPC receiver, a
//! decision produces a span that carries the caller's trace id.

mod common;

use std::{
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use common::{Rules, free_port, request};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
    trace_service_server::{TraceService, TraceServiceServer},
};
use ratelimitd::api::pb::rate_limiter_client::RateLimiterClient;

/// Keeps every export it receives.
#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

impl Receiver {
    /// A receiver on a free loopback port: (receiver, port, its serving).
    async fn start() -> (Self, u16, Serving) {
        let receiver = Receiver::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serve = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver.clone()))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                async move {
                    let _ = stopped.await;
                },
            );
        let task = tokio::spawn(async move { serve.await.map_err(|e| e.to_string()) });
        (receiver, port, Serving { stop, task })
    }

    /// An OTLP/HTTP receiver (protobuf bodies posted to `/v1/traces`, as a
    /// collector's port 4318 takes them) on a free loopback port.
    async fn start_http() -> (Self, u16, Serving) {
        use prost::Message as _;
        let receiver = Receiver::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let kept = receiver.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| async move {
                match ExportTraceServiceRequest::decode(body) {
                    Ok(request) => {
                        kept.0.lock().unwrap().push(request);
                        (axum::http::StatusCode::OK, ExportTraceServiceResponse::default().encode_to_vec())
                    }
                    Err(_) => (axum::http::StatusCode::BAD_REQUEST, Vec::new()),
                }
            }),
        );
        let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stopped.await;
        });
        let task = tokio::spawn(async move { serve.await.map_err(|e| e.to_string()) });
        (receiver, port, Serving { stop, task })
    }

    /// The values of the resource attribute `key` in every export.
    fn resource_values(&self, key: &str) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .flat_map(|r| r.resource_spans.iter())
            .flat_map(|r| r.resource.iter().flat_map(|r| r.attributes.iter()))
            .filter(|a| a.key == key)
            .map(|a| format!("{:?}", a.value))
            .collect()
    }
}

/// A receiver's serving task and what stops it.
struct Serving {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

impl Serving {
    /// Stops serving; panics if serving failed.
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// In envoyproxy compat mode, upstream's tracing variables as Envoy
/// Gateway's generated Deployment sets them (`TRACING_ENABLED`,
/// `TRACING_SERVICE_NAME`, `TRACING_SERVICE_NAMESPACE`,
/// `TRACING_SERVICE_INSTANCE_ID`, `TRACING_SAMPLING_RATE`,
/// `OTEL_EXPORTER_OTLP_ENDPOINT` at a collector's OTLP/HTTP port, no
/// protocol: upstream's default is HTTP) and upstream's default
/// `LOG_LEVEL=warn`: a sampled caller's `ShouldRateLimit` exports its span
/// under those resource attributes (the log level does not filter spans),
/// and a request without a caller's trace (a root, sampled at 0) exports
/// none.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_compat_mode_a_sampled_should_rate_limit_exports_its_span() {
    for protocol in [None, Some("http")] {
        exports_the_sampled_span(protocol).await;
    }
}

/// [`in_compat_mode_a_sampled_should_rate_limit_exports_its_span`] with
/// `TRACING_EXPORTER_PROTOCOL` set to `protocol` (unset: upstream's default).
async fn exports_the_sampled_span(protocol: Option<&str>) {
    let extra: Vec<_> = protocol.map(|p| ("TRACING_EXPORTER_PROTOCOL", p.to_owned())).into_iter().collect();
    let (receiver, log) = compat_run("true", &extra).await;
    let spans = spans_of(&receiver);
    let decisions: Vec<_> = spans.iter().filter(|s| s.name == "ratelimit.should_rate_limit").collect();
    let expected: Vec<u8> =
        (0..16).map(|i| u8::from_str_radix(&TRACE_ID[2 * i..2 * i + 2], 16).unwrap()).collect();
    assert!(
        decisions.len() == 1 && decisions[0].trace_id == expected,
        "{protocol:?}: one span, the sampled caller's: {decisions:#?}; the service's log:\n{log}"
    );
    for (key, value) in [
        ("service.name", "envoy-ratelimit"),
        ("service.namespace", "envoy-gateway-system"),
        ("service.instance.id", "envoy-ratelimit-5d8c7b-x2k4p"),
    ] {
        let values = receiver.resource_values(key);
        assert!(!values.is_empty() && values.iter().all(|v| v.contains(value)), "{key}: {values:?}");
    }
}

/// The same with `TRACING_ENABLED=false`: nothing is exported, though
/// `OTEL_EXPORTER_OTLP_ENDPOINT` names the collector and the caller's trace
/// is sampled (upstream reads no OpenTelemetry variable without it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_compat_mode_tracing_disabled_exports_nothing() {
    let (receiver, log) = compat_run("false", &[]).await;
    assert!(receiver.0.lock().unwrap().is_empty(), "an export reached the collector; log:\n{log}");
}

/// The trace of the one sampled call of [`compat_run`].
const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";

/// The binary in envoyproxy compat mode with Envoy Gateway's tracing
/// variables (`TRACING_ENABLED` as given, `extra` added) and an OTLP/HTTP collector at
/// `OTEL_EXPORTER_OTLP_ENDPOINT`: five unsampled `ShouldRateLimit` calls and
/// one with a sampled caller's trace, then SIGTERM (the exporter flushes).
/// The collector and the service's log.
async fn compat_run(tracing_enabled: &str, extra: &[(&str, String)]) -> (Receiver, String) {
    use ratelimitd::api::envoy_pb::rls::rate_limit_service_client::RateLimitServiceClient;
    let (receiver, otlp_port, serving) = Receiver::start_http().await;
    let redis = common::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("data/ratelimit/config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: minute, requests_per_unit: 10 }\n",
    )
    .unwrap();
    let env = [
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
        ("RUNTIME_ROOT", dir.path().join("data").display().to_string()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("TRACING_ENABLED", tracing_enabled.to_owned()),
        ("LOG_LEVEL", "warn".to_owned()),
        ("TRACING_SERVICE_NAME", "envoy-ratelimit".to_owned()),
        ("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system".to_owned()),
        ("TRACING_SERVICE_INSTANCE_ID", "envoy-ratelimit-5d8c7b-x2k4p".to_owned()),
        ("TRACING_SAMPLING_RATE", "0".to_owned()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{otlp_port}")),
    ]
    .into_iter()
    .chain(extra.iter().cloned())
    .collect::<Vec<_>>();
    let log = dir.path().join("serve.log");
    let (child, grpc_port, _) = common::start_compat(dir.path(), &log, &env);
    let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc_port}")).await.unwrap();
    let request = common::rls_request("edge", "user", "ann");
    for _ in 0..5 {
        client.should_rate_limit(request.clone()).await.unwrap();
    }
    let mut call = tonic::Request::new(request);
    call.metadata_mut().insert("traceparent", format!("00-{TRACE_ID}-00f067aa0ba902b7-01").parse().unwrap());
    client.should_rate_limit(call).await.unwrap();
    stop_and_wait(child).await;
    serving.stop().await;
    (receiver, std::fs::read_to_string(&log).unwrap_or_default())
}

/// SIGTERMs `child` (its exporter flushes on the way out) and waits for it.
async fn stop_and_wait(mut child: std::process::Child) {
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every span `receiver` got.
fn spans_of(receiver: &Receiver) -> Vec<opentelemetry_proto::tonic::trace::v1::Span> {
    receiver
        .0
        .lock()
        .unwrap()
        .iter()
        .flat_map(|r| r.resource_spans.iter())
        .flat_map(|r| r.scope_spans.iter())
        .flat_map(|s| s.spans.iter())
        .cloned()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decision_span_carries_the_incoming_trace_id() {
    let (receiver, otlp_port, serving) = Receiver::start().await;

    // The real binary, exporting to it.
    let rules = Rules::new(
        "rules:\n  - { rule_id: traced, resource_path: /traced, limit: 10, window_seconds: 60 }\n",
    );
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .arg("serve")
        .env_remove("RUST_LOG")
        .env("RATELIMITD__GRPC__LISTEN", format!("127.0.0.1:{port}"))
        .env("RATELIMITD__HTTP__LISTEN", format!("127.0.0.1:{}", free_port()))
        .env("RATELIMITD__RULES__PATH", rules.path())
        .env("RATELIMITD__SHED__MODE", "off")
        .env("RATELIMITD__DLQ__FILE", dir.path().join("dlq.jsonl"))
        .env("RATELIMITD__TELEMETRY__OTLP_ENDPOINT", format!("http://127.0.0.1:{otlp_port}"))
        .env("RATELIMITD__LOG__FORMAT", "json")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.path().join("serve.log")).unwrap())
        .spawn()
        .unwrap();

    let endpoint = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut client = loop {
        match RateLimiterClient::connect(endpoint.clone()).await {
            Ok(c) => break c,
            Err(e) if Instant::now() > deadline => panic!("{e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut call = tonic::Request::new(request("alice", "/traced"));
    call.metadata_mut().insert("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01").parse().unwrap());
    assert!(client.check(call).await.unwrap().into_inner().allowed);

    stop_and_wait(child).await;
    let spans = spans_of(&receiver);
    let expected =
        (0..16).map(|i| u8::from_str_radix(&trace_id[2 * i..2 * i + 2], 16).unwrap()).collect::<Vec<_>>();
    let check = spans.iter().find(|s| s.name == "ratelimit.check").unwrap_or_else(|| {
        let log = std::fs::read_to_string(dir.path().join("serve.log")).unwrap_or_default();
        panic!("no decision span in {spans:#?}; the service's log:\n{log}")
    });
    assert_eq!(check.trace_id, expected, "the decision span continues the caller's trace");
    let parent = (0..8)
        .map(|i| u8::from_str_radix(&"00f067aa0ba902b7"[2 * i..2 * i + 2], 16).unwrap())
        .collect::<Vec<_>>();
    assert_eq!(check.parent_span_id, parent);
    let attributes: Vec<String> = check.attributes.iter().map(|a| a.key.clone()).collect();
    for key in ["rule", "reason", "allowed"] {
        assert!(attributes.iter().any(|a| a == key), "{key} not in {attributes:?}");
    }
    let store = spans.iter().find(|s| s.name == "store.decide").expect("a store span");
    assert_eq!((store.trace_id.clone(), store.parent_span_id.clone()), (expected, check.span_id.clone()));

    serving.stop().await;
}
