//! Liveness, readiness and gRPC health, from one monitor.
//!
//! `/healthz` answers 200 while the process serves. `/readyz` and
//! `grpc.health.v1.Health` say whether this instance can decide: not
//! ready while starting, waiting for its first rules (rules topic, xDS) or
//! draining on shutdown. The counter store is shared by every instance, so
//! its outage does not make one unready (that would take every instance
//! out of its endpoints at once): decisions then follow each rule's
//! failure policy, flagged, and the body says so and which rules fail
//! closed. `http.unready_without_store` makes an instance unready while
//! the store is out and some answer would deny by policy. The body says
//! which. `/readyz` reads the breakers when asked; gRPC health is
//! published by the monitor, every `http.health_interval_ms`.
//! `/healthcheck` is envoyproxy/ratelimit's probe: the same verdict, with
//! upstream's answers (200 `OK`, else 500).
//!
//! The monitor probes the store whatever the traffic, and a probe that
//! finds Redis answering closes its breakers: an instance made unready by
//! an open breaker gets no traffic, so no decision would ever close it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU8, Ordering},
    },
    time::Duration,
};

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use tokio::{net::TcpListener, sync::watch};
use tonic_health::server::HealthReporter;

use crate::telemetry::Metrics;
use crate::{
    config::EnvoyFailureMode,
    limiter::{Store, breaker::Breaker},
    rules::{FailurePolicy, Feed, Hot, RuleStore, XdsState, limitador::Limits},
};

/// The native API's gRPC service, whose health is always reported.
pub const CHECK_SERVICE: &str = "ratelimit.v1.RateLimiter";
/// Envoy's rate limit service, whose health is reported only when it is
/// served (Envoy rules configured); otherwise a check of it is NOT_FOUND.
pub const ENVOY_SERVICE: &str = "envoy.service.ratelimit.v3.RateLimitService";

const STARTING: u8 = 0;
const STORE_UP: u8 = 1;
const STORE_DOWN: u8 = 2;
const DRAINING: u8 = 3;

/// What the monitor last saw.
#[derive(Debug)]
pub struct Health {
    state: AtomicU8,
    rules: Arc<RuleStore>,
    envoy_failure_mode: Option<EnvoyFailureMode>,
    store_name: &'static str,
    /// The Redis store's circuit breakers (none for the memory store).
    breakers: Option<Arc<[Breaker]>>,
    /// The rules topic's feed (`rules.source: kafka`).
    feed: Option<Arc<Feed>>,
    /// The xDS subscription (`rules.source: xds`), and whether the service
    /// serves before its first set (`rules.xds.force_start`).
    xds: Option<(Arc<XdsState>, bool)>,
    /// `http.unready_without_store`.
    unready_without_store: bool,
    /// limitador's limits (`rules.limitador_path`): `/status` reports them.
    limitador: Option<Arc<Hot<Limits>>>,
    /// When the service started.
    started_at: std::time::SystemTime,
}

