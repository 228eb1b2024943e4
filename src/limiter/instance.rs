//! This process's identity among the instances sharing a store, and what
//! it leaves in its state directory for the process after it.
//!
//! The id is unique per process: `{name}-{pid}-{random}`, where the name is
//! `dlq.instance_id` or the host name. Several processes on one host are
//! several instances in the store's live set (`rli:{instances}`), so each
//! enforces its own share while the store is away.
//!
//! The state directory (`local.state_dir`) holds, per process,
//! `{id}.lock` (locked while the process lives) and `{id}.json`: the store
//! it counted in, the instance count it last read from the store, and the
//! hits it admitted locally and still owed the store. A process starting
//! adopts the files of every process that no longer holds its lock and
//! counted in the same store: it starts from the highest instance count
//! among them, takes over their owed hits (written back once the store
//! answers) and removes their files. Dead files of another store are left
//! for a process of that store, and removed after a day.

use std::{
    fs::File,
    io,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use serde::{Deserialize, Serialize, de::DeserializeOwned};

/// A unique id for this process: `name` (sanitized for a file name), the
/// process id and 32 random bits.
pub fn id(name: &str) -> String {
    let name: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '.' | '_') { c } else { '_' })
        .take(64)
        .collect();
    let mut random = [0u8; 4];
    // Without the OS's randomness the process id alone tells processes apart.
    let _ = getrandom::fill(&mut random);
    format!("{name}-{}-{}", std::process::id(), u32::from_be_bytes(random))
}

/// What a process leaves for the next: `T` is one owed entry (the local
/// limiter's).
#[derive(Debug, Serialize, Deserialize)]
pub struct Saved<T> {
    /// The store it counted in (its URL without credentials, and key prefix).
    pub store: String,
    /// The instance count it last read from the store.
    pub instances: Option<u64>,
    /// The hits it admitted locally and still owed the store.
    pub owed: Vec<T>,
}

/// What a starting process took over from those before it.
#[derive(Debug)]
pub struct Adopted<T> {
    /// The highest instance count they last read.
    pub instances: Option<u64>,
    /// Their owed hits.
    pub owed: Vec<T>,
    /// How many processes' files were adopted.
    pub processes: usize,
}

/// A state directory that cannot be used; names the path.
#[derive(Debug, thiserror::Error)]
#[error("local.state_dir {path}: {error}")]
pub struct StateError {
    path: String,
    error: io::Error,
}

/// This process's files in the state directory, its lock held until dropped.
#[derive(Debug)]
pub struct InstanceState {
    dir: PathBuf,
    id: String,
    store: String,
    _lock: File,
}

/// Dead files of another store are removed past this age.
const STALE: Duration = Duration::from_secs(86_400);

impl InstanceState {
    /// Takes `dir` for the process `id` counting in `store`: its lock file
    /// made and locked, the files of dead processes of the same store
    /// adopted and removed.
    pub fn open<T: DeserializeOwned>(
        dir: &Path,
        id: &str,
        store: &str,
    ) -> Result<(Self, Adopted<T>), StateError> {
        let fail = |path: &Path| {
            let path = path.display().to_string();
            move |error| StateError { path, error }
        };
        std::fs::create_dir_all(dir).map_err(fail(dir))?;
        let lock_path = dir.join(format!("{id}.lock"));
        let lock = File::create(&lock_path).map_err(fail(&lock_path))?;
        lock.try_lock().map_err(|e| fail(&lock_path)(io::Error::other(e.to_string())))?;
        let state =
            InstanceState { dir: dir.to_path_buf(), id: id.to_owned(), store: store.to_owned(), _lock: lock };
        let adopted = state.adopt().map_err(fail(dir))?;
        Ok((state, adopted))
    }

