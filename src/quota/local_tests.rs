//! The shares of a bucket: demand followed, capacity moved only once its
//! holder lets go, and what the holders may admit bounded, over any order
//! of reports.

use proptest::prelude::*;

use super::*;
use crate::clock::{Clock, ManualClock};

const LIMIT: BucketLimit = BucketLimit { limit: 300, window_ms: 10_000 };

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

/// An Envoy's stream: its holder id and its live assignment, as
/// `api::rlqs` keeps them.
struct Envoy {
    id: Arc<str>,
    assigned: Option<(u64, u64)>,
    recent: Recent,
}

impl Envoy {
    fn new(id: &str) -> Self {
        Envoy { id: Arc::from(id), assigned: None, recent: Recent::default() }
    }

    /// Reports `usage` of `bucket` at the clock's time and keeps the share.
    fn report(
        &mut self,
        quotas: &BucketShares,
        clock: &ManualClock,
        bucket: &BucketKey,
        usage: Usage,
    ) -> Option<u64> {
        let now = clock.now_ms();
        let live = self.assigned.filter(|(_, until)| now < *until).map(|(share, _)| share);
        let admitted = self.recent.add(now, (usage.allowed, usage.elapsed_ms), live, LIMIT.window_ms);
        let share = quotas.share(&self.id, bucket, LIMIT, usage.holding(live, admitted, LIMIT.window_ms))?;
        self.assigned = Some((share, now + quotas.settings().assignment_ttl_ms));
        Some(share)
    }
}

#[test]
fn the_limit_follows_demand_and_moves_only_once_its_holder_lets_go() {
    let (quotas, clock) = quotas();
    let bucket = key("route=chat");
    let (mut a, mut b) = (Envoy::new("a"), Envoy::new("b"));
    // A alone, wanting 100 a second (1,000 a window), denied all before
    // its first assignment: all that is shared out, 300 less the bursts
    // (6) and one token per holder.
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(0, 100)), Some(293));
    // B joins with the same demand: nothing is free while A may enforce 293.
    clock.advance(1_000);
    assert_eq!(b.report(&quotas, &clock, &bucket, usage(0, 100)), Some(0));
    // A reports again: lowered to its fair half.
    clock.advance(1_000);
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(30, 70)), Some(146));
    // Its lower share confirmed by its next report, B gets the rest.
    clock.advance(1_000);
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(14, 86)), Some(146));
    clock.advance(1_000);
    assert_eq!(b.report(&quotas, &clock, &bucket, usage(0, 100)), Some(146));
    // Demand gone from A; A's assignment expires (20 s, the skew, a
    // window): B gets what A held.
    clock.advance(32_001);
    assert_eq!(b.report(&quotas, &clock, &bucket, usage(14, 86)), Some(293));
    let holders: Vec<Arc<str>> = quotas.lock()[&bucket].holders.keys().cloned().collect();
    assert_eq!(holders, [Arc::from("b")], "A is forgotten");
}

#[test]
fn what_an_envoy_admitted_in_the_window_is_held_after_it_lets_go() {
    let (quotas, clock) = quotas();
    let bucket = key("route=chat");
    let (mut a, mut b) = (Envoy::new("a"), Envoy::new("b"));
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(0, 100)), Some(293));
    clock.advance(1_000);
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(250, 0)), Some(293));
    clock.advance(1_000);
    assert_eq!(b.report(&quotas, &clock, &bucket, usage(0, 100)), Some(0));
    // A's demand is gone: lowered to nothing, which it then enforces.
    clock.advance(1_000);
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(0, 0)), Some(0));
    clock.advance(1_000);
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(0, 0)), Some(0));
    // The 250 it admitted a few seconds ago are still in the window: B
    // gets only the rest.
    clock.advance(1_000);
    assert_eq!(b.report(&quotas, &clock, &bucket, usage(0, 100)), Some(292 - 250));
    // Once they have left the window (A's next report says so), all of it.
    clock.advance(6_000);
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(0, 0)), Some(0));
    assert_eq!(b.report(&quotas, &clock, &bucket, usage(0, 100)), Some(292));
}

