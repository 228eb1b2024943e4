//! Tests of the in-memory store: counting, expiry, eviction and the summary.

use super::*;
use crate::limiter::{
    ManualClock, ManyItem,
    window::{Algorithm, WindowParams},
};

/// A rule's counter, as the store sees it (the store knows no rules).
struct Counter {
    id: Arc<str>,
    window: WindowParams,
}

impl Counter {
    fn counter(&self) -> CounterSpec<'_> {
        CounterSpec { id: &self.id, window: self.window }
    }
}

fn rule(id: &str, window_ms: u64, capacity: u64) -> Counter {
    Counter { id: Arc::from(id), window: WindowParams::sliding(window_ms, capacity) }
}

#[test]
fn counts_per_user_and_rule() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = MemoryStore::new(4, 1_000, clock);
    let a = rule("a", 1_000, 2);
    let b = rule("b", 1_000, 2);
    assert!(store.decide("u1", a.counter(), 2, Count::IfFits).unwrap().admitted);
    assert!(!store.decide("u1", a.counter(), 1, Count::IfFits).unwrap().admitted);
    assert!(store.decide("u2", a.counter(), 2, Count::IfFits).unwrap().admitted, "users are independent");
    assert!(store.decide("u1", b.counter(), 2, Count::IfFits).unwrap().admitted, "rules are independent");
}

#[test]
fn idle_counters_expire_and_are_swept() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = MemoryStore::new(4, 1_000, Arc::clone(&clock) as Arc<dyn Clock>);
    let r = rule("a", 1_000, 5);
    for user in 0..100 {
        store.decide(&format!("user-{user}"), r.counter(), 1, Count::IfFits).unwrap();
    }
    assert_eq!(store.len(), 100);
    clock.advance(1_999);
    assert_eq!(store.sweep(), 100, "still inside 2 x W");
    clock.advance(1);
    assert_eq!(store.sweep(), 0);
    assert!(store.is_empty());
}

/// `Count::Anyway` (upstream's INCRBY): answered as an admission, but
/// counted when it does not fit, so a denial pushes the count on.
#[test]
fn an_admission_counted_anyway_answers_for_itself_and_counts_when_denied() {
    let clock = Arc::new(ManualClock::new(0));
    let store = MemoryStore::new(1, 1_000, clock);
    let r = Counter { id: Arc::from("a"), window: WindowParams::window(1_000, 2, false) };
    let hit = || store.decide("u", r.counter(), 1, Count::Anyway).unwrap();
    let (first, second, third) = (hit(), hit(), hit());
    assert!(first.admitted && first.remaining == 1, "{first:?}");
    assert!(second.admitted && second.remaining == 0, "at the limit, as an admission: {second:?}");
    assert!(!third.admitted && third.retry_after_ms.is_some(), "{third:?}");
    // Three counted against two: even a weight of 0 is past the limit.
    assert!(!store.decide("u", r.counter(), 0, Count::Never).unwrap().admitted);
}

#[test]
fn denied_requests_allocate_nothing() {
    let clock = Arc::new(ManualClock::new(0));
    let store = MemoryStore::new(1, 1_000, clock);
    let r = rule("a", 1_000, 1);
    assert!(!store.decide("u", r.counter(), 2, Count::IfFits).unwrap().admitted);
    assert!(store.is_empty());
}

fn item(key: &str, capacity: u64, weight: u64, shadow: bool) -> ManyItem {
    ManyItem {
        key: key.to_owned(),
        params: WindowParams::sliding(60_000, capacity),
        tick_ms: 1,
        weight,
        count: Count::IfFits,
        shadow,
        clock: None,
        refund: None,
    }
}

