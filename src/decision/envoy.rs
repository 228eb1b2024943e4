//! The Envoy entry point, [`Engine::should_rate_limit`]: envoyproxy/ratelimit's
//! semantics over the engine's steps.
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

use std::{
    collections::{HashMap, HashSet},
    fmt::Write as _,
    sync::Arc,
};

use super::{Api, Engine, LimitHits, REPORT_LABEL, Reason, keys, pipeline::Subject};
use crate::{
    limiter::{
        CallerCalls, Count, FailureKind, ManyItem, ManyOutcome, Shares, StoreError, Verdict,
        adaptive::Outcome, binding, push_encoded, window::Algorithm,
    },
    overload::{Kind, OverloadVerdict},
    rules::envoy::{EnvoyLimit, EnvoyMatch, Unit, params, tick_ms},
    shed::{Level, Priority},
};

/// The metric label and dead-letter rule id of a request-supplied limit: a
/// fixed value, so no request can mint a metric series.
pub(super) const OVERRIDE_LABEL: &str = "override";

/// How the engine treats Envoy requests (from `envoy.*` and `shed.*`).
#[derive(Debug, Clone, PartialEq)]
pub struct EnvoyPolicy {
    /// How limits without an `algorithm` of their own count, request
    /// overrides included (`envoy.algorithm`: a sliding or a fixed window).
    pub algorithm: Algorithm,
    /// What answers when the store cannot decide (`envoy.failure_mode`).
    pub failure: EnvoyFailure,
    /// The same, per domain (`envoy.domain_failure_mode`), over `failure`.
    pub domain_failure: HashMap<String, EnvoyFailure>,
    /// A descriptor entry with this key and a priority name as its value
    /// sets the request's priority (`envoy.priority_key`; empty: none).
    pub priority_key: String,
    /// Priority of requests to a domain whose descriptors name none
    /// (`envoy.domain_priority`).
    pub domain_priority: HashMap<String, Priority>,
    /// A longer entry key or value is counted by its digest
    /// (`envoy.max_entry_bytes`).
    pub max_value_bytes: usize,
    /// Domains whose requests may supply their own limit
    /// (`envoy.allow_request_limits` with `envoy.request_limit_domains`);
    /// empty: no request limit is honoured.
    pub request_limit_domains: HashSet<String>,
    /// Every limit is in quota mode (`envoy.quota_mode`, upstream's
    /// `QUOTA_MODE`), as if each descriptor said `quota_mode: true`.
    pub quota_mode: bool,
    /// Every limit is in shadow mode (`envoy.shadow_mode`, upstream's
    /// `SHADOW_MODE`): over-limit is counted and reported, never enforced.
    pub shadow_mode: bool,
    /// Count every descriptor in envoyproxy/ratelimit's terms
    /// ([`Stats::limit_hits`]; `envoy.upstream_metrics`).
    pub upstream_metrics: bool,
    /// Hits past this share of a limit are `near_limit`
    /// (`envoy.near_limit_ratio`, upstream's `NEAR_LIMIT_RATIO`).
    pub near_limit_ratio: f32,
    /// A 0-hit check passes while the count is within the limit (weight 0)
    /// rather than while one more hit fits (weight 1)
    /// (`envoy.zero_hits: within_limit`).
    pub zero_hits_within_limit: bool,
    /// Every hit is counted, each descriptor on its own, over the limit
    /// too (`envoy.hits_counted: always`).
    pub count_every_hit: bool,
}

impl Default for EnvoyPolicy {
    fn default() -> Self {
        EnvoyPolicy {
            algorithm: Algorithm::SlidingWindow,
            failure: EnvoyFailure::Local,
            domain_failure: HashMap::new(),
            priority_key: "priority".to_owned(),
            domain_priority: HashMap::new(),
            max_value_bytes: 1_024,
            request_limit_domains: HashSet::new(),
            quota_mode: false,
            shadow_mode: false,
            upstream_metrics: true,
            near_limit_ratio: 0.8,
            zero_hits_within_limit: false,
            count_every_hit: false,
        }
    }
}

/// What answers a `ShouldRateLimit` the store could not decide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyFailure {
    /// The local limiter, at this instance's share of each limit (reasons
    /// LOCAL_OK and LOCAL_OVER_LIMIT); every descriptor OVER_LIMIT when it
    /// is at its bound.
    Local,
    /// OK, nothing counted (FAIL_OPEN).
    Open,
    /// The API answers UNAVAILABLE (FAIL_CLOSED), so Envoy's own
    /// `failure_mode_deny` decides.
    Unavailable,
}

