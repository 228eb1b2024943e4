//! The YAML side of envoyproxy/ratelimit's format: the files as written
//! (`Yaml*`, every key upstream accepts), read from a file or a directory
//! of domains, and compiled into the [`EnvoyConfig`](super::EnvoyConfig)
//! lookup tree, every error naming its file, domain path and field.

use std::{
    collections::{HashMap, hash_map::Entry},
    fs,
    path::{Path, PathBuf},
    sync::Arc,
};

use serde::{Deserialize, Deserializer};

use super::{EnvoyConfig, EnvoyLimit, Level, MAX_WINDOW_SECONDS, Node, Unit, params};
use crate::{
    limiter::{
        adaptive::AdaptiveLimit,
        window::{Algorithm, MAX_CAPACITY_TIMES_WINDOW},
    },
    rules::{
        RuleError, RuleErrors,
        model::{AdaptiveSpec, MAX_OVERLOAD_RATE, OverloadSpec},
        native::rule_files,
    },
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRoot {
    #[serde(default, deserialize_with = "scalar")]
    domain: String,
    #[serde(default, deserialize_with = "list")]
    descriptors: Vec<YamlDescriptor>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlDescriptor {
    #[serde(default, deserialize_with = "scalar")]
    key: String,
    #[serde(default, deserialize_with = "scalar")]
    value: String,
    #[serde(default)]
    rate_limit: Option<YamlRateLimit>,
    #[serde(default, deserialize_with = "list")]
    descriptors: Vec<YamlDescriptor>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    quota_mode: bool,
    /// ratelimitd's extension: count hits after the fact.
    #[serde(default)]
    report_mode: bool,
    #[serde(default)]
    detailed_metric: bool,
    #[serde(default)]
    value_to_metric: bool,
    #[serde(default)]
    share_threshold: bool,
    #[serde(default)]
    metadata: Option<yaml_serde::Value>,
    /// ratelimitd's extension: a global rate enforced by probabilistic drop.
    #[serde(default)]
    overload: Option<OverloadSpec>,
    /// ratelimitd's extension: further limits beside `rate_limit`, counted
    /// with it all or nothing.
    #[serde(default, deserialize_with = "list")]
    also: Vec<YamlRateLimit>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlRateLimit {
    #[serde(default)]
    requests_per_unit: u32,
    #[serde(default, deserialize_with = "scalar")]
    unit: String,
    #[serde(default)]
    unlimited: bool,
    #[serde(default, deserialize_with = "scalar")]
    name: String,
    #[serde(default, deserialize_with = "list")]
    replaces: Vec<YamlReplaces>,
    /// ratelimitd's extension: `sliding_window`, `fixed_window`,
    /// `token_bucket` or `gcra`; unset, `envoy.algorithm` decides.
    #[serde(default, deserialize_with = "scalar")]
    algorithm: String,
    /// ratelimitd's extension: the window is this many units (90 seconds:
    /// `unit: second, unit_multiplier: 90`).
    #[serde(default)]
    unit_multiplier: Option<u32>,
    /// ratelimitd's extension: `requests_per_unit` moves by AIMD from
    /// reported outcomes (the native rules' `adaptive:`).
    #[serde(default)]
    adaptive: Option<AdaptiveSpec>,
    /// ratelimitd's extension: `requests_per_unit` holds for every region
    /// together (docs/global-limits.md).
    #[serde(default)]
    global: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct YamlReplaces {
    #[serde(default, deserialize_with = "scalar")]
    name: String,
}

/// A string, or a number or boolean written where upstream expects a string
/// (`value: 123`); null is empty.
fn scalar<'de, D: Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    Ok(match yaml_serde::Value::deserialize(deserializer)? {
        yaml_serde::Value::Null => String::new(),
        yaml_serde::Value::String(s) => s,
        yaml_serde::Value::Number(n) => n.to_string(),
        yaml_serde::Value::Bool(b) => b.to_string(),
        other => return Err(serde::de::Error::custom(format!("expected a string, found {other:?}"))),
    })
}

/// A list, with `key:` left empty (null) meaning an empty list.
fn list<'de, D: Deserializer<'de>, T: Deserialize<'de>>(deserializer: D) -> Result<Vec<T>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(deserializer)?.unwrap_or_default())
}

