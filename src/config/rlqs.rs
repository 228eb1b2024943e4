//! `rlqs.*` checked ([`RlqsConfig`], owned by `quota`), errors naming
//! their key.

use super::{ConfigError, invalid};
use crate::quota::RlqsConfig;

impl RlqsConfig {
    /// Checks `rlqs.*`: every time and bound at least 1, the skew shorter
    /// than an assignment.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let at_least_one = [
            ("rlqs.assignment_ttl_ms", self.assignment_ttl_ms),
            ("rlqs.abandon_after_ms", self.abandon_after_ms),
            ("rlqs.max_streams", self.max_streams as u64),
            ("rlqs.max_buckets_per_stream", self.max_buckets_per_stream as u64),
            ("rlqs.max_bucket_reports_per_second", self.max_bucket_reports_per_second),
            ("rlqs.max_buckets", self.max_buckets as u64),
        ];
        if let Some((key, _)) = at_least_one.iter().find(|(_, value)| *value == 0) {
            return Err(invalid(key, "must be at least 1"));
        }
        if self.assignment_ttl_ms < 1_000 {
            return Err(invalid(
                "rlqs.assignment_ttl_ms",
                "must be at least 1000: Envoy reports in whole seconds",
            ));
        }
        if self.skew_ms >= self.assignment_ttl_ms {
            return Err(invalid("rlqs.skew_ms", "must be shorter than rlqs.assignment_ttl_ms"));
        }
        if self.max_buckets_per_stream > self.max_buckets {
            return Err(invalid("rlqs.max_buckets_per_stream", "must be at most rlqs.max_buckets"));
        }
        Ok(())
    }
}
