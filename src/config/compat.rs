//! envoyproxy/ratelimit's environment, honoured when
//! `RATELIMITD_COMPAT=envoyproxy`: an upstream deployment's variables
//! (`REDIS_URL`, `RUNTIME_ROOT`, `SHADOW_MODE`, …) become the
//! `RATELIMITD__…` variables they stand for, so its manifests run
//! unchanged.
//!
//! Precedence: an explicit `RATELIMITD__…` variable beats the upstream one
//! it would come from, and both beat the file. Upstream's defaults apply
//! where they differ from ours and matter to a client: the Envoy rules
//! directory (`/srv/runtime_data/current/config`), the Redis address (its
//! Unix socket), the `RateLimit-*` header names. A value that does not
//! parse is an error naming the variable; a variable that is set but has
//! no equivalent is reported once at start, by name, with why
//! ([`Compat::ignored`]); one whose absence would change decisions
//! (`BACKEND_TYPE=memcache`, `CONFIG_TYPE=GRPC_XDS_SOTW`) refuses to
//! start.

use std::collections::HashMap;

use super::{ConfigError, ENV_PREFIX, invalid};

/// The variable that turns the translation on.
pub const COMPAT_VAR: &str = "RATELIMITD_COMPAT";

/// Its value for envoyproxy/ratelimit's environment.
pub const ENVOYPROXY: &str = "envoyproxy";

/// Its value for Kuadrant limitador's environment.
pub const LIMITADOR: &str = "limitador";

/// Upstream variables ratelimitd reads nothing from, and why.
const IGNORED: &[(&str, &str)] = &[
    ("DEBUG_HOST", "no debug listener: metrics are on PORT's /metrics"),
    ("DEBUG_PORT", "no debug listener: metrics are on PORT's /metrics"),
    (
        "PROMETHEUS_PATH",
        "metrics are served at /metrics (on PORT, and on PROMETHEUS_ADDR with USE_PROMETHEUS)",
    ),
    ("PROMETHEUS_MAPPER_YAML", "the default mapping's names are served; a custom mapping is not read"),
    ("PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS", "response times are ratelimitd_decision_duration_seconds"),
    ("USE_DOG_STATSD", "plain statsd only: the same counters are on /metrics"),
    ("USE_DOG_STATSD_MOGRIFIERS", "plain statsd only"),
    ("EXTRA_TAGS", "plain statsd names carry no tags"),
    (
        "GRPC_MAX_CONNECTION_AGE_GRACE",
        "an aged connection gets a GOAWAY and closes once its calls finish: never cut off",
    ),
    ("REDIS_POOL_SIZE", "not needed: each connection coalesces its queued decisions (redis.connections)"),
    ("REDIS_PIPELINE_WINDOW", "not needed: concurrent decisions are always coalesced, with no added wait"),
    ("REDIS_PIPELINE_LIMIT", "not needed: concurrent decisions are always coalesced"),
    ("REDIS_CLUSTER_PIPELINE_PARALLELISM", "not needed: concurrent decisions are always coalesced"),
    ("REDIS_HEALTH_CHECK_ACTIVE_CONNECTION", "the store is always health-checked (/readyz)"),
    ("REDIS_POOL_ON_EMPTY_BEHAVIOR", "a decision waits for a connection up to REDIS_TIMEOUT"),
    ("REDIS_STARTUP_INITIAL_INTERVAL", "the service starts without Redis and fails decisions by policy"),
    ("REDIS_STARTUP_MAX_INTERVAL", "the service starts without Redis and fails decisions by policy"),
    ("REDIS_STARTUP_MAX_ELAPSED_TIME", "the service starts without Redis and fails decisions by policy"),
    ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "the Redis certificate's name is always verified"),
    ("REDIS_PERSECOND", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_SOCKET_TYPE", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_TYPE", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_URL", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_POOL_SIZE", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_AUTH", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_TLS", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_SENTINEL_AUTH", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_PIPELINE_WINDOW", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_PIPELINE_LIMIT", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_TIMEOUT", "per-second limits are counted in the one Redis"),
    ("REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR", "per-second limits are counted in the one Redis"),
    ("LOCAL_CACHE_SIZE_IN_BYTES", "no local over-limit cache: every decision is exact"),
    ("EXPIRATION_JITTER_MAX_SECONDS", "counters expire two windows after their last hit"),
    ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "always: a refused hit never counts"),
    ("RUNTIME_IGNOREDOTFILES", "dot files are always ignored"),
    ("RUNTIME_WATCH_ROOT", "the resolved files are always watched (symlink swaps included)"),
    ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "the service is ready once the store answers (/readyz)"),
    (
        "GRPC_SERVER_TLS_CA_CERT",
        "not an upstream setting (Envoy Gateway sets it; upstream reads none): client certificates are required \
         with GRPC_CLIENT_TLS_CACERT",
    ),
    ("MEMCACHE_HOST_PORT", "no memcached backend"),
    ("MEMCACHE_MAX_IDLE_CONNS", "no memcached backend"),
    ("MEMCACHE_SRV", "no memcached backend"),
    ("MEMCACHE_SRV_REFRESH", "no memcached backend"),
    ("MEMCACHE_TLS", "no memcached backend"),
    ("MEMCACHE_TLS_CLIENT_CERT", "no memcached backend"),
    ("MEMCACHE_TLS_CLIENT_KEY", "no memcached backend"),
    ("MEMCACHE_TLS_CACERT", "no memcached backend"),
    ("MEMCACHE_TLS_SKIP_HOSTNAME_VERIFICATION", "no memcached backend"),
    ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR", "the reconnect back-off is jittered by up to half"),
    ("XDS_CLIENT_BACKOFF_JITTER", "the reconnect back-off is always jittered"),
];

