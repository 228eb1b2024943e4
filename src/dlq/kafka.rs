//! The Kafka sink: records go queue → spool (fsync) → Kafka, and leave the
//! spool only once Kafka has acknowledged them.
//!
//! Two owned tasks: [`run_spooler`] drains the hot path's queue into the
//! spool, [`run_shipper`] produces spooled records in order with an
//! idempotent, `acks=all` producer and advances the spool's cursor. The
//! producer's `message.timeout.ms` is 0 (infinite): while Kafka is down
//! librdkafka keeps retrying — without duplicates, thanks to idempotence —
//! and the backlog waits on disk rather than in memory. Message key: user_id.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use rdkafka::{
    error::{KafkaError, RDKafkaErrorCode},
    producer::{FutureProducer, FutureRecord, Producer},
};
use tokio::sync::{Notify, mpsc, watch};

use crate::{
    clock::{Clock as _, SystemClock},
    kafka::client_config,
};

use super::{
    DlqCounters, DropReason, FailureRecord,
    file::{BATCH_MAX, CapAlarm, Drain, Lines, append_durably},
    spool::{SpoolReader, SpoolState, SpoolWriter},
};

/// Properties the service sets; `dlq.kafka.properties` may override them.
const DEFAULTS: [(&str, &str); 8] = [
    ("enable.idempotence", "true"),
    // Never create the topic by producing to it (librdkafka's producer
    // default is true): `ratelimitd migrate` creates it, with its settings.
    ("allow.auto.create.topics", "false"),
    ("acks", "all"),
    ("compression.type", "lz4"),
    ("linger.ms", "5"),
    // Infinite: the spool holds the backlog; librdkafka retries idempotently.
    ("message.timeout.ms", "0"),
    // Back within a second of the broker (librdkafka's default backs off to 10 s).
    ("reconnect.backoff.max.ms", "1000"),
    ("client.id", "ratelimitd"),
];

/// Records produced per round, at most.
const ROUND_MAX: usize = 2_000;

/// Builds the idempotent producer for `brokers` with `properties` applied
/// over the service's defaults.
pub fn producer(brokers: &str, properties: &BTreeMap<String, String>) -> Result<FutureProducer, KafkaError> {
    client_config(brokers, properties, &DEFAULTS).create()
}

/// Drains `queue` into the spool until `shutdown`, then spools what is left.
/// Records that would take the spool past `dlq.spool_max_bytes` are dropped
/// (counted as `disk_cap`, logged once a minute).
pub async fn run_spooler(
    mut queue: mpsc::Receiver<FailureRecord>,
    writer: SpoolWriter,
    spool: Arc<SpoolState>,
    counters: Arc<DlqCounters>,
    spooled: Arc<Notify>,
    mut drain: Drain,
    mut shutdown: watch::Receiver<bool>,
) {
    let alarm = CapAlarm::default();
    let mut writer = Some(writer);
    let mut batch = Vec::with_capacity(BATCH_MAX);
    while drain.next_batch(&mut queue, &mut batch, &counters, &mut shutdown).await {
        let stopping = drain.stopping;
        counters.in_hand.store(batch.len() as u64, Ordering::SeqCst);
        let lines = Lines::of(&batch);
        // Room only grows meanwhile (the shipper deletes segments).
        let w = writer.as_ref().expect("the writer is returned after every append");
        let count = lines.fitting(w.room());
        if count < batch.len() {
            alarm.dropped(
                &counters,
                (batch.len() - count) as u64,
                "dlq.spool_max_bytes",
                w.max_bytes(),
                w.dir(),
            );
        }
        append(&mut writer, Arc::new(lines), count, stopping, &spool, &counters).await;
        counters.in_hand.store(0, Ordering::SeqCst);
        spooled.notify_one();
        batch.clear();
    }
}

