//! The publish gate's thresholds (`gate.*`) and its verdict as a rules
//! record carries it: plain data, produced by `replay` and checked by
//! instances with `rules.kafka.require_gate` (the record's signature covers it).
//!
//! The gate judges CRITICAL traffic as it was captured: a request counts as
//! CRITICAL when the instance that served it decided it with that priority
//! (under the rules and trust settings in force then), whatever the
//! candidate or the rules in force at replay say. It is judged in groups:
//! all of it, per rule the request matched when captured, and per path; a
//! group with fewer than `min_group_requests` allowed CRITICAL requests is
//! shown but not judged (too few to tell a limit from noise), the global
//! group always is. Client-made traffic on other rules or paths cannot
//! dilute a rule's or a path's own share.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `gate.*`: how much CRITICAL traffic a candidate may newly deny.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GateThresholds {
    /// The largest share of all captured CRITICAL requests (allowed by the
    /// rules in force) that the candidate may deny, 0 to 1.
    pub max_critical_drop: f64,
    /// The same, within the CRITICAL requests of any one rule (the rule they
    /// matched when captured).
    pub max_critical_drop_per_rule: f64,
    /// The same, within the CRITICAL requests of any one path (an Envoy
    /// request's path is its domain and first descriptor).
    pub max_critical_drop_per_path: f64,
    /// A rule or path is judged once it has this many CRITICAL requests
    /// allowed by the rules in force (at least 1).
    pub min_group_requests: u64,
    /// A capture of fewer requests (every priority together) fails the gate
    /// whatever it shows: an empty or tiny capture would pass any candidate
    /// (at least 1).
    pub min_capture_requests: u64,
}

impl Default for GateThresholds {
    fn default() -> Self {
        Self {
            max_critical_drop: 0.05,
            max_critical_drop_per_rule: 0.10,
            max_critical_drop_per_path: 0.10,
            min_group_requests: 20,
            min_capture_requests: 1_000,
        }
    }
}

impl GateThresholds {
    /// The first setting out of range: its full key and why.
    pub fn invalid(&self) -> Option<(&'static str, &'static str)> {
        for (key, value) in [
            ("gate.max_critical_drop", self.max_critical_drop),
            ("gate.max_critical_drop_per_rule", self.max_critical_drop_per_rule),
            ("gate.max_critical_drop_per_path", self.max_critical_drop_per_path),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Some((key, "must be within 0..1"));
            }
        }
        if self.min_capture_requests == 0 {
            return Some(("gate.min_capture_requests", "must be at least 1"));
        }
        (self.min_group_requests == 0).then_some(("gate.min_group_requests", "must be at least 1"))
    }

    /// The first threshold of `self` laxer than `required`'s, by its key.
    pub fn laxer_than(&self, required: &GateThresholds) -> Option<&'static str> {
        [
            ("max_critical_drop", self.max_critical_drop > required.max_critical_drop),
            (
                "max_critical_drop_per_rule",
                self.max_critical_drop_per_rule > required.max_critical_drop_per_rule,
            ),
            (
                "max_critical_drop_per_path",
                self.max_critical_drop_per_path > required.max_critical_drop_per_path,
            ),
            ("min_group_requests", self.min_group_requests > required.min_group_requests),
            ("min_capture_requests", self.min_capture_requests < required.min_capture_requests),
        ]
        .into_iter()
        .find_map(|(key, laxer)| laxer.then_some(key))
    }
}

/// Requests and denials of one rule or one priority.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Row {
    /// Requests.
    pub requests: u64,
    /// Denied under the rules in force.
    pub denied_current: u64,
    /// Denied under the candidate.
    pub denied_candidate: u64,
    /// Allowed under the rules in force, denied under the candidate.
    pub newly_denied: u64,
    /// Denied under the rules in force, allowed under the candidate.
    pub newly_allowed: u64,
}

impl Row {
    /// Counts one request denied (or not) under each rule set.
    pub fn add(&mut self, current: bool, candidate: bool) {
        self.requests += 1;
        self.denied_current += u64::from(current);
        self.denied_candidate += u64::from(candidate);
        self.newly_denied += u64::from(candidate && !current);
        self.newly_allowed += u64::from(current && !candidate);
    }
}

/// What a group of CRITICAL requests is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupKind {
    /// Every captured request.
    All,
    /// The requests that matched one rule when captured (`-`: none).
    Rule,
    /// The requests of one path.
    Path,
}

impl GroupKind {
    /// As reports print it.
    pub fn as_str(self) -> &'static str {
        match self {
            GroupKind::All => "all",
            GroupKind::Rule => "rule",
            GroupKind::Path => "path",
        }
    }
}

