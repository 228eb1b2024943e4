//! The decision engine called directly, without gRPC: every reason both
//! entry points give (`Engine::check` and `Engine::should_rate_limit`),
//! against the in-memory store (on an injected clock) and a real
//! `redis-server`. Store failures are a real Redis stopped mid-test.

mod common;

use std::{
    collections::HashMap,
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use common::{Backend, RedisServer};
use ratelimitd::{
    config::RedisConfig,
    decision::{
        CheckRequest, Decision, DenialCache, Engine, EngineParts, EnvoyFailure, EnvoyPolicy, FailedDecision,
        FailureSink, LimitOverride, Reason, RlsDecision, RlsDescriptor, RlsRequest,
    },
    limiter::{Algorithm, Count, ManualClock, MemoryStore, RedisStore, Store},
    rules::{self, Hot, RuleStore, envoy::Unit},
    shed::{Level, Priority, ShedMode, Shedder},
};
use tokio::task::JoinSet;

const NATIVE: &str = r#"
rules:
  - { rule_id: two, resource_path: /two, priority_bucket: DEGRADED, limit: 2, window_seconds: 60 }
  - { rule_id: bulk, resource_path: /bulk, priority_bucket: BULK, limit: 100, window_seconds: 60 }
  - { rule_id: vip, resource_path: /vip, priority_bucket: CRITICAL, limit: 100, window_seconds: 60 }
  - { rule_id: trial, resource_path: /trial, limit: 1, window_seconds: 60, mode: shadow }
  - { rule_id: closed, resource_path: /closed, limit: 5, window_seconds: 60, failure_policy: closed }
  - { rule_id: open, resource_path: /open, limit: 5, window_seconds: 60, failure_policy: open }
  - { rule_id: llm-sliding_window, resource_path: /llm/sliding_window, priority_bucket: BULK, limit: 100, window_seconds: 60 }
  - { rule_id: llm-fixed_window, resource_path: /llm/fixed_window, priority_bucket: BULK, limit: 100, window_seconds: 60, algorithm: fixed_window }
  - { rule_id: llm-token_bucket, resource_path: /llm/token_bucket, priority_bucket: BULK, limit: 100, window_seconds: 60, algorithm: token_bucket }
  - { rule_id: llm-gcra, resource_path: /llm/gcra, priority_bucket: BULK, limit: 100, window_seconds: 60, algorithm: gcra }
  - { rule_id: llm-first_hit_window, resource_path: /llm/first_hit_window, priority_bucket: BULK, limit: 100, window_seconds: 60, algorithm: first_hit_window }
  - { rule_id: llm-concurrency, resource_path: /llm/concurrency, priority_bucket: BULK, limit: 100, window_seconds: 60, algorithm: concurrency }
  - { rule_id: in-flight, resource_path: /in-flight, limit: 3, window_seconds: 60, algorithm: concurrency }
  - { rule_id: both, resource_path: /both, limit: 10, window_seconds: 1, algorithm: fixed_window, also: [ { limit: 30, window_seconds: 60 } ] }
  - { rule_id: monthly, resource_path: /monthly, limit: 3, period: month, time_zone: Europe/Berlin, also: [ { limit: 100, window_seconds: 60 } ] }
  - { rule_id: tokens, resource_path: /tokens, limit: 60, window_seconds: 60, also: [ { limit: 1000, window_seconds: 60, unit: input_tokens }, { limit: 500, window_seconds: 60, unit: output_tokens } ] }
  - { rule_id: spend, resource_path: /spend, limit: 1000, period: month, unit: cost }
  - { rule_id: priced, resource_path: /priced, limit: 100, window_seconds: 60, also: [ { limit: 10000, period: month, unit: cost } ], prices: { model_from: x-model, per_million: { gpt-4o: { input_tokens: 2500000, output_tokens: 10000000 }, mini: { input_tokens: 150000, output_tokens: 600000 } } } }
  - { rule_id: levels, resource_path: /levels, limit: 100, window_seconds: 60, unit: output_tokens, levels: { team: x-team, org: x-org }, also: [ { limit: 150, window_seconds: 60, unit: output_tokens, level: team }, { limit: 400, period: month, unit: cost, level: org } ] }
"#;

const ENVOY: &str = r#"
domain: edge
descriptors:
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 2 }
  - key: trial
    shadow_mode: true
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: free
    rate_limit: { unlimited: true }
  - key: files
    value: "/files/*"
    share_threshold: true
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: own
    value: "/own/*"
    rate_limit: { unit: minute, requests_per_unit: 3 }
  - key: tokens
    report_mode: true
    rate_limit: { unit: minute, requests_per_unit: 100 }
  - key: both
    rate_limit: { unit: second, requests_per_unit: 10, algorithm: fixed_window }
    also: [ { unit: minute, requests_per_unit: 30 } ]
  - key: stream
    rate_limit: { unit: minute, requests_per_unit: 2, algorithm: concurrency }
  - key: llm_key
    descriptors:
      - { key: budget, value: output, rate_limit: { unit: minute, requests_per_unit: 1000 } }
      - { key: budget, value: input, rate_limit: { unit: minute, requests_per_unit: 5000 } }
      - { key: budget, value: daily, rate_limit: { unit: day, requests_per_unit: 1000 } }
"#;

/// The failed decisions the engine reported.
#[derive(Debug, Default)]
struct Recorded(Mutex<Vec<(String, Reason, Priority, String)>>);

impl FailureSink for Recorded {
    fn record(&self, failure: &FailedDecision<'_>) {
        self.0.lock().unwrap().push((
            failure.rule_id.to_owned(),
            failure.answer,
            failure.priority,
            failure.resource_path.to_owned(),
        ));
    }
}

struct Harness {
    engine: Engine,
    shedder: Arc<Shedder>,
    failures: Arc<Recorded>,
    clock: Arc<ManualClock>,
    memory: Option<Arc<MemoryStore>>,
    redis: Option<RedisServer>,
    _dispatchers: JoinSet<()>,
    _dir: tempfile::TempDir,
}

/// A native request of `weight` for `user` on `path`, counted as `count`
/// says, from a caller that may report.
fn native<'a>(
    user: &'a str,
    path: &'a str,
    weight: u32,
    count: Count,
    headers: &'a HashMap<String, String>,
) -> CheckRequest<'a> {
    CheckRequest { weight, count, ..CheckRequest::new(user, path, headers) }
}

impl Harness {
    async fn new(backend: Backend, shed_mode: ShedMode, policy: EnvoyPolicy) -> Self {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("native.yaml"), NATIVE).unwrap();
        std::fs::write(dir.path().join("edge.yaml"), ENVOY).unwrap();
        let native = rules::load(&dir.path().join("native.yaml"), rules::PathForm::default()).unwrap();
        let envoy = rules::envoy::load_sliding(&dir.path().join("edge.yaml")).unwrap();
        let clock = Arc::new(ManualClock::new(1_000_000));
        let mut dispatchers = JoinSet::new();
        let (store, memory, redis) = match backend {
            Backend::Memory => {
                let memory = Arc::new(MemoryStore::new(4, 1_000_000, Arc::clone(&clock) as _));
                (Store::Memory(Arc::clone(&memory)), Some(memory), None)
            }
            Backend::Redis => {
                let redis = RedisServer::start();
                let config = RedisConfig {
                    connection: ratelimitd::limiter::settings::Connection {
                        url: Some(redis.url()),
                        ..Default::default()
                    },
                    timeout_ms: 2_000,
                    connect_timeout_ms: 500,
                    ..RedisConfig::default()
                };
                let store = Arc::new(RedisStore::new(&config, &mut dispatchers).unwrap());
                store.warm_up(Duration::from_secs(5)).await.unwrap();
                (Store::Redis(store), None, Some(redis))
            }
        };
        let shedder = Arc::new(Shedder::new(shed_mode, 1_000));
        let failures = Arc::new(Recorded::default());
        let engine = Engine::new(EngineParts {
            envoy: Some(Arc::new(Hot::new(envoy))),
            shedder: Arc::clone(&shedder),
            failures: Arc::clone(&failures) as _,
            envoy_policy: policy,
            clock: Arc::clone(&clock) as _,
            ..EngineParts::new(Arc::new(RuleStore::new(native)), store)
        });
        Harness { engine, shedder, failures, clock, memory, redis, _dispatchers: dispatchers, _dir: dir }
    }

    async fn default(backend: Backend) -> Self {
        Self::new(backend, ShedMode::Enforce, EnvoyPolicy::default()).await
    }

    async fn check(&self, user: &str, path: &str, weight: u32) -> Decision {
        self.call(user, path, weight, Count::IfFits).await
    }

    /// A `Check` (`IfFits`), a peek (`Never`) or a `Report` (`Always`).
    async fn call(&self, user: &str, path: &str, weight: u32, count: Count) -> Decision {
        let headers = HashMap::new();
        self.engine.check(&native(user, path, weight, count, &headers)).await
    }

    async fn rls(&self, descriptors: &[&[(&str, &str)]]) -> RlsDecision {
        self.rls_with(descriptors, 1, None).await
    }

    async fn rls_with(
        &self,
        descriptors: &[&[(&str, &str)]],
        hits: u32,
        limit: Option<LimitOverride>,
    ) -> RlsDecision {
        let descriptors: Vec<RlsDescriptor<'_>> = descriptors
            .iter()
            .map(|entries| RlsDescriptor { entries: entries.to_vec(), limit, hits_addend: None })
            .collect();
        self.decide_rls(&descriptors, hits, true).await
    }

    /// One descriptor `key=value` with its own `hits_addend`.
    async fn hits(&self, key: &str, value: &str, hits: u64) -> RlsDecision {
        let descriptors =
            [RlsDescriptor { entries: vec![(key, value)], limit: None, hits_addend: Some(hits) }];
        self.decide_rls(&descriptors, 0, true).await
    }

    /// A `ShouldRateLimit` of `descriptors` in domain `edge`.
    async fn decide_rls(
        &self,
        descriptors: &[RlsDescriptor<'_>],
        hits_addend: u32,
        may_report: bool,
    ) -> RlsDecision {
        let request =
            RlsRequest { domain: "edge", descriptors, hits_addend, trace_id: None, share: None, may_report };
        self.engine.should_rate_limit(&request).await
    }

    /// How many counters the store holds.
    async fn counters(&self) -> u64 {
        match (&self.memory, &self.redis) {
            (Some(memory), _) => memory.len() as u64,
            (_, Some(redis)) => {
                let mut conn = redis.client().await;
                ::redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap()
            }
            _ => unreachable!(),
        }
    }

    /// How many counters the store holds (memory) or script calls it made (Redis).
    async fn store_work(&self) -> u64 {
        match (&self.memory, &self.redis) {
            (Some(memory), _) => memory.len() as u64,
            (_, Some(redis)) => redis.evalsha_calls().await,
            _ => unreachable!(),
        }
    }
}

