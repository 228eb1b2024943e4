//! The `ratelimitd` binary: the allocator, and the command line
//! ([`ratelimitd::cli`]), which loads and validates the configuration
//! before anything binds and runs the chosen command.

#![forbid(unsafe_code)]

/// mimalloc instead of glibc's malloc: the gRPC stack allocates and frees
/// per request across worker threads, where glibc's arenas contend (see
/// docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    ratelimitd::cli::main()
}
