//! The decision path's own figures: [`DecisionMetrics`], the [`Stats`]
//! the engine counts into (decisions by API, rule, reason and outcome,
//! adjusted and refused request values, decision and store latencies,
//! store errors, and envoyproxy/ratelimit's families in
//! [`upstream_metrics`](super::upstream_metrics)), and [`Saved`], the
//! store calls the overload layer and the denial cache spared. Both are
//! read by `/metrics` through `telemetry::Figures`.
//!
//! Every label value is bounded (API, rule id, reason, failure kind: never
//! a user id or a request path); a known label set costs one read lock and
//! one atomic add on the hot path.

use std::{
    collections::HashMap,
    fmt::Write as _,
    sync::{
        Arc, RwLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use super::{
    Api, DenialCache, LimitHits, LimitadorStats, Stats, UpstreamStats,
    limitador_metrics::{LimitadorMetrics, Outcome},
    upstream_metrics::UpstreamMetrics,
};
use crate::{
    limiter::FailureKind,
    overload::Overload,
    rules::{Hot, envoy::EnvoyConfig},
    telemetry::exposition::{Figures, Histogram, escape, header, labelled, single},
};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct DecisionKey {
    api: Api,
    /// `None`: no rule matched.
    rule: Option<Arc<str>>,
    reason: &'static str,
    allowed: bool,
}

/// A [`DecisionKey`] borrowed, to look one up without touching the rule's
/// `Arc` (two atomic operations on a line every core shares). Hashes as
/// the key does: the same fields in the same order, `Arc<str>` as `str`.
#[derive(Hash)]
struct DecisionRef<'a> {
    api: Api,
    rule: Option<&'a str>,
    reason: &'static str,
    allowed: bool,
}

impl hashbrown::Equivalent<DecisionKey> for DecisionRef<'_> {
    fn equivalent(&self, key: &DecisionKey) -> bool {
        self.api == key.api
            && self.rule == key.rule.as_deref()
            && self.reason == key.reason
            && self.allowed == key.allowed
    }
}

