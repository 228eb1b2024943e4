//! Global limits across regions, with real parts: each region its own
//! `redis-server` and two instances (engines deciding against it, each
//! with its global exchange), one coordination `redis-server` behind a
//! delay proxy per region (50 ms one way), and load per region that moves
//! on a schedule. Every admitted decision is counted with its time and
//! region, and the sums over every window-long span are checked against
//! the limit. Services started from configuration, and one real Envoy per
//! region in front of them, do the same for native rules and descriptors.

mod common;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use common::{DelayProxy, RedisServer, deployments, two_regions};
use ratelimitd::{
    clock::{Clock, MonotonicClock, SystemClock},
    decision::{CheckRequest, Engine, EngineParts},
    global::{GlobalExchange, Settings, status::GlobalStatus},
    limiter::{
        Algorithm, RedisStore, Store,
        exchange::{self, ExchangeCounts, Participant},
        grants::Grants,
        lease::Lease,
        settings::RedisConfig,
    },
    rules::{self, PathForm, RuleStore},
};
use tokio::task::JoinSet;

const REGIONS: [&str; 3] = ["a", "b", "c"];
/// Each region's floor: 2 % of the limit.
const FLOOR_PPM: u64 = 20_000;
const INTERVAL_MS: u64 = 200;

/// One instance: its engine, its global exchange's figures and task.
struct Instance {
    region: usize,
    engine: Arc<Engine>,
    status: Arc<GlobalStatus>,
    exchange: tokio::task::AbortHandle,
}

/// Three regions of two instances each, sharing the rules through one
/// coordination store `one_way` away (a delay proxy per region).
struct World {
    instances: Vec<Instance>,
    proxies: Vec<DelayProxy>,
    coordination: RedisServer,
    _regional: Vec<RedisServer>,
    stop: tokio::sync::watch::Sender<bool>,
    exchanges: JoinSet<()>,
    _dispatchers: JoinSet<()>,
}

fn store_config(url: String) -> RedisConfig {
    RedisConfig {
        connection: ratelimitd::config::Connection { url: Some(url), ..Default::default() },
        timeout_ms: 1_000,
        connect_timeout_ms: 1_000,
        ..RedisConfig::default()
    }
}

impl World {
    async fn start(rules_yaml: &str, one_way: Duration) -> World {
        let snapshot =
            rules::from_text(std::path::Path::new("global.yaml"), rules_yaml, PathForm::default()).unwrap();
        let rules = Arc::new(RuleStore::new(snapshot));
        let coordination = RedisServer::start();
        let target = format!("127.0.0.1:{}", coordination.port).parse().unwrap();
        let mut dispatchers = JoinSet::new();
        let (mut instances, mut proxies, mut regional) = (Vec::new(), Vec::new(), Vec::new());
        let (stop, _) = tokio::sync::watch::channel(false);
        let mut exchanges = JoinSet::new();
        for (region, name) in REGIONS.iter().enumerate() {
            let redis = RedisServer::start();
            let proxy = DelayProxy::start(target, one_way).await;
            for n in 0..2 {
                let store = Arc::new(RedisStore::new(&store_config(redis.url()), &mut dispatchers).unwrap());
                store.warm_up(Duration::from_secs(5)).await.unwrap();
                let coordination_store = Arc::new(
                    RedisStore::new(&store_config(format!("redis://{}", proxy.addr)), &mut dispatchers)
                        .unwrap(),
                );
                let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::default());
                let grants = Arc::new(Grants::new(FLOOR_PPM, 1_000, Arc::clone(&clock)));
                let lease = Lease { lease_ms: LEASE_MS, skew_ms: SKEW_MS };
                let status = Arc::new(GlobalStatus::new(name, lease.lease_ms, clock));
                let settings = Settings {
                    region,
                    floors_ppm: vec![FLOOR_PPM; REGIONS.len()],
                    interval_ms: INTERVAL_MS,
                    lease,
                    timeout: Duration::from_millis(600),
                    regional_timeout: Duration::from_millis(500),
                    max_keys: 1_000,
                    envoy_algorithm: Algorithm::SlidingWindow,
                    instance: format!("{name}-{n}"),
                };
                let exchange: Box<dyn Participant> = Box::new(GlobalExchange::new(
                    Arc::clone(&grants),
                    (Arc::clone(&rules), None),
                    Store::Redis(Arc::clone(&store)),
                    coordination_store,
                    settings,
                    Arc::clone(&status),
                ));
                let engine = Arc::new(Engine::new(EngineParts {
                    grants: Some(grants),
                    ..EngineParts::new(Arc::clone(&rules), Store::Redis(store))
                }));
                let exchange = vec![exchange];
                let counts = Arc::new(ExchangeCounts::of(&exchange));
                let exchange =
                    exchanges.spawn(exchange::run(exchange, counts, Arc::new(SystemClock), stop.subscribe()));
                instances.push(Instance { region, engine, status, exchange });
            }
            proxies.push(proxy);
            regional.push(redis);
        }
        World {
            instances,
            proxies,
            coordination,
            _regional: regional,
            stop,
            exchanges,
            _dispatchers: dispatchers,
        }
    }

    /// The grant total of `region`'s agent for the first global limit.
    fn granted(&self, region: usize) -> u64 {
        let agent = self.instances.iter().find(|i| i.region == region && i.status.is_agent());
        agent.and_then(|i| i.status.limits().first().map(|(_, s)| s.granted)).unwrap_or(0)
    }

    /// Samples every `every` for `span`: (ms of the wall clock, each region's agent's grant).
    async fn watch_grants(&self, span: Duration, every: Duration) -> Vec<(u64, [u64; 3])> {
        let mut samples = Vec::new();
        let end = tokio::time::Instant::now() + span;
        while tokio::time::Instant::now() < end {
            samples.push((wall_ms(), [self.granted(0), self.granted(1), self.granted(2)]));
            tokio::time::sleep(every).await;
        }
        samples
    }

    async fn shut(mut self) {
        let _ = self.stop.send(true);
        while self.exchanges.join_next().await.is_some() {}
    }
}

