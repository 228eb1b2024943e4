//! The console's audit log: one JSON line per action (who, what, when,
//! the outcome, the version in force before and after, the commit),
//! appended and synced to `admin.audit_log` before the action is answered.
//! An action that cannot be logged is not taken. Refused sign-ins are
//! counted and written as one line a minute at most, so nobody can fill the
//! disk by knocking. What a signed-in user can repeat without changing
//! anything (reading its session, an action its role refuses) is folded
//! ([`AuditLog::fold`]) by user and outcome: written at once when that
//! user's last folded line of that outcome is a minute old, else counted
//! and written as one line a minute, so a user flooding refused actions,
//! whichever, adds at most a line a minute (and its session reads one
//! more).

use std::{
    collections::HashMap,
    io::{Read as _, Seek as _, SeekFrom, Write as _},
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

use super::auth::User;

/// One line of the audit log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// When, RFC 3339 with milliseconds.
    pub at: String,
    /// Who (`-` for refused sign-ins).
    pub user: String,
    /// The user's role then.
    pub role: String,
    /// What: `sign_in`, `validate`, `gate`, `propose`, `publish`, `rollback`, `sign_in_refused`.
    pub action: String,
    /// `ok`, `refused` (not allowed, or failed the gate), `failed`, or
    /// `started` (a publication about to commit; its outcome follows).
    pub outcome: String,
    /// What it was about, in words (the capture, the message, the error).
    pub detail: String,
    /// The version in force before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub before: Option<String>,
    /// The version in force after (published or rolled back to).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// The commit made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
}

impl AuditEntry {
    /// An entry for `user` now.
    pub fn new(user: &User, action: &str, outcome: &str, detail: impl Into<String>) -> Self {
        Self {
            at: now(),
            user: user.name.clone(),
            role: user.role.as_str().to_owned(),
            action: action.to_owned(),
            outcome: outcome.to_owned(),
            detail: detail.into(),
            before: None,
            after: None,
            commit: None,
        }
    }
}

/// `entry`, saying how many like it were counted since its user's last
/// line of that action.
fn with_count(pending: Option<(AuditEntry, u64)>, entry: AuditEntry) -> AuditEntry {
    match pending {
        None => entry,
        Some((_, count)) => {
            AuditEntry { detail: format!("{}; and {count} more since the last line", entry.detail), ..entry }
        }
    }
}

fn now() -> String {
    humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string()
}

/// Why the log could not be written or read.
#[derive(Debug, thiserror::Error)]
#[error("audit log {path}: {error}")]
pub struct AuditError {
    path: String,
    error: std::io::Error,
}

/// The audit log file.
#[derive(Debug)]
pub struct AuditLog {
    path: PathBuf,
    /// One writer at a time: lines never interleave.
    writer: Mutex<()>,
    refused: AtomicU64,
    folded: Mutex<HashMap<(String, String), Folded>>,
}

/// One user's folded action: when its last line was written, and what
/// came since.
#[derive(Debug)]
struct Folded {
    written: Instant,
    /// The last entry not yet written, and how many like it.
    pending: Option<(AuditEntry, u64)>,
}

/// A user's folded action is written at most this often.
pub const FOLD_INTERVAL: Duration = Duration::from_secs(60);

/// Most (user, outcome) pairs folded at once; past it, entries of new pairs
/// count as refused sign-ins (one line a minute): a trusted proxy can name
/// any number of users.
const MAX_FOLDED: usize = 10_000;

/// How much of the log's end [`AuditLog::recent`] reads.
const TAIL_BYTES: u64 = 1 << 20;