/// How Envoy configuration files compile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compile {
    /// Limits without an algorithm of their own count in a sliding window
    /// (else upstream's fixed window): `envoy.algorithm`.
    pub sliding: bool,
    /// A domain may be spread over several files, whose descriptors are
    /// merged (upstream's `MERGE_DOMAIN_CONFIG`, `envoy.merge_domains`); the
    /// same descriptor twice is still an error.
    pub merge_domains: bool,
}

impl Compile {
    /// The sliding window, one file per domain.
    pub const SLIDING: Compile = Compile { sliding: true, merge_domains: false };
    /// Upstream's fixed window, one file per domain.
    pub const FIXED: Compile = Compile { sliding: false, merge_domains: false };
}

/// [`load`] with the sliding-window algorithm.
pub fn load_sliding(path: &Path) -> Result<EnvoyConfig, RuleErrors> {
    load(path, Compile::SLIDING)
}

/// [`load`] with upstream's fixed-window algorithm.
pub fn load_fixed(path: &Path) -> Result<EnvoyConfig, RuleErrors> {
    load(path, Compile::FIXED)
}

/// Loads every file at `path` (a file or a directory of `*.yaml`/`*.yml`)
/// as `how` says.
pub fn load(path: &Path, how: Compile) -> Result<EnvoyConfig, RuleErrors> {
    compile_texts(&read_files(path)?, how)
}

/// The configuration files at `path` (a file or a directory of
/// `*.yaml`/`*.yml`), read, in load order.
pub fn read_files(path: &Path) -> Result<Vec<(PathBuf, String)>, RuleErrors> {
    let files = rule_files(path).map_err(|e| RuleErrors(vec![e]))?;
    let mut texts = Vec::with_capacity(files.len());
    let mut errors = Vec::new();
    for file in files {
        match fs::read_to_string(&file) {
            Ok(text) => texts.push((file, text)),
            Err(e) => errors.push(RuleError::io(&file, &e)),
        }
    }
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    Ok(texts)
}

