//! `ratelimitd rules …`: the rule set's commands, one file each:
//! `validate` and `keygen` (no configuration), `diff`, and the operator's
//! side of the rules topic (`publish` and `sync`, `rollback`, `history`,
//! `status`), with the signing key and error mapping they share.

pub mod diff;
pub mod history;
pub mod keygen;
pub mod publish;
pub mod rollback;
pub mod status;
pub mod validate;

use std::{path::PathBuf, process::ExitCode};

use clap::Subcommand;

use super::EXIT_USAGE;
use crate::{config::Config, rollout::RolloutError, rules::signing::Signer};

/// `ratelimitd rules …`
#[derive(Debug, Subcommand)]
pub enum RulesCommand {
    /// Load and validate rule files or directories; print every problem.
    Validate {
        /// Rule files or directories.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// The paths are envoyproxy/ratelimit configurations (rules.envoy_path), not native rules.
        #[arg(long, conflicts_with = "limitador")]
        envoy: bool,
        /// The paths are Kuadrant limitador limits files (rules.limitador_path), not native rules.
        #[arg(long)]
        limitador: bool,
    },
    /// Validate, compile and publish a rule set to the rules topic (rules.kafka.*).
    Publish(publish::PublishArgs),
    /// Publish the rules a Git repository's commit (default HEAD) holds
    /// when they differ from the version in force, with that commit as the
    /// record's provenance: the repository is the source of truth, however
    /// a change reached it. Paths are inside the repository.
    Sync(publish::SyncArgs),
    /// Publish an earlier version again (see `rules history`).
    Rollback {
        /// The version to put back in force.
        version: String,
        #[command(flatten)]
        signing: SigningArgs,
    },
    /// What a candidate rule set (native, `--envoy`, or both) changes
    /// against the rules in force (or `--from`, `--from-envoy`): rules and
    /// limits added, removed and each changed field, and with `--capture`
    /// how many captured requests each change touches.
    Diff(diff::DiffArgs),
    /// Make a publisher's Ed25519 key pair: the private key goes to a new
    /// file (mode 0600), the public key (for rules.kafka.verify_keys) to stdout.
    Keygen {
        /// The private key's file; it must not exist.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
    /// List the snapshots on the rules topic, oldest first; the last valid one is in force.
    History,
    /// List the version every instance serves (from rules.kafka.status_topic);
    /// exit 0 when all serve the version in force, 1 otherwise.
    Status,
}

/// How a published record is signed.
#[derive(Debug, Clone, clap::Args)]
pub struct SigningArgs {
    /// The publisher's private key file (`rules keygen`); default
    /// rules.kafka.signing_key_file.
    #[arg(long, value_name = "FILE", conflicts_with = "unsigned")]
    pub signing_key: Option<PathBuf>,
    /// Publish without a signature: only instances with
    /// rules.kafka.allow_unsigned serve it.
    #[arg(long)]
    pub unsigned: bool,
}

/// The key `rules publish` and `rules rollback` sign with: `--signing-key`,
/// else `rules.kafka.signing_key_file`; `None` with `--unsigned`.
pub(super) fn signer(what: &str, args: &SigningArgs, config: &Config) -> Result<Option<Signer>, ExitCode> {
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

pub(super) fn failed(what: &str, error: &RolloutError) -> ExitCode {
    eprintln!("{what}: {error}");
    match error {
        RolloutError::Config(_) => ExitCode::from(EXIT_USAGE),
        RolloutError::Kafka(_) | RolloutError::Unknown(_) | RolloutError::Git(_) => ExitCode::from(1),
    }
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
