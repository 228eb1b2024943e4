//! The per-slot dispatchers: each takes what is queued, groups it by node
//! (Cluster) or sends it as one call, settles every job with the answer or
//! the failure, and keeps its connection's health.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use redis::{RedisError, cluster_async::ClusterConnection};
use tokio::sync::mpsc;

use super::{
    Job, MAX_BATCH,
    backend::{Backend, Cluster, Conn, Pooled, breaker_index, classify},
    fail_all,
    script::{KeyArgs, Target, run_script, split_reply},
};
use crate::limiter::{FailureKind, StoreError, breaker::Breaker, slots::group_key};

/// Consecutive batches that missed `redis.timeout_ms` after which a
/// dispatcher stops trusting its connection (a peer that vanished without a
/// reset never errors) and takes a fresh one. One slow call is not enough:
/// replacing connections while Redis is merely overloaded adds load.
pub(super) const TIMEOUTS_BEFORE_RECONNECT: u32 = 3;

/// How much one script call may carry (`redis.max_keys_per_call`,
/// `redis.max_key_bytes_per_call`): a bigger batch is split into calls in
/// order, so no batch of hostile (many, long) keys holds Redis' single
/// thread for long. A job is never split: one that alone exceeds a cap
/// goes in a call of its own.
#[derive(Debug, Clone, Copy)]
pub(super) struct CallCaps {
    pub(super) keys: usize,
    pub(super) key_bytes: usize,
}

