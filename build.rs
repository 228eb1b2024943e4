//! Compiles the gRPC protos with the `protoc` shipped inside the
//! `protoc-bin-vendored` crate, so a fresh machine needs no system protoc.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // Hand the vendored protoc to prost-build directly rather than through the
    // PROTOC environment variable (`set_var` is unsafe in edition 2024).
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .file_descriptor_set_path(out_dir.join("ratelimit_descriptor.bin"))
        .compile_with_config(config, &["proto/ratelimit/v1/ratelimit.proto"], &["proto"])?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
