//! The behaviours every counter store shows, written once and run against
//! each store behind `limiter::CounterStore`: the memory store, Redis, a
//! Redis Cluster, and the local store (the memory store at this
//! instance's share, which decides while the shared store cannot). A new
//! store joins `stores!` below and passes the same tests.
//!
//! Redis counts time by its own clock (`TIME`) and the in-process stores
//! by the system clock here, so waits are real and short, and retry times
//! are checked within the few milliseconds a call takes.

mod common;

use std::{future::Future, sync::Arc, time::Duration};

use common::{RedisCluster, RedisServer};
use ratelimitd::limiter::{
    Algorithm, Count, CounterSpec, CounterStore, FailureKind, ManyItem, ManyOutcome, MemoryStore, RedisStore,
    Shares, StoreError, SystemClock, Verdict, WindowParams,
    calendar::{Calendar, Period},
    local::{LocalLimiter, Settings},
    store,
};

const HOUR_MS: u64 = 3_600_000;

/// One counter of a job, counted if it fits.
fn item(key: &str, params: WindowParams) -> ManyItem {
    ManyItem::admission(key, params)
}

fn params(algorithm: Algorithm, window_ms: u64, capacity: u64) -> WindowParams {
    WindowParams { window_ms, capacity, rate: capacity, algorithm }
}

async fn one<S: CounterStore>(
    store: &S,
    user: &str,
    id: &Arc<str>,
    window: WindowParams,
    (weight, count): (u64, Count),
) -> Result<Verdict, StoreError> {
    store.decide_in(Shares::default(), user, CounterSpec { id, window }, weight, count).await
}

async fn job<S: CounterStore>(store: &S, group: &str, items: &[ManyItem]) -> ManyOutcome {
    let outcome = store::decide_many(store, Shares::default(), group, items).await;
    outcome.unwrap_or_else(|e| panic!("{}: {e:?}", S::NAME))
}

/// What a denial of a full counter of `algorithm` (capacity 5 an hour,
/// first hit just now) may say to wait, in ms: a fixed window until its
/// (aligned) end, a sliding one until a fifth of the next window has
/// passed (the full window's weight then lets one more in), a first-hit
/// window an hour from its first hit, a bucket until one of its 5 tokens
/// an hour is back, slots in flight until the next window's end.
fn wait_bounds(algorithm: Algorithm) -> std::ops::RangeInclusive<u64> {
    match algorithm {
        Algorithm::FixedWindow => 1..=HOUR_MS,
        Algorithm::SlidingWindow => HOUR_MS / 5..=HOUR_MS + HOUR_MS / 5,
        Algorithm::TokenBucket | Algorithm::Gcra => HOUR_MS / 5 - 2_000..=HOUR_MS / 5,
        Algorithm::FirstHitWindow => HOUR_MS - 2_000..=HOUR_MS,
        // Slots in flight, none given back: until this window's are over too.
        Algorithm::Concurrency => HOUR_MS..=2 * HOUR_MS,
    }
}

/// Each algorithm admits its capacity, counting down, then refuses with
/// nothing left and the wait its arithmetic gives; alike for one counter
/// and for a job.
async fn each_algorithm_admits_its_capacity_then_tells_the_wait<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    for algorithm in Algorithm::ALL {
        let window = params(algorithm, HOUR_MS, 5);
        let id: Arc<str> = Arc::from(format!("rule-{}", algorithm.as_str()));
        for left in (0..5).rev() {
            let verdict = one(&*store, "ann", &id, window, (1, Count::IfFits)).await.unwrap();
            assert!(verdict.admitted && verdict.remaining == left, "{name} {algorithm:?}: {verdict:?}");
        }
        let denied = one(&*store, "ann", &id, window, (1, Count::IfFits)).await.unwrap();
        let wait = denied.retry_after_ms.unwrap_or(0);
        assert!(!denied.admitted && denied.remaining == 0, "{name} {algorithm:?}: {denied:?}");
        assert!(wait_bounds(algorithm).contains(&wait), "{name} {algorithm:?}: retry after {wait} ms");
        let other = one(&*store, "bob", &id, window, (1, Count::IfFits)).await.unwrap();
        assert_eq!((other.admitted, other.remaining), (true, 4), "{name} {algorithm:?}: users apart");

        let key = format!("3600|user=ann|{}", algorithm.as_str());
        for left in (0..5).rev() {
            let outcome = job(&*store, "admit", &[item(&key, window)]).await;
            assert!(outcome.committed, "{name} {algorithm:?}");
            assert_eq!(outcome.verdicts[0].remaining, left, "{name} {algorithm:?}");
        }
        let denied = job(&*store, "admit", &[item(&key, window)]).await;
        let wait = denied.verdicts[0].retry_after_ms.unwrap_or(0);
        assert!(!denied.committed && denied.verdicts[0].remaining == 0, "{name} {algorithm:?}");
        assert!(wait_bounds(algorithm).contains(&wait), "{name} {algorithm:?}: job retry after {wait} ms");
    }
}

