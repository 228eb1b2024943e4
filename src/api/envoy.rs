//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`: validates
//! and converts Envoy's request, asks the engine
//! ([`Engine::should_rate_limit`]), and converts the answer back. Every
//! decision, shedding and failure handling included, is the engine's.

use std::{fmt::Write as _, sync::Arc};

use tonic::{Request, Response, Status};
use tracing::Instrument as _;

use super::convert::call_traceparent;
use super::envoy_pb::{
    envoy::{
        config::core::v3::HeaderValue, extensions::common::ratelimit::v3::RateLimitDescriptor,
        r#type::v3::RateLimitUnit,
    },
    rls::{
        RateLimitRequest, RateLimitResponse,
        rate_limit_response::{Code, DescriptorStatus, RateLimit, rate_limit::Unit as ResponseUnit},
        rate_limit_service_server::{RateLimitService, RateLimitServiceServer},
    },
};
use super::envoy_settings::{EnvoyHeaderFormat, EnvoySettings};
use super::ratelimit_headers;
use crate::{
    budget::Refusal,
    decision::{
        Api, Descriptor, DescriptorDecision, Engine, LimitOverride, Reason, RlsDecision, RlsRequest,
        limitador::Call,
    },
    rules::{Hot, XdsState, envoy::Unit, limitador::Limits},
    telemetry::traces::{continue_trace, trace_id_of},
};

/// The Envoy rate limit service.
#[derive(Debug, Clone)]
pub struct EnvoyService {
    pub(super) engine: Engine,
    settings: Arc<EnvoySettings>,
    /// limitador's limits: set, requests are answered as limitador answers
    /// them (every limit of the namespace that applies; no statuses).
    pub(super) limitador: Option<Arc<Hot<Limits>>>,
    /// Envoy's rules over xDS: until the first set is accepted (served
    /// before it with `rules.xds.force_start`), every call is answered
    /// with an error, never with OK, so the gateway's own failure mode
    /// decides (Envoy's `failure_mode_deny` keeps a fail-closed gateway
    /// closed).
    xds: Option<Arc<XdsState>>,
    /// Errors as envoyproxy/ratelimit words them (compat mode), where no
    /// setting decides: its `checkServiceErr` panics, returned to gRPC as
    /// plain errors, so UNKNOWN with its message.
    upstream_errors: bool,
}

impl EnvoyService {
    /// A service deciding with `engine`, validating and answering by `settings`.
    pub fn new(engine: Engine, settings: EnvoySettings) -> Self {
        EnvoyService {
            engine,
            settings: Arc::new(settings),
            limitador: None,
            xds: None,
            upstream_errors: false,
        }
    }

    /// The same service answering from limitador's `limits` instead of
    /// Envoy rules.
    pub fn with_limitador(self, limits: Arc<Hot<Limits>>) -> Self {
        EnvoyService { limitador: Some(limits), ..self }
    }

    /// The same service with its rules over xDS: an error answers every
    /// call until `state` accepts the first set.
    pub fn with_xds(self, state: Arc<XdsState>) -> Self {
        EnvoyService { xds: Some(state), ..self }
    }

    /// The same service wording its errors as envoyproxy/ratelimit does.
    pub fn with_upstream_errors(self) -> Self {
        EnvoyService { upstream_errors: true, ..self }
    }

    /// The tonic server wrapper.
    pub fn into_server(self) -> RateLimitServiceServer<Self> {
        RateLimitServiceServer::new(self)
    }

    /// The answer to a `ShouldRateLimit` refused unread (its message over
    /// `grpc.max_message_bytes`, or its caller holding its share of the
    /// request byte budget): `OVER_LIMIT`, encoded, which Envoy answers its
    /// client 429 whatever its `failure_mode_deny`. A refusal for the
    /// caller's share is flagged with `envoy.error_header` (`caller_busy`):
    /// it was not a decision on the request's limits.
    pub fn refused_unread(&self, refusal: Refusal) -> tonic::codegen::Bytes {
        let mut answer = RateLimitResponse { overall_code: Code::OverLimit as i32, ..Default::default() };
        if refusal == Refusal::CallerBusy && !self.settings.error_header.is_empty() {
            answer
                .response_headers_to_add
                .push(header(&self.settings.error_header, "caller_busy".to_owned()));
        }
        tonic::codegen::Bytes::from(prost::Message::encode_to_vec(&answer))
    }

