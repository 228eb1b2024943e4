//! Black-box tests of what only the Redis store has: the key layout, the
//! script called by SHA, sharing one Redis between instances, coalescing
//! concurrent decisions on few connections, and answering by failure policy
//! when Redis goes away.

mod common;

use std::time::{Duration, Instant};

use common::{RedisServer, Rules, TestServer, check, config, eventually, reason, request};
use ratelimitd::{api::pb::Reason, limiter::Count};
use redis::AsyncCommands;

const RULES: &str = r#"
rules:
  - { rule_id: hot, resource_path: /hot, limit: 100, window_seconds: 86400 }
  - { rule_id: open, resource_path: /open, limit: 1000, window_seconds: 86400, failure_policy: open }
  - { rule_id: closed, resource_path: /closed, limit: 1000, window_seconds: 86400, failure_policy: closed }
"#;

/// One string per (user, rule) at `rl2:{user}:rule`: the window index, the
/// two counts and the expiry (the end of the next window), which is the
/// key's own; denied requests write nothing.
#[tokio::test]
async fn counters_are_strings_that_expire_at_the_end_of_the_next_window() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let server = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let mut client = server.client().await;
    let mut weighted = request("kim", "/hot");
    weighted.weight = 7;
    check(&mut client, weighted).await;

    let mut conn = redis.client().await;
    let [window, current, previous, expiry] = redis.counter("rl2:{kim}:hot").await.expect("a counter");
    assert_eq!((current, previous), (7.0, 0.0));
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let now_ms = u64::try_from(now_ms).unwrap();
    let day = 86_400_000;
    assert!((window as u64).abs_diff(now_ms / day) <= 1, "window {window}");
    assert_eq!(expiry as u64, (window as u64 + 2) * day, "the end of the next window");
    let expiry_at: i64 = redis::cmd("PEXPIRETIME").arg("rl2:{kim}:hot").query_async(&mut conn).await.unwrap();
    assert_eq!(expiry_at, expiry as i64, "the key expires when its value says");

    let mut too_heavy = request("lee", "/hot");
    too_heavy.weight = 101;
    check(&mut client, too_heavy).await;
    let exists: bool = conn.exists("rl2:{lee}:hot").await.unwrap();
    assert!(!exists, "a never-admissible request must not touch Redis");
    server.stop().await.unwrap();
}

/// `redis.key_prefix` (upstream's `CACHE_KEY_PREFIX`): two deployments on
/// one Redis count apart, each under its prefix.
#[tokio::test]
async fn key_prefixes_keep_deployments_apart() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut servers = Vec::new();
    for prefix in ["a:", "b:"] {
        let mut cfg = config(&rules.path(), Some(redis.url()));
        cfg.redis.connection.key_prefix = prefix.to_owned();
        servers.push(TestServer::start(cfg).await);
    }
    for _ in 0..3 {
        check(&mut servers[0].client().await, request("kim", "/hot")).await;
    }
    check(&mut servers[1].client().await, request("kim", "/hot")).await;
    let [_, a, _, _] = redis.counter("a:rl2:{kim}:hot").await.expect("a's counter");
    let [_, b, _, _] = redis.counter("b:rl2:{kim}:hot").await.expect("b's counter");
    assert_eq!((a, b), (3.0, 1.0));
    assert!(redis.counter("rl2:{kim}:hot").await.is_none(), "nothing unprefixed");
    for server in servers {
        server.stop().await.unwrap();
    }
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
    // meets NOSCRIPT: 2 decisions by SHA, 1 failed, and its retry with the
    // script's text.
    let evalsha = redis.info_field("commandstats", "cmdstat_evalsha").await.expect("EVALSHA used");
    assert!(evalsha.starts_with("calls=2,"), "{evalsha}");
    assert!(evalsha.ends_with("failed_calls=1"), "{evalsha}");
    let eval = redis.info_field("commandstats", "cmdstat_eval").await.expect("the retry");
    assert!(eval.starts_with("calls=1,") && eval.ends_with("failed_calls=0"), "{eval}");
    server.stop().await.unwrap();
}