/// Admitted decisions: (ms of the wall clock, region).
type Log = Arc<Mutex<Vec<(u64, usize)>>>;

fn wall_ms() -> u64 {
    SystemClock.now_ms()
}

/// Load on every instance of the regions `demand` turns on (read before
/// each request): about one check of `path` per ms per instance, over
/// `keys` keys, until `stop`; every admission logged.
struct Load {
    demand: Arc<Mutex<[bool; 3]>>,
    log: Log,
    stop: Arc<AtomicBool>,
    tasks: JoinSet<()>,
}

impl Load {
    fn start(world: &World, path: &'static str, keys: usize, demand: [bool; 3]) -> Load {
        let demand = Arc::new(Mutex::new(demand));
        let (log, stop): (Log, _) = (Arc::default(), Arc::new(AtomicBool::new(false)));
        let mut tasks = JoinSet::new();
        for instance in &world.instances {
            let (engine, region) = (Arc::clone(&instance.engine), instance.region);
            let (demand, log, stop) = (Arc::clone(&demand), Arc::clone(&log), Arc::clone(&stop));
            tasks.spawn(async move {
                let headers = HashMap::new();
                let mut n = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    if !demand.lock().unwrap()[region] {
                        continue;
                    }
                    n += 1;
                    let user = format!("tenant-{}", n % keys);
                    let request = CheckRequest::new(&user, path, &headers);
                    if engine.check(&request).await.allowed {
                        log.lock().unwrap().push((wall_ms(), region));
                    }
                }
            });
        }
        Load { demand, log, stop, tasks }
    }

    fn shift(&self, demand: [bool; 3]) -> u64 {
        *self.demand.lock().unwrap() = demand;
        wall_ms()
    }

    async fn finish(mut self) -> Vec<(u64, usize)> {
        self.stop.store(true, Ordering::Relaxed);
        while self.tasks.join_next().await.is_some() {}
        let mut log = self.log.lock().unwrap().clone();
        log.sort_unstable();
        log
    }
}

/// The largest sliding-window estimate one store enforcing the limit alone
/// would have computed after any admission of `log`, all regions
/// together: windows of `window_ms` aligned to the epoch (as the store
/// aligns them), `current + previous × (W − elapsed) / W`.
fn worst_estimate(log: &[(u64, usize)], window_ms: u64) -> (f64, u64) {
    let mut per_window: HashMap<u64, u64> = HashMap::new();
    let mut worst = (0.0, 0);
    for (t, _) in log {
        let index = t / window_ms;
        *per_window.entry(index).or_default() += 1;
        let current = per_window[&index] as f64;
        let previous = per_window.get(&(index.wrapping_sub(1))).copied().unwrap_or(0) as f64;
        let elapsed = (t % window_ms) as f64;
        let estimate = current + previous * (window_ms as f64 - elapsed) / window_ms as f64;
        if estimate > worst.0 {
            worst = (estimate, *t);
        }
    }
    worst
}

