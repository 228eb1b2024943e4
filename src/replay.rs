//! `ratelimitd replay` and the publish gate: captured requests replayed in
//! recorded time order on a virtual clock (no sleeping) through the real
//! engine with an in-memory store, once under the rules in force and once
//! under a candidate, compared per rule and per priority.
//!
//! Each pass is a fresh engine: `MemoryStore` on a `ManualClock` set to
//! each request's time, shedding off (utilization is not replayed), no
//! failure sink (the memory store cannot fail). The two passes run on two
//! threads. The gate ([`crate::rules::gate`]) judges requests by the
//! priority and rule they were captured with, never by what either rule
//! set or the request itself says now: globally, per rule and per path.

use std::{
    collections::{BTreeMap, HashMap},
    io::BufRead as _,
    path::Path,
    sync::Arc,
};

use serde::Serialize;

pub use crate::rules::gate::Row;
use crate::{
    capture::{CaptureRecord, CountKind},
    clock::ManualClock,
    decision::{CheckRequest, Engine, EngineParts, EnvoyCall, EnvoyPolicy, NO_USAGE, Reason, limitador},
    limiter::{MemoryStore, Store},
    rules::{
        Hot, RuleStore, Snapshot, Versioned,
        envoy::EnvoyConfig,
        gate::{Gate, GateReport, GateThresholds},
        limitador::Limits,
    },
    shed::Priority,
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
    /// What it stated of units other than requests; `None`: nothing.
    pub usage: Option<Box<HashMap<String, u64>>>,
    /// Check, peek or report.
    pub count: CountKind,
    /// The priority it was decided with when captured: what the gate
    /// judges it by.
    pub captured_priority: Priority,
    /// The rule it matched when captured (one allocation per rule id).
    pub captured_rule: Option<Arc<str>>,
    /// A `ShouldRateLimit` request; `resource_path` is then its domain and
    /// first descriptor (`domain: key=value, …`), the path it is judged by.
    pub envoy: Option<Box<EnvoyCall>>,
}

/// The path an Envoy request is judged by: its domain and first descriptor.
fn envoy_path(call: &EnvoyCall) -> String {
    let mut path = call.domain.clone();
    path.push(':');
    for (i, (key, value)) in call.descriptors.first().map_or(&[][..], |d| &d.entries).iter().enumerate() {
        path.push_str(if i == 0 { " " } else { ", " });
        path.push_str(key);
        path.push('=');
        path.push_str(value);
    }
    path
}

