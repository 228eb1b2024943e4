//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`: Envoy's
//! external rate limit protocol over the envoyproxy/ratelimit configuration.
//!
//! Semantics follow upstream (lookup, `replaces`, `unlimited`, shadow and
//! quota modes, `hits_addend`, the overall code, the rate-limit headers),
//! with two deliberate differences: counting is a sliding window by default
//! (`envoy.algorithm: fixed_window` restores upstream's), and a request that
//! one enforced descriptor denies consumes nothing from the others.

use std::{collections::HashMap, fmt::Write as _, sync::Arc};

use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::envoy_pb::{
    envoy::{config::core::v3::HeaderValue, extensions::common::ratelimit::v3::RateLimitDescriptor},
    rls::{
        RateLimitRequest, RateLimitResponse,
        rate_limit_response::{Code, DescriptorStatus, RateLimit},
        rate_limit_service_server::{RateLimitService, RateLimitServiceServer},
    },
};
use crate::{
    config::{EnvoyAlgorithm, EnvoyFailureMode, EnvoySettings},
    decision::Reason,
    dlq::{FailedDecision, FailureSink, record::trace_id_of},
    limiter::{ManyItem, Store},
    rules::{
        Hot, Priority,
        envoy::{EnvoyConfig, EnvoyLimit, Unit},
    },
    telemetry::{Api, Metrics, traces::continue_trace},
};

/// The Envoy rate limit service.
#[derive(Debug, Clone)]
pub struct EnvoyService {
    config: Arc<Hot<EnvoyConfig>>,
    store: Store,
    failures: Arc<dyn FailureSink>,
    settings: Arc<EnvoySettings>,
    metrics: Arc<Metrics>,
}

impl EnvoyService {
    /// A service deciding with `config` and `store`.
    pub fn new(
        config: Arc<Hot<EnvoyConfig>>,
        store: Store,
        failures: Arc<dyn FailureSink>,
        settings: EnvoySettings,
        metrics: Arc<Metrics>,
    ) -> Self {
        EnvoyService { config, store, failures, settings: Arc::new(settings), metrics }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
    }

    fn validate(&self, request: &RateLimitRequest) -> Result<(), Status> {
        let invalid = |message: String| Err(Status::invalid_argument(message));
        if request.domain.is_empty() {
            return invalid("domain: must not be empty".to_owned());
        }
        if request.domain.len() > self.settings.max_entry_bytes {
            return invalid(format!(
                "domain: {} bytes exceed the maximum of {} (envoy.max_entry_bytes)",
                request.domain.len(),
                self.settings.max_entry_bytes
            ));
        }
        if request.descriptors.is_empty() {
            return invalid("descriptors: must not be empty".to_owned());
        }
        if request.descriptors.len() > self.settings.max_descriptors {
            return invalid(format!(
                "descriptors: {} exceed the maximum of {} (envoy.max_descriptors)",
                request.descriptors.len(),
                self.settings.max_descriptors
            ));
        }
        for (i, d) in request.descriptors.iter().enumerate() {
            if d.entries.is_empty() {
                return invalid(format!("descriptors[{i}].entries: must not be empty"));
            }
            if d.entries.len() > self.settings.max_entries {
                return invalid(format!(
                    "descriptors[{i}].entries: {} exceed the maximum of {} (envoy.max_entries)",
                    d.entries.len(),
                    self.settings.max_entries
                ));
            }
            if let Some(j) = d.entries.iter().position(|e| e.key.is_empty()) {
                return invalid(format!("descriptors[{i}].entries[{j}].key: must not be empty"));
            }
            if let Some((j, e)) = d
                .entries
                .iter()
                .enumerate()
                .find(|(_, e)| e.key.len() + e.value.len() > self.settings.max_entry_bytes)
            {
                return invalid(format!(
                    "descriptors[{i}].entries[{j}]: {} bytes (key + value) exceed the maximum of {} (envoy.max_entry_bytes)",
                    e.key.len() + e.value.len(),
                    self.settings.max_entry_bytes
                ));
            }
            if let Some(limit) = &d.limit
                && Unit::from_proto(limit.unit).is_none()
            {
                return invalid(format!("descriptors[{i}].limit.unit: unknown unit {}", limit.unit));
            }
        }
        Ok(())
    }
}

