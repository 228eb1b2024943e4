//! The rules' repository as the console edits it: the rule files of a
//! commit, a change to them checked with the compilers `serve` uses (every
//! error naming file, rule and field), compared with the rules in force,
//! and turned into the commit and candidate the publish path takes. Only
//! files under `admin.rules_path`, `admin.envoy_path` and
//! `admin.limitador_path` may be changed:
//! the console writes nothing else into the repository.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::{
    config::Config,
    release::{self, ReleaseError},
    rollout::{
        RolloutError, git,
        publish::{self, Candidate},
    },
    rules::{
        RuleError,
        diff::{self, Change},
        encoding::{Provenance, SnapshotRecord},
        envoy::EnvoyConfig,
        limitador::Limits,
        signing::Trust,
    },
};

/// The most files a change may hold.
pub const MAX_FILES: usize = 256;

/// One file as the console shows and takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    /// Its path in the repository.
    pub path: String,
    /// Its text; `None`: delete it.
    pub text: Option<String>,
}

/// A problem the compiler found, for the page: by file (a repository
/// path), line, rule and field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// The file.
    pub file: String,
    /// Line, 1-based, when known.
    pub line: Option<usize>,
    /// Column, 1-based, when known.
    pub column: Option<usize>,
    /// The rule.
    pub rule: Option<String>,
    /// Its field.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
    /// The whole error as `rules validate` prints it.
    pub text: String,
}

/// One change of a rule or limit against the rules in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuleChange {
    /// `native`, `envoy` or `limitador`.
    pub kind: &'static str,
    /// The rule id, Envoy full key or limitador limit's key
    /// (`Limit::written_identity`).
    pub id: String,
    /// `added`, `removed` or `changed`.
    pub change: &'static str,
    /// What the rule is (added or removed).
    pub describe: String,
    /// Changed fields: (field, from, to).
    pub fields: Vec<(String, String, String)>,
}

