//! Attacks on what callers share, each measured against the bound the
//! service documents (docs/hostile-input.md): the request byte budget from
//! one connection or address, HTTP/2 floods, unfinished HTTP heads against
//! the probes, forged outcome reports. Attackers come from other loopback
//! addresses (127.0.0.2, …): to the service, other peers.

mod common;

use std::time::{Duration, Instant};

use common::{Rules, TestServer, check, grpc_headers, h2_connect, h2_drain, h2_frame, reason, request};
use ratelimitd::api::pb::Reason;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const RULES: &str = r#"
rules:
  - { rule_id: limited, resource_path: /limited, limit: 5, window_seconds: 86400 }
"#;

const CHECK_BATCH: &str = "/ratelimit.v1.RateLimiter/CheckBatch";

/// Opens `streams` CheckBatch calls on `socket`, each sending only the
/// 5-byte gRPC prefix that announces a 4 MiB message (never sent).
async fn announce(socket: &mut tokio::net::TcpStream, first_stream: u32, streams: u32) {
    let mut prefix = vec![0u8];
    prefix.extend_from_slice(&(4u32 << 20).to_be_bytes());
    let headers = grpc_headers(CHECK_BATCH);
    let mut frames = Vec::new();
    for i in 0..streams {
        let stream = first_stream + 2 * i;
        frames.extend(h2_frame(1, 0x4, stream, &headers)); // END_HEADERS
        frames.extend(h2_frame(0, 0, stream, &prefix));
    }
    socket.write_all(&frames).await.unwrap();
}

/// Connections from each of `addrs`, `per_addr` of them, each announcing
/// 40 × 4 MiB (never sent) every half second for `for_how_long`: 320 MiB a
/// round from two connections alone, where the whole budget is 128 MiB.
fn flood(
    server: std::net::SocketAddr,
    addrs: &'static [&'static str],
    per_addr: usize,
    for_how_long: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut sockets = Vec::new();
        for addr in addrs {
            for _ in 0..per_addr {
                sockets.push(h2_connect(server, addr).await);
            }
        }
        let until = Instant::now() + for_how_long;
        let mut next_stream = 1;
        let mut drains = Vec::new();
        while Instant::now() < until {
            for socket in &mut sockets {
                announce(socket, next_stream, 40).await;
            }
            next_stream += 80;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        for socket in sockets {
            drains.push(h2_drain(socket));
        }
        for drain in drains {
            drain.abort();
        }
    })
}

/// The bytes the service on HTTP port `http` holds for unfinished
/// requests, and the requests refused for their caller's share, by share.
async fn budget(http: std::net::SocketAddr) -> (f64, Vec<(&'static str, f64)>) {
    let scrape = tokio::task::spawn_blocking(move || common::http_get(http, "/metrics")).await.unwrap().1;
    let value = |series: &str| -> f64 {
        let value = scrape.lines().find_map(|line| line.strip_prefix(series));
        value.and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("no {series}in the scrape"))
    };
    let held = value("ratelimitd_grpc_request_bytes_in_flight ");
    let refused = ["connection", "peer", "untrusted", "pool", "reclaimed"]
        .into_iter()
        .map(|share| {
            (share, value(&format!("ratelimitd_grpc_requests_over_budget_total{{share=\"{share}\"}} ")))
        })
        .collect();
    (held, refused)
}

/// Seven Checks of alice on the limit of 5 from `client`: each answered
/// within a second, the first five admitted, the rest OVER_LIMIT.
async fn five_of_seven_in_time(
    client: &mut ratelimitd::api::pb::rate_limiter_client::RateLimiterClient<tonic::transport::Channel>,
) {
    let mut answers = Vec::new();
    for _ in 0..7 {
        let started = Instant::now();
        let answer = check(client, request("alice", "/limited")).await;
        assert!(started.elapsed() < Duration::from_secs(1), "answered in {:?}", started.elapsed());
        answers.push((answer.allowed, reason(&answer)));
    }
    assert_eq!(answers.iter().filter(|(allowed, _)| *allowed).count(), 5, "{answers:?}");
    assert!(answers[5..].iter().all(|(_, r)| *r == Reason::OverLimit), "{answers:?}");
}

