//! Kuadrant limitador's metric families, beside ratelimitd's own, so its
//! dashboards and alerts carry over: `authorized_calls`,
//! `authorized_hits` and `limited_calls`, each by `limitador_namespace`
//! (and `limited_calls` also by `limit_name` with limitador's
//! `--limit-name-in-labels`). `limitador_up` and `datastore_partitioned`
//! come from the health state (`server::health`).
//!
//! Namespaces come from requests: at most `max_series` distinct label sets
//! are ever counted (calls past that are counted in
//! `ratelimitd_limitador_metric_series_refused_total` instead), and a
//! namespace is at most `envoy.max_entry_bytes` long (a longer domain is
//! refused before it is decided), so the series are bounded in number and
//! in size. Adding is a read lock, a map lookup and atomic adds; only a
//! label set's first call takes the write lock.

use std::{
    fmt::Write as _,
    hash::Hash,
    sync::{
        RwLock,
        atomic::{AtomicU8, AtomicU64, Ordering},
    },
};

use crate::telemetry::exposition::{escape, header};

/// What the limitador APIs count in limitador's families (the engine's
/// [`super::Stats`] includes it).
pub trait LimitadorStats {
    /// One limitador call of `namespace` (a request's domain, which the
    /// implementation must keep within a bound) in limitador's families.
    fn limitador(&self, namespace: &str, outcome: Outcome<'_>);
}

/// What one limitador call counts in the families.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome<'a> {
    /// Admitted (`ShouldRateLimit`, `check_and_report`) or found to fit
    /// (`CheckRateLimit`): one authorized call and its authorized hits.
    Authorized {
        /// The hits admitted; `None` for a check, which counts none.
        hits: Option<u64>,
    },
    /// Refused: one limited call, under the name of the limit that
    /// refused it (none: unnamed, or no single limit).
    Limited {
        /// The refusing limit's `name`.
        limit: Option<&'a str>,
    },
    /// `Report`: `hits` authorized hits.
    Reported {
        /// The hits reported.
        hits: u64,
    },
}

/// A series' labels: the namespace, and for `limited_calls` with the
/// limit name label, the limit's name (`Some("")` for an unnamed one).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Labels {
    namespace: Box<str>,
    limit: Option<Box<str>>,
}

/// [`Labels`] borrowed, hashing as they do.
#[derive(Hash)]
struct LabelsRef<'a> {
    namespace: &'a str,
    limit: Option<&'a str>,
}

impl hashbrown::Equivalent<Labels> for LabelsRef<'_> {
    fn equivalent(&self, key: &Labels) -> bool {
        self.namespace == &*key.namespace && self.limit == key.limit.as_deref()
    }
}

/// One label set's counters, in [`FAMILIES`] order, and which of them it
/// has counted in (a bit each: a family lists a label set once counted,
/// by 0 included, as limitador's registry does).
#[derive(Debug, Default)]
struct Series {
    counts: [AtomicU64; 3],
    counted: AtomicU8,
}

/// The families, in [`Series::counts`] order.
const FAMILIES: [(&str, &str); 3] = [
    ("authorized_calls", "Authorized calls"),
    ("authorized_hits", "Authorized hits"),
    ("limited_calls", "Limited calls"),
];

/// limitador's counters.
#[derive(Debug)]
pub struct LimitadorMetrics {
    max_series: usize,
    limit_name_label: bool,
    series: RwLock<hashbrown::HashMap<Labels, Series>>,
    refused: AtomicU64,
}

impl LimitadorMetrics {
    /// Counters for at most `max_series` label sets; `limit_name_label`:
    /// `limited_calls` also by `limit_name`.
    pub fn new(max_series: usize, limit_name_label: bool) -> Self {
        LimitadorMetrics {
            max_series,
            limit_name_label,
            series: RwLock::default(),
            refused: AtomicU64::new(0),
        }
    }

