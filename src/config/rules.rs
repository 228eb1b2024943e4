//! `rules.*`: where native and Envoy rules come from (files, or snapshots
//! published to a Kafka topic), and how often files are checked for changes.

use std::{collections::BTreeMap, fmt, path::PathBuf};

use serde::Deserialize;

use super::{ConfigError, invalid};

/// `rules.source`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RulesSource {
    /// `rules.path` and `rules.envoy_path`, reloaded when they change.
    #[default]
    Files,
    /// Snapshots `ratelimitd rules publish` wrote to `rules.kafka.topic`;
    /// `rules.path` / `rules.envoy_path`, when set, are the fallback.
    Kafka,
    /// Envoy rules from an xDS management server (`rules.xds.*`), as
    /// envoyproxy/ratelimit's `CONFIG_TYPE=GRPC_XDS_SOTW`; native rules
    /// from `rules.path` as with `files`.
    Xds,
}

/// `rules.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RulesConfig {
    /// `files` (default) or `kafka`.
    pub source: RulesSource,
    /// A native rule YAML file, or a directory whose `*.yaml`/`*.yml` files
    /// together form the rule set. Unset: the example rules compiled into
    /// the binary (`examples/rules`), unless `envoy_path` is set, in which
    /// case there are no native rules (`Check` answers NO_RULE). With
    /// `source: kafka`: the fallback, used only when no snapshot arrives
    /// within `rules.kafka.wait_ms`.
    pub path: Option<PathBuf>,
    /// How often `path` is checked for changes (metadata only; a file is read
    /// again only when its identity, size or mtime changed). 0 disables reload.
    pub reload_interval_ms: u64,
    /// envoyproxy/ratelimit-format YAML: a file, or a directory with one
    /// domain per file. Unset: `ShouldRateLimit` is not served (with
    /// `source: kafka` it always is, from the snapshot).
    pub envoy_path: Option<PathBuf>,
    /// Accept a rule set with no rules (no native rule, no Envoy domain)
    /// from a file, the rules topic or xDS. Off: such a set is refused like
    /// one that does not compile (the last good set keeps serving; at start
    /// the service does not start), since it would lift every limit at once.
    pub allow_empty: bool,
    /// How native rules' paths and the paths of `Check` requests are
    /// compared. Every instance of a fleet, and `rules publish`, must agree.
    pub path_matching: PathMatchingConfig,
    /// The rules topic (`source: kafka`, `rules publish`, `rules status`).
    pub kafka: RulesKafkaConfig,
    /// The management server (`source: xds`).
    pub xds: XdsConfig,
}

/// `rules.xds.*`
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct XdsConfig {
    /// `http://host:port`, or `https://` for TLS.
    pub server_url: String,
    /// The node id announced (upstream's `CONFIG_GRPC_XDS_NODE_ID`).
    pub node_id: String,
    /// The node's metadata, strings (`CONFIG_GRPC_XDS_NODE_METADATA`).
    pub node_metadata: BTreeMap<String, String>,
    /// gRPC metadata sent with the stream (`CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS`).
    pub headers: BTreeMap<String, String>,
    /// With `https://`: PEM CA certificate(s) to trust instead of the system's.
    pub ca_file: Option<PathBuf>,
    /// With `https://`: PEM client certificate, for mTLS; with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's PEM private key.
    pub key_file: Option<PathBuf>,
    /// The name the server's certificate must carry, when it differs from
    /// the URL's host (`CONFIG_GRPC_XDS_SERVER_TLS_SAN`).
    pub server_name: Option<String>,
    /// Serve before the first configuration arrives (every Envoy
    /// descriptor then has no limit) instead of waiting for it
    /// (`FORCE_START_WITHOUT_INITIAL_CONFIG`).
    pub force_start: bool,
    /// Deadline for connecting to the server.
    pub connect_timeout_ms: u64,
    /// First wait before reconnecting after a broken stream; it doubles
    /// up to `retry_max_ms` (jittered).
    pub retry_initial_ms: u64,
    /// Longest wait between reconnects.
    pub retry_max_ms: u64,
    /// Largest response accepted (`XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES`).
    pub max_message_bytes: usize,
}

impl Default for XdsConfig {
    fn default() -> Self {
        Self {
            server_url: "http://localhost:18000".to_owned(),
            node_id: "default".to_owned(),
            node_metadata: BTreeMap::new(),
            headers: BTreeMap::new(),
            ca_file: None,
            cert_file: None,
            key_file: None,
            server_name: None,
            force_start: false,
            connect_timeout_ms: 3_000,
            retry_initial_ms: 1_000,
            retry_max_ms: 30_000,
            max_message_bytes: 4 << 20,
        }
    }
}