/// A flood from one address (two connections announcing 4 MiB messages
/// they never send) holds at most that address's share (32 MiB of the 128
/// MiB budget): meanwhile another caller's Checks are decided exactly and
/// in time, 5 of 7 admitted on a limit of 5; the flooding address's own
/// Check is decided, never answered with an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_byte_flood_from_one_address_holds_its_32_mib_share_and_others_are_decided_exactly() {
    let rules = Rules::new(RULES);
    let server = TestServer::start(common::config(&rules.path(), None)).await;
    let attack = flood(server.addr, &["127.0.0.2"], 2, Duration::from_secs(3));
    tokio::time::sleep(Duration::from_millis(1_000)).await;

    five_of_seven_in_time(&mut server.client().await).await;

    // The flooding address's own Check is decided, never an error: denied
    // as CALLER_BUSY while its share is full, or admitted in what is left
    // of it (its streams' header blocks leave less than a 4 MiB message).
    let mut flooder = server.client_from("127.0.0.2").await;
    let own = check(&mut flooder, request("mallory", "/limited")).await;
    match reason(&own) {
        Reason::CallerBusy => assert!(!own.allowed && own.retry_after_ms > 0, "{own:?}"),
        Reason::Ok => assert!(own.allowed, "{own:?}"),
        other => panic!("{other:?}: {own:?}"),
    }

    let (held, refused) = budget(server.http_addr).await;
    assert!(held <= f64::from(32u32 << 20), "held {held} bytes");
    assert!(held >= f64::from(16u32 << 20), "the attack was not seen: {held}");
    let by_share: f64 = refused.iter().map(|(_, n)| n).sum();
    assert!(by_share >= 100.0, "{refused:?}");
    attack.await.unwrap();
    server.stop().await.unwrap();
}

/// Five addresses, two connections each, announcing 4 MiB messages they
/// never send, with default settings (no trusted peers), more than the
/// whole budget: the untrusted part is half the pool and the address
/// holding most is reclaimed from when another needs room: another caller's Checks (5 of 7 on a limit of 5) and
/// ShouldRateLimit (3 of 5 on 3 a minute) are decided exactly, in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_addresses_announcing_messages_leave_another_caller_decided_exactly() {
    use ratelimitd::api::envoy_pb::rls::{
        rate_limit_response::Code, rate_limit_service_client::RateLimitServiceClient,
    };
    let rules = Rules::new(RULES);
    let mut config = common::config(&rules.path(), None);
    config.rules.envoy_path = Some(common::repo_path("examples/envoy/ratelimit"));
    let server = TestServer::start(config).await;
    let attackers = &["127.0.5.1", "127.0.5.2", "127.0.5.3", "127.0.5.4", "127.0.5.5"];
    let attack = flood(server.addr, attackers, 2, Duration::from_secs(4));
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    five_of_seven_in_time(&mut server.client_from("127.0.6.1").await).await;

    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .unwrap()
        .local_address(Some("127.0.6.2".parse().unwrap()))
        .connect()
        .await
        .unwrap();
    let mut envoy = RateLimitServiceClient::new(channel);
    let mut codes = Vec::new();
    for _ in 0..5 {
        let answer = envoy.should_rate_limit(common::rls_request("edge", "user", "ann")).await.unwrap();
        let answer = answer.into_inner();
        assert!(
            answer.response_headers_to_add.iter().all(|h| h.key != "x-ratelimit-error"),
            "flagged: {answer:?}"
        );
        codes.push(answer.overall_code);
    }
    let ok = i32::from(Code::Ok);
    assert_eq!(codes.iter().filter(|c| **c == ok).count(), 3, "{codes:?}");
    let (held, refused) = budget(server.http_addr).await;
    assert!(held <= f64::from(64u32 << 20), "untrusted peers held {held} bytes, over their half");
    assert!(refused.iter().map(|(_, n)| n).sum::<f64>() >= 100.0, "the attack was not seen: {refused:?}");
    attack.abort();
    server.stop().await.unwrap();
}

