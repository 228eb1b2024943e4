//! Envoy's Rate Limit Quota Service over gRPC, against a running server
//! with Envoy rules: each bucket's limit is shared out among the streams
//! that report it, by demand; a bucket no rule limits is allowed whole;
//! streams and buckets are bounded; a bucket not reported is abandoned.

mod common;

use std::time::Duration;

use common::{RedisServer, Rules, TestServer, config};
use ratelimitd::api::envoy_pb::{
    envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy},
    rlqs::{
        BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
        rate_limit_quota_response::bucket_action::BucketAction,
        rate_limit_quota_service_client::RateLimitQuotaServiceClient,
        rate_limit_quota_usage_reports::BucketQuotaUsage,
    },
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Streaming};

/// One Envoy's stream: what it sends, what it is answered.
struct Envoy {
    send: mpsc::Sender<RateLimitQuotaUsageReports>,
    answers: Streaming<RateLimitQuotaResponse>,
}

async fn open(server: &TestServer) -> Result<Envoy, tonic::Status> {
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://{}", server.addr)).await.unwrap();
    let (send, receive) = mpsc::channel(4);
    let answers = client.stream_rate_limit_quotas(ReceiverStream::new(receive)).await?.into_inner();
    Ok(Envoy { send, answers })
}

/// How a stream the server refuses ends: refused at once, or at its first
/// report (tonic may answer the call before the refusal arrives).
async fn refusal(server: &TestServer) -> tonic::Status {
    match open(server).await {
        Ok(mut envoy) => {
            envoy.send.send(RateLimitQuotaUsageReports::default()).await.ok();
            envoy.next().await.unwrap_err()
        }
        Err(status) => status,
    }
}

fn bucket(entries: &[(&str, &str)]) -> BucketId {
    BucketId { bucket: entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect() }
}

impl Envoy {
    /// Reports `allowed` and `denied` of `bucket` over a second; the answer.
    async fn report(
        &mut self,
        domain: &str,
        id: &BucketId,
        (allowed, denied): (u64, u64),
    ) -> RateLimitQuotaResponse {
        let usage = BucketQuotaUsage {
            bucket_id: Some(id.clone()),
            time_elapsed: Some(prost_types::Duration { seconds: 1, nanos: 0 }),
            num_requests_allowed: allowed,
            num_requests_denied: denied,
        };
        let reports =
            RateLimitQuotaUsageReports { domain: domain.to_owned(), bucket_quota_usages: vec![usage] };
        self.send.send(reports).await.unwrap();
        self.next().await.unwrap()
    }

    async fn next(&mut self) -> Result<RateLimitQuotaResponse, tonic::Status> {
        tokio::time::timeout(Duration::from_secs(5), self.answers.message())
            .await
            .expect("an answer in time")
            .and_then(|answer| answer.ok_or_else(|| tonic::Status::unknown("the stream ended")))
    }
}

/// What an answer assigns its one bucket: a token bucket's (max_tokens,
/// tokens_per_fill, fill interval s, ttl s), or a blanket rule.
fn assigned(answer: &RateLimitQuotaResponse) -> Result<(u32, u32, i64, i64), BlanketRule> {
    let action = answer.bucket_action[0].bucket_action.unwrap();
    let BucketAction::QuotaAssignmentAction(assignment) = action else { panic!("{answer:?}") };
    let ttl = assignment.assignment_time_to_live.unwrap().seconds;
    match assignment.rate_limit_strategy.unwrap().strategy.unwrap() {
        Strategy::TokenBucket(b) => {
            Ok((b.max_tokens, b.tokens_per_fill.unwrap(), b.fill_interval.unwrap().seconds, ttl))
        }
        Strategy::BlanketRule(rule) => Err(BlanketRule::try_from(rule).unwrap()),
        other => panic!("{other:?}"),
    }
}

const ENVOY_RULES: &str = "domain: edge\ndescriptors:\n  - key: route\n    value: chat\n    rate_limit: { unit: minute, requests_per_unit: 300 }\n  - key: route\n    value: free\n    rate_limit: { unlimited: true }\n";

async fn server(
    tune: impl FnOnce(&mut ratelimitd::config::Config),
) -> (TestServer, (Rules, tempfile::TempDir)) {
    server_on(None, tune).await
}

