//! The current snapshot, swapped atomically, and the task that reloads it when
//! the rule files change.
//!
//! Change detection polls file metadata rather than using inotify: it sees the
//! two ways operators replace rules — an atomic `rename` over the old file and
//! a Kubernetes ConfigMap symlink swap (`..data -> ..2026_…`) — because it
//! compares the *resolved* path, device, inode, size and mtime of every rule
//! file, and it needs no watch on a directory that may itself be replaced.
//! Files are read again only when that fingerprint changes.

use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;

use crate::limiter::adaptive::{self, AdaptiveLimit};

use crate::clock::{Clock, SystemClock};
use tokio::sync::watch as tokio_watch;

use super::{Snapshot, native::rule_files};

/// A compiled rule set that can be hot-swapped: native rules or the Envoy
/// configuration.
pub trait Versioned: Send + Sync + 'static {
    /// Content hash: equal content, equal version.
    fn version(&self) -> &str;
    /// A short description for logs (how many rules or domains).
    fn size(&self) -> usize;
    /// Takes over the moving state of `previous`, the set it replaces
    /// (adaptive limits), before it is swapped in. Nothing by default.
    fn carry_over(&self, _previous: &Self) {}
}

impl Versioned for Snapshot {
    fn version(&self) -> &str {
        Snapshot::version(self)
    }
    fn size(&self) -> usize {
        self.rules().len()
    }
    /// Each adaptive rule keeps the limit its namesake had reached and the
    /// outcomes not yet exchanged.
    fn carry_over(&self, previous: &Self) {
        fn limits(s: &Snapshot) -> Vec<(&str, &AdaptiveLimit)> {
            s.adaptive_rules().filter_map(|r| Some((&*r.id, r.adaptive.as_deref()?))).collect()
        }
        adaptive::carry_over(limits(previous), limits(self));
    }
}

impl Versioned for super::envoy::EnvoyConfig {
    fn version(&self) -> &str {
        super::envoy::EnvoyConfig::version(self)
    }
    fn size(&self) -> usize {
        self.domain_count()
    }
    /// Each adaptive limit keeps the limit its namesake (same full key)
    /// had reached and the outcomes not yet exchanged.
    fn carry_over(&self, previous: &Self) {
        fn limits(c: &super::envoy::EnvoyConfig) -> Vec<(&str, &AdaptiveLimit)> {
            c.adaptive_limits().filter_map(|l| Some((&*l.full_key, l.adaptive.as_deref()?))).collect()
        }
        adaptive::carry_over(limits(previous), limits(self));
    }
}

/// Holds the compiled rules every decision reads. Readers never block writers.
#[derive(Debug)]
pub struct Hot<T> {
    current: ArcSwap<T>,
    /// When `current` was last swapped in, ms since the epoch.
    swapped_at_ms: AtomicU64,
    /// Reloads rejected since start.
    reload_failures: AtomicU64,
    /// Reloads rejected since the last swap.
    failures_since_swap: AtomicU64,
    /// Sets loaded since start, the first included.
    loads: AtomicU64,
}

/// The native rule snapshot, hot-swapped.
pub type RuleStore = Hot<Snapshot>;

impl<T: Versioned> Hot<T> {
    /// A store serving `value`.
    pub fn new(value: T) -> Self {
        Hot {
            current: ArcSwap::from_pointee(value),
            swapped_at_ms: AtomicU64::new(SystemClock.now_ms()),
            reload_failures: AtomicU64::new(0),
            failures_since_swap: AtomicU64::new(0),
            loads: AtomicU64::new(1),
        }
    }

    /// Sets loaded since start, the first included (upstream's
    /// `config_load_success`).
    pub fn loads(&self) -> u64 {
        self.loads.load(Ordering::Relaxed)
    }

    /// When the current rules were swapped in.
    pub fn swapped_at(&self) -> std::time::SystemTime {
        std::time::UNIX_EPOCH + Duration::from_millis(self.swapped_at_ms.load(Ordering::Relaxed))
    }

