//! The Kafka dead-letter topic end to end, against a real Kafka-protocol
//! broker (tansu) and a real redis-server: migrate, records on the topic,
//! a broker outage, `kill -9` with a spool, and `audit`.

#![cfg(feature = "kafka")]

mod common;

use std::{
    collections::HashSet,
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

use common::{
    Broker, RedisServer, Rules, TestServer, check, config, eventually, free_port, kafka_config, reason,
    request, topic_records,
};
use ratelimitd::{api::pb::Reason, config::Config, migrate};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

const RULES: &str = r#"
rules:
  - { rule_id: open, resource_path: /open, limit: 1000, window_seconds: 86400, failure_policy: open }
  - { rule_id: closed, resource_path: /closed, limit: 1000, window_seconds: 86400, failure_policy: closed }
"#;

/// A configuration on `broker` and `redis`, with the topic created.
async fn migrated(rules: &Rules, redis: &RedisServer, broker: &Broker, spool: &std::path::Path) -> Config {
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 200;
    kafka_config(&mut cfg, broker, spool);
    migrate::run(&cfg).await.expect("migrate");
    cfg
}

/// `users` failing decisions (Redis is down) for users `prefix-0..`.
async fn fail_decisions(server: &TestServer, prefix: &str, users: usize) {
    let mut client = server.client().await;
    for i in 0..users {
        let path = if i % 2 == 0 { "/open" } else { "/closed" };
        let r = check(&mut client, request(&format!("{prefix}-{i}"), path)).await;
        assert!(matches!(reason(&r), Reason::FailOpen | Reason::FailClosed), "{r:?}");
    }
}

fn assert_exactly_once(records: &[ratelimitd::dlq::FailureRecord], prefix: &str, users: usize) {
    let ids: HashSet<_> = records.iter().map(|r| &r.event_id).collect();
    assert_eq!(ids.len(), records.len(), "duplicate event ids on the topic");
    let mut seen: Vec<_> = records.iter().map(|r| r.request.user_id.clone()).collect();
    seen.sort();
    let mut expected: Vec<_> = (0..users).map(|i| format!("{prefix}-{i}")).collect();
    expected.sort();
    assert_eq!(seen, expected, "every failed decision exactly once");
}

/// `migrate` creates the topic and records the key schema, then is a no-op.
#[test]
fn migrate_creates_then_is_a_no_op() {
    let broker = Broker::start();
    let redis = RedisServer::start();
    let env = [
        ("RATELIMITD__DLQ__KAFKA__BROKERS", broker.brokers()),
        ("RATELIMITD__DLQ__KAFKA__REPLICATION_FACTOR", "1".to_owned()),
        ("RATELIMITD__DLQ__KAFKA__PARTITIONS", "2".to_owned()),
        ("RATELIMITD__REDIS__URL", redis.url()),
    ];
    let run = || {
        let output = Command::new(BIN).arg("migrate").envs(env.iter().map(|(k, v)| (k, v))).output().unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        String::from_utf8(output.stdout).unwrap()
    };
    let first = run();
    assert!(
        first.contains("0001_dlq_topic.yaml: applied: created topic \"ratelimit.dlq\" (2 partitions"),
        "{first}"
    );
    assert!(first.contains("0002_redis_key_schema.yaml: applied: recorded key-schema version 1"), "{first}");
    assert!(
        first.contains("0003_redis_key_schema_v2.yaml: applied: upgraded key-schema version 1 to 2"),
        "{first}"
    );
    let second = run();
    assert!(
        second.contains("0001_dlq_topic.yaml: already applied: topic \"ratelimit.dlq\" exists"),
        "{second}"
    );
    assert!(
        second.contains(
            "0002_redis_key_schema.yaml: already applied: key-schema version 2 recorded (a later step)"
        ),
        "{second}"
    );
    assert!(second.contains("0003_redis_key_schema_v2.yaml: already applied"), "{second}");
    assert!(second.contains("nothing to do"), "{second}");
}

/// Redis stopped: each failed decision is one record on the topic, keyed by
/// user, and the pipeline's counters reconcile with nothing pending.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_decisions_reach_the_topic_exactly_once() {
    let broker = Broker::start();
    let mut redis = RedisServer::start();
    let (rules, spool) = (Rules::new(RULES), tempfile::tempdir().unwrap());
    let cfg = migrated(&rules, &redis, &broker, spool.path()).await;
    let server = TestServer::start(cfg.clone()).await;
    redis.stop();
    fail_decisions(&server, "user", 40).await;
    let observer = server.observer().await;
    let delivered = eventually(Duration::from_secs(30), || {
        let stats = observer.dlq.stats();
        async move { stats.delivered == 40 }
    })
    .await;
    let stats = observer.dlq.stats();
    assert!(delivered, "{stats:?}");
    assert_eq!((stats.enqueued, stats.delivered, stats.pending, stats.dropped), (40, 40, 0, 0));
    server.stop().await.unwrap();

    let records = tokio::task::spawn_blocking(move || topic_records(&cfg)).await.unwrap();
    assert_exactly_once(&records, "user", 40);
    assert!(
        records
            .iter()
            .all(|r| r.answer.reason == if r.rule_id == "open" { "FAIL_OPEN" } else { "FAIL_CLOSED" })
    );
}

