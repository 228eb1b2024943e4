//! Kuadrant limitador's limits file: a YAML list of limits, each a
//! `namespace`, `max_value` hits per `seconds`, `conditions` (CEL
//! predicates, all of which must hold) and `variables` (CEL expressions
//! whose values tell one counter from another), an optional `name` and
//! `id`. The expressions are compiled once per file version with the
//! `cel` crate limitador evaluates them with, and evaluated against the
//! request's descriptors bound as `descriptors` (a list of string maps,
//! `descriptors[0]['user_id']`) and the limit as `limit` (`limit.name`,
//! `limit.id`).
//!
//! A limit applies to a request when every condition is true and every
//! variable has a value; a reference to a key the descriptors lack
//! (`NoSuchKey`) makes the limit not apply, as in limitador. What
//! limitador-server would never apply (a name it does not bind, a
//! comprehension's variable, which it takes for one) or cannot evaluate
//! (a struct literal, a comprehension over a string) is refused at load. Any other evaluation error (a condition that is
//! not a boolean, a variable that is a list, `descriptors[3]` of a
//! request with one descriptor) is an error of the request: the caller
//! answers it closed, never as "no limit".
//!
//! Differences from limitador's loader, each failing closed: an unknown
//! field (a misspelt `condition:` would make a limit apply to every
//! request), `seconds` outside 1 s to a year, a `max_value` over 2^32 - 1,
//! an empty namespace and two limits with the same identity (namespace,
//! seconds, conditions and variables: limitador keeps one of them,
//! unspecified which) are errors naming file, limit and field; expressions
//! and lists are bounded ([`MAX_EXPRESSION_BYTES`], [`MAX_EXPRESSIONS`],
//! [`MAX_LIMITS`], [`MAX_COMPREHENSION_DEPTH`]).

use std::{
    collections::{BTreeSet, HashMap},
    fmt,
    path::Path,
    sync::Arc,
};

use serde::Deserialize;

use super::{RuleError, RuleErrors, Versioned, envoy::EnvoyLimit};
use crate::limiter::window::Algorithm;

mod fast;
use fast::Fast;

/// The longest CEL expression accepted, in bytes.
pub const MAX_EXPRESSION_BYTES: usize = 1024;
/// The most conditions, and the most variables, of one limit.
pub const MAX_EXPRESSIONS: usize = 32;
/// The most limits of one file.
pub const MAX_LIMITS: usize = 10_000;
/// The deepest comprehensions (`all`, `exists`, `map`, `filter`) may nest:
/// each iterates a list or map of the request (at most its descriptors or
/// a descriptor's entries), so an expression costs at most its size times
/// that bound squared.
pub const MAX_COMPREHENSION_DEPTH: usize = 2;

/// One limit as written in the file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    namespace: String,
    max_value: u64,
    seconds: u64,
    #[serde(default)]
    conditions: Option<Vec<String>>,
    #[serde(default)]
    variables: Option<Vec<String>>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    id: Option<String>,
}

/// A compiled CEL expression and its source.
struct Expression {
    source: Arc<str>,
    program: cel::Program,
    /// Its form answered without the interpreter, if it has one.
    fast: Option<Fast>,
}

impl fmt::Debug for Expression {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Expression").field(&self.source).finish()
    }
}

/// One compiled limit.
#[derive(Debug)]
pub struct Limit {
    /// Its namespace (Envoy's domain).
    pub namespace: Arc<str>,
    /// Hits admitted per window.
    pub max_value: u64,
    /// The window, in seconds.
    pub seconds: u64,
    /// `name`, when given.
    pub name: Option<Arc<str>>,
    /// `id`, when given.
    pub id: Option<Arc<str>>,
    /// Its identity (namespace, seconds, sorted conditions and variables),
    /// stable across file versions and instances: the stem of its
    /// counters' keys. `max_value`, `name` and `id` are not part of it, as
    /// in limitador: raising a limit keeps its counts.
    pub identity: Arc<str>,
    /// What it counts as: `max_value` per `seconds`, named as it is (or by
    /// its identity), `namespace.name` its key in metrics.
    pub envoy: Arc<EnvoyLimit>,
    /// The same, counting reported usage whatever is left (`Report`).
    pub envoy_report: Arc<EnvoyLimit>,
    /// The same, asking whether hits fit and counting nothing (`CheckRateLimit`).
    pub envoy_peek: Arc<EnvoyLimit>,
    conditions: Vec<Expression>,
    /// Sorted by source, as limitador orders them.
    variables: Vec<Expression>,
    /// Every condition and variable has a fast form: the limit is decided
    /// without the interpreter.
    fast: bool,
}

