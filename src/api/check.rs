//! `ratelimit.v1.RateLimiter`: `Check` and `Report`, and the many-decision
//! calls `CheckBatch` (unary) and `CheckStream` (bidirectional), whose
//! items are decided exactly as `Check` decides them.

use std::{
    pin::Pin,
    sync::{Arc, LazyLock},
};

use futures_util::{
    Stream, StreamExt as _,
    future::{Either, ready},
};
use tonic::{Request, Response, Status, Streaming, codegen::Bytes};
use tracing::Instrument as _;

use super::{
    convert::{ValidationError, call_traceparent, reported, response, unknown_priority, validate},
    eager::eager_unordered,
    pb,
};

use crate::{
    budget::{Caller, Refusal},
    decision::{Api, CheckRequest, Engine, reservation::Reservation},
    limiter::{CallerCalls, Count},
    telemetry::traces::continue_trace,
};

/// Most items in one `CheckBatch`: a bigger batch is refused
/// (INVALID_ARGUMENT), so one call's work and memory stay bounded.
pub const MAX_BATCH_ITEMS: usize = 1_024;

/// Most items of one `CheckStream` decided at a time: the stream is not
/// read further until one of them is answered.
pub const STREAM_IN_FLIGHT: usize = 256;

/// The back-off a caller refused for its share of the request byte budget
/// is told (`CALLER_BUSY`): its unfinished requests free their bytes when
/// they end, at the latest after `grpc.request_timeout_ms`.
const CALLER_BUSY_RETRY_MS: i64 = 1_000;

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

    /// The answer to a `Check` or `Report` refused unread, encoded: denied,
    /// never to pass when its message is over `grpc.max_message_bytes`,
    /// after a back-off when its caller holds its share of the request
    /// byte budget.
    pub fn refused_unread(&self, refusal: Refusal) -> Bytes {
        let (reason, retry_after_ms) = match refusal {
            Refusal::TooLarge => (pb::Reason::RequestTooLarge, -1),
            Refusal::CallerBusy => (pb::Reason::CallerBusy, CALLER_BUSY_RETRY_MS),
        };
        let answer = pb::RateLimitResponse {
            allowed: false,
            retry_after_ms,
            cluster_utilization_status: self.engine.shedder().level().as_str().to_owned(),
            reason: reason as i32,
            ..Default::default()
        };
        Bytes::from(prost::Message::encode_to_vec(&answer))
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
        let (metadata, extensions, message) = request.into_parts();
        // Bad input is the caller's bug: INVALID_ARGUMENT naming field and bound.
        // Store failures never become a gRPC error here: the rule's failure
        // policy answers (FAIL_OPEN / FAIL_CLOSED) so the gateway always gets
        // a decision it can act on.
        let refuse = |e: ValidationError| {
            self.engine.refused(Api::Check, e.reason);
            Status::invalid_argument(e.to_string())
        };
        let reservation = settled(&message, report).map_err(refuse)?;
        let mut checked = validate(&message, call_traceparent(&metadata)).map_err(refuse)?;
        if unknown_priority(&message) {
            self.engine.adjusted(Api::Check, "unknown_priority");
        }
        if report {
            if message.peek {
                return Err(refuse(ValidationError {
                    field: "peek",
                    message: "must be false on Report (a report always counts)".to_owned(),
                    reason: "peek_report",
                }));
            }
            checked.count = Count::Always;
            checked.outcome = reported(&message).map_err(refuse)?;
            checked.reservation = reservation.as_deref();
            if let Some(reported) = &mut checked.outcome
                && !may_report(&extensions)
            {
                // Answered as any report, counted nowhere.
                self.engine.adjusted(Api::Check, "outcome_not_allowed");
                reported.counted = false;
            }
        }
        checked.share = share_of(&extensions);
        checked.may_report = may_report(&extensions);
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
}

