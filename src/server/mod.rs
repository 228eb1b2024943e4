//! Wiring: builds the named parts of the service from a [`Config`]
//! (`parts`: rules, store, shedding, dead-letter pipeline, engine), serves
//! gRPC and HTTP until a shutdown future resolves, then drains in-flight
//! calls and joins every task it started.
//!
//! `run` takes the listener and the shutdown future as arguments so tests run
//! the real server on `127.0.0.1:0` and stop it deterministically.
//!
//! Shutdown order: health turns NOT_SERVING, the drain delay passes, the
//! listener closes and in-flight calls finish (at most
//! `grpc.shutdown_grace_ms`); then background tasks stop and are joined
//! (the dead-letter writers drain their queues); then the engine is dropped
//! and the Redis dispatchers, which end with the store, are joined.

pub mod conns;
pub mod health;
mod parts;
mod places;
mod reclaim;
mod threads;

use std::{future::Future, sync::Arc, time::Duration};

use tokio::{net::TcpListener, sync::oneshot, task::JoinSet};
use tonic::transport::server::TcpIncoming;

use self::health::{Health, publish};
use self::parts::Tasks;
use crate::{
    api::{EnvoyService, RateLimiterService, rlqs::RlqsService},
    budget::{Budget, BudgetLayer, Denial, MessageBounds, Peer, PeerKey},
    config::Config,
    decision::Engine,
    dlq::DlqSink,
    limiter::redis::RedisSetupError,
    overload::Overload,
    quota::Quotas,
    rules::{Feed, RuleErrors},
    shed::Shedder,
    telemetry::Metrics,
    tls::ReloadingAcceptor,
};

