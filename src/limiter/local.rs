//! The local limiter: what decides when the shared store cannot (failure
//! policy `local`, the default).
//!
//! A decision the store could not make (deadline missed, Redis error,
//! breaker open, memory store full) is decided here instead, by the same
//! pure arithmetic, on counters of this instance alone, at this instance's
//! share of the limit: `ceil(capacity / instances)` (and the same share of
//! a bucket's rate). Repeats are limited, so a limit never turns into
//! "unlimited" whatever the store does; it turns into a local one, and the
//! engine flags every such answer.
//!
//! Every admission counted here is owed to the shared store: the
//! reconciler ([`Reconciler`], a periodic exchange) writes the owed hits back as reports
//! once the store answers again, so nothing admitted during an outage is
//! forgotten.
//!
//! Bounds, whatever callers send:
//! - the counters are a [`MemoryStore`] of `local.max_counters`: a full
//!   shard evicts the counter holding least of its limit into its summary,
//!   owed or not, so a newcomer always gets a counter and an evicted key
//!   returns at least at its count;
//! - the owed hits are at most `local.max_counters` entries too (plus at
//!   most one per thread deciding at the same instant): an admission that
//!   needs a new entry past the bound folds the entry owing least among
//!   [`FOLD_SAMPLE`] (a flood's one-hit keys first) into a count of folded
//!   hits, which are not written back. So a flood of distinct keys during
//!   an outage never refuses a newcomer, and what it makes the shared store
//!   miss is its own keys' hits, the least owed.

use std::{
    collections::HashMap,
    future::Future,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures_util::future::BoxFuture;

use super::{
    Clock, Count, CounterSpec, CounterStore, Listed, ManyItem, ManyOutcome, MemoryStore, RedisStore, Shares,
    Store, StoreError, Verdict, WindowParams, exchange::Participant,
};
use crate::telemetry::exposition::Figures;

/// How the local limiter runs (from `local.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    /// The most local counters, and the most owed entries.
    pub max_counters: usize,
    /// Shards of the local counter map.
    pub shards: usize,
    /// How many instances share a limit when no instance report says
    /// (`local.instances`).
    pub instances: u64,
    /// How often owed hits are written back (and, with Redis, this
    /// instance reports itself alive).
    pub reconcile_interval: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            max_counters: 100_000,
            shards: 16,
            instances: 1,
            reconcile_interval: Duration::from_secs(1),
        }
    }
}

/// Which counter of the shared store an owed entry is for.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum OwedKey {
    /// A native rule's counter: rule id and user.
    Counter(Arc<str>, Box<str>),
    /// An item of a multi-counter decision: group and key.
    Item(Box<str>, Box<str>),
}

/// One owed entry, as a process leaves it in its state directory.
pub type Owing = (OwedKey, Owed);

/// Hits admitted locally and not yet written to the shared store.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Owed {
    /// Of a native counter with `window`.
    Counter { window: WindowParams, hits: u64 },
    /// Of a multi-counter item (its `weight` is the hits owed).
    Item(ManyItem),
}

/// Owed entries looked at to choose the one folded when they are at their
/// bound: the one owing least of them goes.
pub const FOLD_SAMPLE: usize = 64;

/// Local counters at this instance's share of each limit, and the hits they
/// owe the shared store.
#[derive(Debug)]
pub struct LocalLimiter {
    counters: MemoryStore,
    owed: Mutex<HashMap<OwedKey, Owed>>,
    max_owed: usize,
    /// Hits folded out of the owed entries (never written back).
    folded: AtomicU64,
    /// The divisor of every limit: instances reported alive, else the configured number.
    instances: AtomicU64,
    configured_instances: u64,
    /// Hits written back to the shared store.
    written_back: AtomicU64,
}

