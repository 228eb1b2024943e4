//! Prometheus metrics, rendered in the text exposition format on `/metrics`.
//!
//! A small registry of our own rather than a client library: every label
//! value is bounded (API, rule id, reason, priority, failure kind — never a
//! user id or a request path), a known label set costs one read lock and one
//! atomic add on the hot path, and gauges that mirror other components
//! (shedding level, dead-letter accounting, rule snapshots) are read from
//! them at scrape time instead of being copied on every change.

use std::{
    collections::HashMap,
    fmt::Write as _,
    sync::{
        Arc, RwLock, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use crate::{
    capture::CaptureCounters,
    clock::{Clock as _, SystemClock},
    decision::{Api, DenialCache, LimitHits, Stats},
    dlq::{DlqSink, DropReason},
    limiter::{FailureKind, MemoryStore, RedisStore, local::LocalLimiter},
    overload::Overload,
    rules::{Feed, Hot, OverloadMode, Snapshot, Versioned, envoy::EnvoyConfig},
    shed::{Priority, Shedder},
    telemetry::upstream::UpstreamMetrics,
};

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

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels}{}le=\"{bound}\"}} {cumulative}", sep(labels));
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{{labels}{}le=\"+Inf\"}} {count}", sep(labels));
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum{{{labels}}} {sum}");
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }
}

fn sep(labels: &str) -> &'static str {
    if labels.is_empty() { "" } else { "," }
}

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

const FAILURE_KINDS: [FailureKind; 9] = [
    FailureKind::Timeout,
    FailureKind::ConnectionRefused,
    FailureKind::ConnectionLost,
    FailureKind::PoolExhausted,
    FailureKind::CircuitOpen,
    FailureKind::ScriptError,
    FailureKind::ClusterError,
    FailureKind::StoreFull,
    FailureKind::Other,
];

