//! Rules: the native YAML format, its validation, the immutable [`Snapshot`]
//! the hot path reads, and the [`RuleStore`] that swaps snapshots atomically
//! when the files change.
//!
//! Architecture invariant: nothing here knows about gRPC or the counter store;
//! a snapshot is plain data, built whole and never mutated.

mod compile;
pub mod diff;
pub mod encoding;
pub mod envoy;
mod figures;
pub mod gate;
mod headers;
pub mod levels;
pub mod limitador;
pub mod model;
mod native;
pub mod prices;
pub mod signing;
mod snapshot;
mod store;
pub mod tenants;

use std::{fmt, io, path::Path, path::PathBuf};

pub(crate) use compile::compile;
pub use figures::RuleSets;
pub use headers::header;
pub use model::{
    AdaptiveSpec, AlsoLimit, FailurePolicy, LevelKey, Levels, MAX_ALSO_LIMITS, MAX_LEVELS, MAX_OVERLOAD_RATE,
    MAX_UNIT_BYTES, Mode, OverloadScope, OverloadSpec, Rule,
};
pub use native::RawLimit;
pub use snapshot::{PathForm, Snapshot, canonical_path};
pub use store::{Feed, Hot, Origin, RuleStore, Served, Versioned, XdsState, watch};
pub use tenants::OverloadMode;

/// Loads and compiles the rule set at `path` (a file or a directory),
/// matching paths in `form`.
pub fn load(path: &Path, form: PathForm) -> Result<Snapshot, RuleErrors> {
    let rules = native::load(path).map_err(RuleErrors)?;
    compile(path, rules, form).map_err(RuleErrors)
}

/// The example rule files compiled into the binary: what `serve` decides
/// with when `rules.path` is unset, from any working directory.
const EMBEDDED: &[(&str, &str)] =
    &[("examples/rules/api.yaml", include_str!("../../examples/rules/api.yaml"))];

/// Where [`embedded`] rules say they come from in logs and messages.
pub const EMBEDDED_SOURCE: &str = "<embedded examples/rules>";

/// The rule set compiled into the binary (the repository's `examples/rules`).
pub fn embedded(form: PathForm) -> Result<Snapshot, RuleErrors> {
    let mut rules = Vec::new();
    for (name, text) in EMBEDDED {
        rules.extend(native::parse(Path::new(name), text).map_err(|e| RuleErrors(vec![e]))?);
    }
    compile(Path::new(EMBEDDED_SOURCE), rules, form).map_err(RuleErrors)
}

/// Compiles one native rule file's `text`, named `name` in messages.
pub fn from_text(name: &Path, text: &str, form: PathForm) -> Result<Snapshot, RuleErrors> {
    let rules = native::parse(name, text).map_err(|e| RuleErrors(vec![e]))?;
    compile(name, rules, form).map_err(RuleErrors)
}

/// A rule set with no rules (an Envoy-only deployment): every `Check` is NO_RULE.
pub fn empty() -> Snapshot {
    Snapshot::build(Path::new("<no native rules>"), Vec::new(), PathForm::default())
}

/// A rule problem: always the file, and where known the line, the rule and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct RuleError {
    /// The file (or directory) at fault.
    pub file: PathBuf,
    /// Line and column, 1-based, when the parser knows them.
    pub line: Option<(usize, usize)>,
    /// The rule, by id when it has one: `"id" (rules[3])`.
    pub rule: Option<String>,
    /// The field of the rule.
    pub field: Option<String>,
    /// What is wrong.
    pub message: String,
}

/// `set`, unless it holds no rules (no native rule, no Envoy domain) and
/// `allow_empty` is off (`rules.allow_empty`): an emptied file, an empty
/// xDS response or an empty published set would lift every limit at once,
/// so it is refused like a set that does not compile and the last good one
/// keeps serving. `source` names it in the error.
pub fn non_empty<T: Versioned>(set: T, source: &Path, allow_empty: bool) -> Result<T, RuleErrors> {
    if set.size() > 0 || allow_empty { Ok(set) } else { Err(empty_set(source)) }
}

/// The error of a set from `source` refused for holding no rules.
pub fn empty_set(source: &Path) -> RuleErrors {
    RuleErrors(vec![RuleError {
        file: source.to_path_buf(),
        line: None,
        rule: None,
        field: None,
        message: "no rules: an empty set would lift every limit; refused (set rules.allow_empty: true if no \
                  limits is meant)"
            .to_owned(),
    }])
}

impl RuleError {
    pub(crate) fn io(path: &Path, error: &io::Error) -> Self {
        RuleError {
            file: path.to_path_buf(),
            line: None,
            rule: None,
            field: None,
            message: format!("cannot read: {error}"),
        }
    }
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some((line, column)) = self.line {
            write!(f, ":{line}:{column}")?;
        }
        if let Some(rule) = &self.rule {
            write!(f, ": rule {rule}")?;
        }
        if let Some(field) = &self.field {
            write!(f, ": field `{field}`")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// Every problem found in one rule set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleErrors(pub Vec<RuleError>);

impl fmt::Display for RuleErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for RuleErrors {}

/// The prefix of an Envoy limit's name among the adaptive limits (no rule
/// id has a `:`, so no name is both).
pub const ENVOY_ADAPTIVE_PREFIX: &str = "envoy:";

/// Every adaptive limit served, by name: a native rule's id, or
/// [`ENVOY_ADAPTIVE_PREFIX`] and an Envoy limit's full key; natives first,
/// each kind in its set's order.
pub fn adaptive_limits<'a>(
    native: &'a Snapshot,
    envoy: Option<&'a envoy::EnvoyConfig>,
) -> Vec<(std::sync::Arc<str>, &'a crate::limiter::adaptive::AdaptiveLimit)> {
    adaptive_limits_where(native, envoy, None)
}

/// [`adaptive_limits`], only those of global limits (`Some(true)`: their
/// limit is every region's together) or only the others (`Some(false)`).
pub fn adaptive_limits_where<'a>(
    native: &'a Snapshot,
    envoy: Option<&'a envoy::EnvoyConfig>,
    global: Option<bool>,
) -> Vec<(std::sync::Arc<str>, &'a crate::limiter::adaptive::AdaptiveLimit)> {
    let keep = |is_global: bool| global.is_none_or(|g| g == is_global);
    let rules = native
        .adaptive_rules()
        .filter(|r| keep(r.global))
        .filter_map(|r| Some((std::sync::Arc::clone(&r.id), r.adaptive.as_deref()?)));
    let limits = envoy
        .into_iter()
        .flat_map(envoy::EnvoyConfig::adaptive_limits)
        .filter(|l| keep(l.global))
        .filter_map(|l| {
            Some((
                std::sync::Arc::from(format!("{ENVOY_ADAPTIVE_PREFIX}{}", l.full_key)),
                l.adaptive.as_deref()?,
            ))
        });
    rules.chain(limits).collect()
}
