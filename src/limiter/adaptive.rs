//! Adaptive limits: a rule's limit that moves between `min` and `max` by
//! AIMD (additive increase, multiplicative decrease) from the outcomes
//! callers report.
//!
//! Each instance tallies the outcomes reported for a rule
//! ([`AdaptiveLimit::record`]: one relaxed atomic add). Once per interval
//! it adds its tally to the rule's shared state ([`exchange`]; in Redis its
//! twin `scripts/adapt.lua`, one hash per rule) and reads the current
//! limit back. The first exchange of an interval steps the limit
//! ([`step`]) from the previous interval's tally of every instance, so the
//! limit changes at most once per interval, by one function of one set of
//! figures, whichever instance gets there first. An interval with no
//! outcome reported holds the limit. After a decrease the limit holds for
//! one step: the interval then tallied was mostly decided under the old
//! limit, and is no evidence against the new one (one decrease per round
//! of evidence, as TCP backs off once per round trip).
//!
//! An outcome report weighs at most what its reporter (the user of a
//! native `Report`, the counter key of an Envoy descriptor) was admitted
//! on the rule in this interval and the one before, not yet reported
//! ([`AdaptiveLimit::admit`], [`AdaptiveLimit::record`]): a caller never
//! admitted moves the limit by 0, and a forged weight counts no more than
//! its reporter's own admitted traffic. The credits are kept for at most
//! [`MAX_REPORTERS`] reporters per interval; admissions past that pool in
//! one shared credit.
//!
//! Architecture invariant: the limit is always within `[min, max]`; the
//! decision path only reads it ([`AdaptiveLimit::current`], one atomic load).

use std::{
    collections::HashMap,
    hash::BuildHasher as _,
    sync::{
        Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

/// Most reporters whose admissions are credited apart, per rule and
/// interval; the admissions of any more share one credit.
pub const MAX_REPORTERS: usize = 10_000;

/// What each reporter was admitted and has not yet reported, by the hash
/// of its key (seeded per process: a caller cannot aim at another's).
#[derive(Debug, Default)]
struct Credits {
    current: HashMap<u64, u64>,
    previous: HashMap<u64, u64>,
}

/// The shared credit of reporters past [`MAX_REPORTERS`].
const POOLED: u64 = 0;

impl Credits {
    fn admit(&mut self, reporter: u64, hits: u64) {
        let key = if self.current.len() < MAX_REPORTERS || self.current.contains_key(&reporter) {
            reporter
        } else {
            POOLED
        };
        let credit = self.current.entry(key).or_default();
        *credit = credit.saturating_add(hits);
    }

    /// Takes up to `wanted` of `reporter`'s credit (the older first), and
    /// returns what it took.
    fn take(&mut self, reporter: u64, wanted: u64) -> u64 {
        let mut taken = 0;
        for credits in [&mut self.previous, &mut self.current] {
            for key in [reporter, POOLED] {
                if let Some(credit) = credits.get_mut(&key) {
                    let n = (*credit).min(wanted - taken);
                    *credit -= n;
                    taken += n;
                    if *credit == 0 {
                        credits.remove(&key);
                    }
                }
            }
        }
        taken
    }

    fn rotate(&mut self) {
        self.previous = std::mem::take(&mut self.current);
    }
}

/// How a request went downstream, as its caller reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Served.
    Success,
    /// Failed (an error the downstream answered or caused).
    Failure,
    /// Refused or timed out because the downstream was overloaded.
    Overload,
}

impl Outcome {
    /// Every outcome, in tally order.
    pub const ALL: [Outcome; 3] = [Outcome::Success, Outcome::Failure, Outcome::Overload];

    /// The name in metrics and docs.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Failure => "failure",
            Outcome::Overload => "overload",
        }
    }

    /// The outcome named `name` (as [`Outcome::as_str`] writes it).
    pub fn parse(name: &str) -> Option<Outcome> {
        Outcome::ALL.into_iter().find(|o| o.as_str() == name)
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One outcome report: how `weight` requests went, in `latency_ms` when
/// measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reported {
    /// How they went.
    pub outcome: Outcome,
    /// How long the downstream took, if measured.
    pub latency_ms: Option<u64>,
    /// Its caller may report outcomes (`grpc.reporting_peers`,
    /// `grpc.tls.reporting_client_names`); if not, it is answered and
    /// counts nowhere.
    pub counted: bool,
}