impl LocalLimiter {
    /// A limiter of `settings`, reading `clock`.
    pub fn new(settings: Settings, clock: Arc<dyn Clock>) -> Self {
        let instances = settings.instances.max(1);
        LocalLimiter {
            counters: MemoryStore::new(settings.shards, settings.max_counters, clock),
            owed: Mutex::default(),
            max_owed: settings.max_counters.max(1),
            folded: AtomicU64::new(0),
            instances: AtomicU64::new(instances),
            configured_instances: instances,
            written_back: AtomicU64::new(0),
        }
    }

    /// The number of instances each limit is shared by now.
    pub fn instances(&self) -> u64 {
        self.instances.load(Ordering::Relaxed)
    }

    /// Sets the number of instances from a report (`None`: no report; the
    /// configured number applies). Never below 1.
    pub fn set_instances(&self, reported: Option<u64>) {
        self.instances.store(reported.unwrap_or(self.configured_instances).max(1), Ordering::Relaxed);
    }

    /// This instance's share of `params`: capacity and rate divided by the
    /// instances, rounded up, at least 1; a limit of zero (a global limit
    /// whose region is claimed by another deployment) stays zero.
    pub fn share(&self, params: WindowParams) -> WindowParams {
        if params.capacity == 0 {
            return params;
        }
        let n = self.instances();
        WindowParams {
            capacity: params.capacity.div_ceil(n).max(1),
            rate: params.rate.div_ceil(n).max(1),
            ..params
        }
    }

    /// Decides a native counter locally, at this instance's share; an
    /// admission (or a report) is owed to the shared store.
    pub fn decide(
        &self,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> Result<Verdict, StoreError> {
        let key = OwedKey::Counter(Arc::clone(counter.id), user_id.into());
        // Slots in flight are not handed on: what this instance took and
        // gave back while the store was out stays here (see owes_the_store).
        let owes = owes_the_store(count, weight, counter.window);
        if owes {
            self.make_room(&key);
        }
        let shared = CounterSpec { id: counter.id, window: self.share(counter.window) };
        let verdict = self.counters.decide(user_id, shared, weight, count)?;
        if owes && (count.whatever_is_left() || verdict.admitted) {
            self.owe(key, Owed::Counter { window: counter.window, hits: weight });
        }
        Ok(verdict)
    }

    /// Decides several counters of `group` locally, all or nothing, at this
    /// instance's share of each; what was counted is owed to the shared
    /// store. A refund is given back here only: owed, it would merge with
    /// the key's owed usage (and a later write-back give back too much),
    /// so the shared store keeps the estimate charged (never less).
    pub fn decide_many(&self, group: &str, items: &[ManyItem]) -> Result<ManyOutcome, StoreError> {
        let owing =
            |item: &ManyItem| item.refund.is_none() && owes_the_store(item.count, item.weight, item.params);
        let keys: Vec<OwedKey> = items
            .iter()
            .filter(|i| owing(i))
            .map(|i| OwedKey::Item(group.into(), i.key.as_str().into()))
            .collect();
        keys.iter().for_each(|key| self.make_room(key));
        let shared: Vec<ManyItem> =
            items.iter().map(|item| ManyItem { params: self.share(item.params), ..item.clone() }).collect();
        let outcome = self.counters.decide_many(group, &shared)?;
        let mut keys = keys.into_iter();
        for (item, verdict) in items.iter().zip(&outcome.verdicts) {
            if !owing(item) {
                continue;
            }
            let key = keys.next().expect("one key per owing item");
            let counted = item.count.whatever_is_left() || (outcome.committed && verdict.admitted);
            if counted {
                self.owe(key, Owed::Item(ManyItem { count: Count::Always, shadow: false, ..item.clone() }));
            }
        }
        Ok(outcome)
    }

    /// Room for `key` among the owed entries: at the bound, the entry owing
    /// least among [`FOLD_SAMPLE`] is folded (its hits counted, not owed).
    fn make_room(&self, key: &OwedKey) {
        let mut owed = self.owed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if owed.len() < self.max_owed || owed.contains_key(key) {
            return;
        }
        let lightest = owed.iter().take(FOLD_SAMPLE).min_by_key(|(_, o)| o.hits()).map(|(k, _)| k.clone());
        if let Some(folded) = lightest.and_then(|k| owed.remove(&k)) {
            self.folded.fetch_add(folded.hits(), Ordering::Relaxed);
        }
    }

    fn owe(&self, key: OwedKey, hits: Owed) {
        let mut owed = self.owed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        merge(&mut owed, key, hits);
    }

    /// The owed entries, copied (what a process leaves in its state
    /// directory).
    pub fn owed_entries(&self) -> Vec<(OwedKey, Owed)> {
        let owed = self.owed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        owed.iter().map(|(key, hits)| (key.clone(), hits.clone())).collect()
    }

    /// Takes over `entries` a process before this one owed the store (from
    /// the state directory): written back with this one's own.
    pub fn adopt_owed(&self, entries: Vec<(OwedKey, Owed)>) {
        let mut owed = self.owed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, hits) in entries {
            merge(&mut owed, key, hits);
        }
    }

