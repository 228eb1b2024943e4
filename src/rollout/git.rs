//! `rules sync`'s reading of a Git repository: the files of some paths as
//! one commit holds them (not the work tree), written out under a fresh
//! directory with their repository paths, and who made the commit. Works
//! on a work tree and on a bare repository alike; runs the `git` command.

use std::{
    path::{Component, Path},
    process::Command,
};

use super::RolloutError;

/// The commit the files were read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Its full id.
    pub id: String,
    /// Its author, `Name <email>`.
    pub author: String,
}

/// Runs `git -C repo args…`: its standard output, or an error naming the
/// repository and what git said.
fn git(repo: &Path, args: &[&str]) -> Result<Vec<u8>, RolloutError> {
    let out = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(args)
        .output()
        .map_err(|e| RolloutError::Git(format!("cannot run git: {e}")))?;
    if !out.status.success() {
        let said = String::from_utf8_lossy(&out.stderr);
        return Err(RolloutError::Git(format!(
            "{}: git {}: {}",
            repo.display(),
            args.join(" "),
            said.trim()
        )));
    }
    Ok(out.stdout)
}

/// Writes the files under `paths` (each a file or a directory, relative to
/// the repository's root) as commit `rev` of `repo` holds them into `into`,
/// at the same relative paths; returns the commit. A path the commit does
/// not have, a path leaving the repository, or a symbolic link among the
/// files is an error naming it.
pub fn export(repo: &Path, rev: &str, paths: &[&Path], into: &Path) -> Result<Commit, RolloutError> {
    let spec = format!("{rev}^{{commit}}");
    let id =
        String::from_utf8_lossy(&git(repo, &["rev-parse", "--verify", "--quiet", &spec])?).trim().to_owned();
    let author =
        String::from_utf8_lossy(&git(repo, &["log", "-1", "--format=%an <%ae>", &id])?).trim().to_owned();
    for path in paths {
        if path.is_absolute() || path.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(RolloutError::Git(format!("{}: give a path inside the repository", path.display())));
        }
        let listing = git(repo, &["ls-tree", "-r", "-z", "--full-tree", &id, "--", &path.to_string_lossy()])?;
        let mut found = 0;
        for entry in listing.split(|b| *b == 0).filter(|e| !e.is_empty()) {
            let entry = String::from_utf8_lossy(entry);
            let (meta, name) = entry.split_once('\t').unwrap_or((&entry, ""));
            let mut meta = meta.split(' ');
            let (mode, kind, object) = (meta.next(), meta.next(), meta.next().unwrap_or_default());
            if kind != Some("blob") {
                continue; // a submodule
            }
            if mode == Some("120000") {
                return Err(RolloutError::Git(format!(
                    "{name} is a symbolic link in {id}: commit the rule file itself"
                )));
            }
            let target = into.join(name);
            if let Some(dir) = target.parent() {
                std::fs::create_dir_all(dir).map_err(|e| write_error(&target, &e))?;
            }
            std::fs::write(&target, git(repo, &["cat-file", "blob", object])?)
                .map_err(|e| write_error(&target, &e))?;
            found += 1;
        }
        if found == 0 {
            return Err(RolloutError::Git(format!("{}: no such file or directory in {id}", path.display())));
        }
    }
    Ok(Commit { id, author })
}

fn write_error(path: &Path, e: &std::io::Error) -> RolloutError {
    RolloutError::Git(format!("{}: {e}", path.display()))
}
