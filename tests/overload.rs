//! The overload layer and the denial cache, black-box: several service
//! instances on one real Redis, open-loop load through gRPC.

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use common::{RedisServer, Rules, TestServer, config, http_get, reason, request};
use ratelimitd::api::pb;
use ratelimitd::api::pb::rate_limiter_client::RateLimiterClient;
use std::sync::Mutex;
use tonic::transport::Channel;

/// One answer: ms since the load started, and its reason.
type Answers = Arc<Mutex<Vec<(u64, pb::Reason)>>>;

/// Sends `per_second` Check requests a second to `client` for `seconds`,
/// open loop (each request on its own task, paced every 10 ms), users
/// `<tenant>:u<n>`; answers land in `answers` stamped from `origin`.
async fn offer(
    client: RateLimiterClient<Channel>,
    tenant: &'static str,
    per_second: u64,
    seconds: f64,
    origin: Instant,
    answers: Answers,
) {
    let per_tick = per_second / 100;
    let mut ticker = tokio::time::interval(Duration::from_millis(10));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let ticks = (seconds * 100.0) as u64;
    let mut tasks = tokio::task::JoinSet::new();
    for tick in 0..ticks {
        ticker.tick().await;
        for i in 0..per_tick {
            let mut client = client.clone();
            let answers = Arc::clone(&answers);
            tasks.spawn(async move {
                let r = client.check(request(&format!("{tenant}:u{}", tick * per_tick + i), "/hot")).await;
                let r = r.expect("Check failed").into_inner();
                answers.lock().unwrap().push((origin.elapsed().as_millis() as u64, reason(&r)));
            });
        }
    }
    while tasks.join_next().await.is_some() {}
}

/// Answers with `reason` between `from` and `to` ms, per second.
async fn rate(answers: &Answers, reason: pb::Reason, from: u64, to: u64) -> f64 {
    let n = answers.lock().unwrap().iter().filter(|(at, r)| (from..to).contains(at) && *r == reason).count();
    n as f64 * 1_000.0 / (to - from) as f64
}

/// Runs `ratelimitd <args>` against `redis`; its standard output.
fn switch(redis: &RedisServer, args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_ratelimitd"))
        .args(args)
        .env("RATELIMITD__REDIS__URL", redis.url())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The share of answers between `from` and `to` ms that are OVERLOAD.
async fn share(answers: &Answers, from: u64, to: u64) -> f64 {
    let dropped = rate(answers, pb::Reason::Overload, from, to).await;
    let all = answers.lock().unwrap().iter().filter(|(at, _)| (from..to).contains(at)).count() as f64
        * 1_000.0
        / (to - from) as f64;
    dropped / all.max(1.0)
}

const RULES: &str = "rules:\n  - { rule_id: hot, resource_path: /hot, limit: 1000000000, window_seconds: 1, overload: { rate_per_second: 300 } }\n";

/// Three instances offered 3× a bucket's global rate: the admitted rate,
/// all instances together, settles within ±5% of the rate within 2 s, and
/// when the offered load falls under it, nothing is dropped within 2 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_converge_on_the_global_rate_and_recover() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(TestServer::start(config(&rules.path(), Some(redis.url()))).await);
    }
    let mut clients = Vec::new();
    for server in &servers {
        clients.push(server.client().await);
    }
    let answers: Answers = Arc::default();
    let origin = Instant::now();
    // 3 × 300/s for 4.5 s, then 3 × 60/s for 3 s.
    let high = clients.iter().map(|c| offer(c.clone(), "t", 300, 4.5, origin, Arc::clone(&answers)));
    futures_util::future::join_all(high).await;
    let fell_at = origin.elapsed().as_millis() as u64;
    let low = clients.iter().map(|c| offer(c.clone(), "t", 60, 3.0, origin, Arc::clone(&answers)));
    futures_util::future::join_all(low).await;

    let answered = answers.lock().unwrap().clone();
    assert!(
        answered.iter().all(|(_, r)| matches!(r, pb::Reason::Ok | pb::Reason::Overload)),
        "only OK and OVERLOAD"
    );
    let admitted = rate(&answers, pb::Reason::Ok, 2_000, 4_500).await;
    let offered = admitted + rate(&answers, pb::Reason::Overload, 2_000, 4_500).await;
    assert!(offered > 850.0, "the generator kept up: {offered}/s");
    assert!((285.0..=315.0).contains(&admitted), "admitted {admitted}/s (offered {offered}/s)");
    let dropped_after = rate(&answers, pb::Reason::Overload, fell_at + 2_000, fell_at + 3_000).await;
    assert_eq!(dropped_after, 0.0, "still dropping 2 s after the load fell");

    let (_, metrics) = tokio::task::spawn_blocking({
        let addr = servers[0].http_addr;
        move || http_get(addr, "/metrics")
    })
    .await
    .unwrap();
    assert!(
        metrics.contains("ratelimitd_overload_requests_total{kind=\"native\",bucket=\"hot\",tenant=\"*\",result=\"dropped\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ratelimitd_decisions_total{api=\"check\",rule=\"hot\",reason=\"OVERLOAD\""),
        "{metrics}"
    );
    for server in servers {
        server.stop().await.unwrap();
    }
}

