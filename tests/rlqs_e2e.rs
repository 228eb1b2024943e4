//! Envoy's Rate Limit Quota Service through real Envoys 1.40
//! (`examples/envoy/rlqs.yaml`), each deciding its requests itself against
//! the token bucket ratelimitd assigns it. Envoy reports about every 5 s
//! whatever `reporting_interval` says, so these tests take tens of seconds
//! of real time: the shares move only at reports.

mod common;

use std::{
    path::Path,
    time::{Duration, Instant},
};

use common::{Process, RedisServer, TestServer, default_rules_config};

fn get_path(port: u16, path: &str) -> u16 {
    common::http_get_raw(port, path, &[]).status
}

/// One Envoy on `examples/envoy/rlqs.yaml` against ratelimitd at
/// `rlqs_port`, its upstream at `upstream_port`: its listener port.
fn rlqs_envoy(dir: &Path, rlqs_port: u16, upstream_port: u16) -> (Process, u16) {
    let example = std::fs::read_to_string(common::repo_path("examples/envoy/rlqs.yaml")).unwrap();
    let (envoy, port) = common::start_envoy(dir, |listen, admin| {
        example
            .replace("port_value: 10001", &format!("port_value: {listen}"))
            .replace("port_value: 8001", &format!("port_value: {upstream_port}"))
            .replace("port_value: 8081", &format!("port_value: {rlqs_port}"))
            .replace("port_value: 9902", &format!("port_value: {admin}"))
    });
    (Process(envoy), port)
}

