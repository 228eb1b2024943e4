//! The named parts of a running service, each built by one function from its
//! configuration section: rules, store, shedding, dead-letter pipeline,
//! engine, health. Every long-lived task a part needs is spawned into the
//! [`Tasks`] it is given, never detached.

use std::{path::PathBuf, sync::Arc, time::Duration};

use tokio::{net::TcpListener, sync::watch, task::JoinSet};
use tonic_health::{pb::health_server::HealthServer, server::HealthReporter};

use super::ServerError;
use super::health::{Health, publish, run_monitor, serve_http};
use crate::rules::XdsState;
use crate::{
    adapter::{self, Adapter},
    budget::Budget,
    capture::{self, Capture, CaptureCounters},
    clock::MonotonicClock,
    config::{
        Config, DenialCacheConfig, DlqConfig, EnvoySettings, LimitsConfig, LocalConfig, MemoryConfig,
        OverloadConfig, RedisConfig, RulesConfig, RulesSource, ShedConfig, TelemetryConfig,
    },
    decision::{
        CaptureSink, DecisionMetrics, DenialCache, Engine, EngineParts, FailureSink, Saved, Stats,
        TenantPolicy, TenantShares,
    },
    dlq::{self, DlqSink, RecordBounds},
    limiter::{
        MemoryStore, RedisStore, Store, SystemClock,
        figures::ShareWaits,
        local::{self, LocalLimiter, run_reconciler},
        memory::run_sweeper,
    },
    overload::{Overload, feed},
    rules::{self, Feed, Hot, RuleErrors, RuleSets, RuleStore, envoy::EnvoyConfig, tenants::Tenants},
    shed::{LatencySignal, Sampler, ShedMode, ShedSignal, Shedder, Signal, run_sampler},
    telemetry::{self, Metrics},
};

/// Background tasks and the signal that stops them. Each returns once the
/// signal turns true; one that ends earlier is a bug the server reports.
#[derive(Debug)]
pub(crate) struct Tasks {
    set: JoinSet<()>,
    stop: watch::Sender<bool>,
}

impl Tasks {
    pub(crate) fn new() -> Self {
        Tasks { set: JoinSet::new(), stop: watch::channel(false).0 }
    }

    /// A receiver for the stop signal, for a task to watch.
    pub(crate) fn stopper(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    pub(crate) fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.set.spawn(task);
    }

    /// Waits for the first task to end (serving: that is a failure) and says why.
    pub(crate) async fn first_exit(&mut self) -> String {
        match self.set.join_next().await {
            Some(Err(e)) => e.to_string(),
            Some(Ok(())) => "returned before shutdown".to_owned(),
            None => std::future::pending().await,
        }
    }

    /// Signals every task to stop and waits for all of them.
    pub(crate) async fn stop_and_join(mut self) {
        let _ = self.stop.send(true);
        while let Some(joined) = self.set.join_next().await {
            if let Err(e) = joined {
                tracing::error!(error = %e, "background task failed");
            }
        }
    }
}

/// The compiled rules the engine decides with.
#[derive(Debug)]
pub(crate) struct Rules {
    /// Native rules.
    pub(crate) native: Arc<RuleStore>,
    /// Where they come from, for logs: a path, or the embedded set.
    pub(crate) native_source: String,
    /// The Envoy configuration, when `rules.envoy_path` is set (always
    /// with `rules.source: kafka` or `xds`).
    pub(crate) envoy: Option<Arc<Hot<EnvoyConfig>>>,
    /// What the rules topic feeds, with `rules.source: kafka`.
    pub(crate) feed: Option<Arc<Feed>>,
    /// The xDS subscription, with `rules.source: xds`.
    pub(crate) xds: Option<Arc<XdsState>>,
    /// What the status reports say beside the rules, with `rules.source: kafka`.
    pub(crate) vitals: Option<crate::rollout::status::VitalsSource>,
}

/// The rules: from files ([`rules`]), from the rules topic
/// ([`subscribed_rules`]), or native from files and Envoy's over xDS
/// ([`xds_rules`]).
pub(crate) fn rules_of(config: &Config, tasks: &mut Tasks) -> Result<Rules, ServerError> {
    match config.rules.source {
        RulesSource::Files => rules(&config.rules, &config.envoy, tasks),
        #[cfg(feature = "kafka")]
        RulesSource::Kafka => Ok(subscribed_rules(config, tasks)),
        // The configuration refuses it in a build without Kafka.
        #[cfg(not(feature = "kafka"))]
        RulesSource::Kafka => Err(ServerError::Kafka(NO_KAFKA.to_owned())),
        RulesSource::Xds => xds_rules(config, tasks),
    }
}

