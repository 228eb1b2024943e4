//! What a shard remembers of the counters it evicted while they still
//! counted, in a fixed size: which keys ([`Evicted`], a filter in two
//! generations) and how full they were ([`Sketch`], maximum fills).
//!
//! A key not held starts from the sketch only when the filter says it was
//! evicted. So a key that was evicted returns at least where it was (the
//! sketch only over-estimates), and a key never evicted starts at zero,
//! unless it is one of the filter's false positives. Without the filter a
//! flood of distinct keys on one rule would creep: each flooded key would
//! start from the summary of the ones before it and carry that start, plus
//! its own hit, back into the summary when evicted in turn.

use std::hash::{BuildHasher, RandomState};

use super::KeyRef;

/// A fill of 100 % in a [`Cell`].
pub(super) const FULL_PPM: u64 = 1_000_000;

/// Rows of a [`Sketch`]: a key is remembered in one cell of each, and read
/// back as the least of its cells.
const SKETCH_ROWS: usize = 4;

/// Cells of one row.
const SKETCH_COLUMNS: usize = 1_024;

/// Evictions one generation of [`Evicted`] holds before the next starts.
/// Two generations are kept, so an evicted key is remembered for at least
/// this many further live evictions of its shard (and at most twice as
/// many).
pub(super) const EVICTED_PER_GENERATION: usize = 2_048;

/// Bits of one generation's filter: 16 per key it holds, probed 4 times,
/// which gives about 0.24 % false positives when full.
const FILTER_BITS: usize = 32_768;

/// Probes per key in a generation's filter.
const FILTER_PROBES: u64 = 4;

/// One cell of a [`Sketch`]: the fullest evicted counter that hashed here,
/// and when the last of those expires.
#[derive(Debug, Clone, Copy, Default)]
struct Cell {
    fill_ppm: u32,
    expires_at_ms: u64,
}

/// How full the evicted counters of one shard were: a count-min sketch
/// whose cells keep the maximum fill (relative to each counter's own
/// limit) instead of a sum, each until the last counter it holds would
/// have expired. A key's estimate is the least of its cells: at least its
/// own fill while its counter would have lived.
#[derive(Debug)]
pub(super) struct Sketch {
    cells: Box<[Cell]>,
    evicted: Evicted,
}

impl Sketch {
    pub(super) fn new() -> Self {
        Sketch {
            cells: vec![Cell::default(); SKETCH_ROWS * SKETCH_COLUMNS].into_boxed_slice(),
            evicted: Evicted::default(),
        }
    }

    fn cell(hasher: &RandomState, row: usize, key: &KeyRef<'_>) -> usize {
        row * SKETCH_COLUMNS + (hasher.hash_one((row, key)) % SKETCH_COLUMNS as u64) as usize
    }

    /// Remembers `key`, evicted at `fill_ppm` of its limit, its counter
    /// living until `expires_at_ms`.
    pub(super) fn remember(
        &mut self,
        hasher: &RandomState,
        key: &KeyRef<'_>,
        fill_ppm: u32,
        expires_at_ms: u64,
        now_ms: u64,
    ) {
        self.evicted.insert(hasher.hash_one(key), expires_at_ms, now_ms);
        for row in 0..SKETCH_ROWS {
            let cell = &mut self.cells[Self::cell(hasher, row, key)];
            if cell.expires_at_ms <= now_ms {
                *cell = Cell::default();
            }
            cell.fill_ppm = cell.fill_ppm.max(fill_ppm);
            cell.expires_at_ms = cell.expires_at_ms.max(expires_at_ms);
        }
    }

    /// The most of its limit `key` may have held when evicted, in parts per
    /// million: 0 when the filter does not know it as evicted, or when its
    /// cells expired.
    pub(super) fn recall(&self, hasher: &RandomState, key: &KeyRef<'_>, now_ms: u64) -> u32 {
        if self.evicted.is_empty(now_ms) || !self.evicted.contains(hasher.hash_one(key), now_ms) {
            return 0;
        }
        (0..SKETCH_ROWS)
            .map(|row| self.cells[Self::cell(hasher, row, key)])
            .map(|cell| if cell.expires_at_ms > now_ms { cell.fill_ppm } else { 0 })
            .min()
            .unwrap_or(0)
    }
}

