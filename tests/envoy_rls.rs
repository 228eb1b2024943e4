//! Black-box tests of `envoy.service.ratelimit.v3.RateLimitService` over real
//! gRPC with envoyproxy/ratelimit-format configuration, against both stores.

mod common;

use std::{path::Path, time::Duration};

use common::{Backend, RedisServer, Rules, TestServer, default_rules_config, eventually};
use ratelimitd::{
    api::envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{
            RateLimitDescriptor,
            rate_limit_descriptor::{Entry, RateLimitOverride},
        },
        rls::{
            RateLimitRequest, RateLimitResponse, rate_limit_response::Code,
            rate_limit_service_client::RateLimitServiceClient,
        },
    },
    config::{EnvoyAlgorithm, EnvoyFailureMode, EnvoyHitsCounted, EnvoyZeroHits},
};
use tonic::transport::Channel;

/// Units of a day for anything counted more than once, so no test straddles
/// a window boundary by enough to matter.
const CONFIG: &str = r#"
domain: edge
descriptors:
  - key: user
    rate_limit: { unit: day, requests_per_unit: 3 }
  - key: path
    value: "/api/*"
    rate_limit: { unit: day, requests_per_unit: 2 }
  - key: path
    value: "/health"
    rate_limit: { unlimited: true }
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit: { unit: day, requests_per_unit: 1 }
  - key: shadow
    rate_limit: { unit: day, requests_per_unit: 1 }
    shadow_mode: true
  - key: generic
    rate_limit: { name: generic, unit: day, requests_per_unit: 1 }
  - key: special
    rate_limit:
      name: special
      unit: day
      requests_per_unit: 5
      replaces: [ { name: generic } ]
  - key: quota_a
    rate_limit: { unit: day, requests_per_unit: 1 }
    quota_mode: true
  - key: quota_b
    rate_limit: { unit: day, requests_per_unit: 1 }
    quota_mode: true
  - key: fixed
    rate_limit: { unit: second, requests_per_unit: 2 }
  - key: ip
    detailed_metric: true
    rate_limit: { unit: day, requests_per_unit: 10 }
  - key: ninety
    rate_limit: { unit: second, unit_multiplier: 90, requests_per_unit: 2 }
  - key: model
    rate_limit: { name: per-minute, unit: minute, requests_per_unit: 5 }
    also: [ { unit: day, requests_per_unit: 4 } ]
  - key: backend
    rate_limit:
      unit: day
      requests_per_unit: 10
      adaptive: { min: 2, max: 20, increase: 5, decrease: 0.5, interval_ms: 100 }
"#;

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry { key: (*k).to_owned(), value: (*v).to_owned() })
            .collect(),
        ..Default::default()
    }
}

fn request(descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest { domain: "edge".to_owned(), descriptors, hits_addend: 0 }
}

async fn ask(client: &mut RateLimitServiceClient<Channel>, request: RateLimitRequest) -> RateLimitResponse {
    client.should_rate_limit(request).await.expect("ShouldRateLimit").into_inner()
}

fn code(value: i32) -> Code {
    Code::try_from(value).unwrap()
}

struct Setup {
    server: TestServer,
    client: RateLimitServiceClient<Channel>,
    redis: Option<RedisServer>,
    envoy_rules: Rules,
}

