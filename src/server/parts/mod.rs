//! The named parts of a running service, each built by one function from its
//! configuration section, one file per kind: `rules` (rule sets, tenant
//! table), `store` (counters, the local limiter, denial cache, tenants'
//! shares), `layers` (shedding, overload, adaptive limits), `sinks`
//! (dead letters, capture), `observe` (metrics, health); this file keeps the
//! tasks and the engine. Every long-lived task a part needs is spawned into
//! the [`Tasks`] it is given, never detached.

mod layers;
mod observe;
mod rules;
mod sinks;
mod store;

pub(crate) use layers::{adaptive, exchanges, global, overload, shares_global_limits, shedder};
pub(crate) use observe::{Figures, health, metrics, register_figures, stats, vitals};
pub(crate) use rules::{Rules, rules_of, tenants};
pub(crate) use sinks::{Captured, capture, dlq};
pub(crate) use store::{denials, local, quotas, store, tenant_shares};

use std::sync::Arc;

use tokio::{sync::watch, task::JoinSet};

use crate::{
    config::Config,
    decision::{
        CaptureSink, DecisionMetrics, DenialCache, Engine, EngineParts, FailureSink, Stats, TenantShares,
    },
    dlq::DlqSink,
    limiter::{Store, local::LocalLimiter},
    overload::Overload,
    shed::Shedder,
};

/// Why a Kafka setting cannot be served: the configuration refuses them all
/// in a build without Kafka, so this is only a guard.
#[cfg(not(feature = "kafka"))]
const NO_KAFKA: &str = "this build has no Kafka support (cargo feature `kafka`)";

/// Background tasks and the signal that stops them. Each returns once the
/// signal turns true; one that ends earlier is a bug the server reports.
#[derive(Debug)]
pub(crate) struct Tasks {
    set: JoinSet<()>,
    stop: watch::Sender<bool>,
}

impl Tasks {
    pub(crate) fn new() -> Self {
        Tasks { set: JoinSet::new(), stop: watch::channel(false).0 }
    }

    /// A receiver for the stop signal, for a task to watch.
    pub(crate) fn stopper(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    pub(crate) fn spawn(&mut self, task: impl Future<Output = ()> + Send + 'static) {
        self.set.spawn(task);
    }

    /// Waits for the first task to end (serving: that is a failure) and says why.
    pub(crate) async fn first_exit(&mut self) -> String {
        match self.set.join_next().await {
            Some(Err(e)) => e.to_string(),
            Some(Ok(())) => "returned before shutdown".to_owned(),
            None => std::future::pending().await,
        }
    }

    /// Signals every task to stop and waits for all of them.
    pub(crate) async fn stop_and_join(mut self) {
        let _ = self.stop.send(true);
        while let Some(joined) = self.set.join_next().await {
            if let Err(e) = joined {
                tracing::error!(error = %e, "background task failed");
            }
        }
    }
}

/// What the engine decides with besides the rules and the store.
pub(crate) struct Layers<'a> {
    pub(crate) shedder: &'a Arc<Shedder>,
    pub(crate) overload: &'a Arc<Overload>,
    pub(crate) denials: Option<Arc<DenialCache>>,
    pub(crate) local: Arc<LocalLimiter>,
    pub(crate) tenant_shares: Option<Arc<TenantShares>>,
    pub(crate) grants: Option<Arc<crate::limiter::grants::Grants>>,
}

/// The engine both APIs decide through.
pub(crate) fn engine(
    config: &Config,
    rules: &Rules,
    store: Store,
    layers: Layers<'_>,
    dlq: &Arc<DlqSink>,
    stats: &Arc<DecisionMetrics>,
    capture: Option<&Captured>,
) -> Engine {
    let shedder = layers.shedder;
    Engine::new(EngineParts {
        rules: Arc::clone(&rules.native),
        envoy: rules.envoy.clone(),
        store,
        local: layers.local,
        shedder: Arc::clone(shedder),
        failures: Arc::clone(dlq) as Arc<dyn FailureSink>,
        stats: Arc::clone(stats) as Arc<dyn Stats>,
        default_priority: config.shed.default_priority,
        max_user_id_bytes: config.limits.max_user_id_bytes,
        trust_request_priority: config.shed.trust_request_priority,
        envoy_policy: config.envoy.policy(),
        capture: capture.map(|c| Arc::clone(&c.sink) as Arc<dyn CaptureSink>),
        overload: Some(Arc::clone(layers.overload)),
        tenants: config.overload.tenant_policy(),
        denials: layers.denials,
        tenant_shares: layers.tenant_shares,
        grants: layers.grants,
        clock: Arc::new(crate::clock::SystemClock),
        reservation_ttl_ms: config.limits.reservation_ttl_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn tasks_stop_and_join() {
        let mut tasks = Tasks::new();
        let mut stop = tasks.stopper();
        tasks.spawn(async move {
            let _ = stop.changed().await;
        });
        tokio::time::timeout(std::time::Duration::from_secs(5), tasks.stop_and_join()).await.unwrap();
    }
}