for_each_store!(
    check_ok_then_over_limit_then_ok_once_the_window_passes,
    check_no_rule_weight_and_shadow,
    check_sheds_by_priority_without_a_store_call,
    check_shadow_shedding_decides_normally,
    envoy_ok_over_limit_no_rule_unlimited_and_shadow,
    envoy_sheds_by_priority_without_a_store_call,
    envoy_share_threshold_shares_one_counter,
    envoy_override_limits_count_under_a_fixed_label,
    over_long_values_are_counted_by_digest_exactly,
    a_peek_counts_nothing_and_creates_no_counter,
    reports_count_past_the_limit_for_every_algorithm,
    native_peeks_count_nothing_for_every_algorithm,
    reports_are_never_shed,
    envoy_report_mode_counts_after_the_fact_and_zero_hits_peek,
    envoy_global_quota_mode_denies_only_when_every_limit_is_over,
    envoy_global_shadow_mode_never_denies,
    several_limits_count_all_or_nothing,
    envoy_several_limits_count_all_or_nothing,
    requests_in_flight_are_held_until_reported,
    a_month_resets_when_the_calendar_month_starts_in_its_zone,
    limits_of_other_units_count_what_the_request_states,
    a_money_budget_stops_the_key_at_its_limit,
    a_reservation_is_settled_once_up_or_down,
    a_price_table_charges_the_cost_of_the_tokens_by_model,
    a_reservation_never_settled_stays_charged_at_its_estimate,
    envoy_requests_in_flight_are_released_by_their_release_descriptor,
    a_request_is_charged_to_its_key_its_team_and_its_organisation,
    envoy_reservations_are_settled_once_by_their_stream_done_descriptors,
);

impl Harness {
    /// Waits for (Redis: sleeps until; memory: advances the clock to) the
    /// start of the next second; with `room_ms`, of the next minute when
    /// fewer than `room_ms` are left in this one. Fixed windows are crisp
    /// on either store, and a test that asks for room once at its start
    /// runs in one minute (sliding across a minute boundary, the minute's
    /// count decays).
    async fn next_second(&self, room_ms: u64) {
        use ratelimitd::clock::Clock as _;
        if self.memory.is_some() {
            self.clock.advance(1_000 - self.clock.now_ms() % 1_000);
            return;
        }
        let now = || u64::try_from(std::time::UNIX_EPOCH.elapsed().unwrap().as_millis()).unwrap();
        let into_minute = now() % 60_000;
        let wait = if into_minute + room_ms > 60_000 { 60_000 - into_minute } else { 1_000 - now() % 1_000 };
        tokio::time::sleep(Duration::from_millis(wait + 20)).await;
    }
}

/// "10 per second and 30 per minute" on one rule (`also`): bursts of 10
/// pass, the 11th in a second is denied by the per-second limit and counts
/// nowhere, so a third second's 10 still pass; the 31st in the minute is
/// denied by the per-minute limit, which the answer names.
async fn several_limits_count_all_or_nothing(backend: Backend) {
    let h = Harness::default(backend).await;
    h.next_second(5_000).await;
    for second in 0..3 {
        for i in 0..10u64 {
            let d = h.check("kim", "/both", 1).await;
            assert!(d.allowed, "second {second}, request {i}: {d:?}");
            assert_eq!(d.remaining, (9 - i).min(30 - 10 * second - i - 1), "the least left of both");
        }
        let over = h.check("kim", "/both", 1).await;
        assert_eq!((over.allowed, over.reason), (false, Reason::OverLimit), "{over:?}");
        let rule = over.rule.as_ref().unwrap();
        if second < 2 {
            assert_eq!((&*rule.id, rule.limit, rule.window_ms), ("both", 10, 1_000), "per second binds");
            assert!(over.retry_after_ms > 0 && over.retry_after_ms <= 1_000, "{over:?}");
        } else {
            assert_eq!((rule.limit, rule.window_ms), (30, 60_000), "per minute binds: {over:?}");
            assert!(over.retry_after_ms > 1_000, "{over:?}");
        }
        h.next_second(0).await;
    }
    assert!(!h.check("kim", "/both", 1).await.allowed, "the minute's 30 are spent");
    assert!(h.check("lee", "/both", 1).await.allowed, "users are independent");
}

/// `envoy.shadow_mode`: every limit is in shadow mode; nothing is refused
/// (the same requests are refused without it).
async fn envoy_global_shadow_mode_never_denies(backend: Backend) {
    let policy = EnvoyPolicy { shadow_mode: true, ..EnvoyPolicy::default() };
    let h = Harness::new(backend, ShedMode::Enforce, policy).await;
    for _ in 0..5 {
        let r = h.rls(&[&[("user", "ivy")]]).await;
        assert!(!r.over_limit && !r.statuses[0].over_limit, "{r:?}");
    }
    let h = Harness::new(backend, ShedMode::Enforce, EnvoyPolicy::default()).await;
    let over = (0..5).map(|_| h.rls(&[&[("user", "ivy")]]));
    let mut refused = 0;
    for r in over {
        refused += usize::from(r.await.over_limit);
    }
    assert!(refused > 0, "without shadow mode some are refused");
}

/// `envoy.quota_mode`: every limit is a quota; a request passes while any
/// of its limits has quota left, and the limits with quota are counted.
async fn envoy_global_quota_mode_denies_only_when_every_limit_is_over(backend: Backend) {
    let policy = EnvoyPolicy { quota_mode: true, ..EnvoyPolicy::default() };
    let h = Harness::new(backend, ShedMode::Enforce, policy).await;
    for _ in 0..2 {
        assert!(!h.rls(&[&[("user", "hal")]]).await.over_limit);
    }
    let both = h.rls(&[&[("user", "hal")], &[("own", "/own/x")]]).await;
    assert!(!both.over_limit, "own has quota left: {both:?}");
    assert!(both.statuses[0].over_limit && !both.statuses[1].over_limit);
    assert_eq!(both.statuses[1].remaining, 2, "the limit with quota was counted");
    assert!(h.rls(&[&[("user", "hal")]]).await.over_limit, "its only limit is over");
}