async fn start(backend: Backend, tune: impl FnOnce(&mut ratelimitd::config::Config)) -> Setup {
    let envoy = Rules::new(CONFIG);
    let redis = (backend == Backend::Redis).then(RedisServer::start);
    let mut cfg = default_rules_config(redis.as_ref().map(RedisServer::url));
    cfg.rules.envoy_path = Some(envoy.path());
    tune(&mut cfg);
    let server = TestServer::start(cfg).await;
    let endpoint = format!("http://{}", server.addr);
    let client = loop {
        if let Ok(c) = RateLimitServiceClient::connect(endpoint.clone()).await {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    Setup { server, client, redis, envoy_rules: envoy }
}

for_each_store!(
    limits_count_down_per_value_with_upstream_fields,
    wildcards_nested_and_unmatched,
    unlimited_shadow_and_replaces,
    one_descriptor_over_consumes_nothing_from_the_others,
    hits_addend_request_and_descriptor_level,
    quota_mode_denies_only_when_all_quota_descriptors_are_over,
    headers_on_off_and_request_overrides,
    sliding_window_by_default_fixed_window_on_request,
    invalid_requests_are_invalid_argument,
    upstream_metrics_count_as_upstream,
    dynamic_metadata_says_which_limit_fired,
    a_window_of_any_length,
    an_adaptive_limit_follows_outcome_descriptors,
    standard_headers_name_every_policy_and_the_binding_one,
);

/// `adaptive` on a `rate_limit` (ratelimitd's extension): a descriptor
/// whose last entry is `ratelimitd.outcome` reports, for the limit its
/// other entries find, how many requests (its hits) went that way; it
/// counts nothing, and weighs at most what the counter its other entries
/// name was admitted (a value never admitted moves the limit by 0).
/// Failures halve the limit (down to `min`), successes raise it (up to
/// `max`); answers and `/metrics` name the limit in force.
async fn an_adaptive_limit_follows_outcome_descriptors(backend: Backend) {
    let s = start(backend, |_| {}).await;
    let series = "ratelimitd_adaptive_limit{kind=\"envoy\",rule=\"edge.backend\"}";
    let values = std::sync::atomic::AtomicU64::new(0);
    // Admits one hit of a fresh value, then reports 5 of it (1 credited).
    let report = |outcome: &'static str| {
        let mut client = s.client.clone();
        let value = format!("v{}", values.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        async move {
            let admit = descriptor(&[("backend", &value)]);
            let admitted =
                ask(&mut client, RateLimitRequest { hits_addend: 1, ..request(vec![admit]) }).await;
            assert_eq!(code(admitted.overall_code), Code::Ok, "{admitted:?}");
            let d = descriptor(&[("backend", &value), ("ratelimitd.outcome", outcome)]);
            let answer = ask(&mut client, RateLimitRequest { hits_addend: 5, ..request(vec![d]) }).await;
            assert_eq!(code(answer.overall_code), Code::Ok, "an outcome report is never denied");
            assert!(answer.statuses[0].current_limit.is_none(), "nothing counted: {answer:?}");
        }
    };
    // Never admitted: 30 failures of `attacker` move nothing.
    for _ in 0..30 {
        let d = descriptor(&[("backend", "attacker"), ("ratelimitd.outcome", "failure")]);
        ask(&mut s.client.clone(), RateLimitRequest { hits_addend: 5, ..request(vec![d]) }).await;
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(common::metric(&s.server, series).await, Some(10.0), "a value never admitted moved the limit");
    let uncredited = "ratelimitd_adaptive_outcomes_uncredited_total{kind=\"envoy\",rule=\"edge.backend\"} ";
    assert_eq!(common::metric(&s.server, uncredited).await, Some(150.0));
    for _ in 0..3 {
        report("failure").await;
    }
    let lowered = || async { common::metric(&s.server, series).await.is_some_and(|l| l < 10.0) };
    assert!(eventually(Duration::from_secs(5), lowered).await, "failures lowered the limit");
    // Keep failing until it rests at min: 2 admitted, the third denied, none
    // of the 15 reported hits counted.
    let at_min = || async {
        report("failure").await;
        common::metric(&s.server, series).await == Some(2.0)
    };
    assert!(eventually(Duration::from_secs(5), at_min).await, "floored at min");
    let check = |s: &Setup| {
        let mut client = s.client.clone();
        async move {
            ask(
                &mut client,
                RateLimitRequest { hits_addend: 1, ..request(vec![descriptor(&[("backend", "b")])]) },
            )
            .await
        }
    };
    for _ in 0..2 {
        let ok = check(&s).await;
        assert_eq!(code(ok.overall_code), Code::Ok, "{ok:?}");
        assert_eq!(ok.statuses[0].current_limit.as_ref().unwrap().requests_per_unit, 2);
    }
    assert_eq!(code(check(&s).await.overall_code), Code::OverLimit, "the limit in force is 2");
    let raised = || async {
        report("success").await;
        common::metric(&s.server, series).await == Some(20.0)
    };
    assert!(eventually(Duration::from_secs(5), raised).await, "successes raise it, capped at max");
    let unknown = ask(
        &mut s.client.clone(),
        request(vec![descriptor(&[("backend", "c"), ("ratelimitd.outcome", "fine")])]),
    )
    .await;
    // An ordinary descriptor of two entries: `backend` has no nested
    // descriptors, so, as upstream, it matches no limit, and reports nothing.
    assert_eq!(code(unknown.overall_code), Code::Ok, "{unknown:?}");
    let failures =
        "ratelimitd_adaptive_outcomes_total{kind=\"envoy\",rule=\"edge.backend\",outcome=\"failure\"}";
    let before = common::metric(&s.server, failures).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(common::metric(&s.server, failures).await, before);
    s.server.stop().await.unwrap();
}

/// `unit_multiplier` (ratelimitd's extension): 2 per 90 seconds. The wire's
/// unit stays SECOND (it has no multiplier); the draft-03 header says the
/// window, `w=90`; the counter outlives a second.
async fn a_window_of_any_length(backend: Backend) {
    let mut s = start(backend, |c| {
        c.envoy.response_headers = true;
        c.envoy.response_headers_format = ratelimitd::config::EnvoyHeaderFormat::Draft03;
    })
    .await;
    let ask_once = |s: &mut Setup| {
        let mut client = s.client.clone();
        async move { ask(&mut client, request(vec![descriptor(&[("ninety", "n")])])).await }
    };
    for _ in 0..2 {
        assert_eq!(code(ask_once(&mut s).await.overall_code), Code::Ok);
    }
    let denied = ask_once(&mut s).await;
    assert_eq!(code(denied.overall_code), Code::OverLimit);
    let limit = denied.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (2, 1), "2 per SECOND on the wire");
    let header = &denied.response_headers_to_add[0];
    assert_eq!((header.key.as_str(), header.value.as_str()), ("x-ratelimit-limit", "2, 2;w=90"));
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    assert_eq!(code(ask_once(&mut s).await.overall_code), Code::OverLimit, "still counted after a second");
    s.server.stop().await.unwrap();
}

/// With `envoy.response_dynamic_metadata`, each descriptor of upstream's
/// metadata also carries its `code` and the `limitName` of its limit.
async fn dynamic_metadata_says_which_limit_fired(backend: Backend) {
    use prost_types::value::Kind;
    let mut s = start(backend, |c| c.envoy.response_dynamic_metadata = true).await;
    let both = || request(vec![descriptor(&[("user", "zed")]), descriptor(&[("generic", "g")])]);
    ask(&mut s.client, both()).await;
    let r = ask(&mut s.client, both()).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    let metadata = r.dynamic_metadata.expect("dynamic metadata");
    let Some(Kind::ListValue(list)) = &metadata.fields["descriptors"].kind else { panic!("{metadata:?}") };
    let field = |i: usize, name: &str| {
        let Some(Kind::StructValue(d)) = &list.values[i].kind else { panic!("{list:?}") };
        d.fields.get(name).and_then(|v| match &v.kind {
            Some(Kind::StringValue(text)) => Some(text.clone()),
            _ => None,
        })
    };
    assert_eq!(field(0, "code").as_deref(), Some("OK"));
    assert_eq!(field(0, "limitName"), None, "the user limit has no name");
    assert_eq!(field(1, "code").as_deref(), Some("OVER_LIMIT"));
    assert_eq!(field(1, "limitName").as_deref(), Some("generic"));
    s.server.stop().await.unwrap();
}

/// A default-key limit counts per runtime value; statuses carry the limit,
/// what remains and when it resets.
async fn limits_count_down_per_value_with_upstream_fields(backend: Backend) {
    let mut s = start(backend, |_| {}).await;
    for left in (0..3).rev() {
        let r = ask(&mut s.client, request(vec![descriptor(&[("user", "alice")])])).await;
        assert_eq!(code(r.overall_code), Code::Ok);
        let st = &r.statuses[0];
        assert_eq!((code(st.code), st.limit_remaining), (Code::Ok, left));
        let limit = st.current_limit.as_ref().unwrap();
        assert_eq!((limit.requests_per_unit, limit.unit), (3, 4), "DAY is 4");
        assert!(st.duration_until_reset.as_ref().unwrap().seconds > 0);
    }
    let over = ask(&mut s.client, request(vec![descriptor(&[("user", "alice")])])).await;
    assert_eq!((code(over.overall_code), code(over.statuses[0].code)), (Code::OverLimit, Code::OverLimit));
    assert_eq!(over.statuses[0].limit_remaining, 0);
    let bob = ask(&mut s.client, request(vec![descriptor(&[("user", "bob")])])).await;
    assert_eq!(bob.statuses[0].limit_remaining, 2, "each value has its own counter");
    assert!(s.redis.is_none() || s.redis.is_some());
    s.server.stop().await.unwrap();
}

/// envoyproxy/ratelimit's families on `/metrics`, with the labels its
/// Prometheus mapping gives: hits, within, near (past 80%), over and shadow
/// per limit; a `detailed_metric` limit by value, sanitized; malformed
/// requests as `service_error`; every call in `total_requests` and the
/// decided ones in `response_time_seconds`. Off, none of them.
async fn upstream_metrics_count_as_upstream(backend: Backend) {
    let mut s = start(backend, |_| {}).await;
    for _ in 0..7 {
        ask(&mut s.client, request(vec![descriptor(&[("user", "dave")])])).await;
    }
    for _ in 0..3 {
        ask(&mut s.client, request(vec![descriptor(&[("shadow", "s")])])).await;
    }
    ask(&mut s.client, request(vec![descriptor(&[("ip", "10.1.2.3")])])).await;
    ask(&mut s.client, request(vec![descriptor(&[("tenant", "acme"), ("user", "x")])])).await;
    s.client.should_rate_limit(request(vec![])).await.expect_err("no descriptors");
    let addr = s.server.http_addr;
    let (_, scrape) = tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
    for line in [
        // Limit 3, near from floor(3 × 0.8) = 2: the third hit is near.
        r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="user"} 7"#,
        r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="user"} 3"#,
        r#"ratelimit_service_rate_limit_near_limit{domain="edge",key1="user"} 1"#,
        r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="user"} 4"#,
        r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="shadow"} 2"#,
        r#"ratelimit_service_rate_limit_shadow_mode{domain="edge",key1="shadow"} 2"#,
        r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="ip_10_1_2_3"} 1"#,
        r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="tenant_acme",key2="user"} 1"#,
        r#"ratelimit_service_should_rate_limit_error{err_type="service_error"} 1"#,
        r#"ratelimit_service_config_load_success 1"#,
        // Its server families: 13 calls, 12 decided and one refused.
        r#"ratelimit_service_total_requests{grpc_method="ShouldRateLimit"} 13"#,
        r#"ratelimit_service_response_time_seconds_count{grpc_method="ShouldRateLimit"} 12"#,
        r#"ratelimit_service_response_time_seconds_bucket{grpc_method="ShouldRateLimit",le="+Inf"} 12"#,
    ] {
        let family = line.split(['{', ' ']).next().unwrap();
        let seen: Vec<&str> = scrape.lines().filter(|l| l.starts_with(family)).collect();
        assert!(scrape.lines().any(|l| l == line), "missing {line}; {family}: {seen:?}");
    }
    s.server.stop().await.unwrap();

    let mut s = start(backend, |c| c.envoy.upstream_metrics = false).await;
    ask(&mut s.client, request(vec![descriptor(&[("user", "dave")])])).await;
    let addr = s.server.http_addr;
    let (_, scrape) = tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
    assert!(!scrape.contains("ratelimit_service_"), "off: no upstream family");
    s.server.stop().await.unwrap();
}