    /// [`EnvoyService::validate`], a refusal counted under its reason and
    /// answered INVALID_ARGUMENT (an empty domain or no descriptors, in
    /// envoyproxy compat mode, UNKNOWN in upstream's words): for
    /// `ShouldRateLimit` and Kuadrant's calls.
    pub(super) fn admissible(&self, request: &RateLimitRequest) -> Result<(), Status> {
        self.validate(request).map_err(|(reason, message)| {
            self.engine.refused(Api::Envoy, reason);
            match (self.upstream_errors, reason) {
                (true, "empty_domain") => Status::unknown("rate limit domain must not be empty"),
                (true, "no_descriptors") => Status::unknown("rate limit descriptor list must not be empty"),
                _ => Status::invalid_argument(message),
            }
        })
    }

    /// The answer before the first xDS set.
    fn unconfigured(&self) -> Status {
        self.engine.refused(Api::Envoy, "unconfigured");
        if self.upstream_errors {
            Status::unknown("no rate limit configuration loaded")
        } else {
            Status::unavailable(
                "no rate-limit configuration loaded yet: the first xDS set has not arrived \
                 (rules.xds.force_start serves before it)",
            )
        }
    }

    /// Refuses only broken structure (an empty domain; but with limitador's
    /// limits, which read descriptors as maps, no descriptors, an empty
    /// entry list or key) and the counts Envoy's own configuration bounds
    /// (domain length, descriptors, entries). An entry's size never
    /// refuses: the engine counts a long one by its digest. A request limit
    /// with a unit this service does not know is ignored, as if none were
    /// sent (the configured limit applies; counted as `override_ignored`):
    /// a refusal is an error a proxy may answer with "allow". Returns the
    /// refusal's fixed reason and message.
    fn validate(&self, request: &RateLimitRequest) -> Result<(), (&'static str, String)> {
        let settings = &self.settings;
        if request.domain.is_empty() {
            return Err(("empty_domain", "domain: must not be empty".to_owned()));
        }
        if request.domain.len() > settings.max_entry_bytes {
            return Err((
                "domain_too_long",
                format!(
                    "domain: {} bytes exceed the maximum of {} (envoy.max_entry_bytes)",
                    request.domain.len(),
                    settings.max_entry_bytes
                ),
            ));
        }
        // A limitador limit without conditions applies to a request without
        // descriptors.
        if request.descriptors.is_empty() && self.limitador.is_none() {
            return Err(("no_descriptors", "descriptors: must not be empty".to_owned()));
        }
        if request.descriptors.len() > settings.max_descriptors {
            return Err((
                "too_many_descriptors",
                format!(
                    "descriptors: {} exceed the maximum of {} (envoy.max_descriptors)",
                    request.descriptors.len(),
                    settings.max_descriptors
                ),
            ));
        }
        // limitador reads a descriptor as a map: none, or an empty key, is
        // a map too.
        let structured = self.limitador.is_none();
        for (i, d) in request.descriptors.iter().enumerate() {
            if d.entries.is_empty() && structured {
                return Err(("empty_entries", format!("descriptors[{i}].entries: must not be empty")));
            }
            if d.entries.len() > settings.max_entries {
                return Err((
                    "too_many_entries",
                    format!(
                        "descriptors[{i}].entries: {} exceed the maximum of {} (envoy.max_entries)",
                        d.entries.len(),
                        settings.max_entries
                    ),
                ));
            }
            if let Some(j) = d.entries.iter().position(|e| e.key.is_empty())
                && structured
            {
                return Err(("empty_key", format!("descriptors[{i}].entries[{j}].key: must not be empty")));
            }
            if d.limit.as_ref().is_some_and(|limit| override_unit(limit.unit).is_none()) {
                self.engine.adjusted(Api::Envoy, "override_ignored");
            }
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl RateLimitService for EnvoyService {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let (metadata, extensions, request) = request.into_parts();
        if request.domain.is_empty() && self.limitador.is_some() {
            // limitador's answer to a request without a namespace: UNKNOWN,
            // nothing counted (envoy_rls/server.rs).
            self.engine.refused(Api::Envoy, "empty_domain");
            return Ok(Response::new(RateLimitResponse {
                overall_code: Code::Unknown.into(),
                ..Default::default()
            }));
        }
        self.admissible(&request)?;
        if self.xds.as_ref().is_some_and(|state| !state.configured()) {
            return Err(self.unconfigured());
        }
        let span = tracing::info_span!(
            "ratelimit.should_rate_limit",
            otel.kind = "server",
            domain = %request.domain,
            descriptors = request.descriptors.len(),
            reason = tracing::field::Empty,
            overall_code = tracing::field::Empty,
        );
        continue_trace(&span, &metadata);
        let rls = convert(&request, (&metadata, &extensions), true);
        // The engine fills the span's decision fields (it runs inside it).
        if let Some(limits) = &self.limitador {
            let decision =
                self.engine.limitador(&limits.load(), &rls, Call::Admit, None).instrument(span).await;
            let hits = u64::from(request.hits_addend.max(1));
            self.engine.limitador_counted(&request.domain, Call::Admit, &decision, hits);
            let mut answer = response(&decision, &self.settings, (&request.domain, true))?;
            // limitador answers no statuses (its headers, when asked for,
            // carry what they would).
            answer.statuses.clear();
            return Ok(Response::new(answer));
        }
        let decision = self.engine.should_rate_limit(&rls).instrument(span).await;
        let mut answer = response(&decision, &self.settings, (&request.domain, false))?;
        if self.settings.response_dynamic_metadata {
            answer.dynamic_metadata = Some(dynamic_metadata(&request, &decision));
        }
        if let Some(id) = decision.reservation {
            // Whatever `envoy.response_dynamic_metadata` says: the request
            // asked for it (`ratelimitd.reserve`), and its stream-done
            // settlement reads it.
            let value = prost_types::Value { kind: Some(prost_types::value::Kind::StringValue(id.into())) };
            answer
                .dynamic_metadata
                .get_or_insert_with(Default::default)
                .fields
                .insert(RESERVATION_FIELD.to_owned(), value);
        }
        Ok(Response::new(answer))
    }
}

/// The field of the answer's dynamic metadata (Envoy stores it in the
/// filter's namespace, `envoy.filters.http.ratelimit`) naming a
/// reservation, for the stream-done `ratelimitd.settle` entry to read.
pub(super) const RESERVATION_FIELD: &str = "ratelimitd.reservation";

/// Borrows a validated request, received with `metadata` and `extensions`,
/// as the engine's [`RlsRequest`]: no copy. `reports`: the API lets a
/// caller report usage (`ShouldRateLimit`, as its connection allows; not
/// Kuadrant's, whose `Report` is a call of its own).
pub(super) fn convert<'a>(
    request: &'a RateLimitRequest,
    (metadata, extensions): (&'a tonic::metadata::MetadataMap, &'a tonic::Extensions),
    reports: bool,
) -> RlsRequest<'a, RateLimitDescriptor> {
    RlsRequest {
        domain: &request.domain,
        descriptors: &request.descriptors,
        hits_addend: request.hits_addend,
        trace_id: call_traceparent(metadata).and_then(trace_id_of),
        share: super::check::share_of(extensions),
        may_report: reports && super::check::may_report(extensions),
    }
}

