//! The in-memory counter store: the embedded default when `redis.url` is unset.
//!
//! Counters live in a fixed number of shards, each a `std::sync::Mutex` over
//! one map `(kind, rule id or group, user id or key) -> counter`. A lock is held
//! only for the few arithmetic operations of one decision and never across an
//! `.await`. Lookups borrow `&str` keys (`KeyRef`), so a known counter costs
//! no allocation.
//!
//! Memory is bounded, whatever the callers send:
//! - at most `memory.max_counters` counters (split evenly over the shards);
//! - a full shard makes room by evicting, among [`EVICTION_SAMPLE`]
//!   counters from a random position, the one that expired earliest; when
//!   none has, the one that counts least relative to its own limit (a
//!   flood's counters, one hit each, before a user near its limit), never
//!   one its owner pinned ([`MemoryStore::with_pinned`]). An evicted counter that still counts is
//!   remembered in the shard's summary ([`summary`]): a key evicted
//!   returns at least where it was, for at least
//!   [`EVICTED_PER_GENERATION`](summary::EVICTED_PER_GENERATION) further
//!   evictions of its shard, so a flood hands no evicted key a fresh
//!   budget; a key never evicted starts at zero but for the
//!   summary's rare false positives. Only when every sampled counter is
//!   pinned does the decision fail with [`FailureKind::StoreFull`] (the
//!   rule's failure policy answers it, the failure is counted) and the
//!   sweeper is woken;
//! - idle counters expire after `2 * W`, like the Redis keys; the sweeper
//!   removes them on a blocking thread, a bounded chunk per lock hold, and
//!   shrinks maps that a flood left mostly empty.

use std::{
    collections::HashSet,
    future::Future,
    hash::{BuildHasher, Hash, Hasher, RandomState},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

mod summary;

use indexmap::{Equivalent, IndexMap};
use tokio::sync::{Notify, watch};

use self::summary::{FULL_PPM, Sketch};

use super::{
    Clock, Count, CounterSpec, CounterStore, FailureKind, Listed, ManyItem, ManyOutcome, Shares, StoreError,
    evaluate, many_verdicts,
    window::{StoredCounter, Verdict, WindowParams},
};
use crate::telemetry::exposition::Figures;

/// How many counters a full shard examines for an expired one to evict:
/// this many consecutive ones from a random index (contiguous in memory),
/// every one in a smaller shard.
pub const EVICTION_SAMPLE: usize = 64;

/// Counters the sweeper examines per lock hold.
const SWEEP_CHUNK: usize = 1_024;

/// A sweep asked for by a full shard starts at most this often.
const MIN_WAKE_GAP: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Entry {
    counter: StoredCounter,
    /// Past this instant (ms) the counter holds nothing that still counts.
    expires_at_ms: u64,
    /// The most of its limit it holds from its last write on, in parts per
    /// million of the limit (a window's two counts, a bucket's debt: both
    /// only decay after the write, so this over-estimates).
    fill_ppm: u32,
}

impl Entry {
    fn new(counter: StoredCounter, expires_at_ms: u64, used: u64, capacity: u64) -> Self {
        let fill = u128::from(used) * u128::from(FULL_PPM);
        let fill_ppm = u32::try_from(fill.div_ceil(u128::from(capacity.max(1)))).unwrap_or(u32::MAX);
        Entry { counter, expires_at_ms, fill_ppm }
    }
}

/// Which counters a full shard must not evict, by `(many, group, key)`:
/// the local limiter's whose hits are owed to the shared store.
pub type Pinned = Arc<dyn Fn(bool, &str, &str) -> bool + Send + Sync>;

/// A counter's identity as stored: which kind of decision keeps it
/// (`many`: a job of [`MemoryStore::decide_many`]), its group (a native
/// rule id; a job's Envoy domain or native user, shared by all of the
/// group's counters) and its key (a user id; a job's item key). The kind
/// keeps the two spaces apart as Redis' `rl2:`/`rle2:` prefixes do: a
/// client's user id never names another decision's counter.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct CounterKey {
    pub(crate) many: bool,
    pub(crate) group: Arc<str>,
    pub(crate) key: Box<str>,
}

impl Hash for CounterKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        KeyRef { many: self.many, group: &self.group, key: &self.key }.hash(state);
    }
}

