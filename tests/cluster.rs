//! Redis Cluster: a real three-primary cluster started by the harness
//! (`redis-server --cluster-enabled yes` ×3 + `redis-cli --cluster create`).
//! Decisions are exact across slots, a killed primary only affects its own
//! slots (answered by policy), and once it is back the service decides
//! exactly again without a restart. Two instances sharing the cluster admit
//! exactly `limit × burst` under 64 concurrent callers. A rule with levels
//! keeps a decision's counters in its own slot.

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use common::{RedisCluster, Rules, TestServer, check, config, eventually, key_slot, reason, request};
use ratelimitd::{
    api::pb::{self, Reason, rate_limiter_client::RateLimiterClient},
    config::Config,
};
use tonic::transport::Channel;

fn cluster_config(rules: &Rules, cluster: &RedisCluster) -> Config {
    let mut config = config(&rules.path(), Some(cluster.url()));
    config.redis.connection.cluster = true;
    config
}

/// `n` users whose counters (`rl2:{user}:…`) live on node `node`.
fn users_on(cluster: &RedisCluster, node: usize, prefix: &str, n: usize) -> Vec<String> {
    let owners = cluster.slot_owners();
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|user| owners[usize::from(key_slot(&format!("rl2:{{{user}}}:cap")))] == node)
        .take(n)
        .collect()
}

/// A Redis store on `cluster`, its dispatchers in `dispatchers`. What its
/// tests check is where calls go, not how fast: a loaded machine's first
/// call on a node can take longer than the 10 ms decision timeout.
fn store_on(
    cluster: &RedisCluster,
    dispatchers: &mut tokio::task::JoinSet<()>,
) -> ratelimitd::limiter::Store {
    use ratelimitd::limiter::{RedisStore, Store, settings::RedisConfig};
    let config = RedisConfig {
        connection: ratelimitd::limiter::settings::Connection {
            url: Some(cluster.url()),
            cluster: true,
            ..Default::default()
        },
        timeout_ms: 5_000,
        ..RedisConfig::default()
    };
    Store::Redis(Arc::new(RedisStore::new(&config, dispatchers).unwrap()))
}

/// Sends `limit + 2` requests for `user` and asserts the exact sequence:
/// remaining counts down to 0, then two OVER_LIMIT.
async fn assert_exact(client: &mut RateLimiterClient<Channel>, user: &str, limit: u32) {
    for i in 0..limit + 2 {
        let r = check(client, request(user, "/cap")).await;
        if i < limit {
            assert_eq!(reason(&r), Reason::Ok, "{user} request {i}: {r:?}");
            assert_eq!(r.remaining_tokens, limit - i - 1, "{user} request {i}: {r:?}");
        } else {
            assert_eq!(reason(&r), Reason::OverLimit, "{user} request {i}: {r:?}");
            assert!(r.retry_after_ms > 0, "{r:?}");
        }
    }
}

