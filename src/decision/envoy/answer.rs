//! The answer to a `ShouldRateLimit`: each descriptor's status, the overall
//! code (shadow descriptors never deny; quota descriptors deny only when all
//! of them are over), and [`count`], the one place a descriptor's decision
//! is counted.

use std::sync::Arc;

use super::{
    RlsRequest,
    plan::{Plan, item_hits, stat_key},
    request::{Descriptor, Reporter},
};
use crate::{
    decision::{Api, Engine, LimitHits, REPORT_LABEL, Reason},
    limiter::{Count, FailureKind, ManyItem, ManyOutcome, StoreError, Verdict, binding},
    rules::envoy::EnvoyLimit,
    shed::{Level, Priority},
};

/// The answer to one `ShouldRateLimit` request.
#[derive(Debug, Clone)]
pub struct RlsDecision {
    /// The overall code is OVER_LIMIT.
    pub over_limit: bool,
    /// Why: `Ok`, `OverLimit`, `Shed`, `NoRule` (nothing was counted),
    /// `FailOpen`, or `FailClosed` (the API answers UNAVAILABLE).
    pub reason: Reason,
    /// One per descriptor, in request order.
    pub statuses: Vec<DescriptorDecision>,
    /// The descriptor closest to its limit, whose limit the rate-limit
    /// headers describe.
    pub tightest: Option<usize>,
    /// Shed: the jittered ms after which to retry; 0 otherwise.
    pub retry_after_ms: u64,
    /// The priority the request was decided with.
    pub priority: Priority,
    /// The utilization level it was decided at.
    pub level: Level,
    /// Shedding would have refused it, but `shed.mode` is shadow.
    pub shadow_shed: bool,
    /// Answer UNAVAILABLE with what the store said
    /// ([`EnvoyFailure::Unavailable`]).
    pub failure: Option<StoreError>,
    /// Why the shared store did not decide (the failure policy did);
    /// `None` when it did.
    pub store_error: Option<FailureKind>,
    /// A request that reserves (`ratelimitd.reserve`), admitted: the id a
    /// stream-done `ratelimitd.settle` settles with.
    pub reservation: Option<Box<str>>,
}

impl RlsDecision {
    /// The limit that bound the request: the tightest descriptor's, else
    /// the first counted one's (capture and replay name a request by it).
    pub fn bound_limit(&self) -> Option<&Arc<EnvoyLimit>> {
        let statuses = &self.statuses;
        self.tightest
            .and_then(|i| statuses.get(i))
            .and_then(|s| s.limit.as_ref())
            .or_else(|| statuses.iter().find_map(|s| s.limit.as_ref()))
    }
}

/// The answer for one descriptor.
#[derive(Debug, Clone, Default)]
pub struct DescriptorDecision {
    /// This descriptor's code is OVER_LIMIT.
    pub over_limit: bool,
    /// The limit that was applied (`None`: unmatched, replaced, unlimited,
    /// or not counted because the store failed), with its `also` limits.
    pub limit: Option<Arc<EnvoyLimit>>,
    /// Which of `limit`'s limits binds ([`EnvoyLimit::limit_at`]: 0 itself).
    pub bound: usize,
    /// `unlimited: true` matched.
    pub unlimited: bool,
    /// Hits left.
    pub remaining: u32,
    /// Over: ms until the same hit would pass; under: until the quota is whole.
    pub until_reset_ms: u64,
}

/// Counts one descriptor's decision: the one place an Envoy descriptor
/// reaches [`crate::decision::Stats`]. `rule` is the limit's configured
/// key, `label` the reason; `hits`, its counts in upstream's terms under
/// their metric key, is asked only with `envoy.upstream_metrics` on.
pub(super) fn count<'k>(
    engine: &Engine,
    rule: Option<&Arc<str>>,
    label: &'static str,
    allowed: bool,
    hits: impl FnOnce() -> Option<(&'k str, LimitHits)>,
) {
    let stats = &engine.inner.stats;
    if engine.inner.envoy_policy.upstream_metrics
        && let Some((key, hits)) = hits()
    {
        stats.limit_hits(key, hits);
    }
    stats.decision(Api::Envoy, rule, label, allowed);
}

/// Statuses and the overall code from the store's verdicts (`None`:
/// nothing was counted); `local`: the local limiter's verdicts.
pub(super) fn answer(
    engine: &Engine,
    plans: &[Plan],
    items: &[ManyItem],
    outcome: Option<&ManyOutcome>,
    mut decision: RlsDecision,
    local: bool,
) -> RlsDecision {
    let policy = &engine.inner.envoy_policy;
    let (mut enforced_over, mut quota_total, mut quota_over, mut counted) = (false, 0, 0, false);
    let mut tightest: Option<(u32, usize)> = None;
    for plan in plans {
        let status = match plan {
            Plan::NoLimit => {
                count(engine, None, "NO_RULE", true, || None);
                DescriptorDecision::default()
            }
            Plan::Unlimited(limit, key, hits) => {
                // Upstream counts an unlimited descriptor's hits, nothing else.
                let hits = LimitHits { total: *hits, ..LimitHits::default() };
                count(engine, None, "UNLIMITED", true, || Some((stat_key(limit, key), hits)));
                DescriptorDecision { unlimited: true, remaining: u32::MAX, ..DescriptorDecision::default() }
            }
            Plan::Limited(limit, index, key) => {
                counted = true;
                let verdicts = &outcome.expect("limited descriptors were decided").verdicts;
                let mine = &verdicts[*index..=*index + limit.also.len()];
                let (status, over) = status(engine, limit, key, &items[*index], mine, local);
                if policy.quota(limit) {
                    quota_total += 1;
                    quota_over += usize::from(over);
                } else if status.over_limit {
                    enforced_over = true;
                }
                let rank = if status.over_limit { 0 } else { status.remaining };
                if tightest.is_none_or(|(r, _)| rank < r) {
                    tightest = Some((rank, decision.statuses.len()));
                }
                status
            }
        };
        decision.statuses.push(status);
    }
    decision.over_limit = enforced_over || (quota_total > 0 && quota_total == quota_over);
    decision.reason = match (decision.over_limit, counted) {
        (true, _) => Reason::OverLimit,
        (false, true) => Reason::Ok,
        (false, false) => Reason::NoRule,
    };
    decision.tightest = tightest.map(|(_, index)| index);
    decision
}

