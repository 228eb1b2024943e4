//! `ratelimitd migrate`: the numbered, idempotent setup steps of
//! `migrations/` applied to the external systems — the dead-letter topic in
//! Kafka and the counter key-schema version in Redis.
//!
//! The step files are compiled into the binary, so a deployed binary
//! migrates without the repository. Each step checks before it changes
//! anything; running `migrate` twice changes nothing and says so.

use std::{collections::BTreeMap, time::Duration};

use serde::Deserialize;

use crate::config::{Config, redact_url};

/// The migration files, in order, as compiled in.
pub const MIGRATIONS: [(&str, &str); 6] = [
    ("0001_dlq_topic.yaml", include_str!("../migrations/0001_dlq_topic.yaml")),
    ("0002_redis_key_schema.yaml", include_str!("../migrations/0002_redis_key_schema.yaml")),
    ("0003_redis_key_schema_v2.yaml", include_str!("../migrations/0003_redis_key_schema_v2.yaml")),
    ("0004_rules_topic.yaml", include_str!("../migrations/0004_rules_topic.yaml")),
    ("0005_rules_status_topic.yaml", include_str!("../migrations/0005_rules_status_topic.yaml")),
    ("0006_capture_topic.yaml", include_str!("../migrations/0006_capture_topic.yaml")),
];

/// The Redis key holding the counter key-schema version (after
/// `redis.key_prefix`).
pub const KEY_SCHEMA_KEY: &str = "ratelimitd:key_schema_version";

/// One step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Migration {
    /// Position; ids run 1, 2, 3, … without gaps.
    pub id: u32,
    /// Short name.
    pub name: String,
    /// What it does.
    pub kind: Kind,
}

/// A step file as written (`deny_unknown_fields` does not combine with a
/// flattened tagged enum, so the kind is resolved by hand).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMigration {
    id: u32,
    name: String,
    kind: String,
    version: Option<u32>,
    /// Which topic a `kafka_topic` step creates (default `dlq`).
    topic: Option<String>,
}

/// The topics `migrate` creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topic {
    /// `dlq.kafka.topic`.
    Dlq,
    /// `rules.kafka.topic`: one partition, compacted.
    Rules,
    /// `rules.kafka.status_topic`: one partition, compacted.
    RulesStatus,
    /// `capture.kafka.topic`.
    Capture,
}

/// The kinds of steps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Create a topic.
    KafkaTopic(Topic),
    /// Record the Redis key-schema version.
    RedisKeySchema {
        /// The version this build writes.
        version: u32,
    },
}

/// What applying a step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// It changed something.
    Changed(String),
    /// It was already in place.
    AlreadyApplied(String),
    /// It does not apply to this configuration.
    Skipped(String),
}

/// A step that failed.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {message}")]
pub struct MigrateError {
    /// The migration file.
    pub file: String,
    /// What went wrong.
    pub message: String,
}

/// Parses the compiled-in migrations and checks their numbering.
pub fn migrations() -> Result<Vec<(&'static str, Migration)>, MigrateError> {
    let mut out = Vec::with_capacity(MIGRATIONS.len());
    for (index, (file, text)) in MIGRATIONS.iter().enumerate() {
        let error = |message: String| MigrateError { file: (*file).to_owned(), message };
        let raw: RawMigration = yaml_serde::from_str(text).map_err(|e| error(e.to_string()))?;
        let kind = match (raw.kind.as_str(), raw.version, raw.topic.as_deref()) {
            ("kafka_topic", None, None | Some("dlq")) => Kind::KafkaTopic(Topic::Dlq),
            ("kafka_topic", None, Some("rules")) => Kind::KafkaTopic(Topic::Rules),
            ("kafka_topic", None, Some("rules_status")) => Kind::KafkaTopic(Topic::RulesStatus),
            ("kafka_topic", None, Some("capture")) => Kind::KafkaTopic(Topic::Capture),
            ("redis_key_schema", Some(version), None) => Kind::RedisKeySchema { version },
            (other, _, _) => {
                return Err(error(format!("unknown kind {other:?}, topic, or misplaced version")));
            }
        };
        let migration = Migration { id: raw.id, name: raw.name, kind };
        let expected = u32::try_from(index + 1).unwrap_or(u32::MAX);
        if migration.id != expected || !file.starts_with(&format!("{expected:04}_")) {
            return Err(MigrateError {
                file: (*file).to_owned(),
                message: format!("id {} out of sequence (expected {expected})", migration.id),
            });
        }
        out.push((*file, migration));
    }
    Ok(out)
}