/// Why the server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The initial rule set does not load; nothing was served.
    #[error("rules")]
    Rules(#[from] RuleErrors),
    /// The Redis store could not be set up.
    #[error(transparent)]
    Redis(#[from] RedisSetupError),
    /// `local.state_dir` cannot be used.
    #[error(transparent)]
    State(#[from] crate::limiter::instance::StateError),
    /// `http.probe_listen` cannot be bound.
    #[error("http.probe_listen {0}: cannot bind: {1}")]
    ProbeListen(String, std::io::Error),
    /// `http.metrics_listen` cannot be bound.
    #[error("http.metrics_listen {0}: cannot bind: {1}")]
    MetricsListen(String, std::io::Error),
    /// The dead-letter file (no Kafka brokers set) cannot be written.
    #[error("dlq.file {0}: cannot be written: {1}")]
    DlqFile(String, std::io::Error),
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
    #[error(
        "rules.path: unset, and so is rules.envoy_path, with rules.examples off: name the rules to serve \
         (rules.path for native rules, rules.envoy_path for Envoy's), or turn rules.examples on for the \
         built-in examples"
    )]
    NoRules,
    #[error("grpc server")]
    Transport(#[from] tonic::transport::Error),
    /// The xDS subscription cannot be set up (a TLS file).
    #[error("{0}")]
    Xds(String),
    /// TCP keepalive (`grpc.tcp_keepalive_ms`) cannot be set on the listener.
    #[error("grpc.tcp_keepalive_ms: {0}")]
    Keepalive(std::io::Error),
    /// A serving thread cannot be started (`grpc.serving_threads`).
    #[error("grpc.serving_threads: cannot start a serving thread: {0}")]
    ServingThread(std::io::Error),
    /// The Unix socket (`grpc.uds`) cannot be bound.
    #[error("grpc.uds {0}")]
    Uds(String),
    /// The gRPC TLS certificate, key or client CA does not load.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// A background task (rule reload, counter sweep, utilization sampler,
    /// Redis dispatcher) ended while serving: a bug.
    #[error("background task ended unexpectedly: {0}")]
    TaskExited(String),
}

/// tonic refuses a request message above `max_decoding_message_size` with
/// OUT_OF_RANGE; gRPC's convention (and what clients retry on) for a message
/// over the receive limit is RESOURCE_EXHAUSTED. Our handlers never answer
/// OUT_OF_RANGE, so the rewrite touches nothing else. The refusal is a
/// trailers-only response: the status is in the headers.
fn oversized_is_resource_exhausted(mut response: Response) -> Response {
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
    /// The overload layer (its buckets and drop ratios).
    pub overload: Arc<Overload>,
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
    // First: a connection the kernel accepts meanwhile inherits it, so one
    // arriving while the parts start has keepalive too.
    tcp_keepalive(&listener, config.grpc.tcp_keepalive_ms).map_err(ServerError::Keepalive)?;
    let mut tasks = Tasks::new();
    let mut dispatchers = JoinSet::new();
    let rules = parts::rules_of(&config, &mut tasks)?;
    // Before anything binds or connects: a TLS file that does not load is fatal.
    let tls = ReloadingAcceptor::new(&config.grpc.tls)?;
    let store = parts::store(
        &config.redis,
        &config.memory,
        &mut tasks,
        &mut dispatchers,
        config.grpc.serving_threads(),
    )
    .await?;
    let shedder = parts::shedder(&config.shed, &mut tasks);
    let dlq = parts::dlq(&config.dlq, &config.limits, &mut tasks)?;
    let captured = parts::capture(&config, &mut tasks)?;
    let tenants = parts::tenants(&config.overload, &mut tasks)?;
    let tenant_shares =
        parts::tenant_shares(config.grpc.max_store_calls_per_tenant, tenants.as_ref(), &store);
    let mut exchanges = Vec::new();
    let overload = parts::overload(&config.overload, &rules, tenants, &store, &mut exchanges)?;
    let adapter = parts::adaptive(&rules, &store, parts::shares_global_limits(&config), &mut exchanges);
    let denials = parts::denials(&config.denial_cache, &store);
    let stats = parts::stats(&config.envoy, &rules, &store);
    let metrics = parts::metrics(&config.telemetry, &mut tasks);
    let local = parts::local(&config.local, &config.redis, &config.dlq.instance(), &store, &mut exchanges)?;
    let global = parts::global(&config, (&rules, &adapter), &store, &mut exchanges, &mut dispatchers)?;
    let quotas =
        parts::quotas(&config, rules.envoy.is_some(), &store, global.as_ref().map(|g| &g.coordination));
    let rlqs_figures = quotas.as_ref().map(|q| Arc::clone(q.figures()));
    parts::vitals(
        &rules,
        (&shedder, &overload),
        &dlq,
        (global.as_ref().map(|g| Arc::clone(&g.status)), rlqs_figures.clone()),
    );
    let exchanges = parts::exchanges(exchanges, &mut tasks);
    let layers = parts::Layers {
        shedder: &shedder,
        overload: &overload,
        denials: denials.clone(),
        local,
        tenant_shares,
        grants: global.as_ref().map(|g| Arc::clone(&g.grants)),
    };
    let figures = parts::Figures {
        stats: Arc::clone(&stats),
        shedder: Arc::clone(&shedder),
        dlq: Arc::clone(&dlq),
        capture: captured.as_ref().map(|c| Arc::clone(&c.counters)),
        overload: Arc::clone(&overload),
        denials: denials.clone(),
        adapter,
        exchanges,
        global: global.as_ref().map(|g| Arc::clone(&g.status)),
        rlqs: rlqs_figures,
    };
    let engine = parts::engine(&config, &rules, store, layers, &dlq, &stats, captured.as_ref());
    log_serving(&config, &listener, &rules, engine.store().name());
    let budget = Arc::new(Budget::new(config.grpc.byte_shares()));
    parts::register_figures(&metrics, figures, &rules, &engine, &budget);
    let (health, reporter, health_service) =
        parts::health(&config, &rules, &engine, &metrics, http, &mut tasks).await?;
    let (draining_tx, draining) = tokio::sync::watch::channel(false);
    let router = grpc_router(&config, &engine, (&rules, quotas, draining), health_service, &budget)?;
    // From here the services hold the engine (and the store) alone.
    drop(engine);

    // Rules from a topic: nothing is answered before the first snapshot
    // (or the fallback) is in; /readyz says so meanwhile.
    let mut shutdown = Box::pin(shutdown);
    if !first_rules(&rules, config.rules.xds.force_start, &mut shutdown).await {
        stop(tasks, dispatchers, Duration::from_millis(config.grpc.shutdown_grace_ms), &dlq).await;
        return Ok(());
    }
    // Everything is built: the service is about to answer.
    observe(Observer {
        dlq: Arc::clone(&dlq),
        shedder: Arc::clone(&shedder),
        metrics: Arc::clone(&metrics),
        overload,
    });
    let drain_delay = Duration::from_millis(config.grpc.drain_delay_ms);
    let (signal, drained) = drain_on(shutdown, (health, reporter, draining_tx), drain_delay);
    let places =
        Arc::new(reclaim::Places::new(config.grpc.max_connections, config.grpc.first_request_timeout_ms));
    metrics.register(Arc::clone(&places) as Arc<dyn crate::telemetry::Figures>);
    tasks.spawn(Arc::clone(&places).sweep_until(tasks.stopper()));
    let serve = serve_grpc(&config, router, listener, tls, (&budget, &places), signal, &mut tasks)?;
    let grace = Duration::from_millis(config.grpc.shutdown_grace_ms);
    let result = serve_until_stopped(serve, drained, grace, &mut tasks, &mut dispatchers).await;
    stop(tasks, dispatchers, grace, &dlq).await;
    result
}

/// Waits for the first rules from a topic (`feed`) or over xDS (unless
/// `force_start`); false when `shutdown` resolves first.
async fn first_rules(
    rules: &parts::Rules,
    force_start: bool,
    shutdown: &mut (impl Future<Output = ()> + Unpin),
) -> bool {
    if let Some(feed) = &rules.feed
        && !wait_for_rules(feed, shutdown).await
    {
        return false;
    }
    if let Some(xds) = &rules.xds
        && !force_start
    {
        tracing::info!(
            "waiting for the first rate-limit configuration over xDS (rules.xds.force_start is off)"
        );
        tokio::select! {
            () = xds.first() => {}
            () = shutdown => {
                tracing::info!("stopped while waiting for rules");
                return false;
            }
        }
    }
    true
}

/// Waits until `feed` serves rules; false when `shutdown` resolves first.
async fn wait_for_rules(feed: &Feed, shutdown: &mut (impl Future<Output = ()> + Unpin)) -> bool {
    while feed.served().is_none() {
        tokio::select! {
            () = feed.changed() => {}
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
            () = &mut *shutdown => {
                tracing::info!("stopped while waiting for rules");
                return false;
            }
        }
    }
    true
}

/// The shutdown signal the gRPC server waits for: once `shutdown` resolves,
/// health turns NOT_SERVING (load balancers are told first), answers go on
/// for `drain_delay`, then the server stops accepting and long-lived
/// streams are told to end (`streams`). The receiver hears when that
/// moment comes.
fn drain_on(
    shutdown: impl Future<Output = ()> + Send + 'static,
    (health, reporter, streams): (
        Arc<Health>,
        tonic_health::server::HealthReporter,
        tokio::sync::watch::Sender<bool>,
    ),
    drain_delay: Duration,
) -> (impl Future<Output = ()> + Send + 'static, oneshot::Receiver<()>) {
    let (draining_tx, draining_rx) = oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        health.set_draining();
        publish(&reporter, &health, false).await;
        tracing::info!(delay_ms = drain_delay.as_millis(), "health NOT_SERVING; draining");
        tokio::time::sleep(drain_delay).await;
        // Long-lived streams (RLQS) end now, their peers reconnecting elsewhere.
        let _ = streams.send(true);
        let _ = draining_tx.send(());
    };
    (signal, draining_rx)
}

