//! The shares of a bucket: demand followed, capacity moved only once its
//! holder lets go, and what the holders may admit bounded, over any order
//! of reports.

use proptest::prelude::*;

use super::*;
use crate::clock::ManualClock;

const LIMIT: (u64, u64) = (300, 10);

fn quotas() -> (BucketShares, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(1_800_000_000_000));
    (BucketShares::new(RlqsConfig::default(), clock.clone()), clock)
}

fn key(id: &str) -> BucketKey {
    BucketKey { domain: Arc::from("edge"), id: Box::from(id) }
}

/// A report of `allowed` and `denied` over a second.
fn usage(allowed: u64, denied: u64) -> Usage {
    Usage { allowed, denied, elapsed_ms: 1_000 }
}

#[test]
fn the_limit_follows_demand_and_moves_only_once_its_holder_lets_go() {
    let (quotas, clock) = quotas();
    let bucket = key("route=chat");
    // A alone, 100 a second (1,000 a window): all that is shared out,
    // 300 less the bursts (6) and one token per holder.
    assert_eq!(quotas.share(1, &bucket, LIMIT, usage(100, 0)), Some(293));
    // B joins with the same demand: nothing is free while A may enforce 293.
    clock.advance(1_000);
    assert_eq!(quotas.share(2, &bucket, LIMIT, usage(100, 0)), Some(0));
    // A reports again: lowered to its fair half.
    clock.advance(1_000);
    assert_eq!(quotas.share(1, &bucket, LIMIT, usage(30, 70)), Some(146));
    // Its lower share confirmed by its next report, B gets the rest.
    clock.advance(1_000);
    assert_eq!(quotas.share(1, &bucket, LIMIT, usage(14, 86)), Some(146));
    clock.advance(1_000);
    assert_eq!(quotas.share(2, &bucket, LIMIT, usage(0, 100)), Some(146));
    // Demand gone from A; A's assignment expires (20 s, the skew, a
    // window): B gets what A held.
    clock.advance(32_001);
    assert_eq!(quotas.share(2, &bucket, LIMIT, usage(14, 86)), Some(293));
    assert_eq!(quotas.lock()[&bucket].holders, [2], "A is forgotten");
}

#[test]
fn buckets_are_bounded_as_a_whole_and_the_idle_are_forgotten() {
    let clock = Arc::new(ManualClock::new(0));
    let settings = RlqsConfig { max_buckets: 2, ..RlqsConfig::default() };
    let quotas = BucketShares::new(settings, clock.clone());
    assert!(quotas.share(1, &key("a"), LIMIT, usage(1, 0)).is_some());
    assert!(quotas.share(1, &key("b"), LIMIT, usage(1, 0)).is_some());
    assert_eq!(quotas.share(2, &key("c"), LIMIT, usage(1, 0)), None, "full");
    assert!(quotas.share(2, &key("a"), LIMIT, usage(1, 0)).is_some(), "a known bucket is still shared");
    clock.advance(60_000);
    assert!(quotas.share(2, &key("c"), LIMIT, usage(1, 0)).is_some(), "the idle make room");
    assert_eq!(quotas.len(), 1);
}

proptest! {
    /// Whatever the demands and the order of reports, what the holders
    /// may admit in a window (what they may enforce, and a burst where an
    /// assignment changes) sums to at most the limit and one request per
    /// holder.
    #[test]
    fn what_the_holders_may_admit_stays_within_the_limit_and_a_token_each(
        reports in proptest::collection::vec((0usize..3, 0u64..400, 0u64..400, 0u64..4_000), 1..60),
    ) {
        let (quotas, clock) = quotas();
        let bucket = key("k");
        for holder in 0..3 {
            quotas.share(holder, &bucket, LIMIT, usage(0, 0));
        }
        for (holder, allowed, denied, wait) in reports {
            clock.advance(wait);
            quotas.share(holder as u64, &bucket, LIMIT, usage(allowed, denied)).unwrap();
            let now = clock.now_ms();
            let table = quotas.lock();
            let shared = &table[&bucket];
            // What each may admit in a window: its share, and its bucket's
            // burst once more when its share changes.
            let most: u64 = shared
                .states
                .iter()
                .map(|s| s.held(now, 1_000, 10_000))
                .map(|held| if held == 0 { 0 } else { held + strategy::burst(held) })
                .sum();
            let holders = shared.holders.len() as u64;
            prop_assert!(most <= 300 + holders, "{most} with {holders} holders");
        }
    }
}
