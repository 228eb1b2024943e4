//! The rules' Git repository: `rules sync`'s reading of the files of some
//! paths as one commit holds them (not the work tree), written out under a
//! fresh directory with their repository paths, and who made the commit;
//! and the console's writing of a change or a revert as a commit on a
//! branch, made without a work tree (a temporary index, `commit-tree`) and
//! moved onto the branch only if nobody moved it meanwhile. Works on a
//! work tree and on a bare repository alike (a branch written here is best
//! not checked out anywhere: a work tree does not follow); runs `git`.

use std::{
    path::{Component, Path},
    process::{Command, Stdio},
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

/// Who makes a commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Author {
    /// The name.
    pub name: String,
    /// The e-mail address.
    pub email: String,
}

/// Files by repository path, with their contents.
pub type Files = Vec<(String, Vec<u8>)>;

/// One file of a change: its path in the repository and its new content,
/// `None` to delete it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Relative to the repository's root.
    pub path: String,
    /// The new content; `None`: the file is deleted.
    pub content: Option<Vec<u8>>,
}

/// Runs `git -C repo args…`: its standard output, or an error naming the
/// repository and what git said.
fn git(repo: &Path, args: &[&str]) -> Result<Vec<u8>, RolloutError> {
    git_with(repo, args, &[], None)
}

/// [`git`] with `env` set and `stdin` written to it.
fn git_with(
    repo: &Path,
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
    stdin: Option<&[u8]>,
) -> Result<Vec<u8>, RolloutError> {
    use std::io::Write as _;
    let spawned = Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(args)
        .envs(env.iter().copied())
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = spawned.map_err(|e| RolloutError::Git(format!("cannot run git: {e}")))?;
    if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(bytes).map_err(|e| RolloutError::Git(format!("git {}: {e}", args.join(" "))))?;
    }
    let out = child.wait_with_output().map_err(|e| RolloutError::Git(format!("cannot run git: {e}")))?;
    if !out.status.success() {
        let said = String::from_utf8_lossy(&out.stderr);
        let said = if said.trim().is_empty() { String::from_utf8_lossy(&out.stdout) } else { said };
        let what = format!("{}: git {}: {}", repo.display(), args.join(" "), said.trim());
        return Err(RolloutError::Git(what));
    }
    Ok(out.stdout)
}

/// The first line of a git answer.
fn line(out: &[u8]) -> String {
    String::from_utf8_lossy(out).lines().next().unwrap_or_default().trim().to_owned()
}

/// Whether `path` names a place inside a repository: relative, no `..`,
/// and no control character (git's index input separates entries by NUL
/// and fields by tab: such a name could smuggle in another entry).
pub fn inside(path: &Path) -> bool {
    !path.as_os_str().is_empty()
        && path.components().all(|c| matches!(c, Component::Normal(_)))
        && !path.to_string_lossy().chars().any(char::is_control)
}

/// Commits `changes` on `branch` of `repo` as `author` with `message`,
/// on top of `expected` (the branch's head the change was reviewed
/// against; `None`: the branch has no commit yet). The branch moves only
/// if it is still at `expected`: a change made meanwhile by anyone is never
/// overwritten (the error says so; review again). A change that changes
/// nothing is refused.
pub fn commit(
    repo: &Path,
    branch: &str,
    expected: Option<&str>,
    changes: &[Change],
    author: &Author,
    message: &str,
) -> Result<Commit, RolloutError> {
    let tree = tree_of(repo, expected, changes)?;
    let reference = format!("refs/heads/{branch}");
    record(repo, (&reference, branch), expected, expected, &tree, author, message)
}

