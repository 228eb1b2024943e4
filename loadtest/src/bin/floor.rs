//! `floor`: what a decision's wake-ups and loopback round trips cost on
//! this machine with no decision in them, the floor under `rates.sh`'s CPU
//! per decision at the same rate.
//!
//! A responder process runs a current-thread tokio runtime, as each of
//! ratelimitd's serving threads does, and answers each request of its
//! client (a fixed-size message over loopback TCP) with a fixed-size reply,
//! after one round trip to Redis when `--redis` is given (an `ECHO` of
//! about a script call's size). Per request that is a decision's system
//! calls and wake-ups (two sleeps in `epoll_wait`, two reads, two writes;
//! one of each without Redis) and none of its work: no HTTP/2, gRPC,
//! engine or script. The client, in this process, sends at `--rate` on a
//! fixed schedule (open loop: a sender thread and a receiver thread on one
//! connection) for `--duration` seconds; the responder's CPU, its system
//! part and its context switches per request are read from `/proc`.
//!
//! ```sh
//! floor --rate 2000 --redis 127.0.0.1:6379 --json floor-2000.json
//! ```

#![forbid(unsafe_code)]
#![allow(clippy::print_stdout)] // the report is the program's output

#[path = "../usage.rs"]
mod usage;

use std::{
    io::{Read as _, Write as _},
    net::{TcpListener, TcpStream},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// About a `ShouldRateLimit` request of one descriptor on the wire
/// (HTTP/2 HEADERS and DATA frames).
const REQUEST_BYTES: usize = 200;
/// About its answer (HEADERS, DATA and trailers).
const REPLY_BYTES: usize = 100;
/// About one decision's script call (EVALSHA, its key and arguments).
const SCRIPT_CALL_BYTES: usize = 150;

#[derive(Parser, Debug)]
#[command(about = "The floor of a decision's cost: its wake-ups and loopback round trips, nothing else")]
struct Args {
    /// Requests per second, sent on a fixed schedule.
    #[arg(long, default_value_t = 2000)]
    rate: u32,
    /// Seconds of load after a one-second warm-up.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Redis (host:port) to make one round trip to per request; none: the
    /// responder answers at once (the memory store's floor).
    #[arg(long)]
    redis: Option<String>,
    /// Cores for the responder (taskset -c list).
    #[arg(long)]
    cpus: Option<String>,
    /// Write the figures as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// Run as the responder on this listening address (internal).
    #[arg(long, hide = true)]
    respond: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(listen) = &args.respond {
        return respond(listen, args.redis.as_deref());
    }
    let port = {
        let probe = TcpListener::bind("127.0.0.1:0")?;
        probe.local_addr()?.port()
    };
    let listen = format!("127.0.0.1:{port}");
    let mut responder = start_responder(&args, &listen)?;
    let result = drive(&args, &listen, responder.id());
    let _ = responder.kill();
    let _ = responder.wait();
    let figures = result?;
    println!("{figures}");
    if let Some(path) = &args.json {
        std::fs::write(path, figures.to_string()).with_context(|| path.display().to_string())?;
    }
    Ok(())
}

/// This program again, as the responder on `listen` (on `--cpus`).
fn start_responder(args: &Args, listen: &str) -> anyhow::Result<Child> {
    let this = std::env::current_exe()?;
    let mut command = match &args.cpus {
        Some(cpus) => {
            let mut taskset = Command::new("taskset");
            taskset.args(["-c", cpus]).arg(&this);
            taskset
        }
        None => Command::new(&this),
    };
    command.args(["--respond", listen]).stdin(Stdio::null());
    if let Some(redis) = &args.redis {
        command.args(["--redis", redis]);
    }
    command.spawn().context("starting the responder")
}

/// Connects to the responder, warms up, then sends at `--rate` and reads
/// every reply; the figures of the responder (`pid`) per request.
fn drive(args: &Args, listen: &str, pid: u32) -> anyhow::Result<serde_json::Value> {
    let stream = connect(listen)?;
    let replies = Arc::new(AtomicU64::new(0));
    let reader = {
        let mut stream = stream.try_clone()?;
        let replies = Arc::clone(&replies);
        std::thread::spawn(move || {
            let mut reply = [0u8; REPLY_BYTES];
            while stream.read_exact(&mut reply).is_ok() {
                replies.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    let mut writer = stream.try_clone()?;
    let interval = Duration::from_secs_f64(1.0 / f64::from(args.rate.max(1)));
    send(&mut writer, interval, Duration::from_secs(1))?;
    settle(&replies, 0)?;
    let (before, counted) = (usage::Usage::of(pid)?, replies.load(Ordering::Relaxed));
    let sent = send(&mut writer, interval, Duration::from_secs_f64(args.duration))?;
    settle(&replies, counted + sent)?;
    let used = usage::Usage::of(pid)?.since(before);
    stream.shutdown(std::net::Shutdown::Both)?;
    let _ = reader.join();
    let requests = sent as f64;
    Ok(serde_json::json!({
        "rate": args.rate,
        "redis": args.redis.is_some(),
        "requests": sent,
        "cpu_us_per_request": used.cpu * 1e6 / requests,
        "system_us_per_request": used.system * 1e6 / requests,
        "switches_per_request": used.switches as f64 / requests,
        "migrations_per_request": used.migrations as f64 / requests,
    }))
}

/// The responder's port, once it listens (it may take a moment to start).
fn connect(listen: &str) -> anyhow::Result<TcpStream> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpStream::connect(listen) {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Err(error) => return Err(error).with_context(|| format!("the responder on {listen}")),
        }
    }
}

/// Sends a request every `interval` for `duration`, each at its time on a
/// fixed schedule (late ones at once); how many it sent.
fn send(stream: &mut TcpStream, interval: Duration, duration: Duration) -> anyhow::Result<u64> {
    let request = [b'q'; REQUEST_BYTES];
    let start = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < duration {
        let due = start + interval * u32::try_from(sent).unwrap_or(u32::MAX);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        stream.write_all(&request)?;
        sent += 1;
    }
    Ok(sent)
}

/// Waits until `replies` reaches `expected` (and, with 0, until it stops
/// moving): every request sent is answered before the figures are read.
fn settle(replies: &AtomicU64, expected: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = u64::MAX;
    loop {
        let now = replies.load(Ordering::Relaxed);
        if (expected > 0 && now >= expected) || (expected == 0 && now == last) {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the responder answered {now} of {expected}");
        last = now;
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The responder: one current-thread runtime answering the connections on
/// `listen`, each request after a round trip to `redis` when given.
fn respond(listen: &str, redis: Option<&str>) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        loop {
            let (client, _) = listener.accept().await?;
            client.set_nodelay(true)?;
            let redis = match redis {
                Some(address) => {
                    let redis = tokio::net::TcpStream::connect(address).await?;
                    redis.set_nodelay(true)?;
                    Some(redis)
                }
                None => None,
            };
            tokio::spawn(answer(client, redis));
        }
    })
}

/// Answers `client`'s requests until it closes.
async fn answer(mut client: tokio::net::TcpStream, mut redis: Option<tokio::net::TcpStream>) {
    let mut request = [0u8; REQUEST_BYTES];
    let payload = [b'k'; SCRIPT_CALL_BYTES];
    let mut call = format!("*2\r\n$4\r\nECHO\r\n${SCRIPT_CALL_BYTES}\r\n").into_bytes();
    call.extend_from_slice(&payload);
    call.extend_from_slice(b"\r\n");
    let mut echoed = vec![0u8; format!("${SCRIPT_CALL_BYTES}\r\n").len() + SCRIPT_CALL_BYTES + 2];
    let reply = [b'r'; REPLY_BYTES];
    while client.read_exact(&mut request).await.is_ok() {
        if let Some(redis) = &mut redis
            && (redis.write_all(&call).await.is_err() || redis.read_exact(&mut echoed).await.is_err())
        {
            return;
        }
        if client.write_all(&reply).await.is_err() {
            return;
        }
    }
}
