//! limitador's HTTP API, on the HTTP port with limitador's limits:
//!
//! - `POST /check`, `/report`, `/check_and_report` with
//!   `{"namespace", "values": {key: value}, "delta", "response_headers"?}`
//!   (`values` is the request's one descriptor): whether `delta` more hits
//!   fit (nothing counted: 200 `null`, or 429 `Too many requests`), the
//!   hits counted whatever is left (200 `null`), or both at once (200 or
//!   429, `null`; with `"response_headers": "DraftVersion03"` limitador's
//!   `X-RateLimit-*` headers). A store that cannot answer under
//!   `envoy.failure_mode: unavailable` is 500; a body that is not such an
//!   object is 400.
//! - `GET /limits/{namespace}`: the namespace's limits as limitador lists
//!   them.
//! - A method a route does not take, `HEAD` included, is 404 as a path
//!   none serves ([`routed_as_limitador`]).
//! - `GET /counters/{namespace}`: its counters that hold hits, as
//!   limitador lists them (`limit`, `set_variables`, `remaining`,
//!   `expires_in_seconds`), at most
//!   [`MAX_LISTED_COUNTERS`](crate::decision::limitador::MAX_LISTED_COUNTERS);
//!   `ratelimitd-counters-truncated: true` when there were more (or the
//!   store's scan reached its bound), `ratelimitd-counters-unnamed: N` for
//!   counters that name no limit of the file. Listings are paced
//!   ([`Listings`]): one at a time, and each starts no sooner after the
//!   last than that one took, so they hold the store's side connection
//!   (and Redis' `SCAN` work) at most half of the time, whoever asks; the
//!   others wait in turn, up to [`LISTING_TIMEOUT`] in all. A store that
//!   cannot answer, or a listing past the timeout, is 500.
//!
//! A body is read up to [`MAX_BODY_BYTES`]; its values are bounded as a
//! descriptor's entries are (`envoy.max_entries`; a long key or value
//! counted by its digest). Each connection carries one request at a time,
//! so a peer holds at most `http.max_connections_per_peer` decisions in
//! flight; with `http.probe_listen` the probes have places of their own.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use axum::{
    Router,
    body::Bytes,
    extract::{DefaultBodyLimit, Path, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde::Deserialize;
use tokio::{sync::Semaphore, time::Instant};

use crate::{
    decision::{Engine, OwnedDescriptor, RlsDecision, RlsRequest, limitador::Call},
    rules::{
        Hot,
        limitador::{Limit, Limits},
    },
};

/// The largest request body read.
pub const MAX_BODY_BYTES: usize = 64 << 10;

/// The longest a counter listing takes, its wait for its turn included.
pub const LISTING_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone)]
struct Api {
    engine: Engine,
    limits: Arc<Hot<Limits>>,
    max_entries: usize,
    listings: Arc<Listings>,
}

/// Counter listings, paced: one at a time, and each starts no sooner after
/// the previous one ended than that one took (a listing cut short by its
/// timeout included).
#[derive(Debug)]
struct Listings {
    turn: Semaphore,
    not_before: Mutex<Instant>,
}

impl Listings {
    fn new() -> Self {
        Listings { turn: Semaphore::new(1), not_before: Mutex::new(Instant::now()) }
    }

    /// Runs `listing` at its turn.
    async fn run<T>(&self, listing: impl Future<Output = T>) -> T {
        let _turn = self.turn.acquire().await;
        let not_before = *self.not_before.lock().unwrap_or_else(PoisonError::into_inner);
        tokio::time::sleep_until(not_before).await;
        // Dropped before the turn is: the next listing sees the pause.
        let _paced = Paced { listings: self, started: Instant::now() };
        listing.await
    }
}

/// Sets the next listing's earliest start when a listing ends, or is
/// dropped.
struct Paced<'a> {
    listings: &'a Listings,
    started: Instant,
}

impl Drop for Paced<'_> {
    fn drop(&mut self) {
        let now = Instant::now();
        *self.listings.not_before.lock().unwrap_or_else(PoisonError::into_inner) = now + (now - self.started);
    }
}

/// A check or report, as limitador's HTTP API takes it (its name is
/// limitador's: a body of the wrong shape is refused naming it).
#[derive(Debug, Deserialize)]
struct CheckAndReportInfo {
    namespace: String,
    values: HashMap<String, String>,
    delta: u64,
    #[serde(default)]
    response_headers: Option<String>,
}

