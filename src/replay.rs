//! `ratelimitd replay` and the publish gate: captured requests replayed in
//! recorded time order on a virtual clock (no sleeping) through the real
//! engine with an in-memory store, once under the rules in force and once
//! under a candidate, compared per rule and per priority.
//!
//! Each pass is a fresh engine: `MemoryStore` on a `ManualClock` set to
//! each request's time, shedding off (utilization is not replayed), no
//! failure sink (the memory store cannot fail). The two passes run on two
//! threads. Requests are classed by the priority they were decided with
//! under the rules in force; the gate fails when the candidate denies more
//! than `max_critical_drop` of the CRITICAL requests those rules allow.

use std::{
    collections::{BTreeMap, HashMap},
    io::BufRead as _,
    path::Path,
    sync::Arc,
};

use serde::Serialize;

use crate::{
    capture::{CaptureRecord, CountKind},
    clock::ManualClock,
    decision::{
        CheckRequest, Engine, EngineParts, EnvoyPolicy, FailedDecision, FailureSink, NoStats, Reason,
    },
    limiter::{MemoryStore, Store},
    rules::{RuleStore, Snapshot},
    shed::{Priority, ShedMode, Shedder},
};

/// Why a replay could not run.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The capture cannot be read.
    #[error("{0}")]
    Capture(String),
}

/// One captured request, as replay needs it.
#[derive(Debug, Clone)]
pub struct Request {
    /// When it was decided, ms since the epoch.
    pub time_ms: u64,
    /// The user id as counted.
    pub user_id: Box<str>,
    /// The path.
    pub resource_path: Box<str>,
    /// The client type.
    pub client_type: Option<Box<str>>,
    /// The priority the request stated.
    pub priority: Option<Priority>,
    /// Its weight.
    pub weight: u32,
    /// Check, peek or report.
    pub count: CountKind,
}

impl From<CaptureRecord> for Request {
    fn from(r: CaptureRecord) -> Self {
        Request {
            time_ms: r.time_ms,
            user_id: r.user_id.into(),
            resource_path: r.resource_path.into(),
            client_type: r.client_type.map(Into::into),
            priority: r.priority,
            weight: r.weight.max(1),
            count: r.count,
        }
    }
}

/// A capture, read and ordered by time.
#[derive(Debug, Default)]
pub struct Capture {
    /// The requests, oldest first (stable: equal times keep capture order).
    pub requests: Vec<Request>,
    /// Lines or messages that were not capture records.
    pub unreadable: u64,
    /// Requests per rules version they were decided under.
    pub versions: BTreeMap<String, u64>,
}

impl Capture {
    /// Adds one record (JSON); counts it unreadable when it is not one.
    pub fn push(&mut self, bytes: &[u8]) {
        match serde_json::from_slice::<CaptureRecord>(bytes) {
            Ok(record) => {
                if let Some(n) = self.versions.get_mut(&record.rules_version) {
                    *n += 1;
                } else {
                    self.versions.insert(record.rules_version.clone(), 1);
                }
                self.requests.push(record.into());
            }
            Err(_) => self.unreadable += 1,
        }
    }

    /// Orders the requests by time.
    pub fn sort(&mut self) {
        self.requests.sort_by_key(|r| r.time_ms);
    }

    /// Reads a JSON-lines capture file.
    pub fn from_file(path: &Path) -> Result<Self, ReplayError> {
        let file = std::fs::File::open(path)
            .map_err(|e| ReplayError::Capture(format!("{}: {e}", path.display())))?;
        let mut capture = Capture::default();
        let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
        let mut line = Vec::with_capacity(512);
        loop {
            line.clear();
            let n = reader
                .read_until(b'\n', &mut line)
                .map_err(|e| ReplayError::Capture(format!("{}: {e}", path.display())))?;
            if n == 0 {
                break;
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            capture.push(&line);
        }
        capture.sort();
        Ok(capture)
    }
}

/// What one pass decided for one request.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The rule that matched.
    pub rule: Option<Arc<str>>,
    /// The priority it was decided with.
    pub priority: Priority,
    /// Denied (over the limit, or a weight that never fits); a shadow
    /// rule's denial is not one.
    pub denied: bool,
}

#[derive(Debug)]
struct Discard;

