//! Black-box tests of the `ratelimitd` binary itself: configuration errors,
//! `rules validate`, `serve` + `check` end to end, and graceful shutdown on
//! SIGTERM.

mod common;

use std::{
    path::Path,
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

use common::{RedisServer, Rules, free_port};

const BIN: &str = env!("CARGO_BIN_EXE_ratelimitd");

const RULES: &str = r#"
rules:
  - { rule_id: two, resource_path: /two, limit: 2, window_seconds: 86400, failure_policy: closed }
"#;

fn ratelimitd(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(BIN);
    command.args(args).env_remove("RUST_LOG");
    for (k, v) in env {
        command.env(k, v);
    }
    command.output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// A `ratelimitd serve` child process; killed on drop if still running.
struct Serve {
    child: Child,
    addr: String,
    /// The metrics and health port.
    http: u16,
    _dir: tempfile::TempDir,
}

impl Serve {
    fn start(rules: &Path, redis_url: Option<&str>) -> Self {
        Self::start_with(rules, redis_url, &[])
    }

    fn start_with(rules: &Path, redis_url: Option<&str>, env: &[(&str, &str)]) -> Self {
        Self::spawn(Command::new(BIN), rules, redis_url, env)
    }

    /// `ratelimitd serve` run by `command` (the binary, or a shell that
    /// execs it).
    fn spawn(mut command: Command, rules: &Path, redis_url: Option<&str>, env: &[(&str, &str)]) -> Self {
        let (port, http) = (free_port(), free_port());
        let dir = tempfile::tempdir().unwrap();
        command
            .arg("serve")
            .env("RATELIMITD__DLQ__FILE", dir.path().join("dlq.jsonl"))
            .env_remove("RUST_LOG")
            .env("RATELIMITD__GRPC__LISTEN", format!("127.0.0.1:{port}"))
            .env("RATELIMITD__HTTP__LISTEN", format!("127.0.0.1:{http}"))
            .env("RATELIMITD__RULES__PATH", rules)
            .env("RATELIMITD__REDIS__TIMEOUT_MS", "1000")
            // This machine's real load must not shed the test's requests.
            .env("RATELIMITD__SHED__MODE", "off")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(url) = redis_url {
            command.env("RATELIMITD__REDIS__URL", url);
        }
        command.envs(env.iter().copied());
        let child = command.spawn().unwrap();
        let serve = Serve { child, addr: format!("http://127.0.0.1:{port}"), http, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "ratelimitd serve did not listen on {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        serve
    }

    fn check(&self, extra: &[&str]) -> Output {
        let mut args = vec!["check", "--addr", &self.addr];
        args.extend_from_slice(extra);
        ratelimitd(&args, &[])
    }

    /// Sends SIGTERM (and returns at once).
    fn signal_term(&self) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    }

    /// SIGTERM, then the exit status and everything it logged.
    fn terminate(self) -> (std::process::ExitStatus, String) {
        self.signal_term();
        self.wait_exit()
    }

    /// Waits (at most 20 s) for the process to exit; its status and log.
    fn wait_exit(mut self) -> (std::process::ExitStatus, String) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "no exit within 20 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut log = String::new();
        use std::io::Read;
        self.child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
        (status, log)
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ratelimitd serve` started from `/` with a clean environment (HOME in a
/// temporary directory for the dead-letter file), only the given variables
/// set; returns it once it listens.
fn serve_from_root(env: &[(&str, &str)]) -> Serve {
    let (port, http) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let mut command = Command::new(BIN);
    command
        .arg("serve")
        .current_dir("/")
        .env_clear()
        .env("HOME", dir.path())
        .env("RATELIMITD__GRPC__LISTEN", format!("127.0.0.1:{port}"))
        .env("RATELIMITD__HTTP__LISTEN", format!("127.0.0.1:{http}"))
        .env("RATELIMITD__SHED__MODE", "off")
        .envs(env.iter().copied())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let child = command.spawn().unwrap();
    let mut serve = Serve { child, addr: format!("http://127.0.0.1:{port}"), http, _dir: dir };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(status) = serve.child.try_wait().unwrap() {
            let mut log = String::new();
            use std::io::Read;
            serve.child.stderr.take().unwrap().read_to_string(&mut log).unwrap();
            panic!("serve exited with {status}: {log}");
        }
        assert!(Instant::now() < deadline, "ratelimitd serve did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
    serve
}

/// No configuration at all, started from `/`: the embedded example rules
/// decide, and failed decisions would go under $HOME, never the working
/// directory.
#[test]
fn serve_from_root_with_no_configuration_uses_the_embedded_rules() {
    let serve = serve_from_root(&[]);
    let out = serve.check(&["--user", "alice", "--path", "/api/v1/search", "--json"]);
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (answer["reason"].as_str(), answer["rule_id"].as_str()),
        (Some("OK"), Some("search")),
        "{answer}"
    );
    let (status, log) = serve.terminate();
    assert!(status.success(), "{log}");
    assert!(log.contains("<embedded examples/rules>"), "{log}");
    assert!(log.contains(".local/state/ratelimitd/dlq.jsonl"), "{log}");
}

/// A stderr nobody reads (a full pipe) never stalls a decision: the log
/// writer thread drops lines and counts them instead of blocking a worker.
/// With a blocking writer this stops after a few requests, when the 64 KiB
/// pipe is full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stderr_never_stalls_decisions() {
    use ratelimitd::api::pb::rate_limiter_client::RateLimiterClient;
    let serve = serve_from_root(&[("RUST_LOG", "trace")]);
    let mut client = RateLimiterClient::connect(serve.addr.clone()).await.unwrap();
    for i in 0..3_000 {
        let request = common::request(&format!("user-{i}"), "/api/v1/search");
        let answered = tokio::time::timeout(Duration::from_secs(10), client.check(request)).await;
        answered.unwrap_or_else(|_| panic!("request {i} not answered in 10 s")).unwrap();
    }
    let metrics = scrape(serve.http);
    let dropped: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ratelimitd_log_lines_dropped_total "))
        .unwrap_or_else(|| panic!("no log drop counter in {metrics}"))
        .parse()
        .unwrap();
    assert!(dropped > 0, "the pipe was full, yet no line was dropped");
}

/// 300 idle connections to the HTTP port of a service allowed 256
/// descriptors: only `http.max_connections` (64) are accepted, the rest
/// wait in the backlog holding no descriptor, so gRPC still accepts and
/// `Check` answers within its deadline (each used to take a descriptor,
/// until accepts failed with EMFILE and the accept loop spun).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http_connections_cannot_starve_grpc_of_descriptors() {
    use ratelimitd::api::pb::rate_limiter_client::RateLimiterClient;
    let rules =
        common::Rules::new("rules:\n  - { rule_id: r, resource_path: /r, limit: 5, window_seconds: 60 }\n");
    let mut limited = Command::new("sh");
    limited.args(["-c", "ulimit -n 256 && exec \"$0\" \"$@\"", BIN]);
    let serve = Serve::spawn(limited, &rules.path(), None, &[]);
    // All at once; past the backlog the kernel drops SYNs and the client
    // sends them again after a second, when the service may have accepted
    // more (on a loaded machine it has not accepted all 64 at the first
    // try), so each connect gets three seconds.
    let connects = (0..300).map(|_| {
        tokio::time::timeout(
            Duration::from_secs(3),
            tokio::net::TcpStream::connect(("127.0.0.1", serve.http)),
        )
    });
    let idle: Vec<_> =
        futures_util::future::join_all(connects).await.into_iter().filter_map(|c| c.ok()?.ok()).collect();
    assert!(idle.len() >= 150, "only {} connected", idle.len());
    tokio::time::sleep(Duration::from_millis(300)).await;
    for i in 0..5 {
        let answered = tokio::time::timeout(Duration::from_secs(2), async {
            let mut client = RateLimiterClient::connect(serve.addr.clone()).await.expect("gRPC accepts");
            client.check(common::request(&format!("u{i}"), "/r")).await.expect("decided").into_inner()
        })
        .await
        .expect("answered within 2 s");
        assert!(answered.allowed);
    }
    drop(idle);
    let (status, log) = serve.terminate();
    assert!(status.success(), "{log}");
}

/// `GET /metrics` over plain HTTP/1.1.
fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// Only an Envoy configuration, started from `/`: serve starts with no
/// native rules (Check answers NO_RULE) and serves ShouldRateLimit.
#[test]
fn serve_from_root_with_only_envoy_rules() {
    let envoy = common::repo_path("examples/envoy/ratelimit");
    let serve = serve_from_root(&[("RATELIMITD__RULES__ENVOY_PATH", envoy.to_str().unwrap())]);
    let out = serve.check(&["--user", "alice", "--path", "/api/v1/search", "--json"]);
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["reason"].as_str(), Some("NO_RULE"), "{answer}");
    let (status, log) = serve.terminate();
    assert!(status.success(), "{log}");
    assert!(log.contains("serving envoy.service.ratelimit.v3.RateLimitService"), "{log}");
}

/// A rule path that cannot be read fails startup with its cause said once,
/// in the log; with JSON logs as one JSON line, and so is an invalid
/// configuration (before the log starts).
#[test]
fn a_missing_rule_path_says_its_cause_once() {
    let cause =
        "ratelimitd failed: rules: /nonexistent/rules: cannot read: No such file or directory (os error 2)";
    let out = ratelimitd(&["serve"], &[("RATELIMITD__RULES__PATH", "/nonexistent/rules")]);
    assert_eq!(out.status.code(), Some(1));
    let text = stderr(&out);
    assert_eq!(text.lines().filter(|l| l.contains("ratelimitd failed")).count(), 1, "{text}");
    assert!(text.lines().any(|l| l.contains(" ERROR ") && l.ends_with(cause)), "{text}");

    let json = [("RATELIMITD__RULES__PATH", "/nonexistent/rules"), ("RATELIMITD__LOG__FORMAT", "json")];
    let out = ratelimitd(&["serve"], &json);
    assert_eq!(out.status.code(), Some(1));
    let failed: Vec<serde_json::Value> = stderr(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .filter(|l: &serde_json::Value| l["fields"]["message"].as_str().is_some_and(|m| m.contains("failed")))
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        (failed[0]["level"].as_str(), failed[0]["fields"]["message"].as_str()),
        (Some("ERROR"), Some(cause))
    );

    let out = ratelimitd(&["serve"], &[("RATELIMITD__REDIS__TIMEOUT_MS", "soon"), json[1]]);
    assert_eq!(out.status.code(), Some(64));
    let line: serde_json::Value = serde_json::from_str(stderr(&out).trim()).expect("one JSON line");
    assert_eq!(line["level"], "ERROR");
    assert!(line["fields"]["message"].as_str().unwrap().contains("redis.timeout_ms"), "{line}");
}

#[test]
fn invalid_configuration_exits_64_naming_the_key() {
    for (key, value, named) in [
        ("RATELIMITD__REDIS__TIMEOUT_MS", "soon", "redis.timeout_ms"),
        ("RATELIMITD__REDIS__TIMEOUT_MS", "0", "redis.timeout_ms"),
        ("RATELIMITD__GRPC__LISTEN", "everywhere", "grpc.listen"),
        ("RATELIMITD__REDIS__URL", "http://:secret@10.0.0.1", "redis.url"),
    ] {
        let output = ratelimitd(&["serve"], &[(key, value)]);
        assert_eq!(output.status.code(), Some(64), "{key}={value}: {}", stderr(&output));
        assert!(stderr(&output).contains(named), "{key}={value}: {}", stderr(&output));
        assert!(!stderr(&output).contains("secret"), "a password leaked: {}", stderr(&output));
    }
    let output = ratelimitd(&["serve", "--config", "/nonexistent/ratelimitd.yaml"], &[]);
    assert_eq!(output.status.code(), Some(64));
    assert!(stderr(&output).contains("/nonexistent/ratelimitd.yaml"));
}

/// Under upstream's name (`/bin/ratelimit` in its image) the binary is
/// upstream's: no argument (one is a usage error naming the name), and
/// upstream's variables read without `RATELIMITD_COMPAT` (a bad one is an
/// error naming it). Serving under that name: the upstream suite
/// (tests/upstream.rs).
#[test]
fn under_upstreams_name_it_takes_upstreams_environment_and_no_argument() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("ratelimit");
    std::os::unix::fs::symlink(BIN, &link).unwrap();
    let run = |args: &[&str], env: &[(&str, &str)]| {
        Command::new(&link).args(args).env_clear().envs(env.iter().copied()).output().unwrap()
    };
    let output = run(&["serve"], &[]);
    assert_eq!(output.status.code(), Some(64));
    assert!(stderr(&output).contains("invoked as ratelimit"), "{}", stderr(&output));
    let output = run(&[], &[("REDIS_SOCKET_TYPE", "carrier-pigeon")]);
    assert_eq!(output.status.code(), Some(64));
    assert!(
        stderr(&output).contains("REDIS_SOCKET_TYPE"),
        "upstream's variable was read: {}",
        stderr(&output)
    );
    let output = run(&[], &[("LOG_FORMAT", "json"), ("REDIS_SOCKET_TYPE", "carrier-pigeon")]);
    let line: serde_json::Value =
        serde_json::from_str(stderr(&output).trim()).expect("upstream's LOG_FORMAT");
    assert_eq!(line["level"], "ERROR");
}

#[test]
fn unknown_subcommand_is_a_usage_error() {
    assert_eq!(ratelimitd(&["frobnicate"], &[]).status.code(), Some(64));
    assert_eq!(ratelimitd(&["--help"], &[]).status.code(), Some(0));
}

#[test]
fn rules_validate_reports_file_rule_and_field() {
    let good = Rules::new(RULES);
    let output = ratelimitd(&["rules", "validate", good.path().to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout(&output).contains("ok, 1 rules, version "), "{}", stdout(&output));

    let bad = Rules::new(&RULES.replace("limit: 2,", "limit: 2, burst_capacity: 0.5,"));
    let output = ratelimitd(&["rules", "validate", bad.path().to_str().unwrap()], &[]);
    assert_eq!(output.status.code(), Some(1));
    let err = stderr(&output);
    assert!(
        err.contains("rules.yaml: rule \"two\" (rules[0]): field `burst_capacity`: must be a number >= 1"),
        "{err}"
    );

    // The example rules shipped with the repository are valid.
    let examples = common::repo_path("examples/rules");
    let output = ratelimitd(&["rules", "validate", examples.to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    let envoy = common::repo_path("examples/envoy/ratelimit");
    let output = ratelimitd(&["rules", "validate", "--envoy", envoy.to_str().unwrap()], &[]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(stdout(&output).contains("ok, 1 domains"), "{}", stdout(&output));
    let bad = Rules::new("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: fortnight }\n");
    let output = ratelimitd(&["rules", "validate", "--envoy", bad.path().to_str().unwrap()], &[]);
    assert_eq!(output.status.code(), Some(1));
    assert!(stderr(&output).contains("invalid rate limit unit 'fortnight'"), "{}", stderr(&output));
}

/// A dead-letter file that cannot be written (here its directory is a
/// file: refused even to root) stops the start, naming the key: found at
/// the first failed decision, every record would be lost.
#[test]
fn serve_refuses_to_start_without_a_writable_dead_letter_file() {
    let dir = tempfile::tempdir().unwrap();
    let not_a_dir = dir.path().join("state");
    std::fs::write(&not_a_dir, "").unwrap();
    let output = ratelimitd(
        &["serve"],
        &[
            ("RATELIMITD__DLQ__FILE", not_a_dir.join("dlq.jsonl").to_str().unwrap()),
            ("RATELIMITD__GRPC__LISTEN", &format!("127.0.0.1:{}", free_port())),
            ("RATELIMITD__HTTP__LISTEN", &format!("127.0.0.1:{}", free_port())),
        ],
    );
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("dlq.file") && stderr(&output).contains("cannot be written"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn serve_refuses_to_start_on_invalid_rules() {
    let bad = Rules::new("rules:\n  - { rule_id: x, resource_path: /x, limit: 0, window_seconds: 1 }\n");
    let output = ratelimitd(
        &["serve"],
        &[
            ("RATELIMITD__RULES__PATH", bad.path().to_str().unwrap()),
            ("RATELIMITD__GRPC__LISTEN", &format!("127.0.0.1:{}", free_port())),
            ("RATELIMITD__HTTP__LISTEN", &format!("127.0.0.1:{}", free_port())),
        ],
    );
    assert_eq!(output.status.code(), Some(1));
    assert!(stderr(&output).contains("field `limit`: must be at least 1"), "{}", stderr(&output));
}

/// `serve` on Redis, `check` against it (text and JSON, exit codes), then
/// SIGTERM: the process drains and exits 0.
#[test]
fn serve_check_and_sigterm_with_redis() {
    let redis = RedisServer::start();
    let rules = Rules::new(RULES);
    let serve = Serve::start(&rules.path(), Some(&redis.url()));

    let first = serve.check(&["--user", "u1", "--path", "/two"]);
    assert_eq!(first.status.code(), Some(0), "{}", stderr(&first));
    let text = stdout(&first);
    assert!(text.contains("allowed         true"), "{text}");
    assert!(text.contains("rule_id         two"), "{text}");
    assert!(text.contains("remaining       1"), "{text}");

    let second = serve.check(&["--user", "u1", "--path", "/two", "--json"]);
    assert_eq!(second.status.code(), Some(0));
    let json: serde_json::Value = serde_json::from_slice(&second.stdout).unwrap();
    assert_eq!(json["remaining_tokens"], 0);
    assert_eq!(json["reason"], "OK");

    let denied = serve.check(&["--user", "u1", "--path", "/two", "--json"]);
    assert_eq!(denied.status.code(), Some(1), "denied exits 1");
    let json: serde_json::Value = serde_json::from_slice(&denied.stdout).unwrap();
    assert_eq!(json["reason"], "OVER_LIMIT");
    assert!(json["retry_after_ms"].as_i64().unwrap() > 0);

    // A peek counts nothing; a report counts past the limit.
    let peek = serve.check(&["--user", "u2", "--path", "/two", "--peek", "--json"]);
    assert_eq!(peek.status.code(), Some(0), "{}", stderr(&peek));
    let json: serde_json::Value = serde_json::from_slice(&peek.stdout).unwrap();
    assert_eq!(json["remaining_tokens"], 2);
    let report = serve.check(&["--user", "u2", "--path", "/two", "--report", "--weight", "5", "--json"]);
    assert_eq!(report.status.code(), Some(1), "the next request would be refused");
    let json: serde_json::Value = serde_json::from_slice(&report.stdout).unwrap();
    assert_eq!(json["reason"], "OVER_LIMIT");
    assert_eq!(serve.check(&["--user", "u2", "--path", "/two"]).status.code(), Some(1));

    let invalid = serve.check(&["--user", "", "--path", "/two"]);
    assert_eq!(invalid.status.code(), Some(64));
    assert!(stderr(&invalid).contains("user_id: must not be empty"), "{}", stderr(&invalid));

    // Redis gone: the rule fails closed, and the answer says the store did not decide.
    let mut redis = redis;
    redis.stop();
    let failed = serve.check(&["--user", "u3", "--path", "/two"]);
    assert_eq!(failed.status.code(), Some(1));
    let text = stdout(&failed);
    assert!(text.contains("reason          FAIL_CLOSED"), "{text}");
    assert!(text.contains("store_error     "), "{text}");
    let json: serde_json::Value =
        serde_json::from_slice(&serve.check(&["--user", "u3", "--path", "/two", "--json"]).stdout).unwrap();
    assert!(json["store_error"].as_str().is_some_and(|kind| !kind.is_empty()), "{json}");

    let (status, log) = serve.terminate();
    assert!(status.success(), "exit {status:?}\n{log}");
    assert!(log.contains("SIGTERM received"), "{log}");
    assert!(log.contains("ratelimitd stopped"), "{log}");
    assert!(!log.contains("embedded defaults"), "{log}");
    // Nothing keeps the Redis store alive past the engine: its dispatchers
    // end at once, not at the grace period.
    assert!(!log.contains("after the grace period"), "{log}");
}

/// With no configuration at all, `serve` runs on the embedded defaults and
/// says so in one log line.
#[test]
fn embedded_defaults_say_so() {
    let rules = Rules::new(RULES);
    let serve = Serve::start(&rules.path(), None);
    let ok = serve.check(&["--user", "u1", "--path", "/two"]);
    assert_eq!(ok.status.code(), Some(0), "{}", stderr(&ok));
    let (status, log) = serve.terminate();
    assert!(status.success(), "{log}");
    assert!(log.contains("embedded defaults: in-memory counters"), "{log}");
}

/// `check` against nothing exits 69 (unavailable).
#[test]
fn check_without_a_server_exits_69() {
    let addr = format!("http://127.0.0.1:{}", free_port());
    let output = ratelimitd(&["check", "--addr", &addr, "--user", "u", "--path", "/x"], &[]);
    assert_eq!(output.status.code(), Some(69), "{}", stderr(&output));
}

/// SIGTERM under sustained load (16 callers on 4 connections, Redis store,
/// the production default `grpc.drain_delay_ms` of 0): every call is
/// answered with a real decision or refused unprocessed (`unprocessed`:
/// a new stream on a closing connection, or no connection at all); none is
/// cut off in flight; the process exits 0. Prints the counts. Whether a
/// call went out before the signal is not what decides: a caller's clock
/// reading precedes its request by a scheduling delay, so on a loaded
/// machine a call timed "before" can reach a server that already closed.
#[test]
fn sigterm_under_load_fails_no_in_flight_call() {
    use std::sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    };

    use ratelimitd::api::pb::{self, rate_limiter_client::RateLimiterClient};

    let redis = RedisServer::start();
    let rules = Rules::new(
        "rules:\n  - { rule_id: many, resource_path: /many, limit: 100000000, window_seconds: 3600 }\n",
    );
    let serve = Serve::start_with(
        &rules.path(),
        Some(&redis.url()),
        &[("RATELIMITD__GRPC__SHUTDOWN_GRACE_MS", "10000")],
    );
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let answered = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // (sent at, outcome) of every call; outcome None = a real decision.
    type Calls = Arc<Mutex<Vec<(Instant, Option<tonic::Status>)>>>;
    let calls: Calls = Arc::default();
    let addr = serve.addr.clone();
    let callers = runtime.block_on(async {
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(RateLimiterClient::connect(addr.clone()).await.unwrap());
        }
        (0..16)
            .map(|i| {
                let mut client = clients[i % 4].clone();
                let (answered, stop, calls) = (Arc::clone(&answered), Arc::clone(&stop), Arc::clone(&calls));
                tokio::spawn(async move {
                    let mut n = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let request = pb::RateLimitRequest {
                            user_id: format!("caller-{i}"),
                            resource_path: "/many".to_owned(),
                            ..Default::default()
                        };
                        let sent = Instant::now();
                        let outcome = match client.check(request).await {
                            Ok(response) => {
                                let r = response.into_inner();
                                assert_eq!(r.reason, pb::Reason::Ok as i32, "{r:?}");
                                answered.fetch_add(1, Ordering::Relaxed);
                                None
                            }
                            Err(status) => Some(status),
                        };
                        let refused = outcome.is_some();
                        calls.lock().unwrap().push((sent, outcome));
                        n += 1;
                        if refused {
                            // The server is gone for this connection.
                            break;
                        }
                    }
                    n
                })
            })
            .collect::<Vec<_>>()
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while answered.load(Ordering::Relaxed) < 2_000 {
        assert!(Instant::now() < deadline, "the load never reached 2000 decisions");
        std::thread::sleep(Duration::from_millis(5));
    }
    let signalled = Instant::now();
    serve.signal_term();
    let (status, log) = serve.wait_exit();
    stop.store(true, Ordering::Relaxed);
    runtime.block_on(async {
        for caller in callers {
            caller.await.unwrap();
        }
    });
    let calls = calls.lock().unwrap();
    let before = calls.iter().filter(|(sent, _)| *sent < signalled).count();
    let refused = |before_signal: bool| {
        calls
            .iter()
            .filter(|(sent, outcome)| (*sent < signalled) == before_signal && outcome.is_some())
            .count()
    };
    eprintln!(
        "SIGTERM under load: {before} calls timed before the signal, {} refused unprocessed; {} after it, {} refused unprocessed",
        refused(true),
        calls.len() - before,
        refused(false),
    );
    let cut_off: Vec<_> = calls
        .iter()
        .filter_map(|(_, outcome)| outcome.as_ref())
        .filter(|status| !unprocessed(status))
        .collect();
    assert!(cut_off.is_empty(), "calls failed in flight: {cut_off:?}");
    assert!(status.success(), "exit {status:?}\n{log}");
    assert!(log.contains("SIGTERM received") && log.contains("ratelimitd stopped"), "{log}");
}

/// A call the server never took: a new stream refused by a graceful
/// GOAWAY (NO_ERROR: not processed) or with REFUSED_STREAM, one never sent
/// because its connection had closed (CANCELLED, "connection closed"), or
/// no connection at all (the server no longer listening). Anything else (a
/// reset, a broken connection mid-call) is a call cut off in flight.
fn unprocessed(status: &tonic::Status) -> bool {
    let text = format!("{status:?}");
    text.contains("GoAway(b\"\", NO_ERROR, Remote)")
        || text.contains("REFUSED_STREAM")
        || (status.code() == tonic::Code::Cancelled && text.contains("Canceled, \"connection closed\""))
        || (status.code() == tonic::Code::Unavailable && text.contains("ConnectionRefused"))
}

/// `grpc.uds`: gRPC also on a Unix socket; a stale socket file from an
/// earlier run is replaced, the file is gone after a graceful shutdown,
/// and a path holding another kind of file refuses to start, naming the key.
#[test]
fn grpc_on_a_unix_socket_replaces_a_stale_one_and_cleans_up() {
    let rules = Rules::new(RULES);
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("rl.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap()); // stale
    let uds = socket.to_str().unwrap();
    let serve = Serve::start_with(&rules.path(), None, &[("RATELIMITD__GRPC__UDS", uds)]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(Instant::now() < deadline, "nothing on {uds}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (status, log) = serve.terminate();
    assert!(status.success(), "{log}");
    assert!(!socket.exists(), "the socket file is removed at shutdown");

    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, "keep me").unwrap();
    let out = ratelimitd(
        &["serve"],
        &[
            ("RATELIMITD__GRPC__UDS", file.to_str().unwrap()),
            ("RATELIMITD__GRPC__LISTEN", &format!("127.0.0.1:{}", free_port())),
            ("RATELIMITD__HTTP__LISTEN", &format!("127.0.0.1:{}", free_port())),
            ("RATELIMITD__DLQ__FILE", dir.path().join("dlq.jsonl").to_str().unwrap()),
        ],
    );
    assert!(!out.status.success());
    assert!(stderr(&out).contains("grpc.uds"), "{}", stderr(&out));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me", "another file is never removed");
}

/// `rules diff` names what a candidate adds, removes and changes, field by
/// field, against `--from` (default: the rules in force).
#[test]
fn rules_diff_says_what_a_candidate_changes() {
    let dir = tempfile::tempdir().unwrap();
    let old = dir.path().join("old.yaml");
    let new = dir.path().join("new.yaml");
    std::fs::write(
        &old,
        "rules:\n  - { rule_id: search, resource_path: /s, limit: 10, window_seconds: 1 }\n  - { rule_id: gone, resource_path: /g, limit: 5, window_seconds: 1 }\n",
    )
    .unwrap();
    std::fs::write(
        &new,
        "rules:\n  - { rule_id: search, resource_path: /s, limit: 20, window_seconds: 1 }\n  - { rule_id: write, resource_path: /w, limit: 1, window_seconds: 60 }\n",
    )
    .unwrap();
    let out = ratelimitd(&["rules", "diff", new.to_str().unwrap(), "--from", old.to_str().unwrap()], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.lines().next().unwrap().ends_with(": 1 added, 1 removed, 1 changed"), "{text}");
    assert!(text.contains("removed  gone: /g 5 per 1000 ms"), "{text}");
    assert!(text.contains("changed  search: limit 10 -> 20"), "{text}");
    assert!(text.contains("added    write: /w 1 per 60000 ms"), "{text}");
    // Against the rules in force (the embedded set here): a candidate that
    // does not load is an error naming its file.
    std::fs::write(&new, "rules: [ { rule_id: x } ]\n").unwrap();
    let out = ratelimitd(&["rules", "diff", new.to_str().unwrap()], &[]);
    assert!(!out.status.success() && stderr(&out).contains("new.yaml"), "{}", stderr(&out));
}

/// `rules diff --envoy` does the same for Envoy limits, by full key, and
/// counts the captured Envoy requests each change touches.
#[test]
fn rules_diff_says_what_an_envoy_candidate_changes_and_touches() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let old = write(
        "old.yaml",
        "domain: edge\ndescriptors:\n  - { key: user, rate_limit: { unit: minute, requests_per_unit: 10 } }\n  - { key: path, value: /a, rate_limit: { unit: minute, requests_per_unit: 5 } }\n",
    );
    let new = write(
        "new.yaml",
        "domain: edge\ndescriptors:\n  - { key: user, rate_limit: { unit: minute, requests_per_unit: 5 } }\n  - { key: path, value: /b, rate_limit: { unit: hour, requests_per_unit: 3 } }\n",
    );
    let record = |key: &str, value: &str| {
        format!(
            r#"{{"schema":"ratelimitd.capture/1","time_ms":1,"instance":"i","client_type":null,"priority":null,"weight":1,"count":"check","headers":{{}},"rules_version":"v","rule_id":null,"effective_priority":"CRITICAL","allowed":true,"reason":"OK","envoy":{{"domain":"edge","descriptors":[{{"entries":[["{key}","{value}"]]}}],"hits_addend":1}}}}"#
        )
    };
    let capture =
        write("capture.jsonl", &[record("user", "a"), record("path", "/a"), record("path", "/c")].join("\n"));
    let args = ["rules", "diff", "--envoy", new.to_str().unwrap(), "--from-envoy", old.to_str().unwrap()];
    let out = ratelimitd(&[&args[..], &["--capture", capture.to_str().unwrap()]].concat(), &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.lines().next().unwrap().ends_with(": 1 added, 1 removed, 1 changed"), "{text}");
    assert!(
        text.contains("removed  edge.path_/a: 5 PER MINUTE  (touches 1 of 3 captured requests)"),
        "{text}"
    );
    assert!(
        text.contains("changed  edge.user: limit 10 PER MINUTE -> 5 PER MINUTE  (touches 1 of 3"),
        "{text}"
    );
    assert!(text.contains("added    edge.path_/b: 3 PER HOUR  (touches 0 of 3"), "{text}");
}

/// `audit --kind`'s help names every failure kind a record can carry.
#[test]
fn audit_help_names_every_failure_kind() {
    let help = stdout(&ratelimitd(&["audit", "--help"], &[]));
    for kind in ratelimitd::limiter::FailureKind::ALL {
        assert!(help.contains(kind.as_str()), "audit --help does not name {}", kind.as_str());
    }
}
