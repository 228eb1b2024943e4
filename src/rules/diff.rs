//! `rules diff`: what a candidate rule set changes against another (the
//! rules in force, by default), in words a reviewer reads: native rules (by
//! rule id), Envoy limits (by full key) and limitador's limits (by what
//! makes their counter: namespace, seconds, conditions, variables) added,
//! removed, and each changed
//! field from and to; and, given captured traffic, how many requests each
//! change touches (a request whose rule or limit is another one under the
//! candidate, or whose rule or limit changed).

use std::collections::BTreeMap;

use super::{
    Rule, Snapshot,
    envoy::{EnvoyConfig, EnvoyLimit},
    limitador::{Limit, Limits},
};

/// One change between two rule sets, by rule id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// In the candidate only.
    Added(String),
    /// In the old set only.
    Removed(String),
    /// In both, with these fields changed: (field, from, to).
    Changed(String, Vec<(&'static str, String, String)>),
}

impl Change {
    /// The rule id the change is about.
    pub fn rule_id(&self) -> &str {
        match self {
            Change::Added(id) | Change::Removed(id) | Change::Changed(id, _) => id,
        }
    }
}

/// A rule's fields as a reviewer reads them, in a fixed order.
fn fields(rule: &Rule) -> [(&'static str, String); 9] {
    [
        ("resource_path", rule.resource_path.clone()),
        ("client_type", rule.client_type.clone().unwrap_or_else(|| "any".to_owned())),
        ("limit", rule.limit_text(0)),
        ("window", rule.window_text(0)),
        ("burst_capacity", rule.burst_capacity.to_string()),
        ("algorithm", format!("{:?}", rule.window.algorithm)),
        ("priority", rule.priority.to_string()),
        ("mode", format!("{:?}", rule.mode)),
        ("failure_policy", format!("{:?}", rule.failure_policy)),
    ]
}

/// One line describing `rule`.
pub fn describe(rule: &Rule) -> String {
    format!(
        "{} {} per {} ({:?}{})",
        rule.resource_path,
        rule.limit_text(0),
        rule.window_text(0),
        rule.window.algorithm,
        rule.client_type.as_deref().map(|c| format!(", client_type {c}")).unwrap_or_default()
    )
}

/// [`describe`] of rule `id` of `snapshot`; empty when it has none.
pub fn describe_rule(snapshot: &Snapshot, id: &str) -> String {
    snapshot.rules().iter().find(|r| &*r.id == id).map(describe).unwrap_or_default()
}

/// [`describe_envoy`] of the limit `key` among `limits` (an Envoy
/// configuration's, walked once by the caller); empty when none has it.
pub fn describe_limit(limits: &[std::sync::Arc<EnvoyLimit>], key: &str) -> String {
    limits.iter().find(|l| &*l.full_key == key).map(|l| describe_envoy(l)).unwrap_or_default()
}

/// The changes from `old` to `new`, removed first, then changed, then added,
/// each in rule id order.
pub fn diff(old: &Snapshot, new: &Snapshot) -> Vec<Change> {
    let by_id = |s: &Snapshot| -> BTreeMap<String, Rule> {
        s.rules().iter().map(|r| (r.id.to_string(), r.clone())).collect()
    };
    changes(&by_id(old), &by_id(new), |rule| {
        let mut fields = fields(rule).to_vec();
        fields.push(("overload", format!("{:?}", rule.overload)));
        let also: Vec<String> = rule
            .also
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let level =
                    rule.level_name_at(i + 1).map(|level| format!(", level {level}")).unwrap_or_default();
                format!(
                    "{} per {} ({:?}{level})",
                    rule.limit_text(i + 1),
                    rule.window_text(i + 1),
                    a.window.algorithm
                )
            })
            .collect();
        fields.push(("also", format!("[{}]", also.join(", "))));
        let levels: Vec<String> = rule
            .levels
            .iter()
            .flat_map(|levels| &levels.keys)
            .map(|key| format!("{} from header {}", key.name, key.header))
            .collect();
        fields.push(("levels", format!("[{}]", levels.join(", "))));
        fields.push(("level", rule.level_name_at(0).map_or_else(|| "user".to_owned(), |l| l.to_string())));
        let adaptive = rule.adaptive.as_deref().map(|a| a.params);
        fields.push(("adaptive", adaptive.map_or_else(|| "-".to_owned(), |a| format!("{a:?}"))));
        fields
    })
}