/// One group's CRITICAL figures and verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    /// All, a rule or a path.
    pub kind: GroupKind,
    /// The rule id or the path (`*` for all).
    pub name: String,
    /// CRITICAL requests the rules in force allow.
    pub critical_allowed: u64,
    /// Of those, how many the candidate denies.
    pub critical_newly_denied: u64,
    /// Their share (0 without CRITICAL traffic).
    pub drop: f64,
    /// The largest share allowed for this kind of group.
    pub max_drop: f64,
    /// Large enough to be judged (`gate.min_group_requests`; always for all).
    pub judged: bool,
    /// Judged and within `max_drop`, or not judged.
    pub passed: bool,
}

impl Group {
    /// A group's verdict from its counts.
    pub fn new(kind: GroupKind, name: String, counts: (u64, u64), thresholds: &GateThresholds) -> Self {
        let (critical_allowed, critical_newly_denied) = counts;
        #[allow(clippy::cast_precision_loss)]
        let drop =
            if critical_allowed == 0 { 0.0 } else { critical_newly_denied as f64 / critical_allowed as f64 };
        let max_drop = match kind {
            GroupKind::All => thresholds.max_critical_drop,
            GroupKind::Rule => thresholds.max_critical_drop_per_rule,
            GroupKind::Path => thresholds.max_critical_drop_per_path,
        };
        let judged = kind == GroupKind::All || critical_allowed >= thresholds.min_group_requests;
        Group {
            kind,
            name,
            critical_allowed,
            critical_newly_denied,
            drop,
            max_drop,
            judged,
            passed: !judged || drop <= max_drop,
        }
    }
}

/// How many failing groups a verdict lists (the worst first).
pub const MAX_FAILED_GROUPS: usize = 20;

/// The gate's verdict on CRITICAL traffic.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gate {
    /// The thresholds it was judged by.
    pub thresholds: GateThresholds,
    /// Every captured request.
    pub all: Group,
    /// Per rule matched when captured, by rule id.
    pub rules: Vec<Group>,
    /// The judged group with the largest drop (all when none is larger).
    pub worst: Group,
    /// Judged groups over their threshold, the largest drop first (at most
    /// [`MAX_FAILED_GROUPS`]; `failed_groups` counts them all).
    pub failed: Vec<Group>,
    /// How many judged groups are over their threshold.
    pub failed_groups: u64,
    /// Requests in the capture, every priority together.
    #[serde(default)]
    pub capture_requests: u64,
    /// The capture has at least `min_capture_requests` and no judged group
    /// is over its threshold.
    pub passed: bool,
}

impl Gate {
    /// The verdict on a capture of `capture_requests` requests over `all`,
    /// per-rule and per-path CRITICAL counts (allowed by the rules in force,
    /// newly denied by the candidate).
    pub fn judge(
        thresholds: GateThresholds,
        capture_requests: u64,
        all: (u64, u64),
        rules: &BTreeMap<String, (u64, u64)>,
        paths: &BTreeMap<String, (u64, u64)>,
    ) -> Gate {
        let all = Group::new(GroupKind::All, "*".to_owned(), all, &thresholds);
        let rules: Vec<Group> = rules
            .iter()
            .map(|(name, counts)| Group::new(GroupKind::Rule, name.clone(), *counts, &thresholds))
            .collect();
        let by_drop = |a: &Group, b: &Group| {
            b.drop.total_cmp(&a.drop).then_with(|| a.kind.cmp(&b.kind)).then_with(|| a.name.cmp(&b.name))
        };
        let mut worst = all.clone();
        let mut failed = Vec::new();
        let mut failed_groups = 0u64;
        let paths = paths
            .iter()
            .map(|(name, counts)| Group::new(GroupKind::Path, name.clone(), *counts, &thresholds));
        for group in std::iter::once(all.clone()).chain(rules.iter().cloned()).chain(paths) {
            if group.judged && by_drop(&group, &worst).is_lt() {
                worst = group.clone();
            }
            if !group.passed {
                failed_groups += 1;
                failed.push(group);
                if failed.len() > MAX_FAILED_GROUPS {
                    failed.sort_by(by_drop);
                    failed.truncate(MAX_FAILED_GROUPS);
                }
            }
        }
        failed.sort_by(by_drop);
        let passed = failed_groups == 0 && capture_requests >= thresholds.min_capture_requests;
        Gate { thresholds, all, rules, worst, failed, failed_groups, capture_requests, passed }
    }

    /// The capture is too small to be judged (`gate.min_capture_requests`).
    pub fn capture_too_small(&self) -> bool {
        self.capture_requests < self.thresholds.min_capture_requests
    }
}

/// A gate report as a rules record carries it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GateReport {
    /// SHA-256 (hex) over the capture's records, independent of their order.
    pub capture_digest: String,
    /// Requests replayed.
    pub capture_requests: u64,
    /// The version of the rules in force it was compared with.
    pub baseline_version: String,
    /// The version of the record it gated; an instance refuses a report
    /// attached to another.
    pub candidate_version: String,
    /// Per priority the requests were captured with.
    pub priorities: BTreeMap<String, Row>,
    /// The verdict.
    pub gate: Gate,
    /// When the gate ran, RFC 3339.
    pub gated_at: String,
}

