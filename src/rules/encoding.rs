//! The snapshot record: a compiled rule set as `ratelimitd rules publish`
//! writes it to the rules topic and every instance decodes it
//! (schema `ratelimitd.rules.snapshot/1`, JSON; docs/rules.md, "Rules over Kafka").
//!
//! Native rules travel compiled: every field explicit, defaults resolved,
//! the algorithm named. Envoy configurations travel as their validated
//! envoyproxy/ratelimit YAML documents (upstream's own documented format),
//! because an instance compiles them with its own `envoy.algorithm`.
//! limitador's limits file travels the same way, as its YAML text, compiled
//! by each instance with its own `rules.limitador_algorithm`.
//!
//! Decoding never trusts the record: the rules are compiled again by the
//! same compiler `serve` and `rules validate` use, and every content hash
//! the record states (the native set's version, the Envoy files' digest, the
//! record's own version) must be the one recomputed. A record that fails any
//! of it is refused whole; the caller keeps its last good snapshot.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
    sync::Arc,
};

use serde::{Deserialize, Serialize};

use super::limitador::Limits;
use super::{
    FailurePolicy, Mode, OverloadSpec, PathForm, RuleErrors, Snapshot, compile,
    envoy::{self, EnvoyConfig},
    native::{RawRule, SourcedRule},
};
use crate::{
    limiter::{Algorithm, calendar::Calendar},
    shed::Priority,
};

/// The schema this build writes and reads.
pub const SCHEMA: &str = "ratelimitd.rules.snapshot/1";

/// One published rule set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRecord {
    /// [`SCHEMA`].
    pub schema: String,
    /// Content hash of the whole set ([`record_version`]); the Kafka key.
    pub version: String,
    /// The version that was current on the topic when this one was published.
    pub previous: Option<String>,
    /// When it was published, RFC 3339.
    pub published_at: String,
    /// Who published it, from where.
    pub provenance: Provenance,
    /// Native rules; `None`: none.
    pub native: Option<NativeRules>,
    /// Envoy configuration; `None`: none (every descriptor is unmatched).
    pub envoy: Option<EnvoyRules>,
    /// limitador's limits file; `None`: none. Absent from records without
    /// it, so their versions and bytes are what they were before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limitador: Option<LimitadorRules>,
    /// The publish gate's report on this version (`rules publish --gate`);
    /// instances with `rules.kafka.require_gate` serve only a passing one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<super::gate::GateReport>,
}

/// Where a published rule set comes from.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Provenance {
    /// The publishing host.
    pub host: String,
    /// The paths given to `rules publish`.
    pub paths: Vec<String>,
    /// `git rev-parse HEAD` of the work tree the rules are in, if any.
    pub git_commit: Option<String>,
    /// The commit's author, `Name <email>`.
    pub git_author: Option<String>,
    /// The rule files differ from the commit (uncommitted changes).
    pub git_dirty: Option<bool>,
    /// The publishing tool and its version.
    pub publisher: String,
    /// Set by `rules rollback`: the version that was current and was rolled back.
    pub rolled_back_from: Option<String>,
}

/// The native rule set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NativeRules {
    /// [`Snapshot::version`] of the set.
    pub version: String,
    /// Every rule, in load order.
    pub rules: Vec<EncodedRule>,
}

/// One compiled native rule, every field explicit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncodedRule {
    /// The file it was loaded from (for messages).
    pub source: String,
    pub rule_id: String,
    pub resource_path: String,
    pub client_type: Option<String>,
    pub priority_bucket: Priority,
    pub limit: u64,
    /// 0 for a calendar period.
    pub window_seconds: u64,
    /// The first limit's calendar period, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<crate::limiter::calendar::Period>,
    /// The calendar period's time zone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// What the first limit counts, when not requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    pub burst_capacity: f64,
    /// `sliding_window`, `fixed_window`, `token_bucket` or `gcra`.
    pub algorithm: String,
    pub mode: Mode,
    pub failure_policy: FailurePolicy,
    /// Derived, for readers: `floor(limit × burst_capacity)`; checked on decode.
    pub capacity: u64,
    /// The overload directive, when the rule has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overload: Option<OverloadSpec>,
    /// Further limits, each with its algorithm explicit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<super::RawLimit>,
    /// The adaptive limit, `increase` explicit, when the rule has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<super::AdaptiveSpec>,
    /// The first limit holds for every region together.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub global: bool,
    /// The price table of its cost limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prices: Option<super::prices::RawPrices>,
    /// Its levels: name -> header.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub levels: BTreeMap<String, String>,
    /// The level the first limit is charged to, when not the user.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<String>,
}

