//! The decision engine (docs/design.md §3): the one place that decides, for every
//! API. `api/` validates and converts; `Check` enters at
//! [`Engine::check`], Envoy's `ShouldRateLimit` at
//! [`Engine::should_rate_limit`]. Both go through the same steps in the same
//! order: rule lookup, priority, shedding (no store call when shed), the
//! store call, the failure policy with exactly one [`FailedDecision`] for
//! the dead-letter sink, shadow mode, metrics ([`Stats`]) and the span's
//! decision fields. The API opens the request span (it alone sees the
//! caller's trace context in gRPC metadata); the engine runs inside it and
//! records what it decided.
//!
//! Architecture invariants:
//! - every method of [`Engine`] is in this file or `pipeline.rs`: the
//!   steps of each API are functions and types of their own files
//!   (`check.rs`, `envoy/`), so tidy's folder check sees every loop
//!   between them;
//! - no generated (protobuf) types here;
//! - the engine owns the traits it reports through ([`FailureSink`],
//!   [`Stats`]): `dlq` depends on `decision`, never the other way round,
//!   and `telemetry` depends on neither;
//! - no lock is held across an `.await` (snapshots are `Arc`s, stores lock
//!   only inside synchronous calls).

mod check;
pub mod denials;
mod envoy;
mod failure;
pub mod keys;
pub mod limitador;
pub mod limitador_metrics;
pub mod metrics;
mod pipeline;
pub mod reservation;
pub mod shares;
#[cfg(test)]
mod tests;
pub mod upstream_metrics;

use std::{fmt, sync::Arc, time::Duration};

pub use check::{CheckRequest, Decision, NO_USAGE, RuleInfo};
pub use envoy::{
    Descriptor, DescriptorDecision, EnvoyCall, EnvoyFailure, EnvoyPolicy, LimitOverride, OwnedDescriptor,
    RlsDecision, RlsDescriptor, RlsRequest,
};
pub use failure::{FailedDecision, FailureSink};

pub use denials::DenialCache;
pub use limitador_metrics::LimitadorStats;
pub use metrics::{DecisionMetrics, Saved};
pub use shares::TenantShares;
pub use upstream_metrics::{LimitHits, UpstreamStats};

use crate::{
    limiter::{Count, FailureKind, Store, StoreError, grants::Grants, local::LocalLimiter, window::Verdict},
    overload::Overload,
    rules::{Hot, RuleStore, envoy::EnvoyConfig},
    shed::{Priority, Shedder},
};

/// The `reason` metric label of a counted report (native `Report`, an
/// Envoy `report_mode` descriptor): it refuses nothing, so it is never
/// counted as OK or OVER_LIMIT.
pub const REPORT_LABEL: &str = "REPORT";

/// `retry_after_ms` of a FAIL_CLOSED answer (capped at the rule's window).
pub const FAIL_CLOSED_RETRY_MS: u64 = 1_000;

/// Why a decision came out as it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// Within the limit, or over it under a shadow rule (`shadow_denied`).
    Ok,
    /// Over the limit.
    OverLimit,
    /// Refused by priority load shedding; no counter was touched.
    Shed,
    /// No rule matches.
    NoRule,
    /// The store failed; the rule fails open.
    FailOpen,
    /// The store failed; the rule fails closed (or the local limiter that
    /// would have decided is at its bound).
    FailClosed,
    /// The store failed; admitted by the local limiter at this instance's
    /// share of the limit (counted locally, written back later).
    LocalOk,
    /// The store failed; over this instance's share of the limit.
    LocalOverLimit,
    /// The weight exceeds the rule's capacity: it can never pass.
    WeightExceedsCapacity,
    /// Dropped by the overload layer; no counter was touched.
    Overload,
    /// The rule prices its cost by model and the request's model has no
    /// price: it can never pass as it is; nothing counted.
    NoPrice,
    /// The rule charges a level (`levels:`) whose key the request does
    /// not carry (its header absent, empty, or sent twice with two
    /// values): nothing counted.
    NoLevelKey,
}

