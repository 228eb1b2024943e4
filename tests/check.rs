//! Black-box tests of `ratelimit.v1.RateLimiter/Check` over real gRPC, each
//! scenario run once against the in-memory store and once against a real
//! `redis-server`.

mod common;

use std::time::Duration;

use common::{
    Backend, ConfigMapRules, H2_START, Rules, check, eventually, grpc_headers, h2_frame, reason, request,
};
use ratelimitd::api::pb::{PriorityBucket, Reason};

/// Windows of one day: a test never straddles enough of a window boundary
/// for the previous window's decay to admit one request more (that would
/// need `admitted * elapsed >= W`), so counts are exact and deterministic.
const RULES: &str = r#"
rules:
  - { rule_id: limited, resource_path: /limited, limit: 5, window_seconds: 86400 }
  - { rule_id: limited-android, resource_path: /limited, client_type: ANDROID_MOBILE, limit: 2, window_seconds: 86400 }
  - { rule_id: burst, resource_path: /burst, limit: 10, window_seconds: 86400, burst_capacity: 1.5 }
  - { rule_id: api, resource_path: "/api/*", limit: 3, window_seconds: 86400, priority_bucket: BULK }
  - { rule_id: shadow, resource_path: /shadow, limit: 1, window_seconds: 86400, mode: shadow }
  - { rule_id: hot, resource_path: /hot, limit: 100, window_seconds: 86400 }
  - { rule_id: llm, resource_path: /llm, limit: 100, window_seconds: 86400, also: [ { limit: 5000000000, period: day, unit: output_tokens } ] }
"#;

const DAY_MS: i64 = 86_400_000;

for_each_store!(
    decisions_count_down_and_deny_with_exact_fields,
    rules_match_by_path_and_client_type,
    weights_and_burst,
    never_admissible_weight_says_so,
    shadow_rules_count_but_never_deny,
    invalid_requests_are_rejected_with_the_field,
    concurrent_callers_admit_exactly_the_limit,
    hot_reload_sees_rename_over,
    hot_reload_sees_configmap_symlink_swap,
    invalid_rule_file_keeps_the_last_good_snapshot,
    report_and_peek_over_grpc,
    usage_of_other_units_over_grpc,
    check_batch_decides_in_order_and_answers_each_item,
    check_stream_answers_every_item_by_id,
);

fn item(id: u64, user: &str, path: &str) -> ratelimitd::api::pb::CheckItem {
    ratelimitd::api::pb::CheckItem { id, request: Some(request(user, path)) }
}

/// `CheckBatch`: items decided as Checks, answered in item order with their ids;
/// an invalid item is answered with why while the others are decided; a
/// batch over the item cap is refused by name.
async fn check_batch_decides_in_order_and_answers_each_item(backend: Backend) {
    use ratelimitd::api::pb::CheckBatchRequest;
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;
    // 7 on a limit of 5 (ids counting down), one invalid, one without a rule.
    let mut items: Vec<_> = (0..7).map(|i| item(100 - i, "bee", "/limited")).collect();
    items.push(item(7, "", "/limited"));
    items.push(item(8, "bee", "/nowhere"));
    let results = client.check_batch(CheckBatchRequest { items }).await.unwrap().into_inner().results;
    let ids: Vec<u64> = results.iter().map(|r| r.id).collect();
    assert_eq!(ids, [100, 99, 98, 97, 96, 95, 94, 7, 8]);
    // Decided concurrently, like concurrent Checks: exactly 5 admitted,
    // not necessarily the first 5.
    let allowed = results[..7].iter().filter(|r| r.response.as_ref().unwrap().allowed).count();
    assert_eq!(allowed, 5, "limit 5");
    assert!(results[7].response.is_none());
    assert!(results[7].invalid_argument.contains("user_id"), "{:?}", results[7]);
    assert_eq!(reason(results[8].response.as_ref().unwrap()), Reason::NoRule);
    // The batch counted like Checks: the next Check is denied.
    assert!(!check(&mut client, request("bee", "/limited")).await.allowed);

    let items = (0..=ratelimitd::api::MAX_BATCH_ITEMS as u64).map(|i| item(i, "cy", "/hot")).collect();
    let status = client.check_batch(CheckBatchRequest { items }).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().starts_with("items: 1025 items, at most 1024"), "{}", status.message());
    assert!(check(&mut client, request("cy", "/hot")).await.allowed, "a refused batch counted nothing");
    server.stop().await.unwrap();
}

/// `CheckStream`: 1,000 items over one stream (more than are decided at a
/// time) each get one result with their id; exactly the limit is admitted
/// among those sharing a counter, whatever the order of the answers.
async fn check_stream_answers_every_item_by_id(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;
    // Users dee-0..dee-9 on /hot (limit 100), 100 items each, of which
    // dee-9's ids 99, 199, … 999 are invalid (no user id).
    let items: Vec<_> = (0..1_000u64)
        .map(
            |i| if i % 100 == 99 { item(i, "", "/hot") } else { item(i, &format!("dee-{}", i % 10), "/hot") },
        )
        .collect();
    let mut results = client.check_stream(futures_util::stream::iter(items)).await.unwrap().into_inner();
    let mut seen = vec![false; 1_000];
    let (mut allowed, mut invalid) = (0, 0);
    while let Some(result) = results.message().await.unwrap() {
        let id = usize::try_from(result.id).unwrap();
        assert!(!std::mem::replace(&mut seen[id], true), "id {id} answered twice");
        match result.response {
            Some(response) => allowed += usize::from(response.allowed),
            None => {
                assert_eq!(id % 100, 99, "only the invalid items are refused");
                invalid += 1;
            }
        }
    }
    assert!(seen.iter().all(|s| *s), "every item answered");
    assert_eq!((allowed, invalid), (990, 10), "990 valid items, at most 100 per user");
    // 110 more items for dee-9, who had 90 of 100: exactly 10 fit.
    let items: Vec<_> = (0..110).map(|i| item(i, "dee-9", "/hot")).collect();
    let mut results = client.check_stream(futures_util::stream::iter(items)).await.unwrap().into_inner();
    let mut allowed = 0;
    while let Some(result) = results.message().await.unwrap() {
        allowed += usize::from(result.response.unwrap().allowed);
    }
    assert_eq!(allowed, 10, "dee-9 had 90 of 100");
    server.stop().await.unwrap();
}

