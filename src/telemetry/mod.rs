//! Observability: Prometheus metrics ([`metrics`], and envoyproxy/ratelimit's
//! families in [`upstream`], also sent to statsd by [`statsd`]; the process
//! families and build info in [`process`]), the HTTP endpoints
//! `/metrics`, `/healthz` and `/readyz` and the health monitor that also
//! drives gRPC health ([`health`]), and logs and OpenTelemetry traces
//! ([`traces`]).

pub mod conns;
pub mod health;
pub mod metrics;
pub mod process;
pub mod statsd;
pub mod traces;
pub mod upstream;

pub use metrics::Metrics;
