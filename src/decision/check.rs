//! The native entry point, [`Engine::check`]: one request, one rule, one
//! counter per user.

use std::{borrow::Cow, collections::HashMap, sync::Arc};

use tracing::Instrument as _;

use super::{Api, Engine, REPORT_LABEL, Reason, clamp_i64, fallback::Failed, keys};
use crate::{
    config::TenantSource,
    limiter::{Count, FailureKind, Verdict},
    overload::{Kind, OverloadVerdict},
    rules::Mode,
    shed::{Level, Priority, ShedVerdict},
};

/// A validated request. Borrows from the wire message: no copies.
#[derive(Debug, Clone, Copy)]
pub struct CheckRequest<'a> {
    /// The counting dimension (non-empty, bounded).
    pub user_id: &'a str,
    /// Matched against the rules (non-empty, bounded).
    pub resource_path: &'a str,
    /// `None` when the caller did not say.
    pub client_type: Option<&'a str>,
    /// Cost, at least 1.
    pub weight: u32,
    /// `IfFits`: a `Check`; `Never`: a `Check` with `peek` (nothing is
    /// counted); `Always`: a `Report` (counted whatever is left).
    pub count: Count,
    /// `None`: the matched rule's priority.
    pub priority: Option<Priority>,
    /// Request headers (copied into failure records by allow-list).
    pub headers: &'a HashMap<String, String>,
    /// W3C trace id from the call's `traceparent`, if any.
    pub trace_id: Option<&'a str>,
    /// The caller's share of the store's in-flight work; `None`: unbounded.
    pub share: Option<&'a tokio::sync::Semaphore>,
}

/// What the matched rule says about itself in a response.
#[derive(Debug, Clone)]
pub struct RuleInfo {
    /// The rule id.
    pub id: Arc<str>,
    /// Requests per window before burst.
    pub limit: u64,
    /// `floor(limit * burst_capacity)`.
    pub capacity: u64,
    /// Window length in ms.
    pub window_ms: u64,
}

/// The answer to one request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Let the request through?
    pub allowed: bool,
    /// Why.
    pub reason: Reason,
    /// Tokens left after this decision.
    pub remaining: u64,
    /// 0 when allowed; exact ms until the same request passes; -1 never.
    pub retry_after_ms: i64,
    /// ms until the counter has fully decayed.
    pub reset_after_ms: u64,
    /// A shadow rule would have denied.
    pub shadow_denied: bool,
    /// The matched rule, if any.
    pub rule: Option<RuleInfo>,
    /// The priority the request was decided with (its own, else the rule's,
    /// else `shed.default_priority`).
    pub priority: Priority,
    /// The utilization level the request was decided at.
    pub level: Level,
    /// Shedding would have refused this request, but `shed.mode` is shadow.
    pub shadow_shed: bool,
    /// Why the shared store did not decide (the rule's failure policy
    /// did); `None` when it did.
    pub store_error: Option<FailureKind>,
}

impl Decision {
    pub(super) fn allowed(reason: Reason, rule: Option<RuleInfo>, priority: Priority, level: Level) -> Self {
        Decision {
            allowed: true,
            reason,
            remaining: 0,
            retry_after_ms: 0,
            reset_after_ms: 0,
            shadow_denied: false,
            rule,
            priority,
            level,
            shadow_shed: false,
            store_error: None,
        }
    }
}

