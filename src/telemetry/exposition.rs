//! The one door between the parts and `/metrics`: [`Figures`], which each
//! part implements for the state it owns (read at scrape time, never
//! copied on a change), and the pieces of the text exposition format they
//! write with: [`header`], [`escape`] and the fixed-bucket [`Histogram`].
//! Telemetry imports no part; the server registers each part's figures
//! with the [`Metrics`](super::Metrics) registry.

use std::{
    fmt::{self, Write as _},
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

/// A part's metric families, read when `/metrics` is scraped.
pub trait Figures: Send + Sync + fmt::Debug {
    /// Appends this part's families, each with its [`header`], in the
    /// Prometheus text exposition format. Every label value is bounded by
    /// configuration, never by requests.
    fn render(&self, out: &mut String);

    /// This part's counters under their statsd names (after the client's
    /// `ratelimit.` scope) with their totals; the statsd sink sends what
    /// each gained since the last flush. None by default.
    fn statsd_counters(&self, _out: &mut Vec<(String, u64)>) {}
}

/// Latency buckets in seconds: resolve tens of microseconds up to a second.
const LATENCY_BUCKETS: [f64; 14] = [
    0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// A fixed-bucket histogram.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| seconds <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_nanos.fetch_add(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Appends its `_bucket`, `_sum` and `_count` series of family `name`
    /// with `labels` (`a="x",b="y"`, or empty).
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

/// The `# HELP` and `# TYPE` lines of a family.
pub fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Appends one family of a single unlabelled sample.
pub fn single(out: &mut String, name: &str, kind: &str, help: &str, value: impl fmt::Display) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {value}");
}

/// Appends one family whose samples one label tells apart:
/// `name{label="value"} n` for each `(value, n)` of `samples`. The values
/// are fixed names (results, layers), never escaped.
pub fn labelled(out: &mut String, name: &str, kind: &str, help: &str, label: &str, samples: &[(&str, u64)]) {
    header(out, name, kind, help);
    for (value, n) in samples {
        let _ = writeln!(out, "{name}{{{label}=\"{value}\"}} {n}");
    }
}

/// Label values: backslash, double quote and newline escaped.
pub fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn a_histogram_renders_cumulative_buckets() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(80));
        h.observe(Duration::from_secs(5));
        let mut out = String::new();
        h.render(&mut out, "t", "api=\"check\"");
        assert!(out.contains("t_bucket{api=\"check\",le=\"0.00005\"} 0\n"), "{out}");
        assert!(out.contains("t_bucket{api=\"check\",le=\"0.0001\"} 1\n"));
        assert!(out.contains("t_bucket{api=\"check\",le=\"1\"} 1\n"), "past the last bound: +Inf only");
        assert!(out.contains("t_bucket{api=\"check\",le=\"+Inf\"} 2\n"));
        assert!(out.contains("t_count{api=\"check\"} 2\n"));
    }
}
