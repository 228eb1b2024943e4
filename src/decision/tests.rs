//! Unit tests of the engine's own choices: how an Envoy request's priority
//! is resolved. The reasons each entry point gives, on both stores, are
//! tested in `tests/engine.rs` (no gRPC, real Redis).

use std::{collections::HashMap, path::Path, sync::Arc};

use super::*;
use crate::{
    limiter::{ManualClock, MemoryStore},
    rules,
    shed::ShedMode,
};

fn engine(policy: EnvoyPolicy) -> Engine {
    engine_trusting(policy, true)
}

fn engine_trusting(policy: EnvoyPolicy, trust_request_priority: bool) -> Engine {
    Engine::new(EngineParts { trust_request_priority, ..parts(policy) })
}

/// An engine's parts on no rules, the memory store and the manual clock at 0.
fn parts(policy: EnvoyPolicy) -> EngineParts {
    let store = Store::Memory(Arc::new(MemoryStore::new(1, 1_000, Arc::new(ManualClock::new(0)))));
    EngineParts {
        local: Arc::new(crate::limiter::local::LocalLimiter::new(
            Default::default(),
            Arc::new(ManualClock::new(0)),
        )),
        shedder: Arc::new(Shedder::new(ShedMode::Enforce, 1_000)),
        envoy_policy: policy,
        ..EngineParts::new(Arc::new(RuleStore::new(rules::empty())), store)
    }
}

fn descriptors<'a>(entries: &[&[(&'a str, &'a str)]]) -> Vec<RlsDescriptor<'a>> {
    entries.iter().map(|e| RlsDescriptor { entries: e.to_vec(), ..RlsDescriptor::default() }).collect()
}

fn request<'a>(domain: &'a str, descriptors: &'a [RlsDescriptor<'a>]) -> RlsRequest<'a, RlsDescriptor<'a>> {
    RlsRequest { domain, descriptors, hits_addend: 1, trace_id: None, share: None, may_report: true }
}

#[test]
fn envoy_priority_comes_from_an_entry_then_the_domain_then_the_default() {
    let policy = EnvoyPolicy {
        domain_priority: HashMap::from([("checkout".to_owned(), Priority::Critical)]),
        ..EnvoyPolicy::default()
    };
    let engine = engine(policy);
    let priority = |domain: &str, entries: &[&[(&str, &str)]]| {
        let descriptors = descriptors(entries);
        super::envoy::priority(&engine, &request(domain, &descriptors))
    };
    // An entry anywhere in any descriptor, any case.
    assert_eq!(priority("other", &[&[("path", "/a")], &[("priority", "bulk")]]), Priority::Bulk);
    // The entry beats the domain's default.
    assert_eq!(priority("checkout", &[&[("priority", "BEST_EFFORT")]]), Priority::BestEffort);
    assert_eq!(priority("checkout", &[&[("path", "/a")]]), Priority::Critical);
    // Unknown values and other domains fall back; never an error.
    assert_eq!(priority("other", &[&[("priority", "URGENT")]]), Priority::Degraded);
    // The first valid entry wins.
    assert_eq!(
        priority("other", &[&[("priority", "nope")], &[("priority", "CRITICAL")], &[("priority", "BULK")]]),
        Priority::Critical
    );
}

#[test]
fn an_empty_priority_key_ignores_entries() {
    let engine = engine(EnvoyPolicy { priority_key: String::new(), ..EnvoyPolicy::default() });
    let descriptors = descriptors(&[&[("priority", "CRITICAL")], &[("", "BULK")]]);
    assert_eq!(super::envoy::priority(&engine, &request("d", &descriptors)), Priority::Degraded);
}

/// With `shed.trust_request_priority` off a request may lower its priority,
/// never raise it, on both entry points.
#[tokio::test]
async fn an_untrusted_request_priority_only_lowers() {
    let engine = engine_trusting(EnvoyPolicy::default(), false);
    let stated = |priority: &'static str| {
        let descriptors = descriptors(&[&[("priority", priority)]]);
        super::envoy::priority(&engine, &request("d", &descriptors))
    };
    assert_eq!(stated("CRITICAL"), Priority::Degraded, "cannot rise above the default");
    assert_eq!(stated("BULK"), Priority::Bulk, "may lower");
    let headers = HashMap::new();
    let check =
        |priority| CheckRequest { priority: Some(priority), ..CheckRequest::new("u", "/p", &headers) };
    assert_eq!(engine.check(&check(Priority::Critical)).await.priority, Priority::Degraded);
    assert_eq!(engine.check(&check(Priority::BestEffort)).await.priority, Priority::BestEffort);
    let trusting = engine_trusting(EnvoyPolicy::default(), true);
    assert_eq!(trusting.check(&check(Priority::Critical)).await.priority, Priority::Critical);
}