/// A report counts its whole weight, past the limit: the counter is
/// overdrawn, the report's answer says the next request is refused and
/// exactly until when, and Checks are refused until then (memory: on the
/// injected clock, to the millisecond).
async fn reports_count_past_the_limit_for_every_algorithm(backend: Backend) {
    let h = Harness::default(backend).await;
    // (Slots in flight are given back by a report: below.)
    for algorithm in Algorithm::ALL.into_iter().filter(|a| !a.releases()) {
        let path = format!("/llm/{}", algorithm.as_str());
        let first = h.call("ann", &path, 60, Count::Always).await;
        assert_eq!((first.allowed, first.reason, first.remaining), (true, Reason::Ok, 40), "{algorithm:?}");
        let over = h.call("ann", &path, 90, Count::Always).await;
        assert_eq!(
            (over.allowed, over.reason, over.remaining),
            (false, Reason::OverLimit, 0),
            "{algorithm:?}"
        );
        let wait = over.retry_after_ms;
        assert!(wait > 0 && wait <= 120_000, "{algorithm:?}: {over:?}");
        let denied = h.check("ann", &path, 1).await;
        assert_eq!((denied.allowed, denied.reason), (false, Reason::OverLimit), "{algorithm:?}");
        if backend == Backend::Memory {
            assert_eq!(denied.retry_after_ms, wait, "{algorithm:?}: the report's answer is the next check's");
        } else {
            // Redis time moves on between the two calls.
            assert!((wait - 1_000..=wait).contains(&denied.retry_after_ms), "{algorithm:?}: {denied:?}");
        }
        assert!(h.check("bob", &path, 1).await.allowed, "users are independent");
        if backend == Backend::Memory {
            h.clock.advance(u64::try_from(wait).unwrap() - 1);
            assert!(!h.check("ann", &path, 1).await.allowed, "{algorithm:?}: 1 ms early");
            h.clock.advance(1);
            assert!(h.check("ann", &path, 1).await.allowed, "{algorithm:?}: at retry_after");
        }
    }
}

/// A native peek says whether the weight would fit, counts nothing and
/// creates no counter; a weight over the capacity is never admissible.
async fn native_peeks_count_nothing_for_every_algorithm(backend: Backend) {
    let h = Harness::default(backend).await;
    let before = h.counters().await;
    for algorithm in Algorithm::ALL {
        let path = format!("/llm/{}", algorithm.as_str());
        for _ in 0..3 {
            let peek = h.call("cy", &path, 100, Count::Never).await;
            assert_eq!((peek.allowed, peek.remaining, peek.retry_after_ms), (true, 100, 0), "{algorithm:?}");
        }
        let never = h.call("cy", &path, 101, Count::Never).await;
        assert_eq!((never.reason, never.retry_after_ms), (Reason::WeightExceedsCapacity, -1));
    }
    assert_eq!(h.counters().await, before, "no counter created");
    h.check("cy", "/llm/gcra", 30).await;
    let peek = h.call("cy", "/llm/gcra", 71, Count::Never).await;
    assert_eq!((peek.allowed, peek.reason, peek.remaining), (false, Reason::OverLimit, 70));
    assert!(peek.retry_after_ms > 0);
}

/// A report is never shed (the usage it reports has happened), even at
/// CRITICAL_ONLY for a BULK rule; a Check of the same rule is.
async fn reports_are_never_shed(backend: Backend) {
    let h = Harness::default(backend).await;
    h.shedder.publish(Level::CriticalOnly, 0.95);
    assert_eq!(h.check("dee", "/llm/gcra", 1).await.reason, Reason::Shed);
    let report = h.call("dee", "/llm/gcra", 100, Count::Always).await;
    assert_eq!((report.reason, report.remaining), (Reason::OverLimit, 0), "{report:?}");
    // Envoy: the stream-done report is not shed; the request path's check (0 hits) is.
    assert_eq!(h.hits("tokens", "dee", 0).await.reason, Reason::Shed);
    let report = h.hits("tokens", "dee", 150).await;
    assert_eq!((report.reason, report.over_limit), (Reason::OverLimit, true), "counted: {report:?}");
    h.shedder.publish(Level::Normal, 0.1);
    assert_eq!(h.check("dee", "/llm/gcra", 1).await.reason, Reason::OverLimit, "the report was counted");
    assert!(h.hits("tokens", "dee", 0).await.over_limit, "the Envoy report was counted");
}

/// Envoy's token-quota flow: `hits_addend: 0` on the request path asks
/// whether any quota is left (counting nothing); the stream-done report on
/// a `report_mode` descriptor counts its hits whatever is left; the
/// request after the budget is spent is refused.
async fn envoy_report_mode_counts_after_the_fact_and_zero_hits_peek(backend: Backend) {
    let h = Harness::default(backend).await;
    let before = h.counters().await;
    let send = |hits| h.hits("tokens", "eve", hits);
    let check = send(0).await;
    assert_eq!((check.over_limit, check.statuses[0].remaining), (false, 100));
    assert_eq!(h.counters().await, before, "a check creates no counter");
    let report = send(70).await;
    assert_eq!((report.over_limit, report.statuses[0].remaining), (false, 30));
    assert!(!send(0).await.over_limit, "30 left");
    let report = send(45).await;
    assert!(report.over_limit, "the budget is overdrawn by 15: {report:?}");
    let refused = send(0).await;
    assert!(refused.over_limit, "the request after the budget is spent is refused");
    assert!(refused.statuses[0].until_reset_ms > 0);
    // Exactly spent: a report that lands on the limit leaves nothing for the next request.
    assert!(h.hits("tokens", "fay", 100).await.over_limit);

    // A report rides along with an admission that is refused: the report
    // is counted all the same (it is its own job), the admission is not.
    assert!(!h.rls(&[&[("user", "gil")]]).await.over_limit);
    assert!(!h.rls(&[&[("user", "gil")]]).await.over_limit);
    let descriptors = [
        RlsDescriptor { entries: vec![("tokens", "gil")], limit: None, hits_addend: Some(150) },
        RlsDescriptor { entries: vec![("user", "gil")], limit: None, hits_addend: None },
    ];
    let request = RlsRequest {
        domain: "edge",
        descriptors: &descriptors,
        hits_addend: 0,
        trace_id: None,
        share: None,
        may_report: true,
    };
    let mixed = h.engine.should_rate_limit(&request).await;
    assert!(mixed.over_limit && mixed.statuses[1].over_limit, "{mixed:?}");
    assert!(h.hits("tokens", "gil", 0).await.over_limit, "the report was counted");
}

/// `hits_addend: 0` on a descriptor checks without counting, and leaves no
/// counter behind: a flood of peeks at distinct values costs no memory.
async fn a_peek_counts_nothing_and_creates_no_counter(backend: Backend) {
    let h = Harness::default(backend).await;
    let before = h.counters().await;
    let peek = [RlsDescriptor { entries: vec![("user", "peeker")], limit: None, hits_addend: Some(0) }];
    for _ in 0..3 {
        let request = RlsRequest {
            domain: "edge",
            descriptors: &peek,
            hits_addend: 1,
            trace_id: None,
            share: None,
            may_report: true,
        };
        let r = h.engine.should_rate_limit(&request).await;
        assert_eq!((r.reason, r.statuses[0].remaining), (Reason::Ok, 2), "{r:?}");
    }
    assert_eq!(h.counters().await, before, "no counter created");
    assert!(!h.rls(&[&[("user", "peeker")]]).await.over_limit, "the full limit is still there");
}

async fn check_ok_then_over_limit_then_ok_once_the_window_passes(backend: Backend) {
    let h = Harness::default(backend).await;
    let first = h.check("ann", "/two", 1).await;
    assert_eq!((first.allowed, first.reason, first.remaining), (true, Reason::Ok, 1));
    assert_eq!(first.rule.as_ref().map(|r| &*r.id), Some("two"));
    assert_eq!(first.priority, Priority::Degraded, "the rule's priority");
    assert!(h.check("ann", "/two", 1).await.allowed);
    let over = h.check("ann", "/two", 1).await;
    assert_eq!((over.allowed, over.reason), (false, Reason::OverLimit));
    assert!(over.retry_after_ms > 0 && over.retry_after_ms <= 120_000, "{over:?}");
    assert!(h.check("bob", "/two", 1).await.allowed, "users are independent");
    if backend == Backend::Memory {
        // The injected clock: the sliding estimate lets one more through
        // exactly at retry_after, not a millisecond before.
        let wait = u64::try_from(over.retry_after_ms).unwrap();
        h.clock.advance(wait - 1);
        assert_eq!(h.check("ann", "/two", 1).await.reason, Reason::OverLimit);
        h.clock.advance(1);
        assert_eq!(h.check("ann", "/two", 1).await.reason, Reason::Ok);
    }
}

