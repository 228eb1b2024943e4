//! `ratelimitd rules history`: the records on the rules topic, oldest first.

use std::{io::Write as _, process::ExitCode};

use super::failed;
use crate::{
    config::Config,
    release,
    rollout::publish::{self, Entry},
};

/// Runs `rules history`: one line per record, oldest first.
pub fn run(config: &Config) -> ExitCode {
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