#[test]
fn the_embedded_rules_compile() {
    let snapshot = rules::embedded(rules::PathForm::default()).unwrap();
    assert!(!snapshot.rules().is_empty());
    assert!(snapshot.rules().iter().all(|r| r.source.starts_with(Path::new("examples/rules"))));
}

fn verdict(admitted: bool, remaining: u64) -> crate::limiter::Verdict {
    crate::limiter::Verdict { admitted, remaining, retry_after_ms: None, reset_after_ms: 0 }
}

#[test]
fn limit_hits_split_near_and_over_as_upstream() {
    // Limit 10, near at floor(10 × 0.8) = 8.
    let of = |hits, admitted, remaining, shadow| {
        LimitHits::of(10, hits, &verdict(admitted, remaining), shadow, 0.8)
    };
    // 5 → 6 used: within only.
    assert_eq!(of(1, true, 4, false), LimitHits { total: 1, within: 1, ..LimitHits::default() });
    // 7 → 9 used: one of the two hits past 8.
    assert_eq!(of(2, true, 1, false), LimitHits { total: 2, within: 2, near: 1, ..LimitHits::default() });
    // 9 → 10 used: all past 8.
    assert_eq!(of(1, true, 0, false), LimitHits { total: 1, within: 1, near: 1, ..LimitHits::default() });
    // Refused: every hit over; in shadow mode also shadow.
    assert_eq!(of(3, false, 0, false), LimitHits { total: 3, over: 3, ..LimitHits::default() });
    assert_eq!(of(1, false, 0, true), LimitHits { total: 1, over: 1, shadow: 1, ..LimitHits::default() });
    // A peek counts nothing.
    assert_eq!(of(0, true, 5, false), LimitHits::default());
}

/// A rule with `also` limits against a model of its two fixed windows: a
/// request is admitted only when it fits both, and a denied one consumes
/// nothing from either ("10 per second and 30 per minute").
mod several_limits {
    use proptest::prelude::*;

    use super::*;
    use crate::clock::Clock as _;

    const RULE: &str = "rules:\n  - { rule_id: both, resource_path: /x, limit: 10, window_seconds: 1, algorithm: fixed_window, also: [ { limit: 30, window_seconds: 60 } ] }\n";

    /// Fixed windows of `window_ms` holding `capacity`.
    #[derive(Default)]
    struct Window {
        start: u64,
        count: u64,
    }

    fn fits(w: &mut Window, now: u64, window_ms: u64, capacity: u64, weight: u64) -> bool {
        let start = now - now % window_ms;
        if w.start != start {
            (w.start, w.count) = (start, 0);
        }
        w.count + weight <= capacity
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn admitted_only_within_every_limit_and_denials_consume_nothing(
            steps in proptest::collection::vec((0u64..700, 1u32..4), 1..150)
        ) {
            let clock = Arc::new(ManualClock::new(6_000_000));
            let rules = rules::from_text(Path::new("r.yaml"), RULE, rules::PathForm::default()).unwrap();
            let engine = Engine::new(EngineParts {
                rules: Arc::new(RuleStore::new(rules)),
                store: Store::Memory(Arc::new(MemoryStore::new(1, 1_000, Arc::clone(&clock) as _))),
                ..parts(EnvoyPolicy::default())
            });
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let (mut second, mut minute) = (Window::default(), Window::default());
            let headers = HashMap::new();
            for (advance, weight) in steps {
                clock.advance(advance);
                let now = clock.now_ms();
                let w = u64::from(weight);
                // Both windows are rolled before either is judged.
                let in_second = fits(&mut second, now, 1_000, 10, w);
                let in_minute = fits(&mut minute, now, 60_000, 30, w);
                let expected = in_second && in_minute;
                let request = CheckRequest { weight, ..CheckRequest::new("u", "/x", &headers) };
                let decision = runtime.block_on(engine.check(&request));
                prop_assert_eq!(decision.allowed, expected, "at {} weight {}: {:?}", now, w, decision);
                if expected {
                    second.count += w;
                    minute.count += w;
                } else if in_second != in_minute {
                    // One limit is over: it is the one that binds.
                    let bound = decision.rule.as_ref().map(|r| r.window_ms);
                    prop_assert_eq!(bound, Some(if in_second { 60_000 } else { 1_000 }), "{:?}", decision);
                }
            }
        }
    }
}