async fn check_no_rule_weight_and_shadow(backend: Backend) {
    let h = Harness::default(backend).await;
    let none = h.check("ann", "/nowhere", 1).await;
    assert_eq!((none.allowed, none.reason, none.rule.is_none()), (true, Reason::NoRule, true));
    assert_eq!(none.priority, Priority::Degraded, "shed.default_priority");

    let before = h.store_work().await;
    let heavy = h.check("ann", "/two", 3).await;
    assert_eq!(
        (heavy.allowed, heavy.reason, heavy.retry_after_ms),
        (false, Reason::WeightExceedsCapacity, -1)
    );
    assert_eq!(h.store_work().await, before, "answered from the rule alone");

    assert!(h.check("ann", "/trial", 1).await.allowed);
    let shadow = h.check("ann", "/trial", 1).await;
    assert_eq!((shadow.allowed, shadow.reason, shadow.shadow_denied), (true, Reason::Ok, true));
}

async fn check_sheds_by_priority_without_a_store_call(backend: Backend) {
    let h = Harness::default(backend).await;
    h.shedder.publish(Level::CriticalOnly, 0.95);
    let before = h.store_work().await;
    for path in ["/bulk", "/two", "/nowhere"] {
        let shed = h.check("ann", path, 1).await;
        assert_eq!(
            (shed.allowed, shed.reason, shed.level),
            (false, Reason::Shed, Level::CriticalOnly),
            "{path}"
        );
        assert!((500..=1_500).contains(&shed.retry_after_ms), "{shed:?}");
    }
    assert_eq!(h.store_work().await, before, "no store call when shed");
    let critical = h.check("ann", "/vip", 1).await;
    assert_eq!((critical.allowed, critical.reason), (true, Reason::Ok), "CRITICAL is never shed");

    h.shedder.publish(Level::Degraded, 0.7);
    assert_eq!(h.check("ann", "/bulk", 1).await.reason, Reason::Shed);
    assert_eq!(h.check("ann", "/two", 1).await.reason, Reason::Ok, "DEGRADED passes in DEGRADED_MODE");
    assert_eq!(h.shedder.shed_count(Priority::Bulk), 2);
}

async fn check_shadow_shedding_decides_normally(backend: Backend) {
    let h = Harness::new(backend, ShedMode::Shadow, EnvoyPolicy::default()).await;
    h.shedder.publish(Level::CriticalOnly, 0.95);
    let d = h.check("ann", "/bulk", 1).await;
    assert_eq!((d.allowed, d.reason, d.shadow_shed), (true, Reason::Ok, true));
    let e = h.rls(&[&[("user", "ann")]]).await;
    assert_eq!((e.over_limit, e.reason, e.shadow_shed), (false, Reason::Ok, true));
    assert_eq!(h.shedder.shadow_shed_count(Priority::Bulk), 1);
    assert_eq!(h.shedder.shadow_shed_count(Priority::Degraded), 1);
}

async fn envoy_ok_over_limit_no_rule_unlimited_and_shadow(backend: Backend) {
    let h = Harness::default(backend).await;
    let ok = h.rls(&[&[("user", "ann")], &[("nothing", "x")], &[("free", "x")]]).await;
    assert_eq!((ok.over_limit, ok.reason), (false, Reason::Ok));
    assert_eq!(ok.statuses.len(), 3);
    assert_eq!(ok.statuses[0].remaining, 1);
    assert_eq!(ok.statuses[0].limit.as_ref().map(|l| l.requests_per_unit), Some(2));
    assert!(ok.statuses[1].limit.is_none() && !ok.statuses[1].over_limit, "unmatched is OK");
    assert!(ok.statuses[2].unlimited && ok.statuses[2].remaining == u32::MAX);
    assert_eq!(ok.tightest, Some(0));

    assert!(!h.rls(&[&[("user", "ann")]]).await.over_limit);
    let over = h.rls(&[&[("user", "ann")], &[("free", "x")]]).await;
    assert_eq!((over.over_limit, over.reason), (true, Reason::OverLimit));
    assert!(over.statuses[0].over_limit && over.statuses[0].until_reset_ms > 0);
    assert!(!over.statuses[1].over_limit);

    let none = h.rls(&[&[("nothing", "x")]]).await;
    assert_eq!((none.over_limit, none.reason), (false, Reason::NoRule));

    // A shadow descriptor over its limit reports but never denies.
    assert!(!h.rls(&[&[("trial", "t")]]).await.over_limit);
    let shadow = h.rls(&[&[("trial", "t")]]).await;
    assert_eq!((shadow.over_limit, shadow.statuses[0].over_limit), (false, false));

    // Hits beyond the limit can never pass.
    let heavy = h.rls_with(&[&[("user", "bob")]], 3, None).await;
    assert_eq!(heavy.reason, Reason::OverLimit);
    assert!(h.rls(&[&[("user", "bob")]]).await.statuses[0].remaining == 1, "nothing was counted");
}

async fn envoy_sheds_by_priority_without_a_store_call(backend: Backend) {
    let policy = EnvoyPolicy {
        domain_priority: HashMap::from([("edge".to_owned(), Priority::BestEffort)]),
        ..EnvoyPolicy::default()
    };
    let h = Harness::new(backend, ShedMode::Enforce, policy).await;
    h.shedder.publish(Level::Degraded, 0.7);
    let before = h.store_work().await;
    // The domain's priority (BEST_EFFORT) is shed in DEGRADED_MODE.
    let shed = h.rls(&[&[("user", "ann")], &[("nothing", "x")]]).await;
    assert_eq!((shed.over_limit, shed.reason, shed.priority), (true, Reason::Shed, Priority::BestEffort));
    assert!(shed.statuses.iter().all(|s| s.over_limit), "every descriptor OVER_LIMIT");
    assert_eq!(shed.statuses[0].limit.as_ref().map(|l| l.requests_per_unit), Some(2), "with its limit");
    assert!(shed.statuses[1].limit.is_none());
    assert!((500..=1_500).contains(&shed.retry_after_ms));
    assert_eq!(shed.statuses[0].until_reset_ms, shed.retry_after_ms);
    assert_eq!(h.store_work().await, before, "no store call when shed");
    // A priority entry overrides the domain's: DEGRADED passes in DEGRADED_MODE ...
    let stated = h.rls(&[&[("user", "ann")], &[("priority", "DEGRADED")]]).await;
    assert_eq!((stated.reason, stated.priority), (Reason::Ok, Priority::Degraded));
    // ... and is shed at CRITICAL_ONLY, where only CRITICAL passes.
    h.shedder.publish(Level::CriticalOnly, 0.95);
    assert_eq!(h.rls(&[&[("user", "ann")], &[("priority", "degraded")]]).await.reason, Reason::Shed);
    let critical = h.rls(&[&[("user", "ann")], &[("priority", "CRITICAL")]]).await;
    assert_eq!((critical.reason, critical.level), (Reason::Ok, Level::CriticalOnly));
    assert_eq!(critical.statuses[0].remaining, 0, "counted: the second of two");
}

async fn envoy_share_threshold_shares_one_counter(backend: Backend) {
    let h = Harness::default(backend).await;
    for file in ["/files/a.pdf", "/files/b.csv", "/files/c"] {
        assert!(!h.rls(&[&[("files", file)]]).await.over_limit, "{file}");
    }
    let fourth = h.rls(&[&[("files", "/files/d.txt")]]).await;
    assert!(fourth.over_limit, "3 shared by every value matching /files/*");
    // Without share_threshold each value counts on its own.
    for file in ["/own/a", "/own/b", "/own/c", "/own/d"] {
        assert!(!h.rls(&[&[("own", file)]]).await.over_limit, "{file}");
    }
}

async fn envoy_override_limits_count_under_a_fixed_label(backend: Backend) {
    let limit = Some(LimitOverride { requests_per_unit: 1, unit: Unit::Hour });
    // Off by default: the request's limit is ignored, the configured one applies.
    let h = Harness::default(backend).await;
    let ignored = h.rls_with(&[&[("anything", "v1")]], 1, limit).await;
    assert_eq!((ignored.reason, ignored.statuses[0].limit.is_none()), (Reason::NoRule, true));
    let user = h.rls_with(&[&[("user", "ann")]], 1, limit).await;
    assert_eq!(user.statuses[0].limit.as_ref().map(|l| l.requests_per_unit), Some(2));
    // Honoured for a listed domain, under a fixed label.
    let policy = EnvoyPolicy { request_limit_domains: ["edge".to_owned()].into(), ..EnvoyPolicy::default() };
    let h = Harness::new(backend, ShedMode::Enforce, policy).await;
    let first = h.rls_with(&[&[("anything", "v1")]], 1, limit).await;
    assert_eq!(first.reason, Reason::Ok);
    assert_eq!(first.statuses[0].limit.as_ref().map(|l| &*l.full_key), Some("override"));
    assert_eq!(h.rls_with(&[&[("anything", "v1")]], 1, limit).await.reason, Reason::OverLimit);
}