/// Wildcard values, nested descriptors (the limit of the last entry),
/// unmatched descriptors OK without a limit.
async fn wildcards_nested_and_unmatched(backend: Backend) {
    let mut s = start(backend, |_| {}).await;
    let r = ask(&mut s.client, request(vec![descriptor(&[("path", "/api/users")])])).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().requests_per_unit, 2);
    let r = ask(&mut s.client, request(vec![descriptor(&[("tenant", "acme"), ("user", "x")])])).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().requests_per_unit, 1);
    let r = ask(&mut s.client, request(vec![descriptor(&[("tenant", "acme"), ("user", "x")])])).await;
    assert_eq!(code(r.overall_code), Code::OverLimit);
    // No limit at the tenant level itself, nor for another tenant.
    for entries in
        [vec![("tenant", "acme")], vec![("tenant", "other"), ("user", "x")], vec![("nothing", "here")]]
    {
        let r = ask(&mut s.client, request(vec![descriptor(&entries)])).await;
        assert_eq!(code(r.overall_code), Code::Ok, "{entries:?}");
        assert!(r.statuses[0].current_limit.is_none(), "{entries:?}");
    }
    s.server.stop().await.unwrap();
}

/// Unlimited answers OK with remaining u32::MAX; shadow never denies;
/// a limit named in another's `replaces` does not apply.
async fn unlimited_shadow_and_replaces(backend: Backend) {
    let mut s = start(backend, |_| {}).await;
    for _ in 0..5 {
        let r = ask(&mut s.client, request(vec![descriptor(&[("path", "/health")])])).await;
        assert_eq!((code(r.overall_code), r.statuses[0].limit_remaining), (Code::Ok, u32::MAX));
    }
    for _ in 0..3 {
        let r = ask(&mut s.client, request(vec![descriptor(&[("shadow", "s")])])).await;
        assert_eq!(code(r.overall_code), Code::Ok, "shadow never denies");
        assert_eq!(code(r.statuses[0].code), Code::Ok);
    }
    // generic alone: 1 per day.
    ask(&mut s.client, request(vec![descriptor(&[("generic", "g")])])).await;
    let alone = ask(&mut s.client, request(vec![descriptor(&[("generic", "g")])])).await;
    assert_eq!(code(alone.overall_code), Code::OverLimit);
    // With special, generic is replaced: only special (5) applies.
    for _ in 0..4 {
        let r = ask(
            &mut s.client,
            request(vec![descriptor(&[("generic", "g")]), descriptor(&[("special", "p")])]),
        )
        .await;
        assert_eq!(code(r.overall_code), Code::Ok);
        assert!(r.statuses[0].current_limit.is_none(), "generic is replaced");
    }
    s.server.stop().await.unwrap();
}

