//! The translation of upstream's variables, variable by variable.

use super::*;

fn env_of(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    env(pairs)
}

fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
}

/// TLS asked for with a certificate variable misspelt (or unset) does
/// not serve plaintext: the start is refused, naming the variable.
#[test]
fn tls_asked_for_without_its_files_is_refused() {
    for (missing, set) in
        [("GRPC_SERVER_TLS_CERT", "GRPC_SERVER_TLS_KEY"), ("GRPC_SERVER_TLS_KEY", "GRPC_SERVER_TLS_CERT")]
    {
        let mut bad = env(&[
            (COMPAT_VAR, ENVOYPROXY),
            ("GRPC_SERVER_USE_TLS", "true"),
            (set, "/tls/file.pem"),
            ("GRPC_SERVER_TLS_CRT", "/tls/misspelt.pem"),
        ]);
        let error = apply(&mut bad).unwrap_err().to_string();
        assert!(error.contains(missing), "{error}");
    }
    let (env, _) = translated(&[
        (COMPAT_VAR, ENVOYPROXY),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/tls/cert.pem"),
        ("GRPC_SERVER_TLS_KEY", "/tls/key.pem"),
    ]);
    assert_eq!(env.get("RATELIMITD__GRPC__TLS__CERT_FILE").map(String::as_str), Some("/tls/cert.pem"));
    let (env, _) = translated(&[
        (COMPAT_VAR, ENVOYPROXY),
        ("GRPC_SERVER_USE_TLS", "true"),
        ("GRPC_SERVER_TLS_CERT", "/tls/cert.pem"),
        ("GRPC_SERVER_TLS_KEY", "/tls/key.pem"),
        ("GRPC_CLIENT_TLS_CACERT", "/tls/ca.pem"),
        ("GRPC_CLIENT_TLS_SAN", "gateway.internal"),
    ]);
    assert_eq!(env.get("RATELIMITD__GRPC__TLS__CLIENT_SAN").map(String::as_str), Some("gateway.internal"));
}

fn translated(pairs: &[(&str, &str)]) -> (HashMap<String, String>, Compat) {
    let mut env = env(pairs);
    let compat = apply(&mut env).unwrap();
    (env, compat)
}

