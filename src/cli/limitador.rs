//! The binary invoked as `limitador-server` (by its file name, as
//! Kuadrant's limitador-operator runs its image's command): limitador's
//! command line, as the operator generates it,
//!
//! ```text
//! limitador-server [--rate-limit-headers DRAFT_VERSION_03] [--limit-name-in-labels]
//!     [--tracing-endpoint rpc://host:4317] [-v…] --http-port 8080 --rls-port 8081
//!     /home/limitador/etc/limitador-config.yaml
//!     memory | redis <URL> | redis_cached <URL> [--batch-size N …] | disk <PATH>
//! ```
//!
//! read into limitador's own environment variables (the command line
//! winning, as in limitador) and served in limitador compat mode
//! (`RATELIMITD_COMPAT=limitador`, `config::compat::limitador`): one
//! translation for both. `--validate` checks the limits file and exits.

use std::{collections::HashMap, path::PathBuf, process::ExitCode};

use clap::Parser as _;

use super::{EXIT_USAGE, fatal, serve, with_config_from};
use crate::config::compat::{COMPAT_VAR, LIMITADOR};

/// The name limitador's binary has in its image.
pub(super) const NAME: &str = "limitador-server";

/// limitador-server's command line.
#[derive(Debug, clap::Parser)]
#[command(
    name = "limitador-server",
    about = "ratelimitd serving Kuadrant limitador's limits (limitador's command line)",
    disable_help_subcommand = true,
    subcommand_value_name = "STORAGE"
)]
struct Args {
    /// The limits file (LIMITS_FILE).
    #[arg(value_name = "LIMITS_FILE")]
    limits_file: Option<PathBuf>,
    /// The gRPC listener's address (ENVOY_RLS_HOST).
    #[arg(short = 'b', long = "rls-ip")]
    rls_ip: Option<String>,
    /// The gRPC listener's port (ENVOY_RLS_PORT).
    #[arg(short = 'p', long = "rls-port")]
    rls_port: Option<u16>,
    /// The HTTP listener's address (HTTP_API_HOST).
    #[arg(short = 'B', long = "http-ip")]
    http_ip: Option<String>,
    /// The HTTP listener's port (HTTP_API_PORT).
    #[arg(short = 'P', long = "http-port")]
    http_port: Option<u16>,
    /// `limited_calls` by limit name too (LIMIT_NAME_IN_PROMETHEUS_LABELS).
    #[arg(short = 'l', long = "limit-name-in-labels")]
    limit_name_in_labels: bool,
    /// limitador's custom metric labels: no effect.
    #[arg(short = 'L', long = "custom-metric-labels")]
    custom_metric_labels: Option<String>,
    /// limitador's default metric labels: no effect.
    #[arg(long = "metric-labels-default")]
    metric_labels_default: Option<String>,
    /// OTLP/gRPC collector, `rpc://host:4317` (TRACING_ENDPOINT).
    #[arg(long = "tracing-endpoint")]
    tracing_endpoint: Option<String>,
    /// Verbosity: none or -v warnings, -vv info, -vvv debug, -vvvv trace.
    #[arg(short = 'v', action = clap::ArgAction::Count)]
    verbosity: u8,
    /// JSON log lines.
    #[arg(short = 'S', long = "structured-logs")]
    structured_logs: bool,
    /// Check the limits file and exit (0: valid).
    #[arg(long)]
    validate: bool,
    /// NONE or DRAFT_VERSION_03 (RATE_LIMIT_HEADERS).
    #[arg(short = 'H', long = "rate-limit-headers")]
    rate_limit_headers: Option<String>,
    /// gRPC reflection: always served here.
    #[arg(long = "grpc-reflection-service")]
    grpc_reflection_service: bool,
    /// Where counters live.
    #[command(subcommand)]
    storage: Option<Storage>,
}

/// limitador's storages.
#[derive(Debug, clap::Subcommand)]
enum Storage {
    /// Counters in this instance's memory.
    Memory {
        /// limitador's cache size: no effect.
        #[arg(short = 'c', long = "cache")]
        cache: Option<u64>,
    },
    /// Counters in Redis (REDIS_URL).
    Redis {
        /// `redis://host:port`.
        url: String,
    },
    /// limitador's Redis with a local cache: counted exactly in Redis here.
    #[command(name = "redis_cached")]
    RedisCached {
        /// `redis://host:port`.
        url: String,
        /// No effect.
        #[arg(long = "batch-size")]
        batch_size: Option<u64>,
        /// No effect.
        #[arg(long = "flush-period")]
        flush_period: Option<i64>,
        /// No effect.
        #[arg(long = "max-cached")]
        max_cached: Option<u64>,
        /// No effect.
        #[arg(long = "response-timeout")]
        response_timeout: Option<u64>,
    },
    /// limitador's disk storage: refused.
    Disk {
        /// The counters' database.
        path: PathBuf,
        /// No effect.
        #[arg(long = "optimize")]
        optimize: Option<String>,
    },
}