/// Better than upstream: when one descriptor is over, the others are not
/// consumed (`envoy.hits_counted: if_admitted`, the default); `always`
/// counts as upstream.
async fn one_descriptor_over_consumes_nothing_from_the_others(backend: Backend) {
    let mut s = start(backend, |_| {}).await;
    let both = || {
        request(vec![descriptor(&[("user", "carol")]), descriptor(&[("tenant", "acme"), ("user", "carol")])])
    };
    let first = ask(&mut s.client, both()).await;
    assert_eq!(code(first.overall_code), Code::Ok);
    for _ in 0..3 {
        let r = ask(&mut s.client, both()).await;
        assert_eq!(code(r.overall_code), Code::OverLimit);
        assert_eq!((code(r.statuses[0].code), code(r.statuses[1].code)), (Code::Ok, Code::OverLimit));
        assert_eq!(r.statuses[0].limit_remaining, 2, "the user limit was not consumed");
    }
    let user_only = ask(&mut s.client, request(vec![descriptor(&[("user", "carol")])])).await;
    assert_eq!(user_only.statuses[0].limit_remaining, 1, "only the first request counted");
    s.server.stop().await.unwrap();

    // envoy.hits_counted: always (upstream's INCRBY): every hit counts, each
    // descriptor on its own, over the limit too.
    let mut s = start(backend, |c| c.envoy.hits_counted = EnvoyHitsCounted::Always).await;
    let answers: Vec<Code> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.push(code(ask(&mut s.client, both()).await.overall_code));
        }
        out
    };
    assert_eq!(answers, [Code::Ok, Code::OverLimit, Code::OverLimit]);
    let user_only = ask(&mut s.client, request(vec![descriptor(&[("user", "carol")])])).await;
    assert_eq!(code(user_only.overall_code), Code::OverLimit, "the denied requests spent user's 3");
    s.server.stop().await.unwrap();
    let mut check_only = descriptor(&[("user", "erin")]);
    check_only.hits_addend = Some(0);
    let mut s = start(backend, |c| {
        c.envoy.hits_counted = EnvoyHitsCounted::Always;
        c.envoy.zero_hits = EnvoyZeroHits::WithinLimit;
    })
    .await;
    // With upstream's 0-hit answer: a denied hit still counts, so a check
    // at the limit passes and one past it (4 hits against 3) does not.
    for _ in 0..3 {
        ask(&mut s.client, request(vec![descriptor(&[("user", "erin")])])).await;
    }
    let at = ask(&mut s.client, request(vec![check_only.clone()])).await;
    assert_eq!(code(at.overall_code), Code::Ok, "at the limit");
    let over = ask(&mut s.client, request(vec![descriptor(&[("user", "erin")])])).await;
    assert_eq!(code(over.overall_code), Code::OverLimit);
    let past = ask(&mut s.client, request(vec![check_only])).await;
    assert_eq!(code(past.overall_code), Code::OverLimit, "the denied hit was counted");
    s.server.stop().await.unwrap();
}

