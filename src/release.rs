//! The one way a candidate rule set becomes the record in force: the
//! rules in force read, the candidate compared with them, the publish gate
//! replayed against a capture, the record made, signed and produced to
//! the rules topic. `rules publish`, `rules sync` and the admin console
//! (`console`) all call [`publish`]; they differ only in where the
//! candidate's files and provenance come from and in how they show the
//! outcome. Errors are values: the CLI prints them, the console answers
//! them.

use std::path::Path;

use crate::{
    config::{Config, RulesSource},
    replay::{self, Capture, Report},
    rollout::{
        RolloutError,
        publish::{self, Candidate},
    },
    rules::{
        self,
        encoding::{Provenance, SnapshotRecord},
        gate::GateThresholds,
        limitador::Limits,
        signing::{Signer, Trust},
    },
};

/// Why nothing was published, or the rules could not be compared.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// The rules topic or the repository could not be read or written.
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    /// Rules (in force or the candidate) that do not compile, or a capture
    /// that cannot be read; the message says which.
    #[error("{0}")]
    Rules(String),
    /// The candidate fails the gate; the report says where.
    #[error("the candidate fails the gate; nothing published")]
    GateFailed(Box<Report>),
}

/// What [`publish`] did.
#[derive(Debug)]
pub enum Released {
    /// The candidate's version is already in force: nothing was produced.
    InForce {
        /// The version.
        version: String,
    },
    /// The record was produced.
    Published {
        /// The record as produced.
        record: Box<SnapshotRecord>,
        /// Its offset on the rules topic.
        offset: i64,
        /// The gate's report, when the candidate was gated.
        report: Option<Box<Report>>,
    },
}

/// The gate to pass before publishing: a capture and the thresholds.
#[derive(Debug, Clone, Copy)]
pub struct GateRun<'a> {
    /// The capture (a JSON-lines file).
    pub capture: &'a Path,
    /// The thresholds judged by.
    pub thresholds: GateThresholds,
}

/// A record ready to produce, or nothing to do.
#[derive(Debug)]
pub enum Prepared {
    /// The candidate's version is already in force.
    InForce {
        /// The version.
        version: String,
    },
    /// The record, gated when a gate was asked for.
    Ready {
        /// The record (its provenance may still be completed).
        record: Box<SnapshotRecord>,
        /// The gate's report.
        report: Option<Box<Report>>,
    },
}

/// Publishes `candidate` with `provenance`: nothing when its version is in
/// force; else, with `gate`, only when it passes (the record carries the
/// report); signed by `signer`. The topic's history is read with `trust`.
pub async fn publish(
    config: &Config,
    candidate: &Candidate,
    provenance: Provenance,
    gate: Option<GateRun<'_>>,
    signer: Option<&Signer>,
    trust: Trust,
) -> Result<Released, ReleaseError> {
    match prepare(config, candidate, provenance, gate, trust).await? {
        Prepared::InForce { version } => Ok(Released::InForce { version }),
        Prepared::Ready { record, report } => {
            let offset = publish::publish(&config.rules.kafka, &record, signer).await?;
            Ok(Released::Published { record, offset, report })
        }
    }
}

/// [`publish`] up to the record: the history read, the version in force
/// compared, the gate run. Blocking reads and the replay run off the
/// runtime's workers. The console commits between this and producing, so
/// that a change failing the gate never reaches the repository.
pub async fn prepare(
    config: &Config,
    candidate: &Candidate,
    provenance: Provenance,
    gate: Option<GateRun<'_>>,
    trust: Trust,
) -> Result<Prepared, ReleaseError> {
    let (kafka, reader_trust) = (config.rules.kafka.clone(), trust.clone());
    let history = tokio::task::spawn_blocking(move || publish::history(&kafka, &reader_trust))
        .await
        .unwrap_or_else(|e| Err(RolloutError::Kafka(format!("reader task failed: {e}"))))?;
    let current = publish::current(&history);
    let version = candidate.version();
    if current.is_some_and(|c| c.version == version) {
        return Ok(Prepared::InForce { version });
    }
    let mut record = publish::record(candidate, current, provenance);
    let mut report = None;
    if let Some(run) = gate {
        // Replay runs engines on runtimes of its own: off this one.
        let (config, current, candidate, capture, thresholds, trust) = (
            config.clone(),
            current.cloned(),
            candidate.clone(),
            run.capture.to_path_buf(),
            run.thresholds,
            trust.clone(),
        );
        let gated = tokio::task::spawn_blocking(move || {
            let capture = Capture::from_file(&capture).map_err(|e| ReleaseError::Rules(e.to_string()))?;
            self::gate(&config, current.as_ref(), &trust, &candidate, &capture, thresholds)
        })
        .await
        .unwrap_or_else(|e| Err(ReleaseError::Rules(format!("the gate's task failed: {e}"))))?;
        if !gated.gate.passed {
            return Err(ReleaseError::GateFailed(Box::new(gated)));
        }
        let at = humantime::format_rfc3339_millis(std::time::SystemTime::now()).to_string();
        record.gate = Some(gated.gate_report(&version, at));
        report = Some(Box::new(gated));
    }
    Ok(Prepared::Ready { record: Box::new(record), report })
}