/// `Report` counts usage past the limit and answers for the next request;
/// `peek` checks without counting; `peek` on `Report` is refused by name.
async fn report_and_peek_over_grpc(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;

    let mut peek = request("rae", "/limited");
    peek.peek = true;
    peek.weight = 5;
    for _ in 0..2 {
        let r = check(&mut client, peek.clone()).await;
        assert_eq!((r.allowed, r.remaining_tokens, reason(&r)), (true, 5, Reason::Ok), "{r:?}");
    }
    let mut usage = request("rae", "/limited");
    usage.weight = 8;
    let r = client.report(usage.clone()).await.unwrap().into_inner();
    assert_eq!((r.allowed, r.remaining_tokens, reason(&r)), (false, 0, Reason::OverLimit), "{r:?}");
    assert!(r.retry_after_ms > 0 && r.retry_after_ms <= 2 * DAY_MS, "{r:?}");
    assert_eq!(r.rule_id, "limited");
    let next = check(&mut client, request("rae", "/limited")).await;
    assert_eq!(reason(&next), Reason::OverLimit, "the report was counted past the limit");
    peek.weight = 1;
    assert!(!check(&mut client, peek.clone()).await.allowed);

    usage.peek = true;
    let refused = client.report(usage).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("peek"), "{}", refused.message());

    // The report refused nothing: REPORT, allowed, never a denial.
    let addr = server.http_addr;
    let (_, metrics) = tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
    assert!(
        metrics.contains(
            r#"ratelimitd_decisions_total{api="check",rule="limited",reason="REPORT",allowed="true"} 1"#
        ),
        "{metrics}"
    );
    server.stop().await.unwrap();
}

/// `usage` over gRPC: a limit of output tokens counts the request's, the
/// answer names the unit of the limit it describes and what is left of it
/// past 32 bits; a report of usage is counted past the limit.
async fn usage_of_other_units_over_grpc(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;
    let mut call = request("uma", "/llm");
    call.usage.insert("output_tokens".to_owned(), 500_000_000);
    call.usage.insert("unknown_unit".to_owned(), 7);
    let first = check(&mut client, call.clone()).await;
    assert!(first.allowed, "{first:?}");
    // 4.5e9 output tokens left (a share of 90 %) bind before 99 requests of 100.
    assert_eq!((first.unit.as_str(), first.remaining), ("output_tokens", 4_500_000_000), "{first:?}");
    assert_eq!(first.remaining_tokens, u32::MAX, "the 32-bit field saturates");
    call.usage.insert("output_tokens".to_owned(), 4_500_000_001);
    let over = check(&mut client, call.clone()).await;
    assert_eq!(
        (over.allowed, reason(&over), over.unit.as_str()),
        (false, Reason::OverLimit, "output_tokens")
    );
    let r = client.report(call).await.unwrap().into_inner();
    assert_eq!((r.allowed, r.remaining), (false, 0), "the report counted past the limit: {r:?}");
    let plain = check(&mut client, request("uma", "/limited")).await;
    assert_eq!((plain.unit.as_str(), plain.remaining), ("", 4), "a limit of requests: {plain:?}");

    // Reserve, then settle: 900 million estimated, 100 million used.
    let mut reserve = request("ria", "/llm");
    reserve.usage.insert("output_tokens".to_owned(), 900_000_000);
    reserve.reserve = true;
    let reserved = check(&mut client, reserve.clone()).await;
    assert!(reserved.allowed && reserved.reservation.starts_with("r1|llm|"), "{reserved:?}");
    assert_eq!(reserved.remaining, 4_100_000_000);
    let mut settle = request("ria", "/llm");
    settle.usage.insert("output_tokens".to_owned(), 100_000_000);
    settle.reservation = reserved.reservation.clone();
    let settled = client.report(settle.clone()).await.unwrap().into_inner();
    assert_eq!((settled.unit.as_str(), settled.remaining), ("output_tokens", 4_900_000_000), "{settled:?}");
    let again = client.report(settle.clone()).await.unwrap().into_inner();
    assert_eq!(again.remaining, 4_900_000_000, "settled once: {again:?}");
    let mut garbled = settle.clone();
    garbled.reservation = "r1|llm|not-a-number".to_owned();
    for (message, field) in [(garbled, "reservation"), (reserve.clone(), "reserve")] {
        let status = client.report(message).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{field}");
        assert!(status.message().starts_with(field), "{}", status.message());
    }
    let mut check_with_id = request("ria", "/llm");
    check_with_id.reservation = reserved.reservation;
    let status = client.check(check_with_id).await.unwrap_err();
    assert!(status.message().starts_with("reservation: must be empty on Check"), "{}", status.message());
    server.stop().await.unwrap();
}