/// Broker down while failures happen: records wait in the spool (counted
/// pending); broker back: all delivered, none lost, no duplicate event ids.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_outage_spools_then_delivers_everything_once() {
    let mut broker = Broker::start();
    let mut redis = RedisServer::start();
    let (rules, spool) = (Rules::new(RULES), tempfile::tempdir().unwrap());
    let cfg = migrated(&rules, &redis, &broker, spool.path()).await;
    let server = TestServer::start(cfg.clone()).await;
    let observer = server.observer().await;
    redis.stop();

    fail_decisions(&server, "before", 10).await;
    assert!(eventually(Duration::from_secs(30), || async { observer.dlq.stats().delivered == 10 }).await);

    broker.stop();
    fail_decisions(&server, "during", 200).await;
    // Everything offered is accounted for once the writer is at rest (the
    // counters are separate atomics; mid-batch a read can straddle a move
    // from the writer's hands to the spool): delivered before, pending now.
    let at_rest = eventually(Duration::from_secs(10), || async {
        let s = observer.dlq.stats();
        s.delivered + s.pending + s.dropped == s.enqueued
    })
    .await;
    let during = observer.dlq.stats();
    assert!(at_rest, "{during:?}");
    assert_eq!((during.enqueued, during.delivered, during.pending, during.dropped), (210, 10, 200, 0));
    eprintln!("during the broker outage: {during:?}");

    broker.restart();
    let drained =
        eventually(Duration::from_secs(60), || async { observer.dlq.stats().delivered == 210 }).await;
    let after = observer.dlq.stats();
    eprintln!("after the broker came back: {after:?}");
    assert!(drained, "{after:?}");
    assert_eq!((after.pending, after.dropped), (0, 0));
    server.stop().await.unwrap();

    let records = tokio::task::spawn_blocking(move || topic_records(&cfg)).await.unwrap();
    let during: Vec<_> =
        records.iter().filter(|r| r.request.user_id.starts_with("during-")).cloned().collect();
    assert_eq!(records.len(), 210);
    assert_exactly_once(&during, "during", 200);
}

