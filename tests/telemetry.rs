//! Black-box tests of what operators see: `/metrics` after a known sequence
//! of decisions, `/readyz` and gRPC health as Redis comes and goes and while
//! draining, and server reflection read by grpcurl.

mod common;

use std::{process::Command, time::Duration};

use common::{RedisServer, Rules, TestServer, check, config, eventually, http_get, reason, request};
use ratelimitd::api::pb::{PriorityBucket, Reason};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

const RULES: &str = r#"
rules:
  - { rule_id: two, resource_path: /two, limit: 2, window_seconds: 86400 }
  - { rule_id: open, resource_path: /open, limit: 100, window_seconds: 86400, failure_policy: open }
  - { rule_id: closed, resource_path: /closed, limit: 100, window_seconds: 86400, failure_policy: closed }
"#;

fn metric(scrape: &str, line_start: &str) -> u64 {
    scrape
        .lines()
        .find(|l| l.starts_with(line_start))
        .unwrap_or_else(|| panic!("no {line_start} in\n{scrape}"))
        .rsplit(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// Five decisions (allowed, allowed, over limit, no rule, weight too large)
/// show up as exactly those counter increments and five latency
/// observations; the scrape never contains a user id or a request path.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_count_exactly_the_decisions_made() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let server = TestServer::start(config(&rules.path(), Some(redis.url()))).await;
    let mut client = server.client().await;
    let secret_user = "user-7f3a9c-secret";
    check(&mut client, request(secret_user, "/two")).await;
    check(&mut client, request(secret_user, "/two")).await;
    check(&mut client, request(secret_user, "/two")).await;
    check(&mut client, request(secret_user, "/unmatched/path-secret")).await;
    let mut heavy = request(secret_user, "/two");
    heavy.weight = 10;
    heavy.priority = PriorityBucket::Bulk as i32;
    check(&mut client, heavy).await;

    let (status, scrape) = tokio::task::spawn_blocking({
        let addr = server.http_addr;
        move || http_get(addr, "/metrics")
    })
    .await
    .unwrap();
    assert_eq!(status, 200);
    let decisions = |rule: &str, reason: &str, allowed: bool| {
        metric(
            &scrape,
            &format!(
                "ratelimitd_decisions_total{{api=\"check\",rule=\"{rule}\",reason=\"{reason}\",allowed=\"{allowed}\"}}"
            ),
        )
    };
    assert_eq!(decisions("two", "OK", true), 2);
    assert_eq!(decisions("two", "OVER_LIMIT", false), 1);
    assert_eq!(decisions("", "NO_RULE", true), 1);
    assert_eq!(decisions("two", "WEIGHT_EXCEEDS_CAPACITY", false), 1);
    assert_eq!(metric(&scrape, "ratelimitd_decision_duration_seconds_count{api=\"check\"}"), 5);
    assert_eq!(metric(&scrape, "ratelimitd_decision_duration_seconds_bucket{api=\"check\",le=\"+Inf\"}"), 5);
    // Three decisions reached Redis (no rule and an impossible weight do not).
    assert_eq!(metric(&scrape, "ratelimitd_store_duration_seconds_count{store=\"redis\"}"), 3);
    assert_eq!(metric(&scrape, "ratelimitd_store_errors_total{kind=\"timeout\"}"), 0);
    assert_eq!(metric(&scrape, "ratelimitd_dlq_enqueued_total"), 0);
    assert_eq!(metric(&scrape, "ratelimitd_utilization_level"), 0);
    assert_eq!(metric(&scrape, "ratelimitd_rules_count{kind=\"native\"}"), 3);
    assert_eq!(metric(&scrape, "ratelimitd_rules_reload_failures_total{kind=\"native\"}"), 0);
    assert!(scrape.contains("ratelimitd_shed_total{priority=\"BULK\",mode=\"enforce\"} 0"));
    assert!(!scrape.contains(secret_user), "a user id leaked into the scrape");
    assert!(!scrape.contains("path-secret"), "a request path leaked into the scrape");
    // Every family is documented.
    for line in scrape.lines().filter(|l| !l.starts_with('#')) {
        let family = line.split(['{', ' ']).next().unwrap();
        let documented = scrape.contains(&format!("# HELP {family} "))
            || ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                family
                    .strip_suffix(suffix)
                    .is_some_and(|base| scrape.contains(&format!("# TYPE {base} histogram")))
            });
        assert!(documented, "no HELP for {family}");
    }
    server.stop().await.unwrap();
}