/// A borrowed [`CounterKey`]: hashes the same, so a lookup allocates nothing.
#[derive(Debug, Hash)]
pub(crate) struct KeyRef<'a> {
    pub(crate) many: bool,
    pub(crate) group: &'a str,
    pub(crate) key: &'a str,
}

impl Equivalent<CounterKey> for KeyRef<'_> {
    fn equivalent(&self, stored: &CounterKey) -> bool {
        stored.many == self.many && *stored.group == *self.group && *stored.key == *self.key
    }
}

/// One shard: its counters (std's SipHash: the keys are chosen by clients,
/// so a flooding-resistant hash matters here), the interned group names,
/// and the state of the sampling generator.
#[derive(Debug)]
struct Shard {
    counters: IndexMap<CounterKey, Entry>,
    groups: HashSet<Arc<str>>,
    rng: u64,
    sketch: Sketch,
}

impl Shard {
    /// A job's counter (`many`), if held and live.
    fn get(&self, group: &str, key: &str, now_ms: u64) -> Option<StoredCounter> {
        self.counters
            .get(&KeyRef { many: true, group, key })
            .filter(|entry| entry.expires_at_ms > now_ms)
            .map(|entry| entry.counter)
    }

    /// Where a single decision's counter sits, if held, and its state at `now_ms` (none when
    /// expired): one hash lookup for a whole decision.
    fn find(&self, group: &str, key: &str, now_ms: u64) -> (Option<usize>, Option<StoredCounter>) {
        match self.counters.get_full(&KeyRef { many: false, group, key }) {
            Some((index, _, entry)) => (Some(index), (entry.expires_at_ms > now_ms).then_some(entry.counter)),
            None => (None, None),
        }
    }

    /// Updates an existing counter in place, or inserts it (the caller made
    /// room with [`make_room`](Self::make_room)).
    fn put(&mut self, group: &str, key: &str, entry: Entry) {
        if let Some(existing) = self.counters.get_mut(&KeyRef { many: true, group, key }) {
            *existing = entry;
            return;
        }
        self.insert(true, group, key, entry);
    }

    /// Inserts a counter known not to be held (room made).
    fn insert(&mut self, many: bool, group: &str, key: &str, entry: Entry) {
        let group = match self.groups.get(group) {
            Some(interned) => Arc::clone(interned),
            None => {
                let interned: Arc<str> = Arc::from(group);
                self.groups.insert(Arc::clone(&interned));
                interned
            }
        };
        self.counters.insert(CounterKey { many, group, key: key.into() }, entry);
    }

