//! `/metrics`: one registry every part's figures are read through. The
//! server registers each part's [`Figures`] once it is built; a scrape
//! renders the process families and build info ([`process`](super::process)),
//! the log lines dropped, then every registered part in the order it was
//! registered. Telemetry itself imports no part: what a part counts, and
//! how, is the part's own.

use std::{
    fmt::Write as _,
    sync::{Arc, RwLock},
};

use super::exposition::{Figures, header};

/// The registry behind `/metrics` and the statsd sink.
#[derive(Debug, Default)]
pub struct Metrics {
    figures: RwLock<Vec<Arc<dyn Figures>>>,
}

impl Metrics {
    /// A registry with no part registered yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a part's figures to every later scrape.
    pub fn register(&self, figures: Arc<dyn Figures>) {
        self.figures.write().unwrap_or_else(|p| p.into_inner()).push(figures);
    }

    fn registered(&self) -> Vec<Arc<dyn Figures>> {
        self.figures.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8 * 1024);
        header(
            &mut out,
            "ratelimitd_log_lines_dropped_total",
            "counter",
            "Log lines dropped because stderr could not keep up (logging never blocks a worker).",
        );
        let _ = writeln!(out, "ratelimitd_log_lines_dropped_total {}", super::traces::log_lines_dropped());
        super::process::render(&mut out);
        for figures in self.registered() {
            figures.render(&mut out);
        }
        out
    }

    /// Every registered part's statsd counters with their totals.
    pub fn statsd_counters(&self) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        for figures in self.registered() {
            figures.statsd_counters(&mut out);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Two(&'static str);

    impl Figures for Two {
        fn render(&self, out: &mut String) {
            let _ = writeln!(out, "{} 2", self.0);
        }

        fn statsd_counters(&self, out: &mut Vec<(String, u64)>) {
            out.push((self.0.to_owned(), 2));
        }
    }

    #[test]
    fn renders_every_registered_part_in_order() {
        let metrics = Metrics::new();
        metrics.register(Arc::new(Two("first")));
        metrics.register(Arc::new(Two("second")));
        let text = metrics.render();
        let (first, second) = (text.find("first 2").unwrap(), text.find("second 2").unwrap());
        assert!(first < second, "{text}");
        assert!(text.contains("ratelimitd_log_lines_dropped_total "));
        assert!(text.contains("ratelimitd_build_info{"), "the process families are the registry's own");
        assert_eq!(metrics.statsd_counters(), [("first".to_owned(), 2), ("second".to_owned(), 2)]);
    }
}
