//! What an Envoy is told to enforce for its share of a bucket's limit: a
//! token bucket (the only strategy Envoy's filter enforces besides the
//! blanket rules), sized so that it admits at most its share in any
//! window.
//!
//! Envoy refills its bucket continuously at `tokens_per_fill /
//! fill_interval` (the interval read in whole seconds), starting full. Over
//! any span of one window `W` it admits at most `max_tokens + rate × W`:
//! with `max_tokens = c` and `tokens_per_fill = s − c` per `W`, exactly the
//! share `s`. A new assignment starts a new, full bucket: in the window of
//! the change an Envoy admits at most the larger share and `c` more, which
//! the allocator sets aside ([`burst`]).

/// One part in this many of a share is the bucket's burst (`max_tokens`).
pub const BURST_DIVISOR: u64 = 50;

/// The burst of a share `s`: `max(1, s / 50)` tokens.
pub fn burst(share: u64) -> u64 {
    (share / BURST_DIVISOR).max(1)
}

/// A token bucket for Envoy: `max_tokens`, `tokens_per_fill` every
/// `fill_interval_s` seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bucket {
    /// The burst: what it holds when full.
    pub max_tokens: u32,
    /// Tokens added per interval.
    pub tokens_per_fill: u32,
    /// The interval, whole seconds.
    pub fill_interval_s: u64,
}

/// What an Envoy enforces for a share of `share` requests per window of
/// `window_s` seconds: `None` for a share of 0 (deny all). A share of 1
/// refills once in two windows (its burst is the one request).
pub fn bucket(share: u64, window_s: u64) -> Option<Bucket> {
    if share == 0 {
        return None;
    }
    let window_s = window_s.max(1);
    // An Envoy limit is at most u32::MAX per window, and so is a share.
    let share = share.min(u64::from(u32::MAX));
    let max_tokens = burst(share);
    let (per_window, interval) = match share - max_tokens {
        0 => (1, window_s.saturating_mul(2)),
        more => (more, window_s),
    };
    Some(Bucket {
        max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
        tokens_per_fill: u32::try_from(per_window).unwrap_or(u32::MAX),
        fill_interval_s: interval,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The most the bucket admits in any span of `window_s` seconds:
    /// full, then refilled continuously.
    fn most_in_a_window(b: Bucket, window_s: u64) -> f64 {
        f64::from(b.max_tokens) + f64::from(b.tokens_per_fill) * window_s as f64 / b.fill_interval_s as f64
    }

    #[test]
    fn a_share_becomes_a_bucket_that_admits_it_per_window() {
        assert_eq!(bucket(0, 10), None);
        assert_eq!(
            bucket(300, 10),
            Some(Bucket { max_tokens: 6, tokens_per_fill: 294, fill_interval_s: 10 })
        );
        assert_eq!(bucket(1, 60), Some(Bucket { max_tokens: 1, tokens_per_fill: 1, fill_interval_s: 120 }));
        assert_eq!(bucket(2, 60), Some(Bucket { max_tokens: 1, tokens_per_fill: 1, fill_interval_s: 60 }));
    }

    proptest! {
        #[test]
        fn no_window_admits_more_than_the_share_but_a_share_of_one(
            share in 1u64..=u64::from(u32::MAX),
            window_s in prop_oneof![Just(1u64), Just(60), Just(3_600), Just(86_400)],
        ) {
            let b = bucket(share, window_s).unwrap();
            let most = most_in_a_window(b, window_s);
            prop_assert!(most <= share.max(2) as f64 * 1.000_001, "{b:?}: {most} of {share}");
            // Steady state: at least 97 % of a share of 100 and more.
            if share >= 100 {
                let rate = f64::from(b.tokens_per_fill) * window_s as f64 / b.fill_interval_s as f64;
                prop_assert!(rate >= 0.97 * share as f64, "{b:?}: {rate} of {share}");
            }
        }
    }
}