/// The tree of `base` (none: empty) with `changes` made, written in a
/// temporary index. A change that changes nothing is refused.
fn tree_of(repo: &Path, base: Option<&str>, changes: &[Change]) -> Result<String, RolloutError> {
    let index_dir = tempfile::tempdir().map_err(|e| RolloutError::Git(format!("a temporary index: {e}")))?;
    let index = index_dir.path().join("index");
    let env = [("GIT_INDEX_FILE", index.as_os_str())];
    if let Some(head) = base {
        git_with(repo, &["read-tree", head], &env, None)?;
    }
    for change in changes {
        if !inside(Path::new(&change.path)) {
            return Err(RolloutError::Git(format!("{}: give a path inside the repository", change.path)));
        }
        // One index entry per file (mode 0: removed); `--index-info` needs no work tree.
        let entry = match &change.content {
            Some(content) => {
                let blob = line(&git_with(repo, &["hash-object", "-w", "--stdin"], &env, Some(content))?);
                format!("100644 {blob}\t{}\0", change.path)
            }
            None => format!("0 {}\t{}\0", "0".repeat(40), change.path),
        };
        git_with(repo, &["update-index", "-z", "--index-info"], &env, Some(entry.as_bytes()))?;
    }
    let tree = line(&git_with(repo, &["write-tree"], &env, None)?);
    if let Some(head) = base
        && line(&git(repo, &["rev-parse", &format!("{head}^{{tree}}")])?) == tree
    {
        return Err(RolloutError::Git(format!("the change changes nothing in {head}")));
    }
    Ok(tree)
}

/// Where proposals live: one reference per proposal, numbered.
pub const PROPOSALS: &str = "refs/ratelimitd/proposals/";

/// A change proposed for review: a commit on top of `base`, on a
/// reference of its own (not a branch: nothing deploys it).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Proposal {
    /// Its number.
    pub id: u64,
    /// Its commit.
    pub commit: String,
    /// The commit it was made on.
    pub base: Option<String>,
    /// Who proposed it, `Name <email>`.
    pub author: String,
    /// The proposer's note (the commit's subject).
    pub note: String,
    /// When, RFC 3339.
    pub at: String,
}

/// Records `changes` on top of `base` as a new proposal by `author`.
pub fn propose(
    repo: &Path,
    base: Option<&str>,
    changes: &[Change],
    author: &Author,
    note: &str,
) -> Result<Proposal, RolloutError> {
    let tree = tree_of(repo, base, changes)?;
    let id = proposals(repo)?.iter().map(|p| p.id).max().unwrap_or(0) + 1;
    let reference = format!("{PROPOSALS}{id}");
    let label = format!("proposal {id}");
    let commit = record(repo, (&reference, &label), base, None, &tree, author, note)?;
    Ok(Proposal {
        id,
        commit: commit.id,
        base: base.map(str::to_owned),
        author: commit.author,
        note: note.lines().next().unwrap_or_default().to_owned(),
        at: humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string(),
    })
}

/// The open proposals, oldest first.
pub fn proposals(repo: &Path) -> Result<Vec<Proposal>, RolloutError> {
    let format = "--format=%(refname)%00%(objectname)%00%(parent)%00%(authorname) %(authoremail)%00%(subject)%00%(authordate:iso-strict)";
    let listing = git(repo, &["for-each-ref", format, PROPOSALS])?;
    let mut found: Vec<Proposal> = String::from_utf8_lossy(&listing)
        .lines()
        .filter_map(|l| {
            let mut f = l.split('\0');
            let id = f.next()?.strip_prefix(PROPOSALS)?.parse().ok()?;
            let (commit, parent) = (f.next()?.to_owned(), f.next()?);
            let (author, note, at) = (f.next()?.to_owned(), f.next()?.to_owned(), f.next()?.to_owned());
            let base = (!parent.is_empty()).then(|| parent.to_owned());
            Some(Proposal { id, commit, base, author, note, at })
        })
        .collect();
    found.sort_by_key(|p| p.id);
    Ok(found)
}

/// Removes proposal `id` if it is still at `commit` (published or withdrawn).
pub fn withdraw(repo: &Path, id: u64, commit: &str) -> Result<(), RolloutError> {
    git(repo, &["update-ref", "-d", &format!("{PROPOSALS}{id}"), commit]).map(drop)
}

