//! What the commands that compare rule sets share (`replay`, `rules diff`,
//! `rules publish --gate`): the rules in force with parts replaced from
//! flags, and the gate's thresholds from flags.

use std::process::ExitCode;

use super::EXIT_USAGE;
use crate::config::Config;

/// The gate's thresholds, each overriding its `gate.*` setting.
#[derive(Debug, Clone, clap::Args)]
pub struct GateArgs {
    /// The largest share of the CRITICAL requests allowed by the rules in
    /// force that the candidate may deny (0.05 = 5%); default gate.max_critical_drop.
    #[arg(long, value_name = "SHARE")]
    pub max_critical_drop: Option<f64>,
    /// The same within one rule; default gate.max_critical_drop_per_rule.
    #[arg(long, value_name = "SHARE")]
    pub max_critical_drop_per_rule: Option<f64>,
    /// The same within one path; default gate.max_critical_drop_per_path.
    #[arg(long, value_name = "SHARE")]
    pub max_critical_drop_per_path: Option<f64>,
    /// Judge a rule or path from this many CRITICAL requests; default gate.min_group_requests.
    #[arg(long, value_name = "N")]
    pub min_group_requests: Option<u64>,
    /// Fail on a capture of fewer requests; default gate.min_capture_requests.
    #[arg(long, value_name = "N")]
    pub min_capture_requests: Option<u64>,
}

impl GateArgs {
    /// `configured` with these overrides; an error names the flag.
    pub(super) fn thresholds(
        &self,
        configured: crate::rules::gate::GateThresholds,
    ) -> Result<crate::rules::gate::GateThresholds, ExitCode> {
        let t = crate::rules::gate::GateThresholds {
            max_critical_drop: self.max_critical_drop.unwrap_or(configured.max_critical_drop),
            max_critical_drop_per_rule: self
                .max_critical_drop_per_rule
                .unwrap_or(configured.max_critical_drop_per_rule),
            max_critical_drop_per_path: self
                .max_critical_drop_per_path
                .unwrap_or(configured.max_critical_drop_per_path),
            min_group_requests: self.min_group_requests.unwrap_or(configured.min_group_requests),
            min_capture_requests: self.min_capture_requests.unwrap_or(configured.min_capture_requests),
        };
        match t.invalid() {
            None => Ok(t),
            Some((key, why)) => {
                let flag = key.trim_start_matches("gate.").replace('_', "-");
                eprintln!("--{flag}: {why}");
                Err(ExitCode::from(EXIT_USAGE))
            }
        }
    }
}

/// The rules in force with the parts `sources` gives replaced: native
/// rules, the Envoy configuration, limitador's limits (errors name the
/// part's flag in `flags`, in that order).
pub(super) fn rules_with(
    config: &Config,
    sources: crate::rollout::publish::Sources<'_>,
    flags: [&str; 3],
) -> Result<crate::replay::Rules, ExitCode> {
    let mut rules = match (sources.native, sources.envoy) {
        (Some(_), Some(_)) => crate::replay::Rules::native(crate::rules::empty()),
        _ => current_rules(config, None)?,
    };
    if let Some(path) = sources.native {
        rules.native =
            crate::rules::load(path, config.rules.path_matching).map_err(|e| rule_errors(flags[0], &e))?;
    }
    if let Some(path) = sources.envoy {
        let compiled = crate::rules::envoy::load(path, config.envoy.compile());
        rules.envoy = Some(compiled.map_err(|e| rule_errors(flags[1], &e))?);
    }
    if let Some(path) = sources.limitador {
        let compiled = crate::rules::limitador::Limits::load(path, config.rules.limitador_algorithm);
        rules.limitador = Some(compiled.map_err(|e| rule_errors(flags[2], &e))?);
    }
    Ok(rules)
}

fn rule_errors(flag: &str, errors: &crate::rules::RuleErrors) -> ExitCode {
    for error in &errors.0 {
        eprintln!("{flag}: {error}");
    }
    ExitCode::from(1)
}

/// The rules in force (see [`crate::release::rules_in_force`]); a
/// problem printed (exit 1).
fn current_rules(
    config: &Config,
    in_force: Option<&crate::rules::encoding::SnapshotRecord>,
) -> Result<crate::replay::Rules, ExitCode> {
    crate::release::rules_in_force(config, in_force, &crate::release::trust(config, None)).map_err(|e| {
        eprintln!("{e}");
        ExitCode::from(1)
    })
}