/// The first status other than 429 of requests to `port`, 20 a second, within
/// `seconds`.
fn until_admitted(port: u16, seconds: u64) -> Option<u16> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while Instant::now() < deadline {
        let status = get_path(port, "/");
        if status != 429 {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// The Rate Limit Quota Service through two real Envoys 1.40
/// (`examples/envoy/rlqs.yaml`): each decides its requests itself against
/// the token bucket ratelimitd assigns it. The first denies until its
/// first assignment, then admits at most its burst (5 of its 293 a minute)
/// and its refill; the second, joining while the first holds the limit, is
/// denied until the first's next reports give it its share (Envoy reports
/// about every 5 s: this test takes about 15 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_envoys_share_a_bucket_through_the_quota_service() {
    let mut cfg = default_rules_config(None);
    cfg.rules.envoy_path = Some(common::repo_path("examples/envoy/rlqs"));
    let server = TestServer::start(cfg).await;
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (upstream, upstream_port) = common::python_upstream(one.path());
    let (envoy_a, a) = rlqs_envoy(one.path(), server.addr.port(), upstream_port);
    let (envoy_b, b) = rlqs_envoy(two.path(), server.addr.port(), upstream_port);
    let (first, burst) = tokio::task::spawn_blocking(move || {
        let first = get_path(a, "/");
        let admitted = until_admitted(a, 10);
        let started = Instant::now();
        let burst: Vec<u16> = (0..30).map(|_| get_path(a, "/")).collect();
        (first, (admitted, (burst, started.elapsed())))
    })
    .await
    .unwrap();
    assert_eq!(first, 429, "no assignment yet: the bucket denies");
    let (admitted, (burst, took)) = burst;
    assert_eq!(admitted, Some(200), "assigned within 10 s");
    // Its bucket: 5 tokens, refilled at 288 a minute (4.8 a second).
    let passed = burst.iter().filter(|s| **s == 200).count() as f64;
    let most = 5.0 + 4.8 * took.as_secs_f64() + 1.0;
    assert!(passed <= most && burst.contains(&429), "{passed} of 30 in {took:?}: {burst:?}");
    // Envoy reports about every 5 s: the first lets go of the limit at its
    // next report, confirms at the one after, and the second's next gets it.
    let second = tokio::task::spawn_blocking(move || until_admitted(b, 25)).await.unwrap();
    assert_eq!(second, Some(200), "the second Envoy gets its share");
    drop((envoy_a, envoy_b, upstream));
    server.stop().await.unwrap();
}

/// One request through an Envoy: when it started and ended (seconds since
/// the test's origin) and whether it was admitted.
#[derive(Debug, Clone, Copy)]
struct Sent {
    start: f64,
    end: f64,
    admitted: bool,
}

/// An HTTP/1.1 connection kept alive to an Envoy: a request's status
/// without waiting for the connection to close.
struct KeepAlive {
    port: u16,
    stream: Option<std::io::BufReader<std::net::TcpStream>>,
}

impl KeepAlive {
    fn get(&mut self, path: &str) -> u16 {
        use std::io::{BufRead, Read, Write};
        let reader = self.stream.get_or_insert_with(|| {
            let stream = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
            stream.set_nodelay(true).unwrap();
            stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            std::io::BufReader::new(stream)
        });
        reader.get_mut().write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes()).unwrap();
        let (mut status, mut length, mut close) = (0, 0usize, false);
        let mut line = String::new();
        loop {
            line.clear();
            reader.read_line(&mut line).unwrap();
            let lower = line.trim_end().to_ascii_lowercase();
            if lower.is_empty() {
                break;
            } else if let Some(code) = lower.strip_prefix("http/1.1 ") {
                status = code[..3].parse().unwrap();
            } else if let Some(n) = lower.strip_prefix("content-length:") {
                length = n.trim().parse().unwrap();
            } else if lower == "connection: close" {
                close = true;
            }
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        if close {
            self.stream = None;
        }
        status
    }
}

/// Requests to `port` at each phase's rate (`(from s, to s, per second)`)
/// until `until` seconds past `origin`, on one kept-alive connection.
fn drive(port: u16, origin: Instant, phases: &[(f64, f64, f64)], until: f64) -> Vec<Sent> {
    let mut client = KeepAlive { port, stream: None };
    let mut sent = Vec::new();
    let mut next = 0.0f64;
    loop {
        let now = origin.elapsed().as_secs_f64();
        if now >= until {
            return sent;
        }
        let Some((_, to, rate)) = phases.iter().find(|(from, to, _)| (*from..*to).contains(&now)).copied()
        else {
            std::thread::sleep(Duration::from_millis(20));
            next = origin.elapsed().as_secs_f64();
            continue;
        };
        if now < next {
            std::thread::sleep(Duration::from_secs_f64((next - now).min(to - now).max(0.0)));
            continue;
        }
        let start = origin.elapsed().as_secs_f64();
        let status = client.get("/");
        sent.push(Sent { start, end: origin.elapsed().as_secs_f64(), admitted: status == 200 });
        next = next.max(start - 1.0) + 1.0 / rate;
    }
}

/// Drives each of `envoys` by its schedule ([`drive`]) until `until`
/// seconds from now: the origin and each Envoy's driver.
fn drive_each<const N: usize>(
    envoys: &[(Process, u16)],
    schedules: [Vec<(f64, f64, f64)>; N],
    until: f64,
) -> (Instant, Vec<tokio::task::JoinHandle<Vec<Sent>>>) {
    let origin = Instant::now();
    let drivers = envoys
        .iter()
        .zip(schedules)
        .map(|((_, port), phases)| {
            let port = *port;
            tokio::task::spawn_blocking(move || drive(port, origin, &phases, until))
        })
        .collect();
    (origin, drivers)
}

/// What each driver sent, in order.
async fn sent_by(drivers: Vec<tokio::task::JoinHandle<Vec<Sent>>>) -> Vec<Vec<Sent>> {
    let mut sent = Vec::new();
    for driver in drivers {
        sent.push(driver.await.unwrap());
    }
    sent
}

/// The most requests admitted through all Envoys in any span of `window`
/// seconds: for each admitted request, every admitted request that may
/// have been decided within `window` of its start (ended after it started
/// and started before the span ends), an upper bound of what Envoy decided.
fn most_in_a_window(all: &[Sent], window: f64) -> usize {
    let admitted: Vec<&Sent> = all.iter().filter(|s| s.admitted).collect();
    admitted
        .iter()
        .map(|from| admitted.iter().filter(|s| s.end >= from.start && s.start < from.start + window).count())
        .max()
        .unwrap_or(0)
}

fn admitted_between(sent: &[Sent], from: f64, to: f64) -> usize {
    sent.iter().filter(|s| s.admitted && s.start >= from && s.start < to).count()
}

/// The Rate Limit Quota Service's bound across every Envoy and instance:
/// three real Envoys, two on one instance and one on another, both
/// instances on one Redis, one bucket of 300 per 10 s. Demand on the first
/// Envoy, then moved to the second, then split between the second and
/// the third, whose instance then stops (its stream cut). In every span of
/// 10 s the Envoys together admit at most 300 and one per Envoy; the
/// Envoy with the demand admits at least 90 % of the limit once the shares
/// have converged (25 s: a window and three of Envoy's 5 s reports); both
/// admit once split; the cut Envoy denies once its assignment has expired.
/// About 95 s of real time (the shares move at Envoy's reports).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_envoys_on_two_instances_share_one_bucket_within_its_bound() {
    let redis = RedisServer::start();
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(
        rules.path().join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: route\n    value: chat\n    rate_limit: { unit: second, unit_multiplier: 10, requests_per_unit: 300 }\n",
    )
    .unwrap();
    let instance = || {
        let mut cfg = default_rules_config(Some(redis.url()));
        cfg.rules.envoy_path = Some(rules.path().to_path_buf());
        cfg.rlqs.assignment_ttl_ms = 12_000;
        TestServer::start(cfg)
    };
    let (one, two) = (instance().await, instance().await);
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let (upstream, upstream_port) = common::python_upstream(dirs[0].path());
    let instances = [one.addr.port(), one.addr.port(), two.addr.port()];
    let envoys: Vec<(Process, u16)> =
        dirs.iter().zip(instances).map(|(dir, rlqs)| rlqs_envoy(dir.path(), rlqs, upstream_port)).collect();
    // Phases (s): demand on A; moved to B at 15; split between B and C at
    // 45; C's instance stops at 75.
    let schedules: [Vec<(f64, f64, f64)>; 3] =
        [vec![(0.0, 15.0, 50.0)], vec![(15.0, 45.0, 50.0), (45.0, 95.0, 25.0)], vec![(45.0, 95.0, 25.0)]];
    let (origin, drivers) = drive_each(&envoys, schedules, 95.0);
    tokio::time::sleep_until((origin + Duration::from_secs(75)).into()).await;
    let mut seen = Vec::new();
    for (name, server) in [("one", &one), ("two", &two)] {
        for figure in ["envoys", "reports_total", "unanswered_total", "assigned_per_second"] {
            let series = format!("ratelimitd_rlqs_{figure}{{domain=\"edge\"}} ");
            seen.push(format!("{name} {figure} {:?}", common::metric(server, &series).await));
        }
    }
    two.stop().await.unwrap();
    let sent = sent_by(drivers).await;
    let all: Vec<Sent> = sent.iter().flatten().copied().collect();
    let most = most_in_a_window(&all, 10.0);
    let per_envoy: Vec<[usize; 6]> = sent
        .iter()
        .map(|s| [0.0, 10.0, 40.0, 70.0, 75.0, 89.0].map(|from| admitted_between(s, from, from + 5.0)))
        .collect();
    let totals: Vec<(usize, usize)> =
        sent.iter().map(|s| (s.len(), s.iter().filter(|s| s.admitted).count())).collect();
    eprintln!(
        "most in 10 s: {most}; admitted per 5 s from 0, 10, 40, 70, 75, 89 s: {per_envoy:?}; sent, admitted: {totals:?}; at 75 s: {seen:?}"
    );
    assert!(most <= 303, "at most 300 and one per Envoy in any 10 s: {most}");
    // 90 % of the limit: 135 in 5 s, once converged.
    assert!(per_envoy[0][1] >= 135, "A with the demand, 10 s in: {per_envoy:?}");
    assert!(per_envoy[1][2] >= 135, "B, 25 s after the demand moved to it: {per_envoy:?}");
    assert!(per_envoy[1][3] > 0 && per_envoy[2][3] > 0, "split: both admit: {per_envoy:?}");
    // C's stream is cut at 75 s: its assignment (12 s) expires, then it
    // denies (DENY_ALL).
    assert_eq!(per_envoy[2][5], 0, "C denies once its assignment expired: {per_envoy:?}");
    drop((envoys, upstream));
    one.stop().await.unwrap();
}

