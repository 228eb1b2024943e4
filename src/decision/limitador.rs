//! limitador's decision: the limits of the request's namespace (its
//! domain) whose CEL conditions hold and whose variables resolve
//! ([`Limits::applying`]), each one counter, decided together as one
//! `ShouldRateLimit` is (all or nothing, shedding, overload, the failure
//! policy with its dead-letter record, metrics), each applied limit
//! standing as a descriptor of its own: `limitador` = the limit's identity,
//! then each variable = its value. Those entries are the counter's key, so
//! the same limit and values share one counter on every instance.

use std::sync::Arc;

use super::{
    Api, Engine, Reason,
    envoy::{self, Descriptor, OwnedDescriptor, RlsDecision, RlsRequest},
};
use crate::{
    rules::{envoy::EnvoyMatch, limitador::Limits},
    shed::Level,
};

/// The entry key naming the limit in an applied limit's descriptor.
pub const LIMIT_ENTRY: &str = "limitador";

/// What a limitador call asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `ShouldRateLimit`: admitted and counted, all or nothing.
    Admit,
    /// `CheckRateLimit`: whether the request's hits fit every limit;
    /// nothing counted.
    Check,
    /// `Report`: the hits counted on every limit, whatever is left.
    Report,
}

/// Decides `request` (its domain is the namespace) under `limits`; see
/// [`Engine::limitador`].
pub(super) async fn decide<D: Descriptor>(
    engine: &Engine,
    limits: &Limits,
    request: &RlsRequest<'_, D>,
    call: Call,
    hits: Option<u64>,
) -> RlsDecision {
    let started = std::time::Instant::now();
    let entries: Vec<Vec<(&str, &str)>> = request.descriptors.iter().map(|d| d.entries().collect()).collect();
    let applied = match limits.applying(request.domain, &entries) {
        Ok(applied) => applied,
        Err(error) => {
            tracing::debug!(namespace = request.domain, %error, "limitador limits not evaluable: refused");
            engine.refused(Api::Envoy, "limit_not_evaluable");
            return unevaluable(engine, request);
        }
    };
    let mut descriptors = Vec::with_capacity(applied.len());
    let mut matches = Vec::with_capacity(applied.len());
    for one in &applied {
        let mut entries = Vec::with_capacity(1 + one.values.len());
        entries.push((LIMIT_ENTRY.to_owned(), one.limit.identity.to_string()));
        entries.extend(one.limit.variables().map(str::to_owned).zip(one.values.iter().cloned()));
        descriptors.push(OwnedDescriptor { entries, limit: None, hits_addend: hits });
        let limit = match call {
            Call::Admit => &one.limit.envoy,
            Call::Check => &one.limit.envoy_peek,
            Call::Report => &one.limit.envoy_report,
        };
        matches.push(Some(EnvoyMatch { limit: Arc::clone(limit), shared: Vec::new(), stat_key: None }));
    }
    let counted = RlsRequest {
        domain: request.domain,
        descriptors: &descriptors,
        hits_addend: request.hits_addend,
        trace_id: request.trace_id,
        share: request.share,
        may_report: false,
    };
    // Priority from the request's own entries (`envoy.priority_key`).
    let priority = envoy::priority(engine, request);
    let decision = engine.run(envoy::Rls::with_limits(&counted, matches, priority)).await;
    engine.envoy_decided(&decision, started);
    decision
}

/// The answer to a request whose limits could not be evaluated: over the
/// limit, nothing counted.
fn unevaluable<D: Descriptor>(engine: &Engine, request: &RlsRequest<'_, D>) -> RlsDecision {
    RlsDecision {
        over_limit: true,
        reason: Reason::OverLimit,
        statuses: Vec::new(),
        tightest: None,
        retry_after_ms: 0,
        priority: envoy::priority(engine, request),
        level: Level::Normal,
        shadow_shed: false,
        failure: None,
        store_error: None,
    }
}