/// `rules.source: xds`: native rules as from files, and an Envoy
/// configuration with no domain until the subscription swaps in the first.
pub(crate) fn xds_rules(config: &Config, tasks: &mut Tasks) -> Result<Rules, ServerError> {
    let files = RulesConfig { envoy_path: None, ..config.rules.clone() };
    let mut rules = rules(&files, &config.envoy, tasks)?;
    if config.rules.path.is_none() {
        rules.native = Arc::new(RuleStore::new(rules::empty()));
        rules.native_source = "none (rules.path unset, Envoy rules over xDS only)".to_owned();
    }
    // Before anything serves: a TLS file that does not load is fatal.
    crate::api::xds::endpoint(&config.rules.xds).map_err(ServerError::Xds)?;
    let envoy = Arc::new(Hot::new(EnvoyConfig::default()));
    let state = Arc::new(XdsState::default());
    tracing::info!(
        server = %config.rules.xds.server_url,
        node = %config.rules.xds.node_id,
        force_start = config.rules.xds.force_start,
        "Envoy rules come over xDS"
    );
    let stop = tasks.stopper();
    tasks.spawn(crate::api::xds::run(
        config.rules.xds.clone(),
        crate::api::xds::Accept { how: config.envoy.compile(), allow_empty: config.rules.allow_empty },
        Arc::clone(&envoy),
        Arc::clone(&state),
        stop,
    ));
    rules.envoy = Some(envoy);
    rules.xds = Some(state);
    Ok(rules)
}

/// `rules.source: kafka`: empty rule sets until the subscription swaps in
/// the first snapshot (or the fallback files), its subscriber, and its
/// status reporter.
#[cfg(feature = "kafka")]
pub(crate) fn subscribed_rules(config: &Config, tasks: &mut Tasks) -> Rules {
    use crate::rollout::{
        status,
        subscribe::{self, Fallback, Subscription},
    };
    let native = Arc::new(RuleStore::new(rules::empty()));
    let envoy = Arc::new(Hot::new(EnvoyConfig::default()));
    let feed = Arc::new(Feed::default());
    let kafka = &config.rules.kafka;
    tracing::info!(
        brokers = kafka.brokers.as_deref().unwrap_or_default(),
        topic = %kafka.topic,
        "rules come from the rules topic; not ready until the first snapshot"
    );
    let subscription = Subscription {
        kafka: kafka.clone(),
        compile: config.envoy.compile(),
        paths: config.rules.path_matching,
        allow_empty: config.rules.allow_empty,
        trust: config.rules_trust(),
        native: Arc::clone(&native),
        envoy: Arc::clone(&envoy),
        feed: Arc::clone(&feed),
        fallback: Fallback { native: config.rules.path.clone(), envoy: config.rules.envoy_path.clone() },
    };
    let stop = tasks.stopper();
    tasks.spawn(subscribe::run(subscription, stop));
    let stop = tasks.stopper();
    let instance = format!("{}@{}", config.dlq.instance(), config.grpc_addr().port());
    let vitals = status::VitalsSource::default();
    let reporter = status::run_reporter(
        kafka.clone(),
        instance,
        Arc::clone(&feed),
        Arc::clone(&native),
        Arc::clone(&envoy),
        vitals.clone(),
        stop,
    );
    tasks.spawn(reporter);
    Rules {
        native,
        native_source: format!("kafka topic {}", kafka.topic),
        envoy: Some(envoy),
        feed: Some(feed),
        xds: None,
        vitals: Some(vitals),
    }
}

