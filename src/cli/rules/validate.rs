//! `ratelimitd rules validate`: rule files loaded as `serve` would, every
//! problem printed.

use std::{io::Write as _, path::PathBuf, process::ExitCode};

/// What the paths hold.
#[derive(Debug, Clone, Copy)]
pub enum Format {
    /// Native rules.
    Native,
    /// envoyproxy/ratelimit configurations.
    Envoy,
    /// Kuadrant limitador limits files.
    Limitador,
}

/// Runs `ratelimitd rules validate`: 0 when every path loads, 1 otherwise.
/// It reads no configuration, so paths are compared in the default form
/// (`rules.path_matching` off) and limitador's limits counted by its own
/// windows; `serve` checks again in its own.
pub fn run(paths: &[PathBuf], format: Format) -> ExitCode {
    let mut ok = true;
    let mut out = std::io::stdout().lock();
    for path in paths {
        let loaded = match format {
            Format::Envoy => crate::rules::envoy::load_sliding(path)
                .map(|c| format!("{} domains, version {}", c.domain_count(), c.version())),
            Format::Native => crate::rules::load(path, crate::rules::PathForm::default())
                .map(|s| format!("{} rules, version {}", s.rules().len(), s.version())),
            Format::Limitador => {
                use crate::rules::Versioned as _;
                crate::rules::limitador::Limits::load(path, crate::limiter::Algorithm::FirstHitWindow)
                    .map(|l| format!("{} limits, version {}", l.size(), l.version()))
            }
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