    /// Reloads rejected since start (the previous rules kept serving).
    pub fn reload_failures(&self) -> u64 {
        self.reload_failures.load(Ordering::Relaxed)
    }

    /// Reloads rejected since the rules in force were swapped in
    /// (limitador's `config_err_since`).
    pub fn failures_since_swap(&self) -> u64 {
        self.failures_since_swap.load(Ordering::Relaxed)
    }

    /// The rules to decide with. Hold the `Arc` for the whole decision so
    /// one request sees one rule set even if a reload lands meanwhile.
    pub fn load(&self) -> Arc<T> {
        self.current.load_full()
    }

    /// Replaces the rules for all later `load`s.
    pub fn swap(&self, value: T) {
        value.carry_over(&self.current.load());
        self.current.store(Arc::new(value));
        self.swapped_at_ms.store(SystemClock.now_ms(), Ordering::Relaxed);
        self.failures_since_swap.store(0, Ordering::Relaxed);
        self.loads.fetch_add(1, Ordering::Relaxed);
    }
}

/// Identity of the rule files at one moment: resolved path, device, inode,
/// size and mtime of each. Any replacement or edit changes it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fingerprint(Vec<(PathBuf, u64, u64, u64, i64, i64)>);

fn fingerprint(path: &Path) -> Result<Fingerprint, String> {
    let files = rule_files(path).map_err(|e| e.to_string())?;
    let mut entries = Vec::with_capacity(files.len() + 1);
    for file in std::iter::once(path.to_path_buf()).chain(files) {
        let resolved = fs::canonicalize(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let meta = fs::metadata(&resolved).map_err(|e| format!("{}: {e}", file.display()))?;
        entries.push((resolved, meta.dev(), meta.ino(), meta.len(), meta.mtime(), meta.mtime_nsec()));
    }
    Ok(Fingerprint(entries))
}

/// Polls `path` every `interval` and swaps in a new snapshot when the files
/// changed and the new rule set validates. An invalid rule set is logged
/// (once per distinct change) and the last good snapshot keeps serving.
/// Returns when `shutdown` turns true.
pub async fn watch<T: Versioned>(
    store: Arc<Hot<T>>,
    path: PathBuf,
    interval: Duration,
    load: impl Fn(&Path) -> Result<T, super::RuleErrors> + Send + Sync + 'static,
    mut shutdown: tokio_watch::Receiver<bool>,
) {
    // No fingerprint yet: the first poll reloads, so a change made between
    // the initial load and this task's start is not missed (an unchanged
    // rule set has the same version and is not swapped).
    let load = Arc::new(load);
    let mut last: Option<Fingerprint> = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        let probe_path = path.clone();
        // Metadata calls and file reads block: keep them off the runtime's workers.
        let probed = tokio::task::spawn_blocking(move || {
            let now = fingerprint(&probe_path);
            (now, probe_path)
        })
        .await;
        let Ok((now, probe_path)) = probed else { continue };
        let now = match now {
            Ok(now) => now,
            Err(message) => {
                // Mid-swap a file can be missing for an instant; report once.
                if last.take().is_some() {
                    tracing::warn!(path = %path.display(), %message, "rules unreadable; keeping the last good snapshot");
                }
                continue;
            }
        };
        if last.as_ref() == Some(&now) {
            continue;
        }
        last = Some(now);
        let load = Arc::clone(&load);
        let loaded = tokio::task::spawn_blocking(move || load(&probe_path)).await;
        match loaded {
            Ok(Ok(snapshot)) => {
                let old = store.load();
                if old.version() == snapshot.version() {
                    tracing::debug!(version = snapshot.version(), "rule files changed, content did not");
                    continue;
                }
                tracing::info!(
                    from = old.version(),
                    to = snapshot.version(),
                    size = snapshot.size(),
                    path = %path.display(),
                    "rules reloaded"
                );
                store.swap(snapshot);
            }
            Ok(Err(errors)) => {
                store.reload_failures.fetch_add(1, Ordering::Relaxed);
                store.failures_since_swap.fetch_add(1, Ordering::Relaxed);
                tracing::error!(
                    path = %path.display(),
                    serving = store.load().version(),
                    %errors,
                    "rule reload rejected; keeping the last good snapshot"
                );
            }
            Err(join) => tracing::error!(%join, "rule reload task failed"),
        }
    }
}

