//! envoyproxy/ratelimit's own integration suite, run against ratelimitd.
//!
//! Upstream's suite (`integration-test/`) starts its service with the
//! environment of `docker-compose-integration-test.yml` behind two Envoys
//! (a proxy with the ratelimit filter, a mock answering "Hello World from
//! Service N") and runs eight scripts in file order. This test does the
//! same with ratelimitd: the binary started as upstream's image starts it
//! (`/bin/ratelimit`, a link to ratelimitd, no argument; the name alone
//! turns compat mode on) with that environment (addresses changed), Redis over
//! TCP, a statsd listener, real Envoys on `tests/upstream/proxy.yaml` and
//! `mock.yaml`, and the rules of `tests/upstream/config`. Each flow below
//! is one script: the same requests, the same headers, in the same order,
//! asserting what the script asserts (and, where the script's check
//! cannot fail, what it means to check).
//!
//! Two things differ from running the scripts, both for determinism:
//! - Upstream's `sleep 60` ("wait for the quota buckets to be refreshed")
//!   is the fixed windows rolling over. Every limit in the set is per
//!   second or per minute, so after 60 s no counter is left: the test
//!   empties Redis instead of waiting.
//! - Each script was written as if alone (upstream's own order carries
//!   `service_2` hits from `quota.sh` into `token-quota.sh` unless a minute
//!   boundary falls between them), so each flow starts on empty counters,
//!   and none starts in the last seconds of a minute, where a window edge
//!   would fall inside it.
//! - Envoy reports `apply_on_stream_done` hits after the response; the
//!   scripts rely on a shell being slower than that. The test waits until
//!   ratelimitd has counted each report before the next request.

mod common;