/// Compiles configuration files given as (name, text), in order: what
/// [`load`] does once it has read them, and what an instance does with the
/// files of a published snapshot. Every problem is reported, by file.
pub fn compile_texts(files: &[(PathBuf, String)], how: Compile) -> Result<EnvoyConfig, RuleErrors> {
    let mut domains: HashMap<String, (Level, PathBuf)> = HashMap::new();
    let mut errors = Vec::new();
    let mut canonical = String::new();
    for (file, text) in files {
        match parse_file(file, text) {
            Ok((domain, level)) => match domains.entry(domain.clone()) {
                Entry::Occupied(mut existing) if how.merge_domains => {
                    canonical.push_str(text);
                    if let Err(e) = merge(&mut existing.get_mut().0, level, file, &domain) {
                        errors.push(e);
                    }
                }
                Entry::Occupied(existing) => errors.push(error(
                    file,
                    None,
                    "domain",
                    format!(
                        "duplicate domain '{domain}' in config file (also in {})",
                        existing.get().1.display()
                    ),
                )),
                Entry::Vacant(slot) => {
                    canonical.push_str(text);
                    slot.insert((level, file.clone()));
                }
            },
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    // Merging is part of the version only when on: existing versions stay.
    let merging = if how.merge_domains { "merge" } else { "" };
    let version = sha1_smol::Sha1::from(format!("{}{merging}{canonical}", how.sliding).as_bytes())
        .digest()
        .to_string()[..16]
        .to_owned();
    fn dynamic(level: &Level) -> bool {
        level.entries.values().any(|node| {
            node.value_to_metric
                || node.limit.as_ref().is_some_and(|l| l.detailed_metric)
                || dynamic(&node.children)
        })
    }
    let domains: HashMap<String, Level> = domains.into_iter().map(|(d, (level, _))| (d, level)).collect();
    let dynamic_metrics = domains.values().any(dynamic);
    let mut config = EnvoyConfig { domains, version, dynamic_metrics, adaptive: Vec::new() };
    config.adaptive = config.limits().into_iter().filter(|l| l.adaptive.is_some()).collect();
    config.adaptive.sort_by(|a, b| a.full_key.cmp(&b.full_key));
    Ok(config)
}

fn error(file: &Path, at: Option<&str>, field: &str, message: String) -> RuleError {
    RuleError {
        file: file.to_path_buf(),
        line: None,
        rule: at.map(str::to_owned),
        field: Some(field.to_owned()),
        message,
    }
}

/// Adds `from`'s top-level descriptors (from `file`) to a domain's `into`,
/// as upstream's `MERGE_DOMAIN_CONFIG` does: one already there is an error.
fn merge(into: &mut Level, from: Level, file: &Path, domain: &str) -> Result<(), RuleError> {
    if let Some(key) = from.entries.keys().find(|k| into.entries.contains_key(*k)) {
        return Err(error(
            file,
            None,
            "key",
            format!("duplicate descriptor composite key '{domain}.{key}' in a merged domain"),
        ));
    }
    into.entries.extend(from.entries);
    into.wildcards.extend(from.wildcards);
    Ok(())
}

pub(super) fn parse_file(file: &Path, text: &str) -> Result<(String, Level), RuleError> {
    let root: YamlRoot =
        serde_path_to_error::deserialize(yaml_serde::Deserializer::from_str(text)).map_err(|e| {
            let inner = e.inner();
            let mut message = inner.to_string();
            if let Some(cut) = message.find(" at line ") {
                message.truncate(cut);
            }
            // yaml_serde prefixes its own path; the path is shown once, below.
            if let Some((prefix, rest)) = message.split_once(": ")
                && !prefix.contains(' ')
            {
                message = rest.to_owned();
            }
            RuleError {
                file: file.to_path_buf(),
                line: inner.location().map(|l| (l.line(), l.column())),
                rule: Some(e.path().to_string()).filter(|p| p != "."),
                field: None,
                message,
            }
        })?;
    if root.domain.is_empty() {
        return Err(error(file, None, "domain", "config file cannot have empty domain".to_owned()));
    }
    let mut level = Level::default();
    load_level(file, &mut level, &root.domain, "descriptors", &root.descriptors)?;
    Ok((root.domain, level))
}

fn load_level(
    file: &Path,
    level: &mut Level,
    parent_key: &str,
    path: &str,
    descriptors: &[YamlDescriptor],
) -> Result<(), RuleError> {
    for (index, d) in descriptors.iter().enumerate() {
        let at = format!("{path}[{index}]");
        if d.key.is_empty() {
            return Err(error(file, Some(&at), "key", "descriptor has empty key".to_owned()));
        }
        let composite = if d.value.is_empty() { d.key.clone() } else { format!("{}_{}", d.key, d.value) };
        let full_key = format!("{parent_key}.{composite}");
        if level.entries.contains_key(&composite) {
            return Err(error(
                file,
                Some(&at),
                "key",
                format!("duplicate descriptor composite key '{full_key}'"),
            ));
        }
        if d.share_threshold && !composite.contains('*') {
            return Err(error(
                file,
                Some(&at),
                "share_threshold",
                format!(
                    "share_threshold can only be used with wildcard values (containing '*'), but found key '{composite}'"
                ),
            ));
        }
        if let Some(overload) = &d.overload {
            let problem = if d.rate_limit.as_ref().is_none_or(|r| r.unlimited) {
                Some("needs a limited rate_limit beside it".to_owned())
            } else if !(1..=MAX_OVERLOAD_RATE).contains(&overload.rate_per_second) {
                Some(format!("rate_per_second must be between 1 and {MAX_OVERLOAD_RATE}"))
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(error(file, Some(&at), "overload", problem));
            }
        }
        let limit = match &d.rate_limit {
            None => None,
            Some(r) => {
                // Upstream reads it on any descriptor; only a limit returns it.
                let metadata = match &d.metadata {
                    None | Some(yaml_serde::Value::Null) => None,
                    Some(yaml) => {
                        Some(Arc::new(metadata(yaml).map_err(|e| error(file, Some(&at), "metadata", e))?))
                    }
                };
                let mut limit = compile_limit(file, &at, r, d, &full_key, metadata)?;
                limit.also = also_limits(file, &at, d, &limit)?;
                Some(Arc::new(limit))
            }
        };
        if d.rate_limit.is_none() && !d.also.is_empty() {
            return Err(error(file, Some(&at), "also", "needs a rate_limit beside it".to_owned()));
        }
        let shared_value = d.share_threshold.then(|| Arc::from(d.value.as_str()));
        let mut node =
            Node { limit, shared_value, value_to_metric: d.value_to_metric, children: Level::default() };
        load_level(file, &mut node.children, &full_key, &format!("{at}.descriptors"), &d.descriptors)?;
        if composite.contains('*') {
            level.wildcards.push((composite.clone(), composite.split('*').map(str::to_owned).collect()));
        }
        level.entries.insert(composite, node);
    }
    Ok(())
}

/// A descriptor's `metadata` as JSON: a mapping whose keys are strings,
/// holding any plain YAML (upstream reads it into a protobuf `Struct`).
fn metadata(yaml: &yaml_serde::Value) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    fn json(yaml: &yaml_serde::Value, at: &str) -> Result<serde_json::Value, String> {
        use serde_json::Value as J;
        use yaml_serde::Value as Y;
        Ok(match yaml {
            Y::Null => J::Null,
            Y::Bool(b) => J::Bool(*b),
            Y::Number(n) => n.as_f64().and_then(serde_json::Number::from_f64).map_or(J::Null, J::Number),
            Y::String(s) => J::String(s.clone()),
            Y::Sequence(items) => J::Array(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| json(v, &format!("{at}[{i}]")))
                    .collect::<Result<_, _>>()?,
            ),
            Y::Mapping(map) => J::Object(object(map, at)?),
            Y::Tagged(_) => {
                return Err(format!("{at}: YAML tags are not supported"));
            }
        })
    }
    fn object(
        map: &yaml_serde::Mapping,
        at: &str,
    ) -> Result<serde_json::Map<String, serde_json::Value>, String> {
        map.iter()
            .map(|(k, v)| {
                let yaml_serde::Value::String(key) = k else {
                    let message = format!("keys must be strings, found {k:?}");
                    return Err(if at.is_empty() { message } else { format!("{at}: {message}") });
                };
                let path = if at.is_empty() { key.clone() } else { format!("{at}.{key}") };
                Ok((key.clone(), json(v, &path)?))
            })
            .collect()
    }
    match yaml {
        yaml_serde::Value::Mapping(map) => object(map, ""),
        other => Err(format!("must be a mapping, found {other:?}")),
    }
}

