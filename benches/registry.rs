//! Counting one decision in this service's registry (`DecisionMetrics::decision`: a
//! borrowed key looked up in a foldhash map behind a read lock, then one
//! atomic add) against the well-kept `prometheus-client` crate (a `Family`
//! of counters keyed by an owned label set, which a decision must build from
//! its rule id), side by side, with heap allocations per call. 100 rules
//! cycled, as a service with that many rules sees them.
//!
//!   cargo bench --bench registry

// The allocation counts are this bench's report, printed beside criterion's.
#![allow(clippy::print_stdout)]

mod common;

use common::allocations_per_call;

use std::{fmt::Write as _, hint::black_box, sync::Arc, time::Duration};

use criterion::{Criterion, criterion_group, criterion_main};
use prometheus_client::{
    encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder},
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};
use ratelimitd::decision::{Api, DecisionMetrics, Stats as _};

/// A rule id as a label value: the decision's `Arc<str>`, shared.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Rule(Option<Arc<str>>);

impl EncodeLabelValue for Rule {
    fn encode(&self, encoder: &mut LabelValueEncoder<'_>) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.0.as_deref().unwrap_or(""))
    }
}

/// `ratelimitd_decisions_total`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Decision {
    api: &'static str,
    rule: Rule,
    reason: &'static str,
    allowed: bool,
}

fn benches(c: &mut Criterion) {
    let rules: Vec<Arc<str>> = (0..100).map(|i| Arc::from(format!("rule-{i}"))).collect();

    let ours = DecisionMetrics::new("memory");
    let mut i = 0;
    let mut count_ours = || {
        i = (i + 1) % rules.len();
        ours.decision(Api::Check, Some(&rules[i]), "OK", black_box(true));
    };
    (0..1_000).for_each(|_| count_ours());
    c.bench_function("registry/ours/decision", |b| b.iter(&mut count_ours));
    let ours_allocs = allocations_per_call(10_000, &mut count_ours);

    let family = Family::<Decision, Counter>::default();
    let mut registry = Registry::default();
    registry.register("ratelimitd_decisions", "Decisions.", family.clone());
    let mut j = 0;
    let mut count_theirs = || {
        j = (j + 1) % rules.len();
        let labels = Decision {
            api: "check",
            rule: Rule(Some(Arc::clone(&rules[j]))),
            reason: "OK",
            allowed: black_box(true),
        };
        family.get_or_create(&labels).inc();
    };
    (0..1_000).for_each(|_| count_theirs());
    c.bench_function("registry/prometheus-client/decision", |b| b.iter(&mut count_theirs));
    let theirs_allocs = allocations_per_call(10_000, &mut count_theirs);

    println!("allocations per decision counted: ours {ours_allocs}, prometheus-client {theirs_allocs}");
}

criterion_group! {
    name = registry;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = benches
}
criterion_main!(registry);