/// The decision path's counters and histograms.
#[derive(Debug)]
pub struct DecisionMetrics {
    /// hashbrown's foldhash, not std's SipHash: looked up on every decision.
    decisions: RwLock<hashbrown::HashMap<DecisionKey, AtomicU64>>,
    /// `(api, reason)` of adjusted request values and of refused requests:
    /// fixed names only, so both maps stay a handful of entries.
    adjusted: RwLock<HashMap<(Api, &'static str), AtomicU64>>,
    refused: RwLock<HashMap<(Api, &'static str), AtomicU64>>,
    decision_latency: [Histogram; 2],
    store_latency: Histogram,
    store_errors: [AtomicU64; FailureKind::ALL.len()],
    store_name: &'static str,
    /// envoyproxy/ratelimit's families, and the Envoy configuration whose
    /// loads they count; `None` when `envoy.upstream_metrics` is off.
    upstream: Option<(UpstreamMetrics, Option<Arc<Hot<EnvoyConfig>>>)>,
    /// limitador's families; `None` unless limitador's limits are served
    /// with `envoy.upstream_metrics` on.
    limitador: Option<LimitadorMetrics>,
}

impl DecisionMetrics {
    /// Empty counters for a store named `store_name` (`memory` or `redis`).
    pub fn new(store_name: &'static str) -> Self {
        DecisionMetrics {
            decisions: RwLock::new(hashbrown::HashMap::new()),
            adjusted: RwLock::new(HashMap::new()),
            refused: RwLock::new(HashMap::new()),
            decision_latency: Default::default(),
            store_latency: Histogram::default(),
            store_errors: Default::default(),
            store_name,
            upstream: None,
            limitador: None,
        }
    }

    /// Also counts envoyproxy/ratelimit's families, for at most
    /// `max_keys` distinct stat keys (`envoy.upstream_metrics_max_keys`),
    /// with the loads of `envoy`, the Envoy configuration served.
    pub fn with_upstream(mut self, max_keys: usize, envoy: Option<Arc<Hot<EnvoyConfig>>>) -> Self {
        self.upstream = Some((UpstreamMetrics::new(max_keys), envoy));
        self
    }

    /// Also counts limitador's families, for at most `max_series` label
    /// sets (`envoy.upstream_metrics_max_keys`); `limit_name_label`:
    /// `limited_calls` by `limit_name` too.
    pub fn with_limitador(mut self, max_series: usize, limit_name_label: bool) -> Self {
        self.limitador = Some(LimitadorMetrics::new(max_series, limit_name_label));
        self
    }

    /// The Envoy configuration's (loads, rejected reloads), when served.
    fn envoy_loads(&self) -> Option<(u64, u64)> {
        let envoy = self.upstream.as_ref()?.1.as_ref()?;
        Some((envoy.loads(), envoy.reload_failures()))
    }

    /// Appends every family of the decision path.
    fn render_families(&self, out: &mut String) {
        self.render_decisions(out);
        self.render_request_values(out);
        self.render_latencies(out);
        if let Some((upstream, _)) = &self.upstream {
            upstream.render(out, self.envoy_loads());
            self.render_upstream_server(out);
        }
        if let Some(limitador) = &self.limitador {
            limitador.render(out);
        }
    }

    /// `ratelimitd_decisions_total`, sorted by its labels.
    fn render_decisions(&self, out: &mut String) {
        header(
            out,
            "ratelimitd_decisions_total",
            "counter",
            "Decisions by API, rule, reason and whether the request was allowed.",
        );
        let mut decisions: Vec<(String, u64)> = self
            .decisions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| {
                let labels = format!(
                    "api=\"{}\",rule=\"{}\",reason=\"{}\",allowed=\"{}\"",
                    k.api.as_str(),
                    escape(k.rule.as_deref().unwrap_or("")),
                    k.reason,
                    k.allowed
                );
                (labels, v.load(Ordering::Relaxed))
            })
            .collect();
        decisions.sort();
        for (labels, value) in decisions {
            let _ = writeln!(out, "ratelimitd_decisions_total{{{labels}}} {value}");
        }
    }

    /// Request values adjusted, and requests refused, by API and reason.
    fn render_request_values(&self, out: &mut String) {
        for (name, help, map) in [
            (
                "ratelimitd_request_values_adjusted_total",
                "Request values counted by digest or ignored instead of refused, by API and reason.",
                &self.adjusted,
            ),
            (
                "ratelimitd_requests_refused_total",
                "Requests refused as malformed (INVALID_ARGUMENT), by API and reason.",
                &self.refused,
            ),
        ] {
            header(out, name, "counter", help);
            let mut rows: Vec<(String, u64)> = map
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(|((api, reason), v)| {
                    (format!("api=\"{}\",reason=\"{reason}\"", api.as_str()), v.load(Ordering::Relaxed))
                })
                .collect();
            rows.sort();
            for (labels, value) in rows {
                let _ = writeln!(out, "{name}{{{labels}}} {value}");
            }
        }
    }

    /// The decision and store latencies, and the store's errors by kind.
    fn render_latencies(&self, out: &mut String) {
        header(
            out,
            "ratelimitd_decision_duration_seconds",
            "histogram",
            "Time to answer one request, by API.",
        );
        for api in [Api::Check, Api::Envoy] {
            self.decision_latency[api as usize].render(
                out,
                "ratelimitd_decision_duration_seconds",
                &format!("api=\"{}\"", api.as_str()),
            );
        }
        header(
            out,
            "ratelimitd_store_duration_seconds",
            "histogram",
            "Time of one Redis store call (in-memory calls are not timed).",
        );
        self.store_latency.render(
            out,
            "ratelimitd_store_duration_seconds",
            &format!("store=\"{}\"", self.store_name),
        );
        header(out, "ratelimitd_store_errors_total", "counter", "Store calls that failed, by kind.");
        for (kind, count) in FailureKind::ALL.iter().zip(&self.store_errors) {
            let _ = writeln!(
                out,
                "ratelimitd_store_errors_total{{kind=\"{kind}\"}} {}",
                count.load(Ordering::Relaxed)
            );
        }
    }

    /// envoyproxy/ratelimit's server families (its statsd exporter mapping
    /// of `ratelimit_server.ShouldRateLimit.*`): every `ShouldRateLimit`
    /// call, decided or refused, and the time to decide, in seconds.
    fn render_upstream_server(&self, out: &mut String) {
        let latency = &self.decision_latency[Api::Envoy as usize];
        let refused: u64 = self
            .refused
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|((api, _), _)| *api == Api::Envoy)
            .map(|(_, count)| count.load(Ordering::Relaxed))
            .sum();
        let name = "ratelimit_service_total_requests";
        header(out, name, "counter", "ShouldRateLimit calls (envoyproxy/ratelimit's name).");
        let _ = writeln!(out, "{name}{{grpc_method=\"ShouldRateLimit\"}} {}", latency.count() + refused);
        let name = "ratelimit_service_response_time_seconds";
        header(
            out,
            name,
            "histogram",
            "Time to decide one ShouldRateLimit (envoyproxy/ratelimit's name; this service's buckets).",
        );
        latency.render(out, name, "grpc_method=\"ShouldRateLimit\"");
    }
}