impl XdsConfig {
    /// Checks `rules.xds.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let https = self.server_url.starts_with("https://");
        if !(https || self.server_url.starts_with("http://")) {
            return Err(invalid(
                "rules.xds.server_url",
                format!("{:?} must start with http:// or https://", self.server_url),
            ));
        }
        if self.server_url.parse::<tonic::transport::Uri>().is_err() {
            return Err(invalid("rules.xds.server_url", format!("{:?} is not a URL", self.server_url)));
        }
        if !https && (self.ca_file.is_some() || self.cert_file.is_some() || self.server_name.is_some()) {
            return Err(invalid("rules.xds.server_url", "TLS settings need an https:// URL"));
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(invalid(
                "rules.xds.key_file",
                "set rules.xds.cert_file and rules.xds.key_file together",
            ));
        }
        if self.node_id.is_empty() {
            return Err(invalid("rules.xds.node_id", "must not be empty"));
        }
        for (name, value) in &self.headers {
            if tonic::metadata::MetadataKey::<tonic::metadata::Ascii>::from_bytes(name.as_bytes()).is_err()
                || tonic::metadata::MetadataValue::<tonic::metadata::Ascii>::try_from(value.as_str()).is_err()
            {
                return Err(invalid(
                    "rules.xds.headers",
                    format!("{name:?}: not a valid gRPC metadata entry"),
                ));
            }
        }
        if self.connect_timeout_ms == 0
            || self.retry_initial_ms == 0
            || self.retry_max_ms < self.retry_initial_ms
        {
            return Err(invalid(
                "rules.xds.retry_max_ms",
                "connect_timeout_ms and retry_initial_ms must be at least 1, retry_max_ms at least retry_initial_ms",
            ));
        }
        if !(1_024..=256 << 20).contains(&self.max_message_bytes) {
            return Err(invalid("rules.xds.max_message_bytes", "must be between 1024 and 268435456"));
        }
        Ok(())
    }
}

impl Default for RulesConfig {
    fn default() -> Self {
        Self {
            source: RulesSource::Files,
            path: None,
            reload_interval_ms: 1_000,
            envoy_path: None,
            allow_empty: false,
            path_matching: PathMatchingConfig::default(),
            kafka: RulesKafkaConfig::default(),
            xds: XdsConfig::default(),
        }
    }
}

/// `rules.path_matching.*`: what the canonical form of a path (always dot
/// segments removed, unreserved escapes decoded, `;` parameters cut, `//`
/// collapsed, query cut) does beyond that. Both off by default, as most
/// servers behave; turn one on where the backends behind do the same, so
/// that a variant they serve as one resource is counted as one.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PathMatchingConfig {
    /// `%2F` separates segments like `/`.
    pub decode_slashes: bool,
    /// ASCII letters compare without case.
    pub ignore_case: bool,
}

/// `rules.kafka.*`
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RulesKafkaConfig {
    /// Bootstrap servers, `host:port[,host:port…]`.
    pub brokers: Option<String>,
    /// The compacted topic of snapshot records, keyed by version; one
    /// partition (`ratelimitd migrate` creates it).
    pub topic: String,
    /// The compacted topic where every instance reports the version it
    /// serves, keyed by instance (`ratelimitd rules status` reads it).
    pub status_topic: String,
    /// How long `serve` waits for the first snapshot before it falls back
    /// to `rules.path` / `rules.envoy_path` (when set; otherwise it keeps
    /// waiting, not ready).
    pub wait_ms: u64,
    /// How often an instance reports its version to `status_topic`
    /// (besides on every swap).
    pub status_interval_ms: u64,
    /// Replication factor `ratelimitd migrate` creates both topics with.
    pub replication_factor: i32,
    /// Any librdkafka property (`security.protocol`, `sasl.*`, `ssl.*`, …).
    /// Values are never logged.
    pub properties: BTreeMap<String, String>,
}

impl Default for RulesKafkaConfig {
    fn default() -> Self {
        Self {
            brokers: None,
            topic: "ratelimit.rules".to_owned(),
            status_topic: "ratelimit.rules.status".to_owned(),
            wait_ms: 10_000,
            status_interval_ms: 10_000,
            replication_factor: 3,
            properties: BTreeMap::new(),
        }
    }
}

impl fmt::Debug for RulesKafkaConfig {
    // Properties carry SASL passwords and keys: show their names only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RulesKafkaConfig")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("status_topic", &self.status_topic)
            .field("wait_ms", &self.wait_ms)
            .field("status_interval_ms", &self.status_interval_ms)
            .field("replication_factor", &self.replication_factor)
            .field("properties", &self.properties.keys().map(|k| format!("{k}=***")).collect::<Vec<_>>())
            .finish()
    }
}

impl RulesConfig {
    /// Checks `rules.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid("rules.path", "must not be empty; leave it unset for the embedded rules"));
        }
        if self.envoy_path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid(
                "rules.envoy_path",
                "must not be empty; leave it unset to not serve ShouldRateLimit",
            ));
        }
        let kafka = &self.kafka;
        if kafka.brokers.as_deref().is_some_and(|b| b.trim().is_empty()) {
            return Err(invalid("rules.kafka.brokers", "must not be empty"));
        }
        if self.source == RulesSource::Xds {
            self.xds.validate()?;
        }
        if self.source == RulesSource::Kafka && kafka.brokers.is_none() {
            return Err(invalid("rules.kafka.brokers", "must be set when rules.source is kafka"));
        }
        super::valid_topic("rules.kafka.topic", &kafka.topic)?;
        super::valid_topic("rules.kafka.status_topic", &kafka.status_topic)?;
        if kafka.topic == kafka.status_topic {
            return Err(invalid("rules.kafka.status_topic", "must differ from rules.kafka.topic"));
        }
        if kafka.status_interval_ms < 100 {
            return Err(invalid("rules.kafka.status_interval_ms", "must be at least 100"));
        }
        if kafka.replication_factor < 1 {
            return Err(invalid("rules.kafka.replication_factor", "must be at least 1"));
        }
        if kafka.properties.contains_key("bootstrap.servers") {
            return Err(invalid(
                "rules.kafka.properties",
                "set bootstrap.servers through rules.kafka.brokers",
            ));
        }
        Ok(())
    }
}
