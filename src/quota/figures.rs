//! What this instance shows of its RLQS streams, per domain (never per
//! bucket): `/metrics` and the status reports (`rules status`, the
//! console). A domain is named when the Envoy rules have it; every other
//! domain's streams are counted together under `(none)`, so the label's
//! values are bounded by configuration.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
};

use crate::telemetry::exposition::{Figures, escape, header};

/// The label of the domains the Envoy rules do not have.
pub const NONE: &str = "(none)";

/// One domain's figures.
#[derive(Debug, Default)]
pub struct DomainFigures {
    /// Streams open in it: the Envoys reporting.
    streams: AtomicU64,
    /// Buckets its streams hold.
    buckets: AtomicU64,
    /// The shares last assigned on its streams, in thousandths of a
    /// request per second, summed.
    assigned_milli: AtomicU64,
    /// Bucket usage reports taken.
    reports: AtomicU64,
    /// Reports of a bucket under no limit (allowed whole).
    unmatched: AtomicU64,
    /// Assignments that ran out before their Envoy's next report.
    expired: AtomicU64,
    /// Reports answered nothing: the store did not answer, or no room.
    unanswered: AtomicU64,
}

impl DomainFigures {
    /// A stream opened in this domain.
    pub fn stream_opened(&self) {
        self.streams.fetch_add(1, Ordering::Relaxed);
    }

    /// A stream of this domain ended, holding `buckets` assigned
    /// `assigned_milli` in all.
    pub fn stream_closed(&self, buckets: u64, assigned_milli: u64) {
        self.streams.fetch_sub(1, Ordering::Relaxed);
        self.buckets.fetch_sub(buckets, Ordering::Relaxed);
        self.assigned_milli.fetch_sub(assigned_milli, Ordering::Relaxed);
    }

    /// A report of one bucket, `unmatched` when no limit holds it.
    pub fn reported(&self, unmatched: bool) {
        self.reports.fetch_add(1, Ordering::Relaxed);
        if unmatched {
            self.unmatched.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A report answered nothing.
    pub fn unanswered(&self) {
        self.unanswered.fetch_add(1, Ordering::Relaxed);
    }

    /// An assignment ran out before its Envoy reported again.
    pub fn expired(&self) {
        self.expired.fetch_add(1, Ordering::Relaxed);
    }

    /// A bucket's assignment on a stream went from `was` to `now`
    /// (thousandths of a request per second; `None`: not held).
    pub fn assigned(&self, was: Option<u64>, now: Option<u64>) {
        match (was, now) {
            (None, Some(_)) => self.buckets.fetch_add(1, Ordering::Relaxed),
            (Some(_), None) => self.buckets.fetch_sub(1, Ordering::Relaxed),
            _ => 0,
        };
        self.assigned_milli.fetch_add(now.unwrap_or(0), Ordering::Relaxed);
        self.assigned_milli.fetch_sub(was.unwrap_or(0), Ordering::Relaxed);
    }

    /// The figures as a status report carries them.
    pub fn vital(&self) -> crate::rollout::status::RlqsVital {
        crate::rollout::status::RlqsVital {
            envoys: self.streams.load(Ordering::Relaxed),
            buckets: self.buckets.load(Ordering::Relaxed),
            assigned_per_second: self.assigned_milli.load(Ordering::Relaxed) as f64 / 1_000.0,
            reports: self.reports.load(Ordering::Relaxed),
            unmatched: self.unmatched.load(Ordering::Relaxed),
            expired: self.expired.load(Ordering::Relaxed),
            unanswered: self.unanswered.load(Ordering::Relaxed),
        }
    }
}

/// A share of `share` requests per window of `window_s` seconds in
/// thousandths of a request per second.
pub fn milli_per_second(share: u64, window_s: u64) -> u64 {
    u64::try_from(u128::from(share) * 1_000 / u128::from(window_s.max(1))).unwrap_or(u64::MAX)
}

/// Every domain's figures.
#[derive(Debug, Default)]
pub struct QuotaFigures {
    domains: RwLock<HashMap<Arc<str>, Arc<DomainFigures>>>,
}

impl QuotaFigures {
    /// No stream yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The figures of `domain`, or of [`NONE`] when the Envoy rules do
    /// not have it (`known`).
    pub fn domain(&self, domain: &str, known: bool) -> Arc<DomainFigures> {
        let name = if known { domain } else { NONE };
        if let Some(figures) = self.domains.read().unwrap_or_else(|p| p.into_inner()).get(name) {
            return Arc::clone(figures);
        }
        let mut domains = self.domains.write().unwrap_or_else(|p| p.into_inner());
        Arc::clone(domains.entry(Arc::from(name)).or_default())
    }

    /// Each domain's figures as a status report carries them.
    pub fn vitals(&self) -> BTreeMap<String, crate::rollout::status::RlqsVital> {
        let domains = self.domains.read().unwrap_or_else(|p| p.into_inner());
        domains.iter().map(|(name, figures)| (name.to_string(), figures.vital())).collect()
    }
}

impl Figures for QuotaFigures {
    fn render(&self, out: &mut String) {
        use std::fmt::Write as _;
        let vitals = self.vitals();
        type Read = fn(&crate::rollout::status::RlqsVital) -> f64;
        let families: [(&str, &str, &str, Read); 7] = [
            ("ratelimitd_rlqs_envoys", "gauge", "RLQS streams open (Envoys reporting), by domain.", |v| {
                v.envoys as f64
            }),
            (
                "ratelimitd_rlqs_buckets",
                "gauge",
                "RLQS buckets assigned on this instance's streams, by domain.",
                |v| v.buckets as f64,
            ),
            (
                "ratelimitd_rlqs_assigned_per_second",
                "gauge",
                "Shares last assigned on this instance's streams, requests per second summed, by domain.",
                |v| v.assigned_per_second,
            ),
            (
                "ratelimitd_rlqs_reports_total",
                "counter",
                "RLQS bucket usage reports taken, by domain.",
                |v| v.reports as f64,
            ),
            (
                "ratelimitd_rlqs_unmatched_total",
                "counter",
                "RLQS reports of buckets no limit holds (allowed whole), by domain.",
                |v| v.unmatched as f64,
            ),
            (
                "ratelimitd_rlqs_expired_total",
                "counter",
                "RLQS assignments that ran out before their Envoy reported again, by domain.",
                |v| v.expired as f64,
            ),
            (
                "ratelimitd_rlqs_unanswered_total",
                "counter",
                "RLQS reports answered nothing (the store did not answer, or no room), by domain.",
                |v| v.unanswered as f64,
            ),
        ];
        for (name, kind, help, read) in families {
            header(out, name, kind, help);
            for (domain, vital) in &vitals {
                let _ = writeln!(out, "{name}{{domain=\"{}\"}} {}", escape(domain), read(vital));
            }
        }
    }
}