/// Runs the gRPC server until it has drained, `grace` after draining began
/// (in-flight calls still running then are left), or until a background
/// task or a Redis dispatcher ends: they only return on shutdown, so one
/// that ends earlier (a panic) stops the service with an error rather than
/// leaving it running without rule reloads, bounded memory or Redis.
async fn serve_until_stopped(
    serve: impl Future<Output = Result<(), tonic::transport::Error>>,
    drained: oneshot::Receiver<()>,
    grace: Duration,
    tasks: &mut Tasks,
    dispatchers: &mut JoinSet<()>,
) -> Result<(), ServerError> {
    let grace_expired = async move {
        if drained.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    let dispatcher_exited = async {
        match dispatchers.join_next().await {
            Some(Err(e)) => format!("redis dispatcher: {e}"),
            Some(Ok(())) => "redis dispatcher returned before shutdown".to_owned(),
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        result = serve => result.map_err(ServerError::from),
        () = grace_expired => {
            tracing::warn!(grace_ms = grace.as_millis(), "in-flight calls still running after the grace period; stopping anyway");
            Ok(())
        }
        reason = tasks.first_exit() => Err(ServerError::TaskExited(reason)),
        reason = dispatcher_exited => Err(ServerError::TaskExited(reason)),
    }
}

/// Stops and joins the background tasks (the dead-letter writers drain their
/// queues), then the Redis dispatchers: the services, and with them the
/// engine and its store, went with the server future, so their queues are
/// closing. Logs the dead-letter accounting.
async fn stop(tasks: Tasks, mut dispatchers: JoinSet<()>, grace: Duration, dlq: &DlqSink) {
    tasks.stop_and_join().await;
    if tokio::time::timeout(grace, async { while dispatchers.join_next().await.is_some() {} }).await.is_err()
    {
        tracing::warn!("redis dispatchers still running after the grace period; aborting them");
        dispatchers.shutdown().await;
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
}

/// The startup lines: what is served, from where, on which store.
fn log_serving(config: &Config, listener: &TcpListener, rules: &parts::Rules, store: &str) {
    let local_addr = listener.local_addr().map_or_else(|e| format!("unknown ({e})"), |a| a.to_string());
    if config.redis.connection.url.is_none() && config.dlq.kafka.brokers.is_none() {
        tracing::info!(
            rules = %rules.native_source,
            dlq = %config.dlq.file.display(),
            "embedded defaults: in-memory counters (redis.url unset), failed decisions to a local file (dlq.kafka.brokers unset)"
        );
    }
    for note in &config.notes {
        tracing::warn!("{note}");
    }
    for (variable, why) in &config.compat.ignored {
        tracing::warn!(
            variable,
            why,
            "envoyproxy/ratelimit variable not carried over (RATELIMITD_COMPAT=envoyproxy)"
        );
    }
    let snapshot = rules.native.load();
    tracing::info!(
        addr = %local_addr,
        store,
        rules_version = snapshot.version(),
        rules = snapshot.rules().len(),
        source = %rules.native_source,
        request_bytes_in_flight = config.grpc.request_bytes_in_flight(),
        memory_limit = config.grpc.memory_limit,
        serving_threads = config.grpc.serving_threads(),
        "ratelimitd serving"
    );
}

/// The gRPC services: `Check`, `ShouldRateLimit` (when Envoy rules or
/// limitador's limits are configured), health and reflection (of the
/// services served: Envoy's only with it).
fn grpc_router(
    config: &Config,
    engine: &Engine,
    (rules, quotas, draining): (&parts::Rules, Option<Arc<Quotas>>, tokio::sync::watch::Receiver<bool>),
    health: tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
    budget: &Arc<Budget>,
) -> Result<Router, ServerError> {
    let check = RateLimiterService::new(engine.clone());
    let serve_envoy = rules.envoy.is_some() || rules.limitador.is_some();
    let envoy = serve_envoy.then(|| {
        let mut service = EnvoyService::new(engine.clone(), config.envoy.clone());
        if config.compat.envoyproxy {
            service = service.with_upstream_errors();
        }
        match (&rules.limitador, &rules.xds) {
            (Some(limits), _) => service.with_limitador(Arc::clone(limits)),
            (None, Some(xds)) => service.with_xds(Arc::clone(xds)),
            (None, None) => service,
        }
    });
    let reflection = |builder: tonic_reflection::server::Builder<'static>| {
        [crate::api::CHECK_DESCRIPTOR_SET, tonic_health::pb::FILE_DESCRIPTOR_SET]
            .into_iter()
            .chain(serve_envoy.then_some(crate::api::ENVOY_DESCRIPTOR_SET))
            .chain(rules.limitador.is_some().then_some(crate::api::KUADRANT_DESCRIPTOR_SET))
            .fold(builder, |builder, set| builder.register_encoded_file_descriptor_set(set))
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(|e| ServerError::Reflection(e.to_string()))?;
    let reflection_v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(|e| ServerError::Reflection(e.to_string()))?;
    // Kuadrant's service beside Envoy's, from limitador's limits.
    let kuadrant = envoy.clone().filter(|_| rules.limitador.is_some());
    // Envoy's Rate Limit Quota Service on the Envoy rules.
    let instance = crate::limiter::instance::id(&config.dlq.instance());
    let rlqs = rules.envoy.as_ref().zip(quotas).map(|(envoy, quotas)| {
        RlqsService::new(quotas, Arc::clone(envoy), &instance).with_draining(draining.clone())
    });
    let bounds = message_bounds(&config.grpc, &check, envoy.as_ref());
    // The layer bounds each method; tonic's bound is the largest of them.
    let max_message = bounds.batch;
    let rewrite: fn(Response) -> Response = oversized_is_resource_exhausted;
    Ok(transport(&config.grpc)
        .layer(tower::util::MapResponseLayer::new(rewrite))
        .layer(BudgetLayer::new(Arc::clone(budget), bounds))
        .add_service(check.into_server().max_decoding_message_size(max_message))
        .add_optional_service(
            kuadrant.map(|kuadrant| kuadrant.into_kuadrant_server().max_decoding_message_size(max_message)),
        )
        .add_optional_service(envoy.map(|envoy| envoy.into_server().max_decoding_message_size(max_message)))
        .add_optional_service(rlqs.map(|rlqs| rlqs.into_server().max_decoding_message_size(max_message)))
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha))
}

/// Each method's message bound (`grpc.max_message_bytes`, the batch's
/// `grpc.max_batch_message_bytes`), and the denials of oversized
/// single-decision calls.
fn message_bounds(
    grpc: &crate::config::GrpcConfig,
    check: &RateLimiterService,
    envoy: Option<&EnvoyService>,
) -> MessageBounds {
    use crate::api::paths;
    let native: Denial = Arc::new({
        let check = check.clone();
        move |refusal| check.refused_unread(refusal)
    });
    let mut denials = vec![(paths::CHECK, Arc::clone(&native)), (paths::REPORT, native)];
    if let Some(envoy) = envoy.cloned() {
        let denial: Denial = Arc::new(move |refusal| envoy.refused_unread(refusal));
        // Kuadrant's calls, served with limitador's limits, take Envoy's messages.
        for path in [paths::SHOULD_RATE_LIMIT, paths::CHECK_RATE_LIMIT, paths::KUADRANT_REPORT] {
            denials.push((path, Arc::clone(&denial)));
        }
    }
    MessageBounds {
        message: grpc.max_message_bytes,
        batch: grpc.max_batch_message_bytes,
        batch_path: paths::CHECK_BATCH,
        denials,
        message_timeout: (grpc.request_timeout_ms > 0)
            .then(|| Duration::from_millis(grpc.request_timeout_ms)),
    }
}

// What one HTTP/2 connection may make the server hold or do, beyond the
// `grpc.*` settings (docs/hostile-input.md lists them).
/// Bytes one stream may have in flight before the server reads them.
const STREAM_WINDOW_BYTES: u32 = 1 << 20;
/// Bytes one connection may have in flight before the server reads them.
const CONNECTION_WINDOW_BYTES: u32 = 1 << 20;
/// The largest frame a client may send.
const MAX_FRAME_BYTES: u32 = 16 << 10;
/// Streams a client may reset before the server accepts them (rapid
/// reset); past it the connection is told to go (GOAWAY ENHANCE_YOUR_CALM).
const MAX_PENDING_ACCEPT_RESET_STREAMS: usize = 20;
/// Streams the server may reset for a client's protocol errors before it
/// closes the connection.
const MAX_LOCAL_ERROR_RESET_STREAMS: usize = 1_024;

/// The HTTP/2 settings of the gRPC server: streams per connection, header
/// list size, keepalive and connection age (`grpc.*`), windows, frame size
/// and reset bounds (above), all set here rather than left to hyper's
/// defaults, so they are the documented ones.
fn transport(grpc: &crate::config::GrpcConfig) -> tonic::transport::Server {
    let keepalive =
        (grpc.keepalive_interval_ms > 0).then(|| Duration::from_millis(grpc.keepalive_interval_ms));
    let mut server = tonic::transport::Server::builder()
        .max_concurrent_streams(grpc.max_concurrent_streams)
        .http2_max_header_list_size(grpc.max_header_list_bytes)
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESET_STREAMS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESET_STREAMS))
        .http2_keepalive_interval(keepalive)
        .http2_keepalive_timeout(Some(Duration::from_millis(grpc.keepalive_timeout_ms)));
    if grpc.request_timeout_ms > 0 {
        server = server.timeout(Duration::from_millis(grpc.request_timeout_ms));
    }
    // Without a grace: tonic would then skip the GOAWAY and cut the
    // connection off at age + grace.
    match grpc.max_connection_age_ms {
        0 => server,
        age => server.max_connection_age(Duration::from_millis(age)),
    }
}