/// `kill -9` while records sit in the spool (broker down): a restarted
/// service delivers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_spooled_before_kill_9_are_delivered_after_restart() {
    let mut broker = Broker::start();
    let mut redis = RedisServer::start();
    let (rules, spool) = (Rules::new(RULES), tempfile::tempdir().unwrap());
    let cfg = migrated(&rules, &redis, &broker, spool.path()).await;
    broker.stop();
    redis.stop();

    let brokers = broker.brokers();
    let serve = |port: u16| {
        Command::new(BIN)
            .arg("serve")
            .env("RATELIMITD__GRPC__LISTEN", format!("127.0.0.1:{port}"))
            .env("RATELIMITD__HTTP__LISTEN", format!("127.0.0.1:{}", free_port()))
            .env("RATELIMITD__RULES__PATH", rules.path())
            .env("RATELIMITD__REDIS__URL", redis.url())
            .env("RATELIMITD__REDIS__TIMEOUT_MS", "200")
            .env("RATELIMITD__SHED__MODE", "off")
            .env("RATELIMITD__DLQ__KAFKA__BROKERS", &brokers)
            .env("RATELIMITD__DLQ__KAFKA__TOPIC", &cfg.dlq.kafka.topic)
            .env("RATELIMITD__DLQ__AGGREGATE_AFTER", u32::MAX.to_string())
            .env("RATELIMITD__DLQ__SPOOL_DIR", spool.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let port = free_port();
    let mut first = serve(port);
    let addr = format!("http://127.0.0.1:{port}");
    let mut client = connect(&addr).await;
    for i in 0..30 {
        let r = check(&mut client, request(&format!("spooled-{i}"), "/open")).await;
        assert_eq!(reason(&r), Reason::FailOpen);
    }
    // Each answered decision is in the spool once its batch is fsync'd.
    let spooled = eventually(Duration::from_secs(10), || async { spool_lines(spool.path()) == 30 }).await;
    assert!(spooled, "{} lines spooled", spool_lines(spool.path()));
    first.kill().unwrap(); // SIGKILL: no drain, no flush
    first.wait().unwrap();

    broker.restart();
    let mut second = serve(free_port());
    let topic_cfg = cfg.clone();
    let delivered = eventually(Duration::from_secs(60), || {
        let cfg = topic_cfg.clone();
        async move { tokio::task::spawn_blocking(move || topic_records(&cfg).len()).await.unwrap() >= 30 }
    })
    .await;
    second.kill().unwrap();
    second.wait().unwrap();
    assert!(delivered, "spooled records were not delivered after the restart");
    let records = tokio::task::spawn_blocking(move || topic_records(&cfg)).await.unwrap();
    assert_exactly_once(&records, "spooled", 30);
}

/// audit over the topic: every filter, the summary, JSON, an empty topic
/// and a missing one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audit_filters_and_summarises_the_topic() {
    let broker = Broker::start();
    let mut redis = RedisServer::start();
    let (rules, spool) = (Rules::new(RULES), tempfile::tempdir().unwrap());
    let cfg = migrated(&rules, &redis, &broker, spool.path()).await;
    let env = [
        ("RATELIMITD__DLQ__KAFKA__BROKERS".to_owned(), broker.brokers()),
        ("RATELIMITD__DLQ__KAFKA__TOPIC".to_owned(), cfg.dlq.kafka.topic.clone()),
    ];
    let audit = |args: &[&str]| -> Output {
        Command::new(BIN).arg("audit").args(args).envs(env.iter().map(|(k, v)| (k, v))).output().unwrap()
    };

    // An empty topic.
    let empty = audit(&[]);
    assert!(empty.status.success(), "{}", String::from_utf8_lossy(&empty.stderr));
    assert!(String::from_utf8_lossy(&empty.stdout).contains("0 of 0 records matched"));

    let server = TestServer::start(cfg.clone()).await;
    redis.stop();
    let started = Instant::now();
    fail_decisions(&server, "aud", 6).await; // open: aud-0,2,4; closed: aud-1,3,5
    let observer = server.observer().await;
    assert!(eventually(Duration::from_secs(30), || async { observer.dlq.stats().delivered == 6 }).await);
    server.stop().await.unwrap();

    let text = |o: &Output| String::from_utf8_lossy(&o.stdout).into_owned();
    let all = audit(&[]);
    assert!(
        text(&all).contains("6 of 6 records matched; answered FAIL_OPEN 3, FAIL_CLOSED 3"),
        "{}",
        text(&all)
    );
    assert!(
        text(&all).contains("by rule:\n  closed                   3\n  open                     3"),
        "{}",
        text(&all)
    );
    assert!(text(&audit(&["--user", "aud-3"])).contains("1 of 6 records matched"));
    assert!(text(&audit(&["--rule", "open"])).contains("3 of 6 records matched"));
    // Filter by the kind of some record on the topic.
    let records = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        move || topic_records(&cfg)
    })
    .await
    .unwrap();
    let some_kind = records[0].failure.kind.clone();
    let of_kind = records.iter().filter(|r| r.failure.kind == some_kind).count();
    assert!(text(&audit(&["--kind", &some_kind])).contains(&format!("{of_kind} of 6 records matched")));
    assert!(text(&audit(&["--kind", "cluster_error"])).contains("0 of 6 records matched"));
    let minutes = format!("{}m", started.elapsed().as_secs() / 60 + 5);
    assert!(text(&audit(&["--since", &minutes])).contains("6 of 6 records matched"));
    assert!(text(&audit(&["--until", &minutes])).contains("0 of 6 records matched"));
    assert!(
        text(&audit(&["--since", "2000-01-01T00:00:00Z", "--until", "2000-01-02T00:00:00Z"]))
            .contains("0 of 6")
    );

    let json = audit(&["--format", "json", "--rule", "closed"]);
    let lines: Vec<ratelimitd::dlq::FailureRecord> =
        text(&json).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 3);
    assert!(String::from_utf8_lossy(&json.stderr).contains("3 of 6 records matched"));

    let bad = audit(&["--since", "last tuesday"]);
    assert_eq!(bad.status.code(), Some(64));

    let missing = Command::new(BIN)
        .args(["audit"])
        .env("RATELIMITD__DLQ__KAFKA__BROKERS", broker.brokers())
        .env("RATELIMITD__DLQ__KAFKA__TOPIC", "no.such.topic")
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(1));
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("topic \"no.such.topic\" does not exist"), "{err}");
}

