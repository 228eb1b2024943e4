//! `capture.*`: a sample of decided `Check` requests, mirrored for
//! `ratelimitd replay` and the publish gate.

use std::{collections::BTreeMap, fmt, path::PathBuf};

use serde::Deserialize;

use super::{ConfigError, invalid};

/// `capture.*`
#[derive(Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CaptureConfig {
    /// The share of users whose requests are captured, 0 to 1 (0: off, the
    /// default). Users, not requests, are sampled (by a hash of the user id
    /// keyed by `capture.salt`, the same on every instance), so a sampled
    /// user's requests are all captured and replay counts them exactly.
    /// Envoy requests are sampled by their domain and first descriptor.
    pub sample_ratio: f64,
    /// The secret that keys the sampling hash, at least 16 bytes, the same
    /// on every instance (set it as `RATELIMITD__CAPTURE__SALT` from a
    /// secret). Without it a client cannot tell which user ids are sampled,
    /// so it cannot choose to be captured and sway the publish gate.
    /// Required when `sample_ratio` is above 0. Never logged.
    // Secrets are never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub salt: Option<String>,
    /// The JSON-lines file records are appended to when `capture.kafka.brokers`
    /// is unset.
    ///
    /// Default: `capture.jsonl` in the state directory
    pub file: PathBuf,
    /// The file never grows past this; records that would take it there are
    /// dropped (counted).
    pub file_max_bytes: u64,
    /// Records waiting between the decision path and the writer, at most;
    /// past it a record is dropped (counted).
    pub queue_capacity: usize,
    /// The capture topic; `brokers` unset selects the file.
    pub kafka: CaptureKafkaConfig,
}

impl Default for CaptureConfig {
    fn default() -> Self {
        Self {
            sample_ratio: 0.0,
            salt: None,
            file: PathBuf::from(super::dlq::SYSTEM_STATE_DIR).join("capture.jsonl"),
            file_max_bytes: 1 << 30,
            queue_capacity: 16_384,
            kafka: CaptureKafkaConfig::default(),
        }
    }
}

/// `capture.kafka.*`
#[derive(Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct CaptureKafkaConfig {
    /// Bootstrap servers; unset: the file.
    pub brokers: Option<String>,
    /// The capture topic (`ratelimitd migrate` creates it).
    pub topic: String,
    /// Partitions `migrate` creates it with (replay orders by time, not offset).
    pub partitions: i32,
    /// Replication factor `migrate` creates it with.
    pub replication_factor: i32,
    /// `retention.ms` of the topic `migrate` creates.
    pub retention_ms: i64,
    /// Any librdkafka property; values are never logged.
    // Secrets (passwords, SASL and TLS properties, auth headers) are
    // never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub properties: BTreeMap<String, String>,
}

impl Default for CaptureKafkaConfig {
    fn default() -> Self {
        Self {
            brokers: None,
            topic: "ratelimit.capture".to_owned(),
            partitions: 6,
            replication_factor: 3,
            retention_ms: 7 * 24 * 3_600_000,
            properties: BTreeMap::new(),
        }
    }
}

impl fmt::Debug for CaptureKafkaConfig {
    // Properties carry SASL passwords and keys: show their names only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaptureKafkaConfig")
            .field("brokers", &self.brokers)
            .field("topic", &self.topic)
            .field("partitions", &self.partitions)
            .field("replication_factor", &self.replication_factor)
            .field("retention_ms", &self.retention_ms)
            .field("properties", &self.properties.keys().map(|k| format!("{k}=***")).collect::<Vec<_>>())
            .finish()
    }
}

impl fmt::Debug for CaptureConfig {
    // The salt is a secret: never printed.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CaptureConfig")
            .field("sample_ratio", &self.sample_ratio)
            .field("salt", &self.salt.as_ref().map(|_| "***"))
            .field("file", &self.file)
            .field("file_max_bytes", &self.file_max_bytes)
            .field("queue_capacity", &self.queue_capacity)
            .field("kafka", &self.kafka)
            .finish()
    }
}

impl CaptureConfig {
    /// Checks `capture.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(invalid(
                "capture.sample_ratio",
                format!("must be within 0..1, got {}", self.sample_ratio),
            ));
        }
        // Fails closed: an unkeyed (public) hash lets a client pick ids
        // that are sampled, and flood the capture the gate judges by.
        match &self.salt {
            None if self.sample_ratio > 0.0 => {
                return Err(invalid(
                    "capture.salt",
                    "required when capture.sample_ratio is above 0: a secret of at least 16 bytes, the same on every instance",
                ));
            }
            Some(salt) if salt.len() < 16 => {
                return Err(invalid("capture.salt", "must be at least 16 bytes"));
            }
            _ => {}
        }
        if self.file.as_os_str().is_empty() {
            return Err(invalid("capture.file", "must not be empty"));
        }
        if self.file_max_bytes < 1 << 20 {
            return Err(invalid("capture.file_max_bytes", "must be at least 1048576 (1 MiB)"));
        }
        if self.queue_capacity == 0 {
            return Err(invalid("capture.queue_capacity", "must be at least 1"));
        }
        let kafka = &self.kafka;
        if kafka.brokers.as_deref().is_some_and(|b| b.trim().is_empty()) {
            return Err(invalid("capture.kafka.brokers", "must not be empty; leave it unset for the file"));
        }
        super::valid_topic("capture.kafka.topic", &kafka.topic)?;
        if kafka.partitions < 1 {
            return Err(invalid("capture.kafka.partitions", "must be at least 1"));
        }
        if kafka.replication_factor < 1 {
            return Err(invalid("capture.kafka.replication_factor", "must be at least 1"));
        }
        if kafka.retention_ms < -1 || kafka.retention_ms == 0 {
            return Err(invalid("capture.kafka.retention_ms", "must be positive, or -1 for unlimited"));
        }
        if kafka.properties.contains_key("bootstrap.servers") {
            return Err(invalid(
                "capture.kafka.properties",
                "set bootstrap.servers through capture.kafka.brokers",
            ));
        }
        Ok(())
    }
}
