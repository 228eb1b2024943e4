//! Kuadrant's `kuadrant.service.ratelimit.v1.RateLimitService`, served
//! beside `ShouldRateLimit` from limitador's limits (the wasm shim's
//! calls): `CheckRateLimit` before a request, nothing counted, and
//! `Report` of its usage after the response, counted whatever is left.
//! Validation, conversion and the engine are `ShouldRateLimit`'s
//! ([`EnvoyService`]).

use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::envoy::{EnvoyService, convert};
use super::envoy_pb::{
    kuadrant::service::ratelimit::v1::rate_limit_service_server::{
        RateLimitService as KuadrantRateLimitService,
        RateLimitServiceServer as KuadrantRateLimitServiceServer,
    },
    rls::{RateLimitRequest, RateLimitResponse, rate_limit_response::Code},
};
use crate::{decision::limitador::Call, telemetry::traces::continue_trace};

/// Kuadrant's rate limit service, served beside `ShouldRateLimit` from
/// limitador's limits: the check before a request (nothing counted) and the
/// report of its usage after the response (counted whatever is left).
#[tonic::async_trait]
impl KuadrantRateLimitService for EnvoyService {
    async fn check_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.kuadrant(request, Call::Check).await
    }

    async fn report(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        self.kuadrant(request, Call::Report).await
    }
}

impl EnvoyService {
    /// The Kuadrant service's server (with limitador's limits).
    pub fn into_kuadrant_server(self) -> KuadrantRateLimitServiceServer<Self> {
        KuadrantRateLimitServiceServer::new(self)
    }

    /// `CheckRateLimit` (`call` Check) or `Report`: OK or OVER_LIMIT (a
    /// report is always OK), no statuses or headers, as limitador answers.
    async fn kuadrant(
        &self,
        request: Request<RateLimitRequest>,
        call: Call,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let Some(limits) = &self.limitador else {
            return Err(Status::unimplemented(
                "kuadrant.service.ratelimit.v1 is served with limitador's limits",
            ));
        };
        let (metadata, extensions, request) = request.into_parts();
        self.admissible(&request)?;
        let span = tracing::info_span!(
            "ratelimit.kuadrant",
            otel.kind = "server",
            call = ?call,
            domain = %request.domain,
            descriptors = request.descriptors.len(),
            reason = tracing::field::Empty,
            overall_code = tracing::field::Empty,
        );
        continue_trace(&span, &metadata);
        let rls = convert(&request, (&metadata, &extensions), false);
        // limitador checks one hit, whatever the request says.
        let hits = (call == Call::Check).then_some(1);
        let decision = self.engine.limitador(&limits.load(), &rls, call, hits).instrument(span).await;
        self.engine.limitador_counted(
            &request.domain,
            call,
            &decision,
            u64::from(request.hits_addend.max(1)),
        );
        if let Some(failure) = &decision.failure {
            return Err(Status::unavailable(format!("counter store unavailable: {failure}")));
        }
        let over = call == Call::Check && decision.over_limit;
        let code = if over { Code::OverLimit } else { Code::Ok };
        Ok(Response::new(RateLimitResponse { overall_code: code as i32, ..Default::default() }))
    }
}
