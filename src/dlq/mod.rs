//! Failed decisions (DESIGN §8): every decision the store could not make
//! becomes exactly one [`FailureRecord`], written to a JSON-lines file (the
//! embedded default) or a Kafka topic, and never lost on the way.
//!
//! The hot path only builds the record and `try_send`s it into a bounded
//! queue ([`DlqSink`]); an owned writer task ([`file::run`]) drains it in
//! batches and makes each batch durable (fsync) before counting it
//! delivered. If the queue is full — the disk cannot keep up — the record is
//! counted as dropped, every time, and an error is logged at most once a
//! second with the number of drops it stands for ([`crate::folded::Folded`]).

pub mod audit;
pub mod file;
pub mod kafka;
pub mod record;
pub mod spool;

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use tokio::sync::mpsc;

use record::EventIds;
pub use record::{FailureRecord, RecordBounds};

use crate::{
    clock::{Clock, SystemClock},
    decision::{FailedDecision, FailureSink},
    folded::Folded,
};

/// Logs failed decisions at `warn`, at most one line per second; the line
/// carries how many were folded into it.
#[derive(Debug, Default)]
pub struct LogSink {
    folded: Folded,
}

impl FailureSink for LogSink {
    fn record(&self, failure: &FailedDecision<'_>) {
        if let Some(folded) = self.folded.pass(SystemClock.now_ms() / 1_000) {
            tracing::warn!(
                rule = failure.rule_id,
                kind = %failure.error.kind,
                error = %failure.error.message,
                answer = failure.answer.as_str(),
                folded,
                "store could not decide; answered by failure policy"
            );
        }
    }
}

/// Counters of the dead-letter pipeline. They reconcile:
/// `enqueued = delivered + pending + dropped`, with `pending` measured from
/// the queue, the writer's batch in hand and the spool — not derived.
#[derive(Debug, Default)]
pub struct DlqCounters {
    /// Records offered by the decision path.
    pub enqueued: AtomicU64,
    /// Records durably written to the file or acknowledged by Kafka.
    pub delivered: AtomicU64,
    /// Records lost: the queue was full or the spool's disk refused them.
    pub dropped: AtomicU64,
    /// Records taken off the queue and not yet written.
    pub in_hand: AtomicU64,
    /// Records a previous run left in the spool, found at startup.
    pub recovered: AtomicU64,
}

/// A consistent-enough view of [`DlqCounters`] plus the queue and the spool.
/// `enqueued + recovered = delivered + pending + dropped`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DlqStats {
    /// Records offered.
    pub enqueued: u64,
    /// Records found in the spool at startup.
    pub recovered: u64,
    /// Records delivered.
    pub delivered: u64,
    /// Records waiting: in the queue, in a writer's hands or in the spool.
    pub pending: u64,
    /// Records lost.
    pub dropped: u64,
}

/// The hot path's end of the dead-letter pipeline.
#[derive(Debug)]
pub struct DlqSink {
    queue: mpsc::Sender<FailureRecord>,
    ids: EventIds,
    clock: SystemClock,
    instance: String,
    allowlist: Vec<String>,
    bounds: RecordBounds,
    counters: Arc<DlqCounters>,
    spool: Option<Arc<spool::SpoolState>>,
    log: LogSink,
    drops: Folded,
}

impl DlqSink {
    /// A sink feeding a queue of `capacity` records; the receiver goes to a
    /// writer task. Records keep the headers in `allowlist`, within `bounds`.
    pub fn new(
        capacity: usize,
        instance: String,
        allowlist: Vec<String>,
        bounds: RecordBounds,
    ) -> (Self, mpsc::Receiver<FailureRecord>, Arc<DlqCounters>) {
        let (queue, receiver) = mpsc::channel(capacity);
        let counters = Arc::new(DlqCounters::default());
        let sink = DlqSink {
            queue,
            ids: EventIds::default(),
            clock: SystemClock,
            instance,
            allowlist: allowlist.iter().map(|h| h.to_ascii_lowercase()).collect(),
            bounds,
            counters: Arc::clone(&counters),
            spool: None,
            log: LogSink::default(),
            drops: Folded::default(),
        };
        (sink, receiver, counters)
    }

    /// Counts the spool's records as pending (the Kafka sink).
    pub fn with_spool(mut self, spool: Arc<spool::SpoolState>) -> Self {
        self.spool = Some(spool);
        self
    }

