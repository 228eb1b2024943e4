//! The local spool in front of Kafka: every record is made durable here
//! before it is produced, so neither a Kafka outage nor a `kill -9` loses it.
//!
//! Layout of `dlq.spool_dir`:
//!
//! - `seg-<first sequence number, 20 digits>.jsonl`: append-only segments of
//!   JSON lines; record `n` of the spool is line `n - first` of its segment.
//! - `cursor`: the sequence number of the first record not yet acknowledged
//!   by Kafka, replaced atomically (write + rename) after each acknowledged run.
//!
//! One writer ([`SpoolWriter`], owned by the queue-draining task) appends and
//! fsyncs; one reader ([`SpoolReader`], owned by the shipping task) reads up
//! to what the writer has published as durable, and deletes a segment once
//! every record in it is acknowledged. On open, a torn last line (a crash
//! mid-write) is cut off: it was never acknowledged as spooled. A failed
//! append (a short write, a failed fsync) is cut back to the last durable
//! length before anything else is written, so a retried batch is in the
//! segment exactly once and the line numbering stays true.

use std::{
    fs::{self, File, OpenOptions},
    io::{self, BufRead, BufReader, Seek, SeekFrom, Write},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use super::FailureRecord;

const CURSOR: &str = "cursor";

/// Positions shared between the writer and the reader.
#[derive(Debug, Default)]
pub struct SpoolState {
    /// Sequence number the next appended record gets; everything below is durable.
    pub durable: AtomicU64,
    /// Sequence number of the first record not yet acknowledged.
    pub acked: AtomicU64,
    /// Bytes of the segments on disk (acknowledged records in a segment not
    /// yet deleted included).
    pub bytes: AtomicU64,
}

impl SpoolState {
    /// Makes `count` appended (and fsync'd) records visible to the reader.
    pub fn publish(&self, count: u64) {
        self.durable.fetch_add(count, Ordering::SeqCst);
    }

    /// Records on disk not yet acknowledged.
    pub fn pending(&self) -> u64 {
        self.durable.load(Ordering::SeqCst).saturating_sub(self.acked.load(Ordering::SeqCst))
    }

    /// Bytes of the segments on disk.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }
}

/// What the writer writes a segment through: a [`File`], or in tests a file
/// that fails on cue.
pub trait Segment: Send + std::fmt::Debug {
    /// Appends all of `bytes` (or fails having written some of them).
    fn write_bytes(&mut self, bytes: &[u8]) -> io::Result<()>;
    /// Makes what was written durable.
    fn sync(&mut self) -> io::Result<()>;
    /// Cuts the segment back to `len` bytes (and makes that durable).
    fn truncate(&mut self, len: u64) -> io::Result<()>;
}

impl Segment for File {
    fn write_bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
        Write::write_all(self, bytes)
    }
    fn sync(&mut self) -> io::Result<()> {
        File::sync_data(self)
    }
    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.set_len(len)?;
        File::sync_data(self)
    }
}

/// Opens a segment file for appending.
pub type SegmentOpener = fn(&Path) -> io::Result<Box<dyn Segment>>;

fn open_segment(path: &Path) -> io::Result<Box<dyn Segment>> {
    Ok(Box::new(OpenOptions::new().create(true).append(true).open(path)?))
}

/// How the spool is laid out and how much it may hold.
#[derive(Debug, Clone, Copy)]
pub struct SpoolSizes {
    /// A segment is closed and a new one started past this size.
    pub segment_bytes: u64,
    /// The segments together never exceed this (`dlq.spool_max_bytes`).
    pub max_bytes: u64,
}

/// Opens (or creates) the spool at `dir`; returns its two ends.
pub fn open(dir: &Path, sizes: SpoolSizes) -> io::Result<(SpoolWriter, SpoolReader, Arc<SpoolState>)> {
    open_with(dir, sizes, open_segment)
}

