//! Black-box tests of the dead-letter record: every decision the store
//! could not make becomes exactly one record with every field right.

mod common;

use std::collections::HashSet;

use common::{RedisServer, Rules, TestServer, check, config, reason, request};
use ratelimitd::api::pb::{PriorityBucket, Reason};

const RULES: &str = r#"
rules:
  - { rule_id: open, resource_path: /open, limit: 1000, window_seconds: 86400, failure_policy: open, priority_bucket: BULK }
  - { rule_id: closed, resource_path: "/closed/*", limit: 1000, window_seconds: 86400, failure_policy: closed }
"#;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Redis stopped: each failed decision yields exactly one record, with the
/// request, rule, failure, answer, trace id and only allow-listed headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_failed_decision_is_recorded_once_with_every_field() {
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 200;
    cfg.dlq.instance_id = Some("test-instance".to_owned());
    cfg.dlq.header_allowlist = vec!["X-Request-Id".to_owned()];
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    // A decision Redis makes is not recorded.
    assert_eq!(reason(&check(&mut client, request("ok-user", "/open")).await), Reason::Ok);

    redis.stop();
    let before_ms = now_ms();
    let mut sent = Vec::new();
    for i in 0..20 {
        let (user, path) =
            (format!("user-{i}"), if i % 2 == 0 { "/open".to_owned() } else { format!("/closed/{i}") });
        let mut r = request(&user, &path);
        r.weight = i + 1;
        r.client_type = if i % 3 == 0 { "ANDROID_MOBILE".to_owned() } else { String::new() };
        r.priority = if i % 4 == 0 { PriorityBucket::Critical as i32 } else { 0 };
        r.headers.insert("x-request-id".to_owned(), format!("req-{i}"));
        r.headers.insert("authorization".to_owned(), "Bearer secret".to_owned());
        let mut call = tonic::Request::new(r.clone());
        if i % 5 == 0 {
            call.metadata_mut().insert("traceparent", TRACEPARENT.parse().unwrap());
        }
        let response = client.check(call).await.unwrap().into_inner();
        assert!(matches!(reason(&response), Reason::FailOpen | Reason::FailClosed), "{response:?}");
        sent.push((r, i % 5 == 0, response));
    }
    let after_ms = now_ms();
    let records = server.stop_and_read_dlq().await;

    assert_eq!(records.len(), sent.len(), "exactly one record per failed decision: {records:#?}");
    let ids: HashSet<_> = records.iter().map(|r| r.event_id.clone()).collect();
    assert_eq!(ids.len(), records.len(), "event ids are unique");
    let mut sorted = records.clone();
    sorted.sort_by(|a, b| a.event_id.cmp(&b.event_id));
    assert_eq!(sorted, records, "event ids sort in decision order");

    for (record, (req, traced, response)) in records.iter().zip(&sent) {
        assert_eq!(record.schema_version, 1);
        assert_eq!(record.instance, "test-instance");
        let time = record.time_ms().expect("RFC 3339 time");
        assert!(time >= before_ms && time <= after_ms, "{record:?}");
        assert_eq!(record.request.user_id, req.user_id);
        assert_eq!(record.request.resource_path, req.resource_path);
        assert_eq!(
            record.request.client_type.as_deref(),
            Some(req.client_type.as_str()).filter(|c| !c.is_empty())
        );
        assert_eq!(record.request.weight, req.weight);
        // The rule's (`/open` is BULK, the rest the default DEGRADED), or
        // what the request stated where that is lower: a request may not
        // raise its own (`shed.trust_request_priority` is off).
        let base = if req.resource_path == "/open" { PriorityBucket::Bulk } else { PriorityBucket::Degraded };
        let expected_priority = match (base as i32).max(req.priority) {
            1 => "CRITICAL",
            2 => "DEGRADED",
            3 => "BEST_EFFORT",
            _ => "BULK",
        };
        assert_eq!(record.request.priority, expected_priority);
        assert_eq!(
            record.request.headers.iter().collect::<Vec<_>>(),
            vec![(&"x-request-id".to_owned(), &req.headers["x-request-id"])],
            "only allow-listed headers"
        );
        assert_eq!(record.rule_id, if req.resource_path == "/open" { "open" } else { "closed" });
        assert!(
            ["connection_refused", "connection_lost", "timeout", "circuit_open"]
                .contains(&record.failure.kind.as_str()),
            "{record:?}"
        );
        assert!(!record.failure.message.is_empty());
        assert_eq!(record.answer.allowed, response.allowed);
        assert_eq!(record.answer.reason, if response.allowed { "FAIL_OPEN" } else { "FAIL_CLOSED" });
        assert_eq!(record.trace_id.as_deref(), traced.then_some("4bf92f3577b34da6a3ce929d0e0e4736"));
    }
}

