//! `ratelimitd rules status`: the version every instance serves against the
//! version in force.

use std::{io::Write as _, process::ExitCode};

use super::failed;
use crate::{
    clock::{Clock, SystemClock},
    config::Config,
    release,
    rollout::{publish, status},
    rules::encoding::SnapshotRecord,
};

/// Runs `rules status`: every instance's report against the version in
/// force; 0 when every instance reporting within three intervals serves it
/// (and at least one does).
pub fn run(config: &Config) -> ExitCode {
    let kafka = &config.rules.kafka;
    let trust = release::trust(config, None);
    let (history, reports) = match publish::history(kafka, &trust).and_then(|h| Ok((h, status::read(kafka)?)))
    {
        Ok(both) => both,
        Err(e) => return failed("rules status", &e),
    };
    let in_force: Option<&SnapshotRecord> = publish::current(&history);
    let now = SystemClock.now_ms();
    let stale_after = kafka.status_interval_ms.saturating_mul(3);
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "in force: {}", in_force.map_or("nothing published", |r| &r.version));
    let _ = writeln!(
        out,
        "{:<32}  {:<26}  {:<9}  {:>9}  {:>8}  STATE",
        "INSTANCE", "VERSION", "ORIGIN", "SINCE", "REPORTED"
    );
    let mut converged = true;
    for report in &reports {
        let standing = status::standing(report, in_force.map(|f| f.version.as_str()), now, stale_after);
        let state = match standing {
            "stale" => "stale (no report for 3 intervals)",
            "waiting" => "waiting for rules",
            other => other,
        };
        if !matches!(standing, "stale" | "current") {
            converged = false;
        }
        let ago = |ms: Option<u64>| {
            ms.map_or("-".to_owned(), |ms| format!("{}s ago", now.saturating_sub(ms) / 1_000))
        };
        let _ = writeln!(
            out,
            "{:<32}  {:<26}  {:<9}  {:>9}  {:>8}  {state}",
            report.instance,
            report.version.as_deref().unwrap_or("-"),
            report.origin.as_deref().unwrap_or("-"),
            ago(report.since_ms),
            ago(Some(report.reported_ms)),
        );
        details(&mut out, report);
    }
    if reports.is_empty() {
        let _ = writeln!(out, "(no instance reports)");
    }
    let current = reports.iter().filter(|r| r.version.as_ref() == in_force.map(|f| &f.version)).count();
    if converged && current > 0 { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

/// An instance's lines under its own: its last refusal, its global limits,
/// its RLQS domains and its adaptive limits.
fn details(out: &mut impl std::io::Write, report: &status::StatusReport) {
    if let Some(why) = &report.last_refusal {
        let _ = writeln!(out, "{:<32}  refused {} record(s); the last: {why}", "", report.rejected);
    }
    for (limit, g) in report.vitals.iter().flat_map(|v| &v.global) {
        let age = g.lease_age_s.map_or("no lease".to_owned(), |s| format!("lease {s:.1}s old"));
        let agent = if g.agent { ", the region's agent" } else { "" };
        let _ = writeln!(
            out,
            "{:<32}  global {limit} in {}: granted {} over {} key(s), demand {}, {age}, last answer {}{agent}",
            "", g.region, g.granted, g.keys, g.demand, g.answer
        );
    }
    for (domain, q) in report.vitals.iter().flat_map(|v| &v.rlqs) {
        let _ = writeln!(
            out,
            "{:<32}  rlqs {domain}: {} Envoy(s), {} bucket(s), {:.1}/s assigned, {} report(s), {} unmatched, {} expired, {} unanswered",
            "", q.envoys, q.buckets, q.assigned_per_second, q.reports, q.unmatched, q.expired, q.unanswered
        );
    }
    if !report.adaptive.is_empty() {
        let limits: Vec<String> =
            report.adaptive.iter().map(|(rule, limit)| format!("{rule}={limit}")).collect();
        let _ = writeln!(out, "{:<32}  adaptive limits: {}", "", limits.join(", "));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_instances_rlqs_domains_are_listed_under_it() {
        let report: status::StatusReport = serde_json::from_value(serde_json::json!({
            "schema": status::STATUS_SCHEMA, "instance": "a@1", "version": null, "origin": null,
            "offset": null, "since_ms": null, "reported_ms": 0, "native_rules": 0, "rejected": 0,
            "vitals": {
                "shed_level": "NORMAL", "utilization": null, "overload_mode": "off",
                "overload_directives": 0, "dead_letters": 0, "dead_letters_dropped": 0,
                "rlqs": { "edge": {
                    "envoys": 3, "buckets": 3, "assigned_per_second": 29.25, "reports": 412,
                    "unmatched": 1, "expired": 0, "unanswered": 2
                } }
            }
        }))
        .unwrap();
        let mut out = Vec::new();
        details(&mut out, &report);
        assert_eq!(
            String::from_utf8(out).unwrap().trim(),
            "rlqs edge: 3 Envoy(s), 3 bucket(s), 29.2/s assigned, 412 report(s), 1 unmatched, 0 expired, 2 unanswered"
        );
    }
}