/// limitador's example limits through the engine: every applying limit is
/// counted, all or nothing; a user's POSTs stop at 5 while GETs (the
/// namespace's limit only) go on; an unevaluable request is refused.
#[tokio::test]
async fn limitador_limits_apply_all_or_nothing() {
    let engine = engine(EnvoyPolicy::default());
    let limits = rules::limitador::Limits::parse(
        Path::new("limits.yaml"),
        "- { namespace: ns, max_value: 7, seconds: 60 }\n\
         - { namespace: ns, max_value: 5, seconds: 60, conditions: [\"descriptors[0]['req.method'] == 'POST'\"], \
             variables: [\"descriptors[0]['user_id']\"] }\n\
         - { namespace: ns, max_value: 1, seconds: 60, conditions: [\"descriptors[0].bad\"] }\n",
        crate::limiter::Algorithm::FirstHitWindow,
    )
    .unwrap();
    let decide = |entries: Vec<(&'static str, &'static str)>| {
        let (engine, limits) = (&engine, &limits);
        async move {
            let descriptors = descriptors(&[&entries]);
            engine.limitador(limits, &request("ns", &descriptors), limitador::Call::Admit, None).await
        }
    };
    let post = vec![("req.method", "POST"), ("user_id", "ann")];
    for i in 0..5 {
        let decision = decide(post.clone()).await;
        assert!(!decision.over_limit, "POST {i}: {decision:?}");
        assert_eq!(decision.statuses.len(), 2, "both limits counted");
    }
    let sixth = decide(post.clone()).await;
    assert!(sixth.over_limit && sixth.reason == Reason::OverLimit, "{sixth:?}");
    // Refused as a whole: the namespace's limit took nothing, 2 are left.
    let get = vec![("req.method", "GET"), ("user_id", "ann")];
    assert!(!decide(get.clone()).await.over_limit);
    assert!(!decide(get.clone()).await.over_limit);
    assert!(decide(get).await.over_limit, "7 per minute for the namespace");
    let bad = decide(vec![("bad", "yes")]).await;
    assert!(bad.over_limit, "a condition that is no boolean refuses: {bad:?}");
    // The request's own priority entry is its priority (for shedding).
    let bulk = decide(vec![("req.method", "GET"), ("priority", "BULK")]).await;
    assert_eq!(bulk.priority, Priority::Bulk);
}

/// A namespace's counters: read without counting, in order, bounded; a key
/// that names no limit is counted apart.
#[tokio::test]
async fn limitador_counters_are_listed_in_order_and_bounded() {
    let store = Store::Memory(Arc::new(MemoryStore::new(4, 20_000, Arc::new(ManualClock::new(0)))));
    let engine = Engine::new(EngineParts { store: store.clone(), ..parts(EnvoyPolicy::default()) });
    let limits = rules::limitador::Limits::parse(
        Path::new("limits.yaml"),
        "- { namespace: ns, max_value: 5, seconds: 60, variables: [\"descriptors[0].u\"] }\n",
        crate::limiter::Algorithm::FirstHitWindow,
    )
    .unwrap();
    let report = |user: String, hits: u64| {
        let (engine, limits) = (&engine, &limits);
        async move {
            let entries = [("u", user.as_str())];
            let descriptors = descriptors(&[&entries]);
            engine.limitador(limits, &request("ns", &descriptors), limitador::Call::Report, Some(hits)).await
        }
    };
    report("b".to_owned(), 2).await;
    report("a".to_owned(), 1).await;
    let junk = crate::limiter::ManyItem {
        key: "60|limitador=gone".to_owned(),
        params: crate::limiter::WindowParams::sliding(60_000, 5),
        tick_ms: 1,
        weight: 1,
        count: crate::limiter::Count::IfFits,
        shadow: false,
        clock: None,
        refund: None,
    };
    store.decide_many("ns", &[junk]).await.unwrap();
    let listed = engine.limitador_counters(&limits, "ns").await.unwrap();
    let seen: Vec<(&str, u64, u64)> =
        listed.counters.iter().map(|c| (c.variables[0].1.as_str(), c.remaining, c.reset_after_ms)).collect();
    assert_eq!(seen, [("a", 4, 60_000), ("b", 3, 60_000)]);
    assert_eq!(listed.counters[0].variables[0].0, "descriptors[0].u");
    assert!(listed.complete);
    assert_eq!(listed.unnamed, 1);
    // Reading counted nothing.
    assert_eq!(engine.limitador_counters(&limits, "ns").await.unwrap().counters[0].remaining, 4);
    assert!(engine.limitador_counters(&limits, "other").await.unwrap().counters.is_empty());

    for user in 0..limitador::MAX_LISTED_COUNTERS {
        report(format!("u{user:05}"), 1).await;
    }
    let listed = engine.limitador_counters(&limits, "ns").await.unwrap();
    assert!(!listed.complete);
    assert!(listed.counters.len() + listed.unnamed <= limitador::MAX_LISTED_COUNTERS);
    assert!(listed.counters.len() >= limitador::MAX_LISTED_COUNTERS - 3);
}
