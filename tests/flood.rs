//! Floods that used to turn limits off: a Redis saturated by batches of
//! distinct keys (its calls missing the production deadline), and a full
//! in-memory store. Whatever the store does, a victim and an attacker stay
//! within the limit plus the documented local share (one instance: the
//! limit again), and every answer the store did not make is flagged.

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use common::{RedisServer, Rules, TestServer, check, config, reason, request};
use ratelimitd::{
    api::pb::{self, CheckBatchRequest, CheckItem, Reason, rate_limiter_client::RateLimiterClient},
    config::RedisConfig,
};
use tonic::transport::Channel;

const RULES: &str = r#"
rules:
  - { rule_id: flood, resource_path: /flood, limit: 100000000, window_seconds: 3600 }
  - { rule_id: victim, resource_path: /victim, limit: 2, window_seconds: 60 }
  - { rule_id: hourly, resource_path: /hourly, limit: 5, window_seconds: 3600 }
"#;

/// A batch of `n` items on `path`: user `user(i)` each.
fn batch(n: usize, path: &str, user: impl Fn(usize) -> String) -> CheckBatchRequest {
    let items = (0..n).map(|i| CheckItem { id: i as u64, request: Some(request(&user(i), path)) }).collect();
    CheckBatchRequest { items }
}

fn admitted(results: &[pb::CheckResult]) -> u64 {
    results.iter().filter(|r| r.response.as_ref().is_some_and(|r| r.allowed)).count() as u64
}

/// Four clients (a connection each) send CheckBatch calls of 1,024 distinct
/// 200-byte users on one rule as fast as they can, at the production
/// deadline; meanwhile a victim calls every 10 ms on a rule of 2 a minute,
/// and an attacker batches its own key on that rule. Each is admitted at
/// most 2 by the store plus 2 by the local limiter. Prints the victim's
/// latency and how many of its answers were local.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_redis_never_lifts_a_limit() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = RedisConfig::default().timeout_ms;
    let server = TestServer::start(cfg).await;
    let running = Arc::new(AtomicBool::new(true));
    let flooded = Arc::new(AtomicU64::new(0));
    let mut flooders = Vec::new();
    for flooder in 0..4 {
        let (running, flooded) = (Arc::clone(&running), Arc::clone(&flooded));
        let mut client = server.client().await;
        flooders.push(tokio::spawn(async move {
            let mut round = 0;
            while running.load(Ordering::Relaxed) {
                let flood = batch(1_024, "/flood", |i| format!("{flooder}-{round}-{i}-{}", "x".repeat(180)));
                let results =
                    client.check_batch(flood).await.expect("a batch is answered").into_inner().results;
                flooded.fetch_add(results.len() as u64, Ordering::Relaxed);
                round += 1;
            }
        }));
    }
    let attacker = {
        let running = Arc::clone(&running);
        let mut client = server.client().await;
        tokio::spawn(async move {
            let (mut admitted_total, mut local) = (0, 0);
            while running.load(Ordering::Relaxed) {
                let own = batch(64, "/victim", |_| "attacker".to_owned());
                let results =
                    client.check_batch(own).await.expect("a batch is answered").into_inner().results;
                admitted_total += admitted(&results);
                local += results
                    .iter()
                    .filter(|r| r.response.as_ref().is_some_and(|r| !r.store_error.is_empty()))
                    .count();
            }
            (admitted_total, local)
        })
    };

    let mut victim = server.client().await;
    let (mut victim_admitted, mut victim_local, mut latencies) = (0, 0, Vec::new());
    for _ in 0..300 {
        let started = Instant::now();
        let answer = check(&mut victim, request("victim", "/victim")).await;
        latencies.push(started.elapsed());
        victim_admitted += u64::from(answer.allowed);
        if !answer.store_error.is_empty() {
            victim_local += 1;
            assert!(matches!(reason(&answer), Reason::LocalOk | Reason::LocalOverLimit), "{answer:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.store(false, Ordering::Relaxed);
    for flooder in flooders {
        flooder.await.unwrap();
    }
    let (attacker_admitted, attacker_local) = attacker.await.unwrap();
    latencies.sort();
    let p = |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize];
    eprintln!(
        "flood of {} distinct-key decisions: victim admitted {victim_admitted} of 300 ({victim_local} answered locally), \
         p50 {:?} p99 {:?} max {:?}; attacker admitted {attacker_admitted} ({attacker_local} local answers)",
        flooded.load(Ordering::Relaxed),
        p(0.5),
        p(0.99),
        latencies.last().unwrap()
    );
    assert!(victim_admitted <= 4, "the victim's limit of 2 a minute admitted {victim_admitted}");
    assert!(attacker_admitted <= 4, "the attacker's own key admitted {attacker_admitted}");
    server.stop().await.unwrap();
}

/// The in-memory store full of a flood's counters that still count (one
/// shard of 2,000; 6,144 distinct keys): a new user on a rule of 5 an hour
/// is decided by the store, never failed: admitted 5 (4 when the summary of
/// evicted keys takes it for one of them: it then starts at a flooded
/// key's share, rounded up to one hit), then over;
/// a user counted before the flood keeps its count whether or not its
/// counter was evicted; no decision fails, so nothing is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_memory_store_admits_newcomers_and_keeps_existing_counts() {
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), None);
    cfg.memory.shards = 1;
    cfg.memory.max_counters = 2_000;
    cfg.local.max_counters = 3_000;
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    for _ in 0..5 {
        assert_eq!(reason(&check(&mut client, request("early", "/hourly")).await), Reason::Ok);
    }
    let flood = |round: usize| batch(1_024, "/flood", move |i| format!("{round}-{i}"));
    for round in 0..6 {
        let results = client.check_batch(flood(round)).await.unwrap().into_inner().results;
        assert_eq!(admitted(&results), 1_024, "the flood's own keys are counted");
    }

    for user in ["late", "latest"] {
        let mut answers = Vec::new();
        for _ in 0..7 {
            let answer = check(&mut client, request(user, "/hourly")).await;
            assert_eq!(answer.store_error, "", "{answer:?}");
            answers.push(reason(&answer));
        }
        let ok = answers.iter().filter(|r| **r == Reason::Ok).count();
        assert!((4..=5).contains(&ok), "{user}: {answers:?}");
        assert!(answers[ok..].iter().all(|r| *r == Reason::OverLimit), "{user}: {answers:?}");
    }
    let early = check(&mut client, request("early", "/hourly")).await;
    assert_eq!((reason(&early), early.store_error.as_str()), (Reason::OverLimit, ""), "kept by the store");
    let evicted =
        common::metric(&server, "ratelimitd_memory_live_evictions_total ").await.expect("the eviction count");
    assert!(evicted >= 6.0 * 1_024.0 - 2_000.0, "{evicted} live counters evicted");

    let records = server.stop_and_read_dlq().await;
    assert!(records.is_empty(), "{} failures recorded", records.len());
}

