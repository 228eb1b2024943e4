//! Process signals: the future that resolves when the service should stop.

/// Resolves on SIGTERM (what Kubernetes and systemd send) or SIGINT (Ctrl-C).
pub async fn shutdown() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the service");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received; draining"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; draining"),
    }
}