/// A `ShouldRateLimit` request that owns its parts (capture, replay).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyCall {
    /// The configuration domain.
    pub domain: String,
    /// The descriptors, in request order.
    pub descriptors: Vec<OwnedDescriptor>,
    /// Hits of descriptors that state none (0 means 1).
    pub hits_addend: u32,
}

impl EnvoyCall {
    /// The request as the engine takes it.
    pub fn request(&self) -> RlsRequest<'_, OwnedDescriptor> {
        RlsRequest {
            domain: &self.domain,
            descriptors: &self.descriptors,
            hits_addend: self.hits_addend,
            trace_id: None,
            share: None,
            may_report: true,
        }
    }
}

/// A validated `ShouldRateLimit` request. It borrows the descriptors as
/// they are (any [`Descriptor`], the wire message's included), so handing
/// a request to the engine copies and allocates nothing.
#[derive(Debug, Clone, Copy)]
pub struct RlsRequest<'a, D> {
    /// The configuration domain.
    pub domain: &'a str,
    /// The descriptors, in request order.
    pub descriptors: &'a [D],
    /// Hits of descriptors that state none (0 means 1).
    pub hits_addend: u32,
    /// W3C trace id from the call's `traceparent`, if any.
    pub trace_id: Option<&'a str>,
    /// The caller's shares of the store's in-flight work; `None`: unbounded.
    pub share: Option<&'a CallerCalls>,
    /// The caller may report outcomes (`grpc.reporting_peers`): if not, its
    /// outcome descriptors are answered and count nowhere.
    pub may_report: bool,
}

/// What the engine reads of one descriptor. `api` implements it for the
/// wire type; [`RlsDescriptor`] is a plain one for tools and tests.
pub trait Descriptor {
    /// `(key, value)` entries, in order.
    fn entries(&self) -> impl Iterator<Item = (&str, &str)> + Clone;
    /// A limit the request supplies for this descriptor (a valid one: one
    /// with a unit this service does not know reads as none).
    fn limit(&self) -> Option<LimitOverride>;
    /// This descriptor's own hits, overriding the request's.
    fn hits_addend(&self) -> Option<u64>;
}

/// The descriptor entry key that makes a descriptor an outcome report: its
/// last entry `ratelimitd.outcome: success | failure | overload` tells how
/// requests matched by its other entries went downstream (the Envoy
/// twin of a native `Report` with an outcome).
pub(super) const OUTCOME_KEY: &str = "ratelimitd.outcome";

/// The outcome `d` reports, and its number of entries: `None` unless its
/// last entry is [`OUTCOME_KEY`] with a known outcome (any other value
/// leaves the descriptor an ordinary one, counted as it is).
fn reported<D: Descriptor>(d: &D) -> Option<(Outcome, usize)> {
    let (count, last) = d.entries().fold((0, None), |(n, _), entry| (n + 1, Some(entry)));
    match last? {
        (OUTCOME_KEY, value) if count > 1 => Some((Outcome::parse(value)?, count)),
        _ => None,
    }
}

/// A descriptor as plain data.
#[derive(Debug, Clone, Default)]
pub struct RlsDescriptor<'a> {
    /// `(key, value)` entries, in order.
    pub entries: Vec<(&'a str, &'a str)>,
    /// A limit the request supplies for this descriptor.
    pub limit: Option<LimitOverride>,
    /// This descriptor's own hits, overriding the request's.
    pub hits_addend: Option<u64>,
}

impl Descriptor for RlsDescriptor<'_> {
    fn entries(&self) -> impl Iterator<Item = (&str, &str)> + Clone {
        self.entries.iter().copied()
    }
    fn limit(&self) -> Option<LimitOverride> {
        self.limit
    }
    fn hits_addend(&self) -> Option<u64> {
        self.hits_addend
    }
}

/// A descriptor that owns its entries: what capture records and replay
/// decides again.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnedDescriptor {
    /// `[key, value]` entries, in order.
    pub entries: Vec<(String, String)>,
    /// A limit the request supplied for this descriptor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<LimitOverride>,
    /// This descriptor's own hits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hits_addend: Option<u64>,
}

impl OwnedDescriptor {
    /// A copy of `descriptor`.
    pub fn of<D: Descriptor>(descriptor: &D) -> Self {
        OwnedDescriptor {
            entries: descriptor.entries().map(|(k, v)| (k.to_owned(), v.to_owned())).collect(),
            limit: descriptor.limit(),
            hits_addend: descriptor.hits_addend(),
        }
    }
}

