//! The layers in front of the store: shedding and its sampler, the overload
//! layer and its feed, the adaptive limits' exchange.

use std::{sync::Arc, time::Duration};

use super::{Rules, Tasks};
use crate::server::ServerError;
use crate::{
    adapter::{self, Adapter},
    clock::{Clock, MonotonicClock},
    config::{OverloadConfig, ShedConfig},
    global::{GlobalExchange, status::GlobalStatus},
    limiter::{
        RedisStore, Store, SystemClock,
        exchange::{self, ExchangeCounts, Participant},
        grants::Grants,
        lease::Lease,
        settings::RedisConfig,
    },
    overload::{Overload, feed},
    rules::{Hot, tenants::Tenants},
    shed::{LatencySignal, Sampler, ShedMode, ShedSignal, Shedder, Signal, run_sampler},
};

/// The shedder, and its utilization sampler unless `shed.mode` is off.
pub(crate) fn shedder(config: &ShedConfig, tasks: &mut Tasks) -> Arc<Shedder> {
    let shedder = Shedder::new(config.mode, config.retry_after_ms);
    if config.mode == ShedMode::Off {
        tracing::info!("load shedding off (shed.mode = off)");
        return Arc::new(shedder);
    }
    let cpu = (config.signal != ShedSignal::Latency).then(|| {
        Sampler::new(
            config.source,
            &config.procfs_root,
            &config.cgroup_root,
            config.smoothing,
            Arc::new(MonotonicClock::default()),
        )
    });
    let latency = (config.signal != ShedSignal::Cpu).then(|| {
        LatencySignal::new(Duration::from_secs_f64(config.latency_tolerance_ms / 1_000.0), config.smoothing)
    });
    let shedder = Arc::new(if latency.is_some() { shedder.measuring_latency() } else { shedder });
    let stop = tasks.stopper();
    tasks.spawn(run_sampler(
        Signal::new(cpu, latency),
        Arc::clone(&shedder),
        config.thresholds(),
        Duration::from_millis(config.sample_interval_ms),
        Duration::from_millis(config.report_interval_ms),
        stop,
    ));
    shedder
}

