//! Observability: Prometheus metrics ([`metrics`], and envoyproxy/ratelimit's
//! families in [`upstream`], also sent to statsd by [`statsd`]; the process
//! families and build info in [`process`]), and logs and OpenTelemetry
//! traces ([`traces`]). The HTTP endpoints and the health monitor are the
//! server's (`server::health`).

pub mod metrics;
pub mod process;
pub mod settings;
pub mod statsd;
pub mod traces;
pub mod upstream;

pub use metrics::Metrics;
