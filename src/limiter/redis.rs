//! The Redis counter store: one Lua script (`scripts/decide_batch.lua`),
//! called by SHA and reloaded on NOSCRIPT; one hash per counter, at
//! `rl:{<user_id>}:<rule_id>` (Check) or `rle:{<domain>}:<key>` (Envoy).
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
//! Connections come from a deadpool-redis pool, which creates them under
//! `redis.connect_timeout_ms` and health-checks (PINGs) one before handing
//! it out again; a dispatcher whose call failed on the connection returns
//! it and takes a fresh one for its next batch.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use deadpool_redis::{Pool, PoolError, Runtime};
use redis::{AsyncConnectionConfig, RedisError};
use tokio::sync::{mpsc, oneshot};

use super::{
    FailureKind, ManyItem, ManyOutcome, StoreError,
    breaker::{Admission, Breaker},
    many_verdicts,
    window::{self, Counts, Verdict},
};
use crate::{config::RedisConfig, config::redact_url, rules::Rule};

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

/// Per counter: W in ticks, capacity, weight, tick length in ms, flags
/// (1 = sliding, 2 = shadow) — the script's five arguments.
type KeyArgs = [u64; 5];

/// One decision waiting for its batch.
struct Job {
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

/// Counters in one Redis server.
pub struct RedisStore {
    pool: Pool,
    queues: Box<[mpsc::Sender<Job>]>,
    next_slot: AtomicUsize,
    script: Arc<redis::Script>,
    timeout: Duration,
    breaker: Arc<Breaker>,
    url_for_logs: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.url_for_logs)
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
    /// Builds the pool and starts one dispatcher task per slot (so it must
    /// be called inside a Tokio runtime). Does not connect: see
    /// [`RedisStore::warm_up`]. The dispatchers end once the store is
    /// dropped and their queued jobs are answered.
    pub fn new(config: &RedisConfig, url: &str) -> Result<Self, RedisSetupError> {
        let setup_error = |message: String| RedisSetupError { url: redact_url(url), message };
        // The per-call deadline is ours (`timeout_ms`); the client's own
        // response timeout would only race it.
        let connection_config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(config.connect_timeout_ms)))
            .set_response_timeout(None);
        let manager = deadpool_redis::Manager::new_with_config(url, connection_config)
            .map_err(|e| setup_error(e.to_string()))?;
        // One connection per dispatcher, one for `warm_up` (the readiness
        // probe), and room for a replacement while a broken one is dropped.
        let pool = Pool::builder(manager)
            .max_size(config.connections * 2 + 1)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(Duration::from_millis(config.connect_timeout_ms)))
            // Handing out a returned connection PINGs it first; a peer that
            // stopped answering must not hang a dispatcher in that PING.
            .recycle_timeout(Some(Duration::from_millis(config.connect_timeout_ms)))
            .wait_timeout(Some(Duration::from_millis(config.connect_timeout_ms)))
            .build()
            .map_err(|e| setup_error(e.to_string()))?;
        let script = Arc::new(redis::Script::new(DECIDE_BATCH_LUA));
        let timeout = Duration::from_millis(config.timeout_ms);
        let breaker =
            Arc::new(Breaker::new(config.breaker_failures, Duration::from_millis(config.breaker_open_ms)));
        let queues = (0..config.connections)
            .map(|slot| {
                let (sender, receiver) = mpsc::channel(QUEUE_PER_SLOT);
                let dispatcher = Dispatcher {
                    slot,
                    pool: pool.clone(),
                    script: Arc::clone(&script),
                    timeout,
                    breaker: Arc::clone(&breaker),
                };
                tokio::spawn(dispatcher.run(receiver));
                sender
            })
            .collect();
        Ok(RedisStore {
            pool,
            queues,
            next_slot: AtomicUsize::new(0),
            script,
            timeout,
            breaker,
            url_for_logs: redact_url(url),
        })
    }

    /// The URL with any password masked.
    pub fn url_for_logs(&self) -> &str {
        &self.url_for_logs
    }

    /// Checks within `timeout` that Redis answers, and loads the script so
    /// the first decision does not meet NOSCRIPT. Used at startup and by
    /// the readiness probe to say whether Redis is up; a failure is not fatal.
    pub async fn warm_up(&self, timeout: Duration) -> Result<(), StoreError> {
        let load = async {
            let mut conn = self.pool.get().await.map_err(|e| classify_pool(&e))?;
            let loaded: Result<String, RedisError> = self.script.load_async(&mut *conn).await;
            loaded.map(drop).map_err(|e| classify(&e))
        };
        match tokio::time::timeout(timeout, load).await {
            Ok(result) => result,
            Err(_) => Err(timeout_error(timeout)),
        }
    }

    /// Decides one request (one counter) within `redis.timeout_ms`.
    pub async fn decide(&self, user_id: &str, rule: &Rule, weight: u64) -> Result<Verdict, StoreError> {
        let params = rule.window;
        let args = [params.window_ms, params.capacity, weight, 1, u64::from(params.sliding)];
        let reply = self.run(JobKeys::One([(counter_key(user_id, &rule.id), args)])).await?;
        let &[committed, fits, current, previous, elapsed] = reply.as_slice() else {
            return Err(script_error(format!("script answered {} values for one key", reply.len())));
        };
        if elapsed >= params.window_ms {
            return Err(script_error(format!(
                "elapsed {elapsed} ms outside a {} ms window",
                params.window_ms
            )));
        }
        let verdict = window::decide(Counts { current, previous }, elapsed, weight, params);
        if verdict.admitted != (fits == 1) || committed != fits {
            // The script and window.rs disagree: a bug, never papered over.
            return Err(script_error(format!(
                "script answered fits={fits} committed={committed} where the arithmetic says {} (counts {current}/{previous} at {elapsed} ms)",
                verdict.admitted
            )));
        }
        Ok(verdict)
    }

    /// All-or-nothing decision over several counters of `group` in one job;
    /// see [`Store::decide_many`](super::Store::decide_many). Keys are
    /// `rle:{<group>}:<key>`: the hash tag puts one group's counters in one
    /// cluster slot, which a multi-key script requires.
    pub async fn decide_many(&self, group: &str, items: &[ManyItem]) -> Result<ManyOutcome, StoreError> {
        let keys = items
            .iter()
            .map(|item| {
                let mut key = String::with_capacity(6 + group.len() + item.key.len());
                key.push_str("rle:{");
                key.push_str(group);
                key.push_str("}:");
                key.push_str(&item.key);
                let flags = u64::from(item.params.sliding) | (u64::from(item.shadow) << 1);
                (key, [item.params.window_ms, item.params.capacity, item.weight, item.tick_ms, flags])
            })
            .collect();
        let reply = self.run(JobKeys::Many(keys)).await?;
        if reply.len() != 1 + 4 * items.len() {
            return Err(script_error(format!(
                "script answered {} values for {} keys",
                reply.len(),
                items.len()
            )));
        }
        let committed = reply[0] == 1;
        let mut raw = Vec::with_capacity(items.len());
        for (item, chunk) in items.iter().zip(reply[1..].chunks_exact(4)) {
            let (fits, current, previous, elapsed) = (chunk[0] == 1, chunk[1], chunk[2], chunk[3]);
            if elapsed >= item.params.window_ms {
                return Err(script_error(format!(
                    "elapsed {elapsed} outside a window of {}",
                    item.params.window_ms
                )));
            }
            let counts = Counts { current, previous };
            if window::decide(counts, elapsed, item.weight, item.params).admitted != fits {
                return Err(script_error(format!("script and window.rs disagree on {}", item.key)));
            }
            raw.push((fits, counts, elapsed));
        }
        Ok(ManyOutcome { committed, verdicts: many_verdicts(items, &raw, committed) })
    }

    /// Queues a job on the next slot and waits, at most `redis.timeout_ms`
    /// from now, for its part of the batch's answer. Small by design: this
    /// future is part of every decision's state machine.
    async fn run(&self, keys: JobKeys) -> Result<Vec<u64>, StoreError> {
        if self.breaker.admit() == Admission::Reject {
            return Err(StoreError {
                kind: FailureKind::CircuitOpen,
                message: "redis circuit breaker open after consecutive failures; not tried".to_owned(),
            });
        }
        let (reply, answer) = oneshot::channel();
        let slot = self.next_slot.fetch_add(1, Ordering::Relaxed) % self.queues.len();
        if let Err(e) = self.queues[slot].try_send(Job { keys, reply }) {
            return Err(match e {
                mpsc::error::TrySendError::Full(_) => StoreError {
                    kind: FailureKind::PoolExhausted,
                    message: format!("{QUEUE_PER_SLOT} decisions already wait for redis connection {slot}"),
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

/// One slot's dispatcher: takes everything queued (up to [`MAX_BATCH`]),
/// sends it as one script call, hands each job its part of the answer, and
/// tells the breaker how Redis did.
struct Dispatcher {
    slot: usize,
    pool: Pool,
    script: Arc<redis::Script>,
    timeout: Duration,
    breaker: Arc<Breaker>,
}

impl Dispatcher {
    async fn run(self, mut queue: mpsc::Receiver<Job>) {
        let slot = self.slot;
        let mut batch = Vec::with_capacity(MAX_BATCH);
        let mut conn: Option<deadpool_redis::Connection> = None;
        let mut timeouts = 0;
        while queue.recv_many(&mut batch, MAX_BATCH).await > 0 {
            // A caller that gave up (its deadline passed while the job queued)
            // was answered by its failure policy: do not count it now.
            batch.retain(|job: &Job| !job.reply.is_closed());
            if batch.is_empty() {
                continue;
            }
            if conn.is_none() {
                // Bounded by `redis.connect_timeout_ms`, not by the decisions'
                // deadline: callers stop waiting at theirs (and are answered by
                // policy), but a connection that takes longer than one decision
                // to open is still worth having for the next ones.
                match self.pool.get().await {
                    Ok(fresh) => conn = Some(fresh),
                    Err(e) => {
                        self.breaker.failure();
                        fail_all(&mut batch, &classify_pool(&e));
                        continue;
                    }
                }
                batch.retain(|job: &Job| !job.reply.is_closed());
                if batch.is_empty() {
                    continue;
                }
            }
            // Nobody waits longer than `timeout` for this answer. A late reply
            // on a kept connection is read and discarded by the client.
            let result = match tokio::time::timeout(self.timeout, call(&mut conn, &self.script, &batch)).await
            {
                Ok(result) => {
                    timeouts = 0;
                    result
                }
                Err(_) => {
                    timeouts += 1;
                    if timeouts >= TIMEOUTS_BEFORE_RECONNECT && conn.take().is_some() {
                        tracing::debug!(
                            slot,
                            timeouts,
                            "redis connection unresponsive; dispatcher takes a new one"
                        );
                    }
                    Err(timeout_error(self.timeout))
                }
            };
            match result {
                Ok(reply) => {
                    self.breaker.success();
                    split_reply(&mut batch, &reply);
                }
                Err(error) => {
                    // A script error is an answer: Redis is there.
                    if error.kind != FailureKind::ScriptError {
                        self.breaker.failure();
                    }
                    fail_all(&mut batch, &error);
                }
            }
        }
    }
}

fn fail_all(batch: &mut Vec<Job>, error: &StoreError) {
    for job in batch.drain(..) {
        let _ = job.reply.send(Err(error.clone()));
    }
}

/// Sends one batch on `conn` (which the caller has filled), emptying it
/// when the connection turns out broken.
async fn call(
    conn: &mut Option<deadpool_redis::Connection>,
    script: &redis::Script,
    batch: &[Job],
) -> Result<Vec<u64>, StoreError> {
    let Some(connection) = conn.as_mut() else {
        return Err(StoreError { kind: FailureKind::Other, message: "no redis connection".to_owned() });
    };
    let mut invocation = script.prepare_invoke();
    for job in batch {
        for (key, _) in job.keys.as_slice() {
            invocation.key(key.as_str());
        }
    }
    invocation.arg(batch.len());
    for job in batch {
        let keys = job.keys.as_slice();
        invocation.arg(keys.len());
        for (_, args) in keys {
            for value in args {
                invocation.arg(*value);
            }
        }
    }
    let reply: Result<Vec<u64>, RedisError> = invocation.invoke_async(&mut **connection).await;
    reply.map_err(|e| {
        if e.is_connection_dropped() || e.is_io_error() || e.is_unrecoverable_error() {
            // Back to the pool, which PINGs it before reuse and drops it
            // when that fails; the next batch takes another.
            *conn = None;
            tracing::debug!("redis connection broken; dispatcher takes a new one");
        }
        classify(&e)
    })
}

/// Hands each job of `batch` its slice of `reply` (committed, then four
/// values per key), emptying `batch`.
fn split_reply(batch: &mut Vec<Job>, reply: &[u64]) {
    let expected: usize = batch.iter().map(|job| 1 + 4 * job.keys.as_slice().len()).sum();
    if reply.len() != expected {
        fail_all(
            batch,
            &script_error(format!("script answered {} values for a batch needing {expected}", reply.len())),
        );
        return;
    }
    let mut at = 0;
    for job in batch.drain(..) {
        let len = 1 + 4 * job.keys.as_slice().len();
        let _ = job.reply.send(Ok(reply[at..at + len].to_vec()));
        at += len;
    }
}

fn timeout_error(timeout: Duration) -> StoreError {
    StoreError { kind: FailureKind::Timeout, message: format!("no answer within {} ms", timeout.as_millis()) }
}

/// `rl:{<user_id>}:<rule_id>`, built in one allocation. The hash tag keeps
/// all of a user's counters in one Redis Cluster slot.
pub fn counter_key(user_id: &str, rule_id: &str) -> String {
    let mut key = String::with_capacity(6 + user_id.len() + rule_id.len());
    key.push_str("rl:{");
    key.push_str(user_id);
    key.push_str("}:");
    key.push_str(rule_id);
    key
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
    } else if matches!(e.kind(), redis::ErrorKind::Server(_) | redis::ErrorKind::UnexpectedReturnType) {
        FailureKind::ScriptError
    } else {
        FailureKind::Other
    };
    StoreError { kind, message: e.to_string() }
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
        assert_eq!(counter_key("u-1", "playback"), "rl:{u-1}:playback");
    }
}
