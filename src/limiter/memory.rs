//! The in-memory counter store: the embedded default when `redis.url` is unset.
//!
//! Counters live in a fixed number of shards, each a `std::sync::Mutex` over a
//! map `rule id -> user id -> counter`. A lock is held only for the few
//! arithmetic operations of one decision and never across an `.await`. The
//! two-level map lets a lookup borrow `&str` keys, so a known counter costs
//! no allocation. Idle counters expire after `2 * W`, like the Redis keys, and
//! a background sweep removes them, so memory stays bounded by active users.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::sync::watch;

use super::{
    Clock, CounterSpec, ManyItem, ManyOutcome, many_verdicts,
    window::{self, StoredCounter, Verdict},
};
#[derive(Debug)]
struct Entry {
    counter: StoredCounter,
    /// Past this instant (ms) the counter holds nothing that still counts.
    expires_at_ms: u64,
}

type Shard = HashMap<Arc<str>, HashMap<Box<str>, Entry>>;

/// Sharded in-process counters. The maps keep std's SipHash: their keys are
/// user ids, which clients choose, so a flooding-resistant hash matters here.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
    clock: Arc<dyn Clock>,
}

impl MemoryStore {
    /// A store with `shards` independently locked shards reading `clock`.
    pub fn new(shards: usize, clock: Arc<dyn Clock>) -> Self {
        MemoryStore {
            shards: (0..shards.max(1)).map(|_| Mutex::new(Shard::new())).collect(),
            hasher: RandomState::new(),
            clock,
        }
    }

    fn shard_index(&self, key: &str) -> usize {
        self.hasher.hash_one(key) as usize % self.shards.len()
    }

    fn shard(&self, user_id: &str) -> &Mutex<Shard> {
        &self.shards[self.shard_index(user_id)]
    }

    /// Decides and, on admit, counts — atomically for this user and rule.
    pub fn decide(&self, user_id: &str, counter: CounterSpec<'_>, weight: u64) -> Verdict {
        let now = self.clock.now_ms();
        let params = counter.window;
        let (window_index, elapsed) = window::position(now, params.window_ms);
        // A poisoned lock only means another thread panicked mid-update of
        // plain integers; the counters are still meaningful.
        let mut shard = self.shard(user_id).lock().unwrap_or_else(|p| p.into_inner());
        let stored = shard
            .get(&**counter.id)
            .and_then(|users| users.get(user_id))
            .filter(|entry| entry.expires_at_ms > now)
            .map(|entry| entry.counter)
            .unwrap_or_default();
        let counts = window::roll(stored, window_index);
        let verdict = window::decide(counts, elapsed, weight, params);
        if verdict.admitted {
            let entry = Entry {
                counter: StoredCounter {
                    window: window_index,
                    current: counts.current + weight,
                    previous: counts.previous,
                },
                expires_at_ms: now.saturating_add(2 * params.window_ms),
            };
            let users = match shard.get_mut(&**counter.id) {
                Some(users) => users,
                None => shard.entry(Arc::clone(counter.id)).or_default(),
            };
            match users.get_mut(user_id) {
                Some(existing) => *existing = entry,
                None => {
                    users.insert(user_id.into(), entry);
                }
            }
        }
        verdict
    }

    /// All-or-nothing decision over several counters of `group`; see
    /// [`Store::decide_many`](super::Store::decide_many). The shards involved
    /// are locked together, in index order (no deadlock), for the whole call.
    pub fn decide_many(&self, group: &str, items: &[ManyItem]) -> ManyOutcome {
        let now_ms = self.clock.now_ms();
        let shard_of: Vec<usize> = items.iter().map(|i| self.shard_index(&i.key)).collect();
        let mut order = shard_of.clone();
        order.sort_unstable();
        order.dedup();
        let mut guards: Vec<(usize, std::sync::MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, self.shards[i].lock().unwrap_or_else(|p| p.into_inner()))).collect();

        let mut pending: HashMap<&str, StoredCounter> = HashMap::new();
        let mut raw = Vec::with_capacity(items.len());
        let mut writes = Vec::new();
        let mut blocked = false;
        for (item, &shard) in items.iter().zip(&shard_of) {
            let now = now_ms / item.tick_ms;
            let (window_index, elapsed) = window::position(now, item.params.window_ms);
            let stored = match pending.get(item.key.as_str()) {
                Some(counter) => *counter,
                None => {
                    let guard = &guards.iter().find(|(i, _)| *i == shard).expect("shard locked").1;
                    guard
                        .get(group)
                        .and_then(|keys| keys.get(item.key.as_str()))
                        .filter(|entry| entry.expires_at_ms > now_ms)
                        .map(|entry| entry.counter)
                        .unwrap_or_default()
                }
            };
            let counts = window::roll(stored, window_index);
            let fits = window::decide(counts, elapsed, item.weight, item.params).admitted;
            // A weight of 0 (a peek) writes nothing: no counter is created.
            if fits && item.weight > 0 {
                let next = StoredCounter {
                    window: window_index,
                    current: counts.current + item.weight,
                    previous: counts.previous,
                };
                pending.insert(item.key.as_str(), next);
                writes.push((shard, item, next));
            } else if !item.shadow {
                blocked = true;
            }
            raw.push((fits, counts, elapsed));
        }
        if !blocked {
            for (shard, item, counter) in writes {
                let guard = &mut guards.iter_mut().find(|(i, _)| *i == shard).expect("shard locked").1;
                let keys = match guard.get_mut(group) {
                    Some(keys) => keys,
                    None => guard.entry(Arc::from(group)).or_default(),
                };
                let expires_at_ms = now_ms.saturating_add(2 * item.params.window_ms * item.tick_ms);
                // An existing counter is updated in place: no key allocation.
                match keys.get_mut(item.key.as_str()) {
                    Some(entry) => *entry = Entry { counter, expires_at_ms },
                    None => {
                        keys.insert(item.key.as_str().into(), Entry { counter, expires_at_ms });
                    }
                }
            }
        }
        drop(guards);
        ManyOutcome { committed: !blocked, verdicts: many_verdicts(items, &raw, !blocked) }
    }

    /// Removes expired counters; returns how many remain.
    pub fn sweep(&self) -> usize {
        let now = self.clock.now_ms();
        let mut remaining = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock().unwrap_or_else(|p| p.into_inner());
            shard.retain(|_, users| {
                users.retain(|_, entry| entry.expires_at_ms > now);
                remaining += users.len();
                !users.is_empty()
            });
        }
        remaining
    }

    /// Number of live counters (expired ones not yet swept included).
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).values().map(HashMap::len).sum::<usize>())
            .sum()
    }

    /// Whether no counter is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Sweeps `store` every `interval` until `shutdown` turns true.
