//! Failed decisions (docs/design.md §8): every decision the store could not make
//! becomes exactly one [`FailureRecord`], written to a JSON-lines file (the
//! embedded default) or a Kafka topic, and never lost on the way.
//!
//! The hot path only builds the record and `try_send`s it into a queue
//! bounded in records and in bytes ([`DlqSink`]); an owned writer task
//! ([`file::run`]) drains it in batches and makes each batch durable (fsync)
//! before counting it delivered. The file and the spool have byte caps too.
//! A record that finds no room — the disk cannot keep up, or a cap is
//! reached — is counted as dropped with its [`DropReason`], every time, and
//! an error is logged folded ([`crate::folded::Folded`]): once a second at
//! most for the queue, once a minute for a cap, with the number of drops
//! the line stands for.

pub mod audit;
mod figures;
pub mod file;
pub mod fold;
#[cfg(feature = "kafka")]
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

/// Why a failure record was lost (the `reason` of `ratelimitd_dlq_dropped_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// The queue held `dlq.queue_capacity` records.
    QueueFull,
    /// The queue held `dlq.queue_max_bytes` bytes of records.
    QueueBytes,
    /// The writer task had stopped.
    WriterStopped,
    /// The file (`dlq.file_max_bytes`), the spool or its file of records
    /// Kafka refused for good (`dlq.spool_max_bytes`) reached its byte cap.
    DiskCap,
    /// Shutdown met a disk that kept refusing the write.
    DiskError,
    /// Kafka refused the record for good and it could not be set aside.
    Undeliverable,
}

impl DropReason {
    /// Every reason, in the order of [`DlqCounters::dropped`].
    pub const ALL: [DropReason; 6] = [
        DropReason::QueueFull,
        DropReason::QueueBytes,
        DropReason::WriterStopped,
        DropReason::DiskCap,
        DropReason::DiskError,
        DropReason::Undeliverable,
    ];

    /// Stable snake_case name, the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::QueueFull => "queue_full",
            DropReason::QueueBytes => "queue_bytes",
            DropReason::WriterStopped => "writer_stopped",
            DropReason::DiskCap => "disk_cap",
            DropReason::DiskError => "disk_error",
            DropReason::Undeliverable => "undeliverable",
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
    /// Records lost, per [`DropReason::ALL`].
    dropped: [AtomicU64; DropReason::ALL.len()],
    /// Records taken off the queue and not yet written.
    pub in_hand: AtomicU64,
    /// Records a previous run left in the spool, found at startup.
    pub recovered: AtomicU64,
    /// [`FailureRecord::size_bytes`] of the records in the queue.
    pub queued_bytes: AtomicU64,
    /// Size of the file sink's file after the last write.
    pub file_bytes: AtomicU64,
    /// Failed decisions folded into aggregate records ([`fold`]) rather
    /// than written on their own.
    pub folded: AtomicU64,
}

impl DlqCounters {
    /// Counts `count` records lost for `reason`.
    pub fn lose(&self, reason: DropReason, count: u64) {
        self.dropped[reason as usize].fetch_add(count, Ordering::SeqCst);
    }

    /// Records lost for `reason`.
    pub fn dropped_by(&self, reason: DropReason) -> u64 {
        self.dropped[reason as usize].load(Ordering::SeqCst)
    }

    /// Records lost, for every reason.
    pub fn dropped(&self) -> u64 {
        DropReason::ALL.iter().map(|&r| self.dropped_by(r)).sum()
    }
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
    /// Bytes of records in the queue.
    pub queued_bytes: u64,
    /// Bytes on disk: the file sink's file, or the spool's segments.
    pub disk_bytes: u64,
}

/// The hot path's end of the dead-letter pipeline.
#[derive(Debug)]
pub struct DlqSink {
    queue: mpsc::Sender<FailureRecord>,
    queue_max_bytes: u64,
    disk_max_bytes: u64,
    ids: EventIds,
    clock: SystemClock,
    instance: String,
    allowlist: Vec<String>,
    bounds: RecordBounds,
    counters: Arc<DlqCounters>,
    spool: Option<Arc<spool::SpoolState>>,
    log: LogSink,
    drops: Folded,
    folds: Option<Arc<fold::Folds>>,
}