impl From<CaptureRecord> for Request {
    fn from(r: CaptureRecord) -> Self {
        let resource_path = match &r.envoy {
            Some(call) => envoy_path(call),
            None => r.resource_path,
        };
        Request {
            captured_priority: r.effective_priority,
            captured_rule: r.rule_id.as_deref().map(Arc::from),
            envoy: r.envoy.map(Box::new),
            time_ms: r.time_ms,
            user_id: r.user_id.into(),
            resource_path: resource_path.into(),
            client_type: r.client_type.map(Into::into),
            priority: r.priority,
            weight: r.weight.max(1),
            usage: (!r.usage.is_empty()).then(|| Box::new(r.usage.into_iter().collect())),
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
    /// SHA-256 of each record read, sorted by [`Capture::sort`] ([`Capture::digest`]).
    hashes: Vec<[u8; 32]>,
    /// The captured rule ids, each allocated once.
    rule_ids: std::collections::HashSet<Arc<str>>,
}

impl Capture {
    /// Adds one record (JSON); counts it unreadable when it is not one.
    pub fn push(&mut self, bytes: &[u8]) {
        match serde_json::from_slice::<CaptureRecord>(bytes) {
            Ok(mut record) => {
                use sha2::{Digest as _, Sha256};
                self.hashes.push(Sha256::digest(bytes.trim_ascii()).into());
                if let Some(n) = self.versions.get_mut(&record.rules_version) {
                    *n += 1;
                } else {
                    self.versions.insert(record.rules_version.clone(), 1);
                }
                let rule = record.rule_id.take().map(|id| match self.rule_ids.get(id.as_str()) {
                    Some(interned) => Arc::clone(interned),
                    None => {
                        let interned: Arc<str> = Arc::from(id);
                        self.rule_ids.insert(Arc::clone(&interned));
                        interned
                    }
                });
                let mut request = Request::from(record);
                request.captured_rule = rule;
                self.requests.push(request);
            }
            Err(_) => self.unreadable += 1,
        }
    }

    /// Orders the requests by time (and the records' hashes for the digest).
    pub fn sort(&mut self) {
        self.requests.sort_by_key(|r| r.time_ms);
        self.hashes.sort_unstable();
    }

    /// SHA-256 (hex) over the records read, independent of the order they
    /// were read in (a topic's partitions interleave differently each time).
    pub fn digest(&self) -> String {
        use sha2::{Digest as _, Sha256};
        let mut hashes = std::borrow::Cow::Borrowed(&self.hashes[..]);
        if !hashes.is_sorted() {
            hashes.to_mut().sort_unstable();
        }
        let mut all = Sha256::new();
        for hash in hashes.iter() {
            all.update(hash);
        }
        all.finalize().iter().map(|b| format!("{b:02x}")).collect()
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
    /// Denied (over the limit, or a weight that never fits); a shadow
    /// rule's denial is not one.
    pub denied: bool,
}

/// A rule set replay decides by.
#[derive(Debug)]
pub struct Rules {
    /// Native rules (`Check`).
    pub native: Snapshot,
    /// The Envoy configuration (`ShouldRateLimit`); `None`: every
    /// descriptor is unmatched.
    pub envoy: Option<EnvoyConfig>,
    /// limitador's limits: when set, Envoy-API requests (limitador's
    /// `ShouldRateLimit`, `CheckRateLimit`, `Report`, and its HTTP calls)
    /// are decided by them, as an instance with `rules.limitador_path`
    /// decides them, not by `envoy`.
    pub limitador: Option<Limits>,
}

impl Rules {
    /// Native rules only.
    pub fn native(native: Snapshot) -> Self {
        Rules { native, envoy: None, limitador: None }
    }

    /// The native version, then the Envoy one and limitador's, each after
    /// a `+`, when there is one.
    pub fn version(&self) -> String {
        let mut version = self.native.version().to_owned();
        for other in
            [self.envoy.as_ref().map(EnvoyConfig::version), self.limitador.as_ref().map(Versioned::version)]
                .into_iter()
                .flatten()
        {
            version.push('+');
            version.push_str(other);
        }
        version
    }
}

/// What replay decides with besides the rules: the instances' settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `limits.max_user_id_bytes`.
    pub max_user_id_bytes: usize,
    /// How instances treat Envoy requests (`envoy.*`).
    pub envoy: EnvoyPolicy,
    /// The gate's thresholds.
    pub thresholds: GateThresholds,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_user_id_bytes: 256,
            envoy: EnvoyPolicy::default(),
            thresholds: GateThresholds::default(),
        }
    }
}

/// Replays `requests` through `rules` on a virtual clock; one outcome per request.
pub fn run(rules: Rules, requests: &[Request], settings: &Settings) -> Vec<Outcome> {
    let clock = Arc::new(ManualClock::new(requests.first().map_or(0, |r| r.time_ms)));
    let capacity = requests.len().max(1_000);
    let store = MemoryStore::new(16, capacity, Arc::clone(&clock) as Arc<dyn crate::clock::Clock>);
    let store = Store::Memory(Arc::new(store));
    let limitador = rules.limitador;
    let engine = Engine::new(EngineParts {
        envoy: rules.envoy.map(|envoy| Arc::new(Hot::new(envoy))),
        max_user_id_bytes: settings.max_user_id_bytes,
        envoy_policy: settings.envoy.clone(),
        clock: Arc::clone(&clock) as Arc<dyn crate::clock::Clock>,
        ..EngineParts::new(Arc::new(RuleStore::new(rules.native)), store)
    });
    let runtime = tokio::runtime::Builder::new_current_thread().build().expect("a current-thread runtime");
    runtime.block_on(async {
        let mut outcomes = Vec::with_capacity(requests.len());
        for request in requests {
            clock.set(request.time_ms);
            outcomes.push(decide(&engine, limitador.as_ref(), request).await);
        }
        outcomes
    })
}

