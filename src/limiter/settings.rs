//! `redis.*`, the Redis store's settings (validated by `config`, which
//! composes them into the service's configuration), and [`redact_url`],
//! how a Redis URL is shown in logs and errors.

use std::{fmt, path::PathBuf};

use serde::Deserialize;

/// `redis.*`
#[derive(Clone, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// `redis://[:password@]host:port[/db]` (`rediss://` for TLS, `unix:///path/redis.sock` for a
    /// Unix socket); unset = in-memory store. With `redis.cluster`, a comma-separated list of seed
    /// nodes (`redis://10.0.0.1:7000,redis://10.0.0.2:7000`). Passwords in it are masked in every
    /// log and error.
    pub url: Option<String>,
    /// `redis.url` names Redis Cluster seed nodes: the slot map is read from them, MOVED/ASK and
    /// failovers are followed by the client, and each batch is split into one script call per hash
    /// slot.
    pub cluster: bool,
    /// The master's name in Redis Sentinel: `redis.url` then lists the sentinels
    /// (`redis://host:26379,redis://host2:26379`), asked where the master is on every new
    /// connection, so a failover is followed (counts are what the replica had). `redis.password` is
    /// the master's. Not with `redis.cluster` or `rediss://`.
    pub sentinel_master: Option<String>,
    /// AUTH password of the sentinels themselves (upstream's
    /// `REDIS_SENTINEL_AUTH`); `password` is the master's. Never logged.
    // Secrets (passwords, SASL and TLS properties, auth headers) are
    // never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub sentinel_password: Option<String>,
    /// The AUTH password, instead of one in `url` (best set through
    /// `RATELIMITD__REDIS__PASSWORD`). Never logged.
    // Secrets (passwords, SASL and TLS properties, auth headers) are
    // never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub password: Option<String>,
    /// The ACL user the password is for (`AUTH user password`), instead of
    /// one in `url`; unset: Redis' `default` user.
    pub username: Option<String>,
    /// A file holding the AUTH password (trailing newline ignored), e.g. a mounted secret; read at
    /// startup; mutually exclusive with `redis.password`.
    pub password_file: Option<PathBuf>,
    /// With `rediss://`: PEM CA certificate(s) to trust instead of the
    /// system's roots (a private CA).
    pub tls_ca_file: Option<PathBuf>,
    /// With `rediss://`: PEM client certificate, for a Redis that requires
    /// client certificates (`tls-auth-clients yes`); with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// With `rediss://` URLs: a client certificate and key, for a Redis with `tls-auth-clients
    /// yes`.
    pub tls_key_file: Option<PathBuf>,
    /// Deadline of one store call, connection acquisition included. Past it the
    /// rule's failure policy answers. Well inside Envoy's 20 ms default budget.
    pub timeout_ms: u64,
    /// Deadline for opening a new connection (bounded by `timeout_ms` on the
    /// request path; this bounds background reconnects).
    pub connect_timeout_ms: u64,
    /// Number of connections, each with one dispatcher task: the decisions
    /// queued while its script call is in flight become its next call, so a
    /// couple serve thousands of in-flight decisions (fewer connections,
    /// bigger batches, less Redis CPU per decision). Each serving thread
    /// (`grpc.serving_threads`) has its own, `connections / threads` rounded up, at least
    /// one, opened at its first decision; calls from elsewhere (TLS, `grpc.uds`) use another set
    /// of `connections`, opened at their first call.
    pub connections: usize,
    /// Consecutive failed script calls (unreachable, connection lost, deadline missed) that open
    /// the circuit breaker, if they also span `redis.breaker_min_failing_ms`; `0` disables it.
    /// Against a cluster there is one breaker per 256 slots, so a dead primary opens only its own.
    pub breaker_failures: u32,
    /// The least time those failures must span, from the first: a shorter pause (a fork for BGSAVE)
    /// fails only the decisions it delays and opens no breaker, so instances sharing a Redis do not
    /// all switch to fail-fast at once.
    pub breaker_min_failing_ms: u64,
    /// An open breaker answers decisions by their failure policy at once (kind `circuit_open`, not
    /// tried) for this long, then lets one probe decision through; its success closes the breaker
    /// (so does the readiness probe's, traffic or not).
    pub breaker_open_ms: u64,
    /// The most counters one script call carries; a bigger batch is split
    /// into calls (a job never is).
    pub max_keys_per_call: usize,
    /// The most bytes of counter keys one script call carries; likewise.
    pub max_key_bytes_per_call: usize,
    /// Put before every key this service writes (counters, the overload feed and its switch), so
    /// deployments sharing one Redis keep apart (upstream's `CACHE_KEY_PREFIX`); at most 64 bytes,
    /// no braces, spaces or control characters.
    pub key_prefix: String,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: None,
            cluster: false,
            sentinel_master: None,
            sentinel_password: None,
            password: None,
            username: None,
            password_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            timeout_ms: 10,
            connect_timeout_ms: 1_000,
            connections: 2,
            breaker_failures: 3,
            breaker_min_failing_ms: 200,
            breaker_open_ms: 250,
            max_keys_per_call: 1_024,
            max_key_bytes_per_call: 256 << 10,
            key_prefix: String::new(),
        }
    }
}

