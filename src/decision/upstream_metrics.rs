//! envoyproxy/ratelimit's metrics, beside ratelimitd's own, so an
//! operator's dashboards and alerts carry over: the per-limit
//! `ratelimit_service_rate_limit_{total_hits,over_limit,near_limit,within_limit,shadow_mode}`
//! with the labels upstream's Prometheus mapping gives them (`domain`,
//! `key1`, and `key2` when the key has a third part), and
//! `ratelimit_service_should_rate_limit_error{err_type}`.
//!
//! A limit is counted under upstream's stat key: its configured full key
//! (`domain.key_value.key…`), or with `detailed_metric`, `value_to_metric`
//! or a request's own limit a key holding request values. The key is
//! sanitized as upstream does (`:` and `|` become `_`, and so do the dots of
//! anything shaped like an IPv4 address) and split on dots into the labels.
//! Keys are bounded in number and in size: at most `max_keys` distinct keys
//! are ever counted (hits of a key past that are counted in
//! `ratelimitd_upstream_metric_keys_refused_total` instead), and a key over
//! [`MAX_STAT_KEY_BYTES`] (request values of any length, with
//! `detailed_metric`) is counted as its first bytes and the digest of the
//! whole, so distinct values stay distinct series of bounded size. No
//! request can grow the series, or a scrape, without bound: at most
//! `max_keys` series of at most 512-byte keys.

use std::{
    borrow::Cow,
    collections::HashMap,
    fmt::Write as _,
    sync::{
        Arc, LazyLock, RwLock,
        atomic::{AtomicU64, Ordering},
    },
};

use super::{Verdict, keys::digest_bytes};
use crate::telemetry::exposition::{escape, header};

/// One descriptor's counts in envoyproxy/ratelimit's terms (its
/// `total_hits`, `over_limit`, `near_limit`, `within_limit` and
/// `shadow_mode` stats), in hits.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitHits {
    /// Hits of the descriptor (0 for a `hits_addend: 0` peek).
    pub total: u64,
    /// Hits refused (or, in shadow mode, that would have been).
    pub over: u64,
    /// Admitted hits past `near_limit_ratio` of the limit.
    pub near: u64,
    /// Admitted hits.
    pub within: u64,
    /// Over-limit hits a shadow-mode limit let through.
    pub shadow: u64,
}

impl LimitHits {
    /// Upstream's arithmetic for `hits` against a limit of `limit`, from
    /// the store's `verdict`. A hit that does not fit is refused whole
    /// (nothing of it is counted), so every hit of a refused descriptor is
    /// `over` — upstream, whose counter also takes refused hits, splits a
    /// request straddling the limit into near and over hits.
    pub fn of(limit: u64, hits: u64, verdict: &Verdict, shadow: bool, near_ratio: f32) -> Self {
        let mut out = LimitHits { total: hits, ..LimitHits::default() };
        if !verdict.admitted {
            out.over = hits;
            if shadow {
                out.shadow = hits;
            }
            return out;
        }
        // As upstream: floor(float32(limit) * ratio).
        let near = (limit as f32 * near_ratio).floor() as u64;
        let after = limit.saturating_sub(verdict.remaining);
        let before = after.saturating_sub(hits);
        if after > near {
            out.near = if before >= near { hits } else { after - near };
        }
        out.within = hits;
        out
    }
}

/// What the Envoy API counts in envoyproxy/ratelimit's families (the
/// engine's [`super::Stats`] includes it).
pub trait UpstreamStats {
    /// One Envoy descriptor's counts under upstream's metric `key`: the
    /// limit's configured full key, or one holding request values
    /// (`detailed_metric`, `value_to_metric`, a request's own limit), which
    /// the implementation must keep within a bound.
    fn limit_hits(&self, key: &str, hits: LimitHits);
    /// One `ShouldRateLimit` the store could not decide.
    fn envoy_failed(&self);
}

/// The longest stat key counted as it is (the bound of a counter key).
pub const MAX_STAT_KEY_BYTES: usize = super::keys::MAX_COUNTER_KEY_BYTES;

/// `key` itself when at most [`MAX_STAT_KEY_BYTES`] long; otherwise its
/// first bytes (whole characters), `_` and the digest of the whole key,
/// [`MAX_STAT_KEY_BYTES`] at most.
fn bounded_key(key: &str) -> Cow<'_, str> {
    if key.len() <= MAX_STAT_KEY_BYTES {
        return Cow::Borrowed(key);
    }
    let digest = digest_bytes(key.as_bytes());
    let mut cut = MAX_STAT_KEY_BYTES - digest.len() - 1;
    while !key.is_char_boundary(cut) {
        cut -= 1;
    }
    Cow::Owned(format!("{}_{digest}", &key[..cut]))
}