type Response = tonic::codegen::http::Response<tonic::body::Body>;
type Router = tonic::transport::server::Router<
    tower::layer::util::Stack<
        BudgetLayer,
        tower::layer::util::Stack<
            tower::util::MapResponseLayer<fn(Response) -> Response>,
            tower::layer::util::Identity,
        >,
    >,
>;

type Serving = std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>;

/// Serves `router` on `listener` (over TLS when configured), and on the
/// Unix socket `grpc.uds` when set, until `signal`. One boxed future for
/// the server's lifetime: plain TCP and TLS streams are different types.
fn serve_grpc(
    config: &Config,
    router: Router,
    listener: TcpListener,
    tls: Option<ReloadingAcceptor>,
    (budget, places): (&Arc<Budget>, &Arc<reclaim::Places>),
    signal: impl Future<Output = ()> + Send + 'static,
    tasks: &mut Tasks,
) -> Result<Serving, ServerError> {
    // One count of connections for both listeners.
    let places = Arc::clone(places);
    let Some(path) = &config.grpc.uds else {
        return serve_tcp(config, router, listener, tls, &places, Arc::clone(budget), signal, tasks);
    };
    let unix = bind_uds(path)?;
    tracing::info!(path = %path.display(), "gRPC also on a Unix socket");
    // One signal, two servers: a watch both wait on.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|stop| *stop).await;
    };
    let tcp = serve_tcp(
        config,
        router.clone(),
        listener,
        tls,
        &places,
        Arc::clone(budget),
        stopped(stop_rx.clone()),
        tasks,
    )?;
    let quotas = config.grpc.quotas();
    // The socket's clients are on this host, behind its file permissions: a proxy beside the service.
    let local: places::PeerOf<tokio::net::UnixStream> =
        Arc::new(|_| Peer { key: PeerKey::Local, trusted: true, may_report: true });
    let unix = tokio_stream::wrappers::UnixListenerStream::new(unix);
    let incoming = places::placed(unix, places, Arc::clone(budget), local, quotas);
    let uds = router.serve_with_incoming_shutdown(incoming, stopped(stop_rx));
    let path = path.clone();
    Ok(Box::pin(async move {
        // Tells both servers, then waits for them to finish.
        let forward = async move {
            signal.await;
            let _ = stop_tx.send(true);
            std::future::pending::<std::convert::Infallible>().await
        };
        let served = tokio::select! {
            (tcp, uds) = async { tokio::join!(tcp, uds) } => tcp.and(uds),
            never = forward => match never {},
        };
        let _ = std::fs::remove_file(&path);
        served
    }))
}