impl Figures for DecisionMetrics {
    fn render(&self, out: &mut String) {
        self.render_families(out);
    }

    fn statsd_counters(&self, out: &mut Vec<(String, u64)>) {
        if let Some((upstream, _)) = &self.upstream {
            out.extend(upstream.totals(self.envoy_loads()).counters());
        }
    }
}

fn count(map: &RwLock<HashMap<(Api, &'static str), AtomicU64>>, key: (Api, &'static str)) {
    if let Some(counter) = map.read().unwrap_or_else(|p| p.into_inner()).get(&key) {
        counter.fetch_add(1, Ordering::Relaxed);
        return;
    }
    map.write().unwrap_or_else(|p| p.into_inner()).entry(key).or_default().fetch_add(1, Ordering::Relaxed);
}

impl UpstreamStats for DecisionMetrics {
    fn limit_hits(&self, key: &str, hits: LimitHits) {
        if let Some((upstream, _)) = &self.upstream {
            upstream.add(key, hits);
        }
    }

    fn envoy_failed(&self) {
        if let Some((upstream, _)) = &self.upstream {
            upstream.store_error();
        }
    }
}

impl LimitadorStats for DecisionMetrics {
    fn limitador(&self, namespace: &str, outcome: Outcome<'_>) {
        if let Some(limitador) = &self.limitador {
            limitador.add(namespace, outcome);
        }
    }
}

impl Stats for DecisionMetrics {
    fn adjusted(&self, api: Api, what: &'static str) {
        count(&self.adjusted, (api, what));
    }

    fn refused(&self, api: Api, reason: &'static str) {
        count(&self.refused, (api, reason));
        if api == Api::Envoy
            && let Some((upstream, _)) = &self.upstream
        {
            upstream.service_error();
        }
    }