/// [`open`], writing segments through `opener` (the seam fault tests use).
pub fn open_with(
    dir: &Path,
    sizes: SpoolSizes,
    opener: SegmentOpener,
) -> io::Result<(SpoolWriter, SpoolReader, Arc<SpoolState>)> {
    fs::create_dir_all(dir)?;
    let mut segments = list_segments(dir)?;
    let acked = read_cursor(dir)?.unwrap_or_else(|| segments.first().map_or(0, |(first, _)| *first));
    // Repair the last segment and count its records.
    let durable = match segments.last() {
        Some((first, path)) => first + repair(path)?,
        None => acked,
    };
    // Records below the first segment were deleted, so delivered.
    let oldest = segments.first().map_or(acked, |(first, _)| *first);
    let acked = acked.max(oldest).min(durable);
    // A new spool gets its first segment.
    if segments.is_empty() {
        segments.push((durable, segment_path(dir, durable)));
    }
    let mut bytes = 0;
    for (_, path) in &segments {
        bytes += fs::metadata(path).map_or(0, |m| m.len());
    }
    let state = Arc::new(SpoolState {
        durable: AtomicU64::new(durable),
        acked: AtomicU64::new(acked),
        bytes: AtomicU64::new(bytes),
    });
    let (active_first, active_path) = segments.last().cloned().expect("at least one segment");
    let active_len = fs::metadata(&active_path).map_or(0, |m| m.len());
    let active = opener(&active_path)?;
    let writer = SpoolWriter {
        dir: dir.to_path_buf(),
        sizes,
        opener,
        active,
        active_first,
        active_len,
        dirty: false,
        state: Arc::clone(&state),
    };
    let reader = SpoolReader { dir: dir.to_path_buf(), position: None, state: Arc::clone(&state) };
    Ok((writer, reader, state))
}

/// The appending end.
#[derive(Debug)]
pub struct SpoolWriter {
    dir: PathBuf,
    sizes: SpoolSizes,
    opener: SegmentOpener,
    active: Box<dyn Segment>,
    active_first: u64,
    /// Bytes of the active segment that are durable and published.
    active_len: u64,
    /// A failed append may have left bytes past `active_len`.
    dirty: bool,
    state: Arc<SpoolState>,
}

impl SpoolWriter {
    /// Bytes that may still be appended under `dlq.spool_max_bytes`.
    pub fn room(&self) -> u64 {
        self.sizes.max_bytes.saturating_sub(self.state.bytes())
    }

    /// The spool's byte cap.
    pub fn max_bytes(&self) -> u64 {
        self.sizes.max_bytes
    }

    /// The spool's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Appends `lines` (`count` JSON lines) and fsyncs them. They become
    /// visible to the reader once [`SpoolState::publish`]ed. On failure the
    /// segment is cut back to its last durable length (now, or before the
    /// next append if that fails too), so the caller can retry the same
    /// lines without duplicating or tearing any.
    pub fn append(&mut self, lines: &[u8]) -> io::Result<()> {
        if self.dirty {
            self.active.truncate(self.active_len)?;
            self.dirty = false;
        }
        if self.active_len >= self.sizes.segment_bytes {
            self.roll()?;
        }
        let written = self.active.write_bytes(lines).and_then(|()| self.active.sync());
        if let Err(e) = written {
            self.dirty = self.active.truncate(self.active_len).is_err();
            return Err(e);
        }
        self.active_len += lines.len() as u64;
        self.state.bytes.fetch_add(lines.len() as u64, Ordering::SeqCst);
        Ok(())
    }

    fn roll(&mut self) -> io::Result<()> {
        let first = self.state.durable.load(Ordering::SeqCst);
        let path = segment_path(&self.dir, first);
        self.active = (self.opener)(&path)?;
        // Make the new file's directory entry durable too.
        File::open(&self.dir)?.sync_all()?;
        self.active_first = first;
        self.active_len = 0;
        Ok(())
    }
}

/// The reading end: hands out records in order and records acknowledgements.
#[derive(Debug)]
pub struct SpoolReader {
    dir: PathBuf,
    /// Open segment, its first sequence number, and the sequence number of
    /// the next line the reader will return.
    position: Option<(BufReader<File>, u64, u64)>,
    state: Arc<SpoolState>,
}

impl SpoolReader {
    /// Up to `max` durable records starting at sequence `from` (which must be
    /// at or after the acknowledged cursor), with their sequence numbers.
    /// Lines that do not parse are returned as `Err` with their text, so the
    /// caller can set them aside instead of stalling on them.
    pub fn read(&mut self, from: u64, max: usize) -> io::Result<Vec<(u64, Result<FailureRecord, String>)>> {
        let durable = self.state.durable.load(Ordering::SeqCst);
        let mut out = Vec::new();
        let mut next = from;
        while out.len() < max && next < durable {
            self.seek(next)?;
            let Some((reader, _, at)) = self.position.as_mut() else { break };
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 || !line.ends_with('\n') {
                // End of this segment: the next one starts at `next`.
                self.position = None;
                if !segment_path(&self.dir, next).exists() {
                    break;
                }
                continue;
            }
            *at += 1;
            let parsed = serde_json::from_str::<FailureRecord>(line.trim_end())
                .map_err(|_| line.trim_end().to_owned());
            out.push((next, parsed));
            next += 1;
        }
        Ok(out)
    }