/// Through a fail-open Envoy (trusted: `grpc.trusted_peers`), a user on 3
/// a minute gets 3 of 200 requests through while three other addresses
/// flood the byte budget (6 connections announcing 4 MiB messages they
/// never send, 960 MiB a round): they hold at most the untrusted half, the
/// Envoy's decisions are made normally, and none becomes an error Envoy
/// would answer with "allow".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_envoy_a_user_on_3_a_minute_gets_3_of_200_during_a_byte_flood() {
    let redis = common::RedisServer::start();
    let mut config = common::default_rules_config(Some(redis.url()));
    config.rules.envoy_path = Some(common::repo_path("examples/envoy/ratelimit"));
    config.grpc.trusted_peers = vec!["127.0.0.1".to_owned()];
    let server = TestServer::start(config).await;
    let dir = tempfile::tempdir().unwrap();
    let (_upstream, upstream_port) = common::python_upstream(dir.path());
    let example = std::fs::read_to_string(common::repo_path("examples/envoy/envoy.yaml")).unwrap();
    assert!(example.contains("failure_mode_deny: false"), "the example's filter fails open");
    let (_envoy, port) = common::example_envoy(dir.path(), server.addr.port(), upstream_port);

    let attack = flood(server.addr, &["127.0.0.2", "127.0.0.3", "127.0.0.4"], 2, Duration::from_secs(12));
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let codes = tokio::task::spawn_blocking(move || {
        (0..200)
            .map(|_| common::http_get_raw(port, "/", &[("x-user-id", b"victim")]).status)
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    let passed = codes.iter().filter(|code| **code == 200).count();
    assert_eq!(passed, 3, "{codes:?}");
    assert_eq!(codes.iter().filter(|code| **code == 429).count(), 197, "{codes:?}");

    let (held, refused) = budget(server.http_addr).await;
    assert!(held <= f64::from(64u32 << 20), "untrusted peers held {held} bytes, over their half");
    assert!(refused.iter().map(|(_, n)| n).sum::<f64>() >= 100.0, "the attack was not seen: {refused:?}");
    attack.abort();
    server.stop().await.unwrap();
}

/// One address opening 40 gRPC connections and holding them keeps 4
/// (`grpc.max_connections_per_peer`); the rest are closed as soon as
/// accepted, so the 8 places (`grpc.max_connections`) are not all its own:
/// another address still connects and is decided exactly, in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_address_holds_at_most_its_connections_and_others_still_connect() {
    let rules = Rules::new(RULES);
    let mut config = common::config(&rules.path(), None);
    config.grpc.max_connections = 8;
    config.grpc.max_connections_per_peer = 4;
    let server = TestServer::start(config).await;
    let mut held = Vec::new();
    let mut closed = 0;
    for _ in 0..40 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut socket = socket.connect(server.addr).await.unwrap();
        // The server speaks first (its SETTINGS) on a connection it keeps.
        let mut first = [0u8; 9];
        match tokio::time::timeout(Duration::from_secs(2), socket.write_all(common::H2_START)).await {
            Ok(Ok(())) => {}
            _ => {
                closed += 1;
                continue;
            }
        }
        match tokio::time::timeout(Duration::from_secs(2), socket.read_exact(&mut first)).await {
            Ok(Ok(_)) => held.push(socket),
            _ => closed += 1,
        }
    }
    assert_eq!((held.len(), closed), (4, 36), "one address's connections kept and closed");

    let mut honest = server.client_from("127.0.0.3").await;
    let mut admitted = 0;
    for _ in 0..7 {
        let started = Instant::now();
        let answer = check(&mut honest, request("alice", "/limited")).await;
        assert!(started.elapsed() < Duration::from_secs(1), "answered in {:?}", started.elapsed());
        admitted += usize::from(answer.allowed);
    }
    assert_eq!(admitted, 5);
    let refused = common::metric(&server, "ratelimitd_grpc_connections_over_peer_share_total ").await;
    assert_eq!(refused, Some(36.0));
    drop(held);
    server.stop().await.unwrap();
}

/// Opens `per_address` idle gRPC connections from each of `addresses`
/// loopback addresses (127.0.1.x), preface sent, and holds those the
/// server keeps.
async fn idle_connections(
    addr: std::net::SocketAddr,
    addresses: u8,
    per_address: usize,
) -> Vec<tokio::net::TcpStream> {
    let mut held = Vec::new();
    for a in 0..addresses {
        for _ in 0..per_address {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind(format!("127.0.1.{}:0", a + 1).parse().unwrap()).unwrap();
            let Ok(mut socket) = socket.connect(addr).await else { continue };
            let mut first = [0u8; 9];
            let kept = async {
                socket.write_all(common::H2_START).await?;
                socket.read_exact(&mut first).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), kept).await {
                held.push(socket);
            }
        }
    }
    held
}

