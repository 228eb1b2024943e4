//! Load shedding's figures for `/metrics` (`telemetry::Figures`): the
//! requests shed per priority and mode, the level and the reading it is
//! decided on, and the latency signal's pressure and p90.

use std::fmt::Write as _;

use super::{Priority, Shedder};
use crate::telemetry::exposition::{Figures, header, single};

impl Figures for Shedder {
    fn render(&self, out: &mut String) {
        header(
            out,
            "ratelimitd_shed_total",
            "counter",
            "Requests refused (mode=enforce) or flagged (mode=shadow) by load shedding, by priority.",
        );
        for p in [Priority::Critical, Priority::Degraded, Priority::BestEffort, Priority::Bulk] {
            let _ = writeln!(
                out,
                "ratelimitd_shed_total{{priority=\"{p}\",mode=\"enforce\"}} {}",
                self.shed_count(p)
            );
            let _ = writeln!(
                out,
                "ratelimitd_shed_total{{priority=\"{p}\",mode=\"shadow\"}} {}",
                self.shadow_shed_count(p)
            );
        }
        single(
            out,
            "ratelimitd_utilization_level",
            "gauge",
            "Shedding level: 0 NORMAL, 1 DEGRADED_MODE, 2 CRITICAL_ONLY.",
            self.level().to_u8(),
        );
        single(
            out,
            "ratelimitd_utilization_ratio",
            "gauge",
            "The smoothed reading (0..1) the level is decided on: CPU utilization, latency pressure or the higher of both (shed.signal).",
            self.utilization().unwrap_or(0.0),
        );
        let (pressure, p90_micros) = self.latency();
        single(
            out,
            "ratelimitd_shed_latency_pressure_ratio",
            "gauge",
            "Latency pressure (0..1): 1 - (baseline + shed.latency_tolerance_ms) / p90 of the store calls (0 unless shed.signal reads latency).",
            pressure,
        );
        #[allow(clippy::cast_precision_loss)]
        let p90 = p90_micros as f64 / 1e6;
        single(
            out,
            "ratelimitd_shed_store_latency_p90_seconds",
            "gauge",
            "The last sampling interval's p90 of the store calls, to a power of two µs (0 unless shed.signal reads latency).",
            p90,
        );
    }
}