/// Whether, within 10 s, a first request of one of `fresh_users` (a new
/// user for each try, all on the slots under test) is admitted by a real
/// decision rather than by the failure policy.
async fn exact_again(client: &RateLimiterClient<Channel>, fresh_users: &[String]) -> bool {
    let mut next = fresh_users.iter();
    eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        let user = next.next().expect("enough fresh users").clone();
        async move { reason(&check(&mut client, request(&user, "/cap")).await) == Reason::Ok }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_are_exact_across_slots_and_survive_a_primary_restart() {
    let mut cluster = RedisCluster::start();
    let rules = Rules::new(
        "rules:\n  - { rule_id: cap, resource_path: /cap, limit: 5, window_seconds: 3600, failure_policy: closed }\n",
    );
    let server = TestServer::start(cluster_config(&rules, &cluster)).await;
    let mut client = server.client().await;

    // Users on every node: each counter is exact, wherever its slot is.
    for node in 0..3 {
        for user in users_on(&cluster, node, "before", 4) {
            assert_exact(&mut client, &user, 5).await;
        }
    }
    for node in 0..3 {
        assert_eq!(cluster.keys_on(node), 4, "node {node} holds its users' counters");
    }

    // One primary killed: its slots are answered by the failure policy
    // (closed), the other primaries' slots stay exact.
    cluster.stop_node(1);
    // More failures in a row than `redis.breaker_failures`: the breaker is
    // cluster-wide and must not open because one primary is gone.
    for down in users_on(&cluster, 1, "down", 6) {
        let asked = Instant::now();
        let r = check(&mut client, request(&down, "/cap")).await;
        assert_eq!(reason(&r), Reason::FailClosed, "{r:?}");
        eprintln!("dead primary's slot: answered by policy in {} us", asked.elapsed().as_micros());
    }
    for node in [0, 2] {
        let user = users_on(&cluster, node, "during", 1).remove(0);
        assert_exact(&mut client, &user, 5).await;
    }

    // Back (empty, on its port): exact again, without restarting the service.
    let probe = users_on(&cluster, 1, "probe", 500);
    cluster.restart_node(1);
    let back = Instant::now();
    assert!(
        exact_again(&client, &probe).await,
        "decisions on the restarted primary's slots never became exact again"
    );
    eprintln!(
        "restarted primary: exact decisions again {} ms after it was healthy",
        back.elapsed().as_millis()
    );
    for user in users_on(&cluster, 1, "after", 3) {
        assert_exact(&mut client, &user, 5).await;
    }
    server.stop().await.unwrap();
}

/// Two service instances on one cluster, 64 concurrent callers split
/// between them, 8 users spread over the slots, each user offered far more
/// than its capacity: every user is admitted exactly `limit × burst`
/// (failure policy closed, so a failed decision could only under-admit;
/// none may fail). Prints the over- and under-admission per user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_admit_exactly_limit_times_burst_under_contention() {
    const CALLERS: usize = 64;
    const PER_CALLER: usize = 40;
    const USERS: usize = 8;
    const LIMIT: u64 = 50;
    const CAPACITY: usize = 60; // limit 50 × burst 1.2
    let cluster = RedisCluster::start();
    let rules = Rules::new(
        "rules:\n  - { rule_id: cap, resource_path: /cap, limit: 50, burst_capacity: 1.2, window_seconds: 3600, failure_policy: closed }\n",
    );
    let a = TestServer::start(cluster_config(&rules, &cluster)).await;
    let b = TestServer::start(cluster_config(&rules, &cluster)).await;
    let clients = [a.client().await, b.client().await];
    let users: Arc<Vec<String>> = Arc::new((0..USERS).map(|i| format!("contended-{i}")).collect());
    let nodes: std::collections::HashSet<usize> =
        users.iter().map(|u| cluster.node_of(&format!("rl2:{{{u}}}:cap"))).collect();
    assert!(nodes.len() >= 2, "the users should spread over several primaries: {nodes:?}");

    let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let started = Instant::now();
    let mut handles = Vec::new();
    for caller in 0..CALLERS {
        let mut client = clients[caller % 2].clone();
        let users = Arc::clone(&users);
        let barrier = Arc::clone(&barrier);
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut admitted = vec![0usize; USERS];
            let mut failed = 0;
            for i in 0..PER_CALLER {
                let user = (caller + i) % USERS;
                let r = check(&mut client, request(&users[user], "/cap")).await;
                match reason(&r) {
                    Reason::Ok => admitted[user] += 1,
                    Reason::OverLimit => {}
                    _ => failed += 1,
                }
            }
            (admitted, failed)
        }));
    }
    let mut admitted = vec![0usize; USERS];
    let mut failed = 0;
    for handle in handles {
        let (mine, my_failed) = handle.await.unwrap();
        for (total, n) in admitted.iter_mut().zip(mine) {
            *total += n;
        }
        failed += my_failed;
    }
    let elapsed = started.elapsed();
    let offered = CALLERS * PER_CALLER / USERS;
    eprintln!(
        "accuracy: 2 instances, {CALLERS} callers, {} decisions in {} ms; per user offered {offered}, capacity {CAPACITY} (limit {LIMIT} x 1.2)",
        CALLERS * PER_CALLER,
        elapsed.as_millis()
    );
    for (user, n) in users.iter().zip(&admitted) {
        let delta = *n as i64 - CAPACITY as i64;
        eprintln!("  {user}: admitted {n}, over/under-admission {delta:+}");
    }
    assert_eq!(failed, 0, "decisions that failed (answered by policy)");
    for (user, n) in users.iter().zip(&admitted) {
        assert!(*n <= CAPACITY, "{user} admitted {n} > limit x burst = {CAPACITY}");
        assert_eq!(*n, CAPACITY, "{user} under-admitted");
    }
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// Three primaries with a replica each: a primary killed under the service
/// is failed over to its replica by the cluster, and the service follows
/// (MOVED, slot map refresh) without a restart: decisions on the failed
/// primary's slots are exact again soon after the promotion. Prints how
/// long each step took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_primary_is_replaced_by_its_promoted_replica() {
    let mut cluster = RedisCluster::start_with_replicas(1);
    let rules = Rules::new(
        "rules:\n  - { rule_id: cap, resource_path: /cap, limit: 5, window_seconds: 3600, failure_policy: closed }\n",
    );
    let server = TestServer::start(cluster_config(&rules, &cluster)).await;
    let mut client = server.client().await;
    let owners = cluster.slot_owners();
    let mut primaries: Vec<usize> = owners.clone();
    primaries.sort_unstable();
    primaries.dedup();
    assert_eq!(primaries.len(), 3, "three primaries own the slots");
    for &node in &primaries {
        for user in users_on(&cluster, node, "before", 2) {
            assert_exact(&mut client, &user, 5).await;
        }
    }

    let victim = primaries[1];
    let probes = users_on(&cluster, victim, "after", 500);
    let killed = std::time::Instant::now();
    cluster.stop_node(victim);
    // The cluster notices (node timeout 1 s) and promotes the replica.
    let mut promoted = None;
    assert!(
        eventually(Duration::from_secs(20), || {
            let owner = cluster.slot_owners()[usize::from(key_slot(&format!("rl2:{{{}}}:cap", probes[0])))];
            promoted = (owner != victim && owner != usize::MAX).then_some(owner);
            std::future::ready(promoted.is_some())
        })
        .await,
        "no replica took over the killed primary's slots"
    );
    cluster.wait_healthy();
    let failed_over = killed.elapsed();
    let healthy = std::time::Instant::now();
    assert!(
        exact_again(&client, &probes).await,
        "decisions on the promoted replica's slots never became exact again"
    );
    eprintln!(
        "failover: replica promoted {} ms after the primary was killed; exact decisions {} ms after the cluster was healthy again",
        failed_over.as_millis(),
        healthy.elapsed().as_millis()
    );
    for user in users_on(&cluster, promoted.unwrap(), "promoted", 3) {
        assert_exact(&mut client, &user, 5).await;
    }
    server.stop().await.unwrap();
}