/// How one descriptor is decided.
enum Plan {
    /// No limit applies (unmatched, or replaced).
    NoLimit,
    /// `unlimited: true`.
    Unlimited,
    /// Counted: the limit and the item's index in the store call.
    Limited(Arc<EnvoyLimit>, usize),
}

#[tonic::async_trait]
impl RateLimitService for EnvoyService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let started = std::time::Instant::now();
        let span = tracing::info_span!(
            "ratelimit.should_rate_limit",
            otel.kind = "server",
            domain = %request.get_ref().domain,
            descriptors = request.get_ref().descriptors.len(),
            overall_code = tracing::field::Empty,
        );
        continue_trace(&span, request.metadata());
        let answer = self.answer(request).instrument(span.clone()).await;
        if let Ok(response) = &answer {
            span.record(
                "overall_code",
                Code::try_from(response.get_ref().overall_code).map_or("?", |c| c.as_str_name()),
            );
        }
        self.metrics.decision_latency(Api::Envoy, started.elapsed());
        answer
    }
}

impl EnvoyService {
    async fn answer(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let (metadata, _, request) = request.into_parts();
        self.validate(&request)?;
        let config = self.config.load();

        // The limit of each descriptor: a request override, else the configuration.
        let mut limits: Vec<Option<Arc<EnvoyLimit>>> = request
            .descriptors
            .iter()
            .map(|d| match &d.limit {
                Some(o) => Some(Arc::new(EnvoyLimit {
                    full_key: Arc::from(override_key(&request.domain, d)),
                    requests_per_unit: o.requests_per_unit,
                    unit: Unit::from_proto(o.unit),
                    unlimited: false,
                    shadow_mode: false,
                    quota_mode: false,
                    name: None,
                    replaces: Vec::new(),
                    detailed_metric: false,
                })),
                None => config
                    .lookup(&request.domain, d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()))),
            })
            .collect();
        // `replaces`: a named limit that another matched limit replaces does not apply.
        // The limits are `Arc`s: collecting the names clones pointers, not strings.
        let replacing: Vec<Arc<EnvoyLimit>> =
            limits.iter().flatten().filter(|l| !l.replaces.is_empty()).cloned().collect();
        if !replacing.is_empty() {
            for limit in &mut limits {
                let replaced = limit
                    .as_ref()
                    .and_then(|l| l.name.as_deref())
                    .is_some_and(|name| replacing.iter().any(|r| r.replaces.iter().any(|x| x == name)));
                if replaced {
                    *limit = None;
                }
            }
        }

        let sliding = self.settings.algorithm == EnvoyAlgorithm::SlidingWindow;
        let mut items = Vec::new();
        let plans: Vec<Plan> = limits
            .into_iter()
            .zip(&request.descriptors)
            .map(|(limit, d)| match limit {
                None => Plan::NoLimit,
                Some(l) if l.unlimited => Plan::Unlimited,
                Some(l) => {
                    let unit = l.unit.expect("a limited limit has a unit");
                    let hits = d.hits_addend.unwrap_or_else(|| u64::from(request.hits_addend.max(1)));
                    items.push(ManyItem {
                        key: counter_key(unit, d),
                        params: unit.window(l.requests_per_unit, sliding),
                        tick_ms: unit.tick_ms(),
                        weight: hits,
                        // Neither blocks the others: shadow never denies, and
                        // a quota descriptor denies only together with all others.
                        shadow: l.shadow_mode || l.quota_mode,
                    });
                    Plan::Limited(l, items.len() - 1)
                }
            })
            .collect();

        let outcome = if items.is_empty() {
            None
        } else {
            let domain: Arc<str> = Arc::from(request.domain.as_str());
            let store_started = std::time::Instant::now();
            let decided = self
                .store
                .decide_many(&domain, &items)
                .instrument(tracing::info_span!(
                    "store.decide_many",
                    store = self.store.name(),
                    keys = items.len()
                ))
                .await;
            self.metrics.store_call(store_started.elapsed(), decided.as_ref().err().map(|e| e.kind));
            match decided {
                Ok(outcome) => Some(outcome),
                Err(error) => return self.store_failed(&request, &metadata, &plans, &items, &error),
            }
        };

        let mut statuses = Vec::with_capacity(plans.len());
        let (mut enforced_over, mut quota_total, mut quota_over) = (false, 0, 0);
        let mut tightest: Option<(u32, usize)> = None;
        for plan in &plans {
            let status = match plan {
                Plan::NoLimit => {
                    self.metrics.decision(Api::Envoy, None, "NO_RULE", true);
                    DescriptorStatus { code: Code::Ok as i32, ..Default::default() }
                }
                Plan::Unlimited => {
                    self.metrics.decision(Api::Envoy, None, "UNLIMITED", true);
                    DescriptorStatus {
                        code: Code::Ok as i32,
                        limit_remaining: u32::MAX,
                        ..Default::default()
                    }
                }
                Plan::Limited(limit, index) => {
                    let verdict =
                        outcome.as_ref().expect("limited descriptors were decided").verdicts[*index];
                    let over = !verdict.admitted;
                    if limit.quota_mode {
                        quota_total += 1;
                        quota_over += usize::from(over);
                    } else if over && !limit.shadow_mode {
                        enforced_over = true;
                    }
                    let remaining =
                        if over { 0 } else { u32::try_from(verdict.remaining).unwrap_or(u32::MAX) };
                    // Over: exactly when the same hit would pass. Under: when the quota is whole again.
                    let until_ms =
                        if over { verdict.retry_after_ms.unwrap_or(0) } else { verdict.reset_after_ms };
                    let code = if over && !limit.shadow_mode { Code::OverLimit } else { Code::Ok };
                    let reason = if code == Code::OverLimit { "OVER_LIMIT" } else { "OK" };
                    self.metrics.decision(Api::Envoy, Some(&limit.full_key), reason, code == Code::Ok);
                    let rank = if code == Code::OverLimit { 0 } else { remaining };
                    if tightest.is_none_or(|(r, _)| rank < r) {
                        tightest = Some((rank, statuses.len()));
                    }
                    DescriptorStatus {
                        code: code as i32,
                        current_limit: Some(RateLimit {
                            name: limit.name.clone().unwrap_or_default(),
                            requests_per_unit: limit.requests_per_unit,
                            unit: limit.unit.map_or(0, Unit::proto_value),
                        }),
                        limit_remaining: remaining,
                        duration_until_reset: Some(duration(until_ms)),
                        quota: None,
                    }
                }
            };
            statuses.push(status);
        }
        let over = enforced_over || (quota_total > 0 && quota_total == quota_over);
        let mut response = RateLimitResponse {
            overall_code: if over { Code::OverLimit } else { Code::Ok } as i32,
            statuses,
            ..Default::default()
        };
        if self.settings.response_headers
            && let Some((_, index)) = tightest
        {
            response.response_headers_to_add = headers(&self.settings, &response.statuses[index]);
        }
        Ok(Response::new(response))
    }

    /// The store could not decide: record it, then answer by `envoy.failure_mode`.
    fn store_failed(
        &self,
        request: &RateLimitRequest,
        metadata: &tonic::metadata::MetadataMap,
        plans: &[Plan],
        items: &[ManyItem],
        error: &crate::limiter::StoreError,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let answer = match self.settings.failure_mode {
            EnvoyFailureMode::Allow => Reason::FailOpen,
            EnvoyFailureMode::Unavailable => Reason::FailClosed,
        };
        for plan in plans {
            if let Plan::Limited(limit, _) = plan {
                self.metrics.decision(
                    Api::Envoy,
                    Some(&limit.full_key),
                    answer.as_str(),
                    answer == Reason::FailOpen,
                );
            }
        }
        // One record per request, naming the first counted descriptor.
        if let Some((limit, index)) = plans.iter().find_map(|p| match p {
            Plan::Limited(l, i) => Some((l, *i)),
            _ => None,
        }) {
            let headers = HashMap::new();
            let resource = format!("envoy:{}", request.domain);
            self.failures.record(&FailedDecision {
                user_id: &items[index].key,
                resource_path: &resource,
                client_type: None,
                weight: u32::try_from(items[index].weight).unwrap_or(u32::MAX),
                headers: &headers,
                trace_id: metadata.get("traceparent").and_then(|v| v.to_str().ok()).and_then(trace_id_of),
                rule_id: &limit.full_key,
                priority: Priority::Degraded,
                error,
                answer,
            });
        }
        match self.settings.failure_mode {
            // Fail open: every descriptor OK, nothing counted.
            EnvoyFailureMode::Allow => Ok(Response::new(RateLimitResponse {
                overall_code: Code::Ok as i32,
                statuses: plans
                    .iter()
                    .map(|_| DescriptorStatus { code: Code::Ok as i32, ..Default::default() })
                    .collect(),
                ..Default::default()
            })),
            // UNAVAILABLE (not UNKNOWN): Envoy then applies its failure_mode_deny.
            EnvoyFailureMode::Unavailable => {
                Err(Status::unavailable(format!("counter store unavailable: {error}")))
            }
        }
    }
}