#[test]
fn a_window_counts_every_report_received_in_it_and_merges_the_oldest() {
    let mut recent = Recent::default();
    // Shares unknown: every report received in the window counts whole.
    assert_eq!(recent.add(0, (5, 5_000), None, 10_000), 5);
    assert_eq!(recent.add(5_000, (7, 5_000), None, 10_000), 12);
    assert_eq!(recent.add(9_999, (1, 5_000), None, 10_000), 13, "the first still ends in the window");
    assert_eq!(recent.add(10_000, (0, 1), None, 10_000), 8, "the first left it");
    // A day's window remembers 16 reports, the oldest merged: nothing lost.
    let mut day = Recent::default();
    let total: u64 = (1..=100).map(|i| day.add(i * 5_000, (1, 5_000), None, 86_400_000)).last().unwrap();
    assert_eq!(total, 100);
    assert_eq!(day.reports.len(), RECENT_REPORTS);
}

#[test]
fn a_report_that_only_ends_in_the_window_counts_what_its_share_could_admit_there() {
    // 140 admitted over 5 s at a share of 300 per 10 s; 3 ms of it in the
    // window: at most two bursts (6 each), 300 × 3 / 10,000 (0) and a
    // token.
    let mut recent = Recent::default();
    recent.add(5_000, (140, 5_000), Some(300), 10_000);
    recent.add(10_000, (145, 5_000), Some(300), 10_000);
    assert_eq!(recent.add(14_997, (150, 5_000), Some(300), 10_000), 13 + 145 + 150);
    // Whole once its time is all in the window.
    let mut recent = Recent::default();
    recent.add(5_000, (140, 5_000), Some(300), 10_000);
    assert_eq!(recent.add(10_000, (145, 5_000), Some(300), 10_000), 140 + 145);
}

#[test]
fn an_envoy_without_an_assignment_on_its_stream_holds_what_it_admits() {
    // A's stream broke; its Envoy keeps enforcing what it was assigned
    // (it admits 200 a window) and reports on a new stream: until its
    // first answer there it is counted as holding that.
    let (quotas, clock) = quotas();
    let bucket = key("route=chat");
    let (mut a, mut b) = (Envoy::new("a-again"), Envoy::new("b"));
    assert_eq!(a.report(&quotas, &clock, &bucket, usage(20, 0)), Some(293));
    clock.advance(1_000);
    assert_eq!(b.report(&quotas, &clock, &bucket, usage(0, 100)), Some(0), "A may enforce 293");
}

#[test]
fn buckets_are_bounded_as_a_whole_and_the_idle_are_forgotten() {
    let clock = Arc::new(ManualClock::new(0));
    let settings = RlqsConfig { max_buckets: 2, ..RlqsConfig::default() };
    let quotas = BucketShares::new(settings, clock.clone());
    let (mut one, mut two) = (Envoy::new("1"), Envoy::new("2"));
    assert!(one.report(&quotas, &clock, &key("a"), usage(1, 0)).is_some());
    assert!(one.report(&quotas, &clock, &key("b"), usage(1, 0)).is_some());
    assert_eq!(two.report(&quotas, &clock, &key("c"), usage(1, 0)), None, "full");
    assert!(two.report(&quotas, &clock, &key("a"), usage(1, 0)).is_some(), "a known bucket is still shared");
    clock.advance(60_000);
    assert!(two.report(&quotas, &clock, &key("c"), usage(1, 0)).is_some(), "the idle make room");
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
        let mut envoys: Vec<Envoy> = ["a", "b", "c"].into_iter().map(Envoy::new).collect();
        for envoy in &mut envoys {
            envoy.report(&quotas, &clock, &bucket, usage(0, 0));
        }
        for (holder, allowed, denied, wait) in reports {
            clock.advance(wait);
            // An Envoy admits no more than its live share allows, nothing
            // once it has expired (`expired_assignment_behavior`: deny).
            let envoy = &mut envoys[holder];
            let now = clock.now_ms();
            let most = envoy.assigned.filter(|(_, until)| now < *until).map_or(0, |(share, _)| share / 10);
            envoy.report(&quotas, &clock, &bucket, usage(allowed.min(most), denied)).unwrap();
            let now = clock.now_ms();
            let table = quotas.lock();
            let shared = &table[&bucket];
            // What each may admit in a window: its share, and its bucket's
            // burst once more when its share changes.
            let most: u64 = shared
                .holders
                .values()
                .map(|s| s.held(now, 1_000, 10_000))
                .map(|held| if held == 0 { 0 } else { held + strategy::burst(held) })
                .sum();
            let holders = shared.holders.len() as u64;
            prop_assert!(most <= 300 + holders, "{most} with {holders} holders");
        }
    }
}