impl Engine {
    /// Decides one request, counts and times it, and records `rule`,
    /// `reason` and `allowed` on the current span (the caller's request span).
    pub async fn check(&self, request: &CheckRequest<'_>) -> Decision {
        let started = std::time::Instant::now();
        let decision = self.decide(request).await;
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
            capture.record(request, &decision, self.inner.rules.load().version());
        }
        decision
    }

    async fn decide(&self, request: &CheckRequest<'_>) -> Decision {
        let snapshot = self.inner.rules.load();
        let rule = snapshot.lookup(request.resource_path, request.client_type);
        let base = rule.map_or(self.inner.default_priority, |r| r.priority);
        let priority = self.effective_priority(request.priority, base);
        let info = rule.map(|rule| RuleInfo {
            id: Arc::clone(&rule.id),
            limit: rule.limit,
            capacity: rule.window.capacity,
            window_ms: rule.window.window_ms,
        });

        // Shedding comes before anything that costs a store call. The level
        // is read once so the answer and its status agree. A report is never
        // shed: the usage it reports has happened.
        let level = self.inner.shedder.level();
        let verdict = match request.count {
            Count::Always => ShedVerdict::Pass,
            Count::IfFits | Count::Never => self.inner.shedder.check(level, priority),
        };
        let shadow_shed = match verdict {
            ShedVerdict::Pass => false,
            ShedVerdict::ShadowShed => true,
            ShedVerdict::Shed { retry_after_ms } => {
                return Decision {
                    allowed: false,
                    retry_after_ms: clamp_i64(retry_after_ms),
                    ..Decision::allowed(Reason::Shed, info, priority, level)
                };
            }
        };

        let Some(rule) = rule else {
            return Decision { shadow_shed, ..Decision::allowed(Reason::NoRule, None, priority, level) };
        };
        let weight = u64::from(request.weight);
        let shadow = rule.mode == Mode::Shadow;

        // Never admissible: answered from the rule alone, no store call, and a
        // retry_after of -1 so no client loops waiting for it. A report is
        // counted whatever its weight.
        if weight > rule.window.capacity && request.count != Count::Always {
            let base = Decision { shadow_shed, ..Decision::allowed(Reason::Ok, info, priority, level) };
            return if shadow {
                Decision { shadow_denied: true, ..base }
            } else {
                Decision { allowed: false, reason: Reason::WeightExceedsCapacity, retry_after_ms: -1, ..base }
            };
        }

        // The overload layer, in front of the exact counter: a drop costs no
        // store call. Only admissions are counted and dropped (a peek asks,
        // a report tells what happened).
        if request.count == Count::IfFits
            && rule.overload.is_some()
            && let Some(overload) = &self.inner.overload
            && let OverloadVerdict::Drop { retry_after_ms } =
                overload.check(Kind::Native, &rule.id, self.check_tenant(request), shadow)
        {
            return Decision {
                allowed: false,
                retry_after_ms: clamp_i64(retry_after_ms),
                shadow_shed,
                ..Decision::allowed(Reason::Overload, info, priority, level)
            };
        }

        // An over-long user id is counted by its digest, exactly, never refused.
        let user = keys::bounded(request.user_id, self.inner.max_user_id_bytes);
        if matches!(user, Cow::Owned(_)) {
            self.inner.stats.adjusted(Api::Check, "user_id_digest");
        }
        // A denial the store gave for this counter still holds: answered
        // here, exactly as the store would (only enforced admissions and peeks).
        let cache = self.inner.denials.as_ref().filter(|_| !shadow && request.count != Count::Always);
        let version = cache.map(|c| c.version_hash(snapshot.version()));
        if let (Some(cache), Some(version)) = (cache, version)
            && let Some(hit) = cache.lookup(version, &rule.id, &user, weight)
        {
            return Decision {
                allowed: false,
                retry_after_ms: clamp_i64(hit.retry_after_ms),
                reset_after_ms: hit.reset_after_ms,
                shadow_shed,
                ..Decision::allowed(Reason::OverLimit, info, priority, level)
            };
        }
        let _permit = self.caller_permit(request.share).await;
        let store_started = self.store_call_started();
        let decided = self
            .inner
            .store
            .decide(&user, rule.counter(), weight, request.count)
            .instrument(tracing::info_span!("store.decide", store = self.inner.store.name()))
            .await;
        self.store_call_done(store_started, &decided);
        if let (Some(cache), Some(version), Ok(verdict)) = (cache, version, &decided)
            && !verdict.admitted
            && let Some(retry_after_ms) = verdict.retry_after_ms
        {
            cache.insert(version, &rule.id, &user, weight, retry_after_ms, verdict.reset_after_ms);
        }
        match decided {
            Ok(verdict) => Decision { shadow_shed, level, ..from_verdict(&verdict, shadow, info, priority) },
            Err(error) => {
                let failed = Failed { user: &user, weight, info, priority, level, error };
                Decision { shadow_shed, ..self.check_failed(request, rule, failed) }
            }
        }
    }
}

impl Engine {
    /// The tenant of a `Check` request, for the overload layer: the
    /// `user_id` up to the separator, or a header (`overload.tenant_from`).
    fn check_tenant<'r>(&self, request: &CheckRequest<'r>) -> Option<&'r str> {
        let policy = &self.inner.tenants;
        match policy.source {
            TenantSource::UserIdPrefix => {
                request.user_id.split_once(policy.separator.as_str()).map(|(tenant, _)| tenant)
            }
            TenantSource::Header => request.headers.get(&policy.header).map(String::as_str),
        }
    }
}

pub(super) fn from_verdict(
    verdict: &Verdict,
    shadow: bool,
    info: Option<RuleInfo>,
    priority: Priority,
) -> Decision {
    let denied = !verdict.admitted;
    let enforce_denial = denied && !shadow;
    Decision {
        allowed: !enforce_denial,
        reason: if enforce_denial { Reason::OverLimit } else { Reason::Ok },
        remaining: verdict.remaining,
        retry_after_ms: if enforce_denial { verdict.retry_after_ms.map_or(-1, clamp_i64) } else { 0 },
        reset_after_ms: verdict.reset_after_ms,
        shadow_denied: denied && shadow,
        rule: info,
        priority,
        level: Level::Normal,
        shadow_shed: false,
        store_error: None,
    }
}