/// The limit admits exactly `limit` requests, `remaining` counts down, and
/// the first denial carries the rule, reason and a retry inside the window.
async fn decisions_count_down_and_deny_with_exact_fields(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;

    for expected_remaining in (0..5).rev() {
        let r = check(&mut client, request("alice", "/limited")).await;
        assert!(r.allowed, "{r:?}");
        assert_eq!(reason(&r), Reason::Ok);
        assert_eq!(r.remaining_tokens, expected_remaining);
        assert_eq!(r.retry_after_ms, 0);
        assert_eq!(r.rule_id, "limited");
        assert_eq!((r.limit, r.capacity, r.window_ms), (5, 5, DAY_MS));
        assert_eq!(r.cluster_utilization_status, "NORMAL");
        assert!(r.reset_after_ms > DAY_MS && r.reset_after_ms <= 2 * DAY_MS, "{r:?}");
    }
    let denied = check(&mut client, request("alice", "/limited")).await;
    assert!(!denied.allowed);
    assert_eq!(reason(&denied), Reason::OverLimit);
    assert_eq!(denied.remaining_tokens, 0);
    assert!(denied.retry_after_ms > 0 && denied.retry_after_ms <= 2 * DAY_MS, "{denied:?}");

    // Another user has their own counter.
    let bob = check(&mut client, request("bob", "/limited")).await;
    assert!(bob.allowed);
    assert_eq!(bob.remaining_tokens, 4);
    server.stop().await.unwrap();
}

/// Exact path beats prefix, client-specific beats any-client, unmatched
/// paths are allowed with NO_RULE and count nothing.
async fn rules_match_by_path_and_client_type(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;

    let mut android = request("carol", "/limited");
    android.client_type = "ANDROID_MOBILE".to_owned();
    let r = check(&mut client, android.clone()).await;
    assert_eq!((r.rule_id.as_str(), r.limit), ("limited-android", 2));
    check(&mut client, android.clone()).await;
    assert_eq!(reason(&check(&mut client, android).await), Reason::OverLimit);
    // The any-client rule for the same path has its own counter.
    let r = check(&mut client, request("carol", "/limited")).await;
    assert_eq!((r.rule_id.as_str(), r.remaining_tokens), ("limited", 4));

    let r = check(&mut client, request("carol", "/api/v2/things")).await;
    assert_eq!(r.rule_id, "api");

    for _ in 0..10 {
        let r = check(&mut client, request("carol", "/nowhere")).await;
        assert!(r.allowed);
        assert_eq!(reason(&r), Reason::NoRule);
        assert_eq!(r.rule_id, "");
    }
    server.stop().await.unwrap();
}

/// A request of weight w costs w tokens; burst raises the capacity to
/// floor(limit x burst) and the response says so.
async fn weights_and_burst(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;

    let mut heavy = request("dave", "/burst");
    heavy.weight = 12;
    let r = check(&mut client, heavy).await;
    assert!(r.allowed);
    assert_eq!((r.limit, r.capacity, r.remaining_tokens), (10, 15, 3));
    let mut four = request("dave", "/burst");
    four.weight = 4;
    let r = check(&mut client, four).await;
    assert!(!r.allowed, "4 > 3 remaining");
    assert_eq!(r.remaining_tokens, 3, "a denied request consumes nothing");
    let mut three = request("dave", "/burst");
    three.weight = 3;
    assert!(check(&mut client, three).await.allowed);
    // weight 0 means 1.
    let r = check(&mut client, request("erin", "/burst")).await;
    assert_eq!(r.remaining_tokens, 14);
    server.stop().await.unwrap();
}

/// A weight above the capacity can never pass: denied with its own reason
/// and retry_after -1, without consuming anything.
async fn never_admissible_weight_says_so(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;

    let mut huge = request("frank", "/limited");
    huge.weight = 6;
    let r = check(&mut client, huge).await;
    assert!(!r.allowed);
    assert_eq!(reason(&r), Reason::WeightExceedsCapacity);
    assert_eq!(r.retry_after_ms, -1);
    let r = check(&mut client, request("frank", "/limited")).await;
    assert_eq!(r.remaining_tokens, 4, "the huge request consumed nothing");
    server.stop().await.unwrap();
}

/// Shadow rules count exactly like enforced ones and report what they would
/// have denied, but always allow.
async fn shadow_rules_count_but_never_deny(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;

    let first = check(&mut client, request("gina", "/shadow")).await;
    assert!(first.allowed && !first.shadow_denied);
    for _ in 0..3 {
        let r = check(&mut client, request("gina", "/shadow")).await;
        assert!(r.allowed, "{r:?}");
        assert!(r.shadow_denied, "{r:?}");
        assert_eq!(reason(&r), Reason::Ok);
        assert_eq!(r.retry_after_ms, 0);
    }
    let mut huge = request("gina", "/shadow");
    huge.weight = 2;
    let r = check(&mut client, huge).await;
    assert!(r.allowed && r.shadow_denied);
    server.stop().await.unwrap();
}