    /// Counts one decision.
    fn decision(&self, api: Api, rule: Option<&Arc<str>>, reason: &'static str, allowed: bool) {
        let seen = DecisionRef { api, rule: rule.map(|r| &**r), reason, allowed };
        if let Some(counter) = self.decisions.read().unwrap_or_else(|p| p.into_inner()).get(&seen) {
            counter.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let key = DecisionKey { api, rule: rule.cloned(), reason, allowed };
        self.decisions
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default()
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Records the whole time of one request through `api`.
    fn decision_latency(&self, api: Api, elapsed: Duration) {
        self.decision_latency[api as usize].observe(elapsed);
    }

    /// Records one store call and, if it failed, its kind.
    fn store_call(&self, elapsed: Option<Duration>, failure: Option<FailureKind>) {
        if let Some(elapsed) = elapsed {
            self.store_latency.observe(elapsed);
        }
        if let Some(kind) = failure
            && let Some(i) = FailureKind::ALL.iter().position(|k| *k == kind)
        {
            self.store_errors[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The store calls not made, by the layer that answered instead: the
/// overload layer's drops and the denial cache's hits (with the cache's
/// own families).
#[derive(Debug)]
pub struct Saved {
    /// The overload layer, when built.
    pub overload: Option<Arc<Overload>>,
    /// The denial cache, when on.
    pub denials: Option<Arc<DenialCache>>,
}

impl Figures for Saved {
    fn render(&self, out: &mut String) {
        let dropped = self.overload.as_deref().map_or(0, Overload::dropped);
        let hits = self.denials.as_deref().map_or(0, |d| render_denials(out, d));
        labelled(
            out,
            "ratelimitd_store_calls_saved_total",
            "counter",
            "Store calls not made, by the layer that answered.",
            "by",
            &[("overload", dropped), ("denial_cache", hits)],
        );
    }
}

/// The denial cache's series; returns its hits.
fn render_denials(out: &mut String, denials: &DenialCache) -> u64 {
    let (hits, cached, full) = denials.counts();
    single(
        out,
        "ratelimitd_denial_cache_hits_total",
        "counter",
        "Denials answered from the local cache.",
        hits,
    );
    labelled(
        out,
        "ratelimitd_denial_cache_inserts_total",
        "counter",
        "Exact denials cached, or not for want of room.",
        "result",
        &[("cached", cached), ("full", full)],
    );
    single(out, "ratelimitd_denial_cache_entries", "gauge", "Denials held by the cache.", denials.len());
    hits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hot path finds a counter by a borrowed key: it must hash and
    /// compare as the owned key (a miss would take the write lock every time).
    #[test]
    fn a_borrowed_decision_key_finds_its_counter() {
        let mut map = hashbrown::HashMap::new();
        for rule in [Some(Arc::<str>::from("search")), None] {
            for (api, reason, allowed) in [(Api::Check, "OK", true), (Api::Envoy, "OVER_LIMIT", false)] {
                map.insert(DecisionKey { api, rule: rule.clone(), reason, allowed }, AtomicU64::new(7));
                let seen = DecisionRef { api, rule: rule.as_deref(), reason, allowed };
                assert!(map.get(&seen).is_some(), "{api:?} {rule:?} {reason}");
                let other = DecisionRef { allowed: !allowed, ..seen };
                assert!(map.get(&other).is_none());
            }
        }
        assert!(
            map.get(&DecisionRef { api: Api::Check, rule: Some("searc"), reason: "OK", allowed: true })
                .is_none()
        );
    }

    #[test]
    fn counts_and_renders_decisions_and_histograms() {
        let m = DecisionMetrics::new("memory");
        let rule: Arc<str> = Arc::from("search");
        m.decision(Api::Check, Some(&rule), "OK", true);
        m.decision(Api::Check, Some(&rule), "OK", true);
        m.decision(Api::Check, None, "NO_RULE", true);
        m.decision_latency(Api::Check, Duration::from_micros(80));
        m.store_call(Some(Duration::from_micros(300)), Some(FailureKind::Timeout));
        let mut text = String::new();
        m.render(&mut text);
        assert!(
            text.contains(
                "ratelimitd_decisions_total{api=\"check\",rule=\"search\",reason=\"OK\",allowed=\"true\"} 2"
            ),
            "{text}"
        );
        assert!(text.contains(
            "ratelimitd_decisions_total{api=\"check\",rule=\"\",reason=\"NO_RULE\",allowed=\"true\"} 1"
        ));
        assert!(
            text.contains("ratelimitd_decision_duration_seconds_bucket{api=\"check\",le=\"0.00005\"} 0"),
            "{text}"
        );
        assert!(text.contains("ratelimitd_decision_duration_seconds_bucket{api=\"check\",le=\"0.0001\"} 1"));
        assert!(text.contains("ratelimitd_decision_duration_seconds_count{api=\"check\"} 1"));
        assert!(text.contains("ratelimitd_store_errors_total{kind=\"timeout\"} 1"));
        assert!(text.contains("ratelimitd_store_duration_seconds_count{store=\"memory\"} 1"));
    }
}