/// Every script goes through one runner: by SHA, and on NOSCRIPT (told by
/// the error's kind) once more in one pipeline, each script's first call
/// carrying its text; after that the store knows it again.
#[tokio::test]
async fn the_script_runner_calls_by_sha_and_sends_the_text_once_on_noscript() {
    use ratelimitd::limiter::scripts;
    let redis = RedisServer::start();
    let mut conn = redis.client().await;
    let _: () = redis::cmd("SET").arg("v").arg(1).query_async(&mut conn).await.unwrap();
    let swap = |from: u32, to: u32| {
        let mut call = scripts::SCHEMA_SWAP.call();
        call.arg(1).arg("v").arg(from).arg(to);
        call
    };
    // Unknown to the store: both calls of the pipeline retried, the first
    // with the text, the second by SHA behind it.
    let answers = scripts::run(&mut conn, &[swap(1, 2), swap(2, 3)]).await.unwrap();
    let answers: Vec<u32> = answers.into_iter().map(|a| redis::from_redis_value(a).unwrap()).collect();
    assert_eq!(answers, [1, 1]);
    let answers = scripts::run(&mut conn, &[swap(3, 4)]).await.unwrap();
    assert_eq!(redis::from_redis_value::<u32>(answers[0].clone()).unwrap(), 1);
    let evalsha = redis.info_field("commandstats", "cmdstat_evalsha").await.unwrap();
    let eval = redis.info_field("commandstats", "cmdstat_eval").await.unwrap();
    assert!(evalsha.starts_with("calls=4,") && evalsha.ends_with("failed_calls=2"), "{evalsha}");
    assert!(eval.starts_with("calls=1,"), "{eval}");
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

/// Every algorithm counts exactly under contention: two instances sharing
/// one Redis, 64 callers on one key, 256 requests against a limit of 100
/// per day (a bucket of 100 refilled at 100 a day: under a token in the
/// test's second) admit exactly 100.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_algorithm_admits_exactly_the_bound_across_two_instances() {
    let redis = RedisServer::start();
    let algorithms = ["sliding_window", "fixed_window", "token_bucket", "gcra"];
    let yaml: String = algorithms.iter().fold("rules:\n".to_owned(), |text, a| {
        text + &format!(
            "  - {{ rule_id: {a}, resource_path: /{a}, limit: 100, window_seconds: 86400, algorithm: {a} }}\n"
        )
    });
    let rules = Rules::new(&yaml);
    let a = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let b = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let clients = [a.client().await, b.client().await];
    for algorithm in algorithms {
        let admitted = common::hammer(&clients, 64, 4, &format!("/{algorithm}")).await;
        assert_eq!(admitted, 100, "{algorithm}");
    }
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// A bucket is stored as (stamp, value, minus its algorithm code, expiry);
/// the key expires when its value says, at twice the time until the bucket
/// is full again, and a write whose bucket fills before that keeps the
/// expiry (no PXAT): two decisions, one expiry.
#[tokio::test(flavor = "current_thread")]
async fn a_bucket_keeps_its_expiry_until_it_must_move() {
    use ratelimitd::limiter::{Algorithm, ManyItem, WindowParams};
    let redis = RedisServer::start();
    let (store, _dispatchers) = single_connection_store(&redis).await;
    let mut conn = redis.client().await;
    for (algorithm, code) in [(Algorithm::TokenBucket, -2.0), (Algorithm::Gcra, -3.0)] {
        // 10 tokens, refilled at 10 a minute: a full refill takes 60 s.
        let params = WindowParams { window_ms: 60_000, capacity: 10, rate: 10, algorithm };
        let item = ManyItem { weight: 4, ..ManyItem::admission(format!("k-{}", algorithm.as_str()), params) };
        let key = format!("rle2:{{g}}:k-{}", algorithm.as_str());
        let mut expiries = Vec::new();
        // 4 tokens owed: full again in 24 s, so the key lives 48 s; then 1
        // more: full in 30 s, within those 48 s.
        for (weight, full_in) in [(4, 24_000), (1, 30_000)] {
            let before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
            let item = ManyItem { weight, ..item.clone() };
            assert!(store.decide_many("g", std::slice::from_ref(&item)).await.unwrap().committed);
            let [_, _, kind, expiry] = redis.counter(&key).await.unwrap();
            assert_eq!(kind, code, "{algorithm:?}");
            let at: i64 = redis::cmd("PEXPIRETIME").arg(&key).query_async(&mut conn).await.unwrap();
            assert_eq!(at, expiry as i64, "{algorithm:?}: the key expires when its value says");
            let floor = u64::try_from(before.as_millis()).unwrap() + full_in;
            assert!(expiry as u64 >= floor - 5, "{algorithm:?}: {expiry} < {floor}");
            expiries.push(expiry);
        }
        assert_eq!(expiries[0], expiries[1], "{algorithm:?}: the second write kept the expiry");
    }
}

/// A counter key holding something else — a version-1 hash, a string of
/// another length — reads as no counter and is overwritten; the decision
/// is made, not failed.
#[tokio::test(flavor = "current_thread")]
async fn a_foreign_value_at_a_counter_key_reads_as_none() {
    let redis = RedisServer::start();
    let (store, _dispatchers) = single_connection_store(&redis).await;
    let rule = hot_rule(3);
    let mut conn = redis.client().await;
    let _: () =
        redis::cmd("HSET").arg("rl2:{ann}:hot").arg("c").arg(99).query_async(&mut conn).await.unwrap();
    let _: () = redis::cmd("SET").arg("rl2:{bob}:hot").arg("short").query_async(&mut conn).await.unwrap();
    for user in ["ann", "bob"] {
        let verdict = store.decide(user, rule.counter(), 1, Count::IfFits).await.unwrap();
        assert!(verdict.admitted && verdict.remaining == 2, "{user}: {verdict:?}");
        assert_eq!(redis.counter(&format!("rl2:{{{user}}}:hot")).await.unwrap()[1], 1.0, "{user}");
    }
}

/// 64 concurrent decisions share one connection (coalesced into few script
/// calls), rather than each needing a connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_decisions_share_one_connection() {
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

fn hot_rule(limit: u64) -> ratelimitd::rules::Rule {
    use ratelimitd::{
        limiter::WindowParams,
        rules::{FailurePolicy, Mode, Rule},
        shed::Priority,
    };
    Rule {
        id: "hot".into(),
        resource_path: "/hot".to_owned(),
        client_type: None,
        priority: Priority::Degraded,
        limit,
        burst_capacity: 1.0,
        window: WindowParams::sliding(86_400_000, limit),
        mode: Mode::Enforce,
        failure_policy: FailurePolicy::Open,
        overload: None,
        also: Vec::new(),
        adaptive: None,
        global: false,
        calendar: None,
        unit: None,
        prices: None,
        levels: None,
        level: None,
        source: std::path::Path::new("t.yaml").into(),
    }
}

/// A store with one connection (so one dispatcher, one batch at a time),
/// its script loaded, and the task set its dispatcher runs in (dropping the
/// set aborts it).
async fn single_connection_store(
    redis: &RedisServer,
) -> (ratelimitd::limiter::RedisStore, tokio::task::JoinSet<()>) {
    single_connection_store_with(redis, ratelimitd::config::RedisConfig::default()).await
}

/// [`single_connection_store`] with the other settings of `base`.
async fn single_connection_store_with(
    redis: &RedisServer,
    base: ratelimitd::config::RedisConfig,
) -> (ratelimitd::limiter::RedisStore, tokio::task::JoinSet<()>) {
    let connection = ratelimitd::config::Connection { url: Some(redis.url()), ..base.connection.clone() };
    let config = ratelimitd::config::RedisConfig { connection, connections: 1, timeout_ms: 5_000, ..base };
    let mut dispatchers = tokio::task::JoinSet::new();
    let store = ratelimitd::limiter::RedisStore::new(&config, &mut dispatchers).unwrap();
    store.warm_up(Duration::from_secs(5)).await.unwrap();
    (store, dispatchers)
}

/// Decisions that queue while a connection is busy reach Redis as one script
/// call, in arrival order, and stay exact. On a single-threaded runtime,
/// `join_all` queues all 300 jobs before the dispatcher first runs, so the
/// batches are exactly 256 (MAX_BATCH) and 44: two EVALSHAs for 300
/// decisions, and the 100 admitted are the first 100, counting down.
#[tokio::test(flavor = "current_thread")]
async fn queued_decisions_are_coalesced_into_one_script_call() {
    let redis = RedisServer::start();
    let (store, _dispatchers) = single_connection_store(&redis).await;
    let rule = hot_rule(100);
    let before = redis.evalsha_calls().await;

    let verdicts = futures_util::future::join_all(
        (0..300).map(|_| store.decide("ann", rule.counter(), 1, Count::IfFits)),
    )
    .await;

    assert_eq!(redis.evalsha_calls().await - before, 2, "300 queued decisions, 2 script calls");
    let verdicts: Vec<_> = verdicts.into_iter().map(Result::unwrap).collect();
    assert!(verdicts[..100].iter().all(|v| v.admitted));
    assert!(verdicts[100..].iter().all(|v| !v.admitted));
    let remaining: Vec<u64> = verdicts[..100].iter().map(|v| v.remaining).collect();
    assert_eq!(remaining, (0..100).rev().collect::<Vec<_>>());
    let [_, count, _, _] = redis.counter("rl2:{ann}:hot").await.unwrap();
    assert_eq!(count, 100.0);
}

/// A batch over `redis.max_keys_per_call` is split into calls in order,
/// each within the cap (a job whole), and stays exact: 300 queued jobs of 4
/// counters with a cap of 64 keys are 19 script calls of 16 jobs (the last
/// of 12), and every counter holds exactly what was admitted.
#[tokio::test(flavor = "current_thread")]
async fn batches_over_the_key_cap_are_split_in_order() {
    use ratelimitd::limiter::{ManyItem, WindowParams};
    let redis = RedisServer::start();
    let (store, _dispatchers) = single_connection_store_with(
        &redis,
        ratelimitd::config::RedisConfig { max_keys_per_call: 64, ..Default::default() },
    )
    .await;
    let item = |key: &str| ManyItem::admission(key, WindowParams::sliding(60_000, 250));
    let jobs: Vec<Vec<ManyItem>> = (0..300).map(|_| ["a", "b", "c", "d"].map(item).to_vec()).collect();
    let before = redis.evalsha_calls().await;
    let outcomes = futures_util::future::join_all(jobs.iter().map(|job| store.decide_many("g", job))).await;
    assert_eq!(redis.evalsha_calls().await - before, 19, "16 jobs of 4 keys per call");
    let committed: Vec<bool> = outcomes.into_iter().map(|o| o.unwrap().committed).collect();
    assert!(committed[..250].iter().all(|c| *c) && committed[250..].iter().all(|c| !c), "in order");
    for key in ["rle2:{g}:a", "rle2:{g}:d"] {
        assert_eq!(redis.counter(key).await.unwrap()[1], 250.0, "{key}");
    }
}

/// In one batch, a multi-counter job that one counter denies writes nothing,
/// and the jobs after it see exactly what the jobs before it committed.
#[tokio::test(flavor = "current_thread")]
async fn a_denied_job_in_a_batch_writes_nothing() {
    use ratelimitd::limiter::{ManyItem, WindowParams};
    let redis = RedisServer::start();
    let (store, _dispatchers) = single_connection_store(&redis).await;
    let item = |key: &str, capacity: u64, weight: u64| ManyItem {
        weight,
        ..ManyItem::admission(key, WindowParams::sliding(60_000, capacity))
    };
    let first = [item("a", 10, 4), item("b", 10, 4)];
    // b would reach 4 + 7 = 11 > 10: denied, so a gets nothing either.
    let denied = [item("a", 10, 1), item("b", 10, 7)];
    let third = [item("a", 10, 6), item("b", 10, 6)];
    let before = redis.evalsha_calls().await;
    let (first, denied, third) = tokio::join!(
        store.decide_many("g", &first),
        store.decide_many("g", &denied),
        store.decide_many("g", &third)
    );
    assert_eq!(redis.evalsha_calls().await - before, 1, "one batch");
    let (first, denied, third) = (first.unwrap(), denied.unwrap(), third.unwrap());
    assert!(first.committed && !denied.committed && third.committed);
    assert!(denied.verdicts[0].admitted && !denied.verdicts[1].admitted);
    assert_eq!([third.verdicts[0].remaining, third.verdicts[1].remaining], [0, 0]);
    for key in ["rle2:{g}:a", "rle2:{g}:b"] {
        assert_eq!(redis.counter(key).await.unwrap()[1], 10.0, "{key}");
    }
}

/// In one script call, a counter that occurs once is written as soon as
/// its job is decided and one that repeats once at the end; both exactly.
/// One batch: ten users once each, a hot key five times over a limit of 3,
/// then a two-counter job whose fresh counter (once in the call) is denied
/// by the spent hot one, and a token bucket once: the users hold 1, the hot
/// key 3, the fresh counter does not exist, the bucket owes one token.
#[tokio::test(flavor = "current_thread")]
async fn counters_once_in_a_call_and_repeated_ones_are_written_alike() {
    use ratelimitd::limiter::{Algorithm, ManyItem, WindowParams};
    let redis = RedisServer::start();
    let (store, _dispatchers) = single_connection_store(&redis).await;
    let item = |key: &str, params| ManyItem::admission(key, params);
    let window = WindowParams::sliding(60_000, 3);
    let bucket = WindowParams { window_ms: 60_000, capacity: 3, rate: 3, algorithm: Algorithm::TokenBucket };
    let mut jobs: Vec<Vec<ManyItem>> = (0..10).map(|i| vec![item(&format!("u{i}"), window)]).collect();
    jobs.extend((0..5).map(|_| vec![item("hot", window)]));
    jobs.push(vec![item("fresh", window), item("hot", window)]);
    jobs.push(vec![item("tb", bucket)]);
    let before = redis.evalsha_calls().await;
    let outcomes = futures_util::future::join_all(jobs.iter().map(|job| store.decide_many("g", job))).await;
    assert_eq!(redis.evalsha_calls().await - before, 1, "one batch");
    let outcomes: Vec<_> = outcomes.into_iter().map(Result::unwrap).collect();
    let committed: Vec<bool> = outcomes.iter().map(|o| o.committed).collect();
    let mut expected = vec![true; 13];
    expected.extend([false, false, false, true]);
    assert_eq!(committed, expected);
    let remaining: Vec<u64> = outcomes[10..13].iter().map(|o| o.verdicts[0].remaining).collect();
    assert_eq!(remaining, [2, 1, 0]);
    assert!(outcomes[15].verdicts[0].admitted && !outcomes[15].verdicts[1].admitted);
    assert_eq!(outcomes[16].verdicts[0].remaining, 2);
    for i in 0..10 {
        assert_eq!(redis.counter(&format!("rle2:{{g}}:u{i}")).await.unwrap()[1], 1.0, "u{i}");
    }
    assert_eq!(redis.counter("rle2:{g}:hot").await.unwrap()[1], 3.0);
    assert_eq!(redis.counter("rle2:{g}:fresh").await, None, "a denied job writes nothing");
    let [_, debt, kind, _] = redis.counter("rle2:{g}:tb").await.unwrap();
    assert_eq!((debt, kind), (60_000.0, -2.0), "one token owed, in units of W");
}

/// The script and the Rust arithmetic agree at every point of a window:
/// every answer is checked against `Seen::verdict` (a disagreement is a
/// script error), with a window's elapsed ticks derived from the clock the
/// script returns. Windows of 4 ticks of 25 ms, capacity 6, a decision
/// every ~4 ms for 0.8 s per algorithm: every position in the window, with
/// a previous window that is full, partly full or empty, is decided
/// without error, and some decisions are denied and some admitted after.
#[tokio::test(flavor = "current_thread")]
async fn script_and_arithmetic_agree_across_window_edges() {
    use ratelimitd::limiter::{Algorithm, ManyItem};
    let redis = RedisServer::start();
    let (store, _dispatchers) = single_connection_store(&redis).await;
    for algorithm in Algorithm::ALL {
        let params = ratelimitd::limiter::WindowParams { window_ms: 4, capacity: 6, rate: 6, algorithm };
        let item =
            ManyItem { tick_ms: 25, ..ManyItem::admission(format!("edge-{}", algorithm.as_str()), params) };
        let (mut admitted, mut denied) = (0, 0);
        let until = Instant::now() + Duration::from_millis(800);
        while Instant::now() < until {
            let outcome = store.decide_many("g", std::slice::from_ref(&item)).await;
            let outcome = outcome.unwrap_or_else(|e| panic!("{algorithm:?}: {e:?}"));
            if outcome.committed {
                admitted += 1
            } else {
                denied += 1
            }
            tokio::time::sleep(Duration::from_millis(4)).await;
        }
        assert!(admitted > 6 && denied > 6, "{algorithm:?}: {admitted} admitted, {denied} denied");
    }
}

/// A first-hit window in Redis (limitador's counting): a peek opens
/// nothing; the first admitted hit opens the window, stored as (start,
/// count, -4, expiry) with the key expiring exactly W after the start;
/// refused until then with retry and reset at that end; afterwards a new
/// window opens at the next hit, counted afresh.
#[tokio::test(flavor = "current_thread")]
async fn a_first_hit_window_opens_at_its_first_hit_and_ends_with_its_key() {
    use ratelimitd::limiter::{Algorithm, ManyItem, WindowParams};
    let redis = RedisServer::start();
    let (store, _dispatchers) = single_connection_store(&redis).await;
    let params = WindowParams { window_ms: 400, capacity: 2, rate: 2, algorithm: Algorithm::FirstHitWindow };
    let item = ManyItem::admission("fh", params);
    let decide = |item: ManyItem| {
        let store = &store;
        async move { store.decide_many("g", std::slice::from_ref(&item)).await.unwrap().verdicts[0] }
    };
    let peek = decide(ManyItem { count: Count::Never, ..item.clone() }).await;
    assert_eq!((peek.admitted, peek.remaining, peek.reset_after_ms), (true, 2, 0));
    assert_eq!(redis.counter("rle2:{g}:fh").await, None, "a peek opens no window");

    let first = decide(item.clone()).await;
    assert_eq!((first.admitted, first.remaining, first.reset_after_ms), (true, 1, 400), "{first:?}");
    let [start, count, kind, expiry] = redis.counter("rle2:{g}:fh").await.expect("a counter");
    assert_eq!((count, kind, expiry - start), (1.0, -4.0, 400.0));
    let mut conn = redis.client().await;
    let expiry_at: i64 = redis::cmd("PEXPIRETIME").arg("rle2:{g}:fh").query_async(&mut conn).await.unwrap();
    assert_eq!(expiry_at, expiry as i64, "the key expires at the window's end");

    assert!(decide(item.clone()).await.admitted);
    let refused = decide(item.clone()).await;
    let wait = refused.retry_after_ms.unwrap();
    assert!(!refused.admitted && (1..=400).contains(&wait) && refused.reset_after_ms == wait, "{refused:?}");
    let [same_start, count, ..] = redis.counter("rle2:{g}:fh").await.unwrap();
    assert_eq!((same_start, count), (start, 2.0), "a refusal writes nothing");

    tokio::time::sleep(Duration::from_millis(wait + 5)).await;
    let again = decide(item).await;
    assert_eq!((again.admitted, again.remaining), (true, 1), "{again:?}");
    let [next_start, count, ..] = redis.counter("rle2:{g}:fh").await.unwrap();
    assert!(next_start >= start + 400.0 && count == 1.0, "{next_start} after {start}");
}

/// The circuit breaker: with Redis down, `breaker_failures` failed calls
/// open it, and from then on decisions fail with `circuit_open` without
/// being tried (not one connection attempt each); once Redis is back, the
/// first probe after `breaker_open_ms` closes it and decisions are exact
/// again well within a second.
#[tokio::test(flavor = "current_thread")]
async fn breaker_fails_fast_while_redis_is_down_and_closes_when_it_returns() {
    use ratelimitd::limiter::FailureKind;
    let mut redis = RedisServer::start();
    let config = ratelimitd::config::RedisConfig {
        connections: 1,
        timeout_ms: 1_000,
        breaker_failures: 3,
        // The count alone here; the sustained-failure rule has its own tests.
        breaker_min_failing_ms: 0,
        breaker_open_ms: 100,
        connection: ratelimitd::config::Connection { url: Some(redis.url()), ..Default::default() },
        ..Default::default()
    };
    let mut dispatchers = tokio::task::JoinSet::new();
    let store = ratelimitd::limiter::RedisStore::new(&config, &mut dispatchers).unwrap();
    let rule = hot_rule(100);
    assert!(store.decide("ivy", rule.counter(), 1, Count::IfFits).await.unwrap().admitted);

    redis.stop();
    let mut kinds = Vec::new();
    for _ in 0..10 {
        kinds.push(store.decide("ivy", rule.counter(), 1, Count::IfFits).await.unwrap_err().kind);
    }
    assert!(
        kinds[..3].iter().all(|k| matches!(k, FailureKind::ConnectionLost | FailureKind::ConnectionRefused)),
        "{kinds:?}"
    );
    assert!(kinds[3..].iter().all(|k| *k == FailureKind::CircuitOpen), "{kinds:?}");

    redis.restart();
    let back = Instant::now();
    let recovered = eventually(Duration::from_secs(1), || async {
        store.decide("ivy", rule.counter(), 1, Count::IfFits).await.is_ok_and(|v| v.admitted)
    })
    .await;
    assert!(recovered, "exact decisions did not resume within 1 s of Redis returning");
    eprintln!("decisions exact again {:?} after Redis returned", back.elapsed());
    // The restarted Redis is empty: counting starts again, exactly.
    assert_eq!(store.decide("ivy", rule.counter(), 1, Count::IfFits).await.unwrap().remaining, 98);
}

/// A Redis that requires AUTH: the password comes from `redis.password_file`
/// (a mounted secret), decisions are exact; with a wrong password they are
/// answered by policy, and neither the log-facing error nor the dead-letter
/// record carries the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_password_from_a_file_and_never_in_errors() {
    let redis = RedisServer::start_with_password(Some("s3cret-pw"));
    let rules = Rules::new(RULES);
    let secrets = tempfile::tempdir().unwrap();
    let file = secrets.path().join("redis-password");
    std::fs::write(&file, "s3cret-pw\n").unwrap();
    let mut good = config(&rules.path(), Some(redis.url()));
    good.redis.connection.password_file = Some(file);
    let server = TestServer::start(good).await;
    let mut client = server.client().await;
    for expected in (97..100).rev() {
        let r = check(&mut client, request("ana", "/hot")).await;
        assert_eq!(reason(&r), Reason::Ok, "{r:?}");
        assert_eq!(r.remaining_tokens, expected);
    }
    server.stop().await.unwrap();

    let mut bad = config(&rules.path(), Some(redis.url()));
    bad.redis.connection.password = Some("wrong-pw-value".to_owned());
    let server = TestServer::start(bad).await;
    let mut client = server.client().await;
    let r = check(&mut client, request("ana", "/closed")).await;
    assert_eq!(reason(&r), Reason::FailClosed, "{r:?}");
    let records = server.stop_and_read_dlq().await;
    assert_eq!(records.len(), 1);
    let text = serde_json::to_string(&records[0]).unwrap();
    assert!(!text.contains("wrong-pw-value") && !text.contains("s3cret"), "{text}");
}