/// The Envoy configuration files.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyRules {
    /// [`envoy_digest`] of `files`.
    pub digest: String,
    /// One domain per file, as validated.
    pub files: Vec<EnvoyFile>,
}

/// One Envoy configuration file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvoyFile {
    /// Its name at publication.
    pub name: String,
    /// Its YAML text.
    pub text: String,
}

/// limitador's limits file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitadorRules {
    /// [`envoy_digest`] of `file` alone.
    pub digest: String,
    /// The file, as validated.
    pub file: EnvoyFile,
}

/// How a record's rules compile on this instance.
#[derive(Debug, Clone, Copy)]
pub struct Compilers {
    /// Envoy's (`envoy.algorithm`, `envoy.merge_domains`).
    pub envoy: envoy::Compile,
    /// How native rules' paths are compared (`rules.path_matching`).
    pub paths: PathForm,
    /// How limitador's limits count (`rules.limitador_algorithm`).
    pub limitador: Algorithm,
}

impl Compilers {
    /// Sliding windows, domains merged, paths as written, limitador's own
    /// counters: for tools that only ask whether a record compiles.
    pub const ANY: Compilers = Compilers {
        envoy: envoy::Compile { sliding: true, merge_domains: true },
        paths: PathForm { decode_slashes: false, ignore_case: false },
        limitador: Algorithm::FirstHitWindow,
    };
}

/// Why a record cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not signed, and unsigned records are not allowed (`rules.kafka.allow_unsigned`).
    #[error("unsigned record (rules.kafka.allow_unsigned is off)")]
    Unsigned,
    /// Signed by a key not in `rules.kafka.verify_keys`.
    #[error("signed by {0}, which is not in rules.kafka.verify_keys")]
    UnknownKey(String),
    /// The signature does not verify: the record changed after signing, or
    /// the envelope claims a key it was not signed with.
    #[error("the signature by {0} does not verify")]
    BadSignature(String),
    /// `rules.kafka.require_gate` is on and the record has no passing gate
    /// report for its version by thresholds at least as strict as `gate.*`.
    #[error("snapshot {version}: {why}")]
    Ungated {
        /// The record's version.
        version: String,
        /// What is wrong with its gate report.
        why: String,
    },
    /// Not JSON of this schema.
    #[error("undecodable snapshot record: {0}")]
    Undecodable(String),
    /// A schema this build does not read.
    #[error("snapshot schema {0:?} is not {SCHEMA:?}")]
    Schema(String),
    /// The rules do not compile.
    #[error("snapshot {version}: rules do not compile: {errors}")]
    Rules {
        /// The record's version.
        version: String,
        /// What the compiler said.
        errors: RuleErrors,
    },
    /// A stated hash is not the recomputed one (a corrupt or hand-edited record).
    #[error("snapshot {version}: {what} is {stated}, but the content hashes to {actual}")]
    Hash {
        /// The record's version.
        version: String,
        /// Which hash.
        what: &'static str,
        /// What the record says.
        stated: String,
        /// What its content hashes to.
        actual: String,
    },
}

/// A decoded, compiled rule set, ready to swap in.
#[derive(Debug)]
pub struct Compiled {
    /// The record's version.
    pub version: String,
    /// Native rules ([`super::empty`] when the record has none).
    pub native: Snapshot,
    /// The Envoy configuration, compiled with the instance's algorithm
    /// (empty when the record has none).
    pub envoy: EnvoyConfig,
    /// limitador's limits, compiled with the instance's algorithm (none
    /// when the record has none).
    pub limitador: Limits,
}

/// The digest of Envoy files: SHA-1 over names and texts, 16 hex digits.
pub fn envoy_digest(files: &[EnvoyFile]) -> String {
    let mut hasher = sha1_smol::Sha1::new();
    for file in files {
        hasher.update(format!("{}\n{}\n", file.name.len(), file.text.len()).as_bytes());
        hasher.update(file.name.as_bytes());
        hasher.update(file.text.as_bytes());
    }
    hasher.digest().to_string()[..16].to_owned()
}

/// The version of a whole record: SHA-1 over the native version, the
/// Envoy digest and, when it has limitador's limits, their digest; 16 hex
/// digits. Equal content, equal version.
pub fn record_version(
    native: Option<&NativeRules>,
    envoy: Option<&EnvoyRules>,
    limitador: Option<&LimitadorRules>,
) -> String {
    let mut text = String::new();
    let _ = write!(
        text,
        "native:{}\nenvoy:{}\n",
        native.map_or("-", |n| &n.version),
        envoy.map_or("-", |e| &e.digest)
    );
    if let Some(limitador) = limitador {
        let _ = writeln!(text, "limitador:{}", limitador.digest);
    }
    sha1_smol::Sha1::from(text.as_bytes()).digest().to_string()[..16].to_owned()
}

