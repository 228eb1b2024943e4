//! The rules write path (docs/design.md §5): snapshots published to a compacted
//! Kafka topic, instances that subscribe to it, and the status topic on
//! which every instance says which version it serves.
//!
//! - `publish.rs`: `rules publish`, `rules rollback`, `rules history`
//!   (candidate compilation, provenance, the record in force);
//! - `subscribe.rs`: the subscription behind `rules.source: kafka`;
//! - `status.rs`: the instances' reports and `rules status`;
//! - `topic.rs`: reading a whole topic and producing to one.
//!
//! The record format is `rules::encoding` (pure); everything here is I/O.

pub mod publish;
pub mod status;
#[cfg(feature = "kafka")]
pub mod subscribe;
#[cfg_attr(not(feature = "kafka"), path = "topic_absent.rs")]
pub mod topic;

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
}