/// A weight larger than what is left is refused whole and counts
/// nothing; a weight of what is left is admitted.
async fn a_hit_that_does_not_fit_is_refused_whole<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    for algorithm in Algorithm::ALL {
        let window = params(algorithm, HOUR_MS, 10);
        let id: Arc<str> = Arc::from(format!("whole-{}", algorithm.as_str()));
        assert!(one(&*store, "ann", &id, window, (7, Count::IfFits)).await.unwrap().admitted);
        let refused = one(&*store, "ann", &id, window, (4, Count::IfFits)).await.unwrap();
        assert!(!refused.admitted && refused.remaining == 3, "{name} {algorithm:?}: {refused:?}");
        let fits = one(&*store, "ann", &id, window, (3, Count::IfFits)).await.unwrap();
        assert!(fits.admitted && fits.remaining == 0, "{name} {algorithm:?}: {fits:?}");
    }
}

/// Several limits in one job, all or nothing: one that does not fit keeps
/// every admission of the job uncounted; a shadow item over its limit
/// blocks nothing and is not counted.
async fn several_limits_are_decided_all_or_nothing<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    let (wide, narrow) =
        (params(Algorithm::SlidingWindow, HOUR_MS, 5), params(Algorithm::FixedWindow, HOUR_MS, 1));
    let both = [item("wide", wide), item("narrow", narrow)];
    let first = job(&*store, "all", &both).await;
    assert!(first.committed, "{name}: {first:?}");
    assert_eq!((first.verdicts[0].remaining, first.verdicts[1].remaining), (4, 0), "{name}");
    let second = job(&*store, "all", &both).await;
    assert!(!second.committed, "{name}: narrow is full");
    assert!(second.verdicts[0].admitted && !second.verdicts[1].admitted, "{name}: {second:?}");
    let wide_alone = job(&*store, "all", &[item("wide", wide)]).await;
    assert_eq!(wide_alone.verdicts[0].remaining, 3, "{name}: the refused job counted nothing");

    let shadow = ManyItem { shadow: true, ..item("narrow", narrow) };
    let outcome = job(&*store, "all", &[item("wide", wide), shadow]).await;
    assert!(outcome.committed && !outcome.verdicts[1].admitted, "{name}: a shadow item blocks nothing");
    assert_eq!(outcome.verdicts[0].remaining, 2, "{name}");
}

/// A report is counted whatever is left, past the limit, and later
/// admissions see it; in a job with admissions that are refused, the
/// report is still counted. (Slots in flight: a report gives them back,
/// below.)
async fn reports_are_counted_past_the_limit<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    for algorithm in Algorithm::ALL.into_iter().filter(|a| !a.releases()) {
        let window = params(algorithm, HOUR_MS, 5);
        let id: Arc<str> = Arc::from(format!("report-{}", algorithm.as_str()));
        let reported = one(&*store, "ann", &id, window, (8, Count::Always)).await.unwrap();
        assert_eq!(reported.remaining, 0, "{name} {algorithm:?}: {reported:?}");
        let after = one(&*store, "ann", &id, window, (1, Count::IfFits)).await.unwrap();
        assert!(!after.admitted, "{name} {algorithm:?}: 8 reported of 5: {after:?}");
    }
    let window = params(Algorithm::FixedWindow, HOUR_MS, 2);
    let report = ManyItem { weight: 3, count: Count::Always, ..item("used", window) };
    let full = ManyItem { weight: 3, ..item("asked", window) };
    let outcome = job(&*store, "report", &[report.clone(), full]).await;
    assert!(!outcome.committed, "{name}: 3 asked of 2");
    let peek = ManyItem { count: Count::Never, ..item("used", window) };
    let seen = job(&*store, "report", &[peek]).await;
    assert!(!seen.verdicts[0].admitted && seen.verdicts[0].remaining == 0, "{name}: the report counted");
}