    /// Current counters, with `pending` measured from the queue, the
    /// writer's hands and the spool.
    pub fn stats(&self) -> DlqStats {
        let queued = (self.queue.max_capacity() - self.queue.capacity()) as u64;
        let spooled = self.spool.as_ref().map_or(0, |s| s.pending());
        let c = &self.counters;
        DlqStats {
            enqueued: c.enqueued.load(Ordering::SeqCst),
            recovered: c.recovered.load(Ordering::SeqCst),
            delivered: c.delivered.load(Ordering::SeqCst),
            pending: queued + c.in_hand.load(Ordering::SeqCst) + spooled,
            dropped: c.dropped.load(Ordering::SeqCst),
        }
    }
}

impl FailureSink for DlqSink {
    fn record(&self, failure: &FailedDecision<'_>) {
        self.log.record(failure);
        let now = self.clock.now_ms();
        let record = FailureRecord::new(
            failure,
            self.ids.next(now),
            now,
            &self.instance,
            &self.allowlist,
            &self.bounds,
        );
        self.counters.enqueued.fetch_add(1, Ordering::SeqCst);
        if let Err(e) = self.queue.try_send(record) {
            self.counters.dropped.fetch_add(1, Ordering::SeqCst);
            // Every drop is counted; the log says so once a second at most,
            // so a flood of drops cannot become a flood of log lines.
            if let Some(folded) = self.drops.pass(now / 1_000) {
                let (why, record) = match e {
                    mpsc::error::TrySendError::Full(r) => {
                        ("dead-letter queue full: the writer cannot keep up", r)
                    }
                    mpsc::error::TrySendError::Closed(r) => ("dead-letter writer stopped", r),
                };
                tracing::error!(
                    event_id = %record.event_id,
                    rule = %record.rule_id,
                    also_dropped = folded,
                    "{why}; failure record DROPPED (ratelimitd_dlq_dropped_total counts them all)"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{collections::HashMap, path::Path};

    use super::*;
    use crate::{
        decision::{CheckRequest, Reason},
        limiter::{FailureKind, StoreError, window::WindowParams},
        rules::{FailurePolicy, Mode, Rule},
        shed::Priority,
    };

    fn rule() -> Rule {
        Rule {
            id: Arc::from("r"),
            resource_path: "/p".to_owned(),
            client_type: None,
            priority: Priority::Bulk,
            limit: 1,
            burst_capacity: 1.0,
            window: WindowParams::sliding(1_000, 1),
            mode: Mode::Enforce,
            failure_policy: FailurePolicy::Open,
            source: Arc::from(Path::new("r.yaml")),
        }
    }

    fn fail(sink: &DlqSink, times: usize) {
        let headers = HashMap::new();
        let rule = rule();
        let error = StoreError { kind: FailureKind::Timeout, message: "slow".to_owned() };
        for i in 0..times {
            let user = format!("u{i}");
            let request = CheckRequest {
                user_id: &user,
                resource_path: "/p",
                client_type: None,
                weight: 1,
                priority: None,
                headers: &headers,
                trace_id: None,
            };
            sink.record(&FailedDecision::of_check(&request, &rule, Priority::Bulk, &error, Reason::FailOpen));
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_blocking() {
        let (sink, _queue, _) = DlqSink::new(2, "i".to_owned(), Vec::new(), RecordBounds::default());
        fail(&sink, 5);
        let stats = sink.stats();
        assert_eq!((stats.enqueued, stats.pending, stats.dropped, stats.delivered), (5, 2, 3, 0));
    }

    #[tokio::test]
    async fn file_writer_delivers_everything_and_drains_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/dlq.jsonl");
        let (sink, queue, counters) =
            DlqSink::new(1_000, "i".to_owned(), Vec::new(), RecordBounds::default());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let writer = tokio::spawn(file::run(queue, path.clone(), counters, stopped));
        fail(&sink, 300);
        stop.send(true).unwrap();
        writer.await.unwrap();
        let stats = sink.stats();
        assert_eq!((stats.enqueued, stats.delivered, stats.pending, stats.dropped), (300, 300, 0, 0));
        let lines: Vec<FailureRecord> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 300);
        assert_eq!(lines[299].request.user_id, "u299");
    }
}