/// A flood of failures on one rule (Redis down, 300 calls) is folded: per
/// interval, rule, failure kind and answer at most `dlq.aggregate_after`
/// records of their own and one aggregate standing for the rest, the counts
/// adding up to every failed decision; a failure of another rule in the
/// flood still has a record of its own; `audit` counts the decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_failures_is_folded_and_a_real_failure_still_recorded() {
    let Failing { server, _redis, _rules, _dir } = failing(|cfg| cfg.dlq.aggregate_after = 3).await;
    let mut client = server.client().await;
    for i in 0..300 {
        let response = check(&mut client, request(&format!("flood-{i}"), "/open")).await;
        assert_eq!(reason(&response), Reason::FailOpen);
        if i == 150 {
            assert_eq!(reason(&check(&mut client, request("real", "/closed/x")).await), Reason::FailClosed);
        }
    }
    let file = server.dlq_file.clone();
    let records = server.stop_and_read_dlq().await;
    let represented: u64 = records.iter().map(|r| r.count).sum();
    assert_eq!(represented, 301, "every failed decision is in a record");
    let aggregates: Vec<_> = records.iter().filter(|r| r.count > 1).collect();
    assert!(!aggregates.is_empty(), "the flood was not folded: {} records", records.len());
    assert!(aggregates.iter().all(|r| r.rule_id == "open" && r.last_time.is_some()));
    assert!(records.len() <= 40, "{} records for a flood of 300", records.len());
    let real: Vec<_> = records.iter().filter(|r| r.rule_id == "closed").collect();
    assert_eq!(real.len(), 1);
    assert_eq!((real[0].request.user_id.as_str(), real[0].count), ("real", 1));

    let output = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(["audit", "--file"])
        .arg(&file)
        .output()
        .unwrap();
    let summary = String::from_utf8(output.stdout).unwrap();
    assert!(
        summary.contains(&format!(
            "{n} of {n} records matched, standing for 301 failed decisions; answered FAIL_OPEN 300, FAIL_CLOSED 1",
            n = records.len()
        )),
        "{summary}"
    );
}

/// A server on [`RULES`] whose Redis is stopped (every decision fails), its
/// dead-letter file in a directory that outlives it (the default one goes
/// with the server), `tune`d.
struct Failing {
    server: TestServer,
    _redis: RedisServer,
    _rules: Rules,
    _dir: tempfile::TempDir,
}

async fn failing(tune: impl FnOnce(&mut ratelimitd::config::Config)) -> Failing {
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 200;
    let dir = tempfile::tempdir().unwrap();
    cfg.dlq.file = dir.path().join("dlq.jsonl");
    tune(&mut cfg);
    let server = TestServer::start(cfg).await;
    redis.stop();
    Failing { server, _redis: redis, _rules: rules, _dir: dir }
}

/// Decisions that do not fail — allowed, denied, shed or unmatched — write nothing.
#[tokio::test]
async fn successful_decisions_write_no_record() {
    let redis = RedisServer::start();
    let rules =
        Rules::new("rules:\n  - { rule_id: one, resource_path: /one, limit: 1, window_seconds: 86400 }\n");
    let server = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let mut client = server.client().await;
    assert!(check(&mut client, request("u", "/one")).await.allowed);
    assert!(!check(&mut client, request("u", "/one")).await.allowed);
    assert!(check(&mut client, request("u", "/none")).await.allowed);
    assert!(server.stop_and_read_dlq().await.is_empty());
}

fn now_ms() -> u64 {
    u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis())
        .unwrap()
}

/// `ratelimitd audit --file` reads the file sink's records, filters and summarises.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audit_reads_the_file_sink() {
    let Failing { server, _redis, _rules, _dir } = failing(|_| {}).await;
    let mut client = server.client().await;
    for i in 0..4 {
        check(&mut client, request(&format!("f{i}"), if i < 3 { "/open" } else { "/closed/x" })).await;
    }
    let file = server.dlq_file.clone();
    let records = server.stop_and_read_dlq().await;
    assert_eq!(records.len(), 4);

    let audit = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
            .arg("audit")
            .arg("--file")
            .arg(&file)
            .args(args)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    let all = audit(&[]);
    assert!(all.contains("4 of 4 records matched; answered FAIL_OPEN 3, FAIL_CLOSED 1"), "{all}");
    assert!(audit(&["--rule", "closed"]).contains("1 of 4 records matched"));
    assert!(audit(&["--user", "f1", "--since", "10m"]).contains("1 of 4 records matched"));
    let missing = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(["audit", "--file", "/nonexistent/dlq.jsonl"])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("/nonexistent/dlq.jsonl"));
}
