//! The sliding-window counter as pure integer arithmetic (docs/design.md §6).
//!
//! Time is split into aligned windows of `W` ms. A counter keeps the count of
//! the current window and of the previous one; the previous count is weighted
//! by how much of it still overlaps the sliding window:
//!
//! ```text
//! estimate = current + previous * (W - elapsed) / W
//! admit iff estimate + weight <= capacity          (capacity = floor(limit * burst))
//! ```
//!
//! Everything is computed multiplied through by `W`, in integers, so the Rust
//! and the Lua implementation (`scripts/decide_batch.lua`) agree to the unit and
//! `retry_after_ms` is exact to the millisecond. The Lua side runs on doubles;
//! [`MAX_CAPACITY_TIMES_WINDOW`] keeps every intermediate below 2^53 there.
//!
//! Both stores call [`roll`] then [`decide`]; only the mutation (`current +=
//! weight` on admit) happens in the store, atomically.

/// Largest `capacity * window_ms` a rule may have. Every intermediate of the
/// admission test is at most `3 * capacity * window_ms`, and Redis' Lua numbers
/// are doubles, exact only below 2^53.
pub const MAX_CAPACITY_TIMES_WINDOW: u64 = (1 << 53) / 4;

/// How a rule counts (`algorithm:` of a rule or an Envoy descriptor).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum Algorithm {
    /// The previous window decays in (the default).
    #[default]
    SlidingWindow,
    /// Each aligned window starts from zero (envoyproxy/ratelimit's
    /// algorithm, kept for exact parity).
    FixedWindow,
    /// A bucket of `capacity` tokens refilled at `rate` per `W`
    /// ([`super::bucket`]); stores its level and last refill.
    TokenBucket,
    /// The same bucket as one theoretical arrival time ([`super::bucket`]).
    Gcra,
    /// A window that starts at its counter's first hit and ends `W` later,
    /// when the count starts from zero again (limitador's counters, whose
    /// expiry is set by their first hit). Stores the start in ticks.
    FirstHitWindow,
    /// Requests in flight: an admission takes `weight` slots, a report
    /// gives them back (the request ended). A slot never given back (its
    /// caller died) is freed one to two windows after it was taken: counts
    /// live in aligned windows of `W` and both the current and the previous
    /// window's are in flight, none older.
    Concurrency,
}

impl Algorithm {
    /// Every algorithm, in [`Algorithm::code`] order.
    pub const ALL: [Algorithm; 6] = [
        Algorithm::SlidingWindow,
        Algorithm::FixedWindow,
        Algorithm::TokenBucket,
        Algorithm::Gcra,
        Algorithm::FirstHitWindow,
        Algorithm::Concurrency,
    ];

    /// The name in rule files.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Gcra => "gcra",
            Algorithm::FirstHitWindow => "first_hit_window",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// The algorithm named `name` in a rule file.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.as_str() == name)
    }

    /// The algorithm named `name`, or an error naming every algorithm.
    pub fn named(name: &str) -> Result<Self, String> {
        Self::parse(name).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|a| a.as_str()).collect();
            format!("unknown algorithm {name:?} (one of {})", names.join(", "))
        })
    }

    /// Its number in the Redis script's flags (0 to 5).
    pub fn code(self) -> u64 {
        self as u64
    }

    /// A bucket (token bucket or GCRA) rather than a window.
    pub fn is_bucket(self) -> bool {
        matches!(self, Algorithm::TokenBucket | Algorithm::Gcra)
    }

    /// A report gives slots back rather than counting usage.
    pub fn releases(self) -> bool {
        self == Algorithm::Concurrency
    }
}

/// An [`Algorithm`] (de)serialized by its name in rule files, for a
/// setting (`#[serde(with = "by_name")]`).
pub mod by_name {
    use super::Algorithm;

    /// Writes the algorithm's name.
    pub fn serialize<S: serde::Serializer>(algorithm: &Algorithm, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(algorithm.as_str())
    }