/// Which keys a shard evicted while they still counted: Bloom filters in
/// two generations of [`EVICTED_PER_GENERATION`] keys, so the false
/// positives stay rare however many keys a flood evicts (one filter would
/// fill up and answer "evicted" for every key).
#[derive(Debug, Default)]
struct Evicted {
    current: Generation,
    previous: Generation,
}

#[derive(Debug, Default)]
struct Generation {
    /// `FILTER_BITS` bits, allocated at the first insert.
    bits: Vec<u64>,
    keys: usize,
    /// When the last counter of this generation expires: past it the
    /// generation answers nothing.
    expires_at_ms: u64,
}

impl Generation {
    fn live(&self, now_ms: u64) -> bool {
        self.keys > 0 && self.expires_at_ms > now_ms
    }

    /// The bits `hash` sets: double hashing over its two halves.
    fn probes(hash: u64) -> impl Iterator<Item = usize> {
        let (low, high) = (hash & 0xffff_ffff, (hash >> 32) | 1);
        (0..FILTER_PROBES)
            .map(move |i| (low.wrapping_add(i.wrapping_mul(high)) % FILTER_BITS as u64) as usize)
    }

    fn insert(&mut self, hash: u64, expires_at_ms: u64) {
        if self.bits.is_empty() {
            self.bits = vec![0; FILTER_BITS / 64];
        }
        for bit in Self::probes(hash) {
            self.bits[bit / 64] |= 1 << (bit % 64);
        }
        self.keys += 1;
        self.expires_at_ms = self.expires_at_ms.max(expires_at_ms);
    }

    fn contains(&self, hash: u64, now_ms: u64) -> bool {
        self.live(now_ms) && Self::probes(hash).all(|bit| self.bits[bit / 64] & (1 << (bit % 64)) != 0)
    }

    fn clear(&mut self) {
        self.bits.fill(0);
        self.keys = 0;
        self.expires_at_ms = 0;
    }
}

impl Evicted {
    /// Adds a key to the current generation. A full generation becomes the
    /// previous one (the previous is dropped); a current generation whose
    /// every counter expired is cleared in place, so the previous one,
    /// which may live longer, is kept for its full term.
    fn insert(&mut self, hash: u64, expires_at_ms: u64, now_ms: u64) {
        if self.current.keys >= EVICTED_PER_GENERATION {
            std::mem::swap(&mut self.current, &mut self.previous);
            self.current.clear();
        } else if self.current.keys > 0 && !self.current.live(now_ms) {
            self.current.clear();
        }
        self.current.insert(hash, expires_at_ms);
    }

    fn is_empty(&self, now_ms: u64) -> bool {
        !self.current.live(now_ms) && !self.previous.live(now_ms)
    }

