//! Fault tests: real processes killed under sustained load. Phases advance
//! on counts of answers seen, not on sleeps, so the test runs as fast as the
//! machine allows and is bounded by its `eventually` timeouts.

mod common;

use std::{
    collections::HashSet,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use common::{RedisServer, Rules, TestServer, config, eventually, reason};
use ratelimitd::api::pb::{self, Reason};

const RULES: &str = r#"
rules:
  - { rule_id: open, resource_path: /open, limit: 100000000, window_seconds: 3600, failure_policy: open }
"#;

/// What the callers saw.
#[derive(Debug, Default)]
struct Seen {
    /// Request ids answered OK, with when the answer arrived.
    ok: Vec<(String, Instant)>,
    /// Request ids answered by the failure policy, with their latency.
    by_policy: Vec<(String, Duration)>,
    /// RPCs that failed (any gRPC error).
    errors: Vec<String>,
}

/// A server on `rules` and `redis` with the production Redis deadline (not
/// the harness' lenient one) and its dead-letter file (`dlq.jsonl`) in a
/// directory of the test's own: the server's temporary one goes with it on
/// stop, and the file is read after the stop has flushed it.
async fn fault_server(rules: &Rules, redis: &RedisServer) -> (TestServer, tempfile::TempDir) {
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = ratelimitd::config::RedisConfig::default().timeout_ms;
    let dlq_dir = tempfile::tempdir().unwrap();
    cfg.dlq.file = dlq_dir.path().join("dlq.jsonl");
    (TestServer::start(cfg).await, dlq_dir)
}

/// Redis killed under sustained load (16 callers): no RPC fails, every
/// decision made while Redis is away is answered by the failure policy and
/// is in the dead-letter file exactly once: a record of its own (matched by
/// request id) or counted in an aggregate record of the flood (whose sample
/// is one of them), the counts adding up to the policy answers; the
/// breaker answers most of them without trying Redis, and exact decisions
/// resume within one second of Redis returning. Prints the figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_loses_no_decision() {
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let (server, dlq_dir) = fault_server(&rules, &redis).await;
    let client = server.client().await;

    let running = Arc::new(AtomicBool::new(true));
    let ok = Arc::new(AtomicUsize::new(0));
    let by_policy = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut callers = Vec::new();
    for caller in 0..16 {
        let (running, ok, by_policy, seen) =
            (Arc::clone(&running), Arc::clone(&ok), Arc::clone(&by_policy), Arc::clone(&seen));
        let mut client = client.clone();
        callers.push(tokio::spawn(async move {
            let mut mine = Seen::default();
            let mut n = 0;
            while running.load(Ordering::Relaxed) {
                let id = format!("{caller}-{n}");
                n += 1;
                let mut request = common::request(&format!("user-{caller}"), "/open");
                request.headers.insert("x-request-id".to_owned(), id.clone());
                let sent = Instant::now();
                match client.check(request).await {
                    Ok(response) => {
                        let response: pb::RateLimitResponse = response.into_inner();
                        match reason(&response) {
                            Reason::Ok => {
                                mine.ok.push((id, Instant::now()));
                                ok.fetch_add(1, Ordering::Relaxed);
                            }
                            Reason::FailOpen => {
                                assert!(response.allowed);
                                mine.by_policy.push((id, sent.elapsed()));
                                by_policy.fetch_add(1, Ordering::Relaxed);
                            }
                            other => panic!("unexpected answer {other:?}: {response:?}"),
                        }
                    }
                    Err(status) => mine.errors.push(format!("{id}: {status}")),
                }
            }
            let mut all = seen.lock().unwrap();
            all.ok.extend(mine.ok);
            all.by_policy.extend(mine.by_policy);
            all.errors.extend(mine.errors);
        }));
    }
    let reaches = |counter: &Arc<AtomicUsize>, at_least: usize| {
        let counter = Arc::clone(counter);
        eventually(Duration::from_secs(30), move || {
            let reached = counter.load(Ordering::Relaxed) >= at_least;
            async move { reached }
        })
    };

    assert!(reaches(&ok, 500).await, "no load before the outage");
    redis.stop();
    let killed = Instant::now();
    assert!(reaches(&by_policy, 3_000).await, "the outage was not answered by policy");
    let outage_answers = by_policy.load(Ordering::Relaxed);
    let ok_before_restart = ok.load(Ordering::Relaxed);
    redis.restart();
    let restarted = Instant::now();
    assert!(reaches(&ok, ok_before_restart + 500).await, "decisions did not resume");
    running.store(false, Ordering::Relaxed);
    for caller in callers {
        caller.await.unwrap();
    }
    let outage = restarted - killed;
    let records = {
        server.stop().await.unwrap();
        common::read_dlq(&dlq_dir.path().join("dlq.jsonl"))
    };

    let seen = seen.lock().unwrap();
    assert!(
        seen.errors.is_empty(),
        "{} RPCs failed: {:?}",
        seen.errors.len(),
        &seen.errors[..seen.errors.len().min(5)]
    );
    let first_ok_after =
        seen.ok.iter().map(|(_, at)| *at).filter(|at| *at > restarted).min().expect("OK after restart");
    let recovery = first_ok_after - restarted;

    // Exactly once: the records' counts add up to the policy answers, and
    // every record (own or an aggregate's sample) is one of them, once.
    let represented: u64 = records.iter().map(|r| r.count).sum();
    assert_eq!(represented, seen.by_policy.len() as u64, "records stand for every policy answer, once");
    let aggregates = records.iter().filter(|r| r.count > 1).count();
    let recorded: Vec<&str> = records
        .iter()
        .map(|r| r.request.headers.get("x-request-id").expect("request id kept").as_str())
        .collect();
    let unique: HashSet<&str> = recorded.iter().copied().collect();
    assert_eq!(unique.len(), recorded.len(), "a decision was recorded twice");
    let answered: HashSet<&str> = seen.by_policy.iter().map(|(id, _)| id.as_str()).collect();
    let unanswered: Vec<_> = unique.difference(&answered).collect();
    assert!(
        unanswered.is_empty(),
        "{} records without a policy answer (e.g. {:?})",
        unanswered.len(),
        &unanswered[..unanswered.len().min(5)]
    );
    let circuit_open: u64 =
        records.iter().filter(|r| r.failure.kind == "circuit_open").map(|r| r.count).sum();
    assert!(circuit_open > 0, "the breaker never opened");

    let mut latencies: Vec<Duration> = seen.by_policy.iter().map(|(_, d)| *d).collect();
    latencies.sort();
    let p = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    eprintln!(
        "outage {outage:?}: {} decisions answered by policy ({outage_answers} when Redis was restarted), \
         {} records ({aggregates} aggregates; {circuit_open} decisions circuit_open), 0 lost, 0 failed RPCs; policy-answer latency p50 {:?} p99 {:?} max {:?}; \
         {} OK decisions in all; first exact decision {recovery:?} after Redis returned",
        seen.by_policy.len(),
        records.len(),
        p(0.5),
        p(0.99),
        latencies.last().unwrap(),
        seen.ok.len(),
    );
    assert!(
        recovery < Duration::from_secs(1),
        "exact decisions resumed only {recovery:?} after Redis returned"
    );
}

