//! The file sink (the embedded default, when no Kafka brokers are
//! configured): records appended as JSON lines to `dlq.file`, one `fsync`
//! per batch. A batch counts as delivered only once it is on disk; a failed
//! write is retried, never skipped, and on shutdown the queue is drained.

use std::{
    fs::OpenOptions,
    io::Write,
    path::{Path, PathBuf},
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use tokio::sync::{mpsc, watch};

use super::{DlqCounters, FailureRecord};

/// Records per write and fsync, at most.
pub const BATCH_MAX: usize = 1_024;

/// Serialises `records` as JSON lines.
pub fn to_json_lines(records: &[FailureRecord]) -> Vec<u8> {
    let mut buffer = Vec::with_capacity(records.len() * 512);
    for record in records {
        // Serialising plain strings and integers cannot fail.
        serde_json::to_writer(&mut buffer, record).expect("records serialise");
        buffer.push(b'\n');
    }
    buffer
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
#[derive(Debug, Default)]
pub struct Drain {
    /// Shutdown has begun: the queue is closed and being emptied.
    pub stopping: bool,
}

impl Drain {
    /// Fills `batch` (up to [`BATCH_MAX`]); false when there is nothing more,
    /// ever: shutdown has emptied the queue, or every sender is gone.
    pub async fn next_batch(
        &mut self,
        queue: &mut mpsc::Receiver<FailureRecord>,
        batch: &mut Vec<FailureRecord>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> bool {
        loop {
            if self.stopping {
                return queue.recv_many(batch, BATCH_MAX).await > 0;
            }
            tokio::select! {
                received = queue.recv_many(batch, BATCH_MAX) => return received > 0,
                _ = shutdown.changed() => {
                    self.stopping = true;
                    queue.close();
                }
            }
        }
    }
}

/// Drains `queue` into `path` until `shutdown` turns true, then writes what
/// is still queued and returns.
pub async fn run(
    mut queue: mpsc::Receiver<FailureRecord>,
    path: PathBuf,
    counters: Arc<DlqCounters>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut batch = Vec::with_capacity(BATCH_MAX);
    let mut drain = Drain::default();
    while drain.next_batch(&mut queue, &mut batch, &mut shutdown).await {
        let stopping = drain.stopping;
        counters.in_hand.store(batch.len() as u64, Ordering::SeqCst);
        let outcome = if write_with_retry(&path, &batch, stopping).await {
            &counters.delivered
        } else {
            tracing::error!(records = batch.len(), path = %path.display(), "shutting down with an unwritable disk: failure records DROPPED");
            &counters.dropped
        };
        outcome.fetch_add(batch.len() as u64, Ordering::SeqCst);
        counters.in_hand.store(0, Ordering::SeqCst);
        batch.clear();
    }
}

/// Attempts at writing one batch during shutdown before it is given up.
const SHUTDOWN_ATTEMPTS: u32 = 5;

/// Writes one batch, retrying with backoff while the disk refuses it. The
/// queue fills meanwhile, and the hot path counts what it cannot enqueue as
/// dropped, so nothing is lost silently. While serving it retries for as long
/// as it takes; during shutdown it gives up (returns false) after a few tries
/// so a dead disk cannot keep the process from exiting.
async fn write_with_retry(path: &Path, batch: &[FailureRecord], stopping: bool) -> bool {
    let bytes = Arc::new(to_json_lines(batch));
    let mut backoff = Duration::from_millis(50);
    for attempt in 1.. {
        if stopping && attempt > SHUTDOWN_ATTEMPTS {
            return false;
        }
        let (path_owned, bytes_owned) = (path.to_path_buf(), Arc::clone(&bytes));
        let written = tokio::task::spawn_blocking(move || append_durably(&path_owned, &bytes_owned)).await;
        match written {
            Ok(Ok(())) => return true,
            Ok(Err(e)) => tracing::error!(
                path = %path.display(), records = batch.len(), error = %e, stopping,
                "cannot write failure records; retrying"
            ),
            Err(e) => tracing::error!(error = %e, "failure-record write task failed; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
    unreachable!("the attempt counter is unbounded")
}
