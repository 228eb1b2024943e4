//! Injectable time sources, so time-dependent logic (windows, expiry,
//! utilization deltas) is tested by moving a clock, never by sleeping.

use std::{
    fmt,
    sync::atomic::{AtomicU64, Ordering},
    time::{Instant, SystemTime},
};

/// Milliseconds from a fixed origin (the Unix epoch for [`SystemClock`]),
/// from an injectable source so tests of time-dependent logic never sleep.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Now, in ms since the clock's origin.
    fn now_ms(&self) -> u64;
}

/// The system's wall clock. Windows are aligned to the epoch, as in Redis.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to.
#[derive(Debug, Default)]
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock reading `ms`.
    pub fn new(ms: u64) -> Self {
        ManualClock(AtomicU64::new(ms))
    }

    /// Moves the clock forward by `ms`.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }

    /// Sets the clock to `ms`.
    pub fn set(&self, ms: u64) {
        self.0.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// Milliseconds since this clock was created, from the monotonic clock:
/// immune to wall-clock steps, for measuring intervals.
#[derive(Debug, Clone, Copy)]
pub struct MonotonicClock(Instant);

impl Default for MonotonicClock {
    fn default() -> Self {
        MonotonicClock(Instant::now())
    }
}

impl Clock for MonotonicClock {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}
