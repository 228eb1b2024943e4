//! Envoy Gateway's image swap, end to end: the binary started as Envoy
//! Gateway v1.9.0's generated rate limit Deployment starts it (the
//! command `/bin/ratelimit`, no argument, the Deployment's environment),
//! its rules served over mutual TLS by an aggregated discovery server as
//! Envoy Gateway's control plane serves them (`RateLimitConfig`s built as
//! its translator builds them), and a real Envoy configured as the
//! translator configures the gateway's listener (per-route
//! `RateLimitPerRoute` actions, `DRAFT_VERSION_03` headers, the rate
//! limit cluster over TLS).
//!
//! What the test changes from the Deployment: file paths (`/certs/…` are
//! in a temporary directory), the control plane's address
//! (`envoy-gateway:18001` is `localhost` on a free port) and the listeners'
//! addresses (`PORT`, `GRPC_PORT`, `PROMETHEUS_ADDR`: free loopback ports,
//! where the Deployment has 8080, 8081 and `:19001`).

mod common;

use std::time::{Duration, Instant};

use common::{
    Process, http_get_text, management_server_with, python_upstream, start_as_upstream, start_envoy,
};
use prost::Message as _;
use ratelimitd::api::{
    envoy_pb::rls_config::{RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit},
    xds::TYPE_URL,
};

/// The gateway's listener, `namespace/gateway/listener`: the domain.
const DOMAIN: &str = "default/eg/http";
/// Two HTTPRoute rules' IR route names, each a route descriptor.
const ROUTE_USERS: &str = "httproute/default/backend/rule/0/match/0/*";
const ROUTE_FREE: &str = "httproute/default/backend/rule/1/match/0/*";

/// A descriptor `key` (= `value` when given), nested `inner`, limited by `limit`.
fn descriptor(
    key: &str,
    value: Option<&str>,
    limit: Option<(u32, RateLimitUnit)>,
    shadow: bool,
    inner: Vec<RateLimitDescriptor>,
) -> RateLimitDescriptor {
    RateLimitDescriptor {
        key: key.to_owned(),
        value: value.unwrap_or_default().to_owned(),
        rate_limit: limit.map(|(requests_per_unit, unit)| RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit,
            ..Default::default()
        }),
        shadow_mode: shadow,
        descriptors: inner,
        ..Default::default()
    }
}

/// The `RateLimitConfig` Envoy Gateway's translator builds for the
/// listener's two routes: a route descriptor each (key and value the route
/// name), its rules nested below as `rule-N-match-M` chains, the limit on
/// the last of each chain.
/// - users route, rule 0: a distinct `x-user-id` header match (key only),
///   3 per hour per user; rule 1: no match (`rule-1-match--1`), 5 per
///   year for the whole route.
/// - free route, rule 0: a `x-plan: free` header value match, 1 per second,
///   in shadow mode.
fn gateway_config() -> prost_types::Any {
    use RateLimitUnit::{Hour, Second, Year};
    let config = RateLimitConfig {
        name: DOMAIN.to_owned(),
        domain: DOMAIN.to_owned(),
        descriptors: vec![
            descriptor(
                ROUTE_USERS,
                Some(ROUTE_USERS),
                None,
                false,
                vec![
                    descriptor("rule-0-match-0", None, Some((3, Hour)), false, vec![]),
                    descriptor("rule-1-match--1", Some("rule-1-match--1"), Some((5, Year)), false, vec![]),
                ],
            ),
            descriptor(
                ROUTE_FREE,
                Some(ROUTE_FREE),
                None,
                false,
                vec![descriptor("rule-0-match-0", Some("rule-0-match-0"), Some((1, Second)), true, vec![])],
            ),
        ],
    };
    prost_types::Any { type_url: TYPE_URL.to_owned(), value: config.encode_to_vec() }
}

