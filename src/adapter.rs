//! The adaptive limits' exchange: the periodic exchange (a [`Participant`]
//! of [`crate::limiter::exchange`]) that shares each adaptive rule's
//! reported outcomes and reads its limit back (the arithmetic is
//! [`limiter::adaptive`](crate::limiter::adaptive)).
//!
//! Each rule is exchanged once per `adaptive.interval_ms`, in the middle
//! of the interval (aligned to the wall clock, so every instance writes
//! into the interval it means): the instance takes the outcomes reported
//! to it since its last exchange and
//! - with Redis, adds them to the rule's hash (`rla:{adaptive}:<rule>`)
//!   in one script call for every rule due (`scripts::ADAPT`), which steps
//!   the limit on the first exchange of an interval and returns it;
//! - with the memory store, does the same in-process ([`exchange`]).
//!
//! The limit that comes back is what every decision of the rule reads
//! until the next exchange. When the exchange fails, the limit in force
//! holds (it never jumps to `min` or `max`) and those outcomes are
//! dropped; the exchange mechanism counts the failure and logs a run of
//! them once.

use std::{
    collections::HashMap,
    fmt::Write as _,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures_util::future::BoxFuture;

use crate::{
    limiter::{
        RedisStore, StoreError,
        adaptive::{AdaptiveLimit, STATE_TTL_SECONDS, Shared, Tally, exchange, state_key},
        exchange::Participant,
        scripts,
    },
    rules::{
        ENVOY_ADAPTIVE_PREFIX, Hot, RuleStore, adaptive_limits, adaptive_limits_where, envoy::EnvoyConfig,
    },
    telemetry::exposition::{Figures, escape, header},
};

/// Which adaptive limits an exchange serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every one: the deployment is one region.
    All,
    /// Those of limits that are not global: their state is the region's.
    Regional,
    /// Those of global limits: one state for every region, in the
    /// coordination store, so every region adapts one global limit.
    Global,
}

impl Scope {
    fn global(self) -> Option<bool> {
        match self {
            Scope::All => None,
            Scope::Regional => Some(false),
            Scope::Global => Some(true),
        }
    }
}

/// Where the shared state lives.
#[derive(Debug)]
pub enum Exchange {
    /// In Redis, shared by every instance.
    Redis(Arc<RedisStore>),
    /// In this process (the memory store: the instance is alone).
    Local(Mutex<HashMap<Arc<str>, Shared>>),
}

/// The adaptive rules the exchange task serves, and the figures
/// `/metrics` reads. (The store is the task's alone: the figures outlive
/// it, and must not keep the store's connections open.)
#[derive(Debug)]
pub struct Adapter {
    rules: Arc<RuleStore>,
    envoy: Option<Arc<Hot<EnvoyConfig>>>,
}

/// One rule due for an exchange: its interval index and its outcomes.
struct Due<'r> {
    id: Arc<str>,
    limit: &'r AdaptiveLimit,
    index: u64,
    tally: Tally,
}

impl Adapter {
    /// An adapter for the adaptive rules of `rules` and the adaptive
    /// limits of the Envoy configuration `envoy`, when served.
    pub fn new(rules: Arc<RuleStore>, envoy: Option<Arc<Hot<EnvoyConfig>>>) -> Self {
        Adapter { rules, envoy }
    }

    /// Exchanges every adaptive rule of `scope` due at `now_ms` that `done`
    /// (rule → the interval last exchanged) has not exchanged in its
    /// interval yet; returns when the next one falls due (ms since the
    /// epoch), or `None` when there is no adaptive rule, and how the
    /// exchange went (`None`: none was due).
    pub async fn tick(
        &self,
        (exchange, scope): (&Exchange, Scope),
        now_ms: u64,
        done: &mut HashMap<Arc<str>, u64>,
    ) -> (Option<u64>, Option<Result<(), StoreError>>) {
        // The rule sets stay loaded while their limits are exchanged.
        let (native, envoy) = (self.rules.load(), self.envoy.as_ref().map(|e| e.load()));
        let served = adaptive_limits_where(&native, envoy.as_deref(), scope.global());
        let mut due = Vec::new();
        let mut next: Option<u64> = None;
        for (id, limit) in &served {
            let interval = limit.params.interval_ms;
            let (index, middle) = (now_ms / interval, now_ms / interval * interval + interval / 2);
            let at = if done.get(id) == Some(&index) {
                middle + interval
            } else if now_ms >= middle {
                due.push(Due { id: Arc::clone(id), limit, index, tally: limit.drain() });
                middle + interval
            } else {
                middle
            };
            next = Some(next.map_or(at, |n| n.min(at)));
        }
        let names: std::collections::HashSet<&Arc<str>> = served.iter().map(|(name, _)| name).collect();
        done.retain(|id, _| names.contains(id));
        if due.is_empty() {
            return (next, None);
        }
        let result = match exchange {
            Exchange::Redis(store) => exchange_redis(store, &due).await,
            Exchange::Local(states) => Ok(exchange_local(states, &due)),
        };
        let result = result.map(|limits| {
            for (d, limit) in due.iter().zip(limits) {
                d.limit.set(limit);
                done.insert(Arc::clone(&d.id), d.index);
            }
        });
        if result.is_err() {
            // Tried once per interval: the next attempt is the next interval's.
            for d in &due {
                done.insert(Arc::clone(&d.id), d.index);
            }
        }
        (next, Some(result))
    }
}

