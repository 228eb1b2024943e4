//! Observability: the `/metrics` registry ([`metrics`]) that reads every
//! part's figures through one trait ([`exposition::Figures`]) and sends
//! their statsd counters ([`statsd`]); the process families and build info
//! ([`process`]); and logs and OpenTelemetry
//! traces ([`traces`]). The HTTP endpoints and the health monitor are the
//! server's (`server::health`).

pub mod exposition;
pub mod metrics;
pub mod process;
pub mod settings;
pub mod statsd;
pub mod traces;

pub use exposition::Figures;
pub use metrics::Metrics;