/// One request through `engine`, an Envoy-API one through `limitador`'s
/// limits when given.
async fn decide(engine: &Engine, limitador: Option<&Limits>, request: &Request) -> Outcome {
    if let Some(call) = &request.envoy {
        let decision = match limitador {
            Some(limits) => {
                let how = match request.count {
                    CountKind::Peek => limitador::Call::Check,
                    CountKind::Report => limitador::Call::Report,
                    CountKind::Check | CountKind::CheckAnyway => limitador::Call::Admit,
                };
                engine.limitador(limits, &call.request(), how, None).await
            }
            None => engine.should_rate_limit(&call.request()).await,
        };
        let bound = decision.bound_limit();
        return Outcome { denied: decision.over_limit, rule: bound.map(|limit| Arc::clone(&limit.full_key)) };
    }
    let headers = HashMap::new();
    let decision = engine
        .check(&CheckRequest {
            client_type: request.client_type.as_deref(),
            weight: request.weight,
            count: request.count.count(),
            priority: request.priority,
            usage: request.usage.as_deref().unwrap_or(&NO_USAGE),
            ..CheckRequest::new(&request.user_id, &request.resource_path, &headers)
        })
        .await;
    Outcome {
        denied: matches!(
            decision.reason,
            Reason::OverLimit | Reason::WeightExceedsCapacity | Reason::NoPrice | Reason::NoLevelKey
        ),
        rule: decision.rule.map(|r| r.id),
    }
}

/// The comparison, and the gate's verdict.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Requests replayed.
    pub requests: u64,
    /// Capture lines that were not records.
    pub unreadable: u64,
    /// [`Capture::digest`].
    pub capture_digest: String,
    /// Version of the rules in force, and of the candidate.
    pub current_version: String,
    /// The candidate's native version.
    pub candidate_version: String,
    /// Per rule (under the candidate; `-` for no rule).
    pub rules: BTreeMap<String, Row>,
    /// Per priority the requests were captured with.
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

impl Timeline {
    /// Empty buckets spanning `start..=end`.
    fn spanning(start: u64, end: u64) -> Self {
        let bucket_ms = (end.saturating_sub(start) / 1_000 + 1).max(1_000);
        let buckets = usize::try_from((end - start) / bucket_ms + 1).unwrap_or(1);
        Timeline {
            bucket_ms,
            start_ms: start,
            requests: vec![0; buckets],
            denied_current: vec![0; buckets],
            denied_candidate: vec![0; buckets],
        }
    }

    fn add(&mut self, time_ms: u64, current: bool, candidate: bool) {
        let last = self.requests.len() - 1;
        let bucket = usize::try_from((time_ms - self.start_ms) / self.bucket_ms).unwrap_or(0).min(last);
        self.requests[bucket] += 1;
        self.denied_current[bucket] += u64::from(current);
        self.denied_candidate[bucket] += u64::from(candidate);
    }
}

/// CRITICAL requests allowed by the rules in force and newly denied by the
/// candidate, per group name.
type Counts = BTreeMap<String, (u64, u64)>;

fn count(groups: &mut Counts, name: &str, newly_denied: bool) {
    let counts = match groups.get_mut(name) {
        Some(counts) => counts,
        None => groups.entry(name.to_owned()).or_default(),
    };
    counts.0 += 1;
    counts.1 += u64::from(newly_denied);
}

/// Compares the two passes over `capture`, judging by `thresholds`.
pub fn compare(
    capture: &Capture,
    current: (&str, &[Outcome]),
    candidate: (&str, &[Outcome]),
    thresholds: GateThresholds,
) -> Report {
    let requests = &capture.requests;
    let mut rules: BTreeMap<String, Row> = BTreeMap::new();
    let mut priorities: BTreeMap<&'static str, Row> = BTreeMap::new();
    let mut timeline = Timeline::spanning(
        requests.first().map_or(0, |r| r.time_ms),
        requests.last().map_or(0, |r| r.time_ms),
    );
    let (mut all, mut by_rule, mut by_path) = ((0u64, 0u64), Counts::new(), Counts::new());
    for ((request, now), next) in requests.iter().zip(current.1).zip(candidate.1) {
        let rule = next.rule.as_deref().unwrap_or("-");
        if let Some(row) = rules.get_mut(rule) {
            row.add(now.denied, next.denied);
        } else {
            rules.entry(rule.to_owned()).or_default().add(now.denied, next.denied);
        }
        priorities.entry(request.captured_priority.as_str()).or_default().add(now.denied, next.denied);
        timeline.add(request.time_ms, now.denied, next.denied);
        if request.captured_priority == Priority::Critical && !now.denied {
            let newly_denied = next.denied;
            all.0 += 1;
            all.1 += u64::from(newly_denied);
            count(&mut by_rule, request.captured_rule.as_deref().unwrap_or("-"), newly_denied);
            count(&mut by_path, &request.resource_path, newly_denied);
        }
    }
    Report {
        requests: requests.len() as u64,
        unreadable: capture.unreadable,
        capture_digest: capture.digest(),
        current_version: current.0.to_owned(),
        candidate_version: candidate.0.to_owned(),
        rules,
        priorities,
        timeline,
        gate: Gate::judge(thresholds, requests.len() as u64, all, &by_rule, &by_path),
    }
}