/// Upstream's defaults of the variables translated below.
const RUNTIME_ROOT: &str = "/srv/runtime_data/current";
const RUNTIME_APPDIRECTORY: &str = "config";
const REDIS_URL: &str = "/var/run/nutcracker/ratelimit.sock";

/// What the translation did not carry over.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Compat {
    /// Upstream variables that were set but have no effect, each with why.
    pub ignored: Vec<(&'static str, &'static str)>,
    /// Started as envoyproxy/ratelimit (`RATELIMITD_COMPAT=envoyproxy`):
    /// its answers where they are not settings (before any configuration).
    pub envoyproxy: bool,
}

/// With `RATELIMITD_COMPAT=envoyproxy` (or `limitador`) in `env`, adds
/// the `RATELIMITD__…` variables upstream's (limitador's) stand for, never
/// over one already set, and returns what it ignored; without it, leaves
/// `env` alone. Any other value of `RATELIMITD_COMPAT` is an error.
pub fn apply(env: &mut HashMap<String, String>) -> Result<Compat, ConfigError> {
    let mut out = Vec::new();
    let (ignored, tracing) = match env.get(COMPAT_VAR).map(String::as_str) {
        None | Some("") => return Ok(Compat::default()),
        Some(ENVOYPROXY) => envoyproxy(env, &mut out)?,
        Some(LIMITADOR) => {
            limitador::translate(env, &mut out)?;
            (set(env, limitador::IGNORED), true)
        }
        Some(other) => {
            return Err(invalid(
                COMPAT_VAR,
                format!("{other:?}: the values are {ENVOYPROXY:?} and {LIMITADOR:?}"),
            ));
        }
    };
    for (key, value) in out {
        let name = format!("{ENV_PREFIX}__{}", key.replace('.', "__").to_uppercase());
        env.entry(name).or_insert(value);
    }
    if !tracing {
        for name in OTEL_ENDPOINTS {
            env.remove(name);
        }
    }
    let envoyproxy = env.get(COMPAT_VAR).is_some_and(|mode| mode == ENVOYPROXY);
    Ok(Compat { ignored, envoyproxy })
}

/// The variables of `list` set in `env`, each with why it is ignored.
fn set(
    env: &HashMap<String, String>,
    list: &[(&'static str, &'static str)],
) -> Vec<(&'static str, &'static str)> {
    let upstream = Upstream { env };
    list.iter().filter(|(name, _)| upstream.get(name).is_some()).copied().collect()
}