/// One counted descriptor's status from the `verdicts` of its limits
/// (the one that binds), counted (`local`: the local limiter's verdicts);
/// and whether it was over.
fn status(
    engine: &Engine,
    limit: &Arc<EnvoyLimit>,
    key: &Option<Box<str>>,
    item: &ManyItem,
    verdicts: &[Verdict],
    local: bool,
) -> (DescriptorDecision, bool) {
    let policy = &engine.inner.envoy_policy;
    let (verdict, bound) = binding(verdicts);
    let shadow = policy.shadow(limit);
    let over = !verdict.admitted;
    let denied = over && !shadow;
    let report = item.count == Count::Always;
    // A global limit's hits, for the region's next report (a peek counts nothing).
    if limit.global
        && item.count != Count::Never
        && let Some(grants) = engine.inner.grants.as_deref()
    {
        grants.record(&limit.full_key, &item.key, item.weight, verdict.admitted);
    }
    let reason = match (report, denied, local) {
        (true, _, _) => REPORT_LABEL,
        (false, true, false) => "OVER_LIMIT",
        (false, false, false) => "OK",
        (false, true, true) => "LOCAL_OVER_LIMIT",
        (false, false, true) => "LOCAL_OK",
    };
    count(engine, Some(&limit.full_key), reason, report || !denied, || {
        let hits = item_hits(item);
        let counted =
            LimitHits::of(u64::from(limit.per_unit()), hits, &verdict, shadow, policy.near_limit_ratio);
        Some((stat_key(limit, key), counted))
    });
    let status = DescriptorDecision {
        over_limit: denied,
        limit: Some(Arc::clone(limit)),
        unlimited: false,
        remaining: if over { 0 } else { u32::try_from(verdict.remaining).unwrap_or(u32::MAX) },
        // Over: exactly when the same hit would pass. Under: when the quota is whole again.
        until_reset_ms: if over { verdict.retry_after_ms.unwrap_or(0) } else { verdict.reset_after_ms },
        bound,
    };
    (status, over)
}

/// The answer to a request refused before any counter (shed, or dropped
/// by the overload layer): every descriptor OVER_LIMIT (with its limit,
/// when one matched), nothing counted.
pub(super) fn refused(
    engine: &Engine,
    limits: impl Iterator<Item = Option<(Arc<EnvoyLimit>, u64)>>,
    reason: Reason,
    priority: Priority,
    level: Level,
    retry_after_ms: u64,
) -> RlsDecision {
    let statuses = limits
        .map(|found| {
            let (limit, hits) = found.unzip();
            count(engine, limit.as_ref().map(|l| &l.full_key), reason.as_str(), false, || {
                // Refused before any counter: the hits, all over the limit
                // (an unlimited descriptor's only counted), under its
                // configured key.
                let (limit, total) = (limit.as_ref()?, hits?);
                let over = if limit.unlimited { 0 } else { total };
                Some((&*limit.full_key, LimitHits { total, over, ..LimitHits::default() }))
            });
            DescriptorDecision {
                over_limit: true,
                unlimited: limit.as_ref().is_some_and(|l| l.unlimited),
                limit: limit.filter(|l| !l.unlimited),
                remaining: 0,
                until_reset_ms: retry_after_ms,
                bound: 0,
            }
        })
        .collect();
    RlsDecision {
        over_limit: true,
        reason,
        statuses,
        tightest: None,
        retry_after_ms,
        priority,
        level,
        shadow_shed: false,
        failure: None,
        store_error: None,
        reservation: None,
    }
}

/// Credits each descriptor of an admitted request whose adaptive limit
/// counted it with its hits (a peek's none), for its outcome reports.
pub(in crate::decision) fn admit_reporters<D: Descriptor>(
    request: &RlsRequest<'_, D>,
    decision: &RlsDecision,
) {
    for (d, status) in request.descriptors.iter().zip(&decision.statuses) {
        let Some(adaptive) = status.limit.as_ref().and_then(|limit| limit.adaptive.as_deref()) else {
            continue;
        };
        let hits = d.hits_addend().unwrap_or(u64::from(request.hits_addend));
        if !status.over_limit && hits > 0 {
            adaptive.admit(Reporter(request.domain, d.entries()), hits);
        }
    }
}