/// The engine reads the wire descriptor in place.
impl Descriptor for RateLimitDescriptor {
    fn entries(&self) -> impl Iterator<Item = (&str, &str)> + Clone {
        self.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()))
    }

    fn limit(&self) -> Option<LimitOverride> {
        let limit = self.limit.as_ref()?;
        Some(LimitOverride { requests_per_unit: limit.requests_per_unit, unit: override_unit(limit.unit)? })
    }

    fn hits_addend(&self) -> Option<u64> {
        self.hits_addend
    }
}

/// The unit of a request-supplied limit (`envoy.type.v3.RateLimitUnit`,
/// which has no week).
fn override_unit(value: i32) -> Option<Unit> {
    Some(match RateLimitUnit::try_from(value).ok()? {
        RateLimitUnit::Unknown => return None,
        RateLimitUnit::Second => Unit::Second,
        RateLimitUnit::Minute => Unit::Minute,
        RateLimitUnit::Hour => Unit::Hour,
        RateLimitUnit::Day => Unit::Day,
        RateLimitUnit::Month => Unit::Month,
        RateLimitUnit::Year => Unit::Year,
    })
}

/// The unit as a response's `RateLimit.Unit`.
fn response_unit(unit: Unit) -> ResponseUnit {
    match unit {
        Unit::Second => ResponseUnit::Second,
        Unit::Minute => ResponseUnit::Minute,
        Unit::Hour => ResponseUnit::Hour,
        Unit::Day => ResponseUnit::Day,
        Unit::Week => ResponseUnit::Week,
        Unit::Month => ResponseUnit::Month,
        Unit::Year => ResponseUnit::Year,
    }
}

