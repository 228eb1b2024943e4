//! The rules write path end to end against a real Kafka-protocol broker
//! (tansu): `migrate` creates the topics, `rules publish` writes snapshots,
//! three instances subscribed with `rules.source: kafka` converge on each
//! one, refuse corrupt records, survive a broker outage and follow a
//! rollback; `rules status` and `rules history` show it. Only records
//! signed by a trusted key are served (rotation without a gap). Then capture
//! and replay: a candidate that drops CRITICAL traffic fails the gate, a
//! harmless one passes and is published; the gate judges what traffic was
//! when captured, per rule and per path, travels signed in the record, and
//! `require_gate` instances serve nothing else; Envoy traffic gates an
//! Envoy candidate the same way.

#![cfg(feature = "kafka")]

mod common;

use std::{
    path::Path,
    process::{Command, Output},
    time::{Duration, Instant},
};

use common::{
    Broker, TestServer, capture_play_and_bulk, check, config, eventually, http_get, metric,
    play_and_bulk_rules, request,
};
use ratelimitd::{config::RulesSource, rollout::topic, rules::signing::Signer, shed::Priority};

/// A publisher's key pair: the private key in a file, the public key.
struct Key {
    file: std::path::PathBuf,
    public: String,
}

/// Two publishers' keys (`a` signs by default, `b` for rotations), made by
/// `rules keygen` once for the whole binary.
struct Keys {
    _dir: tempfile::TempDir,
    a: Key,
    b: Key,
}

static KEYS: std::sync::LazyLock<Keys> = std::sync::LazyLock::new(|| {
    let dir = tempfile::tempdir().unwrap();
    let key = |name: &str| {
        let file = dir.path().join(name);
        let out = Command::new(BIN).args(["rules", "keygen", "--out"]).arg(&file).output().unwrap();
        assert!(out.status.success(), "{}", text(&out));
        let public = String::from_utf8(out.stdout).unwrap().trim().to_owned();
        let written = Signer::from_text(&std::fs::read_to_string(&file).unwrap()).unwrap();
        assert_eq!(written.public_key(), public, "the file holds the printed key's pair");
        Key { file, public }
    };
    let (a, b) = (key("a.key"), key("b.key"));
    Keys { _dir: dir, a, b }
});

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

/// `limit` requests per hour on /x for every user.
fn rules(limit: u32) -> String {
    format!(
        "rules:\n  - {{ rule_id: x, resource_path: /x, limit: {limit}, window_seconds: 3600 }}\n  - {{ rule_id: grow, resource_path: /grow, limit: 50, window_seconds: 1, adaptive: {{ min: 10, max: 100 }} }}\n"
    )
}

fn env(broker: &Broker) -> Vec<(&'static str, String)> {
    vec![
        ("RATELIMITD__RULES__KAFKA__BROKERS", broker.brokers()),
        ("RATELIMITD__RULES__KAFKA__REPLICATION_FACTOR", "1".to_owned()),
        ("RATELIMITD__RULES__KAFKA__STATUS_INTERVAL_MS", "200".to_owned()),
        ("RATELIMITD__RULES__KAFKA__SIGNING_KEY_FILE", KEYS.a.file.display().to_string()),
        ("RATELIMITD__CAPTURE__KAFKA__BROKERS", broker.brokers()),
        ("RATELIMITD__CAPTURE__KAFKA__PARTITIONS", "2".to_owned()),
        ("RATELIMITD__CAPTURE__KAFKA__REPLICATION_FACTOR", "1".to_owned()),
        // The captures here are a few dozen requests: judged all the same.
        ("RATELIMITD__GATE__MIN_CAPTURE_REQUESTS", "10".to_owned()),
    ]
}

fn run(broker: &Broker, args: &[&str]) -> Output {
    Command::new(BIN).args(args).envs(env(broker)).output().unwrap()
}

fn text(output: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr))
}

