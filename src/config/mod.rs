//! The service configuration: one typed, documented, defaulted and validated
//! [`Config`], loaded before anything binds.
//!
//! Sources, lowest precedence first: built-in defaults, the YAML file given by
//! `--config`, then environment variables `RATELIMITD__SECTION__KEY`
//! (e.g. `RATELIMITD__REDIS__TIMEOUT_MS=5`), which with
//! `RATELIMITD_COMPAT=envoyproxy` also come from envoyproxy/ratelimit's own
//! variables ([`compat`]). Tests pass the environment as a
//! map ([`Config::load`]) instead of mutating the process environment.
//!
//! One module per section, each with its own `validate()` naming the full
//! key; this module only composes them. No default depends on the working
//! directory: native rules default to the set compiled into the binary, and
//! the dead-letter file and spool to a state directory ([`state_dir`]).

mod admin;
mod capture;
pub mod compat;
mod dlq;
mod environment;
mod envoy;
mod global;
mod grpc;
mod http;
mod limits;
mod local;
mod memory;
mod overload;
mod redis;
mod rlqs;
mod rules;
mod shed;
mod telemetry;
mod yaml;

use std::{
    collections::HashMap,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use serde::Deserialize;

pub use admin::{ConsoleConfig, ConsoleUser, ProxyConfig, Role};
pub use capture::{CaptureConfig, CaptureKafkaConfig};
pub use dlq::{DlqConfig, KafkaConfig};
pub use grpc::GrpcConfig;
pub use http::HttpConfig;
pub use limits::LimitsConfig;
pub use local::LocalConfig;
pub use memory::MemoryConfig;
pub use overload::{DenialCacheConfig, OverloadConfig};
pub use rules::{RulesConfig, RulesSource};
pub use shed::ShedConfig;

pub use crate::global::GlobalConfig;
pub use crate::quota::RlqsConfig;

// Settings owned by the parts they configure, composed here.
pub use crate::{
    api::envoy_settings::{
        EnvoyAlgorithm, EnvoyFailureMode, EnvoyHeaderFormat, EnvoyHitsCounted, EnvoySettings, EnvoyZeroHits,
    },
    api::xds::XdsConfig,
    decision::TenantSource,
    limiter::settings::{Connection, RedisConfig, redact_url},
    rollout::RulesKafkaConfig,
    rules::{OverloadMode, PathForm, gate::GateThresholds},
    telemetry::settings::{LogConfig, LogFormat, TelemetryConfig},
    tls::GrpcTlsConfig,
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
    Invalid {
        /// The full dotted key, e.g. `redis.timeout_ms`.
        key: &'static str,
        /// What is wrong with its value.
        message: String,
    },
}

/// A [`ConfigError::Invalid`] for `key`.
pub(crate) fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key, message: message.into() }
}

/// The whole configuration of `ratelimitd serve`.
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
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
    /// The local limiter: decides at this instance's share when the store cannot.
    pub local: LocalConfig,
    /// Where native and Envoy rules come from and how often they are checked for changes.
    pub rules: RulesConfig,
    /// Bounds on request fields, answered with INVALID_ARGUMENT when exceeded.
    pub limits: LimitsConfig,
    /// Priority load shedding.
    pub shed: ShedConfig,
    /// The probabilistic drop layer of rules with an `overload` directive.
    pub overload: OverloadConfig,
    /// The local cache of exact denials.
    pub denial_cache: DenialCacheConfig,
    /// Where failed decisions are recorded.
    pub dlq: DlqConfig,
    /// A sample of decided requests, for replay.
    pub capture: CaptureConfig,
    /// The publish gate: how much CRITICAL traffic a candidate may newly deny.
    pub gate: GateThresholds,
    /// Envoy's `ShouldRateLimit` (active when `rules.envoy_path` is set).
    pub envoy: EnvoySettings,
    /// Logging.
    pub log: LogConfig,
    /// Trace export.
    pub telemetry: TelemetryConfig,
    /// The admin console (`ratelimitd admin`).
    pub admin: ConsoleConfig,
    /// This deployment's region, one of `global.regions`.
    pub region: Option<String>,
    /// Global limits shared with other regions (off while `global.regions`
    /// is empty).
    pub global: GlobalConfig,
    /// Envoy's Rate Limit Quota Service (served with the Envoy rules).
    pub rlqs: RlqsConfig,
    /// envoyproxy/ratelimit variables that were set but not carried over
    /// (`RATELIMITD_COMPAT=envoyproxy`), logged once at start.
    #[serde(skip)]
    pub compat: compat::Compat,
    /// What the environment set that is not honoured as written (a
    /// misspelt `RATELIMITD_…` name), logged once at start.
    #[serde(skip)]
    pub notes: Vec<String>,
}