    /// Reads an algorithm's name; an unknown one names them all.
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Algorithm, D::Error> {
        let name = <std::borrow::Cow<'de, str> as serde::Deserialize>::deserialize(d)?;
        Algorithm::named(&name).map_err(serde::de::Error::custom)
    }
}

/// What a decision does with its weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub enum Count {
    /// Count it if it fits (admission: `Check`, `ShouldRateLimit`).
    #[default]
    IfFits,
    /// Never count it: say whether it would fit now (a peek: native
    /// `peek`, Envoy `hits_addend: 0`). Creates no counter.
    Never,
    /// Count it whatever is left (usage reported after the fact: native
    /// `Report`, Envoy `report_mode`). The counter may go past its capacity,
    /// up to [`max_count`] (windows) or `bucket::MAX_DEBT` (buckets).
    Always,
    /// An admission counted whether or not it fits, answering for itself
    /// (envoyproxy/ratelimit's INCRBY: Envoy `envoy.hits_counted: always`).
    /// Like a report, it may push the counter past its capacity and never
    /// keeps another counter of its request from being counted.
    Anyway,
}

impl Count {
    /// Its number in the Redis script's flags (0 to 2), times 16. The
    /// script writes `Always` and `Anyway` alike; they differ only in the
    /// answer, which is made here from what the script returns.
    pub fn code(self) -> u64 {
        match self {
            Count::IfFits => 0,
            Count::Never => 1,
            Count::Always | Count::Anyway => 2,
        }
    }

    /// Whether its weight is written whatever is left (`Always`, `Anyway`).
    pub fn whatever_is_left(self) -> bool {
        matches!(self, Count::Always | Count::Anyway)
    }
}

/// The most a window's count holds: `MAX_CAPACITY_TIMES_WINDOW / W`. Only
/// reports push a count past the capacity; beyond this bound a count is
/// clamped (read and write, in both stores), so every intermediate stays
/// below 2^53 and the Lua arithmetic stays exact.
pub fn max_count(window: u64) -> u64 {
    MAX_CAPACITY_TIMES_WINDOW / window.max(1)
}

/// The fixed parameters of one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WindowParams {
    /// Window length (or a bucket's refill period) `W` in ms, at least 1.
    pub window_ms: u64,
    /// The most one window admits, or a full bucket holds:
    /// `floor(limit * burst_capacity)`, at least 1.
    pub capacity: u64,
    /// A bucket's refill per `W` (the rule's `limit`); unused by windows.
    pub rate: u64,
    /// How it counts.
    pub algorithm: Algorithm,
}

impl WindowParams {
    /// A sliding window of `window_ms` admitting `capacity`.
    pub const fn sliding(window_ms: u64, capacity: u64) -> Self {
        WindowParams { window_ms, capacity, rate: capacity, algorithm: Algorithm::SlidingWindow }
    }

    /// A window of `window_ms` admitting `capacity`, sliding or fixed.
    pub const fn window(window_ms: u64, capacity: u64, sliding: bool) -> Self {
        let algorithm = if sliding { Algorithm::SlidingWindow } else { Algorithm::FixedWindow };
        WindowParams { window_ms, capacity, rate: capacity, algorithm }
    }
}

/// A counter as stored: the index of the window its `current` belongs to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoredCounter {
    /// `now_ms / W` when `current` was last written.
    pub window: u64,
    /// Weight admitted in window `window`.
    pub current: u64,
    /// Weight admitted in window `window - 1`.
    pub previous: u64,
}

/// Counts as seen from the window that contains `now`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Weight admitted in the window containing `now`.
    pub current: u64,
    /// Weight admitted in the window before it.
    pub previous: u64,
}

/// What the arithmetic says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Whether the request fits; the store adds `weight` to `current` if so.
    pub admitted: bool,
    /// Whole tokens left after this decision: `floor(capacity - estimate - admitted weight)`.
    pub remaining: u64,
    /// 0 when admitted; otherwise the smallest whole number of ms after which
    /// the same request is admitted if nothing else is counted meanwhile.
    /// `None` when it never will (the weight exceeds the capacity).
    pub retry_after_ms: Option<u64>,
    /// ms until the estimate has decayed to 0 if nothing else is counted.
    pub reset_after_ms: u64,
}

