//! The connections: one server through a deadpool pool, Sentinel through
//! deadpool's sentinel pool, a Cluster through redis-rs' cluster client;
//! their setup from `redis.*`, their circuit breakers, and how their errors
//! are classified.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use arc_swap::ArcSwapOption;

use deadpool_redis::{
    Pool, PoolConfig, PoolError, Runtime, Timeouts,
    sentinel::{
        Manager as SentinelManager, Pool as SentinelPool, PoolError as SentinelPoolError,
        SentinelNodeConnectionInfo, SentinelServerType,
    },
};
use redis::{
    AsyncConnectionConfig, ConnectionInfo, IntoConnectionInfo, RedisError,
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    cluster_routing::{RoutingInfo, SingleNodeRoutingInfo},
};

use crate::limiter::settings::RedisConfig;
use crate::limiter::{FailureKind, StoreError, breaker::Breaker, slots::SlotMap};

/// Cluster slots per circuit breaker: 64 breakers cover the 16384 slots.
/// A primary owns whole ranges of slots, so a dead one opens its own
/// breakers; finer ranges would need more failures to open them all.
pub(super) const SLOTS_PER_BREAKER: u16 = 256;

/// Where the dispatchers get connections from.
#[derive(Clone)]
pub(super) enum Backend {
    /// One server, through a pool.
    Single(Pool),
    /// The master Redis Sentinel names, through a pool whose every new
    /// connection asks the sentinels where the master is now.
    Sentinel(SentinelPool),
    /// A Redis Cluster.
    Cluster(Arc<Cluster>),
}

/// A Redis Cluster: the client (seed nodes, timeouts, credentials), the
/// connection the readiness probe reuses between probes, and the slot map
/// batches are grouped by.
pub(super) struct Cluster {
    pub(super) client: ClusterClient,
    pub(super) connect_timeout: Duration,
    pub(super) probe: std::sync::Mutex<Option<ClusterConnection>>,
    /// Read by the readiness probe (`warm_up`), every probe, and by the
    /// dispatcher that found it stale.
    pub(super) slots: ArcSwapOption<SlotMap>,
    /// A call met a key its node did not serve: the map is not used until
    /// it is read again.
    pub(super) stale: AtomicBool,
}

impl Cluster {
    /// The slot map to group a batch by, unless there is none or it is stale.
    pub(super) fn slot_map(&self) -> Option<Arc<SlotMap>> {
        if self.stale.load(Ordering::Relaxed) { None } else { self.slots.load_full() }
    }

    /// Reads the slot map again (`CLUSTER SLOTS` on a primary).
    pub(super) async fn read_slot_map(&self, conn: &mut ClusterConnection) -> Result<(), StoreError> {
        let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::RandomPrimary);
        let answer = conn
            .route_command(redis::cmd("CLUSTER").arg("SLOTS").clone(), routing)
            .await
            .map_err(|e| classify(&e))?;
        let map = SlotMap::parse(&answer)
            .map_err(|e| StoreError { kind: FailureKind::Other, message: e.to_string() })?;
        self.slots.store(Some(Arc::new(map)));
        self.stale.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// Connects to the seed nodes and reads the slot map, within
    /// `redis.connect_timeout_ms`.
    pub(super) async fn connect(&self) -> Result<ClusterConnection, StoreError> {
        match tokio::time::timeout(self.connect_timeout, self.client.get_async_connection()).await {
            Ok(Ok(conn)) => Ok(conn),
            Ok(Err(e)) => Err(classify(&e)),
            Err(_) => Err(StoreError {
                kind: FailureKind::Timeout,
                message: format!(
                    "no redis cluster connection within {} ms",
                    self.connect_timeout.as_millis()
                ),
            }),
        }
    }
}

/// A dispatcher's connection, or one for calls outside the decision path.
pub(super) enum Conn {
    Single(Pooled),
    Cluster(ClusterConnection),
}

/// A pooled connection to one server (plain or through Sentinel).
pub(super) enum Pooled {
    Plain(deadpool_redis::Connection),
    Sentinel(deadpool_redis::sentinel::Connection),
}

impl Pooled {
    pub(super) fn connection(&mut self) -> &mut redis::aio::MultiplexedConnection {
        match self {
            Pooled::Plain(conn) => conn,
            Pooled::Sentinel(conn) => conn,
        }
    }

    /// Closes it instead of handing it back: its server no longer takes
    /// writes (a demoted master), and the pool's PING would pass it on.
    pub(super) fn discard(self) {
        match self {
            Pooled::Plain(conn) => drop(deadpool_redis::Connection::take(conn)),
            Pooled::Sentinel(conn) => drop(deadpool_redis::sentinel::Connection::take(conn)),
        }
    }
}