    /// Counts one call of `namespace`.
    pub fn add(&self, namespace: &str, outcome: Outcome<'_>) {
        // The families it counts in (a bit each), and by how much.
        let (limit, families, adds) = match outcome {
            Outcome::Authorized { hits: Some(hits) } => (None, 0b011, [1, hits, 0]),
            Outcome::Authorized { hits: None } => (None, 0b001, [1, 0, 0]),
            Outcome::Reported { hits } => (None, 0b010, [0, hits, 0]),
            Outcome::Limited { limit } => {
                (self.limit_name_label.then(|| limit.unwrap_or("")), 0b100, [0, 0, 1])
            }
        };
        let add = |series: &Series| {
            for (counter, value) in series.counts.iter().zip(adds) {
                if value > 0 {
                    counter.fetch_add(value, Ordering::Relaxed);
                }
            }
            if series.counted.load(Ordering::Relaxed) & families != families {
                series.counted.fetch_or(families, Ordering::Relaxed);
            }
        };
        let key = LabelsRef { namespace, limit };
        if let Some(series) = self.series.read().unwrap_or_else(|p| p.into_inner()).get(&key) {
            add(series);
            return;
        }
        let mut map = self.series.write().unwrap_or_else(|p| p.into_inner());
        if let Some(series) = map.get(&key) {
            add(series);
            return;
        }
        if map.len() >= self.max_series {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let series = Series::default();
        add(&series);
        map.insert(Labels { namespace: namespace.into(), limit: limit.map(Into::into) }, series);
    }

    /// Appends the families in Prometheus text format, each series sorted
    /// by its labels; a family lists only the label sets it has counted.
    pub fn render(&self, out: &mut String) {
        let map = self.series.read().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<(String, &Series)> = map
            .iter()
            .map(|(labels, series)| {
                let mut text = format!("limitador_namespace=\"{}\"", escape(&labels.namespace));
                if let Some(limit) = &labels.limit {
                    let _ = write!(text, ",limit_name=\"{}\"", escape(limit));
                }
                (text, series)
            })
            .collect();
        rows.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        for (i, (family, help)) in FAMILIES.iter().enumerate() {
            header(out, family, "counter", &format!("{help} (limitador's name)."));
            for (labels, series) in &rows {
                if series.counted.load(Ordering::Relaxed) & (1 << i) != 0 {
                    let _ =
                        writeln!(out, "{family}{{{labels}}} {}", series.counts[i].load(Ordering::Relaxed));
                }
            }
        }
        let name = "ratelimitd_limitador_metric_series_refused_total";
        header(
            out,
            name,
            "counter",
            "limitador calls not counted in its families: their labels would pass envoy.upstream_metrics_max_keys.",
        );
        let _ = writeln!(out, "{name} {}", self.refused.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_render_and_series_are_bounded() {
        let m = LimitadorMetrics::new(3, false);
        m.add("ns", Outcome::Authorized { hits: Some(2) });
        m.add("ns", Outcome::Authorized { hits: None });
        m.add("ns", Outcome::Reported { hits: 40 });
        m.add("ns", Outcome::Limited { limit: Some("per-user") });
        m.add("a\"b", Outcome::Limited { limit: None });
        m.add("other", Outcome::Authorized { hits: None });
        m.add("fourth", Outcome::Authorized { hits: Some(1) });
        let mut out = String::new();
        m.render(&mut out);
        for line in [
            r#"authorized_calls{limitador_namespace="ns"} 2"#,
            r#"authorized_hits{limitador_namespace="ns"} 42"#,
            r#"limited_calls{limitador_namespace="ns"} 1"#,
            r#"limited_calls{limitador_namespace="a\"b"} 1"#,
            r#"authorized_calls{limitador_namespace="other"} 1"#,
            "ratelimitd_limitador_metric_series_refused_total 1",
        ] {
            assert!(out.lines().any(|l| l == line), "missing {line} in\n{out}");
        }
        assert!(!out.contains("fourth"), "past the bound: {out}");
        assert!(!out.contains(r#"authorized_calls{limitador_namespace="a\"b"}"#), "nothing authorized there");
        assert!(!out.contains(r#"authorized_hits{limitador_namespace="other"}"#), "a check counts no hits");
        // 0 hits admitted: the family lists the namespace, as limitador's does.
        let m = LimitadorMetrics::new(3, false);
        m.add("ns", Outcome::Authorized { hits: Some(0) });
        let mut out = String::new();
        m.render(&mut out);
        assert!(out.lines().any(|l| l == r#"authorized_hits{limitador_namespace="ns"} 0"#), "{out}");
        assert!(!out.contains("limited_calls{"), "{out}");
    }

    #[test]
    fn limited_calls_carry_the_limit_name_when_asked() {
        let m = LimitadorMetrics::new(10, true);
        m.add("ns", Outcome::Authorized { hits: Some(1) });
        m.add("ns", Outcome::Limited { limit: Some("per-user") });
        m.add("ns", Outcome::Limited { limit: Some("per-user") });
        m.add("ns", Outcome::Limited { limit: None });
        let mut out = String::new();
        m.render(&mut out);
        for line in [
            r#"authorized_calls{limitador_namespace="ns"} 1"#,
            r#"limited_calls{limitador_namespace="ns",limit_name="per-user"} 2"#,
            r#"limited_calls{limitador_namespace="ns",limit_name=""} 1"#,
        ] {
            assert!(out.lines().any(|l| l == line), "missing {line} in\n{out}");
        }
        assert!(!out.contains(r#"limited_calls{limitador_namespace="ns"} "#), "{out}");
    }
}
