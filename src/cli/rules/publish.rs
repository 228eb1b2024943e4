//! `ratelimitd rules publish` and `rules sync`: a rule set validated,
//! compiled, optionally gated, signed and published to the rules topic;
//! `sync` publishes what a Git commit holds.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::ExitCode,
};

use super::{SigningArgs, failed, signer};
use crate::{
    cli::{EXIT_USAGE, rule_sets::GateArgs},
    config::Config,
    release::{self, GateRun, ReleaseError, Released},
    rollout::{git, publish},
};

/// `ratelimitd rules publish …`
#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    /// Native rules: a YAML file or a directory of them.
    #[arg(required_unless_present_any = ["envoy", "limitador"])]
    pub path: Option<PathBuf>,
    /// envoyproxy/ratelimit configuration: a file or a directory, one domain per file.
    #[arg(long, value_name = "PATH")]
    pub envoy: Option<PathBuf>,
    /// Kuadrant limitador's limits file (served by instances with rules.limitador_path).
    #[arg(long, value_name = "FILE")]
    pub limitador: Option<PathBuf>,
    /// Replay this capture (a JSON-lines file) through the rules in force and
    /// the candidate first; refuse to publish a candidate that fails the gate.
    #[arg(long, value_name = "CAPTURE")]
    pub gate: Option<PathBuf>,
    #[command(flatten)]
    pub thresholds: GateArgs,
    #[command(flatten)]
    pub signing: SigningArgs,
}

impl PublishArgs {
    /// The files to publish.
    pub fn sources(&self) -> publish::Sources<'_> {
        publish::Sources {
            native: self.path.as_deref(),
            envoy: self.envoy.as_deref(),
            limitador: self.limitador.as_deref(),
        }
    }
}

/// `ratelimitd rules sync …`
#[derive(Debug, clap::Args)]
pub struct SyncArgs {
    /// The Git repository: a work tree (its uncommitted changes are not
    /// published) or a bare repository.
    #[arg(long, value_name = "DIR")]
    pub repo: PathBuf,
    /// The commit to publish.
    #[arg(long, value_name = "REV", default_value = "HEAD")]
    pub rev: String,
    /// What to publish, as `rules publish` takes it, with paths inside the
    /// repository.
    #[command(flatten)]
    pub publish: PublishArgs,
}

/// The thresholds `rules publish --gate` judges by: `gate.*` with the
/// flags over them. With `rules.kafka.require_gate` (instances configured
/// alike refuse anything else) a gate is required and may not be laxer.
fn gate_thresholds(
    args: &PublishArgs,
    config: &Config,
) -> Result<crate::rules::gate::GateThresholds, ExitCode> {
    let require = config.rules.kafka.require_gate;
    if require && args.gate.is_none() {
        eprintln!(
            "rules publish: rules.kafka.require_gate is on: instances serve only gated records; pass --gate CAPTURE"
        );
        return Err(ExitCode::from(EXIT_USAGE));
    }
    let thresholds = args.thresholds.thresholds(config.gate)?;
    if require && let Some(key) = thresholds.laxer_than(&config.gate) {
        eprintln!(
            "rules publish: --{} is laxer than gate.{key}: instances with rules.kafka.require_gate would refuse the record",
            key.replace('_', "-")
        );
        return Err(ExitCode::from(EXIT_USAGE));
    }
    Ok(thresholds)
}

/// Runs `rules sync`: the rules of `args.rev` in `args.repo` published as
/// `rules publish` would (exit codes included), with the commit as the
/// record's provenance; nothing when that version is in force. The
/// commit's files are read into a temporary directory and named by their
/// paths in the repository, as a publish from the repository's root would
/// name them.
pub async fn sync(args: SyncArgs, config: &Config) -> ExitCode {
    let Ok(dir) = tempfile::tempdir() else {
        eprintln!("rules sync: cannot make a temporary directory");
        return ExitCode::FAILURE;
    };
    let wanted: Vec<&Path> = args.publish.sources().paths().collect();
    let repo = std::path::absolute(&args.repo).unwrap_or(args.repo.clone());
    let commit = match git::export(&repo, &args.rev, &wanted, dir.path()) {
        Ok(commit) => commit,
        Err(e) => return failed("rules sync", &e),
    };
    publish_from(args.publish, config, Some((dir.path(), commit))).await
}