impl DlqSink {
    /// A sink feeding a queue of at most `capacity` records and `max_bytes`
    /// bytes of them; the receiver goes to a writer task. Records keep the
    /// headers in `allowlist`, within `bounds`.
    pub fn new(
        capacity: usize,
        max_bytes: u64,
        instance: String,
        allowlist: Vec<String>,
        bounds: RecordBounds,
    ) -> (Self, mpsc::Receiver<FailureRecord>, Arc<DlqCounters>) {
        let (queue, receiver) = mpsc::channel(capacity);
        let counters = Arc::new(DlqCounters::default());
        let sink = DlqSink {
            queue,
            queue_max_bytes: max_bytes,
            disk_max_bytes: u64::MAX,
            ids: EventIds::default(),
            clock: SystemClock,
            instance,
            allowlist: allowlist.iter().map(|h| h.to_ascii_lowercase()).collect(),
            bounds,
            counters: Arc::clone(&counters),
            spool: None,
            log: LogSink::default(),
            drops: Folded::default(),
            folds: None,
        };
        (sink, receiver, counters)
    }

    /// Reports `max_bytes` as the byte cap of the file or the spool.
    pub fn with_disk_cap(mut self, max_bytes: u64) -> Self {
        self.disk_max_bytes = max_bytes;
        self
    }

    /// The queue's and the disk's byte caps.
    pub fn byte_caps(&self) -> (u64, u64) {
        (self.queue_max_bytes, self.disk_max_bytes)
    }

    /// Folds floods of failures into aggregates (`dlq.aggregate_*`); the
    /// writer's [`file::Drain`] takes them.
    pub fn with_folds(mut self, folds: Arc<fold::Folds>) -> Self {
        self.folds = Some(folds);
        self
    }

    /// Failed decisions folded into aggregates.
    pub fn folded(&self) -> u64 {
        self.counters.folded.load(Ordering::Relaxed)
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
            dropped: c.dropped(),
            queued_bytes: c.queued_bytes.load(Ordering::SeqCst),
            disk_bytes: self
                .spool
                .as_ref()
                .map_or_else(|| c.file_bytes.load(Ordering::SeqCst), |s| s.bytes()),
        }
    }

    /// Records lost for `reason`.
    pub fn dropped_by(&self, reason: DropReason) -> u64 {
        self.counters.dropped_by(reason)
    }

    /// Counts a record lost on the hot path and logs it folded.
    fn lost(&self, reason: DropReason, why: &str, record: &FailureRecord, now_ms: u64) {
        self.counters.lose(reason, 1);
        // Every drop is counted; the log says so once a second at most,
        // so a flood of drops cannot become a flood of log lines.
        if let Some(folded) = self.drops.pass(now_ms / 1_000) {
            tracing::error!(
                event_id = %record.event_id,
                rule = %record.rule_id,
                reason = reason.as_str(),
                also_dropped = folded,
                "{why}; failure record DROPPED (ratelimitd_dlq_dropped_total counts them all)"
            );
        }
    }
}

