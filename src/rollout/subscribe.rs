//! `rules.source: kafka`: an instance's subscription to the rules topic.
//!
//! One blocking thread owns a consumer assigned to partition 0 of
//! `rules.kafka.topic` from the beginning (no group, nothing committed: every
//! instance reads the whole compacted topic). Until it reaches the end once
//! it only collects records; then it swaps in the newest one that decodes
//! and compiles, so a corrupt newest record leaves the one before it in
//! force. From then on every record is decoded, compiled and swapped in as
//! it arrives; a record that fails is counted and logged, and the last good
//! rules keep serving. While the broker is away librdkafka reconnects by
//! itself; nothing served is ever dropped.
//!
//! Before the first snapshot nothing is served (`/readyz`: waiting for
//! rules). If the topic is empty, or no snapshot arrived within
//! `rules.kafka.wait_ms`, the fallback files (`rules.path`,
//! `rules.envoy_path`, `rules.limitador_path`) are swapped in when
//! configured; a later record replaces them.
//!
//! An instance with `rules.limitador_path` answers `ShouldRateLimit` with
//! limitador's limits: it serves the records' limitador part, and refuses
//! a record without one (unless `rules.allow_empty`), which would lift
//! every limit it answers by.

use std::{
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use rdkafka::{
    Message as _, Offset, TopicPartitionList,
    consumer::{BaseConsumer, Consumer},
    error::KafkaError,
};
use tokio::sync::watch;

use super::RulesKafkaConfig;
use super::topic;
use crate::{
    clock::{Clock, SystemClock},
    folded::Folded,
    rules::{
        self, Feed, Hot, Origin, RuleErrors, RuleStore, Served, Snapshot, Versioned,
        encoding::{Compiled, Compilers, DecodeError, SnapshotRecord},
        envoy::EnvoyConfig,
        limitador::Limits,
        signing::Trust,
    },
};

/// The local files served when the topic has nothing to serve.
#[derive(Debug, Clone, Default)]
pub struct Fallback {
    /// Native rules (`rules.path`).
    pub native: Option<PathBuf>,
    /// Envoy configuration (`rules.envoy_path`).
    pub envoy: Option<PathBuf>,
    /// limitador's limits file (`rules.limitador_path`).
    pub limitador: Option<PathBuf>,
}

impl Fallback {
    fn configured(&self) -> bool {
        self.native.is_some() || self.envoy.is_some() || self.limitador.is_some()
    }

    fn load(&self, how: Compilers, allow_empty: bool) -> Result<(Snapshot, EnvoyConfig, Limits), RuleErrors> {
        let native = match &self.native {
            Some(path) => rules::non_empty(rules::load(path, how.paths)?, path, allow_empty)?,
            None => rules::empty(),
        };
        let envoy = match &self.envoy {
            Some(path) => rules::non_empty(rules::envoy::load(path, how.envoy)?, path, allow_empty)?,
            None => EnvoyConfig::default(),
        };
        let limitador = match &self.limitador {
            Some(path) => rules::non_empty(Limits::load(path, how.limitador)?, path, allow_empty)?,
            None => Limits::default(),
        };
        Ok((native, envoy, limitador))
    }
}

/// Everything the subscription writes to.
#[derive(Debug)]
pub struct Subscription {
    /// Topic, brokers, properties, how long to wait before falling back.
    pub kafka: RulesKafkaConfig,
    /// How records compile on this instance.
    pub compile: Compilers,
    /// Accept a record, or fallback files, with no rules (`rules.allow_empty`).
    pub allow_empty: bool,
    /// Whose records are served (`rules.kafka.verify_keys`, `allow_unsigned`).
    pub trust: Trust,
    /// The native rules the engine reads.
    pub native: Arc<RuleStore>,
    /// The Envoy configuration the engine reads.
    pub envoy: Arc<Hot<EnvoyConfig>>,
    /// limitador's limits the engine reads, on an instance that answers
    /// with them (`rules.limitador_path`).
    pub limitador: Option<Arc<Hot<Limits>>>,
    /// What is served, for health, metrics and the status reporter.
    pub feed: Arc<Feed>,
    /// Served when the topic has nothing.
    pub fallback: Fallback,
}

/// Follows the rules topic until `stop` turns true.
pub async fn run(subscription: Subscription, stop: watch::Receiver<bool>) {
    let _ = tokio::task::spawn_blocking(move || subscription.follow(&stop)).await;
}

impl Subscription {
    fn follow(&self, stop: &watch::Receiver<bool>) {
        let started = Instant::now();
        let wait = Duration::from_millis(self.kafka.wait_ms);
        let brokers = self.kafka.brokers.clone().unwrap_or_default();
        let topic = self.kafka.topic.as_str();
        let consumer = match topic::consumer(&brokers, &self.kafka.properties, true) {
            Ok(consumer) => Some(consumer),
            Err(e) => {
                tracing::error!(error = %e, "rules.kafka: no consumer; only the fallback can be served");
                None
            }
        };
        let unreachable = Folded::default();
        let mut fallback_tried = false;
        let mut assigned = false;
        let mut caught_up = false;
        let mut backlog: Vec<(i64, Vec<u8>)> = Vec::new();
        // Stopped, or the server that would stop it is gone (its sender dropped).
        while !*stop.borrow() && stop.has_changed().is_ok() {
            if !fallback_tried && self.feed.served().is_none() && started.elapsed() >= wait {
                fallback_tried = true;
                self.serve_fallback(&format!("no snapshot from topic {topic:?} within rules.kafka.wait_ms"));
            }
            let Some(consumer) = &consumer else {
                std::thread::sleep(Duration::from_millis(200));
                continue;
            };
            if !assigned {
                match assign(consumer, &brokers, topic) {
                    Ok(()) => assigned = true,
                    Err(e) => {
                        if let Some(times) = unreachable.pass(SystemClock.now_ms() / 1_000) {
                            tracing::warn!(error = %e, times, "rules topic unreachable; serving what was served before");
                        }
                        std::thread::sleep(Duration::from_millis(250));
                        continue;
                    }
                }
            }
            match consumer.poll(Duration::from_millis(200)) {
                None => {}
                Some(Err(KafkaError::PartitionEOF(_))) if !caught_up => {
                    caught_up = true;
                    self.apply_newest(&mut backlog);
                    if self.feed.served().is_none() && !fallback_tried && self.fallback.configured() {
                        fallback_tried = true;
                        self.serve_fallback(&format!("topic {topic:?} holds no valid snapshot"));
                    }
                }
                Some(Err(KafkaError::PartitionEOF(_))) => {}
                Some(Err(e)) => {
                    if let Some(times) = unreachable.pass(SystemClock.now_ms() / 1_000) {
                        tracing::warn!(error = %e, times, "reading the rules topic; serving what was served before");
                    }
                }
                Some(Ok(message)) => {
                    // A tombstone carries no rules.
                    let Some(payload) = message.payload() else { continue };
                    if caught_up {
                        self.apply(message.offset(), payload);
                    } else {
                        backlog.push((message.offset(), payload.to_vec()));
                    }
                }
            }
        }
    }

    /// `compiled`, unless `record` would lift every limit of a kind it
    /// carries (a part with no rules, or no rules at all; on an instance
    /// answering with limitador's limits, none of those) and empty sets
    /// are not accepted (`rules.allow_empty`).
    fn non_empty(&self, record: &SnapshotRecord, compiled: Compiled) -> Result<Compiled, DecodeError> {
        let answering = self.limitador.is_some();
        let (carries_native, carries_envoy) = (record.native.is_some(), record.envoy.is_some());
        let native = (carries_native || !carries_envoy && !answering) && compiled.native.size() == 0;
        let envoy = (carries_envoy || !carries_native && !answering) && compiled.envoy.size() == 0;
        let limitador = answering && compiled.limitador.size() == 0;
        if self.allow_empty || !(native || envoy || limitador) {
            return Ok(compiled);
        }
        let part = if limitador {
            "the record's limitador limits"
        } else if native {
            "the record's native rules"
        } else {
            "the record's Envoy rules"
        };
        Err(DecodeError::Rules {
            version: compiled.version,
            errors: rules::empty_set(std::path::Path::new(part)),
        })
    }

    /// Swaps in the newest record of `backlog` that decodes and compiles.
    fn apply_newest(&self, backlog: &mut Vec<(i64, Vec<u8>)>) {
        while let Some((offset, payload)) = backlog.pop() {
            if self.apply(offset, &payload) {
                break;
            }
        }
        backlog.clear();
    }

    /// Decodes, compiles and swaps in one record; false when it was refused.
    fn apply(&self, offset: i64, payload: &[u8]) -> bool {
        let compiled = self.trust.open(payload).and_then(|record| {
            let compiled = record.compile(self.compile)?;
            self.non_empty(&record, compiled)
        });
        let compiled = match compiled {
            Ok(compiled) => compiled,
            Err(e) => {
                self.feed.reject(e.to_string());
                let serving =
                    self.feed.served().map_or_else(|| "nothing yet".to_owned(), |s| s.version.clone());
                tracing::error!(offset, error = %e, %serving, "rules record refused; keeping the last good snapshot");
                return false;
            }
        };
        let from = self.feed.served().map(|s| s.version.clone());
        tracing::info!(
            from = from.as_deref().unwrap_or("nothing"),
            to = %compiled.version,
            offset,
            native_rules = compiled.native.rules().len(),
            envoy_domains = compiled.envoy.domain_count(),
            limitador_limits = compiled.limitador.size(),
            "rules snapshot swapped in"
        );
        self.native.swap(compiled.native);
        self.envoy.swap(compiled.envoy);
        if let Some(limits) = &self.limitador {
            limits.swap(compiled.limitador);
        }
        self.feed.serve(Served {
            version: compiled.version,
            origin: Origin::Topic { offset },
            since_ms: SystemClock.now_ms(),
        });
        true
    }

    fn serve_fallback(&self, why: &str) {
        if !self.fallback.configured() {
            tracing::warn!(
                why,
                "no fallback configured (rules.path, rules.envoy_path, rules.limitador_path): waiting for rules"
            );
            return;
        }
        match self.fallback.load(self.compile, self.allow_empty) {
            Ok((native, envoy, limitador)) => {
                let mut version = format!("fallback:{}", native.version());
                if let Some(limits) = &self.limitador {
                    version = format!("{version}+{}", limitador.version());
                    limits.swap(limitador);
                }
                tracing::warn!(why, %version, native = ?self.fallback.native, envoy = ?self.fallback.envoy, limitador = ?self.fallback.limitador, "serving the fallback rule files until a snapshot arrives");
                self.native.swap(native);
                self.envoy.swap(envoy);
                self.feed.serve(Served { version, origin: Origin::Fallback, since_ms: SystemClock.now_ms() });
            }
            Err(errors) => {
                tracing::error!(why, %errors, "the fallback rule files do not load: waiting for rules");
            }
        }
    }
}

/// Assigns partition 0 of `topic` from its beginning.
fn assign(consumer: &BaseConsumer, brokers: &str, topic: &str) -> Result<(), super::RolloutError> {
    let partitions = topic::partitions(consumer, brokers, topic, Duration::from_secs(2))?;
    if partitions.len() > 1 {
        tracing::warn!(
            topic,
            partitions = partitions.len(),
            "the rules topic should have one partition; reading partition 0 only"
        );
    }
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(topic, 0, Offset::Beginning)
        .map_err(|e| super::RolloutError::Kafka(e.to_string()))?;
    consumer
        .assign(&assignment)
        .map_err(|e| super::RolloutError::Kafka(format!("cannot assign {topic}: {e}")))
}