/// Runs limitador-server's command line `argv` with the environment `env`.
pub(super) fn main(argv: Vec<std::ffi::OsString>, env: HashMap<String, String>) -> ExitCode {
    let args = match Args::try_parse_from(argv) {
        Ok(args) => args,
        Err(e) => {
            let code = if e.use_stderr() { EXIT_USAGE } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let validate = args.validate;
    let env = environment(args, env);
    if validate {
        return self::validate(&env);
    }
    with_config_from(None, env, serve::run)
}

/// `env` with the command line's settings as limitador's variables (the
/// command line wins), limitador compat mode on unless a mode is named.
fn environment(args: Args, mut env: HashMap<String, String>) -> HashMap<String, String> {
    let mut set = |name: &str, value: String| {
        env.insert(name.to_owned(), value);
    };
    if let Some(file) = args.limits_file {
        set("LIMITS_FILE", file.display().to_string());
    }
    let given = [
        ("ENVOY_RLS_HOST", args.rls_ip),
        ("ENVOY_RLS_PORT", args.rls_port.map(|p| p.to_string())),
        ("HTTP_API_HOST", args.http_ip),
        ("HTTP_API_PORT", args.http_port.map(|p| p.to_string())),
        ("TRACING_ENDPOINT", args.tracing_endpoint),
        ("RATE_LIMIT_HEADERS", args.rate_limit_headers),
        ("--custom-metric-labels", args.custom_metric_labels),
        ("--metric-labels-default", args.metric_labels_default),
    ];
    for (name, value) in given {
        if let Some(value) = value {
            set(name, value);
        }
    }
    if args.limit_name_in_labels {
        set("LIMIT_NAME_IN_PROMETHEUS_LABELS", "1".to_owned());
    }
    if args.grpc_reflection_service {
        set("--grpc-reflection-service", "true".to_owned());
    }
    storage(args.storage, &mut env);
    let level = match args.verbosity {
        0 | 1 => "warn",
        2 => "info",
        3 => "ratelimitd=debug,info",
        _ => "ratelimitd=trace,info",
    };
    env.entry("RATELIMITD__LOG__LEVEL".to_owned()).or_insert_with(|| level.to_owned());
    if args.structured_logs {
        env.entry("RATELIMITD__LOG__FORMAT".to_owned()).or_insert_with(|| "json".to_owned());
    }
    env.entry(COMPAT_VAR.to_owned()).or_insert_with(|| LIMITADOR.to_owned());
    env
}

/// limitador's storage subcommand as its variables: `memory` drops
/// `REDIS_URL`; options without an equivalent are noted at start.
fn storage(storage: Option<Storage>, env: &mut HashMap<String, String>) {
    let text = |v: Option<String>| v.unwrap_or_default();
    let number = |v: Option<u64>| v.map(|n| n.to_string()).unwrap_or_default();
    match storage {
        Some(Storage::Memory { cache }) => {
            env.remove("REDIS_URL");
            env.insert("--cache".to_owned(), number(cache));
        }
        Some(Storage::Redis { url }) => {
            env.insert("REDIS_URL".to_owned(), url);
        }
        Some(Storage::RedisCached { url, batch_size, flush_period, max_cached, response_timeout }) => {
            env.extend([
                ("REDIS_URL".to_owned(), url),
                ("REDIS_LOCAL_CACHE_ENABLED".to_owned(), "true".to_owned()),
                ("REDIS_LOCAL_CACHE_BATCH_SIZE".to_owned(), number(batch_size)),
                (
                    "REDIS_LOCAL_CACHE_FLUSHING_PERIOD_MS".to_owned(),
                    text(flush_period.map(|n| n.to_string())),
                ),
                ("--max-cached".to_owned(), number(max_cached)),
                ("--response-timeout".to_owned(), number(response_timeout)),
            ]);
        }
        Some(Storage::Disk { path, optimize }) => {
            env.insert("DISK_PATH".to_owned(), path.display().to_string());
            env.insert("DISK_OPTIMIZE".to_owned(), text(optimize));
        }
        None => {}
    }
}

/// `--validate`: the limits file compiles (0), or its errors (1); a
/// configuration that does not load is a usage error (64).
fn validate(env: &HashMap<String, String>) -> ExitCode {
    let config = match crate::config::Config::load(None, env.clone()) {
        Ok(config) => config,
        Err(e) => {
            fatal(&e.to_string());
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let Some(path) = config.rules.limitador_path else {
        fatal("no limits file");
        return ExitCode::from(EXIT_USAGE);
    };
    match crate::rules::limitador::Limits::load(&path, config.rules.limitador_algorithm) {
        Ok(limits) => {
            #[allow(clippy::print_stdout)]
            {
                let (size, version) =
                    (crate::rules::Versioned::size(&limits), crate::rules::Versioned::version(&limits));
                println!("ok, {size} limits, version {version}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            fatal(&e.to_string());
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(argv: &[&str]) -> HashMap<String, String> {
        let args = Args::try_parse_from(std::iter::once(NAME).chain(argv.iter().copied())).unwrap();
        environment(args, HashMap::from([("REDIS_URL".to_owned(), "redis://from-env:6379".to_owned())]))
    }

    /// The command lines Kuadrant's limitador-operator generates.
    #[test]
    fn the_operators_command_lines_read_as_limitadors_variables() {
        let env = parsed(&[
            "--rate-limit-headers",
            "DRAFT_VERSION_03",
            "-vvv",
            "--http-port",
            "8080",
            "--rls-port",
            "8081",
            "/home/limitador/etc/limitador-config.yaml",
            "redis",
            "redis://redis.kuadrant:6379",
        ]);
        assert_eq!(env["LIMITS_FILE"], "/home/limitador/etc/limitador-config.yaml");
        assert_eq!(env["REDIS_URL"], "redis://redis.kuadrant:6379", "the command line wins");
        assert_eq!((env["HTTP_API_PORT"].as_str(), env["ENVOY_RLS_PORT"].as_str()), ("8080", "8081"));
        assert_eq!(env["RATE_LIMIT_HEADERS"], "DRAFT_VERSION_03");
        assert_eq!(env["RATELIMITD__LOG__LEVEL"], "ratelimitd=debug,info");
        assert_eq!(env[COMPAT_VAR], LIMITADOR);
        let config = crate::config::Config::load(None, env).unwrap();
        assert_eq!(
            config.rules.limitador_path.unwrap().to_str(),
            Some("/home/limitador/etc/limitador-config.yaml")
        );
        assert_eq!(config.grpc.listen, "0.0.0.0:8081");
        assert_eq!(config.redis.connection.url.as_deref(), Some("redis://redis.kuadrant:6379"));
        assert!(config.envoy.response_headers);
        assert_eq!(config.envoy.remaining_header, "X-RateLimit-Remaining");
        assert_eq!(
            config.rules.limitador_algorithm,
            crate::limiter::Algorithm::FirstHitWindow,
            "limitador's counting"
        );
        let mut sliding = parsed(&["/etc/limits.yaml", "memory"]);
        sliding.insert("RATELIMITD__RULES__LIMITADOR_ALGORITHM".to_owned(), "sliding_window".to_owned());
        let config = crate::config::Config::load(None, sliding.clone()).unwrap();
        assert_eq!(config.rules.limitador_algorithm, crate::limiter::Algorithm::SlidingWindow);
        sliding.insert("RATELIMITD__RULES__LIMITADOR_ALGORITHM".to_owned(), "leaky".to_owned());
        let error = crate::config::Config::load(None, sliding).unwrap_err().to_string();
        assert!(error.contains("limitador_algorithm") && error.contains("first_hit_window"), "{error}");

        let env = parsed(&["--http-port", "8080", "--rls-port", "8081", "/etc/limits.yaml", "memory"]);
        assert!(!env.contains_key("REDIS_URL"), "memory: no Redis");
        let env = parsed(&["/etc/limits.yaml", "redis_cached", "redis://r:6379", "--flush-period", "100"]);
        let compat = crate::config::Config::load(None, env).unwrap().compat;
        assert!(compat.ignored.iter().any(|(name, _)| *name == "REDIS_LOCAL_CACHE_ENABLED"), "{compat:?}");
        let error = crate::config::Config::load(None, parsed(&["/etc/limits.yaml", "disk", "/var/db"]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("DISK_PATH"), "{error}");
    }
}