    fn adopt<T: DeserializeOwned>(&self) -> io::Result<Adopted<T>> {
        let mut adopted = Adopted { instances: None, owed: Vec::new(), processes: 0 };
        for entry in std::fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let Some(other) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".json"))
            else {
                continue;
            };
            if other == self.id {
                continue;
            }
            let lock_path = self.dir.join(format!("{other}.lock"));
            let lock = File::options().create(true).truncate(false).write(true).open(&lock_path)?;
            if lock.try_lock().is_err() {
                continue; // its process lives
            }
            let saved: Option<Saved<T>> =
                std::fs::read(&path).ok().and_then(|bytes| serde_json::from_slice(&bytes).ok());
            match saved {
                Some(saved) if saved.store == self.store => {
                    adopted.instances = adopted.instances.max(saved.instances);
                    adopted.owed.extend(saved.owed);
                    adopted.processes += 1;
                }
                // Another store's: left for one of its processes, unless stale.
                Some(_) if !older_than(&path, STALE) => continue,
                _ => {}
            }
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_file(&lock_path);
        }
        Ok(adopted)
    }

    /// Writes what this process would leave now (blocking: call off the
    /// runtime): a whole file or none, by rename.
    pub fn save<T: Serialize>(&self, instances: Option<u64>, owed: Vec<T>) -> Result<(), StateError> {
        let path = self.dir.join(format!("{}.json", self.id));
        let temporary = self.dir.join(format!("{}.json.tmp", self.id));
        let saved = Saved { store: self.store.clone(), instances, owed };
        let bytes = serde_json::to_vec(&saved)
            .map_err(|e| StateError { path: temporary.display().to_string(), error: e.into() })?;
        std::fs::write(&temporary, bytes)
            .and_then(|()| std::fs::rename(&temporary, &path))
            .map_err(|error| StateError { path: path.display().to_string(), error })
    }

    /// This process's id.
    pub fn id(&self) -> &str {
        &self.id
    }
}

fn older_than(path: &Path, age: Duration) -> bool {
    let modified = std::fs::metadata(path).and_then(|m| m.modified());
    modified.is_ok_and(|at| SystemTime::now().duration_since(at).is_ok_and(|elapsed| elapsed > age))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owed(user: &str, hits: u64) -> (String, u64) {
        (user.to_owned(), hits)
    }

    /// Ids differ per process start; a live process's files are left alone;
    /// a dead one's of the same store are adopted once and removed; another
    /// store's are left.
    #[test]
    fn a_starting_process_adopts_what_dead_ones_of_its_store_left() {
        let dir = tempfile::tempdir().unwrap();
        assert_ne!(id("host a"), id("host a"));
        assert!(id("host/a").starts_with("host_a-"));
        let (first, adopted) = InstanceState::open::<(String, u64)>(dir.path(), "one", "redis://s1").unwrap();
        assert_eq!(adopted.processes, 0);
        first.save(Some(3), vec![owed("u", 7)]).unwrap();
        let (other_store, _) =
            InstanceState::open::<(String, u64)>(dir.path(), "elsewhere", "redis://s2").unwrap();
        other_store.save(Some(9), vec![owed("v", 1)]).unwrap();
        drop(other_store);
        // "one" lives: nothing to adopt.
        let (second, adopted) =
            InstanceState::open::<(String, u64)>(dir.path(), "two", "redis://s1").unwrap();
        assert_eq!((adopted.processes, adopted.instances), (0, None));
        second.save(Some(2), vec![owed("w", 1)]).unwrap();
        drop((first, second));
        let (third, adopted) =
            InstanceState::open::<(String, u64)>(dir.path(), "three", "redis://s1").unwrap();
        assert_eq!((adopted.processes, adopted.instances), (2, Some(3)));
        let hits: u64 = adopted.owed.iter().map(|(_, hits)| hits).sum();
        assert_eq!(hits, 8);
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".json"))
            .collect();
        assert_eq!(left, ["elsewhere.json"], "the other store's file is left");
        let (_, again) = InstanceState::open::<(String, u64)>(dir.path(), "four", "redis://s1").unwrap();
        assert_eq!(again.processes, 0, "adopted once");
        drop(third);
    }
}