async fn over_long_values_are_counted_by_digest_exactly(backend: Backend) {
    let h = Harness::default(backend).await;
    let long = "u".repeat(2_000);
    let mut near = long.clone();
    near.push('v');
    assert_eq!(h.check(&long, "/two", 1).await.reason, Reason::Ok);
    assert_eq!(h.check(&long, "/two", 1).await.reason, Reason::Ok);
    assert_eq!(h.check(&long, "/two", 1).await.reason, Reason::OverLimit, "limited like a short id");
    assert_eq!(h.check(&near, "/two", 1).await.reason, Reason::Ok, "a different long id is another counter");
    let value = "v".repeat(5_000);
    assert!(!h.rls(&[&[("user", &value)]]).await.over_limit);
    assert!(!h.rls(&[&[("user", &value)]]).await.over_limit);
    assert!(h.rls(&[&[("user", &value)]]).await.over_limit, "limited like a short value");
    // Matching still sees the whole value: a wildcard matches a long path.
    let path = format!("/files/{}", "p".repeat(5_000));
    assert!(h.rls(&[&[("files", &path)]]).await.statuses[0].limit.is_some());
}

/// Redis stops: each entry point answers by its failure policy, flags the
/// answer with the failure kind, and reports exactly one failed decision
/// per request, with the request's priority. `local` (the default) limits
/// at this instance's share (here the whole limit: one instance), never
/// "unlimited".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn store_failures_follow_the_failure_policy_on_both_entry_points() {
    let mut h = Harness::default(Backend::Redis).await;
    h.redis.as_mut().unwrap().stop();
    let mut local = Vec::new();
    for _ in 0..3 {
        let decision = h.check("ann", "/two", 1).await;
        assert!(decision.store_error.is_some(), "flagged: {decision:?}");
        local.push((decision.allowed, decision.reason));
    }
    assert_eq!(
        local,
        [(true, Reason::LocalOk), (true, Reason::LocalOk), (false, Reason::LocalOverLimit)],
        "the rule's limit of 2, counted locally"
    );
    let open = h.check("ann", "/open", 1).await;
    assert_eq!((open.allowed, open.reason), (true, Reason::FailOpen));
    assert!(open.store_error.is_some());
    let closed = h.check("ann", "/closed", 1).await;
    assert_eq!((closed.allowed, closed.reason, closed.retry_after_ms), (false, Reason::FailClosed, 1_000));
    let mut envoy = Vec::new();
    for _ in 0..3 {
        let decision = h.rls(&[&[("user", "ann")], &[("priority", "BULK")]]).await;
        assert!(decision.store_error.is_some() && decision.failure.is_none());
        envoy.push((decision.over_limit, decision.reason));
    }
    assert_eq!(
        envoy,
        [(false, Reason::LocalOk), (false, Reason::LocalOk), (true, Reason::LocalOverLimit)],
        "Envoy's limit of 2 per minute, counted locally"
    );
    assert!(h.rls(&[&[("nothing", "x")]]).await.reason == Reason::NoRule, "no store call, no failure");
    let recorded = h.failures.0.lock().unwrap().clone();
    let two = ("two".to_owned(), Reason::LocalOk, Priority::Degraded, "/two".to_owned());
    let edge = ("edge.user".to_owned(), Reason::LocalOk, Priority::Bulk, "envoy:edge".to_owned());
    assert_eq!(
        recorded,
        [
            two.clone(),
            two,
            ("two".to_owned(), Reason::LocalOverLimit, Priority::Degraded, "/two".to_owned()),
            ("open".to_owned(), Reason::FailOpen, Priority::Degraded, "/open".to_owned()),
            ("closed".to_owned(), Reason::FailClosed, Priority::Degraded, "/closed".to_owned()),
            edge.clone(),
            edge,
            ("edge.user".to_owned(), Reason::LocalOverLimit, Priority::Bulk, "envoy:edge".to_owned()),
        ]
    );

    for (failure, over_limit, reason) in [
        (EnvoyFailure::Open, false, Reason::FailOpen),
        (EnvoyFailure::Unavailable, false, Reason::FailClosed),
    ] {
        let policy = EnvoyPolicy { failure, ..EnvoyPolicy::default() };
        let mut h = Harness::new(Backend::Redis, ShedMode::Enforce, policy).await;
        h.redis.as_mut().unwrap().stop();
        let answer = h.rls(&[&[("user", "ann")]]).await;
        assert_eq!((answer.over_limit, answer.reason), (over_limit, reason));
        assert!(answer.statuses.iter().all(|s| !s.over_limit), "nothing counted");
        assert_eq!(
            answer.failure.is_some(),
            failure == EnvoyFailure::Unavailable,
            "UNAVAILABLE only when asked"
        );
        assert_eq!(h.failures.0.lock().unwrap().len(), 1);
    }
    // Per domain, over the default.
    let policy = EnvoyPolicy {
        domain_failure: [("edge".to_owned(), EnvoyFailure::Open)].into(),
        ..EnvoyPolicy::default()
    };
    let mut h = Harness::new(Backend::Redis, ShedMode::Enforce, policy).await;
    h.redis.as_mut().unwrap().stop();
    assert_eq!(h.rls(&[&[("user", "ann")]]).await.reason, Reason::FailOpen);
}

/// What the local limiter admitted while Redis was down is written back
/// once it answers: the shared counter then holds it, and the same user is
/// limited by what was admitted during the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn local_admissions_are_written_back_when_the_store_returns() {
    let mut h = Harness::default(Backend::Redis).await;
    let redis = h.redis.as_mut().unwrap();
    redis.stop();
    assert_eq!(h.check("bob", "/two", 1).await.reason, Reason::LocalOk);
    assert!(!h.rls(&[&[("user", "bob")]]).await.over_limit);
    assert!(!h.rls(&[&[("user", "bob")]]).await.over_limit);
    let local = Arc::clone(h.engine.local());
    assert_eq!(local.owed_hits(), 3);
    assert_eq!(local.write_back(h.engine.store()).await.0, 0, "nothing to write to while down");
    assert_eq!(local.owed_hits(), 3, "kept owed");
    h.redis.as_mut().unwrap().restart();
    let store = h.engine.store().clone();
    let written = common::eventually(Duration::from_secs(20), || {
        let (local, store) = (Arc::clone(&local), store.clone());
        async move {
            local.write_back(&store).await;
            local.owed_hits() == 0
        }
    })
    .await;
    assert!(written, "owed hits never written back");
    assert_eq!(local.written_back(), 3);
    // The shared counters hold the outage's admissions: one more for the
    // native rule (limit 2), none for Envoy's (2 used of 2).
    let after = common::eventually(Duration::from_secs(10), || {
        let h = &h;
        async move { h.check("bob", "/two", 1).await.reason == Reason::Ok }
    })
    .await;
    assert!(after, "the store did not answer again");
    assert_eq!(h.check("bob", "/two", 1).await.reason, Reason::OverLimit);
    assert_eq!(h.rls(&[&[("user", "bob")]]).await.reason, Reason::OverLimit);
}

#[test]
fn embedded_rules_are_the_repositorys_examples() {
    let embedded = rules::embedded(rules::PathForm::default()).unwrap();
    let examples = rules::load(&common::repo_path("examples/rules"), rules::PathForm::default()).unwrap();
    let ids = |s: &rules::Snapshot| s.rules().iter().map(|r| (r.id.to_string(), r.limit)).collect::<Vec<_>>();
    assert_eq!(ids(&embedded), ids(&examples), "every example file is compiled in");
    assert!(Path::new(&common::repo_path("examples/rules/api.yaml")).is_file());
}

/// The same on one Envoy descriptor (`also` beside `rate_limit`): the
/// status names the limit that binds, per second then per minute.
async fn envoy_several_limits_count_all_or_nothing(backend: Backend) {
    let h = Harness::default(backend).await;
    h.next_second(5_000).await;
    for second in 0..3u32 {
        for i in 0..10u32 {
            let r = h.rls(&[&[("both", "kim")]]).await;
            assert!(!r.over_limit, "second {second}, request {i}: {r:?}");
            assert_eq!(
                r.statuses[0].remaining,
                (9 - i).min(30 - 10 * second - i - 1),
                "the least left of both"
            );
        }
        let over = h.rls(&[&[("both", "kim")]]).await;
        assert!(over.over_limit, "{over:?}");
        let status = &over.statuses[0];
        let bound = status.limit.as_ref().unwrap().limit_at(status.bound);
        if second < 2 {
            assert_eq!((bound.requests_per_unit, bound.unit), (10, Some(Unit::Second)), "per second binds");
            assert!(status.until_reset_ms <= 1_000, "{over:?}");
        } else {
            assert_eq!((bound.requests_per_unit, bound.unit), (30, Some(Unit::Minute)), "per minute binds");
            assert!(status.until_reset_ms > 1_000, "{over:?}");
        }
        h.next_second(0).await;
    }
    assert!(h.rls(&[&[("both", "kim")]]).await.over_limit, "the minute's 30 are spent");
    assert!(!h.rls(&[&[("both", "lee")]]).await.over_limit, "values are independent");
}

