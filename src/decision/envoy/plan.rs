//! How each descriptor of a request is decided ([`Plan`]): its limit (a
//! request override, else the configuration's, `replaces` applied), then
//! the counters of the one all-or-nothing store call, and the overload
//! layer over them.

use std::sync::Arc;

use super::{
    RlsRequest,
    counter::{bounded_key, raw_counter_key},
    request::{Descriptor, LimitOverride, Marked, Reporter, hits_of, marked},
};
use crate::{
    decision::{Api, Engine, EnvoyPolicy},
    limiter::{Count, ManyItem},
    overload::{Kind, OverloadVerdict},
    rules::envoy::{EnvoyConfig, EnvoyLimit, EnvoyMatch, Role, params, tick_ms},
};

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

/// The hits a descriptor's counter item carries: its weight, but none for
/// a peek (`hits_addend: 0`, asked as a weight of 1).
pub(super) fn item_hits(item: &ManyItem) -> u64 {
    if item.count == Count::Never { 0 } else { item.weight }
}

/// Each descriptor's limit: the request's override, else the
/// configuration's; then `replaces` drops every named limit another
/// matched limit replaces.
pub(super) fn limits<D: Descriptor>(
    engine: &Engine,
    config: Option<&EnvoyConfig>,
    request: &RlsRequest<'_, D>,
) -> Vec<Option<EnvoyMatch>> {
    let inner = &engine.inner;
    // Asked only of requests that carry a limit: most carry none.
    let honoured = || inner.envoy_policy.request_limit_domains.contains(request.domain);
    let mut limits: Vec<Option<EnvoyMatch>> = request
        .descriptors
        .iter()
        .map(|d| {
            match marked(d) {
                Some((Marked::Release, n)) => {
                    return released(engine, config, request, d.entries().take(n - 1));
                }
                Some((Marked::Reserve, n)) => {
                    let found = config?.lookup(request.domain, d.entries().take(n - 1))?;
                    return Some(EnvoyMatch { role: Role::Reserved, ..found });
                }
                Some((Marked::Settle, n)) => {
                    if !request.may_report {
                        inner.stats.adjusted(Api::Envoy, "settlement_not_allowed");
                        return None;
                    }
                    let found = config?.lookup(request.domain, d.entries().take(n - 1))?;
                    if in_flight(&found) {
                        inner.stats.adjusted(Api::Envoy, "settlement_in_flight");
                        return None;
                    }
                    return Some(EnvoyMatch { role: Role::Settled, ..found });
                }
                Some((Marked::Outcome(outcome), n)) => {
                    return outcome_reported(engine, config, request, d, (outcome, n));
                }
                None => {}
            }
            let requested = match d.limit() {
                Some(limit) if honoured() => Some(limit),
                Some(_) => {
                    // Request-supplied limits are off for this domain: the
                    // configured limit applies, as if none were sent.
                    inner.stats.adjusted(Api::Envoy, "override_ignored");
                    None
                }
                None => None,
            };
            match requested {
                Some(requested) => Some(requested_limit(engine, request.domain, d, requested)),
                None => config.as_ref()?.lookup(request.domain, d.entries()),
            }
        })
        .collect();
    drop_replaced(&mut limits);
    limits
}

/// Whether `found` counts requests in flight (`algorithm: concurrency`).
fn in_flight(found: &EnvoyMatch) -> bool {
    found.limit.algorithm.is_some_and(|a| a.releases())
}

/// An outcome report (`ratelimitd.outcome` last of the descriptor's `n`
/// entries) fed to the adaptive limit its other entries find, if the
/// caller may report; nothing counted, no limit for the descriptor.
fn outcome_reported<D: Descriptor>(
    engine: &Engine,
    config: Option<&EnvoyConfig>,
    request: &RlsRequest<'_, D>,
    d: &D,
    (outcome, n): (crate::limiter::adaptive::Outcome, usize),
) -> Option<EnvoyMatch> {
    if !request.may_report {
        engine.inner.stats.adjusted(Api::Envoy, "outcome_not_allowed");
        return None;
    }
    // Reported to the limit its other entries find; nothing counted.
    let found = config?.lookup(request.domain, d.entries().take(n - 1));
    if let Some(limit) = found.as_ref().and_then(|f| f.limit.adaptive.as_deref()) {
        // The reporter is the counter its other entries name: its
        // report weighs what that counter was admitted.
        let reporter = Reporter(request.domain, d.entries().take(n - 1));
        limit.record(reporter, outcome, None, hits_of(request, d).max(1));
    }
    None
}

