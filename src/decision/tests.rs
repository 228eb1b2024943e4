//! Unit tests of the engine's own choices: how an Envoy request's priority
//! is resolved. The reasons each entry point gives, on both stores, are
//! tested in `tests/engine.rs` (no gRPC, real Redis).

use std::{collections::HashMap, path::Path, sync::Arc};

use super::*;
use crate::{
    dlq::LogSink,
    limiter::{ManualClock, MemoryStore},
    rules,
    shed::ShedMode,
};

fn engine(policy: EnvoyPolicy) -> Engine {
    Engine::new(EngineParts {
        rules: Arc::new(RuleStore::new(rules::empty())),
        envoy: None,
        store: Store::Memory(Arc::new(MemoryStore::new(1, Arc::new(ManualClock::new(0))))),
        shedder: Arc::new(Shedder::new(ShedMode::Enforce, 1_000)),
        failures: Arc::new(LogSink::default()),
        stats: Arc::new(NoStats),
        default_priority: Priority::Degraded,
        max_user_id_bytes: 256,
        envoy_policy: policy,
    })
}

fn descriptors<'a>(entries: &[&[(&'a str, &'a str)]]) -> Vec<RlsDescriptor<'a>> {
    entries.iter().map(|e| RlsDescriptor { entries: e.to_vec(), ..RlsDescriptor::default() }).collect()
}

fn request<'a>(domain: &'a str, descriptors: &'a [RlsDescriptor<'a>]) -> RlsRequest<'a, RlsDescriptor<'a>> {
    RlsRequest { domain, descriptors, hits_addend: 1, trace_id: None }
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
        engine.rls_priority(&request(domain, &descriptors))
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
    assert_eq!(engine.rls_priority(&request("d", &descriptors)), Priority::Degraded);
}

#[test]
fn the_embedded_rules_compile() {
    let snapshot = rules::embedded().unwrap();
    assert!(!snapshot.rules().is_empty());
    assert!(snapshot.rules().iter().all(|r| r.source.starts_with(Path::new("examples/rules"))));
}
