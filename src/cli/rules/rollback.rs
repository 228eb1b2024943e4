//! `ratelimitd rules rollback`: an earlier record published again.

use std::{io::Write as _, process::ExitCode};

use super::{SigningArgs, blocking, failed, signer};
use crate::{config::Config, release, rollout::publish};

/// Runs `rules rollback VERSION`: publishes that earlier record again.
pub async fn run(version: &str, signing: &SigningArgs, config: &Config) -> ExitCode {
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
