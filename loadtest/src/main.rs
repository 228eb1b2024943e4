//! `loadtest`: a gRPC load generator for ratelimitd's `Check` and Envoy's
//! `ShouldRateLimit` (so it drives envoyproxy/ratelimit and limitador too).
//!
//! - Closed loop (`--concurrency N`): N callers, each sending its next request
//!   when the previous one is answered.
//! - Open loop (`--rate R`): requests are started at a fixed rate whatever
//!   the answers do, and latency is measured from each request's *intended*
//!   send time, so queueing in the client or the server is not hidden.
//! - Many decisions per call (closed loop only): `--api batch` sends
//!   `CheckBatch` calls of `--batch` items; `--api stream` keeps one
//!   `CheckStream` per caller with `--batch` items in flight, sending the
//!   next item as each result arrives. Latency is per decision (a batch's
//!   call time for each of its items; an item's time in the stream).
//!
//! Keys: one hot key, uniform over N users, or zipf over N users. Latency
//! goes into an HDR histogram; the report has p50/p90/p99/p99.9/max,
//! throughput, errors by gRPC code and, with `--target-pid`, the target's
//! CPU time, context switches and CPU migrations per decision (from
//! `/proc/PID`). A progress line on stderr
//! while it runs; a JSON report and an SVG latency plot at the end.

#![forbid(unsafe_code)]
#![allow(clippy::print_stdout)] // the report is the program's output

mod keys;
mod report;
mod usage;
mod victim;

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;
use hdrhistogram::Histogram;
use ratelimitd::api::{
    envoy_pb::{
        envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
        rls::{RateLimitRequest as EnvoyRequest, rate_limit_service_client::RateLimitServiceClient},
    },
    pb::{self, rate_limiter_client::RateLimiterClient},
};
use tonic::transport::Channel;

use crate::keys::{KeySpace, Rng};

/// Load generator for ratelimitd.
#[derive(Debug, Parser)]
#[command(name = "loadtest", version, about)]
struct Args {
    /// Target gRPC address.
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    target: String,
    /// `check` (ratelimit.v1.RateLimiter/Check), `envoy` (ShouldRateLimit),
    /// `batch` (CheckBatch) or `stream` (CheckStream).
    #[arg(long, default_value = "check")]
    api: String,
    /// Items per CheckBatch call, or in flight per CheckStream.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Closed loop: this many concurrent callers.
    #[arg(long, conflicts_with = "rate")]
    concurrency: Option<usize>,
    /// Open loop: requests per second, started on schedule.
    #[arg(long)]
    rate: Option<u64>,
    /// How long to run, in seconds.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// HTTP/2 connections the calls are spread over.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// `hot`, `uniform:N`, `zipf:N:S` (S the exponent, e.g. 1.1), or
    /// `distinct[:LEN]` (a new user every request, padded to LEN bytes).
    #[arg(long, default_value = "hot")]
    keys: String,
    /// resource_path of Check requests.
    #[arg(long, default_value = "/api/v1/playback")]
    path: String,
    /// Envoy domain; descriptors are (user=<key>).
    #[arg(long, default_value = "edge")]
    domain: String,
    /// Request weight (Check) / hits_addend (Envoy).
    #[arg(long, default_value_t = 1)]
    weight: u32,
    /// Priority mix for Check, e.g. `CRITICAL=1,BULK=3` (default: unspecified).
    #[arg(long)]
    priority_mix: Option<String>,
    /// PID of the target process: report its CPU time per decision.
    #[arg(long)]
    target_pid: Option<u32>,
    /// Write the JSON report here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Write an SVG latency plot here.
    #[arg(long)]
    svg: Option<std::path::PathBuf>,
    /// Label for the report (e.g. `ratelimitd-redis`).
    #[arg(long, default_value = "run")]
    label: String,
    /// Seed of the key and priority choices.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also run a victim (one Check every `--victim-interval-ms`) and an
    /// attacker (CheckBatch of `--batch` items of its own key) on this
    /// path, each on a connection of its own, and report what they got.
    #[arg(long)]
    victim: Option<String>,
    /// The victim's interval between Checks.
    #[arg(long, default_value_t = 10)]
    victim_interval_ms: u64,
    /// The load's tenant: every `Check` user id becomes `NAME:<user>` (the
    /// service's default `overload.tenant_from: user_id_prefix`). The
    /// victim and the attacker keep theirs, without a tenant.
    #[arg(long)]
    tenant: Option<String>,
}