/// One script call for every rule due (their keys share a hash slot),
/// within half the shortest interval (at most a second).
async fn exchange_redis(store: &RedisStore, due: &[Due<'_>]) -> Result<Vec<u64>, StoreError> {
    let mut call = scripts::ADAPT.call();
    call.arg(due.len());
    for d in due {
        call.arg(state_key(store.key_prefix(), &d.id));
    }
    let mut shortest = u64::MAX;
    for d in due {
        let (initial, p) = (d.limit.initial, d.limit.params);
        shortest = shortest.min(p.interval_ms);
        call.arg(d.index).arg(initial).arg(p.min).arg(p.max).arg(p.increase);
        call.arg(p.decrease).arg(p.max_failure_ratio);
        call.arg(d.tally.successes).arg(d.tally.failures).arg(d.tally.overloads);
    }
    call.arg(STATE_TTL_SECONDS * 1_000);
    let timeout = Duration::from_millis((shortest / 2).clamp(10, 1_000));
    let answer = store.script(&call, timeout).await?;
    let limits: Vec<u64> = redis::from_redis_value(answer).unwrap_or_default();
    if limits.len() != due.len() {
        return Err(StoreError {
            kind: crate::limiter::FailureKind::ScriptError,
            message: format!("the adaptive script answered {} limits for {} rules", limits.len(), due.len()),
        });
    }
    Ok(limits)
}

/// The same exchange in this process; states of rules no longer served
/// are dropped.
fn exchange_local(states: &Mutex<HashMap<Arc<str>, Shared>>, due: &[Due<'_>]) -> Vec<u64> {
    let mut states = states.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    due.iter()
        .map(|d| {
            let stored = states.get(&d.id).copied();
            let next = exchange(stored, d.index, d.limit.initial, &d.limit.params, d.tally);
            states.insert(Arc::clone(&d.id), next);
            next.limit
        })
        .collect()
}

/// The adaptive limits as a periodic exchange: each rule due in the middle
/// of its interval, and the rule sets looked at again at least once a
/// second, so a rule swapped in meanwhile starts soon.
#[derive(Debug)]
pub struct AdaptiveExchange {
    adapter: Arc<Adapter>,
    exchange: Exchange,
    scope: Scope,
    /// Each rule's interval last exchanged.
    done: HashMap<Arc<str>, u64>,
    /// When the next rule falls due, as the last tick said.
    next: Option<u64>,
}

impl AdaptiveExchange {
    /// The exchange of `adapter`'s limits of `scope` through `exchange`.
    pub fn new(adapter: Arc<Adapter>, exchange: Exchange, scope: Scope) -> Self {
        AdaptiveExchange { adapter, exchange, scope, done: HashMap::new(), next: Some(0) }
    }
}

impl Participant for AdaptiveExchange {
    fn name(&self) -> &'static str {
        match self.scope {
            Scope::Global => "global_adaptive",
            Scope::All | Scope::Regional => "adaptive",
        }
    }

    fn holding(&self) -> &'static str {
        "the adaptive limits in force hold"
    }

    fn due(&mut self, now_ms: u64) -> u64 {
        let soon = now_ms + 1_000;
        self.next.map_or(soon, |at| at.clamp(now_ms + 1, soon))
    }

    fn exchange(&mut self, now_ms: u64) -> BoxFuture<'_, Option<Result<(), StoreError>>> {
        Box::pin(async move {
            let (next, result) =
                self.adapter.tick((&self.exchange, self.scope), now_ms, &mut self.done).await;
            self.next = next;
            if let Exchange::Local(states) = &self.exchange {
                let mut states = states.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                states.retain(|id, _| self.done.contains_key(id));
            }
            result
        })
    }
}