async fn grpc_health(server: &TestServer, service: &str) -> ServingStatus {
    let mut client = HealthClient::new(channel(server).await);
    let response =
        client.check(HealthCheckRequest { service: service.to_owned() }).await.unwrap().into_inner();
    ServingStatus::try_from(response.status).unwrap()
}

async fn channel(server: &TestServer) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn readyz(server: &TestServer) -> (u16, String) {
    let addr = server.http_addr;
    tokio::task::spawn_blocking(move || http_get(addr, "/readyz")).await.unwrap()
}

/// Redis down: a rule fails closed, and with `http.unready_without_store`
/// the instance is not ready (the body names the rule) and gRPC health
/// NOT_SERVING; Redis back: ready and SERVING again; shutdown: NOT_SERVING
/// while draining. `/healthz` stays 200 throughout; `/healthcheck`
/// (envoyproxy/ratelimit's probe) follows readiness with upstream's
/// answers: 200 `OK`, else 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readiness_and_grpc_health_follow_redis_and_shutdown() {
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let mut cfg = config(&rules.path(), Some(redis.url()));
    cfg.http.health_interval_ms = 50;
    cfg.http.unready_without_store = true;
    cfg.redis.connect_timeout_ms = 200;
    // Long enough to observe the drain below.
    cfg.grpc.drain_delay_ms = 1_500;
    let server = TestServer::start(cfg).await;
    let service = "ratelimit.v1.RateLimiter";

    let ready = |expected: u16| {
        let server = &server;
        move || async move { readyz(server).await.0 == expected }
    };
    assert!(eventually(Duration::from_secs(10), ready(200)).await);
    assert!(readyz(&server).await.1.starts_with("ready: redis store reachable"));
    let healthcheck = || {
        let addr = server.http_addr;
        async move { tokio::task::spawn_blocking(move || http_get(addr, "/healthcheck")).await.unwrap() }
    };
    assert_eq!(healthcheck().await, (200, "OK".to_owned()));
    assert_eq!(grpc_health(&server, service).await, ServingStatus::Serving);
    assert_eq!(grpc_health(&server, "").await, ServingStatus::Serving);

    redis.stop();
    assert!(eventually(Duration::from_secs(10), ready(503)).await);
    let (_, body) = readyz(&server).await;
    assert!(body.contains("store unreachable") && body.contains("rules failing closed: closed"), "{body}");
    assert!(body.contains("(http.unready_without_store)"), "{body}");
    assert_eq!(grpc_health(&server, service).await, ServingStatus::NotServing);
    let addr = server.http_addr;
    assert_eq!(tokio::task::spawn_blocking(move || http_get(addr, "/healthz")).await.unwrap().0, 200);
    assert_eq!(healthcheck().await.0, 500);

    redis.restart();
    assert!(eventually(Duration::from_secs(10), ready(200)).await);
    assert_eq!(grpc_health(&server, service).await, ServingStatus::Serving);

    // Shutdown: during the drain delay the service still answers, but health
    // already says NOT_SERVING and /readyz 503.
    let mut health_client = HealthClient::new(channel(&server).await);
    let mut client = server.client().await;
    let http_addr = server.http_addr;
    let stopping = tokio::spawn(server.stop());
    let draining = eventually(Duration::from_secs(5), || {
        let mut c = health_client.clone();
        async move {
            c.check(HealthCheckRequest { service: String::new() })
                .await
                .is_ok_and(|r| r.into_inner().status == ServingStatus::NotServing as i32)
        }
    })
    .await;
    assert!(draining, "gRPC health did not turn NOT_SERVING while draining");
    let status = health_client.check(HealthCheckRequest { service: service.to_owned() }).await.unwrap();
    assert_eq!(status.into_inner().status, ServingStatus::NotServing as i32);
    let (code, body) = tokio::task::spawn_blocking(move || http_get(http_addr, "/readyz")).await.unwrap();
    assert_eq!(code, 503);
    assert!(body.starts_with("not ready: draining for shutdown; rules "), "{body}");
    let drained = tokio::task::spawn_blocking(move || http_get(http_addr, "/healthcheck")).await.unwrap();
    assert_eq!(drained.0, 500, "upstream's probe fails from SIGTERM on");
    assert!(client.check(request("u", "/two")).await.is_ok(), "still answering during the drain delay");
    stopping.await.unwrap().unwrap();
}