impl Limit {
    /// The conditions' sources, in the order written.
    pub fn conditions(&self) -> impl Iterator<Item = &str> {
        self.conditions.iter().map(|e| &*e.source)
    }

    /// The variables' sources, sorted.
    pub fn variables(&self) -> impl Iterator<Item = &str> {
        self.variables.iter().map(|e| &*e.source)
    }

    /// What makes its counter, written out (its identity before the
    /// digest): `ns 60s if [a, b] by [v]`, conditions and variables each as
    /// the identity takes them (sorted, once each).
    pub fn written_identity(&self) -> String {
        let list =
            |expressions: &[Expression]| sources(expressions).into_iter().collect::<Vec<_>>().join(", ");
        format!(
            "{} {}s if [{}] by [{}]",
            self.namespace,
            self.seconds,
            list(&self.conditions),
            list(&self.variables)
        )
    }
}

/// A request's evaluation that failed (not a missing key: that is a limit
/// that does not apply).
#[derive(Debug, thiserror::Error)]
#[error("limit {limit}: {expression}: {message}")]
pub struct EvalError {
    /// The limit's identity.
    pub limit: Arc<str>,
    /// The expression's source.
    pub expression: Arc<str>,
    /// Why.
    pub message: String,
}

/// A limit that applies to a request, with its variables' values (in the
/// limit's variable order): one counter.
#[derive(Debug)]
pub struct Applied<'a> {
    /// The limit.
    pub limit: &'a Limit,
    /// The variables' values.
    pub values: Vec<String>,
}

/// A compiled limits file: the limits of each namespace, in file order.
#[derive(Debug, Default)]
pub struct Limits {
    namespaces: HashMap<Arc<str>, Vec<Limit>>,
    /// The SHA-256 of the file's text (hex, 16 bytes).
    version: String,
    count: usize,
}

impl Versioned for Limits {
    fn version(&self) -> &str {
        &self.version
    }

    fn size(&self) -> usize {
        self.count
    }
}

