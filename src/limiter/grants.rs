//! A region's side of one global limit, per key, in this instance: the grant
//! each key is enforced at (read by a decision with one map lookup, no
//! store call) and what this instance admitted and denied of each key since
//! its last report (docs/design.md §7c; the allocator is
//! [`super::lease`]).
//!
//! Bounds, whatever callers send: at most `max_keys` keys per limit (split
//! evenly over at most 16 shards of at least 64 places). A key new to a
//! full shard takes the place of the key with the fewest hits over this
//! interval and its own of the last, granted or not, and inherits its
//! count of this interval (the
//! space-saving algorithm: a key with more than its shard's hits over two
//! intervals divided by its room is always tracked, and its demand is
//! overstated by at most the count it inherited), so a flood of keys with
//! a hit each, granted or not, cannot keep a busy key from being reported
//! and granted. A granted key that loses its place is enforced at the
//! region's floor from then on here, and the agent reports it with no
//! demand, which gives its grant back: the global bound holds, since a
//! region never enforces more than it was granted. A key with no demand
//! in a report and no lease left is dropped, so the keys held are those
//! with demand in the interval.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{
        Arc, Mutex, RwLock,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::clock::Clock;

/// Shards of a limit's keys, at most: decisions of different keys rarely
/// meet on a lock.
const SHARDS: usize = 16;

/// Places of one shard, at least (but for a table smaller than this): a
/// busy key is tracked when it has more than its shard's hits over its
/// room, so a few large shards hold a busy key better than many small ones.
const MIN_PER_SHARD: usize = 64;

/// One shard of a limit's keys.
type Shard = HashMap<Box<str>, KeyState>;

#[derive(Debug, Clone, Copy, Default)]
struct KeyState {
    /// The grant and when it stops holding (ms of this instance's monotonic
    /// clock); `None` until the first grant.
    grant: Option<(u64, u64)>,
    admitted: u64,
    denied: u64,
    /// Of `denied`, what it inherited with its place this interval.
    inherited: u64,
    /// Its own hits of the last interval (nothing inherited): with this
    /// interval's count, what the key's place is kept by.
    last: u64,
}

impl KeyState {
    /// This interval's count (inherited included).
    fn count(&self) -> u64 {
        self.admitted.saturating_add(self.denied)
    }

    /// Its own hits of the last interval and this interval's count: the
    /// key with the least gives its place to a new one.
    fn weight(&self) -> u64 {
        self.last.saturating_add(self.count())
    }
}

/// What this instance saw of one key since its last report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyTally {
    /// The key.
    pub key: Box<str>,
    /// Hits admitted.
    pub admitted: u64,
    /// Hits denied.
    pub denied: u64,
}

/// One global limit's keys in this instance.
#[derive(Debug)]
pub struct GrantTable {
    shards: Box<[Mutex<Shard>]>,
    per_shard: usize,
    hasher: RandomState,
    /// Until when (ms, this instance's monotonic clock) every key is at
    /// zero: another deployment holds the region at the coordination store.
    claimed_until: AtomicU64,
}

impl GrantTable {
    /// A table of at most `max_keys` keys (at least one).
    pub fn new(max_keys: usize) -> Self {
        let shards = (max_keys / MIN_PER_SHARD).clamp(1, SHARDS);
        GrantTable {
            shards: (0..shards).map(|_| Mutex::default()).collect(),
            per_shard: (max_keys / shards).max(1),
            hasher: RandomState::new(),
            claimed_until: AtomicU64::new(0),
        }
    }

    /// Every key is enforced at zero until `until`: the region's report
    /// was refused, another deployment holding the region (two under one
    /// name would each enforce the region's floor and grants).
    pub fn claimed(&self, until: u64) {
        self.claimed_until.fetch_max(until, Ordering::Relaxed);
    }

