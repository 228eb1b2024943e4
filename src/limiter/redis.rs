//! The Redis counter store: one Lua script (`scripts/decide.lua`), called by
//! SHA and reloaded on NOSCRIPT, one hash per `(user, rule)` at
//! `rl:{<user_id>}:<rule_id>`.
//!
//! Connections come from a deadpool-redis pool, but a decision does not check
//! one out exclusively: each of `redis.connections` slots keeps one pooled
//! multiplexed connection, and concurrent decisions share it, so their
//! EVALSHAs are pipelined on the wire instead of waiting for each other's
//! round trip. (An exclusive checkout per call would serialise callers per
//! connection, and deadpool-redis' recycle check PINGs Redis on every checkout
//! — a second round trip per decision.) A slot whose connection breaks is
//! emptied and refilled from the pool, which health-checks what it hands out.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use arc_swap::ArcSwapOption;
use deadpool_redis::{Pool, PoolError, Runtime};
use redis::{AsyncConnectionConfig, RedisError, aio::MultiplexedConnection};

use super::{
    FailureKind, ManyItem, ManyOutcome, StoreError, many_verdicts,
    window::{self, Counts, Verdict},
};
use crate::{config::RedisConfig, config::redact_url, rules::Rule};

const DECIDE_LUA: &str = include_str!("scripts/decide.lua");
const DECIDE_MANY_LUA: &str = include_str!("scripts/decide_many.lua");

type Slot = ArcSwapOption<deadpool_redis::Connection>;

