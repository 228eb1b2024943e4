//! Envoy rules over xDS, black-box: a small aggregated discovery server
//! written here (the vendored protos; `common::xds`), as Envoy Gateway's
//! control plane would serve envoyproxy/ratelimit, and ratelimitd
//! subscribed to it with `rules.source: xds`.

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use common::{TestServer, default_rules_config, management_server, management_server_with};
use prost::Message as _;
use ratelimitd::api::envoy_pb::{
    envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
    rls::{RateLimitRequest, rate_limit_response::Code, rate_limit_service_client::RateLimitServiceClient},
    rls_config::{self, RateLimitConfig, RateLimitPolicy, RateLimitUnit},
};
use ratelimitd::{api::xds::TYPE_URL, config::RulesSource};
use tonic::transport::Channel;

/// One resource: domain `domain`, descriptor `user` at `per_minute`.
fn resource(name: &str, domain: &str, per_minute: u32) -> prost_types::Any {
    let config = RateLimitConfig {
        name: name.to_owned(),
        domain: domain.to_owned(),
        descriptors: vec![rls_config::RateLimitDescriptor {
            key: "user".to_owned(),
            rate_limit: Some(RateLimitPolicy {
                unit: RateLimitUnit::Minute as i32,
                requests_per_unit: per_minute,
                name: "per-user".to_owned(),
                ..Default::default()
            }),
            ..Default::default()
        }],
    };
    prost_types::Any { type_url: TYPE_URL.to_owned(), value: config.encode_to_vec() }
}

async fn subscribed(server_url: &str, force_start: bool) -> TestServer {
    subscribed_with(server_url, force_start, |_| {}).await
}

async fn subscribed_with(
    server_url: &str,
    force_start: bool,
    tune: impl FnOnce(&mut ratelimitd::config::Config),
) -> TestServer {
    let mut cfg = default_rules_config(None);
    cfg.rules.source = RulesSource::Xds;
    cfg.rules.xds.server_url = server_url.to_owned();
    cfg.rules.xds.node_id = "gateway-ratelimit".to_owned();
    cfg.rules.xds.node_metadata.insert("zone".to_owned(), "a".to_owned());
    cfg.rules.xds.force_start = force_start;
    cfg.rules.xds.retry_initial_ms = 50;
    tune(&mut cfg);
    TestServer::start(cfg).await
}

async fn client(server: &TestServer) -> RateLimitServiceClient<Channel> {
    RateLimitServiceClient::connect(format!("http://{}", server.addr)).await.unwrap()
}

/// The limit `user` = `user` answers with in domain `edge` (0: none).
async fn limit_of(client: &mut RateLimitServiceClient<Channel>, user: &str) -> (Code, u32) {
    answer_of(client, user).await.unwrap()
}

/// [`limit_of`], or the call's error.
async fn answer_of(
    client: &mut RateLimitServiceClient<Channel>,
    user: &str,
) -> Result<(Code, u32), tonic::Status> {
    let request = RateLimitRequest {
        domain: "edge".to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry { key: "user".to_owned(), value: user.to_owned() }],
            ..Default::default()
        }],
        hits_addend: 0,
    };
    let response = client.should_rate_limit(request).await?.into_inner();
    let limit = response.statuses[0].current_limit.as_ref().map_or(0, |l| l.requests_per_unit);
    Ok((Code::try_from(response.overall_code).unwrap(), limit))
}