/// `CheckBatch` of `items` as (user, path), decided concurrently; answers
/// in item order.
async fn batch(client: &mut RateLimiterClient<Channel>, items: &[(&str, &str)]) -> Vec<(bool, u32)> {
    use ratelimitd::api::pb::{CheckBatchRequest, CheckItem};
    let items = items
        .iter()
        .enumerate()
        .map(|(id, (user, path))| CheckItem { id: id as u64, request: Some(request(user, path)) })
        .collect();
    let results = client.check_batch(CheckBatchRequest { items }).await.unwrap().into_inner().results;
    results
        .into_iter()
        .map(|r| {
            let r = r.response.expect("decided");
            assert!(matches!(reason(&r), Reason::Ok | Reason::OverLimit), "{r:?}");
            (r.allowed, r.remaining_tokens)
        })
        .collect()
}

/// Decisions on users all over the slots, queued together, go to Redis
/// in one script call per node, not one per slot: 600 decisions on 300
/// users (each on a slot of its own, mostly) cost far fewer than 300
/// calls, and every user is still counted exactly (limit 1: one of its
/// two items admitted, the other refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_decisions_go_in_one_call_per_node() {
    let cluster = RedisCluster::start();
    let rules = Rules::new(
        "rules:\n  - { rule_id: one, resource_path: /one, limit: 1, window_seconds: 3600, failure_policy: closed }\n",
    );
    let mut config = cluster_config(&rules, &cluster);
    config.redis.connections = 1;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let users: Vec<String> = (0..300).map(|i| format!("spread-{i}")).collect();
    let slots: std::collections::HashSet<u16> =
        users.iter().map(|u| key_slot(&format!("rl2:{{{u}}}:one"))).collect();
    assert!(slots.len() > 290, "the users spread over the slots: {}", slots.len());
    let items: Vec<(&str, &str)> = users.iter().chain(&users).map(|u| (u.as_str(), "/one")).collect();

    let before = cluster.script_calls();
    let answers = batch(&mut client, &items).await;
    let calls = cluster.script_calls() - before;
    for (i, user) in users.iter().enumerate() {
        let (first, second) = (answers[i], answers[i + users.len()]);
        assert_eq!(
            u32::from(first.0) + u32::from(second.0),
            1,
            "{user}: exactly one of two admitted: {first:?} {second:?}"
        );
    }
    eprintln!("{} decisions on {} slots over 3 primaries: {calls} script calls", items.len(), slots.len());
    assert!(
        calls <= 60,
        "{calls} script calls for {} decisions: batches are not grouped per node",
        items.len()
    );
    server.stop().await.unwrap();
}