/// The API's routes, deciding with `engine` under `limits`; `max_entries`
/// bounds a request's values (`envoy.max_entries`).
pub fn router(engine: Engine, limits: Arc<Hot<Limits>>, max_entries: usize) -> Router {
    Router::new()
        .route("/check", post(|s: State<Api>, h: HeaderMap, body: Bytes| decide(s, h, body, Call::Check)))
        .route("/report", post(|s: State<Api>, h: HeaderMap, body: Bytes| decide(s, h, body, Call::Report)))
        .route(
            "/check_and_report",
            post(|s: State<Api>, h: HeaderMap, body: Bytes| decide(s, h, body, Call::Admit)),
        )
        .route("/limits/{namespace}", get(limits_of))
        .route("/counters/{namespace}", get(counters_of))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(Api { engine, limits, max_entries, listings: Arc::new(Listings::new()) })
}

/// `app` (the API's routes with the HTTP port's) answering a method a
/// route does not take as limitador's server does: 404 with no body, as
/// for a path it does not know (not 405), and `HEAD` too (limitador serves
/// no `HEAD` from its `GET` routes).
pub fn routed_as_limitador(app: Router) -> Router {
    async fn no_head(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
        if request.method() == axum::http::Method::HEAD {
            return StatusCode::NOT_FOUND.into_response();
        }
        next.run(request).await
    }
    app.method_not_allowed_fallback(|| async { StatusCode::NOT_FOUND })
        .layer(axum::middleware::from_fn(no_head))
}

/// Whether the body is declared JSON as limitador's JSON extractor (actix
/// web's) requires before it reads one: a content type whose subtype is
/// `json` or ends in `+json`, any parameters after it.
fn json_content(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(axum::http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    let Some((_, subtype)) = essence.split_once('/') else { return false };
    let subtype = subtype.to_ascii_lowercase();
    subtype == "json" || subtype.ends_with("+json")
}

/// limitador's 500: its text body.
fn internal_server_error() -> Response {
    (StatusCode::INTERNAL_SERVER_ERROR, "Internal server error").into_response()
}

/// limitador's JSON `null`, with `status`.
fn null(status: StatusCode) -> Response {
    (status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], "null").into_response()
}

async fn decide(State(api): State<Api>, headers: HeaderMap, body: Bytes, call: Call) -> Response {
    if !json_content(&headers) {
        return (StatusCode::BAD_REQUEST, "Content type error").into_response();
    }
    let request: CheckAndReportInfo = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("Json deserialize error: {e}")).into_response(),
    };
    if request.values.len() > api.max_entries {
        let message = format!(
            "values: {} exceed the maximum of {} (envoy.max_entries)",
            request.values.len(),
            api.max_entries
        );
        return (StatusCode::BAD_REQUEST, message).into_response();
    }
    let mut entries: Vec<(String, String)> = request.values.into_iter().collect();
    entries.sort_unstable();
    let descriptors = [OwnedDescriptor { entries, limit: None, hits_addend: None }];
    let rls = RlsRequest {
        domain: &request.namespace,
        descriptors: &descriptors,
        hits_addend: 1,
        trace_id: None,
        share: None,
        may_report: false,
    };
    let decision = api.engine.limitador(&api.limits.load(), &rls, call, Some(request.delta)).await;
    if call == Call::Admit {
        // limitador's families count `check_and_report` only of its HTTP calls.
        api.engine.limitador_counted(&request.namespace, call, &decision, request.delta);
    }
    if decision.failure.is_some() {
        return match call {
            Call::Check => internal_server_error(),
            _ => null(StatusCode::INTERNAL_SERVER_ERROR),
        };
    }
    match call {
        Call::Report => null(StatusCode::OK),
        Call::Check if decision.over_limit => {
            (StatusCode::TOO_MANY_REQUESTS, "Too many requests").into_response()
        }
        Call::Check => null(StatusCode::OK),
        Call::Admit => {
            let status = if decision.over_limit { StatusCode::TOO_MANY_REQUESTS } else { StatusCode::OK };
            let mut response = null(status);
            if request.response_headers.as_deref() == Some("DraftVersion03") {
                let names = ["X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"];
                for (name, value) in names.into_iter().zip(draft03(&decision).into_iter().flatten()) {
                    if let Ok(value) = HeaderValue::from_str(&value) {
                        response.headers_mut().insert(name, value);
                    }
                }
            }
            response
        }
    }
}

