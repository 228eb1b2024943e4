//! The command line: [`main`] parses it and [`run`] dispatches each command
//! to its file, which holds its arguments beside its code: `serve`,
//! `check`, `rules/` (`validate`, `keygen`, `diff`, `publish` and `sync`,
//! `rollback`, `history`, `status`), `replay`, `migrate`, `audit`,
//! `overload`, `admin`, `probe`. What several commands share is here (the
//! configuration, the runtime, how a failure is printed) or in
//! `rule_sets.rs` (the rule sets they compare).
//!
//! Exit codes follow sysexits where one fits: 0 success (for `check`: the
//! request is allowed), 1 denied / invalid rules, 64 usage or configuration
//! error, 69 the server is unavailable.

pub mod admin;
pub mod audit;
pub mod check;
mod limitador;
pub mod migrate;
pub mod overload;
pub mod probe;
pub mod replay;
mod rule_sets;
pub mod rules;
pub mod serve;

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

use crate::config::Config;
use rules::RulesCommand;

/// Exit status for a bad command line or configuration (EX_USAGE).
pub const EXIT_USAGE: u8 = 64;
/// Exit status when the server cannot be reached (EX_UNAVAILABLE).
pub const EXIT_UNAVAILABLE: u8 = 69;

/// ratelimitd: a gRPC rate-limit decision service.
#[derive(Debug, Parser)]
#[command(name = "ratelimitd", version, about)]
pub struct Cli {
    /// YAML configuration file; environment variables RATELIMITD__SECTION__KEY override it.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the service.
    Serve,
    /// Ask a running server for one decision and print it.
    Check(check::CheckArgs),
    /// Rule set operations.
    #[command(subcommand)]
    Rules(rules::RulesCommand),
    /// Apply the numbered setup steps (Kafka topic, Redis key schema); idempotent.
    Migrate,
    /// Read failed-decision records from the dead-letter topic (or a file), filter and summarise.
    Audit(audit::AuditArgs),
    /// Replay captured requests through the rules in force and a candidate; gate on CRITICAL denials.
    Replay(replay::ReplayArgs),
    /// The overload layer's cluster-wide switch (in Redis): every instance
    /// follows within two `overload.report_interval_ms`.
    Overload {
        /// `enforce`, `shadow` or `off` sets the switch; `clear` removes it
        /// (each instance's tenant table or `overload.mode` decides again);
        /// none prints it.
        #[arg(value_parser = ["enforce", "shadow", "off", "clear"])]
        mode: Option<String>,
    },
    /// Run the admin console (admin.*): edit rules in their Git repository,
    /// review them against the rules in force and a capture, publish
    /// through the rules topic (rules.kafka.*).
    Admin(admin::AdminArgs),
    /// GET a health endpoint of a running service; exit 0 on HTTP 200 (for container HEALTHCHECKs).
    Probe {
        /// host:port of the HTTP listener (http.listen).
        #[arg(long, default_value = "127.0.0.1:8080")]
        addr: String,
        /// /healthz (alive) or /readyz (ready).
        #[arg(long, default_value = "/healthz")]
        path: String,
    },
}

/// The name envoyproxy/ratelimit's binary has in its image
/// (`/bin/ratelimit`), which control planes such as Envoy Gateway run.
pub const UPSTREAM_NAME: &str = "ratelimit";

/// Whether the binary runs under upstream's name ([`UPSTREAM_NAME`]).
fn invoked_as_upstream() -> bool {
    invoked_as(UPSTREAM_NAME)
}

/// Whether the binary's file name (the command's first word) is `name`.
fn invoked_as(name: &str) -> bool {
    let invoked = std::env::args_os().next().map(PathBuf::from);
    invoked.as_deref().and_then(std::path::Path::file_name).is_some_and(|file| file == name)
}

/// Parses the command line and runs it; a usage error exits 64, `--help`
/// and `--version` 0. Invoked as [`UPSTREAM_NAME`] (by its file name, as
/// upstream's image is), the binary is that one: it takes no argument and
/// serves in envoyproxy compat mode (`RATELIMITD_COMPAT=envoyproxy` unless
/// the environment names a mode).
pub fn main() -> ExitCode {
    if invoked_as(limitador::NAME) {
        return limitador::main(std::env::args_os().collect(), std::env::vars().collect());
    }
    if invoked_as_upstream() {
        if let Some(arg) = std::env::args_os().nth(1) {
            fatal(&format!(
                "invoked as {UPSTREAM_NAME} (envoyproxy/ratelimit's binary), which takes no argument: got {arg:?}; run ratelimitd for its commands"
            ));
            return ExitCode::from(EXIT_USAGE);
        }
        let mut env: std::collections::HashMap<String, String> = std::env::vars().collect();
        env.entry(crate::config::compat::COMPAT_VAR.to_owned())
            .or_insert_with(|| crate::config::compat::ENVOYPROXY.to_owned());
        return with_config_from(None, env, serve::run);
    }
    match Cli::try_parse() {
        Ok(cli) => run(cli),
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            ExitCode::from(code)
        }
    }
}