/// hits_addend: the request's (0 means 1), overridden per descriptor (0 =
/// check only: whether one more hit fits, or as upstream whether the count
/// is within the limit).
async fn hits_addend_request_and_descriptor_level(backend: Backend) {
    let mut s = start(backend, |_| {}).await;
    let mut r = request(vec![descriptor(&[("user", "dave")])]);
    r.hits_addend = 2;
    assert_eq!(ask(&mut s.client, r.clone()).await.statuses[0].limit_remaining, 1);
    assert_eq!(code(ask(&mut s.client, r).await.overall_code), Code::OverLimit, "1 left < 2 hits");
    let mut check_only = descriptor(&[("user", "dave")]);
    check_only.hits_addend = Some(0);
    let peek = ask(&mut s.client, request(vec![check_only.clone()])).await;
    assert_eq!((code(peek.overall_code), peek.statuses[0].limit_remaining), (Code::Ok, 1));
    let mut one = descriptor(&[("user", "dave")]);
    one.hits_addend = Some(1);
    let mut req = request(vec![one]);
    req.hits_addend = 50; // the descriptor's own wins
    assert_eq!(ask(&mut s.client, req).await.statuses[0].limit_remaining, 0);
    // At the limit, a 0-hit check says what the next hit would get.
    let peek = ask(&mut s.client, request(vec![check_only.clone()])).await;
    assert_eq!(code(peek.overall_code), Code::OverLimit, "next_hit: no hit fits any more");
    s.server.stop().await.unwrap();

    // envoy.zero_hits: within_limit (upstream's answer): OK while the count
    // is within the limit, so at it; a hit is still refused there.
    let mut s = start(backend, |c| c.envoy.zero_hits = EnvoyZeroHits::WithinLimit).await;
    for _ in 0..3 {
        ask(&mut s.client, request(vec![descriptor(&[("user", "dave")])])).await;
    }
    let peek = ask(&mut s.client, request(vec![check_only])).await;
    assert_eq!((code(peek.overall_code), peek.statuses[0].limit_remaining), (Code::Ok, 0));
    let hit = ask(&mut s.client, request(vec![descriptor(&[("user", "dave")])])).await;
    assert_eq!(code(hit.overall_code), Code::OverLimit);
    s.server.stop().await.unwrap();
}

/// Quota descriptors make the request OVER_LIMIT only when all of them are over.
async fn quota_mode_denies_only_when_all_quota_descriptors_are_over(backend: Backend) {
    let mut s = start(backend, |_| {}).await;
    ask(&mut s.client, request(vec![descriptor(&[("quota_a", "x")])])).await;
    let one_over =
        ask(&mut s.client, request(vec![descriptor(&[("quota_a", "x")]), descriptor(&[("quota_b", "x")])]))
            .await;
    assert_eq!(code(one_over.overall_code), Code::Ok);
    assert_eq!(code(one_over.statuses[0].code), Code::OverLimit);
    let both_over =
        ask(&mut s.client, request(vec![descriptor(&[("quota_a", "x")]), descriptor(&[("quota_b", "x")])]))
            .await;
    assert_eq!(code(both_over.overall_code), Code::OverLimit);
    s.server.stop().await.unwrap();
}

/// Headers only when enabled, from the descriptor closest to its limit;
/// a request's limit override applies instead of the configuration only
/// where `envoy.allow_request_limits` names the domain.
async fn headers_on_off_and_request_overrides(backend: Backend) {
    let mut off = start(backend, |_| {}).await;
    let r = ask(&mut off.client, request(vec![descriptor(&[("user", "erin")])])).await;
    assert!(r.response_headers_to_add.is_empty());
    off.server.stop().await.unwrap();

    let mut on = start(backend, |c| {
        c.envoy.response_headers = true;
        c.envoy.allow_request_limits = true;
        c.envoy.request_limit_domains = vec!["edge".to_owned()];
    })
    .await;
    let r = ask(
        &mut on.client,
        request(vec![descriptor(&[("user", "erin")]), descriptor(&[("path", "/api/x")])]),
    )
    .await;
    let h: Vec<(String, String)> =
        r.response_headers_to_add.iter().map(|h| (h.key.clone(), h.value.clone())).collect();
    assert_eq!(h[0], ("x-ratelimit-limit".to_owned(), "2".to_owned()), "the path limit is closer: {h:?}");
    assert_eq!(h[1], ("x-ratelimit-remaining".to_owned(), "1".to_owned()));
    assert_eq!(h[2].0, "x-ratelimit-reset");
    assert!(h[2].1.parse::<u64>().unwrap() > 0);

    let mut overridden = descriptor(&[("user", "frank")]);
    overridden.limit = Some(RateLimitOverride { requests_per_unit: 10, unit: 4 });
    let r = ask(&mut on.client, request(vec![overridden])).await;
    assert_eq!(
        (r.statuses[0].current_limit.as_ref().unwrap().requests_per_unit, r.statuses[0].limit_remaining),
        (10, 9)
    );
    on.server.stop().await.unwrap();

    // Off by default: the configured limit (3 a day for a user) applies.
    let mut closed = start(backend, |_| {}).await;
    let mut ignored = descriptor(&[("user", "frank")]);
    ignored.limit = Some(RateLimitOverride { requests_per_unit: 1_000, unit: 4 });
    let r = ask(&mut closed.client, request(vec![ignored])).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().requests_per_unit, 3);
    closed.server.stop().await.unwrap();
}

