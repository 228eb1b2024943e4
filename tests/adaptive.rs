//! Adaptive limits, black-box: a simulated downstream of capacity C behind
//! two service instances on one real Redis, fed by open-loop load through
//! gRPC, its outcomes reported with `Report`.

mod common;

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use common::{RedisServer, Rules, TestServer, config, metric, request};
use ratelimitd::{
    api::pb::{self, Outcome, rate_limiter_client::RateLimiterClient},
    limiter::adaptive::{AimdParams, Shared, Tally, exchange},
    limiter::scripts,
};
use tonic::transport::Channel;

const MAX: u64 = 480;

const RULES: &str = "rules:\n  - { rule_id: backend, resource_path: /backend, limit: 100, window_seconds: 1, adaptive: { min: 20, max: 480, increase: 10, interval_ms: 500 } }\n  - { rule_id: fixed, resource_path: /fixed, limit: 2, window_seconds: 60 }\n";

/// The downstream: it serves `capacity` requests a second (a bucket of
/// a tenth of a second's worth, refilled continuously); what comes faster
/// fails. Counts what it was sent, per second since `origin`.
struct Downstream {
    origin: Instant,
    capacity: AtomicU64,
    /// Tokens, and when they were last refilled (s since `origin`).
    bucket: Mutex<(f64, f64)>,
    sent: Mutex<BTreeMap<u64, u64>>,
}

impl Downstream {
    fn new(capacity: u64) -> Self {
        Downstream {
            origin: Instant::now(),
            capacity: AtomicU64::new(capacity),
            bucket: Mutex::new((0.0, 0.0)),
            sent: Mutex::default(),
        }
    }

    /// Serves one request: whether it succeeded.
    fn serve(&self) -> bool {
        let now = self.origin.elapsed().as_secs_f64();
        *self.sent.lock().unwrap().entry(now as u64).or_default() += 1;
        let rate = self.capacity.load(Ordering::Relaxed) as f64;
        let mut bucket = self.bucket.lock().unwrap();
        let (tokens, at) = *bucket;
        let tokens = (tokens + (now - at) * rate).min(rate / 10.0);
        let served = tokens >= 1.0;
        *bucket = (if served { tokens - 1.0 } else { tokens }, now);
        served
    }

    /// Requests sent to it per second over seconds `from..to`.
    fn rate(&self, from: u64, to: u64) -> f64 {
        let sent = self.sent.lock().unwrap();
        (from..to).map(|s| sent.get(&s).copied().unwrap_or(0)).sum::<u64>() as f64 / (to - from) as f64
    }
}

/// What the load saw: Checks sent, and the highest limit an answer named.
#[derive(Default)]
struct Seen {
    checks: AtomicU64,
    highest_limit: AtomicU64,
}