/// A service pointed at a topic that does not exist says what to run, keeps
/// the records in the spool, and delivers them once `migrate` has run.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn missing_topic_spools_until_migrate() {
    let broker = Broker::start();
    let mut redis = RedisServer::start();
    let (rules, spool) = (Rules::new(RULES), tempfile::tempdir().unwrap());
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 200;
    kafka_config(&mut cfg, &broker, spool.path());
    let server = TestServer::start(cfg.clone()).await;
    let observer = server.observer().await;
    redis.stop();
    fail_decisions(&server, "early", 5).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let waiting = observer.dlq.stats();
    assert_eq!((waiting.delivered, waiting.pending), (0, 5), "{waiting:?}");
    // Redis is down for this test; only the topic step matters here.
    let kafka_only = Config { redis: ratelimitd::config::RedisConfig::default(), ..cfg.clone() };
    migrate::run(&kafka_only).await.unwrap();
    assert!(eventually(Duration::from_secs(60), || async { observer.dlq.stats().delivered == 5 }).await);
    server.stop().await.unwrap();
}

async fn connect(
    addr: &str,
) -> ratelimitd::api::pb::rate_limiter_client::RateLimiterClient<tonic::transport::Channel> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match ratelimitd::api::pb::rate_limiter_client::RateLimiterClient::connect(addr.to_owned()).await {
            Ok(client) => return client,
            Err(e) if Instant::now() > deadline => panic!("{addr}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

fn spool_lines(dir: &std::path::Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("seg-"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default().lines().count())
        .sum()
}

/// The broker killed (SIGKILL) while failed decisions stream in from 8
/// callers (Redis down), then restarted: no RPC fails, nothing is dropped,
/// and `ratelimitd audit` counts exactly as many records as the callers saw
/// failed decisions. Prints the figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_killed_under_sustained_failures_loses_nothing() {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    };

    let mut broker = Broker::start();
    let mut redis = RedisServer::start();
    let (rules, spool) = (Rules::new(RULES), tempfile::tempdir().unwrap());
    let cfg = migrated(&rules, &redis, &broker, spool.path()).await;
    let server = TestServer::start(cfg.clone()).await;
    let observer = server.observer().await;
    redis.stop();

    let failed = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let client = server.client().await;
    let callers: Vec<_> = (0..8)
        .map(|caller| {
            let (mut client, failed, stop) = (client.clone(), Arc::clone(&failed), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    let path = if n % 2 == 0 { "/open" } else { "/closed" };
                    let r = check(&mut client, request(&format!("load-{caller}-{n}"), path)).await;
                    assert!(matches!(reason(&r), Reason::FailOpen | Reason::FailClosed), "{r:?}");
                    failed.fetch_add(1, Ordering::Relaxed);
                    n += 1;
                }
            })
        })
        .collect();

    assert!(eventually(Duration::from_secs(30), || async { observer.dlq.stats().delivered >= 200 }).await);
    broker.stop();
    let killed = Instant::now();
    let at_kill = failed.load(Ordering::Relaxed);
    assert!(
        eventually(Duration::from_secs(30), || async { failed.load(Ordering::Relaxed) >= at_kill + 2_000 })
            .await
    );
    broker.restart();
    let outage = killed.elapsed();
    let at_restart = failed.load(Ordering::Relaxed);
    assert!(
        eventually(Duration::from_secs(30), || async { failed.load(Ordering::Relaxed) >= at_restart + 500 })
            .await
    );
    stop.store(true, Ordering::Relaxed);
    for caller in callers {
        caller.await.unwrap();
    }
    let failures = failed.load(Ordering::Relaxed);
    let delivered_all = eventually(Duration::from_secs(60), || async {
        let s = observer.dlq.stats();
        s.enqueued == failures as u64 && s.delivered == s.enqueued
    })
    .await;
    let stats = observer.dlq.stats();
    assert!(delivered_all, "{stats:?} for {failures} failures");
    assert_eq!((stats.pending, stats.dropped), (0, 0));
    server.stop().await.unwrap();

    let audit = Command::new(BIN)
        .arg("audit")
        .env("RATELIMITD__DLQ__KAFKA__BROKERS", broker.brokers())
        .env("RATELIMITD__DLQ__KAFKA__TOPIC", &cfg.dlq.kafka.topic)
        .output()
        .unwrap();
    let summary = String::from_utf8_lossy(&audit.stdout);
    assert!(audit.status.success(), "{}", String::from_utf8_lossy(&audit.stderr));
    assert!(
        summary.contains(&format!("{failures} of {failures} records matched")),
        "audit after {failures} failed decisions: {summary}"
    );
    eprintln!(
        "broker killed for {} ms under load: {failures} failed decisions ({} while it was down), {} records delivered, {} dropped, audit counted {failures}",
        outage.as_millis(),
        at_restart - at_kill,
        stats.delivered,
        stats.dropped
    );
}

