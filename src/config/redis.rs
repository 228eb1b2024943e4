//! `redis.*` checked: the Redis store's settings ([`RedisConfig`], owned by
//! `limiter::settings`) validated with errors naming their key; and
//! [`Connection`], how any Redis is reached (`redis`, `global.redis`),
//! validated here once for both.

use super::{ConfigError, invalid};
use crate::limiter::settings::{Connection, RedisConfig, redact_url};

impl RedisConfig {
    /// Checks `redis.*`: the connection, deadlines, the breaker and the
    /// calls' bounds.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.connection.validate()?;
        if self.timeout_ms == 0 {
            return Err(invalid("redis.timeout_ms", "must be at least 1"));
        }
        if self.connect_timeout_ms == 0 {
            return Err(invalid("redis.connect_timeout_ms", "must be at least 1"));
        }
        if !(1..=256).contains(&self.connections) {
            return Err(invalid("redis.connections", "must be between 1 and 256"));
        }
        if self.max_keys_per_call == 0 {
            return Err(invalid("redis.max_keys_per_call", "must be at least 1"));
        }
        if self.max_key_bytes_per_call < 1_024 {
            return Err(invalid("redis.max_key_bytes_per_call", "must be at least 1024"));
        }
        if self.breaker_failures > 0 && self.breaker_open_ms == 0 {
            return Err(invalid(
                "redis.breaker_open_ms",
                "must be at least 1 while redis.breaker_failures is set",
            ));
        }
        Ok(())
    }
}

impl Connection {
    /// Checks a Redis connection's keys (named as under `redis`; the
    /// coordination store's errors are renamed under `global.redis`): URLs,
    /// credentials, TLS files and the key prefix.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(url) = &self.url {
            self.validate_seeds(url)?;
            self.password().map_err(|e| invalid(e.key, e.message))?;
            let tls_files =
                self.tls_ca_file.is_some() || self.tls_cert_file.is_some() || self.tls_key_file.is_some();
            if tls_files && !self.seed_urls().all(|seed| seed.starts_with("rediss://")) {
                return Err(invalid("redis.url", "redis.tls_* files need rediss:// URLs"));
            }
            if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
                return Err(invalid(
                    "redis.tls_key_file",
                    "set redis.tls_cert_file and redis.tls_key_file together",
                ));
            }
        } else if self.cluster {
            return Err(invalid("redis.cluster", "needs redis.url (the seed nodes)"));
        }
        // Braces would become the key's hash tag; control characters and
        // spaces have no place in a key an operator reads.
        if self.key_prefix.len() > 64
            || self.key_prefix.chars().any(|c| c == '{' || c == '}' || c.is_control() || c.is_whitespace())
        {
            return Err(invalid(
                "redis.key_prefix",
                format!(
                    "{:?}: at most 64 bytes, without braces, spaces or control characters",
                    self.key_prefix
                ),
            ));
        }
        Ok(())
    }

    fn validate_seeds(&self, url: &str) -> Result<(), ConfigError> {
        let mut seeds = 0;
        for seed in self.seed_urls() {
            seeds += 1;
            let unix = seed.starts_with("unix://") || seed.starts_with("redis+unix://");
            if unix && self.cluster {
                return Err(invalid(
                    "redis.url",
                    "a Redis Cluster's seed nodes need redis:// or rediss:// URLs",
                ));
            }
            if !(seed.starts_with("redis://") || seed.starts_with("rediss://") || unix) {
                return Err(invalid(
                    "redis.url",
                    format!("{:?} must start with redis://, rediss:// or unix://", redact_url(seed)),
                ));
            }
            ::redis::Client::open(seed).map_err(|e| {
                invalid("redis.url", format!("{:?} is not a valid Redis URL: {e}", redact_url(seed)))
            })?;
        }
        if seeds == 0 {
            return Err(invalid("redis.url", "must not be empty; leave it unset for in-memory counters"));
        }
        if let Some(master) = &self.sentinel_master {
            if self.cluster {
                return Err(invalid(
                    "redis.sentinel_master",
                    "Sentinel and redis.cluster exclude each other",
                ));
            }
            if master.is_empty() || master.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(invalid("redis.sentinel_master", format!("{master:?} is not a master name")));
            }
            if self.seed_urls().any(|seed| !seed.starts_with("redis://")) {
                return Err(invalid("redis.url", "with redis.sentinel_master: the sentinels' redis:// URLs"));
            }
            return Ok(());
        }
        if seeds > 1 && !self.cluster {
            return Err(invalid(
                "redis.url",
                format!(
                    "{:?} lists {seeds} servers; set redis.cluster: true for a Redis Cluster",
                    redact_url(url)
                ),
            ));
        }
        Ok(())
    }
}
