//! The capture file writer: one task drains the queue in batches into the
//! JSON-lines file until the stop signal, then drains what is left (the
//! topic's writer is `kafka.rs`).

use std::{
    io::Write as _,
    path::PathBuf,
    sync::{Arc, atomic::Ordering},
};

use tokio::sync::{mpsc, watch};

use super::{CaptureCounters, CaptureRecord};
use crate::{
    clock::{Clock, SystemClock},
    folded::Folded,
};

pub(super) const BATCH: usize = 1_024;

/// Receives the next batch into `batch`; false once the queue is closed
/// and empty, or stopping and empty.
pub(super) async fn next_batch(
    queue: &mut mpsc::Receiver<CaptureRecord>,
    batch: &mut Vec<CaptureRecord>,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    batch.clear();
    if !*stop.borrow() {
        tokio::select! {
            n = queue.recv_many(batch, BATCH) => return n > 0,
            _ = stop.changed() => {}
        }
    }
    // Stopping: what is queued, without waiting.
    while let Ok(record) = queue.try_recv() {
        batch.push(record);
        if batch.len() >= BATCH {
            break;
        }
    }
    !batch.is_empty()
}

/// Appends batches to `path`, never past `max_bytes`, until `stop`. The
/// size is read from the file at each batch, so a file rotated away (moved
/// or truncated by logrotate or an operator) is written afresh at once.
pub async fn run_file(
    mut queue: mpsc::Receiver<CaptureRecord>,
    path: PathBuf,
    max_bytes: u64,
    counters: Arc<CaptureCounters>,
    mut stop: watch::Receiver<bool>,
) {
    let mut batch = Vec::with_capacity(BATCH);
    let failed = Folded::default();
    loop {
        if !next_batch(&mut queue, &mut batch, &mut stop).await {
            return;
        }
        let lines: Vec<Vec<u8>> = batch
            .iter()
            .map(|record| {
                let mut line = serde_json::to_vec(record).unwrap_or_default();
                line.push(b'\n');
                line
            })
            .collect();
        let target = path.clone();
        let written = tokio::task::spawn_blocking(move || append_within(&target, &lines, max_bytes)).await;
        match written {
            Ok(Ok((kept, capped))) => {
                counters.written.fetch_add(kept, Ordering::Relaxed);
                counters.dropped_disk_cap.fetch_add(capped, Ordering::Relaxed);
            }
            Ok(Err(e)) => {
                counters.dropped_error.fetch_add(batch.len() as u64, Ordering::Relaxed);
                if let Some(times) = failed.pass(SystemClock.now_ms() / 1_000) {
                    tracing::error!(path = %path.display(), error = %e, times, "cannot append capture records");
                }
            }
            Err(e) => tracing::error!(error = %e, "capture writer failed"),
        }
    }
}

/// Appends to `path` the `lines` that fit under `max_bytes` with what the
/// file holds now; how many were kept and how many did not fit.
fn append_within(path: &std::path::Path, lines: &[Vec<u8>], max_bytes: u64) -> std::io::Result<(u64, u64)> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let mut file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    let mut size = file.metadata()?.len();
    let mut out = Vec::with_capacity(lines.iter().map(Vec::len).sum());
    let (mut kept, mut capped) = (0, 0);
    for line in lines {
        if size + line.len() as u64 > max_bytes {
            capped += 1;
            continue;
        }
        size += line.len() as u64;
        out.extend_from_slice(line);
        kept += 1;
    }
    if !out.is_empty() {
        file.write_all(&out)?;
    }
    Ok((kept, capped))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full file takes no more; once rotated away (moved, or truncated)
    /// it is written again at once.
    #[test]
    fn a_rotated_file_is_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("capture.jsonl");
        let line = |n: u8| vec![n; 9].into_iter().chain([b'\n']).collect::<Vec<u8>>();
        assert_eq!(append_within(&path, &[line(1), line(2), line(3)], 25).unwrap(), (2, 1));
        assert_eq!(append_within(&path, &[line(4)], 25).unwrap(), (0, 1), "full");
        std::fs::rename(&path, dir.path().join("capture.jsonl.1")).unwrap();
        assert_eq!(append_within(&path, &[line(5)], 25).unwrap(), (1, 0), "a new file after a move");
        std::fs::File::create(&path).unwrap().set_len(0).unwrap();
        assert_eq!(append_within(&path, &[line(6), line(7)], 25).unwrap(), (2, 0), "after a truncation");
        assert_eq!(std::fs::read(&path).unwrap(), [line(6), line(7)].concat());
    }
}
