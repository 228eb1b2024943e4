//! `ratelimit.v1.RateLimiter/Check` and `/Report`.

use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::{
    convert::{ValidationError, response, validate},
    pb,
};
use crate::{
    decision::{Api, Engine},
    limiter::Count,
    telemetry::traces::continue_trace,
};

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
        let mut checked = validate(&message, &metadata).map_err(refuse)?;
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
}

#[tonic::async_trait]
impl pb::rate_limiter_server::RateLimiter for RateLimiterService {
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
}
