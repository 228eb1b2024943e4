//! The gRPC edge: generated types, request validation and conversion, and the
//! service implementations.
//!
//! Architecture invariant: this is the only module that sees generated
//! protobuf types; everything deeper works on [`crate::decision`] types.

mod check;
mod convert;

pub use check::RateLimiterService;
pub use convert::{ValidationError, validate};

/// Generated code for `proto/ratelimit/v1/ratelimit.proto`.
#[allow(missing_docs, unreachable_pub, missing_debug_implementations, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("ratelimit.v1");

    /// Encoded `FileDescriptorSet` of the protos, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ratelimit_descriptor");
}
