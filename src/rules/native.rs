//! Loader of the native YAML rule format (docs/design.md §5): a file, or a directory
//! whose `*.yaml` / `*.yml` files together form one rule set.
//!
//! Directory entries are read in name order and hidden entries are skipped, so
//! the `..data` / `..2026_…` folders of a Kubernetes ConfigMap mount are not
//! read twice while the `name.yaml -> ..data/name.yaml` links are followed.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::Arc,
};

use serde::Deserialize;

use super::{
    RuleError,
    model::{AdaptiveSpec, FailurePolicy, Mode, OverloadSpec},
};
use crate::{limiter::calendar::Period, shed::Priority};

/// One rule as written, before validation.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRule {
    pub(crate) rule_id: String,
    pub(crate) resource_path: String,
    #[serde(default)]
    pub(crate) client_type: Option<String>,
    #[serde(default = "default_priority")]
    pub(crate) priority_bucket: Priority,
    pub(crate) limit: u64,
    /// The window; 0 when not written (a calendar `period` instead).
    #[serde(default)]
    pub(crate) window_seconds: u64,
    /// A calendar period instead of a window.
    #[serde(default)]
    pub(crate) period: Option<Period>,
    /// The calendar period's time zone (default UTC).
    #[serde(default)]
    pub(crate) time_zone: Option<String>,
    /// What the first limit counts (default `requests`).
    #[serde(default)]
    pub(crate) unit: Option<String>,
    #[serde(default = "default_burst")]
    pub(crate) burst_capacity: f64,
    #[serde(default)]
    pub(crate) mode: Mode,
    #[serde(default)]
    pub(crate) failure_policy: FailurePolicy,
    /// `sliding_window` (default), `fixed_window`, `token_bucket` or `gcra`.
    #[serde(default)]
    pub(crate) algorithm: Option<String>,
    /// A global rate enforced by probabilistic drop (the overload layer).
    #[serde(default)]
    pub(crate) overload: Option<OverloadSpec>,
    /// Further limits counted with the first, all or nothing.
    #[serde(default)]
    pub(crate) also: Vec<RawLimit>,
    /// The first limit moves by AIMD from reported outcomes.
    #[serde(default)]
    pub(crate) adaptive: Option<AdaptiveSpec>,
    /// The first limit holds for every region together (docs/global-limits.md).
    #[serde(default)]
    pub(crate) global: bool,
    /// What a limit of unit `cost` charges, by model.
    #[serde(default)]
    pub(crate) prices: Option<super::prices::RawPrices>,
    /// Further keys its limits may be charged to: level name -> header.
    #[serde(default)]
    pub(crate) levels: std::collections::BTreeMap<String, String>,
    /// The level the first limit is charged to (default: the user).
    #[serde(default)]
    pub(crate) level: Option<String>,
}

/// A further limit of a rule (`also:`), as written.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    /// Requests per window, before burst.
    pub limit: u64,
    /// The window; 0 when not written (a calendar `period` instead).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub window_seconds: u64,
    /// A calendar period instead of a window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub period: Option<Period>,
    /// The calendar period's time zone (default UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
    /// What it counts (default `requests`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
    /// Burst multiplier (default 1).
    #[serde(default = "default_burst")]
    pub burst_capacity: f64,
    /// Default: the rule's `algorithm`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    /// The level it is charged to (default: the user).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub level: Option<String>,
}

/// A rule together with the file it came from and its position in it.
#[derive(Debug, Clone)]
pub(crate) struct SourcedRule {
    pub(crate) file: Arc<Path>,
    pub(crate) index: usize,
    pub(crate) raw: RawRule,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

fn default_priority() -> Priority {
    Priority::Degraded
}

fn default_burst() -> f64 {
    1.0
}

/// A rule file. `rules` is required: an empty file is far more often a
/// half-written one (an in-place save caught mid-way) than an intent to
/// remove every rule, which is said explicitly with `rules: []` (and
/// `rules.allow_empty`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    rules: Vec<RawRule>,
}