/// The wire answer for `decision` of a request of `domain` (`limitador`:
/// decided against limitador's limits). A store failure under
/// `envoy.failure_mode: unavailable` is UNAVAILABLE (not UNKNOWN): Envoy
/// then applies its own `failure_mode_deny`.
fn response(
    decision: &RlsDecision,
    settings: &EnvoySettings,
    (domain, limitador): (&str, bool),
) -> Result<RateLimitResponse, Status> {
    if let Some(failure) = &decision.failure {
        return Err(Status::unavailable(format!("counter store unavailable: {failure}")));
    }
    let statuses: Vec<DescriptorStatus> = decision.statuses.iter().map(status).collect();
    let mut response_headers_to_add = Vec::new();
    if settings.response_headers && limitador {
        // limitador's own headers (its order and rounding) under the configured names.
        let names = [&settings.limit_header, &settings.remaining_header, &settings.reset_header];
        let values = super::limitador_http::draft03(decision).into_iter().flatten();
        response_headers_to_add =
            names.into_iter().zip(values).map(|(name, value)| header(name, value)).collect();
    } else if settings.response_headers
        && let Some(index) = decision.tightest
    {
        let policies = |i: usize, out: &mut String| {
            if let Some(limit) = &decision.statuses[i].limit {
                for limit in std::iter::once(&**limit).chain(limit.also.iter().map(|a| &**a)) {
                    let name = limit.name.as_deref().unwrap_or_default();
                    policy(out, limit.per_unit(), limit.window_seconds().unwrap_or(0), name);
                }
            }
        };
        response_headers_to_add = headers(settings, &statuses, policies, index);
    }
    if settings.ratelimit_headers_for(domain)
        && let Some((policies, current)) =
            decision.tightest.and_then(|index| ratelimit_headers::fields(&decision.statuses, index))
    {
        response_headers_to_add.push(header(ratelimit_headers::POLICY_FIELD, policies));
        response_headers_to_add.push(header(ratelimit_headers::RATELIMIT_FIELD, current));
    }
    if matches!(decision.reason, Reason::Shed | Reason::Overload) && !settings.reason_header.is_empty() {
        // Envoy adds these to its 429: the client sees why (a back-off, not a spent quota).
        response_headers_to_add.push(header(&settings.reason_header, decision.reason.as_str().to_owned()));
    }
    // Not decided by the shared store: said to the client (on the 429 and
    // the 200 alike) and to the upstream, so either can tell.
    let mut request_headers_to_add = Vec::new();
    if let Some(kind) = decision.store_error
        && !settings.error_header.is_empty()
    {
        let flag = header(&settings.error_header, kind.as_str().to_owned());
        request_headers_to_add.push(flag.clone());
        response_headers_to_add.push(flag);
    }
    Ok(RateLimitResponse {
        overall_code: if decision.over_limit { Code::OverLimit } else { Code::Ok } as i32,
        statuses,
        response_headers_to_add,
        request_headers_to_add,
        ..Default::default()
    })
}