/// A Redis pause of 30 ms (`DEBUG SLEEP 0.03`, what a fork for BGSAVE
/// costs), five times under load from 8 callers of a fail-closed rule at
/// the production deadline: the decisions the pauses delay fail by policy,
/// but no pause opens the circuit breaker (it needs failures spanning
/// `redis.breaker_min_failing_ms`), so no decision is denied without trying
/// Redis and `/readyz` stays ready. Prints the figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_redis_pauses_open_no_breaker() {
    const CLOSED: &str = r#"
rules:
  - { rule_id: closed, resource_path: /closed, limit: 100000000, window_seconds: 3600, failure_policy: closed }
"#;
    let redis = RedisServer::start();
    let rules = Rules::new(CLOSED);
    let (server, dlq_dir) = fault_server(&rules, &redis).await;
    let client = server.client().await;
    let running = Arc::new(AtomicBool::new(true));
    let ok = Arc::new(AtomicUsize::new(0));
    let denied = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::new();
    for caller in 0..8 {
        let (running, ok, denied) = (Arc::clone(&running), Arc::clone(&ok), Arc::clone(&denied));
        let mut client = client.clone();
        callers.push(tokio::spawn(async move {
            while running.load(Ordering::Relaxed) {
                let response = client.check(common::request(&format!("user-{caller}"), "/closed")).await;
                match reason(&response.expect("no RPC fails").into_inner()) {
                    Reason::Ok => ok.fetch_add(1, Ordering::Relaxed),
                    Reason::FailClosed => denied.fetch_add(1, Ordering::Relaxed),
                    other => panic!("unexpected answer {other:?}"),
                };
            }
        }));
    }
    let reaches = |counter: &Arc<AtomicUsize>, at_least: usize| {
        let counter = Arc::clone(counter);
        eventually(Duration::from_secs(30), move || {
            let reached = counter.load(Ordering::Relaxed) >= at_least;
            async move { reached }
        })
    };
    assert!(reaches(&ok, 300).await, "no load before the pauses");
    let mut admin = redis.client().await;
    for _ in 0..5 {
        let () = redis::cmd("DEBUG").arg("SLEEP").arg("0.03").query_async(&mut admin).await.unwrap();
        let seen = ok.load(Ordering::Relaxed);
        assert!(reaches(&ok, seen + 200).await, "decisions did not resume after a pause");
        let addr = server.http_addr;
        let (code, why) =
            tokio::task::spawn_blocking(move || common::http_get(addr, "/readyz")).await.unwrap();
        assert_eq!(code, 200, "{why}");
    }
    running.store(false, Ordering::Relaxed);
    for caller in callers {
        caller.await.unwrap();
    }
    server.stop().await.unwrap();
    let records = common::read_dlq(&dlq_dir.path().join("dlq.jsonl"));
    let circuit_open = records.iter().filter(|r| r.failure.kind == "circuit_open").count();
    let represented: u64 = records.iter().map(|r| r.count).sum();
    eprintln!(
        "5 pauses of 30 ms: {} exact decisions, {} denied by policy while delayed ({} records standing for {represented}, {circuit_open} circuit_open)",
        ok.load(Ordering::Relaxed),
        denied.load(Ordering::Relaxed),
        records.len()
    );
    assert_eq!(represented, denied.load(Ordering::Relaxed) as u64, "every policy answer recorded");
    assert_eq!(circuit_open, 0, "a 30 ms pause opened the breaker");
}