/// How an adaptive limit moves (a rule's `adaptive:`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AimdParams {
    /// The limit never goes below this.
    pub min: u64,
    /// The limit never goes above this.
    pub max: u64,
    /// Added after an interval whose outcomes were good.
    pub increase: u64,
    /// Multiplied after an interval with too many failures (0 < d < 1).
    pub decrease: f64,
    /// Length of one interval in ms.
    pub interval_ms: u64,
    /// An interval is bad when more than this share of its reported
    /// outcomes are failures or overloads.
    pub max_failure_ratio: f64,
    /// A success reported slower than this counts as an overload.
    pub latency_ms: Option<u64>,
}

/// Outcomes counted over one interval.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Successes.
    pub successes: u64,
    /// Failures.
    pub failures: u64,
    /// Overloads (and successes slower than `latency_ms`).
    pub overloads: u64,
}

impl Tally {
    /// All outcomes.
    pub fn total(&self) -> u64 {
        self.successes.saturating_add(self.failures).saturating_add(self.overloads)
    }

    /// `self + other`, saturating.
    pub fn plus(self, other: Tally) -> Tally {
        Tally {
            successes: self.successes.saturating_add(other.successes),
            failures: self.failures.saturating_add(other.failures),
            overloads: self.overloads.saturating_add(other.overloads),
        }
    }
}

/// The limit after an interval whose outcomes, all instances together,
/// were `tally`: none reported, it holds; more than `max_failure_ratio`
/// of them failures or overloads, it is multiplied by `decrease`; else
/// `increase` is added. Always within `[min, max]`.
pub fn step(limit: u64, tally: Tally, params: &AimdParams) -> u64 {
    let total = tally.total();
    let next = if total == 0 {
        limit
    } else if (tally.failures.saturating_add(tally.overloads)) as f64
        > total as f64 * params.max_failure_ratio
    {
        // Exact in f64 for any limit a rule may have (below 2^53).
        (limit as f64 * params.decrease).floor() as u64
    } else {
        limit.saturating_add(params.increase)
    };
    next.clamp(params.min, params.max)
}

/// A rule's shared state: the current limit and the tally of the interval
/// `index` (all instances' exchanges during it so far).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shared {
    /// The current limit.
    pub limit: u64,
    /// The interval `tally` belongs to (`now_ms / interval_ms`).
    pub index: u64,
    /// Outcomes added during interval `index`.
    pub tally: Tally,
    /// The last step decreased the limit: the next one holds it.
    pub cooling: bool,
}

/// One instance's exchange in interval `index`: the state as `stored`
/// (`None`: never written, or expired) with `tally` added. The first
/// exchange of an interval steps the limit from the previous interval's
/// tally (an older tally is no evidence of now: dropped), unless the step
/// before decreased it (then it holds once). A limit out of
/// `[min, max]` (the rule changed) is brought inside; a new state starts
/// at `initial`. `scripts/adapt.lua` is its twin in Redis.
pub fn exchange(
    stored: Option<Shared>,
    index: u64,
    initial: u64,
    params: &AimdParams,
    tally: Tally,
) -> Shared {
    let (limit, index, pending, cooling) = match stored {
        None => (initial, index, Tally::default(), false),
        // A later interval: the one that ended decides, once.
        Some(s) if s.index < index => {
            let limit = s.limit.clamp(params.min, params.max);
            let next = if s.index + 1 == index && !s.cooling { step(limit, s.tally, params) } else { limit };
            (next, index, Tally::default(), next < limit)
        }
        // This interval (or a later one, seen by an instance whose clock
        // runs ahead): add to it.
        Some(s) => (s.limit, s.index, s.tally, s.cooling),
    };
    Shared { limit: limit.clamp(params.min, params.max), index, tally: pending.plus(tally), cooling }
}