/// Seven Checks of `user` from a new connection at `from`: each answered
/// within a second, 5 admitted (the limit).
async fn decided_in_time(server: &TestServer, from: &str, user: &str) {
    let started = Instant::now();
    let mut client = tokio::time::timeout(Duration::from_secs(1), server.client_from(from))
        .await
        .unwrap_or_else(|_| panic!("{from}: no connection within 1 s"));
    let mut admitted = 0;
    for _ in 0..7 {
        let at = Instant::now();
        let answer =
            tokio::time::timeout(Duration::from_secs(1), check(&mut client, request(user, "/limited")))
                .await
                .unwrap_or_else(|_| panic!("{from}: a Check not decided within 1 s"));
        assert!(at.elapsed() < Duration::from_secs(1), "{from}: answered in {:?}", at.elapsed());
        admitted += usize::from(answer.allowed);
    }
    assert_eq!(admitted, 5, "{from}: decided exactly");
    assert!(started.elapsed() < Duration::from_secs(3), "{from}: {:?}", started.elapsed());
}

/// 60 addresses each holding idle gRPC connections up to their share
/// (`grpc.max_connections_per_peer`) take more than every place: a new
/// untrusted caller takes the place of the one
/// idle longest, and a trusted peer finds its reserved part free, both
/// decided within a second; with no trusted peers configured, a new caller
/// still is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_addresses_of_idle_connections_leave_new_callers_decided_within_1_s() {
    for trusted in [true, false] {
        let rules = Rules::new(RULES);
        let mut config = common::config(&rules.path(), None);
        config.grpc.max_connections = 128;
        config.grpc.max_connections_per_peer = 4;
        if trusted {
            config.grpc.trusted_peers = vec!["127.0.2.1/32".to_owned()];
        }
        let server = TestServer::start(config).await;
        let held = idle_connections(server.addr, 60, 4).await;
        assert!(held.len() >= 120, "the attack holds {} connections", held.len());
        decided_in_time(&server, "127.0.3.1", "newcomer").await;
        if trusted {
            decided_in_time(&server, "127.0.2.1", "envoy").await;
        }
        let reclaimed = common::metric(&server, "ratelimitd_grpc_connections_reclaimed_total ").await;
        assert!(reclaimed.is_some_and(|r| r >= 1.0), "{reclaimed:?}");
        drop(held);
        server.stop().await.unwrap();
    }
}

/// This process's resident memory, in bytes (the server runs in it).
fn resident_bytes() -> u64 {
    resident_bytes_of(std::process::id())
}

/// The resident memory of process `pid`.
fn resident_bytes_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
        .unwrap();
    kib * 1024
}