/// Loads the native rules (`rules.path`; unset: the embedded set, or none
/// when only Envoy rules are configured) and the Envoy configuration, and
/// spawns their reloaders.
pub(crate) fn rules(
    config: &RulesConfig,
    envoy: &EnvoySettings,
    tasks: &mut Tasks,
) -> Result<Rules, ServerError> {
    let form = config.path_matching;
    let allow_empty = config.allow_empty;
    // One function loads at start and on every change: an emptied file is
    // refused either way (`rules.allow_empty`).
    let load_native = move |path: &std::path::Path| {
        rules::load(path, form).and_then(|set| rules::non_empty(set, path, allow_empty))
    };
    let (native, native_source) = match (&config.path, &config.envoy_path) {
        (Some(path), _) => (load_native(path)?, path.display().to_string()),
        (None, None) if config.examples => (rules::embedded(form)?, rules::EMBEDDED_SOURCE.to_owned()),
        (None, None) if config.source == crate::config::RulesSource::Files => {
            return Err(ServerError::NoRules);
        }
        (None, None) => (rules::empty(), "none (rules.path unset, rules.examples off)".to_owned()),
        (None, Some(_)) => (rules::empty(), "none (rules.path unset, Envoy rules only)".to_owned()),
    };
    let native = Arc::new(RuleStore::new(native));
    let interval = Duration::from_millis(config.reload_interval_ms);
    if let Some(path) = &config.path {
        watch(tasks, &native, path, interval, load_native);
    }
    let envoy = match &config.envoy_path {
        None => None,
        Some(path) => {
            let how = envoy.compile();
            let load = move |path: &std::path::Path| {
                rules::envoy::load(path, how).and_then(|set| rules::non_empty(set, path, allow_empty))
            };
            let loaded = load(path)?;
            tracing::info!(
                path = %path.display(),
                domains = loaded.domain_count(),
                version = loaded.version(),
                algorithm = ?envoy.algorithm,
                "serving envoy.service.ratelimit.v3.RateLimitService"
            );
            let hot = Arc::new(Hot::new(loaded));
            watch(tasks, &hot, path, interval, load);
            Some(hot)
        }
    };
    Ok(Rules { native, native_source, envoy, feed: None, xds: None, vitals: None })
}

fn watch<T: rules::Versioned>(
    tasks: &mut Tasks,
    hot: &Arc<Hot<T>>,
    path: &std::path::Path,
    interval: Duration,
    load: impl Fn(&std::path::Path) -> Result<T, RuleErrors> + Send + Sync + 'static,
) {
    if !interval.is_zero() {
        let stop = tasks.stopper();
        tasks.spawn(rules::watch(Arc::clone(hot), PathBuf::from(path), interval, load, stop));
    }
}

/// The counter store: in memory (with its sweeper in `tasks`) or Redis
/// (its dispatchers in `dispatchers`, joined only after the engine is
/// dropped, since they end when the store does).
pub(crate) async fn store(
    redis: &RedisConfig,
    memory: &MemoryConfig,
    tasks: &mut Tasks,
    dispatchers: &mut JoinSet<()>,
) -> Result<Store, ServerError> {
    if redis.url.is_none() {
        let store = Arc::new(MemoryStore::new(memory.shards, memory.max_counters, Arc::new(SystemClock)));
        let stop = tasks.stopper();
        tasks.spawn(run_sweeper(Arc::clone(&store), Duration::from_millis(memory.sweep_interval_ms), stop));
        return Ok(Store::Memory(store));
    }
    let connect_timeout = Duration::from_millis(redis.connect_timeout_ms);
    let redis = Arc::new(RedisStore::new(redis, dispatchers)?);
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

/// The local limiter (failure policy `local`) and its reconciler, which
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
    tasks: &mut Tasks,
) -> Result<Arc<LocalLimiter>, ServerError> {
    let mut settings = local_settings(config);
    let id = crate::limiter::instance::id(name);
    let state = match store {
        Store::Memory(_) => {
            settings.instances = 1;
            None
        }
        Store::Redis(_) => {
            let url = redis.url.as_deref().map(crate::limiter::settings::redact_url).unwrap_or_default();
            let store_id = format!("{url} {}", redis.key_prefix);
            let (state, adopted) = crate::limiter::instance::InstanceState::open::<local::Owing>(
                &config.state_dir,
                &id,
                &store_id,
            )?;
            match adopted.instances {
                Some(known) => settings.instances = settings.instances.max(known),
                None if config.instances == 1 => tracing::warn!(
                    "local.instances is 1 and no earlier instance count is in local.state_dir: while the store \
                     cannot answer, this instance admits each whole limit locally until it reads the live count \
                     (set local.instances to the replica count)"
                ),
                None => {}
            }
            Some((state, adopted))
        }
    };
    let local = Arc::new(LocalLimiter::new(settings, Arc::new(SystemClock)));
    let state = state.map(|(state, adopted)| {
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
        state
    });
    let stop = tasks.stopper();
    tasks.spawn(run_reconciler(
        Arc::clone(&local),
        store.clone(),
        id,
        settings.reconcile_interval,
        state,
        stop,
    ));
    Ok(local)
}

