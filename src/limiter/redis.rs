//! The Redis counter store: one Lua script (`scripts/decide_batch.lua`),
//! called by SHA and reloaded on NOSCRIPT; one 32-byte string per counter, at
//! `rl2:{<user_id>}:<rule_id>` (Check) or `rle2:{<domain>}:<key>` (Envoy):
//! key-schema version 2, laid out in the script and in ARCHITECTURE.md.
//!
//! Decisions are coalesced. Each of `redis.connections` slots has one
//! dispatcher task that owns a connection: a decision queues a job on a
//! slot and awaits its answer; the dispatcher sends everything queued as
//! one script call, and whatever arrives while that call is in flight
//! becomes the next call. An idle service therefore sends a lone decision
//! at once, and a busy one pays Redis' per-command costs (parsing, script
//! start, TIME, the round trip, the syscalls on both ends) once per batch
//! instead of once per decision, and reads and writes a hot counter once
//! per batch. Jobs in a batch run in order inside one atomic script, so the
//! result is exactly that of running them one after another.
//!
//! Against one server, connections come from a deadpool-redis pool, which
//! creates them under `redis.connect_timeout_ms` and health-checks (PINGs)
//! one before handing it out again; a dispatcher whose call failed on the
//! connection returns it and takes a fresh one for its next batch.
//!
//! Against a Redis Cluster (`redis.cluster`), each dispatcher owns one
//! multiplexed cluster connection (redis-rs follows MOVED/ASK, refreshes
//! its slot map and reconnects to nodes that come back). Every key of a job
//! shares one hash tag (`{<user_id>}` or `{<domain>}`), so a job never
//! spans slots. A dispatcher splits what it took from its queue by node
//! (by the [`SlotMap`] the readiness probe reads with `CLUSTER SLOTS`),
//! sorted by slot inside (stable: jobs on one counter keep their order), and
//! sends one call per node, all at once. A call that carries several slots
//! passes its keys inline rather than as declared keys (declared keys must
//! share one slot) and reads them one `MGET` per slot; it goes to the
//! primary serving its first slot. When the map is stale (a resharding, a
//! failover), the node refuses the call at its first key it does not serve,
//! before any write: those jobs are sent again one call per slot (declared
//! keys, routed and redirected by redis-rs), and the map is read again
//! (calls go per slot until it is). Without a map, calls are per slot.
//! The circuit breaker is kept per range of 256 slots: a dead primary opens
//! the breakers of its ranges, and the other primaries' slots keep deciding.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use arc_swap::ArcSwapOption;

use deadpool_redis::{
    Pool, PoolError, Runtime,
    sentinel::{
        Manager as SentinelManager, Pool as SentinelPool, PoolError as SentinelPoolError,
        SentinelNodeConnectionInfo, SentinelServerType,
    },
};
use redis::{
    AsyncConnectionConfig, ConnectionInfo, IntoConnectionInfo, RedisError, Value,
    cluster::ClusterClient,
    cluster_async::ClusterConnection,
    cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr},
};
use tokio::{
    sync::{Semaphore, SemaphorePermit, mpsc, oneshot},
    task::JoinSet,
};

use super::settings::{RedisConfig, redact_url};
use super::{
    Count, CounterSpec, FailureKind, ManyItem, ManyOutcome, Seen, Shares, StoreError,
    breaker::{Admission, Breaker},
    bucket::MAX_DEBT,
    many_verdicts,
    slots::{SlotMap, group_key},
    window::{Algorithm, Counts, Verdict, WindowParams, max_count, position},
};

const DECIDE_BATCH_LUA: &str = include_str!("scripts/decide_batch.lua");

/// Most jobs in one script call. Bounds the time one call holds Redis (a
/// script blocks every other client while it runs): at ~1 µs of Lua per key,
/// 256 single-key jobs hold it for about a quarter of a millisecond.
const MAX_BATCH: usize = 256;

/// Most jobs waiting per slot. A job waits at most `redis.timeout_ms`, so
/// the queue only fills when Redis is far slower than the offered load; a
/// decision that finds it full is answered at once by its failure policy
/// (`pool_exhausted`) instead of queueing without bound.
const QUEUE_PER_SLOT: usize = 4_096;

/// The parameters a counter shares with every counter of its rule: window
/// (ticks), capacity, tick (ms), flags (algorithm code + 4 if shadow + 8 ×
/// count code), rate. A script call sends each distinct spec once.
type Spec = [u64; 5];

/// One counter's script arguments: its spec and the request's weight.
#[derive(Debug, Clone, Copy)]
struct KeyArgs {
    spec: Spec,
    weight: u64,
}

/// The flags argument of a counter: its algorithm's code, plus 4 when
/// shadow, plus 8 times how it counts ([`Count::code`]).
fn flags(params: WindowParams, shadow: bool, count: Count) -> u64 {
    params.algorithm.code() | (u64::from(shadow) << 2) | (count.code() << 3)
}

impl KeyArgs {
    /// Its algorithm, from the flags ([`flags`]).
    fn algorithm(&self) -> Algorithm {
        Algorithm::ALL[(self.spec[3] & 3) as usize]
    }
}

/// How many values the script answers for a counter of `algorithm`:
/// whether it fits, then a bucket's debt or a window's current and
/// previous counts.
fn answer_len(algorithm: Algorithm) -> usize {
    if algorithm.is_bucket() { 2 } else { 3 }
}

/// What the script answered for one counter (`values`, [`answer_len`] of
/// them): whether it fits, and what it saw, checked against the
/// counter's parameters. A window's elapsed ticks follow from Redis' clock
/// `now_ms` (the script's answer starts with it) and the tick, as the
/// script derives them.
fn seen_of(
    values: &[u64],
    now_ms: u64,
    tick_ms: u64,
    params: WindowParams,
) -> Result<(bool, Seen), StoreError> {
    let seen = match (params.algorithm.is_bucket(), values) {
        (true, &[_, debt]) => {
            if debt > MAX_DEBT {
                return Err(script_error(format!("debt {debt} beyond the largest debt {MAX_DEBT}")));
            }
            Seen::Bucket { debt }
        }
        (false, &[_, current, previous]) => {
            let max = max_count(params.window_ms);
            if current > max || previous > max {
                return Err(script_error(format!(
                    "counts {current}, {previous} beyond the largest count {max}"
                )));
            }
            let (_, elapsed) = position(now_ms / tick_ms.max(1), params.window_ms);
            Seen::Window { counts: Counts { current, previous }, elapsed }
        }
        _ => return Err(script_error(format!("script answered {} values for one counter", values.len()))),
    };
    Ok((values[0] == 1, seen))
}

/// Cluster slots per circuit breaker: 64 breakers cover the 16384 slots.
/// A primary owns whole ranges of slots, so a dead one opens its own
/// breakers; finer ranges would need more failures to open them all.
const SLOTS_PER_BREAKER: u16 = 256;

/// One decision waiting for its batch.
struct Job {
    /// Its cluster slot (0 against one server).
    slot: u16,
    keys: JobKeys,
    reply: oneshot::Sender<Result<Vec<u64>, StoreError>>,
}