/// Runs `attack` (frames written on one connection from 127.0.0.2, never
/// reading) for `for_how_long` while another connection checks every 50
/// ms: each answered within a second, exactly (5 admitted on a limit of
/// 5, then OVER_LIMIT), and the process growing by less than 64 MiB.
/// Returns how many frames the attacker wrote.
async fn flood_leaves_others_decided(
    attack: impl Fn(u32) -> Vec<u8> + Send + 'static,
    for_how_long: Duration,
) -> tokio::net::TcpStream {
    let rules = Rules::new(RULES);
    let server = TestServer::start(common::config(&rules.path(), None)).await;
    let mut honest = server.client().await;
    check(&mut honest, request("warm-up", "/limited")).await;
    let before = resident_bytes();
    let addr = server.addr;
    let attacker = tokio::spawn(async move {
        let mut socket = h2_connect(addr, "127.0.0.2").await;
        let until = Instant::now() + for_how_long;
        let mut round = 0u32;
        while Instant::now() < until {
            let frames = attack(round);
            // A server that stops reading stalls the attacker, not the others.
            match tokio::time::timeout(Duration::from_millis(200), socket.write_all(&frames)).await {
                Ok(Ok(())) => round += 1,
                Ok(Err(_)) => break, // told to go and closed
                Err(_) => {}
            }
        }
        socket
    });
    let mut answers = Vec::new();
    let mut slowest = Duration::ZERO;
    let started = Instant::now();
    while started.elapsed() < for_how_long {
        let at = Instant::now();
        let answer = check(&mut honest, request("alice", "/limited")).await;
        slowest = slowest.max(at.elapsed());
        answers.push(answer.allowed);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let grown = resident_bytes().saturating_sub(before);
    let socket = attacker.await.unwrap();
    assert!(slowest < Duration::from_secs(1), "a check took {slowest:?}");
    assert!(answers.len() > 10, "{} checks", answers.len());
    assert!(answers[..5].iter().all(|a| *a) && answers[5..].iter().all(|a| !*a), "{answers:?}");
    assert!(grown < 64 << 20, "the process grew by {} MiB", grown >> 20);
    server.stop().await.unwrap();
    socket
}

/// A Check header block of about 15.6 KiB decoded: the request's headers
/// and one literal header whose value fills the rest of
/// `grpc.max_header_list_bytes` (16 KiB).
fn large_header_block() -> Vec<u8> {
    let mut block = grpc_headers("/ratelimit.v1.RateLimiter/Check");
    let value = vec![b'a'; 15_800];
    block.extend([0x00, 0x01, b'x', 0x7f]); // a literal "x", its length on 7 bits and more
    let mut rest = value.len() - 127;
    while rest >= 128 {
        block.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    block.push(rest as u8);
    block.extend(value);
    block
}

/// 32 connections from each of `addresses`' loopback addresses (127.0.7.x),
/// split evenly, each opening 1,024 Check streams with a large header
/// block and no message, never finished, 64 more every 300 ms (about 100
/// MB a second in all), for `for_how_long`; what the server writes is read
/// and dropped.
async fn unfinished_header_streams(addr: std::net::SocketAddr, addresses: u8, for_how_long: Duration) {
    let block = large_header_block();
    let mut attackers = Vec::new();
    for c in 0..32u8 {
        let block = block.clone();
        let from = format!("127.0.7.{}", 1 + c % addresses);
        attackers.push(tokio::spawn(async move {
            let socket = h2_connect(addr, &from).await;
            let (mut read, mut write) = socket.into_split();
            let reader = tokio::spawn(async move {
                let mut sink = vec![0; 64 << 10];
                while matches!(read.read(&mut sink).await, Ok(n) if n > 0) {}
            });
            let until = Instant::now() + for_how_long;
            let mut stream = 1u32;
            while Instant::now() < until && stream < 1 << 30 {
                let mut frames = Vec::new();
                for _ in 0..64 {
                    frames.extend(h2_frame(1, 0x4, stream, &block)); // END_HEADERS, no END_STREAM
                    stream += 2;
                }
                let written =
                    tokio::time::timeout(Duration::from_millis(500), write.write_all(&frames)).await;
                if matches!(written, Ok(Err(_))) {
                    break;
                }
                // About 50 MB a second from the 32 together: the budget is
                // full within a second (`requests_over_budget` below), and
                // a debug build on 2 cores still has CPU for others.
                tokio::time::sleep(Duration::from_millis(600)).await;
            }
            reader.abort();
        }));
    }
    for attacker in attackers {
        let _ = attacker.await;
    }
}

/// Header blocks are in the byte budget: 32 connections of unfinished
/// Check streams with ~15.6 KiB header blocks, from 1 and from 60 addresses,
/// against the service as it ships (its own process, its allocator) under
/// the Deployment's memory limit (1 GiB in its cgroup's `memory.max`, the
/// budget an eighth of it), on the shared runtime and on two serving
/// threads: the process grows by less than 256 MiB (twice the budget, a
/// quarter of the limit) and another caller is decided exactly, each Check
/// within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unfinished_streams_with_large_header_blocks_hold_the_budget_not_the_memory() {
    let rules = Rules::new(RULES);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("memory.max"), "1073741824\n").unwrap();
    let ceiling = 256 << 20;
    for (threads, addresses) in [("0", 1u8), ("0", 60), ("2", 1), ("2", 60)] {
        let http = common::free_port();
        let (service, port) = common::spawn_service(
            dir.path(),
            &[
                ("RATELIMITD__HTTP__LISTEN", format!("127.0.0.1:{http}")),
                ("RATELIMITD__GRPC__SERVING_THREADS", threads.to_owned()),
                ("RATELIMITD__RULES__PATH", rules.path().display().to_string()),
                ("RATELIMITD__SHED__CGROUP_ROOT", dir.path().display().to_string()),
            ],
        );
        let pid = service.0.id();
        let (_, metrics) = common::http_get(([127, 0, 0, 1], http).into(), "/metrics");
        assert!(metrics.contains("ratelimitd_grpc_request_bytes_limit 134217728"), "an eighth of 1 GiB");
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .local_address(Some("127.0.8.1".parse().unwrap()))
            .connect()
            .await
            .unwrap();
        let mut honest = ratelimitd::api::pb::rate_limiter_client::RateLimiterClient::new(channel);
        check(&mut honest, request("warm-up", "/limited")).await;
        let before = resident_bytes_of(pid);
        let attack = tokio::spawn(unfinished_header_streams(addr, addresses, Duration::from_secs(4)));
        let mut answers = Vec::new();
        let mut grown = 0;
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(4) || answers.len() < 7 {
            let at = Instant::now();
            let answer = check(&mut honest, request("alice", "/limited")).await;
            let took = at.elapsed();
            assert!(took < Duration::from_secs(1), "{threads} threads, {addresses}: a check took {took:?}");
            answers.push(answer.allowed);
            grown = grown.max(resident_bytes_of(pid).saturating_sub(before));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        attack.await.unwrap();
        let (_, refused) = budget(([127, 0, 0, 1], http).into()).await;
        let refused: f64 = refused.iter().map(|(_, n)| n).sum();
        assert!(refused > 0.0, "{threads} threads, {addresses}: the flood never reached a byte bound");
        assert!(
            answers[..5].iter().all(|a| *a) && answers[5..].iter().all(|a| !*a),
            "{threads} threads, {addresses}: {answers:?}"
        );
        eprintln!("serving threads {threads}, {addresses} address(es): grew by {} MiB", grown >> 20);
        assert!(grown < ceiling, "{threads} threads, {addresses}: the process grew by {} MiB", grown >> 20);
    }
}

/// Rapid reset (CVE-2023-44487): 100 Check streams opened and reset at
/// once, round after round, on one connection: another connection's
/// checks are answered in time and exactly; the server closes the
/// attacker's connection (more than 20 of its streams wait reset).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rapid_reset_flood_leaves_other_connections_decided_in_time() {
    let headers = grpc_headers("/ratelimit.v1.RateLimiter/Check");
    let mut attacker = flood_leaves_others_decided(
        move |round| {
            let mut frames = Vec::new();
            for i in 0..100u32 {
                let stream = 1 + 2 * (round * 100 + i);
                frames.extend(h2_frame(1, 0x4, stream, &headers)); // END_HEADERS
                frames.extend(h2_frame(3, 0, stream, &8u32.to_be_bytes())); // RST_STREAM CANCEL
            }
            frames
        },
        Duration::from_secs(2),
    )
    .await;
    // What the server wrote is read to its end: the connection was closed
    // (a kept one would leave the read waiting).
    let mut sink = vec![0; 64 * 1024];
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        while matches!(attacker.read(&mut sink).await, Ok(n) if n > 0) {}
    })
    .await;
    assert!(closed.is_ok(), "the attacker kept its connection through 2 s of resets");
}