impl FailureSink for Discard {
    fn record(&self, _: &FailedDecision<'_>) {}
}

/// Replays `requests` through `rules` on a virtual clock; one outcome per request.
pub fn run(rules: Snapshot, requests: &[Request], max_user_id_bytes: usize) -> Vec<Outcome> {
    let clock = Arc::new(ManualClock::new(requests.first().map_or(0, |r| r.time_ms)));
    let capacity = requests.len().max(1_000);
    let store = MemoryStore::new(16, capacity, Arc::clone(&clock) as Arc<dyn crate::clock::Clock>);
    let engine = Engine::new(EngineParts {
        rules: Arc::new(RuleStore::new(rules)),
        envoy: None,
        store: Store::Memory(Arc::new(store)),
        local: Arc::new(crate::limiter::local::LocalLimiter::new(
            Default::default(),
            Arc::new(crate::limiter::SystemClock),
        )),
        shedder: Arc::new(Shedder::new(ShedMode::Off, 0)),
        failures: Arc::new(Discard),
        stats: Arc::new(NoStats),
        default_priority: Priority::Degraded,
        max_user_id_bytes,
        trust_request_priority: true,
        envoy_policy: EnvoyPolicy::default(),
        capture: None,
        overload: None,
        tenants: crate::decision::TenantPolicy::default(),
        denials: None,
        tenant_shares: None,
    });
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime");
    let headers = HashMap::new();
    runtime.block_on(async {
        let mut outcomes = Vec::with_capacity(requests.len());
        for request in requests {
            clock.set(request.time_ms);
            let decision = engine
                .check(&CheckRequest {
                    user_id: &request.user_id,
                    resource_path: &request.resource_path,
                    client_type: request.client_type.as_deref(),
                    weight: request.weight,
                    count: request.count.count(),
                    priority: request.priority,
                    headers: &headers,
                    trace_id: None,
                    share: None,
                })
                .await;
            outcomes.push(Outcome {
                denied: matches!(decision.reason, Reason::OverLimit | Reason::WeightExceedsCapacity),
                rule: decision.rule.map(|r| r.id),
                priority: decision.priority,
            });
        }
        outcomes
    })
}

/// Requests and denials of one rule or one priority.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
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
    fn add(&mut self, current: bool, candidate: bool) {
        self.requests += 1;
        self.denied_current += u64::from(current);
        self.denied_candidate += u64::from(candidate);
        self.newly_denied += u64::from(candidate && !current);
        self.newly_allowed += u64::from(current && !candidate);
    }
}

/// The comparison, and the gate's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Requests replayed.
    pub requests: u64,
    /// Capture lines that were not records.
    pub unreadable: u64,
    /// Version of the rules in force, and of the candidate.
    pub current_version: String,
    /// The candidate's native version.
    pub candidate_version: String,
    /// Per rule (under the candidate; `-` for no rule).
    pub rules: BTreeMap<String, Row>,
    /// Per priority (decided under the rules in force).
    pub priorities: BTreeMap<&'static str, Row>,
    /// Denials over time, for plotting.
    pub timeline: Timeline,
    /// The gate.
    pub gate: Gate,
}

/// Denials per time bucket.
#[derive(Debug, Clone, Serialize, Default)]
pub struct Timeline {
    /// Bucket width in ms (at least 1 s; wider so that there are at most 1,000).
    pub bucket_ms: u64,
    /// Start of the first bucket, ms since the epoch.
    pub start_ms: u64,
    /// Requests per bucket.
    pub requests: Vec<u64>,
    /// Denied under the rules in force, per bucket.
    pub denied_current: Vec<u64>,
    /// Denied under the candidate, per bucket.
    pub denied_candidate: Vec<u64>,
}

/// The gate's verdict on CRITICAL traffic.
#[derive(Debug, Clone, Serialize)]
pub struct Gate {
    /// CRITICAL requests the rules in force allow.
    pub critical_allowed_current: u64,
    /// Of those, how many the candidate denies.
    pub critical_newly_denied: u64,
    /// Their share (0 when there is no CRITICAL traffic).
    pub critical_drop: f64,
    /// The largest share allowed.
    pub max_critical_drop: f64,
    /// `critical_drop <= max_critical_drop`.
    pub passed: bool,
    /// The rules newly denying CRITICAL requests, most first.
    pub offenders: Vec<(String, u64)>,
}