#[test]
fn many_is_all_or_nothing() {
    let store = MemoryStore::new(8, 1_000, Arc::new(ManualClock::new(1_000_000)));
    let group: Arc<str> = Arc::from("d");
    let first = store.decide_many(&group, &[item("a", 5, 1, false), item("b", 1, 1, false)]).unwrap();
    assert!(first.committed);
    // b is full: a must not be consumed.
    let second = store.decide_many(&group, &[item("a", 5, 1, false), item("b", 1, 1, false)]).unwrap();
    assert!(!second.committed);
    assert_eq!((second.verdicts[0].admitted, second.verdicts[1].admitted), (true, false));
    assert_eq!(second.verdicts[0].remaining, 4, "a is reported unconsumed");
    let a_alone = store.decide_many(&group, &[item("a", 5, 1, false)]).unwrap();
    assert_eq!(a_alone.verdicts[0].remaining, 3, "only the first call counted on a");
}

/// A native rule `edge` and an Envoy domain `edge`: a client whose user
/// id spells the domain's counter key (`60|user=a`) counts on its own
/// counter, never on the Envoy descriptor's (Redis: `rl2:` vs `rle2:`).
#[test]
fn single_and_job_counters_never_share_a_key() {
    let store = MemoryStore::new(4, 1_000, Arc::new(ManualClock::new(1_000_000)));
    let native = rule("edge", 60_000, 1);
    assert!(store.decide("60|user=a", native.counter(), 1, Count::IfFits).unwrap().admitted);
    let envoy = store.decide_many("edge", &[item("60|user=a", 1, 1, false)]).unwrap();
    assert!(envoy.committed, "the Envoy counter is untouched by the native one");
    assert_eq!(store.len(), 2);
}

#[test]
fn many_shadow_items_never_block() {
    let store = MemoryStore::new(8, 1_000, Arc::new(ManualClock::new(1_000_000)));
    let group: Arc<str> = Arc::from("d");
    store.decide_many(&group, &[item("s", 1, 1, true)]).unwrap();
    let outcome = store.decide_many(&group, &[item("s", 1, 1, true), item("a", 5, 1, false)]).unwrap();
    assert!(outcome.committed);
    assert!(!outcome.verdicts[0].admitted);
    assert_eq!(store.decide_many(&group, &[item("a", 5, 0, false)]).unwrap().verdicts[0].remaining, 4);
}

#[test]
fn many_counts_a_repeated_key_once_per_occurrence() {
    let store = MemoryStore::new(8, 1_000, Arc::new(ManualClock::new(1_000_000)));
    let group: Arc<str> = Arc::from("d");
    let outcome = store.decide_many(&group, &[item("a", 3, 2, false), item("a", 3, 2, false)]).unwrap();
    assert!(!outcome.committed, "2 + 2 > 3 on the same counter");
    assert!(store.decide_many(&group, &[item("a", 3, 3, false)]).unwrap().committed);
}