impl Descriptor for OwnedDescriptor {
    fn entries(&self) -> impl Iterator<Item = (&str, &str)> + Clone {
        self.entries.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
    fn limit(&self) -> Option<LimitOverride> {
        self.limit
    }
    fn hits_addend(&self) -> Option<u64> {
        self.hits_addend
    }
}

/// A request-supplied limit (`RateLimitDescriptor.limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitOverride {
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

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

/// How one descriptor is decided.
pub(super) enum Plan {
    /// No limit applies (unmatched, or replaced).
    NoLimit,
    /// `unlimited: true`, its upstream metric key if not the full key, and
    /// the descriptor's hits.
    Unlimited(Arc<EnvoyLimit>, Option<Box<str>>, u64),
    /// Counted: the limit, its item's index in the store call, and its
    /// upstream metric key if not the full key.
    Limited(Arc<EnvoyLimit>, usize, Option<Box<str>>),
}

/// Upstream's key of a request-supplied limit: `domain.key_value.key…`.
fn request_stat_key<'a>(domain: &str, entries: impl Iterator<Item = (&'a str, &'a str)>) -> Box<str> {
    let mut key = domain.to_owned();
    for (k, v) in entries {
        key.push('.');
        key.push_str(k);
        if !v.is_empty() {
            key.push('_');
            key.push_str(v);
        }
    }
    key.into_boxed_str()
}

/// The key upstream's metrics count a limit under.
pub(super) fn stat_key<'a>(limit: &'a EnvoyLimit, key: &'a Option<Box<str>>) -> &'a str {
    key.as_deref().unwrap_or(&limit.full_key)
}

impl Engine {
    /// Decides one `ShouldRateLimit` request, counts and times it, and
    /// records `reason` and `overall_code` on the current span.
    pub async fn should_rate_limit<D: Descriptor>(&self, request: &RlsRequest<'_, D>) -> RlsDecision {
        let started = std::time::Instant::now();
        let decision = self.decide_rls(request).await;
        if !decision.over_limit {
            admit_reporters(request, &decision);
        }
        self.capture_rls(request, &decision);
        let span = tracing::Span::current();
        span.record("reason", decision.reason.as_str());
        span.record("overall_code", if decision.over_limit { "OVER_LIMIT" } else { "OK" });
        self.inner.stats.decision_latency(Api::Envoy, started.elapsed());
        decision
    }

    /// Hands a sampled request and its decision to the capture sink.
    fn capture_rls<D: Descriptor>(&self, request: &RlsRequest<'_, D>, decision: &RlsDecision) {
        let Some(capture) = &self.inner.capture else { return };
        let mut first = request.descriptors.first().into_iter().flat_map(Descriptor::entries);
        if !capture.wants_envoy(request.domain, &mut first) {
            return;
        }
        let descriptors: Vec<OwnedDescriptor> = request.descriptors.iter().map(OwnedDescriptor::of).collect();
        let version = self.inner.envoy.as_ref().map(|e| e.load().version().to_owned()).unwrap_or_default();
        let call =
            EnvoyCall { domain: request.domain.to_owned(), descriptors, hits_addend: request.hits_addend };
        capture.record_envoy(call, decision, &version);
    }

    /// The request's priority: a descriptor entry named
    /// `envoy.priority_key` with a priority as its value, else the domain's
    /// default, else `shed.default_priority`. An unknown value is ignored;
    /// with `shed.trust_request_priority` off the entry may only lower the
    /// domain's (or the default) priority.
    pub fn rls_priority<D: Descriptor>(&self, request: &RlsRequest<'_, D>) -> Priority {
        let policy = &self.inner.envoy_policy;
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
        let base = policy.domain_priority.get(request.domain).copied().unwrap_or(self.inner.default_priority);
        self.effective_priority(stated, base)
    }

    async fn decide_rls<D: Descriptor>(&self, request: &RlsRequest<'_, D>) -> RlsDecision {
        let rls = Rls {
            request,
            limits: self.rls_limits(request),
            settled: None,
            priority: self.rls_priority(request),
            level: Level::Normal,
            shadow_shed: false,
        };
        self.run(rls).await
    }