/// The local limiter's settings, from `local.*`.
fn local_settings(config: &LocalConfig) -> local::Settings {
    local::Settings {
        max_counters: config.max_counters,
        shards: config.shards,
        instances: config.instances,
        reconcile_interval: Duration::from_millis(config.reconcile_interval_ms),
    }
}

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

/// What the status reports say beside the rules: shedding, the overload
/// layer and the dead-letter pipeline, read at each report.
pub(crate) fn vitals(rules: &Rules, shedder: &Arc<Shedder>, overload: &Arc<Overload>, dlq: &Arc<DlqSink>) {
    let Some(source) = &rules.vitals else { return };
    let (shedder, overload, dlq) = (Arc::clone(shedder), Arc::clone(overload), Arc::clone(dlq));
    source.set(move || {
        let stats = dlq.stats();
        crate::rollout::status::Vitals {
            shed_level: shedder.level().as_str().to_owned(),
            utilization: shedder.utilization(),
            overload_mode: overload.mode().as_str().to_owned(),
            overload_directives: overload.table().directive_count(),
            dead_letters: stats.enqueued,
            dead_letters_dropped: stats.dropped,
        }
    });
}

/// The dead-letter pipeline: the hot path's sink, and its writer tasks (the
/// file writer, or the spooler and the Kafka shipper).
pub(crate) fn dlq(
    config: &DlqConfig,
    limits: &LimitsConfig,
    tasks: &mut Tasks,
) -> Result<Arc<DlqSink>, ServerError> {
    let bounds = RecordBounds {
        resource_path_bytes: limits.max_resource_path_bytes,
        client_type_bytes: limits.max_client_type_bytes,
        headers: limits.max_headers,
        header_bytes: limits.max_header_bytes,
    };
    let (sink, queue, counters) = DlqSink::new(
        config.queue_capacity,
        config.queue_max_bytes,
        config.instance(),
        config.header_allowlist.clone(),
        bounds,
    );
    let fold_interval = Duration::from_millis(config.aggregate_interval_ms);
    let folds = Arc::new(dlq::fold::Folds::new(config.aggregate_interval_ms, config.aggregate_after));
    let sink = sink.with_folds(Arc::clone(&folds));
    let drain = || dlq::file::Drain::with_folds(Arc::clone(&folds), fold_interval);
    let Some(brokers) = &config.kafka.brokers else {
        tracing::info!(file = %config.file.display(), "failed decisions go to a JSON-lines file");
        let stop = tasks.stopper();
        let target = dlq::file::FileTarget { path: config.file.clone(), max_bytes: config.file_max_bytes };
        let size = std::fs::metadata(&target.path).map_or(0, |m| m.len());
        counters.file_bytes.store(size, std::sync::atomic::Ordering::SeqCst);
        tasks.spawn(dlq::file::run(queue, target, counters, drain(), stop));
        return Ok(Arc::new(sink.with_disk_cap(config.file_max_bytes)));
    };
    dlq_to_kafka(config, brokers, (sink, queue, counters), drain(), tasks)
}

/// Why a Kafka setting cannot be served: the configuration refuses them all
/// in a build without Kafka, so this is only a guard.
#[cfg(not(feature = "kafka"))]
const NO_KAFKA: &str = "this build has no Kafka support (cargo feature `kafka`)";

#[cfg(not(feature = "kafka"))]
fn dlq_to_kafka(
    _config: &DlqConfig,
    _brokers: &str,
    _sink: (DlqSink, tokio::sync::mpsc::Receiver<dlq::FailureRecord>, Arc<dlq::DlqCounters>),
    _drain: dlq::file::Drain,
    _tasks: &mut Tasks,
) -> Result<Arc<DlqSink>, ServerError> {
    Err(ServerError::Kafka(NO_KAFKA.to_owned()))
}