/// A server with the Envoy rules, on Redis at `url` or in memory.
async fn server_on(
    url: Option<String>,
    tune: impl FnOnce(&mut ratelimitd::config::Config),
) -> (TestServer, (Rules, tempfile::TempDir)) {
    let rules = Rules::new("rules:\n  - { rule_id: a, resource_path: /a, limit: 1, window_seconds: 1 }\n");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("edge.yaml"), ENVOY_RULES).unwrap();
    let mut cfg = config(&rules.path(), url);
    cfg.rules.envoy_path = Some(dir.path().to_path_buf());
    tune(&mut cfg);
    (TestServer::start(cfg).await, (rules, dir))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buckets_limit_is_shared_out_among_its_envoys_by_demand() {
    shared_out_by_demand(None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buckets_limit_is_shared_out_among_its_envoys_by_demand_in_redis() {
    let redis = RedisServer::start();
    shared_out_by_demand(Some(redis.url())).await;
}

async fn shared_out_by_demand(url: Option<String>) {
    let (server, _dir) = server_on(url, |_| {}).await;
    let chat = bucket(&[("route", "chat")]);
    let mut a = open(&server).await.unwrap();
    // Alone, 100 a second: all of 300 a minute less the bursts (6) and a
    // token: a bucket of 5 refilled with 288 a minute, for 20 s.
    assert_eq!(assigned(&a.report("edge", &chat, (100, 0)).await), Ok((5, 288, 60, 20)));
    // A second Envoy with the same demand: nothing is free while the
    // first may enforce its share.
    let mut b = open(&server).await.unwrap();
    assert_eq!(assigned(&b.report("edge", &chat, (0, 100)).await), Err(BlanketRule::DenyAll));
    // The first reports: lowered to half; once it enforces it (its next
    // report), the second gets the rest: all but what the first admitted
    // in the window (175 of 292).
    assert_eq!(assigned(&a.report("edge", &chat, (50, 50)).await), Ok((2, 144, 60, 20)));
    assert_eq!(assigned(&a.report("edge", &chat, (25, 75)).await), Ok((2, 144, 60, 20)));
    assert_eq!(assigned(&b.report("edge", &chat, (0, 100)).await), Ok((2, 115, 60, 20)));
    // Unlimited, or under no rule: allowed whole.
    for id in [bucket(&[("route", "free")]), bucket(&[("route", "x")])] {
        assert_eq!(assigned(&a.report("edge", &id, (1, 0)).await), Err(BlanketRule::AllowAll), "{id:?}");
    }
    // A hostile elapsed time (i64::MAX seconds) is read, saturated.
    let usage = BucketQuotaUsage {
        bucket_id: Some(chat.clone()),
        time_elapsed: Some(prost_types::Duration { seconds: i64::MAX, nanos: 0 }),
        num_requests_allowed: u64::MAX,
        num_requests_denied: u64::MAX,
    };
    let reports = RateLimitQuotaUsageReports { domain: "edge".to_owned(), bucket_quota_usages: vec![usage] };
    b.send.send(reports).await.unwrap();
    let answer = b.next().await.expect("the stream lives on");
    assert_eq!(answer.bucket_action[0].bucket_id, Some(chat), "{answer:?}");
    // Per domain: two Envoys, two buckets under a limit, 8 reports of
    // which 2 of buckets no limit holds.
    let figure = |name: &str| {
        let series = format!("ratelimitd_rlqs_{name}{{domain=\"edge\"}} ");
        let server = &server;
        async move { common::metric(server, &series).await }
    };
    assert_eq!(figure("envoys").await, Some(2.0));
    assert_eq!(figure("buckets").await, Some(2.0));
    assert_eq!(figure("reports_total").await, Some(8.0));
    assert_eq!(figure("unmatched_total").await, Some(2.0));
    assert_eq!(figure("unanswered_total").await, Some(0.0));
    assert!(figure("assigned_per_second").await.unwrap() >= 146.0 / 60.0);
    drop((a, b));
    // The streams end: nothing held any more.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while figure("envoys").await != Some(0.0) && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!((figure("envoys").await, figure("buckets").await), (Some(0.0), Some(0.0)));
    assert_eq!(figure("assigned_per_second").await, Some(0.0));
    server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_are_bounded_need_a_domain_and_idle_buckets_are_abandoned() {
    let (server, _dir) = server(|cfg| {
        cfg.rlqs.max_streams = 2;
        cfg.rlqs.abandon_after_ms = 300;
    })
    .await;
    let chat = bucket(&[("route", "chat")]);
    let mut a = open(&server).await.unwrap();
    a.report("edge", &chat, (1, 0)).await;
    let mut nameless = open(&server).await.unwrap();
    nameless.send.send(RateLimitQuotaUsageReports::default()).await.unwrap();
    assert_eq!(nameless.next().await.unwrap_err().code(), Code::InvalidArgument);
    let b = open(&server).await.unwrap();
    // Two open (the nameless one ended): a third is refused.
    let third = refusal(&server).await;
    assert_eq!(third.code(), Code::ResourceExhausted, "{third:?}");
    // Not reported for 300 ms: abandoned.
    let abandoned = a.next().await.unwrap();
    let action = abandoned.bucket_action[0].clone();
    assert_eq!(action.bucket_id, Some(chat));
    assert!(matches!(action.bucket_action, Some(BucketAction::AbandonAction(_))), "{abandoned:?}");
    drop((a, b, nameless));
    server.stop().await.unwrap();
}

/// Reported demand moves the limit others live under: with
/// `grpc.reporting_peers` set, a caller outside it cannot open a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_reporting_peers_stream_quota_usage() {
    let (server, _files) = server(|cfg| cfg.grpc.reporting_peers = vec!["127.0.0.2".to_owned()]).await;
    let refused = refusal(&server).await;
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    server.stop().await.unwrap();
}

/// Two instances on one Redis: the Envoys reporting to either share one
/// bucket's limit, as if they reported to one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_of_two_instances_on_one_redis_share_one_limit() {
    let redis = RedisServer::start();
    let (one, _one) = server_on(Some(redis.url()), |_| {}).await;
    let (two, _two) = server_on(Some(redis.url()), |_| {}).await;
    let chat = bucket(&[("route", "chat")]);
    let mut a = open(&one).await.unwrap();
    let mut b = open(&two).await.unwrap();
    assert_eq!(assigned(&a.report("edge", &chat, (0, 100)).await), Ok((5, 288, 60, 20)));
    // On the other instance: nothing is free while the first may enforce it.
    assert_eq!(assigned(&b.report("edge", &chat, (0, 100)).await), Err(BlanketRule::DenyAll));
    assert_eq!(assigned(&a.report("edge", &chat, (50, 50)).await), Ok((2, 144, 60, 20)));
    assert_eq!(assigned(&a.report("edge", &chat, (25, 75)).await), Ok((2, 144, 60, 20)));
    assert_eq!(assigned(&b.report("edge", &chat, (0, 100)).await), Ok((2, 144, 60, 20)));
    // The first instance stops (its stream breaks): its Envoy's share is
    // still counted while the assignment may live, so the second gets no
    // more.
    drop(a);
    one.stop().await.unwrap();
    assert_eq!(assigned(&b.report("edge", &chat, (25, 75)).await), Ok((2, 144, 60, 20)));
    let mut conn = redis.client().await;
    let keys: Vec<String> = redis::cmd("KEYS").arg("*rlq:*").query_async(&mut conn).await.unwrap();
    assert_eq!(keys.len(), 1, "the bucket's holders: {keys:?}");
    drop(b);
    two.stop().await.unwrap();
}

/// `quota.lua` is the twin of `quota::allot`: 1,500 random reports of four
/// holders of two buckets answer exactly the shares the Rust function
/// computes at the script's clock, and leave Redis holding the same
/// holders.
#[tokio::test]
async fn the_quota_script_is_the_twin_of_allot() {
    use std::{collections::BTreeMap, sync::Arc};

    use ratelimitd::{
        limiter::{
            lease::{Lease, RegionState},
            scripts,
        },
        quota::{BucketLimit, Holding, allot},
    };
    let redis = RedisServer::start();
    let mut conn = redis.client().await;
    let lease = Lease { lease_ms: 40, skew_ms: 15 };
    let limits = [BucketLimit { limit: 300, window_ms: 20 }, BucketLimit { limit: 7, window_ms: 30 }];
    let keys = ["rlq:{edge}:a", "rlq:{edge}:b"];
    let names: Vec<Arc<str>> = ["i1/1", "i1/2", "i2/1", "i2/10"].into_iter().map(Arc::from).collect();
    let mut twins: Vec<BTreeMap<Arc<str>, RegionState>> = vec![BTreeMap::new(); keys.len()];
    let mut random = common::xorshift(0x9e37_79b9_7f4a_7c15_u64);
    for round in 0..1_500 {
        let (k, holder) = (random(2) as usize, &names[random(4) as usize]);
        let limit = limits[k];
        let held = twins[k].get(holder).map_or(0, |s| s.offered.max(s.confirmed));
        let enforcing = if random(4) == 0 { random(400) } else { held };
        let holding = Holding { enforcing, admitted: random(enforcing + 1), demand: random(600) };
        let mut call = scripts::QUOTA.call();
        call.arg(1).arg(keys[k]);
        call.arg(&**holder).arg(limit.limit).arg(lease.lease_ms).arg(lease.skew_ms).arg(limit.window_ms);
        call.arg(60_000).arg(holding.enforcing).arg(holding.admitted).arg(holding.demand);
        let answer = scripts::run(&mut conn, std::slice::from_ref(&call)).await.unwrap().pop().unwrap();
        let answer: Vec<u64> = redis::from_redis_value(answer).unwrap();
        let now = answer[0];
        let twin = allot(&mut twins[k], holder, limit, holding, (now, lease));
        assert_eq!(answer[1], twin, "round {round}, bucket {k}, holder {holder}");
        let stored: std::collections::HashMap<String, String> =
            redis::cmd("HGETALL").arg(keys[k]).query_async(&mut conn).await.unwrap();
        let expected: std::collections::HashMap<String, String> = twins[k]
            .iter()
            .map(|(h, s)| {
                (h.to_string(), format!("{} {} {} {}", s.offered, s.confirmed, s.lease_until_ms, s.demand))
            })
            .collect();
        assert_eq!(stored, expected, "round {round}, bucket {k}");
        // Leases run out now and then (40 ms, trusted 15 ms past).
        if random(15) == 0 {
            tokio::time::sleep(Duration::from_millis(random(80))).await;
        }
    }
}

/// A bucket of a `global: true` limit in two regions, each with its own
/// Redis: its holders are kept in the coordination store, so the Envoys of
/// both regions share the one limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoys_of_two_regions_share_a_global_buckets_limit() {
    let envoy = tempfile::tempdir().unwrap();
    std::fs::write(
        envoy.path().join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: route\n    rate_limit: { unit: minute, requests_per_unit: 300, global: true }\n",
    )
    .unwrap();
    let (servers, stores) =
        common::two_regions(|config| config.rules.envoy_path = Some(envoy.path().to_path_buf())).await;
    let chat = bucket(&[("route", "chat")]);
    let mut a = open(&servers[0]).await.unwrap();
    let mut b = open(&servers[1]).await.unwrap();
    assert_eq!(assigned(&a.report("edge", &chat, (0, 100)).await), Ok((5, 288, 60, 20)));
    assert_eq!(assigned(&b.report("edge", &chat, (0, 100)).await), Err(BlanketRule::DenyAll));
    assert_eq!(assigned(&a.report("edge", &chat, (50, 50)).await), Ok((2, 144, 60, 20)));
    assert_eq!(assigned(&a.report("edge", &chat, (25, 75)).await), Ok((2, 144, 60, 20)));
    assert_eq!(assigned(&b.report("edge", &chat, (0, 100)).await), Ok((2, 144, 60, 20)));
    // In the coordination store; neither region's own.
    for (i, store) in stores.iter().enumerate() {
        let mut conn = store.client().await;
        let keys: Vec<String> = redis::cmd("KEYS").arg("*rlq:*").query_async(&mut conn).await.unwrap();
        assert_eq!(keys.len(), usize::from(i == 0), "store {i}: {keys:?}");
    }
    drop((a, b));
    for server in servers {
        server.stop().await.unwrap();
    }
}

