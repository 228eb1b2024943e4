//! `ratelimitd rules diff`: what a candidate rule set changes against the
//! rules in force, and with a capture how many requests each change touches.

use std::{io::Write, path::PathBuf, process::ExitCode};

use crate::{cli::rule_sets::rules_with, config::Config, rollout::publish::Sources};

/// `ratelimitd rules diff …`
#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    /// The candidate native rules: a YAML file or a directory.
    #[arg(required_unless_present_any = ["envoy", "limitador"])]
    pub rules: Option<PathBuf>,
    /// The candidate envoyproxy/ratelimit configuration: a file or a directory.
    #[arg(long, value_name = "PATH")]
    pub envoy: Option<PathBuf>,
    /// The candidate limitador limits file.
    #[arg(long, value_name = "FILE")]
    pub limitador: Option<PathBuf>,
    /// The native rules to compare with. Default: the record in force on
    /// the rules topic (rules.source: kafka), else rules.path, else the
    /// embedded rules.
    #[arg(long, value_name = "PATH")]
    pub from: Option<PathBuf>,
    /// The Envoy configuration to compare with. Default: the record in force
    /// on the rules topic (rules.source: kafka), else rules.envoy_path, else none.
    #[arg(long, value_name = "PATH")]
    pub from_envoy: Option<PathBuf>,
    /// limitador's limits to compare with. Default: the record in force on
    /// the rules topic (rules.source: kafka), else rules.limitador_path, else none.
    #[arg(long, value_name = "FILE")]
    pub from_limitador: Option<PathBuf>,
    /// A capture (a JSON-lines file, capture.file): count the requests each
    /// change touches.
    #[arg(long, value_name = "FILE")]
    pub capture: Option<PathBuf>,
}

/// Runs `rules diff`: 0 printed (changes or none), 1 rules or the capture
/// cannot be read.
pub fn run(args: &DiffArgs, config: &Config) -> ExitCode {
    let from = Sources {
        native: args.from.as_deref(),
        envoy: args.from_envoy.as_deref(),
        limitador: args.from_limitador.as_deref(),
    };
    let candidate = Sources {
        native: args.rules.as_deref(),
        envoy: args.envoy.as_deref(),
        limitador: args.limitador.as_deref(),
    };
    let sides = rules_with(config, from, ["--from", "--from-envoy", "--from-limitador"]).and_then(|old| {
        let new = rules_with(config, candidate, ["rules diff", "--envoy", "--limitador"])?;
        Ok((old, new))
    });
    let (old, new) = match sides {
        Ok(sides) => sides,
        Err(code) => return code,
    };
    let capture = match args.capture.as_deref().map(crate::replay::Capture::from_file).transpose() {
        Ok(capture) => capture,
        Err(e) => {
            eprintln!("rules diff: {e}");
            return ExitCode::from(1);
        }
    };
    let mut out = std::io::stdout().lock();
    if args.rules.is_some() {
        print_native_diff(&mut out, &old.native, &new.native, capture.as_ref());
    }
    if args.envoy.is_some() {
        let none = crate::rules::envoy::EnvoyConfig::default();
        let old_envoy = old.envoy.as_ref().unwrap_or(&none);
        print_envoy_diff(&mut out, old_envoy, new.envoy.as_ref().unwrap_or(&none), capture.as_ref());
    }
    if args.limitador.is_some() {
        let none = crate::rules::limitador::Limits::default();
        let old_limits = old.limitador.as_ref().unwrap_or(&none);
        print_limitador_diff(&mut out, old_limits, new.limitador.as_ref().unwrap_or(&none));
    }
    ExitCode::SUCCESS
}