/// envoyproxy/ratelimit's variables into `out`: what it ignored, and
/// whether tracing is on.
fn envoyproxy(env: &HashMap<String, String>, out: &mut Out) -> Result<(Vec<Ignored>, bool), ConfigError> {
    let upstream = Upstream { env };
    refuse_unsupported(&upstream)?;
    listeners(&upstream, out)?;
    if upstream.get("CONFIG_TYPE").is_some_and(|k| k.eq_ignore_ascii_case("GRPC_XDS_SOTW")) {
        xds(&upstream, out)?;
    } else {
        runtime(&upstream, out);
    }
    redis(&upstream, out)?;
    grpc_tls(&upstream, out)?;
    envoy(&upstream, out)?;
    logging(&upstream, out)?;
    let tracing = tracing(&upstream, out)?;
    statsd(&upstream, out)?;
    Ok((set(env, IGNORED), tracing))
}

/// Read access to upstream's variables: unset and empty are the same, as
/// for its `envconfig`.
struct Upstream<'a> {
    env: &'a HashMap<String, String>,
}

impl Upstream<'_> {
    fn get(&self, name: &str) -> Option<&str> {
        self.env.get(name).map(String::as_str).filter(|v| !v.is_empty())
    }

    /// A Go `strconv.ParseBool` value.
    fn flag(&self, name: &'static str) -> Result<Option<bool>, ConfigError> {
        self.get(name)
            .map(|v| match v {
                "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
                "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
                _ => Err(invalid(name, format!("{v:?} is not a boolean"))),
            })
            .transpose()
    }

    /// A Go duration (`10s`, `500ms`, `1m30s`) in ms.
    fn millis(&self, name: &'static str) -> Result<Option<u64>, ConfigError> {
        self.get(name)
            .map(|v| {
                humantime::parse_duration(v)
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
                    .map_err(|e| invalid(name, format!("{v:?} is not a duration: {e}")))
            })
            .transpose()
    }
}

