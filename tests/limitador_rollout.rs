//! limitador's limits on the rules topic, against a real Kafka-protocol
//! broker (tansu): an instance with `rules.limitador_path` and
//! `rules.source: kafka` serves its file until a record arrives, then the
//! limits `rules publish --limitador` published; it refuses a record
//! without limitador's limits (which would lift every limit it answers
//! by); `rules diff --limitador` names each changed limit; its captured
//! `ShouldRateLimit` calls gate a candidate (a tighter one fails, a looser
//! one is published, gated); `rules rollback` puts the first back.

#![cfg(feature = "kafka")]

mod common;

use std::{
    path::Path,
    process::{Command, Output},
    time::Duration,
};

use common::{Broker, TestServer, config, eventually, http_get, metric};
use ratelimitd::{
    api::envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
        rls::{RateLimitRequest, rate_limit_service_client::RateLimitServiceClient},
    },
    config::RulesSource,
    shed::Priority,
};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

/// `max` calls per minute per `user` in namespace `ns`.
fn limits(max: u32) -> String {
    format!(
        "- {{ namespace: ns, max_value: {max}, seconds: 60, conditions: [], variables: [\"descriptors[0]['user']\"] }}\n"
    )
}

/// The environment of the operator's commands: the broker, unsigned records.
fn env(broker: &Broker) -> Vec<(&'static str, String)> {
    vec![
        ("RATELIMITD__RULES__KAFKA__BROKERS", broker.brokers()),
        ("RATELIMITD__RULES__KAFKA__REPLICATION_FACTOR", "1".to_owned()),
        ("RATELIMITD__RULES__SOURCE", "kafka".to_owned()),
        ("RATELIMITD__RULES__KAFKA__ALLOW_UNSIGNED", "true".to_owned()),
        ("RATELIMITD__GATE__MIN_CAPTURE_REQUESTS", "10".to_owned()),
    ]
}

