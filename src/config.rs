//! The service configuration: one typed, documented, defaulted and validated
//! [`Config`], loaded before anything binds.
//!
//! Sources, lowest precedence first: built-in defaults, the YAML file given by
//! `--config`, then environment variables `RATELIMITD__SECTION__KEY`
//! (e.g. `RATELIMITD__REDIS__TIMEOUT_MS=5`). Tests pass the environment as a
//! map ([`Config::load`]) instead of mutating the process environment.

use std::{collections::HashMap, fmt, net::SocketAddr, path::PathBuf, time::Duration};

use serde::Deserialize;

use crate::{
    rules::Priority,
    shed::{ShedMode, Thresholds},
};

/// Prefix of configuration environment variables.
pub const ENV_PREFIX: &str = "RATELIMITD";

/// A configuration that could not be loaded or does not validate. The message
/// always names the offending key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read or parsed, or a value has the wrong type.
    #[error("configuration: {0}")]
    Load(String),
    /// A value parsed but is out of range or inconsistent.
    #[error("configuration key `{key}`: {message}")]
    Invalid { key: &'static str, message: String },
}

/// The whole configuration of `ratelimitd serve`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// The gRPC listener.
    pub grpc: GrpcConfig,
    /// Metrics and health over HTTP.
    pub http: HttpConfig,
    /// The Redis counter store; unset `url` selects the in-memory store.
    pub redis: RedisConfig,
    /// The in-memory counter store (used when `redis.url` is unset).
    pub memory: MemoryConfig,
    /// Where native rules come from and how often they are checked for changes.
    pub rules: RulesConfig,
    /// Bounds on request fields, answered with INVALID_ARGUMENT when exceeded.
    pub limits: LimitsConfig,
    /// Priority load shedding.
    pub shed: ShedConfig,
    /// Where failed decisions are recorded.
    pub dlq: DlqConfig,
    /// Envoy's `ShouldRateLimit` (active when `rules.envoy_path` is set).
    pub envoy: EnvoySettings,
    /// Logging.
    pub log: LogConfig,
    /// Trace export.
    pub telemetry: TelemetryConfig,
}

/// `grpc.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcConfig {
    /// Address the gRPC server binds (`grpc.listen`).
    pub listen: String,
    /// How long in-flight calls may take to finish after SIGTERM before the
    /// process exits anyway (`grpc.shutdown_grace_ms`).
    pub shutdown_grace_ms: u64,
    /// After SIGTERM, how long to keep answering while health already says
    /// NOT_SERVING (and `/readyz` 503), so load balancers stop sending before
    /// the listener closes. Behind Kubernetes or Envoy a few seconds is usual.
    pub drain_delay_ms: u64,
    /// Largest accepted request message, in bytes; a larger one is refused
    /// with RESOURCE_EXHAUSTED before it is decoded. The default is above
    /// what the field bounds (`limits.*`, `envoy.max_*`) allow.
    pub max_message_bytes: usize,
    /// TLS on the gRPC port; off unless `cert_file` and `key_file` are set.
    pub tls: GrpcTlsConfig,
}

/// `grpc.tls.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpcTlsConfig {
    /// PEM certificate chain (leaf first). With `key_file`, turns TLS on.
    pub cert_file: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of the certificate.
    pub key_file: Option<PathBuf>,
    /// PEM CA certificate(s): when set, every client must present a
    /// certificate they signed (mTLS).
    pub client_ca_file: Option<PathBuf>,
    /// How often the files are checked for changes (size, mtime); a change
    /// is loaded for new connections without a restart. 0 disables reload.
    pub reload_interval_ms: u64,
    /// A connection whose TLS handshake takes longer is closed.
    pub handshake_timeout_ms: u64,
}

impl Default for GrpcTlsConfig {
    fn default() -> Self {
        Self {
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            reload_interval_ms: 10_000,
            handshake_timeout_ms: 10_000,
        }
    }
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            listen: "0.0.0.0:8081".to_owned(),
            shutdown_grace_ms: 10_000,
            drain_delay_ms: 0,
            max_message_bytes: 1 << 20,
            tls: GrpcTlsConfig::default(),
        }
    }
}