/// Where the served rules came from, when they are fed from a topic.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A snapshot record at this offset of the rules topic.
    Topic {
        /// Its offset.
        offset: i64,
    },
    /// The local fallback files (the topic was empty or unreachable).
    Fallback,
}

impl Origin {
    /// `topic` or `fallback`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Origin::Topic { .. } => "topic",
            Origin::Fallback => "fallback",
        }
    }
}

/// The rule set an instance serves from a feed, and since when.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The published version (a snapshot record's), or `fallback:<native version>`.
    pub version: String,
    /// Where it came from.
    pub origin: Origin,
    /// When it was swapped in, ms since the epoch.
    pub since_ms: u64,
}

/// The state of a rules feed (`rules.source: kafka`), shared by the
/// subscriber that writes it and the health, metrics and status readers.
/// Before the first snapshot (or fallback) arrives, nothing is served.
#[derive(Debug, Default)]
pub struct Feed {
    served: arc_swap::ArcSwapOption<Served>,
    /// Records refused (undecodable, a bad hash, rules that do not compile).
    rejected: AtomicU64,
    /// Records swapped in.
    applied: AtomicU64,
    /// Why the last refused record was refused.
    last_refusal: arc_swap::ArcSwapOption<String>,
    changed: tokio::sync::Notify,
}

impl Feed {
    /// What is served; `None` while waiting for the first rules.
    pub fn served(&self) -> Option<Arc<Served>> {
        self.served.load_full()
    }

    /// Records a swap to `served`.
    pub fn serve(&self, served: Served) {
        if matches!(served.origin, Origin::Topic { .. }) {
            self.applied.fetch_add(1, Ordering::Relaxed);
        }
        self.served.store(Some(Arc::new(served)));
        self.changed.notify_waiters();
        self.changed.notify_one();
    }

    /// Counts a refused record, and why it was refused.
    pub fn reject(&self, why: String) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        self.last_refusal.store(Some(Arc::new(why)));
    }

    /// Why the last refused record was refused, if any was.
    pub fn last_refusal(&self) -> Option<Arc<String>> {
        self.last_refusal.load_full()
    }

    /// Records refused since start.
    pub fn rejected(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Records swapped in since start.
    pub fn applied(&self) -> u64 {
        self.applied.load(Ordering::Relaxed)
    }

    /// Resolves after the next [`Feed::serve`] (or at once if one happened
    /// since the last wait).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }
}

/// What the xDS subscription (`rules.source: xds`, `api::xds`) has done,
/// for readiness, metrics and tests.
#[derive(Debug, Default)]
pub struct XdsState {
    accepted: tokio::sync::watch::Sender<Option<String>>,
    acks: AtomicU64,
    nacks: AtomicU64,
}

impl XdsState {
    /// The version of the set in force; `None` before the first.
    pub fn version(&self) -> Option<String> {
        self.accepted.borrow().clone()
    }

    /// Whether a set has been accepted (cheap: no lock, nothing copied).
    pub fn configured(&self) -> bool {
        self.acks.load(Ordering::Relaxed) > 0
    }

    /// Sets accepted, and refused, since start.
    pub fn counts(&self) -> (u64, u64) {
        (self.acks.load(Ordering::Relaxed), self.nacks.load(Ordering::Relaxed))
    }

    /// Records a set accepted as `version`.
    pub fn accept(&self, version: String) {
        self.acks.fetch_add(1, Ordering::Relaxed);
        self.accepted.send_replace(Some(version));
    }

    /// Records a set refused.
    pub fn refuse(&self) {
        self.nacks.fetch_add(1, Ordering::Relaxed);
    }

    /// Waits until a first set is in force.
    pub async fn first(&self) {
        let mut rx = self.accepted.subscribe();
        let _ = rx.wait_for(Option::is_some).await;
    }
}
