//! Priority load shedding (docs/design.md §7): when the service's host or container
//! runs hot, BULK and BEST_EFFORT requests (and, hotter still, DEGRADED ones)
//! are refused before they cost a store call, so CRITICAL traffic keeps its
//! latency.
//!
//! A background task ([`run_sampler`]) measures utilization and moves the
//! level; the hot path reads it with one atomic load ([`Shedder::check`]).
//!
//! Architecture invariant: no gRPC and no store access here.

mod figures;
pub mod latency;
pub mod policy;
mod priority;
pub mod sampler;

use std::{
    cell::Cell,
    hash::{BuildHasher, RandomState},
    sync::{
        Arc,
        atomic::{AtomicU8, AtomicU64, Ordering},
    },
    time::Duration,
};

pub use latency::{LatencyMeter, LatencySignal};
pub use policy::{Level, Thresholds};
pub use priority::Priority;
pub use sampler::{Sampler, Source};
use tokio::sync::watch;

/// Whether shedding refuses requests or only reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ShedMode {
    /// Shed requests are refused with reason SHED.
    #[default]
    Enforce,
    /// Shed requests are decided normally and flagged `shadow_shed`.
    Shadow,
    /// No sampling, no shedding; the status stays NORMAL.
    Off,
}

/// What the shedding level is decided on (`shed.signal`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ShedSignal {
    /// CPU utilization (`shed.source`).
    #[default]
    Cpu,
    /// The store calls' tail latency against its baseline ([`latency`]).
    Latency,
    /// The higher of the two.
    Both,
}

/// A sampler of what the level is decided on: CPU utilization, latency
/// pressure, or the higher of both.
#[derive(Debug)]
pub struct Signal {
    cpu: Option<Sampler>,
    latency: Option<LatencySignal>,
}

impl Signal {
    /// A signal from `cpu`, `latency`, or both (at least one).
    pub fn new(cpu: Option<Sampler>, latency: Option<LatencySignal>) -> Self {
        Signal { cpu, latency }
    }

    /// One reading: the higher of CPU utilization and latency pressure
    /// (the latency's p90 taken from `shedder`'s meter). `Ok(None)`: no
    /// reading yet; an error reading the CPU keeps the last level.
    fn sample(&mut self, shedder: &Shedder) -> Result<Option<f64>, sampler::SampleError> {
        let cpu = match &mut self.cpu {
            Some(sampler) => sampler.sample()?,
            None => None,
        };
        let latency = self.latency.as_mut().map(|signal| {
            let p90 = shedder.latency.take_p90_micros();
            let pressure = signal.update(p90);
            shedder.latency_pressure.store(pressure.to_bits(), Ordering::Relaxed);
            if let Some(p90) = p90 {
                shedder.latency_p90_micros.store(p90, Ordering::Relaxed);
            }
            pressure
        });
        Ok(match (cpu, latency) {
            (Some(c), Some(l)) => Some(c.max(l)),
            (c, l) => c.or(l),
        })
    }
}

/// What shedding says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShedVerdict {
    /// Decide it normally.
    Pass,
    /// Refuse it; ask the client to come back after this many ms.
    Shed {
        /// Jittered so shed clients do not return in lockstep.
        retry_after_ms: u64,
    },
    /// Would be shed, but the mode is shadow: decide it normally and flag it.
    ShadowShed,
}

const PRIORITIES: [Priority; 4] =
    [Priority::Critical, Priority::Degraded, Priority::BestEffort, Priority::Bulk];

fn priority_index(priority: Priority) -> usize {
    match priority {
        Priority::Critical => 0,
        Priority::Degraded => 1,
        Priority::BestEffort => 2,
        Priority::Bulk => 3,
    }
}

/// The current level and the shed counters; shared by the sampler task
/// (writer) and every decision (readers).
#[derive(Debug)]
pub struct Shedder {
    level: AtomicU8,
    /// Smoothed utilization as `f64` bits (NaN until measured).
    utilization: AtomicU64,
    mode: ShedMode,
    retry_after_ms: u64,
    shed: [AtomicU64; 4],
    shadow_shed: [AtomicU64; 4],
    /// Store call latencies, counted when the level reads latency.
    latency: LatencyMeter,
    measure_latency: bool,
    /// The last interval's store call p90 (µs) and the latency pressure (`f64` bits).
    latency_p90_micros: AtomicU64,
    latency_pressure: AtomicU64,
}