    /// Positions the reader at sequence `seq`.
    fn seek(&mut self, seq: u64) -> io::Result<()> {
        if let Some((_, _, at)) = &self.position
            && *at == seq
        {
            return Ok(());
        }
        let Some((first, path)) =
            list_segments(&self.dir)?.into_iter().rev().find(|(first, _)| *first <= seq)
        else {
            self.position = None;
            return Ok(());
        };
        let mut reader = BufReader::new(File::open(path)?);
        let mut line = String::new();
        for _ in first..seq {
            line.clear();
            reader.read_line(&mut line)?;
        }
        self.position = Some((reader, first, seq));
        Ok(())
    }

    /// Marks every record below `upto` as delivered: persists the cursor and
    /// deletes segments that hold nothing else.
    pub fn acknowledge(&mut self, upto: u64) -> io::Result<()> {
        // Delivered is delivered: move on in memory even if persisting the
        // cursor fails (then only a restart would send these again).
        self.state.acked.store(upto, Ordering::SeqCst);
        write_cursor(&self.dir, upto)?;
        let segments = list_segments(&self.dir)?;
        for pair in segments.windows(2) {
            let ((_, path), (next_first, _)) = (&pair[0], &pair[1]);
            if *next_first <= upto {
                if let Some((_, open_first, _)) = &self.position
                    && segment_path(&self.dir, *open_first) == *path
                {
                    self.position = None;
                }
                let len = fs::metadata(path).map_or(0, |m| m.len());
                fs::remove_file(path)?;
                self.state.bytes.fetch_sub(len.min(self.state.bytes()), Ordering::SeqCst);
            }
        }
        Ok(())
    }
}

fn segment_path(dir: &Path, first: u64) -> PathBuf {
    dir.join(format!("seg-{first:020}.jsonl"))
}

fn list_segments(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let mut segments = Vec::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(first) = name
            .to_str()
            .and_then(|n| n.strip_prefix("seg-"))
            .and_then(|n| n.strip_suffix(".jsonl"))
            .and_then(|n| n.parse::<u64>().ok())
        else {
            continue;
        };
        segments.push((first, entry.path()));
    }
    segments.sort();
    Ok(segments)
}

fn read_cursor(dir: &Path) -> io::Result<Option<u64>> {
    match fs::read_to_string(dir.join(CURSOR)) {
        Ok(text) => text.trim().parse().map(Some).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: not a number", dir.join(CURSOR).display()),
            )
        }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

fn write_cursor(dir: &Path, value: u64) -> io::Result<()> {
    let tmp = dir.join("cursor.tmp");
    let mut file = File::create(&tmp)?;
    writeln!(file, "{value}")?;
    file.sync_data()?;
    fs::rename(tmp, dir.join(CURSOR))
}