impl Reason {
    /// The API name.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Ok => "OK",
            Reason::OverLimit => "OVER_LIMIT",
            Reason::Shed => "SHED",
            Reason::NoRule => "NO_RULE",
            Reason::FailOpen => "FAIL_OPEN",
            Reason::FailClosed => "FAIL_CLOSED",
            Reason::LocalOk => "LOCAL_OK",
            Reason::LocalOverLimit => "LOCAL_OVER_LIMIT",
            Reason::WeightExceedsCapacity => "WEIGHT_EXCEEDS_CAPACITY",
            Reason::Overload => "OVERLOAD",
            Reason::NoPrice => "NO_PRICE",
            Reason::NoLevelKey => "NO_LEVEL_KEY",
        }
    }
}

/// Which API a decision came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// `ratelimit.v1.RateLimiter/Check`.
    Check,
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` (one per descriptor).
    Envoy,
}

impl Api {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Check => "check",
            Api::Envoy => "envoy",
        }
    }
}

/// Where the engine counts what it decides, in its own terms; what a
/// drop-in API also counts in its upstream's metric families is declared
/// beside those families ([`UpstreamStats`], [`LimitadorStats`]). Called on
/// the hot path: implementations only add to atomics.
pub trait Stats: UpstreamStats + LimitadorStats + Send + Sync + fmt::Debug {
    /// One decision (for Envoy: one per descriptor). `rule` is a configured
    /// id or key, or a fixed label: never a request value.
    fn decision(&self, api: Api, rule: Option<&Arc<str>>, reason: &'static str, allowed: bool);
    /// The whole time of one request through `api`.
    fn decision_latency(&self, api: Api, elapsed: Duration);
    /// One store call, its time when it was timed ([`Store::is_remote`]:
    /// an in-process call takes less than the two clock reads that would
    /// time it), and, if it failed, its kind.
    fn store_call(&self, elapsed: Option<Duration>, failure: Option<FailureKind>);
    /// A request value the engine adjusted instead of refusing: `what` is a
    /// fixed name (`user_id_digest`, `entry_digest`, `override_ignored`).
    fn adjusted(&self, api: Api, what: &'static str);
    /// A request refused as malformed (INVALID_ARGUMENT): `reason` is a
    /// fixed name of the broken structure, never a request value.
    fn refused(&self, api: Api, reason: &'static str);
}

/// Receives a sample of decided `Check` and `ShouldRateLimit` requests
/// (`capture.*`), for replay. Called on the hot path: `wants` is a hash
/// and a comparison, `record` only enqueues.
pub trait CaptureSink: Send + Sync + fmt::Debug {
    /// Whether requests of `user_id` are captured (the same answer for every
    /// request of a user, on every instance).
    fn wants(&self, user_id: &str) -> bool;
    /// Captures one decided request, decided under rules `rules_version`.
    fn record(&self, request: &CheckRequest<'_>, decision: &Decision, rules_version: &str);
    /// Whether an Envoy request of `domain` whose first descriptor has
    /// `first_entries` is captured (the same answer for every such request).
    fn wants_envoy(&self, domain: &str, first_entries: &mut dyn Iterator<Item = (&str, &str)>) -> bool;
    /// Captures one decided Envoy request, decided under the Envoy
    /// configuration (or limitador's limits) `envoy_version`; `count` says
    /// how it counted (limitador's `CheckRateLimit` peeks, its `Report`
    /// counts whatever is left).
    fn record_envoy(&self, call: EnvoyCall, count: Count, decision: &RlsDecision, envoy_version: &str);
}

/// A [`Stats`] that counts nothing (tools and tests that do not scrape).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoStats;

impl Stats for NoStats {
    fn decision(&self, _: Api, _: Option<&Arc<str>>, _: &'static str, _: bool) {}
    fn decision_latency(&self, _: Api, _: Duration) {}
    fn store_call(&self, _: Option<Duration>, _: Option<FailureKind>) {}
    fn adjusted(&self, _: Api, _: &'static str) {}
    fn refused(&self, _: Api, _: &'static str) {}
}

impl UpstreamStats for NoStats {
    fn limit_hits(&self, _: &str, _: LimitHits) {}
    fn envoy_failed(&self) {}
}

impl LimitadorStats for NoStats {
    fn limitador(&self, _: &str, _: limitador_metrics::Outcome<'_>) {}
}

/// Everything an [`Engine`] decides with.
#[derive(Debug)]
pub struct EngineParts {
    /// Native rules, hot-swapped.
    pub rules: Arc<RuleStore>,
    /// The Envoy configuration, hot-swapped; `None` when not served (every
    /// descriptor is then unmatched).
    pub envoy: Option<Arc<Hot<EnvoyConfig>>>,
    /// Where counters live.
    pub store: Store,
    /// What decides, at this instance's share, when the store cannot
    /// (failure policy `local`).
    pub local: Arc<LocalLimiter>,
    /// The current utilization level and shed counters.
    pub shedder: Arc<Shedder>,
    /// Receives decisions the store could not make.
    pub failures: Arc<dyn FailureSink>,
    /// Counts decisions.
    pub stats: Arc<dyn Stats>,
    /// Priority of a request that states none and matches no rule (`shed.default_priority`).
    pub default_priority: Priority,
    /// A longer `user_id` is counted by its digest (`limits.max_user_id_bytes`).
    pub max_user_id_bytes: usize,
    /// A priority the request states replaces the rule's or the default
    /// (`true`), or may only lower it (`false`: no caller can make itself
    /// more important) (`shed.trust_request_priority`).
    pub trust_request_priority: bool,
    /// How Envoy requests are prioritised, counted and failed.
    pub envoy_policy: EnvoyPolicy,
    /// Where a sample of decided `Check` requests goes (`capture.*`); `None`: off.
    pub capture: Option<Arc<dyn CaptureSink>>,
    /// The overload layer (`overload.*`); `None`: no request is dropped by it.
    pub overload: Option<Arc<Overload>>,
    /// Where a request's tenant is read from, for the overload layer and
    /// the tenants' shares of the store.
    pub tenants: TenantPolicy,
    /// Each tenant's share of the store's in-flight calls
    /// (`grpc.max_store_calls_per_tenant`); `None`: no tenant table, the
    /// memory store, or unbounded.
    pub tenant_shares: Option<Arc<TenantShares>>,
    /// The local cache of exact denials (`denial_cache.*`); `None`: off.
    pub denials: Option<Arc<DenialCache>>,
    /// This region's grants of the global limits (`global.*`); `None`: no
    /// other region, a global limit is enforced whole.
    pub grants: Option<Arc<Grants>>,
    /// What places a calendar period's edges (`period:`) and a
    /// reservation's expiry: the system clock, or a test's.
    pub clock: Arc<dyn crate::clock::Clock>,
    /// How long a reservation may be settled (`limits.reservation_ttl_ms`).
    pub reservation_ttl_ms: u64,
}

impl EngineParts {
    /// Parts deciding `rules` against `store`, everything else at the
    /// defaults of a tool that decides on its own: no Envoy configuration,
    /// shedding and the overload layer off, failures discarded ([`Discard`]),
    /// nothing counted, request priorities trusted, `limits.*` and
    /// `envoy.*` at their defaults. `server` replaces every part from the
    /// configuration.
    pub fn new(rules: Arc<RuleStore>, store: Store) -> Self {
        EngineParts {
            rules,
            envoy: None,
            store,
            local: Arc::new(LocalLimiter::new(Default::default(), Arc::new(crate::clock::SystemClock))),
            shedder: Arc::new(Shedder::new(crate::shed::ShedMode::Off, 0)),
            failures: Arc::new(Discard),
            stats: Arc::new(NoStats),
            default_priority: Priority::Degraded,
            max_user_id_bytes: 256,
            trust_request_priority: true,
            envoy_policy: EnvoyPolicy::default(),
            capture: None,
            overload: None,
            tenants: TenantPolicy::default(),
            tenant_shares: None,
            denials: None,
            grants: None,
            clock: Arc::new(crate::clock::SystemClock),
            reservation_ttl_ms: reservation::DEFAULT_TTL_MS,
        }
    }
}

/// A [`FailureSink`] that keeps nothing: for tools whose store cannot fail
/// (replay's memory store) and tests that do not look.
#[derive(Debug, Default, Clone, Copy)]
pub struct Discard;

impl FailureSink for Discard {
    fn record(&self, _: &FailedDecision<'_>) {}
}

/// Where a request's tenant is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TenantSource {
    /// `Check`: the `user_id` up to the first `overload.tenant_separator`
    /// (`acme:alice` → `acme`); an id without it has no tenant.
    #[default]
    UserIdPrefix,
    /// `Check`: the request header `overload.tenant_header`.
    Header,
}

/// Where a request's tenant comes from (`overload.tenant_*`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantPolicy {
    /// `Check`: a `user_id` prefix or a header.
    pub source: TenantSource,
    /// The separator ending a `user_id`'s tenant prefix.
    pub separator: String,
    /// The header naming the tenant.
    pub header: String,
    /// Envoy: the descriptor entry key whose value is the tenant.
    pub descriptor_key: String,
}

impl Default for TenantPolicy {
    fn default() -> Self {
        TenantPolicy {
            source: TenantSource::UserIdPrefix,
            separator: ":".to_owned(),
            header: "x-tenant".to_owned(),
            descriptor_key: "tenant".to_owned(),
        }
    }
}

/// Runs the decision path. Cheap to clone: everything inside is shared.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<EngineParts>,
    /// The metric label of request-supplied limits (a fixed value, never the request's).
    override_label: Arc<str>,
}

impl Engine {
    /// An engine deciding with `parts`.
    pub fn new(parts: EngineParts) -> Self {
        Engine { inner: Arc::new(parts), override_label: Arc::from(envoy::OVERRIDE_LABEL) }
    }

    /// The native rule store (for reloads and status).
    pub fn rules(&self) -> &Arc<RuleStore> {
        &self.inner.rules
    }

    /// The counter store.
    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    /// The local limiter (failure policy `local`).
    pub fn local(&self) -> &Arc<LocalLimiter> {
        &self.inner.local
    }

    /// The shedder.
    pub fn shedder(&self) -> &Arc<Shedder> {
        &self.inner.shedder
    }

    /// Decides one `Check` (a peek, a `Report`), counts and times it, and
    /// records `rule`, `reason` and `allowed` on the current span (the
    /// caller's request span).
    pub async fn check(&self, request: &CheckRequest<'_>) -> Decision {
        let started = std::time::Instant::now();
        // One snapshot from lookup to answer, the capture's version included.
        let snapshot = self.inner.rules.load();
        let decision = check::decide(self, &snapshot, request).await;
        let span = tracing::Span::current();
        if let Some(rule) = &decision.rule {
            span.record("rule", &*rule.id);
        }
        span.record("reason", decision.reason.as_str());
        span.record("allowed", decision.allowed);
        // A report refuses nothing: it is counted as REPORT, never as a denial.
        let (label, allowed) = match (request.count, decision.reason) {
            (Count::Always, Reason::Ok | Reason::OverLimit) => (REPORT_LABEL, true),
            _ => (decision.reason.as_str(), decision.allowed),
        };
        self.inner.stats.decision(Api::Check, decision.rule.as_ref().map(|r| &r.id), label, allowed);
        self.inner.stats.decision_latency(Api::Check, started.elapsed());
        if let Some(capture) = &self.inner.capture
            && capture.wants(request.user_id)
        {
            capture.record(request, &decision, snapshot.version());
        }
        decision
    }

    /// Decides one `ShouldRateLimit`, counts and times it (each descriptor
    /// is counted where it is answered, `envoy/answer.rs`), and records
    /// `reason` and `overall_code` on the current span.
    pub async fn should_rate_limit<D: Descriptor>(&self, request: &RlsRequest<'_, D>) -> RlsDecision {
        let started = std::time::Instant::now();
        // One configuration from lookup to answer, the capture's version included.
        let config = self.inner.envoy.as_ref().map(|hot| hot.load());
        let decision = self.run(envoy::Rls::new(self, config.as_deref(), request)).await;
        if !decision.over_limit {
            envoy::admit_reporters(request, &decision);
        }
        envoy::capture(self, config.as_deref(), request, &decision);
        self.envoy_decided(&decision, started);
        decision
    }

    /// What every Envoy-API decision records once taken at `started`: its
    /// reason and overall code on the current span, a store failure, the
    /// latency.
    fn envoy_decided(&self, decision: &RlsDecision, started: std::time::Instant) {
        let span = tracing::Span::current();
        span.record("reason", decision.reason.as_str());
        span.record("overall_code", if decision.over_limit { "OVER_LIMIT" } else { "OK" });
        if decision.store_error.is_some() {
            self.inner.stats.envoy_failed();
        }
        self.inner.stats.decision_latency(Api::Envoy, started.elapsed());
    }

    /// Decides a limitador request (its domain is the namespace) under
    /// `limits`: every limit that applies is a counter, all or nothing
    /// (`call`: admitted, checked without counting, or reported), each by
    /// `hits` (0 included) or else the request's `hits_addend`. A
    /// request whose evaluation fails (not a missing key: a condition that
    /// is no boolean, a descriptor it lacks) is refused, never admitted.
    pub async fn limitador<D: Descriptor>(
        &self,
        limits: &crate::rules::limitador::Limits,
        request: &RlsRequest<'_, D>,
        call: limitador::Call,
        hits: Option<u64>,
    ) -> RlsDecision {
        limitador::decide(self, limits, request, call, hits).await
    }

    /// Counts a limitador call of `namespace` whose `hits` were decided
    /// as `decision` in limitador's metric families, as limitador counts
    /// its calls: `ShouldRateLimit` and `check_and_report` (`Admit`),
    /// `CheckRateLimit` (`Check`) and Kuadrant's `Report`; never one the
    /// store could not answer. (limitador's HTTP `check` and `report`
    /// count nothing.)
    pub fn limitador_counted(
        &self,
        namespace: &str,
        call: limitador::Call,
        decision: &RlsDecision,
        hits: u64,
    ) {
        limitador::counted(self, namespace, call, decision, hits);
    }

    /// `namespace`'s counters under `limits` (limitador's `GET
    /// /counters/{namespace}`): the store's keys of the namespace listed
    /// (at most [`limitador::MAX_LISTED_COUNTERS`]), each that names one of
    /// its limits read without counting, 64 per store call. A store that
    /// cannot answer is an error.
    pub async fn limitador_counters<'l>(
        &self,
        limits: &'l crate::rules::limitador::Limits,
        namespace: &str,
    ) -> Result<limitador::Counters<'l>, crate::limiter::StoreError> {
        limitador::counters(self, limits, namespace).await
    }

    /// Counts a request the API refused as malformed, under a fixed reason.
    pub fn refused(&self, api: Api, reason: &'static str) {
        self.inner.stats.refused(api, reason);
    }

    /// Counts a request value the API adjusted instead of refusing, under
    /// a fixed name.
    pub fn adjusted(&self, api: Api, what: &'static str) {
        self.inner.stats.adjusted(api, what);
    }

    /// The share of the store a request of `tenant` draws on, when tenants
    /// have shares (the tenant is then read; otherwise not).
    fn tenant_share<'r>(
        &self,
        tenant: impl FnOnce() -> Option<&'r str>,
    ) -> Option<Arc<tokio::sync::Semaphore>> {
        self.inner.tenant_shares.as_ref().map(|shares| shares.of(tenant()))
    }
}