/// The native part of a record, from a compiled snapshot.
pub fn encode_native(snapshot: &Snapshot) -> NativeRules {
    let rules = snapshot
        .rules()
        .iter()
        .map(|rule| EncodedRule {
            source: rule.source.display().to_string(),
            rule_id: rule.id.to_string(),
            resource_path: rule.resource_path.clone(),
            client_type: rule.client_type.clone(),
            priority_bucket: rule.priority,
            limit: rule.limit,
            window_seconds: window_seconds(rule.calendar.as_deref(), rule.window.window_ms),
            period: rule.calendar.as_deref().map(Calendar::period),
            time_zone: rule.calendar.as_deref().map(|c| c.zone_name().to_owned()),
            unit: rule.unit.as_deref().map(str::to_owned),
            burst_capacity: rule.burst_capacity,
            algorithm: rule.window.algorithm.as_str().to_owned(),
            mode: rule.mode,
            failure_policy: rule.failure_policy,
            capacity: rule.window.capacity,
            overload: rule.overload,
            also: rule
                .also
                .iter()
                .enumerate()
                .map(|(index, also)| super::RawLimit {
                    limit: also.limit,
                    window_seconds: window_seconds(also.calendar.as_deref(), also.window.window_ms),
                    period: also.calendar.as_deref().map(Calendar::period),
                    time_zone: also.calendar.as_deref().map(|c| c.zone_name().to_owned()),
                    unit: also.unit.as_deref().map(str::to_owned),
                    burst_capacity: also.burst_capacity,
                    algorithm: Some(also.window.algorithm.as_str().to_owned()),
                    level: rule.level_name_at(index + 1).map(|name| name.to_string()),
                })
                .collect(),
            adaptive: rule.adaptive.as_deref().map(|a| super::AdaptiveSpec::of(&a.params)),
            global: rule.global,
            prices: rule.prices.as_deref().map(|p| p.raw().clone()),
            levels: rule
                .levels
                .iter()
                .flat_map(|levels| &levels.keys)
                .map(|key| (key.name.to_string(), key.header.to_string()))
                .collect(),
            level: rule.level_name_at(0).map(|name| name.to_string()),
        })
        .collect();
    NativeRules { version: snapshot.version().to_owned(), rules }
}

/// The Envoy part of a record, from files that compiled.
pub fn encode_envoy(files: &[(PathBuf, String)]) -> EnvoyRules {
    let files: Vec<EnvoyFile> = files
        .iter()
        .map(|(name, text)| EnvoyFile { name: name.display().to_string(), text: text.clone() })
        .collect();
    EnvoyRules { digest: envoy_digest(&files), files }
}

/// The limitador part of a record, from a file that compiled.
pub fn encode_limitador(name: &Path, text: &str) -> LimitadorRules {
    let file = EnvoyFile { name: name.display().to_string(), text: text.to_owned() };
    LimitadorRules { digest: envoy_digest(std::slice::from_ref(&file)), file }
}

impl SnapshotRecord {
    /// Parses a record's bytes (no compilation yet).
    pub fn parse(bytes: &[u8]) -> Result<Self, DecodeError> {
        let record: SnapshotRecord =
            serde_json::from_slice(bytes).map_err(|e| DecodeError::Undecodable(e.to_string()))?;
        if record.schema != SCHEMA {
            return Err(DecodeError::Schema(record.schema));
        }
        Ok(record)
    }