    /// Makes room for `needed` new counters under `capacity`, evicting
    /// expired ones first, else the live ones that count least (each
    /// remembered in the sketch); `false` when the sampled counters are all
    /// pinned.
    fn make_room(&mut self, needed: usize, capacity: usize, now_ms: u64, store: &MemoryStore) -> bool {
        while self.counters.len() + needed > capacity {
            let Some((victim, live)) = self.sample(now_ms, store.pinned.as_ref()) else { return false };
            let (key, entry) = self.counters.swap_remove_index(victim).expect("index below len");
            if live {
                let key = KeyRef { many: key.many, group: &key.group, key: &key.key };
                self.sketch.remember(&store.hasher, &key, entry.fill_ppm, entry.expires_at_ms, now_ms);
                store.live_evictions.fetch_add(1, Ordering::Relaxed);
            } else {
                store.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        true
    }

    /// Among [`EVICTION_SAMPLE`] consecutive counters from a random index
    /// (wrapping; all of them in a smaller shard), the index of the one that
    /// expired earliest, if any has (`false`), else of the live one with
    /// the least fill that is not pinned (`true`).
    fn sample(&mut self, now_ms: u64, pinned: Option<&Pinned>) -> Option<(usize, bool)> {
        let len = self.counters.len();
        if len == 0 {
            return None;
        }
        // xorshift64: cheap, and only ever indexes this shard.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let start = (self.rng % len as u64) as usize;
        let mut expired: Option<(u64, usize)> = None;
        let mut least: Option<(u32, usize)> = None;
        for offset in 0..EVICTION_SAMPLE.min(len) {
            let index = (start + offset) % len;
            let (key, entry) = self.counters.get_index(index).expect("index below len");
            if entry.expires_at_ms <= now_ms {
                if expired.is_none_or(|(at, _)| entry.expires_at_ms < at) {
                    expired = Some((entry.expires_at_ms, index));
                }
            } else if expired.is_none()
                && least.is_none_or(|(fill, _)| entry.fill_ppm < fill)
                && !pinned.is_some_and(|pinned| pinned(key.many, &key.group, &key.key))
            {
                least = Some((entry.fill_ppm, index));
            }
        }
        match expired {
            Some((_, index)) => Some((index, false)),
            None => least.map(|(_, index)| (index, true)),
        }
    }

    /// A job's counter `item` of `group`: its state if held and live, what
    /// the sketch remembers of it if not held.
    fn stored(
        &self,
        hasher: &RandomState,
        group: &str,
        item: &ManyItem,
        now_ms: u64,
    ) -> Option<StoredCounter> {
        let key = KeyRef { many: true, group, key: &item.key };
        match self.counters.get(&key) {
            Some(entry) => (entry.expires_at_ms > now_ms).then_some(entry.counter),
            None => self.recalled(hasher, &key, now_ms, item.now(now_ms), item.params),
        }
    }

    /// The counter a key not held starts from: what the sketch remembers of
    /// it (none when nothing), counted at `now` as a report of that share
    /// of `params`' limit.
    fn recalled(
        &self,
        hasher: &RandomState,
        key: &KeyRef<'_>,
        now_ms: u64,
        now: u64,
        params: WindowParams,
    ) -> Option<StoredCounter> {
        let fill = u128::from(self.sketch.recall(hasher, key, now_ms));
        if fill == 0 {
            return None;
        }
        let used = u64::try_from((fill * u128::from(params.capacity)).div_ceil(u128::from(FULL_PPM)))
            .unwrap_or(u64::MAX);
        evaluate(None, now, used, params, (Count::Always, None)).write.map(|(counter, _, _)| counter)
    }
}

/// Sharded in-process counters, at most `max_counters` of them.
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    /// Counters one shard may hold: `ceil(max_counters / shards)`.
    shard_capacity: usize,
    evictions: AtomicU64,
    live_evictions: AtomicU64,
    pinned: Option<Pinned>,
    sweep_wanted: Notify,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("shards", &self.shards.len())
            .field("shard_capacity", &self.shard_capacity)
            .field("pinned", &self.pinned.is_some())
            .finish_non_exhaustive()
    }
}

impl MemoryStore {
    /// A store with `shards` independently locked shards holding at most
    /// `max_counters` counters together (rounded up to a multiple of
    /// `shards`), reading `clock`.
    pub fn new(shards: usize, max_counters: usize, clock: Arc<dyn Clock>) -> Self {
        let shards = shards.max(1);
        let hasher = RandomState::new();
        MemoryStore {
            shards: (0..shards)
                .map(|i| {
                    Mutex::new(Shard {
                        counters: IndexMap::new(),
                        groups: HashSet::new(),
                        rng: hasher.hash_one(i) | 1,
                        sketch: Sketch::new(),
                    })
                })
                .collect(),
            hasher,
            clock,
            shard_capacity: max_counters.max(1).div_ceil(shards),
            evictions: AtomicU64::new(0),
            live_evictions: AtomicU64::new(0),
            pinned: None,
            sweep_wanted: Notify::new(),
        }
    }

    /// The same store, never evicting the counters `pinned` names.
    pub fn with_pinned(mut self, pinned: Pinned) -> Self {
        self.pinned = Some(pinned);
        self
    }

    fn shard_index(&self, key: &str) -> usize {
        self.hasher.hash_one(key) as usize % self.shards.len()
    }

    fn lock(&self, index: usize) -> MutexGuard<'_, Shard> {
        // A poisoned lock only means another thread panicked mid-update of
        // plain integers; the counters are still meaningful.
        self.shards[index].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn full(&self) -> StoreError {
        self.sweep_wanted.notify_one();
        StoreError {
            kind: FailureKind::StoreFull,
            message: format!(
                "memory.max_counters reached ({} per shard) and every counter sampled is owed to the shared store",
                self.shard_capacity
            ),
        }
    }