/// An ACL user (`redis.username`, as upstream's `REDIS_AUTH=user:password`
/// sets it): decisions are exact; the same password without the user (the
/// `default` user, which is off here) fails AUTH and the policy answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_authenticates_with_its_name() {
    let redis = RedisServer::start();
    let mut admin = redis.client().await;
    for command in [
        vec!["ACL", "SETUSER", "limiter", "on", ">acl-pw", "~*", "&*", "+@all"],
        vec!["ACL", "SETUSER", "default", "off"],
    ] {
        let () = redis::cmd(command[0]).arg(&command[1..]).query_async(&mut admin).await.unwrap();
    }
    let rules = Rules::new(RULES);
    let mut user = config(&rules.path(), Some(redis.url()));
    user.redis.connection.username = Some("limiter".to_owned());
    user.redis.connection.password = Some("acl-pw".to_owned());
    let server = TestServer::start(user).await;
    let mut client = server.client().await;
    for expected in (97..100).rev() {
        let r = check(&mut client, request("ace", "/hot")).await;
        assert_eq!((reason(&r), r.remaining_tokens), (Reason::Ok, expected), "{r:?}");
    }
    server.stop().await.unwrap();

    let mut no_user = config(&rules.path(), Some(redis.url()));
    no_user.redis.connection.password = Some("acl-pw".to_owned());
    let server = TestServer::start(no_user).await;
    let mut client = server.client().await;
    let r = check(&mut client, request("ace", "/closed")).await;
    assert_eq!(reason(&r), Reason::FailClosed, "{r:?}");
    server.stop().await.unwrap();
}

