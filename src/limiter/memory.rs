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
//!   counters from a random position, the one that expired earliest. A counter that still counts
//!   is never evicted: that would hand its user a fresh budget, and anyone
//!   able to send distinct keys could reset anyone else's counter. When the
//!   sample holds no expired counter the decision fails with
//!   [`FailureKind::StoreFull`] (the rule's failure policy answers it, the
//!   failure is counted) and the sweeper is woken;
//! - idle counters expire after `2 * W`, like the Redis keys; the sweeper
//!   removes them on a blocking thread, a bounded chunk per lock hold, and
//!   shrinks maps that a flood left mostly empty.

use std::{
    collections::HashSet,
    hash::{BuildHasher, Hash, Hasher, RandomState},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use indexmap::{Equivalent, IndexMap};
use tokio::sync::{Notify, watch};

use super::{
    Clock, Count, CounterSpec, FailureKind, ManyItem, ManyOutcome, StoreError, evaluate, many_verdicts,
    window::{StoredCounter, Verdict},
};

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
}

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
    /// expired ones; `false` when the sampled counters all still count.
    fn make_room(&mut self, needed: usize, capacity: usize, now_ms: u64, evictions: &AtomicU64) -> bool {
        while self.counters.len() + needed > capacity {
            let Some(victim) = self.expired_sample(now_ms) else { return false };
            self.counters.swap_remove_index(victim);
            evictions.fetch_add(1, Ordering::Relaxed);
        }
        true
    }

    /// Among [`EVICTION_SAMPLE`] consecutive counters from a random index
    /// (wrapping; all of them in a smaller shard), the index of the one that
    /// expired earliest, if any has.
    fn expired_sample(&mut self, now_ms: u64) -> Option<usize> {
        let len = self.counters.len();
        if len == 0 {
            return None;
        }
        // xorshift64: cheap, and only ever indexes this shard.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let start = (self.rng % len as u64) as usize;
        let mut best: Option<(u64, usize)> = None;
        for offset in 0..EVICTION_SAMPLE.min(len) {
            let index = (start + offset) % len;
            let (_, entry) = self.counters.get_index(index).expect("index below len");
            if entry.expires_at_ms <= now_ms && best.is_none_or(|(at, _)| entry.expires_at_ms < at) {
                best = Some((entry.expires_at_ms, index));
            }
        }
        best.map(|(_, index)| index)
    }
}