/// A resharding moves a slot (and its counters) to another primary while
/// the service's slot map still says otherwise: the node refuses the
/// call before writing anything, the jobs go again per slot, and every
/// answer stays exact; the map is read again, and calls are per node again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_slot_map_costs_calls_never_a_wrong_answer() {
    let cluster = RedisCluster::start();
    let rules = Rules::new(
        "rules:\n  - { rule_id: cap, resource_path: /cap, limit: 5, window_seconds: 3600, failure_policy: closed }\n",
    );
    let mut config = cluster_config(&rules, &cluster);
    config.redis.connections = 1;
    // The probe reads the map at start only: it is stale when the batch comes.
    config.http.health_interval_ms = 600_000;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    // `moved` and `stays` on node 0, in different slots; `moved`'s slot
    // goes to node 1.
    let on_0 = users_on(&cluster, 0, "node0", 40);
    let slot_of = |user: &str| key_slot(&format!("rl2:{{{user}}}:cap"));
    let moved = on_0[0].as_str();
    let stays: Vec<&str> =
        on_0[1..].iter().map(String::as_str).filter(|u| slot_of(u) != slot_of(moved)).collect();
    for _ in 0..3 {
        assert!(check(&mut client, request(moved, "/cap")).await.allowed);
    }
    cluster.move_slot(slot_of(moved), 1);
    assert_eq!(cluster.keys_on(1), 1, "the counter moved with its slot");

    // One batch: 4 more for `moved` (2 left of 5) and one for each of the
    // others, grouped on node 0 by the stale map.
    let mut items: Vec<(&str, &str)> = vec![(moved, "/cap"); 4];
    items.extend(stays.iter().map(|u| (*u, "/cap")));
    let before = cluster.script_calls();
    let answers = batch(&mut client, &items).await;
    let calls = cluster.script_calls() - before;
    let slots: std::collections::HashSet<u16> = items.iter().map(|(u, _)| slot_of(u)).collect();
    eprintln!("stale map: {} decisions on {} slots: {calls} script calls", items.len(), slots.len());
    assert!(calls > slots.len() as u64, "the refused call, then one per slot: {calls}");
    let mut remaining: Vec<u32> = answers[..4].iter().filter(|a| a.0).map(|a| a.1).collect();
    remaining.sort_unstable();
    assert_eq!(remaining, [0, 1], "exactly 2 of the moved user's 4 admitted: {answers:?}");
    assert!(answers[4..].iter().all(|a| *a == (true, 4)), "{answers:?}");

    // The dispatcher read the map again: the next batch over node 1's
    // slots, the moved one among them, is one call again.
    let on_1 = users_on(&cluster, 1, "node1", 40);
    let mut items: Vec<(&str, &str)> = on_1.iter().map(|u| (u.as_str(), "/cap")).collect();
    items.push((moved, "/cap"));
    let before = cluster.script_calls();
    let answers = batch(&mut client, &items).await;
    let calls = cluster.script_calls() - before;
    assert!(answers[..on_1.len()].iter().all(|a| *a == (true, 4)), "{answers:?}");
    assert_eq!(answers[on_1.len()], (false, 0), "the moved user is over its limit");
    assert!(
        calls <= 3,
        "{calls} calls for {} decisions on one node after the map was read again",
        items.len()
    );
    server.stop().await.unwrap();
}

