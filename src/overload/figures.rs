//! The overload layer's figures for `/metrics` (`telemetry::Figures`):
//! per bucket the requests, drops, the drop ratio and the directive's age;
//! the mode in force and the exchanges with the global view. Buckets are
//! configured directives × tenants of the table: bounded by configuration,
//! never by requests.

use std::fmt::Write as _;

use super::{Overload, Table};
use crate::{
    clock::{Clock as _, SystemClock},
    rules::OverloadMode,
    telemetry::exposition::{Figures, escape, header},
};

impl Overload {
    /// The requests dropped so far, over every bucket (the store calls the
    /// layer saved).
    pub fn dropped(&self) -> u64 {
        self.table().all().flat_map(|d| d.slots.iter()).map(|slot| slot.counts().1).sum()
    }
}

impl Figures for Overload {
    fn render(&self, out: &mut String) {
        self.render_state(out);
        self.render_buckets(out);
    }
}

impl Overload {
    /// The mode in force and the exchanges with the global view.
    fn render_state(&self, out: &mut String) {
        header(
            out,
            "ratelimitd_overload_mode",
            "gauge",
            "The overload layer's mode in force (1 for the one in force).",
        );
        for mode in [OverloadMode::Enforce, OverloadMode::Shadow, OverloadMode::Off] {
            let on = u8::from(self.mode() == mode);
            let _ = writeln!(out, "ratelimitd_overload_mode{{mode=\"{}\"}} {on}", mode.as_str());
        }
    }

    /// Per bucket: requests offered and dropped, the drop ratio applied,
    /// the directive's age.
    fn render_buckets(&self, out: &mut String) {
        let table = self.table();
        header(
            out,
            "ratelimitd_overload_requests_total",
            "counter",
            "Requests the overload layer saw per bucket, and those it dropped (or would have, in shadow).",
        );
        for d in table.all() {
            for slot in &*d.slots {
                let (offered, dropped, shadow) = slot.counts();
                let labels = format!(
                    "kind=\"{}\",bucket=\"{}\",tenant=\"{}\"",
                    d.kind.as_str(),
                    escape(&d.name),
                    escape(&slot.tenant)
                );
                let _ = writeln!(
                    out,
                    "ratelimitd_overload_requests_total{{{labels},result=\"offered\"}} {offered}"
                );
                let _ = writeln!(
                    out,
                    "ratelimitd_overload_requests_total{{{labels},result=\"dropped\"}} {dropped}"
                );
                let _ = writeln!(
                    out,
                    "ratelimitd_overload_requests_total{{{labels},result=\"shadow_dropped\"}} {shadow}"
                );
            }
        }
        self.render_directives(out, &table);
    }

    /// Per bucket the drop ratio applied now; per directive its age.
    fn render_directives(&self, out: &mut String, table: &Table) {
        let now = SystemClock.now_ms();
        header(
            out,
            "ratelimitd_overload_drop_ratio",
            "gauge",
            "The drop probability applied now, per bucket.",
        );
        for d in table.all() {
            for slot in &*d.slots {
                let _ = writeln!(
                    out,
                    "ratelimitd_overload_drop_ratio{{kind=\"{}\",bucket=\"{}\",tenant=\"{}\"}} {}",
                    d.kind.as_str(),
                    escape(&d.name),
                    escape(&slot.tenant),
                    slot.drop_ratio()
                );
            }
        }
        header(
            out,
            "ratelimitd_overload_directive_age_seconds",
            "gauge",
            "Seconds since the directive's drop ratios were computed from a fresh global view.",
        );
        for d in table.all() {
            let _ = writeln!(
                out,
                "ratelimitd_overload_directive_age_seconds{{kind=\"{}\",bucket=\"{}\"}} {}",
                d.kind.as_str(),
                escape(&d.name),
                d.age_ms(now) as f64 / 1_000.0
            );
        }
    }
}