    /// Whether the region is held by another deployment at `now`.
    pub fn is_claimed(&self, now: u64) -> bool {
        now < self.claimed_until.load(Ordering::Relaxed)
    }

    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, Shard> {
        let index = (self.hasher.hash_one(key) % self.shards.len() as u64) as usize;
        self.shards[index].lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The limit `key` is enforced at `now`: its grant while its lease runs,
    /// else `floor` (no grant yet, the lease ran out, or not tracked). A
    /// decision reads it through [`Grants::limit`], which is zero while the
    /// region is claimed.
    pub fn limit(&self, key: &str, floor: u64, now: u64) -> u64 {
        match self.shard(key).get(key).and_then(|state| state.grant) {
            Some((grant, until)) if now < until => grant,
            _ => floor,
        }
    }

    /// Counts `hits` of `key`, admitted or denied, for the next report (a
    /// key new to a full shard: see the module).
    pub fn record(&self, key: &str, hits: u64, admitted: bool) {
        let mut shard = self.shard(key);
        let Some(state) = tracked(&mut shard, key, self.per_shard) else { return };
        if admitted {
            state.admitted = state.admitted.saturating_add(hits);
        } else {
            state.denied = state.denied.saturating_add(hits);
        }
    }

    /// The tallies since the last report, the counts reset; a key with no
    /// demand and no lease left at `now` is dropped.
    pub fn take_tallies(&self, now: u64) -> Vec<KeyTally> {
        let mut out = Vec::new();
        for shard in &*self.shards {
            let mut shard = shard.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            shard.retain(|key, state| {
                let demand = state.admitted > 0 || state.denied > 0;
                if demand {
                    out.push(KeyTally { key: key.clone(), admitted: state.admitted, denied: state.denied });
                }
                state.last = state.count().saturating_sub(state.inherited);
                (state.admitted, state.denied, state.inherited) = (0, 0, 0);
                demand || state.grant.is_some_and(|(_, until)| now < until)
            });
        }
        out
    }

    /// Sets `key`'s grant until `until`, in the place of the key with the
    /// fewest hits when the shard is full (see the module).
    pub fn set_grant(&self, key: &str, grant: u64, until: u64) {
        if let Some(state) = tracked(&mut self.shard(key), key, self.per_shard) {
            state.grant = Some((grant, until));
        }
    }

    /// Keys held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().unwrap_or_else(std::sync::PoisonError::into_inner).len()).sum()
    }

    /// Whether no key is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Parts per million: a region's floor as a share of each global limit.
pub const PPM: u64 = 1_000_000;

/// This instance's side of every global limit: the tables of grants, by
/// limit id, that decisions read and the global exchange fills.
#[derive(Debug)]
pub struct Grants {
    /// This region's floor, in parts per million of each limit.
    floor_ppm: u64,
    max_keys: usize,
    clock: Arc<dyn Clock>,
    tables: RwLock<HashMap<Arc<str>, Arc<GrantTable>>>,
}

impl Grants {
    /// The grants of a region whose floor is `floor_ppm` parts per million
    /// of each limit, at most `max_keys` keys per limit, timed by the
    /// monotonic `clock`.
    pub fn new(floor_ppm: u64, max_keys: usize, clock: Arc<dyn Clock>) -> Self {
        Grants { floor_ppm: floor_ppm.min(PPM), max_keys, clock, tables: RwLock::default() }
    }

    /// This region's floor of a global limit of `limit`.
    pub fn floor(&self, limit: u64) -> u64 {
        share(limit, self.floor_ppm)
    }

    /// Now, on the clock leases are kept by (ms).
    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The limit `key` of the global limit `id` (of `limit` in all) is
    /// enforced at now: its grant, else this region's floor; `None` while
    /// another deployment holds this region for the limit (zero).
    pub fn limit(&self, id: &str, key: &str, limit: u64) -> Option<u64> {
        let floor = self.floor(limit);
        let now = self.clock.now_ms();
        let tables = self.tables.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        match tables.get(id) {
            Some(table) if table.is_claimed(now) => None,
            // A global limit that adapts may have fallen below the grant.
            Some(table) => Some(table.limit(key, floor, now).min(limit)),
            None => Some(floor),
        }
    }