/// The files that make up the rule set at `path`, in load order.
pub(crate) fn rule_files(path: &Path) -> Result<Vec<PathBuf>, RuleError> {
    let meta = fs::metadata(path).map_err(|e| RuleError::io(path, &e))?;
    if meta.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in fs::read_dir(path).map_err(|e| RuleError::io(path, &e))? {
        let entry = entry.map_err(|e| RuleError::io(path, &e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with('.') || !(name.ends_with(".yaml") || name.ends_with(".yml")) {
            continue;
        }
        let file = entry.path();
        // Follows symlinks: a ConfigMap's files are links into `..data`.
        match fs::metadata(&file) {
            Ok(m) if m.is_file() => files.push(file),
            Ok(_) => {}
            Err(e) => return Err(RuleError::io(&file, &e)),
        }
    }
    files.sort();
    Ok(files)
}

/// Reads and parses every rule file at `path`. Returns all parse errors, not
/// only the first, so one `rules validate` run shows everything to fix.
pub(crate) fn load(path: &Path) -> Result<Vec<SourcedRule>, Vec<RuleError>> {
    let files = rule_files(path).map_err(|e| vec![e])?;
    let mut rules = Vec::new();
    let mut errors = Vec::new();
    for file in files {
        match fs::read_to_string(&file) {
            Ok(text) => match parse(&file, &text) {
                Ok(parsed) => rules.extend(parsed),
                Err(e) => errors.push(e),
            },
            Err(e) => errors.push(RuleError::io(&file, &e)),
        }
    }
    if errors.is_empty() { Ok(rules) } else { Err(errors) }
}

/// Parses one file's text.
pub(crate) fn parse(file: &Path, text: &str) -> Result<Vec<SourcedRule>, RuleError> {
    let file: Arc<Path> = Arc::from(file);
    if text.lines().all(|l| l.trim().is_empty() || l.trim_start().starts_with('#')) {
        return Err(RuleError {
            file: file.to_path_buf(),
            line: None,
            rule: None,
            field: Some("rules".to_owned()),
            message: "the file is empty (a partial write?); write `rules: []` (and set rules.allow_empty) to declare no rules".to_owned(),
        });
    }
    let deserializer = yaml_serde::Deserializer::from_str(text);
    let parsed: RawFile =
        serde_path_to_error::deserialize(deserializer).map_err(|e| parse_error(&file, text, &e))?;
    Ok(parsed
        .rules
        .into_iter()
        .enumerate()
        .map(|(index, raw)| SourcedRule { file: Arc::clone(&file), index, raw })
        .collect())
}

/// Turns a serde error at a path like `rules[3].limit` into a message naming
/// the file, the line, the rule (by id when the file says it) and the field.
fn parse_error(file: &Path, text: &str, error: &serde_path_to_error::Error<yaml_serde::Error>) -> RuleError {
    let inner = error.inner();
    let line = inner.location().map(|l| (l.line(), l.column()));
    // yaml_serde appends " at line L column C"; the location is shown separately.
    let mut message = inner.to_string();
    if let Some(cut) = message.find(" at line ") {
        message.truncate(cut);
    }
    // It also prefixes its own path (`rules[1]: …`); the rule is named below.
    if let Some((prefix, rest)) = message.split_once(": ")
        && prefix.starts_with("rules")
        && !prefix.contains(' ')
    {
        message = rest.to_owned();
    }
    let mut rule = None;
    let mut field = None;
    let segments: Vec<String> = error.path().iter().map(ToString::to_string).collect();
    if segments.first().map(String::as_str) == Some("rules") {
        if let Some(index) = segments.get(1).and_then(|s| s.trim_matches(['[', ']']).parse::<usize>().ok()) {
            rule = Some(rule_label(text, index));
        }
        field = segments.get(2).cloned();
    }
    RuleError { file: file.to_path_buf(), line, rule, field, message }
}

/// `"<rule_id>" (rules[i])` when the i-th entry has a readable `rule_id`,
/// else `rules[i]`. Only used to word an error, so a second lenient parse is fine.
fn rule_label(text: &str, index: usize) -> String {
    let id = yaml_serde::from_str::<yaml_serde::Value>(text)
        .ok()
        .and_then(|doc| doc.get("rules")?.get(index)?.get("rule_id")?.as_str().map(str::to_owned));
    match id {
        Some(id) => format!("{id:?} (rules[{index}])"),
        None => format!("rules[{index}]"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
rules:
  - rule_id: playback-android
    resource_path: /api/v1/playback
    client_type: ANDROID_MOBILE
    priority_bucket: CRITICAL
    limit: 5000
    window_seconds: 60
    burst_capacity: 1.2
    mode: enforce
    failure_policy: open
  - rule_id: search
    resource_path: /api/v1/search*
    limit: 10
    window_seconds: 1
";

    #[test]
    fn parses_every_field_and_defaults() {
        let rules = parse(Path::new("a.yaml"), GOOD).unwrap();
        assert_eq!(rules.len(), 2);
        let first = &rules[0].raw;
        assert_eq!(first.client_type.as_deref(), Some("ANDROID_MOBILE"));
        assert_eq!(first.priority_bucket, Priority::Critical);
        assert!((first.burst_capacity - 1.2).abs() < f64::EPSILON);
        let second = &rules[1].raw;
        assert_eq!(second.priority_bucket, Priority::Degraded);
        assert_eq!(second.mode, Mode::Enforce);
        assert_eq!(second.failure_policy, FailurePolicy::Local);
        assert!((second.burst_capacity - 1.0).abs() < f64::EPSILON);
        assert_eq!(rules[1].index, 1);
    }

    #[test]
    fn unknown_field_names_file_rule_field_and_line() {
        let text = GOOD.replace("    limit: 10\n", "    limt: 10\n");
        let err = parse(Path::new("dir/a.yaml"), &text).unwrap_err().to_string();
        assert!(
            err.starts_with(
                "dir/a.yaml:14:5: rule \"search\" (rules[1]): field `limt`: unknown field `limt`"
            ),
            "{err}"
        );
        assert!(err.contains("\"search\" (rules[1])"), "{err}");
        assert!(err.contains("unknown field `limt`"), "{err}");
    }

    #[test]
    fn wrong_type_names_the_field() {
        let text = GOOD.replace("limit: 5000", "limit: lots");
        let err = parse(Path::new("a.yaml"), &text).unwrap_err().to_string();
        assert!(err.contains("\"playback-android\" (rules[0])"), "{err}");
        assert!(err.contains("field `limit`"), "{err}");
    }

    #[test]
    fn bad_enum_value_names_the_field() {
        let text = GOOD.replace("mode: enforce", "mode: loud");
        let err = parse(Path::new("a.yaml"), &text).unwrap_err().to_string();
        assert!(err.contains("field `mode`"), "{err}");
        assert!(err.contains("loud"), "{err}");
    }

    #[test]
    fn missing_field_is_named() {
        let text = GOOD.replace("    limit: 10\n", "");
        let err = parse(Path::new("a.yaml"), &text).unwrap_err().to_string();
        assert!(err.contains("missing field `limit`"), "{err}");
        assert!(err.contains("\"search\""), "{err}");
    }

    #[test]
    fn no_rules_must_be_said_explicitly() {
        assert!(parse(Path::new("a.yaml"), "rules: []\n").unwrap().is_empty());
        for text in ["", "\n  \n", "# nothing yet\n\n"] {
            let err = parse(Path::new("a.yaml"), text).unwrap_err().to_string();
            assert!(err.contains("the file is empty"), "{text:?}: {err}");
        }
        let err = parse(Path::new("a.yaml"), "other: 1\n").unwrap_err().to_string();
        assert!(err.contains("unknown field `other`"), "{err}");
        let err = parse(Path::new("a.yaml"), "{}\n").unwrap_err().to_string();
        assert!(err.contains("missing field `rules`"), "{err}");
    }

    #[test]
    fn syntax_error_gives_the_line() {
        let err = parse(Path::new("a.yaml"), "rules:\n  - rule_id: [unclosed\n").unwrap_err();
        assert!(err.line.is_some(), "{err}");
    }

    #[test]
    fn directory_reads_yaml_files_in_order_and_skips_hidden() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("b.yaml"), "rules: []").unwrap();
        fs::write(dir.path().join("a.yml"), "rules: []").unwrap();
        fs::write(dir.path().join("notes.txt"), "x").unwrap();
        fs::create_dir(dir.path().join("..data")).unwrap();
        fs::write(dir.path().join("..data/c.yaml"), "rules: []").unwrap();
        let files = rule_files(dir.path()).unwrap();
        let names: Vec<_> = files.iter().map(|f| f.file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(names, ["a.yml", "b.yaml"]);
    }

    mod properties {
        //! Property tests: any file text, and any values in each field of a
        //! well-formed rule, either compile or fail with an error naming the
        //! file; never a panic.
        use proptest::prelude::*;

        use super::*;

        fn scalar() -> impl Strategy<Value = String> {
            prop_oneof![
                any::<i64>().prop_map(|n| n.to_string()),
                any::<f64>().prop_map(|x| format!("{x:?}")),
                Just(".nan".to_owned()),
                Just("-.inf".to_owned()),
                Just("~".to_owned()),
                Just("[]".to_owned()),
                "[a-zA-Z_/*.-]{0,12}",
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 1_000, ..ProptestConfig::default() })]

            #[test]
            fn any_text_parses_or_names_the_file(text in "(?s).{0,300}") {
                match parse(Path::new("any.yaml"), &text) {
                    Ok(rules) => {
                        if let Err(errors) = crate::rules::compile(Path::new("any.yaml"), rules, crate::rules::PathForm::default()) {
                            prop_assert!(errors.iter().all(|e| e.to_string().starts_with("any.yaml")));
                        }
                    }
                    Err(e) => prop_assert!(e.to_string().starts_with("any.yaml"), "{e}"),
                }
            }

            #[test]
            fn any_field_values_compile_or_name_file_rule_and_field(
                fields in proptest::collection::vec(scalar(), 8),
            ) {
                let names = [
                    "rule_id", "resource_path", "limit", "window_seconds",
                    "burst_capacity", "mode", "failure_policy", "priority_bucket",
                ];
                let mut text = "rules:\n  -".to_owned();
                for (name, value) in names.iter().zip(&fields) {
                    text.push_str(&format!(" {name}: {value:?}\n   "));
                }
                let text = text.replace('"', "");
                let result = parse(Path::new("f.yaml"), &text)
                    .map_err(|e| vec![e])
                    .and_then(|rules| crate::rules::compile(Path::new("f.yaml"), rules, crate::rules::PathForm::default()));
                match result {
                    Ok(snapshot) => {
                        for rule in snapshot.rules() {
                            prop_assert!(rule.window.capacity >= 1);
                            prop_assert!(rule.window.window_ms >= 1);
                            prop_assert!(
                                rule.window.capacity.checked_mul(rule.window.window_ms).is_some_and(
                                    |p| p <= crate::limiter::window::MAX_CAPACITY_TIMES_WINDOW
                                )
                            );
                        }
                    }
                    Err(errors) => {
                        prop_assert!(!errors.is_empty());
                        for e in errors {
                            prop_assert!(e.to_string().starts_with("f.yaml"), "{e}");
                            prop_assert!(e.field.is_some() || e.line.is_some(), "no field or line: {e}");
                        }
                    }
                }
            }
        }
    }
}
