//! `redis.*`, the Redis store's settings, and [`Connection`], how to reach
//! a Redis, which `global.redis` shares (validated by `config`, which
//! composes them into the service's configuration), and [`redact_url`],
//! how a Redis URL is shown in logs and errors.

use std::{fmt, path::PathBuf};

use serde::{
    Deserialize, Deserializer,
    de::{self, MapAccess, Visitor},
};

/// How to reach a Redis, the same under `redis` (the counter store) and
/// `global.redis` (the coordination store of global limits): where, as
/// whom, over what TLS, and the prefix of every key written there.
/// Validated in one place (`config/redis.rs`); its `Debug` hides the
/// secrets, which are never serialized either.
#[derive(Clone, Default, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Connection {
    /// `redis://[:password@]host:port[/db]` (`rediss://` for TLS, `unix:///path/redis.sock` for a
    /// Unix socket); with `cluster`, the seed nodes and with `sentinel_master` the sentinels,
    /// comma-separated (`redis://10.0.0.1:7000,redis://10.0.0.2:7000`). Unset under `redis`: counters
    /// in memory; under `global.redis`: required once `global.regions` lists regions. Passwords in it
    /// are masked in every log and error.
    pub url: Option<String>,
    /// `url` names Redis Cluster seed nodes: the slot map is read from them, MOVED/ASK and failovers
    /// are followed by the client, and a call is split into one per hash slot (a global limit's
    /// state is kept in one).
    pub cluster: bool,
    /// The master's name in Redis Sentinel: `url` then lists the sentinels
    /// (`redis://host:26379,redis://host2:26379`), asked where the master is on every new
    /// connection, so a failover is followed (counts are what the replica had). `password` is the
    /// master's. Not with `cluster` or `rediss://`.
    pub sentinel_master: Option<String>,
    /// AUTH password of the sentinels themselves (upstream's `REDIS_SENTINEL_AUTH`); `password` is
    /// the master's. Never logged.
    // Secrets (passwords, SASL and TLS properties, auth headers) are
    // never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub sentinel_password: Option<String>,
    /// The AUTH password, instead of one in `url` (best set through the environment:
    /// `RATELIMITD__REDIS__PASSWORD`, `RATELIMITD__GLOBAL__REDIS__PASSWORD`). Never logged.
    // Secrets (passwords, SASL and TLS properties, auth headers) are
    // never serialized: not even into the generated reference.
    #[serde(skip_serializing)]
    pub password: Option<String>,
    /// The ACL user the password is for (`AUTH user password`), instead of
    /// one in `url`; unset: Redis' `default` user.
    pub username: Option<String>,
    /// A file holding the AUTH password (trailing newline ignored), e.g. a mounted secret; read at
    /// startup; not with `password`.
    pub password_file: Option<PathBuf>,
    /// With `rediss://`: PEM CA certificate(s) to trust instead of the
    /// system's roots (a private CA).
    pub tls_ca_file: Option<PathBuf>,
    /// With `rediss://`: PEM client certificate, for a Redis that requires
    /// client certificates (`tls-auth-clients yes`); with `tls_key_file`.
    pub tls_cert_file: Option<PathBuf>,
    /// With `rediss://`: the key of that client certificate.
    pub tls_key_file: Option<PathBuf>,
    /// Put before every key this service writes there, so deployments sharing one Redis keep apart
    /// (upstream's `CACHE_KEY_PREFIX`; for `global.redis`, the same in every region: they share its
    /// keys); at most 64 bytes, no braces, spaces or control characters.
    pub key_prefix: String,
}

impl Connection {
    /// The names of its keys.
    const FIELDS: [&str; 11] = [
        "url",
        "cluster",
        "sentinel_master",
        "sentinel_password",
        "password",
        "username",
        "password_file",
        "tls_ca_file",
        "tls_cert_file",
        "tls_key_file",
        "key_prefix",
    ];