/// A `global: true` bucket through real Envoys in two regions, each
/// region with its own instance and Redis, sharing the coordination store
/// (`common::two_regions`): one bucket of 300 per 10 s. Demand in region
/// a, then in both: in every span of 10 s the two Envoys together admit at
/// most 300 and one each, and once split both admit. About 45 s of real
/// time (the shares move at Envoy's reports).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn envoys_in_two_regions_share_a_global_bucket_within_its_bound() {
    let rules = tempfile::tempdir().unwrap();
    std::fs::write(
        rules.path().join("edge.yaml"),
        "domain: edge\ndescriptors:\n  - key: route\n    value: chat\n    rate_limit: { unit: second, unit_multiplier: 10, requests_per_unit: 300, global: true }\n",
    )
    .unwrap();
    let (servers, _stores) = common::two_regions(|cfg| {
        cfg.rules.envoy_path = Some(rules.path().to_path_buf());
        cfg.rlqs.assignment_ttl_ms = 12_000;
    })
    .await;
    let dirs: Vec<tempfile::TempDir> = (0..2).map(|_| tempfile::tempdir().unwrap()).collect();
    let (upstream, upstream_port) = common::python_upstream(dirs[0].path());
    let envoys: Vec<(Process, u16)> = dirs
        .iter()
        .zip(&servers)
        .map(|(dir, server)| rlqs_envoy(dir.path(), server.addr.port(), upstream_port))
        .collect();
    let schedules: [Vec<(f64, f64, f64)>; 2] = [vec![(0.0, 45.0, 50.0)], vec![(10.0, 45.0, 50.0)]];
    let (_, drivers) = drive_each(&envoys, schedules, 45.0);
    let sent = sent_by(drivers).await;
    let all: Vec<Sent> = sent.iter().flatten().copied().collect();
    let most = most_in_a_window(&all, 10.0);
    let per_envoy: Vec<[usize; 3]> =
        sent.iter().map(|s| [5.0, 35.0, 40.0].map(|from| admitted_between(s, from, from + 5.0))).collect();
    eprintln!("most in 10 s: {most}; admitted per 5 s from 5, 35, 40 s: {per_envoy:?}");
    assert!(most <= 302, "at most 300 and one per Envoy in any 10 s: {most}");
    assert!(per_envoy[0][0] >= 135, "a alone: {per_envoy:?}");
    assert!(per_envoy.iter().all(|p| p[1] > 0 && p[2] > 0), "split: both admit: {per_envoy:?}");
    drop((envoys, upstream));
    for server in servers {
        server.stop().await.unwrap();
    }
}