/// A rule's adaptive limit on one instance: the limit decisions read, and
/// the outcomes reported since the last exchange. Shared by the rule (in
/// the snapshot) and the task that exchanges it.
#[derive(Debug)]
pub struct AdaptiveLimit {
    /// How it moves.
    pub params: AimdParams,
    /// Where it starts (the rule's `limit`).
    pub initial: u64,
    current: AtomicU64,
    /// Outcomes since the last exchange, in [`Outcome::ALL`] order.
    pending: [AtomicU64; 3],
    /// Outcomes exchanged since start, in [`Outcome::ALL`] order.
    reported: [AtomicU64; 3],
    /// Outcomes reported beyond their reporter's credit, not counted.
    uncredited: AtomicU64,
    credits: Mutex<Credits>,
}

/// The hash of reporters' keys, seeded once per process.
static SEED: std::sync::LazyLock<std::collections::hash_map::RandomState> =
    std::sync::LazyLock::new(std::collections::hash_map::RandomState::new);

impl PartialEq for AdaptiveLimit {
    /// Equal settings; the moving state is not part of a rule's meaning.
    fn eq(&self, other: &Self) -> bool {
        self.params == other.params && self.initial == other.initial
    }
}

impl AdaptiveLimit {
    /// A limit moving by `params`, at `initial` until the first exchange.
    pub fn new(params: AimdParams, initial: u64) -> Self {
        AdaptiveLimit {
            params,
            initial,
            current: AtomicU64::new(initial.clamp(params.min, params.max)),
            pending: Default::default(),
            reported: Default::default(),
            uncredited: AtomicU64::new(0),
            credits: Mutex::default(),
        }
    }

    fn credits(&self) -> std::sync::MutexGuard<'_, Credits> {
        self.credits.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Credits `reporter` (a user id, an Envoy counter key) with `hits`
    /// admitted: what it may report.
    pub fn admit(&self, reporter: impl std::hash::Hash, hits: u64) {
        let reporter = SEED.hash_one(reporter);
        self.credits().admit(reporter, hits);
    }

    /// The limit in force.
    #[inline]
    pub fn current(&self) -> u64 {
        self.current.load(Ordering::Relaxed)
    }

    /// Sets the limit in force (what the exchange brought back), within
    /// `[min, max]`.
    pub fn set(&self, limit: u64) {
        self.current.store(limit.clamp(self.params.min, self.params.max), Ordering::Relaxed);
    }

    /// Counts `requests` requests of `reporter` that went as `outcome`, in
    /// `latency_ms` when measured (a success slower than `latency_ms` is
    /// an overload), up to the reporter's credit; returns how many counted.
    pub fn record(
        &self,
        reporter: impl std::hash::Hash,
        outcome: Outcome,
        latency_ms: Option<u64>,
        requests: u64,
    ) -> u64 {
        let reporter = SEED.hash_one(reporter);
        let credited = self.credits().take(reporter, requests);
        self.uncredited.fetch_add(requests - credited, Ordering::Relaxed);
        let slow = matches!((latency_ms, self.params.latency_ms), (Some(took), Some(bound)) if took > bound);
        let outcome = if outcome == Outcome::Success && slow { Outcome::Overload } else { outcome };
        self.pending[outcome.index()].fetch_add(credited, Ordering::Relaxed);
        credited
    }

    /// Outcomes reported beyond their reporter's credit since start (not
    /// counted).
    pub fn uncredited(&self) -> u64 {
        self.uncredited.load(Ordering::Relaxed)
    }

    /// Takes the outcomes since the last call, for the exchange; the
    /// admissions credited before the last call expire.
    pub fn drain(&self) -> Tally {
        self.credits().rotate();
        let [s, f, o] = std::array::from_fn(|i| {
            let n = self.pending[i].swap(0, Ordering::Relaxed);
            self.reported[i].fetch_add(n, Ordering::Relaxed);
            n
        });
        Tally { successes: s, failures: f, overloads: o }
    }

    /// Outcomes taken for exchanges since start, by outcome.
    pub fn reported(&self) -> [(Outcome, u64); 3] {
        Outcome::ALL.map(|o| (o, self.reported[o.index()].load(Ordering::Relaxed)))
    }