/// Requests in flight: admissions take slots until none is left, a report
/// gives slots back (the oldest first, never below none) and the next
/// request fits again; slots never given back are freed within two
/// windows. Alike for one counter and for a job.
async fn slots_in_flight_are_taken_and_given_back<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    let id: Arc<str> = Arc::from("in-flight");
    let window = params(Algorithm::Concurrency, HOUR_MS, 3);
    for left in (0..3).rev() {
        let taken = one(&*store, "ann", &id, window, (1, Count::IfFits)).await.unwrap();
        assert!(taken.admitted && taken.remaining == left, "{name}: {taken:?}");
    }
    let full = one(&*store, "ann", &id, window, (1, Count::IfFits)).await.unwrap();
    assert!(!full.admitted && full.remaining == 0, "{name}: the fourth in flight: {full:?}");
    let back = one(&*store, "ann", &id, window, (1, Count::Always)).await.unwrap();
    assert!(back.admitted && back.remaining == 1, "{name}: one given back: {back:?}");
    assert!(one(&*store, "ann", &id, window, (1, Count::IfFits)).await.unwrap().admitted, "{name}");
    let all_back = one(&*store, "ann", &id, window, (10, Count::Always)).await.unwrap();
    assert_eq!(all_back.remaining, 3, "{name}: more given back than taken: none in flight");

    let key = "in-flight|ann";
    let take = || item(key, window);
    let give = || ManyItem { count: Count::Always, ..item(key, window) };
    assert!(job(&*store, "flight", &[ManyItem { weight: 3, ..take() }]).await.committed, "{name}");
    assert!(!job(&*store, "flight", &[take()]).await.committed, "{name}: full");
    job(&*store, "flight", &[give()]).await;
    let again = job(&*store, "flight", &[take()]).await;
    assert!(again.committed && again.verdicts[0].remaining == 0, "{name}: {again:?}");

    // A caller that never gives its slots back: freed within two windows.
    let short = params(Algorithm::Concurrency, 200, 2);
    let leaked: Arc<str> = Arc::from("leaked");
    for _ in 0..2 {
        assert!(one(&*store, "bob", &leaked, short, (1, Count::IfFits)).await.unwrap().admitted, "{name}");
    }
    let refused = one(&*store, "bob", &leaked, short, (1, Count::IfFits)).await.unwrap();
    let wait = refused.retry_after_ms.expect("a wait");
    assert!(!refused.admitted && (200..=400).contains(&wait), "{name}: {refused:?}");
    tokio::time::sleep(Duration::from_millis(wait + 5)).await;
    let freed = one(&*store, "bob", &leaked, short, (1, Count::IfFits)).await.unwrap();
    assert!(freed.admitted && freed.remaining == 1, "{name}: {freed:?}");
}

