//! Command-line interface: `serve`, `check` and `rules validate`.
//!
//! Exit codes follow sysexits where one fits: 0 success (for `check`: the
//! request is allowed), 1 denied / invalid rules, 64 usage or configuration
//! error, 69 the server is unavailable.

use std::{io::Write, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

use crate::api::pb;

/// Exit status for a bad command line or configuration (EX_USAGE).
pub const EXIT_USAGE: u8 = 64;
/// Exit status when the server cannot be reached (EX_UNAVAILABLE).
pub const EXIT_UNAVAILABLE: u8 = 69;

/// ratelimitd: a gRPC rate-limit decision service.
#[derive(Debug, Parser)]
#[command(name = "ratelimitd", version, about)]
pub struct Cli {
    /// YAML configuration file; environment variables RATELIMITD__SECTION__KEY override it.
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the service.
    Serve,
    /// Ask a running server for one decision and print it.
    Check(CheckArgs),
    /// Rule set operations.
    #[command(subcommand)]
    Rules(RulesCommand),
}

/// `ratelimitd rules …`
#[derive(Debug, Subcommand)]
pub enum RulesCommand {
    /// Load and validate rule files or directories; print every problem.
    Validate {
        /// Native rule files or directories.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
}

/// `ratelimitd check …`
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Server address.
    #[arg(long, default_value = "http://127.0.0.1:8081")]
    pub addr: String,
    /// user_id to count against.
    #[arg(long)]
    pub user: String,
    /// resource_path to match.
    #[arg(long)]
    pub path: String,
    /// client_type, e.g. ANDROID_MOBILE.
    #[arg(long)]
    pub client_type: Option<String>,
    /// Request weight (0 means 1).
    #[arg(long, default_value_t = 1)]
    pub weight: u32,
    /// CRITICAL, DEGRADED, BEST_EFFORT or BULK (default: the rule's).
    #[arg(long)]
    pub priority: Option<String>,
    /// A request header, NAME=VALUE; repeatable.
    #[arg(long = "header", short = 'H', value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
    /// Deadline of the call in ms.
    #[arg(long, default_value_t = 2_000)]
    pub timeout_ms: u64,
    /// Print one JSON object instead of aligned text.
    #[arg(long)]
    pub json: bool,
}

/// Runs `ratelimitd check`: 0 allowed, 1 denied, 64 bad arguments, 69 RPC failure.
pub async fn check(args: CheckArgs) -> ExitCode {
    let mut request = pb::RateLimitRequest {
        user_id: args.user,
        resource_path: args.path,
        client_type: args.client_type.unwrap_or_default(),
        weight: args.weight,
        ..Default::default()
    };
    if let Some(priority) = &args.priority {
        match pb::PriorityBucket::from_str_name(&priority.to_ascii_uppercase()) {
            Some(p) => request.priority = p as i32,
            None => {
                eprintln!("--priority {priority:?}: expected CRITICAL, DEGRADED, BEST_EFFORT or BULK");
                return ExitCode::from(EXIT_USAGE);
            }
        }
    }
    for header in &args.headers {
        let Some((name, value)) = header.split_once('=') else {
            eprintln!("--header {header:?}: expected NAME=VALUE");
            return ExitCode::from(EXIT_USAGE);
        };
        request.headers.insert(name.to_owned(), value.to_owned());
    }

    let endpoint = match tonic::transport::Endpoint::from_shared(args.addr.clone()) {
        Ok(e) => e.timeout(std::time::Duration::from_millis(args.timeout_ms)),
        Err(e) => {
            eprintln!("--addr {:?}: {e}", args.addr);
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let channel = match endpoint.connect().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot connect to {}: {e}", args.addr);
            return ExitCode::from(EXIT_UNAVAILABLE);
        }
    };
    let mut client = pb::rate_limiter_client::RateLimiterClient::new(channel);
    let response = match client.check(request).await {
        Ok(r) => r.into_inner(),
        Err(status) => {
            eprintln!("{}: {}", status.code(), status.message());
            return ExitCode::from(if status.code() == tonic::Code::InvalidArgument {
                EXIT_USAGE
            } else {
                EXIT_UNAVAILABLE
            });
        }
    };
    let reason = pb::Reason::try_from(response.reason).map_or("REASON_UNSPECIFIED", |r| r.as_str_name());
    let out = if args.json {
        serde_json::json!({
            "allowed": response.allowed,
            "reason": reason,
            "remaining_tokens": response.remaining_tokens,
            "retry_after_ms": response.retry_after_ms,
            "reset_after_ms": response.reset_after_ms,
            "rule_id": response.rule_id,
            "limit": response.limit,
            "capacity": response.capacity,
            "window_ms": response.window_ms,
            "shadow_denied": response.shadow_denied,
            "cluster_utilization_status": response.cluster_utilization_status,
        })
        .to_string()
            + "\n"
    } else {
        format!(
            "allowed         {}\nreason          {reason}\nremaining       {}\nretry_after_ms  {}\nreset_after_ms  {}\nrule_id         {}\nlimit           {} per {} ms (capacity {})\nshadow_denied   {}\nutilization     {}\n",
            response.allowed,
            response.remaining_tokens,
            response.retry_after_ms,
            response.reset_after_ms,
            if response.rule_id.is_empty() { "-" } else { &response.rule_id },
            response.limit,
            response.window_ms,
            response.capacity,
            response.shadow_denied,
            response.cluster_utilization_status,
        )
    };
    let _ = std::io::stdout().write_all(out.as_bytes());
    if response.allowed { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

/// Runs `ratelimitd rules validate`: 0 when every path loads, 1 otherwise.
pub fn validate_rules(paths: &[PathBuf]) -> ExitCode {
    let mut ok = true;
    let mut out = std::io::stdout().lock();
    for path in paths {
        match crate::rules::load(path) {
            Ok(snapshot) => {
                let _ = writeln!(
                    out,
                    "{}: ok, {} rules, version {}",
                    path.display(),
                    snapshot.rules().len(),
                    snapshot.version()
                );
            }
            Err(errors) => {
                ok = false;
                for error in &errors.0 {
                    eprintln!("{error}");
                }
                eprintln!("{}: {} problem(s)", path.display(), errors.0.len());
            }
        }
    }
    if ok { ExitCode::SUCCESS } else { ExitCode::from(1) }
}
