//! Black-box tests of priority load shedding over real gRPC: a synthetic
//! `/proc/stat` drives the utilization; each scenario runs against both stores.

mod common;

use std::time::Duration;

use common::{
    Backend, RedisServer, Rules, SyntheticCpu, TestServer, check, config, eventually, reason, request,
};
use ratelimitd::{
    api::{
        envoy_pb::{
            envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
            rls::{
                RateLimitRequest as EnvoyRequest, rate_limit_response::Code,
                rate_limit_service_client::RateLimitServiceClient,
            },
        },
        pb::{PriorityBucket, RateLimitResponse, Reason, rate_limiter_client::RateLimiterClient},
    },
    shed::{Priority, ShedMode},
};
use tonic::transport::Channel;

const RULES: &str = r#"
rules:
  - { rule_id: critical, resource_path: /critical, priority_bucket: CRITICAL, limit: 1000000, window_seconds: 86400 }
  - { rule_id: degraded, resource_path: /degraded, priority_bucket: DEGRADED, limit: 1000000, window_seconds: 86400 }
  - { rule_id: best-effort, resource_path: /best-effort, priority_bucket: BEST_EFFORT, limit: 1000000, window_seconds: 86400 }
  - { rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: 1000000, window_seconds: 86400 }
"#;

const PATHS: [&str; 4] = ["/critical", "/degraded", "/best-effort", "/bulk"];

for_each_store!(
    status_and_shedding_follow_the_level_both_ways,
    shadow_mode_reports_but_never_refuses,
    envoy_requests_are_shed_by_priority_like_check
);

async fn start(
    backend: Backend,
    cpu: &SyntheticCpu,
    mode: ShedMode,
) -> (TestServer, Option<RedisServer>, Rules) {
    let rules = Rules::new(RULES);
    let redis = (backend == Backend::Redis).then(RedisServer::start);
    let mut cfg = config(&rules.path(), redis.as_ref().map(RedisServer::url));
    cpu.configure(&mut cfg, mode);
    (TestServer::start(cfg).await, redis, rules)
}

async fn wait_for_status(client: &RateLimiterClient<Channel>, status: &str) {
    let reached =
        eventually(Duration::from_secs(10), || {
            let mut client = client.clone();
            async move {
                check(&mut client, request("probe", "/critical")).await.cluster_utilization_status == status
            }
        })
        .await;
    assert!(reached, "status never became {status}");
}

/// Checks each of the four paths; returns which were admitted.
async fn admitted(client: &mut RateLimiterClient<Channel>, status: &str) -> [bool; 4] {
    let mut result = [false; 4];
    for (i, path) in PATHS.iter().enumerate() {
        let r = check(client, request("user", path)).await;
        assert_eq!(r.cluster_utilization_status, status, "{path}: {r:?}");
        assert_shape(&r, path);
        result[i] = r.allowed;
    }
    result
}

/// A shed answer is a denial with reason SHED, a jittered retry and the
/// rule; an admitted one is a normal decision.
fn assert_shape(r: &RateLimitResponse, path: &str) {
    if r.allowed {
        assert_eq!(reason(r), Reason::Ok, "{path}: {r:?}");
    } else {
        assert_eq!(reason(r), Reason::Shed, "{path}: {r:?}");
        assert!((500..=1_500).contains(&r.retry_after_ms), "{path}: {r:?}");
        assert_eq!(r.rule_id, path.trim_start_matches('/'));
    }
}

async fn evalsha_calls(redis: Option<&RedisServer>) -> Option<u64> {
    Some(redis?.evalsha_calls().await)
}