/// Compares the two passes over `capture`.
pub fn compare(
    capture: &Capture,
    current: (&str, &[Outcome]),
    candidate: (&str, &[Outcome]),
    max_critical_drop: f64,
) -> Report {
    let requests = &capture.requests;
    let mut rules: BTreeMap<String, Row> = BTreeMap::new();
    let mut priorities: BTreeMap<&'static str, Row> = BTreeMap::new();
    let mut offenders: BTreeMap<String, u64> = BTreeMap::new();
    let (start, end) = (requests.first().map_or(0, |r| r.time_ms), requests.last().map_or(0, |r| r.time_ms));
    let bucket_ms = (end.saturating_sub(start) / 1_000 + 1).max(1_000);
    let buckets = usize::try_from((end - start) / bucket_ms + 1).unwrap_or(1);
    let mut timeline = Timeline {
        bucket_ms,
        start_ms: start,
        requests: vec![0; buckets],
        denied_current: vec![0; buckets],
        denied_candidate: vec![0; buckets],
    };
    let (mut critical_allowed, mut critical_newly_denied) = (0u64, 0u64);
    for ((request, now), next) in requests.iter().zip(current.1).zip(candidate.1) {
        let rule = next.rule.as_deref().unwrap_or("-");
        if let Some(row) = rules.get_mut(rule) {
            row.add(now.denied, next.denied);
        } else {
            rules.entry(rule.to_owned()).or_default().add(now.denied, next.denied);
        }
        priorities.entry(now.priority.as_str()).or_default().add(now.denied, next.denied);
        let bucket = usize::try_from((request.time_ms - start) / bucket_ms).unwrap_or(0).min(buckets - 1);
        timeline.requests[bucket] += 1;
        timeline.denied_current[bucket] += u64::from(now.denied);
        timeline.denied_candidate[bucket] += u64::from(next.denied);
        if now.priority == Priority::Critical && !now.denied {
            critical_allowed += 1;
            if next.denied {
                critical_newly_denied += 1;
                *offenders.entry(rule.to_owned()).or_default() += 1;
            }
        }
    }
    #[allow(clippy::cast_precision_loss)]
    let critical_drop =
        if critical_allowed == 0 { 0.0 } else { critical_newly_denied as f64 / critical_allowed as f64 };
    let mut offenders: Vec<(String, u64)> = offenders.into_iter().collect();
    offenders.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    Report {
        requests: requests.len() as u64,
        unreadable: capture.unreadable,
        current_version: current.0.to_owned(),
        candidate_version: candidate.0.to_owned(),
        rules,
        priorities,
        timeline,
        gate: Gate {
            critical_allowed_current: critical_allowed,
            critical_newly_denied,
            critical_drop,
            max_critical_drop,
            passed: critical_drop <= max_critical_drop,
            offenders,
        },
    }
}

/// Replays `capture` under `current` and `candidate` (two threads) and compares.
pub fn replay(
    capture: &Capture,
    current: Snapshot,
    candidate: Snapshot,
    max_user_id_bytes: usize,
    max_critical_drop: f64,
) -> Report {
    let (current_version, candidate_version) = (current.version().to_owned(), candidate.version().to_owned());
    let (now, next) = std::thread::scope(|scope| {
        let now = scope.spawn(|| run(current, &capture.requests, max_user_id_bytes));
        let next = run(candidate, &capture.requests, max_user_id_bytes);
        (now.join().expect("the replay thread does not panic"), next)
    });
    compare(capture, (&current_version, &now), (&candidate_version, &next), max_critical_drop)
}