/// The algorithm is what the configuration says: after one hit on a
/// 1-second limit, a sliding window needs until the end of the *next* window
/// to forget it (2W - elapsed > 1 s), a fixed window only until the end of
/// this one (W - elapsed <= 1 s). (What crossing the edge does is tested on
/// the arithmetic itself, with a controlled clock.)
async fn sliding_window_by_default_fixed_window_on_request(backend: Backend) {
    for (algorithm, more_than_a_second) in
        [(EnvoyAlgorithm::SlidingWindow, true), (EnvoyAlgorithm::FixedWindow, false)]
    {
        let mut s = start(backend, |c| c.envoy.algorithm = algorithm).await;
        let r = ask(&mut s.client, request(vec![descriptor(&[("fixed", "one")])])).await;
        let reset = r.statuses[0].duration_until_reset.unwrap();
        let reset_ms = reset.seconds * 1_000 + i64::from(reset.nanos / 1_000_000);
        assert_eq!(reset_ms > 1_000, more_than_a_second, "{algorithm:?}: reset in {reset_ms} ms");
        assert!(reset_ms > 0 && reset_ms <= 2_000, "{algorithm:?}: reset in {reset_ms} ms");
        s.server.stop().await.unwrap();
    }
}

/// Empty domain, no descriptors and empty keys are INVALID_ARGUMENT with
/// the field named; a request limit of an unknown unit is ignored and an
/// oversized request denied, never an error a proxy may answer with "allow".
async fn invalid_requests_are_invalid_argument(backend: Backend) {
    let mut s = start(backend, |_| {}).await;
    let mut no_domain = request(vec![descriptor(&[("user", "x")])]);
    no_domain.domain.clear();
    let cases = [
        (no_domain, "domain: must not be empty"),
        (request(vec![]), "descriptors: must not be empty"),
        (request(vec![descriptor(&[])]), "descriptors[0].entries: must not be empty"),
        (request(vec![descriptor(&[("", "v")])]), "descriptors[0].entries[0].key: must not be empty"),
        (
            request((0..65).map(|_| descriptor(&[("k", "v")])).collect()),
            "descriptors: 65 exceed the maximum of 64",
        ),
    ];
    for (bad, expected) in cases {
        let status = s.client.should_rate_limit(bad).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().starts_with(expected), "{:?} vs {expected:?}", status.message());
    }
    for unit in [0, 99] {
        let mut bad_unit = descriptor(&[("user", "unit")]);
        bad_unit.limit = Some(RateLimitOverride { requests_per_unit: 1_000, unit });
        let r = ask(&mut s.client, request(vec![bad_unit])).await;
        let limit = r.statuses[0].current_limit.as_ref().expect("the configured limit");
        assert_eq!((code(r.overall_code), limit.requests_per_unit), (Code::Ok, 3), "unit {unit}: configured");
    }
    // An entry's size is not structure: a 1,100-byte value is counted, by
    // its digest, exactly like a short one (the user limit is 3 a day).
    let long = "x".repeat(1_100);
    let answers: Vec<i32> = {
        let mut out = Vec::new();
        for _ in 0..4 {
            out.push(ask(&mut s.client, request(vec![descriptor(&[("user", &long)])])).await.overall_code);
        }
        out
    };
    assert_eq!(
        answers.iter().map(|c| code(*c)).collect::<Vec<_>>(),
        [Code::Ok, Code::Ok, Code::Ok, Code::OverLimit]
    );
    // Nor is the request's size: one over grpc.max_message_bytes (the
    // client's headers copied into many descriptors) is denied unread.
    let huge = "y".repeat(8_000);
    let oversized = request((0..40).map(|_| descriptor(&[("user", &huge)])).collect());
    let r = ask(&mut s.client, oversized).await;
    assert_eq!((code(r.overall_code), r.statuses.len()), (Code::OverLimit, 0), "{r:?}");
    s.server.stop().await.unwrap();
}