/// Three instances on one Redis, serving a rule that fails closed, one
/// that fails open and one decided locally: Redis stops and every instance
/// stays ready (`/readyz` 200, `/healthcheck` 200, gRPC SERVING), its body
/// saying the store is unreachable and which rules fail closed, while
/// each rule's decisions follow its policy, flagged. A shared store's
/// outage must not take every endpoint out at once. A fourth instance with
/// `http.unready_without_store` turns unready, as that setting says.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_store_outage_keeps_every_instance_ready_and_decisions_follow_their_policy() {
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let settings = |unready: bool| {
        let mut cfg = config(&rules.path(), Some(redis.url()));
        cfg.http.health_interval_ms = 50;
        cfg.http.unready_without_store = unready;
        cfg.redis.connect_timeout_ms = 200;
        cfg.redis.timeout_ms = 200;
        cfg
    };
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(TestServer::start(settings(false)).await);
    }
    let strict = TestServer::start(settings(true)).await;
    for server in servers.iter().chain([&strict]) {
        assert!(eventually(Duration::from_secs(10), || async { readyz(server).await.0 == 200 }).await);
    }
    redis.stop();
    assert!(eventually(Duration::from_secs(10), || async { readyz(&strict).await.0 == 503 }).await);
    for server in &servers {
        let (code, body) = readyz(server).await;
        assert_eq!(code, 200, "{body}");
        assert!(body.starts_with("ready: redis store unreachable"), "{body}");
        assert!(body.contains("rules failing closed: closed"), "{body}");
        let addr = server.http_addr;
        let upstream = tokio::task::spawn_blocking(move || http_get(addr, "/healthcheck")).await.unwrap();
        assert_eq!(upstream, (200, "OK".to_owned()));
        assert_eq!(grpc_health(server, "ratelimit.v1.RateLimiter").await, ServingStatus::Serving);

        let mut client = server.client().await;
        let closed = check(&mut client, request("u", "/closed")).await;
        assert_eq!((closed.allowed, reason(&closed)), (false, Reason::FailClosed), "{closed:?}");
        let open = check(&mut client, request("u", "/open")).await;
        assert_eq!((open.allowed, reason(&open)), (true, Reason::FailOpen), "{open:?}");
        let local = check(&mut client, request("u", "/two")).await;
        assert_eq!((local.allowed, reason(&local)), (true, Reason::LocalOk), "{local:?}");
        for answer in [&closed, &open, &local] {
            assert!(!answer.store_error.is_empty(), "flagged: {answer:?}");
        }
    }
    for server in servers {
        server.stop().await.unwrap();
    }
    strict.stop().await.unwrap();
}