/// `http.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of `/metrics`, `/healthz` and `/readyz` (`http.listen`).
    pub listen: String,
    /// How often the counter store is probed for readiness and gRPC health.
    pub health_interval_ms: u64,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self { listen: "0.0.0.0:8080".to_owned(), health_interval_ms: 1_000 }
    }
}

/// `redis.*`
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://[:password@]host:port[/db]` (`rediss://` for TLS); unset
    /// selects the in-memory store. With `cluster`, a comma-separated list
    /// of seed nodes.
    pub url: Option<String>,
    /// `url` names Redis Cluster seed nodes; the slot map is read from them.
    pub cluster: bool,
    /// The AUTH password, instead of one in `url` (best set through
    /// `RATELIMITD__REDIS__PASSWORD`). Never logged.
    pub password: Option<String>,
    /// A file whose content (trailing newline removed) is the AUTH
    /// password, e.g. a mounted Kubernetes secret. Read at startup.
    pub password_file: Option<PathBuf>,
    /// With `rediss://`: PEM CA certificate(s) to trust instead of the
    /// system's roots (a private CA).
    pub tls_ca_file: Option<PathBuf>,
    /// With `rediss://`: PEM client certificate, for a Redis that requires
    /// client certificates (`tls-auth-clients yes`); with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// The client certificate's PEM private key.
    pub tls_key_file: Option<PathBuf>,
    /// Deadline of one store call, connection acquisition included. Past it the
    /// rule's failure policy answers. Well inside Envoy's 20 ms default budget.
    pub timeout_ms: u64,
    /// Deadline for opening a new connection (bounded by `timeout_ms` on the
    /// request path; this bounds background reconnects).
    pub connect_timeout_ms: u64,
    /// Number of connections, each with one dispatcher task: the decisions
    /// queued while its script call is in flight become its next call, so a
    /// couple serve thousands of in-flight decisions (fewer connections,
    /// bigger batches, less Redis CPU per decision).
    pub connections: usize,
    /// Consecutive failed script calls (unreachable, connection lost,
    /// deadline missed) that open the circuit breaker; 0 disables it.
    pub breaker_failures: u32,
    /// How long an open breaker fails decisions fast before letting one
    /// probe decision through.
    pub breaker_open_ms: u64,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            cluster: false,
            password: None,
            password_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            timeout_ms: 10,
            connect_timeout_ms: 1_000,
            connections: 2,
            breaker_failures: 3,
            breaker_open_ms: 250,
        }
    }
}

impl fmt::Debug for RedisConfig {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("cluster", &self.cluster)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("password_file", &self.password_file)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("timeout_ms", &self.timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("connections", &self.connections)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_open_ms", &self.breaker_open_ms)
            .finish()
    }
}

impl RedisConfig {
    /// The seed URLs in `url` (one unless `cluster`).
    pub fn seed_urls(&self) -> impl Iterator<Item = &str> {
        self.url.as_deref().unwrap_or_default().split(',').map(str::trim).filter(|s| !s.is_empty())
    }

    /// The AUTH password from `password` or `password_file`, if either is
    /// set. The error names the key and the file, never the content.
    pub fn password(&self) -> Result<Option<String>, ConfigError> {
        match (&self.password, &self.password_file) {
            (Some(_), Some(_)) => Err(ConfigError::Invalid {
                key: "redis.password_file",
                message: "set redis.password or redis.password_file, not both".to_owned(),
            }),
            (Some(password), None) => Ok(Some(password.clone())),
            (None, Some(file)) => {
                let text = std::fs::read_to_string(file).map_err(|e| ConfigError::Invalid {
                    key: "redis.password_file",
                    message: format!("cannot read {}: {e}", file.display()),
                })?;
                let password = text.trim_end_matches(['\r', '\n']);
                if password.is_empty() {
                    return Err(ConfigError::Invalid {
                        key: "redis.password_file",
                        message: format!("{} is empty", file.display()),
                    });
                }
                Ok(Some(password.to_owned()))
            }
            (None, None) => Ok(None),
        }
    }
}

/// Replaces the userinfo of a URL (`user:password@`) with `***@`; in a
/// comma-separated list of URLs (cluster seed nodes), that of each.
pub fn redact_url(url: &str) -> String {
    fn one(url: &str) -> String {
        match (url.find("://"), url.rfind('@')) {
            (Some(scheme_end), Some(at)) if at > scheme_end => {
                format!("{}***{}", &url[..scheme_end + 3], &url[at..])
            }
            _ => url.to_owned(),
        }
    }
    if url.contains(',') { url.split(',').map(one).collect::<Vec<_>>().join(",") } else { one(url) }
}

