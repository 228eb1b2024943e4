//! The Redis counter store: one Lua script (`scripts/decide_batch.lua`),
//! called by SHA and reloaded on NOSCRIPT; one 32-byte string per counter, at
//! `rl2:{<user_id>}:<rule_id>` (Check) or `rle2:{<domain>}:<key>` (Envoy):
//! key-schema version 2, laid out in the script and in docs/design.md §13.
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
    future::Future,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use redis::RedisError;
use tokio::{
    sync::{Semaphore, SemaphorePermit, mpsc, oneshot},
    task::JoinSet,
};

mod backend;
mod dispatch;
mod keys;
mod scan;
mod script;

pub use self::keys::{counter_key, key_slot};
pub use self::scan::{MAX_SCAN_CALLS, SCAN_COUNT};
use self::{
    backend::{Backend, Conn, backend, breaker_of, breakers, classify},
    dispatch::{CallCaps, Dispatcher, timeout_error},
    keys::push_tag,
    script::{KeyArgs, OWN_CLOCK, REFUND, answer_len, flags, script_error, seen_of},
};
use super::settings::{RedisConfig, redact_url};
use super::{
    Count, CounterSpec, CounterStore, FailureKind, Listed, ManyItem, ManyOutcome, Shares, StoreError,
    breaker::{Admission, Breaker},
    figures::{ShareWaits, share_waits},
    many_verdicts, scripts,
    store::Held,
    window::Verdict,
};
use crate::telemetry::exposition::Figures;

/// Most jobs in one script call. Bounds the time one call holds Redis (a
/// script blocks every other client while it runs): at ~1 µs of Lua per key,
/// 256 single-key jobs hold it for about a quarter of a millisecond.
const MAX_BATCH: usize = 256;

/// Most jobs waiting per slot. A job waits at most `redis.timeout_ms`, so
/// the queue only fills when Redis is far slower than the offered load; a
/// decision that finds it full is answered at once by its failure policy
/// (`pool_exhausted`) instead of queueing without bound.
const QUEUE_PER_SLOT: usize = 4_096;

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

/// A set of dispatchers' queues.
type Queues = Box<[mpsc::Sender<Job>]>;

/// Counters in one Redis server or a Redis Cluster.
pub struct RedisStore {
    backend: Backend,
    queues: Queues,
    /// Each serving thread's own dispatchers ([`RedisStore::serving`]),
    /// spawned on that thread at its first call, with connections of their
    /// own: a decision made there wakes nothing on another thread.
    local: Box<[OnceLock<Queues>]>,
    /// Dispatchers per serving thread.
    local_slots: usize,
    /// What makes a dispatcher: the settings and the shared parts.
    parts: Parts,
    next_slot: AtomicUsize,
    timeout: Duration,
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

/// The Redis store's figures: the calls that waited for their
/// connection's, their peer's or their tenant's share
/// (`grpc.max_store_calls_per_*`).
#[derive(Debug)]
struct RedisFigures {
    /// Weak: the store's dispatchers end only once it is dropped, at
    /// shutdown, while metrics may still be scraped.
    redis: std::sync::Weak<RedisStore>,
}

impl Figures for RedisFigures {
    fn render(&self, out: &mut String) {
        share_waits(out, self.redis.upgrade().map(|redis| redis.share_waits()).unwrap_or_default());
    }
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
        let url = config.connection.url.as_deref().unwrap_or_default();
        let setup_error = |message: String| RedisSetupError { url: redact_url(url), message };
        let backend = backend(config).map_err(setup_error)?;
        let parts = Parts { config: config.clone(), breakers: breakers(config, &backend) };
        let queues = parts.dispatchers(&backend, config.connections, |run| drop(tasks.spawn(run)));
        Ok(RedisStore {
            backend,
            queues,
            local: Box::default(),
            local_slots: 0,
            parts,
            next_slot: AtomicUsize::new(0),
            timeout: Duration::from_millis(config.timeout_ms),
            url_for_logs: redact_url(url),
            key_prefix: config.connection.key_prefix.as_str().into(),
            connection_waits: AtomicU64::new(0),
            tenant_waits: AtomicU64::new(0),
            peer_waits: AtomicU64::new(0),
        })
    }