/// Broken structure is INVALID_ARGUMENT with a message naming the field,
/// counted by reason; sizes never are: a 300-byte user id and 100 headers
/// are decided (the id counted by its digest, exactly).
async fn invalid_requests_are_rejected_with_the_field(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;

    let cases: Vec<(common::Request, &str)> = vec![
        (request("", "/limited"), "user_id: must not be empty"),
        (request("u", ""), "resource_path: must not be empty"),
    ];
    for (bad, expected) in cases {
        let status = client.check(bad).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().starts_with(expected), "{:?} vs {expected:?}", status.message());
    }
    // A valid priority is accepted; one this service does not know reads
    // as none stated (the rule's), never as an error a proxy may allow.
    let mut ok = request("u", "/limited");
    ok.priority = PriorityBucket::Bulk as i32;
    assert!(check(&mut client, ok).await.allowed);
    let mut unknown = request("u", "/limited");
    unknown.priority = 42;
    let answer = check(&mut client, unknown).await;
    assert!(answer.allowed);
    assert_eq!(answer.priority, PriorityBucket::Degraded as i32, "the default, as if none was stated");
    // Sizes are not structure: decided, and the long id is limited exactly.
    let long = "u".repeat(300);
    let mut crowded = request(&long, "/limited");
    crowded.headers = (0..100).map(|i| (format!("h{i}"), "v".to_owned())).collect();
    for _ in 0..5 {
        assert!(check(&mut client, crowded.clone()).await.allowed);
    }
    let sixth = check(&mut client, crowded).await;
    assert_eq!((sixth.allowed, reason(&sixth)), (false, Reason::OverLimit));
    let scrape = server.observer().await.metrics.render();
    assert!(
        scrape.contains("ratelimitd_requests_refused_total{api=\"check\",reason=\"empty_user_id\"} 1"),
        "{scrape}"
    );
    assert!(
        scrape
            .contains("ratelimitd_request_values_adjusted_total{api=\"check\",reason=\"user_id_digest\"} 6"),
        "{scrape}"
    );
    server.stop().await.unwrap();
}

/// A server on the in-memory store, its `grpc.*` as `set` leaves them.
async fn grpc_server(
    rules: &Rules,
    set: impl FnOnce(&mut ratelimitd::config::GrpcConfig),
) -> common::TestServer {
    let mut config = common::config(&rules.path(), None);
    set(&mut config.grpc);
    common::TestServer::start(config).await
}

/// A `Check` or `Report` over `grpc.max_message_bytes` is denied, never
/// failed (a fail-open proxy would allow on an error), before it is read;
/// a `CheckStream` item over it fails its stream with RESOURCE_EXHAUSTED;
/// `CheckBatch` has its own, larger bound. The connection keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_single_decisions_are_denied_and_batches_bounded_apart() {
    use ratelimitd::api::pb::{CheckBatchRequest, CheckItem};
    let rules = Rules::new(RULES);
    let server = grpc_server(&rules, |grpc| {
        grpc.max_message_bytes = 4_096;
        grpc.max_batch_message_bytes = 16_384;
    })
    .await;
    let mut client = server.client().await;
    let mut big = request("u", "/limited");
    // 40 headers of 200 bytes: within limits.max_headers and
    // limits.max_header_bytes, but over 4 KiB as a whole.
    big.headers = (0..40).map(|i| (format!("h{i}"), "v".repeat(200))).collect();
    for answer in
        [check(&mut client, big.clone()).await, client.report(big.clone()).await.unwrap().into_inner()]
    {
        assert!(!answer.allowed, "{answer:?}");
        assert_eq!((reason(&answer), answer.retry_after_ms), (Reason::RequestTooLarge, -1), "{answer:?}");
        assert_eq!(answer.cluster_utilization_status, "NORMAL");
    }
    // Nothing was counted: 5 of 5 left.
    assert_eq!(check(&mut client, request("u", "/limited")).await.remaining_tokens, 4);
    let item = |request| CheckItem { id: 1, request: Some(request) };
    let mut stream =
        client.check_stream(futures_util::stream::iter([item(big.clone())])).await.unwrap().into_inner();
    let status = futures_util::StreamExt::next(&mut stream).await.unwrap().unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("grpc.max_message_bytes"), "{:?}", status.message());
    // A batch of the same item is within its bound; four times over it is not.
    let batch = client.check_batch(CheckBatchRequest { items: vec![item(big.clone())] }).await.unwrap();
    assert!(batch.into_inner().results[0].response.as_ref().unwrap().allowed, "decided: 4 left");
    let status = client.check_batch(CheckBatchRequest { items: vec![item(big); 4] }).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("16384"), "{:?}", status.message());
    assert_eq!(common::metric(&server, "ratelimitd_grpc_requests_oversized_total").await, Some(4.0));
    assert!(check(&mut client, request("u", "/limited")).await.allowed);
    server.stop().await.unwrap();
}

/// What a client speaking raw HTTP/2 sees: the preface and an empty
/// SETTINGS sent, then nothing more (no SETTINGS ACK, no PING answered);
/// the server's frames as (type, flags, payload) for up to `wait`, and
/// whether it closed the connection meanwhile.
async fn silent_h2_client(addr: std::net::SocketAddr, wait: Duration) -> (Vec<(u8, u8, Vec<u8>)>, bool) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    socket.write_all(H2_START).await.unwrap();
    let deadline = tokio::time::Instant::now() + wait;
    let mut frames = Vec::new();
    loop {
        let mut head = [0u8; 9];
        match tokio::time::timeout_at(deadline, socket.read_exact(&mut head)).await {
            Err(_) => return (frames, false),
            Ok(Err(_)) => return (frames, true),
            Ok(Ok(_)) => {}
        }
        let len = usize::from(head[0]) << 16 | usize::from(head[1]) << 8 | usize::from(head[2]);
        let mut payload = vec![0; len];
        match tokio::time::timeout_at(deadline, socket.read_exact(&mut payload)).await {
            Err(_) => return (frames, false),
            Ok(Err(_)) => return (frames, true),
            Ok(Ok(_)) => frames.push((head[3], head[4], payload)),
        }
    }
}