impl Health {
    /// The gRPC services whose health is reported besides the overall "":
    /// the native API, and Envoy's when it is served.
    pub fn services(&self) -> impl Iterator<Item = &'static str> + use<> {
        [Some(CHECK_SERVICE), self.envoy_failure_mode.map(|_| ENVOY_SERVICE)].into_iter().flatten()
    }

    /// Health of a service deciding with `rules`; `envoy_failure_mode` when
    /// `ShouldRateLimit` is served.
    /// `feed` when rules come from the rules topic.
    pub fn new(
        rules: Arc<RuleStore>,
        envoy_failure_mode: Option<EnvoyFailureMode>,
        store: &Store,
        feed: Option<Arc<Feed>>,
    ) -> Self {
        let breakers = store.breakers();
        Health {
            state: AtomicU8::new(STARTING),
            rules,
            envoy_failure_mode,
            store_name: store.name(),
            breakers,
            feed,
            xds: None,
            unready_without_store: false,
            limitador: None,
            started_at: std::time::SystemTime::now(),
        }
    }

    /// Serving limitador's `limits`: `/status` answers as limitador's.
    pub fn with_limitador(mut self, limits: Option<Arc<Hot<Limits>>>) -> Self {
        // The service started before it loaded the limits.
        if let Some(limits) = &limits {
            self.started_at = self.started_at.min(limits.swapped_at());
        }
        self.limitador = limits;
        self
    }

    /// Not ready while the store is out and some answer would deny by
    /// policy (`http.unready_without_store`).
    pub fn unready_without_store(mut self, unready: bool) -> Self {
        self.unready_without_store = unready;
        self
    }

    /// With Envoy rules over xDS: not ready before the first set, unless
    /// `force_start`.
    pub fn with_xds(mut self, state: Arc<XdsState>, force_start: bool) -> Self {
        self.xds = Some((state, force_start));
        self
    }

    /// How many circuit breakers are open.
    fn open_breakers(&self) -> usize {
        self.breakers.as_deref().map_or(0, |b| b.iter().filter(|b| b.is_open()).count())
    }

    /// Marks the service as draining (shutdown has begun).
    pub fn set_draining(&self) {
        self.state.store(DRAINING, Ordering::SeqCst);
    }

    /// Ready, and why (or why not), then the rules version served.
    pub fn readiness(&self) -> (bool, String) {
        let native = self.rules.load();
        let served = match &self.feed {
            None => format!("rules {} ({} native rules)", native.version(), native.rules().len()),
            Some(feed) => match feed.served() {
                None => return (false, "not ready: waiting for rules from the rules topic".to_owned()),
                Some(served) => format!(
                    "rules {} (from {}, {} native rules)",
                    served.version,
                    served.origin.as_str(),
                    native.rules().len()
                ),
            },
        };
        let served = match &self.xds {
            None => served,
            Some((xds, force_start)) => match (xds.version(), force_start) {
                (None, false) => {
                    return (
                        false,
                        "not ready: waiting for the first rate-limit configuration over xDS".to_owned(),
                    );
                }
                (None, true) => format!("{served}; no xDS set yet (rules.xds.force_start)"),
                (Some(version), _) => format!("{served}; xDS set {}", version.escape_debug()),
            },
        };
        let (ready, why) = self.store_readiness();
        (ready, format!("{why}; {served}"))
    }

    fn store_readiness(&self) -> (bool, String) {
        let open = self.open_breakers();
        match self.state.load(Ordering::SeqCst) {
            STARTING => (false, "not ready: starting".to_owned()),
            STORE_UP if open == 0 => {
                (true, format!("ready: {} store reachable, decisions are exact", self.store_name))
            }
            DRAINING => (false, "not ready: draining for shutdown".to_owned()),
            state => {
                let down = if state == STORE_UP {
                    format!(
                        "{} store failing (circuit breaker open: {open} of {})",
                        self.store_name,
                        self.breakers.as_deref().map_or(0, <[Breaker]>::len)
                    )
                } else {
                    format!("{} store unreachable", self.store_name)
                };
                let snapshot = self.rules.load();
                let closed: Vec<&str> = snapshot
                    .rules()
                    .iter()
                    .filter(|r| r.failure_policy == FailurePolicy::Closed)
                    .map(|r| &*r.id)
                    .collect();
                let envoy_denies = self.envoy_failure_mode == Some(EnvoyFailureMode::Unavailable);
                if closed.is_empty() && !envoy_denies {
                    return (true, format!("ready: {down}, decisions are local or open by policy"));
                }
                let mut denying = String::new();
                if !closed.is_empty() {
                    denying += &format!("; rules failing closed: {}", closed.join(", "));
                }
                if envoy_denies {
                    denying += "; ShouldRateLimit answers UNAVAILABLE";
                }
                match self.unready_without_store {
                    true => (false, format!("not ready: {down}{denying} (http.unready_without_store)")),
                    false => {
                        (true, format!("ready: {down}, decisions follow each rule's failure policy{denying}"))
                    }
                }
            }
        }
    }
}

