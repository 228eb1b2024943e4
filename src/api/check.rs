//! `ratelimit.v1.RateLimiter`: `Check` and `Report`, and the many-decision
//! calls `CheckBatch` (unary) and `CheckStream` (bidirectional), whose
//! items are decided exactly as `Check` decides them.

use std::{pin::Pin, sync::Arc};

use futures_util::{Stream, StreamExt as _};
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument as _;

use super::{
    convert::{ValidationError, call_traceparent, response, validate},
    pb,
};
use crate::{
    decision::{Api, Engine},
    limiter::Count,
    telemetry::traces::continue_trace,
};

/// Most items in one `CheckBatch`: a bigger batch is refused
/// (INVALID_ARGUMENT), so one call's work and memory stay bounded.
pub const MAX_BATCH_ITEMS: usize = 1_024;

/// Most items of one `CheckStream` decided at a time: the stream is not
/// read further until one of them is answered.
pub const STREAM_IN_FLIGHT: usize = 256;

/// The native decision service.
#[derive(Debug, Clone)]
pub struct RateLimiterService {
    engine: Engine,
}

impl RateLimiterService {
    /// A service deciding with `engine`.
    pub fn new(engine: Engine) -> Self {
        RateLimiterService { engine }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> pb::rate_limiter_server::RateLimiterServer<Self> {
        pb::rate_limiter_server::RateLimiterServer::new(self)
    }
}

impl RateLimiterService {
    /// Validates, decides inside the request span, and answers; `report`:
    /// the request is a `Report` (counted whatever is left).
    async fn decide(
        &self,
        request: Request<pb::RateLimitRequest>,
        report: bool,
    ) -> Result<Response<pb::RateLimitResponse>, Status> {
        let (metadata, _, message) = request.into_parts();
        // Bad input is the caller's bug: INVALID_ARGUMENT naming field and bound.
        // Store failures never become a gRPC error here: the rule's failure
        // policy answers (FAIL_OPEN / FAIL_CLOSED) so the gateway always gets
        // a decision it can act on.
        let refuse = |e: ValidationError| {
            self.engine.refused(Api::Check, e.reason);
            Status::invalid_argument(e.to_string())
        };
        let mut checked = validate(&message, call_traceparent(&metadata)).map_err(refuse)?;
        if report {
            if message.peek {
                return Err(refuse(ValidationError {
                    field: "peek",
                    message: "must be false on Report (a report always counts)".to_owned(),
                    reason: "peek_report",
                }));
            }
            checked.count = Count::Always;
        }
        // One field list for both spans: the engine records `rule`, `reason`
        // and `allowed` on whichever it runs in. (A span's name must be a literal.)
        macro_rules! request_span {
            ($name:literal) => {
                tracing::info_span!(
                    $name,
                    otel.kind = "server",
                    rule = tracing::field::Empty,
                    reason = tracing::field::Empty,
                    allowed = tracing::field::Empty,
                )
            };
        }
        let span = if report { request_span!("ratelimit.report") } else { request_span!("ratelimit.check") };
        continue_trace(&span, &metadata);
        // The engine fills the span's decision fields (it runs inside it).
        let decision = self.engine.check(&checked).instrument(span).await;
        Ok(Response::new(response(decision)))
    }

    /// Decides one item of a batch or a stream as `Check` would, without a
    /// span of its own (one per item would cost more than the decision);
    /// an invalid item is answered with why, not with a call error.
    async fn decide_item(&self, item: pb::CheckItem, traceparent: Option<&str>) -> pb::CheckResult {
        let id = item.id;
        let request = item.request.unwrap_or_default();
        match validate(&request, traceparent) {
            Ok(checked) => {
                let decision = self.engine.check(&checked).await;
                pb::CheckResult { id, response: Some(response(decision)), invalid_argument: String::new() }
            }
            Err(e) => {
                self.engine.refused(Api::Check, e.reason);
                pb::CheckResult { id, response: None, invalid_argument: e.to_string() }
            }
        }
    }
}

/// The results of a `CheckStream`, in the order they are decided.
type ResultStream = Pin<Box<dyn Stream<Item = Result<pb::CheckResult, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl pb::rate_limiter_server::RateLimiter for RateLimiterService {
    type CheckStreamStream = ResultStream;

    async fn check(
        &self,
        request: Request<pb::RateLimitRequest>,
    ) -> Result<Response<pb::RateLimitResponse>, Status> {
        self.decide(request, false).await
    }

    async fn report(
        &self,
        request: Request<pb::RateLimitRequest>,
    ) -> Result<Response<pb::RateLimitResponse>, Status> {
        self.decide(request, true).await
    }

    async fn check_batch(
        &self,
        request: Request<pb::CheckBatchRequest>,
    ) -> Result<Response<pb::CheckBatchResponse>, Status> {
        let (metadata, _, batch) = request.into_parts();
        if batch.items.len() > MAX_BATCH_ITEMS {
            self.engine.refused(Api::Check, "batch_too_large");
            return Err(Status::invalid_argument(format!(
                "items: {} items, at most {MAX_BATCH_ITEMS} in one CheckBatch",
                batch.items.len()
            )));
        }
        let span =
            tracing::info_span!("ratelimit.check_batch", otel.kind = "server", items = batch.items.len());
        continue_trace(&span, &metadata);
        // Decided together: with the Redis store they queue at once and
        // share script calls.
        let traceparent = call_traceparent(&metadata);
        let decisions = batch.items.into_iter().map(|item| self.decide_item(item, traceparent));
        let results = futures_util::future::join_all(decisions).instrument(span).await;
        Ok(Response::new(pb::CheckBatchResponse { results }))
    }

    async fn check_stream(
        &self,
        request: Request<Streaming<pb::CheckItem>>,
    ) -> Result<Response<Self::CheckStreamStream>, Status> {
        let (metadata, _, items) = request.into_parts();
        // The call's trace context, read once for all its items.
        let traceparent: Option<Arc<str>> = call_traceparent(&metadata).map(Arc::from);
        let service = self.clone();
        // Up to STREAM_IN_FLIGHT items decided at a time, each answered as
        // soon as it is; a broken input stream ends the output with its status.
        let results = items
            .map(move |item| {
                let (service, traceparent) = (service.clone(), traceparent.clone());
                async move { Ok(service.decide_item(item?, traceparent.as_deref()).await) }
            })
            .buffer_unordered(STREAM_IN_FLIGHT);
        Ok(Response::new(Box::pin(results)))
    }
}
