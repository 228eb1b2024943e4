//! `region` and `global.*` checked: the regions sharing the global limits
//! ([`GlobalConfig`], owned by `global`), errors naming their key.

use super::{ConfigError, invalid};
use crate::{global::GlobalConfig, limiter::grants::PPM};

/// Most regions `global.regions` may list.
const MAX_REGIONS: usize = 64;

impl GlobalConfig {
    /// Checks `global.*` against this deployment's `region`.
    pub fn validate(&self, region: Option<&str>) -> Result<(), ConfigError> {
        if !self.enabled() {
            if self.redis.url.is_some() {
                return Err(invalid("global.regions", "lists no region, but global.redis.url is set"));
            }
            return Ok(());
        }
        self.validate_regions(region)?;
        if self.redis.url.is_none() {
            return Err(invalid("global.redis.url", "must name the coordination store every region reaches"));
        }
        if self.timeout_ms == 0 {
            return Err(invalid("global.timeout_ms", "must be at least 1"));
        }
        self.redis.validate().map_err(|e| match e {
            ConfigError::Invalid { key, message } => invalid(under_global(key), message),
            other => other,
        })?;
        self.validate_timing()
    }

    /// `global.regions` and `region`: named, listed once, floors in range
    /// and summing to at most 1; this deployment's among them.
    fn validate_regions(&self, region: Option<&str>) -> Result<(), ConfigError> {
        if self.regions.len() > MAX_REGIONS {
            return Err(invalid("global.regions", format!("at most {MAX_REGIONS} regions")));
        }
        for (i, r) in self.regions.iter().enumerate() {
            if !valid_name(&r.name) {
                return Err(invalid(
                    "global.regions",
                    format!("{:?}: a region's name is 1 to 64 letters, digits, '.', '_' or '-'", r.name),
                ));
            }
            if self.regions[..i].iter().any(|other| other.name == r.name) {
                return Err(invalid("global.regions", format!("region {:?} is listed twice", r.name)));
            }
            if !(0.0..=1.0).contains(&r.floor) {
                return Err(invalid(
                    "global.regions",
                    format!("region {:?}: floor must be between 0 and 1", r.name),
                ));
            }
        }
        let floors: u64 = self.floors_ppm().iter().sum();
        if floors > PPM {
            return Err(invalid(
                "global.regions",
                format!(
                    "the floors sum to {:.6}: above 1, the regions' floors alone would exceed every global limit",
                    floors as f64 / PPM as f64
                ),
            ));
        }
        match region {
            None => Err(invalid("region", "must name this deployment's region (one of global.regions)")),
            Some(name) if self.index(name).is_none() => {
                Err(invalid("region", format!("{name:?} is not one of global.regions")))
            }
            Some(_) => Ok(()),
        }
    }

    /// The interval, the lease against it, and the bound on keys.
    fn validate_timing(&self) -> Result<(), ConfigError> {
        if !(100..=60_000).contains(&self.interval_ms) {
            return Err(invalid("global.interval_ms", "must be between 100 and 60000"));
        }
        let least =
            self.interval_ms.saturating_mul(2).saturating_add(self.timeout_ms).saturating_add(self.skew_ms);
        if self.lease_ms <= least {
            return Err(invalid(
                "global.lease_ms",
                format!(
                    "must exceed two intervals, the report's timeout and the skew margin \
                     (2 × global.interval_ms + global.timeout_ms + global.skew_ms = {least})"
                ),
            ));
        }
        if !(1..=1_000_000).contains(&self.max_keys) {
            return Err(invalid("global.max_keys", "must be between 1 and 1000000"));
        }
        Ok(())
    }
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len()) && name.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
}

/// `redis.<key>`'s twin under `global.redis`.
fn under_global(key: &'static str) -> &'static str {
    match key {
        "redis.url" => "global.redis.url",
        "redis.cluster" => "global.redis.cluster",
        "redis.sentinel_master" => "global.redis.sentinel_master",
        "redis.password" => "global.redis.password",
        "redis.password_file" => "global.redis.password_file",
        "redis.tls_key_file" => "global.redis.tls_key_file",
        "redis.key_prefix" => "global.redis.key_prefix",
        _ => "global.redis",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::global::RegionConfig;

    fn regions(floors: &[(&str, f64)]) -> GlobalConfig {
        let mut config = GlobalConfig {
            regions: floors
                .iter()
                .map(|(name, floor)| RegionConfig { name: (*name).into(), floor: *floor })
                .collect(),
            ..GlobalConfig::default()
        };
        config.redis.url = Some("redis://coordination:6379".into());
        config
    }

    fn refused(config: &GlobalConfig, region: Option<&str>) -> (&'static str, String) {
        match config.validate(region) {
            Err(ConfigError::Invalid { key, message }) => (key, message),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn three_regions_with_floors_that_fit_are_taken() {
        let config = regions(&[("eu", 0.05), ("us", 0.05), ("ap", 0.05)]);
        config.validate(Some("us")).unwrap();
        assert_eq!(config.floors_ppm(), [50_000, 50_000, 50_000]);
        assert_eq!(config.index("ap"), Some(2));
    }

    #[test]
    fn each_bad_setting_is_refused_by_its_key() {
        let base = regions(&[("eu", 0.1), ("us", 0.1)]);
        let (key, message) = refused(&regions(&[("eu", 0.6), ("us", 0.5)]), Some("eu"));
        assert_eq!(key, "global.regions");
        assert!(message.contains("floors sum to 1.1"), "{message}");
        assert_eq!(refused(&regions(&[("eu", 0.1), ("eu", 0.1)]), Some("eu")).0, "global.regions");
        assert_eq!(refused(&regions(&[("e u", 0.1)]), Some("e u")).0, "global.regions");
        assert_eq!(refused(&regions(&[("eu", -0.1)]), Some("eu")).0, "global.regions");
        assert_eq!(refused(&base, None).0, "region");
        assert_eq!(refused(&base, Some("ap")).0, "region");
        let mut no_store = base.clone();
        no_store.redis.url = None;
        assert_eq!(refused(&no_store, Some("eu")).0, "global.redis.url");
        let mut bad_url = base.clone();
        bad_url.redis.url = Some("http://coordination".into());
        assert_eq!(refused(&bad_url, Some("eu")).0, "global.redis.url");
        let mut short = base.clone();
        short.lease_ms = 2 * short.interval_ms + short.timeout_ms + short.skew_ms;
        let (key, message) = refused(&short, Some("eu"));
        assert_eq!(key, "global.lease_ms");
        assert!(message.contains("= 3500"), "{message}");
        let mut keys = base.clone();
        keys.max_keys = 0;
        assert_eq!(refused(&keys, Some("eu")).0, "global.max_keys");
        let mut off = GlobalConfig::default();
        off.redis.url = Some("redis://coordination:6379".into());
        assert_eq!(refused(&off, None).0, "global.regions");
        GlobalConfig::default().validate(None).unwrap();
    }
}
