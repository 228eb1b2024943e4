//! The capture topic's writer (cargo feature `kafka`): one task drains the
//! queue in batches into the capture topic, until the stop signal, then
//! waits a little for what is in flight.

use std::{
    collections::BTreeMap,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use futures_util::{FutureExt as _, StreamExt as _, stream::FuturesUnordered};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::sync::{mpsc, watch};

use super::{
    CaptureCounters, CaptureRecord,
    writer::{BATCH, next_batch},
};
use crate::{
    clock::{Clock, SystemClock},
    folded::Folded,
};

/// Produces batches to `topic` (key: user id, so one user's records keep
/// their order), counting acknowledgements, until `stop`.
pub async fn run_kafka(
    mut queue: mpsc::Receiver<CaptureRecord>,
    producer: FutureProducer,
    topic: String,
    counters: Arc<CaptureCounters>,
    mut stop: watch::Receiver<bool>,
) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut in_flight = FuturesUnordered::new();
    let failed = Folded::default();
    loop {
        // Acknowledgements are counted as they come; at most one batch waits.
        while in_flight.len() >= BATCH {
            if let Some(acked) = in_flight.next().await {
                settle(acked, &counters, &failed);
            }
        }
        if !next_batch(&mut queue, &mut batch, &mut stop).await {
            break;
        }
        for record in &batch {
            let payload = serde_json::to_vec(record).unwrap_or_default();
            let message = FutureRecord::<str, [u8]>::to(&topic).key(&record.user_id).payload(&payload);
            match producer.send_result(message) {
                Ok(delivery) => in_flight.push(delivery),
                Err(_) => {
                    counters.dropped_error.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        while let Some(Some(acked)) = in_flight.next().now_or_never() {
            settle(acked, &counters, &failed);
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(acked) = in_flight.next().await {
            settle(acked, &counters, &failed);
        }
    })
    .await;
}

fn settle<E>(
    acked: Result<rdkafka::producer::future_producer::OwnedDeliveryResult, E>,
    counters: &CaptureCounters,
    failed: &Folded,
) {
    match acked {
        Ok(Ok(_)) => {
            counters.written.fetch_add(1, Ordering::Relaxed);
        }
        _ => {
            counters.dropped_error.fetch_add(1, Ordering::Relaxed);
            if let Some(times) = failed.pass(SystemClock.now_ms() / 1_000) {
                tracing::warn!(times, "capture records refused by Kafka");
            }
        }
    }
}

/// The capture producer: not idempotent (a duplicate costs replay little),
/// bounded buffering, never creating the topic.
pub fn producer(
    brokers: &str,
    properties: &BTreeMap<String, String>,
) -> Result<FutureProducer, rdkafka::error::KafkaError> {
    crate::kafka::client_config(
        brokers,
        properties,
        &[
            ("allow.auto.create.topics", "false"),
            ("acks", "1"),
            ("compression.type", "lz4"),
            ("linger.ms", "20"),
            ("message.timeout.ms", "30000"),
            ("queue.buffering.max.messages", "100000"),
            ("reconnect.backoff.max.ms", "1000"),
            ("client.id", "ratelimitd-capture"),
        ],
    )
    .create()
}
