//! Kuadrant limitador's limits (`rules.limitador_path`), through a real
//! Envoy and a real Redis: the semantics of limitador's example limits
//! file (a limit for the whole namespace; 5 POSTs per minute per user),
//! written anew from its documentation.

mod common;

use common::{Process, TestServer, any_method_upstream, default_rules_config, http_raw, start_envoy};

/// The namespace's limit, and 5 POSTs per minute per `user_id`.
const LIMITS: &str = r#"
---
- namespace: test_namespace
  max_value: 10
  seconds: 60
  conditions: []
  variables: []
- namespace: test_namespace
  max_value: 5
  seconds: 60
  name: per-user-posts
  conditions:
    - "descriptors[0]['req.method'] == 'POST'"
  variables:
    - descriptors[0]['user_id']
"#;

/// Envoy on domain `test_namespace`, one descriptor of the method
/// (`req.method`) and the `x-user-id` header (`user_id`), as limitador's
/// own Envoy example builds it.
fn envoy_config(listen: u16, admin: u16, ratelimit: u16, backend: u16) -> String {
    let filter = r#"
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: test_namespace
                      failure_mode_deny: true
                      timeout: 2s
                      rate_limit_service:
                        transport_api_version: V3
                        grpc_service: { envoy_grpc: { cluster_name: ratelimit } }"#;
    let actions = r#"
                            rate_limits:
                              - actions:
                                  - request_headers: { header_name: ":method", descriptor_key: req.method }
                                  - request_headers: { header_name: x-user-id, descriptor_key: user_id }"#;
    envoy_yaml([listen, admin, ratelimit, backend], filter, actions)
}

