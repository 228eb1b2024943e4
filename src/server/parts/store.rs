//! The counter store and what decides beside it: the local limiter (failure
//! policy `local`) and its reconciler, the cache of exact denials, and the
//! tenants' shares of the store's in-flight calls, and where the RLQS
//! buckets' holders are kept.

use std::{sync::Arc, time::Duration};

use tokio::task::JoinSet;

use super::Tasks;
use crate::limiter::exchange::Participant;
use crate::server::ServerError;
use crate::{
    clock::MonotonicClock,
    config::{DenialCacheConfig, LocalConfig, MemoryConfig, RedisConfig},
    decision::{DenialCache, TenantShares},
    limiter::{
        MemoryStore, RedisStore, Store, SystemClock,
        local::{self, LocalLimiter, Reconciler},
        memory::run_sweeper,
    },
    quota::{BucketShares, QuotaStore, Quotas},
    rules::{Hot, tenants::Tenants},
};

/// The counter store: in memory (with its sweeper in `tasks`) or Redis
/// (its shared dispatchers in `dispatchers`, joined only after the engine is
/// dropped, since they end when the store does; each of `serving_threads`
/// spawns its own at its first call, ended with its runtime).
pub(crate) async fn store(
    redis: &RedisConfig,
    memory: &MemoryConfig,
    tasks: &mut Tasks,
    dispatchers: &mut JoinSet<()>,
    serving_threads: usize,
) -> Result<Store, ServerError> {
    if redis.connection.url.is_none() {
        let store = Arc::new(MemoryStore::new(memory.shards, memory.max_counters, Arc::new(SystemClock)));
        let stop = tasks.stopper();
        tasks.spawn(run_sweeper(Arc::clone(&store), Duration::from_millis(memory.sweep_interval_ms), stop));
        return Ok(Store::Memory(store));
    }
    let connect_timeout = Duration::from_millis(redis.connect_timeout_ms);
    let redis = Arc::new(RedisStore::new(redis, dispatchers)?.serving(serving_threads));
    // Not fatal: until Redis answers, rules answer by failure policy.
    match redis.warm_up(connect_timeout).await {
        Ok(()) => tracing::info!(url = redis.url_for_logs(), "redis reachable"),
        Err(e) => tracing::warn!(
            url = redis.url_for_logs(),
            error = %e,
            "redis unreachable at startup; decisions follow each rule's failure_policy until it answers"
        ),
    }
    Ok(Store::Redis(redis))
}

/// The local limiter (failure policy `local`) and its reconciler (joining
/// `exchanges`), which
/// writes locally admitted hits back to `store` and, with Redis, keeps the
/// count of live instances that sets each instance's share. With the memory
/// store the instance is the whole deployment: its share is the whole limit.
/// With Redis this process takes a unique id (`name` and its start) and
/// its files in `local.state_dir`: it starts from the instance count and
/// takes over the owed hits that processes before it left there.
pub(crate) fn local(
    config: &LocalConfig,
    redis: &crate::config::RedisConfig,
    name: &str,
    store: &Store,
    exchanges: &mut Vec<Box<dyn Participant>>,
) -> Result<Arc<LocalLimiter>, ServerError> {
    let mut settings = config.settings();
    let id = crate::limiter::instance::id(name);
    if store.shared().is_none() {
        settings.instances = 1;
        return Ok(reconciled(settings, store, id, None, exchanges));
    }
    let url = redis.connection.url.as_deref().map(crate::limiter::settings::redact_url).unwrap_or_default();
    let store_id = format!("{url} {}", redis.connection.key_prefix);
    let opened =
        crate::limiter::instance::InstanceState::open::<local::Owing>(&config.state_dir, &id, &store_id);
    let (state, adopted) = match opened {
        Ok(opened) => opened,
        Err(error) if config.state_dir_is_default => {
            tracing::warn!(
                %error,
                instances = settings.instances,
                "the state directory cannot be written: this process starts from local.instances and \
                 cannot hand what it owes the store on past a crash; set local.state_dir (or \
                 STATE_DIRECTORY) to a writable volume to keep them"
            );
            return Ok(reconciled(settings, store, id, None, exchanges));
        }
        Err(error) => return Err(error.into()),
    };
    match adopted.instances {
        Some(known) => settings.instances = settings.instances.max(known),
        None if config.instances == 1 => tracing::warn!(
            "local.instances is 1 and no earlier instance count is in local.state_dir: while the store \
             cannot answer, this instance admits each whole limit locally until it reads the live count \
             (set local.instances to the replica count)"
        ),
        None => {}
    }
    let local = reconciled(settings, store, id, Some(state), exchanges);
    if adopted.processes > 0 {
        let hits: u64 = adopted.owed.iter().map(|(_, owed)| owed.hits()).sum();
        tracing::info!(
            processes = adopted.processes,
            hits,
            instances = settings.instances,
            "took over the owed hits and instance count earlier processes left in local.state_dir"
        );
        local.adopt_owed(adopted.owed);
    }
    Ok(local)
}