/// NORMAL sheds nothing; at 70% BULK and BEST_EFFORT are shed without any
/// Redis call while CRITICAL and DEGRADED pass; at 90% only CRITICAL passes;
/// back at 10% the status returns to NORMAL and nothing is shed.
async fn status_and_shedding_follow_the_level_both_ways(backend: Backend) {
    let cpu = SyntheticCpu::new(0.10);
    let (server, redis, _rules) = start(backend, &cpu, ShedMode::Enforce).await;
    let mut client = server.client().await;

    wait_for_status(&client, "NORMAL").await;
    assert_eq!(admitted(&mut client, "NORMAL").await, [true, true, true, true]);

    cpu.set(0.70);
    wait_for_status(&client, "DEGRADED_MODE").await;
    assert_eq!(admitted(&mut client, "DEGRADED_MODE").await, [true, true, false, false]);

    // Shed requests cost no Redis command.
    let before = evalsha_calls(redis.as_ref()).await;
    for i in 0..50 {
        let r = check(&mut client, request(&format!("u{i}"), "/bulk")).await;
        assert_eq!(reason(&r), Reason::Shed);
    }
    assert_eq!(evalsha_calls(redis.as_ref()).await, before, "shed requests reached Redis");
    if backend == Backend::Redis {
        assert!(before.is_some_and(|calls| calls > 0), "the Redis store was not in use");
    }

    // The request's own priority may lower the rule's, never raise it
    // (shed.trust_request_priority is off); unmatched requests use
    // shed.default_priority (DEGRADED).
    let mut override_down = request("user", "/critical");
    override_down.priority = PriorityBucket::Bulk as i32;
    let r = check(&mut client, override_down).await;
    assert_eq!((reason(&r), r.priority), (Reason::Shed, PriorityBucket::Bulk as i32));
    let mut claims_critical = request("user", "/bulk");
    claims_critical.priority = PriorityBucket::Critical as i32;
    let r = check(&mut client, claims_critical).await;
    assert_eq!((reason(&r), r.priority), (Reason::Shed, PriorityBucket::Bulk as i32));
    let unmatched = check(&mut client, request("user", "/nowhere")).await;
    assert_eq!((reason(&unmatched), unmatched.priority), (Reason::NoRule, PriorityBucket::Degraded as i32));

    cpu.set(0.90);
    wait_for_status(&client, "CRITICAL_ONLY").await;
    assert_eq!(admitted(&mut client, "CRITICAL_ONLY").await, [true, false, false, false]);
    assert_eq!(reason(&check(&mut client, request("user", "/nowhere")).await), Reason::Shed);

    cpu.set(0.10);
    wait_for_status(&client, "NORMAL").await;
    assert_eq!(admitted(&mut client, "NORMAL").await, [true, true, true, true]);
    server.stop().await.unwrap();
}

/// In shadow mode nothing is refused: what would have been shed is decided
/// normally and flagged.
async fn shadow_mode_reports_but_never_refuses(backend: Backend) {
    let cpu = SyntheticCpu::new(0.95);
    let (server, _redis, _rules) = start(backend, &cpu, ShedMode::Shadow).await;
    let mut client = server.client().await;
    wait_for_status(&client, "CRITICAL_ONLY").await;
    for path in PATHS {
        let r = check(&mut client, request("user", path)).await;
        assert!(r.allowed, "{path}: {r:?}");
        assert_eq!(reason(&r), Reason::Ok);
        assert_eq!(r.shadow_shed, path != "/critical", "{path}: {r:?}");
        assert!(r.remaining_tokens < 1_000_000, "{path}: counted like any decision");
    }
    server.stop().await.unwrap();
}

/// When utilization becomes unreadable the last level is kept.
#[tokio::test]
async fn unreadable_utilization_keeps_the_last_level() {
    let cpu = SyntheticCpu::new(0.95);
    let (server, _redis, _rules) = start(Backend::Memory, &cpu, ShedMode::Enforce).await;
    let mut client = server.client().await;
    wait_for_status(&client, "CRITICAL_ONLY").await;
    let procfs = cpu.procfs.path().to_path_buf();
    drop(cpu); // stops the writer; the files go with it
    assert!(!procfs.join("stat").exists());
    // Several sampling intervals (10 ms) pass without a readable file.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = check(&mut client, request("user", "/bulk")).await;
    assert_eq!((r.cluster_utilization_status.as_str(), reason(&r)), ("CRITICAL_ONLY", Reason::Shed));
    server.stop().await.unwrap();
}

const ENVOY: &str =
    "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 1000000 }\n";

fn envoy_request(entries: &[(&str, &str)]) -> EnvoyRequest {
    EnvoyRequest {
        domain: "edge".to_owned(),
        descriptors: entries
            .iter()
            .map(|(key, value)| RateLimitDescriptor {
                entries: vec![Entry { key: (*key).to_owned(), value: (*value).to_owned() }],
                ..Default::default()
            })
            .collect(),
        hits_addend: 1,
    }
}

