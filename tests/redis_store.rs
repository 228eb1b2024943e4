//! Black-box tests of what only the Redis store has: the key layout, the
//! script called by SHA, sharing one Redis between instances, pipelining on
//! few connections, and answering by failure policy when Redis goes away.

mod common;

use std::time::{Duration, Instant};

use common::{RedisServer, Rules, TestServer, check, config, eventually, reason, request};
use ratelimitd::api::pb::Reason;
use redis::AsyncCommands;

const RULES: &str = r#"
rules:
  - { rule_id: hot, resource_path: /hot, limit: 100, window_seconds: 86400 }
  - { rule_id: open, resource_path: /open, limit: 1000, window_seconds: 86400, failure_policy: open }
  - { rule_id: closed, resource_path: /closed, limit: 1000, window_seconds: 86400, failure_policy: closed }
"#;

/// One hash per (user, rule) at `rl:{user}:rule`, with the window index,
/// the two counts and a TTL of two windows; denied requests write nothing.
#[tokio::test]
async fn counters_are_hashes_with_a_two_window_ttl() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let server = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let mut client = server.client().await;
    let mut weighted = request("kim", "/hot");
    weighted.weight = 7;
    check(&mut client, weighted).await;

    let mut conn = redis.client().await;
    let fields: std::collections::HashMap<String, u64> = conn.hgetall("rl:{kim}:hot").await.unwrap();
    assert_eq!(fields["c"], 7);
    assert_eq!(fields["p"], 0);
    let now_ms = u64::try_from(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis(),
    )
    .unwrap();
    assert!(fields["w"].abs_diff(now_ms / 86_400_000) <= 1, "{fields:?}");
    let ttl: i64 = conn.pttl("rl:{kim}:hot").await.unwrap();
    assert!(ttl > 0 && ttl <= 2 * 86_400_000, "ttl {ttl}");

    let mut too_heavy = request("lee", "/hot");
    too_heavy.weight = 101;
    check(&mut client, too_heavy).await;
    let exists: bool = conn.exists("rl:{lee}:hot").await.unwrap();
    assert!(!exists, "a never-admissible request must not touch Redis");
    server.stop().await.unwrap();
}

/// The script is called by SHA; after SCRIPT FLUSH it is reloaded on NOSCRIPT
/// and decisions stay exact.
#[tokio::test]
async fn script_is_reloaded_after_script_flush() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let server = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let mut client = server.client().await;

    assert_eq!(check(&mut client, request("max", "/hot")).await.remaining_tokens, 99);
    let mut conn = redis.client().await;
    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.unwrap();
    let r = check(&mut client, request("max", "/hot")).await;
    assert_eq!(reason(&r), Reason::Ok);
    assert_eq!(r.remaining_tokens, 98);

    // The script is loaded at startup, so only the decision after the flush
    // meets NOSCRIPT: 2 decisions + 1 retry, 1 failed.
    let evalsha = redis.info_field("commandstats", "cmdstat_evalsha").await.expect("EVALSHA used");
    assert!(evalsha.starts_with("calls=3,"), "{evalsha}");
    assert!(evalsha.ends_with("failed_calls=1"), "{evalsha}");
    assert!(redis.info_field("commandstats", "cmdstat_eval").await.is_none(), "never plain EVAL");
    server.stop().await.unwrap();
}

/// Two service instances sharing one Redis admit exactly the limit in total.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_sharing_one_redis_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let a = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let b = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let clients = [a.client().await, b.client().await];
    let admitted = common::hammer(&clients, 64, 4, "/hot").await;
    assert_eq!(admitted, 100);
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// 64 concurrent decisions share one connection (pipelined), rather than
/// each needing a connection or waiting for the others' round trips.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_decisions_are_pipelined_on_one_connection() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.connections = 1;
    let server = TestServer::start(cfg).await;
    let client = server.client().await;
    // One real decision first: the listener accepts TCP before the server
    // has finished starting (and opened its Redis connection).
    assert_eq!(reason(&check(&mut client.clone(), request("warm-up", "/hot")).await), Reason::Ok);
    let connections = || async { redis.info_field("stats", "total_connections_received").await.unwrap() };
    let before: u64 = connections().await.parse().unwrap();
    let admitted = common::hammer(&[client], 64, 4, "/hot").await;
    assert_eq!(admitted, 100);
    let after: u64 = connections().await.parse().unwrap();
    // The only new connection is the one `info_field` itself opened: the
    // service decided 256 concurrent requests on the connection it had.
    assert_eq!(after - before, 1, "the service opened {} connections", after - before - 1);
    server.stop().await.unwrap();
}