/// Each tenant's share of the store's in-flight calls, with the store held
/// still: Redis paused (`CLIENT PAUSE ... WRITE` holds every script call),
/// twelve calls of tenants the table does not name, on two connections,
/// find the shared share of 4 (8 of them wait), while acme's four calls, on
/// the same connections, find acme's own share free (none waits). When
/// Redis answers again every call is decided by the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_waits_for_its_own_share_of_the_store() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(&tenants, "tenants:\n  - { name: acme }\n").unwrap();
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 10_000;
    cfg.grpc.max_store_calls_per_tenant = 4;
    cfg.overload.tenants_path = Some(tenants);
    let server = TestServer::start(cfg).await;
    let clients = [server.client().await, server.client().await];
    // One call first: the dispatchers' connections are open before the pause.
    assert_eq!(check(&mut clients[0].clone(), request("warm", "/flood")).await.store_error, "");

    let calls = (0..16)
        .map(|i| {
            // acme:0..3, then 12 of other tenants (one claiming no tenant).
            let user = match i {
                0..4 => format!("acme:{i}"),
                4 => "no-tenant".to_owned(),
                _ => format!("tenant{i}:user"),
            };
            (clients[i % 2].clone(), user)
        })
        .collect();
    all_decided_by_the_store_past_a_pause(&redis, calls).await;
    assert_eq!(
        waits(&server, "tenant").await,
        Some(8.0),
        "12 calls of the others on a share of 4; acme's 4 never wait"
    );
    assert_eq!(waits(&server, "connection").await, Some(0.0));
    server.stop().await.unwrap();
}

/// Pauses `redis`'s writes for 2 s, makes each of `calls` (a client and a
/// user checking `/flood`) meanwhile, and checks that each was decided by
/// the store once it answered.
async fn all_decided_by_the_store_past_a_pause(
    redis: &RedisServer,
    calls: Vec<(RateLimiterClient<Channel>, String)>,
) {
    let mut admin = redis.client().await;
    let () = redis::cmd("CLIENT").arg("PAUSE").arg(2_000).arg("WRITE").query_async(&mut admin).await.unwrap();
    let calls: Vec<_> = calls
        .into_iter()
        .map(|(mut client, user)| {
            tokio::spawn(async move { check(&mut client, request(&user, "/flood")).await })
        })
        .collect();
    for call in calls {
        let answer = call.await.unwrap();
        assert_eq!((reason(&answer), answer.store_error.as_str()), (Reason::Ok, ""), "{answer:?}");
    }
}

/// Store calls that waited for `share` (`ratelimitd_store_call_waits_total`).
async fn waits(server: &TestServer, share: &str) -> Option<f64> {
    common::metric(server, &format!("ratelimitd_store_call_waits_total{{share=\"{share}\"}} ")).await
}

/// Each address's share of the store's in-flight calls, with the store
/// held still: twelve calls from one address over two connections find
/// its share of 4 (8 of them wait), while four calls from another address
/// find its own share free (none waits): more connections take no more of
/// the store. When Redis answers again every call is decided by the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_waits_for_its_own_share_of_the_store() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.redis.timeout_ms = 10_000;
    cfg.grpc.max_store_calls_per_peer = 4;
    let server = TestServer::start(cfg).await;
    let flooder = [server.client_from("127.0.0.2").await, server.client_from("127.0.0.2").await];
    let other = server.client_from("127.0.0.3").await;
    assert_eq!(check(&mut other.clone(), request("warm", "/flood")).await.store_error, "");

    let calls = (0..16)
        .map(|i| (if i < 12 { flooder[i % 2].clone() } else { other.clone() }, format!("user{i}")))
        .collect();
    all_decided_by_the_store_past_a_pause(&redis, calls).await;
    assert_eq!(
        waits(&server, "peer").await,
        Some(8.0),
        "12 calls of one address on a share of 4; the other's 4 never wait"
    );
    assert_eq!(waits(&server, "connection").await, Some(0.0));
    server.stop().await.unwrap();
}