fn admitted_in(log: &[(u64, usize)], region: usize, from: u64, to: u64) -> u64 {
    log.iter().filter(|(t, r)| *r == region && (from..to).contains(t)).count() as u64
}

fn trace(log: &[(u64, usize)], statuses: &[Arc<GlobalStatus>]) {
    if std::env::var("GLOBAL_TRACE").is_err() {
        return;
    }
    let start = log.first().map_or(0, |(t, _)| t / 100 * 100);
    let end = log.last().map_or(0, |(t, _)| *t);
    for b in (start..=end).step_by(100) {
        let per: Vec<u64> = (0..3).map(|r| admitted_in(log, r, b, b + 100)).collect();
        eprintln!("{:>6} ms {per:?}", b - start);
    }
    for s in statuses {
        eprintln!("{} agent={} {:?}", s.region(), s.is_agent(), s.limits());
    }
}

/// One key under a sliding window of 300 per second, all demand in region
/// a, then in b: after every admission, the estimate one store enforcing
/// the limit alone would compute for all regions together stays within
/// the limit (plus one per region for the rounding of grants), and once
/// the first region's admissions have left the window (two windows at
/// most) and three intervals have passed, the region with the demand
/// admits at least 90 % of the limit in a window.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_regions_share_one_limit_and_it_follows_demand() {
    const RULES: &str = "rules:\n  - { rule_id: shared, resource_path: /shared, limit: 300, window_seconds: 1, global: true }\n";
    let world = World::start(RULES, Duration::from_millis(50)).await;
    let load = Load::start(&world, "/shared", 1, [true, false, false]);
    let started = wall_ms();
    let watched: Vec<Arc<GlobalStatus>> = world.instances.iter().map(|i| Arc::clone(&i.status)).collect();
    let watcher = tokio::spawn(async move {
        if std::env::var("GLOBAL_TRACE").is_err() {
            return;
        }
        for _ in 0..80 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let line: Vec<String> = watched
                .iter()
                .map(|s| format!("{}", s.limits().first().map_or(0, |(_, l)| l.granted)))
                .collect();
            eprintln!("grants {:>6} {}", wall_ms() - started, line.join(" "));
        }
    });
    tokio::time::sleep(Duration::from_millis(5_000)).await;
    let shifted = load.shift([false, true, false]);
    tokio::time::sleep(Duration::from_millis(5_000)).await;
    let log = load.finish().await;
    watcher.abort();
    let statuses: Vec<Arc<GlobalStatus>> = world.instances.iter().map(|i| Arc::clone(&i.status)).collect();
    trace(&log, &statuses);
    let (worst, at) = worst_estimate(&log, 1_000);
    assert!(worst <= 300.0 + 3.0, "an estimate of {worst:.1} at {} ms", at - started);
    // The first whole window (aligned, as the store counts) that starts
    // two windows (while the old region's admissions weigh in) and three
    // intervals after the start, and after the shift.
    let window = |from: u64| (from + 2_000 + 3 * INTERVAL_MS).div_ceil(1_000) * 1_000;
    let (a_from, b_from) = (window(started), window(shifted));
    assert!(b_from + 1_000 <= shifted + 5_000);
    let a = admitted_in(&log, 0, a_from, a_from + 1_000);
    let b = admitted_in(&log, 1, b_from, b_from + 1_000);
    assert!(a >= 270, "region a admitted {a} of 300 in a window");
    assert!(b >= 270, "region b admitted {b} of 300 in a window");
    let agents: Vec<&str> = statuses.iter().filter(|s| s.is_agent()).map(|s| s.region()).collect();
    assert_eq!(agents, REGIONS, "one agent per region");
    world.shut().await;
}

const SPLIT_RULES: &str =
    "rules:\n  - { rule_id: shared, resource_path: /shared, limit: 300, window_seconds: 1, global: true }\n";
/// The lease the worlds run with, and its margin.
const LEASE_MS: u64 = 1_500;
const SKEW_MS: u64 = 100;
/// What an exchange's store calls may take beyond its start, six
/// instances sharing 2 cores.
const EXCHANGE_MS: u64 = 100;