/// Why a change cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    /// A path outside the rule paths, too many files, or a change of nothing.
    #[error("{0}")]
    Refused(String),
    /// The rules do not compile.
    #[error("{} problem(s) in the rules", .0.len())]
    Invalid(Vec<Problem>),
    /// The repository or the rules topic.
    #[error(transparent)]
    Rollout(#[from] RolloutError),
    /// The rules in force could not be read or the gate could not run.
    #[error(transparent)]
    Release(#[from] ReleaseError),
}

/// The repository and the rule paths in it.
#[derive(Debug, Clone)]
pub struct Workspace {
    /// The repository.
    pub repo: PathBuf,
    /// The branch.
    pub branch: String,
    /// Native rules in it.
    pub native: Option<PathBuf>,
    /// The Envoy configuration in it.
    pub envoy: Option<PathBuf>,
    /// limitador's limits file in it.
    pub limitador: Option<PathBuf>,
}

/// A change checked and compiled: its candidate and the files it holds.
#[derive(Debug)]
pub struct Checked {
    /// The candidate as `rules sync` of the change's commit would make it.
    pub candidate: Candidate,
    /// The change against its base, as commit changes.
    pub changes: Vec<git::Change>,
}

impl Workspace {
    /// The rule paths in the repository.
    pub fn paths(&self) -> Vec<&Path> {
        self.native.iter().chain(&self.envoy).chain(&self.limitador).map(PathBuf::as_path).collect()
    }

    /// The head of the branch.
    pub fn head(&self) -> Result<Option<String>, RolloutError> {
        git::head(&self.repo, &self.branch)
    }

    /// The rule files of `rev` (none for an unborn branch).
    pub fn files(&self, rev: Option<&str>) -> Result<Vec<File>, RolloutError> {
        let Some(rev) = rev else { return Ok(Vec::new()) };
        let (_, files) = git::files(&self.repo, rev, &self.paths())?;
        Ok(files
            .into_iter()
            .map(|(path, bytes)| File { path, text: Some(String::from_utf8_lossy(&bytes).into_owned()) })
            .collect())
    }

    /// Whether the console may write `path`: inside the repository and
    /// under a rule path.
    pub fn writable(&self, path: &str) -> bool {
        let path = Path::new(path);
        git::inside(path) && self.paths().iter().any(|p| path.starts_with(p))
    }

    /// `edits` on top of `base`, checked and compiled as `serve` compiles
    /// (blocking: runs git and the compilers).
    pub fn check(&self, config: &Config, base: Option<&str>, edits: &[File]) -> Result<Checked, ChangeError> {
        if edits.len() > MAX_FILES {
            return Err(ChangeError::Refused(format!("a change holds at most {MAX_FILES} files")));
        }
        if let Some(bad) = edits.iter().find(|f| !self.writable(&f.path)) {
            let allowed: Vec<String> = self.paths().iter().map(|p| p.display().to_string()).collect();
            return Err(ChangeError::Refused(format!(
                "{}: the console changes only files under {}",
                bad.path,
                allowed.join(", ")
            )));
        }
        let before = self.files(base)?;
        let mut after: std::collections::BTreeMap<&str, Option<&str>> =
            before.iter().map(|f| (f.path.as_str(), f.text.as_deref())).collect();
        for edit in edits {
            after.insert(&edit.path, edit.text.as_deref());
        }
        let written: Vec<(String, Vec<u8>)> = after
            .iter()
            .filter_map(|(path, text)| text.map(|t| ((*path).to_owned(), t.as_bytes().to_vec())))
            .collect();
        let changes: Vec<git::Change> = edits
            .iter()
            .filter(|e| before.iter().find(|b| b.path == e.path).map(|b| &b.text) != Some(&e.text))
            .map(|e| git::Change {
                path: e.path.clone(),
                content: e.text.as_ref().map(|t| t.as_bytes().to_vec()),
            })
            .collect();
        let candidate = self.compile(config, &written)?;
        Ok(Checked { candidate, changes })
    }

    /// The candidate of `files` (repository paths and contents), named by
    /// repository paths, as `rules sync` of a commit holding them makes it.
    pub fn compile(&self, config: &Config, files: &[(String, Vec<u8>)]) -> Result<Candidate, ChangeError> {
        let dir =
            tempfile::tempdir().map_err(|e| RolloutError::Git(format!("a temporary directory: {e}")))?;
        git::write_files(dir.path(), files)?;
        // A rule path the change leaves without files is not compiled.
        let held = |p: &&Path| dir.path().join(p).exists();
        let sources = publish::Sources {
            native: self.native.as_deref().filter(held),
            envoy: self.envoy.as_deref().filter(held),
            limitador: self.limitador.as_deref().filter(held),
        };
        if sources.paths().next().is_none() {
            return Err(ChangeError::Refused("the change leaves no rule file".to_owned()));
        }
        publish::candidate_under(dir.path(), sources, config.compilers(), config.rules.allow_empty)
            .map_err(|errors| ChangeError::Invalid(errors.0.into_iter().map(problem).collect()))
    }
}

fn problem(error: RuleError) -> Problem {
    Problem {
        file: error.file.display().to_string(),
        line: error.line.map(|(l, _)| l),
        column: error.line.map(|(_, c)| c),
        rule: error.rule.clone(),
        field: error.field.clone(),
        message: error.message.clone(),
        text: error.to_string(),
    }
}

/// What `candidate` changes against the rules in force (`in_force`, else
/// the configured rules): native rules by id, Envoy limits by full key,
/// limitador's by what makes their counter.
pub fn changes(
    config: &Config,
    in_force: Option<&SnapshotRecord>,
    trust: &Trust,
    candidate: &Candidate,
) -> Result<Vec<RuleChange>, ReleaseError> {
    let old = release::rules_in_force(config, in_force, trust)?;
    let record = publish::record(candidate, None, Provenance::default());
    let new = release::rules_of(config, &record, "the candidate")?;
    let mut out = Vec::new();
    for change in diff::diff(&old.native, &new.native) {
        out.push(rule_change("native", &change, |id, new_side| {
            diff::describe_rule(if new_side { &new.native } else { &old.native }, id)
        }));
    }
    if candidate.envoy.is_some() {
        let none = EnvoyConfig::default();
        let (old_envoy, new_envoy) =
            (old.envoy.as_ref().unwrap_or(&none), new.envoy.as_ref().unwrap_or(&none));
        let (old_limits, new_limits) = (old_envoy.limits(), new_envoy.limits());
        for change in diff::envoy_diff(old_envoy, new_envoy) {
            out.push(rule_change("envoy", &change, |key, new_side| {
                diff::describe_limit(if new_side { &new_limits } else { &old_limits }, key)
            }));
        }
    }
    if candidate.limitador.is_some() {
        let none = Limits::default();
        let (old_set, new_set) =
            (old.limitador.as_ref().unwrap_or(&none), new.limitador.as_ref().unwrap_or(&none));
        let (old_limits, new_limits) = (diff::limitador_by_key(old_set), diff::limitador_by_key(new_set));
        for change in diff::limitador_diff(old_set, new_set) {
            out.push(rule_change("limitador", &change, |key, new_side| {
                diff::describe_limitador_key(if new_side { &new_limits } else { &old_limits }, key)
            }));
        }
    }
    Ok(out)
}

fn rule_change(kind: &'static str, change: &Change, describe: impl Fn(&str, bool) -> String) -> RuleChange {
    let (what, describe, fields) = match change {
        Change::Added(id) => ("added", describe(id, true), Vec::new()),
        Change::Removed(id) => ("removed", describe(id, false), Vec::new()),
        Change::Changed(_, fields) => (
            "changed",
            String::new(),
            fields.iter().map(|(f, a, b)| ((*f).to_owned(), a.clone(), b.clone())).collect(),
        ),
    };
    RuleChange { kind, id: change.rule_id().to_owned(), change: what, describe, fields }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NATIVE: &str = "rules:\n  - { rule_id: a, resource_path: /a, limit: 10, window_seconds: 60 }\n";
    const ENVOY: &str = "domain: edge\ndescriptors:\n  - { key: path, value: /a, rate_limit: { unit: minute, requests_per_unit: 5 } }\n";

    fn file(path: &str, text: Option<&str>) -> File {
        File { path: path.to_owned(), text: text.map(str::to_owned) }
    }

    /// A bare repository holding native rules and an Envoy file, and its head.
    fn repository() -> (tempfile::TempDir, Workspace, String) {
        let repo = tempfile::tempdir().unwrap();
        let init = std::process::Command::new("git")
            .arg("-C")
            .arg(repo.path())
            .args(["init", "-q", "--bare"])
            .status()
            .unwrap();
        assert!(init.success());
        let author = git::Author { name: "Ada".to_owned(), email: "ada@example.com".to_owned() };
        let put = |path: &str, text: &str| git::Change {
            path: path.to_owned(),
            content: Some(text.as_bytes().to_vec()),
        };
        let changes = [put("rules/limits.yaml", NATIVE), put("envoy/edge.yaml", ENVOY), put("README", "x")];
        let head = git::commit(repo.path(), "main", None, &changes, &author, "seed").unwrap().id;
        let workspace = Workspace {
            repo: repo.path().to_path_buf(),
            branch: "main".to_owned(),
            native: Some(PathBuf::from("rules")),
            envoy: Some(PathBuf::from("envoy")),
            limitador: None,
        };
        (repo, workspace, head)
    }

    #[test]
    fn a_change_of_either_format_is_compiled_named_by_repository_path_and_compared() {
        let (_repo, workspace, head) = repository();
        let config = Config::default();
        let listed: Vec<String> = workspace.files(Some(&head)).unwrap().into_iter().map(|f| f.path).collect();
        assert_eq!(listed, ["rules/limits.yaml", "envoy/edge.yaml"], "only the rule paths");
        let edit =
            file("envoy/edge.yaml", Some(&ENVOY.replace("requests_per_unit: 5", "requests_per_unit: 7")));
        let checked = workspace.check(&config, Some(&head), &[edit]).unwrap();
        assert_eq!(checked.changes.len(), 1);
        let names: Vec<&str> =
            checked.candidate.envoy.as_ref().unwrap().files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["envoy/edge.yaml"], "named as a sync of the commit would name it");
        let changed = changes(&config, None, &Trust::default(), &checked.candidate).unwrap();
        let envoy: Vec<&RuleChange> = changed.iter().filter(|c| c.kind == "envoy").collect();
        assert_eq!(envoy.len(), 1, "{changed:?}");
        assert_eq!((envoy[0].id.as_str(), envoy[0].change), ("edge.path_/a", "added"), "{changed:?}");
        // The same edit twice is no change at all.
        let same = workspace.check(&config, Some(&head), &[file("rules/limits.yaml", Some(NATIVE))]).unwrap();
        assert!(same.changes.is_empty());
    }

    #[test]
    fn problems_name_the_repository_file_and_nothing_outside_the_rule_paths_is_taken() {
        let (_repo, workspace, head) = repository();
        let config = Config::default();
        let broken = file("rules/limits.yaml", Some(&NATIVE.replace("limit: 10", "limit: 0")));
        let Err(ChangeError::Invalid(problems)) = workspace.check(&config, Some(&head), &[broken]) else {
            panic!("a zero limit compiles");
        };
        assert_eq!(problems[0].file, "rules/limits.yaml");
        assert_eq!(
            (problems[0].rule.as_deref(), problems[0].field.as_deref()),
            (Some("\"a\" (rules[0])"), Some("limit"))
        );
        for path in ["README", "rules/../README", "/etc/passwd", "rulesx/a.yaml", "rules/a\tb.yaml"] {
            let outside = workspace.check(&config, Some(&head), &[file(path, Some("x"))]);
            assert!(matches!(outside, Err(ChangeError::Refused(_))), "{path:?}");
        }
        let emptied = [file("rules/limits.yaml", None), file("envoy/edge.yaml", None)];
        assert!(matches!(workspace.check(&config, Some(&head), &emptied), Err(ChangeError::Refused(_))));
    }
}
