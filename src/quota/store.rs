//! The buckets' holders in the Redis store: one hash per bucket, a field
//! per holder, updated by `quota.lua` (the twin of [`super::allot`]) at the
//! store's clock, so Envoys reporting to any instance share one bound.
//!
//! Key: `<prefix>rlq:{<domain>}:<id>` (the bucket's holders, `<id>` the
//! first 8 bytes of the SHA-256 of the bucket's entries, in hex): the
//! domain's hash tag, one cluster slot per domain, like its counters. A
//! bucket's hash expires two leases, margins and windows after its last
//! report, when no holder may enforce anything. Like the counters, the
//! holders are lost with the store's data (a restart without persistence).

use std::{fmt::Write as _, sync::Arc, time::Duration};

use sha2::{Digest as _, Sha256};

use super::{Asked, RlqsConfig};
use crate::limiter::{FailureKind, RedisStore, StoreError, push_encoded, scripts};

/// A store and how long a call to it may take.
#[derive(Debug, Clone)]
pub struct QuotaStore {
    /// The store.
    pub store: Arc<RedisStore>,
    /// How long one report's call may take.
    pub timeout: Duration,
}

/// The bucket's holders' key: `<prefix>rlq:{<domain>}:<id digest>`.
pub fn bucket_key(prefix: &str, domain: &str, id: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + 24 + domain.len());
    out.push_str(prefix);
    out.push_str("rlq:{");
    push_encoded(&mut out, domain, &['{', '}']);
    out.push_str("}:");
    for byte in &Sha256::digest(id.as_bytes())[..8] {
        let _ = write!(out, "{byte:02x}");
    }
    out
}

/// `holder`'s reports `asked` (of one domain) to `store`, pipelined in one
/// round trip: each bucket's share, in order.
pub async fn shares(
    store: &QuotaStore,
    settings: &RlqsConfig,
    holder: &Arc<str>,
    asked: &[Asked<'_>],
) -> Result<Vec<u64>, StoreError> {
    let prefix = store.store.key_prefix();
    let lease = settings.lease();
    let calls: Vec<scripts::Call> = asked
        .iter()
        .map(|a| {
            let linger = a.limit.window_ms;
            let ttl = lease.lease_ms.saturating_add(lease.skew_ms).saturating_add(linger).saturating_mul(2);
            let mut call = scripts::QUOTA.call();
            call.arg(1).arg(bucket_key(prefix, &a.key.domain, &a.key.id));
            call.arg(&**holder)
                .arg(a.limit.limit)
                .arg(lease.lease_ms)
                .arg(lease.skew_ms)
                .arg(linger)
                .arg(ttl);
            call.arg(a.holding.enforcing).arg(a.holding.admitted).arg(a.holding.demand);
            call
        })
        .collect();
    let answers = store.store.scripts(&calls, store.timeout).await?;
    answers
        .into_iter()
        .map(|answer| match redis::from_redis_value::<Vec<u64>>(answer) {
            Ok(answer) if answer.len() == 2 => Ok(answer[1]),
            other => Err(StoreError {
                kind: FailureKind::ScriptError,
                message: format!("the quota script answered {other:?}"),
            }),
        })
        .collect()
}
