//! The token bucket and GCRA as pure integer arithmetic.
//!
//! Both admit the same requests: a bucket of `capacity` tokens (the burst,
//! `floor(limit * burst_capacity)`) refilled at `rate` tokens (the rule's
//! `limit`) per `window_ms`, and a request of weight `n` takes `n` tokens
//! when it finds them. They differ in what they store:
//!
//! - **token bucket**: its debt (below) and when it was last refilled;
//! - **GCRA**: one timestamp, the theoretical arrival time (TAT) at which
//!   the bucket will be full again.
//!
//! Everything is computed in *units*: one token is `window_ms` units and
//! one ms refills `rate` units, so the refill of any whole number of ms is
//! an integer and `retry_after_ms` is exact. Both stores reduce their state
//! to the bucket's **debt** at `now` (units missing from a full bucket: 0
//! when full), call [`decide`], and store the new debt back in their own
//! form. Admission keeps the debt at most a full bucket (`capacity *
//! window_ms`); a usage report (`Count::Always`) may push it further, up to
//! [`MAX_DEBT`], and the bucket then admits nothing until it has refilled
//! past the overdraft. The Lua side (`scripts/decide_batch.lua`) does the
//! same on doubles; every quantity stays below 2^53 (a debt of at most
//! 2^51 plus a request of at most a full bucket ≤ 2^51), and GCRA stores
//! its TAT as whole ms plus a remainder in units.
//!
//! In any interval of `t` ms the weight admitted is at most
//! `capacity + rate * t / window_ms` (the property tests check it).

use super::window::{Algorithm, MAX_CAPACITY_TIMES_WINDOW, Verdict, WindowParams};

/// The most debt a bucket carries, in units: reports past a full bucket are
/// clamped here (2^51, like a rule's largest full bucket).
pub const MAX_DEBT: u64 = MAX_CAPACITY_TIMES_WINDOW;

/// The fixed parameters of one bucket rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketParams {
    /// The refill period `W` in ms (or ticks), at least 1.
    pub window_ms: u64,
    /// Tokens refilled per `window_ms`, at least 1.
    pub rate: u64,
    /// Tokens the bucket holds when full (the burst), at least 1.
    pub capacity: u64,
}

impl WindowParams {
    /// The bucket view of these parameters.
    pub fn bucket(self) -> BucketParams {
        BucketParams { window_ms: self.window_ms, rate: self.rate.max(1), capacity: self.capacity }
    }
}

impl BucketParams {
    /// Units in a full bucket: `capacity * window_ms` (at most 2^51 for a
    /// validated rule; saturating for any other).
    pub fn full(self) -> u64 {
        self.capacity.saturating_mul(self.window_ms)
    }

    /// Ms (or ticks) that pay back the largest debt: `ceil(MAX_DEBT / rate)`.
    fn payback_time(self) -> u64 {
        MAX_DEBT.div_ceil(self.rate.max(1))
    }
}

// All arithmetic is in u64: a debt never exceeds `MAX_DEBT` (2^51), a
// weight over the capacity is answered before it is multiplied, and an
// elapsed time is clamped to the payback time before it is.

/// Decides a request of `weight` against a bucket `debt` units short of
/// full (clamped to [`MAX_DEBT`]). Returns the verdict and the debt to
/// store: `debt + weight * W` when admitted, `debt` when not (a denied
/// request consumes nothing).
pub fn decide(debt: u64, weight: u64, params: BucketParams) -> (Verdict, u64) {
    let full = params.full();
    let w = params.window_ms.max(1);
    let rate = params.rate.max(1);
    let debt = debt.min(MAX_DEBT);
    if weight > params.capacity {
        let verdict = Verdict {
            admitted: false,
            remaining: full.saturating_sub(debt) / w,
            retry_after_ms: None,
            reset_after_ms: debt.div_ceil(rate),
        };
        return (verdict, debt);
    }
    let need = weight * w;
    let admitted = debt + need <= full;
    let after = if admitted { debt + need } else { debt };
    let retry_after_ms = if admitted { 0 } else { (debt + need - full).div_ceil(rate) };
    let verdict = Verdict {
        admitted,
        remaining: full.saturating_sub(after) / w,
        retry_after_ms: Some(retry_after_ms),
        reset_after_ms: after.div_ceil(rate),
    };
    (verdict, after)
}

/// The debt after `weight` is counted whatever is left (a report), clamped
/// to [`MAX_DEBT`].
pub fn report(debt: u64, weight: u64, params: BucketParams) -> u64 {
    debt.saturating_add(weight.saturating_mul(params.window_ms.max(1))).min(MAX_DEBT)
}