    /// Decides and counts as `count` says — atomically for this user and
    /// rule. Fails only when a new counter is needed and its shard is full
    /// of counters that still count.
    pub fn decide(
        &self,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> Result<Verdict, StoreError> {
        let now = self.clock.now_ms();
        let mut shard = self.lock(self.shard_index(user_id));
        let (at, mut stored) = shard.find(counter.id, user_id, now);
        if at.is_none() {
            let key = KeyRef { many: false, group: counter.id, key: user_id };
            stored = shard.recalled(&self.hasher, &key, now, now, counter.window);
        }
        let decided = evaluate(stored, now, weight, counter.window, (count, None));
        if let Some((next, ttl, used)) = decided.write {
            let entry = Entry::new(next, now.saturating_add(ttl), used, counter.window.capacity);
            match at {
                Some(index) => shard.counters[index] = entry,
                None => {
                    if !shard.make_room(1, self.shard_capacity, now, self) {
                        drop(shard);
                        return Err(self.full());
                    }
                    shard.insert(false, counter.id, user_id, entry);
                }
            }
        }
        Ok(decided.verdict)
    }

    /// All-or-nothing decision over several counters of `group`; see
    /// [`Store::decide_many`](super::Store::decide_many). The shards involved
    /// are locked together, in index order (no deadlock), for the whole call.
    pub fn decide_many(&self, group: &str, items: &[ManyItem]) -> Result<ManyOutcome, StoreError> {
        let now_ms = self.clock.now_ms();
        let shard_of: Vec<usize> = items.iter().map(|i| self.shard_index(&i.key)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.lock(i))).collect();
        let position = |shard: usize| guards_position(&order, shard);

        // What this call would store, per key, until it commits (a key may
        // appear twice): state and expiry in ms.
        let mut pending: Vec<(&str, StoredCounter, u64)> = Vec::new();
        let mut raw = Vec::with_capacity(items.len());
        let mut writes = Vec::new();
        let mut blocked = false;
        for (item, &shard) in items.iter().zip(&shard_of) {
            let now = item.now(now_ms);
            let stored = match pending.iter().rev().find(|(key, _, _)| *key == item.key) {
                Some((_, counter, _)) => Some(*counter),
                None => guards[position(shard)].1.stored(&self.hasher, group, item, now_ms),
            };
            let decided = evaluate(stored, now, item.weight, item.params, (item.count, item.refund));
            let fits = decided.fits;
            // A peek (or a weight of 0) writes nothing: no counter is created.
            if let Some((next, ttl, used)) = decided.write {
                let expires_at_ms = now_ms.saturating_add(ttl.saturating_mul(item.tick_ms));
                pending.push((item.key.as_str(), next, expires_at_ms));
                writes.push((shard, item, Entry::new(next, expires_at_ms, used, item.params.capacity)));
            }
            blocked |= item.blocks(fits);
            raw.push((fits, decided.seen));
        }
        if !blocked {
            // Room for every new counter first, so a full shard fails the
            // call before anything is counted.
            for &shard in &order {
                let guard = &mut guards[position(shard)].1;
                let mut new_keys: Vec<&str> = Vec::new();
                for (_, item, _) in writes.iter().filter(|(s, _, _)| *s == shard) {
                    // An expired counter may be evicted to make room: count it as new.
                    let live = guard.get(group, &item.key, now_ms).is_some();
                    if !live && !new_keys.contains(&item.key.as_str()) {
                        new_keys.push(&item.key);
                    }
                }
                if !guard.make_room(new_keys.len(), self.shard_capacity, now_ms, self) {
                    drop(guards);
                    return Err(self.full());
                }
            }
            for (shard, item, entry) in writes {
                guards[position(shard)].1.put(group, &item.key, entry);
            }
        }
        drop(guards);
        let verdicts = many_verdicts(items, &raw, !blocked, now_ms);
        Ok(ManyOutcome { committed: !blocked, verdicts, now_ms })
    }

