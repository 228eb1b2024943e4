//! The local cache of exact denials (`denial_cache.*`).
//!
//! A denied decision comes with the exact time at which the same request
//! could pass if nothing else were counted. Other instances can only add
//! to a counter, so until then the answer cannot change: repeats of the
//! request (same rules, same counter, the same weight or more) are denied
//! here, without a store call. The cache never admits anything: it only
//! answers denials the store would have given, so it can never admit more.
//!
//! Entries are keyed like the memory store's counters
//! (`limiter::memory::CounterKey`, borrowed for lookups) by (scope, counter) — a native rule id and the user,
//! or an Envoy domain and the descriptor's counter key — and carry the
//! version of the rules that decided them: after a reload they no longer
//! match. Bounded by `denial_cache.max_entries`, in locked shards (held
//! only inside a lookup or an insert, never across an `.await`); when a
//! shard is full, expired entries are swept (at most every 100 ms) and a
//! denial that still finds no room is not cached.

use std::{
    hash::BuildHasher,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicU64, Ordering},
    },
};

use hashbrown::HashMap;

use crate::{
    clock::Clock,
    limiter::memory::{CounterKey as Key, KeyRef as Borrowed},
};

const SHARDS: usize = 64;
const SWEEP_EVERY_MS: u64 = 100;

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// Hash of the rules version that decided it.
    version: u64,
    /// The least weight denied.
    weight: u64,
    /// When the same request may pass (the clock's ms).
    until_ms: u64,
    /// When the counter is whole again.
    reset_at_ms: u64,
}

#[derive(Debug, Default)]
struct Shard {
    map: HashMap<Key, Entry>,
    swept_at_ms: u64,
}

/// A cached denial: what to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachedDenial {
    /// ms until the same request may pass (at least 1).
    pub retry_after_ms: u64,
    /// ms until the counter has fully decayed.
    pub reset_after_ms: u64,
}

/// The cache. Shared by every decision of an engine.
#[derive(Debug)]
pub struct DenialCache {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    hasher: hashbrown::DefaultHashBuilder,
    clock: Arc<dyn Clock>,
    hits: AtomicU64,
    inserted: AtomicU64,
    full: AtomicU64,
}