/// A job's counters. `One` spares the single-key Check path a vector.
enum JobKeys {
    One([(String, KeyArgs); 1]),
    Many(Vec<(String, KeyArgs)>),
}

impl JobKeys {
    fn as_slice(&self) -> &[(String, KeyArgs)] {
        match self {
            JobKeys::One(key) => key,
            JobKeys::Many(keys) => keys,
        }
    }
}

/// Where the dispatchers get connections from.
#[derive(Clone)]
enum Backend {
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
struct Cluster {
    client: ClusterClient,
    connect_timeout: Duration,
    probe: std::sync::Mutex<Option<ClusterConnection>>,
    /// Read by the readiness probe (`warm_up`), every probe, and by the
    /// dispatcher that found it stale.
    slots: ArcSwapOption<SlotMap>,
    /// A call met a key its node did not serve: the map is not used until
    /// it is read again.
    stale: AtomicBool,
}

impl Cluster {
    /// The slot map to group a batch by, unless there is none or it is stale.
    fn slot_map(&self) -> Option<Arc<SlotMap>> {
        if self.stale.load(Ordering::Relaxed) { None } else { self.slots.load_full() }
    }

    /// Reads the slot map again (`CLUSTER SLOTS` on a primary).
    async fn read_slot_map(&self, conn: &mut ClusterConnection) -> Result<(), StoreError> {
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
    async fn connect(&self) -> Result<ClusterConnection, StoreError> {
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
enum Conn {
    Single(Pooled),
    Cluster(ClusterConnection),
}

/// A pooled connection to one server (plain or through Sentinel).
enum Pooled {
    Plain(deadpool_redis::Connection),
    Sentinel(deadpool_redis::sentinel::Connection),
}

impl Pooled {
    fn connection(&mut self) -> &mut redis::aio::MultiplexedConnection {
        match self {
            Pooled::Plain(conn) => conn,
            Pooled::Sentinel(conn) => conn,
        }
    }

    /// Closes it instead of handing it back: its server no longer takes
    /// writes (a demoted master), and the pool's PING would pass it on.
    fn discard(self) {
        match self {
            Pooled::Plain(conn) => drop(deadpool_redis::Connection::take(conn)),
            Pooled::Sentinel(conn) => drop(deadpool_redis::sentinel::Connection::take(conn)),
        }
    }
}

/// Counters in one Redis server or a Redis Cluster.
pub struct RedisStore {
    backend: Backend,
    queues: Box<[mpsc::Sender<Job>]>,
    next_slot: AtomicUsize,
    script: Arc<redis::Script>,
    timeout: Duration,
    /// One against a single server; one per [`SLOTS_PER_BREAKER`] slots
    /// against a cluster.
    breakers: Arc<[Breaker]>,
    url_for_logs: String,
    /// `redis.key_prefix`, before every key (upstream's `CACHE_KEY_PREFIX`).
    key_prefix: Box<str>,
    /// Calls that waited for their connection's share ([`RedisStore::permits`]).
    connection_waits: AtomicU64,
    /// Calls that waited for their tenant's share.
    tenant_waits: AtomicU64,
    /// Calls that waited for their peer's share.
    peer_waits: AtomicU64,
}

/// Calls that waited for a share of the in-flight calls, by share.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShareWaits {
    /// For their connection's (`grpc.max_store_calls_per_connection`).
    pub connection: u64,
    /// For their tenant's (`grpc.max_store_calls_per_tenant`).
    pub tenant: u64,
    /// For their peer's (`grpc.max_store_calls_per_peer`).
    pub peer: u64,
}

/// A permit of `share` once one is free (a wait counted in `waits`); none
/// without a share.
async fn permit<'s>(share: Option<&'s Semaphore>, waits: &AtomicU64) -> Option<SemaphorePermit<'s>> {
    let share = share?;
    match share.try_acquire() {
        Ok(permit) => Some(permit),
        Err(_) => {
            waits.fetch_add(1, Ordering::Relaxed);
            share.acquire().await.ok()
        }
    }
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.url_for_logs)
            .field("cluster", &matches!(self.backend, Backend::Cluster(_)))
            .field("sentinel", &matches!(self.backend, Backend::Sentinel(_)))
            .field("slots", &self.queues.len())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The store could not be set up (a malformed URL; reachability is not
/// required at startup: decisions follow the failure policy until it is).
#[derive(Debug, thiserror::Error)]
#[error("redis.url {url}: {message}")]
pub struct RedisSetupError {
    url: String,
    message: String,
}

impl RedisStore {
    /// Builds the pool (or the cluster client) from `redis.url` and spawns
    /// one dispatcher task per connection into `tasks` (so it must be called
    /// inside a Tokio runtime), whose owner joins them. Does not connect: see
    /// [`RedisStore::warm_up`]. The dispatchers end once the store is
    /// dropped and their queued jobs are answered.
    pub fn new(config: &RedisConfig, tasks: &mut JoinSet<()>) -> Result<Self, RedisSetupError> {
        let url = config.url.as_deref().unwrap_or_default();
        let setup_error = |message: String| RedisSetupError { url: redact_url(url), message };
        let backend = backend(config).map_err(setup_error)?;
        let script = Arc::new(redis::Script::new(DECIDE_BATCH_LUA));
        let timeout = Duration::from_millis(config.timeout_ms);
        let breakers = breakers(config, &backend);
        let queues = (0..config.connections)
            .map(|slot| {
                let (sender, receiver) = mpsc::channel(QUEUE_PER_SLOT);
                let dispatcher = Dispatcher {
                    slot,
                    backend: backend.clone(),
                    script: Arc::clone(&script),
                    timeout,
                    breakers: Arc::clone(&breakers),
                    caps: CallCaps {
                        keys: config.max_keys_per_call,
                        key_bytes: config.max_key_bytes_per_call,
                    },
                };
                tasks.spawn(dispatcher.run(receiver));
                sender
            })
            .collect();
        Ok(RedisStore {
            backend,
            queues,
            next_slot: AtomicUsize::new(0),
            script,
            timeout,
            breakers,
            url_for_logs: redact_url(url),
            key_prefix: config.key_prefix.as_str().into(),
            connection_waits: AtomicU64::new(0),
            tenant_waits: AtomicU64::new(0),
            peer_waits: AtomicU64::new(0),
        })
    }

    /// The circuit breakers (one, or one per range of cluster slots), for
    /// the readiness monitor: it reads them and closes them when its probe
    /// finds Redis answering. Holding them keeps no dispatcher alive.
    pub fn breakers(&self) -> Arc<[Breaker]> {
        Arc::clone(&self.breakers)
    }

    /// The URL with any password masked.
    pub fn url_for_logs(&self) -> &str {
        &self.url_for_logs
    }

    /// Checks within `timeout` that Redis answers, and loads the script so
    /// the first decision does not meet NOSCRIPT; in a cluster, also reads
    /// the slot map. Used at startup and by the readiness probe to say
    /// whether Redis is up; a failure is not fatal.
    pub async fn warm_up(&self, timeout: Duration) -> Result<(), StoreError> {
        let load = async {
            let mut conn = self.side_connection().await?;
            let loaded: Result<String, RedisError> = match &mut conn {
                // SCRIPT LOAD goes to every primary of a cluster.
                Conn::Single(conn) => self.script.load_async(conn.connection()).await,
                Conn::Cluster(conn) => self.script.load_async(conn).await,
            };
            if let (Ok(_), Backend::Cluster(cluster), Conn::Cluster(conn)) =
                (&loaded, &self.backend, &mut conn)
                && let Err(error) = cluster.read_slot_map(conn).await
            {
                // The last map read stays in use (per slot if none: exact,
                // only more calls) until a probe reads it.
                tracing::debug!(%error, "redis cluster slot map not read; calls go per slot");
            }
            self.keep(conn, loaded.is_ok());
            loaded.map(drop).map_err(|e| classify(&e))
        };
        match tokio::time::timeout(timeout, load).await {
            Ok(result) => result,
            Err(_) => Err(timeout_error(timeout)),
        }
    }

    /// A permit of each of a caller's `shares` of the in-flight calls,
    /// once one is free: the tenant's first, then the peer's, then the connection's (every
    /// call takes them in this order, so none holds one while another
    /// waits for it the other way round). A wait is counted
    /// ([`RedisStore::share_waits`]) and is the rare path.
    pub async fn permits<'s>(&self, shares: Shares<'s>) -> [Option<SemaphorePermit<'s>>; 3] {
        let tenant = permit(shares.tenant, &self.tenant_waits).await;
        let peer = permit(shares.caller.and_then(|caller| caller.peer.as_deref()), &self.peer_waits).await;
        let connection = permit(shares.caller.map(|caller| &caller.connection), &self.connection_waits).await;
        [tenant, peer, connection]
    }

    /// Calls that waited for their connection's and their tenant's share
    /// of the in-flight calls.
    pub fn share_waits(&self) -> ShareWaits {
        ShareWaits {
            connection: self.connection_waits.load(Ordering::Relaxed),
            tenant: self.tenant_waits.load(Ordering::Relaxed),
            peer: self.peer_waits.load(Ordering::Relaxed),
        }
    }

    /// `redis.key_prefix`: what every key this service writes starts with.
    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// Runs `pipeline` outside the decision path (the overload layer's
    /// feed) within `timeout`, on the connection the readiness probe uses:
    /// a pooled one, or the kept cluster connection (then all of the
    /// pipeline's keys must share one hash slot).
    pub async fn pipeline<T: redis::FromRedisValue>(
        &self,
        pipeline: &redis::Pipeline,
        timeout: Duration,
    ) -> Result<T, StoreError> {
        let run = async {
            let mut conn = self.side_connection().await?;
            let answer: Result<T, RedisError> = match &mut conn {
                Conn::Single(conn) => pipeline.query_async(conn.connection()).await,
                Conn::Cluster(conn) => pipeline.query_async(conn).await,
            };
            self.keep(conn, answer.is_ok());
            answer.map_err(|e| classify(&e))
        };
        match tokio::time::timeout(timeout, run).await {
            Ok(result) => result,
            Err(_) => Err(timeout_error(timeout)),
        }
    }

    /// A connection for calls outside the decision path.
    async fn side_connection(&self) -> Result<Conn, StoreError> {
        match &self.backend {
            Backend::Single(_) | Backend::Sentinel(_) => self.backend.pooled().await.map(Conn::Single),
            Backend::Cluster(cluster) => {
                let kept = cluster.probe.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
                match kept {
                    Some(conn) => Ok(Conn::Cluster(conn)),
                    None => cluster.connect().await.map(Conn::Cluster),
                }
            }
        }
    }

    /// Keeps a cluster connection that worked for the next side call; one
    /// that failed is dropped, so the next starts from the seed nodes. (A
    /// pooled connection goes back to its pool.)
    fn keep(&self, conn: Conn, worked: bool) {
        if let (Backend::Cluster(cluster), Conn::Cluster(conn)) = (&self.backend, conn) {
            let mut probe = cluster.probe.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            *probe = worked.then_some(conn);
        }
    }

    /// Decides one request (one counter) within `redis.timeout_ms`,
    /// counting it as `count` says.
    pub async fn decide(
        &self,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> Result<Verdict, StoreError> {
        let params = counter.window;
        let args = KeyArgs {
            spec: [params.window_ms, params.capacity, 1, flags(params, false, count), params.rate],
            weight,
        };
        let reply =
            self.run(JobKeys::One([(counter_key(&self.key_prefix, user_id, counter.id), args)])).await?;
        // A one-key job's answer does not say whether it committed: it
        // did exactly when it fits or is a report.
        let &[now_ms, ref values @ ..] = reply.as_slice() else {
            return Err(script_error("script answered nothing for one key".to_owned()));
        };
        let (fits, seen) = seen_of(values, now_ms, 1, params)?;
        let test = seen.verdict(weight, params);
        let admitted = test.admitted;
        if admitted != fits {
            // The script and the Rust arithmetic disagree: a bug, never papered over.
            return Err(script_error(format!(
                "script answered fits={fits} where the arithmetic says {admitted} (saw {seen:?})"
            )));
        }
        Ok(seen.answer(test, weight, count, params, admitted))
    }

    /// All-or-nothing decision over several counters of `group` in one job;
    /// see [`Store::decide_many`](super::Store::decide_many). Keys are
    /// `rle:{<group>}:<key>`: the hash tag puts one group's counters in one
    /// cluster slot, which a multi-key script requires.
    pub async fn decide_many(&self, group: &str, items: &[ManyItem]) -> Result<ManyOutcome, StoreError> {
        let keys = items
            .iter()
            .map(|item| {
                let mut key = String::with_capacity(self.key_prefix.len() + 7 + group.len() + item.key.len());
                key.push_str(&self.key_prefix);
                key.push_str("rle2:{");
                push_tag(&mut key, group);
                key.push_str("}:");
                key.push_str(&item.key);
                let p = item.params;
                let flags = flags(p, item.shadow, item.count);
                let spec = [p.window_ms, p.capacity, item.tick_ms, flags, p.rate];
                (key, KeyArgs { spec, weight: item.weight })
            })
            .collect();
        let reply = self.run(JobKeys::Many(keys)).await?;
        // Only a job of several keys says whether it committed.
        let header = usize::from(items.len() > 1);
        let Some((&now_ms, answer)) = reply.split_first().filter(|(_, answer)| answer.len() >= header) else {
            return Err(script_error(format!(
                "script answered {} values for {} keys",
                reply.len(),
                items.len()
            )));
        };
        let (said, mut values) = answer.split_at(header);
        let mut raw = Vec::with_capacity(items.len());
        for item in items {
            let (these, rest) = values.split_at(answer_len(item.params.algorithm).min(values.len()));
            values = rest;
            let (fits, seen) = seen_of(these, now_ms, item.tick_ms, item.params)?;
            if seen.verdict(item.weight, item.params).admitted != fits {
                return Err(script_error(format!("script and the Rust arithmetic disagree on {}", item.key)));
            }
            raw.push((fits, seen));
        }
        let committed = match said {
            [committed] => *committed == 1,
            _ => !items.iter().zip(&raw).any(|(item, &(fits, _))| item.blocks(fits)),
        };
        Ok(ManyOutcome { committed, verdicts: many_verdicts(items, &raw, committed) })
    }

    /// Queues a job on the next slot and waits, at most `redis.timeout_ms`
    /// from now, for its part of the batch's answer. Small by design: this
    /// future is part of every decision's state machine.
    async fn run(&self, keys: JobKeys) -> Result<Vec<u64>, StoreError> {
        let slot = match self.backend {
            Backend::Single(_) | Backend::Sentinel(_) => 0,
            Backend::Cluster(_) => key_slot(keys.as_slice().first().map_or("", |(key, _)| key.as_str())),
        };
        if breaker_of(&self.breakers, slot).admit() == Admission::Reject {
            return Err(StoreError {
                kind: FailureKind::CircuitOpen,
                message: "redis circuit breaker open after consecutive failures; not tried".to_owned(),
            });
        }
        let (reply, answer) = oneshot::channel();
        let queue = self.next_slot.fetch_add(1, Ordering::Relaxed) % self.queues.len();
        if let Err(e) = self.queues[queue].try_send(Job { slot, keys, reply }) {
            return Err(match e {
                mpsc::error::TrySendError::Full(_) => StoreError {
                    kind: FailureKind::PoolExhausted,
                    message: format!("{QUEUE_PER_SLOT} decisions already wait for redis connection {queue}"),
                },
                mpsc::error::TrySendError::Closed(_) => StoreError {
                    kind: FailureKind::Other,
                    message: "the redis store is shutting down".to_owned(),
                },
            });
        }
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(StoreError {
                kind: FailureKind::Other,
                message: "the redis dispatcher stopped before answering".to_owned(),
            }),
            Err(_) => Err(timeout_error(self.timeout)),
        }
    }
}

/// Consecutive batches that missed `redis.timeout_ms` after which a
/// dispatcher stops trusting its connection (a peer that vanished without a
/// reset never errors) and takes a fresh one. One slow call is not enough:
/// replacing connections while Redis is merely overloaded adds load.
const TIMEOUTS_BEFORE_RECONNECT: u32 = 3;

/// How much one script call may carry (`redis.max_keys_per_call`,
/// `redis.max_key_bytes_per_call`): a bigger batch is split into calls in
/// order, so no batch of hostile (many, long) keys holds Redis' single
/// thread for long. A job is never split: one that alone exceeds a cap
/// goes in a call of its own.
#[derive(Debug, Clone, Copy)]
struct CallCaps {
    keys: usize,
    key_bytes: usize,
}

/// How many leading jobs of `batch` the next script call carries: as many
/// as fit both caps, and at least one.
fn call_size<'a>(jobs: impl IntoIterator<Item = &'a [(String, KeyArgs)]>, caps: CallCaps) -> usize {
    let (mut taken, mut keys, mut key_bytes) = (0, 0, 0);
    for job in jobs {
        keys += job.len();
        key_bytes += job.iter().map(|(key, _)| key.len()).sum::<usize>();
        if taken > 0 && (keys > caps.keys || key_bytes > caps.key_bytes) {
            break;
        }
        taken += 1;
    }
    taken
}

