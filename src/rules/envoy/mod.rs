//! envoyproxy/ratelimit's YAML configuration format, loaded unchanged from
//! `rules.envoy_path` (a file, or a directory with one domain per file), and
//! compiled into an immutable [`EnvoyConfig`] that answers descriptor lookups
//! exactly as upstream does: at each entry `key_value` first, then wildcard
//! values (`*` matches any run of characters), then the bare `key` default; a
//! limit applies only where the last entry lands.
//!
//! `share_threshold: true` on a wildcard makes every value it matches share
//! one counter, as upstream: the lookup reports the pattern, and the counter
//! key carries it instead of the value.
//!
//! Every key upstream accepts is accepted. `value_to_metric` and `metadata`
//! only shape upstream's metric names and dynamic metadata; they are
//! validated and otherwise ignored here.

use std::{collections::HashMap, sync::Arc};

use super::model::OverloadSpec;
use crate::limiter::{
    adaptive::AdaptiveLimit,
    window::{Algorithm, MAX_CAPACITY_TIMES_WINDOW, WindowParams},
};

mod yaml;

pub use self::yaml::{Compile, MAX_ALSO_LIMITS, compile_texts, load, load_fixed, load_sliding, read_files};

/// A rate-limit unit, with upstream's lengths (a month is 30 days).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3,600 s.
    Hour,
    /// 86,400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    fn parse(text: &str) -> Option<Self> {
        Some(match text.to_ascii_uppercase().as_str() {
            "SECOND" => Unit::Second,
            "MINUTE" => Unit::Minute,
            "HOUR" => Unit::Hour,
            "DAY" => Unit::Day,
            "WEEK" => Unit::Week,
            "MONTH" => Unit::Month,
            "YEAR" => Unit::Year,
            _ => return None,
        })
    }

    /// The unit's length in seconds.
    pub fn seconds(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// The clock resolution counters of this unit use ([`tick_ms`]).
    pub fn tick_ms(self) -> u64 {
        tick_ms(self.seconds())
    }

    /// Counting parameters for `requests_per_unit` in ticks of
    /// [`Unit::tick_ms`]: a window of one unit, or a bucket of
    /// `requests_per_unit` tokens refilled at that rate per unit.
    pub fn params(self, requests_per_unit: u32, algorithm: Algorithm) -> WindowParams {
        params(self.seconds(), requests_per_unit, algorithm)
    }
}

/// The clock resolution counters of a window of `seconds` use: ms up to a
/// minute, seconds up to a day, minutes up to 30 days, hours beyond. Coarser
/// ticks for long windows keep `requests_per_unit × window` exact in Redis'
/// double-precision Lua for any `u32` limit.
pub fn tick_ms(seconds: u64) -> u64 {
    match seconds {
        0..=60 => 1,
        61..=86_400 => 1_000,
        86_401..=2_592_000 => 60_000,
        _ => 3_600_000,
    }
}

/// Counting parameters for `requests_per_unit` over a window of `seconds`,
/// in ticks of [`tick_ms`]: a window of that length, or a bucket of
/// `requests_per_unit` tokens refilled at that rate per window.
pub fn params(seconds: u64, requests_per_unit: u32, algorithm: Algorithm) -> WindowParams {
    let per_unit = u64::from(requests_per_unit);
    WindowParams {
        window_ms: seconds * 1_000 / tick_ms(seconds),
        capacity: per_unit,
        rate: per_unit,
        algorithm,
    }
}

/// The longest window `unit_multiplier` may make: a year.
pub const MAX_WINDOW_SECONDS: u64 = 365 * 86_400;

impl EnvoyLimit {
    /// A limit of `max` hits per window of `seconds` (1 s to
    /// [`MAX_WINDOW_SECONDS`]), named `name`, with no mode and no extension:
    /// what another format's limit (limitador's) counts as. The error names
    /// the field at fault (`max`, `seconds`) and why.
    pub fn plain(
        full_key: Arc<str>,
        max: u64,
        seconds: u64,
        name: Option<String>,
    ) -> Result<Self, (&'static str, String)> {
        if !(1..=MAX_WINDOW_SECONDS).contains(&seconds) {
            return Err(("seconds", format!("must be between 1 and {MAX_WINDOW_SECONDS} (a year)")));
        }
        let requests_per_unit =
            u32::try_from(max).map_err(|_| ("max", format!("must be at most {}", u32::MAX)))?;
        let window = params(seconds, requests_per_unit, Algorithm::SlidingWindow);
        if window.capacity.saturating_mul(window.window_ms) > MAX_CAPACITY_TIMES_WINDOW {
            return Err(("max", "too large to count exactly".to_owned()));
        }
        let multiplier = u32::try_from(seconds).unwrap_or(u32::MAX);
        Ok(EnvoyLimit { name, ..EnvoyLimit::bare(full_key, requests_per_unit, Unit::Second, multiplier) })
    }