/// The limit of requests in flight that a release descriptor's other
/// `entries` find, marked released; none (adjusted, nothing counted) for a
/// caller that may not report (a release frees slots others wait for) or
/// for a limit that does not count requests in flight.
fn released<'e, D: Descriptor>(
    engine: &Engine,
    config: Option<&EnvoyConfig>,
    request: &RlsRequest<'_, D>,
    entries: impl Iterator<Item = (&'e str, &'e str)> + Clone,
) -> Option<EnvoyMatch> {
    if !request.may_report {
        engine.inner.stats.adjusted(Api::Envoy, "release_not_allowed");
        return None;
    }
    let found = config?.lookup(request.domain, entries)?;
    if !in_flight(&found) {
        engine.inner.stats.adjusted(Api::Envoy, "release_not_in_flight");
        return None;
    }
    Some(EnvoyMatch { role: Role::Released, ..found })
}

/// Drops every named limit of `limits` another of them replaces.
fn drop_replaced(limits: &mut [Option<EnvoyMatch>]) {
    // The limits are `Arc`s: collecting the replacing ones clones pointers.
    let replacing: Vec<Arc<EnvoyLimit>> = limits
        .iter()
        .flatten()
        .filter(|m| !m.limit.replaces.is_empty())
        .map(|m| Arc::clone(&m.limit))
        .collect();
    if replacing.is_empty() {
        return;
    }
    for slot in limits {
        let replaced = slot
            .as_ref()
            .and_then(|m| m.limit.name.as_deref())
            .is_some_and(|name| replacing.iter().any(|r| r.replaces.iter().any(|x| x == name)));
        if replaced {
            *slot = None;
        }
    }
}

/// A limit the request supplies for descriptor `d` of `domain`, under
/// the fixed label (no request can mint a metric series) or, for
/// upstream's metrics, the key upstream names it by (its entries).
fn requested_limit<D: Descriptor>(
    engine: &Engine,
    domain: &str,
    d: &D,
    requested: LimitOverride,
) -> EnvoyMatch {
    EnvoyMatch {
        limit: Arc::new(EnvoyLimit::bare(
            Arc::clone(&engine.override_label),
            requested.requests_per_unit,
            requested.unit,
            1,
        )),
        shared: Vec::new(),
        stat_key: engine.inner.envoy_policy.upstream_metrics.then(|| request_stat_key(domain, d.entries())),
        role: Role::Counted,
    }
}

/// How each descriptor is decided, the counters of the one store call
/// (`hits`: a descriptor's hits), and what each counter's descriptor is
/// ([`Role`]; empty when every one is [`Role::Counted`]).
pub(super) fn plans<D: Descriptor>(
    engine: &Engine,
    descriptors: &[D],
    limits: Vec<Option<EnvoyMatch>>,
    hits: impl Fn(&D) -> u64,
) -> (Vec<Plan>, Vec<ManyItem>, Vec<Role>) {
    let mut items = Vec::new();
    // Only a request that reserves, settles or releases keeps its roles:
    // the others allocate nothing for them.
    let marked = limits.iter().flatten().any(|found| found.role != Role::Counted);
    let mut roles = Vec::new();
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
                push_items(engine, &found, descriptor, hits(descriptor), &mut items);
                if marked {
                    roles.resize(items.len(), found.role);
                }
                Plan::Limited(found.limit, first, found.stat_key)
            }
        })
        .collect();
    (plans, items, roles)
}