/// The counter of one descriptor: its unit and its entries, each as
/// `key=value` with `%`, `=` and `|` percent-encoded so distinct entry lists
/// never share a counter.
fn counter_key(unit: Unit, descriptor: &RateLimitDescriptor) -> String {
    let mut key = String::with_capacity(
        16 + descriptor.entries.iter().map(|e| e.key.len() + e.value.len() + 2).sum::<usize>(),
    );
    let _ = write!(key, "{}", unit.seconds());
    for entry in &descriptor.entries {
        key.push('|');
        escape_into(&mut key, &entry.key);
        key.push('=');
        escape_into(&mut key, &entry.value);
    }
    key
}

fn escape_into(out: &mut String, text: &str) {
    if !text.contains(['%', '=', '|']) {
        out.push_str(text);
        return;
    }
    for c in text.chars() {
        match c {
            '%' => out.push_str("%25"),
            '=' => out.push_str("%3D"),
            '|' => out.push_str("%7C"),
            c => out.push(c),
        }
    }
}

fn override_key(domain: &str, descriptor: &RateLimitDescriptor) -> String {
    let mut key = domain.to_owned();
    for entry in &descriptor.entries {
        key.push('.');
        key.push_str(&entry.key);
        key.push('_');
        key.push_str(&entry.value);
    }
    key
}