/// Envoy on `listen` (admin on `admin`), the service on `ratelimit` as
/// cluster `ratelimit` (HTTP/2), every path routed to `backend`, with the
/// HTTP `filter` before the router and the route's `actions`.
fn envoy_yaml([listen, admin, ratelimit, backend]: [u16; 4], filter: &str, actions: &str) -> String {
    format!(
        r#"
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  clusters:
    - name: ratelimit
      type: STATIC
      connect_timeout: 1s
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {{ http2_protocol_options: {{}} }}
      load_assignment:
        cluster_name: ratelimit
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
    - address: {{ socket_address: {{ address: 127.0.0.1, port_value: {listen} }} }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: http
                http_filters:{filter}
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
                route_config:
                  virtual_hosts:
                    - name: backend
                      domains: ["*"]
                      routes:
                        - match: {{ prefix: / }}
                          route:
                            cluster: backend{actions}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limitadors_example_limits_through_envoy() {
    let (redis, dir) = (common::RedisServer::start(), tempfile::tempdir().unwrap());
    let (mut config, limits) = limitador_config(&redis, dir.path(), LIMITS);
    // limitador's --rate-limit-headers DRAFT_VERSION_03.
    config.envoy.response_headers = true;
    config.envoy.response_headers_format = ratelimitd::config::EnvoyHeaderFormat::Draft03;
    config.envoy.limit_header = "X-RateLimit-Limit".to_owned();
    config.envoy.remaining_header = "X-RateLimit-Remaining".to_owned();
    config.envoy.reset_header = "X-RateLimit-Reset".to_owned();
    let server = TestServer::start(config).await;
    let (_backend, backend) = any_method_upstream(dir.path());
    let (envoy, listen) =
        start_envoy(dir.path(), |listen, admin| envoy_config(listen, admin, server.addr.port(), backend));
    let _envoy = Process(envoy);
    let send = |method: &str, user: &str| http_raw(listen, method, "/", &[("x-user-id", user.as_bytes())]);

    // ann's POSTs: both limits apply; the 6th is over her 5.
    let first = send("POST", "ann");
    assert_eq!(first.status, 200, "{:?}", first.headers);
    assert_eq!(first.header("x-ratelimit-remaining"), Some("4"), "{:?}", first.headers);
    // limitador's counting: the window opened at this first hit, so it
    // resets a minute on, said in whole seconds as limitador says it (a
    // sliding window said 61 to 120).
    assert_eq!(first.header("x-ratelimit-reset"), Some("59"), "{:?}", first.headers);
    for i in 1..5 {
        assert_eq!(send("POST", "ann").status, 200, "POST {i}");
    }
    assert_eq!(send("POST", "ann").status, 429, "ann's 6th POST in a minute");
    // Her GETs and bob's POST: the namespace's limit only, and bob's own;
    // the refused POST took nothing from the namespace's 10.
    assert_eq!(send("GET", "ann").status, 200);
    assert_eq!(send("POST", "bob").status, 200);
    for _ in 0..3 {
        assert_eq!(send("GET", "cat").status, 200);
    }
    assert_eq!(send("GET", "cat").status, 429, "the namespace's 11th hit in a minute");

    // The file is watched: a higher namespace limit is served at once, its
    // counts kept (the limit's identity does not include max_value).
    std::fs::write(&limits, LIMITS.replacen("max_value: 10", "max_value: 12", 1)).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while send("GET", "cat").status != 200 {
        assert!(std::time::Instant::now() < deadline, "the new limit never served");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(send("GET", "cat").status, 200, "the 12th");
    assert_eq!(send("GET", "cat").status, 429, "the 13th");

    // The counters Envoy's calls made, listed under the limits in force; a
    // limit removed from the file leaves its counter unnamed.
    let user = |name: &str| serde_json::json!({"descriptors[0]['user_id']": name});
    let posts = serde_json::json!("per-user-posts");
    let (listed, _) = counters(server.http_addr, "test_namespace").await;
    let namespace_wide = (serde_json::Value::Null, serde_json::json!({}), 0);
    let users = [(posts.clone(), user("ann"), 0), (posts.clone(), user("bob"), 4)];
    assert_eq!(counted(&listed), [vec![namespace_wide], users.to_vec()].concat());
    let per_user_only = LIMITS.split_once("- namespace").map(|(_, rest)| rest).unwrap();
    let per_user_only = per_user_only.split_once("- namespace").map(|(_, rest)| rest).unwrap();
    std::fs::write(&limits, format!("- namespace{per_user_only}")).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (listed, headers) = counters(server.http_addr, "test_namespace").await;
        if headers.contains(&("ratelimitd-counters-unnamed".to_owned(), "1".to_owned())) {
            assert_eq!(counted(&listed), users, "{headers:?}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the limit never removed: {headers:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    server.stop().await.unwrap();
}

/// The binary as Kuadrant's limitador-operator runs limitador's image: the
/// command `limitador-server` (a link of that name), the operator's
/// arguments (`--rate-limit-headers`, `-vvv`, `--http-port`, `--rls-port`,
/// the limits file, `redis <URL>`), nothing else in the environment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn started_as_the_operator_starts_limitador_server() {
    use ratelimitd::api::envoy_pb::rls::{
        rate_limit_response::Code, rate_limit_service_client::RateLimitServiceClient,
    };
    let redis = common::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limitador-config.yaml");
    std::fs::write(&limits, LIMITS).unwrap();
    let link = dir.path().join("limitador-server");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ratelimitd"), &link).unwrap();
    let log = dir.path().join("limitador.log");
    let http = std::cell::Cell::new(0);
    let (child, grpc) = common::start_listening("limitador-server", &log, |grpc| {
        http.set(common::free_port());
        let mut command = std::process::Command::new(&link);
        command
            .env_clear()
            .env("HOME", dir.path())
            .args([
                "--rate-limit-headers",
                "DRAFT_VERSION_03",
                "--limit-name-in-labels",
                "-vvv",
                "--http-port",
            ])
            .arg(http.get().to_string())
            .args(["--http-ip", "127.0.0.1", "--rls-ip", "127.0.0.1", "--rls-port"])
            .arg(grpc.to_string())
            .arg(&limits)
            .args(["redis", &redis.url()]);
        command
    });
    let _service = Process(child);
    let mut client = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc}")).await.unwrap();
    let request = |user: &str| {
        let mut request = common::rls_request("test_namespace", "req.method", "POST");
        request.descriptors[0].entries.push(ratelimitd::api::envoy_pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry {
            key: "user_id".to_owned(),
            value: user.to_owned(),
        });
        request
    };
    let mut codes = Vec::new();
    for _ in 0..6 {
        let answer = client.should_rate_limit(request("ann")).await.unwrap().into_inner();
        codes.push(Code::try_from(answer.overall_code).unwrap());
        assert!(answer.statuses.is_empty(), "limitador answers no statuses");
        if codes.len() == 1 {
            let remaining = answer.response_headers_to_add.iter().find(|h| h.key == "X-RateLimit-Remaining");
            assert_eq!(
                remaining.map(|h| h.value.as_str()),
                Some("4"),
                "{:?}",
                answer.response_headers_to_add
            );
        }
    }
    assert_eq!(codes, [Code::Ok, Code::Ok, Code::Ok, Code::Ok, Code::Ok, Code::OverLimit]);
    // limitador's families, the refused call under its limit's name
    // (--limit-name-in-labels, as the operator passes it for exhaustive telemetry).
    let (_, metrics) = common::http_get(([127, 0, 0, 1], http.get()).into(), "/metrics");
    for line in [
        r#"authorized_calls{limitador_namespace="test_namespace"} 5"#,
        r#"authorized_hits{limitador_namespace="test_namespace"} 5"#,
        r#"limited_calls{limitador_namespace="test_namespace",limit_name="per-user-posts"} 1"#,
    ] {
        assert!(metrics.lines().any(|l| l == line), "no {line}");
    }
    // The operator's probes read limitador's /status.
    let (status, body) = common::http_get(([127, 0, 0, 1], http.get()).into(), "/status");
    assert_eq!(status, 200, "{body}; {}", std::fs::read_to_string(&log).unwrap_or_default());
    let body: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (body["config_version"].as_u64(), body["config_err_since"].as_u64()),
        (Some(0), Some(0)),
        "no reload yet: limitador's Status::default, its first load not counted (main.rs config_success)"
    );
    for at in ["started_at", "config_applied_at"] {
        let text = body[at].as_str().unwrap_or_default();
        assert!(text.len() >= 19 && text.as_bytes()[10] == b'T' && !text.ends_with('Z'), "{at}: {body}");
    }
    assert!(
        body["started_at"].as_str() <= body["config_applied_at"].as_str(),
        "started before it loaded: {body}"
    );

    // --validate: the file compiles (0), or its error names the limit (1).
    let validate = |file: &std::path::Path| {
        std::process::Command::new(&link)
            .env_clear()
            .arg("--validate")
            .arg(file)
            .arg("memory")
            .output()
            .unwrap()
    };
    let good = validate(&limits);
    assert!(good.status.success(), "{}", String::from_utf8_lossy(&good.stderr));
    assert!(String::from_utf8_lossy(&good.stdout).starts_with("ok, 2 limits"));
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, LIMITS.replace("seconds: 60\n  name", "seconds: 0\n  name")).unwrap();
    let refused = validate(&bad);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("limits[1]") && stderr.contains("seconds"), "{stderr}");
}

/// The service on Redis with limitador's limits: 100 tokens a minute per
/// user of namespace `llm`. The Redis, the limits' folder, the service.
async fn serving_token_limit() -> (common::RedisServer, tempfile::TempDir, TestServer) {
    let (redis, dir) = (common::RedisServer::start(), tempfile::tempdir().unwrap());
    let tokens = "- namespace: llm\n  max_value: 100\n  seconds: 60\n  name: tokens\n  variables: [\"descriptors[0].user\"]\n";
    let server = TestServer::start(limitador_config(&redis, dir.path(), tokens).0).await;
    (redis, dir, server)
}

/// The service's configuration on `redis` with the limits file `text`,
/// written in `dir`: the configuration and the file's path.
fn limitador_config(
    redis: &common::RedisServer,
    dir: &std::path::Path,
    text: &str,
) -> (ratelimitd::config::Config, std::path::PathBuf) {
    let limits = dir.join("limits.yaml");
    std::fs::write(&limits, text).unwrap();
    let mut config = default_rules_config(Some(redis.url()));
    config.rules.limitador_path = Some(limits.clone());
    (config, limits)
}

/// Kuadrant's wasm-shim flow over `kuadrant.service.ratelimit.v1`: a
/// token limit checked before each request (nothing counted) and the
/// tokens the response used reported after it (counted whatever is left),
/// on Redis; and the same check from grpcurl through reflection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kuadrants_check_then_report_flow() {
    use ratelimitd::api::envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
        kuadrant::service::ratelimit::v1::rate_limit_service_client::RateLimitServiceClient,
        rls::{RateLimitRequest, rate_limit_response::Code},
    };
    let (_redis, _dir, server) = serving_token_limit().await;
    let mut client = RateLimitServiceClient::connect(format!("http://{}", server.addr)).await.unwrap();
    let request = |user: &str, hits: u32| RateLimitRequest {
        domain: "llm".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry { key: "user".to_owned(), value: user.to_owned() }],
            ..Default::default()
        }],
        hits_addend: hits,
    };
    let code = |answer: ratelimitd::api::envoy_pb::rls::RateLimitResponse| {
        assert!(answer.statuses.is_empty() && answer.response_headers_to_add.is_empty(), "{answer:?}");
        Code::try_from(answer.overall_code).unwrap()
    };
    let mut flow = Vec::new();
    for tokens in [60, 39, 5] {
        flow.push(code(client.check_rate_limit(request("ann", 1)).await.unwrap().into_inner()));
        flow.push(code(client.report(request("ann", tokens)).await.unwrap().into_inner()));
    }
    // 60, then 99: one more fits; then 104 reported whatever was left.
    assert_eq!(flow, [Code::Ok, Code::Ok, Code::Ok, Code::Ok, Code::Ok, Code::Ok]);
    for _ in 0..3 {
        let answer = client.check_rate_limit(request("ann", 1)).await.unwrap().into_inner();
        assert_eq!(code(answer), Code::OverLimit, "a check counts nothing, and ann is over");
    }
    assert_eq!(code(client.check_rate_limit(request("bob", 1)).await.unwrap().into_inner()), Code::Ok);
    // limitador's families: checks count calls, reports their hits.
    let http = server.http_addr;
    let (_, metrics) = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics")).await.unwrap();
    for line in [
        r#"authorized_calls{limitador_namespace="llm"} 4"#,
        r#"authorized_hits{limitador_namespace="llm"} 104"#,
        r#"limited_calls{limitador_namespace="llm"} 3"#,
    ] {
        assert!(metrics.lines().any(|l| l == line), "no {line}");
    }

    // An independent client: grpcurl, the service found by reflection.
    let addr = server.addr.to_string();
    let answer = tokio::task::spawn_blocking(move || {
        std::process::Command::new(common::grpcurl_path())
            .args([
                "-plaintext",
                "-d",
                r#"{"domain":"llm","descriptors":[{"entries":[{"key":"user","value":"ann"}]}]}"#,
            ])
            .arg(addr)
            .arg("kuadrant.service.ratelimit.v1.RateLimitService/CheckRateLimit")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&answer.stdout);
    assert!(stdout.contains("OVER_LIMIT"), "{stdout}{}", String::from_utf8_lossy(&answer.stderr));
    server.stop().await.unwrap();
}