type Out = Vec<(&'static str, String)>;

/// A variable that has no effect, and why.
type Ignored = (&'static str, &'static str);

/// What would change decisions if it were silently ignored.
fn refuse_unsupported(up: &Upstream<'_>) -> Result<(), ConfigError> {
    if let Some(backend) = up.get("BACKEND_TYPE")
        && !backend.eq_ignore_ascii_case("redis")
    {
        return Err(invalid("BACKEND_TYPE", format!("{backend:?} is not supported: only redis")));
    }
    if let Some(kind) = up.get("CONFIG_TYPE")
        && !kind.eq_ignore_ascii_case("FILE")
        && !kind.eq_ignore_ascii_case("GRPC_XDS_SOTW")
    {
        return Err(invalid("CONFIG_TYPE", format!("{kind:?}: expected FILE or GRPC_XDS_SOTW")));
    }
    if let Some(kind) = up.get("REDIS_TYPE")
        && !["single", "cluster", "sentinel"].iter().any(|k| kind.eq_ignore_ascii_case(k))
    {
        return Err(invalid("REDIS_TYPE", format!("{kind:?}: expected SINGLE, cluster or sentinel")));
    }
    Ok(())
}

/// `HOST`/`PORT` (upstream's HTTP listener: health and, here, metrics),
/// `GRPC_HOST`/`GRPC_PORT`, `GRPC_UDS` (served beside the port), and
/// `GRPC_MAX_CONNECTION_AGE` when set (upstream's 24 h default is not
/// carried over: ours is never), and with `USE_PROMETHEUS` its
/// `PROMETHEUS_ADDR` (`:9090` by default) as a listener of `/metrics`.
fn listeners(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    if let Some(path) = up.get("GRPC_UDS") {
        out.push(("grpc.uds", path.to_owned()));
    }
    if let Some(ms) = up.millis("GRPC_MAX_CONNECTION_AGE")? {
        out.push(("grpc.max_connection_age_ms", ms.to_string()));
    }
    if up.flag("USE_PROMETHEUS")? == Some(true) {
        let addr = up.get("PROMETHEUS_ADDR").unwrap_or(":9090");
        let addr = if addr.starts_with(':') { format!("0.0.0.0{addr}") } else { addr.to_owned() };
        addr.parse::<std::net::SocketAddr>()
            .map_err(|_| invalid("PROMETHEUS_ADDR", format!("{addr:?} is not [ip]:port")))?;
        out.push(("http.metrics_listen", addr));
    }
    for (host, port, default_port, key) in
        [("HOST", "PORT", "8080", "http.listen"), ("GRPC_HOST", "GRPC_PORT", "8081", "grpc.listen")]
    {
        if up.get(host).is_none() && up.get(port).is_none() {
            continue;
        }
        let number = up.get(port).unwrap_or(default_port);
        number.parse::<u16>().map_err(|_| invalid(port, format!("{number:?} is not a port")))?;
        let address = up.get(host).unwrap_or("0.0.0.0");
        let address = if address.contains(':') { format!("[{address}]") } else { address.to_owned() };
        out.push((key, format!("{address}:{number}")));
    }
    Ok(())
}

/// `CONFIG_TYPE=GRPC_XDS_SOTW`: the management server and this node.
fn xds(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    out.push(("rules.source", "xds".to_owned()));
    let tls = up.flag("CONFIG_GRPC_XDS_SERVER_USE_TLS")? == Some(true);
    let server = up.get("CONFIG_GRPC_XDS_SERVER_URL").unwrap_or("localhost:18000");
    let scheme = if tls { "https" } else { "http" };
    out.push(("rules.xds.server_url", format!("{scheme}://{server}")));
    if let Some(id) = up.get("CONFIG_GRPC_XDS_NODE_ID") {
        out.push(("rules.xds.node_id", id.to_owned()));
    }
    if tls {
        for (name, key) in [
            ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "rules.xds.ca_file"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "rules.xds.cert_file"),
            ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "rules.xds.key_file"),
            ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "rules.xds.server_name"),
        ] {
            if let Some(value) = up.get(name) {
                out.push((key, value.to_owned()));
            }
        }
    }
    if let Some(on) = up.flag("FORCE_START_WITHOUT_INITIAL_CONFIG")? {
        out.push(("rules.xds.force_start", on.to_string()));
    }
    for (name, key) in [
        ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "rules.xds.retry_initial_ms"),
        ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "rules.xds.retry_max_ms"),
        ("CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL", "rules.xds.connect_timeout_ms"),
    ] {
        if let Some(ms) = up.millis(name)? {
            out.push((key, ms.to_string()));
        }
    }
    if let Some(bytes) = up.get("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES") {
        bytes
            .parse::<usize>()
            .map_err(|_| invalid("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES", format!("{bytes:?} is not a size")))?;
        out.push(("rules.xds.max_message_bytes", bytes.to_owned()));
    }
    // `key=value,key=value` (metadata) and `key:value,key:value` (headers),
    // as upstream reads them. Keys reach ratelimitd in lower case.
    for (name, key, separator) in [
        ("CONFIG_GRPC_XDS_NODE_METADATA", "rules.xds.node_metadata", '='),
        ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "rules.xds.headers", ':'),
    ] {
        for pair in up.get(name).unwrap_or_default().split(',').filter(|p| !p.is_empty()) {
            let Some((k, v)) = pair.split_once(separator) else {
                return Err(invalid(name, format!("{pair:?} is not key{separator}value")));
            };
            out.push((map_key(key, k.trim()), v.trim().to_owned()));
        }
    }
    Ok(())
}

/// A map entry's dotted key, `map.entry`: leaked, once per entry at start
/// (a handful, from the operator's environment).
fn map_key(map: &str, entry: &str) -> &'static str {
    Box::leak(format!("{map}.{entry}").into_boxed_str())
}

/// `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY`, upstream's
/// defaults included: where the Envoy rules are.
fn runtime(up: &Upstream<'_>, out: &mut Out) {
    let mut path = std::path::PathBuf::from(up.get("RUNTIME_ROOT").unwrap_or(RUNTIME_ROOT));
    if let Some(sub) = up.get("RUNTIME_SUBDIRECTORY") {
        path.push(sub);
    }
    path.push(up.get("RUNTIME_APPDIRECTORY").unwrap_or(RUNTIME_APPDIRECTORY));
    out.push(("rules.envoy_path", path.to_string_lossy().into_owned()));
}