/// `rules diff`'s lines for native rules.
fn print_native_diff(
    out: &mut impl Write,
    old: &crate::rules::Snapshot,
    new: &crate::rules::Snapshot,
    capture: Option<&crate::replay::Capture>,
) {
    use crate::rules::diff;
    let changes = diff::diff(old, new);
    let touched = capture.map(|capture| {
        let native = capture.requests.iter().filter(|r| r.envoy.is_none());
        let requests = native.clone().map(|r| (&*r.resource_path, r.client_type.as_deref()));
        (diff::touched(old, new, &changes, requests), native.count())
    });
    let versions = (old.version(), new.version());
    print_changes(out, versions, &changes, touched.as_ref(), |id, candidate| {
        diff::describe_rule(if candidate { new } else { old }, id)
    });
}

/// `rules diff`'s lines for Envoy limits.
fn print_envoy_diff(
    out: &mut impl Write,
    old: &crate::rules::envoy::EnvoyConfig,
    new: &crate::rules::envoy::EnvoyConfig,
    capture: Option<&crate::replay::Capture>,
) {
    use crate::rules::diff;
    let changes = diff::envoy_diff(old, new);
    let touched = capture.map(|capture| {
        let calls = capture.requests.iter().filter_map(|r| r.envoy.as_deref());
        let requests = calls.clone().map(|call| {
            let entries =
                call.descriptors.iter().map(|d| d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            (call.domain.as_str(), entries)
        });
        (diff::envoy_touched(old, new, &changes, requests), calls.count())
    });
    // Each configuration's limits walked once, not once per change.
    let (old_limits, new_limits) = (old.limits(), new.limits());
    let versions = (old.version(), new.version());
    print_changes(out, versions, &changes, touched.as_ref(), |key, candidate| {
        diff::describe_limit(if candidate { &new_limits } else { &old_limits }, key)
    });
}

/// `rules diff`'s lines for limitador's limits (a capture is not counted
/// against them).
fn print_limitador_diff(
    out: &mut impl Write,
    old: &crate::rules::limitador::Limits,
    new: &crate::rules::limitador::Limits,
) {
    use crate::rules::{Versioned, diff};
    let changes = diff::limitador_diff(old, new);
    let (old_limits, new_limits) = (diff::limitador_by_key(old), diff::limitador_by_key(new));
    let (old_version, new_version) = (old.version(), new.version());
    let versions = (if old_version.is_empty() { "none" } else { old_version }, new_version);
    print_changes(out, versions, &changes, None, |key, candidate| {
        diff::describe_limitador_key(if candidate { &new_limits } else { &old_limits }, key)
    });
}

/// A summary line, then one line per change (with the captured requests it
/// touches); `describe(key, in_candidate)` says what a rule or limit is.
fn print_changes(
    out: &mut impl Write,
    (old, new): (&str, &str),
    changes: &[crate::rules::diff::Change],
    touched: Option<&(std::collections::BTreeMap<String, u64>, usize)>,
    describe: impl Fn(&str, bool) -> String,
) {
    use crate::rules::diff::Change;
    let count = |f: fn(&Change) -> bool| changes.iter().filter(|c| f(c)).count();
    let _ = writeln!(
        out,
        "{old} -> {new}: {} added, {} removed, {} changed",
        count(|c| matches!(c, Change::Added(_))),
        count(|c| matches!(c, Change::Removed(_))),
        count(|c| matches!(c, Change::Changed(..))),
    );
    for change in changes {
        let what = match change {
            Change::Added(id) => format!("added    {id}: {}", describe(id, true)),
            Change::Removed(id) => format!("removed  {id}: {}", describe(id, false)),
            Change::Changed(id, fields) => {
                let fields: Vec<String> = fields.iter().map(|(f, a, b)| format!("{f} {a} -> {b}")).collect();
                format!("changed  {id}: {}", fields.join("; "))
            }
        };
        let touches = touched
            .map(|(t, total)| format!("  (touches {} of {total} captured requests)", t[change.rule_id()]))
            .unwrap_or_default();
        let _ = writeln!(out, "{what}{touches}");
    }
}
