//! `dlq.*`: where failed decisions are recorded (a file, or a Kafka topic
//! through a spool).

use std::{collections::BTreeMap, fmt, path::PathBuf};

use serde::Deserialize;

use super::{ConfigError, invalid};

/// The state directory when the environment names none (see
/// [`super::state_dir`]); also the defaults of a `Config` built in code.
pub(super) const SYSTEM_STATE_DIR: &str = "/var/lib/ratelimitd";

/// `dlq.*`: the record of decisions the store could not make.
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct DlqConfig {
    /// The JSON-lines file records are appended to when no Kafka brokers are
    /// set, created (with its directory) at start; `-`: standard error, one
    /// line per record (collected with the container's logs). A file set
    /// here that cannot be written stops the start; the default one that
    /// cannot be written (a read-only root filesystem, no volume) sends the
    /// records to standard error instead, with a warning at start naming
    /// this key.
    ///
    /// Default: `dlq.jsonl` in the state directory: `$STATE_DIRECTORY`, else
    /// `$XDG_STATE_HOME/ratelimitd`, else `$HOME/.local/state/ratelimitd`, else
    /// `/var/lib/ratelimitd` (never the working directory)
    pub file: PathBuf,
    /// Whether `file` is the state directory's default (not set): set by
    /// [`Config::load`](super::Config::load).
    #[serde(skip)]
    pub file_is_default: bool,
    /// Records waiting between the decision path and the writer, at most.
    /// Past it a record is dropped (counted, logged): size it for bursts.
    pub queue_capacity: usize,
    /// Bytes of records waiting in that queue, at most (a record's bytes are
    /// its strings plus a fixed overhead). Past it a record is dropped.
    pub queue_max_bytes: u64,
    /// The file sink's file never grows past this; records that would take
    /// it there are dropped (counted, logged once a minute) until it is
    /// rotated away or emptied.
    pub file_max_bytes: u64,
    /// Request headers copied into records (comma-separated in the environment).
    pub header_allowlist: Vec<String>,
    /// This instance's name in records; default: the host name.
    ///
    /// Default: the host name
    pub instance_id: Option<String>,
    /// Where records wait, durably, until Kafka acknowledges them. Default:
    /// `spool/` in the state directory.
    ///
    /// Default: `spool/` in the state directory
    pub spool_dir: PathBuf,
    /// A spool segment is closed and a new one started past this size.
    pub spool_segment_bytes: u64,
    /// The spool's segments together never exceed this; records that would
    /// take them there are dropped (counted, logged once a minute) until
    /// Kafka has taken enough of them. At least 4 segments.
    pub spool_max_bytes: u64,
    /// Per rule, failure kind and answer, this many failed decisions of
    /// each `aggregate_interval_ms` are written as records of their own; the
    /// rest of the interval become one aggregate record (a sample, a
    /// `count`), so a flood cannot fill the queue or the disk cap.
    pub aggregate_after: u32,
    /// The interval of `aggregate_after`.
    pub aggregate_interval_ms: u64,
    /// The dead-letter topic; `brokers` unset selects the file sink.
    pub kafka: KafkaConfig,
}

impl Default for DlqConfig {
    fn default() -> Self {
        Self {
            file: PathBuf::from(SYSTEM_STATE_DIR).join("dlq.jsonl"),
            file_is_default: false,
            queue_capacity: 65_536,
            queue_max_bytes: 64 << 20,
            file_max_bytes: 1 << 30,
            header_allowlist: vec!["x-request-id".to_owned(), "user-agent".to_owned()],
            instance_id: None,
            spool_dir: PathBuf::from(SYSTEM_STATE_DIR).join("spool"),
            spool_segment_bytes: 16 << 20,
            spool_max_bytes: 1 << 30,
            aggregate_after: 10,
            aggregate_interval_ms: 1_000,
            kafka: KafkaConfig::default(),
        }
    }
}

/// `dlq.kafka.*`
#[derive(Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers; unset = file sink. Every Kafka key (this one, `capture.kafka.brokers`,
    /// `rules.kafka.brokers`, `rules.source: kafka`) needs a build with the cargo feature `kafka`
    /// (the default); a build without it refuses them by key.
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
    /// Any librdkafka property (YAML map in the config file), over the defaults
    /// `enable.idempotence=true`, `allow.auto.create.topics=false`, `acks=all`,
    /// `compression.type=lz4`, `linger.ms=5`, `message.timeout.ms=0`,
    /// `reconnect.backoff.max.ms=1000`.
    // Secrets (passwords, SASL and TLS properties, auth headers) are
    // never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub properties: BTreeMap<String, String>,
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

/// `dlq.file`'s value for standard error.
const STDERR: &str = "-";

impl DlqConfig {
    /// Whether records go to standard error by choice (`dlq.file: "-"`).
    pub fn to_stderr(&self) -> bool {
        self.file.as_os_str() == STDERR
    }

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

impl DlqConfig {
    /// Checks `dlq.*` and `dlq.kafka.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.queue_capacity == 0 {
            return Err(invalid("dlq.queue_capacity", "must be at least 1"));
        }
        if self.file.as_os_str().is_empty() {
            return Err(invalid("dlq.file", "must not be empty"));
        }
        if self.spool_segment_bytes < 4_096 {
            return Err(invalid("dlq.spool_segment_bytes", "must be at least 4096"));
        }
        if self.queue_max_bytes < 1 << 20 {
            return Err(invalid("dlq.queue_max_bytes", "must be at least 1048576 (1 MiB)"));
        }
        if self.file_max_bytes < 1 << 20 {
            return Err(invalid("dlq.file_max_bytes", "must be at least 1048576 (1 MiB)"));
        }
        // Acknowledged records are freed a segment at a time, and only once
        // a newer segment exists: room for a few segments keeps it moving.
        if self.spool_max_bytes < self.spool_segment_bytes.saturating_mul(4) {
            return Err(invalid("dlq.spool_max_bytes", "must be at least 4 x dlq.spool_segment_bytes"));
        }
        if !(10..=3_600_000).contains(&self.aggregate_interval_ms) {
            return Err(invalid("dlq.aggregate_interval_ms", "must be between 10 and 3600000"));
        }
        self.kafka.validate()
    }
}

impl KafkaConfig {
    /// Checks `dlq.kafka.*`; every error names its key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.brokers.as_deref().is_some_and(|b| b.trim().is_empty()) {
            return Err(invalid("dlq.kafka.brokers", "must not be empty; leave it unset for the file sink"));
        }
        super::valid_topic("dlq.kafka.topic", &self.topic)?;
        if self.partitions < 1 {
            return Err(invalid("dlq.kafka.partitions", "must be at least 1"));
        }
        if self.replication_factor < 1 {
            return Err(invalid("dlq.kafka.replication_factor", "must be at least 1"));
        }
        if self.retention_ms < -1 || self.retention_ms == 0 {
            return Err(invalid("dlq.kafka.retention_ms", "must be positive, or -1 for unlimited"));
        }
        if self.properties.contains_key("bootstrap.servers") {
            return Err(invalid("dlq.kafka.properties", "set bootstrap.servers through dlq.kafka.brokers"));
        }
        Ok(())
    }
}