    /// How each descriptor is decided, and the counters of the one store
    /// call (`hits`: a descriptor's hits).
    fn rls_plans<D: Descriptor>(
        &self,
        descriptors: &[D],
        limits: Vec<Option<EnvoyMatch>>,
        hits: impl Fn(&D) -> u64,
    ) -> (Vec<Plan>, Vec<ManyItem>) {
        let mut items = Vec::new();
        let plans = limits
            .into_iter()
            .zip(descriptors)
            .map(|(found, descriptor)| match found {
                None => Plan::NoLimit,
                Some(found) if found.limit.unlimited => {
                    Plan::Unlimited(found.limit, found.stat_key, hits(descriptor))
                }
                Some(found) => {
                    let first = items.len();
                    self.rls_items(&found, descriptor, hits(descriptor), &mut items);
                    Plan::Limited(found.limit, first, found.stat_key)
                }
            })
            .collect();
        (plans, items)
    }

    /// The counters of a descriptor with a limit (`found`) and `hits`: one
    /// per limit, the limit's then its `also` limits' (their keys are
    /// `<seconds>+<slot>|…`, never a first limit's `<seconds>|…`), pushed onto
    /// `items`. The entries are encoded once, and a digested entry counted
    /// once per descriptor.
    fn rls_items<D: Descriptor>(
        &self,
        found: &EnvoyMatch,
        descriptor: &D,
        hits: u64,
        items: &mut Vec<ManyItem>,
    ) {
        let first = &found.limit;
        let policy = &self.inner.envoy_policy;
        let seconds = |limit: &EnvoyLimit| limit.window_seconds().expect("a limited limit has a unit");
        let (raw, mut digested) =
            raw_counter_key(seconds(first), descriptor.entries(), &found.shared, policy.max_value_bytes);
        let entries_at = raw.find('|').unwrap_or(raw.len());
        let mut keys = Vec::with_capacity(first.also.len() + 1);
        for (slot, also) in first.also.iter().enumerate() {
            let (key, whole) = bounded_key(format!("{}+{}{}", seconds(also), slot + 1, &raw[entries_at..]));
            digested |= whole;
            keys.push(key);
        }
        let (key, whole) = bounded_key(raw);
        if digested || whole {
            self.inner.stats.adjusted(Api::Envoy, "entry_digest");
        }
        for (slot, key) in std::iter::once(key).chain(keys).enumerate() {
            let limit = first.limit_at(slot);
            let seconds = seconds(limit);
            // `hits_addend: 0` asks whether one more hit fits (or, as
            // upstream, whether the count is within the limit) and counts
            // nothing; a `report_mode` limit counts hits whatever is left, and
            // with `count_every_hit` an admission is counted even when denied.
            let (weight, count) = match hits {
                0 => (u64::from(!policy.zero_hits_within_limit), Count::Never),
                hits if limit.report_mode => (hits, Count::Always),
                hits if policy.count_every_hit => (hits, Count::Anyway),
                hits => (hits, Count::IfFits),
            };
            items.push(ManyItem {
                key,
                params: params(seconds, limit.per_unit(), limit.algorithm.unwrap_or(policy.algorithm)),
                tick_ms: tick_ms(seconds),
                weight,
                count,
                // Neither blocks the others: shadow never denies, and a quota
                // descriptor denies only together with all others.
                shadow: self.shadow(first) || self.quota(first),
            });
        }
    }