/// Failed decisions to the dead-letter topic, through the spool.
#[cfg(feature = "kafka")]
fn dlq_to_kafka(
    config: &DlqConfig,
    brokers: &str,
    (sink, queue, counters): (
        DlqSink,
        tokio::sync::mpsc::Receiver<dlq::FailureRecord>,
        Arc<dlq::DlqCounters>,
    ),
    drain: dlq::file::Drain,
    tasks: &mut Tasks,
) -> Result<Arc<DlqSink>, ServerError> {
    let spool_dir = &config.spool_dir;
    let (writer, reader, spool) = dlq::spool::open(
        spool_dir,
        dlq::spool::SpoolSizes {
            segment_bytes: config.spool_segment_bytes,
            max_bytes: config.spool_max_bytes,
        },
    )
    .map_err(|e| ServerError::Spool(format!("{}: {e}", spool_dir.display())))?;
    let recovered = spool.pending();
    counters.recovered.store(recovered, std::sync::atomic::Ordering::SeqCst);
    if recovered > 0 {
        tracing::info!(records = recovered, spool = %spool_dir.display(), "delivering failure records a previous run left in the spool");
    }
    let kafka = &config.kafka;
    let producer =
        dlq::kafka::producer(brokers, &kafka.properties).map_err(|e| ServerError::Kafka(e.to_string()))?;
    tracing::info!(brokers = %brokers, topic = %kafka.topic, spool = %spool_dir.display(), "failed decisions go to Kafka through the spool");
    let notify = Arc::new(tokio::sync::Notify::new());
    let stop = tasks.stopper();
    tasks.spawn(dlq::kafka::run_spooler(
        queue,
        writer,
        Arc::clone(&spool),
        Arc::clone(&counters),
        Arc::clone(&notify),
        drain,
        stop,
    ));
    let shipper = dlq::kafka::Shipper {
        producer,
        topic: kafka.topic.clone(),
        undeliverable: spool_dir.join("undeliverable.jsonl"),
        undeliverable_max_bytes: config.spool_max_bytes,
        set_aside_logs: crate::folded::Folded::default(),
        counters,
        flush_timeout: Duration::from_millis(kafka.flush_timeout_ms),
    };
    let stop = tasks.stopper();
    tasks.spawn(dlq::kafka::run_shipper(shipper, reader, Arc::clone(&spool), notify, stop));
    Ok(Arc::new(sink.with_spool(spool).with_disk_cap(config.spool_max_bytes)))
}

/// The capture sink and its writer task, when `capture.sample_ratio` > 0.
pub(crate) fn capture(config: &Config, tasks: &mut Tasks) -> Result<Option<Captured>, ServerError> {
    let settings = &config.capture;
    if settings.sample_ratio <= 0.0 {
        return Ok(None);
    }
    let limits = &config.limits;
    let bounds = capture::Bounds {
        user_id_bytes: limits.max_user_id_bytes,
        resource_path_bytes: limits.max_resource_path_bytes,
        client_type_bytes: limits.max_client_type_bytes,
        // Replay does not read headers: 256 bytes each bounds the queue
        // (16,384 records of at most ~3 KB) without losing their gist.
        header_bytes: limits.max_header_bytes.min(256),
    };
    let (sink, queue, counters) = Capture::new(
        settings.sample_ratio,
        // Required with a ratio above 0 (validated).
        settings.salt.as_deref().unwrap_or_default(),
        settings.queue_capacity,
        &config.dlq.header_allowlist,
        bounds,
        config.dlq.instance(),
    );
    let stop = tasks.stopper();
    match &settings.kafka.brokers {
        #[cfg(feature = "kafka")]
        Some(brokers) => {
            let producer = capture::producer(brokers, &settings.kafka.properties)
                .map_err(|e| ServerError::Kafka(format!("capture.kafka: {e}")))?;
            tracing::info!(ratio = settings.sample_ratio, topic = %settings.kafka.topic, "capturing a sample of users' requests to Kafka");
            tasks.spawn(capture::run_kafka(
                queue,
                producer,
                settings.kafka.topic.clone(),
                Arc::clone(&counters),
                stop,
            ));
        }
        #[cfg(not(feature = "kafka"))]
        Some(_) => return Err(ServerError::Kafka(NO_KAFKA.to_owned())),
        None => {
            tracing::info!(ratio = settings.sample_ratio, file = %settings.file.display(), "capturing a sample of users' requests to a file");
            tasks.spawn(capture::run_file(
                queue,
                settings.file.clone(),
                settings.file_max_bytes,
                Arc::clone(&counters),
                stop,
            ));
        }
    }
    Ok(Some(Captured { sink: Arc::new(sink), counters }))
}

/// The capture sink the engine writes to and the counters `/metrics` reads.
#[derive(Debug)]
pub(crate) struct Captured {
    pub(crate) sink: Arc<Capture>,
    pub(crate) counters: Arc<CaptureCounters>,
}