/// A peek says whether a hit would fit and counts nothing, nor creates a
/// counter (nothing listed).
async fn a_peek_counts_nothing<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    for algorithm in Algorithm::ALL {
        let window = params(algorithm, HOUR_MS, 3);
        let id: Arc<str> = Arc::from(format!("peek-{}", algorithm.as_str()));
        for _ in 0..5 {
            let peek = one(&*store, "ann", &id, window, (1, Count::Never)).await.unwrap();
            assert!(peek.admitted && peek.remaining == 3, "{name} {algorithm:?}: {peek:?}");
        }
        let first = one(&*store, "ann", &id, window, (1, Count::IfFits)).await.unwrap();
        assert_eq!(first.remaining, 2, "{name} {algorithm:?}: the peeks counted nothing");
        let peek = one(&*store, "ann", &id, window, (3, Count::Never)).await.unwrap();
        assert!(!peek.admitted && peek.remaining == 2, "{name} {algorithm:?}: 3 would not fit: {peek:?}");
    }
    let peek = ManyItem { count: Count::Never, ..item("peeked", params(Algorithm::FixedWindow, HOUR_MS, 3)) };
    assert!(job(&*store, "peek", &[peek]).await.verdicts[0].admitted);
    assert!(store.list_keys("peek", "", 10).await.unwrap().keys.is_empty(), "{name}: a peek wrote a counter");
}

/// A counter ends with its window: a refused key is admitted again once
/// the wait it was told has passed, and a key of a window long over is
/// listed no more.
async fn counters_expire_with_their_window<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    for algorithm in Algorithm::ALL {
        let window = params(algorithm, 200, 1);
        let key = format!("short-{}", algorithm.as_str());
        assert!(job(&*store, "expiry", &[item(&key, window)]).await.committed, "{name} {algorithm:?}");
        let refused = job(&*store, "expiry", &[item(&key, window)]).await;
        assert!(!refused.committed, "{name} {algorithm:?}");
        let wait = refused.verdicts[0].retry_after_ms.expect("a wait");
        assert!((1..=400).contains(&wait), "{name} {algorithm:?}: retry after {wait} ms");
        tokio::time::sleep(Duration::from_millis(wait + 5)).await;
        let again = job(&*store, "expiry", &[item(&key, window)]).await;
        assert!(again.committed, "{name} {algorithm:?}: not admitted {wait} ms later: {again:?}");
    }
    // Every window and bucket above is over (and a sliding window's
    // previous one too) within four windows.
    tokio::time::sleep(Duration::from_millis(850)).await;
    let listed = store.list_keys("expiry", "", 10).await.unwrap();
    assert!(listed.keys.is_empty(), "{name}: {:?} still listed", listed.keys);
}

/// Listing a group's counters: only its job counters (not another
/// group's, one whose name is a glob matching it, nor a single counter
/// keyed by the group's name), by prefix, bounded.
async fn a_groups_counters_are_listed<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    let window = params(Algorithm::FixedWindow, 60_000, 5);
    for (group, key) in
        [("ns", "60|a=1"), ("ns", "60|a=2"), ("ns", "1|b=%2A"), ("n*", "60|a=3"), ("other", "60|a=4")]
    {
        assert!(job(&*store, group, &[item(key, window)]).await.committed, "{name}");
    }
    let id: Arc<str> = Arc::from("ns");
    one(&*store, "60|a=single", &id, window, (1, Count::IfFits)).await.unwrap();

    let mut listed = store.list_keys("ns", "", 10).await.unwrap();
    listed.keys.sort();
    assert_eq!(listed.keys, ["1|b=%2A", "60|a=1", "60|a=2"], "{name}");
    assert!(listed.complete, "{name}");
    assert_eq!(store.list_keys("ns", "60|", 10).await.unwrap().keys.len(), 2, "{name}: by prefix");
    let glob = store.list_keys("n*", "", 10).await.unwrap();
    assert_eq!(glob.keys, ["60|a=3"], "{name}: a glob in the group matches only itself");
    let bounded = store.list_keys("ns", "", 2).await.unwrap();
    assert_eq!((bounded.keys.len(), bounded.complete), (2, false), "{name}: bounded");
    assert!(store.list_keys("none", "", 10).await.unwrap().keys.is_empty(), "{name}");
}

