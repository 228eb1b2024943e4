//! Observability: Prometheus metrics ([`metrics`]), the HTTP endpoints
//! `/metrics`, `/healthz` and `/readyz` and the health monitor that also
//! drives gRPC health ([`health`]).

pub mod health;
pub mod metrics;

pub use metrics::{Api, Metrics};