/// The tenant table (`overload.tenants_path`), hot-reloaded; `None`: not
/// configured.
pub(crate) fn tenants(
    settings: &OverloadConfig,
    tasks: &mut Tasks,
) -> Result<Option<Arc<Hot<Tenants>>>, ServerError> {
    let Some(path) = &settings.tenants_path else { return Ok(None) };
    let table = Arc::new(Hot::new(rules::tenants::load(path)?));
    watch(tasks, &table, path, Duration::from_millis(settings.reload_interval_ms), rules::tenants::load);
    Ok(Some(table))
}

/// The overload layer over the tenant table `tenants`, and its feed (one
/// task, ticking every `overload.report_interval_ms`).
pub(crate) fn overload(
    settings: &OverloadConfig,
    rules: &Rules,
    tenants: Option<Arc<Hot<Tenants>>>,
    store: &Store,
    tasks: &mut Tasks,
) -> Result<Arc<Overload>, ServerError> {
    let overload = Arc::new(Overload::new(settings.mode, settings.report_interval_ms));
    let sources = feed::Sources { rules: Arc::clone(&rules.native), envoy: rules.envoy.clone(), tenants };
    let exchange = match store {
        Store::Memory(_) => feed::Exchange::Local,
        Store::Redis(redis) => feed::Exchange::Redis(Arc::clone(redis)),
    };
    let stop = tasks.stopper();
    tasks.spawn(feed::run(
        Arc::clone(&overload),
        sources,
        exchange,
        feed::Settings {
            mode: settings.mode,
            interval_ms: settings.report_interval_ms,
            max_staleness_ms: settings.max_staleness_ms,
        },
        Arc::new(SystemClock),
        stop,
    ));
    Ok(overload)
}

/// The exchange of the adaptive limits (one task, each rule once per its
/// `adaptive.interval_ms`): through Redis, or in-process with the memory store.
pub(crate) fn adaptive(rules: &Rules, store: &Store, tasks: &mut Tasks) -> Arc<Adapter> {
    let exchange = match store {
        Store::Memory(_) => adapter::Exchange::Local(std::sync::Mutex::default()),
        Store::Redis(redis) => adapter::Exchange::Redis(Arc::clone(redis)),
    };
    let adapter = Arc::new(Adapter::new(Arc::clone(&rules.native), rules.envoy.clone()));
    let stop = tasks.stopper();
    tasks.spawn(adapter::run(Arc::clone(&adapter), exchange, Arc::new(SystemClock), stop));
    adapter
}

/// The local cache of exact denials: with the Redis store, unless
/// `denial_cache.enabled` is off (the memory store is local already).
pub(crate) fn denials(config: &DenialCacheConfig, store: &Store) -> Option<Arc<DenialCache>> {
    match store {
        Store::Redis(_) if config.enabled => {
            Some(Arc::new(DenialCache::new(config.max_entries, Arc::new(MonotonicClock::default()))))
        }
        _ => None,
    }
}

/// Each tenant's share of the Redis store's in-flight calls: with a tenant
/// table, unless `grpc.max_store_calls_per_tenant` is 0 (the memory store's
/// calls do not queue).
pub(crate) fn tenant_shares(
    permits: usize,
    tenants: Option<&Arc<Hot<Tenants>>>,
    store: &Store,
) -> Option<Arc<TenantShares>> {
    match (tenants, store) {
        (Some(table), Store::Redis(_)) if permits > 0 => {
            Some(Arc::new(TenantShares::new(Arc::clone(table), permits)))
        }
        _ => None,
    }
}

/// Where the engine reads a request's tenant from.
pub(crate) fn tenant_policy(config: &OverloadConfig) -> TenantPolicy {
    TenantPolicy {
        source: config.tenant_from,
        separator: config.tenant_separator.clone(),
        header: config.tenant_header.clone(),
        descriptor_key: config.tenant_descriptor_key.clone(),
    }
}

/// What the engine decides with besides the rules and the store.
pub(crate) struct Layers<'a> {
    pub(crate) shedder: &'a Arc<Shedder>,
    pub(crate) overload: &'a Arc<Overload>,
    pub(crate) denials: Option<Arc<DenialCache>>,
    pub(crate) local: Arc<LocalLimiter>,
    pub(crate) tenant_shares: Option<Arc<TenantShares>>,
}