/// `algorithm: concurrency` through the native API: each Check takes a
/// slot, the fourth of 3 is refused (retry: until the slots' windows are
/// over, given no report), and a Report at a request's end gives its slot
/// back, so the next Check passes at once, even with a cache of denials
/// (whose retry time a report overtakes: such denials are not cached); a
/// Report from a caller that may not report is answered as a peek.
async fn requests_in_flight_are_held_until_reported(backend: Backend) {
    let h = Harness::default(backend).await;
    let engine = Engine::new(EngineParts {
        denials: Some(Arc::new(DenialCache::new(1_000, Arc::clone(&h.clock) as _))),
        ..EngineParts::new(Arc::clone(h.engine.rules()), h.engine.store().clone())
    });
    let headers = HashMap::new();
    let call = |count: Count| native("flo", "/in-flight", 1, count, &headers);
    for left in (0..3).rev() {
        let taken = engine.check(&call(Count::IfFits)).await;
        assert_eq!((taken.allowed, taken.remaining), (true, left), "{taken:?}");
    }
    for _ in 0..2 {
        let fourth = engine.check(&call(Count::IfFits)).await;
        assert_eq!((fourth.allowed, fourth.reason), (false, Reason::OverLimit), "{fourth:?}");
        assert!((60_000..=120_000).contains(&fourth.retry_after_ms), "{fourth:?}");
    }
    let untrusted = engine.check(&CheckRequest { may_report: false, ..call(Count::Always) }).await;
    assert!(!untrusted.allowed, "answered as a peek: {untrusted:?}");
    assert!(
        !engine.check(&call(Count::IfFits)).await.allowed,
        "a caller that may not report gave nothing back"
    );
    let ended = engine.check(&call(Count::Always)).await;
    assert_eq!((ended.allowed, ended.remaining), (true, 1), "a slot given back: {ended:?}");
    let next = engine.check(&call(Count::IfFits)).await;
    assert_eq!((next.allowed, next.remaining), (true, 0), "{next:?}");
}

/// A limit of 3 a month in Berlin, on the engine's clock: spent in the
/// last hour of October (a month of 31 days and an hour: it left summer
/// time), refused until November starts there (an hour before UTC's
/// month), to the ms; again at the end of March, whose month is an hour
/// short. Alike on the memory store and Redis, whose own clock is a
/// month ahead of the injected one.
async fn a_month_resets_when_the_calendar_month_starts_in_its_zone(backend: Backend) {
    let h = Harness::default(backend).await;
    let utc = |text: &str| u64::try_from(text.parse::<jiff::Timestamp>().unwrap().as_millisecond()).unwrap();
    const HOUR_MS: u64 = 3_600_000;
    for (spend, month_start, month_hours) in [
        ("2026-10-31T22:00:00Z", "2026-10-31T23:00:00Z", 31 * 24 + 1),
        ("2027-03-31T21:00:00Z", "2027-03-31T22:00:00Z", 31 * 24 - 1),
    ] {
        h.clock.set(utc(spend));
        for left in (0..3).rev() {
            let d = h.check("mia", "/monthly", 1).await;
            assert_eq!((d.allowed, d.remaining), (true, left), "{spend}: {d:?}");
            assert_eq!(d.rule.as_ref().unwrap().window_ms, month_hours * HOUR_MS, "{spend}: {d:?}");
        }
        let over = h.check("mia", "/monthly", 1).await;
        assert_eq!((over.allowed, over.reason), (false, Reason::OverLimit), "{spend}: {over:?}");
        assert_eq!((over.retry_after_ms, over.reset_after_ms), (3_600_000, 3_600_000), "{spend}: {over:?}");
        h.clock.set(utc(month_start) - 1);
        let last = h.check("mia", "/monthly", 1).await;
        assert_eq!((last.allowed, last.retry_after_ms), (false, 1), "{spend}: {last:?}");
        h.clock.set(utc(month_start));
        let next = h.check("mia", "/monthly", 1).await;
        assert_eq!((next.allowed, next.remaining), (true, 2), "{spend}: a new month: {next:?}");
        assert_eq!(h.check("amy", "/monthly", 2).await.remaining, 1, "users apart");
    }
}

/// A rule of 60 requests, 1,000 input tokens and 500 output tokens a
/// minute: each limit counts its own unit from the request's usage, all
/// or nothing; a request that would pass one budget but not another
/// counts in neither; one that states nothing of a spent unit is refused;
/// a report counts past the limit; more than a limit holds never fits.
async fn limits_of_other_units_count_what_the_request_states(backend: Backend) {
    let h = Harness::default(backend).await;
    let headers = HashMap::new();
    let call = |usage: &[(&str, u64)], count: Count| {
        let usage: HashMap<String, u64> = usage.iter().map(|(unit, n)| ((*unit).to_owned(), *n)).collect();
        let engine = h.engine.clone();
        let headers = &headers;
        async move {
            engine.check(&CheckRequest { usage: &usage, ..native("tia", "/tokens", 1, count, headers) }).await
        }
    };
    let unit = |d: &Decision| d.rule.as_ref().and_then(|r| r.unit.as_deref().map(str::to_owned));
    let first = call(&[("input_tokens", 600), ("output_tokens", 200)], Count::IfFits).await;
    assert!(first.allowed, "{first:?}");
    let over = call(&[("input_tokens", 500), ("output_tokens", 10)], Count::IfFits).await;
    assert_eq!((over.allowed, over.reason), (false, Reason::OverLimit), "{over:?}");
    assert_eq!(
        (unit(&over).as_deref(), over.remaining),
        (Some("input_tokens"), 400),
        "the input budget binds"
    );
    let exact = call(&[("input_tokens", 400), ("output_tokens", 300)], Count::IfFits).await;
    assert!(exact.allowed, "the refused request counted nothing: {exact:?}");
    let nothing = call(&[], Count::IfFits).await;
    assert!(!nothing.allowed, "spent budgets refuse a request that states none: {nothing:?}");
    let peek = call(&[("input_tokens", 0)], Count::Never).await;
    assert!(!peek.allowed, "{peek:?}");
    let reported = call(&[("output_tokens", 120)], Count::Always).await;
    assert!(!reported.allowed, "a report past the output limit: {reported:?}");
    let requests = h.check("tia", "/other-path", 1).await;
    assert_eq!(requests.reason, Reason::NoRule);
    let huge = call(&[("input_tokens", 1_001)], Count::IfFits).await;
    assert_eq!((huge.allowed, huge.reason, huge.retry_after_ms), (false, Reason::WeightExceedsCapacity, -1));
    let both = HashMap::from([("input_tokens".to_owned(), 1_000), ("output_tokens".to_owned(), 500)]);
    let tom = CheckRequest { usage: &both, ..native("tom", "/tokens", 1, Count::IfFits, &headers) };
    assert!(h.engine.check(&tom).await.allowed, "users apart");
}

/// A budget of 1,000 micro-units of money a month: spent to exactly its
/// limit, then refused, whatever the next request states.
async fn a_money_budget_stops_the_key_at_its_limit(backend: Backend) {
    let h = Harness::default(backend).await;
    let headers = HashMap::new();
    let mut spent = 0;
    for cost in [400, 350, 250] {
        let usage = HashMap::from([("cost".to_owned(), cost)]);
        let d = h
            .engine
            .check(&CheckRequest { usage: &usage, ..native("mo", "/spend", 1, Count::IfFits, &headers) })
            .await;
        spent += cost;
        assert_eq!((d.allowed, d.remaining), (true, 1_000 - spent), "{d:?}");
        assert_eq!(d.rule.as_ref().and_then(|r| r.unit.as_deref()), Some("cost"));
    }
    for usage in
        [HashMap::from([("cost".to_owned(), 1)]), HashMap::from([("cost".to_owned(), 0)]), HashMap::new()]
    {
        let d = h
            .engine
            .check(&CheckRequest { usage: &usage, ..native("mo", "/spend", 1, Count::IfFits, &headers) })
            .await;
        assert_eq!((d.allowed, d.reason), (false, Reason::OverLimit), "{usage:?}: {d:?}");
    }
}

