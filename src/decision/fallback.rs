//! The failure policy: what answers when the shared store could not decide
//! (deadline missed, Redis error, breaker open, memory store full), for
//! both APIs, in one place.
//!
//! - `local` (the default): the local limiter decides at this instance's
//!   share of the limit, counts the admission locally and owes it to the
//!   store ([`crate::limiter::local`]); at its own bound it denies.
//! - `open`: allowed, nothing counted. `closed`: denied (Envoy: the API
//!   answers UNAVAILABLE).
//!
//! Whichever answers, the decision carries the failure kind
//! (`store_error`: the native answer's field, Envoy's `x-ratelimit-error`
//! header) and exactly one [`FailedDecision`] goes to the dead-letter sink.

use std::{collections::HashMap, sync::Arc};

use super::{
    Api, CheckRequest, Decision, Engine, FAIL_CLOSED_RETRY_MS, FailedDecision, LimitHits, Reason,
    RlsDecision, RlsRequest, RuleInfo,
    check::{Failed, from_verdict},
    clamp_i64,
    envoy::{DescriptorDecision, EnvoyFailure, Plan, item_hits, stat_key},
};
use crate::{
    limiter::{ManyItem, StoreError},
    rules::{FailurePolicy, Mode, Rule},
};

impl Engine {
    /// A `Check` the store could not decide, answered by `rule`'s failure
    /// policy, flagged and dead-lettered.
    pub(super) fn check_failed(
        &self,
        request: &CheckRequest<'_>,
        rule: &Rule,
        failed: Failed<'_>,
    ) -> Decision {
        let Failed { user, priority, level, error } = failed;
        let (weight, info) = (u64::from(request.weight), Some(RuleInfo::of(rule)));
        let local = match rule.failure_policy {
            FailurePolicy::Local if rule.also.is_empty() => {
                Some(self.inner.local.decide(user, rule.counter(), weight, request.count).map(|v| (v, 0)))
            }
            // Every limit locally too: an outage never lifts the daily one.
            FailurePolicy::Local => Some(
                self.inner.local.decide_many(user, &rule.items(weight, request.count)).map(|o| o.binding()),
            ),
            FailurePolicy::Open | FailurePolicy::Closed => None,
        };
        let decision = match (rule.failure_policy, local) {
            (_, Some(Ok((verdict, bound)))) => {
                let info = Some(RuleInfo::of_limit(rule, bound));
                let decided = from_verdict(&verdict, rule.mode == Mode::Shadow, info, priority);
                let reason = if decided.reason == Reason::OverLimit {
                    Reason::LocalOverLimit
                } else {
                    Reason::LocalOk
                };
                Decision { reason, ..decided }
            }
            (FailurePolicy::Open, _) => Decision::allowed(Reason::FailOpen, info, priority, level),
            // Closed, or local at its bound: denied. Nothing is known about
            // the counter, so clients back off for a second (or one window,
            // if shorter) rather than spin against an outage.
            _ => Decision {
                allowed: false,
                retry_after_ms: clamp_i64(rule.window.window_ms.min(FAIL_CLOSED_RETRY_MS)),
                ..Decision::allowed(Reason::FailClosed, info, priority, level)
            },
        };
        // The record names what was counted: the digest of an over-long id.
        self.inner.failures.record(&FailedDecision {
            user_id: user,
            ..FailedDecision::of_check(request, rule, priority, &error, decision.reason)
        });
        Decision { level, store_error: Some(error.kind), ..decision }
    }

    /// The answer `envoy.failure_mode` (or the domain's own) gives for
    /// `domain`.
    fn envoy_failure(&self, domain: &str) -> EnvoyFailure {
        let policy = &self.inner.envoy_policy;
        policy.domain_failure.get(domain).copied().unwrap_or(policy.failure)
    }

    /// A `ShouldRateLimit` the store could not decide: answered by the
    /// domain's failure mode, flagged, and one dead-letter record for the
    /// request.
    pub(super) fn rls_failed<D>(
        &self,
        request: &RlsRequest<'_, D>,
        plans: &[Plan],
        items: &[ManyItem],
        error: StoreError,
        base: RlsDecision,
    ) -> RlsDecision {
        self.inner.stats.envoy_failed();
        let mut decision = match self.envoy_failure(request.domain) {
            EnvoyFailure::Local => match self.inner.local.decide_many(request.domain, items) {
                Ok(outcome) => {
                    let decided = self.rls_answer(plans, items, Some(&outcome), base, true);
                    let reason = if decided.over_limit { Reason::LocalOverLimit } else { Reason::LocalOk };
                    RlsDecision { reason, ..decided }
                }
                // At its bound: every counted descriptor over, never "allow".
                Err(_) => self.rls_unanswered(plans, items, base, Reason::FailClosed, true),
            },
            EnvoyFailure::Open => self.rls_unanswered(plans, items, base, Reason::FailOpen, false),
            // The API answers UNAVAILABLE: no descriptor is decided.
            EnvoyFailure::Unavailable => RlsDecision {
                failure: Some(error.clone()),
                ..self.rls_unanswered(plans, items, base, Reason::FailClosed, false)
            },
        };
        self.record_rls_failure(request, plans, items, &error, &decision);
        decision.store_error = Some(error.kind);
        decision
    }

    /// A failed request answered without counting under `reason`: every
    /// counted descriptor OVER_LIMIT when `over`, else every descriptor OK.
    fn rls_unanswered(
        &self,
        plans: &[Plan],
        items: &[ManyItem],
        base: RlsDecision,
        reason: Reason,
        over: bool,
    ) -> RlsDecision {
        for plan in plans {
            if let Plan::Limited(limit, index, key) = plan {
                if self.inner.envoy_policy.upstream_metrics {
                    // Upstream counts the hits before it asks Redis.
                    let total = item_hits(&items[*index]);
                    let over = if over { total } else { 0 };
                    self.inner
                        .stats
                        .limit_hits(stat_key(limit, key), LimitHits { total, over, ..LimitHits::default() });
                }
                self.inner.stats.decision(
                    Api::Envoy,
                    Some(&limit.full_key),
                    reason.as_str(),
                    reason == Reason::FailOpen,
                );
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
    fn record_rls_failure<D>(
        &self,
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
        self.inner.failures.record(&FailedDecision {
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
}