impl crate::telemetry::Figures for Health {
    fn render(&self, out: &mut String) {
        use crate::telemetry::exposition::single;
        single(
            out,
            "ratelimitd_ready",
            "gauge",
            "1 while /readyz answers 200 (this instance can decide), else 0: starting, waiting for its first rules, draining.",
            u8::from(self.readiness().0),
        );
        let exact = self.state.load(Ordering::SeqCst) == STORE_UP && self.open_breakers() == 0;
        single(
            out,
            "ratelimitd_store_reachable",
            "gauge",
            "1 while the counter store answers and no circuit breaker is open (decisions are exact), else 0.",
            u8::from(exact),
        );
        if self.limitador.is_some() {
            single(out, "limitador_up", "gauge", "Limitador is running (limitador's name): 1.", 1);
            single(
                out,
                "datastore_partitioned",
                "gauge",
                "Limitador is partitioned from backing datastore (limitador's name): 1 while ratelimitd_store_reachable is 0.",
                u8::from(!exact),
            );
        }
    }
}

/// Probes the store every `interval` and publishes readiness to `reporter`
/// until `shutdown`.
pub async fn run_monitor(
    health: Arc<Health>,
    store: Store,
    reporter: HealthReporter,
    interval: Duration,
    probe_timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_ready = None;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => return,
        }
        if health.state.load(Ordering::SeqCst) == DRAINING {
            continue;
        }
        let up = store.probe(probe_timeout).await;
        // A concurrent drain wins: never turn draining back into serving.
        let next = if up { STORE_UP } else { STORE_DOWN };
        let _ = health
            .state
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |s| (s != DRAINING).then_some(next));
        let (ready, why) = health.readiness();
        if last_ready != Some(ready) {
            tracing::info!(ready, %why, "readiness changed");
            publish(&reporter, &health, ready).await;
            last_ready = Some(ready);
        }
    }
}

/// Sets every gRPC service `health` reports (and the overall "") to
/// `serving` or not.
pub async fn publish(reporter: &HealthReporter, health: &Health, serving: bool) {
    let status =
        if serving { tonic_health::ServingStatus::Serving } else { tonic_health::ServingStatus::NotServing };
    for service in health.services().chain([""]) {
        reporter.set_service_status(service, status).await;
    }
}

#[derive(Clone)]
struct HttpState {
    health: Arc<Health>,
    metrics: Option<Arc<Metrics>>,
}

/// Serves `/healthz`, `/readyz`, `/healthcheck` and, given `metrics`,
/// `/metrics` (and, given `api`, its routes) on `listener`, its
/// connections bounded by `limits`, until `shutdown`.
pub async fn serve_http(
    listener: TcpListener,
    limits: super::conns::Limits,
    health: Arc<Health>,
    metrics: Option<Arc<Metrics>>,
    api: Option<Router>,
    shutdown: watch::Receiver<bool>,
) {
    let probes = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready_handler))
        .route("/healthcheck", get(healthcheck_handler));
    let probes =
        if health.limitador.is_some() { probes.route("/status", get(status_handler)) } else { probes };
    let app = if metrics.is_some() { probes.route("/metrics", get(metrics_handler)) } else { probes };
    let app = app.with_state(HttpState { health, metrics });
    let app = match api {
        Some(api) => crate::api::limitador_http::routed_as_limitador(app.merge(api)),
        None => app,
    };
    serve_app(listener, limits, app, shutdown).await;
}

/// Serves `app` on `listener`, its connections bounded by `limits`, until
/// `shutdown`; each request carries its peer's address
/// (`ConnectInfo<SocketAddr>`). The HTTP port's server and the console's.
pub async fn serve_app(
    listener: TcpListener,
    limits: super::conns::Limits,
    app: Router,
    shutdown: watch::Receiver<bool>,
) {
    serve_bounded(super::conns::Capped::new(listener, limits), app, limits.header_read_timeout, shutdown)
        .await;
}