/// Client of one of the two APIs over one channel.
#[derive(Clone)]
enum Client {
    Check(RateLimiterClient<Channel>),
    Envoy(RateLimitServiceClient<Channel>),
}

/// What every call needs to build its request.
struct Plan {
    keys: KeySpace,
    tenant: Option<String>,
    path: String,
    domain: String,
    weight: u32,
    priorities: Vec<(i32, u32)>,
}

impl Plan {
    /// A Check request for the next user.
    fn check_request(&self, rng: &mut Rng) -> pb::RateLimitRequest {
        pb::RateLimitRequest {
            user_id: match &self.tenant {
                Some(tenant) => format!("{tenant}:{}", self.keys.pick(rng)),
                None => self.keys.pick(rng),
            },
            resource_path: self.path.clone(),
            weight: self.weight,
            priority: pick_priority(&self.priorities, rng),
            ..Default::default()
        }
    }

    /// One CheckBatch of `size` items, each outcome recorded with the call's latency.
    async fn batch(
        &self,
        client: &mut RateLimiterClient<Channel>,
        size: usize,
        rng: &mut Rng,
        tally: &Tally,
        local: &mut Histogram<u64>,
    ) {
        let items =
            (0..size as u64).map(|id| pb::CheckItem { id, request: Some(self.check_request(rng)) }).collect();
        let sent = Instant::now();
        match client.check_batch(pb::CheckBatchRequest { items }).await {
            Ok(response) => {
                let latency = sent.elapsed();
                for result in response.into_inner().results {
                    tally.record(outcome_of(&result), latency, local);
                }
            }
            Err(status) => tally.record(Err(status.code()), sent.elapsed(), local),
        }
    }

    /// One CheckStream with `window` items in flight until `running` stops
    /// or `duration` has passed since `started`; each result is recorded
    /// with its item's time in the stream.
    #[allow(clippy::too_many_arguments)]
    async fn stream(
        &self,
        client: &mut RateLimiterClient<Channel>,
        window: usize,
        rng: &mut Rng,
        tally: &Tally,
        local: &mut Histogram<u64>,
        running: &AtomicBool,
        (started, duration): (Instant, Duration),
    ) {
        let window = window.max(1);
        let (items, receiver) = tokio::sync::mpsc::channel(window);
        let input = futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        });
        let mut results = match client.check_stream(input).await {
            Ok(response) => response.into_inner(),
            Err(status) => return tally.record(Err(status.code()), Duration::ZERO, local),
        };
        // An item's id picks its slot (id % window): the answer to id frees
        // the slot that id + window then takes.
        let mut sent_at = vec![Instant::now(); window];
        for id in 0..window as u64 {
            sent_at[id as usize % window] = Instant::now();
            let _ = items.send(pb::CheckItem { id, request: Some(self.check_request(rng)) }).await;
        }
        let mut open = window;
        while open > 0 {
            match results.message().await {
                Ok(Some(result)) => {
                    let slot = result.id as usize % window;
                    tally.record(outcome_of(&result), sent_at[slot].elapsed(), local);
                    open -= 1;
                    if running.load(Ordering::Relaxed) && started.elapsed() < duration {
                        sent_at[slot] = Instant::now();
                        let next = pb::CheckItem {
                            id: result.id + window as u64,
                            request: Some(self.check_request(rng)),
                        };
                        if items.send(next).await.is_ok() {
                            open += 1;
                        }
                    }
                }
                Ok(None) => break,
                Err(status) => {
                    tally.record(Err(status.code()), Duration::ZERO, local);
                    break;
                }
            }
        }
    }

    async fn call(&self, client: &mut Client, rng: &mut Rng) -> Result<bool, tonic::Code> {
        match client {
            Client::Check(c) => {
                let request = self.check_request(rng);
                c.check(request).await.map(|r| r.into_inner().allowed).map_err(|s| s.code())
            }
            Client::Envoy(c) => {
                let user = self.keys.pick(rng);
                let request = EnvoyRequest {
                    domain: self.domain.clone(),
                    descriptors: vec![RateLimitDescriptor {
                        entries: vec![Entry { key: "user".to_owned(), value: user }],
                        ..Default::default()
                    }],
                    hits_addend: self.weight,
                };
                c.should_rate_limit(request)
                    .await
                    .map(|r| r.into_inner().overall_code == 1)
                    .map_err(|s| s.code())
            }
        }
    }
}

/// Allowed or not, or INVALID_ARGUMENT for an item the service refused.
fn outcome_of(result: &pb::CheckResult) -> Result<bool, tonic::Code> {
    result.response.as_ref().map(|r| r.allowed).ok_or(tonic::Code::InvalidArgument)
}