    /// Hits admitted locally and not yet written back.
    pub fn owed_hits(&self) -> u64 {
        let owed = self.owed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        owed.values().map(Owed::hits).sum()
    }

    /// Hits folded out of the owed entries at their bound: admitted
    /// locally, never written back.
    pub fn folded_hits(&self) -> u64 {
        self.folded.load(Ordering::Relaxed)
    }

    /// Hits written back to the shared store so far.
    pub fn written_back(&self) -> u64 {
        self.written_back.load(Ordering::Relaxed)
    }

    /// Local counters held (expired ones not yet swept included).
    pub fn counters(&self) -> usize {
        self.counters.len()
    }

    /// Writes every owed hit back to `store` as a report (counted whatever
    /// is left), [`WRITE_BACK_CHUNK`] calls at a time. Stops after the first
    /// chunk with a failure: what was refused, and what is left, stays owed
    /// for the next round. Returns the hits written, and the failure that
    /// stopped it.
    pub async fn write_back(&self, store: &Store) -> (u64, Option<StoreError>) {
        let taken = std::mem::take(&mut *self.owed.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let mut written = 0;
        let mut failure = None;
        let mut entries = taken.into_iter();
        loop {
            let chunk: Vec<(OwedKey, Owed)> = entries.by_ref().take(WRITE_BACK_CHUNK).collect();
            if chunk.is_empty() {
                break;
            }
            let results =
                futures_util::future::join_all(chunk.iter().map(|(key, owed)| write_one(store, key, owed)))
                    .await;
            let mut refused = Vec::new();
            for ((key, owed), result) in chunk.into_iter().zip(results) {
                match result {
                    Ok(()) => written += owed.hits(),
                    Err(error) => refused.push((key, owed, error)),
                }
            }
            if let Some((_, _, error)) = refused.first() {
                failure = Some(error.clone());
                let mut map = self.owed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for (key, owed, _) in refused {
                    merge(&mut map, key, owed);
                }
                for (key, owed) in entries {
                    merge(&mut map, key, owed);
                }
                break;
            }
        }
        self.written_back.fetch_add(written, Ordering::Relaxed);
        (written, failure)
    }

    /// Removes expired local counters (blocking: off the async workers).
    pub fn sweep(&self) -> usize {
        self.counters.sweep()
    }
}

/// Whether a decision counted here is owed to the shared store: a count
/// (an admission or a report) of a limit that counts usage. Slots in flight
/// are not: their admissions and their releases (reports) would both reach
/// the store as reports, and a release written back as one would count
/// where it should give back. Those taken here are freed here, and the
/// store's count of them starts over: for at most two windows after the
/// store is back, an instance's requests of the outage and the store's may
/// together exceed the limit by what this instance took.
fn owes_the_store(count: Count, weight: u64, params: WindowParams) -> bool {
    count != Count::Never && weight > 0 && !params.algorithm.releases()
}

/// The local store: the memory store's counters at this instance's share
/// of each limit, each admission owed to the shared store.
impl CounterStore for LocalLimiter {
    const NAME: &'static str = "local";
    const REMOTE: bool = false;