    /// Reads the value of `key` from `map` when `key` is one of its own:
    /// `false` (nothing read) otherwise. Each value is read as its field's
    /// type, so the configuration's sources convert it as for any field.
    fn read<'de, A: MapAccess<'de>>(&mut self, key: &str, map: &mut A) -> Result<bool, A::Error> {
        match key {
            "url" => self.url = map.next_value()?,
            "cluster" => self.cluster = map.next_value()?,
            "sentinel_master" => self.sentinel_master = map.next_value()?,
            "sentinel_password" => self.sentinel_password = map.next_value()?,
            "password" => self.password = map.next_value()?,
            "username" => self.username = map.next_value()?,
            "password_file" => self.password_file = map.next_value()?,
            "tls_ca_file" => self.tls_ca_file = map.next_value()?,
            "tls_cert_file" => self.tls_cert_file = map.next_value()?,
            "tls_key_file" => self.tls_key_file = map.next_value()?,
            "key_prefix" => self.key_prefix = map.next_value()?,
            _ => return Ok(false),
        }
        Ok(true)
    }

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

impl fmt::Debug for Connection {
    // The URL may carry a password: never print it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hidden = |secret: &Option<String>| secret.as_ref().map(|_| "***");
        f.debug_struct("Connection")
            .field("url", &self.url.as_deref().map(redact_url))
            .field("cluster", &self.cluster)
            .field("sentinel_master", &self.sentinel_master)
            .field("sentinel_password", &hidden(&self.sentinel_password))
            .field("password", &hidden(&self.password))
            .field("username", &self.username)
            .field("password_file", &self.password_file)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("key_prefix", &self.key_prefix)
            .finish()
    }
}

/// `redis.*`: the Redis store's connection and how it is called.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RedisConfig {
    /// Where and how to reach it: `redis.url`, `redis.password`, … (read
    /// as keys of `redis` itself).
    #[serde(flatten)]
    pub connection: Connection,
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
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            connection: Connection::default(),
            timeout_ms: 10,
            connect_timeout_ms: 1_000,
            connections: 2,
            breaker_failures: 3,
            breaker_min_failing_ms: 200,
            breaker_open_ms: 250,
            max_keys_per_call: 1_024,
            max_key_bytes_per_call: 256 << 10,
        }
    }
}

impl RedisConfig {
    /// How a part that calls Redis off the request path reaches the store
    /// of `connection` (the coordination store): one connection, `timeout_ms`
    /// for a call and for connecting, no breaker.
    pub fn side(connection: &Connection, timeout_ms: u64) -> Self {
        RedisConfig {
            connection: connection.clone(),
            timeout_ms,
            connect_timeout_ms: timeout_ms,
            connections: 1,
            breaker_failures: 0,
            ..RedisConfig::default()
        }
    }
}

/// Read by hand rather than derived: the connection's keys sit beside the
/// store's own (`redis.url` and `redis.timeout_ms`), and a flattened field
/// would lose the conversions the configuration's sources make per field
/// type (a numeric password from the environment read as a string).
impl<'de> Deserialize<'de> for RedisConfig {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = RedisConfig;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("the redis section")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RedisConfig, A::Error> {
                let mut out = RedisConfig::default();
                while let Some(key) = map.next_key::<String>()? {
                    if out.connection.read(&key, &mut map)? {
                        continue;
                    }
                    match key.as_str() {
                        "timeout_ms" => out.timeout_ms = map.next_value()?,
                        "connect_timeout_ms" => out.connect_timeout_ms = map.next_value()?,
                        "connections" => out.connections = map.next_value()?,
                        "breaker_failures" => out.breaker_failures = map.next_value()?,
                        "breaker_min_failing_ms" => out.breaker_min_failing_ms = map.next_value()?,
                        "breaker_open_ms" => out.breaker_open_ms = map.next_value()?,
                        "max_keys_per_call" => out.max_keys_per_call = map.next_value()?,
                        "max_key_bytes_per_call" => out.max_key_bytes_per_call = map.next_value()?,
                        other => return Err(de::Error::unknown_field(other, &REDIS_FIELDS)),
                    }
                }
                Ok(out)
            }
        }
        deserializer.deserialize_struct("RedisConfig", &REDIS_FIELDS, Fields)
    }
}

/// Every key of `redis`: the connection's, then the store's own.
const REDIS_FIELDS: [&str; 19] = {
    let own = [
        "timeout_ms",
        "connect_timeout_ms",
        "connections",
        "breaker_failures",
        "breaker_min_failing_ms",
        "breaker_open_ms",
        "max_keys_per_call",
        "max_key_bytes_per_call",
    ];
    let mut all = [""; 19];
    let mut i = 0;
    while i < all.len() {
        all[i] = if i < Connection::FIELDS.len() {
            Connection::FIELDS[i]
        } else {
            own[i - Connection::FIELDS.len()]
        };
        i += 1;
    }
    all
};

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