impl AuditLog {
    /// The log at `path`; its directory is made when missing, and it is
    /// opened once now, so a log that cannot be written stops the console
    /// from starting.
    pub fn open(path: &Path) -> Result<Self, AuditError> {
        let log = Self {
            path: path.to_path_buf(),
            writer: Mutex::new(()),
            refused: AtomicU64::new(0),
            folded: Mutex::default(),
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| log.error(e))?;
        }
        log.file().map_err(|e| log.error(e))?;
        Ok(log)
    }

    fn error(&self, error: std::io::Error) -> AuditError {
        AuditError { path: self.path.display().to_string(), error }
    }

    fn file(&self) -> std::io::Result<std::fs::File> {
        use std::os::unix::fs::OpenOptionsExt as _;
        std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(&self.path)
    }

    /// Appends `entry` and syncs it to disk (blocking: call off the runtime).
    pub fn write(&self, entry: &AuditEntry) -> Result<(), AuditError> {
        let mut line = serde_json::to_vec(entry).map_err(|e| self.error(e.into()))?;
        line.push(b'\n');
        let _one = self.writer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut file = self.file().map_err(|e| self.error(e))?;
        file.write_all(&line).and_then(|()| file.sync_data()).map_err(|e| self.error(e))
    }

    /// Counts a refused sign-in (written by [`AuditLog::flush_refused`]).
    pub fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Logs `entry`, an action that changes nothing (a session read, a
    /// refusal by role): written now when its user's last folded line of
    /// its outcome is [`FOLD_INTERVAL`] old, else counted and written by
    /// [`AuditLog::flush`]. Returns the entry to write now, if any
    /// (blocking to write: the caller writes it off the runtime).
    pub fn fold(&self, entry: AuditEntry, now: Instant) -> Option<AuditEntry> {
        let mut folded = self.folded.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = (entry.user.clone(), entry.outcome.clone());
        if !folded.contains_key(&key) && folded.len() >= MAX_FOLDED {
            folded.retain(|_, f| f.pending.is_some() || now.duration_since(f.written) < FOLD_INTERVAL);
            if folded.len() >= MAX_FOLDED {
                self.refused();
                return None;
            }
        }
        match folded.get_mut(&key) {
            Some(f) if now.duration_since(f.written) < FOLD_INTERVAL => {
                let count = f.pending.as_ref().map_or(0, |(_, n)| *n);
                f.pending = Some((entry, count + 1));
                None
            }
            Some(f) => {
                f.written = now;
                Some(with_count(f.pending.take(), entry))
            }
            None => {
                folded.insert(key, Folded { written: now, pending: None });
                Some(entry)
            }
        }
    }

    /// Writes one line for the sign-ins refused since the last, if any,
    /// and one for each folded action whose last line is
    /// [`FOLD_INTERVAL`] old.
    pub fn flush(&self, now: Instant) -> Result<(), AuditError> {
        let due: Vec<AuditEntry> = {
            let mut folded = self.folded.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let due = folded
                .values_mut()
                .filter(|f| f.pending.is_some() && now.duration_since(f.written) >= FOLD_INTERVAL)
                .filter_map(|f| {
                    f.written = now;
                    let (entry, count) = f.pending.take()?;
                    Some(AuditEntry {
                        detail: format!("{count} time(s); the last: {}", entry.detail),
                        ..entry
                    })
                })
                .collect();
            folded.retain(|_, f| f.pending.is_some() || now.duration_since(f.written) < FOLD_INTERVAL);
            due
        };
        for entry in &due {
            self.write(entry)?;
        }
        self.flush_refused()
    }

    /// Writes one line for the sign-ins refused since the last, if any.
    fn flush_refused(&self) -> Result<(), AuditError> {
        let count = self.refused.swap(0, Ordering::Relaxed);
        if count == 0 {
            return Ok(());
        }
        let entry = AuditEntry {
            at: now(),
            user: "-".to_owned(),
            role: "-".to_owned(),
            action: "sign_in_refused".to_owned(),
            outcome: "refused".to_owned(),
            detail: format!("{count} request(s) without a known token or role"),
            before: None,
            after: None,
            commit: None,
        };
        self.write(&entry)
    }

    /// Folded entries not yet written, all users together.
    pub fn pending(&self) -> u64 {
        let folded = self.folded.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        folded.values().filter_map(|f| f.pending.as_ref()).map(|(_, n)| n).sum()
    }

    /// The last `limit` entries, newest first (from the log's last MiB).
    pub fn recent(&self, limit: usize) -> Result<Vec<AuditEntry>, AuditError> {
        let mut file = std::fs::File::open(&self.path).map_err(|e| self.error(e))?;
        let len = file.metadata().map_err(|e| self.error(e))?.len();
        let start = len.saturating_sub(TAIL_BYTES);
        file.seek(SeekFrom::Start(start)).map_err(|e| self.error(e))?;
        let mut text = String::new();
        file.take(TAIL_BYTES).read_to_string(&mut text).map_err(|e| self.error(e))?;
        let lines = text.lines().skip(usize::from(start > 0)); // the first may be cut
        let mut entries: Vec<AuditEntry> = lines.filter_map(|l| serde_json::from_str(l).ok()).collect();
        entries.reverse();
        entries.truncate(limit);
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::console::auth::Role;

    #[test]
    fn entries_are_appended_and_read_back_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(&dir.path().join("state/audit.jsonl")).unwrap();
        let ada = User { name: "Ada".into(), email: "ada@example.com".into(), role: Role::Publisher };
        let mut entry = AuditEntry::new(&ada, "publish", "ok", "raise the login limit");
        entry.before = Some("v1".into());
        entry.after = Some("v2".into());
        log.write(&entry).unwrap();
        log.write(&AuditEntry::new(&ada, "gate", "refused", "fails")).unwrap();
        log.refused();
        log.refused();
        let now = Instant::now();
        log.flush(now).unwrap();
        log.flush(now).unwrap();
        let read = log.recent(10).unwrap();
        let actions: Vec<&str> = read.iter().map(|e| e.action.as_str()).collect();
        assert_eq!(actions, ["sign_in_refused", "gate", "publish"]);
        assert_eq!(read[0].detail, "2 request(s) without a known token or role");
        assert_eq!(read[2], entry);
        assert_eq!(log.recent(1).unwrap().len(), 1);
    }

    /// A user repeating refused actions 5,000 times in a minute, whichever
    /// action, adds one line then, one at the minute's end, and none while
    /// silent; its session read has a line of its own.
    #[test]
    fn a_flood_of_folded_actions_adds_a_line_a_minute() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(&dir.path().join("audit.jsonl")).unwrap();
        let val = User { name: "Val".into(), email: String::new(), role: Role::Viewer };
        let start = Instant::now();
        let mut written = 0;
        for i in 0..5_000u64 {
            let at = start + Duration::from_millis(i * 10);
            let action = ["publish", "rollback", "sync"][(i % 3) as usize];
            let refused =
                AuditEntry::new(&val, action, "refused", format!("{action} needs the publisher role"));
            if let Some(entry) = log.fold(refused, at) {
                log.write(&entry).unwrap();
                written += 1;
            }
            if i % 100 == 0 {
                log.flush(at).unwrap();
            }
        }
        // 50 s of flood: the first line at once, the rest counted.
        assert_eq!((written, log.pending()), (1, 4_999));
        let other = AuditEntry::new(&val, "sign_in", "ok", "from 192.0.2.1");
        assert!(log.fold(other, start).is_some(), "another action has its own line");
        log.flush(start + FOLD_INTERVAL).unwrap();
        log.flush(start + FOLD_INTERVAL * 3).unwrap();
        let read = log.recent(10).unwrap();
        assert_eq!(read.len(), 2, "{read:?}");
        assert_eq!(read[0].detail, "4999 time(s); the last: rollback needs the publisher role");
        assert_eq!((log.pending(), log.folded.lock().unwrap().len()), (0, 0), "forgotten once quiet");
    }

    #[test]
    fn a_log_that_cannot_be_written_is_an_error_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, "").unwrap();
        let error = AuditLog::open(&file.join("audit.jsonl")).unwrap_err();
        assert!(error.to_string().starts_with("audit log "), "{error}");
    }
}
