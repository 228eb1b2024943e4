//! `ratelimitd check`: one decision from a running server, printed.

use std::{io::Write as _, process::ExitCode};

use super::{EXIT_UNAVAILABLE, EXIT_USAGE};
use crate::{
    api::client::{self, CallError, CheckAnswer, CheckCall},
    shed::Priority,
};

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
    /// Check without counting (`peek`): would this request pass now?
    #[arg(long, conflicts_with = "report")]
    pub peek: bool,
    /// Send a `Report` instead: count `--weight` of usage whatever is left;
    /// the answer is about the next request.
    #[arg(long)]
    pub report: bool,
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
pub async fn run(args: CheckArgs) -> ExitCode {
    let call = match check_call(&args) {
        Ok(call) => call,
        Err(usage) => {
            eprintln!("{usage}");
            return ExitCode::from(EXIT_USAGE);
        }
    };
    let timeout = std::time::Duration::from_millis(args.timeout_ms);
    let answer = match client::check(&args.addr, timeout, call).await {
        Ok(answer) => answer,
        Err(error) => {
            let (message, code) = match error {
                CallError::Address(e) => (format!("--addr {:?}: {e}", args.addr), EXIT_USAGE),
                CallError::Connect(e) => (format!("cannot connect to {}: {e}", args.addr), EXIT_UNAVAILABLE),
                CallError::InvalidArgument(e) => (e, EXIT_USAGE),
                CallError::Rpc(e) => (e, EXIT_UNAVAILABLE),
            };
            eprintln!("{message}");
            return ExitCode::from(code);
        }
    };
    let out = if args.json {
        serde_json::to_string(&answer).unwrap_or_default() + "\n"
    } else {
        check_text(&answer)
    };
    let _ = std::io::stdout().write_all(out.as_bytes());
    if answer.allowed { ExitCode::SUCCESS } else { ExitCode::from(1) }
}

/// The call `check`'s arguments ask for, or what is wrong with them.
fn check_call(args: &CheckArgs) -> Result<CheckCall, String> {
    let mut call = CheckCall {
        user_id: args.user.clone(),
        resource_path: args.path.clone(),
        client_type: args.client_type.clone(),
        weight: args.weight,
        peek: args.peek,
        report: args.report,
        ..CheckCall::default()
    };
    if let Some(priority) = &args.priority {
        call.priority = Some(Priority::parse(priority).ok_or_else(|| {
            format!("--priority {priority:?}: expected CRITICAL, DEGRADED, BEST_EFFORT or BULK")
        })?);
    }
    for header in &args.headers {
        let (name, value) =
            header.split_once('=').ok_or_else(|| format!("--header {header:?}: expected NAME=VALUE"))?;
        call.headers.insert(name.to_owned(), value.to_owned());
    }
    Ok(call)
}

/// `check`'s answer as aligned text.
fn check_text(answer: &CheckAnswer) -> String {
    let mut text = format!(
        "allowed         {}\nreason          {}\nremaining       {}\nretry_after_ms  {}\nreset_after_ms  {}\nrule_id         {}\nlimit           {} per {} ms (capacity {})\nshadow_denied   {}\nutilization     {}\n",
        answer.allowed,
        answer.reason,
        answer.remaining_tokens,
        answer.retry_after_ms,
        answer.reset_after_ms,
        if answer.rule_id.is_empty() { "-" } else { &answer.rule_id },
        answer.limit,
        answer.window_ms,
        answer.capacity,
        answer.shadow_denied,
        answer.cluster_utilization_status,
    );
    if !answer.store_error.is_empty() {
        text += &format!("store_error     {} (not decided by the shared store)\n", answer.store_error);
    }
    text
}
