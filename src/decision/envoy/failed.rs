//! A `ShouldRateLimit` the store could not decide: answered by the domain's
//! failure mode (`envoy.failure_mode`: the local limiter, open, or
//! UNAVAILABLE), flagged, with one dead-letter record for the request.

use std::{collections::HashMap, sync::Arc};

use super::{
    EnvoyFailure, RlsRequest,
    answer::{DescriptorDecision, RlsDecision, answer, count},
    plan::{Plan, item_hits, stat_key},
};
use crate::{
    decision::{Engine, FAIL_CLOSED_RETRY_MS, FailedDecision, LimitHits, Reason},
    limiter::{ManyItem, StoreError},
};

/// The failure mode's answer to a request whose store call failed with
/// `error`, and its dead-letter record.
pub(super) fn failed<D>(
    engine: &Engine,
    request: &RlsRequest<'_, D>,
    plans: &[Plan],
    items: &[ManyItem],
    error: StoreError,
    base: RlsDecision,
) -> RlsDecision {
    let mut decision = match engine.inner.envoy_policy.failure_for(request.domain) {
        EnvoyFailure::Local => match engine.inner.local.decide_many(request.domain, items) {
            Ok(outcome) => {
                let decided = answer(engine, plans, items, Some(&outcome), base, true);
                let reason = if decided.over_limit { Reason::LocalOverLimit } else { Reason::LocalOk };
                RlsDecision { reason, ..decided }
            }
            // At its bound: every counted descriptor over, never "allow".
            Err(_) => unanswered(engine, plans, items, base, Reason::FailClosed, true),
        },
        EnvoyFailure::Open => unanswered(engine, plans, items, base, Reason::FailOpen, false),
        // The API answers UNAVAILABLE: no descriptor is decided.
        EnvoyFailure::Unavailable => RlsDecision {
            failure: Some(error.clone()),
            ..unanswered(engine, plans, items, base, Reason::FailClosed, false)
        },
    };
    record(engine, request, plans, items, &error, &decision);
    decision.store_error = Some(error.kind);
    decision
}

/// A failed request answered without counting under `reason`: every
/// counted descriptor OVER_LIMIT when `over`, else every descriptor OK.
fn unanswered(
    engine: &Engine,
    plans: &[Plan],
    items: &[ManyItem],
    base: RlsDecision,
    reason: Reason,
    over: bool,
) -> RlsDecision {
    for plan in plans {
        if let Plan::Limited(limit, index, key) = plan {
            count(engine, Some(&limit.full_key), reason.as_str(), reason == Reason::FailOpen, || {
                // Upstream counts the hits before it asks Redis.
                let total = item_hits(&items[*index]);
                let over = if over { total } else { 0 };
                Some((stat_key(limit, key), LimitHits { total, over, ..LimitHits::default() }))
            });
        }
    }
    let statuses = plans
        .iter()
        .map(|plan| match plan {
            Plan::Limited(limit, ..) if over => DescriptorDecision {
                over_limit: true,
                limit: Some(Arc::clone(limit)),
                until_reset_ms: FAIL_CLOSED_RETRY_MS,
                ..DescriptorDecision::default()
            },
            _ => DescriptorDecision::default(),
        })
        .collect();
    RlsDecision { over_limit: over, reason, statuses, ..base }
}

/// One dead-letter record for a failed `ShouldRateLimit`, naming its
/// first counted descriptor.
fn record<D>(
    engine: &Engine,
    request: &RlsRequest<'_, D>,
    plans: &[Plan],
    items: &[ManyItem],
    error: &StoreError,
    decision: &RlsDecision,
) {
    let Some((limit, index)) = plans.iter().find_map(|p| match p {
        Plan::Limited(l, i, _) => Some((l, *i)),
        _ => None,
    }) else {
        return;
    };
    let headers = HashMap::new();
    let resource = format!("envoy:{}", request.domain);
    engine.inner.failures.record(&FailedDecision {
        user_id: &items[index].key,
        resource_path: &resource,
        client_type: None,
        weight: u32::try_from(items[index].weight).unwrap_or(u32::MAX),
        count: items[index].count,
        headers: &headers,
        trace_id: request.trace_id,
        rule_id: &limit.full_key,
        priority: decision.priority,
        error,
        answer: decision.reason,
    });
}