/// Cuts a torn last line off `path`; returns the number of complete lines.
fn repair(path: &Path) -> io::Result<u64> {
    let mut file = OpenOptions::new().read(true).write(true).open(path)?;
    let mut reader = BufReader::new(&mut file);
    let (mut lines, mut good_len, mut line) = (0, 0_u64, Vec::new());
    loop {
        line.clear();
        let read = reader.read_until(b'\n', &mut line)?;
        if read == 0 || line.last() != Some(&b'\n') {
            break;
        }
        lines += 1;
        good_len += read as u64;
    }
    drop(reader);
    if file.seek(SeekFrom::End(0))? != good_len {
        tracing::warn!(path = %path.display(), kept = lines, "spool segment ended in a torn write; cut it off");
        file.set_len(good_len)?;
        file.sync_data()?;
    }
    Ok(lines)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::dlq::{file::to_json_lines, record::*};

    fn sizes(segment_bytes: u64) -> SpoolSizes {
        SpoolSizes { segment_bytes, max_bytes: u64::MAX }
    }

    /// A record of about 200 bytes, numbered `i`.
    pub(crate) fn record(i: u64) -> FailureRecord {
        FailureRecord {
            schema_version: SCHEMA_VERSION,
            event_id: format!("{i:026}"),
            time: format_time(i),
            instance: "t".to_owned(),
            request: RecordRequest {
                user_id: format!("u{i}"),
                resource_path: "/p".to_owned(),
                client_type: None,
                priority: "BULK".to_owned(),
                weight: 1,
                counting: "admission".to_owned(),
                headers: Default::default(),
            },
            rule_id: "r".to_owned(),
            failure: RecordFailure { kind: "timeout".to_owned(), message: "slow".to_owned() },
            answer: RecordAnswer { allowed: true, reason: "FAIL_OPEN".to_owned() },
            trace_id: None,
            count: 1,
            last_time: None,
        }
    }

    fn append(writer: &mut SpoolWriter, range: std::ops::Range<u64>) {
        let records: Vec<_> = range.clone().map(record).collect();
        writer.append(&to_json_lines(&records)).unwrap();
        writer.state.publish(records.len() as u64);
    }

    fn users(read: &[(u64, Result<FailureRecord, String>)]) -> Vec<String> {
        read.iter().map(|(_, r)| r.as_ref().unwrap().request.user_id.clone()).collect()
    }

    /// Faults the next segment operations will meet, shared by the test and
    /// the opener (a `fn`, so the script is a static).
    static FAULTS: std::sync::Mutex<Vec<Fault>> = std::sync::Mutex::new(Vec::new());

    #[derive(Debug, Clone, Copy)]
    enum Fault {
        /// `write_all` writes this many bytes, then fails.
        ShortWrite(usize),
        /// `sync_data` fails after a complete write.
        FailedSync,
    }

    #[derive(Debug)]
    struct Faulty(File);

    impl Segment for Faulty {
        fn write_bytes(&mut self, bytes: &[u8]) -> io::Result<()> {
            let fault = FAULTS.lock().unwrap().first().copied();
            if let Some(Fault::ShortWrite(n)) = fault {
                FAULTS.lock().unwrap().remove(0);
                Write::write_all(&mut self.0, &bytes[..n.min(bytes.len())])?;
                return Err(io::Error::other("injected short write (disk full)"));
            }
            Write::write_all(&mut self.0, bytes)
        }
        fn sync(&mut self) -> io::Result<()> {
            let fault = FAULTS.lock().unwrap().first().copied();
            if let Some(Fault::FailedSync) = fault {
                FAULTS.lock().unwrap().remove(0);
                return Err(io::Error::other("injected fsync failure (EIO)"));
            }
            self.0.sync_data()
        }
        fn truncate(&mut self, len: u64) -> io::Result<()> {
            Segment::truncate(&mut self.0, len)
        }
    }

    fn faulty(path: &Path) -> io::Result<Box<dyn Segment>> {
        Ok(Box::new(Faulty(OpenOptions::new().create(true).append(true).open(path)?)))
    }

    /// A short write and a failed fsync, each retried as the spooler does:
    /// every record is read back exactly once, in order, none torn, and
    /// again after a reopen (a restart).
    #[test]
    fn a_retried_append_after_a_partial_write_or_failed_fsync_loses_and_repeats_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (mut writer, mut reader, state) = open_with(dir.path(), sizes(1 << 20), faulty).unwrap();
        let batch = |range: std::ops::Range<u64>| to_json_lines(&range.map(record).collect::<Vec<_>>());
        let append_retrying = |writer: &mut SpoolWriter, lines: Vec<u8>, count: u64| {
            let mut failures = 0;
            while writer.append(&lines).is_err() {
                failures += 1;
            }
            writer.state.publish(count);
            failures
        };
        assert_eq!(append_retrying(&mut writer, batch(0..3), 3), 0);
        FAULTS.lock().unwrap().push(Fault::ShortWrite(100));
        assert_eq!(append_retrying(&mut writer, batch(3..6), 3), 1, "the short write failed once");
        FAULTS.lock().unwrap().push(Fault::FailedSync);
        assert_eq!(append_retrying(&mut writer, batch(6..9), 3), 1, "the fsync failed once");
        assert_eq!(append_retrying(&mut writer, batch(9..10), 1), 0);
        assert_eq!(state.pending(), 10);
        let read = reader.read(0, 100).unwrap();
        assert_eq!(users(&read), (0..10).map(|i| format!("u{i}")).collect::<Vec<_>>());
        let ids: std::collections::HashSet<_> =
            read.iter().map(|(_, r)| r.as_ref().unwrap().event_id.clone()).collect();
        assert_eq!(ids.len(), 10, "every event id exactly once");
        drop((writer, reader));
        let (_, mut reader, state) = open(dir.path(), sizes(1 << 20)).unwrap();
        assert_eq!(state.pending(), 10, "a restart counts the same records");
        assert_eq!(
            users(&reader.read(0, 100).unwrap()),
            (0..10).map(|i| format!("u{i}")).collect::<Vec<_>>()
        );
    }

    #[test]
    fn reads_in_order_across_segments_and_deletes_acknowledged_ones() {
        let dir = tempfile::tempdir().unwrap();
        let (mut writer, mut reader, state) = open(dir.path(), sizes(600)).unwrap();
        for batch in 0..10 {
            append(&mut writer, batch * 3..batch * 3 + 3);
        }
        assert_eq!(state.pending(), 30);
        assert!(list_segments(dir.path()).unwrap().len() > 3, "segments rolled");
        let first = reader.read(0, 12).unwrap();
        assert_eq!(first.iter().map(|(s, _)| *s).collect::<Vec<_>>(), (0..12).collect::<Vec<_>>());
        reader.acknowledge(12).unwrap();
        assert_eq!(state.pending(), 18);
        let rest = reader.read(12, 100).unwrap();
        assert_eq!(users(&rest), (12..30).map(|i| format!("u{i}")).collect::<Vec<_>>());
        reader.acknowledge(30).unwrap();
        assert_eq!(state.pending(), 0);
        assert_eq!(list_segments(dir.path()).unwrap().len(), 1, "only the active segment is left");
    }

    #[test]
    fn reopening_resumes_at_the_cursor() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut writer, mut reader, _) = open(dir.path(), sizes(1 << 20)).unwrap();
            append(&mut writer, 0..10);
            reader.read(0, 4).unwrap();
            reader.acknowledge(4).unwrap();
        }
        let (mut writer, mut reader, state) = open(dir.path(), sizes(1 << 20)).unwrap();
        assert_eq!((state.acked.load(Ordering::SeqCst), state.pending()), (4, 6));
        append(&mut writer, 10..12);
        let read = reader.read(4, 100).unwrap();
        assert_eq!(read.first().unwrap().0, 4);
        assert_eq!(users(&read), (4..12).map(|i| format!("u{i}")).collect::<Vec<_>>());
    }

    #[test]
    fn a_torn_last_line_is_cut_off() {
        let dir = tempfile::tempdir().unwrap();
        {
            let (mut writer, _, _) = open(dir.path(), sizes(1 << 20)).unwrap();
            append(&mut writer, 0..3);
        }
        let (_, path) = list_segments(dir.path()).unwrap().pop().unwrap();
        OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"schema_version\":1,\"ev")
            .unwrap();
        let (mut writer, mut reader, state) = open(dir.path(), sizes(1 << 20)).unwrap();
        assert_eq!(state.pending(), 3);
        append(&mut writer, 3..4);
        assert_eq!(users(&reader.read(0, 10).unwrap()), ["u0", "u1", "u2", "u3"]);
    }

    #[test]
    fn nothing_beyond_durable_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let (mut writer, mut reader, _) = open(dir.path(), sizes(1 << 20)).unwrap();
        assert!(reader.read(0, 10).unwrap().is_empty());
        append(&mut writer, 0..2);
        assert_eq!(reader.read(0, 10).unwrap().len(), 2);
        assert!(reader.read(2, 10).unwrap().is_empty());
    }

    #[test]
    fn unparseable_lines_are_handed_back_not_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let (mut writer, mut reader, _) = open(dir.path(), sizes(1 << 20)).unwrap();
        writer.append(b"not json\n").unwrap();
        writer.state.publish(1);
        append(&mut writer, 1..2);
        let read = reader.read(0, 10).unwrap();
        assert_eq!(read[0], (0, Err("not json".to_owned())));
        assert!(read[1].1.is_ok());
    }

    #[test]
    fn its_bytes_are_counted_on_append_and_freed_with_deleted_segments() {
        let dir = tempfile::tempdir().unwrap();
        let (mut writer, mut reader, state) = open(dir.path(), sizes(600)).unwrap();
        append(&mut writer, 0..5);
        append(&mut writer, 5..10);
        append(&mut writer, 10..15);
        let on_disk = |dir: &Path| -> u64 {
            list_segments(dir).unwrap().iter().map(|(_, p)| fs::metadata(p).unwrap().len()).sum()
        };
        assert_eq!(state.bytes(), on_disk(dir.path()));
        assert!(list_segments(dir.path()).unwrap().len() >= 2);
        reader.acknowledge(15).unwrap();
        assert_eq!(state.bytes(), on_disk(dir.path()), "deleted segments are given back");
        drop((writer, reader));
        let (_, _, reopened) = open(dir.path(), sizes(600)).unwrap();
        assert_eq!(reopened.bytes(), on_disk(dir.path()), "counted again at startup");
    }
}