/// `REDIS_SOCKET_TYPE`, `REDIS_URL`, `REDIS_TYPE`, `REDIS_AUTH`,
/// `REDIS_SENTINEL_AUTH`, `REDIS_TLS*`, `REDIS_TIMEOUT`, upstream's
/// defaults included (a Unix socket).
fn redis(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    if up.get("REDIS_TYPE").is_some_and(|t| t.eq_ignore_ascii_case("sentinel")) {
        sentinel(up, out)?;
    } else {
        single_or_cluster(up, out)?;
    }
    if let Some(auth) = up.get("REDIS_AUTH") {
        // Upstream takes `password` or `user:password` (an ACL user): both
        // are sent, or AUTH fails against an ACL Redis.
        match auth.split_once(':') {
            Some((user, password)) => {
                out.push(("redis.username", user.to_owned()));
                out.push(("redis.password", password.to_owned()));
            }
            None => out.push(("redis.password", auth.to_owned())),
        }
    }
    if let Some(prefix) = up.get("CACHE_KEY_PREFIX") {
        out.push(("redis.key_prefix", prefix.to_owned()));
    }
    if let Some(ms) = up.millis("REDIS_TIMEOUT")? {
        out.push(("redis.timeout_ms", ms.to_string()));
    }
    Ok(())
}

/// `REDIS_TYPE=sentinel`: `REDIS_URL` is the master's name, then the
/// sentinels (`mymaster,host:26379,host2:26379`).
fn sentinel(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    let list = up.get("REDIS_URL").unwrap_or_default();
    let mut parts = list.split(',').map(str::trim).filter(|p| !p.is_empty());
    let (Some(master), sentinels) = (parts.next(), parts.map(|s| format!("redis://{s}")).collect::<Vec<_>>())
    else {
        return Err(invalid("REDIS_URL", "with REDIS_TYPE=sentinel: the master's name, then the sentinels"));
    };
    if sentinels.is_empty() {
        return Err(invalid("REDIS_URL", "with REDIS_TYPE=sentinel: the master's name, then the sentinels"));
    }
    if up.flag("REDIS_TLS")? == Some(true) {
        return Err(invalid("REDIS_TLS", "not supported with REDIS_TYPE=sentinel yet"));
    }
    out.push(("redis.sentinel_master", master.to_owned()));
    out.push(("redis.url", sentinels.join(",")));
    if let Some(auth) = up.get("REDIS_SENTINEL_AUTH") {
        out.push(("redis.sentinel_password", auth.to_owned()));
    }
    Ok(())
}

/// One server (tcp or unix) or a cluster's seed nodes.
fn single_or_cluster(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    let cluster = up.get("REDIS_TYPE").is_some_and(|t| t.eq_ignore_ascii_case("cluster"));
    let tls = up.flag("REDIS_TLS")?.unwrap_or(false);
    let socket = up.get("REDIS_SOCKET_TYPE").unwrap_or("unix");
    let raw = up.get("REDIS_URL").unwrap_or(REDIS_URL);
    let url = match socket {
        "unix" if cluster => {
            return Err(invalid("REDIS_SOCKET_TYPE", "a Redis Cluster is reached over tcp"));
        }
        "unix" if tls => return Err(invalid("REDIS_TLS", "TLS needs REDIS_SOCKET_TYPE=tcp")),
        "unix" => format!("unix://{raw}"),
        "tcp" => {
            let scheme = if tls { "rediss" } else { "redis" };
            raw.split(',').map(|node| format!("{scheme}://{}", node.trim())).collect::<Vec<_>>().join(",")
        }
        other => return Err(invalid("REDIS_SOCKET_TYPE", format!("{other:?}: expected tcp or unix"))),
    };
    out.push(("redis.url", url));
    if cluster {
        out.push(("redis.cluster", "true".to_owned()));
    }
    for (name, key) in [
        ("REDIS_TLS_CACERT", "redis.tls_ca_file"),
        ("REDIS_TLS_CLIENT_CERT", "redis.tls_cert_file"),
        ("REDIS_TLS_CLIENT_KEY", "redis.tls_key_file"),
    ] {
        if let Some(path) = up.get(name) {
            out.push((key, path.to_owned()));
        }
    }
    Ok(())
}