/// With Redis gone, fail-open rules allow (FAIL_OPEN) and fail-closed rules
/// deny (FAIL_CLOSED), each within the configured timeout; when Redis comes
/// back, exact decisions resume without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_outage_answers_by_failure_policy_then_recovers() {
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 100;
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    assert_eq!(reason(&check(&mut client, request("ned", "/open")).await), Reason::Ok);

    redis.stop();
    for _ in 0..5 {
        let started = Instant::now();
        let open = check(&mut client, request("ned", "/open")).await;
        assert!(open.allowed);
        assert_eq!(reason(&open), Reason::FailOpen);
        let closed = check(&mut client, request("ned", "/closed")).await;
        assert!(!closed.allowed);
        assert_eq!(reason(&closed), Reason::FailClosed);
        assert!(closed.retry_after_ms > 0, "{closed:?}");
        // Two calls, each bounded by the 100 ms store deadline; the bound
        // here is loose on purpose, it only rules out hanging on a client default.
        assert!(started.elapsed() < Duration::from_secs(2), "{:?}", started.elapsed());
    }

    redis.restart();
    let recovered = eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move { reason(&check(&mut client, request("ned", "/open")).await) == Reason::Ok }
    })
    .await;
    assert!(recovered, "decisions did not resume after Redis came back");
    // The restarted Redis is empty: counting starts again, exactly.
    let r = check(&mut client, request("oli", "/open")).await;
    assert_eq!((reason(&r), r.remaining_tokens), (Reason::Ok, 999));
    server.stop().await.unwrap();
}

/// Starting while Redis is down is not fatal: decisions follow the policy
/// until Redis answers.
#[tokio::test]
async fn service_starts_while_redis_is_down() {
    let mut redis = RedisServer::start();
    redis.stop();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 100;
    cfg.redis.connect_timeout_ms = 100;
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    assert_eq!(reason(&check(&mut client, request("pat", "/closed")).await), Reason::FailClosed);
    redis.restart();
    let recovered = eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move { reason(&check(&mut client, request("pat", "/closed")).await) == Reason::Ok }
    })
    .await;
    assert!(recovered);
    server.stop().await.unwrap();
}

/// Shutdown stops accepting but lets in-flight calls finish: calls stuck on
/// a paused Redis when the shutdown begins still get real decisions.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_finishes_in_flight_calls() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 5_000;
    let server = TestServer::start(cfg).await;
    let client = server.client().await;
    assert_eq!(reason(&check(&mut client.clone(), request("quinn", "/hot")).await), Reason::Ok);

    // Hold every Redis command for 600 ms, then start 16 calls.
    let mut conn = redis.client().await;
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(600).arg("ALL").query_async(&mut conn).await.unwrap();
    let paused_at = Instant::now();
    let in_flight: Vec<_> = (0..16)
        .map(|_| {
            let mut client = client.clone();
            tokio::spawn(async move { client.check(request("quinn", "/hot")).await })
        })
        .collect();
    // Give the calls time to reach the (paused) store before shutting down.
    tokio::time::sleep(Duration::from_millis(150)).await;
    server.stop().await.unwrap();
    assert!(paused_at.elapsed() >= Duration::from_millis(600), "shutdown did not wait for in-flight calls");
    for call in in_flight {
        let response = call.await.unwrap().expect("in-flight call failed during shutdown").into_inner();
        assert_eq!(reason(&response), Reason::Ok, "{response:?}");
    }
}

/// A Redis that is up but does not answer within `redis.timeout_ms` (here:
/// paused) is a failure too: answered by policy once the deadline passes,
/// not when Redis finally answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn slow_redis_answers_by_failure_policy_at_the_deadline() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 50;
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    assert_eq!(reason(&check(&mut client, request("rae", "/open")).await), Reason::Ok);

    let mut conn = redis.client().await;
    let _: () = redis::cmd("CLIENT").arg("PAUSE").arg(1_000).arg("ALL").query_async(&mut conn).await.unwrap();
    let started = Instant::now();
    let open = check(&mut client, request("rae", "/open")).await;
    let closed = check(&mut client, request("rae", "/closed")).await;
    let elapsed = started.elapsed();
    assert_eq!((open.allowed, reason(&open)), (true, Reason::FailOpen));
    assert_eq!((closed.allowed, reason(&closed)), (false, Reason::FailClosed));
    // Two 50 ms deadlines; well under the 1 s pause they would otherwise wait out.
    assert!(elapsed < Duration::from_millis(900), "answers waited for Redis: {elapsed:?}");
    server.stop().await.unwrap();
}