    /// `requests_per_unit` per `unit_multiplier` × `unit`, with no name,
    /// mode or extension: a request's override, and the base of
    /// [`EnvoyLimit::plain`].
    pub fn bare(full_key: Arc<str>, requests_per_unit: u32, unit: Unit, unit_multiplier: u32) -> Self {
        EnvoyLimit {
            full_key,
            requests_per_unit,
            unit: Some(unit),
            unit_multiplier,
            unlimited: false,
            shadow_mode: false,
            quota_mode: false,
            report_mode: false,
            peek_mode: false,
            metadata: None,
            name: None,
            replaces: Vec::new(),
            detailed_metric: false,
            algorithm: None,
            overload: None,
            also: Vec::new(),
            adaptive: None,
            global: false,
        }
    }
}

/// A limit from the configuration (or a request's override).
#[derive(Debug, Clone, PartialEq)]
pub struct EnvoyLimit {
    /// Where it sits: `domain.key_value.key…`, as upstream names it.
    pub full_key: Arc<str>,
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit; `None` only when unlimited.
    pub unit: Option<Unit>,
    /// The window is this many units (ratelimitd's extension
    /// `unit_multiplier`; 1 for upstream's files and request overrides).
    pub unit_multiplier: u32,
    /// Never limited.
    pub unlimited: bool,
    /// Over-limit is reported but never makes the overall code OVER_LIMIT.
    pub shadow_mode: bool,
    /// Over-limit makes the overall code OVER_LIMIT only if every quota descriptor is over.
    pub quota_mode: bool,
    /// ratelimitd's extension: hits are usage reported after the fact
    /// (Envoy's `apply_on_stream_done`), counted whatever is left.
    pub report_mode: bool,
    /// Hits are asked about, never counted: whether that many more fit
    /// (Kuadrant's `CheckRateLimit`; never from a configuration file).
    pub peek_mode: bool,
    /// The descriptor's `metadata`, returned (merged over the descriptors
    /// that passed) as the response's dynamic metadata when
    /// `envoy.response_dynamic_metadata` is on. Any YAML mapping with
    /// string keys.
    pub metadata: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
    /// The limit's name (for `replaces`).
    pub name: Option<String>,
    /// Names of limits this one replaces.
    pub replaces: Vec<String>,
    /// Upstream's `detailed_metric`: its upstream-compatible metrics are
    /// keyed by the request's own keys and values
    /// ([`EnvoyMatch::stat_key`]).
    pub detailed_metric: bool,
    /// `rate_limit.algorithm` (ratelimitd's extension); `None`: the
    /// service's `envoy.algorithm`.
    pub algorithm: Option<Algorithm>,
    /// The descriptor's `overload` (ratelimitd's extension): a global rate
    /// enforced by probabilistic drop before the exact counter.
    pub overload: Option<OverloadSpec>,
    /// Further limits of the descriptor (ratelimitd's extension `also`),
    /// counted with this one all or nothing; each has this one's key, modes
    /// and metadata, no name and no `also` of its own.
    pub also: Vec<Arc<EnvoyLimit>>,
    /// Set when `requests_per_unit` is adaptive (ratelimitd's extension
    /// `adaptive`): then it is where the limit starts, and [`EnvoyLimit::per_unit`]
    /// the limit in force.
    pub adaptive: Option<Arc<AdaptiveLimit>>,
    /// `requests_per_unit` holds for every region together (ratelimitd's
    /// extension `global`): each region enforces it at its grant.
    pub global: bool,
}

impl EnvoyLimit {
    /// The window in seconds (`unit × unit_multiplier`); `None` when unlimited.
    pub fn window_seconds(&self) -> Option<u64> {
        self.unit.map(|unit| unit.seconds() * u64::from(self.unit_multiplier))
    }

    /// Requests per unit in force: `requests_per_unit`, or the adaptive
    /// limit's current value.
    #[inline]
    pub fn per_unit(&self) -> u32 {
        self.adaptive
            .as_deref()
            .map_or(self.requests_per_unit, |a| u32::try_from(a.current()).unwrap_or(u32::MAX))
    }

    /// Limit `index` of the descriptor: 0 this one, then `also`'s.
    pub fn limit_at(&self, index: usize) -> &EnvoyLimit {
        index.checked_sub(1).and_then(|i| self.also.get(i)).map_or(self, |also| also)
    }
}