fn run(broker: &Broker, args: &[&str]) -> Output {
    Command::new(BIN).args(args).envs(env(broker)).output().unwrap()
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

/// Runs `args`, which must succeed; the second word of its output (the
/// version `rules publish` and `rules rollback` print).
fn version_of(broker: &Broker, args: &[&str]) -> String {
    let out = run(broker, args);
    assert!(out.status.success(), "{args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).split_whitespace().nth(1).expect("published VERSION …").to_owned()
}

/// An instance answering with limitador's limits from the rules topic,
/// `fallback` its file, CRITICAL its namespace, every call captured to `capture`.
fn instance(broker: &Broker, fallback: &Path, capture: &Path) -> ratelimitd::config::Config {
    let mut cfg = config(Path::new("/unused"), None);
    cfg.rules.path = None;
    cfg.rules.source = RulesSource::Kafka;
    cfg.rules.limitador_path = Some(fallback.to_path_buf());
    cfg.rules.kafka.brokers = Some(broker.brokers());
    cfg.rules.kafka.allow_unsigned = true;
    cfg.rules.kafka.status_interval_ms = 200;
    cfg.envoy.domain_priority = [("ns".to_owned(), Priority::Critical)].into();
    cfg.capture.sample_ratio = 1.0;
    cfg.capture.salt = Some("a secret shared by the fleet".to_owned());
    cfg.capture.file = capture.to_path_buf();
    cfg
}

async fn readyz(server: &TestServer) -> String {
    let addr = server.http_addr;
    tokio::task::spawn_blocking(move || http_get(addr, "/readyz")).await.unwrap().1
}

async fn serves(server: &TestServer, version: &str) -> bool {
    readyz(server).await.contains(&format!("rules {version} (from topic,"))
}

/// How many of `n` `ShouldRateLimit` calls of `user` in `ns` are OK.
async fn admitted(server: &TestServer, user: &str, n: usize) -> usize {
    let mut client = RateLimitServiceClient::connect(format!("http://{}", server.addr)).await.unwrap();
    let mut ok = 0;
    for _ in 0..n {
        let entries = vec![Entry { key: "user".to_owned(), value: user.to_owned() }];
        let descriptors = vec![RateLimitDescriptor { entries, ..Default::default() }];
        let request = RateLimitRequest { domain: "ns".to_owned(), descriptors, hits_addend: 0 };
        let code = client.should_rate_limit(request).await.unwrap().into_inner().overall_code;
        ok += usize::from(code == 1);
    }
    ok
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limitadors_limits_are_published_refused_gated_and_rolled_back() {
    let broker = Broker::start();
    let out = run(&broker, &["migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let (fallback, capture) = (file("fallback.yaml", &limits(100)), dir.path().join("capture.jsonl"));

    // An empty topic: the file is served.
    let server = TestServer::start(instance(&broker, &fallback, &capture)).await;
    assert!(readyz(&server).await.contains("(from fallback,"), "{}", readyz(&server).await);
    assert_eq!(admitted(&server, "f", 5).await, 5, "100 a minute from the file");

    let v1 = file("v1.yaml", &limits(3));
    let first = version_of(&broker, &["rules", "publish", "--unsigned", "--limitador", v1.to_str().unwrap()]);
    assert!(
        eventually(Duration::from_secs(10), || serves(&server, &first)).await,
        "{}",
        readyz(&server).await
    );
    for user in ["a", "b", "c", "d"] {
        assert_eq!(admitted(&server, user, 3).await, 3, "3 a minute from the record");
    }
    assert_eq!(admitted(&server, "a", 1).await, 0, "a's fourth");

    // rules diff names the limit by what makes its counter.
    let tight = file("tight.yaml", &limits(1));
    let out = run(&broker, &["rules", "diff", "--limitador", tight.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("changed  ns 60s if [] by [descriptors[0]['user']]: max_value 3 -> 1"),
        "{}",
        text(&out)
    );

    // A record of native rules only would lift every limit this instance answers by.
    let native =
        file("native.yaml", "rules:\n  - { rule_id: x, resource_path: /x, limit: 1, window_seconds: 60 }\n");
    version_of(&broker, &["rules", "publish", "--unsigned", native.to_str().unwrap()]);
    let refused = "ratelimitd_rules_records_total{result=\"refused\"}";
    assert!(
        eventually(Duration::from_secs(10), || async { metric(&server, refused).await == Some(1.0) }).await,
        "the native-only record is refused"
    );
    assert!(serves(&server, &first).await, "{}", readyz(&server).await);
    assert_eq!(admitted(&server, "b", 1).await, 0, "b's limit still holds");
    server.stop().await.unwrap();

    // The captured calls gate candidates against the record in force: the native-only one
    // (no instance like this one serves it; under it every call is unmatched, admitted).
    let lines = std::fs::read_to_string(&capture).unwrap();
    let captured = lines.lines().filter(|l| l.contains("\"domain\":\"ns\"")).count();
    assert_eq!(captured, 5 + 4 * 3 + 1 + 1, "every ShouldRateLimit call: {lines}");
    let gate = |candidate: &Path| {
        run(
            &broker,
            &[
                "rules",
                "publish",
                "--unsigned",
                "--limitador",
                candidate.to_str().unwrap(),
                "--gate",
                capture.to_str().unwrap(),
            ],
        )
    };
    let failed = gate(&tight);
    assert_eq!(failed.status.code(), Some(1), "{}", text(&failed));
    assert!(text(&failed).contains("fails the gate; nothing published"), "{}", text(&failed));
    let valid = run(&broker, &["rules", "validate", "--limitador", tight.to_str().unwrap()]);
    assert!(text(&valid).contains("tight.yaml: ok, 1 limits"), "{}", text(&valid));
    let replayed = Command::new(BIN)
        .args(["replay", "--capture", capture.to_str().unwrap(), "--min-group-requests", "1"])
        .args(["--limitador", tight.to_str().unwrap(), "--current-limitador", v1.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(replayed.status.code(), Some(1), "{}", text(&replayed));
    // Under 3 a minute 15 of the 19 were admitted; 1 a minute denies 10 of them.
    assert!(
        text(&replayed).contains("the candidate denies 10 of 15 CRITICAL requests"),
        "{}",
        text(&replayed)
    );
    assert!(text(&replayed).contains("path ns: user=f: 2 of 3"), "{}", text(&replayed));
    let loose = file("loose.yaml", &limits(20));
    let passed = gate(&loose);
    assert!(passed.status.success(), "{}", text(&passed));
    let history = text(&run(&broker, &["rules", "history"]));
    assert!(history.contains("gated (19 requests"), "{history}");

    let server = TestServer::start(instance(&broker, &fallback, &capture)).await;
    let loose_version =
        text(&passed).split_whitespace().skip_while(|w| *w != "published").nth(1).unwrap().to_owned();
    assert!(serves(&server, &loose_version).await, "{}", readyz(&server).await);
    assert_eq!(admitted(&server, "e", 5).await, 5, "20 a minute");

    // Rolled back: the first record's limits again.
    let back = run(&broker, &["rules", "rollback", "--unsigned", &first]);
    assert!(back.status.success(), "{}", text(&back));
    assert!(
        eventually(Duration::from_secs(10), || serves(&server, &first)).await,
        "{}",
        readyz(&server).await
    );
    assert_eq!(admitted(&server, "g", 4).await, 3, "3 a minute again");
    server.stop().await.unwrap();
}
