//! `ratelimitd serve`: the service, until SIGTERM or SIGINT.

use std::process::ExitCode;

use super::{chain, report, runtime};
use crate::{config::Config, server, signal, telemetry};

/// Runs the service on `config`: binds both listeners, serves until
/// SIGTERM or SIGINT, and exits 0 after a clean stop, 1 on a failure
/// (logged, in the log's format, before the log is flushed).
pub fn run(config: Config) -> ExitCode {
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => return report(&e),
    };
    // Inside the runtime: the OTLP batch exporter runs on it.
    let tracing = match rt.block_on(async { telemetry::traces::init(&config.log, &config.telemetry) }) {
        Ok(tracing) => tracing,
        Err(e) => return report(&e),
    };
    raise_descriptor_limit();
    let served: Result<(), String> = rt.block_on(async {
        let addr = config.grpc_addr();
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("grpc.listen {addr}: cannot bind: {e}"))?;
        let http_addr = config.http_addr();
        let http = tokio::net::TcpListener::bind(http_addr)
            .await
            .map_err(|e| format!("http.listen {http_addr}: cannot bind: {e}"))?;
        server::run(config, listener, Some(http), signal::shutdown()).await.map_err(|e| chain(&e))
    });
    // In the log's format, before the log's writer is flushed and closed.
    if let Err(error) = &served {
        tracing::error!("ratelimitd failed: {error}");
    }
    // Flushes spans still buffered, while the runtime still runs.
    drop(tracing);
    if served.is_ok() { ExitCode::SUCCESS } else { ExitCode::FAILURE }
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