/// The engine both APIs decide through.
pub(crate) fn engine(
    config: &Config,
    rules: &Rules,
    store: Store,
    layers: Layers<'_>,
    dlq: &Arc<DlqSink>,
    stats: &Arc<DecisionMetrics>,
    capture: Option<&Captured>,
) -> Engine {
    let shedder = layers.shedder;
    Engine::new(EngineParts {
        rules: Arc::clone(&rules.native),
        envoy: rules.envoy.clone(),
        store,
        local: layers.local,
        shedder: Arc::clone(shedder),
        failures: Arc::clone(dlq) as Arc<dyn FailureSink>,
        stats: Arc::clone(stats) as Arc<dyn Stats>,
        default_priority: config.shed.default_priority,
        max_user_id_bytes: config.limits.max_user_id_bytes,
        trust_request_priority: config.shed.trust_request_priority,
        envoy_policy: config.envoy.policy(),
        capture: capture.map(|c| Arc::clone(&c.sink) as Arc<dyn CaptureSink>),
        overload: Some(Arc::clone(layers.overload)),
        tenants: tenant_policy(&config.overload),
        denials: layers.denials,
        tenant_shares: layers.tenant_shares,
    })
}

/// The decision path's counters (with envoyproxy/ratelimit's families
/// when `envoy.upstream_metrics` is on and Envoy rules are served).
pub(crate) fn stats(envoy: &EnvoySettings, rules: &Rules, store: &Store) -> Arc<DecisionMetrics> {
    let stats = DecisionMetrics::new(store.name());
    Arc::new(if envoy.upstream_metrics && rules.envoy.is_some() {
        stats.with_upstream(envoy.upstream_metrics_max_keys, rules.envoy.clone())
    } else {
        stats
    })
}

/// The `/metrics` registry, and the statsd sink reading it when
/// `telemetry.statsd_addr` is set.
pub(crate) fn metrics(telemetry: &TelemetryConfig, tasks: &mut Tasks) -> Arc<Metrics> {
    let metrics = Arc::new(Metrics::new());
    if let Some(addr) = &telemetry.statsd_addr {
        let interval = Duration::from_millis(telemetry.statsd_flush_interval_ms);
        let stop = tasks.stopper();
        tasks.spawn(crate::telemetry::statsd::run(Arc::clone(&metrics), addr.clone(), interval, stop));
    }
    metrics
}

/// The parts whose figures `/metrics` reads, beside the rules and the
/// engine's stores.
pub(crate) struct Figures {
    pub(crate) stats: Arc<DecisionMetrics>,
    pub(crate) shedder: Arc<Shedder>,
    pub(crate) dlq: Arc<DlqSink>,
    pub(crate) capture: Option<Arc<CaptureCounters>>,
    pub(crate) overload: Arc<Overload>,
    pub(crate) denials: Option<Arc<DenialCache>>,
    pub(crate) adapter: Arc<Adapter>,
}

/// Registers every part's figures with `metrics`, in `/metrics`' order:
/// the decision path, the stores, the request byte budget, shedding, the
/// dead-letter pipeline, the rule sets and their feeds, capture, and the
/// store calls saved.
pub(crate) fn register_figures(
    metrics: &Metrics,
    parts: Figures,
    rules: &Rules,
    engine: &Engine,
    budget: &Arc<Budget>,
) {
    metrics.register(parts.stats);
    if let Store::Memory(memory) = engine.store() {
        metrics.register(Arc::clone(memory) as Arc<dyn telemetry::Figures>);
    }
    metrics.register(Arc::clone(engine.local()) as Arc<dyn telemetry::Figures>);
    metrics.register(ShareWaits::of(engine.store()));
    metrics.register(Arc::clone(budget) as Arc<dyn telemetry::Figures>);
    metrics.register(parts.shedder);
    metrics.register(parts.dlq);
    metrics.register(Arc::new(RuleSets { native: Arc::clone(&rules.native), envoy: rules.envoy.clone() }));
    if let Some(feed) = &rules.feed {
        metrics.register(Arc::clone(feed) as Arc<dyn telemetry::Figures>);
    }
    if let Some(xds) = &rules.xds {
        metrics.register(Arc::clone(xds) as Arc<dyn telemetry::Figures>);
    }
    if let Some(capture) = parts.capture {
        metrics.register(capture);
    }
    metrics.register(Arc::clone(&parts.overload) as Arc<dyn telemetry::Figures>);
    metrics.register(parts.adapter);
    metrics.register(Arc::new(Saved { overload: Some(parts.overload), denials: parts.denials }));
}