/// Redis down: `local` (the default) limits at this instance's share (the
/// user limit, 3 a day: one instance) and flags every answer with
/// `x-ratelimit-error`, to the client and to the upstream; `allow` answers
/// OK, flagged; `unavailable` answers gRPC UNAVAILABLE so Envoy's
/// failure_mode_deny decides. Each records every failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn store_failure_follows_the_failure_mode() {
    for mode in [EnvoyFailureMode::Local, EnvoyFailureMode::Allow, EnvoyFailureMode::Unavailable] {
        let mut s = start(Backend::Redis, |c| {
            c.envoy.failure_mode = mode;
            c.redis.timeout_ms = 200;
        })
        .await;
        s.redis.as_mut().unwrap().stop();
        let calls = if mode == EnvoyFailureMode::Local { 4 } else { 1 };
        let mut codes = Vec::new();
        for _ in 0..calls {
            let result = s.client.should_rate_limit(request(vec![descriptor(&[("user", "gina")])])).await;
            if mode == EnvoyFailureMode::Unavailable {
                assert_eq!(result.unwrap_err().code(), tonic::Code::Unavailable);
                continue;
            }
            let r = result.unwrap().into_inner();
            for headers in [&r.response_headers_to_add, &r.request_headers_to_add] {
                let flag: Vec<_> = headers.iter().filter(|h| h.key == "x-ratelimit-error").collect();
                assert_eq!(flag.len(), 1, "{mode:?}: flagged once: {headers:?}");
                assert!(!flag[0].value.is_empty(), "{mode:?}: names the failure kind");
            }
            codes.push(code(r.overall_code));
        }
        let expected: &[Code] = match mode {
            EnvoyFailureMode::Local => &[Code::Ok, Code::Ok, Code::Ok, Code::OverLimit],
            EnvoyFailureMode::Allow => &[Code::Ok],
            EnvoyFailureMode::Unavailable => &[],
        };
        assert_eq!(codes, expected, "{mode:?}");
        let addr = s.server.http_addr;
        let (_, scrape) =
            tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
        for line in [
            format!(r#"ratelimit_service_should_rate_limit_error{{err_type="redis_error"}} {calls}"#),
            format!(r#"ratelimit_service_rate_limit_total_hits{{domain="edge",key1="user"}} {calls}"#),
        ] {
            assert!(scrape.lines().any(|l| l == line), "{mode:?}: missing {line}");
        }
        let records = s.server.stop_and_read_dlq().await;
        assert_eq!(records.len(), calls, "{mode:?}: {records:?}");
        assert_eq!(records[0].rule_id, "edge.user");
        assert_eq!(records[0].request.resource_path, "envoy:edge");
        assert_eq!(records[0].request.user_id, "86400|user=gina");
        let reasons: Vec<&str> = records.iter().map(|r| r.answer.reason.as_str()).collect();
        let expected: &[&str] = match mode {
            EnvoyFailureMode::Local => &["LOCAL_OK", "LOCAL_OK", "LOCAL_OK", "LOCAL_OVER_LIMIT"],
            EnvoyFailureMode::Allow => &["FAIL_OPEN"],
            EnvoyFailureMode::Unavailable => &["FAIL_CLOSED"],
        };
        assert_eq!(reasons, expected, "{mode:?}");
    }
}

/// Config reload: a rename over the file is picked up; a broken file keeps
/// the last good configuration.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envoy_config_hot_reloads_and_keeps_last_good() {
    let mut s = start(Backend::Memory, |_| {}).await;
    let limit_of = |r: RateLimitResponse| r.statuses[0].current_limit.as_ref().map(|l| l.requests_per_unit);
    let dir: &Path = s.envoy_rules.dir.path();
    let broken = CONFIG.replace("requests_per_unit: 3 }", "requests_per_unit: 3, unit_typo: 1 }");
    std::fs::write(dir.join(".tmp"), broken).unwrap();
    std::fs::rename(dir.join(".tmp"), dir.join("rules.yaml")).unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(limit_of(ask(&mut s.client, request(vec![descriptor(&[("user", "h")])])).await), Some(3));
    s.envoy_rules.rename_over(&CONFIG.replace("requests_per_unit: 3 }", "requests_per_unit: 30 }"));
    let reloaded =
        eventually(Duration::from_secs(10), || {
            let mut client = s.client.clone();
            async move {
                limit_of(ask(&mut client, request(vec![descriptor(&[("user", "h2")])])).await) == Some(30)
            }
        })
        .await;
    assert!(reloaded);
    s.server.stop().await.unwrap();
}

/// Behind Envoy one connection carries every tenant's requests, so the
/// tenant's share is what keeps one tenant from queueing the others: with
/// Redis paused (every script call held), twelve requests of tenants the
/// table does not name wait for their shared share of 4 (8 wait), and
/// acme's four, on the same connection, find acme's share free. All are
/// decided by the store once it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_envoy_connection_still_shares_the_store_by_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let tenants = dir.path().join("tenants.yaml");
    std::fs::write(&tenants, "tenants:\n  - { name: acme }\n").unwrap();
    let s = start(Backend::Redis, |c| {
        c.redis.timeout_ms = 10_000;
        c.grpc.max_store_calls_per_tenant = 4;
        c.overload.tenants_path = Some(tenants.clone());
    })
    .await;
    // One call first: the dispatchers' connections are open before the pause.
    let warm = request(vec![descriptor(&[("user", "warm")])]);
    assert_eq!(code(ask(&mut s.client.clone(), warm).await.overall_code), Code::Ok);
    let mut admin = s.redis.as_ref().unwrap().client().await;
    let () =
        ::redis::cmd("CLIENT").arg("PAUSE").arg(2_000).arg("WRITE").query_async(&mut admin).await.unwrap();
    let calls: Vec<_> = (0..16)
        .map(|i| {
            let tenant = if i < 4 { "acme".to_owned() } else { format!("tenant{i}") };
            let user = format!("user{i}");
            let asked = request(vec![descriptor(&[("tenant", &tenant)]), descriptor(&[("user", &user)])]);
            let mut client = s.client.clone();
            tokio::spawn(async move { ask(&mut client, asked).await })
        })
        .collect();
    for call in calls {
        let answer = call.await.unwrap();
        assert_eq!(code(answer.overall_code), Code::Ok, "{answer:?}");
        assert!(answer.response_headers_to_add.iter().all(|h| h.key != "x-ratelimit-error"), "{answer:?}");
    }
    let addr = s.server.http_addr;
    let (_, scrape) = tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
    for line in [
        r#"ratelimitd_store_call_waits_total{share="tenant"} 8"#,
        r#"ratelimitd_store_call_waits_total{share="connection"} 0"#,
    ] {
        assert!(scrape.lines().any(|l| l == line), "missing {line}");
    }
    s.server.stop().await.unwrap();
}