/// A full store never admits past a limit: a key at its limit stays
/// refused, and a new key is decided exactly or fails as `store_full`
/// (answered by the rule's failure policy), never admitted unchecked.
async fn a_full_store_never_admits_past_a_limit<S: CounterStore, F: Future<Output = ()>>(
    store: Arc<S>,
    fill: impl FnOnce() -> F,
) {
    let name = S::NAME;
    let window = params(Algorithm::SlidingWindow, HOUR_MS, 3);
    let id: Arc<str> = Arc::from("full");
    one(&*store, "held", &id, window, (3, Count::IfFits)).await.unwrap();
    fill().await;
    for n in 0..64 {
        let user = format!("new-{n}");
        for (weight, may_admit) in [(3, true), (1, false)] {
            match one(&*store, &user, &id, window, (weight, Count::IfFits)).await {
                Ok(verdict) => {
                    assert!(may_admit || !verdict.admitted, "{name}: {user} admitted past its limit")
                }
                Err(e) => assert_eq!(e.kind, FailureKind::StoreFull, "{name}: {e:?}"),
            }
        }
        match one(&*store, "held", &id, window, (1, Count::IfFits)).await {
            Ok(verdict) => assert!(!verdict.admitted, "{name}: the held key was admitted past its limit"),
            Err(e) => assert_eq!(e.kind, FailureKind::StoreFull, "{name}: {e:?}"),
        }
    }
}

/// Fills an in-process store of `max_counters` with counters that still
/// count.
async fn fill_with_counters<S: CounterStore>(store: Arc<S>, max_counters: usize) {
    let id: Arc<str> = Arc::from("filler");
    for n in 0..2 * max_counters {
        one(
            &*store,
            &format!("filler-{n}"),
            &id,
            params(Algorithm::FixedWindow, HOUR_MS, 5),
            (1, Count::IfFits),
        )
        .await
        .unwrap();
    }
}

/// The stores, each opened fresh for one test.
mod open {
    use super::*;

    pub(crate) fn memory(max_counters: usize) -> Arc<MemoryStore> {
        Arc::new(MemoryStore::new(4, max_counters, Arc::new(SystemClock)))
    }

    pub(crate) fn local(max_counters: usize) -> Arc<LocalLimiter> {
        let settings = Settings { max_counters, shards: 4, instances: 1, ..Settings::default() };
        Arc::new(LocalLimiter::new(settings, Arc::new(SystemClock)))
    }

    /// A store on `url` (seed nodes when `cluster`), its script loaded; its
    /// dispatchers end with the returned set.
    pub(crate) async fn redis(url: String, cluster: bool) -> (Arc<RedisStore>, tokio::task::JoinSet<()>) {
        let config = ratelimitd::config::RedisConfig {
            connection: ratelimitd::config::Connection { url: Some(url), cluster, ..Default::default() },
            timeout_ms: 5_000,
            ..ratelimitd::config::RedisConfig::default()
        };
        let mut dispatchers = tokio::task::JoinSet::new();
        let store = RedisStore::new(&config, &mut dispatchers).unwrap();
        store.warm_up(Duration::from_secs(10)).await.unwrap();
        (Arc::new(store), dispatchers)
    }
}

/// The counter of a calendar limit of `capacity` (`algorithm`) for a
/// decision at `now_ms`: in its period's ticks, on the decision's clock.
fn in_period(key: &str, calendar: &Calendar, algorithm: Algorithm, capacity: u64, now_ms: u64) -> ManyItem {
    let (clock, window) = calendar.clock(now_ms);
    let tick_ms = calendar.period().tick_ms();
    ManyItem { tick_ms, clock: Some(clock), ..item(key, params(algorithm, window, capacity)) }
}

fn utc(text: &str) -> u64 {
    u64::try_from(text.parse::<jiff::Timestamp>().unwrap().as_millisecond()).unwrap()
}