#[test]
fn concurrent_callers_admit_exactly_the_capacity() {
    let clock = Arc::new(ManualClock::new(5_000));
    let store = Arc::new(MemoryStore::new(8, 1_000, clock));
    let r = Arc::new(rule("a", 60_000, 1_000));
    let admitted: usize = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let store = Arc::clone(&store);
                let r = Arc::clone(&r);
                scope.spawn(move || {
                    (0..500)
                        .filter(|_| store.decide("hot", r.counter(), 1, Count::IfFits).unwrap().admitted)
                        .count()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(admitted, 1_000);
}

#[test]
fn a_full_store_admits_newcomers_and_no_evicted_key_regains_its_budget() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = MemoryStore::new(4, 64, Arc::clone(&clock) as Arc<dyn Clock>);
    let r = rule("a", 3_600_000, 5);
    for user in 0..5 {
        store.decide(&format!("near-{user}"), r.counter(), 4, Count::IfFits).unwrap();
    }
    // A flood of 10,000 distinct keys, one hit each, on a store of 64.
    for user in 0..10_000 {
        assert!(store.decide(&format!("flood-{user}"), r.counter(), 1, Count::IfFits).unwrap().admitted);
    }
    assert_eq!(store.len(), 64, "every shard filled to its share, none beyond");
    assert!(store.live_evictions() >= 10_000 - 64, "{}", store.live_evictions());
    // A newcomer on 5 an hour starts at zero, but for the summary's
    // false positives (they start at most at a flood key's share).
    let before = newcomers_admitted(&store, &r, "before");
    assert!(before >= 95 * 5, "100 newcomers admitted {before} of 500");
    // Whoever was evicted returns at least at its old count.
    for user in 0..5 {
        let verdict = store.decide(&format!("near-{user}"), r.counter(), 1, Count::IfFits).unwrap();
        assert!(verdict.remaining == 0, "near-{user} regained a budget: {verdict:?}");
        assert!(!store.decide(&format!("near-{user}"), r.counter(), 1, Count::IfFits).unwrap().admitted);
    }
    for user in 0..10_000 {
        let again = store.decide(&format!("flood-{user}"), r.counter(), 5, Count::IfFits).unwrap();
        assert!(!again.admitted, "flood-{user} returned with a fresh budget");
    }
    // A peek needs no room.
    assert!(store.decide("peek", r.counter(), 0, Count::IfFits).unwrap().admitted);
    // However long the flood goes on, newcomers' starts do not creep.
    for user in 10_000..200_000 {
        assert!(store.decide(&format!("flood-{user}"), r.counter(), 1, Count::IfFits).unwrap().admitted);
    }
    let after = newcomers_admitted(&store, &r, "after");
    assert!(after >= 95 * 5, "100 newcomers admitted {after} of 500");
}

/// What 100 newcomers are admitted of 5 each, each admitted at least 1.
fn newcomers_admitted(store: &MemoryStore, r: &Counter, name: &str) -> usize {
    (0..100)
        .map(|n| {
            let admitted = (0..6)
                .filter(|_| {
                    store.decide(&format!("{name}-{n}"), r.counter(), 1, Count::IfFits).unwrap().admitted
                })
                .count();
            assert!((1..=5).contains(&admitted), "a newcomer admitted {admitted} of 5");
            admitted
        })
        .sum()
}

/// Token buckets and GCRA: an evicted key returns with at least the
/// debt it had (none of its spent tokens back).
#[test]
fn an_evicted_bucket_returns_no_tokens() {
    for algorithm in [Algorithm::TokenBucket, Algorithm::Gcra] {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(1, 4, Arc::clone(&clock) as Arc<dyn Clock>);
        let id: Arc<str> = Arc::from("b");
        let window = WindowParams { algorithm, ..WindowParams::sliding(60_000, 10) };
        let spec = CounterSpec { id: &id, window };
        for _ in 0..9 {
            assert!(store.decide("heavy", spec, 1, Count::IfFits).unwrap().admitted);
        }
        for user in 0..100 {
            store.decide(&format!("flood-{user}"), spec, 1, Count::IfFits).unwrap();
        }
        let mut admitted = 0;
        for _ in 0..3 {
            admitted += usize::from(store.decide("heavy", spec, 1, Count::IfFits).unwrap().admitted);
        }
        assert!(admitted <= 1, "{algorithm:?}: heavy got {admitted} more of its 1 left");
    }
}

/// Counters the owner pins (owed to the shared store) are never
/// evicted: a shard full of them fails the decision.
#[test]
fn a_pinned_counter_is_never_evicted() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let pinned: Pinned = Arc::new(|_, _, key: &str| key.starts_with("owed"));
    let store = MemoryStore::new(1, 2, Arc::clone(&clock) as Arc<dyn Clock>).with_pinned(pinned);
    let r = rule("a", 60_000, 5);
    store.decide("owed-1", r.counter(), 1, Count::IfFits).unwrap();
    store.decide("owed-2", r.counter(), 1, Count::IfFits).unwrap();
    let error = store.decide("new", r.counter(), 1, Count::IfFits).unwrap_err();
    assert_eq!(error.kind, FailureKind::StoreFull);
    assert_eq!(store.len(), 2);
}

