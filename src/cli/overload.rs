//! `ratelimitd overload [MODE]`: the overload layer's cluster-wide switch in
//! Redis.

use std::{io::Write as _, process::ExitCode};

use crate::config::Config;

/// Runs `ratelimitd overload [MODE]`: sets, clears or prints the
/// cluster-wide mode switch. 0 on success, 1 when Redis cannot be reached,
/// 64 without `redis.url` (the memory store has no cluster to switch).
pub async fn run(mode: Option<&str>, config: &Config) -> ExitCode {
    if config.redis.connection.url.is_none() {
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
                config.redis.connection.url.as_deref().map(crate::config::redact_url).unwrap_or_default()
            );
            ExitCode::from(1)
        }
    }
}