/// `grpc.max_concurrent_streams` is advertised in the server's first
/// SETTINGS (SETTINGS_MAX_CONCURRENT_STREAMS, 0x3): what one connection
/// can hold open is bounded (tonic would advertise no limit at all).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_per_connection_are_bounded_by_the_servers_settings() {
    let rules = Rules::new(RULES);
    let server = grpc_server(&rules, |grpc| grpc.max_concurrent_streams = 7).await;
    let (frames, _) = silent_h2_client(server.addr, Duration::from_millis(300)).await;
    let (kind, flags, settings) = frames.first().expect("the server sent nothing");
    assert_eq!((*kind, *flags), (4, 0), "first frame {frames:?}");
    let advertised: Vec<(u16, u32)> = settings
        .chunks_exact(6)
        .map(|s| (u16::from_be_bytes([s[0], s[1]]), u32::from_be_bytes([s[2], s[3], s[4], s[5]])))
        .collect();
    assert!(advertised.contains(&(3, 7)), "SETTINGS {advertised:?}");
    server.stop().await.unwrap();
}

/// `grpc.keepalive_interval_ms`: a connection whose peer stopped answering
/// (a vanished host) is pinged, then closed once the PING goes unanswered
/// for `grpc.keepalive_timeout_ms`; with keepalive off it stays open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_keepalive_closes_the_connection() {
    let rules = Rules::new(RULES);
    for interval_ms in [100, 0] {
        let server = grpc_server(&rules, |grpc| {
            grpc.keepalive_interval_ms = interval_ms;
            grpc.keepalive_timeout_ms = 100;
        })
        .await;
        let (frames, closed) =
            silent_h2_client(server.addr, Duration::from_secs(if interval_ms > 0 { 10 } else { 1 })).await;
        let pinged = frames.iter().any(|(kind, flags, _)| *kind == 6 && flags & 1 == 0);
        assert_eq!(
            (pinged, closed),
            (interval_ms > 0, interval_ms > 0),
            "interval {interval_ms} ms: {frames:?}"
        );
        server.stop().await.unwrap();
    }
}

/// `grpc.max_connection_age_ms`: past its age a connection is told to go
/// (GOAWAY, NO_ERROR), not cut off; with 0 it never is. A gRPC client
/// then moves on to a new connection and its calls keep being answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aged_connection_is_told_to_go() {
    let rules = Rules::new(RULES);
    for age_ms in [200, 0] {
        let server = grpc_server(&rules, |grpc| grpc.max_connection_age_ms = age_ms).await;
        let wait = Duration::from_millis(if age_ms > 0 { 1_000 } else { 500 });
        let (frames, _) = silent_h2_client(server.addr, wait).await;
        let goaway = frames.iter().find(|(kind, _, _)| *kind == 7);
        assert_eq!(goaway.is_some(), age_ms > 0, "age {age_ms} ms: {frames:?}");
        if let Some((_, _, payload)) = goaway {
            assert_eq!(payload[4..8], [0, 0, 0, 0], "GOAWAY's error code is NO_ERROR");
        }
        let mut client = server.client().await;
        for _ in 0..3 {
            assert!(check(&mut client, request("u", "/hot")).await.allowed);
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        drop(client);
        server.stop().await.unwrap();
    }
}

/// `grpc.tcp_keepalive_ms`: the server's side of an accepted connection
/// runs the kernel's keepalive timer (as `ss` shows it), so a peer that
/// vanished is found without any per-request cost; 0 leaves it off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_connections_keep_tcp_keepalive() {
    let rules = Rules::new(RULES);
    for idle_ms in [45_000, 0] {
        let server = grpc_server(&rules, |grpc| grpc.tcp_keepalive_ms = idle_ms).await;
        // An idle connection: the timer `ss` shows is then keepalive's.
        let client = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        let filter = format!("( sport = :{} )", server.addr.port());
        let established = || {
            let out =
                std::process::Command::new("ss").args(["-tnoH", "state", "established", &filter]).output();
            String::from_utf8(out.expect("ss (iproute2) runs").stdout).unwrap()
        };
        // The connection is accepted a moment after connect returns.
        let mut timers = String::new();
        for _ in 0..100 {
            timers = established();
            if !timers.trim().is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!timers.trim().is_empty(), "ss saw no connection on {filter}");
        assert_eq!(
            timers.contains("timer:(keepalive,"),
            idle_ms > 0,
            "grpc.tcp_keepalive_ms {idle_ms}: {timers}"
        );
        // Closed before the server stops: a shutdown waits out its grace
        // for an open connection.
        drop(client);
        server.stop().await.unwrap();
    }
}

/// `grpc.max_connections`: with both places taken by idle connections, a
/// third client's connection is served at once, in the place of the one
/// idle longest, which the server closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_take_the_place_of_the_idle_longest() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let rules = Rules::new(RULES);
    let server = grpc_server(&rules, |grpc| grpc.max_connections = 2).await;
    let connect = || async {
        let mut socket = tokio::net::TcpStream::connect(server.addr).await.unwrap();
        socket.write_all(H2_START).await.unwrap();
        socket
    };
    // Whether the server's first frame (SETTINGS: type 4) came within `wait`.
    async fn served(socket: &mut tokio::net::TcpStream, wait: Duration) -> bool {
        let mut head = [0u8; 9];
        matches!(tokio::time::timeout(wait, socket.read_exact(&mut head)).await, Ok(Ok(_))) && head[3] == 4
    }
    let (mut first, mut second) = (connect().await, connect().await);
    assert!(served(&mut first, Duration::from_secs(5)).await);
    assert!(served(&mut second, Duration::from_secs(5)).await);
    let mut third = connect().await;
    assert!(served(&mut third, Duration::from_secs(5)).await, "a third connection was not served");
    // The first, idle longest, is closed: its reads come to an end.
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        let mut sink = [0u8; 1024];
        while matches!(first.read(&mut sink).await, Ok(n) if n > 0) {}
    });
    assert!(closed.await.is_ok(), "the idle longest kept its place");
    drop((second, third));
    server.stop().await.unwrap();
}