/// CONTINUATION flood (CVE-2024-27316's kind): a header block that never
/// ends, 16 KiB frames after 16 KiB frames: the server holds at most
/// `grpc.max_header_list_bytes` of it and other connections are decided
/// in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_continuation_flood_holds_one_header_list_and_others_are_decided() {
    let mut block = grpc_headers("/ratelimit.v1.RateLimiter/Check");
    block.extend([0x00, 0x01, b'x', 0x7f, 0x81, 0x7f]); // a literal "x" announcing a 16 KiB value
    let filler = vec![b'a'; 16 << 10];
    flood_leaves_others_decided(
        move |round| {
            if round == 0 {
                h2_frame(1, 0, 1, &block) // HEADERS without END_HEADERS
            } else {
                (0..16).flat_map(|_| h2_frame(9, 0, 1, &filler)).collect() // CONTINUATION
            }
        },
        Duration::from_secs(2),
    )
    .await;
}

/// PING and SETTINGS floods from a client that never reads the
/// acknowledgements: other connections are decided in time and the
/// process does not grow with the acknowledgements owed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ping_and_settings_floods_leave_other_connections_decided() {
    flood_leaves_others_decided(
        |round| {
            (0..1_000u64)
                .flat_map(|i| {
                    if i % 2 == 0 {
                        h2_frame(6, 0, 0, &(u64::from(round) * 1_000 + i).to_be_bytes()) // PING
                    } else {
                        h2_frame(4, 0, 0, &[0, 3, 0, 0, 0, 100]) // SETTINGS_MAX_CONCURRENT_STREAMS
                    }
                })
                .collect()
        },
        Duration::from_secs(2),
    )
    .await;
}