/// Upstream's dynamic metadata (`RESPONSE_DYNAMIC_METADATA`): `domain`,
/// `descriptors` (each as `entries: ["key=value", …]`, with its `limit`
/// and `hitsAddend` when the request gave them, and — ratelimitd's
/// addition — its `code` and the `limitName` of the limit that applied),
/// `hitsAddend` when not 0,
/// and `metadata`: the `metadata` of every descriptor whose limit passed,
/// merged in request order (the first value of a key wins; mappings merge
/// recursively). Envoy stores it under the filter's namespace, so a route
/// can pick, say, the backend whose quota is left
/// (`%DYNAMIC_METADATA(envoy.filters.http.ratelimit:metadata:…)%`).
fn dynamic_metadata(request: &RateLimitRequest, decision: &RlsDecision) -> prost_types::Struct {
    use prost_types::{ListValue, Struct, Value, value::Kind};
    let text = |s: String| Value { kind: Some(Kind::StringValue(s)) };
    let number = |n: f64| Value { kind: Some(Kind::NumberValue(n)) };
    let list = |values: Vec<Value>| Value { kind: Some(Kind::ListValue(ListValue { values })) };
    let object = |fields: std::collections::BTreeMap<String, Value>| Value {
        kind: Some(Kind::StructValue(Struct { fields })),
    };

    let descriptors = request
        .descriptors
        .iter()
        .zip(&decision.statuses)
        .map(|(d, status)| {
            let mut fields = std::collections::BTreeMap::new();
            // ratelimitd's addition: which limit applied and what it said.
            let code = if status.over_limit { Code::OverLimit } else { Code::Ok };
            fields.insert("code".to_owned(), text(code.as_str_name().to_owned()));
            if let Some(name) = status.limit.as_ref().and_then(|l| l.name.clone()) {
                fields.insert("limitName".to_owned(), text(name));
            }
            let entries = d.entries.iter().map(|e| text(format!("{}={}", e.key, e.value))).collect();
            fields.insert("entries".to_owned(), list(entries));
            if let Some(limit) = &d.limit {
                let unit = RateLimitUnit::try_from(limit.unit).map_or("UNKNOWN", |u| u.as_str_name());
                fields.insert(
                    "limit".to_owned(),
                    text(format!("requests_per_unit:{} unit:{unit}", limit.requests_per_unit)),
                );
            }
            if let Some(hits) = d.hits_addend {
                fields.insert("hitsAddend".to_owned(), number(hits as f64));
            }
            object(fields)
        })
        .collect();
    let mut fields = std::collections::BTreeMap::new();
    fields.insert("domain".to_owned(), text(request.domain.clone()));
    fields.insert("descriptors".to_owned(), list(descriptors));
    if request.hits_addend != 0 {
        fields.insert("hitsAddend".to_owned(), number(f64::from(request.hits_addend)));
    }
    let mut passed = serde_json::Map::new();
    for status in decision.statuses.iter().filter(|s| !s.over_limit) {
        if let Some(metadata) = status.limit.as_ref().and_then(|l| l.metadata.as_deref()) {
            merge(&mut passed, metadata);
        }
    }
    if !passed.is_empty() {
        fields.insert("metadata".to_owned(), to_value(&serde_json::Value::Object(passed)));
    }
    Struct { fields }
}

