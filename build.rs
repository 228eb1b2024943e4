//! Compiles the gRPC protos — ours (`proto/ratelimit/v1`) and Envoy's rate
//! limit service with its imports (`proto/vendor`, untouched) — with the
//! protoc shipped inside the `protoc-bin-vendored` crate, so a fresh machine
//! needs no system protoc. Writes descriptor sets for server reflection.

use std::{env, path::PathBuf};

/// Every vendored file: Envoy's RLS and RLQS and what they import
/// (transitively).
const ENVOY_PROTOS: &[&str] = &[
    "proto/vendor/envoy/service/ratelimit/v3/rls.proto",
    "proto/vendor/envoy/service/rate_limit_quota/v3/rlqs.proto",
    "proto/vendor/envoy/type/v3/ratelimit_strategy.proto",
    "proto/vendor/envoy/extensions/common/ratelimit/v3/ratelimit.proto",
    "proto/vendor/envoy/config/core/v3/base.proto",
    "proto/vendor/envoy/config/core/v3/address.proto",
    "proto/vendor/envoy/config/core/v3/backoff.proto",
    "proto/vendor/envoy/config/core/v3/extension.proto",
    "proto/vendor/envoy/config/core/v3/http_uri.proto",
    "proto/vendor/envoy/config/core/v3/socket_option.proto",
    "proto/vendor/envoy/type/v3/percent.proto",
    "proto/vendor/envoy/type/v3/ratelimit_unit.proto",
    "proto/vendor/envoy/type/v3/semantic_version.proto",
    "proto/vendor/envoy/type/v3/token_bucket.proto",
    "proto/vendor/envoy/annotations/deprecation.proto",
    "proto/vendor/udpa/annotations/migrate.proto",
    "proto/vendor/udpa/annotations/status.proto",
    "proto/vendor/udpa/annotations/versioning.proto",
    "proto/vendor/validate/validate.proto",
    "proto/vendor/xds/annotations/v3/status.proto",
    "proto/vendor/xds/core/v3/context_params.proto",
];

/// Kuadrant's rate limit service (`CheckRateLimit`, `Report`), ours, over
/// Envoy's messages.
const KUADRANT_PROTO: &str = "proto/kuadrant/service/ratelimit/v1/ratelimit.proto";

/// The rate-limit configuration over xDS (`rules.source: xds`): the
/// aggregated discovery service and envoyproxy/ratelimit's
/// `RateLimitConfig`. Their imports are the files above, generated there.
const XDS_PROTOS: &[&str] = &[
    "proto/vendor/envoy/service/discovery/v3/ads.proto",
    "proto/vendor/envoy/service/discovery/v3/discovery.proto",
    "proto/vendor/google/rpc/status.proto",
    "proto/vendor/ratelimit/config/ratelimit/v3/rls_conf.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let well_known = protoc_bin_vendored::include_path()?;
    let well_known = well_known.to_str().ok_or("non-UTF-8 protoc include path")?;

    // Hand the vendored protoc to prost-build directly rather than through the
    // PROTOC environment variable (`set_var` is unsafe in edition 2024).
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::api::lenient::LenientCodec")
        .file_descriptor_set_path(out_dir.join("ratelimit_descriptor.bin"))
        .compile_with_config(config, &["proto/ratelimit/v1/ratelimit.proto"], &["proto", well_known])?;

    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(&protoc);
    // Both services decode through our lenient codec: a request whose
    // strings are not UTF-8 is counted, not refused (src/api/lenient.rs).
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::api::lenient::LenientCodec")
        .file_descriptor_set_path(out_dir.join("envoy_descriptor.bin"))
        .compile_with_config(config, ENVOY_PROTOS, &["proto/vendor", well_known])?;

    // Kuadrant's service over Envoy's messages: its own directory (only its
    // package's file is used; the Envoy packages are those above) and its
    // own descriptor set, reflected only where it is served.
    let kuadrant_dir = out_dir.join("kuadrant");
    std::fs::create_dir_all(&kuadrant_dir)?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .codec_path("crate::api::lenient::LenientCodec")
        .out_dir(&kuadrant_dir)
        .file_descriptor_set_path(out_dir.join("kuadrant_descriptor.bin"))
        .compile_with_config(config, &[KUADRANT_PROTO], &["proto/vendor", "proto", well_known])?;

    // A client of a management server (and, for the tests, a server): the
    // plain prost codec, and no reflection of a service not served.
    // Its own directory: it also writes the imported packages, with only
    // the messages these files use, which must not replace the full ones.
    let xds_dir = out_dir.join("xds");
    std::fs::create_dir_all(&xds_dir)?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(&protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .out_dir(&xds_dir)
        .compile_with_config(config, XDS_PROTOS, &["proto/vendor", well_known])?;

    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