/// The coordination store hangs (SIGSTOP) for three leases' worth of time:
/// each region keeps its grant while its lease runs, then enforces its
/// floor (2 % of the limit); when the store answers again, the grants
/// follow demand within a few intervals. The bound holds throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn while_the_coordination_store_is_away_regions_keep_their_grants_for_a_lease_then_their_floors() {
    let world = World::start(SPLIT_RULES, Duration::from_millis(50)).await;
    let load = Load::start(&world, "/shared", 1, [true, true, false]);
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    let before = [world.granted(0), world.granted(1)];
    assert!(before.iter().all(|g| *g >= 100), "split between a and b: {before:?}");
    world.coordination.pause();
    let paused = wall_ms();
    let away = world.watch_grants(Duration::from_millis(4_500), Duration::from_millis(50)).await;
    world.coordination.resume();
    let resumed = wall_ms();
    let back = world.watch_grants(Duration::from_millis(4_500), Duration::from_millis(50)).await;
    let log = load.finish().await;
    let statuses: Vec<Arc<GlobalStatus>> = world.instances.iter().map(|i| Arc::clone(&i.status)).collect();
    trace(&log, &statuses);
    if std::env::var("GLOBAL_TRACE").is_ok() {
        for (t, g) in away.iter().chain(&back) {
            eprintln!("grants {} {g:?}", t - paused);
        }
        eprintln!("paused {paused} resumed {}", resumed - paused);
    }
    let (worst, at) = worst_estimate(&log, 1_000);
    assert!(worst <= 303.0, "an estimate of {worst:.1} at {at}");
    for (t, grants) in &away {
        if *t < paused + LEASE_MS - 2 * INTERVAL_MS {
            assert!(
                grants[0] >= before[0].min(grants[0]) && grants[0] > 6,
                "a kept its grant at {}: {grants:?}",
                t - paused
            );
        }
        if *t > paused + LEASE_MS + 2 * INTERVAL_MS {
            assert_eq!(grants[..2], [0, 0], "on their floors at {} ms", t - paused);
        }
    }
    // On its floor, once what it admitted has decayed (two windows at
    // most), a region admits its floor: 6 a second.
    let on_floor = paused + LEASE_MS + 2_000;
    assert!(on_floor + 1_000 <= resumed);
    let a = admitted_in(&log, 0, on_floor, on_floor + 1_000);
    assert!(a <= 6 + 1, "region a admitted {a} on its floor");
    let expired = world.instances.iter().filter(|i| i.region == 0).map(|i| i.status.expired()).sum::<u64>();
    assert!(expired >= 1, "region a's lease running out is counted");
    // Grants come back within a few intervals (a report in flight may
    // first run into its 600 ms timeout); the first region back may take
    // all it wants, and the other gets its share once what the first
    // admitted has left its window (two windows at most).
    let first = back.iter().find(|(_, g)| g[0] >= 100 || g[1] >= 100).map(|(t, _)| t - resumed);
    assert!(first.is_some_and(|ms| ms <= 10 * INTERVAL_MS), "grants back after {first:?} ms");
    let both = back.iter().find(|(_, g)| g[0] >= 100 && g[1] >= 100).map(|(t, _)| t - resumed);
    assert!(both.is_some_and(|ms| ms <= 2_000 + 10 * INTERVAL_MS), "both back after {both:?} ms");
    world.shut().await;
}

/// Region a's path to the coordination store is cut: b never takes a's
/// capacity before a's lease (and the margin) has run out, then does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_region_cut_off_keeps_its_capacity_until_its_lease_runs_out() {
    let world = World::start(SPLIT_RULES, Duration::from_millis(50)).await;
    let load = Load::start(&world, "/shared", 1, [true, true, false]);
    tokio::time::sleep(Duration::from_millis(3_000)).await;
    world.proxies[0].cut();
    let cut = wall_ms();
    let a_held = world.granted(0);
    // a's lease and margin, what it admitted lingering (two windows), and
    // three intervals.
    let samples = world.watch_grants(Duration::from_millis(4_800), Duration::from_millis(50)).await;
    let log = load.finish().await;
    let (worst, at) = worst_estimate(&log, 1_000);
    assert!(worst <= 303.0, "an estimate of {worst:.1} at {at}");
    // a's lease began before the cut, so it ends before cut + lease.
    for (t, grants) in &samples {
        if *t < cut + LEASE_MS {
            assert!(
                grants[1] + a_held + 6 <= 300,
                "b took {} beside a's {a_held} at {} ms",
                grants[1],
                t - cut
            );
        }
    }
    let last = samples.last().unwrap().1;
    assert_eq!(last[1], 288, "b has all but the others' floors once a's lease ran out: {last:?}");
    world.proxies[0].restore();
    world.shut().await;
}

