//! Command-line interface: `serve`, `check`, `rules …` (`rules.rs`: the
//! rules topic's commands, and `admin`, the console on top of them),
//! `replay`, `migrate`, `audit`, `probe`.
//!
//! Exit codes follow sysexits where one fits: 0 success (for `check`: the
//! request is allowed), 1 denied / invalid rules, 64 usage or configuration
//! error, 69 the server is unavailable.

use std::{io::Write, path::PathBuf, process::ExitCode};

use clap::{Parser, Subcommand};

mod rules;

pub use rules::{admin, history, keygen, publish, rollback, status, sync};

use crate::{
    api::client::{self, CallError, CheckAnswer, CheckCall},
    clock::{Clock, SystemClock},
    config::Config,
    dlq::audit::{self, Filter, Format, Printer},
    migrate::{self, Applied},
    shed::Priority,
};

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
    /// Apply the numbered setup steps (Kafka topic, Redis key schema); idempotent.
    Migrate,
    /// Read failed-decision records from the dead-letter topic (or a file), filter and summarise.
    Audit(AuditArgs),
    /// Replay captured requests through the rules in force and a candidate; gate on CRITICAL denials.
    Replay(ReplayArgs),
    /// The overload layer's cluster-wide switch (in Redis): every instance
    /// follows within two `overload.report_interval_ms`.
    Overload {
        /// `enforce`, `shadow` or `off` sets the switch; `clear` removes it
        /// (each instance's tenant table or `overload.mode` decides again);
        /// none prints it.
        #[arg(value_parser = ["enforce", "shadow", "off", "clear"])]
        mode: Option<String>,
    },
    /// Run the admin console (admin.*): edit rules in their Git repository,
    /// review them against the rules in force and a capture, publish
    /// through the rules topic (rules.kafka.*).
    Admin(AdminArgs),
    /// GET a health endpoint of a running service; exit 0 on HTTP 200 (for container HEALTHCHECKs).
    Probe {
        /// host:port of the HTTP listener (http.listen).
        #[arg(long, default_value = "127.0.0.1:8080")]
        addr: String,
        /// /healthz (alive) or /readyz (ready).
        #[arg(long, default_value = "/healthz")]
        path: String,
    },
}

/// `ratelimitd admin …`
#[derive(Debug, clap::Args)]
pub struct AdminArgs {
    /// How the console's publications are signed.
    #[command(flatten)]
    pub signing: SigningArgs,
}

/// `ratelimitd audit …`
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    /// Read this JSON-lines file (e.g. dlq.file) instead of the Kafka topic.
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

