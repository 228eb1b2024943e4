//! `shed.*`: priority load shedding (docs/design.md §7).

use std::path::PathBuf;

use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::shed::{Priority, ShedMode, ShedSignal, Source, Thresholds};

/// `shed.*`: priority load shedding (docs/design.md §7).
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShedConfig {
    /// `enforce` refuses shed requests (reason SHED); `shadow` decides them
    /// normally and flags `shadow_shed`; `off` neither samples nor sheds.
    /// In compat mode (`RATELIMITD_COMPAT=envoyproxy`) the default is
    /// `shadow`: upstream never sheds.
    pub mode: ShedMode,
    /// What the level is decided on: `cpu` (utilization, `shed.source`),
    /// `latency` (the store calls' p90 against its own unloaded baseline:
    /// `1 − (baseline + latency_tolerance_ms) / p90`, read against the same
    /// thresholds; a remote store's calls only), or `both` (the higher).
    pub signal: ShedSignal,
    /// Latency within this many ms of the baseline p90 is no pressure
    /// (`shed.signal: latency | both`).
    pub latency_tolerance_ms: f64,
    /// What utilization measures: `process` (the service's own CPU use:
    /// its cgroup against the quota when one is set, else the process
    /// against the CPUs its affinity mask allows), or `host` (the whole
    /// host's busy share, neighbours included).
    pub source: Source,
    /// Where `self/stat`, `self/status` (process) and `stat` (host) are read.
    pub procfs_root: PathBuf,
    /// The process's cgroup directory: `cpu.max` and `cpu.stat` (v2) for `shed.source: process`,
    /// and its memory limit (v2 `memory.max`, v1 `memory/memory.limit_in_bytes`), of which
    /// `grpc.max_request_bytes_in_flight` is a fraction by default.
    pub cgroup_root: PathBuf,
    /// Utilization (0..1) at which DEGRADED_MODE starts: BULK and BEST_EFFORT are shed.
    pub degraded_at: f64,
    /// Utilization (0..1) at which CRITICAL_ONLY starts: DEGRADED is shed too.
    pub critical_only_at: f64,
    /// A level is left only when utilization falls this far below its threshold.
    pub hysteresis: f64,
    /// How often utilization is sampled.
    pub sample_interval_ms: u64,
    /// Weight of a new sample in the moving average (0 < x <= 1); lower is smoother.
    pub smoothing: f64,
    /// Priority of requests that state none and match no rule.
    pub default_priority: Priority,
    /// Believe a priority the request states (Check's `priority`, Envoy's `envoy.priority_key`
    /// entry); `false`: it may only lower the rule's, domain's or default priority, so a gateway
    /// forwarding a client's value cannot let the client declare itself CRITICAL. Turn it on only
    /// where every caller sets the priority itself (from the route, never from a client's header).
    pub trust_request_priority: bool,
    /// Centre of the jittered `retry_after_ms` of shed requests (spread over ±50%).
    pub retry_after_ms: u64,
    /// How often, at most, the shed counts are logged while shedding.
    pub report_interval_ms: u64,
}

impl Default for ShedConfig {
    fn default() -> Self {
        Self {
            mode: ShedMode::Enforce,
            signal: ShedSignal::Cpu,
            latency_tolerance_ms: 1.0,
            source: Source::Process,
            procfs_root: PathBuf::from("/proc"),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
            degraded_at: 0.60,
            critical_only_at: 0.85,
            hysteresis: 0.05,
            sample_interval_ms: 250,
            smoothing: 0.3,
            default_priority: Priority::Degraded,
            trust_request_priority: false,
            retry_after_ms: 1_000,
            report_interval_ms: 10_000,
        }
    }
}

impl ShedConfig {
    /// The level thresholds.
    pub fn thresholds(&self) -> Thresholds {
        Thresholds {
            degraded_at: self.degraded_at,
            critical_only_at: self.critical_only_at,
            hysteresis: self.hysteresis,
        }
    }
}

impl ShedConfig {
    /// Checks `shed.*`: thresholds in order, smoothing and intervals in range.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(0.0..=60_000.0).contains(&self.latency_tolerance_ms) {
            return Err(invalid(
                "shed.latency_tolerance_ms",
                format!("must be within 0..60000, got {}", self.latency_tolerance_ms),
            ));
        }
        if !(self.degraded_at > 0.0 && self.degraded_at <= 1.0) {
            return Err(invalid("shed.degraded_at", format!("must be in (0, 1], got {}", self.degraded_at)));
        }
        if !(self.critical_only_at >= self.degraded_at && self.critical_only_at <= 1.0) {
            return Err(invalid(
                "shed.critical_only_at",
                format!("must be in [shed.degraded_at, 1], got {}", self.critical_only_at),
            ));
        }
        if !(self.hysteresis >= 0.0 && self.hysteresis < self.degraded_at) {
            return Err(invalid(
                "shed.hysteresis",
                format!("must be in [0, shed.degraded_at), got {}", self.hysteresis),
            ));
        }
        if !(self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(invalid("shed.smoothing", format!("must be in (0, 1], got {}", self.smoothing)));
        }
        if self.sample_interval_ms < 10 {
            return Err(invalid("shed.sample_interval_ms", "must be at least 10"));
        }
        if self.retry_after_ms == 0 {
            return Err(invalid("shed.retry_after_ms", "must be at least 1"));
        }
        if self.report_interval_ms == 0 {
            return Err(invalid("shed.report_interval_ms", "must be at least 1"));
        }
        Ok(())
    }
}