/// TCP keepalive on `listener` (`grpc.tcp_keepalive_ms`; 0 leaves it off):
/// probes after `idle_ms` idle, every 10 s, the connection closed after 3
/// unanswered. Set once on the listener: Linux copies it, with its timer,
/// to every connection accepted (plain or TLS alike).
fn tcp_keepalive(listener: &TcpListener, idle_ms: u64) -> std::io::Result<()> {
    if idle_ms == 0 {
        return Ok(());
    }
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_millis(idle_ms))
        .with_interval(Duration::from_secs(10))
        .with_retries(3);
    socket2::SockRef::from(listener).set_tcp_keepalive(&keepalive)
}

/// Binds the Unix socket at `path`, replacing a socket file an earlier run
/// left (never another kind of file).
fn bind_uds(path: &std::path::Path) -> Result<tokio::net::UnixListener, ServerError> {
    use std::os::unix::fs::FileTypeExt as _;
    let shown = || path.display().to_string();
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(ServerError::Uds(format!("{}: exists and is not a socket", shown())));
        }
        std::fs::remove_file(path).map_err(|e| ServerError::Uds(format!("{}: {e}", shown())))?;
    }
    tokio::net::UnixListener::bind(path)
        .map_err(|e| ServerError::Uds(format!("{}: cannot bind: {e}", shown())))
}