/// Tenant weights: a paying tenant (4.0) and a free one (0.25) each
/// offering the whole rate: the free tier is dropped first and cannot
/// crowd out the paying one; together they still get the rate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weights_protect_the_paying_tenant() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(&tenants, "tenants:\n  - { name: paid, weight: 4.0 }\n  - { name: free, weight: 0.25 }\n")
        .unwrap();
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.overload.tenants_path = Some(tenants.clone());
    let server = TestServer::start(cfg).await;
    let client = server.client().await;
    let answers_paid: Answers = Arc::default();
    let answers_free: Answers = Arc::default();
    let origin = Instant::now();
    tokio::join!(
        offer(client.clone(), "paid", 300, 3.5, origin, Arc::clone(&answers_paid)),
        offer(client.clone(), "free", 300, 3.5, origin, Arc::clone(&answers_free)),
    );
    let paid = rate(&answers_paid, pb::Reason::Ok, 2_000, 3_500).await;
    let free = rate(&answers_free, pb::Reason::Ok, 2_000, 3_500).await;
    // Solved: the paying tenant drops d/4, the free one 4d, d = 1/4.25.
    assert!(paid > 250.0, "paid admitted {paid}/s, free {free}/s");
    assert!(free < 60.0, "paid admitted {paid}/s, free {free}/s");
    assert!((270.0..=330.0).contains(&(paid + free)), "paid {paid}/s + free {free}/s");
    server.stop().await.unwrap();
}

