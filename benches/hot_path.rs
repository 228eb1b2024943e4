//! Criterion benches of the decision hot path, with a heap allocation count
//! per operation (a counting global allocator wraps the system one).
//!
//!   cargo bench --bench hot_path
//!
//! Scenarios: request validation, rule lookup in a 10,000-rule snapshot plus
//! the shedding check, the window arithmetic, one in-memory store decision,
//! a whole `Engine::check` on the in-memory store, and Envoy's
//! `ShouldRateLimit` handler (conversion, engine, response) on it.

// The allocation counts are this bench's report, printed beside criterion's.
#![allow(clippy::print_stdout)]

mod common;

use common::allocations_per_call;

use std::{collections::HashMap, hint::black_box, sync::Arc, time::Duration};

use criterion::{Criterion, criterion_group, criterion_main};
use ratelimitd::{
    api::{
        EnvoyService,
        envoy_pb::{
            envoy::extensions::common::ratelimit::v3::{RateLimitDescriptor, rate_limit_descriptor::Entry},
            rls::{RateLimitRequest as RlsRequest, rate_limit_service_server::RateLimitService as _},
        },
        pb, validate,
    },
    clock::SystemClock,
    config::EnvoySettings,
    decision::{CheckRequest, DecisionMetrics, Engine, EngineParts, EnvoyPolicy},
    dlq::LogSink,
    limiter::{
        Count, MemoryStore, Store,
        window::{self, Algorithm, Counts, WindowParams},
    },
    overload::{Kind, Overload},
    rules::{Hot, RuleStore, envoy::EnvoyConfig},
    shed::{Level, Priority, ShedMode, Shedder},
};

const RULES: usize = 10_000;