/// The debt at `now_ms` of a token bucket that owed `debt` units at
/// `last_ms`: paid back by `rate` units per ms since, down to 0. A clock
/// that went backwards pays back nothing.
pub fn token_bucket_debt(debt: u64, last_ms: u64, now_ms: u64, params: BucketParams) -> u64 {
    let elapsed = now_ms.saturating_sub(last_ms).min(params.payback_time());
    debt.min(MAX_DEBT).saturating_sub(elapsed * params.rate.max(1))
}

/// The debt at `now_ms` of a GCRA bucket whose TAT is `tat_ms` whole ms
/// plus `tat_rem` units: how far the TAT lies ahead of now, in units,
/// clamped to [`MAX_DEBT`] (a clock that went backwards cannot create more
/// debt than that).
pub fn gcra_debt(tat_ms: u64, tat_rem: u64, now_ms: u64, params: BucketParams) -> u64 {
    if tat_ms < now_ms {
        return 0;
    }
    let ahead = tat_ms - now_ms;
    if ahead > params.payback_time() {
        return MAX_DEBT;
    }
    (ahead * params.rate.max(1)).saturating_add(tat_rem).min(MAX_DEBT)
}

/// A GCRA bucket's state after a decision at `now_ms` left `debt`: the new
/// TAT as `(tat_ms, tat_rem)`.
pub fn gcra_state(debt: u64, now_ms: u64, params: BucketParams) -> (u64, u64) {
    let rate = params.rate.max(1);
    (now_ms.saturating_add(debt / rate), debt % rate)
}

/// The debt at `now_ms` of a bucket stored as `(stamp, value)`, the two
/// fields both stores keep for it: a token bucket's (last refill, debt
/// then), GCRA's (TAT in whole ms, remainder).
pub fn debt_of(algorithm: Algorithm, stamp: u64, value: u64, now_ms: u64, params: BucketParams) -> u64 {
    match algorithm {
        Algorithm::Gcra => gcra_debt(stamp, value, now_ms, params),
        _ => token_bucket_debt(value, stamp, now_ms, params),
    }
}