/// One slot's dispatcher: takes everything queued (up to [`MAX_BATCH`]),
/// sends it as script calls within [`CallCaps`] (usually one), hands each
/// job its part of the answer, and tells the breaker how Redis did.
struct Dispatcher {
    slot: usize,
    backend: Backend,
    script: Arc<redis::Script>,
    timeout: Duration,
    breakers: Arc<[Breaker]>,
    caps: CallCaps,
}

/// How one script call (or, in a cluster, the calls of one batch) went,
/// for the breaker and the reconnect rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Health {
    /// Redis answered (a script error is an answer too).
    Answered,
    /// The call missed its deadline.
    TimedOut,
    /// Unreachable, refused, connection lost, cluster down.
    Failed,
    /// The server answered READONLY: it is no longer the master (a
    /// Sentinel failover demoted it).
    Demoted,
}

impl Dispatcher {
    async fn run(self, mut queue: mpsc::Receiver<Job>) {
        let slot = self.slot;
        let mut batch = Vec::with_capacity(MAX_BATCH);
        // Jobs past the caps of the last call: the next call's first, in order.
        let mut rest: Vec<Job> = Vec::new();
        let mut conn: Option<Conn> = None;
        let mut timeouts = 0;
        loop {
            if rest.is_empty() {
                if queue.recv_many(&mut batch, MAX_BATCH).await == 0 {
                    break;
                }
            } else {
                batch.append(&mut rest);
                while batch.len() < MAX_BATCH {
                    let Ok(job) = queue.try_recv() else { break };
                    batch.push(job);
                }
            }
            // A caller that gave up (its deadline passed while the job queued)
            // was answered by its failure policy: do not count it now.
            batch.retain(|job: &Job| !job.reply.is_closed());
            if batch.is_empty() {
                continue;
            }
            let size = call_size(batch.iter().map(|job| job.keys.as_slice()), self.caps);
            if size < batch.len() {
                rest = batch.split_off(size);
            }
            if conn.is_none() {
                // Bounded by `redis.connect_timeout_ms`, not by the decisions'
                // deadline: callers stop waiting at theirs (and are answered by
                // policy), but a connection that takes longer than one decision
                // to open is still worth having for the next ones.
                match self.connect().await {
                    Ok(fresh) => conn = Some(fresh),
                    Err(error) => {
                        self.report(&batch, Health::Failed);
                        fail_all(&mut batch, &error);
                        continue;
                    }
                }
                batch.retain(|job: &Job| !job.reply.is_closed());
                if batch.is_empty() {
                    continue;
                }
            }
            // The breakers hear about every call; `health` is what the
            // connection as a whole did.
            let health = match &mut conn {
                Some(Conn::Single(connection)) => self.dispatch_single(connection, &mut batch).await,
                Some(Conn::Cluster(connection)) => self.dispatch_cluster(connection, &mut batch).await,
                None => unreachable!("a connection was just set"),
            };
            match health {
                Health::Answered => timeouts = 0,
                Health::TimedOut => {
                    timeouts += 1;
                    if timeouts >= TIMEOUTS_BEFORE_RECONNECT && conn.take().is_some() {
                        tracing::debug!(
                            slot,
                            timeouts,
                            "redis connection unresponsive; dispatcher takes a new one"
                        );
                    }
                }
                Health::Demoted => {
                    timeouts = 0;
                    if let Some(Conn::Single(pooled)) = conn.take() {
                        // Closed, not pooled: the next connection asks
                        // the sentinels for the master.
                        pooled.discard();
                        tracing::info!(slot, "redis answered READONLY; dispatcher reconnects to the master");
                    }
                }
                Health::Failed => {
                    timeouts = 0;
                    if matches!(conn, Some(Conn::Single(_))) {
                        // Back to the pool, which PINGs it before reuse and
                        // drops it when that fails; the next batch takes
                        // another. (A cluster connection reconnects to its
                        // nodes by itself.)
                        conn = None;
                        tracing::debug!(slot, "redis connection broken; dispatcher takes a new one");
                    }
                }
            }
        }
    }