/// `rediss://` to a Redis that serves TLS only and requires AUTH, trusting
/// a private CA through `redis.tls_ca_file`: decisions are exact. Without
/// that CA the server's certificate is not trusted: decisions are answered
/// by policy (and the password is in no record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_with_a_private_ca_and_auth() {
    let certs = tempfile::tempdir().unwrap();
    common::make_ca(certs.path(), "ca");
    common::make_leaf(certs.path(), "ca", "server", "serverAuth");
    let redis = RedisServer::start_with(Some("tls-pw"), Some(certs.path()));
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    let rules = Rules::new(RULES);

    let mut trusted = config(&rules.path(), Some(url.clone()));
    trusted.redis.connection.password = Some("tls-pw".to_owned());
    trusted.redis.connection.tls_ca_file = Some(certs.path().join("ca.pem"));
    let server = TestServer::start(trusted).await;
    let mut client = server.client().await;
    for expected in (97..100).rev() {
        let r = check(&mut client, request("tess", "/hot")).await;
        assert_eq!(reason(&r), Reason::Ok, "{r:?}");
        assert_eq!(r.remaining_tokens, expected);
    }
    server.stop().await.unwrap();

    let mut untrusted = config(&rules.path(), Some(url));
    untrusted.redis.connection.password = Some("tls-pw".to_owned());
    let server = TestServer::start(untrusted).await;
    let mut client = server.client().await;
    let r = check(&mut client, request("tess", "/closed")).await;
    assert_eq!(reason(&r), Reason::FailClosed, "{r:?}");
    let records = server.stop_and_read_dlq().await;
    let text = serde_json::to_string(&records).unwrap();
    assert!(!text.contains("tls-pw"), "{text}");
}