/// An Envoy limit's fields as a reviewer reads them, in a fixed order.
fn envoy_fields(limit: &EnvoyLimit) -> Vec<(&'static str, String)> {
    vec![
        ("limit", describe_envoy(limit)),
        ("algorithm", limit.algorithm.map_or_else(|| "envoy.algorithm".to_owned(), |a| format!("{a:?}"))),
        ("shadow_mode", limit.shadow_mode.to_string()),
        ("quota_mode", limit.quota_mode.to_string()),
        ("report_mode", limit.report_mode.to_string()),
        ("name", limit.name.clone().unwrap_or_else(|| "-".to_owned())),
        ("replaces", limit.replaces.join(",")),
        ("overload", format!("{:?}", limit.overload)),
        (
            "also",
            format!("[{}]", limit.also.iter().map(|a| describe_envoy(a)).collect::<Vec<_>>().join(", ")),
        ),
    ]
}

/// An Envoy limit in a few words: `10 per MINUTE`, `unlimited`.
pub fn describe_envoy(limit: &EnvoyLimit) -> String {
    match limit.unit {
        Some(unit) if !limit.unlimited && limit.unit_multiplier > 1 => {
            format!("{} per {} × {unit:?}", limit.requests_per_unit, limit.unit_multiplier).to_uppercase()
        }
        Some(unit) if !limit.unlimited => format!("{} per {unit:?}", limit.requests_per_unit).to_uppercase(),
        _ => "unlimited".to_owned(),
    }
}

/// The changes from `old` to `new` Envoy configurations, by full key, in
/// the order of [`diff`].
pub fn envoy_diff(old: &EnvoyConfig, new: &EnvoyConfig) -> Vec<Change> {
    let by_key = |c: &EnvoyConfig| -> BTreeMap<String, std::sync::Arc<EnvoyLimit>> {
        c.limits().into_iter().map(|l| (l.full_key.to_string(), l)).collect()
    };
    changes(&by_key(old), &by_key(new), |limit| envoy_fields(limit))
}

/// A limitador limit in a few words: `5 per 60 s (name per-user)`.
pub fn describe_limitador(limit: &Limit) -> String {
    let name = limit.name.as_deref().map(|n| format!(" (name {n})")).unwrap_or_default();
    format!("{} per {} s{name}", limit.max_value, limit.seconds)
}

/// [`describe_limitador`] of the limit `key` among `limits` (a limits
/// file's, by [`limitador_by_key`], walked once by the caller); empty when
/// none has it.
pub fn describe_limitador_key(limits: &BTreeMap<String, &Limit>, key: &str) -> String {
    limits.get(key).map(|l| describe_limitador(l)).unwrap_or_default()
}

/// The changes from `old` to `new` limitador limits, by [`Limit::written_identity`],
/// in the order of [`diff`]; a changed `max_value`, `name` or `id` keeps
/// the limit's counters.
pub fn limitador_diff(old: &Limits, new: &Limits) -> Vec<Change> {
    changes(&limitador_by_key(old), &limitador_by_key(new), |limit| {
        let text = |v: &Option<std::sync::Arc<str>>| v.as_deref().unwrap_or("-").to_owned();
        vec![("max_value", limit.max_value.to_string()), ("name", text(&limit.name)), ("id", text(&limit.id))]
    })
}

/// `limits` by [`Limit::written_identity`].
pub fn limitador_by_key(limits: &Limits) -> BTreeMap<String, &Limit> {
    limits.namespaces().flat_map(|(_, l)| l).map(|l| (l.written_identity(), l)).collect()
}

