//! Latency as a shedding signal (`shed.signal: latency | both`): the tail
//! of the store calls' latency against its own unloaded baseline, a
//! gradient in the manner of TCP Vegas and Netflix's concurrency limiters.
//! Tail latency rises before CPU does when the store, not this process, is
//! what saturates.
//!
//! The hot path only counts: one relaxed `fetch_add` into a log2 histogram
//! per timed store call ([`LatencyMeter::record`]). The sampler takes the
//! histogram each interval, reads its p90, keeps the baseline (the lowest
//! p90 seen, let up by 1% an interval so a lasting change is learnt) and
//! turns the two into a pressure in 0..1 that the levels' thresholds read
//! like utilization:
//!
//! `pressure = 1 − (baseline + tolerance) / p90`, clamped to 0..1,
//!
//! so a p90 within `shed.latency_tolerance_ms` of the baseline is no
//! pressure at all, and with the default thresholds DEGRADED starts at
//! 2.5 × (baseline + tolerance) and CRITICAL_ONLY at about 6.7 ×. An
//! interval with fewer than [`MIN_SAMPLES`] calls is no evidence on its
//! own: the last pressure stands and its calls are read with the next
//! interval's, so a store slow enough to slow its callers down (fewer calls
//! an interval) is still seen. Only calls that leave the process are timed (a remote
//! store); with the in-memory store the pressure stays 0.

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

/// Buckets of the histogram: bucket `i` holds calls of `2^(i-1)..2^i` µs
/// (bucket 0: under 1 µs); the last holds everything longer (about 18 min).
const BUCKETS: usize = 32;

/// Fewest calls in an interval that say anything about its latency.
pub const MIN_SAMPLES: u64 = 20;

/// The store calls' latencies since the sampler last took them.
#[derive(Debug, Default)]
pub struct LatencyMeter {
    buckets: [AtomicU64; BUCKETS],
}

impl LatencyMeter {
    /// Counts one call of `elapsed`.
    #[inline]
    pub fn record(&self, elapsed: Duration) {
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        let bucket = (u64::BITS - micros.leading_zeros()) as usize;
        self.buckets[bucket.min(BUCKETS - 1)].fetch_add(1, Ordering::Relaxed);
    }

    /// The p90 in µs of the calls since the last take (the upper bound of
    /// its bucket), emptying the histogram; `None`, the calls kept for the
    /// next take, under [`MIN_SAMPLES`].
    pub fn take_p90_micros(&self) -> Option<u64> {
        let seen: u64 = self.buckets.iter().map(|b| b.load(Ordering::Relaxed)).sum();
        if seen < MIN_SAMPLES {
            return None;
        }
        // Calls counted since the sum only add to what is taken.
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.swap(0, Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        let rank = total - total / 10;
        let mut seen = 0;
        for (i, count) in counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return Some(1u64 << i);
            }
        }
        Some(1u64 << (BUCKETS - 1))
    }
}

/// The sampler's side: the baseline and the smoothed pressure.
#[derive(Debug, Clone)]
pub struct LatencySignal {
    /// The lowest p90 seen, in µs, let up slowly; `None` until one is.
    baseline: Option<f64>,
    tolerance_micros: f64,
    alpha: f64,
    pressure: f64,
}

impl LatencySignal {
    /// A signal counting `tolerance` above the baseline as no pressure,
    /// smoothed by `alpha` (the weight of a new reading, as `shed.smoothing`).
    pub fn new(tolerance: Duration, alpha: f64) -> Self {
        LatencySignal {
            baseline: None,
            tolerance_micros: tolerance.as_secs_f64() * 1e6,
            alpha,
            pressure: 0.0,
        }
    }

    /// The pressure after an interval whose p90 was `p90_micros` (`None`:
    /// too few calls; the last pressure stands).
    pub fn update(&mut self, p90_micros: Option<u64>) -> f64 {
        let Some(p90) = p90_micros else { return self.pressure };
        #[allow(clippy::cast_precision_loss)]
        let p90 = p90 as f64;
        let baseline = self.baseline.map_or(p90, |b| (b * 1.01).min(p90));
        self.baseline = Some(baseline);
        let reading = (1.0 - (baseline + self.tolerance_micros) / p90).clamp(0.0, 1.0);
        self.pressure += self.alpha * (reading - self.pressure);
        self.pressure
    }

    /// The baseline p90 in µs, once one was seen.
    pub fn baseline_micros(&self) -> Option<f64> {
        self.baseline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p90_comes_from_the_log2_histogram_and_needs_enough_calls() {
        let meter = LatencyMeter::default();
        for _ in 0..19 {
            meter.record(Duration::from_micros(100));
        }
        assert_eq!(meter.take_p90_micros(), None, "19 calls: no evidence");
        assert_eq!(meter.take_p90_micros(), None, "still 19, kept");
        meter.record(Duration::from_micros(100));
        assert_eq!(meter.take_p90_micros(), Some(128), "the 20th call: read with the 19 kept");
        assert_eq!(meter.take_p90_micros(), None, "taken: empty");
        for _ in 0..90 {
            meter.record(Duration::from_micros(100));
        }
        for _ in 0..10 {
            meter.record(Duration::from_millis(50));
        }
        assert_eq!(meter.take_p90_micros(), Some(128), "90% at 100 µs (the 64..128 bucket)");
        for _ in 0..80 {
            meter.record(Duration::from_micros(100));
        }
        for _ in 0..20 {
            meter.record(Duration::from_millis(50));
        }
        assert_eq!(meter.take_p90_micros(), Some(65_536), "the tail moved the p90");
        meter.record(Duration::from_secs(100_000));
    }

    #[test]
    fn pressure_rises_with_the_tail_over_the_baseline_and_falls_back() {
        let mut signal = LatencySignal::new(Duration::from_millis(1), 1.0);
        assert_eq!(signal.update(Some(128)), 0.0, "the first reading is the baseline");
        assert_eq!(signal.update(Some(1_024)), 0.0, "within the tolerance");
        let hot = signal.update(Some(4_096));
        assert!((hot - (1.0 - 1_128.0 / 4_096.0)).abs() < 0.01, "{hot}");
        assert!(signal.update(Some(16_384)) > 0.85, "CRITICAL_ONLY territory");
        assert_eq!(signal.update(None), signal.update(None), "no evidence: unchanged");
        assert_eq!(signal.update(Some(128)), 0.0, "back to the baseline");
        // The baseline follows a lasting rise, 1% an interval.
        for _ in 0..500 {
            signal.update(Some(4_096));
        }
        assert!(signal.baseline_micros().unwrap() > 4_000.0 && signal.update(Some(4_096)) == 0.0);
        let mut smooth = LatencySignal::new(Duration::ZERO, 0.5);
        smooth.update(Some(100));
        let reading = 1.0 - 101.0 / 200.0; // the baseline let up 1%
        assert!((smooth.update(Some(200)) - 0.5 * reading).abs() < 1e-9, "half of the reading");
    }
}