#[derive(Debug, Default)]
struct Level {
    /// `key_value` or `key` → node, as upstream keys its map.
    entries: HashMap<String, Node>,
    /// Values containing `*`: the composite key split on `*`, in file order.
    wildcards: Vec<(String, Vec<String>)>,
}

#[derive(Debug, Default)]
struct Node {
    limit: Option<Arc<EnvoyLimit>>,
    /// `share_threshold: true` on a wildcard: the pattern's value part
    /// (`files/*` of `key: files, value: files/*`).
    shared_value: Option<Arc<str>>,
    /// Upstream's `value_to_metric`: the request's value stands in this
    /// level's part of the metric key.
    value_to_metric: bool,
    children: Level,
}

/// The limit a descriptor matched, and how its counter is keyed.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvoyMatch {
    /// The limit.
    pub limit: Arc<EnvoyLimit>,
    /// Entries matched through a `share_threshold` wildcard: their index and
    /// the pattern that stands for their value in the counter key, so every
    /// matching value shares one counter. Empty (no allocation) otherwise.
    pub shared: Vec<(usize, Arc<str>)>,
    /// The key upstream's metrics name this match by when it is not the
    /// limit's `full_key`: with `detailed_metric` the request's own keys and
    /// values, with `value_to_metric` its values at the flagged levels
    /// (upstream's `GetLimit`). Unsanitized. `None` (no allocation) unless
    /// the configuration uses either flag.
    pub stat_key: Option<Box<str>>,
    /// What the descriptor's last entry makes of it.
    pub role: Role,
}

/// What a descriptor's last entry makes of it; but for [`Role::Counted`]
/// its other entries name the counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Role {
    /// An ordinary descriptor, counted as it is.
    #[default]
    Counted,
    /// `ratelimitd.release`, of a limit of requests in flight: its hits give
    /// slots back (the request ended).
    Released,
    /// `ratelimitd.reserve`: its hits (an estimate) are counted, and the
    /// answer names the reservation.
    Reserved,
    /// `ratelimitd.settle`, valued with a reservation's id: its hits (the
    /// actual usage) replace what the reservation holds there.
    Settled,
}

impl Role {
    /// Whether its hits report what happened (usage, a request's end)
    /// rather than ask for room.
    pub fn reports(self) -> bool {
        matches!(self, Role::Released | Role::Settled)
    }
}

/// How one request entry found its node.
#[derive(Clone, Copy)]
enum Matched<'a> {
    /// `key_value` is in the map.
    Exact,
    /// Through a wildcard: its composite pattern (`key_files*`).
    Wildcard(&'a str),
    /// The key alone (a default).
    Default,
}

/// Every domain's compiled descriptor tree.
#[derive(Debug, Default)]
pub struct EnvoyConfig {
    domains: HashMap<String, Level>,
    version: String,
    /// Whether any descriptor sets `detailed_metric` or `value_to_metric`
    /// (only then does a lookup build metric keys).
    dynamic_metrics: bool,
    /// The limits with an adaptive `requests_per_unit`, by full key.
    adaptive: Vec<Arc<EnvoyLimit>>,
}

/// The three metric keys upstream builds while it walks a request's
/// entries; built only when the configuration asks for them.
#[derive(Default)]
struct MetricKeys {
    /// Every entry as `key_value` (`detailed_metric`).
    detailed: String,
    /// Entries matched through a `share_threshold` wildcard as
    /// `key_pattern`, the others as `key[_value]` (`detailed_metric` with
    /// `share_threshold`).
    thresholded: String,
    /// `value_to_metric`'s key.
    enhanced: String,
}

impl MetricKeys {
    fn new(domain: &str) -> Self {
        MetricKeys {
            detailed: domain.to_owned(),
            thresholded: domain.to_owned(),
            enhanced: domain.to_owned(),
        }
    }