/// The cluster-wide switch flips every instance within an interval, and
/// a cut feed (Redis gone) changes nothing but the directive's age: the
/// last ratio keeps dropping (and exact counting fails open as ever).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_switch_flips_instances_and_a_cut_feed_keeps_the_ratio() {
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let a = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let b = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let answers: Answers = Arc::default();
    let origin = Instant::now();
    tokio::join!(
        offer(ca.clone(), "t", 450, 2.5, origin, Arc::clone(&answers)),
        offer(cb.clone(), "t", 450, 2.5, origin, Arc::clone(&answers)),
    );
    let dropping = share(&answers, 1_500, 2_500).await;
    assert!((0.55..0.8).contains(&dropping), "dropping {dropping} of 900/s against 300/s");

    // The switch: both instances stop refusing within one interval (plus
    // the one they read behind).
    assert!(switch(&redis, &["overload", "shadow"]).contains("overload mode switch: shadow"));
    assert!(switch(&redis, &["overload"]).contains("overload mode switch: shadow"));
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let shadow: Answers = Arc::default();
    let origin = Instant::now();
    tokio::join!(
        offer(ca.clone(), "t", 450, 1.0, origin, Arc::clone(&shadow)),
        offer(cb.clone(), "t", 450, 1.0, origin, Arc::clone(&shadow)),
    );
    assert_eq!(rate(&shadow, pb::Reason::Overload, 0, 1_000).await, 0.0, "shadow refuses nothing");
    assert!(switch(&redis, &["overload", "clear"]).contains("unset"));
    tokio::time::sleep(Duration::from_millis(1_100)).await;

    // Converged and enforcing again; then the feed is cut for 3 s.
    let warm: Answers = Arc::default();
    let origin = Instant::now();
    tokio::join!(
        offer(ca.clone(), "t", 450, 2.5, origin, Arc::clone(&warm)),
        offer(cb.clone(), "t", 450, 2.5, origin, Arc::clone(&warm)),
    );
    let before = share(&warm, 1_500, 2_500).await;
    redis.stop();
    let cut: Answers = Arc::default();
    let origin = Instant::now();
    tokio::join!(
        offer(ca.clone(), "t", 450, 3.0, origin, Arc::clone(&cut)),
        offer(cb.clone(), "t", 450, 3.0, origin, Arc::clone(&cut)),
    );
    let during = share(&cut, 0, 3_000).await;
    assert!((during - before).abs() < 0.08, "dropped {before} before the cut, {during} during");
    let (_, metrics) = tokio::task::spawn_blocking({
        let addr = a.http_addr;
        move || http_get(addr, "/metrics")
    })
    .await
    .unwrap();
    let age: f64 = metrics
        .lines()
        .find_map(|l| {
            l.strip_prefix("ratelimitd_overload_directive_age_seconds{kind=\"native\",bucket=\"hot\"} ")
        })
        .expect("the age is exposed")
        .parse()
        .unwrap();
    assert!(age >= 2.5, "age {age}");
    assert!(metrics.contains("ratelimitd_store_exchange_failing{exchange=\"overload\"} 1"), "{metrics}");
    let failed = metrics.lines().find_map(|l| {
        l.strip_prefix("ratelimitd_store_exchanges_total{exchange=\"overload\",result=\"failed\"} ")
    });
    assert!(failed.is_some_and(|n| n.parse::<u64>().unwrap() >= 2), "{metrics}");
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// The denial cache never admits more than exact counting: two instances
/// on one Redis, 64 callers on one counter for 3 s across fixed windows of
/// a second with a limit of 30: every window admits at most 30 (and, kept
/// busy, exactly 30), while most denials are answered without Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_denial_cache_never_admits_more_than_exact_counting() {
    let redis = RedisServer::start();
    let rules = Rules::new(
        "rules:\n  - { rule_id: tight, resource_path: /tight, limit: 30, window_seconds: 1, algorithm: fixed_window }\n",
    );
    let a = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let b = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let clients = [a.client().await, b.client().await];
    // (sent, answered) in epoch ms, of each admitted request.
    let admitted: Arc<Mutex<Vec<(u128, u128)>>> = Arc::default();
    let epoch_ms = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let deadline = Instant::now() + Duration::from_millis(3_000);
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..64 {
        let mut client = clients[task % 2].clone();
        let admitted = Arc::clone(&admitted);
        tasks.spawn(async move {
            while Instant::now() < deadline {
                let sent = epoch_ms();
                let r = client.check(request("hot", "/tight")).await.unwrap().into_inner();
                assert!(matches!(reason(&r), pb::Reason::Ok | pb::Reason::OverLimit), "{r:?}");
                if r.allowed {
                    admitted.lock().unwrap().push((sent, epoch_ms()));
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    // Redis counted each decision between its sending and its answer: one
    // whose two stamps fall in the same window was counted in that window.
    let admitted = admitted.lock().unwrap().clone();
    let windows: std::collections::BTreeSet<u128> =
        admitted.iter().flat_map(|(s, a)| [s / 1_000, a / 1_000]).collect();
    for window in &windows {
        let inside = admitted.iter().filter(|(s, a)| s / 1_000 == *window && a / 1_000 == *window).count();
        assert!(inside <= 30, "window {window}: {inside} admitted");
    }
    assert!(admitted.len() <= 30 * windows.len(), "{} admitted in {} windows", admitted.len(), windows.len());
    // Kept busy, every window but the edges admitted its whole limit.
    assert!(
        admitted.len() >= 30 * (windows.len() - 2),
        "{} admitted in {} windows",
        admitted.len(),
        windows.len()
    );
    let mut saved = 0.0;
    for server in [&a, &b] {
        let addr = server.http_addr;
        let (_, metrics) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics")).await.unwrap();
        saved += metrics
            .lines()
            .find_map(|l| l.strip_prefix("ratelimitd_store_calls_saved_total{by=\"denial_cache\"} "))
            .unwrap()
            .parse::<f64>()
            .unwrap();
    }
    assert!(saved > 100.0, "the cache answered {saved} denials");
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}