/// A calendar period counts on the decision's clock, whatever the store's:
/// a month in Berlin resets at its first midnight (an hour before UTC's,
/// after the autumn's daylight-saving change), a denial waits exactly to
/// the period's end, a writer whose clock is behind counts in the newer
/// period and loses nothing of it, and a sliding day of 25 hours weighs
/// the previous day by what is left of this one.
async fn calendar_periods_count_on_the_decisions_clock<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    let month = Calendar::new(Period::Month, "Europe/Berlin").unwrap();
    let at = |key: &str, now_ms| [in_period(key, &month, Algorithm::FixedWindow, 5, now_ms)];
    let october = utc("2026-10-31T22:30:00Z");
    for left in (0..5).rev() {
        let outcome = job(&*store, "cal", &at("month", october)).await;
        assert_eq!((outcome.committed, outcome.verdicts[0].remaining), (true, left), "{name}");
    }
    let denied = job(&*store, "cal", &at("month", october)).await;
    // Half an hour to November in Berlin, to the ms.
    assert!(!denied.committed, "{name}");
    assert_eq!(denied.verdicts[0].retry_after_ms, Some(1_800_000), "{name}: {denied:?}");
    assert_eq!(denied.verdicts[0].reset_after_ms, 1_800_000, "{name}");
    let november = utc("2026-10-31T23:00:00Z");
    let fresh = job(&*store, "cal", &at("month", november)).await;
    assert_eq!((fresh.committed, fresh.verdicts[0].remaining), (true, 4), "{name}: {fresh:?}");
    // A clock still in October finds November's counter: counted there,
    // everything it holds as current (conservative), nothing lost.
    let behind = job(&*store, "cal", &at("month", november - 1)).await;
    assert!(!behind.committed, "{name}: {behind:?}");
    let later = job(&*store, "cal", &at("month", november + 60_000)).await;
    assert_eq!((later.committed, later.verdicts[0].remaining), (true, 3), "{name}: {later:?}");

    // Berlin's 2026-10-25 lasts 25 hours; the day before is full.
    let day = Calendar::new(Period::Day, "Europe/Berlin").unwrap();
    let at = |now_ms| [in_period("day", &day, Algorithm::SlidingWindow, 10, now_ms)];
    let eve = utc("2026-10-24T21:59:00Z");
    assert!(job(&*store, "cal", &[ManyItem { weight: 10, ..at(eve)[0].clone() }]).await.committed);
    let midnight = utc("2026-10-24T22:00:00Z");
    let denied = job(&*store, "cal", &at(midnight)).await;
    // 10 x (W - e) / W <= 9 once e is a tenth of 25 hours.
    assert_eq!(denied.verdicts[0].retry_after_ms, Some(9_000_000), "{name}: {denied:?}");
    assert!(!job(&*store, "cal", &at(midnight + 8_999_000)).await.committed, "{name}");
    assert!(job(&*store, "cal", &at(midnight + 9_000_000)).await.committed, "{name}");
}

/// A refund (a settlement below its reservation) gives its weight back to
/// the window it names while that window counts (this one's count, or the
/// previous one's), never below 0, and nothing to a window long gone; a
/// bucket's debt shrinks by it. Decided by the script as by the Rust
/// arithmetic.
async fn refunds_give_back_to_the_window_counted_in<S: CounterStore>(store: Arc<S>) {
    let name = S::NAME;
    for algorithm in
        [Algorithm::SlidingWindow, Algorithm::FixedWindow, Algorithm::TokenBucket, Algorithm::Gcra]
    {
        let key = format!("refund-{}", algorithm.as_str());
        let spend = ManyItem { weight: 6, ..item(&key, params(algorithm, HOUR_MS, 10)) };
        let spent = job(&*store, "refund", std::slice::from_ref(&spend)).await;
        assert_eq!(spent.verdicts[0].remaining, 4, "{name} {algorithm:?}");
        let window = spend.window_at(spent.now_ms);
        let refund =
            |weight, window| ManyItem { weight, count: Count::Always, refund: Some(window), ..spend.clone() };
        let gone = job(&*store, "refund", &[refund(4, window.saturating_sub(5))]).await;
        let expected = if algorithm.is_bucket() { 8 } else { 4 };
        // What is left once the refund is given back (a bucket's, whatever window it names).
        assert_eq!(gone.verdicts[0].remaining, expected, "{name} {algorithm:?}: a window long gone");
        let back = job(&*store, "refund", &[refund(3, window)]).await;
        let expected = if algorithm.is_bucket() { 10 } else { 7 };
        assert_eq!(back.verdicts[0].remaining, expected, "{name} {algorithm:?}: {back:?}");
        let all = job(&*store, "refund", &[refund(100, window)]).await;
        assert_eq!(all.verdicts[0].remaining, 10, "{name} {algorithm:?}: never below 0");
    }
    // A sliding day: 10 counted on the eve, 4 given back the next day from
    // the previous window, which then weighs 6.
    let day = Calendar::new(Period::Day, "UTC").unwrap();
    let eve = utc("2026-11-27T23:00:00Z");
    let at =
        |now_ms, weight| ManyItem { weight, ..in_period("days", &day, Algorithm::SlidingWindow, 10, now_ms) };
    let spent = job(&*store, "refund", &[at(eve, 10)]).await;
    let window = at(eve, 10).window_at(spent.now_ms);
    let midnight = utc("2026-11-28T00:00:00Z");
    let back = ManyItem { count: Count::Always, refund: Some(window), ..at(midnight, 4) };
    job(&*store, "refund", &[back]).await;
    let next = job(&*store, "refund", &[ManyItem { count: Count::Never, ..at(midnight, 1) }]).await;
    assert_eq!((next.verdicts[0].admitted, next.verdicts[0].remaining), (true, 4), "{name}: {next:?}");
}