/// Sends 250 Checks a second to `client` until `stop` (open loop, each on
/// its own task, paced every 10 ms); each admitted one goes to the
/// downstream and, while `reporting`, its outcome is reported.
async fn offer(
    client: RateLimiterClient<Channel>,
    downstream: Arc<Downstream>,
    reporting: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
) {
    let mut ticker = tokio::time::interval(Duration::from_millis(10));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = tokio::task::JoinSet::new();
    let mut tick = 0u64;
    while !stop.load(Ordering::Relaxed) {
        ticker.tick().await;
        tick += 1;
        // 2.5 a tick: 2, 3, 2, 3, …
        for _ in 0..(2 + tick % 2) {
            let (mut client, downstream, reporting, seen) =
                (client.clone(), Arc::clone(&downstream), Arc::clone(&reporting), Arc::clone(&seen));
            tasks.spawn(async move {
                let answer = client.check(request("svc", "/backend")).await.expect("Check").into_inner();
                seen.checks.fetch_add(1, Ordering::Relaxed);
                seen.highest_limit.fetch_max(answer.limit, Ordering::Relaxed);
                if !answer.allowed {
                    return;
                }
                let outcome = if downstream.serve() { Outcome::Success } else { Outcome::Failure };
                if reporting.load(Ordering::Relaxed) {
                    let report =
                        pb::RateLimitRequest { outcome: outcome as i32, ..request("svc", "/backend") };
                    let answer = client.report(report).await.expect("Report").into_inner();
                    assert_eq!(answer.reason, pb::Reason::Ok as i32, "{answer:?}");
                }
            });
        }
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

/// The limit in force on `server`, as its `/metrics` says.
async fn limit_of(server: &TestServer) -> f64 {
    metric(server, "ratelimitd_adaptive_limit{kind=\"native\",rule=\"backend\"}")
        .await
        .expect("the adaptive limit's gauge")
}

/// C = 200/s offered 500/s through two instances: what reaches the
/// downstream settles within ±10% of C within 7 s (from a limit of 100,
/// +10 per 500 ms); when C doubles it follows within 12 s; the limit never goes above `max`, both instances
/// agree on it, and it holds once the last reports are exchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_follow_a_downstreams_capacity() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let servers = [
        TestServer::start(config(&rules.path(), Some(redis.url()))).await,
        TestServer::start(config(&rules.path(), Some(redis.url()))).await,
    ];
    let downstream = Arc::new(Downstream::new(200));
    let (reporting, stop, seen) =
        (Arc::new(AtomicBool::new(true)), Arc::new(AtomicBool::new(false)), Arc::default());
    let mut load = Vec::new();
    for server in &servers {
        let args = (Arc::clone(&downstream), Arc::clone(&reporting), Arc::clone(&stop), Arc::clone(&seen));
        load.push(tokio::spawn(offer(server.client().await, args.0, args.1, args.2, args.3)));
    }
    let origin = downstream.origin;
    let until = |second: u64| tokio::time::sleep_until((origin + Duration::from_secs(second)).into());

    until(11).await;
    let settled = downstream.rate(7, 11);
    downstream.capacity.store(400, Ordering::Relaxed);
    until(27).await;
    let followed = downstream.rate(23, 27);
    eprintln!("sent per second: {:?}", downstream.sent.lock().unwrap());
    let limits = [limit_of(&servers[0]).await, limit_of(&servers[1]).await];
    reporting.store(false, Ordering::Relaxed);
    // The last reports land and are exchanged: an instance drains them at
    // its next exchange, into the tally of the interval it runs in, and the
    // step from that tally comes at the next interval's first exchange.
    // Under this load an exchange can run late into the next interval, so
    // that is up to three intervals (1.5 s); two seconds are given.
    until(29).await;
    let stopped = limit_of(&servers[0]).await;
    until(32).await;
    let held = [limit_of(&servers[0]).await, limit_of(&servers[1]).await];
    stop.store(true, Ordering::Relaxed);
    for task in load {
        task.await.unwrap();
    }

    let offered = seen.checks.load(Ordering::Relaxed) as f64 / origin.elapsed().as_secs_f64();
    assert!(offered > 450.0, "the generator kept up: {offered:.0}/s of 500/s");
    assert!(
        (180.0..=220.0).contains(&settled),
        "C = 200: {settled:.0}/s reached the downstream in seconds 7-11"
    );
    assert!((360.0..=440.0).contains(&followed), "C = 400: {followed:.0}/s in seconds 23-27");
    let highest = seen.highest_limit.load(Ordering::Relaxed);
    assert!(highest <= MAX, "an answer named limit {highest}, above max {MAX}");
    assert!((limits[0] - limits[1]).abs() <= 10.0, "the instances agree within one step: {limits:?}");
    assert_eq!(held, [stopped, stopped], "no reports: the limit holds ({stopped} then {held:?})");
    let outcomes = metric(
        &servers[0],
        "ratelimitd_adaptive_outcomes_total{kind=\"native\",rule=\"backend\",outcome=\"failure\"}",
    )
    .await
    .unwrap_or(0.0);
    assert!(outcomes > 0.0, "failures were reported and counted");
    for server in servers {
        server.stop().await.unwrap();
    }
}

/// A `Report` with an outcome counts nothing and is answered from the
/// rule; an outcome this service does not know is refused; on a rule
/// without an adaptive limit the outcome is accepted and ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outcome_report_counts_nothing() {
    let rules = Rules::new(RULES);
    let server = TestServer::start(config(&rules.path(), None)).await;
    let mut client = server.client().await;
    for _ in 0..5 {
        let report = pb::RateLimitRequest {
            outcome: Outcome::Failure as i32,
            latency_ms: 12,
            ..request("u", "/fixed")
        };
        let answer = client.report(report).await.unwrap().into_inner();
        assert_eq!(
            (answer.allowed, answer.reason, answer.rule_id.as_str()),
            (true, pb::Reason::Ok as i32, "fixed")
        );
    }
    let check = client.check(request("u", "/fixed")).await.unwrap().into_inner();
    assert_eq!((check.allowed, check.remaining_tokens), (true, 1), "the outcome reports counted nothing");
    let report = pb::RateLimitRequest { outcome: Outcome::Success as i32, ..request("u", "/backend") };
    let answer = client.report(report).await.unwrap().into_inner();
    assert_eq!(
        (answer.reason, answer.limit),
        (pb::Reason::Ok as i32, 100),
        "answered with the limit in force"
    );
    let unknown = pb::RateLimitRequest { outcome: 9, ..request("u", "/backend") };
    let refused = client.report(unknown).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().starts_with("outcome: 9 is not an outcome"), "{}", refused.message());
    server.stop().await.unwrap();
}