impl Engine {
    /// The priority a request is decided with: what it `stated` over the
    /// `base` (the rule's, the domain's or the default), or, when request
    /// priorities are not trusted, only ever the less important of the two.
    fn effective_priority(&self, stated: Option<Priority>, base: Priority) -> Priority {
        match stated {
            None => base,
            Some(stated) if self.inner.trust_request_priority => stated,
            Some(stated) => base.least_important(stated),
        }
    }

    /// When a store call starts, if it is timed: only a call that leaves
    /// the process is ([`Store::is_remote`]: an in-process call takes less
    /// than the two clock reads that would time it).
    fn store_call_started(&self) -> Option<std::time::Instant> {
        self.inner.store.is_remote().then(std::time::Instant::now)
    }

    /// Counts one store call begun at `started` ([`Self::store_call_started`]):
    /// its time, if timed, and its failure kind.
    fn store_call_done<T>(&self, started: Option<std::time::Instant>, decided: &Result<T, StoreError>) {
        let elapsed = started.map(|t| t.elapsed());
        if let Some(elapsed) = elapsed {
            self.inner.shedder.record_latency(elapsed);
        }
        self.inner.stats.store_call(elapsed, decided.as_ref().err().map(|e| e.kind));
    }
}

pub(crate) fn clamp_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