/// `memory.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// How often idle (expired) counters are removed, so memory stays bounded.
    pub sweep_interval_ms: u64,
    /// Number of independently locked shards of the counter map.
    pub shards: usize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self { sweep_interval_ms: 10_000, shards: 64 }
    }
}

/// `rules.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RulesConfig {
    /// A native rule YAML file, or a directory whose `*.yaml`/`*.yml` files
    /// together form the rule set.
    pub path: PathBuf,
    /// How often `path` is checked for changes (metadata only; a file is read
    /// again only when its identity, size or mtime changed). 0 disables reload.
    pub reload_interval_ms: u64,
    /// envoyproxy/ratelimit-format YAML: a file, or a directory with one
    /// domain per file. Unset: `ShouldRateLimit` is not served.
    pub envoy_path: Option<PathBuf>,
}

impl Default for RulesConfig {
    fn default() -> Self {
        Self { path: PathBuf::from("examples/rules"), reload_interval_ms: 1_000, envoy_path: None }
    }
}

/// Counting algorithm of Envoy descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvoyAlgorithm {
    /// Sliding window: no client gets twice the limit across a window edge.
    #[default]
    SlidingWindow,
    /// envoyproxy/ratelimit's fixed window, for exact parity.
    FixedWindow,
}

/// What `ShouldRateLimit` answers when the counter store cannot decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvoyFailureMode {
    /// Answer OK (and record the failure like any failed decision).
    #[default]
    Allow,
    /// Answer gRPC UNAVAILABLE, so Envoy's own `failure_mode_deny` decides.
    Unavailable,
}

/// `envoy.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvoySettings {
    /// `sliding_window` (default) or `fixed_window`.
    pub algorithm: EnvoyAlgorithm,
    /// `allow` (default) or `unavailable`.
    pub failure_mode: EnvoyFailureMode,
    /// Add rate-limit headers (of the descriptor closest to its limit) to responses.
    pub response_headers: bool,
    /// Name of the limit header.
    pub limit_header: String,
    /// Name of the remaining header.
    pub remaining_header: String,
    /// Name of the reset header (seconds).
    pub reset_header: String,
    /// Most descriptors in one request.
    pub max_descriptors: usize,
    /// Most entries in one descriptor.
    pub max_entries: usize,
    /// Longest entry (key + value) and domain, in bytes.
    pub max_entry_bytes: usize,
}

impl Default for EnvoySettings {
    fn default() -> Self {
        Self {
            algorithm: EnvoyAlgorithm::SlidingWindow,
            failure_mode: EnvoyFailureMode::Allow,
            response_headers: false,
            limit_header: "x-ratelimit-limit".to_owned(),
            remaining_header: "x-ratelimit-remaining".to_owned(),
            reset_header: "x-ratelimit-reset".to_owned(),
            max_descriptors: 64,
            max_entries: 32,
            max_entry_bytes: 1_024,
        }
    }
}

/// `limits.*`: bounds on request fields.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Longest accepted `user_id`, in bytes.
    pub max_user_id_bytes: usize,
    /// Longest accepted `resource_path`, in bytes.
    pub max_resource_path_bytes: usize,
    /// Longest accepted `client_type`, in bytes.
    pub max_client_type_bytes: usize,
    /// Most entries in the `headers` map.
    pub max_headers: usize,
    /// Longest header name plus value, in bytes.
    pub max_header_bytes: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_user_id_bytes: 256,
            max_resource_path_bytes: 2_048,
            max_client_type_bytes: 64,
            max_headers: 64,
            max_header_bytes: 8_192,
        }
    }
}

