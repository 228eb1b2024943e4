//! Reading a whole topic and producing to one: what `rules publish`,
//! `rules rollback`, `rules status` and `rules history` share.

use std::{collections::BTreeMap, time::Duration};

use rdkafka::{
    consumer::BaseConsumer,
    producer::{FutureProducer, FutureRecord},
};

use super::RolloutError;
use crate::kafka::client_config;

pub use super::Record;

/// A consumer that joins no group and commits nothing (`assign`, not `subscribe`).
pub(crate) fn consumer(
    brokers: &str,
    properties: &BTreeMap<String, String>,
    eof: bool,
) -> Result<BaseConsumer, RolloutError> {
    let group = format!("ratelimitd-rules-{}", std::process::id());
    client_config(
        brokers,
        properties,
        &[
            ("group.id", group.as_str()),
            ("enable.auto.commit", "false"),
            ("enable.auto.offset.store", "false"),
            ("enable.partition.eof", if eof { "true" } else { "false" }),
            ("auto.offset.reset", "earliest"),
            ("allow.auto.create.topics", "false"),
            ("reconnect.backoff.max.ms", "1000"),
            // A fetch with nothing new returns after 100 ms (librdkafka's
            // default is 500): a new record is seen within ~100 ms.
            ("fetch.wait.max.ms", "100"),
        ],
    )
    .create()
    .map_err(|e| RolloutError::Kafka(format!("cannot create a Kafka consumer: {e}")))
}

/// The partitions of `topic`, or an error saying it does not exist.
pub(crate) fn partitions(
    consumer: &BaseConsumer,
    brokers: &str,
    topic: &str,
    timeout: Duration,
) -> Result<Vec<i32>, RolloutError> {
    crate::kafka::partitions(consumer, brokers, topic, timeout).map_err(RolloutError::Kafka)
}

/// Every record of `topic` from the low to the high watermark as of now,
/// in offset order per partition (partitions one after the other).
pub fn read_all(
    brokers: &str,
    properties: &BTreeMap<String, String>,
    topic: &str,
) -> Result<Vec<Record>, RolloutError> {
    let group = format!("ratelimitd-rules-{}", std::process::id());
    let mut records = Vec::new();
    crate::kafka::read_topic(brokers, properties, topic, &group, |m| {
        records.push(Record {
            partition: m.partition,
            offset: m.offset,
            key: m.key.map(<[u8]>::to_vec),
            payload: m.payload.map(<[u8]>::to_vec),
        });
        Ok(())
    })
    .map_err(RolloutError::Kafka)?;
    records.sort_by_key(|r| (r.partition, r.offset));
    Ok(records)
}

/// Producer settings: idempotent, acknowledged by every in-sync replica,
/// never creating a topic, giving up after `timeout`.
pub(crate) fn producer(
    brokers: &str,
    properties: &BTreeMap<String, String>,
    timeout: Duration,
) -> Result<FutureProducer, RolloutError> {
    let timeout = timeout.as_millis().to_string();
    client_config(
        brokers,
        properties,
        &[
            ("enable.idempotence", "true"),
            ("acks", "all"),
            ("allow.auto.create.topics", "false"),
            ("message.timeout.ms", timeout.as_str()),
            ("reconnect.backoff.max.ms", "1000"),
            ("client.id", "ratelimitd"),
        ],
    )
    .create()
    .map_err(|e| RolloutError::Kafka(format!("cannot create a Kafka producer: {e}")))
}

/// Produces one record and waits for its acknowledgement; returns its offset.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
    payload: Option<&[u8]>,
) -> Result<i64, RolloutError> {
    let mut record = FutureRecord::<str, [u8]>::to(topic).key(key);
    if let Some(payload) = payload {
        record = record.payload(payload);
    }
    producer
        .send(record, rdkafka::util::Timeout::Never)
        .await
        .map(|delivery| delivery.offset)
        .map_err(|(e, _)| RolloutError::Kafka(format!("cannot write to {topic}: {e}")))
}