    fn decide_in(
        &self,
        _: Shares<'_>,
        user_id: &str,
        counter: CounterSpec<'_>,
        weight: u64,
        count: Count,
    ) -> impl Future<Output = Result<Verdict, StoreError>> + Send {
        std::future::ready(self.decide(user_id, counter, weight, count))
    }

    fn decide_job(
        &self,
        group: &str,
        items: &[ManyItem],
    ) -> impl Future<Output = Result<ManyOutcome, StoreError>> + Send {
        std::future::ready(self.decide_many(group, items))
    }

    /// Every shard walked, one lock hold each, on a blocking thread.
    async fn list_keys(
        self: &Arc<Self>,
        group: &str,
        prefix: &str,
        max: usize,
    ) -> Result<Listed, StoreError> {
        let (local, group, prefix) = (Arc::clone(self), group.to_owned(), prefix.to_owned());
        super::store::listed_blocking(move || local.counters.list(&group, &prefix, max)).await
    }

    fn figures(self: &Arc<Self>) -> Arc<dyn Figures> {
        Arc::clone(self) as Arc<dyn Figures>
    }
}

impl Owed {
    /// The hits owed.
    pub fn hits(&self) -> u64 {
        match self {
            Owed::Counter { hits, .. } => *hits,
            Owed::Item(item) => item.weight,
        }
    }
}

/// Owed entries written back at a time: a recovering store gets a
/// bounded burst, and a long outage's debt is still paid in a few rounds.
pub const WRITE_BACK_CHUNK: usize = 64;

/// Writes one owed entry back as a report.
async fn write_one(store: &Store, key: &OwedKey, owed: &Owed) -> Result<(), StoreError> {
    match (key, owed) {
        (OwedKey::Counter(rule, user), Owed::Counter { window, hits }) => store
            .decide(user, CounterSpec { id: rule, window: *window }, *hits, Count::Always)
            .await
            .map(drop),
        (OwedKey::Item(group, _), Owed::Item(item)) => {
            store.decide_many(group, std::slice::from_ref(item)).await.map(drop)
        }
        _ => unreachable!("an owed entry's key and value are of one kind"),
    }
}

/// Adds `hits` to what `owed` holds for `key`.
fn merge(owed: &mut HashMap<OwedKey, Owed>, key: OwedKey, hits: Owed) {
    match (owed.get_mut(&key), hits) {
        (Some(Owed::Counter { hits: sum, .. }), Owed::Counter { hits, .. }) => {
            *sum = sum.saturating_add(hits)
        }
        (Some(Owed::Item(sum)), Owed::Item(item)) => sum.weight = sum.weight.saturating_add(item.weight),
        (_, hits) => {
            owed.insert(key, hits);
        }
    }
}

/// The sorted set of live instances, after `redis.key_prefix`.
pub const INSTANCES_KEY: &str = "rli:{instances}";

/// How often, at most, a process saves its state while it runs (and
/// always at shutdown).
pub const SAVE_INTERVAL: Duration = Duration::from_secs(5);

/// The local limiter's periodic exchange with the shared store, every
/// `local.reconcile_interval_ms` from the last (the first at start): with
/// Redis it reports this instance (`instance`) alive and reads how many
/// are, which sets the local share; it writes owed hits back, sweeps the
/// local counters, and saves the count and the owed hits to `state` when
/// they changed (at most every [`SAVE_INTERVAL`]). At shutdown, one last
/// write-back, then what is still owed is saved for the next process.
#[derive(Debug)]
pub struct Reconciler {
    local: Arc<LocalLimiter>,
    store: Store,
    instance: String,
    interval: Duration,
    state: Option<Arc<super::instance::InstanceState>>,
    /// What was saved last, and when.
    saved: Option<((u64, u64), std::time::Instant)>,
    /// When the last exchange began (ms of the wall clock).
    last: Option<u64>,
}

impl Reconciler {
    /// The reconciler of `local` with `store`, as `instance`, every
    /// `interval`, saving to `state` when given.
    pub fn new(
        local: Arc<LocalLimiter>,
        store: Store,
        instance: String,
        interval: Duration,
        state: Option<super::instance::InstanceState>,
    ) -> Self {
        let state = state.map(Arc::new);
        Reconciler { local, store, instance, interval, state, saved: None, last: None }
    }

