//! A real Kafka-protocol broker (tansu) on a free loopback port, and what
//! the dead-letter tests read from it.

#[allow(unused_imports)]
use super::*;

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