/// The overload layer over the tenant table `tenants`, and its feed (an
/// exchange every `overload.report_interval_ms`, joining `exchanges`).
pub(crate) fn overload(
    settings: &OverloadConfig,
    rules: &Rules,
    tenants: Option<Arc<Hot<Tenants>>>,
    store: &Store,
    exchanges: &mut Vec<Box<dyn Participant>>,
) -> Result<Arc<Overload>, ServerError> {
    let overload = Arc::new(Overload::new(settings.mode, settings.report_interval_ms));
    let sources = feed::Sources { rules: Arc::clone(&rules.native), envoy: rules.envoy.clone(), tenants };
    let exchange = match store.shared() {
        Some(redis) => feed::Exchange::Redis(Arc::clone(redis)),
        None => feed::Exchange::Local,
    };
    let feed_settings = feed::Settings {
        mode: settings.mode,
        interval_ms: settings.report_interval_ms,
        max_staleness_ms: settings.max_staleness_ms,
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let feed = feed::Feed::new(Arc::clone(&overload), sources, feed_settings, clock.now_ms());
    exchanges.push(Box::new(feed::FeedExchange::new(feed, exchange, clock)));
    Ok(overload)
}

/// The exchange of the adaptive limits (each rule once per its
/// `adaptive.interval_ms`, joining `exchanges`): through Redis, or
/// in-process with the memory store; when the deployment shares global
/// limits with other regions (`regional`), only those of the others
/// (the global ones are exchanged with the coordination store, [`global`]).
pub(crate) fn adaptive(
    rules: &Rules,
    store: &Store,
    regional: bool,
    exchanges: &mut Vec<Box<dyn Participant>>,
) -> Arc<Adapter> {
    let exchange = match store.shared() {
        Some(redis) => adapter::Exchange::Redis(Arc::clone(redis)),
        None => adapter::Exchange::Local(std::sync::Mutex::default()),
    };
    let adapter = Arc::new(Adapter::new(Arc::clone(&rules.native), rules.envoy.clone()));
    let scope = if regional { adapter::Scope::Regional } else { adapter::Scope::All };
    exchanges.push(Box::new(adapter::AdaptiveExchange::new(Arc::clone(&adapter), exchange, scope)));
    adapter
}

/// Whether this deployment shares global limits with other regions
/// (`global.regions` and `region` set).
pub(crate) fn shares_global_limits(config: &crate::config::Config) -> bool {
    config.global.enabled() && config.region.is_some()
}

/// The global limits' exchange (`global.*`, joining `exchanges`), with the
/// exchange of the global adaptive limits of `adapter` with the
/// coordination store, and this region's grants, which decisions read;
/// `None` while `global.regions` is empty (a global limit is then enforced
/// whole: the deployment is the only region). The coordination store's
/// dispatchers join `dispatchers`.
pub(crate) fn global(
    config: &crate::config::Config,
    (rules, adapter): (&Rules, &Arc<Adapter>),
    store: &Store,
    exchanges: &mut Vec<Box<dyn Participant>>,
    dispatchers: &mut tokio::task::JoinSet<()>,
) -> Result<Option<Global>, ServerError> {
    let global = &config.global;
    let (true, Some(region)) = (shares_global_limits(config), config.region.as_deref()) else {
        return Ok(None);
    };
    let index = global.index(region).expect("validated: region is one of global.regions");
    let floors_ppm = global.floors_ppm();
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::default());
    let grants = Arc::new(Grants::new(floors_ppm[index], global.max_keys, Arc::clone(&clock)));
    let coordination =
        Arc::new(RedisStore::new(&RedisConfig::side(&global.redis, global.timeout_ms), dispatchers)?);
    let status = Arc::new(GlobalStatus::new(region, global.lease_ms, clock));
    let settings = crate::global::Settings {
        region: index,
        floors_ppm,
        interval_ms: global.interval_ms,
        lease: Lease { lease_ms: global.lease_ms, skew_ms: global.skew_ms },
        timeout: Duration::from_millis(global.timeout_ms),
        regional_timeout: Duration::from_millis(config.redis.timeout_ms.max(100)),
        max_keys: global.max_keys,
        envoy_algorithm: config.envoy.policy().algorithm,
        instance: crate::limiter::instance::id(&config.dlq.instance()),
    };
    tracing::info!(
        region,
        coordination = coordination.url_for_logs(),
        interval_ms = global.interval_ms,
        lease_ms = global.lease_ms,
        "global limits shared with {} regions",
        global.regions.len()
    );
    let shared = adapter::Exchange::Redis(Arc::clone(&coordination));
    exchanges.push(Box::new(adapter::AdaptiveExchange::new(
        Arc::clone(adapter),
        shared,
        adapter::Scope::Global,
    )));
    exchanges.push(Box::new(GlobalExchange::new(
        Arc::clone(&grants),
        (Arc::clone(&rules.native), rules.envoy.clone()),
        store.clone(),
        Arc::clone(&coordination),
        settings,
        Arc::clone(&status),
    )));
    Ok(Some(Global { grants, status, coordination }))
}

/// The global limits' parts the engine and `/metrics` read.
pub(crate) struct Global {
    pub(crate) grants: Arc<Grants>,
    pub(crate) status: Arc<GlobalStatus>,
    /// The coordination store (RLQS buckets of global limits share it).
    pub(crate) coordination: Arc<RedisStore>,
}

/// The one task that runs every periodic exchange with the store
/// (`exchanges`), and their counts for `/metrics`.
pub(crate) fn exchanges(exchanges: Vec<Box<dyn Participant>>, tasks: &mut Tasks) -> Arc<ExchangeCounts> {
    let counts = Arc::new(ExchangeCounts::of(&exchanges));
    let stop = tasks.stopper();
    tasks.spawn(exchange::run(exchanges, Arc::clone(&counts), Arc::new(SystemClock), stop));
    counts
}