    /// Compiles the record's rules as `how` says and checks every hash it
    /// states.
    pub fn compile(&self, how: Compilers) -> Result<Compiled, DecodeError> {
        let version = &self.version;
        let hash = |what, stated: &str, actual: &str| {
            if stated == actual {
                Ok(())
            } else {
                Err(DecodeError::Hash {
                    version: version.clone(),
                    what,
                    stated: stated.to_owned(),
                    actual: actual.to_owned(),
                })
            }
        };
        let stated = record_version(self.native.as_ref(), self.envoy.as_ref(), self.limitador.as_ref());
        hash("the version", version, &stated)?;
        let rules_error = |errors| DecodeError::Rules { version: version.clone(), errors };
        let native = match &self.native {
            None => super::empty(),
            Some(native) => {
                let snapshot = decode_native(native, version, how.paths).map_err(rules_error)?;
                hash("the native version", &native.version, snapshot.version())?;
                for (encoded, rule) in native.rules.iter().zip(snapshot.rules()) {
                    hash(
                        "a rule's capacity",
                        &encoded.capacity.to_string(),
                        &rule.window.capacity.to_string(),
                    )?;
                }
                snapshot
            }
        };
        let envoy = match &self.envoy {
            None => EnvoyConfig::default(),
            Some(envoy) => {
                hash("the envoy digest", &envoy.digest, &envoy_digest(&envoy.files))?;
                let files: Vec<(PathBuf, String)> =
                    envoy.files.iter().map(|f| (PathBuf::from(&f.name), f.text.clone())).collect();
                envoy::compile_texts(&files, how.envoy).map_err(rules_error)?
            }
        };
        let limitador = match &self.limitador {
            None => Limits::default(),
            Some(limitador) => {
                let digest = envoy_digest(std::slice::from_ref(&limitador.file));
                hash("the limitador digest", &limitador.digest, &digest)?;
                let file = &limitador.file;
                Limits::parse(Path::new(&file.name), &file.text, how.limitador)
                    .map_err(|e| rules_error(RuleErrors(vec![e])))?
            }
        };
        Ok(Compiled { version: version.clone(), native, envoy, limitador })
    }
}

/// A limit's `window_seconds` as written: 0 for a calendar period.
fn window_seconds(calendar: Option<&Calendar>, window_ms: u64) -> u64 {
    if calendar.is_some() { 0 } else { window_ms / 1_000 }
}