impl DenialCache {
    /// A cache of at most `max_entries` (rounded up to whole shards) on `clock`.
    pub fn new(max_entries: usize, clock: Arc<dyn Clock>) -> Self {
        DenialCache {
            shards: (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect(),
            per_shard: max_entries.div_ceil(SHARDS).max(1),
            hasher: hashbrown::DefaultHashBuilder::default(),
            clock,
            hits: AtomicU64::new(0),
            inserted: AtomicU64::new(0),
            full: AtomicU64::new(0),
        }
    }

    fn shard(&self, key: &Borrowed<'_>) -> &Mutex<Shard> {
        let hash = self.hasher.hash_one(key);
        // The high bits: the map inside uses the low ones.
        &self.shards[(hash >> 58) as usize % SHARDS]
    }

    /// A version string as the cache keeps it.
    pub fn version_hash(&self, version: &str) -> u64 {
        self.hasher.hash_one(version)
    }

    /// The denial cached for this counter under `version` covering
    /// `weight`, if it still holds.
    pub fn lookup(&self, version: u64, scope: &str, counter: &str, weight: u64) -> Option<CachedDenial> {
        let key = Borrowed { many: false, group: scope, key: counter };
        let now = self.clock.now_ms();
        let mut shard = self.shard(&key).lock().unwrap_or_else(PoisonError::into_inner);
        let entry = *shard.map.get(&key)?;
        if entry.version != version || now >= entry.until_ms {
            // Expired, or decided under other rules: it never holds again.
            shard.map.remove(&key);
            return None;
        }
        if weight < entry.weight {
            return None;
        }
        drop(shard);
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(CachedDenial {
            retry_after_ms: entry.until_ms - now,
            reset_after_ms: entry.reset_at_ms.saturating_sub(now),
        })
    }

    /// Caches a denial of `weight` the store just gave: the same request
    /// passes in `retry_after_ms` at the earliest.
    pub fn insert(
        &self,
        version: u64,
        scope: &Arc<str>,
        counter: &str,
        weight: u64,
        retry_after_ms: u64,
        reset_after_ms: u64,
    ) {
        if retry_after_ms == 0 {
            return;
        }
        let now = self.clock.now_ms();
        let entry = Entry {
            version,
            weight,
            until_ms: now.saturating_add(retry_after_ms),
            reset_at_ms: now.saturating_add(reset_after_ms),
        };
        let key = Borrowed { many: false, group: scope, key: counter };
        let mut shard = self.shard(&key).lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(existing) = shard.map.get_mut(&key) {
            *existing = entry;
            return;
        }
        if shard.map.len() >= self.per_shard {
            if now.saturating_sub(shard.swept_at_ms) >= SWEEP_EVERY_MS {
                shard.swept_at_ms = now;
                shard.map.retain(|_, e| e.until_ms > now);
            }
            if shard.map.len() >= self.per_shard {
                drop(shard);
                self.full.fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        shard.map.insert(Key { many: false, group: Arc::clone(scope), key: counter.into() }, entry);
        drop(shard);
        self.inserted.fetch_add(1, Ordering::Relaxed);
    }

    /// Hits (store calls saved), denials cached, denials not cached for want of room.
    pub fn counts(&self) -> (u64, u64, u64) {
        (
            self.hits.load(Ordering::Relaxed),
            self.inserted.load(Ordering::Relaxed),
            self.full.load(Ordering::Relaxed),
        )
    }

    /// Entries held (expired ones included until swept or looked up).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).map.len()).sum()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn cache(max: usize) -> (DenialCache, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000));
        (DenialCache::new(max, Arc::clone(&clock) as Arc<dyn Clock>), clock)
    }

    #[test]
    fn a_denial_holds_until_its_retry_time_for_the_same_weight_or_more() {
        let (cache, clock) = cache(1_000);
        let rule: Arc<str> = Arc::from("r");
        let v = cache.version_hash("v1");
        cache.insert(v, &rule, "alice", 2, 300, 900);
        assert_eq!(
            cache.lookup(v, "r", "alice", 2),
            Some(CachedDenial { retry_after_ms: 300, reset_after_ms: 900 })
        );
        assert_eq!(cache.lookup(v, "r", "alice", 5).map(|d| d.retry_after_ms), Some(300));
        assert_eq!(cache.lookup(v, "r", "alice", 1), None, "a lighter request may fit");
        assert_eq!(cache.lookup(v, "r", "bob", 2), None);
        assert_eq!(cache.lookup(v, "s", "alice", 2), None);
        clock.advance(299);
        assert_eq!(cache.lookup(v, "r", "alice", 2).map(|d| d.retry_after_ms), Some(1));
        clock.advance(1);
        assert_eq!(cache.lookup(v, "r", "alice", 2), None, "exactly at the retry time it goes to the store");
        assert!(cache.is_empty(), "expired entries go when met");
        assert_eq!(cache.counts(), (3, 1, 0));
        cache.insert(v, &rule, "alice", 2, 300, 900);
        assert_eq!(
            cache.lookup(cache.version_hash("v2"), "r", "alice", 2),
            None,
            "decided under other rules"
        );
        assert!(cache.is_empty());
    }

    #[test]
    fn the_cache_is_bounded() {
        let (cache, clock) = cache(SHARDS);
        let rule: Arc<str> = Arc::from("r");
        for user in 0..10_000 {
            cache.insert(1, &rule, &format!("u{user}"), 1, 1_000, 1_000);
        }
        assert!(cache.len() <= SHARDS, "{}", cache.len());
        let (_, inserted, full) = cache.counts();
        assert_eq!(inserted + full, 10_000);
        // Once expired, room is made again.
        clock.advance(1_000);
        cache.insert(1, &rule, "late", 1, 1_000, 1_000);
        assert_eq!(cache.lookup(1, "r", "late", 1).map(|d| d.retry_after_ms), Some(1_000));
    }
}
