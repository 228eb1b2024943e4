//! limitador's decision: the limits of the request's namespace (its
//! domain) whose CEL conditions hold and whose variables resolve
//! ([`Limits::applying`]), each one counter, decided together as one
//! `ShouldRateLimit` is (all or nothing, shedding, overload, the failure
//! policy with its dead-letter record, metrics), each applied limit
//! standing as a descriptor of its own: `limitador` = the limit's identity,
//! then each variable = its value. Those entries are the counter's key, so
//! the same limit and values share one counter on every instance.

use std::{collections::HashMap, sync::Arc};

use super::{
    Api, Engine, Reason,
    envoy::{self, Descriptor, OwnedDescriptor, RlsDecision, RlsRequest, parse_counter_key},
    limitador_metrics::Outcome,
};
use crate::{
    limiter::{Algorithm, Count, ManyItem, StoreError},
    rules::{
        envoy::{EnvoyMatch, params, tick_ms},
        limitador::{Limit, Limits},
    },
    shed::Level,
};

/// The most counters one listing answers (`GET /counters/{namespace}`).
pub const MAX_LISTED_COUNTERS: usize = 10_000;

/// Counters read per store call of a listing.
const PEEK_BATCH: usize = 64;

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
        matches.push(Some(EnvoyMatch {
            limit: Arc::clone(limit),
            shared: Vec::new(),
            stat_key: None,
            role: crate::rules::envoy::Role::Counted,
        }));
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
    capture(engine, limits, request, call, hits, &decision);
    decision
}

/// Captures `request` as it was asked (its descriptors, its hits: `hits`,
/// else the request's), counted as `call` counts, for the publish gate
/// to replay through limitador's limits. Hits beyond `u32::MAX` are
/// captured as that many.
fn capture<D: Descriptor>(
    engine: &Engine,
    limits: &Limits,
    request: &RlsRequest<'_, D>,
    call: Call,
    hits: Option<u64>,
    decision: &RlsDecision,
) {
    let count = match call {
        Call::Admit => Count::IfFits,
        Call::Check => Count::Never,
        Call::Report => Count::Always,
    };
    let hits = hits.map_or(request.hits_addend, |h| u32::try_from(h).unwrap_or(u32::MAX));
    let version = || crate::rules::Versioned::version(limits).to_owned();
    envoy::capture_as(engine, request, hits, count, decision, version);
}

/// See [`Engine::limitador_counted`]. A refused call counts under the
/// name of its first limit over (none when no limit refused it: an
/// unevaluable request, shedding).
pub(super) fn counted(engine: &Engine, namespace: &str, call: Call, decision: &RlsDecision, hits: u64) {
    if decision.failure.is_some() {
        return;
    }
    let outcome = match call {
        Call::Report => Outcome::Reported { hits },
        _ if decision.over_limit => {
            let over = decision.statuses.iter().find(|s| s.over_limit).and_then(|s| s.limit.as_ref());
            Outcome::Limited { limit: over.and_then(|l| l.name.as_deref()) }
        }
        Call::Admit => Outcome::Authorized { hits: Some(hits) },
        Call::Check => Outcome::Authorized { hits: None },
    };
    engine.inner.stats.limitador(namespace, outcome);
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
        reservation: None,
    }
}

/// A counter's variables (sorted) and their values.
pub type Variables = Vec<(String, String)>;

/// One counter of a namespace, as limitador lists it.
#[derive(Debug)]
pub struct Counter<'l> {
    /// Its limit.
    pub limit: &'l Limit,
    /// Each variable of the limit (sorted) and its value (a value counted
    /// by its digest reads `#sha256:…`).
    pub variables: Variables,
    /// Hits left in its window.
    pub remaining: u64,
    /// Until its window ends (a first-hit or fixed window), or until one
    /// more hit would be admitted after a full one frees (a sliding window).
    pub reset_after_ms: u64,
}