    /// The same store, whose calls from each of `threads` serving threads
    /// ([`crate::locality`]) go to dispatchers of that thread's own,
    /// `redis.connections` shared among the threads (at least one each).
    #[must_use]
    pub fn serving(mut self, threads: usize) -> Self {
        self.local = (0..threads).map(|_| OnceLock::new()).collect();
        self.local_slots = self.parts.config.connections.div_ceil(threads.max(1)).max(1);
        self
    }

    /// The dispatchers of the serving thread running this code, spawned
    /// on it at its first call; the shared ones elsewhere.
    fn queues(&self) -> &[mpsc::Sender<Job>] {
        let Some(cell) = crate::locality::serving_thread().and_then(|index| self.local.get(index)) else {
            return &self.queues;
        };
        cell.get_or_init(|| {
            // A pool of its own against one server (a pooled connection
            // would run where it was made); a cluster's client and slot map
            // are shared, each dispatcher connecting from its thread.
            let backend = match &self.backend {
                Backend::Cluster(_) => self.backend.clone(),
                _ => match backend(&self.parts.config) {
                    Ok(backend) => backend,
                    Err(_) => return self.queues.clone(),
                },
            };
            self.parts.dispatchers(&backend, self.local_slots, |run| drop(tokio::spawn(run)))
        })
    }

