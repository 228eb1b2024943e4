//! `regions`: the three-region harness for global limits
//! (docs/global-limits.md). It starts three regional `redis-server`s, a
//! coordination `redis-server` behind one delay proxy per region (50 ms
//! each way by default), and two `ratelimitd serve` instances per region;
//! offers open-loop `Check` load per region on a schedule; counts every
//! admitted decision with its time, region and key; and scrapes each
//! instance's grants and agent role every 500 ms. Every process it starts
//! is stopped by PID when it ends.
//!
//! Scenarios (`--scenario`, repeatable; each in a world of its own):
//! - `shift`: all demand in a, then in b, then split 60/30/10 (after a
//!   little demand everywhere for a lease);
//! - `one-store`: the same schedule with every instance on one store and a
//!   plain rule: what one store enforcing the limit alone admits;
//! - `whole`, `third`: the same schedule without global limits, each region
//!   given the whole limit, or a third of it (the two setups operators have
//!   without this feature);
//! - `store-stop`: demand split, the coordination store frozen (SIGSTOP)
//!   for `--outage-s` in the middle;
//! - `region-cut`: demand split, region a's path to the coordination store
//!   cut for `--outage-s`;
//! - `agent-kill`: demand in a, its agent killed (SIGKILL) mid-run;
//! - `clock-skew`: demand split, one instance's wall clock 5 s ahead
//!   (`faketime`; its monotonic clock untouched).
//!
//! For each it prints and writes (`--out`) the most admitted over any span
//! of one window (all regions, per key, spans every 100 ms), the largest
//! one-store sliding-window estimate, what the demand region admitted in the
//! first full window starting three intervals after each shift, and the
//! timelines.

#![forbid(unsafe_code)]
#![allow(clippy::print_stdout)] // the report is the program's output

#[path = "../../../tests/common/delay.rs"]
#[allow(dead_code, unreachable_pub)]
mod delay;

