//! The run's report: text for the terminal, JSON for scripts, an SVG plot of
//! the latency distribution, and the progress line while it runs.

use std::{
    fmt::Write as _,
    io::Write as _,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use hdrhistogram::Histogram;

use crate::Tally;

/// Prints `sent, rate, elapsed/duration` on one stderr line twice a second.
pub(crate) async fn progress(
    tally: Arc<Tally>,
    started: Instant,
    duration: Duration,
    running: Arc<AtomicBool>,
) {
    let mut last = 0;
    while running.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let sent = tally.sent.load(Ordering::Relaxed);
        let elapsed = started.elapsed().min(duration);
        let width = 30;
        let done = (elapsed.as_secs_f64() / duration.as_secs_f64() * width as f64) as usize;
        let _ = write!(
            std::io::stderr(),
            "\r[{}{}] {:>5.1}s/{:.0}s {:>9} calls {:>8.0}/s ",
            "#".repeat(done.min(width)),
            " ".repeat(width - done.min(width)),
            elapsed.as_secs_f64(),
            duration.as_secs_f64(),
            sent,
            (sent - last) as f64 * 2.0,
        );
        last = sent;
    }
    let _ = writeln!(std::io::stderr());
}

/// The numbers of one run.
#[derive(Debug)]
pub(crate) struct Report {
    label: String,
    api: String,
    mode: String,
    seconds: f64,
    sent: u64,
    allowed: u64,
    denied: u64,
    errors: Vec<(String, u64)>,
    /// (name, nanoseconds)
    latency: Vec<(&'static str, u64)>,
    usage: Option<crate::usage::Usage>,
}

impl Report {
    /// Collects the report of a finished run.
    pub(crate) fn build(
        label: &str,
        api: &str,
        tally: &Tally,
        elapsed: Duration,
        usage: Option<crate::usage::Usage>,
        rate: Option<u64>,
        concurrency: Option<usize>,
    ) -> Self {
        let h = tally.latency.lock().unwrap();
        let h = h.as_ref().expect("a histogram");
        let latency = vec![
            ("p50", h.value_at_quantile(0.50)),
            ("p90", h.value_at_quantile(0.90)),
            ("p99", h.value_at_quantile(0.99)),
            ("p99.9", h.value_at_quantile(0.999)),
            ("max", h.max()),
        ];
        Report {
            label: label.to_owned(),
            api: api.to_owned(),
            mode: match (rate, concurrency) {
                (Some(r), _) => format!("open loop, {r}/s"),
                (_, Some(c)) => format!("closed loop, {c} callers"),
                _ => "unknown".to_owned(),
            },
            seconds: elapsed.as_secs_f64(),
            sent: tally.sent.load(Ordering::Relaxed),
            allowed: tally.allowed.load(Ordering::Relaxed),
            denied: tally.denied.load(Ordering::Relaxed),
            errors: tally.errors.lock().unwrap().iter().map(|(k, v)| (k.clone(), *v)).collect(),
            latency,
            usage,
        }
    }

    fn decisions(&self) -> u64 {
        self.allowed + self.denied
    }

    fn throughput(&self) -> f64 {
        self.decisions() as f64 / self.seconds
    }

    fn cpu_per_decision_us(&self) -> Option<f64> {
        self.usage.map(|usage| usage.cpu / self.decisions().max(1) as f64 * 1e6)
    }

    /// The system part of it.
    fn system_per_decision_us(&self) -> Option<f64> {
        self.usage.map(|usage| usage.system / self.decisions().max(1) as f64 * 1e6)
    }

    /// The target's context switches and CPU migrations per decision.
    fn switches_per_decision(&self) -> Option<(f64, f64)> {
        let decisions = self.decisions().max(1) as f64;
        self.usage.map(|usage| (usage.switches as f64 / decisions, usage.migrations as f64 / decisions))
    }

    /// Human-readable summary.
    pub(crate) fn text(&self) -> String {
        let mut out = format!(
            "{} ({}, {}): {} decisions in {:.1} s = {:.0}/s ({} allowed, {} denied)\n",
            self.label,
            self.api,
            self.mode,
            self.decisions(),
            self.seconds,
            self.throughput(),
            self.allowed,
            self.denied
        );
        out += "latency:";
        for (name, ns) in &self.latency {
            let _ = write!(out, " {name} {:.3} ms", *ns as f64 / 1e6);
        }
        out.push('\n');
        if let (Some(cpu), Some(system)) = (self.cpu_per_decision_us(), self.system_per_decision_us()) {
            let _ = writeln!(out, "target CPU: {cpu:.2} µs per decision ({system:.2} of it system)");
        }
        if let Some((switches, migrations)) = self.switches_per_decision() {
            let _ = writeln!(
                out,
                "target: {switches:.2} context switches, {migrations:.2} migrations per decision"
            );
        }
        if !self.errors.is_empty() {
            let _ = writeln!(out, "errors: {:?}", self.errors);
        }
        out
    }

    /// Machine-readable report.
    pub(crate) fn json(&self) -> String {
        let latency: serde_json::Map<String, serde_json::Value> = self
            .latency
            .iter()
            .map(|(k, v)| (format!("{k}_us"), serde_json::json!(*v as f64 / 1e3)))
            .collect();
        serde_json::json!({
            "label": self.label,
            "api": self.api,
            "mode": self.mode,
            "seconds": self.seconds,
            "requests": self.sent,
            "decisions": self.decisions(),
            "allowed": self.allowed,
            "denied": self.denied,
            "decisions_per_second": self.throughput(),
            "latency": latency,
            "errors": self.errors.iter().cloned().collect::<std::collections::BTreeMap<_, _>>(),
            "target_cpu_us_per_decision": self.cpu_per_decision_us(),
            "target_system_us_per_decision": self.system_per_decision_us(),
            "target_switches_per_decision": self.switches_per_decision().map(|s| s.0),
            "target_migrations_per_decision": self.switches_per_decision().map(|s| s.1),
        })
        .to_string()
    }
}

/// Latency by percentile (log scale up to p99.99) as a standalone SVG.
pub(crate) fn svg(label: &str, h: &Histogram<u64>) -> String {
    let (w, ht, margin) = (640.0, 360.0, 50.0);
    let quantiles: Vec<f64> = (0..=400).map(|i| 1.0 - 10f64.powf(-(i as f64) / 100.0)).collect();
    let values: Vec<f64> = quantiles.iter().map(|q| h.value_at_quantile(*q) as f64 / 1e3).collect();
    let max = values.iter().cloned().fold(1.0, f64::max);
    let x = |i: usize| margin + (w - 2.0 * margin) * i as f64 / 400.0;
    let y = |v: f64| ht - margin - (ht - 2.0 * margin) * v / max;
    let points: Vec<String> =
        values.iter().enumerate().map(|(i, v)| format!("{:.1},{:.1}", x(i), y(*v))).collect();
    let mut svg = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{ht}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{margin}" y="25">{label}: latency by percentile (µs, max {max:.0})</text>
<line x1="{margin}" y1="{b}" x2="{r}" y2="{b}" stroke="black"/>
<line x1="{margin}" y1="{margin}" x2="{margin}" y2="{b}" stroke="black"/>
<polyline fill="none" stroke="steelblue" stroke-width="2" points="{}"/>
"#,
        points.join(" "),
        b = ht - margin,
        r = w - margin,
    );
    for (i, tick) in ["p0", "p90", "p99", "p99.9", "p99.99"].iter().enumerate() {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{tick}</text>"#,
            x(i * 100),
            ht - margin + 18.0
        );
    }
    svg += "</svg>\n";
    svg
}