/// `unit_multiplier`, checked: at least 1, not beside `unlimited`, and a
/// window of at most [`MAX_WINDOW_SECONDS`].
fn multiplier(file: &Path, at: &str, r: &YamlRateLimit, unit: Option<Unit>) -> Result<u32, RuleError> {
    let Some(multiplier) = r.unit_multiplier else { return Ok(1) };
    let problem = match unit {
        None => Some("should not specify a unit_multiplier when unlimited".to_owned()),
        _ if multiplier == 0 => Some("must be at least 1".to_owned()),
        Some(unit) if unit.seconds() * u64::from(multiplier) > MAX_WINDOW_SECONDS => Some(format!(
            "a window of {multiplier} × {unit:?} is longer than a year ({MAX_WINDOW_SECONDS} s)"
        )),
        Some(_) => None,
    };
    match problem {
        Some(message) => Err(error(file, Some(at), "unit_multiplier", message)),
        None => Ok(multiplier),
    }
}

fn compile_limit(
    file: &Path,
    at: &str,
    r: &YamlRateLimit,
    d: &YamlDescriptor,
    full_key: &str,
    metadata: Option<Arc<serde_json::Map<String, serde_json::Value>>>,
) -> Result<EnvoyLimit, RuleError> {
    let at = format!("{at}.rate_limit");
    let unit = Unit::parse(&r.unit);
    if r.unlimited && unit.is_some() {
        return Err(error(
            file,
            Some(&at),
            "unit",
            "should not specify rate limit unit when unlimited".to_owned(),
        ));
    }
    if !r.unlimited && unit.is_none() {
        return Err(error(file, Some(&at), "unit", format!("invalid rate limit unit '{}'", r.unit)));
    }
    for replaced in &r.replaces {
        if replaced.name.is_empty() {
            return Err(error(
                file,
                Some(&at),
                "replaces",
                "should not have an empty replaces entry".to_owned(),
            ));
        }
        if replaced.name == r.name {
            return Err(error(
                file,
                Some(&at),
                "replaces",
                "replaces should not contain name of same descriptor".to_owned(),
            ));
        }
    }
    let algorithm = match r.algorithm.as_str() {
        "" => None,
        name => Some(Algorithm::named(name).map_err(|message| error(file, Some(&at), "algorithm", message))?),
    };
    if algorithm.is_some_and(Algorithm::releases) {
        // Slots are given back by `ratelimitd.release` descriptors: a limit
        // of requests in flight stands alone, as a native one does.
        let alone = |field: &str, what: &str| {
            let message = format!("a limit of requests in flight (algorithm: concurrency) cannot {what}");
            Err(error(file, Some(&at), field, message))
        };
        if !d.also.is_empty() {
            return alone("also", "share its descriptor with further limits");
        }
        if r.adaptive.is_some() || r.global || d.report_mode {
            let field = if r.adaptive.is_some() {
                "adaptive"
            } else if r.global {
                "global"
            } else {
                "report_mode"
            };
            return alone(
                field,
                "be adaptive, global or report_mode (its release is a ratelimitd.release descriptor)",
            );
        }
    }
    let unit_multiplier = multiplier(file, &at, r, unit)?;
    if let Some(unit) = unit {
        let seconds = unit.seconds() * u64::from(unit_multiplier);
        let window = params(seconds, r.requests_per_unit, Algorithm::SlidingWindow);
        // Holds for every u32 with the ticks chosen per window; checked anyway.
        if window.capacity.saturating_mul(window.window_ms) > MAX_CAPACITY_TIMES_WINDOW {
            return Err(error(file, Some(&at), "requests_per_unit", "too large to count exactly".to_owned()));
        }
    }
    Ok(EnvoyLimit {
        full_key: Arc::from(full_key),
        requests_per_unit: r.requests_per_unit,
        unit,
        unit_multiplier,
        unlimited: r.unlimited,
        shadow_mode: d.shadow_mode,
        quota_mode: d.quota_mode,
        report_mode: d.report_mode,
        peek_mode: false,
        metadata,
        name: Some(r.name.clone()).filter(|n| !n.is_empty()),
        replaces: r.replaces.iter().map(|r| r.name.clone()).collect(),
        detailed_metric: d.detailed_metric,
        algorithm,
        overload: d.overload,
        also: Vec::new(),
        adaptive: adaptive_limit(file, &at, r, unit.map(|u| u.seconds() * u64::from(unit_multiplier)))?,
        global: global(file, &at, r)?,
    })
}