    /// One counted descriptor's status from the `verdicts` of its limits
    /// (the one that binds), counted in the metrics (`local`: the local
    /// limiter's verdicts); and whether it was over.
    fn rls_status(
        &self,
        limit: &Arc<EnvoyLimit>,
        key: &Option<Box<str>>,
        item: &ManyItem,
        verdicts: &[Verdict],
        local: bool,
    ) -> (DescriptorDecision, bool) {
        let (verdict, bound) = binding(verdicts);
        let shadow = self.shadow(limit);
        if self.inner.envoy_policy.upstream_metrics {
            let hits = item_hits(item);
            let near = self.inner.envoy_policy.near_limit_ratio;
            let counted = LimitHits::of(u64::from(limit.per_unit()), hits, &verdict, shadow, near);
            self.inner.stats.limit_hits(stat_key(limit, key), counted);
        }
        let over = !verdict.admitted;
        let denied = over && !shadow;
        let report = item.count == Count::Always;
        let reason = match (report, denied, local) {
            (true, _, _) => REPORT_LABEL,
            (false, true, false) => "OVER_LIMIT",
            (false, false, false) => "OK",
            (false, true, true) => "LOCAL_OVER_LIMIT",
            (false, false, true) => "LOCAL_OK",
        };
        self.inner.stats.decision(Api::Envoy, Some(&limit.full_key), reason, report || !denied);
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

    /// The overload layer over every counted admission whose limit has a
    /// directive: `Some(retry_after_ms)` when one of them is dropped (then
    /// nothing is counted). A shadow limit's drop is only counted.
    fn rls_overload<D: Descriptor>(
        &self,
        request: &RlsRequest<'_, D>,
        plans: &[Plan],
        items: &[ManyItem],
    ) -> Option<u64> {
        let overload = self.inner.overload.as_ref()?;
        let mut tenant = None;
        for plan in plans {
            let Plan::Limited(limit, index, _) = plan else { continue };
            // Admissions only: not a 0-hit check, not a usage report.
            if limit.overload.is_none() || matches!(items[*index].count, Count::Never | Count::Always) {
                continue;
            }
            let tenant = *tenant.get_or_insert_with(|| self.rls_tenant(request));
            if let OverloadVerdict::Drop { retry_after_ms } =
                overload.check(Kind::Envoy, &limit.full_key, tenant, self.shadow(limit))
            {
                return Some(retry_after_ms);
            }
        }
        None
    }

    /// An Envoy request's tenant (for the overload layer and the tenants'
    /// shares of the store): the value of the first descriptor entry keyed
    /// `overload.tenant_descriptor_key`.
    fn rls_tenant<'r, D: Descriptor>(&self, request: &RlsRequest<'r, D>) -> Option<&'r str> {
        let key = self.inner.tenants.descriptor_key.as_str();
        request.descriptors.iter().flat_map(Descriptor::entries).find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    /// Whether `limit` is in shadow mode: its own `shadow_mode`, or
    /// `envoy.shadow_mode` for all.
    pub(super) fn shadow(&self, limit: &EnvoyLimit) -> bool {
        limit.shadow_mode || self.inner.envoy_policy.shadow_mode
    }

    /// Whether `limit` is in quota mode: its own `quota_mode`, or
    /// `envoy.quota_mode` for all.
    pub(super) fn quota(&self, limit: &EnvoyLimit) -> bool {
        limit.quota_mode || self.inner.envoy_policy.quota_mode
    }

    /// Each descriptor's limit: the request's override, else the
    /// configuration's; then `replaces` drops every named limit another
    /// matched limit replaces.
    fn rls_limits<D: Descriptor>(&self, request: &RlsRequest<'_, D>) -> Vec<Option<EnvoyMatch>> {
        let config = self.inner.envoy.as_ref().map(|hot| hot.load());
        // Asked only of requests that carry a limit: most carry none.
        let honoured = || self.inner.envoy_policy.request_limit_domains.contains(request.domain);
        let mut limits: Vec<Option<EnvoyMatch>> = request
            .descriptors
            .iter()
            .map(|d| {
                if let Some((outcome, n)) = reported(d) {
                    if !request.may_report {
                        self.inner.stats.adjusted(Api::Envoy, "outcome_not_allowed");
                        return None;
                    }
                    // Reported to the limit its other entries find; nothing counted.
                    let found = config.as_ref()?.lookup(request.domain, d.entries().take(n - 1));
                    if let Some(limit) = found.as_ref().and_then(|f| f.limit.adaptive.as_deref()) {
                        // The reporter is the counter its other entries name: its
                        // report weighs what that counter was admitted.
                        let reporter = Reporter(request.domain, d.entries().take(n - 1));
                        limit.record(reporter, outcome, None, hits_of(request, d).max(1));
                    }
                    return None;
                }
                let requested = match d.limit() {
                    Some(limit) if honoured() => Some(limit),
                    Some(_) => {
                        // Request-supplied limits are off for this domain: the
                        // configured limit applies, as if none were sent.
                        self.inner.stats.adjusted(Api::Envoy, "override_ignored");
                        None
                    }
                    None => None,
                };
                match requested {
                    Some(requested) => Some(self.requested_limit(request.domain, d, requested)),
                    None => config.as_ref()?.lookup(request.domain, d.entries()),
                }
            })
            .collect();
        // The limits are `Arc`s: collecting the replacing ones clones pointers.
        let replacing: Vec<Arc<EnvoyLimit>> = limits
            .iter()
            .flatten()
            .filter(|m| !m.limit.replaces.is_empty())
            .map(|m| Arc::clone(&m.limit))
            .collect();
        if !replacing.is_empty() {
            for slot in &mut limits {
                let replaced = slot
                    .as_ref()
                    .and_then(|m| m.limit.name.as_deref())
                    .is_some_and(|name| replacing.iter().any(|r| r.replaces.iter().any(|x| x == name)));
                if replaced {
                    *slot = None;
                }
            }
        }
        limits
    }

