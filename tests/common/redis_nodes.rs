//! Real `redis-server` processes on free loopback ports: one node, a
//! three-primary cluster, a Sentinel setup; `redis-server` is installed
//! from Debian's packages when missing.

#[allow(unused_imports)]
use super::*;

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

    /// Stops the process where it is (SIGSTOP): its connections stay open
    /// and nothing is answered, a hung Redis, until [`resume`](Self::resume).
    #[allow(dead_code)]
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Lets a paused process go on (SIGCONT), its data as it was.
    #[allow(dead_code)]
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("redis-server running").id().to_string();
        let status = std::process::Command::new("kill").args([signal, &pid]).status().expect("kill");
        assert!(status.success(), "kill {signal} {pid}");
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

    /// Each node's port.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|n| n.port).collect()
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
/// `CONFIG SET parameter value` on the servers listening on `ports`.
pub fn redis_config_set(ports: &[u16], parameter: &str, value: &str) {
    for &port in ports {
        let answer = redis_cli(port, &["config", "set", parameter, value]);
        assert_eq!(answer.trim(), "OK", "CONFIG SET {parameter} {value} on port {port}");
    }
}

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