impl Harness {
    /// A `Check` (`reserve`) or `Report` (`settle`: a reservation's id) of
    /// `usage` on `path` for `user`, from a caller that may report.
    async fn usage(
        &self,
        user: &str,
        path: &str,
        usage: &[(&str, u64)],
        reserve: bool,
        settle: Option<&str>,
    ) -> Decision {
        let usage: HashMap<String, u64> = usage.iter().map(|(unit, n)| ((*unit).to_owned(), *n)).collect();
        let headers = HashMap::new();
        let reservation = settle.map(|id| ratelimitd::decision::reservation::Reservation::parse(id).unwrap());
        let count = if settle.is_some() { Count::Always } else { Count::IfFits };
        let request = CheckRequest {
            usage: &usage,
            reserve,
            reservation: reservation.as_ref(),
            ..native(user, path, 1, count, &headers)
        };
        self.engine.check(&request).await
    }
}

/// Reserve 300 input and 400 output tokens (of 1,000 and 500 a minute):
/// a parallel request cannot spend what is reserved; the settlement of
/// 100 output tokens gives 300 back, once however often it is retried;
/// another key's settlement above its estimate counts the difference.
async fn a_reservation_is_settled_once_up_or_down(backend: Backend) {
    let h = Harness::default(backend).await;
    let reserved =
        h.usage("rex", "/tokens", &[("input_tokens", 300), ("output_tokens", 400)], true, None).await;
    let id = reserved.reservation.clone().expect("a reservation id");
    assert!(reserved.allowed, "{reserved:?}");
    let parallel =
        h.usage("rex", "/tokens", &[("input_tokens", 100), ("output_tokens", 200)], false, None).await;
    assert!(!parallel.allowed, "the reservation holds 400 of 500: {parallel:?}");
    let settled =
        h.usage("rex", "/tokens", &[("input_tokens", 300), ("output_tokens", 100)], false, Some(&id)).await;
    assert!(settled.reservation.is_none(), "{settled:?}");
    for _ in 0..2 {
        let retried = h.usage("rex", "/tokens", &[("output_tokens", 0)], false, Some(&id)).await;
        assert!(retried.reservation.is_none(), "{retried:?}");
    }
    let fits = h.usage("rex", "/tokens", &[("input_tokens", 700), ("output_tokens", 400)], false, None).await;
    assert!(fits.allowed, "300 output tokens back, once: {fits:?}");
    let full = h.usage("rex", "/tokens", &[("output_tokens", 1)], false, None).await;
    assert!(!full.allowed, "a retried settlement gave nothing more back: {full:?}");
    let plain = h.usage("rex", "/both", &[], true, None).await;
    assert!(plain.allowed && plain.reservation.is_none(), "no unit, nothing to reserve: {plain:?}");

    let up = h.usage("uly", "/tokens", &[("input_tokens", 200), ("output_tokens", 100)], true, None).await;
    let id = up.reservation.expect("a reservation id");
    h.usage("uly", "/tokens", &[("output_tokens", 450)], false, Some(&id)).await;
    let over = h.usage("uly", "/tokens", &[("output_tokens", 51)], false, None).await;
    assert_eq!((over.allowed, over.remaining), (false, 50), "450 counted, not 100: {over:?}");
    assert!(h.usage("uly", "/tokens", &[("output_tokens", 50)], false, None).await.allowed);

    // Not the rule's, or from a caller that may not report: nothing settled.
    let other = h.usage("vic", "/spend", &[("cost", 900)], true, None).await.reservation.unwrap();
    let wrong = h.usage("vic", "/tokens", &[("output_tokens", 0)], false, Some(&other)).await;
    assert!(wrong.allowed && wrong.reservation.is_none());
    let headers = HashMap::new();
    let usage = HashMap::from([("cost".to_owned(), 0)]);
    let parsed = ratelimitd::decision::reservation::Reservation::parse(&other).unwrap();
    let untrusted = CheckRequest {
        usage: &usage,
        reservation: Some(&parsed),
        may_report: false,
        ..native("vic", "/spend", 1, Count::Always, &headers)
    };
    h.engine.check(&untrusted).await;
    let spent = h.usage("vic", "/spend", &[("cost", 101)], false, None).await;
    assert_eq!((spent.allowed, spent.remaining), (false, 100), "nothing given back: {spent:?}");
}

/// A budget of 10,000 micro-dollars a month charged from a price table:
/// each request costs its tokens at its model's prices (rounded up once),
/// a `cost` the request states itself is not what is charged, a model the
/// table does not list is refused on a Check and charged the highest
/// prices on a Report.
async fn a_price_table_charges_the_cost_of_the_tokens_by_model(backend: Backend) {
    let h = Harness::default(backend).await;
    let call = |model: &str, usage: &[(&str, u64)], count: Count| {
        let usage: HashMap<String, u64> = usage.iter().map(|(unit, n)| ((*unit).to_owned(), *n)).collect();
        let headers = HashMap::from([("X-Model".to_owned(), model.to_owned())]);
        let engine = h.engine.clone();
        async move {
            engine
                .check(&CheckRequest { usage: &usage, ..native("pia", "/priced", 1, count, &headers) })
                .await
        }
    };
    let cost = |d: &Decision| {
        (d.allowed, d.rule.as_ref().and_then(|r| r.unit.as_deref().map(str::to_owned)), d.remaining)
    };
    // 1,200 x 2.5 + 312 x 10 = 6,120 micro-dollars.
    let first =
        call("gpt-4o", &[("input_tokens", 1_200), ("output_tokens", 312), ("cost", 1)], Count::IfFits).await;
    assert_eq!(cost(&first), (true, Some("cost".to_owned()), 3_880), "{first:?}");
    let over = call("gpt-4o", &[("input_tokens", 400), ("output_tokens", 300)], Count::IfFits).await;
    assert_eq!(cost(&over), (false, Some("cost".to_owned()), 3_880), "4,000 does not fit: {over:?}");
    // 1,000 x 0.15 + 1,001 x 0.6 = 150 + 600.6, rounded up: 751.
    let mini = call("mini", &[("input_tokens", 1_000), ("output_tokens", 1_001)], Count::IfFits).await;
    assert_eq!(cost(&mini), (true, Some("cost".to_owned()), 3_129), "{mini:?}");
    let unknown = call("llama", &[("input_tokens", 10)], Count::IfFits).await;
    assert_eq!((unknown.allowed, unknown.reason, unknown.retry_after_ms), (false, Reason::NoPrice, -1));
    // Reported at the highest prices: 100 x 2.5 + 100 x 10 = 1,250.
    call("llama", &[("input_tokens", 100), ("output_tokens", 100)], Count::Always).await;
    let left = call("mini", &[("input_tokens", 1)], Count::Never).await;
    assert_eq!(cost(&left), (true, Some("cost".to_owned()), 1_879), "{left:?}");
}

/// A reservation not settled within limits.reservation_ttl_ms stays
/// charged at its estimate: a late settlement gives nothing back.
async fn a_reservation_never_settled_stays_charged_at_its_estimate(backend: Backend) {
    let h = Harness::default(backend).await;
    let id = h.usage("eve", "/spend", &[("cost", 300)], true, None).await.reservation.unwrap();
    h.clock.advance(600_001);
    let late = h.usage("eve", "/spend", &[("cost", 0)], false, Some(&id)).await;
    assert!(late.reservation.is_none(), "{late:?}");
    let over = h.usage("eve", "/spend", &[("cost", 701)], false, None).await;
    assert_eq!((over.allowed, over.remaining), (false, 700), "still charged 300: {over:?}");
    assert!(h.usage("eve", "/spend", &[("cost", 700)], false, None).await.allowed);
}

/// Requests in flight through Envoy's API: a descriptor of a `concurrency`
/// limit takes a slot; the same entries with `ratelimitd.release` last
/// (what Envoy sends with `apply_on_stream_done`) give it back, never
/// shed; a caller that may not report cannot release (nothing counted),
/// and a release aimed at a limit that is not of requests in flight
/// counts nothing.
async fn envoy_requests_in_flight_are_released_by_their_release_descriptor(backend: Backend) {
    let h = Harness::default(backend).await;
    let take: &[(&str, &str)] = &[("stream", "s1")];
    let give: &[(&str, &str)] = &[("stream", "s1"), ("ratelimitd.release", "1")];
    for left in [1, 0] {
        let taken = h.rls(&[take]).await;
        assert_eq!((taken.over_limit, taken.statuses[0].remaining), (false, left), "{taken:?}");
    }
    assert!(h.rls(&[take]).await.over_limit, "a third in flight of 2");
    let descriptors = [RlsDescriptor { entries: give.to_vec(), limit: None, hits_addend: None }];
    let untrusted = RlsRequest {
        domain: "edge",
        descriptors: &descriptors,
        hits_addend: 1,
        trace_id: None,
        share: None,
        may_report: false,
    };
    h.engine.should_rate_limit(&untrusted).await;
    assert!(h.rls(&[take]).await.over_limit, "a caller that may not report released nothing");

    h.shedder.publish(Level::CriticalOnly, 0.95);
    let released = h.rls(&[give]).await;
    assert_eq!((released.over_limit, released.reason), (false, Reason::Ok), "never shed: {released:?}");
    h.shedder.publish(Level::Normal, 0.1);
    let again = h.rls(&[take]).await;
    assert_eq!((again.over_limit, again.statuses[0].remaining), (false, 0), "{again:?}");

    h.rls(&[&[("user", "una")]]).await;
    let not_in_flight = h.rls(&[&[("user", "una"), ("ratelimitd.release", "1")]]).await;
    assert!(not_in_flight.statuses[0].limit.is_none(), "{not_in_flight:?}");
    assert_eq!(h.rls(&[&[("user", "una")]]).await.statuses[0].remaining, 0, "the user's count was not moved");
}