/// With `http.unready_without_store`, an open circuit breaker makes the
/// instance unready at once (`/readyz`
/// reads the breaker; the monitor has not probed since Redis went), and the
/// monitor's probe closes it with no traffic at all once Redis is back,
/// although `redis.breaker_open_ms` would keep it open for a minute: an
/// unready instance gets no decisions, so no decision would close it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_open_breaker_is_unready_and_closes_without_traffic() {
    let mut redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let settings = |interval_ms: u64| {
        let mut cfg = config(&rules.path(), Some(redis.url()));
        cfg.http.health_interval_ms = interval_ms;
        cfg.redis.connect_timeout_ms = 200;
        cfg.redis.timeout_ms = 200;
        cfg.redis.breaker_failures = 1;
        cfg.redis.breaker_min_failing_ms = 0;
        cfg.redis.breaker_open_ms = 60_000;
        cfg.http.unready_without_store = true;
        cfg
    };
    // The monitor probes once, at start, then not for a minute.
    let unprobed = TestServer::start(settings(60_000)).await;
    let probed = TestServer::start(settings(50)).await;
    for server in [&unprobed, &probed] {
        assert!(eventually(Duration::from_secs(10), || async { readyz(server).await.0 == 200 }).await);
    }
    redis.stop();
    for server in [&unprobed, &probed] {
        let mut client = server.client().await;
        let answer = check(&mut client, request("u", "/closed")).await;
        assert!(!answer.allowed, "failed closed");
    }
    let (code, body) = readyz(&unprobed).await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("circuit breaker open: 1 of 1") && body.contains("rules failing closed"), "{body}");

    redis.restart();
    assert!(
        eventually(Duration::from_secs(10), || async { readyz(&probed).await.0 == 200 }).await,
        "the probe did not close the breaker: {}",
        readyz(&probed).await.1
    );
    let mut client = probed.client().await;
    let again = check(&mut client, request("u", "/closed")).await;
    assert!(again.allowed, "exact again at once: {again:?}");
    unprobed.stop().await.unwrap();
    probed.stop().await.unwrap();
}

/// grpcurl, with no proto files, lists the rate-limit services served,
/// health and reflection, and describes the Check method. Envoy's service
/// is listed, and its health reported, only where Envoy rules make it
/// served: without them a health check of it is NOT_FOUND, not a SERVING
/// that would send Envoy to a service answering UNIMPLEMENTED.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reflection_and_health_name_only_the_services_served() {
    const ENVOY: &str = "envoy.service.ratelimit.v3.RateLimitService";
    let rules = Rules::new(RULES);
    let envoy = Rules::new(
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: second, requests_per_unit: 1 }\n",
    );
    for serve_envoy in [true, false] {
        let mut cfg = config(&rules.path(), None);
        cfg.rules.envoy_path = serve_envoy.then(|| envoy.path());
        let server = TestServer::start(cfg).await;
        let grpcurl = common::grpcurl_path();
        assert!(grpcurl.exists(), "{} not found: run scripts/install-tools", grpcurl.display());
        let addr = server.addr.to_string();
        let run = move |args: Vec<String>| {
            let output = Command::new(&grpcurl).arg("-plaintext").args(&args).output().unwrap();
            assert!(output.status.success(), "grpcurl {args:?}: {}", String::from_utf8_lossy(&output.stderr));
            String::from_utf8(output.stdout).unwrap()
        };
        let (list, describe) = tokio::task::spawn_blocking(move || {
            (
                run(vec![addr.clone(), "list".into()]),
                run(vec![addr, "describe".into(), "ratelimit.v1.RateLimiter.Check".into()]),
            )
        })
        .await
        .unwrap();
        for service in
            ["ratelimit.v1.RateLimiter", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]
        {
            assert!(list.lines().any(|l| l.trim() == service), "{service} not in\n{list}");
        }
        assert_eq!(
            list.lines().any(|l| l.trim() == ENVOY),
            serve_envoy,
            "serve_envoy {serve_envoy}:\n{list}"
        );
        assert!(
            describe.contains(
                "rpc Check ( .ratelimit.v1.RateLimitRequest ) returns ( .ratelimit.v1.RateLimitResponse )"
            ),
            "{describe}"
        );

        let serving =
            || async { grpc_health(&server, "ratelimit.v1.RateLimiter").await == ServingStatus::Serving };
        assert!(eventually(Duration::from_secs(10), serving).await, "never SERVING");
        let mut client = HealthClient::new(channel(&server).await);
        let envoy_health = client.check(HealthCheckRequest { service: ENVOY.to_owned() }).await;
        if serve_envoy {
            assert_eq!(envoy_health.unwrap().into_inner().status, ServingStatus::Serving as i32);
        } else {
            assert_eq!(envoy_health.unwrap_err().code(), tonic::Code::NotFound);
        }
        server.stop().await.unwrap();
    }
}
