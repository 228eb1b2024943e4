//! `ratelimitd replay`: captured requests through the rules in force and a
//! candidate, the report printed and gated.

use std::{io::Write as _, path::PathBuf, process::ExitCode};

use super::{
    EXIT_USAGE,
    rule_sets::{GateArgs, rules_with},
};
use crate::{config::Config, rollout::publish::Sources};

/// `ratelimitd replay …`
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The candidate native rules: a YAML file or a directory. Default: the
    /// native rules in force.
    #[arg(long, required_unless_present_any = ["envoy", "limitador"])]
    pub rules: Option<PathBuf>,
    /// The candidate envoyproxy/ratelimit configuration: a file or a
    /// directory. Default: the Envoy configuration in force.
    #[arg(long, value_name = "PATH")]
    pub envoy: Option<PathBuf>,
    /// The candidate limitador limits file: Envoy-API requests are then
    /// decided by limitador's limits. Default: those in force.
    #[arg(long, value_name = "FILE")]
    pub limitador: Option<PathBuf>,
    /// The capture: a JSON-lines file (capture.file), or `kafka` for capture.kafka.topic.
    #[arg(long)]
    pub capture: String,
    /// The native rules in force. Default: the record in force on the
    /// rules topic (rules.source: kafka), else rules.path, else the embedded rules.
    #[arg(long)]
    pub current: Option<PathBuf>,
    /// The Envoy configuration in force. Default: the record in force on
    /// the rules topic (rules.source: kafka), else rules.envoy_path.
    #[arg(long, value_name = "PATH")]
    pub current_envoy: Option<PathBuf>,
    /// limitador's limits in force. Default: the record in force on the
    /// rules topic (rules.source: kafka), else rules.limitador_path.
    #[arg(long, value_name = "FILE")]
    pub current_limitador: Option<PathBuf>,
    /// Exit 1 when the candidate fails the gate by these thresholds.
    #[command(flatten)]
    pub thresholds: GateArgs,
    /// Also write the report as JSON (per rule, per priority, a timeline, the gate) to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Runs `ratelimitd replay`: 0 the candidate passes the gate, 1 it fails
/// (or the capture cannot be read), 64 bad arguments.
pub fn run(args: &ReplayArgs, config: &Config) -> ExitCode {
    let current = Sources {
        native: args.current.as_deref(),
        envoy: args.current_envoy.as_deref(),
        limitador: args.current_limitador.as_deref(),
    };
    let current = match rules_with(config, current, ["--current", "--current-envoy", "--current-limitador"]) {
        Ok(current) => current,
        Err(code) => return code,
    };
    let candidate = Sources {
        native: args.rules.as_deref(),
        envoy: args.envoy.as_deref(),
        limitador: args.limitador.as_deref(),
    };
    let candidate = match rules_with(config, candidate, ["--rules", "--envoy", "--limitador"]) {
        Ok(candidate) => candidate,
        Err(code) => return code,
    };
    let thresholds = match args.thresholds.thresholds(config.gate) {
        Ok(thresholds) => thresholds,
        Err(code) => return code,
    };
    match run_replay(config, &args.capture, current, candidate, thresholds, args.json.as_deref()) {
        Ok(report) if report.gate.passed => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(code) => code,
    }
}

/// Reads the capture, replays, prints the report and returns it.
fn run_replay(
    config: &Config,
    source: &str,
    current: crate::replay::Rules,
    candidate: crate::replay::Rules,
    thresholds: crate::rules::gate::GateThresholds,
    json: Option<&std::path::Path>,
) -> Result<crate::replay::Report, ExitCode> {
    let capture = if source == "kafka" {
        let kafka = &config.capture.kafka;
        let Some(brokers) = &kafka.brokers else {
            eprintln!("--capture kafka: capture.kafka.brokers is not set");
            return Err(ExitCode::from(EXIT_USAGE));
        };
        match crate::rollout::topic::read_all(brokers, &kafka.properties, &kafka.topic) {
            Ok(records) => {
                let mut capture = crate::replay::Capture::default();
                records.iter().filter_map(|r| r.payload.as_deref()).for_each(|p| capture.push(p));
                capture.sort();
                capture
            }
            Err(e) => {
                eprintln!("--capture kafka: {e}");
                return Err(ExitCode::from(1));
            }
        }
    } else {
        crate::replay::Capture::from_file(std::path::Path::new(source)).map_err(|e| {
            eprintln!("--capture: {e}");
            ExitCode::from(1)
        })?
    };
    let in_force = [Some(current.native.version()), current.envoy.as_ref().map(|e| e.version())];
    if capture.versions.keys().any(|v| !in_force.contains(&Some(v.as_str()))) {
        eprintln!(
            "note: the capture was decided under rules {:?}; replaying against {} as the rules in force",
            capture.versions,
            current.version()
        );
    }
    let report = crate::replay::replay(
        &capture,
        current,
        candidate,
        &crate::release::replay_settings(config, thresholds),
    );
    let _ = std::io::stdout().write_all(report.table().as_bytes());
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("--json {}: {e}", path.display());
            return Err(ExitCode::from(1));
        }
    }
    Ok(report)
}