    /// Counts `hits` of `key` of the global limit `id`, admitted or denied,
    /// for the region's next report.
    pub fn record(&self, id: &Arc<str>, key: &str, hits: u64, admitted: bool) {
        self.table(id).record(key, hits, admitted);
    }

    /// The table of the global limit `id`, made on first use.
    pub fn table(&self, id: &Arc<str>) -> Arc<GrantTable> {
        if let Some(table) = self.tables.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(id) {
            return Arc::clone(table);
        }
        let mut tables = self.tables.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        Arc::clone(tables.entry(Arc::clone(id)).or_insert_with(|| Arc::new(GrantTable::new(self.max_keys))))
    }

    /// Drops the tables of limits no longer served (not in `served`).
    pub fn retain(&self, served: &dyn Fn(&str) -> bool) {
        self.tables.write().unwrap_or_else(std::sync::PoisonError::into_inner).retain(|id, _| served(id));
    }
}

/// `ppm` parts per million of `limit`, rounded down: shares that sum to at
/// most a million sum to at most `limit`.
pub fn share(limit: u64, ppm: u64) -> u64 {
    u64::try_from(u128::from(limit) * u128::from(ppm.min(PPM)) / u128::from(PPM)).unwrap_or(limit)
}

/// `key`'s state in `shard`; a new key takes a place while there is room,
/// else the place and this interval's count of the key with the fewest
/// hits over this interval and its own of the last, one without a grant
/// first among equals.
fn tracked<'m>(
    shard: &'m mut HashMap<Box<str>, KeyState>,
    key: &str,
    room: usize,
) -> Option<&'m mut KeyState> {
    if !shard.contains_key(key) {
        let mut state = KeyState::default();
        if shard.len() >= room {
            let lightest = shard
                .iter()
                .min_by_key(|(_, s)| (s.weight(), s.grant.is_some()))
                .map(|(k, s)| (k.clone(), s.count()));
            if let Some((evicted, count)) = lightest {
                shard.remove(&evicted);
                // Inherited as denied: it counts as demand, never as admitted.
                (state.denied, state.inherited) = (count, count);
            }
        }
        shard.insert(key.into(), state);
    }
    shard.get_mut(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_at_its_grant_while_the_lease_runs_and_at_the_floor_otherwise() {
        let table = GrantTable::new(100);
        let now = 1_000;
        assert_eq!(table.limit("k", 10, now), 10, "no grant yet");
        table.set_grant("k", 300, now + 3_000);
        assert_eq!(table.limit("k", 10, now), 300);
        assert_eq!(table.limit("k", 10, now + 3_000), 10, "the lease ran out");
        assert_eq!(table.limit("other", 10, now), 10);
    }

    #[test]
    fn tallies_are_reported_once_and_idle_keys_without_a_lease_go() {
        let table = GrantTable::new(100);
        let now = 1_000;
        table.record("a", 3, true);
        table.record("a", 2, false);
        table.record("b", 1, true);
        table.set_grant("b", 50, now + 3_000);
        let mut tallies = table.take_tallies(now);
        tallies.sort_by(|x, y| x.key.cmp(&y.key));
        assert_eq!(
            tallies,
            [
                KeyTally { key: "a".into(), admitted: 3, denied: 2 },
                KeyTally { key: "b".into(), admitted: 1, denied: 0 }
            ]
        );
        // No demand since: "a" (no lease) goes, "b" keeps its grant until its lease ends.
        assert!(table.take_tallies(now).is_empty());
        assert_eq!(table.len(), 1);
        assert_eq!(table.limit("b", 10, now), 50);
        assert!(table.take_tallies(now + 3_000).is_empty());
        assert!(table.is_empty());
    }

    #[test]
    fn a_flood_of_keys_with_a_hit_each_cannot_keep_a_busy_key_out() {
        let table = GrantTable::new(64);
        let now = 1_000;
        // 10,000 junk keys of a hit each, every place taken before a busy
        // key (2,250 hits) comes: its shard sees 12,250 hits for 64
        // places, and it has far more than a 64th of them.
        for i in 0..10_000 {
            table.record(&format!("junk{i}"), 1, true);
            if i >= 1_000 && i % 4 == 0 {
                table.record("busy", 1, true);
            }
        }
        let tallies = table.take_tallies(now);
        assert!(tallies.len() <= 64, "{}", tallies.len());
        let busy = tallies.iter().find(|t| &*t.key == "busy").expect("the busy key is reported");
        let demand = busy.admitted + busy.denied;
        assert!(busy.admitted <= 2_250, "admitted: only its own hits");
        assert!(
            (2_250..=2_250 + 10_000 / 4).contains(&demand),
            "overstated by at most what it inherited: {demand}"
        );
        // A granted key busier than the flood keeps its place and grant; a
        // granted key with no demand gives its place up (its region then
        // enforces the floor, and the agent gives the grant back).
        table.record("granted", 1, true);
        table.set_grant("granted", 900, now + 3_000);
        table.set_grant("idle", 900, now + 3_000);
        for i in 0..10_000 {
            table.record(&format!("more{i}"), 1, true);
            if i % 4 == 0 {
                table.record("granted", 1, true);
            }
        }
        assert_eq!(table.limit("granted", 7, now), 900);
        assert_eq!(table.limit("idle", 7, now), 7);
    }

    /// A global limit with `max_keys` 32; 200 keys of a hit every 150 ms
    /// each hold every place, each granted as soon as reported; a busy key
    /// of 50 hits a second comes: it gets its place and its grant, and
    /// keeps them, where a policy keeping granted keys' places would leave
    /// it at its floor of 5.
    #[test]
    fn a_busy_key_gets_its_grant_during_a_flood_of_one_hit_keys_holding_every_place() {
        let table = GrantTable::new(32);
        let (floor, grant) = (5, 30);
        let (mut at_grant, mut decisions) = (0, 0);
        for tick in 0..1_000u64 {
            let now = tick * 10;
            for key in (0..200u64).filter(|k| k % 15 == tick % 15) {
                let key = format!("flood{key}");
                let limit = table.limit(&key, floor, now);
                table.record(&key, 1, limit > 0);
            }
            if tick >= 100 && tick % 2 == 0 {
                let limit = table.limit("busy", floor, now);
                if tick >= 400 {
                    decisions += 1;
                    at_grant += u32::from(limit == grant);
                }
                table.record("busy", 1, true);
            }
            if tick % 100 == 99 {
                for tally in table.take_tallies(now) {
                    table.set_grant(&tally.key, grant, now + 3_000);
                }
            }
        }
        assert!(
            at_grant * 100 >= decisions * 95,
            "the busy key was at its grant for {at_grant} of {decisions} decisions"
        );
        assert!(table.len() <= 32, "{}", table.len());
    }

    #[test]
    fn a_flood_of_keys_holds_at_most_the_bound_and_the_rest_stay_at_the_floor() {
        let table = GrantTable::new(64);
        let now = 1_000;
        for i in 0..10_000 {
            let key = format!("k{i}");
            table.record(&key, 1, true);
            table.set_grant(&key, 500, now + 3_000);
        }
        assert!(table.len() <= 64, "{}", table.len());
        let granted = (0..10_000).filter(|i| table.limit(&format!("k{i}"), 7, now) == 500).count();
        assert_eq!(granted, table.len(), "only held keys have a grant; the others are at the floor");
        assert_eq!(table.take_tallies(now).len(), table.len());
    }
}