/// Waits until `check` holds, polling.
async fn eventually<F: std::future::Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check().await {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The node announces itself; each set swaps in and is acknowledged with
/// its version and nonce; a set that does not compile, or an empty one, is
/// refused with the errors while the last good one keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sets_swap_in_are_acknowledged_and_a_bad_one_is_refused() {
    let (set, seen, url) = management_server(Some(("1".to_owned(), vec![resource("edge", "edge", 2)]))).await;
    let server = subscribed(&url, false).await;
    let mut client = client(&server).await;
    assert_eq!(limit_of(&mut client, "ann").await, (Code::Ok, 2), "served from the first set");
    let first = seen.lock().unwrap()[0].clone();
    let node = first.node.expect("the node");
    assert_eq!(node.id, "gateway-ratelimit");
    assert_eq!(format!("{:?}", node.metadata.unwrap().fields["zone"].kind), r#"Some(StringValue("a"))"#);
    assert_eq!((first.type_url.as_str(), first.version_info.as_str()), (TYPE_URL, ""));
    let acked = |version: &'static str, nonce: &'static str| {
        let seen = Arc::clone(&seen);
        move || {
            let seen = Arc::clone(&seen);
            async move {
                seen.lock().unwrap().iter().any(|r| {
                    r.version_info == version && r.response_nonce == nonce && r.error_detail.is_none()
                })
            }
        }
    };
    eventually("v1 acknowledged", acked("1", "1")).await;

    set.send_replace(Some(("2".to_owned(), vec![resource("edge", "edge", 5)])));
    eventually("v2 in force", || {
        let mut client = client.clone();
        async move { limit_of(&mut client, "cy").await == (Code::Ok, 5) }
    })
    .await;
    eventually("v2 acknowledged", acked("2", "2")).await;

    // Two resources for one domain do not compile: refused, v2 stays.
    set.send_replace(Some(("3".to_owned(), vec![resource("a", "edge", 7), resource("b", "edge", 8)])));
    let nack = Arc::clone(&seen);
    eventually("v3 refused", move || {
        let nack = Arc::clone(&nack);
        async move {
            nack.lock().unwrap().iter().any(|r| {
                r.response_nonce == "3"
                    && r.version_info == "2"
                    && r.error_detail.as_ref().is_some_and(|e| e.message.contains("duplicate domain"))
            })
        }
    })
    .await;
    assert_eq!(limit_of(&mut client, "di").await, (Code::Ok, 5), "the last good set keeps serving");

    // An empty set would lift every limit: refused too (rules.allow_empty off).
    set.send_replace(Some(("4".to_owned(), vec![])));
    let nack = Arc::clone(&seen);
    eventually("the empty v4 refused", move || {
        let nack = Arc::clone(&nack);
        async move {
            nack.lock().unwrap().iter().any(|r| {
                r.response_nonce == "4"
                    && r.version_info == "2"
                    && r.error_detail.as_ref().is_some_and(|e| e.message.contains("no rules"))
            })
        }
    })
    .await;
    assert_eq!(limit_of(&mut client, "ed").await, (Code::Ok, 5), "the last good set keeps serving");
    let addr = server.http_addr;
    let (_, scrape) = tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
    for line in
        [r#"ratelimitd_rules_xds_total{result="ack"} 2"#, r#"ratelimitd_rules_xds_total{result="nack"} 2"#]
    {
        assert!(scrape.lines().any(|l| l == line), "missing {line}");
    }
    server.stop().await.unwrap();
}

/// `rules.xds.force_start`: without a first set the service starts at
/// once, and answers every `ShouldRateLimit` with UNAVAILABLE (never OK:
/// Envoy's failure_mode_deny keeps a fail-closed gateway closed) until the
/// set comes; then it decides by the set.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn force_start_serves_before_the_first_set() {
    let (set, _seen, url) = management_server(None).await;
    let server = subscribed(&url, true).await;
    let mut client = client(&server).await;
    let refused = answer_of(&mut client, "ed").await.expect_err("no configuration yet");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("rules.xds.force_start"), "{refused:?}");
    set.send_replace(Some(("1".to_owned(), vec![resource("edge", "edge", 3)])));
    eventually("the first set in force", || {
        let mut client = client.clone();
        async move { answer_of(&mut client, "ed").await.ok() == Some((Code::Ok, 3)) }
    })
    .await;
    server.stop().await.unwrap();
}

/// Over mTLS: with the CA and a client certificate the set arrives; without
/// a client certificate the server refuses the connection, and nothing is
/// ever served (force_start, so the service runs meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mutual_tls_to_the_management_server() {
    let dir = tempfile::tempdir().unwrap();
    common::make_ca(dir.path(), "ca");
    common::make_leaf(dir.path(), "ca", "server", "serverAuth");
    common::make_leaf(dir.path(), "ca", "client", "clientAuth");
    let initial = Some(("1".to_owned(), vec![resource("edge", "edge", 4)]));
    let (_set, _seen, url) = management_server_with(initial, Some(dir.path())).await;
    let path = |name: &str| Some(dir.path().join(name));
    let server = subscribed_with(&url, false, |c| {
        c.rules.xds.ca_file = path("ca.pem");
        c.rules.xds.cert_file = path("client.pem");
        c.rules.xds.key_file = path("client.key");
    })
    .await;
    assert_eq!(limit_of(&mut client(&server).await, "fay").await, (Code::Ok, 4));
    server.stop().await.unwrap();

    let server = subscribed_with(&url, true, |c| c.rules.xds.ca_file = path("ca.pem")).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let refused =
        answer_of(&mut client(&server).await, "fay").await.expect_err("no client certificate: no set");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    server.stop().await.unwrap();
}

/// Without `force_start` nothing is answered before the first set, and
/// `/readyz` says why; it is ready once the set is in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn not_ready_until_the_first_set() {
    let (set, _seen, url) = management_server(None).await;
    let mut cfg = default_rules_config(None);
    cfg.rules.source = RulesSource::Xds;
    cfg.rules.xds.server_url = url;
    let server = TestServer::start_unready(cfg).await;
    let addr = server.http_addr;
    let readyz = move || async move {
        tokio::task::spawn_blocking(move || common::http_get(addr, "/readyz")).await.unwrap()
    };
    eventually("/readyz answers", || async { readyz().await.0 != 0 }).await;
    let (status, body) = readyz().await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("waiting for the first rate-limit configuration over xDS"), "{body}");
    set.send_replace(Some(("1".to_owned(), vec![resource("edge", "edge", 6)])));
    eventually("ready with the set", || async { readyz().await.0 == 200 }).await;
    assert_eq!(limit_of(&mut client(&server).await, "gus").await, (Code::Ok, 6));
    server.stop().await.unwrap();
}