fn pick_priority(mix: &[(i32, u32)], rng: &mut Rng) -> i32 {
    let total: u32 = mix.iter().map(|(_, w)| w).sum();
    if total == 0 {
        return 0;
    }
    let mut roll = (rng.next() % u64::from(total)) as u32;
    for (priority, weight) in mix {
        if roll < *weight {
            return *priority;
        }
        roll -= weight;
    }
    0
}

fn parse_priorities(text: Option<&str>) -> anyhow::Result<Vec<(i32, u32)>> {
    let Some(text) = text else { return Ok(Vec::new()) };
    text.split(',')
        .map(|part| {
            let (name, weight) = part.split_once('=').context("--priority-mix: expected NAME=WEIGHT")?;
            let priority = pb::PriorityBucket::from_str_name(name)
                .with_context(|| format!("--priority-mix: unknown {name}"))?;
            Ok((priority as i32, weight.parse().context("--priority-mix: weight")?))
        })
        .collect()
}

/// Shared counters of a run.
#[derive(Default)]
struct Tally {
    sent: AtomicU64,
    allowed: AtomicU64,
    denied: AtomicU64,
    errors: Mutex<BTreeMap<String, u64>>,
    latency: Mutex<Option<Histogram<u64>>>,
}

impl Tally {
    fn record(&self, outcome: Result<bool, tonic::Code>, latency: Duration, local: &mut Histogram<u64>) {
        self.count(outcome);
        let _ = local.record(nanos(latency));
    }

    fn count(&self, outcome: Result<bool, tonic::Code>) {
        self.sent.fetch_add(1, Ordering::Relaxed);
        match outcome {
            Ok(true) => self.allowed.fetch_add(1, Ordering::Relaxed),
            Ok(false) => self.denied.fetch_add(1, Ordering::Relaxed),
            Err(code) => {
                *self.errors.lock().unwrap().entry(format!("{code:?}")).or_default() += 1;
                0
            }
        };
    }

    fn merge(&self, local: &Histogram<u64>) {
        let mut merged = self.latency.lock().unwrap();
        match merged.as_mut() {
            Some(h) => h.add(local).expect("same bounds"),
            None => *merged = Some(local.clone()),
        }
    }
}

fn nanos(latency: Duration) -> u64 {
    u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX).max(1)
}