impl Limits {
    /// Reads and compiles the limits file at `path`, its limits counted by
    /// `algorithm` (`rules.limitador_algorithm`).
    pub fn load(path: &Path, algorithm: Algorithm) -> Result<Self, RuleErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| RuleErrors(vec![RuleError::io(path, &e)]))?;
        Self::parse(path, &text, algorithm).map_err(|e| RuleErrors(vec![e]))
    }

    /// Compiles `text`, the contents of `file`, its limits counted by `algorithm`.
    pub fn parse(file: &Path, text: &str, algorithm: Algorithm) -> Result<Self, RuleError> {
        let parse = |message: String| RuleError {
            file: file.to_path_buf(),
            line: None,
            rule: None,
            field: None,
            message,
        };
        // An empty file (or `---` alone) is no limit, as limitador reads it.
        let raw: Option<Vec<RawLimit>> = if text.trim().trim_start_matches("---").trim().is_empty() {
            None
        } else {
            let deserializer = yaml_serde::Deserializer::from_str(text);
            serde_path_to_error::deserialize(deserializer).map_err(|e| {
                // The YAML error names the path itself (`.[0]: …`) inside a list.
                let inner = e.inner().to_string();
                parse(inner.strip_prefix('.').map_or_else(|| format!("{}: {inner}", e.path()), str::to_owned))
            })?
        };
        let raw = raw.unwrap_or_default();
        if raw.len() > MAX_LIMITS {
            return Err(parse(format!("{} limits: at most {MAX_LIMITS}", raw.len())));
        }
        let mut limits = Limits { version: digest(&[text]), count: raw.len(), ..Limits::default() };
        let mut seen: HashMap<Arc<str>, usize> = HashMap::new();
        for (index, raw) in raw.into_iter().enumerate() {
            let limit = compile(file, index, raw, algorithm)?;
            if let Some(first) = seen.insert(Arc::clone(&limit.identity), index) {
                return Err(limit_error(
                    file,
                    index,
                    &limit.namespace,
                    "variables",
                    format!(
                        "the same namespace, seconds, conditions and variables as limits[{first}]: one counter \
                         cannot have two limits (merge them, or tell them apart)"
                    ),
                ));
            }
            limits.namespaces.entry(Arc::clone(&limit.namespace)).or_default().push(limit);
        }
        Ok(limits)
    }

    /// The limits of `namespace`, in file order.
    pub fn of(&self, namespace: &str) -> &[Limit] {
        self.namespaces.get(namespace).map_or(&[], Vec::as_slice)
    }

    /// Every namespace with its limits.
    pub fn namespaces(&self) -> impl Iterator<Item = (&str, &[Limit])> {
        self.namespaces.iter().map(|(n, l)| (&**n, l.as_slice()))
    }

    /// The limits of `namespace` that apply to a request with
    /// `descriptors` (each a list of key and value), each with its
    /// variables' values, in file order.
    pub fn applying<'s>(
        &'s self,
        namespace: &str,
        descriptors: &[Vec<(&str, &str)>],
    ) -> Result<Vec<Applied<'s>>, EvalError> {
        let limits = self.of(namespace);
        if limits.is_empty() {
            return Ok(Vec::new());
        }
        // The interpreter's context, built only for a limit that needs it.
        let root = std::cell::OnceCell::new();
        let mut applied = Vec::new();
        for limit in limits {
            let scope = (!limit.fast).then(|| {
                let mut scope = root.get_or_init(|| context(descriptors)).new_inner_scope();
                let text = |v: &Option<Arc<str>>| {
                    v.as_ref().map_or(cel::Value::Null, |s| cel::Value::String(Arc::new(s.to_string())))
                };
                let data: HashMap<&str, cel::Value> =
                    HashMap::from([("name", text(&limit.name)), ("id", text(&limit.id))]);
                scope.add_variable_from_value("limit", cel::Value::from(data));
                scope
            });
            let execute = |e: &Expression| match (&e.fast, &scope) {
                (Some(fast), _) => fast.execute(descriptors),
                (None, Some(scope)) => interpret(e, scope),
                (None, None) => {
                    Err(cel::ExecutionError::function_error("limit", "no context for the interpreter"))
                }
            };
            if let Some(values) = evaluate(limit, execute)? {
                applied.push(Applied { limit, values });
            }
        }
        Ok(applied)
    }
}

/// `e` run by the interpreter in `scope`. The load refuses every
/// construct known to panic it ([`evaluable`]); should one still panic,
/// the request is not evaluable (answered closed, counted), never a
/// reset stream or a dropped connection.
fn interpret(e: &Expression, scope: &cel::Context<'_>) -> Result<cel::Value, cel::ExecutionError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| e.program.execute(scope))).unwrap_or_else(|_| {
        Err(cel::ExecutionError::function_error("cel", "the interpreter failed on this expression"))
    })
}

/// The interpreter's context over `descriptors`: each a map of its entries.
fn context(descriptors: &[Vec<(&str, &str)>]) -> cel::Context<'static> {
    let mut root = cel::Context::default();
    let list: Vec<cel::Value> = descriptors
        .iter()
        .map(|entries| {
            let map: HashMap<String, String> =
                entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
            cel::Value::from(map)
        })
        .collect();
    root.add_variable_from_value("descriptors", cel::Value::List(Arc::new(list)));
    root
}