impl Counts {
    /// Both counts clamped to [`max_count`] of a window of `window` ticks.
    pub fn clamped(self, window: u64) -> Self {
        let max = max_count(window);
        Counts { current: self.current.min(max), previous: self.previous.min(max) }
    }
}

/// The window index containing `now_ms` and the ms elapsed inside it.
pub fn position(now_ms: u64, window_ms: u64) -> (u64, u64) {
    (now_ms / window_ms, now_ms % window_ms)
}

/// Re-reads a stored counter from the point of view of window `now_window`:
/// the same window keeps both counts, the next one demotes `current` to
/// `previous`, anything later starts empty. A counter of the window after
/// `now_window` (written by a clock ahead of this one: another instance's
/// at a calendar period's edge) is not lost: [`locate`] counts in its
/// window, both of its counts as current. One further ahead is another
/// window's (a rule whose window changed, a clock far off) and starts
/// empty, as one far behind does: a counter can never stick to a window
/// it would not leave.
pub fn roll(stored: StoredCounter, now_window: u64) -> Counts {
    if stored.window == now_window {
        Counts { current: stored.current, previous: stored.previous }
    } else if stored.window.checked_add(1) == Some(now_window) {
        Counts { current: 0, previous: stored.current }
    } else if Some(stored.window) == now_window.checked_add(1) {
        Counts { current: stored.current.saturating_add(stored.previous), previous: 0 }
    } else {
        Counts::default()
    }
}

/// The window a counter read at `now_window` is stored with: the next one
/// when it was written there ([`roll`]), else `now_window`.
fn kept(stored: StoredCounter, now_window: u64) -> u64 {
    if Some(stored.window) == now_window.checked_add(1) { stored.window } else { now_window }
}

/// Where `now` (ticks) falls for the window counter `stored` (none: never
/// counted, or expired): the window to store with the counts (`now / W` for
/// an aligned window, its first hit's tick for a first-hit window), the
/// counts as seen from it, and the ticks elapsed in it. A first-hit window
/// is open from its first hit until `W` later; a clock behind its start
/// keeps its count, with nothing elapsed. An aligned window's counter
/// written by a clock ahead keeps its window ([`roll`]).
pub fn locate(stored: Option<StoredCounter>, now: u64, params: WindowParams) -> (u64, Counts, u64) {
    if params.algorithm == Algorithm::FirstHitWindow {
        return match stored {
            Some(s) if now < s.window.saturating_add(params.window_ms) => {
                (s.window, Counts { current: s.current, previous: 0 }, now.saturating_sub(s.window))
            }
            _ => (now, Counts::default(), 0),
        };
    }
    let (index, elapsed) = position(now, params.window_ms);
    let stored = stored.unwrap_or_default();
    (kept(stored, index), roll(stored, index), elapsed)
}