/// Reverts `target` on `branch` of `repo` (at `expected`): a new commit
/// whose files are the branch's with `target`'s change undone, as `author`
/// with `message`. Refused when a later change touched the same lines, or
/// when `target` has no parent.
pub fn revert(
    repo: &Path,
    branch: &str,
    expected: &str,
    target: &str,
    author: &Author,
    message: &str,
) -> Result<Commit, RolloutError> {
    let tree = reverted(repo, expected, target)?;
    commit_tree(repo, branch, expected, &tree, author, message)
}

/// The tree of `expected` with `target`'s change undone (see [`revert`]),
/// written but not committed: its files can be read with [`files`] and
/// checked before [`commit_tree`] commits it.
pub fn reverted(repo: &Path, expected: &str, target: &str) -> Result<String, RolloutError> {
    let parent = git(repo, &["rev-parse", "--verify", "--quiet", &format!("{target}^")])
        .map_err(|_| RolloutError::Git(format!("{target} has no parent to revert to")))?;
    let base = format!("--merge-base={target}");
    let merged = git(repo, &["merge-tree", "--write-tree", "--name-only", &base, expected, &line(&parent)])
        .map_err(|e| {
        RolloutError::Git(format!("reverting {target} conflicts with a later change: {e}"))
    })?;
    Ok(line(&merged))
}

/// Commits `tree` on `branch` on top of `expected` (moving the branch only
/// from there), as `author` with `message`.
pub fn commit_tree(
    repo: &Path,
    branch: &str,
    expected: &str,
    tree: &str,
    author: &Author,
    message: &str,
) -> Result<Commit, RolloutError> {
    let reference = format!("refs/heads/{branch}");
    record(repo, (&reference, branch), Some(expected), Some(expected), tree, author, message)
}

/// Makes the commit of `tree` with `parent` and moves `reference`
/// (`label` in errors) to it, only from `old` (`None`: it must not exist).
fn record(
    repo: &Path,
    (reference, label): (&str, &str),
    parent: Option<&str>,
    old: Option<&str>,
    tree: &str,
    author: &Author,
    message: &str,
) -> Result<Commit, RolloutError> {
    let (name, email) = (std::ffi::OsStr::new(&author.name), std::ffi::OsStr::new(&author.email));
    let env = [
        ("GIT_AUTHOR_NAME", name),
        ("GIT_AUTHOR_EMAIL", email),
        ("GIT_COMMITTER_NAME", name),
        ("GIT_COMMITTER_EMAIL", email),
    ];
    let mut args = vec!["commit-tree", tree, "-F", "-"];
    if let Some(head) = parent {
        args.extend(["-p", head]);
    }
    let id = line(&git_with(repo, &args, &env, Some(message.as_bytes()))?);
    // The reference must still be where the change was made (all zeros:
    // it must not exist yet).
    let old = old.map_or_else(|| "0".repeat(40), str::to_owned);
    git(repo, &["update-ref", "-m", message, reference, &id, &old]).map_err(|_| {
        let since = &old[..old.len().min(10)];
        RolloutError::Git(format!("{label} moved since {since}: nothing committed; review the change again"))
    })?;
    Ok(Commit { id, author: format!("{} <{}>", author.name, author.email) })
}

/// The files under `paths` (each a file or a directory, relative to the
/// repository's root) as commit `rev` of `repo` holds them, by repository
/// path, and the commit. A path the commit does not have is skipped
/// (`export` refuses it); a path leaving the repository or a symbolic link
/// among the files is an error naming it.
pub fn files(repo: &Path, rev: &str, paths: &[&Path]) -> Result<(Commit, Files), RolloutError> {
    let spec = format!("{rev}^{{commit}}");
    let id = line(&git(repo, &["rev-parse", "--verify", "--quiet", &spec])?);
    let author = line(&git(repo, &["log", "-1", "--format=%an <%ae>", &id])?);
    Ok((Commit { id: id.clone(), author }, tree_files(repo, &id, paths)?))
}