/// The per-limit families, in [`Series::counts`] order.
const FAMILIES: [(&str, &str); 5] = [
    ("total_hits", "Hits of descriptors with a limit."),
    ("over_limit", "Hits over their limit (refused, or let through by shadow mode)."),
    ("near_limit", "Admitted hits past near_limit_ratio of their limit."),
    ("within_limit", "Admitted hits."),
    ("shadow_mode", "Over-limit hits a shadow-mode limit let through."),
];

/// Anything shaped like an IPv4 address (upstream's `ipv4Regex`).
static IPV4: LazyLock<regex::Regex> = LazyLock::new(|| {
    regex::Regex::new(r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}").expect("a valid pattern")
});

/// One stat key's counters and its rendered labels.
#[derive(Debug)]
struct Series {
    labels: String,
    counts: [AtomicU64; 5],
}

/// Keys as the engine gives them, and the series their sanitized forms
/// name (two keys may sanitize to one series, as upstream counts them).
#[derive(Debug, Default)]
struct Keys {
    raw: HashMap<Box<str>, Arc<Series>>,
    sanitized: HashMap<Box<str>, Arc<Series>>,
}

/// The upstream-compatible counters. Adding is a read lock, a map lookup
/// by the key as given and atomic adds; only a key's first hit sanitizes
/// it and takes the write lock.
#[derive(Debug)]
pub struct UpstreamMetrics {
    max_keys: usize,
    keys: RwLock<Keys>,
    refused: AtomicU64,
    store_errors: AtomicU64,
    service_errors: AtomicU64,
}

impl UpstreamMetrics {
    /// Counters for at most `max_keys` distinct stat keys.
    pub fn new(max_keys: usize) -> Self {
        UpstreamMetrics {
            max_keys,
            keys: RwLock::new(Keys::default()),
            refused: AtomicU64::new(0),
            store_errors: AtomicU64::new(0),
            service_errors: AtomicU64::new(0),
        }
    }