/// `count` connections to `addr` from `from`, each sending the start of a
/// request head it never finishes (slowloris); those the server closes at
/// once are dropped.
async fn unfinished_heads(
    addr: std::net::SocketAddr,
    from: &str,
    count: usize,
) -> Vec<tokio::net::TcpStream> {
    let mut held = Vec::new();
    for _ in 0..count {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
        let Ok(mut stream) = socket.connect(addr).await else { continue };
        if stream.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nX-Slow: ").await.is_ok() {
            held.push(stream);
        }
    }
    held
}

/// `/readyz` on `addr`, answered 200 within a second, ten times.
async fn ready_in_time(addr: std::net::SocketAddr) {
    for _ in 0..10 {
        let started = Instant::now();
        let (status, _) =
            tokio::task::spawn_blocking(move || common::http_get(addr, "/readyz")).await.unwrap();
        assert_eq!(status, 200);
        assert!(started.elapsed() < Duration::from_secs(1), "/readyz took {:?}", started.elapsed());
    }
}

/// 300 unfinished request heads from one address hold 8 of the HTTP
/// port's 64 places (`http.max_connections_per_peer`): `/readyz` answers
/// within a second. From 9 addresses they fill all 64: a new connection
/// takes the place of the one quiet longest, and `/readyz` still answers
/// within a second; so does the probe port (`http.probe_listen`), whose
/// places are its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unfinished_request_heads_leave_readyz_answering_within_1_s() {
    let rules = Rules::new(RULES);
    let mut config = common::config(&rules.path(), None);
    let probe_port = common::free_port();
    config.http.probe_listen = Some(format!("127.0.0.1:{probe_port}"));
    let server = TestServer::start(config).await;
    let one_address = unfinished_heads(server.http_addr, "127.0.0.2", 300).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    ready_in_time(server.http_addr).await;

    let mut many = Vec::new();
    for host in 3..12 {
        many.push(unfinished_heads(server.http_addr, &format!("127.0.0.{host}"), 8).await);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    ready_in_time(server.http_addr).await;
    let probes: std::net::SocketAddr = format!("127.0.0.1:{probe_port}").parse().unwrap();
    ready_in_time(probes).await;
    let (status, _) =
        tokio::task::spawn_blocking(move || common::http_get(probes, "/metrics")).await.unwrap();
    assert_eq!(status, 404, "the probe port serves the probes alone");
    drop((one_address, many));
    server.stop().await.unwrap();
}

/// 10 addresses of 8 keep-alive connections each, within their share,
/// polling `/readyz` every 2 s, 80 for 64 places: another client's `/readyz` is answered within a second, ten times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keep_alive_pollers_from_10_addresses_leave_another_client_answered_within_1_s() {
    let rules = Rules::new(RULES);
    let server = TestServer::start(common::config(&rules.path(), None)).await;
    let addr = server.http_addr;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut pollers = Vec::new();
    for host in 0..10 {
        for _ in 0..8 {
            let stop = std::sync::Arc::clone(&stop);
            pollers.push(tokio::spawn(async move {
                let mut socket = None;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if socket.is_none() {
                        let fresh = tokio::net::TcpSocket::new_v4().unwrap();
                        fresh.bind(format!("127.0.4.{}:0", host + 1).parse().unwrap()).unwrap();
                        socket = fresh.connect(addr).await.ok();
                    }
                    if let Some(open) = socket.as_mut() {
                        let polled = async {
                            open.write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n").await?;
                            let mut answer = [0u8; 512];
                            let n = open.read(&mut answer).await?;
                            if n == 0 { Err(std::io::ErrorKind::UnexpectedEof.into()) } else { Ok(()) }
                        };
                        if tokio::time::timeout(Duration::from_secs(1), polled)
                            .await
                            .map_or(true, |r: std::io::Result<()>| r.is_err())
                        {
                            socket = None;
                        }
                    }
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }));
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    ready_in_time(addr).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for poller in pollers {
        poller.await.unwrap();
    }
    server.stop().await.unwrap();
}

/// Checks `n` times for `user` on `server`; returns how many were admitted.
async fn admitted(server: &TestServer, user: &str, path: &str, n: usize) -> usize {
    let mut client = server.client().await;
    let mut allowed = 0;
    for _ in 0..n {
        allowed += usize::from(check(&mut client, request(user, path)).await.allowed);
    }
    allowed
}

/// How Redis fails in [`three_instances_share_a_limit_of_30`].
#[derive(Clone, Copy)]
enum Outage {
    /// Killed: connections refused.
    Killed,
    /// Stopped (SIGSTOP): connections open, nothing answered.
    Hung,
}

/// Three instances in one process (one host name, one state directory)
/// count as three in the store's live set: with Redis killed they admit 30
/// on a limit of 30 (10 each). One restarted during the outage takes its
/// predecessor's count and owed hits from the state directory: it adds
/// at most its share (10), and once Redis is back every hit admitted
/// during the outage, the dead process's included, is written to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_on_one_host_admit_30_of_30_while_redis_is_down() {
    three_instances_share_a_limit_of_30(Outage::Killed).await;
}