use std::{
    collections::HashMap,
    fmt::Write as _,
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use anyhow::{Context as _, bail};
use clap::Parser;
use ratelimitd::api::pb::{self, rate_limiter_client::RateLimiterClient};

use crate::delay::DelayProxy;

const REGIONS: [&str; 3] = ["a", "b", "c"];

/// The three-region harness for global limits.
#[derive(Debug, Parser)]
#[command(name = "regions")]
struct Args {
    /// The `ratelimitd` binary.
    #[arg(long, default_value = "target/release/ratelimitd")]
    ratelimitd: PathBuf,
    /// Where the reports and the instances' logs go.
    #[arg(long, default_value = "regions-out")]
    out: PathBuf,
    /// Scenarios to run, in order (see the module's doc); default: all.
    #[arg(long)]
    scenario: Vec<String>,
    /// One-way latency to the coordination store (ms).
    #[arg(long, default_value_t = 50)]
    one_way_ms: u64,
    /// The global limit per key and window.
    #[arg(long, default_value_t = 1_000)]
    limit: u64,
    /// The window (s).
    #[arg(long, default_value_t = 10)]
    window_s: u64,
    /// `sliding_window`, `fixed_window`, `token_bucket` or `gcra`.
    #[arg(long, default_value = "sliding_window")]
    algorithm: String,
    /// Active keys (the load is uniform over them).
    #[arg(long, default_value_t = 1)]
    keys: u64,
    /// Demand of a region with all the demand, as a multiple of the limit's rate.
    #[arg(long, default_value_t = 3.0)]
    demand: f64,
    /// `global.interval_ms`.
    #[arg(long, default_value_t = 1_000)]
    interval_ms: u64,
    /// `global.lease_ms`.
    #[arg(long, default_value_t = 5_000)]
    lease_ms: u64,
    /// Each region's floor (share of the limit).
    #[arg(long, default_value_t = 0.02)]
    floor: f64,
    /// Length of each phase (s).
    #[arg(long, default_value_t = 30)]
    phase_s: u64,
    /// How long the store is frozen or the region cut (s).
    #[arg(long, default_value_t = 30)]
    outage_s: u64,
}

/// A process started by the harness, killed by PID when dropped.
#[derive(Debug)]
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn signal(&self, signal: &str) -> anyhow::Result<()> {
        let status = Command::new("kill").args([signal, &self.0.id().to_string()]).status()?;
        if !status.success() {
            bail!("kill {signal} {}", self.0.id());
        }
        Ok(())
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn wait_port(port: u16) -> anyhow::Result<()> {
    for _ in 0..300 {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    bail!("nothing listens on {port}")
}

fn redis(port: u16) -> anyhow::Result<Proc> {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn()
        .context("redis-server")?;
    wait_port(port)?;
    Ok(Proc(child))
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// One instance: its process, ports and region.
#[derive(Debug)]
struct Instance {
    proc: Option<Proc>,
    region: usize,
    grpc: u16,
    http: u16,
}

/// Three regions of two instances, a coordination store and its proxies.
#[derive(Debug)]
struct World {
    instances: Vec<Instance>,
    proxies: Vec<DelayProxy>,
    coordination: Proc,
    coordination_port: u16,
    _regional: Vec<Proc>,
}

/// How a scenario's rules and instances are set up.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Setup {
    /// One global limit.
    Global,
    /// Every instance on region a's store: the limit enforced by one store
    /// alone (the reference).
    OneStore,
    /// Each region the whole limit, on its own.
    Whole,
    /// Each region a third of it.
    Third,
}

impl World {
    async fn start(args: &Args, dir: &Path, setup: Setup, skewed: Option<usize>) -> anyhow::Result<World> {
        std::fs::create_dir_all(dir)?;
        let coordination_port = free_port()?;
        let coordination = redis(coordination_port)?;
        let target: SocketAddr = format!("127.0.0.1:{coordination_port}").parse()?;
        let limit = if setup == Setup::Third { args.limit / 3 } else { args.limit };
        let global = setup == Setup::Global;
        let rules = dir.join("rules.yaml");
        std::fs::write(
            &rules,
            format!(
                "rules:\n  - {{ rule_id: shared, resource_path: /shared, limit: {limit}, window_seconds: {}, algorithm: {}, global: {global} }}\n",
                args.window_s, args.algorithm
            ),
        )?;
        let (mut instances, mut proxies, mut regional) = (Vec::new(), Vec::new(), Vec::new());
        let mut first_store = 0;
        for (region, name) in REGIONS.iter().enumerate() {
            let redis_port = free_port()?;
            regional.push(redis(redis_port)?);
            if region == 0 {
                first_store = redis_port;
            }
            let proxy = DelayProxy::start(target, Duration::from_millis(args.one_way_ms)).await;
            for n in 0..2 {
                let (grpc, http) = (free_port()?, free_port()?);
                let state = dir.join(format!("{name}{n}"));
                std::fs::create_dir_all(&state)?;
                let store_port = if setup == Setup::OneStore { first_store } else { redis_port };
                let mut config = format!(
                    "grpc: {{ listen: \"127.0.0.1:{grpc}\" }}\nhttp: {{ listen: \"127.0.0.1:{http}\" }}\n\
                     redis: {{ url: \"redis://127.0.0.1:{store_port}\", timeout_ms: 100 }}\n\
                     rules: {{ path: \"{}\" }}\nshed: {{ mode: off }}\nlocal: {{ instances: 2 }}\n",
                    rules.display()
                );
                if global {
                    let regions: Vec<String> =
                        REGIONS.iter().map(|r| format!("{{ name: {r}, floor: {} }}", args.floor)).collect();
                    let _ = write!(
                        config,
                        "region: {name}\nglobal:\n  regions: [{}]\n  redis: {{ url: \"redis://{}\" }}\n  \
                         interval_ms: {}\n  lease_ms: {}\n",
                        regions.join(", "),
                        proxy.addr,
                        args.interval_ms,
                        args.lease_ms
                    );
                }
                let file = state.join("config.yaml");
                std::fs::write(&file, config)?;
                let log = std::fs::File::create(state.join("log.txt"))?;
                let mut command = if skewed == Some(instances.len()) {
                    let mut c = Command::new("faketime");
                    c.arg("-f").arg("+5s").arg(&args.ratelimitd).env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
                    c
                } else {
                    Command::new(&args.ratelimitd)
                };
                command
                    .args(["serve", "--config"])
                    .arg(&file)
                    .env("STATE_DIRECTORY", &state)
                    .stdout(log.try_clone()?)
                    .stderr(log);
                let child = command.spawn().context("ratelimitd")?;
                instances.push(Instance { proc: Some(Proc(child)), region, grpc, http });
            }
            proxies.push(proxy);
        }
        for i in &instances {
            wait_port(i.grpc)?;
        }
        Ok(World { instances, proxies, coordination, coordination_port, _regional: regional })
    }
}

/// `INFO stats` of the Redis on `port`: (calls, bytes in, bytes out).
fn redis_traffic(port: u16) -> Option<(u64, u64, u64)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(b"INFO stats\r\n").ok()?;
    let mut reply = vec![0u8; 64 * 1024];
    let n = stream.read(&mut reply).ok()?;
    let text = String::from_utf8_lossy(&reply[..n]);
    let field = |name: &str| sample(&text, &format!("{name}:"));
    let (calls, bytes_in, bytes_out) = (
        field("total_commands_processed")?,
        field("total_net_input_bytes")?,
        field("total_net_output_bytes")?,
    );
    Some((calls as u64, bytes_in as u64, bytes_out as u64))
}

/// A plain HTTP GET of `/metrics`.
fn scrape(port: u16) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut body = String::new();
    stream.read_to_string(&mut body).ok()?;
    Some(body)
}

fn sample(body: &str, prefix: &str) -> Option<f64> {
    body.lines().find_map(|l| l.strip_prefix(prefix)).and_then(|v| v.trim().parse().ok())
}

/// What the load saw: admissions (wall ms, region, key), offered per region.
#[derive(Debug, Default)]
struct Seen {
    admitted: Mutex<Vec<(u64, u8, u32)>>,
    offered: [AtomicU64; 3],
    failed: AtomicU64,
}

/// Open-loop load on every instance: region r's rate (`rates[r]`, per
/// second, split over its two instances), uniform over `keys`.
async fn load(
    world: &World,
    rates: Arc<[AtomicU64; 3]>,
    keys: u64,
    seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (n, instance) in world.instances.iter().enumerate() {
        let endpoint = format!("http://127.0.0.1:{}", instance.grpc);
        let Ok(client) = RateLimiterClient::connect(endpoint).await else { continue };
        let (rates, seen, stop, region) =
            (Arc::clone(&rates), Arc::clone(&seen), Arc::clone(&stop), instance.region);
        tasks.push(tokio::spawn(async move {
            let mut next = tokio::time::Instant::now();
            let mut i = n as u64;
            while !stop.load(Ordering::Relaxed) {
                let rate = rates[region].load(Ordering::Relaxed) as f64 / 2.0;
                if rate <= 0.0 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    next = tokio::time::Instant::now();
                    continue;
                }
                next += Duration::from_secs_f64(1.0 / rate);
                tokio::time::sleep_until(next).await;
                i = i.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let key = ((i >> 33) % keys) as u32;
                let (mut client, seen) = (client.clone(), Arc::clone(&seen));
                seen.offered[region].fetch_add(1, Ordering::Relaxed);
                tokio::spawn(async move {
                    let request = pb::RateLimitRequest {
                        user_id: format!("k{key}"),
                        resource_path: "/shared".into(),
                        ..Default::default()
                    };
                    match client.check(request).await {
                        Ok(answer) if answer.get_ref().allowed => {
                            seen.admitted.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push((
                                wall_ms(),
                                region as u8,
                                key,
                            ));
                        }
                        Ok(_) => {}
                        Err(_) => {
                            seen.failed.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        }));
    }
    tasks
}

/// The most admitted by all regions over any span of `window_ms` starting
/// every 100 ms, for the key that got the most; and the largest one-store
/// sliding-window estimate (windows aligned to the epoch) after any admission.
fn bound(log: &[(u64, u8, u32)], window_ms: u64) -> (u64, f64) {
    let mut by_key: HashMap<u32, Vec<u64>> = HashMap::new();
    for (t, _, key) in log {
        by_key.entry(*key).or_default().push(*t);
    }
    let (mut span_max, mut estimate_max) = (0u64, 0f64);
    for times in by_key.values_mut() {
        times.sort_unstable();
        let (first, last) = (times[0] / 100 * 100, *times.last().unwrap_or(&0));
        let mut start = first;
        while start <= last {
            let from = times.partition_point(|t| *t < start);
            let to = times.partition_point(|t| *t < start + window_ms);
            span_max = span_max.max((to - from) as u64);
            start += 100;
        }
        let mut per_window: HashMap<u64, u64> = HashMap::new();
        for t in times.iter() {
            let index = t / window_ms;
            *per_window.entry(index).or_default() += 1;
            let previous = per_window.get(&index.wrapping_sub(1)).copied().unwrap_or(0) as f64;
            let elapsed = (t % window_ms) as f64;
            let estimate =
                per_window[&index] as f64 + previous * (window_ms as f64 - elapsed) / window_ms as f64;
            estimate_max = estimate_max.max(estimate);
        }
    }
    (span_max, estimate_max)
}

/// Admitted by `region` in `[from, from + window_ms)`, per key.
fn admitted(log: &[(u64, u8, u32)], region: u8, from: u64, window_ms: u64, keys: u64) -> f64 {
    let n = log.iter().filter(|(t, r, _)| *r == region && (from..from + window_ms).contains(t)).count();
    n as f64 / keys as f64
}

/// One phase: its length and each region's demand (share of the demand).
type Phase = (u64, [f64; 3]);

/// Something done at a time into the run (s).
#[derive(Debug, Clone, Copy)]
enum Event {
    FreezeStore,
    ThawStore,
    CutA,
    RestoreA,
    KillAgentA,
}

/// A scenario: how it is set up, its phases and its events.
#[derive(Debug)]
struct Plan {
    setup: Setup,
    /// The instance whose wall clock runs 5 s ahead.
    skewed: Option<usize>,
    phases: Vec<Phase>,
    events: Vec<(u64, Event)>,
}

fn plan(args: &Args, name: &str) -> anyhow::Result<Plan> {
    let (p, split) = (args.phase_s, [0.6, 0.3, 0.1]);
    let warm = (args.lease_ms + 500).div_ceil(1_000) + 2;
    let around = |first: Event, second: Event| {
        (vec![(20 + args.outage_s + 20, split)], vec![(20, first), (20 + args.outage_s, second)])
    };
    let (phases, events) = match name {
        "shift" | "whole" | "third" | "one-store" => (
            // A little demand everywhere first: every region reports its
            // key, and the coordination store, new to the limit, has seen
            // a lease go by (it grows no grant before).
            vec![(warm, [0.05, 0.05, 0.05]), (p, [1.0, 0.0, 0.0]), (p, [0.0, 1.0, 0.0]), (p, split)],
            vec![],
        ),
        "store-stop" => around(Event::FreezeStore, Event::ThawStore),
        "region-cut" => around(Event::CutA, Event::RestoreA),
        "agent-kill" => (vec![(45, [1.0, 0.0, 0.0])], vec![(20, Event::KillAgentA)]),
        "clock-skew" => (vec![(40, split)], vec![]),
        other => bail!("unknown scenario {other:?}"),
    };
    let setup = match name {
        "whole" => Setup::Whole,
        "third" => Setup::Third,
        "one-store" => Setup::OneStore,
        _ => Setup::Global,
    };
    Ok(Plan { setup, skewed: (name == "clock-skew").then_some(0), phases, events })
}

/// What a run recorded beside the admissions.
#[derive(Debug, Default)]
struct Record {
    started: u64,
    /// When each phase began, and its shares.
    shifts: Vec<(u64, [f64; 3])>,
    timeline: String,
    /// When region a's agent was killed, and which instance it was.
    killed: Option<(u64, usize)>,
    /// How long until another instance of a held the role (ms).
    took_over: Option<u64>,
    ended: u64,
}

impl World {
    /// Does `event`; returns what it killed, if anything.
    fn apply(&mut self, event: Event) -> anyhow::Result<Option<(u64, usize)>> {
        match event {
            Event::FreezeStore => self.coordination.signal("-STOP")?,
            Event::ThawStore => self.coordination.signal("-CONT")?,
            Event::CutA => self.proxies[0].cut(),
            Event::RestoreA => self.proxies[0].restore(),
            Event::KillAgentA => {
                let agent = self.instances.iter().position(|i| {
                    i.region == 0
                        && scrape(i.http).and_then(|b| sample(&b, "ratelimitd_global_agent{region=\"a\"}"))
                            == Some(1.0)
                });
                if let Some(i) = agent {
                    self.instances[i].proc = None;
                    return Ok(Some((wall_ms(), i)));
                }
            }
        }
        Ok(None)
    }

    /// One line of the timeline: each instance's grant and agent flag; notes
    /// when another instance of a took the role after `record.killed`.
    fn observe(&self, t: u64, record: &mut Record) -> String {
        let mut line = format!("t {t}");
        for (n, i) in self.instances.iter().enumerate() {
            let body = i.proc.as_ref().and_then(|_| scrape(i.http)).unwrap_or_default();
            let region = REGIONS[i.region];
            let grant =
                sample(&body, &format!("ratelimitd_global_grant{{limit=\"shared\",region=\"{region}\"}}"));
            let agent = sample(&body, &format!("ratelimitd_global_agent{{region=\"{region}\"}}"));
            let _ = write!(line, " {region}:{}:{}", grant.unwrap_or(-1.0), agent.unwrap_or(-1.0));
            if let Some((at, dead)) = record.killed
                && record.took_over.is_none()
                && i.region == 0
                && agent == Some(1.0)
                && n != dead
            {
                record.took_over = Some(wall_ms() - at);
            }
        }
        line
    }
}

/// Runs `plan` on `world` under load `rates` (`full`: a region's rate with
/// all the demand), scraping every 500 ms.
async fn drive(world: &mut World, plan: &Plan, rates: &[AtomicU64; 3], full: f64) -> anyhow::Result<Record> {
    let mut record = Record { started: wall_ms(), ..Record::default() };
    let total: u64 = plan.phases.iter().map(|(s, _)| s).sum();
    let (mut phase_end, mut phases) = (0u64, plan.phases.iter());
    let mut events = plan.events.iter().peekable();
    while wall_ms() < record.started + total * 1_000 {
        let t = wall_ms() - record.started;
        if t >= phase_end * 1_000
            && let Some((len, shares)) = phases.next()
        {
            for (r, share) in shares.iter().enumerate() {
                rates[r].store((full * share) as u64, Ordering::Relaxed);
            }
            record.shifts.push((wall_ms(), *shares));
            phase_end += len;
        }
        while let Some((_, event)) = events.next_if(|(at, _)| t >= at * 1_000) {
            if let Some(killed) = world.apply(*event)? {
                record.killed = Some(killed);
            }
            let _ = writeln!(record.timeline, "event {t} {event:?}");
        }
        let line = world.observe(t, &mut record);
        let _ = writeln!(record.timeline, "{line}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    record.ended = wall_ms();
    Ok(record)
}

/// The scenario's summary.
fn report(args: &Args, name: &str, log: &[(u64, u8, u32)], record: &Record, seen: &Seen) -> String {
    let window_ms = args.window_s * 1_000;
    let (span_max, estimate_max) = bound(log, window_ms);
    let mut report = format!(
        "{name}: limit {} per {} s per key, {} keys, {}, one way {} ms, interval {} ms, lease {} ms\n  \
         most admitted in any {} s span (one key, all regions): {span_max} ({:.1} % of the limit); \
         largest one-store estimate: {estimate_max:.1}\n",
        args.limit,
        args.window_s,
        args.keys,
        args.algorithm,
        args.one_way_ms,
        args.interval_ms,
        args.lease_ms,
        args.window_s,
        span_max as f64 * 100.0 / args.limit as f64,
    );
    let ends: Vec<u64> = record.shifts.iter().skip(1).map(|(at, _)| *at).chain([record.ended]).collect();
    for ((at, shares), end) in record.shifts.iter().zip(ends) {
        // The first whole window three intervals after the shift, and the
        // phase's last window.
        let windows =
            [("from 3 intervals after", at + 3 * args.interval_ms), ("last", end.saturating_sub(window_ms))];
        for (what, from) in windows {
            let got: Vec<f64> = (0..3).map(|r| admitted(log, r, from, window_ms, args.keys)).collect();
            let percent: Vec<String> =
                got.iter().map(|g| format!("{:.1} %", g * 100.0 / args.limit as f64)).collect();
            let _ = writeln!(
                report,
                "  demand {shares:?} from {} s, window {what}: admitted per key a/b/c {}; all {:.1} %",
                (at - record.started) / 1_000,
                percent.join(" / "),
                got.iter().sum::<f64>() * 100.0 / args.limit as f64
            );
        }
    }
    if let Some(ms) = record.took_over {
        let _ = writeln!(report, "  agent of a killed: another instance held the role {ms} ms later");
    }
    let offered: Vec<u64> = seen.offered.iter().map(|o| o.load(Ordering::Relaxed)).collect();
    let failed = seen.failed.load(Ordering::Relaxed);
    let _ =
        writeln!(report, "  offered per region {offered:?}, admitted {}, failed calls {failed}", log.len());
    report
}

async fn run(args: &Args, name: &str) -> anyhow::Result<String> {
    let plan = plan(args, name)?;
    let dir = args.out.join(name);
    let mut world = World::start(args, &dir, plan.setup, plan.skewed).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let full = args.limit as f64 * args.keys as f64 / args.window_s as f64 * args.demand;
    let rates = Arc::new([AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)]);
    let (seen, stop) = (Arc::new(Seen::default()), Arc::new(AtomicBool::new(false)));
    let tasks = load(&world, Arc::clone(&rates), args.keys, Arc::clone(&seen), Arc::clone(&stop)).await;
    let traffic_before = redis_traffic(world.coordination_port);
    let record = drive(&mut world, &plan, &rates, full).await?;
    let traffic_after = redis_traffic(world.coordination_port);
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let _ = task.await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = seen.admitted.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
    std::fs::write(dir.join("timeline.txt"), &record.timeline)?;
    let mut report = report(args, name, &log, &record, &seen);
    if let (Some(before), Some(after)) = (traffic_before, traffic_after) {
        // Per region and interval, all regions' traffic shared evenly.
        let intervals = ((record.ended - record.started) / args.interval_ms).max(1) as f64 * 3.0;
        let per = |a: u64, b: u64| (b - a) as f64 / intervals;
        let _ = writeln!(
            report,
            "  coordination store per region and interval: {:.1} commands, {:.0} bytes in, {:.0} bytes out",
            per(before.0, after.0),
            per(before.1, after.1),
            per(before.2, after.2)
        );
    }
    std::fs::write(dir.join("report.txt"), &report)?;
    Ok(report)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let all =
        ["one-store", "shift", "whole", "third", "store-stop", "region-cut", "agent-kill", "clock-skew"];
    let scenarios: Vec<String> = if args.scenario.is_empty() {
        all.iter().map(|s| (*s).to_owned()).collect()
    } else {
        args.scenario.clone()
    };
    for name in &scenarios {
        let report = run(&args, name).await.with_context(|| format!("scenario {name}"))?;
        print!("{report}");
    }
    Ok(())
}