    /// Adds one entry, matched `how` at `node` (`None`: nothing matched).
    fn push(&mut self, key: &str, value: &str, how: Option<(Matched<'_>, &Node)>) {
        let join = |out: &mut String, part: &str| {
            out.push('_');
            out.push_str(part);
        };
        self.detailed.push('.');
        self.detailed.push_str(key);
        join(&mut self.detailed, value);
        self.thresholded.push('.');
        self.thresholded.push_str(key);
        self.enhanced.push('.');
        self.enhanced.push_str(key);
        let shared = how.and_then(|(matched, node)| match matched {
            Matched::Wildcard(_) => node.shared_value.as_deref(),
            _ => None,
        });
        match shared {
            Some(pattern) => join(&mut self.thresholded, pattern),
            None if !value.is_empty() => join(&mut self.thresholded, value),
            None => {}
        }
        let part = match how {
            None => None,
            Some((Matched::Exact, _)) => Some(value),
            Some((Matched::Wildcard(pattern), node)) => match &node.shared_value {
                Some(shared) => Some(&**shared),
                None if node.value_to_metric => Some(value),
                None => Some(pattern.strip_prefix(key).and_then(|p| p.strip_prefix('_')).unwrap_or(pattern)),
            },
            Some((Matched::Default, node)) => node.value_to_metric.then_some(value),
        };
        if let Some(part) = part.filter(|p| !p.is_empty()) {
            join(&mut self.enhanced, part);
        }
    }
}

impl EnvoyConfig {
    /// Whether any rule is in `domain`.
    pub fn has_domain(&self, domain: &str) -> bool {
        self.domains.contains_key(domain)
    }

    /// The limit for `entries` (key, value pairs) in `domain`, as upstream's
    /// `GetLimit` finds it; `None` when nothing matches.
    pub fn lookup<'a>(
        &self,
        domain: &str,
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Option<EnvoyMatch> {
        let mut level = self.domains.get(domain)?;
        let mut found = None;
        let mut shared = Vec::new();
        let mut entries = entries.into_iter().enumerate().peekable();
        let mut composite = String::new();
        let mut metric = self.dynamic_metrics.then(|| MetricKeys::new(domain));
        while let Some((index, (key, value))) = entries.next() {
            composite.clear();
            composite.push_str(key);
            composite.push('_');
            composite.push_str(value);
            let node = level
                .entries
                .get(&composite)
                .map(|n| (Matched::Exact, n))
                .or_else(|| {
                    level.wildcards.iter().find(|(_, parts)| wildcard_match(parts, &composite)).and_then(
                        |(pattern, _)| level.entries.get(pattern).map(|n| (Matched::Wildcard(pattern), n)),
                    )
                })
                .or_else(|| level.entries.get(key).map(|n| (Matched::Default, n)));
            if let Some(metric) = &mut metric {
                metric.push(key, value, node);
            }
            let Some((_, node)) = node else { break };
            if let Some(pattern) = &node.shared_value {
                shared.push((index, Arc::clone(pattern)));
            }
            if entries.peek().is_none() {
                found = node.limit.clone();
            }
            if node.children.entries.is_empty() {
                break;
            }
            level = &node.children;
        }
        found.map(|limit| {
            let stat_key = metric.and_then(|m| {
                let key = match (limit.detailed_metric, shared.is_empty()) {
                    (true, true) => m.detailed,
                    (true, false) => m.thresholded,
                    (false, _) => m.enhanced,
                };
                (*key != *limit.full_key).then(|| key.into_boxed_str())
            });
            EnvoyMatch { limit, shared, stat_key, role: Role::Counted }
        })
    }

    /// Content hash of the configuration.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// Number of domains.
    pub fn domain_count(&self) -> usize {
        self.domains.len()
    }

    /// Every limit of every domain.
    pub fn limits(&self) -> Vec<Arc<EnvoyLimit>> {
        self.limits_by_domain().into_iter().map(|(_, limit)| limit).collect()
    }

    /// Every limit of the configuration with its domain.
    pub fn limits_by_domain(&self) -> Vec<(&String, Arc<EnvoyLimit>)> {
        fn walk(level: &Level, out: &mut Vec<Arc<EnvoyLimit>>) {
            for node in level.entries.values() {
                out.extend(node.limit.iter().cloned());
                walk(&node.children, out);
            }
        }
        let mut out = Vec::new();
        for (domain, level) in &self.domains {
            let mut limits = Vec::new();
            walk(level, &mut limits);
            out.extend(limits.into_iter().map(|limit| (domain, limit)));
        }
        out
    }

    /// The limits with an adaptive `requests_per_unit`, by full key.
    pub fn adaptive_limits(&self) -> impl Iterator<Item = &Arc<EnvoyLimit>> {
        self.adaptive.iter()
    }

    /// Every limit with an `overload` directive: its full key and the directive.
    pub fn overload_directives(&self) -> impl Iterator<Item = (Arc<str>, OverloadSpec)> + '_ {
        self.limits()
            .into_iter()
            .filter_map(|limit| limit.overload.map(|spec| (Arc::clone(&limit.full_key), spec)))
    }
}

/// Upstream's wildcard match: `*` matches any (possibly empty) run of
/// characters; `parts` is the pattern split on `*`.
fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else { return false };
    if parts.len() == 1 {
        return first == value;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed || !value.starts_with(first.as_str()) || !value.ends_with(last.as_str()) {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part.as_str()) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests;
