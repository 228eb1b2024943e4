//! What the service shows of itself: the status reports' vitals, the
//! decision counters, `/metrics` and its figures, readiness and health.

use std::{sync::Arc, time::Duration};

use tokio::net::TcpListener;
use tonic_health::{pb::health_server::HealthServer, server::HealthReporter};

use super::{Rules, Tasks};
use crate::server::{
    ServerError,
    health::{Health, publish, run_monitor, serve_http},
};
use crate::{
    adapter::Adapter,
    budget::Budget,
    capture::CaptureCounters,
    config::{Config, EnvoySettings, TelemetryConfig},
    decision::{DecisionMetrics, DenialCache, Engine, Saved},
    dlq::DlqSink,
    global::status::GlobalStatus,
    limiter::Store,
    limiter::exchange::ExchangeCounts,
    overload::Overload,
    quota::QuotaFigures,
    rules::RuleSets,
    shed::Shedder,
    telemetry::{self, Metrics},
};

/// What the status reports say beside the rules: shedding, the overload
/// layer and the dead-letter pipeline, read at each report.
pub(crate) fn vitals(
    rules: &Rules,
    (shedder, overload): (&Arc<Shedder>, &Arc<Overload>),
    dlq: &Arc<DlqSink>,
    (global, rlqs): (Option<Arc<GlobalStatus>>, Option<Arc<QuotaFigures>>),
) {
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
            global: global.as_deref().map(global_vitals).unwrap_or_default(),
            rlqs: rlqs.as_deref().map(QuotaFigures::vitals).unwrap_or_default(),
        }
    });
}

/// Every global limit's figures of this region, as a status report carries them.
fn global_vitals(
    status: &GlobalStatus,
) -> std::collections::BTreeMap<String, crate::rollout::status::GlobalVital> {
    let agent = status.is_agent();
    status
        .limits()
        .into_iter()
        .map(|(id, s)| {
            let vital = crate::rollout::status::GlobalVital {
                region: status.region().to_owned(),
                granted: s.granted,
                keys: s.keys,
                demand: s.demand,
                lease_age_s: status.lease_age_seconds(&s),
                answer: s.answer.as_str().to_owned(),
                agent,
            };
            (id.to_string(), vital)
        })
        .collect()
}

/// The decision path's counters (with `envoy.upstream_metrics` on,
/// envoyproxy/ratelimit's families when Envoy rules are served and
/// limitador's when its limits are).
pub(crate) fn stats(envoy: &EnvoySettings, rules: &Rules, store: &Store) -> Arc<DecisionMetrics> {
    let mut stats = DecisionMetrics::new(store.name());
    if envoy.upstream_metrics && rules.envoy.is_some() {
        stats = stats.with_upstream(envoy.upstream_metrics_max_keys, rules.envoy.clone());
    }
    if envoy.upstream_metrics && rules.limitador.is_some() {
        stats = stats.with_limitador(envoy.upstream_metrics_max_keys, envoy.upstream_metrics_limit_name);
    }
    Arc::new(stats)
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
    pub(crate) exchanges: Arc<ExchangeCounts>,
    pub(crate) global: Option<Arc<crate::global::status::GlobalStatus>>,
    pub(crate) rlqs: Option<Arc<QuotaFigures>>,
}

/// Registers every part's figures with `metrics`, in `/metrics`' order:
/// the decision path, the stores, the request byte budget, shedding, the
/// dead-letter pipeline, the rule sets and their feeds, capture, the
/// overload layer, the adaptive limits, the periodic exchanges, the
/// global limits, the RLQS streams and the store calls saved.
pub(crate) fn register_figures(
    metrics: &Metrics,
    parts: Figures,
    rules: &Rules,
    engine: &Engine,
    budget: &Arc<Budget>,
) {
    metrics.register(parts.stats);
    metrics.register(engine.store().figures());
    metrics.register(Arc::clone(engine.local()) as Arc<dyn telemetry::Figures>);
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
    metrics.register(parts.exchanges);
    if let Some(global) = parts.global {
        metrics.register(global);
    }
    if let Some(rlqs) = parts.rlqs {
        metrics.register(rlqs);
    }
    metrics.register(Arc::new(Saved { overload: Some(parts.overload), denials: parts.denials }));
}

/// Readiness and gRPC health: the state behind `/readyz` and
/// `grpc.health.v1`, the monitor that probes the store, and the HTTP
/// endpoints when `http` is given (the probes also on
/// `http.probe_listen`, everything also on `http.metrics_listen`, when set). Starts NOT_SERVING until the first probe.
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
        (rules.envoy.is_some() || rules.limitador.is_some()).then_some(config.envoy.failure_mode),
        engine.store(),
        rules.feed.clone(),
    )
    .unready_without_store(config.http.unready_without_store)
    .with_limitador(rules.limitador.clone());
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
        // limitador's HTTP API, with its limits, on the HTTP port only.
        let api = rules.limitador.as_ref().map(|limits| {
            crate::api::limitador_http::router(engine.clone(), Arc::clone(limits), config.envoy.max_entries)
        });
        serve_endpoints(config, &health, metrics, http, api, tasks).await?;
    }
    Ok((health, reporter, service))
}

/// The HTTP endpoints on `http` (with `api`, limitador's HTTP API), the
/// probes alone on `http.probe_listen` and the endpoints but `api` on
/// `http.metrics_listen` when set, each listener with connection places of
/// its own.
async fn serve_endpoints(
    config: &Config,
    health: &Arc<Health>,
    metrics: &Arc<Metrics>,
    http: TcpListener,
    api: Option<axum::Router>,
    tasks: &mut Tasks,
) -> Result<(), ServerError> {
    tracing::info!(addr = ?http.local_addr().ok(), "serving /metrics, /healthz, /readyz");
    let limits = crate::server::conns::Limits {
        max_connections: config.http.max_connections,
        max_connections_per_peer: config.http.max_connections_per_peer,
        idle_timeout: Duration::from_millis(config.http.idle_timeout_ms),
        max_age: Duration::from_millis(config.http.max_connection_age_ms),
        header_read_timeout: Duration::from_millis(config.http.header_read_timeout_ms),
    };
    if let Some(addr) = &config.http.probe_listen {
        let probes = TcpListener::bind(addr).await.map_err(|e| ServerError::ProbeListen(addr.clone(), e))?;
        tracing::info!(addr = ?probes.local_addr().ok(), "serving /healthz, /readyz, /healthcheck");
        let stop = tasks.stopper();
        tasks.spawn(serve_http(probes, limits, Arc::clone(health), None, None, stop));
    }
    if let Some(addr) = &config.http.metrics_listen {
        let scrapes =
            TcpListener::bind(addr).await.map_err(|e| ServerError::MetricsListen(addr.clone(), e))?;
        tracing::info!(addr = ?scrapes.local_addr().ok(), "serving /metrics, /healthz, /readyz");
        let stop = tasks.stopper();
        tasks.spawn(serve_http(scrapes, limits, Arc::clone(health), Some(Arc::clone(metrics)), None, stop));
    }
    let stop = tasks.stopper();
    tasks.spawn(serve_http(http, limits, Arc::clone(health), Some(Arc::clone(metrics)), api, stop));
    Ok(())
}
