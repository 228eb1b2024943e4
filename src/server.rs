//! Wiring: builds the rule store, the counter store and the engine from a
//! [`Config`], serves gRPC on a listener until a shutdown future resolves,
//! then drains in-flight calls and joins every background task.
//!
//! `run` takes the listener and the shutdown future as arguments so tests run
//! the real server on `127.0.0.1:0` and stop it deterministically.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::{
    net::TcpListener,
    sync::{oneshot, watch},
    task::JoinSet,
};
use tonic::transport::server::TcpIncoming;

use crate::{
    api::{EnvoyService, RateLimiterService},
    clock::MonotonicClock,
    config::{Config, EnvoyAlgorithm},
    decision::Engine,
    dlq::{self, DlqSink},
    limiter::{MemoryStore, RedisStore, Store, SystemClock, memory::run_sweeper, redis::RedisSetupError},
    rules::{self, RuleErrors, RuleStore},
    shed::{Sampler, ShedMode, Shedder, run_sampler},
    telemetry::{
        Metrics,
        health::{Health, publish, run_monitor, serve_http},
        metrics::Sources,
    },
    tls::ReloadingAcceptor,
};

/// Why the server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The initial rule set does not load; nothing was served.
    #[error("rules: {0}")]
    Rules(#[from] RuleErrors),
    /// The Redis store could not be set up.
    #[error(transparent)]
    Redis(#[from] RedisSetupError),
    /// The spool directory cannot be opened.
    #[error("dlq.spool_dir {0}")]
    Spool(String),
    /// The Kafka producer cannot be created (a bad property).
    #[error("dlq.kafka: {0}")]
    Kafka(String),
    /// The reflection service could not be built from the descriptor sets.
    #[error("grpc reflection: {0}")]
    Reflection(String),
    /// The gRPC server failed.
    #[error("grpc server: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The gRPC TLS certificate, key or client CA does not load.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// A background task (rule reload, counter sweep, utilization sampler) ended while serving: a bug.
    #[error("background task ended unexpectedly: {0}")]
    TaskExited(String),
}

/// tonic refuses a request message above `max_decoding_message_size` with
/// OUT_OF_RANGE; gRPC's convention (and what clients retry on) for a message
/// over the receive limit is RESOURCE_EXHAUSTED. Our handlers never answer
/// OUT_OF_RANGE, so the rewrite touches nothing else. The refusal is a
/// trailers-only response: the status is in the headers.
fn oversized_is_resource_exhausted(
    mut response: tonic::codegen::http::Response<tonic::body::Body>,
) -> tonic::codegen::http::Response<tonic::body::Body> {
    let headers = response.headers_mut();
    if headers.get("grpc-status").is_some_and(|code| code.as_bytes() == b"11") {
        headers.insert("grpc-status", tonic::codegen::http::HeaderValue::from_static("8"));
    }
    response
}

/// Handles on the running service's state, for tests and diagnostics.
#[derive(Debug, Clone)]
pub struct Observer {
    /// The dead-letter pipeline (its counters reconcile).
    pub dlq: Arc<DlqSink>,
    /// The load shedder.
    pub shedder: Arc<Shedder>,
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
}

/// Serves until `shutdown` resolves, then stops accepting, lets in-flight
/// calls finish (at most `grpc.shutdown_grace_ms`) and stops background tasks.
pub async fn run(
    config: Config,
    listener: TcpListener,
    http: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    run_observed(config, listener, http, shutdown, |_| {}).await
}

/// [`run`], handing `observe` the service's state once everything is built
/// and loaded, just before it starts answering.
pub async fn run_observed(
    config: Config,
    listener: TcpListener,
    http: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    observe: impl FnOnce(Observer),
) -> Result<(), ServerError> {
    let snapshot = rules::load(&config.rules.path)?;
    // Before anything else starts: a TLS file that does not load is fatal.
    let tls = ReloadingAcceptor::new(&config.grpc.tls)?;
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = JoinSet::new();

    let store = match &config.redis.url {
        None => {
            let memory = Arc::new(MemoryStore::new(config.memory.shards, Arc::new(SystemClock)));
            tasks.spawn(run_sweeper(
                Arc::clone(&memory),
                Duration::from_millis(config.memory.sweep_interval_ms),
                stop_rx.clone(),
            ));
            Store::Memory(memory)
        }
        Some(_) => {
            let redis = Arc::new(RedisStore::new(&config.redis)?);
            // Not fatal: until Redis answers, rules answer by failure policy.
            match redis.warm_up(Duration::from_millis(config.redis.connect_timeout_ms)).await {
                Ok(()) => tracing::info!(url = redis.url_for_logs(), "redis reachable"),
                Err(e) => tracing::warn!(
                    url = redis.url_for_logs(),
                    error = %e,
                    "redis unreachable at startup; decisions follow each rule's failure_policy until it answers"
                ),
            }
            Store::Redis(redis)
        }
    };

    let rule_store = Arc::new(RuleStore::new(snapshot));
    if config.rules.reload_interval_ms > 0 {
        tasks.spawn(rules::watch(
            Arc::clone(&rule_store),
            config.rules.path.clone(),
            Duration::from_millis(config.rules.reload_interval_ms),
            rules::load,
            stop_rx.clone(),
        ));
    }

    let shedder = Arc::new(Shedder::new(config.shed.mode, config.shed.retry_after_ms));
    if config.shed.mode == ShedMode::Off {
        tracing::info!("load shedding off (shed.mode = off)");
    } else {
        let sampler = Sampler::new(
            &config.shed.procfs_root,
            &config.shed.cgroup_root,
            config.shed.smoothing,
            Arc::new(MonotonicClock::default()),
        );
        tasks.spawn(run_sampler(
            sampler,
            Arc::clone(&shedder),
            config.shed.thresholds(),
            Duration::from_millis(config.shed.sample_interval_ms),
            Duration::from_millis(config.shed.report_interval_ms),
            stop_rx.clone(),
        ));
    }

    let (dlq, dlq_queue, dlq_counters) =
        DlqSink::new(config.dlq.queue_capacity, config.dlq.instance(), config.dlq.header_allowlist.clone());
    let dlq = match &config.dlq.kafka.brokers {
        None => {
            tracing::info!(file = %config.dlq.file.display(), "failed decisions go to a JSON-lines file");
            tasks.spawn(dlq::file::run(dlq_queue, config.dlq.file.clone(), dlq_counters, stop_rx.clone()));
            dlq
        }
        Some(brokers) => {
            let spool_dir = &config.dlq.spool_dir;
            let (writer, reader, spool) = dlq::spool::open(spool_dir, config.dlq.spool_segment_bytes)
                .map_err(|e| ServerError::Spool(format!("{}: {e}", spool_dir.display())))?;
            let recovered = spool.pending();
            dlq_counters.recovered.store(recovered, std::sync::atomic::Ordering::SeqCst);
            if recovered > 0 {
                tracing::info!(records = recovered, spool = %spool_dir.display(), "delivering failure records a previous run left in the spool");
            }
            let kafka = &config.dlq.kafka;
            let producer = dlq::kafka::producer(brokers, &kafka.properties)
                .map_err(|e| ServerError::Kafka(e.to_string()))?;
            tracing::info!(brokers = %brokers, topic = %kafka.topic, spool = %spool_dir.display(), "failed decisions go to Kafka through the spool");
            let notify = Arc::new(tokio::sync::Notify::new());
            tasks.spawn(dlq::kafka::run_spooler(
                dlq_queue,
                writer,
                Arc::clone(&spool),
                Arc::clone(&dlq_counters),
                Arc::clone(&notify),
                stop_rx.clone(),
            ));
            let shipper = dlq::kafka::Shipper {
                producer,
                topic: kafka.topic.clone(),
                undeliverable: spool_dir.join("undeliverable.jsonl"),
                counters: dlq_counters,
                flush_timeout: Duration::from_millis(kafka.flush_timeout_ms),
            };
            tasks.spawn(dlq::kafka::run_shipper(
                shipper,
                reader,
                Arc::clone(&spool),
                notify,
                stop_rx.clone(),
            ));
            dlq.with_spool(spool)
        }
    };
    let dlq = Arc::new(dlq);

    let metrics = Arc::new(Metrics::new(store.name()));
    let engine = Engine::new(
        Arc::clone(&rule_store),
        store,
        Arc::clone(&shedder),
        Arc::clone(&dlq) as Arc<dyn dlq::FailureSink>,
        config.shed.default_priority,
        Arc::clone(&metrics),
    );

    let mut envoy_hot = None;
    let envoy = match &config.rules.envoy_path {
        None => None,
        Some(path) => {
            let load = match config.envoy.algorithm {
                EnvoyAlgorithm::SlidingWindow => rules::envoy::load_sliding,
                EnvoyAlgorithm::FixedWindow => rules::envoy::load_fixed,
            };
            let envoy_config = load(path)?;
            tracing::info!(
                path = %path.display(),
                domains = envoy_config.domain_count(),
                version = envoy_config.version(),
                algorithm = ?config.envoy.algorithm,
                "serving envoy.service.ratelimit.v3.RateLimitService"
            );
            let envoy_config = Arc::new(rules::Hot::new(envoy_config));
            envoy_hot = Some(Arc::clone(&envoy_config));
            if config.rules.reload_interval_ms > 0 {
                tasks.spawn(rules::watch(
                    Arc::clone(&envoy_config),
                    path.clone(),
                    Duration::from_millis(config.rules.reload_interval_ms),
                    load,
                    stop_rx.clone(),
                ));
            }
            Some(EnvoyService::new(
                envoy_config,
                engine.store().clone(),
                Arc::clone(&dlq) as Arc<dyn dlq::FailureSink>,
                config.envoy.clone(),
                Arc::clone(&metrics),
            ))
        }
    };
    let local_addr = listener.local_addr().map_or_else(|e| format!("unknown ({e})"), |a| a.to_string());
    if config.redis.url.is_none() && config.dlq.kafka.brokers.is_none() {
        tracing::info!(
            rules = %config.rules.path.display(),
            "embedded defaults: in-memory counters (redis.url unset), failed decisions to a local file (dlq.kafka.brokers unset)"
        );
    }
    tracing::info!(
        addr = %local_addr,
        store = engine.store().name(),
        rules_version = engine.rules().load().version(),
        rules = engine.rules().load().rules().len(),
        path = %config.rules.path.display(),
        "ratelimitd serving"
    );

    let store_handle = engine.store().clone();
    let service = RateLimiterService::new(engine, config.limits.clone());

    // Metrics, health, readiness, reflection.
    metrics.set_sources(Sources {
        shedder: Arc::clone(&shedder),
        dlq: Arc::clone(&dlq),
        rules: Arc::clone(&rule_store),
        envoy: envoy_hot,
    });
    let health = Arc::new(Health::new(
        Arc::clone(&rule_store),
        envoy.as_ref().map(|_| config.envoy.failure_mode),
        store_handle.name(),
    ));
    let (reporter, health_service) = tonic_health::server::health_reporter();
    publish(&reporter, false).await;
    tasks.spawn(run_monitor(
        Arc::clone(&health),
        store_handle,
        reporter.clone(),
        Duration::from_millis(config.http.health_interval_ms),
        Duration::from_millis(config.redis.connect_timeout_ms),
        stop_rx.clone(),
    ));
    if let Some(http) = http {
        tracing::info!(addr = ?http.local_addr().ok(), "serving /metrics, /healthz, /readyz");
        tasks.spawn(serve_http(http, Arc::clone(&health), Arc::clone(&metrics), stop_rx.clone()));
    }
    let reflection = |builder: tonic_reflection::server::Builder<'static>| {
        builder
            .register_encoded_file_descriptor_set(crate::api::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(crate::api::envoy_pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(|e| ServerError::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(|e| ServerError::Reflection(e.to_string()))?;

    // Everything is built: the service is about to answer.
    observe(Observer { dlq: Arc::clone(&dlq), shedder: Arc::clone(&shedder), metrics: Arc::clone(&metrics) });

    let (draining_tx, draining_rx) = oneshot::channel::<()>();
    let draining_health = Arc::clone(&health);
    let drain_delay = Duration::from_millis(config.grpc.drain_delay_ms);
    let signal = async move {
        shutdown.await;
        // Tell load balancers first, keep answering for the drain delay,
        // then stop accepting and let in-flight calls finish.
        draining_health.set_draining();
        publish(&reporter, false).await;
        tracing::info!(delay_ms = drain_delay.as_millis(), "health NOT_SERVING; draining");
        tokio::time::sleep(drain_delay).await;
        let _ = draining_tx.send(());
    };
    let max_message = config.grpc.max_message_bytes;
    let router = tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(oversized_is_resource_exhausted))
        .add_service(service.into_server().max_decoding_message_size(max_message))
        .add_optional_service(envoy.map(|envoy| envoy.into_server().max_decoding_message_size(max_message)))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    // One boxed future for the server's lifetime: plain TCP and TLS streams
    // are different types.
    let serve: std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> = match tls
    {
        None => {
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            Box::pin(router.serve_with_incoming_shutdown(incoming, signal))
        }
        Some(tls) => {
            tracing::info!(mutual = tls.mutual(), "gRPC over TLS");
            if config.grpc.tls.reload_interval_ms > 0 {
                let interval = Duration::from_millis(config.grpc.tls.reload_interval_ms);
                tasks.spawn(tls.clone().watch(interval, stop_rx.clone()));
            }
            let (streams, accept_loop) = tls.incoming(listener, stop_rx.clone());
            tasks.spawn(accept_loop);
            let incoming = tokio_stream::wrappers::ReceiverStream::new(streams);
            Box::pin(router.serve_with_incoming_shutdown(incoming, signal))
        }
    };

    let grace = Duration::from_millis(config.grpc.shutdown_grace_ms);
    let grace_expired = async move {
        if draining_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    // Background tasks only return on shutdown; one that ends earlier (a
    // panic) stops the service with an error rather than leaving it running
    // without rule reloads or with unbounded memory.
    let task_exited = async {
        match tasks.join_next().await {
            Some(Err(e)) => e.to_string(),
            Some(Ok(())) => "returned before shutdown".to_owned(),
            None => std::future::pending().await,
        }
    };
    let result = tokio::select! {
        result = serve => result.map_err(ServerError::from),
        () = grace_expired => {
            tracing::warn!(grace_ms = config.grpc.shutdown_grace_ms, "in-flight calls still running after the grace period; stopping anyway");
            Ok(())
        }
        reason = task_exited => Err(ServerError::TaskExited(reason)),
    };

    let _ = stop_tx.send(true);
    while let Some(joined) = tasks.join_next().await {
        if let Err(e) = joined {
            tracing::error!(error = %e, "background task failed");
        }
    }
    let stats = dlq.stats();
    tracing::info!(
        enqueued = stats.enqueued,
        recovered = stats.recovered,
        delivered = stats.delivered,
        pending = stats.pending,
        dropped = stats.dropped,
        "dead-letter pipeline at shutdown (enqueued + recovered = delivered + pending + dropped)"
    );
    tracing::info!("ratelimitd stopped");
    result
}