    async fn connect(&self) -> Result<Conn, StoreError> {
        match &self.backend {
            Backend::Single(_) | Backend::Sentinel(_) => self.backend.pooled().await.map(Conn::Single),
            Backend::Cluster(cluster) => cluster.connect().await.map(Conn::Cluster),
        }
    }

    /// Tells the breakers of `batch`'s slots how Redis did (once per
    /// breaker, however many of its jobs the batch holds).
    fn report(&self, batch: &[Job], health: Health) {
        let mut told = 0u64; // one bit per breaker (at most 64)
        for job in batch {
            let index = breaker_index(job.slot, self.breakers.len());
            if told & (1 << index) == 0 {
                told |= 1 << index;
                match health {
                    Health::Answered => self.breakers[index].success(),
                    Health::TimedOut | Health::Failed | Health::Demoted => self.breakers[index].failure(),
                }
            }
        }
    }

    /// One script call for the whole batch, answered within `timeout`.
    async fn dispatch_single(&self, conn: &mut Pooled, batch: &mut Vec<Job>) -> Health {
        // Nobody waits longer than `timeout` for this answer. A late reply
        // on a kept connection is read and discarded by the client.
        let call = tokio::time::timeout(
            self.timeout,
            run_script(Target::Server(conn.connection()), &self.script, batch),
        )
        .await;
        self.settle_call(call, batch)
    }