/// Where state that must survive a restart (the dead-letter file and spool)
/// goes by default, from the environment `env`: `$STATE_DIRECTORY` (systemd's
/// `StateDirectory=`), else `$XDG_STATE_HOME/ratelimitd`, else
/// `$HOME/.local/state/ratelimitd`, else `/var/lib/ratelimitd`. Never the
/// working directory.
pub fn state_dir(env: &HashMap<String, String>) -> PathBuf {
    let set = |name: &str| env.get(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("STATE_DIRECTORY")
        .or_else(|| set("XDG_STATE_HOME").map(|d| d.join("ratelimitd")))
        .or_else(|| set("HOME").map(|d| d.join(".local/state/ratelimitd")))
        .unwrap_or_else(|| PathBuf::from(dlq::SYSTEM_STATE_DIR))
}

impl Config {
    /// Loads defaults < `file` < `env` and validates the result. `env` is the
    /// process environment in production and a plain map in tests.
    pub fn load(file: Option<&Path>, mut env: HashMap<String, String>) -> Result<Self, ConfigError> {
        let compat = compat::apply(&mut env)?;
        let notes = environment::unread(&env);
        environment::otel(&mut env)?;
        let state = state_dir(&env);
        let (dlq_file, local_dir) = (state.join("dlq.jsonl"), state.join("local"));
        let mut builder = config::Config::builder()
            .set_default("dlq.file", path_value(&dlq_file))
            .and_then(|b| b.set_default("dlq.spool_dir", path_value(&state.join("spool"))))
            .and_then(|b| b.set_default("local.state_dir", path_value(&local_dir)))
            .and_then(|b| b.set_default("capture.file", path_value(&state.join("capture.jsonl"))))
            .and_then(|b| b.set_default("admin.audit_log", path_value(&state.join("admin-audit.jsonl"))))
            .map_err(|e| ConfigError::Load(e.to_string()))?;
        if let Some(file) = file {
            if !file.is_file() {
                return Err(ConfigError::Load(format!("--config {}: no such file", file.display())));
            }
            let text = std::fs::read_to_string(file)
                .map_err(|e| ConfigError::Load(format!("--config {}: {e}", file.display())))?;
            builder = builder.add_source(yaml::YamlFile { origin: file.display().to_string(), text });
        }
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .list_separator(",")
                .with_list_parse_key("dlq.header_allowlist")
                .with_list_parse_key("envoy.request_limit_domains")
                .source(Some(env.into_iter().collect())),
        );
        let raw = builder.build().map_err(|e| ConfigError::Load(e.to_string()))?;
        let mut config: Config = raw.try_deserialize().map_err(|e| ConfigError::Load(e.to_string()))?;
        config.grpc.memory_limit = crate::budget::memory_limit(&config.shed.cgroup_root);
        config.dlq.file_is_default = config.dlq.file == dlq_file;
        config.local.state_dir_is_default = config.local.state_dir == local_dir;
        config.validate()?;
        config.compat = compat;
        config.notes = notes;
        Ok(config)
    }

    /// Checks ranges and consistency, section by section; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.grpc.validate()?;
        self.http.validate()?;
        self.redis.validate()?;
        self.memory.validate()?;
        self.local.validate()?;
        self.rules.validate()?;
        self.limits.validate()?;
        self.shed.validate()?;
        self.overload.validate()?;
        self.denial_cache.validate()?;
        self.dlq.validate()?;
        self.capture.validate()?;
        if let Some((key, message)) = self.gate.invalid() {
            return Err(invalid(key, message));
        }
        self.envoy.validate()?;
        self.log.validate()?;
        self.telemetry.validate()?;
        self.admin.validate()?;
        self.global.validate(self.region.as_deref())?;
        self.rlqs.validate()?;
        self.kafka_built()
    }

    /// Whose rules records an instance of this configuration serves:
    /// `rules.kafka.verify_keys` (validated; were they not, nothing would be
    /// trusted: fail closed), `allow_unsigned`, and with `require_gate` the
    /// thresholds of `gate.*`.
    pub fn rules_trust(&self) -> crate::rules::signing::Trust {
        let kafka = &self.rules.kafka;
        crate::rules::signing::Trust::of(&kafka.verify_keys, kafka.allow_unsigned)
            .unwrap_or_default()
            .requiring_gate(kafka.require_gate.then_some(self.gate))
    }

    /// How this instance compiles a rules record: `envoy.algorithm` and
    /// `envoy.merge_domains`, `rules.path_matching`, `rules.limitador_algorithm`.
    pub fn compilers(&self) -> crate::rules::encoding::Compilers {
        crate::rules::encoding::Compilers {
            envoy: self.envoy.compile(),
            paths: self.rules.path_matching,
            limitador: self.rules.limitador_algorithm,
        }
    }

    /// A Kafka setting in a build without Kafka (cargo feature `kafka`)
    /// fails closed, naming its key: failed decisions would otherwise go
    /// to a file the operator does not read, and rules never arrive.
    fn kafka_built(&self) -> Result<(), ConfigError> {
        if cfg!(feature = "kafka") {
            return Ok(());
        }
        let set = [
            ("dlq.kafka.brokers", self.dlq.kafka.brokers.is_some()),
            ("capture.kafka.brokers", self.capture.kafka.brokers.is_some()),
            ("rules.kafka.brokers", self.rules.kafka.brokers.is_some()),
            ("rules.source", self.rules.source == RulesSource::Kafka),
        ];
        match set.into_iter().find(|(_, set)| *set) {
            Some((key, _)) => {
                Err(invalid(key, "this build has no Kafka support (built without the cargo feature `kafka`)"))
            }
            None => Ok(()),
        }
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

/// Checks that `topic` is a valid Kafka topic name; the error names `key`.
pub(crate) fn valid_topic(key: &'static str, topic: &str) -> Result<(), ConfigError> {
    if topic.is_empty()
        || topic.len() > 249
        || !topic.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
    {
        return Err(invalid(key, format!("{topic:?} is not a valid Kafka topic name")));
    }
    Ok(())
}

fn path_value(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shed::{Priority, ShedMode};

    /// Built without Kafka, every Kafka setting is refused by its key; built
    /// with it, each is taken.
    #[test]
    fn kafka_settings_need_a_build_with_kafka() {
        for (key, value) in [
            ("RATELIMITD__DLQ__KAFKA__BROKERS", "k:9092"),
            ("RATELIMITD__CAPTURE__KAFKA__BROKERS", "k:9092"),
            ("RATELIMITD__RULES__KAFKA__BROKERS", "k:9092"),
        ] {
            let env = HashMap::from([(key.to_owned(), value.to_owned())]);
            let loaded = Config::load(None, env);
            if cfg!(feature = "kafka") {
                assert!(loaded.is_ok(), "{key}: {loaded:?}");
            } else {
                let error = loaded.unwrap_err().to_string();
                assert!(
                    error.contains("no Kafka support")
                        && error.contains(&key[12..].to_lowercase().replace("__", ".")),
                    "{error}"
                );
            }
        }
    }

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn defaults_are_the_embedded_mode() {
        let config = Config::load(None, HashMap::new()).unwrap();
        assert!(config.redis.connection.url.is_none());
        assert_eq!(config.grpc.listen, "0.0.0.0:8081");
        assert_eq!(config.rules.path, None, "the embedded rules");
    }

    #[test]
    fn no_default_depends_on_the_working_directory() {
        let config = Config::load(None, env(&[("HOME", "/home/ann")])).unwrap();
        assert_eq!(config.dlq.file, PathBuf::from("/home/ann/.local/state/ratelimitd/dlq.jsonl"));
        assert_eq!(config.dlq.spool_dir, PathBuf::from("/home/ann/.local/state/ratelimitd/spool"));
        let config = Config::load(None, env(&[("HOME", "/home/ann"), ("XDG_STATE_HOME", "/state")])).unwrap();
        assert_eq!(config.dlq.file, PathBuf::from("/state/ratelimitd/dlq.jsonl"));
        let config = Config::load(None, env(&[("STATE_DIRECTORY", "/var/lib/rl"), ("HOME", "/h")])).unwrap();
        assert_eq!(config.dlq.spool_dir, PathBuf::from("/var/lib/rl/spool"));
        let config = Config::load(None, HashMap::new()).unwrap();
        assert_eq!(config.dlq.file, DlqConfig::default().file);
        assert!(config.dlq.file.is_absolute() && config.dlq.spool_dir.is_absolute());
        // Set explicitly, the key wins over the state directory.
        let config =
            Config::load(None, env(&[("HOME", "/h"), ("RATELIMITD__DLQ__FILE", "/x/dlq.jsonl")])).unwrap();
        assert_eq!(config.dlq.file, PathBuf::from("/x/dlq.jsonl"));
        // Only a default may fall back (to standard error, to no local state).
        assert!(!config.dlq.file_is_default && config.local.state_dir_is_default);
        let config = Config::load(None, env(&[("HOME", "/h")])).unwrap();
        assert!(config.dlq.file_is_default && !config.dlq.to_stderr());
        let config = Config::load(
            None,
            env(&[("RATELIMITD__DLQ__FILE", "-"), ("RATELIMITD__LOCAL__STATE_DIR", "/x/local")]),
        )
        .unwrap();
        assert!(config.dlq.to_stderr() && !config.dlq.file_is_default && !config.local.state_dir_is_default);
    }

    #[test]
    fn envoy_priority_keys_parse_and_validate() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.yaml");
        std::fs::write(
            &file,
            "envoy:\n  priority_key: tier\n  domain_priority:\n    checkout: CRITICAL\n    batch: BULK\n",
        )
        .unwrap();
        let config = Config::load(Some(&file), HashMap::new()).unwrap();
        assert_eq!(config.envoy.priority_key, "tier");
        assert_eq!(config.envoy.domain_priority.get("checkout"), Some(&crate::shed::Priority::Critical));
        std::fs::write(&file, "envoy:\n  domain_priority:\n    checkout: URGENT\n").unwrap();
        let err = Config::load(Some(&file), HashMap::new()).unwrap_err().to_string();
        assert!(err.contains("domain_priority") || err.contains("URGENT"), "{err}");
        let err =
            Config::load(None, env(&[("RATELIMITD__ENVOY__REASON_HEADER", "a b")])).unwrap_err().to_string();
        assert!(err.contains("`envoy.reason_header`"), "{err}");
        assert!(
            Config::load(None, env(&[("RATELIMITD__ENVOY__REASON_HEADER", "")])).is_ok(),
            "empty turns it off"
        );
    }

    /// The request byte budget is an eighth of the cgroup's memory limit
    /// unless set; a setting over half the limit, or a limit too small for
    /// the largest message, refuses to start, naming the key.
    #[test]
    fn the_request_byte_budget_follows_the_memory_limit() {
        let cgroup = tempfile::tempdir().unwrap();
        let root = cgroup.path().to_str().unwrap();
        let load = |pairs: &[(&str, &str)]| {
            let mut pairs = pairs.to_vec();
            pairs.push(("RATELIMITD__SHED__CGROUP_ROOT", root));
            Config::load(None, env(&pairs))
        };
        assert_eq!(load(&[]).unwrap().grpc.request_bytes_in_flight(), 128 << 20, "no limit: 128 MiB");
        std::fs::write(cgroup.path().join("memory.max"), "max\n").unwrap();
        assert_eq!(load(&[]).unwrap().grpc.request_bytes_in_flight(), 128 << 20, "max: 128 MiB");
        std::fs::write(cgroup.path().join("memory.max"), "4294967296\n").unwrap();
        let config = load(&[]).unwrap();
        assert_eq!(config.grpc.request_bytes_in_flight(), 512 << 20, "an eighth of 4 GiB");
        assert_eq!(config.grpc.byte_shares().untrusted, 256 << 20);
        let set = ("RATELIMITD__GRPC__MAX_REQUEST_BYTES_IN_FLIGHT", "67108864");
        assert_eq!(load(&[set]).unwrap().grpc.request_bytes_in_flight(), 64 << 20, "set, it wins");
        let over = ("RATELIMITD__GRPC__MAX_REQUEST_BYTES_IN_FLIGHT", "2147483649");
        let err = load(&[over]).unwrap_err().to_string();
        assert!(err.contains("`grpc.max_request_bytes_in_flight`") && err.contains("over half"), "{err}");
        std::fs::write(cgroup.path().join("memory.max"), "16777216\n").unwrap();
        let err = load(&[]).unwrap_err().to_string();
        assert!(
            err.contains("`grpc.max_request_bytes_in_flight`")
                && err.contains("grpc.max_batch_message_bytes"),
            "{err}"
        );
    }

    #[test]
    fn environment_overrides_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.yaml");
        std::fs::write(&file, "redis:\n  timeout_ms: 7\n  url: redis://127.0.0.1:1\n").unwrap();
        let config = Config::load(Some(&file), env(&[("RATELIMITD__REDIS__TIMEOUT_MS", "3")])).unwrap();
        assert_eq!(config.redis.timeout_ms, 3);
        assert_eq!(config.redis.connection.url.as_deref(), Some("redis://127.0.0.1:1"));
    }

    #[test]
    fn wrong_type_names_the_key() {
        let err =
            Config::load(None, env(&[("RATELIMITD__REDIS__TIMEOUT_MS", "soon")])).unwrap_err().to_string();
        assert!(err.contains("redis.timeout_ms"), "{err}");
    }

    #[test]
    fn limitador_limits_answer_should_rate_limit_alone() {
        let load = |pairs: &[(&str, &str)]| Config::load(None, env(pairs)).map(|c| c.rules.limitador_path);
        let path = ("RATELIMITD__RULES__LIMITADOR_PATH", "/etc/limitador/limits.yaml");
        assert!(load(&[path]).unwrap().is_some());
        let err = load(&[path, ("RATELIMITD__RULES__ENVOY_PATH", "/etc/envoy")]).unwrap_err().to_string();
        assert!(err.contains("`rules.limitador_path`") && err.contains("rules.envoy_path"), "{err}");
        let err = load(&[path, ("RATELIMITD__RULES__SOURCE", "xds")]).unwrap_err().to_string();
        assert!(err.contains("`rules.limitador_path`"), "{err}");
    }

    #[test]
    fn out_of_range_names_the_key() {
        let err = Config::load(None, env(&[("RATELIMITD__REDIS__TIMEOUT_MS", "0")])).unwrap_err().to_string();
        assert!(err.contains("`redis.timeout_ms`"), "{err}");
        let err =
            Config::load(None, env(&[("RATELIMITD__GRPC__LISTEN", "nowhere")])).unwrap_err().to_string();
        assert!(err.contains("`grpc.listen`"), "{err}");
        for key in ["max_concurrent_streams", "max_connections"] {
            let var = format!("RATELIMITD__GRPC__{}", key.to_uppercase());
            let err = Config::load(None, env(&[(&var, "0")])).unwrap_err().to_string();
            assert!(err.contains(&format!("`grpc.{key}`")), "{err}");
        }
        for key in [
            "max_store_calls_per_connection",
            "max_store_calls_per_tenant",
            "max_store_calls_per_peer",
            "max_connections_per_peer",
        ] {
            let var = format!("RATELIMITD__GRPC__{}", key.to_uppercase());
            let err = Config::load(None, env(&[(&var, "1048577")])).unwrap_err().to_string();
            assert!(err.contains(&format!("`grpc.{key}`")), "{err}");
            assert!(Config::load(None, env(&[(&var, "0")])).is_ok(), "{key}: 0 is unbounded");
        }
        let keepalive = |interval: &str| {
            let pairs = [
                ("RATELIMITD__GRPC__KEEPALIVE_INTERVAL_MS", interval),
                ("RATELIMITD__GRPC__KEEPALIVE_TIMEOUT_MS", "0"),
            ];
            Config::load(None, env(&pairs))
        };
        let err = keepalive("1000").unwrap_err().to_string();
        assert!(err.contains("`grpc.keepalive_timeout_ms`"), "{err}");
        assert!(keepalive("0").is_ok(), "no timeout is needed with keepalive off");
        for prefix in ["{tag}:", "a b", &"x".repeat(65)] {
            let err = Config::load(None, env(&[("RATELIMITD__REDIS__KEY_PREFIX", prefix)]))
                .unwrap_err()
                .to_string();
            assert!(err.contains("`redis.key_prefix`"), "{prefix}: {err}");
        }
        let unix = Config::load(None, env(&[("RATELIMITD__REDIS__URL", "unix:///run/redis.sock")])).unwrap();
        assert_eq!(unix.redis.connection.url.as_deref(), Some("unix:///run/redis.sock"));
    }

    #[test]
    fn sentinel_keys_validate() {
        let sentinel = |extra: &[(&str, &str)]| {
            let mut pairs = vec![
                ("RATELIMITD__REDIS__URL", "redis://s1:26379,redis://s2:26379"),
                ("RATELIMITD__REDIS__SENTINEL_MASTER", "mymaster"),
            ];
            pairs.extend_from_slice(extra);
            Config::load(None, env(&pairs))
        };
        let ok = sentinel(&[]).unwrap();
        assert_eq!(ok.redis.connection.sentinel_master.as_deref(), Some("mymaster"));
        let err = sentinel(&[("RATELIMITD__REDIS__CLUSTER", "true")]).unwrap_err().to_string();
        assert!(err.contains("`redis.sentinel_master`"), "{err}");
        let err = sentinel(&[("RATELIMITD__REDIS__SENTINEL_MASTER", "my master")]).unwrap_err().to_string();
        assert!(err.contains("`redis.sentinel_master`"), "{err}");
        let err = Config::load(
            None,
            env(&[
                ("RATELIMITD__REDIS__URL", "rediss://s1:26379"),
                ("RATELIMITD__REDIS__SENTINEL_MASTER", "m"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("`redis.url`"), "{err}");
        let shown =
            format!("{:?}", sentinel(&[("RATELIMITD__REDIS__SENTINEL_PASSWORD", "hush")]).unwrap().redis);
        assert!(!shown.contains("hush"), "{shown}");
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
            config.redis.connection.seed_urls().collect::<Vec<_>>(),
            ["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"]
        );
        assert_eq!(config.redis.connection.password().unwrap().as_deref(), Some("s3cret"));
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
        assert_eq!(config.redis.connection.password().unwrap().as_deref(), Some("from-file"));
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

    /// limitador's limits count hits: an algorithm of requests in flight
    /// is refused for them, naming the key.
    #[test]
    fn limitador_limits_cannot_count_requests_in_flight() {
        let error = Config::load(None, env(&[("RATELIMITD__RULES__LIMITADOR_ALGORITHM", "concurrency")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("rules.limitador_algorithm") && error.contains("in flight"), "{error}");
    }

    /// `redis` and `global.redis` read one connection type: each key as its
    /// field's type (a numeric password from the environment stays the
    /// string it was), an unknown key refused by name, secrets hidden in
    /// both.
    #[test]
    fn both_redis_sections_read_one_connection_type() {
        let config = Config::load(
            None,
            env(&[
                ("RATELIMITD__REDIS__URL", "redis://127.0.0.1:1"),
                ("RATELIMITD__REDIS__PASSWORD", "123456"),
                ("RATELIMITD__REDIS__KEY_PREFIX", "7"),
                ("RATELIMITD__REDIS__TIMEOUT_MS", "25"),
                ("RATELIMITD__GLOBAL__REDIS__PASSWORD", "987654"),
            ]),
        )
        .unwrap();
        assert_eq!(config.redis.connection.password().unwrap().as_deref(), Some("123456"));
        assert_eq!((config.redis.connection.key_prefix.as_str(), config.redis.timeout_ms), ("7", 25));
        assert_eq!(config.global.redis.password.as_deref(), Some("987654"));
        let shown = format!("{config:?}");
        assert!(!shown.contains("123456") && !shown.contains("987654"), "{shown}");
        for key in ["RATELIMITD__REDIS__URLL", "RATELIMITD__GLOBAL__REDIS__TIMEOUT_MS"] {
            let error = Config::load(None, env(&[(key, "1")])).unwrap_err().to_string();
            assert!(error.contains("unknown field"), "{key}: {error}");
        }
    }

    #[test]
    fn redis_password_is_redacted() {
        let config = RedisConfig {
            connection: Connection {
                url: Some("redis://:hunter2@10.0.0.1:6379/0".to_owned()),
                ..Default::default()
            },
            ..RedisConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(!shown.contains("hunter2"), "{shown}");
        assert!(shown.contains("***@10.0.0.1:6379"), "{shown}");
        assert_eq!(redact_url("redis://:a@h1:1,redis://:b@h2:2"), "redis://***@h1:1,redis://***@h2:2");
        // A comma inside a password is not a seed separator.
        assert_eq!(redact_url("redis://:se,cret@h1:1"), "redis://***@h1:1");
        assert_eq!(
            redact_url("redis://:a,b@h1:1, rediss://:c,d@h2:2"),
            "redis://***@h1:1, rediss://***@h2:2"
        );
        let config = RedisConfig {
            connection: Connection {
                url: Some("redis://:p,w@h1:1,redis://h2:2".to_owned()),
                ..Default::default()
            },
            ..RedisConfig::default()
        };
        assert_eq!(config.connection.seed_urls().collect::<Vec<_>>(), ["redis://:p,w@h1:1", "redis://h2:2"]);
    }
}