impl Report {
    /// The human-readable report.
    pub fn table(&self) -> String {
        use std::fmt::Write as _;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "replayed {} requests ({} unreadable); rules in force {}, candidate {}",
            self.requests, self.unreadable, self.current_version, self.candidate_version
        );
        let row = |out: &mut String, name: &str, r: &Row| {
            let _ = writeln!(
                out,
                "{name:<32} {:>10} {:>10} {:>10} {:>+10} {:>10}",
                r.requests,
                r.denied_current,
                r.denied_candidate,
                i128::from(r.denied_candidate) - i128::from(r.denied_current),
                r.newly_denied
            );
        };
        let _ = writeln!(
            out,
            "\n{:<32} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "RULE (candidate)", "REQUESTS", "DENIED NOW", "DENIED NEW", "DIFF", "NEWLY DEN."
        );
        for (name, r) in &self.rules {
            row(&mut out, name, r);
        }
        let _ = writeln!(
            out,
            "\n{:<32} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "PRIORITY", "REQUESTS", "DENIED NOW", "DENIED NEW", "DIFF", "NEWLY DEN."
        );
        for priority in Priority::ALL {
            if let Some(r) = self.priorities.get(priority.as_str()) {
                row(&mut out, priority.as_str(), r);
            }
        }
        let g = &self.gate;
        let _ = writeln!(
            out,
            "\ngate: the candidate denies {} of {} CRITICAL requests the rules in force allow ({:.2}%; at most {:.2}%): {}",
            g.critical_newly_denied,
            g.critical_allowed_current,
            g.critical_drop * 100.0,
            g.max_critical_drop * 100.0,
            if g.passed { "PASS" } else { "FAIL" }
        );
        if !g.passed {
            for (rule, n) in &g.offenders {
                let _ = writeln!(out, "  rule {rule}: {n} CRITICAL requests newly denied");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(text: &str) -> Snapshot {
        crate::rules::from_text(Path::new("r.yaml"), text, crate::rules::PathForm::default()).unwrap()
    }

    fn request(t: u64, user: &str, path: &str) -> Request {
        Request {
            time_ms: t,
            user_id: user.into(),
            resource_path: path.into(),
            client_type: None,
            priority: None,
            weight: 1,
            count: CountKind::Check,
        }
    }

    #[test]
    fn a_tighter_critical_rule_fails_the_gate_and_a_harmless_one_passes() {
        let current = "rules:\n  - { rule_id: play, resource_path: /play, priority_bucket: CRITICAL, limit: 10, window_seconds: 1 }\n  - { rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: 10, window_seconds: 1 }\n";
        let tight = current.replacen("limit: 10", "limit: 5", 1);
        let harmless = current.replace(
            "rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: 10",
            "rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: 2",
        );
        // 3 users × 8 requests to /play within one second, 8 to /bulk.
        let mut capture = Capture::default();
        for i in 0..8u64 {
            for user in ["a", "b", "c"] {
                capture.requests.push(request(1_000_000 + i * 10, user, "/play"));
            }
            capture.requests.push(request(1_000_000 + i * 10, "a", "/bulk"));
        }
        capture.sort();
        let fail = replay(&capture, snapshot(current), snapshot(&tight), 256, 0.05);
        assert!(!fail.gate.passed);
        assert_eq!((fail.gate.critical_allowed_current, fail.gate.critical_newly_denied), (24, 9));
        assert_eq!(fail.gate.offenders, vec![("play".to_owned(), 9)]);
        assert_eq!(
            fail.rules["play"],
            Row { requests: 24, denied_current: 0, denied_candidate: 9, newly_denied: 9, newly_allowed: 0 }
        );
        assert!(fail.table().contains("FAIL") && fail.table().contains("rule play: 9"));

        let pass = replay(&capture, snapshot(current), snapshot(&harmless), 256, 0.05);
        assert!(pass.gate.passed, "{}", pass.table());
        assert_eq!(pass.priorities["BULK"].newly_denied, 6, "BULK may be denied: not gated");
        assert_eq!(pass.gate.critical_newly_denied, 0);
    }

    #[test]
    fn replay_follows_the_virtual_clock() {
        let rules = snapshot(
            "rules:\n  - { rule_id: r, resource_path: /r, limit: 2, window_seconds: 1, algorithm: fixed_window }\n",
        );
        // Three in one window: the third is denied; a window later it passes.
        let requests = vec![
            request(5_000, "u", "/r"),
            request(5_001, "u", "/r"),
            request(5_002, "u", "/r"),
            request(6_000, "u", "/r"),
        ];
        let outcomes = run(rules, &requests, 256);
        let denied: Vec<bool> = outcomes.iter().map(|o| o.denied).collect();
        assert_eq!(denied, vec![false, false, true, false]);
    }
}