    fn contains(&self, hash: u64, now_ms: u64) -> bool {
        self.current.contains(hash, now_ms) || self.previous.contains(hash, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> KeyRef<'_> {
        KeyRef { many: false, group: "a", key: name }
    }

    #[test]
    fn an_evicted_key_is_recalled_for_a_generation_of_evictions_after_it() {
        let hasher = RandomState::new();
        let mut sketch = Sketch::new();
        sketch.remember(&hasher, &key("heavy"), 800_000, 10_000, 0);
        for n in 0..EVICTED_PER_GENERATION {
            sketch.remember(&hasher, &key(&format!("flood-{n}")), 200_000, 10_000, 0);
            assert!(sketch.recall(&hasher, &key("heavy"), 0) >= 800_000, "forgotten after {n}");
        }
        // Past two generations a key is forgotten; so is every key once
        // its counter would have expired.
        for n in 0..2 * EVICTED_PER_GENERATION {
            sketch.remember(&hasher, &key(&format!("more-{n}")), 200_000, 10_000, 0);
        }
        assert_eq!(sketch.recall(&hasher, &key("heavy"), 0), 0);
        let last = format!("more-{}", 2 * EVICTED_PER_GENERATION - 1);
        assert!(sketch.recall(&hasher, &key(&last), 0) >= 200_000);
        assert_eq!(sketch.recall(&hasher, &key(&last), 10_000), 0);
    }

    /// However many keys are evicted, a key never evicted starts at zero
    /// but for the filter's rare false positives.
    #[test]
    fn a_key_never_evicted_starts_at_zero_after_any_flood() {
        let hasher = RandomState::new();
        let mut sketch = Sketch::new();
        for n in 0..200_000 {
            sketch.remember(&hasher, &key(&format!("flood-{n}")), 1_000_000, 10_000, 0);
        }
        let recalled =
            (0..10_000).filter(|n| sketch.recall(&hasher, &key(&format!("new-{n}")), 0) > 0).count();
        // 2 x 0.24 % expected (about 48); 150 is over ten standard deviations away.
        assert!(recalled < 150, "{recalled} of 10,000 newcomers started above zero");
    }

    /// A key that lives an hour, evicted, then evictions of keys that live
    /// a second around a pause: the current generation expires during the
    /// pause, and clearing it must not take the older, live one along.
    #[test]
    fn a_long_lived_key_outlives_a_pause_that_expires_the_newer_generation() {
        let hasher = RandomState::new();
        let mut sketch = Sketch::new();
        sketch.remember(&hasher, &key("user"), 800_000, 3_600_000, 0);
        for n in 0..EVICTED_PER_GENERATION {
            sketch.remember(&hasher, &key(&format!("a-{n}")), 1, 1_000 + n as u64, n as u64);
        }
        // The user is in the previous generation now; a few short-lived
        // evictions, a 3 s pause, then more.
        for n in 0..17 {
            sketch.remember(&hasher, &key(&format!("b-{n}")), 1, 3_000, 2_500);
        }
        for n in 0..17 {
            sketch.remember(&hasher, &key(&format!("c-{n}")), 1, 7_000, 6_000);
        }
        assert!(sketch.recall(&hasher, &key("user"), 6_000) >= 800_000, "forgotten after 34 evictions");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, ..Default::default() })]

        /// Under any timing of evictions, pauses and lifetimes, a key
        /// evicted is recalled at least at its fill while its counter would
        /// live, for at least a generation of further evictions.
        #[test]
        fn an_evicted_key_is_recalled_within_the_stated_bound(
            watched in proptest::collection::vec((0usize..3_000, 1u32..=1_000_000, 1u64..7_200_000), 1..4),
            steps in proptest::collection::vec((0u64..5_000, 1u64..120_000, proptest::prelude::any::<bool>()), 1..3_000),
        ) {
            let hasher = RandomState::new();
            let mut sketch = Sketch::new();
            // (name, fill, expires at, evictions since)
            let mut remembered: Vec<(String, u32, u64, usize)> = Vec::new();
            let mut now = 0u64;
            for (i, (pause, lifetime, long_pause)) in steps.iter().enumerate() {
                now += if *long_pause { pause * 10 } else { *pause / 100 };
                for (n, (at, fill, life)) in watched.iter().enumerate() {
                    if *at == i {
                        remembered.iter_mut().for_each(|r| r.3 += 1);
                        sketch.remember(&hasher, &key(&format!("watched-{n}")), *fill, now + life, now);
                        remembered.push((format!("watched-{n}"), *fill, now + life, 0));
                    }
                }
                sketch.remember(&hasher, &key(&format!("flood-{i}")), 1, now + lifetime, now);
                for (name, fill, expires_at, since) in &mut remembered {
                    *since += 1;
                    if now < *expires_at && *since <= EVICTED_PER_GENERATION {
                        let recalled = sketch.recall(&hasher, &key(name), now);
                        proptest::prop_assert!(
                            recalled >= *fill,
                            "{} at {} of its limit recalled at {} after {} evictions",
                            name, fill, recalled, since
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_expired_generation_is_replaced_before_it_fills() {
        let hasher = RandomState::new();
        let mut sketch = Sketch::new();
        sketch.remember(&hasher, &key("old"), 500_000, 1_000, 0);
        sketch.remember(&hasher, &key("new"), 500_000, 5_000, 2_000);
        assert_eq!(sketch.evicted.current.keys, 1, "the expired generation was set aside");
        assert_eq!(sketch.recall(&hasher, &key("old"), 2_000), 0);
        assert_eq!(sketch.recall(&hasher, &key("new"), 2_000), 500_000);
    }
}
