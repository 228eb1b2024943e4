//! Redis Sentinel, black-box: the service finds the master through a real
//! sentinel, and after the master dies and the sentinel promotes its
//! replica, decisions go on exactly from the replicated counts.

mod common;

use std::time::{Duration, Instant};

use common::{Rules, SentinelSetup, TestServer, check, config, reason, request};
use ratelimitd::api::pb::Reason;

// Open: the failover's exactness is the point here, not what answers
// while no primary is known (tests/engine.rs covers `local`).
const RULES: &str = "rules:\n  - { rule_id: hot, resource_path: /hot, limit: 10, window_seconds: 86400, failure_policy: open }\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_keeps_decisions_exact() {
    let mut setup = SentinelSetup::start().await;
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(setup.sentinel_url()));
    cfg.redis.connection.sentinel_master = Some("mymaster".to_owned());
    cfg.redis.timeout_ms = 500;
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    for _ in 0..6 {
        let r = check(&mut client, request("kim", "/hot")).await;
        assert_eq!(reason(&r), Reason::Ok, "{r:?}");
    }
    // Every count is on the replica before the master dies.
    let mut master = setup.master.client().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Short waits: the client's own response timeout is shorter than a long one.
        let acked: i64 = redis::cmd("WAIT").arg(1).arg(200).query_async(&mut master).await.unwrap();
        if acked == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "the replica never acknowledged the writes");
    }
    let old_master = setup.master.port;
    setup.master.stop();

    // Until the sentinel has promoted the replica, decisions fail by policy
    // (open) and count nothing; then the replica's counts go on.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut admitted = 0;
    loop {
        let r = check(&mut client, request("kim", "/hot")).await;
        match reason(&r) {
            Reason::Ok => admitted += 1,
            Reason::OverLimit => break,
            Reason::FailOpen => {
                assert_eq!(admitted, 0, "a failure after the failover: {r:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("unexpected {other:?}: {r:?}"),
        }
        assert!(Instant::now() < deadline, "no failover within 30 s");
    }
    assert_eq!(admitted, 4, "10 in all: 6 before the failover, 4 after");
    assert_eq!(setup.master_port().await, setup.replica_port, "the replica was promoted");
    assert_ne!(setup.replica_port, old_master);
    server.stop().await.unwrap();
}