/// Upstream's tracing variables as Envoy Gateway's Deployment sets them:
/// OTLP/HTTP by default, the resource attributes, the rate; without
/// `TRACING_ENABLED` the endpoint variable exports nothing.
#[test]
fn tracing_follows_upstream() {
    use crate::telemetry::settings::OtlpProtocol;
    let load = |pairs: &[(&str, &str)]| crate::config::Config::load(None, env(pairs)).map(|c| c.telemetry);
    let t = load(&[
        (COMPAT_VAR, ENVOYPROXY),
        ("TRACING_ENABLED", "true"),
        ("TRACING_SERVICE_NAME", "envoy-ratelimit"),
        ("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system"),
        ("TRACING_SERVICE_INSTANCE_ID", "envoy-ratelimit-7d9f-abcde"),
        ("TRACING_SAMPLING_RATE", "0.5"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://otel-svc.observability:4318"),
    ])
    .unwrap();
    assert_eq!(t.otlp_protocol, OtlpProtocol::HttpProtobuf);
    assert_eq!(t.otlp_endpoint.as_deref(), Some("http://otel-svc.observability:4318"));
    assert_eq!(t.service_name, "envoy-ratelimit");
    assert_eq!(t.service_namespace.as_deref(), Some("envoy-gateway-system"));
    assert_eq!(t.service_instance_id.as_deref(), Some("envoy-ratelimit-7d9f-abcde"));
    assert_eq!(t.sampling_ratio, 0.5);

    let t =
        load(&[(COMPAT_VAR, ENVOYPROXY), ("TRACING_ENABLED", "1"), ("TRACING_EXPORTER_PROTOCOL", "grpc")])
            .unwrap();
    assert_eq!(t.otlp_protocol, OtlpProtocol::Grpc);
    assert_eq!(t.otlp_endpoint.as_deref(), Some("http://localhost:4317"), "the protocol's default");
    assert_eq!(t.service_name, "RateLimit", "upstream's default");

    let t =
        load(&[(COMPAT_VAR, ENVOYPROXY), ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")]).unwrap();
    assert_eq!(t.otlp_endpoint, None, "not enabled: nothing exported");

    let error = load(&[
        (COMPAT_VAR, ENVOYPROXY),
        ("TRACING_ENABLED", "true"),
        ("TRACING_EXPORTER_PROTOCOL", "zipkin"),
    ])
    .unwrap_err()
    .to_string();
    assert!(error.contains("TRACING_EXPORTER_PROTOCOL") && error.contains("zipkin"), "{error}");
}

/// `USE_PROMETHEUS` serves `/metrics` on `PROMETHEUS_ADDR` too, as
/// Envoy Gateway's Deployment scrapes it (`:19001`).
#[test]
fn prometheus_addr_is_a_metrics_listener() {
    let load = |pairs: &[(&str, &str)]| crate::config::Config::load(None, env(pairs)).map(|c| c.http);
    let http = load(&[(COMPAT_VAR, ENVOYPROXY), ("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", ":19001")]);
    assert_eq!(http.unwrap().metrics_listen.as_deref(), Some("0.0.0.0:19001"));
    let http = load(&[(COMPAT_VAR, ENVOYPROXY), ("USE_PROMETHEUS", "true")]).unwrap();
    assert_eq!(http.metrics_listen.as_deref(), Some("0.0.0.0:9090"), "upstream's default");
    assert_eq!(
        load(&[(COMPAT_VAR, ENVOYPROXY), ("PROMETHEUS_ADDR", ":19001")]).unwrap().metrics_listen,
        None
    );
    let error = load(&[(COMPAT_VAR, ENVOYPROXY), ("USE_PROMETHEUS", "true"), ("PROMETHEUS_ADDR", ":8080")])
        .unwrap_err()
        .to_string();
    assert!(error.contains("http.metrics_listen") && error.contains("http.listen"), "{error}");
}

#[test]
fn nothing_happens_without_the_switch() {
    let (env, compat) = translated(&[("REDIS_URL", "redis:6379"), ("SHADOW_MODE", "true")]);
    assert_eq!(env.len(), 2);
    assert_eq!(compat, Compat::default());
    let mut bad = self::env(&[(COMPAT_VAR, "lyft")]);
    assert!(apply(&mut bad).unwrap_err().to_string().contains(COMPAT_VAR));
}

#[test]
fn an_upstream_deployment_translates() {
    let (env, compat) = translated(&[
        (COMPAT_VAR, ENVOYPROXY),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", "redis.internal:6379"),
        ("REDIS_AUTH", "user:s3cret"),
        ("REDIS_TIMEOUT", "150ms"),
        ("CACHE_KEY_PREFIX", "team-a:"),
        ("RUNTIME_ROOT", "/data"),
        ("RUNTIME_SUBDIRECTORY", "ratelimit"),
        ("PORT", "9080"),
        ("GRPC_PORT", "9081"),
        ("GRPC_MAX_CONNECTION_AGE", "1h30m"),
        ("SHADOW_MODE", "True"),
        ("MERGE_DOMAIN_CONFIG", "true"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "1"),
        ("NEAR_LIMIT_RATIO", "0.9"),
        ("LOG_LEVEL", "WARN"),
        ("LOG_FORMAT", "json"),
        ("USE_STATSD", "false"),
        ("REDIS_POOL_SIZE", "10"),
        ("RATELIMITD__GRPC__LISTEN", "127.0.0.1:7000"),
    ]);
    let get = |k: &str| env.get(k).map(String::as_str);
    assert_eq!(get("RATELIMITD__REDIS__URL"), Some("redis://redis.internal:6379"));
    assert_eq!(get("RATELIMITD__REDIS__PASSWORD"), Some("s3cret"));
    assert_eq!(get("RATELIMITD__REDIS__USERNAME"), Some("user"), "an ACL user is sent too");
    assert_eq!(get("RATELIMITD__REDIS__TIMEOUT_MS"), Some("150"));
    assert_eq!(get("RATELIMITD__REDIS__KEY_PREFIX"), Some("team-a:"));
    assert_eq!(get("RATELIMITD__RULES__ENVOY_PATH"), Some("/data/ratelimit/config"));
    assert_eq!(get("RATELIMITD__HTTP__LISTEN"), Some("0.0.0.0:9080"));
    assert_eq!(get("RATELIMITD__GRPC__MAX_CONNECTION_AGE_MS"), Some("5400000"));
    assert_eq!(get("RATELIMITD__GRPC__LISTEN"), Some("127.0.0.1:7000"), "an explicit key wins");
    assert_eq!(get("RATELIMITD__ENVOY__SHADOW_MODE"), Some("true"));
    assert_eq!(get("RATELIMITD__ENVOY__MERGE_DOMAINS"), Some("true"));
    assert_eq!(get("RATELIMITD__ENVOY__RESPONSE_HEADERS"), Some("true"));
    assert_eq!(get("RATELIMITD__ENVOY__LIMIT_HEADER"), Some("RateLimit-Limit"));
    assert_eq!(get("RATELIMITD__ENVOY__NEAR_LIMIT_RATIO"), Some("0.9"));
    assert_eq!(get("RATELIMITD__LOG__LEVEL"), Some("warn"));
    assert_eq!(get("RATELIMITD__LOG__FORMAT"), Some("json"));
    assert_eq!(compat.ignored.iter().map(|(n, _)| *n).collect::<Vec<_>>(), ["REDIS_POOL_SIZE"]);
}

#[test]
fn upstream_defaults_apply() {
    let (env, _) = translated(&[(COMPAT_VAR, ENVOYPROXY)]);
    let get = |k: &str| env.get(k).map(String::as_str);
    assert_eq!(get("RATELIMITD__REDIS__URL"), Some("unix:///var/run/nutcracker/ratelimit.sock"));
    assert_eq!(get("RATELIMITD__RULES__ENVOY_PATH"), Some("/srv/runtime_data/current/config"));
    assert_eq!(get("RATELIMITD__HTTP__LISTEN"), None, "ours is upstream's 0.0.0.0:8080 already");
    assert_eq!(
        get("RATELIMITD__TELEMETRY__STATSD_ADDR"),
        Some("localhost:8125"),
        "USE_STATSD is on by default"
    );
    // Upstream's decisions by default; ours one variable away.
    assert_eq!(get("RATELIMITD__ENVOY__ALGORITHM"), Some("fixed_window"));
    assert_eq!(get("RATELIMITD__ENVOY__ZERO_HITS"), Some("within_limit"));
    assert_eq!(get("RATELIMITD__ENVOY__HITS_COUNTED"), Some("always"));
    assert_eq!(get("RATELIMITD__SHED__MODE"), Some("shadow"), "upstream never sheds");
    let (env, _) =
        translated(&[(COMPAT_VAR, ENVOYPROXY), ("RATELIMITD__ENVOY__ALGORITHM", "sliding_window")]);
    assert_eq!(env["RATELIMITD__ENVOY__ALGORITHM"], "sliding_window");
    let (env, compat) = translated(&[
        (COMPAT_VAR, ENVOYPROXY),
        ("REDIS_TYPE", "cluster"),
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_TLS", "true"),
        ("REDIS_URL", "a:7000,b:7001"),
        ("STATSD_HOST", "exporter"),
        ("EXTRA_TAGS", "a:b"),
    ]);
    assert_eq!(env["RATELIMITD__REDIS__URL"], "rediss://a:7000,rediss://b:7001");
    assert_eq!(env["RATELIMITD__REDIS__CLUSTER"], "true");
    assert_eq!(env["RATELIMITD__TELEMETRY__STATSD_ADDR"], "exporter:8125");
    assert_eq!(compat.ignored.iter().map(|(n, _)| *n).collect::<Vec<_>>(), ["EXTRA_TAGS"]);
    let (env, _) = translated(&[
        (COMPAT_VAR, ENVOYPROXY),
        ("REDIS_TYPE", "sentinel"),
        ("REDIS_URL", "mymaster,s1:26379,s2:26379"),
        ("REDIS_SENTINEL_AUTH", "sentinel-secret"),
        ("REDIS_AUTH", "master-secret"),
    ]);
    assert_eq!(env["RATELIMITD__REDIS__SENTINEL_MASTER"], "mymaster");
    assert_eq!(env["RATELIMITD__REDIS__URL"], "redis://s1:26379,redis://s2:26379");
    assert_eq!(env["RATELIMITD__REDIS__SENTINEL_PASSWORD"], "sentinel-secret");
    assert_eq!(env["RATELIMITD__REDIS__PASSWORD"], "master-secret");
    let (env, _) = translated(&[
        (COMPAT_VAR, ENVOYPROXY),
        ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
        ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
        ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
        ("CONFIG_GRPC_XDS_NODE_METADATA", "zone=a,team=edge"),
        ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
        ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
        ("FORCE_START_WITHOUT_INITIAL_CONFIG", "true"),
    ]);
    assert_eq!(env["RATELIMITD__RULES__SOURCE"], "xds");
    assert_eq!(env["RATELIMITD__RULES__XDS__SERVER_URL"], "https://envoy-gateway:18001");
    assert_eq!(env["RATELIMITD__RULES__XDS__NODE_ID"], "envoy-ratelimit");
    assert_eq!(env["RATELIMITD__RULES__XDS__NODE_METADATA__ZONE"], "a");
    assert_eq!(env["RATELIMITD__RULES__XDS__CA_FILE"], "/certs/ca.crt");
    assert_eq!(env["RATELIMITD__RULES__XDS__FORCE_START"], "true");
    assert!(!env.contains_key("RATELIMITD__RULES__ENVOY_PATH"), "no runtime directory with xDS");
    let config = crate::config::Config::load(None, env).unwrap();
    assert_eq!(config.rules.xds.node_metadata["zone"], "a");
    let mut alone =
        env_of(&[(COMPAT_VAR, ENVOYPROXY), ("REDIS_TYPE", "sentinel"), ("REDIS_URL", "mymaster")]);
    assert!(apply(&mut alone).unwrap_err().to_string().contains("REDIS_URL"));
}

#[test]
fn what_would_change_decisions_refuses_to_start_naming_the_variable() {
    for (name, value) in [
        ("BACKEND_TYPE", "memcache"),
        ("CONFIG_TYPE", "REST"),
        ("REDIS_TYPE", "sentinel-ish"),
        ("REDIS_TIMEOUT", "soon"),
        ("SHADOW_MODE", "yes"),
        ("PORT", "http"),
        ("REDIS_SOCKET_TYPE", "udp"),
        ("LOG_LEVEL", "loud"),
    ] {
        let mut env = env(&[(COMPAT_VAR, ENVOYPROXY), (name, value)]);
        let error = apply(&mut env).unwrap_err().to_string();
        assert!(error.contains(name), "{name}={value}: {error}");
    }
}
