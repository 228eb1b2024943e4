//! The overload layer's arithmetic, pure: the biased coin of the hot path,
//! the drop ratios a directive's global rates call for (tenant weights and
//! floors included), and the decay of a stale directive.
//!
//! Every instance computes the same function of the same global sums, so
//! all of them arrive at the same ratios without a leader.

/// A drop probability of 1, in the fixed point the hot path compares with:
/// a ratio `p` is stored as `round(p × ONE)`.
pub const ONE: u64 = 1 << 32;

/// A ratio in `[0, 1]` as the hot path's fixed point.
pub fn to_fixed(ratio: f64) -> u64 {
    if ratio.is_nan() || ratio <= 0.0 {
        0
    } else if ratio >= 1.0 {
        ONE
    } else {
        // In (0, 2^32): the cast is exact enough and cannot overflow.
        (ratio * ONE as f64).round() as u64
    }
}

/// The golden ratio's fractional part in 64-bit fixed point: the step of
/// the coin's Weyl sequence.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The biased coin: whether the `n`-th request of a bucket is dropped at
/// fixed-point ratio `drop`. The coin walks a Weyl sequence, `seed + n ×
/// φ` modulo 1 (φ the golden ratio, `seed` random per process), and drops
/// when it falls under the ratio. Because φ is the most irrational of
/// numbers, the sequence fills `[0, 1)` as evenly as any can: over every
/// run of consecutive requests, of any length, the drops are within 4 of
/// the ratio's share (an independent coin strays by ±√N: ±50 in 10,000),
/// so a bucket keeps its rate exactly, not on average. It needs no random
/// state of its own and allocates nothing; its pattern never repeats, and
/// where a request falls in it depends on the start (the seed) and on
/// every other caller of the bucket, which no caller sees.
pub fn coin(n: u64, seed: u64, drop: u64) -> bool {
    (seed.wrapping_add(n.wrapping_mul(GOLDEN)) >> 32) < drop
}

/// One tenant's share of a bucket, as the global view saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TenantLoad {
    /// Requests per second, all instances together.
    pub rate: f64,
    /// Its drop is the bucket's ratio divided by this.
    pub weight: f64,
    /// Requests per second it always keeps.
    pub floor: f64,
}

impl TenantLoad {
    /// This tenant's drop at the bucket's base ratio `base`: `base /
    /// weight`, at most all, and never so much that it keeps less than
    /// its floor.
    pub fn drop_at(&self, base: f64) -> f64 {
        if self.rate <= 0.0 || self.rate <= self.floor {
            return 0.0;
        }
        let keep_floor = 1.0 - self.floor / self.rate;
        (base / self.weight).clamp(0.0, 1.0).min(keep_floor)
    }

    fn admitted_at(&self, base: f64) -> f64 {
        self.rate * (1.0 - self.drop_at(base))
    }
}

/// The drops of tenants sharing one bucket limited to `limit` requests
/// per second: the smallest base ratio `d` at which what the tenants keep,
/// each dropping `d / weight` (within its floor), fits the limit, and each
/// tenant's drop at it (written into `drops`, one per load). With equal
/// weights and no floors `d = (actual − limit) / actual`. Returns `d`.
pub fn shared(limit: f64, loads: &[TenantLoad], drops: &mut Vec<f64>) -> f64 {
    drops.clear();
    let total: f64 = loads.iter().map(|l| l.rate).sum();
    if total <= limit || total <= 0.0 {
        drops.extend(loads.iter().map(|_| 0.0));
        return 0.0;
    }
    let admitted = |base: f64| loads.iter().map(|l| l.admitted_at(base)).sum::<f64>();
    // At `high` every tenant drops all it may: floors can keep more than the limit.
    let (mut low, mut high) = (0.0_f64, loads.iter().map(|l| l.weight).fold(1.0, f64::max));
    if admitted(high) > limit {
        low = high;
    } else {
        for _ in 0..64 {
            let mid = (low + high) / 2.0;
            if admitted(mid) > limit {
                low = mid;
            } else {
                high = mid;
            }
        }
    }
    let base = if low == high { low } else { high };
    drops.extend(loads.iter().map(|l| l.drop_at(base)));
    base
}

/// The drop of a bucket of its own (a tenant-scoped directive): `(actual −
/// limit) / actual`, divided by the tenant's weight, within its floor.
pub fn own(limit: f64, load: TenantLoad) -> f64 {
    if load.rate <= limit {
        return 0.0;
    }
    load.drop_at((load.rate - limit) / load.rate)
}