/// ShouldRateLimit goes through the same shedding as Check: at 70% a
/// `priority` entry of BULK or BEST_EFFORT is shed (OVER_LIMIT on every
/// descriptor, the `x-ratelimit-reason: SHED` header, no Redis call) while
/// the default (DEGRADED) passes; at 90% only CRITICAL passes.
async fn envoy_requests_are_shed_by_priority_like_check(backend: Backend) {
    let cpu = SyntheticCpu::new(0.70);
    let rules = Rules::new(RULES);
    let envoy_dir = tempfile::tempdir().unwrap();
    std::fs::write(envoy_dir.path().join("edge.yaml"), ENVOY).unwrap();
    let redis = (backend == Backend::Redis).then(RedisServer::start);
    let mut cfg = config(&rules.path(), redis.as_ref().map(RedisServer::url));
    cfg.rules.envoy_path = Some(envoy_dir.path().to_path_buf());
    cpu.configure(&mut cfg, ShedMode::Enforce);
    // Envoy sets the priority entry from the route here, not from a client.
    cfg.shed.trust_request_priority = true;
    let server = TestServer::start(cfg).await;
    let client = server.client().await;
    wait_for_status(&client, "DEGRADED_MODE").await;
    let mut envoy = RateLimitServiceClient::connect(format!("http://{}", server.addr)).await.unwrap();

    let before = evalsha_calls(redis.as_ref()).await;
    for priority in ["BULK", "best_effort"] {
        let r = envoy
            .should_rate_limit(envoy_request(&[("user", "ann"), ("priority", priority)]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.overall_code, Code::OverLimit as i32, "{priority}: {r:?}");
        assert!(r.statuses.iter().all(|s| s.code == Code::OverLimit as i32), "{r:?}");
        assert_eq!(r.statuses[0].current_limit.as_ref().map(|l| l.requests_per_unit), Some(1_000_000));
        let reason = r.response_headers_to_add.iter().find(|h| h.key == "x-ratelimit-reason");
        assert_eq!(reason.map(|h| h.value.as_str()), Some("SHED"), "{r:?}");
    }
    assert_eq!(evalsha_calls(redis.as_ref()).await, before, "shed requests reached Redis");
    let default = envoy.should_rate_limit(envoy_request(&[("user", "ann")])).await.unwrap().into_inner();
    assert_eq!(default.overall_code, Code::Ok as i32, "DEGRADED (shed.default_priority) passes at 70%");
    assert!(default.response_headers_to_add.is_empty());

    cpu.set(0.90);
    wait_for_status(&client, "CRITICAL_ONLY").await;
    let degraded = envoy.should_rate_limit(envoy_request(&[("user", "ann")])).await.unwrap().into_inner();
    assert_eq!(degraded.overall_code, Code::OverLimit as i32);
    let critical = envoy
        .should_rate_limit(envoy_request(&[("user", "ann"), ("priority", "CRITICAL")]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(critical.overall_code, Code::Ok as i32, "CRITICAL is never shed");
    let observer = server.observer().await;
    assert_eq!(observer.shedder.shed_count(Priority::Bulk), 1);
    assert_eq!(observer.shedder.shed_count(Priority::BestEffort), 1);
    assert_eq!(observer.shedder.shed_count(Priority::Degraded), 1);
    server.stop().await.unwrap();
}

/// `shed.signal: both` with the CPU idle (a synthetic 10%): a store that
/// turns slow raises the store calls' p90 far above their baseline, and
/// BULK is shed on latency alone; once the store is fast again the level
/// falls back to NORMAL and BULK passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_store_sheds_bulk_by_latency_and_recovers() {
    let rules = Rules::new(RULES);
    let redis = RedisServer::start();
    let url = redis.url();
    let target: std::net::SocketAddr =
        url.trim_start_matches("redis://").trim_end_matches('/').parse().unwrap();
    let proxy = common::DelayProxy::start(target, Duration::ZERO).await;
    let mut cfg = config(&rules.path(), Some(format!("redis://{}", proxy.addr)));
    let cpu = SyntheticCpu::new(0.10);
    cpu.configure(&mut cfg, ShedMode::Enforce);
    cfg.shed.signal = ratelimitd::shed::ShedSignal::Both;
    cfg.shed.sample_interval_ms = 100;
    cfg.shed.smoothing = 1.0;
    cfg.shed.latency_tolerance_ms = 2.0;
    cfg.redis.timeout_ms = 2_000;
    let server = TestServer::start(cfg).await;
    let client = server.client().await;
    // CRITICAL traffic, never shed, keeps the store calls coming.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = tokio::task::JoinSet::new();
    for i in 0..16 {
        let (mut client, stop) = (client.clone(), std::sync::Arc::clone(&stop));
        load.spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                check(&mut client, request(&format!("load{i}"), "/critical")).await;
            }
        });
    }
    let bulk = |mut client: RateLimiterClient<Channel>| async move {
        check(&mut client, request("b", "/bulk")).await
    };
    wait_for_status(&client, "NORMAL").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(bulk(client.clone()).await.allowed, "a fast store: nothing is shed");

    proxy.set_latency(Duration::from_millis(25));
    let shed = eventually(Duration::from_secs(10), || {
        let client = client.clone();
        async move { reason(&bulk(client).await) == Reason::Shed }
    })
    .await;
    let metrics = common::http_get(server.http_addr, "/metrics").1;
    assert!(
        shed,
        "BULK never shed; {}",
        metrics.lines().filter(|l| l.contains("shed_")).collect::<Vec<_>>().join("\n")
    );
    let pressure = common::metric(&server, "ratelimitd_shed_latency_pressure_ratio").await.unwrap();
    assert!(pressure >= 0.6, "{pressure}");
    let ratio = common::metric(&server, "ratelimitd_utilization_ratio").await.unwrap();
    assert!(ratio >= 0.6, "the level reads the higher of CPU (10%) and latency: {ratio}");

    proxy.set_latency(Duration::ZERO);
    wait_for_status(&client, "NORMAL").await;
    assert!(bulk(client.clone()).await.allowed, "recovered: BULK passes");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    while load.join_next().await.is_some() {}
    server.stop().await.unwrap();
}