/// Adds `from`'s keys that `into` lacks; two mappings under one key merge.
fn merge(
    into: &mut serde_json::Map<String, serde_json::Value>,
    from: &serde_json::Map<String, serde_json::Value>,
) {
    for (key, value) in from {
        match (into.get_mut(key), value) {
            (Some(serde_json::Value::Object(mine)), serde_json::Value::Object(theirs)) => merge(mine, theirs),
            (Some(_), _) => {}
            (None, _) => {
                into.insert(key.clone(), value.clone());
            }
        }
    }
}

/// A JSON value as a protobuf `Value`.
fn to_value(json: &serde_json::Value) -> prost_types::Value {
    use prost_types::{ListValue, Struct, value::Kind};
    let kind = match json {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(items) => {
            Kind::ListValue(ListValue { values: items.iter().map(to_value).collect() })
        }
        serde_json::Value::Object(map) => {
            Kind::StructValue(Struct { fields: map.iter().map(|(k, v)| (k.clone(), to_value(v))).collect() })
        }
    };
    prost_types::Value { kind: Some(kind) }
}

fn status(decision: &DescriptorDecision) -> DescriptorStatus {
    DescriptorStatus {
        code: if decision.over_limit { Code::OverLimit } else { Code::Ok } as i32,
        // The limit that binds, of the descriptor's `also` limits too.
        current_limit: decision.limit.as_ref().map(|limit| limit.limit_at(decision.bound)).map(|limit| {
            RateLimit {
                name: limit.name.clone().unwrap_or_default(),
                requests_per_unit: limit.per_unit(),
                unit: limit.unit.map_or(ResponseUnit::Unknown, response_unit) as i32,
            }
        }),
        limit_remaining: decision.remaining,
        duration_until_reset: decision.limit.as_ref().map(|_| duration(decision.until_reset_ms)),
        quota: None,
    }
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue { key: key.to_owned(), value, ..Default::default() }
}

fn duration(ms: u64) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(ms / 1_000).unwrap_or(i64::MAX),
        nanos: i32::try_from((ms % 1_000) * 1_000_000).unwrap_or(0),
    }
}

/// One quota policy of a draft-03 limit header: `, 10;w=60;name="daily"`.
fn policy(out: &mut String, requests_per_unit: u32, window_seconds: u64, name: &str) {
    let _ = write!(out, ", {requests_per_unit};w={window_seconds}");
    if !name.is_empty() {
        let _ = write!(out, ";name=\"{}\"", name.replace(['"', '\\'], ""));
    }
}