/// `shed.*`: priority load shedding (DESIGN §7).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShedConfig {
    /// `enforce` refuses shed requests (reason SHED); `shadow` decides them
    /// normally and flags `shadow_shed`; `off` neither samples nor sheds.
    pub mode: ShedMode,
    /// Where `stat` is read when no cgroup CPU quota applies.
    pub procfs_root: PathBuf,
    /// The cgroup v2 directory holding `cpu.max` and `cpu.stat`.
    pub cgroup_root: PathBuf,
    /// Utilization (0..1) at which DEGRADED_MODE starts: BULK and BEST_EFFORT are shed.
    pub degraded_at: f64,
    /// Utilization (0..1) at which CRITICAL_ONLY starts: DEGRADED is shed too.
    pub critical_only_at: f64,
    /// A level is left only when utilization falls this far below its threshold.
    pub hysteresis: f64,
    /// How often utilization is sampled.
    pub sample_interval_ms: u64,
    /// Weight of a new sample in the moving average (0 < x <= 1); lower is smoother.
    pub smoothing: f64,
    /// Priority of requests that state none and match no rule.
    pub default_priority: Priority,
    /// Centre of the jittered `retry_after_ms` of shed requests (spread over ±50%).
    pub retry_after_ms: u64,
    /// How often, at most, the shed counts are logged while shedding.
    pub report_interval_ms: u64,
}

impl Default for ShedConfig {
    fn default() -> Self {
        Self {
            mode: ShedMode::Enforce,
            procfs_root: PathBuf::from("/proc"),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            degraded_at: 0.60,
            critical_only_at: 0.85,
            hysteresis: 0.05,
            sample_interval_ms: 250,
            smoothing: 0.3,
            default_priority: Priority::Degraded,
            retry_after_ms: 1_000,
            report_interval_ms: 10_000,
        }
    }
}

impl ShedConfig {
    /// The level thresholds.
    pub fn thresholds(&self) -> Thresholds {
        Thresholds {
            degraded_at: self.degraded_at,
            critical_only_at: self.critical_only_at,
            hysteresis: self.hysteresis,
        }
    }
}

/// `dlq.*`: the record of decisions the store could not make.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DlqConfig {
    /// The JSON-lines file records are appended to when no Kafka brokers are set.
    pub file: PathBuf,
    /// Records waiting between the decision path and the writer, at most.
    /// Past it a record is dropped (counted, logged): size it for bursts.
    pub queue_capacity: usize,
    /// Request headers copied into records (case-insensitive names).
    pub header_allowlist: Vec<String>,
    /// This instance's name in records; default: the host name.
    pub instance_id: Option<String>,
    /// Where records wait, durably, until Kafka acknowledges them.
    pub spool_dir: PathBuf,
    /// A spool segment is closed and a new one started past this size.
    pub spool_segment_bytes: u64,
    /// The dead-letter topic; `brokers` unset selects the file sink.
    pub kafka: KafkaConfig,
}

impl Default for DlqConfig {
    fn default() -> Self {
        Self {
            file: PathBuf::from("data/dlq.jsonl"),
            queue_capacity: 65_536,
            header_allowlist: vec!["x-request-id".to_owned(), "user-agent".to_owned()],
            instance_id: None,
            spool_dir: PathBuf::from("data/spool"),
            spool_segment_bytes: 16 << 20,
            kafka: KafkaConfig::default(),
        }
    }
}

/// `dlq.kafka.*`
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers, `host:port[,host:port…]`; unset = file sink.
    pub brokers: Option<String>,
    /// The dead-letter topic.
    pub topic: String,
    /// Partitions `ratelimitd migrate` creates the topic with.
    pub partitions: i32,
    /// Replication factor `ratelimitd migrate` creates the topic with.
    pub replication_factor: i32,
    /// `retention.ms` of the topic `ratelimitd migrate` creates.
    pub retention_ms: i64,
    /// How long shutdown waits for outstanding deliveries before leaving them in the spool.
    pub flush_timeout_ms: u64,
    /// Any librdkafka property (`security.protocol`, `sasl.*`, `ssl.*`, …),
    /// applied over the service's defaults. Values are never logged.
    pub properties: std::collections::BTreeMap<String, String>,
}

impl Default for KafkaConfig {
    fn default() -> Self {
        Self {
            brokers: None,
            topic: "ratelimit.dlq".to_owned(),
            partitions: 6,
            replication_factor: 3,
            retention_ms: 14 * 24 * 3_600_000,
            flush_timeout_ms: 5_000,
            properties: Default::default(),
        }
    }
}