    /// The circuit breakers (one, or one per range of cluster slots), for
    /// the readiness monitor: it reads them and closes them when its probe
    /// finds Redis answering. Holding them keeps no dispatcher alive.
    pub fn breakers(&self) -> Arc<[Breaker]> {
        Arc::clone(&self.parts.breakers)
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
            let loaded: Result<(), RedisError> = match &mut conn {
                // SCRIPT LOAD goes to every primary of a cluster.
                Conn::Single(conn) => scripts::DECIDE_BATCH.load(conn.connection()).await,
                Conn::Cluster(conn) => scripts::DECIDE_BATCH.load(conn).await,
            };
            if let (Ok(_), Backend::Cluster(cluster), Conn::Cluster(conn)) =
                (&loaded, &self.backend, &mut conn)
                && let Err(error) = cluster.read_slot_map(conn).await
            {
                // The last map read stays in use (per slot if none: exact,
                // only more calls) until a probe reads it.
                tracing::debug!(%error, "redis cluster slot map not read; calls go per slot");
            }
            self.settle_side(conn, loaded)
        };
        within(timeout, load).await
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
            self.settle_side(conn, answer)
        };
        within(timeout, run).await
    }

    /// Runs `calls` outside the decision path within `timeout`, in one
    /// pipeline on the side connection ([`RedisStore::pipeline`]'s), as
    /// [`scripts::run`] runs them: by SHA, and once more with each script's
    /// text when the store does not know it. Each call's answer, in order.
    pub async fn scripts(
        &self,
        calls: &[scripts::Call],
        timeout: Duration,
    ) -> Result<Vec<redis::Value>, StoreError> {
        let run = async {
            let mut conn = self.side_connection().await?;
            let answer = match &mut conn {
                Conn::Single(conn) => scripts::run(conn.connection(), calls).await,
                Conn::Cluster(conn) => scripts::run(conn, calls).await,
            };
            self.settle_side(conn, answer)
        };
        within(timeout, run).await
    }

    /// [`RedisStore::scripts`] of one call: its answer.
    pub async fn script(&self, call: &scripts::Call, timeout: Duration) -> Result<redis::Value, StoreError> {
        let mut answers = self.scripts(std::slice::from_ref(call), timeout).await?;
        answers.pop().ok_or_else(|| script_error(format!("{} answered nothing", call.script().name())))
    }

    /// What a side call's `answer` says: the connection kept when it worked
    /// ([`RedisStore::keep`]), the error classified.
    fn settle_side<T>(&self, conn: Conn, answer: Result<T, RedisError>) -> Result<T, StoreError> {
        self.keep(conn, answer.is_ok());
        answer.map_err(|e| classify(&e))
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
            spec: [params.window_ms, params.capacity, 1, flags(params, false, count), params.rate, 0, 0],
            weight,
        };
        let reply =
            self.run(JobKeys::One([(counter_key(&self.key_prefix, user_id, counter.id), args)])).await?;
        // A one-key job's answer does not say whether it committed: it
        // did exactly when it fits or is a report.
        let &[now_ms, ref values @ ..] = reply.as_slice() else {
            return Err(script_error("script answered nothing for one key".to_owned()));
        };
        let (fits, seen) = seen_of(values, now_ms, params)?;
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
    /// `rle2:{<group>}:<key>`: the hash tag puts one group's counters in one
    /// cluster slot, which a multi-key script requires.
    pub async fn decide_many(&self, group: &str, items: &[ManyItem]) -> Result<ManyOutcome, StoreError> {
        let keys = items
            .iter()
            .map(|item| {
                let mut key = String::with_capacity(self.key_prefix.len() + 8 + group.len() + item.key.len());
                self.push_group_stem(&mut key, group);
                key.push_str(&item.key);
                let p = item.params;
                let (own, now) = item.clock.map_or((0, 0), |clock| (OWN_CLOCK, clock.now));
                let (refunds, window) = item.refund.map_or((0, 0), |window| (REFUND, window));
                let flags = flags(p, item.shadow, item.count) | own | refunds;
                let spec = [p.window_ms, p.capacity, item.tick_ms, flags, p.rate, now, window];
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
            let (fits, seen) = seen_of(these, item.now(now_ms), item.params)?;
            if seen.verdict(item.weight, item.params).admitted != fits {
                return Err(script_error(format!("script and the Rust arithmetic disagree on {}", item.key)));
            }
            raw.push((fits, seen));
        }
        let committed = match said {
            [committed] => *committed == 1,
            _ => !items.iter().zip(&raw).any(|(item, &(fits, _))| item.blocks(fits)),
        };
        Ok(ManyOutcome { committed, verdicts: many_verdicts(items, &raw, committed, now_ms), now_ms })
    }

    /// Appends `<prefix>rle2:{<group>}:`, what every key of `group`'s jobs
    /// starts with.
    fn push_group_stem(&self, key: &mut String, group: &str) {
        key.push_str(&self.key_prefix);
        key.push_str("rle2:{");
        push_tag(key, group);
        key.push_str("}:");
    }

    /// Queues a job on the next slot and waits, at most `redis.timeout_ms`
    /// from now, for its part of the batch's answer. Small by design: this
    /// future is part of every decision's state machine.
    async fn run(&self, keys: JobKeys) -> Result<Vec<u64>, StoreError> {
        let slot = match self.backend {
            Backend::Single(_) | Backend::Sentinel(_) => 0,
            Backend::Cluster(_) => key_slot(keys.as_slice().first().map_or("", |(key, _)| key.as_str())),
        };
        if breaker_of(&self.parts.breakers, slot).admit() == Admission::Reject {
            return Err(StoreError {
                kind: FailureKind::CircuitOpen,
                message: "redis circuit breaker open after consecutive failures; not tried".to_owned(),
            });
        }
        let (reply, answer) = oneshot::channel();
        let queues = self.queues();
        let queue = self.next_slot.fetch_add(1, Ordering::Relaxed) % queues.len();
        if let Err(e) = queues[queue].try_send(Job { slot, keys, reply }) {
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

/// What every dispatcher of a store is made of.
struct Parts {
    config: RedisConfig,
    /// One against a single server; one per [`SLOTS_PER_BREAKER`] slots
    /// against a cluster.
    breakers: Arc<[Breaker]>,
}

impl Parts {
    /// `count` dispatchers on `backend`, each handed to `spawn` to run: their queues.
    fn dispatchers(
        &self,
        backend: &Backend,
        count: usize,
        mut spawn: impl FnMut(std::pin::Pin<Box<dyn Future<Output = ()> + Send>>),
    ) -> Queues {
        (0..count)
            .map(|slot| {
                let (sender, receiver) = mpsc::channel(QUEUE_PER_SLOT);
                let dispatcher = Dispatcher {
                    slot,
                    backend: backend.clone(),
                    timeout: Duration::from_millis(self.config.timeout_ms),
                    breakers: Arc::clone(&self.breakers),
                    caps: CallCaps {
                        keys: self.config.max_keys_per_call,
                        key_bytes: self.config.max_key_bytes_per_call,
                    },
                };
                spawn(Box::pin(dispatcher.run(receiver)));
                sender
            })
            .collect()
    }
}

/// Answers every job of `batch` with `error`.
fn fail_all(batch: &mut Vec<Job>, error: &StoreError) {
    for job in batch.drain(..) {
        let _ = job.reply.send(Err(error.clone()));
    }
}

/// `run`'s result, or a timeout once `timeout` has passed.
async fn within<T>(
    timeout: Duration,
    run: impl Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError> {
    tokio::time::timeout(timeout, run).await.unwrap_or_else(|_| Err(timeout_error(timeout)))
}

impl CounterStore for RedisStore {
    const NAME: &'static str = "redis";
    const REMOTE: bool = true;

    fn decide_in(
        &self,
        shares: Shares<'_>,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        // Boxed: the Redis call's future (its batch slot, its timeout, the
        // wait for a permit) would otherwise size every decision's future,
        // the in-memory ones too, and a stream allocates one per item in
        // flight.
        Box::pin(async move {
            let _permits = self.permits(shares).await;
            self.decide(user_id, counter, weight, count).await
        })
    }

    fn decide_job(
        &self,
        group: &str,
        items: &[ManyItem],
    ) -> impl Future<Output = Result<ManyOutcome, StoreError>> + Send {
        self.decide_many(group, items)
    }

    fn hold<'s>(&self, shares: Shares<'s>) -> impl Future<Output = Held<'s>> + Send {
        self.permits(shares)
    }

    /// `SCAN … MATCH` on the node serving the group's hash slot.
    fn list_keys(
        self: &Arc<Self>,
        group: &str,
        prefix: &str,
        max: usize,
    ) -> impl Future<Output = Result<Listed, StoreError>> + Send {
        self.list(group, prefix, max)
    }

    /// Redis answers: no traffic is needed to close a breaker. Also
    /// reloads the script after a Redis restart.
    async fn probe(&self, timeout: Duration) -> bool {
        let up = self.warm_up(timeout).await.is_ok();
        if up {
            self.parts.breakers.iter().for_each(Breaker::close);
        }
        up
    }

    fn breakers(&self) -> Option<Arc<[Breaker]>> {
        Some(self.breakers())
    }

    fn shared(self: &Arc<Self>) -> Option<&Arc<RedisStore>> {
        Some(self)
    }

    fn figures(self: &Arc<Self>) -> Arc<dyn Figures> {
        Arc::new(RedisFigures { redis: Arc::downgrade(self) })
    }
}

#[cfg(test)]
mod tests {
    use super::{
        dispatch::{call_size, groups},
        script::{Specs, script_call, slot_runs},
        *,
    };

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
        let spec = |n: u64| [n, 1, 1, 0, 1, 0, 0];
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
        let args = KeyArgs { spec: [1, 1, 1, 0, 1, 0, 0], weight: 1 };
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
            script_call(&batch, inline)
                .by_sha()
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
        let sha = scripts::DECIDE_BATCH.sha();
        let declared: Vec<&str> =
            ["EVALSHA", sha, "4", "x", "x", "y", "z", "1", "4"].into_iter().chain(tail).collect();
        assert_eq!(args(false), declared);
        let inline: Vec<&str> =
            ["EVALSHA", sha, "0", "2", "3", "1", "x", "x", "y", "z"].into_iter().chain(tail).collect();
        assert_eq!(args(true), inline);
    }

    #[test]
    fn a_call_takes_jobs_while_both_caps_hold_and_always_one() {
        let job = |keys: usize, len: usize| -> Vec<(String, KeyArgs)> {
            vec![("k".repeat(len), KeyArgs { spec: [0; 7], weight: 1 }); keys]
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