/// Replays `capture` under `current` and `candidate` (two threads) and compares.
pub fn replay(capture: &Capture, current: Rules, candidate: Rules, settings: &Settings) -> Report {
    let (current_version, candidate_version) = (current.version(), candidate.version());
    let (now, next) = std::thread::scope(|scope| {
        let now = scope.spawn(|| run(current, &capture.requests, settings));
        let next = run(candidate, &capture.requests, settings);
        (now.join().expect("the replay thread does not panic"), next)
    });
    compare(capture, (&current_version, &now), (&candidate_version, &next), settings.thresholds)
}

impl Report {
    /// The gate's report as the record of version `record_version` carries it.
    pub fn gate_report(&self, record_version: &str, gated_at: String) -> GateReport {
        GateReport {
            capture_digest: self.capture_digest.clone(),
            capture_requests: self.requests,
            baseline_version: self.current_version.clone(),
            candidate_version: record_version.to_owned(),
            priorities: self.priorities.iter().map(|(p, row)| ((*p).to_owned(), row.clone())).collect(),
            gate: self.gate.clone(),
            gated_at,
        }
    }

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
        self.gate_table(&mut out);
        out
    }

    /// The gate's lines of [`Self::table`].
    fn gate_table(&self, out: &mut String) {
        use std::fmt::Write as _;
        let g = &self.gate;
        let _ = write!(out, "\ngate: a capture of {} requests", g.capture_requests);
        if g.capture_too_small() {
            let _ = write!(
                out,
                ", under gate.min_capture_requests ({}): too small to judge any candidate",
                g.thresholds.min_capture_requests
            );
        }
        let _ = writeln!(
            out,
            "; the candidate denies {} of {} CRITICAL requests the rules in force allow ({:.2}%; at most {:.2}%); worst: {} {} at {:.2}%: {}",
            g.all.critical_newly_denied,
            g.all.critical_allowed,
            g.all.drop * 100.0,
            g.all.max_drop * 100.0,
            g.worst.kind.as_str(),
            g.worst.name,
            g.worst.drop * 100.0,
            if g.passed { "PASS" } else { "FAIL" }
        );
        for group in &g.failed {
            let _ = writeln!(
                out,
                "  {} {}: {} of {} CRITICAL requests newly denied ({:.2}%; at most {:.2}%)",
                group.kind.as_str(),
                group.name,
                group.critical_newly_denied,
                group.critical_allowed,
                group.drop * 100.0,
                group.max_drop * 100.0
            );
        }
        if g.failed_groups > g.failed.len() as u64 {
            let _ = writeln!(out, "  … {} more", g.failed_groups - g.failed.len() as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(text: &str) -> Rules {
        Rules::native(
            crate::rules::from_text(Path::new("r.yaml"), text, crate::rules::PathForm::default()).unwrap(),
        )
    }

    /// A request captured as CRITICAL under rule `play` on /play, as BULK
    /// under `bulk` elsewhere.
    fn request(t: u64, user: &str, path: &str) -> Request {
        let (captured_priority, rule) =
            if path == "/play" { (Priority::Critical, "play") } else { (Priority::Bulk, "bulk") };
        Request {
            time_ms: t,
            user_id: user.into(),
            resource_path: path.into(),
            client_type: None,
            priority: None,
            weight: 1,
            usage: None,
            count: CountKind::Check,
            captured_priority,
            captured_rule: Some(rule.into()),
            envoy: None,
        }
    }

    const PLAY: &str = "rules:\n  - { rule_id: play, resource_path: /play, priority_bucket: CRITICAL, limit: 10, window_seconds: 1 }\n  - { rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: 10, window_seconds: 1 }\n";

    /// 3 users × 8 requests to /play within one second, 8 to /bulk.
    fn play_capture() -> Capture {
        let mut capture = Capture::default();
        for i in 0..8u64 {
            for user in ["a", "b", "c"] {
                capture.requests.push(request(1_000_000 + i * 10, user, "/play"));
            }
            capture.requests.push(request(1_000_000 + i * 10, "a", "/bulk"));
        }
        capture.sort();
        capture
    }

    #[test]
    fn a_tighter_critical_rule_fails_the_gate_and_a_harmless_one_passes() {
        let tight = PLAY.replacen("limit: 10", "limit: 5", 1);
        let harmless = PLAY.replace(
            "rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: 10",
            "rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: 2",
        );
        let capture = play_capture();
        // A capture this small is judged only under a lowered bound.
        let thresholds = GateThresholds { min_capture_requests: 32, ..GateThresholds::default() };
        let settings = Settings { thresholds, ..Settings::default() };
        let fail = replay(&capture, snapshot(PLAY), snapshot(&tight), &settings);
        assert!(!fail.gate.passed);
        assert_eq!((fail.gate.all.critical_allowed, fail.gate.all.critical_newly_denied), (24, 9));
        let failed: Vec<(&str, &str)> =
            fail.gate.failed.iter().map(|g| (g.kind.as_str(), &*g.name)).collect();
        assert_eq!(failed, vec![("all", "*"), ("rule", "play"), ("path", "/play")]);
        assert_eq!(
            fail.rules["play"],
            Row { requests: 24, denied_current: 0, denied_candidate: 9, newly_denied: 9, newly_allowed: 0 }
        );
        let table = fail.table();
        assert!(table.contains("FAIL") && table.contains("rule play: 9 of 24 CRITICAL"), "{table}");

        let pass = replay(&capture, snapshot(PLAY), snapshot(&harmless), &settings);
        assert!(pass.gate.passed, "{}", pass.table());
        assert_eq!(pass.priorities["BULK"].newly_denied, 6, "BULK may be denied: not gated");
        assert_eq!(pass.gate.all.critical_newly_denied, 0);
        let report = pass.gate_report("v2", "now".to_owned());
        assert_eq!((report.candidate_version.as_str(), report.capture_requests), ("v2", 32));
        assert_eq!(report.capture_digest, pass.capture_digest);
    }

    /// Under the default gate.min_capture_requests (1,000), an empty or a
    /// 32-request capture fails whatever the candidate, a CRITICAL rule cut
    /// from 1,000 a minute to 1 a day included, and the verdict says why.
    #[test]
    fn an_empty_or_tiny_capture_fails_the_gate() {
        let cut = PLAY.replacen("limit: 10, window_seconds: 1", "limit: 1, window_seconds: 86400", 1);
        for capture in [Capture::default(), play_capture()] {
            let report = replay(&capture, snapshot(PLAY), snapshot(&cut), &Settings::default());
            assert!(!report.gate.passed && report.gate.capture_too_small());
            let table = report.table();
            let size = format!(
                "a capture of {} requests, under gate.min_capture_requests (1000)",
                capture.requests.len()
            );
            assert!(table.contains(&size) && table.contains(": FAIL"), "{table}");
        }
    }

    /// The rules in force at replay no longer call /play CRITICAL (nor does
    /// the request); it was captured as CRITICAL, so a candidate denying
    /// 37.5% of it fails.
    #[test]
    fn critical_is_what_the_request_was_when_captured() {
        let plain = PLAY.replace("priority_bucket: CRITICAL, ", "");
        let tight = PLAY.replacen("limit: 10", "limit: 5", 1);
        let report = replay(&play_capture(), snapshot(&plain), snapshot(&tight), &Settings::default());
        assert!(!report.gate.passed, "{}", report.table());
        assert!((report.gate.all.drop - 0.375).abs() < 1e-9, "{}", report.gate.all.drop);
    }

    /// 1,000 client-made CRITICAL requests on an unruled path dilute the
    /// global share under its threshold; rule play's own share still fails.
    #[test]
    fn client_made_critical_traffic_does_not_dilute_a_rule() {
        let mut capture = play_capture();
        for i in 0..1_000u64 {
            let mut junk = request(1_000_000 + i, &format!("bot{i}"), "/junk");
            (junk.captured_priority, junk.captured_rule) = (Priority::Critical, None);
            capture.requests.push(junk);
        }
        capture.sort();
        let tightest = PLAY.replacen("limit: 10", "limit: 3", 1);
        let report = replay(&capture, snapshot(PLAY), snapshot(&tightest), &Settings::default());
        assert!(report.gate.all.drop < 0.05, "diluted: {}", report.gate.all.drop);
        assert!(!report.gate.passed, "{}", report.table());
        assert_eq!((report.gate.worst.kind.as_str(), &*report.gate.worst.name), ("rule", "play"));
        assert!(report.gate.rules.iter().any(|g| g.name == "-" && g.passed), "{:?}", report.gate.rules);
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
        let outcomes = run(rules, &requests, &Settings::default());
        let denied: Vec<bool> = outcomes.iter().map(|o| o.denied).collect();
        assert_eq!(denied, vec![false, false, true, false]);
    }
}