/// The local limiter of `settings` with its reconciler, which keeps its
/// `state` (none: nothing kept for the next process).
fn reconciled(
    settings: crate::limiter::local::Settings,
    store: &Store,
    id: String,
    state: Option<crate::limiter::instance::InstanceState>,
    exchanges: &mut Vec<Box<dyn Participant>>,
) -> Arc<LocalLimiter> {
    let local = Arc::new(LocalLimiter::new(settings, Arc::new(SystemClock)));
    exchanges.push(Box::new(Reconciler::new(
        Arc::clone(&local),
        store.clone(),
        id,
        settings.reconcile_interval,
        state,
    )));
    local
}

/// The local cache of exact denials: with the Redis store, unless
/// `denial_cache.enabled` is off (the memory store is local already).
pub(crate) fn denials(config: &DenialCacheConfig, store: &Store) -> Option<Arc<DenialCache>> {
    (store.is_remote() && config.enabled)
        .then(|| Arc::new(DenialCache::new(config.max_entries, Arc::new(MonotonicClock::default()))))
}

/// Each tenant's share of the Redis store's in-flight calls: with a tenant
/// table, unless `grpc.max_store_calls_per_tenant` is 0 (the memory store's
/// calls do not queue).
pub(crate) fn tenant_shares(
    permits: usize,
    tenants: Option<&Arc<Hot<Tenants>>>,
    store: &Store,
) -> Option<Arc<TenantShares>> {
    match tenants {
        Some(table) if store.is_remote() && permits > 0 => {
            Some(Arc::new(TenantShares::new(Arc::clone(table), permits)))
        }
        _ => None,
    }
}

/// Where the RLQS buckets' holders are kept (`rlqs.*`): in the Redis
/// store, a global limit's in the coordination store (`coordination`, when
/// the deployment shares limits with other regions); with the memory store,
/// in this instance. `None` without Envoy rules (no RLQS served).
pub(crate) fn quotas(
    config: &crate::config::Config,
    envoy_rules: bool,
    store: &Store,
    coordination: Option<&Arc<RedisStore>>,
) -> Option<Arc<Quotas>> {
    if !envoy_rules {
        return None;
    }
    let local = BucketShares::new(config.rlqs.clone(), Arc::new(SystemClock));
    // Off the request path: at least 100 ms.
    let regional = store.shared().map(|regional| QuotaStore {
        store: Arc::clone(regional),
        timeout: Duration::from_millis(config.redis.timeout_ms.max(100)),
    });
    let coordination = coordination.map(|store| QuotaStore {
        store: Arc::clone(store),
        timeout: Duration::from_millis(config.global.timeout_ms),
    });
    Some(Arc::new(Quotas::new(local, regional, coordination)))
}
