//! `rules publish`, `rules sync`, `rules rollback`, `rules history` and `rules status`:
//! the operator's side of the rules topic (`rollout`, through `release`),
//! and `admin`, which serves the console (`console`) over the same path.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::ExitCode,
};

use super::{EXIT_USAGE, PublishArgs, SigningArgs, SyncArgs};
use crate::{
    clock::{Clock, SystemClock},
    config::Config,
    release::{self, GateRun, ReleaseError, Released},
    rollout::{
        RolloutError, git,
        publish::{self, Entry},
        status,
    },
    rules::{encoding::SnapshotRecord, signing::Signer},
};

/// Runs `rules keygen --out FILE`: 0 written, 1 the file exists or cannot
/// be written.
pub fn keygen(out: &std::path::Path) -> ExitCode {
    use std::os::unix::fs::OpenOptionsExt as _;
    let signer = match Signer::generate() {
        Ok(signer) => signer,
        Err(e) => {
            eprintln!("rules keygen: no randomness: {e}");
            return ExitCode::from(1);
        }
    };
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(out)
        .and_then(|mut file| writeln!(file, "{}", signer.to_text()));
    if let Err(e) = written {
        eprintln!("rules keygen: {}: {e}", out.display());
        return ExitCode::from(1);
    }
    let _ = writeln!(std::io::stdout(), "{}", signer.public_key());
    ExitCode::SUCCESS
}

/// The key `rules publish` and `rules rollback` sign with: `--signing-key`,
/// else `rules.kafka.signing_key_file`; `None` with `--unsigned`.
fn signer(what: &str, args: &SigningArgs, config: &Config) -> Result<Option<Signer>, ExitCode> {
    if args.unsigned {
        return Ok(None);
    }
    let Some(path) = args.signing_key.as_ref().or(config.rules.kafka.signing_key_file.as_ref()) else {
        eprintln!(
            "{what}: no signing key: pass --signing-key FILE or set rules.kafka.signing_key_file \
             (--unsigned only for instances with rules.kafka.allow_unsigned)"
        );
        return Err(ExitCode::from(EXIT_USAGE));
    };
    let text = std::fs::read_to_string(path).map_err(|e| {
        eprintln!("{what}: {}: {e}", path.display());
        ExitCode::from(EXIT_USAGE)
    })?;
    Signer::from_text(&text).map(Some).map_err(|e| {
        eprintln!("{what}: {}: {e}", path.display());
        ExitCode::from(EXIT_USAGE)
    })
}