/// `telemetry.statsd_addr`: upstream's counters arrive over UDP under
/// upstream's names; an address that does not resolve (a statsd pod not
/// yet up) is tried again, never fatal: the service starts and decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statsd_gets_upstream_counters_and_an_unresolved_host_is_not_fatal() {
    let receiver = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    receiver.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let addr = receiver.local_addr().unwrap().to_string();
    let mut s = start(Backend::Memory, |c| {
        c.telemetry.statsd_addr = Some(addr);
        c.telemetry.statsd_flush_interval_ms = 100;
    })
    .await;
    ask(&mut s.client, request(vec![descriptor(&[("user", "statsd")])])).await;
    let expected = "ratelimit.service.rate_limit.edge.user.total_hits:1|c";
    let lines = tokio::task::spawn_blocking(move || {
        let (mut buf, mut lines) = ([0u8; 4096], Vec::<String>::new());
        while !lines.iter().any(|l| l == expected) {
            let n = receiver.recv(&mut buf).expect("a datagram within 5 s");
            lines.extend(String::from_utf8_lossy(&buf[..n]).lines().map(str::to_owned));
        }
        lines
    })
    .await;
    assert!(lines.is_ok(), "{expected} received");
    s.server.stop().await.unwrap();

    let mut s = start(Backend::Memory, |c| {
        c.telemetry.statsd_addr = Some("statsd.invalid:8125".to_owned());
        c.telemetry.statsd_flush_interval_ms = 100;
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let answer = ask(&mut s.client, request(vec![descriptor(&[("user", "x")])])).await;
    assert_eq!(code(answer.overall_code), Code::Ok);
    s.server.stop().await.unwrap();
}

/// The draft-11 fields as a Structured Field List (RFC 8941): each member's
/// policy name and its integer parameters.
fn sf_list(value: &str) -> Vec<(String, Vec<(String, i64)>)> {
    let list = sfv::Parser::new(value).parse::<sfv::List>().unwrap_or_else(|e| panic!("{value:?}: {e}"));
    list.into_iter()
        .map(|member| {
            let sfv::ListEntry::Item(item) = member else { panic!("{value:?}: an inner list") };
            let sfv::BareItem::String(name) = &item.bare_item else { panic!("{value:?}: not a string") };
            let params = item
                .params
                .iter()
                .map(|(key, value)| (key.as_str().to_owned(), value.as_integer().map_or(-1, i64::from)))
                .collect();
            (name.as_str().to_owned(), params)
        })
        .collect()
}

/// `envoy.ratelimit_headers` (here for the domain alone): the standard
/// `RateLimit-Policy` lists every limit a request met, each once, by name
/// (a further `also` limit as the name and `#1`; an unnamed limit by its
/// key), with its quota and window in seconds; `RateLimit` names the one
/// that binds, with what is left and the seconds until it resets. Both
/// parse as RFC 8941 lists. Off for a domain set to false.
async fn standard_headers_name_every_policy_and_the_binding_one(backend: Backend) {
    let mut s = start(backend, |c| {
        c.envoy.domain_ratelimit_headers = [("edge".to_owned(), true)].into();
    })
    .await;
    let fields = |r: &RateLimitResponse| {
        let get =
            |name: &str| r.response_headers_to_add.iter().find(|h| h.key == name).map(|h| sf_list(&h.value));
        (get("RateLimit-Policy"), get("RateLimit"))
    };
    // The day's 4 (the `also` limit) bind before the minute's 5.
    let r = ask(&mut s.client, request(vec![descriptor(&[("model", "m1")])])).await;
    let (Some(policies), Some(current)) = fields(&r) else { panic!("{r:?}") };
    let param = |params: &[(String, i64)], key: &str| params.iter().find(|(k, _)| k == key).map(|(_, v)| *v);
    let listed: Vec<(&str, Option<i64>, Option<i64>)> =
        policies.iter().map(|(n, p)| (n.as_str(), param(p, "q"), param(p, "w"))).collect();
    assert_eq!(listed, [("per-minute", Some(5), Some(60)), ("per-minute#1", Some(4), Some(86_400))]);
    let (name, params) = &current[0];
    assert_eq!((name.as_str(), param(params, "r")), ("per-minute#1", Some(3)), "{current:?}");
    // Whole again once the (sliding) day and the next have passed.
    assert!(param(params, "t").is_some_and(|t| (1..=2 * 86_400).contains(&t)), "{current:?}");

    // Three descriptors: the user's 3 a day (2 left) bind; every policy once.
    let three =
        vec![descriptor(&[("model", "m2")]), descriptor(&[("user", "gus")]), descriptor(&[("model", "m3")])];
    let r = ask(&mut s.client, request(three)).await;
    let (Some(policies), Some(current)) = fields(&r) else { panic!("{r:?}") };
    let names: Vec<&str> = policies.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["per-minute", "per-minute#1", "edge.user"], "{policies:?}");
    assert_eq!((current[0].0.as_str(), param(&current[0].1, "r")), ("edge.user", Some(2)), "{current:?}");
    s.server.stop().await.unwrap();

    let mut off = start(backend, |c| {
        c.envoy.ratelimit_headers = true;
        c.envoy.domain_ratelimit_headers = [("edge".to_owned(), false)].into();
    })
    .await;
    let r = ask(&mut off.client, request(vec![descriptor(&[("user", "hal")])])).await;
    assert_eq!(fields(&r), (None, None), "off for the domain: {r:?}");
    off.server.stop().await.unwrap();
}
