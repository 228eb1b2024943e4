//! The circuit breaker around the Redis store: while Redis is unreachable,
//! decisions are answered by their failure policy at once (no queueing, no
//! connection attempt, no waiting for `redis.timeout_ms`), and one probe
//! decision at a time finds out whether Redis is back.
//!
//! States, in two atomics (the closed hot path is one relaxed load):
//! - **closed**: every decision goes to Redis. Sustained failure opens it:
//!   at least `redis.breaker_failures` consecutive failed script calls
//!   (unreachable, connection lost, deadline missed — not script errors:
//!   Redis answered) spanning at least `redis.breaker_min_failing_ms` from
//!   the first of them. A pause shorter than that (a fork for BGSAVE, a
//!   `DEBUG SLEEP 0.03`) fails only the decisions it delays and opens no
//!   breaker, so a fleet of instances behind one Redis does not switch to
//!   fail-fast all at once.
//! - **open** until `redis.breaker_open_ms` have passed: decisions fail fast
//!   with `circuit_open`.
//! - **half-open**: the first decision after that is let through as the
//!   probe (a real decision); the others still fail fast. Its success closes
//!   the breaker, its failure opens it for another `breaker_open_ms`. A probe
//!   that never reports (its caller gave up before the batch was sent) is
//!   replaced once `breaker_open_ms` has passed again, so the breaker cannot
//!   stick half-open.
//!
//! The readiness monitor probes Redis whatever the traffic and closes the
//! breaker when the probe succeeds ([`Breaker::close`]): a breaker that made
//! an instance unready, so that no traffic (and no probe decision) reaches
//! it, still closes.
//!
//! So at most one connection attempt per `breaker_open_ms` reaches a dead
//! Redis (no reconnect stampede), and exact decisions resume within
//! `breaker_open_ms` plus one round trip of Redis returning.

use std::{
    sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering},
    time::{Duration, Instant},
};

const CLOSED: u8 = 0;
const OPEN: u8 = 1;
const HALF_OPEN: u8 = 2;

/// What [`Breaker::admit`] decided for one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Send it to Redis.
    Pass,
    /// Send it: it is the half-open probe.
    Probe,
    /// Fail fast: the breaker is open.
    Reject,
}

/// Shared by every dispatcher of one store (one per range of slots in a
/// cluster).
#[derive(Debug)]
pub struct Breaker {
    state: AtomicU8,
    /// While open or half-open: ms since `epoch` before which no (new) probe
    /// is let through.
    until_ms: AtomicU64,
    failures: AtomicU32,
    /// ms since `epoch` of the first failure of the current run.
    first_failure_ms: AtomicU64,
    threshold: u32,
    min_failing_ms: u64,
    open_ms: u64,
    epoch: Instant,
    /// What it guards, for logs: `redis`, or a range of cluster slots.
    scope: String,
}

impl Breaker {
    /// Opens after `threshold` consecutive failures spanning at least
    /// `min_failing`, for `open`. A threshold of 0 disables the breaker.
    /// `scope` names what it guards in logs.
    pub fn new(threshold: u32, min_failing: Duration, open: Duration, scope: String) -> Self {
        Breaker {
            state: AtomicU8::new(CLOSED),
            until_ms: AtomicU64::new(0),
            failures: AtomicU32::new(0),
            first_failure_ms: AtomicU64::new(0),
            threshold,
            min_failing_ms: u64::try_from(min_failing.as_millis()).unwrap_or(u64::MAX),
            open_ms: u64::try_from(open.as_millis()).unwrap_or(u64::MAX),
            epoch: Instant::now(),
            scope,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Whether a decision may go to Redis now.
    pub fn admit(&self) -> Admission {
        if self.state.load(Ordering::Relaxed) == CLOSED {
            return Admission::Pass;
        }
        let now = self.now_ms();
        let until = self.until_ms.load(Ordering::Acquire);
        if now < until {
            return Admission::Reject;
        }
        // One caller wins the right to probe until `now + open_ms`.
        match self.until_ms.compare_exchange(
            until,
            now.saturating_add(self.open_ms),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                // A success may have closed it meanwhile: then this is a plain pass.
                match self.state.compare_exchange(OPEN, HALF_OPEN, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => Admission::Probe,
                    Err(CLOSED) => Admission::Pass,
                    Err(_) => Admission::Probe,
                }
            }
            Err(_) => Admission::Reject,
        }
    }

    /// A script call succeeded: Redis is there.
    pub fn success(&self) {
        self.close();
    }

    /// Redis answered (a decision, or the readiness monitor's probe):
    /// closes the breaker and forgets the failures.
    pub fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        if self.state.swap(CLOSED, Ordering::AcqRel) != CLOSED {
            tracing::info!(scope = %self.scope, "redis answers again; circuit breaker closed");
        }
    }