/// SASL passthrough: a broker that requires SCRAM-SHA-512 authentication,
/// credentials given as `dlq.kafka.properties`: `migrate` creates the topic
/// and failed decisions reach it. The password is in no record and not in
/// the configuration's debug output.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sasl_scram_credentials_pass_through_to_the_broker() {
    let mut broker = Broker::start();
    broker.require_scram_user("ratelimitd", "scram-secret-pw");
    let mut redis = RedisServer::start();
    let (rules, spool) = (Rules::new(RULES), tempfile::tempdir().unwrap());
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 200;
    kafka_config(&mut cfg, &broker, spool.path());
    for (key, value) in [
        ("security.protocol", "SASL_PLAINTEXT"),
        ("sasl.mechanism", "SCRAM-SHA-512"),
        ("sasl.username", "ratelimitd"),
        ("sasl.password", "scram-secret-pw"),
    ] {
        cfg.dlq.kafka.properties.insert(key.to_owned(), value.to_owned());
    }
    assert!(!format!("{cfg:?}").contains("scram-secret-pw"));
    migrate::run(&cfg).await.expect("migrate over SASL");
    let server = TestServer::start(cfg.clone()).await;
    let observer = server.observer().await;
    redis.stop();
    fail_decisions(&server, "sasl", 6).await;
    assert!(eventually(Duration::from_secs(30), || async { observer.dlq.stats().delivered == 6 }).await);
    server.stop().await.unwrap();
    let records = tokio::task::spawn_blocking(move || topic_records(&cfg)).await.unwrap();
    assert_exactly_once(&records, "sasl", 6);
    assert!(!serde_json::to_string(&records).unwrap().contains("scram-secret-pw"));
}

