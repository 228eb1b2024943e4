//! The Envoy decision (`ShouldRateLimit`): envoyproxy/ratelimit's semantics
//! over the engine's pipeline.
//!
//! Per request: each descriptor's limit (a request override, else the
//! configuration, `share_threshold` patterns included), `replaces`, the
//! request's priority and shedding (no store call when shed), then one
//! all-or-nothing store call over every counted descriptor, the failure
//! policy (`envoy.failure_mode`) with one dead-letter record, and the
//! overall code (shadow descriptors never deny; quota descriptors deny only
//! when all of them are over).
//!
//! Two deliberate differences from upstream: counting is a sliding window by
//! default (`envoy.algorithm: fixed_window` restores upstream's), and a
//! request that one enforced descriptor denies consumes nothing from the
//! others.
//!
//! The files, in the order a request meets them: `request` (what the API
//! hands over), `policy` (the settings), `plan` (each descriptor's limit and
//! counters), `reserve` (reservations and their settlement), `counter`
//! (counter keys), `answer` (statuses, the overall code and the one place a
//! descriptor is counted), `failed` (the failure mode).

mod answer;
mod counter;
mod failed;
mod plan;
mod policy;
mod request;
mod reserve;

use std::sync::Arc;

pub(super) use answer::admit_reporters;
pub use answer::{DescriptorDecision, RlsDecision};
pub(super) use counter::parse_counter_key;
use plan::{Plan, item_hits};
pub use policy::{EnvoyFailure, EnvoyPolicy};
use request::hits_of;
pub use request::{Descriptor, EnvoyCall, LimitOverride, OwnedDescriptor, RlsDescriptor, RlsRequest};

use super::{Engine, Reason, pipeline::Subject};
use crate::{
    limiter::{Count, ManyItem, ManyOutcome, Shares, StoreError},
    rules::envoy::{EnvoyConfig, EnvoyMatch, Role},
    shed::{Level, Priority},
};

/// The metric label and dead-letter rule id of a request-supplied limit: a
/// fixed value, so no request can mint a metric series.
pub(super) const OVERRIDE_LABEL: &str = "override";

/// The request's priority: a descriptor entry named `envoy.priority_key`
/// with a priority as its value, else the domain's default, else
/// `shed.default_priority`. An unknown value is ignored; with
/// `shed.trust_request_priority` off the entry may only lower the domain's
/// (or the default) priority.
pub(in crate::decision) fn priority<D: Descriptor>(engine: &Engine, request: &RlsRequest<'_, D>) -> Priority {
    let policy = &engine.inner.envoy_policy;
    let stated = (!policy.priority_key.is_empty())
        .then(|| {
            request
                .descriptors
                .iter()
                .flat_map(Descriptor::entries)
                .filter(|(key, _)| *key == policy.priority_key)
                .find_map(|(_, value)| Priority::parse(value))
        })
        .flatten();
    let base = policy.domain_priority.get(request.domain).copied().unwrap_or(engine.inner.default_priority);
    engine.effective_priority(stated, base)
}

/// Hands a sampled request and its decision to the capture sink.
pub(super) fn capture<D: Descriptor>(
    engine: &Engine,
    config: Option<&EnvoyConfig>,
    request: &RlsRequest<'_, D>,
    decision: &RlsDecision,
) {
    let version = || config.map(|c| c.version().to_owned()).unwrap_or_default();
    capture_as(engine, request, request.hits_addend, Count::IfFits, decision, version);
}

/// [`capture`] of a request whose hits are `hits_addend`, counted as
/// `count`, decided under the rules `version` names (asked only when the
/// request is captured).
pub(super) fn capture_as<D: Descriptor>(
    engine: &Engine,
    request: &RlsRequest<'_, D>,
    hits_addend: u32,
    count: Count,
    decision: &RlsDecision,
    version: impl FnOnce() -> String,
) {
    let Some(capture) = &engine.inner.capture else { return };
    let mut first = request.descriptors.first().into_iter().flat_map(Descriptor::entries);
    if !capture.wants_envoy(request.domain, &mut first) {
        return;
    }
    let descriptors: Vec<OwnedDescriptor> = request.descriptors.iter().map(OwnedDescriptor::of).collect();
    let call = EnvoyCall { domain: request.domain.to_owned(), descriptors, hits_addend };
    capture.record_envoy(call, count, decision, &version());
}