    /// Settles one call: tells the breakers of its jobs' slots how Redis
    /// did and hands each job its answer.
    fn settle_call(&self, call: CallResult, batch: &mut Vec<Job>) -> Health {
        let (health, result) = settle(call, self.timeout);
        self.report(batch, health);
        answer(batch, result);
        health
    }

    /// One script call per node (per slot without a usable slot map), all
    /// in flight together.
    async fn dispatch_cluster(&self, conn: &ClusterConnection, batch: &mut Vec<Job>) -> Health {
        let Backend::Cluster(cluster) = &self.backend else { unreachable!("a cluster connection") };
        let map = cluster.slot_map();
        let calls = groups(batch, |slot| group_key(map.as_deref(), slot))
            .into_iter()
            .map(|group| self.call_node(cluster, conn.clone(), group));
        combined(futures_util::future::join_all(calls).await)
    }

    /// One call for one node's jobs. When the node refuses a key (the map
    /// was stale), nothing was written: the map is set aside and the jobs
    /// go again, one call per slot.
    async fn call_node(&self, cluster: &Cluster, mut conn: ClusterConnection, mut group: Vec<Job>) -> Health {
        let first = group[0].slot;
        if group.iter().all(|job| job.slot == first) {
            return self.call_slot(conn, group).await;
        }
        let call = tokio::time::timeout(
            self.timeout,
            run_script(Target::Node(&mut conn, first), &self.script, &group),
        )
        .await;
        match call {
            Ok(Err(e)) if refused_as_not_local(&e) => {
                // The first call to find the map stale reads it again, once
                // its jobs are answered; until then, calls go per slot.
                let first_to_see = !cluster.stale.swap(true, Ordering::Relaxed);
                tracing::debug!(error = %e, "redis cluster slot map stale; this batch goes per slot");
                // A caller that gave up meanwhile was answered by its policy.
                group.retain(|job| !job.reply.is_closed());
                let calls =
                    groups(&mut group, u32::from).into_iter().map(|slot| self.call_slot(conn.clone(), slot));
                // Each slot's call told its breakers how it went.
                futures_util::future::join_all(calls).await;
                if first_to_see
                    && let Ok(Err(error)) =
                        tokio::time::timeout(self.timeout, cluster.read_slot_map(&mut conn)).await
                {
                    tracing::debug!(%error, "redis cluster slot map not read; the probe tries again");
                }
                // The node answered (it refused): the connection works.
                Health::Answered
            }
            call => self.settle_call(call, &mut group),
        }
    }

    /// One call for one slot's jobs, with declared keys: routed by them,
    /// redirected by redis-rs (MOVED, ASK) as any keyed command.
    async fn call_slot(&self, mut conn: ClusterConnection, mut group: Vec<Job>) -> Health {
        let call =
            tokio::time::timeout(self.timeout, run_script(Target::Slot(&mut conn), &self.script, &group))
                .await;
        self.settle_call(call, &mut group)
    }
}

/// Empties `batch` into groups of equal `key(slot)`, each sorted by slot,
/// in order of key. Stable: jobs on one counter (hence one slot) keep their
/// order.
fn groups(batch: &mut Vec<Job>, key: impl Fn(u16) -> u32) -> Vec<Vec<Job>> {
    batch.sort_by_key(|job| (key(job.slot), job.slot));
    let mut groups: Vec<Vec<Job>> = Vec::new();
    let mut last = None;
    for job in batch.drain(..) {
        let this = key(job.slot);
        match groups.last_mut() {
            Some(group) if last == Some(this) => group.push(job),
            _ => groups.push(vec![job]),
        }
        last = Some(this);
    }
    groups
}

/// How a connection did over several calls: fine while any node answered
/// through it.
fn combined(healths: Vec<Health>) -> Health {
    if healths.contains(&Health::Answered) {
        Health::Answered
    } else if healths.contains(&Health::Demoted) {
        Health::Demoted
    } else if healths.contains(&Health::Failed) {
        Health::Failed
    } else {
        Health::TimedOut
    }
}

/// Whether a cluster node refused a call for a key it does not serve
/// (Redis 7: "Script attempted to access a non local key in a cluster
/// node"; Redis 6: "Lua script attempted to ..."): the script reads every
/// key before it writes any, so nothing was written.
fn refused_as_not_local(e: &RedisError) -> bool {
    e.to_string().contains("non local key")
}

type CallResult = Result<Result<Vec<u64>, RedisError>, tokio::time::error::Elapsed>;

/// How Redis did on one call, and its answer with any error classified
/// (once).
fn settle(call: CallResult, timeout: Duration) -> (Health, Result<Vec<u64>, StoreError>) {
    match call {
        Ok(Ok(reply)) => (Health::Answered, Ok(reply)),
        Ok(Err(e)) => {
            let error = classify(&e);
            // A script error is an answer: Redis is there.
            let health = if matches!(e.kind(), redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)) {
                Health::Demoted
            } else if error.kind == FailureKind::ScriptError {
                Health::Answered
            } else {
                Health::Failed
            };
            (health, Err(error))
        }
        Err(_) => (Health::TimedOut, Err(timeout_error(timeout))),
    }
}

/// Hands a call's result to the jobs it was for.
fn answer(batch: &mut Vec<Job>, result: Result<Vec<u64>, StoreError>) {
    match result {
        Ok(reply) => split_reply(batch, &reply),
        Err(error) => fail_all(batch, &error),
    }
}