/// Whether `limit` applies, each expression's answer from `execute`, and
/// if so its variables' values.
fn evaluate(
    limit: &Limit,
    execute: impl Fn(&Expression) -> Result<cel::Value, cel::ExecutionError>,
) -> Result<Option<Vec<String>>, EvalError> {
    let error = |e: &Expression, message: String| EvalError {
        limit: Arc::clone(&limit.identity),
        expression: Arc::clone(&e.source),
        message,
    };
    for condition in &limit.conditions {
        match execute(condition) {
            Ok(cel::Value::Bool(true)) => {}
            Ok(cel::Value::Bool(false)) | Err(cel::ExecutionError::NoSuchKey(_)) => return Ok(None),
            Ok(other) => {
                return Err(error(condition, format!("a condition must be a boolean, not {other:?}")));
            }
            Err(e) => return Err(error(condition, e.to_string())),
        }
    }
    let mut values = Vec::with_capacity(limit.variables.len());
    for variable in &limit.variables {
        let value = match execute(variable) {
            Ok(cel::Value::String(s)) => s.to_string(),
            Ok(cel::Value::Int(i)) => i.to_string(),
            Ok(cel::Value::UInt(u)) => u.to_string(),
            Ok(cel::Value::Float(f)) => f.to_string(),
            Ok(cel::Value::Bool(b)) => b.to_string(),
            Ok(cel::Value::Null) => "null".to_owned(),
            Ok(other) => return Err(error(variable, format!("a variable must be a scalar, not {other:?}"))),
            Err(cel::ExecutionError::NoSuchKey(_)) => return Ok(None),
            Err(e) => return Err(error(variable, e.to_string())),
        };
        values.push(value);
    }
    Ok(Some(values))
}

/// An error of limit `index` of `file`, at `field`.
fn limit_error(file: &Path, index: usize, namespace: &str, field: &str, message: String) -> RuleError {
    RuleError {
        file: file.to_path_buf(),
        line: None,
        rule: Some(format!("limits[{index}] (namespace {namespace:?})")),
        field: Some(field.to_owned()),
        message,
    }
}

/// Compiles limit `index` of `file`.
fn compile(file: &Path, index: usize, raw: RawLimit, algorithm: Algorithm) -> Result<Limit, RuleError> {
    let fail = |field: &str, message: String| limit_error(file, index, &raw.namespace, field, message);
    if raw.namespace.trim().is_empty() {
        return Err(fail("namespace", "must not be empty".to_owned()));
    }
    let expressions = |field: &str, sources: &Option<Vec<String>>| -> Result<Vec<Expression>, RuleError> {
        let sources = sources.as_deref().unwrap_or_default();
        if sources.len() > MAX_EXPRESSIONS {
            return Err(fail(field, format!("{} expressions: at most {MAX_EXPRESSIONS}", sources.len())));
        }
        let mut out = Vec::with_capacity(sources.len());
        for (i, source) in sources.iter().enumerate() {
            let at = format!("{field}[{i}]");
            if source.len() > MAX_EXPRESSION_BYTES {
                return Err(fail(&at, format!("{} bytes: at most {MAX_EXPRESSION_BYTES}", source.len())));
            }
            let program = cel::Program::compile(source).map_err(|e| fail(&at, format!("{source:?}: {e}")))?;
            let depth = comprehension_depth(program.expression());
            if depth > MAX_COMPREHENSION_DEPTH {
                let message = format!(
                    "{source:?}: comprehensions nested {depth} deep: at most {MAX_COMPREHENSION_DEPTH} (each iterates \
                     the request's descriptors or entries: their cost multiplies)"
                );
                return Err(fail(&at, message));
            }
            evaluable(program.expression(), field == "variables")
                .map_err(|e| fail(&at, format!("{source:?}: {e}")))?;
            let fast = Fast::of(program.expression());
            out.push(Expression { source: Arc::from(source.as_str()), program, fast });
        }
        Ok(out)
    };
    let conditions = expressions("conditions", &raw.conditions)?;
    let mut variables = expressions("variables", &raw.variables)?;
    variables.sort_by(|a, b| a.source.cmp(&b.source));
    let identity = identity(&raw.namespace, raw.seconds, &conditions, &variables);
    let key = format!("{}.{}", raw.namespace, raw.name.as_deref().unwrap_or(&identity));
    let envoy = EnvoyLimit::plain(Arc::from(key), raw.max_value, raw.seconds, raw.name.clone())
        .map_err(|(field, message)| fail(if field == "max" { "max_value" } else { field }, message))?;
    let envoy = EnvoyLimit { algorithm: Some(algorithm), ..envoy };
    Ok(Limit {
        namespace: Arc::from(raw.namespace.as_str()),
        max_value: raw.max_value,
        seconds: raw.seconds,
        name: raw.name.as_deref().map(Arc::from),
        id: raw.id.as_deref().map(Arc::from),
        identity,
        envoy_report: Arc::new(EnvoyLimit { report_mode: true, ..envoy.clone() }),
        envoy_peek: Arc::new(EnvoyLimit { peek_mode: true, ..envoy.clone() }),
        envoy: Arc::new(envoy),
        fast: conditions.iter().chain(&variables).all(|e| e.fast.is_some()),
        conditions,
        variables,
    })
}