impl Shedder {
    /// A shedder at NORMAL. `retry_after_ms` is the centre of the jittered
    /// retry hint given to shed requests.
    pub fn new(mode: ShedMode, retry_after_ms: u64) -> Self {
        Shedder {
            level: AtomicU8::new(Level::Normal.to_u8()),
            utilization: AtomicU64::new(f64::NAN.to_bits()),
            mode,
            retry_after_ms,
            shed: Default::default(),
            shadow_shed: Default::default(),
            latency: LatencyMeter::default(),
            measure_latency: false,
            latency_p90_micros: AtomicU64::new(0),
            latency_pressure: AtomicU64::new(0f64.to_bits()),
        }
    }

    /// This shedder, counting store call latencies (`shed.signal` reads them).
    #[must_use]
    pub fn measuring_latency(self) -> Self {
        Shedder { measure_latency: true, ..self }
    }

    /// Counts one timed store call, when the level reads latency.
    #[inline]
    pub fn record_latency(&self, elapsed: Duration) {
        if self.measure_latency {
            self.latency.record(elapsed);
        }
    }

    /// The last latency pressure (0..1) and store call p90 (µs).
    pub fn latency(&self) -> (f64, u64) {
        (
            f64::from_bits(self.latency_pressure.load(Ordering::Relaxed)),
            self.latency_p90_micros.load(Ordering::Relaxed),
        )
    }

    /// The current level.
    pub fn level(&self) -> Level {
        Level::from_u8(self.level.load(Ordering::Relaxed))
    }

    /// The last smoothed utilization, if measured.
    pub fn utilization(&self) -> Option<f64> {
        Some(f64::from_bits(self.utilization.load(Ordering::Relaxed))).filter(|u| !u.is_nan())
    }

    /// Decides whether a request of `priority` is shed at `level` (the
    /// level the caller read once for the whole decision), and counts it.
    pub fn check(&self, level: Level, priority: Priority) -> ShedVerdict {
        if !policy::sheds(level, priority) {
            return ShedVerdict::Pass;
        }
        match self.mode {
            ShedMode::Enforce => {
                self.shed[priority_index(priority)].fetch_add(1, Ordering::Relaxed);
                ShedVerdict::Shed { retry_after_ms: jitter(self.retry_after_ms) }
            }
            ShedMode::Shadow => {
                self.shadow_shed[priority_index(priority)].fetch_add(1, Ordering::Relaxed);
                ShedVerdict::ShadowShed
            }
            ShedMode::Off => ShedVerdict::Pass,
        }
    }

    /// Requests shed (enforced) so far, by priority.
    pub fn shed_count(&self, priority: Priority) -> u64 {
        self.shed[priority_index(priority)].load(Ordering::Relaxed)
    }

    /// Requests that would have been shed under `shadow` mode, by priority.
    pub fn shadow_shed_count(&self, priority: Priority) -> u64 {
        self.shadow_shed[priority_index(priority)].load(Ordering::Relaxed)
    }

    /// Sets the level and the utilization it was read at: the sampler's job
    /// ([`run_sampler`]); tests and tools pin a level with it.
    pub fn publish(&self, level: Level, utilization: f64) {
        self.utilization.store(utilization.to_bits(), Ordering::Relaxed);
        self.level.store(level.to_u8(), Ordering::Relaxed);
    }

    fn counts(&self) -> [u64; 8] {
        let mut counts = [0; 8];
        for (i, p) in PRIORITIES.into_iter().enumerate() {
            counts[i] = self.shed_count(p);
            counts[4 + i] = self.shadow_shed_count(p);
        }
        counts
    }
}

/// Uniform in `[base/2, base*3/2]`: shed clients spread their retries.
fn jitter(base: u64) -> u64 {
    if base < 2 {
        return base;
    }
    base / 2 + next_random() % (base + 1)
}

/// xorshift64* per thread, seeded from std's random hasher keys: enough to
/// spread retries, no dependency, no lock.
fn next_random() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(RandomState::new().hash_one(std::thread::current().id()) | 1);
    }
    STATE.with(|state| {
        let mut x = state.get();
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        state.set(x);
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    })
}