    /// Saves the count and the owed hits when they changed, at most every
    /// [`SAVE_INTERVAL`].
    async fn save_if_changed(&mut self) {
        let Some(state) = &self.state else { return };
        let now = (self.local.instances(), self.local.owed_hits());
        let due = self.saved.is_none_or(|(then, at)| then != now && at.elapsed() >= SAVE_INTERVAL);
        if due {
            save(state, &self.local).await;
            self.saved = Some((now, std::time::Instant::now()));
        }
    }
}

impl Participant for Reconciler {
    fn name(&self) -> &'static str {
        "local"
    }

    fn holding(&self) -> &'static str {
        "locally admitted hits stay owed, and the last instance count holds"
    }

    fn due(&mut self, now_ms: u64) -> u64 {
        let interval = u64::try_from(self.interval.as_millis()).unwrap_or(u64::MAX);
        self.last.map_or(now_ms, |last| last.saturating_add(interval).max(now_ms))
    }

    /// Nothing counted when no store call was made (the memory store,
    /// nothing owed).
    fn exchange(&mut self, now_ms: u64) -> BoxFuture<'_, Option<Result<(), StoreError>>> {
        self.last = Some(now_ms);
        Box::pin(async move {
            let mut result = None;
            if let Some(redis) = self.store.shared() {
                // Kept on a failure: an outage is exactly when the last count matters.
                let alive = report_alive(redis, &self.instance, self.interval).await;
                result = Some(alive.map(|alive| self.local.set_instances(Some(alive))));
            }
            if self.local.owed_hits() > 0 {
                let (written, failure) = self.local.write_back(&self.store).await;
                if written > 0 {
                    tracing::info!(hits = written, "locally admitted hits written back to the shared store");
                }
                if let Some(error) = failure {
                    result = Some(Err(error));
                } else if result.is_none() {
                    result = Some(Ok(()));
                }
            }
            let sweeping = Arc::clone(&self.local);
            if let Err(error) = tokio::task::spawn_blocking(move || sweeping.sweep()).await {
                tracing::error!(%error, "local limiter sweep failed");
            }
            self.save_if_changed().await;
            result
        })
    }

    fn finish(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.local.owed_hits() > 0 {
                let _ = self.local.write_back(&self.store).await;
                let left = self.local.owed_hits();
                if left > 0 {
                    tracing::warn!(
                        hits = left,
                        "shutting down with locally admitted hits the shared store never took: left in local.state_dir for the next process (each decision is also in the dead-letter records)"
                    );
                }
            }
            if let Some(state) = &self.state {
                save(state, &self.local).await;
            }
        })
    }
}

/// Saves the instance count and the owed hits to `state`, off the runtime;
/// a failure is logged (the hits stay owed in memory).
async fn save(state: &Arc<super::instance::InstanceState>, local: &LocalLimiter) {
    let (instances, owed) = (local.instances(), local.owed_entries());
    let state = Arc::clone(state);
    match tokio::task::spawn_blocking(move || state.save(Some(instances), owed)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "cannot save the local limiter's state"),
        Err(error) => tracing::error!(%error, "saving the local limiter's state failed"),
    }
}