impl Figures for Adapter {
    fn render(&self, out: &mut String) {
        let (native, envoy) = (self.rules.load(), self.envoy.as_ref().map(|e| e.load()));
        let served = adaptive_limits(&native, envoy.as_deref());
        let labels = |name: &str| match name.strip_prefix(ENVOY_ADAPTIVE_PREFIX) {
            Some(key) => format!("kind=\"envoy\",rule=\"{}\"", escape(key)),
            None => format!("kind=\"native\",rule=\"{name}\""),
        };
        header(
            out,
            "ratelimitd_adaptive_limit",
            "gauge",
            "The limit in force of each adaptive limit: a native rule, or an Envoy limit by its full key.",
        );
        for (name, limit) in &served {
            let _ = writeln!(out, "ratelimitd_adaptive_limit{{{}}} {}", labels(name), limit.current());
        }
        header(
            out,
            "ratelimitd_adaptive_outcomes_total",
            "counter",
            "Outcomes reported for each adaptive limit and exchanged, by outcome (a success slower than adaptive.latency_ms counts as overload).",
        );
        for (name, limit) in &served {
            for (outcome, n) in limit.reported() {
                let (labels, outcome) = (labels(name), outcome.as_str());
                let _ =
                    writeln!(out, "ratelimitd_adaptive_outcomes_total{{{labels},outcome=\"{outcome}\"}} {n}");
            }
        }
        header(
            out,
            "ratelimitd_adaptive_outcomes_uncredited_total",
            "counter",
            "Outcomes reported for each adaptive limit beyond what their reporter was admitted on it (this interval and the last): not counted.",
        );
        for (name, limit) in &served {
            let _ = writeln!(
                out,
                "ratelimitd_adaptive_outcomes_uncredited_total{{{}}} {}",
                labels(name),
                limit.uncredited()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::{
        limiter::adaptive::Outcome,
        rules::{self, Hot},
    };

    const RULES: &str = "rules:\n  - { rule_id: a, resource_path: /a, limit: 100, window_seconds: 1, adaptive: { min: 10, max: 200, increase: 10, interval_ms: 1000 } }\n  - { rule_id: f, resource_path: /f, limit: 5, window_seconds: 1 }\n";

    fn adapter() -> Adapter {
        let rules = rules::from_text(Path::new("r.yaml"), RULES, rules::PathForm::default()).unwrap();
        Adapter::new(Arc::new(Hot::new(rules)), None)
    }

    fn limit(adapter: &Adapter) -> u64 {
        adapter.rules.load().rules()[0].adaptive.as_deref().unwrap().current()
    }

    fn report(adapter: &Adapter, outcome: Outcome, n: u64) {
        let limit = adapter.rules.load().rules()[0].adaptive.clone().unwrap();
        limit.admit(b"gateway", n);
        assert_eq!(limit.record(b"gateway", outcome, None, n), n);
    }

    #[tokio::test]
    async fn each_interval_exchanges_once_in_its_middle_and_steps_from_the_last() {
        let adapter = adapter();
        let local = Exchange::Local(Mutex::default());
        let mut done = HashMap::new();
        let (next, result) = adapter.tick((&local, Scope::All), 10_100, &mut done).await;
        assert!(result.is_none(), "nothing due");
        assert_eq!(next, Some(10_500), "not yet: the middle of the interval");
        report(&adapter, Outcome::Success, 50);
        assert_eq!(adapter.tick((&local, Scope::All), 10_500, &mut done).await.0, Some(11_500));
        assert_eq!(limit(&adapter), 100, "the first exchange of a state starts it");
        report(&adapter, Outcome::Success, 50);
        assert_eq!(
            adapter.tick((&local, Scope::All), 10_900, &mut done).await.0,
            Some(11_500),
            "once per interval"
        );
        assert_eq!(adapter.tick((&local, Scope::All), 11_500, &mut done).await.0, Some(12_500));
        assert_eq!(limit(&adapter), 110, "interval 10 was good");
        report(&adapter, Outcome::Failure, 10);
        report(&adapter, Outcome::Success, 40);
        adapter.tick((&local, Scope::All), 12_600, &mut done).await.1.unwrap().unwrap();
        assert_eq!(limit(&adapter), 120, "interval 11 (50 successes) was good");
        adapter.tick((&local, Scope::All), 13_600, &mut done).await.1.unwrap().unwrap();
        assert_eq!(limit(&adapter), 108, "interval 12: 10 of 50 failed");
        adapter.tick((&local, Scope::All), 14_600, &mut done).await.1.unwrap().unwrap();
        assert_eq!(limit(&adapter), 108, "interval 13: nothing reported, the limit holds");
        let mut text = String::new();
        adapter.render(&mut text);
        assert!(text.contains("ratelimitd_adaptive_limit{kind=\"native\",rule=\"a\"} 108"), "{text}");
        assert!(
            text.contains(
                "ratelimitd_adaptive_outcomes_total{kind=\"native\",rule=\"a\",outcome=\"failure\"} 10"
            ),
            "{text}"
        );
        assert!(!text.contains("rule=\"f\""), "fixed rules have no adaptive figures");
    }
}