/// `adapt.lua` is the twin of `limiter::adaptive::exchange`: 2,000 random
/// exchanges of two rules with different settings, in one script call
/// each (as an instance makes them), leave Redis holding exactly the
/// states the Rust function computes.
#[tokio::test]
async fn the_script_is_the_twin_of_exchange() {
    let redis = RedisServer::start();
    let mut conn = redis.client().await;
    let params = [
        AimdParams {
            min: 10,
            max: 1_000,
            increase: 7,
            decrease: 0.85,
            interval_ms: 1_000,
            max_failure_ratio: 0.05,
            latency_ms: None,
        },
        AimdParams {
            min: 1,
            max: 50,
            increase: 1,
            decrease: 0.5,
            interval_ms: 100,
            max_failure_ratio: 0.0,
            latency_ms: Some(5),
        },
    ];
    let initial = [300, 60];
    let mut states: [Option<Shared>; 2] = [None, None];
    let mut index = [1_000u64, 7];
    let mut random = common::xorshift(0x9e37_79b9_7f4a_7c15_u64);
    for round in 0..2_000 {
        let mut call = scripts::ADAPT.call();
        call.arg(2).arg("rla:a").arg("rla:b");
        let mut expected = [0; 2];
        for k in 0..2 {
            // Mostly the same or the next interval; sometimes a gap, or a clock behind.
            index[k] = match random(10) {
                0..=4 => index[k],
                5..=7 => index[k] + 1,
                8 => index[k] + 2 + random(3),
                _ => index[k].saturating_sub(1),
            };
            let tally = Tally { successes: random(60), failures: random(4), overloads: random(3) };
            let p = params[k];
            call.arg(index[k]).arg(initial[k]).arg(p.min).arg(p.max).arg(p.increase);
            call.arg(p.decrease).arg(p.max_failure_ratio);
            call.arg(tally.successes).arg(tally.failures).arg(tally.overloads);
            let next = exchange(states[k], index[k], initial[k], &p, tally);
            expected[k] = next.limit;
            states[k] = Some(next);
        }
        call.arg(60_000);
        let answer = scripts::run(&mut conn, std::slice::from_ref(&call)).await.unwrap().pop().unwrap();
        let limits: Vec<u64> = redis::from_redis_value(answer).unwrap();
        assert_eq!(limits, expected, "round {round}");
        for (k, key) in ["rla:a", "rla:b"].into_iter().enumerate() {
            let stored: Vec<u64> = redis::cmd("HMGET")
                .arg(key)
                .arg(&["limit", "index", "s", "f", "o", "c"])
                .query_async(&mut conn)
                .await
                .unwrap();
            let state = states[k].unwrap();
            let t = state.tally;
            let twin = vec![
                state.limit,
                state.index,
                t.successes,
                t.failures,
                t.overloads,
                u64::from(state.cooling),
            ];
            assert_eq!(stored, twin, "round {round}, rule {key}");
        }
    }
}