/// A `rate_limit`'s `global`, checked: a limit.
fn global(file: &Path, at: &str, r: &YamlRateLimit) -> Result<bool, RuleError> {
    match (r.global, r.unlimited) {
        (true, true) => {
            Err(error(file, Some(at), "global", "should not specify global when unlimited".to_owned()))
        }
        (global, _) => Ok(global),
    }
}

/// A `rate_limit`'s `adaptive:`, checked (errors at `adaptive.<field>`,
/// or `requests_per_unit` when it is not between `min` and `max`); `seconds`:
/// its window, `None` when unlimited.
fn adaptive_limit(
    file: &Path,
    at: &str,
    r: &YamlRateLimit,
    seconds: Option<u64>,
) -> Result<Option<Arc<AdaptiveLimit>>, RuleError> {
    let Some(spec) = &r.adaptive else { return Ok(None) };
    let Some(seconds) = seconds else {
        return Err(error(
            file,
            Some(at),
            "adaptive",
            "should not specify adaptive when unlimited".to_owned(),
        ));
    };
    let fits = |max: u64| {
        let per_unit = u32::try_from(max).map_err(|_| format!("must be at most {}", u32::MAX))?;
        let window = params(seconds, per_unit, Algorithm::SlidingWindow);
        let exact = window.capacity.saturating_mul(window.window_ms) <= MAX_CAPACITY_TIMES_WINDOW;
        if exact { Ok(()) } else { Err("too large to count exactly".to_owned()) }
    };
    let params = crate::rules::compile::adaptive_params(
        spec,
        u64::from(r.requests_per_unit),
        "requests_per_unit",
        fits,
    )
    .map_err(|(field, message)| error(file, Some(at), &field, message))?;
    Ok(Some(Arc::new(AdaptiveLimit::new(params, u64::from(r.requests_per_unit)))))
}