/// The counters of a descriptor with a limit (`found`) and `hits`: one
/// per limit, the limit's then its `also` limits' (their keys are
/// `<seconds>+<slot>|…`, never a first limit's `<seconds>|…`), pushed onto
/// `items`. The entries are encoded once, and a digested entry counted
/// once per descriptor.
fn push_items<D: Descriptor>(
    engine: &Engine,
    found: &EnvoyMatch,
    descriptor: &D,
    hits: u64,
    items: &mut Vec<ManyItem>,
) {
    let first = &found.limit;
    let policy = &engine.inner.envoy_policy;
    let seconds = |limit: &EnvoyLimit| limit.window_seconds().expect("a limited limit has a unit");
    // A release, a reservation and a settlement name their counter by
    // their other entries.
    let named = if found.role == Role::Counted { usize::MAX } else { descriptor.entries().count() - 1 };
    let (raw, mut digested) = raw_counter_key(
        seconds(first),
        descriptor.entries().take(named),
        &found.shared,
        policy.max_value_bytes,
    );
    let entries_at = raw.find('|').unwrap_or(raw.len());
    let mut keys = Vec::with_capacity(first.also.len() + 1);
    for (slot, also) in first.also.iter().enumerate() {
        let (key, whole) = bounded_key(format!("{}+{}{}", seconds(also), slot + 1, &raw[entries_at..]));
        digested |= whole;
        keys.push(key);
    }
    let (key, whole) = bounded_key(raw);
    if digested || whole {
        engine.inner.stats.adjusted(Api::Envoy, "entry_digest");
    }
    for (slot, key) in std::iter::once(key).chain(keys).enumerate() {
        let limit = first.limit_at(slot);
        let seconds = seconds(limit);
        let (weight, count) = counting(found, limit, hits, policy);
        // A global limit is enforced at this region's grant for the counter.
        let per_unit = match engine.inner.grants.as_deref() {
            Some(grants) if slot == 0 && limit.global => {
                // Claimed by another deployment: a limit of 0 (a descriptor's
                // counter holds it, as `requests_per_unit: 0`).
                let grant = grants.limit(&limit.full_key, &key, u64::from(limit.per_unit())).unwrap_or(0);
                u32::try_from(grant).unwrap_or(u32::MAX)
            }
            _ => limit.per_unit(),
        };
        items.push(ManyItem {
            key,
            params: params(seconds, per_unit, limit.algorithm.unwrap_or(policy.algorithm)),
            tick_ms: tick_ms(seconds),
            weight,
            count,
            // Neither blocks the others: shadow never denies, and a quota
            // descriptor denies only together with all others.
            shadow: policy.shadow(first) || policy.quota(first),
            clock: None,
            refund: None,
        });
    }
}

/// A counter's weight and how it counts, for `hits` of a descriptor that
/// found `found` (`limit`, one of its limits): `hits_addend: 0` asks
/// whether one more hit fits (or, as upstream, whether the count is within
/// the limit) and counts nothing, as a `peek_mode` limit asks of its hits;
/// a `report_mode` limit counts hits whatever is left (a release gives
/// them back), and with `count_every_hit` an admission is counted even
/// when denied.
fn counting(found: &EnvoyMatch, limit: &EnvoyLimit, hits: u64, policy: &EnvoyPolicy) -> (u64, Count) {
    match hits {
        hits if found.role.reports() => (hits, Count::Always),
        0 => (u64::from(!policy.zero_hits_within_limit), Count::Never),
        hits if limit.peek_mode => (hits, Count::Never),
        hits if limit.report_mode => (hits, Count::Always),
        hits if policy.count_every_hit => (hits, Count::Anyway),
        hits => (hits, Count::IfFits),
    }
}

/// The overload layer over every counted admission whose limit has a
/// directive: `Some(retry_after_ms)` when one of them is dropped (then
/// nothing is counted). A shadow limit's drop is only counted.
pub(super) fn overload<D: Descriptor>(
    engine: &Engine,
    request: &RlsRequest<'_, D>,
    plans: &[Plan],
    items: &[ManyItem],
) -> Option<u64> {
    let overload = engine.inner.overload.as_ref()?;
    let mut tenant_of = None;
    for plan in plans {
        let Plan::Limited(limit, index, _) = plan else { continue };
        // Admissions only: not a 0-hit check, not a usage report.
        if limit.overload.is_none() || matches!(items[*index].count, Count::Never | Count::Always) {
            continue;
        }
        let tenant = *tenant_of.get_or_insert_with(|| tenant(engine, request));
        let shadow = engine.inner.envoy_policy.shadow(limit);
        if let OverloadVerdict::Drop { retry_after_ms } =
            overload.check(Kind::Envoy, &limit.full_key, tenant, shadow)
        {
            return Some(retry_after_ms);
        }
    }
    None
}

/// An Envoy request's tenant (for the overload layer and the tenants'
/// shares of the store): the value of the first descriptor entry keyed
/// `overload.tenant_descriptor_key`.
pub(super) fn tenant<'r, D: Descriptor>(engine: &Engine, request: &RlsRequest<'r, D>) -> Option<&'r str> {
    let key = engine.inner.tenants.descriptor_key.as_str();
    request.descriptors.iter().flat_map(Descriptor::entries).find(|(k, _)| *k == key).map(|(_, v)| v)
}