/// Applies every step in order; stops at the first failure.
pub async fn run(config: &Config) -> Result<Vec<(&'static str, Applied)>, MigrateError> {
    let migrations = migrations()?;
    let latest = migrations
        .iter()
        .filter_map(|(_, m)| match m.kind {
            Kind::RedisKeySchema { version } => Some(version),
            Kind::KafkaTopic(_) => None,
        })
        .max()
        .unwrap_or(0);
    let mut results = Vec::new();
    for (file, migration) in migrations {
        let applied = match &migration.kind {
            Kind::KafkaTopic(topic) => kafka_topic(config, *topic).await,
            Kind::RedisKeySchema { version } => redis_key_schema(config, *version, latest).await,
        }
        .map_err(|message| MigrateError { file: file.to_owned(), message })?;
        results.push((file, applied));
    }
    Ok(results)
}

/// What `migrate` creates for `topic`, from the configuration: brokers,
/// properties, name, partitions, replication and topic settings; `Err`
/// with the reason when it is not configured.
fn topic_spec(config: &Config, topic: Topic) -> Result<TopicSpec<'_>, String> {
    let unset = |key: &str, why: &str| format!("{key} unset ({why})");
    match topic {
        Topic::Dlq => {
            let k = &config.dlq.kafka;
            Ok(TopicSpec {
                brokers: k
                    .brokers
                    .as_deref()
                    .ok_or_else(|| unset("dlq.kafka.brokers", "the file sink needs no topic"))?,
                properties: &k.properties,
                name: &k.topic,
                partitions: k.partitions,
                replication: k.replication_factor,
                settings: vec![("retention.ms", k.retention_ms.to_string())],
            })
        }
        Topic::Rules | Topic::RulesStatus => {
            let k = &config.rules.kafka;
            Ok(TopicSpec {
                brokers: k
                    .brokers
                    .as_deref()
                    .ok_or_else(|| unset("rules.kafka.brokers", "rules come from files"))?,
                properties: &k.properties,
                name: if topic == Topic::Rules { &k.topic } else { &k.status_topic },
                // One partition: the newest record is the one in force.
                partitions: 1,
                replication: k.replication_factor,
                settings: vec![("cleanup.policy", "compact".to_owned())],
            })
        }
        Topic::Capture => {
            let k = &config.capture.kafka;
            Ok(TopicSpec {
                brokers: k
                    .brokers
                    .as_deref()
                    .ok_or_else(|| unset("capture.kafka.brokers", "capture goes to a file or nowhere"))?,
                properties: &k.properties,
                name: &k.topic,
                partitions: k.partitions,
                replication: k.replication_factor,
                settings: vec![("retention.ms", k.retention_ms.to_string())],
            })
        }
    }
}

/// A topic to create.
// Without Kafka only the name is read (the build creates no topic).
#[cfg_attr(not(feature = "kafka"), allow(dead_code))]
struct TopicSpec<'a> {
    brokers: &'a str,
    properties: &'a BTreeMap<String, String>,
    name: &'a str,
    partitions: i32,
    replication: i32,
    settings: Vec<(&'static str, String)>,
}

async fn kafka_topic(config: &Config, topic: Topic) -> Result<Applied, String> {
    match topic_spec(config, topic) {
        Ok(spec) => create_topic(&spec).await,
        Err(why) => Ok(Applied::Skipped(why)),
    }
}

/// Without Kafka support no topic is configured (the configuration refuses
/// Kafka settings), so this is never reached.
#[cfg(not(feature = "kafka"))]
async fn create_topic(spec: &TopicSpec<'_>) -> Result<Applied, String> {
    Ok(Applied::Skipped(format!("{}: this build has no Kafka (cargo feature `kafka`)", spec.name)))
}

#[cfg(feature = "kafka")]
async fn create_topic(spec: &TopicSpec<'_>) -> Result<Applied, String> {
    use rdkafka::{
        admin::{AdminClient, AdminOptions, NewTopic, TopicReplication},
        client::DefaultClientContext,
        types::RDKafkaErrorCode,
    };
    let admin: AdminClient<DefaultClientContext> =
        crate::kafka::client_config(spec.brokers, spec.properties, &[])
            .create()
            .map_err(|e| format!("cannot create a Kafka admin client: {e}"))?;
    let mut new = NewTopic::new(spec.name, spec.partitions, TopicReplication::Fixed(spec.replication));
    for (key, value) in &spec.settings {
        new = new.set(key, value);
    }
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let brokers = spec.brokers;
    let results = tokio::time::timeout(Duration::from_secs(30), admin.create_topics([&new], &options))
        .await
        .map_err(|_| format!("no answer from Kafka at {brokers} within 30 s"))?
        .map_err(|e| format!("cannot create topic {:?}: {e}", spec.name))?;
    let settings: Vec<String> = spec.settings.iter().map(|(k, v)| format!("{k} {v}")).collect();
    match results.into_iter().next() {
        Some(Ok(name)) => Ok(Applied::Changed(format!(
            "created topic {name:?} ({} partitions, replication factor {}, {})",
            spec.partitions,
            spec.replication,
            settings.join(", ")
        ))),
        Some(Err((name, RDKafkaErrorCode::TopicAlreadyExists))) => {
            Ok(Applied::AlreadyApplied(format!("topic {name:?} exists")))
        }
        Some(Err((name, code))) => Err(format!("cannot create topic {name:?}: {code}")),
        None => Err("Kafka answered CreateTopics with no result".to_owned()),
    }
}