/// Counters in one Redis server.
pub struct RedisStore {
    pool: Pool,
    slots: Box<[Slot]>,
    next_slot: AtomicUsize,
    script: redis::Script,
    many_script: redis::Script,
    timeout: Duration,
    url_for_logs: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.url_for_logs)
            .field("slots", &self.slots.len())
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
    /// Builds the pool. Does not connect: see [`RedisStore::ping`].
    pub fn new(config: &RedisConfig, url: &str) -> Result<Self, RedisSetupError> {
        let setup_error = |message: String| RedisSetupError { url: redact_url(url), message };
        // The per-call deadline is ours (`timeout_ms`); the client's own
        // response timeout would only race it.
        let connection_config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(config.connect_timeout_ms)))
            .set_response_timeout(None);
        let manager = deadpool_redis::Manager::new_with_config(url, connection_config)
            .map_err(|e| setup_error(e.to_string()))?;
        // Twice the slots: a broken connection is still checked out while
        // its replacement is being created.
        let pool = Pool::builder(manager)
            .max_size(config.connections * 2)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(Duration::from_millis(config.connect_timeout_ms)))
            .build()
            .map_err(|e| setup_error(e.to_string()))?;
        Ok(RedisStore {
            pool,
            slots: (0..config.connections).map(|_| Slot::empty()).collect(),
            next_slot: AtomicUsize::new(0),
            script: redis::Script::new(DECIDE_LUA),
            many_script: redis::Script::new(DECIDE_MANY_LUA),
            timeout: Duration::from_millis(config.timeout_ms),
            url_for_logs: redact_url(url),
        })
    }

    /// The URL with any password masked.
    pub fn url_for_logs(&self) -> &str {
        &self.url_for_logs
    }

    /// Checks within `timeout` that Redis answers, and loads the script so
    /// the first decision does not meet NOSCRIPT. Used at startup to say
    /// whether Redis is up; a failure is not fatal.
    pub async fn warm_up(&self, timeout: Duration) -> Result<(), StoreError> {
        let load = async {
            let (_, mut conn) = self.connection().await?;
            for script in [&self.script, &self.many_script] {
                let loaded: Result<String, RedisError> = script.load_async(&mut conn).await;
                loaded.map_err(|e| classify(&e))?;
            }
            Ok(())
        };
        self.within(timeout, load).await
    }

    /// Decides one request by running the script; the whole call, connection
    /// included, is bounded by `redis.timeout_ms`.
    pub async fn decide(&self, user_id: &str, rule: &Rule, weight: u64) -> Result<Verdict, StoreError> {
        let params = rule.window;
        let key = counter_key(user_id, &rule.id);
        let call = async {
            let (slot, mut conn) = self.connection().await?;
            let mut invocation = self.script.prepare_invoke();
            invocation.key(key.as_str()).arg(params.window_ms).arg(params.capacity).arg(weight);
            match invocation.invoke_async::<(u8, u64, u64, u64)>(&mut conn).await {
                Ok(reply) => Ok(reply),
                Err(e) => {
                    if e.is_connection_dropped() || e.is_io_error() || e.is_unrecoverable_error() {
                        self.release_broken(slot);
                    }
                    Err(classify(&e))
                }
            }
        };
        let (admitted, current, previous, elapsed) = self.within(self.timeout, call).await?;
        if elapsed >= params.window_ms {
            return Err(script_error(format!(
                "elapsed {elapsed} ms outside a {} ms window",
                params.window_ms
            )));
        }
        let verdict = window::decide(Counts { current, previous }, elapsed, weight, params);
        if verdict.admitted != (admitted == 1) {
            // The script and window.rs disagree: a bug, never papered over.
            return Err(script_error(format!(
                "script answered admitted={admitted} where the arithmetic says {} (counts {current}/{previous} at {elapsed} ms)",
                verdict.admitted
            )));
        }
        Ok(verdict)
    }

    /// All-or-nothing decision over several counters of `group` in one
    /// script call; see [`Store::decide_many`](super::Store::decide_many).
    /// Keys are `rle:{<group>}:<key>`: the hash tag puts one group's
    /// counters in one cluster slot, which a multi-key script requires.
    pub async fn decide_many(&self, group: &str, items: &[ManyItem]) -> Result<ManyOutcome, StoreError> {
        let call = async {
            let (slot, mut conn) = self.connection().await?;
            let mut invocation = self.many_script.prepare_invoke();
            for item in items {
                let mut key = String::with_capacity(8 + group.len() + item.key.len());
                key.push_str("rle:{");
                key.push_str(group);
                key.push_str("}:");
                key.push_str(&item.key);
                let flags = u8::from(item.params.sliding) | (u8::from(item.shadow) << 1);
                invocation
                    .key(key)
                    .arg(item.params.window_ms)
                    .arg(item.params.capacity)
                    .arg(item.weight)
                    .arg(item.tick_ms)
                    .arg(flags);
            }
            match invocation.invoke_async::<Vec<u64>>(&mut conn).await {
                Ok(reply) => Ok(reply),
                Err(e) => {
                    if e.is_connection_dropped() || e.is_io_error() || e.is_unrecoverable_error() {
                        self.release_broken(slot);
                    }
                    Err(classify(&e))
                }
            }
        };
        let reply = self.within(self.timeout, call).await?;
        if reply.len() != 1 + 4 * items.len() {
            return Err(script_error(format!(
                "multi-key script answered {} values for {} keys",
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
                return Err(script_error(format!("multi-key script and window.rs disagree on {}", item.key)));
            }
            raw.push((fits, counts, elapsed));
        }
        Ok(ManyOutcome { committed, verdicts: many_verdicts(items, &raw, committed) })
    }

    async fn within<T>(
        &self,
        timeout: Duration,
        call: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        match tokio::time::timeout(timeout, call).await {
            Ok(result) => result,
            Err(_) => Err(StoreError {
                kind: FailureKind::Timeout,
                message: format!("no answer within {} ms", timeout.as_millis()),
            }),
        }
    }

    /// A shared multiplexed connection from the next slot, filling the slot
    /// from the pool when it is empty.
    async fn connection(&self) -> Result<(usize, MultiplexedConnection), StoreError> {
        let index = self.next_slot.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let slot = &self.slots[index];
        if let Some(pooled) = slot.load().as_ref() {
            return Ok((index, MultiplexedConnection::clone(pooled)));
        }
        let pooled = Arc::new(self.pool.get().await.map_err(|e| classify_pool(&e))?);
        let conn = MultiplexedConnection::clone(&pooled);
        // If another caller filled the slot first, ours goes back to the pool.
        let _ = slot.compare_and_swap(&None::<Arc<deadpool_redis::Connection>>, Some(pooled));
        Ok((index, conn))
    }

    fn release_broken(&self, index: usize) {
        // The pool re-checks the returned connection (PING) before reuse and
        // drops it when it fails.
        if self.slots[index].swap(None).is_some() {
            tracing::debug!(slot = index, "redis connection broken; slot emptied");
        }
    }
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
