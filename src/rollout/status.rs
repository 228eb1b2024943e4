//! Which instance serves which version: every instance reports to the
//! compacted `rules.kafka.status_topic` (key: its instance name) on every
//! swap and every `rules.kafka.status_interval_ms`, and withdraws its
//! report (a tombstone) when it stops cleanly. `rules status` reads the
//! topic and compares each report with the record in force, and shows
//! each instance's adaptive limits.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::RulesKafkaConfig;
use super::{RolloutError, topic};
use crate::{
    clock::{Clock, SystemClock},
    folded::Folded,
    rules::{Feed, Hot, RuleStore, adaptive_limits, envoy::EnvoyConfig},
};

/// The schema of a status report.
pub const STATUS_SCHEMA: &str = "ratelimitd.rules.status/1";

/// One instance's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// [`STATUS_SCHEMA`].
    pub schema: String,
    /// The instance (`dlq.instance_id` or the host name, `@` the gRPC port).
    pub instance: String,
    /// The version served; `None` while waiting for rules.
    pub version: Option<String>,
    /// `topic` or `fallback`; `None` while waiting.
    pub origin: Option<String>,
    /// The topic offset of the record served.
    pub offset: Option<i64>,
    /// When the version was swapped in, ms since the epoch.
    pub since_ms: Option<u64>,
    /// When this report was made, ms since the epoch.
    pub reported_ms: u64,
    /// Native rules served.
    pub native_rules: usize,
    /// Records refused since the instance started.
    pub rejected: u64,
    /// Why the last refused record was refused (unsigned, an unknown key,
    /// a signature that does not verify, rules that do not compile).
    #[serde(default)]
    pub last_refusal: Option<String>,
    /// The limit in force of each adaptive limit, by name (a rule id, or
    /// `envoy:` and an Envoy limit's full key); the same on every instance
    /// sharing a store, give or take an interval.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub adaptive: BTreeMap<String, u64>,
    /// The instance's load shedding, overload layer and dead-letter
    /// pipeline as of the report; `None` until its parts are built.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vitals: Option<Vitals>,
}

/// What else an instance says in its report, beside its rules.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Vitals {
    /// The shedding level, as `Check` answers it in
    /// `cluster_utilization_status`: `NORMAL`, `DEGRADED_MODE` or `CRITICAL_ONLY`.
    pub shed_level: String,
    /// The smoothed utilization shedding judges by (0..1), when measured.
    pub utilization: Option<f64>,
    /// The overload layer's mode in force: `enforce`, `shadow` or `off`.
    pub overload_mode: String,
    /// Overload directives in force (native rules and Envoy limits).
    pub overload_directives: usize,
    /// Failed decisions recorded for the dead-letter sink since the start.
    pub dead_letters: u64,
    /// Of those, lost (counted, never silently).
    pub dead_letters_dropped: u64,
    /// Each global limit in this instance's region, by limit id.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub global: BTreeMap<String, GlobalVital>,
    /// Envoy's Rate Limit Quota Service on this instance, by domain.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rlqs: BTreeMap<String, RlqsVital>,
}

/// One domain's RLQS streams on an instance, as its report says.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RlqsVital {
    /// Streams open: the Envoys reporting to this instance.
    pub envoys: u64,
    /// Buckets assigned on those streams.
    pub buckets: u64,
    /// The shares last assigned on them, requests per second summed.
    pub assigned_per_second: f64,
    /// Bucket usage reports taken since the start.
    pub reports: u64,
    /// Of those, of buckets no limit holds (allowed whole).
    pub unmatched: u64,
    /// Assignments that ran out before their Envoy reported again.
    pub expired: u64,
    /// Reports answered nothing (the store did not answer, or no room).
    pub unanswered: u64,
}

/// One global limit in an instance's region, as its report says.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GlobalVital {
    /// The instance's region.
    pub region: String,
    /// The region's grants summed over the limit's keys.
    pub granted: u64,
    /// Keys holding a grant.
    pub keys: usize,
    /// Hits admitted and denied in the last interval (the agent's view).
    pub demand: u64,
    /// Seconds since the grants' lease began; `None` when none is held.
    pub lease_age_s: Option<f64>,
    /// The coordination store's last answer: `none`, `ok`, `failed`, `claimed`.
    pub answer: String,
    /// Whether this instance is its region's agent.
    pub agent: bool,
}

/// Where the reporter reads an instance's [`Vitals`] from: set once the
/// parts that know them are built (the rules come first).
#[derive(Clone, Default)]
pub struct VitalsSource(Arc<std::sync::OnceLock<VitalsReader>>);

type VitalsReader = Box<dyn Fn() -> Vitals + Send + Sync>;