    /// Takes over from the same rule's limit in the rule set this one
    /// replaces: its limit (within this one's bounds) and its outcomes
    /// not yet exchanged, so a reload neither resets nor loses them.
    pub fn adopt(&self, previous: &AdaptiveLimit) {
        self.set(previous.current());
        *self.credits() = std::mem::take(&mut *previous.credits());
        self.uncredited.fetch_add(previous.uncredited(), Ordering::Relaxed);
        for i in 0..3 {
            let n = previous.pending[i].swap(0, Ordering::Relaxed);
            self.pending[i].fetch_add(n, Ordering::Relaxed);
            self.reported[i].fetch_add(previous.reported[i].load(Ordering::Relaxed), Ordering::Relaxed);
        }
    }
}

/// Each limit of `next` (a rule set being swapped in) adopts
/// ([`AdaptiveLimit::adopt`]) the limit of `previous` (the set it
/// replaces) of the same name, if any.
pub fn carry_over<'a>(previous: Vec<(&'a str, &'a AdaptiveLimit)>, next: Vec<(&'a str, &'a AdaptiveLimit)>) {
    let previous: std::collections::HashMap<&str, &AdaptiveLimit> = previous.into_iter().collect();
    for (name, limit) in next {
        if let Some(old) = previous.get(name) {
            limit.adopt(old);
        }
    }
}

/// Seconds a rule's shared state outlives its last exchange.
pub const STATE_TTL_SECONDS: u64 = 86_400;