/// Whether limitador-server evaluates `e`, a condition or (`variable`) a
/// variable, without panicking and with a chance to apply; else why not.
/// Refused here, never found out per request:
/// - a struct literal (`Foo{a: 1}`): the interpreter panics on it;
/// - a comprehension over what may be a string or a scalar (a
///   descriptor's value, a literal): the interpreter panics iterating it;
///   ranges are the descriptors, one descriptor, a list or map written in
///   the expression, or a `map`/`filter` of those;
/// - a comprehension's variable read in its body, or any name but
///   `descriptors` (and, in a condition, `limit`): limitador-server takes
///   each for an unbound reference and never applies the limit.
fn evaluable(e: &cel::IdedExpr, variable: bool) -> Result<(), String> {
    let mut bound = BTreeSet::new();
    unsupported(e, &mut bound)?;
    let referenced = e.references();
    let mut references: Vec<&str> = referenced.variables().into_iter().collect();
    references.sort_unstable();
    for name in references {
        if bound.contains(name) {
            return Err(format!(
                "`{name}` is a comprehension's variable: limitador-server takes it for an unbound reference \
                 and never applies the limit (test a key with `has(descriptors[0].key)` or `'key' in \
                 descriptors[0]` instead)"
            ));
        }
        let known = name == "descriptors" || (!variable && name == "limit");
        if !known {
            let names = if variable { "`descriptors`" } else { "`descriptors` and `limit`" };
            return Err(format!(
                "`{name}` is not bound: limitador-server binds only {names} here and would never apply the limit"
            ));
        }
    }
    Ok(())
}

/// The first construct of `e` the interpreter cannot evaluate (see
/// [`evaluable`]); the comprehensions' variables go to `bound`.
fn unsupported<'e>(e: &'e cel::IdedExpr, bound: &mut BTreeSet<&'e str>) -> Result<(), String> {
    use cel::common::ast::{EntryExpr, Expr};
    match &e.expr {
        Expr::Struct(_) => Err("a struct literal: the interpreter cannot evaluate it".to_owned()),
        Expr::Comprehension(c) => {
            if !iterable(&c.iter_range) {
                return Err(
                    "a comprehension over what may be a string or a scalar: the interpreter iterates \
                            only lists and maps (`descriptors`, `descriptors[N]`, a list or map written out)"
                        .to_owned(),
                );
            }
            bound.insert(&c.iter_var);
            if let Some(second) = &c.iter_var2 {
                bound.insert(second);
            }
            for part in [&c.iter_range, &c.accu_init, &c.loop_cond, &c.loop_step, &c.result] {
                unsupported(part, bound)?;
            }
            Ok(())
        }
        Expr::Call(call) => {
            call.target.iter().map(|t| &**t).chain(&call.args).try_for_each(|a| unsupported(a, bound))
        }
        Expr::List(list) => list.elements.iter().try_for_each(|a| unsupported(a, bound)),
        Expr::Map(map) => map.entries.iter().try_for_each(|entry| match &entry.expr {
            EntryExpr::MapEntry(m) => unsupported(&m.key, bound).and_then(|()| unsupported(&m.value, bound)),
            EntryExpr::StructField(_) => Err("a struct field: the interpreter cannot evaluate it".to_owned()),
        }),
        Expr::Select(select) => unsupported(&select.operand, bound),
        Expr::Unspecified => Err("an empty expression".to_owned()),
        Expr::Ident(_) | Expr::Literal(_) => Ok(()),
    }
}