impl fmt::Debug for KafkaConfig {
    // Properties carry SASL passwords and keys: show their names only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("partitions", &self.partitions)
            .field("replication_factor", &self.replication_factor)
            .field("retention_ms", &self.retention_ms)
            .field("flush_timeout_ms", &self.flush_timeout_ms)
            .field("properties", &self.properties.keys().map(|k| format!("{k}=***")).collect::<Vec<_>>())
            .finish()
    }
}

impl DlqConfig {
    /// `instance_id`, else the host name, else `ratelimitd`.
    pub fn instance(&self) -> String {
        self.instance_id.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .ok()
                .filter(|h| !h.is_empty())
                .unwrap_or_else(|| "ratelimitd".to_owned())
        })
    }
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Readable text (coloured on a terminal).
    #[default]
    Human,
    /// One JSON object per line, for log collectors.
    Json,
}

/// `log.*`
#[derive(Debug, Clone, Deserialize)]
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
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TelemetryConfig {
    /// OTLP/gRPC collector, e.g. `http://otel-collector:4317`; unset = no span export.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of exported spans.
    pub service_name: String,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self { otlp_endpoint: None, service_name: "ratelimitd".to_owned() }
    }
}

impl Config {
    /// Loads defaults < `file` < `env` and validates the result. `env` is the
    /// process environment in production and a plain map in tests.
    pub fn load(file: Option<&std::path::Path>, env: HashMap<String, String>) -> Result<Self, ConfigError> {
        let mut builder = config::Config::builder();
        if let Some(file) = file {
            if !file.is_file() {
                return Err(ConfigError::Load(format!("--config {}: no such file", file.display())));
            }
            builder = builder.add_source(config::File::from(file).format(config::FileFormat::Yaml));
        }
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("dlq.header_allowlist")
                .source(Some(env.into_iter().collect())),
        );
        let raw = builder.build().map_err(|e| ConfigError::Load(e.to_string()))?;
        let config: Config = raw.try_deserialize().map_err(|e| ConfigError::Load(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks ranges and consistency; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
            ConfigError::Invalid { key, message: message.into() }
        }
        self.grpc.listen.parse::<SocketAddr>().map_err(|e| {
            invalid("grpc.listen", format!("{:?} is not an ip:port address: {e}", self.grpc.listen))
        })?;
        self.http.listen.parse::<SocketAddr>().map_err(|e| {
            invalid("http.listen", format!("{:?} is not an ip:port address: {e}", self.http.listen))
        })?;
        let tls = &self.grpc.tls;
        match (&tls.cert_file, &tls.key_file) {
            (Some(_), None) => {
                return Err(invalid("grpc.tls.key_file", "must be set with grpc.tls.cert_file"));
            }
            (None, Some(_)) => {
                return Err(invalid("grpc.tls.cert_file", "must be set with grpc.tls.key_file"));
            }
            (None, None) if tls.client_ca_file.is_some() => {
                return Err(invalid(
                    "grpc.tls.client_ca_file",
                    "needs grpc.tls.cert_file and grpc.tls.key_file (mTLS is TLS first)",
                ));
            }
            _ => {}
        }
        if tls.handshake_timeout_ms == 0 {
            return Err(invalid("grpc.tls.handshake_timeout_ms", "must be at least 1"));
        }
        if !(1_024..=64 << 20).contains(&self.grpc.max_message_bytes) {
            return Err(invalid("grpc.max_message_bytes", "must be between 1024 and 67108864"));
        }
        if self.http.health_interval_ms < 10 {
            return Err(invalid("http.health_interval_ms", "must be at least 10"));
        }
        if let Some(url) = &self.redis.url {
            let mut seeds = 0;
            for seed in self.redis.seed_urls() {
                seeds += 1;
                if !(seed.starts_with("redis://") || seed.starts_with("rediss://")) {
                    return Err(invalid(
                        "redis.url",
                        format!("{:?} must start with redis:// or rediss://", redact_url(seed)),
                    ));
                }
                redis::Client::open(seed).map_err(|e| {
                    invalid("redis.url", format!("{:?} is not a valid Redis URL: {e}", redact_url(seed)))
                })?;
            }
            if seeds == 0 {
                return Err(invalid("redis.url", "must not be empty; leave it unset for in-memory counters"));
            }
            if seeds > 1 && !self.redis.cluster {
                return Err(invalid(
                    "redis.url",
                    format!(
                        "{:?} lists {seeds} servers; set redis.cluster: true for a Redis Cluster",
                        redact_url(url)
                    ),
                ));
            }
            self.redis.password()?;
            let tls_files = self.redis.tls_ca_file.is_some()
                || self.redis.tls_cert_file.is_some()
                || self.redis.tls_key_file.is_some();
            if tls_files && !self.redis.seed_urls().all(|seed| seed.starts_with("rediss://")) {
                return Err(invalid("redis.url", "redis.tls_* files need rediss:// URLs"));
            }
            if self.redis.tls_cert_file.is_some() != self.redis.tls_key_file.is_some() {
                return Err(invalid(
                    "redis.tls_key_file",
                    "set redis.tls_cert_file and redis.tls_key_file together",
                ));
            }
        } else if self.redis.cluster {
            return Err(invalid("redis.cluster", "needs redis.url (the seed nodes)"));
        }
        if self.redis.timeout_ms == 0 {
            return Err(invalid("redis.timeout_ms", "must be at least 1"));
        }
        if self.redis.connect_timeout_ms == 0 {
            return Err(invalid("redis.connect_timeout_ms", "must be at least 1"));
        }
        if !(1..=256).contains(&self.redis.connections) {
            return Err(invalid("redis.connections", "must be between 1 and 256"));
        }
        if self.redis.breaker_failures > 0 && self.redis.breaker_open_ms == 0 {
            return Err(invalid(
                "redis.breaker_open_ms",
                "must be at least 1 while redis.breaker_failures is set",
            ));
        }
        if self.memory.sweep_interval_ms == 0 {
            return Err(invalid("memory.sweep_interval_ms", "must be at least 1"));
        }
        if !(1..=4096).contains(&self.memory.shards) {
            return Err(invalid("memory.shards", "must be between 1 and 4096"));
        }
        if self.rules.path.as_os_str().is_empty() {
            return Err(invalid("rules.path", "must not be empty"));
        }
        for (key, value) in [
            ("limits.max_user_id_bytes", self.limits.max_user_id_bytes),
            ("limits.max_resource_path_bytes", self.limits.max_resource_path_bytes),
            ("limits.max_client_type_bytes", self.limits.max_client_type_bytes),
            ("limits.max_header_bytes", self.limits.max_header_bytes),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be at least 1"));
            }
        }
        let shed = &self.shed;
        if !(shed.degraded_at > 0.0 && shed.degraded_at <= 1.0) {
            return Err(invalid("shed.degraded_at", format!("must be in (0, 1], got {}", shed.degraded_at)));
        }
        if !(shed.critical_only_at >= shed.degraded_at && shed.critical_only_at <= 1.0) {
            return Err(invalid(
                "shed.critical_only_at",
                format!("must be in [shed.degraded_at, 1], got {}", shed.critical_only_at),
            ));
        }
        if !(shed.hysteresis >= 0.0 && shed.hysteresis < shed.degraded_at) {
            return Err(invalid(
                "shed.hysteresis",
                format!("must be in [0, shed.degraded_at), got {}", shed.hysteresis),
            ));
        }
        if !(shed.smoothing > 0.0 && shed.smoothing <= 1.0) {
            return Err(invalid("shed.smoothing", format!("must be in (0, 1], got {}", shed.smoothing)));
        }
        if shed.sample_interval_ms < 10 {
            return Err(invalid("shed.sample_interval_ms", "must be at least 10"));
        }
        if shed.retry_after_ms == 0 {
            return Err(invalid("shed.retry_after_ms", "must be at least 1"));
        }
        if shed.report_interval_ms == 0 {
            return Err(invalid("shed.report_interval_ms", "must be at least 1"));
        }
        if let Some(path) = &self.rules.envoy_path
            && path.as_os_str().is_empty()
        {
            return Err(invalid(
                "rules.envoy_path",
                "must not be empty; leave it unset to not serve ShouldRateLimit",
            ));
        }
        for (key, name) in [
            ("envoy.limit_header", &self.envoy.limit_header),
            ("envoy.remaining_header", &self.envoy.remaining_header),
            ("envoy.reset_header", &self.envoy.reset_header),
        ] {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
                return Err(invalid(key, format!("{name:?} is not a valid header name")));
            }
        }
        if self.envoy.max_descriptors == 0 {
            return Err(invalid("envoy.max_descriptors", "must be at least 1"));
        }
        if self.envoy.max_entries == 0 {
            return Err(invalid("envoy.max_entries", "must be at least 1"));
        }
        if self.envoy.max_entry_bytes == 0 {
            return Err(invalid("envoy.max_entry_bytes", "must be at least 1"));
        }
        if self.dlq.queue_capacity == 0 {
            return Err(invalid("dlq.queue_capacity", "must be at least 1"));
        }
        if self.dlq.file.as_os_str().is_empty() {
            return Err(invalid("dlq.file", "must not be empty"));
        }
        if self.dlq.spool_segment_bytes < 4_096 {
            return Err(invalid("dlq.spool_segment_bytes", "must be at least 4096"));
        }
        let kafka = &self.dlq.kafka;
        if kafka.brokers.as_deref().is_some_and(|b| b.trim().is_empty()) {
            return Err(invalid("dlq.kafka.brokers", "must not be empty; leave it unset for the file sink"));
        }
        if kafka.topic.is_empty()
            || kafka.topic.len() > 249
            || !kafka.topic.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
        {
            return Err(invalid(
                "dlq.kafka.topic",
                format!("{:?} is not a valid Kafka topic name", kafka.topic),
            ));
        }
        if kafka.partitions < 1 {
            return Err(invalid("dlq.kafka.partitions", "must be at least 1"));
        }
        if kafka.replication_factor < 1 {
            return Err(invalid("dlq.kafka.replication_factor", "must be at least 1"));
        }
        if kafka.retention_ms < -1 || kafka.retention_ms == 0 {
            return Err(invalid("dlq.kafka.retention_ms", "must be positive, or -1 for unlimited"));
        }
        for key in ["bootstrap.servers"] {
            if kafka.properties.contains_key(key) {
                return Err(invalid("dlq.kafka.properties", format!("set {key} through dlq.kafka.brokers")));
            }
        }
        if let Some(endpoint) = &self.telemetry.otlp_endpoint
            && !(endpoint.starts_with("http://") || endpoint.starts_with("https://"))
        {
            return Err(invalid(
                "telemetry.otlp_endpoint",
                format!("{endpoint:?} must start with http:// or https://"),
            ));
        }
        tracing_subscriber::EnvFilter::try_new(&self.log.level)
            .map_err(|e| invalid("log.level", format!("{:?}: {e}", self.log.level)))?;
        Ok(())
    }

    /// The validated gRPC listen address.
    pub fn grpc_addr(&self) -> SocketAddr {
        // Validated in `validate`; a Config built by hand in a test must be valid too.
        self.grpc.listen.parse().expect("grpc.listen is validated")
    }

    /// The validated HTTP listen address.
    pub fn http_addr(&self) -> SocketAddr {
        self.http.listen.parse().expect("http.listen is validated")
    }

    /// `redis.timeout_ms` as a duration.
    pub fn redis_timeout(&self) -> Duration {
        Duration::from_millis(self.redis.timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn defaults_are_the_embedded_mode() {
        let config = Config::load(None, HashMap::new()).unwrap();
        assert!(config.redis.url.is_none());
        assert_eq!(config.grpc.listen, "0.0.0.0:8081");
        assert_eq!(config.rules.path, PathBuf::from("examples/rules"));
    }

    #[test]
    fn environment_overrides_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.yaml");
        std::fs::write(&file, "redis:\n  timeout_ms: 7\n  url: redis://127.0.0.1:1\n").unwrap();
        let config = Config::load(Some(&file), env(&[("RATELIMITD__REDIS__TIMEOUT_MS", "3")])).unwrap();
        assert_eq!(config.redis.timeout_ms, 3);
        assert_eq!(config.redis.url.as_deref(), Some("redis://127.0.0.1:1"));
    }

    #[test]
    fn wrong_type_names_the_key() {
        let err =
            Config::load(None, env(&[("RATELIMITD__REDIS__TIMEOUT_MS", "soon")])).unwrap_err().to_string();
        assert!(err.contains("redis.timeout_ms"), "{err}");
    }

    #[test]
    fn out_of_range_names_the_key() {
        let err = Config::load(None, env(&[("RATELIMITD__REDIS__TIMEOUT_MS", "0")])).unwrap_err().to_string();
        assert!(err.contains("`redis.timeout_ms`"), "{err}");
        let err =
            Config::load(None, env(&[("RATELIMITD__GRPC__LISTEN", "nowhere")])).unwrap_err().to_string();
        assert!(err.contains("`grpc.listen`"), "{err}");
    }

    #[test]
    fn shed_keys_parse_and_validate() {
        let config = Config::load(
            None,
            env(&[
                ("RATELIMITD__SHED__MODE", "shadow"),
                ("RATELIMITD__SHED__DEFAULT_PRIORITY", "BULK"),
                ("RATELIMITD__SHED__DEGRADED_AT", "0.5"),
            ]),
        )
        .unwrap();
        assert_eq!(config.shed.mode, ShedMode::Shadow);
        assert_eq!(config.shed.default_priority, Priority::Bulk);
        assert!((config.shed.degraded_at - 0.5).abs() < f64::EPSILON);
        for (key, value, named) in [
            ("RATELIMITD__SHED__DEGRADED_AT", "0.9", "`shed.critical_only_at`"),
            ("RATELIMITD__SHED__DEGRADED_AT", "1.5", "`shed.degraded_at`"),
            ("RATELIMITD__SHED__HYSTERESIS", "0.7", "`shed.hysteresis`"),
            ("RATELIMITD__SHED__SMOOTHING", "0", "`shed.smoothing`"),
            ("RATELIMITD__SHED__MODE", "loud", "shed.mode"),
            ("RATELIMITD__SHED__DEFAULT_PRIORITY", "URGENT", "shed.default_priority"),
        ] {
            let err = Config::load(None, env(&[(key, value)])).unwrap_err().to_string();
            assert!(err.contains(named), "{key}={value}: {err}");
        }
    }

    #[test]
    fn unknown_key_is_rejected() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.yaml");
        std::fs::write(&file, "redis:\n  timeout: 7\n").unwrap();
        let err = Config::load(Some(&file), HashMap::new()).unwrap_err().to_string();
        assert!(err.contains("timeout"), "{err}");
    }

    #[test]
    fn cluster_seeds_and_password_keys() {
        let config = Config::load(
            None,
            env(&[
                ("RATELIMITD__REDIS__URL", "redis://10.0.0.1:7000, redis://10.0.0.2:7000"),
                ("RATELIMITD__REDIS__CLUSTER", "true"),
                ("RATELIMITD__REDIS__PASSWORD", "s3cret"),
            ]),
        )
        .unwrap();
        assert_eq!(
            config.redis.seed_urls().collect::<Vec<_>>(),
            ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]
        );
        assert_eq!(config.redis.password().unwrap().as_deref(), Some("s3cret"));
        assert!(!format!("{config:?}").contains("s3cret"));

        let err = Config::load(None, env(&[("RATELIMITD__REDIS__URL", "redis://a:1,redis://b:2")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("`redis.url`") && err.contains("redis.cluster: true"), "{err}");
        let err = Config::load(None, env(&[("RATELIMITD__REDIS__CLUSTER", "true")])).unwrap_err().to_string();
        assert!(err.contains("`redis.cluster`"), "{err}");

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("password");
        std::fs::write(&file, "from-file\n").unwrap();
        let file_env = file.to_str().unwrap();
        let config = Config::load(
            None,
            env(&[
                ("RATELIMITD__REDIS__URL", "redis://127.0.0.1:1"),
                ("RATELIMITD__REDIS__PASSWORD_FILE", file_env),
            ]),
        )
        .unwrap();
        assert_eq!(config.redis.password().unwrap().as_deref(), Some("from-file"));
        let missing = dir.path().join("absent");
        let err = Config::load(
            None,
            env(&[
                ("RATELIMITD__REDIS__URL", "redis://127.0.0.1:1"),
                ("RATELIMITD__REDIS__PASSWORD_FILE", missing.to_str().unwrap()),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("`redis.password_file`") && err.contains("absent"), "{err}");
    }

    #[test]
    fn redis_password_is_redacted() {
        let config = RedisConfig {
            url: Some("redis://:hunter2@10.0.0.1:6379/0".to_owned()),
            ..RedisConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("***@10.0.0.1:6379"), "{shown}");
        assert_eq!(redact_url("redis://:a@h1:1,redis://:b@h2:2"), "redis://***@h1:1,redis://***@h2:2");
    }
}