/// The `(stamp, value)` to store after a decision at `now_ms` left `debt`.
pub fn state_of(algorithm: Algorithm, debt: u64, now_ms: u64, params: BucketParams) -> (u64, u64) {
    match algorithm {
        Algorithm::Gcra => gcra_state(debt, now_ms, params),
        _ => (now_ms, debt),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bucket as a store drives it, in either representation.
    #[derive(Debug, Clone, Copy)]
    enum Stored {
        Bucket { debt: u64, last_ms: u64 },
        Gcra { tat_ms: u64, tat_rem: u64 },
    }

    impl Stored {
        fn empty_bucket() -> Self {
            Stored::Bucket { debt: 0, last_ms: 0 }
        }

        fn debt(self, now_ms: u64, params: BucketParams) -> u64 {
            match self {
                Stored::Bucket { debt, last_ms } => token_bucket_debt(debt, last_ms, now_ms, params),
                Stored::Gcra { tat_ms, tat_rem } => gcra_debt(tat_ms, tat_rem, now_ms, params),
            }
        }

        fn store(&mut self, debt: u64, now_ms: u64, params: BucketParams) {
            *self = match self {
                Stored::Bucket { .. } => Stored::Bucket { debt, last_ms: now_ms },
                Stored::Gcra { .. } => {
                    let (tat_ms, tat_rem) = gcra_state(debt, now_ms, params);
                    Stored::Gcra { tat_ms, tat_rem }
                }
            };
        }

        fn hit(&mut self, now_ms: u64, weight: u64, params: BucketParams) -> Verdict {
            let (verdict, after) = decide(self.debt(now_ms, params), weight, params);
            if verdict.admitted {
                self.store(after, now_ms, params);
            }
            verdict
        }

        fn report(&mut self, now_ms: u64, weight: u64, params: BucketParams) {
            let after = report(self.debt(now_ms, params), weight, params);
            self.store(after, now_ms, params);
        }
    }

    fn params(window_ms: u64, rate: u64, capacity: u64) -> BucketParams {
        BucketParams { window_ms, rate, capacity }
    }

    #[test]
    fn a_full_bucket_admits_the_burst_then_refills_at_the_rate() {
        // 10 per second, burst 20.
        let p = params(1_000, 10, 20);
        for mut stored in [Stored::empty_bucket(), Stored::Gcra { tat_ms: 0, tat_rem: 0 }] {
            let now = 1_000_000;
            for left in (0..20).rev() {
                let v = stored.hit(now, 1, p);
                assert!(v.admitted);
                assert_eq!(v.remaining, left);
            }
            let denied = stored.hit(now, 1, p);
            assert!(!denied.admitted);
            assert_eq!(denied.retry_after_ms, Some(100), "one token every 100 ms");
            assert_eq!(denied.reset_after_ms, 2_000, "full again in 2 s");
            assert!(!stored.hit(now + 99, 1, p).admitted);
            assert!(stored.hit(now + 100, 1, p).admitted);
            // Half a second later: five more tokens, no more.
            let later = now + 600;
            for _ in 0..5 {
                assert!(stored.hit(later, 1, p).admitted);
            }
            assert!(!stored.hit(later, 1, p).admitted);
        }
    }

    #[test]
    fn a_weight_over_the_burst_is_never_admitted_and_consumes_nothing() {
        let p = params(1_000, 10, 20);
        let mut stored = Stored::Gcra { tat_ms: 0, tat_rem: 0 };
        let v = stored.hit(5_000, 21, p);
        assert!(!v.admitted);
        assert_eq!(v.retry_after_ms, None);
        assert_eq!(v.remaining, 20);
        assert!(stored.hit(5_000, 20, p).admitted);
    }

    #[test]
    fn fractional_rates_stay_exact() {
        // 3 per 1000 ms: a token every 333.33 ms.
        let p = params(1_000, 3, 1);
        let mut stored = Stored::Gcra { tat_ms: 0, tat_rem: 0 };
        assert!(stored.hit(10_000, 1, p).admitted);
        let denied = stored.hit(10_000, 1, p);
        assert_eq!(denied.retry_after_ms, Some(334), "ceil(1000 / 3)");
        assert!(!stored.hit(10_333, 1, p).admitted);
        assert!(stored.hit(10_334, 1, p).admitted);
        // The bucket was full from 10_333.33: what refilled past full is
        // lost, so the next token is due 333.33 ms after 10_334.
        assert!(!stored.hit(10_667, 1, p).admitted);
        assert!(stored.hit(10_668, 1, p).admitted);
        // Two tokens of a larger bucket, 3 ms apart, leave exactly 1000 - 9
        // units of debt behind the second: the remainder is kept.
        let p = params(1_000, 3, 2);
        let mut stored = Stored::Gcra { tat_ms: 0, tat_rem: 0 };
        assert!(stored.hit(20_000, 1, p).admitted);
        assert!(stored.hit(20_003, 1, p).admitted);
        assert_eq!(stored.debt(20_003, p), 2_000 - 9);
        assert_eq!(stored.hit(20_003, 1, p).retry_after_ms, Some(331), "ceil(991 / 3)");
    }

    #[test]
    fn a_report_overdraws_the_bucket_and_it_pays_the_overdraft_back_at_the_rate() {
        // 10 per second, burst 20: a report of 50 leaves a debt of 30 tokens past empty.
        let p = params(1_000, 10, 20);
        for mut stored in [Stored::empty_bucket(), Stored::Gcra { tat_ms: 0, tat_rem: 0 }] {
            let now = 1_000_000;
            stored.report(now, 50, p);
            assert_eq!(stored.debt(now, p), 50_000);
            let denied = stored.hit(now, 1, p);
            assert!(!denied.admitted);
            assert_eq!(denied.remaining, 0);
            // 30 tokens of overdraft and one for the request: 3.1 s.
            assert_eq!(denied.retry_after_ms, Some(3_100));
            assert_eq!(denied.reset_after_ms, 5_000);
            assert!(!stored.hit(now + 3_099, 1, p).admitted);
            assert!(stored.hit(now + 3_100, 1, p).admitted);
        }
    }

    #[test]
    fn reports_are_clamped_at_the_largest_debt() {
        let p = params(1_000, 10, 20);
        for mut stored in [Stored::empty_bucket(), Stored::Gcra { tat_ms: 0, tat_rem: 0 }] {
            stored.report(7, u64::MAX, p);
            stored.report(7, u64::MAX, p);
            assert_eq!(stored.debt(7, p), MAX_DEBT);
            let v = stored.hit(7, 1, p);
            assert_eq!(v.retry_after_ms, Some((MAX_DEBT + 1_000 - 20_000).div_ceil(10)));
        }
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;
        use crate::limiter::window::{MAX_CAPACITY_TIMES_WINDOW, tests::properties::retry_is_exact};

        fn bucket_params() -> impl Strategy<Value = BucketParams> {
            (1u64..=120_000, 1u64..=1_000, 1u64..=1_000).prop_map(|(window_ms, rate, capacity)| {
                let capacity = capacity.max(1).min(MAX_CAPACITY_TIMES_WINDOW / window_ms);
                BucketParams { window_ms, rate, capacity }
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 1_000, ..ProptestConfig::default() })]

            /// Both representations decide alike, and in every interval
            /// [t_i, t_j] the weight admitted is at most
            /// capacity + rate * (t_j - t_i) / W.
            #[test]
            fn never_admits_more_than_burst_plus_rate_times_t(
                p in bucket_params(),
                start in 0u64..1_000_000_000,
                steps in proptest::collection::vec((0u64..2_000, 1u64..=20), 1..200),
            ) {
                let mut bucket = Stored::empty_bucket();
                let mut gcra = Stored::Gcra { tat_ms: 0, tat_rem: 0 };
                let mut now = start;
                let mut admitted: Vec<(u64, u64)> = Vec::new();
                for (gap, weight) in steps {
                    now += gap;
                    let a = bucket.hit(now, weight, p);
                    let b = gcra.hit(now, weight, p);
                    prop_assert_eq!(a, b, "token bucket and GCRA disagree at {}", now);
                    if a.admitted {
                        admitted.push((now, weight));
                    }
                }
                for i in 0..admitted.len() {
                    let mut sum = 0u128;
                    for j in i..admitted.len() {
                        sum += u128::from(admitted[j].1);
                        let t = u128::from(admitted[j].0 - admitted[i].0);
                        prop_assert!(
                            sum * u128::from(p.window_ms) <= u128::from(p.full()) + t * u128::from(p.rate),
                            "{} admitted in {} ms", sum, t
                        );
                    }
                }
            }

            /// Denied with `retry_after_ms = t`: admitted after exactly `t`
            /// ms with nothing else counted, and not at `t - 1`.
            #[test]
            fn retry_after_is_exact(
                p in bucket_params(),
                debt_frac in 0.0f64..=1.0,
                weight_frac in 0.0f64..=1.0,
            ) {
                let now = 5_000_000_000u64;
                let debt = (p.full() as f64 * debt_frac) as u64;
                let (tat_ms, tat_rem) = gcra_state(debt, now, p);
                let weight = ((p.capacity as f64 * weight_frac) as u64).max(1);
                retry_is_exact(now, |t| decide(gcra_debt(tat_ms, tat_rem, t, p), weight, p).0)?;
            }

            /// Any state, any time (clocks going backwards included), any
            /// weight: no panic, and a consistent verdict.
            #[test]
            fn decide_is_total(
                p in bucket_params(),
                level in any::<u64>(),
                stamp in any::<u64>(),
                now in any::<u64>(),
                weight in any::<u64>(),
            ) {
                for debt in [token_bucket_debt(level, stamp, now, p), gcra_debt(stamp, level, now, p)] {
                    prop_assert!(debt <= MAX_DEBT);
                    let (v, after) = decide(debt, weight, p);
                    prop_assert!(v.remaining <= p.capacity && after <= MAX_DEBT);
                    prop_assert!(!v.admitted || after <= p.full());
                    prop_assert_eq!(v.admitted, v.retry_after_ms == Some(0));
                    prop_assert!(report(debt, weight, p) <= MAX_DEBT);
                }
            }

            /// Reports and admissions mixed: both representations agree,
            /// and what is admitted plus what is reported in any interval
            /// stays within capacity + rate * t / W.
            #[test]
            fn reports_count_against_the_same_bound(
                p in bucket_params(),
                start in 0u64..1_000_000_000,
                steps in proptest::collection::vec((0u64..2_000, 1u64..=40, any::<bool>()), 1..200),
            ) {
                let mut bucket = Stored::empty_bucket();
                let mut gcra = Stored::Gcra { tat_ms: 0, tat_rem: 0 };
                let mut now = start;
                let mut counted: Vec<(u64, u64, bool)> = Vec::new();
                for (gap, weight, is_report) in steps {
                    now += gap;
                    if is_report {
                        bucket.report(now, weight, p);
                        gcra.report(now, weight, p);
                        counted.push((now, weight, true));
                    } else {
                        let a = bucket.hit(now, weight, p);
                        let b = gcra.hit(now, weight, p);
                        prop_assert_eq!(a, b, "token bucket and GCRA disagree at {}", now);
                        if a.admitted {
                            counted.push((now, weight, false));
                        }
                    }
                    prop_assert_eq!(bucket.debt(now, p), gcra.debt(now, p));
                }
                // Every admission at t_j fits: the weight counted in
                // [t_i, t_j] is at most capacity + rate * (t_j - t_i) / W.
                for j in 0..counted.len() {
                    if counted[j].2 {
                        continue;
                    }
                    let mut sum = 0u128;
                    for i in (0..=j).rev() {
                        sum += u128::from(counted[i].1);
                        let t = u128::from(counted[j].0 - counted[i].0);
                        prop_assert!(
                            sum * u128::from(p.window_ms) <= u128::from(p.full()) + t * u128::from(p.rate),
                            "{} counted in {} ms before an admission", sum, t
                        );
                    }
                }
            }
        }
    }
}
