//! The gRPC edge: generated types, request validation and conversion, and the
//! service implementations.
//!
//! Architecture invariant: this is the only module that sees generated
//! protobuf types; everything deeper works on [`crate::decision`] types.

mod check;
pub mod client;
mod convert;
mod eager;
mod envoy;
pub mod envoy_settings;
mod kuadrant;
pub mod lenient;
pub mod limitador_http;
pub mod ratelimit_headers;
pub mod rlqs;
mod wire;
pub mod xds;

/// gRPC paths of the calls whose request size is bounded apart: the
/// single-decision calls (denied when oversized) and the batch.
pub mod paths {
    /// `ratelimit.v1.RateLimiter/Check`.
    pub const CHECK: &str = "/ratelimit.v1.RateLimiter/Check";
    /// `ratelimit.v1.RateLimiter/Report`.
    pub const REPORT: &str = "/ratelimit.v1.RateLimiter/Report";
    /// `ratelimit.v1.RateLimiter/CheckBatch`.
    pub const CHECK_BATCH: &str = "/ratelimit.v1.RateLimiter/CheckBatch";
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
    pub const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";
    /// Kuadrant's check (limitador).
    pub const CHECK_RATE_LIMIT: &str = "/kuadrant.service.ratelimit.v1.RateLimitService/CheckRateLimit";
    /// Kuadrant's report (limitador).
    pub const KUADRANT_REPORT: &str = "/kuadrant.service.ratelimit.v1.RateLimitService/Report";
}

pub use check::{MAX_BATCH_ITEMS, RateLimiterService, STREAM_IN_FLIGHT};

/// Encoded `FileDescriptorSet` of the native API, for server reflection:
/// bytes, so the server wires reflection without naming a generated type.
pub const CHECK_DESCRIPTOR_SET: &[u8] = pb::FILE_DESCRIPTOR_SET;
/// Encoded `FileDescriptorSet` of Envoy's rate limit service, for server
/// reflection when that service is served.
pub const ENVOY_DESCRIPTOR_SET: &[u8] = envoy_pb::FILE_DESCRIPTOR_SET;

/// Kuadrant's service (served with limitador's limits), for reflection.
pub const KUADRANT_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("kuadrant_descriptor");
pub use convert::{ValidationError, validate};
pub use envoy::EnvoyService;

/// Generated code for `proto/ratelimit/v1/ratelimit.proto`.
#[allow(missing_docs, unreachable_pub, missing_debug_implementations, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("ratelimit.v1");

    /// Encoded `FileDescriptorSet` of the protos, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ratelimit_descriptor");
}

/// Generated code for Envoy's rate limit service (`proto/vendor`), mounted
/// with the package nesting the generated cross-references expect.
#[allow(missing_docs, unreachable_pub, missing_debug_implementations, clippy::all, clippy::pedantic)]
pub mod envoy_pb {
    pub mod envoy {
        pub mod service {
            pub mod ratelimit {
                pub mod v3 {
                    tonic::include_proto!("envoy.service.ratelimit.v3");
                }
            }
            pub mod rate_limit_quota {
                pub mod v3 {
                    tonic::include_proto!("envoy.service.rate_limit_quota.v3");
                }
            }
            pub mod discovery {
                pub mod v3 {
                    include!(concat!(env!("OUT_DIR"), "/xds/envoy.service.discovery.v3.rs"));
                }
            }
        }
        pub mod extensions {
            pub mod common {
                pub mod ratelimit {
                    pub mod v3 {
                        tonic::include_proto!("envoy.extensions.common.ratelimit.v3");
                    }
                }
            }
        }
        pub mod config {
            pub mod core {
                pub mod v3 {
                    tonic::include_proto!("envoy.config.core.v3");
                }
            }
        }
        pub mod r#type {
            pub mod v3 {
                tonic::include_proto!("envoy.r#type.v3");
            }
        }
    }

    pub mod xds {
        pub mod core {
            pub mod v3 {
                tonic::include_proto!("xds.core.v3");
            }
        }
    }

    /// Encoded `FileDescriptorSet` of the Envoy protos, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("envoy_descriptor");

    pub use envoy::service::ratelimit::v3 as rls;

    /// Envoy's Rate Limit Quota Service.
    pub use envoy::service::rate_limit_quota::v3 as rlqs;

    /// Kuadrant's rate limit service (limitador's `CheckRateLimit`, `Report`).
    pub mod kuadrant {
        pub mod service {
            pub mod ratelimit {
                pub mod v1 {
                    include!(concat!(env!("OUT_DIR"), "/kuadrant/kuadrant.service.ratelimit.v1.rs"));
                }
            }
        }
    }

    /// The aggregated discovery service (`rules.source: xds`).
    pub mod discovery {
        pub use super::envoy::service::discovery::v3::*;
    }

    /// envoyproxy/ratelimit's `RateLimitConfig`, the xDS resource.
    pub use ratelimit::config::ratelimit::v3 as rls_config;

    pub mod google {
        pub mod rpc {
            include!(concat!(env!("OUT_DIR"), "/xds/google.rpc.rs"));
        }
    }

    pub mod ratelimit {
        pub mod config {
            pub mod ratelimit {
                pub mod v3 {
                    include!(concat!(env!("OUT_DIR"), "/xds/ratelimit.config.ratelimit.v3.rs"));
                }
            }
        }
    }
}