fn histogram() -> Histogram<u64> {
    // 1 ns .. 60 s, 3 significant digits.
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("valid bounds")
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let keys: KeySpace = args.keys.parse().map_err(anyhow::Error::msg)?;
    if matches!(args.api.as_str(), "batch" | "stream") && args.rate.is_some() {
        anyhow::bail!("--api {}: closed loop only (--concurrency), not --rate", args.api);
    }
    let plan = Arc::new(Plan {
        keys,
        tenant: args.tenant.clone(),
        path: args.path.clone(),
        domain: args.domain.clone(),
        weight: args.weight,
        priorities: parse_priorities(args.priority_mix.as_deref())?,
    });
    let mut clients = Vec::with_capacity(args.connections);
    for _ in 0..args.connections.max(1) {
        let channel = tonic::transport::Endpoint::from_shared(args.target.clone())?
            .tcp_nodelay(true)
            .connect()
            .await
            .with_context(|| format!("cannot connect to {}", args.target))?;
        clients.push(match args.api.as_str() {
            "check" | "batch" | "stream" => Client::Check(RateLimiterClient::new(channel)),
            "envoy" => Client::Envoy(RateLimitServiceClient::new(channel)),
            other => anyhow::bail!("--api {other}: expected check, envoy, batch or stream"),
        });
    }

    let duration = Duration::from_secs_f64(args.duration);
    let tally = Arc::new(Tally::default());
    let running = Arc::new(AtomicBool::new(true));
    let usage_before = args.target_pid.map(usage::Usage::of).transpose()?;
    let started = Instant::now();
    let progress =
        tokio::spawn(report::progress(Arc::clone(&tally), started, duration, Arc::clone(&running)));
    let victims = args.victim.clone().map(|path| {
        let interval = Duration::from_millis(args.victim_interval_ms.max(1));
        tokio::spawn(victim::run(args.target.clone(), path, interval, args.batch, Arc::clone(&running)))
    });

    let mut workers = Vec::new();
    match (args.concurrency, args.rate) {
        (Some(concurrency), None) => {
            for worker in 0..concurrency.max(1) {
                let (plan, tally, running) = (Arc::clone(&plan), Arc::clone(&tally), Arc::clone(&running));
                let mut client = clients[worker % clients.len()].clone();
                let mut rng = Rng::new(args.seed ^ (worker as u64 + 1));
                let (api, size) = (args.api.clone(), args.batch);
                workers.push(tokio::spawn(async move {
                    let mut local = histogram();
                    match (api.as_str(), &mut client) {
                        ("stream", Client::Check(c)) => {
                            let window = (started, duration);
                            plan.stream(c, size, &mut rng, &tally, &mut local, &running, window).await;
                        }
                        ("batch", Client::Check(c)) => {
                            while running.load(Ordering::Relaxed) && started.elapsed() < duration {
                                plan.batch(c, size, &mut rng, &tally, &mut local).await;
                            }
                        }
                        _ => {
                            while running.load(Ordering::Relaxed) && started.elapsed() < duration {
                                let sent = Instant::now();
                                let outcome = plan.call(&mut client, &mut rng).await;
                                tally.record(outcome, sent.elapsed(), &mut local);
                            }
                        }
                    }
                    tally.merge(&local);
                }));
            }
        }
        (None, Some(rate)) => {
            // One pacing thread; each request its own task, timed from its
            // intended start. The pacer sleeps with the OS (nanosleep, some
            // 50-100 µs late), not with Tokio's timer, whose 1 ms granularity
            // would release requests in bursts and add up to a millisecond
            // of the generator's own lateness to every latency. Requests
            // whose intended time has passed are started at once (catch-up),
            // so the rate holds and the lateness is still measured.
            let interval = Duration::from_secs_f64(1.0 / rate.max(1) as f64);
            let mut rng = Rng::new(args.seed);
            let in_flight = Arc::new(tokio::sync::Semaphore::new(100_000));
            // Tasks report only their latency; one collector owns the histogram.
            let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
            let collector = tokio::spawn(async move {
                let mut all = histogram();
                while let Some(ns) = done_rx.recv().await {
                    let _ = all.record(ns);
                }
                all
            });
            let runtime = tokio::runtime::Handle::current();
            let (plan, pacer_tally, clients) = (Arc::clone(&plan), Arc::clone(&tally), clients.clone());
            let pacer = tokio::task::spawn_blocking(move || {
                let mut i: u64 = 0;
                loop {
                    let intended = started + interval.mul_f64(i as f64);
                    if intended.duration_since(started) >= duration {
                        break;
                    }
                    let now = Instant::now();
                    if intended > now {
                        std::thread::sleep(intended - now);
                    }
                    let permit = match Arc::clone(&in_flight).try_acquire_owned() {
                        Ok(permit) => permit,
                        Err(_) => {
                            runtime.block_on(Arc::clone(&in_flight).acquire_owned()).expect("semaphore open")
                        }
                    };
                    let (plan, tally, done) = (Arc::clone(&plan), Arc::clone(&pacer_tally), done_tx.clone());
                    let mut client = clients[(i as usize) % clients.len()].clone();
                    let mut task_rng = Rng::new(rng.next());
                    runtime.spawn(async move {
                        let outcome = plan.call(&mut client, &mut task_rng).await;
                        tally.count(outcome);
                        let _ = done.send(nanos(intended.elapsed()));
                        drop(permit);
                    });
                    i += 1;
                }
            });
            pacer.await?;
            tally.merge(&collector.await?);
        }
        _ => anyhow::bail!("give exactly one of --concurrency (closed loop) or --rate (open loop)"),
    }
    for worker in workers {
        worker.await?;
    }
    let elapsed = started.elapsed();
    running.store(false, Ordering::Relaxed);
    progress.await?;
    let victims = match victims {
        Some(victims) => Some(victims.await??),
        None => None,
    };
    let usage = match (args.target_pid, usage_before) {
        (Some(pid), Some(before)) => Some(usage::Usage::of(pid)?.since(before)),
        _ => None,
    };
    let report =
        report::Report::build(&args.label, &args.api, &tally, elapsed, usage, args.rate, args.concurrency);
    println!("{}", report.text());
    if let (Some(victims), Some(path)) = (&victims, &args.victim) {
        println!("{}", victims.text(path));
    }
    if let Some(path) = &args.json {
        std::fs::write(path, report.json()).with_context(|| path.display().to_string())?;
    }
    if let Some(path) = &args.svg {
        let latency = tally.latency.lock().unwrap();
        std::fs::write(path, report::svg(&args.label, latency.as_ref().expect("a histogram")))
            .with_context(|| path.display().to_string())?;
    }
    Ok(())
}