/// The same with Redis hung (SIGSTOP) instead of killed: every store call
/// runs to its deadline, and the instances still admit 30 of 30.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_on_one_host_admit_30_of_30_while_redis_hangs() {
    three_instances_share_a_limit_of_30(Outage::Hung).await;
}

async fn three_instances_share_a_limit_of_30(outage: Outage) {
    const LIMIT_30: &str =
        "rules:\n  - { rule_id: thirty, resource_path: /thirty, limit: 30, window_seconds: 3600 }\n";
    let mut redis = common::RedisServer::start();
    let rules = Rules::new(LIMIT_30);
    let state = tempfile::tempdir().unwrap();
    let url = redis.url();
    let config = || {
        let mut config = common::config(&rules.path(), Some(url.clone()));
        config.local.reconcile_interval_ms = 100;
        config.local.state_dir = state.path().to_path_buf();
        config.redis.timeout_ms = 200;
        config
    };
    let mut servers = Vec::new();
    for _ in 0..3 {
        servers.push(TestServer::start(config()).await);
    }
    for server in &servers {
        let three = || async { common::metric(server, "ratelimitd_local_instances ").await == Some(3.0) };
        assert!(common::eventually(Duration::from_secs(10), three).await, "three live instances");
    }
    match outage {
        Outage::Killed => redis.stop(),
        Outage::Hung => redis.pause(),
    }
    let mut during = 0;
    for server in &servers {
        during += admitted(server, "u", "/thirty", 30).await;
    }
    assert_eq!(during, 30, "three instances admitted {during} on a limit of 30");

    let first = servers.remove(0);
    first.stop().await.unwrap();
    let restarted = TestServer::start(config()).await;
    assert_eq!(common::metric(&restarted, "ratelimitd_local_instances ").await, Some(3.0));
    assert_eq!(
        common::metric(&restarted, "ratelimitd_local_owed_hits ").await,
        Some(10.0),
        "the dead one's 10"
    );
    let after = admitted(&restarted, "u", "/thirty", 30).await;
    assert_eq!(after, 10, "the restarted instance admitted {after}: more than its share");
    servers.push(restarted);

    match outage {
        Outage::Killed => redis.restart(),
        Outage::Hung => redis.resume(),
    }
    for server in &servers {
        let paid = || async { common::metric(server, "ratelimitd_local_owed_hits ").await == Some(0.0) };
        assert!(common::eventually(Duration::from_secs(20), paid).await, "owed hits never reached Redis");
    }
    let mut client = servers[0].client().await;
    let answer = check(&mut client, request("u", "/thirty")).await;
    assert_eq!(
        (answer.allowed, answer.store_error.as_str()),
        (false, ""),
        "Redis holds the 40 hits: {answer:?}"
    );
    let other = check(&mut client, request("v", "/thirty")).await;
    assert_eq!((other.allowed, other.remaining_tokens), (true, 29), "decided by Redis again");
    for server in servers {
        server.stop().await.unwrap();
    }
}
