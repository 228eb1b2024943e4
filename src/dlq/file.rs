//! The file sink (the embedded default, when no Kafka brokers are
//! configured): records appended as JSON lines to `dlq.file`, one `fsync`
//! per batch. A batch counts as delivered only once it is on disk; a failed
//! write is retried, never skipped, and on shutdown the queue is drained.
//! The file never grows past `dlq.file_max_bytes`: records that would take
//! it there are dropped (counted as `disk_cap`, logged once a minute), until
//! the file is rotated away or emptied.

use std::{
    fs::OpenOptions,
    io::Write,
    path::{Path, PathBuf},
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use tokio::sync::{mpsc, watch};

use super::{DlqCounters, DropReason, FailureRecord, fold::Folds};
use crate::{
    clock::{Clock, SystemClock},
    folded::Folded,
};

/// Records per write and fsync, at most.
pub const BATCH_MAX: usize = 1_024;

/// Serialises `records` as JSON lines.
pub fn to_json_lines(records: &[FailureRecord]) -> Vec<u8> {
    Lines::of(records).bytes
}

/// A batch serialised as JSON lines, with where each record's line ends, so
/// a writer can take the longest prefix that fits under a byte cap.
#[derive(Debug, Default)]
pub struct Lines {
    bytes: Vec<u8>,
    ends: Vec<usize>,
}

impl Lines {
    /// Serialises `records`.
    pub fn of(records: &[FailureRecord]) -> Self {
        let mut lines = Lines { bytes: Vec::with_capacity(records.len() * 512), ends: Vec::new() };
        for record in records {
            serde_json::to_writer(&mut lines.bytes, record).expect("records serialise");
            lines.bytes.push(b'\n');
            lines.ends.push(lines.bytes.len());
        }
        lines
    }

    /// How many leading records fit in `room` bytes.
    pub fn fitting(&self, room: u64) -> usize {
        self.ends.partition_point(|&end| end as u64 <= room)
    }

    /// The lines of the first `records` records.
    pub fn prefix(&self, records: usize) -> &[u8] {
        &self.bytes[..records.checked_sub(1).map_or(0, |last| self.ends[last])]
    }
}

/// Logs, once a minute at most, that a byte cap made records drop; the line
/// says how many drops it stands for.
#[derive(Debug, Default)]
pub struct CapAlarm {
    folded: Folded,
    dropped_since: std::sync::atomic::AtomicU64,
}

impl CapAlarm {
    /// Counts `count` records dropped at the cap `key` = `max_bytes` of
    /// `place`, and logs one loud line a minute.
    pub fn dropped(&self, counters: &DlqCounters, count: u64, key: &str, max_bytes: u64, place: &Path) {
        counters.lose(DropReason::DiskCap, count);
        let since = self.dropped_since.fetch_add(count, Ordering::Relaxed) + count;
        if self.folded.pass(SystemClock.now_ms() / 60_000).is_some() {
            self.dropped_since.store(0, Ordering::Relaxed);
            tracing::error!(
                place = %place.display(),
                cap = key,
                max_bytes,
                dropped = since,
                "dead-letter storage at its byte cap: failure records DROPPED (ratelimitd_dlq_dropped_total{{reason=\"disk_cap\"}}); \
                 free space by shipping, rotating or raising the cap"
            );
        }
    }
}

/// Appends `bytes` to `path` (created with its directory if missing) and
/// waits until they are on disk. On failure the file is cut back to its
/// length before the call, so a retry neither duplicates nor tears a line.
pub fn append_durably(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut file = OpenOptions::new().create(true).append(true).open(path)?;
    let before = file.metadata()?.len();
    let written = file.write_all(bytes).and_then(|()| file.sync_data());
    if written.is_err() {
        let _ = file.set_len(before).and_then(|()| file.sync_data());
    }
    written
}

/// How a writer task takes batches off the queue: until shutdown, whatever
/// arrives; from shutdown on, what is left (the queue is closed: nothing new
/// arrives, nothing already in it is lost).
///
/// With [`Folds`], it also takes the aggregate records of ended intervals,
/// every interval, and all that are left once the queue is empty at
/// shutdown; each is counted as enqueued when taken.
#[derive(Debug, Default)]
pub struct Drain {
    /// Shutdown has begun: the queue is closed and being emptied.
    pub stopping: bool,
    folds: Option<(Arc<Folds>, tokio::time::Interval)>,
}

/// What woke a drain.
enum Event {
    Received(usize),
    Shutdown,
    Tick,
}

impl Drain {
    /// A drain that also takes `folds`' aggregates every `interval`.
    pub fn with_folds(folds: Arc<Folds>, interval: Duration) -> Self {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Drain { stopping: false, folds: Some((folds, ticker)) }
    }

    /// Moves the aggregates ended by now (all of them at shutdown) into
    /// `batch`, counting them as enqueued.
    fn take_folds(&self, batch: &mut Vec<FailureRecord>, counters: &DlqCounters, all: bool) {
        if let Some((folds, _)) = &self.folds {
            let before = batch.len();
            let now = if all { u64::MAX } else { SystemClock.now_ms() };
            folds.take_ended(now, batch);
            counters.enqueued.fetch_add((batch.len() - before) as u64, Ordering::SeqCst);
        }
    }

    /// Fills `batch` (up to [`BATCH_MAX`]); false when there is nothing more,
    /// ever: shutdown has emptied the queue, or every sender is gone. What
    /// it takes off the queue leaves the queue's byte count in `counters`.
    pub async fn next_batch(
        &mut self,
        queue: &mut mpsc::Receiver<FailureRecord>,
        batch: &mut Vec<FailureRecord>,
        counters: &DlqCounters,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        let received = loop {
            if self.stopping {
                let received = queue.recv_many(batch, BATCH_MAX).await;
                if received == 0 {
                    // The queue is empty for good: the last aggregates.
                    self.take_folds(batch, counters, true);
                    self.folds = None;
                }
                break received;
            }
            let event = {
                let ticker = self.folds.as_mut().map(|(_, ticker)| ticker);
                let tick = async move {
                    match ticker {
                        Some(ticker) => drop(ticker.tick().await),
                        None => std::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    received = queue.recv_many(batch, BATCH_MAX) => Event::Received(received),
                    _ = shutdown.changed() => Event::Shutdown,
                    () = tick => Event::Tick,
                }
            };
            match event {
                Event::Received(received) => break received,
                Event::Shutdown => {
                    self.stopping = true;
                    queue.close();
                }
                Event::Tick => {
                    self.take_folds(batch, counters, false);
                    if !batch.is_empty() {
                        break 0;
                    }
                }
            }
        };
        let bytes: u64 = batch[batch.len() - received..].iter().map(FailureRecord::size_bytes).sum();
        counters.queued_bytes.fetch_sub(bytes, Ordering::SeqCst);
        !batch.is_empty()
    }
}

/// Where the file sink writes, and how much it may hold.
#[derive(Debug, Clone)]
pub struct FileTarget {
    /// `dlq.file`.
    pub path: PathBuf,
    /// `dlq.file_max_bytes`.
    pub max_bytes: u64,
}

/// Where the sink without Kafka writes its JSON lines.
#[derive(Debug, Clone)]
pub enum Target {
    /// Appended to `dlq.file`, fsync'd per batch, under its cap.
    File(FileTarget),
    /// Standard error (`dlq.file: "-"`, or the default file where it cannot
    /// be written): each record one line, written whole under the stream's
    /// lock (log lines never split it), kept as long as the container's log
    /// pipeline keeps them. No cap here: the pipeline's.
    Stderr,
}

impl Target {
    /// Where it writes, for logs.
    pub fn place(&self) -> std::borrow::Cow<'_, str> {
        match self {
            Target::File(file) => file.path.to_string_lossy(),
            Target::Stderr => "standard error".into(),
        }
    }
}

/// Drains `queue` into `target` until `shutdown` turns true, then writes
/// what is still queued and returns.
pub async fn run(
    mut queue: mpsc::Receiver<FailureRecord>,
    target: Target,
    counters: Arc<DlqCounters>,
    mut drain: Drain,
    mut shutdown: watch::Receiver<bool>,
) {
    let alarm = CapAlarm::default();
    let mut batch = Vec::with_capacity(BATCH_MAX);
    while drain.next_batch(&mut queue, &mut batch, &counters, &mut shutdown).await {
        counters.in_hand.store(batch.len() as u64, Ordering::SeqCst);
        let lines = Arc::new(Lines::of(&batch));
        let written = write_with_retry(&target, lines, drain.stopping).await;
        let over = (batch.len() - written.records) as u64;
        if over > 0
            && let Target::File(file) = &target
        {
            alarm.dropped(&counters, over, "dlq.file_max_bytes", file.max_bytes, &file.path);
        }
        if written.durable {
            counters.delivered.fetch_add(written.records as u64, Ordering::SeqCst);
        } else {
            tracing::error!(records = written.records, to = %target.place(), "shutting down unable to write: failure records DROPPED");
            counters.lose(DropReason::DiskError, written.records as u64);
        }
        if let Some(bytes) = written.file_bytes {
            counters.file_bytes.store(bytes, Ordering::SeqCst);
        }
        counters.in_hand.store(0, Ordering::SeqCst);
        batch.clear();
    }
}

/// What one batch's write achieved.
#[derive(Debug, Clone, Copy)]
struct Written {
    /// Records that fit under the cap at the last attempt (the rest are dropped).
    records: usize,
    /// Whether they are on disk (false only when shutdown gave up).
    durable: bool,
    /// The file's size afterwards, when known.
    file_bytes: Option<u64>,
}

/// Attempts at writing one batch during shutdown before it is given up.
const SHUTDOWN_ATTEMPTS: u32 = 5;

/// Writes what of `lines` fits under the cap, on a blocking thread (the size
/// is read afresh each time, so a rotated file makes room), retrying with
/// backoff while the disk refuses it. The queue fills meanwhile, and the hot
/// path counts what it cannot enqueue as dropped, so nothing is lost
/// silently. While serving it retries for as long as it takes; during
/// shutdown it gives up after a few tries so a dead disk cannot keep the
/// process from exiting.
async fn write_with_retry(target: &Target, lines: Arc<Lines>, stopping: bool) -> Written {
    let mut backoff = Duration::from_millis(50);
    let mut records = lines.ends.len();
    for attempt in 1.. {
        if stopping && attempt > SHUTDOWN_ATTEMPTS {
            return Written { records, durable: false, file_bytes: None };
        }
        let (owned, batch) = (target.clone(), Arc::clone(&lines));
        let attempted = tokio::task::spawn_blocking(move || match owned {
            Target::File(file) => {
                let size = std::fs::metadata(&file.path).map_or(0, |m| m.len());
                let records = batch.fitting(file.max_bytes.saturating_sub(size));
                let bytes = batch.prefix(records);
                let result = if records == 0 { Ok(()) } else { append_durably(&file.path, bytes) };
                (records, Some(size + bytes.len() as u64), result)
            }
            Target::Stderr => {
                let records = batch.ends.len();
                (records, None, std::io::stderr().lock().write_all(batch.prefix(records)))
            }
        })
        .await;
        match attempted {
            Ok((fitting, file_bytes, Ok(()))) => {
                return Written { records: fitting, durable: true, file_bytes };
            }
            Ok((fitting, _, Err(e))) => {
                records = fitting;
                tracing::error!(
                    to = %target.place(), records, error = %e, stopping,
                    "cannot write failure records; retrying"
                );
            }
            Err(e) => tracing::error!(error = %e, "failure-record write task failed; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
    unreachable!("the attempt counter is unbounded")
}