/// The files under `paths` of the tree (or commit) `tree`, as [`files`].
pub fn tree_files(repo: &Path, tree: &str, paths: &[&Path]) -> Result<Files, RolloutError> {
    let mut files = Vec::new();
    for path in paths {
        // `./rules` is the repository's `rules`; nothing may leave the repository.
        if path.is_absolute() || path.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(RolloutError::Git(format!("{}: give a path inside the repository", path.display())));
        }
        let listing =
            git(repo, &["ls-tree", "-r", "-z", "--full-tree", tree, "--", &path.to_string_lossy()])?;
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
                    "{name} is a symbolic link in {tree}: commit the rule file itself"
                )));
            }
            files.push((name.to_owned(), git(repo, &["cat-file", "blob", object])?));
        }
    }
    Ok(files)
}

/// Writes the files under `paths` as commit `rev` of `repo` holds them
/// (see [`files`]) into `into`, at the same relative paths; returns the
/// commit. A path the commit does not have is an error naming it.
pub fn export(repo: &Path, rev: &str, paths: &[&Path], into: &Path) -> Result<Commit, RolloutError> {
    let (commit, files) = files(repo, rev, paths)?;
    for path in paths {
        let prefix =
            path.components().filter(|c| !matches!(c, Component::CurDir)).collect::<std::path::PathBuf>();
        if !files.iter().any(|(name, _)| Path::new(name).starts_with(&prefix)) {
            return Err(RolloutError::Git(format!(
                "{}: no such file or directory in {}",
                path.display(),
                commit.id
            )));
        }
    }
    write_files(into, &files)?;
    Ok(commit)
}

/// Writes `files` (repository paths and contents) under `into`.
pub fn write_files(into: &Path, files: &[(String, Vec<u8>)]) -> Result<(), RolloutError> {
    for (name, content) in files {
        if !inside(Path::new(name)) {
            return Err(RolloutError::Git(format!("{name}: give a path inside the repository")));
        }
        let target = into.join(name);
        if let Some(dir) = target.parent() {
            std::fs::create_dir_all(dir).map_err(|e| write_error(&target, &e))?;
        }
        std::fs::write(&target, content).map_err(|e| write_error(&target, &e))?;
    }
    Ok(())
}

/// The commit `branch` of `repo` points at; `None` when it has none yet.
pub fn head(repo: &Path, branch: &str) -> Result<Option<String>, RolloutError> {
    let reference = format!("refs/heads/{branch}");
    // `--quiet --verify` fails without output when the branch is unborn.
    match git(repo, &["rev-parse", "--verify", "--quiet", &format!("{reference}^{{commit}}")]) {
        Ok(out) => Ok(Some(line(&out))),
        Err(_) if git(repo, &["rev-parse", "--git-dir"]).is_ok() => Ok(None),
        Err(e) => Err(e),
    }
}