/// A stream is answered at most `rlqs.max_bucket_reports_per_second`
/// bucket reports a second: five messages of two buckets at 10 a second
/// (a burst of two) take at least 0.8 s past the first, each answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_bucket_reports_are_paced() {
    let (server, _dir) = server(|cfg| {
        cfg.rlqs.max_bucket_reports_per_second = 10;
        cfg.rlqs.max_buckets_per_stream = 2;
    })
    .await;
    let mut envoy = open(&server).await.unwrap();
    let usage = |id: BucketId| BucketQuotaUsage {
        bucket_id: Some(id),
        time_elapsed: Some(prost_types::Duration { seconds: 1, nanos: 0 }),
        num_requests_allowed: 1,
        num_requests_denied: 0,
    };
    let message = || RateLimitQuotaUsageReports {
        domain: "edge".to_owned(),
        bucket_quota_usages: vec![usage(bucket(&[("route", "chat")])), usage(bucket(&[("route", "free")]))],
    };
    envoy.send.send(message()).await.unwrap();
    assert_eq!(envoy.next().await.unwrap().bucket_action.len(), 2);
    let started = std::time::Instant::now();
    for _ in 0..5 {
        envoy.send.send(message()).await.unwrap();
        assert_eq!(envoy.next().await.unwrap().bucket_action.len(), 2);
    }
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(750), "{took:?}");
    drop(envoy);
    server.stop().await.unwrap();
}