/// `GRPC_SERVER_USE_TLS` with `GRPC_SERVER_TLS_CERT`/`_KEY`, and
/// `GRPC_CLIENT_TLS_CACERT` (and `GRPC_CLIENT_TLS_SAN`, the name they must
/// carry) for client certificates.
fn grpc_tls(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    if up.flag("GRPC_SERVER_USE_TLS")? != Some(true) {
        return Ok(());
    }
    // TLS asked for but without its files would serve plaintext: refused,
    // as upstream refuses to start.
    for name in ["GRPC_SERVER_TLS_CERT", "GRPC_SERVER_TLS_KEY"] {
        if up.get(name).is_none_or(str::is_empty) {
            return Err(invalid(
                name,
                "must be set with GRPC_SERVER_USE_TLS=true (else gRPC would be plaintext)",
            ));
        }
    }
    for (name, key) in [
        ("GRPC_SERVER_TLS_CERT", "grpc.tls.cert_file"),
        ("GRPC_SERVER_TLS_KEY", "grpc.tls.key_file"),
        ("GRPC_CLIENT_TLS_CACERT", "grpc.tls.client_ca_file"),
        ("GRPC_CLIENT_TLS_SAN", "grpc.tls.client_san"),
    ] {
        if let Some(path) = up.get(name) {
            out.push((key, path.to_owned()));
        }
    }
    Ok(())
}

/// The modes, the response headers (upstream's `RateLimit-*` names by
/// default), the near-limit ratio and the stats switch.
fn envoy(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    // Upstream's decisions: a fixed window (a new minute starts afresh, and
    // a reset is never more than the unit away), a 0-hit check admitted
    // while the count is within the limit, and every hit counted (its
    // token-quota flow checks with 0 hits and debits afterwards, whatever
    // is left).
    out.push(("envoy.algorithm", "fixed_window".to_owned()));
    out.push(("envoy.zero_hits", "within_limit".to_owned()));
    out.push(("envoy.hits_counted", "always".to_owned()));
    // Upstream never sheds: a busy node measures and flags what it would
    // shed, and refuses nothing until `shed.mode: enforce` says so.
    out.push(("shed.mode", "shadow".to_owned()));
    for (name, key) in [
        ("MERGE_DOMAIN_CONFIG", "envoy.merge_domains"),
        ("SHADOW_MODE", "envoy.shadow_mode"),
        ("QUOTA_MODE", "envoy.quota_mode"),
        ("RESPONSE_DYNAMIC_METADATA", "envoy.response_dynamic_metadata"),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "envoy.response_headers"),
    ] {
        if let Some(on) = up.flag(name)? {
            out.push((key, on.to_string()));
        }
    }
    for (name, key, default) in [
        ("LIMIT_LIMIT_HEADER", "envoy.limit_header", "RateLimit-Limit"),
        ("LIMIT_REMAINING_HEADER", "envoy.remaining_header", "RateLimit-Remaining"),
        ("LIMIT_RESET_HEADER", "envoy.reset_header", "RateLimit-Reset"),
    ] {
        out.push((key, up.get(name).unwrap_or(default).to_owned()));
    }
    if let Some(ratio) = up.get("NEAR_LIMIT_RATIO") {
        ratio
            .parse::<f32>()
            .map_err(|_| invalid("NEAR_LIMIT_RATIO", format!("{ratio:?} is not a number")))?;
        out.push(("envoy.near_limit_ratio", ratio.to_owned()));
    }
    if up.flag("DISABLE_STATS")? == Some(true) {
        out.push(("envoy.upstream_metrics", "false".to_owned()));
    }
    Ok(())
}

/// `USE_STATSD` (on by default, as upstream), `STATSD_HOST`, `STATSD_PORT`,
/// `STATS_FLUSH_INTERVAL`; `DISABLE_STATS` turns it off too.
fn statsd(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    if up.flag("USE_STATSD")? == Some(false) || up.flag("DISABLE_STATS")? == Some(true) {
        return Ok(());
    }
    let port = up.get("STATSD_PORT").unwrap_or("8125");
    port.parse::<u16>().map_err(|_| invalid("STATSD_PORT", format!("{port:?} is not a port")))?;
    out.push(("telemetry.statsd_addr", format!("{}:{port}", up.get("STATSD_HOST").unwrap_or("localhost"))));
    if let Some(ms) = up.millis("STATS_FLUSH_INTERVAL")? {
        out.push(("telemetry.statsd_flush_interval_ms", ms.to_string()));
    }
    Ok(())
}