/// One HTTP/1.1 POST of `body` (JSON) to `addr`: (status, headers with
/// lower-case names, body).
fn post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, Vec<(String, String)>, String) {
    let json: &[u8] = b"application/json";
    let reply = common::http_request(addr.port(), "POST", path, &[("Content-Type", json)], body.as_bytes());
    (reply.status, reply.headers, reply.body)
}

/// limitador's HTTP API on the same limits, on Redis and in memory:
/// status codes and bodies as limitador answers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limitadors_http_api() {
    let (redis, dir) = (common::RedisServer::start(), tempfile::tempdir().unwrap());
    for store in ["redis", "memory"] {
        let (mut config, _) = limitador_config(&redis, dir.path(), LIMITS);
        if store == "memory" {
            config.redis.connection.url = None;
        }
        let server = TestServer::start(config).await;
        http_api_answers(server.http_addr, store).await;
        server.stop().await.unwrap();
    }
}

/// `GET /counters/{namespace}` at `addr`, parsed.
async fn counters(
    addr: std::net::SocketAddr,
    namespace: &str,
) -> (Vec<serde_json::Value>, Vec<(String, String)>) {
    let path = format!("/counters/{namespace}");
    let reply =
        tokio::task::spawn_blocking(move || common::http_request(addr.port(), "GET", &path, &[], b""))
            .await
            .unwrap();
    assert_eq!(reply.status, 200, "{}", reply.body);
    (serde_json::from_str(&reply.body).unwrap(), reply.headers)
}

/// Each counter's limit name (null for none), variables and remaining.
fn counted(listed: &[serde_json::Value]) -> Vec<(serde_json::Value, serde_json::Value, u64)> {
    listed
        .iter()
        .map(|c| {
            let expires = c["expires_in_seconds"].as_u64().unwrap();
            assert!((40..=60).contains(&expires), "a minute's counter, counted moments ago: {c}");
            (c["limit"]["name"].clone(), c["set_variables"].clone(), c["remaining"].as_u64().unwrap())
        })
        .collect()
}