/// How many leading jobs of `batch` the next script call carries: as many
/// as fit both caps, and at least one.
pub(super) fn call_size<'a>(
    jobs: impl IntoIterator<Item = &'a [(String, KeyArgs)]>,
    caps: CallCaps,
) -> usize {
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
pub(super) struct Dispatcher {
    pub(super) slot: usize,
    pub(super) backend: Backend,
    pub(super) timeout: Duration,
    pub(super) breakers: Arc<[Breaker]>,
    pub(super) caps: CallCaps,
}

/// How one script call (or, in a cluster, the calls of one batch) went,
/// for the breaker and the reconnect rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Health {
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
    pub(super) async fn run(self, mut queue: mpsc::Receiver<Job>) {
        let mut batch = Vec::with_capacity(MAX_BATCH);
        // Every call's deadline, one timer for the dispatcher's life. Each
        // call moves it later (tokio then only updates the entry in place);
        // a fresh timer per call would be registered ahead of the runtime's
        // next wake-up, and each registration writes to its eventfd. Kept
        // armed while calls follow each other, it also keeps the decisions'
        // own deadlines from being the earliest.
        let mut deadline = Box::pin(tokio::time::sleep(self.timeout));
        // Jobs past the caps of the last call: the next call's first, in order.
        let mut rest: Vec<Job> = Vec::new();
        let mut conn: Option<Conn> = None;
        let mut timeouts = 0;
        loop {
            if !self.next_batch(&mut queue, &mut batch, &mut rest).await {
                break;
            }
            if batch.is_empty() {
                continue;
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
                Some(Conn::Single(connection)) => {
                    self.dispatch_single(connection, &mut batch, deadline.as_mut()).await
                }
                Some(Conn::Cluster(connection)) => self.dispatch_cluster(connection, &mut batch).await,
                None => unreachable!("a connection was just set"),
            };
            self.after_call(health, &mut conn, &mut timeouts);
        }
    }

    /// Fills `batch` for the next call: the jobs past the last call's caps
    /// first (`rest`), then what is queued, up to [`MAX_BATCH`]; without
    /// left-overs it waits for the queue. Drops the jobs whose caller gave
    /// up (its deadline passed while the job queued: it was answered by its
    /// failure policy, so it is not counted now), and keeps in `rest` what
    /// is past this call's caps. `false` once the queue is closed.
    async fn next_batch(
        &self,
        queue: &mut mpsc::Receiver<Job>,
        batch: &mut Vec<Job>,
        rest: &mut Vec<Job>,
    ) -> bool {
        if rest.is_empty() {
            if queue.recv_many(batch, MAX_BATCH).await == 0 {
                return false;
            }
        } else {
            batch.append(rest);
            while batch.len() < MAX_BATCH {
                let Ok(job) = queue.try_recv() else { break };
                batch.push(job);
            }
        }
        batch.retain(|job: &Job| !job.reply.is_closed());
        let size = call_size(batch.iter().map(|job| job.keys.as_slice()), self.caps);
        if size < batch.len() {
            *rest = batch.split_off(size);
        }
        true
    }

    /// What a call's `health` does to the connection: a run of
    /// [`TIMEOUTS_BEFORE_RECONNECT`] timeouts, a READONLY answer (a demoted
    /// master) or a broken connection make the next call take another.
    fn after_call(&self, health: Health, conn: &mut Option<Conn>, timeouts: &mut u32) {
        let slot = self.slot;
        match health {
            Health::Answered => *timeouts = 0,
            Health::TimedOut => {
                *timeouts += 1;
                if *timeouts >= TIMEOUTS_BEFORE_RECONNECT && conn.take().is_some() {
                    tracing::debug!(
                        slot,
                        timeouts = *timeouts,
                        "redis connection unresponsive; dispatcher takes a new one"
                    );
                }
            }
            Health::Demoted => {
                *timeouts = 0;
                if let Some(Conn::Single(pooled)) = conn.take() {
                    // Closed, not pooled: the next connection asks
                    // the sentinels for the master.
                    pooled.discard();
                    tracing::info!(slot, "redis answered READONLY; dispatcher reconnects to the master");
                }
            }
            Health::Failed => {
                *timeouts = 0;
                if matches!(conn, Some(Conn::Single(_))) {
                    // Back to the pool, which PINGs it before reuse and
                    // drops it when that fails; the next batch takes
                    // another. (A cluster connection reconnects to its
                    // nodes by itself.)
                    *conn = None;
                    tracing::debug!(slot, "redis connection broken; dispatcher takes a new one");
                }
            }
        }
    }

    pub(super) async fn connect(&self) -> Result<Conn, StoreError> {
        match &self.backend {
            Backend::Single(_) | Backend::Sentinel(_) => self.backend.pooled().await.map(Conn::Single),
            Backend::Cluster(cluster) => cluster.connect().await.map(Conn::Cluster),
        }
    }

    /// Tells the breakers of `batch`'s slots how Redis did (once per
    /// breaker, however many of its jobs the batch holds).
    pub(super) fn report(&self, batch: &[Job], health: Health) {
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

    /// One script call for the whole batch, answered within `timeout`
    /// (`deadline`, reset to it).
    pub(super) async fn dispatch_single(
        &self,
        conn: &mut Pooled,
        batch: &mut Vec<Job>,
        mut deadline: std::pin::Pin<&mut tokio::time::Sleep>,
    ) -> Health {
        // Nobody waits longer than `timeout` for this answer. A late reply
        // on a kept connection is read and discarded by the client.
        deadline.as_mut().reset(tokio::time::Instant::now() + self.timeout);
        let call = tokio::select! {
            biased;
            answer = run_script(Target::Server(conn.connection()), batch) => Ok(answer),
            () = deadline => Err(TimedOut),
        };
        self.settle_call(call, batch)
    }

    /// Settles one call: tells the breakers of its jobs' slots how Redis
    /// did and hands each job its answer.
    pub(super) fn settle_call(&self, call: CallResult, batch: &mut Vec<Job>) -> Health {
        let (health, result) = settle(call, self.timeout);
        self.report(batch, health);
        answer(batch, result);
        health
    }

    /// One script call per node (per slot without a usable slot map), all
    /// in flight together.
    pub(super) async fn dispatch_cluster(&self, conn: &ClusterConnection, batch: &mut Vec<Job>) -> Health {
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
    pub(super) async fn call_node(
        &self,
        cluster: &Cluster,
        mut conn: ClusterConnection,
        mut group: Vec<Job>,
    ) -> Health {
        let first = group[0].slot;
        if group.iter().all(|job| job.slot == first) {
            return self.call_slot(conn, group).await;
        }
        let call = tokio::time::timeout(self.timeout, run_script(Target::Node(&mut conn, first), &group))
            .await
            .map_err(|_| TimedOut);
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
    pub(super) async fn call_slot(&self, mut conn: ClusterConnection, mut group: Vec<Job>) -> Health {
        let call = tokio::time::timeout(self.timeout, run_script(Target::Slot(&mut conn), &group))
            .await
            .map_err(|_| TimedOut);
        self.settle_call(call, &mut group)
    }
}

/// Empties `batch` into groups of equal `key(slot)`, each sorted by slot,
/// in order of key. Stable: jobs on one counter (hence one slot) keep their
/// order.
pub(super) fn groups(batch: &mut Vec<Job>, key: impl Fn(u16) -> u32) -> Vec<Vec<Job>> {
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
pub(super) fn combined(healths: Vec<Health>) -> Health {
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
pub(super) fn refused_as_not_local(e: &RedisError) -> bool {
    e.to_string().contains("non local key")
}

/// A script call's answer, or its deadline passed.
pub(super) type CallResult = Result<Result<Vec<u64>, RedisError>, TimedOut>;

/// A call's deadline passed first.
#[derive(Debug, Clone, Copy)]
pub(super) struct TimedOut;

/// How Redis did on one call, and its answer with any error classified
/// (once).
pub(super) fn settle(call: CallResult, timeout: Duration) -> (Health, Result<Vec<u64>, StoreError>) {
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
pub(super) fn answer(batch: &mut Vec<Job>, result: Result<Vec<u64>, StoreError>) {
    match result {
        Ok(reply) => split_reply(batch, &reply),
        Err(error) => fail_all(batch, &error),
    }
}

pub(super) fn timeout_error(timeout: Duration) -> StoreError {
    StoreError { kind: FailureKind::Timeout, message: format!("no answer within {} ms", timeout.as_millis()) }
}