    /// A script call failed because Redis could not be reached or did not
    /// answer in time.
    pub fn failure(&self) {
        if self.threshold == 0 {
            return;
        }
        let state = self.state.load(Ordering::Acquire);
        let now = self.now_ms();
        let before = self.failures.fetch_add(1, Ordering::AcqRel);
        if before == 0 {
            self.first_failure_ms.store(now, Ordering::Release);
        }
        let failures = before.saturating_add(1);
        let failing_ms = now.saturating_sub(self.first_failure_ms.load(Ordering::Acquire));
        let sustained = failures >= self.threshold && failing_ms >= self.min_failing_ms;
        if state == HALF_OPEN || (state == CLOSED && sustained) {
            self.until_ms.store(self.now_ms().saturating_add(self.open_ms), Ordering::Release);
            if self.state.swap(OPEN, Ordering::AcqRel) == CLOSED {
                tracing::warn!(
                    scope = %self.scope,
                    failures,
                    failing_ms,
                    open_ms = self.open_ms,
                    "redis unreachable; circuit breaker open: decisions follow their failure policy at once"
                );
            }
        }
    }

    /// Whether decisions currently fail fast (open, or half-open with its
    /// probe out).
    pub fn is_open(&self) -> bool {
        self.state.load(Ordering::Relaxed) != CLOSED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_consecutive_failures_only() {
        let b = Breaker::new(3, Duration::ZERO, Duration::from_secs(60), "test".to_owned());
        b.failure();
        b.failure();
        b.success();
        b.failure();
        b.failure();
        assert_eq!(b.admit(), Admission::Pass, "a success resets the count");
        b.failure();
        assert!(b.is_open());
        assert_eq!(b.admit(), Admission::Reject);
    }

    #[test]
    fn one_probe_after_the_open_time_then_closes_on_success() {
        let b = Breaker::new(1, Duration::ZERO, Duration::ZERO, "test".to_owned());
        b.failure();
        assert_eq!(b.admit(), Admission::Probe);
        assert_eq!(b.admit(), Admission::Probe, "open_ms 0: a lost probe is replaced at once");
        b.success();
        assert!(!b.is_open());
        assert_eq!(b.admit(), Admission::Pass);
    }

    #[test]
    fn a_failed_probe_reopens() {
        let b = Breaker::new(1, Duration::ZERO, Duration::from_secs(60), "test".to_owned());
        b.failure();
        // Pretend the open time passed.
        b.until_ms.store(0, Ordering::Release);
        assert_eq!(b.admit(), Admission::Probe);
        assert_eq!(b.admit(), Admission::Reject, "only one probe at a time");
        b.failure();
        assert!(b.is_open());
        assert_eq!(b.admit(), Admission::Reject);
    }

    #[test]
    fn threshold_zero_never_opens() {
        let b = Breaker::new(0, Duration::ZERO, Duration::from_secs(60), "test".to_owned());
        for _ in 0..100 {
            b.failure();
        }
        assert_eq!(b.admit(), Admission::Pass);
    }

    #[test]
    fn a_short_run_of_failures_opens_nothing_a_sustained_one_does() {
        let mut b = Breaker::new(3, Duration::from_millis(200), Duration::from_secs(60), "test".to_owned());
        // Ten seconds into the breaker's life, so the run can be dated back.
        b.epoch = Instant::now().checked_sub(Duration::from_secs(10)).unwrap();
        for _ in 0..50 {
            b.failure();
        }
        assert!(!b.is_open(), "50 failures within a few ms are a pause, not an outage");
        // The run began 200 ms ago.
        b.first_failure_ms.store(b.now_ms() - 200, Ordering::Release);
        b.failure();
        assert!(b.is_open());
        // A success ends the run: the next failure starts a new one.
        b.close();
        b.failure();
        b.failure();
        b.failure();
        assert!(!b.is_open());
    }
}