/// Index of the breaker guarding `slot` among `breakers` of them (one
/// against a single server: every job has slot 0 there).
pub(super) fn breaker_index(slot: u16, breakers: usize) -> usize {
    usize::from(slot / SLOTS_PER_BREAKER) % breakers
}

/// The breaker of a slot's range.
pub(super) fn breaker_of(breakers: &[Breaker], slot: u16) -> &Breaker {
    &breakers[breaker_index(slot, breakers.len())]
}

/// The connections `redis.*` asks for: a Sentinel-discovered master, a
/// Redis Cluster client, or a pool to one server. Errors are the message
/// of a [`RedisSetupError`].
pub(super) fn backend(config: &RedisConfig) -> Result<Backend, String> {
    let password = config.connection.password().map_err(|e| e.to_string())?;
    let nodes = config
        .connection
        .seed_urls()
        .map(|node| {
            let info = node.into_connection_info().map_err(|e| e.to_string())?;
            Ok(with_auth(info, config.connection.username.as_deref(), password.as_deref()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
    let tls = tls_certificates(config)?;
    if let Some(master) = &config.connection.sentinel_master {
        Ok(Backend::Sentinel(sentinel_pool(config, master, password, connect_timeout)?))
    } else if config.connection.cluster {
        cluster_backend(nodes, tls, connect_timeout)
    } else {
        single_backend(config, nodes, tls, connect_timeout)
    }
}

/// A Redis Cluster client over the seed `nodes`.
pub(super) fn cluster_backend(
    nodes: Vec<ConnectionInfo>,
    tls: Option<redis::TlsCertificates>,
    connect_timeout: Duration,
) -> Result<Backend, String> {
    let mut builder = ClusterClient::builder(nodes);
    if let Some(certs) = tls {
        builder = builder.certs(certs);
    }
    let client = builder
        .connection_timeout(connect_timeout)
        // Bounds one attempt inside the client; callers stop
        // waiting at `timeout_ms` either way.
        .response_timeout(connect_timeout)
        // A redirect (MOVED/ASK, a failover) is a retry: a few, fast.
        .retries(3)
        .min_retry_wait(1)
        .max_retry_wait(50)
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Backend::Cluster(Arc::new(Cluster {
        client,
        connect_timeout,
        probe: std::sync::Mutex::new(None),
        slots: ArcSwapOption::empty(),
        stale: AtomicBool::new(false),
    })))
}

/// A pool of connections to the one server in `nodes`.
pub(super) fn single_backend(
    config: &RedisConfig,
    nodes: Vec<ConnectionInfo>,
    tls: Option<redis::TlsCertificates>,
    connect_timeout: Duration,
) -> Result<Backend, String> {
    let [mut node] = <[ConnectionInfo; 1]>::try_from(nodes)
        .map_err(|_| "several seed nodes need redis.cluster: true".to_owned())?;
    if let Some(certs) = tls {
        // The TLS parameters become part of the connection info the
        // pool's manager connects with.
        node = redis::Client::build_with_tls(node, certs)
            .map_err(|e| e.to_string())?
            .get_connection_info()
            .clone();
    }
    // The per-call deadline is ours (`timeout_ms`); the client's own
    // response timeout would only race it.
    let connection_config =
        AsyncConnectionConfig::new().set_connection_timeout(Some(connect_timeout)).set_response_timeout(None);
    let manager =
        deadpool_redis::Manager::new_with_config(node, connection_config).map_err(|e| e.to_string())?;
    let pool = Pool::builder(manager)
        .config(pool_config(config, connect_timeout))
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Backend::Single(pool))
}

/// The sizing and timeouts of a pool, one server's or Sentinel's master's:
/// one connection per dispatcher, one for `warm_up` (the readiness probe),
/// and room for a replacement while a broken one is dropped; creating,
/// waiting for and recycling a connection each bounded by the connect
/// timeout (handing out a returned connection PINGs it first, and a peer
/// that stopped answering must not hang a dispatcher in that PING).
fn pool_config(config: &RedisConfig, connect_timeout: Duration) -> PoolConfig {
    let bound = Some(connect_timeout);
    PoolConfig {
        timeouts: Timeouts { wait: bound, create: bound, recycle: bound },
        ..PoolConfig::new(config.connections * 2 + 1)
    }
}

/// The circuit breakers: one for a server, one per range of slots for a cluster.
pub(super) fn breakers(config: &RedisConfig, backend: &Backend) -> Arc<[Breaker]> {
    let open = Duration::from_millis(config.breaker_open_ms);
    let min_failing = Duration::from_millis(config.breaker_min_failing_ms);
    match backend {
        Backend::Single(_) | Backend::Sentinel(_) => {
            Arc::new([Breaker::new(config.breaker_failures, min_failing, open, "redis".to_owned())])
        }
        Backend::Cluster(_) => (0..16_384 / SLOTS_PER_BREAKER)
            .map(|range| {
                let first = range * SLOTS_PER_BREAKER;
                let scope = format!("redis cluster slots {first}-{}", first + SLOTS_PER_BREAKER - 1);
                Breaker::new(config.breaker_failures, min_failing, open, scope)
            })
            .collect(),
    }
}

/// The private CA and client certificate of `redis.tls_*`, if any is set.
pub(super) fn tls_certificates(config: &RedisConfig) -> Result<Option<redis::TlsCertificates>, String> {
    let read = |key: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("{key} {}: {e}", path.display()))
    };
    let root_cert = match &config.connection.tls_ca_file {
        Some(path) => Some(read("redis.tls_ca_file", path)?),
        None => None,
    };
    let client_tls = match (&config.connection.tls_cert_file, &config.connection.tls_key_file) {
        (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
            client_cert: read("redis.tls_cert_file", cert)?,
            client_key: read("redis.tls_key_file", key)?,
        }),
        _ => None,
    };
    Ok((root_cert.is_some() || client_tls.is_some())
        .then_some(redis::TlsCertificates { client_tls, root_cert }))
}

