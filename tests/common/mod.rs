//! Shared harness for the black-box tests: a real `redis-server` on a free
//! loopback port (installed from Debian's packages when missing), the real
//! gRPC server on `127.0.0.1:0`, rule files in a temporary directory, and a
//! generated client. Every child process is stopped by PID when dropped.

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

static INSTALL: Once = Once::new();

/// Makes sure `redis-server` is on the PATH, installing Debian's package if
/// not. Concurrent test processes serialise on a lock file.
pub fn ensure_redis_installed() {
    INSTALL.call_once(|| {
        if which("redis-server") {
            return;
        }
        let status = Command::new("flock")
            .args([
                "/tmp/ratelimitd-apt.lock",
                "sh",
                "-c",
                "command -v redis-server >/dev/null || \
                 { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server; }",
            ])
            .status();
        assert!(
            which("redis-server"),
            "redis-server is not installed and `apt-get install redis-server` failed ({status:?}); \
             install it (Debian package redis-server) and run the tests again"
        );
    });
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

/// The records in a DLQ file (none if it does not exist).
pub fn read_dlq(path: &Path) -> Vec<ratelimitd::dlq::FailureRecord> {
    match std::fs::read_to_string(path) {
        Ok(text) => text.lines().map(|l| serde_json::from_str(l).expect("a valid record line")).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A `redis-server` child process, killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    /// `--requirepass`, if any.
    password: Option<String>,
    /// TLS only (no plain port), with `server.pem`/`server.key`/`ca.pem`
    /// from this directory.
    tls: Option<PathBuf>,
}

impl RedisServer {
    /// Starts a fresh, empty, non-persistent Redis on a free port.
    pub fn start() -> Self {
        Self::start_with_password(None)
    }

    /// Starts one that requires AUTH with `password`.
    pub fn start_with_password(password: Option<&str>) -> Self {
        Self::start_with(password, None)
    }

    /// Starts one serving TLS only, with `server.pem`, `server.key` and
    /// `ca.pem` from `certs` (client certificates not required), and AUTH
    /// with `password` if given.
    pub fn start_with(password: Option<&str>, certs: Option<&Path>) -> Self {
        ensure_redis_installed();
        for _ in 0..5 {
            let mut server = RedisServer {
                child: None,
                port: free_port(),
                dir: tempfile::tempdir().unwrap(),
                password: password.map(str::to_owned),
                tls: certs.map(Path::to_path_buf),
            };
            if server.spawn() {
                return server;
            }
        }
        panic!("could not start redis-server on a free port");
    }

    /// (Re)starts the process on the same port; true once it answers PING.
    fn spawn(&mut self) -> bool {
        let mut command = redis_server(self.dir.path());
        match &self.tls {
            None => command.args(["--port", &self.port.to_string()]),
            Some(certs) => command
                .args(["--port", "0", "--tls-port", &self.port.to_string(), "--tls-auth-clients", "no"])
                .arg("--tls-cert-file")
                .arg(certs.join("server.pem"))
                .arg("--tls-key-file")
                .arg(certs.join("server.key"))
                .arg("--tls-ca-cert-file")
                .arg(certs.join("ca.pem")),
        };
        // Also on a Unix socket in its directory ([`RedisServer::unix_url`]).
        let child = command
            .arg("--unixsocket")
            .arg(self.socket())
            .args(["--unixsocketperm", "700"])
            .args(self.password.iter().flat_map(|p| ["--requirepass", p.as_str()]))
            .spawn()
            .expect("spawn redis-server");
        let port = self.port;
        // Without AUTH a protected server answers PING with NOAUTH: a TCP
        // answer is then proof enough that it serves.
        let protected = self.password.is_some() || self.tls.is_some();
        self.child = wait_ready(child, Duration::from_secs(10), || {
            if protected { std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() } else { ping(port) }
        });
        self.child.is_some()
    }

    /// The Unix socket it also listens on.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("redis.sock")
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the process (SIGKILL) and waits for it: Redis is gone, abruptly.
    pub fn stop(&mut self) {
        kill(&mut self.child);
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.stop();
        assert!(self.spawn(), "redis-server did not come back on port {}", self.port);
    }

    /// A client connection for assertions on Redis itself.
    pub async fn client(&self) -> redis::aio::MultiplexedConnection {
        let url = match &self.password {
            Some(password) => format!("redis://:{password}@127.0.0.1:{}", self.port),
            None => self.url(),
        };
        redis::Client::open(url).unwrap().get_multiplexed_async_connection().await.unwrap()
    }

    /// The counter at `key` as the script stores it (key-schema version 2:
    /// four little-endian doubles — a window's index, current and previous
    /// counts, or a bucket's stamp, value and minus its algorithm code —
    /// then its expiry in Unix ms), or `None` when there is no such key.
    pub async fn counter(&self, key: &str) -> Option<[f64; 4]> {
        let mut conn = self.client().await;
        let value: Option<Vec<u8>> = redis::cmd("GET").arg(key).query_async(&mut conn).await.unwrap();
        let value = value?;
        assert_eq!(value.len(), 32, "{key}: a counter is 32 bytes");
        let mut fields = [0.0; 4];
        for (field, bytes) in fields.iter_mut().zip(value.chunks_exact(8)) {
            *field = f64::from_le_bytes(bytes.try_into().unwrap());
        }
        Some(fields)
    }

    /// A field of `INFO <section>`, e.g. `("commandstats", "cmdstat_evalsha")`.
    pub async fn info_field(&self, section: &str, field: &str) -> Option<String> {
        let mut conn = self.client().await;
        let info: String = redis::cmd("INFO").arg(section).query_async(&mut conn).await.unwrap();
        info.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':').map(str::to_owned))
    }

    /// EVALSHA calls this server has run (0 before the first).
    pub async fn evalsha_calls(&self) -> u64 {
        let stats = self.info_field("commandstats", "cmdstat_evalsha").await.unwrap_or_default();
        stats.strip_prefix("calls=").and_then(|s| s.split(',').next()).map_or(0, |n| n.parse().unwrap())
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A real Redis Cluster of three primaries (no replicas) on free loopback
/// ports, built with `redis-cli --cluster create`. A node can be killed and
/// restarted on its port with its `nodes.conf`, so it takes its slots back
/// (empty: no persistence), which is the failover the tests exercise.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<ClusterNode>,
    dir: tempfile::TempDir,
}

#[derive(Debug)]
struct ClusterNode {
    port: u16,
    bus_port: u16,
    child: Option<Child>,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers, assigns the 16384 slots and
    /// waits until every node reports `cluster_state:ok`.
    pub fn start() -> Self {
        Self::start_with_replicas(0)
    }

    /// Three primaries with `replicas` replicas each (redis-cli assigns
    /// the roles); a killed primary is failed over to one of its replicas.
    pub fn start_with_replicas(replicas: usize) -> Self {
        ensure_redis_installed();
        let dir = tempfile::tempdir().unwrap();
        let mut cluster = RedisCluster { nodes: Vec::new(), dir };
        for _ in 0..3 * (1 + replicas) {
            let mut started = None;
            for _ in 0..5 {
                let mut node = ClusterNode { port: free_port(), bus_port: free_port(), child: None };
                if cluster.spawn(&mut node) {
                    started = Some(node);
                    break;
                }
            }
            cluster.nodes.push(started.expect("could not start a cluster node on free ports"));
        }
        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        cluster.wait_healthy();
        // A replica can only be promoted once it has synchronised with its
        // primary, which takes a few seconds after the cluster forms.
        let deadline = Instant::now() + Duration::from_secs(30);
        while cluster
            .nodes
            .iter()
            .map(|n| redis_cli(n.port, &["info", "replication"]))
            .filter(|info| info.contains("role:slave") && info.contains("master_link_status:up"))
            .count()
            < 3 * replicas
        {
            assert!(Instant::now() < deadline, "the replicas never synchronised with their primaries");
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// (Re)starts one node on its ports, with its cluster config file.
    fn spawn(&self, node: &mut ClusterNode) -> bool {
        let child = redis_server(self.dir.path())
            .args(["--port", &node.port.to_string()])
            .args(["--cluster-enabled", "yes", "--cluster-port", &node.bus_port.to_string()])
            .args(["--cluster-config-file", &format!("nodes-{}.conf", node.port)])
            // A dead primary is detected within a second, and the other
            // primaries keep serving their slots meanwhile.
            .args(["--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"])
            .spawn()
            .expect("spawn redis-server");
        let port = node.port;
        node.child = wait_ready(child, Duration::from_secs(10), || ping(port));
        node.child.is_some()
    }

    /// The seed nodes, as `redis.url` takes them.
    pub fn url(&self) -> String {
        self.nodes.iter().map(|n| format!("redis://127.0.0.1:{}", n.port)).collect::<Vec<_>>().join(",")
    }

    /// Kills node `i` (SIGKILL): its slots are unreachable.
    pub fn stop_node(&mut self, i: usize) {
        kill(&mut self.nodes[i].child);
    }

    /// Starts node `i` again (empty) and waits until the cluster is whole.
    pub fn restart_node(&mut self, i: usize) {
        let mut node =
            ClusterNode { port: self.nodes[i].port, bus_port: self.nodes[i].bus_port, child: None };
        kill(&mut self.nodes[i].child);
        assert!(self.spawn(&mut node), "cluster node on port {} did not come back", node.port);
        self.nodes[i] = node;
        self.wait_healthy();
    }

    /// Waits until every running node says `cluster_state:ok` with all
    /// slots served.
    pub fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let healthy = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                let info = redis_cli(n.port, &["cluster", "info"]);
                info.contains("cluster_state:ok") && info.contains("cluster_slots_ok:16384")
            });
            if healthy {
                return;
            }
            assert!(Instant::now() < deadline, "the redis cluster never became healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Keys stored on node `i`.
    pub fn keys_on(&self, i: usize) -> u64 {
        // Not the instances' live set (`rli:{instances}`), which the
        // service keeps on whichever node serves its slot.
        let keys = redis_cli(self.nodes[i].port, &["--scan"]);
        keys.lines()
            .filter(|key| !key.is_empty() && !key.ends_with(ratelimitd::limiter::local::INSTANCES_KEY))
            .count() as u64
    }

    /// Which node serves each slot, from `CLUSTER NODES`; see [`key_slot`].
    pub fn slot_owners(&self) -> Vec<usize> {
        let alive = self.nodes.iter().find(|n| n.child.is_some()).expect("a running node");
        self.owners_seen_by(alive.port)
    }

    /// Which node serves each slot, as the node on `port` sees it.
    fn owners_seen_by(&self, port: u16) -> Vec<usize> {
        let mut owners = vec![usize::MAX; 16_384];
        let nodes = redis_cli(port, &["cluster", "nodes"]);
        for line in nodes.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let Some(port) = fields.get(1).and_then(|a| a.split(['@', ':']).nth(1)) else { continue };
            let Some(node) = self.nodes.iter().position(|n| n.port.to_string() == port) else { continue };
            for range in fields.iter().skip(8) {
                let (a, b) = range.split_once('-').unwrap_or((range, range));
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    owners[a..=b].iter_mut().for_each(|o| *o = node);
                }
            }
        }
        owners
    }

    /// The index of the node serving `key`'s slot.
    pub fn node_of(&self, key: &str) -> usize {
        self.slot_owners()[usize::from(key_slot(key))]
    }

    /// Script calls (`EVALSHA`) every running node has served so far.
    pub fn script_calls(&self) -> u64 {
        self.nodes
            .iter()
            .filter(|n| n.child.is_some())
            .map(|n| {
                let stats = redis_cli(n.port, &["info", "commandstats"]);
                stats
                    .lines()
                    .find_map(|line| line.strip_prefix("cmdstat_evalsha:calls="))
                    .and_then(|rest| rest.split(',').next())
                    .and_then(|calls| calls.parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum()
    }

    /// Moves `slot` and its keys from the node serving it to node `to`, as
    /// a resharding does (IMPORTING/MIGRATING, MIGRATE, SETSLOT NODE on
    /// every node), and waits until every node agrees.
    pub fn move_slot(&self, slot: u16, to: usize) {
        let from = self.slot_owners()[usize::from(slot)];
        assert_ne!(from, to, "slot {slot} is already on node {to}");
        let id = |i: usize| redis_cli(self.nodes[i].port, &["cluster", "myid"]).trim().to_owned();
        let (from_id, to_id) = (id(from), id(to));
        let (from_port, to_port) = (self.nodes[from].port, self.nodes[to].port);
        let slot = slot.to_string();
        let ok = |port: u16, args: &[&str]| {
            let out = redis_cli(port, args);
            assert!(out.trim() == "OK" || out.trim() == "NOKEY", "{args:?} on {port}: {out}");
        };
        ok(to_port, &["cluster", "setslot", &slot, "importing", &from_id]);
        ok(from_port, &["cluster", "setslot", &slot, "migrating", &to_id]);
        let keys = redis_cli(from_port, &["cluster", "getkeysinslot", &slot, "1000"]);
        let keys: Vec<&str> = keys.split_whitespace().collect();
        if !keys.is_empty() {
            let port = to_port.to_string();
            let mut args = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "keys"];
            args.extend(keys);
            ok(from_port, &args);
        }
        for i in [to, from] {
            ok(self.nodes[i].port, &["cluster", "setslot", &slot, "node", &to_id]);
        }
        for node in self.nodes.iter().filter(|n| n.child.is_some()) {
            let _ = redis_cli(node.port, &["cluster", "setslot", &slot, "node", &to_id]);
        }
        let slot: usize = slot.parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.nodes.iter().filter(|n| n.child.is_some()).any(|n| self.owners_seen_by(n.port)[slot] != to)
        {
            assert!(Instant::now() < deadline, "the nodes never agreed on slot {slot}'s move");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

pub use ratelimitd::limiter::redis::key_slot;

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            kill(&mut node.child);
        }
    }
}

/// `redis-cli -p <port> <args…>`'s output ("" if it could not run).
fn redis_cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// `redis-server` on loopback, without persistence, its files in `dir`, its
/// output discarded; the caller adds the port and the rest.
fn redis_server(dir: &Path) -> Command {
    let mut command = Command::new("redis-server");
    command
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        // DEBUG SLEEP simulates a pause (a BGSAVE fork); Redis 7 or later.
        .args(["--enable-debug-command", "local"])
        .arg("--dir")
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    command
}

/// Kills a child process by PID (SIGKILL), if running, and reaps it.
/// Redis Sentinel: a master, one replica and one sentinel watching them as
/// `mymaster` (quorum 1, down after 300 ms), all on free ports; every
/// process stopped by PID on drop.
pub struct SentinelSetup {
    pub master: RedisServer,
    replica: Option<Child>,
    pub replica_port: u16,
    sentinel: Option<Child>,
    pub sentinel_port: u16,
    _dir: tempfile::TempDir,
}

impl SentinelSetup {
    /// Starts all three and waits until the sentinel knows the replica.
    pub async fn start() -> Self {
        let master = RedisServer::start();
        let dir = tempfile::tempdir().unwrap();
        let replica_port = free_port();
        let replica_dir = dir.path().join("replica");
        std::fs::create_dir_all(&replica_dir).unwrap();
        let child = redis_server(&replica_dir)
            .args(["--port", &replica_port.to_string(), "--replicaof", "127.0.0.1", &master.port.to_string()])
            .spawn()
            .expect("spawn the replica");
        let replica = wait_ready(child, Duration::from_secs(10), || ping(replica_port));
        assert!(replica.is_some(), "the replica did not start on {replica_port}");
        let sentinel_port = free_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {sentinel_port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {} 1\nsentinel down-after-milliseconds mymaster 300\nsentinel failover-timeout mymaster 3000\n",
                dir.path().display(),
                master.port
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server --sentinel");
        let sentinel = wait_ready(child, Duration::from_secs(10), || ping(sentinel_port));
        assert!(sentinel.is_some(), "the sentinel did not start on {sentinel_port}");
        let setup = SentinelSetup { master, replica, replica_port, sentinel, sentinel_port, _dir: dir };
        let client = redis::Client::open(setup.sentinel_url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let replicas: Vec<redis::Value> =
                redis::cmd("SENTINEL").arg("REPLICAS").arg("mymaster").query_async(&mut conn).await.unwrap();
            if !replicas.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "the sentinel never saw the replica");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        setup
    }

    /// `redis://127.0.0.1:<sentinel port>`.
    pub fn sentinel_url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.sentinel_port)
    }

    /// The port of the master the sentinel names now.
    pub async fn master_port(&self) -> u16 {
        let client = redis::Client::open(self.sentinel_url()).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        let (_, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("GET-MASTER-ADDR-BY-NAME")
            .arg("mymaster")
            .query_async(&mut conn)
            .await
            .unwrap();
        port
    }
}

impl Drop for SentinelSetup {
    fn drop(&mut self) {
        kill(&mut self.sentinel);
        kill(&mut self.replica);
    }
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

fn ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    if stream.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 7];
    stream.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
}

/// A rule directory in a temporary folder.
#[derive(Debug)]
pub struct Rules {
    pub dir: tempfile::TempDir,
}

impl Rules {
    /// A directory holding `rules.yaml` with `yaml`.
    pub fn new(yaml: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("rules.yaml"), yaml).unwrap();
        Rules { dir }
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }

    /// Replaces `rules.yaml` the way deploy tools do: write a temporary file
    /// in the same directory, then `rename` it over the old one (atomic).
    pub fn rename_over(&self, yaml: &str) {
        let tmp = self.dir.path().join(".rules.yaml.tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, self.dir.path().join("rules.yaml")).unwrap();
    }
}

/// A rule directory laid out like a Kubernetes ConfigMap volume:
/// `rules.yaml -> ..data/rules.yaml`, `..data -> ..<version>/`.
#[derive(Debug)]
pub struct ConfigMapRules {
    pub dir: tempfile::TempDir,
    version: u32,
}

impl ConfigMapRules {
    pub fn new(yaml: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut rules = ConfigMapRules { dir, version: 0 };
        rules.write_version(yaml);
        std::fs::rename(rules.dir.path().join("..data_tmp"), rules.dir.path().join("..data")).unwrap();
        std::os::unix::fs::symlink("..data/rules.yaml", rules.dir.path().join("rules.yaml")).unwrap();
        rules
    }

    fn write_version(&mut self, yaml: &str) {
        self.version += 1;
        let versioned = self.dir.path().join(format!("..2026_11_21_{:04}", self.version));
        std::fs::create_dir(&versioned).unwrap();
        std::fs::write(versioned.join("rules.yaml"), yaml).unwrap();
        // Point a fresh link at the new version, then rename it over `..data`:
        // the atomic swap the kubelet performs.
        let tmp = self.dir.path().join("..data_tmp");
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(versioned.file_name().unwrap(), &tmp).unwrap();
    }

    /// Publishes `yaml` as a new version by swapping the `..data` link, then
    /// removes the old version directory, as the kubelet does.
    pub fn swap(&mut self, yaml: &str) {
        let old = self.dir.path().join(format!("..2026_11_21_{:04}", self.version));
        self.write_version(yaml);
        std::fs::rename(self.dir.path().join("..data_tmp"), self.dir.path().join("..data")).unwrap();
        std::fs::remove_dir_all(old).unwrap();
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().to_path_buf()
    }
}

/// A configuration for tests: loopback, the given rules and store, a fast
/// reload poll and a generous store timeout (exactness tests must not fail
/// open because a loaded CI machine answered slowly).
pub fn config(rules: &Path, redis_url: Option<String>) -> Config {
    let mut config = Config::default();
    config.grpc.listen = "127.0.0.1:0".to_owned();
    config.rules.path = Some(rules.to_path_buf());
    config.rules.reload_interval_ms = 20;
    config.redis.url = redis_url;
    config.redis.timeout_ms = 2_000;
    config.grpc.shutdown_grace_ms = 5_000;
    // The host's real CPU load must not shed requests in tests that are not
    // about shedding; those turn it on with a SyntheticCpu.
    config.shed.mode = ratelimitd::shed::ShedMode::Off;
    config
}

/// [`config`] with `rules.path` unset: no native rules where Envoy rules
/// are configured (a service answering `ShouldRateLimit` only), else the
/// embedded example rules.
pub fn default_rules_config(redis_url: Option<String>) -> Config {
    let mut config = config(Path::new(""), redis_url);
    config.rules.path = None;
    config
}

/// The value of the series `series` (name and labels, as scraped) on the
/// server's `/metrics`; `None` when it is not there.
pub async fn metric(server: &TestServer, series: &str) -> Option<f64> {
    let addr = server.http_addr;
    let body = tokio::task::spawn_blocking(move || http_get(addr, "/metrics")).await.unwrap().1;
    body.lines().find_map(|l| l.strip_prefix(series)).and_then(|v| v.trim().parse().ok())
}

/// The real server, on a loopback port, stopped by [`TestServer::stop`].
#[derive(Debug)]
pub struct TestServer {
    pub addr: SocketAddr,
    /// `/metrics`, `/healthz`, `/readyz`.
    pub http_addr: SocketAddr,
    /// Where failed decisions are written (a temporary file unless the
    /// config named one).
    pub dlq_file: PathBuf,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<Result<(), server::ServerError>>>,
    observer: std::sync::Arc<std::sync::Mutex<Option<server::Observer>>>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    pub async fn start(config: Config) -> Self {
        let server = Self::start_unready(config).await;
        // The listener accepts TCP before the server has loaded its rules:
        // wait until it is built, so a test that changes files right away
        // does not race the initial load.
        server.ready().await;
        server
    }

    /// Starts the server without waiting until it answers (rules from a
    /// topic may not have arrived yet).
    pub async fn start_unready(mut config: Config) -> Self {
        // The server's own logs, shown by the test runner when a test fails.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("info"))
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().unwrap();
        if config.dlq.file == ratelimitd::config::DlqConfig::default().file {
            config.dlq.file = dir.path().join("dlq.jsonl");
        }
        let dlq_file = config.dlq.file.clone();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http_addr = http.local_addr().unwrap();
        let (tx, rx) = oneshot::channel();
        let observer = std::sync::Arc::new(std::sync::Mutex::new(None));
        let slot = std::sync::Arc::clone(&observer);
        let handle = tokio::spawn(server::run_observed(
            config,
            listener,
            Some(http),
            async move {
                let _ = rx.await;
            },
            move |o| *slot.lock().unwrap() = Some(o),
        ));
        TestServer {
            addr,
            http_addr,
            dlq_file,
            shutdown: Some(tx),
            handle: Some(handle),
            observer,
            _dir: dir,
        }
    }

    /// Waits until the server has been built and answers.
    pub async fn ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.observer.lock().unwrap().is_none() {
            if self.handle.as_ref().is_some_and(JoinHandle::is_finished) {
                panic!("the server stopped while starting (see its log above)");
            }
            assert!(Instant::now() < deadline, "the server never finished starting");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The records written to the DLQ file so far.
    pub fn dlq_records(&self) -> Vec<ratelimitd::dlq::FailureRecord> {
        read_dlq(&self.dlq_file)
    }

    pub async fn client(&self) -> RateLimiterClient<Channel> {
        let endpoint = format!("http://{}", self.addr);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match RateLimiterClient::connect(endpoint.clone()).await {
                Ok(client) => return client,
                Err(e) if Instant::now() > deadline => panic!("server at {endpoint} unreachable: {e}"),
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    /// Stops the server gracefully and returns its result.
    pub async fn stop(mut self) -> Result<(), server::ServerError> {
        let _ = self.shutdown.take().unwrap().send(());
        self.handle.take().unwrap().await.unwrap()
    }

    /// The service's state, once it has been built.
    pub async fn observer(&self) -> server::Observer {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(observer) = self.observer.lock().unwrap().clone() {
                return observer;
            }
            assert!(Instant::now() < deadline, "the server never finished starting");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops the server gracefully (which drains the DLQ writer) and returns
    /// the records it wrote.
    pub async fn stop_and_read_dlq(mut self) -> Vec<ratelimitd::dlq::FailureRecord> {
        let _ = self.shutdown.take().unwrap().send(());
        self.handle.take().unwrap().await.unwrap().unwrap();
        self.dlq_records()
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let Some(handle) = self.handle.take() else { return };
        if handle.is_finished() {
            // The server stopped on its own before the test stopped it: say
            // why, or a failing test only shows a refused connection.
            let result = tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(handle));
            eprintln!("the server stopped before the test stopped it: {result:?}");
        } else {
            handle.abort();
        }
    }
}

/// Starts the store a scenario asks for (Redis: a fresh server) and the
/// service on `rules`. The `RedisServer` must outlive the test.
pub async fn start(backend: Backend, rules: &Path) -> (TestServer, Option<RedisServer>) {
    let redis = (backend == Backend::Redis).then(RedisServer::start);
    let server = TestServer::start(config(rules, redis.as_ref().map(RedisServer::url))).await;
    (server, redis)
}

/// A request for `user` on `path`.
pub fn request(user: &str, path: &str) -> pb::RateLimitRequest {
    pb::RateLimitRequest { user_id: user.to_owned(), resource_path: path.to_owned(), ..Default::default() }
}

/// Calls Check and unwraps the response.
pub async fn check(
    client: &mut RateLimiterClient<Channel>,
    request: pb::RateLimitRequest,
) -> pb::RateLimitResponse {
    client.check(request).await.expect("Check failed").into_inner()
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

pub fn reason(response: &pb::RateLimitResponse) -> pb::Reason {
    pb::Reason::try_from(response.reason).unwrap()
}

pub type Request = pb::RateLimitRequest;

/// `tasks` concurrent callers, each sending `per_task` requests for user
/// `hot` on `path`, spread over `clients`. Returns how many were admitted;
/// fails on any answer that is not a real decision (OK or OVER_LIMIT).
pub async fn hammer(
    clients: &[RateLimiterClient<Channel>],
    tasks: usize,
    per_task: usize,
    path: &str,
) -> usize {
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(tasks));
    let mut handles = Vec::with_capacity(tasks);
    for task in 0..tasks {
        let mut client = clients[task % clients.len()].clone();
        let barrier = std::sync::Arc::clone(&barrier);
        let path = path.to_owned();
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            let mut admitted = 0;
            for _ in 0..per_task {
                let r = check(&mut client, request("hot", &path)).await;
                let why = reason(&r);
                assert!(matches!(why, pb::Reason::Ok | pb::Reason::OverLimit), "not a real decision: {r:?}");
                admitted += usize::from(r.allowed);
            }
            admitted
        }));
    }
    let mut admitted = 0;
    for handle in handles {
        admitted += handle.await.unwrap();
    }
    admitted
}

/// A synthetic `/proc/stat` (and an empty cgroup directory, so no quota
/// applies) whose counters a background thread advances every few ms at a
/// chosen busy ratio: any two readings the sampler takes differ by exactly
/// that ratio, so the measured utilization is deterministic.
#[derive(Debug)]
pub struct SyntheticCpu {
    pub procfs: tempfile::TempDir,
    pub cgroup: tempfile::TempDir,
    busy_per_mille: std::sync::Arc<std::sync::atomic::AtomicU64>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl SyntheticCpu {
    pub fn new(utilization: f64) -> Self {
        use std::sync::{
            Arc,
            atomic::{AtomicBool, AtomicU64, Ordering},
        };
        let procfs = tempfile::tempdir().unwrap();
        let cgroup = tempfile::tempdir().unwrap();
        let busy_per_mille = Arc::new(AtomicU64::new((utilization * 1000.0).round() as u64));
        let stop = Arc::new(AtomicBool::new(false));
        let path = procfs.path().join("stat");
        let write = move |busy: u64, idle: u64| {
            // Write-then-rename: the sampler never reads a half-written file.
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, format!("cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\n")).unwrap();
            std::fs::rename(&tmp, &path).unwrap();
        };
        write(0, 0);
        let writer = {
            let busy_per_mille = Arc::clone(&busy_per_mille);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let (mut busy, mut idle) = (0, 0);
                while !stop.load(Ordering::Relaxed) {
                    let b = busy_per_mille.load(Ordering::Relaxed);
                    busy += b;
                    idle += 1000 - b;
                    write(busy, idle);
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        };
        SyntheticCpu { procfs, cgroup, busy_per_mille, stop, writer: Some(writer) }
    }

    /// From now on every interval reads as `utilization`.
    pub fn set(&self, utilization: f64) {
        self.busy_per_mille
            .store((utilization * 1000.0).round() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Points `config` at these files with fast sampling and no smoothing
    /// lag beyond a few samples.
    pub fn configure(&self, config: &mut Config, mode: ratelimitd::shed::ShedMode) {
        config.shed.mode = mode;
        // The synthetic file is a host-wide /proc/stat.
        config.shed.source = ratelimitd::shed::Source::Host;
        config.shed.procfs_root = self.procfs.path().to_path_buf();
        config.shed.cgroup_root = self.cgroup.path().to_path_buf();
        config.shed.sample_interval_ms = 10;
    }
}

impl Drop for SyntheticCpu {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// The tansu binary: `$RATELIMITD_TANSU`, else the `scripts/install-tools` cache.
pub fn tansu_path() -> PathBuf {
    if let Some(path) = std::env::var_os("RATELIMITD_TANSU") {
        return PathBuf::from(path);
    }
    let tools = std::env::var_os("RATELIMITD_TOOLS_DIR").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_else(|| "/root".into()))
            .join(".cache/ratelimitd-tools")
    });
    tools.join("bin/tansu")
}

/// The Envoy binary scripts/install-tools put in the tools cache.
pub fn envoy_path() -> PathBuf {
    if let Some(path) = std::env::var_os("RATELIMITD_ENVOY") {
        return PathBuf::from(path);
    }
    tansu_path().parent().unwrap().parent().unwrap().join("venv/bin/envoy")
}

/// grpcurl, from `RATELIMITD_GRPCURL` or the tools cache.
pub fn grpcurl_path() -> PathBuf {
    if let Some(path) = std::env::var_os("RATELIMITD_GRPCURL") {
        return PathBuf::from(path);
    }
    tansu_path().parent().unwrap().parent().unwrap().join("venv/bin/grpcurl")
}

/// Envoy (one worker, warnings only) on the config `render(listen, admin)`
/// returns, written to `envoy.yaml` in `dir`; its log goes to `envoy.log`
/// there. Returns the child and `listen` once Envoy accepts connections on it.
pub fn start_envoy(dir: &Path, render: impl Fn(u16, u16) -> String) -> (Child, u16) {
    let envoy = envoy_path();
    assert!(envoy.exists(), "{} not found: run scripts/install-tools", envoy.display());
    let (config, log) = (dir.join("envoy.yaml"), dir.join("envoy.log"));
    start_listening("envoy", &log, |listen| {
        std::fs::write(&config, render(listen, free_port())).unwrap();
        let mut command = Command::new(&envoy);
        command.arg("-c").arg(&config).args(["--disable-hot-restart", "--concurrency", "1", "-l", "warning"]);
        command
    })
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

/// A real Kafka-protocol broker (tansu) on a free loopback port, storing in
/// sqlite inside a temporary directory so a restart keeps topics and data.
/// Killed by PID on drop.
#[derive(Debug)]
pub struct Broker {
    child: Option<Child>,
    pub port: u16,
    dir: tempfile::TempDir,
    /// `--authentication`: clients must authenticate (SASL).
    authentication: bool,
    /// The port the broker tells clients to connect to (its own, unless a
    /// proxy fronts it).
    advertised: u16,
}

impl Broker {
    pub fn start() -> Self {
        let tansu = tansu_path();
        assert!(
            tansu.exists(),
            "{} not found: run scripts/install-tools (it builds tansu once into a cache)",
            tansu.display()
        );
        for _ in 0..5 {
            let port = free_port();
            let mut broker = Broker {
                child: None,
                port,
                dir: tempfile::tempdir().unwrap(),
                authentication: false,
                advertised: port,
            };
            if broker.spawn() {
                return broker;
            }
        }
        panic!("could not start tansu on a free port");
    }

    fn spawn(&mut self) -> bool {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let advertised = format!("tcp://127.0.0.1:{}", self.advertised);
        let child = Command::new(tansu_path())
            .args(["broker", "--listener-url", &url, "--advertised-listener-url", &advertised])
            .args(["--storage-engine", "sqlite://tansu.db"])
            .args(self.authentication.then_some("--authentication"))
            .current_dir(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tansu");
        let port = self.port;
        self.child = wait_ready(child, Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        self.child.is_some()
    }

    /// `127.0.0.1:<port>`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Creates SCRAM-SHA-512 user `name` (with `tansu user create`), then
    /// restarts the broker requiring authentication.
    pub fn require_scram_user(&mut self, name: &str, password: &str) {
        let out = Command::new(tansu_path())
            .args(["user", "create", "--broker", &format!("tcp://127.0.0.1:{}", self.port), name, password])
            .args(["--mechanism", "scram512"])
            .stdin(Stdio::null())
            .output()
            .expect("run tansu user create");
        assert!(out.status.success(), "tansu user create: {}", String::from_utf8_lossy(&out.stderr));
        self.authentication = true;
        self.restart();
    }

    /// Restarts the broker telling clients to connect to `port` (a proxy in
    /// front of it) instead of its own.
    pub fn advertise(&mut self, port: u16) {
        self.advertised = port;
        self.restart();
    }

    /// Kills the broker (SIGKILL): Kafka is gone, abruptly.
    pub fn stop(&mut self) {
        kill(&mut self.child);
    }

    /// Starts it again on the same port with the same data.
    pub fn restart(&mut self) {
        self.stop();
        assert!(self.spawn(), "tansu did not come back on port {}", self.port);
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Points `config` at `broker` with a topic name unique to the test.
pub fn kafka_config(config: &mut Config, broker: &Broker, spool: &Path) {
    config.dlq.kafka.brokers = Some(broker.brokers());
    config.dlq.kafka.topic = "ratelimit.dlq.test".to_owned();
    config.dlq.kafka.partitions = 3;
    config.dlq.kafka.replication_factor = 1;
    config.dlq.kafka.flush_timeout_ms = 2_000;
    config.dlq.spool_dir = spool.to_path_buf();
    // These tests prove delivery one record per failed decision; folding a
    // flood into aggregates is tested on its own (tests/dlq.rs).
    config.dlq.aggregate_after = u32::MAX;
}

/// Every record on the configured topic, read with the audit reader.
pub fn topic_records(config: &Config) -> Vec<ratelimitd::dlq::FailureRecord> {
    use ratelimitd::dlq::audit::{Filter, Format, Printer};
    let mut out = Vec::new();
    let mut printer = Printer::new(&mut out, Format::Json, Filter::default());
    ratelimitd::dlq::audit::from_kafka(
        config.dlq.kafka.brokers.as_deref().unwrap(),
        &config.dlq.kafka.topic,
        &config.dlq.kafka.properties,
        &mut printer,
    )
    .expect("audit the topic");
    printer.finish(&mut std::io::sink()).unwrap();
    String::from_utf8(out).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// One HTTP/1.1 GET; returns the status and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(stream, "GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = Vec::new();
    stream.read_to_end(&mut response).unwrap();
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, body.to_owned())
}

// Certificates for the TLS tests, made by the `openssl` command line.

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl").current_dir(dir).args(args).output().expect("run openssl");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA (`<name>.pem`, `<name>.key`) in `dir`.
pub fn make_ca(dir: &Path, name: &str) {
    let (key, pem, subject) = (format!("{name}.key"), format!("{name}.pem"), format!("/CN={name}"));
    let mut args = vec!["req", "-x509"];
    args.extend(NEW_EC_KEY);
    args.extend(["-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subject]);
    openssl(dir, &args);
}

/// `openssl req` arguments for a new P-256 key, unencrypted.
const NEW_EC_KEY: [&str; 5] = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"];

/// A leaf certificate `<name>.pem` / `<name>.key` signed by CA `ca`, for
/// `usage` (`serverAuth` or `clientAuth`).
pub fn make_leaf(dir: &Path, ca: &str, name: &str, usage: &str) {
    make_leaf_for(dir, ca, name, usage, "DNS:localhost,IP:127.0.0.1");
}

/// [`make_leaf`] with the subject alternative names `san` (openssl's form).
pub fn make_leaf_for(dir: &Path, ca: &str, name: &str, usage: &str, san: &str) {
    let (key, csr, subject) = (format!("{name}.key"), format!("{name}.csr"), format!("/CN={name}"));
    let mut args = vec!["req"];
    args.extend(NEW_EC_KEY);
    args.extend(["-keyout", &key, "-out", &csr, "-subj", &subject]);
    openssl(dir, &args);
    let ext = dir.join(format!("{name}.ext"));
    std::fs::write(
        &ext,
        format!("subjectAltName={san}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n"),
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            &format!("{ca}.pem"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{name}.pem"),
            "-days",
            "2",
            "-extfile",
            ext.to_str().unwrap(),
        ],
    );
}