impl fmt::Debug for RedisConfig {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("cluster", &self.cluster)
            .field("sentinel_master", &self.sentinel_master)
            .field("sentinel_password", &self.sentinel_password.as_ref().map(|_| "***"))
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("password_file", &self.password_file)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("timeout_ms", &self.timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("connections", &self.connections)
            .field("breaker_failures", &self.breaker_failures)
            .field("breaker_min_failing_ms", &self.breaker_min_failing_ms)
            .field("breaker_open_ms", &self.breaker_open_ms)
            .field("max_keys_per_call", &self.max_keys_per_call)
            .field("max_key_bytes_per_call", &self.max_key_bytes_per_call)
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}

impl RedisConfig {
    /// The seed URLs in `url` (one unless `cluster`).
    pub fn seed_urls(&self) -> impl Iterator<Item = &str> {
        split_seeds(self.url.as_deref().unwrap_or_default()).map(str::trim).filter(|s| !s.is_empty())
    }

    /// The AUTH password from `password` or `password_file`, if either is
    /// set. The error names the key and the file, never the content.
    pub fn password(&self) -> Result<Option<String>, PasswordError> {
        let error = |message: String| PasswordError { key: "redis.password_file", message };
        match (&self.password, &self.password_file) {
            (Some(_), Some(_)) => {
                Err(error("set redis.password or redis.password_file, not both".to_owned()))
            }
            (Some(password), None) => Ok(Some(password.clone())),
            (None, Some(file)) => {
                let text = std::fs::read_to_string(file)
                    .map_err(|e| error(format!("cannot read {}: {e}", file.display())))?;
                let password = text.trim_end_matches(['\r', '\n']);
                if password.is_empty() {
                    return Err(error(format!("{} is empty", file.display())));
                }
                Ok(Some(password.to_owned()))
            }
            (None, None) => Ok(None),
        }
    }
}

/// Replaces the userinfo of a URL (`user:password@`) with `***@`; in a
/// comma-separated list of URLs (cluster seed nodes), that of each.
pub fn redact_url(url: &str) -> String {
    fn one(url: &str) -> String {
        match (url.find("://"), url.rfind('@')) {
            (Some(scheme_end), Some(at)) if at > scheme_end => {
                format!("{}***{}", &url[..scheme_end + 3], &url[at..])
            }
            _ => url.to_owned(),
        }
    }
    split_seeds(url).map(one).collect::<Vec<_>>().join(",")
}

/// Splits a seed list at the commas that start another `redis://` or
/// `rediss://` URL, so a comma inside a password stays in its URL.
pub(crate) fn split_seeds(list: &str) -> impl Iterator<Item = &str> {
    let starts_url = |rest: &str| {
        let rest = rest.trim_start();
        rest.starts_with("redis://") || rest.starts_with("rediss://")
    };
    let mut cuts: Vec<usize> =
        list.match_indices(',').map(|(at, _)| at).filter(|&at| starts_url(&list[at + 1..])).collect();
    cuts.push(list.len());
    let mut start = 0;
    cuts.into_iter().map(move |end| {
        let seed = &list[start..end];
        start = (end + 1).min(list.len());
        seed
    })
}

/// Why the AUTH password could not be read: the key to fix and what is
/// wrong, never the password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct PasswordError {
    /// The settings key (`redis.password_file`).
    pub key: &'static str,
    /// What is wrong.
    pub message: String,
}