/// envoyproxy/ratelimit never sheds, so its drop-in does not either until
/// told: the binary started with upstream's environment
/// (`RATELIMITD_COMPAT=envoyproxy`) on a saturated CPU (a synthetic 95 %,
/// level CRITICAL_ONLY) answers every `ShouldRateLimit` without a stated
/// priority as upstream would (OK, then OVER_LIMIT past the limit, never
/// `x-ratelimit-reason: SHED`) and counts what it would have shed in
/// `ratelimitd_shed_total{mode="shadow"}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_compat_mode_a_saturated_cpu_sheds_nothing_and_counts_what_it_would() {
    let redis = RedisServer::start();
    let cpu = SyntheticCpu::new(0.95);
    let dir = tempfile::tempdir().unwrap();
    let config_dir = dir.path().join("runtime/ratelimit/config");
    std::fs::create_dir_all(&config_dir).unwrap();
    let three =
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: hour, requests_per_unit: 3 }\n";
    std::fs::write(config_dir.join("edge.yaml"), three).unwrap();
    let log = dir.path().join("stderr.log");
    let env = [
        ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
        ("REDIS_URL", redis.url().trim_start_matches("redis://").to_owned()),
        ("RUNTIME_ROOT", dir.path().join("runtime").display().to_string()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("USE_STATSD", "false".to_owned()),
        ("RATELIMITD__SHED__SOURCE", "host".to_owned()),
        ("RATELIMITD__SHED__PROCFS_ROOT", cpu.procfs.path().display().to_string()),
        ("RATELIMITD__SHED__CGROUP_ROOT", cpu.cgroup.path().display().to_string()),
        ("RATELIMITD__SHED__SAMPLE_INTERVAL_MS", "10".to_owned()),
    ];
    let (service, grpc_port, http_port) = common::start_compat(dir.path(), &log, &env);
    let _service = common::Process(service);
    let http: std::net::SocketAddr = ([127, 0, 0, 1], http_port).into();
    let scrape = |series: &'static str| async move {
        let body = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics").1).await.unwrap();
        body.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse::<f64>().ok())
    };
    let saturated = || async { scrape("ratelimitd_utilization_level ").await == Some(2.0) };
    assert!(eventually(Duration::from_secs(10), saturated).await, "CRITICAL_ONLY never reached");

    let mut envoy = RateLimitServiceClient::connect(format!("http://127.0.0.1:{grpc_port}")).await.unwrap();
    let mut codes = Vec::new();
    for _ in 0..5 {
        let r = envoy.should_rate_limit(envoy_request(&[("user", "ann")])).await.unwrap().into_inner();
        assert!(r.response_headers_to_add.iter().all(|h| h.key != "x-ratelimit-reason"), "{r:?}");
        codes.push(Code::try_from(r.overall_code).unwrap());
    }
    assert_eq!(codes, [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit, Code::OverLimit]);
    let shadow = scrape(r#"ratelimitd_shed_total{priority="DEGRADED",mode="shadow"} "#).await;
    assert_eq!(shadow, Some(5.0), "each would have been shed");
    assert_eq!(scrape(r#"ratelimitd_shed_total{priority="DEGRADED",mode="enforce"} "#).await, Some(0.0));
}