/// Index of the breaker guarding `slot` among `breakers` of them (one
/// against a single server: every job has slot 0 there).
fn breaker_index(slot: u16, breakers: usize) -> usize {
    usize::from(slot / SLOTS_PER_BREAKER) % breakers
}

/// The breaker of a slot's range.
fn breaker_of(breakers: &[Breaker], slot: u16) -> &Breaker {
    &breakers[breaker_index(slot, breakers.len())]
}

/// Redis Cluster's slot of a key: CRC16 (XMODEM) of its hash tag (between
/// the first `{` and the next `}`, when not empty), else of the whole key,
/// modulo 16384. Every key of one job shares a hash tag.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let len = bytes[open + 1..].iter().position(|&b| b == b'}')?;
            (len > 0).then(|| &bytes[open + 1..open + 1 + len])
        })
        .unwrap_or(bytes);
    crc16::State::<crc16::XMODEM>::calculate(hashed) % 16_384
}

/// The connections `redis.*` asks for: a Sentinel-discovered master, a
/// Redis Cluster client, or a pool to one server. Errors are the message
/// of a [`RedisSetupError`].
fn backend(config: &RedisConfig) -> Result<Backend, String> {
    let password = config.password().map_err(|e| e.to_string())?;
    let nodes = config
        .seed_urls()
        .map(|node| {
            let info = node.into_connection_info().map_err(|e| e.to_string())?;
            Ok(with_auth(info, config.username.as_deref(), password.as_deref()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
    let tls = tls_certificates(config)?;
    if let Some(master) = &config.sentinel_master {
        Ok(Backend::Sentinel(sentinel_pool(config, master, password, connect_timeout)?))
    } else if config.cluster {
        cluster_backend(nodes, tls, connect_timeout)
    } else {
        single_backend(config, nodes, tls, connect_timeout)
    }
}

/// A Redis Cluster client over the seed `nodes`.
fn cluster_backend(
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
fn single_backend(
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
    // One connection per dispatcher, one for `warm_up` (the readiness
    // probe), and room for a replacement while a broken one is dropped.
    let pool = Pool::builder(manager)
        .max_size(config.connections * 2 + 1)
        .runtime(Runtime::Tokio1)
        .create_timeout(Some(connect_timeout))
        // Handing out a returned connection PINGs it first; a peer that
        // stopped answering must not hang a dispatcher in that PING.
        .recycle_timeout(Some(connect_timeout))
        .wait_timeout(Some(connect_timeout))
        .build()
        .map_err(|e| e.to_string())?;
    Ok(Backend::Single(pool))
}

/// The circuit breakers: one for a server, one per range of slots for a cluster.
fn breakers(config: &RedisConfig, backend: &Backend) -> Arc<[Breaker]> {
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
fn tls_certificates(config: &RedisConfig) -> Result<Option<redis::TlsCertificates>, String> {
    let read = |key: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| format!("{key} {}: {e}", path.display()))
    };
    let root_cert = match &config.tls_ca_file {
        Some(path) => Some(read("redis.tls_ca_file", path)?),
        None => None,
    };
    let client_tls = match (&config.tls_cert_file, &config.tls_key_file) {
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
fn sentinel_pool(
    config: &RedisConfig,
    master: &str,
    password: Option<String>,
    connect_timeout: Duration,
) -> Result<SentinelPool, String> {
    let sentinels = config
        .seed_urls()
        .map(|url| {
            let info = url.into_connection_info().map_err(|e| e.to_string())?;
            Ok(with_auth(info, None, config.sentinel_password.as_deref()))
        })
        .collect::<Result<Vec<_>, String>>()?;
    let node = SentinelNodeConnectionInfo {
        tls_mode: None,
        redis_connection_info: Some(deadpool_redis::RedisConnectionInfo {
            username: config.username.clone(),
            password,
            ..Default::default()
        }),
    };
    let manager = SentinelManager::new(sentinels, master.to_owned(), Some(node), SentinelServerType::Master)
        .map_err(|e| e.to_string())?;
    deadpool_redis::sentinel::Pool::builder(manager)
        .max_size(config.connections * 2 + 1)
        .runtime(Runtime::Tokio1)
        .create_timeout(Some(connect_timeout))
        .recycle_timeout(Some(connect_timeout))
        .wait_timeout(Some(connect_timeout))
        .build()
        .map_err(|e| e.to_string())
}

/// Sets the AUTH user and password given (`redis.username`,
/// `redis.password` or `redis.password_file`) on a node's connection
/// info; the URL's own are kept otherwise.
fn with_auth(info: ConnectionInfo, username: Option<&str>, password: Option<&str>) -> ConnectionInfo {
    let mut settings = info.redis_settings().clone();
    if let Some(username) = username {
        settings = settings.set_username(username);
    }
    if let Some(password) = password {
        settings = settings.set_password(password);
    }
    info.set_redis_settings(settings)
}

fn fail_all(batch: &mut Vec<Job>, error: &StoreError) {
    for job in batch.drain(..) {
        let _ = job.reply.send(Err(error.clone()));
    }
}

/// The distinct specs of one script call, in order of first use: the
/// script parses each once, and a key names its spec by position (1-based).
#[derive(Debug, Default)]
struct Specs {
    list: Vec<Spec>,
    /// Position of each spec, once there are too many to search in order
    /// (a batch spanning many rules).
    index: Option<std::collections::HashMap<Spec, usize>>,
}

impl Specs {
    /// Specs searched in order below this many; a map from there on.
    const LINEAR: usize = 8;

    /// The 1-based position of `spec`, added when new.
    fn position(&mut self, spec: Spec) -> usize {
        if let Some(index) = &mut self.index {
            let next = self.list.len() + 1;
            let at = *index.entry(spec).or_insert(next);
            if at == next {
                self.list.push(spec);
            }
            return at;
        }
        if let Some(at) = self.list.iter().position(|s| *s == spec) {
            return at + 1;
        }
        self.list.push(spec);
        if self.list.len() == Self::LINEAR {
            self.index = Some(self.list.iter().enumerate().map(|(i, s)| (*s, i + 1)).collect());
        }
        self.list.len()
    }
}

/// Where one script call goes.
enum Target<'a> {
    /// One server (plain or the master Sentinel names).
    Server(&'a mut redis::aio::MultiplexedConnection),
    /// A cluster, routed by the call's declared keys (all in one slot).
    Slot(&'a mut ClusterConnection),
    /// A cluster: the primary serving `slot`, with the keys of its other
    /// slots inline.
    Node(&'a mut ClusterConnection, u16),
}

impl Target<'_> {
    async fn query(&mut self, call: redis::Cmd) -> Result<Value, RedisError> {
        match self {
            Target::Server(conn) => call.query_async(*conn).await,
            Target::Slot(conn) => call.query_async(*conn).await,
            Target::Node(conn, slot) => {
                let route = Route::new(*slot, SlotAddr::Master);
                conn.route_command(call, RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(route)))
                    .await
            }
        }
    }

    /// SCRIPT LOAD (to every primary of a cluster).
    async fn load(&mut self, script: &redis::Script) -> Result<String, RedisError> {
        match self {
            Target::Server(conn) => script.load_async(*conn).await,
            Target::Slot(conn) | Target::Node(conn, _) => script.load_async(*conn).await,
        }
    }
}

/// Sends one batch as one script call by its SHA, loading the script once
/// when the server does not know it (NOSCRIPT: a restart, a new node).
async fn run_script(
    mut target: Target<'_>,
    script: &redis::Script,
    batch: &[Job],
) -> Result<Vec<u64>, RedisError> {
    let inline = matches!(target, Target::Node(..));
    let answer = match target.query(script_call(script.get_hash(), batch, inline)).await {
        Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
            target.load(script).await?;
            target.query(script_call(script.get_hash(), batch, inline)).await?
        }
        answer => answer?,
    };
    Ok(redis::from_redis_value(answer)?)
}

/// The EVALSHA of one batch: its keys (declared, or `inline` in ARGV),
/// how to read them (one run, or one run per slot when inline), the
/// distinct specs, then per job (`0, n` first when it has several keys)
/// per key its entry: its spec's position, plus the number of specs when
/// its weight (not 1) follows, negated when the key occurs more than once
/// in the call. The layout is the script's header. Every value is a
/// command argument Redis parses and Lua interns (~900 instructions per
/// key for two of them), so the common case (one key, weight 1) is one.
fn script_call(sha: &str, batch: &[Job], inline: bool) -> redis::Cmd {
    let keys = || batch.iter().flat_map(|job| job.keys.as_slice().iter().map(|(key, _)| key.as_str()));
    let nkeys: usize = batch.iter().map(|job| job.keys.as_slice().len()).sum();
    let mut call = redis::cmd("EVALSHA");
    call.arg(sha);
    if inline {
        call.arg(0);
        let runs = slot_runs(batch);
        call.arg(runs.len());
        for run in &runs {
            call.arg(*run);
        }
        for key in keys() {
            call.arg(key);
        }
    } else {
        call.arg(nkeys);
        for key in keys() {
            call.arg(key);
        }
        call.arg(1).arg(nkeys);
    }
    let mut specs = Specs::default();
    let positions: Vec<usize> =
        batch.iter().flat_map(|job| job.keys.as_slice()).map(|(_, args)| specs.position(args.spec)).collect();
    call.arg(specs.list.len());
    for spec in &specs.list {
        for value in spec {
            call.arg(*value);
        }
    }
    call.arg(batch.len());
    let repeated = repeated_keys(keys(), nkeys);
    let nspecs = specs.list.len();
    let mut positions = positions.into_iter();
    for job in batch {
        let keys = job.keys.as_slice();
        if keys.len() > 1 {
            call.arg(0).arg(keys.len());
        }
        for ((key, args), position) in keys.iter().zip(&mut positions) {
            // At most twice the call's number of keys.
            let entry = (if args.weight == 1 { position } else { nspecs + position }) as i64;
            call.arg(if repeated.contains(key.as_str()) { -entry } else { entry });
            if args.weight != 1 {
                call.arg(args.weight);
            }
        }
    }
    call
}

/// The keys that occur more than once in a call of `nkeys` keys over
/// `batch` (none in a call of one key). The script writes any other key as
/// soon as its job is decided, keeping no state for it.
fn repeated_keys<'a>(keys: impl Iterator<Item = &'a str>, nkeys: usize) -> hashbrown::HashSet<&'a str> {
    let mut repeated = hashbrown::HashSet::new();
    if nkeys > 1 {
        let mut seen = hashbrown::HashSet::with_capacity(nkeys);
        for key in keys {
            if !seen.insert(key) {
                repeated.insert(key);
            }
        }
    }
    repeated
}

/// The keys of `batch` (sorted by slot) per slot, in order: how many keys
/// each `MGET` of the script reads.
fn slot_runs(batch: &[Job]) -> Vec<usize> {
    let mut runs: Vec<usize> = Vec::new();
    let mut last = None;
    for job in batch {
        let keys = job.keys.as_slice().len();
        match runs.last_mut() {
            Some(run) if last == Some(job.slot) => *run += keys,
            _ => runs.push(keys),
        }
        last = Some(job.slot);
    }
    runs
}

/// Values of the script's answer for `job`: whether it committed (only a
/// job of several keys says), then [`answer_len`] per key.
fn job_answer_len(job: &Job) -> usize {
    let keys = job.keys.as_slice();
    usize::from(keys.len() > 1) + keys.iter().map(|(_, args)| answer_len(args.algorithm())).sum::<usize>()
}

/// Hands each job of `batch` Redis' clock (the answer's first value) and
/// its slice of the rest of `reply`, emptying `batch`.
fn split_reply(batch: &mut Vec<Job>, reply: &[u64]) {
    let expected: usize = 1 + batch.iter().map(job_answer_len).sum::<usize>();
    let Some((&now_ms, mut rest)) = reply.split_first().filter(|_| reply.len() == expected) else {
        fail_all(
            batch,
            &script_error(format!("script answered {} values for a batch needing {expected}", reply.len())),
        );
        return;
    };
    for job in batch.drain(..) {
        let (part, after) = rest.split_at(job_answer_len(&job));
        rest = after;
        let mut answer = Vec::with_capacity(1 + part.len());
        answer.push(now_ms);
        answer.extend_from_slice(part);
        let _ = job.reply.send(Ok(answer));
    }
}

fn timeout_error(timeout: Duration) -> StoreError {
    StoreError { kind: FailureKind::Timeout, message: format!("no answer within {} ms", timeout.as_millis()) }
}

/// `<prefix>rl2:{<user_id>}:<rule_id>`, built in one allocation. The hash
/// tag keeps all of a user's counters in one Redis Cluster slot.
pub fn counter_key(prefix: &str, user_id: &str, rule_id: &str) -> String {
    let mut key = String::with_capacity(prefix.len() + 7 + user_id.len() + rule_id.len());
    key.push_str(prefix);
    key.push_str("rl2:{");
    push_tag(&mut key, user_id);
    key.push_str("}:");
    key.push_str(rule_id);
    key
}

/// Appends `text` as a hash tag's content with `%`, `{` and `}`
/// percent-encoded: Redis takes the tag from the first `{` to the next `}`,
/// so a raw brace in a user id or a domain would cut the tag short, or
/// empty it (then the whole key is hashed, and one Envoy job's keys could
/// land in different cluster slots). Encoded, the tag is the whole value.
fn push_tag(key: &mut String, text: &str) {
    super::push_encoded(key, text, &['{', '}']);
}

fn script_error(message: String) -> StoreError {
    StoreError { kind: FailureKind::ScriptError, message }
}

fn classify(e: &RedisError) -> StoreError {
    let kind = if e.is_timeout() {
        FailureKind::Timeout
    } else if e.is_connection_refusal() {
        FailureKind::ConnectionRefused
    } else if e.is_connection_dropped() || e.is_io_error() {
        FailureKind::ConnectionLost
    } else if e.is_cluster_error() {
        FailureKind::ClusterError
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
    async fn pooled(&self) -> Result<Pooled, StoreError> {
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

fn classify_sentinel_pool(e: &SentinelPoolError) -> StoreError {
    match e {
        SentinelPoolError::Backend(e) => classify(e),
        SentinelPoolError::Timeout(_) => {
            StoreError { kind: FailureKind::PoolExhausted, message: e.to_string() }
        }
        _ => StoreError { kind: FailureKind::Other, message: e.to_string() },
    }
}

fn classify_pool(e: &PoolError) -> StoreError {
    match e {
        PoolError::Backend(e) => classify(e),
        PoolError::Timeout(_) => StoreError { kind: FailureKind::PoolExhausted, message: e.to_string() },
        _ => StoreError { kind: FailureKind::Other, message: e.to_string() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_has_the_user_as_hash_tag() {
        assert_eq!(counter_key("", "u-1", "playback"), "rl2:{u-1}:playback");
    }

    #[test]
    fn key_slot_matches_redis_cluster() {
        // Values from Redis' CLUSTER KEYSLOT.
        assert_eq!(key_slot("foo"), 12_182);
        assert_eq!(key_slot("123456789"), 12_739);
        assert_eq!(key_slot("{user1000}.following"), key_slot("user1000"));
        assert_eq!(key_slot("rl2:{u-1}:a"), key_slot("rle2:{u-1}:b"));
        // A brace in a value cannot cut or empty the tag: every key of one
        // user (or domain) stays in one slot, whatever follows the tag.
        for hostile in ["}evil", "{x}y", "a}b{c", "%7D"] {
            let a = counter_key("", hostile, "rule-a");
            let b = counter_key("", hostile, "rule-b");
            assert_eq!(key_slot(&a), key_slot(&b), "{a} / {b}");
            assert!(!a.contains("{}"), "{a}");
        }
        assert_ne!(counter_key("", "}", "r"), counter_key("", "%7D", "r"), "the encoding is injective");
        // An empty tag hashes the whole key.
        assert_eq!(key_slot("{}x"), crc16::State::<crc16::XMODEM>::calculate(b"{}x") % 16_384);
    }

    #[test]
    fn specs_are_numbered_once_in_order_of_first_use() {
        let mut specs = Specs::default();
        let spec = |n: u64| [n, 1, 1, 0, 1];
        assert_eq!([1, 2, 1, 3, 2].map(|n| specs.position(spec(n))), [1, 2, 1, 3, 2]);
        // Past the linear search, the map keeps every number.
        for n in 4..=40 {
            assert_eq!(specs.position(spec(n)), n as usize);
        }
        assert!(specs.index.is_some());
        assert_eq!([1, 7, 40, 8].map(|n| specs.position(spec(n))), [1, 7, 40, 8]);
        assert_eq!(specs.position(spec(41)), 41);
        assert_eq!(specs.list.len(), 41);
        assert_eq!(specs.list[6], spec(7));
    }

    fn job(slot: u16, key: &str, keys: usize) -> Job {
        let args = KeyArgs { spec: [1, 1, 1, 0, 1], weight: 1 };
        let keys = match keys {
            1 => JobKeys::One([(key.to_owned(), args)]),
            n => JobKeys::Many(vec![(key.to_owned(), args); n]),
        };
        Job { slot, keys, reply: oneshot::channel().0 }
    }

    #[test]
    fn a_batch_groups_by_node_sorted_by_slot_keeping_each_counters_order() {
        // Slots 1 and 9 on node 0, slot 5 on node 1.
        let node = |slot: u16| u32::from(slot == 5);
        let mut batch = vec![
            job(9, "a1", 1),
            job(5, "b1", 1),
            job(1, "c1", 2),
            job(9, "a2", 1),
            job(5, "b2", 1),
            job(1, "c2", 1),
        ];
        let grouped = groups(&mut batch, node);
        assert!(batch.is_empty());
        let names = |group: &[Job]| group.iter().map(|j| j.keys.as_slice()[0].0.clone()).collect::<Vec<_>>();
        assert_eq!(grouped.len(), 2);
        assert_eq!(names(&grouped[0]), ["c1", "c2", "a1", "a2"]);
        assert_eq!(names(&grouped[1]), ["b1", "b2"]);
        // Node 0's call reads slot 1's three keys, then slot 9's two.
        assert_eq!(slot_runs(&grouped[0]), [3, 2]);
        assert_eq!(slot_runs(&grouped[1]), [2]);
        // Per slot (no map): one group per slot.
        let mut again: Vec<Job> = grouped.into_iter().flatten().collect();
        assert_eq!(groups(&mut again, u32::from).iter().map(Vec::len).collect::<Vec<_>>(), [2, 2, 2]);
    }

    #[test]
    fn a_call_passes_its_keys_declared_or_inline_with_their_read_runs() {
        let mut batch = [job(1, "x", 2), job(1, "y", 1), job(7, "z", 1)];
        if let JobKeys::One([(_, args)]) = &mut batch[1].keys {
            args.weight = 5;
        }
        let args = |inline| {
            script_call("sha", &batch, inline)
                .args_iter()
                .map(|arg| match arg {
                    redis::Arg::Simple(bytes) => String::from_utf8(bytes.to_vec()).unwrap(),
                    _ => unreachable!("no cursor"),
                })
                .collect::<Vec<_>>()
        };
        // One spec; three jobs: x twice (0, 2 keys, each repeated: -1), y
        // of weight 5 (1 spec + position 1, then its weight), z (1).
        let tail = ["1", "1", "1", "1", "0", "1", "3", "0", "2", "-1", "-1", "2", "5", "1"];
        let declared: Vec<&str> =
            ["EVALSHA", "sha", "4", "x", "x", "y", "z", "1", "4"].into_iter().chain(tail).collect();
        assert_eq!(args(false), declared);
        let inline: Vec<&str> =
            ["EVALSHA", "sha", "0", "2", "3", "1", "x", "x", "y", "z"].into_iter().chain(tail).collect();
        assert_eq!(args(true), inline);
    }

    #[test]
    fn a_call_takes_jobs_while_both_caps_hold_and_always_one() {
        let job = |keys: usize, len: usize| -> Vec<(String, KeyArgs)> {
            vec![("k".repeat(len), KeyArgs { spec: [0; 5], weight: 1 }); keys]
        };
        let jobs = [job(4, 10), job(4, 10), job(4, 10), job(100, 10), job(1, 10)];
        let slices = || jobs.iter().map(Vec::as_slice);
        let caps = |keys, key_bytes| CallCaps { keys, key_bytes };
        assert_eq!(call_size(slices(), caps(8, 1 << 20)), 2, "8 keys: two jobs of 4");
        assert_eq!(call_size(slices(), caps(1_000, 100)), 2, "100 bytes: two jobs of 40");
        assert_eq!(call_size(slices().skip(3), caps(8, 1 << 20)), 1, "a job over the cap goes alone");
        assert_eq!(call_size(slices(), caps(1_000, 1 << 20)), 5);
    }
}