/// Readiness and gRPC health: the state behind `/readyz` and
/// `grpc.health.v1`, the monitor that probes the store, and the HTTP
/// endpoints when `http` is given (the probes also on
/// `http.probe_listen` when set). Starts NOT_SERVING until the first probe.
pub(crate) async fn health(
    config: &Config,
    rules: &Rules,
    engine: &Engine,
    metrics: &Arc<Metrics>,
    http: Option<TcpListener>,
    tasks: &mut Tasks,
) -> Result<
    (Arc<Health>, HealthReporter, HealthServer<impl tonic_health::pb::health_server::Health>),
    ServerError,
> {
    let health = Health::new(
        Arc::clone(&rules.native),
        rules.envoy.as_ref().map(|_| config.envoy.failure_mode),
        engine.store(),
        rules.feed.clone(),
    )
    .unready_without_store(config.http.unready_without_store);
    let health = Arc::new(match &rules.xds {
        Some(xds) => health.with_xds(Arc::clone(xds), config.rules.xds.force_start),
        None => health,
    });
    metrics.register(Arc::clone(&health) as Arc<dyn telemetry::Figures>);
    let (reporter, service) = tonic_health::server::health_reporter();
    publish(&reporter, &health, false).await;
    let stop = tasks.stopper();
    tasks.spawn(run_monitor(
        Arc::clone(&health),
        engine.store().clone(),
        reporter.clone(),
        Duration::from_millis(config.http.health_interval_ms),
        Duration::from_millis(config.redis.connect_timeout_ms),
        stop,
    ));
    if let Some(http) = http {
        tracing::info!(addr = ?http.local_addr().ok(), "serving /metrics, /healthz, /readyz");
        let limits = super::conns::Limits {
            max_connections: config.http.max_connections,
            max_connections_per_peer: config.http.max_connections_per_peer,
            idle_timeout: Duration::from_millis(config.http.idle_timeout_ms),
            max_age: Duration::from_millis(config.http.max_connection_age_ms),
            header_read_timeout: Duration::from_millis(config.http.header_read_timeout_ms),
        };
        if let Some(addr) = &config.http.probe_listen {
            let probes =
                TcpListener::bind(addr).await.map_err(|e| ServerError::ProbeListen(addr.clone(), e))?;
            tracing::info!(addr = ?probes.local_addr().ok(), "serving /healthz, /readyz, /healthcheck");
            let stop = tasks.stopper();
            tasks.spawn(serve_http(probes, limits, Arc::clone(&health), None, stop));
        }
        let stop = tasks.stopper();
        tasks.spawn(serve_http(http, limits, Arc::clone(&health), Some(Arc::clone(metrics)), stop));
    }
    Ok((health, reporter, service))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules_config(path: Option<PathBuf>, envoy_path: Option<PathBuf>) -> RulesConfig {
        RulesConfig { path, envoy_path, reload_interval_ms: 0, ..RulesConfig::default() }
    }

    #[test]
    fn rules_default_to_the_embedded_set_and_to_none_beside_envoy() {
        let mut tasks = Tasks::new();
        let envoy = EnvoySettings::default();
        let embedded = rules(&rules_config(None, None), &envoy, &mut tasks).unwrap();
        assert!(!embedded.native.load().rules().is_empty());
        assert!(embedded.envoy.is_none());

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("envoy.yaml");
        std::fs::write(
            &file,
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: 1 }\n",
        )
        .unwrap();
        let envoy_only = rules(&rules_config(None, Some(file)), &envoy, &mut tasks).unwrap();
        assert!(envoy_only.native.load().rules().is_empty(), "no native rules beside Envoy's");
        assert_eq!(envoy_only.envoy.unwrap().load().domain_count(), 1);

        let missing = rules(&rules_config(Some(dir.path().join("absent")), None), &envoy, &mut tasks);
        assert!(matches!(missing, Err(ServerError::Rules(_))));
    }

    #[test]
    fn local_defaults_are_the_limiters_own() {
        assert_eq!(local_settings(&LocalConfig::default()), local::Settings::default());
    }

    #[tokio::test]
    async fn tasks_stop_and_join() {
        let mut tasks = Tasks::new();
        let mut stop = tasks.stopper();
        tasks.spawn(async move {
            let _ = stop.changed().await;
        });
        tokio::time::timeout(Duration::from_secs(5), tasks.stop_and_join()).await.unwrap();
    }
}