/// The HTTP API's calls and answers, the service at `addr` on `store`.
async fn http_api_answers(addr: std::net::SocketAddr, store: &str) {
    let call = move |path: &'static str, user: &'static str, delta: u32, headers: bool| {
        let extra = if headers { r#", "response_headers": "DraftVersion03""# } else { "" };
        let body = format!(
            r#"{{"namespace": "test_namespace", "values": {{"req.method": "POST", "user_id": "{user}"}}, "delta": {delta}{extra}}}"#
        );
        tokio::task::spawn_blocking(move || post(addr, path, &body))
    };
    let (status, headers, body) = call("/check_and_report", "ann", 1, true).await.unwrap();
    assert_eq!((status, body.as_str()), (200, "null"));
    let header = |name: &str| headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
    assert_eq!(header("x-ratelimit-remaining").as_deref(), Some("4"), "{headers:?}");
    assert_eq!(
        header("x-ratelimit-limit").as_deref(),
        Some(r#"5, 5;w=60;name="per-user-posts", 10;w=60"#),
        "the fewest left first"
    );
    let user = |name: &str| serde_json::json!({"descriptors[0]['user_id']": name});
    let (listed, headers) = counters(addr, "test_namespace").await;
    let none = serde_json::Value::Null;
    let (posts, empty) = (serde_json::json!("per-user-posts"), serde_json::json!({}));
    assert_eq!(
        counted(&listed),
        [(none.clone(), empty.clone(), 9), (posts.clone(), user("ann"), 4)],
        "{store}"
    );
    assert_eq!(listed[1]["limit"]["variables"][0], "descriptors[0]['user_id']");
    assert!(headers.iter().all(|(name, _)| !name.starts_with("ratelimitd-counters")), "{headers:?}");
    for _ in 1..5 {
        assert_eq!(call("/check_and_report", "ann", 1, false).await.unwrap().0, 200);
    }
    let (status, _, body) = call("/check_and_report", "ann", 1, false).await.unwrap();
    assert_eq!((status, body.as_str()), (429, "null"));
    let (status, _, body) = call("/check", "ann", 1, false).await.unwrap();
    assert_eq!((status, body.as_str()), (429, "Too many requests"));
    // bob: a check counts nothing; a report counts whatever is left.
    for _ in 0..3 {
        let (status, _, body) = call("/check", "bob", 5, false).await.unwrap();
        assert_eq!((status, body.as_str()), (200, "null"), "5 fit bob's 5");
    }
    assert_eq!(call("/check", "bob", 6, false).await.unwrap().0, 429, "6 do not");
    let (status, _, body) = call("/report", "bob", 7, false).await.unwrap();
    assert_eq!((status, body.as_str()), (200, "null"));
    assert_eq!(call("/check", "bob", 1, false).await.unwrap().0, 429);

    let (status, body) =
        tokio::task::spawn_blocking(move || common::http_get(addr, "/limits/test_namespace")).await.unwrap();
    assert_eq!(status, 200);
    let listed: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{listed}");
    assert_eq!(listed[1]["name"], "per-user-posts");
    assert_eq!(listed[1]["max_value"], 5);
    assert_eq!(listed[1]["variables"][0], "descriptors[0]['user_id']");
    assert_eq!(listed[0]["name"], serde_json::Value::Null);

    // A method a route does not take is 404 as an unknown path: actix's
    // default service behind limitador's method guards (http_api/server.rs),
    // HEAD included.
    for (method, path) in [
        ("GET", "/check"),
        ("GET", "/report"),
        ("GET", "/check_and_report"),
        ("PUT", "/check"),
        ("POST", "/limits/test_namespace"),
        ("DELETE", "/counters/test_namespace"),
        ("POST", "/status"),
        ("HEAD", "/status"),
        ("HEAD", "/limits/test_namespace"),
        ("GET", "/nothing"),
    ] {
        let reply =
            tokio::task::spawn_blocking(move || common::http_request(addr.port(), method, path, &[], b""))
                .await
                .unwrap();
        assert_eq!((reply.status, reply.body.as_str()), (404, ""), "{method} {path}");
    }

    // A body not declared JSON is not read (actix's Json extractor).
    let undeclared = tokio::task::spawn_blocking(move || {
        common::http_request(addr.port(), "POST", "/check", &[("Content-Type", b"text/plain")], b"{}")
    })
    .await
    .unwrap();
    assert_eq!((undeclared.status, undeclared.body.as_str()), (400, "Content type error"));
    let bad = tokio::task::spawn_blocking(move || post(addr, "/check", r#"{"namespace": 1}"#)).await.unwrap();
    assert_eq!(bad.0, 400, "{bad:?}");
    let huge = format!(r#"{{"namespace": "{}", "values": {{}}, "delta": 1}}"#, "n".repeat(100_000));
    let refused = tokio::task::spawn_blocking(move || post(addr, "/report", &huge)).await.unwrap();
    assert_eq!(refused.0, 413, "a body over 64 KiB is not read");

    // limitador's families count check_and_report only of the HTTP calls:
    // ann's five admitted (one hit each) and her sixth refused by her limit.
    let (_, metrics) = tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
    for line in [
        r#"authorized_calls{limitador_namespace="test_namespace"} 5"#,
        r#"authorized_hits{limitador_namespace="test_namespace"} 5"#,
        r#"limited_calls{limitador_namespace="test_namespace"} 1"#,
        "limitador_up 1",
        "datastore_partitioned 0",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{store}: no {line}");
    }

    // ann's five and bob's report of 7 (over his 5 and the 10 of all).
    let (listed, _) = counters(addr, "test_namespace").await;
    let mut counted = counted(&listed);
    counted.sort_by_key(|c| c.1.to_string());
    assert_eq!(
        counted,
        [(posts.clone(), user("ann"), 0), (posts, user("bob"), 0), (none, empty, 0)],
        "{store}"
    );
    assert_eq!(counters(addr, "elsewhere").await.0, Vec::<serde_json::Value>::new());
}

/// One HTTP call of the parity test: method, path, JSON body.
type Call = (&'static str, &'static str, String);

/// An answer as the parity test compares it: status, body (JSON as a
/// value with lists sorted, so a set's order does not count; other text
/// as it is), the rate limit headers but `x-ratelimit-reset`, and the
/// times in seconds compared within a second (the two answers come a
/// moment apart, and limitador's Redis rounds a counter's time to live):
/// that header, then each listed counter's `expires_in_seconds`.
type Comparable = (u16, String, Vec<(String, String)>, Vec<u64>);

fn comparable(reply: common::Reply) -> Comparable {
    fn sorted(value: serde_json::Value) -> serde_json::Value {
        match value {
            serde_json::Value::Array(items) => {
                let mut items: Vec<_> = items.into_iter().map(sorted).collect();
                items.sort_by_key(|v| v.to_string());
                serde_json::Value::Array(items)
            }
            serde_json::Value::Object(map) => map.into_iter().map(|(k, v)| (k, sorted(v))).collect(),
            other => other,
        }
    }
    let mut times: Vec<u64> = reply
        .headers
        .iter()
        .filter(|(name, _)| name == "x-ratelimit-reset")
        .map(|(_, v)| v.parse().unwrap())
        .collect();
    let body = match serde_json::from_str(&reply.body) {
        Ok(serde_json::Value::Array(items)) => {
            let mut items: Vec<(String, Option<u64>)> = items
                .into_iter()
                .map(|mut item| {
                    let expires = item.as_object_mut().and_then(|o| o.remove("expires_in_seconds"));
                    (sorted(item).to_string(), expires.and_then(|e| e.as_u64()))
                })
                .collect();
            items.sort();
            times.extend(items.iter().filter_map(|(_, expires)| *expires));
            format!("[{}]", items.into_iter().map(|(item, _)| item).collect::<Vec<_>>().join(","))
        }
        // `/status`: its times are each process's own.
        Ok(serde_json::Value::Object(mut status)) if status.contains_key("started_at") => {
            status.remove("started_at");
            status.remove("config_applied_at");
            serde_json::Value::Object(status).to_string()
        }
        Ok(other) => sorted(other).to_string(),
        Err(_) => reply.body,
    };
    let mut headers: Vec<_> = reply
        .headers
        .into_iter()
        .filter(|(name, _)| name.starts_with("x-ratelimit-") && name != "x-ratelimit-reset")
        .collect();
    headers.sort();
    (reply.status, body, headers, times)
}

/// Starts `binary` as limitador-server with the operator's command line
/// on free loopback ports, `store` last (`memory`, or `redis URL`): its
/// process, HTTP port and gRPC port.
fn start_as_limitador(
    binary: &std::path::Path,
    log: &std::path::Path,
    limits: &std::path::Path,
    store: &[String],
) -> (Process, u16, u16) {
    let http = std::cell::Cell::new(0);
    let (child, grpc) = common::start_listening("limitador-server", log, |grpc| {
        http.set(common::free_port());
        let mut command = std::process::Command::new(binary);
        command
            .env_clear()
            .args(["--rate-limit-headers", "DRAFT_VERSION_03", "--limit-name-in-labels"])
            .args(["--http-ip", "127.0.0.1", "--http-port"])
            .arg(http.get().to_string())
            .args(["--rls-ip", "127.0.0.1", "--rls-port"])
            .arg(grpc.to_string())
            .arg(limits)
            .args(store);
        command
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", http.get())).is_err() {
        assert!(std::time::Instant::now() < deadline, "{}: HTTP never listened", binary.display());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    (Process(child), http.get(), grpc)
}

/// Whether two answers are alike: all but the times exactly, the times
/// within a second.
fn alike(a: &Comparable, b: &Comparable) -> bool {
    let times = a.3.len() == b.3.len() && a.3.iter().zip(&b.3).all(|(x, y)| x.abs_diff(*y) <= 1);
    (a.0, &a.1, &a.2) == (b.0, &b.1, &b.2) && times
}

/// limitador's metric families on `/metrics` at `port`: their series, sorted.
fn limitador_families(port: u16) -> Vec<String> {
    let (status, body) = common::http_get(([127, 0, 0, 1], port).into(), "/metrics");
    assert_eq!(status, 200, "{body}");
    let families =
        ["authorized_calls", "authorized_hits", "limited_calls", "limitador_up", "datastore_partitioned"];
    let mut series: Vec<String> = body
        .lines()
        .filter(|line| {
            families.iter().any(|f| line.strip_prefix(f).is_some_and(|r| r.starts_with(['{', ' '])))
        })
        .map(str::to_owned)
        .collect();
    series.sort();
    series
}

/// The HTTP calls of the parity test, each to both: those answered differently.
fn http_differences(theirs: u16, ours: u16) -> Vec<String> {
    let values = |user: &str, method: &str, delta: u32, headers: bool| {
        let extra = if headers { r#", "response_headers": "DraftVersion03""# } else { "" };
        format!(
            r#"{{"namespace": "test_namespace", "values": {{"req.method": "{method}", "user_id": "{user}"}}, "delta": {delta}{extra}}}"#
        )
    };
    let mut calls: Vec<Call> = vec![("POST", "/check_and_report", values("ann", "POST", 1, true)); 6];
    calls.extend([
        ("POST", "/check", values("ann", "POST", 1, true)),
        ("POST", "/check", values("ann", "GET", 1, true)),
        ("POST", "/check", values("bob", "POST", 5, true)),
        ("POST", "/check", values("bob", "POST", 6, false)),
        // Listed before bob's report puts counters past their limits:
        // limitador's `remaining` then wraps below zero (2^64 - 2 for 7 of 5).
        ("POST", "/report", values("we{ir}d*|=%", "POST", 2, false)),
        ("GET", "/counters/test_namespace", String::new()),
        ("GET", "/counters/elsewhere", String::new()),
        ("POST", "/report", values("bob", "POST", 7, false)),
        ("POST", "/check", values("bob", "POST", 1, true)),
        ("POST", "/check", values("cat", "POST", 0, true)),
        ("POST", "/check_and_report", values("cat", "GET", 3, true)),
        ("POST", "/check_and_report", r#"{"namespace": "elsewhere", "values": {}, "delta": 1}"#.to_owned()),
        ("POST", "/check", r#"{"namespace": "test_namespace", "values": {}, "delta": 1}"#.to_owned()),
        ("POST", "/check", r#"{"namespace": 1}"#.to_owned()),
        (
            "POST",
            "/report",
            r#"{"namespace": "test_namespace", "values": {"user_id": 7}, "delta": 1}"#.to_owned(),
        ),
        ("POST", "/check", "not json".to_owned()),
        ("GET", "/limits/test_namespace", String::new()),
        ("GET", "/limits/elsewhere", String::new()),
        // The rest of the API: the status, methods a route does not take,
        // paths none serves, bodies of the wrong kind.
        ("GET", "/status", String::new()),
        ("HEAD", "/status", String::new()),
        ("POST", "/status", String::new()),
        ("GET", "/check", String::new()),
        ("GET", "/report", String::new()),
        ("GET", "/check_and_report", String::new()),
        ("PUT", "/check_and_report", values("ann", "POST", 1, false)),
        ("DELETE", "/counters/test_namespace", String::new()),
        ("POST", "/limits/test_namespace", String::new()),
        ("GET", "/limits", String::new()),
        ("GET", "/limits/", String::new()),
        ("GET", "/nothing", String::new()),
        ("GET", "/", String::new()),
        ("POST", "/check", String::new()),
        ("POST", "/check", "[]".to_owned()),
        ("POST", "/check", r#"{"namespace": "test_namespace", "values": {}}"#.to_owned()),
        ("POST", "/check", r#"{"namespace": "test_namespace", "values": {}, "delta": -1}"#.to_owned()),
        (
            "POST",
            "/check_and_report",
            r#"{"namespace": "test_namespace", "values": {"user_id": "dan"}, "delta": 1, "response_headers": "bogus"}"#
                .to_owned(),
        ),
    ]);
    let json: &[u8] = b"application/json";
    let mut differ = Vec::new();
    for (method, path, body) in &calls {
        let ask = |port: u16| {
            let headers: &[(&str, &[u8])] = if body.is_empty() { &[] } else { &[("Content-Type", json)] };
            comparable(common::http_request(port, method, path, headers, body.as_bytes()))
        };
        let (limitador, ratelimitd) = (ask(theirs), ask(ours));
        if !alike(&limitador, &ratelimitd) {
            differ.push(format!(
                "{method} {path} {body}\n  limitador:  {limitador:?}\n  ratelimitd: {ratelimitd:?}"
            ));
        }
    }
    differ
}

/// The `ShouldRateLimit` calls of the parity test, each to both: those
/// answered differently (code, statuses, headers).
async fn rls_differences(theirs: u16, ours: u16) -> Vec<String> {
    use ratelimitd::api::envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
        rls::{RateLimitRequest, rate_limit_service_client::RateLimitServiceClient},
    };
    let request = |domain: &str, entries: &[(&str, &str)], hits: u32| RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry { key: (*k).to_owned(), value: (*v).to_owned() })
                .collect(),
            ..Default::default()
        }],
        hits_addend: hits,
    };
    let mut requests = vec![request("test_namespace", &[("req.method", "POST"), ("user_id", "dan")], 1); 6];
    requests.extend([
        request("test_namespace", &[("req.method", "POST"), ("user_id", "eve")], 4),
        request("test_namespace", &[("req.method", "POST"), ("user_id", "eve")], 2),
        request("test_namespace", &[("req.method", "GET")], 0),
        request("elsewhere", &[("req.method", "POST")], 1),
        // What Envoy never sends: no domain, a descriptor without entries or
        // with an empty key, no descriptor at all.
        request("", &[("req.method", "POST")], 1),
        request("test_namespace", &[], 1),
        request("test_namespace", &[("", "x"), ("req.method", "POST")], 1),
        RateLimitRequest { domain: "elsewhere".to_owned(), descriptors: vec![], hits_addend: 1 },
    ]);
    let connect = |port: u16| RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"));
    let (mut theirs, mut ours) = (connect(theirs).await.unwrap(), connect(ours).await.unwrap());
    let mut differ = Vec::new();
    for request in requests {
        let answer =
            |r: Result<tonic::Response<ratelimitd::api::envoy_pb::rls::RateLimitResponse>, tonic::Status>| {
                let r = match r {
                    Ok(r) => r.into_inner(),
                    Err(status) => {
                        return (1000 + status.code() as u16, status.message().to_owned(), vec![], vec![]);
                    }
                };
                let mut headers: Vec<_> = r
                    .response_headers_to_add
                    .iter()
                    .map(|h| (h.key.to_ascii_lowercase(), h.value.clone()))
                    .collect();
                let reset: Vec<u64> = headers
                    .iter()
                    .filter(|(k, _)| k == "x-ratelimit-reset")
                    .map(|(_, v)| v.parse().unwrap())
                    .collect();
                headers.retain(|(k, _)| k != "x-ratelimit-reset");
                headers.sort();
                let code = u16::try_from(r.overall_code).unwrap();
                (code, format!("{} statuses", r.statuses.len()), headers, reset)
            };
        let limitador = answer(theirs.should_rate_limit(request.clone()).await);
        let ratelimitd = answer(ours.should_rate_limit(request.clone()).await);
        if !alike(&limitador, &ratelimitd) {
            differ.push(format!("{request:?}\n  limitador:  {limitador:?}\n  ratelimitd: {ratelimitd:?}"));
        }
    }
    differ
}

/// limitador-server itself, built from limitador's repository (outside
/// this one), and this binary started as limitador-server, each with the
/// same command line and limits file, in memory and each on its own Redis:
/// the same HTTP calls (decisions counted and refused, checks, reports,
/// headers, listings, malformed bodies) get the same status, body and rate
/// limit headers, and the same `ShouldRateLimit` calls the same code,
/// statuses and headers.
///
/// `LIMITADOR_SERVER=/path/to/limitador-server cargo nextest run --test limitador --run-ignored only`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs LIMITADOR_SERVER, a limitador-server built from limitador's repository"]
async fn the_same_calls_are_answered_as_limitador_server_answers_them() {
    let peer =
        std::env::var_os("LIMITADOR_SERVER").expect("LIMITADOR_SERVER: the path of a limitador-server");
    let peer = std::path::PathBuf::from(peer);
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits.yaml");
    std::fs::write(&limits, LIMITS).unwrap();
    let link = dir.path().join("limitador-server");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ratelimitd"), &link).unwrap();
    let redis = [common::RedisServer::start(), common::RedisServer::start()];
    let on = |r: &common::RedisServer| vec!["redis".to_owned(), r.url()];
    let mut differ = Vec::new();
    for (store, theirs, ours) in [
        ("memory", vec!["memory".to_owned()], vec!["memory".to_owned()]),
        ("redis", on(&redis[0]), on(&redis[1])),
    ] {
        let (_limitador, their_http, their_grpc) =
            start_as_limitador(&peer, &dir.path().join(format!("limitador-{store}.log")), &limits, &theirs);
        let (_ratelimitd, our_http, our_grpc) =
            start_as_limitador(&link, &dir.path().join(format!("ratelimitd-{store}.log")), &limits, &ours);
        let http = tokio::task::spawn_blocking(move || http_differences(their_http, our_http)).await.unwrap();
        differ.extend(http.into_iter().map(|d| format!("{store}: {d}")));
        differ
            .extend(rls_differences(their_grpc, our_grpc).await.into_iter().map(|d| format!("{store}: {d}")));
        let (theirs, ours) = (limitador_families(their_http), limitador_families(our_http));
        if theirs != ours {
            differ.push(format!("{store}: /metrics\n  limitador:  {theirs:?}\n  ratelimitd: {ours:?}"));
        }
    }
    assert!(differ.is_empty(), "{} calls answered differently:\n{}", differ.len(), differ.join("\n"));
}

/// Conditions (and variables) limitador-server evaluates, each a limit of
/// its own: keys present and missing, `has()`, `in`, comparisons of
/// another type, conversions that fail, comprehensions over the
/// descriptors and over literals, an index past the descriptors, the
/// limit's own name, on the fast path and the interpreter's alike.
const CEL_TABLE: &[(&str, &str)] = &[
    ("descriptors[0].user == 'ann'", ""),
    ("descriptors[0]['user'] == 'ann'", ""),
    ("descriptors[0].plan == 'gold'", ""),
    ("descriptors[0].user != 'ann'", ""),
    ("has(descriptors[0].plan)", ""),
    ("!has(descriptors[0].plan)", ""),
    ("'plan' in descriptors[0]", ""),
    ("descriptors[0].user in ['ann', 'bob']", ""),
    ("descriptors[0].user > 5", ""),
    ("descriptors[0].user == 5", ""),
    ("int(descriptors[0].n) > 5", ""),
    ("descriptors[0].user.startsWith('a') && descriptors[0].user.size() == 3", ""),
    ("descriptors[0].user.matches('^a.n$')", ""),
    ("descriptors[0].plan == 'gold' || descriptors[0].user == 'ann'", ""),
    ("descriptors[0].user == 'ann' || descriptors[0].plan == 'gold'", ""),
    ("descriptors.exists(d, true)", ""),
    ("descriptors.all(d, false)", ""),
    ("descriptors.map(d, 1).size() == 1", ""),
    ("size(descriptors) == 1", ""),
    ("descriptors.size() == 2", ""),
    ("descriptors[1].user == 'bob'", ""),
    ("[1, 2].all(x, true)", ""),
    ("limit.name == 'named'", ""),
    ("", "descriptors[0].plan"),
    ("", "descriptors[0].n"),
    ("descriptors[0].user == 'ann'", "descriptors[0].user"),
];

/// What this service refuses at load as never applied by limitador-server
/// (a comprehension's variable read, a name it does not bind):
/// limitador-server loads each and, the test checks, never applies it.
const CEL_REFUSED: &[&str] =
    &["descriptors.exists(d, d.user == 'ann')", "[1, 2].all(x, x > 0)", "user == 'ann'"];

/// The requests of the CEL parity test: one descriptor's entries each (none:
/// over HTTP only), and two descriptors (over `ShouldRateLimit` only).
const CEL_VALUES: &[&[&[(&str, &str)]]] = &[
    &[&[("user", "ann")]],
    &[&[("user", "ann"), ("plan", "gold")]],
    &[&[("user", "bob"), ("n", "7")]],
    &[&[("user", "ann"), ("n", "x")]],
    &[&[]],
    &[&[("user", "ann")], &[("user", "bob")]],
];

/// A limits file of `conditions` (with `variables`), each limit once per
/// request of [`CEL_VALUES`] and API, 1 a minute, in a namespace of its own.
fn cel_limits(table: &[(&str, &str)]) -> String {
    let mut out = String::from("---\n");
    for (i, (condition, variable)) in table.iter().enumerate() {
        for v in 0..CEL_VALUES.len() {
            for api in ["http", "rls"] {
                let conditions = if condition.is_empty() { String::new() } else { format!("{condition:?}") };
                let variables = if variable.is_empty() { String::new() } else { format!("{variable:?}") };
                out.push_str(&format!(
                    "- {{ namespace: cel-{i}-{v}-{api}, name: named, max_value: 1, seconds: 60, \
                     conditions: [{conditions}], variables: [{variables}] }}\n"
                ));
            }
        }
    }
    out
}

/// The calls of the CEL parity test against limits `table`, each twice (the
/// second says whether the first was counted): those answered differently.
async fn cel_differences(table: &[(&str, &str)], theirs: (u16, u16), ours: (u16, u16)) -> Vec<String> {
    use ratelimitd::api::envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
        rls::{RateLimitRequest, rate_limit_service_client::RateLimitServiceClient},
    };
    let connect = |port: u16| RateLimitServiceClient::connect(format!("http://127.0.0.1:{port}"));
    let (mut their_rls, mut our_rls) = (connect(theirs.1).await.unwrap(), connect(ours.1).await.unwrap());
    let mut differ = Vec::new();
    let mut unanswered = 0;
    for (i, entry) in table.iter().enumerate() {
        for (v, descriptors) in CEL_VALUES.iter().enumerate() {
            if let [one] = descriptors {
                let values: serde_json::Map<String, serde_json::Value> =
                    one.iter().map(|(k, v)| ((*k).to_owned(), serde_json::Value::from(*v))).collect();
                let body = serde_json::json!({ "namespace": format!("cel-{i}-{v}-http"), "values": values, "delta": 1 })
                    .to_string();
                for _ in 0..2 {
                    let (limitador, ratelimitd) = (posted(theirs.0, &body), posted(ours.0, &body));
                    // What limitador-server cannot evaluate (a type error, a
                    // failed conversion, a missing key or descriptor read)
                    // panics its handler: the connection closes unanswered,
                    // which a proxy failing open allows. Here it is denied.
                    let denied = ratelimitd.as_ref().is_some_and(|(status, _)| *status == 429);
                    if limitador.is_none() && denied {
                        unanswered += 1;
                    } else if limitador != ratelimitd {
                        differ.push(format!("{entry:?} {one:?} (HTTP)\n  limitador:  {limitador:?}\n  ratelimitd: {ratelimitd:?}"));
                    }
                }
            }
            // Envoy never sends a descriptor without entries (limitador
            // takes one; this service refuses it, INVALID_ARGUMENT).
            if descriptors.iter().any(|entries| entries.is_empty()) {
                continue;
            }
            let request = RateLimitRequest {
                domain: format!("cel-{i}-{v}-rls"),
                descriptors: descriptors
                    .iter()
                    .map(|entries| RateLimitDescriptor {
                        entries: entries
                            .iter()
                            .map(|(k, v)| Entry { key: (*k).to_owned(), value: (*v).to_owned() })
                            .collect(),
                        ..Default::default()
                    })
                    .collect(),
                hits_addend: 1,
            };
            let answer = |r: Result<
                tonic::Response<ratelimitd::api::envoy_pb::rls::RateLimitResponse>,
                tonic::Status,
            >| {
                match r {
                    Ok(r) => format!("code {}", r.into_inner().overall_code),
                    Err(status) => format!("error {:?}", status.code()),
                }
            };
            for _ in 0..2 {
                let limitador = answer(their_rls.should_rate_limit(request.clone()).await);
                let ratelimitd = answer(our_rls.should_rate_limit(request.clone()).await);
                // As above: where limitador-server's handler fails, OVER_LIMIT here.
                let denied = limitador.starts_with("error") && ratelimitd == "code 2";
                if denied {
                    unanswered += 1;
                } else if limitador != ratelimitd {
                    differ.push(format!("{entry:?} {descriptors:?} (RLS)\n  limitador:  {limitador}\n  ratelimitd: {ratelimitd}"));
                }
            }
        }
    }
    eprintln!("{unanswered} calls limitador-server left unanswered were denied here");
    differ
}

/// `body` POSTed to `/check_and_report` on `port`: the status and body, or
/// `None` when the connection closed unanswered.
fn posted(port: u16, body: &str) -> Option<(u16, String)> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let request = format!(
        "POST /check_and_report HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some((status, body.to_owned()))
}

/// limitador-server built from limitador's repository and this binary
/// started as limitador-server, on the limits of [`CEL_TABLE`]: every call
/// answered alike, over HTTP and `ShouldRateLimit`, but where
/// limitador-server cannot evaluate a condition (its handler panics and the
/// call goes unanswered: a proxy failing open allows it), which this
/// service answers with a denial. What this service
/// refuses at load ([`CEL_REFUSED`]) `rules validate` refuses, naming the
/// limit, and limitador-server never applies.
///
/// `LIMITADOR_SERVER=/path/to/limitador-server cargo nextest run --test limitador --run-ignored only`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs LIMITADOR_SERVER, a limitador-server built from limitador's repository"]
async fn cel_conditions_are_evaluated_as_limitador_server_evaluates_them() {
    let peer =
        std::env::var_os("LIMITADOR_SERVER").expect("LIMITADOR_SERVER: the path of a limitador-server");
    let peer = std::path::PathBuf::from(peer);
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("limitador-server");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_ratelimitd"), &link).unwrap();
    let memory = vec!["memory".to_owned()];

    let limits = dir.path().join("limits.yaml");
    std::fs::write(&limits, cel_limits(CEL_TABLE)).unwrap();
    let (_limitador, their_http, their_grpc) =
        start_as_limitador(&peer, &dir.path().join("limitador.log"), &limits, &memory);
    let (_ratelimitd, our_http, our_grpc) =
        start_as_limitador(&link, &dir.path().join("ratelimitd.log"), &limits, &memory);
    let differ = cel_differences(CEL_TABLE, (their_http, their_grpc), (our_http, our_grpc)).await;
    assert!(differ.is_empty(), "{} calls answered differently:\n{}", differ.len(), differ.join("\n"));

    let refused: Vec<(&str, &str)> = CEL_REFUSED.iter().map(|c| (*c, "")).collect();
    let limits = dir.path().join("refused.yaml");
    std::fs::write(&limits, cel_limits(&refused)).unwrap();
    for (n, source) in CEL_REFUSED.iter().enumerate() {
        let alone = dir.path().join(format!("refused-{n}.yaml"));
        std::fs::write(&alone, cel_limits(&[(source, "")])).unwrap();
        let validate = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
            .args(["rules", "validate", "--limitador"])
            .arg(&alone)
            .output()
            .unwrap();
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&validate.stdout),
            String::from_utf8_lossy(&validate.stderr)
        );
        assert!(!validate.status.success() && said.contains("limits[0]") && said.contains(source), "{said}");
    }
    let (_limitador, http, grpc) =
        start_as_limitador(&peer, &dir.path().join("limitador-refused.log"), &limits, &memory);
    let never = CEL_REFUSED.iter().map(|_| ("false", "")).collect::<Vec<_>>();
    let (_never, never_http, never_grpc) = {
        let limits = dir.path().join("never.yaml");
        std::fs::write(&limits, cel_limits(&never)).unwrap();
        start_as_limitador(&peer, &dir.path().join("limitador-never.log"), &limits, &memory)
    };
    let differ = cel_differences(&refused, (http, grpc), (never_http, never_grpc)).await;
    assert!(differ.is_empty(), "limitador-server applied what is refused here:\n{}", differ.join("\n"));
}

/// Kuadrant's wasm shim, as its calls go out of Envoy, played by an Envoy
/// Lua filter written anew (the shim's module is not at hand): before the
/// request, `CheckRateLimit` with one hit (OVER_LIMIT: 429; no answer:
/// 500); after the response, `Report` with the tokens the upstream says it
/// used (`usage.total_tokens` in its JSON body). gRPC framed by hand over
/// Envoy's HTTP/2 client.
const SHIM_LUA: &str = r#"
local function varint(n)
  local out = {}
  repeat
    local b = n % 128
    n = math.floor(n / 128)
    if n > 0 then b = b + 128 end
    out[#out + 1] = string.char(b)
  until n == 0
  return table.concat(out)
end
local function field(tag, bytes) return string.char(tag) .. varint(#bytes) .. bytes end
-- RateLimitRequest { domain = 1, descriptors = 2 { entries = 1 { key = 1, value = 2 } }, hits_addend = 3 }
local function request(user, hits)
  local entry = field(0x0a, "user") .. field(0x12, user)
  local message = field(0x0a, "llm") .. field(0x12, field(0x0a, entry)) .. string.char(0x18) .. varint(hits)
  local n = #message
  return string.char(0, math.floor(n / 16777216) % 256, math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256) .. message
end
-- The answer's overall_code (field 1, first when set), or nil without an answer.
local function call(handle, method, body)
  local headers, reply = handle:httpCall("ratelimit", {
    [":method"] = "POST", [":path"] = "/kuadrant.service.ratelimit.v1.RateLimitService/" .. method,
    [":authority"] = "ratelimit", ["content-type"] = "application/grpc", ["te"] = "trailers",
  }, body, 2000)
  if headers[":status"] ~= "200" or reply == nil or #reply < 5 then return nil end
  if #reply >= 7 and reply:byte(6) == 0x08 then return reply:byte(7) end
  return 0
end
function envoy_on_request(handle)
  local user = handle:headers():get("x-user-id") or ""
  local code = call(handle, "CheckRateLimit", request(user, 1))
  if code ~= 1 then
    handle:respond({[":status"] = (code == 2) and "429" or "500"}, "")
    return
  end
  handle:streamInfo():dynamicMetadata():set("kuadrant", "user", user)
end
function envoy_on_response(handle)
  local checked = handle:streamInfo():dynamicMetadata():get("kuadrant")
  if checked == nil then return end
  local body = handle:body()
  local tokens = tonumber(string.match(body:getBytes(0, body:length()), '"total_tokens"%s*:%s*(%d+)')) or 0
  if call(handle, "Report", request(checked["user"], tokens)) ~= 1 then
    handle:logErr("the report was not counted")
  end
end
"#;

/// An upstream that answers like a model API: its JSON body says how many
/// tokens the request used (the request's `x-tokens` header).
fn token_upstream(dir: &std::path::Path) -> (Process, u16) {
    common::scripted_upstream(
        dir,
        "tokens",
        "    def do_POST(self):\n\
         \x20       body = ('{\"usage\": {\"total_tokens\": %s}}' % int(self.headers['x-tokens'])).encode()\n\
         \x20       self.send_response(200)\n\
         \x20       self.send_header('Content-Type', 'application/json')\n\
         \x20       self.send_header('Content-Length', str(len(body)))\n\
         \x20       self.end_headers()\n\
         \x20       self.wfile.write(body)\n",
    )
}

/// Envoy with the shim's calls (`SHIM_LUA`) in front of `backend`.
fn shim_envoy_config(listen: u16, admin: u16, ratelimit: u16, backend: u16) -> String {
    let lua: String = SHIM_LUA.lines().map(|line| format!("\n                          {line}")).collect();
    let filter = format!(
        r#"
                  - name: envoy.filters.http.lua
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua
                      default_source_code:
                        inline_string: |{lua}"#
    );
    envoy_yaml([listen, admin, ratelimit, backend], &filter, "")
}

/// Kuadrant's token flow through a real Envoy: each request is checked
/// (one hit, nothing counted) before it goes upstream and the tokens its
/// response used are reported after it, on Redis. ann's 60, 39 and 5
/// tokens pass (99 used when the third is checked) and are all counted
/// (104 of 100), so her next request is refused before it reaches the
/// upstream; bob's is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kuadrants_check_then_report_flow_through_envoy() {
    let (_redis, dir, server) = serving_token_limit().await;
    let (_upstream, backend) = token_upstream(dir.path());
    let (envoy, listen) = start_envoy(dir.path(), |listen, admin| {
        shim_envoy_config(listen, admin, server.addr.port(), backend)
    });
    let _envoy = Process(envoy);
    let send = |user: &str, tokens: u32| {
        let tokens = tokens.to_string();
        http_raw(
            listen,
            "POST",
            "/v1/chat",
            &[("x-user-id", user.as_bytes()), ("x-tokens", tokens.as_bytes())],
        )
    };
    for tokens in [60, 39, 5] {
        let answer = send("ann", tokens);
        assert_eq!(answer.status, 200, "{tokens} tokens: {:?}", answer.headers);
        assert!(answer.body.contains(&format!("\"total_tokens\": {tokens}")), "{}", answer.body);
    }
    assert_eq!(send("ann", 1).status, 429, "104 of 100 tokens used: checked and refused");
    assert_eq!(send("bob", 1).status, 200, "bob's tokens are his own");
    server.stop().await.unwrap();
    let log = std::fs::read_to_string(dir.path().join("envoy.log")).unwrap_or_default();
    assert!(!log.contains("the report was not counted"), "{log}");
}