/// 64 concurrent callers, 256 requests against a limit of 100: exactly 100
/// are admitted.
async fn concurrent_callers_admit_exactly_the_limit(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let client = server.client().await;
    let admitted = common::hammer(&[client], 64, 4, "/hot").await;
    assert_eq!(admitted, 100);
    server.stop().await.unwrap();
}

/// Replacing the rule file by an atomic rename is picked up.
async fn hot_reload_sees_rename_over(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;
    assert_eq!(check(&mut client, request("h", "/limited")).await.limit, 5);

    rules.rename_over(&RULES.replace("limit: 5,", "limit: 7,"));
    let reloaded = eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move { check(&mut client, request("h2", "/limited")).await.limit == 7 }
    })
    .await;
    assert!(reloaded, "rename-over was not picked up");
    server.stop().await.unwrap();
}

/// A Kubernetes ConfigMap update (the `..data` symlink swapped to a new
/// directory, the old one deleted) is picked up.
async fn hot_reload_sees_configmap_symlink_swap(backend: Backend) {
    let mut rules = ConfigMapRules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;
    assert_eq!(check(&mut client, request("i", "/limited")).await.limit, 5);

    for limit in [8, 9] {
        rules.swap(&RULES.replace("limit: 5,", &format!("limit: {limit},")));
        let reloaded = eventually(Duration::from_secs(10), || {
            let mut client = client.clone();
            async move { check(&mut client, request("i2", "/limited")).await.limit == limit }
        })
        .await;
        assert!(reloaded, "symlink swap to limit {limit} was not picked up");
    }
    server.stop().await.unwrap();
}

/// An invalid rule set is rejected while the last good one keeps serving; a
/// later valid one is picked up again.
async fn invalid_rule_file_keeps_the_last_good_snapshot(backend: Backend) {
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(backend, &rules.path()).await;
    let mut client = server.client().await;

    rules.rename_over(&RULES.replace("limit: 5,", "limit: 0,"));
    // Let several reload polls (20 ms apart) see the broken file.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..5 {
        let r = check(&mut client, request("j", "/limited")).await;
        assert_eq!((r.rule_id.as_str(), r.limit), ("limited", 5), "old snapshot must keep serving");
    }
    // An in-place truncate-and-write is seen half-done (empty, then broken
    // YAML): neither may replace the rules.
    std::fs::write(rules.dir.path().join("rules.yaml"), "").unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(check(&mut client, request("j", "/limited")).await.limit, 5);
    std::fs::write(rules.dir.path().join("rules.yaml"), "rules: [ {").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(check(&mut client, request("j", "/limited")).await.limit, 5);
    // A set with no rules would lift every limit: refused too
    // (rules.allow_empty is off).
    rules.rename_over("rules: []\n");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(check(&mut client, request("j", "/limited")).await.limit, 5);

    rules.rename_over(&RULES.replace("limit: 5,", "limit: 6,"));
    let recovered = eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move { check(&mut client, request("j2", "/limited")).await.limit == 6 }
    })
    .await;
    assert!(recovered, "a valid file after an invalid one was not picked up");
    server.stop().await.unwrap();
}

/// A `Check` whose user id is not UTF-8, sent as raw bytes over gRPC (prost
/// would refuse the string; a refusal is an error a fail-open proxy
/// answers with "allow"): decided and limited like any other user.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_id_that_is_not_utf8_is_limited_like_any_other() {
    /// `RateLimitRequest`'s first two fields, as bytes.
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawRequest {
        #[prost(bytes = "vec", tag = "1")]
        user_id: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        resource_path: Vec<u8>,
    }
    let rules = Rules::new(RULES);
    let (server, _redis) = common::start(Backend::Memory, &rules.path()).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let mut answers = Vec::new();
    for _ in 0..6 {
        grpc.ready().await.unwrap();
        let request = RawRequest { user_id: b"zed\xff".to_vec(), resource_path: b"/limited".to_vec() };
        let codec: tonic_prost::ProstCodec<RawRequest, ratelimitd::api::pb::RateLimitResponse> =
            Default::default();
        let path = tonic::codegen::http::uri::PathAndQuery::from_static("/ratelimit.v1.RateLimiter/Check");
        let response = grpc.unary(tonic::Request::new(request), path, codec).await.unwrap().into_inner();
        answers.push(response.allowed);
    }
    assert_eq!(answers, [true, true, true, true, true, false], "limit 5, then denied");

    // The same inside a CheckBatch: the item is decided (and counted against
    // the same user), not the batch refused.
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawItem {
        #[prost(uint64, tag = "1")]
        id: u64,
        #[prost(message, optional, tag = "2")]
        request: Option<RawRequest>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct RawBatch {
        #[prost(message, repeated, tag = "1")]
        items: Vec<RawItem>,
    }
    grpc.ready().await.unwrap();
    let request = RawRequest { user_id: b"zed\xff".to_vec(), resource_path: b"/limited".to_vec() };
    let batch = RawBatch { items: vec![RawItem { id: 9, request: Some(request) }] };
    let codec: tonic_prost::ProstCodec<RawBatch, ratelimitd::api::pb::CheckBatchResponse> =
        Default::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/ratelimit.v1.RateLimiter/CheckBatch");
    let response = grpc.unary(tonic::Request::new(batch), path, codec).await.unwrap().into_inner();
    let result = &response.results[0];
    assert_eq!(result.id, 9);
    assert!(!result.response.as_ref().expect("decided").allowed, "the same counter: still denied");

    // Not protobuf at all (a varint where a string belongs): the caller's
    // bug, INVALID_ARGUMENT (never INTERNAL, a server fault).
    #[derive(Clone, PartialEq, prost::Message)]
    struct Malformed {
        #[prost(uint64, tag = "1")]
        user_id: u64,
    }
    grpc.ready().await.unwrap();
    let codec: tonic_prost::ProstCodec<Malformed, ratelimitd::api::pb::RateLimitResponse> =
        Default::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/ratelimit.v1.RateLimiter/Check");
    let status = grpc.unary(tonic::Request::new(Malformed { user_id: 7 }), path, codec).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    server.stop().await.unwrap();
}