/// Records key-schema `version` in Redis: on an empty Redis, or as the
/// upgrade from `version - 1`. A version up to `latest` (this build's
/// newest, recorded by a later step) counts as applied; a newer one is
/// refused.
async fn redis_key_schema(config: &Config, version: u32, latest: u32) -> Result<Applied, String> {
    let Some(url) = &config.redis.connection.url else {
        return Ok(Applied::Skipped("redis.url unset (in-memory counters)".to_owned()));
    };
    let shown = redact_url(url);
    let client = redis::Client::open(url.as_str()).map_err(|e| format!("redis.url {shown}: {e}"))?;
    let mut conn = tokio::time::timeout(Duration::from_secs(10), client.get_multiplexed_async_connection())
        .await
        .map_err(|_| format!("no answer from Redis at {shown} within 10 s"))?
        .map_err(|e| format!("cannot connect to Redis at {shown}: {e}"))?;
    let key = format!("{}{KEY_SCHEMA_KEY}", config.redis.connection.key_prefix);
    let key = key.as_str();
    // SET NX first: concurrent migrations agree on one writer.
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg(version)
        .arg("NX")
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("cannot write {key}: {e}"))?;
    if set.is_some() {
        return Ok(Applied::Changed(format!("recorded key-schema version {version} in {key}")));
    }
    let stored: String = redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn)
        .await
        .map_err(|e| format!("cannot read {key}: {e}"))?;
    match stored.parse::<u32>() {
        Ok(v) if v == version => Ok(Applied::AlreadyApplied(format!("key-schema version {v} recorded"))),
        Ok(v) if v > version && v <= latest => {
            Ok(Applied::AlreadyApplied(format!("key-schema version {v} recorded (a later step)")))
        }
        Ok(v) if v > version => Err(format!(
            "Redis holds key-schema version {v}, newer than this build's {latest}: upgrade ratelimitd"
        )),
        Ok(v) if v + 1 == version => upgrade_key_schema(&mut conn, key, v, version).await,
        Ok(v) => {
            Err(format!("Redis holds key-schema version {v}; this build has no upgrade from it to {version}"))
        }
        Err(_) => Err(format!("{key} holds {stored:?}, not a version number")),
    }
}

/// Moves the recorded key-schema version from `from` to `to` if it still
/// is `from` (compare and set, so concurrent migrations agree). The
/// counters need no conversion: each version has its own key prefix, and
/// the older counters expire by their own TTL.
async fn upgrade_key_schema(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    from: u32,
    to: u32,
) -> Result<Applied, String> {
    let mut call = crate::limiter::scripts::SCHEMA_SWAP.call();
    call.arg(1).arg(key).arg(from).arg(to);
    let answers = crate::limiter::scripts::run(conn, std::slice::from_ref(&call))
        .await
        .map_err(|e| format!("cannot update {key}: {e}"))?;
    let swapped =
        answers.into_iter().next().and_then(|a| redis::from_redis_value::<u32>(a).ok()).unwrap_or(0);
    if swapped == 1 {
        Ok(Applied::Changed(format!(
            "upgraded key-schema version {from} to {to}; version-{from} counters expire by their own TTL"
        )))
    } else {
        Err(format!("{key} changed while this step ran; run migrate again"))
    }
}

/// Counts of what a run did, for the closing line.
pub fn summary(results: &[(&str, Applied)]) -> BTreeMap<&'static str, usize> {
    let mut counts = BTreeMap::new();
    for (_, applied) in results {
        let key = match applied {
            Applied::Changed(_) => "applied",
            Applied::AlreadyApplied(_) => "already applied",
            Applied::Skipped(_) => "skipped",
        };
        *counts.entry(key).or_insert(0) += 1;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiled_in_migrations_parse_in_sequence() {
        let migrations = migrations().unwrap();
        assert_eq!(migrations.len(), 6);
        assert_eq!(migrations[0].1.kind, Kind::KafkaTopic(Topic::Dlq));
        assert_eq!(migrations[3].1.kind, Kind::KafkaTopic(Topic::Rules));
        assert_eq!(migrations[4].1.kind, Kind::KafkaTopic(Topic::RulesStatus));
        assert_eq!(migrations[5].1.kind, Kind::KafkaTopic(Topic::Capture));
        assert_eq!(migrations[1].1.kind, Kind::RedisKeySchema { version: 1 });
        assert_eq!(migrations[2].1.kind, Kind::RedisKeySchema { version: 2 });
    }

    #[tokio::test]
    async fn nothing_configured_skips_every_step() {
        let results = run(&Config::default()).await.unwrap();
        assert!(results.iter().all(|(_, a)| matches!(a, Applied::Skipped(_))), "{results:?}");
    }
}
