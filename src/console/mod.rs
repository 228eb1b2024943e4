//! `ratelimitd admin`: the console of the write path. Its pages (no build
//! step: one HTML file, one script, one style sheet, compiled into the
//! binary) and its JSON API, on `admin.listen`.
//!
//! - See: every instance's version and standing (the status topic), the
//!   record in force and the topic's history, the rules at the branch head.
//! - Change: a change to the rule files checked as typed (the compilers
//!   `serve` uses), compared with the rules in force, gated against a
//!   capture of `admin.captures_dir`, proposed for review.
//! - Publish through Git: a publisher's accepted change becomes a commit on
//!   `admin.branch` (author: the publisher, message: the reviewer's text)
//!   and that commit is published by [`crate::release`], the path `rules
//!   publish` and `rules sync` take; a rollback is a revert commit
//!   published the same way. The repository stays the truth: `rules sync`
//!   publishes what reached it by other means.
//!
//! Sign-in ([`auth`]): tokens or a trusted proxy's headers; roles viewer,
//! editor, publisher. Every action is in the audit log ([`audit`]).

pub mod audit;
pub mod auth;
mod handlers;
mod pages;
mod publication;
pub mod workspace;

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Router,
    extract::DefaultBodyLimit,
    routing::{get, post},
};
use std::sync::Mutex;

use tokio::sync::{Semaphore, watch};

use crate::{
    config::Config,
    rules::signing::{Signer, Trust},
    server::{conns::Limits, health::serve_app},
};

/// The largest request body the API reads.
const MAX_BODY_BYTES: usize = 2 << 20;

/// Why the console cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// A setting it needs.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The audit log cannot be written.
    #[error(transparent)]
    Audit(#[from] audit::AuditError),
    /// The signing key.
    #[error("{0}")]
    Key(String),
}

/// What every request handler shares.
#[derive(Debug)]
pub struct Console {
    config: Config,
    workspace: workspace::Workspace,
    auth: auth::Auth,
    audit: audit::AuditLog,
    signer: Option<Signer>,
    trust: Trust,
    /// One replay or publish at a time: each runs engines over a capture.
    heavy: Semaphore,
    /// The overview, made at most once a second whoever asks.
    overview: Mutex<handlers::OverviewCache>,
    /// One reader of the topics at a time; the others take its view.
    refresh: Arc<Semaphore>,
}

impl Console {
    /// The console of `config` (`admin.*`, `rules.kafka.*`), signing with
    /// `signer`; the audit log is opened now.
    pub fn new(config: Config, signer: Option<Signer>) -> Result<Self, ConsoleError> {
        let admin = &config.admin;
        admin.runnable()?;
        let workspace = workspace::Workspace {
            repo: admin.repo.clone().unwrap_or_default(),
            branch: admin.branch.clone(),
            native: admin.rules_path.clone(),
            envoy: admin.envoy_path.clone(),
            limitador: admin.limitador_path.clone(),
        };
        let auth = auth::Auth::new(&admin.users, &admin.proxy);
        let audit = audit::AuditLog::open(&admin.audit_log)?;
        let trust = crate::release::trust(&config, signer.as_ref());
        Ok(Self {
            config,
            workspace,
            auth,
            audit,
            signer,
            trust,
            heavy: Semaphore::new(1),
            overview: Mutex::new(handlers::OverviewCache::default()),
            refresh: Arc::new(Semaphore::new(1)),
        })
    }
}

/// The console's routes.
pub fn router(console: Arc<Console>) -> Router {
    Router::new()
        .route("/", get(pages::index))
        .route("/app.js", get(pages::script))
        .route("/style.css", get(pages::style))
        .route("/api/session", get(handlers::session))
        .route("/api/overview", get(handlers::overview))
        .route("/api/rules", get(handlers::rules))
        .route("/api/in-force", get(handlers::in_force))
        .route("/api/check", post(handlers::check))
        .route("/api/gate", post(handlers::gate))
        .route("/api/proposals", get(handlers::proposals).post(handlers::propose))
        .route("/api/proposals/{id}", get(handlers::proposal))
        .route("/api/publish", post(publication::publish))
        .route("/api/rollback", post(publication::rollback))
        .route("/api/sync", post(publication::sync))
        .route("/api/audit", get(handlers::audit))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(console)
}

/// Serves the console on `listener` until `shutdown`; refused sign-ins are
/// written to the audit log once a minute.
pub async fn run(console: Console, listener: tokio::net::TcpListener, shutdown: watch::Receiver<bool>) {
    let console = Arc::new(console);
    let limits = Limits {
        max_connections: 256,
        // A signing-in proxy carries every user's connections.
        max_connections_per_peer: 64,
        idle_timeout: Duration::from_secs(60),
        max_age: Duration::from_secs(600),
        header_read_timeout: Duration::from_secs(10),
    };
    let flusher = {
        let (console, mut stop) = (console.clone(), shutdown.clone());
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(60));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop.changed() => break,
                }
                let console = console.clone();
                let written =
                    tokio::task::spawn_blocking(move || console.audit.flush(std::time::Instant::now())).await;
                if let Ok(Err(e)) = written {
                    tracing::error!("{e}");
                }
            }
        })
    };
    serve_app(listener, limits, router(console.clone()), shutdown).await;
    flusher.abort();
    let _ = console.audit.flush(std::time::Instant::now() + audit::FOLD_INTERVAL);
}

/// The peer of a request, for the proxy's trust.
pub(crate) type Peer = axum::extract::ConnectInfo<SocketAddr>;
