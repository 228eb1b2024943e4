//! The adaptive limits' exchange: the one task per instance that shares
//! each adaptive rule's reported outcomes and reads its limit back
//! (the arithmetic is [`limiter::adaptive`](crate::limiter::adaptive)).
//!
//! Each rule is exchanged once per `adaptive.interval_ms`, in the middle
//! of the interval (aligned to the wall clock, so every instance writes
//! into the interval it means): the instance takes the outcomes reported
//! to it since its last exchange and
//! - with Redis, adds them to the rule's hash (`rla:{adaptive}:<rule>`)
//!   in one script call for every rule due ([`ADAPT_LUA`]), which steps
//!   the limit on the first exchange of an interval and returns it;
//! - with the memory store, does the same in-process ([`exchange`]).
//!
//! The limit that comes back is what every decision of the rule reads
//! until the next exchange. When the exchange fails, the limit in force
//! holds (it never jumps to `min` or `max`) and those outcomes are
//! dropped; the failure is counted and logged once per run of failures.

use std::{
    collections::HashMap,
    fmt::Write as _,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::sync::watch;

use crate::{
    clock::Clock,
    limiter::{
        RedisStore, StoreError,
        adaptive::{ADAPT_LUA, AdaptiveLimit, STATE_TTL_SECONDS, Shared, Tally, exchange, state_key},
    },
    rules::{ENVOY_ADAPTIVE_PREFIX, Hot, RuleStore, adaptive_limits, envoy::EnvoyConfig},
    telemetry::exposition::{Figures, escape, header},
};

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
    /// Exchanges that failed since start.
    failures: AtomicU64,
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
        Adapter { rules, envoy, failures: AtomicU64::new(0) }
    }

    /// Exchanges every adaptive rule due at `now_ms` that `done` (rule →
    /// the interval last exchanged) has not exchanged in its interval yet;
    /// returns when the next one falls due (ms since the epoch), or `None`
    /// when there is no adaptive rule. `Err` when the exchange failed.
    pub async fn tick(
        &self,
        exchange: &Exchange,
        now_ms: u64,
        done: &mut HashMap<Arc<str>, u64>,
    ) -> (Option<u64>, Result<(), StoreError>) {
        // The rule sets stay loaded while their limits are exchanged.
        let (native, envoy) = (self.rules.load(), self.envoy.as_ref().map(|e| e.load()));
        let served = adaptive_limits(&native, envoy.as_deref());
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
            return (next, Ok(()));
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
            self.failures.fetch_add(1, Ordering::Relaxed);
            // Tried once per interval: the next attempt is the next interval's.
            for d in &due {
                done.insert(Arc::clone(&d.id), d.index);
            }
        }
        (next, result)
    }
}

/// One script call for every rule due (their keys share a hash slot),
/// within half the shortest interval (at most a second).
async fn exchange_redis(store: &RedisStore, due: &[Due<'_>]) -> Result<Vec<u64>, StoreError> {
    let mut call = redis::cmd("EVAL");
    call.arg(ADAPT_LUA).arg(due.len());
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
    let mut pipeline = redis::pipe();
    pipeline.add_command(call);
    let timeout = Duration::from_millis((shortest / 2).clamp(10, 1_000));
    let (limits,): (Vec<u64>,) = store.pipeline(&pipeline, timeout).await?;
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

/// Runs the exchange until `stop` turns true.
pub async fn run(
    adapter: Arc<Adapter>,
    exchange: Exchange,
    clock: Arc<dyn Clock>,
    mut stop: watch::Receiver<bool>,
) {
    let mut done = HashMap::new();
    let mut failing = false;
    loop {
        let now = clock.now_ms();
        let (next, result) = adapter.tick(&exchange, now, &mut done).await;
        match (&result, failing) {
            (Err(e), false) => {
                tracing::warn!(error = %e, "cannot exchange adaptive limits: the limits in force hold")
            }
            (Ok(()), true) => tracing::info!("adaptive limits exchanged again"),
            _ => {}
        }
        failing = result.is_err();
        if let Exchange::Local(states) = &exchange {
            let mut states = states.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            states.retain(|id, _| done.contains_key(id));
        }
        // At least once a second, so a rule set swapped in meanwhile starts soon.
        let wait = next.map_or(1_000, |at| at.saturating_sub(clock.now_ms()).clamp(1, 1_000));
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(wait)) => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
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
        header(
            out,
            "ratelimitd_adaptive_exchange_failures_total",
            "counter",
            "Exchanges of the adaptive limits with the store that failed (the limits in force held).",
        );
        let _ = writeln!(
            out,
            "ratelimitd_adaptive_exchange_failures_total {}",
            self.failures.load(Ordering::Relaxed)
        );
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
        let (next, result) = adapter.tick(&local, 10_100, &mut done).await;
        assert!(result.is_ok());
        assert_eq!(next, Some(10_500), "not yet: the middle of the interval");
        report(&adapter, Outcome::Success, 50);
        assert_eq!(adapter.tick(&local, 10_500, &mut done).await.0, Some(11_500));
        assert_eq!(limit(&adapter), 100, "the first exchange of a state starts it");
        report(&adapter, Outcome::Success, 50);
        assert_eq!(adapter.tick(&local, 10_900, &mut done).await.0, Some(11_500), "once per interval");
        assert_eq!(adapter.tick(&local, 11_500, &mut done).await.0, Some(12_500));
        assert_eq!(limit(&adapter), 110, "interval 10 was good");
        report(&adapter, Outcome::Failure, 10);
        report(&adapter, Outcome::Success, 40);
        adapter.tick(&local, 12_600, &mut done).await.1.unwrap();
        assert_eq!(limit(&adapter), 120, "interval 11 (50 successes) was good");
        adapter.tick(&local, 13_600, &mut done).await.1.unwrap();
        assert_eq!(limit(&adapter), 108, "interval 12: 10 of 50 failed");
        adapter.tick(&local, 14_600, &mut done).await.1.unwrap();
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