/// `lease.lua` is the twin of `limiter::lease::allocate`: 1,500 random
/// reports of three regions on two keys, each key's in one script call per
/// report (as a region makes them), answer exactly the grants the Rust
/// function computes at the script's clock, and leave Redis holding the
/// same states.
#[tokio::test]
async fn the_lease_script_is_the_twin_of_allocate() {
    use ratelimitd::limiter::{
        lease::{Lease, RegionState, Report, allocate},
        scripts,
    };
    let redis = RedisServer::start();
    let mut conn = redis.client().await;
    let (limit, floors) = (1_000u64, [50u64, 100, 0]);
    let lease = Lease { lease_ms: 40, skew_ms: 15 };
    const LINGER: u64 = 20;
    let keys = ["rlg:{g}:a", "rlg:{g}:b"];
    // The store's memory of the limit: set by the first call, it holds no
    // grant above what a region enforces for one lease and margin.
    let mut remembering: Option<u64> = None;
    let mut states: Vec<Vec<RegionState>> =
        keys.iter().map(|_| floors.iter().map(|f| RegionState::new(*f)).collect()).collect();
    let mut random = common::xorshift(0x2545_f491_4f6c_dd1d_u64);
    for round in 0..1_500 {
        let region = random(3) as usize;
        let reports: Vec<Report> = (0..keys.len())
            .map(|k| {
                let held = states[k][region].offered.max(states[k][region].confirmed);
                let enforcing = if random(4) == 0 { floors[region] } else { held };
                let admitted = random(enforcing + 1);
                Report { region, enforcing, admitted, demand: random(1_500) }
            })
            .collect();
        let mut call = scripts::LEASE.call();
        call.arg(2 + keys.len()).arg("rlg:{g}").arg("rlg:{g}!claims").arg(&keys);
        call.arg(region).arg(format!("deployment-{region}")).arg(floors.len()).arg(&floors);
        call.arg(limit).arg(lease.lease_ms).arg(lease.skew_ms).arg(LINGER).arg(60_000);
        for r in &reports {
            call.arg(r.enforcing).arg(r.admitted).arg(r.demand);
        }
        let answer = scripts::run(&mut conn, std::slice::from_ref(&call)).await.unwrap().pop().unwrap();
        let answer: Vec<u64> = redis::from_redis_value(answer).unwrap();
        let now = answer[0];
        let since = *remembering.get_or_insert(now);
        let amnesia = now < since + lease.lease_ms + lease.skew_ms;
        for (k, report) in reports.into_iter().enumerate() {
            let twin = allocate(&mut states[k], limit, report, now, lease.lingering(LINGER), amnesia);
            assert_eq!(answer[1 + k], twin.grant, "round {round}, key {k}");
            let fields: Vec<String> = ["o", "c", "e", "d"].iter().map(|f| format!("{f}{region}")).collect();
            let stored: Vec<u64> =
                redis::cmd("HMGET").arg(keys[k]).arg(&fields).query_async(&mut conn).await.unwrap();
            let s = states[k][region];
            assert_eq!(
                stored,
                [s.offered, s.confirmed, s.lease_until_ms, s.demand],
                "round {round}, key {k}"
            );
        }
        // Leases run out now and then (40 ms, trusted 15 ms past).
        if random(20) == 0 {
            tokio::time::sleep(Duration::from_millis(random(60))).await;
        }
    }
}