use std::{
    net::{TcpStream, UdpSocket},
    process::Command,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use common::{Process, RedisServer, Reply, free_port};

impl Reply {
    /// What `curl -f` calls success.
    fn ok(&self) -> bool {
        self.status < 400
    }
}

/// The deployment of upstream's docker-compose file, on loopback.
struct Suite {
    proxy_port: u16,
    http_port: u16,
    redis: RedisServer,
    statsd: UdpSocket,
    log: std::path::PathBuf,
    _processes: Vec<Process>,
    _dir: tempfile::TempDir,
}

/// Fills `tests/upstream/NAME`'s port placeholders.
fn render(name: &str, ports: &[(&str, u16)]) -> String {
    let mut text = std::fs::read_to_string(common::repo_path(&format!("tests/upstream/{name}"))).unwrap();
    for (placeholder, port) in ports {
        text = text.replace(placeholder, &port.to_string());
    }
    text
}

impl Suite {
    fn start() -> Self {
        let redis = RedisServer::start();
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("data/ratelimit/config");
        std::fs::create_dir_all(&config).unwrap();
        for file in ["rl.yaml", "mongo_cps.yaml"] {
            std::fs::copy(common::repo_path(&format!("tests/upstream/config/{file}")), config.join(file))
                .unwrap();
        }
        let statsd = UdpSocket::bind("127.0.0.1:0").unwrap();
        // Upstream's flush interval (10 s) is kept: a flush comes within it.
        statsd.set_read_timeout(Some(Duration::from_secs(15))).unwrap();
        let statsd_port = statsd.local_addr().unwrap().port();
        let log = dir.path().join("ratelimitd.log");
        // docker-compose-integration-test.yml's environment.
        let env = [
            ("USE_STATSD", "true".to_owned()),
            ("STATSD_HOST", "127.0.0.1".to_owned()),
            ("STATSD_PORT", statsd_port.to_string()),
            ("LOG_LEVEL", "debug".to_owned()),
            ("REDIS_SOCKET_TYPE", "tcp".to_owned()),
            ("REDIS_URL", format!("127.0.0.1:{}", redis.port)),
            ("RUNTIME_ROOT", dir.path().join("data").display().to_string()),
            ("RUNTIME_SUBDIRECTORY", "ratelimit".to_owned()),
            ("RUNTIME_WATCH_ROOT", "false".to_owned()),
            ("RESPONSE_DYNAMIC_METADATA", "true".to_owned()),
        ];
        // As upstream's image runs it: `/bin/ratelimit`, no argument.
        let (service, grpc_port, http_port) = common::start_as_upstream(dir.path(), &log, &env);
        let service = Process(service);
        let mock_dir = dir.path().join("mock");
        std::fs::create_dir_all(&mock_dir).unwrap();
        let mock_2 = std::cell::Cell::new(0);
        let (mock, mock_1) = common::start_envoy(&mock_dir, |listen, admin| {
            mock_2.set(free_port());
            render(
                "mock.yaml",
                &[("MOCK_1_PORT", listen), ("MOCK_2_PORT", mock_2.get()), ("MOCK_ADMIN_PORT", admin)],
            )
        });
        let (mock, mock_2) = (Process(mock), mock_2.get());
        assert!(wait_until(Duration::from_secs(10), || TcpStream::connect(("127.0.0.1", mock_2)).is_ok()));
        let proxy_dir = dir.path().join("proxy");
        std::fs::create_dir_all(&proxy_dir).unwrap();
        let (proxy, proxy_port) = common::start_envoy(&proxy_dir, |listen, admin| {
            render(
                "proxy.yaml",
                &[
                    ("PROXY_PORT", listen),
                    ("PROXY_ADMIN_PORT", admin),
                    ("RATELIMIT_PORT", grpc_port),
                    ("MOCK_1_PORT", mock_1),
                    ("MOCK_2_PORT", mock_2),
                ],
            )
        });
        Suite {
            proxy_port,
            http_port,
            redis,
            statsd,
            log,
            _processes: vec![Process(proxy), mock, service],
            _dir: dir,
        }
    }

    /// One GET through the proxy, as the scripts' curl does it.
    fn curl(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        common::http_get_text(self.proxy_port, path, headers)
    }

    /// `curl` on a route whose hits are reported when the stream is done:
    /// returns once ratelimitd has counted the report too.
    fn curl_reported(&self, path: &str, headers: &[(&str, &str)]) -> Reply {
        let before = self.total_hits();
        let reply = self.curl(path, headers);
        if reply.ok() {
            assert!(
                wait_until(Duration::from_secs(10), || self.total_hits() > before),
                "{path}: the stream-done report never arrived"
            );
        }
        reply
    }

    /// Upstream's `ratelimit_service_rate_limit_total_hits`, summed over
    /// domain `rl`.
    fn total_hits(&self) -> u64 {
        self.metrics()
            .lines()
            .filter(|l| l.starts_with("ratelimit_service_rate_limit_total_hits{domain=\"rl\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    fn metrics(&self) -> String {
        let (status, body) = common::http_get(([127, 0, 0, 1], self.http_port).into(), "/metrics");
        assert_eq!(status, 200);
        body
    }

    /// Upstream's `sleep 60`: every minute and second window rolls over.
    fn windows_roll_over(&self) {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.redis.port.to_string(), "FLUSHALL"])
            .output()
            .unwrap();
        assert!(out.status.success() && out.stdout.starts_with(b"OK"), "{out:?}");
    }

    /// Before each script: empty counters, and the script's requests inside
    /// one minute window (none starts in a minute's last 10 s).
    fn fresh(&self) {
        let second = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() % 60_000;
        if second >= 50_000 {
            std::thread::sleep(Duration::from_millis(60_100 - second as u64));
        }
        self.windows_roll_over();
    }
}

fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

/// `multiservice-tokenquota.sh`: service_1 (1 a minute) and service_2 (2)
/// asked with 0 hits; the service that served is debited when the stream
/// is done, so service_1 serves 2 and service_2 3 before every quota is
/// spent; after the refresh service_1 serves again.
fn multiservice_tokenquota(s: &Suite) {
    let served = |n: u32| {
        let reply = s.curl_reported("/multiservice-tokenquota", &[("request-no", &n.to_string())]);
        assert!(reply.ok(), "request {n}: {}", reply.status);
        reply.body
    };
    for (n, service) in [(1, "1"), (2, "1"), (3, "2"), (4, "2"), (5, "2")] {
        assert_eq!(served(n), format!("Hello World from Service {service}"), "request {n}");
    }
    let sixth = s.curl("/multiservice-tokenquota", &[("request-no", "6")]);
    assert_eq!(sixth.status, 429, "every quota is spent: {}", sixth.body);
    s.windows_roll_over();
    assert_eq!(served(7), "Hello World from Service 1", "the buckets are refreshed");
}

/// `quota.sh`: /quota debits service_1 (1 a minute) and service_2 (2) in
/// quota mode: OVER_LIMIT only when both are spent, so the third request
/// is limited; after the refresh it passes.
fn quota(s: &Suite) {
    assert!(s.curl("/quota", &[]).ok(), "first");
    assert!(s.curl("/quota", &[]).ok(), "service_1 is spent, service_2 is not");
    assert_eq!(s.curl("/quota", &[]).status, 429, "both spent");
    s.windows_roll_over();
    assert!(s.curl("/quota", &[]).ok(), "the buckets are refreshed");
}

/// `replaces.sh`: a limit's `replaces` lifts the named limits it replaces
/// (and only those), one or several.
fn replaces(s: &Suite) {
    let banned = [("foo", "bkthomps"), ("bar", "banned")];
    assert!(!s.curl("/twoheader", &banned).ok(), "banned_limit is 0 a minute");
    let mut mock = banned.to_vec();
    mock.extend([("source_cluster", "proxy"), ("destination_cluster", "mock")]);
    assert!(!s.curl("/fourheader", &mock).ok(), "mock does not replace banned_limit");
    let mut overridden = banned.to_vec();
    overridden.extend([("source_cluster", "proxy"), ("destination_cluster", "override")]);
    let answers: Vec<bool> = (0..3).map(|_| s.curl("/fourheader", &overridden).ok()).collect();
    assert_eq!(answers, [true, true, false], "override replaces banned_limit with 2 a minute");

    // Replacing does not touch the replaced limit's own counter.
    let bkthomps = |destination| {
        [
            ("foo", "my_foo"),
            ("bar", "bkthomps"),
            ("source_cluster", "proxy"),
            ("destination_cluster", destination),
        ]
    };
    let answers: Vec<bool> = (0..3).map(|_| s.curl("/fourheader", &bkthomps("bkthomps")).ok()).collect();
    assert_eq!(answers, [true, true, false], "bkthomps replaced by 2 a minute");
    let answers: Vec<bool> = (0..2).map(|_| s.curl("/fourheader", &bkthomps("not_bkthomps")).ok()).collect();
    assert_eq!(answers, [true, false], "bkthomps itself is 1 a minute");
    assert!(!s.curl("/fourheader", &bkthomps("bkthomps")).ok());

    // One limit replaces two.
    let five = [
        ("foo", "my_foo"),
        ("bar", "bkthomps"),
        ("source_cluster", "proxy"),
        ("destination_cluster", "fake"),
        ("category", "account"),
    ];
    let answers: Vec<bool> = (0..5).map(|_| s.curl("/fiveheader", &five).ok()).collect();
    assert_eq!(answers, [true, true, true, true, false], "account replaces bkthomps and fake_name with 4");
    let answers: Vec<bool> =
        (0..2).map(|_| s.curl("/twoheader", &[("foo", "foo_2"), ("bar", "bkthomps")]).ok()).collect();
    assert_eq!(answers, [true, false], "bkthomps alone");
    let fake =
        [("foo", "foo_3"), ("bar", "bar_3"), ("source_cluster", "proxy"), ("destination_cluster", "fake")];
    let answers: Vec<bool> = (0..3).map(|_| s.curl("/fourheader", &fake).ok()).collect();
    assert_eq!(answers, [true, true, false], "fake_name alone is 2 a minute");
    assert!(!s.curl("/fiveheader", &five).ok());
}

/// `simple-get.sh`: the happy path.
fn simple_get(s: &Suite) {
    let reply = s.curl("/twoheader", &[("foo", "test"), ("baz", "shady")]);
    assert!(reply.ok(), "{}", reply.status);
}

/// `token-quota.sh`: service_2 (2 a minute) asked with 0 hits and debited
/// when the stream is done: a 0-hit ask passes while the count is within
/// the limit, so three requests pass and the fourth is limited.
fn token_quota(s: &Suite) {
    for n in 1..=3 {
        let reply = s.curl_reported("/tokenquota", &[("request-no", &n.to_string())]);
        assert!(reply.ok(), "request {n}: {}", reply.status);
    }
    assert_eq!(s.curl("/tokenquota", &[("request-no", "4")]).status, 429);
    s.windows_roll_over();
    assert!(s.curl("/tokenquota", &[("request-no", "5")]).ok(), "the bucket is refreshed");
}

/// `trigger-ratelimit.sh`: (foo: *, baz: not-so-shady) is 3 a minute.
fn trigger_ratelimit(s: &Suite) {
    let headers = [("foo", "pelle"), ("baz", "not-so-shady")];
    let answers: Vec<bool> = (0..4).map(|_| s.curl("/twoheader", &headers).ok()).collect();
    assert_eq!(answers, [true, true, true, false]);
    let reply = s.curl("/twoheader", &headers);
    assert_eq!(reply.status, 429, "Too Many Requests");
}

/// `trigger-shadow-mode-key.sh`: (foo: *, baz: shady) is 3 a minute in
/// shadow mode: never limited, though spent. The script then reads
/// Envoy's draft-03 `x-ratelimit-remaining` and says "Remaining should be
/// zero"; its comparison keeps the header's trailing CR and so never
/// fails. Upstream answers a spent shadow limit with remaining 0, and so
/// does ratelimitd: that is what is checked.
fn trigger_shadow_mode_key(s: &Suite) {
    let headers = [("foo", "pelle"), ("baz", "shady")];
    for n in 1..=5 {
        assert!(s.curl("/twoheader", &headers).ok(), "request {n}: shadow mode never limits");
    }
    let reply = s.curl("/twoheader", &headers);
    assert!(reply.ok());
    assert_eq!(reply.header("x-ratelimit-remaining"), Some("0"), "{:?}", reply.headers);
}

/// `value-included-in-stats-key-when-unspecified.sh`: (unspec: *) is 2 a
/// minute with `detailed_metric`: the value is in the statsd key of the
/// over-limit count.
fn value_included_in_stats_key_when_unspecified(s: &Suite) {
    let headers = [("unspec", "unspecified_value")];
    let answers: Vec<bool> = (0..3).map(|_| s.curl("/unspec", &headers).ok()).collect();
    assert_eq!(answers, [true, true, false]);
    let name = "ratelimit.service.rate_limit.rl.unspec_unspecified_value.over_limit:";
    let (mut over, mut buf) = (0, [0u8; 8192]);
    while over < 1 {
        let n = s.statsd.recv(&mut buf).expect("statsd datagrams");
        for line in String::from_utf8_lossy(&buf[..n]).lines() {
            if let Some(count) = line.strip_prefix(name) {
                over += count.trim_end_matches("|c").parse::<u64>().unwrap();
            }
        }
    }
    assert_eq!(over, 1, "Overlimit should be 1");
    let series = r#"ratelimit_service_rate_limit_over_limit{domain="rl",key1="unspec_unspecified_value"} 1"#;
    let metrics = s.metrics();
    assert!(metrics.lines().any(|l| l == series), "missing {series}");
}

/// A script's name and its flow.
type Flow = (&'static str, fn(&Suite));

/// The whole suite, in upstream's order (its run-all.sh takes the scripts
/// in file-name order), against one deployment.
#[test]
fn upstreams_integration_suite_passes() {
    let s = Suite::start();
    let (status, body) = common::http_get(([127, 0, 0, 1], s.http_port).into(), "/healthcheck");
    assert_eq!((status, body.trim()), (200, "OK"), "upstream's probe");
    let flows: [Flow; 8] = [
        ("multiservice-tokenquota.sh", multiservice_tokenquota),
        ("quota.sh", quota),
        ("replaces.sh", replaces),
        ("simple-get.sh", simple_get),
        ("token-quota.sh", token_quota),
        ("trigger-ratelimit.sh", trigger_ratelimit),
        ("trigger-shadow-mode-key.sh", trigger_shadow_mode_key),
        ("value-included-in-stats-key-when-unspecified.sh", value_included_in_stats_key_when_unspecified),
    ];
    for (script, flow) in flows {
        s.fresh();
        eprintln!("{script}");
        flow(&s);
    }
    // Upstream's metric names, the two request families included.
    let metrics = s.metrics();
    for family in [
        "ratelimit_service_rate_limit_total_hits{",
        "ratelimit_service_rate_limit_over_limit{",
        "ratelimit_service_rate_limit_within_limit{",
        "ratelimit_service_rate_limit_shadow_mode{",
        "ratelimit_service_config_load_success ",
        "ratelimit_service_total_requests{",
        "ratelimit_service_response_time_seconds_bucket{",
    ] {
        assert!(metrics.lines().any(|l| l.starts_with(family)), "missing {family}");
    }
    // Debug logs, as the compose file asks, but no line per request.
    let lines = std::fs::read_to_string(&s.log).unwrap().lines().count();
    assert!(lines < 40, "{lines} log lines for ~60 requests");
}
