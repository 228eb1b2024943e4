//! `ratelimitd admin`: the console, with the service's logging, until
//! SIGTERM or SIGINT.

use std::process::ExitCode;

use super::{
    EXIT_USAGE, report,
    rules::{SigningArgs, signer},
    runtime,
};
use crate::{config::Config, signal, telemetry};

/// `ratelimitd admin …`
#[derive(Debug, clap::Args)]
pub struct AdminArgs {
    /// How the console's publications are signed.
    #[command(flatten)]
    pub signing: SigningArgs,
}

/// Runs the admin console with the service's logging until SIGTERM or SIGINT.
pub fn run(args: &AdminArgs, config: Config) -> ExitCode {
    let Ok(rt) = runtime().map_err(|e| report(&e)) else { return ExitCode::FAILURE };
    let tracing = match rt.block_on(async { telemetry::traces::init(&config.log, &config.telemetry) }) {
        Ok(tracing) => tracing,
        Err(e) => return report(&e),
    };
    let code = rt.block_on(serve(args, config, signal::shutdown()));
    drop(tracing);
    code
}

/// Runs `ratelimitd admin` until `stop`: 0 after a clean stop, 64 for a
/// configuration it cannot run with, 1 when it cannot start.
async fn serve(args: &AdminArgs, config: Config, stop: impl std::future::Future<Output = ()>) -> ExitCode {
    if config.rules.kafka.brokers.is_none() {
        eprintln!("admin: rules.kafka.brokers is not set: the console publishes to the rules topic");
        return ExitCode::from(EXIT_USAGE);
    }
    let signer = match signer("admin", &args.signing, &config) {
        Ok(signer) => signer,
        Err(code) => return code,
    };
    let addr = config.admin.addr();
    let console = match crate::console::Console::new(config, signer) {
        Ok(console) => console,
        Err(e @ crate::console::ConsoleError::Config(_)) => {
            eprintln!("admin: {e}");
            return ExitCode::from(EXIT_USAGE);
        }
        Err(e) => {
            eprintln!("admin: {e}");
            return ExitCode::from(1);
        }
    };
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("admin: admin.listen {addr}: cannot bind: {e}");
            return ExitCode::from(1);
        }
    };
    tracing::info!(%addr, "admin console listening");
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let serving = tokio::spawn(crate::console::run(console, listener, stopped));
    stop.await;
    let _ = stopping.send(true);
    let _ = serving.await;
    ExitCode::SUCCESS
}