fn duration(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(ms / 1_000).unwrap_or(i64::MAX),
        nanos: i32::try_from((ms % 1_000) * 1_000_000).unwrap_or(0),
    }
}

/// Limit, remaining and reset (whole seconds, rounded up) of `status`.
fn headers(settings: &EnvoySettings, status: &DescriptorStatus) -> Vec<HeaderValue> {
    let header = |key: &str, value: String| HeaderValue { key: key.to_owned(), value, ..Default::default() };
    let limit = status.current_limit.as_ref().map_or(0, |l| l.requests_per_unit);
    let reset_s = status.duration_until_reset.as_ref().map_or(0, |d| d.seconds + i64::from(d.nanos > 0));
    vec![
        header(&settings.limit_header, limit.to_string()),
        header(&settings.remaining_header, status.limit_remaining.to_string()),
        header(&settings.reset_header, reset_s.to_string()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::envoy_pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;

    fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
        RateLimitDescriptor {
            entries: entries
                .iter()
                .map(|(k, v)| Entry { key: (*k).to_owned(), value: (*v).to_owned() })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn counter_keys_never_collide() {
        let a = counter_key(Unit::Second, &descriptor(&[("a", "b|c=d")]));
        let b = counter_key(Unit::Second, &descriptor(&[("a", "b"), ("c", "d")]));
        assert_ne!(a, b);
        assert_eq!(b, "1|a=b|c=d");
        assert_ne!(
            counter_key(Unit::Second, &descriptor(&[("a", "b")])),
            counter_key(Unit::Minute, &descriptor(&[("a", "b")]))
        );
    }

    #[test]
    fn durations_and_reset_header_round_up() {
        let d = duration(1_500);
        assert_eq!((d.seconds, d.nanos), (1, 500_000_000));
        let status =
            DescriptorStatus { duration_until_reset: Some(d), limit_remaining: 3, ..Default::default() };
        let h = headers(&EnvoySettings::default(), &status);
        assert_eq!((h[1].value.as_str(), h[2].value.as_str()), ("3", "2"));
    }

    #[test]
    fn proto_module_is_mounted() {
        let _ = crate::api::envoy_pb::rls::RateLimitRequest::default();
    }
}