/// Decides one item of a batch or a stream as `Check` would, without a span
/// of its own (one per item would cost more than the decision); an invalid
/// item is answered with why, not with a call error. `None`: the item
/// carried no request (refused as an empty one is).
///
/// Borrows everything: a stream allocates a future per item in flight, so
/// it holds only what the decision needs (a future over 1 KiB leaves the
/// allocator's fast path).
async fn decide_item(
    engine: &Engine,
    id: u64,
    request: Option<&pb::RateLimitRequest>,
    traceparent: Option<&str>,
    share: Option<&CallerCalls>,
) -> pb::CheckResult {
    let request = request.unwrap_or_else(|| &NO_REQUEST);
    let checked = match settled(request, false).and_then(|_| validate(request, traceparent)) {
        Ok(checked) => {
            if unknown_priority(request) {
                engine.adjusted(Api::Check, "unknown_priority");
            }
            CheckRequest { share, ..checked }
        }
        Err(e) => {
            engine.refused(Api::Check, e.reason);
            return pb::CheckResult { id, response: None, invalid_argument: e.to_string() };
        }
    };
    let decision = engine.check(&checked).await;
    pb::CheckResult { id, response: Some(response(decision)), invalid_argument: String::new() }
}

/// The reservation a `Report` settles, read from its id; `reserve` on a
/// `Report` and `reservation` on a `Check` are refused by name.
/// Boxed: every call's future holds it, and most hold none.
fn settled(
    message: &pb::RateLimitRequest,
    report: bool,
) -> Result<Option<Box<Reservation>>, ValidationError> {
    let wrong = |field, message: String| ValidationError { field, message, reason: "reservation" };
    match (report, message.reserve, message.reservation.is_empty()) {
        (true, true, _) => Err(wrong("reserve", "must be false on Report (a Check reserves)".to_owned())),
        (false, _, false) => {
            Err(wrong("reservation", "must be empty on Check (a Report settles)".to_owned()))
        }
        (_, _, true) => Ok(None),
        (true, false, false) => Reservation::parse(&message.reservation)
            .map(|r| Some(Box::new(r)))
            .map_err(|e| wrong("reservation", e)),
    }
}

/// The connection's shares of the store's in-flight work, which the
/// server puts in every request's extensions.
pub(super) fn share_of(extensions: &tonic::Extensions) -> Option<&CallerCalls> {
    extensions.get::<Caller>().map(|caller| &*caller.store_calls)
}

/// Whether the connection may report outcomes (`grpc.reporting_peers`);
/// without connect info (no server), it may.
pub(super) fn may_report(extensions: &tonic::Extensions) -> bool {
    extensions.get::<Caller>().is_none_or(|caller| caller.may_report)
}

/// What an item without a request is decided as.
static NO_REQUEST: LazyLock<pb::RateLimitRequest> = LazyLock::new(pb::RateLimitRequest::default);

/// What the items of one `CheckStream` share, made once per stream: each
/// item's future holds a reference to it alone, counted on the stream's
/// own count rather than on the engine's (which every core shares).
#[derive(Debug)]
struct StreamContext {
    engine: Engine,
    /// The call's trace context, read once for all its items.
    traceparent: Option<Box<str>>,
    /// The connection's shares of the store's in-flight work.
    share: Option<Arc<CallerCalls>>,
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
        let (metadata, extensions, batch) = request.into_parts();
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
        let (traceparent, share) = (call_traceparent(&metadata), share_of(&extensions));
        let decisions = batch
            .items
            .iter()
            .map(|item| decide_item(&self.engine, item.id, item.request.as_ref(), traceparent, share));
        let results = futures_util::future::join_all(decisions).instrument(span).await;
        Ok(Response::new(pb::CheckBatchResponse { results }))
    }

    async fn check_stream(
        &self,
        request: Request<Streaming<pb::CheckItem>>,
    ) -> Result<Response<Self::CheckStreamStream>, Status> {
        let (metadata, extensions, items) = request.into_parts();
        let context = Arc::new(StreamContext {
            engine: self.engine.clone(),
            traceparent: call_traceparent(&metadata).map(Box::from),
            share: extensions.get::<Caller>().map(|caller| Arc::clone(&caller.store_calls)),
        });
        // Up to STREAM_IN_FLIGHT items decided at a time, each answered as
        // soon as it is; a broken input stream ends the output with its
        // status. The item is taken apart here, so its future holds the
        // request alone.
        let items = items.map(move |item| match item {
            Ok(pb::CheckItem { id, request }) => {
                let context = Arc::clone(&context);
                Either::Left(async move {
                    let StreamContext { engine, traceparent, share } = &*context;
                    let share = share.as_deref();
                    Ok(decide_item(engine, id, request.as_ref(), traceparent.as_deref(), share).await)
                })
            }
            Err(status) => Either::Right(ready(Err(status))),
        });
        Ok(Response::new(Box::pin(eager_unordered(items, STREAM_IN_FLIGHT))))
    }
}
