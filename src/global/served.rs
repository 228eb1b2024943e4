//! The global limits served now: a native rule's first limit (`global:
//! true`) or an Envoy descriptor's `rate_limit` (`global: true`), each with
//! how its region's counter of a key is peeked at.

use std::sync::Arc;

use crate::{
    limiter::{Algorithm, Count, ManyItem, Store, StoreError, WindowParams, adaptive::AdaptiveLimit},
    rules::{
        Rule, Snapshot,
        envoy::{EnvoyConfig, params, tick_ms},
        model::capacity,
    },
};

/// One global limit.
#[derive(Debug, Clone)]
pub struct Served {
    /// Its id: the rule's id or the descriptor's full key.
    pub id: Arc<str>,
    /// What all regions together may admit per window (an adaptive
    /// limit's value in force).
    pub limit: u64,
    /// The most it can be: an adaptive limit's `max`, else `limit`. A
    /// region's counter never holds more than that.
    pub most: u64,
    /// Its window in ms and its algorithm (for demand per window and how
    /// long admissions linger).
    pub window: WindowParams,
    counter: Counter,
}

/// The most a limit now at `limit` can be: an adaptive limit's `max`.
fn most(adaptive: Option<&AdaptiveLimit>, limit: u64) -> u64 {
    adaptive.map_or(limit, |a| a.params.max.max(limit))
}

/// How a key's counter is reached.
#[derive(Debug, Clone)]
enum Counter {
    /// A native rule's: the user's counter of the rule.
    Native(Box<Rule>),
    /// An Envoy descriptor's: the counter key in its domain.
    Envoy { domain: Arc<str>, seconds: u64, algorithm: Algorithm },
}

impl Served {
    /// Every global limit of the native rules `native` and the Envoy
    /// configuration `envoy` (its limits' algorithm unset: `algorithm`).
    pub fn all(native: &Snapshot, envoy: Option<&EnvoyConfig>, algorithm: Algorithm) -> Vec<Served> {
        let mut out: Vec<Served> = native
            .rules()
            .iter()
            .filter(|r| r.global)
            .map(|rule| {
                // An adaptive rule's limit in force.
                let (limit, window) = rule.limit_at(0);
                let most = most(rule.adaptive.as_deref(), limit);
                Served {
                    id: Arc::clone(&rule.id),
                    limit,
                    most,
                    window,
                    counter: Counter::Native(Box::new(rule.clone())),
                }
            })
            .collect();
        for (domain, limit) in envoy.map(EnvoyConfig::limits_by_domain).unwrap_or_default() {
            let Some(seconds) = limit.window_seconds().filter(|_| limit.global) else { continue };
            let algorithm = limit.algorithm.unwrap_or(algorithm);
            let per_unit = u64::from(limit.per_unit());
            out.push(Served {
                id: Arc::clone(&limit.full_key),
                limit: per_unit,
                most: most(limit.adaptive.as_deref(), per_unit),
                window: WindowParams {
                    window_ms: seconds * 1_000,
                    capacity: per_unit,
                    rate: per_unit,
                    algorithm,
                },
                counter: Counter::Envoy { domain: Arc::from(domain.as_str()), seconds, algorithm },
            });
        }
        out
    }

    /// What the region's counter of `key` holds (admitted in the window, a
    /// bucket's tokens taken), peeked at in `store` as a limit of `limit`
    /// (which must be at least what it holds).
    pub async fn admitted(&self, store: &Store, key: &str, limit: u64) -> Result<u64, StoreError> {
        match &self.counter {
            Counter::Native(rule) => {
                let verdict = store.decide(key, rule.counter_at(Some(limit)), 0, Count::Never).await?;
                Ok(capacity(limit, rule.burst_capacity).saturating_sub(verdict.remaining))
            }
            Counter::Envoy { domain, seconds, algorithm } => {
                let params = params(*seconds, u32::try_from(limit).unwrap_or(u32::MAX), *algorithm);
                let item = ManyItem {
                    key: key.to_owned(),
                    params,
                    tick_ms: tick_ms(*seconds),
                    weight: 0,
                    count: Count::Never,
                    shadow: false,
                    clock: None,
                    refund: None,
                };
                let outcome = store.decide_many(domain, &[item]).await?;
                let remaining = outcome.verdicts.first().map_or(0, |v| v.remaining);
                Ok(params.capacity.saturating_sub(remaining))
            }
        }
    }
}