/// A `ShouldRateLimit` in the pipeline: each descriptor's limit, then
/// (settled) how each is decided and the counters of one all-or-nothing
/// store call.
pub(super) struct Rls<'r, 'a, D> {
    request: &'r RlsRequest<'a, D>,
    /// Each descriptor's limit, until settled.
    limits: Vec<Option<EnvoyMatch>>,
    /// Settled: each descriptor's plan, and the store call's counters.
    settled: Option<(Vec<Plan>, Vec<ManyItem>)>,
    /// What each counter's descriptor is, when one reserves or settles
    /// (empty otherwise: no allocation).
    roles: Vec<Role>,
    /// The counters settle a reservation: one job, its claim last.
    settles: bool,
    priority: Priority,
    level: Level,
    shadow_shed: bool,
}

impl<'r, 'a, D: Descriptor> Rls<'r, 'a, D> {
    /// `request` before the pipeline: its limits in `config` and its priority.
    pub(super) fn new(engine: &Engine, config: Option<&EnvoyConfig>, request: &'r RlsRequest<'a, D>) -> Self {
        Rls::with_limits(request, plan::limits(engine, config, request), priority(engine, request))
    }

    /// `request` whose descriptors' limits are already known (one each),
    /// as another format's evaluation found them (limitador's), decided at
    /// `priority` (the original request's).
    pub(super) fn with_limits(
        request: &'r RlsRequest<'a, D>,
        limits: Vec<Option<EnvoyMatch>>,
        priority: Priority,
    ) -> Self {
        Rls {
            request,
            limits,
            settled: None,
            roles: Vec::new(),
            settles: false,
            priority,
            level: Level::Normal,
            shadow_shed: false,
        }
    }

    fn hits(&self, descriptor: &D) -> u64 {
        hits_of(self.request, descriptor)
    }

    /// The answer before any descriptor is decided.
    fn base(&self, plans: usize) -> RlsDecision {
        RlsDecision {
            over_limit: false,
            reason: Reason::NoRule,
            statuses: Vec::with_capacity(plans),
            tightest: None,
            retry_after_ms: 0,
            priority: self.priority,
            level: self.level,
            shadow_shed: self.shadow_shed,
            failure: None,
            store_error: None,
            reservation: None,
        }
    }

    /// A request admitted whole that reserves: the reservation of what its
    /// reserving descriptors' admissions counted, in the windows of the
    /// store's clock.
    fn reserved(&self, engine: &Engine, items: &[ManyItem], outcome: &ManyOutcome) -> Option<Box<str>> {
        let admitted =
            outcome.committed && outcome.verdicts.iter().zip(items).all(|(v, i)| v.admitted || i.shadow);
        if !admitted || !self.roles.contains(&Role::Reserved) {
            return None;
        }
        let reserved = items
            .iter()
            .zip(&self.roles)
            // A slot in flight is taken, not reserved: a release gives it back.
            .filter(|(item, role)| {
                **role == Role::Reserved && item.count == Count::IfFits && !item.params.algorithm.releases()
            })
            .map(|(item, _)| item);
        // Expiry is the deciding instance's clock, which settling reads.
        let expires_ms = engine.inner.clock.now_ms().saturating_add(engine.inner.reservation_ttl_ms);
        let reservation =
            reserve::EnvoyReservation::new(self.request.domain, expires_ms, reserved, outcome.now_ms);
        if reservation.is_none() {
            engine.adjusted(super::Api::Envoy, "reservation_too_large");
        }
        reservation.filter(|r| !r.held.is_empty()).map(|r| r.id().into_boxed_str())
    }

    fn settled(&self) -> (&[Plan], &[ManyItem]) {
        let (plans, items) = self.settled.as_ref().expect("settled");
        (plans, items)
    }
}

impl<D: Descriptor> Subject for Rls<'_, '_, D> {
    type Answer = RlsDecision;
    type Outcome = ManyOutcome;

    #[inline]
    fn priority(&self) -> Priority {
        self.priority
    }

