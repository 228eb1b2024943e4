//! `rules publish`, `rules rollback` and `rules history`: the write side of
//! the rules topic. Records are keyed by their version, so the compacted
//! topic keeps one record per distinct rule set (its latest publication)
//! and the record with the highest offset is the one in force.

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use super::RulesKafkaConfig;
use super::{RolloutError, topic};
use crate::rules::{
    self, RuleErrors,
    encoding::{self, Provenance, SCHEMA, SnapshotRecord},
    signing::{self, Signer, Trust},
};

/// A validated candidate: the parts of a record, before it has a place on the topic.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Native rules.
    pub native: Option<encoding::NativeRules>,
    /// Envoy configuration files.
    pub envoy: Option<encoding::EnvoyRules>,
    /// limitador's limits file.
    pub limitador: Option<encoding::LimitadorRules>,
    /// The paths it was loaded from.
    pub paths: Vec<PathBuf>,
}

/// Where a candidate's files are: native rules, Envoy configuration,
/// limitador's limits file; any may be absent.
#[derive(Debug, Clone, Copy, Default)]
pub struct Sources<'a> {
    /// Native rules: a file or a directory.
    pub native: Option<&'a Path>,
    /// envoyproxy/ratelimit configuration: a file or a directory.
    pub envoy: Option<&'a Path>,
    /// limitador's limits file.
    pub limitador: Option<&'a Path>,
}

impl<'a> Sources<'a> {
    /// Every path given, in that order.
    pub fn paths(self) -> impl Iterator<Item = &'a Path> {
        self.native.into_iter().chain(self.envoy).chain(self.limitador)
    }
}

impl Candidate {
    /// The version the record will have.
    pub fn version(&self) -> String {
        encoding::record_version(self.native.as_ref(), self.envoy.as_ref(), self.limitador.as_ref())
    }

    /// The candidate as if loaded from `base` as the working directory:
    /// every file named by its path under `base` (`rules sync` loads a
    /// commit's files from a temporary directory, and names them as a
    /// publish from the repository's root would; Envoy and limitador file
    /// names are part of the version).
    pub fn relative_to(mut self, base: &Path) -> Self {
        let strip = |name: &str| {
            Path::new(name).strip_prefix(base).map_or(name.to_owned(), |p| p.display().to_string())
        };
        for rule in self.native.iter_mut().flat_map(|n| n.rules.iter_mut()) {
            rule.source = strip(&rule.source);
        }
        if let Some(envoy) = &mut self.envoy {
            for file in &mut envoy.files {
                file.name = strip(&file.name);
            }
            envoy.digest = encoding::envoy_digest(&envoy.files);
        }
        if let Some(limitador) = &mut self.limitador {
            *limitador =
                encoding::encode_limitador(Path::new(&strip(&limitador.file.name)), &limitador.file.text);
        }
        for path in &mut self.paths {
            *path = path.strip_prefix(base).map_or(path.clone(), Path::to_path_buf);
        }
        self
    }
}

/// Loads and compiles the files `sources` names with the compilers `serve`
/// uses; every problem is returned, as `rules validate` reports it. A set
/// without rules is one unless `allow_empty` (`rules.allow_empty`):
/// instances would refuse it.
pub fn candidate(
    sources: Sources<'_>,
    how: encoding::Compilers,
    allow_empty: bool,
) -> Result<Candidate, RuleErrors> {
    let mut errors = Vec::new();
    let native = sources.native.and_then(|path| {
        kept(&mut errors, rules::load(path, how.paths).and_then(|s| rules::non_empty(s, path, allow_empty)))
            .map(|snapshot| encoding::encode_native(&snapshot))
    });
    let envoy = sources.envoy.and_then(|path| {
        let files = kept(&mut errors, rules::envoy::read_files(path))?;
        let compiled = rules::envoy::compile_texts(&files, how.envoy)
            .and_then(|set| rules::non_empty(set, path, allow_empty));
        kept(&mut errors, compiled).map(|_| encoding::encode_envoy(&files))
    });
    let limitador = sources.limitador.and_then(|path| {
        let text =
            std::fs::read_to_string(path).map_err(|e| RuleErrors(vec![rules::RuleError::io(path, &e)]));
        let text = kept(&mut errors, text)?;
        let compiled = rules::limitador::Limits::parse(path, &text, how.limitador)
            .map_err(|e| RuleErrors(vec![e]))
            .and_then(|set| rules::non_empty(set, path, allow_empty));
        kept(&mut errors, compiled).map(|_| encoding::encode_limitador(path, &text))
    });
    if !errors.is_empty() {
        return Err(RuleErrors(errors));
    }
    let paths = sources.paths().map(Path::to_path_buf).collect();
    Ok(Candidate { native, envoy, limitador, paths })
}

/// `result`'s value, or nothing with its errors added to `errors`.
fn kept<T>(errors: &mut Vec<rules::RuleError>, result: Result<T, RuleErrors>) -> Option<T> {
    result.map_err(|e| errors.extend(e.0)).ok()
}

/// [`candidate`] of the files `sources` names below `base` (a directory
/// holding a commit's files: `rules sync`, the console): every file, and
/// every error, named by its path below `base`, as a publish from the
/// repository's root names them (Envoy and limitador file names are part
/// of the version).
pub fn candidate_under(
    base: &Path,
    sources: Sources<'_>,
    how: encoding::Compilers,
    allow_empty: bool,
) -> Result<Candidate, RuleErrors> {
    let joined = |p: Option<&Path>| p.map(|p| base.join(p));
    let (native, envoy, limitador) =
        (joined(sources.native), joined(sources.envoy), joined(sources.limitador));
    let under =
        Sources { native: native.as_deref(), envoy: envoy.as_deref(), limitador: limitador.as_deref() };
    match candidate(under, how, allow_empty) {
        Ok(candidate) => Ok(candidate.relative_to(base)),
        Err(mut errors) => {
            for error in &mut errors.0 {
                if let Ok(inside) = error.file.strip_prefix(base) {
                    error.file = inside.to_path_buf();
                }
            }
            Err(errors)
        }
    }
}