/// Decides a request of `weight` against `counts` at `elapsed_ms` into the
/// current window. Pure: the caller applies `current += weight` on admit.
pub fn decide(counts: Counts, elapsed_ms: u64, weight: u64, params: WindowParams) -> Verdict {
    let w = u128::from(params.window_ms);
    let cap = u128::from(params.capacity);
    let cur = u128::from(counts.current);
    // A fixed or first-hit window forgets the previous one entirely; the
    // slots of requests in flight count whole until their window is over.
    let sliding = params.algorithm == Algorithm::SlidingWindow;
    let in_flight = params.algorithm == Algorithm::Concurrency;
    debug_assert!(!params.algorithm.is_bucket(), "a bucket decides in bucket.rs");
    let prev = if sliding || in_flight { u128::from(counts.previous) } else { 0 };
    let weight_w = u128::from(weight);
    let elapsed = u128::from(elapsed_ms);
    debug_assert!(elapsed < w, "elapsed {elapsed} outside window {w}");

    // estimate * W, exactly.
    let prev_share = if in_flight { w } else { w - elapsed };
    let estimate_w = cur * w + prev * prev_share;
    let admitted = weight_w <= cap && estimate_w + weight_w * w <= cap * w;
    let used_w = if admitted { estimate_w + weight_w * w } else { estimate_w };
    let remaining = (cap * w).saturating_sub(used_w) / w;

    let current_after = if admitted { cur + weight_w } else { cur };
    // Sliding: what is counted now decays out by the end of the next window
    // (slots in flight: are freed then at the latest).
    // Fixed or first-hit (prev is 0 there): everything resets when this window ends.
    let reset_after_ms = if current_after > 0 && (sliding || in_flight) {
        2 * w - elapsed
    } else if current_after > 0 || prev > 0 {
        w - elapsed
    } else {
        0
    };

    let retry_after_ms = if admitted {
        Some(0)
    } else if weight_w > cap {
        None
    } else if sliding {
        Some(retry_after(cur, prev, elapsed, weight_w, cap, w))
    } else if in_flight && cur + weight_w > cap {
        // Given no release: once this window's slots are over too.
        Some(2 * w - elapsed)
    } else {
        // Fixed window: everything resets when the next window starts (slots
        // in flight: the previous window's are over then, enough to fit).
        Some(w - elapsed)
    };

    Verdict {
        admitted,
        remaining: to_u64(remaining),
        retry_after_ms: retry_after_ms.map(to_u64),
        reset_after_ms: to_u64(reset_after_ms),
    }
}

/// The earliest whole ms at which a denied request of weight `weight <= cap` is
/// admitted, given no other traffic. Solves the decay of `prev` within the
/// current window, else in the next one (where `cur` becomes the decaying
/// count), else at the start of the one after (where nothing is left).
fn retry_after(cur: u128, prev: u128, elapsed: u128, weight: u128, cap: u128, w: u128) -> u128 {
    // Within this window at elapsed e: cur*W + prev*(W - e) <= (cap - cur - weight)*W + cur*W,
    // i.e. prev*(W - e) <= room*W with room = cap - cur - weight.
    // `checked_div` is None when nothing decays (prev == 0).
    if let Some(allowed_decay) = cap.checked_sub(cur + weight).and_then(|room| (room * w).checked_div(prev)) {
        let need = w - allowed_decay.min(w);
        if need < w {
            // `need > elapsed`, or the request would have been admitted.
            return need - elapsed;
        }
    }
    // Next window at elapsed e2: cur*(W - e2) + weight*W <= cap*W.
    let to_next = w - elapsed;
    if cur == 0 {
        return to_next;
    }
    let e2 = w - ((cap - weight) * w / cur).min(w);
    to_next + e2
}