/// The gateway's Envoy: the listener's routes with the translator's
/// per-route actions, the rate limit filter on the listener's domain, the
/// rate limit cluster over TLS (verifying the service against the
/// gateway's CA, presenting `envoy.pem`).
fn envoy_config(listen: u16, admin: u16, ratelimit: u16, backend: u16, certs: &std::path::Path) -> String {
    let cert = |name: &str| certs.join(name).display().to_string();
    let (ca, envoy_cert, envoy_key) = (cert("ca.pem"), cert("envoy.pem"), cert("envoy.key"));
    format!(
        r#"
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  clusters:
    - name: ratelimit_cluster
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {{ http2_protocol_options: {{}} }}
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
          sni: localhost
          common_tls_context:
            tls_certificates:
              - certificate_chain: {{ filename: {envoy_cert} }}
                private_key: {{ filename: {envoy_key} }}
            validation_context:
              trusted_ca: {{ filename: {ca} }}
              match_typed_subject_alt_names:
                - san_type: DNS
                  matcher: {{ exact: localhost }}
      load_assignment:
        cluster_name: ratelimit_cluster
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {ratelimit} }} }} }}
    - name: backend
      type: STATIC
      connect_timeout: 1s
      load_assignment:
        cluster_name: backend
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {backend} }} }} }}
  listeners:
    - name: {DOMAIN}
      address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: http
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: {DOMAIN}
                      # The translator leaves Envoy's 20 ms; generous for a loaded CI machine.
                      timeout: 2s
                      enable_x_ratelimit_headers: DRAFT_VERSION_03
                      disable_x_envoy_ratelimited_header: true
                      rate_limit_service:
                        transport_api_version: V3
                        grpc_service: {{ envoy_grpc: {{ cluster_name: ratelimit_cluster }} }}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
                route_config:
                  virtual_hosts:
                    - name: backend
                      domains: ["*"]
                      routes:
                        - name: "{ROUTE_USERS}"
                          match: {{ prefix: /users }}
                          route: {{ cluster: backend, prefix_rewrite: / }}
                          typed_per_filter_config:
                            envoy.filters.http.ratelimit:
                              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
                              domain: {DOMAIN}
                              rate_limits:
                                - actions:
                                    - generic_key: {{ descriptor_key: "{ROUTE_USERS}", descriptor_value: "{ROUTE_USERS}" }}
                                    - request_headers: {{ header_name: x-user-id, descriptor_key: rule-0-match-0 }}
                                - actions:
                                    - generic_key: {{ descriptor_key: "{ROUTE_USERS}", descriptor_value: "{ROUTE_USERS}" }}
                                    - generic_key: {{ descriptor_key: rule-1-match--1, descriptor_value: rule-1-match--1 }}
                        - name: "{ROUTE_FREE}"
                          match: {{ prefix: /free }}
                          route: {{ cluster: backend, prefix_rewrite: / }}
                          typed_per_filter_config:
                            envoy.filters.http.ratelimit:
                              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute
                              domain: {DOMAIN}
                              rate_limits:
                                - actions:
                                    - generic_key: {{ descriptor_key: "{ROUTE_FREE}", descriptor_value: "{ROUTE_FREE}" }}
                                    - header_value_match:
                                        descriptor_key: rule-0-match-0
                                        descriptor_value: rule-0-match-0
                                        expect_match: true
                                        headers:
                                          - name: x-plan
                                            string_match: {{ exact: free }}
"#
    )
}

/// The environment of Envoy Gateway v1.9.0's rate limit Deployment
/// (`internal/infrastructure/kubernetes/ratelimit/resource.go`), Redis
/// backend without TLS, Prometheus on, tracing off.
fn deployment_env(
    certs: &std::path::Path,
    xds_port: u16,
    redis_port: u16,
    metrics_port: u16,
) -> Vec<(&'static str, String)> {
    let cert = |name: &str| certs.join(name).display().to_string();
    vec![
        ("RUNTIME_ROOT", "/data".to_owned()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("RUNTIME_IGNOREDOTFILES", "true".to_owned()),
        ("RUNTIME_WATCH_ROOT", "false".to_owned()),
        ("LOG_LEVEL", "info".to_owned()),
        ("USE_STATSD", "false".to_owned()),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW".to_owned()),
        ("CONFIG_GRPC_XDS_SERVER_URL", format!("localhost:{xds_port}")),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit".to_owned()),
        ("GRPC_SERVER_USE_TLS", "true".to_owned()),
        ("GRPC_SERVER_TLS_CERT", cert("tls.crt")),
        ("GRPC_SERVER_TLS_KEY", cert("tls.key")),
        ("GRPC_SERVER_TLS_CA_CERT", cert("ca.crt")),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true".to_owned()),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", cert("tls.crt")),
        ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", cert("tls.key")),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", cert("ca.crt")),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true".to_owned()),
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", format!("127.0.0.1:{redis_port}")),
        ("USE_PROMETHEUS", "true".to_owned()),
        ("PROMETHEUS_ADDR", format!("127.0.0.1:{metrics_port}")),
        ("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml".to_owned()),
    ]
}