/// The rules `args` name, compiled as `serve` would; every problem printed
/// (exit 1). With `base` (`rules sync`) the paths are under it, and files
/// are named by their paths below it.
fn candidate(
    args: &PublishArgs,
    config: &Config,
    base: Option<&Path>,
) -> Result<publish::Candidate, ExitCode> {
    let (sources, how, allow_empty) = (args.sources(), config.compilers(), config.rules.allow_empty);
    let compiled = match base {
        Some(base) => publish::candidate_under(base, sources, how, allow_empty),
        None => publish::candidate(sources, how, allow_empty),
    };
    compiled.map_err(|errors| {
        for error in &errors.0 {
            eprintln!("{error}");
        }
        eprintln!("rules publish: {} problem(s); nothing published", errors.0.len());
        ExitCode::from(1)
    })
}

/// Runs `rules publish`: 0 published (or already in force), 1 invalid rules,
/// a failed gate or Kafka unreachable, 64 bad arguments or configuration.
pub async fn run(args: PublishArgs, config: &Config) -> ExitCode {
    publish_from(args, config, None).await
}

/// `rules publish` of `args`; with `synced` (`rules sync`) its paths are
/// under that directory, and its provenance is that commit, else the work
/// tree the files are in.
async fn publish_from(args: PublishArgs, config: &Config, synced: Option<(&Path, git::Commit)>) -> ExitCode {
    let kafka = &config.rules.kafka;
    if kafka.brokers.is_none() {
        eprintln!("rules publish: rules.kafka.brokers is not set");
        return ExitCode::from(EXIT_USAGE);
    }
    let signer = match signer("rules publish", &args.signing, config) {
        Ok(signer) => signer,
        Err(code) => return code,
    };
    let thresholds = match gate_thresholds(&args, config) {
        Ok(thresholds) => thresholds,
        Err(code) => return code,
    };
    let trust = release::trust(config, signer.as_ref());
    let base = synced.as_ref().map(|(dir, _)| *dir);
    let candidate = match candidate(&args, config, base) {
        Ok(candidate) => candidate,
        Err(code) => return code,
    };
    let mut provenance = publish::provenance(&candidate.paths);
    if let Some((_, commit)) = synced {
        (provenance.git_commit, provenance.git_author) = (Some(commit.id), Some(commit.author));
        provenance.git_dirty = Some(false);
    }
    let gate = args.gate.as_deref().map(|capture| GateRun { capture, thresholds });
    match release::publish(config, &candidate, provenance, gate, signer.as_ref(), trust).await {
        Ok(Released::InForce { version }) => {
            let _ = writeln!(std::io::stdout(), "{version}: already in force; nothing published");
            ExitCode::SUCCESS
        }
        Ok(Released::Published { record, offset, report }) => {
            let mut out = std::io::stdout().lock();
            if let Some(report) = report {
                let _ = out.write_all(report.table().as_bytes());
            }
            let _ = writeln!(
                out,
                "published {} at offset {offset} of {} (previous {}; commit {}{})",
                record.version,
                kafka.topic,
                record.previous.as_deref().unwrap_or("none"),
                record.provenance.git_commit.as_deref().unwrap_or("none"),
                if record.provenance.git_dirty == Some(true) { ", with uncommitted changes" } else { "" },
            );
            ExitCode::SUCCESS
        }
        Err(ReleaseError::GateFailed(report)) => {
            let _ = std::io::stdout().write_all(report.table().as_bytes());
            eprintln!("rules publish: the candidate fails the gate; nothing published");
            ExitCode::from(1)
        }
        Err(ReleaseError::Rollout(e)) => failed("rules publish", &e),
        Err(e @ ReleaseError::Rules(_)) => {
            eprintln!("rules publish: {e}");
            ExitCode::from(1)
        }
    }
}
