//! The rules write path (docs/design.md §5): snapshots published to a compacted
//! Kafka topic, instances that subscribe to it, and the status topic on
//! which every instance says which version it serves.
//!
//! - `publish.rs`: `rules publish`, `rules rollback`, `rules history`
//!   (candidate compilation, provenance, the record in force);
//! - `subscribe.rs`: the subscription behind `rules.source: kafka`;
//! - `status.rs`: the instances' reports and `rules status`;
//! - `topic.rs`: reading a whole topic and producing to one;
//! - `git.rs`: `rules sync`'s reading of a commit's rule files.
//!
//! The record format is `rules::encoding` (pure); everything here is I/O.

pub mod git;
pub mod publish;
pub mod status;
#[cfg(feature = "kafka")]
pub mod subscribe;
#[cfg_attr(not(feature = "kafka"), path = "topic_absent.rs")]
pub mod topic;

use std::{collections::BTreeMap, fmt};

use serde::Deserialize;

/// `rules.kafka.*`
#[derive(Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RulesKafkaConfig {
    /// Bootstrap servers of the rules topic (`source: kafka`, `rules
    /// publish/rollback/history/status`).
    pub brokers: Option<String>,
    /// The compacted topic of snapshot records, keyed by version; one
    /// partition (`ratelimitd migrate` creates it).
    pub topic: String,
    /// The compacted topic where every instance reports the version it
    /// serves, keyed by instance (`ratelimitd rules status` reads it).
    pub status_topic: String,
    /// How long `serve` waits for the first snapshot before it falls back
    /// to `rules.path` / `rules.envoy_path` / `rules.limitador_path` (when
    /// set; otherwise it keeps waiting, not ready).
    pub wait_ms: u64,
    /// How often an instance reports its version to `status_topic`
    /// (besides on every swap).
    pub status_interval_ms: u64,
    /// Replication factor `ratelimitd migrate` creates both topics with.
    pub replication_factor: i32,
    /// The publishers' Ed25519 public keys (base64, as `rules keygen`
    /// prints them): an instance serves a record only when one of them
    /// signed it. List the old and the new key together to rotate without a
    /// gap. Required with `rules.source: kafka` unless `allow_unsigned`.
    pub verify_keys: Vec<String>,
    /// Serve unsigned records too. Anyone who can produce to the topic then
    /// sets every instance's limits: for a topic only trusted producers can
    /// write to.
    pub allow_unsigned: bool,
    /// The file holding this publisher's Ed25519 private key (`rules
    /// keygen` writes it), with which `rules publish` and `rules rollback`
    /// sign; `--signing-key` overrides it.
    pub signing_key_file: Option<std::path::PathBuf>,
    /// Serve only records that carry a passing gate report (`rules publish
    /// --gate`) for their own version, judged by thresholds at least as
    /// strict as this instance's `gate.*`; `rules publish` then refuses to
    /// publish without `--gate`.
    pub require_gate: bool,
    /// Any librdkafka property (`security.protocol`, `sasl.*`, `ssl.*`, …).
    /// Values are never logged.
    // Secrets (passwords, SASL and TLS properties, auth headers) are
    // never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
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
            verify_keys: Vec::new(),
            allow_unsigned: false,
            signing_key_file: None,
            require_gate: false,
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
            .field("verify_keys", &self.verify_keys)
            .field("allow_unsigned", &self.allow_unsigned)
            .field("signing_key_file", &self.signing_key_file)
            .field("require_gate", &self.require_gate)
            .field("properties", &self.properties.keys().map(|k| format!("{k}=***")).collect::<Vec<_>>())
            .finish()
    }
}

/// One record of a topic (`topic::read_all`).
#[derive(Debug, Clone)]
pub struct Record {
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its key, if any.
    pub key: Option<Vec<u8>>,
    /// Its value; `None` for a tombstone.
    pub payload: Option<Vec<u8>>,
}

/// Why a rollout command failed.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    /// A configuration key is missing or wrong.
    #[error("{0}")]
    Config(String),
    /// Kafka could not be reached or refused.
    #[error("{0}")]
    Kafka(String),
    /// No record on the topic has this version.
    #[error("no snapshot with version {0:?} on the rules topic (see `ratelimitd rules history`)")]
    Unknown(String),
    /// The Git repository could not be read (`rules sync`).
    #[error("{0}")]
    Git(String),
}
