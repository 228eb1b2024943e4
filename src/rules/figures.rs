//! The rule sets' figures for `/metrics` (`telemetry::Figures`): the
//! loaded sets (version, size, age, rejected reloads), the rules topic's
//! feed and the xDS subscription.

use std::{fmt::Write as _, sync::Arc, time::SystemTime};

use super::{Feed, Hot, Snapshot, Versioned, XdsState, envoy::EnvoyConfig};
use crate::telemetry::exposition::{Figures, header, labelled, single};

/// The native rule set and, when served, the Envoy configuration.
#[derive(Debug)]
pub struct RuleSets {
    /// Native rules.
    pub native: Arc<Hot<Snapshot>>,
    /// The Envoy configuration, if served.
    pub envoy: Option<Arc<Hot<EnvoyConfig>>>,
}

impl Figures for RuleSets {
    fn render(&self, out: &mut String) {
        header(out, "ratelimitd_rules_info", "gauge", "The loaded rule sets (value 1), by kind and version.");
        let native = self.native.load();
        let _ = writeln!(out, "ratelimitd_rules_info{{kind=\"native\",version=\"{}\"}} 1", native.version());
        let envoy = self.envoy.as_ref().map(|e| e.load());
        if let Some(envoy) = &envoy {
            let _ =
                writeln!(out, "ratelimitd_rules_info{{kind=\"envoy\",version=\"{}\"}} 1", envoy.version());
        }
        header(out, "ratelimitd_rules_count", "gauge", "Native rules, or Envoy domains, in the loaded set.");
        let _ = writeln!(out, "ratelimitd_rules_count{{kind=\"native\"}} {}", native.size());
        if let Some(envoy) = &envoy {
            let _ = writeln!(out, "ratelimitd_rules_count{{kind=\"envoy\"}} {}", envoy.size());
        }
        header(
            out,
            "ratelimitd_rules_age_seconds",
            "gauge",
            "Seconds since the loaded rule set was swapped in.",
        );
        let _ = writeln!(
            out,
            "ratelimitd_rules_age_seconds{{kind=\"native\"}} {}",
            age(self.native.swapped_at())
        );
        if let Some(e) = &self.envoy {
            let _ = writeln!(out, "ratelimitd_rules_age_seconds{{kind=\"envoy\"}} {}", age(e.swapped_at()));
        }
        header(
            out,
            "ratelimitd_rules_reload_failures_total",
            "counter",
            "Reloads rejected (the previous set kept serving).",
        );
        let _ = writeln!(
            out,
            "ratelimitd_rules_reload_failures_total{{kind=\"native\"}} {}",
            self.native.reload_failures()
        );
        if let Some(e) = &self.envoy {
            let _ = writeln!(
                out,
                "ratelimitd_rules_reload_failures_total{{kind=\"envoy\"}} {}",
                e.reload_failures()
            );
        }
    }
}

/// The rules topic's feed: the published version served (an info metric;
/// the version is a content hash from the topic, never a request value;
/// one series at a time) and the records applied and refused.
impl Figures for Feed {
    fn render(&self, out: &mut String) {
        header(
            out,
            "ratelimitd_rules_published_info",
            "gauge",
            "The published rule set served (value 1), by version and origin (topic | fallback); absent while waiting.",
        );
        if let Some(served) = self.served() {
            let _ = writeln!(
                out,
                "ratelimitd_rules_published_info{{version=\"{}\",origin=\"{}\"}} 1",
                served.version,
                served.origin.as_str()
            );
        }
        single(
            out,
            "ratelimitd_rules_waiting",
            "gauge",
            "1 while no rules have arrived from the rules topic.",
            u8::from(self.served().is_none()),
        );
        labelled(
            out,
            "ratelimitd_rules_records_total",
            "counter",
            "Rules topic records swapped in or refused.",
            "result",
            &[("applied", self.applied()), ("refused", self.rejected())],
        );
    }
}

impl Figures for XdsState {
    fn render(&self, out: &mut String) {
        let (acks, nacks) = self.counts();
        labelled(
            out,
            "ratelimitd_rules_xds_total",
            "counter",
            "Envoy rule sets received over xDS, accepted (ACK) or refused (NACK).",
            "result",
            &[("ack", acks), ("nack", nacks)],
        );
    }
}

fn age(at: SystemTime) -> f64 {
    SystemTime::now().duration_since(at).map_or(0.0, |d| d.as_secs_f64())
}
