//! Load shedding's figures for `/metrics` (`telemetry::Figures`): the
//! requests shed per priority and mode, the level and the utilization it
//! is decided on.

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
            "Smoothed CPU utilization (0..1) the level is decided on.",
            self.utilization().unwrap_or(0.0),
        );
    }
}