/// The delay proxy the region tests put between a region and its
/// coordination store: a round trip through it takes two one-way
/// latencies, a cut path answers nothing, and a restored one answers what
/// waited, in order.
#[tokio::test]
async fn a_delay_proxy_delays_each_way_and_cuts_the_path() {
    let redis = RedisServer::start();
    let target: std::net::SocketAddr = format!("127.0.0.1:{}", redis.port).parse().unwrap();
    let proxy = common::DelayProxy::start(target, Duration::from_millis(50)).await;
    let client = redis::Client::open(format!("redis://{}", proxy.addr)).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let started = Instant::now();
    let pong: String = redis::cmd("PING").query_async(&mut conn).await.unwrap();
    let round_trip = started.elapsed();
    assert_eq!(pong, "PONG");
    assert!(round_trip >= Duration::from_millis(100), "{round_trip:?}");
    assert!(round_trip < Duration::from_millis(1_000), "{round_trip:?}");
    proxy.cut();
    let mut waiting = conn.clone();
    let answer = tokio::spawn(async move {
        let _: () = redis::cmd("SET").arg("k").arg("v").query_async(&mut waiting).await.unwrap();
        let value: String = redis::cmd("GET").arg("k").query_async(&mut waiting).await.unwrap();
        value
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!answer.is_finished(), "a cut path answers nothing");
    let mut direct = redis.client().await;
    let stored: Option<String> = redis::cmd("GET").arg("k").query_async(&mut direct).await.unwrap();
    assert_eq!(stored, None, "nothing reached the store while cut");
    proxy.restore();
    assert_eq!(tokio::time::timeout(Duration::from_secs(2), answer).await.unwrap().unwrap(), "v");
}

/// Two regions share a global limit of 1,000 through a coordination store
/// 50 ms away (a delay proxy each way): capacity follows demand, but only
/// once the region that held it confirmed the lower grant, and what the
/// regions may enforce never sums above the limit.
#[tokio::test]
async fn regions_report_to_a_distant_coordination_store_and_grants_follow_demand() {
    use ratelimitd::limiter::{
        RedisStore,
        lease::{GlobalLimit, KeyReport, Lease, Reporter, report},
        settings::RedisConfig,
    };
    let redis = RedisServer::start();
    let target: std::net::SocketAddr = format!("127.0.0.1:{}", redis.port).parse().unwrap();
    let proxy = common::DelayProxy::start(target, Duration::from_millis(50)).await;
    let mut dispatchers = tokio::task::JoinSet::new();
    let config = RedisConfig {
        connection: ratelimitd::limiter::settings::Connection {
            url: Some(format!("redis://{}", proxy.addr)),
            ..Default::default()
        },
        ..RedisConfig::default()
    };
    let store = RedisStore::new(&config, &mut dispatchers).unwrap();
    let limit = GlobalLimit { id: "api{1}", limit: 1_000, floors: &[50, 50, 50], linger_ms: 2_000 };
    let lease = Lease { lease_ms: 3_000, skew_ms: 500 };
    const REGIONS: [&str; 3] = ["deployment-a", "deployment-b", "deployment-c"];
    // A store that has remembered the limit's leases for long.
    let mut conn = redis.client().await;
    let _: () = redis::cmd("SET").arg("rlg:{api%7B1%7D}").arg(0).query_async(&mut conn).await.unwrap();
    let ask = |region: usize, enforcing: u64, admitted: u64, demand: u64| {
        let (store, reports) =
            (&store, vec![KeyReport { key: "tenant-a".into(), enforcing, admitted, demand }]);
        async move {
            let started = Instant::now();
            let granted = report(
                store,
                limit,
                Reporter { region, deployment: REGIONS[region] },
                lease,
                &reports,
                Duration::from_secs(2),
            )
            .await
            .unwrap();
            assert!(started.elapsed() >= Duration::from_millis(100), "through the 50 ms proxy each way");
            granted.grants[0]
        }
    };
    // All demand in region 0: all but the others' floors.
    assert_eq!(ask(0, 50, 0, 5_000).await, 900);
    // Demand moves to region 1, which finds no room while region 0 may enforce 900.
    assert_eq!(ask(1, 50, 0, 5_000).await, 50);
    // Region 0 reports no demand, 200 admitted this window: lowered to its
    // floor (it admits nothing more until its counter is under it)...
    assert_eq!(ask(0, 900, 200, 0).await, 50);
    // ...and only once it confirms does region 1 get the rest, less the
    // 200 region 0's counter still holds.
    assert_eq!(ask(1, 50, 0, 5_000).await, 50);
    assert_eq!(ask(0, 50, 200, 0).await, 50);
    assert_eq!(ask(1, 50, 0, 5_000).await, 750);
    // A second deployment claiming region 1 is refused while region 1's lease runs.
    let reports = [KeyReport { key: "tenant-a".into(), enforcing: 50, admitted: 0, demand: 5_000 }];
    let twin = Reporter { region: 1, deployment: "deployment-b2" };
    let refused = report(&store, limit, twin, lease, &reports, Duration::from_secs(2)).await.unwrap_err();
    assert!(refused.message.contains("REGION_CLAIMED"), "{refused}");
    // The state lives under the limit's hash tag, percent-encoded, and expires.
    let mut conn = redis.client().await;
    let key = "rlg:{api%7B1%7D}:tenant-a";
    let grants: Vec<Option<u64>> =
        redis::cmd("HMGET").arg(key).arg(&["o0", "o1", "o2"]).query_async(&mut conn).await.unwrap();
    assert_eq!(grants, [Some(50), Some(750), None], "region 2 never reported");
    let ttl: i64 = redis::cmd("PTTL").arg(key).query_async(&mut conn).await.unwrap();
    assert!((1..=11_000).contains(&ttl), "two leases, margins and lingers: {ttl}");
    // The script's text crossed once; every later report named its SHA.
    let stats: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    let calls = |command: &str| command_calls(&stats, command);
    assert_eq!((calls("eval"), calls("evalsha")), (1, 7), "{stats}");
    drop(store);
    while dispatchers.join_next().await.is_some() {}
}

/// The region's record of which grants each instance may enforce: an
/// instance that reads is recorded at what it applied before (or, having
/// nothing, at what it reads) until it says it applied what it read; the
/// agent sees the oldest version the others recorded; a late word changes
/// nothing, and an instance silent for longer than a grant is kept is
/// forgotten (it holds nothing it read).
#[tokio::test]
async fn instances_record_the_grants_they_apply_and_the_agent_reads_the_oldest() {
    use ratelimitd::{
        global::regional::{self, Call, Written},
        limiter::{RedisStore, settings::RedisConfig},
    };
    let redis = RedisServer::start();
    let mut dispatchers = tokio::task::JoinSet::new();
    let config = RedisConfig {
        connection: ratelimitd::limiter::settings::Connection {
            url: Some(redis.url()),
            ..Default::default()
        },
        ..RedisConfig::default()
    };
    let store = RedisStore::new(&config, &mut dispatchers).unwrap();
    let timeout = Duration::from_secs(2);
    let call = |instance: &'static str, applied: Option<u64>| Call {
        instance,
        applied,
        role_ms: 60_000,
        tally_ttl_ms: 3_000,
        kept_ms: 400,
    };
    let exchange = |call: Call<'static>| {
        let store = &store;
        async move { regional::exchange(store, call, &["api"], &[Vec::new()], timeout).await.unwrap() }
    };
    let agent = exchange(call("one", None)).await;
    assert!(agent.agent);
    assert_eq!((agent.version, agent.oldest_applied), (0, None), "nothing written, nobody else");
    let other = exchange(call("two", None)).await;
    assert!(!other.agent);
    // The agent writes version 1; "two" reads it while it enforces version 0.
    let written = Written {
        limit: "api".into(),
        until: other.now_ms + 60_000,
        grants: vec![("k".into(), 500)],
        claimed: false,
    };
    regional::write_grants(&store, (1, &[written]), 60_000, timeout).await.unwrap();
    let read = exchange(call("two", Some(0))).await;
    assert_eq!((read.version, &read.grants[0].grants[..]), (1, &[("k".into(), 500)][..]));
    assert_eq!(read.grants[0].claimed, None);
    assert_eq!(exchange(call("one", Some(1))).await.oldest_applied, Some(0), "not applied yet");
    regional::applied(&store, "two", (1, read.now_ms), timeout).await.unwrap();
    assert_eq!(exchange(call("one", Some(1))).await.oldest_applied, Some(1));
    // A late word about an older read changes nothing.
    regional::applied(&store, "two", (0, read.now_ms - 10), timeout).await.unwrap();
    assert_eq!(exchange(call("one", Some(1))).await.oldest_applied, Some(1));
    // A new instance is recorded at what it reads.
    let _ = exchange(call("three", None)).await;
    assert_eq!(exchange(call("one", Some(1))).await.oldest_applied, Some(1));
    // Silent for longer than a grant is kept: forgotten.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(exchange(call("one", Some(1))).await.oldest_applied, None);
    let mut conn = redis.client().await;
    let left: Vec<String> =
        redis::cmd("HKEYS").arg("rlr:{global}:applied").query_async(&mut conn).await.unwrap();
    assert_eq!(left, ["one"], "the others' records are dropped");
    drop(store);
    while dispatchers.join_next().await.is_some() {}
}