impl FailureSink for DlqSink {
    fn record(&self, failure: &FailedDecision<'_>) {
        self.log.record(failure);
        let now = self.clock.now_ms();
        let build = || {
            FailureRecord::new(
                failure,
                self.ids.next(now),
                now,
                &self.instance,
                &self.allowlist,
                &self.bounds,
            )
        };
        if let Some(folds) = &self.folds
            && folds.admit(failure, now, build) == fold::Admit::Folded
        {
            self.counters.folded.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let record = build();
        self.counters.enqueued.fetch_add(1, Ordering::SeqCst);
        let size = record.size_bytes();
        let queued = self.counters.queued_bytes.fetch_add(size, Ordering::SeqCst);
        if queued + size > self.queue_max_bytes {
            self.counters.queued_bytes.fetch_sub(size, Ordering::SeqCst);
            let why = "dead-letter queue at dlq.queue_max_bytes: the writer cannot keep up";
            self.lost(DropReason::QueueBytes, why, &record, now);
            return;
        }
        if let Err(e) = self.queue.try_send(record) {
            self.counters.queued_bytes.fetch_sub(size, Ordering::SeqCst);
            let (reason, why, record) = match e {
                mpsc::error::TrySendError::Full(r) => {
                    (DropReason::QueueFull, "dead-letter queue full: the writer cannot keep up", r)
                }
                mpsc::error::TrySendError::Closed(r) => {
                    (DropReason::WriterStopped, "dead-letter writer stopped", r)
                }
            };
            self.lost(reason, why, &record, now);
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
            overload: None,
            also: Vec::new(),
            adaptive: None,
            global: false,
            calendar: None,
            unit: None,
            prices: None,
            levels: None,
            level: None,
            source: Arc::from(Path::new("r.yaml")),
        }
    }

    /// The file writer of `queue` on `path`, capped at `max_bytes`, until `stopped`.
    fn file_writer(
        queue: tokio::sync::mpsc::Receiver<FailureRecord>,
        path: &Path,
        max_bytes: u64,
        counters: Arc<DlqCounters>,
        stopped: tokio::sync::watch::Receiver<bool>,
    ) -> tokio::task::JoinHandle<()> {
        let target = file::Target::File(file::FileTarget { path: path.to_owned(), max_bytes });
        tokio::spawn(file::run(queue, target, counters, file::Drain::default(), stopped))
    }

    fn fail(sink: &DlqSink, times: usize) {
        let headers = HashMap::new();
        let rule = rule();
        let error = StoreError { kind: FailureKind::Timeout, message: "slow".to_owned() };
        for i in 0..times {
            let user = format!("u{i}");
            let request = CheckRequest::new(&user, "/p", &headers);
            sink.record(&FailedDecision::of_check(&request, &rule, Priority::Bulk, &error, Reason::FailOpen));
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_without_blocking() {
        let (sink, _queue, _) = DlqSink::new(2, 1 << 20, "i".to_owned(), Vec::new(), RecordBounds::default());
        fail(&sink, 5);
        let stats = sink.stats();
        assert_eq!((stats.enqueued, stats.pending, stats.dropped, stats.delivered), (5, 2, 3, 0));
    }

    #[tokio::test]
    async fn file_writer_delivers_everything_and_drains_on_shutdown() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/dlq.jsonl");
        let (sink, queue, counters) =
            DlqSink::new(1_000, 1 << 20, "i".to_owned(), Vec::new(), RecordBounds::default());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let writer = file_writer(queue, &path, u64::MAX, counters, stopped);
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

    #[test]
    fn the_queue_is_bounded_in_bytes_too() {
        let (probe, _q, _) = DlqSink::new(10, u64::MAX, "i".to_owned(), Vec::new(), RecordBounds::default());
        fail(&probe, 1);
        let one = probe.stats().queued_bytes;
        assert!(one > 0);
        // Room for three records' bytes, ten records' slots.
        let (sink, mut queue, counters) =
            DlqSink::new(10, one * 3 + one / 2, "i".to_owned(), Vec::new(), RecordBounds::default());
        fail(&sink, 5);
        let stats = sink.stats();
        assert_eq!((stats.enqueued, stats.pending, stats.dropped), (5, 3, 2));
        assert_eq!(sink.dropped_by(DropReason::QueueBytes), 2);
        // Taking records off the queue gives their bytes back.
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let (_stop, mut stopped) = tokio::sync::watch::channel(false);
        let mut batch = Vec::new();
        rt.block_on(file::Drain::default().next_batch(&mut queue, &mut batch, &counters, &mut stopped));
        assert_eq!((batch.len(), sink.stats().queued_bytes), (3, 0));
        fail(&sink, 1);
        assert_eq!(sink.stats().pending, 1, "room again");
    }

    #[tokio::test]
    async fn the_file_never_grows_past_its_cap_and_a_rotated_file_makes_room() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dlq.jsonl");
        let (probe, mut probe_queue, _) =
            DlqSink::new(10, u64::MAX, "i".to_owned(), Vec::new(), RecordBounds::default());
        fail(&probe, 1);
        let line = file::to_json_lines(&[probe_queue.recv().await.unwrap()]).len() as u64;
        let cap = line * 10 + line / 2;
        let (sink, queue, counters) =
            DlqSink::new(1_000, u64::MAX, "i".to_owned(), Vec::new(), RecordBounds::default());
        let sink = sink.with_disk_cap(cap);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let writer = file_writer(queue, &path, cap, counters, stopped);
        let settled = |sink: &DlqSink| {
            let s = sink.stats();
            s.pending == 0 && s.enqueued == s.delivered + s.dropped
        };
        fail(&sink, 25);
        while !settled(&sink) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let stats = sink.stats();
        assert_eq!((stats.delivered, stats.dropped), (10, 15), "{stats:?}");
        assert_eq!(sink.dropped_by(DropReason::DiskCap), 15);
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(size <= cap && stats.disk_bytes == size, "{size} of {cap}, {stats:?}");
        // Rotated away (logrotate's rename): the next records go to a new file.
        std::fs::rename(&path, dir.path().join("dlq.jsonl.1")).unwrap();
        fail(&sink, 4);
        stop.send(true).unwrap();
        writer.await.unwrap();
        let stats = sink.stats();
        assert_eq!((stats.enqueued, stats.delivered, stats.dropped, stats.pending), (29, 14, 15, 0));
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 4);
    }
}