fn write_error(path: &Path, e: &std::io::Error) -> RolloutError {
    RolloutError::Git(format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ada() -> Author {
        Author { name: "Ada Lovelace".to_owned(), email: "ada@example.com".to_owned() }
    }

    fn put(path: &str, text: &str) -> Change {
        Change { path: path.to_owned(), content: Some(text.as_bytes().to_vec()) }
    }

    fn show(repo: &Path, what: &str) -> String {
        String::from_utf8(git(repo, &["show", what]).unwrap()).unwrap()
    }

    fn bare() -> tempfile::TempDir {
        let repo = tempfile::tempdir().unwrap();
        git(repo.path(), &["init", "-q", "--bare"]).unwrap();
        repo
    }

    #[test]
    fn a_path_with_a_control_character_is_refused() {
        let repo = bare();
        for path in [
            "rules/a.yaml\x00100644 0000000000000000000000000000000000000000\tci.yml",
            "rules/a\tb",
            "rules/a\nb",
        ] {
            let error = commit(repo.path(), "main", None, &[put(path, "x")], &ada(), "m").unwrap_err();
            assert!(error.to_string().contains("give a path inside the repository"), "{path:?}: {error}");
        }
    }

    #[test]
    fn a_change_is_a_commit_by_its_author_only_on_the_head_it_was_made_on() {
        let repo = bare();
        let first =
            commit(repo.path(), "main", None, &[put("rules/a.yaml", "a: 1\n")], &ada(), "first").unwrap();
        assert_eq!(first.author, "Ada Lovelace <ada@example.com>");
        let second = commit(
            repo.path(),
            "main",
            Some(&first.id),
            &[put("rules/a.yaml", "a: 2\n"), put("rules/b.yaml", "b\n")],
            &ada(),
            "search: 20/s\n\nReviewed against capture 11-24.",
        )
        .unwrap();
        assert_eq!(show(repo.path(), "main:rules/a.yaml"), "a: 2\n");
        assert_eq!(show(repo.path(), "main:rules/b.yaml"), "b\n");
        let log = line(&git(repo.path(), &["log", "-1", "--format=%an <%ae>|%cn|%s|%b", "main"]).unwrap());
        assert_eq!(
            log,
            "Ada Lovelace <ada@example.com>|Ada Lovelace|search: 20/s|Reviewed against capture 11-24."
        );

        let stale =
            commit(repo.path(), "main", Some(&first.id), &[put("rules/a.yaml", "a: 3\n")], &ada(), "late");
        let e = stale.unwrap_err().to_string();
        assert!(e.contains("main moved since") && e.contains("nothing committed"), "{e}");
        assert_eq!(show(repo.path(), "main:rules/a.yaml"), "a: 2\n", "nobody's change overwritten");

        let same =
            commit(repo.path(), "main", Some(&second.id), &[put("rules/a.yaml", "a: 2\n")], &ada(), "again");
        assert!(same.unwrap_err().to_string().contains("changes nothing"));
        let outside = commit(repo.path(), "main", Some(&second.id), &[put("../x", "x")], &ada(), "x");
        assert!(outside.unwrap_err().to_string().contains("inside the repository"));

        let gone = Change { path: "rules/b.yaml".to_owned(), content: None };
        let third = commit(repo.path(), "main", Some(&second.id), &[gone], &ada(), "drop b").unwrap();
        assert!(git(repo.path(), &["show", "main:rules/b.yaml"]).is_err(), "deleted");

        // What sync reads is what was committed.
        let out = tempfile::tempdir().unwrap();
        let read = export(repo.path(), "main", &[Path::new("rules")], out.path()).unwrap();
        assert_eq!(read.id, third.id);
        assert_eq!(std::fs::read_to_string(out.path().join("rules/a.yaml")).unwrap(), "a: 2\n");
    }

    #[test]
    fn a_revert_undoes_one_commit_under_later_ones_or_refuses_a_conflict() {
        let repo = bare();
        let one = commit(
            repo.path(),
            "main",
            None,
            &[put("a.yaml", "a: 1\n"), put("b.yaml", "b: 1\n")],
            &ada(),
            "one",
        )
        .unwrap();
        let two =
            commit(repo.path(), "main", Some(&one.id), &[put("a.yaml", "a: 2\n")], &ada(), "two").unwrap();
        let three =
            commit(repo.path(), "main", Some(&two.id), &[put("b.yaml", "b: 3\n")], &ada(), "three").unwrap();
        let undone = revert(repo.path(), "main", &three.id, &two.id, &ada(), "Revert two").unwrap();
        assert_eq!(show(repo.path(), "main:a.yaml"), "a: 1\n", "two's change undone");
        assert_eq!(show(repo.path(), "main:b.yaml"), "b: 3\n", "three's kept");
        assert_eq!(
            line(&git(repo.path(), &["rev-parse", "main^"]).unwrap()),
            three.id,
            "on top, history kept"
        );

        let four = commit(repo.path(), "main", Some(&undone.id), &[put("b.yaml", "b: 4\n")], &ada(), "four")
            .unwrap();
        let conflict = revert(repo.path(), "main", &four.id, &three.id, &ada(), "Revert three").unwrap_err();
        assert!(conflict.to_string().contains("conflicts with a later change"), "{conflict}");
        assert!(
            revert(repo.path(), "main", &four.id, &one.id, &ada(), "x")
                .unwrap_err()
                .to_string()
                .contains("no parent")
        );
        let stale = revert(repo.path(), "main", &three.id, &four.id, &ada(), "x").unwrap_err();
        assert!(stale.to_string().contains("moved since"), "{stale}");
    }
}