/// A report of more keys than one script call takes goes in several calls
/// of at most `KEYS_PER_CALL` keys, pipelined: every key is granted, in
/// order, and no call runs longer than its share.
#[tokio::test]
async fn a_report_of_many_keys_goes_in_calls_of_a_bounded_size() {
    use ratelimitd::limiter::{
        RedisStore,
        lease::{GlobalLimit, KEYS_PER_CALL, KeyReport, Lease, Reporter, fair_shares, report},
        settings::RedisConfig,
    };
    let redis = RedisServer::start();
    let mut dispatchers = tokio::task::JoinSet::new();
    let config = RedisConfig {
        connection: ratelimitd::limiter::settings::Connection {
            url: Some(redis.url()),
            ..Default::default()
        },
        ..RedisConfig::default()
    };
    let store = RedisStore::new(&config, &mut dispatchers).unwrap();
    let limit = GlobalLimit { id: "many", limit: 1_000, floors: &[50, 50, 50], linger_ms: 2_000 };
    let lease = Lease { lease_ms: 3_000, skew_ms: 500 };
    let keys = 2 * KEYS_PER_CALL + 200;
    // Every other key wants little: each key's grant is its own.
    let reports: Vec<KeyReport> = (0..keys)
        .map(|i| KeyReport {
            key: format!("k{i}"),
            enforcing: 50,
            admitted: 0,
            demand: if i % 2 == 0 { 5_000 } else { 100 },
        })
        .collect();
    let reporter = Reporter { region: 0, deployment: "deployment-a" };
    // A store that has remembered the limit's leases for long.
    let mut conn = redis.client().await;
    let _: () = redis::cmd("SET").arg("rlg:{many}").arg(0).query_async(&mut conn).await.unwrap();
    for round in 0..2 {
        let granted = report(&store, limit, reporter, lease, &reports, Duration::from_secs(5)).await.unwrap();
        let expected: Vec<u64> =
            reports.iter().map(|r| fair_shares(1_000, &[50, 50, 50], &[r.demand, 0, 0])[0]).collect();
        assert!(granted.grants == expected, "round {round}: {:?}…", &granted.grants[..6]);
    }
    let stats: String = redis::cmd("INFO").arg("commandstats").query_async(&mut conn).await.unwrap();
    let calls = |command: &str| command_calls(&stats, command);
    // Round 0: 3 EVALSHA refused (NOSCRIPT), then an EVAL and 2 EVALSHA;
    // round 1: 3 EVALSHA.
    assert_eq!(calls("eval"), 1, "{stats}");
    assert!(calls("evalsha") >= 5, "{stats}");
    let held: Vec<String> = redis::cmd("KEYS").arg("rlg:{many}:*").query_async(&mut conn).await.unwrap();
    assert_eq!(held.len(), keys);
    drop(store);
    while dispatchers.join_next().await.is_some() {}
}

/// How many times `INFO commandstats` (`stats`) says `command` was called.
fn command_calls(stats: &str, command: &str) -> u64 {
    stats
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse::<u64>().unwrap())
}