/// Sharded in-process counters, at most `max_counters` of them.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    /// Counters one shard may hold: `ceil(max_counters / shards)`.
    shard_capacity: usize,
    evictions: AtomicU64,
    sweep_wanted: Notify,
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
                    })
                })
                .collect(),
            hasher,
            clock,
            shard_capacity: max_counters.max(1).div_ceil(shards),
            evictions: AtomicU64::new(0),
            sweep_wanted: Notify::new(),
        }
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
                "memory.max_counters reached ({} per shard) and no expired counter to evict",
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
        let (at, stored) = shard.find(counter.id, user_id, now);
        let decided = evaluate(stored, now, weight, counter.window, count);
        if let Some((next, ttl)) = decided.write {
            let entry = Entry { counter: next, expires_at_ms: now.saturating_add(ttl) };
            match at {
                Some(index) => shard.counters[index] = entry,
                None => {
                    if !shard.make_room(1, self.shard_capacity, now, &self.evictions) {
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
            let now = now_ms / item.tick_ms;
            let stored = match pending.iter().rev().find(|(key, _, _)| *key == item.key) {
                Some((_, counter, _)) => Some(*counter),
                None => guards[position(shard)].1.get(group, &item.key, now_ms),
            };
            let decided = evaluate(stored, now, item.weight, item.params, item.count);
            let fits = decided.fits;
            // A peek (or a weight of 0) writes nothing: no counter is created.
            if let Some((next, ttl)) = decided.write {
                let expires_at_ms = now_ms.saturating_add(ttl.saturating_mul(item.tick_ms));
                pending.push((item.key.as_str(), next, expires_at_ms));
                writes.push((shard, item, next, expires_at_ms));
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
                for (_, item, _, _) in writes.iter().filter(|(s, _, _, _)| *s == shard) {
                    // An expired counter may be evicted to make room: count it as new.
                    let live = guard.get(group, &item.key, now_ms).is_some();
                    if !live && !new_keys.contains(&item.key.as_str()) {
                        new_keys.push(&item.key);
                    }
                }
                if !guard.make_room(new_keys.len(), self.shard_capacity, now_ms, &self.evictions) {
                    drop(guards);
                    return Err(self.full());
                }
            }
            for (shard, item, counter, expires_at_ms) in writes {
                guards[position(shard)].1.put(group, &item.key, Entry { counter, expires_at_ms });
            }
        }
        drop(guards);
        Ok(ManyOutcome { committed: !blocked, verdicts: many_verdicts(items, &raw, !blocked) })
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

    /// Counter slots allocated over all shards (what the maps have room for).
    pub fn allocated(&self) -> usize {
        (0..self.shards.len()).map(|i| self.lock(i).counters.capacity()).sum()
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
mod tests {
    use super::*;
    use crate::limiter::{ManualClock, ManyItem, window::WindowParams};

    /// A rule's counter, as the store sees it (the store knows no rules).
    struct Counter {
        id: Arc<str>,
        window: WindowParams,
    }

    impl Counter {
        fn counter(&self) -> CounterSpec<'_> {
            CounterSpec { id: &self.id, window: self.window }
        }
    }

    fn rule(id: &str, window_ms: u64, capacity: u64) -> Counter {
        Counter { id: Arc::from(id), window: WindowParams::sliding(window_ms, capacity) }
    }

    #[test]
    fn counts_per_user_and_rule() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(4, 1_000, clock);
        let a = rule("a", 1_000, 2);
        let b = rule("b", 1_000, 2);
        assert!(store.decide("u1", a.counter(), 2, Count::IfFits).unwrap().admitted);
        assert!(!store.decide("u1", a.counter(), 1, Count::IfFits).unwrap().admitted);
        assert!(store.decide("u2", a.counter(), 2, Count::IfFits).unwrap().admitted, "users are independent");
        assert!(store.decide("u1", b.counter(), 2, Count::IfFits).unwrap().admitted, "rules are independent");
    }

    #[test]
    fn idle_counters_expire_and_are_swept() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(4, 1_000, Arc::clone(&clock) as Arc<dyn Clock>);
        let r = rule("a", 1_000, 5);
        for user in 0..100 {
            store.decide(&format!("user-{user}"), r.counter(), 1, Count::IfFits).unwrap();
        }
        assert_eq!(store.len(), 100);
        clock.advance(1_999);
        assert_eq!(store.sweep(), 100, "still inside 2 x W");
        clock.advance(1);
        assert_eq!(store.sweep(), 0);
        assert!(store.is_empty());
    }

    /// `Count::Anyway` (upstream's INCRBY): answered as an admission, but
    /// counted when it does not fit, so a denial pushes the count on.
    #[test]
    fn an_admission_counted_anyway_answers_for_itself_and_counts_when_denied() {
        let clock = Arc::new(ManualClock::new(0));
        let store = MemoryStore::new(1, 1_000, clock);
        let r = Counter { id: Arc::from("a"), window: WindowParams::window(1_000, 2, false) };
        let hit = || store.decide("u", r.counter(), 1, Count::Anyway).unwrap();
        let (first, second, third) = (hit(), hit(), hit());
        assert!(first.admitted && first.remaining == 1, "{first:?}");
        assert!(second.admitted && second.remaining == 0, "at the limit, as an admission: {second:?}");
        assert!(!third.admitted && third.retry_after_ms.is_some(), "{third:?}");
        // Three counted against two: even a weight of 0 is past the limit.
        assert!(!store.decide("u", r.counter(), 0, Count::Never).unwrap().admitted);
    }

    #[test]
    fn denied_requests_allocate_nothing() {
        let clock = Arc::new(ManualClock::new(0));
        let store = MemoryStore::new(1, 1_000, clock);
        let r = rule("a", 1_000, 1);
        assert!(!store.decide("u", r.counter(), 2, Count::IfFits).unwrap().admitted);
        assert!(store.is_empty());
    }

    fn item(key: &str, capacity: u64, weight: u64, shadow: bool) -> ManyItem {
        ManyItem {
            key: key.to_owned(),
            params: WindowParams::sliding(60_000, capacity),
            tick_ms: 1,
            weight,
            count: Count::IfFits,
            shadow,
        }
    }

    #[test]
    fn many_is_all_or_nothing() {
        let store = MemoryStore::new(8, 1_000, Arc::new(ManualClock::new(1_000_000)));
        let group: Arc<str> = Arc::from("d");
        let first = store.decide_many(&group, &[item("a", 5, 1, false), item("b", 1, 1, false)]).unwrap();
        assert!(first.committed);
        // b is full: a must not be consumed.
        let second = store.decide_many(&group, &[item("a", 5, 1, false), item("b", 1, 1, false)]).unwrap();
        assert!(!second.committed);
        assert_eq!((second.verdicts[0].admitted, second.verdicts[1].admitted), (true, false));
        assert_eq!(second.verdicts[0].remaining, 4, "a is reported unconsumed");
        let a_alone = store.decide_many(&group, &[item("a", 5, 1, false)]).unwrap();
        assert_eq!(a_alone.verdicts[0].remaining, 3, "only the first call counted on a");
    }

    /// A native rule `edge` and an Envoy domain `edge`: a client whose user
    /// id spells the domain's counter key (`60|user=a`) counts on its own
    /// counter, never on the Envoy descriptor's (Redis: `rl2:` vs `rle2:`).
    #[test]
    fn single_and_job_counters_never_share_a_key() {
        let store = MemoryStore::new(4, 1_000, Arc::new(ManualClock::new(1_000_000)));
        let native = rule("edge", 60_000, 1);
        assert!(store.decide("60|user=a", native.counter(), 1, Count::IfFits).unwrap().admitted);
        let envoy = store.decide_many("edge", &[item("60|user=a", 1, 1, false)]).unwrap();
        assert!(envoy.committed, "the Envoy counter is untouched by the native one");
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn many_shadow_items_never_block() {
        let store = MemoryStore::new(8, 1_000, Arc::new(ManualClock::new(1_000_000)));
        let group: Arc<str> = Arc::from("d");
        store.decide_many(&group, &[item("s", 1, 1, true)]).unwrap();
        let outcome = store.decide_many(&group, &[item("s", 1, 1, true), item("a", 5, 1, false)]).unwrap();
        assert!(outcome.committed);
        assert!(!outcome.verdicts[0].admitted);
        assert_eq!(store.decide_many(&group, &[item("a", 5, 0, false)]).unwrap().verdicts[0].remaining, 4);
    }

    #[test]
    fn many_counts_a_repeated_key_once_per_occurrence() {
        let store = MemoryStore::new(8, 1_000, Arc::new(ManualClock::new(1_000_000)));
        let group: Arc<str> = Arc::from("d");
        let outcome = store.decide_many(&group, &[item("a", 3, 2, false), item("a", 3, 2, false)]).unwrap();
        assert!(!outcome.committed, "2 + 2 > 3 on the same counter");
        assert!(store.decide_many(&group, &[item("a", 3, 3, false)]).unwrap().committed);
    }

    #[test]
    fn concurrent_callers_admit_exactly_the_capacity() {
        let clock = Arc::new(ManualClock::new(5_000));
        let store = Arc::new(MemoryStore::new(8, 1_000, clock));
        let r = Arc::new(rule("a", 60_000, 1_000));
        let admitted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let store = Arc::clone(&store);
                    let r = Arc::clone(&r);
                    scope.spawn(move || {
                        (0..500)
                            .filter(|_| store.decide("hot", r.counter(), 1, Count::IfFits).unwrap().admitted)
                            .count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 1_000);
    }

    #[test]
    fn a_full_store_never_evicts_a_counter_that_still_counts() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(4, 64, Arc::clone(&clock) as Arc<dyn Clock>);
        let r = rule("a", 1_000, 3);
        store.decide("victim", r.counter(), 3, Count::IfFits).unwrap();
        let mut full = 0;
        for user in 0..1_000 {
            match store.decide(&format!("flood-{user}"), r.counter(), 1, Count::IfFits) {
                Ok(verdict) => assert!(verdict.admitted),
                Err(e) => {
                    assert_eq!(e.kind, FailureKind::StoreFull);
                    full += 1;
                }
            }
        }
        assert_eq!(store.len(), 64, "every shard filled to its share, none beyond");
        assert_eq!(full, 1_000 - 63);
        assert_eq!(store.evictions(), 0);
        assert!(
            !store.decide("victim", r.counter(), 1, Count::IfFits).unwrap().admitted,
            "the victim's counter survived"
        );
        // A known counter keeps deciding; a denial or a peek needs no room.
        assert!(!store.decide("flood-unknown", r.counter(), 4, Count::IfFits).unwrap().admitted);
        assert!(store.decide("flood-unknown-2", r.counter(), 0, Count::IfFits).unwrap().admitted);
    }

    #[test]
    fn a_full_shard_evicts_expired_counters_without_a_sweep() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(1, 8, Arc::clone(&clock) as Arc<dyn Clock>);
        let r = rule("a", 1_000, 3);
        for user in 0..8 {
            store.decide(&format!("old-{user}"), r.counter(), 1, Count::IfFits).unwrap();
        }
        assert_eq!(
            store.decide("new", r.counter(), 1, Count::IfFits).unwrap_err().kind,
            FailureKind::StoreFull
        );
        clock.advance(2_000);
        for user in 0..8 {
            assert!(store.decide(&format!("new-{user}"), r.counter(), 1, Count::IfFits).unwrap().admitted);
        }
        assert_eq!(store.len(), 8);
        assert_eq!(store.evictions(), 8);
    }

    #[test]
    fn many_fails_whole_when_a_new_counter_finds_no_room() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(1, 2, Arc::clone(&clock) as Arc<dyn Clock>);
        let group: Arc<str> = Arc::from("d");
        store.decide_many(&group, &[item("a", 5, 1, false), item("b", 5, 1, false)]).unwrap();
        let error = store.decide_many(&group, &[item("a", 5, 1, false), item("c", 5, 1, false)]).unwrap_err();
        assert_eq!(error.kind, FailureKind::StoreFull);
        let a = store.decide_many(&group, &[item("a", 5, 0, false)]).unwrap();
        assert_eq!(a.verdicts[0].remaining, 4, "a was not counted by the failed call");
        // Repeated new keys need one slot, not two.
        clock.advance(120_000);
        store.decide_many(&group, &[item("c", 5, 1, false), item("c", 5, 1, false)]).unwrap();
        assert_eq!(store.len(), 2);
    }

    #[test]
    fn sweeping_after_a_flood_shrinks_the_maps() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(2, 100_000, Arc::clone(&clock) as Arc<dyn Clock>);
        let r = rule("a", 1_000, 3);
        for user in 0..50_000 {
            store.decide(&format!("flood-{user}"), r.counter(), 1, Count::IfFits).unwrap();
        }
        let flooded = store.allocated();
        assert!(flooded >= 50_000);
        clock.advance(1_000);
        store.decide("stays", r.counter(), 1, Count::IfFits).unwrap();
        clock.advance(1_000);
        assert_eq!(store.sweep(), 1, "only the counter written a window ago is left");
        assert!(store.allocated() < flooded / 10, "{} slots left of {flooded}", store.allocated());
        assert!(
            !store.decide("stays", r.counter(), 3, Count::IfFits).unwrap().admitted,
            "the survivor still counts"
        );
    }

    #[test]
    fn many_never_outgrows_the_bound_by_rewriting_an_expired_counter() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(1, 2, Arc::clone(&clock) as Arc<dyn Clock>);
        let group: Arc<str> = Arc::from("d");
        let short =
            |key: &str| ManyItem { params: WindowParams::sliding(1_000, 5), ..item(key, 5, 1, false) };
        store.decide_many(&group, &[short("a"), item("b", 5, 1, false)]).unwrap();
        clock.advance(2_000);
        // a has expired, b has not: writing a again and c needs two slots,
        // and only a's can be had.
        let error = store.decide_many(&group, &[short("a"), item("c", 5, 1, false)]).unwrap_err();
        assert_eq!(error.kind, FailureKind::StoreFull);
        assert!(store.len() <= 2, "{} counters", store.len());
    }
}