/// One module per store, one test per behaviour: `$open` (an async block)
/// gives the store and what must live as long as it; `$fill` makes it full.
macro_rules! stores {
    ($($store:ident: $open:expr, $fill:expr;)*) => {$(
        mod $store {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn each_algorithm_admits_its_capacity_then_tells_the_wait() {
                let (store, _keep) = $open.await;
                super::each_algorithm_admits_its_capacity_then_tells_the_wait(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_hit_that_does_not_fit_is_refused_whole() {
                let (store, _keep) = $open.await;
                super::a_hit_that_does_not_fit_is_refused_whole(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn several_limits_are_decided_all_or_nothing() {
                let (store, _keep) = $open.await;
                super::several_limits_are_decided_all_or_nothing(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn reports_are_counted_past_the_limit() {
                let (store, _keep) = $open.await;
                super::reports_are_counted_past_the_limit(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn slots_in_flight_are_taken_and_given_back() {
                let (store, _keep) = $open.await;
                super::slots_in_flight_are_taken_and_given_back(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_peek_counts_nothing() {
                let (store, _keep) = $open.await;
                super::a_peek_counts_nothing(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn counters_expire_with_their_window() {
                let (store, _keep) = $open.await;
                super::counters_expire_with_their_window(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_groups_counters_are_listed() {
                let (store, _keep) = $open.await;
                super::a_groups_counters_are_listed(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn calendar_periods_count_on_the_decisions_clock() {
                let (store, _keep) = $open.await;
                super::calendar_periods_count_on_the_decisions_clock(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn refunds_give_back_to_the_window_counted_in() {
                let (store, _keep) = $open.await;
                super::refunds_give_back_to_the_window_counted_in(store).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_full_store_never_admits_past_a_limit() {
                let (store, keep) = $open.await;
                let fill = $fill;
                super::a_full_store_never_admits_past_a_limit(Arc::clone(&store), || fill(store, &keep)).await;
            }
        }
    )*};
}

stores! {
    memory: async { (open::memory(1_000), ()) },
        |store, _| fill_with_counters(store, 1_000);
    local: async { (open::local(1_000), ()) },
        |store, _| fill_with_counters(store, 1_000);
    redis: async {
        let server = RedisServer::start();
        let (store, dispatchers) = open::redis(server.url(), false).await;
        (store, (server, dispatchers))
    },
        |_, (server, _): &(RedisServer, _)| {
            let port = server.port;
            async move { common::redis_config_set(&[port], "maxmemory", "1") }
        };
    cluster: async {
        let cluster = RedisCluster::start();
        let (store, dispatchers) = open::redis(cluster.url(), true).await;
        (store, (cluster, dispatchers))
    },
        |_, (cluster, _): &(RedisCluster, _)| {
            let ports = cluster.ports();
            async move { common::redis_config_set(&ports, "maxmemory", "1") }
        };
}