/// 10,000 rules: 9,000 exact paths (some per client type) and 1,000 prefixes
/// of varied lengths, loaded through the real YAML loader.
fn snapshot() -> ratelimitd::rules::Snapshot {
    let dir = std::env::temp_dir().join(format!("ratelimitd-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut yaml = String::from("rules:\n");
    for i in 0..RULES {
        let (path, client) = if i < 9_000 {
            (
                format!("/api/v1/service-{}/resource-{i}", i % 97),
                if i % 3 == 0 { "ANDROID_MOBILE" } else { "" },
            )
        } else {
            (format!("/static/{}{}*", "x".repeat(i % 40), i), "")
        };
        yaml += &format!("  - {{ rule_id: r{i}, resource_path: {path:?}, limit: 100, window_seconds: 60");
        if !client.is_empty() {
            yaml += &format!(", client_type: {client}");
        }
        yaml += " }\n";
    }
    let file = dir.join("rules.yaml");
    std::fs::write(&file, yaml).unwrap();
    let snapshot = ratelimitd::rules::load(&file, ratelimitd::rules::PathForm::default()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(snapshot.rules().len(), RULES);
    snapshot
}

fn benches(c: &mut Criterion) {
    let snapshot = snapshot();
    let shedder = Shedder::new(ShedMode::Enforce, 1_000);
    let paths: Vec<String> = (0..1_024)
        .map(|i| match i % 4 {
            0 => format!("/api/v1/service-{}/resource-{}", (i * 7) % 97, (i * 7) % 9_000),
            1 => format!("/static/{}{}/file.css", "x".repeat((9_000 + i) % 40), 9_000 + i % 1_000),
            2 => "/nowhere/at/all".to_owned(),
            _ => format!("/api/v1/service-{}/resource-{}", i % 97, i % 9_000),
        })
        .collect();

    let mut i = 0;
    let lookup_and_shed = |i: &mut usize| {
        let path = &paths[*i % paths.len()];
        *i += 1;
        let rule = snapshot.lookup(path, Some("ANDROID_MOBILE"));
        let priority = rule.map_or(Priority::Degraded, |r| r.priority);
        black_box(shedder.check(black_box(Level::Degraded), priority));
        black_box(rule);
    };
    c.bench_function("lookup + shedding check, 10k rules", |b| b.iter(|| lookup_and_shed(&mut i)));
    let allocs = allocations_per_call(100_000, || lookup_and_shed(&mut i));
    println!("lookup + shedding check, 10k rules: {allocs} allocations per call");

    // The overload layer's hot path: bucket lookup (rule, tenant), one
    // atomic add, the coin against a drop ratio of 2/3.
    let overload = overload_layer();
    let mut n = 0u64;
    let tenants = ["acme", "free", "unknown"];
    let mut overload_check = || {
        n += 1;
        let tenant = tenants[(n % 3) as usize];
        black_box(overload.check(Kind::Native, black_box("hot"), Some(tenant), false));
    };
    c.bench_function("overload check (bucket + coin)", |b| b.iter(&mut overload_check));
    let allocs = allocations_per_call(100_000, &mut overload_check);
    println!("overload check (bucket + coin): {allocs} allocations per call");

    let params = WindowParams::sliding(60_000, 6_000);
    c.bench_function("window arithmetic (decide)", |b| {
        b.iter(|| {
            window::decide(
                black_box(Counts { current: 4_000, previous: 3_000 }),
                black_box(21_000),
                1,
                params,
            )
        })
    });

    let request = pb::RateLimitRequest {
        user_id: "user-123456".to_owned(),
        resource_path: "/api/v1/service-49/resource-49".to_owned(),
        client_type: "ANDROID_MOBILE".to_owned(),
        weight: 1,
        priority: 2,
        headers: HashMap::from([("x-request-id".to_owned(), "r-1".to_owned())]),
        ..Default::default()
    };
    c.bench_function("request validation", |b| {
        b.iter(|| black_box(validate(black_box(&request), None)).is_ok())
    });
    let allocs = allocations_per_call(100_000, || {
        black_box(validate(&request, None).is_ok());
    });
    println!("request validation: {allocs} allocations per call");

    let memory = Arc::new(MemoryStore::new(64, 1_000_000, Arc::new(SystemClock)));
    let rule = snapshot.lookup("/api/v1/service-49/resource-49", None).unwrap().clone();
    let big =
        ratelimitd::rules::Rule { window: WindowParams::sliding(60_000, u64::MAX >> 40), ..rule.clone() };
    c.bench_function("memory store decide (known counter)", |b| {
        b.iter(|| memory.decide(black_box("user-1"), big.counter(), 1, Count::IfFits))
    });
    let allocs = allocations_per_call(100_000, || {
        let _ = black_box(memory.decide("user-1", big.counter(), 1, Count::IfFits));
    });
    println!("memory store decide (known counter): {allocs} allocations per call");
    // The other algorithms, each on a counter of its own.
    for algorithm in [Algorithm::FixedWindow, Algorithm::TokenBucket, Algorithm::Gcra] {
        let capacity = u64::MAX >> 40;
        let window = WindowParams { window_ms: 60_000, capacity, rate: capacity, algorithm };
        let rule = ratelimitd::rules::Rule { id: algorithm.as_str().into(), window, ..rule.clone() };
        let name = format!("memory store decide (known counter, {})", algorithm.as_str());
        c.bench_function(&name, |b| {
            b.iter(|| memory.decide(black_box("user-1"), rule.counter(), 1, Count::IfFits))
        });
        let allocs = allocations_per_call(100_000, || {
            let _ = black_box(memory.decide("user-1", rule.counter(), 1, Count::IfFits));
        });
        println!("{name}: {allocs} allocations per call");
    }

    // The whole decision path on the in-memory store (no gRPC).
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let rules = Arc::new(RuleStore::new(snapshot));
    let envoy = Arc::new(Hot::new(envoy_config()));
    // As served: with an Envoy configuration, envoyproxy/ratelimit's
    // families are counted too (`envoy.upstream_metrics`, on by default).
    let engine_with = |upstream: bool| {
        let metrics = DecisionMetrics::new("memory");
        Engine::new(EngineParts {
            envoy: Some(Arc::clone(&envoy)),
            shedder: Arc::new(Shedder::new(ShedMode::Enforce, 1_000)),
            failures: Arc::new(LogSink::default()),
            stats: Arc::new(if upstream {
                metrics.with_upstream(10_000, Some(Arc::clone(&envoy)))
            } else {
                metrics
            }),
            envoy_policy: EnvoyPolicy { upstream_metrics: upstream, ..EnvoyPolicy::default() },
            ..EngineParts::new(Arc::clone(&rules), Store::Memory(Arc::clone(&memory)))
        })
    };
    let engine = engine_with(true);
    let headers = HashMap::new();
    let check = CheckRequest::new("user-2", "/api/v1/service-49/resource-49", &headers);
    c.bench_function("Engine::check, memory store", |b| {
        b.iter(|| runtime.block_on(engine.check(black_box(&check))))
    });
    let allocs = allocations_per_call(100_000, || {
        black_box(runtime.block_on(engine.check(&check)));
    });
    println!("Engine::check, memory store: {allocs} allocations per decision");

    // Envoy's ShouldRateLimit through the handler (validation, conversion,
    // the engine, the response), in memory, no network: two descriptors,
    // one counted.
    let service = EnvoyService::new(engine.clone(), EnvoySettings::default());
    let envoy_request = RlsRequest {
        domain: "bench".to_owned(),
        descriptors: vec![
            RateLimitDescriptor {
                entries: vec![
                    Entry { key: "remote_address".to_owned(), value: "10.0.0.1".to_owned() },
                    Entry { key: "path".to_owned(), value: "/api/v1/items".to_owned() },
                ],
                ..Default::default()
            },
            RateLimitDescriptor {
                entries: vec![Entry { key: "unmatched".to_owned(), value: "x".to_owned() }],
                ..Default::default()
            },
        ],
        hits_addend: 1,
    };
    c.bench_function("ShouldRateLimit handler, memory store", |b| {
        b.iter(|| {
            runtime.block_on(service.should_rate_limit(tonic::Request::new(black_box(envoy_request.clone()))))
        })
    });
    let allocs = allocations_per_call(100_000, || {
        let _ = black_box(
            runtime.block_on(service.should_rate_limit(tonic::Request::new(envoy_request.clone()))),
        );
    });
    println!(
        "ShouldRateLimit handler, memory store: {allocs} allocations per request (request clone included)"
    );
    // The same without envoyproxy/ratelimit's families: their cost.
    let service = EnvoyService::new(engine_with(false), EnvoySettings::default());
    c.bench_function("ShouldRateLimit handler, memory store, upstream metrics off", |b| {
        b.iter(|| {
            runtime.block_on(service.should_rate_limit(tonic::Request::new(black_box(envoy_request.clone()))))
        })
    });
}

/// An overload layer with one directive over a tenant table of two,
/// dropping 2/3 of every bucket.
fn overload_layer() -> Arc<Overload> {
    use ratelimitd::{
        config::OverloadMode,
        overload::feed::{Feed, Settings, Sources, View},
        rules::tenants,
    };
    let rules = ratelimitd::rules::from_text(
        std::path::Path::new("bench.yaml"),
        "rules:\n  - { rule_id: hot, resource_path: /hot, limit: 1000, window_seconds: 1, overload: { rate_per_second: 100 } }\n",
        ratelimitd::rules::PathForm::default(),
    )
    .unwrap();
    let table =
        tenants::parse(std::path::Path::new("t.yaml"), "tenants: [{name: acme, weight: 4}, {name: free}]")
            .unwrap();
    let overload = Arc::new(Overload::new(OverloadMode::Enforce, 500));
    let sources =
        Sources { rules: Arc::new(Hot::new(rules)), envoy: None, tenants: Some(Arc::new(Hot::new(table))) };
    let settings = Settings { mode: OverloadMode::Enforce, interval_ms: 500, max_staleness_ms: 30_000 };
    let mut feed = Feed::new(Arc::clone(&overload), sources, settings, 0);
    let counts = ["native|hot|acme", "native|hot|free", "native|hot|*"].map(|f| (f.to_owned(), 100));
    feed.apply(1, Ok(View { counts: counts.into_iter().collect(), mode: None }));
    overload
}

/// One domain with a nested limit that never fills during the bench.
fn envoy_config() -> EnvoyConfig {
    let dir = std::env::temp_dir().join(format!("ratelimitd-bench-envoy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bench.yaml");
    std::fs::write(
        &file,
        "domain: bench\ndescriptors:\n  - key: remote_address\n    descriptors:\n      - key: path\n        rate_limit: { unit: hour, requests_per_unit: 4000000000 }\n",
    )
    .unwrap();
    let config = ratelimitd::rules::envoy::load_sliding(&file).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    config
}

criterion_group! {
    name = hot_path;
    config = Criterion::default().measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_secs(1));
    targets = benches
}
criterion_main!(hot_path);
