//! `ratelimitd rules validate`: rule files loaded as `serve` would, every
//! problem printed.

use std::{io::Write as _, path::PathBuf, process::ExitCode};

/// Runs `ratelimitd rules validate`: 0 when every path loads, 1 otherwise.
/// It reads no configuration, so paths are compared in the default form
/// (`rules.path_matching` off); `serve` checks again in its own.
pub fn run(paths: &[PathBuf], envoy: bool) -> ExitCode {
    let mut ok = true;
    let mut out = std::io::stdout().lock();
    for path in paths {
        let loaded = if envoy {
            crate::rules::envoy::load_sliding(path)
                .map(|c| format!("{} domains, version {}", c.domain_count(), c.version()))
        } else {
            crate::rules::load(path, crate::rules::PathForm::default())
                .map(|s| format!("{} rules, version {}", s.rules().len(), s.version()))
        };
        match loaded {
            Ok(summary) => {
                let _ = writeln!(out, "{}: ok, {summary}", path.display());
            }
            Err(errors) => {
                ok = false;
                for error in &errors.0 {
                    eprintln!("{error}");
                }
                eprintln!("{}: {} problem(s)", path.display(), errors.0.len());
            }
        }
    }
    if ok { ExitCode::SUCCESS } else { ExitCode::from(1) }
}