/// A namespace's counters ([`Engine::limitador_counters`]).
#[derive(Debug, Default)]
pub struct Counters<'l> {
    /// Those that hold hits, in the file's order of their limits, then by
    /// their variables' values.
    pub counters: Vec<Counter<'l>>,
    /// Every counter of the namespace was read: the store's listing was
    /// complete (see [`crate::limiter::Listed`]) and held at most
    /// [`MAX_LISTED_COUNTERS`].
    pub complete: bool,
    /// Counters of the namespace that name none of its limits: a limit
    /// since removed from the file, or a key too long to keep (counted by
    /// its digest as a whole).
    pub unnamed: usize,
}

/// Reads `namespace`'s counters; see [`Engine::limitador_counters`].
pub(super) async fn counters<'l>(
    engine: &Engine,
    limits: &'l Limits,
    namespace: &str,
) -> Result<Counters<'l>, StoreError> {
    let of_namespace = limits.of(namespace);
    if of_namespace.is_empty() {
        // No limit, no counter to name: the store is not asked.
        return Ok(Counters { counters: Vec::new(), complete: true, unnamed: 0 });
    }
    let store = &engine.inner.store;
    let listed = store.list(namespace, "", MAX_LISTED_COUNTERS).await?;
    let by_identity: HashMap<&str, (usize, &Limit)> =
        of_namespace.iter().enumerate().map(|(at, l)| (&*l.identity, (at, l))).collect();
    let mut found = Vec::with_capacity(listed.keys.len());
    let mut unnamed = 0;
    for key in &listed.keys {
        match named(key, &by_identity) {
            Some((at, limit, variables)) => found.push((at, limit, variables, key)),
            None => unnamed += 1,
        }
    }
    found.sort_by(|a, b| (a.0, &a.2).cmp(&(b.0, &b.2)));
    let algorithm = engine.inner.envoy_policy.algorithm;
    let mut counters = Vec::with_capacity(found.len());
    let mut rest = found.into_iter().peekable();
    while rest.peek().is_some() {
        let batch: Vec<_> = rest.by_ref().take(PEEK_BATCH).collect();
        let items: Vec<ManyItem> =
            batch.iter().map(|(_, limit, _, key)| peek(limit, key, algorithm)).collect();
        let outcome = store.decide_many(namespace, &items).await?;
        for ((_, limit, variables, _), verdict) in batch.into_iter().zip(outcome.verdicts) {
            // A counter whose hits have all left its window holds nothing.
            if verdict.remaining < limit.max_value {
                let (remaining, reset_after_ms) = (verdict.remaining, verdict.reset_after_ms);
                counters.push(Counter { limit, variables, remaining, reset_after_ms });
            }
        }
    }
    Ok(Counters { counters, complete: listed.complete, unnamed })
}

/// A read of `limit`'s counter at `key` that counts nothing (`algorithm`:
/// `envoy.algorithm`, for a limit without one).
fn peek(limit: &Limit, key: &str, algorithm: Algorithm) -> ManyItem {
    let algorithm = limit.envoy.algorithm.unwrap_or(algorithm);
    ManyItem {
        key: key.to_owned(),
        params: params(limit.seconds, limit.envoy.per_unit(), algorithm),
        tick_ms: tick_ms(limit.seconds),
        weight: 0,
        count: Count::Never,
        shadow: false,
        clock: None,
        refund: None,
    }
}

/// The limit (its position in the namespace) and the variables of a
/// limitador counter's `key`, when it names one of `limits`.
fn named<'l>(key: &str, limits: &HashMap<&str, (usize, &'l Limit)>) -> Option<(usize, &'l Limit, Variables)> {
    let (seconds, entries) = parse_counter_key(key)?;
    let mut entries = entries.into_iter();
    let (name, identity) = entries.next()?;
    let &(at, limit) = limits.get(&*identity).filter(|(_, l)| name == LIMIT_ENTRY && l.seconds == seconds)?;
    let variables: Variables = entries.map(|(k, v)| (k.into_owned(), v.into_owned())).collect();
    limit.variables().eq(variables.iter().map(|(k, _)| k.as_str())).then_some((at, limit, variables))
}