/// `ratelimitd rules …`
#[derive(Debug, Subcommand)]
pub enum RulesCommand {
    /// Load and validate rule files or directories; print every problem.
    Validate {
        /// Rule files or directories.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// The paths are envoyproxy/ratelimit configurations (rules.envoy_path), not native rules.
        #[arg(long)]
        envoy: bool,
    },
    /// Validate, compile and publish a rule set to the rules topic (rules.kafka.*).
    Publish(PublishArgs),
    /// Publish the rules a Git repository's commit (default HEAD) holds
    /// when they differ from the version in force, with that commit as the
    /// record's provenance: the repository is the source of truth, however
    /// a change reached it. Paths are inside the repository.
    Sync(SyncArgs),
    /// Publish an earlier version again (see `rules history`).
    Rollback {
        /// The version to put back in force.
        version: String,
        #[command(flatten)]
        signing: SigningArgs,
    },
    /// What a candidate rule set (native, `--envoy`, or both) changes
    /// against the rules in force (or `--from`, `--from-envoy`): rules and
    /// limits added, removed and each changed field, and with `--capture`
    /// how many captured requests each change touches.
    Diff(DiffArgs),
    /// Make a publisher's Ed25519 key pair: the private key goes to a new
    /// file (mode 0600), the public key (for rules.kafka.verify_keys) to stdout.
    Keygen {
        /// The private key's file; it must not exist.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
    /// List the snapshots on the rules topic, oldest first; the last valid one is in force.
    History,
    /// List the version every instance serves (from rules.kafka.status_topic);
    /// exit 0 when all serve the version in force, 1 otherwise.
    Status,
}

/// `ratelimitd rules publish …`
#[derive(Debug, clap::Args)]
pub struct PublishArgs {
    /// Native rules: a YAML file or a directory of them.
    #[arg(required_unless_present = "envoy")]
    pub path: Option<PathBuf>,
    /// envoyproxy/ratelimit configuration: a file or a directory, one domain per file.
    #[arg(long, value_name = "PATH")]
    pub envoy: Option<PathBuf>,
    /// Replay this capture (a JSON-lines file) through the rules in force and
    /// the candidate first; refuse to publish a candidate that fails the gate.
    #[arg(long, value_name = "CAPTURE")]
    pub gate: Option<PathBuf>,
    #[command(flatten)]
    pub thresholds: GateArgs,
    #[command(flatten)]
    pub signing: SigningArgs,
}

/// `ratelimitd rules sync …`
#[derive(Debug, clap::Args)]
pub struct SyncArgs {
    /// The Git repository: a work tree (its uncommitted changes are not
    /// published) or a bare repository.
    #[arg(long, value_name = "DIR")]
    pub repo: PathBuf,
    /// The commit to publish.
    #[arg(long, value_name = "REV", default_value = "HEAD")]
    pub rev: String,
    /// What to publish, as `rules publish` takes it, with paths inside the
    /// repository.
    #[command(flatten)]
    pub publish: PublishArgs,
}

/// The gate's thresholds, each overriding its `gate.*` setting.
#[derive(Debug, Clone, clap::Args)]
pub struct GateArgs {
    /// The largest share of the CRITICAL requests allowed by the rules in
    /// force that the candidate may deny (0.05 = 5%); default gate.max_critical_drop.
    #[arg(long, value_name = "SHARE")]
    pub max_critical_drop: Option<f64>,
    /// The same within one rule; default gate.max_critical_drop_per_rule.
    #[arg(long, value_name = "SHARE")]
    pub max_critical_drop_per_rule: Option<f64>,
    /// The same within one path; default gate.max_critical_drop_per_path.
    #[arg(long, value_name = "SHARE")]
    pub max_critical_drop_per_path: Option<f64>,
    /// Judge a rule or path from this many CRITICAL requests; default gate.min_group_requests.
    #[arg(long, value_name = "N")]
    pub min_group_requests: Option<u64>,
    /// Fail on a capture of fewer requests; default gate.min_capture_requests.
    #[arg(long, value_name = "N")]
    pub min_capture_requests: Option<u64>,
}

impl GateArgs {
    /// `configured` with these overrides; an error names the flag.
    fn thresholds(
        &self,
        configured: crate::rules::gate::GateThresholds,
    ) -> Result<crate::rules::gate::GateThresholds, ExitCode> {
        let t = crate::rules::gate::GateThresholds {
            max_critical_drop: self.max_critical_drop.unwrap_or(configured.max_critical_drop),
            max_critical_drop_per_rule: self
                .max_critical_drop_per_rule
                .unwrap_or(configured.max_critical_drop_per_rule),
            max_critical_drop_per_path: self
                .max_critical_drop_per_path
                .unwrap_or(configured.max_critical_drop_per_path),
            min_group_requests: self.min_group_requests.unwrap_or(configured.min_group_requests),
            min_capture_requests: self.min_capture_requests.unwrap_or(configured.min_capture_requests),
        };
        match t.invalid() {
            None => Ok(t),
            Some((key, why)) => {
                let flag = key.trim_start_matches("gate.").replace('_', "-");
                eprintln!("--{flag}: {why}");
                Err(ExitCode::from(EXIT_USAGE))
            }
        }
    }
}

/// `ratelimitd rules diff …`
#[derive(Debug, clap::Args)]
pub struct DiffArgs {
    /// The candidate native rules: a YAML file or a directory.
    #[arg(required_unless_present = "envoy")]
    pub rules: Option<PathBuf>,
    /// The candidate envoyproxy/ratelimit configuration: a file or a directory.
    #[arg(long, value_name = "PATH")]
    pub envoy: Option<PathBuf>,
    /// The native rules to compare with. Default: the record in force on
    /// the rules topic (rules.source: kafka), else rules.path, else the
    /// embedded rules.
    #[arg(long, value_name = "PATH")]
    pub from: Option<PathBuf>,
    /// The Envoy configuration to compare with. Default: the record in force
    /// on the rules topic (rules.source: kafka), else rules.envoy_path, else none.
    #[arg(long, value_name = "PATH")]
    pub from_envoy: Option<PathBuf>,
    /// A capture (a JSON-lines file, capture.file): count the requests each
    /// change touches.
    #[arg(long, value_name = "FILE")]
    pub capture: Option<PathBuf>,
}

/// How a published record is signed.
#[derive(Debug, Clone, clap::Args)]
pub struct SigningArgs {
    /// The publisher's private key file (`rules keygen`); default
    /// rules.kafka.signing_key_file.
    #[arg(long, value_name = "FILE", conflicts_with = "unsigned")]
    pub signing_key: Option<PathBuf>,
    /// Publish without a signature: only instances with
    /// rules.kafka.allow_unsigned serve it.
    #[arg(long)]
    pub unsigned: bool,
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
pub async fn check(args: CheckArgs) -> ExitCode {
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

/// Runs `ratelimitd rules validate`: 0 when every path loads, 1 otherwise.
/// It reads no configuration, so paths are compared in the default form
/// (`rules.path_matching` off); `serve` checks again in its own.
pub fn validate_rules(paths: &[PathBuf], envoy: bool) -> ExitCode {
    let mut ok = true;
    let mut out = std::io::stdout().lock();
    for path in paths {
        let loaded = if envoy {
            crate::rules::envoy::load_sliding(path)
                .map(|c| format!("{} domains, version {}", c.domain_count(), c.version()))
        } else {
            crate::rules::load(path, crate::rules::PathForm::default())
                .map(|s| format!("{} rules, version {}", s.rules().len(), s.version()))
        };
        match loaded {
            Ok(summary) => {
                let _ = writeln!(out, "{}: ok, {summary}", path.display());
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

/// Runs `ratelimitd migrate`: 0 when every step is applied or already was, 1 otherwise.
pub async fn migrate(config: &Config) -> ExitCode {
    match migrate::run(config).await {
        Ok(results) => {
            let mut out = std::io::stdout().lock();
            for (file, applied) in &results {
                let (what, detail) = match applied {
                    Applied::Changed(d) => ("applied", d),
                    Applied::AlreadyApplied(d) => ("already applied", d),
                    Applied::Skipped(d) => ("skipped", d),
                };
                let _ = writeln!(out, "{file}: {what}: {detail}");
            }
            let summary = migrate::summary(&results);
            let count = |key| summary.get(key).copied().unwrap_or(0);
            if count("applied") == 0 {
                let _ = writeln!(out, "nothing to do: {} migrations, none changed anything", results.len());
            } else {
                let _ = writeln!(
                    out,
                    "{} applied, {} already applied, {} skipped",
                    count("applied"),
                    count("already applied"),
                    count("skipped")
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("migrate: {e}");
            ExitCode::from(1)
        }
    }
}

/// Runs `ratelimitd overload [MODE]`: sets, clears or prints the
/// cluster-wide mode switch. 0 on success, 1 when Redis cannot be reached,
/// 64 without `redis.url` (the memory store has no cluster to switch).
pub async fn overload_mode(mode: Option<&str>, config: &Config) -> ExitCode {
    if config.redis.url.is_none() {
        eprintln!(
            "overload: redis.url is unset: the switch lives in Redis (set overload.mode or the tenant table's mode instead)"
        );
        return ExitCode::from(64);
    }
    let mut tasks = tokio::task::JoinSet::new();
    let store = match crate::limiter::RedisStore::new(&config.redis, &mut tasks) {
        Ok(store) => store,
        Err(e) => {
            eprintln!("overload: {e}");
            return ExitCode::from(1);
        }
    };
    let key = crate::overload::feed::mode_key(store.key_prefix());
    let key = key.as_str();
    let mut pipeline = redis::pipe();
    match mode {
        None => pipeline.cmd("GET").arg(key),
        Some("clear") => pipeline.cmd("DEL").arg(key).ignore().cmd("GET").arg(key),
        Some(mode) => pipeline.cmd("SET").arg(key).arg(mode).ignore().cmd("GET").arg(key),
    };
    let timeout =
        std::time::Duration::from_millis(config.redis.connect_timeout_ms.max(config.redis.timeout_ms));
    let answer: Result<(Option<String>,), _> = store.pipeline(&pipeline, timeout).await;
    drop(store);
    while tasks.join_next().await.is_some() {}
    match answer {
        Ok((Some(mode),)) => {
            let _ = writeln!(
                std::io::stdout().lock(),
                "overload mode switch: {mode} (every instance follows within two overload.report_interval_ms)"
            );
            ExitCode::SUCCESS
        }
        Ok((None,)) => {
            let _ = writeln!(
                std::io::stdout().lock(),
                "overload mode switch: unset (each instance follows its tenant table's mode, else overload.mode)"
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "overload: {}: {e}",
                config.redis.url.as_deref().map(crate::config::redact_url).unwrap_or_default()
            );
            ExitCode::from(1)
        }
    }
}

/// Runs `ratelimitd audit`: 0 on success (even with no match), 1 when the
/// source cannot be read, 64 on bad arguments.
pub fn audit(args: AuditArgs, config: &Config) -> ExitCode {
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

/// Runs `ratelimitd probe`: 0 when `path` on `addr` answers 200, 1 otherwise.
pub fn probe(addr: &str, path: &str) -> ExitCode {
    use std::io::Read;
    let fetched = (|| -> std::io::Result<String> {
        let addr: std::net::SocketAddr = addr
            .parse()
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{addr}: {e}")))?;
        let mut stream = std::net::TcpStream::connect_timeout(&addr, std::time::Duration::from_secs(2))?;
        stream.set_read_timeout(Some(std::time::Duration::from_secs(2)))?;
        write!(stream, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        Ok(response)
    })();
    match fetched {
        Ok(response) if response.starts_with("HTTP/1.1 200") => ExitCode::SUCCESS,
        Ok(response) => {
            eprintln!("{}", response.lines().next().unwrap_or("empty response"));
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("probe {addr}{path}: {e}");
            ExitCode::from(1)
        }
    }
}

/// `ratelimitd replay …`
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    /// The candidate native rules: a YAML file or a directory. Default: the
    /// native rules in force.
    #[arg(long, required_unless_present = "envoy")]
    pub rules: Option<PathBuf>,
    /// The candidate envoyproxy/ratelimit configuration: a file or a
    /// directory. Default: the Envoy configuration in force.
    #[arg(long, value_name = "PATH")]
    pub envoy: Option<PathBuf>,
    /// The capture: a JSON-lines file (capture.file), or `kafka` for capture.kafka.topic.
    #[arg(long)]
    pub capture: String,
    /// The native rules in force. Default: the record in force on the
    /// rules topic (rules.source: kafka), else rules.path, else the embedded rules.
    #[arg(long)]
    pub current: Option<PathBuf>,
    /// The Envoy configuration in force. Default: the record in force on
    /// the rules topic (rules.source: kafka), else rules.envoy_path.
    #[arg(long, value_name = "PATH")]
    pub current_envoy: Option<PathBuf>,
    /// Exit 1 when the candidate fails the gate by these thresholds.
    #[command(flatten)]
    pub thresholds: GateArgs,
    /// Also write the report as JSON (per rule, per priority, a timeline, the gate) to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Runs `ratelimitd replay`: 0 the candidate passes the gate, 1 it fails
/// (or the capture cannot be read), 64 bad arguments.
pub fn replay(args: &ReplayArgs, config: &Config) -> ExitCode {
    let rules = |native: &Option<PathBuf>, envoy: &Option<PathBuf>, flags: (&str, &str)| {
        rules_with(config, native.as_deref(), envoy.as_deref(), flags)
    };
    let current = match rules(&args.current, &args.current_envoy, ("--current", "--current-envoy")) {
        Ok(current) => current,
        Err(code) => return code,
    };
    let candidate = match rules(&args.rules, &args.envoy, ("--rules", "--envoy")) {
        Ok(candidate) => candidate,
        Err(code) => return code,
    };
    let thresholds = match args.thresholds.thresholds(config.gate) {
        Ok(thresholds) => thresholds,
        Err(code) => return code,
    };
    match run_replay(config, &args.capture, current, candidate, thresholds, args.json.as_deref()) {
        Ok(report) if report.gate.passed => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(code) => code,
    }
}

/// The rules in force with the parts given replaced: native rules from
/// `native`, the Envoy configuration from `envoy` (errors name `flags`).
fn rules_with(
    config: &Config,
    native: Option<&std::path::Path>,
    envoy: Option<&std::path::Path>,
    flags: (&str, &str),
) -> Result<crate::replay::Rules, ExitCode> {
    let mut rules = match (native, envoy) {
        (Some(_), Some(_)) => crate::replay::Rules::native(crate::rules::empty()),
        _ => current_rules(config, None)?,
    };
    if let Some(path) = native {
        rules.native =
            crate::rules::load(path, config.rules.path_matching).map_err(|e| rule_errors(flags.0, &e))?;
    }
    if let Some(path) = envoy {
        let compiled = crate::rules::envoy::load(path, config.envoy.compile());
        rules.envoy = Some(compiled.map_err(|e| rule_errors(flags.1, &e))?);
    }
    Ok(rules)
}

fn rule_errors(flag: &str, errors: &crate::rules::RuleErrors) -> ExitCode {
    for error in &errors.0 {
        eprintln!("{flag}: {error}");
    }
    ExitCode::from(1)
}

/// The rules in force (see [`crate::release::rules_in_force`]); a
/// problem printed (exit 1).
fn current_rules(
    config: &Config,
    in_force: Option<&crate::rules::encoding::SnapshotRecord>,
) -> Result<crate::replay::Rules, ExitCode> {
    crate::release::rules_in_force(config, in_force, &crate::release::trust(config, None)).map_err(|e| {
        eprintln!("{e}");
        ExitCode::from(1)
    })
}

/// Runs `rules diff`: 0 printed (changes or none), 1 rules or the capture
/// cannot be read.
pub fn diff(args: &DiffArgs, config: &Config) -> ExitCode {
    let sides =
        rules_with(config, args.from.as_deref(), args.from_envoy.as_deref(), ("--from", "--from-envoy"))
            .and_then(|old| {
                let new = rules_with(
                    config,
                    args.rules.as_deref(),
                    args.envoy.as_deref(),
                    ("rules diff", "--envoy"),
                )?;
                Ok((old, new))
            });
    let (old, new) = match sides {
        Ok(sides) => sides,
        Err(code) => return code,
    };
    let capture = match args.capture.as_deref().map(crate::replay::Capture::from_file).transpose() {
        Ok(capture) => capture,
        Err(e) => {
            eprintln!("rules diff: {e}");
            return ExitCode::from(1);
        }
    };
    let mut out = std::io::stdout().lock();
    if args.rules.is_some() {
        print_native_diff(&mut out, &old.native, &new.native, capture.as_ref());
    }
    if args.envoy.is_some() {
        let none = crate::rules::envoy::EnvoyConfig::default();
        let old_envoy = old.envoy.as_ref().unwrap_or(&none);
        print_envoy_diff(&mut out, old_envoy, new.envoy.as_ref().unwrap_or(&none), capture.as_ref());
    }
    ExitCode::SUCCESS
}

/// `rules diff`'s lines for native rules.
fn print_native_diff(
    out: &mut impl Write,
    old: &crate::rules::Snapshot,
    new: &crate::rules::Snapshot,
    capture: Option<&crate::replay::Capture>,
) {
    use crate::rules::diff;
    let changes = diff::diff(old, new);
    let touched = capture.map(|capture| {
        let native = capture.requests.iter().filter(|r| r.envoy.is_none());
        let requests = native.clone().map(|r| (&*r.resource_path, r.client_type.as_deref()));
        (diff::touched(old, new, &changes, requests), native.count())
    });
    let versions = (old.version(), new.version());
    print_changes(out, versions, &changes, touched.as_ref(), |id, candidate| {
        diff::describe_rule(if candidate { new } else { old }, id)
    });
}

/// `rules diff`'s lines for Envoy limits.
fn print_envoy_diff(
    out: &mut impl Write,
    old: &crate::rules::envoy::EnvoyConfig,
    new: &crate::rules::envoy::EnvoyConfig,
    capture: Option<&crate::replay::Capture>,
) {
    use crate::rules::diff;
    let changes = diff::envoy_diff(old, new);
    let touched = capture.map(|capture| {
        let calls = capture.requests.iter().filter_map(|r| r.envoy.as_deref());
        let requests = calls.clone().map(|call| {
            let entries =
                call.descriptors.iter().map(|d| d.entries.iter().map(|(k, v)| (k.as_str(), v.as_str())));
            (call.domain.as_str(), entries)
        });
        (diff::envoy_touched(old, new, &changes, requests), calls.count())
    });
    // Each configuration's limits walked once, not once per change.
    let (old_limits, new_limits) = (old.limits(), new.limits());
    let versions = (old.version(), new.version());
    print_changes(out, versions, &changes, touched.as_ref(), |key, candidate| {
        diff::describe_limit(if candidate { &new_limits } else { &old_limits }, key)
    });
}

/// A summary line, then one line per change (with the captured requests it
/// touches); `describe(key, in_candidate)` says what a rule or limit is.
fn print_changes(
    out: &mut impl Write,
    (old, new): (&str, &str),
    changes: &[crate::rules::diff::Change],
    touched: Option<&(std::collections::BTreeMap<String, u64>, usize)>,
    describe: impl Fn(&str, bool) -> String,
) {
    use crate::rules::diff::Change;
    let count = |f: fn(&Change) -> bool| changes.iter().filter(|c| f(c)).count();
    let _ = writeln!(
        out,
        "{old} -> {new}: {} added, {} removed, {} changed",
        count(|c| matches!(c, Change::Added(_))),
        count(|c| matches!(c, Change::Removed(_))),
        count(|c| matches!(c, Change::Changed(..))),
    );
    for change in changes {
        let what = match change {
            Change::Added(id) => format!("added    {id}: {}", describe(id, true)),
            Change::Removed(id) => format!("removed  {id}: {}", describe(id, false)),
            Change::Changed(id, fields) => {
                let fields: Vec<String> = fields.iter().map(|(f, a, b)| format!("{f} {a} -> {b}")).collect();
                format!("changed  {id}: {}", fields.join("; "))
            }
        };
        let touches = touched
            .map(|(t, total)| format!("  (touches {} of {total} captured requests)", t[change.rule_id()]))
            .unwrap_or_default();
        let _ = writeln!(out, "{what}{touches}");
    }
}

/// Reads the capture, replays, prints the report and returns it.
fn run_replay(
    config: &Config,
    source: &str,
    current: crate::replay::Rules,
    candidate: crate::replay::Rules,
    thresholds: crate::rules::gate::GateThresholds,
    json: Option<&std::path::Path>,
) -> Result<crate::replay::Report, ExitCode> {
    let capture = if source == "kafka" {
        let kafka = &config.capture.kafka;
        let Some(brokers) = &kafka.brokers else {
            eprintln!("--capture kafka: capture.kafka.brokers is not set");
            return Err(ExitCode::from(EXIT_USAGE));
        };
        match crate::rollout::topic::read_all(brokers, &kafka.properties, &kafka.topic) {
            Ok(records) => {
                let mut capture = crate::replay::Capture::default();
                records.iter().filter_map(|r| r.payload.as_deref()).for_each(|p| capture.push(p));
                capture.sort();
                capture
            }
            Err(e) => {
                eprintln!("--capture kafka: {e}");
                return Err(ExitCode::from(1));
            }
        }
    } else {
        crate::replay::Capture::from_file(std::path::Path::new(source)).map_err(|e| {
            eprintln!("--capture: {e}");
            ExitCode::from(1)
        })?
    };
    let in_force = [Some(current.native.version()), current.envoy.as_ref().map(|e| e.version())];
    if capture.versions.keys().any(|v| !in_force.contains(&Some(v.as_str()))) {
        eprintln!(
            "note: the capture was decided under rules {:?}; replaying against {} as the rules in force",
            capture.versions,
            current.version()
        );
    }
    let report = crate::replay::replay(
        &capture,
        current,
        candidate,
        &crate::release::replay_settings(config, thresholds),
    );
    let _ = std::io::stdout().write_all(report.table().as_bytes());
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).unwrap_or_default();
        if let Err(e) = std::fs::write(path, text + "\n") {
            eprintln!("--json {}: {e}", path.display());
            return Err(ExitCode::from(1));
        }
    }
    Ok(report)
}