/// Most limits `also` may add to a descriptor.
pub const MAX_ALSO_LIMITS: usize = 8;

/// A descriptor's `also` limits, each compiled like `rate_limit` (errors at
/// `also[i]`): limited, unnamed, replacing nothing, beside a limited
/// `rate_limit`.
fn also_limits(
    file: &Path,
    at: &str,
    d: &YamlDescriptor,
    first: &EnvoyLimit,
) -> Result<Vec<Arc<EnvoyLimit>>, RuleError> {
    if d.also.is_empty() {
        return Ok(Vec::new());
    }
    if first.unlimited {
        return Err(error(file, Some(at), "also", "needs a limited rate_limit beside it".to_owned()));
    }
    if d.also.len() > MAX_ALSO_LIMITS {
        return Err(error(file, Some(at), "also", format!("at most {MAX_ALSO_LIMITS} further limits")));
    }
    d.also
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let here = format!("{at}.also[{i}]");
            let problem = if r.unlimited {
                Some(("unlimited", "an also limit is a limit"))
            } else if !r.name.is_empty() || !r.replaces.is_empty() {
                Some((
                    "name",
                    "an also limit has no name and replaces nothing (the rate_limit beside it does)",
                ))
            } else if r.adaptive.is_some() {
                Some(("adaptive", "an also limit is fixed (the rate_limit beside it may be adaptive)"))
            } else if r.global {
                Some((
                    "global",
                    "an also limit is this region's own (the rate_limit beside it may be global)",
                ))
            } else {
                None
            };
            if let Some((field, message)) = problem {
                return Err(error(file, Some(&here), field, message.to_owned()));
            }
            // Compiled as a rate_limit, reported under `also[i]`.
            let limit = compile_limit(file, &here, r, d, &first.full_key, first.metadata.clone())
                .map_err(|e| RuleError { rule: Some(here.clone()), ..e })?;
            Ok(Arc::new(limit))
        })
        .collect()
}