/// Adaptive limits over Redis Cluster: the exchange's one script call (its
/// keys in the `{adaptive}` slot) reaches the node serving that slot, and
/// two instances read back the limit their outcomes moved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_limits_are_exchanged_through_the_cluster() {
    let cluster = RedisCluster::start();
    let rules = Rules::new(
        "rules:\n  - { rule_id: backend, resource_path: /backend, limit: 100, window_seconds: 1, adaptive: { min: 10, max: 200, interval_ms: 100 } }\n",
    );
    let servers = [
        TestServer::start(cluster_config(&rules, &cluster)).await,
        TestServer::start(cluster_config(&rules, &cluster)).await,
    ];
    let mut client = servers[0].client().await;
    let failures = pb::RateLimitRequest {
        outcome: pb::Outcome::Failure as i32,
        weight: 10,
        ..request("svc", "/backend")
    };
    let series = "ratelimitd_adaptive_limit{kind=\"native\",rule=\"backend\"}";
    let lowered = || async {
        // A report weighs what its reporter was admitted: admitted first.
        let mut client = client.clone();
        client.check(pb::RateLimitRequest { weight: 10, ..request("svc", "/backend") }).await.unwrap();
        client.report(failures.clone()).await.unwrap();
        let limits = [common::metric(&servers[0], series).await, common::metric(&servers[1], series).await];
        limits.iter().all(|l| l.is_some_and(|l| l < 100.0))
    };
    assert!(eventually(Duration::from_secs(10), lowered).await, "both instances read the lowered limit");
    let answer = check(&mut client, request("svc", "/backend")).await;
    assert!(answer.limit < 100, "{answer:?}");
    let series = "ratelimitd_store_exchanges_total{exchange=\"adaptive\",result=\"failed\"}";
    assert_eq!(common::metric(&servers[0], series).await, Some(0.0), "no exchange failed");
    let series = "ratelimitd_store_exchanges_total{exchange=\"adaptive\",result=\"ok\"}";
    assert!(common::metric(&servers[0], series).await.is_some_and(|n| n > 0.0), "exchanges counted");
    for server in servers {
        server.stop().await.unwrap();
    }
}

/// A global limit's state lives in one hash slot of a coordination store
/// that is a Redis Cluster: one call of `lease.lua` per limit and region
/// covers every key of the limit, whichever node serves the limit's slot.
#[tokio::test]
async fn a_global_limits_keys_share_one_slot_of_a_coordination_cluster() {
    use ratelimitd::limiter::{
        RedisStore,
        lease::{GlobalLimit, KeyReport, Lease, Reporter, lease_key, memory_key, report},
        settings::RedisConfig,
    };
    let cluster = RedisCluster::start();
    let mut dispatchers = tokio::task::JoinSet::new();
    let config = RedisConfig {
        connection: ratelimitd::limiter::settings::Connection {
            url: Some(cluster.url()),
            cluster: true,
            ..Default::default()
        },
        ..RedisConfig::default()
    };
    let store = RedisStore::new(&config, &mut dispatchers).unwrap();
    let lease = Lease { lease_ms: 3_000, skew_ms: 500 };
    let keys: Vec<String> = (0..50).map(|i| format!("tenant-{i}")).collect();
    // Limits whose slots three different nodes are likely to serve.
    for id in ["checkout", "search", "upload"] {
        let limit = GlobalLimit { id, limit: 10_000, floors: &[100, 100], linger_ms: 2_000 };
        let reports: Vec<KeyReport> = keys
            .iter()
            .map(|key| KeyReport { key: key.clone(), enforcing: 100, admitted: 0, demand: 50_000 })
            .collect();
        let granted = report(
            &store,
            limit,
            Reporter { region: 0, deployment: "a" },
            lease,
            &reports,
            Duration::from_secs(2),
        )
        .await
        .unwrap();
        // A store new to the limit grows no grant for a lease and margin.
        assert_eq!(granted.grants, vec![100; keys.len()], "{id}: what the region enforces");
        let mut slots: std::collections::BTreeSet<u16> =
            keys.iter().map(|key| key_slot(&lease_key("", id, key))).collect();
        slots.insert(key_slot(&memory_key("", id)));
        slots.insert(key_slot(&format!("{}!claims", memory_key("", id))));
        assert_eq!(slots.len(), 1, "{id}: one slot for every key of the limit, its memory and its claims");
    }
    let held: u64 = (0..3).map(|node| cluster.keys_on(node)).sum();
    assert_eq!(held, 156, "every key of every limit, each limit's memory and claims, is stored once");
    drop(store);
    while dispatchers.join_next().await.is_some() {}
}