fn to_u64(value: u128) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A counter with a clock the test moves: the same sequence of `roll`,
    /// `decide` and mutation the memory store performs.
    struct Sim {
        params: WindowParams,
        stored: StoredCounter,
        now_ms: u64,
    }

    impl Sim {
        fn new(limit_window_ms: u64, capacity: u64, start_ms: u64) -> Self {
            Sim {
                params: WindowParams::sliding(limit_window_ms, capacity),
                stored: StoredCounter::default(),
                now_ms: start_ms,
            }
        }

        fn peek(&self, weight: u64) -> Verdict {
            let (window, elapsed) = position(self.now_ms, self.params.window_ms);
            decide(roll(self.stored, window), elapsed, weight, self.params)
        }

        fn hit(&mut self, weight: u64) -> Verdict {
            let (window, elapsed) = position(self.now_ms, self.params.window_ms);
            let counts = roll(self.stored, window);
            let verdict = decide(counts, elapsed, weight, self.params);
            if verdict.admitted {
                self.stored =
                    StoredCounter { window, current: counts.current + weight, previous: counts.previous };
            }
            verdict
        }

        fn advance(&mut self, ms: u64) {
            self.now_ms += ms;
        }
    }

    #[test]
    fn admits_exactly_capacity_in_one_window() {
        let mut sim = Sim::new(1_000, 5, 10_000);
        for left in (0..5).rev() {
            let verdict = sim.hit(1);
            assert!(verdict.admitted);
            assert_eq!(verdict.remaining, left);
            assert_eq!(verdict.retry_after_ms, Some(0));
        }
        let denied = sim.hit(1);
        assert!(!denied.admitted);
        assert_eq!(denied.remaining, 0);
    }

    #[test]
    fn denied_request_consumes_nothing() {
        let mut sim = Sim::new(1_000, 3, 0);
        assert!(sim.hit(2).admitted);
        assert!(!sim.hit(2).admitted);
        // Still room for exactly one more unit.
        assert!(sim.hit(1).admitted);
        assert!(!sim.hit(1).admitted);
    }

    #[test]
    fn previous_window_decays_linearly() {
        let mut sim = Sim::new(1_000, 10, 0);
        assert!(sim.hit(10).admitted);
        // At the start of the next window the previous 10 count fully.
        sim.advance(1_000);
        assert!(!sim.peek(1).admitted);
        // Halfway through, they count as 5: one more leaves 4.
        sim.advance(500);
        assert_eq!(sim.peek(1).remaining, 4);
        assert!(sim.hit(5).admitted);
        assert!(!sim.hit(1).admitted);
        // Two windows later nothing is left.
        sim.advance(1_500);
        assert_eq!(sim.peek(1).remaining, 9);
    }

    #[test]
    fn window_boundary_cannot_double_the_limit() {
        // A fixed window would admit 10 at 999 ms and 10 more at 1000 ms.
        let mut sim = Sim::new(1_000, 10, 0);
        sim.advance(999);
        assert!(sim.hit(10).admitted);
        sim.advance(1);
        assert!(!sim.hit(1).admitted);
    }

    #[test]
    fn weights_count_as_their_cost() {
        let mut sim = Sim::new(60_000, 100, 0);
        assert_eq!(sim.hit(60).remaining, 40);
        assert_eq!(sim.peek(1).remaining, 39);
        assert!(!sim.hit(41).admitted);
        assert!(sim.hit(40).admitted);
    }

    #[test]
    fn burst_is_capacity_above_the_limit() {
        // limit 5000 x burst 1.2 = capacity 6000.
        let mut sim = Sim::new(60_000, 6_000, 0);
        assert!(sim.hit(6_000).admitted);
        assert!(!sim.hit(1).admitted);
    }

    #[test]
    fn weight_above_capacity_is_never_admissible() {
        let sim = Sim::new(1_000, 10, 0);
        let verdict = sim.peek(11);
        assert!(!verdict.admitted);
        assert_eq!(verdict.retry_after_ms, None);
    }

    #[test]
    fn reset_after_reflects_both_windows() {
        let mut sim = Sim::new(1_000, 10, 200);
        assert_eq!(sim.peek(1).reset_after_ms, 1_800, "admitting makes current non-zero");
        sim.hit(1);
        sim.advance(1_000);
        assert_eq!(sim.peek(20).reset_after_ms, 800, "only the decaying previous remains");
    }

    /// Whatever the state, waiting exactly `retry_after_ms` admits the same
    /// request and waiting one ms less does not.
    #[test]
    fn retry_after_is_exact_to_the_millisecond() {
        let windows = [1, 7, 1_000, 60_000];
        let mut checked = 0;
        for &window_ms in &windows {
            for capacity in [1_u64, 3, 10, 97] {
                for fill in [0, 1, capacity / 2, capacity] {
                    for carry in [0, 1, capacity / 3, capacity] {
                        for weight in [1, 2, capacity].into_iter().filter(|&w| w <= capacity) {
                            for offset in [0, window_ms / 3, window_ms - 1] {
                                checked +=
                                    check_retry_exact(window_ms, capacity, carry, fill, weight, offset);
                            }
                        }
                    }
                }
            }
        }
        assert!(checked > 500, "only {checked} denied states exercised");
    }

    /// Builds a counter with `carry` admitted in the previous window and `fill`
    /// in the current one, `offset` ms into it; returns 1 if the request was
    /// denied (and its retry checked), 0 if it was admitted outright.
    fn check_retry_exact(
        window_ms: u64,
        capacity: u64,
        carry: u64,
        fill: u64,
        weight: u64,
        offset: u64,
    ) -> u32 {
        let params = WindowParams::sliding(window_ms, capacity);
        let window = 1_000;
        let stored = StoredCounter { window, current: fill, previous: carry };
        let now = window * window_ms + offset;
        let at = |t: u64| {
            let (idx, elapsed) = position(t, window_ms);
            decide(roll(stored, idx), elapsed, weight, params)
        };
        let verdict = at(now);
        if verdict.admitted {
            return 0;
        }
        let retry = verdict.retry_after_ms.expect("weight <= capacity is admissible");
        assert!(retry >= 1, "denied but retry_after 0: {params:?} {stored:?} w={weight} +{offset}");
        assert!(
            at(now + retry).admitted,
            "not admitted after retry_after={retry}: {params:?} {stored:?} w={weight} +{offset}"
        );
        assert!(
            !at(now + retry - 1).admitted,
            "admitted 1 ms before retry_after={retry}: {params:?} {stored:?} w={weight} +{offset}"
        );
        1
    }

    #[test]
    fn fixed_window_forgets_the_previous_window_and_retries_at_its_end() {
        let params = WindowParams::window(1_000, 10, false);
        let full = StoredCounter { window: 5, current: 10, previous: 0 };
        // Same window: denied, retry exactly at the next window's start.
        let verdict = decide(roll(full, 5), 300, 1, params);
        assert_eq!(
            (verdict.admitted, verdict.retry_after_ms, verdict.reset_after_ms),
            (false, Some(700), 700)
        );
        // Next window: the previous 10 no longer count (a sliding window would deny).
        assert!(decide(roll(full, 6), 0, 10, params).admitted);
        assert!(!decide(roll(full, 6), 0, 1, WindowParams::window(1_000, 10, true)).admitted);
    }

    #[test]
    fn first_hit_window_opens_at_its_first_hit_and_lasts_exactly_w() {
        let params = WindowParams { algorithm: Algorithm::FirstHitWindow, ..WindowParams::sliding(1_000, 2) };
        // No counter: a window would open now, nothing elapsed.
        assert_eq!(locate(None, 12_345, params), (12_345, Counts::default(), 0));
        let opened = StoredCounter { window: 12_345, current: 2, previous: 0 };
        // Open until 13_345 (not aligned to 1 s): denied, retry and reset at its end.
        let (start, counts, elapsed) = locate(Some(opened), 13_000, params);
        assert_eq!((start, counts.current, elapsed), (12_345, 2, 655));
        let verdict = decide(counts, elapsed, 1, params);
        assert_eq!(
            (verdict.admitted, verdict.retry_after_ms, verdict.reset_after_ms),
            (false, Some(345), 345)
        );
        // At its end a new window opens, empty, whatever the alignment.
        assert_eq!(locate(Some(opened), 13_345, params), (13_345, Counts::default(), 0));
        // A clock behind the start keeps the count, nothing elapsed.
        assert_eq!(locate(Some(opened), 12_000, params), (12_345, Counts { current: 2, previous: 0 }, 0));
        // Admitted on an empty counter: resets a whole window on; refused: nothing to reset.
        assert_eq!(decide(Counts::default(), 0, 1, params).reset_after_ms, 1_000);
        assert_eq!(decide(Counts::default(), 0, 3, params).reset_after_ms, 0);
    }

    #[test]
    fn a_clock_behind_the_counter_counts_in_its_window() {
        let stored = StoredCounter { window: 10, current: 5, previous: 4 };
        // Nothing written one window ahead is lost: both counts are current, in window 10.
        assert_eq!(roll(stored, 9), Counts { current: 9, previous: 0 });
        let params = WindowParams::window(1_000, 10, false);
        assert_eq!(locate(Some(stored), 9_500, params), (10, Counts { current: 9, previous: 0 }, 500));
        // Further ahead is another window's counter: empty, stored at now's.
        assert_eq!(roll(stored, 8), Counts::default());
        assert_eq!(locate(Some(stored), 8_500, params), (8, Counts::default(), 500));
        assert_eq!(roll(stored, 12), Counts::default());
        assert_eq!(roll(stored, 11), Counts { current: 0, previous: 5 });
        let huge = StoredCounter { window: u64::MAX, current: u64::MAX, previous: 1 };
        assert_eq!(roll(huge, u64::MAX - 1), Counts { current: u64::MAX, previous: 0 });
        assert_eq!(roll(huge, 1), Counts::default());
    }

    #[test]
    fn largest_allowed_product_does_not_overflow() {
        let params = WindowParams::sliding(1 << 20, MAX_CAPACITY_TIMES_WINDOW >> 20);
        let counts = Counts { current: params.capacity, previous: params.capacity };
        let verdict = decide(counts, 0, params.capacity, params);
        assert!(!verdict.admitted);
        assert!(verdict.retry_after_ms.is_some());
    }

    pub(in crate::limiter) mod properties {
        //! Property tests: any parameters a rule may have, any counts a
        //! store may hold, any time and weight.
        use proptest::{prelude::*, test_runner::TestCaseError};

        use super::*;

        /// The verdict `at(now)`, if denied, names the exact ms at which the
        /// same request passes with nothing else counted: admitted at
        /// `now + retry_after_ms`, not one ms earlier. (The bucket's
        /// properties check theirs with it too.)
        pub(in crate::limiter) fn retry_is_exact(
            now: u64,
            at: impl Fn(u64) -> Verdict,
        ) -> Result<(), TestCaseError> {
            let v = at(now);
            if !v.admitted {
                let t = v.retry_after_ms.expect("weight <= capacity is admissible");
                prop_assert!(t >= 1);
                prop_assert!(at(now + t).admitted, "not admitted after retry_after {}", t);
                prop_assert!(!at(now + t - 1).admitted, "admitted 1 ms before retry_after {}", t);
            }
            Ok(())
        }

        /// The algorithms that count in windows.
        fn windows() -> impl Strategy<Value = Algorithm> {
            prop_oneof![
                Just(Algorithm::SlidingWindow),
                Just(Algorithm::FixedWindow),
                Just(Algorithm::FirstHitWindow),
                Just(Algorithm::Concurrency)
            ]
        }

        fn window(window_ms: u64, capacity: u64, algorithm: Algorithm) -> WindowParams {
            WindowParams { algorithm, ..WindowParams::sliding(window_ms, capacity) }
        }

        /// Parameters a compiled rule may have (capacity × window within
        /// [`MAX_CAPACITY_TIMES_WINDOW`]).
        fn params() -> impl Strategy<Value = WindowParams> {
            (1u64..=86_400_000, windows()).prop_flat_map(|(window_ms, algorithm)| {
                let max_capacity = (MAX_CAPACITY_TIMES_WINDOW / window_ms).clamp(1, 1 << 40);
                (Just(window_ms), 1..=max_capacity, Just(algorithm))
                    .prop_map(|(window_ms, capacity, algorithm)| window(window_ms, capacity, algorithm))
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

            /// No panic or overflow for any stored counts (even corrupt ones
            /// far above capacity), any elapsed time and any weight; and the
            /// verdict is self-consistent.
            #[test]
            fn decide_is_total_and_consistent(
                params in params(),
                current in any::<u64>(),
                previous in any::<u64>(),
                elapsed_frac in 0.0f64..1.0,
                weight in any::<u64>(),
            ) {
                let elapsed = ((params.window_ms as f64) * elapsed_frac) as u64 % params.window_ms;
                let v = decide(Counts { current, previous }, elapsed, weight, params);
                prop_assert!(v.remaining <= params.capacity);
                if v.admitted {
                    prop_assert_eq!(v.retry_after_ms, Some(0));
                    prop_assert!(weight <= params.capacity);
                } else if weight > params.capacity {
                    prop_assert_eq!(v.retry_after_ms, None, "never admissible says so");
                } else {
                    prop_assert!(v.retry_after_ms.is_some_and(|t| t >= 1));
                }
                prop_assert!(v.reset_after_ms <= 2 * params.window_ms);
            }

            /// A counter driven through locate + decide + commit, as both
            /// stores do, by requests at increasing random times with random
            /// weights: the weight admitted in any one window (aligned, or
            /// from a first hit) never exceeds the capacity (limit × burst),
            /// a first-hit window opens at an admitted request and lasts
            /// exactly W, and with a sliding window the estimate (slots in
            /// flight: this window's and the last one's) never exceeds the
            /// capacity either.
            #[test]
            fn never_admits_more_than_capacity_in_any_window(
                window_ms in 1u64..=10_000,
                capacity in 1u64..=1_000,
                algorithm in windows(),
                start in 0u64..1_000_000_000,
                steps in proptest::collection::vec((0u64..3_000, 1u64..=50), 1..300),
            ) {
                let params = window(window_ms, capacity, algorithm);
                let mut stored = None;
                let mut now = start;
                let mut admitted_in: std::collections::HashMap<u64, u64> = Default::default();
                for (gap, weight) in steps {
                    now += gap;
                    let (window, counts, elapsed) = locate(stored, now, params);
                    let v = decide(counts, elapsed, weight, params);
                    let two_windows = matches!(algorithm, Algorithm::SlidingWindow | Algorithm::Concurrency);
                    prop_assert!(v.reset_after_ms <= window_ms || two_windows);
                    if v.admitted {
                        if algorithm == Algorithm::FirstHitWindow {
                            prop_assert!(counts.current > 0 || window == now, "a window opens at its first hit");
                            prop_assert!(now - window < window_ms);
                        }
                        let next = StoredCounter { window, current: counts.current + weight, previous: counts.previous };
                        stored = Some(next);
                        let total = admitted_in.entry(window).or_default();
                        *total += weight;
                        prop_assert!(*total <= capacity, "window {window} admitted {total} > {capacity}");
                        if algorithm == Algorithm::Concurrency {
                            // In flight: this window's and the last one's, given nothing back.
                            prop_assert!(next.current + next.previous <= capacity);
                        }
                        if algorithm == Algorithm::SlidingWindow {
                            let stored = next;
                            // estimate × W after the commit.
                            let estimate_w = u128::from(stored.current) * u128::from(window_ms)
                                + u128::from(stored.previous) * u128::from(window_ms - elapsed);
                            prop_assert!(estimate_w <= u128::from(capacity) * u128::from(window_ms));
                        }
                    }
                }
            }

            /// Denied with `retry_after_ms = t`: the same request, with nothing
            /// else counted, is admitted after exactly `t` ms and not at `t - 1`.
            #[test]
            fn retry_after_is_exact(
                window_ms in 1u64..=120_000,
                capacity in 1u64..=10_000,
                algorithm in windows(),
                fill in 0.0f64..=1.0,
                carry in 0.0f64..=1.0,
                weight_frac in 0.0f64..=1.0,
                offset_frac in 0.0f64..1.0,
            ) {
                let params = window(window_ms, capacity, algorithm);
                let current = (capacity as f64 * fill) as u64;
                let previous = (capacity as f64 * carry) as u64;
                let weight = ((capacity as f64 * weight_frac) as u64).max(1);
                let offset = ((window_ms as f64 * offset_frac) as u64).min(window_ms - 1);
                // A first-hit window's start is a tick, an aligned window's an index.
                let first_hit = algorithm == Algorithm::FirstHitWindow;
                let opened = if first_hit { 1_000 * window_ms } else { 1_000 };
                let stored = StoredCounter { window: opened, current, previous: if first_hit { 0 } else { previous } };
                let now = 1_000 * window_ms + offset;
                let at = |t: u64| {
                    let (_, counts, elapsed) = locate(Some(stored), t, params);
                    decide(counts, elapsed, weight, params)
                };
                retry_is_exact(now, at)?;
            }
        }
    }
}