/// Moves `shedder` to the level `utilization` calls for, logging a change.
fn step(shedder: &Shedder, utilization: f64, thresholds: &Thresholds) {
    let current = shedder.level();
    let next = policy::next_level(current, utilization, thresholds);
    shedder.publish(next, utilization);
    if next != current {
        let utilization = format!("{utilization:.3}");
        if next > current {
            tracing::warn!(from = %current, to = %next, %utilization, "utilization level rising: shedding lower priorities");
        } else {
            tracing::info!(from = %current, to = %next, %utilization, "utilization level falling");
        }
    }
}

/// Samples every `interval`, moves the level and logs transitions and, at
/// most every `report_every`, the shed counts. Returns when `shutdown` turns true.
pub async fn run_sampler(
    mut signal: Signal,
    shedder: Arc<Shedder>,
    thresholds: Thresholds,
    interval: Duration,
    report_every: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    let mut reported = shedder.counts();
    let mut last_report = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        match signal.sample(&shedder) {
            Ok(Some(utilization)) => {
                if failing {
                    tracing::info!("utilization readable again");
                    failing = false;
                }
                step(&shedder, utilization, &thresholds);
            }
            Ok(None) => {}
            Err(e) => {
                // Keep the last level: a broken reading is no evidence either way.
                if !failing {
                    tracing::error!(error = %e, level = %shedder.level(), "cannot read utilization; keeping the last level");
                    failing = true;
                }
            }
        }
        if last_report.elapsed() >= report_every {
            let now = shedder.counts();
            if now != reported {
                let delta = |i: usize| now[i] - reported[i];
                tracing::info!(
                    level = %shedder.level(),
                    critical = delta(0), degraded = delta(1), best_effort = delta(2), bulk = delta(3),
                    shadow_critical = delta(4), shadow_degraded = delta(5), shadow_best_effort = delta(6), shadow_bulk = delta(7),
                    "requests shed since the last report"
                );
                reported = now;
            }
            last_report = tokio::time::Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enforce_sheds_and_counts_by_priority() {
        let shedder = Shedder::new(ShedMode::Enforce, 1_000);
        assert_eq!(shedder.check(Level::Degraded, Priority::Critical), ShedVerdict::Pass);
        assert_eq!(shedder.check(Level::Degraded, Priority::Degraded), ShedVerdict::Pass);
        assert!(matches!(shedder.check(Level::Degraded, Priority::Bulk), ShedVerdict::Shed { .. }));
        assert!(matches!(shedder.check(Level::CriticalOnly, Priority::Degraded), ShedVerdict::Shed { .. }));
        assert_eq!(shedder.shed_count(Priority::Bulk), 1);
        assert_eq!(shedder.shed_count(Priority::Degraded), 1);
        assert_eq!(shedder.shed_count(Priority::Critical), 0);
    }

    #[test]
    fn shadow_mode_reports_without_refusing() {
        let shedder = Shedder::new(ShedMode::Shadow, 1_000);
        assert_eq!(shedder.check(Level::CriticalOnly, Priority::Bulk), ShedVerdict::ShadowShed);
        assert_eq!(shedder.check(Level::CriticalOnly, Priority::Critical), ShedVerdict::Pass);
        assert_eq!(shedder.shadow_shed_count(Priority::Bulk), 1);
        assert_eq!(shedder.shed_count(Priority::Bulk), 0);
    }

    #[test]
    fn retry_after_is_jittered_within_half_to_one_and_a_half() {
        let values: Vec<u64> = (0..1_000).map(|_| jitter(1_000)).collect();
        assert!(values.iter().all(|v| (500..=1_500).contains(v)));
        let distinct: std::collections::HashSet<_> = values.iter().collect();
        assert!(distinct.len() > 100, "only {} distinct values", distinct.len());
    }

    #[test]
    fn level_and_utilization_are_published_together() {
        let shedder = Shedder::new(ShedMode::Enforce, 1_000);
        assert_eq!((shedder.level(), shedder.utilization()), (Level::Normal, None));
        shedder.publish(Level::CriticalOnly, 0.9);
        assert_eq!((shedder.level(), shedder.utilization()), (Level::CriticalOnly, Some(0.9)));
    }
}