/// Serves `router` on `listener`, over TLS when configured, until `signal`,
/// each connection holding one of `places` while open and its shares of
/// `budget`.
#[allow(clippy::too_many_arguments)]
fn serve_tcp(
    config: &Config,
    router: Router,
    listener: TcpListener,
    tls: Option<ReloadingAcceptor>,
    places: &Arc<reclaim::Places>,
    budget: Arc<Budget>,
    signal: impl Future<Output = ()> + Send + 'static,
    tasks: &mut Tasks,
) -> Result<Serving, ServerError> {
    let places = Arc::clone(places);
    let quotas = config.grpc.quotas();
    let identify = Arc::new(places::Identify::of(&config.grpc));
    match tls {
        None => {
            let peer_of: places::PeerOf<tokio::net::TcpStream> =
                Arc::new(move |io| identify.peer(io.peer_addr().ok(), None));
            let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
            let incoming = places::placed(incoming, places, budget, peer_of, quotas);
            match config.grpc.serving_threads() {
                0 => Ok(Box::pin(router.serve_with_incoming_shutdown(incoming, signal))),
                threads => {
                    threads::serve(threads, router, incoming, signal).map_err(ServerError::ServingThread)
                }
            }
        }
        Some(tls) => {
            tracing::info!(mutual = tls.mutual(), "gRPC over TLS");
            if config.grpc.tls.reload_interval_ms > 0 {
                let interval = Duration::from_millis(config.grpc.tls.reload_interval_ms);
                let stop = tasks.stopper();
                tasks.spawn(tls.clone().watch(interval, stop));
            }
            let (streams, accept_loop) = tls.incoming(listener, tasks.stopper());
            tasks.spawn(accept_loop);
            let peer_of: places::PeerOf<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> =
                Arc::new(move |io| identify.peer(io.get_ref().0.peer_addr().ok(), Some(io)));
            let incoming = tokio_stream::wrappers::ReceiverStream::new(streams);
            let incoming = places::placed(incoming, places, budget, peer_of, quotas);
            Ok(Box::pin(router.serve_with_incoming_shutdown(incoming, signal)))
        }
    }
}