/// A rule set with no rules does not start the service (it would serve no
/// limit at all) unless `rules.allow_empty` says so; the error names
/// `rules.path` and the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_rule_set_does_not_start_unless_allowed() {
    let rules = Rules::new("rules: []\n");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let error = ratelimitd::server::run(common::config(&rules.path(), None), listener, None, async {})
        .await
        .expect_err("an empty rule set is refused");
    let ratelimitd::server::ServerError::Rules(errors) = error else { panic!("{error:?}") };
    let errors = errors.to_string();
    let path = rules.path().display().to_string();
    assert!(errors.starts_with(&path) && errors.contains("rules.allow_empty"), "{errors}");
    let mut allowed = common::config(&rules.path(), None);
    allowed.rules.allow_empty = true;
    let server = common::TestServer::start(allowed).await;
    let mut client = server.client().await;
    assert_eq!(reason(&check(&mut client, request("u", "/anything")).await), Reason::NoRule);
    server.stop().await.unwrap();
}

/// Every variant of a path that servers serve as that path is counted on
/// its rule (2 a minute): dot segments, escapes of unreserved characters,
/// `;` parameters; with `rules.path_matching` on, case and `%2F` too. Off,
/// those two are other resources (no rule).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_variants_are_counted_as_the_path() {
    let rules = Rules::new("rules:\n  - { rule_id: t, resource_path: /t, limit: 2, window_seconds: 60 }\n");
    for matching in [false, true] {
        let mut cfg = common::config(&rules.path(), None);
        cfg.rules.path_matching.ignore_case = matching;
        cfg.rules.path_matching.decode_slashes = matching;
        let server = common::TestServer::start(cfg).await;
        let mut client = server.client().await;
        let mut reasons = Vec::new();
        for path in ["/t", "/./t", "/x/../t", "/%74", "/t;jsessionid=1", "/t/.", "/%2e%2E/t"] {
            let answer = check(&mut client, request("mallory", path)).await;
            reasons.push((path, reason(&answer), answer.rule_id));
        }
        let over: Vec<_> =
            reasons.iter().skip(2).filter(|(_, r, id)| id == "t" && *r == Reason::OverLimit).collect();
        assert_eq!(over.len(), 5, "{reasons:?}");
        for path in ["/T", "/t%2F"] {
            let answer = check(&mut client, request("mallory", path)).await;
            let expected = if matching { Reason::OverLimit } else { Reason::NoRule };
            assert_eq!(reason(&answer), expected, "{path}, path_matching {matching}");
        }
        server.stop().await.unwrap();
    }
}

/// Streams that announce a 256 KiB message (`grpc.max_message_bytes`) and
/// send only its first 16 KiB, 3 connections × 60 of them: the service
/// holds at most `grpc.max_request_bytes_in_flight` (1 MiB here) of them, fails the rest
/// with RESOURCE_EXHAUSTED, and frees what it held when the calls pass
/// `grpc.request_timeout_ms`, the connections still open; then `Check`
/// answers again. (Each stream used to hold its bytes as long as the
/// connection lived: 3 connections × 1,000 streams held over 3 GB.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unfinished_requests_hold_at_most_the_byte_budget() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let rules = Rules::new(RULES);
    let server = grpc_server(&rules, |grpc| {
        grpc.max_request_bytes_in_flight = Some(1 << 20);
        grpc.max_batch_message_bytes = 1 << 20;
        grpc.request_timeout_ms = 1_000;
    })
    .await;
    let metric = |series: &'static str| {
        let server = &server;
        async move { common::metric(server, series).await.unwrap_or_else(|| panic!("no {series}")) }
    };
    let mut prefix = vec![0u8];
    prefix.extend_from_slice(&(256u32 << 10).to_be_bytes());
    let mut chunk = prefix;
    chunk.resize(16 * 1024, 7);
    let mut connections = Vec::new();
    for _ in 0..3 {
        // Its SETTINGS acknowledged and its window update read before any data.
        let mut socket = common::h2_connect(server.addr, "127.0.0.1").await;
        for i in 0..60u32 {
            let stream = 2 * i + 1;
            let headers = grpc_headers("/ratelimit.v1.RateLimiter/Check");
            socket.write_all(&h2_frame(1, 0x4, stream, &headers)).await.unwrap(); // END_HEADERS
            socket.write_all(&h2_frame(0, 0, stream, &chunk)).await.unwrap();
        }
        // Drain what the server says, so its writes never block.
        connections.push(tokio::spawn(async move {
            let mut sink = vec![0; 64 * 1024];
            while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
        }));
    }
    tokio::time::sleep(Duration::from_millis(400)).await;
    let held = metric("ratelimitd_grpc_request_bytes_in_flight ").await;
    assert!(held <= f64::from(1 << 20), "held {held} bytes");
    assert!(held > 0.0, "the attack was not seen");
    let mut refused = 0.0;
    for share in ["connection", "peer", "untrusted", "pool"] {
        let series = format!("ratelimitd_grpc_requests_over_budget_total{{share=\"{share}\"}} ");
        refused += common::metric(&server, &series).await.unwrap();
    }
    assert!(refused >= 100.0, "180 streams × 16 KiB on 1 MiB: {refused} refused");
    let freed = eventually(Duration::from_secs(10), || async {
        metric("ratelimitd_grpc_request_bytes_in_flight ").await == 0.0
    })
    .await;
    assert!(freed, "the timed-out calls kept their bytes");
    let mut client = server.client().await;
    assert!(check(&mut client, request("after", "/limited")).await.allowed);
    for connection in connections {
        connection.abort();
    }
    server.stop().await.unwrap();
}

