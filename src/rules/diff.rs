//! `rules diff`: what a candidate native rule set changes against another
//! (the rules in force, by default), in words a reviewer reads: rules
//! added, removed, and each changed field from and to; and, given captured
//! traffic, how many requests each change touches (a request whose rule is
//! another one under the candidate, or whose rule changed).

use std::collections::BTreeMap;

use super::{Rule, Snapshot};

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
        ("limit", rule.limit.to_string()),
        ("window", format!("{} ms", rule.window.window_ms)),
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
        "{} {} per {} ms ({:?}{})",
        rule.resource_path,
        rule.limit,
        rule.window.window_ms,
        rule.window.algorithm,
        rule.client_type.as_deref().map(|c| format!(", client_type {c}")).unwrap_or_default()
    )
}

/// The changes from `old` to `new`, removed first, then changed, then added,
/// each in rule id order.
pub fn diff(old: &Snapshot, new: &Snapshot) -> Vec<Change> {
    let by_id = |s: &Snapshot| -> BTreeMap<String, Rule> {
        s.rules().iter().map(|r| (r.id.to_string(), r.clone())).collect()
    };
    let (old, new) = (by_id(old), by_id(new));
    let mut out: Vec<Change> =
        old.keys().filter(|id| !new.contains_key(*id)).cloned().map(Change::Removed).collect();
    for (id, before) in &old {
        let Some(after) = new.get(id) else { continue };
        let changed: Vec<(&'static str, String, String)> = fields(before)
            .into_iter()
            .zip(fields(after))
            .filter(|((_, a), (_, b))| a != b)
            .map(|((field, a), (_, b))| (field, a, b))
            .collect();
        let overload = (format!("{:?}", before.overload), format!("{:?}", after.overload));
        let mut changed = changed;
        if overload.0 != overload.1 {
            changed.push(("overload", overload.0, overload.1));
        }
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
    let changed: BTreeMap<&str, ()> = changes.iter().map(|c| (c.rule_id(), ())).collect();
    let mut out: BTreeMap<String, u64> = changes.iter().map(|c| (c.rule_id().to_owned(), 0)).collect();
    for (path, client_type) in requests {
        let before = old.lookup(path, client_type).map(|r| &*r.id);
        let after = new.lookup(path, client_type).map(|r| &*r.id);
        let moved = before != after;
        let mut count = |id: Option<&str>| {
            if let Some(id) = id
                && (moved || changed.contains_key(id))
                && let Some(n) = out.get_mut(id)
            {
                *n += 1;
            }
        };
        count(before);
        if after != before {
            count(after);
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
}