/// limitador's draft-03 headers, for its HTTP API and its `ShouldRateLimit`
/// alike: the limit with the fewest hits left (`X-RateLimit-Limit` lists
/// every limit, fewest left first, as `max;w=seconds[;name="…"]`), what it
/// has left, and the whole seconds until it resets, counted from just after
/// the decision as limitador counts them (59 at a minute window's first
/// hit). `None` when no limit was counted.
pub(crate) fn draft03(decision: &RlsDecision) -> Option<[String; 3]> {
    let mut counted: Vec<_> = decision.statuses.iter().filter(|s| s.limit.is_some()).collect();
    counted.sort_by_key(|s| s.remaining);
    let first = counted.first()?;
    let max = |s: &&crate::decision::DescriptorDecision| s.limit.as_ref().map_or(0, |l| l.per_unit());
    let mut limit = max(first).to_string();
    for status in &counted {
        let Some(l) = &status.limit else { continue };
        limit.push_str(&format!(", {};w={}", l.per_unit(), l.window_seconds().unwrap_or(0)));
        if let Some(name) = &l.name {
            limit.push_str(&format!(";name=\"{}\"", name.replace('"', "'")));
        }
    }
    let reset = first.until_reset_ms.saturating_sub(1) / 1_000;
    Some([limit, first.remaining.to_string(), reset.to_string()])
}

/// A limit as limitador lists it.
fn limit_json(l: &Limit) -> serde_json::Value {
    serde_json::json!({
        "id": l.id.as_deref(),
        "namespace": &*l.namespace,
        "max_value": l.max_value,
        "seconds": l.seconds,
        "name": l.name.as_deref(),
        "conditions": l.conditions().collect::<Vec<_>>(),
        "variables": l.variables().collect::<Vec<_>>(),
    })
}

/// `GET /limits/{namespace}`: each limit as limitador lists it.
async fn limits_of(State(api): State<Api>, Path(namespace): Path<String>) -> Response {
    let limits = api.limits.load();
    let listed: Vec<serde_json::Value> = limits.of(&namespace).iter().map(limit_json).collect();
    axum::Json(listed).into_response()
}

/// `GET /counters/{namespace}`: each counter holding hits as limitador
/// lists it (`expires_in_seconds` in whole seconds, as limitador's memory
/// store reads a counter's time to live).
async fn counters_of(State(api): State<Api>, Path(namespace): Path<String>) -> Response {
    let limits = api.limits.load();
    let listing = api.listings.run(api.engine.limitador_counters(&limits, &namespace));
    let counters = match tokio::time::timeout(LISTING_TIMEOUT, listing).await {
        Ok(Ok(counters)) => counters,
        failed => {
            let error = match failed {
                Ok(Err(store)) => format!("the store did not answer: {store}"),
                _ => format!("not done within {} ms", LISTING_TIMEOUT.as_millis()),
            };
            tracing::warn!(namespace, error, "limitador counters not listed");
            return internal_server_error();
        }
    };
    let listed: Vec<serde_json::Value> = counters
        .counters
        .iter()
        .map(|c| {
            serde_json::json!({
                "limit": limit_json(c.limit),
                "set_variables": c.variables.iter().map(|(k, v)| (k.clone(), v.as_str().into())).collect::<serde_json::Map<_, _>>(),
                "remaining": c.remaining,
                "expires_in_seconds": c.reset_after_ms / 1_000,
            })
        })
        .collect();
    let mut response = axum::Json(listed).into_response();
    let headers = response.headers_mut();
    if !counters.complete {
        headers.insert("ratelimitd-counters-truncated", HeaderValue::from_static("true"));
    }
    if counters.unnamed > 0 {
        headers.insert("ratelimitd-counters-unnamed", HeaderValue::from(counters.unnamed));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each listing starts no sooner after the last than that one took,
    /// one cut short by a timeout included.
    #[tokio::test(start_paused = true)]
    async fn listings_are_paced_by_what_they_took() {
        let listings = Listings::new();
        let start = Instant::now();
        listings.run(tokio::time::sleep(Duration::from_millis(300))).await;
        assert_eq!(listings.run(async { Instant::now() }).await - start, Duration::from_millis(600));
        let cut = tokio::time::timeout(
            Duration::from_millis(100),
            listings.run(tokio::time::sleep(Duration::from_secs(60))),
        );
        assert!(cut.await.is_err());
        let after_cut = Instant::now();
        assert_eq!(listings.run(async { Instant::now() }).await - after_cut, Duration::from_millis(100));
    }
}