/// SASL_SSL end to end: the broker (tansu, whose own TLS flags cannot be
/// used together in 0.6.0) behind a real Envoy that terminates TLS with a
/// certificate from a private CA and advertised at Envoy's port, requiring
/// SCRAM-SHA-512. With `security.protocol: SASL_SSL` and `ssl.ca.location`
/// in `dlq.kafka.properties`, `migrate`, delivery and audit all work over
/// TLS; without the CA the service cannot deliver and keeps every record in
/// the spool.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sasl_ssl_through_a_tls_terminating_proxy() {
    let certs = tempfile::tempdir().unwrap();
    common::make_ca(certs.path(), "ca");
    common::make_leaf(certs.path(), "ca", "kafka", "serverAuth");
    let mut broker = Broker::start();
    broker.require_scram_user("ratelimitd", "ssl-scram-pw");
    let proxy = TlsProxy::start(certs.path(), broker.port);
    broker.advertise(proxy.port);

    let mut redis = RedisServer::start();
    let (rules, spool) = (Rules::new(RULES), tempfile::tempdir().unwrap());
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 200;
    kafka_config(&mut cfg, &broker, spool.path());
    cfg.dlq.kafka.brokers = Some(format!("127.0.0.1:{}", proxy.port));
    let ca = certs.path().join("ca.pem");
    for (key, value) in [
        ("security.protocol", "SASL_SSL"),
        ("ssl.ca.location", ca.to_str().unwrap()),
        ("sasl.mechanism", "SCRAM-SHA-512"),
        ("sasl.username", "ratelimitd"),
        ("sasl.password", "ssl-scram-pw"),
    ] {
        cfg.dlq.kafka.properties.insert(key.to_owned(), value.to_owned());
    }
    migrate::run(&cfg).await.expect("migrate over SASL_SSL");
    let server = TestServer::start(cfg.clone()).await;
    let observer = server.observer().await;
    redis.stop();
    fail_decisions(&server, "tls", 6).await;
    assert!(eventually(Duration::from_secs(30), || async { observer.dlq.stats().delivered == 6 }).await);
    server.stop().await.unwrap();
    let records = tokio::task::spawn_blocking({
        let cfg = cfg.clone();
        move || topic_records(&cfg)
    })
    .await
    .unwrap();
    assert_exactly_once(&records, "tls", 6);

    // The same, trusting the system roots only: the proxy's certificate is
    // refused, nothing is delivered and nothing is lost.
    let spool2 = tempfile::tempdir().unwrap();
    let mut untrusted = cfg.clone();
    untrusted.dlq.kafka.properties.remove("ssl.ca.location");
    untrusted.dlq.spool_dir = spool2.path().to_path_buf();
    let server = TestServer::start(untrusted).await;
    let observer = server.observer().await;
    fail_decisions(&server, "untrusted", 4).await;
    assert!(eventually(Duration::from_secs(10), || async { observer.dlq.stats().pending == 4 }).await);
    let stats = observer.dlq.stats();
    assert_eq!((stats.delivered, stats.dropped), (0, 0), "{stats:?}");
    server.stop().await.unwrap();
}

/// Envoy terminating TLS (`kafka.pem`/`kafka.key` from `certs`) in front of
/// a plain TCP port. Killed by PID on drop.
struct TlsProxy {
    child: std::process::Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl TlsProxy {
    fn start(certs: &std::path::Path, upstream: u16) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (child, port) = common::start_envoy(dir.path(), |port, admin| {
            format!(
                r#"
admin:
  address: {{ socket_address: {{ address: 127.0.0.1, port_value: {admin} }} }}
static_resources:
  listeners:
  - name: kafka_tls
    address: {{ socket_address: {{ address: 127.0.0.1, port_value: {port} }} }}
    filter_chains:
    - transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            tls_certificates:
            - certificate_chain: {{ filename: "{cert}" }}
              private_key: {{ filename: "{key}" }}
      filters:
      - name: envoy.filters.network.tcp_proxy
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy
          stat_prefix: kafka
          cluster: broker
  clusters:
  - name: broker
    connect_timeout: 1s
    type: STATIC
    load_assignment:
      cluster_name: broker
      endpoints:
      - lb_endpoints:
        - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {upstream} }} }} }}
"#,
                cert = certs.join("kafka.pem").display(),
                key = certs.join("kafka.key").display(),
            )
        });
        TlsProxy { child, port, _dir: dir }
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