/// The limit `server` has in force, once `for_how_long` has passed with
/// `mallory` reporting `outcome` of `weight` every 20 ms, after `admitted`
/// Checks of its own, beside a gateway (`svc`) that is admitted 40 times a
/// second and reports every other one failed; also the outcomes refused.
async fn forged(
    server: &TestServer,
    gateway_reports: bool,
    admitted: u32,
    outcome: Outcome,
    weight: u32,
    for_how_long: Duration,
) -> (f64, f64) {
    let mut client = server.client().await;
    for _ in 0..admitted {
        let answer = client.check(request("mallory", "/backend")).await.unwrap().into_inner();
        assert!(answer.allowed);
    }
    let started = Instant::now();
    let mut tick = 0u64;
    while started.elapsed() < for_how_long {
        tick += 1;
        let forged =
            pb::RateLimitRequest { outcome: outcome as i32, weight, ..request("mallory", "/backend") };
        let answer = client.report(forged).await.unwrap().into_inner();
        assert_eq!(answer.reason, pb::Reason::Ok as i32, "a report is answered, never refused");
        if gateway_reports && tick.is_multiple_of(2) {
            let answer = client.check(request("svc", "/backend")).await.unwrap().into_inner();
            if answer.allowed {
                let went = if tick.is_multiple_of(4) { Outcome::Failure } else { Outcome::Success };
                let report = pb::RateLimitRequest { outcome: went as i32, ..request("svc", "/backend") };
                client.report(report).await.unwrap();
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let uncredited =
        metric(server, "ratelimitd_adaptive_outcomes_uncredited_total{kind=\"native\",rule=\"backend\"}")
            .await
            .unwrap();
    (limit_of(server).await, uncredited)
}

/// A caller never admitted on the rule reports a failure every 20 ms for
/// 3 s (six intervals): the limit moves by 0, every report refused as
/// uncredited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reporter_never_admitted_moves_the_limit_by_0() {
    let rules = Rules::new(RULES);
    let server = TestServer::start(config(&rules.path(), None)).await;
    let (limit, uncredited) = forged(&server, false, 0, Outcome::Failure, 1, Duration::from_secs(3)).await;
    assert_eq!(limit, 100.0, "moved by {}", 100.0 - limit);
    assert!(uncredited >= 100.0, "{uncredited} reports refused");
    server.stop().await.unwrap();
}

/// A caller admitted 5 times reports a success of weight 2^32-1 every
/// 20 ms, while the gateway reports half of its admitted requests failed:
/// the forged weight counts 5 and the limit goes down, not up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_success_of_weight_2_pow_32_does_not_outvote_50_percent_failures() {
    let rules = Rules::new(RULES);
    let server = TestServer::start(config(&rules.path(), None)).await;
    let (limit, uncredited) =
        forged(&server, true, 5, Outcome::Success, u32::MAX, Duration::from_secs(3)).await;
    assert!(limit < 100.0, "the limit rose to {limit}");
    assert!(uncredited >= f64::from(u32::MAX) * 100.0, "{uncredited} outcomes refused");
    let successes = metric(
        &server,
        "ratelimitd_adaptive_outcomes_total{kind=\"native\",rule=\"backend\",outcome=\"success\"}",
    )
    .await
    .unwrap();
    assert!(successes < 100.0, "{successes} successes counted: the forged weight went through");
    server.stop().await.unwrap();
}

/// With `grpc.reporting_peers`, only those addresses report: a caller
/// elsewhere, admitted and reporting failures every 20 ms, moves the limit
/// by 0 (its reports answered, counted as `outcome_not_allowed`); the
/// allowed gateway's failures lower it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_reporting_peers_move_the_limit() {
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), None);
    cfg.grpc.reporting_peers = vec!["127.0.0.2".to_owned()];
    let server = TestServer::start(cfg).await;
    let from = |ip: &str| {
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr)).unwrap();
        endpoint.local_address(Some(ip.parse().unwrap()))
    };
    let mut elsewhere = RateLimiterClient::new(from("127.0.0.1").connect().await.unwrap());
    let mut gateway = RateLimiterClient::new(from("127.0.0.2").connect().await.unwrap());
    let fail =
        |user: &str| pb::RateLimitRequest { outcome: Outcome::Failure as i32, ..request(user, "/backend") };
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1_500) {
        assert!(elsewhere.check(request("mallory", "/backend")).await.unwrap().into_inner().allowed);
        let answer = elsewhere.report(fail("mallory")).await.unwrap().into_inner();
        assert_eq!(answer.reason, pb::Reason::Ok as i32);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(limit_of(&server).await, 100.0, "a caller outside grpc.reporting_peers moved the limit");
    let ignored = metric(
        &server,
        "ratelimitd_request_values_adjusted_total{api=\"check\",reason=\"outcome_not_allowed\"}",
    )
    .await
    .unwrap_or(0.0);
    assert!(ignored >= 20.0, "{ignored} reports ignored");
    let started = Instant::now();
    while started.elapsed() < Duration::from_millis(1_500) {
        assert!(gateway.check(request("svc", "/backend")).await.unwrap().into_inner().allowed);
        gateway.report(fail("svc")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(limit_of(&server).await < 100.0, "the gateway's failures did not lower the limit");
    server.stop().await.unwrap();
}