/// A group's counters listed from a cluster: `SCAN` goes to the primary
/// serving the group's slot, one group on each of the three primaries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_groups_counters_are_listed_from_the_node_serving_it() {
    use ratelimitd::limiter::{Algorithm, ManyItem, WindowParams};
    let cluster = RedisCluster::start();
    let owners = cluster.slot_owners();
    let mut dispatchers = tokio::task::JoinSet::new();
    let store = store_on(&cluster, &mut dispatchers);
    let groups: Vec<String> = (0..3)
        .map(|node| {
            (0..)
                .map(|i| format!("ns-{i}"))
                .find(|group| owners[usize::from(key_slot(&format!("rle2:{{{group}}}:k")))] == node)
                .unwrap()
        })
        .collect();
    for (n, group) in groups.iter().enumerate() {
        let params =
            WindowParams { window_ms: 60_000, capacity: 5, rate: 5, algorithm: Algorithm::FixedWindow };
        let items: Vec<ManyItem> =
            (0..=n).map(|i| ManyItem::admission(format!("60|user={i}"), params)).collect();
        assert!(store.decide_many(group, &items).await.unwrap().committed);
    }
    for (n, group) in groups.iter().enumerate() {
        let mut listed = store.list(group, "", 100).await.unwrap();
        listed.keys.sort();
        let expected: Vec<String> = (0..=n).map(|i| format!("60|user={i}")).collect();
        assert_eq!(listed.keys, expected, "{group}, on node {n}");
        assert!(listed.complete);
    }
    drop(store);
    while dispatchers.join_next().await.is_some() {}
}

/// A rule with levels on a Redis Cluster: keys whose own counters would
/// live on three different primaries share their team's budget, decided
/// in one step in the rule's slot (`{~<rule id>}`): the team's limit binds
/// across them, exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_teams_budget_binds_across_keys_of_every_node() {
    let cluster = RedisCluster::start();
    let rules = Rules::new(
        "rules:\n  - { rule_id: llm, resource_path: /llm, limit: 4, window_seconds: 3600, failure_policy: closed, levels: { team: x-team }, also: [ { limit: 6, window_seconds: 3600, level: team } ] }\n",
    );
    let server = TestServer::start(cluster_config(&rules, &cluster)).await;
    let mut client = server.client().await;
    let keys: Vec<String> = (0..3).flat_map(|node| users_on(&cluster, node, "key", 1)).collect();
    let mut answers = Vec::new();
    for key in keys.iter().cycle().take(9) {
        let mut req = request(key, "/llm");
        req.headers.insert("x-team".to_owned(), "search".to_owned());
        let r = check(&mut client, req).await;
        answers.push((r.allowed, r.level));
    }
    let admitted = answers.iter().filter(|(allowed, _)| *allowed).count();
    assert_eq!(admitted, 6, "the team's 6, over keys on three primaries: {answers:?}");
    assert!(answers[6..].iter().all(|(allowed, level)| !allowed && level == "team"), "{answers:?}");
    let owner = cluster.slot_owners()[usize::from(key_slot("rle2:{~llm}:#llm/1/search"))];
    for node in 0..3 {
        let held = if node == owner { 4 } else { 0 };
        assert_eq!(cluster.keys_on(node), held, "the team's counter and three keys', in the rule's slot");
    }
}

/// A settlement on a Redis Cluster: its claim and its refund, one job in
/// the group's slot (an Envoy domain's, a leveled rule's), counted once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settlement_and_its_claim_are_one_job_in_the_groups_slot() {
    use ratelimitd::limiter::{Algorithm, Count, ManyItem, Shares, WindowParams};
    let cluster = RedisCluster::start();
    let mut dispatchers = tokio::task::JoinSet::new();
    let store = store_on(&cluster, &mut dispatchers);
    let params =
        WindowParams { window_ms: 3_600_000, capacity: 100, rate: 100, algorithm: Algorithm::FixedWindow };
    let reserved = ManyItem { weight: 80, ..ManyItem::admission("3600|budget_key=k", params) };
    let outcome = store.decide_many("llm", std::slice::from_ref(&reserved)).await.unwrap();
    let window = reserved.window_at(outcome.now_ms);
    let claim_params =
        WindowParams { window_ms: 600_000, capacity: 1, rate: 1, algorithm: Algorithm::FirstHitWindow };
    let job = [
        ManyItem::admission("~settled/00000000000000aa", claim_params),
        ManyItem { weight: 50, count: Count::Always, refund: Some(window), ..reserved.clone() },
    ];
    let shares = Shares { caller: None, tenant: None };
    assert!(store.decide_job_in(shares, "llm", &job).await.unwrap().committed);
    assert!(!store.decide_job_in(shares, "llm", &job).await.unwrap().committed, "settled once");
    let peek = ManyItem { weight: 1, count: Count::Never, ..reserved };
    let left = store.decide_many("llm", &[peek]).await.unwrap().verdicts[0].remaining;
    assert_eq!(left, 70, "80 reserved, 50 given back once");
    drop(store);
    while dispatchers.join_next().await.is_some() {}
}
