//! A flood of distinct keys against the in-memory store at its embedded
//! defaults (`memory.*` unset): 10 million distinct worst-case user ids
//! (`limits.max_user_id_bytes` long), each decided (the counters that count
//! least evicted into each shard's summary), keep the counter count at
//! `memory.max_counters` and the process's resident memory under the bound
//! docs/operations.md documents (`MEMORY_BOUND_BYTES_PER_COUNTER` per counter over the
//! base). Its own test binary, so the RSS read is this flood's alone.

use std::{sync::Arc, time::Instant};

use ratelimitd::{
    config::Config,
    limiter::{Count, CounterSpec, FailureKind, MemoryStore, SystemClock, WindowParams},
};

/// What docs/operations.md promises per counter at the longest user id, allocator
/// overhead and map growth included.
const MEMORY_BOUND_BYTES_PER_COUNTER: u64 = 512;

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[test]
fn ten_million_distinct_keys_stay_under_the_documented_bound() {
    let config = Config::default();
    let store = MemoryStore::new(config.memory.shards, config.memory.max_counters, Arc::new(SystemClock));
    let id: Arc<str> = Arc::from("flooded-rule");
    // A window long enough that nothing expires during the test: the worst
    // case, where only counters that still count can be evicted.
    let counter = CounterSpec { id: &id, window: WindowParams::sliding(3_600_000, 10) };
    let max_len = config.limits.max_user_id_bytes;
    let base = rss_bytes();
    let started = Instant::now();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get()).min(4);
    let per_thread = 10_000_000 / threads;
    let (admitted, full): (u64, u64) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let store = &store;
                scope.spawn(move || {
                    let mut user = "u".repeat(max_len);
                    let (mut admitted, mut full) = (0, 0);
                    for n in 0..per_thread {
                        user.truncate(max_len - 20);
                        use std::fmt::Write as _;
                        let _ = write!(user, "{t:>10}{n:>10}");
                        match store.decide(&user, counter, 1, Count::IfFits) {
                            Ok(verdict) => admitted += u64::from(verdict.admitted),
                            Err(e) => {
                                assert_eq!(e.kind, FailureKind::StoreFull);
                                full += 1;
                            }
                        }
                    }
                    (admitted, full)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    });
    let grown = rss_bytes().saturating_sub(base);
    let max = store.max_counters() as u64;
    eprintln!(
        "{} keys in {:.1?}: {admitted} counted, {full} refused as store_full, {} counters ({} evicted), RSS +{} MB ({} B per counter)",
        per_thread * threads,
        started.elapsed(),
        store.len(),
        store.live_evictions(),
        grown >> 20,
        grown / max
    );
    let total = (per_thread * threads) as u64;
    let held = store.len() as u64;
    assert!(held <= max && held > max * 99 / 100, "{held} of {max}");
    assert_eq!((admitted, full), (total, 0), "every key decided, and admitted: one hit of 10");
    assert_eq!(store.live_evictions(), total - held);
    assert!(grown <= max * MEMORY_BOUND_BYTES_PER_COUNTER, "RSS grew {grown} bytes for {max} counters");
}