/// The Redis key of `rule`'s shared state under `prefix` (`redis.key_prefix`).
pub fn state_key(prefix: &str, rule: &str) -> String {
    format!("{prefix}rla:{{adaptive}}:{rule}")
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const PARAMS: AimdParams = AimdParams {
        min: 10,
        max: 1_000,
        increase: 10,
        decrease: 0.9,
        interval_ms: 1_000,
        max_failure_ratio: 0.02,
        latency_ms: Some(250),
    };

    fn tally(successes: u64, failures: u64, overloads: u64) -> Tally {
        Tally { successes, failures, overloads }
    }

    #[test]
    fn good_intervals_add_bad_ones_multiply_and_silence_holds() {
        assert_eq!(step(100, tally(100, 0, 0), &PARAMS), 110);
        assert_eq!(step(100, tally(98, 2, 0), &PARAMS), 110, "2% is not more than 2%");
        assert_eq!(step(100, tally(97, 2, 1), &PARAMS), 90);
        assert_eq!(step(100, tally(0, 0, 0), &PARAMS), 100);
        assert_eq!(step(995, tally(1, 0, 0), &PARAMS), 1_000, "capped at max");
        assert_eq!(step(10, tally(0, 1, 0), &PARAMS), 10, "floored at min");
    }

    #[test]
    fn the_first_exchange_of_an_interval_steps_once() {
        let first = exchange(None, 7, 100, &PARAMS, tally(5, 0, 0));
        assert_eq!(first, Shared { limit: 100, index: 7, tally: tally(5, 0, 0), cooling: false });
        let second = exchange(Some(first), 7, 100, &PARAMS, tally(0, 1, 0));
        assert_eq!(second.tally, tally(5, 1, 0), "same interval: added, not stepped");
        let next = exchange(Some(second), 8, 100, &PARAMS, tally(3, 0, 0));
        assert_eq!(
            next,
            Shared { limit: 90, index: 8, tally: tally(3, 0, 0), cooling: true },
            "1 of 6 failed"
        );
        let again = exchange(Some(next), 8, 100, &PARAMS, tally(0, 5, 0));
        assert_eq!(again.limit, 90, "stepped once per interval");
        let cooled = exchange(Some(again), 9, 100, &PARAMS, Tally::default());
        assert_eq!((cooled.limit, cooled.cooling), (90, false), "after a decrease, one step holds");
        let after_a_gap = exchange(Some(cooled), 11, 100, &PARAMS, Tally::default());
        assert_eq!(after_a_gap.limit, 90, "a tally from long ago is no evidence");
        let behind = exchange(Some(after_a_gap), 10, 100, &PARAMS, tally(1, 0, 0));
        assert_eq!((behind.index, behind.tally), (11, tally(1, 0, 0)), "a clock behind adds to the latest");
    }

    #[test]
    fn a_slow_success_is_an_overload_and_a_reload_keeps_the_limit() {
        let limit = AdaptiveLimit::new(PARAMS, 100);
        limit.admit(b"u", 5);
        limit.record(b"u", Outcome::Success, Some(300), 2);
        limit.record(b"u", Outcome::Success, Some(200), 1);
        limit.record(b"u", Outcome::Success, None, 1);
        limit.record(b"u", Outcome::Failure, None, 1);
        limit.set(5_000);
        assert_eq!(limit.current(), 1_000);
        let reloaded = AdaptiveLimit::new(AimdParams { max: 500, ..PARAMS }, 100);
        reloaded.adopt(&limit);
        assert_eq!(reloaded.current(), 500, "within the new bounds");
        assert_eq!(reloaded.drain(), tally(2, 1, 2));
        assert_eq!(limit.drain(), Tally::default(), "moved, not copied");
        assert_eq!(reloaded.reported()[2], (Outcome::Overload, 2));
    }

    /// A reporter never admitted moves nothing; one admitted reports at
    /// most what it was admitted, over this interval and the next, never
    /// another reporter's; a forged weight of 2^32-1 counts its credit.
    #[test]
    fn a_report_weighs_at_most_its_reporters_admissions() {
        let limit = AdaptiveLimit::new(PARAMS, 100);
        assert_eq!(limit.record(b"mallory", Outcome::Failure, None, 1_000), 0);
        limit.admit(b"alice", 3);
        limit.admit(b"mallory", 2);
        assert_eq!(limit.record(b"mallory", Outcome::Success, None, u64::from(u32::MAX)), 2);
        assert_eq!(limit.record(b"mallory", Outcome::Success, None, 1), 0, "spent");
        assert_eq!(limit.record(b"alice", Outcome::Failure, None, 2), 2);
        assert_eq!(limit.drain(), tally(2, 2, 0));
        assert_eq!(limit.record(b"alice", Outcome::Failure, None, 5), 1, "last interval's credit, once");
        limit.drain();
        limit.admit(b"alice", 1);
        limit.drain();
        limit.drain();
        assert_eq!(limit.record(b"alice", Outcome::Failure, None, 1), 0, "older credit expired");
        assert_eq!(limit.uncredited(), 1_000 + u64::from(u32::MAX) - 2 + 1 + 4 + 1);
    }

    /// Past MAX_REPORTERS, admissions share one credit: none is lost, and
    /// the map stays bounded.
    #[test]
    fn reporters_past_the_bound_share_one_credit() {
        let limit = AdaptiveLimit::new(PARAMS, 100);
        for i in 0..MAX_REPORTERS as u64 + 10 {
            limit.admit(i.to_be_bytes(), 1);
        }
        assert_eq!(limit.credits().current.len(), MAX_REPORTERS + 1);
        let late = (MAX_REPORTERS as u64 + 5).to_be_bytes();
        assert_eq!(limit.record(late, Outcome::Success, None, 100), 10, "its own is pooled, with 9 others'");
    }

    proptest! {
        /// Whatever is reported, in whatever intervals, the shared limit
        /// stays within [min, max] and changes at most once per interval.
        #[test]
        fn the_limit_stays_within_its_bounds(
            initial in 0u64..2_000,
            steps in prop::collection::vec((0u64..3, 0u64..50, 0u64..50, 0u64..50), 1..60),
        ) {
            let mut state: Option<Shared> = None;
            let mut index = 0;
            for (gap, s, f, o) in steps {
                index += gap;
                let before = state;
                let next = exchange(state, index, initial, &PARAMS, tally(s, f, o));
                prop_assert!((PARAMS.min..=PARAMS.max).contains(&next.limit));
                if let Some(b) = before && b.index >= index {
                    prop_assert_eq!(next.limit, b.limit.clamp(PARAMS.min, PARAMS.max));
                }
                state = Some(next);
            }
        }
    }
}
