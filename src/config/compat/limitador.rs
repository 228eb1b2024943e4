//! Kuadrant limitador's environment, honoured when
//! `RATELIMITD_COMPAT=limitador` (and when the binary runs as
//! `limitador-server`, whose command line sets the same variables): a
//! limitador deployment's variables become the `RATELIMITD__…` variables
//! they stand for, never over one already set.
//!
//! - `LIMITS_FILE` → `rules.limitador_path` (required: limitador does not
//!   start without one either).
//! - `ENVOY_RLS_HOST`/`ENVOY_RLS_PORT` (`0.0.0.0:8081`) → `grpc.listen`;
//!   `HTTP_API_HOST`/`HTTP_API_PORT` (`0.0.0.0:8080`) → `http.listen`.
//! - `REDIS_URL` → `redis.url`; unset, counters are in memory (limitador's
//!   `memory` storage). `REDIS_LOCAL_CACHE_*` has no equivalent: every
//!   decision is exact (reported at start).
//! - `RATE_LIMIT_HEADERS` (`NONE` or `DRAFT_VERSION_03`) → the
//!   `envoy.response_headers` family with limitador's `X-RateLimit-*`
//!   names.
//! - `TRACING_ENDPOINT` (`rpc://host:4317`, OTLP/gRPC) →
//!   `telemetry.otlp_endpoint`.
//! - `LIMIT_NAME_IN_PROMETHEUS_LABELS=1` →
//!   `envoy.upstream_metrics_limit_name` (`limited_calls` by `limit_name`).
//! - `DISK_PATH` (limitador's disk storage) refuses to start: counts kept
//!   on one instance's disk are not served here.
//!
//! As for envoyproxy/ratelimit's compat mode: shedding in shadow, the
//! failure policy local (limitador answers UNAVAILABLE; `envoy.failure_mode:
//! unavailable` gives its answer).

use std::collections::HashMap;

use super::{ConfigError, Out, invalid};

/// limitador variables ratelimitd reads nothing from, and why.
pub(super) const IGNORED: &[(&str, &str)] = &[
    ("REDIS_LOCAL_CACHE_ENABLED", "no local counter cache: every decision is exact in Redis"),
    ("REDIS_LOCAL_CACHE_FLUSHING_PERIOD_MS", "no local counter cache: every decision is exact in Redis"),
    ("REDIS_LOCAL_CACHE_BATCH_SIZE", "no local counter cache: every decision is exact in Redis"),
    ("DISK_OPTIMIZE", "no disk storage"),
    ("--custom-metric-labels", "decisions are counted per limit key in ratelimitd's own metrics"),
    ("--metric-labels-default", "decisions are counted per limit key in ratelimitd's own metrics"),
    ("--grpc-reflection-service", "gRPC reflection is always served"),
    ("--cache", "the memory store is sized by memory.max_counters"),
    ("--max-cached", "no local counter cache: every decision is exact in Redis"),
    ("--response-timeout", "Redis calls time out after redis.timeout_ms"),
];

/// Read access to limitador's variables: unset and empty are the same.
fn get<'e>(env: &'e HashMap<String, String>, name: &str) -> Option<&'e str> {
    env.get(name).map(String::as_str).filter(|v| !v.is_empty())
}

/// limitador's variables in `env` as `RATELIMITD__…` settings.
pub(super) fn translate(env: &HashMap<String, String>, out: &mut Out) -> Result<(), ConfigError> {
    if get(env, "DISK_PATH").is_some() {
        return Err(invalid(
            "DISK_PATH",
            "limitador's disk storage is not supported: use REDIS_URL, or memory",
        ));
    }
    let limits = get(env, "LIMITS_FILE")
        .ok_or_else(|| invalid("LIMITS_FILE", "must be set (limitador's limits file)"))?;
    out.push(("rules.limitador_path", limits.to_owned()));
    out.push(("rules.examples", "false".to_owned()));
    for (host, port, default_port, key) in [
        ("ENVOY_RLS_HOST", "ENVOY_RLS_PORT", "8081", "grpc.listen"),
        ("HTTP_API_HOST", "HTTP_API_PORT", "8080", "http.listen"),
    ] {
        let number = get(env, port).unwrap_or(default_port);
        number.parse::<u16>().map_err(|_| invalid(port, format!("{number:?} is not a port")))?;
        let address = get(env, host).unwrap_or("0.0.0.0");
        let address = if address.contains(':') { format!("[{address}]") } else { address.to_owned() };
        out.push((key, format!("{address}:{number}")));
    }
    if let Some(url) = get(env, "REDIS_URL") {
        out.push(("redis.url", url.to_owned()));
    }
    headers(env, out)?;
    // Enabled by "1" only, as limitador reads it.
    if get(env, "LIMIT_NAME_IN_PROMETHEUS_LABELS") == Some("1") {
        out.push(("envoy.upstream_metrics_limit_name", "true".to_owned()));
    }
    if let Some(endpoint) = get(env, "TRACING_ENDPOINT") {
        let endpoint =
            endpoint.strip_prefix("rpc://").map_or_else(|| endpoint.to_owned(), |e| format!("http://{e}"));
        out.push(("telemetry.otlp_endpoint", endpoint));
        out.push(("telemetry.service_name", "limitador".to_owned()));
    }
    out.push(("shed.mode", "shadow".to_owned()));
    Ok(())
}

/// `RATE_LIMIT_HEADERS`: `NONE` (limitador's default) or
/// `DRAFT_VERSION_03`.
fn headers(env: &HashMap<String, String>, out: &mut Out) -> Result<(), ConfigError> {
    match get(env, "RATE_LIMIT_HEADERS").unwrap_or("NONE") {
        "NONE" => out.push(("envoy.response_headers", "false".to_owned())),
        "DRAFT_VERSION_03" => {
            out.push(("envoy.response_headers", "true".to_owned()));
            out.push(("envoy.response_headers_format", "draft03".to_owned()));
            out.push(("envoy.limit_header", "X-RateLimit-Limit".to_owned()));
            out.push(("envoy.remaining_header", "X-RateLimit-Remaining".to_owned()));
            out.push(("envoy.reset_header", "X-RateLimit-Reset".to_owned()));
        }
        other => {
            return Err(invalid(
                "RATE_LIMIT_HEADERS",
                format!("{other:?}: expected NONE or DRAFT_VERSION_03"),
            ));
        }
    }
    Ok(())
}
