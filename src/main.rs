//! The `ratelimitd` binary: parses the command line, loads and validates the
//! configuration before anything binds, and runs the chosen subcommand.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use ratelimitd::{
    cli::{self, Cli, Command, RulesCommand},
    config::Config,
    server, signal, telemetry,
};

/// mimalloc instead of glibc's malloc: the gRPC stack allocates and frees
/// per request across worker threads, where glibc's arenas contend (see
/// docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { cli::EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match cli.command {
        Command::Serve => serve(cli.config.as_deref()),
        Command::Check(args) => runtime().map_or_else(report, |rt| rt.block_on(cli::check(args))),
        Command::Rules(RulesCommand::Validate { paths, envoy }) => cli::validate_rules(&paths, envoy),
        Command::Rules(RulesCommand::Keygen { out }) => cli::keygen(&out),
        Command::Rules(command) => match load_config(cli.config.as_deref()) {
            Ok(config) => rules(command, &config),
            Err(code) => code,
        },
        Command::Replay(args) => match load_config(cli.config.as_deref()) {
            Ok(config) => cli::replay(&args, &config),
            Err(code) => code,
        },
        Command::Migrate => match load_config(cli.config.as_deref()) {
            Ok(config) => runtime().map_or_else(report, |rt| rt.block_on(cli::migrate(&config))),
            Err(code) => code,
        },
        Command::Probe { addr, path } => cli::probe(&addr, &path),
        Command::Admin(args) => match load_config(cli.config.as_deref()) {
            Ok(config) => admin(&args, config),
            Err(code) => code,
        },
        Command::Overload { mode } => match load_config(cli.config.as_deref()) {
            Ok(config) => {
                runtime().map_or_else(report, |rt| rt.block_on(cli::overload_mode(mode.as_deref(), &config)))
            }
            Err(code) => code,
        },
        Command::Audit(args) => match load_config(cli.config.as_deref()) {
            Ok(config) => cli::audit(args, &config),
            Err(code) => code,
        },
    }
}

/// The rules topic's commands (`rules validate` and `rules keygen` need no configuration).
fn rules(command: RulesCommand, config: &Config) -> ExitCode {
    match command {
        RulesCommand::Validate { paths, envoy } => cli::validate_rules(&paths, envoy),
        RulesCommand::Keygen { out } => cli::keygen(&out),
        RulesCommand::Diff(args) => cli::diff(&args, config),
        RulesCommand::Publish(args) => {
            runtime().map_or_else(report, |rt| rt.block_on(cli::publish(args, config)))
        }
        RulesCommand::Sync(args) => runtime().map_or_else(report, |rt| rt.block_on(cli::sync(args, config))),
        RulesCommand::Rollback { version, signing } => {
            runtime().map_or_else(report, |rt| rt.block_on(cli::rollback(&version, &signing, config)))
        }
        RulesCommand::History => cli::history(config),
        RulesCommand::Status => cli::status(config),
    }
}

/// Runs the admin console with the service's logging until SIGTERM or SIGINT.
fn admin(args: &cli::AdminArgs, config: Config) -> ExitCode {
    let run = runtime().and_then(|rt| {
        let tracing = rt.block_on(async { telemetry::traces::init(&config.log, &config.telemetry) })?;
        let code = rt.block_on(cli::admin(args, config, signal::shutdown()));
        drop(tracing);
        Ok(code)
    });
    run.unwrap_or_else(report)
}

/// Loads and validates the configuration; on error prints it and returns exit 64.
fn load_config(config_file: Option<&std::path::Path>) -> Result<Config, ExitCode> {
    Config::load(config_file, std::env::vars().collect()).map_err(|e| {
        fatal(&e.to_string());
        ExitCode::from(cli::EXIT_USAGE)
    })
}

fn serve(config_file: Option<&std::path::Path>) -> ExitCode {
    // Configuration is complete and valid before logging starts or a port binds.
    let config = match load_config(config_file) {
        Ok(config) => config,
        Err(code) => return code,
    };
    let result = runtime().and_then(|rt| {
        // Inside the runtime: the OTLP batch exporter runs on it.
        let tracing = rt.block_on(async { telemetry::traces::init(&config.log, &config.telemetry) })?;
        raise_descriptor_limit();
        let served: anyhow::Result<()> = rt.block_on(async {
            let addr = config.grpc_addr();
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("grpc.listen {addr}: cannot bind"))?;
            let http_addr = config.http_addr();
            let http = tokio::net::TcpListener::bind(http_addr)
                .await
                .with_context(|| format!("http.listen {http_addr}: cannot bind"))?;
            server::run(config, listener, Some(http), signal::shutdown()).await?;
            Ok(())
        });
        // In the log's format, before the log's writer is flushed and closed.
        if let Err(error) = &served {
            tracing::error!("ratelimitd failed: {error:#}");
        }
        // Flushes spans still buffered, while the runtime still runs.
        drop(tracing);
        Ok(served.is_ok())
    });
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => report(error),
    }
}

/// Raises the soft limit on open descriptors to the hard one: a service
/// holding thousands of connections must not run out at a distribution's
/// default soft limit (often 1,024) while the system allows more. Logged
/// either way; the connection bounds (`grpc.max_connections`,
/// `http.max_connections`) still apply.
fn raise_descriptor_limit() {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => tracing::info!(limit, "open descriptor limit"),
        Err(error) => tracing::warn!(%error, "open descriptor limit not raised"),
    }
}

/// The multi-threaded runtime, without its LIFO slot where the build
/// allows (`--cfg tokio_unstable`, set in .cargo/config.toml): with it, a
/// response wakes the HTTP/2 connection task straight away and every
/// response costs a `writev` of its own; without it the responses of one
/// scheduler pass go out together (per unary decision, five alternating
/// rounds on 2 cores: 0.79–0.95 -> 0.19–0.21 `writev`, and CPU 20.2 ->
/// 17.3 µs, medians; docs/performance.md, "Trimming the stream and unary paths").
fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    #[cfg(tokio_unstable)]
    builder.disable_lifo_slot();
    builder.build().context("cannot start the tokio runtime")
}

/// A command's failure, or the service's before its log started.
fn report(error: anyhow::Error) -> ExitCode {
    fatal(&format!("{error:#}"));
    ExitCode::FAILURE
}

/// Writes a failure that happened where no log runs (the configuration
/// does not load, the log cannot start) to stderr: one JSON object like
/// the log's own lines when the environment asks for JSON logs
/// (`RATELIMITD__LOG__FORMAT=json`, or upstream's `LOG_FORMAT=json` in
/// compat mode), so a log collector parsing JSON keeps it; plain text
/// otherwise.
fn fatal(message: &str) {
    let env = |name: &str| std::env::var(name).is_ok_and(|v| v.eq_ignore_ascii_case("json"));
    let compat = std::env::var(ratelimitd::config::compat::COMPAT_VAR).is_ok_and(|v| !v.is_empty());
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