    /// A limit the request supplies for descriptor `d` of `domain`, under
    /// the fixed label (no request can mint a metric series) or, for
    /// upstream's metrics, the key upstream names it by (its entries).
    fn requested_limit<D: Descriptor>(&self, domain: &str, d: &D, requested: LimitOverride) -> EnvoyMatch {
        EnvoyMatch {
            limit: Arc::new(EnvoyLimit {
                full_key: Arc::clone(&self.override_label),
                requests_per_unit: requested.requests_per_unit,
                unit: Some(requested.unit),
                unit_multiplier: 1,
                unlimited: false,
                shadow_mode: false,
                quota_mode: false,
                report_mode: false,
                metadata: None,
                name: None,
                replaces: Vec::new(),
                detailed_metric: false,
                algorithm: None,
                overload: None,
                also: Vec::new(),
                adaptive: None,
            }),
            shared: Vec::new(),
            stat_key: self.inner.envoy_policy.upstream_metrics.then(|| request_stat_key(domain, d.entries())),
        }
    }

    /// The answer to a request refused before any counter (shed, or
    /// dropped by the overload layer): every descriptor OVER_LIMIT (with its
    /// limit, when one matched), nothing counted.
    fn rls_refused(
        &self,
        limits: impl Iterator<Item = Option<(Arc<EnvoyLimit>, u64)>>,
        reason: Reason,
        priority: Priority,
        level: Level,
        retry_after_ms: u64,
    ) -> RlsDecision {
        let statuses = limits
            .map(|found| {
                let (limit, hits) = found.unzip();
                self.inner.stats.decision(
                    Api::Envoy,
                    limit.as_ref().map(|l| &l.full_key),
                    reason.as_str(),
                    false,
                );
                if self.inner.envoy_policy.upstream_metrics
                    && let (Some(limit), Some(total)) = (&limit, hits)
                {
                    // Refused before any counter: the hits, all over the
                    // limit (an unlimited descriptor's only counted), under
                    // its configured key.
                    let over = if limit.unlimited { 0 } else { total };
                    self.inner
                        .stats
                        .limit_hits(&limit.full_key, LimitHits { total, over, ..LimitHits::default() });
                }
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
        }
    }

    /// Statuses and the overall code from the store's verdicts (`None`:
    /// nothing was counted); `local`: the local limiter's verdicts.
    pub(super) fn rls_answer(
        &self,
        plans: &[Plan],
        items: &[ManyItem],
        outcome: Option<&ManyOutcome>,
        mut decision: RlsDecision,
        local: bool,
    ) -> RlsDecision {
        let (mut enforced_over, mut quota_total, mut quota_over, mut counted) = (false, 0, 0, false);
        let mut tightest: Option<(u32, usize)> = None;
        for plan in plans {
            let status = match plan {
                Plan::NoLimit => {
                    self.inner.stats.decision(Api::Envoy, None, "NO_RULE", true);
                    DescriptorDecision::default()
                }
                Plan::Unlimited(limit, key, hits) => {
                    self.inner.stats.decision(Api::Envoy, None, "UNLIMITED", true);
                    if self.inner.envoy_policy.upstream_metrics {
                        // Upstream counts an unlimited descriptor's hits, nothing else.
                        let hits = LimitHits { total: *hits, ..LimitHits::default() };
                        self.inner.stats.limit_hits(stat_key(limit, key), hits);
                    }
                    DescriptorDecision {
                        unlimited: true,
                        remaining: u32::MAX,
                        ..DescriptorDecision::default()
                    }
                }
                Plan::Limited(limit, index, key) => {
                    counted = true;
                    let verdicts = &outcome.expect("limited descriptors were decided").verdicts;
                    let mine = &verdicts[*index..=*index + limit.also.len()];
                    let (status, over) = self.rls_status(limit, key, &items[*index], mine, local);
                    if self.quota(limit) {
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
}

/// Who may report outcomes of an adaptive Envoy limit: a descriptor's
/// counter, by its domain and entries.
struct Reporter<'a, I>(&'a str, I);

impl<'a, I: Iterator<Item = (&'a str, &'a str)> + Clone> std::hash::Hash for Reporter<'a, I> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state);
        for entry in self.1.clone() {
            entry.hash(state);
        }
    }
}

/// Credits each descriptor of an admitted request whose adaptive limit
/// counted it with its hits (a peek's none), for its outcome reports.
fn admit_reporters<D: Descriptor>(request: &RlsRequest<'_, D>, decision: &RlsDecision) {
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

/// The hits a descriptor's counter item carries: its weight, but none for
/// a peek (`hits_addend: 0`, asked as a weight of 1).
pub(super) fn item_hits(item: &ManyItem) -> u64 {
    if item.count == Count::Never { 0 } else { item.weight }
}

/// A descriptor's hits: its own, else the request's (0 means 1).
fn hits_of<D: Descriptor>(request: &RlsRequest<'_, D>, descriptor: &D) -> u64 {
    descriptor.hits_addend().unwrap_or_else(|| u64::from(request.hits_addend.max(1)))
}

/// A `ShouldRateLimit` in the pipeline: each descriptor's limit, then
/// (settled) how each is decided and the counters of one all-or-nothing
/// store call.
struct Rls<'r, 'a, D> {
    request: &'r RlsRequest<'a, D>,
    /// Each descriptor's limit, until settled.
    limits: Vec<Option<EnvoyMatch>>,
    /// Settled: each descriptor's plan, and the store call's counters.
    settled: Option<(Vec<Plan>, Vec<ManyItem>)>,
    priority: Priority,
    level: Level,
    shadow_shed: bool,
}

impl<D: Descriptor> Rls<'_, '_, D> {
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
        }
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

    /// A request whose every counted limit is a report (with hits): its
    /// usage has happened. (A check of a `report_mode` limit, 0 hits, is
    /// shed.)
    #[inline]
    fn shed_exempt(&self) -> bool {
        let (mut reports, mut others) = (0, 0);
        for (found, descriptor) in self.limits.iter().zip(self.request.descriptors) {
            match found {
                Some(m) if m.limit.unlimited => {}
                Some(m) if m.limit.report_mode && self.hits(descriptor) > 0 => reports += 1,
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
                engine.rls_refused(limits, reason, priority, level, retry_after_ms)
            }
            Some((plans, items)) => {
                let limits = plans.iter().map(|plan| match plan {
                    Plan::NoLimit => None,
                    Plan::Unlimited(limit, _, hits) => Some((Arc::clone(limit), *hits)),
                    Plan::Limited(limit, index, _) => {
                        let item = &items[*index];
                        Some((Arc::clone(limit), item_hits(item)))
                    }
                });
                engine.rls_refused(limits, reason, priority, level, retry_after_ms)
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
        let (plans, items) = engine.rls_plans(self.request.descriptors, limits, |d| self.hits(d));
        if items.is_empty() {
            return Some(engine.rls_answer(&plans, &items, None, self.base(plans.len()), false));
        }
        self.settled = Some((plans, items));
        None
    }

    #[inline]
    fn overload(&self, engine: &Engine) -> Option<u64> {
        let (plans, items) = self.settled();
        engine.rls_overload(self.request, plans, items)
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
        let tenant = engine.tenant_share(|| engine.rls_tenant(self.request));
        let shares = Shares { caller: self.request.share, tenant: tenant.as_deref() };
        engine.inner.store.decide_many_in(shares, self.request.domain, items).await
    }

    #[inline]
    fn answer(self, engine: &Engine, outcome: ManyOutcome) -> RlsDecision {
        let (plans, items) = self.settled();
        engine.rls_answer(plans, items, Some(&outcome), self.base(plans.len()), false)
    }

    #[inline]
    fn failed(self, engine: &Engine, error: StoreError) -> RlsDecision {
        let (plans, items) = self.settled();
        engine.rls_failed(self.request, plans, items, error, self.base(plans.len()))
    }
}

/// The counter of one descriptor: its window in seconds and its entries, each as
/// `key=value` with `%`, `=`, `|` and `*` percent-encoded so distinct entry
/// lists never share a counter. An entry matched through a `share_threshold`
/// wildcard contributes the pattern instead of its value (`shared`), so all
/// of its values share the counter. A key or value over `max_bytes` is
/// counted by its digest ([`keys::bounded`]), and a whole key over
/// [`keys::MAX_COUNTER_KEY_BYTES`] is digested by [`bounded_key`]; the flag
/// says an entry was.
fn raw_counter_key<'a>(
    window_seconds: u64,
    entries: impl Iterator<Item = (&'a str, &'a str)> + Clone,
    shared: &[(usize, Arc<str>)],
    max_bytes: usize,
) -> (String, bool) {
    let bound = |text: &'a str| keys::bounded(text, max_bytes);
    let mut key = String::with_capacity(
        16 + entries.clone().map(|(k, v)| k.len().min(72) + v.len().min(72) + 2).sum::<usize>(),
    );
    let mut digested = false;
    let _ = write!(key, "{window_seconds}");
    for (index, (name, value)) in entries.enumerate() {
        key.push('|');
        let name = bound(name);
        digested |= matches!(name, std::borrow::Cow::Owned(_));
        escape_into(&mut key, &name);
        key.push('=');
        match shared.iter().find(|(i, _)| *i == index) {
            // `*` is escaped too, so a shared pattern never equals a value.
            Some((_, pattern)) => {
                key.push('*');
                escape_into(&mut key, pattern);
            }
            None => {
                let value = bound(value);
                digested |= matches!(value, std::borrow::Cow::Owned(_));
                escape_into(&mut key, &value);
            }
        }
    }
    (key, digested)
}

/// `key`, or its digest when it is over [`keys::MAX_COUNTER_KEY_BYTES`]
/// (never equal to a short key: those start with the window's digits); the
/// flag says the digest was taken.
fn bounded_key(key: String) -> (String, bool) {
    if key.len() > keys::MAX_COUNTER_KEY_BYTES {
        return (keys::digest_bytes(key.as_bytes()), true);
    }
    (key, false)
}

/// Separators of the counter key format, encoded inside names and values.
const KEY_SEPARATORS: [char; 3] = ['=', '|', '*'];

fn escape_into(out: &mut String, text: &str) {
    push_encoded(out, text, &KEY_SEPARATORS);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A descriptor's first counter key, as [`Engine::rls_items`] makes it.
    fn counter_key<'a>(
        window_seconds: u64,
        entries: impl Iterator<Item = (&'a str, &'a str)> + Clone,
        shared: &[(usize, Arc<str>)],
        max_bytes: usize,
    ) -> (String, bool) {
        let (raw, digested) = raw_counter_key(window_seconds, entries, shared, max_bytes);
        let (key, whole) = bounded_key(raw);
        (key, digested || whole)
    }

    #[test]
    fn counter_keys_never_collide() {
        let a = counter_key(Unit::Second.seconds(), [("a", "b|c=d")].into_iter(), &[], 1_024).0;
        let b = counter_key(Unit::Second.seconds(), [("a", "b"), ("c", "d")].into_iter(), &[], 1_024).0;
        assert_ne!(a, b);
        assert_eq!(b, "1|a=b|c=d");
        assert_ne!(
            counter_key(Unit::Second.seconds(), [("a", "b")].into_iter(), &[], 1_024).0,
            counter_key(Unit::Minute.seconds(), [("a", "b")].into_iter(), &[], 1_024).0
        );
    }

    #[test]
    fn shared_entries_key_by_pattern_and_never_meet_a_value() {
        let shared = [(0, Arc::from("files/*"))];
        let a = counter_key(Unit::Minute.seconds(), [("files", "files/a.pdf")].into_iter(), &shared, 1_024).0;
        let b = counter_key(Unit::Minute.seconds(), [("files", "files/b.csv")].into_iter(), &shared, 1_024).0;
        assert_eq!(a, b);
        assert_eq!(a, "60|files=*files/%2A");
        // The literal value "files/*" (or "*files/*") counted without sharing is another counter.
        assert_ne!(a, counter_key(Unit::Minute.seconds(), [("files", "files/*")].into_iter(), &[], 1_024).0);
        assert_ne!(a, counter_key(Unit::Minute.seconds(), [("files", "*files/*")].into_iter(), &[], 1_024).0);
        // Only the shared entry is replaced.
        let nested = counter_key(
            Unit::Second.seconds(),
            [("user", "u1"), ("path", "/x")].into_iter(),
            &[(0, Arc::from("u*"))],
            1_024,
        )
        .0;
        assert_eq!(nested, "1|user=*u%2A|path=/x");
    }

    #[test]
    fn long_keys_are_stored_by_a_digest_of_the_whole_key() {
        let long = "v".repeat(400);
        let (a, digested) =
            counter_key(Unit::Second.seconds(), [("a", &*long), ("b", &*long)].into_iter(), &[], 1_024);
        assert!(digested);
        assert_eq!(a.len(), 72);
        let (b, _) = counter_key(Unit::Second.seconds(), [("a", &*long), ("b", "w")].into_iter(), &[], 1_024);
        assert_eq!(b.len(), 2 + 2 + 400 + 4, "under the bound: kept as it is");
        let (c, _) =
            counter_key(Unit::Minute.seconds(), [("a", &*long), ("b", &*long)].into_iter(), &[], 1_024);
        assert_ne!(a, c, "the unit is part of what is digested");
    }
}