/// Appends the first `count` of `lines` to the spool durably, retrying a
/// failed write with a growing pause; when `stopping`, after five tries
/// the records are counted lost (`DiskError`). The writer is lent to a
/// blocking task and given back.
async fn append(
    writer: &mut Option<SpoolWriter>,
    lines: Arc<Lines>,
    count: usize,
    stopping: bool,
    spool: &SpoolState,
    counters: &DlqCounters,
) {
    let mut backoff = Duration::from_millis(50);
    for attempt in 1.. {
        if count == 0 {
            break;
        }
        let mut w = writer.take().expect("the writer is returned after every append");
        let bytes = Arc::clone(&lines);
        let (w, result) = tokio::task::spawn_blocking(move || {
            let result = w.append(bytes.prefix(count));
            (w, result)
        })
        .await
        .expect("spool append does not panic");
        *writer = Some(w);
        match result {
            Ok(()) => {
                // Out of the writer's hands, into the spool: adjacent
                // stores, so a stats read rarely sees the batch twice.
                counters.in_hand.store(0, Ordering::SeqCst);
                spool.publish(count as u64);
                break;
            }
            Err(e) => {
                // Every time: a failing spool disk is a way records get lost.
                tracing::error!(records = count, error = %e, attempt, "cannot append failure records to the spool");
                if stopping && attempt >= 5 {
                    counters.lose(DropReason::DiskError, count as u64);
                    tracing::error!(
                        records = count,
                        "shutting down with an unwritable spool: failure records DROPPED"
                    );
                    break;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// What the shipper needs besides the spool.
pub struct Shipper {
    /// The producer.
    pub producer: FutureProducer,
    /// The dead-letter topic.
    pub topic: String,
    /// Where records Kafka refuses for good (too large, invalid) are kept.
    pub undeliverable: PathBuf,
    /// The most bytes `undeliverable` grows to (`dlq.spool_max_bytes`);
    /// past it a refused record is dropped, counted as `disk_cap`.
    pub undeliverable_max_bytes: u64,
    /// Logs of set-aside records, at most one a second.
    pub set_aside_logs: crate::folded::Folded,
    /// Pipeline counters.
    pub counters: Arc<DlqCounters>,
    /// How long shutdown waits for outstanding deliveries.
    pub flush_timeout: Duration,
}

/// Produces spooled records in order until `shutdown`; acknowledges them in
/// the spool as Kafka confirms them. On shutdown it flushes the producer and
/// leaves whatever is unconfirmed in the spool for the next start.
pub async fn run_shipper(
    shipper: Shipper,
    reader: SpoolReader,
    state: Arc<SpoolState>,
    spooled: Arc<Notify>,
    mut shutdown: watch::Receiver<bool>,
) {
    announce_topic(&shipper).await;
    let mut reader = Some(reader);
    // Records Kafka confirmed beyond a failed one: skipped when the failed
    // one is produced again, so a retry never duplicates them.
    let mut delivered_ahead: BTreeSet<u64> = BTreeSet::new();
    let mut outage = Outage::default();
    loop {
        let from = state.acked.load(Ordering::SeqCst);
        if from >= state.durable.load(Ordering::SeqCst) {
            tokio::select! {
                _ = spooled.notified() => continue,
                // A spool append notifies, but poll too: cheap insurance.
                _ = tokio::time::sleep(Duration::from_millis(500)) => continue,
                _ = shutdown.changed() => return,
            }
        }
        let records = match read_round(&mut reader, from).await {
            Ok(records) => records,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the spool; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let (in_flight, mut settled) = produce_round(&shipper, records, &delivered_ahead);
        let stopping = await_round(&shipper, in_flight, &mut settled, &mut shutdown).await;
        let round = settle(&shipper, settled, from, &mut delivered_ahead);
        if round.upto > from {
            acknowledge(&mut reader, round.upto).await;
            // Counted after the spool let go of them: never both delivered and pending.
            shipper.counters.delivered.fetch_add(round.newly_delivered, Ordering::SeqCst);
        }
        if stopping {
            return;
        }
        match round.retry_reason {
            None => outage.over(),
            Some(why) => {
                outage.log(&shipper.topic, &why, state.pending());
                tokio::select! {
                    _ = tokio::time::sleep(outage.backoff) => {}
                    _ = shutdown.changed() => return,
                }
                outage.backoff = (outage.backoff * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Says clearly, once, whether the topic exists: never rely on auto-creation.
async fn announce_topic(shipper: &Shipper) {
    let (producer, topic) = (shipper.producer.clone(), shipper.topic.clone());
    match tokio::task::spawn_blocking(move || check_topic(&producer, &topic, Duration::from_secs(5))).await {
        Ok(Ok(())) => tracing::info!(topic = %shipper.topic, "dead-letter topic found"),
        Ok(Err(message)) => tracing::error!("{message}"),
        Err(e) => tracing::error!(error = %e, "topic check failed"),
    }
}

/// An outage of the topic: the retry backoff and whether it was logged.
#[derive(Debug)]
struct Outage {
    backoff: Duration,
    logged: bool,
}

impl Default for Outage {
    fn default() -> Self {
        Outage { backoff: Duration::from_millis(100), logged: false }
    }
}

impl Outage {
    /// A round delivered everything: the outage, if any, is over.
    fn over(&mut self) {
        if self.logged {
            tracing::info!("dead-letter topic reachable again; spool draining");
            self.logged = false;
        }
        self.backoff = Duration::from_millis(100);
    }

    /// Logs the outage once.
    fn log(&mut self, topic: &str, why: &str, pending: u64) {
        if !self.logged {
            tracing::error!(topic, reason = %why, pending, "cannot deliver failure records; they stay in the spool and are retried");
            self.logged = true;
        }
    }
}

/// A round of spooled records from `from` on (the reader is lent to a
/// blocking task and given back).
async fn read_round(
    reader: &mut Option<SpoolReader>,
    from: u64,
) -> std::io::Result<Vec<(u64, Result<FailureRecord, String>)>> {
    let mut r = reader.take().expect("the reader is returned after every read");
    let (r, read) = tokio::task::spawn_blocking(move || {
        let read = r.read(from, ROUND_MAX);
        (r, read)
    })
    .await
    .expect("spool read does not panic");
    *reader = Some(r);
    read
}

/// A record handed to the producer, awaiting its delivery report.
type InFlight = (u64, FailureRecord, rdkafka::producer::DeliveryFuture);

/// Produces a round: what is in flight, and what is settled already
/// (confirmed before, unreadable, or refused by the producer).
fn produce_round(
    shipper: &Shipper,
    records: Vec<(u64, Result<FailureRecord, String>)>,
    delivered_ahead: &BTreeSet<u64>,
) -> (Vec<InFlight>, Vec<(u64, Outcome)>) {
    let mut in_flight = Vec::with_capacity(records.len());
    let mut settled: Vec<(u64, Outcome)> = Vec::with_capacity(records.len());
    for (seq, record) in records {
        if delivered_ahead.contains(&seq) {
            settled.push((seq, Outcome::Delivered));
            continue;
        }
        let record = match record {
            Ok(record) => record,
            Err(line) => {
                settled.push((seq, Outcome::Undeliverable(line, "unreadable spool line".to_owned())));
                continue;
            }
        };
        let payload = serde_json::to_vec(&record).expect("records serialise");
        let message = FutureRecord::to(&shipper.topic).key(record.request.user_id.as_str()).payload(&payload);
        match shipper.producer.send_result(message) {
            Ok(delivery) => in_flight.push((seq, record, delivery)),
            // librdkafka's own queue is full: settle what is in flight first.
            Err((e, _)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::QueueFull) => break,
            Err((e, _)) => settled.push((seq, classify(&e, &record))),
        }
    }
    (in_flight, settled)
}

/// Awaits the round's deliveries into `settled` (sorted by sequence
/// number), or shutdown: then outstanding deliveries get one last flush and
/// what is not confirmed stays spooled. Returns whether it is stopping.
async fn await_round(
    shipper: &Shipper,
    in_flight: Vec<InFlight>,
    settled: &mut Vec<(u64, Outcome)>,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    let mut stopping = false;
    for (seq, record, mut delivery) in in_flight {
        let result = if stopping {
            tokio::time::timeout(Duration::from_millis(1), &mut delivery).await.ok()
        } else {
            tokio::select! {
                result = &mut delivery => Some(result),
                _ = shutdown.changed() => {
                    stopping = true;
                    let producer = shipper.producer.clone();
                    let timeout = shipper.flush_timeout;
                    // Give outstanding deliveries a last chance, then keep what is confirmed.
                    let _ = tokio::task::spawn_blocking(move || producer.flush(timeout)).await;
                    tokio::time::timeout(Duration::from_millis(1), &mut delivery).await.ok()
                }
            }
        };
        let outcome = match result {
            Some(Ok(Ok(_))) => Outcome::Delivered,
            Some(Ok(Err((e, _)))) => classify(&e, &record),
            Some(Err(_)) | None => Outcome::Retry("not confirmed before shutdown".to_owned()),
        };
        settled.push((seq, outcome));
    }
    settled.sort_by_key(|(seq, _)| *seq);
    stopping
}

/// What a round settled: the spool may let go of everything before
/// `upto`, of which `newly_delivered` were confirmed now; `retry_reason`
/// when something must be tried again.
struct Round {
    upto: u64,
    newly_delivered: u64,
    retry_reason: Option<String>,
}

/// Acknowledges the confirmed prefix of `settled` (sorted), from `from`;
/// remembers confirmations past a gap in `delivered_ahead`, and sets
/// undeliverable records at the front aside.
fn settle(
    shipper: &Shipper,
    settled: Vec<(u64, Outcome)>,
    from: u64,
    delivered_ahead: &mut BTreeSet<u64>,
) -> Round {
    let mut round = Round { upto: from, newly_delivered: 0, retry_reason: None };
    for (seq, outcome) in settled {
        match outcome {
            // Counted delivered when acknowledged, so a record is either
            // delivered or pending, never both.
            Outcome::Delivered => {
                if round.retry_reason.is_none() && seq == round.upto {
                    round.upto += 1;
                    delivered_ahead.remove(&seq);
                    round.newly_delivered += 1;
                } else {
                    delivered_ahead.insert(seq);
                }
            }
            Outcome::Undeliverable(line, why) if round.retry_reason.is_none() && seq == round.upto => {
                set_aside(shipper, &line, &why);
                round.upto += 1;
            }
            Outcome::Undeliverable(_, why) | Outcome::Retry(why) => {
                round.retry_reason.get_or_insert(why);
            }
        }
    }
    round
}

/// Records in the spool that everything before `upto` is delivered.
async fn acknowledge(reader: &mut Option<SpoolReader>, upto: u64) {
    let mut r = reader.take().expect("reader");
    let (r, acked) = tokio::task::spawn_blocking(move || {
        let acked = r.acknowledge(upto);
        (r, acked)
    })
    .await
    .expect("spool acknowledge does not panic");
    *reader = Some(r);
    if let Err(e) = acked {
        tracing::error!(error = %e, "cannot record delivery in the spool; records may be sent again after a restart");
    }
}

impl std::fmt::Debug for Shipper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shipper").field("topic", &self.topic).finish_non_exhaustive()
    }
}

enum Outcome {
    Delivered,
    /// Kafka refuses this record for good; kept aside in a local file.
    Undeliverable(String, String),
    /// Try again later (no topic yet, broker trouble).
    Retry(String),
}

fn classify(e: &KafkaError, record: &FailureRecord) -> Outcome {
    use RDKafkaErrorCode::*;
    match e.rdkafka_error_code() {
        Some(MessageSizeTooLarge | InvalidMessageSize | InvalidRecord | InvalidMessage) => {
            let line = serde_json::to_string(record).expect("records serialise");
            Outcome::Undeliverable(line, e.to_string())
        }
        Some(UnknownTopic | UnknownTopicOrPartition) => {
            Outcome::Retry(format!("{e}: the topic does not exist; run `ratelimitd migrate`"))
        }
        _ => Outcome::Retry(e.to_string()),
    }
}

/// Keeps a record Kafka will never take in `undeliverable`, and counts it
/// dropped (it did not reach the topic) with an error naming the file.
fn set_aside(shipper: &Shipper, line: &str, why: &str) {
    let mut bytes = line.as_bytes().to_vec();
    bytes.push(b'\n');
    let size = std::fs::metadata(&shipper.undeliverable).map_or(0, |m| m.len());
    if size + bytes.len() as u64 > shipper.undeliverable_max_bytes {
        // Bounded like the spool: a flood of refusals cannot fill the disk.
        shipper.counters.lose(DropReason::DiskCap, 1);
    } else {
        if let Err(e) = append_durably(&shipper.undeliverable, &bytes) {
            tracing::error!(error = %e, "cannot keep an undeliverable record aside; it is lost");
        }
        shipper.counters.lose(DropReason::Undeliverable, 1);
    }
    if let Some(folded) = shipper.set_aside_logs.pass(SystemClock.now_ms() / 1_000) {
        tracing::error!(
            file = %shipper.undeliverable.display(),
            reason = why,
            also_refused = folded,
            cap = shipper.undeliverable_max_bytes,
            "Kafka refused a failure record for good; kept aside (within the cap), not on the topic"
        );
    }
}

/// Checks that `topic` exists on the cluster, saying clearly what to run if
/// not. Blocking (metadata request): run it off the runtime's workers.
pub fn check_topic(producer: &FutureProducer, topic: &str, timeout: Duration) -> Result<(), String> {
    let metadata = producer
        .client()
        .fetch_metadata(Some(topic), timeout)
        .map_err(|e| format!("cannot reach Kafka to check topic {topic:?}: {e}"))?;
    match metadata.topics().iter().find(|t| t.name() == topic) {
        Some(t) if t.error().is_none() && !t.partitions().is_empty() => Ok(()),
        _ => Err(format!(
            "dead-letter topic {topic:?} does not exist: run `ratelimitd migrate` (records are spooled until it exists)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dlq::{
        DlqCounters, DropReason,
        file::to_json_lines,
        spool::{self, tests::record},
    };

    #[tokio::test]
    async fn the_spool_never_grows_past_its_cap() {
        use std::sync::atomic::Ordering;

        let dir = tempfile::tempdir().unwrap();
        let line = to_json_lines(&[record(100)]).len() as u64;
        let cap = line * 8 + line / 2;
        let (writer, _reader, state) =
            spool::open(dir.path(), spool::SpoolSizes { segment_bytes: line * 2, max_bytes: cap }).unwrap();
        let counters = Arc::new(DlqCounters::default());
        let (queue, receiver) = tokio::sync::mpsc::channel(100);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let spooler = tokio::spawn(run_spooler(
            receiver,
            writer,
            Arc::clone(&state),
            Arc::clone(&counters),
            Arc::new(tokio::sync::Notify::new()),
            crate::dlq::file::Drain::default(),
            stopped,
        ));
        for i in 100..120 {
            let record = record(i);
            counters.queued_bytes.fetch_add(record.size_bytes(), Ordering::SeqCst);
            queue.send(record).await.unwrap();
        }
        stop.send(true).unwrap();
        spooler.await.unwrap();
        assert_eq!((state.pending(), counters.dropped_by(DropReason::DiskCap)), (8, 12));
        assert!(state.bytes() <= cap, "{} of {cap}", state.bytes());
        assert_eq!(counters.queued_bytes.load(Ordering::SeqCst), 0);
    }
}