pub async fn run_sweeper(store: Arc<MemoryStore>, interval: Duration, mut shutdown: watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {
                let remaining = store.sweep();
                tracing::trace!(remaining, "memory store swept");
            }
            _ = shutdown.changed() => return,
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
        let store = MemoryStore::new(4, clock);
        let a = rule("a", 1_000, 2);
        let b = rule("b", 1_000, 2);
        assert!(store.decide("u1", a.counter(), 2).admitted);
        assert!(!store.decide("u1", a.counter(), 1).admitted);
        assert!(store.decide("u2", a.counter(), 2).admitted, "users are independent");
        assert!(store.decide("u1", b.counter(), 2).admitted, "rules are independent");
    }

    #[test]
    fn idle_counters_expire_and_are_swept() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(4, Arc::clone(&clock) as Arc<dyn Clock>);
        let r = rule("a", 1_000, 5);
        for user in 0..100 {
            store.decide(&format!("user-{user}"), r.counter(), 1);
        }
        assert_eq!(store.len(), 100);
        clock.advance(1_999);
        assert_eq!(store.sweep(), 100, "still inside 2 x W");
        clock.advance(1);
        assert_eq!(store.sweep(), 0);
        assert!(store.is_empty());
    }

    #[test]
    fn denied_requests_allocate_nothing() {
        let clock = Arc::new(ManualClock::new(0));
        let store = MemoryStore::new(1, clock);
        let r = rule("a", 1_000, 1);
        assert!(!store.decide("u", r.counter(), 2).admitted);
        assert!(store.is_empty());
    }

    fn item(key: &str, capacity: u64, weight: u64, shadow: bool) -> ManyItem {
        ManyItem {
            key: key.to_owned(),
            params: WindowParams::sliding(60_000, capacity),
            tick_ms: 1,
            weight,
            shadow,
        }
    }

    #[test]
    fn many_is_all_or_nothing() {
        let store = MemoryStore::new(8, Arc::new(ManualClock::new(1_000_000)));
        let group: Arc<str> = Arc::from("d");
        let first = store.decide_many(&group, &[item("a", 5, 1, false), item("b", 1, 1, false)]);
        assert!(first.committed);
        // b is full: a must not be consumed.
        let second = store.decide_many(&group, &[item("a", 5, 1, false), item("b", 1, 1, false)]);
        assert!(!second.committed);
        assert_eq!((second.verdicts[0].admitted, second.verdicts[1].admitted), (true, false));
        assert_eq!(second.verdicts[0].remaining, 4, "a is reported unconsumed");
        let a_alone = store.decide_many(&group, &[item("a", 5, 1, false)]);
        assert_eq!(a_alone.verdicts[0].remaining, 3, "only the first call counted on a");
    }

    #[test]
    fn many_shadow_items_never_block() {
        let store = MemoryStore::new(8, Arc::new(ManualClock::new(1_000_000)));
        let group: Arc<str> = Arc::from("d");
        store.decide_many(&group, &[item("s", 1, 1, true)]);
        let outcome = store.decide_many(&group, &[item("s", 1, 1, true), item("a", 5, 1, false)]);
        assert!(outcome.committed);
        assert!(!outcome.verdicts[0].admitted);
        assert_eq!(store.decide_many(&group, &[item("a", 5, 0, false)]).verdicts[0].remaining, 4);
    }

    #[test]
    fn many_counts_a_repeated_key_once_per_occurrence() {
        let store = MemoryStore::new(8, Arc::new(ManualClock::new(1_000_000)));
        let group: Arc<str> = Arc::from("d");
        let outcome = store.decide_many(&group, &[item("a", 3, 2, false), item("a", 3, 2, false)]);
        assert!(!outcome.committed, "2 + 2 > 3 on the same counter");
        assert!(store.decide_many(&group, &[item("a", 3, 3, false)]).committed);
    }

    #[test]
    fn concurrent_callers_admit_exactly_the_capacity() {
        let clock = Arc::new(ManualClock::new(5_000));
        let store = Arc::new(MemoryStore::new(8, clock));
        let r = Arc::new(rule("a", 60_000, 1_000));
        let admitted: usize = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let store = Arc::clone(&store);
                    let r = Arc::clone(&r);
                    scope.spawn(move || {
                        (0..500).filter(|_| store.decide("hot", r.counter(), 1).admitted).count()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 1_000);
    }
}
