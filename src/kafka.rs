//! The librdkafka plumbing every Kafka user shares (the dead-letter
//! pipeline, `audit`, the rules topic, capture, `migrate`): client
//! configuration, and reading a whole topic as of now without joining a
//! consumer group.

use std::{collections::BTreeMap, time::Duration};

use rdkafka::{
    ClientConfig, Message as _, Offset, TopicPartitionList,
    consumer::{BaseConsumer, Consumer},
};

/// A librdkafka configuration: `defaults`, then the operator's `properties`.
pub fn client_config(
    brokers: &str,
    properties: &BTreeMap<String, String>,
    defaults: &[(&str, &str)],
) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", brokers);
    for (key, value) in defaults {
        config.set(*key, *value);
    }
    for (key, value) in properties {
        config.set(key, value);
    }
    config
}

/// The partitions of `topic`, or an error saying it does not exist.
pub fn partitions(
    consumer: &BaseConsumer,
    brokers: &str,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<i32>, String> {
    let metadata = consumer
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| format!("cannot reach Kafka at {brokers}: {e}"))?;
    match metadata.topics().iter().find(|t| t.name() == topic) {
        Some(t) if t.error().is_none() && !t.partitions().is_empty() => {
            Ok(t.partitions().iter().map(|p| p.id()).collect())
        }
        _ => {
            Err(format!("topic {topic:?} does not exist on {brokers} (create it with `ratelimitd migrate`)"))
        }
    }
}

/// One message of a topic, as [`read_topic`] hands it over.
#[derive(Debug, Clone, Copy)]
pub struct Read<'a> {
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its key, if any.
    pub key: Option<&'a [u8]>,
    /// Its value; `None` for a tombstone.
    pub payload: Option<&'a [u8]>,
}

/// Hands every message of `topic`, from each partition's low to its high
/// watermark as of now, to `each`, streaming (nothing is kept). No group is
/// joined and nothing is committed (`assign`, not `subscribe`). Later
/// messages are not waited for; 30 s without progress is an error.
pub fn read_topic(
    brokers: &str,
    properties: &BTreeMap<String, String>,
    topic: &str,
    group: &str,
    mut each: impl FnMut(Read<'_>) -> Result<(), String>,
) -> Result<(), String> {
    let timeout = Duration::from_secs(10);
    let consumer: BaseConsumer = client_config(
        brokers,
        properties,
        &[
            // A group id librdkafka requires, but no group is joined (assign,
            // not subscribe) and nothing is committed or stored.
            ("group.id", group),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("enable.partition.eof", "false"),
        ],
    )
    .create()
    .map_err(|e| format!("cannot create a Kafka consumer: {e}"))?;
    // The end of each partition as of now: later records are not waited for.
    let mut remaining: BTreeMap<i32, i64> = BTreeMap::new();
    let mut assignment = TopicPartitionList::new();
    for partition in partitions(&consumer, brokers, topic, timeout)? {
        let (low, high) = consumer
            .fetch_watermarks(topic, partition, timeout)
            .map_err(|e| format!("cannot read the offsets of {topic}/{partition}: {e}"))?;
        if high > low {
            remaining.insert(partition, high);
            assignment
                .add_partition_offset(topic, partition, Offset::Offset(low))
                .map_err(|e| e.to_string())?;
        }
    }
    if remaining.is_empty() {
        return Ok(());
    }
    consumer.assign(&assignment).map_err(|e| format!("cannot assign {topic}: {e}"))?;
    let mut idle = Duration::ZERO;
    while !remaining.is_empty() {
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            idle += Duration::from_millis(200);
            if idle >= Duration::from_secs(30) {
                return Err(format!(
                    "no progress for 30 s; still missing partitions {:?}",
                    remaining.keys().collect::<Vec<_>>()
                ));
            }
            continue;
        };
        idle = Duration::ZERO;
        let message = message.map_err(|e| format!("reading {topic}: {e}"))?;
        let (partition, offset) = (message.partition(), message.offset());
        each(Read { partition, offset, key: message.key(), payload: message.payload() })?;
        if remaining.get(&partition).is_some_and(|&high| offset + 1 >= high) {
            remaining.remove(&partition);
        }
    }
    Ok(())
}
