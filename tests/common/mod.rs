//! Shared harness for the black-box tests, one file per component:
//! `redis_nodes.rs` (real `redis-server` nodes, cluster, Sentinel),
//! `service.rs` (the real gRPC server on `127.0.0.1:0`, rule files in a
//! temporary directory, a generated client), `kafka.rs` (a real
//! Kafka-protocol broker), `envoy.rs` (real Envoy, grpcurl), `tls.rs`
//! (certificates), `xds.rs` (an aggregated discovery server), `delay.rs` (a TCP proxy with a one-way latency that can
//! cut the path); here, what they share (free ports, child processes,
//! waiting). Every child process is stopped by PID when dropped.

#![allow(dead_code, unreachable_pub)]

use std::{
    net::{SocketAddr, TcpListener as StdListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Once,
    time::{Duration, Instant},
};

use ratelimitd::{
    api::pb::{self, rate_limiter_client::RateLimiterClient},
    config::Config,
    server,
};
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};
use tonic::transport::Channel;

mod delay;
mod envoy;
mod h2;
mod kafka;
mod redis_nodes;
mod service;
mod tls;
pub mod webdriver;
mod xds;

// Each test binary uses some of them.
#[allow(unused_imports)]
pub use self::{delay::*, envoy::*, h2::*, kafka::*, redis_nodes::*, service::*, tls::*, xds::*};

/// Which counter store a scenario runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Redis,
}

/// Generates one `#[tokio::test]` per store from one async scenario
/// `async fn name(backend: Backend)`.
#[macro_export]
macro_rules! for_each_store {
    ($($scenario:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $scenario() { super::$scenario($crate::common::Backend::Memory).await }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $scenario() { super::$scenario($crate::common::Backend::Redis).await }
            )*
        }
    };
}

fn which(program: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {program} >/dev/null")])
        .status()
        .is_ok_and(|s| s.success())
}

/// A file of this repository. Read from the test's environment at run
/// time, not baked in at compile time: CI shares one target directory
/// between clones at different paths, and a test binary built in one clone
/// must not read another clone's files.
pub fn repo_path(relative: &str) -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
        .join(relative)
}

/// A seeded xorshift: `random(bound)` is in `0..bound`, the same sequence
/// for the same seed on every run (the scripts' twin tests).
pub fn xorshift(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |bound| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % bound
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn kill(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Waits until `ready()` says the child serves. `None` if it exited first
/// (most likely its port was taken meanwhile) or never became ready, in
/// which case it is killed.
fn wait_ready(mut child: Child, timeout: Duration, ready: impl Fn() -> bool) -> Option<Child> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return None;
        }
        if ready() {
            return Some(child);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    kill(&mut Some(child));
    None
}

/// Polls `probe` until it returns true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut probe: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if probe().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// The child `command(port)` spawns, with its stderr in `log`, once it
/// accepts connections on `port` (a fresh [`free_port`]).
///
/// A port found free can be taken before the child binds it (the kernel
/// hands the same range to outgoing connections, and the suite opens many):
/// the child then exits. So each try picks a fresh port, and only the fifth
/// failure panics, with the child's last log.
pub fn start_listening(what: &str, log: &Path, mut command: impl FnMut(u16) -> Command) -> (Child, u16) {
    for _ in 0..5 {
        let port = free_port();
        let child = command(port)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let listening = || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
        if let Some(child) = wait_ready(child, Duration::from_secs(30), listening) {
            return (child, port);
        }
    }
    let log = std::fs::read_to_string(log).unwrap_or_default();
    panic!("{what} did not listen in 5 tries on fresh ports; its last log:\n{log}");
}

/// Every `.rs` file under the repository's `src/`, sorted.
pub fn rust_sources() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![repo_path("src")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}
