//! The service under test: rule files, configurations, the real server on
//! `127.0.0.1:0` with a generated client, and helpers to ask it.

#[allow(unused_imports)]
use super::*;

/// The records in a DLQ file (none if it does not exist).
pub fn read_dlq(path: &Path) -> Vec<ratelimitd::dlq::FailureRecord> {
    match std::fs::read_to_string(path) {
        Ok(text) => text.lines().map(|l| serde_json::from_str(l).expect("a valid record line")).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("{}: {e}", path.display()),
    }
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
    config.redis.connection.url = redis_url;
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
        if config.local.state_dir == ratelimitd::config::LocalConfig::default().state_dir {
            config.local.state_dir = dir.path().join("local");
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

    /// A client connecting from the loopback address `from` (any of
    /// 127.0.0.0/8: another peer to the server).
    #[allow(dead_code)]
    pub async fn client_from(&self, from: &str) -> RateLimiterClient<Channel> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .local_address(Some(from.parse().unwrap()))
            .connect()
            .await
            .unwrap();
        RateLimiterClient::new(channel)
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

/// A `ShouldRateLimit` of one hit on one descriptor of one entry,
/// `key=value`, in `domain`.
pub fn rls_request(domain: &str, key: &str, value: &str) -> ratelimitd::api::envoy_pb::rls::RateLimitRequest {
    use ratelimitd::api::envoy_pb::envoy::extensions::common::ratelimit::v3::{
        RateLimitDescriptor, rate_limit_descriptor::Entry,
    };
    ratelimitd::api::envoy_pb::rls::RateLimitRequest {
        domain: domain.to_owned(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry { key: key.to_owned(), value: value.to_owned() }],
            ..Default::default()
        }],
        hits_addend: 1,
    }
}

/// Calls Check and unwraps the response.
pub async fn check(
    client: &mut RateLimiterClient<Channel>,
    request: pb::RateLimitRequest,
) -> pb::RateLimitResponse {
    client.check(request).await.expect("Check failed").into_inner()
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

/// CRITICAL /play and BULK /bulk at `play` and `bulk` a minute per user.
pub fn play_and_bulk_rules(play: u32, bulk: u32) -> String {
    format!(
        "rules:\n  - {{ rule_id: play, resource_path: /play, priority_bucket: CRITICAL, limit: {play}, window_seconds: 60 }}\n  - {{ rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: {bulk}, window_seconds: 60 }}\n"
    )
}

/// Serves the rules at `rules` with every request captured to `file`:
/// three users' 8 CRITICAL /play requests each (each one allowed) and 8
/// BULK /bulk requests.
pub async fn capture_play_and_bulk(rules: &Path, file: &Path) {
    let mut cfg = config(rules, None);
    cfg.capture.sample_ratio = 1.0;
    cfg.capture.salt = Some("a secret shared by the fleet".to_owned());
    cfg.capture.file = file.to_path_buf();
    let server = TestServer::start(cfg).await;
    let mut client = server.client().await;
    for user in ["a", "b", "c"] {
        for _ in 0..8 {
            assert!(check(&mut client, request(user, "/play")).await.allowed);
        }
    }
    for _ in 0..8 {
        let mut bulk = request("a", "/bulk");
        bulk.priority = ratelimitd::api::pb::PriorityBucket::Bulk as i32;
        check(&mut client, bulk).await;
    }
    server.stop().await.unwrap();
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

/// The service as it ships (`ratelimitd serve`, its own allocator) in a
/// process of its own: gRPC on a fresh loopback port, the HTTP port on any
/// unless `env` names one, no shedding, its state and log
/// (`service.log`) in `dir`; `env` adds or overrides settings. Its process
/// (stopped when dropped) and gRPC port.
pub fn spawn_service(dir: &Path, env: &[(&str, String)]) -> (Process, u16) {
    let (child, port) = start_listening("ratelimitd", &dir.join("service.log"), |port| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_ratelimitd"));
        command
            .arg("serve")
            .env_clear()
            .env("RATELIMITD__GRPC__LISTEN", format!("127.0.0.1:{port}"))
            .env("RATELIMITD__HTTP__LISTEN", "127.0.0.1:0")
            .env("RATELIMITD__SHED__MODE", "off")
            .env("STATE_DIRECTORY", dir.join(format!("state-{port}")))
            .envs(env.iter().map(|(key, value)| (*key, value.as_str())));
        command
    });
    (Process(child), port)
}

/// Two services started from their configuration (`region`, `global.*`),
/// each in its region with its own Redis, sharing a coordination store;
/// `tune` adds the rules.
pub async fn two_regions(
    tune: impl Fn(&mut ratelimitd::config::Config),
) -> (Vec<TestServer>, Vec<RedisServer>) {
    deployments(&["a", "b"], tune).await
}

/// A service for each of `regions` (a name given twice: two deployments
/// calling themselves that region), each with its own Redis, the regions
/// a and b sharing a coordination store; `tune` adds the rules. Returns
/// the services in that order and the stores.
pub async fn deployments(
    regions: &[&str],
    tune: impl Fn(&mut ratelimitd::config::Config),
) -> (Vec<TestServer>, Vec<RedisServer>) {
    use ratelimitd::global::RegionConfig;
    let coordination = RedisServer::start();
    let (mut servers, mut stores) = (Vec::new(), vec![coordination]);
    for name in regions {
        let redis = RedisServer::start();
        let mut config = default_rules_config(Some(redis.url()));
        tune(&mut config);
        config.region = Some((*name).to_owned());
        config.global.regions =
            ["a", "b"].iter().map(|n| RegionConfig { name: (*n).to_owned(), floor: 0.05 }).collect();
        config.global.redis.url = Some(stores[0].url());
        (config.global.interval_ms, config.global.lease_ms) = (200, 1_500);
        (config.global.timeout_ms, config.global.skew_ms) = (500, 100);
        servers.push(TestServer::start(config).await);
        stores.push(redis);
    }
    (servers, stores)
}
