//! `ratelimitd audit`: failed-decision records from the dead-letter topic or
//! a file, filtered and summarised.

use std::{path::PathBuf, process::ExitCode};

use super::EXIT_USAGE;
use crate::{
    clock::{Clock, SystemClock},
    config::Config,
    dlq::audit::{self, Filter, Format, Printer},
};

/// `ratelimitd audit …`
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    /// Read this JSON-lines file (e.g. dlq.file) instead of the Kafka topic; `-`: standard
    /// input (e.g. `kubectl logs POD | ratelimitd audit --file -` where records go to standard
    /// error).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Only this user_id.
    #[arg(long)]
    pub user: Option<String>,
    /// Only this rule_id.
    #[arg(long)]
    pub rule: Option<String>,
    /// Only this failure kind (timeout, connection_refused, connection_lost, pool_exhausted, circuit_open, script_error, cluster_error, store_full, other).
    #[arg(long)]
    pub kind: Option<String>,
    /// Only records at or after: a duration ago (2h, 30m, 7d) or an RFC 3339 time.
    #[arg(long)]
    pub since: Option<String>,
    /// Only records before: a duration ago or an RFC 3339 time.
    #[arg(long)]
    pub until: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Runs `ratelimitd audit`: 0 on success (even with no match), 1 when the
/// source cannot be read, 64 on bad arguments.
pub fn run(args: AuditArgs, config: &Config) -> ExitCode {
    let now = SystemClock.now_ms();
    let when = |value: &Option<String>, flag: &str| -> Result<Option<u64>, ExitCode> {
        value.as_deref().map(|v| audit::parse_when(v, now)).transpose().map_err(|e| {
            eprintln!("{flag}: {e}");
            ExitCode::from(EXIT_USAGE)
        })
    };
    let (since_ms, until_ms) = match (when(&args.since, "--since"), when(&args.until, "--until")) {
        (Ok(since), Ok(until)) => (since, until),
        (Err(code), _) | (_, Err(code)) => return code,
    };
    let filter = Filter { user: args.user, rule: args.rule, kind: args.kind, since_ms, until_ms };
    let stdout = std::io::stdout().lock();
    let mut printer = Printer::new(std::io::BufWriter::new(stdout), args.format, filter);
    let read = match (&args.file, &config.dlq.kafka.brokers) {
        (Some(file), _) => audit::from_file(file, &mut printer),
        (None, Some(brokers)) => {
            audit::from_kafka(brokers, &config.dlq.kafka.topic, &config.dlq.kafka.properties, &mut printer)
        }
        (None, None) => {
            eprintln!(
                "audit: no source: pass --file (e.g. {}) or configure dlq.kafka.brokers",
                config.dlq.file.display()
            );
            return ExitCode::from(EXIT_USAGE);
        }
    };
    if let Err(e) = read {
        eprintln!("audit: {e}");
        return ExitCode::from(1);
    }
    match printer.finish(&mut std::io::stderr()) {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("audit: {e}");
            ExitCode::from(1)
        }
    }
}