/// Upstream's tracing: nothing is exported unless `TRACING_ENABLED`
/// (so the OpenTelemetry endpoint variables are not read without it);
/// with it, spans go over `TRACING_EXPORTER_PROTOCOL` (`http`, upstream's
/// default, or `grpc`) to `OTEL_EXPORTER_OTLP_ENDPOINT` (the
/// OpenTelemetry default for the protocol, `http://localhost:4318` or
/// `:4317`, when unset), under `TRACING_SERVICE_NAME` (upstream's default
/// `RateLimit`), `TRACING_SERVICE_NAMESPACE` and
/// `TRACING_SERVICE_INSTANCE_ID`; `TRACING_SAMPLING_RATE` (0 to 1) is the
/// share of decisions without a caller's trace that are traced.
/// Returns whether tracing is on.
fn tracing(up: &Upstream<'_>, out: &mut Out) -> Result<bool, ConfigError> {
    if up.flag("TRACING_ENABLED")? != Some(true) {
        return Ok(false);
    }
    let (protocol, port) = match up.get("TRACING_EXPORTER_PROTOCOL").unwrap_or("http") {
        "http" => ("http/protobuf", 4318),
        "grpc" => ("grpc", 4317),
        other => {
            return Err(invalid("TRACING_EXPORTER_PROTOCOL", format!("{other:?}: expected http or grpc")));
        }
    };
    out.push(("telemetry.otlp_protocol", protocol.to_owned()));
    if OTEL_ENDPOINTS.iter().all(|name| up.get(name).is_none()) {
        out.push(("telemetry.otlp_endpoint", format!("http://localhost:{port}")));
    }
    out.push(("telemetry.service_name", up.get("TRACING_SERVICE_NAME").unwrap_or("RateLimit").to_owned()));
    if let Some(namespace) = up.get("TRACING_SERVICE_NAMESPACE") {
        out.push(("telemetry.service_namespace", namespace.to_owned()));
    }
    if let Some(instance) = up.get("TRACING_SERVICE_INSTANCE_ID") {
        out.push(("telemetry.service_instance_id", instance.to_owned()));
    }
    if let Some(rate) = up.get("TRACING_SAMPLING_RATE") {
        let ratio = rate.trim().parse::<f64>().ok().filter(|r| (0.0..=1.0).contains(r));
        let ratio =
            ratio.ok_or_else(|| invalid("TRACING_SAMPLING_RATE", format!("{rate:?}: expected 0 to 1")))?;
        out.push(("telemetry.sampling_ratio", ratio.to_string()));
    }
    Ok(true)
}

/// The OpenTelemetry variables that name where spans go.
const OTEL_ENDPOINTS: [&str; 2] = ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"];

/// `LOG_LEVEL` (upstream's names, any case) and `LOG_FORMAT` (`text` or
/// `json`). Upstream's level is its own logger's: `debug` and `trace` are
/// ratelimitd's own, the libraries beneath (h2, hyper: a line per frame)
/// stay at `info`.
fn logging(up: &Upstream<'_>, out: &mut Out) -> Result<(), ConfigError> {
    if let Some(level) = up.get("LOG_LEVEL") {
        let level = match level.to_ascii_lowercase().as_str() {
            "trace" => "ratelimitd=trace,info",
            "debug" => "ratelimitd=debug,info",
            "info" => "info",
            "warn" | "warning" => "warn",
            "error" | "fatal" | "panic" => "error",
            _ => return Err(invalid("LOG_LEVEL", format!("{level:?} is not a log level"))),
        };
        out.push(("log.level", level.to_owned()));
    }
    if let Some(format) = up.get("LOG_FORMAT") {
        let format = match format.to_ascii_lowercase().as_str() {
            "text" => "human",
            "json" => "json",
            _ => return Err(invalid("LOG_FORMAT", format!("{format:?}: expected text or json"))),
        };
        out.push(("log.format", format.to_owned()));
    }
    Ok(())
}

mod limitador;

#[cfg(test)]
mod tests;
