//! `rules.*`: where native and Envoy rules come from (files, or snapshots
//! published to a Kafka topic), and how often files are checked for changes.

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::{api::xds::XdsConfig, limiter::Algorithm, rollout::RulesKafkaConfig, rules::PathForm};

/// `rules.source`
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
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
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RulesConfig {
    /// `files` (`rules.path`, `rules.envoy_path`), `kafka` (snapshots on `rules.kafka.topic`; the
    /// files, when set, are the fallback) or `xds` (Envoy rules from a management server,
    /// `rules.xds.*`; native rules from `rules.path`).
    pub source: RulesSource,
    /// A native rule YAML file, or a directory whose `*.yaml`/`*.yml` files
    /// together form the rule set. Unset: the example rules compiled into
    /// the binary (`examples/rules`) while `rules.examples` is on, unless
    /// `envoy_path` is set, in which case there are no native rules
    /// (`Check` answers NO_RULE). With `source: kafka`: the fallback, used
    /// only when no snapshot arrives within `rules.kafka.wait_ms`.
    pub path: Option<PathBuf>,
    /// Serve the example rules compiled into the binary when neither
    /// `rules.path` nor `rules.envoy_path` is set (the quick start). The
    /// container image turns it off, so an image started without rules
    /// serves none of the examples' limits: `serve` with `source: files`
    /// then refuses to start, naming the keys to set.
    pub examples: bool,
    /// How often `path` is checked for changes (metadata only; a file is read
    /// again only when its identity, size or mtime changed). 0 disables reload.
    pub reload_interval_ms: u64,
    /// envoyproxy/ratelimit-format YAML: a file, or a directory with one
    /// domain per file. Unset: `ShouldRateLimit` is not served (with
    /// `source: kafka` it always is, from the snapshot).
    pub envoy_path: Option<PathBuf>,
    /// Kuadrant limitador's limits file (a YAML list of limits with CEL conditions and
    /// variables): `ShouldRateLimit` is answered as limitador answers it, every limit of the
    /// request's domain (its namespace) that applies counted. Watched and swapped as `envoy_path`
    /// is. With `source: kafka` the limits come from the rules topic's records (`rules publish
    /// --limitador`) and this file is the fallback, served as `path` is. Not with `envoy_path`,
    /// nor with `source: xds`.
    pub limitador_path: Option<PathBuf>,
    /// How limitador's limits count: `first_hit_window` (limitador's own counters: a window
    /// opens at a counter's first hit and ends `seconds` later), or any rule algorithm
    /// (`sliding_window`: no `seconds`-long span admits more than `max_value`; `fixed_window`,
    /// `token_bucket`, `gcra`). A change restarts every count.
    #[serde(with = "crate::limiter::window::by_name")]
    pub limitador_algorithm: Algorithm,
    /// Accept a rule set with no rules (no native rule, no Envoy domain) from a file, a reload, the
    /// rules topic or xDS; off, such a set is refused like one that does not compile (counted, the
    /// last good set keeps serving; at start the service does not start; over xDS a NACK), since it
    /// would lift every limit at once. Turn it on where a control plane legitimately removes every
    /// limit.
    pub allow_empty: bool,
    /// How native rules' paths and the paths of `Check` requests are
    /// compared. Every instance of a fleet, and `rules publish`, must agree.
    pub path_matching: PathForm,
    /// The rules topic (`source: kafka`, `rules publish`, `rules status`).
    pub kafka: RulesKafkaConfig,
    /// The management server (`source: xds`).
    pub xds: XdsConfig,
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
            limitador_path: None,
            limitador_algorithm: Algorithm::FirstHitWindow,
            examples: true,
            allow_empty: false,
            path_matching: PathForm::default(),
            kafka: RulesKafkaConfig::default(),
            xds: XdsConfig::default(),
        }
    }
}

impl RulesConfig {
    /// Checks `rules.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.limitador_algorithm.releases() {
            return Err(invalid(
                "rules.limitador_algorithm",
                "concurrency counts requests in flight, not limitador's hits: a native rule's algorithm",
            ));
        }
        if self.path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid("rules.path", "must not be empty; leave it unset for the embedded rules"));
        }
        if self.envoy_path.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
            return Err(invalid(
                "rules.envoy_path",
                "must not be empty; leave it unset to not serve ShouldRateLimit",
            ));
        }
        self.validate_limitador()?;
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
        // Fails closed: without the publishers' keys anyone who can write
        // to the topic would set every instance's limits.
        if self.source == RulesSource::Kafka && kafka.verify_keys.is_empty() && !kafka.allow_unsigned {
            return Err(invalid(
                "rules.kafka.verify_keys",
                "list the publishers' public keys (ratelimitd rules keygen), or set rules.kafka.allow_unsigned: true",
            ));
        }
        if let Err((key, error)) = crate::rules::signing::Trust::of(&kafka.verify_keys, kafka.allow_unsigned)
        {
            return Err(invalid("rules.kafka.verify_keys", format!("{key:?}: {error}")));
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

impl RulesConfig {
    /// `rules.limitador_path`: a file, alone in answering `ShouldRateLimit`.
    fn validate_limitador(&self) -> Result<(), ConfigError> {
        let Some(path) = &self.limitador_path else { return Ok(()) };
        if path.as_os_str().is_empty() {
            return Err(invalid("rules.limitador_path", "must not be empty; leave it unset"));
        }
        if self.envoy_path.is_some() {
            return Err(invalid(
                "rules.limitador_path",
                "not with rules.envoy_path: both would answer ShouldRateLimit",
            ));
        }
        if self.source == RulesSource::Xds {
            return Err(invalid(
                "rules.limitador_path",
                "not with rules.source: xds (Envoy's configuration only)",
            ));
        }
        Ok(())
    }
}