/// The agent of region a stops: the other instance of a takes the role
/// within one lease, and the region's grant follows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_a_regions_agent_dies_another_instance_takes_the_role_within_a_lease() {
    let world = World::start(SPLIT_RULES, Duration::from_millis(50)).await;
    let load = Load::start(&world, "/shared", 1, [true, false, false]);
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let agent = world.instances.iter().position(|i| i.region == 0 && i.status.is_agent()).unwrap();
    world.instances[agent].exchange.abort();
    world.instances[agent].status.set_agent(false);
    let killed = wall_ms();
    let other = world
        .instances
        .iter()
        .position(|i| i.region == 0 && !std::ptr::eq(i, &world.instances[agent]))
        .unwrap();
    let mut took = None;
    while wall_ms() < killed + 2 * LEASE_MS {
        if world.instances[other].status.is_agent() {
            took = Some(wall_ms() - killed);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The lease runs out at most a lease after the kill; the other takes
    // the role at its next exchange, an interval later at most, once that
    // exchange's store calls are back (and this loop looks every 20 ms).
    let within = LEASE_MS + INTERVAL_MS + EXCHANGE_MS;
    assert!(took.is_some_and(|ms| ms <= within), "took the role after {took:?} ms (within {within})");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(world.granted(0) >= 270, "the new agent holds the region's grant: {}", world.granted(0));
    let log = load.finish().await;
    let (worst, at) = worst_estimate(&log, 1_000);
    assert!(worst <= 303.0, "an estimate of {worst:.1} at {at}");
    world.shut().await;
}

/// Two deployments claim region a (the second, refused at the
/// coordination store, would otherwise enforce a's floor on its own keys
/// beside the first's grants): once refused, it
/// enforces zero, says so (`ratelimitd_global_last_answer{answer="claimed"}`),
/// and the admissions of every deployment together stay within the limit
/// and one per region of rounding over any window.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_region_claimed_by_two_deployments_stays_within_the_limit() {
    use common::{Rules, check, request};
    let rules = Rules::new(
        "rules:\n  - { rule_id: shared, resource_path: /shared, limit: 300, window_seconds: 2, global: true }\n",
    );
    // Region a's service, b's, and a second deployment that also calls itself a.
    let (servers, _stores) =
        deployments(&["a", "b", "a"], |config| config.rules.path = Some(rules.path())).await;
    let log: Log = Arc::default();
    let running = Arc::new(AtomicBool::new(true));
    // Decisions asked from this wall-clock ms on are logged (0: none yet).
    let measuring = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut load = JoinSet::new();
    let answered = |region: &str, answer: &str| {
        format!("ratelimitd_global_last_answer{{limit=\"shared\",region=\"{region}\",answer=\"{answer}\"}}")
    };
    for (deployment, server) in servers.iter().enumerate() {
        if deployment == 2 {
            // The first a holds the region before the second comes.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while common::metric(&servers[0], &answered("a", "ok")).await != Some(1.0) {
                assert!(tokio::time::Instant::now() < deadline, "the first a never reported");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        let mut client = server.client().await;
        let (log, running, measuring) = (Arc::clone(&log), Arc::clone(&running), Arc::clone(&measuring));
        load.spawn(async move {
            while running.load(Ordering::Relaxed) {
                let asked = wall_ms();
                let allowed = check(&mut client, request("tenant", "/shared")).await.allowed;
                let from = measuring.load(Ordering::Relaxed);
                if allowed && from != 0 && asked >= from {
                    log.lock().unwrap().push((wall_ms(), deployment));
                }
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        });
    }
    // The second a reports its demand, is refused, and enforces zero.
    let claimed = answered("a", "claimed");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while common::metric(&servers[2], &claimed).await != Some(1.0) {
        assert!(tokio::time::Instant::now() < deadline, "the second deployment of a was never refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    measuring.store(wall_ms(), Ordering::Relaxed);
    tokio::time::sleep(Duration::from_secs(5)).await;
    running.store(false, Ordering::Relaxed);
    while load.join_next().await.is_some() {}
    let log = log.lock().unwrap().clone();
    let (worst, at) = worst_estimate(&log, 2_000);
    let by_second_a = log.iter().filter(|(_, d)| *d == 2).count();
    assert_eq!(by_second_a, 0, "the refused deployment admitted {by_second_a} in 5 s");
    assert!(worst <= 302.0, "{worst:.1} admitted over a window ending at {at}");
    assert!(log.len() >= 150, "{} admitted in 5 s: the first a and b share the limit", log.len());
    let held = common::metric(&servers[0], &answered("a", "ok")).await;
    assert_eq!(held, Some(1.0), "the first a holds the region");
    for server in servers {
        server.stop().await.unwrap();
    }
}

/// The same through Envoy's API: a second deployment calling itself region
/// a, refused at the coordination store for a descriptor marked global,
/// answers its `ShouldRateLimit`s OVER_LIMIT (a limit of zero) while the
/// first a still admits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_claimed_region_denies_a_global_descriptor_through_envoys_api() {
    use ratelimitd::api::envoy_pb::rls::{
        rate_limit_response::Code, rate_limit_service_client::RateLimitServiceClient,
    };
    let envoy = common::Rules::new(
        "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit: { unit: second, unit_multiplier: 2, requests_per_unit: 200, global: true }\n",
    );
    let (servers, _stores) =
        deployments(&["a", "b", "a"], |config| config.rules.envoy_path = Some(envoy.path())).await;
    let request = common::rls_request("edge", "tenant", "acme");
    let answered = |answer: &str| {
        format!("ratelimitd_global_last_answer{{limit=\"edge.tenant\",region=\"a\",answer=\"{answer}\"}}")
    };
    let mut first = RateLimitServiceClient::connect(format!("http://{}", servers[0].addr)).await.unwrap();
    let mut second = RateLimitServiceClient::connect(format!("http://{}", servers[2].addr)).await.unwrap();
    // The first a holds the region before the second comes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while common::metric(&servers[0], &answered("ok")).await != Some(1.0) {
        assert!(tokio::time::Instant::now() < deadline, "the first a never reported");
        first.should_rate_limit(request.clone()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Demand at both deployments of a until the second is refused.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while common::metric(&servers[2], &answered("claimed")).await != Some(1.0) {
        assert!(tokio::time::Instant::now() < deadline, "the second deployment of a was never refused");
        first.should_rate_limit(request.clone()).await.unwrap();
        second.should_rate_limit(request.clone()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let code = |answer: tonic::Response<ratelimitd::api::envoy_pb::rls::RateLimitResponse>| {
        answer.into_inner().overall_code
    };
    let mut denied = 0;
    for _ in 0..50 {
        denied += usize::from(
            code(second.should_rate_limit(request.clone()).await.unwrap()) == Code::OverLimit as i32,
        );
    }
    assert_eq!(denied, 50, "the refused deployment of a admitted {} of 50", 50 - denied);
    // The first a admits: at once within its floor (10 per 2 s, which the
    // demand above may have spent), else at its grant once the next
    // exchange brings one.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while code(first.should_rate_limit(request.clone()).await.unwrap()) != Code::Ok as i32 {
        assert!(tokio::time::Instant::now() < deadline, "the first a admitted nothing for 5 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for server in servers {
        server.stop().await.unwrap();
    }
}

/// The services' global figures for `limit` in region a: its grant, the
/// agent flags of both regions, the reports answered, the last answer and
/// the leases run out.
async fn figures_of_a(servers: &[common::TestServer], limit: &str) -> Vec<Option<f64>> {
    use common::metric;
    let series = [
        format!("ratelimitd_global_grant{{limit=\"{limit}\",region=\"a\"}}"),
        "ratelimitd_global_agent{region=\"a\"}".to_owned(),
        format!("ratelimitd_global_last_answer{{limit=\"{limit}\",region=\"a\",answer=\"ok\"}}"),
        "ratelimitd_global_lease_expired_total{region=\"a\"}".to_owned(),
    ];
    let mut out = Vec::new();
    for s in &series {
        out.push(metric(&servers[0], s).await);
    }
    out.push(metric(&servers[1], "ratelimitd_global_agent{region=\"b\"}").await);
    out
}

/// Region a, with all the demand for `limit` (a window of 2 s, 200 in all),
/// holds all but b's floor (10) and admitted (`admitted`) no more; both
/// regions have their agent, the allocator answered, no lease ran out.
/// Stops the services.
async fn held_all_but_bs_floor(servers: Vec<common::TestServer>, limit: &str, admitted: &[(u64, usize)]) {
    let figures = figures_of_a(&servers, limit).await;
    let expected = [Some(190.0), Some(1.0), Some(1.0), Some(0.0), Some(1.0)];
    assert_eq!(figures, expected, "grant, agents, answer, expired");
    let (worst, _) = worst_estimate(admitted, 2_000);
    assert!(worst <= 190.0 + 1.0, "{worst}");
    assert!(admitted.len() >= 190, "{} admitted in 4 s", admitted.len());
    for server in servers {
        server.stop().await.unwrap();
    }
}

/// Native rules: a rule with `global: true` shared by two services in two
/// regions: the region with the demand is granted all but the other's
/// floor (5 % of 200), admits at most that, and `/metrics` shows the
/// grant, the agents and the allocator's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn services_configured_for_two_regions_share_a_global_rule() {
    use common::{Rules, check, request};
    let rules = Rules::new(
        "rules:\n  - { rule_id: shared, resource_path: /shared, limit: 200, window_seconds: 2, global: true }\n",
    );
    let (servers, _stores) = two_regions(|config| config.rules.path = Some(rules.path())).await;
    let mut client = servers[0].client().await;
    let mut admitted = Vec::new();
    let started = wall_ms();
    while wall_ms() < started + 4_000 {
        if check(&mut client, request("tenant", "/shared")).await.allowed {
            admitted.push((wall_ms(), 0));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // Its denials went to the store (a cached one would outlive a grant).
    let cached = common::metric(&servers[0], "ratelimitd_denial_cache_hits_total").await;
    assert_eq!(cached, Some(0.0), "no denial of a global rule from the cache");
    held_all_but_bs_floor(servers, "shared", &admitted).await;
}

/// Envoy's descriptors: a `rate_limit` with `global: true` shared by two
/// services in two regions, decided through `ShouldRateLimit`, the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn services_configured_for_two_regions_share_a_global_descriptor() {
    use common::Rules;
    use ratelimitd::api::envoy_pb::rls::{
        rate_limit_response::Code, rate_limit_service_client::RateLimitServiceClient,
    };
    let envoy = Rules::new(
        "domain: edge\ndescriptors:\n  - key: tenant\n    rate_limit: { unit: second, unit_multiplier: 2, requests_per_unit: 200, global: true }\n",
    );
    let (servers, _stores) = two_regions(|config| config.rules.envoy_path = Some(envoy.path())).await;
    let mut client = RateLimitServiceClient::connect(format!("http://{}", servers[0].addr)).await.unwrap();
    let request = common::rls_request("edge", "tenant", "acme");
    let mut admitted = Vec::new();
    let started = wall_ms();
    while wall_ms() < started + 4_000 {
        let answer = client.should_rate_limit(request.clone()).await.unwrap().into_inner();
        if answer.overall_code == Code::Ok as i32 {
            admitted.push((wall_ms(), 0));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    held_all_but_bs_floor(servers, "edge.tenant", &admitted).await;
}

/// Through real Envoy, one per region, each in front of its region's
/// service: a descriptor limit marked global (100 per 2 s) holds for the
/// requests of both Envoys together while demand moves from a to b, and
/// each Envoy answers 200 or 429, nothing else (its filter fails open, so
/// an error would have been a 200 the bound would count).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn through_one_envoy_per_region_a_global_descriptor_holds_across_both() {
    use common::{Process, Rules, example_envoy, http_get_raw, python_upstream};
    let envoy_rules = Rules::new(
        "domain: edge\ndescriptors:\n  - key: user\n    rate_limit: { unit: second, unit_multiplier: 2, requests_per_unit: 100, global: true }\n",
    );
    let (servers, _stores) = two_regions(|config| config.rules.envoy_path = Some(envoy_rules.path())).await;
    let dir = tempfile::tempdir().unwrap();
    let (_upstream, upstream_port): (Process, u16) = python_upstream(dir.path());
    let mut envoys = Vec::new();
    for (region, server) in servers.iter().enumerate() {
        let envoy_dir = dir.path().join(REGIONS[region]);
        std::fs::create_dir(&envoy_dir).unwrap();
        envoys.push(example_envoy(&envoy_dir, server.addr.port(), upstream_port));
    }
    let ports: Vec<u16> = envoys.iter().map(|(_, port)| *port).collect();
    // Demand in a for 3 s, then in b for 3 s, one request at a time.
    let load = tokio::task::spawn_blocking(move || {
        let (mut admitted, mut refused) = (Vec::new(), [0u32; 2]);
        let started = wall_ms();
        while wall_ms() < started + 6_000 {
            let region = usize::from(wall_ms() >= started + 3_000);
            let reply = http_get_raw(ports[region], "/", &[("x-user-id", b"acme")]);
            match reply.status {
                200 => admitted.push((wall_ms(), region)),
                429 => refused[region] += 1,
                other => panic!("region {region}: Envoy answered {other}"),
            }
        }
        (admitted, refused, started)
    });
    let (admitted, refused, started) = load.await.unwrap();
    let (worst, at) = worst_estimate(&admitted, 2_000);
    assert!(worst <= 100.0 + 2.0, "one store would have estimated {worst:.1} at {at}");
    let (in_a, in_b) = (admitted_in(&admitted, 0, 0, u64::MAX), admitted_in(&admitted, 1, 0, u64::MAX));
    eprintln!("admitted a {in_a}, b {in_b}; refused {refused:?}; largest one-store estimate {worst:.1}");
    assert!(in_a >= 90, "a, with all the demand, holds all but b's floor: {in_a}");
    assert!(in_b >= 30, "capacity moved to b as a's counter emptied: {in_b}");
    assert!(refused.iter().all(|r| *r > 0), "both refused past their grants: {refused:?}");
    let late_in_b = admitted_in(&admitted, 1, started + 4_500, u64::MAX);
    assert!(late_in_b > 5, "b holds more than its floor (5) by the end: {late_in_b} in the last 1.5 s");
    drop(envoys);
    for server in servers {
        server.stop().await.unwrap();
    }
}

/// A rule both global and adaptive: one adaptive limit for every region
/// (its state in the coordination store, exchanged by every instance),
/// moved by the outcomes reported in any region; each region's grant is a
/// share of it. Region a, with all the traffic, reports failures: the
/// limit in force falls alike in a and in b (which reported nothing), and
/// a's grant falls below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_global_adaptive_rule_adapts_one_limit_for_every_region() {
    use common::{Rules, check, metric, request};
    use ratelimitd::api::pb;
    let rules = Rules::new(
        "rules:\n  - { rule_id: shared, resource_path: /shared, limit: 200, window_seconds: 2, global: true, adaptive: { min: 20, max: 400, decrease: 0.5, interval_ms: 200 } }\n",
    );
    let (servers, _stores) = two_regions(|config| config.rules.path = Some(rules.path())).await;
    let mut client = servers[0].client().await;
    let limit = "ratelimitd_adaptive_limit{kind=\"native\",rule=\"shared\"}";
    let started = wall_ms();
    while wall_ms() < started + 2_500 {
        if check(&mut client, request("tenant", "/shared")).await.allowed {
            let failed =
                pb::RateLimitRequest { outcome: pb::Outcome::Failure as i32, ..request("tenant", "/shared") };
            client.report(failed).await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // The last step reaches every instance within an interval.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (in_a, in_b) = (metric(&servers[0], limit).await.unwrap(), metric(&servers[1], limit).await.unwrap());
    eprintln!("limit in force: a {in_a}, b {in_b}");
    assert!(in_a < 100.0, "failures halved the limit of 200: {in_a}");
    assert_eq!(in_a, in_b, "one limit for both regions");
    let grant = metric(&servers[0], "ratelimitd_global_grant{limit=\"shared\",region=\"a\"}").await.unwrap();
    assert!(grant <= in_a, "a's grant ({grant}) is a share of the limit in force ({in_a})");
    let shared = "ratelimitd_store_exchanges_total{exchange=\"global_adaptive\",result=\"ok\"}";
    assert!(metric(&servers[1], shared).await.unwrap() > 0.0, "b exchanged it with the coordination store");
    for server in servers {
        server.stop().await.unwrap();
    }
}