fn failed(what: &str, error: &RolloutError) -> ExitCode {
    eprintln!("{what}: {error}");
    match error {
        RolloutError::Config(_) => ExitCode::from(EXIT_USAGE),
        RolloutError::Kafka(_) | RolloutError::Unknown(_) | RolloutError::Git(_) => ExitCode::from(1),
    }
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
    let wanted: Vec<&Path> =
        args.publish.path.iter().chain(&args.publish.envoy).map(PathBuf::as_path).collect();
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
    let (native, envoy) = (args.path.as_deref(), args.envoy.as_deref());
    let (how, paths, allow_empty) =
        (config.envoy.compile(), config.rules.path_matching, config.rules.allow_empty);
    let compiled = match base {
        Some(base) => publish::candidate_under(base, native, envoy, how, paths, allow_empty),
        None => publish::candidate(native, envoy, how, paths, allow_empty),
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
pub async fn publish(args: PublishArgs, config: &Config) -> ExitCode {
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

/// Runs `ratelimitd admin` until `stop`: 0 after a clean stop, 64 for a
/// configuration it cannot run with, 1 when it cannot start.
pub async fn admin(
    args: &super::AdminArgs,
    config: Config,
    stop: impl std::future::Future<Output = ()>,
) -> ExitCode {
    if config.rules.kafka.brokers.is_none() {
        eprintln!("admin: rules.kafka.brokers is not set: the console publishes to the rules topic");
        return ExitCode::from(EXIT_USAGE);
    }
    let signer = match signer("admin", &args.signing, &config) {
        Ok(signer) => signer,
        Err(code) => return code,
    };
    let addr = config.admin.addr();
    let console = match crate::console::Console::new(config, signer) {
        Ok(console) => console,
        Err(e @ crate::console::ConsoleError::Config(_)) => {
            eprintln!("admin: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
        Err(e) => {
            eprintln!("admin: {e}");
            return ExitCode::from(1);
        }
    };
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("admin: admin.listen {addr}: cannot bind: {e}");
            return ExitCode::from(1);
        }
    };
    tracing::info!(%addr, "admin console listening");
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let serving = tokio::spawn(crate::console::run(console, listener, stopped));
    stop.await;
    let _ = stopping.send(true);
    let _ = serving.await;
    ExitCode::SUCCESS
}

/// Runs `rules rollback VERSION`: publishes that earlier record again.
pub async fn rollback(version: &str, signing: &SigningArgs, config: &Config) -> ExitCode {
    let kafka = &config.rules.kafka;
    let signer = match signer("rules rollback", signing, config) {
        Ok(signer) => signer,
        Err(code) => return code,
    };
    let trust = release::trust(config, signer.as_ref());
    let history = match blocking(kafka.clone(), move |k| publish::history(&k, &trust)).await {
        Ok(history) => history,
        Err(e) => return failed("rules rollback", &e),
    };
    if publish::current(&history).is_some_and(|c| c.version == version) {
        let _ = writeln!(std::io::stdout(), "{version}: already in force; nothing published");
        return ExitCode::SUCCESS;
    }
    let record = match publish::rollback(&history, version) {
        Ok(record) => record,
        Err(e) => return failed("rules rollback", &e),
    };
    match publish::publish(kafka, &record, signer.as_ref()).await {
        Ok(offset) => {
            let _ = writeln!(
                std::io::stdout(),
                "rolled back to {version} (from {}) at offset {offset} of {}",
                record.previous.as_deref().unwrap_or("none"),
                kafka.topic
            );
            ExitCode::SUCCESS
        }
        Err(e) => failed("rules rollback", &e),
    }
}

/// Runs `rules history`: one line per record, oldest first.
pub fn history(config: &Config) -> ExitCode {
    let history = match publish::history(&config.rules.kafka, &release::trust(config, None)) {
        Ok(history) => history,
        Err(e) => return failed("rules history", &e),
    };
    let in_force = publish::current(&history).map(|r| r.version.clone());
    let mut out = std::io::stdout().lock();
    let _ = writeln!(
        out,
        "{:>7}  {:<16}  {:<24}  {:<16}  {:<10}  BY",
        "OFFSET", "VERSION", "PUBLISHED", "PREVIOUS", "COMMIT"
    );
    for Entry { offset, record, signer } in &history {
        let signer = signer.as_deref().map_or_else(|| "unsigned".to_owned(), |k| format!("signed by {k}"));
        match record {
            Ok(r) => {
                let mark = if Some(&r.version) == in_force.as_ref() { "  (in force)" } else { "" };
                let gate = r.gate.as_ref().map_or_else(
                    || ", ungated".to_owned(),
                    |g| {
                        format!(
                            ", gated ({} requests, worst {} {} {:.2}%)",
                            g.capture_requests,
                            g.gate.worst.kind.as_str(),
                            g.gate.worst.name,
                            g.gate.worst.drop * 100.0
                        )
                    },
                );
                let _ = writeln!(
                    out,
                    "{offset:>7}  {:<16}  {:<24}  {:<16}  {:<10}  {}{}, {signer}{gate}{mark}",
                    r.version,
                    r.published_at,
                    r.previous.as_deref().unwrap_or("-"),
                    r.provenance.git_commit.as_deref().map_or("-", |c| &c[..c.len().min(10)]),
                    r.provenance.git_author.as_deref().unwrap_or(&r.provenance.host),
                    r.provenance
                        .rolled_back_from
                        .as_deref()
                        .map(|f| format!(", rollback from {f}"))
                        .unwrap_or_default(),
                );
            }
            Err(e) => {
                let _ = writeln!(out, "{offset:>7}  (refused: {e})");
            }
        }
    }
    ExitCode::SUCCESS
}

/// Runs `rules status`: every instance's report against the version in
/// force; 0 when every instance reporting within three intervals serves it
/// (and at least one does).
pub fn status(config: &Config) -> ExitCode {
    let kafka = &config.rules.kafka;
    let trust = release::trust(config, None);
    let (history, reports) = match publish::history(kafka, &trust).and_then(|h| Ok((h, status::read(kafka)?)))
    {
        Ok(both) => both,
        Err(e) => return failed("rules status", &e),
    };
    let in_force: Option<&SnapshotRecord> = publish::current(&history);
    let now = SystemClock.now_ms();
    let stale_after = kafka.status_interval_ms.saturating_mul(3);
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "in force: {}", in_force.map_or("nothing published", |r| &r.version));
    let _ = writeln!(
        out,
        "{:<32}  {:<26}  {:<9}  {:>9}  {:>8}  STATE",
        "INSTANCE", "VERSION", "ORIGIN", "SINCE", "REPORTED"
    );
    let mut converged = true;
    for report in &reports {
        let standing = status::standing(report, in_force.map(|f| f.version.as_str()), now, stale_after);
        let state = match standing {
            "stale" => "stale (no report for 3 intervals)",
            "waiting" => "waiting for rules",
            other => other,
        };
        if !matches!(standing, "stale" | "current") {
            converged = false;
        }
        let ago = |ms: Option<u64>| {
            ms.map_or("-".to_owned(), |ms| format!("{}s ago", now.saturating_sub(ms) / 1_000))
        };
        let _ = writeln!(
            out,
            "{:<32}  {:<26}  {:<9}  {:>9}  {:>8}  {state}",
            report.instance,
            report.version.as_deref().unwrap_or("-"),
            report.origin.as_deref().unwrap_or("-"),
            ago(report.since_ms),
            ago(Some(report.reported_ms)),
        );
        if let Some(why) = &report.last_refusal {
            let _ = writeln!(out, "{:<32}  refused {} record(s); the last: {why}", "", report.rejected);
        }
        if !report.adaptive.is_empty() {
            let limits: Vec<String> =
                report.adaptive.iter().map(|(rule, limit)| format!("{rule}={limit}")).collect();
            let _ = writeln!(out, "{:<32}  adaptive limits: {}", "", limits.join(", "));
        }
    }
    if reports.is_empty() {
        let _ = writeln!(out, "(no instance reports)");
    }
    let current = reports.iter().filter(|r| r.version.as_ref() == in_force.map(|f| &f.version)).count();
    if converged && current > 0 { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

/// Runs a blocking Kafka read off the runtime's workers.
async fn blocking<T: Send + 'static>(
    kafka: crate::config::RulesKafkaConfig,
    read: impl FnOnce(crate::config::RulesKafkaConfig) -> Result<T, RolloutError> + Send + 'static,
) -> Result<T, RolloutError> {
    tokio::task::spawn_blocking(move || read(kafka))
        .await
        .unwrap_or_else(|e| Err(RolloutError::Kafka(format!("reader task failed: {e}"))))
}