impl std::fmt::Debug for VitalsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("VitalsSource").field(&self.0.get().is_some()).finish()
    }
}

impl VitalsSource {
    /// Sets how the vitals are read (the first setting holds).
    pub fn set(&self, read: impl Fn() -> Vitals + Send + Sync + 'static) {
        let _ = self.0.set(Box::new(read));
    }

    /// The vitals now, once set.
    pub fn read(&self) -> Option<Vitals> {
        self.0.get().map(|read| read())
    }
}

/// Where an instance stands against the version in force, as of `now_ms`:
/// `stale` (no report within `stale_after_ms`), `waiting` (no rules yet),
/// `current` or `behind`.
pub fn standing(
    report: &StatusReport,
    in_force: Option<&str>,
    now_ms: u64,
    stale_after_ms: u64,
) -> &'static str {
    match (&report.version, in_force) {
        _ if now_ms.saturating_sub(report.reported_ms) > stale_after_ms => "stale",
        (None, _) => "waiting",
        (Some(v), Some(f)) if v == f => "current",
        (Some(_), _) => "behind",
    }
}

/// The report of what `feed` serves now (the rule sets `native` and
/// `envoy`), with `vitals` when known.
pub fn report(
    instance: &str,
    feed: &Feed,
    native: &RuleStore,
    envoy: &Hot<EnvoyConfig>,
    vitals: Option<Vitals>,
) -> StatusReport {
    let served = feed.served();
    let (native, envoy) = (native.load(), envoy.load());
    let adaptive = adaptive_limits(&native, Some(&envoy))
        .into_iter()
        .map(|(name, limit)| (name.to_string(), limit.current()))
        .collect();
    StatusReport {
        schema: STATUS_SCHEMA.to_owned(),
        instance: instance.to_owned(),
        version: served.as_ref().map(|s| s.version.clone()),
        origin: served.as_ref().map(|s| s.origin.as_str().to_owned()),
        offset: served.as_ref().and_then(|s| match s.origin {
            crate::rules::Origin::Topic { offset } => Some(offset),
            crate::rules::Origin::Fallback => None,
        }),
        since_ms: served.as_ref().map(|s| s.since_ms),
        reported_ms: SystemClock.now_ms(),
        native_rules: native.rules().len(),
        rejected: feed.rejected(),
        last_refusal: feed.last_refusal().map(|why| why.to_string()),
        adaptive,
        vitals,
    }
}

/// Reports `feed` to the status topic on every change and every
/// `status_interval_ms` until `stop`, then withdraws the report.
pub async fn run_reporter(
    kafka: RulesKafkaConfig,
    instance: String,
    feed: Arc<Feed>,
    native: Arc<RuleStore>,
    envoy: Arc<Hot<EnvoyConfig>>,
    vitals: VitalsSource,
    mut stop: watch::Receiver<bool>,
) {
    let brokers = kafka.brokers.clone().unwrap_or_default();
    let producer = match topic::producer(&brokers, &kafka.properties, Duration::from_secs(5)) {
        Ok(producer) => producer,
        Err(e) => {
            tracing::error!(error = %e, "rules status reports disabled");
            let _ = stop.changed().await;
            return;
        }
    };
    let mut ticker = tokio::time::interval(Duration::from_millis(kafka.status_interval_ms));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let failed = Folded::default();
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = feed.changed() => {}
            _ = stop.changed() => break,
        }
        let now = vitals.read();
        let payload = serde_json::to_vec(&report(&instance, &feed, &native, &envoy, now)).unwrap_or_default();
        // A broker that is away must not hold up shutdown.
        let produced = tokio::select! {
            produced = topic::produce(&producer, &kafka.status_topic, &instance, Some(&payload)) => produced,
            _ = stop.changed() => break,
        };
        if let Err(e) = produced
            && let Some(times) = failed.pass(SystemClock.now_ms() / 1_000)
        {
            tracing::warn!(error = %e, times, "cannot report the served rules version");
        }
    }
    // A clean stop withdraws the report: the instance serves nothing any more.
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        topic::produce(&producer, &kafka.status_topic, &instance, None),
    )
    .await;
}

/// The latest report of every instance that has not withdrawn it.
pub fn read(kafka: &RulesKafkaConfig) -> Result<Vec<StatusReport>, RolloutError> {
    let brokers = super::publish::brokers(kafka)?;
    let mut latest: BTreeMap<Vec<u8>, Option<StatusReport>> = BTreeMap::new();
    for record in topic::read_all(brokers, &kafka.properties, &kafka.status_topic)? {
        let Some(key) = record.key else { continue };
        let report = record.payload.and_then(|p| serde_json::from_slice::<StatusReport>(&p).ok());
        latest.insert(key, report);
    }
    Ok(latest.into_values().flatten().collect())
}