/// Limit, remaining and reset (whole seconds, rounded up) of the tightest
/// status, `statuses[tightest]`. In the `draft03` format the limit is
/// followed by every descriptor's quota policies, as Envoy's own
/// `DRAFT_VERSION_03` headers write them: `10, 10;w=60, 1000;w=3600;name="daily"`;
/// `policies(i, out)` writes status `i`'s ([`policy`]): each of its limits,
/// `also` limits included, with its real window (the unit times its
/// `unit_multiplier`, which the wire's unit cannot say).
fn headers(
    settings: &EnvoySettings,
    statuses: &[DescriptorStatus],
    policies: impl Fn(usize, &mut String),
    tightest: usize,
) -> Vec<HeaderValue> {
    let status = &statuses[tightest];
    let limit = status.current_limit.as_ref().map_or(0, |l| l.requests_per_unit);
    let reset_s = status.duration_until_reset.as_ref().map_or(0, |d| d.seconds + i64::from(d.nanos > 0));
    let mut limit = limit.to_string();
    if settings.response_headers_format == EnvoyHeaderFormat::Draft03 {
        for i in 0..statuses.len() {
            policies(i, &mut limit);
        }
    }
    vec![
        header(&settings.limit_header, limit),
        header(&settings.remaining_header, status.limit_remaining.to_string()),
        header(&settings.reset_header, reset_s.to_string()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_merges_first_wins_and_mappings_recursively() {
        let mut into =
            serde_json::json!({ "svc": { "name": "one" }, "tier": "gold" }).as_object().unwrap().clone();
        let from =
            serde_json::json!({ "svc": { "name": "two", "zone": "b" }, "tier": "free", "extra": [1, 2] });
        merge(&mut into, from.as_object().unwrap());
        assert_eq!(
            serde_json::Value::Object(into.clone()),
            serde_json::json!({ "svc": { "name": "one", "zone": "b" }, "tier": "gold", "extra": [1, 2] })
        );
        let value = to_value(&serde_json::Value::Object(into));
        let Some(prost_types::value::Kind::StructValue(s)) = value.kind else { panic!("{value:?}") };
        assert_eq!(s.fields["tier"].kind, Some(prost_types::value::Kind::StringValue("gold".to_owned())));
    }

    /// A unit's window in seconds, as Envoy's draft-03 headers count it (a
    /// month is 30 days, a year 365).
    fn window_seconds(unit: ResponseUnit) -> u64 {
        match unit {
            ResponseUnit::Unknown => 0,
            ResponseUnit::Second => 1,
            ResponseUnit::Minute => 60,
            ResponseUnit::Hour => 3_600,
            ResponseUnit::Day => 86_400,
            ResponseUnit::Week => 604_800,
            ResponseUnit::Month => 2_592_000,
            ResponseUnit::Year => 31_536_000,
        }
    }

    /// The policy of `statuses[i]`'s limit, by its unit.
    fn unit_policies(statuses: &[DescriptorStatus]) -> impl Fn(usize, &mut String) + '_ {
        |i, out| {
            if let Some(l) = &statuses[i].current_limit {
                let window = ResponseUnit::try_from(l.unit).map_or(0, window_seconds);
                policy(out, l.requests_per_unit, window, &l.name);
            }
        }
    }

    #[test]
    fn durations_and_reset_header_round_up() {
        let d = duration(1_500);
        assert_eq!((d.seconds, d.nanos), (1, 500_000_000));
        let status =
            DescriptorStatus { duration_until_reset: Some(d), limit_remaining: 3, ..Default::default() };
        let h = headers(&EnvoySettings::default(), &[status], |_, _| {}, 0);
        assert_eq!((h[1].value.as_str(), h[2].value.as_str()), ("3", "2"));
    }

    #[test]
    fn draft03_lists_every_quota_policy_after_the_tightest_limit() {
        let limit = |requests_per_unit, unit: ResponseUnit, name: &str| RateLimit {
            name: name.to_owned(),
            requests_per_unit,
            unit: unit as i32,
        };
        let statuses = [
            DescriptorStatus {
                current_limit: Some(limit(1000, ResponseUnit::Hour, "")),
                ..Default::default()
            },
            DescriptorStatus::default(), // no limit: no policy
            DescriptorStatus {
                current_limit: Some(limit(10, ResponseUnit::Minute, "per \"user\"")),
                limit_remaining: 4,
                ..Default::default()
            },
        ];
        let draft =
            EnvoySettings { response_headers_format: EnvoyHeaderFormat::Draft03, ..Default::default() };
        let h = headers(&draft, &statuses, unit_policies(&statuses), 2);
        assert_eq!(h[0].value, r#"10, 1000;w=3600, 10;w=60;name="per user""#);
        assert_eq!(h[1].value, "4");
        let plain = headers(&EnvoySettings::default(), &statuses, unit_policies(&statuses), 2);
        assert_eq!(plain[0].value, "10", "plain: the number only");
    }

    #[test]
    fn units_map_both_ways() {
        for (wire, unit) in [
            (1, Unit::Second),
            (2, Unit::Minute),
            (3, Unit::Hour),
            (4, Unit::Day),
            (5, Unit::Month),
            (6, Unit::Year),
        ] {
            assert_eq!(override_unit(wire), Some(unit));
        }
        assert_eq!(override_unit(0), None);
        assert_eq!(override_unit(7), None, "RateLimitUnit has no week");
        assert_eq!(response_unit(Unit::Week) as i32, 7);
        assert_eq!(response_unit(Unit::Month) as i32, 5);
    }
}