/// HTTP/1.1 on `listener` until `shutdown`: each connection must send a
/// request's whole head within `header_read_timeout` of its first byte
/// (hyper's deadline, which axum's own server leaves off), then closes
/// gracefully at shutdown; returns when every connection is closed.
async fn serve_bounded(
    mut listener: super::conns::Capped<TcpListener>,
    app: Router,
    header_read_timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    use axum::serve::Listener as _;
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.changed() => break,
        };
        while connections.try_join_next().is_some() {}
        let app = app.clone().layer(axum::Extension(axum::extract::ConnectInfo(peer)));
        let service = hyper_util::service::TowerToHyperService::new(app);
        let mut stop = shutdown.clone();
        connections.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(header_read_timeout);
            let connection = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                _ = stop.changed() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    }
    while connections.join_next().await.is_some() {}
}

async fn metrics_handler(State(state): State<HttpState>) -> impl IntoResponse {
    let text = state.metrics.as_ref().map(|metrics| metrics.render()).unwrap_or_default();
    ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

/// envoyproxy/ratelimit's `/healthcheck`, which its manifests and Envoy
/// Gateway probe: readiness with upstream's answers, `OK` (200) or an empty
/// 500.
async fn healthcheck_handler(State(state): State<HttpState>) -> axum::response::Response {
    if state.health.readiness().0 {
        "OK".into_response()
    } else {
        StatusCode::INTERNAL_SERVER_ERROR.into_response()
    }
}

/// limitador's `/status`, which its operator's probes read: always 200,
/// `{"started_at", "config_applied_at", "config_version",
/// "config_err_since"}` (times as limitador writes them: UTC, no zone;
/// the version counts the reloads applied since start, 0 before the first,
/// as limitador counts them: its first load precedes its status; the
/// errors, reloads refused since the last applied).
async fn status_handler(State(state): State<HttpState>) -> axum::response::Response {
    let Some(limits) = &state.health.limitador else { return StatusCode::NOT_FOUND.into_response() };
    let time = |at: std::time::SystemTime| {
        humantime::format_rfc3339_micros(at).to_string().trim_end_matches('Z').to_owned()
    };
    axum::Json(serde_json::json!({
        "started_at": time(state.health.started_at),
        "config_applied_at": time(limits.swapped_at()),
        "config_version": limits.loads().saturating_sub(1),
        "config_err_since": limits.failures_since_swap(),
    }))
    .into_response()
}

async fn ready_handler(State(state): State<HttpState>) -> impl IntoResponse {
    let (ready, why) = state.health.readiness();
    (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, why + "\n")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::{
        io::{AsyncReadExt as _, AsyncWriteExt as _},
        net::{TcpListener, TcpStream},
        sync::watch,
    };

    use super::*;

    /// A request head trickled in a byte at a time, each byte well within
    /// the idle timeout, is cut at the header-read deadline; a prompt
    /// request on the next connection is answered; shutdown returns.
    #[tokio::test]
    async fn a_trickled_request_head_is_cut_at_its_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let limits = super::super::conns::Limits {
            max_connections: 1,
            max_connections_per_peer: 1,
            idle_timeout: Duration::from_secs(10),
            max_age: Duration::from_secs(60),
            header_read_timeout: Duration::from_millis(300),
        };
        let app = Router::new().route("/healthz", get(|| async { "ok\n" }));
        let (stop, stopped) = watch::channel(false);
        let server = tokio::spawn(serve_bounded(
            super::super::conns::Capped::new(listener, limits),
            app,
            limits.header_read_timeout,
            stopped,
        ));
        let mut slow = TcpStream::connect(addr).await.unwrap();
        let started = tokio::time::Instant::now();
        let mut cut = None;
        for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" {
            if slow.write_all(&[*byte]).await.is_err() {
                cut = Some(started.elapsed());
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut rest)).await;
        let cut = cut.unwrap_or_else(|| started.elapsed());
        assert!(read.is_ok(), "the connection is closed");
        assert!(cut < Duration::from_secs(3), "closed after {cut:?}, the head still incomplete");
        // Its place is free again (max_connections 1): a prompt request is answered.
        let mut prompt = TcpStream::connect(addr).await.unwrap();
        prompt.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
        let mut answer = String::new();
        prompt.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("ok\n"), "{answer}");
        stop.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), server).await.unwrap().unwrap();
    }
}