    /// A request whose every counted limit is a report or a release (with
    /// hits): its usage has happened. (A check of a `report_mode` limit, 0 hits, is
    /// shed.)
    #[inline]
    fn shed_exempt(&self) -> bool {
        let (mut reports, mut others) = (0, 0);
        for (found, descriptor) in self.limits.iter().zip(self.request.descriptors) {
            match found {
                Some(m) if m.limit.unlimited => {}
                Some(m) if (m.limit.report_mode || m.role.reports()) && self.hits(descriptor) > 0 => {
                    reports += 1
                }
                Some(_) => others += 1,
                None => {}
            }
        }
        reports > 0 && others == 0
    }

    #[inline]
    fn refused(self, engine: &Engine, reason: Reason, retry_after_ms: u64, level: Level) -> RlsDecision {
        let (priority, shadow_shed) = (self.priority, self.shadow_shed);
        let refused = match &self.settled {
            None => {
                let request = self.request;
                let limits = self.limits.into_iter().zip(request.descriptors);
                let limits =
                    limits.map(|(found, descriptor)| found.map(|m| (m.limit, hits_of(request, descriptor))));
                answer::refused(engine, limits, reason, priority, level, retry_after_ms)
            }
            Some((plans, items)) => {
                let limits = plans.iter().map(|plan| match plan {
                    Plan::NoLimit => None,
                    Plan::Unlimited(limit, _, hits) => Some((Arc::clone(limit), *hits)),
                    Plan::Limited(limit, index, _) => Some((Arc::clone(limit), item_hits(&items[*index]))),
                });
                answer::refused(engine, limits, reason, priority, level, retry_after_ms)
            }
        };
        RlsDecision { shadow_shed, ..refused }
    }

    /// Nothing to count (no limit matched, or only unlimited ones):
    /// answered without a store call.
    #[inline]
    fn settle(&mut self, engine: &Engine, level: Level, shadow_shed: bool) -> Option<RlsDecision> {
        (self.level, self.shadow_shed) = (level, shadow_shed);
        let limits = std::mem::take(&mut self.limits);
        let (plans, mut items, roles) =
            plan::plans(engine, self.request.descriptors, limits, |d| self.hits(d));
        if items.is_empty() {
            return Some(answer::answer(engine, &plans, &items, None, self.base(plans.len()), false));
        }
        if roles.iter().any(|role| matches!(role, Role::Reserved | Role::Settled)) {
            if roles.contains(&Role::Settled) {
                let now_ms = engine.inner.clock.now_ms();
                self.settles = reserve::settle(engine, self.request, &mut items, &roles, now_ms);
            }
            self.roles = roles;
        }
        self.settled = Some((plans, items));
        None
    }

    #[inline]
    fn overload(&self, engine: &Engine) -> Option<u64> {
        let (plans, items) = self.settled();
        plan::overload(engine, self.request, plans, items)
    }

    #[inline]
    fn cached(&mut self, _: &Engine) -> Option<RlsDecision> {
        None
    }

    #[inline]
    fn keys(&self) -> usize {
        self.settled().1.len()
    }

    #[inline]
    async fn decide(&self, engine: &Engine) -> Result<ManyOutcome, StoreError> {
        let items = self.settled().1;
        let tenant = engine.tenant_share(|| plan::tenant(engine, self.request));
        let shares = Shares { caller: self.request.share, tenant: tenant.as_deref() };
        if self.settles {
            return engine.inner.store.decide_job_in(shares, self.request.domain, items).await;
        }
        engine.inner.store.decide_many_in(shares, self.request.domain, items).await
    }

    #[inline]
    fn answer(self, engine: &Engine, outcome: ManyOutcome) -> RlsDecision {
        let (plans, items) = self.settled();
        if self.settles && !outcome.committed {
            engine.adjusted(super::Api::Envoy, "settlement_repeated");
        }
        let reservation = self.reserved(engine, items, &outcome);
        let decided = answer::answer(engine, plans, items, Some(&outcome), self.base(plans.len()), false);
        RlsDecision { reservation, ..decided }
    }

    #[inline]
    fn failed(self, engine: &Engine, error: StoreError) -> RlsDecision {
        let (plans, items) = self.settled();
        failed::failed(engine, self.request, plans, items, error, self.base(plans.len()))
    }
}