/// Adds this instance to the live set (scored by the time it reported),
/// drops those silent for five intervals (at least ten seconds), and
/// counts the rest.
async fn report_alive(redis: &RedisStore, instance: &str, interval: Duration) -> Result<u64, StoreError> {
    let now_ms = crate::clock::SystemClock.now_ms();
    let silent_ms = (interval.as_millis() as u64).saturating_mul(5).max(10_000);
    let key = format!("{}{INSTANCES_KEY}", redis.key_prefix());
    let mut pipeline = redis::pipe();
    pipeline.cmd("ZADD").arg(&key).arg(now_ms).arg(instance).ignore();
    pipeline.cmd("ZREMRANGEBYSCORE").arg(&key).arg("-inf").arg(now_ms.saturating_sub(silent_ms)).ignore();
    pipeline.cmd("PEXPIRE").arg(&key).arg(silent_ms).ignore();
    pipeline.cmd("ZCARD").arg(&key);
    let timeout = (interval / 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
    let (alive,): (u64,) = redis.pipeline(&pipeline, timeout).await?;
    Ok(alive)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{FailureKind, ManualClock, memory::MemoryStore, window::Algorithm};

    fn limiter(max_counters: usize, instances: u64) -> (LocalLimiter, Arc<ManualClock>) {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let settings = Settings { max_counters, shards: 1, instances, ..Settings::default() };
        (LocalLimiter::new(settings, clock.clone()), clock)
    }

    fn spec(id: &Arc<str>, capacity: u64) -> CounterSpec<'_> {
        CounterSpec { id, window: WindowParams::sliding(60_000, capacity) }
    }

    #[test]
    fn admits_the_share_and_owes_what_it_admitted() {
        let (local, _) = limiter(100, 3);
        let rule: Arc<str> = Arc::from("r");
        // ceil(10 / 3) = 4 per instance.
        let admitted =
            (0..10).filter(|_| local.decide("u", spec(&rule, 10), 1, Count::IfFits).unwrap().admitted);
        assert_eq!(admitted.count(), 4);
        assert_eq!(local.owed_hits(), 4);
        // A peek is never owed; a report always is.
        assert!(!local.decide("u", spec(&rule, 10), 1, Count::Never).unwrap().admitted);
        local.decide("u", spec(&rule, 10), 5, Count::Always).unwrap();
        assert_eq!(local.owed_hits(), 9);
    }

    #[test]
    fn a_share_is_never_zero_and_follows_reports() {
        let (local, _) = limiter(100, 1);
        let params = WindowParams { algorithm: Algorithm::TokenBucket, ..WindowParams::sliding(1_000, 5) };
        assert_eq!(local.share(params).capacity, 5);
        local.set_instances(Some(10));
        assert_eq!((local.share(params).capacity, local.share(params).rate), (1, 1));
        local.set_instances(Some(0));
        assert_eq!(local.instances(), 1);
        local.set_instances(None);
        assert_eq!(local.instances(), 1, "the configured number");
        let zero = WindowParams { capacity: 0, ..params };
        assert_eq!(local.share(zero).capacity, 0, "a limit of zero stays zero");
    }

    /// A store outage and a flood of distinct keys past every bound: the
    /// owed entries owing least are folded, so a newcomer on 5 an hour is
    /// still decided at its share, 5 of 8.
    #[test]
    fn a_newcomer_is_decided_at_its_share_after_a_flood_past_every_bound() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let local = LocalLimiter::new(Settings::default(), clock);
        let rule: Arc<str> = Arc::from("r");
        let hour = |id| CounterSpec { id, window: WindowParams::sliding(3_600_000, 5) };
        for i in 0..110_000 {
            assert!(local.decide(&format!("flood{i}"), hour(&rule), 1, Count::IfFits).unwrap().admitted);
        }
        let admitted = (0..8)
            .filter(|_| local.decide("newcomer", hour(&rule), 1, Count::IfFits).unwrap().admitted)
            .count();
        assert_eq!(admitted, 5);
        assert!(local.counters() <= 100_000, "{}", local.counters());
        assert!(local.owed_entries().len() <= 100_000);
        assert_eq!(local.owed_hits() + local.folded_hits(), 110_005, "every admission owed or folded");
        assert!(
            local
                .owed_entries()
                .iter()
                .any(|(k, _)| *k == OwedKey::Counter(Arc::clone(&rule), "newcomer".into()))
        );
    }

    /// At the bound, the entry folded is the one owing least of a sample:
    /// a key near its limit stays owed while one-hit keys go.
    #[test]
    fn the_entry_folded_owes_least() {
        let (local, _) = limiter(4, 1);
        let rule: Arc<str> = Arc::from("r");
        for _ in 0..4 {
            local.decide("heavy", spec(&rule, 5), 1, Count::IfFits).unwrap();
        }
        for i in 0..10 {
            local.decide(&format!("light{i}"), spec(&rule, 5), 1, Count::IfFits).unwrap();
        }
        assert_eq!(local.folded_hits(), 7);
        let owed = local.owed_entries();
        assert_eq!(owed.len(), 4);
        assert!(
            owed.iter()
                .any(|(k, o)| *k == OwedKey::Counter(Arc::clone(&rule), "heavy".into()) && o.hits() == 4)
        );
        // The heavy key's local counter was kept too: one more of its 5.
        assert!(local.decide("heavy", spec(&rule, 5), 1, Count::IfFits).unwrap().admitted);
        assert!(!local.decide("heavy", spec(&rule, 5), 1, Count::IfFits).unwrap().admitted);
    }

    #[test]
    fn many_owes_only_what_it_committed() {
        let (local, _) = limiter(100, 1);
        let item =
            |key: &str, capacity: u64| ManyItem::admission(key, WindowParams::sliding(1_000, capacity));
        let items = [item("a", 5), item("b", 1)];
        assert!(local.decide_many("d", &items).unwrap().committed);
        assert_eq!(local.owed_hits(), 2);
        // "b" is over: nothing of the call is counted or owed.
        assert!(!local.decide_many("d", &items).unwrap().committed);
        assert_eq!(local.owed_hits(), 2);
        // A refund is given back locally and owed to nobody.
        let refund = ManyItem { count: Count::Always, refund: Some(0), ..item("a", 5) };
        assert!(local.decide_many("d", &[refund]).unwrap().committed);
        assert_eq!(local.owed_hits(), 2);
    }

    #[tokio::test]
    async fn write_back_reports_every_owed_hit_to_the_store() {
        let (local, _) = limiter(100, 2);
        let clock = Arc::new(ManualClock::new(1_000_000));
        let shared = Arc::new(MemoryStore::new(1, 100, clock));
        let store = Store::Memory(Arc::clone(&shared));
        let rule: Arc<str> = Arc::from("r");
        for _ in 0..3 {
            local.decide("u", spec(&rule, 6), 1, Count::IfFits).unwrap();
        }
        assert_eq!(local.write_back(&store).await.0, 3);
        assert_eq!(local.owed_hits(), 0);
        // The shared counter now holds the three: three more fit of six.
        let admitted =
            (0..6).filter(|_| shared.decide("u", spec(&rule, 6), 1, Count::IfFits).unwrap().admitted).count();
        assert_eq!(admitted, 3);
    }

    #[tokio::test]
    async fn a_refused_write_back_keeps_the_hits_owed() {
        let (local, _) = limiter(100, 1);
        let clock = Arc::new(ManualClock::new(1_000_000));
        // A shared store with room for nothing new (its one counter owed
        // elsewhere): every write-back fails.
        let pinned: crate::limiter::memory::Pinned = Arc::new(|_, _, _| true);
        let full = Arc::new(MemoryStore::new(1, 1, clock).with_pinned(pinned));
        let rule: Arc<str> = Arc::from("r");
        full.decide("other", spec(&rule, 9), 1, Count::IfFits).unwrap();
        let store = Store::Memory(full);
        local.decide("u", spec(&rule, 9), 2, Count::IfFits).unwrap();
        local.decide("v", spec(&rule, 9), 1, Count::IfFits).unwrap();
        let (written, failure) = local.write_back(&store).await;
        assert_eq!((written, failure.map(|e| e.kind)), (0, Some(FailureKind::StoreFull)));
        assert_eq!(local.owed_hits(), 3);
    }
}
