//! The rules topic in a build without Kafka (cargo feature `kafka` off):
//! the same calls as `topic.rs`, each failing with why. The configuration
//! refuses every Kafka setting in such a build, so they are reached only
//! by the `rules` commands, which then say what is missing.

use std::{collections::BTreeMap, time::Duration};

use super::RolloutError;

pub use super::Record;

/// A producer: none can exist in this build.
#[derive(Debug)]
pub enum Producer {}

fn absent() -> RolloutError {
    RolloutError::Kafka("this build has no Kafka support (cargo feature `kafka`)".to_owned())
}

/// Fails: no Kafka in this build.
pub fn read_all(
    _brokers: &str,
    _properties: &BTreeMap<String, String>,
    _topic: &str,
) -> Result<Vec<Record>, RolloutError> {
    Err(absent())
}

/// Fails: no Kafka in this build.
pub(crate) fn producer(
    _brokers: &str,
    _properties: &BTreeMap<String, String>,
    _timeout: Duration,
) -> Result<Producer, RolloutError> {
    Err(absent())
}

/// Unreachable: no [`Producer`] exists.
pub async fn produce(
    producer: &Producer,
    _topic: &str,
    _key: &str,
    _payload: Option<&[u8]>,
) -> Result<i64, RolloutError> {
    match *producer {}
}