/// Everything `/metrics` shows.
#[derive(Debug)]
pub struct Metrics {
    /// hashbrown's foldhash, not std's SipHash: looked up on every decision.
    decisions: RwLock<hashbrown::HashMap<DecisionKey, AtomicU64>>,
    /// `(api, reason)` of adjusted request values and of refused requests:
    /// fixed names only, so both maps stay a handful of entries.
    adjusted: RwLock<HashMap<(Api, &'static str), AtomicU64>>,
    refused: RwLock<HashMap<(Api, &'static str), AtomicU64>>,
    decision_latency: [Histogram; 2],
    store_latency: Histogram,
    store_errors: [AtomicU64; FAILURE_KINDS.len()],
    store_name: &'static str,
    sources: RwLock<Option<Sources>>,
    /// envoyproxy/ratelimit's families; `None` when `envoy.upstream_metrics` is off.
    upstream: Option<UpstreamMetrics>,
}

/// Components whose state `/metrics` reads at scrape time.
#[derive(Debug, Clone)]
pub struct Sources {
    /// Load shedding.
    pub shedder: Arc<Shedder>,
    /// The dead-letter pipeline.
    pub dlq: Arc<DlqSink>,
    /// Native rules.
    pub rules: Arc<Hot<Snapshot>>,
    /// The Envoy configuration, if served.
    pub envoy: Option<Arc<Hot<EnvoyConfig>>>,
    /// The rules topic's feed (`rules.source: kafka`).
    pub feed: Option<Arc<Feed>>,
    /// The xDS subscription (`rules.source: xds`).
    pub xds: Option<Arc<crate::rules::XdsState>>,
    /// The capture pipeline, when capturing.
    pub capture: Option<Arc<CaptureCounters>>,
    /// The in-memory counter store, when it is the store.
    pub memory: Option<Arc<MemoryStore>>,
    /// The local limiter (failure policy `local`).
    pub local: Option<Arc<LocalLimiter>>,
    /// The Redis store, when it is the store. Weak: its dispatchers end
    /// only once the store is dropped, at shutdown, while metrics may
    /// still be scraped.
    pub redis: Option<Weak<RedisStore>>,
    /// The overload layer.
    pub overload: Option<Arc<Overload>>,
    /// The denial cache, when on.
    pub denials: Option<Arc<DenialCache>>,
    /// The gRPC request byte budget (`grpc.max_request_bytes_in_flight`).
    pub budget: Option<Arc<crate::budget::Budget>>,
}

impl Metrics {
    /// An empty registry for a store named `store_name` (`memory` or `redis`).
    pub fn new(store_name: &'static str) -> Self {
        Metrics {
            decisions: RwLock::new(hashbrown::HashMap::new()),
            adjusted: RwLock::new(HashMap::new()),
            refused: RwLock::new(HashMap::new()),
            decision_latency: Default::default(),
            store_latency: Histogram::default(),
            store_errors: Default::default(),
            store_name,
            sources: RwLock::new(None),
            upstream: None,
        }
    }

    /// Also counts envoyproxy/ratelimit's families, for at most
    /// `max_keys` distinct stat keys (`envoy.upstream_metrics_max_keys`).
    pub fn with_upstream(mut self, max_keys: usize) -> Self {
        self.upstream = Some(UpstreamMetrics::new(max_keys));
        self
    }

    /// The Envoy configuration's (loads, rejected reloads), when served.
    fn envoy_loads(&self) -> Option<(u64, u64)> {
        let sources = self.sources.read().unwrap_or_else(|p| p.into_inner());
        let envoy = sources.as_ref()?.envoy.as_ref()?;
        Some((envoy.loads(), envoy.reload_failures()))
    }

    /// The totals of envoyproxy/ratelimit's counters, for the statsd sink;
    /// `None` when they are not counted.
    pub fn upstream_totals(&self) -> Option<super::upstream::Totals> {
        Some(self.upstream.as_ref()?.totals(self.envoy_loads()))
    }

    /// Wires the components read at scrape time.
    pub fn set_sources(&self, sources: Sources) {
        *self.sources.write().unwrap_or_else(|p| p.into_inner()) = Some(sources);
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8 * 1024);
        header(
            &mut out,
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
            header(&mut out, name, "counter", help);
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

        header(
            &mut out,
            "ratelimitd_decision_duration_seconds",
            "histogram",
            "Time to answer one request, by API.",
        );
        for api in [Api::Check, Api::Envoy] {
            self.decision_latency[api as usize].render(
                &mut out,
                "ratelimitd_decision_duration_seconds",
                &format!("api=\"{}\"", api.as_str()),
            );
        }
        header(
            &mut out,
            "ratelimitd_store_duration_seconds",
            "histogram",
            "Time of one Redis store call (in-memory calls are not timed).",
        );
        self.store_latency.render(
            &mut out,
            "ratelimitd_store_duration_seconds",
            &format!("store=\"{}\"", self.store_name),
        );
        header(&mut out, "ratelimitd_store_errors_total", "counter", "Store calls that failed, by kind.");
        for (kind, count) in FAILURE_KINDS.iter().zip(&self.store_errors) {
            let _ = writeln!(
                out,
                "ratelimitd_store_errors_total{{kind=\"{kind}\"}} {}",
                count.load(Ordering::Relaxed)
            );
        }

        header(
            &mut out,
            "ratelimitd_log_lines_dropped_total",
            "counter",
            "Log lines dropped because stderr could not keep up (logging never blocks a worker).",
        );
        let _ = writeln!(out, "ratelimitd_log_lines_dropped_total {}", super::traces::log_lines_dropped());
        super::process::render(&mut out);

        let sources = self.sources.read().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(s) = &sources {
            render_sources(&mut out, s);
        }
        if let Some(upstream) = &self.upstream {
            upstream.render(&mut out, self.envoy_loads());
            self.render_upstream_server(&mut out);
        }
        out
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

fn render_sources(out: &mut String, s: &Sources) {
    if let Some(memory) = &s.memory {
        render_memory(out, memory);
    }
    if let Some(local) = &s.local {
        render_local(out, local);
    }
    header(
        out,
        "ratelimitd_store_call_waits_total",
        "counter",
        "Store calls that waited for their connection's or their tenant's share (grpc.max_store_calls_per_*).",
    );
    let waits = s.redis.as_ref().and_then(Weak::upgrade).map(|redis| redis.share_waits()).unwrap_or_default();
    let _ = writeln!(out, "ratelimitd_store_call_waits_total{{share=\"connection\"}} {}", waits.connection);
    let _ = writeln!(out, "ratelimitd_store_call_waits_total{{share=\"tenant\"}} {}", waits.tenant);
    if let Some(budget) = &s.budget {
        header(
            out,
            "ratelimitd_grpc_request_bytes_in_flight",
            "gauge",
            "Bytes of gRPC request messages announced but not yet whole (grpc.max_request_bytes_in_flight).",
        );
        let _ = writeln!(out, "ratelimitd_grpc_request_bytes_in_flight {}", budget.held());
        header(
            out,
            "ratelimitd_grpc_requests_over_budget_total",
            "counter",
            "Requests failed with RESOURCE_EXHAUSTED: their bytes would pass grpc.max_request_bytes_in_flight.",
        );
        let _ = writeln!(out, "ratelimitd_grpc_requests_over_budget_total {}", budget.refused());
        header(
            out,
            "ratelimitd_grpc_requests_oversized_total",
            "counter",
            "Requests whose message was over grpc.max_message_bytes (grpc.max_batch_message_bytes for CheckBatch): a Check, Report or ShouldRateLimit denied unread, others failed with RESOURCE_EXHAUSTED.",
        );
        let _ = writeln!(out, "ratelimitd_grpc_requests_oversized_total {}", budget.oversized());
    }
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
            s.shedder.shed_count(p)
        );
        let _ = writeln!(
            out,
            "ratelimitd_shed_total{{priority=\"{p}\",mode=\"shadow\"}} {}",
            s.shedder.shadow_shed_count(p)
        );
    }
    header(
        out,
        "ratelimitd_utilization_level",
        "gauge",
        "Shedding level: 0 NORMAL, 1 DEGRADED_MODE, 2 CRITICAL_ONLY.",
    );
    let _ = writeln!(out, "ratelimitd_utilization_level {}", s.shedder.level().to_u8());
    header(
        out,
        "ratelimitd_utilization_ratio",
        "gauge",
        "Smoothed CPU utilization (0..1) the level is decided on.",
    );
    let _ = writeln!(out, "ratelimitd_utilization_ratio {}", s.shedder.utilization().unwrap_or(0.0));

    let dlq = s.dlq.stats();
    for (name, help, value) in [
        ("ratelimitd_dlq_enqueued_total", "Failure records offered by the decision path.", dlq.enqueued),
        (
            "ratelimitd_dlq_delivered_total",
            "Failure records durably written (file) or acknowledged (Kafka).",
            dlq.delivered,
        ),
        ("ratelimitd_dlq_recovered_total", "Failure records found in the spool at startup.", dlq.recovered),
        (
            "ratelimitd_dlq_folded_total",
            "Failed decisions folded into aggregate records (dlq.aggregate_after) instead of records of their own.",
            s.dlq.folded(),
        ),
    ] {
        header(out, name, "counter", help);
        let _ = writeln!(out, "{name} {value}");
    }
    header(out, "ratelimitd_dlq_dropped_total", "counter", "Failure records lost, by reason.");
    for reason in DropReason::ALL {
        let _ = writeln!(
            out,
            "ratelimitd_dlq_dropped_total{{reason=\"{}\"}} {}",
            reason.as_str(),
            s.dlq.dropped_by(reason)
        );
    }
    let (queue_max, disk_max) = s.dlq.byte_caps();
    for (name, help, value) in [
        (
            "ratelimitd_dlq_pending",
            "Failure records waiting in the queue, the writer or the spool.",
            dlq.pending,
        ),
        ("ratelimitd_dlq_queue_bytes", "Bytes of failure records in the queue.", dlq.queued_bytes),
        ("ratelimitd_dlq_queue_max_bytes", "The queue's byte cap (dlq.queue_max_bytes).", queue_max),
        ("ratelimitd_dlq_disk_bytes", "Bytes on disk: the file sink's file, or the spool.", dlq.disk_bytes),
        (
            "ratelimitd_dlq_disk_max_bytes",
            "The byte cap of that file or spool (dlq.file_max_bytes, dlq.spool_max_bytes).",
            disk_max,
        ),
    ] {
        header(out, name, "gauge", help);
        let _ = writeln!(out, "{name} {value}");
    }

    header(out, "ratelimitd_rules_info", "gauge", "The loaded rule sets (value 1), by kind and version.");
    let native = s.rules.load();
    let _ = writeln!(out, "ratelimitd_rules_info{{kind=\"native\",version=\"{}\"}} 1", native.version());
    let envoy = s.envoy.as_ref().map(|e| e.load());
    if let Some(envoy) = &envoy {
        let _ = writeln!(out, "ratelimitd_rules_info{{kind=\"envoy\",version=\"{}\"}} 1", envoy.version());
    }
    header(out, "ratelimitd_rules_count", "gauge", "Native rules, or Envoy domains, in the loaded set.");
    let _ = writeln!(out, "ratelimitd_rules_count{{kind=\"native\"}} {}", native.size());
    if let Some(envoy) = &envoy {
        let _ = writeln!(out, "ratelimitd_rules_count{{kind=\"envoy\"}} {}", envoy.size());
    }
    header(out, "ratelimitd_rules_age_seconds", "gauge", "Seconds since the loaded rule set was swapped in.");
    let _ = writeln!(out, "ratelimitd_rules_age_seconds{{kind=\"native\"}} {}", age(s.rules.swapped_at()));
    if let Some(e) = &s.envoy {
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
        s.rules.reload_failures()
    );
    if let Some(e) = &s.envoy {
        let _ =
            writeln!(out, "ratelimitd_rules_reload_failures_total{{kind=\"envoy\"}} {}", e.reload_failures());
    }
    if let Some(feed) = &s.feed {
        render_feed(out, feed);
    }
    if let Some(xds) = &s.xds {
        let (acks, nacks) = xds.counts();
        header(
            out,
            "ratelimitd_rules_xds_total",
            "counter",
            "Envoy rule sets received over xDS, accepted (ACK) or refused (NACK).",
        );
        let _ = writeln!(out, "ratelimitd_rules_xds_total{{result=\"ack\"}} {acks}");
        let _ = writeln!(out, "ratelimitd_rules_xds_total{{result=\"nack\"}} {nacks}");
    }
    if let Some(capture) = &s.capture {
        render_capture(out, capture);
    }
    render_saving(out, s.overload.as_deref(), s.denials.as_deref());
}

/// The overload layer (per bucket: requests, drops, the drop ratio and the
/// directive's age; the mode; the feed) and the denial cache, and the
/// store calls both saved. Buckets are configured directives × tenants of
/// the table: bounded by configuration, never by requests.
fn render_saving(out: &mut String, overload: Option<&Overload>, denials: Option<&DenialCache>) {
    let dropped = overload.map_or(0, |o| render_overload(out, o));
    let hits = denials.map_or(0, |d| render_denials(out, d));
    header(
        out,
        "ratelimitd_store_calls_saved_total",
        "counter",
        "Store calls not made, by the layer that answered.",
    );
    let _ = writeln!(out, "ratelimitd_store_calls_saved_total{{by=\"overload\"}} {dropped}");
    let _ = writeln!(out, "ratelimitd_store_calls_saved_total{{by=\"denial_cache\"}} {hits}");
}

/// The overload layer's series; returns the requests it dropped.
fn render_overload(out: &mut String, overload: &Overload) -> u64 {
    let mut dropped_total = 0;
    header(
        out,
        "ratelimitd_overload_mode",
        "gauge",
        "The overload layer's mode in force (1 for the one in force).",
    );
    for mode in [OverloadMode::Enforce, OverloadMode::Shadow, OverloadMode::Off] {
        let on = u8::from(overload.mode() == mode);
        let _ = writeln!(out, "ratelimitd_overload_mode{{mode=\"{}\"}} {on}", mode.as_str());
    }
    let (ok, failed) = overload.feeds();
    header(out, "ratelimitd_overload_feed_total", "counter", "Exchanges with the global view, by result.");
    let _ = writeln!(out, "ratelimitd_overload_feed_total{{result=\"ok\"}} {ok}");
    let _ = writeln!(out, "ratelimitd_overload_feed_total{{result=\"failed\"}} {failed}");
    let table = overload.table();
    let now = SystemClock.now_ms();
    header(
        out,
        "ratelimitd_overload_requests_total",
        "counter",
        "Requests the overload layer saw per bucket, and those it dropped (or would have, in shadow).",
    );
    for d in table.all() {
        for slot in &*d.slots {
            let (offered, dropped, shadow) = slot.counts();
            dropped_total += dropped;
            let labels = format!(
                "kind=\"{}\",bucket=\"{}\",tenant=\"{}\"",
                d.kind.as_str(),
                escape(&d.name),
                escape(&slot.tenant)
            );
            let _ =
                writeln!(out, "ratelimitd_overload_requests_total{{{labels},result=\"offered\"}} {offered}");
            let _ =
                writeln!(out, "ratelimitd_overload_requests_total{{{labels},result=\"dropped\"}} {dropped}");
            let _ = writeln!(
                out,
                "ratelimitd_overload_requests_total{{{labels},result=\"shadow_dropped\"}} {shadow}"
            );
        }
    }
    header(out, "ratelimitd_overload_drop_ratio", "gauge", "The drop probability applied now, per bucket.");
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
    dropped_total
}

/// The denial cache's series; returns its hits.
fn render_denials(out: &mut String, denials: &DenialCache) -> u64 {
    let (hits, cached, full) = denials.counts();
    header(out, "ratelimitd_denial_cache_hits_total", "counter", "Denials answered from the local cache.");
    let _ = writeln!(out, "ratelimitd_denial_cache_hits_total {hits}");
    header(
        out,
        "ratelimitd_denial_cache_inserts_total",
        "counter",
        "Exact denials cached, or not for want of room.",
    );
    let _ = writeln!(out, "ratelimitd_denial_cache_inserts_total{{result=\"cached\"}} {cached}");
    let _ = writeln!(out, "ratelimitd_denial_cache_inserts_total{{result=\"full\"}} {full}");
    header(out, "ratelimitd_denial_cache_entries", "gauge", "Denials held by the cache.");
    let _ = writeln!(out, "ratelimitd_denial_cache_entries {}", denials.len());
    hits
}

/// The capture pipeline: `enqueued = written + dropped (by reason) + in flight`.
fn render_capture(out: &mut String, c: &CaptureCounters) {
    use std::sync::atomic::Ordering::Relaxed;
    header(out, "ratelimitd_capture_records_total", "counter", "Captured requests by what became of them.");
    for (result, value) in [
        ("enqueued", c.enqueued.load(Relaxed)),
        ("written", c.written.load(Relaxed)),
        ("dropped_queue_full", c.dropped_queue_full.load(Relaxed)),
        ("dropped_disk_cap", c.dropped_disk_cap.load(Relaxed)),
        ("dropped_error", c.dropped_error.load(Relaxed)),
    ] {
        let _ = writeln!(out, "ratelimitd_capture_records_total{{result=\"{result}\"}} {value}");
    }
}

/// The rules topic's feed: the published version served (an info metric;
/// the version is a content hash from the topic, never a request value;
/// one series at a time) and the records applied and refused.
fn render_feed(out: &mut String, feed: &Feed) {
    header(
        out,
        "ratelimitd_rules_published_info",
        "gauge",
        "The published rule set served (value 1), by version and origin (topic | fallback); absent while waiting.",
    );
    if let Some(served) = feed.served() {
        let _ = writeln!(
            out,
            "ratelimitd_rules_published_info{{version=\"{}\",origin=\"{}\"}} 1",
            served.version,
            served.origin.as_str()
        );
    }
    header(out, "ratelimitd_rules_waiting", "gauge", "1 while no rules have arrived from the rules topic.");
    let _ = writeln!(out, "ratelimitd_rules_waiting {}", u8::from(feed.served().is_none()));
    header(out, "ratelimitd_rules_records_total", "counter", "Rules topic records swapped in or refused.");
    let _ = writeln!(out, "ratelimitd_rules_records_total{{result=\"applied\"}} {}", feed.applied());
    let _ = writeln!(out, "ratelimitd_rules_records_total{{result=\"refused\"}} {}", feed.rejected());
}

fn render_memory(out: &mut String, memory: &MemoryStore) {
    header(
        out,
        "ratelimitd_memory_counters",
        "gauge",
        "Counters held by the in-memory store (expired ones not yet swept included).",
    );
    let _ = writeln!(out, "ratelimitd_memory_counters {}", memory.len());
    header(
        out,
        "ratelimitd_memory_counters_max",
        "gauge",
        "The most counters the in-memory store holds (memory.max_counters, rounded up to the shards).",
    );
    let _ = writeln!(out, "ratelimitd_memory_counters_max {}", memory.max_counters());
    header(
        out,
        "ratelimitd_memory_evictions_total",
        "counter",
        "Expired counters evicted to make room for new ones in a full shard.",
    );
    let _ = writeln!(out, "ratelimitd_memory_evictions_total {}", memory.evictions());
}

fn render_local(out: &mut String, local: &LocalLimiter) {
    let gauges: [(&str, &str, &str, u64); 5] = [
        (
            "ratelimitd_local_instances",
            "gauge",
            "Instances each limit is shared by when decided locally (reported alive, else local.instances).",
            local.instances(),
        ),
        (
            "ratelimitd_local_counters",
            "gauge",
            "Counters held by the local limiter (expired ones not yet swept included).",
            local.counters() as u64,
        ),
        (
            "ratelimitd_local_owed_hits",
            "gauge",
            "Hits admitted locally and not yet written back to the shared store.",
            local.owed_hits(),
        ),
        (
            "ratelimitd_local_written_back_hits_total",
            "counter",
            "Locally admitted hits written back to the shared store.",
            local.written_back(),
        ),
        (
            "ratelimitd_local_write_back_failures_total",
            "counter",
            "Write-back rounds the shared store refused (the hits stay owed).",
            local.write_back_failures(),
        ),
    ];
    for (name, kind, help, value) in gauges {
        header(out, name, kind, help);
        let _ = writeln!(out, "{name} {value}");
    }
}

fn age(at: SystemTime) -> f64 {
    SystemTime::now().duration_since(at).map_or(0.0, |d| d.as_secs_f64())
}

fn count(map: &RwLock<HashMap<(Api, &'static str), AtomicU64>>, key: (Api, &'static str)) {
    if let Some(counter) = map.read().unwrap_or_else(|p| p.into_inner()).get(&key) {
        counter.fetch_add(1, Ordering::Relaxed);
        return;
    }
    map.write().unwrap_or_else(|p| p.into_inner()).entry(key).or_default().fetch_add(1, Ordering::Relaxed);
}

impl Stats for Metrics {
    fn adjusted(&self, api: Api, what: &'static str) {
        count(&self.adjusted, (api, what));
    }

    fn refused(&self, api: Api, reason: &'static str) {
        count(&self.refused, (api, reason));
        if api == Api::Envoy
            && let Some(upstream) = &self.upstream
        {
            upstream.service_error();
        }
    }

    fn limit_hits(&self, key: &str, hits: LimitHits) {
        if let Some(upstream) = &self.upstream {
            upstream.add(key, hits);
        }
    }

    fn envoy_failed(&self) {
        if let Some(upstream) = &self.upstream {
            upstream.store_error();
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
            && let Some(i) = FAILURE_KINDS.iter().position(|k| *k == kind)
        {
            self.store_errors[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// The `# HELP` and `# TYPE` lines of a family.
pub(super) fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Label values: backslash, double quote and newline escaped.
pub(super) fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
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
        let m = Metrics::new("memory");
        let rule: Arc<str> = Arc::from("search");
        m.decision(Api::Check, Some(&rule), "OK", true);
        m.decision(Api::Check, Some(&rule), "OK", true);
        m.decision(Api::Check, None, "NO_RULE", true);
        m.decision_latency(Api::Check, Duration::from_micros(80));
        m.store_call(Some(Duration::from_micros(300)), Some(FailureKind::Timeout));
        let text = m.render();
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

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