/// Why an instance with `rules.kafka.require_gate` refuses a record.
pub fn refusal(report: Option<&GateReport>, version: &str, required: &GateThresholds) -> Option<String> {
    let Some(report) = report else {
        return Some("no gate report (rules.kafka.require_gate is on)".to_owned());
    };
    if report.candidate_version != version {
        return Some(format!("its gate report is for {}, not {version}", report.candidate_version));
    }
    if report.capture_requests < required.min_capture_requests {
        return Some(format!(
            "its gate replayed a capture of {} requests; this instance's gate.min_capture_requests is {}",
            report.capture_requests, required.min_capture_requests
        ));
    }
    if !report.gate.passed {
        let worst = &report.gate.worst;
        return Some(format!(
            "it failed its gate ({} {}: {:.2}% of CRITICAL newly denied)",
            worst.kind.as_str(),
            worst.name,
            worst.drop * 100.0
        ));
    }
    report
        .gate
        .thresholds
        .laxer_than(required)
        .map(|key| format!("its gate's {key} is laxer than this instance's gate.{key}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(pairs: &[(&str, (u64, u64))]) -> BTreeMap<String, (u64, u64)> {
        pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect()
    }

    #[test]
    fn a_rule_over_its_share_fails_however_much_other_traffic_dilutes_all() {
        let t = GateThresholds::default();
        // 60 of 90 of rule play's CRITICAL requests newly denied, hidden
        // among 1,000 client-made ones on an unruled path: 5.5% overall.
        let gate = Gate::judge(
            t,
            1_090,
            (1_090, 60),
            &counts(&[("play", (90, 60)), ("-", (1_000, 0))]),
            &counts(&[("/play", (90, 60)), ("/junk", (1_000, 0))]),
        );
        assert!(!gate.passed);
        assert_eq!((gate.worst.kind, gate.worst.name.as_str()), (GroupKind::Rule, "play"));
        assert_eq!(gate.failed_groups, 3, "all, rule play and path /play");
        assert_eq!(gate.failed[0].name, "play", "{:?}", gate.failed);
        // A group under min_group_requests is shown, not judged.
        let small = Gate::judge(t, 1_000, (1_000, 5), &counts(&[("tiny", (5, 5))]), &BTreeMap::new());
        assert!(!small.rules[0].judged && small.rules[0].passed && small.passed, "{small:?}");
        assert_eq!(small.worst.kind, GroupKind::All);
    }

    #[test]
    fn an_instance_refuses_a_missing_failed_foreign_or_lax_report() {
        let t = GateThresholds::default();
        let gate = Gate::judge(t, 1_000, (100, 1), &BTreeMap::new(), &BTreeMap::new());
        let report = GateReport {
            capture_digest: "d".to_owned(),
            capture_requests: 1_000,
            baseline_version: "v0".to_owned(),
            candidate_version: "v1".to_owned(),
            priorities: BTreeMap::new(),
            gate: gate.clone(),
            gated_at: "2026-11-25T00:00:00Z".to_owned(),
        };
        assert_eq!(refusal(Some(&report), "v1", &t), None);
        assert!(refusal(None, "v1", &t).unwrap().contains("no gate report"));
        assert!(refusal(Some(&report), "v2", &t).unwrap().contains("is for v1, not v2"));
        let strict = GateThresholds { max_critical_drop_per_path: 0.01, ..t };
        assert!(refusal(Some(&report), "v1", &strict).unwrap().contains("gate.max_critical_drop_per_path"));
        let failing = Gate::judge(t, 1_000, (100, 50), &BTreeMap::new(), &BTreeMap::new());
        let failed = GateReport { gate: failing, ..report.clone() };
        assert!(refusal(Some(&failed), "v1", &t).unwrap().contains("failed its gate (all *: 50.00%"));
        // A capture too small fails the gate however clean, and an instance
        // refuses a report of one.
        for requests in [0, 999] {
            let tiny = Gate::judge(t, requests, (0, 0), &BTreeMap::new(), &BTreeMap::new());
            assert!(!tiny.passed && tiny.capture_too_small(), "{requests} requests");
            let tiny = GateReport { gate: tiny, capture_requests: requests, ..report.clone() };
            assert!(refusal(Some(&tiny), "v1", &t).unwrap().contains("gate.min_capture_requests is 1000"));
        }
        let lax = GateThresholds { min_capture_requests: 10, ..t };
        assert_eq!(lax.laxer_than(&t), Some("min_capture_requests"));
        assert_eq!(t.invalid(), None);
        assert_eq!(
            GateThresholds { min_group_requests: 0, ..t }.invalid().unwrap().0,
            "gate.min_group_requests"
        );
    }
}