    /// Adds one descriptor's `hits` under stat key `key` (bounded in size:
    /// [`MAX_STAT_KEY_BYTES`]).
    pub fn add(&self, key: &str, hits: LimitHits) {
        let key = &*bounded_key(key);
        let add = |series: &Series| {
            let values = [hits.total, hits.over, hits.near, hits.within, hits.shadow];
            for (counter, value) in series.counts.iter().zip(values) {
                if value > 0 {
                    counter.fetch_add(value, Ordering::Relaxed);
                }
            }
        };
        if let Some(series) = self.keys.read().unwrap_or_else(|p| p.into_inner()).raw.get(key) {
            add(series);
            return;
        }
        let mut keys = self.keys.write().unwrap_or_else(|p| p.into_inner());
        let keys = &mut *keys;
        if let Some(series) = keys.raw.get(key) {
            add(series);
            return;
        }
        // Both maps are bounded: every sanitized key is some raw key's.
        if keys.raw.len() >= self.max_keys {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let series =
            Arc::clone(keys.sanitized.entry(sanitize(key).into_owned().into_boxed_str()).or_insert_with_key(
                |name| Arc::new(Series { labels: labels(name), counts: Default::default() }),
            ));
        add(&series);
        keys.raw.insert(key.into(), series);
    }

    /// One `ShouldRateLimit` the store could not decide (upstream's
    /// `redis_error`).
    pub fn store_error(&self) {
        self.store_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// One `ShouldRateLimit` refused as malformed (upstream's `service_error`).
    pub fn service_error(&self) {
        self.service_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Every counter's total now, for the statsd sink; `config` as for
    /// [`UpstreamMetrics::render`].
    pub fn totals(&self, config: Option<(u64, u64)>) -> Totals {
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
        let series = keys
            .sanitized
            .iter()
            .map(|(name, s)| (name.to_string(), std::array::from_fn(|i| s.counts[i].load(Ordering::Relaxed))))
            .collect();
        Totals {
            series,
            store_errors: self.store_errors.load(Ordering::Relaxed),
            service_errors: self.service_errors.load(Ordering::Relaxed),
            config,
        }
    }

    /// Appends the families in Prometheus text format; `config` is the
    /// Envoy configuration's (loads, rejected reloads), when it is served.
    pub fn render(&self, out: &mut String, config: Option<(u64, u64)>) {
        let keys = self.keys.read().unwrap_or_else(|p| p.into_inner());
        let mut sorted: Vec<&Series> = keys.sanitized.values().map(|s| &**s).collect();
        sorted.sort_unstable_by(|a, b| a.labels.cmp(&b.labels));
        for (i, (family, help)) in FAMILIES.iter().enumerate() {
            let name = format!("ratelimit_service_rate_limit_{family}");
            header(out, &name, "counter", &format!("{help} (envoyproxy/ratelimit's name)"));
            for s in &sorted {
                let _ = writeln!(out, "{name}{{{}}} {}", s.labels, s.counts[i].load(Ordering::Relaxed));
            }
        }
        let name = "ratelimit_service_should_rate_limit_error";
        header(out, name, "counter", "ShouldRateLimit calls that failed (envoyproxy/ratelimit's name).");
        let _ =
            writeln!(out, "{name}{{err_type=\"redis_error\"}} {}", self.store_errors.load(Ordering::Relaxed));
        let _ = writeln!(
            out,
            "{name}{{err_type=\"service_error\"}} {}",
            self.service_errors.load(Ordering::Relaxed)
        );
        if let Some((loads, failures)) = config {
            for (name, help, value) in [
                ("ratelimit_service_config_load_success", "Envoy configurations loaded", loads),
                ("ratelimit_service_config_load_error", "Envoy configuration reloads rejected", failures),
            ] {
                header(out, name, "counter", &format!("{help} (envoyproxy/ratelimit's name)."));
                let _ = writeln!(out, "{name} {value}");
            }
        }
        let name = "ratelimitd_upstream_metric_keys";
        header(out, name, "gauge", "Distinct series of the ratelimit_service_rate_limit_* families.");
        let _ = writeln!(out, "{name} {}", sorted.len());
        let name = "ratelimitd_upstream_metric_keys_refused_total";
        header(
            out,
            name,
            "counter",
            "Descriptor hits not counted in the ratelimit_service_* families: their key would pass envoy.upstream_metrics_max_keys.",
        );
        let _ = writeln!(out, "{name} {}", self.refused.load(Ordering::Relaxed));
    }
}

/// The upstream counters' totals at one moment.
#[derive(Debug)]
pub struct Totals {
    /// Per sanitized stat key, the five per-limit counters in
    /// `FAMILIES` order.
    series: Vec<(String, [u64; 5])>,
    store_errors: u64,
    service_errors: u64,
    /// (loads, rejected reloads) of the Envoy configuration, when served.
    config: Option<(u64, u64)>,
}

impl Totals {
    /// Every counter under its statsd name after upstream's `ratelimit.`
    /// scope: `service.rate_limit.<key>.<stat>`,
    /// `service.call.should_rate_limit.<error>`, `service.config_load_*`.
    pub fn counters(&self) -> impl Iterator<Item = (String, u64)> + '_ {
        let per_limit = self.series.iter().flat_map(|(key, counts)| {
            FAMILIES
                .iter()
                .zip(counts)
                .map(move |((family, _), n)| (format!("service.rate_limit.{key}.{family}"), *n))
        });
        let errors = [
            ("service.call.should_rate_limit.redis_error".to_owned(), self.store_errors),
            ("service.call.should_rate_limit.service_error".to_owned(), self.service_errors),
        ];
        let config = self.config.into_iter().flat_map(|(loads, failures)| {
            [
                ("service.config_load_success".to_owned(), loads),
                ("service.config_load_error".to_owned(), failures),
            ]
        });
        per_limit.chain(errors).chain(config)
    }
}

/// Upstream's `SanitizeStatName`: `:` and `|` become `_`, and so do the
/// dots inside anything shaped like an IPv4 address. Borrowed when nothing
/// changes.
pub fn sanitize(key: &str) -> Cow<'_, str> {
    let key =
        if key.contains([':', '|']) { Cow::Owned(key.replace([':', '|'], "_")) } else { Cow::Borrowed(key) };
    match IPV4.replace_all(&key, |c: &regex::Captures<'_>| c[0].replace('.', "_")) {
        Cow::Borrowed(_) => key,
        Cow::Owned(changed) => Cow::Owned(changed),
    }
}

/// The labels upstream's Prometheus mapping (`default_mapper.yaml`) gives
/// a sanitized key: its first dot-separated part is `domain`, the next
/// `key1`, and the third, if any, `key2`; later parts are not labelled.
fn labels(key: &str) -> String {
    let mut parts = key.split('.');
    let mut out = String::new();
    for (name, part) in ["domain", "key1", "key2"].into_iter().zip(&mut parts) {
        if !out.is_empty() {
            out.push(',');
        }
        let _ = write!(out, "{name}=\"{}\"", escape(part));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hits(total: u64, over: u64, near: u64, within: u64, shadow: u64) -> LimitHits {
        LimitHits { total, over, near, within, shadow }
    }

    #[test]
    fn sanitizes_as_upstream() {
        assert!(matches!(sanitize("edge.user_alice"), Cow::Borrowed(_)));
        assert_eq!(sanitize("edge.remote_address_10.0.0.1"), "edge.remote_address_10_0_0_1");
        assert_eq!(sanitize("edge.path_/a:b|c"), "edge.path_/a_b_c");
        // Leftmost first, up to three digits a part, as RE2 finds them.
        assert_eq!(sanitize("d.k_1234.5.6.7.8"), "d.k_1234_5_6_7.8");
        assert_eq!(sanitize("d.v_1.2.3"), "d.v_1.2.3");
    }

    #[test]
    fn labels_follow_the_default_mapping() {
        assert_eq!(labels("edge.user"), r#"domain="edge",key1="user""#);
        assert_eq!(labels("edge.a_1.b_2.c_3"), r#"domain="edge",key1="a_1",key2="b_2""#);
        assert_eq!(labels(r#"d.k_"x""#), r#"domain="d",key1="k_\"x\"""#);
    }

    #[test]
    fn counts_render_and_keys_are_bounded() {
        let m = UpstreamMetrics::new(3);
        m.add("edge.user", hits(3, 1, 1, 2, 0));
        m.add("edge.user", hits(1, 0, 0, 1, 0));
        m.add("edge.ip_10.0.0.1", hits(1, 1, 0, 0, 1));
        m.add("edge.ip_10_0_0_1", hits(1, 0, 0, 1, 0));
        m.add("edge.ip_10.0.0.2", hits(5, 5, 0, 0, 0));
        m.add("edge.user", hits(1, 0, 0, 1, 0));
        m.store_error();
        let mut out = String::new();
        m.render(&mut out, Some((3, 1)));
        for line in [
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="user"} 5"#,
            r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="user"} 1"#,
            r#"ratelimit_service_rate_limit_near_limit{domain="edge",key1="user"} 1"#,
            r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="user"} 4"#,
            r#"ratelimit_service_rate_limit_shadow_mode{domain="edge",key1="ip_10_0_0_1"} 1"#,
            // Two keys that sanitize alike are one series.
            r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="ip_10_0_0_1"} 2"#,
            r#"ratelimit_service_should_rate_limit_error{err_type="redis_error"} 1"#,
            "ratelimitd_upstream_metric_keys 2",
            "ratelimit_service_config_load_success 3",
            "ratelimit_service_config_load_error 1",
            "ratelimitd_upstream_metric_keys_refused_total 1",
        ] {
            assert!(out.lines().any(|l| l == line), "missing {line} in\n{out}");
        }
        assert!(!out.contains("10_0_0_2"), "a key past the bound is not counted:\n{out}");
    }

    /// 200 detailed-metric keys carrying 64 KiB values each (any size
    /// alike; 900 KiB values held 900 MB in a scrape): every series key is
    /// at most 512 bytes, distinct values stay distinct series, and the
    /// scrape stays small.
    #[test]
    fn long_request_values_are_bounded_series() {
        let m = UpstreamMetrics::new(10_000);
        let value = "v".repeat(64 * 1024);
        for i in 0..200 {
            m.add(&format!("edge.user_{i}{value}"), hits(1, 0, 0, 1, 0));
            m.add(&format!("edge.user_{i}{value}"), hits(1, 0, 0, 1, 0));
        }
        let keys = m.keys.read().unwrap();
        assert_eq!((keys.raw.len(), keys.sanitized.len()), (200, 200));
        assert!(keys.raw.keys().chain(keys.sanitized.keys()).all(|k| k.len() <= MAX_STAT_KEY_BYTES));
        drop(keys);
        let mut out = String::new();
        m.render(&mut out, None);
        assert!(out.len() < 200 * 5 * 700 + 10_000, "{} bytes", out.len());
        assert!(
            out.lines()
                .filter(|l| l.starts_with("ratelimit_service_rate_limit_total_hits{"))
                .all(|l| l.ends_with(" 2"))
        );
        let multibyte = format!("edge.user_{}", "é".repeat(400));
        assert!(bounded_key(&multibyte).len() <= MAX_STAT_KEY_BYTES);
    }
}
