//! Validation of a whole rule set and its compilation into a [`Snapshot`].
//!
//! Validation is all-or-nothing: one bad rule rejects the set, and every
//! problem is reported at once with file, rule and field.

use std::{collections::HashMap, path::Path, sync::Arc};

use super::{
    RuleError,
    model::{
        ADAPTIVE_INTERVAL_MS, AdaptiveSpec, AlsoLimit, MAX_ALSO_LIMITS, MAX_OVERLOAD_RATE, MAX_UNIT_BYTES,
        Rule, capacity,
    },
    native::{RawLimit, RawRule, SourcedRule},
    prices::{COST, Prices},
    snapshot::{PathForm, PathKey, Snapshot},
};
use crate::limiter::{
    adaptive::{AdaptiveLimit, AimdParams},
    calendar::Calendar,
    window::{Algorithm, MAX_CAPACITY_TIMES_WINDOW, WindowParams},
};

/// Longest accepted rule id; ids are part of Redis keys and metric labels.
pub(crate) const MAX_RULE_ID_BYTES: usize = 128;

/// Validates `rules` (loaded from `source`) and builds the snapshot,
/// matching paths in `form`.
pub(crate) fn compile(
    source: &Path,
    rules: Vec<SourcedRule>,
    form: PathForm,
) -> Result<Snapshot, Vec<RuleError>> {
    let mut errors = Vec::new();
    let mut compiled = Vec::with_capacity(rules.len());
    let mut ids: HashMap<Arc<str>, (Arc<Path>, usize)> = HashMap::with_capacity(rules.len());
    let mut keys: HashMap<(PathKey, Option<String>), usize> = HashMap::with_capacity(rules.len());

    for sourced in rules {
        let rule = match validate(&sourced) {
            Ok(rule) => rule,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        if let Some((file, index)) = ids.get(&rule.id) {
            errors.push(error(
                &sourced,
                "rule_id",
                format!("duplicate rule id, first defined in {} (rules[{index}])", file.display()),
            ));
            continue;
        }
        let key = (PathKey::of(&rule.resource_path, form), rule.client_type.clone());
        if let Some(&other) = keys.get(&key) {
            let other: &Rule = &compiled[other];
            errors.push(error(
                &sourced,
                "resource_path",
                format!(
                    "ambiguous: rule {:?} in {} already covers resource_path {:?} with client_type {}",
                    other.id,
                    other.source.display(),
                    other.resource_path,
                    other.client_type.as_deref().unwrap_or("(any)"),
                ),
            ));
            continue;
        }
        ids.insert(Arc::clone(&rule.id), (Arc::clone(&sourced.file), sourced.index));
        keys.insert(key, compiled.len());
        compiled.push(rule);
    }
    if errors.is_empty() { Ok(Snapshot::build(source, compiled, form)) } else { Err(errors) }
}

fn error(sourced: &SourcedRule, field: &str, message: String) -> RuleError {
    let rule = if sourced.raw.rule_id.is_empty() {
        format!("rules[{}]", sourced.index)
    } else {
        format!("{:?} (rules[{}])", sourced.raw.rule_id, sourced.index)
    };
    RuleError {
        file: sourced.file.to_path_buf(),
        line: None,
        rule: Some(rule),
        field: Some(field.to_owned()),
        message,
    }
}

fn validate(sourced: &SourcedRule) -> Result<Rule, RuleError> {
    let raw = &sourced.raw;
    let fail = |(field, message): (&str, String)| error(sourced, field, message);
    names(raw).map_err(fail)?;
    let written = match raw.algorithm.as_deref() {
        None => None,
        Some(name) => Some(Algorithm::named(name).map_err(|message| fail(("algorithm", message)))?),
    };
    let first = raw_first(raw);
    let (capacity, window_ms, calendar) = limit_window(&first).map_err(fail)?;
    let algorithm = counted_by(written, &first).map_err(|message| fail(("algorithm", message)))?;
    let unit = unit_of(&first).map_err(|message| fail(("unit", message)))?;
    let mut also = also_limits(raw, written).map_err(|(field, message)| error(sourced, &field, message))?;
    let (levels, level) = super::levels::compile(raw, algorithm, &mut also)
        .map_err(|(field, message)| error(sourced, &field, message))?;
    if let Some(overload) = &raw.overload
        && !(1..=MAX_OVERLOAD_RATE).contains(&overload.rate_per_second)
    {
        let message = format!("must be between 1 and {MAX_OVERLOAD_RATE}");
        return Err(fail(("overload.rate_per_second", message)));
    }
    let adaptive = rule_adaptive(raw).map_err(|(field, message)| error(sourced, &field, message))?;
    in_flight(raw, algorithm, &also).map_err(fail)?;
    moving(raw, unit.is_some(), calendar.is_some()).map_err(fail)?;
    let charges = unit.as_deref() == Some(COST) || also.iter().any(|a| a.unit.as_deref() == Some(COST));
    let prices = priced(raw, charges).map_err(|(field, message)| error(sourced, &field, message))?;
    Ok(Rule {
        id: Arc::from(raw.rule_id.as_str()),
        resource_path: raw.resource_path.clone(),
        client_type: raw.client_type.clone(),
        priority: raw.priority_bucket,
        limit: raw.limit,
        burst_capacity: raw.burst_capacity,
        window: WindowParams { window_ms, capacity, rate: raw.limit, algorithm },
        mode: raw.mode,
        failure_policy: raw.failure_policy,
        overload: raw.overload,
        also,
        adaptive,
        global: raw.global,
        calendar,
        unit,
        prices,
        levels,
        level,
        source: Arc::clone(&sourced.file),
    })
}

/// The rule's id, path and client type, checked.
fn names(raw: &RawRule) -> Result<(), (&'static str, String)> {
    if raw.rule_id.is_empty() {
        return Err(("rule_id", "must not be empty".to_owned()));
    }
    if raw.rule_id.len() > MAX_RULE_ID_BYTES {
        return Err(("rule_id", format!("longer than {MAX_RULE_ID_BYTES} bytes")));
    }
    if let Some(bad) = raw.rule_id.chars().find(|c| !(c.is_ascii_alphanumeric() || "._-".contains(*c))) {
        return Err(("rule_id", format!("{bad:?} is not allowed: use letters, digits, '.', '_' and '-'")));
    }
    if raw.resource_path.is_empty() {
        return Err(("resource_path", "must not be empty".to_owned()));
    }
    if let Some(star) = raw.resource_path.find('*')
        && star != raw.resource_path.len() - 1
    {
        let message =
            format!("{:?}: '*' is only allowed as the last character (a prefix pattern)", raw.resource_path);
        return Err(("resource_path", message));
    }
    if raw.client_type.as_deref() == Some("") {
        return Err(("client_type", "must not be empty; omit it to match any client".to_owned()));
    }
    Ok(())
}

/// A first limit that moves (`adaptive:`) or is shared out among regions
/// (`global:`) counts requests in a window: outcomes are reported per
/// request, and grants follow a rate.
fn moving(raw: &RawRule, unit: bool, calendar: bool) -> Result<(), (&'static str, String)> {
    let what = if unit {
        "a limit of another unit than requests"
    } else if calendar {
        "a limit counted per calendar period (period:)"
    } else {
        return Ok(());
    };
    if raw.adaptive.is_some() {
        return Err(("adaptive", format!("{what} cannot be adaptive: outcomes are reported per request")));
    }
    if raw.global {
        return Err((
            "global",
            format!("{what} cannot be global: its regions' grants follow a rate of requests"),
        ));
    }
    Ok(())
}

/// The rule's price table, checked: only on a rule with a limit of unit
/// `cost` (what it charges).
fn priced(raw: &RawRule, charges: bool) -> Result<Option<Arc<Prices>>, (String, String)> {
    let Some(table) = &raw.prices else { return Ok(None) };
    if !charges {
        let message = format!("a price table charges a limit of unit {COST}: the rule has none");
        return Err(("prices".to_owned(), message));
    }
    Ok(Some(Arc::new(Prices::new(table, well_formed_unit)?)))
}

/// Whether `unit` is a unit's name: lower-case letters, digits and `_`,
/// starting with a letter, at most [`MAX_UNIT_BYTES`].
fn well_formed_unit(unit: &str) -> bool {
    unit.len() <= MAX_UNIT_BYTES
        && unit.starts_with(|c: char| c.is_ascii_lowercase())
        && unit.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// What a limit counts: `None` for requests (written or not), else the
/// unit's name, lower-case letters, digits and `_`, starting with a
/// letter (`input_tokens`, `cost`).
fn unit_of(limit: &RawLimit) -> Result<Option<Arc<str>>, String> {
    let Some(unit) = limit.unit.as_deref().filter(|unit| *unit != "requests") else { return Ok(None) };
    if !well_formed_unit(unit) {
        return Err(format!(
            "{unit:?}: a unit is lower-case letters, digits and '_', starting with a letter (at most {MAX_UNIT_BYTES} bytes)"
        ));
    }
    Ok(Some(Arc::from(unit)))
}

/// How a limit counts: the algorithm written (the rule's, or the
/// limit's own), else a sliding window, or for a calendar period a fixed
/// one (it starts from zero when the period does). A calendar period
/// counts in a window, sliding or fixed.
fn counted_by(written: Option<Algorithm>, limit: &RawLimit) -> Result<Algorithm, String> {
    let Some(period) = limit.period else { return Ok(written.unwrap_or(Algorithm::SlidingWindow)) };
    match written {
        None => Ok(Algorithm::FixedWindow),
        Some(algorithm @ (Algorithm::FixedWindow | Algorithm::SlidingWindow)) => Ok(algorithm),
        Some(other) => Err(format!(
            "a calendar period (period: {}) counts with fixed_window or sliding_window, not {}",
            period.as_str(),
            other.as_str()
        )),
    }
}

/// A limit of requests in flight (`algorithm: concurrency`) stands alone:
/// its reports give slots back, so it shares no rule with a limit whose
/// reports count usage (`also:`), nor moves (`adaptive:`), nor is split
/// among regions (`global:`), whose grants follow a rate.
fn in_flight(raw: &RawRule, algorithm: Algorithm, also: &[AlsoLimit]) -> Result<(), (&'static str, String)> {
    let releases = algorithm.releases() || also.iter().any(|a| a.window.algorithm.releases());
    let unit = raw.unit.as_deref().is_some_and(|unit| unit != "requests");
    let alone = |what: &str| format!("a limit of requests in flight (algorithm: concurrency) cannot {what}");
    if !releases {
        Ok(())
    } else if !also.is_empty() {
        Err(("also", alone("share its rule with further limits: give it a rule of its own")))
    } else if unit {
        Err(("unit", alone("count another unit than requests")))
    } else if raw.adaptive.is_some() {
        Err(("adaptive", alone("be adaptive")))
    } else if raw.global {
        Err(("global", alone("be global")))
    } else {
        Ok(())
    }
}

/// `adaptive:` checked for a limit that starts at `start` (the field
/// `start_field`); `fits(max)` says whether the highest limit fits the
/// counters' bound. An error names the field (`adaptive.max`, or
/// `start_field` when it is not between `min` and `max`).
pub(crate) fn adaptive_params(
    spec: &AdaptiveSpec,
    start: u64,
    start_field: &str,
    fits: impl Fn(u64) -> Result<(), String>,
) -> Result<AimdParams, (String, String)> {
    let at = |field: &str| format!("adaptive.{field}");
    if spec.min == 0 {
        return Err((at("min"), "must be at least 1".to_owned()));
    }
    if spec.max < spec.min {
        return Err((at("max"), format!("must be at least adaptive.min ({})", spec.min)));
    }
    fits(spec.max).map_err(|message| (at("max"), message))?;
    if !(spec.min..=spec.max).contains(&start) {
        let (min, max) = (spec.min, spec.max);
        let message = format!(
            "an adaptive limit starts at `{start_field}`: it must be between adaptive.min ({min}) and adaptive.max ({max})"
        );
        return Err((start_field.to_owned(), message));
    }
    if spec.increase == Some(0) {
        return Err((at("increase"), "must be at least 1".to_owned()));
    }
    if !(spec.decrease > 0.0 && spec.decrease < 1.0) {
        return Err((at("decrease"), format!("must be between 0 and 1 (exclusive), got {}", spec.decrease)));
    }
    if !ADAPTIVE_INTERVAL_MS.contains(&spec.interval_ms) {
        let (low, high) = (ADAPTIVE_INTERVAL_MS.start(), ADAPTIVE_INTERVAL_MS.end());
        return Err((at("interval_ms"), format!("must be between {low} and {high}")));
    }
    if !(spec.max_failure_ratio >= 0.0 && spec.max_failure_ratio < 1.0) {
        let message = format!("must be at least 0 and below 1, got {}", spec.max_failure_ratio);
        return Err((at("max_failure_ratio"), message));
    }
    if spec.latency_ms == Some(0) {
        return Err((at("latency_ms"), "must be at least 1".to_owned()));
    }
    Ok(AimdParams {
        min: spec.min,
        max: spec.max,
        increase: spec.increase(),
        decrease: spec.decrease,
        interval_ms: spec.interval_ms,
        max_failure_ratio: spec.max_failure_ratio,
        latency_ms: spec.latency_ms,
    })
}

/// The rule's adaptive limit, when it has one: its first limit's.
fn rule_adaptive(raw: &RawRule) -> Result<Option<Arc<AdaptiveLimit>>, (String, String)> {
    let Some(spec) = &raw.adaptive else { return Ok(None) };
    // The highest limit must fit the counters' bound as a fixed one must.
    let fits = |max| limit_window(&RawLimit { limit: max, ..raw_first(raw) }).map(|_| ()).map_err(|(_, m)| m);
    let params = adaptive_params(spec, raw.limit, "limit", fits)?;
    Ok(Some(Arc::new(AdaptiveLimit::new(params, raw.limit))))
}

/// The rule's first limit as a [`RawLimit`].
fn raw_first(raw: &RawRule) -> RawLimit {
    RawLimit {
        limit: raw.limit,
        window_seconds: raw.window_seconds,
        period: raw.period,
        time_zone: raw.time_zone.clone(),
        unit: raw.unit.clone(),
        burst_capacity: raw.burst_capacity,
        algorithm: None,
        level: raw.level.clone(),
    }
}

/// A limit checked: its capacity, window and calendar period.
type Checked = (u64, u64, Option<Arc<Calendar>>);

/// A limit's capacity (`floor(limit × burst)`), window in ms (a calendar
/// period's longest, in its ticks) and calendar period, checked; an error
/// names the field (relative to the limit).
fn limit_window(raw: &RawLimit) -> Result<Checked, (&'static str, String)> {
    if raw.limit == 0 {
        return Err(("limit", "must be at least 1".to_owned()));
    }
    if !raw.burst_capacity.is_finite() || raw.burst_capacity < 1.0 {
        return Err(("burst_capacity", format!("must be a number >= 1, got {}", raw.burst_capacity)));
    }
    let Some(period) = raw.period else {
        if raw.time_zone.is_some() {
            return Err(("time_zone", "only a calendar period (period:) has a time zone".to_owned()));
        }
        let (capacity, window_ms) = window(raw)?;
        return Ok((capacity, window_ms, None));
    };
    if raw.window_seconds != 0 {
        return Err(("period", "a limit has window_seconds or a calendar period, not both".to_owned()));
    }
    let zone = raw.time_zone.as_deref().unwrap_or("UTC");
    let calendar = Calendar::new(period, zone).map_err(|message| ("time_zone", message))?;
    let capacity = capacity(raw.limit, raw.burst_capacity);
    let most = MAX_CAPACITY_TIMES_WINDOW / period.max_ticks();
    if capacity > most {
        let period = period.as_str();
        return Err((
            "limit",
            format!(
                "limit x burst_capacity must not exceed {most} for period {period} (the counters are exact \
                 to the unit): use a shorter period or a smaller limit"
            ),
        ));
    }
    Ok((capacity, period.max_ticks(), Some(Arc::new(calendar))))
}

/// A limit of `window_seconds`: its capacity and window in ms, checked.
fn window(raw: &RawLimit) -> Result<(u64, u64), (&'static str, String)> {
    if raw.window_seconds == 0 {
        let message = "must be at least 1 (or give a calendar period: day, week, month or year)";
        return Err(("window_seconds", message.to_owned()));
    }
    let window_ms = raw.window_seconds.checked_mul(1_000);
    // Exact for the magnitudes the bound below admits; a larger one fails it.
    let capacity = capacity(raw.limit, raw.burst_capacity);
    let within_bound = window_ms.is_some_and(|w| capacity <= MAX_CAPACITY_TIMES_WINDOW / w);
    if !within_bound {
        return Err((
            "limit",
            format!(
                "limit x burst_capacity x window_seconds x 1000 must not exceed {MAX_CAPACITY_TIMES_WINDOW} \
                 (the counters are exact to the request and the ms): use a shorter window, a smaller \
                 limit, or a calendar period (period:), counted in coarser ticks"
            ),
        ));
    }
    Ok((capacity, window_ms.unwrap_or(u64::MAX)))
}

/// The rule's `also` limits, checked; an error names the field
/// (`also[1].window_seconds`). Each takes the rule's written algorithm
/// unless it names its own ([`counted_by`]).
fn also_limits(raw: &RawRule, written: Option<Algorithm>) -> Result<Vec<AlsoLimit>, (String, String)> {
    if raw.also.len() > MAX_ALSO_LIMITS {
        return Err(("also".to_owned(), format!("at most {MAX_ALSO_LIMITS} further limits")));
    }
    raw.also
        .iter()
        .enumerate()
        .map(|(i, also)| {
            let at = |field: &str| format!("also[{i}].{field}");
            let (capacity, window_ms, calendar) =
                limit_window(also).map_err(|(field, message)| (at(field), message))?;
            let own = match also.algorithm.as_deref() {
                None => written,
                Some(name) => Some(Algorithm::named(name).map_err(|message| (at("algorithm"), message))?),
            };
            let algorithm = counted_by(own, also).map_err(|message| (at("algorithm"), message))?;
            let unit = unit_of(also).map_err(|message| (at("unit"), message))?;
            let window = WindowParams { window_ms, capacity, rate: also.limit, algorithm };
            let burst_capacity = also.burst_capacity;
            Ok(AlsoLimit { limit: also.limit, burst_capacity, window, calendar, unit, level: None })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::native::parse;

    fn compile_text(text: &str) -> Result<Snapshot, Vec<RuleError>> {
        let rules = parse(Path::new("r.yaml"), text).unwrap();
        compile(Path::new("r.yaml"), rules, PathForm::default())
    }

    fn one_error(text: &str) -> String {
        let errors = compile_text(text).unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        errors[0].to_string()
    }

    fn rule(id: &str, path: &str, extra: &str) -> String {
        format!(
            "  - rule_id: {id}\n    resource_path: {path:?}\n    limit: 10\n    window_seconds: 1\n{extra}"
        )
    }

    #[test]
    fn capacity_is_limit_times_burst_floored() {
        let snapshot =
            compile_text(&format!("rules:\n{}", rule("a", "/a", "    burst_capacity: 1.25\n"))).unwrap();
        let rule = snapshot.lookup("/a", None).unwrap();
        assert_eq!(rule.window, WindowParams { rate: 10, ..WindowParams::sliding(1_000, 12) });
    }

    #[test]
    fn a_bucket_refills_at_the_limit_and_holds_limit_times_burst() {
        let snapshot = compile_text(&format!(
            "rules:\n{}",
            rule("a", "/a", "    burst_capacity: 2\n    algorithm: token_bucket\n")
        ))
        .unwrap();
        let rule = snapshot.lookup("/a", None).unwrap();
        assert_eq!(
            rule.window,
            WindowParams { window_ms: 1_000, capacity: 20, rate: 10, algorithm: Algorithm::TokenBucket }
        );
    }

    #[test]
    fn each_bad_field_is_named() {
        let cases = [
            (rule("a", "/a", "    burst_capacity: 0.5\n"), "field `burst_capacity`"),
            (rule("a", "/a", "").replace("limit: 10", "limit: 0"), "field `limit`"),
            (rule("a", "/a", "").replace("window_seconds: 1", "window_seconds: 0"), "field `window_seconds`"),
            (rule("a b", "/a", ""), "field `rule_id`"),
            (rule("a", "/a*/b", ""), "field `resource_path`"),
            (rule("a", "", ""), "field `resource_path`"),
            (rule("a", "/a", "    client_type: \"\"\n"), "field `client_type`"),
            (rule("a", "/a", "").replace("limit: 10", "limit: 10000000000000"), "field `limit`"),
            (rule("a", "/a", "    algorithm: leaky_bucket\n"), "field `algorithm`"),
            (
                rule("a", "/a", "    algorithm: concurrency\n    also: [{limit: 5, window_seconds: 60}]\n"),
                "field `also`: a limit of requests in flight",
            ),
            (
                rule("a", "/a", "    also: [{limit: 5, window_seconds: 60, algorithm: concurrency}]\n"),
                "field `also`: a limit of requests in flight",
            ),
            (
                rule("a", "/a", "    algorithm: concurrency\n    adaptive: {min: 5, max: 20}\n"),
                "field `adaptive`: a limit of requests in flight",
            ),
            (rule("a", "/a", "    algorithm: concurrency\n    global: true\n"), "field `global`"),
            (rule("a", "/a", "    overload: {rate_per_second: 0}\n"), "field `overload.rate_per_second`"),
            (
                rule("a", "/a", "    adaptive: {min: 11, max: 20}\n"),
                "field `limit`: an adaptive limit starts at",
            ),
            (rule("a", "/a", "    adaptive: {min: 0, max: 20}\n"), "field `adaptive.min`"),
            (rule("a", "/a", "    adaptive: {min: 5, max: 4}\n"), "field `adaptive.max`"),
            (rule("a", "/a", "    adaptive: {min: 5, max: 10000000000000}\n"), "field `adaptive.max`"),
            (rule("a", "/a", "    adaptive: {min: 5, max: 20, decrease: 1}\n"), "field `adaptive.decrease`"),
            (rule("a", "/a", "    adaptive: {min: 5, max: 20, increase: 0}\n"), "field `adaptive.increase`"),
            (
                rule("a", "/a", "    adaptive: {min: 5, max: 20, interval_ms: 50}\n"),
                "field `adaptive.interval_ms`",
            ),
            (
                rule("a", "/a", "    adaptive: {min: 5, max: 20, max_failure_ratio: 1}\n"),
                "field `adaptive.max_failure_ratio`",
            ),
            (
                rule("a", "/a", "    adaptive: {min: 5, max: 20, latency_ms: 0}\n"),
                "field `adaptive.latency_ms`",
            ),
        ];
        for (text, expected) in cases {
            let err = one_error(&format!("rules:\n{text}"));
            assert!(err.starts_with("r.yaml: rule \"a"), "{err}");
            assert!(err.contains(expected), "{expected} not in {err}");
        }
    }

    #[test]
    fn duplicate_ids_are_rejected() {
        let err = one_error(&format!("rules:\n{}{}", rule("a", "/a", ""), rule("a", "/b", "")));
        assert!(err.contains("duplicate rule id"), "{err}");
        assert!(err.contains("rules[1]"), "{err}");
    }

    #[test]
    fn ambiguous_duplicates_are_rejected() {
        let err = one_error(&format!("rules:\n{}{}", rule("a", "/a*", ""), rule("b", "/a*", "")));
        assert!(err.contains("ambiguous"), "{err}");
        // Same path for different client types is not ambiguous.
        compile_text(&format!(
            "rules:\n{}{}",
            rule("a", "/a", ""),
            rule("b", "/a", "    client_type: IOS\n")
        ))
        .unwrap();
    }

    #[test]
    fn all_errors_are_reported_at_once() {
        let errors = compile_text(&format!(
            "rules:\n{}{}",
            rule("a", "/a", "").replace("limit: 10", "limit: 0"),
            rule("b", "/b", "    burst_capacity: 0\n")
        ))
        .unwrap_err();
        assert_eq!(errors.len(), 2, "{errors:?}");
    }

    #[test]
    fn also_limits_compile_with_the_rules_algorithm_unless_their_own() {
        let snapshot = compile_text(&format!(
            "rules:\n{}",
            rule(
                "a",
                "/a",
                "    algorithm: fixed_window\n    also:\n      - { limit: 1000, window_seconds: 86400 }\n      - { limit: 50, window_seconds: 60, burst_capacity: 1.5, algorithm: gcra }\n"
            )
        ))
        .unwrap();
        let rule = snapshot.lookup("/a", None).unwrap();
        assert_eq!(rule.also.len(), 2);
        assert_eq!(rule.also[0].window, WindowParams::window(86_400_000, 1000, false));
        assert_eq!((rule.also[1].window.capacity, rule.also[1].window.algorithm), (75, Algorithm::Gcra));
        assert_eq!(rule.min_capacity(), 10);
        assert_eq!(rule.limit_at(2), (50, rule.also[1].window));
        let keys: Vec<String> =
            rule.items(None, 0, |_| (1, crate::limiter::Count::IfFits)).into_iter().map(|i| i.key).collect();
        assert_eq!(keys, ["#a/0", "#a/1", "#a/2"]);
    }

    #[test]
    fn also_limits_are_checked_field_by_field() {
        let with =
            |also: &str| one_error(&format!("rules:\n{}", rule("a", "/a", &format!("    also: {also}\n"))));
        let e = with("[ { limit: 5, window_seconds: 0 } ]");
        assert!(e.contains("also[0].window_seconds") && e.contains("must be at least 1"), "{e}");
        let e =
            with("[ { limit: 5, window_seconds: 1 }, { limit: 5, window_seconds: 1, algorithm: leaky } ]");
        assert!(e.contains("also[1].algorithm") && e.contains("unknown algorithm"), "{e}");
        let nine = ["{ limit: 5, window_seconds: 1 }"; 9].join(", ");
        let e = with(&format!("[ {nine} ]"));
        assert!(e.contains("also") && e.contains("at most 8"), "{e}");
        let e = with("[ { limit: 5 } ]");
        assert!(e.contains("also[0].window_seconds") && e.contains("calendar period"), "{e}");
    }

    #[test]
    fn units_are_checked_field_by_field() {
        let compiled = |extra: &str| compile_text(&format!("rules:\n{}", rule("a", "/a", extra)));
        let rule = compiled(
            "    unit: input_tokens\n    also: [ { limit: 5, window_seconds: 60, unit: requests } ]\n",
        )
        .unwrap()
        .rules()[0]
            .clone();
        assert_eq!(rule.unit_at(0).map(|u| &**u), Some("input_tokens"));
        assert!(rule.unit_at(1).is_none(), "requests is the default, written or not");
        assert!(rule.has_units() && rule.counts_a_job());
        assert_eq!(rule.limit_text(0), "10 input_tokens");
        let errors = |extra: &str| compiled(extra).unwrap_err()[0].to_string();
        for (extra, expected) in [
            ("    unit: Input-Tokens\n", "field `unit`: \"Input-Tokens\": a unit is lower-case letters"),
            ("    unit: cost\n    global: true\n", "field `global`: a limit of another unit than requests"),
            (
                "    unit: cost\n    adaptive: { min: 1, max: 20 }\n",
                "field `adaptive`: a limit of another unit",
            ),
            ("    unit: cost\n    algorithm: concurrency\n", "field `unit`: a limit of requests in flight"),
            ("    also: [ { limit: 5, window_seconds: 60, unit: \"9lives\" } ]\n", "also[0].unit"),
        ] {
            let e = errors(extra);
            assert!(e.contains(expected), "{extra}: {e}");
        }
        let long = format!("    unit: {}\n", "u".repeat(MAX_UNIT_BYTES + 1));
        assert!(errors(&long).contains("at most 64 bytes"));
        // A unit is part of the rules' version.
        let version = |extra: &str| compiled(extra).unwrap().version().to_owned();
        assert_ne!(version("    unit: input_tokens\n"), version("    unit: output_tokens\n"));
        assert_eq!(version(""), version("    unit: requests\n"));
        // Prices charge a limit of cost, and are part of the version.
        let table = |price: u64| {
            format!(
                "    prices: {{ model_from: x-model, per_million: {{ m: {{ input_tokens: {price} }} }} }}\n"
            )
        };
        let e = errors(&table(1));
        assert!(e.contains("field `prices`: a price table charges a limit of unit cost"), "{e}");
        let priced = |price| format!("    unit: cost\n{}", table(price));
        assert!(compiled(&priced(1)).unwrap().rules()[0].prices.is_some());
        assert_ne!(version(&priced(1)), version(&priced(2)));
        let e = errors(&format!("    unit: cost\n{}", table(1).replace("x-model", "'x model'")));
        assert!(e.contains("field `prices.model_from`"), "{e}");
    }

    #[test]
    fn calendar_periods_are_checked_field_by_field() {
        let errors = |extra: &str| {
            let text = format!("rules:\n{}", rule("a", "/a", extra)).replace("    window_seconds: 1\n", "");
            compile_text(&text).unwrap_err().iter().map(ToString::to_string).collect::<Vec<_>>().join("\n")
        };
        let ok = |extra: &str| {
            let text = format!("rules:\n{}", rule("a", "/a", extra)).replace("    window_seconds: 1\n", "");
            compile_text(&text).map_err(|e| format!("{e:?}")).unwrap().rules()[0].clone()
        };
        let monthly = ok("    period: month\n    time_zone: Europe/Berlin\n");
        assert_eq!(monthly.window.algorithm, Algorithm::FixedWindow, "a period starts from zero");
        assert_eq!(monthly.window_text(0), "month in Europe/Berlin");
        let sliding = ok(
            "    period: day\n    algorithm: sliding_window\n    also: [ { limit: 5, window_seconds: 60 } ]\n",
        );
        assert_eq!(sliding.window.algorithm, Algorithm::SlidingWindow);
        assert_eq!(sliding.calendar_at(0).unwrap().zone_name(), "UTC");
        assert!(sliding.calendar_at(1).is_none() && sliding.counts_a_job());
        for (extra, expected) in [
            ("", "field `window_seconds`: must be at least 1 (or give a calendar period"),
            ("    period: fortnight\n", "fortnight"),
            (
                "    period: month\n    window_seconds: 60\n",
                "field `period`: a limit has window_seconds or a calendar period, not both",
            ),
            ("    window_seconds: 60\n    time_zone: UTC\n", "field `time_zone`: only a calendar period"),
            (
                "    period: month\n    time_zone: Mars/Olympus\n",
                "field `time_zone`: unknown time zone \"Mars/Olympus\"",
            ),
            (
                "    period: month\n    algorithm: gcra\n",
                "field `algorithm`: a calendar period (period: month) counts with fixed_window or sliding_window",
            ),
            ("    period: month\n    global: true\n", "field `global`: a limit counted per calendar period"),
            ("    period: month\n    adaptive: { min: 1, max: 20 }\n", "field `adaptive`"),
            (
                "    window_seconds: 2\n    also: [ { limit: 5, period: year, algorithm: token_bucket } ]\n",
                "also[0].algorithm",
            ),
        ] {
            let e = if expected == "fortnight" {
                let text =
                    format!("rules:\n{}", rule("a", "/a", extra)).replace("    window_seconds: 1\n", "");
                parse(Path::new("r.yaml"), &text).unwrap_err().to_string()
            } else {
                errors(extra)
            };
            assert!(e.contains(expected), "{extra}: {e}");
        }
        // The bound: a year counts in hours, so at most 2^51 / 8,787.
        let text = format!("rules:\n{}", rule("a", "/a", "    period: year\n"))
            .replace("    window_seconds: 1\n", "")
            .replace("limit: 10", "limit: 300000000000");
        let e = compile_text(&text).unwrap_err()[0].to_string();
        assert!(e.contains("field `limit`") && e.contains("for period year"), "{e}");
    }
}