/// Whether `range` is always a list or a map: the descriptors, one of them
/// (`descriptors[N]`: a map, or an error), a list or map written out, or
/// a comprehension that builds a list (`map`, `filter`).
fn iterable(range: &cel::IdedExpr) -> bool {
    use cel::common::ast::Expr;
    match &range.expr {
        Expr::Ident(name) => name == "descriptors",
        Expr::Call(call) if call.func_name == cel::common::ast::operators::INDEX => {
            matches!(call.args.first().map(|a| &a.expr), Some(Expr::Ident(name)) if name == "descriptors")
        }
        Expr::List(_) | Expr::Map(_) => true,
        Expr::Comprehension(c) => matches!(c.accu_init.expr, Expr::List(_)) && iterable(&c.iter_range),
        _ => false,
    }
}

/// How deep comprehensions nest in `e` (a comprehension's range is not
/// inside it: ranges chained one after another add nothing).
fn comprehension_depth(e: &cel::IdedExpr) -> usize {
    use cel::common::ast::{EntryExpr, Expr};
    let deepest =
        |items: &mut dyn Iterator<Item = &cel::IdedExpr>| items.map(comprehension_depth).max().unwrap_or(0);
    match &e.expr {
        Expr::Comprehension(c) => {
            let body = deepest(&mut [&c.accu_init, &c.loop_cond, &c.loop_step, &c.result].into_iter());
            comprehension_depth(&c.iter_range).max(1 + body)
        }
        Expr::Call(call) => deepest(&mut call.target.iter().map(|t| &**t).chain(&call.args)),
        Expr::List(list) => deepest(&mut list.elements.iter()),
        Expr::Map(map) => deepest(&mut map.entries.iter().flat_map(|entry| match &entry.expr {
            EntryExpr::MapEntry(m) => vec![&m.key, &m.value],
            EntryExpr::StructField(f) => vec![&f.value],
        })),
        Expr::Struct(st) => deepest(&mut st.entries.iter().flat_map(|entry| match &entry.expr {
            EntryExpr::MapEntry(m) => vec![&m.key, &m.value],
            EntryExpr::StructField(f) => vec![&f.value],
        })),
        Expr::Select(select) => comprehension_depth(&select.operand),
        Expr::Unspecified | Expr::Ident(_) | Expr::Literal(_) => 0,
    }
}

/// The SHA-256 (hex, 16 bytes) of `parts`, each with its length, so no
/// two different lists share one.
fn digest(parts: &[&str]) -> String {
    use sha2::Digest as _;
    let mut hash = sha2::Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part.as_bytes());
    }
    hash.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The sources of `expressions` as a set: how a limit's identity takes
/// its conditions and its variables.
fn sources(expressions: &[Expression]) -> BTreeSet<&str> {
    expressions.iter().map(|e| &*e.source).collect()
}

/// A limit's identity: the digest of its namespace, seconds, and its
/// conditions and variables each sorted, with their counts.
fn identity(namespace: &str, seconds: u64, conditions: &[Expression], variables: &[Expression]) -> Arc<str> {
    let seconds = seconds.to_string();
    let (conditions_set, variables_set) = (sources(conditions), sources(variables));
    let (nc, nv) = (conditions_set.len().to_string(), variables_set.len().to_string());
    let mut parts = vec![namespace, &seconds, &nc];
    parts.extend(conditions_set);
    parts.push(&nv);
    parts.extend(variables_set);
    Arc::from(digest(&parts))
}

#[cfg(test)]
mod tests;
