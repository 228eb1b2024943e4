//! `ratelimitd migrate`: the numbered setup steps, applied or reported.

use std::{io::Write as _, process::ExitCode};

use crate::{
    config::Config,
    migrate::{self, Applied},
};

/// Runs `ratelimitd migrate`: 0 when every step is applied or already was, 1 otherwise.
pub async fn run(config: &Config) -> ExitCode {
    match migrate::run(config).await {
        Ok(results) => {
            let mut out = std::io::stdout().lock();
            for (file, applied) in &results {
                let (what, detail) = match applied {
                    Applied::Changed(d) => ("applied", d),
                    Applied::AlreadyApplied(d) => ("already applied", d),
                    Applied::Skipped(d) => ("skipped", d),
                };
                let _ = writeln!(out, "{file}: {what}: {detail}");
            }
            let summary = migrate::summary(&results);
            let count = |key| summary.get(key).copied().unwrap_or(0);
            if count("applied") == 0 {
                let _ = writeln!(out, "nothing to do: {} migrations, none changed anything", results.len());
            } else {
                let _ = writeln!(
                    out,
                    "{} applied, {} already applied, {} skipped",
                    count("applied"),
                    count("already applied"),
                    count("skipped")
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("migrate: {e}");
            ExitCode::from(1)
        }
    }
}