/// The pool of connections to the master `master` the sentinels in
/// `redis.url` name; `password` is the master's.
pub(super) fn sentinel_pool(
    config: &RedisConfig,
    master: &str,
    password: Option<String>,
    connect_timeout: Duration,
) -> Result<SentinelPool, String> {
    let sentinels = config
        .connection
        .seed_urls()
        .map(|url| {
            let info = url.into_connection_info().map_err(|e| e.to_string())?;
            Ok(with_auth(info, None, config.connection.sentinel_password.as_deref()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let node = SentinelNodeConnectionInfo {
        tls_mode: None,
        redis_connection_info: Some(deadpool_redis::RedisConnectionInfo {
            username: config.connection.username.clone(),
            password,
            ..Default::default()
        }),
    };
    let manager = SentinelManager::new(sentinels, master.to_owned(), Some(node), SentinelServerType::Master)
        .map_err(|e| e.to_string())?;
    deadpool_redis::sentinel::Pool::builder(manager)
        .config(pool_config(config, connect_timeout))
        .runtime(Runtime::Tokio1)
        .build()
        .map_err(|e| e.to_string())
}

/// Sets the AUTH user and password given (`redis.username`,
/// `redis.password` or `redis.password_file`) on a node's connection
/// info; the URL's own are kept otherwise.
pub(super) fn with_auth(
    info: ConnectionInfo,
    username: Option<&str>,
    password: Option<&str>,
) -> ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if let Some(username) = username {
        settings = settings.set_username(username);
    }
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    info.set_redis_settings(settings)
}

pub(super) fn classify(e: &RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        FailureKind::Timeout
    } else if e.is_connection_refusal() {
        FailureKind::ConnectionRefused
    } else if e.is_connection_dropped() || e.is_io_error() {
        FailureKind::ConnectionLost
    } else if e.is_cluster_error() {
        FailureKind::ClusterError
    } else if e.code() == Some("OOM") {
        // maxmemory reached under `noeviction`: full, as a memory store can be.
        FailureKind::StoreFull
    } else if matches!(e.kind(), redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)) {
        // A demoted master: not the script's fault.
        FailureKind::Other
    } else if matches!(e.kind(), redis::ErrorKind::Server(_) | redis::ErrorKind::UnexpectedReturnType) {
        FailureKind::ScriptError
    } else {
        FailureKind::Other
    };
    StoreError { kind, message: e.to_string() }
}

impl Backend {
    /// A pooled connection to the one server (the master, through
    /// Sentinel). A cluster has no pool.
    pub(super) async fn pooled(&self) -> Result<Pooled, StoreError> {
        match self {
            Backend::Single(pool) => pool.get().await.map(Pooled::Plain).map_err(|e| classify_pool(&e)),
            Backend::Sentinel(pool) => {
                pool.get().await.map(Pooled::Sentinel).map_err(|e| classify_sentinel_pool(&e))
            }
            Backend::Cluster(_) => {
                Err(StoreError { kind: FailureKind::Other, message: "no pool".to_owned() })
            }
        }
    }
}

pub(super) fn classify_sentinel_pool(e: &SentinelPoolError) -> StoreError {
    match e {
        SentinelPoolError::Backend(e) => classify(e),
        SentinelPoolError::Timeout(_) => {
            StoreError { kind: FailureKind::PoolExhausted, message: e.to_string() }
        }
        _ => StoreError { kind: FailureKind::Other, message: e.to_string() },
    }
}

pub(super) fn classify_pool(e: &PoolError) -> StoreError {
    match e {
        PoolError::Backend(e) => classify(e),
        PoolError::Timeout(_) => StoreError { kind: FailureKind::PoolExhausted, message: e.to_string() },
        _ => StoreError { kind: FailureKind::Other, message: e.to_string() },
    }
}