/// Removed, changed (the fields that differ), added: by key, in key order.
fn changes<T>(
    old: &BTreeMap<String, T>,
    new: &BTreeMap<String, T>,
    fields: impl Fn(&T) -> Vec<(&'static str, String)>,
) -> Vec<Change> {
    let mut out: Vec<Change> =
        old.keys().filter(|id| !new.contains_key(*id)).cloned().map(Change::Removed).collect();
    for (id, before) in old {
        let Some(after) = new.get(id) else { continue };
        let changed: Vec<(&'static str, String, String)> = fields(before)
            .into_iter()
            .zip(fields(after))
            .filter(|((_, a), (_, b))| a != b)
            .map(|((field, a), (_, b))| (field, a, b))
            .collect();
        if !changed.is_empty() {
            out.push(Change::Changed(id.clone(), changed));
        }
    }
    out.extend(new.keys().filter(|id| !old.contains_key(*id)).cloned().map(Change::Added));
    out
}

/// Per rule id of `changes`, how many of `requests` (resource path, client
/// type) the change touches: the request's rule differs between `old` and
/// `new`, or is the same rule, changed. A request counts for the rule it
/// had and the rule it gets.
pub fn touched<'a>(
    old: &Snapshot,
    new: &Snapshot,
    changes: &[Change],
    requests: impl IntoIterator<Item = (&'a str, Option<&'a str>)>,
) -> BTreeMap<String, u64> {
    touched_by(
        changes,
        requests.into_iter().map(|(path, client_type)| {
            let rule = |s: &Snapshot| s.lookup(path, client_type).map(|r| std::sync::Arc::clone(&r.id));
            [(rule(old), rule(new))]
        }),
    )
}

/// As [`touched`], for Envoy requests given as (domain, each descriptor's
/// entries): a request counts once for each changed limit any of its
/// descriptors had or gets.
pub fn envoy_touched<'a, D, E>(
    old: &EnvoyConfig,
    new: &EnvoyConfig,
    changes: &[Change],
    requests: impl IntoIterator<Item = (&'a str, D)>,
) -> BTreeMap<String, u64>
where
    D: IntoIterator<Item = E>,
    E: IntoIterator<Item = (&'a str, &'a str)> + Clone,
{
    touched_by(
        changes,
        requests.into_iter().map(|(domain, descriptors)| {
            let limit = |c: &EnvoyConfig, entries: E| {
                c.lookup(domain, entries).map(|m| std::sync::Arc::clone(&m.limit.full_key))
            };
            descriptors
                .into_iter()
                .map(|entries| (limit(old, entries.clone()), limit(new, entries)))
                .collect::<Vec<_>>()
        }),
    )
}

/// Counts, per changed key, the items with a (before, after) pair that
/// touches it: the key changed, or the pair moved to or from it.
fn touched_by<P>(changes: &[Change], items: impl IntoIterator<Item = P>) -> BTreeMap<String, u64>
where
    P: IntoIterator<Item = (Option<std::sync::Arc<str>>, Option<std::sync::Arc<str>>)>,
{
    let changed: BTreeMap<&str, ()> = changes.iter().map(|c| (c.rule_id(), ())).collect();
    let mut out: BTreeMap<String, u64> = changes.iter().map(|c| (c.rule_id().to_owned(), 0)).collect();
    let mut hit: Vec<String> = Vec::new();
    for pairs in items {
        hit.clear();
        for (before, after) in pairs {
            let moved = before != after;
            for id in [before.as_deref(), after.as_deref()].into_iter().flatten() {
                if (moved || changed.contains_key(id)) && out.contains_key(id) && !hit.iter().any(|h| h == id)
                {
                    hit.push(id.to_owned());
                }
            }
        }
        for id in &hit {
            if let Some(n) = out.get_mut(id) {
                *n += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::rules::{PathForm, from_text};

    fn set(yaml: &str) -> Snapshot {
        from_text(Path::new("t.yaml"), yaml, PathForm::default()).unwrap()
    }

    #[test]
    fn says_what_was_added_removed_and_changed_and_what_traffic_it_touches() {
        let old = set(
            "rules:\n  - { rule_id: search, resource_path: /s, limit: 10, window_seconds: 1 }\n  - { rule_id: old, resource_path: /o, limit: 5, window_seconds: 1 }\n  - { rule_id: same, resource_path: /x, limit: 5, window_seconds: 1 }\n",
        );
        let new = set(
            "rules:\n  - { rule_id: search, resource_path: /s, limit: 20, window_seconds: 2 }\n  - { rule_id: same, resource_path: /x, limit: 5, window_seconds: 1 }\n  - { rule_id: write, resource_path: /o, limit: 1, window_seconds: 1 }\n",
        );
        let changes = diff(&old, &new);
        assert_eq!(
            changes,
            vec![
                Change::Removed("old".to_owned()),
                Change::Changed(
                    "search".to_owned(),
                    vec![
                        ("limit", "10".to_owned(), "20".to_owned()),
                        ("window", "1000 ms".to_owned(), "2000 ms".to_owned())
                    ]
                ),
                Change::Added("write".to_owned()),
            ]
        );
        let traffic = [("/s", None), ("/s", None), ("/o", None), ("/x", None), ("/nothing", None)];
        let touched = touched(&old, &new, &changes, traffic);
        assert_eq!(touched["search"], 2, "both /s requests: their rule changed");
        assert_eq!((touched["old"], touched["write"]), (1, 1), "/o moves from old to write");
        assert!(!touched.contains_key("same"), "unchanged rules are not listed");
        assert!(diff(&old, &old).is_empty());
    }

    #[test]
    fn a_change_of_levels_is_shown() {
        let rule = |also_level: &str, header: &str| {
            set(&format!(
                "rules:\n  - {{ rule_id: llm, resource_path: /l, limit: 10, window_seconds: 1, levels: {{ team: {header} }}, level: team, also: [ {{ limit: 50, window_seconds: 60{also_level} }} ] }}\n"
            ))
        };
        let changes = diff(&rule("", "x-team"), &rule(", level: team", "x-group"));
        let Change::Changed(_, fields) = &changes[0] else { panic!("{changes:?}") };
        assert_eq!(
            fields,
            &[
                (
                    "also",
                    "[50 per 60000 ms (SlidingWindow)]".to_owned(),
                    "[50 per 60000 ms (SlidingWindow, level team)]".to_owned()
                ),
                ("levels", "[team from header x-team]".to_owned(), "[team from header x-group]".to_owned()),
            ]
        );
    }

    #[test]
    fn limitador_limits_are_compared_by_what_makes_their_counter() {
        let limits = |yaml: &str| {
            Limits::parse(Path::new("l.yaml"), yaml, crate::limiter::Algorithm::FirstHitWindow).unwrap()
        };
        let old = limits(
            "- { namespace: ns, max_value: 5, seconds: 60, conditions: [\"descriptors[0]['m'] == 'GET'\"], variables: [\"descriptors[0]['u']\"] }\n- { namespace: ns, max_value: 9, seconds: 1, conditions: [], variables: [] }\n",
        );
        let new = limits(
            "- { namespace: ns, max_value: 7, seconds: 60, name: per-user, conditions: [\"descriptors[0]['m'] == 'GET'\"], variables: [\"descriptors[0]['u']\"] }\n- { namespace: ns, max_value: 9, seconds: 2, conditions: [], variables: [] }\n",
        );
        let key = "ns 60s if [descriptors[0]['m'] == 'GET'] by [descriptors[0]['u']]";
        assert_eq!(
            limitador_diff(&old, &new),
            vec![
                Change::Removed("ns 1s if [] by []".to_owned()),
                Change::Changed(
                    key.to_owned(),
                    vec![
                        ("max_value", "5".to_owned(), "7".to_owned()),
                        ("name", "-".to_owned(), "per-user".to_owned())
                    ]
                ),
                Change::Added("ns 2s if [] by []".to_owned()),
            ]
        );
        assert_eq!(describe_limitador_key(&limitador_by_key(&new), key), "7 per 60 s (name per-user)");
        assert_eq!(describe_limitador_key(&limitador_by_key(&new), "ns 1s if [] by []"), "");
    }
}