/// How much of a directive still applies at `age_ms` since it was last
/// computed: all of it up to `max_staleness_ms`, then linearly less, none
/// after twice that. A stalled feed neither fails open nor closed at once.
pub fn freshness(age_ms: u64, max_staleness_ms: u64) -> f64 {
    if age_ms <= max_staleness_ms {
        return 1.0;
    }
    let over = (age_ms - max_staleness_ms) as f64;
    (1.0 - over / max_staleness_ms.max(1) as f64).max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(rate: f64, weight: f64, floor: f64) -> TenantLoad {
        TenantLoad { rate, weight, floor }
    }

    #[test]
    fn the_coin_drops_the_ratio_it_is_given() {
        for ratio in [0.0, 0.1, 2.0 / 3.0, 0.999, 1.0] {
            let fixed = to_fixed(ratio);
            let dropped = (0..100_000u64).filter(|&n| coin(n, 42, fixed)).count() as f64 / 100_000.0;
            assert!((dropped - ratio).abs() < 0.001, "{ratio}: dropped {dropped}");
        }
        assert_eq!(to_fixed(f64::NAN), 0);
        assert_eq!(to_fixed(-1.0), 0);
        assert_eq!(to_fixed(7.0), ONE);
    }

    /// Not only on average: every run of consecutive requests, short or
    /// long, from any start and seed, drops its share within 4 (an
    /// independent coin at 1/2 strays by ±50 in 10,000 requests, ±5 in 100).
    #[test]
    fn every_run_of_requests_drops_its_share() {
        for ratio in [0.1, 1.0 / 3.0, 0.37, 0.5, 2.0 / 3.0, 0.9, 0.999] {
            let fixed = to_fixed(ratio);
            for seed in [0, 42, 0xdead_beef_cafe_babe, u64::MAX] {
                for start in [0, 12_345, 1 << 40, u64::MAX - 5_000] {
                    // dropped[i]: drops among the first i requests from `start`.
                    let mut dropped = vec![0u32];
                    for i in 0..20_000u64 {
                        let n = start.wrapping_add(i);
                        dropped.push(dropped[dropped.len() - 1] + u32::from(coin(n, seed, fixed)));
                    }
                    for len in [7usize, 10, 100, 1_000, 10_000] {
                        for from in (0..20_000 - len).step_by(13) {
                            let got = f64::from(dropped[from + len] - dropped[from]);
                            let share = len as f64 * fixed as f64 / ONE as f64;
                            assert!(
                                (got - share).abs() <= 4.0,
                                "ratio {ratio}, seed {seed}, start {start}: {got} dropped of {len} from {from}, share {share}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn equal_tenants_drop_the_excess_share() {
        let mut drops = Vec::new();
        let base = shared(10_000.0, &[load(30_000.0, 1.0, 0.0)], &mut drops);
        assert!((base - 2.0 / 3.0).abs() < 1e-9, "{base}");
        assert!((drops[0] - 2.0 / 3.0).abs() < 1e-9);
        assert_eq!(shared(10_000.0, &[load(9_000.0, 1.0, 0.0)], &mut drops), 0.0);
        assert_eq!(drops, vec![0.0]);
    }

    #[test]
    fn weights_divide_the_ratio_and_the_sum_fits_the_limit() {
        let loads = [load(10_000.0, 4.0, 0.0), load(10_000.0, 0.25, 0.0)];
        let mut drops = Vec::new();
        let base = shared(10_000.0, &loads, &mut drops);
        let admitted: f64 = loads.iter().zip(&drops).map(|(l, d)| l.rate * (1.0 - d)).sum();
        assert!((admitted - 10_000.0).abs() < 1e-3, "{admitted}");
        assert!((drops[0] - (base / 4.0).min(1.0)).abs() < 1e-9);
        assert!(drops[1] > drops[0] * 4.0 - 1e-9, "the free tier drops more: {drops:?}");
        // A noisy free tier cannot crowd out the paying one.
        let noisy = [load(10_000.0, 4.0, 0.0), load(1_000_000.0, 0.25, 0.0)];
        shared(10_000.0, &noisy, &mut drops);
        assert!(drops[0] < 0.25, "the paying tenant keeps most: {drops:?}");
    }

    #[test]
    fn floors_are_kept() {
        let loads = [load(500.0, 1.0, 1_000.0), load(100_000.0, 1.0, 2_000.0)];
        let mut drops = Vec::new();
        shared(1_000.0, &loads, &mut drops);
        assert_eq!(drops[0], 0.0, "under its floor: never dropped");
        assert!((100_000.0 * (1.0 - drops[1]) - 2_000.0).abs() < 1e-6, "keeps its floor: {drops:?}");
        assert_eq!(own(10.0, load(5.0, 1.0, 0.0)), 0.0);
        assert!((own(10.0, load(40.0, 1.0, 0.0)) - 0.75).abs() < 1e-12);
        assert!((own(10.0, load(40.0, 3.0, 0.0)) - 0.25).abs() < 1e-12);
        assert!((own(10.0, load(40.0, 1.0, 20.0)) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn a_stale_directive_decays_to_nothing() {
        assert_eq!(freshness(0, 30_000), 1.0);
        assert_eq!(freshness(30_000, 30_000), 1.0);
        assert!((freshness(45_000, 30_000) - 0.5).abs() < 1e-12);
        assert_eq!(freshness(60_000, 30_000), 0.0);
        assert_eq!(freshness(u64::MAX, 30_000), 0.0);
    }
}