/// Where the rules come from: the host, the paths and, when they are in a
/// git work tree, the commit, its author and whether the files differ from it.
pub fn provenance(paths: &[PathBuf]) -> Provenance {
    let host =
        std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_owned()).unwrap_or_default();
    let mut provenance = Provenance {
        host,
        paths: paths.iter().map(|p| p.display().to_string()).collect(),
        publisher: format!("ratelimitd {}", env!("CARGO_PKG_VERSION")),
        ..Provenance::default()
    };
    let Some(first) = paths.first() else { return provenance };
    let dir = if first.is_dir() {
        first.clone()
    } else {
        first.parent().map(Path::to_path_buf).unwrap_or_default()
    };
    let dir = if dir.as_os_str().is_empty() { PathBuf::from(".") } else { dir };
    let git = |args: &[&str]| {
        Command::new("git")
            .arg("-C")
            .arg(&dir)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    provenance.git_commit = git(&["rev-parse", "HEAD"]).filter(|c| !c.is_empty());
    if provenance.git_commit.is_some() {
        provenance.git_author = git(&["log", "-1", "--format=%an <%ae>"]);
        // Paths are relative to the caller's directory, git -C changes it: use absolute ones.
        let absolute: Vec<String> = paths
            .iter()
            .map(|p| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()).display().to_string())
            .collect();
        let mut status = vec!["status", "--porcelain", "--"];
        status.extend(absolute.iter().map(String::as_str));
        provenance.git_dirty = git(&status).map(|out| !out.is_empty());
    }
    provenance
}

/// A record for `candidate` following `previous`.
pub fn record(
    candidate: &Candidate,
    previous: Option<&SnapshotRecord>,
    provenance: Provenance,
) -> SnapshotRecord {
    SnapshotRecord {
        schema: SCHEMA.to_owned(),
        version: candidate.version(),
        previous: previous.map(|p| p.version.clone()),
        published_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
        provenance,
        native: candidate.native.clone(),
        envoy: candidate.envoy.clone(),
        limitador: candidate.limitador.clone(),
        gate: None,
    }
}

/// One record of the rules topic as `history` lists it.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Its offset.
    pub offset: i64,
    /// The record, or why it cannot be read.
    pub record: Result<SnapshotRecord, String>,
    /// The public key it is signed with, as it claims (unverified when
    /// `record` is an error).
    pub signer: Option<String>,
}

/// Every record of the rules topic, oldest first; a record `trust` does
/// not take (unsigned, or signed by another key) is listed as refused, as
/// instances with that trust refuse it.
pub fn history(kafka: &RulesKafkaConfig, trust: &Trust) -> Result<Vec<Entry>, RolloutError> {
    let brokers = brokers(kafka)?;
    let records = topic::read_all(brokers, &kafka.properties, &kafka.topic)?;
    Ok(records
        .into_iter()
        .filter_map(|r| {
            let payload = r.payload?;
            Some(Entry {
                offset: r.offset,
                signer: signing::signer_of(&payload),
                record: trust
                    .open(&payload)
                    // Display only: a record any instance could compile is shown as valid.
                    .and_then(|record| record.compile(encoding::Compilers::ANY).map(|_| record))
                    .map_err(|e| e.to_string()),
            })
        })
        .collect())
}

/// The record in force: the newest one that decodes and compiles.
pub fn current(history: &[Entry]) -> Option<&SnapshotRecord> {
    history.iter().rev().find_map(|e| e.record.as_ref().ok())
}

/// The configured brokers, or an error naming the key.
pub(crate) fn brokers(kafka: &RulesKafkaConfig) -> Result<&str, RolloutError> {
    kafka.brokers.as_deref().ok_or_else(|| RolloutError::Config("rules.kafka.brokers is not set".to_owned()))
}

/// Writes `record` to the rules topic, keyed by its version, signed by
/// `signer` (unsigned without one); returns its offset.
pub async fn publish(
    kafka: &RulesKafkaConfig,
    record: &SnapshotRecord,
    signer: Option<&Signer>,
) -> Result<i64, RolloutError> {
    let brokers = brokers(kafka)?;
    let producer = topic::producer(brokers, &kafka.properties, Duration::from_secs(30))?;
    let payload = match signer {
        Some(signer) => signer.sign(record),
        None => serde_json::to_vec(record).map_err(|e| RolloutError::Kafka(e.to_string()))?,
    };
    topic::produce(&producer, &kafka.topic, &record.version, Some(&payload)).await
}

/// A record that puts `version` (an earlier record on the topic) back in force.
pub fn rollback(history: &[Entry], version: &str) -> Result<SnapshotRecord, RolloutError> {
    let current = current(history);
    let target = history
        .iter()
        .rev()
        .filter_map(|e| e.record.as_ref().ok())
        .find(|r| r.version == version)
        .ok_or_else(|| RolloutError::Unknown(version.to_owned()))?;
    let mut provenance = provenance(&[]);
    provenance.paths = target.provenance.paths.clone();
    provenance.git_commit = target.provenance.git_commit.clone();
    provenance.git_author = target.provenance.git_author.clone();
    provenance.git_dirty = target.provenance.git_dirty;
    provenance.rolled_back_from = current.map(|c| c.version.clone());
    Ok(SnapshotRecord {
        previous: current.map(|c| c.version.clone()),
        published_at: humantime::format_rfc3339_millis(SystemTime::now()).to_string(),
        provenance,
        ..target.clone()
    })
}