/// In `dir`: the gateway's CA (`ca.pem`), the control plane's certificate
/// (`server.pem`), and the Deployment's `/certs` (returned): `tls.crt` and
/// `tls.key` (it serves and it is a client of the control plane) and
/// `ca.crt`, readable by the container's user as the Secret's files are.
fn deployment_certs(dir: &std::path::Path) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt as _;
    common::make_ca(dir, "ca");
    common::make_leaf(dir, "ca", "server", "serverAuth");
    common::make_leaf(dir, "ca", "ratelimit", "serverAuth,clientAuth");
    let certs = dir.join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    for (from, to) in [("ratelimit.pem", "tls.crt"), ("ratelimit.key", "tls.key"), ("ca.pem", "ca.crt")] {
        std::fs::copy(dir.join(from), certs.join(to)).unwrap();
        std::fs::set_permissions(certs.join(to), std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    certs
}

/// GET `path` through Envoy with `headers`: (status, `x-ratelimit-remaining`).
fn get(port: u16, path: &str, headers: &[(&str, &str)]) -> (u16, Option<String>) {
    let reply = http_get_text(port, path, headers);
    (reply.status, reply.header("x-ratelimit-remaining").map(str::to_owned))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envoy_gateways_deployment_serves_its_xds_limits_through_envoy() {
    let dir = tempfile::tempdir().unwrap();
    let certs = deployment_certs(dir.path());
    // The Envoy proxy's client certificate.
    common::make_leaf(dir.path(), "ca", "envoy", "clientAuth");

    let (_set, seen, url) =
        management_server_with(Some(("1".to_owned(), vec![gateway_config()])), Some(dir.path())).await;
    let xds_port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let redis = common::RedisServer::start();
    let log = dir.path().join("ratelimit.log");
    let metrics_port = common::free_port();
    let (child, grpc_port, http_port) =
        start_as_upstream(dir.path(), &log, &deployment_env(&certs, xds_port, redis.port, metrics_port));
    let _service = Process(child);
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();

    // The Deployment's probe, then the set acknowledged by the node it names.
    let deadline = Instant::now() + Duration::from_secs(20);
    while common::http_get(([127, 0, 0, 1], http_port).into(), "/healthcheck").0 != 200 {
        assert!(Instant::now() < deadline, "/healthcheck never 200; log:\n{}", log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    loop {
        let acked = seen
            .lock()
            .unwrap()
            .iter()
            .any(|r| r.version_info == "1" && r.node.as_ref().is_some_and(|n| n.id == "envoy-ratelimit"));
        if acked {
            break;
        }
        assert!(Instant::now() < deadline, "the set was never acknowledged; log:\n{}", log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let backend_dir = tempfile::tempdir().unwrap();
    let (_backend, backend_port) = python_upstream(backend_dir.path());
    let (envoy, listen) = start_envoy(dir.path(), |listen, admin| {
        envoy_config(listen, admin, grpc_port, backend_port, dir.path())
    });
    let _envoy = Process(envoy);

    // Rule 0: 3 per hour per user; rule 1: 5 per year for the route, every
    // hit counted as upstream counts them (a refused one too).
    let ann = [("x-user-id", "ann")];
    let answers: Vec<_> = (0..4).map(|_| get(listen, "/users", &ann)).collect();
    let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert_eq!(statuses, [200, 200, 200, 429], "ann: {answers:?}; log:\n{}", log_text());
    assert_eq!(
        answers[0].1.as_deref(),
        Some("2"),
        "DRAFT_VERSION_03 headers: the tightest limit's remaining"
    );
    let bob = [("x-user-id", "bob")];
    assert_eq!(get(listen, "/users", &bob).0, 200, "bob's first: the route's 5th hit this year");
    assert_eq!(get(listen, "/users", &bob).0, 429, "bob's second: the route's 6th, over 5 per year");

    // Shadow mode: over 1 per second, never refused, counted as shadow.
    let free = [("x-plan", "free")];
    let statuses: Vec<u16> = (0..3).map(|_| get(listen, "/free", &free).0).collect();
    assert_eq!(statuses, [200, 200, 200], "shadow mode refuses nothing");
    // Scraped where the Deployment's `metrics` port points (PROMETHEUS_ADDR).
    let (_, metrics) = common::http_get(([127, 0, 0, 1], metrics_port).into(), "/metrics");
    let shadow: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("ratelimit_service_rate_limit_shadow_mode{") && l.contains(DOMAIN))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(shadow >= 2.0, "the over-limit free requests counted as shadow: {shadow}\n{metrics}");
}

/// Envoy Gateway's Deployment unchanged but for the image: uid 65534 with
/// the image's `STATE_DIRECTORY` on a root filesystem it cannot write and
/// no volume (here: a state and working directory owned by root, when the
/// test runs as root; read-only ones otherwise). It starts, warning that
/// `dlq.file` and `local.state_dir` cannot be written; before the control
/// plane's first set it answers as envoyproxy/ratelimit does
/// (`checkServiceErr(snappedConfig != nil, "no rate limit configuration
/// loaded")` in service/ratelimit.go, a plain error: UNKNOWN, after its
/// checks of the request's structure), so Envoy's failure mode decides,
/// never OK; once the set is in and Redis is gone, a
/// failed decision's record is a JSON line on standard error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_unchanged_deployment_starts_as_nobody_without_a_volume() {
    use ratelimitd::api::envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{
            RateLimitDescriptor as Descriptor, rate_limit_descriptor::Entry,
        },
        rls::{RateLimitRequest, rate_limit_service_client::RateLimitServiceClient},
    };
    use std::os::unix::{fs::PermissionsExt as _, process::CommandExt as _};
    let dir = tempfile::tempdir().unwrap();
    let certs = deployment_certs(dir.path());
    let root = running_as_root();
    let (state, work) = (dir.path().join("var/lib/ratelimitd"), dir.path().join("work"));
    for (place, mode) in [(dir.path(), 0o755), (&certs, 0o755), (&state, 0o555), (&work, 0o555)] {
        std::fs::create_dir_all(place).unwrap();
        // Root's and not writable by 65534 (root itself passes the mode bits,
        // so a run as root drops to 65534 below).
        std::fs::set_permissions(place, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    let (set, seen, url) = management_server_with(None, Some(dir.path())).await;
    let xds_port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    let mut redis = common::RedisServer::start();
    let metrics_port = common::free_port();
    let mut env = deployment_env(&certs, xds_port, redis.port, metrics_port);
    env.push(("STATE_DIRECTORY", state.display().to_string()));
    let log = dir.path().join("ratelimit.log");
    let home = dir.path().join("home");
    std::fs::create_dir_all(&home).unwrap();
    let (child, grpc_port, _) = common::start_as_upstream_with(&home, &log, &env, |command| {
        command.current_dir(&work);
        if root {
            command.uid(65534).gid(65534);
        }
    });
    let _service = Process(child);
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();

    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(std::fs::read(certs.join("ca.crt")).unwrap()))
        .domain_name("localhost");
    let channel = tonic::transport::Endpoint::from_shared(format!("https://127.0.0.1:{grpc_port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = RateLimitServiceClient::new(channel);
    let request = || RateLimitRequest {
        domain: DOMAIN.to_owned(),
        descriptors: vec![Descriptor {
            entries: vec![
                Entry { key: ROUTE_USERS.to_owned(), value: ROUTE_USERS.to_owned() },
                Entry { key: "rule-1-match--1".to_owned(), value: "rule-1-match--1".to_owned() },
            ],
            ..Default::default()
        }],
        hits_addend: 1,
    };
    let refused = client.should_rate_limit(request()).await.expect_err("no configuration yet");
    assert_eq!(
        (refused.code(), refused.message()),
        (tonic::Code::Unknown, "no rate limit configuration loaded"),
        "{refused:?}"
    );

    // Upstream checks the request's structure first, with its own words.
    let mut nameless = request();
    nameless.domain.clear();
    let refused = client.should_rate_limit(nameless).await.expect_err("no domain");
    assert_eq!(
        (refused.code(), refused.message()),
        (tonic::Code::Unknown, "rate limit domain must not be empty"),
        "{refused:?}"
    );

    set.send_replace(Some(("1".to_owned(), vec![gateway_config()])));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !seen.lock().unwrap().iter().any(|r| r.version_info == "1") {
        assert!(Instant::now() < deadline, "the set was never acknowledged; log:\n{}", log_text());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for key in ["dlq.file", "local.state_dir"] {
        let warned = log_text().lines().any(|l| l.contains("WARN") && l.contains(key));
        assert!(warned, "no warning naming {key}:\n{}", log_text());
    }
    let answer = client.should_rate_limit(request()).await.expect("the set is in").into_inner();
    assert_eq!(answer.overall_code, 1, "OK: the first of 5 a year");

    // Redis gone: the decision is the local share's, its record on stderr.
    redis.stop();
    let _ = client.should_rate_limit(request()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let record = loop {
        let found = log_text()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|r| r["schema_version"].is_u64() && r["failure"].is_object());
        if let Some(record) = found {
            break record;
        }
        assert!(Instant::now() < deadline, "no record on standard error:\n{}", log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(record["request"].to_string().contains(DOMAIN), "{record}");
    // Read back from the container's log, as the docs say.
    let mut audit = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(["audit", "--file", "-"])
        .env_clear()
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut audit.stdin.take().unwrap(), log_text().as_bytes()).unwrap();
    let audited = audit.wait_with_output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&audited.stdout), String::from_utf8_lossy(&audited.stderr));
    let event = record["event_id"].as_str().unwrap();
    assert!(audited.status.success() && out.contains(event), "{out}\n{err}");
}

/// Whether this test runs as root (then the service is started as 65534).
fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}