/// A `CheckStream` item begun (its length prefix and a few bytes) and
/// never finished holds its bytes at most `grpc.request_timeout_ms`: the
/// stream then fails and the budget is whole again, its connection still
/// open (a streaming call is not bounded by the call's own timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_begun_and_never_finished_holds_its_bytes_at_most_the_request_timeout() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let rules = Rules::new(RULES);
    let server = grpc_server(&rules, |grpc| grpc.request_timeout_ms = 500).await;
    let mut begun = vec![0u8];
    begun.extend_from_slice(&(200u32).to_be_bytes());
    begun.extend_from_slice(&[7; 10]);
    let mut socket = common::h2_connect(server.addr, "127.0.0.1").await;
    let headers = grpc_headers("/ratelimit.v1.RateLimiter/CheckStream");
    socket.write_all(&h2_frame(1, 0x4, 1, &headers)).await.unwrap(); // END_HEADERS
    socket.write_all(&h2_frame(0, 0, 1, &begun)).await.unwrap();
    let reader = tokio::spawn(async move {
        let mut sink = vec![0; 64 * 1024];
        while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
    });
    let series = "ratelimitd_grpc_request_bytes_in_flight ";
    tokio::time::sleep(Duration::from_millis(200)).await;
    let held = common::metric(&server, series).await.unwrap();
    assert!(held >= 200.0, "the message begun is held: {held}");
    let freed =
        eventually(Duration::from_secs(5), || async { common::metric(&server, series).await == Some(0.0) })
            .await;
    assert!(freed, "a message begun and never finished kept its bytes");
    reader.abort();
    server.stop().await.unwrap();
}

/// Context switches so far of `pid`'s threads, serving threads
/// (`ratelimitd-serve-*`) and the others apart.
fn switches(pid: u32) -> (u64, u64) {
    let (mut serving, mut others) = (0, 0);
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap().flatten() {
        let (Ok(name), Ok(status)) = (
            std::fs::read_to_string(task.path().join("comm")),
            std::fs::read_to_string(task.path().join("status")),
        ) else {
            continue; // a thread that ended meanwhile
        };
        let count: u64 = status
            .lines()
            .filter(|line| line.contains("ctxt_switches:"))
            .filter_map(|line| line.split_whitespace().last()?.parse::<u64>().ok())
            .sum();
        if name.starts_with("ratelimitd-serv") { serving += count } else { others += count }
    }
    (serving, others)
}

/// A decision wakes no thread but the one serving its connection: 300
/// Checks, one after another over one connection, on Redis, to the service
/// as it runs (its own process, two serving threads): the threads serving
/// no connection switch fewer than once every ten decisions. On a shared
/// multi-threaded runtime each hand-off (the connection, the request, the
/// store's dispatcher and its connection) woke a sleeping worker: about 3
/// switches of those threads per decision.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_wakes_no_thread_but_its_connections() {
    let redis = common::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let rules = Rules::new(RULES);
    let (service, port) = common::spawn_service(
        dir.path(),
        &[
            ("RATELIMITD__GRPC__SERVING_THREADS", "2".to_owned()),
            ("RATELIMITD__RULES__PATH", rules.path().display().to_string()),
            ("RATELIMITD__REDIS__URL", redis.url()),
        ],
    );
    let mut client = ratelimitd::api::pb::rate_limiter_client::RateLimiterClient::connect(format!(
        "http://127.0.0.1:{port}"
    ))
    .await
    .unwrap();
    for _ in 0..20 {
        check(&mut client, request("warm-up", "/hot")).await;
    }
    let pid = service.0.id();
    let before = switches(pid);
    for i in 0..300 {
        let answer = check(&mut client, request(&format!("user-{i}"), "/hot")).await;
        assert!(answer.allowed, "{answer:?}");
    }
    let after = switches(pid);
    let (serving, others) = (after.0 - before.0, after.1 - before.1);
    assert!(others < 30, "threads serving no connection switched {others} times for 300 decisions");
    assert!(serving >= 300, "the serving threads switched {serving} times for 300 decisions");
}