#[test]
fn a_full_shard_evicts_expired_counters_without_a_sweep() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = MemoryStore::new(1, 8, Arc::clone(&clock) as Arc<dyn Clock>);
    let r = rule("a", 1_000, 3);
    for user in 0..8 {
        store.decide(&format!("old-{user}"), r.counter(), 1, Count::IfFits).unwrap();
    }
    assert!(store.decide("new", r.counter(), 1, Count::IfFits).unwrap().admitted);
    assert_eq!((store.live_evictions(), store.evictions()), (1, 0), "a live counter made room");
    clock.advance(2_000);
    for user in 0..8 {
        assert!(store.decide(&format!("new-{user}"), r.counter(), 1, Count::IfFits).unwrap().admitted);
    }
    assert_eq!(store.len(), 8);
    assert_eq!(store.evictions(), 8, "expired ones first");
}

#[test]
fn many_fails_whole_when_a_new_counter_finds_no_room() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let pinned: Pinned = Arc::new(|_, _, _| true);
    let store = MemoryStore::new(1, 2, Arc::clone(&clock) as Arc<dyn Clock>).with_pinned(pinned);
    let group: Arc<str> = Arc::from("d");
    store.decide_many(&group, &[item("a", 5, 1, false), item("b", 5, 1, false)]).unwrap();
    let error = store.decide_many(&group, &[item("a", 5, 1, false), item("c", 5, 1, false)]).unwrap_err();
    assert_eq!(error.kind, FailureKind::StoreFull);
    let a = store.decide_many(&group, &[item("a", 5, 0, false)]).unwrap();
    assert_eq!(a.verdicts[0].remaining, 4, "a was not counted by the failed call");
    // Repeated new keys need one slot, not two.
    clock.advance(120_000);
    store.decide_many(&group, &[item("c", 5, 1, false), item("c", 5, 1, false)]).unwrap();
    assert_eq!(store.len(), 2);
}

#[test]
fn sweeping_after_a_flood_shrinks_the_maps() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = MemoryStore::new(2, 100_000, Arc::clone(&clock) as Arc<dyn Clock>);
    let r = rule("a", 1_000, 3);
    for user in 0..50_000 {
        store.decide(&format!("flood-{user}"), r.counter(), 1, Count::IfFits).unwrap();
    }
    let flooded = store.allocated();
    assert!(flooded >= 50_000);
    clock.advance(1_000);
    store.decide("stays", r.counter(), 1, Count::IfFits).unwrap();
    clock.advance(1_000);
    assert_eq!(store.sweep(), 1, "only the counter written a window ago is left");
    assert!(store.allocated() < flooded / 10, "{} slots left of {flooded}", store.allocated());
    assert!(
        !store.decide("stays", r.counter(), 3, Count::IfFits).unwrap().admitted,
        "the survivor still counts"
    );
}

#[test]
fn many_never_outgrows_the_bound_by_rewriting_an_expired_counter() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let pinned: Pinned = Arc::new(|_, _, _| true);
    let store = MemoryStore::new(1, 2, Arc::clone(&clock) as Arc<dyn Clock>).with_pinned(pinned);
    let group: Arc<str> = Arc::from("d");
    let short = |key: &str| ManyItem { params: WindowParams::sliding(1_000, 5), ..item(key, 5, 1, false) };
    store.decide_many(&group, &[short("a"), item("b", 5, 1, false)]).unwrap();
    clock.advance(2_000);
    // a has expired, b has not: writing a again and c needs two slots,
    // and only a's can be had.
    let error = store.decide_many(&group, &[short("a"), item("c", 5, 1, false)]).unwrap_err();
    assert_eq!(error.kind, FailureKind::StoreFull);
    assert!(store.len() <= 2, "{} counters", store.len());
}

#[test]
fn a_listing_leaves_out_expired_counters() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let store = MemoryStore::new(4, 1_000, Arc::clone(&clock) as Arc<dyn Clock>);
    let short = |key: &str| ManyItem { params: WindowParams::sliding(1_000, 5), ..item(key, 5, 1, false) };
    store.decide_many("g", &[short("a"), item("b", 5, 1, false)]).unwrap();
    let mut listed = store.list("g", "", 10);
    listed.keys.sort();
    assert_eq!(listed, Listed { keys: vec!["a".to_owned(), "b".to_owned()], complete: true });
    // A sliding window's counter lasts two windows.
    clock.advance(2_000);
    assert_eq!(store.list("g", "", 10).keys, ["b"]);
}