    /// Removes expired counters, `SWEEP_CHUNK` per lock hold, and shrinks
    /// maps that hold under a quarter of what they have room for; returns
    /// how many counters remain. Blocking: run it off the async workers.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        let mut remaining = 0;
        for index in 0..self.shards.len() {
            let mut next = 0;
            loop {
                let mut shard = self.lock(index);
                let mut examined = 0;
                while next < shard.counters.len() && examined < SWEEP_CHUNK {
                    if shard.counters[next].expires_at_ms <= now {
                        // The last counter moves into `next`: examined next.
                        shard.counters.swap_remove_index(next);
                    } else {
                        next += 1;
                    }
                    examined += 1;
                }
                if next < shard.counters.len() {
                    continue;
                }
                let len = shard.counters.len();
                if shard.counters.capacity() > 4 * len.max(1024) {
                    shard.counters.shrink_to(2 * len);
                    shard.groups.shrink_to_fit();
                }
                shard.groups.retain(|group| Arc::strong_count(group) > 1);
                remaining += len;
                break;
            }
        }
        remaining
    }

    /// The keys of `group`'s job counters that start with `prefix` and
    /// have not expired, at most `max` (see [`Store::list`](super::Store::list)).
    /// One lock hold per shard; a shard that never interned `group` is
    /// passed at once, and the others compare the interned group by
    /// pointer. Blocking: run it off the async workers.
    pub fn list(&self, group: &str, prefix: &str, max: usize) -> Listed {
        let now = self.clock.now_ms();
        let mut keys = Vec::new();
        for index in 0..self.shards.len() {
            let shard = self.lock(index);
            let Some(interned) = shard.groups.get(group) else { continue };
            let found = shard.counters.iter().filter(|(key, entry)| {
                key.many
                    && Arc::ptr_eq(&key.group, interned)
                    && entry.expires_at_ms > now
                    && key.key.starts_with(prefix)
            });
            for (key, _) in found {
                if keys.len() == max {
                    return Listed { keys, complete: false };
                }
                keys.push(key.key.to_string());
            }
        }
        Listed { keys, complete: true }
    }

    /// Number of live counters (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        (0..self.shards.len()).map(|i| self.lock(i).counters.len()).sum()
    }

    /// Whether no counter is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most counters the store holds: `memory.max_counters` rounded up
    /// to a multiple of the shard count.
    pub fn max_counters(&self) -> usize {
        self.shard_capacity * self.shards.len()
    }

    /// Expired counters evicted to make room for new ones (the sweeper's
    /// removals not included).
    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    /// Counters that still counted evicted to make room (each remembered
    /// in its shard's summary).
    pub fn live_evictions(&self) -> u64 {
        self.live_evictions.load(Ordering::Relaxed)
    }

    /// Counter slots allocated over all shards (what the maps have room for).
    pub fn allocated(&self) -> usize {
        (0..self.shards.len()).map(|i| self.lock(i).counters.capacity()).sum()
    }
}

impl CounterStore for MemoryStore {
    const NAME: &'static str = "memory";
    const REMOTE: bool = false;

    fn decide_in(
        &self,
        _: Shares<'_>,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        std::future::ready(self.decide(user_id, counter, weight, count))
    }

    fn decide_job(
        &self,
        group: &str,
        items: &[ManyItem],
    ) -> impl Future<Output = Result<ManyOutcome, StoreError>> + Send {
        std::future::ready(self.decide_many(group, items))
    }

    /// Every shard walked, one lock hold each, on a blocking thread.
    async fn list_keys(
        self: &Arc<Self>,
        group: &str,
        prefix: &str,
        max: usize,
    ) -> Result<Listed, StoreError> {
        let (store, group, prefix) = (Arc::clone(self), group.to_owned(), prefix.to_owned());
        super::store::listed_blocking(move || store.list(&group, &prefix, max)).await
    }

    fn figures(self: &Arc<Self>) -> Arc<dyn Figures> {
        Arc::clone(self) as Arc<dyn Figures>
    }
}

/// Where shard `shard` sits among the guards of a sorted, deduplicated `order`.
fn guards_position(order: &[usize], shard: usize) -> usize {
    order.binary_search(&shard).expect("shard locked")
}

/// Sweeps `store` every `interval`, and when a full shard asks (at most
/// once per second), on a blocking thread, until `shutdown` turns true.
pub async fn run_sweeper(store: Arc<MemoryStore>, interval: Duration, mut shutdown: watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last: Option<Instant> = None;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = store.sweep_wanted.notified() => {
                if last.is_some_and(|at| at.elapsed() < MIN_WAKE_GAP) {
                    continue;
                }
            }
            _ = shutdown.changed() => return,
        }
        last = Some(Instant::now());
        let sweeping = Arc::clone(&store);
        match tokio::task::spawn_blocking(move || sweeping.sweep()).await {
            Ok(remaining) => tracing::trace!(remaining, "memory store swept"),
            Err(error) => tracing::error!(%error, "memory store sweep failed"),
        }
    }
}

#[cfg(test)]
mod tests;
