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
    Clock,
    window::{self, StoredCounter, Verdict},
};
use crate::rules::Rule;

#[derive(Debug)]
struct Entry {
    counter: StoredCounter,
    /// Past this instant (ms) the counter holds nothing that still counts.
    expires_at_ms: u64,
}

type Shard = HashMap<Arc<str>, HashMap<Box<str>, Entry>>;

/// Sharded in-process counters.
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

    fn shard(&self, user_id: &str) -> &Mutex<Shard> {
        let index = self.hasher.hash_one(user_id) as usize % self.shards.len();
        &self.shards[index]
    }

    /// Decides and, on admit, counts — atomically for this user and rule.
    pub fn decide(&self, user_id: &str, rule: &Rule, weight: u64) -> Verdict {
        let now = self.clock.now_ms();
        let params = rule.window;
        let (window_index, elapsed) = window::position(now, params.window_ms);
        // A poisoned lock only means another thread panicked mid-update of
        // plain integers; the counters are still meaningful.
        let mut shard = self.shard(user_id).lock().unwrap_or_else(|p| p.into_inner());
        let stored = shard
            .get(&*rule.id)
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
            let users = match shard.get_mut(&*rule.id) {
                Some(users) => users,
                None => shard.entry(Arc::clone(&rule.id)).or_default(),
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
    use std::path::Path;

    use super::*;
    use crate::{
        limiter::{ManualClock, window::WindowParams},
        rules::{FailurePolicy, Mode, Priority},
    };

    fn rule(id: &str, window_ms: u64, capacity: u64) -> Rule {
        Rule {
            id: Arc::from(id),
            resource_path: "/x".to_owned(),
            client_type: None,
            priority: Priority::Degraded,
            limit: capacity,
            burst_capacity: 1.0,
            window: WindowParams::sliding(window_ms, capacity),
            mode: Mode::Enforce,
            failure_policy: FailurePolicy::Open,
            source: Arc::from(Path::new("t.yaml")),
        }
    }

    #[test]
    fn counts_per_user_and_rule() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(4, clock);
        let a = rule("a", 1_000, 2);
        let b = rule("b", 1_000, 2);
        assert!(store.decide("u1", &a, 2).admitted);
        assert!(!store.decide("u1", &a, 1).admitted);
        assert!(store.decide("u2", &a, 2).admitted, "users are independent");
        assert!(store.decide("u1", &b, 2).admitted, "rules are independent");
    }

    #[test]
    fn idle_counters_expire_and_are_swept() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(4, Arc::clone(&clock) as Arc<dyn Clock>);
        let r = rule("a", 1_000, 5);
        for user in 0..100 {
            store.decide(&format!("user-{user}"), &r, 1);
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
        assert!(!store.decide("u", &r, 2).admitted);
        assert!(store.is_empty());
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
                    scope.spawn(move || (0..500).filter(|_| store.decide("hot", &r, 1).admitted).count())
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(admitted, 1_000);
    }
}