/// Levels: 100 output tokens a minute per key, 150 per team, 400
/// micro-dollars a month per organisation, charged all or nothing, the
/// level that binds named; a request without a level's key (absent, or
/// two spellings of the header with two values) is refused, counted
/// nowhere.
async fn a_request_is_charged_to_its_key_its_team_and_its_organisation(backend: Backend) {
    let h = Harness::default(backend).await;
    h.next_second(10_000).await;
    let call = |user: &str, headers: &[(&str, &str)], usage: &[(&str, u64)], count: Count| {
        let usage: HashMap<String, u64> = usage.iter().map(|(unit, n)| ((*unit).to_owned(), *n)).collect();
        let headers: HashMap<String, String> =
            headers.iter().map(|(name, value)| ((*name).to_owned(), (*value).to_owned())).collect();
        let (engine, user) = (h.engine.clone(), user.to_owned());
        async move {
            engine
                .check(&CheckRequest { usage: &usage, ..native(&user, "/levels", 1, count, &headers) })
                .await
        }
    };
    let answer = |d: &Decision| {
        let rule = d.rule.as_ref().unwrap();
        (
            d.allowed,
            rule.level.as_deref().map(str::to_owned),
            rule.unit.as_deref().map(str::to_owned),
            d.remaining,
        )
    };
    let (team_a, team_b) = ([("x-team", "a"), ("x-org", "o")], [("X-Team", "b"), ("X-Org", "o")]);
    let tokens = |n| [("output_tokens", n)];
    assert!(call("alice", &team_a, &tokens(100), Count::IfFits).await.allowed);
    let own = call("alice", &team_b, &tokens(1), Count::IfFits).await;
    assert_eq!(answer(&own), (false, None, Some("output_tokens".into()), 0), "her own key binds: {own:?}");
    let team = call("bob", &team_a, &tokens(60), Count::IfFits).await;
    assert_eq!(answer(&team), (false, Some("team".into()), Some("output_tokens".into()), 50), "{team:?}");
    assert!(call("bob", &team_a, &tokens(50), Count::IfFits).await.allowed, "the refusal counted nothing");
    assert!(!call("carl", &team_a, &tokens(1), Count::IfFits).await.allowed, "team a is spent");
    assert!(call("carl", &team_b, &tokens(100), Count::IfFits).await.allowed, "team b is not");

    assert!(call("dora", &team_b, &[("cost", 300)], Count::IfFits).await.allowed);
    let org = call("ezra", &[("x-team", "c"), ("x-org", "o")], &[("cost", 101)], Count::IfFits).await;
    assert_eq!(answer(&org), (false, Some("org".into()), Some("cost".into()), 100), "{org:?}");
    let other_org = call("ezra", &[("x-team", "c"), ("x-org", "p")], &[("cost", 101)], Count::IfFits).await;
    assert!(other_org.allowed, "{other_org:?}");

    for headers in [&[("x-team", "c")][..], &[("x-team", "c"), ("x-org", "")], &team_a[..1]] {
        for count in [Count::IfFits, Count::Always] {
            let d = call("finn", headers, &[("cost", 1)], count).await;
            assert_eq!(
                (d.allowed, d.reason, d.retry_after_ms),
                (false, Reason::NoLevelKey, -1),
                "{headers:?}"
            );
        }
    }
    let twice = [("x-team", "a"), ("X-TEAM", "z"), ("x-org", "o")];
    let d = call("finn", &twice, &tokens(1), Count::IfFits).await;
    assert_eq!(d.reason, Reason::NoLevelKey, "a caller may not choose which spelling counts: {d:?}");
    let left = call("finn", &[("x-team", "c"), ("x-org", "o")], &[("cost", 100)], Count::IfFits).await;
    assert!(left.allowed, "nothing was counted for the refused ones: {left:?}");
}

impl Harness {
    /// One `ShouldRateLimit` of key `key`'s `budgets` (name, hits), each
    /// descriptor `llm_key=<key>, budget=<name>` and `mark` last when given.
    async fn budgets(
        &self,
        key: &str,
        budgets: &[(&str, u64)],
        mark: Option<(&str, &str)>,
        may_report: bool,
    ) -> RlsDecision {
        let descriptors: Vec<RlsDescriptor<'_>> = budgets
            .iter()
            .map(|(budget, hits)| RlsDescriptor {
                entries: [("llm_key", key), ("budget", *budget)].into_iter().chain(mark).collect(),
                limit: None,
                hits_addend: Some(*hits),
            })
            .collect();
        self.decide_rls(&descriptors, 0, may_report).await
    }

    /// What is left of `key`'s budget `budget` (a 0-hit peek).
    async fn budget_left(&self, key: &str, budget: &str) -> u32 {
        self.budgets(key, &[(budget, 0)], None, true).await.statuses[0].remaining
    }
}

/// Reservations through Envoy's API: descriptors ending in
/// `ratelimitd.reserve` count their estimates and the admitted answer
/// names the reservation; the stream-done descriptors ending in
/// `ratelimitd.settle=<id>` charge the actual usage instead, once however
/// often the call comes; an expired one changes nothing; one that names
/// no reservation counts its usage whole; a caller that may not report
/// settles nothing.
async fn envoy_reservations_are_settled_once_by_their_stream_done_descriptors(backend: Backend) {
    let h = Harness::default(backend).await;
    h.next_second(10_000).await;
    let reserve = Some(("ratelimitd.reserve", "1"));
    let first = h.budgets("k1", &[("output", 400), ("input", 1_200)], reserve, true).await;
    assert!(!first.over_limit, "{first:?}");
    let id = first.reservation.clone().expect("a reservation id");
    assert!(id.starts_with("e1|"), "{id}");
    let parallel = h.budgets("k1", &[("output", 700), ("input", 10)], reserve, true).await;
    assert!(parallel.over_limit && parallel.reservation.is_none(), "400 of 1,000 held: {parallel:?}");
    assert_eq!(h.budget_left("k1", "input").await, 3_800, "the refused request counted nothing");

    let settle = Some(("ratelimitd.settle", &*id));
    h.budgets("k1", &[("output", 100), ("input", 1_300)], settle, false).await;
    assert_eq!(h.budget_left("k1", "output").await, 600, "a caller that may not report settles nothing");
    for _ in 0..2 {
        h.budgets("k1", &[("output", 100), ("input", 1_300)], settle, true).await;
        assert_eq!(h.budget_left("k1", "output").await, 900, "300 given back, once");
        assert_eq!(h.budget_left("k1", "input").await, 3_700, "100 more counted, once");
    }

    let late = h.budgets("k2", &[("daily", 500)], reserve, true).await.reservation.unwrap();
    h.clock.advance(600_001);
    h.budgets("k2", &[("daily", 0)], Some(("ratelimitd.settle", &*late)), true).await;
    let left = h.budget_left("k2", "daily").await;
    // A sliding day: ten minutes decay at most a 144th of it.
    assert!(left < 550, "an expired reservation stays charged: {left} left");

    h.budgets("k3", &[("output", 250)], Some(("ratelimitd.settle", "none")), true).await;
    assert_eq!(h.budget_left("k3", "output").await, 750, "no reservation: the usage is counted whole");
    let plain = h.budgets("k3", &[("output", 10)], None, true).await;
    assert!(!plain.over_limit && plain.reservation.is_none(), "{plain:?}");

    // A slot in flight is taken, not reserved, and no settlement gives it back.
    let slot = h.rls(&[&[("stream", "s9"), ("ratelimitd.reserve", "1")]]).await;
    assert!(!slot.over_limit && slot.reservation.is_none(), "{slot:?}");
    h.rls(&[&[("stream", "s9"), ("ratelimitd.settle", "none")]]).await;
    assert_eq!(h.rls(&[&[("stream", "s9")]]).await.statuses[0].remaining, 0, "one of 2 still taken");
}