/// Compiles encoded rules with the same validation as rule files.
fn decode_native(native: &NativeRules, version: &str, paths: PathForm) -> Result<Snapshot, RuleErrors> {
    let rules = native
        .rules
        .iter()
        .enumerate()
        .map(|(index, rule)| SourcedRule {
            file: Arc::from(Path::new(&rule.source)),
            index,
            raw: RawRule {
                rule_id: rule.rule_id.clone(),
                resource_path: rule.resource_path.clone(),
                client_type: rule.client_type.clone(),
                priority_bucket: rule.priority_bucket,
                limit: rule.limit,
                window_seconds: rule.window_seconds,
                period: rule.period,
                time_zone: rule.time_zone.clone(),
                unit: rule.unit.clone(),
                burst_capacity: rule.burst_capacity,
                mode: rule.mode,
                failure_policy: rule.failure_policy,
                algorithm: Some(rule.algorithm.clone()),
                overload: rule.overload,
                also: rule.also.clone(),
                adaptive: rule.adaptive,
                global: rule.global,
                prices: rule.prices.clone(),
                levels: rule.levels.clone(),
                level: rule.level.clone(),
            },
        })
        .collect();
    compile(Path::new(&format!("<snapshot {version}>")), rules, paths).map_err(RuleErrors)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::{Versioned as _, native::parse};

    const RULES: &str = r#"
rules:
  - { rule_id: a, resource_path: /a, limit: 10, window_seconds: 60, burst_capacity: 1.5, also: [ { limit: 100, window_seconds: 3600 } ] }
  - { rule_id: b, resource_path: "/b/*", client_type: IOS, priority_bucket: CRITICAL, limit: 5, window_seconds: 1, algorithm: gcra, mode: shadow, failure_policy: closed }
  - { rule_id: c, resource_path: /c, limit: 9, window_seconds: 60, level: team, levels: { team: X-Team, org: x-org }, also: [ { limit: 90, period: month, unit: cost, level: org } ] }
"#;
    const ENVOY: &str =
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: 1 }\n";

    const HOW: Compilers = Compilers {
        envoy: envoy::Compile::SLIDING,
        paths: PathForm { decode_slashes: false, ignore_case: false },
        limitador: Algorithm::FirstHitWindow,
    };
    const LIMITS: &str = "- { namespace: ns, max_value: 5, seconds: 60, conditions: [], variables: [] }\n";

    fn record() -> (Snapshot, SnapshotRecord) {
        let snapshot =
            compile(Path::new("r.yaml"), parse(Path::new("r.yaml"), RULES).unwrap(), PathForm::default())
                .unwrap();
        let native = encode_native(&snapshot);
        let envoy = encode_envoy(&[(PathBuf::from("d.yaml"), ENVOY.to_owned())]);
        let record = SnapshotRecord {
            schema: SCHEMA.to_owned(),
            version: record_version(Some(&native), Some(&envoy), None),
            previous: None,
            published_at: "2026-11-23T10:00:00.000Z".to_owned(),
            provenance: Provenance::default(),
            native: Some(native),
            envoy: Some(envoy),
            limitador: None,
            gate: None,
        };
        (snapshot, record)
    }

    #[test]
    fn a_record_round_trips_to_the_same_rules() {
        let (snapshot, record) = record();
        let bytes = serde_json::to_vec(&record).unwrap();
        let parsed = SnapshotRecord::parse(&bytes).unwrap();
        assert_eq!(parsed, record);
        let compiled = parsed.compile(HOW).unwrap();
        assert_eq!(compiled.native.version(), snapshot.version());
        assert_eq!(compiled.native.rules(), snapshot.rules());
        assert_eq!(compiled.native.rules()[2].level_name_at(1).map(|l| &**l), Some("org"));
        assert_eq!(compiled.envoy.domain_count(), 1);
        assert_eq!(compiled.version, record.version);
    }

    #[test]
    fn tampered_records_are_refused() {
        let (_, record) = record();
        let mut limit = record.clone();
        limit.native.as_mut().unwrap().rules[0].limit = 1_000;
        assert!(matches!(limit.compile(HOW), Err(DecodeError::Hash { what: "the native version", .. })));
        let mut version = record.clone();
        version.version = "0000000000000000".to_owned();
        assert!(matches!(version.compile(HOW), Err(DecodeError::Hash { what: "the version", .. })));

        let mut envoy = record.clone();
        envoy.envoy.as_mut().unwrap().files[0].text.push_str("# edited\n");
        assert!(matches!(envoy.compile(HOW), Err(DecodeError::Hash { what: "the envoy digest", .. })));

        // Consistent hashes over an invalid rule: the compiler refuses it.
        let mut invalid = record.clone();
        let native = invalid.native.as_mut().unwrap();
        native.rules[0].limit = 0;
        invalid.version = record_version(invalid.native.as_ref(), invalid.envoy.as_ref(), None);
        let error = invalid.compile(HOW).unwrap_err().to_string();
        assert!(error.contains("field `limit`") && error.contains("\"a\""), "{error}");

        assert!(matches!(SnapshotRecord::parse(b"{not json"), Err(DecodeError::Undecodable(_))));
        let mut future = serde_json::to_value(&record).unwrap();
        future["schema"] = "ratelimitd.rules.snapshot/2".into();
        let bytes = serde_json::to_vec(&future).unwrap();
        assert!(matches!(SnapshotRecord::parse(&bytes), Err(DecodeError::Schema(_))));
    }

    #[test]
    fn an_empty_record_serves_no_rules() {
        let record = SnapshotRecord {
            schema: SCHEMA.to_owned(),
            version: record_version(None, None, None),
            previous: Some("x".to_owned()),
            published_at: String::new(),
            provenance: Provenance::default(),
            native: None,
            envoy: None,
            limitador: None,
            gate: None,
        };
        let compiled = record.compile(Compilers { envoy: envoy::Compile::FIXED, ..HOW }).unwrap();
        assert!(compiled.native.rules().is_empty());
        assert_eq!(compiled.envoy.domain_count(), 0);
    }

    #[test]
    fn limitadors_limits_travel_as_their_file_and_are_checked() {
        let (_, mut record) = record();
        let before = record.version.clone();
        record.limitador = Some(encode_limitador(Path::new("limits.yaml"), LIMITS));
        record.version =
            record_version(record.native.as_ref(), record.envoy.as_ref(), record.limitador.as_ref());
        assert_ne!(record.version, before, "limitador's limits are part of the version");
        let bytes = serde_json::to_vec(&record).unwrap();
        let compiled = SnapshotRecord::parse(&bytes).unwrap().compile(HOW).unwrap();
        assert_eq!((compiled.limitador.of("ns").len(), compiled.limitador.size()), (1, 1));

        let mut edited = record.clone();
        edited.limitador.as_mut().unwrap().file.text = LIMITS.replace('5', "500");
        assert!(matches!(edited.compile(HOW), Err(DecodeError::Hash { what: "the limitador digest", .. })));
        let mut invalid = record.clone();
        invalid.limitador = Some(encode_limitador(Path::new("limits.yaml"), "- { namespace: ns }\n"));
        invalid.version =
            record_version(invalid.native.as_ref(), invalid.envoy.as_ref(), invalid.limitador.as_ref());
        let error = invalid.compile(HOW).unwrap_err().to_string();
        assert!(error.contains("limits.yaml") && error.contains("max_value"), "{error}");

        // A record without them serializes as before they existed.
        let (_, plain) = self::record();
        assert!(!String::from_utf8(serde_json::to_vec(&plain).unwrap()).unwrap().contains("limitador"));
    }
}
