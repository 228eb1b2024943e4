//! `ratelimitd rules keygen`: a publisher's Ed25519 key pair.

use std::{io::Write as _, process::ExitCode};

use crate::rules::signing::Signer;

/// Runs `rules keygen --out FILE`: 0 written, 1 the file exists or cannot
/// be written.
pub fn run(out: &std::path::Path) -> ExitCode {
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