fn migrate(broker: &Broker) {
    let out = run(broker, &["migrate"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("0004_rules_topic.yaml: applied: created topic \"ratelimit.rules\""),
        "{}",
        text(&out)
    );
}

/// Publishes `path`; returns the version it printed.
fn publish(broker: &Broker, path: &Path) -> String {
    let out = run(broker, &["rules", "publish", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    stdout.split_whitespace().nth(1).expect("published VERSION …").to_owned()
}

fn subscriber(broker: &Broker, instance: &str) -> ratelimitd::config::Config {
    let mut cfg = config(Path::new("/unused"), None);
    cfg.rules.path = None;
    cfg.rules.source = RulesSource::Kafka;
    cfg.rules.kafka.brokers = Some(broker.brokers());
    cfg.rules.kafka.status_interval_ms = 200;
    cfg.rules.kafka.verify_keys = vec![KEYS.a.public.clone()];
    cfg.dlq.instance_id = Some(instance.to_owned());
    cfg.gate.min_capture_requests = 10;
    cfg
}

async fn readyz(server: &TestServer) -> (u16, String) {
    let addr = server.http_addr;
    tokio::task::spawn_blocking(move || http_get(addr, "/readyz")).await.unwrap()
}

async fn serves(server: &TestServer, version: &str) -> bool {
    readyz(server).await.1.contains(&format!("rules {version} (from topic,"))
}

/// How many of `n` requests by a fresh `user` on /x pass.
async fn admitted(server: &TestServer, user: &str, n: usize) -> usize {
    let mut client = server.client().await;
    let mut passed = 0;
    for _ in 0..n {
        passed += usize::from(check(&mut client, request(user, "/x")).await.allowed);
    }
    passed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn published_snapshots_converge_survive_bad_records_and_outages_and_roll_back() {
    let mut broker = Broker::start();
    migrate(&broker);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    // A git work tree: the record names the commit and its author.
    std::fs::write(&file, rules(1)).unwrap();
    let git = |args: &[&str]| {
        let out = Command::new("git").arg("-C").arg(dir.path()).args(args).output().unwrap();
        assert!(out.status.success(), "git {args:?}: {}", text(&out));
    };
    git(&["init", "-q"]);
    git(&["-c", "user.name=Ann Op", "-c", "user.email=ann@example.com", "add", "rules.yaml"]);
    git(&["-c", "user.name=Ann Op", "-c", "user.email=ann@example.com", "commit", "-qm", "limit 1"]);
    let v1 = publish(&broker, &file);
    let again = run(&broker, &["rules", "publish", file.to_str().unwrap()]);
    assert!(text(&again).contains("already in force"), "{}", text(&again));

    let servers = [
        TestServer::start(subscriber(&broker, "i1")).await,
        TestServer::start(subscriber(&broker, "i2")).await,
        TestServer::start(subscriber(&broker, "i3")).await,
    ];
    for (i, server) in servers.iter().enumerate() {
        assert!(serves(server, &v1).await, "{}", readyz(server).await.1);
        assert_eq!(admitted(server, &format!("a{i}"), 3).await, 1, "limit 1 in force");
        let info = format!("ratelimitd_rules_published_info{{version=\"{v1}\",origin=\"topic\"}}");
        assert_eq!(metric(server, &info).await, Some(1.0));
    }

    // Publish → every instance swaps; the time to the last one is measured.
    std::fs::write(&file, rules(3)).unwrap();
    let started = Instant::now();
    let v2 = publish(&broker, &file);
    let published = started.elapsed();
    let mut converged = [None; 3];
    while converged.iter().any(Option::is_none) && started.elapsed() < Duration::from_secs(20) {
        for (slot, server) in converged.iter_mut().zip(&servers) {
            if slot.is_none() && serves(server, &v2).await {
                *slot = Some(started.elapsed());
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    eprintln!("rules publish took {published:?}; instances swapped {converged:?} after it started");
    assert!(converged.iter().all(Option::is_some), "not every instance took {v2}");
    for (i, server) in servers.iter().enumerate() {
        assert_eq!(admitted(server, &format!("b{i}"), 5).await, 3, "limit 3 in force");
    }

    // A corrupt record and a tampered one: refused, v2 stays.
    let producer = tokio::task::spawn_blocking({
        let brokers = broker.brokers();
        move || topic::read_all(&brokers, &Default::default(), "ratelimit.rules").unwrap()
    })
    .await
    .unwrap();
    // Signed: the limit raised inside the signed record breaks the signature.
    let good = producer.last().unwrap().payload.clone().unwrap();
    let mut envelope: serde_json::Value = serde_json::from_slice(&good).unwrap();
    let mut record: serde_json::Value = serde_json::from_str(envelope["record"].as_str().unwrap()).unwrap();
    record["native"]["rules"][0]["limit"] = 1_000_000.into();
    envelope["record"] = serde_json::to_string(&record).unwrap().into();
    let tampered = serde_json::to_vec(&envelope).unwrap();
    let kafka =
        ratelimitd::config::RulesKafkaConfig { brokers: Some(broker.brokers()), ..Default::default() };
    let p = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", broker.brokers())
        .create::<rdkafka::producer::FutureProducer>()
        .unwrap();
    topic::produce(&p, &kafka.topic, "garbage", Some(b"{not a snapshot")).await.unwrap();
    topic::produce(&p, &kafka.topic, "tampered", Some(&tampered)).await.unwrap();
    for server in &servers {
        let refused = || async {
            metric(server, "ratelimitd_rules_records_total{result=\"refused\"}").await == Some(2.0)
        };
        assert!(eventually(Duration::from_secs(10), refused).await, "both bad records counted");
        assert!(serves(server, &v2).await, "{}", readyz(server).await.1);
    }

    // An empty set: `rules publish` refuses it; published anyway (a
    // publisher allowing empty sets), every instance refuses it.
    let empty = dir.path().join("empty.yaml");
    std::fs::write(&empty, "rules: []\n").unwrap();
    let refused = run(&broker, &["rules", "publish", empty.to_str().unwrap()]);
    assert!(!refused.status.success() && text(&refused).contains("no rules"), "{}", text(&refused));
    let forced = Command::new(BIN)
        .args(["rules", "publish", empty.to_str().unwrap()])
        .envs(env(&broker))
        .env("RATELIMITD__RULES__ALLOW_EMPTY", "true")
        .output()
        .unwrap();
    assert!(forced.status.success(), "{}", text(&forced));
    for server in &servers {
        let refused = || async {
            metric(server, "ratelimitd_rules_records_total{result=\"refused\"}").await == Some(3.0)
        };
        assert!(eventually(Duration::from_secs(10), refused).await, "the empty record refused");
        assert!(serves(server, &v2).await, "{}", readyz(server).await.1);
    }

    // The broker goes away: rules stay; it comes back: the next publish lands.
    broker.stop();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for (i, server) in servers.iter().enumerate() {
        assert!(serves(server, &v2).await, "no rules lost while the broker is down");
        assert_eq!(admitted(server, &format!("c{i}"), 5).await, 3);
    }
    broker.restart();
    std::fs::write(&file, rules(2)).unwrap();
    let v3 = publish(&broker, &file);
    for server in &servers {
        assert!(
            eventually(Duration::from_secs(20), || serves(server, &v3)).await,
            "{}",
            readyz(server).await.1
        );
    }

    // Status: every instance reports v3.
    let status = || async {
        let out = tokio::task::spawn_blocking({
            let env = env(&broker);
            move || Command::new(BIN).args(["rules", "status"]).envs(env).output().unwrap()
        })
        .await
        .unwrap();
        (out.status.success(), text(&out))
    };
    assert!(eventually(Duration::from_secs(10), || async { status().await.0 }).await, "{}", status().await.1);
    let shown = status().await.1;
    for instance in ["i1@", "i2@", "i3@"] {
        assert!(
            shown.lines().any(|l| l.starts_with(instance) && l.contains(&v3) && l.ends_with("current")),
            "{shown}"
        );
    }
    assert_eq!(shown.matches("adaptive limits: grow=50").count(), 3, "{shown}");

    // Rollback to v1: every instance follows.
    let out = run(&broker, &["rules", "rollback", &v1]);
    assert!(
        out.status.success() && text(&out).contains(&format!("rolled back to {v1} (from {v3})")),
        "{}",
        text(&out)
    );
    for (i, server) in servers.iter().enumerate() {
        assert!(eventually(Duration::from_secs(20), || serves(server, &v1)).await);
        assert_eq!(admitted(server, &format!("d{i}"), 3).await, 1, "limit 1 again");
    }
    let history = text(&run(&broker, &["rules", "history"]));
    assert!(history.contains("(refused: undecodable") && history.contains("rollback from"), "{history}");
    assert!(history.contains("Ann Op <ann@example.com>") && history.contains("(in force)"), "{history}");

    for server in servers {
        server.stop().await.unwrap();
    }
}

/// Publishes `path` with extra `args` (`--unsigned`, `--signing-key F`);
/// returns the version it printed.
fn publish_with(broker: &Broker, path: &Path, args: &[&str]) -> String {
    let mut all = vec!["rules", "publish"];
    all.extend_from_slice(args);
    all.push(path.to_str().unwrap());
    let out = run(broker, &all);
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout).split_whitespace().nth(1).expect("published VERSION …").to_owned()
}

/// Who may change the limits. Three instances trusting key A keep serving
/// A's record when an unsigned record and one signed by an unknown key B
/// arrive: each is refused, counted and shown by `rules status`. A
/// rotation: an instance trusting A and B takes records of both, in turn,
/// never waiting between them; one trusting only B refuses A's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_records_signed_by_a_trusted_key_are_served() {
    let broker = Broker::start();
    migrate(&broker);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, rules(2)).unwrap();
    let v1 = publish(&broker, &file);
    let servers = [
        TestServer::start(subscriber(&broker, "i1")).await,
        TestServer::start(subscriber(&broker, "i2")).await,
        TestServer::start(subscriber(&broker, "i3")).await,
    ];
    for server in &servers {
        assert!(
            eventually(Duration::from_secs(20), || serves(server, &v1)).await,
            "{}",
            readyz(server).await.1
        );
    }

    // Unsigned, then signed by a key no instance trusts: both published, both refused.
    std::fs::write(&file, rules(7)).unwrap();
    publish_with(&broker, &file, &["--unsigned"]);
    std::fs::write(&file, rules(9)).unwrap();
    let b_key = KEYS.b.file.to_str().unwrap();
    let by_b = publish_with(&broker, &file, &["--signing-key", b_key]);
    for (i, server) in servers.iter().enumerate() {
        let refused = || async {
            metric(server, "ratelimitd_rules_records_total{result=\"refused\"}").await == Some(2.0)
        };
        assert!(eventually(Duration::from_secs(10), refused).await, "both records refused");
        assert!(serves(server, &v1).await, "{}", readyz(server).await.1);
        assert_eq!(admitted(server, &format!("a{i}"), 4).await, 2, "A's limit of 2 still in force");
    }
    let status = text(&run(&broker, &["rules", "status"]));
    let unknown = format!("the last: signed by {}, which is not in rules.kafka.verify_keys", KEYS.b.public);
    assert_eq!(status.lines().filter(|l| l.contains(&unknown)).count(), 3, "{status}");
    let history = text(&run(&broker, &["rules", "history"]));
    assert!(history.contains("(refused: unsigned record"), "{history}");
    assert!(history.contains(&format!("(refused: signed by {}", KEYS.b.public)), "{history}");

    // Rotation: trusting A and B, the newest record (B's) is served; A's
    // next one follows; readiness never drops in between.
    let mut both = subscriber(&broker, "i4");
    both.rules.kafka.verify_keys = vec![KEYS.a.public.clone(), KEYS.b.public.clone()];
    let rotating = TestServer::start(both).await;
    assert!(
        eventually(Duration::from_secs(20), || serves(&rotating, &by_b)).await,
        "{}",
        readyz(&rotating).await.1
    );
    std::fs::write(&file, rules(4)).unwrap();
    let by_a = publish(&broker, &file);
    let started = Instant::now();
    while !serves(&rotating, &by_a).await {
        assert_eq!(readyz(&rotating).await.0, 200, "no gap while the next key's record arrives");
        assert!(started.elapsed() < Duration::from_secs(20), "{}", readyz(&rotating).await.1);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // After the rotation: trusting only B, A's newer record is refused.
    let mut only_b = subscriber(&broker, "i5");
    only_b.rules.kafka.verify_keys = vec![KEYS.b.public.clone()];
    let rotated = TestServer::start(only_b).await;
    assert!(
        eventually(Duration::from_secs(20), || serves(&rotated, &by_b)).await,
        "{}",
        readyz(&rotated).await.1
    );
    for server in servers.into_iter().chain([rotating, rotated]) {
        server.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn instances_wait_for_rules_or_fall_back() {
    let broker = Broker::start();
    migrate(&broker);
    let dir = tempfile::tempdir().unwrap();

    // An empty topic and no fallback: not ready, "waiting for rules".
    let waiting = TestServer::start_unready(subscriber(&broker, "w")).await;
    let readiness = || async { readyz(&waiting).await };
    assert!(
        eventually(Duration::from_secs(5), || async { readiness().await.1.contains("waiting for rules") })
            .await,
        "{}",
        readiness().await.1
    );
    assert_eq!(readiness().await.0, 503);

    // An empty topic with a fallback file: served at once, from the fallback.
    let fallback = dir.path().join("fallback.yaml");
    std::fs::write(&fallback, rules(2)).unwrap();
    let mut with_fallback = subscriber(&broker, "f");
    with_fallback.rules.path = Some(fallback.clone());
    let falling_back = TestServer::start(with_fallback).await;
    assert!(readyz(&falling_back).await.1.contains("(from fallback,"), "{}", readyz(&falling_back).await.1);
    assert_eq!(admitted(&falling_back, "f", 3).await, 2);

    // An unreachable broker: the fallback after rules.kafka.wait_ms.
    let mut unreachable = subscriber(&broker, "u");
    unreachable.rules.kafka.brokers = Some(format!("127.0.0.1:{}", common::free_port()));
    unreachable.rules.kafka.wait_ms = 300;
    unreachable.rules.path = Some(fallback);
    let isolated = TestServer::start(unreachable).await;
    assert!(readyz(&isolated).await.1.contains("(from fallback,"));

    // A snapshot arrives: the waiting one becomes ready, the fallback is replaced.
    let file = dir.path().join("rules.yaml");
    std::fs::write(&file, rules(4)).unwrap();
    let version = publish(&broker, &file);
    waiting.ready().await;
    assert!(eventually(Duration::from_secs(10), || serves(&waiting, &version)).await);
    assert!(eventually(Duration::from_secs(10), || serves(&falling_back, &version)).await);
    assert_eq!(admitted(&waiting, "w", 5).await, 4);
    for server in [waiting, falling_back, isolated] {
        server.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn captured_traffic_gates_a_candidate_that_drops_critical_requests() {
    let broker = Broker::start();
    migrate(&broker);
    let dir = tempfile::tempdir().unwrap();
    let current = dir.path().join("current.yaml");
    let rules_of = play_and_bulk_rules;
    std::fs::write(&current, rules_of(10, 10)).unwrap();
    let capture = dir.path().join("capture.jsonl");
    capture_play_and_bulk(&current, &capture).await;
    let lines = std::fs::read_to_string(&capture).unwrap();
    assert_eq!(lines.lines().count(), 32, "every request of every sampled user");
    let record: ratelimitd::capture::CaptureRecord =
        serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!((record.effective_priority, record.rule_id.as_deref()), (Priority::Critical, Some("play")));

    let tight = dir.path().join("tight.yaml");
    std::fs::write(&tight, rules_of(5, 10)).unwrap();
    let harmless = dir.path().join("harmless.yaml");
    std::fs::write(&harmless, rules_of(10, 2)).unwrap();
    let replay = |candidate: &Path| {
        let json = dir.path().join("report.json");
        let out = Command::new(BIN)
            .env("RATELIMITD__GATE__MIN_CAPTURE_REQUESTS", "10")
            .args(["replay", "--rules", candidate.to_str().unwrap(), "--capture", capture.to_str().unwrap()])
            .args(["--current", current.to_str().unwrap(), "--json", json.to_str().unwrap()])
            .output()
            .unwrap();
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        (out, report)
    };
    let (out, report) = replay(&tight);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("denies 9 of 24 CRITICAL requests"), "{}", text(&out));
    assert!(text(&out).contains("FAIL") && text(&out).contains("rule play: 9"), "{}", text(&out));
    assert_eq!(report["rules"]["play"]["newly_denied"], 9);
    assert_eq!(report["gate"]["passed"], false);
    let (out, report) = replay(&harmless);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert_eq!(report["priorities"]["BULK"]["newly_denied"], 6);

    // The gate in front of publish: the rules in force are the configured file.
    let gate = |candidate: &Path| {
        Command::new(BIN)
            .args(["rules", "publish", candidate.to_str().unwrap(), "--gate", capture.to_str().unwrap()])
            .envs(env(&broker))
            .env("RATELIMITD__RULES__PATH", &current)
            .output()
            .unwrap()
    };
    let refused = gate(&tight);
    assert_eq!(refused.status.code(), Some(1));
    assert!(text(&refused).contains("fails the gate; nothing published"), "{}", text(&refused));
    let history = text(&run(&broker, &["rules", "history"]));
    assert!(!history.contains("(in force)"), "nothing was published: {history}");
    let passed = gate(&harmless);
    assert!(passed.status.success() && text(&passed).contains("published "), "{}", text(&passed));

    // The same traffic captured to the capture topic replays the same way.
    let mut cfg = config(&current, None);
    cfg.capture.sample_ratio = 1.0;
    cfg.capture.salt = Some("a secret shared by the fleet".to_owned());
    cfg.capture.kafka.brokers = Some(broker.brokers());
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    for user in ["a", "b", "c"] {
        for _ in 0..8 {
            check(&mut client, request(user, "/play")).await;
        }
    }
    server.stop().await.unwrap();
    let out = Command::new(BIN)
        .env("RATELIMITD__GATE__MIN_CAPTURE_REQUESTS", "10")
        .args(["replay", "--rules", tight.to_str().unwrap(), "--capture", "kafka"])
        .args(["--current", current.to_str().unwrap()])
        .envs(env(&broker))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("replayed 24 requests") && text(&out).contains("denies 9 of 24"),
        "{}",
        text(&out)
    );
}

/// The gate judges what traffic was when captured and travels with the
/// record. The capture is taken under rules where /play is CRITICAL; the
/// rules in force on the topic no longer say so. A candidate denying 37.5%
/// of /play fails; one denying 62.5% of it fails though 1,000 client-made
/// CRITICAL requests on an unruled path dilute the global share to 1.5%.
/// An instance with `rules.kafka.require_gate` refuses ungated records,
/// records gated by laxer thresholds and serves a passing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gate_judges_captured_priorities_and_travels_with_the_record() {
    let broker = Broker::start();
    migrate(&broker);
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: String| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let play = |priority: &str, limit: u32| {
        format!(
            "rules:\n  - {{ rule_id: play, resource_path: /play, {priority}limit: {limit}, window_seconds: 60 }}\n"
        )
    };
    let captured_under = write("captured.yaml", play("priority_bucket: CRITICAL, ", 10));
    let capture = dir.path().join("capture.jsonl");
    let mut cfg = config(&captured_under, None);
    cfg.capture.sample_ratio = 1.0;
    cfg.capture.salt = Some("a secret shared by the fleet".to_owned());
    cfg.capture.file = capture.clone();
    cfg.shed.trust_request_priority = true;
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    for user in ["a", "b", "c"] {
        for _ in 0..8 {
            assert!(check(&mut client, request(user, "/play")).await.allowed);
        }
    }
    let undiluted = dir.path().join("undiluted.jsonl");
    assert!(
        eventually(Duration::from_secs(5), || async {
            std::fs::read_to_string(&capture).unwrap_or_default().lines().count() == 24
        })
        .await
    );
    std::fs::copy(&capture, &undiluted).unwrap();
    for i in 0..1_000 {
        let mut junk = request(&format!("bot{i}"), "/junk");
        junk.priority = ratelimitd::api::pb::PriorityBucket::Critical as i32;
        check(&mut client, junk).await;
    }
    server.stop().await.unwrap();

    let in_force = publish(&broker, &write("plain.yaml", play("", 10)));
    let publish_gated = |candidate: &Path, capture: &Path, extra: &[&str]| {
        let mut args =
            vec!["rules", "publish", candidate.to_str().unwrap(), "--gate", capture.to_str().unwrap()];
        args.extend_from_slice(extra);
        run(&broker, &args)
    };
    let tight = write("tight.yaml", play("priority_bucket: CRITICAL, ", 5));
    let out = publish_gated(&tight, &undiluted, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("denies 9 of 24 CRITICAL requests"), "{}", text(&out));
    let tightest = write("tightest.yaml", play("priority_bucket: CRITICAL, ", 3));
    let out = publish_gated(&tightest, &capture, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("denies 15 of 1024 CRITICAL requests the rules in force allow (1.46%"),
        "{}",
        text(&out)
    );
    assert!(text(&out).contains("worst: rule play at 62.50%: FAIL"), "{}", text(&out));

    // An instance that requires the gate refuses the ungated record in force.
    let mut strict = subscriber(&broker, "g1");
    strict.rules.kafka.require_gate = true;
    let gated = TestServer::start_unready(strict).await;
    let refused = |n: f64| {
        let gated = &gated;
        move || async move { metric(gated, "ratelimitd_rules_records_total{result=\"refused\"}").await == Some(n) }
    };
    assert!(eventually(Duration::from_secs(20), refused(1.0)).await, "{}", readyz(&gated).await.1);
    assert!(readyz(&gated).await.1.contains("waiting for rules"), "{}", readyz(&gated).await.1);
    // A passing report by thresholds laxer than the instance's: refused too.
    let lax = [
        "--max-critical-drop",
        "1",
        "--max-critical-drop-per-rule",
        "1",
        "--max-critical-drop-per-path",
        "1",
    ];
    let out = publish_gated(&tight, &capture, &lax);
    assert!(out.status.success(), "{}", text(&out));
    assert!(eventually(Duration::from_secs(20), refused(2.0)).await);
    let status = text(&run(&broker, &["rules", "status"]));
    assert!(
        status.contains("its gate's max_critical_drop is laxer than this instance's gate.max_critical_drop"),
        "{status}"
    );
    // A passing candidate, gated: served.
    let same = write("same.yaml", play("priority_bucket: CRITICAL, ", 12));
    let out = publish_gated(&same, &capture, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let published = stdout.lines().find(|l| l.starts_with("published ")).expect("published VERSION …");
    let version = published.split_whitespace().nth(1).unwrap().to_owned();
    gated.ready().await;
    assert!(
        eventually(Duration::from_secs(20), || serves(&gated, &version)).await,
        "{}",
        readyz(&gated).await.1
    );
    let history = text(&run(&broker, &["rules", "history"]));
    assert!(history.contains("gated (1024 requests, worst all * 0.00%)"), "{history}");
    assert!(history.lines().any(|l| l.contains(&in_force) && l.contains("ungated")), "{history}");
    // A publisher configured like the instance cannot skip the gate.
    let out = Command::new(BIN)
        .args(["rules", "publish", tight.to_str().unwrap()])
        .envs(env(&broker))
        .env("RATELIMITD__RULES__KAFKA__REQUIRE_GATE", "true")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{}", text(&out));
    assert!(text(&out).contains("pass --gate CAPTURE"), "{}", text(&out));
    // Nor loosen it.
    let out = Command::new(BIN)
        .args(["rules", "publish", tight.to_str().unwrap(), "--gate", capture.to_str().unwrap()])
        .args(["--max-critical-drop", "0.5"])
        .envs(env(&broker))
        .env("RATELIMITD__RULES__KAFKA__REQUIRE_GATE", "true")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(64), "{}", text(&out));
    assert!(
        text(&out).contains("--max-critical-drop is laxer than gate.max_critical_drop"),
        "{}",
        text(&out)
    );
    gated.stop().await.unwrap();
}

/// Envoy traffic is captured (domain, descriptors, hits; the priority and
/// the limit that bound) and gates an Envoy candidate the same way: a
/// tighter limit on the CRITICAL domain fails, in `replay` and in front of
/// `rules publish --envoy`; a looser one passes and is published gated.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_envoy_capture_gates_an_envoy_candidate() {
    use ratelimitd::api::envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
        rls::{RateLimitRequest, rate_limit_service_client::RateLimitServiceClient},
    };
    let broker = Broker::start();
    migrate(&broker);
    let dir = tempfile::tempdir().unwrap();
    let envoy = |name: &str, limit: u32| {
        let path = dir.path().join(name);
        let text = format!(
            "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: {{ unit: minute, requests_per_unit: {limit} }}\n"
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    let current = envoy("current.yaml", 10);
    let capture = dir.path().join("capture.jsonl");
    let mut cfg = config(&dir.path().join("absent.yaml"), None);
    cfg.rules.path = None;
    cfg.rules.envoy_path = Some(current.clone());
    cfg.envoy.domain_priority = [("edge".to_owned(), Priority::Critical)].into();
    cfg.capture.sample_ratio = 1.0;
    cfg.capture.salt = Some("a secret shared by the fleet".to_owned());
    cfg.capture.file = capture.clone();
    let server = TestServer::start(cfg).await;
    let mut client = RateLimitServiceClient::connect(format!("http://{}", server.addr)).await.unwrap();
    for user in ["a", "b", "c"] {
        for _ in 0..8 {
            let entries = vec![Entry { key: "user".to_owned(), value: user.to_owned() }];
            let descriptors = vec![RateLimitDescriptor { entries, ..Default::default() }];
            let request = RateLimitRequest { domain: "edge".to_owned(), descriptors, hits_addend: 0 };
            assert_eq!(client.should_rate_limit(request).await.unwrap().into_inner().overall_code, 1, "OK");
        }
    }
    server.stop().await.unwrap();
    let lines = std::fs::read_to_string(&capture).unwrap();
    assert_eq!(lines.lines().count(), 24, "every request of every sampled descriptor");
    let record: ratelimitd::capture::CaptureRecord =
        serde_json::from_str(lines.lines().next().unwrap()).unwrap();
    assert_eq!(
        (record.effective_priority, record.rule_id.as_deref()),
        (Priority::Critical, Some("edge.user"))
    );
    let call = record.envoy.expect("an Envoy record");
    assert_eq!((call.domain.as_str(), call.descriptors[0].entries[0].0.as_str()), ("edge", "user"));

    let tight = envoy("tight.yaml", 5);
    let replay = |candidate: &Path| {
        Command::new(BIN)
            .env("RATELIMITD__GATE__MIN_CAPTURE_REQUESTS", "10")
            .args(["replay", "--envoy", candidate.to_str().unwrap(), "--capture", capture.to_str().unwrap()])
            .args(["--current-envoy", current.to_str().unwrap(), "--min-group-requests", "8"])
            .output()
            .unwrap()
    };
    let out = replay(&tight);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("denies 9 of 24 CRITICAL requests"), "{}", text(&out));
    assert!(text(&out).contains("rule edge.user: 9 of 24"), "{}", text(&out));
    assert!(
        text(&out).contains("path edge: user=a"),
        "per path: domain and first descriptor: {}",
        text(&out)
    );
    let looser = envoy("looser.yaml", 20);
    assert_eq!(replay(&looser).status.code(), Some(0));

    let publish = |candidate: &Path| {
        Command::new(BIN)
            .args([
                "rules",
                "publish",
                "--envoy",
                candidate.to_str().unwrap(),
                "--gate",
                capture.to_str().unwrap(),
            ])
            .envs(env(&broker))
            .env("RATELIMITD__RULES__ENVOY_PATH", &current)
            .output()
            .unwrap()
    };
    let refused = publish(&tight);
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused));
    assert!(text(&refused).contains("fails the gate; nothing published"), "{}", text(&refused));
    let published = publish(&looser);
    assert!(published.status.success(), "{}", text(&published));
    let history = text(&run(&broker, &["rules", "history"]));
    assert!(history.contains("gated (24 requests, worst all * 0.00%)"), "{history}");
}

/// Runs `git args…` in `dir` as a test author; panics when it fails.
fn git(dir: &Path, args: &[&str]) -> String {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "-c",
            "user.name=Ada Lovelace",
            "-c",
            "user.email=ada@example.com",
            "-c",
            "init.defaultBranch=main",
        ])
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "git {args:?}: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `rules sync`: the repository is the source of truth. Its head's rules
/// are published with the commit as provenance (a work tree's uncommitted
/// edit is not), once: a second sync finds them in force; a new commit is
/// published; a bare clone syncs the same way; a path the commit does not
/// have is refused, nothing published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_publishes_the_repositorys_commit_once() {
    let broker = Broker::start();
    migrate(&broker);
    let repo = tempfile::tempdir().unwrap();
    git(repo.path(), &["init", "-q"]);
    std::fs::create_dir(repo.path().join("rules")).unwrap();
    std::fs::write(repo.path().join("rules/limits.yaml"), rules(5)).unwrap();
    git(repo.path(), &["add", "rules"]);
    git(repo.path(), &["commit", "-q", "-m", "five"]);
    let first = git(repo.path(), &["rev-parse", "HEAD"]);
    // An edit nobody committed: not the repository's truth.
    std::fs::write(repo.path().join("rules/limits.yaml"), rules(500)).unwrap();
    let sync = |args: &[&str]| {
        let mut all = vec!["rules", "sync", "--repo", repo.path().to_str().unwrap()];
        all.extend_from_slice(args);
        run(&broker, &all)
    };

    let out = sync(&["rules"]);
    assert!(out.status.success(), "{}", text(&out));
    let shown = text(&out);
    let v5 = shown.split_whitespace().nth(1).unwrap().to_owned();
    assert!(shown.contains(&format!("commit {first})")), "{shown}");
    let checkout = tempfile::tempdir().unwrap();
    std::fs::write(checkout.path().join("five.yaml"), rules(5)).unwrap();
    let same = run(&broker, &["rules", "publish", checkout.path().join("five.yaml").to_str().unwrap()]);
    assert!(
        text(&same).contains(&format!("{v5}: already in force")),
        "the committed rules are in force, not the edit: {}",
        text(&same)
    );

    let again = sync(&["rules"]);
    assert!(
        again.status.success() && text(&again).contains("already in force; nothing published"),
        "{}",
        text(&again)
    );

    std::fs::write(repo.path().join("rules/limits.yaml"), rules(7)).unwrap();
    git(repo.path(), &["commit", "-q", "-am", "seven"]);
    let bare = tempfile::tempdir().unwrap();
    git(bare.path(), &["clone", "-q", "--bare", repo.path().to_str().unwrap(), "."]);
    let out = run(&broker, &["rules", "sync", "--repo", bare.path().to_str().unwrap(), "rules"]);
    assert!(out.status.success(), "{}", text(&out));
    let v7 = text(&out).split_whitespace().nth(1).unwrap().to_owned();
    assert_ne!(v5, v7);

    let missing = sync(&["policies"]);
    assert_eq!(missing.status.code(), Some(1), "{}", text(&missing));
    assert!(text(&missing).contains("policies: no such file or directory in "), "{}", text(&missing));
    std::fs::write(
        repo.path().join("rules/broken.yaml"),
        "rules:\n  - { rule_id: b, resource_path: /b, limit: 0, window_seconds: 1 }\n",
    )
    .unwrap();
    git(repo.path(), &["add", "rules"]);
    git(repo.path(), &["commit", "-q", "-m", "broken"]);
    let broken = sync(&["rules"]);
    assert_eq!(broken.status.code(), Some(1), "{}", text(&broken));
    assert!(
        text(&broken).starts_with("rules/broken.yaml: rule \"b\""),
        "named by its path in the repository: {}",
        text(&broken)
    );
    let dotted = sync(&["./rules"]);
    assert!(
        text(&dotted).contains("rules/broken.yaml: rule \"b\""),
        "./rules is the repository's rules: {}",
        text(&dotted)
    );
    let outside = sync(&["../etc"]);
    assert!(text(&outside).contains("give a path inside the repository"), "{}", text(&outside));

    let history = text(&run(&broker, &["rules", "history"]));
    let lines: Vec<&str> = history.lines().skip(1).collect();
    assert_eq!(lines.len(), 2, "{history}");
    assert!(
        lines[0].contains(&v5) && lines[0].contains(&first[..10]) && lines[0].contains("Ada Lovelace"),
        "{history}"
    );
    assert!(lines[1].contains(&v7), "{history}");
}