/// Runs one command: the one place a command is dispatched. A command
/// that needs the configuration loads and validates it first (an error
/// exits 64); an async one runs on [`runtime`].
pub fn run(cli: Cli) -> ExitCode {
    let file = cli.config.as_deref();
    match cli.command {
        Command::Serve => with_config(file, serve::run),
        Command::Check(args) => block_on(check::run(args)),
        Command::Rules(RulesCommand::Validate { paths, envoy, limitador }) => {
            let format = match (envoy, limitador) {
                (true, _) => rules::validate::Format::Envoy,
                (_, true) => rules::validate::Format::Limitador,
                _ => rules::validate::Format::Native,
            };
            rules::validate::run(&paths, format)
        }
        Command::Rules(RulesCommand::Keygen { out }) => rules::keygen::run(&out),
        Command::Rules(RulesCommand::Diff(args)) => with_config(file, |c| rules::diff::run(&args, &c)),
        Command::Rules(RulesCommand::Publish(args)) => {
            with_config(file, |c| block_on(rules::publish::run(args, &c)))
        }
        Command::Rules(RulesCommand::Sync(args)) => {
            with_config(file, |c| block_on(rules::publish::sync(args, &c)))
        }
        Command::Rules(RulesCommand::Rollback { version, signing }) => {
            with_config(file, |c| block_on(rules::rollback::run(&version, &signing, &c)))
        }
        Command::Rules(RulesCommand::History) => with_config(file, |c| rules::history::run(&c)),
        Command::Rules(RulesCommand::Status) => with_config(file, |c| rules::status::run(&c)),
        Command::Replay(args) => with_config(file, |c| replay::run(&args, &c)),
        Command::Migrate => with_config(file, |c| block_on(migrate::run(&c))),
        Command::Audit(args) => with_config(file, |c| audit::run(args, &c)),
        Command::Overload { mode } => with_config(file, |c| block_on(overload::run(mode.as_deref(), &c))),
        Command::Admin(args) => with_config(file, |c| admin::run(&args, c)),
        Command::Probe { addr, path } => probe::run(&addr, &path),
    }
}

/// Runs `command` with the configuration (`--config`, then the
/// environment), loaded and validated; on error prints it and exits 64.
fn with_config(file: Option<&std::path::Path>, command: impl FnOnce(Config) -> ExitCode) -> ExitCode {
    with_config_from(file, std::env::vars().collect(), command)
}

/// [`with_config`] with `env` for the process environment.
fn with_config_from(
    file: Option<&std::path::Path>,
    env: std::collections::HashMap<String, String>,
    command: impl FnOnce(Config) -> ExitCode,
) -> ExitCode {
    match Config::load(file, env) {
        Ok(config) => command(config),
        Err(e) => {
            fatal(&e.to_string());
            ExitCode::from(EXIT_USAGE)
        }
    }
}

/// Runs an async command on [`runtime`].
fn block_on(command: impl Future<Output = ExitCode>) -> ExitCode {
    match runtime() {
        Ok(rt) => rt.block_on(command),
        Err(e) => report(&e),
    }
}

/// The multi-threaded runtime, without its LIFO slot where the build
/// allows (`--cfg tokio_unstable`, set in .cargo/config.toml): with it, a
/// response wakes the HTTP/2 connection task straight away and every
/// response costs a `writev` of its own; without it the responses of one
/// scheduler pass go out together (docs/performance.md, "Trimming the
/// stream and unary paths").
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    #[cfg(tokio_unstable)]
    builder.disable_lifo_slot();
    builder.build().map_err(|e| std::io::Error::other(format!("cannot start the tokio runtime: {e}")))
}

/// A command's failure, or the service's before its log started, with its
/// chain of causes (`outer: inner`).
fn report(error: &dyn std::error::Error) -> ExitCode {
    fatal(&chain(error));
    ExitCode::FAILURE
}

/// `error` and its sources, joined by `: `.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// Writes a failure that happened where no log runs (the configuration
/// does not load, the log cannot start) to stderr: one JSON object like
/// the log's own lines when the environment asks for JSON logs
/// (`RATELIMITD__LOG__FORMAT=json`, or upstream's `LOG_FORMAT=json` in
/// compat mode), so a log collector parsing JSON keeps it; plain text
/// otherwise.
fn fatal(message: &str) {
    let env = |name: &str| std::env::var(name).is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let compat = invoked_as_upstream()
        || std::env::var(crate::config::compat::COMPAT_VAR).is_ok_and(|v| !v.is_empty());
    if env("RATELIMITD__LOG__FORMAT") || (compat && env("LOG_FORMAT")) {
        let line = serde_json::json!({
            "timestamp": humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string(),
            "level": "ERROR",
            "fields": { "message": format!("ratelimitd failed: {message}") },
            "target": "ratelimitd",
        });
        eprintln!("{line}");
    } else {
        eprintln!("ratelimitd: {message}");
    }
}