/// Whose records count as published: those instances take
/// (`rules.kafka.verify_keys`, `allow_unsigned`), and the publisher's own:
/// `signer`, else the key of `rules.kafka.signing_key_file` when it loads.
pub fn trust(config: &Config, signer: Option<&Signer>) -> Trust {
    let kafka = &config.rules.kafka;
    let mut trust = config.rules_trust();
    let configured = || {
        let text = std::fs::read_to_string(kafka.signing_key_file.as_ref()?).ok()?;
        Signer::from_text(&text).ok()
    };
    let own = signer.cloned().or_else(configured);
    if let Some(key) = own.and_then(|s| crate::rules::signing::public_key(&s.public_key()).ok()) {
        trust.keys.push(key);
    }
    trust
}

/// The publish gate: replays `capture` through the rules in force (the
/// record `in_force`, else the configured rules; see [`rules_in_force`])
/// and `candidate`.
pub fn gate(
    config: &Config,
    in_force: Option<&SnapshotRecord>,
    trust: &Trust,
    candidate: &Candidate,
    capture: &Capture,
    thresholds: GateThresholds,
) -> Result<Report, ReleaseError> {
    let current = rules_in_force(config, in_force, trust)?;
    let record = publish::record(candidate, None, Provenance::default());
    let candidate = rules_of(config, &record, "the candidate")?;
    Ok(replay::replay(capture, current, candidate, &replay_settings(config, thresholds)))
}

/// How this configuration replays: its request bounds and Envoy policy.
pub fn replay_settings(config: &Config, thresholds: GateThresholds) -> replay::Settings {
    replay::Settings {
        max_user_id_bytes: config.limits.max_user_id_bytes,
        envoy: config.envoy.policy(),
        thresholds,
    }
}

/// The rules of `record`, compiled as this configuration compiles them
/// (no Envoy configuration when it has none; limitador's limits when it
/// has them or this configuration answers with them); an error says it of
/// `what`.
pub fn rules_of(config: &Config, record: &SnapshotRecord, what: &str) -> Result<replay::Rules, ReleaseError> {
    let compiled =
        record.compile(config.compilers()).map_err(|e| ReleaseError::Rules(format!("{what}: {e}")))?;
    let limitador = record.limitador.is_some() || config.rules.limitador_path.is_some();
    Ok(replay::Rules {
        native: compiled.native,
        envoy: record.envoy.is_some().then_some(compiled.envoy),
        limitador: limitador.then_some(compiled.limitador),
    })
}

/// The rules in force: `in_force` (a record from the rules topic), else,
/// with `rules.source: kafka`, the record in force on the topic (read with
/// `trust`), else `rules.path` (or the embedded rules), `rules.envoy_path`
/// and `rules.limitador_path`.
pub fn rules_in_force(
    config: &Config,
    in_force: Option<&SnapshotRecord>,
    trust: &Trust,
) -> Result<replay::Rules, ReleaseError> {
    let what = "the rules in force";
    if let Some(record) = in_force {
        return rules_of(config, record, what);
    }
    if config.rules.source == RulesSource::Kafka {
        let history = publish::history(&config.rules.kafka, trust)
            .map_err(|e| ReleaseError::Rules(format!("{what}: {e}")))?;
        if let Some(record) = publish::current(&history) {
            return rules_of(config, record, what);
        }
    }
    let loaded = match &config.rules.path {
        Some(path) => rules::load(path, config.rules.path_matching),
        None if config.rules.examples
            && config.rules.envoy_path.is_none()
            && config.rules.limitador_path.is_none() =>
        {
            rules::embedded(config.rules.path_matching)
        }
        None => Ok(rules::empty()),
    };
    let native = loaded.map_err(|e| ReleaseError::Rules(format!("{what}: {e}")))?;
    let envoy = match &config.rules.envoy_path {
        Some(path) => Some(
            rules::envoy::load(path, config.envoy.compile())
                .map_err(|e| ReleaseError::Rules(format!("the Envoy configuration in force: {e}")))?,
        ),
        None => None,
    };
    let limitador = match &config.rules.limitador_path {
        Some(path) => Some(
            Limits::load(path, config.rules.limitador_algorithm)
                .map_err(|e| ReleaseError::Rules(format!("limitador's limits in force: {e}")))?,
        ),
        None => None,
    };
    Ok(replay::Rules { native, envoy, limitador })
}
